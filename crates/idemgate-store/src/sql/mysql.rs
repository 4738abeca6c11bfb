//! The durable record in MySQL 8 or MariaDB 10.6+ (InnoDB), on one server
//! or a Galera cluster.
//!
//! The same rules as every store (docs/semantics.md), with InnoDB's means:
//!
//! - A claim is one atomic statement: `INSERT … ON DUPLICATE KEY UPDATE`
//!   on the record's primary key (a fresh key), or one conditional
//!   `UPDATE` (a takeover). InnoDB has no `RETURNING`, and the driver's
//!   `CLIENT_FOUND_ROWS` counts an untouched duplicate as "affected", so a
//!   claim never reads "inserted" from a row count: it writes a fresh
//!   random `claim_token` with its row and then reads which rows carry it
//!   (`migrations/mysql/0001_records.sql`).
//! - Every write after a claim is fenced by its epoch (`… WHERE epoch = ?
//!   AND state = 'in_flight'`), as elsewhere; what `RETURNING` answers in
//!   Postgres is read back by key.
//! - Every lease and expiry is judged by the database's clock
//!   (`UTC_TIMESTAMP(6)`, which also keeps one value for a whole
//!   statement), never a gateway's.
//! - Sessions run READ COMMITTED (the default REPEATABLE READ takes gap
//!   locks that make claims and sweeps collide) in strict mode (a value too
//!   long for its column fails instead of being cut, which would merge two
//!   keys).
//! - Deadlocks, lock-wait timeouts and Galera certification failures roll
//!   back the statement or transaction that met them; it is run again
//!   within `store.timeout` ([`MysqlSql::run`]), then the store is
//!   unavailable (`503`) — never "no record".
//! - A node that became read-only or left its cluster's quorum fails the
//!   operation (unavailable, fail closed), and the connection that met it
//!   is closed rather than returned to the pool. The URL may name several
//!   nodes (`mysql://u@n1:3306,n2:3306,n3:3306/db`); the pool follows the
//!   first that takes writes ([`crate::sql::primary`]).
//!
//! # Layout
//!
//! - `statements.rs`: the SQL text, with the database's clock.
//! - `records.rs`: a claim's takeover half, reads, the fenced writes,
//!   purges.
//! - `batched.rs`: claims of fresh keys and completions, many per
//!   statement.
//! - `upkeep.rs`: the delivery log, the purge log, the scope registry and
//!   sweeping.

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::future::BoxFuture;
use sqlx::mysql::{MySql, MySqlConnectOptions, MySqlConnection, MySqlPool, MySqlPoolOptions};
use sqlx::{Connection, Executor, Row};

use crate::StoreError;
use crate::sql::primary::{self, Follow, Member, Primary};
use crate::sql::{Dialect, SqlSettings};

/// Runs `$body` (a `Result<T, sqlx::Error>`, with `$conn` a pooled
/// `&mut MySqlConnection`) within `store.timeout`, again (after a short
/// pause) as long as what stopped it was rolled back whole and may be
/// retried — a deadlock, a lock-wait timeout, a Galera certification
/// failure. `$body` must be one statement in autocommit or one transaction
/// of its own, so that running it again repeats nothing that committed. A
/// connection to a node that cannot take writes is closed, so the pool
/// opens a new one (to wherever the URL's name now points). A macro, not a
/// function taking a closure: a closure over a borrowed connection would
/// make every caller's future not `Send`.
macro_rules! run {
    ($self:expr, $op:expr, |$conn:ident| $body:expr) => {{
        $crate::sql::bounded_by($op, $self.timeout, async {
            let op: &'static str = $op;
            let mut pause = $crate::sql::mysql::FIRST_RETRY_PAUSE;
            loop {
                let mut pooled = $self.pool.acquire().await?;
                let result = async {
                    let $conn: &mut sqlx::mysql::MySqlConnection = &mut pooled;
                    $body
                }
                .await;
                let e = match result {
                    Ok(value) => break Ok(value),
                    Err(e) => e,
                };
                match $crate::sql::mysql::failure(&e) {
                    $crate::sql::mysql::Failure::Again => {
                        tracing::debug!(op, error = %e, layer = "sql", "rolled back; running again");
                        drop(pooled);
                        pause = $crate::sql::mysql::pause_after(pause).await;
                    }
                    $crate::sql::mysql::Failure::NodeUnusable => {
                        tracing::warn!(op, error = %e, layer = "sql", "the database node cannot take writes; dropping its connection");
                        pooled.close_on_drop();
                        break Err(e);
                    }
                    $crate::sql::mysql::Failure::Other => break Err(e),
                }
            }
        })
    }};
}

mod batched;
mod records;
mod statements;
mod upkeep;

/// The record in MySQL or MariaDB (see the module docs).
#[derive(Clone)]
pub(crate) struct MysqlSql {
    pool: MySqlPool,
    /// How to open a connection of its own (migrations).
    options: Arc<MySqlConnectOptions>,
    #[cfg_attr(not(any(test, feature = "testing")), allow(dead_code))]
    url: Arc<str>,
    timeout: Duration,
    /// How long a record stays a tombstone after its retention.
    tombstone: Duration,
    /// Whether reads that answer a client wait for the Galera cluster to
    /// have applied everything committed before them (MariaDB Galera).
    causal_reads: bool,
    /// Keeps the pool's watcher ([`crate::sql::primary`]) running while
    /// a clone of this store lives.
    _alive: Arc<()>,
}

/// How long InnoDB waits for a row lock (and the server for a table's
/// metadata lock) before it gives the statement up (rolled back; a row
/// lock's wait is run again by `run!`): under
/// `store.timeout`, so that the database gives up before the gateway does,
/// and at least the one second InnoDB accepts.
fn lock_wait_bound(timeout: Duration) -> u64 {
    (timeout * 7 / 10).as_secs().max(1)
}

/// How long an operation may wait for a pooled connection before it is
/// refused unsent.
fn acquire_bound(timeout: Duration) -> Duration {
    timeout / 5
}

/// A pooled connection idle longer than this is pinged before use.
const PING_IF_IDLE_FOR: Duration = Duration::from_secs(1);

/// The first pause before an operation that met a deadlock runs again;
/// it doubles up to [`MAX_RETRY_PAUSE`].
pub(super) const FIRST_RETRY_PAUSE: Duration = Duration::from_millis(2);
const MAX_RETRY_PAUSE: Duration = Duration::from_millis(100);

/// What an error from the server means for the operation that met it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Failure {
    /// Rolled back whole and safe to run again: a deadlock (1213, also a
    /// Galera certification failure), a lock-wait timeout (1205), a row
    /// changed under a snapshot (1020).
    Again,
    /// This connection's node cannot take writes: read-only (1290, 1792,
    /// 1836) or out of its cluster's quorum (1047, "WSREP has not yet
    /// prepared node for application use"). Close it; fail the operation.
    NodeUnusable,
    /// Anything else: fail the operation.
    Other,
}

pub(super) fn failure(e: &sqlx::Error) -> Failure {
    let Some(db) = e.as_database_error() else {
        return Failure::Other;
    };
    let Some(mysql) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() else {
        return Failure::Other;
    };
    match mysql.number() {
        1213 | 1205 | 1020 => Failure::Again,
        1290 | 1792 | 1836 | 1047 => Failure::NodeUnusable,
        _ => Failure::Other,
    }
}

impl MysqlSql {
    /// Connects: READ COMMITTED, strict, the server's lock waits bounded
    /// under `store.timeout`.
    pub(crate) async fn connect(settings: &SqlSettings) -> Result<MysqlSql, StoreError> {
        let unavailable = |e: sqlx::Error| StoreError::Unavailable {
            op: "connect",
            cause: e.to_string(),
        };
        if let Some(schema) = &settings.schema {
            return Err(StoreError::Unavailable {
                op: "connect",
                cause: format!(
                    "schema {schema:?} is a Postgres setting; a MySQL store's tables live in \
                     the database its URL names"
                ),
            });
        }
        // `mariadb://` is this store's alias; the driver knows `mysql://`.
        let url = match settings.url.strip_prefix("mariadb://") {
            Some(rest) => format!("mysql://{rest}"),
            None => settings.url.clone(),
        };
        // Several hosts (a Galera cluster's nodes): the pool follows the
        // first that takes writes.
        let hosts = primary::hosts(&url).map_err(|cause| StoreError::Unavailable {
            op: "connect",
            cause,
        })?;
        let options = MySqlConnectOptions::from_str(&hosts.first).map_err(unavailable)?;
        let primary = Primary::<MySql>::new(&options, &hosts);
        let options = primary
            .first_target(options, settings.timeout)
            .await
            .map_err(unavailable)?;
        let lock_wait = lock_wait_bound(settings.timeout);
        let statement_bound = settings.timeout * 7 / 10;
        let watched = primary.clone();
        let checked = primary.clone();
        let pool = MySqlPoolOptions::new()
            .max_connections(settings.pool_size)
            .acquire_timeout(acquire_bound(settings.timeout))
            .test_before_acquire(false)
            .before_acquire(move |conn, meta| {
                let stale = watched.is_stale(meta.age);
                Box::pin(async move {
                    // Opened before the node was found gone: closed, not
                    // reused.
                    if stale {
                        return Ok(false);
                    }
                    if meta.idle_for > PING_IF_IDLE_FOR {
                        sqlx::Connection::ping(conn).await?;
                    }
                    Ok(true)
                })
            })
            .after_connect(move |conn, _| {
                let checked = checked.clone();
                Box::pin(async move {
                    // A node that takes no writes (read-only, out of its
                    // cluster's quorum, not synced, of another cluster) is
                    // no place for claims.
                    if !checked.accepts(conn).await? {
                        return Err(primary::read_only("the server"));
                    }
                    prepare_session(conn, lock_wait, statement_bound).await
                })
            })
            .connect_with(options.clone())
            .await
            .map_err(unavailable)?;
        let causal_reads = galera(&pool).await.map_err(unavailable)?;
        let alive = Arc::new(());
        tokio::spawn(primary.watch(pool.clone(), settings.timeout, Arc::downgrade(&alive)));
        Ok(MysqlSql {
            pool,
            options: Arc::new(options),
            url: settings.url.as_str().into(),
            timeout: settings.timeout,
            tombstone: settings.tombstone,
            causal_reads,
            _alive: alive,
        })
    }

    /// Applies the migrations (`migrations/mysql`).
    pub(crate) async fn migrate(&self) -> Result<(), StoreError> {
        self.migrate_until(None).await
    }

    /// The migrations up to `version` only (upgrade tests). On a
    /// connection of their own, without the pool's statement bound: the
    /// migrator's lock (`GET_LOCK`) waits for another instance's migrations,
    /// and a bound would cut that wait short (`GET_LOCK` then returns NULL,
    /// which the migrator does not check) and let two instances migrate at
    /// once.
    pub(crate) async fn migrate_until(&self, version: Option<i64>) -> Result<(), StoreError> {
        let migrate = async {
            let mut conn = MySqlConnection::connect_with(&self.options).await?;
            let result = crate::migrations::mysql(&mut conn, version).await;
            let _ = conn.close().await;
            result
        };
        migrate
            .await
            .map_err(|e| StoreError::Migrate(e.to_string()))
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    pub(crate) fn dialect(&self) -> Dialect {
        Dialect::Mysql
    }

    pub(crate) fn tombstone(&self) -> Duration {
        self.tombstone
    }

    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn url_for_tests(&self) -> &str {
        &self.url
    }

    /// Whether a commit survives a failover (see [`crate::sql::Durability`]):
    /// a Galera cluster, or semi-synchronous replication.
    pub(crate) async fn durability(&self) -> Result<crate::sql::Durability, StoreError> {
        use sqlx::Row;
        let rows = run!(self, "durability", |conn| {
            let mut rows = Vec::new();
            for show in ["SHOW GLOBAL STATUS", "SHOW GLOBAL VARIABLES"] {
                let found = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "{show} WHERE Variable_name LIKE 'wsrep\\_%' \
                     OR Variable_name LIKE 'rpl\\_semi\\_sync\\_%'"
                )))
                .fetch_all(&mut *conn)
                .await?;
                for row in found {
                    // Bytes: the server labels these columns binary.
                    let name: Vec<u8> = row.try_get(0)?;
                    let value: Vec<u8> = row.try_get(1)?;
                    rows.push((
                        String::from_utf8_lossy(&name).to_ascii_lowercase(),
                        String::from_utf8_lossy(&value).into_owned(),
                    ));
                }
            }
            Ok::<_, sqlx::Error>(rows)
        })
        .await?;
        Ok(crate::sql::durability::mysql(|name| {
            rows.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
        }))
    }

    /// `SELECT 1`, for `/readyz`.
    pub(crate) async fn ping(&self) -> Result<(), StoreError> {
        run!(self, "ping", |conn| conn
            .execute("SELECT 1")
            .await
            .map(drop))
        .await
    }
}

impl Follow for MySql {
    /// A MySQL URL names several hosts for a Galera cluster's nodes only:
    /// MySQL's own replicas are not fenced when their old primary comes
    /// back writable, so they belong behind a proxy or a name that moves.
    const SEVERAL_HOSTS_NEED_A_CLUSTER: bool = true;

    /// Not read-only (`read_only` is `OFF`: MariaDB 12 has further values
    /// that all mean fenced), and on a Galera node, in its cluster's
    /// primary component (`wsrep_ready`); settled when synced
    /// (`wsrep_local_state` 4: not a donor, not still joining); naming its
    /// cluster by `wsrep_cluster_state_uuid`. Two `SHOW` statements that
    /// MySQL 8 and MariaDB both answer (`@@wsrep_on` is MariaDB's alone).
    fn member(conn: &mut MySqlConnection) -> BoxFuture<'_, Result<Member, sqlx::Error>> {
        Box::pin(async move {
            let mut seen = std::collections::HashMap::new();
            for show in [
                "SHOW GLOBAL VARIABLES WHERE Variable_name IN ('read_only', 'wsrep_on')",
                "SHOW GLOBAL STATUS WHERE Variable_name IN \
                 ('wsrep_ready', 'wsrep_local_state', 'wsrep_cluster_state_uuid')",
            ] {
                for row in sqlx::raw_sql(show).fetch_all(&mut *conn).await? {
                    // Bytes: the server labels these columns binary.
                    let name: Vec<u8> = row.try_get(0)?;
                    let value: Vec<u8> = row.try_get(1)?;
                    seen.insert(
                        String::from_utf8_lossy(&name).to_ascii_lowercase(),
                        String::from_utf8_lossy(&value).into_owned(),
                    );
                }
            }
            let is = |name: &str, values: &[&str]| {
                seen.get(name)
                    .is_some_and(|v| values.iter().any(|want| v.eq_ignore_ascii_case(want)))
            };
            // Absent, as before this check existed: writable; present,
            // only OFF is (MariaDB 12's NO_LOCK values mean fenced too).
            let writable = !seen.contains_key("read_only") || is("read_only", &["OFF", "0"]);
            if !is("wsrep_on", &["ON", "1"]) {
                return Ok(Member {
                    writes: writable,
                    settled: true,
                    cluster: None,
                });
            }
            Ok(Member {
                writes: writable && is("wsrep_ready", &["ON", "1"]),
                settled: is("wsrep_local_state", &["4"]),
                cluster: seen.get("wsrep_cluster_state_uuid").cloned(),
            })
        })
    }

    fn is_evidence_of_a_move(e: &sqlx::Error) -> bool {
        match e {
            sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::Configuration(_) => true,
            // A node that cannot take writes, a server shutting down (1053),
            // a connection the server killed (1927, MariaDB).
            _ => {
                failure(e) == Failure::NodeUnusable
                    || e.as_database_error()
                        .and_then(|db| db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
                        .is_some_and(|db| matches!(db.number(), 1053 | 1927))
            }
        }
    }

    fn at(options: &MySqlConnectOptions, host: &str, port: u16) -> MySqlConnectOptions {
        options.clone().host(host).port(port)
    }

    fn address(options: &MySqlConnectOptions) -> (String, u16) {
        (options.get_host().to_owned(), options.get_port())
    }
}

/// A session as the store needs it (see the module docs).
async fn prepare_session(
    conn: &mut MySqlConnection,
    lock_wait_s: u64,
    statement_bound: Duration,
) -> Result<(), sqlx::Error> {
    conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        .await?;
    conn.execute(sqlx::AssertSqlSafe(format!(
        "SET SESSION innodb_lock_wait_timeout = {lock_wait_s}, \
         lock_wait_timeout = {lock_wait_s}, \
         sql_mode = CONCAT_WS(',', NULLIF(@@sql_mode, ''), 'STRICT_ALL_TABLES')"
    )))
    .await?;
    // The server abandons a statement the gateway has given up on. MariaDB
    // bounds every statement; MySQL only SELECTs (its lock-wait bound
    // above covers the rest).
    let version: String = sqlx::query("SELECT VERSION()")
        .fetch_one(&mut *conn)
        .await?
        .try_get(0)?;
    let bound = if version.contains("MariaDB") {
        format!(
            "SET SESSION max_statement_time = {:.3}",
            statement_bound.as_secs_f64()
        )
    } else {
        format!(
            "SET SESSION max_execution_time = {}",
            statement_bound.as_millis()
        )
    };
    conn.execute(sqlx::AssertSqlSafe(bound)).await?;
    Ok(())
}

/// Whether the server is a Galera node (`wsrep_on`): its reads that answer
/// a client then wait for what the cluster committed before them.
async fn galera(pool: &MySqlPool) -> Result<bool, sqlx::Error> {
    let row = sqlx::query("SHOW VARIABLES LIKE 'wsrep_on'")
        .fetch_optional(pool)
        .await?;
    Ok(match row {
        Some(row) => row.try_get::<String, _>(1)?.eq_ignore_ascii_case("ON"),
        None => false,
    })
}

/// Sleeps `pause` give or take half (so that two sessions that deadlocked
/// do not meet again in step); the next pause.
pub(super) async fn pause_after(pause: Duration) -> Duration {
    let spread = pause.as_micros() as u64;
    tokio::time::sleep(pause / 2 + Duration::from_micros(next_random() % spread.max(1))).await;
    (pause * 2).min(MAX_RETRY_PAUSE)
}

/// A fresh claim token: 8 random bytes of this process, then a counter.
/// Unique across processes (the random half) and within one (the counter),
/// which is all a token needs: it tells a claim's own rows from others'.
fn claim_token() -> [u8; 16] {
    static PROCESS: std::sync::LazyLock<u64> =
        std::sync::LazyLock::new(|| getrandom::u64().unwrap_or_else(|_| fallback_seed()));
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut token = [0u8; 16];
    token[..8].copy_from_slice(&PROCESS.to_be_bytes());
    token[8..].copy_from_slice(&COUNTER.fetch_add(1, Ordering::Relaxed).to_be_bytes());
    token
}

/// A seed from the clock and the process id, when the OS has no randomness
/// to give.
fn fallback_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ (u64::from(std::process::id()) << 32)
}

/// A cheap pseudo-random number (xorshift on a shared counter): for retry
/// jitter only.
fn next_random() -> u64 {
    static STATE: AtomicU64 = AtomicU64::new(0x9e37_79b9_7f4a_7c15);
    let mut x = STATE.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}
