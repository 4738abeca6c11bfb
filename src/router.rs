//! The route table: which stack a request goes through.
//!
//! Each `[[routes]]` entry becomes its own tower stack — a policy layer (none,
//! key, token or callback) over a [`Proxy`] to the route's upstream — boxed
//! as a [`RouteService`]. The router matches path then method, answers 404,
//! 405 and bad paths itself, and is the one place that counts every request
//! (`idemgate_requests_total`) and logs every problem with its route.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use http::{Request, Response};
use tower::util::BoxCloneSyncService;
use tower::{Service, ServiceExt};

use crate::config::RouteMatcher;
use crate::error::{Problem, ProblemLog, ProblemReason};
use crate::metrics::{Outcome, RouteCounters};

/// A route's whole stack, type-erased.
pub type RouteService = BoxCloneSyncService<Request<Body>, Response<Body>, Infallible>;

/// The name of the route a request matched (a request extension).
#[derive(Debug, Clone)]
pub struct RouteName(pub Arc<str>);

/// Why the router answered a request itself.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("no route matches the path")]
    NotFound,
    #[error("the route does not take this method")]
    MethodNotAllowed { allow: String },
    #[error("the path holds dot or empty segments")]
    InvalidPath,
    #[error("both Content-Length and Transfer-Encoding")]
    AmbiguousFraming,
}

/// One entry of the table.
pub struct Route {
    pub name: Arc<str>,
    pub matcher: RouteMatcher,
    pub service: RouteService,
    pub counters: Arc<RouteCounters>,
}

/// The public listener's service: reserved endpoints, then the route table.
#[derive(Clone)]
pub struct Router {
    inner: Arc<Inner>,
}

struct Inner {
    routes: Vec<Route>,
    token: Option<Route>,
}

impl Router {
    /// A router over `routes`; `token` answers `/token` when present.
    pub fn new(routes: Vec<Route>, token: Option<Route>) -> Self {
        Router {
            inner: Arc::new(Inner { routes, token }),
        }
    }

    fn find(&self, req: &Request<Body>) -> Result<&Route, RouteError> {
        // RFC 9112 §6.3: a request with both is a smuggling attempt until
        // proven otherwise; the gateway and an upstream could disagree on
        // where it ends. Refused, and the connection is closed.
        let headers = req.headers();
        if headers.contains_key(http::header::TRANSFER_ENCODING)
            && headers.contains_key(http::header::CONTENT_LENGTH)
        {
            return Err(RouteError::AmbiguousFraming);
        }
        let path = req.uri().path();
        if has_unsafe_segments(path) {
            return Err(RouteError::InvalidPath);
        }
        if let Some(token) = &self.inner.token
            && token.matcher.matches_path(path)
        {
            return if token.matcher.matches_method(req.method()) {
                Ok(token)
            } else {
                Err(RouteError::MethodNotAllowed {
                    allow: allow_list([token]),
                })
            };
        }
        let mut path_matched = Vec::new();
        for route in &self.inner.routes {
            if route.matcher.matches_path(path) {
                if route.matcher.matches_method(req.method()) {
                    return Ok(route);
                }
                path_matched.push(route);
            }
        }
        if path_matched.is_empty() {
            Err(RouteError::NotFound)
        } else {
            Err(RouteError::MethodNotAllowed {
                allow: allow_list(path_matched),
            })
        }
    }
}

fn allow_list<'a>(routes: impl IntoIterator<Item = &'a Route>) -> String {
    let mut methods: Vec<&str> = routes
        .into_iter()
        .flat_map(|r| r.matcher.methods.iter().map(|m| m.as_str()))
        .collect();
    methods.sort_unstable();
    methods.dedup();
    methods.join(", ")
}

/// Refuses `.`/`..` segments (raw or percent-encoded) and empty segments, so
/// that a request can never match one route and, after the upstream
/// normalises its path, execute as another.
fn has_unsafe_segments(path: &str) -> bool {
    if path.contains("//") {
        return true;
    }
    // Byte checks only: this runs on every request, so no allocation.
    let eq = |a: &[u8], b: &[u8]| a.eq_ignore_ascii_case(b);
    path.split('/').skip(1).any(|segment| {
        let s = segment.as_bytes();
        let dot = |part: &[u8]| part == b"." || eq(part, b"%2e");
        let is_dots = match s.len() {
            1 | 3 => dot(s),
            2 => s == b"..",
            4 => (s[0] == b'.' && eq(&s[1..], b"%2e")) || (eq(&s[..3], b"%2e") && s[3] == b'.'),
            6 => eq(s, b"%2e%2e"),
            _ => false,
        };
        let encoded_separator = s.windows(3).any(|w| eq(w, b"%2f") || eq(w, b"%5c"));
        is_dots || encoded_separator
    })
}

/// The outcome a finished response stands for, when no layer said otherwise.
fn outcome_of(response: &Response<Body>) -> Outcome {
    if let Some(outcome) = response.extensions().get::<Outcome>() {
        return *outcome;
    }
    match response.extensions().get::<ProblemReason>() {
        Some(_) if response.status().is_server_error() => Outcome::Error,
        Some(_) => Outcome::Rejected,
        None => Outcome::Forwarded,
    }
}

impl Service<Request<Body>> for Router {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: Request<Body>) -> Self::Future {
        let route = match self.find(&req) {
            Ok(route) => route,
            Err(e) => {
                tracing::debug!(path = %req.uri().path().escape_debug(), error = %e, "no route");
                let mut response = Problem::from(&e).into_response();
                if matches!(e, RouteError::AmbiguousFraming) {
                    // Whatever follows on this connection cannot be trusted.
                    response.headers_mut().insert(
                        http::header::CONNECTION,
                        http::HeaderValue::from_static("close"),
                    );
                }
                return Box::pin(std::future::ready(Ok(response)));
            }
        };
        let name = route.name.clone();
        let counters = route.counters.clone();
        req.extensions_mut().insert(RouteName(name.clone()));
        // Clone the boxed stack for this call: the shared one cannot be
        // driven through `&self`, and `oneshot` polls the clone ready before
        // calling it (tower's "call the service you polled ready").
        let service = route.service.clone();
        Box::pin(async move {
            let response = service.oneshot(req).await?;
            let outcome = outcome_of(&response);
            counters.record(outcome);
            if let Some(log) = response.extensions().get::<ProblemLog>() {
                let status = response.status().as_u16();
                if response.status().is_server_error() {
                    tracing::warn!(route = %name, layer = log.layer, status, cause = %log.cause, "request failed");
                } else {
                    tracing::info!(route = %name, layer = log.layer, status, cause = %log.cause, "request refused");
                }
            }
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsafe_segments_are_detected() {
        for bad in [
            "/a/.%2e/b",
            "/a/%2E./b",
            "/a%5Cb",
            "/a/../b",
            "/a/./b",
            "/a/%2e%2E/b",
            "/a/%2E/b",
            "//orders",
            "/a/..",
            "/a%2fb",
        ] {
            assert!(has_unsafe_segments(bad), "{bad}");
        }
        for good in [
            "/",
            "/orders",
            "/orders/",
            "/a.b/c",
            "/a/...x",
            "/v1/orders?x=../",
        ] {
            assert!(
                !has_unsafe_segments(good.split('?').next().unwrap()),
                "{good}"
            );
        }
    }
}
