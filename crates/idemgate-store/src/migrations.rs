//! The store's schema, applied by a migrator of its own.
//!
//! The migrations are sqlx's, embedded with `include_str!` (no build-time
//! macro), and their bookkeeping lives in a table of their own,
//! [`MIGRATIONS_TABLE`], never in `_sqlx_migrations`: an application that
//! runs its own sqlx migrations on the same database would otherwise find
//! Idemgate's versions in its table ("previously applied but missing"), or
//! Idemgate would find the application's.
//!
//! A database migrated by a release that still used `_sqlx_migrations` is
//! adopted once: Idemgate's rows there (same version and checksum) move to
//! its own table in one transaction, so nothing is applied twice and the
//! application's table keeps only the application's rows.

use std::borrow::Cow;

#[cfg(any(feature = "sqlite", feature = "postgres"))]
use sqlx::Connection;
use sqlx::SqlSafeStr;
#[cfg(feature = "postgres")]
use sqlx::migrate::Migrate;
use sqlx::migrate::{MigrateError, Migration, MigrationType, Migrator};

/// The table that records which of Idemgate's migrations ran.
pub(crate) const MIGRATIONS_TABLE: &str = "_idemgate_migrations";

/// Where earlier releases recorded them (sqlx's default, shared with the
/// application's own migrations).
#[cfg(any(feature = "sqlite", feature = "postgres"))]
const SHARED_TABLE: &str = "_sqlx_migrations";

/// One migration file.
struct Source {
    version: i64,
    description: &'static str,
    sql: &'static str,
}

#[cfg(feature = "postgres")]
const POSTGRES: [Source; 9] = [
    Source {
        version: 1,
        description: "records",
        sql: include_str!("../migrations/postgres/0001_records.sql"),
    },
    Source {
        version: 2,
        description: "purges",
        sql: include_str!("../migrations/postgres/0002_purges.sql"),
    },
    Source {
        version: 3,
        description: "settling",
        sql: include_str!("../migrations/postgres/0003_settling.sql"),
    },
    Source {
        version: 4,
        description: "uncertain_log",
        sql: include_str!("../migrations/postgres/0004_uncertain_log.sql"),
    },
    Source {
        version: 5,
        description: "deliveries",
        sql: include_str!("../migrations/postgres/0005_deliveries.sql"),
    },
    Source {
        version: 6,
        description: "partitions",
        sql: include_str!("../migrations/postgres/0006_partitions.sql"),
    },
    Source {
        version: 7,
        description: "dead_letter_lease",
        sql: include_str!("../migrations/postgres/0007_dead_letter_lease.sql"),
    },
    Source {
        version: 8,
        description: "schema_locks",
        sql: include_str!("../migrations/postgres/0008_schema_locks.sql"),
    },
    Source {
        version: 9,
        description: "scopes",
        sql: include_str!("../migrations/postgres/0009_scopes.sql"),
    },
];

#[cfg(feature = "sqlite")]
const SQLITE: [Source; 7] = [
    Source {
        version: 1,
        description: "records",
        sql: include_str!("../migrations/sqlite/0001_records.sql"),
    },
    Source {
        version: 2,
        description: "purges",
        sql: include_str!("../migrations/sqlite/0002_purges.sql"),
    },
    Source {
        version: 3,
        description: "settling",
        sql: include_str!("../migrations/sqlite/0003_settling.sql"),
    },
    Source {
        version: 4,
        description: "uncertain_log",
        sql: include_str!("../migrations/sqlite/0004_uncertain_log.sql"),
    },
    Source {
        version: 5,
        description: "deliveries",
        sql: include_str!("../migrations/sqlite/0005_deliveries.sql"),
    },
    Source {
        version: 6,
        description: "dead_letter_lease",
        sql: include_str!("../migrations/sqlite/0006_dead_letter_lease.sql"),
    },
    Source {
        version: 7,
        description: "scopes",
        sql: include_str!("../migrations/sqlite/0007_scopes.sql"),
    },
];

#[cfg(feature = "mysql")]
const MYSQL: [Source; 5] = [
    Source {
        version: 1,
        description: "records",
        sql: include_str!("../migrations/mysql/0001_records.sql"),
    },
    Source {
        version: 2,
        description: "purges",
        sql: include_str!("../migrations/mysql/0002_purges.sql"),
    },
    Source {
        version: 3,
        description: "uncertain_log",
        sql: include_str!("../migrations/mysql/0003_uncertain_log.sql"),
    },
    Source {
        version: 4,
        description: "deliveries",
        sql: include_str!("../migrations/mysql/0004_deliveries.sql"),
    },
    Source {
        version: 5,
        description: "scopes",
        sql: include_str!("../migrations/mysql/0005_scopes.sql"),
    },
];

fn migrator(sources: &[Source]) -> Migrator {
    let migrations = sources
        .iter()
        .map(|s| {
            Migration::new(
                s.version,
                Cow::Borrowed(s.description),
                MigrationType::Simple,
                s.sql.into_sql_str(),
                false,
            )
        })
        .collect();
    let mut migrator = Migrator::with_migrations(migrations);
    // Not "dangerous" here: the adoption below moves the rows first.
    migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
    migrator
}

/// Applies the Postgres schema.
#[cfg(feature = "postgres")]
pub(crate) async fn postgres(
    pool: &sqlx::PgPool,
    schema: Option<&str>,
    until: Option<i64>,
) -> Result<(), MigrateError> {
    // `until`: a database as an earlier release left it (upgrade tests).
    let last = POSTGRES
        .iter()
        .take_while(|s| until.is_none_or(|v| s.version <= v))
        .count();
    let migrator = migrator(&POSTGRES[..last]);
    let mut conn = pool.acquire().await?;
    if let Some(schema) = schema {
        // A checked identifier (`sql::check_schema`): safe to splice.
        let create = format!("CREATE SCHEMA IF NOT EXISTS {schema}");
        sqlx::query(sqlx::AssertSqlSafe(create))
            .execute(&mut *conn)
            .await?;
    }
    // Serialised against other instances starting at the same moment (the
    // migrator's own lock is taken later, per run).
    conn.lock().await?;
    let adopted = adopt(
        &mut conn,
        &migrator,
        "SELECT to_regclass($1) IS NOT NULL",
        "CREATE TABLE IF NOT EXISTS _idemgate_migrations (version BIGINT PRIMARY KEY, \
         description TEXT NOT NULL, installed_on TIMESTAMPTZ NOT NULL DEFAULT now(), \
         success BOOLEAN NOT NULL, checksum BYTEA NOT NULL, execution_time BIGINT NOT NULL)",
    )
    .await;
    conn.unlock().await?;
    adopted?;
    drop(conn);
    migrator.run(pool).await
}

/// Applies the SQLite schema.
#[cfg(feature = "sqlite")]
pub(crate) async fn sqlite(pool: &sqlx::SqlitePool) -> Result<(), MigrateError> {
    let migrator = migrator(&SQLITE);
    let mut conn = pool.acquire().await?;
    adopt(
        &mut conn,
        &migrator,
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = $1)",
        "CREATE TABLE IF NOT EXISTS _idemgate_migrations (version BIGINT PRIMARY KEY, \
         description TEXT NOT NULL, installed_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP, \
         success BOOLEAN NOT NULL, checksum BLOB NOT NULL, execution_time BIGINT NOT NULL)",
    )
    .await?;
    drop(conn);
    migrator.run(pool).await
}

/// Applies the MySQL / MariaDB schema. No release ever kept these
/// migrations in the shared table, so there is nothing to adopt.
///
/// The migrator's own lock is off: it waits with `GET_LOCK(…, -1)`, which
/// MariaDB answers at once with NULL (a negative timeout is no wait there)
/// and a Galera node refuses outright. The store takes a lock of its own
/// where the server has one, and every statement of its migrations is
/// idempotent (`IF NOT EXISTS`), so instances that still migrate at once
/// (two Galera nodes) at worst meet the other's bookkeeping row — a
/// duplicate version, or one still marked unfinished — and run again once
/// the other is done.
#[cfg(feature = "mysql")]
pub(crate) async fn mysql(
    conn: &mut sqlx::MySqlConnection,
    until: Option<i64>,
) -> Result<(), MigrateError> {
    use sqlx::Row;
    let last = MYSQL
        .iter()
        .take_while(|s| until.is_none_or(|v| s.version <= v))
        .count();
    let mut migrator = migrator(&MYSQL[..last]);
    migrator.set_locking(false);
    // 1: taken; NULL or an error (Galera): no lock to take.
    let locked = sqlx::query("SELECT GET_LOCK(CONCAT('idemgate_migrations.', DATABASE()), 60)")
        .fetch_one(&mut *conn)
        .await
        .ok()
        .and_then(|row| row.try_get::<Option<i64>, _>(0).ok().flatten())
        == Some(1);
    let mut tries = 0;
    let result = loop {
        match migrator.run(&mut *conn).await {
            Err(e) if tries < MYSQL_RACED_TRIES && raced(&e) => {
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
            done => break done,
        }
    };
    if locked {
        let _ = sqlx::query("SELECT RELEASE_LOCK(CONCAT('idemgate_migrations.', DATABASE()))")
            .execute(&mut *conn)
            .await;
    }
    result
}

/// How many times a migration that met another instance's is run again
/// (half a second apart).
#[cfg(feature = "mysql")]
const MYSQL_RACED_TRIES: u32 = 40;

/// Whether a MySQL migration failed on another instance's bookkeeping: a
/// version it recorded first (1062), or one it has not finished.
#[cfg(feature = "mysql")]
fn raced(e: &MigrateError) -> bool {
    match e {
        MigrateError::Dirty(_) => true,
        MigrateError::Execute(sqlx::Error::Database(db)) => db.code().as_deref() == Some("23000"),
        _ => false,
    }
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
async fn adopt<'c, DB>(
    conn: &'c mut sqlx::pool::PoolConnection<DB>,
    migrator: &Migrator,
    table_exists: &'static str,
    create: &'static str,
) -> Result<(), MigrateError>
where
    DB: sqlx::Database,
    for<'e> &'e mut DB::Connection: sqlx::Executor<'e, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> &'q [u8]: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i64: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    bool: for<'r> sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    use sqlx::Row;
    let exists = async |conn: &mut DB::Connection, table: &str| -> Result<bool, sqlx::Error> {
        let row = sqlx::query::<DB>(table_exists)
            .bind(table)
            .fetch_one(&mut *conn)
            .await?;
        row.try_get::<bool, _>(0)
    };
    let conn: &mut DB::Connection = conn;
    if exists(conn, MIGRATIONS_TABLE).await? || !exists(conn, SHARED_TABLE).await? {
        return Ok(());
    }
    let mut tx = conn.begin().await?;
    sqlx::query::<DB>(create).execute(&mut *tx).await?;
    for m in migrator.iter() {
        // The same rows both times, within one transaction.
        sqlx::query::<DB>(
            "INSERT INTO _idemgate_migrations \
             (version, description, installed_on, success, checksum, execution_time) \
             SELECT version, description, installed_on, success, checksum, execution_time \
             FROM _sqlx_migrations WHERE version = $1 AND checksum = $2",
        )
        .bind(m.version)
        .bind(&*m.checksum)
        .execute(&mut *tx)
        .await?;
        sqlx::query::<DB>("DELETE FROM _sqlx_migrations WHERE version = $1 AND checksum = $2")
            .bind(m.version)
            .bind(&*m.checksum)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(())
}
