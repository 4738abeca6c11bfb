//! Claims are counted (docs/semantics.md, rule 10).
//!
//! A won claim runs in a task of its own and outlives its client — right
//! for "never twice", and a way to pile work on the upstream: clients that
//! send a request and hang up, or an HTTP/2 connection that opens streams
//! and resets them at once, leave a claim behind each time. Every claim
//! therefore counts, until its holder has finished, against two limits,
//! both taken *before* the claim is made (nothing recorded, nothing
//! forwarded when one is full):
//!
//! - [`ClaimBudget`]: the process's claims in flight (`server.max_claims`,
//!   by default half the descriptors left after a reserve, as nginx's
//!   `worker_connections` and HAProxy's `maxconn` bound what one process
//!   holds). Full: `503 claims-exhausted` with `Retry-After`.
//! - [`ConnectionClaims`]: the connection that made the claim. The claims
//!   of one connection hold its `server.max_connections` slot until the
//!   last of them finished, so a client that hangs up does not free its
//!   slot for the next; and one connection may leave at most
//!   [`CLAIMS_PER_CONNECTION`] claims live (HTTP/2's stream limit, resets
//!   included: Go's answer to CVE-2023-44487 bounds running handlers the
//!   same way). Past it the request is refused and the connection asked to
//!   close (HTTP/2 `GOAWAY`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

pub use crate::limits::CLAIMS_PER_CONNECTION;

/// The process's claims in flight.
#[derive(Clone, Debug)]
pub struct ClaimBudget {
    permits: Arc<Semaphore>,
    limit: usize,
}

impl ClaimBudget {
    /// At most `limit` claims at once.
    pub fn new(limit: usize) -> Self {
        ClaimBudget {
            permits: Arc::new(Semaphore::new(limit)),
            limit,
        }
    }

    /// A budget no workload reaches (library use, tests).
    pub fn unbounded() -> Self {
        Self::new(Semaphore::MAX_PERMITS)
    }

    /// One claim's share, or `None` when the budget is spent.
    pub fn try_take(&self) -> Option<OwnedSemaphorePermit> {
        self.permits.clone().try_acquire_owned().ok()
    }

    /// The limit.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Claims held right now.
    pub fn in_use(&self) -> usize {
        self.limit - self.permits.available_permits()
    }
}

/// One client connection's claims: what its requests carry (a request
/// extension) and its claims hold until they finish.
#[derive(Clone, Debug)]
pub struct ConnectionClaims(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    /// The connection's `max_connections` slot: released when the
    /// connection and all its claims are gone.
    _slot: Option<OwnedSemaphorePermit>,
    live: AtomicUsize,
    limit: usize,
    /// Notified when the connection left too many claims behind.
    calm: Notify,
}

/// A live claim of a connection; dropping it counts the claim finished.
#[derive(Debug)]
pub struct ConnectionClaim(ConnectionClaims);

impl Drop for ConnectionClaim {
    fn drop(&mut self) {
        self.0.0.live.fetch_sub(1, Ordering::AcqRel);
    }
}

impl ConnectionClaims {
    /// The claims of a connection holding `slot`, at most `limit` live.
    pub fn new(slot: Option<OwnedSemaphorePermit>, limit: usize) -> Self {
        ConnectionClaims(Arc::new(Inner {
            _slot: slot,
            live: AtomicUsize::new(0),
            limit,
            calm: Notify::new(),
        }))
    }

    /// Counts one more claim, or refuses it (and asks the connection to
    /// close) when the connection already has its limit live.
    pub fn take(&self) -> Option<ConnectionClaim> {
        let before = self.0.live.fetch_add(1, Ordering::AcqRel);
        if before >= self.0.limit {
            self.0.live.fetch_sub(1, Ordering::AcqRel);
            self.0.calm.notify_one();
            return None;
        }
        Some(ConnectionClaim(self.clone()))
    }

    /// Claims live right now.
    pub fn live(&self) -> usize {
        self.0.live.load(Ordering::Acquire)
    }

    /// Resolves when the connection left more claims behind than it may
    /// (the server then closes it).
    pub async fn too_many(&self) {
        self.0.calm.notified().await
    }
}

/// Why a claim was not even tried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exhausted {
    /// `server.max_claims` are in flight.
    Process,
    /// This connection left its limit of claims behind.
    Connection,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_connection_holds_its_slot_until_its_last_claim_ends() {
        let slots = Arc::new(Semaphore::new(1));
        let slot = slots.clone().try_acquire_owned().unwrap();
        let conn = ConnectionClaims::new(Some(slot), 2);
        let first = conn.take().unwrap();
        let second = conn.take().unwrap();
        assert!(conn.take().is_none(), "a third live claim");
        // The connection goes; its claims keep the slot.
        let claims = conn.clone();
        drop(conn);
        assert_eq!(slots.available_permits(), 0);
        drop(first);
        assert!(claims.take().is_some(), "room again");
        drop((second, claims));
        assert_eq!(slots.available_permits(), 1);
    }

    #[test]
    fn the_budget_counts_claims_until_they_end() {
        let budget = ClaimBudget::new(2);
        let a = budget.try_take().unwrap();
        let _b = budget.try_take().unwrap();
        assert!(budget.try_take().is_none());
        assert_eq!(budget.in_use(), 2);
        drop(a);
        assert!(budget.try_take().is_some());
    }
}
