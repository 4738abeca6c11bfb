//! The upstream side of the wire: how the gateway's own HTTP/1.1 client
//! reads answers that are framed in every legal (and some illegal) way, and
//! when it reuses a connection. The upstream here is a raw TCP server that
//! writes canned bytes, so each framing is exactly what the test says.

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idemgate::gateway;
use support::{Http, PASS_THROUGH, config};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A raw upstream: answers each request by its path with canned bytes.
struct RawUpstream {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    requests: Arc<AtomicUsize>,
}

/// What the raw upstream writes for a path: the pieces (written with a
/// pause between them) and whether it closes the connection afterwards.
fn answer_for(path: &str) -> (Vec<&'static [u8]>, bool) {
    match path {
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
    }
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
        let (pieces, close) = answer_for(&path);
        for (i, piece) in pieces.iter().enumerate() {
            if i > 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if stream.write_all(piece).await.is_err() {
                return;
            }
        }
        if close {
            return;
        }
    }
}

async fn gateway_for(upstream: &RawUpstream) -> gateway::RunningGateway {
    let mut config = config(upstream.addr, PASS_THROUGH);
    config.server.worker_threads = 1; // one pool, so reuse is countable
    gateway::start(config).await.unwrap()
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
