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
//!   `sql/partitions.rs`). Otherwise one conditional statement takes over a
//!   record that may be taken (released, uncertain, lease expired,
//!   retention expired) and bumps its epoch (SQLite: `UPDATE … RETURNING`;
//!   Postgres: `idempotency_take_over`, which moves the row). Only when
//!   both found nothing to take is the row read — to answer the client,
//!   never to decide a write.
//! - complete, release, mark uncertain, renew: `UPDATE … WHERE epoch = mine
//!   AND state = 'in_flight'`. A holder whose lease was taken over finds zero
//!   rows: its late write is refused (fencing).
//!
//! The statements themselves (`store/statements.rs`) read the database's
//! clock: leases and expiries never depend on a gateway's clock.
//!
//! Here: the pool, bounds and single-record statements. `sql/batched.rs`:
//! the batched claims and completions (Postgres `UNNEST` arrays, one SQLite
//! transaction). `sql/rows.rs`: decoding a row into a [`Record`].
//!
//! SQLite runs on one connection: its writers serialise anyway, and a single
//! connection never meets `SQLITE_BUSY` from its own pool. Its
//! multi-statement transactions (a batch of claims and completions,
//! archiving) use `BEGIN IMMEDIATE`, because a
//! deferred `BEGIN` that reads then writes fails with `SQLITE_BUSY` without
//! waiting for the busy timeout when another process (the CLI) writes.

use std::str::FromStr;
use std::time::Duration;

#[cfg(feature = "sqlite")]
use sqlx::Connection;
use sqlx::Row;
#[cfg(feature = "postgres")]
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
#[cfg(feature = "sqlite")]
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

use super::codec::encode_headers;
use super::held::HeldConnection;
#[cfg(feature = "postgres")]
use super::statements::POSTGRES;
#[cfg(feature = "sqlite")]
use super::statements::SQLITE;
use super::statements::{Statements, millis};
use super::{Claim, Record, RecordKey, RecordState, StoreError, StoredResponse};

mod batched;
#[cfg(feature = "postgres")]
mod partitions;
mod rows;

pub use batched::{Completion, NewClaim, Write, Written};
use rows::{RawRecord, answer_for};

/// Rows moved per sweep statement: small enough that a sweep never holds
/// locks for long, large enough to keep up.
pub const SWEEP_BATCH: i64 = 500;

#[derive(Clone)]
enum Pool {
    #[cfg(feature = "postgres")]
    Postgres(PgPool),
    #[cfg(feature = "sqlite")]
    Sqlite(SqlitePool),
}

/// Runs `$body` with `$pool` bound to whichever pool this store has. The
/// body is written once and compiled once per database.
macro_rules! with_pool {
    ($self:expr, $pool:ident => $body:expr) => {
        match &$self.pool {
            #[cfg(feature = "postgres")]
            Pool::Postgres($pool) => $body,
            #[cfg(feature = "sqlite")]
            Pool::Sqlite($pool) => $body,
        }
    };
}

// After `with_pool!`, which it uses.
mod scopes;
pub use scopes::{Orphaned, Scoping};

/// The SQL record store.
#[derive(Clone)]
pub struct SqlStore {
    pool: Pool,
    url: std::sync::Arc<str>,
    timeout: Duration,
    /// How long a record stays a tombstone after its retention.
    tombstone: Duration,
    /// Whether batch writers keep a Postgres connection between batches
    /// (see [`super::held`]): only with room left in the pool.
    hold_batch_connections: bool,
    schema: Option<String>,
    /// Postgres: how far ahead partitions are made, and how wide.
    retention: Duration,
    partition_span: Duration,
}

/// How long Postgres may work on one statement. With the wait for a pooled
/// connection ([`acquire_bound`]) it stays under `store.timeout`, so that the database gives up (and rolls back) before
/// the gateway does: a statement the gateway stopped waiting for must not
/// commit behind its back (a claim committed that way would be held, with
/// nobody to forward it, for a whole lease).
fn server_side_bound(timeout: Duration) -> Duration {
    timeout * 7 / 10
}

/// How long an operation may wait for a pooled Postgres connection before
/// it is refused unsent. (SQLite's one connection is shared by every
/// operation and waits up to `store.timeout`; its busy timeout is 4/5 of
/// it.)
fn acquire_bound(timeout: Duration) -> Duration {
    timeout / 5
}

/// A pooled Postgres connection idle longer than this is pinged before use
/// (one that died meanwhile is replaced instead of failing a batch).
const PING_IF_IDLE_FOR: Duration = Duration::from_secs(1);

#[cfg(feature = "sqlite")]
const COUNT_ARCHIVE: &str = "SELECT COUNT(*) FROM idempotency_archive";

/// Connection settings of the SQL store.
#[derive(Debug, Clone)]
pub struct SqlSettings {
    pub url: String,
    pub pool_size: u32,
    /// Bound on every operation, and on waiting for a pooled connection.
    pub timeout: Duration,
    /// How long a record stays a fingerprint-only tombstone after its
    /// retention (zero: forgotten at once).
    pub tombstone: Duration,
    /// Postgres: the schema the tables live in (see
    /// [`super::StoreOptions::schema`]).
    pub schema: Option<String>,
    /// `store.retention`: Postgres makes partitions this far ahead.
    pub retention: Duration,
    /// Postgres: the span of expiries one partition holds (see
    /// [`partition_span`]).
    pub partition_span: Duration,
}

/// The narrowest and widest span of expiries one Postgres partition holds.
pub const MIN_PARTITION_SPAN: Duration = Duration::from_secs(1);
pub const MAX_PARTITION_SPAN: Duration = Duration::from_secs(24 * 3600);

/// Partitions that hold live records and tombstones, at most: every by-key
/// statement probes each one (the key does not name its partition), so a
/// retention (plus tombstone) longer than this many days gets wider spans
/// instead of more partitions.
pub const MAX_LIVE_PARTITIONS: u32 = 16;

/// The span of one Postgres partition: the retention, or the sweep
/// interval where that is longer (so a sweep never has more than a few
/// partitions to make or retire), within a second and a day. Records live
/// at most one span past their retention before their partition goes.
pub fn partition_span(retention: Duration, sweep_interval: Duration) -> Duration {
    retention
        .max(sweep_interval)
        .clamp(MIN_PARTITION_SPAN, MAX_PARTITION_SPAN)
}

/// A schema name as the store accepts it: a plain lowercase SQL
/// identifier, so it needs no quoting anywhere.
pub fn check_schema(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    if first_ok
        && name.len() <= 63
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        Ok(())
    } else {
        Err(format!(
            "schema {name:?} must be a lowercase identifier ([a-z_][a-z0-9_]*, at most 63 bytes)"
        ))
    }
}

impl SqlStore {
    /// Connects (creating a SQLite file and its directory when missing).
    pub async fn connect(settings: &SqlSettings) -> Result<SqlStore, StoreError> {
        let pool = if settings.url.starts_with("sqlite:") {
            if let Some(schema) = &settings.schema {
                return Err(StoreError::Unavailable {
                    op: "connect",
                    cause: format!(
                        "schema {schema:?} is a Postgres setting; a SQLite store is its own file"
                    ),
                });
            }
            Self::connect_sqlite(settings).await?
        } else if settings.url.starts_with("postgres:") || settings.url.starts_with("postgresql:") {
            Self::connect_postgres(settings).await?
        } else {
            return Err(StoreError::Unavailable {
                op: "connect",
                cause: format!("{:?} is neither sqlite: nor postgres://", settings.url),
            });
        };
        Ok(SqlStore {
            url: settings.url.as_str().into(),
            hold_batch_connections: cfg!(feature = "postgres")
                && !settings.url.starts_with("sqlite:")
                && settings.pool_size >= super::held::MIN_POOL_TO_HOLD,
            pool,
            timeout: settings.timeout,
            tombstone: settings.tombstone,
            schema: settings.schema.clone(),
            retention: settings.retention,
            partition_span: settings
                .partition_span
                .clamp(MIN_PARTITION_SPAN, MAX_PARTITION_SPAN)
                .max((settings.retention + settings.tombstone) / MAX_LIVE_PARTITIONS),
        })
    }

    #[cfg(feature = "sqlite")]
    async fn connect_sqlite(settings: &SqlSettings) -> Result<Pool, StoreError> {
        let unavailable = |e: sqlx::Error| StoreError::Unavailable {
            op: "connect",
            cause: e.to_string(),
        };
        let options = SqliteConnectOptions::from_str(&settings.url)
            .map_err(unavailable)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // FULL: a claim must survive power loss, or a retry after
            // the crash could execute the request a second time.
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(settings.timeout * 4 / 5);
        if let Some(dir) = options.get_filename().parent()
            && !dir.as_os_str().is_empty()
        {
            let _ = std::fs::create_dir_all(dir);
        }
        // One permanent connection (an in-memory database lives and
        // dies with its connection, so it must never be recycled).
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .acquire_timeout(settings.timeout)
            .connect_with(options)
            .await
            .map_err(unavailable)?;
        Ok(Pool::Sqlite(pool))
    }

    #[cfg(not(feature = "sqlite"))]
    async fn connect_sqlite(_: &SqlSettings) -> Result<Pool, StoreError> {
        Err(not_built("sqlite"))
    }

    #[cfg(feature = "postgres")]
    async fn connect_postgres(settings: &SqlSettings) -> Result<Pool, StoreError> {
        let unavailable = |e: sqlx::Error| StoreError::Unavailable {
            op: "connect",
            cause: e.to_string(),
        };
        let statement_timeout = server_side_bound(settings.timeout).as_millis().to_string();
        let options = PgConnectOptions::from_str(&settings.url)
            .map_err(unavailable)?
            // The server abandons a query the gateway has given up on,
            // instead of holding its locks.
            .options([("statement_timeout", statement_timeout.as_str())])
            // sqlx prepares every statement, and a generic plan is made
            // once per connection: every by-key statement probes each
            // partition of the record table, and planning that afresh
            // on every run cost more CPU than running it (a third of the
            // claim rate, loadtest/README.md). A generic plan costed on a
            // table as it was when empty (at first start, or a partition
            // just made) could pick a sequential scan and keep it as the
            // table grows; with sequential scans priced out, the key's
            // index is always the plan. Partition maintenance turns them
            // back on (it does read whole partitions).
            .options([("plan_cache_mode", "force_generic_plan")])
            .options([("enable_seqscan", "off")])
            // A key's one row across partitions rests on each statement
            // of the claim function seeing the rows committed before it
            // (docs in migrations/postgres/0006_partitions.sql), which a
            // database whose default is REPEATABLE READ would break.
            .options([("default_transaction_isolation", "read committed")]);
        // The store's own schema, first on the path: its tables (and its
        // migrations table) are found and created there.
        let options = match &settings.schema {
            Some(schema) => {
                check_schema(schema).map_err(|cause| StoreError::Unavailable {
                    op: "connect",
                    cause,
                })?;
                options.options([("search_path", schema.as_str())])
            }
            None => options,
        };
        let pool = PgPoolOptions::new()
            .max_connections(settings.pool_size)
            .acquire_timeout(acquire_bound(settings.timeout))
            // sqlx pings every connection it hands out by default: a
            // second round trip (and a second Postgres wake-up) for each
            // batch. A connection used moments ago is known to be alive;
            // only one that sat idle is checked, as HikariCP does.
            .test_before_acquire(false)
            .before_acquire(|conn, meta| {
                Box::pin(async move {
                    if meta.idle_for > PING_IF_IDLE_FOR {
                        sqlx::Connection::ping(conn).await?;
                    }
                    Ok(true)
                })
            })
            .connect_with(options)
            .await
            .map_err(unavailable)?;
        Ok(Pool::Postgres(pool))
    }

    #[cfg(not(feature = "postgres"))]
    async fn connect_postgres(_: &SqlSettings) -> Result<Pool, StoreError> {
        Err(not_built("postgres"))
    }

    /// Applies the migrations of this store's database, then (Postgres)
    /// makes the partitions the next claims land in.
    pub async fn migrate(&self) -> Result<(), StoreError> {
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
    pub async fn migrate_until(&self, version: Option<i64>) -> Result<(), StoreError> {
        let result = match &self.pool {
            #[cfg(feature = "postgres")]
            Pool::Postgres(pool) => {
                super::migrations::postgres(pool, self.schema.as_deref(), version).await
            }
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(pool) => {
                let _ = version;
                super::migrations::sqlite(pool).await
            }
        };
        result.map_err(|e| StoreError::Migrate(e.to_string()))
    }

    /// The bound on every operation (`store.timeout`).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// `postgres` or `sqlite`.
    pub fn backend(&self) -> &'static str {
        match self.pool {
            #[cfg(feature = "postgres")]
            Pool::Postgres(_) => "postgres",
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(_) => "sqlite",
        }
    }

    /// Runs one batch statement on Postgres: on the batch writer's kept
    /// connection when the pool has room to keep one, else on a pooled one.
    #[cfg(feature = "postgres")]
    async fn on_batch_connection<T>(
        &self,
        pool: &PgPool,
        held: &HeldConnection,
        work: impl AsyncFnOnce(&mut sqlx::PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, sqlx::Error> {
        if self.hold_batch_connections {
            held.run(pool, PING_IF_IDLE_FOR, work).await
        } else {
            let mut conn = pool.acquire().await?;
            work(&mut conn).await
        }
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
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.bounded("ping", async {
            with_pool!(self, pool => sqlx::query("SELECT 1").execute(pool).await.map(|_| ()))
        })
        .await
    }

    /// This database's statements.
    fn sql(&self) -> &'static Statements {
        match self.pool {
            #[cfg(feature = "postgres")]
            Pool::Postgres(_) => &POSTGRES,
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(_) => &SQLITE,
        }
    }

    /// Claims `key` for a request with `fingerprint` (see the module docs),
    /// on a connection of its own, for tools and tests: the gateway claims
    /// through [`crate::Store`], whose batch writer releases a claim that
    /// committed after its caller stopped waiting. (On SQLite a `COMMIT`,
    /// once sent, is waited for: see `sql/batched.rs`.)
    pub async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &str,
        request_id: &str,
        lease: Duration,
        retention: Duration,
    ) -> Result<Claim, StoreError> {
        let job = NewClaim {
            key: key.clone(),
            fingerprint: fingerprint.to_owned(),
            request_id: request_id.to_owned(),
            lease,
            retention,
            past_tombstone: false,
        };
        // A record deleted (purged, swept) between our statements makes the
        // read find nothing; the loop then simply claims again.
        // Not a batch writer: a connection of its own, returned at the end.
        let unbatched = HeldConnection::default();
        for _ in 0..3 {
            if let Some((epoch, expires_at_ms)) = self
                .insert_claims(std::slice::from_ref(&job), &unbatched)
                .await?[0]
            {
                return Ok(Claim::Won {
                    epoch,
                    expires_at_ms,
                    maybe_ran: false,
                });
            }
            if let Some((claim, _)) = self.claim_existing(&job).await? {
                return Ok(claim);
            }
        }
        Err(StoreError::Unavailable {
            op: "claim",
            cause: "the record kept disappearing between statements".into(),
        })
    }

    /// The existing-key half of a claim: take the record over if it may be
    /// taken, else read it to answer, with the record's retention left (a
    /// fast layer caching the answer must not outlive the record). `None`
    /// when the row vanished.
    pub async fn claim_existing(
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
    pub async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
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
    pub async fn find(&self, route: &str, key: &str) -> Result<Vec<Record>, StoreError> {
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
    pub async fn uncertain(&self, limit: i64) -> Result<Vec<Record>, StoreError> {
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

    /// A consumed message's failed upstream attempts and whether its
    /// dead-letter copy is stored (`0`, `false` when it never failed).
    pub async fn delivery(&self, route: &str, key: &str) -> Result<(u32, bool), StoreError> {
        let statement = self.sql().select_delivery.as_str();
        let row: Option<(i64, bool)> = self
            .bounded("delivery", async {
                with_pool!(self, pool => sqlx::query(statement).bind(route).bind(key).fetch_optional(pool).await
                    .and_then(|row| row.map(|r| Ok((r.try_get(0)?, r.try_get(1)?))).transpose()))
            })
            .await?;
        Ok(row.map_or((0, false), |(failures, dead)| {
            (u32::try_from(failures).unwrap_or(u32::MAX), dead)
        }))
    }

    /// Counts a failed upstream attempt of a consumed message, for every
    /// instance; `first`: the broker delivered it fresh (a new publish),
    /// so the count starts over. The failures so far.
    pub async fn count_delivery_failure(
        &self,
        route: &str,
        key: &str,
        first: bool,
    ) -> Result<u32, StoreError> {
        let statement = self.sql().count_delivery_failure.as_str();
        let failures: i64 = self
            .bounded("delivery", async {
                with_pool!(self, pool => sqlx::query(statement).bind(route).bind(key).bind(first)
                    .fetch_one(pool).await.and_then(|r| r.try_get(0)))
            })
            .await?;
        Ok(u32::try_from(failures).unwrap_or(u32::MAX))
    }

    /// Says a consumed message's dead-letter copy is stored.
    pub async fn mark_dead_lettered(&self, route: &str, key: &str) -> Result<(), StoreError> {
        let statement = self.sql().mark_dead_lettered.as_str();
        self.bounded("delivery", async {
            with_pool!(self, pool => sqlx::query(statement).bind(route).bind(key).execute(pool).await.map(|_| ()))
        })
        .await
    }

    /// Takes the lease to publish a consumed message's dead-letter copy
    /// for `lease`, so that one instance publishes it while any other that
    /// decided the same end waits: [`DeadLetterClaim::Won`] with the copy's
    /// id — `holder` the first time, the row's own after that, so a copy
    /// made again after a holder died carries its predecessor's id.
    /// `holder` (fresh for every claim) names this holder for renewing and
    /// releasing, which a successor under the same copy id does not share.
    pub async fn claim_dead_letter(
        &self,
        route: &str,
        key: &str,
        holder: &str,
        lease: Duration,
    ) -> Result<DeadLetterClaim, StoreError> {
        let statement = self.sql().claim_dead_letter.as_str();
        let ms = millis(lease);
        let won: Option<String> = self
            .bounded("delivery", async {
                with_pool!(self, pool => sqlx::query(statement).bind(route).bind(key).bind(holder).bind(ms)
                    .fetch_optional(pool).await
                    .and_then(|row| row.map(|r| r.try_get(0)).transpose()))
            })
            .await?;
        if let Some(copy) = won {
            return Ok(DeadLetterClaim::Won(copy));
        }
        // Not taken: the copy is stored, or another instance is making it.
        Ok(match self.delivery(route, key).await? {
            (_, true) => DeadLetterClaim::Copied,
            (_, false) => DeadLetterClaim::Busy,
        })
    }

    /// Extends `holder`'s copy lease by `lease` from now, while its broker
    /// has not confirmed the copy; whether it still held it.
    pub async fn renew_dead_letter(
        &self,
        route: &str,
        key: &str,
        holder: &str,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let statement = self.sql().renew_dead_letter.as_str();
        let ms = millis(lease);
        self.bounded("delivery", async {
            with_pool!(self, pool => sqlx::query(statement).bind(route).bind(key).bind(holder).bind(ms)
                .execute(pool).await.map(|r| r.rows_affected() == 1))
        })
        .await
    }

    /// Gives back the copy lease `holder` won with
    /// [`Self::claim_dead_letter`], when the copy was refused: the next try
    /// need not wait for it to lapse. A lease that passed to another holder
    /// is left alone.
    pub async fn release_dead_letter(
        &self,
        route: &str,
        key: &str,
        holder: &str,
    ) -> Result<(), StoreError> {
        let statement = self.sql().release_dead_letter.as_str();
        self.bounded("delivery", async {
            with_pool!(self, pool => sqlx::query(statement).bind(route).bind(key).bind(holder).execute(pool).await.map(|_| ()))
        })
        .await
    }

    /// Forgets delivery rows untouched since `before_ms`.
    pub async fn trim_deliveries(&self, before_ms: i64) -> Result<u64, StoreError> {
        let statement = self.sql().trim_deliveries.as_str();
        self.bounded("trim", async {
            with_pool!(self, pool => sqlx::query(statement).bind(before_ms).execute(pool).await.map(|r| r.rows_affected()))
        })
        .await
    }

    /// Forgets uncertain-log entries older than `before_ms`.
    pub async fn trim_uncertain_log(&self, before_ms: i64) -> Result<u64, StoreError> {
        let statement = self.sql().trim_uncertain_log.as_str();
        self.bounded("trim", async {
            with_pool!(self, pool => sqlx::query(statement).bind(before_ms).execute(pool).await.map(|r| r.rows_affected()))
        })
        .await
    }

    /// Stores the outcome; the retention left (by the database's clock) and
    /// whether a duplicate waits for it, or `None` when `epoch` no longer
    /// holds the claim.
    pub async fn complete(
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
    pub async fn complete_reconciled(
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
        let headers = encode_headers(&response.headers);
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

    /// Gives the claim up (nothing happened upstream): whether a duplicate
    /// waits for it, or `None` when `epoch` no longer holds it.
    pub async fn release(&self, key: &RecordKey, epoch: i64) -> Result<Option<bool>, StoreError> {
        self.set_state(key, epoch, RecordState::Released, Duration::ZERO, "release")
            .await
    }

    /// Records that the outcome is unknown: nothing is forwarded for `hold`
    /// (a copy may still be running at the upstream), then the next retry
    /// may take over.
    pub async fn mark_uncertain(
        &self,
        key: &RecordKey,
        epoch: i64,
        hold: Duration,
    ) -> Result<Option<bool>, StoreError> {
        self.set_state(key, epoch, RecordState::Uncertain, hold, "mark_uncertain")
            .await
    }

    async fn set_state(
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

    /// Tells every instance listening on Postgres that the record with
    /// this hash settled (see [`super::settle`]); nothing on SQLite.
    pub async fn announce(&self, token: &str) -> Result<(), StoreError> {
        match &self.pool {
            #[cfg(feature = "postgres")]
            Pool::Postgres(pool) => {
                self.bounded("announce", async {
                    sqlx::query("SELECT pg_notify($1, $2)")
                        .bind(super::settle::PG_CHANNEL)
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

    /// Says a duplicate waits for `key` while it is in flight; false when
    /// it is not in flight (any more): claim again at once.
    pub async fn mark_watched(&self, key: &RecordKey) -> Result<bool, StoreError> {
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
    pub async fn renew(
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

    /// Deletes one record, or with `scope = None` the key in every scope —
    /// except a record held under a live lease, which is never purged (a
    /// purge must not let a second request run beside the first).
    pub async fn purge(
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

    /// Removes (or archives) one batch of expired records; returns how
    /// many. On Postgres, of one partition: `table` (see
    /// [`Self::sweep_partitions`]); SQLite has the one table.
    pub async fn sweep_batch(&self, archive: bool, table: &str) -> Result<u64, StoreError> {
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
    pub async fn strip_batch(&self, after: i64) -> Result<(u64, i64), StoreError> {
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

    /// How long a record stays a tombstone after its retention.
    pub fn tombstone(&self) -> Duration {
        self.tombstone
    }

    /// Purges logged after `last` (oldest first, at most 1,000), for the
    /// in-process fast layers to forget.
    pub async fn purges_since(&self, last: i64) -> Result<Vec<LoggedPurge>, StoreError> {
        let statement = self.sql().purges_since.as_str();
        self.bounded("purges", async {
            with_pool!(self, pool => {
                let rows = sqlx::query(statement).bind(last).fetch_all(pool).await?;
                rows.iter()
                    .map(|row| {
                        Ok(LoggedPurge {
                            id: row.try_get(0)?,
                            route: row.try_get(1)?,
                            key: row.try_get(2)?,
                            scope: row.try_get(3)?,
                        })
                    })
                    .collect::<Result<Vec<_>, sqlx::Error>>()
            })
        })
        .await
    }

    /// The newest logged purge's id.
    pub async fn last_purge(&self) -> Result<i64, StoreError> {
        let statement = self.sql().last_purge.as_str();
        self.bounded("purges", async {
            with_pool!(self, pool => {
                sqlx::query(statement).fetch_one(pool).await?.try_get::<i64, _>(0)
            })
        })
        .await
    }

    /// Forgets logged purges older than `age`.
    pub async fn trim_purges(&self, age: Duration) -> Result<u64, StoreError> {
        let statement = self.sql().trim_purges.as_str();
        self.bounded("purges", async {
            with_pool!(self, pool => {
                sqlx::query(statement).bind(millis(age)).execute(pool).await.map(|r| r.rows_affected())
            })
        })
        .await
    }

    /// The URL this store connected to (tests open a second store on it).
    pub fn url_for_tests(&self) -> &str {
        &self.url
    }

    /// Rows in the record table (operators, tests).
    pub async fn records(&self) -> Result<i64, StoreError> {
        self.bounded("records", async {
            with_pool!(self, pool => {
                sqlx::query("SELECT COUNT(*) FROM idempotency_records").fetch_one(pool).await?.try_get::<i64, _>(0)
            })
        })
        .await
    }

    /// Rows archived (operators, tests): on Postgres, in the archive
    /// table and in the partitions retired with `store.archive`.
    pub async fn archived(&self) -> Result<i64, StoreError> {
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

/// Bounds one operation by `limit` and names it in errors.
async fn bounded_by<T>(
    op: &'static str,
    limit: Duration,
    work: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(limit, work).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(StoreError::Unavailable {
            op,
            cause: e.to_string(),
        }),
        Err(_) => Err(StoreError::Timeout { op, after: limit }),
    }
}

/// Who publishes a consumed message's dead-letter copy
/// ([`SqlStore::claim_dead_letter`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeadLetterClaim {
    /// This caller, under this copy id.
    Won(String),
    /// Nobody: the copy is stored.
    Copied,
    /// Another instance, under a live lease.
    Busy,
}

/// One logged purge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoggedPurge {
    pub id: i64,
    pub route: String,
    pub key: String,
    /// `None`: every scope.
    pub scope: Option<String>,
}

/// Milliseconds left, as a duration (zero when past).
fn left(ms: i64) -> Duration {
    Duration::from_millis(ms.max(0) as u64)
}

/// What a purge did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Purged {
    /// Records deleted.
    pub removed: u64,
    /// Records left because they are held under a live lease.
    pub held: u64,
}

/// The error of a database whose support this build left out.
#[cfg(not(all(feature = "sqlite", feature = "postgres")))]
fn not_built(feature: &str) -> StoreError {
    StoreError::Unavailable {
        op: "connect",
        cause: format!(
            "this build has no {feature} support (the idemgate-store feature {feature:?})"
        ),
    }
}

/// A migrated SQLite store in memory, retention an hour: for unit tests.
#[cfg(all(test, feature = "sqlite"))]
pub(crate) async fn sqlite_in_memory() -> SqlStore {
    let store = SqlStore::connect(&SqlSettings {
        url: "sqlite::memory:".into(),
        pool_size: 1,
        timeout: Duration::from_secs(5),
        tombstone: Duration::ZERO,
        schema: None,
        retention: Duration::from_secs(3600),
        partition_span: Duration::from_secs(3600),
    })
    .await
    .unwrap();
    store.migrate().await.unwrap();
    store
}
