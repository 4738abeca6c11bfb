//! The engine: scope + key → claim → forward → store the outcome → replay.
//!
//! Ordering is the guarantee:
//! 1. Everything that can refuse a request without the store (policy, body
//!    limit) runs first, so bad input leaves no record.
//! 2. The claim is durable in SQL before the request is forwarded (the
//!    store's `claim`); if the store cannot answer, the request is refused
//!    503 and never forwarded — fail closed.
//! 3. While the upstream works, the lease is renewed every third of its
//!    length, so a slow request is not taken over by a retry.
//! 4. The outcome decides the record: a stored status completes it; a 5xx,
//!    408/409/425/429 or a request that never left releases it (the retry
//!    executes again); a request that reached the upstream without an answer
//!    coming back (timeout, reset, body cut) marks it uncertain, and the next
//!    retry is forwarded again — one at a time, with the same key, so the
//!    upstream's own state check decides.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode, header};
use sha2::{Digest, Sha256};
use tower::{Service, ServiceExt};

use super::body::{BodyError, Captured, capture, chain, read_and_fingerprint};
use super::layer::{Head, Policy};
use super::{IDEMPOTENCY_KEY, IDEMPOTENT_BODY_OMITTED, IDEMPOTENT_REPLAYED};
use crate::config::OnConcurrent;
use crate::error::Problem;
use crate::identity::scope_of;
use crate::metrics::{Metrics, Outcome};
use crate::proxy::{ForwardFailure, is_hop_by_hop};
use crate::request_id::X_REQUEST_ID;
use crate::store::{Claim, RecordKey, StoreError, StoredResponse};

/// Why the engine answered a request itself.
#[derive(Debug, thiserror::Error)]
pub enum IdempotencyError {
    #[error("request body over {limit} bytes")]
    BodyTooLarge { limit: u64 },
    #[error("request body unreadable: {0}")]
    BadBody(String),
    #[error("request body not received within {0:?}")]
    BodyTimeout(Duration),
    #[error("key reused for a different request")]
    Mismatch,
    #[error("a request with this key is in flight")]
    InFlight { retry_after: Duration },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Per-route settings of the engine.
#[derive(Clone)]
pub struct EngineSettings {
    pub route: Arc<str>,
    pub identity_header: HeaderName,
    pub max_body_bytes: u64,
    /// Bound on receiving the whole request body.
    pub body_read_timeout: Duration,
    pub max_stored_body_bytes: usize,
    pub on_concurrent: OnConcurrent,
    /// How long a waiting duplicate waits (the upstream's timeout).
    pub wait_limit: Duration,
}

/// The shared engine of one route.
#[derive(Clone)]
pub struct Engine {
    store: crate::store::Store,
    settings: Arc<EngineSettings>,
    metrics: Arc<Metrics>,
}

/// First poll delay of a waiting duplicate; it doubles up to the maximum.
const WAIT_POLL_START: Duration = Duration::from_millis(5);
const WAIT_POLL_MAX: Duration = Duration::from_millis(100);

impl Engine {
    /// An engine for one route.
    pub fn new(
        store: crate::store::Store,
        settings: EngineSettings,
        metrics: Arc<Metrics>,
    ) -> Self {
        Engine {
            store,
            settings: Arc::new(settings),
            metrics,
        }
    }

    /// Handles one request on a protected route.
    pub async fn handle<S, P>(&self, policy: P, inner: S, req: Request<Body>) -> Response<Body>
    where
        S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Send,
        S::Future: Send,
        P: Policy,
    {
        let (parts, body) = req.into_parts();
        let scope = scope_of(&parts.headers, &self.settings.identity_header);
        let head = match policy.key_in_head(&parts, &scope) {
            Ok(head) => head,
            Err(problem) => {
                return problem
                    .logged(P::LAYER, "refused before the store")
                    .into_response();
            }
        };
        if let Head::Bypass = head {
            return forward_plain(inner, Request::from_parts(parts, body)).await;
        }
        // A slow-drip body must not hold a connection (and, later, a claim)
        // forever: the whole body arrives within the deadline or the
        // request is refused before anything is stored.
        let deadline = self.settings.body_read_timeout;
        let read = read_and_fingerprint(&parts, body, self.settings.max_body_bytes);
        let (bytes, fingerprint) = match tokio::time::timeout(deadline, read).await {
            Ok(Ok(read)) => read,
            Ok(Err(BodyError::TooLarge { limit })) => {
                return self.refuse::<P>(IdempotencyError::BodyTooLarge { limit }, None);
            }
            Ok(Err(BodyError::Broken(e))) => {
                return self.refuse::<P>(IdempotencyError::BadBody(e), None);
            }
            Err(_) => return self.refuse::<P>(IdempotencyError::BodyTimeout(deadline), None),
        };
        let (key, replay_only) = match head {
            Head::Key(key) => (key, None),
            Head::ReplayOnly { key, refusal } => (key, Some(refusal)),
            Head::FromBody => match policy.key_in_body(&parts, &bytes) {
                Ok(key) => (key, None),
                Err(problem) => {
                    return problem
                        .logged(P::LAYER, "refused before the store")
                        .into_response();
                }
            },
            Head::Bypass => unreachable!("handled above"),
        };
        let key = RecordKey::new(scope, &*self.settings.route, key);
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

        let deadline = Instant::now() + self.settings.wait_limit;
        let mut pause = WAIT_POLL_START;
        loop {
            match self.store.claim(&key, &fingerprint, &request_id).await {
                Err(e) => return self.refuse::<P>(e.into(), Some(&key)),
                Ok(Claim::Completed(stored)) => return replay(stored),
                Ok(Claim::Mismatch) => {
                    return self.refuse::<P>(IdempotencyError::Mismatch, Some(&key));
                }
                Ok(Claim::InFlight { retry_after }) => {
                    let wait = self.settings.on_concurrent == OnConcurrent::Wait;
                    if wait && Instant::now() + pause < deadline {
                        // Poll the claim: it answers from the fast layer
                        // while the marker stands, replays once the first
                        // request completed (in this process or another),
                        // and wins if the first one was released.
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(WAIT_POLL_MAX);
                        continue;
                    }
                    return self
                        .refuse::<P>(IdempotencyError::InFlight { retry_after }, Some(&key));
                }
                Ok(Claim::Won { epoch }) => {
                    let claim = Claimed {
                        key: &key,
                        fingerprint: &fingerprint,
                        epoch,
                        request_id: &request_id,
                    };
                    return self.forward(&policy, inner, parts, bytes, claim).await;
                }
            }
        }
    }

    async fn replay_or_refuse<P: Policy>(
        &self,
        key: &RecordKey,
        fingerprint: &str,
        refusal: Problem,
    ) -> Response<Body> {
        match self.store.get(key).await {
            Ok(Some(record)) if record.fingerprint == fingerprint => match record.response {
                Some(stored) => replay(stored),
                None => refusal
                    .logged(P::LAYER, "expired token, no stored outcome")
                    .into_response(),
            },
            Ok(_) => refusal
                .logged(P::LAYER, "expired token, no stored outcome")
                .into_response(),
            Err(e) => self.refuse::<P>(e.into(), Some(key)),
        }
    }

    async fn forward<S, P>(
        &self,
        policy: &P,
        inner: S,
        mut parts: Parts,
        body: Bytes,
        claim: Claimed<'_>,
    ) -> Response<Body>
    where
        S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Send,
        S::Future: Send,
        P: Policy,
    {
        let Claimed {
            key,
            fingerprint,
            epoch,
            request_id,
        } = claim;
        policy.strip(&mut parts.headers);
        parts.headers.insert(IDEMPOTENCY_KEY, stable_key(key));
        let request = Request::from_parts(parts, Body::from(body));

        self.metrics
            .claims_in_flight
            .fetch_add(1, Ordering::Relaxed);
        let response = self
            .with_renewal(key, epoch, forward_plain(inner, request))
            .await;
        self.metrics
            .claims_in_flight
            .fetch_sub(1, Ordering::Relaxed);

        match response.extensions().get::<ForwardFailure>() {
            Some(ForwardFailure::NotSent) => {
                self.settle(key, epoch, Settle::Release, P::LAYER).await;
                return response;
            }
            Some(ForwardFailure::Uncertain) => {
                self.settle(key, epoch, Settle::Uncertain, P::LAYER).await;
                return response;
            }
            None => {}
        }
        if !is_stored(response.status()) {
            self.settle(key, epoch, Settle::Release, P::LAYER).await;
            return response;
        }
        let (parts, body) = response.into_parts();
        let (kept, client_body) = match capture(body, self.settings.max_stored_body_bytes).await {
            Captured::Whole(bytes) => (Some(bytes.clone()), Body::from(bytes)),
            Captured::TooLarge(prefix, rest) => (None, chain(prefix, rest)),
            Captured::Broken(cause) => {
                // The upstream answered the head, then broke: it executed,
                // but the client never got the outcome.
                self.settle(key, epoch, Settle::Uncertain, P::LAYER).await;
                return Problem::new(
                    StatusCode::BAD_GATEWAY,
                    "upstream-broken",
                    "The upstream connection failed before a complete answer",
                )
                .logged(P::LAYER, format!("response body cut: {cause}"))
                .into_response();
            }
        };
        let stored = StoredResponse {
            status: parts.status.as_u16(),
            headers: storable_headers(&parts.headers),
            body_kept: kept.is_some(),
            body: kept.unwrap_or_default(),
            request_id: request_id.to_owned(),
        };
        match self.store.complete(key, epoch, fingerprint, &stored).await {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                route = %key.route, key = %key.escaped(), layer = P::LAYER, epoch,
                "completion refused: the claim was taken over while this request ran"
            ),
            Err(e) => tracing::error!(
                route = %key.route, key = %key.escaped(), layer = P::LAYER, error = %e,
                "outcome not recorded; a retry after the lease will be forwarded with the same key"
            ),
        }
        Response::from_parts(parts, client_body)
    }

    /// Drives `forward`, renewing the lease every third of its length.
    async fn with_renewal(
        &self,
        key: &RecordKey,
        epoch: i64,
        forward: impl std::future::Future<Output = Response<Body>>,
    ) -> Response<Body> {
        let every = self.store.settings().lease / 3;
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tokio::pin!(forward);
        loop {
            tokio::select! {
                response = &mut forward => return response,
                _ = ticker.tick() => {
                    if let Ok(false) = self.store.renew(key, epoch).await {
                        tracing::warn!(route = %key.route, key = %key.escaped(), epoch, layer = "engine", "lease lost while the request ran");
                    }
                }
            }
        }
    }

    async fn settle(&self, key: &RecordKey, epoch: i64, how: Settle, layer: &'static str) {
        let result = match how {
            Settle::Release => self.store.release(key, epoch).await,
            Settle::Uncertain => self.store.mark_uncertain(key, epoch).await,
        };
        if let Err(e) = result {
            // The claim stays in flight until its lease runs out; retries
            // get 409 meanwhile, never a second execution.
            tracing::error!(route = %key.route, key = %key.escaped(), layer, error = %e, ?how, "could not settle the claim");
        }
    }

    fn refuse<P: Policy>(
        &self,
        error: IdempotencyError,
        key: Option<&RecordKey>,
    ) -> Response<Body> {
        let mut problem = Problem::from(&error);
        if let Some(key) = key {
            problem = problem.logged(P::LAYER, format!("key {}: {error}", key.escaped()));
        }
        let mut response = problem.into_response();
        let outcome = match error {
            IdempotencyError::Mismatch => Some(Outcome::Mismatch),
            IdempotencyError::InFlight { .. } => Some(Outcome::Conflict),
            _ => None,
        };
        if let Some(outcome) = outcome {
            response.extensions_mut().insert(outcome);
        }
        response
    }
}

/// A won claim, as the forward needs it.
struct Claimed<'a> {
    key: &'a RecordKey,
    fingerprint: &'a str,
    epoch: i64,
    request_id: &'a str,
}

#[derive(Debug, Clone, Copy)]
enum Settle {
    Release,
    Uncertain,
}

async fn forward_plain<S>(inner: S, request: Request<Body>) -> Response<Body>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Send,
    S::Future: Send,
{
    match inner.oneshot(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

/// Outcomes that are recorded and replayed: the upstream acted (or refused
/// for good). 5xx and the "try again" statuses are not: the retry runs.
/// 3xx is stored too: a `303 See Other` after a POST means it executed.
pub fn is_stored(status: StatusCode) -> bool {
    let code = status.as_u16();
    (200..500).contains(&code) && !matches!(code, 408 | 409 | 425 | 429)
}

/// The key forwarded upstream: the same on every retry of one request and
/// different for different clients, routes and keys.
pub fn stable_key(key: &RecordKey) -> HeaderValue {
    let mut hash = Sha256::new();
    hash.update(b"idemgate/forwarded-key/v1\0");
    for part in [&key.scope, &key.route, &key.key] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part.as_bytes());
    }
    let text = format!("ig-{}", hex::encode(&hash.finalize()[..20]));
    HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static("ig-invalid"))
}

/// Headers kept for replay: end-to-end ones, minus `Set-Cookie` (a session
/// must never be handed to whoever replays) and those the replay sets.
fn storable_headers(headers: &http::HeaderMap) -> Vec<(String, Vec<u8>)> {
    headers
        .iter()
        .filter(|(name, _)| {
            !is_hop_by_hop(name)
                && *name != header::SET_COOKIE
                && *name != header::CONTENT_LENGTH
                && *name != X_REQUEST_ID
        })
        .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
        .collect()
}

/// The stored outcome as a response.
pub fn replay(stored: StoredResponse) -> Response<Body> {
    let mut response = Response::new(Body::from(stored.body));
    *response.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(&value),
        ) {
            headers.append(name, value);
        }
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    if !stored.body_kept {
        headers.insert(IDEMPOTENT_BODY_OMITTED, HeaderValue::from_static("true"));
    }
    if let Ok(id) = HeaderValue::from_str(&stored.request_id)
        && !stored.request_id.is_empty()
    {
        headers.insert(X_REQUEST_ID, id);
    }
    response.extensions_mut().insert(Outcome::Replayed);
    response
}
