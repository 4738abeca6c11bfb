//! Postgres: connecting (statement timeout, generic plans, READ
//! COMMITTED, the store's own schema) and what only Postgres does.

use std::str::FromStr;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use std::time::Duration;

use sqlx::postgres::PgPool;

use super::DollarSql;
use crate::StoreError;
use crate::held::HeldConnection;
use crate::sql::primary::{self, Follow, Member, Primary};
use crate::sql::{SqlSettings, check_schema};

/// Whether the server behind a connection takes writes: not a standby in
/// recovery, and not read-only by default (a primary an operator or a
/// failover tool fenced).
const TAKES_WRITES: &str = "SELECT NOT pg_is_in_recovery() \
     AND current_setting('transaction_read_only') = 'off'";

impl Follow for sqlx::Postgres {
    /// libpq's own rule: the first host that takes writes.
    const SEVERAL_HOSTS_NEED_A_CLUSTER: bool = false;

    fn member(
        conn: &mut sqlx::PgConnection,
    ) -> futures_util::future::BoxFuture<'_, Result<Member, sqlx::Error>> {
        Box::pin(async move {
            let writes = sqlx::query_scalar::<_, bool>(TAKES_WRITES)
                .fetch_one(conn)
                .await?;
            Ok(Member {
                writes,
                settled: true,
                cluster: None,
            })
        })
    }

    fn is_evidence_of_a_move(e: &sqlx::Error) -> bool {
        match e {
            sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::Configuration(_) => true,
            sqlx::Error::Database(db) => matches!(
                db.code().as_deref(),
                // read_only_sql_transaction, admin_shutdown, crash_shutdown,
                // and the connection exceptions.
                Some("25006" | "57P01" | "57P02" | "08000" | "08003" | "08006" | "08001" | "08004")
            ),
            _ => false,
        }
    }

    fn at(options: &PgConnectOptions, host: &str, port: u16) -> PgConnectOptions {
        options.clone().host(host).port(port)
    }

    fn address(options: &PgConnectOptions) -> (String, u16) {
        (options.get_host().to_owned(), options.get_port())
    }
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

impl DollarSql {
    /// Runs one batch statement on Postgres: on the batch writer's kept
    /// connection when the pool has room to keep one, else on a pooled one.
    pub(super) async fn on_batch_connection<T>(
        &self,
        pool: &PgPool,
        held: &HeldConnection,
        work: impl AsyncFnOnce(&mut sqlx::PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, sqlx::Error> {
        if self.postgres.hold_batch_connections {
            held.run(pool, PING_IF_IDLE_FOR, work).await
        } else {
            let mut conn = pool.acquire().await?;
            work(&mut conn).await
        }
    }
}

/// Connects to Postgres as `settings` say: to the first host of the URL
/// that takes writes, watched while `alive` has an owner
/// ([`super::primary`]).
pub(super) async fn connect(
    settings: &SqlSettings,
    alive: std::sync::Weak<()>,
) -> Result<PgPool, StoreError> {
    let unavailable = |e: sqlx::Error| StoreError::Unavailable {
        op: "connect",
        cause: e.to_string(),
    };
    let hosts = primary::hosts(&settings.url).map_err(|cause| StoreError::Unavailable {
        op: "connect",
        cause,
    })?;
    let statement_timeout = server_side_bound(settings.timeout).as_millis().to_string();
    let options = PgConnectOptions::from_str(&hosts.first)
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
    let primary = Primary::<sqlx::Postgres>::new(&options, &hosts);
    let options = primary
        .first_target(options, settings.timeout)
        .await
        .map_err(unavailable)?;
    let watched = primary.clone();
    let checked = primary.clone();
    let pool = PgPoolOptions::new()
        .max_connections(settings.pool_size)
        .acquire_timeout(acquire_bound(settings.timeout))
        // sqlx pings every connection it hands out by default: a
        // second round trip (and a second Postgres wake-up) for each
        // batch. A connection used moments ago is known to be alive;
        // only one that sat idle is checked, as HikariCP does.
        .test_before_acquire(false)
        // A server that takes no writes (a standby a failover left, a
        // fenced primary) is no place for claims.
        .after_connect(move |conn, _| {
            let checked = checked.clone();
            Box::pin(async move {
                if checked.accepts(conn).await? {
                    Ok(())
                } else {
                    Err(primary::read_only("the server"))
                }
            })
        })
        .before_acquire(move |conn, meta| {
            let stale = watched.is_stale(meta.age);
            Box::pin(async move {
                // Opened before the primary moved: closed, not reused.
                if stale {
                    return Ok(false);
                }
                if meta.idle_for > PING_IF_IDLE_FOR {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
        .connect_with(options)
        .await
        .map_err(unavailable)?;
    tokio::spawn(primary.watch(pool.clone(), settings.timeout, alive));
    Ok(pool)
}
