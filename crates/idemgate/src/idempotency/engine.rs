//! The engine: scope + key → claim → hold → replay.
//!
//! Ordering is the guarantee:
//! 1. Everything that can refuse a request without the store (policy, body
//!    limit) runs first, so bad input leaves no record.
//! 2. The claim is durable in SQL before the request is forwarded (the
//!    store's `claim`); if the store cannot answer, the request is refused
//!    503 and never forwarded — fail closed.
//! 3. A won claim belongs to a [`Holder`] (see [`super::holder`]), in a task
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
//!    ([`super::reconcile`]).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use tower::Service;

use tokio::sync::oneshot;

use idemgate_core::budget::{self, ConnectionClaims};
use idemgate_core::error::{Problem, Reason};
use idemgate_core::identity::Identity;
use idemgate_core::metrics::{ClaimLimit, Metrics, WakeUp};
use idemgate_core::request_id::X_REQUEST_ID;
use idemgate_core::trace;
use idemgate_store::{Claim, RecordKey, StoreError, StoredResponse};
use tracing::Instrument;

use super::IDEMPOTENCY_KEY;
use super::answer::{AnswerBudget, AnswerShare};
use super::body::{BodyError, read_and_fingerprint};
use super::expires::set_expires;
use super::holder::{Claimed, Holder, Holders, Outcome as Published};
use super::outcome::{UncertainStatuses, forward_plain, replay};
use super::policy::{Head, Policy};
use super::reconcile::{Reconcile, Reconciled};
use super::stable_key::stable_key;
use super::verdict::{Answer, Verdict};

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

/// The shared engine of one route.
#[derive(Clone)]
pub struct Engine {
    store: idemgate_store::Store,
    settings: Arc<EngineSettings>,
    metrics: Arc<Metrics>,
    holders: Arc<Holders>,
}

/// A duplicate waiting for this process's holder also claims again this
/// often, in case the outcome arrives another way (a takeover elsewhere).
const WAIT_SAFETY_POLL: Duration = Duration::from_millis(500);
/// A duplicate waiting for a holder on another instance claims again this
/// often even without an announcement (one lost with a dropped listener).
pub const CROSS_INSTANCE_SAFETY_POLL: Duration = Duration::from_secs(1);

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
        Engine {
            store,
            settings: Arc::new(settings),
            metrics,
            holders,
        }
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
                return forward_plain(inner, Request::from_parts(parts, body)).await;
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
        // A slow-drip body must not hold a connection (and, later, a claim)
        // forever: the whole body arrives within the deadline or the
        // request is refused before anything is stored.
        let deadline = self.settings.body_read_timeout;
        let read = read_and_fingerprint(
            &parts,
            body,
            self.settings.max_body_bytes,
            &self.settings.body_budget,
        );
        // `_buffered` counts the body until this request is answered.
        let (bytes, fingerprint, _buffered) = match tokio::time::timeout(deadline, read).await {
            Ok(Ok(read)) => read,
            Ok(Err(BodyError::TooLarge { limit })) => {
                return self.refusal::<P>(IdempotencyError::BodyTooLarge { limit }, None);
            }
            Ok(Err(BodyError::Broken(e))) => {
                return self.refusal::<P>(IdempotencyError::BadBody(e), None);
            }
            Ok(Err(BodyError::Budget)) => {
                return self.refusal::<P>(IdempotencyError::BodyBudget, None);
            }
            Err(_) => return self.refusal::<P>(IdempotencyError::BodyTimeout(deadline), None),
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
            return self
                .replay_or_refuse::<P>(&key, &fingerprint, refusal)
                .await;
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
        self.claim_and_hold(policy, inner, parts, bytes, ticket)
            .await
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

    /// One claim, and if it is won, the holder's whole run. The answer goes
    /// to `reply` as soon as there is one; the task goes on after that.
    async fn attempt<S, P>(
        self,
        policy: P,
        inner: S,
        mut parts: Parts,
        bytes: Bytes,
        ticket: Arc<Ticket>,
        reply: oneshot::Sender<Attempt>,
    ) where
        S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Send + 'static,
        S::Future: Send,
        P: Policy,
    {
        let Ticket {
            key,
            fingerprint,
            legacy_fingerprint,
            request_id,
        } = &*ticket;
        // This process still holds the key for the same request: its
        // holder has the answer in hand, or is forwarding. Its lease may
        // have run out while the database was away; a claim now would take
        // the record over and forward the request a second time, while the
        // holder is about to record the first outcome.
        if let Some(expires_at_ms) = self.holders.holds_unrecorded(key, fingerprint) {
            let _ = reply.send(Attempt::InFlight {
                retry_after: self.store.settings().lease,
                expires_at_ms,
                parts,
                bytes,
            });
            return;
        }
        // Counted before the claim is made: a claim outlives its client, so
        // it holds the process's budget and its connection's share until
        // its holder has finished (`_counted` lives as long as this task),
        // and the reserve its answer will be kept in.
        let connection = parts.extensions.get::<ConnectionClaims>().cloned();
        let (_counted, mut share) = match self.count_claim(connection.as_ref()) {
            Ok(counted) => counted,
            Err(refused) => {
                let refused = self.refusal::<P>(refused, Some(key));
                let _ = reply.send(Attempt::Answered(refused));
                return;
            }
        };
        let claimed_at = tokio::time::Instant::now();
        let mut claim = self
            .store
            .claim(key, fingerprint, request_id)
            .instrument(trace::span(
                || tracing::info_span!(target: trace::TARGET, "store.claim"),
            ))
            .await;
        let mut fingerprint = fingerprint;
        if let (Ok(Claim::Mismatch { .. }), Some(legacy)) = (&claim, legacy_fingerprint) {
            // Recorded before requests were identified by their key.
            claim = self.store.claim(key, legacy, request_id).await;
            fingerprint = legacy;
        }
        if !P::TOMBSTONED && matches!(claim, Ok(Claim::Expired { .. })) {
            claim = self
                .store
                .claim_past_tombstone(key, fingerprint, request_id)
                .await;
        }
        let claimed = match claim {
            Ok(Claim::Won {
                epoch,
                expires_at_ms,
                maybe_ran,
            }) => match maybe_ran {
                true => match self
                    .reconcile_held::<P>(&ticket, fingerprint, epoch, expires_at_ms, &mut share)
                    .await
                {
                    Some(answered) => Err(Attempt::Answered(answered)),
                    None => Ok((epoch, expires_at_ms)),
                },
                false => Ok((epoch, expires_at_ms)),
            },
            Ok(Claim::InFlight {
                retry_after,
                expires_at_ms,
            }) => {
                let _ = reply.send(Attempt::InFlight {
                    retry_after,
                    expires_at_ms,
                    parts,
                    bytes,
                });
                return;
            }
            Ok(Claim::Uncertain {
                epoch,
                retry_after,
                expires_at_ms,
            }) => Err(Attempt::Answered(
                self.during_hold::<P>(
                    &ticket,
                    fingerprint,
                    epoch,
                    retry_after,
                    expires_at_ms,
                    &mut share,
                )
                .await,
            )),
            Ok(Claim::Completed {
                response,
                expires_at_ms,
            }) => Err(Attempt::Answered(replay(response, expires_at_ms))),
            Ok(Claim::Mismatch { expires_at_ms }) => {
                let error = if legacy_fingerprint.is_some() {
                    // The same business key with other must_match fields: a
                    // sender contradicting itself (another amount for the
                    // same trade) is worth an alarm.
                    tracing::error!(route = %key.route, key = %key.escaped(), layer = P::LAYER, "a delivery's must_match fields differ from the first delivery's with this business key; refused");
                    IdempotencyError::FieldsDiffer
                } else {
                    IdempotencyError::Mismatch
                };
                Err(Attempt::Answered(self.refuse::<P>(
                    error,
                    Some(key),
                    expires_at_ms,
                )))
            }
            Ok(Claim::Expired { forgotten_at_ms }) => Err(Attempt::Answered(self.refuse::<P>(
                IdempotencyError::Expired,
                Some(key),
                forgotten_at_ms,
            ))),
            Err(e) => Err(Attempt::Answered(
                self.refuse_unrecorded::<P>(e.into(), key),
            )),
        };
        let (epoch, expires_at_ms) = match claimed {
            Ok(won) => won,
            Err(attempt) => {
                let _ = reply.send(attempt);
                return;
            }
        };
        policy.strip(&mut parts.headers);
        parts
            .headers
            .insert(IDEMPOTENCY_KEY, stable_key(key).into_header());
        let request = Request::from_parts(parts, Body::from(bytes));
        let holder = Holder {
            ledger: self.store.clone(),
            holders: self.holders.clone(),
            claim: Claimed {
                key: key.clone(),
                epoch,
                fingerprint: fingerprint.clone(),
                expires_at_ms,
            },
            request_id: request_id.clone(),
            deadline: self.settings.wait_limit,
            uncertain_hold: self.settings.uncertain_hold,
            uncertain_statuses: self.settings.uncertain_statuses,
            max_stored_body_bytes: self.settings.max_stored_body_bytes,
            share,
            layer: P::LAYER,
            in_process: self.settings.in_process,
            claimed_at,
        };
        let in_flight = &self.metrics.claims_in_flight;
        in_flight.fetch_add(1, Ordering::Relaxed);
        holder
            .run(inner, request, move |response| {
                let _ = reply.send(Attempt::Answered(response));
            })
            .await;
        in_flight.fetch_sub(1, Ordering::Relaxed);
    }

    /// One claim's share of the process budget and of its connection's,
    /// and the reserve of answer budget its answer is kept in; a refusal is
    /// counted by the limit that was full.
    fn count_claim(
        &self,
        connection: Option<&ConnectionClaims>,
    ) -> Result<(Counted, AnswerShare), IdempotencyError> {
        use budget::Exhausted;
        let refused = |limit, error| {
            self.metrics.claim_refused(limit);
            error
        };
        let connection = match connection {
            Some(c) => Some(c.take().ok_or_else(|| {
                refused(
                    ClaimLimit::Connection,
                    IdempotencyError::Exhausted(Exhausted::Connection),
                )
            })?),
            None => None,
        };
        let process = self.settings.budget.try_take().ok_or_else(|| {
            refused(
                ClaimLimit::Process,
                IdempotencyError::Exhausted(Exhausted::Process),
            )
        })?;
        let share = AnswerShare::reserve(
            &self.settings.answer_budget,
            self.settings.max_stored_body_bytes,
        )
        .map_err(|_| refused(ClaimLimit::Answers, IdempotencyError::AnswerBudget))?;
        let counted = Counted {
            _process: process,
            _connection: connection,
        };
        Ok((counted, share))
    }

    /// A won claim over an attempt that may have acted: asks the upstream
    /// first (where the route can). `None`: forward the request.
    async fn reconcile_held<P: Policy>(
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
    async fn reconcile_failed<P: Policy>(
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
    async fn stored_answer(
        &self,
        answer: Response<Body>,
        request_id: &str,
        share: &mut AnswerShare,
    ) -> Result<StoredResponse, String> {
        super::reconcile::stored_answer(
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
    async fn during_hold<P: Policy>(
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

    /// A duplicate's wait: for this process's holder of the key to publish
    /// its outcome, or — when the holder runs elsewhere (another instance)
    /// — for the store to announce that the record settled, or at most a
    /// safety poll. `None` means claim again.
    async fn wait_turn(
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
            let safety = (Instant::now() + CROSS_INSTANCE_SAFETY_POLL).min(until);
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

    async fn replay_or_refuse<P: Policy>(
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
    fn refuse<P: Policy>(
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
    fn refuse_unrecorded<P: Policy>(
        &self,
        error: IdempotencyError,
        key: &RecordKey,
    ) -> Response<Body> {
        self.refusal::<P>(error, Some(key))
    }

    fn refusal<P: Policy>(
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

/// A claim's place in the budgets, given back when it is dropped.
struct Counted {
    _process: tokio::sync::OwnedSemaphorePermit,
    _connection: Option<budget::ConnectionClaim>,
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
