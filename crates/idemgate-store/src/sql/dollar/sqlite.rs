//! SQLite: connecting (one permanent connection, WAL, `synchronous =
//! FULL`, a busy timeout under `store.timeout`).

use std::str::FromStr;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

use super::SqlSettings;
use crate::StoreError;

/// Opens the SQLite database `settings` name (made when missing, with its
/// directory).
pub(super) async fn connect(settings: &SqlSettings) -> Result<sqlx::SqlitePool, StoreError> {
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
    Ok(pool)
}
