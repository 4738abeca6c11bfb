//! The consumers' lives: each one's broker session kept connected (with
//! backoff), all of them stopped together.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;

use crate::{Deliverer, Source, redact};

/// First pause before reconnecting to a broker; it doubles.
pub const RECONNECT_START: Duration = Duration::from_millis(100);
/// Longest pause between two connection attempts.
pub const RECONNECT_MAX: Duration = Duration::from_secs(5);

/// The running consumers of a gateway.
pub struct Consumers {
    tasks: Vec<JoinHandle<()>>,
}

impl Consumers {
    /// Starts one task per consumer; each stops consuming when `stop` is
    /// cancelled and finishes what it holds within its grace.
    pub fn spawn(deliverers: Vec<Arc<Deliverer>>, stop: CancellationToken) -> Self {
        let tasks = deliverers
            .into_iter()
            .map(|d| {
                let signal = stop.clone();
                tokio::spawn(async move {
                    match d.settings().source.clone() {
                        #[cfg(feature = "amqp")]
                        Source::Amqp {
                            url,
                            queue,
                            dead_letter,
                        } => crate::amqp::run(d, url, queue, dead_letter, signal).await,
                        #[cfg(feature = "nats")]
                        Source::Nats {
                            url,
                            stream,
                            durable,
                            dead_letter,
                        } => crate::nats::run(d, url, stream, durable, dead_letter, signal).await,
                        #[cfg(feature = "redis-streams")]
                        Source::Redis(source) => crate::redis_streams::run(d, source, signal).await,
                        #[allow(unreachable_patterns)]
                        other => tracing::error!(
                            consumer = %d.settings().name,
                            source = ?other,
                            layer = "consumer",
                            "this build has no client for the consumer's broker (a cargo feature of idemgate-mq is off)"
                        ),
                    }
                })
            })
            .collect();
        Consumers { tasks }
    }

    /// Waits for every consumer to stop.
    pub async fn join(self) {
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

/// Runs `session` (connect, consume, return why it ended) again and again
/// until `stop`, pausing with backoff between tries; a session that got
/// connected starts the backoff over. `from` names the queue or stream in
/// logs.
pub(crate) async fn keep_connected<S, F>(
    d: &Deliverer,
    url: &str,
    from: &str,
    stop: &CancellationToken,
    mut session: S,
) where
    S: FnMut() -> F,
    F: std::future::Future<Output = Result<(), String>>,
{
    let name = &d.settings().name;
    let mut failures = 0u32;
    loop {
        let connects = d.counters().connects();
        let started = tokio::time::Instant::now();
        let ended = session().await;
        if stop.is_cancelled() {
            return;
        }
        // Backoff starts over only after a session that stayed up: a broker
        // that accepts and drops at once must not be hammered (and logged)
        // every 100 ms.
        if d.counters().connects() != connects && started.elapsed() >= RECONNECT_MAX {
            failures = 0;
        }
        let why = ended
            .err()
            .unwrap_or_else(|| "the session ended".to_owned());
        d.counters().set_disconnected(why.clone());
        let pause = backoff(failures);
        failures = failures.saturating_add(1);
        // The first failure in a row is a warning, then about one a
        // minute: a broker that is down for hours must not flood the log.
        if failures == 1 || failures.is_multiple_of(12) {
            tracing::warn!(consumer = %name, broker = %redact(url), from = %from, error = %why, retry_in = ?pause, layer = "consumer", "broker unreachable or connection lost; reconnecting");
        } else {
            tracing::debug!(consumer = %name, error = %why, retry_in = ?pause, layer = "consumer", "reconnecting");
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

/// The reconnect pause after `failures` failed attempts in a row.
pub(crate) fn backoff(failures: u32) -> Duration {
    RECONNECT_START
        .saturating_mul(1 << failures.min(16))
        .min(RECONNECT_MAX)
}

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
