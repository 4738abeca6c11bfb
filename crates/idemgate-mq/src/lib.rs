//! The MQ link (docs/semantics.md, "Queues"): consume from RabbitMQ, NATS JetStream or Redis Streams and
//! deliver each message to an upstream over HTTP once.
//!
//! A broker delivers at least once: a failover, or a consumer killed before
//! its ack, delivers a message again that was already processed. Each
//! delivery is turned into a request — `POST path` with the message body,
//! the stable key as `Idempotency-Key`, the id, topic and delivery count as
//! headers — and run through the same [`Engine`] as a callback route, keyed
//! by the message's business key ([`key`]). What the engine answers decides
//! the acknowledgement ([`Verdict`]):
//!
//! - a recorded outcome (the holder's first write landed) or a replay of one:
//!   acknowledged — the ack comes after the record is durable, so a crash in
//!   between redelivers a message the store already answers;
//! - an upstream failure (5xx, refusal, timeout, uncertain): delivered again
//!   after `retry_delay`, dead-lettered after `max_deliveries` failures;
//! - the store unreachable, or a copy in flight elsewhere: delivered again
//!   after `retry_delay`, and never dead-lettered for it (the message waits);
//! - a message without a usable key, too large, or whose key was first used
//!   for a different body: dead-lettered at once, never forwarded.
//!
//! `amqp`, `nats` and `redis_streams` own the broker connections: consuming, acks,
//! dead-letter publishing, reconnecting with backoff, and the graceful stop.

#[cfg(feature = "amqp")]
mod amqp;
pub mod key;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "redis-streams")]
mod redis_streams;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use std::convert::Infallible;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, HeaderValue, Method, Request, StatusCode, header};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use key::{
    DEFAULT_MESSAGE_KEY, KeyedMessage, MessageKeySource, message_key, message_match_values,
};

use idemgate::idempotency::Verdict as EngineVerdict;
use idemgate::idempotency::{Engine, Head, Policy};
use idemgate_core::error::{Problem, Reason};
use idemgate_core::metrics::{ConsumerCounters, MessageOutcome};
use idemgate_core::trace;
use idemgate_proxy::Proxy;
use idemgate_store::sql::DeadLetterClaim;
use idemgate_store::{RecordKey, key_ref};
use tracing::Instrument;

/// `X-Msg-Id`: the message's id, as the upstream receives it.
pub const X_MSG_ID: HeaderName = HeaderName::from_static("x-msg-id");
/// `X-Topic`: the routing key or subject.
pub const X_TOPIC: HeaderName = HeaderName::from_static("x-topic");
/// `X-Delivery-Count`: how many times the broker has delivered it (1 the
/// first time).
pub const X_DELIVERY_COUNT: HeaderName = HeaderName::from_static("x-delivery-count");

/// The scope of every consumer record: the consumer is the sender.
pub const CONSUMER_SCOPE: &str = "consumer";

/// First pause before reconnecting to a broker; it doubles.
pub const RECONNECT_START: Duration = Duration::from_millis(100);
/// Longest pause between two connection attempts.
pub const RECONNECT_MAX: Duration = Duration::from_secs(5);

/// Where a consumer reads from.
#[derive(Debug, Clone)]
pub enum Source {
    /// A RabbitMQ queue, and where its dead letters go.
    Amqp {
        url: String,
        queue: String,
        dead_letter: DeadLetters,
    },
    /// A durable pull consumer of a JetStream stream, and the subject its
    /// dead letters go to.
    Nats {
        url: String,
        stream: String,
        durable: String,
        dead_letter: String,
    },
    /// A consumer group of a Redis stream.
    Redis(StreamSource),
}

/// Where a RabbitMQ queue's dead letters go unless `dead_letter` says
/// otherwise.
pub fn default_dead_letter_queue(queue: &str) -> String {
    format!("{queue}.dlq")
}

/// Where a JetStream stream's dead letters go unless `dead_letter` says
/// otherwise.
pub fn default_dead_letter_subject(stream: &str) -> String {
    format!("{stream}.dlq")
}

/// Where a Redis stream's dead letters go unless `dead_letter` says
/// otherwise.
pub fn default_dead_letter_stream(stream: &str) -> String {
    format!("{stream}.dlq")
}

/// What one Redis Streams consumer reads.
#[derive(Debug, Clone)]
pub struct StreamSource {
    /// `redis://…` or `rediss://…`.
    pub url: String,
    /// The stream.
    pub stream: String,
    /// The consumer group.
    pub group: String,
    /// Entries pending longer than this on any consumer are claimed.
    pub claim_idle: Duration,
    /// The stream dead letters are added to.
    pub dead_letter: String,
}

/// Where a RabbitMQ consumer's dead letters go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeadLetters {
    /// A copy to this queue of Idemgate's own, published with confirms,
    /// the reason as a header; the original is acknowledged after.
    Queue(String),
    /// Rejected without requeue: the broker routes it to the queue's own
    /// dead-letter exchange (its owner's policy or `x-dead-letter-exchange`)
    /// with its `x-death` history. Without one the broker drops it.
    Dlx,
}

impl Source {
    /// Whether a dead letter is a copy Idemgate publishes (recorded in the
    /// store, so a redelivery after a lost ack makes no second one) rather
    /// than a rejection the broker routes.
    pub fn copies_dead_letters(&self) -> bool {
        !matches!(
            self,
            Source::Amqp {
                dead_letter: DeadLetters::Dlx,
                ..
            }
        )
    }
}

/// One consumer's settings.
#[derive(Debug, Clone)]
pub struct ConsumerSettings {
    /// Its name in logs, metrics and spans.
    pub name: Arc<str>,
    /// The identity its records and delivery counts are kept under (its
    /// name unless it keeps another across a rename).
    pub records: Arc<str>,
    pub source: Source,
    pub path: http::uri::PathAndQuery,
    pub sources: Arc<[MessageKeySource]>,
    /// Fields a redelivery with the same key must repeat (else it is
    /// dead-lettered, and logged as an error).
    pub must_match: Arc<[MessageKeySource]>,
    pub prefetch: u16,
    pub max_deliveries: u32,
    pub retry_delay: Duration,
    /// The upstream's timeout (NATS redelivers an unacked message after
    /// twice this, or 30 s, whichever is longer).
    pub upstream_timeout: Duration,
    /// How long a stop waits for messages in flight.
    pub shutdown_grace: Duration,
}

/// One delivery, whatever the broker.
#[derive(Debug, Clone)]
pub struct Message {
    pub id: Option<String>,
    pub topic: String,
    /// Header values as text, or why not.
    pub headers: Vec<(String, Result<String, String>)>,
    pub content_type: Option<String>,
    pub body: Bytes,
    /// The broker's delivery count, 1-based (0: the broker does not count).
    pub delivery_count: u64,
    /// Its business key, read once (every try and the settling use it).
    pub key: std::sync::OnceLock<Result<String, idemgate::callback::KeyError>>,
}

impl KeyedMessage for Message {
    fn message_id(&self) -> Option<&str> {
        self.id.as_deref()
    }
    fn topic(&self) -> &str {
        &self.topic
    }
    fn header(&self, name: &str) -> Option<Result<String, String>> {
        let mut found = self
            .headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name));
        let (_, value) = found.next()?;
        if found.next().is_some() {
            // `Event-Id` and `event-id` both set: which one is the key
            // must not depend on the order a map yields them.
            return Some(Err("sent more than once (names differ only in case)".into()));
        }
        Some(value.clone())
    }
    fn body(&self) -> &Bytes {
        &self.body
    }
}

/// Why a dead-letter copy was not stored.
#[derive(Debug)]
pub enum CopyFailure {
    /// The broker answered no (unroutable, refused, no such stream): the
    /// copy is not stored.
    Refused(String),
    /// No answer (the connection went): the copy may have been stored.
    Unknown(String),
}

/// What to do with a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Acknowledge: the outcome is durable.
    Ack(MessageOutcome),
    /// An upstream attempt failed (it counts towards `max_deliveries`):
    /// leave it to the broker to deliver again after the delay.
    Retry(Duration),
    /// Nothing was attempted upstream — the store is unreachable, a copy
    /// is in flight, the outcome is not recorded yet: try again in this
    /// process after the delay (see [`Deliverer::decide`]).
    Wait(Duration),
    /// Move it to the dead letters (then acknowledge it), for `reason`,
    /// as the copy named `copy` (`x-idemgate-copy`): this instance holds
    /// the message's copy lease as `holder` ([`Deliverer::while_copying`]
    /// keeps it).
    DeadLetter {
        reason: String,
        copy: String,
        holder: String,
    },
}

impl Verdict {
    /// A dead letter as [`Deliverer::deliver`] decides it, before the copy
    /// lease names its copy.
    fn dead_letter(reason: String) -> Verdict {
        Verdict::DeadLetter {
            reason,
            copy: String::new(),
            holder: String::new(),
        }
    }

    /// Its name in a message's span.
    pub fn name(&self) -> &'static str {
        match self {
            Verdict::Ack(outcome) => outcome.as_str(),
            Verdict::Retry(_) => "retry",
            Verdict::Wait(_) => "wait",
            Verdict::DeadLetter { .. } => "dead_letter",
        }
    }
}

/// Delivers messages of one consumer through the engine.
pub struct Deliverer {
    settings: ConsumerSettings,
    engine: Engine,
    proxy: Proxy,
    counters: Arc<ConsumerCounters>,
}

/// How long a delivery is tried again in this process (store outage,
/// copy in flight elsewhere) before it goes back to the broker.
pub const MAX_IN_PROCESS_WAIT: Duration = Duration::from_secs(300);

/// How long one instance holds the right to publish a message's
/// dead-letter copy, at least (four store timeouts when longer), renewed
/// every third of it while its broker has not confirmed the copy. Another
/// instance that decided the same message's end meanwhile waits; a holder
/// that died is replaced after this long.
pub const DEAD_LETTER_LEASE: Duration = Duration::from_secs(30);

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
    /// [`Verdict::Wait`] is tried again here, after its delay, for up to
    /// [`MAX_IN_PROCESS_WAIT`] — a broker never sees a store outage as a
    /// failed delivery (quorum queues drop a message after their
    /// `delivery-limit` of requeues). `keep` runs between tries (NATS:
    /// extends the ack deadline). A stop hands the message back at once.
    pub async fn decide<F, K>(
        &self,
        message: &Message,
        stop: &CancellationToken,
        mut keep: K,
    ) -> Verdict
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
                Some(reason) => Verdict::dead_letter(reason),
            };
            let delay = match verdict {
                Verdict::Wait(delay) => delay,
                // One copy, whichever instance decided it: published by
                // the holder of the message's copy lease alone.
                Verdict::DeadLetter { reason, .. } => {
                    let holder = uuid::Uuid::now_v7().to_string();
                    match self.lease_dead_letter(message, &holder).await {
                        Ok(DeadLetterClaim::Won(copy)) => {
                            return Verdict::DeadLetter {
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
                            _ => return Verdict::Ack(MessageOutcome::Duplicate),
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
                return Verdict::Retry(delay);
            }
            self.counters.record(MessageOutcome::Retried);
            let _waiting = self.counters.wait();
            tokio::select! {
                _ = stop.cancelled() => return Verdict::Retry(Duration::ZERO),
                _ = tokio::time::sleep(delay) => {}
            }
            waited += delay;
            keep().await;
        }
    }

    /// One try through the engine.
    async fn deliver(&self, message: &Message) -> Verdict {
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
                    match self
                        .engine
                        .store()
                        .sql()
                        .delivery(&self.settings.records, &mark)
                        .await
                    {
                        Ok((_, true)) => return Verdict::Ack(MessageOutcome::Duplicate),
                        Ok(_) => {}
                        Err(_) => return Verdict::Wait(self.settings.retry_delay),
                    }
                }
                return Verdict::dead_letter(format!("no usable business key: {e}"));
            }
        };
        // A dead-letter copy moved back to the source (a replay) is counted
        // and marked apart from its original: never settled by the mark
        // the original left, and dead-lettered once itself.
        let row = delivery_row(&key, message);
        let (failures, dead_lettered) = match fresh {
            true => (0, false),
            false => match self
                .engine
                .store()
                .sql()
                .delivery(&self.settings.records, &row)
                .await
            {
                Ok(found) => found,
                // Fail closed: nothing is forwarded while the store is away.
                Err(_) => return Verdict::Wait(self.settings.retry_delay),
            },
        };
        let copied = dead_lettered && self.settings.source.copies_dead_letters();
        if copied || failures >= self.settings.max_deliveries {
            // What the store says was the end of this key — once no
            // attempt of it is open (a re-publish of it at the upstream, an
            // uncertain try within its hold): until then the message waits,
            // neither acknowledged beside that attempt nor sent again.
            match self.attempt_open(&key).await {
                Err(()) | Ok(true) => return Verdict::Wait(self.settings.retry_delay),
                // Its dead-letter copy is stored and the ack was lost:
                // done, and no second copy.
                Ok(false) if copied => return Verdict::Ack(MessageOutcome::Duplicate),
                // Out of attempts already (its dead-letter copy failed
                // before): straight to the dead letters, not upstream again.
                Ok(false) => {
                    return Verdict::dead_letter(format!("the upstream failed {failures} time(s)"));
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
            Verdict::Ack(_) | Verdict::Wait(_) => {}
            Verdict::DeadLetter { reason, .. } => {
                tracing::error!(consumer = %name, key = %key_ref(&key), topic = %message.topic.escape_debug(), reason = %reason, layer = "consumer", "dead-lettering the message");
            }
            Verdict::Retry(_) => {
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
    async fn attempt_open(&self, key: &str) -> Result<bool, ()> {
        let records = self
            .engine
            .store()
            .sql()
            .find(&self.settings.records, key)
            .await
            .map_err(|_| ())?;
        Ok(records.iter().any(idemgate_store::Record::is_held))
    }

    /// A delivery's span (traces on), continuing the producer's trace when
    /// the message carries a `traceparent` header.
    fn message_span(&self, message: &Message) -> tracing::Span {
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
    pub fn settled(&self, message: &Message, verdict: &Verdict, broker: Result<(), String>) {
        let outcome = match (verdict, broker) {
            (_, Err(e)) => {
                tracing::warn!(consumer = %self.settings.name, error = %e, layer = "consumer", "the broker did not take the acknowledgement or dead letter; the message is delivered again");
                MessageOutcome::Error
            }
            (Verdict::Ack(outcome), Ok(())) => *outcome,
            (Verdict::Retry(_) | Verdict::Wait(_), Ok(())) => MessageOutcome::Retried,
            (Verdict::DeadLetter { .. }, Ok(())) => MessageOutcome::DeadLettered,
        };
        let _ = message;
        self.counters.record(outcome);
    }

    /// Says, for every instance, that `message`'s dead-letter copy is
    /// stored: a redelivery (its ack was lost) is then acknowledged without
    /// a second copy. A store that fails is tried again for half a copy
    /// lease — the lease, renewed at most a third of it ago, still keeps
    /// other instances from copying meanwhile. Past that, best effort:
    /// without the record a redelivery makes a second copy (under the same
    /// id), never a lost message.
    async fn dead_lettered(&self, message: &Message) {
        let Some(key) = self.dead_letter_row(message) else {
            return;
        };
        let sql = self.engine.store().sql();
        let until = tokio::time::Instant::now() + self.copy_lease() / 2;
        let pause = self
            .settings
            .retry_delay
            .clamp(Duration::from_millis(100), Duration::from_secs(1));
        loop {
            let e = match sql.mark_dead_lettered(&self.settings.records, &key).await {
                Ok(()) => return,
                Err(e) => e,
            };
            if tokio::time::Instant::now() + pause >= until {
                tracing::warn!(consumer = %self.settings.name, key = %key_ref(&key), error = %e, layer = "consumer", "the dead-letter copy is stored but could not be recorded; a redelivery would make a second copy");
                return;
            }
            tokio::time::sleep(pause).await;
        }
    }

    /// Gives back `message`'s copy lease: the broker refused the copy
    /// `holder` was publishing, so the next try (on any instance) need not
    /// wait for the lease to lapse. Not after a copy that may have been
    /// stored (a lost confirm): that lease lapses, and the copy is made
    /// again under the same id.
    async fn dead_letter_refused(&self, message: &Message, holder: &str) {
        let Some(key) = self.dead_letter_row(message) else {
            return;
        };
        let _ = self
            .engine
            .store()
            .sql()
            .release_dead_letter(&self.settings.records, &key, holder)
            .await;
    }

    /// Makes `message`'s dead-letter copy with `publish` (until its broker
    /// confirms or refuses it) as the copy lease's `holder`, then records
    /// it for every instance; the caller acknowledges the original after.
    /// A refusal gives the lease back; a copy that may have landed (a lost
    /// confirm) keeps it until it lapses.
    pub async fn copy_dead_letter<F>(
        &self,
        message: &Message,
        holder: &str,
        publish: F,
    ) -> Result<(), String>
    where
        F: std::future::Future<Output = Result<(), CopyFailure>>,
    {
        match self.while_copying(message, holder, publish).await {
            Ok(()) => {
                // Recorded before the ack: if the ack is lost, the
                // redelivery is acknowledged without a second copy, on any
                // instance.
                self.dead_lettered(message).await;
                Ok(())
            }
            Err(CopyFailure::Refused(e)) => {
                self.dead_letter_refused(message, holder).await;
                Err(e)
            }
            Err(CopyFailure::Unknown(e)) => Err(e),
        }
    }

    /// Runs `publish` while keeping `holder`'s copy lease on `message`, so
    /// no other instance takes it over from a live, slow publisher. A
    /// publish is never cut short here: given up, it could still land
    /// after the lease passed on. The connection's end ends it, and so does
    /// a stop once its grace is over (the lease then lapses).
    async fn while_copying<F: std::future::Future>(
        &self,
        message: &Message,
        holder: &str,
        publish: F,
    ) -> F::Output {
        // Only copies are published (a `dlx` rejection has no lease).
        let Some(row) = self.dead_letter_row(message) else {
            return publish.await;
        };
        let lease = self.copy_lease();
        let mut renew =
            tokio::time::interval_at(tokio::time::Instant::now() + lease / 3, lease / 3);
        tokio::pin!(publish);
        loop {
            tokio::select! {
                done = &mut publish => return done,
                _ = renew.tick() => {
                    let sql = self.engine.store().sql();
                    if !matches!(sql.renew_dead_letter(&self.settings.records, &row, holder, lease).await, Ok(true)) {
                        tracing::warn!(consumer = %self.settings.name, key = %key_ref(&row), layer = "consumer", "the dead-letter copy's lease could not be renewed while its broker has not confirmed it; another instance may make the copy again, under the same copy id");
                    }
                }
            }
        }
    }

    /// How long a copy lease runs before it lapses: a renewal must fit in
    /// it whatever the store's timeout.
    fn copy_lease(&self) -> Duration {
        DEAD_LETTER_LEASE.max(self.engine.store().sql().timeout() * 4)
    }

    /// Takes `message`'s copy lease as `holder`: the copy's id when this
    /// instance is to publish it. A message nothing names alone (no key,
    /// no id) and a rejection the broker routes (`dlx`) need no lease.
    async fn lease_dead_letter(
        &self,
        message: &Message,
        holder: &str,
    ) -> Result<DeadLetterClaim, ()> {
        let row = match self.dead_letter_row(message) {
            Some(row) if self.settings.source.copies_dead_letters() => row,
            _ => return Ok(DeadLetterClaim::Won(holder.to_owned())),
        };
        self.engine
            .store()
            .sql()
            .claim_dead_letter(&self.settings.records, &row, holder, self.copy_lease())
            .await
            .map_err(|_| ())
    }

    /// The store row that keeps `message`'s dead-letter mark and lease:
    /// its delivery row, or a keyless message's own mark. `None`: nothing
    /// names this message alone, so a redelivery after a lost ack makes a
    /// second copy rather than risk another message's loss.
    fn dead_letter_row(&self, message: &Message) -> Option<String> {
        match self.key_of(message) {
            Ok(key) => Some(delivery_row(key, message)),
            Err(_) => keyless_mark(message),
        }
    }

    /// The request for `message`'s `attempt`-th delivery to the upstream.
    fn request(&self, message: &Message, attempt: u32) -> Request<Body> {
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
    async fn judge(
        &self,
        row: &str,
        fresh: bool,
        verdict: EngineVerdict,
        status: StatusCode,
    ) -> Verdict {
        let wait = Verdict::Wait(self.settings.retry_delay);
        match verdict {
            // Acknowledged only once the outcome is durable (or was, for a
            // duplicate).
            EngineVerdict::Recorded => return Verdict::Ack(MessageOutcome::Forwarded),
            EngineVerdict::Replayed => return Verdict::Ack(MessageOutcome::Duplicate),
            // Redelivered after its record's retention, within its
            // tombstone: it was handled long ago; never executed again.
            EngineVerdict::Refused(Reason::IdempotencyKeyExpired) => {
                return Verdict::Ack(MessageOutcome::Duplicate);
            }
            EngineVerdict::Refused(Reason::IdempotencyKeyReused | Reason::BusinessKeyReused) => {
                return Verdict::dead_letter(
                    "its key was first used for a message whose must_match fields differ".into(),
                );
            }
            EngineVerdict::Refused(Reason::BodyTooLarge) => {
                return Verdict::dead_letter("the message is over server.max_body_bytes".into());
            }
            // Nothing was forwarded: the message waits for the store, a
            // budget, or the copy in flight (here or on another instance).
            // A recordable outcome whose write has not landed yet waits
            // too: the holder keeps writing, and the next try finds it.
            EngineVerdict::StoreDown
            | EngineVerdict::InFlight
            | EngineVerdict::Recording
            | EngineVerdict::Refused(Reason::ClaimsExhausted | Reason::BuffersExhausted) => {
                return wait;
            }
            _ => {}
        }
        let failures = match self
            .engine
            .store()
            .sql()
            .count_delivery_failure(&self.settings.records, row, fresh)
            .await
        {
            Ok(failures) => failures,
            // Not counted (the store went away): delivered again; the
            // next failure is counted.
            Err(_) => return Verdict::Retry(self.settings.retry_delay),
        };
        if failures >= self.settings.max_deliveries {
            return Verdict::dead_letter(format!(
                "the upstream failed {failures} time(s), the last with {}",
                status.as_u16()
            ));
        }
        Verdict::Retry(self.settings.retry_delay)
    }

    fn key_of<'m>(&self, message: &'m Message) -> &'m Result<String, idemgate::callback::KeyError> {
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

/// The running consumers of a gateway.
pub struct Consumers {
    tasks: Vec<JoinHandle<()>>,
}

impl Consumers {
    /// Starts one task per consumer; each stops consuming when `stop` is
    /// cancelled and finishes what it holds within its grace.
    pub fn spawn(deliverers: Vec<Arc<Deliverer>>, stop: CancellationToken) -> Self {
        let tasks = deliverers
            .into_iter()
            .map(|d| {
                let signal = stop.clone();
                tokio::spawn(async move {
                    match d.settings().source.clone() {
                        #[cfg(feature = "amqp")]
                        Source::Amqp {
                            url,
                            queue,
                            dead_letter,
                        } => amqp::run(d, url, queue, dead_letter, signal).await,
                        #[cfg(feature = "nats")]
                        Source::Nats {
                            url,
                            stream,
                            durable,
                            dead_letter,
                        } => nats::run(d, url, stream, durable, dead_letter, signal).await,
                        #[cfg(feature = "redis-streams")]
                        Source::Redis(source) => redis_streams::run(d, source, signal).await,
                        #[allow(unreachable_patterns)]
                        other => tracing::error!(
                            consumer = %d.settings().name,
                            source = ?other,
                            layer = "consumer",
                            "this build has no client for the consumer's broker (a cargo feature of idemgate-mq is off)"
                        ),
                    }
                })
            })
            .collect();
        Consumers { tasks }
    }

    /// Waits for every consumer to stop.
    pub async fn join(self) {
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

/// Runs `session` (connect, consume, return why it ended) again and again
/// until `stop`, pausing with backoff between tries; a session that got
/// connected starts the backoff over. `from` names the queue or stream in
/// logs.
pub(crate) async fn keep_connected<S, F>(
    d: &Deliverer,
    url: &str,
    from: &str,
    stop: &CancellationToken,
    mut session: S,
) where
    S: FnMut() -> F,
    F: std::future::Future<Output = Result<(), String>>,
{
    let name = &d.settings().name;
    let mut failures = 0u32;
    loop {
        let connects = d.counters().connects();
        let started = tokio::time::Instant::now();
        let ended = session().await;
        if stop.is_cancelled() {
            return;
        }
        // Backoff starts over only after a session that stayed up: a broker
        // that accepts and drops at once must not be hammered (and logged)
        // every 100 ms.
        if d.counters().connects() != connects && started.elapsed() >= RECONNECT_MAX {
            failures = 0;
        }
        let why = ended
            .err()
            .unwrap_or_else(|| "the session ended".to_owned());
        d.counters().set_disconnected(why.clone());
        let pause = backoff(failures);
        failures = failures.saturating_add(1);
        // The first failure in a row is a warning, then about one a
        // minute: a broker that is down for hours must not flood the log.
        if failures == 1 || failures.is_multiple_of(12) {
            tracing::warn!(consumer = %name, broker = %redact(url), from = %from, error = %why, retry_in = ?pause, layer = "consumer", "broker unreachable or connection lost; reconnecting");
        } else {
            tracing::debug!(consumer = %name, error = %why, retry_in = ?pause, layer = "consumer", "reconnecting");
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

/// Where the dead-letter mark of a message without a usable key is kept:
/// its broker id (as it came, unusable as a key) and body hashed, behind a
/// control character no usable key may hold, so it never meets a business
/// key. `None` without an id: a body alone does not name one message (two
/// keyless messages may carry the same), and a mark shared by two would
/// settle the second without its copy.
fn keyless_mark(message: &Message) -> Option<String> {
    use sha2::{Digest, Sha256};
    let id = message.id.as_deref()?.as_bytes();
    let copy = copy_id(message).unwrap_or_default();
    let mut hash = Sha256::new();
    for part in [id, copy.as_bytes()] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part);
    }
    hash.update(&message.body);
    Some(format!("\u{1}keyless:{}", hex::encode(hash.finalize())))
}

/// The store row that counts `message`'s failed attempts and keeps its
/// dead-letter mark: its key's, or for one of Idemgate's dead-letter
/// copies moved back to the source, a row of that copy's own.
fn delivery_row(key: &str, message: &Message) -> String {
    match copy_id(message) {
        Some(copy) => format!("{key}\u{1}copy:{copy}"),
        None => key.to_owned(),
    }
}

/// Which dead-letter copy `message` is, if it is one: the copy header each
/// broker's copy gets (`x-idemgate-copy`, `Idemgate-Copy`, `idemgate-copy`;
/// names compare without case), or for a copy made before that header, its
/// reason header.
fn copy_id(message: &Message) -> Option<String> {
    [
        "x-idemgate-copy",
        "idemgate-copy",
        "x-idemgate-reason",
        "idemgate-reason",
    ]
    .iter()
    .find_map(|name| message.header(name).and_then(Result::ok))
}

/// The reconnect pause after `failures` failed attempts in a row.
pub(crate) fn backoff(failures: u32) -> Duration {
    RECONNECT_START
        .saturating_mul(1 << failures.min(16))
        .min(RECONNECT_MAX)
}

use idemgate_core::error::redact_url as redact;
