//! What an upstream answer means for its record: whether it is stored,
//! which of its headers are kept, and how a stored one is replayed.

use std::convert::Infallible;

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, header};
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
/// for good). 5xx and the "try again" statuses are not: the retry runs
/// (unless the status is one of the route's [`UncertainStatuses`]). 3xx is
/// stored too: a `303 See Other` after a POST means it executed.
pub fn is_stored(status: StatusCode) -> bool {
    let code = status.as_u16();
    (200..500).contains(&code) && !matches!(code, 408 | 409 | 425 | 429)
}

/// What a gRPC call's `grpc-status` means for its record, decided as
/// HTTP statuses are (the table is in `docs/grpc.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpcMeaning {
    /// The method answered, or refused for good: recorded and replayed.
    Stored,
    /// Refused before acting (`ABORTED`, as `409`): the retry runs.
    Released,
    /// May have run (`UNKNOWN`, `INTERNAL`, `DEADLINE_EXCEEDED`,
    /// `UNAVAILABLE`, `RESOURCE_EXHAUSTED`, `CANCELLED`, `DATA_LOSS`, any code gRPC does not
    /// define, or no status at all): the record is uncertain, as after a
    /// lost connection (rule 11).
    Uncertain,
}

/// See [`GrpcMeaning`].
pub fn grpc_meaning(code: u32) -> GrpcMeaning {
    match code {
        // OK, INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS,
        // PERMISSION_DENIED, FAILED_PRECONDITION, OUT_OF_RANGE,
        // UNIMPLEMENTED, UNAUTHENTICATED
        0 | 3 | 5 | 6 | 7 | 9 | 11 | 12 | 16 => GrpcMeaning::Stored,
        10 => GrpcMeaning::Released,
        // UNAVAILABLE too: it is what a proxy in front of the service
        // (Envoy, an Istio sidecar) answers a gRPC client for a lost or
        // late answer — its 502, 503 and 504 — so it may mean "it ran";
        // and RESOURCE_EXHAUSTED, which a server sends when the answer
        // it made after acting is over its message limit.
        _ => GrpcMeaning::Uncertain,
    }
}

/// A whole answer body, with its trailers when it had any. With trailers
/// its length is left unsaid: an HTTP/1.1 client then gets it chunked,
/// the only framing that carries trailers (hyper drops them beside a
/// `Content-Length`).
pub(crate) fn body_with_trailers(bytes: Bytes, trailers: Option<HeaderMap>) -> Body {
    match trailers {
        None => Body::from(bytes),
        Some(trailers) => {
            let frames = [
                Ok::<_, Infallible>(http_body::Frame::data(bytes)),
                Ok(http_body::Frame::trailers(trailers)),
            ];
            Body::new(http_body_util::StreamBody::new(futures_util::stream::iter(
                frames,
            )))
        }
    }
}

/// `fields` without the connection-specific ones (RFC 9110 §7.6.1).
pub(crate) fn end_to_end(mut fields: HeaderMap) -> HeaderMap {
    let doomed: Vec<HeaderName> = fields
        .keys()
        .filter(|n| is_hop_by_hop(n))
        .cloned()
        .collect();
    for name in doomed {
        fields.remove(name);
    }
    fields
}

/// Trailer fields as stored: end-to-end ones, minus `Set-Cookie`, as
/// headers are kept.
pub(crate) fn storable_trailers(trailers: Option<&HeaderMap>) -> Vec<(String, Vec<u8>)> {
    trailers.map_or_else(Vec::new, |t| storable_headers(t, true))
}

/// What a route's upstream answers with when the action may have run but
/// its answer was lost: `502` and `504` by default, the statuses a proxy in
/// front of the service (nginx, an ingress, a load balancer, a sidecar)
/// sends when it lost the service's answer or stopped waiting for it while
/// the service went on working. Such an answer makes the record
/// `uncertain`, exactly as a lost connection does (held while a copy may
/// still run, then reconciled), never released: the httpapi working group
/// says the same of intermediaries (draft-ietf-httpapi-idempotency-key-header
/// issue #41: a 500 or 504 cannot be relied on to mean "no change").
///
/// Only 5xx statuses can be listed: every other status is an answer the
/// service itself gave, stored or released by [`is_stored`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UncertainStatuses(u128);

/// The statuses [`UncertainStatuses::default`] holds.
pub const DEFAULT_UNCERTAIN_STATUSES: [u16; 2] = [502, 504];

impl UncertainStatuses {
    /// None: every 5xx releases its claim (a service answered directly,
    /// with nothing in between that could lose its answer).
    pub const NONE: UncertainStatuses = UncertainStatuses(0);

    /// These statuses; `Err` names the first that is not a 5xx.
    pub fn new(statuses: &[u16]) -> Result<UncertainStatuses, u16> {
        let mut bits = 0u128;
        for &status in statuses {
            if !(500..=599).contains(&status) {
                return Err(status);
            }
            bits |= 1 << (status - 500);
        }
        Ok(UncertainStatuses(bits))
    }

    /// Whether an answer with `status` may mean the action ran.
    pub fn contains(self, status: StatusCode) -> bool {
        let code = status.as_u16();
        (500..=599).contains(&code) && self.0 & (1 << (code - 500)) != 0
    }
}

impl Default for UncertainStatuses {
    fn default() -> Self {
        match UncertainStatuses::new(&DEFAULT_UNCERTAIN_STATUSES) {
            Ok(statuses) => statuses,
            Err(_) => UncertainStatuses::NONE,
        }
    }
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

/// Appends stored fields to `map`, skipping any that no longer parse.
fn append_fields(map: &mut HeaderMap, fields: Vec<(String, Vec<u8>)>) {
    for (name, value) in fields {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(&value),
        ) {
            map.append(name, value);
        }
    }
}

/// The stored outcome as a response, with the record's expiry.
pub fn replay(stored: StoredResponse, expires_at_ms: i64) -> Response<Body> {
    let trailers = (!stored.trailers.is_empty()).then(|| {
        let mut map = HeaderMap::with_capacity(stored.trailers.len());
        append_fields(&mut map, stored.trailers);
        map
    });
    // hyper writes to an HTTP/1.1 client only the trailer fields its head
    // announced (RFC 9110 §6.6.2).
    let announced = trailers.as_ref().and_then(|t| {
        let names: Vec<&str> = t.keys().map(HeaderName::as_str).collect();
        HeaderValue::from_str(&names.join(", ")).ok()
    });
    let mut response = Response::new(body_with_trailers(stored.body, trailers));
    *response.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let headers = response.headers_mut();
    append_fields(headers, stored.headers);
    if let Some(names) = announced {
        headers.insert(header::TRAILER, names);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uncertain_statuses_are_5xx_only_and_default_to_502_and_504() {
        let default = UncertainStatuses::default();
        for (code, uncertain) in [(500, false), (502, true), (503, false), (504, true)] {
            assert_eq!(
                default.contains(StatusCode::from_u16(code).unwrap()),
                uncertain,
                "{code}"
            );
        }
        let with_500 = UncertainStatuses::new(&[500, 502, 504, 599]).unwrap();
        assert!(with_500.contains(StatusCode::INTERNAL_SERVER_ERROR));
        assert!(with_500.contains(StatusCode::from_u16(599).unwrap()));
        assert!(!with_500.contains(StatusCode::OK));
        assert_eq!(UncertainStatuses::new(&[502, 404]), Err(404));
        assert_eq!(UncertainStatuses::new(&[600]), Err(600));
        assert!(!UncertainStatuses::NONE.contains(StatusCode::BAD_GATEWAY));
    }
}
