//! A Postgres connection kept by one batch writer between its batches.
//!
//! sqlx checks every connection taken back into its pool with a round trip
//! (a `Sync`), so a batch that borrowed a pooled connection cost Postgres
//! two wake-ups instead of one. A batch writer runs one batch at a time
//! ([`super::batch::WRITERS`]), so it keeps the connection its last batch
//! used. The connection goes back to the pool (and through the pool's
//! check) when a statement on it failed or was cut short, since its state
//! is then unknown, and when it sat idle long enough that it may have died
//! meanwhile; the pool then pings it before anyone uses it again.

#[cfg(feature = "postgres")]
use std::time::{Duration, Instant};

#[cfg(feature = "postgres")]
use sqlx::Postgres;
#[cfg(feature = "postgres")]
use sqlx::pool::PoolConnection;
#[cfg(feature = "postgres")]
use sqlx::postgres::{PgConnection, PgPool};
#[cfg(feature = "postgres")]
use tokio::sync::Mutex;

/// A pool smaller than this lends each batch a connection instead: the
/// three writers (claims, completions, large completions) keeping one each
/// must leave some for everything else (takeovers, reads, the sweeper).
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) const MIN_POOL_TO_HOLD: u32 = 4;

/// The connection one batch writer keeps, with when it was last used.
/// (Nothing to keep without Postgres.)
#[derive(Default)]
pub(crate) struct HeldConnection {
    // Locked for a whole batch: with one writer per batcher it is never
    // contended, and with more it keeps one batch per connection.
    #[cfg(feature = "postgres")]
    slot: Mutex<Option<(PoolConnection<Postgres>, Instant)>>,
}

#[cfg(feature = "postgres")]
impl HeldConnection {
    /// Runs `work` on the kept connection, or on a fresh one from `pool`
    /// when there is none or the kept one sat idle longer than `max_idle`.
    /// The connection is kept again only if `work` succeeded; if `work` is
    /// dropped half-way (a timeout), the connection goes back to the pool.
    pub(crate) async fn run<T>(
        &self,
        pool: &PgPool,
        max_idle: Duration,
        work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, sqlx::Error> {
        let mut slot = self.slot.lock().await;
        let kept = slot
            .take()
            .filter(|(_, last_used)| last_used.elapsed() <= max_idle);
        // A stale one was dropped by the filter: returned to the pool,
        // which checks it before lending it again.
        let mut conn = match kept {
            Some((conn, _)) => conn,
            None => pool.acquire().await?,
        };
        let result = work(&mut conn).await;
        if result.is_ok() {
            *slot = Some((conn, Instant::now()));
        }
        result
    }
}
