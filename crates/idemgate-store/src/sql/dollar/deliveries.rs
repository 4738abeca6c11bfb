//! The MQ link's delivery log: failed attempts of a consumed message,
//! counted for every instance (`max_deliveries`), and the lease that lets
//! one instance publish a message's dead-letter copy while the others
//! wait.

use std::time::Duration;

use sqlx::Row;

use super::{DollarSql, Pool};
use crate::StoreError;
use crate::record::millis;
use crate::sql::DeadLetterClaim;
impl DollarSql {
    /// A consumed message's failed upstream attempts and whether its
    /// dead-letter copy is stored (`0`, `false` when it never failed).
    pub(crate) async fn delivery(&self, route: &str, key: &str) -> Result<(u32, bool), StoreError> {
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
    pub(crate) async fn count_delivery_failure(
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
    pub(crate) async fn mark_dead_lettered(
        &self,
        route: &str,
        key: &str,
    ) -> Result<(), StoreError> {
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
    pub(crate) async fn claim_dead_letter(
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
    pub(crate) async fn renew_dead_letter(
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
    pub(crate) async fn release_dead_letter(
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
    pub(crate) async fn trim_deliveries(&self, before_ms: i64) -> Result<u64, StoreError> {
        let statement = self.sql().trim_deliveries.as_str();
        self.bounded("trim", async {
            with_pool!(self, pool => sqlx::query(statement).bind(before_ms).execute(pool).await.map(|r| r.rows_affected()))
        })
        .await
    }
}
