//! `[server.cors]`: browser clients on other origins (the token flow's
//! audience), answered by the gateway itself.
//!
//! - A preflight (`OPTIONS` with `Origin` and
//!   `Access-Control-Request-Method`, Fetch standard §3.2.2) is answered
//!   here and never forwarded: `204` with the methods the matching routes
//!   take, `Idempotency-Key`, `Idempotency-Token` and `Content-Type` (plus
//!   `allow_headers`) as request headers, and `max_age`.
//! - Any other request from a listed origin gets `Access-Control-Allow-
//!   Origin` (that origin), `Access-Control-Expose-Headers`
//!   (`Idempotent-Replayed`, `Idempotency-Expires`, `Retry-After`,
//!   `X-Request-Id`, `Idempotent-Body-Omitted`) and, with
//!   `allow_credentials`, `Access-Control-Allow-Credentials` (cookie
//!   sessions). Replays get the same as first answers.
//! - An origin not listed gets no CORS header at all (its preflight is
//!   still answered, so the upstream never sees one); every answer carries
//!   `Vary: Origin` so that a cache never serves one origin's answer to
//!   another.
//!
//! Written here rather than with tower-http's `CorsLayer`, which answers
//! every `OPTIONS` (a route taking `OPTIONS` could never be reached) and
//! sends its other `Access-Control-*` headers to origins it does not allow.

use std::collections::HashSet;
use std::time::Duration;

use axum::body::Body;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};

/// Request headers a browser may send on any route.
const ALLOWED_HEADERS: &str = "content-type, idempotency-key, idempotency-token, x-request-id";
/// Answer headers scripts may read.
const EXPOSED_HEADERS: &str =
    "idempotent-replayed, idempotency-expires, retry-after, x-request-id, idempotent-body-omitted";

/// What `[server.cors]` allows.
#[derive(Debug, Clone)]
pub struct CorsPolicy {
    origins: HashSet<HeaderValue>,
    allow_headers: HeaderValue,
    allow_credentials: bool,
    max_age: HeaderValue,
}

impl CorsPolicy {
    /// A policy for `origins` (each `scheme://host[:port]`, as browsers
    /// send `Origin`); `extra_headers` are allowed besides the gateway's.
    pub fn new(
        origins: &[String],
        extra_headers: &[String],
        allow_credentials: bool,
        max_age: Duration,
    ) -> Result<CorsPolicy, String> {
        let origins = origins
            .iter()
            .map(|o| {
                HeaderValue::from_str(o.trim_end_matches('/'))
                    .map_err(|_| format!("{o:?} is not an origin"))
            })
            .collect::<Result<_, _>>()?;
        let mut allowed = ALLOWED_HEADERS.to_owned();
        for h in extra_headers {
            let name: http::HeaderName = h
                .parse()
                .map_err(|_| format!("{h:?} is not a header name"))?;
            allowed.push_str(", ");
            allowed.push_str(name.as_str());
        }
        Ok(CorsPolicy {
            origins,
            allow_headers: HeaderValue::from_str(&allowed).map_err(|e| e.to_string())?,
            allow_credentials,
            max_age: HeaderValue::from(max_age.as_secs()),
        })
    }

    /// The request's `Origin` when it is listed.
    pub fn allowed_origin(&self, headers: &HeaderMap) -> Option<HeaderValue> {
        headers
            .get(header::ORIGIN)
            .filter(|o| self.origins.contains(*o))
            .cloned()
    }

    /// Whether `req` is a CORS preflight.
    pub fn is_preflight(req: &Request<Body>) -> bool {
        req.method() == Method::OPTIONS
            && req.headers().contains_key(header::ORIGIN)
            && req
                .headers()
                .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD)
    }

    /// The answer to a preflight; `methods` are those the path's routes take.
    pub fn preflight(&self, req: &Request<Body>, methods: &str) -> Response<Body> {
        let mut response = Response::new(Body::empty());
        *response.status_mut() = StatusCode::NO_CONTENT;
        let headers = response.headers_mut();
        headers.insert(header::VARY, HeaderValue::from_static("origin"));
        let Some(origin) = self.allowed_origin(req.headers()) else {
            return response;
        };
        headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        if let Ok(methods) = HeaderValue::from_str(methods) {
            headers.insert(header::ACCESS_CONTROL_ALLOW_METHODS, methods);
        }
        headers.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            self.allow_headers.clone(),
        );
        headers.insert(header::ACCESS_CONTROL_MAX_AGE, self.max_age.clone());
        if self.allow_credentials {
            headers.insert(
                header::ACCESS_CONTROL_ALLOW_CREDENTIALS,
                HeaderValue::from_static("true"),
            );
        }
        response
    }

    /// Adds the CORS headers of an answer to `origin` (`None`: not listed
    /// or absent, only `Vary`).
    pub fn decorate(&self, origin: Option<HeaderValue>, headers: &mut HeaderMap) {
        headers.append(header::VARY, HeaderValue::from_static("origin"));
        let Some(origin) = origin else {
            return;
        };
        headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        headers.insert(
            header::ACCESS_CONTROL_EXPOSE_HEADERS,
            HeaderValue::from_static(EXPOSED_HEADERS),
        );
        if self.allow_credentials {
            headers.insert(
                header::ACCESS_CONTROL_ALLOW_CREDENTIALS,
                HeaderValue::from_static("true"),
            );
        }
    }
}
