//! [`Verdict`]: what the engine did with a request, beside the answer it
//! gives. The router counts it, a message consumer acknowledges, retries or
//! dead-letters by it; neither reads markers or reason strings off the
//! response.

use axum::body::Body;
use http::Response;
use idemgate_core::error::{ProblemReason, Reason};
use idemgate_core::metrics::Outcome;

/// What happened to a protected request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// Forwarded, and its outcome was durable in the store before the
    /// answer was handed on.
    Recorded,
    /// Forwarded, with an outcome to record whose first write did not land
    /// (the database away, or the record taken over meanwhile): the holder
    /// keeps writing while it holds the claim; the next try finds the
    /// record.
    Recording,
    /// Forwarded (or it never left), and the outcome releases the claim —
    /// a 5xx, a "try again" status, a request the upstream never received:
    /// a retry executes again.
    Released,
    /// Forwarded, and no whole answer came back (timeout, reset, a cut
    /// body): the record is `uncertain`.
    Uncertain,
    /// Answered from the record: the first request's stored outcome (or
    /// what the upstream's status endpoint said it did).
    Replayed,
    /// A duplicate while the first request still runs (`409`), or while a
    /// copy of an uncertain one may still run upstream (`502`).
    InFlight,
    /// Not protected (a key route without a key): forwarded as it came.
    Bypassed,
    /// The store could not be reached: nothing was forwarded (`503`).
    StoreDown,
    /// Refused before anything was forwarded, for this reason.
    Refused(Reason),
}

impl Verdict {
    /// The `idemgate_requests_total` outcome this verdict counts as.
    pub fn outcome(self, response: &Response<Body>) -> Outcome {
        match self {
            Verdict::Replayed => Outcome::Replayed,
            Verdict::InFlight => Outcome::Conflict,
            Verdict::Refused(Reason::IdempotencyKeyReused | Reason::BusinessKeyReused) => {
                Outcome::Mismatch
            }
            Verdict::Refused(reason) if reason.status().is_server_error() => Outcome::Error,
            Verdict::Refused(_) => Outcome::Rejected,
            Verdict::StoreDown => Outcome::Error,
            Verdict::Recorded
            | Verdict::Recording
            | Verdict::Released
            | Verdict::Uncertain
            | Verdict::Bypassed => match response.extensions().get::<ProblemReason>() {
                // The gateway answered for an upstream that failed.
                Some(_) if response.status().is_server_error() => Outcome::Error,
                _ => Outcome::Forwarded,
            },
        }
    }

    /// The verdict the engine set on `response`, or what a response without
    /// one stands for: a problem the engine answered, or a forward.
    pub(crate) fn take(response: &mut Response<Body>) -> Verdict {
        if let Some(verdict) = response.extensions_mut().remove::<Verdict>() {
            return verdict;
        }
        match response.extensions().get::<ProblemReason>() {
            Some(ProblemReason(Reason::StoreUnavailable)) => Verdict::StoreDown,
            Some(ProblemReason(reason)) => Verdict::Refused(*reason),
            None => Verdict::Bypassed,
        }
    }
}

/// A request's answer and what the engine did with it.
#[derive(Debug)]
pub struct Answer {
    /// What happened.
    pub verdict: Verdict,
    /// What the client gets.
    pub response: Response<Body>,
}
