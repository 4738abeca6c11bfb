//! The in-process fast layer (when `store.redis_url` is empty).
//!
//! A sharded map with per-entry expiry, bounded twice (docs/semantics.md, rule 10):
//! by entries, and by bytes (`store.memory_layer_bytes`, default 64 MiB) —
//! a completed answer holds its whole stored body, so a bound in entries
//! alone let 600 one-megabyte answers hold 600 MiB for a whole retention.
//! Past either bound the least recently used entries go first (expired
//! ones before anything else); an entry larger than a shard's share is not
//! kept at all, and its replays come from SQL. Forgetting is always safe:
//! the layer only spares SQL a read.
//!
//! Shards keep lock hold times short and contention low under a duplicate
//! storm; each lock is a std `Mutex` held for a few map operations, never
//! across an `.await`.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;

use super::RecordKey;
use super::codec::FastEntry;
use super::fast::{FastError, FastLayer};
use idemgate_core::metrics::FallbackLayer;

const SHARDS: usize = 16;

/// Entries kept at most, across shards.
pub(crate) const DEFAULT_MAX_ENTRIES: usize = 100_000;

/// Bytes kept at most, across shards (`store.memory_layer_bytes`).
pub const DEFAULT_MAX_BYTES: usize = 64 * 1024 * 1024;

/// What an entry costs beyond its variable parts: the map slot, the
/// recency index, the `Arc` and the entry's fixed fields.
const ENTRY_OVERHEAD: usize = 256;
/// How often a full shard looks for expired entries to drop before the
/// least recently used (the sweeper drops expired entries besides).
const EXPIRED_SCAN_EVERY: Duration = Duration::from_secs(1);

/// The in-process fast layer.
pub struct MemoryLayer {
    shards: Vec<Mutex<Shard>>,
    hasher: RandomState,
    max_entries_per_shard: usize,
    max_bytes_per_shard: usize,
    /// Until when its completed answers may be replayed, in nanoseconds
    /// after `base` (`u64::MAX`: always, where nobody follows purges). The
    /// purge-log follower moves it on after each read of the log
    /// ([`super::purges`]): a follower that stalls, fails or dies lets it
    /// lapse, and replays go to Redis or SQL, so a purge reported done is
    /// never replayed from here however the follower fares.
    trusted_until: AtomicU64,
    base: Instant,
    /// Purges applied so far (see [`Self::purges_seen`]).
    purges: AtomicU64,
}

#[derive(Default)]
struct Shard {
    entries: HashMap<RecordKey, Slot>,
    /// Recency: use tick → key, oldest first.
    recency: BTreeMap<u64, RecordKey>,
    tick: u64,
    bytes: usize,
    /// When [`Shard::make_room`] last looked for expired entries.
    expired_scan_at: Option<Instant>,
}

struct Slot {
    expires: Instant,
    entry: Arc<FastEntry>,
    bytes: usize,
    used: u64,
}

impl Shard {
    fn touch(&mut self, key: &RecordKey) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(slot) = self.entries.get_mut(key) {
            self.recency.remove(&slot.used);
            slot.used = tick;
            self.recency.insert(tick, key.clone());
        }
    }

    fn remove(&mut self, key: &RecordKey) -> bool {
        match self.entries.remove(key) {
            Some(slot) => {
                self.recency.remove(&slot.used);
                self.bytes -= slot.bytes;
                true
            }
            None => false,
        }
    }

    fn insert(&mut self, key: RecordKey, slot: Slot) {
        self.remove(&key);
        self.bytes += slot.bytes;
        self.recency.insert(slot.used, key.clone());
        self.entries.insert(key, slot);
    }

    /// Makes room for `incoming` more bytes and one more entry: expired
    /// entries first, then the least recently used.
    fn make_room(&mut self, incoming: usize, max_entries: usize, max_bytes: usize, now: Instant) {
        let over = |s: &Shard| s.entries.len() >= max_entries || s.bytes + incoming > max_bytes;
        if !over(self) {
            return;
        }
        // A look for expired entries reads the whole shard: at most one per
        // EXPIRED_SCAN_EVERY, not one per insert into a full shard (one
        // per first request, each a pass over thousands of live entries
        // under the lock). In between, the least recently used go.
        if self
            .expired_scan_at
            .is_none_or(|at| now.saturating_duration_since(at) >= EXPIRED_SCAN_EVERY)
        {
            self.expired_scan_at = Some(now);
            let expired: Vec<RecordKey> = self
                .entries
                .iter()
                .filter(|(_, slot)| slot.expires <= now)
                .map(|(k, _)| k.clone())
                .collect();
            for key in &expired {
                self.remove(key);
            }
        }
        while over(self) {
            let Some((_, oldest)) = self.recency.pop_first() else {
                break;
            };
            if let Some(slot) = self.entries.remove(&oldest) {
                self.bytes -= slot.bytes;
            }
        }
    }
}

/// What an entry holds in memory, roughly.
fn size_of(entry: &FastEntry) -> usize {
    let key = entry.key();
    let fixed = ENTRY_OVERHEAD + key.scope.len() + key.route.len() + key.key.len();
    match entry {
        FastEntry::InFlight { fingerprint, .. } => fixed + fingerprint.len(),
        FastEntry::Completed {
            fingerprint,
            response,
            ..
        } => {
            let headers: usize = response
                .headers
                .iter()
                .chain(&response.trailers)
                .map(|(n, v)| n.len() + v.len() + 48)
                .sum();
            fixed + fingerprint.len() + response.body.len() + headers + response.request_id.len()
        }
    }
}

impl MemoryLayer {
    /// A layer holding at most `max_entries` and the default byte budget.
    #[cfg(any(test, feature = "testing"))]
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    pub(crate) fn new(max_entries: usize) -> Self {
        Self::with_budget(max_entries, DEFAULT_MAX_BYTES)
    }

    /// A layer holding at most `max_entries` and `max_bytes`.
    pub(crate) fn with_budget(max_entries: usize, max_bytes: usize) -> Self {
        MemoryLayer {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: RandomState::new(),
            max_entries_per_shard: max_entries.div_ceil(SHARDS).max(1),
            max_bytes_per_shard: (max_bytes / SHARDS).max(ENTRY_OVERHEAD * 4),
            trusted_until: AtomicU64::new(u64::MAX),
            base: Instant::now(),
            purges: AtomicU64::new(0),
        }
    }

    /// Completed answers may be replayed until `until` and not after
    /// (markers are not affected: they never replay anything).
    pub(crate) fn trust_until(&self, until: Instant) {
        let nanos = until.saturating_duration_since(self.base).as_nanos();
        self.trusted_until.store(
            u64::try_from(nanos).unwrap_or(u64::MAX - 1),
            Ordering::Release,
        );
    }

    /// Whether `entry` may be answered at `now`.
    fn usable(&self, entry: &FastEntry, now: Instant) -> bool {
        match entry {
            FastEntry::InFlight { .. } => true,
            FastEntry::Completed { .. } => {
                let until = self.trusted_until.load(Ordering::Acquire);
                until == u64::MAX
                    || now.saturating_duration_since(self.base).as_nanos() < u128::from(until)
            }
        }
    }

    fn shard(&self, key: &RecordKey) -> std::sync::MutexGuard<'_, Shard> {
        let i = self.hasher.hash_one(key) as usize % SHARDS;
        // Entries are plain values replaced whole, so a panic elsewhere
        // cannot leave a shard half-written: a poisoned lock is still sound.
        self.shards[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stores `entry`; with `only_if_absent`, answers the live entry
    /// instead when there is one (check and store under one lock).
    pub(crate) fn store(
        &self,
        entry: &FastEntry,
        ttl: Duration,
        only_if_absent: bool,
    ) -> Result<Option<(Arc<FastEntry>, Duration)>, FastError> {
        self.store_in(entry, ttl, only_if_absent, None)
    }

    /// Stores `entry` unless a purge was applied since [`Self::purges_seen`]
    /// said `since` — an answer read before a purge must not be kept after
    /// it; then removes what is stored under its key instead. Checked under
    /// the shard's lock, which the purge's removal takes after counting
    /// itself: either the purge is counted first and nothing is stored, or
    /// the entry is stored first and the purge removes it.
    pub(crate) fn store_unless_purged(&self, entry: &FastEntry, ttl: Duration, since: u64) {
        // Cannot fail (an entry too large for the layer is not kept).
        let _ = self.store_in(entry, ttl, false, Some(since));
    }

    fn store_in(
        &self,
        entry: &FastEntry,
        ttl: Duration,
        only_if_absent: bool,
        unless_purged_since: Option<u64>,
    ) -> Result<Option<(Arc<FastEntry>, Duration)>, FastError> {
        let now = Instant::now();
        let mut shard = self.shard(entry.key());
        if unless_purged_since.is_some_and(|since| self.purges_seen() != since) {
            // What is there (the caller's own in-flight marker, say) goes
            // as the purge would have taken it.
            shard.remove(entry.key());
            return Ok(None);
        }
        if let Some(slot) = shard.entries.get(entry.key())
            && only_if_absent
            && slot.expires > now
        {
            if !self.usable(&slot.entry, now) {
                // A finished answer not to be replayed from here just now:
                // the request goes on to SQL, and no marker replaces the
                // answer (it would turn the key's retries away as in
                // flight).
                return Ok(None);
            }
            let existing = (slot.entry.clone(), slot.expires - now);
            shard.touch(entry.key());
            return Ok(Some(existing));
        }
        let bytes = size_of(entry);
        if bytes > self.max_bytes_per_shard / 4 {
            // Too large to be worth a quarter of a shard: not kept (not a
            // failure either), SQL replays it.
            shard.remove(entry.key());
            return Ok(None);
        }
        shard.make_room(
            bytes,
            self.max_entries_per_shard,
            self.max_bytes_per_shard,
            now,
        );
        shard.tick += 1;
        let used = shard.tick;
        shard.insert(
            entry.key().clone(),
            Slot {
                expires: now + ttl,
                entry: Arc::new(entry.clone()),
                bytes,
                used,
            },
        );
        Ok(None)
    }

    /// The live completed entry under `key`, with the time it has left;
    /// never marks anything (replays answered before any claim is made, and
    /// the copies kept in front of Redis).
    pub(crate) fn completed(&self, key: &RecordKey) -> Option<(FastEntry, Duration)> {
        let now = Instant::now();
        let mut shard = self.shard(key);
        let slot = shard.entries.get(key)?;
        if slot.expires <= now
            || !matches!(*slot.entry, FastEntry::Completed { .. })
            || !self.usable(&slot.entry, now)
        {
            return None;
        }
        let found = ((*slot.entry).clone(), slot.expires - now);
        shard.touch(key);
        Some(found)
    }

    /// How many purges have been applied ([`Self::forget_purged`]): a copy
    /// of an answer read before a purge must not be kept after the purge was
    /// applied, so whoever copies reads this before the question and keeps
    /// the copy only if it has not moved.
    pub(crate) fn purges_seen(&self) -> u64 {
        self.purges.load(Ordering::Acquire)
    }

    /// [`Self::forget`] for a purge read from the purge log.
    pub(crate) fn forget_purged(&self, route: &str, key: &str, scope: Option<&str>) -> usize {
        self.purges.fetch_add(1, Ordering::AcqRel);
        self.forget(route, key, scope)
    }

    /// Forgets every entry of `route`/`key` (in `scope`, or in every scope);
    /// returns how many.
    pub(crate) fn forget(&self, route: &str, key: &str, scope: Option<&str>) -> usize {
        if let Some(scope) = scope {
            let key = RecordKey::new(scope, route, key);
            return usize::from(self.shard(&key).remove(&key));
        }
        let mut removed = 0;
        for shard in &self.shards {
            let mut shard = shard.lock().unwrap_or_else(|p| p.into_inner());
            let matching: Vec<RecordKey> = shard
                .entries
                .keys()
                .filter(|k| k.route == route && k.key == key)
                .cloned()
                .collect();
            for k in &matching {
                removed += usize::from(shard.remove(k));
            }
        }
        removed
    }

    /// Drops expired entries (run by the sweeper).
    pub(crate) fn purge_expired(&self) -> usize {
        let now = Instant::now();
        let mut removed = 0;
        for shard in &self.shards {
            let mut shard = shard.lock().unwrap_or_else(|p| p.into_inner());
            let expired: Vec<RecordKey> = shard
                .entries
                .iter()
                .filter(|(_, slot)| slot.expires <= now)
                .map(|(k, _)| k.clone())
                .collect();
            for k in &expired {
                removed += usize::from(shard.remove(k));
            }
        }
        removed
    }

    /// Bytes held, across shards (for `/metrics` and the tests).
    pub fn bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).bytes)
            .sum()
    }

    /// Entries held, across shards.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).entries.len())
            .sum()
    }

    /// Whether it holds nothing.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
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
    ) -> BoxFuture<'a, Result<Option<(FastEntry, Duration)>, FastError>> {
        let found = self
            .store(entry, ttl, true)
            .map(|existing| existing.map(|(e, left)| ((*e).clone(), left)));
        Box::pin(std::future::ready(found))
    }

    fn peek(&self, key: &RecordKey) -> Option<(FastEntry, Duration)> {
        self.completed(key)
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

    fn purges_seen(&self) -> Option<u64> {
        Some(MemoryLayer::purges_seen(self))
    }

    fn put_unless_purged<'a>(
        &'a self,
        entry: &'a FastEntry,
        ttl: Duration,
        since: Option<u64>,
    ) -> BoxFuture<'a, Result<(), FastError>> {
        match since {
            Some(since) => {
                self.store_unless_purged(entry, ttl, since);
                Box::pin(std::future::ready(Ok(())))
            }
            None => self.put(entry, ttl),
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StoredResponse;

    fn completed(key: &str, body: usize) -> FastEntry {
        FastEntry::Completed {
            key: RecordKey::new("s", "r", key),
            fingerprint: "fp".into(),
            response: StoredResponse {
                status: 200,
                headers: vec![],
                trailers: Vec::new(),
                body: bytes::Bytes::from(vec![b'x'; body]),
                body_kept: true,
                request_id: "rid".into(),
            },
            expires_at_ms: 0,
        }
    }

    #[test]
    fn the_byte_budget_holds_and_the_least_recently_used_go_first() {
        // 16 shards of 1 MiB; entries up to a quarter of a shard are kept.
        let layer = MemoryLayer::with_budget(100_000, 16 * 1024 * 1024);
        let hour = Duration::from_secs(3600);
        for i in 0..600 {
            let _ = layer.store(&completed(&format!("k{i}"), 200 * 1024), hour, false);
        }
        assert!(layer.bytes() <= 16 * 1024 * 1024, "{} bytes", layer.bytes());
        assert!(layer.len() >= 40, "{} entries", layer.len());
        // A recently used entry survives the next wave; the oldest do not.
        let _ = layer.store(&completed("hot", 1024), hour, false);
        for i in 600..1200 {
            let _ = layer.store(&completed("hot", 1024), hour, true);
            let _ = layer.store(&completed(&format!("k{i}"), 200 * 1024), hour, false);
        }
        let hot = RecordKey::new("s", "r", "hot");
        assert!(layer.shard(&hot).entries.contains_key(&hot));
        let first = RecordKey::new("s", "r", "k0");
        assert!(!layer.shard(&first).entries.contains_key(&first));
        assert!(layer.bytes() <= 16 * 1024 * 1024);
        // An answer too large for a shard's quarter is not kept at all.
        layer
            .store(&completed("huge", 600 * 1024), hour, false)
            .unwrap();
        let huge = RecordKey::new("s", "r", "huge");
        assert!(!layer.shard(&huge).entries.contains_key(&huge));
    }

    #[test]
    fn forgetting_keeps_the_accounting_right() {
        let layer = MemoryLayer::with_budget(1000, 16 * 1024 * 1024);
        let hour = Duration::from_secs(3600);
        for i in 0..10 {
            layer
                .store(&completed(&format!("k{i}"), 1000), hour, false)
                .unwrap();
        }
        assert_eq!(layer.forget("r", "k3", None), 1);
        assert_eq!(layer.forget("r", "k4", Some("s")), 1);
        assert_eq!(layer.len(), 8);
        for i in 0..10 {
            layer.forget("r", &format!("k{i}"), None);
        }
        assert_eq!((layer.len(), layer.bytes()), (0, 0));
    }

    #[test]
    fn completed_answers_are_replayed_only_while_purges_are_followed() {
        let layer = MemoryLayer::new(100);
        let hour = Duration::from_secs(3600);
        layer.store(&completed("done", 10), hour, false).unwrap();
        let marker = FastEntry::InFlight {
            key: RecordKey::new("s", "r", "busy"),
            fingerprint: "fp".into(),
            expires_at_ms: 0,
        };
        layer.store(&marker, hour, false).unwrap();
        let done = RecordKey::new("s", "r", "done");
        // Nobody follows purges here: always.
        assert!(layer.completed(&done).is_some());
        // The follower's last read has lapsed: no replay from memory, and
        // a claim finds nothing here (SQL decides) without a marker taking
        // the answer's place; markers still turn duplicates away.
        layer.trust_until(Instant::now() - Duration::from_millis(1));
        assert!(layer.completed(&done).is_none());
        let claim = FastEntry::InFlight {
            key: done.clone(),
            fingerprint: "fp".into(),
            expires_at_ms: 0,
        };
        assert!(layer.store(&claim, hour, true).unwrap().is_none());
        assert!(layer.store(&marker, hour, true).unwrap().is_some());
        // Read again: the answer (not a marker) is replayed again.
        layer.trust_until(Instant::now() + Duration::from_secs(2));
        assert!(layer.completed(&done).is_some());
        assert!(
            layer
                .store(&completed("done", 10), hour, true)
                .unwrap()
                .is_some()
        );
    }

    /// An answer stored with the purge count read before a purge that has
    /// since been applied is not kept, and what was under its key (the
    /// claim's own in-flight marker) goes too; with the current count it
    /// is kept.
    #[test]
    fn an_answer_read_before_a_purge_applied_since_is_not_kept() {
        let layer = MemoryLayer::new(100);
        let hour = Duration::from_secs(3600);
        let key = RecordKey::new("s", "r", "k");
        let marker = FastEntry::InFlight {
            key: key.clone(),
            fingerprint: "fp".into(),
            expires_at_ms: 0,
        };
        let before = layer.purges_seen();
        layer.store(&marker, hour, false).unwrap();
        // A purge (of any key: the count does not say which) is applied.
        layer.forget_purged("r", "other", None);
        layer.store_unless_purged(&completed("k", 10), hour, before);
        assert!(layer.completed(&key).is_none(), "kept after the purge");
        let found = layer.store(&marker, hour, true).unwrap();
        assert!(found.is_none(), "the marker stayed behind: {found:?}");
        layer.store_unless_purged(&completed("k", 10), hour, layer.purges_seen());
        assert!(
            layer.completed(&key).is_some(),
            "not kept with the current count"
        );
    }
}
