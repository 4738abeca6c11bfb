//! `[[consumers]]` (docs/semantics.md, "Queues"): a queue or stream Idemgate consumes and
//! delivers, once per business key, to an upstream over HTTP — the schema,
//! the defaults, the checks each entry needs on its own, and what the MQ
//! crate is built from (its source, its path, its key sources parsed),
//! which the plan keeps. What compares a consumer with the routes or with
//! another consumer is in `validate.rs`.

use std::collections::BTreeSet;

use serde::Deserialize;

use super::HumanDuration;
use idemgate_mq::{DEFAULT_MESSAGE_KEY, MessageKeySource};

const DEFAULT_PREFETCH: u16 = 32;
const DEFAULT_MAX_DELIVERIES: u32 = 10;
const DEFAULT_RETRY_DELAY: &str = "1s";
/// Redis Streams: entries pending this long on a consumer are claimed by
/// another (that consumer is taken for dead).
const DEFAULT_CLAIM_IDLE: &str = "30s";

/// `[[consumers]]`: one queue (RabbitMQ) or durable consumer of a stream
/// (NATS JetStream).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsumerConfig {
    /// Names the consumer in logs and metrics, and scopes its records.
    pub name: String,
    /// The identity its records are kept under; default: `name` (keep it
    /// to rename the consumer without losing its records).
    pub id: Option<String>,
    /// `amqp://` / `amqps://` (RabbitMQ), `nats://` / `tls://` (JetStream)
    /// or `redis://` / `rediss://` (Redis Streams).
    pub source: String,
    /// AMQP: the queue.
    pub queue: Option<String>,
    /// NATS, Redis: the stream.
    pub stream: Option<String>,
    /// NATS: the durable consumer's name (default: the consumer's name).
    pub durable: Option<String>,
    /// Redis: the consumer group (default: the consumer's name).
    pub group: Option<String>,
    /// Redis: entries pending this long on a consumer are claimed by
    /// another (default 30 s).
    #[serde(default = "default_claim_idle")]
    pub claim_idle: HumanDuration,
    /// Where dead letters go: AMQP a queue (default `<queue>.dlq`) or
    /// `"dlx"` (the queue's own dead-letter exchange), NATS a subject
    /// (default `<stream>.dlq`), Redis a stream (default `<stream>.dlq`).
    pub dead_letter: Option<String>,
    /// The name of the `[[upstreams]]` entry messages are POSTed to.
    pub upstream: String,
    /// Each message is POSTed here.
    pub path: String,
    /// Sources of the key (`msg:message_id`, `msg:topic`, `msg:header:Name`,
    /// `json:/pointer`); default: the message id and the topic.
    #[serde(default = "default_business_key")]
    pub business_key: Vec<String>,
    /// Fields a redelivery with the same key must repeat (same sources as
    /// `business_key`); one that differs is dead-lettered and logged.
    #[serde(default)]
    pub must_match: Vec<String>,
    /// Messages in flight at once (AMQP prefetch, NATS max ack pending).
    #[serde(default = "default_prefetch")]
    pub prefetch: u16,
    /// Failed upstream attempts before a message is dead-lettered.
    #[serde(default = "default_max_deliveries")]
    pub max_deliveries: u32,
    /// How long a failed message waits before it is delivered again.
    #[serde(default = "default_retry_delay")]
    pub retry_delay: HumanDuration,
}

/// Which broker a consumer reads from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Broker {
    /// RabbitMQ, AMQP 0-9-1.
    Amqp,
    /// NATS JetStream.
    Nats,
    /// Redis Streams.
    Redis,
}

impl ConsumerConfig {
    /// The identity its records are kept under: `id`, or the name.
    pub fn record_id(&self) -> &str {
        self.id.as_deref().unwrap_or(&self.name)
    }

    /// The broker `source` names, if its scheme is known.
    pub fn broker(&self) -> Option<Broker> {
        let scheme = self.source.split_once("://")?.0.to_ascii_lowercase();
        match scheme.as_str() {
            "amqp" | "amqps" => Some(Broker::Amqp),
            "nats" | "tls" => Some(Broker::Nats),
            "redis" | "rediss" => Some(Broker::Redis),
            _ => None,
        }
    }

    /// The NATS durable consumer's name.
    pub fn durable_name(&self) -> &str {
        self.durable.as_deref().unwrap_or(&self.name)
    }

    /// The dead-letter queue (AMQP) or subject (NATS); for `dlx`, the
    /// queue's own dead-letter exchange.
    pub fn dead_letter_name(&self) -> String {
        if let Some(name) = &self.dead_letter {
            return name.clone();
        }
        match self.broker() {
            Some(Broker::Nats) => {
                idemgate_mq::default_dead_letter_subject(self.stream.as_deref().unwrap_or_default())
            }
            Some(Broker::Redis) => {
                idemgate_mq::default_dead_letter_stream(self.stream.as_deref().unwrap_or_default())
            }
            _ => idemgate_mq::default_dead_letter_queue(self.queue.as_deref().unwrap_or_default()),
        }
    }

    /// The Redis consumer group.
    pub fn group_name(&self) -> &str {
        self.group.as_deref().unwrap_or(&self.name)
    }

    /// What the consumer reads, for spotting two entries on one queue.
    pub(super) fn reads(&self) -> (String, String) {
        let from = match self.broker() {
            Some(Broker::Redis) => format!(
                "{}/{}",
                self.stream.as_deref().unwrap_or_default(),
                self.group_name()
            ),
            Some(Broker::Nats) => format!(
                "{}/{}",
                self.stream.as_deref().unwrap_or_default(),
                self.durable_name()
            ),
            _ => self.queue.clone().unwrap_or_default(),
        };
        (self.source.clone(), from)
    }

    /// Where it reads, as the MQ crate connects to it; `None` for a
    /// scheme no broker has (see [`Self::unknown_source`]).
    pub(super) fn mq_source(&self) -> Option<idemgate_mq::Source> {
        use idemgate_mq::Source;
        Some(match self.broker()? {
            Broker::Amqp => Source::Amqp {
                url: self.source.clone(),
                queue: self.queue.clone().unwrap_or_default(),
                dead_letter: match self.dead_letter.as_deref() {
                    Some(DEAD_LETTER_EXCHANGE) => idemgate_mq::DeadLetters::Dlx,
                    _ => idemgate_mq::DeadLetters::Queue(self.dead_letter_name()),
                },
            },
            Broker::Nats => Source::Nats {
                url: self.source.clone(),
                stream: self.stream.clone().unwrap_or_default(),
                durable: self.durable_name().to_owned(),
                dead_letter: self.dead_letter_name(),
            },
            Broker::Redis => Source::Redis(idemgate_mq::StreamSource {
                url: self.source.clone(),
                stream: self.stream.clone().unwrap_or_default(),
                group: self.group_name().to_owned(),
                claim_idle: self.claim_idle.get(),
                dead_letter: self.dead_letter_name(),
            }),
        })
    }

    /// Why `source` names no broker (its password left out).
    pub(super) fn unknown_source(&self) -> String {
        format!(
            "{:?} must be amqp://… or amqps://… (RabbitMQ), nats://… or tls://… (NATS JetStream), redis://… or rediss://… (Redis Streams)",
            idemgate_core::error::redact_url(&self.source)
        )
    }

    /// `path`, as each message is POSTed to it; why not.
    pub(super) fn upstream_path(&self) -> Result<http::uri::PathAndQuery, String> {
        self.path
            .parse::<http::uri::PathAndQuery>()
            .ok()
            .filter(|_| self.path.starts_with('/'))
            .ok_or_else(|| format!("{:?} must be a path starting with '/'", self.path))
    }

    /// `business_key` and `must_match`, parsed: read here once, when the
    /// plan is loaded, every source that is not one reported under its key.
    pub(super) fn key_sources(
        &self,
        key: &dyn Fn(&str) -> String,
        add: &mut dyn FnMut(String, String),
    ) -> Option<(Vec<MessageKeySource>, Vec<MessageKeySource>)> {
        let mut parse = |field: &str, sources: &[String]| {
            let mut parsed = Vec::with_capacity(sources.len());
            let mut all = true;
            for source in sources {
                match MessageKeySource::parse(source) {
                    Ok(one) => parsed.push(one),
                    Err(reason) => {
                        add(key(field), reason);
                        all = false;
                    }
                }
            }
            all.then_some(parsed)
        };
        let sources = parse("business_key", &self.business_key);
        let must_match = parse("must_match", &self.must_match);
        Some((sources?, must_match?))
    }

    /// Checks one entry on its own (its key sources are read, and
    /// reported, with the plan); `key` names its fields.
    fn check(
        &self,
        key: &dyn Fn(&str) -> String,
        upstreams: &BTreeSet<&str>,
        add: &mut dyn FnMut(String, String),
    ) {
        match self.broker() {
            None => add(key("source"), self.unknown_source()),
            Some(Broker::Amqp) => self.check_amqp(key, add),
            Some(Broker::Redis) => self.check_redis(key, add),
            Some(Broker::Nats) => self.check_nats(key, add),
        }
        if !upstreams.contains(self.upstream.as_str()) {
            add(
                key("upstream"),
                format!("unknown upstream {:?}", self.upstream),
            );
        }
        if let Err(reason) = self.upstream_path() {
            add(key("path"), reason);
        }
        if self.business_key.is_empty() {
            add(
                key("business_key"),
                "needs at least one source (msg:message_id, msg:topic, msg:header:Name, json:/pointer)"
                    .into(),
            );
        }
        self.check_dead_letter(key, add);
        if self.prefetch == 0 {
            add(key("prefetch"), "must be above zero".into());
        }
        if self.max_deliveries == 0 {
            add(key("max_deliveries"), "must be above zero".into());
        }
        if let Some(reason) = self.retry_delay.problem() {
            add(key("retry_delay"), reason);
        }
    }

    /// RabbitMQ: a queue, and none of the stream keys.
    fn check_amqp(&self, key: &dyn Fn(&str) -> String, add: &mut dyn FnMut(String, String)) {
        if self.queue.as_deref().is_none_or(str::is_empty) {
            add(key("queue"), "an AMQP consumer names its queue".into());
        }
        for (field, set) in [
            ("stream", &self.stream),
            ("durable", &self.durable),
            ("group", &self.group),
        ] {
            if set.is_some() {
                add(
                    key(field),
                    "only NATS and Redis consumers take a stream (and a durable or group)".into(),
                );
            }
        }
    }

    /// Redis Streams: a stream and a group, a usable `claim_idle`, dead
    /// letters elsewhere.
    fn check_redis(&self, key: &dyn Fn(&str) -> String, add: &mut dyn FnMut(String, String)) {
        if self.stream.as_deref().is_none_or(str::is_empty) {
            add(
                key("stream"),
                "a Redis Streams consumer names its stream".into(),
            );
        }
        for (field, set) in [("queue", &self.queue), ("durable", &self.durable)] {
            if set.is_some() {
                add(
                    key(field),
                    "a Redis Streams consumer reads a stream with a group (stream = \"…\", group = \"…\")"
                        .into(),
                );
            }
        }
        if let Some(reason) = self.claim_idle.problem() {
            add(key("claim_idle"), reason);
        } else if self.claim_idle.get() < MIN_CLAIM_IDLE {
            // Entries in hand are kept fresh every third of it: below
            // a second that is a Redis call every few milliseconds
            // per consumer, and a slow round trip would let another
            // instance take entries that are still being handled.
            add(
                key("claim_idle"),
                format!("must be at least {MIN_CLAIM_IDLE:?}"),
            );
        }
        if self
            .dead_letter
            .as_deref()
            .is_some_and(|d| Some(d) == self.stream.as_deref())
        {
            add(
                key("dead_letter"),
                "must name a stream other than the one consumed".into(),
            );
        }
    }

    /// NATS JetStream: a stream and a durable, named as subject tokens.
    fn check_nats(&self, key: &dyn Fn(&str) -> String, add: &mut dyn FnMut(String, String)) {
        if self.stream.as_deref().is_none_or(str::is_empty) {
            add(key("stream"), "a NATS consumer names its stream".into());
        }
        if self.queue.is_some() {
            add(
                key("queue"),
                "a NATS consumer reads a stream (stream = \"…\", durable = \"…\"), not a queue"
                    .into(),
            );
        }
        // Stream and consumer names are subject tokens.
        for (field, name) in [
            ("stream", self.stream.as_deref().unwrap_or_default()),
            ("durable", self.durable_name()),
        ] {
            if name.contains(['.', '*', '>', ' ', '\t']) {
                add(
                    key(field),
                    format!("{name:?}: NATS names hold no '.', '*', '>' or whitespace"),
                );
            }
        }
    }

    /// `dead_letter`: `dlx` on RabbitMQ only, and never what is consumed.
    fn check_dead_letter(&self, key: &dyn Fn(&str) -> String, add: &mut dyn FnMut(String, String)) {
        if self.dead_letter.as_deref() == Some(DEAD_LETTER_EXCHANGE)
            && self.broker() != Some(Broker::Amqp)
        {
            add(
                key("dead_letter"),
                "\"dlx\" (reject into the queue's own dead-letter exchange) is RabbitMQ's; \
                 name a subject or stream for the dead letters instead"
                    .into(),
            );
        }
        if let Some(dead) = &self.dead_letter {
            let same = match self.broker() {
                Some(Broker::Nats) => false,
                _ => self.queue.as_ref() == Some(dead),
            };
            if dead.is_empty() || same {
                add(
                    key("dead_letter"),
                    "must name a queue or subject other than the one consumed".into(),
                );
            }
        }
    }
}

/// Checks every `[[consumers]]` entry on its own, and that each has a name
/// of its own (a route's name too is refused in `validate.rs`).
pub(super) fn check_all(
    consumers: &[ConsumerConfig],
    upstreams: &BTreeSet<&str>,
    add: &mut dyn FnMut(String, String),
) {
    let mut names = BTreeSet::new();
    for (i, c) in consumers.iter().enumerate() {
        let key = |field: &str| format!("consumers[{i}].{field}");
        if c.name.is_empty() {
            add(key("name"), "must not be empty".into());
        } else if !names.insert(c.name.as_str()) {
            add(key("name"), format!("duplicate consumer name {:?}", c.name));
        }
        c.check(&key, upstreams, add);
    }
}

/// `dead_letter = "dlx"`: reject without requeue, so that RabbitMQ routes
/// the message to the queue's own dead-letter exchange.
pub const DEAD_LETTER_EXCHANGE: &str = "dlx";

fn default_business_key() -> Vec<String> {
    DEFAULT_MESSAGE_KEY
        .iter()
        .map(|s| (*s).to_owned())
        .collect()
}
fn default_prefetch() -> u16 {
    DEFAULT_PREFETCH
}
fn default_max_deliveries() -> u32 {
    DEFAULT_MAX_DELIVERIES
}
fn default_retry_delay() -> HumanDuration {
    DEFAULT_RETRY_DELAY.into()
}
/// The shortest `claim_idle` accepted.
const MIN_CLAIM_IDLE: std::time::Duration = std::time::Duration::from_secs(1);

fn default_claim_idle() -> HumanDuration {
    DEFAULT_CLAIM_IDLE.into()
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    fn problems(consumers: &str) -> Vec<(String, String)> {
        let text = format!(
            r#"
            [[upstreams]]
            name = "coupons"
            url = "http://127.0.0.1:1"
            [[routes]]
            name = "orders"
            path = "/orders"
            upstream = "coupons"
            {consumers}
            "#
        );
        match Config::parse(&text, "t").unwrap().validate("t") {
            Ok(_) => Vec::new(),
            Err(e) => e
                .problems()
                .iter()
                .map(|p| (p.key.clone(), p.reason.clone()))
                .collect(),
        }
    }

    fn keys(consumers: &str) -> Vec<String> {
        problems(consumers).into_iter().map(|(k, _)| k).collect()
    }

    #[test]
    fn a_complete_consumer_is_valid_with_its_defaults() {
        let text = r#"
            [[consumers]]
            name = "coupon-events"
            source = "amqp://guest:guest@127.0.0.1:5672/%2f"
            queue = "coupon.deduct"
            upstream = "coupons"
            path = "/mq/coupons"
            [[consumers]]
            name = "stream-events"
            source = "nats://127.0.0.1:4222"
            stream = "COUPONS"
            upstream = "coupons"
            path = "/mq/coupons"
            business_key = ["msg:header:Event-Id", "json:/coupon"]
        "#;
        assert_eq!(problems(text), Vec::new());
        let config = Config::parse(
            &format!("[[upstreams]]\nname = \"coupons\"\nurl = \"http://h\"\n{text}"),
            "t",
        )
        .unwrap();
        let c = &config.consumers[0];
        assert_eq!(c.business_key, ["msg:message_id", "msg:topic"]);
        assert_eq!(
            (c.prefetch, c.max_deliveries, c.retry_delay.get()),
            (32, 10, std::time::Duration::from_secs(1))
        );
        assert_eq!(config.consumers[1].durable_name(), "stream-events");
    }

    #[test]
    fn every_broken_field_is_named() {
        let found = keys(
            r#"
            [[consumers]]
            name = "orders"
            source = "kafka://x"
            upstream = "nowhere"
            path = "mq"
            business_key = ["json:trade_no", "msg:id"]
            prefetch = 0
            max_deliveries = 0
            retry_delay = "soon"
            "#,
        );
        for key in [
            "consumers[0].name",
            "consumers[0].source",
            "consumers[0].upstream",
            "consumers[0].path",
            "consumers[0].business_key",
            "consumers[0].prefetch",
            "consumers[0].max_deliveries",
            "consumers[0].retry_delay",
        ] {
            assert!(found.contains(&key.to_owned()), "{key} not in {found:?}");
        }
    }

    #[test]
    fn each_broker_needs_its_own_fields() {
        let found = keys(
            r#"
            [[consumers]]
            name = "a"
            source = "amqp://h"
            stream = "S"
            upstream = "coupons"
            path = "/a"
            [[consumers]]
            name = "b"
            source = "nats://h"
            queue = "q"
            durable = "d.x"
            upstream = "coupons"
            path = "/b"
            [[consumers]]
            name = "b"
            source = "nats://h"
            stream = "S"
            upstream = "coupons"
            path = "/b"
            "#,
        );
        for key in [
            "consumers[0].queue",
            "consumers[0].stream",
            "consumers[1].stream",
            "consumers[1].queue",
            "consumers[1].durable",
            "consumers[2].name",
        ] {
            assert!(found.contains(&key.to_owned()), "{key} not in {found:?}");
        }
    }

    #[test]
    fn a_password_in_a_bad_source_is_not_echoed() {
        let found = problems(
            r#"
            [[consumers]]
            name = "a"
            source = "mqtt://user:hunter2@h"
            queue = "q"
            upstream = "coupons"
            path = "/a"
            "#,
        );
        assert!(
            found.iter().all(|(_, r)| !r.contains("hunter2")),
            "{found:?}"
        );
    }
}
