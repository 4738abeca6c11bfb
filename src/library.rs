//! Idemgate as a library: the key, token and callback layers over your own
//! handlers, without the gateway's config file or proxy (SPEC §6).
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
//! let idempotency = idemgate::library::Idempotency::builder()
//!     .database_url("sqlite::memory:") // or sqlite://PATH, postgres://…
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
//! stopped; its record becomes `uncertain` (`502`/`504` to the client) and
//! the next retry runs the handler again with the same stable key in
//! `Idempotency-Key`, for the handler's own state check.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;

use crate::callback::KeySource;
use crate::config::StoreConfig;
use crate::idempotency::{Engine, EngineSettings, Holders};
use crate::identity::Identity;
use crate::metrics::Metrics;
use crate::store::Store;
use crate::token::TokenKeys;

pub use crate::callback::CallbackPolicy;
pub use crate::idempotency::{IdempotencyLayer, IdempotencyService, KeyPolicy, ResponseFuture};
pub use crate::store::StoreError;
pub use crate::token::{TokenEndpoint, TokenPolicy};

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
/// The default lifetime of a `/token` token.
pub const DEFAULT_TOKEN_TTL: Duration = Duration::from_secs(600);

/// Settings of an [`Idempotency`]; every one has a default.
#[derive(Clone)]
pub struct Builder {
    store: StoreConfig,
    identity_header: HeaderName,
    handler_deadline: Duration,
    max_body_bytes: u64,
    body_read_timeout: Duration,
    token_secret: String,
    token_ttl: Duration,
}

impl Builder {
    /// `sqlite://PATH`, `sqlite::memory:` or `postgres://…` (default: the
    /// gateway's `sqlite://data/idemgate.db`).
    pub fn database_url(mut self, url: impl Into<String>) -> Self {
        self.store.database_url = url.into();
        self
    }

    /// `redis://…` for a Redis fast layer (default: in process).
    pub fn redis_url(mut self, url: impl Into<String>) -> Self {
        self.store.redis_url = url.into();
        self
    }

    /// How long a finished request replays (default 24 h).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.store.retention = retention.into();
        self
    }

    /// How long a claim outlives a crashed process (default 30 s).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.store.lease = lease.into();
        self
    }

    /// The bound on every store operation (default 2 s).
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.store.timeout = timeout.into();
        self
    }

    /// The header that identifies a client (default `Authorization`).
    pub fn identity_header(mut self, header: HeaderName) -> Self {
        self.identity_header = header;
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

    /// The HMAC secret of tokens (default: random per process).
    pub fn token_secret(mut self, secret: impl Into<String>) -> Self {
        self.token_secret = secret.into();
        self
    }

    /// Opens the store, applies its migrations and starts the sweeper.
    /// Call it inside a tokio runtime.
    pub async fn build(self) -> Result<Idempotency, StoreError> {
        let metrics = Arc::new(Metrics::default());
        let (store, memory) = crate::store::open(&self.store.options(), metrics.clone()).await?;
        let sweeper = crate::store::sweep::spawn(
            store.sql().clone(),
            memory,
            self.store.sweep_interval.get(),
            self.store.archive,
        );
        let (keys, _) = TokenKeys::new(&self.token_secret);
        Ok(Idempotency {
            inner: Arc::new(Shared {
                store,
                metrics,
                holders: Arc::new(Holders::default()),
                keys: Arc::new(keys),
                budget: crate::idempotency::ClaimBudget::new(DEFAULT_MAX_CLAIMS),
                body_budget: crate::idempotency::body::BodyBudget::new(DEFAULT_MAX_BUFFERED_BYTES),
                settings: self,
                _sweeper: AbortOnDrop(sweeper),
            }),
        })
    }
}

/// The store and settings every layer of an application shares.
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
    budget: crate::idempotency::ClaimBudget,
    /// Request bodies buffered at once across every layer.
    body_budget: crate::idempotency::body::BodyBudget,
    _sweeper: AbortOnDrop,
}

impl Idempotency {
    /// Settings with their defaults.
    pub fn builder() -> Builder {
        Builder {
            store: StoreConfig::default(),
            identity_header: http::header::AUTHORIZATION,
            handler_deadline: DEFAULT_HANDLER_DEADLINE,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            body_read_timeout: DEFAULT_BODY_READ_TIMEOUT,
            token_secret: String::new(),
            token_ttl: DEFAULT_TOKEN_TTL,
        }
    }

    fn engine(&self, route: &str) -> Engine {
        let s = &self.inner.settings;
        Engine::new(
            self.inner.store.clone(),
            EngineSettings {
                route: route.into(),
                identity: Identity::header(s.identity_header.clone()),
                max_body_bytes: s.max_body_bytes,
                body_read_timeout: s.body_read_timeout,
                max_stored_body_bytes: s.store.max_stored_body_bytes,
                on_concurrent: crate::config::OnConcurrent::Reject,
                wait_limit: s.handler_deadline,
                // The handler runs in process: past its deadline its future
                // is dropped, but it may have spawned work; hold as long.
                uncertain_hold: s.handler_deadline,
                reconcile: None,
                budget: self.inner.budget.clone(),
                body_budget: self.inner.body_budget.clone(),
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

    /// The `/token` endpoint (a tower service) issuing tokens for `routes`.
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
    /// `query:name`), scoped by the route.
    pub fn callback_layer(
        &self,
        route: &str,
        business_key: &[&str],
    ) -> Result<IdempotencyLayer<CallbackPolicy>, String> {
        let sources = business_key
            .iter()
            .map(|s| KeySource::parse(s))
            .collect::<Result<Vec<_>, _>>()?;
        if sources.is_empty() {
            return Err("a callback route needs at least one business_key source".into());
        }
        Ok(IdempotencyLayer::new(
            self.engine(route),
            CallbackPolicy::new(sources, None),
        ))
    }

    /// Prometheus text of this instance's counters.
    pub fn metrics(&self) -> String {
        self.inner.metrics.render()
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The README's library section, compiled as a doc test: what a newcomer
/// copies must build.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeLibrarySection;

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use axum::body::Body;
    use http::{Request, StatusCode};
    use tower::{ServiceBuilder, ServiceExt};

    use super::*;

    async fn in_memory(builder: Builder) -> Idempotency {
        builder
            .database_url("sqlite::memory:")
            .build()
            .await
            .unwrap()
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
