//! Retiring what expired: forgotten records deleted (or archived) a batch
//! at a time, tombstones stripped of their answers, the uncertain log
//! trimmed. Postgres retires whole partitions first (`partitions.rs`).

use sqlx::Row;

#[cfg(feature = "sqlite")]
use sqlx::Connection;

#[cfg(all(feature = "sqlite", any(test, feature = "testing")))]
use super::COUNT_ARCHIVE;
use super::{DollarSql, Pool};
use crate::StoreError;
use crate::record::millis;
use crate::sql::SWEEP_BATCH;
impl DollarSql {
    /// Postgres retires whole partitions first (see
    /// [`Self::sweep_partitions`]); SQLite has one table to sweep by rows.
    pub(crate) async fn retire(&self, archive: bool) -> Result<(u64, Vec<String>), StoreError> {
        match &self.pool {
            #[cfg(feature = "postgres")]
            Pool::Postgres(_) => self.sweep_partitions(archive).await,
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(_) => {
                let _ = archive;
                Ok((0, vec!["idempotency_records".to_owned()]))
            }
        }
    }

    /// Nothing to make without Postgres's partitions.
    #[cfg(all(not(feature = "postgres"), any(test, feature = "testing")))]
    pub(crate) async fn extend_partitions(&self) -> Result<u32, StoreError> {
        Ok(0)
    }

    /// Removes (or archives) one batch of expired records; returns how
    /// many. On Postgres, of one partition: `table` (see
    /// [`Self::sweep_partitions`]); SQLite has the one table.
    pub(crate) async fn sweep_batch(&self, archive: bool, table: &str) -> Result<u64, StoreError> {
        let statements = self.sql();
        let tombstone = millis(self.tombstone);
        #[cfg(not(feature = "postgres"))]
        let _ = table;
        self.bounded("sweep", async {
            match &self.pool {
                #[cfg(feature = "postgres")]
                Pool::Postgres(pool) => {
                    let text = match archive {
                        true => &statements.sweep_archive_pg,
                        false => &statements.sweep_delete,
                    };
                    sqlx::query(sqlx::AssertSqlSafe(text.replace("{table}", table)))
                        .bind(tombstone)
                        .execute(pool)
                        .await
                        .map(|r| r.rows_affected())
                }
                #[cfg(feature = "sqlite")]
                Pool::Sqlite(pool) if !archive => sqlx::query(statements.sweep_delete.as_str())
                    .bind(tombstone)
                    .execute(pool)
                    .await
                    .map(|r| r.rows_affected()),
                #[cfg(feature = "sqlite")]
                Pool::Sqlite(pool) => {
                    // Copy then delete the same batch inside one write
                    // transaction: the subqueries see the same rows because
                    // no other writer can run until COMMIT.
                    let mut conn = pool.acquire().await?;
                    let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
                    let now: i64 = sqlx::query(statements.now.as_str())
                        .fetch_one(&mut *tx)
                        .await?
                        .try_get(0)?;
                    let copied = sqlx::query(statements.sweep_archive_copy_sqlite.as_str())
                        .bind(now)
                        .bind(tombstone)
                        .execute(&mut *tx)
                        .await?
                        .rows_affected();
                    sqlx::query(statements.sweep_delete_at.as_str())
                        .bind(now)
                        .bind(tombstone)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    Ok(copied)
                }
            }
        })
        .await
    }

    /// With tombstones on: drops the stored answers of records whose
    /// retention ended at or after `after` (ms), one batch; returns how
    /// many and the watermark to pass next time (see [`super::sweep`]).
    pub(crate) async fn strip_batch(&self, after: i64) -> Result<(u64, i64), StoreError> {
        let statements = self.sql();
        self.bounded("sweep", async {
            with_pool!(self, pool => {
                let now: i64 = sqlx::query(statements.now.as_str())
                    .fetch_one(pool)
                    .await?
                    .try_get(0)?;
                let rows = sqlx::query(statements.strip_expired.as_str())
                    .bind(after)
                    .bind(now)
                    .fetch_all(pool)
                    .await?;
                let stripped = rows.len() as u64;
                // A short batch took every strippable row up to `now`; a
                // full one goes on from the newest it took.
                let next = if stripped < SWEEP_BATCH as u64 {
                    now
                } else {
                    rows.iter()
                        .map(|r| r.try_get::<i64, _>(0))
                        .collect::<Result<Vec<_>, _>>()?
                        .into_iter()
                        .max()
                        .unwrap_or(now)
                };
                Ok((stripped, next))
            })
        })
        .await
    }

    /// Forgets uncertain-log entries older than `before_ms`.
    pub(crate) async fn trim_uncertain_log(&self, before_ms: i64) -> Result<u64, StoreError> {
        let statement = self.sql().trim_uncertain_log.as_str();
        self.bounded("trim", async {
            with_pool!(self, pool => sqlx::query(statement).bind(before_ms).execute(pool).await.map(|r| r.rows_affected()))
        })
        .await
    }

    /// Rows archived (operators, tests): on Postgres, in the archive
    /// table and in the partitions retired with `store.archive`.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) async fn archived(&self) -> Result<i64, StoreError> {
        self.bounded("archived", async {
            match &self.pool {
                #[cfg(feature = "postgres")]
                Pool::Postgres(pool) => sqlx::query("SELECT idempotency_archived()")
                    .fetch_one(pool)
                    .await?
                    .try_get::<i64, _>(0),
                #[cfg(feature = "sqlite")]
                Pool::Sqlite(pool) => sqlx::query(COUNT_ARCHIVE)
                    .fetch_one(pool)
                    .await?
                    .try_get::<i64, _>(0),
            }
        })
        .await
    }
}
