//! Dead letters made once across instances: a message's dead-letter copy
//! is published by the one instance that holds its copy lease in the
//! store, renewed while its broker has not confirmed the copy.

use std::time::Duration;

use idemgate_store::DeadLetterClaim;
use idemgate_store::key_ref;

use crate::key::{delivery_row, keyless_mark};
use crate::{Deliverer, Message};

/// Why a dead-letter copy was not stored.
#[derive(Debug)]
pub enum CopyFailure {
    /// The broker answered no (unroutable, refused, no such stream): the
    /// copy is not stored.
    Refused(String),
    /// No answer (the connection went): the copy may have been stored.
    Unknown(String),
}

/// How long one instance holds the right to publish a message's
/// dead-letter copy, at least (four store timeouts when longer), renewed
/// every third of it while its broker has not confirmed the copy. Another
/// instance that decided the same message's end meanwhile waits; a holder
/// that died is replaced after this long.
pub const DEAD_LETTER_LEASE: Duration = Duration::from_secs(30);

impl Deliverer {
    /// Says, for every instance, that `message`'s dead-letter copy is
    /// stored: a redelivery (its ack was lost) is then acknowledged without
    /// a second copy. A store that fails is tried again for half a copy
    /// lease — the lease, renewed at most a third of it ago, still keeps
    /// other instances from copying meanwhile. Past that, best effort:
    /// without the record a redelivery makes a second copy (under the same
    /// id), never a lost message.
    pub(crate) async fn dead_lettered(&self, message: &Message) {
        let Some(key) = self.dead_letter_row(message) else {
            return;
        };
        let sql = &self.deliveries;
        let until = tokio::time::Instant::now() + self.copy_lease() / 2;
        let pause = self
            .settings
            .retry_delay
            .clamp(Duration::from_millis(100), Duration::from_secs(1));
        loop {
            let e = match sql.mark_dead_lettered(&key).await {
                Ok(()) => return,
                Err(e) => e,
            };
            if tokio::time::Instant::now() + pause >= until {
                tracing::warn!(consumer = %self.settings.name, key = %key_ref(&key), error = %e, layer = "consumer", "the dead-letter copy is stored but could not be recorded; a redelivery would make a second copy");
                return;
            }
            tokio::time::sleep(pause).await;
        }
    }

    /// Gives back `message`'s copy lease: the broker refused the copy
    /// `holder` was publishing, so the next try (on any instance) need not
    /// wait for the lease to lapse. Not after a copy that may have been
    /// stored (a lost confirm): that lease lapses, and the copy is made
    /// again under the same id.
    pub(crate) async fn dead_letter_refused(&self, message: &Message, holder: &str) {
        let Some(key) = self.dead_letter_row(message) else {
            return;
        };
        let _ = self.deliveries.release_dead_letter(&key, holder).await;
    }

    /// Makes `message`'s dead-letter copy with `publish` (until its broker
    /// confirms or refuses it) as the copy lease's `holder`, then records
    /// it for every instance; the caller acknowledges the original after.
    /// A refusal gives the lease back; a copy that may have landed (a lost
    /// confirm) keeps it until it lapses.
    pub async fn copy_dead_letter<F>(
        &self,
        message: &Message,
        holder: &str,
        publish: F,
    ) -> Result<(), String>
    where
        F: std::future::Future<Output = Result<(), CopyFailure>>,
    {
        match self.while_copying(message, holder, publish).await {
            Ok(()) => {
                // Recorded before the ack: if the ack is lost, the
                // redelivery is acknowledged without a second copy, on any
                // instance.
                self.dead_lettered(message).await;
                Ok(())
            }
            Err(CopyFailure::Refused(e)) => {
                self.dead_letter_refused(message, holder).await;
                Err(e)
            }
            Err(CopyFailure::Unknown(e)) => Err(e),
        }
    }

    /// Runs `publish` while keeping `holder`'s copy lease on `message`, so
    /// no other instance takes it over from a live, slow publisher. A
    /// publish is never cut short here: given up, it could still land
    /// after the lease passed on. The connection's end ends it, and so does
    /// a stop once its grace is over (the lease then lapses).
    pub(crate) async fn while_copying<F: std::future::Future>(
        &self,
        message: &Message,
        holder: &str,
        publish: F,
    ) -> F::Output {
        // Only copies are published (a `dlx` rejection has no lease).
        let Some(row) = self.dead_letter_row(message) else {
            return publish.await;
        };
        let lease = self.copy_lease();
        let mut renew =
            tokio::time::interval_at(tokio::time::Instant::now() + lease / 3, lease / 3);
        tokio::pin!(publish);
        loop {
            tokio::select! {
                done = &mut publish => return done,
                _ = renew.tick() => {
                    let sql = &self.deliveries;
                    if !matches!(sql.renew_dead_letter(&row, holder, lease).await, Ok(true)) {
                        tracing::warn!(consumer = %self.settings.name, key = %key_ref(&row), layer = "consumer", "the dead-letter copy's lease could not be renewed while its broker has not confirmed it; another instance may make the copy again, under the same copy id");
                    }
                }
            }
        }
    }

    /// How long a copy lease runs before it lapses: a renewal must fit in
    /// it whatever the store's timeout.
    pub(crate) fn copy_lease(&self) -> Duration {
        DEAD_LETTER_LEASE.max(self.deliveries.timeout() * 4)
    }

    /// Takes `message`'s copy lease as `holder`: the copy's id when this
    /// instance is to publish it. A message nothing names alone (no key,
    /// no id) and a rejection the broker routes (`dlx`) need no lease.
    pub(crate) async fn lease_dead_letter(
        &self,
        message: &Message,
        holder: &str,
    ) -> Result<DeadLetterClaim, ()> {
        let row = match self.dead_letter_row(message) {
            Some(row) if self.settings.source.copies_dead_letters() => row,
            _ => return Ok(DeadLetterClaim::Won(holder.to_owned())),
        };
        self.deliveries
            .claim_dead_letter(&row, holder, self.copy_lease())
            .await
            .map_err(|_| ())
    }

    /// The store row that keeps `message`'s dead-letter mark and lease:
    /// its delivery row, or a keyless message's own mark. `None`: nothing
    /// names this message alone, so a redelivery after a lost ack makes a
    /// second copy rather than risk another message's loss.
    pub(crate) fn dead_letter_row(&self, message: &Message) -> Option<String> {
        match self.key_of(message) {
            Ok(key) => Some(delivery_row(key, message)),
            Err(_) => keyless_mark(message),
        }
    }
}
