//! [`Disposition`]: what becomes of a delivered message at its broker.

use std::time::Duration;

use idemgate_core::metrics::MessageOutcome;

/// What to do with a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disposition {
    /// Acknowledge: the outcome is durable.
    Ack(MessageOutcome),
    /// An upstream attempt failed (it counts towards `max_deliveries`):
    /// leave it to the broker to deliver again after the delay.
    Retry(Duration),
    /// Nothing was attempted upstream — the store is unreachable, a copy
    /// is in flight, the outcome is not recorded yet: try again in this
    /// process after the delay (see `Deliverer::decide`).
    Wait(Duration),
    /// Move it to the dead letters (then acknowledge it), for `reason`,
    /// as the copy named `copy` (`x-idemgate-copy`): this instance holds
    /// the message's copy lease as `holder` (`Deliverer::while_copying`
    /// keeps it).
    DeadLetter {
        /// Why, as logged and carried by the copy Idemgate publishes.
        reason: String,
        /// Which copy this is (empty until the copy lease names it).
        copy: String,
        /// The id this instance holds the copy lease under (empty until the
        /// lease is won).
        holder: String,
    },
}

impl Disposition {
    /// A dead letter as [`Deliverer::deliver`] decides it, before the copy
    /// lease names its copy.
    pub(crate) fn dead_letter(reason: String) -> Disposition {
        Disposition::DeadLetter {
            reason,
            copy: String::new(),
            holder: String::new(),
        }
    }

    /// Its name in a message's span.
    pub fn name(&self) -> &'static str {
        match self {
            Disposition::Ack(outcome) => outcome.as_str(),
            Disposition::Retry(_) => "retry",
            Disposition::Wait(_) => "wait",
            Disposition::DeadLetter { .. } => "dead_letter",
        }
    }
}
