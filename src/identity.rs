//! Client identity: which scope a request's records live in (SPEC §1 rule 4).
//!
//! The configured header (`identity.header`, default `Authorization`) is
//! hashed; the raw credential is never stored or logged. A request without
//! the header lives in the anonymous scope. Scoping every record by this
//! hash is what makes one client unable to receive another's stored
//! response, whatever key it sends.

use sha2::{Digest, Sha256};

/// The scope of requests without the identity header.
pub const ANONYMOUS_SCOPE: &str = "anonymous";

/// The scope for an identity header value (`None`: anonymous).
pub fn client_scope(identity: Option<&[u8]>) -> String {
    match identity {
        None => ANONYMOUS_SCOPE.to_owned(),
        Some(value) => {
            let mut hash = Sha256::new();
            hash.update(b"idemgate/identity/v1\0");
            hash.update(value);
            // 128 bits: collisions are out of reach, and the column stays short.
            format!("c_{}", hex::encode(&hash.finalize()[..16]))
        }
    }
}

/// The scope of a request, read from `header`.
pub fn scope_of(headers: &http::HeaderMap, header: &http::HeaderName) -> String {
    client_scope(headers.get(header).map(|v| v.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_differ_per_identity_and_hide_it() {
        let a = client_scope(Some(b"Bearer alice"));
        let b = client_scope(Some(b"Bearer bob"));
        assert_ne!(a, b);
        assert_ne!(a, client_scope(None));
        assert!(!a.contains("alice"));
        assert_eq!(a, client_scope(Some(b"Bearer alice")));
    }
}
