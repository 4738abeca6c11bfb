//! [`IdempotencyLayer`]: a [`Policy`] plus the [`Engine`], in front of a
//! route's proxy.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::Bytes;
use http::{Request, Response};
use tower::{Layer, Service, ServiceExt};

use idemgate_core::request_id::{self, X_REQUEST_ID};

use super::engine::Engine;
use super::policy::Policy;
use super::verdict::Answer;

/// Applies a policy and the engine to a route.
#[derive(Clone)]
pub struct IdempotencyLayer<P> {
    engine: Engine,
    policy: P,
}

impl<P> IdempotencyLayer<P> {
    /// A layer running `policy` through `engine`.
    pub fn new(engine: Engine, policy: P) -> Self {
        IdempotencyLayer { engine, policy }
    }
}

impl<S, P: Clone> Layer<S> for IdempotencyLayer<P> {
    type Service = IdempotencyService<S, P>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService {
            inner,
            engine: self.engine.clone(),
            policy: self.policy.clone(),
        }
    }
}

/// The service [`IdempotencyLayer`] makes: any request body in, the inner
/// service's answer (any body) out, both as [`axum::body::Body`] to the
/// engine, which buffers the request body to fingerprint it and stores
/// the answer it relays.
#[derive(Clone)]
pub struct IdempotencyService<S, P> {
    inner: S,
    engine: Engine,
    policy: P,
}

impl<S, P, ReqBody, ResBody> Service<Request<ReqBody>> for IdempotencyService<S, P>
where
    S: Service<Request<Body>, Response = Response<ResBody>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send,
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<axum::BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<axum::BoxError>,
    P: Policy,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // The inner service is driven with `oneshot` (polled ready right
        // before its one call), because the engine decides only after the
        // store answers whether to call it at all.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let engine = self.engine.clone();
        let policy = self.policy.clone();
        let inner = self.inner.clone().map_response(boxed_body as fn(_) -> _);
        let mut req = req.map(Body::new);
        // Every request is named (kept when the client named it): the id
        // goes upstream, into the record, and back on the answer — in the
        // gateway the router has already set it; mounted by itself, the
        // layer does.
        let id = request_id::ensure(req.headers_mut());
        ResponseFuture {
            inner: Box::pin(async move {
                let Answer {
                    verdict,
                    mut response,
                } = engine.handle(policy, inner, req).await;
                response.headers_mut().entry(X_REQUEST_ID).or_insert(id);
                // Typed, for the layers outside (the gateway's router
                // counts it).
                response.extensions_mut().insert(verdict);
                Ok(response)
            }),
        }
    }
}

/// The inner service's answer with its body as the engine's one type
/// (`Body::new` passes an `axum::body::Body` through unwrapped).
fn boxed_body<B>(response: Response<B>) -> Response<Body>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    response.map(Body::new)
}

/// The response future of [`IdempotencyService`].
pub struct ResponseFuture {
    inner: Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>,
}

impl Future for ResponseFuture {
    type Output = Result<Response<Body>, Infallible>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

#[cfg(test)]
mod tests {
    //! The layer over a plain handler, driven with `oneshot` in the manner
    //! of tower-http's own tests: each rule in milliseconds, no process.

    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    use tower::{ServiceBuilder, ServiceExt};

    use super::*;
    use crate::idempotency::{EngineSettings, Holders, KeyPolicy, OnConcurrent};
    use idemgate_core::metrics::Metrics;
    use idemgate_store::StoreOptions;

    async fn layer(on_concurrent: OnConcurrent) -> IdempotencyLayer<KeyPolicy> {
        let options = StoreOptions {
            database_url: "sqlite::memory:".into(),
            in_memory_for_tests: true,
            ..StoreOptions::default()
        };
        let metrics = Arc::new(Metrics::default());
        let (store, _) = idemgate_store::open(&options, metrics.clone())
            .await
            .unwrap();
        let engine = Engine::new(
            store,
            EngineSettings {
                max_body_bytes: 1024,
                body_read_timeout: Duration::from_secs(5),
                max_stored_body_bytes: 1024,
                on_concurrent,
                wait_limit: Duration::from_secs(5),
                uncertain_hold: Duration::from_secs(5),
                in_process: true,
                ..EngineSettings::new(
                    "orders",
                    idemgate_core::identity::Identity::header(http::header::AUTHORIZATION),
                )
            },
            metrics,
            Arc::new(Holders::default()),
        );
        IdempotencyLayer::new(engine, KeyPolicy { require_key: true })
    }

    /// A handler that counts its calls and answers `status` after `delay`.
    fn handler(
        calls: Arc<AtomicU32>,
        statuses: &'static [u16],
        delay: Duration,
    ) -> impl Service<
        Request<Body>,
        Response = Response<Body>,
        Error = Infallible,
        Future = impl Send,
    > + Clone
    + Send
    + Sync
    + 'static {
        tower::service_fn(move |_req: Request<Body>| {
            let calls = calls.clone();
            async move {
                let n = calls.fetch_add(1, Ordering::SeqCst) as usize;
                tokio::time::sleep(delay).await;
                let mut response = Response::new(Body::from(format!("call {n}")));
                *response.status_mut() =
                    http::StatusCode::from_u16(statuses[n.min(statuses.len() - 1)]).unwrap();
                Ok::<_, Infallible>(response)
            }
        })
    }

    fn order(key: Option<&str>, body: &'static str) -> Request<Body> {
        let mut b = Request::post("/orders");
        if let Some(key) = key {
            b = b.header("idempotency-key", key);
        }
        b.body(Body::from(body)).unwrap()
    }

    async fn text(response: Response<Body>) -> String {
        let bytes = http_body_util::BodyExt::collect(response.into_body())
            .await
            .unwrap()
            .to_bytes();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    #[tokio::test]
    async fn a_repeat_is_replayed_without_calling_the_handler() {
        let calls = Arc::new(AtomicU32::new(0));
        let service = ServiceBuilder::new()
            .layer(layer(OnConcurrent::Reject).await)
            .service(handler(calls.clone(), &[201], Duration::ZERO));
        let first = service
            .clone()
            .oneshot(order(Some("k"), "{}"))
            .await
            .unwrap();
        assert_eq!(first.status(), 201);
        let again = service
            .clone()
            .oneshot(order(Some("k"), "{}"))
            .await
            .unwrap();
        assert_eq!(again.status(), 201);
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(text(again).await, "call 0");
        let other = service
            .clone()
            .oneshot(order(Some("k"), "{\"x\":1}"))
            .await
            .unwrap();
        assert_eq!(other.status(), 422);
        let missing = service.oneshot(order(None, "{}")).await.unwrap();
        assert_eq!(missing.status(), 400);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn any_request_and_response_body_type_goes_through_the_layer() {
        // A plain hyper-style service: `Full<Bytes>` in, `String` out. The
        // layer must fingerprint the first and store the second.
        let calls = Arc::new(AtomicU32::new(0));
        let counted = calls.clone();
        let service = ServiceBuilder::new()
            .layer(layer(OnConcurrent::Reject).await)
            .service(tower::service_fn(move |req: Request<Body>| {
                let calls = counted.clone();
                async move {
                    let body = http_body_util::BodyExt::collect(req.into_body())
                        .await
                        .unwrap()
                        .to_bytes();
                    let n = calls.fetch_add(1, Ordering::SeqCst);
                    let answer = format!("call {n} got {}", String::from_utf8_lossy(&body));
                    Ok::<_, Infallible>(Response::new(answer))
                }
            }));
        let order = |body: &'static str| {
            Request::post("/orders")
                .header("idempotency-key", "k")
                .body(http_body_util::Full::new(Bytes::from_static(
                    body.as_bytes(),
                )))
                .unwrap()
        };
        let first = service.clone().oneshot(order("{}")).await.unwrap();
        assert_eq!(text(first).await, "call 0 got {}");
        let again = service.clone().oneshot(order("{}")).await.unwrap();
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(text(again).await, "call 0 got {}");
        let other = service.oneshot(order("{\"x\":1}")).await.unwrap();
        assert_eq!(other.status(), 422);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_5xx_releases_the_claim_and_the_retry_runs() {
        let calls = Arc::new(AtomicU32::new(0));
        let service = ServiceBuilder::new()
            .layer(layer(OnConcurrent::Reject).await)
            .service(handler(calls.clone(), &[503, 201], Duration::ZERO));
        let failed = service
            .clone()
            .oneshot(order(Some("k"), "{}"))
            .await
            .unwrap();
        assert_eq!(failed.status(), 503);
        let retried = service
            .clone()
            .oneshot(order(Some("k"), "{}"))
            .await
            .unwrap();
        assert_eq!(retried.status(), 201);
        assert!(retried.headers().get("idempotent-replayed").is_none());
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_duplicate_in_flight_is_409_or_with_wait_the_first_outcome() {
        for (mode, want) in [(OnConcurrent::Reject, 409), (OnConcurrent::Wait, 201)] {
            let calls = Arc::new(AtomicU32::new(0));
            let service = ServiceBuilder::new()
                .layer(layer(mode).await)
                .service(handler(calls.clone(), &[201], Duration::from_millis(300)));
            let first = tokio::spawn(service.clone().oneshot(order(Some("k"), "{}")));
            // The duplicate arrives once the first holds the claim.
            while calls.load(Ordering::SeqCst) == 0 {
                tokio::task::yield_now().await;
            }
            let duplicate = service
                .clone()
                .oneshot(order(Some("k"), "{}"))
                .await
                .unwrap();
            assert_eq!(duplicate.status(), want, "{mode:?}");
            assert_eq!(first.await.unwrap().unwrap().status(), 201);
            assert_eq!(calls.load(Ordering::SeqCst), 1, "{mode:?}");
        }
    }

    #[tokio::test]
    async fn a_dropped_caller_does_not_cancel_the_handler() {
        let calls = Arc::new(AtomicU32::new(0));
        let service = ServiceBuilder::new()
            .layer(layer(OnConcurrent::Reject).await)
            .service(handler(calls.clone(), &[201], Duration::from_millis(200)));
        // The caller gives up after 50 ms (as a client hanging up does).
        let gave_up = tokio::time::timeout(
            Duration::from_millis(50),
            service.clone().oneshot(order(Some("k"), "{}")),
        )
        .await;
        assert!(gave_up.is_err());
        tokio::time::sleep(Duration::from_millis(400)).await;
        let retry = service.oneshot(order(Some("k"), "{}")).await.unwrap();
        assert_eq!(retry.headers()["idempotent-replayed"], "true");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}
