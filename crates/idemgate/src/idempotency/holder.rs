//! The life of a won claim, owned by the gateway: claimed → forwarded →
//! response in hand → recorded.
//!
//! A claim must not belong to the client's connection (docs/semantics.md, rule 6).
//! hyper drops a request's future when its client hangs up; if that future
//! held the claim, the forward would be cancelled mid-flight and the outcome
//! never recorded, and the client's retry after the lease would execute the
//! action a second time — the seed incident. So a won claim is handed to a
//! [`Holder`] that runs in a task of its own: it forwards, receives the whole
//! response (bounded by the upstream's timeout), renews the lease in a
//! second task for as long as it lives, answers the client as soon as it has
//! the answer, and then retries the record write until it is durable. The
//! client only awaits that answer; whether it stays or goes changes nothing.
//!
//! [`Holders`] is the process-wide list of live holders. Waiting duplicates
//! (`on_concurrent = "wait"`) subscribe to a holder's outcome instead of
//! polling the store, and a graceful shutdown waits for the list to empty.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response};
use tokio::sync::{Notify, watch};
use tower::Service;

use super::ForwardFailure;
use super::answer::{AnswerShare, CAPTURE_WAIT, Captured, capture};
use super::body::chain;
use super::expires::set_expires;
use super::outcome::GrpcMeaning;
use super::verdict::Verdict;
use idemgate_core::await_boxed;
use idemgate_core::error::{Problem, Reason};
use idemgate_core::grpc;
use idemgate_core::trace;
use idemgate_store::{RecordKey, RecordState, Store, StoreError, StoredResponse};
use tracing::Instrument;

/// Pause before the first retry of a failed record write; it doubles.
pub(super) const WRITE_BACKOFF_START: Duration = Duration::from_millis(100);
/// Longest pause between two tries of a record write.
pub(super) const WRITE_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Pause before a failed renewal is tried again (a renewal that fails must
/// not wait a third of the lease: the lease may be about to end).
pub(super) const RENEW_RETRY: Duration = Duration::from_millis(250);

/// Where a holder stands; logged when a shutdown leaves it unfinished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
    /// The claim is durable; nothing was sent yet.
    Claimed,
    /// The request is at the upstream.
    Forwarded,
    /// The whole answer is here; its record is being written.
    ResponseInHand,
    /// The record is durable (or was refused by the fence, or given up).
    Recorded,
}

/// What the outcome means for the record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Write {
    /// The upstream acted: store this and replay it from now on.
    Complete(StoredResponse),
    /// Nothing happened upstream: the key is free again.
    Release,
    /// The request may have reached the upstream and no answer came back;
    /// a copy may still be running there, so nothing else is forwarded for
    /// `hold`.
    Uncertain { hold: Duration },
}

/// The claim a holder writes for.
#[derive(Debug, Clone)]
pub(super) struct Claimed {
    pub key: RecordKey,
    pub epoch: i64,
    pub fingerprint: String,
    /// The record's expiry (`Idempotency-Expires`).
    pub expires_at_ms: i64,
}

/// What a waiting duplicate learns from the holder.
#[derive(Debug, Clone)]
pub enum Published {
    /// Replay this, and the record's expiry.
    Stored(StoredResponse, i64),
    /// The claim was released (nothing happened upstream): claim again.
    Retry,
    /// The request may have reached the upstream and no answer came back:
    /// the waiter is told so, and is not forwarded at once — the first copy
    /// may still be running there. Its client's retry is forwarded, one at
    /// a time, with the same key.
    Uncertain,
}

/// The record writes a holder makes: the store in the gateway, a scripted
/// double in unit tests.
pub(super) trait Ledger: Clone + Send + Sync + 'static {
    /// The store's lease.
    fn lease(&self) -> Duration;
    /// Extends the lease; false when the claim was taken over.
    fn renew(
        &self,
        key: &RecordKey,
        epoch: i64,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;
    /// Writes the outcome; false when the fence refused it.
    fn write(
        &self,
        claim: &Claimed,
        write: &Write,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;
    /// Whether `epoch` already left `in_flight` (an earlier try that timed
    /// out may still have committed).
    fn settled(
        &self,
        key: &RecordKey,
        epoch: i64,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;
}

impl Ledger for Store {
    fn lease(&self) -> Duration {
        self.settings().lease
    }

    async fn renew(&self, key: &RecordKey, epoch: i64) -> Result<bool, StoreError> {
        Store::renew(self, key, epoch).await
    }

    async fn write(&self, claim: &Claimed, write: &Write) -> Result<bool, StoreError> {
        let (key, epoch) = (&claim.key, claim.epoch);
        match write {
            Write::Complete(stored) => {
                self.complete(key, epoch, &claim.fingerprint, stored, claim.expires_at_ms)
                    .instrument(trace::span(
                        || tracing::info_span!(target: trace::TARGET, "store.complete"),
                    ))
                    .await
            }
            Write::Release => {
                self.release(key, epoch)
                    .instrument(trace::span(
                        || tracing::info_span!(target: trace::TARGET, "store.release"),
                    ))
                    .await
            }
            Write::Uncertain { hold } => {
                self.mark_uncertain(key, epoch, *hold)
                    .instrument(trace::span(
                        || tracing::info_span!(target: trace::TARGET, "store.uncertain"),
                    ))
                    .await
            }
        }
    }

    async fn settled(&self, key: &RecordKey, epoch: i64) -> Result<bool, StoreError> {
        let settled = self
            .get(key)
            .await?
            .is_some_and(|r| r.epoch == epoch && r.state != RecordState::InFlight);
        if settled {
            // The write landed behind a timeout: the fast layer still holds
            // the in-flight marker. Drop it; SQL answers (and re-caches).
            self.forget(key).await;
        }
        Ok(settled)
    }
}

/// Every live holder of this process, by record key.
#[derive(Default)]
pub struct Holders {
    live: Mutex<HashMap<RecordKey, Live>>,
    emptied: Notify,
}

struct Live {
    epoch: i64,
    fingerprint: String,
    expires_at_ms: i64,
    stage: Stage,
    outcome: watch::Sender<Option<Published>>,
}

impl Holders {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<RecordKey, Live>> {
        // Every critical section is a map operation: a panic cannot leave
        // the map half-changed.
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn register(&self, claim: &Claimed) {
        let (outcome, _) = watch::channel(None);
        self.lock().insert(
            claim.key.clone(),
            Live {
                epoch: claim.epoch,
                fingerprint: claim.fingerprint.clone(),
                expires_at_ms: claim.expires_at_ms,
                stage: Stage::Claimed,
                outcome,
            },
        );
    }

    fn set_stage(&self, key: &RecordKey, epoch: i64, stage: Stage) {
        if let Some(live) = self.lock().get_mut(key).filter(|l| l.epoch == epoch) {
            live.stage = stage;
        }
    }

    fn publish(&self, key: &RecordKey, epoch: i64, outcome: Published) {
        if let Some(live) = self.lock().get(key).filter(|l| l.epoch == epoch) {
            live.outcome.send_replace(Some(outcome));
        }
    }

    fn remove(&self, key: &RecordKey, epoch: i64) {
        let mut live = self.lock();
        if live.get(key).is_some_and(|l| l.epoch == epoch) {
            live.remove(key);
        }
        if live.is_empty() {
            self.emptied.notify_waiters();
        }
    }

    /// The outcome of this process's holder of `key`, if one is running
    /// for the same request (same fingerprint).
    pub fn subscribe(
        &self,
        key: &RecordKey,
        fingerprint: &str,
    ) -> Option<watch::Receiver<Option<Published>>> {
        self.lock()
            .get(key)
            .filter(|l| l.fingerprint == fingerprint)
            .map(|l| l.outcome.subscribe())
    }

    /// Whether this process's holder of `key` for the same request is
    /// still before its record (forwarding, or writing the outcome): a
    /// claim now could take its expired lease over. A holder that has
    /// recorded (and is about to deregister) is not counted. With the
    /// record's expiry.
    pub fn holds_unrecorded(&self, key: &RecordKey, fingerprint: &str) -> Option<i64> {
        self.lock()
            .get(key)
            .filter(|l| l.fingerprint == fingerprint && l.stage != Stage::Recorded)
            .map(|l| l.expires_at_ms)
    }

    /// How many holders are running.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none is running.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Waits until every holder has finished, at most `within`; logs those
    /// left (their records are taken over after their lease).
    pub async fn drain(&self, within: Duration) {
        let wait = async {
            loop {
                let emptied = self.emptied.notified();
                if self.is_empty() {
                    return;
                }
                emptied.await;
            }
        };
        if tokio::time::timeout(within, wait).await.is_err() {
            for (key, live) in self.lock().iter() {
                tracing::warn!(
                    route = %key.route, key = %key.escaped(), epoch = live.epoch,
                    stage = ?live.stage, layer = "holder",
                    "shutdown grace over with this claim unfinished; it is taken over after its lease"
                );
            }
        }
    }
}

/// One won claim and what it needs to see its request through.
pub(super) struct Holder<L> {
    pub ledger: L,
    pub holders: Arc<Holders>,
    pub claim: Claimed,
    pub request_id: String,
    /// Bound on receiving the whole response (the upstream's timeout).
    pub deadline: Duration,
    /// How long an uncertain outcome keeps the key from being forwarded
    /// again (a copy may still be running at the upstream).
    pub uncertain_hold: Duration,
    /// Answers that may mean the action ran (rule 11): uncertain, not
    /// released.
    pub uncertain_statuses: super::outcome::UncertainStatuses,
    /// Larger response bodies are recorded without the body.
    pub max_stored_body_bytes: usize,
    /// The claim's share of the answer budget, the answer is kept in;
    /// given back when the holder has finished.
    pub share: AnswerShare,
    /// The policy layer's name, for logs.
    pub layer: &'static str,
    /// The inner service is a handler in this process, not an upstream.
    pub in_process: bool,
    /// When the claim was submitted: the lease counts from its insert, so
    /// renewals are timed from here, not from when the holder started.
    pub claimed_at: tokio::time::Instant,
}

impl<L: Ledger> Holder<L> {
    /// Sees the claim through: forward, receive, answer (`reply`, as soon
    /// (Long by design: the claim's stages in the order they happen, each
    /// marked with `set_stage`, so the life of a claim reads top to bottom.)
    /// as the answer is in hand), record. Run it in a task of its own: it
    /// must not be dropped with a client's connection.
    pub(super) async fn run<S>(
        mut self,
        inner: S,
        request: Request<Body>,
        reply: impl FnOnce(Response<Body>) + Send,
    ) where
        S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Send,
        S::Future: Send,
    {
        self.holders.register(&self.claim);
        // Deregisters (waking a shutdown that waits) however the task ends.
        let _registered = Registered {
            holders: self.holders.clone(),
            key: self.claim.key.clone(),
            epoch: self.claim.epoch,
        };
        let lost = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let _renewal = AbortOnDrop(tokio::spawn(renew(
            self.ledger.clone(),
            self.claim.key.clone(),
            self.claim.epoch,
            self.claimed_at,
            lost.clone(),
        )));
        self.holders
            .set_stage(&self.claim.key, self.claim.epoch, Stage::Forwarded);
        let give_up = tokio::time::Instant::now() + self.deadline;
        // The steps of a holder are boxed (`await_boxed!`): the forward
        // and the writes each keep a large state, and side by side they
        // would be copied whole into every claim's task.
        let receiving = { Box::pin(self.receive(inner, request, give_up)) };
        let received = tokio::time::timeout_at(give_up, receiving).await;
        let (write, response) = received.unwrap_or_else(|_| {
            // What the answer took of the budget is not kept.
            self.share.shrink();
            let problem = match self.in_process {
                false => Problem::new(Reason::UpstreamTimeout),
                true => held_in_process(
                    Problem::new(Reason::HandlerTimeout),
                    &format!(
                        "did not answer within {}s",
                        self.deadline.as_secs_f64().ceil()
                    ),
                    self.uncertain_hold,
                ),
            }
            .logged(
                self.layer,
                format!(
                    "key {}: whole response not received within {:?}",
                    self.claim.key.escaped(),
                    self.deadline
                ),
            );
            let mut response = problem.into_response();
            set_expires(response.headers_mut(), self.claim.expires_at_ms);
            (
                Write::Uncertain {
                    hold: self.uncertain_hold,
                },
                response,
            )
        });
        self.holders
            .set_stage(&self.claim.key, self.claim.epoch, Stage::ResponseInHand);
        if let Write::Complete(stored) = &write {
            // Waiters replay the outcome the moment it exists.
            self.holders.publish(
                &self.claim.key,
                self.claim.epoch,
                Published::Stored(stored.clone(), self.claim.expires_at_ms),
            );
        }
        // The first write before the answer, so that a client who retries
        // right after its answer finds the outcome recorded.
        let first = await_boxed!(self.write_once(&write));
        let mut response = response;
        set_expires(response.headers_mut(), self.claim.expires_at_ms);
        let verdict = match (&write, &first) {
            (Write::Complete(_), Ok(true)) => Verdict::Recorded,
            (Write::Complete(_), _) => Verdict::Recording,
            (Write::Release, _) => Verdict::Released,
            (Write::Uncertain { .. }, _) => Verdict::Uncertain,
        };
        response.extensions_mut().insert(verdict);
        reply(response);
        if first.is_err() {
            await_boxed!(self.write_until_durable(&write, &lost));
        }
        self.holders
            .set_stage(&self.claim.key, self.claim.epoch, Stage::Recorded);
        match write {
            Write::Complete(_) => {}
            Write::Release => {
                self.holders
                    .publish(&self.claim.key, self.claim.epoch, Published::Retry)
            }
            Write::Uncertain { .. } => {
                self.holders
                    .publish(&self.claim.key, self.claim.epoch, Published::Uncertain)
            }
        }
    }

    /// One try; `Err` when it should be tried again, `Ok(false)` when the
    /// fence refused it.
    async fn write_once(&self, write: &Write) -> Result<bool, StoreError> {
        match self.ledger.write(&self.claim, write).await {
            Ok(true) => Ok(true),
            Ok(false) => {
                tracing::warn!(
                    route = %self.claim.key.route, key = %self.claim.key.escaped(), layer = self.layer,
                    epoch = self.claim.epoch, "outcome refused: the claim was taken over while this request ran"
                );
                Ok(false)
            }
            Err(e) => {
                tracing::warn!(
                    route = %self.claim.key.route, key = %self.claim.key.escaped(), layer = self.layer,
                    epoch = self.claim.epoch, error = %e, "recording the outcome failed; retrying while the claim is held"
                );
                Err(e)
            }
        }
    }

    /// Retries the write for as long as the claim is held: the answer is
    /// in hand, and throwing it away would let a retry execute the action
    /// again (docs/semantics.md, rule 6). It stops only when the write lands, the
    /// fence refuses it, or the lease was lost (another holder owns the
    /// record now) — or when the process ends (a shutdown past its grace
    /// logs the key; the record is then taken over after its lease).
    async fn write_until_durable(&self, write: &Write, lost: &std::sync::atomic::AtomicBool) {
        let mut pause = WRITE_BACKOFF_START;
        for attempt in 1u64.. {
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(WRITE_BACKOFF_MAX);
            if lost.load(std::sync::atomic::Ordering::Relaxed) {
                tracing::error!(
                    route = %self.claim.key.route, key = %self.claim.key.escaped(), layer = self.layer,
                    epoch = self.claim.epoch, attempt,
                    "outcome not recorded: the lease was lost while the database was away; the record is taken over and the retry forwarded with the same key"
                );
                return;
            }
            // A try that timed out may have committed all the same.
            if let Ok(true) = self.ledger.settled(&self.claim.key, self.claim.epoch).await {
                return;
            }
            if self.write_once(write).await.is_ok() {
                tracing::info!(
                    route = %self.claim.key.route, key = %self.claim.key.escaped(), layer = self.layer,
                    epoch = self.claim.epoch, attempt, "outcome recorded after retrying"
                );
                return;
            }
        }
    }

    /// Forwards and reads the whole answer: what it means for the record,
    /// and the client's response. `give_up` bounds it from outside.
    async fn receive<S>(
        &mut self,
        inner: S,
        request: Request<Body>,
        give_up: tokio::time::Instant,
    ) -> (Write, Response<Body>)
    where
        S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Send,
        S::Future: Send,
    {
        let hold = self.uncertain_hold;
        let grpc_call = grpc::is_grpc(request.headers());
        // An in-process handler (the library's use) that panics may have
        // acted before it did: the outcome is uncertain, never a lost claim.
        let forwarded = std::panic::AssertUnwindSafe(super::outcome::forward_plain(inner, request));
        let response = match futures_util::FutureExt::catch_unwind(forwarded).await {
            Ok(response) => response,
            Err(_) => {
                let problem =
                    held_in_process(Problem::new(Reason::HandlerPanicked), "panicked", hold)
                        .logged(
                            "holder",
                            "the inner service panicked; the outcome is uncertain",
                        );
                return (Write::Uncertain { hold }, problem.into_response());
            }
        };
        match response.extensions().get::<ForwardFailure>() {
            Some(ForwardFailure::NotSent) => return (Write::Release, response),
            Some(ForwardFailure::Uncertain) => return (Write::Uncertain { hold }, response),
            None => {}
        }
        if self.uncertain_statuses.contains(response.status()) {
            // A proxy in front of the service lost its answer or stopped
            // waiting for it: the service may have acted, and may still be
            // acting. Relayed as it came (its status already tells the
            // client to retry, and its body is the only account of what
            // went wrong); the retry finds the record uncertain.
            tracing::warn!(
                route = %self.claim.key.route, key = %self.claim.key.escaped(), layer = self.layer,
                status = response.status().as_u16(), hold = ?hold,
                "the upstream answered a status that may mean the action ran; the record is uncertain"
            );
            return (Write::Uncertain { hold }, response);
        }
        // An HTTP error that carries a `grpc-status` (a proxy's `503` with
        // `UNAVAILABLE` for an answer it lost) means to the caller what
        // its gRPC status means, and so it does to the record; a status
        // that would be stored leaves the HTTP rule to decide.
        if grpc_call
            && response.status() != http::StatusCode::OK
            && response.headers().contains_key(grpc::GRPC_STATUS)
            && let Some(write) = self.grpc_unstored(grpc::status(response.headers()))
        {
            return (write, response);
        }
        // A gRPC answer (HTTP 200 either way, and gRPC itself: a REST
        // route a client mislabelled answers as HTTP) is judged by its
        // `grpc-status`, once it is read whole.
        let grpc_answer = grpc_call
            && response.status() == http::StatusCode::OK
            && grpc::is_grpc(response.headers());
        if !grpc_answer && !super::outcome::is_stored(response.status()) {
            return (Write::Release, response);
        }
        self.keep(response, grpc_answer, give_up).await
    }
}

impl<L> Holder<L> {
    /// Reads an answer to be recorded whole (its body up to the cap,
    /// counted in the claim's share) and says what it means: stored, or
    /// for a gRPC call whose trailers carry a status that says otherwise,
    /// released or uncertain. `give_up` bounds it from outside.
    async fn keep(
        &mut self,
        response: Response<Body>,
        grpc_answer: bool,
        give_up: tokio::time::Instant,
    ) -> (Write, Response<Body>) {
        let hold = self.uncertain_hold;
        let (parts, body) = response.into_parts();
        // Waiting for room in the answer budget ends well before
        // `give_up`: an answer in hand is never turned into a timeout.
        // An in-process handler's answer is in memory already: waiting
        // would only delay it.
        let now = tokio::time::Instant::now();
        let until = match self.in_process {
            true => now,
            false => now + CAPTURE_WAIT.min(give_up.saturating_duration_since(now) / 2),
        };
        let cap = self.max_stored_body_bytes;
        let (kept, trailers, client_body) = match capture(body, cap, &mut self.share, until).await {
            Captured::Whole(bytes, trailers) => {
                // Connection-specific fields have no place in trailers;
                // HTTP/2 would reset the stream that carried them.
                let trailers = trailers.map(super::outcome::end_to_end);
                let stored = super::outcome::storable_trailers(trailers.as_ref());
                // Several messages: a stream, which ran whatever its status.
                if grpc_answer && grpc::message_count(&bytes).is_some_and(|n| n > 1) {
                    self.share.shrink();
                    return self.streamed_answer(parts.headers);
                }
                let code = grpc_answer
                    .then(|| grpc_status(&parts.headers, &bytes, trailers.as_ref()))
                    .flatten();
                if grpc_answer && let Some(write) = self.grpc_unstored(code) {
                    self.share.shrink();
                    let body = super::outcome::body_with_trailers(bytes, trailers);
                    return (write, Response::from_parts(parts, body));
                }
                let body = super::outcome::body_with_trailers(bytes.clone(), trailers);
                (Some(bytes), stored, body)
            }
            // The status of a gRPC answer over the cap passes by unread:
            // the call ran once, and its replay says so.
            Captured::TooLarge(prefix, rest) if grpc_answer => {
                (None, omitted_grpc_answer(), chain(prefix, rest))
            }
            Captured::TooLarge(prefix, rest) => (None, Vec::new(), chain(prefix, rest)),
            Captured::Broken(cause) => {
                // The upstream answered the head, then broke: it executed,
                // but the outcome never arrived whole.
                let problem = Problem::new(Reason::UpstreamBroken)
                    .logged("holder", format!("response body cut: {cause}"));
                return (Write::Uncertain { hold }, problem.into_response());
            }
        };
        let stored = StoredResponse {
            status: parts.status.as_u16(),
            headers: super::outcome::storable_headers(&parts.headers, kept.is_some()),
            trailers,
            body_kept: kept.is_some(),
            body: kept.unwrap_or_default(),
            request_id: self.request_id.clone(),
        };
        (
            Write::Complete(stored),
            Response::from_parts(parts, client_body),
        )
    }

    /// A server-streaming call on a protected route: its request looked
    /// unary, so it was forwarded, and it ran; its answer, a stream, is not
    /// one to replay. Recorded and answered as `UNIMPLEMENTED`
    /// (`streaming-call`, naming the route, saying it ran once), the same
    /// to every retry: the operator learns at the first call that the
    /// method belongs on a route without `idempotency`, and nothing runs
    /// twice.
    fn streamed_answer(&self, upstream: http::HeaderMap) -> (Write, Response<Body>) {
        let message = grpc::message_value(&format!(
            "{}streaming-call: {} (route {}); it ran once, and its stream is not kept",
            idemgate_core::error::PROBLEM_TYPE_PREFIX,
            Reason::StreamingCall.title(),
            self.claim.key.route
        ));
        tracing::error!(
            route = %self.claim.key.route, key = %self.claim.key.escaped(), layer = self.layer,
            "a server-streaming call on a protected route ran once; its answer is recorded as UNIMPLEMENTED. Route streaming methods without idempotency"
        );
        let mut headers = vec![("content-type".to_owned(), b"application/grpc".to_vec())];
        headers.extend(
            super::outcome::storable_headers(&upstream, false)
                .into_iter()
                .filter(|(name, _)| !name.starts_with("grpc-") && name != "content-type"),
        );
        headers.push(("grpc-status".to_owned(), b"12".to_vec()));
        headers.push(("grpc-message".to_owned(), message.as_bytes().to_vec()));
        let stored = StoredResponse {
            status: 200,
            headers,
            trailers: Vec::new(),
            body: bytes::Bytes::new(),
            body_kept: true,
            request_id: self.request_id.clone(),
        };
        let mut response = super::outcome::replay(stored.clone(), self.claim.expires_at_ms);
        // The first answer is not a replay.
        response.headers_mut().remove(super::IDEMPOTENT_REPLAYED);
        response.extensions_mut().remove::<Verdict>();
        (Write::Complete(stored), response)
    }

    /// What a gRPC call's status `code` means when its answer is not to be
    /// stored: `None` to store it. No status at all is uncertain: the
    /// answer ended before saying how the call ended.
    fn grpc_unstored(&self, code: Option<u32>) -> Option<Write> {
        match code.map(super::outcome::grpc_meaning) {
            Some(GrpcMeaning::Stored) => None,
            Some(GrpcMeaning::Released) => Some(Write::Release),
            None | Some(GrpcMeaning::Uncertain) => {
                tracing::warn!(
                    route = %self.claim.key.route, key = %self.claim.key.escaped(), layer = self.layer,
                    grpc_status = ?code, hold = ?self.uncertain_hold,
                    "the gRPC call ended with a status that may mean it ran; the record is uncertain"
                );
                Some(Write::Uncertain {
                    hold: self.uncertain_hold,
                })
            }
        }
    }
}

/// The `grpc-status` of a whole gRPC answer: in the headers of a
/// trailers-only answer (no messages, no trailers), else in the trailers.
/// An answer that carries it in both places, or in its headers beside
/// messages, or several times in one place, says two things at once:
/// `None`, which makes it uncertain.
fn grpc_status(
    head: &http::HeaderMap,
    body: &[u8],
    trailers: Option<&http::HeaderMap>,
) -> Option<u32> {
    // Present: `Some`, holding the code when it is one readable value.
    let said = |fields: &http::HeaderMap| {
        fields
            .contains_key(grpc::GRPC_STATUS)
            .then(|| grpc::status(fields))
    };
    match (said(head), trailers.and_then(said)) {
        (Some(code), None) if body.is_empty() && trailers.is_none() => code,
        (None, Some(code)) => code,
        _ => None,
    }
}

/// The trailers a gRPC answer over `store.max_stored_body_bytes` is
/// replayed with: its own status was not kept, so the replay says that
/// the call ran once and what became of its answer (`UNKNOWN`: a generic
/// retry policy does not retry it).
fn omitted_grpc_answer() -> Vec<(String, Vec<u8>)> {
    vec![
        ("grpc-status".to_owned(), b"2".to_vec()),
        (
            "grpc-message".to_owned(),
            b"the call ran once; its answer was larger than store.max_stored_body_bytes and was not kept".to_vec(),
        ),
    ]
}

/// The answer to a request whose in-process handler stopped without an
/// answer (`what` it did): what stands, and how long its retry is held.
fn held_in_process(problem: Problem, what: &str, hold: Duration) -> Problem {
    let secs = hold.as_secs_f64().ceil().max(1.0) as u64;
    problem
        .detail(format!(
            "the handler {what} and may have acted before it stopped; work it started (a task it \
             spawned) may still be running, so a retry with the same key is held for {secs}s \
             (Retry-After), then runs the handler once more with the same key, for its own check"
        ))
        .retry_after(secs)
}

/// Renews the lease every third of its length until aborted, or until the
/// claim turns out to be taken over (then `lost` is set).
async fn renew<L: Ledger>(
    ledger: L,
    key: RecordKey,
    epoch: i64,
    claimed_at: tokio::time::Instant,
    lost: Arc<std::sync::atomic::AtomicBool>,
) {
    let every = ledger.lease() / 3;
    let mut next = claimed_at + every;
    loop {
        tokio::time::sleep_until(next).await;
        let pause = match await_boxed!(ledger.renew(&key, epoch)) {
            Ok(true) => every,
            Ok(false) => {
                lost.store(true, std::sync::atomic::Ordering::Relaxed);
                tracing::warn!(route = %key.route, key = %key.escaped(), epoch, layer = "holder", "lease lost while the claim was held");
                return;
            }
            Err(e) => {
                tracing::warn!(route = %key.route, key = %key.escaped(), epoch, layer = "holder", error = %e, "renewing the lease failed; trying again");
                RENEW_RETRY.min(every)
            }
        };
        next = tokio::time::Instant::now() + pause;
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct Registered {
    holders: Arc<Holders>,
    key: RecordKey,
    epoch: i64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.holders.remove(&self.key, self.epoch);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gRPC answer that states its status twice, or in its head beside
    /// messages, says two things: no status, so the record is uncertain.
    #[test]
    fn a_grpc_status_counts_only_where_grpc_puts_it() {
        let with = |code: &'static str| {
            let mut h = http::HeaderMap::new();
            h.insert("grpc-status", http::HeaderValue::from_static(code));
            h
        };
        let none = http::HeaderMap::new();
        assert_eq!(grpc_status(&with("9"), b"", None), Some(9), "trailers-only");
        assert_eq!(grpc_status(&none, b"m", Some(&with("0"))), Some(0));
        assert_eq!(grpc_status(&with("14"), b"m", Some(&with("0"))), None);
        assert_eq!(grpc_status(&with("0"), b"", Some(&with("13"))), None);
        assert_eq!(
            grpc_status(&with("14"), b"m", None),
            None,
            "a head status beside messages"
        );
        assert_eq!(grpc_status(&none, b"m", None), None, "no status at all");
        let mut twice = with("0");
        twice.append("grpc-status", http::HeaderValue::from_static("10"));
        assert_eq!(grpc_status(&none, b"m", Some(&twice)), None, "two statuses");
        assert_eq!(
            grpc_status(&twice, b"", None),
            None,
            "two statuses, trailers-only"
        );
    }
    use http::StatusCode;
    use std::sync::atomic::{AtomicU32, Ordering};

    use bytes::Bytes;
    use futures_util::StreamExt;
    use tokio::time::Instant;

    /// The record writes a holder made, with scripted failures.
    #[derive(Clone, Default)]
    struct Script {
        renewals: Arc<Mutex<Vec<Instant>>>,
        writes: Arc<Mutex<Vec<(Instant, Write)>>>,
        fail_writes: Arc<AtomicU32>,
    }

    impl Ledger for Script {
        fn lease(&self) -> Duration {
            Duration::from_secs(3)
        }

        async fn renew(&self, _: &RecordKey, _: i64) -> Result<bool, StoreError> {
            self.renewals.lock().unwrap().push(Instant::now());
            Ok(true)
        }

        async fn write(&self, _: &Claimed, write: &Write) -> Result<bool, StoreError> {
            self.writes
                .lock()
                .unwrap()
                .push((Instant::now(), write.clone()));
            if self
                .fail_writes
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                return Err(StoreError::Timeout {
                    op: "complete",
                    after: Duration::from_secs(1),
                });
            }
            Ok(true)
        }

        async fn settled(&self, _: &RecordKey, _: i64) -> Result<bool, StoreError> {
            Ok(false)
        }
    }

    fn holder(script: &Script, deadline: Duration) -> (Holder<Script>, Arc<Holders>) {
        let holders = Arc::new(Holders::default());
        let holder = Holder {
            ledger: script.clone(),
            holders: holders.clone(),
            claim: Claimed {
                key: RecordKey::new("scope", "route", "k"),
                fingerprint: "fp".into(),
                epoch: 1,
                expires_at_ms: 0,
            },
            request_id: "rid".into(),
            deadline,
            uncertain_hold: Duration::from_secs(2),
            uncertain_statuses: Default::default(),
            max_stored_body_bytes: 1024,
            share: AnswerShare::empty(&super::super::answer::AnswerBudget::unbounded()),
            layer: "test",
            in_process: false,
            claimed_at: Instant::now(),
        };
        (holder, holders)
    }

    /// An upstream that answers `status` at once, its body after `stall`.
    fn upstream(
        status: u16,
        stall: Duration,
    ) -> impl Service<
        Request<Body>,
        Response = Response<Body>,
        Error = Infallible,
        Future = impl Send,
    > + Send
    + 'static {
        tower::service_fn(move |_req: Request<Body>| async move {
            let body = futures_util::stream::once(async move {
                tokio::time::sleep(stall).await;
                Ok::<_, Infallible>(Bytes::from_static(b"{\"ok\":true}"))
            });
            let mut response = Response::new(Body::from_stream(body.boxed()));
            *response.status_mut() = StatusCode::from_u16(status).unwrap();
            Ok::<_, Infallible>(response)
        })
    }

    async fn run(
        holder: Holder<Script>,
        inner: impl Service<
            Request<Body>,
            Response = Response<Body>,
            Error = Infallible,
            Future = impl Send,
        > + Send
        + 'static,
    ) -> Option<Response<Body>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        holder
            .run(inner, Request::new(Body::empty()), move |r| {
                let _ = tx.send(r);
            })
            .await;
        rx.await.ok()
    }

    #[tokio::test(start_paused = true)]
    async fn the_lease_is_renewed_while_a_slow_body_arrives() {
        let script = Script::default();
        let (holder, _) = holder(&script, Duration::from_secs(30));
        let started = Instant::now();
        let response = run(holder, upstream(201, Duration::from_secs(7)))
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
        // Lease 3 s, renewed every second for the 7 s of body (the one due
        // at 7 s races the body's end).
        let renewals = script.renewals.lock().unwrap().clone();
        assert!(renewals.len() >= 6, "{renewals:?}");
        for pair in renewals.windows(2) {
            assert_eq!(pair[1] - pair[0], Duration::from_secs(1));
        }
        let writes = script.writes.lock().unwrap().clone();
        assert_eq!(writes.len(), 1);
        assert_eq!(writes[0].0 - started, Duration::from_secs(7));
        assert!(matches!(&writes[0].1, Write::Complete(s) if s.status == 201 && s.body_kept));
    }

    #[tokio::test(start_paused = true)]
    async fn the_whole_response_is_bounded_by_the_deadline_and_then_uncertain() {
        let script = Script::default();
        let (holder, holders) = holder(&script, Duration::from_secs(2));
        let key = holder.claim.key.clone();
        let task = tokio::spawn(run(holder, upstream(201, Duration::from_secs(60))));
        tokio::task::yield_now().await;
        // A waiter learns the outcome is uncertain: it must not be
        // forwarded beside a copy that may still run upstream.
        let mut outcome = holders.subscribe(&key, "fp").expect("registered");
        let seen = outcome.wait_for(|o| o.is_some()).await.map(|o| o.clone());
        assert!(matches!(seen, Ok(Some(Published::Uncertain))), "{seen:?}");
        let response = task.await.unwrap().unwrap();
        assert_eq!(response.status(), StatusCode::GATEWAY_TIMEOUT);
        let writes = script.writes.lock().unwrap().clone();
        assert_eq!(writes.len(), 1);
        assert_eq!(
            writes[0].1,
            Write::Uncertain {
                hold: Duration::from_secs(2)
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_write_is_retried_while_the_claim_stays_renewed() {
        let script = Script::default();
        script.fail_writes.store(4, Ordering::SeqCst);
        let (holder, holders) = holder(&script, Duration::from_secs(30));
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(holder.run(
            upstream(201, Duration::ZERO),
            Request::new(Body::empty()),
            move |r| {
                let _ = tx.send(r);
            },
        ));
        // The client has its answer after the first (failed) try.
        let answer = (&mut rx).await.unwrap();
        assert_eq!(answer.status(), 201);
        assert_eq!(holders.len(), 1, "still held while the write is retried");
        task.await.unwrap();
        let writes = script.writes.lock().unwrap().clone();
        assert_eq!(writes.len(), 5, "four failures, then durable");
        // 100 + 200 + 400 + 800 ms of backoff.
        assert_eq!(writes[4].0 - writes[0].0, Duration::from_millis(1500));
        assert!(holders.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_handler_that_panics_leaves_an_uncertain_record_not_a_stuck_claim() {
        let script = Script::default();
        let (holder, holders) = holder(&script, Duration::from_secs(30));
        let panicking = tower::service_fn(|_req: Request<Body>| async move {
            if true {
                panic!("the handler failed half-way");
            }
            Ok::<_, Infallible>(Response::new(Body::empty()))
        });
        let response = run(holder, panicking).await.unwrap();
        assert_eq!(response.status(), StatusCode::BAD_GATEWAY);
        // How long its retry is held, and why, said.
        assert_eq!(response.headers()["retry-after"], "2");
        let body = axum::body::to_bytes(response.into_body(), 4096)
            .await
            .unwrap();
        let detail = String::from_utf8_lossy(&body);
        assert!(
            detail.contains("held for 2s") && detail.contains("spawned"),
            "{detail}"
        );
        assert!(matches!(
            script.writes.lock().unwrap()[0].1,
            Write::Uncertain { .. }
        ));
        assert!(holders.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_goes_away_changes_nothing() {
        let script = Script::default();
        let (holder, holders) = holder(&script, Duration::from_secs(30));
        let (tx, rx) = tokio::sync::oneshot::channel::<Response<Body>>();
        drop(rx);
        holder
            .run(
                upstream(201, Duration::from_secs(2)),
                Request::new(Body::empty()),
                move |r| {
                    let _ = tx.send(r);
                },
            )
            .await;
        let writes = script.writes.lock().unwrap().clone();
        assert!(matches!(&writes[..], [(_, Write::Complete(s))] if s.status == 201));
        assert!(holders.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_see_the_stored_outcome_and_a_retry_after_a_release() {
        let script = Script::default();
        let (holder, holders) = holder(&script, Duration::from_secs(30));
        let key = holder.claim.key.clone();
        let task = tokio::spawn(run(holder, upstream(201, Duration::from_secs(1))));
        tokio::task::yield_now().await;
        assert!(holders.subscribe(&key, "another request").is_none());
        let mut outcome = holders.subscribe(&key, "fp").expect("registered");
        let seen = outcome.wait_for(|o| o.is_some()).await.unwrap().clone();
        assert!(matches!(seen, Some(Published::Stored(s, _)) if s.status == 201));
        task.await.unwrap();

        let (holder, holders) = self::holder(&script, Duration::from_secs(30));
        let task = tokio::spawn(run(holder, upstream(503, Duration::ZERO)));
        tokio::task::yield_now().await;
        if let Some(mut outcome) = holders.subscribe(&key, "fp") {
            let seen = outcome.wait_for(|o| o.is_some()).await.map(|o| o.clone());
            assert!(matches!(seen, Ok(Some(Published::Retry)) | Err(_)));
        }
        task.await.unwrap();
        assert_eq!(
            script.writes.lock().unwrap().last().unwrap().1,
            Write::Release
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_proxys_502_or_504_is_uncertain_and_relayed_as_sent() {
        for (status, uncertain) in [(502, true), (504, true), (500, false), (503, false)] {
            let script = Script::default();
            let (holder, _) = holder(&script, Duration::from_secs(30));
            let response = run(holder, upstream(status, Duration::ZERO)).await.unwrap();
            assert_eq!(response.status(), status, "relayed as the upstream sent it");
            let body = axum::body::to_bytes(response.into_body(), 1024)
                .await
                .unwrap();
            assert_eq!(&body[..], b"{\"ok\":true}");
            let writes = script.writes.lock().unwrap().clone();
            let expected = match uncertain {
                true => Write::Uncertain {
                    hold: Duration::from_secs(2),
                },
                false => Write::Release,
            };
            assert_eq!(writes[0].1, expected, "{status}");
        }
        // A service that may fail after its commit: 500 listed too.
        let script = Script::default();
        let (mut holder, _) = holder(&script, Duration::from_secs(30));
        holder.uncertain_statuses =
            super::super::outcome::UncertainStatuses::new(&[500, 502, 504]).unwrap();
        run(holder, upstream(500, Duration::ZERO)).await.unwrap();
        assert!(matches!(
            script.writes.lock().unwrap()[0].1,
            Write::Uncertain { .. }
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_drain_waits_for_holders_and_gives_up_after_the_grace() {
        let script = Script::default();
        let (holder, holders) = holder(&script, Duration::from_secs(30));
        tokio::spawn(run(holder, upstream(201, Duration::from_secs(5))));
        tokio::task::yield_now().await;
        let started = Instant::now();
        holders.drain(Duration::from_secs(2)).await;
        assert_eq!(started.elapsed(), Duration::from_secs(2));
        assert_eq!(holders.len(), 1);
        holders.drain(Duration::from_secs(10)).await;
        assert!(holders.is_empty());
        assert!(started.elapsed() < Duration::from_secs(6));
    }
}
