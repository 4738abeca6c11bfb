//! The fast layer: an accelerator in front of SQL, never the truth.
//!
//! It holds in-flight markers (`SET NX PX`, expiring with the lease) and
//! completed responses (expiring with the retention). Two implementations:
//! [`super::redis::RedisLayer`] (shared by every gateway instance) and
//! [`super::memory::MemoryLayer`] (one process). The tiered store verifies
//! every entry against the record key and fingerprint before using it, and
//! treats any error or slow answer as "go to SQL".

use std::time::Duration;

use futures_util::future::BoxFuture;
use sha2::{Digest, Sha256};

use super::RecordKey;
use super::codec::FastEntry;
use idemgate_core::metrics::FallbackLayer;

/// Why a fast-layer call failed (the caller falls back to SQL).
#[derive(Debug, thiserror::Error)]
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
// Only the Redis layer fails; the in-process one always answers.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub enum FastError {
    /// The layer failed (a connection, a script, a timeout).
    #[error("fast layer error: {0}")]
    Backend(String),
    /// What it holds under a key is not an Idemgate entry.
    #[error("fast layer value is not an idemgate entry: {0}")]
    Corrupt(String),
}

/// The operations the tiered store needs from a fast layer.
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
pub trait FastLayer: Send + Sync + 'static {
    /// For the `layer` label of `idemgate_store_fallback_total`.
    fn layer(&self) -> FallbackLayer;

    /// In one atomic step: the entry stored under `entry`'s key if there is
    /// one, with the time it has left in this layer; otherwise store
    /// `entry` (the in-flight marker) and answer `None`.
    fn get_or_mark<'a>(
        &'a self,
        entry: &'a FastEntry,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<(FastEntry, Duration)>, FastError>>;

    /// The completed answer under `key` that this process holds in memory,
    /// with the time it has left, without a round trip and without marking
    /// anything; `None` where the layer is remote (a replay then takes the
    /// claim's path).
    fn peek(&self, _key: &RecordKey) -> Option<(FastEntry, Duration)> {
        None
    }

    /// Stores `entry`, replacing what was there (`SET PX`).
    fn put<'a>(
        &'a self,
        entry: &'a FastEntry,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), FastError>>;

    /// How many purges this process's layer has applied from the purge log
    /// (`purges.rs`); `None` where it keeps nothing in this process (Redis
    /// alone). Read before a record is read from SQL, for
    /// [`Self::put_unless_purged`].
    fn purges_seen(&self) -> Option<u64> {
        None
    }

    /// [`Self::put`] for an answer read from SQL (or just written there)
    /// when this layer's purge count was `since`. If a purge was applied
    /// meanwhile (it may have been this very record's, and an answer kept
    /// after its purge would be replayed without another look), the key is
    /// removed instead, as the purge would have removed it: the caller's
    /// in-flight marker must not stay behind either.
    fn put_unless_purged<'a>(
        &'a self,
        entry: &'a FastEntry,
        ttl: Duration,
        _since: Option<u64>,
    ) -> BoxFuture<'a, Result<(), FastError>> {
        self.put(entry, ttl)
    }

    /// Forgets `key`.
    fn remove<'a>(&'a self, key: &'a RecordKey) -> BoxFuture<'a, Result<(), FastError>>;

    /// When this layer last moved to another server after a failure (a
    /// Sentinel failover). Its in-flight markers from before may be
    /// stale — a promoted replica can hold a marker whose outcome the old
    /// master took but never passed on — so for one lease after it they
    /// are not trusted to answer "in flight"; SQL is asked instead.
    fn moved_at(&self) -> Option<std::time::Instant> {
        None
    }

    /// Checks the layer answers (for `/readyz`).
    fn ping(&self) -> BoxFuture<'_, Result<(), FastError>>;

    /// Tells every instance that a watched record settled (see
    /// [`super::settle`]); the in-process layer has nobody to tell.
    fn announce<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<(), FastError>>;
}

/// The storage key of a record: a fixed-length hash, so no client input
/// ever shapes a Redis key; the entry itself carries the full record key,
/// which is compared on every read.
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
// Only the Redis layer names keys; the in-process layer keys by record.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub fn storage_key(prefix: &str, key: &RecordKey) -> String {
    let mut hash = Sha256::new();
    for part in [&key.scope, &key.route, &key.key] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part.as_bytes());
    }
    format!("{prefix}{}", hex::encode(hash.finalize()))
}
