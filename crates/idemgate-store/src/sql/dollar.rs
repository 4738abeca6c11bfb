//! The durable record in Postgres or SQLite: the source of truth.
//!
//! Both databases run the same statements (`$N` placeholders work in both)
//! against the same schema (`migrations/postgres`, `migrations/sqlite`: only
//! type names differ). Every statement is a single atomic statement, so no
//! read is ever followed by a dependent write in another statement:
//!
//! - claim: an insert wins a fresh key in one round trip (SQLite: `INSERT …
//!   ON CONFLICT DO NOTHING RETURNING epoch`; Postgres, whose record table
//!   is partitioned: the function `idempotency_claim`, see
//!   `sql/dollar/partitions.rs`). Otherwise one conditional statement takes over a
//!   record that may be taken (released, uncertain, lease expired,
//!   retention expired) and bumps its epoch (SQLite: `UPDATE … RETURNING`;
//!   Postgres: `idempotency_take_over`, which moves the row). Only when
//!   both found nothing to take is the row read — to answer the client,
//!   never to decide a write.
//! - complete, release, mark uncertain, renew: `UPDATE … WHERE epoch = mine
//!   AND state = 'in_flight'`. A holder whose lease was taken over finds zero
//!   rows: its late write is refused (fencing).
//!
//! The statements themselves (`sql/dollar/statements.rs`) read the database's
//! clock: leases and expiries never depend on a gateway's clock.
//!
//! Here: the pool, bounds and single-record statements. `sql/dollar/batched.rs`:
//! the batched claims and completions (Postgres `UNNEST` arrays, one SQLite
//! transaction). `sql/rows.rs`: decoding a row into a [`Record`].
//!
//! SQLite runs on one connection: its writers serialise anyway, and a single
//! connection never meets `SQLITE_BUSY` from its own pool. Its
//! multi-statement transactions (a batch of claims and completions,
//! archiving) use `BEGIN IMMEDIATE`, because a
//! deferred `BEGIN` that reads then writes fails with `SQLITE_BUSY` without
//! waiting for the busy timeout when another process (the CLI) writes.

use std::time::Duration;

use crate::StoreError;
use crate::sql::{
    Dialect, MAX_LIVE_PARTITIONS, MAX_PARTITION_SPAN, MIN_PARTITION_SPAN, SqlSettings, bounded_by,
};
use statements::Statements;

// The pool of each database and `with_pool!`, first, for the modules
// after it.
#[macro_use]
mod pool;
mod batched;
mod deliveries;
#[cfg(feature = "postgres")]
mod partitions;
#[cfg(feature = "postgres")]
mod postgres;
mod purge_log;
mod records;
mod scopes;
#[cfg(feature = "sqlite")]
mod sqlite;
mod statements;
mod sweeping;
use pool::Pool;

/// The record in Postgres or SQLite (see the module docs).
#[derive(Clone)]
pub(crate) struct DollarSql {
    pool: Pool,
    #[cfg_attr(not(any(test, feature = "testing")), allow(dead_code))]
    url: std::sync::Arc<str>,
    timeout: Duration,
    /// How long a record stays a tombstone after its retention.
    tombstone: Duration,
    /// What only Postgres reads.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    postgres: PgParts,
}

/// What only a Postgres store reads (a build without Postgres leaves it
/// unread).
#[derive(Clone)]
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
struct PgParts {
    /// Whether batch writers keep a connection between batches (see
    /// [`super::held`]): only with room left in the pool.
    hold_batch_connections: bool,
    /// The schema its tables live in.
    schema: Option<String>,
    /// How far ahead partitions are made, and how wide.
    retention: Duration,
    partition_span: Duration,
    /// While any clone of the store lives: the primary's watcher runs.
    _alive: std::sync::Arc<()>,
}

#[cfg(feature = "sqlite")]
#[cfg(any(test, feature = "testing"))]
pub(super) const COUNT_ARCHIVE: &str = "SELECT COUNT(*) FROM idempotency_archive";

impl DollarSql {
    /// Connects (creating a SQLite file and its directory when missing).
    pub(crate) async fn connect(settings: &SqlSettings) -> Result<DollarSql, StoreError> {
        let dialect = Dialect::of(&settings.url).ok_or_else(|| StoreError::Unavailable {
            op: "connect",
            cause: format!(
                "{:?} names no database this store knows (sqlite:, postgres://)",
                settings.url
            ),
        })?;
        if let (Some(schema), false) = (&settings.schema, dialect.has_schemas()) {
            return Err(StoreError::Unavailable {
                op: "connect",
                cause: format!(
                    "schema {schema:?} is a Postgres setting; a {} store is its own database",
                    dialect.name()
                ),
            });
        }
        let alive = std::sync::Arc::new(());
        let pool = Pool::connect(dialect, settings, std::sync::Arc::downgrade(&alive)).await?;
        Ok(DollarSql {
            url: settings.url.as_str().into(),
            pool,
            timeout: settings.timeout,
            tombstone: settings.tombstone,
            postgres: PgParts {
                hold_batch_connections: dialect == Dialect::Postgres
                    && settings.pool_size >= crate::held::MIN_POOL_TO_HOLD,
                schema: settings.schema.clone(),
                retention: settings.retention,
                partition_span: settings
                    .partition_span
                    .clamp(MIN_PARTITION_SPAN, MAX_PARTITION_SPAN)
                    .max((settings.retention + settings.tombstone) / MAX_LIVE_PARTITIONS),
                _alive: alive,
            },
        })
    }

    /// Applies the migrations of this store's database, then (Postgres)
    /// makes the partitions the next claims land in.
    pub(crate) async fn migrate(&self) -> Result<(), StoreError> {
        self.migrate_until(None).await?;
        #[cfg(feature = "postgres")]
        if let Err(e) = self.extend_partitions().await {
            // A claim that finds no partition makes its own; the
            // sweeper tries again.
            tracing::warn!(error = %e, layer = "sql", "making the record partitions failed; will retry");
        }
        Ok(())
    }

    /// The migrations up to `version` only: a database as an earlier
    /// release left it (upgrade tests).
    #[doc(hidden)]
    pub(crate) async fn migrate_until(&self, version: Option<i64>) -> Result<(), StoreError> {
        let result = match &self.pool {
            #[cfg(feature = "postgres")]
            Pool::Postgres(pool) => {
                crate::migrations::postgres(pool, self.postgres.schema.as_deref(), version).await
            }
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(pool) => {
                let _ = version;
                crate::migrations::sqlite(pool).await
            }
        };
        result.map_err(|e| StoreError::Migrate(e.to_string()))
    }

    /// The bound on every operation (`store.timeout`).
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Which database this store runs on.
    pub(crate) fn dialect(&self) -> Dialect {
        self.pool.dialect()
    }

    /// Bounds one operation by `store.timeout` and names it in errors.
    async fn bounded<T>(
        &self,
        op: &'static str,
        work: impl std::future::Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, StoreError> {
        bounded_by(op, self.timeout, work).await
    }

    /// `SELECT 1`, for `/readyz`.
    pub(crate) async fn ping(&self) -> Result<(), StoreError> {
        self.bounded("ping", async {
            with_pool!(self, pool => sqlx::query("SELECT 1").execute(pool).await.map(|_| ()))
        })
        .await
    }

    /// Whether a commit survives a failover (see [`crate::sql::Durability`]).
    pub(crate) async fn durability(&self) -> Result<crate::sql::Durability, StoreError> {
        match &self.pool {
            #[cfg(feature = "postgres")]
            Pool::Postgres(pool) => {
                let (commit, names, sync, all): (String, String, i64, i64) = self
                    .bounded("durability", async {
                        sqlx::query_as(
                            "SELECT current_setting('synchronous_commit'), \
                                    current_setting('synchronous_standby_names'), \
                                    (SELECT count(*) FROM pg_stat_replication \
                                      WHERE sync_state IN ('sync', 'quorum')), \
                                    (SELECT count(*) FROM pg_stat_replication)",
                        )
                        .fetch_one(pool)
                        .await
                    })
                    .await?;
                Ok(crate::sql::durability::postgres(&commit, &names, sync, all))
            }
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(_) => Ok(crate::sql::Durability::Unconfirmed(
                "SQLite: one file on one machine, replicated by nothing the store can see".into(),
            )),
        }
    }

    /// This database's statements.
    fn sql(&self) -> &'static Statements {
        self.pool.statements()
    }

    /// How long a record stays a tombstone after its retention.
    pub(crate) fn tombstone(&self) -> Duration {
        self.tombstone
    }

    /// The URL this store connected to (tests open a second store on it).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn url_for_tests(&self) -> &str {
        &self.url
    }
}
