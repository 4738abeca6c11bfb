//! [`StatusEndpoint`]: reconciliation over the route's own upstream.
//!
//! `routes[].reconcile_path = "/payments/by-key/{key}"`: the engine's
//! question "did the action behind this key run?" becomes a `GET` of that
//! path, `{key}` replaced by the stable key the gateway forwarded (and the
//! key also sent as `Idempotency-Key`), through the route's proxy and
//! pool, bounded by the upstream's timeout like any request.

use axum::body::Body;
use futures_util::future::BoxFuture;
use http::{HeaderValue, Method, Request, StatusCode};

use idemgate::idempotency::StableKey;
use idemgate::idempotency::{ForwardFailure, IDEMPOTENCY_KEY, Reconcile, Reconciled};
use idemgate_core::request_id::X_REQUEST_ID;
use idemgate_proxy::Proxy;

/// The placeholder in `reconcile_path` replaced by the stable key.
pub const KEY_PLACEHOLDER: &str = "{key}";

/// A route's status endpoint.
pub struct StatusEndpoint {
    proxy: Proxy,
    /// The path, `{key}` in it.
    path: String,
}

impl StatusEndpoint {
    /// Asks `path` (with `{key}`) on `proxy`'s upstream.
    pub fn new(proxy: Proxy, path: &str) -> Self {
        StatusEndpoint {
            proxy,
            path: path.to_owned(),
        }
    }
}

impl Reconcile for StatusEndpoint {
    fn ask<'a>(&'a self, key: &'a StableKey, request_id: &'a str) -> BoxFuture<'a, Reconciled> {
        Box::pin(async move {
            // The stable key is `ig-` and hex digits: safe in a path as is.
            let path = self.path.replace(KEY_PLACEHOLDER, key.as_str());
            let mut request = Request::new(Body::empty());
            *request.method_mut() = Method::GET;
            *request.uri_mut() = match path.parse() {
                Ok(uri) => uri,
                Err(e) => return Reconciled::Unknown(format!("{path:?} is not a path: {e}")),
            };
            let headers = request.headers_mut();
            headers.insert(IDEMPOTENCY_KEY, key.clone().into_header());
            if let Ok(id) = HeaderValue::from_str(request_id) {
                headers.insert(X_REQUEST_ID, id);
            }
            let answer = self.proxy.clone().answer(request).await;
            if answer.extensions().get::<ForwardFailure>().is_some() {
                return Reconciled::Unknown(format!(
                    "the status endpoint could not be asked ({})",
                    answer.status()
                ));
            }
            match answer.status() {
                StatusCode::OK => Reconciled::Ran(answer),
                StatusCode::NOT_FOUND => Reconciled::NotRun,
                other => Reconciled::Unknown(format!("the status endpoint answered {other}")),
            }
        })
    }
}
