//! [`Plan`]: a configuration with everything read from disk or built from
//! text done once — certificates and keys, the JWKS file, each upstream's
//! TLS settings, each route's matcher and policy, each consumer's source
//! and key sources, the CORS policy — and one typed entry per route and
//! per consumer holding what start-up needs of it. Start-up and a reload
//! assemble the gateway from a plan's entries and never read the file's
//! text again (only the plain values of `[server]`, `[store]` and
//! `[tokens]`, through [`Plan::config`]); validation is what makes one.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use idemgate::callback::{CallbackPolicy, KeySource, Verifier};
use idemgate_core::identity::Identity;
use idemgate_mq::MessageKeySource;
use idemgate_proxy::Upstream;

use super::*;
use crate::router::{CorsPolicy, RouteMatcher};

/// A configuration, loaded.
pub struct Plan {
    /// The file as read (and its environment overrides).
    pub config: Config,
    /// Who a client is (a JWKS file read).
    pub identity: Identity,
    /// `[server.tls]`, certificate and key read.
    pub server_tls: Option<Arc<rustls::ServerConfig>>,
    /// Every upstream by name, TLS settings read.
    pub upstreams: HashMap<String, Upstream>,
    /// Every route, in the file's order.
    pub routes: Vec<RoutePlan>,
    /// Every consumer, in the file's order.
    pub consumers: Vec<ConsumerPlan>,
    /// `[server.cors]` (`None`: off).
    pub cors: Option<CorsPolicy>,
    /// The admin API's bearer token (`None`: open, on loopback only).
    pub admin_token: Option<AdminToken>,
    /// Tests only: the store may be an in-memory database (refused
    /// otherwise, when the store is opened; validation refuses it in a
    /// file).
    pub in_memory_store_for_tests: bool,
}

/// The admin API's bearer token, compared in constant time.
#[derive(Clone)]
pub struct AdminToken(Arc<str>);

impl AdminToken {
    /// A token; `None` when empty.
    pub fn new(token: &str) -> Option<AdminToken> {
        let token = token.trim();
        (!token.is_empty()).then(|| AdminToken(token.into()))
    }

    /// Whether `candidate` is the token, in time that does not depend on
    /// where they differ.
    pub fn matches(&self, candidate: &str) -> bool {
        let (a, b) = (self.0.as_bytes(), candidate.as_bytes());
        let mut differ = a.len() ^ b.len();
        for (i, x) in a.iter().enumerate() {
            differ |= usize::from(x ^ b.get(i).copied().unwrap_or(0));
        }
        differ == 0
    }
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(…)")
    }
}

impl std::fmt::Debug for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Keys and certificates are not printed.
        f.debug_struct("Plan")
            .field("routes", &self.routes.len())
            .field("consumers", &self.consumers.len())
            .field("upstreams", &self.upstreams.len())
            .field("server_tls", &self.server_tls.is_some())
            .finish_non_exhaustive()
    }
}

/// One `[[routes]]` entry, built: everything start-up, the record scopes
/// and the admin API need of it.
pub struct RoutePlan {
    /// `routes[].name`: its metrics series, spans and logs.
    pub name: String,
    /// The identity its records are kept under (`id`, or the name).
    pub record_id: String,
    /// The upstream it forwards to, by name.
    pub upstream: String,
    /// Which requests it takes.
    pub matcher: RouteMatcher,
    /// What protects it.
    pub policy: PolicyPlan,
    /// What a duplicate gets while the first is in flight.
    pub on_concurrent: OnConcurrent,
    /// The upstream's status endpoint (`{key}` = the stable key), asked
    /// before an uncertain request is forwarded again.
    pub reconcile_path: Option<String>,
    /// What its engine takes from its upstream.
    pub outcomes: OutcomeSettings,
    /// Callback routes: the business-key sources as written, part of what
    /// scopes its records (empty on a sync route).
    pub business_key: Vec<String>,
    /// Callback routes on a `path_prefix`: the path is part of the key.
    pub scoped_by_path: bool,
}

/// A route's policy, built.
pub enum PolicyPlan {
    /// Forwarded as is.
    PassThrough,
    /// `Idempotency-Key`.
    Key {
        /// A missing key is `400`.
        require_key: bool,
    },
    /// One-time tokens.
    Token,
    /// A callback's business key (signature verifier built).
    Callback(CallbackPolicy),
}

impl PolicyPlan {
    /// Its name in a request's span: `pass_through`, `key`, `token`,
    /// `callback`.
    pub fn name(&self) -> &'static str {
        match self {
            PolicyPlan::PassThrough => "pass_through",
            PolicyPlan::Key { .. } => "key",
            PolicyPlan::Token => "token",
            PolicyPlan::Callback(_) => "callback",
        }
    }
}

/// One `[[consumers]]` entry, built: its source, path and key sources
/// parsed, and what its engine takes from its upstream.
pub struct ConsumerPlan {
    /// `consumers[].name`: logs, metrics and spans.
    pub name: String,
    /// The identity its records are kept under (`id`, or the name).
    pub record_id: String,
    /// The upstream each message is delivered to, by name.
    pub upstream: String,
    /// The queue or stream, and where its dead letters go.
    pub source: idemgate_mq::Source,
    /// Where each message is POSTed.
    pub path: http::uri::PathAndQuery,
    /// The business-key sources as written, what scopes its records.
    pub business_key: Vec<String>,
    /// `business_key`, parsed.
    pub sources: Arc<[MessageKeySource]>,
    /// `must_match`, parsed.
    pub must_match: Arc<[MessageKeySource]>,
    /// Messages in flight at once.
    pub prefetch: u16,
    /// Failed upstream attempts before a message is dead-lettered.
    pub max_deliveries: u32,
    /// How long a failed message waits before it is delivered again.
    pub retry_delay: Duration,
    /// What its engine takes from its upstream.
    pub outcomes: OutcomeSettings,
}

impl Plan {
    /// Loads `config` without the checks [`Config::validate`] makes of the
    /// values (for a configuration already validated, or built in code).
    pub fn load(config: Config) -> Result<Plan, ConfigError> {
        let config = config.with_secrets_trimmed();
        let mut problems = Vec::new();
        let loaded = load(&config, &mut |key, reason| {
            problems.push(ConfigProblem { key, reason })
        });
        match loaded {
            Some(parts) if problems.is_empty() => Ok(parts.into_plan(config)),
            _ => Err(ConfigError::Invalid {
                origin: "the configuration".into(),
                problems,
            }),
        }
    }

    /// The token routes (`/token?route=NAME` binds to one), each name
    /// with the identity its tokens are bound to.
    pub fn token_routes(&self) -> std::collections::BTreeMap<String, String> {
        self.routes
            .iter()
            .filter(|r| matches!(r.policy, PolicyPlan::Token))
            .map(|r| (r.name.clone(), r.record_id.clone()))
            .collect()
    }
}

/// What [`load`] builds, before it is paired with its configuration.
pub(super) struct Loaded {
    identity: Identity,
    server_tls: Option<Arc<rustls::ServerConfig>>,
    upstreams: HashMap<String, Upstream>,
    routes: Vec<RoutePlan>,
    consumers: Vec<ConsumerPlan>,
    cors: Option<CorsPolicy>,
    admin_token: Option<AdminToken>,
}

impl Loaded {
    pub(super) fn into_plan(self, config: Config) -> Plan {
        Plan {
            config,
            identity: self.identity,
            server_tls: self.server_tls,
            upstreams: self.upstreams,
            routes: self.routes,
            consumers: self.consumers,
            cors: self.cors,
            admin_token: self.admin_token,
            in_memory_store_for_tests: false,
        }
    }
}

/// Reads and builds every part, reporting each failure with its key;
/// `None` when a part could not be built.
pub(super) fn load(config: &Config, add: &mut dyn FnMut(String, String)) -> Option<Loaded> {
    let identity = config
        .identity
        .identity()
        .map_err(|(key, reason)| add(key, reason))
        .ok();
    let server_tls = match &config.server.tls {
        None => Some(None),
        Some(tls) => idemgate_proxy::tls::server_config(
            ("server.tls.cert", &tls.cert),
            ("server.tls.key", &tls.key),
            config.server.http2,
        )
        .map(Some)
        .map_err(|e| add(e.key.clone(), e.to_string()))
        .ok(),
    };
    let upstreams = load_upstreams(config, add);
    let mut routes = Vec::with_capacity(config.routes.len());
    for (i, r) in config.routes.iter().enumerate() {
        let key = |field: &str| format!("routes[{i}].{field}");
        routes.extend(route_plan(config, r, &key, add));
    }
    let mut consumers = Vec::with_capacity(config.consumers.len());
    for (i, c) in config.consumers.iter().enumerate() {
        let key = |field: &str| format!("consumers[{i}].{field}");
        consumers.extend(consumer_plan(config, c, &key, add));
    }
    let cors = config
        .server
        .cors_policy()
        .map_err(|reason| add("server.cors".into(), reason))
        .ok();
    let admin_token = load_admin_token(&config.server, add);
    Some(Loaded {
        identity: identity?,
        server_tls: server_tls?,
        upstreams: upstreams?,
        routes: (routes.len() == config.routes.len()).then_some(routes)?,
        consumers: (consumers.len() == config.consumers.len()).then_some(consumers)?,
        cors: cors?,
        admin_token: admin_token?,
    })
}

/// Every upstream by name, its TLS files read.
fn load_upstreams(
    config: &Config,
    add: &mut dyn FnMut(String, String),
) -> Option<HashMap<String, Upstream>> {
    let mut upstreams = HashMap::new();
    let mut all_upstreams = true;
    for (i, u) in config.upstreams.iter().enumerate() {
        if let Err(reason) = super::upstreams::check_upstream_url(&u.url) {
            add(format!("upstreams[{i}].url"), reason);
            all_upstreams = false;
            continue;
        }
        match Upstream::new_at(u.spec(), &format!("upstreams[{i}]")) {
            Ok(upstream) => {
                upstreams.insert(u.name.clone(), upstream);
            }
            Err((key, reason)) => {
                add(key, reason);
                all_upstreams = false;
            }
        }
    }
    all_upstreams.then_some(upstreams)
}

/// The admin token: `admin_token`, or the first line of
/// `admin_token_file` (`Some(None)`: none configured).
fn load_admin_token(
    server: &ServerConfig,
    add: &mut dyn FnMut(String, String),
) -> Option<Option<AdminToken>> {
    let Some(path) = &server.admin_token_file else {
        return Some(AdminToken::new(&server.admin_token));
    };
    match std::fs::read_to_string(path) {
        Ok(text) => match AdminToken::new(text.lines().next().unwrap_or_default()) {
            Some(token) => Some(Some(token)),
            None => {
                add(
                    "server.admin_token_file".into(),
                    format!("{path:?} holds no token on its first line"),
                );
                None
            }
        },
        Err(e) => {
            add(
                "server.admin_token_file".into(),
                format!("cannot read {path:?}: {e}"),
            );
            None
        }
    }
}

/// A route's entry: its matcher and policy built, and what its engine
/// takes from its upstream (the defaults for an upstream that is not
/// configured: validation refuses it, and a start from code fails on it).
fn route_plan(
    config: &Config,
    r: &RouteConfig,
    key: &dyn Fn(&str) -> String,
    add: &mut dyn FnMut(String, String),
) -> Option<RoutePlan> {
    let matcher = r.matcher().map_err(|reason| add(key("path"), reason)).ok();
    let policy = policy_of(r, key, add);
    Some(RoutePlan {
        name: r.name.clone(),
        record_id: r.record_id().to_owned(),
        upstream: r.upstream.clone(),
        matcher: matcher?,
        policy: policy?,
        on_concurrent: r.on_concurrent,
        reconcile_path: r.reconcile_path.clone(),
        outcomes: outcomes_of(config, &r.upstream),
        business_key: r.business_key.clone(),
        scoped_by_path: r.path_prefix.is_some(),
    })
}

/// A consumer's entry: its source, path and key sources read.
fn consumer_plan(
    config: &Config,
    c: &ConsumerConfig,
    key: &dyn Fn(&str) -> String,
    add: &mut dyn FnMut(String, String),
) -> Option<ConsumerPlan> {
    let source = c.mq_source();
    if source.is_none() {
        add(key("source"), c.unknown_source());
    }
    let path = c
        .upstream_path()
        .map_err(|reason| add(key("path"), reason))
        .ok();
    let (sources, must_match) = c.key_sources(key, add)?;
    Some(ConsumerPlan {
        name: c.name.clone(),
        record_id: c.record_id().to_owned(),
        upstream: c.upstream.clone(),
        source: source?,
        path: path?,
        business_key: c.business_key.clone(),
        sources: sources.into(),
        must_match: must_match.into(),
        prefetch: c.prefetch,
        max_deliveries: c.max_deliveries,
        retry_delay: c.retry_delay.get(),
        outcomes: outcomes_of(config, &c.upstream),
    })
}

/// What an engine in front of the upstream `name` takes from it (the
/// defaults for one that is not configured).
fn outcomes_of(config: &Config, name: &str) -> OutcomeSettings {
    config
        .upstream(name)
        .map(UpstreamConfig::outcome_settings)
        .unwrap_or_default()
}

/// A route's policy, its key sources parsed and its verifier built (the
/// secrets from the environment read).
fn policy_of(
    r: &RouteConfig,
    key: &dyn Fn(&str) -> String,
    add: &mut dyn FnMut(String, String),
) -> Option<PolicyPlan> {
    match (r.kind, r.idempotency()) {
        (RouteKind::Sync, IdempotencyMode::None) => Some(PolicyPlan::PassThrough),
        (RouteKind::Sync, IdempotencyMode::Key) => Some(PolicyPlan::Key {
            require_key: r.require_key,
        }),
        (RouteKind::Sync, IdempotencyMode::Token) => Some(PolicyPlan::Token),
        (RouteKind::Callback, _) => {
            let mut parse = |field: &str, sources: &[String]| {
                sources
                    .iter()
                    .map(|s| KeySource::parse(s).map_err(|reason| add(key(field), reason)))
                    .collect::<Result<Vec<_>, ()>>()
                    .ok()
            };
            let sources = parse("business_key", &r.business_key);
            let must_match = parse("must_match", &r.must_match);
            let verifier = match &r.signature {
                None => Some(None),
                Some(sig) => Verifier::new(sig.spec(), |name| std::env::var(name).ok())
                    .map(Some)
                    .map_err(|reason| add(key("signature"), reason))
                    .ok(),
            };
            let mut policy = CallbackPolicy::new(sources?, verifier?).with_must_match(must_match?);
            if r.path_prefix.is_some() {
                policy = policy.scoped_by_path();
            }
            Some(PolicyPlan::Callback(policy))
        }
    }
}
