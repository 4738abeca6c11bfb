//! Retention: the sweeper deletes (or archives) expired records.
//!
//! It works in bounded batches ([`super::sql::SWEEP_BATCH`] rows per
//! statement), never one huge transaction, so a backlog of millions of rows
//! never holds locks for long. Records still held under a live lease are
//! left alone until they are resolved or their lease runs out.

use std::sync::Arc;
use std::time::Duration;

use super::StoreError;
use super::memory::MemoryLayer;
use super::sql::{SWEEP_BATCH, SqlStore};

/// Runs batches until one comes back short; returns the rows removed.
pub async fn sweep_once(sql: &SqlStore, archive: bool) -> Result<u64, StoreError> {
    let mut total = 0;
    loop {
        let moved = sql.sweep_batch(archive).await?;
        total += moved;
        if moved < SWEEP_BATCH as u64 {
            return Ok(total);
        }
        // Let claims in between batches.
        tokio::task::yield_now().await;
    }
}

/// Sweeps every `interval` until the task is aborted.
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
        loop {
            ticker.tick().await;
            match sweep_once(&sql, archive).await {
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
        }
    })
}
