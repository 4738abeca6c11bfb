//! The in-process fast layer (when `store.redis_url` is empty).
//!
//! A sharded map with per-entry expiry. Shards keep lock hold times short
//! and contention low under a duplicate storm; each lock is a std `Mutex`
//! held for a map lookup only, never across an `.await`. Bounded: when full,
//! writes fail with [`FastError::Full`], which only sends requests down the
//! SQL path.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;

use super::RecordKey;
use super::codec::FastEntry;
use super::fast::{FastError, FastLayer};
use crate::metrics::FallbackLayer;

const SHARDS: usize = 16;

/// Entries kept at most, across shards.
pub const DEFAULT_MAX_ENTRIES: usize = 100_000;

type Shard = Mutex<HashMap<RecordKey, (Instant, Arc<FastEntry>)>>;

/// The in-process fast layer.
pub struct MemoryLayer {
    shards: Vec<Shard>,
    hasher: RandomState,
    max_per_shard: usize,
}

impl MemoryLayer {
    /// A layer holding at most `max_entries`.
    pub fn new(max_entries: usize) -> Self {
        MemoryLayer {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: RandomState::new(),
            max_per_shard: max_entries.div_ceil(SHARDS),
        }
    }

    fn shard(
        &self,
        key: &RecordKey,
    ) -> std::sync::MutexGuard<'_, HashMap<RecordKey, (Instant, Arc<FastEntry>)>> {
        let i = self.hasher.hash_one(key) as usize % SHARDS;
        // Entries are plain values replaced whole, so a panic elsewhere
        // cannot leave a shard half-written: a poisoned lock is still sound.
        self.shards[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stores `entry`; with `only_if_absent`, answers the live entry
    /// instead when there is one (check and store under one lock).
    fn store(
        &self,
        entry: &FastEntry,
        ttl: Duration,
        only_if_absent: bool,
    ) -> Result<Option<Arc<FastEntry>>, FastError> {
        let now = Instant::now();
        let mut shard = self.shard(entry.key());
        if let Some((expires, existing)) = shard.get(entry.key())
            && only_if_absent
            && *expires > now
        {
            return Ok(Some(existing.clone()));
        }
        if shard.len() >= self.max_per_shard {
            shard.retain(|_, (expires, _)| *expires > now);
            if shard.len() >= self.max_per_shard {
                return Err(FastError::Full);
            }
        }
        shard.insert(entry.key().clone(), (now + ttl, Arc::new(entry.clone())));
        Ok(None)
    }

    /// Forgets every entry of `route`/`key` (in `scope`, or in every scope);
    /// returns how many.
    pub fn forget(&self, route: &str, key: &str, scope: Option<&str>) -> usize {
        if let Some(scope) = scope {
            let key = RecordKey::new(scope, route, key);
            return usize::from(self.shard(&key).remove(&key).is_some());
        }
        let mut removed = 0;
        for shard in &self.shards {
            let mut shard = shard.lock().unwrap_or_else(|p| p.into_inner());
            let before = shard.len();
            shard.retain(|k, _| !(k.route == route && k.key == key));
            removed += before - shard.len();
        }
        removed
    }

    /// Drops expired entries (run by the sweeper).
    pub fn purge_expired(&self) -> usize {
        let now = Instant::now();
        let mut removed = 0;
        for shard in &self.shards {
            let mut shard = shard.lock().unwrap_or_else(|p| p.into_inner());
            let before = shard.len();
            shard.retain(|_, (expires, _)| *expires > now);
            removed += before - shard.len();
        }
        removed
    }
}

impl FastLayer for MemoryLayer {
    fn layer(&self) -> FallbackLayer {
        FallbackLayer::Memory
    }

    fn get_or_mark<'a>(
        &'a self,
        entry: &'a FastEntry,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<FastEntry>, FastError>> {
        let found = self
            .store(entry, ttl, true)
            .map(|existing| existing.map(|e| (*e).clone()));
        Box::pin(std::future::ready(found))
    }

    fn put<'a>(
        &'a self,
        entry: &'a FastEntry,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), FastError>> {
        Box::pin(std::future::ready(
            self.store(entry, ttl, false).map(|_| ()),
        ))
    }

    fn remove<'a>(&'a self, key: &'a RecordKey) -> BoxFuture<'a, Result<(), FastError>> {
        self.shard(key).remove(key);
        Box::pin(std::future::ready(Ok(())))
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), FastError>> {
        Box::pin(std::future::ready(Ok(())))
    }

    fn announce<'a>(&'a self, _token: &'a str) -> BoxFuture<'a, Result<(), FastError>> {
        Box::pin(std::future::ready(Ok(())))
    }
}
