//! A duplicate's wait (`on_concurrent = "wait"`): for this process's
//! holder to publish its outcome, or for the store to announce that a
//! record held on another instance settled, at most a safety poll apart.

use std::time::Instant;

use idemgate_core::metrics::WakeUp;

use super::super::holder::Published;
use super::{CROSS_INSTANCE_SAFETY_POLL, Engine, Ticket, UNANNOUNCED_POLL, WAIT_SAFETY_POLL};

impl Engine {
    /// A duplicate's wait: for this process's holder of the key to publish
    /// its outcome, or — when the holder runs elsewhere (another instance)
    /// — for the store to announce that the record settled, or at most a
    /// safety poll. `None` means claim again.
    pub(super) async fn wait_turn(
        &self,
        ticket: &Ticket,
        until: Instant,
        watch: &mut Option<idemgate_store::settle::Watch>,
    ) -> Option<Published> {
        let Some(mut outcome) = self.holders.subscribe(&ticket.key, &ticket.fingerprint) else {
            // No holder here: it runs on another instance (or has just
            // finished). Registered before the flag is set, so that no
            // announcement falls between the two.
            let watch = watch.get_or_insert_with(|| self.store.watch(&ticket.key));
            match self.store.flag_watched(&ticket.key, watch).await {
                // Settled since the claim: claim again now.
                Ok(false) => return None,
                Ok(true) => {}
                // Flagging failed (store away): the safety poll still runs.
                Err(e) => {
                    tracing::debug!(route = %ticket.key.route, key = %ticket.key.escaped(), error = %e, layer = "engine", "flagging a waited-for record failed; polling");
                }
            }
            let poll = match self.store.channel() {
                idemgate_store::settle::Channel::Local => UNANNOUNCED_POLL,
                _ => CROSS_INSTANCE_SAFETY_POLL,
            };
            let safety = (Instant::now() + poll).min(until);
            let by = match tokio::time::timeout_at(safety.into(), watch.settled()).await {
                Ok(()) => WakeUp::Announcement,
                Err(_) => WakeUp::Poll,
            };
            self.metrics.woken(by);
            return None;
        };
        let published = outcome.wait_for(|o| o.is_some());
        let safety = (Instant::now() + WAIT_SAFETY_POLL).min(until);
        let (seen, by) = match tokio::time::timeout_at(safety.into(), published).await {
            Ok(Ok(seen)) => (seen.clone(), WakeUp::Holder),
            // The holder is gone (its task ended): claim again.
            Ok(Err(_)) => (None, WakeUp::Holder),
            Err(_) => (None, WakeUp::Poll),
        };
        self.metrics.woken(by);
        seen
    }
}
