//! [`Config::validate`]: everything serde could not check, every problem
//! collected at once (see the module docs of [`crate::config`]), and
//! [`Config::warnings`] for what is allowed but risky.

use std::collections::BTreeSet;
use std::net::SocketAddr;

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
        let mut add = |key: String, reason: String| problems.push(Problem { key, reason });

        for (key, value) in [
            ("server.listen", &self.server.listen),
            ("server.admin_listen", &self.server.admin_listen),
        ] {
            if value.parse::<SocketAddr>().is_err() {
                add(
                    key.into(),
                    format!("{value:?} is not an address like \"127.0.0.1:8080\""),
                );
            }
        }
        if self.server.listen == self.server.admin_listen && !self.server.listen.ends_with(":0") {
            add(
                "server.admin_listen".into(),
                "must differ from server.listen: the admin endpoints must not be public".into(),
            );
        }
        // The admin API can purge records and reconcile uncertain ones:
        // anyone who reaches it must say who they are.
        let has_token =
            !self.server.admin_token.is_empty() || self.server.admin_token_file.is_some();
        if !self.server.admin_token.is_empty() && self.server.admin_token_file.is_some() {
            add(
                "server.admin_token_file".into(),
                "set server.admin_token or server.admin_token_file, not both".into(),
            );
        }
        if let Ok(addr) = self.server.admin_listen.parse::<SocketAddr>()
            && !addr.ip().is_loopback()
            && !has_token
        {
            add(
                "server.admin_token".into(),
                format!(
                    "server.admin_listen = {:?} is reachable from other hosts, and the admin API \
                     can purge records: set server.admin_token (or admin_token_file, or \
                     IDEMGATE_ADMIN_TOKEN), or listen on a loopback address",
                    self.server.admin_listen
                ),
            );
        }
        if let Some(endpoint) = &self.telemetry.otlp_endpoint {
            match url::Url::parse(endpoint) {
                Ok(url) if url.scheme() == "http" && url.host().is_some() => {}
                Ok(url) if url.scheme() == "https" => add(
                    "telemetry.otlp_endpoint".into(),
                    format!(
                        "{endpoint:?}: spans are exported in plain HTTP/2 or HTTP to a collector \
                         beside the gateway (an OpenTelemetry Collector or agent on the host or \
                         in the pod), which forwards them over TLS; https is not supported"
                    ),
                ),
                _ => add(
                    "telemetry.otlp_endpoint".into(),
                    format!("{endpoint:?} is not a URL like \"http://127.0.0.1:4317\""),
                ),
            }
        }
        if self.telemetry.service_name.trim().is_empty() {
            add("telemetry.service_name".into(), "must not be empty".into());
        }
        if self.server.max_body_bytes == 0 {
            add("server.max_body_bytes".into(), "must be above zero".into());
        }
        if self.server.max_connections == 0 {
            add("server.max_connections".into(), "must be above zero".into());
        }
        if self.server.max_buffered_bytes < self.server.max_body_bytes {
            add(
                "server.max_buffered_bytes".into(),
                format!(
                    "{} is below server.max_body_bytes ({}): a largest body could never be buffered",
                    self.server.max_buffered_bytes, self.server.max_body_bytes
                ),
            );
        }
        if self.server.max_captured_bytes < self.store.max_stored_body_bytes as u64 {
            add(
                "server.max_captured_bytes".into(),
                format!(
                    "{} is below store.max_stored_body_bytes ({}): every largest answer would pass the budget",
                    self.server.max_captured_bytes, self.store.max_stored_body_bytes
                ),
            );
        }
        if self.store.memory_layer_bytes == 0 {
            add(
                "store.memory_layer_bytes".into(),
                "must be above zero (the in-process fast layer needs room for its in-flight markers)"
                    .into(),
            );
        }
        // Every duration of the file, unparsable or zero refused: none of them
        // has a meaningful zero (a zero read timeout or store timeout fails
        // every request, a zero lease or retention protects nothing, a zero
        // sweep interval or budget spins, a zero shutdown grace drops every
        // in-flight request). `upstreams[].timeout` and
        // `routes[].signature.tolerance` are checked with their entries.
        for (key, d) in [
            (
                "server.header_read_timeout",
                &self.server.header_read_timeout,
            ),
            ("server.body_read_timeout", &self.server.body_read_timeout),
            ("server.shutdown_grace", &self.server.shutdown_grace),
            ("store.retention", &self.store.retention),
            ("store.lease", &self.store.lease),
            ("store.timeout", &self.store.timeout),
            ("store.sweep_interval", &self.store.sweep_interval),
            ("store.fast_layer_budget", &self.store.fast_layer_budget),
            ("tokens.ttl", &self.tokens.ttl),
        ] {
            if let Some(reason) = d.problem() {
                add(key.into(), reason);
            }
        }
        if let Some(reason) = self.store.tombstone.problem_unless_zero() {
            add("store.tombstone".into(), reason);
        }
        let lease = self.store.lease.valid();
        let store_timeout = self.store.timeout.valid();
        let budget = self.store.fast_layer_budget.valid();
        // holder.rs `renew`: the lease is renewed every third of its length,
        // and a renewal is a store operation bounded by store.timeout.
        if let (Some(lease), Some(timeout)) = (lease, store_timeout)
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
                    self.store.lease.raw,
                    self.store.timeout.raw,
                    (lease / 3).as_millis(),
                    humantime::format_duration(timeout * 2)
                ),
            );
        }
        if let (Some(budget), Some(timeout)) = (budget, store_timeout)
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
                    self.store.fast_layer_budget.raw,
                    self.store.timeout.raw,
                    DEFAULT_FAST_LAYER_BUDGET
                ),
            );
        }
        let db = &self.store.database_url;
        if idemgate_store::is_in_memory(db) {
            add(
                "store.database_url".into(),
                idemgate_store::in_memory_refusal("store.database_url", db),
            );
        }
        if !(db.starts_with("sqlite:")
            || db.starts_with("postgres://")
            || db.starts_with("postgresql://"))
        {
            add(
                "store.database_url".into(),
                format!("{db:?} must start with sqlite:, postgres:// or postgresql://"),
            );
        }
        let redis = &self.store.redis_url;
        let redis_ok = ["redis://", "rediss://", "redis+cluster://"]
            .iter()
            .any(|scheme| redis.starts_with(scheme));
        if !redis.is_empty() && !redis_ok {
            add(
                "store.redis_url".into(),
                format!(
                    "{redis:?} must be empty (in-process fast layer), redis://… or redis+cluster://…"
                ),
            );
        }
        if self.store.pool_size == 0 {
            add("store.pool_size".into(), "must be above zero".into());
        }
        if let Some(reason) = self
            .identity
            .jwt
            .as_ref()
            .and_then(|j| j.leeway.problem_unless_zero())
        {
            add("identity.jwt.leeway".into(), reason);
        }
        if let Some(jwt) = &self.identity.jwt {
            if jwt.issuer.is_some() && !jwt.issuers.is_empty() {
                add(
                    "identity.jwt.issuers".into(),
                    "set identity.jwt.issuer or identity.jwt.issuers, not both".into(),
                );
            }
            if jwt.issuer_list().iter().any(|i| i.trim().is_empty()) {
                add(
                    "identity.jwt.issuers".into(),
                    "an issuer must not be empty".into(),
                );
            }
        }

        if !self.tokens.secret.is_empty() && !self.tokens.secrets.is_empty() {
            add(
                "tokens.secrets".into(),
                "set tokens.secret or tokens.secrets, not both (IDEMGATE_TOKEN_SECRET sets \
                 tokens.secret): secrets = [\"new\", \"old\"] signs with the first and verifies \
                 with any"
                    .into(),
            );
        }
        if self.tokens.secrets.iter().any(String::is_empty) {
            add(
                "tokens.secrets".into(),
                "a secret must not be empty (or blank)".into(),
            );
        }
        if let Some(cors) = &self.server.cors {
            if let Some(reason) = cors.max_age.problem_unless_zero() {
                add("server.cors.max_age".into(), reason);
            }
            for origin in &cors.allow_origins {
                // Exactly what a browser sends as `Origin`: the serialised
                // origin (RFC 6454 §6.1), compared byte for byte.
                let ok = url::Url::parse(origin).is_ok_and(|u| {
                    matches!(u.scheme(), "http" | "https")
                        && u.origin().ascii_serialization() == origin.trim_end_matches('/')
                });
                if !ok {
                    add(
                        "server.cors.allow_origins".into(),
                        format!(
                            "{origin:?} is not an origin like \"https://shop.example\" (scheme, host, \
                             optional port; no path, no wildcard)"
                        ),
                    );
                }
            }
        }

        let mut upstream_names = BTreeSet::new();
        for (i, u) in self.upstreams.iter().enumerate() {
            let key = |field: &str| format!("upstreams[{i}].{field}");
            if u.name.is_empty() {
                add(key("name"), "must not be empty".into());
            } else if !upstream_names.insert(u.name.as_str()) {
                add(key("name"), format!("duplicate upstream name {:?}", u.name));
            }
            if let Err(reason) = super::plan::check_upstream_url(&u.url) {
                add(key("url"), reason);
            } else if let Err((field, reason)) = check_upstream_tls(u, &key) {
                add(field, reason);
            }
            if let Some(reason) = u.timeout.problem() {
                add(key("timeout"), reason);
            }
            if let Some(reason) = u
                .uncertain_hold
                .as_ref()
                .and_then(|h| h.problem_unless_zero())
            {
                add(key("uncertain_hold"), reason);
            }
            if let Err(status) =
                idemgate::idempotency::outcome::UncertainStatuses::new(&u.uncertain_statuses)
            {
                add(
                    key("uncertain_statuses"),
                    format!(
                        "{status} is not a 5xx status: only an answer in 500..599 can stand for \
                         one a proxy in front of the service lost (every other status is the \
                         service's own, stored or released as it says)"
                    ),
                );
            }
            if u.http2 && u.max_connections > 0 {
                add(
                    key("max_connections"),
                    "caps HTTP/1.1 upstreams only: an HTTP/2 upstream's requests share connections of 100 streams".into(),
                );
            }
        }

        let mut route_names = BTreeSet::new();
        let mut matchers: Vec<(usize, RouteMatcher)> = Vec::new();
        for (i, r) in self.routes.iter().enumerate() {
            let key = |field: &str| format!("routes[{i}].{field}");
            if r.name.is_empty() {
                add(key("name"), "must not be empty".into());
            } else if !route_names.insert(r.name.as_str()) {
                add(key("name"), format!("duplicate route name {:?}", r.name));
            }
            if !upstream_names.contains(r.upstream.as_str()) {
                let known: Vec<_> = upstream_names.iter().copied().collect();
                add(
                    key("upstream"),
                    format!(
                        "unknown upstream {:?} (known: {})",
                        r.upstream,
                        if known.is_empty() {
                            "none".to_owned()
                        } else {
                            known.join(", ")
                        }
                    ),
                );
            }
            for m in &r.methods {
                if m.parse::<http::Method>().is_err() || m.chars().any(|c| c.is_ascii_lowercase()) {
                    add(
                        key("methods"),
                        format!("{m:?} is not an upper-case HTTP method"),
                    );
                }
            }
            match r.matcher() {
                Ok(m) => {
                    if let Some(reserved) = m.reserved_overlap(RESERVED_PATHS) {
                        add(
                            key("path"),
                            format!(
                                "{reserved} is answered by the gateway itself and cannot be routed"
                            ),
                        );
                    }
                    matchers.push((i, m));
                }
                Err(reason) => add(key("path"), reason),
            }
            self.validate_policy(r, &key, &mut add);
            if let Some(path) = &r.reconcile_path
                && let Err(reason) = check_reconcile_path(r, path)
            {
                add(key("reconcile_path"), reason);
            }
        }
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

        let mut consumer_names = BTreeSet::new();
        for (i, c) in self.consumers.iter().enumerate() {
            let key = |field: &str| format!("consumers[{i}].{field}");
            if c.name.is_empty() {
                add(key("name"), "must not be empty".into());
            } else if !consumer_names.insert(c.name.as_str()) {
                add(key("name"), format!("duplicate consumer name {:?}", c.name));
            } else if route_names.contains(c.name.as_str()) || c.name == "token" {
                // A consumer's records are kept under its name as their
                // route: sharing a route's name would share its records.
                add(
                    key("name"),
                    format!(
                        "{:?} is also a route's name; records are kept by name",
                        c.name
                    ),
                );
            }
            c.validate(&key, &upstream_names, &mut add);
        }
        self.check_record_ids(&mut add);
        // Two entries on one queue would keep one message under two
        // records (the consumer's name scopes them): executed twice.
        let mut reads = std::collections::BTreeMap::new();
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

        self.check_timing(&mut add);
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

    /// Each route's and consumer's record identity (`id`, default its
    /// name): one each, so that two never share records, and a plain
    /// label (no `/`: the token records' own namespace is `/token`).
    fn check_record_ids(&self, add: &mut dyn FnMut(String, String)) {
        let mut seen: std::collections::BTreeMap<&str, (String, bool)> = Default::default();
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
        let longest = protected
            .chain(consumers)
            .filter_map(|(who, upstream)| {
                let (j, u) = self
                    .upstreams
                    .iter()
                    .enumerate()
                    .find(|(_, u)| &u.name == upstream)?;
                Some((u.timeout.valid()?, who, j))
            })
            .max_by_key(|(timeout, ..)| *timeout);
        if let Some((timeout, who, j)) = longest {
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
                        self.store.lease.raw,
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
                        self.store.retention.raw,
                        fmt(timeout),
                        fmt(lease),
                        fmt(timeout + lease)
                    ),
                );
            }
        }
        let token_routes = self
            .routes
            .iter()
            .any(|r| r.kind == RouteKind::Sync && r.idempotency() == Idempotency::Token);
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
                    self.store.retention.raw, self.tokens.ttl.raw
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
                        self.store.retention.raw, sig.tolerance.raw
                    ),
                );
            }
        }
    }

    fn validate_policy(
        &self,
        r: &RouteConfig,
        key: &dyn Fn(&str) -> String,
        add: &mut dyn FnMut(String, String),
    ) {
        match r.kind {
            RouteKind::Sync => {
                if !r.business_key.is_empty() {
                    add(
                        key("business_key"),
                        "only callback routes take a business key (set kind = \"callback\")".into(),
                    );
                }
                if r.signature.is_some() {
                    add(
                        key("signature"),
                        "only callback routes verify signatures (set kind = \"callback\")".into(),
                    );
                }
                if !r.must_match.is_empty() {
                    add(
                        key("must_match"),
                        "only callback routes are identified by a business key (set kind = \"callback\")"
                            .into(),
                    );
                }
            }
            RouteKind::Callback => {
                match r.idempotency {
                    Some(Idempotency::Token) => add(
                        key("idempotency"),
                        format!(
                            "route {:?} is a callback route and cannot use idempotency = \"token\": \
                             asynchronous callers (payment providers, message queues, jobs) never carry \
                             a client token, so a token check would either reject every legitimate \
                             redelivery or protect nothing; dedupe on the business key instead \
                             (business_key = [\"json:/trade_no\"])",
                            r.name
                        ),
                    ),
                    Some(Idempotency::Key) => add(
                        key("idempotency"),
                        "callback routes dedupe on their business_key; to use the caller's \
                         Idempotency-Key header, write business_key = [\"header:Idempotency-Key\"]"
                            .into(),
                    ),
                    Some(Idempotency::None) | None => {}
                }
                if r.business_key.is_empty() {
                    add(
                        key("business_key"),
                        "a callback route needs at least one source (json:/pointer, header:Name or query:name)"
                            .into(),
                    );
                }
                for source in &r.business_key {
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
                    if let (Some(sig), Some(place)) = (&r.signature, unsigned) {
                        add(
                            key("business_key"),
                            format!(
                                "route {:?} verifies a {} signature, which covers the body only, \
                                 but its business key source {source:?} is a {place} the sender \
                                 does not sign: a captured delivery replayed with a new {place} \
                                 value would pass the signature check and count as a new key, so \
                                 it would be executed again; take the key from the body \
                                 (json:/pointer)",
                                r.name, sig.scheme
                            ),
                        );
                    }
                }
                for source in &r.must_match {
                    if let Err(reason) = idemgate::callback::KeySource::parse(source) {
                        add(key("must_match"), reason);
                    }
                }
                if let Some(sig) = &r.signature {
                    if sig.secrets.iter().any(String::is_empty) {
                        add(
                            key("signature.secrets"),
                            "a secret must not be empty (or blank): anyone could sign with it"
                                .into(),
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
                            "scheme = \"hmac-sha256\" needs the header that carries the signature"
                                .into(),
                        );
                    }
                    if let Some(reason) = sig.tolerance.problem() {
                        add(key("signature.tolerance"), reason);
                    }
                }
            }
        }
    }

    /// What a valid configuration still risks, for `check-config` to print:
    /// each callback route signed with `hmac-sha256` (no timestamp, so a
    /// captured delivery never goes stale).
    pub fn warnings(&self) -> Vec<Problem> {
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
                if r.kind == RouteKind::Sync && r.idempotency() != Idempotency::None {
                    warnings.push(Problem {
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
                warnings.push(Problem {
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
                warnings.push(Problem {
                    key: format!("routes[{i}].signature.scheme"),
                    reason: format!(
                        "route {:?} uses hmac-sha256, which signs the body without a timestamp: \
                         a captured delivery replayed after its record's retention \
                         (store.retention = {:?}) is treated as a new delivery and forwarded \
                         again; prefer standard-webhooks or stripe if the sender supports them",
                        r.name, self.store.retention.raw
                    ),
                });
            }
        }
        warnings
    }
}

/// A duration as the messages print it.
fn fmt(d: std::time::Duration) -> String {
    humantime::format_duration(d).to_string()
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

/// An upstream's TLS files: only on `https://` (they are read with the
/// upstream, in [`super::plan`]).
fn check_upstream_tls(
    u: &UpstreamConfig,
    key: &dyn Fn(&str) -> String,
) -> Result<(), (String, String)> {
    let fields = [
        ("ca_file", &u.ca_file),
        ("client_cert", &u.client_cert),
        ("client_key", &u.client_key),
    ];
    if u.url.to_ascii_lowercase().starts_with("https://") {
        return Ok(());
    }
    match fields.iter().find(|(_, v)| v.is_some()) {
        Some((field, _)) => Err((
            key(field),
            "only an https:// upstream uses TLS files".into(),
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
        [[upstreams]]
        name = "orders"
        url = "http://127.0.0.1:9001"

        [[routes]]
        name = "all"
        path_prefix = "/"
        upstream = "orders"
    "#;

    #[test]
    fn minimal_config_is_valid_and_defaulted() {
        let c = Config::parse(MINIMAL, "t").unwrap();
        c.validate("t").unwrap();
        assert_eq!(c.server.listen, DEFAULT_LISTEN);
        assert_eq!(c.store.retention.get(), Duration::from_secs(86_400));
        assert_eq!(c.routes[0].idempotency(), Idempotency::None);
    }

    #[test]
    fn an_uncertain_key_is_held_for_the_upstreams_timeout_unless_told_and_warned() {
        let c = Config::parse(
            &MINIMAL.replace("url = ", "timeout = \"7s\"\n        url = "),
            "t",
        )
        .unwrap();
        c.validate("t").unwrap();
        assert_eq!(c.upstreams[0].uncertain_hold(), Duration::from_secs(7));
        assert!(
            c.warnings()
                .iter()
                .all(|w| !w.key.contains("uncertain_hold"))
        );
        let shorter = MINIMAL.replace(
            "url = ",
            "timeout = \"7s\"\n        uncertain_hold = \"2s\"\n        url = ",
        );
        let c = Config::parse(&shorter, "t").unwrap();
        c.validate("t").unwrap();
        assert_eq!(c.upstreams[0].uncertain_hold(), Duration::from_secs(2));
        let warned = c.warnings();
        let w = warned
            .iter()
            .find(|w| w.key == "upstreams[0].uncertain_hold")
            .expect("warned");
        assert!(w.reason.contains("7s"), "{}", w.reason);
    }

    #[test]
    fn unknown_key_names_the_key() {
        let err = Config::parse("[server]\nlisten_addr = \"x\"\n", "t").unwrap_err();
        assert!(err.to_string().contains("listen_addr"), "{err}");
    }

    #[test]
    fn env_overrides_apply() {
        let mut c = Config::parse(MINIMAL, "t").unwrap();
        c.apply_env(|k| match k {
            "IDEMGATE_LISTEN" => Some("127.0.0.1:1".into()),
            "IDEMGATE_DATABASE_URL" => Some("postgres://x/y".into()),
            "IDEMGATE_REDIS_URL" => Some("redis://127.0.0.1/".into()),
            "IDEMGATE_TOKEN_SECRET" => Some("s".into()),
            _ => None,
        });
        assert_eq!(c.server.listen, "127.0.0.1:1");
        assert_eq!(c.store.database_url, "postgres://x/y");
        assert_eq!(c.store.redis_url, "redis://127.0.0.1/");
        assert_eq!(c.tokens.secret, "s");
    }

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

    /// The problems validation finds in `text` (none when it is valid).
    fn problems_of(text: &str) -> Vec<Problem> {
        match Config::parse(text, "t").unwrap().validate("t") {
            Ok(_) => Vec::new(),
            Err(e) => e.problems().to_vec(),
        }
    }

    /// The reasons given for `key`.
    fn reasons_for<'a>(problems: &'a [Problem], key: &str) -> Vec<&'a str> {
        problems
            .iter()
            .filter(|p| p.key == key)
            .map(|p| p.reason.as_str())
            .collect()
    }

    /// Every duration key of the file, as validation names it.
    const DURATION_KEYS: &[&str] = &[
        "server.header_read_timeout",
        "server.body_read_timeout",
        "server.shutdown_grace",
        "store.retention",
        "store.lease",
        "store.timeout",
        "store.sweep_interval",
        "store.fast_layer_budget",
        "tokens.ttl",
        "upstreams[0].timeout",
        "routes[0].signature.tolerance",
    ];

    /// A config with every duration of [`DURATION_KEYS`] set to `value`.
    fn every_duration(value: &str) -> String {
        format!(
            r#"
            [server]
            header_read_timeout = "{value}"
            body_read_timeout = "{value}"
            shutdown_grace = "{value}"
            [store]
            retention = "{value}"
            lease = "{value}"
            timeout = "{value}"
            sweep_interval = "{value}"
            fast_layer_budget = "{value}"
            [tokens]
            ttl = "{value}"
            [[upstreams]]
            name = "o"
            url = "http://127.0.0.1:9001"
            timeout = "{value}"
            [[routes]]
            name = "hook"
            path = "/hook"
            upstream = "o"
            kind = "callback"
            business_key = ["json:/id"]
            [routes.signature]
            scheme = "stripe"
            secrets = ["whsec_x"]
            tolerance = "{value}"
            "#
        )
    }

    #[test]
    fn every_duration_key_refuses_text_that_is_not_a_duration() {
        let problems = problems_of(&every_duration("abc"));
        for key in DURATION_KEYS {
            let reasons = reasons_for(&problems, key);
            assert_eq!(reasons.len(), 1, "{key}: {problems:?}");
            assert!(reasons[0].contains("\"abc\""), "{key}: {}", reasons[0]);
            assert!(
                reasons[0].contains("not a duration"),
                "{key}: {}",
                reasons[0]
            );
        }
        assert_eq!(problems.len(), DURATION_KEYS.len(), "{problems:?}");
    }

    #[test]
    fn every_duration_key_refuses_zero() {
        let problems = problems_of(&every_duration("0s"));
        for key in DURATION_KEYS {
            let reasons = reasons_for(&problems, key);
            // One each: lease and budget are not also compared with a zero
            // store.timeout.
            assert_eq!(reasons.len(), 1, "{key}: {problems:?}");
            assert!(reasons[0].contains("\"0s\""), "{key}: {}", reasons[0]);
            assert!(
                reasons[0].contains("longer than zero"),
                "{key}: {}",
                reasons[0]
            );
        }
        assert_eq!(problems.len(), DURATION_KEYS.len(), "{problems:?}");
    }

    #[test]
    fn a_zero_or_bad_body_read_timeout_is_refused() {
        for value in ["0s", "0ms", "abc", ""] {
            let text = format!("[server]\nbody_read_timeout = \"{value}\"\n{MINIMAL}");
            let problems = problems_of(&text);
            assert_eq!(
                reasons_for(&problems, "server.body_read_timeout").len(),
                1,
                "{value:?}: {problems:?}"
            );
        }
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

    /// One callback route `hook` with these `business_key` sources and
    /// signature table (`""`: unsigned).
    fn callback_route(business_key: &str, signature: &str) -> String {
        format!(
            r#"
            [[upstreams]]
            name = "o"
            url = "http://127.0.0.1:9001"
            [[routes]]
            name = "hook"
            methods = ["POST"]
            path = "/hook"
            upstream = "o"
            kind = "callback"
            business_key = {business_key}
            {signature}
            "#
        )
    }

    /// A `[routes.signature]` table for each scheme.
    const SIGNATURES: &[(&str, &str)] = &[
        (
            "standard-webhooks",
            "[routes.signature]\nscheme = \"standard-webhooks\"\nsecrets = [\"whsec_MDEyMzQ1Njc4OWFiY2RlZg==\"]",
        ),
        (
            "stripe",
            "[routes.signature]\nscheme = \"stripe\"\nsecrets = [\"whsec_x\"]",
        ),
        (
            "hmac-sha256",
            "[routes.signature]\nscheme = \"hmac-sha256\"\nheader = \"X-Signature\"\nsecrets = [\"k\"]",
        ),
    ];

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

    /// A protected route over `timeout`, with `store` keys.
    fn timed(store: &str, timeout: &str, extra: &str) -> String {
        format!(
            r#"
            [store]
            {store}
            [tokens]
            ttl = "10m"
            [[upstreams]]
            name = "orders"
            url = "http://127.0.0.1:9001"
            timeout = "{timeout}"
            [[routes]]
            name = "pay"
            path = "/pay"
            upstream = "orders"
            idempotency = "token"
            {extra}
            "#
        )
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
