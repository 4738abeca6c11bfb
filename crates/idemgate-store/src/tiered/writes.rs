//! The batch writers of one store: claims and completions gathered into
//! shared transactions (on SQLite one writer takes both kinds), large
//! answers in a lane of their own, and the claims whose caller stopped
//! waiting released.

use std::sync::Arc;
use std::time::Duration;

use crate::StoreError;
use crate::batch::{Batcher, Lane};
use crate::held::HeldConnection;
use crate::sql::{Completion, NewClaim, SqlStore, Write, Written};

/// A completion whose body is larger goes to the large lane.
pub(super) const LARGE_BODY: usize = 64 * 1024;

/// The large lane: one answer per write, and after each write a rest three
/// times as long as the write took. A megabyte answer holds the store's
/// writer (SQLite's only one; on Postgres its CPU, WAL and the Redis
/// connection) for milliseconds, and without a rest a flood of them kept
/// it busy back to back: every claim and small completion waited for one,
/// twice per request. Resting, a lane writes at most a quarter of its
/// time (one lane per store: per process on SQLite, per worker on
/// Postgres), a claim meets a large write in progress that much less
/// often, and a flood of large answers slows the recording of large
/// answers rather than every claim (`loadtest/README.md` has the
/// measurements).
pub(super) const LARGE_LANE: Lane = Lane {
    max_batch: 1,
    rest_per_write: 3,
};

/// A batch writer of completions, on its own kept connection.
pub(super) fn completion_batcher(
    sql: &SqlStore,
    lane: Lane,
) -> Batcher<Completion, Option<(Duration, bool)>> {
    let sql = sql.clone();
    let held = Arc::new(HeldConnection::default());
    Batcher::spawn_lane(
        "complete",
        sql.timeout(),
        lane,
        move |batch: Vec<Completion>| {
            let (sql, held) = (sql.clone(), held.clone());
            async move {
                let result = sql.complete_many(&batch, &held).await;
                (batch, result)
            }
        },
        // A holder whose write timed out checks whether it landed.
        |_, _| {},
    )
}

/// The batch writers of claims and (small) completions.
#[derive(Clone)]
pub(super) enum Writes {
    /// Postgres: two writers on two connections, so a claim never waits
    /// for a batch of completions (or the reverse), and each kind keeps
    /// its own statement.
    Apart {
        claims: Batcher<NewClaim, Option<(i64, i64)>>,
        completions: Batcher<Completion, Option<(Duration, bool)>>,
    },
    /// SQLite: its one connection writes in turn whatever the lanes, so
    /// one writer takes both kinds and commits them together — one
    /// transaction and one fsync where two writers took two.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    Together(Batcher<Write, Written>),
}

impl Writes {
    pub(super) fn new(sql: &SqlStore) -> Self {
        #[cfg(feature = "sqlite")]
        if sql.backend() == "sqlite" {
            let (writer, releaser) = (sql.clone(), sql.clone());
            return Writes::Together(Batcher::spawn(
                "write",
                sql.timeout(),
                move |batch: Vec<Write>| {
                    let sql = writer.clone();
                    async move {
                        let result = sql.write_many(&batch).await;
                        (batch, result)
                    }
                },
                move |write, written| {
                    if let (Write::Claim(claim), Written::Claim(won)) = (write, written) {
                        release_orphan(&releaser, claim, won);
                    }
                },
            ));
        }
        let (writer, releaser) = (sql.clone(), sql.clone());
        let held = Arc::new(HeldConnection::default());
        Writes::Apart {
            claims: Batcher::spawn(
                "claim",
                sql.timeout(),
                move |batch: Vec<NewClaim>| {
                    let (sql, held) = (writer.clone(), held.clone());
                    async move {
                        let result = sql.insert_claims(&batch, &held).await;
                        (batch, result)
                    }
                },
                move |claim, won| release_orphan(&releaser, claim, won),
            ),
            completions: completion_batcher(sql, Lane::default()),
        }
    }

    /// Inserts a fresh key's claim → its epoch and expiry where won.
    pub(super) async fn claim(&self, claim: NewClaim) -> Result<Option<(i64, i64)>, StoreError> {
        match self {
            Writes::Apart { claims, .. } => claims.submit(claim).await,
            Writes::Together(writes) => match writes.submit(Write::Claim(claim)).await? {
                Written::Claim(won) => Ok(won),
                Written::Complete(_) => Err(mismatched("claim")),
            },
        }
    }

    /// Stores an outcome → the retention left and whether a duplicate
    /// waits, where the epoch still held the claim.
    pub(super) async fn complete(
        &self,
        completion: Completion,
    ) -> Result<Option<(Duration, bool)>, StoreError> {
        match self {
            Writes::Apart { completions, .. } => completions.submit(completion).await,
            Writes::Together(writes) => match writes.submit(Write::Complete(completion)).await? {
                Written::Complete(done) => Ok(done),
                Written::Claim(_) => Err(mismatched("complete")),
            },
        }
    }
}

/// A write answered with the other kind's answer (a bug in `write_many`).
fn mismatched(op: &'static str) -> StoreError {
    StoreError::Unavailable {
        op,
        cause: "the batch writer answered another kind of write".into(),
    }
}

/// A claim won after its caller was told 503: nobody will forward it, so
/// the key is given back at once rather than held until its lease.
fn release_orphan(sql: &SqlStore, claim: NewClaim, won: Option<(i64, i64)>) {
    if let Some((epoch, _)) = won {
        let sql = sql.clone();
        tokio::spawn(async move {
            let released = sql.release(&claim.key, epoch).await;
            tracing::info!(route = %claim.key.route, key = %claim.key.escaped(), layer = "store", ?released, "claim committed after its caller gave up; released");
        });
    }
}
