//! The gateway foundation end to end: a real gateway on 127.0.0.1:0 in front
//! of a real demo upstream.

use crate::support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use support::{Http, PASS_THROUGH, Stack, dead_port};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[tokio::test]
async fn forwards_method_path_query_headers_and_body() {
    let stack = Stack::start(PASS_THROUGH).await;
    let a = stack
        .http
        .send(
            "PUT",
            &stack.url("/echo/a/b?x=1&y=%20z"),
            &[
                ("x-custom", "kept"),
                ("host", "shop.example"),
                ("x-forwarded-for", "10.1.2.3"),
            ],
            "hello",
        )
        .await;
    assert_eq!(a.status, 200);
    let echo = a.json();
    assert_eq!(echo["method"], "PUT");
    assert_eq!(echo["path"], "/echo/a/b");
    assert_eq!(echo["query"], "x=1&y=%20z");
    assert_eq!(echo["body_bytes"], 5);
    let h = &echo["headers"];
    assert_eq!(h["x-custom"][0], "kept");
    assert_eq!(h["x-forwarded-for"][0], "10.1.2.3, 127.0.0.1");
    assert_eq!(h["x-forwarded-proto"][0], "http");
    assert_eq!(h["x-forwarded-host"][0], "shop.example");
    assert_eq!(h["host"][0], stack.upstream.addr.to_string());
    // A request id was made (UUID v7), forwarded, and returned.
    let id = a.header("x-request-id").unwrap().to_owned();
    assert_eq!(h["x-request-id"][0], id.as_str());
    assert_eq!(uuid::Uuid::parse_str(&id).unwrap().get_version_num(), 7);
    stack.shutdown().await;
}

#[tokio::test]
async fn client_request_id_is_kept() {
    let stack = Stack::start(PASS_THROUGH).await;
    let a = stack
        .http
        .send(
            "GET",
            &stack.url("/echo"),
            &[("x-request-id", "abc-123")],
            "",
        )
        .await;
    assert_eq!(a.header("x-request-id"), Some("abc-123"));
    assert_eq!(a.json()["headers"]["x-request-id"][0], "abc-123");
    stack.shutdown().await;
}

#[tokio::test]
async fn hop_by_hop_headers_are_stripped_including_connection_named_ones() {
    let stack = Stack::start(PASS_THROUGH).await;
    let a = stack
        .http
        .send(
            "GET",
            &stack.url("/echo"),
            &[
                ("connection", "x-hop-secret"),
                ("x-hop-secret", "must-not-pass"),
                ("keep-alive", "timeout=5"),
                ("proxy-authorization", "Basic eA=="),
                ("te", "trailers"),
                ("upgrade", "h2c"),
                ("x-end-to-end", "passes"),
            ],
            "",
        )
        .await;
    let h = &a.json()["headers"];
    for gone in [
        "x-hop-secret",
        "keep-alive",
        "proxy-authorization",
        "te",
        "upgrade",
    ] {
        assert!(h.get(gone).is_none(), "{gone} was forwarded: {h}");
    }
    assert_eq!(h["x-end-to-end"][0], "passes");
    stack.shutdown().await;
}

#[tokio::test]
async fn large_bodies_stream_both_ways() {
    let stack = Stack::start_with(PASS_THROUGH, |c| c.server.max_body_bytes = 64 << 20).await;
    let body = Bytes::from(vec![7u8; 24 << 20]);
    let expected = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(&body))
    };
    let a = stack
        .http
        .send("POST", &stack.url("/echo/upload"), &[], body)
        .await;
    assert_eq!(a.status, 200);
    assert_eq!(a.json()["body_bytes"], 24 << 20);
    assert_eq!(a.json()["body_sha256"], expected);

    let a = stack.http.get(&stack.url("/stream?bytes=20000000")).await;
    assert_eq!(a.status, 200);
    assert_eq!(a.body.len(), 20_000_000);
    stack.shutdown().await;
}

#[tokio::test]
async fn unknown_path_is_404_and_wrong_method_is_405_with_allow() {
    let routes = r#"
        [[routes]]
        name = "create"
        methods = ["POST"]
        path = "/echo"
        upstream = "demo"
        [[routes]]
        name = "replace"
        methods = ["PUT"]
        path = "/echo"
        upstream = "demo"
    "#;
    let stack = Stack::start(routes).await;
    let a = stack.http.get(&stack.url("/nowhere")).await;
    assert_eq!(a.status, 404);
    assert_eq!(a.problem_type(), "urn:idemgate:problem:route-not-found");
    assert!(a.header("x-request-id").is_some());

    let a = stack.http.get(&stack.url("/echo")).await;
    assert_eq!(a.status, 405);
    assert_eq!(a.problem_type(), "urn:idemgate:problem:method-not-allowed");
    assert_eq!(a.header("allow"), Some("POST, PUT"));
    stack.shutdown().await;
}

#[tokio::test]
async fn dot_segments_are_refused() {
    let stack = Stack::start(PASS_THROUGH).await;
    for path in ["/echo/../stats", "/echo/%2e%2e/stats", "//stats"] {
        let a = stack.http.get(&stack.url(path)).await;
        assert_eq!(a.status, 400, "{path}");
        assert_eq!(a.problem_type(), "urn:idemgate:problem:invalid-path");
    }
    assert_eq!(stack.upstream.state.stats().requests, 0);
    stack.shutdown().await;
}

#[tokio::test]
async fn oversized_bodies_are_413_and_not_forwarded() {
    let stack = Stack::start_with(PASS_THROUGH, |c| c.server.max_body_bytes = 1000).await;
    // Declared length over the limit: refused before anything is sent.
    let a = stack
        .http
        .send("POST", &stack.url("/actions/big"), &[], vec![b'x'; 1001])
        .await;
    assert_eq!(a.status, 413);
    assert_eq!(a.problem_type(), "urn:idemgate:problem:body-too-large");
    // Chunked (no length): the limit trips while streaming.
    let mut conn = TcpStream::connect(stack.gateway.public_addr).await.unwrap();
    let mut request =
        b"POST /actions/big HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..4 {
        request.extend_from_slice(b"1f4\r\n");
        request.extend_from_slice(&[b'y'; 500]);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"0\r\n\r\n");
    conn.write_all(&request).await.unwrap();
    let mut reply = vec![0; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut reply))
        .await
        .unwrap()
        .unwrap();
    let reply = String::from_utf8_lossy(&reply[..n]);
    assert!(reply.starts_with("HTTP/1.1 413"), "{reply}");
    assert_eq!(
        stack.upstream.state.executions("big", "-"),
        0,
        "a truncated body must not execute"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn upstream_down_is_502_and_slow_upstream_is_504() {
    let upstream = idemgate_demo_upstream::start("127.0.0.1:0").await.unwrap();
    let mut config = support::config(upstream.addr, PASS_THROUGH);
    config.upstreams[0].url = format!("http://127.0.0.1:{}", dead_port());
    let gateway = idemgate_gateway::gateway::start_for_tests(config)
        .await
        .unwrap();
    let http = Http::default();
    let a = http
        .get(&format!("http://{}/echo", gateway.public_addr))
        .await;
    assert_eq!(a.status, 502);
    assert_eq!(
        a.problem_type(),
        "urn:idemgate:problem:upstream-unavailable"
    );
    gateway.shutdown().await;

    let stack = Stack::start_with(PASS_THROUGH, |c| {
        c.upstreams[0].timeout = "300ms".into();
    })
    .await;
    let started = Instant::now();
    let a = stack
        .http
        .send(
            "GET",
            &stack.url("/echo"),
            &[("x-demo-delay-ms", "3000")],
            "",
        )
        .await;
    assert_eq!(a.status, 504);
    assert_eq!(a.problem_type(), "urn:idemgate:problem:upstream-timeout");
    assert!(started.elapsed() < Duration::from_secs(2));
    stack.shutdown().await;
    upstream.shutdown().await;
}

#[tokio::test]
async fn upstream_dropping_the_connection_is_502() {
    let stack = Stack::start(PASS_THROUGH).await;
    let a = stack
        .http
        .send(
            "POST",
            &stack.url("/actions/pay"),
            &[("x-demo-drop", "after")],
            "",
        )
        .await;
    assert_eq!(a.status, 502);
    assert_eq!(a.problem_type(), "urn:idemgate:problem:upstream-broken");
    // The gateway itself never retried the POST.
    assert_eq!(stack.upstream.state.executions("pay", "-"), 1);
    stack.shutdown().await;
}

#[tokio::test]
async fn header_read_timeout_disconnects_a_half_sent_request_line() {
    let stack = Stack::start_with(PASS_THROUGH, |c| {
        c.server.header_read_timeout = "500ms".into();
    })
    .await;
    let mut conn = TcpStream::connect(stack.gateway.public_addr).await.unwrap();
    conn.write_all(b"GET /ec").await.unwrap();
    let started = Instant::now();
    let mut buf = [0u8; 512];
    let read = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut buf))
        .await
        .expect("the gateway kept a half-sent request open");
    // Closed (0 bytes) or answered 408 and closed — never left hanging.
    if let Ok(n) = read
        && n > 0
    {
        assert!(String::from_utf8_lossy(&buf[..n]).contains("408"));
    }
    assert!(started.elapsed() >= Duration::from_millis(400));
    assert!(started.elapsed() < Duration::from_secs(3));
    stack.shutdown().await;
}

/// A connection that got one keep-alive answer and stays open.
async fn served_connection(addr: std::net::SocketAddr) -> TcpStream {
    let mut conn = TcpStream::connect(addr).await.unwrap();
    conn.write_all(b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 8192];
    let n = conn.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    conn
}

/// At the connection cap a newcomer is answered at once — `503
/// connections-exhausted`, the connection closed, nothing forwarded —
/// and a connection once a slot is free is served.
#[tokio::test]
async fn connection_cap_refuses_extra_connections_at_once() {
    // One worker: the cap is split across worker threads.
    let stack = Stack::start_with(PASS_THROUGH, |c| {
        c.server.max_connections = 1;
        c.server.worker_threads = 1;
    })
    .await;
    let addr = stack.gateway.public_addr;
    // Connection A: one keep-alive exchange, then held open.
    let a = served_connection(addr).await;
    let requests = stack.upstream.state.stats().requests;
    // Connection B is refused while A holds the only slot…
    let mut b = TcpStream::connect(addr).await.unwrap();
    b.write_all(b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut refused = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), b.read_to_end(&mut refused))
        .await
        .expect("B was left waiting")
        .unwrap();
    let refused = String::from_utf8_lossy(&refused);
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    assert!(refused.contains("connections-exhausted"), "{refused}");
    assert_eq!(
        stack.upstream.state.stats().requests,
        requests,
        "nothing forwarded"
    );
    // …and a connection after A went away is served.
    drop(a);
    let served = support::eventually(Duration::from_secs(5), || async {
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(2), c.read_to_end(&mut answer)).await;
        answer.starts_with(b"HTTP/1.1 200")
    })
    .await;
    assert!(served);
    stack.shutdown().await;
}

#[tokio::test]
async fn graceful_shutdown_finishes_in_flight_requests() {
    let stack = Stack::start(PASS_THROUGH).await;
    let url = stack.url("/actions/slow");
    let http = stack.http.clone();
    let in_flight = tokio::spawn(async move {
        http.send("POST", &url, &[("x-demo-delay-ms", "800")], "")
            .await
    });
    support::reached(&stack.upstream, 1).await;
    let public = stack.gateway.public_addr;
    let Stack {
        upstream, gateway, ..
    } = stack;
    let stopping = tokio::spawn(gateway.shutdown());
    tokio::time::sleep(Duration::from_millis(100)).await;
    // No new connections once shutdown began…
    assert!(TcpStream::connect(public).await.is_err());
    // …but the request already running gets its answer.
    let a = in_flight.await.unwrap();
    assert_eq!(a.status, 201);
    stopping.await.unwrap();
    assert_eq!(upstream.state.executions("slow", "-"), 1);
    upstream.shutdown().await;
}

#[tokio::test]
async fn admin_endpoints_are_only_on_the_admin_listener() {
    let routes = r#"
        [[routes]]
        name = "orders"
        path_prefix = "/orders"
        upstream = "demo"
    "#;
    let stack = Stack::start(routes).await;
    for path in ["/healthz", "/readyz", "/metrics"] {
        let a = stack.http.get(&stack.admin(path)).await;
        assert_eq!(a.status, 200, "{path}");
        let a = stack.http.get(&stack.url(path)).await;
        assert_eq!(a.status, 404, "{path} reachable on the public listener");
    }
    stack.shutdown().await;
}

#[tokio::test]
async fn metrics_count_requests_by_route_and_outcome() {
    let stack = Stack::start(PASS_THROUGH).await;
    stack.http.get(&stack.url("/echo")).await;
    stack.http.get(&stack.url("/echo/../x")).await;
    let text =
        String::from_utf8(stack.http.get(&stack.admin("/metrics")).await.body.to_vec()).unwrap();
    assert!(
        text.contains("idemgate_requests_total{route=\"pass\",outcome=\"forwarded\"} 1"),
        "{text}"
    );
    assert!(text.contains("idemgate_upstream_duration_seconds_count{upstream=\"demo\"} 1"));
    assert!(text.contains("idemgate_store_fallback_total{layer=\"redis\"} 0"));
    stack.shutdown().await;
}

#[tokio::test]
async fn a_second_gateway_on_a_taken_port_refuses_to_start() {
    let stack = Stack::start(PASS_THROUGH).await;
    let mut config = support::config(stack.upstream.addr, PASS_THROUGH);
    config.server.listen = stack.gateway.public_addr.to_string();
    match idemgate_gateway::gateway::start_for_tests(config).await {
        Err(e @ idemgate_gateway::gateway::StartError::Bind { .. }) => {
            assert!(e.to_string().contains("server.listen"), "{e}");
        }
        Err(other) => panic!("expected a bind error, got {other}"),
        Ok(_) => panic!("two gateways shared one port"),
    }
    // The running one is unaffected.
    assert_eq!(stack.http.get(&stack.url("/echo")).await.status, 200);
    stack.shutdown().await;
}

#[tokio::test]
async fn a_burst_of_connections_is_spread_evenly_over_the_workers() {
    let stack = Stack::start_with(PASS_THROUGH, |c| c.server.worker_threads = 2).await;
    let addr = stack.gateway.public_addr;
    // 40 keep-alive connections opened at once, each answered once and held
    // open: whichever worker wakes first accepts, and the balance hands
    // connections on until both serve about half.
    let mut held = Vec::new();
    let mut opening = Vec::new();
    for _ in 0..40 {
        opening.push(tokio::spawn(served_connection(addr)));
    }
    for conn in opening {
        held.push(conn.await.unwrap());
    }
    let text =
        String::from_utf8(stack.http.get(&stack.admin("/metrics")).await.body.to_vec()).unwrap();
    let open: Vec<usize> = (0..2)
        .map(|w| {
            let series = format!("idemgate_worker_connections{{worker=\"{w}\"}} ");
            let line = text
                .lines()
                .find(|l| l.starts_with(&series))
                .expect(&series);
            line[series.len()..].parse().unwrap()
        })
        .collect();
    // The admin client's own connection is not on the public listener.
    assert_eq!(open.iter().sum::<usize>(), 40, "{open:?}");
    assert!(open[0].abs_diff(open[1]) <= 2, "{open:?}");
    drop(held);
    stack.shutdown().await;
}
