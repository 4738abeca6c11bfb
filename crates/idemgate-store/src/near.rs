//! A near copy of completed answers in front of Redis.
//!
//! With Redis as the fast layer, every replay was a Redis round trip:
//! the same answer fetched and decoded again for each retry of a key. A
//! completed record never changes — it only leaves, by expiry or by an
//! operator's purge — so this process may keep a copy of it and replay
//! from memory. Both ways out are covered: the copy is kept for at most
//! the time Redis still gives the entry (its `PTTL`, counted from before
//! the question, so no clock of the gateway's decides), and purges reach it
//! through the purge log that every in-process layer follows
//! ([`super::purges`]; a purge command reports success only after
//! followers have read it, and a process that has not read the log
//! recently replays nothing from its copies).
//!
//! A copy is made when a replay reads a completed answer from Redis, not
//! when an answer is written: most keys are never retried, and copying
//! every answer would only push out the ones that are. Only completed
//! answers are kept here. In-flight markers stay in Redis alone: they are
//! what turns away a duplicate sent to another instance, and a marker seen
//! by one process only would turn away nobody else.
//! The copies share the in-process layer's bounds
//! (`store.memory_layer_bytes` and its entry count): past them the least
//! recently used go first, and their replays come from Redis again.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;

use super::RecordKey;
use super::codec::FastEntry;
use super::fast::{FastError, FastLayer};
use super::memory::MemoryLayer;
use idemgate_core::metrics::FallbackLayer;

/// A shared fast layer (Redis) with this process's copies of its
/// completed answers in front.
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
pub struct NearLayer {
    shared: Arc<dyn FastLayer>,
    near: Arc<MemoryLayer>,
}

impl NearLayer {
    /// `shared` behind copies kept in `near` (one per process, shared by
    /// every worker's store, followed by the purge log and trimmed by the
    /// sweeper).
    #[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
    #[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
    pub fn new(shared: Arc<dyn FastLayer>, near: Arc<MemoryLayer>) -> Self {
        NearLayer { shared, near }
    }

    /// Keeps a copy of `found`, read under `asked`'s key, if it is a
    /// completed answer of that very record with time left. A value that
    /// names another record is never copied: it would be filed under the
    /// record it names and replayed from memory without any check.
    /// Nor is one read before a purge that was applied meanwhile
    /// (`purges_seen` is what [`MemoryLayer::purges_seen`] said before the
    /// question).
    fn keep(&self, asked: &FastEntry, found: &FastEntry, left: Duration, purges_seen: u64) {
        if matches!(found, FastEntry::Completed { .. })
            && found.key() == asked.key()
            && !left.is_zero()
        {
            self.near.store_unless_purged(found, left, purges_seen);
        }
    }
}

impl FastLayer for NearLayer {
    fn layer(&self) -> FallbackLayer {
        self.shared.layer()
    }

    fn get_or_mark<'a>(
        &'a self,
        entry: &'a FastEntry,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<(FastEntry, Duration)>, FastError>> {
        if let Some(found) = self.peek(entry.key()) {
            return Box::pin(std::future::ready(Ok(Some(found))));
        }
        Box::pin(async move {
            // The time left is counted from before the question: the copy
            // never outlives the entry by the answer's latency.
            let asked_at = std::time::Instant::now();
            let purges_seen = self.near.purges_seen();
            let found = self.shared.get_or_mark(entry, ttl).await?;
            if let Some((existing, left)) = &found {
                let left = left.saturating_sub(asked_at.elapsed());
                self.keep(entry, existing, left, purges_seen);
            }
            Ok(found)
        })
    }

    fn peek(&self, key: &RecordKey) -> Option<(FastEntry, Duration)> {
        self.near.completed(key)
    }

    fn put<'a>(
        &'a self,
        entry: &'a FastEntry,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), FastError>> {
        // Written to Redis only; its first replay makes the copy.
        self.shared.put(entry, ttl)
    }

    fn purges_seen(&self) -> Option<u64> {
        Some(self.near.purges_seen())
    }

    fn put_unless_purged<'a>(
        &'a self,
        entry: &'a FastEntry,
        ttl: Duration,
        since: Option<u64>,
    ) -> BoxFuture<'a, Result<(), FastError>> {
        // Redis is shared: a purge applied here was made by an operator,
        // who also removed the key from Redis; writing back the answer read
        // before it would undo that for every instance. (One that lands
        // before this process has read the purge log is removed again by
        // the purger once the purge has settled.)
        if since.is_some_and(|since| since != self.near.purges_seen()) {
            return self.shared.remove(entry.key());
        }
        self.shared.put(entry, ttl)
    }

    fn remove<'a>(&'a self, key: &'a RecordKey) -> BoxFuture<'a, Result<(), FastError>> {
        self.near.forget(&key.route, &key.key, Some(&key.scope));
        self.shared.remove(key)
    }

    fn moved_at(&self) -> Option<std::time::Instant> {
        self.shared.moved_at()
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), FastError>> {
        self.shared.ping()
    }

    fn announce<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<(), FastError>> {
        self.shared.announce(token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StoredResponse;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A shared layer that counts its round trips (an in-process layer
    /// standing in for Redis).
    struct Counted {
        inner: MemoryLayer,
        calls: AtomicUsize,
    }

    impl FastLayer for Counted {
        fn layer(&self) -> FallbackLayer {
            FallbackLayer::Redis
        }
        fn get_or_mark<'a>(
            &'a self,
            entry: &'a FastEntry,
            ttl: Duration,
        ) -> BoxFuture<'a, Result<Option<(FastEntry, Duration)>, FastError>> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            self.inner.get_or_mark(entry, ttl)
        }
        fn put<'a>(
            &'a self,
            entry: &'a FastEntry,
            ttl: Duration,
        ) -> BoxFuture<'a, Result<(), FastError>> {
            self.inner.put(entry, ttl)
        }
        fn remove<'a>(&'a self, key: &'a RecordKey) -> BoxFuture<'a, Result<(), FastError>> {
            self.inner.remove(key)
        }
        fn ping(&self) -> BoxFuture<'_, Result<(), FastError>> {
            self.inner.ping()
        }
        fn announce<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<(), FastError>> {
            self.inner.announce(token)
        }
    }

    fn layers() -> (Arc<Counted>, Arc<MemoryLayer>, NearLayer) {
        let shared = Arc::new(Counted {
            inner: MemoryLayer::new(1000),
            calls: AtomicUsize::new(0),
        });
        let near = Arc::new(MemoryLayer::new(1000));
        let layer = NearLayer::new(shared.clone(), near.clone());
        (shared, near, layer)
    }

    fn marker(key: &str) -> FastEntry {
        FastEntry::InFlight {
            key: RecordKey::new("s", "r", key),
            fingerprint: "fp".into(),
            expires_at_ms: 0,
        }
    }

    fn completed(key: &str) -> FastEntry {
        FastEntry::Completed {
            key: RecordKey::new("s", "r", key),
            fingerprint: "fp".into(),
            response: StoredResponse {
                status: 201,
                headers: vec![],
                trailers: Vec::new(),
                body: bytes::Bytes::from_static(b"{}"),
                body_kept: true,
                request_id: "rid".into(),
            },
            expires_at_ms: 0,
        }
    }

    #[tokio::test]
    async fn markers_stay_shared_and_completed_answers_are_kept_near() {
        let (shared, near, layer) = layers();
        let lease = Duration::from_secs(30);
        // A marker is placed in the shared layer only: another instance
        // must see it.
        assert!(
            layer
                .get_or_mark(&marker("k"), lease)
                .await
                .unwrap()
                .is_none()
        );
        assert!(near.is_empty());
        let (seen, _) = shared
            .inner
            .get_or_mark(&marker("k"), lease)
            .await
            .unwrap()
            .expect("the marker is in the shared layer");
        assert_eq!(seen, marker("k"));
        // Its completion goes to the shared layer; the first replay reads
        // it there and keeps a copy, the next ones cost no round trip.
        layer
            .put(&completed("k"), Duration::from_secs(60))
            .await
            .unwrap();
        assert!(near.is_empty(), "a copy made before anyone replayed it");
        let calls = shared.calls.load(Ordering::SeqCst);
        for _ in 0..5 {
            let (found, _) = layer
                .get_or_mark(&marker("k"), lease)
                .await
                .unwrap()
                .unwrap();
            assert_eq!(found, completed("k"));
        }
        assert_eq!(shared.calls.load(Ordering::SeqCst), calls + 1);
        // Forgotten in both.
        layer.remove(&RecordKey::new("s", "r", "k")).await.unwrap();
        assert!(near.is_empty());
        assert!(
            layer
                .get_or_mark(&marker("k"), lease)
                .await
                .unwrap()
                .is_none()
        );
    }

    #[tokio::test]
    async fn a_completed_answer_read_from_the_shared_layer_is_kept_for_its_time_left() {
        let (shared, near, layer) = layers();
        shared
            .inner
            .put(&completed("k"), Duration::from_millis(300))
            .await
            .unwrap();
        let (_, left) = layer
            .get_or_mark(&marker("k"), Duration::from_secs(30))
            .await
            .unwrap()
            .unwrap();
        assert!(left <= Duration::from_millis(300));
        let key = RecordKey::new("s", "r", "k");
        let (_, near_left) = near.completed(&key).expect("kept near");
        assert!(near_left <= left, "{near_left:?} > {left:?}");
        // Past the shared layer's expiry the copy is gone too.
        tokio::time::sleep(Duration::from_millis(350)).await;
        assert!(near.completed(&key).is_none());
        // A purge followed from the log forgets the copy.
        layer
            .put(&completed("k"), Duration::from_secs(60))
            .await
            .unwrap();
        layer
            .get_or_mark(&marker("k"), Duration::from_secs(30))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(near.forget("r", "k", None), 1);
        assert!(near.completed(&key).is_none());
    }

    /// A shared layer whose every key holds one value with `left` to live,
    /// answered `after` the question.
    struct Forged {
        value: FastEntry,
        left: Duration,
        after: Duration,
    }

    impl Forged {
        fn holding(value: FastEntry) -> Self {
            Forged {
                value,
                left: Duration::from_secs(60),
                after: Duration::ZERO,
            }
        }
    }

    impl FastLayer for Forged {
        fn layer(&self) -> FallbackLayer {
            FallbackLayer::Redis
        }
        fn get_or_mark<'a>(
            &'a self,
            _entry: &'a FastEntry,
            _ttl: Duration,
        ) -> BoxFuture<'a, Result<Option<(FastEntry, Duration)>, FastError>> {
            Box::pin(async move {
                tokio::time::sleep(self.after).await;
                Ok(Some((self.value.clone(), self.left)))
            })
        }
        fn put<'a>(
            &'a self,
            _: &'a FastEntry,
            _: Duration,
        ) -> BoxFuture<'a, Result<(), FastError>> {
            Box::pin(std::future::ready(Ok(())))
        }
        fn remove<'a>(&'a self, _: &'a RecordKey) -> BoxFuture<'a, Result<(), FastError>> {
            Box::pin(std::future::ready(Ok(())))
        }
        fn ping(&self) -> BoxFuture<'_, Result<(), FastError>> {
            Box::pin(std::future::ready(Ok(())))
        }
        fn announce<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<(), FastError>> {
            Box::pin(std::future::ready(Ok(())))
        }
    }

    #[tokio::test]
    async fn a_value_naming_another_record_is_never_copied() {
        // Under k's storage key, a value that says it is another scope's
        // record: the tiered store ignores it, and no copy may file it
        // under the record it names (it would be replayed from memory).
        let FastEntry::Completed {
            fingerprint,
            response,
            expires_at_ms,
            ..
        } = completed("k")
        else {
            unreachable!()
        };
        let forged = FastEntry::Completed {
            key: RecordKey::new("other-scope", "r", "k"),
            fingerprint,
            response,
            expires_at_ms,
        };
        let near = Arc::new(MemoryLayer::new(1000));
        let layer = NearLayer::new(Arc::new(Forged::holding(forged.clone())), near.clone());
        let (seen, _) = layer
            .get_or_mark(&marker("k"), Duration::from_secs(30))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(seen, forged);
        assert!(near.is_empty(), "a foreign value was copied");
        assert!(layer.peek(forged.key()).is_none());
    }

    #[tokio::test]
    async fn a_copy_never_outlives_the_entry_by_the_answers_latency() {
        // The entry has 300 ms left when Redis answers, 200 ms after the
        // question: the copy gets at most 100 ms, not 300.
        let near = Arc::new(MemoryLayer::new(1000));
        let shared = Forged {
            value: completed("k"),
            left: Duration::from_millis(300),
            after: Duration::from_millis(200),
        };
        let layer = NearLayer::new(Arc::new(shared), near.clone());
        layer
            .get_or_mark(&marker("k"), Duration::from_secs(30))
            .await
            .unwrap()
            .unwrap();
        let (_, left) = near
            .completed(&RecordKey::new("s", "r", "k"))
            .expect("kept");
        assert!(left <= Duration::from_millis(100), "{left:?}");
    }

    #[tokio::test]
    async fn an_answer_read_before_a_purge_applied_meanwhile_is_not_copied() {
        // The follower applies a purge while Redis's answer is on its way:
        // that answer may predate the purge, so no copy is made of it.
        let near = Arc::new(MemoryLayer::new(1000));
        let shared = Forged {
            value: completed("k"),
            left: Duration::from_secs(60),
            after: Duration::from_millis(100),
        };
        let layer = NearLayer::new(Arc::new(shared), near.clone());
        let question = marker("k");
        let (asked, _) = tokio::join!(
            layer.get_or_mark(&question, Duration::from_secs(30)),
            async {
                tokio::time::sleep(Duration::from_millis(30)).await;
                near.forget_purged("r", "k", Some("s"));
            }
        );
        assert!(asked.unwrap().is_some());
        assert!(near.is_empty(), "a copy outlived a purge applied meanwhile");
        // Without a purge meanwhile, the copy is made.
        layer
            .get_or_mark(&marker("k"), Duration::from_secs(30))
            .await
            .unwrap();
        assert!(near.completed(&RecordKey::new("s", "r", "k")).is_some());
    }
}
