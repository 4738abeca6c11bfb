//! Postgres: the record table's partitions by expiry — made ahead, retired
//! whole (`migrations/postgres/0006_partitions.sql` explains the design and
//! holds the functions called here).
//!
//! Partition maintenance is not on any request's path, and checking that a
//! partition holds no live lease reads all of it, so it runs under a bound
//! of its own ([`MAINTENANCE_BOUND`]) rather than `store.timeout`. The DDL
//! inside waits at most `lock_timeout` (set by the functions) for the
//! parent table's lock: claims queue behind a waiting DDL, so it gives up
//! quickly and tries again at the next sweep instead.

use std::time::Duration;

use sqlx::Row;

use super::{DollarSql, Pool};
use crate::StoreError;
use crate::record::millis;

/// How long one maintenance statement may run.
const MAINTENANCE_BOUND: Duration = Duration::from_secs(600);

/// Spans of expiries made ahead beyond the retention: a span is at least
/// a sweep interval, so the next partition exists at least a sweep or two
/// before the first claim lands in it.
const SPANS_AHEAD: u32 = 2;

/// Whether a write failed because no partition takes its row's expiry:
/// a check violation (23514) that names no constraint.
pub(super) fn no_partition(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db)
        if db.code().as_deref() == Some("23514") && db.constraint().is_none())
}

/// `$1 span ms, $2 ms ahead of now, $3 lock wait` → partitions made.
const EXTEND: &str = "SELECT idempotency_extend($1, \
     (extract(epoch from clock_timestamp()) * 1000)::bigint + $2, $3)";

/// How long the sweeper waits for the locks that making partitions takes
/// (claims queue behind a waiting DDL): it tries again at its next sweep.
const SWEEPER_LOCK_WAIT: &str = "200ms";

/// A claim that found no partition waits for whoever is making them, as
/// long as its statement may run (`0`: no lock timeout of its own).
const CLAIM_LOCK_WAIT: &str = "0";

impl DollarSql {
    /// Makes the partitions that cover expiries up to the retention plus
    /// [`SPANS_AHEAD`] spans from now; returns how many were made. Nothing
    /// to do on SQLite.
    #[allow(irrefutable_let_patterns)] // a build without SQLite
    pub(crate) async fn extend_partitions(&self) -> Result<u32, StoreError> {
        let Pool::Postgres(pool) = &self.pool else {
            return Ok(0);
        };
        let span = millis(self.postgres.partition_span);
        let ahead = millis(self.postgres.retention) + span * i64::from(SPANS_AHEAD);
        let made: i32 = self
            .maintenance("partitions", pool, async |conn| {
                sqlx::query(EXTEND)
                    .bind(span)
                    .bind(ahead)
                    .bind(SWEEPER_LOCK_WAIT)
                    .fetch_one(&mut *conn)
                    .await?
                    .try_get(0)
            })
            .await?;
        if made > 0 {
            tracing::debug!(
                partitions = made,
                layer = "sql",
                "made record partitions ahead"
            );
        }
        Ok(made.unsigned_abs())
    }

    /// After a claim found no partition for its expiry: makes the
    /// partitions a record kept `retention` needs, on the claim's own
    /// connection, so that it can be tried once more.
    pub(super) async fn extend_on(
        &self,
        conn: &mut sqlx::PgConnection,
        retention: Duration,
    ) -> Result<(), sqlx::Error> {
        let span = millis(self.postgres.partition_span);
        let ahead = millis(retention.max(self.postgres.retention)) + span * i64::from(SPANS_AHEAD);
        tracing::warn!(
            layer = "sql",
            "a claim found no record partition for its expiry (is every sweeper stopped?); making them now"
        );
        // Waits (within the claim's statement timeout) for whoever is
        // making them at the same moment, instead of failing the claim.
        sqlx::query(EXTEND)
            .bind(span)
            .bind(ahead)
            .bind(CLAIM_LOCK_WAIT)
            .execute(conn)
            .await
            .map(|_| ())
    }

    /// Makes the partitions ahead, then retires every partition whose
    /// expiries and tombstones are over. Returns the rows they held and the
    /// partitions left to sweep row by row: those a live lease still holds.
    /// A partition whose DDL lock was not granted is left for the next
    /// sweep (logged).
    #[allow(irrefutable_let_patterns)]
    pub(crate) async fn sweep_partitions(
        &self,
        archive: bool,
    ) -> Result<(u64, Vec<String>), StoreError> {
        let mut by_rows = Vec::new();
        let Pool::Postgres(pool) = &self.pool else {
            return Ok((0, by_rows));
        };
        if let Err(e) = self.extend_partitions().await {
            tracing::warn!(error = %e, layer = "sql", "making the record partitions failed; will retry");
        }
        let tombstone = millis(self.tombstone);
        let due: Vec<(String, bool)> = self
            .maintenance("partitions", pool, async |conn| {
                sqlx::query_as(
                    "SELECT name, detached FROM idempotency_partitions \
                     WHERE detached \
                        OR upper_ms + $1 <= (extract(epoch from clock_timestamp()) * 1000)::bigint \
                     ORDER BY upper_ms",
                )
                .bind(tombstone)
                .fetch_all(&mut *conn)
                .await
            })
            .await?;
        let mut retired = 0;
        for (name, detached) in due {
            if !detached {
                let outcome: Result<i64, StoreError> = self
                    .maintenance("retire", pool, async |conn| {
                        sqlx::query_scalar("SELECT idempotency_retire($1)")
                            .bind(&name)
                            .fetch_one(&mut *conn)
                            .await
                    })
                    .await;
                match outcome {
                    Ok(-2) => break, // another gateway is retiring
                    Ok(-1) => {
                        tracing::info!(
                            partition = %name, layer = "sql",
                            "an expired record partition still holds a live lease; sweeping its free rows one by one"
                        );
                        by_rows.push(name);
                        continue;
                    }
                    Ok(rows) => {
                        retired += rows.unsigned_abs();
                        tracing::info!(
                            partition = %name, records = rows, archive, layer = "sql",
                            "retired an expired record partition"
                        );
                    }
                    Err(e) => {
                        tracing::warn!(
                            partition = %name, error = %e, layer = "sql",
                            "retiring an expired record partition failed; will retry"
                        );
                        continue;
                    }
                }
            }
            // Detached: no claim reads it any more; dropping it (its files)
            // holds no lock anyone waits for.
            if let Err(e) = self
                .maintenance("retire", pool, async |conn| {
                    sqlx::query("SELECT idempotency_discard($1, $2)")
                        .bind(&name)
                        .bind(archive)
                        .execute(&mut *conn)
                        .await
                })
                .await
            {
                tracing::warn!(
                    partition = %name, error = %e, layer = "sql",
                    "dropping a detached record partition failed; will retry"
                );
            }
        }
        Ok((retired, by_rows))
    }

    /// One maintenance transaction, its statements bounded by
    /// [`MAINTENANCE_BOUND`] instead of the pool's statement timeout.
    async fn maintenance<T>(
        &self,
        op: &'static str,
        pool: &sqlx::PgPool,
        work: impl AsyncFnOnce(&mut sqlx::PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, StoreError> {
        let run = async {
            let mut tx = pool.begin().await?;
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "SET LOCAL statement_timeout = {}",
                MAINTENANCE_BOUND.as_millis()
            )))
            .execute(&mut *tx)
            .await?;
            // The held-row check reads a whole partition: plan it as such.
            sqlx::query("SET LOCAL enable_seqscan = on")
                .execute(&mut *tx)
                .await?;
            let value = work(&mut tx).await?;
            tx.commit().await?;
            Ok::<T, sqlx::Error>(value)
        };
        super::bounded_by(op, MAINTENANCE_BOUND, run).await
    }
}
