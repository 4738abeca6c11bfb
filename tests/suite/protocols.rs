//! HTTP/2 and TLS on both sides (docs/semantics.md, "What is forwarded upstream"), with real
//! certificates generated per test and real TLS handshakes.
//!
//! Every execution count is taken on the demo's `/actions/{name}`, which
//! executes on every call: a duplicate that slipped through shows.

use crate::support;

use std::time::Duration;

use idemgate_demo_upstream as demo_upstream;
use idemgate_gateway::config::Config;
use support::tls::Pki;
use support::{Http, Stack, executions};

const ACTIONS: &str = r#"
    [[routes]]
    name = "act"
    methods = ["POST"]
    path_prefix = "/actions/"
    upstream = "demo"
    idempotency = "key"
    on_concurrent = "wait"

    [[routes]]
    name = "stats"
    methods = ["GET"]
    path = "/stats"
    upstream = "demo"

    [[routes]]
    name = "echo"
    methods = ["GET"]
    path = "/echo"
    upstream = "demo"
"#;

fn key(k: &str) -> [(&str, &str); 2] {
    [("idempotency-key", k), ("content-type", "application/json")]
}

/// A gateway with TLS on its listener, in front of a plain demo upstream.
async fn tls_stack(pki: &Pki) -> Stack {
    Stack::start_with(ACTIONS, |c| {
        c.server.tls = Some(idemgate_gateway::config::ServerTlsConfig {
            cert: pki.server_cert.display().to_string(),
            key: pki.server_key.display().to_string(),
        });
    })
    .await
}

#[tokio::test]
async fn the_tls_listener_speaks_h2_and_http1_by_alpn_and_executes_once() {
    let pki = Pki::generate();
    let stack = tls_stack(&pki).await;
    let addr = stack.gateway.public_addr;

    let mut h2 = pki
        .client(&[b"h2", b"http/1.1"])
        .connect(addr)
        .await
        .unwrap();
    assert_eq!(h2.version(), http::Version::HTTP_2, "ALPN picked h2");
    let first = h2.send("POST", "/actions/pay", &key("tls-1"), "{}").await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(first.header("idempotent-replayed").is_none());

    let mut h1 = pki.client(&[b"http/1.1"]).connect(addr).await.unwrap();
    assert_eq!(h1.version(), http::Version::HTTP_11);
    let again = h1.send("POST", "/actions/pay", &key("tls-1"), "{}").await;
    assert_eq!(again.status, 201);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        again.body, first.body,
        "the same stored answer on both protocols"
    );
    let replay_h2 = h2.send("POST", "/actions/pay", &key("tls-1"), "{}").await;
    assert_eq!(replay_h2.header("idempotent-replayed"), Some("true"));
    assert_eq!(executions(&stack, "pay"), 1);

    // The upstream is told the client came over TLS, on both protocols.
    for conn in [&mut h2, &mut h1] {
        let echo = conn.send("GET", "/echo", &[], "").await.json();
        assert_eq!(echo["headers"]["x-forwarded-proto"][0], "https", "{echo}");
        assert_eq!(
            echo["headers"]["x-forwarded-host"][0], "localhost",
            "{echo}"
        );
    }

    // A plain-text client on the TLS port gets no answer at all.
    let plain = Http::http1()
        .try_send("GET", &stack.url("/stats"), &[], "")
        .await;
    assert!(plain.is_err(), "plain HTTP on the TLS port: {plain:?}");
    stack.shutdown().await;
}

#[tokio::test]
async fn a_storm_on_one_h2_connection_is_a_storm_with_one_execution() {
    let stack = Stack::start(ACTIONS).await;
    let h2 = Http::h2c();
    // Warm the connection, so every request below is a stream of it.
    assert_eq!(h2.get(&stack.url("/stats")).await.status, 200);
    let answers = support::concurrent_posts(
        &h2,
        300,
        |_| stack.url("/actions/storm"),
        |_| support::pairs(&[("idempotency-key", "storm-1")]),
        "{}",
    )
    .await;
    let statuses: std::collections::BTreeMap<u16, usize> =
        answers.iter().fold(Default::default(), |mut m, a| {
            *m.entry(a.status.as_u16()).or_default() += 1;
            m
        });
    assert_eq!(statuses.get(&201), Some(&300), "{statuses:?}");
    let bodies: std::collections::BTreeSet<_> = answers.iter().map(|a| a.body.clone()).collect();
    assert_eq!(bodies.len(), 1, "every stream shares the first result");
    assert_eq!(executions(&stack, "storm"), 1);

    // Distinct keys on the same connection are distinct requests.
    let answers = support::concurrent_posts(
        &h2,
        200,
        |_| stack.url("/actions/many"),
        |i| vec![("idempotency-key".into(), format!("many-{i}"))],
        "{}",
    )
    .await;
    assert!(answers.iter().all(|a| a.status == 201));
    assert_eq!(executions(&stack, "many"), 200);
    stack.shutdown().await;
}

/// A demo upstream behind TLS, and a gateway reaching it over `https://`.
async fn https_pair(
    pki: &Pki,
    upstream_tls: std::sync::Arc<rustls::ServerConfig>,
    tweak: impl FnOnce(&mut idemgate_gateway::config::UpstreamConfig),
    database_url: Option<String>,
) -> Stack {
    let upstream = demo_upstream::start_with_tls("127.0.0.1:0", Some(upstream_tls))
        .await
        .unwrap();
    let mut config = support::config(upstream.addr, ACTIONS);
    let u = &mut config.upstreams[0];
    u.url = format!("https://localhost:{}", upstream.addr.port());
    u.ca_file = Some(pki.ca.display().to_string());
    tweak(u);
    if let Some(url) = database_url {
        config.store.database_url = url;
    }
    let gateway = idemgate_gateway::gateway::start_for_tests(config)
        .await
        .unwrap();
    Stack {
        upstream,
        gateway,
        http: Http::default(),
    }
}

#[tokio::test]
async fn an_https_upstream_is_verified_against_ca_file_and_executes_once() {
    let pki = Pki::generate();
    let stack = https_pair(
        &pki,
        pki.upstream_config(false, false, &[b"http/1.1"]),
        |_| {},
        None,
    )
    .await;
    let first = stack
        .http
        .send("POST", &stack.url("/actions/charge"), &key("https-1"), "{}")
        .await;
    assert_eq!(first.status, 201, "{first:?}");
    let again = stack
        .http
        .send("POST", &stack.url("/actions/charge"), &key("https-1"), "{}")
        .await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(executions(&stack, "charge"), 1);
    // Pass-through rides the same verified connections.
    for _ in 0..5 {
        assert_eq!(stack.http.get(&stack.url("/stats")).await.status, 200);
    }
    stack.shutdown().await;
}

#[tokio::test]
async fn an_untrusted_upstream_certificate_is_502_upstream_tls_and_releases_the_claim() {
    let pki = Pki::generate();
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}/records.db", dir.path().display());
    let rogue = https_pair(
        &pki,
        pki.upstream_config(true, false, &[b"http/1.1"]),
        |_| {},
        Some(db.clone()),
    )
    .await;
    for attempt in 0..3 {
        let refused = rogue
            .http
            .send("POST", &rogue.url("/actions/refund"), &key("tls-rel"), "{}")
            .await;
        assert_eq!(refused.status, 502, "attempt {attempt}: {refused:?}");
        assert_eq!(
            refused.problem_type(),
            "urn:idemgate:problem:upstream-tls",
            "attempt {attempt}"
        );
    }
    assert_eq!(
        rogue.upstream.state.stats().requests,
        0,
        "nothing reached it"
    );
    rogue.shutdown().await;

    // The same key, on the same records, against a trusted upstream: it
    // executes, so the refused attempts left no claim and no "uncertain".
    let trusted = https_pair(
        &pki,
        pki.upstream_config(false, false, &[b"http/1.1"]),
        |_| {},
        Some(db),
    )
    .await;
    let done = trusted
        .http
        .send(
            "POST",
            &trusted.url("/actions/refund"),
            &key("tls-rel"),
            "{}",
        )
        .await;
    assert_eq!(done.status, 201, "{done:?}");
    assert!(done.header("idempotent-replayed").is_none());
    assert_eq!(executions(&trusted, "refund"), 1);
    trusted.shutdown().await;
}

#[tokio::test]
async fn mutual_tls_presents_the_client_certificate() {
    let pki = Pki::generate();
    let with_cert = https_pair(
        &pki,
        pki.upstream_config(false, true, &[b"http/1.1"]),
        |u| {
            u.client_cert = Some(pki.client_cert.display().to_string());
            u.client_key = Some(pki.client_key.display().to_string());
        },
        None,
    )
    .await;
    let ok = with_cert
        .http
        .send(
            "POST",
            &with_cert.url("/actions/mtls"),
            &key("mtls-1"),
            "{}",
        )
        .await;
    assert_eq!(ok.status, 201, "{ok:?}");
    assert_eq!(executions(&with_cert, "mtls"), 1);
    with_cert.shutdown().await;

    let without = https_pair(
        &pki,
        pki.upstream_config(false, true, &[b"http/1.1"]),
        |_| {},
        None,
    )
    .await;
    let refused = without
        .http
        .send("POST", &without.url("/actions/mtls"), &key("mtls-2"), "{}")
        .await;
    assert_eq!(refused.status, 502, "{refused:?}");
    // Over TLS 1.3 the refusal arrives after the client's handshake ended,
    // as an alert on the first read: still "nothing was sent", so the claim
    // is released (a retry is refused the same way, never "uncertain").
    assert_eq!(refused.problem_type(), "urn:idemgate:problem:upstream-tls");
    let again = without
        .http
        .send("POST", &without.url("/actions/mtls"), &key("mtls-2"), "{}")
        .await;
    assert_eq!(
        again.problem_type(),
        "urn:idemgate:problem:upstream-tls",
        "{again:?}"
    );
    assert_eq!(
        executions(&without, "mtls"),
        0,
        "no certificate, no execution"
    );
    without.shutdown().await;
}

#[tokio::test]
async fn http2_upstreams_over_tls_alpn_and_prior_knowledge() {
    let pki = Pki::generate();
    let tls = https_pair(
        &pki,
        pki.upstream_config(false, false, &[b"h2"]),
        |u| u.http2 = true,
        None,
    )
    .await;
    for _ in 0..2 {
        let answer = tls
            .http
            .send("POST", &tls.url("/actions/h2tls"), &key("h2-tls"), "{}")
            .await;
        assert_eq!(answer.status, 201, "{answer:?}");
    }
    assert_eq!(executions(&tls, "h2tls"), 1);
    let stats = tls.upstream.state.stats();
    assert_eq!(
        stats.http2_requests, stats.requests,
        "every request over h2"
    );
    tls.shutdown().await;

    // An upstream that ignores the h2 offer is refused before anything is
    // sent, never spoken to in a protocol it did not agree to.
    let http1_only = https_pair(
        &pki,
        pki.upstream_config(false, false, &[]),
        |u| u.http2 = true,
        None,
    )
    .await;
    let refused = http1_only
        .http
        .send(
            "POST",
            &http1_only.url("/actions/h2no"),
            &key("h2-no"),
            "{}",
        )
        .await;
    assert_eq!(refused.status, 502, "{refused:?}");
    assert_eq!(refused.problem_type(), "urn:idemgate:problem:upstream-tls");
    assert_eq!(http1_only.upstream.state.stats().requests, 0);
    http1_only.shutdown().await;

    let plain = Stack::start_with(ACTIONS, |c| c.upstreams[0].http2 = true).await;
    let answers = support::concurrent_posts(
        &plain.http,
        50,
        |_| plain.url("/actions/h2c"),
        |i| vec![("idempotency-key".into(), format!("h2c-{}", i % 10))],
        "{}",
    )
    .await;
    assert!(answers.iter().all(|a| a.status == 201), "{answers:?}");
    assert_eq!(executions(&plain, "h2c"), 10);
    let stats = plain.upstream.state.stats();
    assert!(stats.requests > 0);
    assert_eq!(stats.http2_requests, stats.requests, "prior knowledge h2c");
    plain.shutdown().await;
}

#[test]
fn a_connection_cap_on_an_http2_upstream_is_refused_naming_the_key() {
    let text = r#"
        [[upstreams]]
        name = "u"
        url = "http://127.0.0.1:1"
        http2 = true
        max_connections = 8
        [[routes]]
        name = "r"
        path_prefix = "/"
        upstream = "u"
    "#;
    let config = Config::parse(text, "t.toml").unwrap();
    let problems = config.validate("t.toml").unwrap_err();
    let keys: Vec<String> = problems.problems().iter().map(|p| p.key.clone()).collect();
    assert_eq!(keys, ["upstreams[0].max_connections"]);
    let plain = text.replace("http2 = true", "http2 = false");
    Config::parse(&plain, "t.toml")
        .unwrap()
        .validate("t.toml")
        .expect("an HTTP/1.1 upstream may be capped");
}

#[test]
fn tls_files_are_checked_at_start_up_naming_the_key() {
    let pki = Pki::generate();
    let check = |extra: &str| {
        let text = format!(
            r#"
            {extra}
            [[routes]]
            name = "r"
            path_prefix = "/"
            upstream = "u"
            "#
        );
        let config = Config::parse(&text, "t.toml").unwrap();
        config
            .validate("t.toml")
            .err()
            .map(|e| {
                e.problems()
                    .iter()
                    .map(|p| format!("{}: {}", p.key, p.reason))
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .unwrap_or_default()
    };
    let upstream =
        |url: &str, more: &str| format!("[[upstreams]]\nname = \"u\"\nurl = \"{url}\"\n{more}\n");
    let good = upstream("http://127.0.0.1:1", "");

    let missing = check(&format!(
        "[server.tls]\ncert = \"/nonexistent/gw.pem\"\nkey = \"{}\"\n{good}",
        pki.server_key.display()
    ));
    assert!(missing.starts_with("server.tls.cert:"), "{missing}");
    let mismatched = check(&format!(
        "[server.tls]\ncert = \"{}\"\nkey = \"{}\"\n{good}",
        pki.server_cert.display(),
        pki.client_key.display()
    ));
    assert!(mismatched.starts_with("server.tls.key:"), "{mismatched}");
    let not_pem = check(&format!(
        "[server.tls]\ncert = \"{}\"\nkey = \"{}\"\n{good}",
        pki.server_key.display(),
        pki.server_key.display()
    ));
    assert!(not_pem.starts_with("server.tls.cert:"), "{not_pem}");
    let fine = check(&format!(
        "[server.tls]\ncert = \"{}\"\nkey = \"{}\"\n{good}",
        pki.server_cert.display(),
        pki.server_key.display()
    ));
    assert_eq!(fine, "");

    let ca = check(&upstream(
        "https://localhost:1",
        "ca_file = \"/nonexistent/ca.pem\"",
    ));
    assert!(ca.starts_with("upstreams[0].ca_file:"), "{ca}");
    let half = check(&upstream(
        "https://localhost:1",
        &format!("client_cert = \"{}\"", pki.client_cert.display()),
    ));
    assert!(half.starts_with("upstreams[0].client_cert:"), "{half}");
    let plain_with_ca = check(&upstream(
        "http://localhost:1",
        &format!("ca_file = \"{}\"", pki.ca.display()),
    ));
    assert!(
        plain_with_ca.starts_with("upstreams[0].ca_file:"),
        "{plain_with_ca}"
    );
    let ftp = check(&upstream("ftp://localhost:1", ""));
    assert!(ftp.starts_with("upstreams[0].url:"), "{ftp}");
}

#[tokio::test]
async fn a_rapid_reset_flood_does_not_take_the_gateway_down() {
    let stack = Stack::start(ACTIONS).await;
    let tcp = tokio::net::TcpStream::connect(stack.gateway.public_addr)
        .await
        .unwrap();
    let (send, connection) = h2::client::handshake(tcp).await.unwrap();
    let driver = tokio::spawn(connection);
    // Open and at once cancel streams, as fast as the connection allows
    // (CVE-2023-44487). A reset stream's work is cancelled (hyper drops
    // its service future) and h2 closes a connection that piles up resets
    // faster than they are accepted; either way, everyone else is served
    // while it goes on.
    let mut opened = 0u32;
    let flood = async {
        let mut send = send;
        for _ in 0..20_000 {
            send = match send.ready().await {
                Ok(send) => send,
                Err(_) => break,
            };
            let request = http::Request::get(stack.url("/stats")).body(()).unwrap();
            match send.send_request(request, true) {
                Ok((_, mut stream)) => {
                    stream.send_reset(h2::Reason::CANCEL);
                    opened += 1;
                }
                Err(_) => break,
            }
            if opened.is_multiple_of(64) {
                tokio::task::yield_now().await;
            }
        }
    };
    let probe = async {
        let http = Http::http1();
        let mut served = 0;
        for _ in 0..20 {
            let answer =
                tokio::time::timeout(Duration::from_secs(5), http.get(&stack.url("/stats")))
                    .await
                    .expect("a bystander is answered during the flood");
            assert_eq!(answer.status, 200);
            served += 1;
        }
        served
    };
    let (flooded, served) =
        tokio::join!(tokio::time::timeout(Duration::from_secs(60), flood), probe);
    flooded.expect("the flood ends");
    assert_eq!(served, 20);
    let _ = tokio::time::timeout(Duration::from_secs(10), driver).await;
    assert!(opened > 0);
    // Everyone else is still served, on both protocols.
    assert_eq!(Http::http1().get(&stack.url("/stats")).await.status, 200);
    assert_eq!(Http::h2c().get(&stack.url("/stats")).await.status, 200);
    let answer = Http::h2c()
        .send(
            "POST",
            &stack.url("/actions/after"),
            &key("after-flood"),
            "{}",
        )
        .await;
    assert_eq!(answer.status, 201);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_stream_reset_mid_request_does_not_cancel_the_outcome() {
    let stack = Stack::start(ACTIONS).await;
    let tcp = tokio::net::TcpStream::connect(stack.gateway.public_addr)
        .await
        .unwrap();
    let (send, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let mut send = send.ready().await.unwrap();
    let request = http::Request::post(stack.url("/actions/reset"))
        .header("idempotency-key", "reset-1")
        .header("x-demo-delay-ms", "800")
        .body(())
        .unwrap();
    let (_, mut stream) = send.send_request(request, false).unwrap();
    stream
        .send_data(bytes::Bytes::from_static(b"{}"), true)
        .unwrap();
    // The upstream is working on it when the client gives up on the stream.
    let reached = support::eventually(Duration::from_secs(5), || async {
        stack.upstream.state.stats().requests == 1
    })
    .await;
    assert!(reached, "the request reached the upstream");
    stream.send_reset(h2::Reason::CANCEL);

    // The claim outlived its stream: a retry (this route waits for a
    // running first request) gets the one outcome, executed once.
    let retry = Http::h2c()
        .send(
            "POST",
            &stack.url("/actions/reset"),
            &[("idempotency-key", "reset-1")],
            "{}",
        )
        .await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(executions(&stack, "reset"), 1);
    stack.shutdown().await;
}

#[tokio::test]
async fn silent_and_half_preface_connections_are_closed_and_h2_keeps_the_limits() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let stack = Stack::start_with(ACTIONS, |c| {
        c.server.header_read_timeout = "1s".into();
        c.server.max_body_bytes = 1024;
    })
    .await;
    for opening in [&b""[..], b"PRI * HTTP/2.0\r\n"] {
        let mut conn = tokio::net::TcpStream::connect(stack.gateway.public_addr)
            .await
            .unwrap();
        conn.write_all(opening).await.unwrap();
        let mut rest = Vec::new();
        let closed =
            tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut rest)).await;
        assert!(
            matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
            "{opening:?}: the gateway closes a connection that does not speak ({closed:?})"
        );
    }
    // Over h2 as over HTTP/1.1: a body over the limit is 413, not forwarded.
    let h2 = Http::h2c();
    let big = h2
        .send(
            "POST",
            &stack.url("/actions/big"),
            &[("idempotency-key", "big-1")],
            vec![b'x'; 4096],
        )
        .await;
    assert_eq!(big.status, 413, "{big:?}");
    // Headers past the HTTP/2 header list limit are refused before routing.
    let huge = "v".repeat(70 * 1024);
    let refused = h2
        .try_send(
            "POST",
            &stack.url("/actions/huge"),
            &[("idempotency-key", "huge-1"), ("x-huge", &huge)],
            "{}",
        )
        .await;
    assert!(
        refused.as_ref().map_or(true, |a| a.status == 431),
        "{:?}",
        refused.map(|a| a.status)
    );
    assert_eq!(
        stack.upstream.state.stats().requests,
        0,
        "nothing was forwarded"
    );
    assert_eq!(h2.get(&stack.url("/stats")).await.status, 200);
    stack.shutdown().await;
}

#[tokio::test]
async fn an_idle_h2_connection_is_closed_and_a_slow_stream_is_not() {
    // Idle after 1 s; the upstream's timeout is 2 s.
    let stack = Stack::start_with(ACTIONS, |c| c.server.header_read_timeout = "1s".into()).await;
    let tcp = tokio::net::TcpStream::connect(stack.gateway.public_addr)
        .await
        .unwrap();
    let (send, connection) = h2::client::handshake(tcp).await.unwrap();
    let connection = tokio::spawn(connection);
    // A request slower than the idle timeout is answered: busy is not idle.
    let mut send = send.ready().await.unwrap();
    let request = http::Request::post(stack.url("/actions/slow-h2"))
        .header("idempotency-key", "slow-1")
        .header("x-demo-delay-ms", "1500")
        .body(())
        .unwrap();
    let (answer, mut stream) = send.send_request(request, false).unwrap();
    stream
        .send_data(bytes::Bytes::from_static(b"{}"), true)
        .unwrap();
    let answer = answer.await.expect("the slow stream was answered");
    assert_eq!(answer.status(), 201);
    drop(send);
    // Then nothing: the gateway says GOAWAY and the connection ends.
    let started = tokio::time::Instant::now();
    let ended = tokio::time::timeout(Duration::from_secs(6), connection).await;
    assert!(ended.is_ok(), "an idle h2 connection stayed open");
    assert!(
        started.elapsed() >= Duration::from_millis(700),
        "closed before it was idle for the timeout: {:?}",
        started.elapsed()
    );
    assert_eq!(executions(&stack, "slow-h2"), 1);
    stack.shutdown().await;
}

#[tokio::test]
async fn an_h2_stream_still_sending_its_body_keeps_the_connection_busy() {
    // Idle after 1 s; a pass-through answer whose body stalls 1.5 s.
    let stack = Stack::start_with(support::PASS_THROUGH, |c| {
        c.server.header_read_timeout = "1s".into()
    })
    .await;
    let tcp = tokio::net::TcpStream::connect(stack.gateway.public_addr)
        .await
        .unwrap();
    let (send, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let mut send = send.ready().await.unwrap();
    let request = http::Request::get(stack.url("/echo"))
        .header("x-demo-stall-body-ms", "1500")
        .body(())
        .unwrap();
    let (answer, _) = send.send_request(request, true).unwrap();
    let answer = answer.await.unwrap();
    assert_eq!(answer.status(), 200);
    // Past the idle timeout while the body is still coming: the connection
    // is busy, so a second request on it is served.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let mut send = send.ready().await.expect("the busy connection was closed");
    let second = http::Request::get(stack.url("/echo")).body(()).unwrap();
    let (second, _) = send
        .send_request(second, true)
        .expect("the busy connection refused a new stream");
    assert_eq!(second.await.unwrap().status(), 200);
    let mut body = answer.into_body();
    while let Some(chunk) = body.data().await {
        chunk.unwrap();
    }
    stack.shutdown().await;
}
