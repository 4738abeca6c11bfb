//! What surrounds the records on MySQL: the MQ link's delivery log, the
//! purge log, the registry of what scopes each namespace, and sweeping.
//!
//! A read-modify statement whose answer Postgres gets from `RETURNING`
//! runs here as an upsert and a read in one transaction: the upsert locks
//! the row, so the read sees what this caller wrote and nobody else's
//! write in between.
//!
//! Sweeping is by rows along the expiry index (the table is not
//! partitioned: a partitioned table needs the partition column in every
//! unique key, which would let a key be claimed again in another period).

use std::collections::BTreeMap;
use std::time::Duration;

use sqlx::mysql::MySqlConnection;
use sqlx::{Connection, Row};

use super::MysqlSql;
use super::records::bind_key;
use super::statements as s;
use crate::record::millis;
use crate::sql::{DeadLetterClaim, LoggedPurge, Orphaned, SWEEP_BATCH, Scoping};
use crate::{RecordKey, StoreError};

// === the delivery log ===

impl MysqlSql {
    /// A consumed message's failed attempts and whether its dead-letter
    /// copy is stored.
    pub(crate) async fn delivery(&self, route: &str, key: &str) -> Result<(u32, bool), StoreError> {
        let row: Option<(i64, bool)> = run!(self, "delivery", |conn| {
            let row = sqlx::query(s::SELECT_DELIVERY.as_str())
                .bind(route)
                .bind(key)
                .fetch_optional(&mut *conn)
                .await?;
            row.map(|r| Ok((r.try_get(0)?, r.try_get(1)?))).transpose()
        })
        .await?;
        Ok(row.map_or((0, false), |(failures, dead)| {
            (u32::try_from(failures).unwrap_or(u32::MAX), dead)
        }))
    }

    /// Counts a failed upstream attempt; `first`: a fresh delivery starts
    /// the count over. The failures so far.
    pub(crate) async fn count_delivery_failure(
        &self,
        route: &str,
        key: &str,
        first: bool,
    ) -> Result<u32, StoreError> {
        let failures: i64 = run!(self, "delivery", |conn| {
            let mut tx = conn.begin().await?;
            sqlx::query(s::COUNT_DELIVERY_FAILURE.as_str())
                .bind(route)
                .bind(key)
                .bind(first)
                .bind(first)
                .bind(first)
                .bind(first)
                .execute(&mut *tx)
                .await?;
            let failures = sqlx::query(s::SELECT_DELIVERY.as_str())
                .bind(route)
                .bind(key)
                .fetch_one(&mut *tx)
                .await?
                .try_get(0)?;
            tx.commit().await?;
            Ok(failures)
        })
        .await?;
        Ok(u32::try_from(failures).unwrap_or(u32::MAX))
    }

    /// Says a consumed message's dead-letter copy is stored.
    pub(crate) async fn mark_dead_lettered(
        &self,
        route: &str,
        key: &str,
    ) -> Result<(), StoreError> {
        run!(self, "delivery", |conn| {
            sqlx::query(s::MARK_DEAD_LETTERED.as_str())
                .bind(route)
                .bind(key)
                .execute(&mut *conn)
                .await
                .map(drop)
        })
        .await
    }

    /// Takes the lease to publish a consumed message's dead-letter copy
    /// (see [`crate::sql::SqlStore::claim_dead_letter`]): won when the row
    /// names `holder` (fresh for every claim) after the upsert.
    pub(crate) async fn claim_dead_letter(
        &self,
        route: &str,
        key: &str,
        holder: &str,
        lease: Duration,
    ) -> Result<DeadLetterClaim, StoreError> {
        let ms = millis(lease);
        run!(self, "delivery", |conn| {
            let mut tx = conn.begin().await?;
            sqlx::query(s::CLAIM_DEAD_LETTER.as_str())
                .bind(route)
                .bind(key)
                .bind(holder)
                .bind(holder)
                .bind(ms)
                .bind(holder)
                .bind(holder)
                .bind(ms)
                .execute(&mut *tx)
                .await?;
            let row = sqlx::query(s::DEAD_LETTER_HOLDER.as_str())
                .bind(route)
                .bind(key)
                .fetch_one(&mut *tx)
                .await?;
            let copy: Option<String> = row.try_get(0)?;
            let now_holder: Option<String> = row.try_get(1)?;
            let stored: bool = row.try_get(2)?;
            tx.commit().await?;
            Ok(match (stored, copy) {
                (true, _) => DeadLetterClaim::Copied,
                (false, Some(copy)) if now_holder.as_deref() == Some(holder) => {
                    DeadLetterClaim::Won(copy)
                }
                _ => DeadLetterClaim::Busy,
            })
        })
        .await
    }

    /// Extends `holder`'s copy lease; whether it still held it.
    pub(crate) async fn renew_dead_letter(
        &self,
        route: &str,
        key: &str,
        holder: &str,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        run!(self, "delivery", |conn| {
            sqlx::query(s::RENEW_DEAD_LETTER.as_str())
                .bind(millis(lease))
                .bind(route)
                .bind(key)
                .bind(holder)
                .execute(&mut *conn)
                .await
                .map(|r| r.rows_affected() == 1)
        })
        .await
    }

    /// Gives back the copy lease `holder` won.
    pub(crate) async fn release_dead_letter(
        &self,
        route: &str,
        key: &str,
        holder: &str,
    ) -> Result<(), StoreError> {
        run!(self, "delivery", |conn| {
            sqlx::query(s::RELEASE_DEAD_LETTER)
                .bind(route)
                .bind(key)
                .bind(holder)
                .execute(&mut *conn)
                .await
                .map(drop)
        })
        .await
    }

    /// Forgets delivery rows untouched since `before_ms`.
    pub(crate) async fn trim_deliveries(&self, before_ms: i64) -> Result<u64, StoreError> {
        self.execute_one("trim", s::TRIM_DELIVERIES, before_ms)
            .await
    }

    /// Runs a statement of one integer parameter; the rows it touched.
    async fn execute_one(
        &self,
        op: &'static str,
        statement: &'static str,
        value: i64,
    ) -> Result<u64, StoreError> {
        run!(self, op, |conn| {
            sqlx::query(statement)
                .bind(value)
                .execute(&mut *conn)
                .await
                .map(|r| r.rows_affected())
        })
        .await
    }

    /// Runs a query of one integer answer.
    async fn fetch_count(
        &self,
        op: &'static str,
        statement: &'static str,
    ) -> Result<i64, StoreError> {
        run!(self, op, |conn| {
            sqlx::query(statement)
                .fetch_one(&mut *conn)
                .await?
                .try_get::<i64, _>(0)
        })
        .await
    }
}

// === the purge log ===

impl MysqlSql {
    /// Purges logged after `last` (oldest first, at most 1,000).
    pub(crate) async fn purges_since(&self, last: i64) -> Result<Vec<LoggedPurge>, StoreError> {
        run!(self, "purges", |conn| {
            let rows = sqlx::query(s::PURGES_SINCE.as_str())
                .bind(last)
                .fetch_all(&mut *conn)
                .await?;
            rows.iter()
                .map(|row| {
                    Ok(LoggedPurge {
                        id: row.try_get(0)?,
                        route: row.try_get(1)?,
                        key: row.try_get(2)?,
                        scope: row.try_get(3)?,
                    })
                })
                .collect()
        })
        .await
    }

    /// The newest logged purge's id.
    pub(crate) async fn last_purge(&self) -> Result<i64, StoreError> {
        self.fetch_count("purges", s::LAST_PURGE).await
    }

    /// Forgets logged purges older than `age`.
    pub(crate) async fn trim_purges(&self, age: Duration) -> Result<u64, StoreError> {
        self.execute_one("purges", s::TRIM_PURGES.as_str(), millis(age))
            .await
    }
}

// === what scopes records ===

impl MysqlSql {
    async fn registered(
        &self,
        conn: &mut MySqlConnection,
    ) -> Result<Vec<(String, String, String)>, sqlx::Error> {
        sqlx::query(s::SCOPES)
            .fetch_all(&mut *conn)
            .await?
            .iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?)))
            .collect()
    }

    /// Every namespace the registry knows that `planned` would drop or
    /// scope otherwise while records under it are live, with their count.
    pub(crate) async fn orphaned_by(
        &self,
        planned: &BTreeMap<String, Scoping>,
    ) -> Result<Vec<Orphaned>, StoreError> {
        let tomb = millis(self.tombstone);
        run!(self, "scopes", |conn| {
            let mut orphaned = Vec::new();
            for (route, records, was) in self.registered(conn).await? {
                let now = planned.get(&route);
                if now.is_some_and(|n| n.records == records && n.scope == was) {
                    continue;
                }
                let row = sqlx::query(s::LIVE_IN_SCOPE.as_str())
                    .bind(tomb)
                    .bind(tomb)
                    .bind(&records)
                    .bind(tomb)
                    .fetch_one(&mut *conn)
                    .await?;
                let (live, until_ms): (i64, i64) = (row.try_get(0)?, row.try_get(1)?);
                if live > 0 {
                    orphaned.push(Orphaned {
                        route,
                        was,
                        now: now.map(|n| n.scope.clone()),
                        live: live as u64,
                        until_ms,
                    });
                }
            }
            Ok(orphaned)
        })
        .await
    }

    /// Records `planned` as what the records are written under from now
    /// on, and forgets the namespaces it drops.
    pub(crate) async fn register_scopes(
        &self,
        planned: &BTreeMap<String, Scoping>,
    ) -> Result<(), StoreError> {
        run!(self, "scopes", |conn| {
            let mut tx = conn.begin().await?;
            let registered = self.registered(&mut tx).await?;
            for (gone, ..) in registered.iter().filter(|(r, ..)| !planned.contains_key(r)) {
                sqlx::query(s::FORGET_SCOPE)
                    .bind(gone)
                    .execute(&mut *tx)
                    .await?;
            }
            for (route, scoping) in planned {
                sqlx::query(s::REGISTER_SCOPE.as_str())
                    .bind(route)
                    .bind(&scoping.records)
                    .bind(&scoping.scope)
                    .bind(&scoping.records)
                    .bind(&scoping.scope)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await
        })
        .await
    }
}

// === sweeping ===

impl MysqlSql {
    /// Nothing is retired whole on MySQL: the one record table is swept by
    /// rows.
    pub(crate) async fn retire(&self, _archive: bool) -> Result<(u64, Vec<String>), StoreError> {
        Ok((0, vec!["idempotency_records".to_owned()]))
    }

    /// No partitions to make.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) async fn extend_partitions(&self) -> Result<u32, StoreError> {
        Ok(0)
    }

    /// Removes (or archives) one batch of forgotten records; how many.
    /// Archiving locks the batch first, so the rows copied are the rows
    /// deleted.
    pub(crate) async fn sweep_batch(&self, archive: bool, _table: &str) -> Result<u64, StoreError> {
        let tomb = millis(self.tombstone);
        run!(self, "sweep", |conn| {
            let now: i64 = sqlx::query(s::NOW_MS.as_str())
                .fetch_one(&mut *conn)
                .await?
                .try_get(0)?;
            if !archive {
                return sqlx::query(s::SWEEP_DELETE.as_str())
                    .bind(now)
                    .bind(tomb)
                    .bind(now)
                    .execute(&mut *conn)
                    .await
                    .map(|r| r.rows_affected());
            }
            let mut tx = conn.begin().await?;
            let keys: Vec<RecordKey> = sqlx::query(s::SWEEP_LOCK.as_str())
                .bind(now)
                .bind(tomb)
                .bind(now)
                .fetch_all(&mut *tx)
                .await?
                .iter()
                .map(|r| {
                    Ok(RecordKey {
                        route: r.try_get(0)?,
                        key: r.try_get(1)?,
                        scope: r.try_get(2)?,
                    })
                })
                .collect::<Result<_, sqlx::Error>>()?;
            if keys.is_empty() {
                return Ok(0);
            }
            // One text per batch size: not kept in the statement cache.
            let copy = s::archive_rows(keys.len());
            let mut query = sqlx::query(sqlx::AssertSqlSafe(copy))
                .persistent(false)
                .bind(now);
            for key in &keys {
                query = bind_key(query, key);
            }
            let copied = query.execute(&mut *tx).await?.rows_affected();
            let delete = s::delete_rows(keys.len());
            let mut query = sqlx::query(sqlx::AssertSqlSafe(delete)).persistent(false);
            for key in &keys {
                query = bind_key(query, key);
            }
            query.execute(&mut *tx).await?;
            tx.commit().await?;
            Ok(copied)
        })
        .await
    }

    /// With tombstones on: drops the stored answers of one batch of
    /// records whose retention ended at or after `after` (ms); how many,
    /// and the watermark to pass next time.
    pub(crate) async fn strip_batch(&self, after: i64) -> Result<(u64, i64), StoreError> {
        run!(self, "sweep", |conn| {
            let now: i64 = sqlx::query(s::NOW_MS.as_str())
                .fetch_one(&mut *conn)
                .await?
                .try_get(0)?;
            let until: Option<i64> = sqlx::query(s::STRIP_UNTIL.as_str())
                .bind(after)
                .bind(now)
                .bind(now)
                .fetch_one(&mut *conn)
                .await?
                .try_get(0)?;
            let Some(until) = until else {
                return Ok((0, now));
            };
            let stripped = sqlx::query(s::STRIP)
                .bind(after)
                .bind(until)
                .bind(now)
                .execute(&mut *conn)
                .await?
                .rows_affected();
            // A short batch took every strippable row up to `now`; a full
            // one goes on from the newest it took.
            let next = if stripped < SWEEP_BATCH as u64 {
                now
            } else {
                until
            };
            Ok((stripped, next))
        })
        .await
    }

    /// Forgets uncertain-log entries older than `before_ms`.
    pub(crate) async fn trim_uncertain_log(&self, before_ms: i64) -> Result<u64, StoreError> {
        self.execute_one("trim", s::TRIM_UNCERTAIN_LOG, before_ms)
            .await
    }

    /// Rows archived.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) async fn archived(&self) -> Result<i64, StoreError> {
        self.fetch_count("archived", s::COUNT_ARCHIVE).await
    }
}
