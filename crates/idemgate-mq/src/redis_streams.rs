//! Redis Streams: a consumer group read with `XREADGROUP`, each entry
//! acknowledged (`XACK`) only after its outcome is durable in the store.
//!
//! - The stream and the group are created when missing (`XGROUP CREATE …
//!   $ MKSTREAM`: a new group starts with the entries added after it). A
//!   group that vanished while this process ran (Redis restarted without
//!   persistence, the stream deleted) is created again after the last
//!   entry this process read, so nothing added in between is skipped and
//!   nothing handled before is read again.
//!   Each process reads as a consumer of its own name (the host, the pid
//!   and a random tag); entries it has not
//!   acknowledged stay in the group's pending list.
//! - An entry is a message: its `body` field is the body (without one, the
//!   body is a JSON object of every field, so `json:/pointer` keys work on
//!   fields), every other field is a header (`msg:header:order_id`), the
//!   stream is the topic, the entry id the message id.
//! - Retries after an upstream failure are made here, after `retry_delay`
//!   (a stream has no "nack"); the failure count is the store's, so
//!   `max_deliveries` holds across instances.
//! - A consumer that died leaves its entries pending: every instance
//!   claims entries idle longer than `claim_idle` (`XAUTOCLAIM`, its
//!   cursor carried from one scan to the next so entries held long by live
//!   consumers do not hide those behind them) and delivers them again — the
//!   store answers what was already done. An entry's idle time is reset
//!   only while this process still owns it.
//! - Dead letters are added to `<stream>.dlq` with the original's fields
//!   (but Idemgate's own) and `idemgate-reason`, `idemgate-copy`,
//!   `idemgate-consumer`, `idemgate-id` (the
//!   original's entry id), recorded in the store, then the original is
//!   acknowledged: a claim of it after a lost `XACK` adds no second copy.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::deliveries::Deliveries;
use bytes::Bytes;
use redis::Value;
use redis::aio::MultiplexedConnection;
use redis::streams::{StreamAutoClaimReply, StreamId, StreamReadReply};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::{CopyFailure, Deliverer, Disposition, Message, StreamSource, keep_connected, redact};

/// How long one `XREADGROUP` blocks for new entries.
const READ_BLOCK: Duration = Duration::from_millis(1000);
/// How long any other command may take before the connection is
/// considered lost.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);

/// The field that holds the body.
const BODY_FIELD: &str = "body";

/// Runs the consumer until `stop`, reconnecting with backoff.
pub(super) async fn run(d: Arc<Deliverer>, source: StreamSource, stop: CancellationToken) {
    // The id of the last entry read, kept across sessions.
    let last_read = Mutex::new(None);
    let (d, source, stop, last_read) = (&d, &source, &stop, &last_read);
    keep_connected(d, &source.url, &source.stream, stop, || async move {
        session(d, source, stop, last_read).await
    })
    .await;
}

/// This process's name in the group: stable for its life, different from
/// every other process's.
fn consumer_name(d: &Deliverer) -> String {
    // HOSTNAME is often unset (systemd, cron), and pids repeat across
    // hosts: a random tag drawn once per process keeps two hosts apart.
    static TAG: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let tag = TAG.get_or_init(|| uuid::Uuid::new_v4().simple().to_string()[..8].to_owned());
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "host".into());
    format!(
        "idemgate-{}-{host}-{}-{tag}",
        d.settings().name,
        std::process::id()
    )
}

/// Two connections: one for commands (acks, claims), one for the blocking
/// `XREADGROUP`, which holds its connection until it returns: commands
/// pipelined behind it would wait.
async fn connect(
    source: &StreamSource,
) -> Result<(MultiplexedConnection, MultiplexedConnection), redis::RedisError> {
    let client = redis::Client::open(source.url.as_str())?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    conn.set_response_timeout(COMMAND_TIMEOUT);
    let mut reader = client.get_multiplexed_async_connection().await?;
    reader.set_response_timeout(READ_BLOCK + COMMAND_TIMEOUT);
    Ok((conn, reader))
}

/// Makes the consumer group if it is missing (at the stream's end, or
/// after the last entry read here: see inside).
async fn ensure_group(
    conn: &mut MultiplexedConnection,
    d: &Deliverer,
    source: &StreamSource,
    last_read: &Mutex<Option<String>>,
) -> Result<(), String> {
    let failed = |e: redis::RedisError| e.to_string();
    // Where the group starts if it has to be created: for a process that
    // never read, at the stream's end (a new group takes what is added
    // after it); for one whose group vanished under it, after the last
    // entry it read — in the same stream, trimmed or not, and in one made
    // again after a Redis restart, whose entries (ids by time) come after
    // it. Never from the beginning: entries handled long ago, past the
    // store's retention, would run again.
    let read_before = lock(last_read).clone();
    let start = read_before.clone().unwrap_or_else(|| "$".to_owned());
    let created: Result<(), redis::RedisError> = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&source.stream)
        .arg(&source.group)
        .arg(&start)
        .arg("MKSTREAM")
        .query_async(conn)
        .await;
    match created {
        Err(e) if e.code() != Some("BUSYGROUP") => return Err(failed(e)),
        Ok(()) if read_before.is_some() => {
            tracing::warn!(consumer = %d.settings().name, stream = %source.stream, group = %source.group, after = %start, layer = "consumer", "the consumer group had vanished (Redis restarted without persistence, the stream deleted); made again after the last entry read here");
        }
        _ => {}
    }
    Ok(())
}

async fn session(
    d: &Arc<Deliverer>,
    source: &StreamSource,
    stop: &CancellationToken,
    last_read: &Mutex<Option<String>>,
) -> Result<(), String> {
    let failed = |e: redis::RedisError| e.to_string();
    let (mut conn, mut reader) = connect(source).await.map_err(failed)?;
    ensure_group(&mut conn, d, source, last_read).await?;
    let me: Arc<str> = consumer_name(d).into();
    let settings = d.settings();
    d.counters().set_connected();
    tracing::info!(consumer = %settings.name, broker = %redact(&source.url), stream = %source.stream, group = %source.group, prefetch = settings.prefetch, layer = "consumer", "consuming");

    let slots = Arc::new(Semaphore::new(usize::from(settings.prefetch.max(1))));
    let mut deliveries = Deliveries::new(stop);
    let claim_every = (source.claim_idle / 2).max(READ_BLOCK);
    let mut next_claim = tokio::time::Instant::now();
    let mut cursor = "0-0".to_owned();
    let ended: Result<(), String> = loop {
        deliveries.reap();
        if stop.is_cancelled() {
            break Ok(());
        }
        // A place for each entry in hand, `prefetch` at most: what is read
        // next never waits unacknowledged in this process.
        let free = slots.available_permits();
        if free == 0 {
            tokio::select! {
                _ = stop.cancelled() => break Ok(()),
                () = deliveries.one_done() => continue,
            }
        }
        // A read is never cancelled half-way: the entries of a reply Redis
        // sent are this consumer's pending entries, and one dropped here
        // would wait for another's claim. It blocks READ_BLOCK at most.
        let claimed = tokio::time::Instant::now() >= next_claim;
        let entries = if claimed {
            next_claim = tokio::time::Instant::now() + claim_every;
            let claimed = claim(&mut conn, source, &me, free, &mut cursor).await;
            if cursor == "0-0" {
                // A whole scan done: the names of finished processes go.
                forget_finished(&mut conn, source, &me, &d.settings().name).await;
            }
            claimed
        } else {
            let read = read(&mut reader, source, &me, free).await;
            if let Ok(Some(last)) = read.as_ref().map(|entries| entries.last()) {
                *lock(last_read) = Some(last.id.clone());
            }
            read
        };
        match entries {
            Ok(entries) => {
                for entry in entries {
                    let permit = slots
                        .clone()
                        .try_acquire_owned()
                        .map_err(|e| e.to_string())?;
                    spawn(
                        &mut deliveries,
                        d,
                        &conn,
                        source,
                        &me,
                        entry,
                        claimed,
                        permit,
                    );
                }
            }
            Err(e) => break Err(failed(e)),
        }
    };
    let stopped = stop.is_cancelled();
    // Entries whose acks fail stay pending, and are claimed again.
    let then = "unacknowledged entries stay pending and are claimed again";
    deliveries
        .end(stopped, settings.shutdown_grace, &settings.name, then)
        .await;
    if stopped {
        return Ok(());
    }
    ended.and(Err("the stream read ended".to_owned()))
}

/// New entries for this consumer, `count` at most, blocking a moment.
async fn read(
    conn: &mut MultiplexedConnection,
    source: &StreamSource,
    me: &str,
    count: usize,
) -> Result<Vec<StreamId>, redis::RedisError> {
    let reply: StreamReadReply = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(&source.group)
        .arg(me)
        .arg("COUNT")
        .arg(count.max(1))
        .arg("BLOCK")
        .arg(READ_BLOCK.as_millis() as u64)
        .arg("STREAMS")
        .arg(&source.stream)
        .arg(">")
        .query_async(conn)
        .await?;
    Ok(reply.keys.into_iter().flat_map(|k| k.ids).collect())
}

/// Entries pending on any consumer (this one included) for longer than
/// `claim_idle`, made this consumer's: one step of a scan of the pending
/// list from `cursor`, which is moved on (back to the start after the end).
async fn claim(
    conn: &mut MultiplexedConnection,
    source: &StreamSource,
    me: &str,
    count: usize,
    cursor: &mut String,
) -> Result<Vec<StreamId>, redis::RedisError> {
    if count == 0 {
        return Ok(Vec::new());
    }
    let reply: StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
        .arg(&source.stream)
        .arg(&source.group)
        .arg(me)
        .arg(source.claim_idle.as_millis() as u64)
        .arg(cursor.as_str())
        .arg("COUNT")
        .arg(count)
        .query_async(conn)
        .await?;
    *cursor = reply.next_stream_id;
    Ok(reply.claimed)
}

/// Removes from the group the consumers of earlier processes of this
/// consumer (same name prefix) that hold no pending entry and have been
/// idle past `claim_idle`: each process reads under a name of its own, and
/// without this every restart would leave one behind. Safe for a live one
/// too: holding nothing, it loses nothing, and Redis makes it again on its
/// next read. Best effort.
async fn forget_finished(
    conn: &mut MultiplexedConnection,
    source: &StreamSource,
    me: &str,
    consumer: &str,
) {
    let prefix = format!("idemgate-{consumer}-");
    let listed: Result<redis::streams::StreamInfoConsumersReply, _> = redis::cmd("XINFO")
        .arg("CONSUMERS")
        .arg(&source.stream)
        .arg(&source.group)
        .query_async(conn)
        .await;
    let Ok(listed) = listed else {
        return;
    };
    let idle = source.claim_idle.as_millis();
    for gone in listed.consumers.iter().filter(|c| {
        c.name != me && c.name.starts_with(&prefix) && c.pending == 0 && c.idle as u128 > idle
    }) {
        let _: Result<i64, _> = redis::cmd("XGROUP")
            .arg("DELCONSUMER")
            .arg(&source.stream)
            .arg(&source.group)
            .arg(&gone.name)
            .query_async(conn)
            .await;
    }
}

#[allow(clippy::too_many_arguments)]
fn spawn(
    deliveries: &mut Deliveries,
    d: &Arc<Deliverer>,
    conn: &MultiplexedConnection,
    source: &StreamSource,
    me: &Arc<str>,
    entry: StreamId,
    claimed: bool,
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    let session = deliveries.session().clone();
    let (d, conn, source) = (d.clone(), conn.clone(), source.clone());
    let me = me.clone();
    deliveries.spawn(async move {
        let _permit = permit;
        let handled = handle(&d, conn.clone(), &source, entry.clone(), claimed, &session);
        tokio::select! {
            () = handled => {}
            () = keep_claimed(conn, &source, &me, &entry.id) => {}
        }
    });
}

/// Resets an entry's idle time if `ARGV[2]` still owns it: an entry
/// another consumer claimed (this one stalled past `claim_idle`) is not
/// taken back.
const RESET_IF_OWNED: &str = r"
local mine = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2])
if #mine == 0 then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
return 1
";

/// Resets the entry's idle time while this process holds it, a third of
/// `claim_idle` apart: a slow upstream or a retry pause is not mistaken
/// for a dead consumer, and only an entry whose holder stopped is claimed
/// by another. Once another consumer owns it, it stops (the store's claim
/// keeps the two handlers from forwarding it twice). Never returns.
async fn keep_claimed(mut conn: MultiplexedConnection, source: &StreamSource, me: &str, id: &str) {
    let mut every = tokio::time::interval(source.claim_idle / 3);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    every.tick().await;
    let script = redis::Script::new(RESET_IF_OWNED);
    loop {
        every.tick().await;
        let reset: Result<i64, redis::RedisError> = script
            .key(&source.stream)
            .arg(&source.group)
            .arg(me)
            .arg(id)
            .invoke_async(&mut conn)
            .await;
        match reset {
            Ok(1) => {}
            Ok(_) => break,
            Err(e) => {
                // Scripting refused (an ACL without EVAL/EVALSHA, a managed
                // Redis without Lua) shows here: entries in hand are then
                // claimed by others after claim_idle.
                tracing::warn!(stream = %source.stream, id, error = %e, layer = "consumer", "could not reset an entry's idle time; another consumer may claim it after claim_idle");
            }
        }
    }
    std::future::pending::<()>().await;
}

async fn handle(
    d: &Deliverer,
    mut conn: MultiplexedConnection,
    source: &StreamSource,
    entry: StreamId,
    claimed: bool,
    stop: &CancellationToken,
) {
    let mut message = to_message(source, &entry, claimed);
    loop {
        let verdict = d.decide(&message, stop, || async {}).await;
        let done = match &verdict {
            Disposition::Ack(_) => xack(&mut conn, source, &entry.id).await,
            Disposition::Retry(delay) | Disposition::Wait(delay) => {
                if stop.is_cancelled() {
                    // Left pending: another instance claims it.
                    Ok(())
                } else {
                    d.settled(&message, &verdict, Ok(()));
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(*delay) => {}
                    }
                    message.delivery_count += 1;
                    continue;
                }
            }
            Disposition::DeadLetter {
                reason,
                copy,
                holder,
            } => {
                let name = &d.settings().name;
                let publish = dead_letter(conn.clone(), source, &entry, name, reason, copy);
                match d.copy_dead_letter(&message, holder, publish).await {
                    Ok(()) => xack(&mut conn, source, &entry.id).await,
                    Err(e) => Err(e),
                }
            }
        };
        d.settled(&message, &verdict, done);
        return;
    }
}

async fn xack(
    conn: &mut MultiplexedConnection,
    source: &StreamSource,
    id: &str,
) -> Result<(), String> {
    let acked: i64 = redis::cmd("XACK")
        .arg(&source.stream)
        .arg(&source.group)
        .arg(id)
        .query_async(conn)
        .await
        .map_err(|e| e.to_string())?;
    // 0: another consumer claimed it meanwhile (it answers the entry from
    // the store); nothing is lost.
    let _ = acked;
    Ok(())
}

/// Adds the dead letter to the dead-letter stream; the deliverer records
/// it and the caller acknowledges the original.
async fn dead_letter(
    mut conn: MultiplexedConnection,
    source: &StreamSource,
    entry: &StreamId,
    consumer: &str,
    reason: &str,
    copy: &str,
) -> Result<(), CopyFailure> {
    let mut add = redis::cmd("XADD");
    add.arg(&source.dead_letter).arg("*");
    // A copy of a copy keeps one set of Idemgate's fields: the new one.
    for (field, value) in sorted_fields(entry) {
        if !field.starts_with("idemgate-") {
            add.arg(field).arg(value);
        }
    }
    add.arg("idemgate-copy")
        .arg(copy)
        .arg("idemgate-reason")
        .arg(reason)
        .arg("idemgate-consumer")
        .arg(consumer)
        .arg("idemgate-id")
        .arg(&entry.id);
    let added: Result<String, _> = add.query_async(&mut conn).await;
    added.map(|_| ()).map_err(|e| {
        // Redis answered with an error: nothing was added. Lost on the
        // way, it may have been.
        if e.kind() != redis::ErrorKind::Io && !e.is_timeout() && !e.is_connection_dropped() {
            CopyFailure::Refused(e.to_string())
        } else {
            CopyFailure::Unknown(e.to_string())
        }
    })
}

/// The entry's fields by name, as bytes.
fn sorted_fields(entry: &StreamId) -> BTreeMap<&str, Vec<u8>> {
    entry
        .map
        .iter()
        .map(|(k, v)| (k.as_str(), value_bytes(v)))
        .collect()
}

fn value_bytes(value: &Value) -> Vec<u8> {
    match value {
        Value::BulkString(bytes) => bytes.clone(),
        Value::SimpleString(s) => s.clone().into_bytes(),
        Value::Int(n) => n.to_string().into_bytes(),
        other => format!("{other:?}").into_bytes(),
    }
}

fn to_message(source: &StreamSource, entry: &StreamId, claimed: bool) -> Message {
    let fields = sorted_fields(entry);
    let mut headers = Vec::new();
    for (name, value) in &fields {
        if *name != BODY_FIELD {
            let text = String::from_utf8(value.clone()).map_err(|_| "not UTF-8".to_owned());
            headers.push(((*name).to_owned(), text));
        }
    }
    let body = match fields.get(BODY_FIELD) {
        Some(body) => Bytes::copy_from_slice(body),
        // No body field: the fields as one JSON object.
        None => {
            let object: serde_json::Map<String, serde_json::Value> = fields
                .iter()
                .map(|(k, v)| {
                    (
                        (*k).to_owned(),
                        serde_json::Value::String(String::from_utf8_lossy(v).into_owned()),
                    )
                })
                .collect();
            Bytes::from(serde_json::to_vec(&object).unwrap_or_default())
        }
    };
    Message {
        id: Some(entry.id.clone()),
        topic: source.stream.clone(),
        headers,
        content_type: Some(
            match fields.get(BODY_FIELD) {
                Some(body) if serde_json::from_slice::<serde_json::Value>(body).is_err() => {
                    "application/octet-stream"
                }
                _ => "application/json",
            }
            .to_owned(),
        ),
        body,
        // A claimed entry was delivered before (to a consumer that died,
        // or that is this one, retrying).
        delivery_count: if claimed { 2 } else { 1 },
        key: std::sync::OnceLock::new(),
    }
}

/// The guarded value, even if a holder panicked (an id stays an id).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
