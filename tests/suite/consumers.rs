//! The MQ link (docs/semantics.md, "Queues") against the real brokers: RabbitMQ and NATS
//! JetStream, real gateways, the demo upstream's `/actions/{name}` — which
//! executes on every call, so each count below is what the gateway let
//! through, not what the upstream deduplicated.

use crate::support;

use std::collections::BTreeMap;
use std::time::Duration;

use support::brokers::{PrivateNats, PrivateRabbit, Queue, RedisStream, Stream, consumer_toml};
use support::services::{self, FaultProxy, Mode, postgres, shared_sql};
use support::{Http, Stack, dead_port, eventually, executions};

/// One series of `/metrics`.
async fn metric(stack: &Stack, consumer: &str, outcome: &str) -> u64 {
    metric_at(&stack.http, &stack.admin("/metrics"), consumer, outcome).await
}

async fn metric_at(http: &Http, url: &str, consumer: &str, outcome: &str) -> u64 {
    let text = http.get(url).await.body;
    let line = format!("idemgate_messages_total{{consumer=\"{consumer}\",outcome=\"{outcome}\"}} ");
    String::from_utf8_lossy(&text)
        .lines()
        .find_map(|l| l.strip_prefix(&line).map(|v| v.trim().parse().unwrap()))
        .unwrap_or(0)
}

/// Executions of `action` per forwarded key.
fn per_key(stack: &Stack, action: &str) -> BTreeMap<String, u64> {
    stack
        .upstream
        .state
        .stats()
        .executions
        .get(action)
        .cloned()
        .unwrap_or_default()
}

async fn arm(stack: &Stack, plan: &'static str) {
    let answer = stack
        .http
        .send(
            "POST",
            &format!("{}/faults", stack.upstream.url()),
            &[],
            plan,
        )
        .await;
    assert!(answer.status.is_success(), "{answer:?}");
}

const WAIT: Duration = Duration::from_secs(20);

#[tokio::test]
async fn amqp_the_same_message_published_100_times_executes_once_and_all_are_acked() {
    let Some(queue) = Queue::new("amqp_100").await else {
        return;
    };
    let stack = Stack::start(&queue.consumer("coupons", "/actions/mq100", "prefetch = 16")).await;
    for _ in 0..100 {
        queue
            .publish(Some("msg-1"), br#"{"coupon":"C1"}"#, &[])
            .await;
    }
    let settled = eventually(WAIT, || async {
        metric(&stack, "coupons", "forwarded").await + metric(&stack, "coupons", "duplicate").await
            == 100
    })
    .await;
    assert!(settled, "not every delivery was acknowledged");
    assert_eq!(executions(&stack, "mq100"), 1);
    assert_eq!(metric(&stack, "coupons", "forwarded").await, 1);
    assert_eq!(metric(&stack, "coupons", "duplicate").await, 99);
    assert_eq!(queue.ready(&queue.name).await, 0);
    // The upstream saw the stable key, the id, the topic and a count.
    let keys = per_key(&stack, "mq100");
    assert!(keys.keys().all(|k| k.starts_with("ig-")), "{keys:?}");
    stack.shutdown().await;
}

/// Acks go out in runs (one `multiple` ack for messages settled
/// together), and a run never covers a message still in hand: 300
/// messages whose first 60 attempts fail — each held `retry_delay`, then
/// requeued, while the rest are acknowledged around them — all execute
/// once, none is acknowledged before its outcome (it would be lost, never
/// executed), and the channel never sees a tag settled twice (an error).
#[tokio::test]
async fn amqp_acks_in_runs_never_cover_a_message_being_requeued() {
    let Some(queue) = Queue::new("amqp_runs").await else {
        return;
    };
    let stack =
        Stack::start(&queue.consumer("pay", "/actions/runs", "prefetch = 64\nmax_deliveries = 5"))
            .await;
    arm(&stack, r#"{"fail_status": 503, "count": 60}"#).await;
    for i in 0..300 {
        queue.publish(Some(&format!("r-{i}")), b"{}", &[]).await;
    }
    let settled = eventually(WAIT, || async {
        metric(&stack, "pay", "forwarded").await == 300
    })
    .await;
    let keys = per_key(&stack, "runs");
    assert!(settled, "{} of 300 executed", keys.len());
    assert_eq!(keys.len(), 300);
    assert!(keys.values().all(|n| *n == 1), "{keys:?}");
    assert!(metric(&stack, "pay", "retried").await >= 60);
    assert_eq!(metric(&stack, "pay", "error").await, 0);
    assert_eq!(queue.ready(&queue.name).await, 0);
    stack.shutdown().await;
}

#[tokio::test]
async fn nats_the_same_message_published_100_times_executes_once_and_all_are_acked() {
    let Some(stream) = Stream::new("nats_100", None).await else {
        return;
    };
    // Keyed by a header, not Nats-Msg-Id: JetStream's own publish window
    // would drop the copies before they were stored, and prove nothing.
    let consumer = stream.consumer(
        "events",
        "/actions/nats100",
        r#"business_key = ["msg:header:Event-Id", "msg:topic"]"#,
    );
    let stack = Stack::start(&consumer).await;
    for _ in 0..100 {
        stream
            .publish("coupon", &[("Event-Id", "e-1")], br#"{"coupon":"C1"}"#)
            .await;
    }
    let settled = eventually(WAIT, || async {
        metric(&stack, "events", "forwarded").await + metric(&stack, "events", "duplicate").await
            == 100
    })
    .await;
    assert!(settled, "not every delivery was acknowledged");
    assert_eq!(executions(&stack, "nats100"), 1);
    assert_eq!(metric(&stack, "events", "duplicate").await, 99);
    stack.shutdown().await;
}

#[tokio::test]
async fn amqp_an_upstream_500_twice_then_201_is_three_deliveries_and_one_execution() {
    let Some(queue) = Queue::new("amqp_500s").await else {
        return;
    };
    let stack = Stack::start(&queue.consumer("pay", "/actions/flaky", "max_deliveries = 5")).await;
    arm(&stack, r#"{"fail_status": 500, "count": 2}"#).await;
    queue.publish(Some("p-1"), b"{}", &[]).await;
    let done = eventually(WAIT, || async {
        metric(&stack, "pay", "forwarded").await == 1
    })
    .await;
    assert!(done, "the message was never delivered");
    assert_eq!(metric(&stack, "pay", "retried").await, 2);
    assert_eq!(stack.upstream.state.stats().requests, 3);
    assert_eq!(executions(&stack, "flaky"), 1);
    assert_eq!(queue.ready(&queue.dlq()).await, 0);
    stack.shutdown().await;
}

#[tokio::test]
async fn amqp_an_upstream_that_always_fails_is_dead_lettered_after_max_deliveries() {
    let Some(queue) = Queue::new("amqp_dlq").await else {
        return;
    };
    let stack = Stack::start(&queue.consumer("pay", "/actions/down", "max_deliveries = 3")).await;
    arm(&stack, r#"{"fail_status": 503}"#).await;
    queue.publish(Some("p-2"), b"{}", &[]).await;
    let dead = eventually(WAIT, || async {
        metric(&stack, "pay", "dead_lettered").await == 1
    })
    .await;
    assert!(dead, "never dead-lettered");
    assert_eq!(stack.upstream.state.stats().requests, 3);
    assert_eq!(metric(&stack, "pay", "retried").await, 2);
    assert_eq!(queue.ready(&queue.name).await, 0);
    let copy = queue.take(&queue.dlq()).await.expect("a dead letter");
    let headers = copy.delivery.properties.headers().clone().unwrap();
    let reason = match headers.inner().get("x-idemgate-reason") {
        Some(lapin::types::AMQPValue::LongString(s)) => {
            String::from_utf8_lossy(s.as_bytes()).into_owned()
        }
        other => panic!("no reason header: {other:?}"),
    };
    assert!(reason.contains("failed 3 time"), "{reason}");
    assert_eq!(
        copy.delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str()),
        Some("p-2")
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn amqp_messages_without_a_usable_key_are_dead_lettered_and_never_forwarded() {
    let Some(queue) = Queue::new("amqp_nokey").await else {
        return;
    };
    let stack = Stack::start(&queue.consumer("pay", "/actions/nokey", "")).await;
    queue.publish(None, b"{}", &[]).await;
    queue.publish(Some("a\u{0}b"), b"{}", &[]).await;
    queue.publish(Some(""), b"{}", &[]).await;
    queue.publish(Some(&"x".repeat(250)), b"{}", &[]).await;
    let dead = eventually(WAIT, || async {
        metric(&stack, "pay", "dead_lettered").await == 4
    })
    .await;
    assert!(dead, "not every keyless message was dead-lettered");
    assert_eq!(stack.upstream.state.stats().requests, 0);
    assert_eq!(queue.ready(&queue.dlq()).await, 4);
    assert_eq!(queue.ready(&queue.name).await, 0);
    stack.shutdown().await;
}

/// A message is identified by its key, not its bytes: a producer's
/// re-publish with a new timestamp is a duplicate (acked, not forwarded);
/// one whose `must_match` field differs is dead-lettered, never forwarded.
#[tokio::test]
async fn amqp_a_restamped_message_is_a_duplicate_and_another_amount_a_dead_letter() {
    let Some(queue) = Queue::new("amqp_restamped").await else {
        return;
    };
    let extra = r#"must_match = ["json:/amount"]"#;
    let stack = Stack::start(&queue.consumer("pay", "/actions/restamp", extra)).await;
    for stamp in 1..=3 {
        let body = format!(r#"{{"amount":100,"sent_at":{stamp}}}"#);
        queue.publish(Some("pay-1"), body.as_bytes(), &[]).await;
    }
    let acked = eventually(WAIT, || async {
        metric(&stack, "pay", "forwarded").await + metric(&stack, "pay", "duplicate").await == 3
    })
    .await;
    assert!(
        acked,
        "the re-stamped copies were not acknowledged as duplicates"
    );
    queue
        .publish(Some("pay-1"), br#"{"amount":999,"sent_at":4}"#, &[])
        .await;
    let dead = eventually(WAIT, || async {
        metric(&stack, "pay", "dead_lettered").await == 1
    })
    .await;
    assert!(
        dead,
        "another amount under the same key was not dead-lettered"
    );
    assert_eq!(executions(&stack, "restamp"), 1);
    assert_eq!(queue.ready(&queue.dlq()).await, 1);
    stack.shutdown().await;
}

#[tokio::test]
async fn nats_failures_and_keyless_messages_go_to_the_dlq_subject() {
    let Some(stream) = Stream::new("nats_dlq", None).await else {
        return;
    };
    let consumer = stream.consumer(
        "events",
        "/actions/natsdlq",
        r#"business_key = ["json:/order"]
        max_deliveries = 2"#,
    );
    let stack = Stack::start(&consumer).await;
    arm(&stack, r#"{"fail_status": 500}"#).await;
    stream.publish("a", &[], br#"{"order":"o-1"}"#).await;
    stream.publish("a", &[], br#"{"no_order":true}"#).await;
    stream.publish("a", &[], b"not json").await;
    let dead = eventually(WAIT, || async {
        metric(&stack, "events", "dead_lettered").await == 3
    })
    .await;
    assert!(dead, "not dead-lettered");
    assert_eq!(stack.upstream.state.stats().requests, 2);
    assert_eq!(stream.dead_letters().await, 3);
    stack.shutdown().await;
}

#[tokio::test]
async fn a_private_nats_server_restarted_mid_stream_loses_nothing_and_executes_each_once() {
    let Some(mut nats) = PrivateNats::start("nats_restart").await else {
        return;
    };
    let url = nats.url();
    let stream = Stream::new("nats_restart", Some(&url)).await.unwrap();
    let consumer = stream.consumer(
        "events",
        "/actions/restart",
        r#"business_key = ["msg:header:Event-Id"]"#,
    );
    let stack = Stack::start(&consumer).await;
    for i in 0..40 {
        let id = format!("e-{i}");
        stream.publish("x", &[("Event-Id", &id)], b"{}").await;
    }
    // Mid-stream: some delivered, the server killed under the consumer.
    let some = eventually(WAIT, || async { executions(&stack, "restart") >= 5 }).await;
    assert!(some);
    nats.restart(Duration::from_millis(500)).await;
    // The test's own client reconnects by itself; wait until JetStream
    // answers it again before publishing the rest.
    let back = eventually(WAIT, || async {
        stream.js.get_stream(&stream.name).await.is_ok()
    })
    .await;
    assert!(back, "the restarted server never served the stream");
    for i in 40..60 {
        let id = format!("e-{i}");
        stream.publish("x", &[("Event-Id", &id)], b"{}").await;
    }
    let all = eventually(Duration::from_secs(40), || async {
        per_key(&stack, "restart").len() == 60
    })
    .await;
    assert!(
        all,
        "only {} of 60 executed",
        per_key(&stack, "restart").len()
    );
    // Give redeliveries of unacked messages time to arrive, then count.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let keys = per_key(&stack, "restart");
    assert!(keys.values().all(|n| *n == 1), "{keys:?}");
    assert_eq!(executions(&stack, "restart"), 60);
    stack.shutdown().await;
}

#[tokio::test]
async fn an_amqp_connection_cut_mid_stream_is_reconnected_and_each_message_executes_once() {
    let Some(queue) = Queue::new("amqp_cut").await else {
        return;
    };
    let broker = FaultProxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let source = format!("amqp://guest:guest@127.0.0.1:{}/%2f", broker.port);
    let consumer = consumer_toml(
        "pay",
        &source,
        &format!("queue = \"{}\"", queue.name),
        "/actions/cut",
        "prefetch = 4",
    );
    let stack = Stack::start(&consumer).await;
    for i in 0..30 {
        queue.publish(Some(&format!("m-{i}")), b"{}", &[]).await;
    }
    assert!(eventually(WAIT, || async { executions(&stack, "cut") >= 3 }).await);
    broker.set(Mode::Refuse);
    let ready = Http::default();
    let down = eventually(WAIT, || async {
        let body = ready.get(&stack.admin("/readyz")).await.json();
        body["consumers"]["pay"]
            .as_str()
            .unwrap_or("")
            .starts_with("disconnected")
    })
    .await;
    assert!(down, "/readyz never reported the lost broker");
    for i in 30..50 {
        queue.publish(Some(&format!("m-{i}")), b"{}", &[]).await;
    }
    broker.set(Mode::Pass);
    let all = eventually(Duration::from_secs(30), || async {
        per_key(&stack, "cut").len() == 50 && queue.ready(&queue.name).await == 0
    })
    .await;
    assert!(all, "only {} of 50 executed", per_key(&stack, "cut").len());
    let keys = per_key(&stack, "cut");
    assert!(keys.values().all(|n| *n == 1), "{keys:?}");
    let body = ready.get(&stack.admin("/readyz")).await.json();
    assert_eq!(body["consumers"]["pay"], "connected");
    stack.shutdown().await;
}

#[tokio::test]
async fn two_gateways_consuming_one_queue_execute_each_message_once() {
    let Some(queue) = Queue::new("amqp_two").await else {
        return;
    };
    let Some(db) = shared_sql("two_gateways_consuming_one_queue").await else {
        return;
    };
    let consumer = queue.consumer("pay", "/actions/two", "prefetch = 8");
    let one = Stack::start_with(&consumer, |c| c.store.database_url = db.clone()).await;
    // The second gateway forwards to the first's upstream, so one counter
    // sees every execution.
    let mut config = support::config(one.upstream.addr, &consumer);
    config.store.database_url = db.clone();
    let two = idemgate_gateway::gateway::start_for_tests(config)
        .await
        .unwrap();
    // 100 messages, each published twice: 200 deliveries over two
    // consumers with their own prefetch windows.
    for round in 0..2 {
        for i in 0..100 {
            queue
                .publish(
                    Some(&format!("m-{i}")),
                    format!("{{\"n\":{i}}}").as_bytes(),
                    &[],
                )
                .await;
        }
        let _ = round;
    }
    let two_metrics = format!("http://{}/metrics", two.admin_addr);
    let settled = eventually(Duration::from_secs(30), || async {
        let mut n = 0;
        for outcome in ["forwarded", "duplicate"] {
            n += metric(&one, "pay", outcome).await;
            n += metric_at(&one.http, &two_metrics, "pay", outcome).await;
        }
        n == 200
    })
    .await;
    assert!(settled, "not every delivery was acknowledged");
    let keys = per_key(&one, "two");
    assert_eq!(keys.len(), 100);
    assert!(keys.values().all(|n| *n == 1), "{keys:?}");
    let second = metric_at(&one.http, &two_metrics, "pay", "forwarded").await
        + metric_at(&one.http, &two_metrics, "pay", "duplicate").await;
    assert!(second > 0, "the second gateway consumed nothing");
    two.shutdown().await;
    one.shutdown().await;
}

#[tokio::test]
async fn postgres_unreachable_nothing_is_forwarded_and_messages_are_delivered_once_after() {
    let Some(queue) = Queue::new("amqp_pgdown").await else {
        return;
    };
    let Some(db) = shared_sql("postgres_unreachable_consumer").await else {
        return;
    };
    let pg = FaultProxy::start(services::sql_addr(&db)).await;
    let via_proxy = services::via(&db, pg.port);
    let consumer = queue.consumer("pay", "/actions/pgdown", "");
    let stack = Stack::start_with(&consumer, |c| {
        c.store.database_url = via_proxy.clone();
        c.store.timeout = "500ms".into();
        c.store.lease = "2s".into();
    })
    .await;
    pg.set(Mode::Refuse);
    for i in 0..5 {
        queue.publish(Some(&format!("m-{i}")), b"{}", &[]).await;
    }
    // Well past several retry delays: each delivery met the closed store.
    let retried = eventually(WAIT, || async {
        metric(&stack, "pay", "retried").await >= 10
    })
    .await;
    assert!(
        retried,
        "deliveries were not retried while the store was down"
    );
    assert_eq!(stack.upstream.state.stats().requests, 0);
    assert_eq!(metric(&stack, "pay", "dead_lettered").await, 0);
    pg.set(Mode::Pass);
    let all = eventually(Duration::from_secs(30), || async {
        per_key(&stack, "pgdown").len() == 5 && metric(&stack, "pay", "forwarded").await == 5
    })
    .await;
    assert!(all, "messages were not delivered once the store returned");
    assert_eq!(executions(&stack, "pgdown"), 5);
    assert_eq!(queue.ready(&queue.dlq()).await, 0);
    stack.shutdown().await;
}

/// Deliveries waiting in process (the store away) when the broker
/// connection drops can only fail to ack: they stop waiting with their
/// session, and only the new session's copies wait (before: both, for up
/// to five minutes, a pile that grew with every reconnect).
#[tokio::test]
async fn a_session_that_ends_takes_its_waiting_deliveries_with_it() {
    let Some(queue) = Queue::new("amqp_session_end").await else {
        return;
    };
    let Some(db) = shared_sql("a_session_that_ends_takes_its_waiting_deliveries_with_it").await
    else {
        return;
    };
    let pg = FaultProxy::start(services::sql_addr(&db)).await;
    let via_proxy = services::via(&db, pg.port);
    let broker = FaultProxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let source = format!("amqp://guest:guest@127.0.0.1:{}/%2f", broker.port);
    let consumer = consumer_toml(
        "pay",
        &source,
        &format!("queue = \"{}\"", queue.name),
        "/actions/session",
        "",
    );
    let stack = Stack::start_with(&consumer, |c| {
        c.store.database_url = via_proxy.clone();
        c.store.timeout = "500ms".into();
    })
    .await;
    pg.set(Mode::Refuse);
    for i in 0..5 {
        queue.publish(Some(&format!("s-{i}")), b"{}", &[]).await;
    }
    let waiting = || async {
        let text = stack.http.get(&stack.admin("/metrics")).await.body;
        let line = "idemgate_messages_waiting{consumer=\"pay\"} ";
        String::from_utf8_lossy(&text)
            .lines()
            .find_map(|l| {
                l.strip_prefix(line)
                    .map(|v| v.trim().parse::<u64>().unwrap())
            })
            .unwrap_or(0)
    };
    assert!(eventually(WAIT, || async { waiting().await == 5 }).await);
    // The broker connection drops and comes back: the five are delivered
    // again to the new session, and wait there.
    broker.set(Mode::Refuse);
    let ready = Http::default();
    let state = || async {
        ready.get(&stack.admin("/readyz")).await.json()["consumers"]["pay"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    };
    assert!(eventually(WAIT, || async { state().await.starts_with("disconnected") }).await);
    broker.set(Mode::Pass);
    assert!(eventually(WAIT, || async { state().await == "connected" }).await);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut most = 0;
    for _ in 0..10 {
        most = most.max(waiting().await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(most <= 5, "{most} deliveries waiting for 5 messages");
    pg.set(Mode::Pass);
    let all = eventually(Duration::from_secs(30), || async {
        per_key(&stack, "session").len() == 5
    })
    .await;
    assert!(all);
    assert!(per_key(&stack, "session").values().all(|n| *n == 1));
    stack.shutdown().await;
}

#[tokio::test]
async fn a_gateway_killed_after_recording_and_before_its_ack_is_not_executed_again() {
    let Some(queue) = Queue::new("amqp_kill").await else {
        return;
    };
    let upstream = idemgate_demo_upstream::start("127.0.0.1:0").await.unwrap();
    let broker = FaultProxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let dir = tempfile::tempdir().unwrap();
    let (public, admin) = (dead_port(), dead_port());
    let consumer = consumer_toml(
        "pay",
        &format!("amqp://guest:guest@127.0.0.1:{}/%2f", broker.port),
        &format!("queue = \"{}\"", queue.name),
        "/actions/kill",
        r#"business_key = ["msg:message_id"]"#,
    );
    let text = format!(
        r#"
        [server]
        listen = "127.0.0.1:{public}"
        admin_listen = "127.0.0.1:{admin}"
        [store]
        database_url = "sqlite://{}/records.db"
        [[upstreams]]
        name = "demo"
        url = "http://{}"
        timeout = "5s"
        {consumer}
        "#,
        dir.path().display(),
        upstream.addr
    );
    let path = dir.path().join("idemgate.toml");
    std::fs::write(&path, text).unwrap();
    let http = Http::default();
    // The upstream executes at once and then stalls its body: the outcome
    // arrives 1.5 s after the action ran.
    let armed = http
        .send(
            "POST",
            &format!("{}/faults", upstream.url()),
            &[],
            r#"{"stall_body_ms": 1500, "count": 1}"#,
        )
        .await;
    assert!(armed.status.is_success());
    let mut gateway = support::spawn_gateway(&path);
    support::wait_up(&http, &format!("http://127.0.0.1:{admin}/healthz")).await;
    queue.publish(Some("kill-1"), b"{}", &[]).await;
    let ran = eventually(WAIT, || async {
        upstream.state.stats().total_executions == 1
    })
    .await;
    assert!(ran);
    // The broker connection goes while the body is still coming: the ack
    // that follows the record cannot reach the broker.
    broker.set(Mode::Refuse);
    let record = format!("http://127.0.0.1:{admin}/admin/keys/pay/kill-1");
    let recorded = eventually(WAIT, || async {
        let answer = http.get(&record).await;
        answer.status.is_success() && answer.json()["records"][0]["state"] == "completed"
    })
    .await;
    assert!(recorded, "the outcome was never recorded");
    gateway.kill().unwrap();
    gateway.wait().unwrap();
    broker.set(Mode::Pass);
    // The message is still in the queue (never acknowledged); the
    // restarted gateway is delivered it again and acknowledges the repeat.
    let mut restarted = support::spawn_gateway(&path);
    // A new client: the old one's kept connection died with the process.
    let http = Http::default();
    support::wait_up(&http, &format!("http://127.0.0.1:{admin}/healthz")).await;
    let metrics = format!("http://127.0.0.1:{admin}/metrics");
    let acked = eventually(WAIT, || async {
        metric_at(&http, &metrics, "pay", "duplicate").await == 1
    })
    .await;
    assert!(acked, "the redelivery was not acknowledged as a duplicate");
    assert_eq!(upstream.state.stats().total_executions, 1);
    assert_eq!(metric_at(&http, &metrics, "pay", "forwarded").await, 0);
    assert!(eventually(WAIT, || async { queue.ready(&queue.name).await == 0 }).await);
    restarted.kill().unwrap();
    restarted.wait().unwrap();
    upstream.shutdown().await;
}

#[tokio::test]
async fn a_shutdown_finishes_and_acknowledges_the_message_in_flight() {
    let Some(queue) = Queue::new("amqp_stop").await else {
        return;
    };
    let stack = Stack::start(&queue.consumer("pay", "/actions/stop", "")).await;
    arm(&stack, r#"{"delay_ms": 800, "count": 1}"#).await;
    queue.publish(Some("s-1"), b"{}", &[]).await;
    let at_upstream = eventually(WAIT, || async {
        stack.upstream.state.stats().requests == 1
    })
    .await;
    assert!(at_upstream);
    let metrics = stack.gateway.metrics.clone();
    stack.gateway.shutdown().await;
    // Finished within the grace, recorded and acknowledged: nothing left
    // for the broker to deliver again.
    assert_eq!(
        metrics
            .consumer("pay")
            .get(idemgate_core::metrics::MessageOutcome::Forwarded),
        1
    );
    assert_eq!(executions_in(&stack.upstream, "stop"), 1);
    assert_eq!(queue.ready(&queue.name).await, 0);
    stack.upstream.shutdown().await;
}

fn executions_in(upstream: &idemgate_demo_upstream::DemoUpstream, action: &str) -> u64 {
    upstream
        .state
        .stats()
        .executions
        .get(action)
        .map_or(0, |keys| keys.values().sum())
}

#[tokio::test]
async fn a_dead_letter_the_broker_cannot_route_is_kept_and_never_forwarded_again() {
    let Some(queue) = Queue::new("amqp_dlq_gone").await else {
        return;
    };
    let dlq = format!("{}.parked", queue.name);
    let stack = Stack::start(&queue.consumer(
        "pay",
        "/actions/gone",
        &format!("dead_letter = \"{dlq}\"\n        max_deliveries = 1"),
    ))
    .await;
    assert!(
        eventually(WAIT, || async {
            queue.exists(&dlq).await && queue.ready(&dlq).await == 0
        })
        .await
    );
    // The dead-letter queue disappears under the running consumer.
    queue.delete(&dlq).await;
    arm(&stack, r#"{"fail_status": 500}"#).await;
    queue.publish(Some("g-1"), b"{}", &[]).await;
    let refused = eventually(WAIT, || async { metric(&stack, "pay", "error").await >= 2 }).await;
    assert!(refused, "the unroutable dead letter was not reported");
    assert_eq!(metric(&stack, "pay", "dead_lettered").await, 0);
    // One upstream attempt; every later delivery goes for the dead
    // letters again, not upstream.
    assert_eq!(stack.upstream.state.stats().requests, 1);
    queue.declare(&dlq).await;
    let parked = eventually(WAIT, || async { queue.ready(&dlq).await == 1 }).await;
    assert!(
        parked,
        "the dead letter never reached the queue once it existed"
    );
    assert_eq!(stack.upstream.state.stats().requests, 1);
    assert_eq!(queue.ready(&queue.name).await, 0);
    stack.shutdown().await;
}

#[tokio::test]
async fn a_stream_that_captures_its_own_dead_letter_subject_is_refused_by_name() {
    let Some(stream) = Stream::new("nats_own_dlq", None).await else {
        return;
    };
    // The source stream captures `<lower>.in.>`: a dead_letter inside it
    // would come back to the consumer forever.
    let inside = stream.subject("dead");
    let stack = Stack::start(&stream.consumer(
        "events",
        "/actions/own",
        &format!("dead_letter = \"{inside}\""),
    ))
    .await;
    let refused = eventually(WAIT, || async {
        let body = stack.http.get(&stack.admin("/readyz")).await.json();
        body["consumers"]["events"]
            .as_str()
            .unwrap_or("")
            .contains("captures its own dead-letter subject")
    })
    .await;
    assert!(
        refused,
        "the overlapping dead-letter subject was not reported"
    );
    stream.publish("x", &[], b"{}").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(stack.upstream.state.stats().requests, 0);
    stack.shutdown().await;
}

#[tokio::test]
async fn a_store_outage_longer_than_the_lease_does_not_forward_a_message_twice() {
    let Some(queue) = Queue::new("amqp_long_outage").await else {
        return;
    };
    let Some(db) = shared_sql("a_store_outage_longer_than_the_lease").await else {
        return;
    };
    let pg = FaultProxy::start(services::sql_addr(&db)).await;
    let via_proxy = services::via(&db, pg.port);
    let stack = Stack::start_with(&queue.consumer("pay", "/actions/outage", ""), |c| {
        c.store.database_url = via_proxy.clone();
        c.store.timeout = "300ms".into();
        c.store.lease = "1s".into();
    })
    .await;
    // The upstream takes 600 ms; the store goes away while it works and
    // stays away for three leases.
    arm(&stack, r#"{"delay_ms": 600, "count": 1}"#).await;
    queue.publish(Some("o-1"), b"{}", &[]).await;
    assert!(
        eventually(WAIT, || async {
            stack.upstream.state.stats().requests == 1
        })
        .await
    );
    pg.set(Mode::Refuse);
    tokio::time::sleep(Duration::from_secs(3)).await;
    pg.set(Mode::Pass);
    let acked = eventually(WAIT, || async {
        metric(&stack, "pay", "forwarded").await + metric(&stack, "pay", "duplicate").await == 1
    })
    .await;
    assert!(acked, "the message was never acknowledged");
    // The holder had the answer; the redeliveries waited for it instead of
    // taking the expired claim over and forwarding again.
    assert_eq!(executions(&stack, "outage"), 1);
    assert_eq!(stack.upstream.state.stats().requests, 1);
    stack.shutdown().await;
}

#[tokio::test]
async fn a_private_rabbitmq_node_restarted_mid_stream_loses_nothing_and_executes_each_once() {
    let test = "rabbit_restart";
    let Some(mut rabbit) = PrivateRabbit::start(test).await else {
        return;
    };
    let url = rabbit.url();
    let queue = Queue::open(test, &url, "restart.q").await.unwrap();
    let consumer = consumer_toml(
        "pay",
        &url,
        "queue = \"restart.q\"",
        "/actions/rrestart",
        "prefetch = 4",
    );
    let stack = Stack::start(&consumer).await;
    for i in 0..40 {
        queue.publish(Some(&format!("m-{i}")), b"{}", &[]).await;
    }
    assert!(eventually(WAIT, || async { executions(&stack, "rrestart") >= 5 }).await);
    rabbit.restart().await;
    // Unacknowledged and unconsumed messages come back with the node; the
    // consumer reconnects by itself.
    let queue = Queue::open(test, &url, "restart.q").await.unwrap();
    for i in 40..60 {
        queue.publish(Some(&format!("m-{i}")), b"{}", &[]).await;
    }
    let all = eventually(Duration::from_secs(60), || async {
        per_key(&stack, "rrestart").len() == 60 && queue.ready("restart.q").await == 0
    })
    .await;
    assert!(
        all,
        "only {} of 60 executed",
        per_key(&stack, "rrestart").len()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let keys = per_key(&stack, "rrestart");
    assert!(keys.values().all(|n| *n == 1), "{keys:?}");
    stack.shutdown().await;
}

/// `max_deliveries` is counted in the store, for every instance: a message
/// whose upstream always fails, consumed by two gateways on one Postgres
/// (one of them replaced midway, as a restart does), reaches the upstream
/// exactly `max_deliveries` times in all, with `X-Delivery-Count` 1, 2, 3,
/// 4 — a classic queue only says "redelivered" — and is dead-lettered once.
#[tokio::test]
async fn a_failing_message_gets_max_deliveries_attempts_across_instances_and_a_restart() {
    let test = "a_failing_message_gets_max_deliveries_attempts_across_instances_and_a_restart";
    let Some(queue) = Queue::new("amqp_counted").await else {
        return;
    };
    let Some(db) = shared_sql(test).await else {
        return;
    };
    let consumer = queue.consumer("pay", "/actions/down", "max_deliveries = 4\nprefetch = 1");
    let one = Stack::start_with(&consumer, |c| c.store.database_url = db.clone()).await;
    arm(&one, r#"{"fail_status": 503}"#).await;
    let another = || {
        let mut config = support::config(one.upstream.addr, &consumer);
        config.store.database_url = db.clone();
        idemgate_gateway::gateway::start_for_tests(config)
    };
    let two = another().await.unwrap();
    queue.publish(Some("fails-1"), b"{}", &[]).await;
    let started = eventually(WAIT, || async { one.upstream.state.stats().requests >= 2 }).await;
    assert!(started);
    // The second gateway is replaced by a third (a restart): the count is
    // the store's, not a process's.
    two.shutdown().await;
    let three = another().await.unwrap();
    let dead = eventually(WAIT, || async { queue.ready(&queue.dlq()).await == 1 }).await;
    assert!(
        dead,
        "never dead-lettered: {:?}",
        one.upstream.state.stats()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stats = one.upstream.state.stats();
    assert_eq!(stats.requests, 4, "attempts in all: {stats:?}");
    assert_eq!(stats.delivery_counts, vec![1, 2, 3, 4]);
    assert_eq!(queue.ready(&queue.dlq()).await, 1, "one copy");
    assert_eq!(queue.ready(&queue.name).await, 0);
    three.shutdown().await;
    one.shutdown().await;
}

/// A queue and a gateway with `max_deliveries = 1` whose upstream fails
/// `id`'s first delivery (a redelivery by its count when `redelivered`):
/// returned once its dead-letter copy is in the queue's `.dlq`.
async fn dead_lettered_once(
    queue: &str,
    action: &str,
    id: &str,
    redelivered: bool,
) -> Option<(Queue, Stack)> {
    let queue = Queue::new(queue).await?;
    let stack =
        Stack::start(&queue.consumer("pay", &format!("/actions/{action}"), "max_deliveries = 1"))
            .await;
    arm(&stack, r#"{"fail_status": 503, "count": 1}"#).await;
    match redelivered {
        true => queue.publish_redelivered(id, b"{}").await,
        false => queue.publish(Some(id), b"{}", &[]).await,
    }
    let dead = eventually(WAIT, || async { queue.ready(&queue.dlq()).await == 1 }).await;
    assert!(dead, "{:?}", stack.upstream.state.stats());
    Some((queue, stack))
}

/// A redelivery of a message whose dead-letter copy is recorded (its ack
/// was lost) is acknowledged without a second copy and never forwarded;
/// the same key published afresh (a replay from the dead letters) is a new
/// delivery and is tried again. (A quorum queue's `x-delivery-count`
/// header is how a redelivery is told here.)
#[tokio::test]
async fn a_lost_ack_after_a_dead_letter_copy_makes_no_second_copy() {
    let Some((queue, stack)) = dead_lettered_once("amqp_dlq_once", "once", "d-1", false).await
    else {
        return;
    };
    // The broker delivers the original again: the ack was lost.
    queue.publish_redelivered("d-1", b"{}").await;
    let acked = eventually(WAIT, || async {
        metric(&stack, "pay", "duplicate").await == 1
    })
    .await;
    assert!(acked, "the redelivery was not acknowledged");
    assert_eq!(queue.ready(&queue.dlq()).await, 1, "no second copy");
    assert_eq!(
        stack.upstream.state.stats().requests,
        1,
        "never forwarded again"
    );
    // Replayed from the dead letters (a fresh publish): tried again.
    queue.publish(Some("d-1"), b"{}", &[]).await;
    let replayed = eventually(WAIT, || async { executions(&stack, "once") == 1 }).await;
    assert!(replayed, "{:?}", stack.upstream.state.stats());
    assert_eq!(queue.ready(&queue.name).await, 0);
    stack.shutdown().await;
}

/// Another instance holds a message's copy lease (it is adding the dead
/// letter, as written in the shared store) when this gateway decides the
/// same message's end: it adds no copy of its own, and acknowledges the
/// message once the other's copy is recorded. A lease whose holder died
/// lapses, and the copy is added under the holder's copy id; a message
/// nobody is copying is copied at once; one whose only attempt failed here
/// while another instance copies it waits for that copy, never going
/// upstream again.
#[tokio::test]
async fn a_dead_letter_another_instance_is_adding_is_not_added_twice() {
    let Some(queue) = Queue::new("amqp_dlq_lease").await else {
        return;
    };
    let Some(db) = postgres("a_dead_letter_another_instance_is_adding").await else {
        return;
    };
    let consumer = queue.consumer(
        "pay",
        "/actions/lease",
        "max_deliveries = 1\nbusiness_key = [\"msg:message_id\"]",
    );
    let stack = Stack::start_with(&consumer, |c| c.store.database_url = db.clone()).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&db)
        .await
        .unwrap();
    // h-1, d-1 and f-1 are out of attempts (another instance counted the
    // failure): h-1's copy is being added by another instance, d-1's
    // holder died 2.5 s from now, nobody copies f-1. b-1 is published
    // afresh while another instance copies it (for 2.5 s): its one
    // attempt fails here, and it waits for that copy — never upstream
    // again.
    for (key, failures, copy, lease_ms) in [
        ("h-1", 1, Some("theirs-1"), Some(60_000)),
        ("d-1", 1, Some("theirs-2"), Some(2_500)),
        ("f-1", 1, None, None),
        ("b-1", 0, Some("theirs-3"), Some(2_500)),
    ] {
        sqlx::query(
            "INSERT INTO idempotency_deliveries \
             (route, idem_key, failures, dead_letter, updated_at, copy_id, copying_until) \
             SELECT 'pay', $1, $2, FALSE, t, $3, t + $4 \
             FROM (SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS t) AS now",
        )
        .bind(key)
        .bind(failures)
        .bind(copy)
        .bind(lease_ms.map(i64::from))
        .execute(&pool)
        .await
        .unwrap();
    }
    arm(&stack, r#"{"fail_status": 503}"#).await;
    for id in ["h-1", "d-1", "f-1"] {
        queue.publish_redelivered(id, b"{}").await;
    }
    queue.publish(Some("b-1"), b"{}", &[]).await;
    let free = eventually(WAIT, || async { queue.ready(&queue.dlq()).await == 1 }).await;
    assert!(free, "the message nobody copies was not copied");
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(
        queue.ready(&queue.dlq()).await,
        1,
        "a copy beside another instance's"
    );
    // The other instance's copy is stored: acknowledged, no copy here.
    sqlx::query("UPDATE idempotency_deliveries SET dead_letter = TRUE WHERE idem_key = 'h-1'")
        .execute(&pool)
        .await
        .unwrap();
    let acked = eventually(WAIT, || async {
        metric(&stack, "pay", "duplicate").await == 1
    })
    .await;
    assert!(acked, "never acknowledged after the other's copy");
    // The dead holders' leases lapse: copied once each, under their ids.
    let lapsed = eventually(WAIT, || async { queue.ready(&queue.dlq()).await == 3 }).await;
    assert!(lapsed, "never copied after the holders' leases lapsed");
    let mut copies = BTreeMap::new();
    while let Some(copy) = queue.take(&queue.dlq()).await {
        let properties = &copy.delivery.properties;
        let id = properties.message_id().clone().unwrap().to_string();
        let headers = properties.headers().clone().unwrap();
        let copy_id = match &headers.inner()["x-idemgate-copy"] {
            lapin::types::AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into(),
            other => format!("{other:?}"),
        };
        copies.insert(id, copy_id);
    }
    assert_eq!(copies.len(), 3, "{copies:?}");
    assert_eq!(copies["d-1"], "theirs-2", "{copies:?}");
    assert_eq!(copies["b-1"], "theirs-3", "{copies:?}");
    assert!(!copies.contains_key("h-1"), "{copies:?}");
    assert_eq!(queue.ready(&queue.name).await, 0);
    assert_eq!(
        stack.upstream.state.stats().requests,
        1,
        "b-1 went upstream again while it waited for its copy"
    );
    stack.shutdown().await;
}

/// A message without a usable key is dead-lettered once too: its mark is
/// kept under its own identity (id and body), so a redelivery after a lost
/// ack makes no second copy, while another keyless message still gets its
/// own.
#[tokio::test]
async fn a_keyless_message_redelivered_after_its_dead_letter_makes_no_second_copy() {
    let Some(queue) = Queue::new("amqp_nokey_once").await else {
        return;
    };
    let stack = Stack::start(&queue.consumer("pay", "/actions/nokey", "")).await;
    queue.publish(Some("bad\u{1}id"), b"{}", &[]).await;
    let dead = eventually(WAIT, || async { queue.ready(&queue.dlq()).await == 1 }).await;
    assert!(dead);
    // The broker delivers it again: the ack after the copy was lost.
    queue.publish_redelivered("bad\u{1}id", b"{}").await;
    let acked = eventually(WAIT, || async {
        metric(&stack, "pay", "duplicate").await == 1
    })
    .await;
    assert!(acked, "the redelivery was not acknowledged");
    assert_eq!(queue.ready(&queue.dlq()).await, 1, "no second copy");
    // Another keyless message, redelivered, was never dead-lettered: it
    // gets its copy.
    queue
        .publish_redelivered("bad\u{1}id", br#"{"other":1}"#)
        .await;
    let other = eventually(WAIT, || async { queue.ready(&queue.dlq()).await == 2 }).await;
    assert!(other);
    assert_eq!(stack.upstream.state.stats().requests, 0);
    assert_eq!(queue.ready(&queue.name).await, 0);
    stack.shutdown().await;
}

/// The last allowed attempt timed out (its record uncertain) and the
/// message was dead-lettered; its ack was lost. The redelivery waits out
/// the uncertain hold, then is acknowledged: never sent upstream again,
/// never copied twice.
#[tokio::test]
async fn a_redelivery_after_an_uncertain_last_attempt_is_neither_sent_nor_copied_again() {
    let Some(queue) = Queue::new("amqp_dlq_uncertain").await else {
        return;
    };
    let stack = Stack::start(&queue.consumer("pay", "/actions/late", "max_deliveries = 1")).await;
    // Past the upstream's 2 s timeout: the attempt is uncertain.
    arm(&stack, r#"{"delay_ms": 2500, "count": 1}"#).await;
    queue.publish(Some("u-1"), b"{}", &[]).await;
    let dead = eventually(WAIT, || async { queue.ready(&queue.dlq()).await == 1 }).await;
    assert!(dead, "{:?}", stack.upstream.state.stats());
    queue.publish_redelivered("u-1", b"{}").await;
    let acked = eventually(WAIT, || async {
        metric(&stack, "pay", "duplicate").await == 1
    })
    .await;
    assert!(acked, "{:?}", stack.upstream.state.stats());
    assert_eq!(stack.upstream.state.stats().requests, 1, "sent again");
    assert_eq!(queue.ready(&queue.dlq()).await, 1, "copied again");
    assert_eq!(queue.ready(&queue.name).await, 0);
    stack.shutdown().await;
}

/// A dead-letter copy is a new message: it does not carry the original's
/// `x-delivery-count`, so an operator who moves it back to the queue gets
/// it tried again instead of acknowledged as the settled original.
#[tokio::test]
async fn a_dead_letter_moved_back_to_the_queue_is_tried_again() {
    // First seen as a quorum queue's redelivery (it carries a count).
    let Some((queue, stack)) = dead_lettered_once("amqp_dlq_moved", "moved", "m-1", true).await
    else {
        return;
    };
    let copy = queue.take(&queue.dlq()).await.expect("the dead letter");
    let headers = copy.delivery.properties.headers().clone().unwrap();
    assert!(
        !headers.inner().contains_key("x-delivery-count"),
        "{headers:?}"
    );
    assert!(headers.inner().contains_key("x-idemgate-reason"));
    tried_as_replay(&queue, &stack, &copy, "moved").await;
    stack.shutdown().await;
}

/// Moves a dead-letter `copy` back to the source queue: it runs at the
/// upstream (once), a replay, never acknowledged as a duplicate of its
/// original.
async fn tried_as_replay(
    queue: &Queue,
    stack: &Stack,
    copy: &lapin::message::BasicGetMessage,
    action: &str,
) {
    queue.republish(copy).await;
    let tried = eventually(WAIT, || async { executions(stack, action) == 1 }).await;
    assert!(tried, "{:?}", stack.upstream.state.stats());
    assert_eq!(metric(stack, "pay", "duplicate").await, 0);
}

/// A dead-letter copy moved back and then delivered again (its first
/// delivery's channel closed before anything was recorded) is still a
/// replay: the mark its original left does not settle it, and it runs.
#[tokio::test]
async fn a_moved_back_dead_letter_delivered_again_is_still_tried() {
    let Some((queue, stack)) =
        dead_lettered_once("amqp_dlq_moved_again", "again", "a-1", false).await
    else {
        return;
    };
    let mut copy = queue.take(&queue.dlq()).await.expect("the dead letter");
    let mut headers = copy.delivery.properties.headers().clone().unwrap();
    headers.insert(
        "x-delivery-count".into(),
        lapin::types::AMQPValue::LongLongInt(1),
    );
    copy.delivery.properties = copy.delivery.properties.clone().with_headers(headers);
    tried_as_replay(&queue, &stack, &copy, "again").await;
    stack.shutdown().await;
}

/// A replay that fails is dead-lettered on its own count, once: when the
/// ack after its copy is lost, its redelivery is acknowledged, neither
/// sent upstream again nor copied a second time.
#[tokio::test]
async fn a_replay_dead_lettered_again_is_copied_once() {
    let Some((queue, stack)) =
        dead_lettered_once("amqp_dlq_replay_once", "twice", "w-1", false).await
    else {
        return;
    };
    let mut copy = queue.take(&queue.dlq()).await.expect("the dead letter");
    arm(&stack, r#"{"fail_status": 503, "count": 1}"#).await;
    queue.republish(&copy).await;
    let again = eventually(WAIT, || async { queue.ready(&queue.dlq()).await == 1 }).await;
    assert!(again, "{:?}", stack.upstream.state.stats());
    assert_eq!(stack.upstream.state.stats().requests, 2);
    // The ack after the replay's copy was lost: the broker delivers it
    // again.
    let mut headers = copy.delivery.properties.headers().clone().unwrap();
    headers.insert(
        "x-delivery-count".into(),
        lapin::types::AMQPValue::LongLongInt(1),
    );
    copy.delivery.properties = copy.delivery.properties.clone().with_headers(headers);
    queue.republish(&copy).await;
    let acked = eventually(WAIT, || async {
        metric(&stack, "pay", "duplicate").await == 1
    })
    .await;
    assert!(acked, "{:?}", stack.upstream.state.stats());
    assert_eq!(stack.upstream.state.stats().requests, 2, "sent again");
    assert_eq!(queue.ready(&queue.dlq()).await, 1, "copied again");
    stack.shutdown().await;
}

/// A replay from the dead letters that the broker delivers again while its
/// first try is still at the upstream (its channel closed, say): the
/// redelivery is not acknowledged on the strength of the old dead-letter
/// mark beside the running attempt; it waits for that attempt's outcome.
#[tokio::test]
async fn a_replay_delivered_again_while_its_first_try_runs_waits_for_its_outcome() {
    let Some((queue, stack)) = dead_lettered_once("amqp_dlq_replay", "replay", "r-1", false).await
    else {
        return;
    };
    // The replay: slow at the upstream (within its 2 s timeout), then a
    // success.
    arm(&stack, r#"{"delay_ms": 1500, "count": 1}"#).await;
    queue.publish(Some("r-1"), b"{}", &[]).await;
    let started = eventually(WAIT, || async {
        stack.upstream.state.stats().requests >= 2
    })
    .await;
    assert!(started);
    queue.publish_redelivered("r-1", b"{}").await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(
        metric(&stack, "pay", "duplicate").await,
        0,
        "acknowledged beside the running attempt"
    );
    let settled = eventually(WAIT, || async {
        metric(&stack, "pay", "duplicate").await == 1
    })
    .await;
    assert!(settled, "{:?}", stack.upstream.state.stats());
    assert_eq!(executions(&stack, "replay"), 1);
    assert_eq!(stack.upstream.state.stats().requests, 2);
    assert_eq!(queue.ready(&queue.dlq()).await, 1, "no second copy");
    assert_eq!(queue.ready(&queue.name).await, 0);
    stack.shutdown().await;
}

/// `dead_letter = "dlx"`: a queue whose owner set a dead-letter exchange
/// gets its dead letters routed by the broker (rejected without requeue),
/// with RabbitMQ's `x-death` history; Idemgate declares no queue of its own.
#[tokio::test]
async fn dlx_mode_routes_dead_letters_through_the_queues_own_exchange() {
    let Some(queue) = Queue::new("amqp_dlx").await else {
        return;
    };
    let (exchange, dead) = (format!("{}.x", queue.name), format!("{}.dead", queue.name));
    let owned = queue
        .declare_with_dead_letter_exchange(&exchange, &dead)
        .await;
    let stack = Stack::start(&owned.consumer(
        "pay",
        "/actions/dlx",
        "max_deliveries = 2\ndead_letter = \"dlx\"",
    ))
    .await;
    arm(&stack, r#"{"fail_status": 503}"#).await;
    owned.publish(Some("x-1"), b"{}", &[]).await;
    let routed = eventually(WAIT, || async { owned.ready(&dead).await == 1 }).await;
    assert!(routed, "{:?}", stack.upstream.state.stats());
    assert_eq!(stack.upstream.state.stats().requests, 2);
    assert!(
        !owned.exists(&owned.dlq()).await,
        "no queue of Idemgate's own"
    );
    let copy = owned.take(&dead).await.expect("the dead letter");
    let headers = copy.delivery.properties.headers().clone().unwrap();
    assert!(headers.inner().contains_key("x-death"), "{headers:?}");
    stack.shutdown().await;
}

// === Redis Streams ===

/// The same order added to the stream 50 times (a producer retrying) is
/// executed once; every entry is acknowledged; the upstream sees the
/// stable key.
#[tokio::test]
async fn redis_streams_duplicates_execute_once_and_every_entry_is_acked() {
    let Some(stream) = RedisStream::new("redis_dup", None).await else {
        return;
    };
    let consumer = stream.consumer(
        "orders",
        "/actions/rs",
        r#"business_key = ["msg:header:order_id"]"#,
    );
    let stack = Stack::start(&consumer).await;
    // The group starts with entries added after it exists.
    assert!(
        eventually(WAIT, || async {
            metric(&stack, "orders", "forwarded").await == 0 && stream.pending("g").await == 0
        })
        .await
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..50 {
        stream
            .add(&[("order_id", "o-1"), ("body", r#"{"amount":5}"#)])
            .await;
    }
    let settled = eventually(WAIT, || async {
        metric(&stack, "orders", "forwarded").await + metric(&stack, "orders", "duplicate").await
            == 50
    })
    .await;
    assert!(settled, "not every entry was acknowledged");
    assert_eq!(executions(&stack, "rs"), 1);
    assert_eq!(stream.pending("g").await, 0);
    assert!(per_key(&stack, "rs").keys().all(|k| k.starts_with("ig-")));
    stack.shutdown().await;
    stream.delete().await;
}

/// Two gateways in one consumer group on one Postgres: 100 orders, each
/// added twice, execute once each; both gateways take entries.
#[tokio::test]
async fn redis_streams_two_gateways_in_one_group_execute_each_order_once() {
    let Some(stream) = RedisStream::new("redis_two", None).await else {
        return;
    };
    let Some(db) = shared_sql("redis_streams_two_gateways").await else {
        return;
    };
    let consumer = stream.consumer(
        "orders",
        "/actions/rs2",
        r#"business_key = ["msg:header:order_id"]
        prefetch = 4"#,
    );
    let one = Stack::start_with(&consumer, |c| c.store.database_url = db.clone()).await;
    let mut config = support::config(one.upstream.addr, &consumer);
    config.store.database_url = db.clone();
    let two = idemgate_gateway::gateway::start_for_tests(config)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    for _ in 0..2 {
        for i in 0..100 {
            stream.add(&[("order_id", &format!("o-{i}"))]).await;
        }
    }
    let two_metrics = format!("http://{}/metrics", two.admin_addr);
    let settled = eventually(Duration::from_secs(30), || async {
        let mut n = 0;
        for outcome in ["forwarded", "duplicate"] {
            n += metric(&one, "orders", outcome).await;
            n += metric_at(&one.http, &two_metrics, "orders", outcome).await;
        }
        n == 200
    })
    .await;
    assert!(settled, "not every entry was acknowledged");
    let keys = per_key(&one, "rs2");
    assert_eq!(keys.len(), 100);
    assert!(keys.values().all(|n| *n == 1), "{keys:?}");
    assert!(
        metric_at(&one.http, &two_metrics, "orders", "forwarded").await > 0,
        "the second gateway took nothing"
    );
    assert_eq!(stream.pending("g").await, 0);
    two.shutdown().await;
    one.shutdown().await;
    stream.delete().await;
}

/// Poison entries (no key field) are dead-lettered at once to
/// `<stream>.dlq` with the reason and never forwarded; an order whose
/// upstream always fails is tried `max_deliveries` times, with
/// `X-Delivery-Count` 1, 2, 3, then dead-lettered once.
#[tokio::test]
async fn redis_streams_poison_entries_and_failures_go_to_the_dead_letter_stream() {
    let Some(stream) = RedisStream::new("redis_dlq", None).await else {
        return;
    };
    let consumer = stream.consumer(
        "orders",
        "/actions/rsdlq",
        "business_key = [\"msg:header:order_id\"]\nmax_deliveries = 3",
    );
    let stack = Stack::start(&consumer).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    stream.add(&[("note", "no key here")]).await;
    let poison = eventually(WAIT, || async { stream.dead_letters().await.len() == 1 }).await;
    assert!(poison);
    assert_eq!(stack.upstream.state.stats().requests, 0, "never forwarded");
    arm(&stack, r#"{"fail_status": 503}"#).await;
    stream.add(&[("order_id", "o-bad")]).await;
    let dead = eventually(WAIT, || async { stream.dead_letters().await.len() == 2 }).await;
    assert!(dead, "{:?}", stack.upstream.state.stats());
    let stats = stack.upstream.state.stats();
    assert_eq!(stats.requests, 3);
    assert_eq!(stats.delivery_counts, vec![1, 2, 3]);
    let letters = stream.dead_letters().await;
    assert!(letters[0]["idemgate-reason"].contains("key"), "{letters:?}");
    assert!(
        letters[1]["idemgate-reason"].contains("failed 3 time"),
        "{letters:?}"
    );
    assert_eq!(letters[1]["order_id"], "o-bad");
    assert_eq!(stream.pending("g").await, 0);
    stack.shutdown().await;
    stream.delete().await;
}

/// A gateway killed (SIGKILL) after the order's outcome is recorded and
/// before its `XACK`: the entry stays pending; another gateway claims it
/// once it has been idle `claim_idle`, the store answers it, it is
/// acknowledged, and the order executed once.
#[tokio::test]
async fn redis_streams_a_gateway_killed_before_its_ack_is_claimed_and_not_executed_again() {
    let Some(stream) = RedisStream::new("redis_kill", None).await else {
        return;
    };
    let upstream = idemgate_demo_upstream::start("127.0.0.1:0").await.unwrap();
    let redis_port: u16 = stream
        .url
        .rsplit(':')
        .next()
        .unwrap()
        .trim_end_matches('/')
        .parse()
        .unwrap();
    let broker = FaultProxy::start(format!("127.0.0.1:{redis_port}").parse().unwrap()).await;
    let dir = tempfile::tempdir().unwrap();
    let (public, admin) = (dead_port(), dead_port());
    let consumer = consumer_toml(
        "orders",
        &format!("redis://127.0.0.1:{}/", broker.port),
        &format!(
            "stream = \"{}\"\ngroup = \"g\"\nclaim_idle = \"1s\"",
            stream.name
        ),
        "/actions/rskill",
        r#"business_key = ["msg:header:order_id"]"#,
    );
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:{public}\"\nadmin_listen = \"127.0.0.1:{admin}\"\n\
         [store]\ndatabase_url = \"sqlite://{}/records.db\"\n\
         [[upstreams]]\nname = \"demo\"\nurl = \"http://{}\"\ntimeout = \"5s\"\n{consumer}",
        dir.path().display(),
        upstream.addr
    );
    let path = dir.path().join("idemgate.toml");
    std::fs::write(&path, text).unwrap();
    let http = Http::default();
    let armed = http
        .send(
            "POST",
            &format!("{}/faults", upstream.url()),
            &[],
            r#"{"stall_body_ms": 1500, "count": 1}"#,
        )
        .await;
    assert!(armed.status.is_success());
    let mut gateway = support::spawn_gateway(&path);
    support::wait_up(&http, &format!("http://127.0.0.1:{admin}/healthz")).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stream.add(&[("order_id", "kill-1")]).await;
    assert!(
        eventually(WAIT, || async {
            upstream.state.stats().total_executions == 1
        })
        .await
    );
    // Redis goes away while the body is still coming: the XACK that
    // follows the record cannot reach it.
    broker.set(Mode::Refuse);
    let record = format!("http://127.0.0.1:{admin}/admin/keys/orders/kill-1");
    let recorded = eventually(WAIT, || async {
        let answer = http.get(&record).await;
        answer.status.is_success() && answer.json()["records"][0]["state"] == "completed"
    })
    .await;
    assert!(recorded, "the outcome was never recorded");
    gateway.kill().unwrap();
    gateway.wait().unwrap();
    broker.set(Mode::Pass);
    assert_eq!(
        stream.pending("g").await,
        1,
        "left pending by the killed gateway"
    );
    let mut restarted = support::spawn_gateway(&path);
    let http = Http::default();
    support::wait_up(&http, &format!("http://127.0.0.1:{admin}/healthz")).await;
    let metrics = format!("http://127.0.0.1:{admin}/metrics");
    let acked = eventually(WAIT, || async {
        metric_at(&http, &metrics, "orders", "duplicate").await == 1
    })
    .await;
    assert!(
        acked,
        "the claimed entry was not acknowledged as a duplicate"
    );
    assert_eq!(upstream.state.stats().total_executions, 1);
    assert_eq!(stream.pending("g").await, 0);
    restarted.kill().unwrap();
    restarted.wait().unwrap();
    upstream.shutdown().await;
    stream.delete().await;
}

/// A private Redis server restarted mid-stream (its data kept: the stream
/// and the group survive, as with persistence on): consumption resumes,
/// and each of 40 orders executes once.
#[tokio::test]
async fn redis_streams_a_restarted_server_loses_nothing_and_executes_each_once() {
    let Some(mut server) = support::services::PrivateRedis::start("redis_streams_restart").await
    else {
        return;
    };
    let Some(stream) = RedisStream::new("redis_restart", Some(&server.url())).await else {
        return;
    };
    let consumer = stream.consumer(
        "orders",
        "/actions/rsrestart",
        r#"business_key = ["msg:header:order_id"]"#,
    );
    let stack = Stack::start(&consumer).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 0..20 {
        stream.add(&[("order_id", &format!("r-{i}"))]).await;
    }
    assert!(
        eventually(WAIT, || async {
            metric(&stack, "orders", "forwarded").await == 20
        })
        .await
    );
    server.restart_keeping_data().await;
    for i in 20..40 {
        stream.add(&[("order_id", &format!("r-{i}"))]).await;
    }
    let all = eventually(Duration::from_secs(30), || async {
        metric(&stack, "orders", "forwarded").await == 40
    })
    .await;
    assert!(all, "{:?}", stack.upstream.state.stats());
    let keys = per_key(&stack, "rsrestart");
    assert_eq!(keys.len(), 40);
    assert!(keys.values().all(|n| *n == 1));
    stack.shutdown().await;
}

/// The store unreachable: nothing is forwarded, the entries wait (pending,
/// never dead-lettered for it); once it is back each order executes once.
#[tokio::test]
async fn redis_streams_store_down_forwards_nothing_and_delivers_once_after() {
    let Some(stream) = RedisStream::new("redis_pgdown", None).await else {
        return;
    };
    let Some(db) = shared_sql("redis_streams_store_down").await else {
        return;
    };
    let pg_port: u16 = url::Url::parse(&db).unwrap().port().unwrap_or(5432);
    let proxy = FaultProxy::start(format!("127.0.0.1:{pg_port}").parse().unwrap()).await;
    let through_proxy = {
        let mut u = url::Url::parse(&db).unwrap();
        u.set_port(Some(proxy.port)).unwrap();
        u.to_string()
    };
    let consumer = stream.consumer(
        "orders",
        "/actions/rspg",
        "business_key = [\"msg:header:order_id\"]\nmax_deliveries = 2",
    );
    let stack = Stack::start_with(&consumer, |c| {
        c.store.database_url = through_proxy.clone();
        c.store.timeout = "1s".into();
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.set(Mode::Refuse);
    for i in 0..5 {
        stream.add(&[("order_id", &format!("p-{i}"))]).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        stack.upstream.state.stats().requests,
        0,
        "forwarded while the store was away"
    );
    assert!(stream.dead_letters().await.is_empty());
    proxy.set(Mode::Pass);
    let done = eventually(Duration::from_secs(30), || async {
        metric(&stack, "orders", "forwarded").await == 5
    })
    .await;
    assert!(done, "{:?}", stack.upstream.state.stats());
    let keys = per_key(&stack, "rspg");
    assert!(keys.values().all(|n| *n == 1), "{keys:?}");
    assert_eq!(stream.pending("g").await, 0);
    stack.shutdown().await;
    stream.delete().await;
}

/// `claim_idle` below a second is refused by name: entries in hand are
/// kept fresh every third of it, so a tiny value is a Redis call every few
/// milliseconds (and a timer that cannot tick at zero).
#[test]
fn a_claim_idle_below_a_second_is_refused_by_name() {
    use idemgate_gateway::config::Config;
    let check = |idle: &str| {
        let text = format!(
            "[[upstreams]]\nname = \"demo\"\nurl = \"http://127.0.0.1:1\"\n{}",
            consumer_toml(
                "orders",
                "redis://127.0.0.1:6379/",
                "stream = \"s\"\ngroup = \"g\"",
                "/actions/x",
                &format!("claim_idle = \"{idle}\""),
            )
        );
        Config::parse(&text, "test")
            .map_err(|e| e.to_string())?
            .validate("test")
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let refused = check("1ns").unwrap_err();
    assert!(refused.contains("claim_idle"), "{refused}");
    check("1s").unwrap();
}

/// A group that vanishes under a running gateway (Redis restarted without
/// persistence, the stream deleted) while producers go on: the group is
/// created again after the last entry the gateway read, so the entries
/// added in between are delivered, not skipped.
#[tokio::test]
async fn redis_streams_a_vanished_group_is_recreated_without_skipping_entries() {
    let Some(stream) = RedisStream::new("redis_vanished", None).await else {
        return;
    };
    let stack = Stack::start(&stream.consumer(
        "orders",
        "/actions/vanish",
        r#"business_key = ["msg:header:order_id"]"#,
    ))
    .await;
    assert!(eventually(WAIT, || async { stream.exists().await }).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    stream.add(&[("order_id", "v-1"), ("body", "{}")]).await;
    assert!(eventually(WAIT, || async { executions(&stack, "vanish") == 1 }).await);
    stream.recreate_with(&["v-2", "v-3"]).await;
    let delivered = eventually(WAIT, || async { executions(&stack, "vanish") == 3 }).await;
    assert!(delivered, "{:?}", stack.upstream.state.stats());
    assert!(eventually(WAIT, || async { stream.pending("g").await == 0 }).await);
    stack.shutdown().await;
    stream.delete().await;
}

/// An entry another consumer took over (this gateway looked dead to it) is
/// not taken back by the gateway's idle-time resets: it stays the other's.
#[tokio::test]
async fn redis_streams_an_entry_another_consumer_claimed_is_not_taken_back() {
    let Some(stream) = RedisStream::new("redis_taken", None).await else {
        return;
    };
    let stack = Stack::start(&stream.consumer(
        "orders",
        "/actions/taken",
        "business_key = [\"msg:header:order_id\"]\nclaim_idle = \"1s\"",
    ))
    .await;
    assert!(eventually(WAIT, || async { stream.exists().await }).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Slow, within the upstream's 2 s timeout.
    arm(&stack, r#"{"delay_ms": 1500, "count": 1}"#).await;
    let id = stream.add(&[("order_id", "t-1"), ("body", "{}")]).await;
    assert!(
        eventually(WAIT, || async {
            stack.upstream.state.stats().requests >= 1
        })
        .await
    );
    stream.steal("g", "another", &id).await;
    // Two idle-time resets later (a third of claim_idle apart), before the
    // entry is idle long enough for anyone to claim it.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(stream.owner("g", &id).await.as_deref(), Some("another"));
    let done = eventually(WAIT, || async { stream.pending("g").await == 0 }).await;
    assert!(done, "the gateway's ack ends the entry whoever owns it");
    assert_eq!(executions(&stack, "taken"), 1);
    stack.shutdown().await;
    stream.delete().await;
}

/// Each process reads under a name of its own; the names earlier processes
/// of this consumer left in the group, holding nothing, are removed — and
/// nobody else's.
#[tokio::test]
async fn redis_streams_names_of_finished_processes_are_removed_from_the_group() {
    let Some(stream) = RedisStream::new("redis_names", None).await else {
        return;
    };
    let stack = Stack::start(&stream.consumer(
        "orders",
        "/actions/names",
        "business_key = [\"msg:header:order_id\"]\nclaim_idle = \"1s\"",
    ))
    .await;
    assert!(eventually(WAIT, || async { stream.exists().await }).await);
    stream
        .create_consumer("g", "idemgate-orders-gone-1-0000")
        .await;
    stream.create_consumer("g", "someone-else").await;
    let forgotten = eventually(WAIT, || async {
        !stream
            .consumers("g")
            .await
            .iter()
            .any(|c| c == "idemgate-orders-gone-1-0000")
    })
    .await;
    assert!(forgotten, "{:?}", stream.consumers("g").await);
    let names = stream.consumers("g").await;
    assert!(names.iter().any(|c| c == "someone-else"), "{names:?}");
    // The live gateway still reads and acknowledges.
    stream.add(&[("order_id", "n-1"), ("body", "{}")]).await;
    assert!(eventually(WAIT, || async { executions(&stack, "names") == 1 }).await);
    assert!(eventually(WAIT, || async { stream.pending("g").await == 0 }).await);
    stack.shutdown().await;
    stream.delete().await;
}
