//! `X-Request-Id`: kept when the client sent one, otherwise a UUID v7 (time
//! ordered, so ids sort the way requests arrived). The router sets it on
//! every request before routing (so it is forwarded upstream and stored with
//! a record) and on every answer that does not already carry one (a replay
//! carries the id of the request that executed).

use http::{HeaderMap, HeaderValue};

/// The header name.
pub const X_REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");

/// The request's id: the client's, or a new UUID v7 set on `headers`.
pub fn ensure(headers: &mut HeaderMap) -> HeaderValue {
    if let Some(id) = headers.get(X_REQUEST_ID) {
        return id.clone();
    }
    let id = new_id();
    headers.insert(X_REQUEST_ID, id.clone());
    id
}

/// A new UUID v7, formatted without an intermediate `String`.
pub fn new_id() -> HeaderValue {
    let mut text = [0u8; uuid::fmt::Hyphenated::LENGTH];
    let text = uuid::Uuid::now_v7().hyphenated().encode_lower(&mut text);
    HeaderValue::from_str(text).expect("a hyphenated UUID is a valid header value")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_id_is_kept_and_a_missing_one_is_made() {
        let mut headers = HeaderMap::new();
        headers.insert(X_REQUEST_ID, HeaderValue::from_static("abc"));
        assert_eq!(ensure(&mut headers), "abc");
        let mut headers = HeaderMap::new();
        let id = ensure(&mut headers);
        assert_eq!(headers[X_REQUEST_ID], id);
        let parsed = uuid::Uuid::parse_str(id.to_str().unwrap()).unwrap();
        assert_eq!(parsed.get_version_num(), 7);
    }
}
