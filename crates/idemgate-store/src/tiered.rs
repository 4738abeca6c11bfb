//! [`Store`]: the fast layer in front of the SQL record.
//!
//! Claim protocol, in order:
//! 1. In one atomic fast-layer step (a Lua script on Redis, one lock in
//!    process; bounded by `store.fast_layer_budget`): read what is stored,
//!    or, if nothing is, place an in-flight marker that expires with the
//!    lease. A verified completed entry with the same fingerprint is
//!    replayed; a verified in-flight marker with the same fingerprint is
//!    answered "in flight". Neither touches SQL. Anything else — another
//!    fingerprint, a foreign or corrupt value — goes on to SQL unmarked.
//! 2. (Only a request that placed the marker, or that could not use the fast
//!    layer, gets here.)
//! 3. Claim in SQL — always, for every request that could win. SQL decides;
//!    the marker only spares SQL the duplicates. If SQL says anything but
//!    "won" (Redis had lost its keys), the marker is removed again and a
//!    completed outcome is written back to the fast layer.
//!
//! A fast-layer error or timeout at any step skips the fast layer for this
//! request and is counted in `idemgate_store_fallback_total{layer}`; it can
//! never let a duplicate through because step 3 always runs. Writes after
//! the claim go to SQL first (the truth) and to the fast layer second, best
//! effort.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::batch::Batcher;
use super::codec::FastEntry;
use super::fast::FastLayer;
use super::settle::{Channel, Settlements};
use super::sql::{Completion, NewClaim, SqlStore};
use super::{Claim, Record, RecordKey, StoreError, StoredResponse};
use idemgate_core::await_boxed;
use idemgate_core::metrics::Metrics;

mod fast_claim;
mod purging;
mod repairs;
mod settling;
mod writes;

use fast_claim::FastClaim;
use writes::{LARGE_BODY, LARGE_LANE, Writes, completion_batcher};

/// Where token records live (kept equal to [`idemgate::token::TOKEN_RECORDS`]
/// by a test; the store does not depend on the token module).
pub(crate) const TOKEN_NAMESPACE: &str = "/token";

/// What SQL was asked after: this process's purge count then, and when.
#[derive(Debug, Clone, Copy)]
struct BeforeReading {
    purges_seen: Option<u64>,
    at: Instant,
}

/// How long after SQL was asked an answer may still be written back to
/// the fast layer: well within [`super::purges::SETTLE`], after which a
/// purge made meanwhile removes the key from the fast layer a second time
/// ([`Store::purge_settled`]); a write-back later than that (a process
/// stalled for seconds) could land after that removal.
const WRITE_BACK_WITHIN: Duration =
    Duration::from_millis(super::purges::SETTLE.as_millis() as u64 / 2);

/// Timing settings of the store (from `[store]`).
#[derive(Debug, Clone, Copy)]
pub struct StoreSettings {
    /// How long a claim outlives a crashed holder.
    pub lease: Duration,
    /// How long a finished request replays.
    pub retention: Duration,
    /// A fast-layer answer slower than this falls back to SQL.
    pub fast_layer_budget: Duration,
}

/// The store the gateway uses. Must be made inside a tokio runtime (it
/// starts the completion writer).
#[derive(Clone)]
pub struct Store {
    sql: SqlStore,
    /// Claims and completions with small bodies.
    writes: Writes,
    /// Completions with large bodies, in a lane of their own: a batch of
    /// megabyte answers takes its time to write, and the small ones (most
    /// of them) must not queue behind it.
    large_completions: Batcher<Completion, Option<(Duration, bool)>>,
    fast: Option<Arc<dyn FastLayer>>,
    settings: StoreSettings,
    metrics: Arc<Metrics>,
    /// This process's waiters (shared by every worker's store) and how a
    /// settled record is announced to the other instances.
    settlements: Arc<Settlements>,
    channel: Channel,
    /// Fast-layer keys whose write failed, removed once it answers.
    repairs: Arc<repairs::Repairs>,
}

impl Store {
    /// Composes `sql` with an optional fast layer.
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn new(
        sql: SqlStore,
        fast: Option<Arc<dyn FastLayer>>,
        settings: StoreSettings,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self::with_settlements(sql, fast, settings, metrics, Arc::default(), Channel::Local)
    }

    /// [`Self::new`], sharing `settlements` (one per process) and
    /// announcing settled records on `channel`.
    pub(crate) fn with_settlements(
        sql: SqlStore,
        fast: Option<Arc<dyn FastLayer>>,
        settings: StoreSettings,
        metrics: Arc<Metrics>,
        settlements: Arc<Settlements>,
        channel: Channel,
    ) -> Self {
        Store {
            writes: Writes::new(&sql),
            large_completions: completion_batcher(&sql, LARGE_LANE),
            sql,
            fast,
            settings,
            metrics,
            settlements,
            channel,
            repairs: Arc::default(),
        }
    }

    /// This store without its fast layer: every call goes to SQL. For the
    /// MQ consumers, whose records no HTTP request replays and whose
    /// duplicates are rarely hot: the layer's marker and answer writes
    /// would be two Redis round trips a message for nothing.
    pub fn without_fast_layer(&self) -> Store {
        Store {
            fast: None,
            ..self.clone()
        }
    }

    /// This process's waiters.
    pub(crate) fn settlements(&self) -> &Arc<Settlements> {
        &self.settlements
    }

    /// How settled records are announced to other instances.
    pub fn channel(&self) -> Channel {
        self.channel
    }

    /// The delivery log of the consumer whose records are kept under
    /// `consumer`: the MQ link's handle on the store.
    pub fn delivery_log(&self, consumer: &str) -> crate::sql::DeliveryLog {
        crate::sql::DeliveryLog::new(self.sql.clone(), consumer)
    }

    /// The SQL store underneath.
    pub fn sql(&self) -> &SqlStore {
        &self.sql
    }

    /// The timing settings.
    pub fn settings(&self) -> StoreSettings {
        self.settings
    }

    /// Runs one fast-layer call within the budget. `None` means "skip the
    /// fast layer": the failure is counted and logged here.
    async fn fast<T, E: std::fmt::Display>(
        &self,
        op: &'static str,
        call: impl std::future::Future<Output = Result<T, E>>,
    ) -> Option<T> {
        let fast = self.fast.as_ref()?;
        match tokio::time::timeout(self.settings.fast_layer_budget, call).await {
            Ok(Ok(value)) => Some(value),
            Ok(Err(e)) => {
                self.metrics.fallback(fast.layer());
                tracing::debug!(op, error = %e, layer = "fast", "fast layer failed; using SQL");
                None
            }
            Err(_) => {
                self.metrics.fallback(fast.layer());
                tracing::debug!(op, budget = ?self.settings.fast_layer_budget, layer = "fast", "fast layer too slow; using SQL");
                None
            }
        }
    }

    /// The completed answer for `key` and `fingerprint` that this process
    /// holds in memory (the in-process layer, or the copies kept in front of
    /// Redis), with the record's expiry: a replay answered without a claim,
    /// a round trip or a task. `None` is no answer either way; the claim
    /// decides.
    pub fn replay_in_memory(
        &self,
        key: &RecordKey,
        fingerprint: &str,
    ) -> Option<(StoredResponse, i64)> {
        match self.fast.as_ref()?.peek(key)? {
            (
                FastEntry::Completed {
                    key: found,
                    fingerprint: seen,
                    response,
                    expires_at_ms,
                },
                _,
            ) if found == *key && seen == fingerprint => Some((response, expires_at_ms)),
            _ => None,
        }
    }

    /// Claims `key` for the request with `fingerprint`: the fast layer
    /// first (it may answer a duplicate at once, or place this request's
    /// in-flight marker), then SQL, which decides; then the fast layer is
    /// set to agree with SQL's answer.
    pub async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &str,
        request_id: &str,
    ) -> Result<Claim, StoreError> {
        let started = Instant::now();
        // Before SQL is read: a completed answer read there is written
        // back only as a purge applied meanwhile allows.
        let read = self.before_reading(started);
        // Each half boxed (`await_boxed!`): side by side, their states made
        // this future 27 KB, copied whole wherever a claim is moved.
        let marked = match await_boxed!(self.claim_in_fast_layer(key, fingerprint)) {
            FastClaim::Answered(claim) => return Ok(claim),
            FastClaim::Marked => true,
            FastClaim::ToSql => false,
        };
        // The whole SQL half (insert, takeover, read) within one
        // `store.timeout`, not one per statement.
        let bound = self.sql.timeout();
        let in_sql = { Box::pin(self.claim_in_sql(key, fingerprint, request_id)) };
        let answer =
            tokio::time::timeout(bound, in_sql)
                .await
                .unwrap_or(Err(StoreError::Timeout {
                    op: "claim",
                    after: bound,
                }));
        self.metrics.store_latency.observe(started.elapsed());
        let (claim, left) = match answer {
            Ok((claim, left)) => (Ok(claim), left),
            Err(e) => (Err(e), Duration::ZERO),
        };
        await_boxed!(self.agree_with_sql(key, fingerprint, &claim, left, marked, read));
        claim
    }

    /// After SQL answered a claim: a completed answer is written back for
    /// what is left of its retention (not a whole new one); a marker this
    /// request placed goes when the claim was not won, or it would answer
    /// 409 for a whole lease.
    async fn agree_with_sql(
        &self,
        key: &RecordKey,
        fingerprint: &str,
        claim: &Result<Claim, StoreError>,
        left: Duration,
        marked: bool,
        read: BeforeReading,
    ) {
        let Some(fast) = &self.fast else { return };
        match claim {
            Ok(Claim::Won { .. }) => {}
            Ok(Claim::Completed {
                response,
                expires_at_ms,
            }) if !left.is_zero() => {
                let entry = FastEntry::Completed {
                    key: key.clone(),
                    fingerprint: fingerprint.to_owned(),
                    response: response.clone(),
                    expires_at_ms: *expires_at_ms,
                };
                self.write_back(fast, &entry, left, read).await;
            }
            _ if marked => {
                // A removal slower than the budget (Redis busy in a burst)
                // is finished in the background instead of given up.
                let removed = self.fast("remove", fast.remove(key)).await;
                if removed.is_none() {
                    self.repair_later(fast, key);
                }
            }
            _ => {}
        }
    }

    /// The SQL half of a claim: the fresh-key insert goes through the batch
    /// writer (shared commit), the rest through the single-row path. With
    /// the answer, the record's retention left.
    async fn claim_in_sql(
        &self,
        key: &RecordKey,
        fingerprint: &str,
        request_id: &str,
    ) -> Result<(Claim, Duration), StoreError> {
        let job = NewClaim {
            key: key.clone(),
            fingerprint: fingerprint.to_owned(),
            request_id: request_id.to_owned(),
            lease: self.settings.lease,
            retention: self.settings.retention,
            past_tombstone: false,
        };
        self.claim_job(&job, true).await
    }

    /// Claims `job`'s key: a fresh key through the batch writer (when
    /// `insert_first`, or after a first look found the record gone), else
    /// the record is taken over where it may be, or read to answer. A
    /// record deleted between the two statements (purged, swept) is claimed
    /// again, three times at most. Every insert goes through the writer, so
    /// a claim that committed after its caller stopped waiting always
    /// reaches the writer's orphan hook, which releases it.
    async fn claim_job(
        &self,
        job: &NewClaim,
        insert_first: bool,
    ) -> Result<(Claim, Duration), StoreError> {
        let mut insert = insert_first;
        for _ in 0..3 {
            if insert && let Some((epoch, expires_at_ms)) = self.writes.claim(job.clone()).await? {
                let won = Claim::Won {
                    epoch,
                    expires_at_ms,
                    maybe_ran: false,
                };
                return Ok((won, job.retention));
            }
            insert = true;
            if let Some(answer) = self.sql.claim_existing(job).await? {
                return Ok(answer);
            }
        }
        Err(StoreError::Unavailable {
            op: "claim",
            cause: "the record kept disappearing between statements".into(),
        })
    }

    /// Claims a key whose record answered [`Claim::Expired`], for a
    /// sender's redelivery (a callback): a provider retries for days, and a
    /// `410` is not an acknowledgement it understands, so the record is
    /// taken over and the delivery forwarded again with the same stable
    /// key, for the upstream's own state check. SQL only: a fast layer never
    /// holds a record past its retention.
    pub async fn claim_past_tombstone(
        &self,
        key: &RecordKey,
        fingerprint: &str,
        request_id: &str,
    ) -> Result<Claim, StoreError> {
        let job = NewClaim {
            key: key.clone(),
            fingerprint: fingerprint.to_owned(),
            request_id: request_id.to_owned(),
            lease: self.settings.lease,
            retention: self.settings.retention,
            past_tombstone: true,
        };
        let bound = self.sql.timeout();
        let answer = tokio::time::timeout(bound, async {
            self.claim_job(&job, false).await.map(|(claim, _)| claim)
        })
        .await;
        answer.unwrap_or(Err(StoreError::Timeout {
            op: "claim",
            after: bound,
        }))
    }

    /// Records the outcome; false when the claim was taken over meanwhile
    /// (the late write is refused and nothing is cached). `expires_at_ms`
    /// is the record's, from its claim.
    pub async fn complete(
        &self,
        key: &RecordKey,
        epoch: i64,
        fingerprint: &str,
        response: &StoredResponse,
        expires_at_ms: i64,
    ) -> Result<bool, StoreError> {
        let started = Instant::now();
        let read = self.before_reading(started);
        let completion = Completion {
            key: key.clone(),
            epoch,
            response: response.clone(),
        };
        let done = if response.body.len() > LARGE_BODY {
            self.large_completions.submit(completion).await?
        } else {
            self.writes.complete(completion).await?
        };
        self.metrics.store_latency.observe(started.elapsed());
        self.after_completion(key, fingerprint, response, expires_at_ms, done, read)
            .await
    }

    /// Records what reconciliation learned for an `uncertain` record (the
    /// upstream says the action ran), fenced by that record's epoch.
    pub async fn complete_reconciled(
        &self,
        key: &RecordKey,
        epoch: i64,
        fingerprint: &str,
        response: &StoredResponse,
        expires_at_ms: i64,
    ) -> Result<bool, StoreError> {
        let read = self.before_reading(Instant::now());
        let done = self.sql.complete_reconciled(key, epoch, response).await?;
        self.after_completion(key, fingerprint, response, expires_at_ms, done, read)
            .await
    }

    async fn after_completion(
        &self,
        key: &RecordKey,
        fingerprint: &str,
        response: &StoredResponse,
        expires_at_ms: i64,
        done: Option<(Duration, bool)>,
        read: BeforeReading,
    ) -> Result<bool, StoreError> {
        let Some((left, watched)) = done else {
            // Refused by the fence: whatever the fast layer holds for this
            // key is not ours to keep; SQL decides from here.
            self.forget(key).await;
            return Ok(false);
        };
        // The fast layer keeps the outcome exactly as long as the record
        // (unless it was purged as soon as it was written).
        if let Some(fast) = &self.fast {
            let entry = FastEntry::Completed {
                key: key.clone(),
                fingerprint: fingerprint.to_owned(),
                response: response.clone(),
                expires_at_ms,
            };
            self.write_back(fast, &entry, left, read).await;
        }
        if watched {
            self.announce(key).await;
        }
        Ok(true)
    }

    /// What a write-back of what SQL says after `at` depends on.
    fn before_reading(&self, at: Instant) -> BeforeReading {
        BeforeReading {
            purges_seen: self.fast.as_ref().and_then(|fast| fast.purges_seen()),
            at,
        }
    }

    /// Writes a completed answer read from (or just written to) SQL back
    /// to the fast layer — unless a purge was applied in this process
    /// since, or the SQL half took so long that a purge made meanwhile may
    /// already have settled (its purger's second removal from Redis has
    /// run): then the key is removed instead, our own marker with it.
    async fn write_back(
        &self,
        fast: &Arc<dyn FastLayer>,
        entry: &FastEntry,
        ttl: Duration,
        read: BeforeReading,
    ) {
        let written = if read.at.elapsed() < WRITE_BACK_WITHIN {
            self.fast("put", fast.put_unless_purged(entry, ttl, read.purges_seen))
                .await
        } else {
            self.fast("remove", fast.remove(entry.key())).await
        };
        if written.is_none() {
            self.repair_later(fast, entry.key());
        }
    }

    /// A write to the fast layer failed: the marker this request placed
    /// may still be there, answering every retry "in flight" without SQL.
    /// The key is removed once the layer answers again (see
    /// `tiered/repairs.rs`).
    fn repair_later(&self, fast: &Arc<dyn FastLayer>, key: &RecordKey) {
        self.repairs.remove_later(
            fast,
            key,
            self.settings.lease,
            self.settings.fast_layer_budget,
        );
    }

    /// Extends the lease of a running claim.
    pub async fn renew(&self, key: &RecordKey, epoch: i64) -> Result<bool, StoreError> {
        self.sql.renew(key, epoch, self.settings.lease).await
    }

    /// Reads one record from SQL.
    pub async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        self.sql.get(key).await
    }

    /// Every record of `route`/`key` across client scopes.
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    #[cfg(any(test, feature = "testing"))]
    pub(crate) async fn find(&self, route: &str, key: &str) -> Result<Vec<Record>, StoreError> {
        self.sql.find(route, key).await
    }

    /// Drops whatever the fast layer holds for `key` (SQL answers next).
    pub async fn forget(&self, key: &RecordKey) {
        if let Some(fast) = &self.fast
            && self.fast("remove", fast.remove(key)).await.is_none()
        {
            self.repair_later(fast, key);
        }
    }

    /// SQL reachable, and the fast layer's state, for `/readyz`.
    pub async fn readiness(&self) -> (Result<(), StoreError>, Option<Result<(), String>>) {
        let sql = self.sql.ping().await;
        let fast = match &self.fast {
            None => None,
            Some(fast) => Some(
                match tokio::time::timeout(
                    self.settings
                        .fast_layer_budget
                        .max(Duration::from_millis(500)),
                    fast.ping(),
                )
                .await
                {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err("timed out".into()),
                },
            ),
        };
        (sql, fast)
    }

    /// The fast layer's kind, for logs and `/readyz`.
    pub fn fast_layer_name(&self) -> &'static str {
        match self.fast.as_ref().map(|f| f.layer()) {
            Some(idemgate_core::metrics::FallbackLayer::Redis) => "redis",
            Some(idemgate_core::metrics::FallbackLayer::Memory) => "memory",
            None => "none",
        }
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;
    use crate::memory::MemoryLayer;
    use futures_util::future::BoxFuture;
    use idemgate_core::metrics::FallbackLayer;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    use super::super::fast::FastError;

    /// The in-process layer, where a purge can be applied (as the purge
    /// log's follower applies one) at the moment a claim asks the layer,
    /// i.e. after the claim noted the purge count and before it reads SQL.
    struct PurgedMeanwhile {
        memory: Arc<MemoryLayer>,
        purge_next: AtomicBool,
        /// The next question takes this many ms (a process stalled).
        stall_next_ms: AtomicU64,
        /// Removals fail (Redis unreachable, say).
        removals_fail: AtomicBool,
    }

    impl FastLayer for PurgedMeanwhile {
        fn layer(&self) -> FallbackLayer {
            FallbackLayer::Memory
        }
        fn get_or_mark<'a>(
            &'a self,
            entry: &'a FastEntry,
            ttl: Duration,
        ) -> BoxFuture<'a, Result<Option<(FastEntry, Duration)>, FastError>> {
            if self.purge_next.swap(false, Ordering::SeqCst) {
                let key = entry.key();
                self.memory.forget_purged(&key.route, &key.key, None);
            }
            let stall = Duration::from_millis(self.stall_next_ms.swap(0, Ordering::SeqCst));
            Box::pin(async move {
                tokio::time::sleep(stall).await;
                self.memory.get_or_mark(entry, ttl).await
            })
        }
        fn peek(&self, key: &RecordKey) -> Option<(FastEntry, Duration)> {
            self.memory.peek(key)
        }
        fn put<'a>(
            &'a self,
            entry: &'a FastEntry,
            ttl: Duration,
        ) -> BoxFuture<'a, Result<(), FastError>> {
            self.memory.put(entry, ttl)
        }
        fn purges_seen(&self) -> Option<u64> {
            FastLayer::purges_seen(&*self.memory)
        }
        fn put_unless_purged<'a>(
            &'a self,
            entry: &'a FastEntry,
            ttl: Duration,
            since: Option<u64>,
        ) -> BoxFuture<'a, Result<(), FastError>> {
            self.memory.put_unless_purged(entry, ttl, since)
        }
        fn remove<'a>(&'a self, key: &'a RecordKey) -> BoxFuture<'a, Result<(), FastError>> {
            if self.removals_fail.load(Ordering::SeqCst) {
                let refused = FastError::Backend("unreachable".into());
                return Box::pin(std::future::ready(Err(refused)));
            }
            self.memory.remove(key)
        }
        fn ping(&self) -> BoxFuture<'_, Result<(), FastError>> {
            self.memory.ping()
        }
        fn announce<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<(), FastError>> {
            self.memory.announce(token)
        }
    }

    /// A completed answer read from SQL while a purge was being applied in
    /// this process is not written back to memory (from where it would be
    /// replayed after the purge without another look), and the claim's
    /// in-flight marker does not stay behind (it would turn the key's
    /// retries away for a lease). Without a purge meanwhile, the same read
    /// is written back.
    #[tokio::test]
    async fn an_answer_read_before_a_purge_is_not_kept_in_memory_after_it() {
        let (store, layer, key) = completed_record().await;
        let memory = layer.memory.clone();

        // Another process, say, that does not hold the answer: SQL replays
        // it, and it is written back.
        FastLayer::remove(&*memory, &key).await.unwrap();
        let claim = store.claim(&key, "fp", "rid").await.unwrap();
        assert!(matches!(claim, Claim::Completed { .. }), "{claim:?}");
        assert!(
            memory.completed(&key).is_some(),
            "the read was written back"
        );

        // The same read with a purge applied meanwhile.
        FastLayer::remove(&*memory, &key).await.unwrap();
        layer.purge_next.store(true, Ordering::SeqCst);
        let claim = store.claim(&key, "fp", "rid").await.unwrap();
        assert!(matches!(claim, Claim::Completed { .. }), "{claim:?}");
        assert!(
            memory.completed(&key).is_none(),
            "an answer read before a purge was kept after it"
        );
        assert!(
            memory.peek(&key).is_none() && store.replay_in_memory(&key, "fp").is_none(),
            "something stayed behind in memory"
        );
        // No marker either: the next claim asks SQL and is answered.
        let claim = store.claim(&key, "fp", "rid").await.unwrap();
        assert!(matches!(claim, Claim::Completed { .. }), "{claim:?}");
    }

    /// A claim whose process stalled between asking SQL and writing the
    /// answer back, for longer than a purge made meanwhile takes to settle
    /// (after which its purger has cleared the fast layer for the last
    /// time), does not write it back; nor does its marker stay.
    #[tokio::test]
    async fn a_stalled_claim_does_not_write_back_what_it_read_seconds_ago() {
        let (store, layer, key) = completed_record().await;
        let memory = layer.memory.clone();
        FastLayer::remove(&*memory, &key).await.unwrap();
        let stall = WRITE_BACK_WITHIN + Duration::from_millis(100);
        layer
            .stall_next_ms
            .store(stall.as_millis() as u64, Ordering::SeqCst);
        let claim = store.claim(&key, "fp", "rid").await.unwrap();
        assert!(matches!(claim, Claim::Completed { .. }), "{claim:?}");
        assert!(
            memory.completed(&key).is_none(),
            "written back after a stall"
        );
        let claim = store.claim(&key, "fp", "rid").await.unwrap();
        assert!(
            matches!(claim, Claim::Completed { .. }),
            "a marker stayed: {claim:?}"
        );
    }

    /// A purge is not reported done while the fast layer may still replay
    /// the key: a removal that fails after the purge settled fails the
    /// purge (the record is gone from SQL all the same).
    #[tokio::test]
    async fn a_purge_whose_fast_layer_cannot_be_cleared_is_not_reported_done() {
        let (store, layer, key) = completed_record().await;
        layer.removals_fail.store(true, Ordering::SeqCst);
        let purged = store
            .purge_settled(&key.route, &key.key, Some(&key.scope))
            .await;
        assert!(
            matches!(purged, Err(StoreError::Unavailable { op: "purge", .. })),
            "{purged:?}"
        );
        assert!(store.sql().get(&key).await.unwrap().is_none());
        // Repeated once the layer answers, naming the client: done.
        layer.removals_fail.store(false, Ordering::SeqCst);
        let purged = store
            .purge_settled(&key.route, &key.key, Some(&key.scope))
            .await
            .unwrap();
        assert_eq!(purged.removed, 0);
        assert!(layer.memory.peek(&key).is_none());
    }

    /// An operator who hangs up while a purge settles does not cancel its
    /// second removal: an answer written back just after the first one
    /// (a retry that read SQL just before the purge) is still removed.
    #[tokio::test]
    async fn a_purge_given_up_on_by_its_operator_still_clears_the_fast_layer() {
        let (store, layer, key) = completed_record().await;
        let entry = layer.memory.completed(&key).unwrap().0;
        let purge = store.purge_settled(&key.route, &key.key, Some(&key.scope));
        let given_up = tokio::time::timeout(Duration::from_millis(200), purge).await;
        assert!(given_up.is_err(), "the purge did not wait to settle");
        // The late write-back, after the first removal.
        layer
            .memory
            .store(&entry, Duration::from_secs(3600), false)
            .unwrap();
        tokio::time::sleep(super::super::purges::SETTLE + Duration::from_millis(300)).await;
        assert!(
            layer.memory.completed(&key).is_none(),
            "the second removal was cancelled with the operator's request"
        );
    }

    /// A store on SQLite behind [`PurgedMeanwhile`], holding one completed
    /// record (in SQL and in memory).
    async fn completed_record() -> (Store, Arc<PurgedMeanwhile>, RecordKey) {
        let settings = StoreSettings {
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(3600),
            fast_layer_budget: Duration::from_secs(5),
        };
        let sql = crate::sql::sqlite_in_memory().await;
        let memory = Arc::new(MemoryLayer::new(100));
        let layer = Arc::new(PurgedMeanwhile {
            memory: memory.clone(),
            purge_next: AtomicBool::new(false),
            stall_next_ms: AtomicU64::new(0),
            removals_fail: AtomicBool::new(false),
        });
        let store = Store::new(sql, Some(layer.clone()), settings, Arc::default());
        let key = RecordKey::new("scope", "/orders", "k1");
        let Claim::Won {
            epoch,
            expires_at_ms,
            ..
        } = store.claim(&key, "fp", "rid").await.unwrap()
        else {
            panic!("a fresh key was not won");
        };
        let response = StoredResponse {
            status: 201,
            headers: Vec::new(),
            trailers: Vec::new(),
            body: bytes::Bytes::from_static(b"{}"),
            body_kept: true,
            request_id: "rid".into(),
        };
        assert!(
            store
                .complete(&key, epoch, "fp", &response, expires_at_ms)
                .await
                .unwrap()
        );
        assert!(memory.completed(&key).is_some(), "the outcome is kept");
        (store, layer, key)
    }
}
