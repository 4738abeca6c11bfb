//! Idemgate as a library: the key, token and callback layers over your own
//! handlers, without the gateway's config file or proxy.
//!
//! [`Idempotency`] owns what every layer shares: the store (SQL record,
//! optional Redis), the sweeper that retires expired records, and the list
//! of claims this process holds. Build it once with [`Idempotency::builder`]
//! and hand out a layer per route:
//!
//! ```
//! use axum::{Router, body::Body, http::{Request, StatusCode}, routing::post};
//! use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let idempotency = idemgate::Idempotency::builder()
//!     .in_memory_for_tests() // in production: .database_url("sqlite://PATH", "postgres://…" or "mysql://…")
//!     .build()
//!     .await?;
//! let app = Router::new()
//!     .route("/orders", post(|| async { (StatusCode::CREATED, "ord_1") }))
//!     .route_layer(idempotency.key_layer("create-order"));
//!
//! let order = || {
//!     Request::post("/orders")
//!         .header("idempotency-key", "order-42")
//!         .body(Body::from(r#"{"item":"book"}"#))
//!         .unwrap()
//! };
//! let first = app.clone().oneshot(order()).await?;
//! assert_eq!(first.status(), StatusCode::CREATED);
//! // The retry is answered from the record; the handler does not run again.
//! let retry = app.oneshot(order()).await?;
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! # Ok(()) }
//! ```
//!
//! The handler behind a layer runs in the claim's own task: a client that
//! hangs up does not cancel it, and its outcome is recorded either way. What
//! "uncertain" means in process: a handler that panics, or that does not
//! finish within [`Builder::handler_deadline`], may have acted before it
//! stopped, and work it spawned may still be running; its record becomes
//! `uncertain` (`502`/`504` to the client, with `Retry-After`). A retry
//! within the next `handler_deadline` is held (`502 outcome-uncertain`,
//! nothing runs); the retry after it runs the handler once more with the
//! same stable key in `Idempotency-Key`, for the handler's own state check.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;
use idemgate_core::budget::ClaimBudget;
use idemgate_core::identity::Identity;
use idemgate_core::metrics::Metrics;
use idemgate_store::{Store, StoreOptions};

use crate::callback::{KeySource, SignatureScheme, SignatureSpec, Verifier};
use crate::idempotency::answer::AnswerBudget;
use crate::idempotency::body::BodyBudget;
use crate::idempotency::{Engine, EngineSettings, Holders};
use crate::token::TokenKeys;

use crate::callback::CallbackPolicy;
use crate::idempotency::{IdempotencyLayer, KeyPolicy, OnConcurrent};
use crate::token::{TokenEndpoint, TokenPolicy};
use idemgate_store::StoreError;

/// The default bound on a handler's whole answer.
pub const DEFAULT_HANDLER_DEADLINE: Duration = Duration::from_secs(10);
/// The default request body limit of a protected route.
pub const DEFAULT_MAX_BODY_BYTES: u64 = 1024 * 1024;
/// The default time a client has to send a protected request's body.
pub const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Handlers a process runs at once behind the layers (a claim outlives its
/// client; past this new ones are `503 claims-exhausted`).
pub const DEFAULT_MAX_CLAIMS: usize = 4096;
/// Bytes of request bodies the layers buffer at once (past this a request
/// is `503 buffers-exhausted`).
pub const DEFAULT_MAX_BUFFERED_BYTES: u64 = 256 * 1024 * 1024;
/// Bytes of handlers' answers the layers hold until their records are
/// written; each claim reserves 64 KiB of it before it is made (past this a
/// request is `503 buffers-exhausted`).
pub use crate::idempotency::answer::DEFAULT_MAX_CAPTURED_BYTES;
/// The default lifetime of a `/token` token.
pub const DEFAULT_TOKEN_TTL: Duration = Duration::from_secs(600);
/// The default signature tolerance of timestamped schemes (Stripe's).
pub const DEFAULT_SIGNATURE_TOLERANCE: Duration = Duration::from_secs(300);

/// Settings of an [`Idempotency`]; every one has a default.
#[derive(Clone)]
pub struct Builder {
    store: StoreOptions,
    sweep_interval: Duration,
    archive: bool,
    max_stored_body_bytes: usize,
    identity_header: HeaderName,
    handler_deadline: Duration,
    max_body_bytes: u64,
    body_read_timeout: Duration,
    token_secret: String,
    token_ttl: Duration,
    on_concurrent: OnConcurrent,
}

impl Builder {
    /// `sqlite://PATH`, `postgres://…` or `mysql://…` (default:
    /// `sqlite://data/idemgate.db`). Each needs its cargo feature (`sqlite`,
    /// the default, `postgres` or `mysql`). A database that dies with the process
    /// (`sqlite::memory:`, `mode=memory`) is refused by [`Self::build`]: its
    /// records would vanish with a restart and every retry after it would
    /// execute again — tests say so with [`Self::in_memory_for_tests`].
    pub fn database_url(mut self, url: impl Into<String>) -> Self {
        self.store.database_url = url.into();
        self
    }

    /// Postgres: keep Idemgate's tables, and the table recording its
    /// migrations, in this schema (created when missing), apart from your
    /// application's own. Default: the connection's `search_path`; either
    /// way Idemgate never touches `_sqlx_migrations`.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.store.schema = Some(schema.into());
        self
    }

    /// `redis://…` for a Redis fast layer (default: in process; needs the
    /// `redis` feature).
    pub fn redis_url(mut self, url: impl Into<String>) -> Self {
        self.store.redis_url = url.into();
        self
    }

    /// The prefix of every Redis key and channel (default `idemgate:`), so
    /// that several applications can share one Redis.
    pub fn redis_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.store.redis_prefix = prefix.into();
        self
    }

    /// How long a finished request replays (default 24 h).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.store.retention = retention;
        self
    }

    /// How long a claim outlives a crashed process (default 30 s).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.store.lease = lease;
        self
    }

    /// The bound on every store operation (default 2 s).
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.store.timeout = timeout;
        self
    }

    /// How often expired records are retired (default 1 min).
    pub fn sweep_interval(mut self, interval: Duration) -> Self {
        self.sweep_interval = interval;
        self
    }

    /// The header that identifies a client (default `Authorization`). A
    /// principal header your auth layer sets (`X-User-Id`) is better: a
    /// refreshed credential is then the same client.
    pub fn identity_header(mut self, header: HeaderName) -> Self {
        self.identity_header = header;
        self
    }

    /// What a duplicate gets while the first request is still running:
    /// `409` (default) or, with [`OnConcurrent::Wait`], the first one's
    /// answer once it has one (bounded by the handler deadline).
    pub fn on_concurrent(mut self, on_concurrent: OnConcurrent) -> Self {
        self.on_concurrent = on_concurrent;
        self
    }

    /// The bound on a handler's whole answer; past it the record is
    /// `uncertain` and the client gets `504` (default 10 s).
    pub fn handler_deadline(mut self, deadline: Duration) -> Self {
        self.handler_deadline = deadline;
        self
    }

    /// The request body limit of protected routes (default 1 MiB).
    pub fn max_body_bytes(mut self, limit: u64) -> Self {
        self.max_body_bytes = limit;
        self
    }

    /// The time a client has to send a protected request's body (default
    /// 30 s); past it the request is refused before any claim.
    pub fn body_read_timeout(mut self, timeout: Duration) -> Self {
        self.body_read_timeout = timeout;
        self
    }

    /// How long a `/token` token can be used (default 10 min).
    pub fn token_ttl(mut self, ttl: Duration) -> Self {
        self.token_ttl = ttl;
        self
    }

    /// An in-memory SQLite store, for tests only: every record dies with
    /// the process, so a restarted application executes every retry
    /// again. Never a default, and refused when given as a URL.
    pub fn in_memory_for_tests(mut self) -> Self {
        self.store.database_url = "sqlite::memory:".into();
        self.store.in_memory_for_tests = true;
        self
    }

    /// The HMAC secret of tokens (default: random per process, so tokens
    /// do not survive a restart and are not accepted by another instance).
    pub fn token_secret(mut self, secret: impl Into<String>) -> Self {
        self.token_secret = secret.into();
        self
    }

    /// Opens the store, applies its migrations and starts the sweeper and
    /// the purge-log follower. Call it inside a tokio runtime.
    pub async fn build(self) -> Result<Idempotency, StoreError> {
        let metrics = Arc::new(Metrics::default());
        // Postgres sizes its record partitions by the sweep interval too.
        let options = idemgate_store::StoreOptions {
            sweep_interval: self.sweep_interval,
            ..self.store.clone()
        };
        let (store, memory) = idemgate_store::open(&options, metrics.clone()).await?;
        // Purges made elsewhere (`idemgate keys purge`, a gateway's admin
        // API) reach the answers this process holds in memory through the
        // purge log, as in the gateway.
        let purge_follower = idemgate_store::follow_purges(store.sql().clone(), memory.clone());
        let sweeper = idemgate_store::spawn_sweeper(
            store.sql().clone(),
            Some(memory),
            self.sweep_interval,
            self.archive,
        );
        let (keys, _) = TokenKeys::new(&self.token_secret);
        Ok(Idempotency {
            inner: Arc::new(Shared {
                store,
                metrics,
                holders: Arc::new(Holders::default()),
                keys: Arc::new(keys),
                budget: ClaimBudget::new(DEFAULT_MAX_CLAIMS),
                body_budget: BodyBudget::new(DEFAULT_MAX_BUFFERED_BYTES),
                answer_budget: AnswerBudget::new(DEFAULT_MAX_CAPTURED_BYTES),
                settings: self,
                _sweeper: AbortOnDrop(sweeper),
                _purge_follower: AbortOnDrop(purge_follower),
            }),
        })
    }
}

/// The store and settings every layer of an application shares.
///
/// Cheap to clone. Its background work (the sweeper that retires expired
/// records, the follower of the purge log) lives as long as this handle *or any layer made from it*: the
/// common `fn app() -> Router` may drop the handle once its layers are
/// mounted.
#[derive(Clone)]
pub struct Idempotency {
    inner: Arc<Shared>,
}

struct Shared {
    store: Store,
    metrics: Arc<Metrics>,
    holders: Arc<Holders>,
    keys: Arc<TokenKeys>,
    settings: Builder,
    /// Handlers running at once across every layer.
    budget: ClaimBudget,
    /// Request bodies buffered at once across every layer.
    body_budget: BodyBudget,
    /// Handlers' answers held until their record is written, across every
    /// layer.
    answer_budget: AnswerBudget,
    _sweeper: AbortOnDrop,
    _purge_follower: AbortOnDrop,
}

impl Idempotency {
    /// Settings with their defaults.
    pub fn builder() -> Builder {
        Builder {
            store: StoreOptions::default(),
            sweep_interval: idemgate_store::DEFAULT_SWEEP_INTERVAL,
            archive: false,
            max_stored_body_bytes: idemgate_store::DEFAULT_MAX_STORED_BODY_BYTES,
            identity_header: http::header::AUTHORIZATION,
            handler_deadline: DEFAULT_HANDLER_DEADLINE,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            body_read_timeout: DEFAULT_BODY_READ_TIMEOUT,
            token_secret: String::new(),
            token_ttl: DEFAULT_TOKEN_TTL,
            on_concurrent: OnConcurrent::Reject,
        }
    }

    fn engine(&self, route: &str) -> Engine {
        let s = &self.inner.settings;
        Engine::new(
            self.inner.store.clone(),
            EngineSettings {
                max_body_bytes: s.max_body_bytes,
                body_read_timeout: s.body_read_timeout,
                max_stored_body_bytes: s.max_stored_body_bytes,
                on_concurrent: s.on_concurrent,
                wait_limit: s.handler_deadline,
                // The handler runs in process: past its deadline its future
                // is dropped, but it may have spawned work; hold as long.
                uncertain_hold: s.handler_deadline,
                budget: self.inner.budget.clone(),
                body_budget: self.inner.body_budget.clone(),
                answer_budget: self.inner.answer_budget.clone(),
                in_process: true,
                // Every layer keeps the shared state (and so the sweeper)
                // alive, whether or not the handle is still around.
                keep_alive: Some(self.inner.clone()),
                ..EngineSettings::new(route, Identity::header(s.identity_header.clone()))
            },
            self.inner.metrics.clone(),
            self.inner.holders.clone(),
        )
    }

    /// `Idempotency-Key` semantics for `route` (a name of your choosing:
    /// records are kept per route). A missing key is `400`.
    pub fn key_layer(&self, route: &str) -> IdempotencyLayer<KeyPolicy> {
        IdempotencyLayer::new(self.engine(route), KeyPolicy { require_key: true })
    }

    /// One-time tokens (`Idempotency-Token`) for `route`; issue them with
    /// [`Self::token_endpoint`].
    pub fn token_layer(&self, route: &str) -> IdempotencyLayer<TokenPolicy> {
        IdempotencyLayer::new(
            self.engine(route),
            TokenPolicy::new(self.inner.keys.clone(), route),
        )
    }

    /// The `/token` endpoint (a tower service; `POST` or `GET`, anything
    /// else `405`) issuing tokens for `routes`.
    pub fn token_endpoint(&self, routes: &[&str]) -> TokenEndpoint {
        let routes: BTreeSet<String> = routes.iter().map(|r| r.to_string()).collect();
        TokenEndpoint::new(
            self.inner.keys.clone(),
            self.inner.settings.token_ttl,
            Identity::header(self.inner.settings.identity_header.clone()),
            routes,
        )
    }

    /// Callback semantics for `route`: deduplicated by the business key
    /// read from `business_key` sources (`json:/pointer`, `header:Name`,
    /// `query:name`), scoped by the route. Without a signature check: use
    /// [`Self::callback`] to add one, so forged ids cannot fill the table.
    pub fn callback_layer(
        &self,
        route: &str,
        business_key: &[&str],
    ) -> Result<IdempotencyLayer<CallbackPolicy>, CallbackError> {
        self.callback(route).business_key(business_key).build()
    }

    /// A callback route, configured step by step: its business key, the
    /// fields a redelivery must repeat, and its signature.
    pub fn callback(&self, route: &str) -> CallbackBuilder {
        CallbackBuilder {
            idempotency: self.clone(),
            route: route.to_owned(),
            business_key: Vec::new(),
            must_match: Vec::new(),
            signature: None,
        }
    }

    /// Prometheus text of this instance's counters.
    pub fn metrics(&self) -> String {
        self.inner.metrics.render()
    }
}

/// A callback route being configured; [`CallbackBuilder::build`] makes its
/// layer.
pub struct CallbackBuilder {
    idempotency: Idempotency,
    route: String,
    business_key: Vec<String>,
    must_match: Vec<String>,
    signature: Option<Signature>,
}

impl CallbackBuilder {
    /// Where the business key is read: `json:/pointer` (RFC 6901),
    /// `header:Name`, `query:name`; several form a composite key.
    pub fn business_key(mut self, sources: &[&str]) -> Self {
        self.business_key = sources.iter().map(|s| s.to_string()).collect();
        self
    }

    /// Fields (same syntax) a redelivery with the same business key must
    /// repeat; one that differs is `422 business-key-reused`.
    pub fn must_match(mut self, sources: &[&str]) -> Self {
        self.must_match = sources.iter().map(|s| s.to_string()).collect();
        self
    }

    /// Verifies every delivery before anything is stored: a bad signature
    /// is `401` and leaves no record.
    pub fn signature(mut self, signature: Signature) -> Self {
        self.signature = Some(signature);
        self
    }

    /// The layer.
    pub fn build(self) -> Result<IdempotencyLayer<CallbackPolicy>, CallbackError> {
        let parse = |sources: &[String]| {
            sources
                .iter()
                .map(|s| KeySource::parse(s).map_err(CallbackError::Source))
                .collect::<Result<Vec<_>, _>>()
        };
        let sources = parse(&self.business_key)?;
        if sources.is_empty() {
            return Err(CallbackError::NoBusinessKey);
        }
        let must_match = parse(&self.must_match)?;
        let verifier = match &self.signature {
            None => None,
            Some(signature) => {
                // A signed body is all a signature covers: a key read from a
                // header or the query could be re-stamped by whoever
                // captured a delivery.
                if let Some(unsigned) = self.business_key.iter().find(|s| !s.starts_with("json:")) {
                    return Err(CallbackError::UnsignedSource(unsigned.clone()));
                }
                let spec = SignatureSpec {
                    scheme: signature.scheme,
                    secrets: &signature.secrets,
                    secrets_env: None,
                    header: signature.header.as_deref(),
                    tolerance: signature.tolerance,
                };
                Some(Verifier::new(spec, |_| None).map_err(CallbackError::Signature)?)
            }
        };
        let policy = CallbackPolicy::new(sources, verifier).with_must_match(must_match);
        Ok(IdempotencyLayer::new(
            self.idempotency.engine(&self.route),
            policy,
        ))
    }
}

/// How a callback's deliveries are signed.
#[derive(Clone)]
pub struct Signature {
    scheme: SignatureScheme,
    secrets: Vec<String>,
    header: Option<String>,
    tolerance: Duration,
}

impl Signature {
    /// Standard Webhooks (`webhook-id`, `webhook-timestamp`,
    /// `webhook-signature`); secrets as `whsec_<base64>`, several for
    /// rotation.
    pub fn standard_webhooks(secrets: &[&str]) -> Self {
        Self::of(SignatureScheme::StandardWebhooks, secrets, None)
    }

    /// Stripe's `Stripe-Signature: t=…,v1=…`; several secrets for rotation.
    pub fn stripe(secrets: &[&str]) -> Self {
        Self::of(SignatureScheme::Stripe, secrets, None)
    }

    /// A hex HMAC-SHA256 of the raw body in `header` (no timestamp: a
    /// captured delivery never goes stale).
    pub fn hmac_sha256(header: &str, secrets: &[&str]) -> Self {
        Self::of(SignatureScheme::HmacSha256, secrets, Some(header))
    }

    /// How far a timestamped signature may be from now (default 300 s).
    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    fn of(scheme: SignatureScheme, secrets: &[&str], header: Option<&str>) -> Self {
        Signature {
            scheme,
            secrets: secrets.iter().map(|s| s.to_string()).collect(),
            header: header.map(str::to_owned),
            tolerance: DEFAULT_SIGNATURE_TOLERANCE,
        }
    }
}

/// Why a callback layer could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CallbackError {
    /// A `business_key` or `must_match` source is not `json:/pointer`,
    /// `header:Name` or `query:name`.
    #[error("{0}")]
    Source(String),
    /// No business key source was given.
    #[error("a callback route needs at least one business_key source")]
    NoBusinessKey,
    /// With a signature, every business key source must be in the signed
    /// body.
    #[error("{0:?} is not covered by the signature (only json: sources are signed)")]
    UnsignedSource(String),
    /// The signature settings cannot verify anything (no secret, a bad
    /// `whsec_` secret, a bad header name).
    #[error("{0}")]
    Signature(String),
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// This crate's README, compiled as a doc test: what a newcomer copies
/// must build.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDocTest;

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use axum::body::Body;
    use http::{Request, StatusCode};
    use tower::{ServiceBuilder, ServiceExt};

    use super::*;

    async fn in_memory(builder: Builder) -> Idempotency {
        builder.in_memory_for_tests().build().await.unwrap()
    }

    #[tokio::test]
    async fn a_body_slower_than_body_read_timeout_is_refused_before_the_handler() {
        let idempotency =
            in_memory(Idempotency::builder().body_read_timeout(Duration::from_millis(100))).await;
        let calls = Arc::new(AtomicU32::new(0));
        let counted = calls.clone();
        let service = ServiceBuilder::new()
            .layer(idempotency.key_layer("orders"))
            .service(tower::service_fn(move |_req: Request<Body>| {
                counted.fetch_add(1, Ordering::SeqCst);
                async { Ok::<_, std::convert::Infallible>(http::Response::new(Body::empty())) }
            }));
        // A body that never ends.
        let body = futures_util::stream::pending::<Result<bytes::Bytes, std::io::Error>>();
        let request = Request::post("/orders")
            .header("idempotency-key", "slow")
            .body(Body::from_stream(body))
            .unwrap();
        // Well before the default 30 s: the setting is what ended it.
        let answer = tokio::time::timeout(Duration::from_secs(5), service.oneshot(request))
            .await
            .expect("refused within the configured 100 ms")
            .unwrap();
        assert_eq!(answer.status(), StatusCode::REQUEST_TIMEOUT);
        assert_eq!(calls.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn token_ttl_sets_the_lifetime_of_issued_tokens() {
        let idempotency =
            in_memory(Idempotency::builder().token_ttl(Duration::from_secs(42))).await;
        let answer = idempotency
            .token_endpoint(&["checkout"])
            .oneshot(
                Request::post("/token?route=checkout")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::CREATED);
        let body = http_body_util::BodyExt::collect(answer.into_body())
            .await
            .unwrap()
            .to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["ttl_seconds"], 42, "{json}");
    }
}
