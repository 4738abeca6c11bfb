//! [`Plan`]: a configuration with everything read from disk or built from
//! text done once — certificates and keys, the JWKS file, each upstream's
//! TLS settings, each route's matcher and policy, the CORS policy. Start-up
//! assembles the gateway from a plan and never reads the file's text
//! again; validation is what makes one.

use std::collections::HashMap;
use std::sync::Arc;

use idemgate::callback::{CallbackPolicy, KeySource, Verifier};
use idemgate_core::identity::Identity;
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
            .field("routes", &self.config.routes.len())
            .field("upstreams", &self.upstreams.len())
            .field("server_tls", &self.server_tls.is_some())
            .finish_non_exhaustive()
    }
}

/// One `[[routes]]` entry, built.
pub struct RoutePlan {
    /// Which requests it takes.
    pub matcher: RouteMatcher,
    /// What protects it.
    pub policy: PolicyPlan,
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

impl Plan {
    /// Loads `config` without the checks [`Config::validate`] makes of the
    /// values (for a configuration already validated, or built in code).
    pub fn load(config: Config) -> Result<Plan, ConfigError> {
        let config = config.with_secrets_trimmed();
        let mut problems = Vec::new();
        let loaded = load(&config, &mut |key, reason| {
            problems.push(Problem { key, reason })
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
        self.config
            .routes
            .iter()
            .zip(&self.routes)
            .filter(|(_, r)| matches!(r.policy, PolicyPlan::Token))
            .map(|(c, _)| (c.name.clone(), c.record_id().to_owned()))
            .collect()
    }
}

/// What [`load`] builds, before it is paired with its configuration.
pub(super) struct Loaded {
    identity: Identity,
    server_tls: Option<Arc<rustls::ServerConfig>>,
    upstreams: HashMap<String, Upstream>,
    routes: Vec<RoutePlan>,
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
    let mut upstreams = HashMap::new();
    let mut all_upstreams = true;
    for (i, u) in config.upstreams.iter().enumerate() {
        if let Err(reason) = check_upstream_url(&u.url) {
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
    let mut routes = Vec::with_capacity(config.routes.len());
    for (i, r) in config.routes.iter().enumerate() {
        let key = |field: &str| format!("routes[{i}].{field}");
        let matcher = r.matcher().map_err(|reason| add(key("path"), reason)).ok();
        let policy = policy_of(r, &key, add);
        if let (Some(matcher), Some(policy)) = (matcher, policy) {
            routes.push(RoutePlan { matcher, policy });
        }
    }
    let cors = config
        .server
        .cors_policy()
        .map_err(|reason| add("server.cors".into(), reason))
        .ok();
    let admin_token = match &config.server.admin_token_file {
        None => Some(AdminToken::new(&config.server.admin_token)),
        Some(path) => match std::fs::read_to_string(path) {
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
        },
    };
    Some(Loaded {
        identity: identity?,
        server_tls: server_tls?,
        upstreams: all_upstreams.then_some(upstreams)?,
        routes: (routes.len() == config.routes.len()).then_some(routes)?,
        cors: cors?,
        admin_token: admin_token?,
    })
}

/// A route's policy, its key sources parsed and its verifier built (the
/// secrets from the environment read).
fn policy_of(
    r: &RouteConfig,
    key: &dyn Fn(&str) -> String,
    add: &mut dyn FnMut(String, String),
) -> Option<PolicyPlan> {
    match (r.kind, r.idempotency()) {
        (RouteKind::Sync, Idempotency::None) => Some(PolicyPlan::PassThrough),
        (RouteKind::Sync, Idempotency::Key) => Some(PolicyPlan::Key {
            require_key: r.require_key,
        }),
        (RouteKind::Sync, Idempotency::Token) => Some(PolicyPlan::Token),
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

/// An upstream URL: `http://` or `https://`, a host, no path or query.
pub(super) fn check_upstream_url(raw: &str) -> Result<(), String> {
    let url = url::Url::parse(raw).map_err(|e| format!("{raw:?} is not a URL: {e}"))?;
    if url.scheme() != "http" && url.scheme() != "https" {
        return Err(format!("{raw:?}: an upstream is http:// or https://"));
    }
    if url.host_str().is_none() {
        return Err(format!("{raw:?} has no host"));
    }
    if !(url.path().is_empty() || url.path() == "/") || url.query().is_some() {
        return Err(format!(
            "{raw:?}: an upstream URL is scheme, host and port only; request paths are forwarded unchanged"
        ));
    }
    Ok(())
}
