//! The deliveries one broker session has started, and how they end with
//! it: the shape the AMQP, JetStream and Redis Streams sessions share.

use std::future::Future;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// The deliveries one broker session started, the shape every session
/// shares. A stop cancels them (they finish and acknowledge within the
/// grace), and so does the session's end: their acks can only fail with
/// the connection, so a delivery that waits in process (store away, a copy
/// elsewhere) stops waiting; its holder, if it claimed, still sees the
/// claim through.
pub(crate) struct Deliveries {
    running: JoinSet<()>,
    session: CancellationToken,
}

impl Deliveries {
    /// None yet, for a session that ends with `stop`.
    pub(crate) fn new(stop: &CancellationToken) -> Deliveries {
        Deliveries {
            running: JoinSet::new(),
            session: stop.child_token(),
        }
    }

    /// What a delivery of this session watches to stop waiting.
    pub(crate) fn session(&self) -> &CancellationToken {
        &self.session
    }

    /// Runs `delivery` beside the session.
    pub(crate) fn spawn(&mut self, delivery: impl Future<Output = ()> + Send + 'static) {
        self.running.spawn(delivery);
    }

    /// Waits until a delivery finishes, and never while none runs: the
    /// branch of a session's `select!` that keeps the set small.
    pub(crate) async fn one_done(&mut self) {
        if self.running.join_next().await.is_none() {
            std::future::pending::<()>().await;
        }
    }

    /// Forgets the deliveries that have finished.
    pub(crate) fn reap(&mut self) {
        while self.running.try_join_next().is_some() {}
    }

    /// Ends the session: after a stop, the deliveries in hand finish
    /// within `grace` (the broker delivers the rest again: `then` says
    /// how, in the warning); after a broken session, they go on in the
    /// background — their holders see their claims through; their acks
    /// fail with the connection.
    pub(crate) async fn end(mut self, stopped: bool, grace: Duration, consumer: &str, then: &str) {
        if !stopped {
            self.session.cancel();
            self.running.detach_all();
            return;
        }
        let finish = async { while self.running.join_next().await.is_some() {} };
        if tokio::time::timeout(grace, finish).await.is_err() {
            tracing::warn!(consumer = %consumer, left = self.running.len(), then, layer = "consumer", "shutdown grace over");
        }
    }
}
