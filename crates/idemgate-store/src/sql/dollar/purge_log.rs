//! The purge log: every purge is logged with its delete, so that every
//! process's in-process layer hears of it (see [`crate::purges`]).

use std::time::Duration;

use sqlx::Row;

use super::{DollarSql, Pool};
use crate::StoreError;
use crate::record::millis;
use crate::sql::LoggedPurge;
impl DollarSql {
    /// Purges logged after `last` (oldest first, at most 1,000), for the
    /// in-process fast layers to forget.
    pub(crate) async fn purges_since(&self, last: i64) -> Result<Vec<LoggedPurge>, StoreError> {
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
    pub(crate) async fn last_purge(&self) -> Result<i64, StoreError> {
        let statement = self.sql().last_purge.as_str();
        self.bounded("purges", async {
            with_pool!(self, pool => {
                sqlx::query(statement).fetch_one(pool).await?.try_get::<i64, _>(0)
            })
        })
        .await
    }

    /// Forgets logged purges older than `age`.
    pub(crate) async fn trim_purges(&self, age: Duration) -> Result<u64, StoreError> {
        let statement = self.sql().trim_purges.as_str();
        self.bounded("purges", async {
            with_pool!(self, pool => {
                sqlx::query(statement).bind(millis(age)).execute(pool).await.map(|r| r.rows_affected())
            })
        })
        .await
    }
}
