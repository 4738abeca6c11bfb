//! A claim over an attempt that may have acted: the upstream's status
//! endpoint is asked before anything is forwarded again, and a retry
//! within an uncertain record's hold is refused (or answered from that
//! endpoint).

use std::time::Duration;

use axum::body::Body;
use http::Response;
use idemgate_store::{RecordKey, StoredResponse};

use super::super::answer::AnswerShare;
use super::super::outcome::replay;
use super::super::policy::Policy;
use super::super::reconcile::Reconciled;
use super::super::stable_key::stable_key;
use super::{Engine, IdempotencyError, Ticket};

impl Engine {
    /// A won claim over an attempt that may have acted: asks the upstream
    /// first (where the route can). `None`: forward the request.
    pub(super) async fn reconcile_held<P: Policy>(
        &self,
        ticket: &Ticket,
        fingerprint: &str,
        epoch: i64,
        expires_at_ms: i64,
        share: &mut AnswerShare,
    ) -> Option<Response<Body>> {
        let reconcile = self.settings.reconcile.as_ref()?;
        let key = &ticket.key;
        let asked = reconcile.ask(&stable_key(key), &ticket.request_id).await;
        match asked {
            Reconciled::NotRun => {
                tracing::info!(route = %key.route, key = %key.escaped(), layer = P::LAYER, "reconciliation: the action did not run; forwarding the retry");
                None
            }
            Reconciled::Ran(answer) => {
                let stored = match self.stored_answer(answer, &ticket.request_id, share).await {
                    Ok(stored) => stored,
                    Err(why) => {
                        return Some(
                            self.reconcile_failed::<P>(key, epoch, why, expires_at_ms)
                                .await,
                        );
                    }
                };
                let recorded = self
                    .store
                    .complete(key, epoch, fingerprint, &stored, expires_at_ms)
                    .await;
                tracing::info!(route = %key.route, key = %key.escaped(), layer = P::LAYER, recorded = ?recorded.as_ref().ok(), "reconciliation: the action ran; its answer is the outcome");
                // Not recorded (store away): the claim's lease runs out and
                // the next retry asks again; the action is not run again.
                Some(replay(stored, expires_at_ms))
            }
            Reconciled::Unknown(why) => Some(
                self.reconcile_failed::<P>(key, epoch, why, expires_at_ms)
                    .await,
            ),
        }
    }

    /// The status endpoint proved nothing: the record goes back to
    /// uncertain, with no hold (the attempt it replaced has had its time);
    /// the next retry asks again.
    pub(super) async fn reconcile_failed<P: Policy>(
        &self,
        key: &RecordKey,
        epoch: i64,
        why: String,
        expires_at_ms: i64,
    ) -> Response<Body> {
        let _ = self.store.mark_uncertain(key, epoch, Duration::ZERO).await;
        self.refuse::<P>(
            IdempotencyError::ReconcileFailed(why),
            Some(key),
            expires_at_ms,
        )
    }

    /// A status endpoint's `200`, read whole (bounded by the upstream's
    /// timeout) as the outcome to store.
    pub(super) async fn stored_answer(
        &self,
        answer: Response<Body>,
        request_id: &str,
        share: &mut AnswerShare,
    ) -> Result<StoredResponse, String> {
        super::super::reconcile::stored_answer(
            answer,
            request_id,
            self.settings.max_stored_body_bytes,
            self.settings.wait_limit,
            share,
        )
        .await
    }

    /// A retry of an uncertain record within its hold: `502` with
    /// `Retry-After` — unless the upstream's status endpoint says the
    /// action ran, whose answer is then recorded and replayed at once.
    pub(super) async fn during_hold<P: Policy>(
        &self,
        ticket: &Ticket,
        fingerprint: &str,
        epoch: i64,
        retry_after: Duration,
        expires_at_ms: i64,
        share: &mut AnswerShare,
    ) -> Response<Body> {
        let key = &ticket.key;
        if let Some(reconcile) = &self.settings.reconcile
            && let Reconciled::Ran(answer) =
                reconcile.ask(&stable_key(key), &ticket.request_id).await
            && let Ok(stored) = self.stored_answer(answer, &ticket.request_id, share).await
        {
            let recorded = self
                .store
                .complete_reconciled(key, epoch, fingerprint, &stored, expires_at_ms)
                .await;
            tracing::info!(route = %key.route, key = %key.escaped(), layer = P::LAYER, recorded = ?recorded.as_ref().ok(), "reconciliation: the action ran; its answer is the outcome");
            return replay(stored, expires_at_ms);
        }
        self.refuse::<P>(
            IdempotencyError::Uncertain {
                retry_after,
                in_process: self.settings.in_process,
            },
            Some(key),
            expires_at_ms,
        )
    }
}
