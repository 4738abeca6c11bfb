//! A route's whole stack behind one object-safe trait: what the router
//! calls, and what both the proxy (a pass-through route) and a policy stack
//! (a tower service, through [`TowerHandler`]) are.
//!
//! A [`Handler`] is called through `&self`, so the router drives a shared
//! stack without cloning it; [`TowerHandler`] clones the tower service for
//! each call as tower's readiness contract requires.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;

use axum::body::Body;
use http::{Request, Response};
use tower::{Service, ServiceExt};

/// The future a [`Handler`] answers with.
pub type HandlerFuture = Pin<Box<dyn Future<Output = Response<Body>> + Send>>;

/// A route's whole stack, called through a shared reference.
pub trait Handler: Send + Sync + 'static {
    /// Answers one request (problems are answers too).
    fn call(&self, req: Request<Body>) -> HandlerFuture;
}

/// A cloneable tower service as a [`Handler`]: each call drives a fresh
/// clone with `oneshot`, which polls it ready first (tower's "call the
/// service you polled ready").
#[derive(Clone)]
pub struct TowerHandler<S>(pub S);

impl<S> Handler for TowerHandler<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send,
{
    fn call(&self, req: Request<Body>) -> HandlerFuture {
        let service = self.0.clone();
        Box::pin(async move {
            match service.oneshot(req).await {
                Ok(response) => response,
                Err(never) => match never {},
            }
        })
    }
}
