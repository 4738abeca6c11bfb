//! Purges reach every in-process fast layer (docs/semantics.md, "Purges").
//!
//! An in-process layer (the fast layer, or the copies of completed answers
//! kept in front of Redis, [`super::near`]) lives in one gateway process; a
//! purge made by the CLI or by another instance cannot touch it directly.
//! Every purge is therefore logged in SQL (`idempotency_purges`), and every
//! gateway (and every application built on the library) follows that log:
//! every [`FOLLOW_EVERY`] it reads the purges past the last one it saw (and
//! a trailing window before it: ids of concurrent purges may commit out of
//! order; forgetting twice is harmless) and forgets their keys. A purge
//! command waits [`SETTLE`] before it reports success, so that when the
//! operator is told "purged", no layer still replays the key — and a layer
//! whose follower has not read the log within that time (a failed read, a
//! stalled runtime, a follower gone) replays nothing from memory until it
//! has.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::memory::MemoryLayer;
use super::sql::SqlStore;

/// How often a gateway reads the purge log.
pub(crate) const FOLLOW_EVERY: Duration = Duration::from_secs(1);
/// Ids re-read behind the last one seen.
const TRAILING: i64 = 100;

/// How long a purge waits, once logged, before it reports success; and how
/// long after the start of a successful read of the log a follower's layer
/// may replay from memory. One constant, not derived from any process's
/// own settings: the purger and every follower must agree on it, whatever
/// `store.timeout` each was given (a poll interval, and two seconds for a
/// read to finish before the layer stops replaying).
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
pub const SETTLE: Duration = Duration::from_secs(3);
/// Logged purges older than this are trimmed by the sweeper.
pub(crate) const KEEP_FOR: Duration = Duration::from_secs(3600);

/// Follows the purge log into `memory` until the task is aborted. From
/// this call on, `memory` replays completed answers only while the log has
/// been read recently enough: until a read that started at `R` has
/// succeeded, nothing purged before `R` is known to be forgotten, and a
/// purge is reported done `SETTLE` after it was logged — so each
/// successful read lets answers be replayed until `R + SETTLE`.
pub fn follow(sql: SqlStore, memory: Arc<MemoryLayer>) -> tokio::task::JoinHandle<()> {
    memory.trust_until(Instant::now());
    tokio::spawn(async move {
        // Purges from before this process started touched nothing it holds.
        let mut last = loop {
            let started = Instant::now();
            match sql.last_purge().await {
                Ok(last) => {
                    memory.trust_until(started + SETTLE);
                    break last;
                }
                Err(e) => {
                    tracing::warn!(error = %e, layer = "memory", "reading the purge log failed; retrying");
                    tokio::time::sleep(FOLLOW_EVERY).await;
                }
            }
        };
        // Ids applied within the trailing window: each purge is applied
        // (and counted, `MemoryLayer::purges_seen`) once, not on every
        // re-read — a count that moved every second would keep answers
        // read meanwhile out of memory, and a key purged and then run again
        // would lose its new answer from memory every second.
        let mut applied = std::collections::HashSet::new();
        let mut ticker = tokio::time::interval(FOLLOW_EVERY);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let started = Instant::now();
            match sql.purges_since((last - TRAILING).max(0)).await {
                Ok(purges) => {
                    for purge in purges {
                        last = last.max(purge.id);
                        if !applied.insert(purge.id) {
                            continue;
                        }
                        let n =
                            memory.forget_purged(&purge.route, &purge.key, purge.scope.as_deref());
                        tracing::debug!(route = %purge.route, key = %super::key_ref(&purge.key), forgotten = n, layer = "memory", "followed a purge");
                    }
                    applied.retain(|id| *id > last - TRAILING);
                    memory.trust_until(started + SETTLE);
                }
                Err(e) => {
                    // Until a read succeeds, the trust of the last one
                    // lapses: replays then come from Redis or SQL.
                    tracing::warn!(error = %e, layer = "memory", "reading the purge log failed; answers in memory are not replayed until it is read again")
                }
            }
        }
    })
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;

    /// The follower re-reads a window of ids behind the last one it saw
    /// (late commits), but applies — and counts — each purge once: a count
    /// that moved on every read would keep the answers read meanwhile out
    /// of memory for as long as the purge stays in the window.
    #[tokio::test]
    async fn each_purge_is_applied_once_however_often_it_is_read_again() {
        let sql = crate::sql::sqlite_in_memory().await;
        let memory = Arc::new(MemoryLayer::new(100));
        let follower = follow(sql.clone(), memory.clone());
        // Let the follower note the log's end, then log one purge.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let key = crate::RecordKey::new("scope", "/orders", "k1");
        let hour = Duration::from_secs(3600);
        let crate::Claim::Won { epoch, .. } =
            sql.claim(&key, "fp", "rid", hour, hour).await.unwrap()
        else {
            panic!("a fresh key was not won");
        };
        let response = crate::StoredResponse {
            status: 201,
            headers: Vec::new(),
            trailers: Vec::new(),
            body: bytes::Bytes::new(),
            body_kept: true,
            request_id: "rid".into(),
        };
        sql.complete(&key, epoch, &response).await.unwrap().unwrap();
        assert_eq!(sql.purge("/orders", "k1", None).await.unwrap().removed, 1);
        // Three reads of the log at least (one a second).
        tokio::time::sleep(FOLLOW_EVERY * 3 + Duration::from_millis(300)).await;
        follower.abort();
        assert_eq!(memory.purges_seen(), 1, "one purge, applied once");
    }
}
