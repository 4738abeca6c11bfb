//! The upstream side of the wire: how the gateway's own HTTP/1.1 client
//! reads answers that are framed in every legal (and some illegal) way, and
//! when it reuses a connection. The upstream here is a raw TCP server that
//! writes canned bytes, so each framing is exactly what the test says.

use crate::support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idemgate_gateway::gateway;
use support::{Http, PASS_THROUGH, config};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A raw upstream: answers each request by its path with canned bytes.
struct RawUpstream {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    requests: Arc<AtomicUsize>,
}

/// What the raw upstream does with a connection after its answer.
#[derive(Clone, Copy)]
enum After {
    /// Reads the next request.
    Keep,
    /// Closes it at once.
    Close,
    /// Closes it this long after answering, without saying so.
    CloseLater(u64),
    /// Never reads from it again, and never closes it.
    Hold,
}

/// What the raw upstream writes for a path: the pieces (written with a
/// pause between them) and what happens to the connection afterwards.
fn answer_for(path: &str) -> (Vec<&'static [u8]>, After) {
    let (pieces, close): (Vec<&'static [u8]>, bool) = match path {
        // A request body it will not read: it answers at once, and the
        // upload stalls against a full socket buffer.
        "/upload" => {
            return (
                vec![b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 8\r\n\r\ntoo big!"],
                After::Hold,
            );
        }
        "/close-later" => {
            return (
                vec![b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"],
                After::CloseLater(30),
            );
        }
        // Bytes no request asked for, after a bodiless answer: in the same
        // write, or a moment later while the connection sits idle.
        "/stray-now" => (
            vec![b"HTTP/1.1 204 No Content\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nEVIL"],
            false,
        ),
        "/stray-later" => (
            vec![
                b"HTTP/1.1 204 No Content\r\n\r\n",
                b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nEVIL",
            ],
            false,
        ),
        // A HEAD answer followed by the body it must not have.
        "/stray-head" => (
            vec![b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nEVIL"],
            false,
        ),
        "/good" => (vec![b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\ngood"], false),
        "/gzip-chunked" => (
            vec![b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n2\r\nzz\r\n0\r\n\r\n"],
            false,
        ),
        // Answers, then closes without saying so: every pooled connection
        // is stale by the next request.
        "/close-after" => (vec![b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"], true),
        "/chunked" => (
            vec![
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nx-up: 1\r\n\r\n5\r\nhel",
                b"lo\r\n6;ext=1\r\n world\r\n",
                b"0\r\nx-trailer: t\r\n\r\n",
            ],
            false,
        ),
        "/dup-length" => (
            vec![b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello!"],
            false,
        ),
        "/te-and-length" => (
            vec![
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 99\r\n\r\n2\r\nok\r\n0\r\n\r\n",
            ],
            false,
        ),
        "/continue" => (
            vec![b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 4\r\n\r\ndone"],
            false,
        ),
        "/until-close" => (vec![b"HTTP/1.1 200 OK\r\n\r\nstreamed ", b"to the end"], true),
        "/hop" => (
            vec![
                b"HTTP/1.1 200 OK\r\nconnection: keep-alive, x-secret\r\nx-secret: 1\r\nkeep-alive: timeout=5\r\nx-end: 2\r\ncontent-length: 0\r\n\r\n",
            ],
            false,
        ),
        // Bodiless by status or method, yet with the length of the
        // representation (RFC 9110 §8.6): nothing follows the head.
        "/not-modified" => (
            vec![b"HTTP/1.1 304 Not Modified\r\netag: \"v1\"\r\ncontent-length: 10\r\n\r\n"],
            false,
        ),
        "/head" => (vec![b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n"], false),
        _ => (vec![b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"], false),
    };
    (pieces, if close { After::Close } else { After::Keep })
}

impl RawUpstream {
    async fn start() -> RawUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let requests = Arc::new(AtomicUsize::new(0));
        let (c, r) = (connections.clone(), requests.clone());
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                c.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(stream, r.clone()));
            }
        });
        RawUpstream {
            addr,
            connections,
            requests,
        }
    }
}

async fn serve(mut stream: TcpStream, requests: Arc<AtomicUsize>) {
    let mut buf = Vec::new();
    loop {
        // Read one request head (these tests send no request bodies).
        let end = loop {
            if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_string();
        buf.drain(..end);
        requests.fetch_add(1, Ordering::SeqCst);
        let path = head.split(' ').nth(1).unwrap_or("/").to_owned();
        let (pieces, after) = answer_for(&path);
        for (i, piece) in pieces.iter().enumerate() {
            if i > 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if stream.write_all(piece).await.is_err() {
                return;
            }
        }
        match after {
            After::Keep => {}
            After::Close => return,
            After::CloseLater(ms) => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                return;
            }
            After::Hold => {
                tokio::time::sleep(Duration::from_secs(60)).await;
                return;
            }
        }
    }
}

async fn gateway_for(upstream: &RawUpstream) -> gateway::RunningGateway {
    gateway_with(upstream, PASS_THROUGH, |_| {}).await
}

async fn gateway_with(
    upstream: &RawUpstream,
    routes: &str,
    tweak: impl FnOnce(&mut idemgate_gateway::config::Config),
) -> gateway::RunningGateway {
    let mut config = config(upstream.addr, routes);
    config.server.worker_threads = 1; // one pool, so reuse is countable
    tweak(&mut config);
    gateway::start_for_tests(config).await.unwrap()
}

/// Key routes for uploads and pass-through for everything else.
const KEYED_UPLOADS: &str = r#"
    [[routes]]
    name = "upload"
    methods = ["POST"]
    path = "/upload"
    upstream = "demo"
    idempotency = "key"

    [[routes]]
    name = "keyed"
    methods = ["POST"]
    path = "/close-later"
    upstream = "demo"
    idempotency = "key"

    [[routes]]
    name = "pass"
    methods = ["GET", "HEAD"]
    path_prefix = "/"
    upstream = "demo"
"#;

#[tokio::test]
async fn an_early_413_to_an_unread_upload_is_answered_at_once_and_stored() {
    let upstream = RawUpstream::start().await;
    let gw = gateway_with(&upstream, KEYED_UPLOADS, |c| {
        c.server.max_body_bytes = 8 * 1024 * 1024;
        c.upstreams[0].timeout = "8s".into();
    })
    .await;
    let http = Http::default();
    let upload = vec![b'x'; 6 * 1024 * 1024];
    for attempt in 0..2 {
        // Well inside the upstream's 8 s: the answer is not a timeout.
        let answer = tokio::time::timeout(
            Duration::from_secs(4),
            http.send(
                "POST",
                &url(&gw, "/upload"),
                &[("idempotency-key", "upload-1")],
                upload.clone(),
            ),
        )
        .await
        .unwrap_or_else(|_| panic!("attempt {attempt}: the 413 waited for the upload"));
        assert_eq!(answer.status, 413, "attempt {attempt}: {answer:?}");
        assert_eq!(&answer.body[..], b"too big!");
        if attempt == 1 {
            assert_eq!(answer.header("idempotent-replayed"), Some("true"));
        }
    }
    // The refusal was recorded, not "uncertain": the retry was a replay.
    assert_eq!(upstream.requests.load(Ordering::SeqCst), 1);
    gw.shutdown().await;
}

#[tokio::test]
async fn stray_bytes_after_an_answer_never_become_the_next_answer() {
    let upstream = RawUpstream::start().await;
    let gw = gateway_for(&upstream).await;
    let http = Http::default();
    for (path, method) in [
        ("/stray-now", "GET"),
        ("/stray-later", "GET"),
        ("/stray-head", "HEAD"),
    ] {
        for round in 0..3 {
            let first = http.send(method, &url(&gw, path), &[], "").await;
            assert!(first.status.is_success(), "{path}: {first:?}");
            assert!(first.body.is_empty(), "{path}: a bodiless answer");
            // The stray bytes arrive while the connection sits idle.
            tokio::time::sleep(Duration::from_millis(60)).await;
            let next = http.get(&url(&gw, "/good")).await;
            assert_eq!(next.status, 200, "{path} round {round}");
            assert_eq!(&next.body[..], b"good", "{path} round {round}: {next:?}");
        }
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn connections_the_upstream_closes_while_idle_cost_no_key_request() {
    let upstream = RawUpstream::start().await;
    let gw = gateway_with(&upstream, KEYED_UPLOADS, |_| {}).await;
    let http = Http::default();
    for i in 0..20 {
        let key = format!("later-{i}");
        let answer = http
            .send(
                "POST",
                &url(&gw, "/close-later"),
                &[("idempotency-key", &key)],
                "{}",
            )
            .await;
        assert_eq!(answer.status, 200, "request {i}: {answer:?}");
        // Past the upstream's close: the pooled connection is closed by
        // now, and must not be the one the next key goes out on.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(upstream.requests.load(Ordering::SeqCst), 20);
    assert_eq!(upstream.connections.load(Ordering::SeqCst), 20);
    gw.shutdown().await;
}

#[tokio::test]
async fn a_transfer_coding_other_than_chunked_is_refused_not_relayed_undecoded() {
    let upstream = RawUpstream::start().await;
    let gw = gateway_for(&upstream).await;
    let answer = Http::default().get(&url(&gw, "/gzip-chunked")).await;
    assert_eq!(answer.status, 502, "{answer:?}");
    assert_eq!(
        answer.problem_type(),
        "urn:idemgate:problem:upstream-broken"
    );
    gw.shutdown().await;
}

fn url(gw: &gateway::RunningGateway, path: &str) -> String {
    format!("http://{}{}", gw.public_addr, path)
}

#[tokio::test]
async fn an_upstream_closing_idle_connections_costs_no_request() {
    let upstream = RawUpstream::start().await;
    let gw = gateway_for(&upstream).await;
    let http = Http::default();
    for i in 0..30 {
        let method = if i % 2 == 0 { "GET" } else { "POST" };
        let a = http.send(method, &url(&gw, "/close-after"), &[], "").await;
        assert_eq!(a.status, 200, "request {i}");
        assert_eq!(&a.body[..], b"ok");
        // Let the upstream's FIN arrive, as it would on an idle connection.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Every request reached the upstream exactly once, each on its own
    // connection: the closed ones were never handed out again.
    assert_eq!(upstream.requests.load(Ordering::SeqCst), 30);
    assert_eq!(upstream.connections.load(Ordering::SeqCst), 30);
    gw.shutdown().await;
}

#[tokio::test]
async fn a_chunked_answer_streams_through_and_its_connection_is_reused() {
    let upstream = RawUpstream::start().await;
    let gw = gateway_for(&upstream).await;
    let http = Http::default();
    for _ in 0..3 {
        let a = http.get(&url(&gw, "/chunked")).await;
        assert_eq!(a.status, 200);
        assert_eq!(&a.body[..], b"hello world");
        assert_eq!(a.header("x-up"), Some("1"));
        assert!(
            a.header("transfer-encoding")
                .is_none_or(|te| te == "chunked")
        );
        assert!(a.header("x-trailer").is_none(), "trailers are dropped");
    }
    assert_eq!(upstream.connections.load(Ordering::SeqCst), 1);
    gw.shutdown().await;
}

#[tokio::test]
async fn conflicting_lengths_are_502_and_an_ambiguous_answer_closes_its_connection() {
    let upstream = RawUpstream::start().await;
    let gw = gateway_for(&upstream).await;
    let http = Http::default();
    let a = http.get(&url(&gw, "/dup-length")).await;
    assert_eq!(a.status, 502);
    assert_eq!(a.problem_type(), "urn:idemgate:problem:upstream-broken");
    // Transfer-Encoding and Content-Length: chunked wins (RFC 9112 §6.3),
    // and the connection that carried it is not trusted again.
    let before = upstream.connections.load(Ordering::SeqCst);
    for _ in 0..2 {
        let a = http.get(&url(&gw, "/te-and-length")).await;
        assert_eq!(a.status, 200);
        assert_eq!(&a.body[..], b"ok");
    }
    assert_eq!(upstream.connections.load(Ordering::SeqCst), before + 2);
    gw.shutdown().await;
}

#[tokio::test]
async fn interim_answers_are_skipped_and_hop_by_hop_answer_headers_dropped() {
    let upstream = RawUpstream::start().await;
    let gw = gateway_for(&upstream).await;
    let http = Http::default();
    let a = http.send("POST", &url(&gw, "/continue"), &[], "x").await;
    assert_eq!(a.status, 201);
    assert_eq!(&a.body[..], b"done");
    let a = http.get(&url(&gw, "/hop")).await;
    assert_eq!(a.status, 200);
    assert_eq!(a.header("x-end"), Some("2"));
    assert!(a.header("x-secret").is_none(), "named by Connection");
    assert!(a.header("keep-alive").is_none());
    gw.shutdown().await;
}

#[tokio::test]
async fn bodiless_answers_with_a_length_keep_the_connection_in_step() {
    let upstream = RawUpstream::start().await;
    let gw = gateway_for(&upstream).await;
    let http = Http::default();
    for _ in 0..2 {
        let a = http.get(&url(&gw, "/not-modified")).await;
        assert_eq!(a.status, 304);
        assert_eq!(a.header("etag"), Some("\"v1\""));
        assert!(a.body.is_empty());
        let a = http.send("HEAD", &url(&gw, "/head"), &[], "").await;
        assert_eq!(a.status, 200);
        assert_eq!(a.header("content-length"), Some("10"));
        assert!(a.body.is_empty());
    }
    // Nothing was read past those heads: one connection carried all four.
    assert_eq!(upstream.connections.load(Ordering::SeqCst), 1);
    assert_eq!(upstream.requests.load(Ordering::SeqCst), 4);
    gw.shutdown().await;
}

#[tokio::test]
async fn a_body_read_until_close_is_delivered_whole() {
    let upstream = RawUpstream::start().await;
    let gw = gateway_for(&upstream).await;
    let http = Http::default();
    for _ in 0..2 {
        let a = http.get(&url(&gw, "/until-close")).await;
        assert_eq!(a.status, 200);
        assert_eq!(&a.body[..], b"streamed to the end");
    }
    assert_eq!(upstream.connections.load(Ordering::SeqCst), 2);
    gw.shutdown().await;
}
