//! The record's statements on MySQL: a claim's takeover half, reads, the
//! writes fenced by the claim's epoch, lease renewals and purges. Where
//! Postgres answers with `RETURNING`, the row is read back by its key (and
//! the claim's token, or the epoch that fenced the write).

use std::time::Duration;

use sqlx::mysql::{MySql, MySqlArguments};
use sqlx::{Connection, Row};

use super::statements as s;
use super::{MysqlSql, claim_token};
use crate::codec::encode_fields;
use crate::record::millis;
use crate::sql::rows::{RawRecord, answer_for};
use crate::sql::{NewClaim, Purged, left};
use crate::{Claim, Record, RecordKey, RecordState, StoreError, StoredResponse};

pub(super) type Query<'q> = sqlx::query::Query<'q, MySql, MySqlArguments>;

/// Binds a record key, in the primary key's order.
pub(super) fn bind_key<'q>(query: Query<'q>, key: &'q RecordKey) -> Query<'q> {
    query.bind(&key.route).bind(&key.key).bind(&key.scope)
}

/// MariaDB Galera: a read that answers a client waits until the node has
/// applied what the cluster committed before it.
const CAUSAL: &str = "SET STATEMENT wsrep_sync_wait = 1 FOR ";

impl MysqlSql {
    /// A statement that answers a client, causal on Galera.
    fn answering(&self, text: &'static str) -> sqlx::AssertSqlSafe<String> {
        sqlx::AssertSqlSafe(if self.causal_reads {
            format!("{CAUSAL}{text}")
        } else {
            text.to_owned()
        })
    }

    /// The existing-key half of a claim: take the record over if it may be
    /// taken, else read it to answer, with the record's retention left.
    /// `None` when the row vanished.
    pub(crate) async fn claim_existing(
        &self,
        c: &NewClaim,
    ) -> Result<Option<(Claim, Duration)>, StoreError> {
        let key = &c.key;
        let tomb = millis(if c.past_tombstone {
            Duration::ZERO
        } else {
            self.tombstone
        });
        // One token for every try: a try that met a deadlock took nothing.
        let token = claim_token();
        let taken = run!(self, "claim", |conn| {
            let updated = sqlx::query(s::TAKEOVER.as_str())
                .bind(tomb)
                .bind(&token[..])
                .bind(&c.fingerprint)
                .bind(millis(c.lease))
                .bind(&c.request_id)
                .bind(millis(c.retention));
            let updated = bind_key(updated, key)
                .bind(tomb)
                .bind(&c.fingerprint)
                .execute(&mut *conn)
                .await?;
            if updated.rows_affected() == 0 {
                return Ok(None);
            }
            // Read by the token: a row taken over again since (its
            // lease lapsed at once) is not this claim's.
            let row = bind_key(sqlx::query(s::TAKEN.as_str()), key)
                .bind(&token[..])
                .fetch_optional(&mut *conn)
                .await?;
            row.map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?)))
                .transpose()
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
        let row = run!(self, "get", |conn| {
            let query = sqlx::query(self.answering(s::SELECT_ONE.as_str()));
            match bind_key(query, key).fetch_optional(&mut *conn).await? {
                Some(row) => Ok(Some(RawRecord::read(&row)?)),
                None => Ok(None),
            }
        })
        .await?;
        row.map(|r| r.into_record(self.tombstone)).transpose()
    }

    /// Every record of `route` and `key`, whatever the client scope.
    pub(crate) async fn find(&self, route: &str, key: &str) -> Result<Vec<Record>, StoreError> {
        let rows = run!(self, "find", |conn| {
            let rows = sqlx::query(self.answering(s::SELECT_BY_ROUTE_KEY.as_str()))
                .bind(route)
                .bind(key)
                .fetch_all(&mut *conn)
                .await?;
            rows.iter()
                .map(RawRecord::read)
                .collect::<Result<Vec<_>, _>>()
        })
        .await?;
        rows.into_iter()
            .map(|r| r.into_record(self.tombstone))
            .collect()
    }

    /// The records still `uncertain` among the `limit` most recently
    /// marked, newest first.
    pub(crate) async fn uncertain(&self, limit: i64) -> Result<Vec<Record>, StoreError> {
        let rows = run!(self, "uncertain", |conn| {
            let rows = sqlx::query(self.answering(s::SELECT_UNCERTAIN.as_str()))
                .bind(limit)
                .fetch_all(&mut *conn)
                .await?;
            rows.iter()
                .map(RawRecord::read)
                .collect::<Result<Vec<_>, _>>()
        })
        .await?;
        rows.into_iter()
            .map(|r| r.into_record(self.tombstone))
            .collect()
    }

    /// Stores the outcome; the retention left and whether a duplicate
    /// waits, or `None` when `epoch` no longer holds the claim.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) async fn complete(
        &self,
        key: &RecordKey,
        epoch: i64,
        response: &StoredResponse,
    ) -> Result<Option<(Duration, bool)>, StoreError> {
        self.write_outcome(s::COMPLETE.as_str(), key, epoch, response)
            .await
    }

    /// Stores the answer reconciliation got for an `uncertain` record,
    /// fenced by its epoch.
    pub(crate) async fn complete_reconciled(
        &self,
        key: &RecordKey,
        epoch: i64,
        response: &StoredResponse,
    ) -> Result<Option<(Duration, bool)>, StoreError> {
        self.write_outcome(s::COMPLETE_RECONCILED.as_str(), key, epoch, response)
            .await
    }

    async fn write_outcome(
        &self,
        statement: &'static str,
        key: &RecordKey,
        epoch: i64,
        response: &StoredResponse,
    ) -> Result<Option<(Duration, bool)>, StoreError> {
        let headers = encode_fields(response);
        let status = i32::from(response.status);
        run!(self, "complete", |conn| {
            let query = sqlx::query(statement)
                .bind(status)
                .bind(&headers)
                .bind(response.body.as_ref())
                .bind(response.body_kept)
                .bind(&response.request_id);
            let done = bind_key(query, key).bind(epoch).execute(&mut *conn).await?;
            if done.rows_affected() == 0 {
                return Ok(None);
            }
            settled(conn, key, epoch).await.map(Some)
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
        let (hold, tomb) = (millis(hold), millis(self.tombstone));
        run!(self, op, |conn| {
            let mut tx = conn.begin().await?;
            let query = sqlx::query(s::SET_STATE.as_str())
                .bind(hold)
                .bind(hold)
                .bind(state.as_str());
            let done = bind_key(query, key)
                .bind(epoch)
                .bind(hold)
                .bind(tomb)
                .execute(&mut *tx)
                .await?;
            if done.rows_affected() == 0 {
                return Ok(None);
            }
            if state == RecordState::Uncertain {
                bind_key(sqlx::query(s::LOG_UNCERTAIN.as_str()), key)
                    .bind(epoch)
                    .execute(&mut *tx)
                    .await?;
            }
            let (_, watched) = settled(&mut tx, key, epoch).await?;
            tx.commit().await?;
            Ok(Some(watched))
        })
        .await
    }

    /// Says a duplicate waits for `key` while it is in flight; false when
    /// it is not in flight (any more).
    pub(crate) async fn mark_watched(&self, key: &RecordKey) -> Result<bool, StoreError> {
        run!(self, "watch", |conn| {
            bind_key(sqlx::query(s::MARK_WATCHED.as_str()), key)
                .execute(&mut *conn)
                .await
                .map(|r| r.rows_affected() > 0)
        })
        .await
    }

    /// Extends a running claim's lease to `lease` from now; false when it
    /// was taken over.
    pub(crate) async fn renew(
        &self,
        key: &RecordKey,
        epoch: i64,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let tomb = millis(self.tombstone);
        run!(self, "renew", |conn| {
            let query = sqlx::query(s::RENEW.as_str()).bind(millis(lease));
            bind_key(query, key)
                .bind(epoch)
                .bind(tomb)
                .execute(&mut *conn)
                .await
                .map(|r| r.rows_affected() == 1)
        })
        .await
    }

    /// Nothing to announce on: waiters on other instances hear of a
    /// settled record through Redis, or find it at their safety poll.
    pub(crate) async fn announce(&self, _token: &str) -> Result<(), StoreError> {
        Ok(())
    }

    /// Deletes one record, or with `scope = None` the key in every scope,
    /// except a record held under a live lease; the delete and its log
    /// entry commit together.
    pub(crate) async fn purge(
        &self,
        route: &str,
        key: &str,
        scope: Option<&str>,
    ) -> Result<Purged, StoreError> {
        let removed = run!(self, "purge", |conn| {
            let mut tx = conn.begin().await?;
            let removed = match scope {
                Some(scope) => {
                    sqlx::query(s::PURGE_ONE.as_str())
                        .bind(route)
                        .bind(key)
                        .bind(scope)
                        .execute(&mut *tx)
                        .await?
                }
                None => {
                    sqlx::query(s::PURGE_ALL_SCOPES.as_str())
                        .bind(route)
                        .bind(key)
                        .execute(&mut *tx)
                        .await?
                }
            }
            .rows_affected();
            if removed > 0 {
                sqlx::query(s::LOG_PURGE.as_str())
                    .bind(route)
                    .bind(key)
                    .bind(scope)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            Ok(removed)
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

    /// Rows in the record table.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) async fn records(&self) -> Result<i64, StoreError> {
        run!(self, "records", |conn| {
            sqlx::query(s::COUNT_RECORDS)
                .fetch_one(&mut *conn)
                .await?
                .try_get::<i64, _>(0)
        })
        .await
    }
}

/// What a fenced write left on the record it wrote with `epoch`: the
/// retention left and whether a duplicate waits (nothing left, nobody
/// waiting, when the row was purged since).
async fn settled(
    conn: &mut sqlx::MySqlConnection,
    key: &RecordKey,
    epoch: i64,
) -> Result<(Duration, bool), sqlx::Error> {
    let row = bind_key(sqlx::query(s::SETTLED.as_str()), key)
        .bind(epoch)
        .fetch_optional(&mut *conn)
        .await?;
    Ok(match row {
        Some(row) => (left(row.try_get(0)?), row.try_get(1)?),
        None => (Duration::ZERO, false),
    })
}
