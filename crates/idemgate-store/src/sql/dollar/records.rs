//! The record's statements: a claim (its existing-key half; the fresh-key
//! half is batched, `batched.rs`), reads, the outcome writes fenced by the
//! claim's epoch, lease renewals, purges, and the wake-up a settled record
//! sends to waiters on other instances.

use std::time::Duration;

use sqlx::Row;

#[cfg(feature = "postgres")]
use super::partitions;
use super::{DollarSql, Pool};
use crate::codec::encode_fields;
use crate::record::millis;
use crate::sql::rows::{RawRecord, answer_for};
use crate::sql::{NewClaim, Purged, left};
use crate::{Claim, Record, RecordKey, RecordState, StoreError, StoredResponse};
impl DollarSql {
    /// The existing-key half of a claim: take the record over if it may be
    /// taken, else read it to answer, with the record's retention left (a
    /// fast layer caching the answer must not outlive the record). `None`
    /// when the row vanished.
    pub(crate) async fn claim_existing(
        &self,
        c: &NewClaim,
    ) -> Result<Option<(Claim, Duration)>, StoreError> {
        let key = &c.key;
        let statement = self.sql().claim_takeover.as_str();
        let take = async || -> Result<Option<(i64, i64, bool)>, sqlx::Error> {
            with_pool!(self, pool => {
                sqlx::query(statement)
                    .bind(&key.scope).bind(&key.route).bind(&key.key).bind(&c.fingerprint)
                    .bind(millis(c.lease)).bind(&c.request_id).bind(millis(c.retention))
                    .bind(millis(if c.past_tombstone { Duration::ZERO } else { self.tombstone }))
                    .fetch_optional(pool).await
                    .and_then(|row| {
                        row.map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?)))
                            .transpose()
                    })
            })
        };
        let taken = self
            .bounded("claim", async {
                match take().await {
                    // The successor's expiry found no partition (Postgres).
                    #[cfg(feature = "postgres")]
                    Err(e) if partitions::no_partition(&e) => {
                        // Made under this claim's own statement timeout.
                        #[allow(irrefutable_let_patterns)] // without SQLite
                        if let Pool::Postgres(pool) = &self.pool {
                            self.extend_on(&mut *pool.acquire().await?, c.retention)
                                .await?;
                        }
                        take().await
                    }
                    taken => taken,
                }
            })
            .await?;
        if let Some((epoch, expires_at_ms, maybe_ran)) = taken {
            let won = Claim::Won {
                epoch,
                expires_at_ms,
                maybe_ran,
            };
            return Ok(Some((won, c.retention)));
        }
        Ok(self.get(key).await?.map(|record| {
            let remaining = left(record.expires_at_ms - record.read_at_ms);
            (answer_for(&record, &c.fingerprint), remaining)
        }))
    }

    /// Reads one record.
    pub(crate) async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        let statement = self.sql().select_one.as_str();
        let row = self
            .bounded("get", async {
                with_pool!(self, pool => {
                    match sqlx::query(statement)
                        .bind(&key.scope).bind(&key.route).bind(&key.key)
                        .fetch_optional(pool).await?
                    {
                        Some(row) => Ok(Some(RawRecord::read(&row)?)),
                        None => Ok(None),
                    }
                })
            })
            .await?;
        row.map(|r| r.into_record(self.tombstone)).transpose()
    }

    /// Every record of `route` and `key`, whatever the client scope.
    pub(crate) async fn find(&self, route: &str, key: &str) -> Result<Vec<Record>, StoreError> {
        let statement = self.sql().select_by_route_key.as_str();
        let rows = self
            .bounded("find", async {
                with_pool!(self, pool => {
                    let rows = sqlx::query(statement)
                        .bind(route).bind(key)
                        .fetch_all(pool).await?;
                    rows.iter().map(RawRecord::read).collect::<Result<Vec<_>, _>>()
                })
            })
            .await?;
        rows.into_iter()
            .map(|r| r.into_record(self.tombstone))
            .collect()
    }

    /// The records still `uncertain` among the `limit` most recently marked,
    /// newest first: what an operator may have to look at.
    pub(crate) async fn uncertain(&self, limit: i64) -> Result<Vec<Record>, StoreError> {
        let statement = self.sql().select_uncertain.as_str();
        let rows = self
            .bounded("uncertain", async {
                with_pool!(self, pool => {
                    let rows = sqlx::query(statement).bind(limit).fetch_all(pool).await?;
                    rows.iter().map(RawRecord::read).collect::<Result<Vec<_>, _>>()
                })
            })
            .await?;
        rows.into_iter()
            .map(|r| r.into_record(self.tombstone))
            .collect()
    }

    /// Stores the outcome; the retention left (by the database's clock) and
    /// whether a duplicate waits for it, or `None` when `epoch` no longer
    /// holds the claim.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) async fn complete(
        &self,
        key: &RecordKey,
        epoch: i64,
        response: &StoredResponse,
    ) -> Result<Option<(Duration, bool)>, StoreError> {
        self.write_outcome(
            "complete",
            self.sql().complete.as_str(),
            key,
            epoch,
            response,
        )
        .await
    }

    /// Stores the answer reconciliation got for an `uncertain` record (the
    /// upstream says the action ran), fenced by that record's epoch.
    pub(crate) async fn complete_reconciled(
        &self,
        key: &RecordKey,
        epoch: i64,
        response: &StoredResponse,
    ) -> Result<Option<(Duration, bool)>, StoreError> {
        let statement = self.sql().complete_reconciled.as_str();
        self.write_outcome("complete", statement, key, epoch, response)
            .await
    }

    async fn write_outcome(
        &self,
        op: &'static str,
        statement: &'static str,
        key: &RecordKey,
        epoch: i64,
        response: &StoredResponse,
    ) -> Result<Option<(Duration, bool)>, StoreError> {
        let headers = encode_fields(response);
        let status = i32::from(response.status);
        self.bounded(op, async {
            with_pool!(self, pool => {
                sqlx::query(statement)
                    .bind(&key.scope).bind(&key.route).bind(&key.key).bind(epoch)
                    .bind(status).bind(&headers).bind(response.body.as_ref())
                    .bind(response.body_kept).bind(&response.request_id)
                    .fetch_optional(pool).await?
                    .map(|row| Ok((left(row.try_get::<i64, _>(0)?), row.try_get::<bool, _>(1)?)))
                    .transpose()
            })
        })
        .await
    }

    /// Settles a claim `epoch` still holds as `state` (released, or
    /// uncertain for `hold`): whether a duplicate waits for it, or `None`
    /// when `epoch` no longer holds it.
    pub(crate) async fn set_state(
        &self,
        key: &RecordKey,
        epoch: i64,
        state: RecordState,
        hold: Duration,
        op: &'static str,
    ) -> Result<Option<bool>, StoreError> {
        let statement = self.sql().set_state.as_str();
        self.bounded(op, async {
            with_pool!(self, pool => {
                sqlx::query(statement)
                    .bind(&key.scope).bind(&key.route).bind(&key.key).bind(epoch)
                    .bind(state.as_str()).bind(millis(hold)).bind(millis(self.tombstone))
                    .fetch_optional(pool).await?
                    .map(|row| row.try_get::<bool, _>(0))
                    .transpose()
            })
        })
        .await
    }

    /// Says a duplicate waits for `key` while it is in flight; false when
    /// it is not in flight (any more): claim again at once.
    pub(crate) async fn mark_watched(&self, key: &RecordKey) -> Result<bool, StoreError> {
        let statement = self.sql().mark_watched.as_str();
        self.bounded("watch", async {
            with_pool!(self, pool => {
                sqlx::query(statement)
                    .bind(&key.scope).bind(&key.route).bind(&key.key)
                    .execute(pool).await.map(|r| r.rows_affected() > 0)
            })
        })
        .await
    }

    /// Extends a running claim's lease to `lease` from now (the database's
    /// now); false when it was taken over.
    pub(crate) async fn renew(
        &self,
        key: &RecordKey,
        epoch: i64,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let statement = self.sql().renew.as_str();
        self.bounded("renew", async {
            with_pool!(self, pool => {
                sqlx::query(statement)
                    .bind(&key.scope).bind(&key.route).bind(&key.key).bind(epoch)
                    .bind(millis(lease)).bind(millis(self.tombstone))
                    .execute(pool).await.map(|r| r.rows_affected() == 1)
            })
        })
        .await
    }

    /// Tells every instance listening on Postgres that the record with
    /// this hash settled (see [`super::settle`]); nothing on SQLite.
    pub(crate) async fn announce(&self, token: &str) -> Result<(), StoreError> {
        match &self.pool {
            #[cfg(feature = "postgres")]
            Pool::Postgres(pool) => {
                self.bounded("announce", async {
                    sqlx::query("SELECT pg_notify($1, $2)")
                        .bind(crate::settle::PG_CHANNEL)
                        .bind(token)
                        .execute(pool)
                        .await
                        .map(|_| ())
                })
                .await
            }
            #[allow(unreachable_patterns)]
            _ => {
                let _ = token;
                Ok(())
            }
        }
    }

    /// Deletes one record, or with `scope = None` the key in every scope —
    /// except a record held under a live lease, which is never purged (a
    /// purge must not let a second request run beside the first).
    pub(crate) async fn purge(
        &self,
        route: &str,
        key: &str,
        scope: Option<&str>,
    ) -> Result<Purged, StoreError> {
        let statements = self.sql();
        // The delete and its log entry commit together: a purge that other
        // gateways never hear of would leave their in-process layers
        // replaying the key.
        let removed = self
            .bounded("purge", async {
                with_pool!(self, pool => {
                    let mut tx = pool.begin().await?;
                    let removed = match scope {
                        Some(scope) => sqlx::query(statements.purge_one.as_str())
                            .bind(scope).bind(route).bind(key)
                            .execute(&mut *tx).await?,
                        None => sqlx::query(statements.purge_all_scopes.as_str())
                            .bind(route).bind(key)
                            .execute(&mut *tx).await?,
                    }
                    .rows_affected();
                    if removed > 0 {
                        sqlx::query(statements.log_purge.as_str())
                            .bind(route).bind(key).bind(scope)
                            .execute(&mut *tx).await?;
                    }
                    tx.commit().await?;
                    Ok(removed)
                })
            })
            .await?;
        let held = self
            .find(route, key)
            .await?
            .iter()
            .filter(|r| scope.is_none_or(|s| r.key.scope == s) && r.is_held())
            .count() as u64;
        Ok(Purged { removed, held })
    }

    /// Rows in the record table (operators, tests).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) async fn records(&self) -> Result<i64, StoreError> {
        self.bounded("records", async {
            with_pool!(self, pool => {
                sqlx::query("SELECT COUNT(*) FROM idempotency_records").fetch_one(pool).await?.try_get::<i64, _>(0)
            })
        })
        .await
    }
}
