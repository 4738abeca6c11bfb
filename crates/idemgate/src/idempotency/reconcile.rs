//! Reconciliation: asking the upstream whether an uncertain action ran.
//!
//! An `uncertain` record means the request may have executed and no answer
//! came back (the lost-ACK incident). Forwarding the retry with the same key
//! leaves the decision to the upstream's own state check; a route with a
//! status endpoint (`reconcile_path`) can do better: before the retry is
//! forwarded, the engine asks that endpoint, by the stable key, whether the
//! action ran. `200` means it did: that answer becomes the record's outcome
//! and every retry replays it. `404` means it did not: the retry is
//! forwarded. Anything else (another status, a timeout, a refused
//! connection) proves nothing, and the record stays uncertain.
//!
//! The engine asks only from a held claim (so one question at a time per
//! key) or, while an uncertain record's hold still runs, to answer a retry
//! from a `200` early; a `404` then still waits out the hold, because a
//! copy that has not committed yet may still be running.

use std::time::Duration;

use axum::body::Body;
use futures_util::future::BoxFuture;
use http::Response;
use idemgate_store::{RecordKey, RecordState, Store, StoreError, StoredResponse};

use super::answer::{AnswerBudget, AnswerShare, CAPTURE_WAIT, Captured, capture};
use super::stable_key::{StableKey, stable_key};

/// What the upstream's status endpoint said.
#[derive(Debug)]
pub enum Reconciled {
    /// `200`: the action ran; this answer is its outcome (its body is read
    /// and stored by the engine).
    Ran(Response<Body>),
    /// `404`: the action did not run.
    NotRun,
    /// Anything else: nothing is known (the reason, for the log).
    Unknown(String),
}

/// Asks an upstream whether the action behind a stable key ran.
pub trait Reconcile: Send + Sync + 'static {
    /// Asks once, within the implementation's own bound.
    fn ask<'a>(&'a self, key: &'a StableKey, request_id: &'a str) -> BoxFuture<'a, Reconciled>;
}

/// A status endpoint's `200`, read whole within `deadline` as the outcome
/// to store (without its body past `cap`), counted in `share`.
pub(crate) async fn stored_answer(
    answer: Response<Body>,
    request_id: &str,
    cap: usize,
    deadline: Duration,
    share: &mut AnswerShare,
) -> Result<StoredResponse, String> {
    let (parts, body) = answer.into_parts();
    let until = tokio::time::Instant::now() + (deadline / 2).min(CAPTURE_WAIT);
    let captured = tokio::time::timeout(deadline, capture(body, cap, share, until))
        .await
        .map_err(|_| "the status endpoint's body did not arrive in time".to_owned())?;
    // A gRPC route's status endpoint may answer as its method would, its
    // status in trailers: they are kept for the replay.
    let (body, trailers) = match captured {
        Captured::Whole(bytes, trailers) => (
            Some(bytes),
            super::outcome::storable_trailers(trailers.as_ref()),
        ),
        Captured::TooLarge(..) => (None, Vec::new()),
        Captured::Broken(cause) => return Err(cause),
    };
    Ok(StoredResponse {
        status: parts.status.as_u16(),
        headers: super::outcome::storable_headers(&parts.headers, body.is_some()),
        trailers,
        body_kept: body.is_some(),
        body: body.unwrap_or_default(),
        request_id: request_id.to_owned(),
    })
}

/// What an operator's reconciliation of an uncertain record found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reconciliation {
    /// The action ran: its answer (this status) is now the record's
    /// outcome, replayed to every retry.
    Recorded(u16),
    /// The action did not run: the record stays uncertain until its hold
    /// ends, and the next retry is forwarded (a copy that has not committed
    /// yet may still be on its way).
    NotRun,
    /// The status endpoint proved nothing; the record stays uncertain.
    Failed(String),
    /// The record is not uncertain (any more): nothing to do.
    NotUncertain,
}

/// Asks `reconcile` about the uncertain record `key`, as an operator does
/// (the dashboard's reconcile action), and records its answer when the
/// action ran — only while the record is still uncertain at the epoch that
/// was read, so a retry that took it over meanwhile is never overwritten.
pub async fn reconcile_uncertain(
    store: &Store,
    reconcile: &dyn Reconcile,
    key: &RecordKey,
    cap: usize,
    budget: &AnswerBudget,
    deadline: Duration,
) -> Result<Reconciliation, StoreError> {
    let Some(record) = store.get(key).await? else {
        return Ok(Reconciliation::NotUncertain);
    };
    if record.state != RecordState::Uncertain {
        return Ok(Reconciliation::NotUncertain);
    }
    let request_id = idemgate_core::request_id::new_id();
    let request_id = request_id.to_str().unwrap_or_default();
    match reconcile.ask(&stable_key(key), request_id).await {
        Reconciled::NotRun => Ok(Reconciliation::NotRun),
        Reconciled::Unknown(why) => Ok(Reconciliation::Failed(why)),
        Reconciled::Ran(answer) => {
            // Not a claim: nothing reserved, the answer is counted as it
            // arrives.
            let mut share = AnswerShare::empty(budget);
            let stored = match stored_answer(answer, request_id, cap, deadline, &mut share).await {
                Ok(stored) => stored,
                Err(why) => return Ok(Reconciliation::Failed(why)),
            };
            let status = stored.status;
            let recorded = store
                .complete_reconciled(
                    key,
                    record.epoch,
                    &record.fingerprint,
                    &stored,
                    record.expires_at_ms,
                )
                .await?;
            Ok(match recorded {
                true => Reconciliation::Recorded(status),
                false => Reconciliation::NotUncertain,
            })
        }
    }
}
