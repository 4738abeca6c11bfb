//! Settling a record (released, uncertain) and telling the waiters: this
//! process's directly, the other instances' by `NOTIFY` or Redis pub/sub
//! (see [`crate::settle`]).

use std::time::Duration;

use super::Store;
use crate::settle::{Channel, Watch};
use crate::{RecordKey, StoreError};

impl Store {
    /// Gives the claim up: the request had no effect upstream.
    pub async fn release(&self, key: &RecordKey, epoch: i64) -> Result<bool, StoreError> {
        let released = self.sql.release(key, epoch).await?;
        self.after_settling(key, released).await
    }

    /// The outcome is unknown: nothing is forwarded for `hold` (a copy may
    /// still run at the upstream), then the next retry may be.
    pub async fn mark_uncertain(
        &self,
        key: &RecordKey,
        epoch: i64,
        hold: Duration,
    ) -> Result<bool, StoreError> {
        let marked = self.sql.mark_uncertain(key, epoch, hold).await?;
        self.after_settling(key, marked).await
    }

    async fn after_settling(
        &self,
        key: &RecordKey,
        settled: Option<bool>,
    ) -> Result<bool, StoreError> {
        self.forget(key).await;
        if settled == Some(true) {
            self.announce(key).await;
        }
        Ok(settled.is_some())
    }

    /// Tells this process's and every other instance's waiters that `key`
    /// settled. Best effort: a waiter that misses it polls.
    pub(super) async fn announce(&self, key: &RecordKey) {
        let token = crate::settle::token(key);
        self.settlements.wake(&token);
        let announced = match self.channel {
            Channel::Local => Ok(()),
            Channel::Postgres => self.sql.announce(&token).await.map_err(|e| e.to_string()),
            Channel::Redis => match &self.fast {
                Some(fast) => self
                    .fast("announce", fast.announce(&token))
                    .await
                    .ok_or_else(|| "fast layer failed".to_owned()),
                None => Ok(()),
            },
        };
        if let Err(e) = announced {
            tracing::debug!(route = %key.route, key = %key.escaped(), error = %e, layer = "settle", "announcing a settled record failed; waiters elsewhere poll");
        }
    }

    /// Registers a waiter of `key` in this process (before it claims
    /// again, so that no announcement falls between).
    pub fn watch(&self, key: &RecordKey) -> Watch {
        self.settlements.watch(key)
    }

    /// Before `watch` waits: makes sure the record's running attempt is
    /// flagged in SQL, so that settling it is announced. False when the
    /// record is not in flight any more: claim again at once.
    pub async fn flag_watched(&self, key: &RecordKey, watch: &Watch) -> Result<bool, StoreError> {
        if !watch.take_flag() {
            return Ok(true);
        }
        match self.sql.mark_watched(key).await {
            Ok(true) => Ok(true),
            Ok(false) => {
                // Settled already: every waiter here that trusted this
                // flag must look again too.
                self.settlements.wake(&crate::settle::token(key));
                Ok(false)
            }
            Err(e) => {
                watch.clear_flag();
                Err(e)
            }
        }
    }
}
