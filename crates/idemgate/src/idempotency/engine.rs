//! The engine: scope + key → claim → hold → replay.
//!
//! Ordering is the guarantee:
//! 1. Everything that can refuse a request without the store (policy, body
//!    limit) runs first, so bad input leaves no record.
//! 2. The claim is durable in SQL before the request is forwarded (the
//!    store's `claim`); if the store cannot answer, the request is refused
//!    503 and never forwarded — fail closed.
//! 3. A won claim belongs to a `Holder` (see `super::holder`), in a task
//!    the client cannot cancel: it forwards, renews the lease, receives the
//!    whole response within the upstream's timeout and records the outcome
//!    until it is durable, whether the client is still there or not.
//! 4. The outcome decides the record: a stored status completes it; a 5xx,
//!    408/409/425/429 or a request that never left releases it (the retry
//!    executes again); a request that reached the upstream without an answer
//!    coming back (timeout, reset, body cut) marks it uncertain, and the next
//!    retry is forwarded again — one at a time, with the same key, so the
//!    upstream's own state check decides.
//! 5. A duplicate in flight is answered 409, or (`on_concurrent = "wait"`)
//!    waits for the holder's outcome: published in process when the holder
//!    runs here, announced through the store (Postgres `NOTIFY`, Redis
//!    pub/sub) when it runs on another instance, with a slow safety poll for
//!    an announcement that was lost.
//! 6. An `uncertain` record is not forwarded again while a copy may still
//!    be running at the upstream (its hold, by the database's clock): every
//!    duplicate, on every instance, gets `502 outcome-uncertain` with a
//!    `Retry-After` until then. After it, the one retry that takes the claim
//!    over asks the upstream first where the route can
//!    (`super::reconcile`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use tower::Service;

use tokio::sync::oneshot;

use idemgate_core::await_boxed;
use idemgate_core::budget::{self};
use idemgate_core::error::{Problem, Reason};
use idemgate_core::identity::Identity;
use idemgate_core::metrics::Metrics;
use idemgate_core::request_id::X_REQUEST_ID;
use idemgate_core::trace;
use idemgate_store::RecordKey;
use tracing::Instrument;

use super::answer::AnswerBudget;
use super::body::{BodyError, read_and_fingerprint};
use super::holder::{Holders, Published};
use super::outcome::{UncertainStatuses, forward_plain, replay};
use super::policy::{Head, Policy};
use super::reconcile::Reconcile;
use super::verdict::{Answer, Verdict};

mod attempt;
mod refusal;
mod uncertain;
mod waiting;

pub use refusal::IdempotencyError;

/// `on_concurrent`: what a duplicate gets while the first is in flight.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnConcurrent {
    /// `409 request-in-flight`, with `Retry-After`.
    #[default]
    Reject,
    /// Wait for the first request's outcome (at most the upstream's
    /// timeout) and answer with it.
    Wait,
}

/// Per-route settings of the engine.
#[derive(Clone)]
pub struct EngineSettings {
    /// The route's name: part of every record key.
    pub route: Arc<str>,
    /// Who a client is (its records' scope).
    pub identity: Identity,
    /// The request body limit (`413` past it).
    pub max_body_bytes: u64,
    /// Bound on receiving the whole request body.
    pub body_read_timeout: Duration,
    /// Answers larger than this are recorded without their body.
    pub max_stored_body_bytes: usize,
    /// What a duplicate gets while the first is in flight.
    pub on_concurrent: OnConcurrent,
    /// How long a waiting duplicate waits (the upstream's timeout).
    pub wait_limit: Duration,
    /// How long an uncertain outcome keeps the key from being forwarded
    /// again: a copy may still be running at the upstream.
    pub uncertain_hold: Duration,
    /// Answers that may mean the action ran (a proxy's `502`/`504` for an
    /// answer it lost): the record becomes uncertain, as after a lost
    /// connection (docs/semantics.md, rule 11).
    pub uncertain_statuses: UncertainStatuses,
    /// The upstream's status endpoint, asked before an uncertain action is
    /// forwarded again.
    pub reconcile: Option<Arc<dyn Reconcile>>,
    /// The process's claims in flight (`server.max_claims`).
    pub budget: budget::ClaimBudget,
    /// The process's buffered request bodies (`server.max_buffered_bytes`).
    pub body_budget: super::body::BodyBudget,
    /// The process's answers held until their record is written
    /// (`server.max_captured_bytes`).
    pub answer_budget: AnswerBudget,
    /// The inner service is a handler in this process (the library), not
    /// an upstream: what a client is told when it does not answer in time.
    pub in_process: bool,
    /// What must live as long as this engine (the library's shared state
    /// and its sweeper).
    pub keep_alive: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

impl EngineSettings {
    /// The settings of `route` with every other value at its default: the
    /// one place they are spelled out. Callers change what they configure
    /// (`EngineSettings { on_concurrent, ..EngineSettings::new(route,
    /// identity) }`).
    pub fn new(route: &str, identity: Identity) -> EngineSettings {
        EngineSettings {
            route: route.into(),
            identity,
            max_body_bytes: crate::DEFAULT_MAX_BODY_BYTES,
            body_read_timeout: crate::DEFAULT_BODY_READ_TIMEOUT,
            max_stored_body_bytes: idemgate_store::DEFAULT_MAX_STORED_BODY_BYTES,
            on_concurrent: OnConcurrent::Reject,
            wait_limit: crate::DEFAULT_HANDLER_DEADLINE,
            uncertain_hold: crate::DEFAULT_HANDLER_DEADLINE,
            uncertain_statuses: UncertainStatuses::default(),
            reconcile: None,
            budget: budget::ClaimBudget::unbounded(),
            body_budget: super::body::BodyBudget::unbounded(),
            answer_budget: AnswerBudget::unbounded(),
            in_process: false,
            keep_alive: None,
        }
    }
}

/// The shared engine of one route. Cloned for every request and every
/// claim, so it is one `Arc`: one reference count to move, where its
/// fields (the store alone holds a dozen handles) would be many.
#[derive(Clone)]
pub struct Engine(Arc<EngineParts>);

/// What an [`Engine`] shares among its clones.
pub struct EngineParts {
    store: idemgate_store::Store,
    settings: EngineSettings,
    metrics: Arc<Metrics>,
    holders: Arc<Holders>,
}

impl std::ops::Deref for Engine {
    type Target = EngineParts;

    fn deref(&self) -> &EngineParts {
        &self.0
    }
}

/// A duplicate waiting for this process's holder also claims again this
/// often, in case the outcome arrives another way (a takeover elsewhere).
const WAIT_SAFETY_POLL: Duration = Duration::from_millis(500);
/// A duplicate waiting for a holder on another instance claims again this
/// often even without an announcement (one lost with a dropped listener).
pub const CROSS_INSTANCE_SAFETY_POLL: Duration = Duration::from_secs(1);
/// ... and this often where nothing announces a settled record (MySQL
/// without Redis has no `LISTEN/NOTIFY`): the poll is the only wake-up, so
/// it is short, at the cost of a claim attempt per waiter each time.
pub const UNANNOUNCED_POLL: Duration = Duration::from_millis(200);

impl Engine {
    /// The store its records are in.
    pub fn store(&self) -> &idemgate_store::Store {
        &self.store
    }

    /// An engine for one route. `holders` is the process's list of live
    /// claims: every engine of a process shares one, so that a duplicate
    /// on any worker finds the holder of its key.
    pub fn new(
        store: idemgate_store::Store,
        settings: EngineSettings,
        metrics: Arc<Metrics>,
        holders: Arc<Holders>,
    ) -> Self {
        Engine(Arc::new(EngineParts {
            store,
            settings,
            metrics,
            holders,
        }))
    }

    /// Handles one request on a protected route.
    pub async fn handle<S, P>(&self, policy: P, inner: S, req: Request<Body>) -> Answer
    where
        S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
            + Clone
            + Send
            + 'static,
        S::Future: Send,
        P: Policy,
    {
        let mut response = self.respond(policy, inner, req).await;
        let verdict = Verdict::take(&mut response);
        Answer { verdict, response }
    }

    async fn respond<S, P>(&self, policy: P, inner: S, req: Request<Body>) -> Response<Body>
    where
        S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
            + Clone
            + Send
            + 'static,
        S::Future: Send,
        P: Policy,
    {
        let (parts, body) = req.into_parts();
        let scope = if P::CLIENT_SCOPED {
            match self.settings.identity.scope(&parts.headers) {
                Ok(scope) => scope,
                Err(e) => return Problem::from(&e).into_response(),
            }
        } else {
            String::new()
        };
        let head = match policy.key_in_head(&parts, &scope) {
            Ok(Head::Bypass) => {
                return await_boxed!(forward_plain(inner, Request::from_parts(parts, body)));
            }
            Ok(Head::Key(key)) => Keyed::Key(key),
            Ok(Head::ReplayOnly { key, refusal }) => Keyed::ReplayOnly(key, refusal),
            Ok(Head::FromBody(from)) => Keyed::FromBody(from),
            Err(problem) => {
                return problem
                    .logged(P::LAYER, "refused before the store")
                    .into_response();
            }
        };
        // `_buffered` counts the body until this request is answered.
        let (bytes, fingerprint, _buffered) = match self.read_body::<P>(&parts, body).await {
            Ok(read) => read,
            Err(refusal) => return refusal,
        };
        let (key, replay_only) = match head {
            Keyed::Key(key) => (key, None),
            Keyed::ReplayOnly(key, refusal) => (key, Some(refusal)),
            Keyed::FromBody(from) => match policy.key_in_body(from, &parts, &bytes) {
                Ok(key) => (key, None),
                Err(problem) => {
                    return problem
                        .logged(P::LAYER, "refused before the store")
                        .into_response();
                }
            },
        };
        // A policy may identify the request by its key: then the whole
        // request's fingerprint is only what records written before that
        // rule carry (tried when the record mismatches).
        let (fingerprint, legacy_fingerprint) = match policy.fingerprint(&parts, &bytes, &key) {
            Some(by_key) => (by_key, Some(fingerprint)),
            None => (fingerprint, None),
        };
        let key = policy.record_key(scope, &self.settings.route, key);
        // A finished request this process holds the answer to is replayed
        // here, on the request's task: nothing is claimed, so nothing
        // needs a task that outlives the client. Unless this process holds
        // the key for the same request again (a purged key re-executing):
        // the claim's path answers that, as it would have.
        if let Some((stored, expires_at_ms)) = self.store.replay_in_memory(&key, &fingerprint)
            && self.holders.holds_unrecorded(&key, &fingerprint).is_none()
        {
            return replay(stored, expires_at_ms);
        }
        if let Some(refusal) = replay_only {
            return await_boxed!(self.replay_or_refuse::<P>(&key, &fingerprint, refusal));
        }
        let request_id = parts
            .headers
            .get(X_REQUEST_ID)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let ticket = Ticket {
            key,
            fingerprint,
            legacy_fingerprint,
            request_id,
        };
        // Boxed, as the two paths above: the claim's state machine is
        // most of this future's size, and a replay (answered above) would
        // otherwise pay for moving all of it into the request's box.
        await_boxed!(self.claim_and_hold(policy, inner, parts, bytes, ticket))
    }

    /// Reads the whole request body and its fingerprint, or the refusal
    /// that ends the request before anything is stored: too large, broken,
    /// too slow, past the process's budget, or a streaming gRPC call.
    async fn read_body<P: Policy>(
        &self,
        parts: &Parts,
        body: Body,
    ) -> Result<(Bytes, String, super::body::Buffered), Response<Body>> {
        // A slow-drip body must not hold a connection (and, later, a claim)
        // forever: the whole body arrives within the deadline or the
        // request is refused before anything is stored.
        let deadline = self.settings.body_read_timeout;
        let read = read_and_fingerprint(
            parts,
            body,
            self.settings.max_body_bytes,
            &self.settings.body_budget,
        );
        let error = match tokio::time::timeout(deadline, read).await {
            Ok(Ok(read)) => {
                // A unary gRPC call is one message; more is a stream, whose
                // answer depends on how the messages interleave and cannot
                // be replayed; none, or bytes that are not whole messages,
                // is no call at all.
                if idemgate_core::grpc::is_grpc(&parts.headers) {
                    let error = match idemgate_core::grpc::message_count(&read.0) {
                        Some(1) => return Ok(read),
                        Some(messages @ 2..) => IdempotencyError::StreamingCall(messages),
                        _ => IdempotencyError::BadBody(
                            "not one length-prefixed gRPC message".to_owned(),
                        ),
                    };
                    let problem = Problem::from(&error).logged(P::LAYER, error.to_string());
                    return Err(problem.into_response());
                }
                return Ok(read);
            }
            Ok(Err(BodyError::TooLarge { limit })) => IdempotencyError::BodyTooLarge { limit },
            Ok(Err(BodyError::Broken(e))) => IdempotencyError::BadBody(e),
            Ok(Err(BodyError::Budget)) => IdempotencyError::BodyBudget,
            Err(_) => IdempotencyError::BodyTimeout(deadline),
        };
        Err(self.refusal::<P>(error, None))
    }

    /// Claims the key; a won claim is seen through by a [`Holder`]. A
    /// duplicate in flight is refused (409), or with `on_concurrent =
    /// "wait"` waits for the holder's outcome and claims again.
    ///
    /// Each claim runs in a task of its own: a client that hangs up while
    /// its claim is being written must not leave a won claim that nobody
    /// forwards.
    async fn claim_and_hold<S, P>(
        &self,
        policy: P,
        inner: S,
        mut parts: Parts,
        mut bytes: Bytes,
        ticket: Ticket,
    ) -> Response<Body>
    where
        S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
            + Clone
            + Send
            + 'static,
        S::Future: Send,
        P: Policy,
    {
        let ticket = Arc::new(ticket);
        let until = Instant::now() + self.settings.wait_limit;
        // Registered while waiting for a holder on another instance.
        let mut watch = None;
        loop {
            let (reply, answer) = oneshot::channel();
            let attempt = self.clone().attempt(
                policy.clone(),
                inner.clone(),
                parts,
                bytes,
                ticket.clone(),
                reply,
            );
            // The attempt outlives the client; with traces on, its store and
            // upstream spans stay children of the request's.
            if trace::enabled() {
                tokio::spawn(attempt.in_current_span());
            } else {
                tokio::spawn(attempt);
            }
            let (retry_after, expires_at_ms) = match answer.await {
                Ok(Attempt::Answered(response)) => return response,
                Ok(Attempt::InFlight {
                    retry_after,
                    expires_at_ms,
                    parts: p,
                    bytes: b,
                }) => {
                    (parts, bytes) = (p, b);
                    (retry_after, expires_at_ms)
                }
                Err(_) => {
                    return Problem::new(Reason::HolderFailed)
                        .logged(
                            P::LAYER,
                            format!(
                                "key {}: claim task ended without an answer",
                                ticket.key.escaped()
                            ),
                        )
                        .into_response();
                }
            };
            let wait = self.settings.on_concurrent == OnConcurrent::Wait;
            if !wait || Instant::now() >= until {
                return self.refuse::<P>(
                    IdempotencyError::InFlight { retry_after },
                    Some(&ticket.key),
                    expires_at_ms,
                );
            }
            match self.wait_turn(&ticket, until, &mut watch).await {
                Some(Published::Stored(stored, expires_at_ms)) => {
                    return replay(stored, expires_at_ms);
                }
                // Released or uncertain: the next claim tells (an uncertain
                // record answers 502 with its hold, as on any instance).
                Some(Published::Retry | Published::Uncertain) | None => {}
            }
        }
    }
}

/// A protected request's key, as its head said: every [`Head`] but
/// `Bypass`, which never reads the body.
enum Keyed<B> {
    Key(String),
    ReplayOnly(String, Problem),
    FromBody(B),
}

/// What identifies one request's claim.
struct Ticket {
    key: RecordKey,
    fingerprint: String,
    /// The whole request's fingerprint, when `fingerprint` is its business
    /// key's: a record of an earlier version carries this one.
    legacy_fingerprint: Option<String>,
    request_id: String,
}

/// What one claim attempt tells the waiting client.
enum Attempt {
    /// The answer: a replay, a refusal, or the holder's response.
    Answered(Response<Body>),
    /// Another request holds the key; the request comes back for the next
    /// attempt.
    InFlight {
        retry_after: Duration,
        expires_at_ms: i64,
        parts: Parts,
        bytes: Bytes,
    },
}
