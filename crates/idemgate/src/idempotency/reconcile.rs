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

use axum::body::Body;
use futures_util::future::BoxFuture;
use http::Response;

use super::stable_key::StableKey;

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
