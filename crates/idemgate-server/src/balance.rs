//! Even load across the worker threads: which worker serves a connection.
//!
//! Workers accept from one shared socket and whichever is woken first takes
//! the connection, so a burst of new connections (a load balancer or a load
//! generator opening its pool) lands mostly on one worker. A keep-alive connection stays on its worker
//! for its whole life, so the busier worker queues requests while the other
//! idles, which costs throughput and lengthens the tail. nginx evens this
//! out by letting a busy worker skip accepting; here a worker that already
//! serves [`HAND_OVER_MARGIN`] or more connections beyond the least loaded
//! worker hands the new connection to that worker's inbox instead. A
//! hand-over costs one cross-thread wake-up per connection, never per
//! request, and happens before a byte of the connection was read.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::net::TcpStream;
use tokio::sync::mpsc;

/// How many more connections than the least loaded worker a worker may
/// serve before it hands new ones over. One would ping-pong connections on
/// every accept for no gain; two keeps workers within two connections.
pub const HAND_OVER_MARGIN: usize = 2;

/// A connection on its way to another worker, not yet read from.
#[derive(Debug)]
struct Handed {
    stream: std::net::TcpStream,
    peer: SocketAddr,
}

/// Open connections per worker, and each worker's inbox.
#[derive(Debug)]
pub struct Balance {
    // Relaxed counters: a decision made on a count that is one off is still
    // a good decision, and nothing else depends on them.
    open: Box<[AtomicUsize]>,
    inboxes: Box<[mpsc::UnboundedSender<Handed>]>,
}

/// One worker's place in the [`Balance`]: its index and its inbox.
#[derive(Debug)]
pub struct Seat {
    balance: Arc<Balance>,
    index: usize,
    inbox: mpsc::UnboundedReceiver<Handed>,
}

/// Counts one connection against its worker until dropped.
#[derive(Debug)]
pub struct ConnGuard {
    balance: Arc<Balance>,
    index: usize,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.balance.open[self.index].fetch_sub(1, Ordering::Relaxed);
    }
}

impl Balance {
    /// A balance over `workers` workers, and one seat per worker.
    pub fn new(workers: usize) -> (Arc<Balance>, Vec<Seat>) {
        let (senders, receivers): (Vec<_>, Vec<_>) =
            (0..workers).map(|_| mpsc::unbounded_channel()).unzip();
        let balance = Arc::new(Balance {
            open: (0..workers).map(|_| AtomicUsize::new(0)).collect(),
            inboxes: senders.into(),
        });
        let seats = receivers
            .into_iter()
            .enumerate()
            .map(|(index, inbox)| Seat {
                balance: balance.clone(),
                index,
                inbox,
            })
            .collect();
        (balance, seats)
    }

    /// Open connections per worker, in worker order.
    pub fn open_connections(&self) -> Vec<usize> {
        self.open
            .iter()
            .map(|n| n.load(Ordering::Relaxed))
            .collect()
    }

    /// The worker that should serve a connection `me` accepted, if not `me`.
    fn hand_over_to(&self, me: usize) -> Option<usize> {
        let mine = self.open[me].load(Ordering::Relaxed);
        let (least, fewest) = self
            .open
            .iter()
            .map(|n| n.load(Ordering::Relaxed))
            .enumerate()
            .min_by_key(|&(_, n)| n)?;
        (least != me && mine >= fewest + HAND_OVER_MARGIN).then_some(least)
    }

    fn guard(self: &Arc<Self>, index: usize) -> ConnGuard {
        ConnGuard {
            balance: self.clone(),
            index,
        }
    }
}

impl idemgate_core::metrics::WorkerConnections for Balance {
    fn open_connections(&self) -> Vec<usize> {
        Balance::open_connections(self)
    }
}

impl Seat {
    /// Where a connection this worker accepted is served: here (the stream
    /// comes back with its guard) or handed to a less loaded worker (`None`).
    pub fn place(&self, stream: TcpStream, peer: SocketAddr) -> Option<(TcpStream, ConnGuard)> {
        let balance = &self.balance;
        if let Some(to) = balance.hand_over_to(self.index) {
            // Deregister from this worker's event loop; the receiving worker
            // registers it with its own.
            let stream = match stream.into_std() {
                Ok(stream) => stream,
                Err(e) => {
                    // Nothing was read from it, so closing it loses nothing.
                    tracing::warn!(%peer, error = %e, layer = "server", "handing a connection over failed; closed");
                    return None;
                }
            };
            // Count it against the receiver now, so that the next accept
            // already sees the new balance.
            balance.open[to].fetch_add(1, Ordering::Relaxed);
            match balance.inboxes[to].send(Handed { stream, peer }) {
                Ok(()) => return None,
                Err(mpsc::error::SendError(handed)) => {
                    // That worker has stopped (shutdown): serve it here.
                    balance.open[to].fetch_sub(1, Ordering::Relaxed);
                    let stream = TcpStream::from_std(handed.stream).ok()?;
                    return Some(self.keep(stream));
                }
            }
        }
        Some(self.keep(stream))
    }

    fn keep(&self, stream: TcpStream) -> (TcpStream, ConnGuard) {
        self.balance.open[self.index].fetch_add(1, Ordering::Relaxed);
        (stream, self.balance.guard(self.index))
    }

    /// The next connection another worker handed over (already counted
    /// here). Pending forever once every sender is gone.
    pub async fn handed(&mut self) -> (TcpStream, SocketAddr, ConnGuard) {
        loop {
            let Some(Handed { stream, peer }) = self.inbox.recv().await else {
                return std::future::pending().await;
            };
            let guard = self.balance.guard(self.index);
            match TcpStream::from_std(stream) {
                Ok(stream) => return (stream, peer, guard),
                // Registration failed (the event loop is out of resources):
                // the guard uncounts it, the connection closes unread.
                Err(e) => {
                    tracing::warn!(%peer, error = %e, layer = "server", "a handed-over connection could not be registered; closed")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_hands_over_only_past_the_margin() {
        let (balance, _seats) = Balance::new(3);
        assert_eq!(balance.hand_over_to(0), None, "all idle: keep it");
        balance.open[0].store(1, Ordering::Relaxed);
        assert_eq!(balance.hand_over_to(0), None, "one ahead: keep it");
        balance.open[0].store(2, Ordering::Relaxed);
        balance.open[1].store(1, Ordering::Relaxed);
        assert_eq!(balance.hand_over_to(0), Some(2), "to the least loaded");
        assert_eq!(balance.hand_over_to(2), None, "the least loaded keeps it");
    }

    #[tokio::test]
    async fn a_burst_of_connections_ends_up_even() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (balance, mut seats) = Balance::new(2);
        let mut kept = Vec::new();
        let mut clients = Vec::new();
        // Worker 0 accepts all 40; it keeps about half.
        for _ in 0..40 {
            clients.push(std::net::TcpStream::connect(addr).unwrap());
            let (stream, peer) = listener.accept().await.unwrap();
            if let Some(k) = seats[0].place(stream, peer) {
                kept.push(k);
            }
        }
        let open = balance.open_connections();
        assert!(open[0].abs_diff(open[1]) <= HAND_OVER_MARGIN, "{open:?}");
        let mut handed = Vec::new();
        for _ in 0..open[1] {
            handed.push(seats[1].handed().await);
        }
        assert_eq!(kept.len() + handed.len(), 40);
        drop(kept);
        drop(handed);
        assert_eq!(balance.open_connections(), vec![0, 0]);
    }
}
