//! RabbitMQ (AMQP 0-9-1, `lapin`): one connection and channel per
//! consumer, manual acks, `prefetch` unacknowledged messages at most.
//!
//! - The queue is the application's: it is checked (a passive declare), not
//!   created, so Idemgate never fights its owner over arguments. A missing
//!   queue is reported and retried with the reconnect backoff.
//! - Dead letters go to `dead_letter` (default `<queue>.dlq`, declared
//!   durable by Idemgate) through the default exchange, mandatory and with
//!   publisher confirms, carrying the reason and the consumer as headers;
//!   the original is acknowledged only after the broker stored the copy.
//!   (A queue's own dead-letter exchange works only where its owner set one
//!   — without one, a rejected message is dropped — and carries no reason.)
//! - Retries after an upstream failure: the message is held `retry_delay`,
//!   then rejected with requeue; RabbitMQ delivers it again, here or to
//!   another instance. Store outages and copies in flight are waited out
//!   in process ([`Deliverer::decide`]): a requeue counts against a quorum
//!   queue's `delivery-limit`.
//! - Acknowledgements go out in runs ([`acks`]): one `multiple` ack for
//!   the messages whose outcomes became durable together, never reaching
//!   past a message still in hand.
//! - A dropped connection ends the session; deliveries still running are
//!   seen through by their holders, and their acks are refused with the
//!   channel (counted as `error`) — the broker delivers them again and the
//!   store answers the repeat.

mod acks;

use std::sync::Arc;
use std::time::Duration;

use crate::deliveries::Deliveries;
use bytes::Bytes;
use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use acks::{Acks, Refusal};
use tokio_util::sync::CancellationToken;

use super::{CopyFailure, DeadLetters, Deliverer, Disposition, Message, keep_connected, redact};

/// Runs the consumer until `stop`, reconnecting with backoff.
pub(super) async fn run(
    d: Arc<Deliverer>,
    url: String,
    queue: String,
    dead_letters: DeadLetters,
    stop: CancellationToken,
) {
    let (d, url, queue, dead_letters, stop) = (&d, &url, &queue, &dead_letters, &stop);
    keep_connected(d, url, queue, stop, || async move {
        match session(d, url, queue, dead_letters, stop).await {
            Ok(()) => Err("the broker cancelled the consumer".to_owned()),
            Err(e) => Err(e.to_string()),
        }
    })
    .await;
}

/// Sets a session's channel up: `prefetch` unacknowledged messages at
/// most, publisher confirms (a dead letter is acknowledged only once the
/// broker has it), the queue checked to exist (never made: a typo must not
/// consume from an empty new queue), and a dead-letter queue of Idemgate's
/// own made if missing.
async fn declare(
    channel: &Channel,
    prefetch: u16,
    queue: &str,
    dead_letters: &DeadLetters,
) -> Result<(), lapin::Error> {
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    if let DeadLetters::Queue(name) = dead_letters {
        channel
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await?;
    }
    Ok(())
}

async fn session(
    d: &Arc<Deliverer>,
    url: &str,
    queue: &str,
    dead_letters: &DeadLetters,
    stop: &CancellationToken,
) -> Result<(), lapin::Error> {
    let settings = d.settings();
    let properties = ConnectionProperties::default()
        .with_connection_name(LongString::from(format!("idemgate {}", settings.name)));
    let connection = Connection::connect(url, properties).await?;
    let channel = connection.create_channel().await?;
    declare(&channel, settings.prefetch, queue, dead_letters).await?;
    let tag = format!("idemgate-{}-{}", settings.name, uuid::Uuid::new_v4());
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    d.counters().set_connected();
    tracing::info!(consumer = %settings.name, broker = %redact(url), queue = %queue, prefetch = settings.prefetch, layer = "consumer", "consuming");

    let acks = Acks::start(channel.clone());
    let mut deliveries = Deliveries::new(stop);
    let ended = loop {
        tokio::select! {
            _ = stop.cancelled() => break Ok(()),
            next = consumer.next() => match next {
                Some(Ok(delivery)) => {
                    acks.delivered(delivery.delivery_tag);
                    let d = d.clone();
                    let channel = channel.clone();
                    let acks = acks.clone();
                    let session = deliveries.session().clone();
                    let dead_letters = dead_letters.clone();
                    deliveries.spawn(async move {
                        handle(&d, &channel, &acks, &dead_letters, delivery, &session).await
                    });
                }
                Some(Err(e)) => break Err(e),
                None => break Ok(()),
            },
            () = deliveries.one_done() => {}
        }
    };
    let stopped = stop.is_cancelled();
    if stopped {
        // Stop taking messages before finishing those in hand.
        let _ = channel
            .basic_cancel(tag.as_str().into(), BasicCancelOptions::default())
            .await;
    }
    let then = "unacknowledged messages are delivered again";
    deliveries
        .end(stopped, settings.shutdown_grace, &settings.name, then)
        .await;
    acks.close();
    let reason = if stopped {
        "idemgate stopping"
    } else {
        "reconnecting"
    };
    let _ = connection.close(200, reason.into()).await;
    if stopped { Ok(()) } else { ended }
}

async fn handle(
    d: &Deliverer,
    channel: &Channel,
    acks: &Acks,
    dead_letters: &DeadLetters,
    delivery: Delivery,
    stop: &CancellationToken,
) {
    let message = to_message(&delivery);
    let verdict = d.decide(&message, stop, || async {}).await;
    let tag = delivery.delivery_tag;
    let done = match (&verdict, dead_letters) {
        (Disposition::Ack(_), _) => acks.ack(tag).await,
        (Disposition::Retry(delay) | Disposition::Wait(delay), _) => {
            requeue(acks, tag, *delay, stop).await
        }
        // The queue's owner routes dead letters: a rejection without
        // requeue hands it to the queue's dead-letter exchange, with its
        // `x-death` history (the reason is in the log, where the deliverer
        // wrote it). A rejection lost with the connection is repeated on
        // the redelivery: the broker dead-letters only what it took.
        (Disposition::DeadLetter { .. }, DeadLetters::Dlx) => {
            acks.refuse(tag, Refusal::Reject).await
        }
        (
            Disposition::DeadLetter {
                reason,
                copy,
                holder,
            },
            DeadLetters::Queue(dead_letters),
        ) => {
            let name = &d.settings().name;
            let publish = dead_letter(channel, dead_letters, &delivery, name, reason, copy);
            match d.copy_dead_letter(&message, holder, publish).await {
                Ok(()) => acks.ack(tag).await,
                Err(e) => {
                    // The copy is not stored: the original stays, and comes
                    // back after the delay (its failure count is kept).
                    let _ = requeue(acks, tag, d.settings().retry_delay, stop).await;
                    Err(e)
                }
            }
        }
    };
    d.settled(&message, &verdict, done);
}

/// Holds the message `delay` (cut short by a stop, so that another
/// instance gets it at once), then rejects it with requeue.
async fn requeue(
    acks: &Acks,
    tag: u64,
    delay: Duration,
    stop: &CancellationToken,
) -> Result<(), String> {
    tokio::select! {
        _ = stop.cancelled() => {}
        _ = tokio::time::sleep(delay) => {}
    }
    acks.refuse(tag, Refusal::Requeue).await
}

/// Publishes a copy to the dead-letter queue — mandatory, confirmed, and
/// not returned as unroutable; the deliverer records it and the caller
/// acknowledges the original.
async fn dead_letter(
    channel: &Channel,
    dead_letters: &str,
    delivery: &Delivery,
    consumer: &str,
    reason: &str,
    copy: &str,
) -> Result<(), CopyFailure> {
    let failed = |e: lapin::Error| CopyFailure::Unknown(e.to_string());
    // The copy is a new message: a quorum queue's count of the original's
    // deliveries would make the copy, moved back to the queue by an
    // operator, look like a redelivery of a message already settled.
    let mut headers = FieldTable::from(
        delivery
            .properties
            .headers()
            .iter()
            .flat_map(|table| table.inner())
            .filter(|(name, _)| name.as_str() != "x-delivery-count")
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect::<std::collections::BTreeMap<_, _>>(),
    );
    headers.insert(
        "x-idemgate-reason".into(),
        AMQPValue::LongString(LongString::from(reason.to_owned())),
    );
    // Which copy this is: moved back to the queue, it is counted apart
    // from the original (and from other copies). A copy made again after
    // its first publisher died carries the same id.
    headers.insert(
        "x-idemgate-copy".into(),
        AMQPValue::LongString(LongString::from(copy.to_owned())),
    );
    headers.insert(
        "x-idemgate-consumer".into(),
        AMQPValue::LongString(LongString::from(consumer.to_owned())),
    );
    headers.insert(
        "x-idemgate-routing-key".into(),
        AMQPValue::LongString(LongString::from(delivery.routing_key.to_string())),
    );
    let properties = dead_letter_properties(&delivery.properties, headers);
    let confirmed = channel
        .basic_publish(
            ShortString::from(""),
            dead_letters.into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            &delivery.data,
            properties,
        )
        .await
        .map_err(failed)?
        .await
        .map_err(failed)?;
    // A mandatory publish nobody could route is confirmed all the same,
    // with the message handed back: not stored.
    if !confirmed.is_ack() {
        return Err(CopyFailure::Refused(format!(
            "the broker refused the dead-letter copy for {dead_letters:?}"
        )));
    }
    if confirmed.take_message().is_some() {
        return Err(CopyFailure::Refused(format!(
            "the dead-letter queue {dead_letters:?} does not exist"
        )));
    }
    Ok(())
}

/// The original's properties for its dead-letter copy, persistent, minus
/// `expiration` (the copy must not expire with the original's per-message
/// TTL) and `user_id` (RabbitMQ checks it against the publishing user).
fn dead_letter_properties(original: &BasicProperties, headers: FieldTable) -> BasicProperties {
    let mut p = BasicProperties::default()
        .with_headers(headers)
        .with_delivery_mode(2);
    let o = original;
    if let Some(v) = o.content_type() {
        p = p.with_content_type(v.clone());
    }
    if let Some(v) = o.content_encoding() {
        p = p.with_content_encoding(v.clone());
    }
    if let Some(v) = o.priority() {
        p = p.with_priority(*v);
    }
    if let Some(v) = o.correlation_id() {
        p = p.with_correlation_id(v.clone());
    }
    if let Some(v) = o.reply_to() {
        p = p.with_reply_to(v.clone());
    }
    if let Some(v) = o.message_id() {
        p = p.with_message_id(v.clone());
    }
    if let Some(v) = o.timestamp() {
        p = p.with_timestamp(*v);
    }
    if let Some(v) = o.kind() {
        p = p.with_type(v.clone());
    }
    if let Some(v) = o.app_id() {
        p = p.with_app_id(v.clone());
    }
    if let Some(v) = o.cluster_id() {
        p = p.with_cluster_id(v.clone());
    }
    p
}

fn to_message(delivery: &Delivery) -> Message {
    let properties: &BasicProperties = &delivery.properties;
    let mut headers = Vec::new();
    let mut broker_count = None;
    if let Some(table) = properties.headers() {
        for (name, value) in table.inner() {
            if name.as_str() == "x-delivery-count" {
                broker_count = as_count(value);
            }
            headers.push((name.to_string(), header_text(value)));
        }
    }
    // Quorum queues count earlier deliveries in `x-delivery-count`; a
    // classic queue only says whether this is a redelivery.
    let delivery_count = match broker_count {
        Some(earlier) => earlier + 1,
        None if delivery.redelivered => 2,
        None => 1,
    };
    Message {
        id: properties.message_id().as_ref().map(|id| id.to_string()),
        topic: delivery.routing_key.to_string(),
        headers,
        content_type: properties.content_type().as_ref().map(|c| c.to_string()),
        body: Bytes::copy_from_slice(&delivery.data),
        delivery_count,
        key: std::sync::OnceLock::new(),
    }
}

fn as_count(value: &AMQPValue) -> Option<u64> {
    match value {
        AMQPValue::LongLongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongUInt(n) => Some(u64::from(*n)),
        AMQPValue::ShortInt(n) => u64::try_from(*n).ok(),
        AMQPValue::ShortUInt(n) => Some(u64::from(*n)),
        _ => None,
    }
}

/// A header's value as key text: strings as they are, integers as digits;
/// anything else is not a key.
fn header_text(value: &AMQPValue) -> Result<String, String> {
    match value {
        AMQPValue::LongString(s) => {
            String::from_utf8(s.as_bytes().to_vec()).map_err(|_| "not UTF-8".to_owned())
        }
        AMQPValue::ShortString(s) => Ok(s.to_string()),
        AMQPValue::ShortShortInt(n) => Ok(n.to_string()),
        AMQPValue::ShortShortUInt(n) => Ok(n.to_string()),
        AMQPValue::ShortInt(n) => Ok(n.to_string()),
        AMQPValue::ShortUInt(n) => Ok(n.to_string()),
        AMQPValue::LongInt(n) => Ok(n.to_string()),
        AMQPValue::LongUInt(n) => Ok(n.to_string()),
        AMQPValue::LongLongInt(n) => Ok(n.to_string()),
        other => Err(format!("a {:?} header is not a key", other.get_type())),
    }
}
