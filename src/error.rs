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

/// An RFC 9457 problem, ready to become a response.
#[derive(Debug, Clone)]
pub struct Problem {
    status: StatusCode,
    reason: &'static str,
    title: &'static str,
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
    pub layer: &'static str,
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
    /// A problem with a status, a reason slug and a human title.
    pub fn new(status: StatusCode, reason: &'static str, title: &'static str) -> Self {
        Problem {
            status,
            reason,
            title,
            detail: title.to_owned(),
            extras: None,
        }
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
        let body = ProblemBody {
            kind: format!("{PROBLEM_TYPE_PREFIX}{}", self.reason),
            title: self.title,
            status: self.status.as_u16(),
            detail: &self.detail,
        };
        let bytes = serde_json::to_vec(&body).unwrap_or_default();
        let mut response = Response::new(Body::from(bytes));
        *response.status_mut() = self.status;
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
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) if parsed.password().is_some() => {
            let _ = parsed.set_password(Some("***"));
            parsed.to_string()
        }
        _ => url.to_owned(),
    }
}

/// Marks a response as a problem the gateway answered itself (for metrics).
#[derive(Debug, Clone, Copy)]
pub struct ProblemReason(pub &'static str);

impl axum::response::IntoResponse for Problem {
    fn into_response(self) -> axum::response::Response {
        Problem::into_response(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn problem_renders_rfc9457() {
        let r = Problem::new(StatusCode::CONFLICT, "in-flight", "Busy")
            .detail("d")
            .retry_after(1)
            .into_response();
        assert_eq!(r.status(), 409);
        assert_eq!(r.headers()["content-type"], PROBLEM_JSON);
        assert_eq!(r.headers()["retry-after"], "1");
        let body = r.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["type"], "urn:idemgate:problem:in-flight");
        assert_eq!(v["status"], 409);
        assert_eq!(v["title"], "Busy");
        assert_eq!(v["detail"], "d");
    }
}
