//! Configuration: the TOML file of docs/configuration.md, the `IDEMGATE_*`
//! environment overrides, and validation.
//!
//! Parsing happens in two phases. Serde rejects what cannot be read at all
//! (syntax, unknown keys, wrong types) and stops at the first such error,
//! naming the key and the line. Everything that can be read is then checked
//! by [`Config::validate`], which collects *every* problem — bad durations,
//! unknown upstreams, duplicate names, overlapping routes, bad URLs — so an
//! operator fixes a file in one round instead of one error per restart.
//! Durations are therefore read as strings ([`HumanDuration`]) and only
//! judged in the second phase.
//!
//! Each section lives in its own module with its schema, its defaults and
//! the checks its keys need on their own: `server.rs` (`[server]`),
//! `store.rs`, `tokens.rs`, `identity.rs`, `upstreams.rs`, `routes.rs`,
//! `consumer.rs` (`[[consumers]]`), `telemetry.rs`; `duration.rs` holds
//! [`HumanDuration`]. A default the library or store crate also has is
//! that crate's constant, so the two never drift apart. `validate.rs` runs
//! the checks and the rules that compare keys of several sections, and
//! makes the [`Plan`] (`plan.rs`): everything read from disk and built
//! from text, once, in typed entries that start-up and reloads read
//! instead of the file. `secrets.rs`: trimming secrets, and leaving them
//! out of the fingerprint.
//!
//! Here: the whole file ([`Config`]), reading it, the environment's
//! overrides, and the errors.

use std::path::Path;

pub use crate::router::{PathMatch, RouteMatcher};
pub use idemgate::callback::SignatureScheme;
pub use idemgate::idempotency::OnConcurrent;

mod consumer;
mod duration;
mod identity;
mod plan;
mod routes;
mod secrets;
mod server;
mod store;
mod telemetry;
mod tokens;
mod upstreams;
mod validate;
pub use consumer::{Broker, ConsumerConfig, DEAD_LETTER_EXCHANGE};
pub use duration::HumanDuration;
pub use identity::{IdentityConfig, JwtConfig};
pub use plan::{AdminToken, ConsumerPlan, Plan, PolicyPlan, RoutePlan};
pub use routes::{IdempotencyMode, RouteConfig, RouteKind, SignatureConfig};
pub use server::{CorsConfig, ServerConfig, ServerTlsConfig};
pub use store::{DEFAULT_DATABASE_URL, StoreConfig};
pub use telemetry::{OtlpProtocol, TelemetryConfig};
pub use tokens::TokenConfig;
pub use upstreams::{OutcomeSettings, UpstreamConfig};

/// Where `serve`, `demo` and `check-config` look when `--config` is absent.
pub const DEFAULT_CONFIG_PATH: &str = "config/idemgate.toml";

/// Paths the gateway answers itself on the public listener; routes may not
/// claim them.
pub const RESERVED_PATHS: &[&str] = &["/token"];

/// The whole configuration file.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `[server]`: the listeners, the admin token, and the bounds on
    /// connections, bodies and claims.
    #[serde(default)]
    pub server: ServerConfig,
    /// `[store]`: the durable record, the fast layer, retention and lease.
    #[serde(default)]
    pub store: StoreConfig,
    /// `[tokens]`: the one-time tokens `/token` issues.
    #[serde(default)]
    pub tokens: TokenConfig,
    /// `[identity]`: who a client is, which scopes the records of key and
    /// token routes.
    #[serde(default)]
    pub identity: IdentityConfig,
    /// `[[upstreams]]`: the services requests are forwarded to.
    #[serde(default)]
    pub upstreams: Vec<UpstreamConfig>,
    /// `[[routes]]`: which requests go to which upstream, under which policy.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// `[[consumers]]`: queues and streams Idemgate consumes and POSTs to an
    /// upstream once per message.
    #[serde(default)]
    pub consumers: Vec<ConsumerConfig>,
    /// `[telemetry]`: traces over OTLP (off without `otlp_endpoint`).
    #[serde(default)]
    pub telemetry: TelemetryConfig,
}

// === errors ===

/// One thing wrong with a config file (or, from [`Config::warnings`], one
/// thing risky in it): the key and the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigProblem {
    /// The key at fault, with its place (`upstreams[2].url`).
    pub key: String,
    /// What is wrong with it.
    pub reason: String,
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{origin}: cannot read: {source}")]
    Read {
        /// The file's path.
        origin: String,
        /// Why reading failed.
        source: std::io::Error,
    },
    /// The TOML is malformed, or has an unknown key or a wrong type (the
    /// first such error only).
    #[error("{origin}: {message}")]
    Parse {
        /// The file's path.
        origin: String,
        /// The parser's message, naming the key and the line.
        message: String,
    },
    /// The file was read but failed validation.
    #[error("{origin}: {} problem(s):\n{}", problems.len(), render_problems(problems))]
    Invalid {
        /// The file's path, or "the configuration" when no file is named.
        origin: String,
        /// Every problem found, each with its key.
        problems: Vec<ConfigProblem>,
    },
}

fn render_problems(problems: &[ConfigProblem]) -> String {
    problems
        .iter()
        .map(|p| format!("  - {}: {}", p.key, p.reason))
        .collect::<Vec<_>>()
        .join("\n")
}

impl ConfigError {
    /// The collected problems (empty for read and parse errors).
    pub fn problems(&self) -> &[ConfigProblem] {
        match self {
            ConfigError::Invalid { problems, .. } => problems,
            _ => &[],
        }
    }
}

// === impl Config ===

impl Config {
    /// Reads, overrides from the environment, and validates.
    pub fn load(path: &Path) -> Result<Plan, ConfigError> {
        Config::read(path)?.validate(&path.display().to_string())
    }

    /// Reads the file and applies the environment's overrides, without
    /// validating (a reload validates what will run: see
    /// `gateway/reload.rs`).
    pub fn read(path: &Path) -> Result<Config, ConfigError> {
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            origin: origin.clone(),
            source,
        })?;
        let mut config = Config::parse(&text, &origin)?;
        config.apply_env(|name| std::env::var(name).ok());
        Ok(config)
    }

    /// Parses TOML text without validating it.
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            origin: origin.to_owned(),
            message: e.to_string(),
        })
    }

    /// Applies the `IDEMGATE_*` overrides; `lookup` reads one variable. A
    /// secret's variable is trimmed, and one that is blank is not set.
    pub fn apply_env(&mut self, lookup: impl Fn(&str) -> Option<String>) {
        let secret = |name: &str| secrets::from_env(lookup(name));
        if let Some(v) = lookup("IDEMGATE_LISTEN") {
            self.server.listen = v;
        }
        if let Some(v) = lookup("IDEMGATE_ADMIN_LISTEN") {
            self.server.admin_listen = v;
        }
        if let Some(v) = lookup("IDEMGATE_DATABASE_URL") {
            self.store.database_url = v;
        }
        if let Some(v) = lookup("IDEMGATE_REDIS_URL") {
            self.store.redis_url = v;
        }
        if let Some(v) = secret("IDEMGATE_TOKEN_SECRET") {
            self.tokens.secret = v;
        }
        if let Some(v) = secret("IDEMGATE_ADMIN_TOKEN") {
            self.server.admin_token = v;
            self.server.admin_token_file = None;
        }
    }

    /// The identity the records of the route or consumer an operator names
    /// are kept under (`routes[].id`): a name maps to its route's id; any
    /// other text (an id itself, a route no longer configured) is taken
    /// as it is.
    pub fn record_id_of<'a>(&'a self, named: &'a str) -> &'a str {
        self.routes
            .iter()
            .find(|r| r.name == named)
            .map(RouteConfig::record_id)
            .or_else(|| {
                self.consumers
                    .iter()
                    .find(|c| c.name == named)
                    .map(ConsumerConfig::record_id)
            })
            .unwrap_or(named)
    }

    /// The upstream a route names (validation guarantees it exists).
    pub fn upstream(&self, name: &str) -> Option<&UpstreamConfig> {
        self.upstreams.iter().find(|u| u.name == name)
    }

    /// A metrics registry with a series for each route, upstream and
    /// consumer of this file.
    pub fn metrics(&self) -> idemgate_core::metrics::Metrics {
        idemgate_core::metrics::Metrics::new(
            self.routes.iter().map(|r| r.name.as_str()),
            self.upstreams.iter().map(|u| u.name.as_str()),
            self.consumers.iter().map(|c| c.name.as_str()),
        )
    }
}

/// What the unit tests of every section share: a minimal file, and the
/// problems validation finds in a file.
#[cfg(test)]
mod testing {
    use super::{Config, ConfigProblem};

    /// One upstream and one pass-through route over it.
    pub(super) const MINIMAL: &str = r#"
        [[upstreams]]
        name = "orders"
        url = "http://127.0.0.1:9001"

        [[routes]]
        name = "all"
        path_prefix = "/"
        upstream = "orders"
    "#;

    /// The problems validation finds in `text` (none when it is valid).
    pub(super) fn problems_of(text: &str) -> Vec<ConfigProblem> {
        match Config::parse(text, "t").unwrap().validate("t") {
            Ok(_) => Vec::new(),
            Err(e) => e.problems().to_vec(),
        }
    }

    /// The reasons given for `key`.
    pub(super) fn reasons_for<'a>(problems: &'a [ConfigProblem], key: &str) -> Vec<&'a str> {
        problems
            .iter()
            .filter(|p| p.key == key)
            .map(|p| p.reason.as_str())
            .collect()
    }

    /// One callback route `hook` with these `business_key` sources and
    /// signature table (`""`: unsigned).
    pub(super) fn callback_route(business_key: &str, signature: &str) -> String {
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
    pub(super) const SIGNATURES: &[(&str, &str)] = &[
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

    /// A protected route over `timeout`, with `store` keys.
    pub(super) fn timed(store: &str, timeout: &str, extra: &str) -> String {
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
}

#[cfg(test)]
mod tests {
    use super::Config;
    use super::testing::MINIMAL;

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
}
