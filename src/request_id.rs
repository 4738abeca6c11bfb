//! `X-Request-Id`: kept when the client sent one, otherwise a UUID v7 (time
//! ordered, so ids sort the way requests arrived), and returned on every
//! response through tower-http's request-id layers.

use http::{HeaderValue, Request};
use tower_http::request_id::{MakeRequestId, RequestId};

/// The header name.
pub const X_REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");

/// Makes UUID v7 request ids.
#[derive(Debug, Clone, Copy, Default)]
pub struct MakeRequestUuidV7;

impl MakeRequestId for MakeRequestUuidV7 {
    fn make_request_id<B>(&mut self, _request: &Request<B>) -> Option<RequestId> {
        let id = uuid::Uuid::now_v7().to_string();
        HeaderValue::from_str(&id).ok().map(RequestId::new)
    }
}
