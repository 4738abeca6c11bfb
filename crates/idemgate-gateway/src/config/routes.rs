//! `[[routes]]` and `[routes.signature]`: which requests go where, under
//! which policy — the schema, the defaults, what a route's own keys must
//! satisfy (its paths, its methods, its policy against its kind, its
//! reconcile path), and what its matcher and signature verifier are built
//! from. What compares two routes (overlap, record identities) or a route
//! with other sections (retention, consumer names) is in `validate.rs`.

use std::collections::BTreeSet;
use std::fmt;

use idemgate::callback::SignatureScheme;
use idemgate::idempotency::OnConcurrent;
use serde::Deserialize;

use super::{HumanDuration, RESERVED_PATHS};
use crate::router::RouteMatcher;

/// `[[routes]]`: which requests go where, under which policy.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Unique; names the route in metrics and logs, and scopes its records
    /// unless `id` is set.
    pub name: String,
    /// The identity its records (and the tokens bound to it) are kept
    /// under; default: `name`. Keep it to rename a route without losing
    /// its live and retained records.
    pub id: Option<String>,
    /// Empty means every method.
    #[serde(default)]
    pub methods: Vec<String>,
    /// An exact path (set this or `path_prefix`, not both).
    pub path: Option<String>,
    /// A path prefix, starting with `/` (set this or `path`, not both).
    pub path_prefix: Option<String>,
    /// The name of the `[[upstreams]]` entry it forwards to.
    pub upstream: String,
    /// `sync` (the default) or `callback`.
    #[serde(default)]
    pub kind: RouteKind,
    /// Absent means `none` on sync routes; callback routes must leave it out.
    pub idempotency: Option<IdempotencyMode>,
    /// Key routes: a missing `Idempotency-Key` is `400` (default `true`);
    /// with `false` such a request is forwarded unprotected.
    #[serde(default = "default_require_key")]
    pub require_key: bool,
    /// A duplicate while the first request runs: `reject` (`409`, the
    /// default) or `wait` for the first outcome.
    #[serde(default)]
    pub on_concurrent: OnConcurrent,
    /// Callback routes, required: sources of the key (`json:/pointer`,
    /// `header:Name`, `query:name`); several form a composite key.
    #[serde(default)]
    pub business_key: Vec<String>,
    /// Callback routes: fields a redelivery with the same business key must
    /// repeat (same sources as `business_key`), else `422`.
    #[serde(default)]
    pub must_match: Vec<String>,
    /// Callback routes: verify the sender's signature first.
    pub signature: Option<SignatureConfig>,
    /// A status endpoint on the upstream (`{key}` = the stable key), asked
    /// before an uncertain request is forwarded again.
    pub reconcile_path: Option<String>,
}

/// `[routes.signature]`: how a callback's sender signs it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignatureConfig {
    /// `standard-webhooks`, `stripe` or `hmac-sha256`.
    pub scheme: SignatureScheme,
    /// Secrets tried in turn (rotation).
    #[serde(default)]
    pub secrets: Vec<String>,
    /// An environment variable with more secrets, comma-separated.
    pub secrets_env: Option<String>,
    /// `hmac-sha256`: the header carrying the hex signature.
    pub header: Option<String>,
    /// Timestamped schemes: how far the timestamp may be from now.
    #[serde(default = "default_signature_tolerance")]
    pub tolerance: HumanDuration,
}

/// `kind`: how a route's callers behave.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RouteKind {
    /// A client waits for the answer; `idempotency` picks its policy.
    #[default]
    Sync,
    /// A sender's redeliveries (webhooks, pushed messages), made one by
    /// their `business_key`; records belong to the route.
    Callback,
}

/// `idempotency`: the policy of a sync route.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IdempotencyMode {
    /// Pass-through, streamed; nothing is recorded.
    #[default]
    None,
    /// Protected by the client's `Idempotency-Key`.
    Key,
    /// Protected by a one-time token from `/token`.
    Token,
}

impl fmt::Display for RouteKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RouteKind::Sync => "sync",
            RouteKind::Callback => "callback",
        })
    }
}

impl fmt::Display for IdempotencyMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            IdempotencyMode::None => "none",
            IdempotencyMode::Key => "key",
            IdempotencyMode::Token => "token",
        })
    }
}

/// A key route refuses a request without `Idempotency-Key` unless told.
fn default_require_key() -> bool {
    true
}
/// The library's tolerance (Stripe's): a route behind the gateway accepts
/// what the same route in a service would.
fn default_signature_tolerance() -> HumanDuration {
    idemgate::DEFAULT_SIGNATURE_TOLERANCE.into()
}

impl RouteConfig {
    /// The identity its records are kept under: `id`, or the name.
    pub fn record_id(&self) -> &str {
        self.id.as_deref().unwrap_or(&self.name)
    }

    /// The policy this route runs under.
    pub fn idempotency(&self) -> IdempotencyMode {
        self.idempotency.unwrap_or_default()
    }

    /// Whether requests on it are claimed (key, token or callback).
    pub fn is_protected(&self) -> bool {
        self.kind == RouteKind::Callback || self.idempotency() != IdempotencyMode::None
    }

    /// The route's matcher, or why its paths are wrong.
    pub fn matcher(&self) -> Result<RouteMatcher, String> {
        RouteMatcher::new(
            &self.methods,
            self.path.as_deref(),
            self.path_prefix.as_deref(),
        )
    }
}

impl SignatureConfig {
    /// What the callback layer builds its verifier from.
    pub fn spec(&self) -> idemgate::callback::SignatureSpec<'_> {
        idemgate::callback::SignatureSpec {
            scheme: self.scheme,
            secrets: &self.secrets,
            secrets_env: self.secrets_env.as_deref(),
            header: self.header.as_deref(),
            tolerance: self.tolerance.get(),
        }
    }
}

// === checks ===

/// Checks every `[[routes]]` entry on its own, and that each has a name of
/// its own; the names, for what must not share them.
pub(super) fn check_all<'a>(
    routes: &'a [RouteConfig],
    upstreams: &BTreeSet<&str>,
    add: &mut dyn FnMut(String, String),
) -> BTreeSet<&'a str> {
    let mut names = BTreeSet::new();
    for (i, r) in routes.iter().enumerate() {
        let key = |field: &str| format!("routes[{i}].{field}");
        if r.name.is_empty() {
            add(key("name"), "must not be empty".into());
        } else if !names.insert(r.name.as_str()) {
            add(key("name"), format!("duplicate route name {:?}", r.name));
        }
        r.check(&key, upstreams, add);
    }
    names
}

impl RouteConfig {
    /// Checks one entry; `key` names its fields.
    fn check(
        &self,
        key: &dyn Fn(&str) -> String,
        upstreams: &BTreeSet<&str>,
        add: &mut dyn FnMut(String, String),
    ) {
        if !upstreams.contains(self.upstream.as_str()) {
            let known: Vec<_> = upstreams.iter().copied().collect();
            add(
                key("upstream"),
                format!(
                    "unknown upstream {:?} (known: {})",
                    self.upstream,
                    if known.is_empty() {
                        "none".to_owned()
                    } else {
                        known.join(", ")
                    }
                ),
            );
        }
        for m in &self.methods {
            if m.parse::<http::Method>().is_err() || m.chars().any(|c| c.is_ascii_lowercase()) {
                add(
                    key("methods"),
                    format!("{m:?} is not an upper-case HTTP method"),
                );
            }
        }
        match self.matcher() {
            Ok(m) => {
                if let Some(reserved) = m.reserved_overlap(RESERVED_PATHS) {
                    add(
                        key("path"),
                        format!(
                            "{reserved} is answered by the gateway itself and cannot be routed"
                        ),
                    );
                }
            }
            Err(reason) => add(key("path"), reason),
        }
        self.validate_policy(key, add);
        if let Some(path) = &self.reconcile_path
            && let Err(reason) = check_reconcile_path(self, path)
        {
            add(key("reconcile_path"), reason);
        }
    }

    /// The policy keys against the route's kind.
    fn validate_policy(&self, key: &dyn Fn(&str) -> String, add: &mut dyn FnMut(String, String)) {
        match self.kind {
            RouteKind::Sync => self.check_sync_policy(key, add),
            RouteKind::Callback => {
                self.check_callback_policy(key, add);
                if let Some(sig) = &self.signature {
                    check_signature(sig, key, add);
                }
            }
        }
    }

    /// A sync route takes none of a callback's keys.
    fn check_sync_policy(&self, key: &dyn Fn(&str) -> String, add: &mut dyn FnMut(String, String)) {
        if !self.business_key.is_empty() {
            add(
                key("business_key"),
                "only callback routes take a business key (set kind = \"callback\")".into(),
            );
        }
        if self.signature.is_some() {
            add(
                key("signature"),
                "only callback routes verify signatures (set kind = \"callback\")".into(),
            );
        }
        if !self.must_match.is_empty() {
            add(
                key("must_match"),
                "only callback routes are identified by a business key (set kind = \"callback\")"
                    .into(),
            );
        }
    }

    /// A callback route dedupes on its business key, never on a client's
    /// key or token.
    fn check_callback_policy(
        &self,
        key: &dyn Fn(&str) -> String,
        add: &mut dyn FnMut(String, String),
    ) {
        match self.idempotency {
            Some(IdempotencyMode::Token) => add(
                key("idempotency"),
                format!(
                    "route {:?} is a callback route and cannot use idempotency = \"token\": \
                     asynchronous callers (payment providers, message queues, jobs) never carry \
                     a client token, so a token check would either reject every legitimate \
                     redelivery or protect nothing; dedupe on the business key instead \
                     (business_key = [\"json:/trade_no\"])",
                    self.name
                ),
            ),
            Some(IdempotencyMode::Key) => add(
                key("idempotency"),
                "callback routes dedupe on their business_key; to use the caller's \
                 Idempotency-Key header, write business_key = [\"header:Idempotency-Key\"]"
                    .into(),
            ),
            Some(IdempotencyMode::None) | None => {}
        }
        if self.business_key.is_empty() {
            add(
                key("business_key"),
                "a callback route needs at least one source (json:/pointer, header:Name or query:name)"
                    .into(),
            );
        }
        self.check_business_key_sources(key, add);
        for source in &self.must_match {
            if let Err(reason) = idemgate::callback::KeySource::parse(source) {
                add(key("must_match"), reason);
            }
        }
    }

    /// Each business-key source parses, and a signed route reads its key
    /// from what the sender signs.
    fn check_business_key_sources(
        &self,
        key: &dyn Fn(&str) -> String,
        add: &mut dyn FnMut(String, String),
    ) {
        for source in &self.business_key {
            if let Err(reason) = idemgate::callback::KeySource::parse(source) {
                add(key("business_key"), reason);
                continue;
            }
            // Every scheme signs the body only (docs/semantics.md, "Callback routes";
            // callback routes): a key read elsewhere is not covered.
            let unsigned = if source.starts_with("header:") {
                Some("header")
            } else if source.starts_with("query:") {
                Some("query parameter")
            } else {
                None
            };
            if let (Some(sig), Some(place)) = (&self.signature, unsigned) {
                add(
                    key("business_key"),
                    format!(
                        "route {:?} verifies a {} signature, which covers the body only, \
                         but its business key source {source:?} is a {place} the sender \
                         does not sign: a captured delivery replayed with a new {place} \
                         value would pass the signature check and count as a new key, so \
                         it would be executed again; take the key from the body \
                         (json:/pointer)",
                        self.name, sig.scheme
                    ),
                );
            }
        }
    }
}

/// `[routes.signature]`: secrets to sign with, the header `hmac-sha256`
/// reads, a usable tolerance.
fn check_signature(
    sig: &SignatureConfig,
    key: &dyn Fn(&str) -> String,
    add: &mut dyn FnMut(String, String),
) {
    if sig.secrets.iter().any(String::is_empty) {
        add(
            key("signature.secrets"),
            "a secret must not be empty (or blank): anyone could sign with it".into(),
        );
    }
    if sig.secrets.is_empty() && sig.secrets_env.is_none() {
        add(
            key("signature"),
            "set secrets = [\"…\"] or secrets_env = \"VAR\"".into(),
        );
    }
    if sig.scheme == SignatureScheme::HmacSha256 && sig.header.is_none() {
        add(
            key("signature.header"),
            "scheme = \"hmac-sha256\" needs the header that carries the signature".into(),
        );
    }
    if let Some(reason) = sig.tolerance.problem() {
        add(key("signature.tolerance"), reason);
    }
}

/// `reconcile_path`: a protected route's, a path with `{key}` once.
fn check_reconcile_path(r: &RouteConfig, path: &str) -> Result<(), String> {
    if !r.is_protected() {
        return Err(
            "only a protected route (idempotency = \"key\" or \"token\", or a callback) has \
             records to reconcile"
                .into(),
        );
    }
    let placeholder = crate::status_endpoint::KEY_PLACEHOLDER;
    if !path.starts_with('/') || path.matches(placeholder).count() != 1 {
        return Err(format!(
            "{path:?} must be a path with {placeholder} exactly once, e.g. \"/payments/by-key/{placeholder}\""
        ));
    }
    path.replace(placeholder, "ig-0")
        .parse::<http::uri::PathAndQuery>()
        .map(|_| ())
        .map_err(|e| format!("{path:?} is not a path: {e}"))
}

#[cfg(test)]
mod tests {
    use crate::config::Config;
    use crate::config::testing::{SIGNATURES, callback_route, problems_of, reasons_for, timed};

    #[test]
    fn reserved_token_path_cannot_be_routed() {
        let text = r#"
            [[upstreams]]
            name = "o"
            url = "http://127.0.0.1:9001"
            [[routes]]
            name = "all"
            path = "/token"
            upstream = "o"
        "#;
        let err = Config::parse(text, "t").unwrap().validate("t").unwrap_err();
        assert!(err.to_string().contains("/token"), "{err}");
    }

    #[test]
    fn a_signed_callback_route_refuses_header_and_query_key_sources() {
        for (scheme, signature) in SIGNATURES {
            let text = callback_route(r#"["header:X-Msg-Id", "query:id", "json:/id"]"#, signature);
            let problems = problems_of(&text);
            let reasons = reasons_for(&problems, "routes[0].business_key");
            assert_eq!(reasons.len(), 2, "{scheme}: {problems:?}");
            assert_eq!(problems.len(), 2, "{scheme}: {problems:?}");
            for (reason, source) in reasons.iter().zip(["header:X-Msg-Id", "query:id"]) {
                for expected in [source, "\"hook\"", *scheme, "body only", "new key"] {
                    assert!(
                        reason.contains(expected),
                        "{scheme}: missing {expected:?} in {reason}"
                    );
                }
                assert!(!reason.contains("json:/id"), "{reason}");
            }
        }
    }

    #[test]
    fn a_signed_callback_route_accepts_json_key_sources() {
        for (scheme, signature) in SIGNATURES {
            let text = callback_route(r#"["json:/id", "json:/type"]"#, signature);
            let problems = problems_of(&text);
            assert!(problems.is_empty(), "{scheme}: {problems:?}");
        }
    }

    #[test]
    fn an_unsigned_callback_route_still_accepts_header_and_query_sources() {
        let problems = problems_of(&callback_route(r#"["header:X-Msg-Id", "query:id"]"#, ""));
        assert!(problems.is_empty(), "{problems:?}");
    }

    #[test]
    fn reconcile_paths_and_tombstones_are_checked() {
        let ok = timed(
            r#"tombstone = "7d""#,
            "10s",
            r#"reconcile_path = "/pay/by-key/{key}""#,
        );
        assert!(problems_of(&ok).is_empty(), "{:?}", problems_of(&ok));
        for bad in ["/pay/by-key", "pay/{key}", "/a/{key}/{key}"] {
            let text = timed("", "10s", &format!("reconcile_path = {bad:?}"));
            assert_eq!(
                reasons_for(&problems_of(&text), "routes[0].reconcile_path").len(),
                1,
                "{bad}"
            );
        }
        let text = timed("", "10s", r#"reconcile_path = "/x/{key}""#)
            .replace(r#"idempotency = "token""#, "");
        assert_eq!(
            reasons_for(&problems_of(&text), "routes[0].reconcile_path").len(),
            1
        );
        let text = timed(r#"tombstone = "soon""#, "10s", "");
        assert_eq!(reasons_for(&problems_of(&text), "store.tombstone").len(), 1);
    }
}
