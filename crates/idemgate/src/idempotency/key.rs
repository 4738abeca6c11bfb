//! `Idempotency-Key` parsing and the key-route policy.
//!
//! A key is 1–255 printable ASCII characters (0x20–0x7E), sent bare or as an
//! RFC 8941 structured-field String (`"…"`, with `\"` and `\\` escapes), as
//! the IETF draft specifies. Exactly one header. Anything else is 400 before
//! the body is read, so a malformed key never reaches the store or a log
//! unescaped.

use std::convert::Infallible;

use bytes::Bytes;
use http::HeaderMap;
use http::request::Parts;

use super::IDEMPOTENCY_KEY;
use super::policy::{Head, Policy};
use idemgate_core::error::{Problem, Reason};

/// The longest key accepted (Stripe's limit, and the IETF draft's example).
pub(super) const MAX_KEY_LEN: usize = 255;

/// Why a key header was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum HeaderKeyError {
    #[error("more than one Idempotency-Key header")]
    Multiple,
    #[error("the key is empty")]
    Empty,
    #[error("the key is longer than 255 characters")]
    TooLong,
    #[error("the key holds a character outside printable ASCII")]
    BadCharacter,
    #[error("the structured-field string is malformed")]
    BadQuoting,
}

/// Reads the key: `Ok(None)` when absent.
pub(super) fn parse_key(headers: &HeaderMap) -> Result<Option<String>, HeaderKeyError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(HeaderKeyError::Multiple);
    }
    let raw = value.as_bytes();
    let key = match raw {
        [b'"', inner @ .., b'"'] => unquote(inner)?,
        [b'"', ..] => return Err(HeaderKeyError::BadQuoting),
        _ => raw.to_vec(),
    };
    if key.is_empty() {
        return Err(HeaderKeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(HeaderKeyError::TooLong);
    }
    if !key.iter().all(|b| (0x20..=0x7e).contains(b)) {
        return Err(HeaderKeyError::BadCharacter);
    }
    // Printable ASCII is valid UTF-8.
    Ok(Some(
        String::from_utf8(key).map_err(|_| HeaderKeyError::BadCharacter)?,
    ))
}

fn unquote(inner: &[u8]) -> Result<Vec<u8>, HeaderKeyError> {
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e),
                _ => return Err(HeaderKeyError::BadQuoting),
            },
            b'"' => return Err(HeaderKeyError::BadQuoting),
            _ => out.push(b),
        }
    }
    Ok(out)
}

/// The policy of `idempotency = "key"` routes.
#[derive(Debug, Clone, Copy)]
pub struct KeyPolicy {
    /// A missing key is 400 (true) or forwarded unprotected (false).
    pub(crate) require_key: bool,
}

impl KeyPolicy {
    /// A missing key is `400` (`require_key`), or the request is forwarded
    /// unprotected.
    pub fn new(require_key: bool) -> Self {
        KeyPolicy { require_key }
    }
}

impl Policy for KeyPolicy {
    const LAYER: &'static str = "key";

    type BodyKey = Infallible;

    fn key_in_body(&self, from: Infallible, _: &Parts, _: &Bytes) -> Result<String, Problem> {
        match from {}
    }

    fn key_in_head(&self, parts: &Parts, _scope: &str) -> Result<Head, Problem> {
        match parse_key(&parts.headers) {
            Ok(Some(key)) => Ok(Head::Key(key)),
            Ok(None) if self.require_key => Err(Problem::new(Reason::IdempotencyKeyMissing)
            .detail("send Idempotency-Key: <1-255 printable ASCII characters>, the same on every retry")),
            Ok(None) => Ok(Head::Bypass),
            Err(e) => Err(Problem::new(Reason::IdempotencyKeyInvalid)
            .detail(format!("{e}; a key is 1-255 printable ASCII characters, bare or as a quoted structured-field string"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(values: &[&[u8]]) -> Result<Option<String>, HeaderKeyError> {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(IDEMPOTENCY_KEY, http::HeaderValue::from_bytes(v).unwrap());
        }
        parse_key(&h)
    }

    #[test]
    fn keys_are_validated() {
        assert_eq!(parse(&[]), Ok(None));
        assert_eq!(parse(&[b"order-1"]), Ok(Some("order-1".into())));
        assert_eq!(parse(&[b"\"order-1\""]), Ok(Some("order-1".into())));
        assert_eq!(parse(&[br#""a\"b\\c""#]), Ok(Some(r#"a"b\c"#.into())));
        assert_eq!(parse(&[b"\"\""]), Err(HeaderKeyError::Empty));
        assert_eq!(parse(&[b"\"abc"]), Err(HeaderKeyError::BadQuoting));
        assert_eq!(parse(&[br#""a\x""#]), Err(HeaderKeyError::BadQuoting));
        assert_eq!(parse(&[&[b'k'; 255]]).unwrap().unwrap().len(), 255);
        assert_eq!(parse(&[&[b'k'; 256]]), Err(HeaderKeyError::TooLong));
        assert_eq!(parse(&[b"caf\xc3\xa9"]), Err(HeaderKeyError::BadCharacter));
        assert_eq!(parse(&[b"a\tb"]), Err(HeaderKeyError::BadCharacter));
        assert_eq!(parse(&[b"a", b"b"]), Err(HeaderKeyError::Multiple));
    }
}
