//! What an upstream answer means for its record: whether it is stored,
//! which of its headers are kept, and how a stored one is replayed.

use std::convert::Infallible;

use axum::body::Body;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode, header};
use idemgate_core::hop_by_hop::is_hop_by_hop;
use idemgate_core::request_id::X_REQUEST_ID;
use idemgate_store::StoredResponse;
use tower::{Service, ServiceExt};

use super::expires::set_expires;
use super::verdict::Verdict;
use super::{IDEMPOTENT_BODY_OMITTED, IDEMPOTENT_REPLAYED};

/// Calls the inner service once (it cannot fail: its errors are answers).
pub(crate) async fn forward_plain<S>(inner: S, request: Request<Body>) -> Response<Body>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Send,
    S::Future: Send,
{
    match inner.oneshot(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

/// Outcomes that are recorded and replayed: the upstream acted (or refused
/// for good). 5xx and the "try again" statuses are not: the retry runs.
/// 3xx is stored too: a `303 See Other` after a POST means it executed.
pub fn is_stored(status: StatusCode) -> bool {
    let code = status.as_u16();
    (200..500).contains(&code) && !matches!(code, 408 | 409 | 425 | 429)
}

/// Headers that describe a body; a replay without its body must not carry
/// them (docs/semantics.md, "What is forwarded upstream").
const BODY_HEADERS: [&str; 7] = [
    "content-encoding",
    "content-md5",
    "etag",
    "digest",
    "content-digest",
    "repr-digest",
    "content-range",
];

/// Headers kept for replay: end-to-end ones, minus `Set-Cookie` (a session
/// must never be handed to whoever replays) and those the replay sets; when
/// the body is not kept, minus those that describe it.
pub(crate) fn storable_headers(
    headers: &http::HeaderMap,
    body_kept: bool,
) -> Vec<(String, Vec<u8>)> {
    headers
        .iter()
        .filter(|(name, _)| {
            !is_hop_by_hop(name)
                && *name != header::SET_COOKIE
                && *name != header::CONTENT_LENGTH
                && *name != X_REQUEST_ID
                && (body_kept || !BODY_HEADERS.contains(&name.as_str()))
        })
        .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
        .collect()
}

/// The stored outcome as a response, with the record's expiry.
pub fn replay(stored: StoredResponse, expires_at_ms: i64) -> Response<Body> {
    let mut response = Response::new(Body::from(stored.body));
    *response.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(&value),
        ) {
            headers.append(name, value);
        }
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    if !stored.body_kept {
        headers.insert(IDEMPOTENT_BODY_OMITTED, HeaderValue::from_static("true"));
    }
    if let Ok(id) = HeaderValue::from_str(&stored.request_id)
        && !stored.request_id.is_empty()
    {
        headers.insert(X_REQUEST_ID, id);
    }
    set_expires(headers, expires_at_ms);
    response.extensions_mut().insert(Verdict::Replayed);
    response
}
