//! `POST /token` and `GET /token`: issue a one-time token.

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use http::{HeaderValue, Request, Response, StatusCode, header};
use serde::Serialize;
use tower::Service;

use super::codec::TokenKeys;
use idemgate_core::error::{Problem, Reason};
use idemgate_core::identity::Identity;
use idemgate_core::request_id::{self, X_REQUEST_ID};

/// The `/token` service.
#[derive(Clone)]
pub struct TokenEndpoint {
    keys: Arc<TokenKeys>,
    ttl: Duration,
    identity: Identity,
    /// Each token route's name (`?route=`), and the identity its records
    /// and tokens are bound to (the name, unless the route keeps another).
    token_routes: Arc<BTreeMap<String, String>>,
    limit: Option<Arc<super::IssueLimit>>,
}

#[derive(Serialize)]
struct Issued {
    token: String,
    expires_at: String,
    ttl_seconds: u64,
}

impl TokenEndpoint {
    /// Issues tokens valid for `ttl`, bindable to any of `token_routes`.
    pub fn new(
        keys: Arc<TokenKeys>,
        ttl: Duration,
        identity: Identity,
        token_routes: BTreeSet<String>,
    ) -> Self {
        TokenEndpoint {
            keys,
            ttl,
            identity,
            token_routes: Arc::new(token_routes.into_iter().map(|r| (r.clone(), r)).collect()),
            limit: None,
        }
    }

    /// Binds each token route's tokens to the identity its records keep
    /// (`routes[].id` in the gateway) rather than to its name: a route
    /// renamed with its identity kept still accepts the tokens issued for
    /// it. `ids` maps each name `?route=` may give to that identity.
    pub fn binding_ids(mut self, ids: BTreeMap<String, String>) -> Self {
        self.token_routes = Arc::new(ids);
        self
    }

    /// Limits how many tokens one principal is issued per minute.
    pub fn with_limit(mut self, limit: Option<Arc<super::IssueLimit>>) -> Self {
        self.limit = limit;
        self
    }

    fn issue(&self, req: &Request<Body>) -> Response<Body> {
        if req.method() != http::Method::POST && req.method() != http::Method::GET {
            let mut refused = Problem::new(Reason::MethodNotAllowed)
                .detail("a token is issued by POST (or GET)")
                .into_response();
            refused
                .headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("POST, GET"));
            return refused;
        }
        let route = req.uri().query().and_then(|q| {
            url::form_urlencoded::parse(q.as_bytes())
                .find(|(k, _)| k == "route")
                .map(|(_, v)| v.into_owned())
        });
        let route = match route {
            None => None,
            Some(name) => match self.token_routes.get(&name) {
                Some(id) => Some(id.clone()),
                None => {
                    return Problem::new(Reason::UnknownTokenRoute)
                        .detail(format!(
                            "?route= names a route with idempotency = \"token\" (known: {})",
                            self.token_routes
                                .keys()
                                .cloned()
                                .collect::<Vec<_>>()
                                .join(", ")
                        ))
                        .into_response();
                }
            },
        };
        // The token binds the principal, not the credential's bytes: a
        // refreshed credential still uses the token.
        let scope = match self.identity.scope(req.headers()) {
            Ok(scope) => scope,
            Err(e) => return Problem::from(&e).into_response(),
        };
        if let Some(limit) = &self.limit {
            // Anonymous clients are told apart by their address.
            let principal = match req
                .extensions()
                .get::<idemgate_core::client_addr::ClientAddr>()
            {
                Some(peer) if scope == idemgate_core::identity::ANONYMOUS_SCOPE => {
                    format!("ip:{}", peer.addr.ip())
                }
                _ => scope.clone(),
            };
            if let Err(wait) = limit.take(&principal) {
                return Problem::new(Reason::TokenRateLimited)
                .detail(
                    "tokens.issue_per_minute: fetch a token when a form is shown, not in a loop",
                )
                .retry_after(wait.as_secs_f64().ceil().max(1.0) as u64)
                .into_response();
            }
        }
        // Tokens carry whole seconds; rounding the expiry up keeps every
        // token valid for at least its full ttl (truncating could take up
        // to a second off it, all of a one-second ttl).
        let expires_ms = idemgate_store::now_ms() + self.ttl.as_millis() as i64;
        let expires_at = (expires_ms + 999).div_euclid(1000);
        let (token, _) = self.keys.issue(route.as_deref(), &scope, expires_at);
        let expires = rfc3339(expires_at);
        let body = serde_json::to_vec(&Issued {
            token,
            expires_at: expires,
            ttl_seconds: self.ttl.as_secs(),
        })
        .unwrap_or_default();
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = StatusCode::CREATED;
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        response
            .headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        response
    }
}

impl Service<Request<Body>> for TokenEndpoint {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: Request<Body>) -> Self::Future {
        // Mounted by itself (the library), the endpoint names its answers
        // as the gateway's router would.
        let id = request_id::ensure(req.headers_mut());
        let mut response = self.issue(&req);
        response.headers_mut().entry(X_REQUEST_ID).or_insert(id);
        Box::pin(std::future::ready(Ok(response)))
    }
}

/// Unix seconds as an RFC 3339 UTC timestamp (`2026-12-02T08:00:00Z`), by
/// the proleptic Gregorian calendar (H. Hinnant's `civil_from_days`): all a
/// token's expiry needs, without a date library.
fn rfc3339(unix: i64) -> String {
    let (days, secs) = (unix.div_euclid(86_400), unix.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use super::rfc3339;

    #[test]
    fn expiries_are_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_212_800), "2026-12-02T12:00:00Z");
        assert_eq!(rfc3339(4_107_542_399), "2100-02-28T23:59:59Z");
        assert_eq!(rfc3339(-1), "1969-12-31T23:59:59Z");
    }
}
