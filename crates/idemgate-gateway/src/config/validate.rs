//! [`Config::validate`]: everything serde could not check, every problem
//! collected at once (see the module docs of [`crate::config`]), and
//! [`Config::warnings`] for what is allowed but risky.
//!
//! Each section checks its own keys (`server.rs`, `store.rs`, …); here is
//! the entry that runs them in turn, and the rules no one section can
//! judge because they compare keys: the listeners with each other and the
//! admin token, the budgets with the body limits, the lease with the store
//! timeout, routes with routes, consumers with routes and with each other,
//! record identities, and the durations that together let a request run
//! twice. Then the plan is loaded, so that what start-up uses is what was
//! checked.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use super::*;

impl Config {
    /// Checks everything serde could not, collecting every problem, and
    /// loads what the configuration names (certificates, keys, the JWKS
    /// file): the [`Plan`] start-up assembles from. Secrets are trimmed
    /// first, so every check judges what will be used.
    pub fn validate(&self, origin: &str) -> Result<Plan, ConfigError> {
        self.clone().with_secrets_trimmed().validate_trimmed(origin)
    }

    fn validate_trimmed(self, origin: &str) -> Result<Plan, ConfigError> {
        let mut problems = Vec::new();
        let mut add = |key: String, reason: String| problems.push(ConfigProblem { key, reason });
        self.collect_problems(&mut add);
        // Read once, here: what start-up uses is what was checked.
        let loaded = super::plan::load(&self, &mut add);

        // A part that cannot be built is often a value checked above as
        // well: each problem once.
        let mut seen = BTreeSet::new();
        problems.retain(|p| seen.insert((p.key.clone(), p.reason.clone())));
        match loaded {
            Some(loaded) if problems.is_empty() => Ok(loaded.into_plan(self)),
            _ => Err(ConfigError::Invalid {
                origin: origin.to_owned(),
                problems,
            }),
        }
    }

    /// Every check but loading: each section's own keys, then the rules
    /// between keys, in the file's order as far as they allow.
    fn collect_problems(&self, add: &mut dyn FnMut(String, String)) {
        self.server.check(add);
        self.check_listeners(add);
        self.telemetry.check(add);
        self.store.check(add);
        self.tokens.check(add);
        self.check_budgets(add);
        self.check_store_timeout(add);
        self.identity.check(add);
        let upstream_names = super::upstreams::check_all(&self.upstreams, add);
        let route_names = super::routes::check_all(&self.routes, &upstream_names, add);
        self.check_route_overlap(add);
        super::consumer::check_all(&self.consumers, &upstream_names, add);
        self.check_consumer_names(&route_names, add);
        self.check_record_ids(add);
        self.check_consumer_queues(add);
        self.check_timing(add);
    }

    /// The two listeners: apart, and the admin one either private or
    /// behind a token.
    fn check_listeners(&self, add: &mut dyn FnMut(String, String)) {
        let server = &self.server;
        if server.listen == server.admin_listen && !server.listen.ends_with(":0") {
            add(
                "server.admin_listen".into(),
                "must differ from server.listen: the admin endpoints must not be public".into(),
            );
        }
        // The admin API can purge records and reconcile uncertain ones:
        // anyone who reaches it must say who they are.
        let has_token = !server.admin_token.is_empty() || server.admin_token_file.is_some();
        if let Ok(addr) = server.admin_listen.parse::<SocketAddr>()
            && !addr.ip().is_loopback()
            && !has_token
        {
            add(
                "server.admin_token".into(),
                format!(
                    "server.admin_listen = {:?} is reachable from other hosts, and the admin API \
                     can purge records: set server.admin_token (or admin_token_file, or \
                     IDEMGATE_ADMIN_TOKEN), or listen on a loopback address",
                    server.admin_listen
                ),
            );
        }
    }

    /// The process-wide budgets hold at least one largest body and answer.
    fn check_budgets(&self, add: &mut dyn FnMut(String, String)) {
        let server = &self.server;
        if server.max_buffered_bytes < server.max_body_bytes {
            add(
                "server.max_buffered_bytes".into(),
                format!(
                    "{} is below server.max_body_bytes ({}): a largest body could never be buffered",
                    server.max_buffered_bytes, server.max_body_bytes
                ),
            );
        }
        if server.max_captured_bytes < self.store.max_stored_body_bytes as u64 {
            add(
                "server.max_captured_bytes".into(),
                format!(
                    "{} is below store.max_stored_body_bytes ({}): every largest answer would pass the budget",
                    server.max_captured_bytes, self.store.max_stored_body_bytes
                ),
            );
        }
    }

    /// `store.lease` and `store.fast_layer_budget` against `store.timeout`,
    /// the bound on one store operation.
    fn check_store_timeout(&self, add: &mut dyn FnMut(String, String)) {
        let store = &self.store;
        let Some(timeout) = store.timeout.valid() else {
            return;
        };
        // holder.rs `renew`: the lease is renewed every third of its length,
        // and a renewal is a store operation bounded by store.timeout.
        if let Some(lease) = store.lease.valid()
            && lease < timeout * 2
        {
            add(
                "store.lease".into(),
                format!(
                    "{:?} is shorter than twice store.timeout ({:?}): while a request runs, its \
                     claim's lease is renewed every third of the lease (here every {}ms) and one \
                     renewal may take up to store.timeout, so a slow renewal can land after the \
                     lease has ended; another gateway then takes the claim over and executes the \
                     request a second time while the first is still running. Set lease to at \
                     least {} or lower store.timeout",
                    store.lease.raw(),
                    store.timeout.raw(),
                    (lease / 3).as_millis(),
                    humantime::format_duration(timeout * 2)
                ),
            );
        }
        if let Some(budget) = store.fast_layer_budget.valid()
            && budget > timeout
        {
            add(
                "store.fast_layer_budget".into(),
                format!(
                    "{:?} is longer than store.timeout ({:?}): the fast layer only spares SQL the \
                     duplicates, and a fast-layer call slower than the budget is abandoned for \
                     SQL, so a budget above the bound on a SQL operation would let a slow fast \
                     layer delay every request longer than the store operation it is meant to \
                     speed up; keep it at most store.timeout (typically far below, the default \
                     is {})",
                    store.fast_layer_budget.raw(),
                    store.timeout.raw(),
                    fmt(idemgate_store::DEFAULT_FAST_LAYER_BUDGET)
                ),
            );
        }
    }

    /// No two routes share a request.
    fn check_route_overlap(&self, add: &mut dyn FnMut(String, String)) {
        // A route whose paths are wrong is refused as such.
        let matchers: Vec<(usize, RouteMatcher)> = self
            .routes
            .iter()
            .enumerate()
            .filter_map(|(i, r)| Some((i, r.matcher().ok()?)))
            .collect();
        for (a, (i, m)) in matchers.iter().enumerate() {
            for (j, other) in matchers.iter().skip(a + 1) {
                if m.overlaps(other) {
                    add(
                        format!("routes[{j}]"),
                        format!(
                            "route {:?} overlaps route {:?} ({} and {} share requests); routes must not overlap",
                            self.routes[*j].name,
                            self.routes[*i].name,
                            other.describe(),
                            m.describe()
                        ),
                    );
                }
            }
        }
    }

    /// A consumer's name is no route's (nor `token`'s).
    fn check_consumer_names(
        &self,
        route_names: &BTreeSet<&str>,
        add: &mut dyn FnMut(String, String),
    ) {
        let mut seen = BTreeSet::new();
        for (i, c) in self.consumers.iter().enumerate() {
            // An empty or repeated name is refused as such, once.
            if c.name.is_empty() || !seen.insert(c.name.as_str()) {
                continue;
            }
            if route_names.contains(c.name.as_str()) || c.name == "token" {
                // A consumer's records are kept under its name as their
                // route: sharing a route's name would share its records.
                add(
                    format!("consumers[{i}].name"),
                    format!(
                        "{:?} is also a route's name; records are kept by name",
                        c.name
                    ),
                );
            }
        }
    }

    /// Two entries on one queue would keep one message under two records
    /// (the consumer's name scopes them): executed twice.
    fn check_consumer_queues(&self, add: &mut dyn FnMut(String, String)) {
        let mut reads = BTreeMap::new();
        for (i, c) in self.consumers.iter().enumerate() {
            if let Some(first) = reads.insert(c.reads(), i) {
                add(
                    format!("consumers[{i}]"),
                    format!(
                        "reads the same queue or durable as consumers[{first}]; one message would be \
                         kept under two records and executed twice"
                    ),
                );
            }
        }
    }

    /// Each route's and consumer's record identity (`id`, default its
    /// name): one each, so that two never share records, and a plain
    /// label (no `/`: the token records' own namespace is `/token`).
    fn check_record_ids(&self, add: &mut dyn FnMut(String, String)) {
        let mut seen: BTreeMap<&str, (String, bool)> = BTreeMap::new();
        let entries = self
            .routes
            .iter()
            .enumerate()
            .map(|(i, r)| (format!("routes[{i}]"), r.id.is_some(), r.record_id()))
            .chain(
                self.consumers
                    .iter()
                    .enumerate()
                    .map(|(i, c)| (format!("consumers[{i}]"), c.id.is_some(), c.record_id())),
            );
        for (who, explicit, id) in entries {
            let key = if explicit {
                format!("{who}.id")
            } else {
                format!("{who}.name")
            };
            if explicit && id.trim().is_empty() {
                add(key, "must not be empty".into());
                continue;
            }
            if id.contains('/') || id.chars().any(char::is_control) || id.len() > 255 {
                add(
                    key,
                    format!(
                        "{id:?}: a record identity is at most 255 bytes, without '/' or control \
                         characters"
                    ),
                );
                continue;
            }
            // Two names alike are refused by name already.
            if let Some((first, first_explicit)) = seen.insert(id, (who.clone(), explicit))
                && (explicit || first_explicit)
            {
                add(
                    key,
                    format!(
                        "{id:?} is also the record identity of {first}: the two would share \
                         records (one request's answer replayed for the other's)"
                    ),
                );
            }
        }
    }

    /// Durations that are each fine but together let a request execute
    /// twice; every problem names both keys.
    ///
    /// - `store.lease` against the longest upstream timeout of a protected
    ///   route or consumer, plus `store.timeout`: a claim's first lease must
    ///   outlast its copy at the upstream and the write of its outcome. A
    ///   lease renewed while the database is away does not grow, so during
    ///   an outage longer than the lease another instance would take the
    ///   claim over and forward beside a copy still running.
    /// - `store.retention` against that timeout plus the lease (a record
    ///   must outlive its own claim), against `tokens.ttl` (a token still
    ///   valid after its record expired would execute again), and against
    ///   each signature `tolerance` (a signed delivery still accepted after
    ///   its record expired would too).
    fn check_timing(&self, add: &mut dyn FnMut(String, String)) {
        let (Some(lease), Some(retention), Some(store_timeout)) = (
            self.store.lease.valid(),
            self.store.retention.valid(),
            self.store.timeout.valid(),
        ) else {
            return;
        };
        if let Some((timeout, who, j)) = self.longest_claimed_upstream() {
            let needed = timeout + store_timeout;
            if lease < needed {
                add(
                    "store.lease".into(),
                    format!(
                        "{:?} is shorter than upstreams[{j}].timeout ({}) of {who} plus \
                         store.timeout ({}): a claim's lease must outlast its copy at the upstream \
                         and the write of its outcome, or during a database outage longer than the \
                         lease another instance takes the claim over and forwards the request beside \
                         a copy that may still be running; set store.lease to at least {}",
                        self.store.lease.raw(),
                        fmt(timeout),
                        fmt(store_timeout),
                        fmt(needed)
                    ),
                );
            }
            if retention < timeout + lease {
                add(
                    "store.retention".into(),
                    format!(
                        "{:?} is shorter than upstreams[{j}].timeout ({}) of {who} plus store.lease \
                         ({}): a record could expire while its own claim is still running, and a retry \
                         would then execute again; set store.retention to at least {}",
                        self.store.retention.raw(),
                        fmt(timeout),
                        fmt(lease),
                        fmt(timeout + lease)
                    ),
                );
            }
        }
        self.check_retention_outlives_keys(retention, add);
    }

    /// The longest upstream timeout a claim can wait on (a protected
    /// route's or a consumer's upstream): the timeout, who waits on it,
    /// and the upstream's index.
    fn longest_claimed_upstream(&self) -> Option<(Duration, String, usize)> {
        let protected = self
            .routes
            .iter()
            .enumerate()
            .filter(|(_, r)| r.is_protected())
            .map(|(i, r)| (format!("routes[{i}] ({:?})", r.name), &r.upstream));
        let consumers = self
            .consumers
            .iter()
            .enumerate()
            .map(|(i, c)| (format!("consumers[{i}] ({:?})", c.name), &c.upstream));
        protected
            .chain(consumers)
            .filter_map(|(who, upstream)| {
                let (j, u) = self
                    .upstreams
                    .iter()
                    .enumerate()
                    .find(|(_, u)| &u.name == upstream)?;
                Some((u.timeout.valid()?, who, j))
            })
            .max_by_key(|(timeout, ..)| *timeout)
    }

    /// `store.retention` against what can still present a key after it:
    /// a token within `tokens.ttl`, a signed delivery within its
    /// signature's `tolerance`.
    fn check_retention_outlives_keys(
        &self,
        retention: Duration,
        add: &mut dyn FnMut(String, String),
    ) {
        let token_routes = self
            .routes
            .iter()
            .any(|r| r.kind == RouteKind::Sync && r.idempotency() == IdempotencyMode::Token);
        if token_routes
            && let Some(ttl) = self.tokens.ttl.valid()
            && retention < ttl
        {
            add(
                "store.retention".into(),
                format!(
                    "{:?} is shorter than tokens.ttl ({:?}): a token used early in its life would \
                     still be valid after its record expired, and the same one-time token would \
                     execute a second time; set store.retention to at least tokens.ttl",
                    self.store.retention.raw(),
                    self.tokens.ttl.raw()
                ),
            );
        }
        for (i, r) in self.routes.iter().enumerate() {
            let Some(sig) = &r.signature else { continue };
            if !sig.scheme.is_timestamped() {
                continue;
            }
            if let Some(tolerance) = sig.tolerance.valid()
                && retention < tolerance
            {
                add(
                    "store.retention".into(),
                    format!(
                        "{:?} is shorter than routes[{i}].signature.tolerance ({:?}): a captured \
                         delivery replayed after its record expired would still pass the signature \
                         check and execute again; set store.retention to at least the tolerance",
                        self.store.retention.raw(),
                        sig.tolerance.raw()
                    ),
                );
            }
        }
    }

    /// What a valid configuration still risks, for `check-config` to print:
    /// each callback route signed with `hmac-sha256` (no timestamp, so a
    /// captured delivery never goes stale).
    pub fn warnings(&self) -> Vec<ConfigProblem> {
        let mut warnings = Vec::new();
        // A scope made of a rotating credential's bytes: each route whose
        // records are the client's says so (callbacks are the sender's).
        let advice = match (
            &self.identity.jwt,
            self.identity.header.parse::<http::HeaderName>(),
        ) {
            (None, Ok(name)) => {
                idemgate_core::identity::Identity::header(name).rotating_credential()
            }
            _ => None,
        };
        if let Some(advice) = advice {
            for (i, r) in self.routes.iter().enumerate() {
                if r.kind == RouteKind::Sync && r.idempotency() != IdempotencyMode::None {
                    warnings.push(ConfigProblem {
                        key: format!("routes[{i}] (identity.header)"),
                        reason: format!("route {:?} scopes its records by {advice}", r.name),
                    });
                }
            }
        }
        // A hold shorter than the upstream's timeout lets a retry of an
        // uncertain request be forwarded while the first copy may still be
        // running there: safe only if the upstream stops its own work then.
        for (i, u) in self.upstreams.iter().enumerate() {
            if u.uncertain_hold() < u.timeout.get() {
                warnings.push(ConfigProblem {
                    key: format!("upstreams[{i}].uncertain_hold"),
                    reason: format!(
                        "upstream {:?} holds an uncertain key {} but may run a request for {}                          (timeout): a retry can then be forwarded beside a copy still running                          there, unless the upstream cancels its work when the gateway gives up;                          leave it unset (the timeout) otherwise",
                        u.name,
                        fmt(u.uncertain_hold()),
                        fmt(u.timeout.get())
                    ),
                });
            }
        }
        for (i, r) in self.routes.iter().enumerate() {
            let scheme = r.signature.as_ref().map(|s| s.scheme);
            if r.kind == RouteKind::Callback && scheme == Some(SignatureScheme::HmacSha256) {
                warnings.push(ConfigProblem {
                    key: format!("routes[{i}].signature.scheme"),
                    reason: format!(
                        "route {:?} uses hmac-sha256, which signs the body without a timestamp: \
                         a captured delivery replayed after its record's retention \
                         (store.retention = {:?}) is treated as a new delivery and forwarded \
                         again; prefer standard-webhooks or stripe if the sender supports them",
                        r.name,
                        self.store.retention.raw()
                    ),
                });
            }
        }
        warnings
    }
}

/// A duration as the messages print it.
fn fmt(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::testing::{
        MINIMAL, SIGNATURES, callback_route, problems_of, reasons_for, timed,
    };

    #[test]
    fn every_problem_is_reported_at_once() {
        let text = r#"
            [store]
            retention = "forever"
            lease = "0s"

            [[upstreams]]
            name = "orders"
            url = "ftp://orders.internal"

            [[upstreams]]
            name = "orders"
            url = "http://127.0.0.1:9001/api"

            [[routes]]
            name = "a"
            path = "/orders"
            upstream = "nowhere"

            [[routes]]
            name = "a"
            path_prefix = "/ord"
            upstream = "orders"

            [[routes]]
            name = "cb"
            kind = "callback"
            idempotency = "token"
            path = "/callbacks/pay"
            upstream = "orders"
            business_key = ["json:/trade_no"]
        "#;
        let c = Config::parse(text, "t").unwrap();
        let err = c.validate("t").unwrap_err();
        let keys: Vec<_> = err.problems().iter().map(|p| p.key.as_str()).collect();
        for expected in [
            "store.retention",
            "store.lease",
            "upstreams[0].url",
            "upstreams[1].name",
            "upstreams[1].url",
            "routes[0].upstream",
            "routes[1].name",
            "routes[1]",
            "routes[2].idempotency",
        ] {
            assert!(keys.contains(&expected), "missing {expected} in {err}");
        }
        let text = err.to_string();
        assert!(text.contains("overlaps"), "{text}");
        assert!(text.contains("never carry"), "{text}");
    }

    #[test]
    fn disjoint_methods_do_not_overlap() {
        let text = r#"
            [[upstreams]]
            name = "o"
            url = "http://127.0.0.1:9001"
            [[routes]]
            name = "create"
            methods = ["POST"]
            path = "/orders"
            upstream = "o"
            [[routes]]
            name = "read"
            methods = ["GET"]
            path_prefix = "/orders"
            upstream = "o"
        "#;
        Config::parse(text, "t").unwrap().validate("t").unwrap();
    }

    /// [`MINIMAL`] with these `[store]` lines.
    fn with_store(lines: &str) -> String {
        format!("[store]\n{lines}\n{MINIMAL}")
    }

    #[test]
    fn a_lease_shorter_than_twice_the_store_timeout_is_refused() {
        let problems = problems_of(&with_store("lease = \"3s\"\ntimeout = \"2s\""));
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert_eq!(problems[0].key, "store.lease");
        let reason = &problems[0].reason;
        for expected in [
            "\"3s\"",
            "\"2s\"",
            "twice store.timeout",
            "every third of the lease",
            "every 1000ms",
            "a second time",
            "at least 4s",
        ] {
            assert!(
                reason.contains(expected),
                "missing {expected:?} in {reason}"
            );
        }
        // Exactly twice is enough, and so are the defaults (30s, 2s).
        for lines in [
            "lease = \"4s\"\ntimeout = \"2s\"",
            "lease = \"1s\"\ntimeout = \"500ms\"",
            "",
        ] {
            let problems = problems_of(&with_store(lines));
            assert!(problems.is_empty(), "{lines:?}: {problems:?}");
        }
        // The default store.timeout (2s) counts too.
        let problems = problems_of(&with_store("lease = \"1s\""));
        let reasons = reasons_for(&problems, "store.lease");
        assert_eq!(reasons.len(), 1, "{problems:?}");
    }

    #[test]
    fn a_fast_layer_budget_above_the_store_timeout_is_refused() {
        let problems = problems_of(&with_store("fast_layer_budget = \"3s\"\ntimeout = \"2s\""));
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert_eq!(problems[0].key, "store.fast_layer_budget");
        assert!(
            problems[0].reason.contains("\"3s\"") && problems[0].reason.contains("store.timeout"),
            "{}",
            problems[0].reason
        );
        let equal = with_store("fast_layer_budget = \"2s\"\ntimeout = \"2s\"");
        assert!(problems_of(&equal).is_empty(), "{:?}", problems_of(&equal));
    }

    #[test]
    fn hmac_sha256_callback_routes_are_warned_about() {
        for (scheme, signature) in SIGNATURES {
            let c = Config::parse(&callback_route(r#"["json:/id"]"#, signature), "t").unwrap();
            c.validate("t").unwrap();
            let warnings = c.warnings();
            if *scheme == "hmac-sha256" {
                assert_eq!(warnings.len(), 1, "{warnings:?}");
                assert_eq!(warnings[0].key, "routes[0].signature.scheme");
                for expected in [
                    "\"hook\"",
                    "hmac-sha256",
                    "timestamp",
                    "retention",
                    "\"24h\"",
                ] {
                    assert!(
                        warnings[0].reason.contains(expected),
                        "missing {expected:?} in {}",
                        warnings[0].reason
                    );
                }
            } else {
                assert!(warnings.is_empty(), "{scheme}: {warnings:?}");
            }
        }
        assert!(Config::parse(MINIMAL, "t").unwrap().warnings().is_empty());
    }

    #[test]
    fn a_lease_that_ends_before_its_copy_at_the_upstream_is_refused() {
        // 20 s upstream + 2 s store timeout > the 10 s lease.
        let problems = problems_of(&timed(r#"lease = "10s""#, "20s", ""));
        let reasons = reasons_for(&problems, "store.lease");
        assert_eq!(reasons.len(), 1, "{problems:?}");
        for named in ["upstreams[0].timeout", "store.timeout", "routes[0]", "22s"] {
            assert!(
                reasons[0].contains(named),
                "missing {named} in {}",
                reasons[0]
            );
        }
        assert!(problems_of(&timed(r#"lease = "22s""#, "20s", "")).is_empty());
        // A pass-through route over a slow upstream claims nothing.
        let text = timed(r#"lease = "10s""#, "20s", "").replace(r#"idempotency = "token""#, "");
        assert!(problems_of(&text).is_empty());
    }

    #[test]
    fn a_retention_shorter_than_what_can_still_use_a_key_is_refused() {
        let problems = problems_of(&timed(r#"retention = "5m""#, "10s", ""));
        let reasons = reasons_for(&problems, "store.retention");
        assert_eq!(reasons.len(), 1, "{problems:?}");
        assert!(reasons[0].contains("tokens.ttl"), "{}", reasons[0]);
        // Shorter than the upstream timeout plus the lease.
        let problems = problems_of(&timed(r#"retention = "30s""#, "10s", "").replace("10m", "10s"));
        let reasons = reasons_for(&problems, "store.retention");
        assert!(
            reasons
                .iter()
                .any(|r| r.contains("store.lease") && r.contains("upstreams[0].timeout")),
            "{problems:?}"
        );
        // Shorter than a signature tolerance.
        let text = r#"
            [store]
            retention = "2m"
            [[upstreams]]
            name = "orders"
            url = "http://127.0.0.1:9001"
            [[routes]]
            name = "hook"
            kind = "callback"
            path = "/hook"
            upstream = "orders"
            business_key = ["json:/id"]
            [routes.signature]
            scheme = "stripe"
            secrets = ["whsec_x"]
            tolerance = "5m"
            "#;
        let problems = problems_of(text);
        let reasons = reasons_for(&problems, "store.retention");
        assert!(
            reasons
                .iter()
                .any(|r| r.contains("routes[0].signature.tolerance")),
            "{problems:?}"
        );
    }

    #[test]
    fn a_scope_made_of_a_rotating_credential_is_warned_about_per_route() {
        let routes = timed("", "10s", "");
        let warnings = Config::parse(&routes, "t").unwrap().warnings();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].reason.contains("X-User-Id"), "{warnings:?}");
        for identity in [
            "[identity]\nheader = \"X-User-Id\"",
            "[identity]\nheader = \"Cookie\"",
        ] {
            let text = format!("{identity}\n{routes}");
            let warnings = Config::parse(&text, "t").unwrap().warnings();
            assert_eq!(
                warnings.len(),
                usize::from(identity.contains("Cookie")),
                "{identity}"
            );
        }
    }
}
