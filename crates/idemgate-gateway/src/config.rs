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
//! Here: the schema, its defaults and the errors. `validate.rs`: the second
//! phase and the warnings. `consumer.rs`: `[[consumers]]`. `options.rs`:
//! the options each lower module is built from.

use std::fmt;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

pub use crate::router::{PathMatch, RouteMatcher};

mod consumer;
mod options;
mod plan;
mod secrets;
mod validate;
pub use consumer::{Broker, ConsumerConfig, DEAD_LETTER_EXCHANGE};
pub use plan::{AdminToken, Plan, PolicyPlan, RoutePlan};

/// Where `serve`, `demo` and `check-config` look when `--config` is absent.
pub const DEFAULT_CONFIG_PATH: &str = "config/idemgate.toml";

const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9090";
const DEFAULT_MAX_BODY_BYTES: u64 = 1024 * 1024;
/// `server.max_buffered_bytes`: 256 bodies of the default largest size.
const DEFAULT_MAX_BUFFERED_BYTES: u64 = 256 * 1024 * 1024;
/// `server.max_captured_bytes`: the reserves of 4,096 claims.
const DEFAULT_MAX_CAPTURED_BYTES: u64 = idemgate::idempotency::answer::DEFAULT_MAX_CAPTURED_BYTES;
const DEFAULT_HEADER_READ_TIMEOUT: &str = "10s";
const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
const DEFAULT_BODY_READ_TIMEOUT: &str = "30s";
const DEFAULT_SHUTDOWN_GRACE: &str = "30s";
const DEFAULT_HTTP2: bool = true;
/// `server.cors.max_age`: what Chromium caps a preflight cache at.
const DEFAULT_CORS_MAX_AGE: &str = "2h";
/// `upstreams[].max_connections`: no cap, as nginx (`max_conns`) and
/// HAProxy (`maxconn` per server) default to.
const DEFAULT_UPSTREAM_MAX_CONNECTIONS: usize = 0;

/// The embedded store every fresh checkout runs on.
pub const DEFAULT_DATABASE_URL: &str = "sqlite://data/idemgate.db";
const DEFAULT_RETENTION: &str = "24h";
const DEFAULT_LEASE: &str = "30s";
const DEFAULT_STORE_TIMEOUT: &str = "2s";
const DEFAULT_SWEEP_INTERVAL: &str = "1m";
const DEFAULT_FAST_LAYER_BUDGET: &str = "100ms";
const DEFAULT_MAX_STORED_BODY_BYTES: usize = 1024 * 1024;
const DEFAULT_POOL_SIZE: u32 = 16;
const DEFAULT_REDIS_PREFIX: &str = "idemgate:";
/// `store.tombstone`: off, as the spec's default; an expired key then
/// executes again, as after Stripe's 24 h.
const DEFAULT_TOMBSTONE: &str = "0s";

const DEFAULT_TOKEN_TTL: &str = "10m";
const DEFAULT_IDENTITY_HEADER: &str = "Authorization";
const DEFAULT_JWT_CLAIM: &str = "sub";
const DEFAULT_JWT_LEEWAY: &str = "60s";
const DEFAULT_UPSTREAM_TIMEOUT: &str = "10s";
const DEFAULT_SIGNATURE_TOLERANCE: &str = "300s";
/// The `service.name` exported spans carry.
const DEFAULT_SERVICE_NAME: &str = "idemgate";

/// Paths the gateway answers itself on the public listener; routes may not
/// claim them.
pub const RESERVED_PATHS: &[&str] = &["/token"];

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub server: ServerConfig,
    #[serde(default)]
    pub store: StoreConfig,
    #[serde(default)]
    pub tokens: TokenConfig,
    #[serde(default)]
    pub identity: IdentityConfig,
    #[serde(default)]
    pub upstreams: Vec<UpstreamConfig>,
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    #[serde(default)]
    pub consumers: Vec<ConsumerConfig>,
    #[serde(default)]
    pub telemetry: TelemetryConfig,
}

/// `[telemetry]`: traces exported over OTLP; off until `otlp_endpoint` is
/// set.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    /// The collector: `http://host:4317` for gRPC, the base URL
    /// (`http://host:4318`) for HTTP/protobuf.
    pub otlp_endpoint: Option<String>,
    #[serde(default)]
    pub otlp_protocol: OtlpProtocol,
    /// The `service.name` resource attribute.
    #[serde(default = "default_service_name")]
    pub service_name: String,
}

/// How spans travel to the collector.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub enum OtlpProtocol {
    /// OTLP/gRPC (port 4317).
    #[default]
    #[serde(rename = "grpc")]
    Grpc,
    /// OTLP/HTTP with protobuf bodies, POSTed to `<endpoint>/v1/traces`
    /// (port 4318).
    #[serde(rename = "http/protobuf")]
    HttpProtobuf,
}

impl OtlpProtocol {
    /// Its name in the configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            OtlpProtocol::Grpc => "grpc",
            OtlpProtocol::HttpProtobuf => "http/protobuf",
        }
    }
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otlp_endpoint: None,
            otlp_protocol: OtlpProtocol::default(),
            service_name: default_service_name(),
        }
    }
}

fn default_service_name() -> String {
    DEFAULT_SERVICE_NAME.into()
}

/// `[server]`: listeners and connection hardening.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    #[serde(default = "default_listen")]
    pub listen: String,
    #[serde(default = "default_admin_listen")]
    pub admin_listen: String,
    /// Larger request bodies are answered 413 and nothing is forwarded.
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: u64,
    /// A client must finish sending its request head within this time.
    #[serde(default = "default_header_read_timeout")]
    pub header_read_timeout: HumanDuration,
    /// A protected route must receive the whole request body within this
    /// (it is buffered to fingerprint it); slower clients get 408.
    #[serde(default = "default_body_read_timeout")]
    pub body_read_timeout: HumanDuration,
    /// Connections beyond this are answered `503 connections-exhausted`
    /// at once (while a reserve of refusals and the descriptors last;
    /// past them they wait in the kernel's accept queue). Split evenly
    /// across worker threads (each counts its own connections: a
    /// shared count could leave a connection waiting on one thread while
    /// another holds the last slot).
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Claims in flight at once across the process (0: twice the
    /// connections the descriptors allow); past it `503 claims-exhausted`.
    #[serde(default)]
    pub max_claims: usize,
    /// Bytes of request bodies buffered at once across the process (the
    /// protected routes read each whole); past it `503 buffers-exhausted`.
    #[serde(default = "default_max_buffered_bytes")]
    pub max_buffered_bytes: u64,
    /// Bytes of upstream answers held across the process until their
    /// record is written. Each claim reserves 64 KiB of it before it is
    /// made (full: `503 buffers-exhausted`); a larger answer waits at most
    /// a second for room, then is kept past it.
    #[serde(default = "default_max_captured_bytes")]
    pub max_captured_bytes: u64,
    /// Threads serving the public listener, each with its own event loop
    /// and upstream connection pool, all accepting from one shared socket;
    /// 0 = one per CPU.
    #[serde(default)]
    pub worker_threads: usize,
    /// How long in-flight requests may take to finish after SIGTERM.
    #[serde(default = "default_shutdown_grace")]
    pub shutdown_grace: HumanDuration,
    /// HTTP/2 beside HTTP/1.1 on the public listener: h2c with prior
    /// knowledge on a plain listener, ALPN `h2` with TLS.
    #[serde(default = "default_http2")]
    pub http2: bool,
    /// `[server.tls]`: terminate TLS on the public listener.
    #[serde(default)]
    pub tls: Option<ServerTlsConfig>,
    /// `[server.cors]`: browser clients on other origins.
    #[serde(default)]
    pub cors: Option<CorsConfig>,
    /// The bearer token `/admin/*` and the dashboard's actions require
    /// (`IDEMGATE_ADMIN_TOKEN` overrides it); empty: none, allowed only on
    /// a loopback `admin_listen`.
    #[serde(default)]
    pub admin_token: String,
    /// A file holding the admin token (its first line), instead of
    /// `admin_token`: kept out of the configuration file.
    #[serde(default)]
    pub admin_token_file: Option<String>,
}

/// `[server.cors]`: which other origins' scripts may call the gateway.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CorsConfig {
    /// `scheme://host[:port]` of each allowed origin (empty: CORS off).
    #[serde(default)]
    pub allow_origins: Vec<String>,
    /// Request headers allowed besides `Content-Type`, `Idempotency-Key`,
    /// `Idempotency-Token` and `X-Request-Id` (e.g. `Authorization`).
    #[serde(default)]
    pub allow_headers: Vec<String>,
    /// Let scripts send cookies and credentials (a cookie session).
    #[serde(default)]
    pub allow_credentials: bool,
    /// How long a browser may cache a preflight's answer.
    #[serde(default = "default_cors_max_age")]
    pub max_age: HumanDuration,
}

/// `[server.tls]`: the public listener's certificate chain and key (PEM).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerTlsConfig {
    pub cert: String,
    pub key: String,
}

/// `[store]`: the durable record and its fast layer.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    #[serde(default = "default_database_url")]
    pub database_url: String,
    #[serde(default)]
    pub redis_url: String,
    #[serde(default = "default_retention")]
    pub retention: HumanDuration,
    #[serde(default = "default_lease")]
    pub lease: HumanDuration,
    #[serde(default = "default_store_timeout")]
    pub timeout: HumanDuration,
    #[serde(default = "default_sweep_interval")]
    pub sweep_interval: HumanDuration,
    #[serde(default)]
    pub archive: bool,
    /// After `retention`, how long a record is kept as a fingerprint-only
    /// tombstone: the same request gets 410 instead of executing again.
    #[serde(default = "default_tombstone")]
    pub tombstone: HumanDuration,
    /// A fast-layer answer slower than this sends the request down the SQL
    /// path (and is counted in `idemgate_store_fallback_total`).
    #[serde(default = "default_fast_layer_budget")]
    pub fast_layer_budget: HumanDuration,
    /// Response bodies larger than this are recorded without their body.
    #[serde(default = "default_max_stored_body_bytes")]
    pub max_stored_body_bytes: usize,
    /// Bytes the in-process fast layer may hold (least recently used
    /// answers go first; replays then come from SQL).
    #[serde(default = "default_memory_layer_bytes")]
    pub memory_layer_bytes: usize,
    /// Connections in the SQL pool.
    #[serde(default = "default_pool_size")]
    pub pool_size: u32,
    /// Prefix of every Redis key this gateway writes.
    #[serde(default = "default_redis_prefix")]
    pub redis_prefix: String,
}

/// `[tokens]`: one-time tokens issued by `/token`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenConfig {
    #[serde(default = "default_token_ttl")]
    pub ttl: HumanDuration,
    /// The HMAC secret (a one-element `secrets`).
    #[serde(default)]
    pub secret: String,
    /// Rotation: sign with the first, verify with any.
    #[serde(default)]
    pub secrets: Vec<String>,
    /// Tokens one principal may be issued per minute (0: no limit); past
    /// it `429` with `Retry-After`.
    #[serde(default)]
    pub issue_per_minute: u32,
}

/// `[identity]`: who a client is (see [`idemgate_core::identity`]).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentityConfig {
    /// The header that identifies a client (hashed); with `[identity.jwt]`
    /// the header carrying `Bearer <jwt>`.
    #[serde(default = "default_identity_header")]
    pub header: String,
    /// `[identity.jwt]`: scope by a verified claim instead.
    #[serde(default)]
    pub jwt: Option<JwtConfig>,
}

/// `[identity.jwt]`: the principal is a verified JWT's claim.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JwtConfig {
    /// The claim naming the principal.
    #[serde(default = "default_jwt_claim")]
    pub claim: String,
    /// HS256: the shared secret (at least 32 bytes)…
    pub hs256_secret: Option<String>,
    /// …or the environment variable holding it.
    pub hs256_secret_env: Option<String>,
    /// RS256/ES256: a JWKS file (`{"keys": […]}`), read at start-up.
    pub jwks_file: Option<String>,
    /// The one accepted `iss` (a one-element `issuers`).
    pub issuer: Option<String>,
    /// The accepted `iss` values (empty, with no `issuer`: any). The
    /// token's own `iss` is part of the principal either way: the same
    /// claim from two issuers is two clients.
    #[serde(default)]
    pub issuers: Vec<String>,
    /// Required `aud`.
    pub audience: Option<String>,
    /// Clock skew allowed on `exp` and `nbf`.
    #[serde(default = "default_jwt_leeway")]
    pub leeway: HumanDuration,
}

/// `[[upstreams]]`: a service requests are forwarded to.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    pub name: String,
    pub url: String,
    #[serde(default = "default_upstream_timeout")]
    pub timeout: HumanDuration,
    /// `https://` only: a PEM bundle trusted instead of the system roots.
    #[serde(default)]
    pub ca_file: Option<String>,
    /// `https://` only: the client certificate chain for mutual TLS.
    #[serde(default)]
    pub client_cert: Option<String>,
    /// `https://` only: the client certificate's private key.
    #[serde(default)]
    pub client_key: Option<String>,
    /// Speak HTTP/2 to this upstream (ALPN over TLS, prior knowledge over
    /// plain HTTP).
    #[serde(default)]
    pub http2: bool,
    /// At most this many HTTP/1.1 connections to it at once (0: no cap),
    /// split over the workers; past it requests wait for a connection to
    /// come back, up to the connect timeout (half the timeout, at most
    /// 5 s), then `503 upstream-busy`.
    #[serde(default = "default_upstream_max_connections")]
    pub max_connections: usize,
    /// How long an uncertain outcome keeps its key from being forwarded
    /// again (a copy may still be running here); default: `timeout`.
    #[serde(default)]
    pub uncertain_hold: Option<HumanDuration>,
    /// Answers that may mean the action ran (5xx only): a proxy in front
    /// of the service sends `502`/`504` for an answer it lost; add `500`
    /// for a service that may fail after its commit. Such an answer makes
    /// the record uncertain, never released.
    #[serde(default = "default_uncertain_statuses")]
    pub uncertain_statuses: Vec<u16>,
}

/// `[[routes]]`: which requests go where, under which policy.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub name: String,
    /// The identity its records (and the tokens bound to it) are kept
    /// under; default: `name`. Keep it to rename a route without losing
    /// its live and retained records.
    pub id: Option<String>,
    /// Empty means every method.
    #[serde(default)]
    pub methods: Vec<String>,
    pub path: Option<String>,
    pub path_prefix: Option<String>,
    pub upstream: String,
    #[serde(default)]
    pub kind: RouteKind,
    /// Absent means `none` on sync routes; callback routes must leave it out.
    pub idempotency: Option<Idempotency>,
    #[serde(default = "default_require_key")]
    pub require_key: bool,
    #[serde(default)]
    pub on_concurrent: OnConcurrent,
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

pub use idemgate::callback::SignatureScheme;

/// `kind`: how a route's callers behave.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RouteKind {
    #[default]
    Sync,
    Callback,
}

/// `idempotency`: the policy of a sync route.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Idempotency {
    #[default]
    None,
    Key,
    Token,
}

pub use idemgate::idempotency::OnConcurrent;

impl fmt::Display for RouteKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RouteKind::Sync => "sync",
            RouteKind::Callback => "callback",
        })
    }
}

impl fmt::Display for Idempotency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Idempotency::None => "none",
            Idempotency::Key => "key",
            Idempotency::Token => "token",
        })
    }
}

// === impl HumanDuration ===

/// A duration written the human way (`500ms`, `30s`, `10m`, `24h`).
///
/// Deserializing never fails on a bad value: the raw text is kept so that
/// [`Config::validate`] can report every bad duration at once.
#[derive(Debug, Clone)]
pub struct HumanDuration {
    raw: String,
    parsed: Option<Duration>,
}

impl HumanDuration {
    fn from_text(raw: &str) -> Self {
        let parsed = humantime::parse_duration(raw.trim()).ok();
        HumanDuration {
            raw: raw.to_owned(),
            parsed,
        }
    }

    /// The value; zero when invalid (validation has refused such a config).
    pub fn get(&self) -> Duration {
        self.parsed.unwrap_or_default()
    }

    /// The value when it is usable (parsed and above zero); `None` when
    /// [`HumanDuration::problem`] reports it, so checks that compare two
    /// durations skip a value that is already refused on its own.
    fn valid(&self) -> Option<Duration> {
        self.parsed.filter(|d| !d.is_zero())
    }

    /// [`Self::problem`] for a key whose zero means "off".
    fn problem_unless_zero(&self) -> Option<String> {
        match self.parsed {
            Some(d) if d.is_zero() => None,
            _ => self.problem(),
        }
    }

    fn problem(&self) -> Option<String> {
        match self.parsed {
            None => Some(format!(
                "{:?} is not a duration (write e.g. \"500ms\", \"30s\", \"10m\", \"24h\")",
                self.raw
            )),
            Some(d) if d.is_zero() => Some(format!("{:?} must be longer than zero", self.raw)),
            Some(_) => None,
        }
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(d)?;
        Ok(HumanDuration::from_text(&raw))
    }
}

impl From<&str> for HumanDuration {
    fn from(raw: &str) -> Self {
        HumanDuration::from_text(raw)
    }
}

impl From<Duration> for HumanDuration {
    fn from(d: Duration) -> Self {
        HumanDuration {
            raw: humantime::format_duration(d).to_string(),
            parsed: Some(d),
        }
    }
}

// === defaults ===

fn default_listen() -> String {
    DEFAULT_LISTEN.into()
}
fn default_admin_listen() -> String {
    DEFAULT_ADMIN_LISTEN.into()
}
fn default_max_body_bytes() -> u64 {
    DEFAULT_MAX_BODY_BYTES
}
fn default_max_buffered_bytes() -> u64 {
    DEFAULT_MAX_BUFFERED_BYTES
}
fn default_max_captured_bytes() -> u64 {
    DEFAULT_MAX_CAPTURED_BYTES
}
fn default_header_read_timeout() -> HumanDuration {
    DEFAULT_HEADER_READ_TIMEOUT.into()
}
fn default_body_read_timeout() -> HumanDuration {
    DEFAULT_BODY_READ_TIMEOUT.into()
}
fn default_max_connections() -> usize {
    DEFAULT_MAX_CONNECTIONS
}
fn default_shutdown_grace() -> HumanDuration {
    DEFAULT_SHUTDOWN_GRACE.into()
}
fn default_database_url() -> String {
    DEFAULT_DATABASE_URL.into()
}
fn default_retention() -> HumanDuration {
    DEFAULT_RETENTION.into()
}
fn default_lease() -> HumanDuration {
    DEFAULT_LEASE.into()
}
fn default_store_timeout() -> HumanDuration {
    DEFAULT_STORE_TIMEOUT.into()
}
fn default_sweep_interval() -> HumanDuration {
    DEFAULT_SWEEP_INTERVAL.into()
}
fn default_fast_layer_budget() -> HumanDuration {
    DEFAULT_FAST_LAYER_BUDGET.into()
}
fn default_max_stored_body_bytes() -> usize {
    DEFAULT_MAX_STORED_BODY_BYTES
}
fn default_tombstone() -> HumanDuration {
    DEFAULT_TOMBSTONE.into()
}
fn default_memory_layer_bytes() -> usize {
    idemgate_store::memory::DEFAULT_MAX_BYTES
}
fn default_pool_size() -> u32 {
    DEFAULT_POOL_SIZE
}
fn default_redis_prefix() -> String {
    DEFAULT_REDIS_PREFIX.into()
}
fn default_token_ttl() -> HumanDuration {
    DEFAULT_TOKEN_TTL.into()
}
fn default_identity_header() -> String {
    DEFAULT_IDENTITY_HEADER.into()
}
fn default_jwt_claim() -> String {
    DEFAULT_JWT_CLAIM.into()
}
fn default_jwt_leeway() -> HumanDuration {
    DEFAULT_JWT_LEEWAY.into()
}
fn default_upstream_max_connections() -> usize {
    DEFAULT_UPSTREAM_MAX_CONNECTIONS
}
fn default_upstream_timeout() -> HumanDuration {
    DEFAULT_UPSTREAM_TIMEOUT.into()
}
fn default_uncertain_statuses() -> Vec<u16> {
    idemgate::idempotency::outcome::DEFAULT_UNCERTAIN_STATUSES.to_vec()
}
fn default_signature_tolerance() -> HumanDuration {
    DEFAULT_SIGNATURE_TOLERANCE.into()
}
fn default_cors_max_age() -> HumanDuration {
    DEFAULT_CORS_MAX_AGE.into()
}
fn default_require_key() -> bool {
    true
}
fn default_http2() -> bool {
    DEFAULT_HTTP2
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: default_listen(),
            admin_listen: default_admin_listen(),
            max_body_bytes: default_max_body_bytes(),
            header_read_timeout: default_header_read_timeout(),
            body_read_timeout: default_body_read_timeout(),
            max_connections: default_max_connections(),
            max_claims: 0,
            max_buffered_bytes: default_max_buffered_bytes(),
            max_captured_bytes: default_max_captured_bytes(),
            worker_threads: 0,
            shutdown_grace: default_shutdown_grace(),
            http2: DEFAULT_HTTP2,
            tls: None,
            cors: None,
            admin_token: String::new(),
            admin_token_file: None,
        }
    }
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            database_url: default_database_url(),
            redis_url: String::new(),
            retention: default_retention(),
            lease: default_lease(),
            timeout: default_store_timeout(),
            sweep_interval: default_sweep_interval(),
            archive: false,
            tombstone: default_tombstone(),
            fast_layer_budget: default_fast_layer_budget(),
            max_stored_body_bytes: default_max_stored_body_bytes(),
            memory_layer_bytes: default_memory_layer_bytes(),
            pool_size: default_pool_size(),
            redis_prefix: default_redis_prefix(),
        }
    }
}

impl Default for TokenConfig {
    fn default() -> Self {
        TokenConfig {
            ttl: default_token_ttl(),
            secret: String::new(),
            secrets: Vec::new(),
            issue_per_minute: 0,
        }
    }
}

impl Default for IdentityConfig {
    fn default() -> Self {
        IdentityConfig {
            header: default_identity_header(),
            jwt: None,
        }
    }
}

// === errors ===

/// One thing wrong with a config file (or, from [`Config::warnings`], one
/// thing risky in it): the key and the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub key: String,
    pub reason: String,
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{origin}: cannot read: {source}")]
    Read {
        origin: String,
        source: std::io::Error,
    },
    #[error("{origin}: {message}")]
    Parse { origin: String, message: String },
    #[error("{origin}: {} problem(s):\n{}", problems.len(), render_problems(problems))]
    Invalid {
        origin: String,
        problems: Vec<Problem>,
    },
}

fn render_problems(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|p| format!("  - {}: {}", p.key, p.reason))
        .collect::<Vec<_>>()
        .join("\n")
}

impl ConfigError {
    /// The collected problems (empty for read and parse errors).
    pub fn problems(&self) -> &[Problem] {
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
}

impl TokenConfig {
    /// The token secrets, newest first: `secrets`, or `secret` alone.
    pub fn secret_list(&self) -> Vec<&str> {
        if self.secrets.is_empty() {
            vec![self.secret.as_str()]
        } else {
            self.secrets.iter().map(String::as_str).collect()
        }
    }
}

impl UpstreamConfig {
    /// How long an uncertain outcome holds its key: `uncertain_hold`, or
    /// the upstream's timeout (the gateway gave up waiting that long; the
    /// upstream usually did not).
    pub fn uncertain_hold(&self) -> Duration {
        self.uncertain_hold
            .as_ref()
            .map_or_else(|| self.timeout.get(), HumanDuration::get)
    }
}

impl JwtConfig {
    /// The accepted issuers: `issuers`, or `issuer` alone.
    pub fn issuer_list(&self) -> Vec<String> {
        match &self.issuer {
            Some(one) if self.issuers.is_empty() => vec![one.clone()],
            _ => self.issuers.clone(),
        }
    }
}

impl UpstreamConfig {
    /// `uncertain_statuses`, checked (validation refuses a status outside
    /// 5xx; none is taken here for one that slipped through).
    pub fn uncertain_statuses(&self) -> idemgate::idempotency::outcome::UncertainStatuses {
        idemgate::idempotency::outcome::UncertainStatuses::new(&self.uncertain_statuses)
            .unwrap_or_default()
    }
}

impl RouteConfig {
    /// The identity its records are kept under: `id`, or the name.
    pub fn record_id(&self) -> &str {
        self.id.as_deref().unwrap_or(&self.name)
    }

    /// The policy this route runs under.
    pub fn idempotency(&self) -> Idempotency {
        self.idempotency.unwrap_or_default()
    }

    /// Whether requests on it are claimed (key, token or callback).
    pub fn is_protected(&self) -> bool {
        self.kind == RouteKind::Callback || self.idempotency() != Idempotency::None
    }
}
