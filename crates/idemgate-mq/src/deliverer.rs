//! [`Deliverer`]: one consumer's messages, each turned into a request and
//! run through the engine, and what the engine's verdict means for the
//! broker ([`Disposition`]): acknowledge, try again, or dead-letter.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Method, Request, StatusCode, header};
use idemgate::idempotency::Verdict;
use idemgate::idempotency::{Engine, Head, Policy};
use idemgate_core::error::{Problem, Reason};
use idemgate_core::metrics::{ConsumerCounters, MessageOutcome};
use idemgate_core::trace;
use idemgate_proxy::Proxy;
use idemgate_store::{DeadLetterClaim, DeliveryLog};
use idemgate_store::{RecordKey, key_ref};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::key::{KeyedMessage, delivery_row, keyless_mark, message_key, message_match_values};
use crate::{
    CONSUMER_SCOPE, ConsumerSettings, Disposition, Message, X_DELIVERY_COUNT, X_MSG_ID, X_TOPIC,
};

/// Delivers messages of one consumer through the engine.
pub struct Deliverer {
    pub(crate) settings: ConsumerSettings,
    pub(crate) engine: Engine,
    pub(crate) proxy: Proxy,
    pub(crate) counters: Arc<ConsumerCounters>,
    /// Its messages' failed attempts and dead-letter leases, in the store.
    pub(crate) deliveries: DeliveryLog,
}

/// How long a delivery is tried again in this process (store outage,
/// copy in flight elsewhere) before it goes back to the broker.
pub const MAX_IN_PROCESS_WAIT: Duration = Duration::from_secs(300);

impl Deliverer {
    /// A deliverer over an engine whose route is the consumer's name and a
    /// proxy to its upstream.
    pub fn new(
        settings: ConsumerSettings,
        engine: Engine,
        proxy: Proxy,
        counters: Arc<ConsumerCounters>,
    ) -> Self {
        Deliverer {
            deliveries: engine.store().delivery_log(&settings.records),
            settings,
            engine,
            proxy,
            counters,
        }
    }

    /// The consumer's settings.
    pub fn settings(&self) -> &ConsumerSettings {
        &self.settings
    }

    /// The consumer's counters.
    pub fn counters(&self) -> &ConsumerCounters {
        &self.counters
    }

    /// Delivers one message until there is a verdict for the broker:
    /// [`Disposition::Wait`] is tried again here, after its delay, for up to
    /// [`MAX_IN_PROCESS_WAIT`] — a broker never sees a store outage as a
    /// failed delivery (quorum queues drop a message after their
    /// `delivery-limit` of requeues). `keep` runs between tries (NATS:
    /// extends the ack deadline). A stop hands the message back at once.
    pub async fn decide<F, K>(
        &self,
        message: &Message,
        stop: &CancellationToken,
        mut keep: K,
    ) -> Disposition
    where
        K: FnMut() -> F,
        F: std::future::Future<Output = ()>,
    {
        let mut waited = Duration::ZERO;
        // Decided for the dead letters: from here on only its copy lease is
        // tried for, never the upstream again.
        let mut dead: Option<String> = None;
        loop {
            let verdict = match dead.take() {
                None => self.deliver(message).await,
                Some(reason) => Disposition::dead_letter(reason),
            };
            let delay = match verdict {
                Disposition::Wait(delay) => delay,
                // One copy, whichever instance decided it: published by
                // the holder of the message's copy lease alone.
                Disposition::DeadLetter { reason, .. } => {
                    let holder = uuid::Uuid::now_v7().to_string();
                    match self.lease_dead_letter(message, &holder).await {
                        Ok(DeadLetterClaim::Won(copy)) => {
                            return Disposition::DeadLetter {
                                reason,
                                copy,
                                holder,
                            };
                        }
                        // Its copy is stored — acknowledged once no attempt
                        // of its key is open (a re-publish of it at the
                        // upstream elsewhere), as a redelivery would be.
                        Ok(DeadLetterClaim::Copied) => match self.key_of(message) {
                            Ok(key) if self.attempt_open(key).await != Ok(false) => {
                                dead = Some(reason);
                                self.settings.retry_delay
                            }
                            _ => return Disposition::Ack(MessageOutcome::Duplicate),
                        },
                        // Another instance is publishing it (or the store
                        // is away): wait, and find the copy stored — or
                        // its lease lapsed.
                        Ok(DeadLetterClaim::Busy) | Err(()) => {
                            dead = Some(reason);
                            self.settings.retry_delay
                        }
                    }
                }
                verdict => return verdict,
            };
            if stop.is_cancelled() || waited >= MAX_IN_PROCESS_WAIT {
                return Disposition::Retry(delay);
            }
            self.counters.record(MessageOutcome::Retried);
            let _waiting = self.counters.wait();
            tokio::select! {
                _ = stop.cancelled() => return Disposition::Retry(Duration::ZERO),
                _ = tokio::time::sleep(delay) => {}
            }
            waited += delay;
            keep().await;
        }
    }

    /// One try through the engine. (Long by design: the checks before a
    /// message may go — its key, its past failures and dead-letter mark in
    /// the store, an attempt still open — then the try, in that order.)
    pub(crate) async fn deliver(&self, message: &Message) -> Disposition {
        let name = &self.settings.name;
        // A redelivery: how it went before, on any instance, is in the
        // store (failed attempts only: store outages and copies in flight
        // elsewhere do not bring a message nearer the dead letters). A
        // fresh delivery — most messages — never reads it.
        let fresh = message.delivery_count <= 1;
        let key = match self.key_of(message) {
            Ok(key) => key.clone(),
            Err(e) => {
                // Its dead-letter copy may be stored already (the ack after
                // it was lost): recorded under the message's own identity.
                if let Some(mark) = keyless_mark(message)
                    && !fresh
                    && self.settings.source.copies_dead_letters()
                {
                    match self.deliveries.delivery(&mark).await {
                        Ok((_, true)) => return Disposition::Ack(MessageOutcome::Duplicate),
                        Ok(_) => {}
                        Err(_) => return Disposition::Wait(self.settings.retry_delay),
                    }
                }
                return Disposition::dead_letter(format!("no usable business key: {e}"));
            }
        };
        // A dead-letter copy moved back to the source (a replay) is counted
        // and marked apart from its original: never settled by the mark
        // the original left, and dead-lettered once itself.
        let row = delivery_row(&key, message);
        let (failures, dead_lettered) = match fresh {
            true => (0, false),
            false => match self.deliveries.delivery(&row).await {
                Ok(found) => found,
                // Fail closed: nothing is forwarded while the store is away.
                Err(_) => return Disposition::Wait(self.settings.retry_delay),
            },
        };
        let copied = dead_lettered && self.settings.source.copies_dead_letters();
        if copied || failures >= self.settings.max_deliveries {
            // What the store says was the end of this key — once no
            // attempt of it is open (a re-publish of it at the upstream, an
            // uncertain try within its hold): until then the message waits,
            // neither acknowledged beside that attempt nor sent again.
            match self.attempt_open(&key).await {
                Err(()) | Ok(true) => return Disposition::Wait(self.settings.retry_delay),
                // Its dead-letter copy is stored and the ack was lost:
                // done, and no second copy.
                Ok(false) if copied => return Disposition::Ack(MessageOutcome::Duplicate),
                // Out of attempts already (its dead-letter copy failed
                // before): straight to the dead letters, not upstream again.
                Ok(false) => {
                    return Disposition::dead_letter(format!(
                        "the upstream failed {failures} time(s)"
                    ));
                }
            }
        }
        let request = self.request(message, failures + 1);
        // The same message whenever its key is: a broker's redelivery or a
        // producer's re-publish with a new timestamp is not a new message.
        let values = message_match_values(&self.settings.must_match, message);
        let names: Vec<String> = self
            .settings
            .must_match
            .iter()
            .map(|m| m.describe())
            .collect();
        let fingerprint = idemgate::idempotency::body::key_fingerprint(
            &key,
            names
                .iter()
                .map(String::as_str)
                .zip(values.iter().map(Option::as_deref)),
        );
        let policy = MessagePolicy {
            key: key.clone(),
            fingerprint,
        };
        let span = trace::enabled().then(|| self.message_span(message));
        let handled = self.engine.handle(policy, self.proxy.clone(), request);
        let answer = match &span {
            Some(span) => handled.instrument(span.clone()).await,
            None => handled.await,
        };
        let response = answer.response;
        let verdict = self
            .judge(&row, fresh, answer.verdict, response.status())
            .await;
        if let Some(span) = &span {
            span.record("outcome", verdict.name());
            span.record("http.response.status_code", response.status().as_u16());
        }
        match &verdict {
            Disposition::Ack(_) | Disposition::Wait(_) => {}
            Disposition::DeadLetter { reason, .. } => {
                tracing::error!(consumer = %name, key = %key_ref(&key), topic = %message.topic.escape_debug(), reason = %reason, layer = "consumer", "dead-lettering the message");
            }
            Disposition::Retry(_) => {
                tracing::warn!(consumer = %name, key = %key_ref(&key), status = response.status().as_u16(), layer = "consumer", "delivery failed; the message is delivered again");
            }
        }
        verdict
    }

    /// Whether `key` has an attempt that has not ended: a record in flight
    /// under a live lease (its holder may be at the upstream) or uncertain
    /// within its hold. An uncertain record past its hold is no attempt:
    /// the dead letters already hold the message. `Err`: the store did not
    /// answer (nothing is decided without it).
    pub(crate) async fn attempt_open(&self, key: &str) -> Result<bool, ()> {
        self.deliveries.attempt_open(key).await.map_err(|_| ())
    }

    /// A delivery's span (traces on), continuing the producer's trace when
    /// the message carries a `traceparent` header.
    pub(crate) fn message_span(&self, message: &Message) -> tracing::Span {
        let span = tracing::info_span!(
            target: trace::TARGET,
            "message",
            otel.name = %format_args!("process {}", self.settings.name),
            otel.kind = "consumer",
            consumer = %self.settings.name,
            messaging.destination.name = %message.topic.escape_debug(),
            delivery_count = message.delivery_count,
            http.response.status_code = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        let mut context = http::HeaderMap::new();
        for name in ["traceparent", "tracestate"] {
            if let Some(Ok(value)) = message.header(name)
                && let Ok(value) = HeaderValue::from_str(&value)
            {
                context.insert(name, value);
            }
        }
        if !context.is_empty() {
            trace::continue_from(&context, &span);
        }
        span
    }

    /// Counts a verdict once the broker carried it out, or an error.
    pub fn settled(&self, message: &Message, verdict: &Disposition, broker: Result<(), String>) {
        let outcome = match (verdict, broker) {
            (_, Err(e)) => {
                tracing::warn!(consumer = %self.settings.name, error = %e, layer = "consumer", "the broker did not take the acknowledgement or dead letter; the message is delivered again");
                MessageOutcome::Error
            }
            (Disposition::Ack(outcome), Ok(())) => *outcome,
            (Disposition::Retry(_) | Disposition::Wait(_), Ok(())) => MessageOutcome::Retried,
            (Disposition::DeadLetter { .. }, Ok(())) => MessageOutcome::DeadLettered,
        };
        let _ = message;
        self.counters.record(outcome);
    }

    /// The request for `message`'s `attempt`-th delivery to the upstream.
    pub(crate) fn request(&self, message: &Message, attempt: u32) -> Request<Body> {
        let mut request = Request::new(Body::from(message.body.clone()));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = http::Uri::from(self.settings.path.clone());
        let headers = request.headers_mut();
        let content_type = message
            .content_type
            .as_deref()
            .and_then(|c| HeaderValue::from_str(c).ok())
            .unwrap_or(HeaderValue::from_static("application/octet-stream"));
        headers.insert(header::CONTENT_TYPE, content_type);
        if let Some(id) = message
            .id
            .as_deref()
            .and_then(|id| HeaderValue::from_bytes(id.as_bytes()).ok())
        {
            headers.insert(X_MSG_ID, id);
        }
        // UTF-8 ids and topics go as their bytes (obs-text), not dropped.
        if let Ok(topic) = HeaderValue::from_bytes(message.topic.as_bytes()) {
            headers.insert(X_TOPIC, topic);
        }
        // The upstream's own count: attempts that reached it, on any
        // instance (a broker's redelivered flag says only "not the first").
        headers.insert(X_DELIVERY_COUNT, HeaderValue::from(attempt));
        if let Ok(id) = HeaderValue::from_str(&uuid::Uuid::now_v7().to_string()) {
            headers.insert(idemgate_core::request_id::X_REQUEST_ID, id);
        }
        request
    }

    /// What the broker is told, from what the engine did; a failed
    /// upstream attempt is counted in the store, for every instance.
    pub(crate) async fn judge(
        &self,
        row: &str,
        fresh: bool,
        verdict: Verdict,
        status: StatusCode,
    ) -> Disposition {
        let wait = Disposition::Wait(self.settings.retry_delay);
        match verdict {
            // Acknowledged only once the outcome is durable (or was, for a
            // duplicate).
            Verdict::Recorded => return Disposition::Ack(MessageOutcome::Forwarded),
            Verdict::Replayed => return Disposition::Ack(MessageOutcome::Duplicate),
            // Redelivered after its record's retention, within its
            // tombstone: it was handled long ago; never executed again.
            Verdict::Refused(Reason::IdempotencyKeyExpired) => {
                return Disposition::Ack(MessageOutcome::Duplicate);
            }
            Verdict::Refused(Reason::IdempotencyKeyReused | Reason::BusinessKeyReused) => {
                return Disposition::dead_letter(
                    "its key was first used for a message whose must_match fields differ".into(),
                );
            }
            Verdict::Refused(Reason::BodyTooLarge) => {
                return Disposition::dead_letter(
                    "the message is over server.max_body_bytes".into(),
                );
            }
            // Nothing was forwarded: the message waits for the store, a
            // budget, or the copy in flight (here or on another instance).
            // A recordable outcome whose write has not landed yet waits
            // too: the holder keeps writing, and the next try finds it.
            Verdict::StoreDown
            | Verdict::InFlight
            | Verdict::Recording
            | Verdict::Refused(Reason::ClaimsExhausted | Reason::BuffersExhausted) => {
                return wait;
            }
            _ => {}
        }
        let failures = match self.deliveries.count_failure(row, fresh).await {
            Ok(failures) => failures,
            // Not counted (the store went away): delivered again; the
            // next failure is counted.
            Err(_) => return Disposition::Retry(self.settings.retry_delay),
        };
        if failures >= self.settings.max_deliveries {
            return Disposition::dead_letter(format!(
                "the upstream failed {failures} time(s), the last with {}",
                status.as_u16()
            ));
        }
        Disposition::Retry(self.settings.retry_delay)
    }

    pub(crate) fn key_of<'m>(
        &self,
        message: &'m Message,
    ) -> &'m Result<String, idemgate::callback::BusinessKeyError> {
        message
            .key
            .get_or_init(|| message_key(&self.settings.sources, message))
    }
}

/// The key is the message's, read before the engine runs; so is its
/// fingerprint (the key and its `must_match` fields).
#[derive(Clone)]
struct MessagePolicy {
    key: String,
    fingerprint: String,
}

impl Policy for MessagePolicy {
    const LAYER: &'static str = "consumer";

    const CLIENT_SCOPED: bool = false;

    fn fingerprint(&self, _: &Parts, _: &Bytes, _: &str) -> Option<String> {
        Some(self.fingerprint.clone())
    }

    type BodyKey = Infallible;

    fn key_in_body(&self, from: Infallible, _: &Parts, _: &Bytes) -> Result<String, Problem> {
        match from {}
    }

    fn key_in_head(&self, _parts: &Parts, _scope: &str) -> Result<Head, Problem> {
        Ok(Head::Key(self.key.clone()))
    }

    fn record_key(&self, _client_scope: String, route: &str, key: String) -> RecordKey {
        RecordKey::new(CONSUMER_SCOPE, route, key)
    }
}
