//! The seam between the store and its databases (in the manner of sqlx's
//! driver crates): which databases there are ([`Dialect`]), the one pool
//! type that holds a connection pool of any of them ([`Pool`]), and
//! `with_pool!`, which runs one body of shared code on whichever pool a
//! store has. What differs between the databases lives behind this seam, a
//! module each (`postgres.rs`, `sqlite.rs`): how they connect, their
//! statements' clock and text (`statements.rs`), and the operations whose
//! steps differ (batched claims and completions, archiving, partitions,
//! wake-ups). A database is one more variant here and one more module
//! there, not a branch in every function.

#[cfg(feature = "postgres")]
use sqlx::postgres::PgPool;
#[cfg(feature = "sqlite")]
use sqlx::sqlite::SqlitePool;

use super::SqlSettings;
use super::statements::Statements;
use crate::StoreError;

/// A database the store can keep its records in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// Postgres (`postgres://`, `postgresql://`).
    Postgres,
    /// SQLite (`sqlite:`), embedded.
    Sqlite,
}

impl Dialect {
    /// The database a URL names.
    pub fn of(url: &str) -> Option<Dialect> {
        if url.starts_with("sqlite:") {
            Some(Dialect::Sqlite)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Some(Dialect::Postgres)
        } else {
            None
        }
    }

    /// Its name (`postgres`, `sqlite`), as logs and metrics say it.
    pub fn name(self) -> &'static str {
        match self {
            Dialect::Postgres => "postgres",
            Dialect::Sqlite => "sqlite",
        }
    }

    /// Whether its tables can live in a schema of their own
    /// ([`crate::StoreOptions::schema`]).
    pub fn has_schemas(self) -> bool {
        self == Dialect::Postgres
    }
}

/// A connection pool of one of the databases this build supports.
#[derive(Clone)]
pub(super) enum Pool {
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

impl Pool {
    /// Connects to `dialect`'s database; a database this build left out is
    /// refused naming its cargo feature.
    pub(super) async fn connect(
        dialect: Dialect,
        settings: &SqlSettings,
    ) -> Result<Pool, StoreError> {
        match dialect {
            #[cfg(feature = "postgres")]
            Dialect::Postgres => Ok(Pool::Postgres(super::postgres::connect(settings).await?)),
            #[cfg(feature = "sqlite")]
            Dialect::Sqlite => Ok(Pool::Sqlite(super::sqlite::connect(settings).await?)),
            #[allow(unreachable_patterns)] // every database built in
            other => Err(not_built(other)),
        }
    }

    /// Which database it is.
    pub(super) fn dialect(&self) -> Dialect {
        match self {
            #[cfg(feature = "postgres")]
            Pool::Postgres(_) => Dialect::Postgres,
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(_) => Dialect::Sqlite,
        }
    }

    /// Its database's statements.
    pub(super) fn statements(&self) -> &'static Statements {
        match self {
            #[cfg(feature = "postgres")]
            Pool::Postgres(_) => &super::statements::POSTGRES,
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(_) => &super::statements::SQLITE,
        }
    }
}

/// A database this build has no support for.
fn not_built(dialect: Dialect) -> StoreError {
    StoreError::Unavailable {
        op: "connect",
        cause: format!(
            "this build has no {} support (the idemgate-store feature {:?})",
            dialect.name(),
            dialect.name()
        ),
    }
}
