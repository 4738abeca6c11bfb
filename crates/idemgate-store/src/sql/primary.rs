//! Following the primary through a failover (Postgres), or the cluster
//! through a node's loss (a Galera cluster).
//!
//! A claim is a write, so only a server that takes writes will do. The
//! database URL may name several hosts, as libpq's do
//! (`postgres://u@h1:5432,h2:5432/db?target_session_attrs=read-write`,
//! `mysql://u@n1:3306,n2:3306,n3:3306/db`), or one name (DNS, a VIP, a
//! pgbouncer, a ProxySQL) that moves. Either way, after a failover the pool
//! may hold connections to a server that is gone, came back as a read-only
//! standby, or (Galera) left its cluster's quorum: each of those fails its
//! operation with an error (`503`, nothing forwarded), never with "no
//! record", but a pool that keeps them would fail for as long as they live.
//!
//! So:
//! - every new connection asks the server whether it takes writes and is
//!   refused if not (`after_connect`);
//! - a watcher asks the same every [`WATCH_EVERY`] on a pooled connection.
//!   When the answer is "no", or the connection broke, every connection
//!   opened before that moment is closed instead of being handed out
//!   again (`before_acquire` compares its age), and with several hosts the
//!   watcher finds the first, in the URL's order, that takes writes and
//!   points the pool at it.
//!
//! sqlx takes one host per pool; the host list, the search and the switch
//! are this module's, the smallest layer over `Pool::set_connect_options`,
//! written once for both databases: what differs ([`Follow`]) is how a
//! server says it takes writes and which errors say it moved.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use sqlx::{ConnectOptions, Connection, Database, Pool};

pub(super) use crate::url_hosts::{Hosts, hosts};

/// A pool's connect options.
pub(super) type Options<DB> = <<DB as Database>::Connection as Connection>::Options;

/// What following a database's primary needs of it.
pub(super) trait Follow: Database {
    /// Several hosts are safe only as members of one cluster that names
    /// itself (Galera's state UUID): servers that could each take writes
    /// alone (an old MySQL primary restarted writable beside the replica
    /// promoted in its place) would split the records between them.
    const SEVERAL_HOSTS_NEED_A_CLUSTER: bool;

    /// Whether the server behind `conn` takes the store's writes now, and
    /// the cluster it says it belongs to.
    fn member(conn: &mut Self::Connection) -> BoxFuture<'_, Result<Member, sqlx::Error>>;

    /// Whether an error says the server moved or went away (rather than
    /// that it is busy): a broken or refused connection, a server shutting
    /// down, read-only or out of its cluster, or a connection
    /// [`read_only`] refused.
    fn is_evidence_of_a_move(e: &sqlx::Error) -> bool;

    /// `options`, pointed at `host:port`.
    fn at(options: &Options<Self>, host: &str, port: u16) -> Options<Self>;

    /// `host:port` of `options`, for logs.
    fn address(options: &Options<Self>) -> (String, u16);
}

/// How often the watcher asks whether the pool's server still takes writes.
pub(super) const WATCH_EVERY: Duration = Duration::from_millis(500);

/// What a server says of itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Member {
    /// It takes writes now.
    pub(super) writes: bool,
    /// It is fully caught up (a Galera node synced, not a donor or still
    /// joining). With several hosts only such a one is chosen; with one,
    /// a node that takes writes will do.
    pub(super) settled: bool,
    /// The cluster it belongs to, where it names one.
    pub(super) cluster: Option<String>,
}

/// What the pool's hooks and the watcher share.
pub(super) struct Primary<DB: Follow> {
    /// Every host of the URL, each with the store's connect options.
    candidates: Vec<Options<DB>>,
    /// With several hosts: the cluster the first server written to named.
    /// A server of another one is never written to.
    cluster: std::sync::Mutex<Option<String>>,
    /// Connections opened before this (ms after `started`) are closed
    /// instead of handed out: they may point at a server that moved.
    stale_before_ms: AtomicU64,
    started: Instant,
}

impl<DB: Follow> Primary<DB> {
    pub(super) fn new(base: &Options<DB>, hosts: &Hosts) -> Arc<Primary<DB>> {
        Arc::new(Primary {
            candidates: hosts
                .list
                .iter()
                .map(|(host, port)| DB::at(base, host, *port))
                .collect(),
            cluster: std::sync::Mutex::new(None),
            stale_before_ms: AtomicU64::new(0),
            started: Instant::now(),
        })
    }

    /// Whether the server behind `conn` is one to write to: it takes
    /// writes, and with several hosts, it is of the cluster the first one
    /// written to named (one that names none is refused where
    /// [`Follow::SEVERAL_HOSTS_NEED_A_CLUSTER`]).
    pub(super) async fn accepts(&self, conn: &mut DB::Connection) -> Result<bool, sqlx::Error> {
        Ok(self.admits(DB::member(conn).await?))
    }

    /// See [`Primary::accepts`]: what a server said of itself decides.
    fn admits(&self, member: Member) -> bool {
        if !member.writes {
            return false;
        }
        if self.candidates.len() < 2 {
            return true;
        }
        if !member.settled {
            return false;
        }
        let Some(cluster) = member.cluster else {
            return !DB::SEVERAL_HOSTS_NEED_A_CLUSTER;
        };
        let mut known = self.cluster.lock().unwrap_or_else(|e| e.into_inner());
        match &*known {
            Some(first) if *first != cluster => {
                tracing::error!(
                    layer = "sql",
                    cluster = %cluster,
                    expected = %first,
                    "a host of the database URL belongs to another cluster; it is not written to"
                );
                false
            }
            Some(_) => true,
            None => {
                *known = Some(cluster);
                true
            }
        }
    }

    /// Asks the server `options` name, on a connection of its own,
    /// whether it is one to write to ([`Primary::accepts`]).
    async fn probe(&self, options: &Options<DB>) -> Result<bool, sqlx::Error> {
        Ok(self.admits(ask::<DB>(options).await?))
    }

    /// Whether a connection of this age was opened before the last time
    /// the primary was found gone or read-only.
    pub(super) fn is_stale(&self, age: Duration) -> bool {
        let stale_before = self.stale_before_ms.load(Ordering::Relaxed);
        if stale_before == 0 {
            return false;
        }
        let opened = self.started.elapsed().saturating_sub(age);
        (opened.as_millis() as u64) < stale_before
    }

    fn mark_stale(&self) {
        let now = self.started.elapsed().as_millis() as u64;
        self.stale_before_ms
            .fetch_max(now.max(1), Ordering::Relaxed);
    }

    /// Where the pool connects first: with several hosts, the first, in
    /// the URL's order, to write to; with one, `options`. The hosts are
    /// asked all at once, each once, within `within`; every one that
    /// answers must name one cluster, or none is written to (a node of a
    /// stale, separately started cluster listed beside the real one would
    /// split the records). Where hosts must name a cluster, more than half
    /// of them must answer: a node wiped and started alone names a cluster
    /// of its own, and were it the only one to answer (its cluster's nodes
    /// down for a restart), its cluster would be the one pinned — while
    /// other instances write to the real one. Two majorities share a node,
    /// so every instance pins the same cluster.
    pub(super) async fn first_target(
        &self,
        options: Options<DB>,
        within: Duration,
    ) -> Result<Options<DB>, sqlx::Error> {
        if self.candidates.len() < 2 {
            return Ok(options);
        }
        let answers = self.ask_all(within).await;
        let named: Vec<(&Options<DB>, &String)> = self
            .candidates
            .iter()
            .zip(&answers)
            .filter_map(|(options, answer)| {
                Some((options, answer.as_ref().ok()?.cluster.as_ref()?))
            })
            .collect();
        // Hosts that answer without naming a cluster are refused below,
        // by name; here only silence counts.
        let answered = answers.iter().filter(|a| a.is_ok()).count();
        if DB::SEVERAL_HOSTS_NEED_A_CLUSTER && answered * 2 <= self.candidates.len() {
            return Err(sqlx::Error::Configuration(
                format!(
                    "{answered} of the {} hosts of the database URL answered; more than \
                     half must, so that the cluster written to is the one most of them \
                     belong to",
                    self.candidates.len()
                )
                .into(),
            ));
        }
        if let Some((first_host, first)) = named.first()
            && let Some((host, other)) = named.iter().find(|(_, c)| c != first)
        {
            let (a, b) = (DB::address(first_host), DB::address(host));
            return Err(sqlx::Error::Configuration(
                format!(
                    "the hosts of the database URL belong to different clusters \
                     ({}:{}: {first}, {}:{}: {other}); list one cluster's nodes",
                    a.0, a.1, b.0, b.1
                )
                .into(),
            ));
        }
        self.first_admitted(answers)
    }

    /// Every host's answer, asked all at once, each within `within`: a
    /// host that is down costs one bound, not one each.
    async fn ask_all(&self, within: Duration) -> Vec<Result<Member, sqlx::Error>> {
        let asked = self.candidates.iter().map(|options| async move {
            match tokio::time::timeout(within, ask::<DB>(options)).await {
                Ok(answer) => answer,
                Err(_) => Err(sqlx::Error::PoolTimedOut),
            }
        });
        futures_util::future::join_all(asked).await
    }

    /// The first host, in the URL's order, whose answer admits it.
    fn first_admitted(
        &self,
        answers: Vec<Result<Member, sqlx::Error>>,
    ) -> Result<Options<DB>, sqlx::Error> {
        let mut last = None;
        for (options, answer) in self.candidates.iter().zip(answers) {
            match answer.map(|member| self.admits(member)) {
                Ok(true) => return Ok(options.clone()),
                Ok(false) => {
                    let (host, port) = DB::address(options);
                    last = Some(read_only(&format!("{host}:{port}")));
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or(sqlx::Error::PoolTimedOut))
    }

    /// The first host, in the URL's order, that takes writes now.
    pub(super) async fn find_writable(&self, within: Duration) -> Result<Options<DB>, sqlx::Error> {
        let answers = self.ask_all(within).await;
        self.first_admitted(answers)
    }

    /// Watches `pool` until `alive` says the store is gone: see the module
    /// docs.
    pub(super) async fn watch(
        self: Arc<Self>,
        pool: Pool<DB>,
        timeout: Duration,
        alive: std::sync::Weak<()>,
    ) {
        let mut moved = false;
        loop {
            tokio::time::sleep(WATCH_EVERY).await;
            if alive.strong_count() == 0 {
                return;
            }
            let check = async {
                let mut conn = pool.acquire().await?;
                self.accepts(&mut conn).await
            };
            // Moved only on evidence: a server that answers "read-only",
            // a connection that breaks or hangs, a server that refuses
            // connections. A busy pool, or a server refusing for load
            // (too many connections, starting up), is not a move: closing
            // every connection then would only add a reconnect storm.
            let healthy = match tokio::time::timeout(timeout, check).await {
                Ok(Ok(writable)) => writable,
                // No connection in time: the pool is busy, or it keeps
                // failing to reach its server (sqlx retries a refused
                // connect until the wait runs out). Ask the server itself.
                Ok(Err(sqlx::Error::PoolTimedOut)) => {
                    let options = pool.connect_options();
                    match tokio::time::timeout(timeout, self.probe(&options)).await {
                        Ok(Ok(writable)) => writable,
                        Ok(Err(e)) => !DB::is_evidence_of_a_move(&e),
                        Err(_) => true,
                    }
                }
                // A connection in hand whose query hung past the acquire's
                // own bound: it (and its siblings) may point at a host
                // that vanished without a reset.
                Err(_) => false,
                Ok(Err(e)) => !DB::is_evidence_of_a_move(&e),
            };
            if healthy {
                if moved {
                    tracing::info!(layer = "sql", "the pool's server takes writes again");
                    moved = false;
                }
                continue;
            }
            if !moved {
                tracing::warn!(
                    layer = "sql",
                    "the pool's server is gone or read-only: closing its connections and \
                     looking for the primary; store operations fail (503) meanwhile"
                );
                moved = true;
            }
            self.mark_stale();
            if self.candidates.len() > 1 {
                match self.find_writable(timeout).await {
                    Ok(options) => {
                        let (host, port) = DB::address(&options);
                        tracing::info!(
                            layer = "sql",
                            host,
                            port,
                            "the primary is found; new connections go there"
                        );
                        pool.set_connect_options(options);
                        // Anything opened while the search ran went
                        // to the old target.
                        self.mark_stale();
                    }
                    Err(e) => {
                        tracing::warn!(layer = "sql", error = %e, "no host of the database URL takes writes")
                    }
                }
            }
        }
    }
}

/// What the server `options` name says of itself, on a connection of its
/// own.
async fn ask<DB: Follow>(options: &Options<DB>) -> Result<Member, sqlx::Error> {
    let mut conn = options.connect().await?;
    let member = DB::member(&mut conn).await;
    let _ = conn.close().await;
    member
}

/// The error a connection to a server (`which`) that takes no writes is
/// refused with.
pub(super) fn read_only(which: &str) -> sqlx::Error {
    sqlx::Error::Configuration(
        format!(
            "{which} is not one to write to (a standby or read-only server; a Galera node out \
             of its quorum, not synced, or of another cluster; a MySQL URL names several hosts \
             only for a Galera cluster's nodes): the store needs the primary"
        )
        .into(),
    )
}

#[cfg(all(test, feature = "postgres"))]
mod tests {
    use super::*;

    #[test]
    fn connections_older_than_a_move_are_stale() {
        let hosts = crate::url_hosts::hosts("postgres://h1/db").unwrap();
        let options = sqlx::postgres::PgConnectOptions::new();
        let primary = Primary::<sqlx::Postgres>::new(&options, &hosts);
        assert!(!primary.is_stale(Duration::from_secs(3600)));
        std::thread::sleep(Duration::from_millis(5));
        primary.mark_stale();
        assert!(primary.is_stale(Duration::from_millis(4)));
        assert!(!primary.is_stale(Duration::ZERO));
    }
}
