//! Which databases the store knows ([`Dialect`]): what a URL names, and
//! what each can do. Each has its implementation behind the store's face
//! ([`super::SqlStore`]): Postgres and SQLite share one (`dollar.rs`: the
//! same statements, `$N` placeholders, `RETURNING`), MySQL and MariaDB have
//! their own (`mysql.rs`: InnoDB's locking, `?` placeholders, no
//! `RETURNING`). A database is one more variant here and one more
//! implementation there, not a branch in every function.

/// A database the store can keep its records in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// Postgres (`postgres://`, `postgresql://`).
    Postgres,
    /// SQLite (`sqlite:`), embedded.
    Sqlite,
    /// MySQL 8 or MariaDB 10.6+ (`mysql://`, `mariadb://`), InnoDB.
    Mysql,
}

impl Dialect {
    /// The database a URL names.
    pub fn of(url: &str) -> Option<Dialect> {
        if url.starts_with("sqlite:") {
            Some(Dialect::Sqlite)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Some(Dialect::Postgres)
        } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
            Some(Dialect::Mysql)
        } else {
            None
        }
    }

    /// Its name (`postgres`, `sqlite`, `mysql`), as logs and metrics say it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Dialect::Postgres => "postgres",
            Dialect::Sqlite => "sqlite",
            Dialect::Mysql => "mysql",
        }
    }

    /// Whether its tables can live in a schema of their own
    /// ([`crate::StoreOptions::schema`]).
    #[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    pub(crate) fn has_schemas(self) -> bool {
        self == Dialect::Postgres
    }
}

/// A database this build has no support for, naming its cargo feature.
pub(super) fn not_built(dialect: Dialect) -> crate::StoreError {
    crate::StoreError::Unavailable {
        op: "connect",
        cause: format!(
            "this build has no {} support (the idemgate-store feature {:?})",
            dialect.name(),
            dialect.name()
        ),
    }
}
