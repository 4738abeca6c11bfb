//! Waiting for a record to settle, on any instance (docs/semantics.md, "Waiting duplicates").
//!
//! A duplicate that waits (`on_concurrent = "wait"`) for a request held by
//! another gateway process must learn the outcome the moment it is recorded,
//! not at its next poll. The waiter registers here (`Settlements::watch`)
//! and flags the record in SQL (`watched`); the statement that settles the
//! record (complete, release, uncertain) returns that flag, and only then
//! does the settling store announce it on the instance-wide channel:
//!
//! - Postgres `LISTEN/NOTIFY` (`pg_notify` on the settling store's own
//!   pool; one listening connection per process);
//! - Redis pub/sub when Redis is the fast layer (`PUBLISH` on its
//!   connection; one subscribed connection per process);
//! - in process only on SQLite, whose several instances are not supported.
//!
//! A notification carries a hash of the record key, never the key. Every
//! process's listener wakes its own waiters of that hash; they claim again
//! and find the outcome in the store (the notification says only "look
//! now"). Notifications are an accelerator: a lost one (the listener's
//! connection dropped, Redis restarted) costs a waiter its safety poll,
//! never a wrong answer, and a listener that reconnects wakes every waiter,
//! since it may have missed any of them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
#[cfg(any(feature = "postgres", feature = "redis"))]
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::sync::watch;

use super::RecordKey;

/// The Postgres channel (one per database: gateways on other schemas of
/// the same database hear each other's hashes and at worst claim once
/// more for nothing).
pub const PG_CHANNEL: &str = "idemgate_settled";

/// The Redis channel's name after the key prefix.
pub const REDIS_CHANNEL_SUFFIX: &str = "settled";

/// First pause before a listener reconnects; it doubles.
#[cfg(any(feature = "postgres", feature = "redis"))]
const RECONNECT_START: Duration = Duration::from_millis(100);
/// Longest pause between two listener connection attempts.
#[cfg(any(feature = "postgres", feature = "redis"))]
const RECONNECT_MAX: Duration = Duration::from_secs(5);

/// The hash a notification names a record by.
pub fn token(key: &RecordKey) -> String {
    let mut hash = Sha256::new();
    hash.update(b"idemgate/settled/v1\0");
    for part in [&key.scope, &key.route, &key.key] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part.as_bytes());
    }
    hex::encode(&hash.finalize()[..16])
}

/// How this process announces a settled record to the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Channel {
    /// Nothing to tell the others with (SQLite; MySQL without Redis):
    /// their waiters poll.
    Local,
    /// `pg_notify`.
    Postgres,
    /// `PUBLISH` on the Redis fast layer.
    Redis,
}

/// This process's waiters, by record hash.
#[derive(Default)]
pub struct Settlements {
    waiting: Mutex<HashMap<String, Waiting>>,
    /// The listener task, ended when the last store handle goes.
    listener: Mutex<Option<tokio::task::AbortHandle>>,
}

struct Waiting {
    watchers: usize,
    wake: watch::Sender<u64>,
    /// The record's current attempt is flagged `watched` in SQL by one of
    /// this process's waiters; reset by every wake-up (the next attempt
    /// is a new row version with the flag cleared).
    flagged: bool,
}

/// One waiter's registration; dropping it unregisters.
pub struct Watch {
    settlements: Arc<Settlements>,
    token: String,
    seen: watch::Receiver<u64>,
}

impl Watch {
    /// Whether this waiter must flag the record in SQL before it waits:
    /// true for the first waiter since the last wake-up, which is then
    /// counted as flagged (the others share its announcement).
    pub(crate) fn take_flag(&self) -> bool {
        let mut waiting = self.settlements.lock();
        match waiting.get_mut(&self.token) {
            Some(w) if !w.flagged => {
                w.flagged = true;
                true
            }
            _ => false,
        }
    }

    /// Undoes [`Self::take_flag`] when flagging failed.
    pub(crate) fn clear_flag(&self) {
        if let Some(w) = self.settlements.lock().get_mut(&self.token) {
            w.flagged = false;
        }
    }

    /// Returns once the record was announced settled (or the listener
    /// reconnected) since this watch was made or last returned.
    pub async fn settled(&mut self) {
        // The sender lives as long as a watch of its token does.
        let _ = self.seen.changed().await;
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut waiting = self.settlements.lock();
        if let Some(w) = waiting.get_mut(&self.token) {
            w.watchers -= 1;
            if w.watchers == 0 {
                waiting.remove(&self.token);
            }
        }
    }
}

impl Drop for Settlements {
    fn drop(&mut self) {
        if let Some(task) = self
            .listener
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            task.abort();
        }
    }
}

impl Settlements {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Waiting>> {
        // Each critical section is one map operation.
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a waiter of `key`.
    pub(crate) fn watch(self: &Arc<Self>, key: &RecordKey) -> Watch {
        let token = token(key);
        let mut waiting = self.lock();
        let entry = waiting.entry(token.clone()).or_insert_with(|| Waiting {
            watchers: 0,
            wake: watch::channel(0).0,
            flagged: false,
        });
        entry.watchers += 1;
        let seen = entry.wake.subscribe();
        drop(waiting);
        Watch {
            settlements: self.clone(),
            token,
            seen,
        }
    }

    /// Wakes the waiters of the record with this hash.
    pub(crate) fn wake(&self, token: &str) {
        if let Some(w) = self.lock().get_mut(token) {
            w.flagged = false;
            w.wake.send_modify(|n| *n += 1);
        }
    }

    /// Wakes every waiter (a notification may have been missed).
    #[cfg_attr(not(any(feature = "postgres", feature = "redis")), allow(dead_code))]
    pub(crate) fn wake_all(&self) {
        for w in self.lock().values_mut() {
            w.flagged = false;
            w.wake.send_modify(|n| *n += 1);
        }
    }

    /// Starts this process's listener on the channel (Postgres or Redis);
    /// it runs until the last handle of `self` is dropped.
    pub(crate) fn listen(self: &Arc<Self>, channel: Channel, options: &super::StoreOptions) {
        let weak = Arc::downgrade(self);
        let task = match channel {
            Channel::Local => return,
            Channel::Postgres => tokio::spawn(listen_postgres(weak, options.database_url.clone())),
            Channel::Redis => tokio::spawn(listen_redis(
                weak,
                options.redis_url.clone(),
                redis_channel(&options.redis_prefix),
            )),
        };
        *self.listener.lock().unwrap_or_else(|p| p.into_inner()) = Some(task.abort_handle());
    }
}

/// Whether the process still has a store; wakes everyone after a gap.
#[cfg(any(feature = "postgres", feature = "redis"))]
fn alive(weak: &Weak<Settlements>, missed: bool) -> bool {
    match weak.upgrade() {
        Some(settlements) => {
            if missed {
                settlements.wake_all();
            }
            true
        }
        None => false,
    }
}

#[cfg(not(feature = "postgres"))]
async fn listen_postgres(_: Weak<Settlements>, _: String) {}

#[cfg(feature = "postgres")]
async fn listen_postgres(weak: Weak<Settlements>, url: String) {
    // A URL naming several hosts: each in turn until one takes `LISTEN`
    // (a standby refuses it), and the next after a failure.
    let urls = crate::url_hosts::each_host_url(&url);
    let mut failures = 0u32;
    loop {
        let url = &urls[failures as usize % urls.len()];
        match sqlx::postgres::PgListener::connect(url).await {
            Ok(mut listener) => match listener.listen(PG_CHANNEL).await {
                Ok(()) => {
                    failures = 0;
                    // Anything settled while we were away was not heard.
                    if !alive(&weak, true) {
                        return;
                    }
                    loop {
                        match listener.try_recv().await {
                            Ok(Some(note)) => match weak.upgrade() {
                                Some(s) => s.wake(note.payload()),
                                None => return,
                            },
                            // The connection dropped: reconnected on the
                            // next call, and everyone re-checks.
                            Ok(None) => {
                                if !alive(&weak, true) {
                                    return;
                                }
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, layer = "settle", "Postgres listener failed; waiters fall back to polling until it is back");
                                break;
                            }
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, layer = "settle", "LISTEN failed; retrying")
                }
            },
            Err(e) => {
                if failures == 0 {
                    tracing::warn!(error = %e, layer = "settle", "cannot open the Postgres listener; waiters poll until it is up");
                }
            }
        }
        if !alive(&weak, true) {
            return;
        }
        tokio::time::sleep(backoff(failures)).await;
        failures = failures.saturating_add(1);
    }
}

#[cfg(not(feature = "redis"))]
async fn listen_redis(_: Weak<Settlements>, _: String, _: String) {}

#[cfg(feature = "redis")]
async fn listen_redis(weak: Weak<Settlements>, url: String, channel: String) {
    use futures_util::StreamExt;
    let mut failures = 0u32;
    loop {
        let subscribed = async {
            // The one server, a cluster's first seed node (Redis Cluster
            // forwards every `PUBLISH` to all its nodes), or the
            // Sentinels' master now.
            let client = crate::redis_url::pubsub_client(&url).await?;
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        match subscribed.await {
            Ok(pubsub) => {
                failures = 0;
                if !alive(&weak, true) {
                    return;
                }
                let mut messages = pubsub.into_on_message();
                while let Some(message) = messages.next().await {
                    let Ok(payload) = message.get_payload::<String>() else {
                        continue;
                    };
                    match weak.upgrade() {
                        Some(s) => s.wake(&payload),
                        None => return,
                    }
                }
                tracing::warn!(layer = "settle", "Redis subscription ended; resubscribing");
            }
            Err(e) => {
                if failures == 0 {
                    tracing::warn!(error = %e, layer = "settle", "cannot subscribe on Redis; waiters poll until it is up");
                }
            }
        }
        if !alive(&weak, true) {
            return;
        }
        tokio::time::sleep(backoff(failures)).await;
        failures = failures.saturating_add(1);
    }
}

/// The Redis channel for a key prefix.
pub fn redis_channel(prefix: &str) -> String {
    format!("{prefix}{REDIS_CHANNEL_SUFFIX}")
}

#[cfg(any(feature = "postgres", feature = "redis"))]
fn backoff(failures: u32) -> Duration {
    RECONNECT_START
        .saturating_mul(1 << failures.min(16))
        .min(RECONNECT_MAX)
}
