//! Fast-layer entries that may be stale because a write to them failed.
//!
//! A completion (or a release) is written to SQL first and to the fast
//! layer second. When the second write fails — Redis away, or a Sentinel
//! failover that promoted a replica lacking it — the layer may still hold
//! the request's in-flight marker: every retry would be answered "in
//! flight" from it, without asking SQL, until the marker expired with its
//! lease. So each such key is removed from the layer as soon as the layer
//! answers again (removing is always safe: the next claim asks SQL, which
//! decides, and writes the outcome back). One task per store works the
//! list while it is not empty; a key is given up when the lease that
//! bounds its marker has run out.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::RecordKey;
use crate::fast::FastLayer;

/// How often the list is tried again.
const RETRY_EVERY: Duration = Duration::from_millis(250);

/// Keys to remove from the fast layer, each until its deadline.
#[derive(Default)]
pub(super) struct Repairs {
    pending: Mutex<HashMap<RecordKey, Instant>>,
    /// Whether a task works the list now.
    working: Mutex<bool>,
}

impl Repairs {
    /// Removes `key` from `fast` once it answers, within `lease`.
    pub(super) fn remove_later(
        self: &Arc<Self>,
        fast: &Arc<dyn FastLayer>,
        key: &RecordKey,
        lease: Duration,
        budget: Duration,
    ) {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key.clone(), Instant::now() + lease);
        let mut working = self.working.lock().unwrap_or_else(|p| p.into_inner());
        if *working {
            return;
        }
        *working = true;
        drop(working);
        let (repairs, fast) = (self.clone(), fast.clone());
        tokio::spawn(async move { repairs.work(fast, budget).await });
    }

    async fn work(self: Arc<Self>, fast: Arc<dyn FastLayer>, budget: Duration) {
        loop {
            let due: Vec<RecordKey> = {
                let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
                let now = Instant::now();
                pending.retain(|_, until| *until > now);
                if pending.is_empty() {
                    // Stop under the same lock a new key would take after
                    // inserting: none is left without a task.
                    *self.working.lock().unwrap_or_else(|p| p.into_inner()) = false;
                    return;
                }
                pending.keys().cloned().collect()
            };
            for key in due {
                match tokio::time::timeout(budget, fast.remove(&key)).await {
                    Ok(Ok(())) => {
                        self.pending
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .remove(&key);
                    }
                    // Still away: the rest would fail alike.
                    _ => break,
                }
            }
            tokio::time::sleep(RETRY_EVERY).await;
        }
    }
}
