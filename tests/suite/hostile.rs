//! Hostile input, sent as raw bytes: request smuggling framings, slow
//! clients, endless bodies, header injection. Oracle: the demo upstream's
//! own counters — a smuggled request never executes.

use crate::support;

use std::time::{Duration, Instant};

use support::Stack;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const ROUTES: &str = r#"
    [[routes]]
    name = "pass"
    methods = ["GET"]
    path_prefix = "/"
    upstream = "demo"

    [[routes]]
    name = "act"
    methods = ["POST"]
    path_prefix = "/actions/"
    upstream = "demo"
    idempotency = "key"
"#;

const PASS_ROUTES: &str = r#"
    [[routes]]
    name = "pass"
    path_prefix = "/"
    upstream = "demo"
"#;

/// Sends raw bytes; returns what came back before the connection closed
/// (or the timeout passed).
async fn raw(stack: &Stack, bytes: &[u8], wait: Duration) -> String {
    let mut conn = TcpStream::connect(stack.gateway.public_addr).await.unwrap();
    let _ = conn.write_all(bytes).await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(wait, conn.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

const SMUGGLED: &str =
    "0\r\n\r\nPOST /actions/smuggled HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n";

#[tokio::test]
async fn smuggling_framings_are_refused_and_nothing_smuggled_executes() {
    for routes in [PASS_ROUTES, ROUTES] {
        let stack = Stack::start(routes).await;
        let cases = [
            (
                "content-length plus transfer-encoding",
                format!(
                    "POST /actions/front HTTP/1.1\r\nhost: x\r\nidempotency-key: k1\r\ncontent-length: 6\r\ntransfer-encoding: chunked\r\n\r\n{SMUGGLED}"
                ),
            ),
            (
                "two content-lengths",
                format!(
                    "POST /actions/front HTTP/1.1\r\nhost: x\r\nidempotency-key: k2\r\ncontent-length: 0\r\ncontent-length: {}\r\n\r\n{SMUGGLED}",
                    SMUGGLED.len()
                ),
            ),
            (
                "obfuscated transfer-encoding",
                format!(
                    "POST /actions/front HTTP/1.1\r\nhost: x\r\nidempotency-key: k3\r\ntransfer-encoding: xchunked\r\n\r\n{SMUGGLED}"
                ),
            ),
            (
                "transfer-encoding list",
                format!(
                    "POST /actions/front HTTP/1.1\r\nhost: x\r\nidempotency-key: k4\r\ntransfer-encoding: chunked, identity\r\n\r\n{SMUGGLED}"
                ),
            ),
            (
                "space before colon",
                format!(
                    "POST /actions/front HTTP/1.1\r\nhost: x\r\nidempotency-key: k5\r\ntransfer-encoding : chunked\r\ncontent-length: 6\r\n\r\n{SMUGGLED}"
                ),
            ),
        ];
        for (what, request) in cases {
            let answer = raw(&stack, request.as_bytes(), Duration::from_secs(3)).await;
            let status = answer.split(' ').nth(1).unwrap_or("closed");
            {
                use std::io::Write as _;
                let _ = writeln!(std::io::stderr(), "smuggling: {what}: {status}");
            }
            // hyper resolves Content-Length + Transfer-Encoding as RFC 9112
            // §6.3 allows: chunked wins, Content-Length is dropped, and the
            // connection is closed after the answer. Every other framing is
            // refused.
            let one_request_then_close = what.starts_with("content-length plus");
            assert!(
                answer.is_empty()
                    || answer.starts_with("HTTP/1.1 400")
                    || (one_request_then_close && answer.starts_with("HTTP/1.1 201")),
                "{what}: unexpected answer {status}: {answer}"
            );
            // Exactly one answer: nothing after the refused request was
            // read as a request of its own.
            assert!(answer.matches("HTTP/1.1").count() <= 1, "{what}: {answer}");
            assert_eq!(
                stack.upstream.state.executions("smuggled", "-"),
                0,
                "{what}: a smuggled request executed"
            );
        }
        // At most the one well-formed request (the CL+TE case) reached the
        // upstream, with its body as the gateway decoded it.
        assert!(stack.upstream.state.stats().requests <= 1);
        stack.shutdown().await;
    }
}

#[tokio::test]
async fn slow_headers_and_slow_bodies_are_cut_off() {
    let stack = Stack::start_with(ROUTES, |c| {
        c.server.header_read_timeout = "1s".into();
        c.server.body_read_timeout = "700ms".into();
    })
    .await;
    // Headers, a byte every 300 ms.
    let mut conn = TcpStream::connect(stack.gateway.public_addr).await.unwrap();
    let started = Instant::now();
    let head = b"GET /echo HTTP/1.1\r\nhost: x\r\nx-slow: aaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    let mut cut = false;
    for byte in head {
        if conn.write_all(&[*byte]).await.is_err() {
            cut = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        if started.elapsed() > Duration::from_secs(4) {
            break;
        }
    }
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), conn.read_to_end(&mut out)).await;
    let text = String::from_utf8_lossy(&out);
    assert!(cut || text.is_empty() || text.contains("408"), "{text}");
    assert!(started.elapsed() < Duration::from_secs(5));

    // A protected route's body, a byte every 300 ms: 408, nothing stored.
    let mut conn = TcpStream::connect(stack.gateway.public_addr).await.unwrap();
    conn.write_all(b"POST /actions/slow HTTP/1.1\r\nhost: x\r\nidempotency-key: slow\r\ncontent-length: 20\r\n\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    let reader = tokio::spawn(async move {
        let mut buf = vec![0; 4096];
        let mut text = String::new();
        for _ in 0..20 {
            if conn.write_all(b"x").await.is_err() {
                break;
            }
            if let Ok(Ok(n)) =
                tokio::time::timeout(Duration::from_millis(300), conn.read(&mut buf)).await
            {
                text.push_str(&String::from_utf8_lossy(&buf[..n]));
                if n == 0 || text.contains("\r\n\r\n") {
                    break;
                }
            }
        }
        text
    });
    let text = reader.await.unwrap();
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("body-timeout"), "{text}");
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(
        stack
            .gateway
            .store
            .find("act", "slow")
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(stack.upstream.state.executions("slow", "-"), 0);
    stack.shutdown().await;
}

#[tokio::test]
async fn an_endless_chunked_body_hits_the_limit() {
    for (routes, path, key) in [
        (PASS_ROUTES, "/actions/endless", ""),
        (ROUTES, "/actions/endless", "idempotency-key: e\r\n"),
    ] {
        let stack = Stack::start_with(routes, |c| c.server.max_body_bytes = 64 * 1024).await;
        let mut conn = TcpStream::connect(stack.gateway.public_addr).await.unwrap();
        conn.write_all(
            format!("POST {path} HTTP/1.1\r\nhost: x\r\n{key}transfer-encoding: chunked\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
        let chunk = format!("1000\r\n{}\r\n", "y".repeat(4096));
        let started = Instant::now();
        let mut sent = 0usize;
        // Keep sending until the gateway answers or stops reading; bounded.
        while started.elapsed() < Duration::from_secs(5) && sent < 64 * 1024 * 1024 {
            match tokio::time::timeout(Duration::from_millis(200), conn.write_all(chunk.as_bytes()))
                .await
            {
                Ok(Ok(())) => sent += 4096,
                _ => break,
            }
        }
        let mut out = vec![0; 4096];
        let n = tokio::time::timeout(Duration::from_secs(2), conn.read(&mut out))
            .await
            .map(|r| r.unwrap_or(0))
            .unwrap_or(0);
        let text = String::from_utf8_lossy(&out[..n]);
        assert!(n == 0 || text.starts_with("HTTP/1.1 413"), "{text}");
        assert!(
            sent < 64 * 1024 * 1024,
            "the gateway kept reading an endless body"
        );
        assert_eq!(stack.upstream.state.executions("endless", "-"), 0);
        stack.shutdown().await;
    }
}

#[tokio::test]
async fn header_injection_and_bad_keys_are_400() {
    let stack = Stack::start(ROUTES).await;
    for (what, header) in [
        (
            "bare CR in key",
            &b"idempotency-key: a\rx-injected: 1\r\n"[..],
        ),
        ("NUL in key", b"idempotency-key: a\x00b\r\n"),
        ("non-ASCII key", b"idempotency-key: \xe2\x82\xac\r\n"),
        ("empty key", b"idempotency-key: \r\n"),
    ] {
        let mut request =
            b"POST /actions/inj HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\nconnection: close\r\n"
                .to_vec();
        request.extend_from_slice(header);
        request.extend_from_slice(b"\r\n");
        let answer = raw(&stack, &request, Duration::from_secs(3)).await;
        assert!(
            answer.is_empty() || answer.starts_with("HTTP/1.1 400"),
            "{what}: {answer}"
        );
    }
    assert_eq!(stack.upstream.state.stats().requests, 0);
    stack.shutdown().await;
}

#[tokio::test]
async fn keys_are_logged_by_prefix_and_hash_never_raw() {
    let upstream = idemgate_demo_upstream::start("127.0.0.1:0").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", support::dead_port());
    let config = dir.path().join("idemgate.toml");
    std::fs::write(
        &config,
        format!(
            r#"
            [server]
            listen = "{listen}"
            admin_listen = "127.0.0.1:0"
            [store]
            database_url = "sqlite://{}/records.db"
            [[upstreams]]
            name = "demo"
            url = "http://{}"
            [[routes]]
            name = "hook"
            methods = ["POST"]
            path = "/mq/push"
            upstream = "demo"
            kind = "callback"
            business_key = ["json:/id"]
            must_match = ["json:/n"]
            "#,
            dir.path().display(),
            upstream.addr
        ),
    )
    .unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["serve", "--config"])
        .arg(&config)
        .env("IDEMGATE_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let http = support::Http::default();
    let url = format!("http://{listen}/mq/push");
    support::wait_up(&http, &url).await;
    // A key that would forge a log line and recolour a terminal is not a
    // key at all: refused before anything is stored or logged raw.
    let evil = r#"{"id":"T1\nFAKE LOG LINE level=ERROR\u001b[31m","n":1}"#;
    let refused = http.send("POST", &url, &[], evil).await;
    assert_eq!(refused.status, 400);
    assert_eq!(
        refused.problem_type(),
        "urn:idemgate:problem:business-key-invalid"
    );
    // A plain key redelivered with another must_match field: logged as an
    // error, but the key never raw.
    let first = r#"{"id":"secret-key-123","n":1}"#;
    assert_eq!(http.send("POST", &url, &[], first).await.status, 200);
    let reused = r#"{"id":"secret-key-123","n":2}"#;
    assert_eq!(http.send("POST", &url, &[], reused).await.status, 422);
    child.kill().unwrap();
    let output = child.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(log.contains("must_match"), "{log}");
    assert!(
        log.contains("secr…#"),
        "the key is named by prefix and hash: {log}"
    );
    assert!(
        !log.contains("secret-key-123"),
        "a raw key reached the log: {log}"
    );
    assert!(
        !log.lines().any(|l| l.starts_with("FAKE LOG LINE")),
        "a raw newline reached the log"
    );
    assert!(
        !log.contains('\u{1b}'),
        "a raw escape sequence reached the log"
    );
    upstream.shutdown().await;
}

/// A pass-through route (GET, everything) and a protected route (POST,
/// `Idempotency-Key`) under `/echo`: the demo upstream's `/echo` endpoint
/// counts and echoes whatever reaches it.
const PATH_ROUTES: &str = r#"
    [[routes]]
    name = "pass"
    methods = ["GET"]
    path_prefix = "/"
    upstream = "demo"

    [[routes]]
    name = "key"
    methods = ["POST"]
    path_prefix = "/echo"
    upstream = "demo"
    idempotency = "key"
"#;

/// Paths that another component could read as a different path (docs/semantics.md
/// Always). All but the first live under `/echo`, so that any of them that
/// got through would reach a counting endpoint of the upstream.
const AMBIGUOUS_PATHS: &[&str] = &[
    "/pass/..;/orders",
    // `;` inside a segment, raw or encoded.
    "/echo/..;/orders",
    "/echo/..;x=1/orders",
    "/echo/.;/orders",
    "/echo/%2e%2e;/orders",
    "/echo/%2E%2E;/orders",
    "/echo/.%2e;/orders",
    "/echo/..%3b/orders",
    "/echo/..%3B/orders",
    "/echo/a;b",
    // Backslashes, raw or encoded.
    "/echo/..\\orders",
    "/echo\\..\\orders",
    "/echo/..%5corders",
    "/echo/%5C..%5Corders",
    // Double encoding.
    "/echo/%252e%252e/orders",
    "/echo/%252E%252E/orders",
    "/echo/%252f",
    // Encoded slashes.
    "/echo/..%2forders",
    "/echo/a%2Fb",
    // Dot segments in every encoding.
    "/echo/../orders",
    "/echo/./orders",
    "/echo/%2e%2e/orders",
    "/echo/%2E%2E/orders",
    "/echo/.%2e/orders",
    "/echo/%2e./orders",
    "/echo/%2e/orders",
    "/echo/%c0%ae%c0%ae/orders",
    "/echo/..",
    // Empty segments.
    "/echo//orders",
    "//echo",
];

#[tokio::test]
async fn ambiguous_paths_are_400_invalid_path_and_never_reach_the_upstream() {
    let stack = Stack::start(PATH_ROUTES).await;
    for (i, path) in AMBIGUOUS_PATHS.iter().enumerate() {
        // Raw bytes: the test client would refuse or normalise some of these.
        let requests = [
            (
                "pass-through",
                format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"),
            ),
            (
                "protected",
                format!(
                    "POST {path} HTTP/1.1\r\nhost: x\r\nidempotency-key: path-{i}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                ),
            ),
        ];
        for (route, request) in requests {
            let answer = raw(&stack, request.as_bytes(), Duration::from_secs(3)).await;
            assert!(
                answer.starts_with("HTTP/1.1 400"),
                "{route} {path:?}: {answer}"
            );
            assert!(
                answer.contains("application/problem+json"),
                "{route} {path:?}: {answer}"
            );
            assert!(
                answer.contains("urn:idemgate:problem:invalid-path"),
                "{route} {path:?}: {answer}"
            );
        }
        assert_eq!(
            stack.upstream.state.stats().requests,
            0,
            "{path:?} reached the upstream"
        );
        assert!(
            stack
                .gateway
                .store
                .find("key", &format!("path-{i}"))
                .await
                .unwrap()
                .is_empty(),
            "{path:?} left a record"
        );
    }

    // The same routes forward ordinary paths, dots inside names and
    // anything in the query, unchanged.
    for (path, query) in [
        ("/echo/a.b/c..d/...x", "q=../;%2f%5c%25//"),
        ("/echo/a%20b", "x=..%3b"),
    ] {
        let url = stack.url(&format!("{path}?{query}"));
        let a = stack.http.get(&url).await;
        assert_eq!(a.status, 200, "{path}?{query}");
        let echo = a.json();
        assert_eq!(echo["path"], path);
        assert_eq!(echo["query"], query);
    }
    let a = stack
        .http
        .send(
            "POST",
            &stack.url("/echo/ok%20x"),
            &[("idempotency-key", "path-ok")],
            "",
        )
        .await;
    assert_eq!(a.status, 200);
    assert_eq!(a.json()["path"], "/echo/ok%20x");
    assert_eq!(stack.upstream.state.stats().requests, 3);
    stack.shutdown().await;
}

#[tokio::test]
async fn a_client_connection_header_cannot_remove_what_the_gateway_sets() {
    let stack = Stack::start(PATH_ROUTES).await;
    // Protected route: the client names the gateway's own headers.
    let a = stack
        .http
        .send(
            "POST",
            &stack.url("/echo"),
            &[
                ("idempotency-key", "conn-1"),
                (
                    "connection",
                    "idempotency-key, x-request-id, x-forwarded-for",
                ),
                ("x-kept", "yes"),
            ],
            "{}",
        )
        .await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    let echo = a.json();
    let seen = &echo["headers"];
    let keys = seen["idempotency-key"]
        .as_array()
        .expect("no Idempotency-Key forwarded");
    assert_eq!(keys.len(), 1, "{seen}");
    let stable = keys[0].as_str().unwrap().to_owned();
    assert!(stable.starts_with("ig-"), "{seen}");
    let request_id = seen["x-request-id"][0]
        .as_str()
        .expect("no X-Request-Id forwarded");
    assert_eq!(a.header("x-request-id"), Some(request_id), "{seen}");
    assert_eq!(seen["x-forwarded-for"][0], "127.0.0.1", "{seen}");
    assert!(seen["x-forwarded-proto"][0].is_string(), "{seen}");
    assert_eq!(seen["x-kept"][0], "yes", "{seen}");

    // An ordinary header the client names is hop-by-hop: not forwarded.
    let a = stack
        .http
        .send(
            "POST",
            &stack.url("/echo"),
            &[
                ("idempotency-key", "conn-2"),
                ("connection", "x-secret"),
                ("x-secret", "1"),
                ("x-kept", "yes"),
            ],
            "{}",
        )
        .await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    let echo = a.json();
    let seen = &echo["headers"];
    assert!(seen.get("x-secret").is_none(), "{seen}");
    assert_eq!(seen["x-kept"][0], "yes", "{seen}");
    let other = seen["idempotency-key"][0].as_str().unwrap();
    assert!(other.starts_with("ig-") && other != stable, "{seen}");
    assert!(seen["x-request-id"][0].is_string(), "{seen}");

    // Pass-through route: the same rule, with the client's own request id
    // kept and its `Host` still reported as `X-Forwarded-Host`.
    let a = stack
        .http
        .send(
            "GET",
            &stack.url("/echo/pass"),
            &[
                ("host", "shop.example"),
                ("x-request-id", "client-rid"),
                (
                    "connection",
                    "x-request-id, x-forwarded-for, x-forwarded-host, x-forwarded-proto, x-secret",
                ),
                ("x-secret", "1"),
            ],
            "",
        )
        .await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    let echo = a.json();
    let seen = &echo["headers"];
    assert!(seen.get("x-secret").is_none(), "{seen}");
    assert_eq!(seen["x-request-id"][0], "client-rid", "{seen}");
    assert_eq!(seen["x-forwarded-for"][0], "127.0.0.1", "{seen}");
    assert_eq!(seen["x-forwarded-proto"][0], "http", "{seen}");
    assert_eq!(seen["x-forwarded-host"][0], "shop.example", "{seen}");
    stack.shutdown().await;
}
