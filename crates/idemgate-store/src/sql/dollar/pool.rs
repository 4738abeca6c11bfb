//! The one pool type of the databases that share the `$N` statements
//! (Postgres and SQLite), and `with_pool!`, which runs one body of shared
//! code on whichever of them a store has.

#[cfg(feature = "postgres")]
use sqlx::postgres::PgPool;
#[cfg(feature = "sqlite")]
use sqlx::sqlite::SqlitePool;

use super::statements::Statements;
use crate::StoreError;
use crate::sql::{Dialect, SqlSettings};

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
    /// refused naming its cargo feature. Background work for the pool (the
    /// Postgres primary's watcher) ends once `alive` has no owner.
    pub(super) async fn connect(
        dialect: Dialect,
        settings: &SqlSettings,
        #[cfg_attr(not(feature = "postgres"), allow(unused_variables))] alive: std::sync::Weak<()>,
    ) -> Result<Pool, StoreError> {
        match dialect {
            #[cfg(feature = "postgres")]
            Dialect::Postgres => Ok(Pool::Postgres(
                super::postgres::connect(settings, alive).await?,
            )),
            #[cfg(feature = "sqlite")]
            Dialect::Sqlite => Ok(Pool::Sqlite(super::sqlite::connect(settings).await?)),
            #[allow(unreachable_patterns)] // every database built in
            other => Err(crate::sql::dialect::not_built(other)),
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
