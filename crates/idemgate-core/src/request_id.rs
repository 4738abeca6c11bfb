//! `X-Request-Id`: kept when the client sent one, otherwise a UUID v7 (time
//! ordered, so ids sort the way requests arrived). The router sets it on
//! every request before routing (so it is forwarded upstream and stored with
//! a record) and on every answer that does not already carry one (a replay
//! carries the id of the request that executed).

use std::cell::Cell;
use std::time::{SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderValue};

/// The header name.
pub const X_REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");

/// The request's id: the client's, or a new UUID v7 set on `headers`.
/// The value returned is the answer's copy, marked never to be indexed
/// by HPACK (RFC 7541 §6.2.3): a value that differs on every answer would
/// only churn an HTTP/2 connection's header table, evicting the values
/// that do repeat (`server`, `content-type`), at a cost on every answer.
pub fn ensure(headers: &mut HeaderMap) -> HeaderValue {
    let mut answer = match headers.get(X_REQUEST_ID) {
        // A copy, not a clone: the client's value is a slice of its
        // connection's read buffer, and the answer carrying it back would
        // keep that whole buffer alive (`proxy::headers::detach_values`).
        Some(id) => HeaderValue::from_bytes(id.as_bytes()).unwrap_or_else(|_| id.clone()),
        None => {
            let id = new_id();
            headers.insert(X_REQUEST_ID, id.clone());
            id
        }
    };
    answer.set_sensitive(true);
    answer
}

thread_local! {
    /// Per-thread xorshift state for the random bits, seeded from the OS.
    /// Request ids need uniqueness, not secrecy; a thread-local generator
    /// costs no lock and no system call (the `uuid` crate's shared v7
    /// context was a measurable share of a pass-through request).
    static RANDOM: Cell<u64> = Cell::new(getrandom::u64().unwrap_or(0x9e37_79b9_7f4a_7c15) | 1);
}

/// A new UUID v7 (RFC 9562 §5.7): 48 bits of Unix milliseconds, then 74
/// random bits, formatted without an intermediate `String`.
pub fn new_id() -> HeaderValue {
    let millis = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let (high, low) = RANDOM.with(|state| (next(state), next(state)));
    let mut bytes = [0u8; 16];
    bytes[..6].copy_from_slice(&millis.to_be_bytes()[2..]);
    bytes[6..8].copy_from_slice(&high.to_be_bytes()[..2]);
    bytes[8..].copy_from_slice(&low.to_be_bytes());
    let id = uuid::Builder::from_bytes(bytes)
        .with_version(uuid::Version::SortRand)
        .with_variant(uuid::Variant::RFC4122)
        .into_uuid();
    let mut text = [0u8; uuid::fmt::Hyphenated::LENGTH];
    let text = id.hyphenated().encode_lower(&mut text);
    HeaderValue::from_str(text).expect("a hyphenated UUID is a valid header value")
}

/// xorshift64*: one step.
fn next(state: &Cell<u64>) -> u64 {
    let mut x = state.get();
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    state.set(x);
    x.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clients_id_is_echoed_as_a_copy_of_its_own() {
        let buffer = bytes::Bytes::from(vec![b'a'; 8192]);
        let mut headers = HeaderMap::new();
        headers.insert(
            X_REQUEST_ID,
            HeaderValue::from_maybe_shared(buffer.slice(..36)).unwrap(),
        );
        let echoed = ensure(&mut headers);
        assert_eq!(echoed.as_bytes(), &buffer[..36]);
        drop(headers);
        assert!(
            buffer.is_unique(),
            "the echo keeps nothing of the client's buffer"
        );
    }

    #[test]
    fn the_answers_id_is_never_indexed_and_the_forwarded_one_is_plain() {
        for given in [None, Some("abc")] {
            let mut headers = HeaderMap::new();
            if let Some(id) = given {
                headers.insert(X_REQUEST_ID, HeaderValue::from_static(id));
            }
            assert!(ensure(&mut headers).is_sensitive());
            assert!(!headers[X_REQUEST_ID].is_sensitive());
        }
    }

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
        assert_eq!(parsed.get_variant(), uuid::Variant::RFC4122);
        let (secs, _) = parsed.get_timestamp().unwrap().to_unix();
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        assert!(now.abs_diff(secs) < 5, "timestamp {secs} vs now {now}");
        let ids: std::collections::HashSet<_> = (0..10_000).map(|_| new_id()).collect();
        assert_eq!(ids.len(), 10_000, "ids are unique");
    }
}
