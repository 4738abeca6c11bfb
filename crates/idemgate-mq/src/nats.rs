//! NATS JetStream (`async-nats`): a durable pull consumer with explicit
//! acks, `prefetch` unacknowledged messages at most (`max_ack_pending`).
//!
//! - The stream is the application's and must exist; the durable consumer
//!   is created if absent, with unlimited deliveries (Idemgate decides when
//!   a message is dead-lettered: store outages do not count).
//! - Acks are double acks: the server confirms each one, so "acknowledged"
//!   means the server will not deliver the message again.
//! - Retries are naks with `retry_delay`; the server delivers again after
//!   it. Dead letters are published to `dead_letter` (default
//!   `<stream>.dlq`), captured by a stream `<stream>_dlq` that Idemgate
//!   creates (or any stream that already captures it, never the source
//!   stream), and the original is acknowledged only after JetStream stored
//!   the copy.
//! - A lost server ends the session (missed heartbeats or a failed
//!   request); a new client connects with backoff.

use std::sync::Arc;
use std::time::Duration;

use crate::deliveries::Deliveries;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::{self, AckKind, consumer::pull};
use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;

use super::{CopyFailure, Deliverer, Disposition, Message, keep_connected, redact};

/// The shortest ack wait: the server delivers an unacknowledged message
/// again after it (a holder may still run, and its claim answers the copy).
const MIN_ACK_WAIT: Duration = Duration::from_secs(30);

type Failure = Box<dyn std::error::Error + Send + Sync>;

/// Runs the consumer until `stop`, reconnecting with backoff.
pub(super) async fn run(
    d: Arc<Deliverer>,
    url: String,
    stream: String,
    durable: String,
    dead_letters: String,
    stop: CancellationToken,
) {
    let (d, url, stream, durable, dead_letters, stop) =
        (&d, &url, &stream, &durable, &dead_letters, &stop);
    keep_connected(d, url, stream, stop, || async move {
        match session(d, url, stream, durable, dead_letters, stop).await {
            Ok(()) => Err("the message stream ended".to_owned()),
            Err(e) => Err(e.to_string()),
        }
    })
    .await;
}

/// The stream's durable pull consumer, made if missing, and a stream for
/// the dead letters unless one already captures their subject. Refused: a
/// stream that captures its own dead-letter subject, and a durable made
/// before (by hand, or by an older config) with settings that would
/// strand or lose messages.
async fn durable_consumer(
    js: &jetstream::Context,
    stream_name: &str,
    durable: &str,
    dead_letters: &str,
    settings: &crate::ConsumerSettings,
) -> Result<jetstream::consumer::Consumer<pull::Config>, Failure> {
    let stream = js.get_stream(stream_name).await?;
    let captured = &stream.cached_info().config.subjects;
    if captured
        .iter()
        .any(|pattern| subject_matches(pattern, dead_letters))
    {
        // The copy would land in the stream it came from, and be consumed
        // (and dead-lettered) again, forever.
        return Err(format!(
            "stream {stream_name} captures its own dead-letter subject {dead_letters:?} \
             (subjects {captured:?}); set dead_letter to a subject outside it"
        )
        .into());
    }
    // A stream of Idemgate's own keeps the dead letters, unless one
    // already captures the subject.
    let dlq_stream = format!("{stream_name}_dlq");
    if let Err(e) = js
        .get_or_create_stream(jetstream::stream::Config {
            name: dlq_stream.clone(),
            subjects: vec![dead_letters.to_owned()],
            ..Default::default()
        })
        .await
    {
        js.stream_by_subject(dead_letters).await.map_err(|_| {
            format!(
                "the dead-letter stream {dlq_stream} on {dead_letters:?} cannot be created: {e}"
            )
        })?;
    }
    let ack_wait = MIN_ACK_WAIT.max(settings.upstream_timeout * 2);
    let consumer = stream
        .get_or_create_consumer(
            durable,
            pull::Config {
                durable_name: Some(durable.to_owned()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait,
                max_deliver: -1,
                max_ack_pending: i64::from(settings.prefetch),
                ..Default::default()
            },
        )
        .await?;
    // A durable made before (by hand, or by an older config) keeps its own
    // settings: one that stops redelivering, or does not wait for acks,
    // would strand or lose messages.
    let existing = &consumer.cached_info().config;
    if existing.ack_policy != jetstream::consumer::AckPolicy::Explicit {
        return Err(format!(
            "durable {durable:?} does not use explicit acks; delete it or fix its ack policy"
        )
        .into());
    }
    if existing.max_deliver > 0 {
        return Err(format!(
            "durable {durable:?} stops after {} deliveries, which would strand messages during a \
             store outage; Idemgate dead-letters by itself (set max_deliver to -1)",
            existing.max_deliver
        )
        .into());
    }
    Ok(consumer)
}

async fn session(
    d: &Arc<Deliverer>,
    url: &str,
    stream_name: &str,
    durable: &str,
    dead_letters: &str,
    stop: &CancellationToken,
) -> Result<(), Failure> {
    let settings = d.settings();
    let client = async_nats::ConnectOptions::new()
        .name(format!("idemgate {}", settings.name))
        .connection_timeout(Duration::from_secs(5))
        .connect(url)
        .await?;
    let js = jetstream::new(client.clone());
    let consumer = durable_consumer(&js, stream_name, durable, dead_letters, settings).await?;
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(usize::from(settings.prefetch))
        .heartbeat(Duration::from_secs(5))
        .messages()
        .await?;
    d.counters().set_connected();
    tracing::info!(consumer = %settings.name, broker = %redact(url), stream = %stream_name, durable = %durable, prefetch = settings.prefetch, layer = "consumer", "consuming");

    let mut deliveries = Deliveries::new(stop);
    let ended: Result<(), Failure> = loop {
        tokio::select! {
            _ = stop.cancelled() => break Ok(()),
            next = messages.next() => match next {
                Some(Ok(message)) => {
                    let d = d.clone();
                    let js = js.clone();
                    let session = deliveries.session().clone();
                    let subject = dead_letters.to_owned();
                    deliveries.spawn(async move { handle(&d, &js, &subject, message, &session).await });
                }
                Some(Err(e)) => break Err(e.into()),
                None => break Ok(()),
            },
            () = deliveries.one_done() => {}
        }
    };
    drop(messages);
    let stopped = stop.is_cancelled();
    let then = "unacknowledged messages are delivered again";
    deliveries
        .end(stopped, settings.shutdown_grace, &settings.name, then)
        .await;
    if stopped {
        let _ = client.drain().await;
        return Ok(());
    }
    ended
}

async fn handle(
    d: &Deliverer,
    js: &jetstream::Context,
    dead_letters: &str,
    message: jetstream::Message,
    stop: &CancellationToken,
) {
    let view = to_message(&message);
    // While it is tried again here, the ack deadline is pushed back.
    let verdict = d
        .decide(&view, stop, || async {
            let _ = message.ack_with(AckKind::Progress).await;
        })
        .await;
    let nak = |delay: Duration| {
        let delay = (!stop.is_cancelled()).then_some(delay);
        message.ack_with(AckKind::Nak(delay))
    };
    let done: Result<(), Failure> = match &verdict {
        Disposition::Ack(_) => message.double_ack().await,
        Disposition::Retry(delay) | Disposition::Wait(delay) => nak(*delay).await,
        Disposition::DeadLetter {
            reason,
            copy,
            holder,
        } => {
            let name = &d.settings().name;
            let publish = dead_letter(js, dead_letters, &message, name, reason, copy);
            match d.copy_dead_letter(&view, holder, publish).await {
                Ok(()) => message.double_ack().await,
                Err(e) => {
                    // Not stored: back after the delay, failure count kept.
                    let _ = nak(d.settings().retry_delay).await;
                    Err(e.into())
                }
            }
        }
    };
    d.settled(&view, &verdict, done.map_err(|e| e.to_string()));
}

/// Publishes a copy to the dead-letter subject and waits for its stream's
/// ack; the deliverer records it and the caller acknowledges the original.
async fn dead_letter(
    js: &jetstream::Context,
    subject: &str,
    message: &jetstream::Message,
    consumer: &str,
    reason: &str,
    copy: &str,
) -> Result<(), CopyFailure> {
    // The original's headers, minus JetStream's own (`Nats-Expected-*`,
    // `Nats-TTL`, `Nats-Rollup` … would refuse, expire or purge the copy).
    let mut headers = async_nats::HeaderMap::new();
    for (name, values) in message.headers.iter().flat_map(|h| h.iter()) {
        if name.to_string().to_ascii_lowercase().starts_with("nats-") {
            continue;
        }
        for value in values {
            headers.append(name.clone(), value.clone());
        }
    }
    // JetStream's own de-duplication must not swallow the copy.
    // Named by the original's place in its stream (or, unknown, by the
    // copy's id): a copy published again (its ack was lost, the redelivery
    // dead-letters once more) is dropped by JetStream's own de-duplication
    // window.
    let id = match message.info() {
        Ok(info) => format!("dlq-{}-{}", info.stream, info.stream_sequence),
        Err(_) => format!("dlq-{copy}"),
    };
    headers.insert("Nats-Msg-Id", id);
    headers.insert("Idemgate-Reason", sanitize(reason));
    headers.insert("Idemgate-Consumer", consumer);
    headers.insert("Idemgate-Copy", copy);
    headers.insert("Idemgate-Subject", message.subject.to_string());
    if let Some(id) = message.headers.as_ref().and_then(|h| h.get("Nats-Msg-Id")) {
        headers.insert("Idemgate-Msg-Id", id.as_str());
    }
    let sent = js
        .publish_with_headers(subject.to_owned(), headers, message.payload.clone())
        .await
        .map_err(|e| CopyFailure::Unknown(e.to_string()))?;
    // Only "no stream captures the subject" says the copy is not stored;
    // a timeout or a lost connection may hide one that is.
    sent.await.map(|_| ()).map_err(|e| match e.kind() {
        PublishErrorKind::StreamNotFound => CopyFailure::Refused(e.to_string()),
        _ => CopyFailure::Unknown(e.to_string()),
    })
}

/// A header value holds no line breaks.
fn sanitize(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// Whether a stream subject pattern (`a.*.c`, `a.>`) captures `subject`.
fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut pattern = pattern.split('.');
    let mut subject = subject.split('.');
    loop {
        match (pattern.next(), subject.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(p), Some(s)) if p == s => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

fn to_message(message: &jetstream::Message) -> Message {
    let mut headers = Vec::new();
    let mut id = None;
    if let Some(map) = &message.headers {
        for (name, values) in map.iter() {
            let name = name.to_string();
            if let [single] = values.as_slice() {
                if name.eq_ignore_ascii_case("Nats-Msg-Id") {
                    id = Some(single.as_str().to_owned());
                }
                headers.push((name, Ok(single.as_str().to_owned())));
            } else {
                headers.push((name, Err("sent more than once".to_owned())));
            }
        }
    }
    let content_type = headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case("content-type"))
        .and_then(|(_, v)| v.clone().ok());
    let delivery_count = message
        .info()
        .ok()
        .and_then(|info| u64::try_from(info.delivered).ok())
        .unwrap_or(0);
    Message {
        id,
        topic: message.subject.to_string(),
        headers,
        content_type,
        body: message.payload.clone(),
        delivery_count,
        key: std::sync::OnceLock::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::subject_matches;

    #[test]
    fn subject_patterns_match_as_jetstream_does() {
        assert!(subject_matches("ORDERS.>", "ORDERS.dlq"));
        assert!(subject_matches("ORDERS.*", "ORDERS.dlq"));
        assert!(subject_matches(">", "ORDERS.dlq"));
        assert!(subject_matches("ORDERS.dlq", "ORDERS.dlq"));
        assert!(!subject_matches("orders.>", "ORDERS.dlq"));
        assert!(!subject_matches("ORDERS.*", "ORDERS.dlq.x"));
        assert!(!subject_matches("ORDERS.>", "ORDERS"));
        assert!(!subject_matches("ORDERS.in.>", "ORDERS.dlq"));
    }
}
