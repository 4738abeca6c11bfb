//! `Idempotency-Key` routes end to end (docs/semantics.md): a real gateway in front of
//! the demo upstream, whose execution counter is the oracle.

use crate::support;

use std::time::Duration;

use support::services::{self, FaultProxy, Mode};
use support::{Answer, Http, Stack};

fn key_route(extra: &str) -> String {
    format!(
        r#"
        [[routes]]
        name = "act"
        methods = ["POST"]
        path_prefix = "/actions/"
        upstream = "demo"
        idempotency = "key"
        {extra}

        [[routes]]
        name = "orders"
        methods = ["POST"]
        path = "/orders"
        upstream = "demo"
        idempotency = "key"

        [[routes]]
        name = "pay"
        methods = ["POST"]
        path = "/callbacks/payment"
        upstream = "demo"
        idempotency = "key"
        "#
    )
}

async fn post(stack: &Stack, path: &str, key: &str, body: &str, extra: &[(&str, &str)]) -> Answer {
    let mut headers = vec![("idempotency-key", key)];
    headers.extend_from_slice(extra);
    stack
        .http
        .send("POST", &stack.url(path), &headers, body.to_owned())
        .await
}

/// `Idempotency-Expires` on every answer that names the record: the first,
/// a replay, a mismatch and a duplicate in flight (the default 24 h).
#[tokio::test]
async fn every_answer_says_until_when_its_key_is_remembered() {
    let stack = Stack::start(&key_route("")).await;
    let slow = {
        let (http, url) = (stack.http.clone(), stack.url("/actions/slow"));
        tokio::spawn(async move {
            http.send(
                "POST",
                &url,
                &[("idempotency-key", "e-1"), ("x-demo-delay-ms", "500")],
                "{}",
            )
            .await
        })
    };
    support::reached(&stack.upstream, 1).await;
    let in_flight = post(&stack, "/actions/slow", "e-1", "{}", &[]).await;
    assert_eq!(in_flight.status, 409);
    let first = slow.await.unwrap();
    assert_eq!(first.status, 201);
    let replay = post(&stack, "/actions/slow", "e-1", "{}", &[]).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    let mismatch = post(&stack, "/actions/slow", "e-1", "{\"other\":1}", &[]).await;
    assert_eq!(mismatch.status, 422);
    support::assert_same_expiry(
        &[&first, &in_flight, &replay, &mismatch],
        Duration::from_secs(86_400),
    );
    // A pass-through or refused-before-the-store answer names no record.
    let bad = post(&stack, "/actions/slow", "", "{}", &[]).await;
    assert_eq!(bad.status, 400);
    assert_eq!(bad.header("idempotency-expires"), None);
    stack.shutdown().await;
}

#[tokio::test]
async fn first_request_is_forwarded_with_a_stable_key_and_retries_replay() {
    let stack = Stack::start(&key_route("")).await;
    let first = post(&stack, "/actions/charge", "k-1", "{\"amount\":5}", &[]).await;
    assert_eq!(first.status, 201);
    assert!(first.header("idempotent-replayed").is_none());
    let forwarded_key = first.json()["key"].as_str().unwrap().to_owned();
    assert!(forwarded_key.starts_with("ig-"), "{forwarded_key}");
    assert_ne!(forwarded_key, "k-1");

    let again = post(&stack, "/actions/charge", "k-1", "{\"amount\":5}", &[]).await;
    assert_eq!(again.status, 201);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body, "replay is byte-identical");
    assert_eq!(again.header("x-request-id"), first.header("x-request-id"));
    assert_eq!(again.header("x-demo-execution"), Some("1"));
    assert_eq!(stack.upstream.state.executions("charge", &forwarded_key), 1);

    // The quoted structured-field form is the same key.
    let quoted = post(&stack, "/actions/charge", "\"k-1\"", "{\"amount\":5}", &[]).await;
    assert_eq!(quoted.header("idempotent-replayed"), Some("true"));
    stack.shutdown().await;
}

#[tokio::test]
async fn missing_and_malformed_keys_are_400_and_never_forwarded() {
    let stack = Stack::start(&key_route("")).await;
    let a = stack
        .http
        .send("POST", &stack.url("/actions/x"), &[], "{}")
        .await;
    assert_eq!(a.status, 400);
    assert_eq!(
        a.problem_type(),
        "urn:idemgate:problem:idempotency-key-missing"
    );
    let long = "k".repeat(256);
    let bad: Vec<Vec<(&str, &str)>> = vec![
        vec![("idempotency-key", long.as_str())],
        vec![("idempotency-key", "\"\"")],
        vec![("idempotency-key", "\"unterminated")],
        vec![("idempotency-key", "a"), ("idempotency-key", "b")],
    ];
    for headers in bad {
        let a = stack
            .http
            .send("POST", &stack.url("/actions/x"), &headers, "{}")
            .await;
        assert_eq!(a.status, 400, "{headers:?}");
        assert_eq!(
            a.problem_type(),
            "urn:idemgate:problem:idempotency-key-invalid"
        );
    }
    // Control characters and non-ASCII, sent raw.
    for raw in [&b"a\x01b"[..], b"caf\xc3\xa9", b"a\x7fb"] {
        let mut conn = tokio::net::TcpStream::connect(stack.gateway.public_addr)
            .await
            .unwrap();
        let mut req =
            b"POST /actions/x HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\nidempotency-key: "
                .to_vec();
        req.extend_from_slice(raw);
        req.extend_from_slice(b"\r\nconnection: close\r\n\r\n");
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        conn.write_all(&req).await.unwrap();
        let mut out = Vec::new();
        let _ = conn.read_to_end(&mut out).await;
        let text = String::from_utf8_lossy(&out);
        assert!(text.starts_with("HTTP/1.1 400"), "{raw:?}: {text}");
    }
    assert_eq!(
        stack.upstream.state.stats().requests,
        0,
        "nothing was forwarded"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn optional_keys_forward_unprotected_requests() {
    let stack = Stack::start(&key_route("require_key = false")).await;
    for _ in 0..2 {
        let a = stack
            .http
            .send("POST", &stack.url("/actions/free"), &[], "{}")
            .await;
        assert_eq!(a.status, 201);
    }
    assert_eq!(stack.upstream.state.executions("free", "-"), 2);
    stack.shutdown().await;
}

#[tokio::test]
async fn reusing_a_key_for_another_request_is_422() {
    let stack = Stack::start(&key_route("")).await;
    assert_eq!(
        post(&stack, "/actions/a", "k", "{\"n\":1}", &[])
            .await
            .status,
        201
    );
    for (path, body) in [
        ("/actions/a", "{\"n\":2}"),
        ("/actions/a?x=1", "{\"n\":1}"),
        ("/actions/b", "{\"n\":1}"),
    ] {
        let a = post(&stack, path, "k", body, &[]).await;
        assert_eq!(a.status, 422, "{path} {body}");
        assert_eq!(
            a.problem_type(),
            "urn:idemgate:problem:idempotency-key-reused"
        );
    }
    stack.shutdown().await;
}

#[tokio::test]
async fn a_duplicate_in_flight_is_409_with_retry_after() {
    let stack = Stack::start(&key_route("")).await;
    let url = stack.url("/actions/slow");
    let http = stack.http.clone();
    let first = tokio::spawn(async move {
        http.send(
            "POST",
            &url,
            &[("idempotency-key", "k"), ("x-demo-delay-ms", "600")],
            "{}",
        )
        .await
    });
    support::reached(&stack.upstream, 1).await;
    let dup = post(
        &stack,
        "/actions/slow",
        "k",
        "{}",
        &[("x-demo-delay-ms", "600")],
    )
    .await;
    assert_eq!(dup.status, 409);
    assert_eq!(dup.problem_type(), "urn:idemgate:problem:request-in-flight");
    assert!(dup.header("retry-after").unwrap().parse::<u64>().unwrap() >= 1);
    assert_eq!(first.await.unwrap().status, 201);
    let metrics =
        String::from_utf8(stack.http.get(&stack.admin("/metrics")).await.body.to_vec()).unwrap();
    assert!(
        metrics.contains("idemgate_requests_total{route=\"act\",outcome=\"conflict\"} 1"),
        "{metrics}"
    );
    stack.shutdown().await;
}

/// 500 clients, one key, at once: one execution.
async fn storm(stack: &Stack, wait: bool) -> (u64, Vec<u16>) {
    let url = stack.url("/actions/storm");
    let tasks = (0..500).map(|_| {
        let http = stack.http.clone();
        let url = url.clone();
        tokio::spawn(async move {
            http.send(
                "POST",
                &url,
                &[("idempotency-key", "storm-key"), ("x-demo-delay-ms", "200")],
                "{\"x\":1}",
            )
            .await
        })
    });
    let answers = futures_util::future::join_all(tasks).await;
    let statuses: Vec<u16> = answers
        .iter()
        .map(|a| a.as_ref().unwrap().status.as_u16())
        .collect();
    if wait {
        let bodies: std::collections::HashSet<_> = answers
            .iter()
            .map(|a| a.as_ref().unwrap().body.clone())
            .collect();
        assert_eq!(bodies.len(), 1, "every waiter got the first outcome");
    }
    let total = stack.upstream.state.stats().total_executions;
    (total, statuses)
}

async fn storm_case(store: Option<(String, String, String)>, wait: bool) {
    let extra = if wait { "on_concurrent = \"wait\"" } else { "" };
    let stack = Stack::start_with(&key_route(extra), |c| {
        c.server.max_connections = 1000;
        if let Some((db, redis, prefix)) = store {
            c.store.database_url = db;
            c.store.redis_url = redis;
            c.store.redis_prefix = prefix;
        }
    })
    .await;
    let started = std::time::Instant::now();
    let (executions, statuses) = storm(&stack, wait).await;
    let elapsed = started.elapsed();
    let mut mix = std::collections::BTreeMap::new();
    for s in &statuses {
        *mix.entry(*s).or_insert(0) += 1;
    }
    {
        // The figures behind the closing notes, visible with --nocapture.
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "storm wait={wait} store={}: 500 requests, {executions} execution(s), statuses {mix:?}, {elapsed:?}",
            stack.gateway.store.sql().backend()
        );
    }
    assert_eq!(executions, 1, "{statuses:?}");
    if wait {
        assert!(statuses.iter().all(|s| *s == 201), "{statuses:?}");
    } else {
        assert!(
            statuses.iter().all(|s| *s == 201 || *s == 409),
            "{statuses:?}"
        );
        assert!(statuses.contains(&201));
    }
    stack.shutdown().await;
}

async fn redis_postgres(test: &str) -> Option<(String, String, String)> {
    let db = services::shared_sql(test).await?;
    let (redis, prefix) = services::redis(test).await?;
    Some((db, redis, prefix))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storm_of_500_reject_sqlite() {
    storm_case(None, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storm_of_500_wait_sqlite() {
    storm_case(None, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storm_of_500_reject_redis_postgres() {
    let Some(store) = redis_postgres("storm_of_500_reject_redis_postgres").await else {
        return;
    };
    storm_case(Some(store), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storm_of_500_wait_redis_postgres() {
    let Some(store) = redis_postgres("storm_of_500_wait_redis_postgres").await else {
        return;
    };
    storm_case(Some(store), true).await;
}

#[tokio::test]
async fn upstream_5xx_and_retry_statuses_release_the_claim() {
    let stack = Stack::start(&key_route("")).await;
    for status in ["503", "500", "429", "409", "408"] {
        let key = format!("k-{status}");
        let a = post(
            &stack,
            "/actions/r",
            &key,
            "{}",
            &[("x-demo-fail-status", status)],
        )
        .await;
        assert_eq!(a.status.as_str(), status);
        let retry = post(&stack, "/actions/r", &key, "{}", &[]).await;
        assert_eq!(retry.status, 201, "after {status}");
        assert!(
            retry.header("idempotent-replayed").is_none(),
            "after {status}"
        );
    }
    assert_eq!(stack.upstream.state.stats().total_executions, 5);
    stack.shutdown().await;
}

#[tokio::test]
async fn upstream_4xx_is_stored_and_replayed() {
    let stack = Stack::start(&key_route("")).await;
    let body = "{\"trade_no\":\"T1\",\"order_id\":\"missing\"}";
    let first = post(&stack, "/callbacks/payment", "k", body, &[]).await;
    assert_eq!(first.status, 404);
    let again = post(&stack, "/callbacks/payment", "k", body, &[]).await;
    assert_eq!(again.status, 404);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(stack.upstream.state.stats().requests, 1);
    stack.shutdown().await;
}

/// How long these tests let an uncertain key wait (the default is the
/// upstream's timeout).
const SHORT_HOLD: std::time::Duration = std::time::Duration::from_millis(400);

fn short_hold(config: &mut idemgate_gateway::config::Config) {
    config.upstreams[0].uncertain_hold = Some("300ms".into());
}

#[tokio::test]
async fn lost_ack_is_uncertain_and_the_retry_is_decided_by_the_upstream_state() {
    let stack = Stack::start_with(&key_route(""), short_hold).await;
    let order = "{\"item\":\"book\",\"amount\":100,\"coupon\":\"SAVE10\"}";
    let lost = post(
        &stack,
        "/orders",
        "order-1",
        order,
        &[("x-demo-drop", "after")],
    )
    .await;
    assert_eq!(lost.status, 502);
    let record = stack.gateway.store.find("orders", "order-1").await.unwrap();
    assert_eq!(record[0].state, idemgate_store::RecordState::Uncertain);
    // A copy may still be running upstream: nothing is forwarded within the
    // hold, and the client is told when to come back.
    let early = post(&stack, "/orders", "order-1", order, &[]).await;
    assert_eq!(early.status, 502);
    assert_eq!(
        early.problem_type(),
        "urn:idemgate:problem:outcome-uncertain"
    );
    assert_eq!(early.header("retry-after"), Some("1"));
    tokio::time::sleep(SHORT_HOLD).await;
    // The client retries: forwarded again with the same key; the upstream
    // sees the order exists and answers without deducting again.
    let retry = post(&stack, "/orders", "order-1", order, &[]).await;
    assert_eq!(retry.status, 201);
    assert_eq!(retry.json()["repeat"], true);
    let stats = stack.upstream.state.stats();
    assert_eq!(
        stats.executions["deduct_coupon"]["SAVE10"], 1,
        "coupon deducted once"
    );
    assert_eq!(stats.executions["create_order"].values().sum::<u64>(), 1);
    assert_eq!(stats.requests, 2, "the lost attempt and its one retry");
    // And from now on it replays: the upstream is not asked again (a
    // proxy without a record would forward every retry, and the state
    // machine alone would hide it).
    let third = post(&stack, "/orders", "order-1", order, &[]).await;
    assert_eq!(third.header("idempotent-replayed"), Some("true"));
    assert_eq!(stack.upstream.state.stats().requests, 2);
    stack.shutdown().await;
}

#[tokio::test]
async fn upstream_timeout_is_504_and_uncertain() {
    let stack =
        Stack::start_with(&key_route(""), |c| c.upstreams[0].timeout = "300ms".into()).await;
    let a = post(
        &stack,
        "/actions/t",
        "k",
        "{}",
        &[("x-demo-delay-ms", "1000")],
    )
    .await;
    assert_eq!(a.status, 504);
    let record = stack.gateway.store.find("act", "k").await.unwrap();
    assert_eq!(record[0].state, idemgate_store::RecordState::Uncertain);
    tokio::time::sleep(Duration::from_millis(900)).await;
    let retry = post(
        &stack,
        "/actions/t",
        "k",
        "{}",
        &[("x-demo-delay-ms", "1000")],
    )
    .await;
    assert_eq!(retry.status, 504, "the retry was forwarded again");
    assert_eq!(stack.upstream.state.stats().requests, 2);
    stack.shutdown().await;
}

#[tokio::test]
async fn refused_connection_is_502_and_released() {
    let upstream = idemgate_demo_upstream::start("127.0.0.1:0").await.unwrap();
    let mut config = support::config(upstream.addr, &key_route(""));
    config.upstreams[0].url = format!("http://127.0.0.1:{}", support::dead_port());
    let gateway = idemgate_gateway::gateway::start_for_tests(config)
        .await
        .unwrap();
    let http = Http::default();
    let a = http
        .send(
            "POST",
            &format!("http://{}/actions/x", gateway.public_addr),
            &[("idempotency-key", "k")],
            "{}",
        )
        .await;
    assert_eq!(a.status, 502);
    let record = gateway.store.find("act", "k").await.unwrap();
    assert_eq!(record[0].state, idemgate_store::RecordState::Released);
    gateway.shutdown().await;
    upstream.shutdown().await;
}

/// `upstreams[].max_connections`: a request that finds every allowed
/// connection in use waits for one, and one that waited past half the
/// upstream timeout is `503 upstream-busy` with its claim released: the
/// retry executes, once (counted on `/actions/`, which executes every
/// call it gets).
#[tokio::test]
async fn past_the_upstream_connection_cap_a_request_waits_then_is_busy_and_released() {
    let stack = Stack::start_with(&key_route(""), |c| {
        c.server.worker_threads = 1;
        c.upstreams[0].max_connections = 1;
        // Queued requests wait up to 1 s; the first holds the connection
        // for 1.5 s, well within its own 2 s.
        c.upstreams[0].timeout = "2s".into();
    })
    .await;
    let holder = {
        let http = stack.http.clone();
        let url = stack.url("/actions/capped");
        tokio::spawn(async move {
            let headers = [("idempotency-key", "first"), ("x-demo-delay-ms", "1500")];
            http.send("POST", &url, &headers, "{}").await
        })
    };
    support::reached(&stack.upstream, 1).await;
    let busy = post(&stack, "/actions/capped", "second", "{}", &[]).await;
    assert_eq!(busy.status, 503);
    assert_eq!(busy.problem_type(), "urn:idemgate:problem:upstream-busy");
    assert_eq!(busy.header("retry-after"), Some("1"));
    let record = stack.gateway.store.find("act", "second").await.unwrap();
    assert_eq!(record[0].state, idemgate_store::RecordState::Released);
    assert_eq!(holder.await.unwrap().status, 201);
    assert_eq!(
        support::executions(&stack, "capped"),
        1,
        "the queued one never went"
    );
    let retry = post(&stack, "/actions/capped", "second", "{}", &[]).await;
    assert_eq!(retry.status, 201);
    assert_eq!(
        support::executions(&stack, "capped"),
        2,
        "the retry executed once"
    );
    stack.shutdown().await;
}

/// Under the cap a burst queues instead of failing: 100 keys at once
/// through one connection, each executed once.
#[tokio::test]
async fn a_burst_queues_behind_the_upstream_connection_cap() {
    let stack = Stack::start_with(&key_route(""), |c| {
        c.server.worker_threads = 1;
        c.upstreams[0].max_connections = 1;
        c.upstreams[0].timeout = "10s".into();
    })
    .await;
    let answers = support::concurrent_posts(
        &stack.http,
        100,
        |_| stack.url("/actions/burst"),
        |i| support::pairs(&[("idempotency-key", &format!("burst-{i}"))]),
        "{}",
    )
    .await;
    assert!(answers.iter().all(|a| a.status == 201));
    assert_eq!(support::executions(&stack, "burst"), 100);
    stack.shutdown().await;
}

#[tokio::test]
async fn clients_never_share_records_or_responses() {
    let stack = Stack::start(&key_route("")).await;
    let alice = post(
        &stack,
        "/actions/c",
        "same-key",
        "{}",
        &[("authorization", "Bearer alice")],
    )
    .await;
    let bob = post(
        &stack,
        "/actions/c",
        "same-key",
        "{}",
        &[("authorization", "Bearer bob")],
    )
    .await;
    assert_eq!(alice.status, 201);
    assert_eq!(bob.status, 201);
    assert!(
        bob.header("idempotent-replayed").is_none(),
        "bob got alice's outcome"
    );
    assert_ne!(alice.body, bob.body);
    assert_ne!(
        alice.json()["key"],
        bob.json()["key"],
        "forwarded keys differ per client"
    );
    // Bob with a different body is a fresh request of his, not alice's 422.
    let anon = post(&stack, "/actions/c", "same-key", "{\"other\":1}", &[]).await;
    assert_eq!(anon.status, 201);
    assert_eq!(stack.upstream.state.stats().total_executions, 3);
    stack.shutdown().await;
}

#[tokio::test]
async fn set_cookie_is_never_replayed() {
    let stack = Stack::start(&key_route("")).await;
    let first = post(
        &stack,
        "/actions/login",
        "k",
        "{}",
        &[("x-demo-set-cookie", "abc")],
    )
    .await;
    assert_eq!(first.header("set-cookie"), Some("session=abc"));
    let again = post(
        &stack,
        "/actions/login",
        "k",
        "{}",
        &[("x-demo-set-cookie", "abc")],
    )
    .await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert!(again.header("set-cookie").is_none());
    stack.shutdown().await;
}

#[tokio::test]
async fn responses_over_the_cap_are_recorded_without_body_and_never_rerun() {
    let stack = Stack::start_with(&key_route(""), |c| c.store.max_stored_body_bytes = 1000).await;
    let first = post(
        &stack,
        "/actions/big",
        "k",
        "{}",
        &[("x-demo-response-bytes", "50000")],
    )
    .await;
    assert_eq!(first.status, 201);
    assert_eq!(first.body.len(), 50_000, "the first answer is whole");
    let again = post(
        &stack,
        "/actions/big",
        "k",
        "{}",
        &[("x-demo-response-bytes", "50000")],
    )
    .await;
    assert_eq!(again.status, 201);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.header("idempotent-body-omitted"), Some("true"));
    assert!(again.body.is_empty());
    assert_eq!(stack.upstream.state.stats().total_executions, 1);
    stack.shutdown().await;
}

#[tokio::test]
async fn oversized_request_bodies_are_413_and_leave_no_record() {
    let stack = Stack::start_with(&key_route(""), |c| c.server.max_body_bytes = 100).await;
    let a = post(&stack, "/actions/x", "k", &"x".repeat(101), &[]).await;
    assert_eq!(a.status, 413);
    assert_eq!(a.problem_type(), "urn:idemgate:problem:body-too-large");
    assert!(
        stack
            .gateway
            .store
            .find("act", "k")
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(stack.upstream.state.stats().requests, 0);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_store_is_503_and_nothing_is_forwarded() {
    let test = "unreachable_store_is_503_and_nothing_is_forwarded";
    let Some(url) = services::shared_sql(test).await else {
        return;
    };
    let proxy = FaultProxy::start(services::sql_addr(&url)).await;
    let proxied = services::via(&url, proxy.port);
    let stack = Stack::start_with(&key_route(""), |c| {
        c.store.database_url = proxied;
        c.store.timeout = "500ms".into();
    })
    .await;
    proxy.set(Mode::Blackhole);
    let started = std::time::Instant::now();
    let a = post(&stack, "/actions/x", "k", "{}", &[]).await;
    assert_eq!(a.status, 503);
    assert_eq!(a.problem_type(), "urn:idemgate:problem:store-unavailable");
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(
        stack.upstream.state.stats().requests,
        0,
        "forwarded without a durable claim"
    );
    proxy.set(Mode::Pass);
    stack.shutdown().await;
}

#[tokio::test]
async fn a_response_cut_mid_body_is_uncertain_and_the_retry_is_forwarded() {
    let stack = Stack::start_with(&key_route(""), short_hold).await;
    let order = "{\"item\":\"book\",\"amount\":1,\"coupon\":\"CUT\"}";
    let cut = post(
        &stack,
        "/orders",
        "cut-1",
        order,
        &[("x-demo-cut-body", "1")],
    )
    .await;
    assert_eq!(cut.status, 502);
    assert_eq!(cut.problem_type(), "urn:idemgate:problem:upstream-broken");
    let record = stack.gateway.store.find("orders", "cut-1").await.unwrap();
    assert_eq!(record[0].state, idemgate_store::RecordState::Uncertain);
    tokio::time::sleep(SHORT_HOLD).await;
    let retry = post(&stack, "/orders", "cut-1", order, &[]).await;
    assert_eq!(retry.status, 201);
    assert_eq!(retry.json()["repeat"], true);
    assert_eq!(stack.upstream.state.executions("deduct_coupon", "CUT"), 1);
    stack.shutdown().await;
}

#[tokio::test]
async fn network_faults_between_gateway_and_upstream() {
    use support::services::{FaultProxy, Mode};
    let upstream = idemgate_demo_upstream::start("127.0.0.1:0").await.unwrap();
    let proxy = FaultProxy::start(upstream.addr).await;
    let mut config = support::config(upstream.addr, &key_route(""));
    config.upstreams[0].url = format!("http://127.0.0.1:{}", proxy.port);
    config.upstreams[0].timeout = "500ms".into();
    let gateway = idemgate_gateway::gateway::start_for_tests(config)
        .await
        .unwrap();
    let http = Http::default();
    let url = format!("http://{}/orders", gateway.public_addr);
    let send = |key: &'static str| {
        let http = http.clone();
        let url = url.clone();
        // One coupon per order: a second deduction would show as a 2.
        let order = format!("{{\"item\":\"book\",\"amount\":1,\"coupon\":\"{key}\"}}");
        async move {
            http.send("POST", &url, &[("idempotency-key", key)], order)
                .await
        }
    };
    // Delayed past the upstream timeout: 504, uncertain.
    proxy.set(Mode::Delay(Duration::from_millis(1500)));
    assert_eq!(send("net-1").await.status, 504);
    // The answer cut after 20 bytes (the upstream committed): 502.
    proxy.set(Mode::CutAfter(20));
    assert_eq!(send("net-2").await.status, 502);
    // Connections refused: 502, released.
    proxy.set(Mode::Refuse);
    assert_eq!(send("net-3").await.status, 502);
    // Healthy again: every retry resolves, and nothing ran twice.
    proxy.set(Mode::Pass);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    for key in ["net-1", "net-2", "net-3"] {
        let a = send(key).await;
        assert_eq!(a.status, 201, "{key}");
    }
    for key in ["net-1", "net-2", "net-3"] {
        assert_eq!(upstream.state.executions("deduct_coupon", key), 1, "{key}");
    }
    gateway.shutdown().await;
    upstream.shutdown().await;
}
