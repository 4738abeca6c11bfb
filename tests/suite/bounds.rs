//! Bounded under abuse (docs/semantics.md, rule 10): every claim, buffered answer and
//! descriptor counts against a limit, and "never sent" means nothing was
//! sent. Real gateways, raw clients that hang up or reset, a gateway
//! process under a lowered descriptor limit, an HTTPS upstream that
//! corrupts a record after it executed.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use support::{Stack, eventually, executions};

const KEYS: &str = r#"
    [[routes]]
    name = "act"
    methods = ["POST"]
    path_prefix = "/actions/"
    upstream = "demo"
    idempotency = "key"
    on_concurrent = "wait"
"#;

/// One request on a raw connection, then hang up at once.
async fn hang_up(addr: std::net::SocketAddr, key: String, delay_ms: u64) {
    let Ok(mut socket) = tokio::net::TcpStream::connect(addr).await else {
        return;
    };
    let request = format!(
        "POST /actions/hangup HTTP/1.1\r\nHost: gw\r\nIdempotency-Key: {key}\r\n\
         X-Demo-Delay-Ms: {delay_ms}\r\nContent-Length: 2\r\n\r\n{{}}"
    );
    let _ = socket.write_all(request.as_bytes()).await;
}

fn metric(text: &str, series: &str) -> u64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no {series} in metrics"))
}

/// `server.max_connections = 4`, 300 clients that each send a request and
/// hang up: a claim that outlives its connection keeps the connection's
/// slot, so the upstream never has more than 4 at once (before: 300); the
/// clients past the cap are refused, and none of them runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_left_by_hung_up_clients_count_against_max_connections() {
    let stack = Stack::start_with(KEYS, |c| {
        c.server.max_connections = 4;
        c.server.worker_threads = 2;
    })
    .await;
    let addr = stack.gateway.public_addr;
    let storm = (0..300).map(|i| tokio::spawn(hang_up(addr, format!("h-{i}"), 300)));
    let storm: Vec<_> = storm.collect();
    for task in storm {
        task.await.unwrap();
    }
    // Every request that got a slot runs, four at a time; the rest were
    // answered 503 (or waited in the backlog past the refusals' reserve).
    let mut last = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let now = executions(&stack, "hangup");
        if now == last {
            break;
        }
        last = now;
    }
    assert!((4..=300).contains(&last), "{last} of 300 executed");
    let peak = stack.upstream.state.stats().peak_running;
    assert!(
        peak <= 4,
        "{peak} upstream requests at once with max_connections = 4"
    );
    stack.shutdown().await;
}

/// One request on a raw connection, read to its end: the status line and
/// the whole answer, or what arrived before the deadline.
async fn ask(addr: std::net::SocketAddr, key: &str, within: Duration) -> Option<String> {
    let mut socket = tokio::net::TcpStream::connect(addr).await.ok()?;
    let request = format!(
        "POST /actions/newcomer HTTP/1.1\r\nHost: gw\r\nIdempotency-Key: {key}\r\n\
         Content-Length: 2\r\n\r\n{{}}"
    );
    socket.write_all(request.as_bytes()).await.ok()?;
    let mut answer = Vec::new();
    let read = tokio::time::timeout(within, socket.read_to_end(&mut answer)).await;
    match read {
        Ok(_) => Some(String::from_utf8_lossy(&answer).into_owned()),
        Err(_) => None,
    }
}

/// Clients that hung up leave their claims running and fill
/// `max_connections` (descriptors to spare): a newcomer is answered at once
/// — `503 connections-exhausted`, `Retry-After`, problem+json, the
/// connection closed — not left unanswered in the backlog; nothing of it
/// ran. Once the claims finish, a newcomer is served. (Before: no answer
/// within 5 s.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_connection_cap_a_newcomer_is_refused_at_once() {
    let stack = Stack::start_with(KEYS, |c| {
        c.server.max_connections = 2;
        c.server.worker_threads = 1;
    })
    .await;
    let addr = stack.gateway.public_addr;
    // Two clients whose requests run 5 s hold both slots (they stay
    // connected; one that hangs up holds its slot by its claim alike).
    let mut held = Vec::new();
    for i in 0..2 {
        let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!(
            "POST /actions/hangup HTTP/1.1\r\nHost: gw\r\nIdempotency-Key: slow-{i}\r\n\
             X-Demo-Delay-Ms: 5000\r\nContent-Length: 2\r\n\r\n{{}}"
        );
        socket.write_all(request.as_bytes()).await.unwrap();
        held.push(socket);
    }
    support::reached(&stack.upstream, 2).await;
    // A 503 is the proof it was not kept waiting: a newcomer that waited
    // would be served (201) once the claims finish, 5 s from now.
    let answer = ask(addr, "new-1", Duration::from_secs(4))
        .await
        .expect("no answer while the claims run");
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    let lower = answer.to_ascii_lowercase();
    for expected in [
        "retry-after: 1",
        "content-type: application/problem+json",
        "connection: close",
        "urn:idemgate:problem:connections-exhausted",
    ] {
        assert!(lower.contains(expected), "{expected} in {answer}");
    }
    // Many at once are each answered too.
    let many: Vec<_> = (0..10)
        .map(|i| {
            let key = format!("new-{i}");
            tokio::spawn(async move { ask(addr, &key, Duration::from_secs(3)).await })
        })
        .collect();
    for answer in many {
        let answer = answer.await.unwrap().expect("answered");
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    }
    assert_eq!(executions(&stack, "newcomer"), 0, "nothing of theirs ran");
    // The claims finish (5 s): a newcomer is served.
    let served = eventually(Duration::from_secs(15), || async {
        ask(addr, "late-1", Duration::from_secs(5))
            .await
            .is_some_and(|a| a.starts_with("HTTP/1.1 201"))
    })
    .await;
    assert!(served);
    assert_eq!(executions(&stack, "hangup"), 2);
    drop(held);
    stack.shutdown().await;
}

/// One HTTP/2 connection opens streams and resets each 5 ms later, 600
/// times, each leaving a claim behind: its claims are bounded by its
/// stream limit, past it requests are refused and the connection gets
/// GOAWAY (before: 600 upstream requests in flight, no GOAWAY).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_flood_on_one_connection_is_bounded_by_its_stream_limit() {
    let stack = Stack::start(KEYS).await;
    let tcp = tokio::net::TcpStream::connect(stack.gateway.public_addr)
        .await
        .unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    let driver = tokio::spawn(connection);
    let mut refused = false;
    for i in 0..600 {
        let mut client = match client.clone().ready().await {
            Ok(client) => client,
            Err(_) => {
                refused = true;
                break;
            }
        };
        let request = http::Request::post("http://gw/actions/flood")
            .header("idempotency-key", format!("f-{i}"))
            .header("x-demo-delay-ms", "3000")
            .body(())
            .unwrap();
        match client.send_request(request, true) {
            Ok((response, _)) => {
                // Reset 5 ms later: the stream goes, its claim stays.
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(Duration::from_millis(5), response).await;
                });
            }
            Err(_) => {
                refused = true;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let closed = tokio::time::timeout(Duration::from_secs(10), driver).await;
    assert!(
        refused || closed.is_ok(),
        "the connection was neither refused new streams nor closed"
    );
    let peak = stack.upstream.state.stats().peak_running;
    assert!(
        peak <= idemgate_core::budget::CLAIMS_PER_CONNECTION as u64,
        "{peak} upstream requests in flight from one connection"
    );
    let metrics =
        String::from_utf8_lossy(&stack.http.get(&stack.admin("/metrics")).await.body).into_owned();
    assert!(
        metric(
            &metrics,
            "idemgate_claims_refused_total{limit=\"connection\"}"
        ) >= 1
    );
    stack.shutdown().await;
}

/// `server.max_claims = 10`: 50 requests at once with fresh keys, 10
/// forwarded, the rest `503 claims-exhausted` before anything was
/// recorded — their retries later execute normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_max_claims_a_request_is_refused_before_it_is_claimed() {
    let stack = Stack::start_with(KEYS, |c| c.server.max_claims = 10).await;
    let answers = support::concurrent_posts(
        &stack.http,
        50,
        |_| stack.url("/actions/budget"),
        |i| {
            support::pairs(&[
                ("idempotency-key", &format!("b-{i}")),
                ("x-demo-delay-ms", "500"),
            ])
        },
        "{}",
    )
    .await;
    let refused: Vec<usize> = answers
        .iter()
        .enumerate()
        .filter(|(_, a)| a.status == 503)
        .map(|(i, _)| i)
        .collect();
    assert!(refused.len() >= 40, "{} refused", refused.len());
    for i in &refused {
        let a = &answers[*i];
        assert_eq!(a.problem_type(), "urn:idemgate:problem:claims-exhausted");
        assert!(a.header("retry-after").is_some());
        let records = stack
            .gateway
            .store
            .find("act", &format!("b-{i}"))
            .await
            .unwrap();
        assert!(records.is_empty(), "a refused request left a record");
    }
    assert!(stack.upstream.state.stats().peak_running <= 10);
    // Once the first ten are done, a refused one goes through.
    let again = stack
        .http
        .send(
            "POST",
            &stack.url("/actions/budget"),
            &[("idempotency-key", &format!("b-{}", refused[0]))],
            "{}",
        )
        .await;
    assert_eq!(again.status, 201);
    assert_eq!(executions(&stack, "budget"), 50 - refused.len() as u64 + 1);
    stack.shutdown().await;
}

/// A replay this process holds in memory takes no claim: with
/// `server.max_claims = 1` taken by a slow request, 50 concurrent retries
/// of a finished key are all replayed (before: 49 or 50 of them `503
/// claims-exhausted`), while a new key is still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_held_in_memory_takes_no_claim() {
    let stack = Stack::start_with(KEYS, |c| c.server.max_claims = 1).await;
    let first = stack
        .http
        .send(
            "POST",
            &stack.url("/actions/memo"),
            &[("idempotency-key", "done-1")],
            "{}",
        )
        .await;
    assert_eq!(first.status, 201);
    let slow = {
        let (http, url) = (stack.http.clone(), stack.url("/actions/slow"));
        tokio::spawn(async move {
            http.send(
                "POST",
                &url,
                &[("idempotency-key", "slow-1"), ("x-demo-delay-ms", "1200")],
                "{}",
            )
            .await
        })
    };
    support::reached(&stack.upstream, 2).await;
    let answers = support::concurrent_posts(
        &stack.http,
        50,
        |_| stack.url("/actions/memo"),
        |_| support::pairs(&[("idempotency-key", "done-1")]),
        "{}",
    )
    .await;
    for answer in &answers {
        assert_eq!(answer.status, 201, "{:?}", answer.body);
        assert_eq!(answer.header("idempotent-replayed"), Some("true"));
        assert_eq!(answer.body, first.body);
    }
    let fresh = stack
        .http
        .send(
            "POST",
            &stack.url("/actions/memo"),
            &[("idempotency-key", "new-1")],
            "{}",
        )
        .await;
    assert_eq!(fresh.status, 503);
    assert_eq!(
        fresh.problem_type(),
        "urn:idemgate:problem:claims-exhausted"
    );
    assert_eq!(slow.await.unwrap().status, 201);
    assert_eq!(executions(&stack, "memo"), 1);
    stack.shutdown().await;
}

/// The in-process fast layer is bounded in bytes: 600 distinct keys with
/// one-megabyte answers leave it at most its budget, 64 MiB (before: all
/// 600, about 600 MiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_process_layer_holds_at_most_its_byte_budget() {
    let stack = Stack::start(KEYS).await;
    for wave in 0..30 {
        let answers = support::concurrent_posts(
            &stack.http,
            20,
            |_| stack.url("/actions/big"),
            |i| {
                support::pairs(&[
                    ("idempotency-key", &format!("big-{wave}-{i}")),
                    ("x-demo-response-bytes", "1000000"),
                ])
            },
            "{}",
        )
        .await;
        assert!(
            answers
                .iter()
                .all(|a| a.status == 201 && a.body.len() == 1_000_000)
        );
    }
    let metrics =
        String::from_utf8_lossy(&stack.http.get(&stack.admin("/metrics")).await.body).into_owned();
    let held = metric(&metrics, "idemgate_memory_layer_bytes");
    assert!(held <= 64 * 1024 * 1024, "{held} bytes held");
    assert!(
        held >= 8 * 1024 * 1024,
        "the layer keeps what fits ({held})"
    );
    // Evicted answers still replay, from SQL.
    let replay = stack
        .http
        .send(
            "POST",
            &stack.url("/actions/big"),
            &[
                ("idempotency-key", "big-0-0"),
                ("x-demo-response-bytes", "1000000"),
            ],
            "{}",
        )
        .await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body.len(), 1_000_000);
    assert_eq!(executions(&stack, "big"), 600);
    stack.shutdown().await;
}

/// A gateway under a descriptor limit of 256 (both soft and hard), 1,100
/// clients hanging up at it: it keeps serving — a client on its own
/// connection gets every answer — never runs out of descriptors, and says
/// why it lowered `max_connections` once, with the numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_descriptor_limit_the_gateway_keeps_serving() {
    let upstream = idemgate_demo_upstream::start("127.0.0.1:0").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", support::dead_port());
    let admin = format!("127.0.0.1:{}", support::dead_port());
    let config = dir.path().join("idemgate.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"{listen}\"\nadmin_listen = \"{admin}\"\nworker_threads = 2\n\
             [store]\ndatabase_url = \"sqlite://{}/r.db\"\n\
             [[upstreams]]\nname = \"demo\"\nurl = \"http://{}\"\ntimeout = \"5s\"\n{KEYS}",
            dir.path().display(),
            upstream.addr
        ),
    )
    .unwrap();
    let log = std::fs::File::create(dir.path().join("log")).unwrap();
    let mut gateway = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -n 256 && exec {} serve --config {}",
            env!("CARGO_BIN_EXE_idemgate"),
            config.display()
        ))
        .env("IDEMGATE_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let http = support::Http::http1();
    support::wait_up(&http, &format!("http://{admin}/healthz")).await;
    let addr: std::net::SocketAddr = listen.parse().unwrap();
    // A legitimate client on its own keep-alive connection.
    let legit = {
        let http = http.clone();
        let url = format!("http://{listen}/actions/legit");
        tokio::spawn(async move {
            let mut errors = Vec::new();
            for i in 0..60 {
                let key = format!("legit-{i}");
                match http
                    .try_send("POST", &url, &[("idempotency-key", &key)], "{}")
                    .await
                {
                    Ok(a) if a.status == 201 => {}
                    Ok(a) => {
                        errors.push(format!("{} {}", a.status, String::from_utf8_lossy(&a.body)))
                    }
                    Err(e) => errors.push(format!("{e:?}")),
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            errors
        })
    };
    let storm: Vec<_> = (0..1100)
        .map(|i| tokio::spawn(hang_up(addr, format!("fd-{i}"), 200)))
        .collect();
    for task in storm {
        task.await.unwrap();
    }
    let errors = legit.await.unwrap();
    assert!(
        errors.is_empty(),
        "the legitimate client saw errors: {errors:?}"
    );
    let metrics = String::from_utf8_lossy(&http.get(&format!("http://{admin}/metrics")).await.body)
        .into_owned();
    assert!(metric(&metrics, "idemgate_open_descriptors") < 256);
    assert_eq!(metric(&metrics, "idemgate_descriptor_limit"), 256);
    gateway.kill().unwrap();
    gateway.wait().unwrap();
    let log = std::fs::read_to_string(dir.path().join("log")).unwrap();
    assert!(
        log.contains("lowers server.max_connections"),
        "the lowered limit was not explained: {log}"
    );
    assert!(
        log.matches("Too many open files").count() <= 1,
        "EMFILE flooded the log: {log}"
    );
    upstream.shutdown().await;
}

/// An HTTPS upstream that executes, then writes a corrupt TLS record: the
/// request was sent, so the outcome is uncertain — the claim is not
/// released, and the duplicate waiting beside it is not forwarded (before:
/// "never sent", released, the duplicate forwarded: two executions).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_tls_record_after_the_request_left_is_uncertain() {
    let pki = support::tls::Pki::generate();
    let server = pki.upstream_config(false, false, &[b"http/1.1"]);
    let acceptor = tokio_rustls::TlsAcceptor::from(server);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_addr = listener.local_addr().unwrap();
    let executed = Arc::new(AtomicU64::new(0));
    let counted = executed.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let (acceptor, counted) = (acceptor.clone(), counted.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut buf = vec![0u8; 4096];
                let mut seen = Vec::new();
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    match tls.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
                // Executed; slow enough for a duplicate to wait beside it.
                counted.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(300)).await;
                // An application-data record that cannot decrypt.
                let tcp = tls.get_mut().0;
                let _ = tcp
                    .write_all(b"\x17\x03\x03\x00\x20this-record-will-never-decrypt!!")
                    .await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            });
        }
    });
    let stack = Stack::start_with(KEYS, |c| {
        c.upstreams[0].url = format!("https://localhost:{}", upstream_addr.port());
        c.upstreams[0].ca_file = Some(pki.ca.display().to_string());
    })
    .await;
    let first = {
        let (http, url) = (stack.http.clone(), stack.url("/actions/tls"));
        tokio::spawn(async move {
            http.send("POST", &url, &[("idempotency-key", "t-1")], "{}")
                .await
        })
    };
    let reached = eventually(Duration::from_secs(5), || async {
        executed.load(Ordering::SeqCst) == 1
    })
    .await;
    assert!(reached);
    let duplicate = stack
        .http
        .send(
            "POST",
            &stack.url("/actions/tls"),
            &[("idempotency-key", "t-1")],
            "{}",
        )
        .await;
    let first = first.await.unwrap();
    assert_eq!(first.status, 502, "{:?}", first.body);
    assert_eq!(first.problem_type(), "urn:idemgate:problem:upstream-broken");
    assert_eq!(duplicate.status, 502, "{:?}", duplicate.body);
    assert_eq!(
        duplicate.problem_type(),
        "urn:idemgate:problem:outcome-uncertain"
    );
    let record = stack.gateway.store.find("act", "t-1").await.unwrap();
    assert_eq!(record[0].state, idemgate_store::RecordState::Uncertain);
    assert_eq!(
        executed.load(Ordering::SeqCst),
        1,
        "forwarded beside the first copy"
    );
    stack.shutdown().await;
}

/// `server.max_buffered_bytes`: request bodies the protected routes hold
/// at once are counted; a body that would go past the budget is refused
/// `503 buffers-exhausted` at once, before any claim, and the bodies that
/// fit go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_request_bodies_count_against_a_byte_budget() {
    let stack = Stack::start_with(KEYS, |c| c.server.max_buffered_bytes = 2 * 1024 * 1024).await;
    let addr = stack.gateway.public_addr;
    let body = vec![b'x'; 900_000];
    // Three slow uploads: their heads arrive, their bodies wait.
    let mut sockets = Vec::new();
    for i in 0..3 {
        let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "POST /actions/upload HTTP/1.1\r\nHost: gw\r\nIdempotency-Key: up-{i}\r\n\
             Content-Length: {}\r\n\r\n",
            body.len()
        );
        socket.write_all(head.as_bytes()).await.unwrap();
        sockets.push(socket);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The third did not fit beside the first two: refused at once.
    let mut third = sockets.pop().unwrap();
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), third.read(&mut answer))
        .await
        .expect("the third upload was not refused at once")
        .unwrap();
    let text = String::from_utf8_lossy(&answer[..n]);
    assert!(text.starts_with("HTTP/1.1 503"), "{text}");
    assert!(text.contains("buffers-exhausted"), "{text}");
    for socket in &mut sockets {
        socket.write_all(&body).await.unwrap();
        let n = socket.read(&mut answer).await.unwrap();
        let text = String::from_utf8_lossy(&answer[..n]);
        assert!(text.starts_with("HTTP/1.1 201"), "{text}");
    }
    assert_eq!(executions(&stack, "upload"), 2);
    assert!(
        stack
            .gateway
            .store
            .find("act", "up-2")
            .await
            .unwrap()
            .is_empty()
    );
    stack.shutdown().await;
}

/// `server.max_captured_bytes`: every claim reserves 64 KiB of it for its
/// answer before it is made, and a claim that finds the budget full is
/// refused `503 buffers-exhausted` before anything is claimed or forwarded
/// (before: nothing counted the answers held for their record). An answer
/// in hand is never cut: a larger one that finds no room is kept all the
/// same, and replays whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_awaiting_their_record_count_against_a_byte_budget() {
    let stack = Stack::start_with(KEYS, |c| {
        c.store.max_stored_body_bytes = 256 * 1024;
        // Eight claims' reserves.
        c.server.max_captured_bytes = 512 * 1024;
        // The slow claims must outlast the big answer's wait.
        c.upstreams[0].timeout = "20s".into();
    })
    .await;
    let post = |http: support::Http, url: String, key: String, headers: Vec<(String, String)>| async move {
        let mut all = vec![("idempotency-key".to_owned(), key)];
        all.extend(headers);
        let all: Vec<(&str, &str)> = all.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        http.send("POST", &url, &all, "{}").await
    };
    let send = |path: &str, key: &str, headers: &[(&str, &str)]| {
        let headers = headers.iter().map(|(n, v)| (n.to_string(), v.to_string()));
        post(
            stack.http.clone(),
            stack.url(path),
            key.to_owned(),
            headers.collect(),
        )
    };
    let slow = |i: usize| {
        tokio::spawn(post(
            support::Http::http1(),
            stack.url("/actions/slow"),
            format!("slow-{i}"),
            vec![("x-demo-delay-ms".into(), "6000".into())],
        ))
    };
    let claims_in_flight = || async {
        let text = stack.http.get(&stack.admin("/metrics")).await.body;
        metric(&String::from_utf8_lossy(&text), "idemgate_claims_in_flight")
    };
    // Six slow claims hold 384 KiB of reserves.
    let mut running: Vec<_> = (0..6).map(slow).collect();
    assert!(
        eventually(Duration::from_secs(5), || async {
            claims_in_flight().await == 6
        })
        .await
    );
    let big = |key: &str| send("/actions/big", key, &[("x-demo-response-bytes", "200000")]);
    // A 200 kB answer: its reserve fits, the rest not while they run; it
    // waits for room, then is kept past the budget.
    let started = std::time::Instant::now();
    let first = big("big-1").await;
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "it did not wait for room"
    );
    assert_eq!(first.status, 201);
    assert_eq!(
        first.body.len(),
        200_000,
        "the client gets the whole answer"
    );
    // A 60 kB answer fits its own reserve, whatever else is held.
    let small = send(
        "/actions/small",
        "small-1",
        &[("x-demo-response-bytes", "60000")],
    )
    .await;
    assert_eq!((small.status.as_u16(), small.body.len()), (201, 60_000));
    // Two more slow claims reserve the rest: the next is refused at once.
    running.extend((6..8).map(slow));
    assert!(
        eventually(Duration::from_secs(5), || async {
            claims_in_flight().await == 8
        })
        .await
    );
    let refused = send("/actions/slow", "slow-8", &[]).await;
    assert_eq!(refused.status, 503);
    assert_eq!(
        refused.problem_type(),
        "urn:idemgate:problem:buffers-exhausted"
    );
    assert!(refused.header("retry-after").is_some());
    let metrics = stack.http.get(&stack.admin("/metrics")).await.body;
    let metrics = String::from_utf8_lossy(&metrics);
    assert_eq!(
        metric(&metrics, "idemgate_claims_refused_total{limit=\"answers\"}"),
        1
    );
    // What fills it is shown: at least all but one reserve of the budget.
    assert!(
        metric(&metrics, "idemgate_answer_bytes_held") > 512 * 1024 - 64 * 1024,
        "{metrics}"
    );
    assert!(
        stack
            .gateway
            .store
            .find("act", "slow-8")
            .await
            .unwrap()
            .is_empty()
    );
    for answer in running {
        assert_eq!(answer.await.unwrap().status, 201);
    }
    assert_eq!(executions(&stack, "slow"), 8, "the refused one never ran");
    // Both answers were recorded whole.
    let replay = big("big-1").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!((replay.status.as_u16(), replay.body.len()), (201, 200_000));
    assert_eq!(replay.header("idempotent-body-omitted"), None);
    let replay = send("/actions/small", "small-1", &[]).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body.len(), 60_000);
    // Everything given back: claims are made again.
    let again = send("/actions/slow", "slow-8", &[]).await;
    assert_eq!(again.status, 201);
    assert_eq!(executions(&stack, "slow"), 9);
    assert_eq!(executions(&stack, "big"), 1);
    assert_eq!(executions(&stack, "small"), 1);
    // And the gauge says so once every holder has finished.
    assert_answer_budget_drains(&stack).await;
    stack.shutdown().await;
}

/// An answer that never finishes gives its share of
/// `server.max_captured_bytes` back: an upstream that sends its head and a
/// few bytes, then stalls past the upstream's timeout, ends the attempt
/// (the record is uncertain), and the reserve its claim took returns. With
/// room for two reserves, four such attempts in turn are each claimed and
/// forwarded (none refused `buffers-exhausted`), a fresh request after them
/// is served, and nothing stays held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_stalled_mid_body_gives_its_budget_back() {
    let stack = Stack::start_with(KEYS, |c| {
        // Two claims' reserves.
        c.server.max_captured_bytes = 128 * 1024;
        c.upstreams[0].timeout = "1s".into();
    })
    .await;
    let send = |key: String, headers: Vec<(&'static str, &'static str)>| {
        let (http, url) = (stack.http.clone(), stack.url("/actions/stalled"));
        async move {
            let mut all = vec![("idempotency-key", key.as_str())];
            all.extend(headers);
            http.send("POST", &url, &all, "{}").await
        }
    };
    for i in 0..4 {
        let stalled = vec![
            ("x-demo-stall-body-ms", "3000"),
            ("x-demo-response-bytes", "100000"),
        ];
        let answer = send(format!("stalled-{i}"), stalled).await;
        assert_ne!(
            answer.problem_type(),
            "urn:idemgate:problem:buffers-exhausted",
            "attempt {i} found the budget held by the stalled ones before it"
        );
        assert_ne!(
            answer.status, 201,
            "attempt {i}: a cut answer passed as whole"
        );
    }
    assert_eq!(executions(&stack, "stalled"), 4);
    let fresh = send("fresh".into(), vec![]).await;
    assert_eq!(fresh.status, 201);
    assert_answer_budget_drains(&stack).await;
    stack.shutdown().await;
}

/// `idemgate_answer_bytes_held` falls to 0 once every holder has finished.
async fn assert_answer_budget_drains(stack: &Stack) {
    let drained = support::eventually(Duration::from_secs(5), || async {
        let text = stack.http.get(&stack.admin("/metrics")).await.body;
        metric(
            &String::from_utf8_lossy(&text),
            "idemgate_answer_bytes_held",
        ) == 0
    })
    .await;
    assert!(drained, "answer budget not given back");
}
