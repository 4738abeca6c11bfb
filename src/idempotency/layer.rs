//! [`IdempotencyLayer`]: a [`Policy`] plus the [`Engine`], in front of a
//! route's proxy.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, Request, Response};
use tower::{Layer, Service};

use super::engine::Engine;
use crate::error::Problem;
use crate::store::RecordKey;

/// What a policy read from the request head.
#[derive(Debug, Clone)]
pub enum Head {
    /// Protect the request under this key.
    Key(String),
    /// Forward without protection (a key route with `require_key = false`
    /// and no key).
    Bypass,
    /// The key is in the body: read it first ([`Policy::key_in_body`]).
    FromBody,
    /// Only replay a finished outcome stored under this key; otherwise
    /// answer `refusal` (a used token past its expiry).
    ReplayOnly { key: String, refusal: Problem },
}

/// Where a route's idempotency key comes from.
pub trait Policy: Clone + Send + Sync + 'static {
    /// The layer's name in logs (`key`, `token`, `callback`).
    const LAYER: &'static str;

    /// Reads the key from the head, or refuses the request (4xx) before its
    /// body is read and before any store access.
    fn key_in_head(&self, parts: &Parts, scope: &str) -> Result<Head, Problem>;

    /// Reads the key from the buffered body (callback routes).
    fn key_in_body(&self, _parts: &Parts, _body: &Bytes) -> Result<String, Problem> {
        Err(Problem::new(
            http::StatusCode::INTERNAL_SERVER_ERROR,
            "policy-error",
            "This route's policy reads no body",
        ))
    }

    /// Removes what must not reach the upstream (client credentials such as
    /// the one-time token).
    fn strip(&self, _headers: &mut HeaderMap) {}

    /// Which record a key names (SPEC §1 rule 4): by default the client's
    /// scope, the route and the key. Policies whose keys are not the
    /// client's own say otherwise (a callback's sender rotates credentials;
    /// a token is one action whatever route it is used on).
    fn record_key(&self, client_scope: String, route: &str, key: String) -> RecordKey {
        RecordKey::new(client_scope, route, key)
    }
}

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
    type Service = Idempotency<S, P>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency {
            inner,
            engine: self.engine.clone(),
            policy: self.policy.clone(),
        }
    }
}

/// The service [`IdempotencyLayer`] makes.
#[derive(Clone)]
pub struct Idempotency<S, P> {
    inner: S,
    engine: Engine,
    policy: P,
}

impl<S, P> Service<Request<Body>> for Idempotency<S, P>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send,
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

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let engine = self.engine.clone();
        let policy = self.policy.clone();
        let inner = self.inner.clone();
        ResponseFuture {
            inner: Box::pin(async move { Ok(engine.handle(policy, inner, req).await) }),
        }
    }
}

/// The response future of [`Idempotency`].
pub struct ResponseFuture {
    inner: Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>,
}

impl Future for ResponseFuture {
    type Output = Result<Response<Body>, Infallible>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}
