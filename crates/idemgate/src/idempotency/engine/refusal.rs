//! The engine's own answers: why it answered a request itself
//! ([`IdempotencyError`]), as the one problem type, with the record's
//! expiry where the answer names one.

use std::time::Duration;

use axum::body::Body;
use http::Response;
use idemgate_core::budget;
use idemgate_core::error::{Problem, Reason};
use idemgate_store::{RecordKey, StoreError};

use super::super::expires::set_expires;
use super::super::outcome::replay;
use super::super::policy::Policy;
use super::super::verdict::Verdict;
use super::Engine;

/// Why the engine answered a request itself.
#[derive(Debug, thiserror::Error)]
pub enum IdempotencyError {
    /// `413`: over the route's body limit.
    #[error("request body over {limit} bytes")]
    BodyTooLarge {
        /// The limit, in bytes.
        limit: u64,
    },
    /// `400`: the body could not be read.
    #[error("request body unreadable: {0}")]
    BadBody(String),
    /// `408`: the body did not arrive within the deadline.
    #[error("request body not received within {0:?}")]
    BodyTimeout(Duration),
    /// `501`: a gRPC call that sent more than one message (client or
    /// bidirectional streaming): a stream cannot be replayed.
    #[error("a streaming gRPC call ({0} messages) on a protected route")]
    StreamingCall(usize),
    /// `422`: the key was used for a different request.
    #[error("key reused for a different request")]
    Mismatch,
    /// `422`: a business key redelivered with other `must_match` fields.
    #[error("business key delivered again with other must_match fields")]
    FieldsDiffer,
    /// `409`: the first request with this key still runs.
    #[error("a request with this key is in flight")]
    InFlight {
        /// When to try again.
        retry_after: Duration,
    },
    /// `502`: the first request's outcome is uncertain and a copy may still
    /// run upstream (or, in process, work its handler spawned).
    #[error("the first request's outcome is uncertain; a copy may still run upstream")]
    Uncertain {
        /// When the hold ends.
        retry_after: Duration,
        /// The first request ran in a handler in this process (the
        /// library), not at an upstream.
        in_process: bool,
    },
    /// `502`: the status endpoint could not say whether the action ran.
    #[error("the upstream's status endpoint could not say whether the action ran: {0}")]
    ReconcileFailed(String),
    /// `410`: the record is past its retention, within its tombstone.
    #[error("the key's record has expired (tombstone)")]
    Expired,
    /// `503`: the process's budget of buffered bodies is full.
    #[error("the process holds server.max_buffered_bytes of request bodies")]
    BodyBudget,
    /// `503`: the process's budget of answers held until their record is
    /// written is full.
    #[error("the process holds server.max_captured_bytes of answers awaiting their record")]
    AnswerBudget,
    /// `503`: the process's, or this connection's, budget of claims is full.
    #[error("no claim can be made now: {0:?} limit reached")]
    Exhausted(budget::Exhausted),
    /// `503`: the store could not answer.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl Engine {
    pub(super) async fn replay_or_refuse<P: Policy>(
        &self,
        key: &RecordKey,
        fingerprint: &str,
        refusal: Problem,
    ) -> Response<Body> {
        let record = match self.store.get(key).await {
            Ok(Some(record)) => record,
            Ok(None) => {
                return refusal
                    .logged(P::LAYER, "expired token, no stored outcome")
                    .into_response();
            }
            Err(e) => return self.refuse_unrecorded::<P>(e.into(), key),
        };
        let past_retention = record.expires_at_ms <= record.read_at_ms;
        match (record.fingerprint == fingerprint, record.response) {
            (true, Some(stored)) if !past_retention => replay(stored, record.expires_at_ms),
            (true, _) if past_retention && record.forgotten_at_ms > record.read_at_ms => {
                self.refuse::<P>(IdempotencyError::Expired, Some(key), record.forgotten_at_ms)
            }
            _ => refusal
                .logged(P::LAYER, "expired token, no stored outcome")
                .into_response(),
        }
    }

    /// A refusal that names a record: logged with its key, and saying until
    /// when the key is remembered.
    pub(super) fn refuse<P: Policy>(
        &self,
        error: IdempotencyError,
        key: Option<&RecordKey>,
        expires_at_ms: i64,
    ) -> Response<Body> {
        let mut response = self.refusal::<P>(error, key);
        set_expires(response.headers_mut(), expires_at_ms);
        response
    }

    /// A refusal about a record the gateway could not read (store away).
    pub(super) fn refuse_unrecorded<P: Policy>(
        &self,
        error: IdempotencyError,
        key: &RecordKey,
    ) -> Response<Body> {
        self.refusal::<P>(error, Some(key))
    }

    pub(super) fn refusal<P: Policy>(
        &self,
        error: IdempotencyError,
        key: Option<&RecordKey>,
    ) -> Response<Body> {
        let mut problem = Problem::from(&error);
        if let Some(key) = key {
            problem = problem.logged(P::LAYER, format!("key {}: {error}", key.escaped()));
        }
        let mut response = problem.into_response();
        if let IdempotencyError::InFlight { .. } | IdempotencyError::Uncertain { .. } = error {
            response.extensions_mut().insert(Verdict::InFlight);
        }
        response
    }
}

/// Whole seconds, rounded up, at least one (a `Retry-After`).
fn secs_up(d: Duration) -> u64 {
    d.as_secs_f64().ceil().max(1.0) as u64
}

/// Its answer to the client: the one problem type every module maps to.
impl From<&IdempotencyError> for idemgate_core::error::Problem {
    fn from(e: &IdempotencyError) -> Self {
        use IdempotencyError as E;
        match e {
            E::BodyTooLarge { limit } => idemgate_core::error::Problem::new(Reason::BodyTooLarge)
            .detail(format!(
                "request bodies are limited to {limit} bytes; nothing was forwarded or stored"
            )),
            E::BadBody(_) => idemgate_core::error::Problem::new(Reason::BadRequestBody),
            E::BodyTimeout(after) => idemgate_core::error::Problem::new(Reason::BodyTimeout)
            .detail(format!(
                "the whole body must arrive within {}s; nothing was forwarded or stored",
                after.as_secs()
            )),
            E::StreamingCall(_) => idemgate_core::error::Problem::new(Reason::StreamingCall)
            .detail("only unary calls can be deduplicated; nothing was claimed or forwarded"),
            E::Mismatch => idemgate_core::error::Problem::new(Reason::IdempotencyKeyReused)
            .detail("use a new key for a new request; a retry must repeat the same method, path, query and body"),
            E::InFlight { retry_after } => idemgate_core::error::Problem::new(Reason::RequestInFlight)
            .detail(format!(
                "retry later with the same key to receive its outcome; the claim is held for at most {}s more",
                retry_after.as_secs_f64().ceil() as u64
            ))
            // The first request usually finishes in milliseconds; the lease
            // only bounds a crashed holder. Ask for an early retry.
            .retry_after(idemgate_core::error::IN_FLIGHT_RETRY_AFTER_SECS),
            E::FieldsDiffer => idemgate_core::error::Problem::new(Reason::BusinessKeyReused)
            .detail("a redelivery must carry the same values in the fields the route lists in must_match; it was not forwarded"),
            E::Uncertain { retry_after, in_process: false } => idemgate_core::error::Problem::new(Reason::OutcomeUncertain)
            .detail(format!(
                "a copy may still be running at the upstream, so nothing is forwarded for {}s more; \
                 then retry with the same key: the retry is forwarded once, with the same key, \
                 for the upstream's own check",
                secs_up(*retry_after)
            ))
            .retry_after(secs_up(*retry_after)),
            E::Uncertain { retry_after, in_process: true } => idemgate_core::error::Problem::new(Reason::OutcomeUncertain)
            .detail(format!(
                "the first request's handler stopped without an answer (it panicked, or ran past \
                 its deadline) and may have acted; work it started (a task it spawned) may still \
                 be running, so the handler is not run again for {}s more; then retry with the \
                 same key: the handler runs once more, with the same key, for its own check",
                secs_up(*retry_after)
            ))
            .retry_after(secs_up(*retry_after)),
            E::ReconcileFailed(_) => idemgate_core::error::Problem::new(Reason::ReconcileFailed)
            .detail("the record stays uncertain and nothing was forwarded; retry with the same key")
            .retry_after(idemgate_core::error::IN_FLIGHT_RETRY_AFTER_SECS),
            E::Expired => idemgate_core::error::Problem::new(Reason::IdempotencyKeyExpired)
            .detail("the request was answered before and its stored answer is no longer kept; it is not executed again — use a new key for a new request"),
            E::BodyBudget => idemgate_core::error::Problem::new(Reason::BuffersExhausted)
            .detail("server.max_buffered_bytes of request bodies are being read or held; nothing was recorded or forwarded, retry shortly")
            .retry_after(idemgate_core::error::IN_FLIGHT_RETRY_AFTER_SECS),
            E::AnswerBudget => idemgate_core::error::Problem::new(Reason::BuffersExhausted)
            .detail("server.max_captured_bytes of answers are held until their records are written; nothing was recorded or forwarded, retry shortly")
            .retry_after(idemgate_core::error::IN_FLIGHT_RETRY_AFTER_SECS),
            E::Exhausted(which) => idemgate_core::error::Problem::new(Reason::ClaimsExhausted)
            .detail(match which {
                budget::Exhausted::Process => {
                    "server.max_claims requests are in progress; nothing was recorded or forwarded, retry shortly"
                }
                budget::Exhausted::Connection => {
                    "this connection left as many requests in progress as it may open streams; nothing was recorded or forwarded, retry on a new connection"
                }
            })
            .retry_after(idemgate_core::error::IN_FLIGHT_RETRY_AFTER_SECS),
            E::Store(store) => idemgate_core::error::Problem::from(store),
        }
    }
}
