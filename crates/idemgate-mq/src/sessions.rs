//! The consumers' lives: each one's broker session kept connected (with
//! backoff), all of them stopped together.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
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
