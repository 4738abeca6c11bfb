//! The key forwarded upstream as `Idempotency-Key`: derived from the
//! record's scope, route and key, so the upstream's own state check sees
//! the same key on every retry of one request, and different keys for
//! different clients.

use http::HeaderValue;
use idemgate_store::RecordKey;
use sha2::{Digest, Sha256};

/// The key forwarded upstream: the same on every retry of one request and
/// different for different clients, routes and keys. It is `ig-` and 40
/// lowercase hex digits by construction, so it is always a valid header
/// value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StableKey(String);

impl StableKey {
    /// As the `Idempotency-Key` header sent upstream.
    pub fn into_header(self) -> HeaderValue {
        HeaderValue::try_from(self.0).expect("ig- and hex digits are visible ASCII")
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The stable key of a record.
pub fn stable_key(key: &RecordKey) -> StableKey {
    let mut hash = Sha256::new();
    hash.update(b"idemgate/forwarded-key/v1\0");
    for part in [&key.scope, &key.route, &key.key] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part.as_bytes());
    }
    StableKey(format!("ig-{}", hex::encode(&hash.finalize()[..20])))
}
