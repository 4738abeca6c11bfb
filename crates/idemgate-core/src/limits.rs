//! What the process may hold: descriptors, and the budgets sized from them
//! (docs/semantics.md, rule 10).
//!
//! Every client connection, upstream connection and store connection is a
//! descriptor. Past the limit `accept` fails (`EMFILE`) and so does every
//! connect, the store's included: the gateway would stop answering anyone.
//! So at start-up the soft limit is raised to the hard one (as Go's
//! runtime and nginx's `worker_rlimit_nofile` do), a reserve is kept for
//! the store, Redis, the brokers, logs and the admin listener, and what is
//! left is split between client connections and the upstream connections
//! their claims use: `server.max_connections` is lowered to fit (logged
//! once, with the numbers), and `server.max_claims` and the upstream
//! connection cap default to their share.

/// Descriptors kept back from the budgets: the admin listener and its
/// clients, the runtime, DNS, log files (the store's pools and the
/// brokers' connections are added to it).
pub const BASE_RESERVE: usize = 64;

/// Claims one connection may leave live at most: the HTTP/2 stream limit
/// (a client that resets streams leaves a claim behind with each).
pub const CLAIMS_PER_CONNECTION: usize = 128;

/// The fewest claims and connections a budget leaves, however low the
/// descriptor limit (a limit that low is refused at start-up elsewhere).
const MIN_SHARE: usize = 16;

/// Raises the soft descriptor limit to the hard one; the soft limit after.
pub fn raise_descriptor_limit() -> Option<u64> {
    rlimit::increase_nofile_limit(u64::MAX).ok()
}

/// The soft descriptor limit, if the platform has one.
pub fn descriptor_limit() -> Option<u64> {
    rlimit::Resource::NOFILE.get().ok().map(|(soft, _)| soft)
}

/// Descriptors open right now (Linux: `/proc/self/fd`).
pub fn open_descriptors() -> Option<usize> {
    std::fs::read_dir("/proc/self/fd").ok().map(|d| d.count())
}

/// What the descriptors left after the reserve allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budgets {
    /// Client connections at once (at most the configured number).
    pub max_connections: usize,
    /// Claims in flight (the configured number, or twice the connections:
    /// one per connection and as many outliving theirs).
    pub max_claims: usize,
    /// HTTP/1.1 upstream connections of one upstream at once, where none is
    /// configured (the upstream half, split over the upstreams).
    pub upstream_connections: usize,
    /// Claims one client connection may leave live.
    pub claims_per_connection: usize,
}

/// The budgets for `limit` descriptors (`None`: no limit known), keeping
/// `reserve` back; `0` in a configured value means "derive it".
pub fn budgets(
    limit: Option<u64>,
    reserve: usize,
    upstreams: usize,
    configured_connections: usize,
    configured_claims: usize,
) -> Budgets {
    let usable = limit
        .map(|l| {
            usize::try_from(l)
                .unwrap_or(usize::MAX)
                .saturating_sub(reserve)
        })
        .unwrap_or(usize::MAX / 4);
    // Half for clients, half for the upstream connections their claims
    // and pass-through requests use.
    let half = (usable / 2).max(MIN_SHARE);
    let max_connections = configured_connections.min(half).max(1);
    let upstream_connections = (half / upstreams.max(1)).max(MIN_SHARE);
    // Claims past the upstream connections wait for one (bounded by the
    // connect timeout), they do not open more: the budget bounds work, the
    // caps bound descriptors.
    let max_claims = match configured_claims {
        0 => max_connections.saturating_mul(2),
        n => n,
    };
    // One connection (an HTTP/2 client resetting its streams) must not
    // take the whole budget.
    let claims_per_connection = CLAIMS_PER_CONNECTION.min((max_claims / 8).max(1));
    Budgets {
        max_connections,
        max_claims,
        upstream_connections,
        claims_per_connection,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_low_descriptor_limit_lowers_connections_and_sizes_claims() {
        // systemd's default soft limit.
        let b = budgets(Some(1024), 100, 2, 10_000, 0);
        assert_eq!(b.max_connections, 462);
        assert_eq!(b.max_claims, 924);
        assert_eq!(b.upstream_connections, 231);
        assert_eq!(b.claims_per_connection, 115);
        // Plenty of descriptors: the configured values stand.
        let b = budgets(Some(1 << 20), 100, 1, 10_000, 500);
        assert_eq!((b.max_connections, b.max_claims), (10_000, 500));
        assert!(b.upstream_connections > 500_000);
        assert_eq!(b.claims_per_connection, 62);
        let b = budgets(Some(1 << 20), 100, 1, 10_000, 0);
        assert_eq!((b.max_claims, b.claims_per_connection), (20_000, 128));
        // No limit known.
        assert_eq!(budgets(None, 100, 1, 10_000, 0).max_connections, 10_000);
    }
}
