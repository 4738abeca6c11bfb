//! The one `Problem` type every error becomes as an HTTP answer.
//!
//! Every module keeps its own error enum and maps it to a [`Problem`] next
//! to it (`impl From<&ProxyError> for Problem` lives in the proxy): an RFC
//! 9457 `application/problem+json` response whose `type` names the reason
//! (`urn:idemgate:problem:<reason>`, listed in `docs/problems.md`). This
//! module depends on no other part of the crate. The client
//! gets a safe `detail`; the internal cause travels as a [`ProblemLog`]
//! response extension and is logged once, with the route, by the router.

use axum::body::Body;
use http::{HeaderValue, Response, StatusCode, header};
use serde::Serialize;

/// The prefix of every problem `type`.
pub const PROBLEM_TYPE_PREFIX: &str = "urn:idemgate:problem:";

/// `Retry-After` of a 409 for a request still in flight.
pub const IN_FLIGHT_RETRY_AFTER_SECS: u64 = 1;

/// The media type of every error body.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// Why Idemgate answered a request itself: one reason, one status, one
/// title. The `type` of the problem is `urn:idemgate:problem:<slug>`; the
/// catalogue with when each is answered is `docs/problems.md`.
macro_rules! reasons {
    ($($variant:ident = ($slug:literal, $status:expr, $title:literal),)+) => {
        /// Why a request was answered by Idemgate itself.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum Reason {
            $(
                #[doc = $title]
                $variant,
            )+
        }

        impl Reason {
            /// Every reason, in slug order.
            pub const ALL: &'static [Reason] = &[$(Reason::$variant),+];

            /// The slug in `urn:idemgate:problem:<slug>`.
            pub const fn slug(self) -> &'static str {
                match self {
                    $(Reason::$variant => $slug,)+
                }
            }

            /// The status every answer with this reason has.
            pub const fn status(self) -> StatusCode {
                match self {
                    $(Reason::$variant => $status,)+
                }
            }

            /// The human title, the same on every answer with this reason.
            pub const fn title(self) -> &'static str {
                match self {
                    $(Reason::$variant => $title,)+
                }
            }
        }
    };
}

reasons! {
    AdminUnauthorized = ("admin-unauthorized", StatusCode::UNAUTHORIZED, "The admin API needs its bearer token"),
    AmbiguousFraming = ("ambiguous-framing", StatusCode::BAD_REQUEST, "The request has both Content-Length and Transfer-Encoding"),
    BadRequestBody = ("bad-request-body", StatusCode::BAD_REQUEST, "The request body could not be read"),
    BodyTimeout = ("body-timeout", StatusCode::REQUEST_TIMEOUT, "The request body did not arrive in time"),
    BodyTooLarge = ("body-too-large", StatusCode::PAYLOAD_TOO_LARGE, "The request body is larger than the gateway accepts"),
    BuffersExhausted = ("buffers-exhausted", StatusCode::SERVICE_UNAVAILABLE, "The gateway holds as many request bodies or answers as it may"),
    BusinessKeyInvalid = ("business-key-invalid", StatusCode::BAD_REQUEST, "The callback's business key cannot be read"),
    BusinessKeyMissing = ("business-key-missing", StatusCode::BAD_REQUEST, "The callback carries no business key"),
    BusinessKeyReused = ("business-key-reused", StatusCode::UNPROCESSABLE_ENTITY, "This business key was delivered before with different must_match fields"),
    ClaimsExhausted = ("claims-exhausted", StatusCode::SERVICE_UNAVAILABLE, "The gateway holds as many requests in progress as it may"),
    ConnectionsExhausted = ("connections-exhausted", StatusCode::SERVICE_UNAVAILABLE, "The gateway serves as many connections as it may"),
    HandlerPanicked = ("handler-panicked", StatusCode::BAD_GATEWAY, "The handler failed before a complete answer"),
    HandlerTimeout = ("handler-timeout", StatusCode::GATEWAY_TIMEOUT, "The handler did not answer in time"),
    HolderFailed = ("holder-failed", StatusCode::INTERNAL_SERVER_ERROR, "The gateway lost track of this request; retry it with the same key"),
    IdempotencyKeyExpired = ("idempotency-key-expired", StatusCode::GONE, "This idempotency key's record has expired"),
    IdempotencyKeyInvalid = ("idempotency-key-invalid", StatusCode::BAD_REQUEST, "The Idempotency-Key header is malformed"),
    IdempotencyKeyMissing = ("idempotency-key-missing", StatusCode::BAD_REQUEST, "This route requires an Idempotency-Key header"),
    IdempotencyKeyReused = ("idempotency-key-reused", StatusCode::UNPROCESSABLE_ENTITY, "This idempotency key was already used for a different request"),
    IdempotencyTokenExpired = ("idempotency-token-expired", StatusCode::FORBIDDEN, "The Idempotency-Token has expired"),
    IdempotencyTokenInvalid = ("idempotency-token-invalid", StatusCode::FORBIDDEN, "The Idempotency-Token is not valid for this request"),
    IdempotencyTokenMissing = ("idempotency-token-missing", StatusCode::BAD_REQUEST, "This route requires an Idempotency-Token header"),
    IdentityAmbiguous = ("identity-ambiguous", StatusCode::BAD_REQUEST, "The header that identifies the client is ambiguous"),
    IdentityInvalid = ("identity-invalid", StatusCode::UNAUTHORIZED, "The bearer token could not be verified"),
    InvalidPath = ("invalid-path", StatusCode::BAD_REQUEST, "The request path could be read as a different path"),
    MethodNotAllowed = ("method-not-allowed", StatusCode::METHOD_NOT_ALLOWED, "The route does not take this method"),
    OutcomeUncertain = ("outcome-uncertain", StatusCode::BAD_GATEWAY, "The first request with this key may have acted, but no answer came back"),
    ReconcileFailed = ("reconcile-failed", StatusCode::BAD_GATEWAY, "The upstream could not say whether the first request's action ran"),
    RecordInFlight = ("record-in-flight", StatusCode::CONFLICT, "A request with this key is still being processed"),
    RequestInFlight = ("request-in-flight", StatusCode::CONFLICT, "A request with this idempotency key is still being processed"),
    RouteNotFound = ("route-not-found", StatusCode::NOT_FOUND, "No route matches this path"),
    SignatureInvalid = ("signature-invalid", StatusCode::UNAUTHORIZED, "The callback's signature could not be verified"),
    StoreUnavailable = ("store-unavailable", StatusCode::SERVICE_UNAVAILABLE, "The idempotency store cannot be reached"),
    StreamingCall = ("streaming-call", StatusCode::NOT_IMPLEMENTED, "A streaming gRPC call cannot be deduplicated"),
    TokenRateLimited = ("token-rate-limited", StatusCode::TOO_MANY_REQUESTS, "Too many tokens were issued to this client"),
    UnknownTokenRoute = ("unknown-token-route", StatusCode::BAD_REQUEST, "No token route has this name"),
    UpstreamBroken = ("upstream-broken", StatusCode::BAD_GATEWAY, "The upstream connection failed before a complete answer"),
    UpstreamBusy = ("upstream-busy", StatusCode::SERVICE_UNAVAILABLE, "Every connection the gateway may open to the upstream stayed in use"),
    UpstreamTimeout = ("upstream-timeout", StatusCode::GATEWAY_TIMEOUT, "The upstream did not answer in time"),
    UpstreamTls = ("upstream-tls", StatusCode::BAD_GATEWAY, "The upstream's TLS certificate was not trusted, or the TLS handshake failed"),
    UpstreamUnavailable = ("upstream-unavailable", StatusCode::BAD_GATEWAY, "The upstream service could not be reached"),
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.slug())
    }
}

/// An RFC 9457 problem, ready to become a response.
#[derive(Debug, Clone)]
pub struct Problem {
    reason: Reason,
    detail: String,
    /// Rarely set, so boxed: keeps `Result<_, Problem>` small.
    extras: Option<Box<Extras>>,
}

#[derive(Debug, Clone, Default)]
struct Extras {
    retry_after: Option<u64>,
    allow: Option<String>,
    www_authenticate: Option<&'static str>,
    log: Option<ProblemLog>,
}

/// What the gateway logs about a problem it answered: which layer decided,
/// and the internal cause (never shown to the client).
#[derive(Debug, Clone)]
pub struct ProblemLog {
    /// The layer that decided (`key`, `token`, `callback`, `proxy`, …).
    pub layer: &'static str,
    /// The internal cause, for the log line.
    pub cause: String,
}

#[derive(Serialize)]
struct ProblemBody<'a> {
    #[serde(rename = "type")]
    kind: String,
    title: &'a str,
    status: u16,
    detail: &'a str,
}

impl Problem {
    /// A problem of this reason (its status and title are the reason's).
    pub fn new(reason: Reason) -> Self {
        Problem {
            reason,
            detail: reason.title().to_owned(),
            extras: None,
        }
    }

    /// Why.
    pub fn reason(&self) -> Reason {
        self.reason
    }

    fn extras(&mut self) -> &mut Extras {
        self.extras.get_or_insert_with(Box::default)
    }

    /// The client-facing explanation.
    pub fn detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = detail.into();
        self
    }

    /// Adds `Retry-After: secs`.
    pub fn retry_after(mut self, secs: u64) -> Self {
        self.extras().retry_after = Some(secs);
        self
    }

    /// Adds `Allow` (for 405).
    pub fn allow(mut self, methods: String) -> Self {
        self.extras().allow = Some(methods);
        self
    }

    /// Adds `WWW-Authenticate` (for 401, RFC 9110 §11.6.1).
    pub fn www_authenticate(mut self, challenge: &'static str) -> Self {
        self.extras().www_authenticate = Some(challenge);
        self
    }

    /// Records the internal cause for the log line.
    pub fn logged(mut self, layer: &'static str, cause: impl Into<String>) -> Self {
        self.extras().log = Some(ProblemLog {
            layer,
            cause: cause.into(),
        });
        self
    }

    /// Renders the response.
    pub fn into_response(self) -> Response<Body> {
        let status = self.reason.status();
        let body = ProblemBody {
            kind: format!("{PROBLEM_TYPE_PREFIX}{}", self.reason.slug()),
            title: self.reason.title(),
            status: status.as_u16(),
            detail: &self.detail,
        };
        let bytes = serde_json::to_vec(&body).unwrap_or_default();
        let mut response = Response::new(Body::from(bytes));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        let extras = self.extras.map(|e| *e).unwrap_or_default();
        if let Some(secs) = extras.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if let Some(allow) = extras.allow.and_then(|a| HeaderValue::from_str(&a).ok()) {
            headers.insert(header::ALLOW, allow);
        }
        if let Some(challenge) = extras.www_authenticate {
            headers.insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static(challenge),
            );
        }
        response.extensions_mut().insert(ProblemReason(self.reason));
        if let Some(log) = extras.log {
            response.extensions_mut().insert(log);
        }
        response
    }
}

/// A URL (database, broker) without its password, for messages and logs.
/// Masked by position, not by a URL parser: URLs the parser refuses (a
/// libpq host list `h1:5432,h2:5432`, a Sentinel list) carry passwords too.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let Some((userinfo, hosts)) = authority.rsplit_once('@') else {
        return url.to_owned();
    };
    match userinfo.split_once(':') {
        Some((user, _password)) => format!("{scheme}://{user}:***@{hosts}{tail}"),
        None => url.to_owned(),
    }
}

/// Marks a response as a problem the gateway answered itself (for metrics
/// and logs).
#[derive(Debug, Clone, Copy)]
pub struct ProblemReason(pub Reason);

impl axum::response::IntoResponse for Problem {
    fn into_response(self) -> axum::response::Response {
        Problem::into_response(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[test]
    fn every_reason_has_one_slug_and_a_4xx_or_5xx_status() {
        let mut slugs: Vec<_> = Reason::ALL.iter().map(|r| r.slug()).collect();
        let count = slugs.len();
        slugs.sort_unstable();
        slugs.dedup();
        assert_eq!(slugs.len(), count, "a slug names two reasons");
        for reason in Reason::ALL {
            let status = reason.status();
            assert!(
                status.is_client_error() || status.is_server_error(),
                "{reason}"
            );
            assert!(!reason.title().is_empty());
        }
    }

    #[tokio::test]
    async fn problem_renders_rfc9457() {
        let r = Problem::new(Reason::RequestInFlight)
            .detail("d")
            .retry_after(1)
            .into_response();
        assert_eq!(r.status(), 409);
        assert_eq!(r.headers()["content-type"], PROBLEM_JSON);
        assert_eq!(r.headers()["retry-after"], "1");
        let body = r.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["type"], "urn:idemgate:problem:request-in-flight");
        assert_eq!(v["status"], 409);
        assert_eq!(v["title"], Reason::RequestInFlight.title());
        assert_eq!(v["detail"], "d");
    }

    #[test]
    fn a_password_is_masked_in_every_url_form() {
        for (url, masked) in [
            (
                "postgres://u:secret@h1:5432/db",
                "postgres://u:***@h1:5432/db",
            ),
            (
                "postgres://u:se%40cret@h1:5432,h2:5433/db?target_session_attrs=read-write",
                "postgres://u:***@h1:5432,h2:5433/db?target_session_attrs=read-write",
            ),
            (
                "redis+sentinel://:pw@h1:26379,h2:26379/mymaster",
                "redis+sentinel://:***@h1:26379,h2:26379/mymaster",
            ),
            (
                "mysql://root@127.0.0.1:3306/test",
                "mysql://root@127.0.0.1:3306/test",
            ),
            ("sqlite://data/idemgate.db", "sqlite://data/idemgate.db"),
        ] {
            assert_eq!(redact_url(url), masked);
        }
    }
}
