//! An HTTP/2 upstream that refuses or abandons streams (docs/semantics.md: only a
//! request that may have reached the upstream becomes `uncertain`). The
//! upstream is a raw frame writer, so each refusal is exactly the frame the
//! test names: `RST_STREAM(REFUSED_STREAM)` and a graceful `GOAWAY` below
//! the stream say "not processed" (RFC 9113 §8.7, §6.8) and release the
//! claim; a `GOAWAY` with an error code after the stream may have been
//! processed, so the record turns `uncertain`. And an upstream that allows
//! 100 streams per connection gets a second connection for the 101st
//! concurrent request, instead of a request waiting unsent until it times
//! out as `uncertain`.

use crate::support;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemgate_gateway::gateway;
use idemgate_store::RecordState;
use support::{Http, config};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the upstream does with the next request (HEADERS frame) it gets.
#[derive(Debug, Clone, Copy)]
enum Action {
    /// `RST_STREAM` with `REFUSED_STREAM`; the connection stays up.
    Refuse,
    /// `GOAWAY(NO_ERROR)` with last stream id 0, then close.
    GoAwayBelow,
    /// `GOAWAY(NO_ERROR)` naming this stream as processed, then close
    /// before answering it.
    GoAwayAt,
    /// `GOAWAY(INTERNAL_ERROR)`, naming this stream as processed (`true`)
    /// or not (`false`: last stream id 0), then close.
    GoAwayFailed(bool),
    /// `:status 200`, no body.
    Answer,
}

struct H2Upstream {
    addr: SocketAddr,
    actions: Arc<Mutex<VecDeque<Action>>>,
    /// Every request (HEADERS frame) received, whatever was done with it.
    requests: Arc<Mutex<u32>>,
}

impl H2Upstream {
    async fn start(actions: &[Action]) -> H2Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = H2Upstream {
            addr: listener.local_addr().unwrap(),
            actions: Arc::new(Mutex::new(actions.iter().copied().collect())),
            requests: Arc::new(Mutex::new(0)),
        };
        let (actions, requests) = (upstream.actions.clone(), upstream.requests.clone());
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, actions.clone(), requests.clone()));
            }
        });
        upstream
    }

    fn requests(&self) -> u32 {
        *self.requests.lock().unwrap()
    }
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut out = len.to_be_bytes()[1..].to_vec();
    out.extend([kind, flags]);
    out.extend(stream.to_be_bytes());
    out.extend(payload);
    out
}

const SETTINGS: u8 = 4;
const HEADERS: u8 = 1;
const RST_STREAM: u8 = 3;
const GOAWAY: u8 = 7;
const ACK: u8 = 1;
const END_STREAM_AND_HEADERS: u8 = 0x1 | 0x4;

fn go_away(last: u32, code: u32) -> Vec<u8> {
    let mut payload = last.to_be_bytes().to_vec();
    payload.extend(code.to_be_bytes());
    frame(GOAWAY, 0, 0, &payload)
}

async fn serve(
    mut stream: TcpStream,
    actions: Arc<Mutex<VecDeque<Action>>>,
    requests: Arc<Mutex<u32>>,
) {
    let mut preface = [0u8; 24];
    if stream.read_exact(&mut preface).await.is_err() {
        return;
    }
    let _ = stream.write_all(&frame(SETTINGS, 0, 0, &[])).await;
    loop {
        let mut head = [0u8; 9];
        if stream.read_exact(&mut head).await.is_err() {
            return;
        }
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let (kind, flags) = (head[3], head[4]);
        let id = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let mut payload = vec![0u8; len];
        if stream.read_exact(&mut payload).await.is_err() {
            return;
        }
        if kind == SETTINGS && flags & ACK == 0 {
            let _ = stream.write_all(&frame(SETTINGS, ACK, 0, &[])).await;
        }
        if kind != HEADERS {
            continue;
        }
        *requests.lock().unwrap() += 1;
        let action = actions
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or(Action::Answer);
        match action {
            Action::Refuse => {
                let refused_stream = 0x7u32.to_be_bytes();
                let _ = stream
                    .write_all(&frame(RST_STREAM, 0, id, &refused_stream))
                    .await;
            }
            Action::GoAwayBelow | Action::GoAwayAt => {
                let last = if matches!(action, Action::GoAwayAt) {
                    id
                } else {
                    0
                };
                let _ = stream.write_all(&go_away(last, 0x0)).await;
                let _ = stream.shutdown().await;
                return;
            }
            Action::GoAwayFailed(processed) => {
                let last = if processed { id } else { 0 };
                let _ = stream.write_all(&go_away(last, 0x2)).await;
                let _ = stream.shutdown().await;
                return;
            }
            Action::Answer => {
                // HPACK static table index 8: `:status 200`.
                let answer = frame(HEADERS, END_STREAM_AND_HEADERS, id, &[0x88]);
                let _ = stream.write_all(&answer).await;
            }
        }
    }
}

const KEYED: &str = r#"
    [[routes]]
    name = "act"
    methods = ["POST"]
    path_prefix = "/"
    upstream = "demo"
    idempotency = "key"
"#;

async fn gateway_for(upstream: &H2Upstream) -> gateway::RunningGateway {
    let mut config = config(upstream.addr, KEYED);
    config.server.worker_threads = 1;
    config.upstreams[0].http2 = true;
    gateway::start_for_tests(config).await.unwrap()
}

async fn post(http: &Http, gw: &gateway::RunningGateway, key: &str) -> support::Answer {
    let url = format!("http://{}/actions/x", gw.public_addr);
    http.send("POST", &url, &[("idempotency-key", key)], "{}")
        .await
}

async fn states(gw: &gateway::RunningGateway, key: &str) -> Vec<RecordState> {
    let records = gw.store.find("act", key).await.unwrap();
    records.iter().map(|r| r.state).collect()
}

#[tokio::test]
async fn a_refused_stream_releases_the_claim_and_the_retry_executes() {
    let upstream = H2Upstream::start(&[Action::Refuse, Action::Answer]).await;
    let gw = gateway_for(&upstream).await;
    let http = Http::default();
    let refused = post(&http, &gw, "r-1").await;
    assert_eq!(refused.status, 502, "{refused:?}");
    assert_eq!(
        refused.problem_type(),
        "urn:idemgate:problem:upstream-unavailable"
    );
    assert!(
        !states(&gw, "r-1").await.contains(&RecordState::Uncertain),
        "a refused stream was not processed: {:?}",
        states(&gw, "r-1").await
    );
    let retry = post(&http, &gw, "r-1").await;
    assert_eq!(retry.status, 200, "{retry:?}");
    assert_eq!(retry.header("idempotent-replayed"), None);
    assert_eq!(upstream.requests(), 2);
    gw.shutdown().await;
}

#[tokio::test]
async fn a_stream_above_a_graceful_goaway_releases_the_claim() {
    let upstream = H2Upstream::start(&[Action::GoAwayBelow, Action::Answer]).await;
    let gw = gateway_for(&upstream).await;
    let http = Http::default();
    let cut = post(&http, &gw, "g-1").await;
    assert_eq!(cut.status, 502, "{cut:?}");
    assert_eq!(
        cut.problem_type(),
        "urn:idemgate:problem:upstream-unavailable"
    );
    assert!(
        !states(&gw, "g-1").await.contains(&RecordState::Uncertain),
        "a stream above the GOAWAY's last id was not processed: {:?}",
        states(&gw, "g-1").await
    );
    // A new connection takes the retry, which executes and is recorded.
    let retry = post(&http, &gw, "g-1").await;
    assert_eq!(retry.status, 200, "{retry:?}");
    let again = post(&http, &gw, "g-1").await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(upstream.requests(), 2);
    gw.shutdown().await;
}

#[tokio::test]
async fn a_stream_at_or_below_a_graceful_goaway_cut_by_the_close_stays_uncertain() {
    // The upstream says it may have processed the stream, then closes
    // without an answer: it may have acted.
    let upstream = H2Upstream::start(&[Action::GoAwayAt]).await;
    let gw = gateway_for(&upstream).await;
    let http = Http::default();
    let cut = post(&http, &gw, "a-1").await;
    assert_eq!(cut.status, 502, "{cut:?}");
    assert_eq!(cut.problem_type(), "urn:idemgate:problem:upstream-broken");
    assert_eq!(states(&gw, "a-1").await, vec![RecordState::Uncertain]);
    gw.shutdown().await;
}

#[tokio::test]
async fn a_goaway_with_an_error_code_leaves_the_stream_uncertain() {
    // Named as processed, then the connection failed: it may have acted.
    // Not named: RFC 9113 would allow a retry, but an upstream failing with
    // an error is not trusted to know what it processed; only a graceful
    // GOAWAY releases the claim. Either way the record is uncertain and the
    // retry runs again with the same `Idempotency-Key`.
    let upstream =
        H2Upstream::start(&[Action::GoAwayFailed(true), Action::GoAwayFailed(false)]).await;
    let gw = gateway_for(&upstream).await;
    let http = Http::default();
    for key in ["e-1", "e-2"] {
        let cut = post(&http, &gw, key).await;
        assert_eq!(cut.status, 502, "{key}: {cut:?}");
        assert_eq!(
            cut.problem_type(),
            "urn:idemgate:problem:upstream-broken",
            "{key}"
        );
        assert_eq!(
            states(&gw, key).await,
            vec![RecordState::Uncertain],
            "{key}"
        );
    }
    assert_eq!(upstream.requests(), 2);
    gw.shutdown().await;
}

/// An upstream that announces `SETTINGS_MAX_CONCURRENT_STREAMS = 100`,
/// answers its first request at once (a warm-up), and holds every later
/// one until `release_at` of them have arrived (over all its connections),
/// then answers them all.
struct HoldingUpstream {
    addr: SocketAddr,
    requests: Arc<AtomicUsize>,
    connections: Arc<AtomicUsize>,
}

impl HoldingUpstream {
    async fn start(release_at: usize) -> HoldingUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = HoldingUpstream {
            addr: listener.local_addr().unwrap(),
            requests: Arc::new(AtomicUsize::new(0)),
            connections: Arc::new(AtomicUsize::new(0)),
        };
        let (requests, connections) = (upstream.requests.clone(), upstream.connections.clone());
        let (release, released) = tokio::sync::watch::channel(false);
        let release = Arc::new(release);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                connections.fetch_add(1, Ordering::SeqCst);
                let (requests, release, released) =
                    (requests.clone(), release.clone(), released.clone());
                tokio::spawn(hold(stream, requests, release_at, release, released));
            }
        });
        upstream
    }
}

enum Seen {
    Settings,
    Request(u32),
}

async fn hold(
    stream: TcpStream,
    requests: Arc<AtomicUsize>,
    release_at: usize,
    release: Arc<tokio::sync::watch::Sender<bool>>,
    mut released: tokio::sync::watch::Receiver<bool>,
) {
    let (mut reader, mut writer) = stream.into_split();
    let mut preface = [0u8; 24];
    if reader.read_exact(&mut preface).await.is_err() {
        return;
    }
    let max_streams = [0x00, 0x03, 0, 0, 0, 100];
    let _ = writer.write_all(&frame(SETTINGS, 0, 0, &max_streams)).await;
    let (seen, mut frames) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let mut head = [0u8; 9];
            if reader.read_exact(&mut head).await.is_err() {
                return;
            }
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let id = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            let mut payload = vec![0u8; len];
            if reader.read_exact(&mut payload).await.is_err() {
                return;
            }
            let event = match head[3] {
                SETTINGS if head[4] & ACK == 0 => Seen::Settings,
                HEADERS => Seen::Request(id),
                _ => continue,
            };
            if seen.send(event).is_err() {
                return;
            }
        }
    });
    let mut held = Vec::new();
    loop {
        tokio::select! {
            event = frames.recv() => match event {
                None => return,
                Some(Seen::Settings) => {
                    let _ = writer.write_all(&frame(SETTINGS, ACK, 0, &[])).await;
                }
                Some(Seen::Request(id)) => {
                    let n = requests.fetch_add(1, Ordering::SeqCst);
                    if n == 0 {
                        let answer = frame(HEADERS, END_STREAM_AND_HEADERS, id, &[0x88]);
                        let _ = writer.write_all(&answer).await;
                        continue;
                    }
                    held.push(id);
                    if n >= release_at {
                        let _ = release.send(true);
                    }
                }
            },
            Ok(()) = released.changed() => {}
        }
        if *released.borrow() {
            for id in held.drain(..) {
                let answer = frame(HEADERS, END_STREAM_AND_HEADERS, id, &[0x88]);
                let _ = writer.write_all(&answer).await;
            }
        }
    }
}

#[tokio::test]
async fn past_100_concurrent_streams_a_second_connection_carries_the_rest() {
    const CONCURRENT: usize = 150;
    let upstream = HoldingUpstream::start(CONCURRENT).await;
    let mut config = config(upstream.addr, KEYED);
    config.server.worker_threads = 1;
    config.upstreams[0].http2 = true;
    config.upstreams[0].timeout = "5s".into();
    let gw = gateway::start_for_tests(config).await.unwrap();
    let http = Http::default();
    let url = format!("http://{}/actions/x", gw.public_addr);
    // The warm-up opens the shared connection, so the burst finds one
    // connection with room for 100 streams (not a cold pool, where every
    // request opens its own).
    let warm = http
        .send("POST", &url, &[("idempotency-key", "warm")], "{}")
        .await;
    assert_eq!(warm.status, 200, "{warm:?}");
    assert_eq!(upstream.connections.load(Ordering::SeqCst), 1);
    let answers = futures_util::future::join_all((0..CONCURRENT).map(|i| {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let key = format!("c-{i}");
            http.send("POST", &url, &[("idempotency-key", key.as_str())], "{}")
                .await
        }
    }));
    let answers = tokio::time::timeout(Duration::from_secs(15), answers)
        .await
        .expect("every request answered");
    let statuses: Vec<u16> = answers.iter().map(|a| a.status.as_u16()).collect();
    // With one connection, the upstream would see 100 streams and never
    // release them: every request would end as a 504 `uncertain`.
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert_eq!(upstream.requests.load(Ordering::SeqCst), CONCURRENT + 1);
    assert!(upstream.connections.load(Ordering::SeqCst) >= 2);
    gw.shutdown().await;
}
