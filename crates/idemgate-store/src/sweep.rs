//! Retention: the sweeper deletes (or archives) expired records.
//!
//! On Postgres the record table is partitioned by expiry, and the sweeper
//! first makes the partitions ahead and retires the partitions whose
//! records are all forgotten (`sql/dollar/partitions.rs`): no row-by-row work for
//! them. What is left — a partition a live lease still holds — and
//! SQLite's one table are swept row by row.
//!
//! Row sweeping works in bounded batches ([`super::sql::SWEEP_BATCH`] rows per
//! statement), never one huge transaction, so a backlog of millions of rows
//! never holds locks for long. Records still held under a live lease are
//! left alone until they are resolved or their lease runs out.
//!
//! With `store.tombstone`, a record past its retention is kept until its
//! tombstone ends, and the sweeper drops its stored answer (headers and
//! body) so that only the fingerprint remains. It strips from a watermark
//! (the newest expiry it has stripped), so each row is visited once rather
//! than every tombstone being scanned again at every tick.

use std::sync::Arc;
use std::time::Duration;

use super::StoreError;
use super::memory::MemoryLayer;
use super::sql::{SWEEP_BATCH, SqlStore};

/// Runs batches until one comes back short; returns the rows removed.
/// Tombstones' answers are dropped over the whole tombstone window.
pub async fn sweep_once(sql: &SqlStore, archive: bool) -> Result<u64, StoreError> {
    let mut watermark = None;
    sweep_from(sql, archive, &mut watermark).await
}

/// [`sweep_once`], stripping tombstones from `watermark` on (and moving it).
async fn sweep_from(
    sql: &SqlStore,
    archive: bool,
    watermark: &mut Option<i64>,
) -> Result<u64, StoreError> {
    let (mut total, by_rows) = sql.retire(archive).await?;
    for table in &by_rows {
        loop {
            let moved = sql.sweep_batch(archive, table).await?;
            total += moved;
            if moved < SWEEP_BATCH as u64 {
                break;
            }
            // Let claims in between batches.
            tokio::task::yield_now().await;
        }
    }
    if !sql.tombstone().is_zero() {
        // Rows that expired before the window are forgotten (swept above).
        let mut from = match *watermark {
            Some(from) => from,
            None => super::now_ms() - crate::record::millis(sql.tombstone()),
        };
        loop {
            let (stripped, next) = sql.strip_batch(from).await?;
            from = next;
            if stripped < SWEEP_BATCH as u64 {
                break;
            }
            tokio::task::yield_now().await;
        }
        *watermark = Some(from);
    }
    Ok(total)
}

/// Sweeps every `interval` until the task is aborted.
/// How long the log of records that became uncertain is kept (what the
/// operator's list of uncertain records reads; a record still uncertain
/// after this long is past any retention worth keeping).
pub(crate) const UNCERTAIN_LOG_KEEP: Duration = Duration::from_secs(30 * 24 * 3600);

/// The sweeper: every `interval`, expired records are retired (or
/// archived), tombstones stripped and the logs trimmed, and the in-process
/// layer's expired entries dropped; it runs until aborted.
pub fn spawn(
    sql: SqlStore,
    memory: Option<Arc<MemoryLayer>>,
    interval: Duration,
    archive: bool,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        let mut watermark = None;
        loop {
            ticker.tick().await;
            match sweep_from(&sql, archive, &mut watermark).await {
                Ok(0) => {}
                Ok(n) => {
                    tracing::info!(records = n, archive, layer = "sql", "swept expired records")
                }
                Err(e) => tracing::warn!(error = %e, layer = "sql", "sweep failed; will retry"),
            }
            if let Some(memory) = &memory {
                memory.purge_expired();
            }
            if let Err(e) = sql.trim_purges(super::purges::KEEP_FOR).await {
                tracing::debug!(error = %e, layer = "sql", "trimming the purge log failed; will retry");
            }
            let before = super::now_ms() - crate::record::millis(UNCERTAIN_LOG_KEEP);
            if let Err(e) = sql.trim_uncertain_log(before).await {
                tracing::debug!(error = %e, layer = "sql", "trimming the uncertain log failed; will retry");
            }
            if let Err(e) = sql.trim_deliveries(before).await {
                tracing::debug!(error = %e, layer = "sql", "trimming the delivery counts failed; will retry");
            }
        }
    })
}
