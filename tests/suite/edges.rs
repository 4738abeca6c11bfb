//! Keys and edges that cannot be bent (docs/semantics.md): callback scoping, business
//! key validation, tokens as one action, purges of live claims, requests
//! that never left, replays without their body.
//!
//! Counts are taken on the demo upstream's `/actions/{name}`, which executes
//! on every call.

use crate::support;

use std::time::Duration;

use support::services;
use support::{Answer, Stack, executions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const HOOKS: &str = r#"
    [[routes]]
    name = "hook"
    methods = ["POST"]
    path_prefix = "/actions/"
    upstream = "demo"
    kind = "callback"
    business_key = ["json:/id"]
"#;

async fn deliver(stack: &Stack, auth: Option<&str>, body: &str) -> Answer {
    let mut headers = vec![];
    if let Some(auth) = auth {
        headers.push(("authorization", auth));
    }
    stack
        .http
        .send(
            "POST",
            &stack.url("/actions/hook"),
            &headers,
            body.to_owned(),
        )
        .await
}

#[tokio::test]
async fn a_redelivery_with_a_rotated_credential_finds_the_first_delivery() {
    let stack = Stack::start(HOOKS).await;
    let first = deliver(&stack, Some("Bearer token-of-monday"), r#"{"id":"evt_1"}"#).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let again = deliver(&stack, Some("Bearer token-of-tuesday"), r#"{"id":"evt_1"}"#).await;
    assert_eq!(again.status, 201);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    let anonymous = deliver(&stack, None, r#"{"id":"evt_1"}"#).await;
    assert_eq!(anonymous.header("idempotent-replayed"), Some("true"));
    // The same forwarded key, whatever credential carried the delivery.
    assert_eq!(first.json()["key"], again.json()["key"]);
    assert_eq!(executions(&stack, "hook"), 1);
    stack.shutdown().await;
}

#[tokio::test]
async fn large_json_numbers_are_keys_as_written() {
    let stack = Stack::start(HOOKS).await;
    for id in ["18446744073709551616", "18446744073709551617", "1.0", "1"] {
        let a = deliver(&stack, None, &format!(r#"{{"id":{id}}}"#)).await;
        assert_eq!(a.status, 201, "{id}: {:?}", a.body);
        assert_eq!(a.header("idempotent-replayed"), None, "{id} collided");
    }
    assert_eq!(executions(&stack, "hook"), 4);
    stack.shutdown().await;
}

async fn bad_keys_case(stack: &Stack) {
    let long = "x".repeat(5000);
    let bad = [
        r#"{"id":"a\u0000b"}"#.to_owned(),
        r#"{"id":"bell\u0007"}"#.to_owned(),
        r#"{"id":"line\nbreak"}"#.to_owned(),
        format!(r#"{{"id":"{long}"}}"#),
        format!(r#"{{"id":"{}"}}"#, "y".repeat(256)),
    ];
    for body in &bad {
        let a = deliver(stack, None, body).await;
        assert_eq!(a.status, 400, "{body:.40}");
        assert_eq!(
            a.problem_type(),
            "urn:idemgate:problem:business-key-invalid"
        );
    }
    let ok = deliver(stack, None, &format!(r#"{{"id":"{}"}}"#, "z".repeat(255))).await;
    assert_eq!(ok.status, 201, "255 bytes is a key");
    // One bad key never fails another request's claim: valid deliveries
    // sent at once beside bad ones all go through.
    let answers = futures_util::future::join_all((0..40).map(|i| {
        let body = if i % 10 == 0 {
            bad[i % bad.len()].clone()
        } else {
            format!(r#"{{"id":"ok-{i}"}}"#)
        };
        async move { (i, deliver(stack, None, &body).await) }
    }))
    .await;
    for (i, a) in answers {
        let want = if i % 10 == 0 { 400 } else { 201 };
        assert_eq!(a.status, want, "delivery {i}: {:?}", a.body);
    }
    assert_eq!(executions(stack, "hook"), 1 + 36);
}

#[tokio::test]
async fn business_keys_are_bounded_and_free_of_control_characters_sqlite() {
    let stack = Stack::start(HOOKS).await;
    bad_keys_case(&stack).await;
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn business_keys_are_bounded_and_free_of_control_characters_postgres() {
    let test = "business_keys_are_bounded_and_free_of_control_characters_postgres";
    let Some(db) = services::shared_sql(test).await else {
        return;
    };
    let stack = Stack::start_with(HOOKS, |c| c.store.database_url = db).await;
    bad_keys_case(&stack).await;
    stack.shutdown().await;
}

#[tokio::test]
async fn a_token_without_a_route_executes_on_at_most_one_route() {
    let stack = Stack::start(
        r#"
        [[routes]]
        name = "one"
        methods = ["POST"]
        path = "/actions/one"
        upstream = "demo"
        idempotency = "token"

        [[routes]]
        name = "two"
        methods = ["POST"]
        path = "/actions/two"
        upstream = "demo"
        idempotency = "token"
        "#,
    )
    .await;
    let issued = stack.http.send("POST", &stack.url("/token"), &[], "").await;
    let token = issued.json()["token"].as_str().unwrap().to_owned();
    let headers = [("idempotency-token", token.as_str())];
    let one = stack
        .http
        .send("POST", &stack.url("/actions/one"), &headers, "{}")
        .await;
    assert_eq!(one.status, 201);
    let two = stack
        .http
        .send("POST", &stack.url("/actions/two"), &headers, "{}")
        .await;
    assert_eq!(two.status, 422, "{:?}", two.body);
    assert_eq!(
        two.problem_type(),
        "urn:idemgate:problem:idempotency-key-reused"
    );
    let again = stack
        .http
        .send("POST", &stack.url("/actions/one"), &headers, "{}")
        .await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(executions(&stack, "one") + executions(&stack, "two"), 1);
    // Operators find the record by the route it was used on.
    let token_id = {
        use base64::Engine as _;
        let payload = token.split('.').nth(1).unwrap();
        let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(payload)
            .unwrap();
        hex::encode(&payload[..16])
    };
    let shown = stack
        .http
        .get(&stack.admin(&format!("/admin/keys/one/{token_id}")))
        .await;
    assert_eq!(shown.status, 200, "{:?}", shown.body);
    stack.shutdown().await;
}

const ACTIONS: &str = r#"
    [[routes]]
    name = "act"
    methods = ["POST"]
    path_prefix = "/actions/"
    upstream = "demo"
    idempotency = "key"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_never_lets_a_second_request_run_beside_the_first() {
    let stack = Stack::start(ACTIONS).await;
    let first = {
        let http = stack.http.clone();
        let url = stack.url("/actions/purged");
        tokio::spawn(async move {
            http.send(
                "POST",
                &url,
                &[("idempotency-key", "p-1"), ("x-demo-delay-ms", "1000")],
                "{}",
            )
            .await
        })
    };
    assert!(
        support::eventually(Duration::from_secs(2), || async {
            stack
                .gateway
                .metrics
                .claims_in_flight
                .load(std::sync::atomic::Ordering::Relaxed)
                == 1
        })
        .await
    );
    let purge = stack
        .http
        .send("DELETE", &stack.admin("/admin/keys/act/p-1"), &[], "")
        .await;
    assert_eq!(purge.status, 409, "{:?}", purge.body);
    assert_eq!(
        purge.problem_type(),
        "urn:idemgate:problem:record-in-flight"
    );
    let retry = stack
        .http
        .send(
            "POST",
            &stack.url("/actions/purged"),
            &[("idempotency-key", "p-1")],
            "{}",
        )
        .await;
    assert_eq!(retry.status, 409, "still held: no second execution");
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(executions(&stack, "purged"), 1);
    // Finished: now it may go.
    let purge = stack
        .http
        .send("DELETE", &stack.admin("/admin/keys/act/p-1"), &[], "")
        .await;
    assert_eq!(purge.status, 200);
    assert_eq!(purge.json()["purged"], 1);
    stack.shutdown().await;
}

/// An upstream that never accepts: its backlog is full, so a connect to it
/// hangs (the SYN is dropped) — a request that never leaves.
async fn blackhole() -> (std::net::SocketAddr, Vec<tokio::net::TcpStream>) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(0).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut held = Vec::new();
    for _ in 0..8 {
        match tokio::time::timeout(
            Duration::from_millis(200),
            tokio::net::TcpStream::connect(addr),
        )
        .await
        {
            Ok(Ok(s)) => held.push(s),
            _ => break,
        }
    }
    std::mem::forget(listener);
    (addr, held)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_that_times_out_is_never_sent_never_uncertain() {
    let (addr, _held) = blackhole().await;
    let stack = Stack::start_with(ACTIONS, |c| {
        c.upstreams[0].url = format!("http://{addr}");
        c.upstreams[0].timeout = "1s".into();
    })
    .await;
    let a = stack
        .http
        .send(
            "POST",
            &stack.url("/actions/never"),
            &[("idempotency-key", "n-1")],
            "{}",
        )
        .await;
    assert_eq!(a.status, 502, "{:?}", a.body);
    assert_eq!(
        a.problem_type(),
        "urn:idemgate:problem:upstream-unavailable"
    );
    let shown = stack
        .http
        .get(&stack.admin("/admin/keys/act/n-1"))
        .await
        .json();
    assert_eq!(shown["records"][0]["state"], "released", "{shown}");
    stack.shutdown().await;
}

/// A raw upstream answering every request with `response`.
async fn raw_upstream(response: &'static [u8]) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                let mut seen = Vec::new();
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    match socket.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = socket.write_all(response).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn a_replay_without_its_body_carries_no_header_describing_the_body() {
    let addr = raw_upstream(
        b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n\
          ETag: \"v1\"\r\nContent-MD5: Q2hlY2sgSW50ZWdyaXR5IQ==\r\nDigest: sha-256=abc\r\n\
          X-Kept: yes\r\nContent-Length: 64\r\nConnection: close\r\n\r\n\
          0123456789012345678901234567890123456789012345678901234567890123",
    )
    .await;
    let stack = Stack::start_with(ACTIONS, |c| {
        c.upstreams[0].url = format!("http://{addr}");
        c.store.max_stored_body_bytes = 16;
    })
    .await;
    let url = stack.url("/actions/big");
    let post = || {
        stack
            .http
            .send("POST", &url, &[("idempotency-key", "b-1")], "{}")
    };
    let first = post().await;
    assert_eq!(first.status, 201);
    assert_eq!(
        first.header("etag"),
        Some("\"v1\""),
        "the first client gets it all"
    );
    assert_eq!(first.body.len(), 64);
    let replay = post().await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.header("idempotent-body-omitted"), Some("true"));
    for name in ["content-encoding", "etag", "content-md5", "digest"] {
        assert_eq!(replay.header(name), None, "{name} describes a missing body");
    }
    assert_eq!(replay.header("x-kept"), Some("yes"));
    assert!(replay.body.is_empty());
    stack.shutdown().await;
}

/// A gateway on the SQLite file in `dir` with the in-process fast layer.
async fn on_file(
    dir: &std::path::Path,
    upstream: std::net::SocketAddr,
    retention: &str,
) -> idemgate_gateway::gateway::RunningGateway {
    let mut c = support::config(upstream, ACTIONS);
    c.store.database_url = format!("sqlite://{}/records.db", dir.display());
    c.store.retention = retention.into();
    idemgate_gateway::gateway::start_for_tests(c).await.unwrap()
}

async fn act(
    http: &support::Http,
    gateway: &idemgate_gateway::gateway::RunningGateway,
    key: &str,
) -> Answer {
    http.send(
        "POST",
        &format!("http://{}/actions/cached", gateway.public_addr),
        &[("idempotency-key", key)],
        "{}",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_from_the_cli_reaches_the_gateways_in_process_layer() {
    let upstream = idemgate_demo_upstream::start("127.0.0.1:0").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gateway = on_file(dir.path(), upstream.addr, "1h").await;
    let http = support::Http::default();
    assert_eq!(act(&http, &gateway, "c-1").await.status, 201);
    let replay = act(&http, &gateway, "c-1").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    // The operator purges from another process: this gateway's in-process
    // layer must forget the key by the time the command returns.
    let config = dir.path().join("cli.toml");
    std::fs::write(
        &config,
        format!(
            "[store]\ndatabase_url = \"sqlite://{}/records.db\"\n",
            dir.path().display()
        ),
    )
    .unwrap();
    let purge = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["keys", "purge", "act", "c-1", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(
        purge.status.success(),
        "{}",
        String::from_utf8_lossy(&purge.stderr)
    );
    let after = act(&http, &gateway, "c-1").await;
    assert_eq!(after.status, 201);
    assert_eq!(
        after.header("idempotent-replayed"),
        None,
        "a purged key was replayed"
    );
    assert_eq!(
        upstream.state.stats().executions["cached"]
            .values()
            .sum::<u64>(),
        2
    );
    gateway.shutdown().await;
    upstream.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_replay_never_outlives_its_record() {
    let upstream = idemgate_demo_upstream::start("127.0.0.1:0").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let a = on_file(dir.path(), upstream.addr, "2s").await;
    let b = on_file(dir.path(), upstream.addr, "2s").await;
    let http = support::Http::default();
    let started = std::time::Instant::now();
    assert_eq!(act(&http, &a, "t-1").await.status, 201);
    // B replays from SQL at 1.2 s and caches the outcome in its own layer —
    // for what is left of the record's retention, not a whole new one.
    tokio::time::sleep_until((started + Duration::from_millis(1200)).into()).await;
    assert_eq!(
        act(&http, &b, "t-1").await.header("idempotent-replayed"),
        Some("true")
    );
    // Past the record's retention the key is free: B must not replay it
    // from its cache.
    tokio::time::sleep_until((started + Duration::from_millis(2600)).into()).await;
    let after = act(&http, &b, "t-1").await;
    assert_eq!(after.status, 201);
    assert_eq!(
        after.header("idempotent-replayed"),
        None,
        "replayed past the record's retention"
    );
    a.shutdown().await;
    b.shutdown().await;
    upstream.shutdown().await;
}
