//! The MQ link (docs/semantics.md, "Queues"): consume from RabbitMQ, NATS JetStream or Redis Streams and
//! deliver each message to an upstream over HTTP once.
//!
//! A broker delivers at least once: a failover, or a consumer killed before
//! its ack, delivers a message again that was already processed. Each
//! delivery is turned into a request — `POST path` with the message body,
//! the stable key as `Idempotency-Key`, the id, topic and delivery count as
//! headers — and run through the same `Engine` as a callback route, keyed
//! by the message's business key ([`key`]). What the engine answers decides
//! the acknowledgement ([`Disposition`]):
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
//!
//! # Layout
//!
//! - `lib.rs`: the vocabulary — [`Source`], [`ConsumerSettings`],
//!   [`Message`] and the headers each request carries.
//! - `deliverer.rs`: [`Deliverer`], a message through the engine and what
//!   the engine's verdict means ([`Disposition`], `disposition.rs`).
//! - `dead_letter.rs`: dead letters made once across instances.
//! - [`key`]: business keys of messages, and their rows in the delivery
//!   log.
//! - `sessions.rs`: [`Consumers`], each broker session kept connected.
//! - `deliveries.rs`: the deliveries a session started, and how they end
//!   with it.
//! - `amqp.rs` (`amqp/acks.rs`), `nats.rs`, `redis_streams.rs`: one
//!   module per broker, each behind its feature.
#![warn(missing_docs)]

#[cfg(feature = "amqp")]
mod amqp;
mod dead_letter;
mod deliverer;
#[cfg(any(feature = "amqp", feature = "nats", feature = "redis-streams"))]
mod deliveries;
mod disposition;
pub mod key;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "redis-streams")]
mod redis_streams;
mod sessions;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::HeaderName;

pub use dead_letter::{CopyFailure, DEAD_LETTER_LEASE};
pub use deliverer::{Deliverer, MAX_IN_PROCESS_WAIT};
pub use disposition::Disposition;
pub use key::{
    DEFAULT_MESSAGE_KEY, KeyedMessage, MessageKeySource, message_key, message_match_values,
};
pub(crate) use sessions::keep_connected;
pub use sessions::{Consumers, RECONNECT_MAX, RECONNECT_START};

/// `X-Msg-Id`: the message's id, as the upstream receives it.
pub const X_MSG_ID: HeaderName = HeaderName::from_static("x-msg-id");
/// `X-Topic`: the routing key or subject.
pub const X_TOPIC: HeaderName = HeaderName::from_static("x-topic");
/// `X-Delivery-Count`: how many times the broker has delivered it (1 the
/// first time).
pub const X_DELIVERY_COUNT: HeaderName = HeaderName::from_static("x-delivery-count");

/// The scope of every consumer record: the consumer is the sender.
pub const CONSUMER_SCOPE: &str = "consumer";

/// Where a consumer reads from.
#[derive(Debug, Clone)]
pub enum Source {
    /// A RabbitMQ queue, and where its dead letters go.
    Amqp {
        /// `amqp://…` or `amqps://…`.
        url: String,
        /// The queue consumed; it must exist (checked, never created).
        queue: String,
        /// Where its dead letters go.
        dead_letter: DeadLetters,
    },
    /// A durable pull consumer of a JetStream stream, and the subject its
    /// dead letters go to.
    Nats {
        /// `nats://…` or `tls://…`.
        url: String,
        /// The stream; it must exist.
        stream: String,
        /// The durable pull consumer, created if absent.
        durable: String,
        /// The subject dead letters are published to, outside the stream.
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
    /// The broker it reads from, and where its dead letters go.
    pub source: Source,
    /// The upstream path each message is POSTed to.
    pub path: http::uri::PathAndQuery,
    /// Where the business key is read from; several form a composite key.
    pub sources: Arc<[MessageKeySource]>,
    /// Fields a redelivery with the same key must repeat (else it is
    /// dead-lettered, and logged as an error).
    pub must_match: Arc<[MessageKeySource]>,
    /// Messages in flight at once (AMQP prefetch, NATS max ack pending,
    /// Redis entries in hand).
    pub prefetch: u16,
    /// Failed upstream attempts before a message is dead-lettered, counted
    /// in the store across instances and restarts.
    pub max_deliveries: u32,
    /// How long a failed message waits before it is delivered again.
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
    /// Its id (AMQP `message_id`, NATS `Nats-Msg-Id`, the Redis entry id),
    /// sent upstream as `X-Msg-Id`.
    pub id: Option<String>,
    /// The routing key (AMQP), subject (NATS) or stream (Redis), sent
    /// upstream as `X-Topic`.
    pub topic: String,
    /// Header values as text, or why not.
    pub headers: Vec<(String, Result<String, String>)>,
    /// Its content type, sent upstream as `Content-Type`
    /// (`application/octet-stream` when absent or not a valid value).
    pub content_type: Option<String>,
    /// The payload, POSTed upstream as the request body.
    pub body: Bytes,
    /// The broker's delivery count, 1-based (0: the broker does not count).
    pub delivery_count: u64,
    /// Its business key, read once (every try and the settling use it).
    pub key: std::sync::OnceLock<Result<String, idemgate::callback::BusinessKeyError>>,
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

use idemgate_core::error::redact_url as redact;
