//! One claim attempt, in the claim's own task: the budgets counted, the
//! key claimed (with the fallbacks older records need), what the store
//! answered decided, and a won claim handed to its [`Holder`] to see the
//! request through.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::body::Body;
use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use idemgate_core::await_boxed;
use idemgate_core::budget::{self, ConnectionClaims};
use idemgate_core::metrics::ClaimLimit;
use idemgate_core::trace;
use idemgate_store::{Claim, StoreError};
use tokio::sync::oneshot;
use tower::Service;
use tracing::Instrument;

use super::super::IDEMPOTENCY_KEY;
use super::super::answer::AnswerShare;
use super::super::holder::{Claimed, Holder};
use super::super::outcome::replay;
use super::super::policy::Policy;
use super::super::stable_key::stable_key;
use super::{Attempt, Engine, IdempotencyError, Ticket};

/// A claim's place in the budgets, given back when it is dropped.
struct Counted {
    _process: tokio::sync::OwnedSemaphorePermit,
    _connection: Option<budget::ConnectionClaim>,
}

/// What a claim's answer means for the attempt.
enum Decided {
    /// The claim is this request's, under `epoch`: forward it.
    Won { epoch: i64, expires_at_ms: i64 },
    /// Another request holds the key: come back (or wait) for its outcome.
    InFlight {
        retry_after: std::time::Duration,
        expires_at_ms: i64,
    },
    /// The client's answer: a replay, a refusal, a reconciled outcome.
    Answered(Response<Body>),
}

impl Engine {
    /// One claim, and if it is won, the holder's whole run. The answer goes
    /// to `reply` as soon as there is one; the task goes on after that.
    pub(super) async fn attempt<S, P>(
        self,
        policy: P,
        inner: S,
        parts: Parts,
        bytes: Bytes,
        ticket: Arc<Ticket>,
        reply: oneshot::Sender<Attempt>,
    ) where
        S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Send + 'static,
        S::Future: Send,
        P: Policy,
    {
        // This process still holds the key for the same request: its
        // holder has the answer in hand, or is forwarding. Its lease may
        // have run out while the database was away; a claim now would take
        // the record over and forward the request a second time, while the
        // holder is about to record the first outcome.
        if let Some(expires_at_ms) = self
            .holders
            .holds_unrecorded(&ticket.key, &ticket.fingerprint)
        {
            let retry_after = self.store.settings().lease;
            let _ = reply.send(Attempt::InFlight {
                retry_after,
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
                let refused = self.refusal::<P>(refused, Some(&ticket.key));
                let _ = reply.send(Attempt::Answered(refused));
                return;
            }
        };
        let claimed_at = tokio::time::Instant::now();
        // Each step boxed: an `async fn` keeps every step's state side by
        // side (measured: 81 KB for this task, copied whole into it and
        // again on the way), while a box costs one allocation and holds
        // only the step that runs.
        let (claim, fingerprint) = await_boxed!(self.claim_with_fallbacks::<P>(&ticket));
        let decided = await_boxed!(self.decide::<P>(claim, &ticket, fingerprint, &mut share));
        let (epoch, expires_at_ms) = match decided {
            Decided::Won {
                epoch,
                expires_at_ms,
            } => (epoch, expires_at_ms),
            Decided::InFlight {
                retry_after,
                expires_at_ms,
            } => {
                let _ = reply.send(Attempt::InFlight {
                    retry_after,
                    expires_at_ms,
                    parts,
                    bytes,
                });
                return;
            }
            Decided::Answered(response) => {
                let _ = reply.send(Attempt::Answered(response));
                return;
            }
        };
        let claim = Claimed {
            key: ticket.key.clone(),
            epoch,
            fingerprint: fingerprint.clone(),
            expires_at_ms,
        };
        await_boxed!(self.hold(
            policy, inner, parts, bytes, &ticket, claim, share, claimed_at, reply,
        ));
    }

    /// Claims the key; with a policy that identifies a request by its key,
    /// a record written before that rule (by the whole request's
    /// fingerprint) is claimed by that; a route that keeps no tombstones
    /// takes an expired record over. The claim, and the fingerprint it was
    /// made with.
    async fn claim_with_fallbacks<'t, P: Policy>(
        &self,
        ticket: &'t Ticket,
    ) -> (Result<Claim, StoreError>, &'t String) {
        let (key, request_id) = (&ticket.key, &ticket.request_id);
        let mut fingerprint = &ticket.fingerprint;
        let mut claim = self
            .store
            .claim(key, fingerprint, request_id)
            .instrument(trace::span(
                || tracing::info_span!(target: trace::TARGET, "store.claim"),
            ))
            .await;
        if let (Ok(Claim::Mismatch { .. }), Some(legacy)) = (&claim, &ticket.legacy_fingerprint) {
            // Recorded before requests were identified by their key.
            claim = await_boxed!(self.store.claim(key, legacy, request_id));
            fingerprint = legacy;
        }
        if !P::TOMBSTONED && matches!(claim, Ok(Claim::Expired { .. })) {
            claim = await_boxed!(
                self.store
                    .claim_past_tombstone(key, fingerprint, request_id),
            );
        }
        (claim, fingerprint)
    }

    /// What the store's answer to a claim means: forward, come back, or
    /// this answer (a replay, a refusal; for a claim over an attempt that
    /// may have acted, what the upstream's status endpoint said).
    async fn decide<P: Policy>(
        &self,
        claim: Result<Claim, StoreError>,
        ticket: &Ticket,
        fingerprint: &str,
        share: &mut AnswerShare,
    ) -> Decided {
        let key = &ticket.key;
        match claim {
            Ok(Claim::Won {
                epoch,
                expires_at_ms,
                maybe_ran: false,
            }) => Decided::Won {
                epoch,
                expires_at_ms,
            },
            Ok(Claim::Won {
                epoch,
                expires_at_ms,
                maybe_ran: true,
            }) => match await_boxed!(self.reconcile_held::<P>(
                ticket,
                fingerprint,
                epoch,
                expires_at_ms,
                share,
            )) {
                Some(answered) => Decided::Answered(answered),
                None => Decided::Won {
                    epoch,
                    expires_at_ms,
                },
            },
            Ok(Claim::InFlight {
                retry_after,
                expires_at_ms,
            }) => Decided::InFlight {
                retry_after,
                expires_at_ms,
            },
            Ok(Claim::Uncertain {
                epoch,
                retry_after,
                expires_at_ms,
            }) => Decided::Answered(await_boxed!(self.during_hold::<P>(
                ticket,
                fingerprint,
                epoch,
                retry_after,
                expires_at_ms,
                share,
            ))),
            Ok(Claim::Completed {
                response,
                expires_at_ms,
            }) => Decided::Answered(replay(response, expires_at_ms)),
            Ok(Claim::Mismatch { expires_at_ms }) => {
                let error = if ticket.legacy_fingerprint.is_some() {
                    // The same business key with other must_match fields: a
                    // sender contradicting itself (another amount for the
                    // same trade) is worth an alarm.
                    tracing::error!(route = %key.route, key = %key.escaped(), layer = P::LAYER, "a delivery's must_match fields differ from the first delivery's with this business key; refused");
                    IdempotencyError::FieldsDiffer
                } else {
                    IdempotencyError::Mismatch
                };
                Decided::Answered(self.refuse::<P>(error, Some(key), expires_at_ms))
            }
            Ok(Claim::Expired { forgotten_at_ms }) => Decided::Answered(self.refuse::<P>(
                IdempotencyError::Expired,
                Some(key),
                forgotten_at_ms,
            )),
            Err(e) => Decided::Answered(self.refuse_unrecorded::<P>(e.into(), key)),
        }
    }

    /// Hands a won claim to its [`Holder`], which forwards the request with
    /// the stable key, answers `reply` as soon as it has the answer, and
    /// records the outcome whatever the client does.
    #[allow(clippy::too_many_arguments)] // one request's parts, one call site
    async fn hold<S, P>(
        &self,
        policy: P,
        inner: S,
        mut parts: Parts,
        bytes: Bytes,
        ticket: &Ticket,
        claim: Claimed,
        share: AnswerShare,
        claimed_at: tokio::time::Instant,
        reply: oneshot::Sender<Attempt>,
    ) where
        S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Send + 'static,
        S::Future: Send,
        P: Policy,
    {
        policy.strip(&mut parts.headers);
        parts
            .headers
            .insert(IDEMPOTENCY_KEY, stable_key(&ticket.key).into_header());
        let request = Request::from_parts(parts, Body::from(bytes));
        let holder = Holder {
            ledger: self.store.clone(),
            holders: self.holders.clone(),
            claim,
            request_id: ticket.request_id.clone(),
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
}
