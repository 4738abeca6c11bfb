//! `Idempotency-Expires`: until when a protected request's key is
//! remembered, on every answer that names a record.
//!
//! The IETF idempotency-key draft leaves advertising the key's lifetime
//! open (its issues #35, #49); Stripe documents it (24 h) but does not
//! send it. Idemgate sends the record's expiry as an HTTP-date (RFC 9110
//! §5.6.7), by the database's clock, so a client knows whether a late
//! retry can still be answered from the record.

use std::time::{Duration, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, HeaderValue};

/// `Idempotency-Expires`.
pub(super) const IDEMPOTENCY_EXPIRES: HeaderName = HeaderName::from_static("idempotency-expires");

/// Sets `Idempotency-Expires` to `expires_at_ms` (ms since the Unix epoch).
pub(super) fn set_expires(headers: &mut HeaderMap, expires_at_ms: i64) {
    let at = UNIX_EPOCH + Duration::from_millis(expires_at_ms.max(0) as u64);
    if let Ok(value) = HeaderValue::from_str(&httpdate::fmt_http_date(at)) {
        headers.insert(IDEMPOTENCY_EXPIRES, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_expiry_is_an_http_date() {
        let mut headers = HeaderMap::new();
        set_expires(&mut headers, 1_784_000_000_123);
        assert_eq!(
            headers[IDEMPOTENCY_EXPIRES],
            "Tue, 14 Jul 2026 03:33:20 GMT"
        );
    }
}
