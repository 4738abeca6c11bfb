//! gRPC through the gateway (docs/grpc.md), with tonic's client and
//! server on either side. The service counts executions and copies at
//! once and does NOT deduplicate, and like gRPC's C core (grpcio, grpc-go)
//! it refuses a call that arrives without `te: trailers`: before the
//! gateway forwarded that header, every call here failed.

use crate::support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes};
use futures_util::StreamExt;
use http::uri::PathAndQuery;
use http_body::Frame;
use hyper::body::Incoming;
use idemgate_gateway::config::Config;
use idemgate_gateway::gateway::{self, RunningGateway};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::{Code, Status};

/// Messages as raw bytes: the gateway never reads them, and the tests
/// need no generated code.
#[derive(Clone, Copy, Default)]
struct Raw;

impl Codec for Raw {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = Raw;
    type Decoder = Raw;

    fn encoder(&mut self) -> Raw {
        Raw
    }

    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl Encoder for Raw {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for Raw {
    type Item = Vec<u8>;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        let n = src.remaining();
        Ok(Some(src.copy_to_bytes(n).to_vec()))
    }
}

/// What the service saw.
#[derive(Default)]
struct Seen {
    /// Calls whose handler ran, of every method.
    executions: AtomicU64,
    /// Handlers running right now, and the most at once.
    running: AtomicU64,
    peak: AtomicU64,
    /// Calls refused for want of `te: trailers`.
    without_te: AtomicU64,
    /// The `grpc-timeout` of the last call.
    last_timeout: Mutex<Option<String>>,
    /// The `idempotency-key` of every `Place` that ran, for the status
    /// endpoint `GET /status/{key}`.
    ran: Mutex<std::collections::HashSet<String>>,
}

/// The gRPC service: `Place` (unary), `Watch` (server streaming), `Batch`
/// (client streaming), `Chat` (bidirectional), under any service name.
/// Metadata steers it: `x-delay-ms` (work that long), `x-status` (end with
/// that code, trailing metadata `x-reason`). Every answer carries initial
/// metadata `x-order` and trailing metadata `x-trail`.
struct GrpcService {
    addr: SocketAddr,
    seen: Arc<Seen>,
}

impl GrpcService {
    async fn start() -> GrpcService {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let seen = Arc::new(Seen::default());
        let service = GrpcService {
            addr: listener.local_addr().unwrap(),
            seen: seen.clone(),
        };
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let seen = seen.clone();
                tokio::spawn(async move {
                    let serve = hyper::service::service_fn(move |req| call(seen.clone(), req));
                    let _ = hyper::server::conn::http2::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(hyper_util::rt::TokioIo::new(tcp), serve)
                    .await;
                });
            }
        });
        service
    }

    fn executions(&self) -> u64 {
        self.seen.executions.load(Ordering::SeqCst)
    }

    fn peak(&self) -> u64 {
        self.seen.peak.load(Ordering::SeqCst)
    }
}

/// Counts a running handler for as long as it lives.
struct Running(Arc<Seen>);

impl Running {
    fn start(seen: &Arc<Seen>) -> Running {
        seen.executions.fetch_add(1, Ordering::SeqCst);
        let now = seen.running.fetch_add(1, Ordering::SeqCst) + 1;
        seen.peak.fetch_max(now, Ordering::SeqCst);
        Running(seen.clone())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
    }
}

type Reply = http::Response<tonic::body::Body>;

async fn call(seen: Arc<Seen>, req: http::Request<Incoming>) -> Result<Reply, Infallible> {
    *seen.last_timeout.lock().unwrap() = req
        .headers()
        .get("grpc-timeout")
        .map(|v| v.to_str().unwrap().to_owned());
    if let Some(key) = req.uri().path().strip_prefix("/status/") {
        return Ok(status_endpoint(&seen, key));
    }
    if req.headers().get("te").is_none_or(|te| te != "trailers") {
        seen.without_te.fetch_add(1, Ordering::SeqCst);
        let mut refused = http::Response::new(tonic::body::Body::empty());
        *refused.status_mut() = http::StatusCode::BAD_REQUEST;
        return Ok(refused);
    }
    let method = req.uri().path().rsplit('/').next().unwrap_or("").to_owned();
    let drop_answer = req.headers().contains_key("x-drop");
    // After the method ran: answer as a proxy that lost its answer does
    // (this HTTP status, `grpc-status: 14`), or add a second status to the
    // trailers.
    let lost_with = req.headers().get("x-http-status").cloned();
    let second_status = req.headers().get("x-second-status").cloned();
    let mut grpc = tonic::server::Grpc::new(Raw);
    let reply = match method.as_str() {
        "Place" => {
            let seen = seen.clone();
            let place = tower::service_fn(move |r: tonic::Request<Vec<u8>>| {
                let seen = seen.clone();
                async move {
                    let _running = Running::start(&seen);
                    if let Some(key) = r.metadata().get("idempotency-key") {
                        let key = key.to_str().unwrap().to_owned();
                        seen.ran.lock().unwrap().insert(key);
                    }
                    steer(r.metadata()).await?;
                    let mut answer = b"placed:".to_vec();
                    answer.extend(r.get_ref());
                    Ok::<_, Status>(with_order(tonic::Response::new(answer)))
                }
            });
            grpc.unary(place, req).await
        }
        "Watch" => {
            let seen = seen.clone();
            let watch = tower::service_fn(move |r: tonic::Request<Vec<u8>>| {
                let seen = seen.clone();
                async move {
                    let _running = Running::start(&seen);
                    // With `x-status`, the stream ends with that status
                    // after its messages.
                    let end = steer(r.metadata()).await.err().map(Err);
                    let base = r.into_inner();
                    let items = (1..=3u8)
                        .map(move |i| {
                            Ok::<_, Status>([base.clone(), vec![b'#', b'0' + i]].concat())
                        })
                        .chain(end);
                    let stream: ResponseStream = Box::pin(futures_util::stream::iter(items));
                    Ok::<_, Status>(with_order(tonic::Response::new(stream)))
                }
            });
            grpc.server_streaming(watch, req).await
        }
        "Batch" => {
            let seen = seen.clone();
            let batch = tower::service_fn(move |r: tonic::Request<tonic::Streaming<Vec<u8>>>| {
                let seen = seen.clone();
                async move {
                    let _running = Running::start(&seen);
                    let mut stream = r.into_inner();
                    let mut all = Vec::new();
                    while let Some(message) = stream.next().await {
                        all.extend(message?);
                        all.push(b'+');
                    }
                    Ok::<_, Status>(with_order(tonic::Response::new(all)))
                }
            });
            grpc.client_streaming(batch, req).await
        }
        "Chat" => {
            let seen = seen.clone();
            let chat = tower::service_fn(move |r: tonic::Request<tonic::Streaming<Vec<u8>>>| {
                let seen = seen.clone();
                async move {
                    let _running = Running::start(&seen);
                    let echo = r
                        .into_inner()
                        .map(|m| m.map(|m| [b"echo:".to_vec(), m].concat()));
                    let stream: ResponseStream = Box::pin(echo);
                    Ok::<_, Status>(with_order(tonic::Response::new(stream)))
                }
            });
            grpc.streaming(chat, req).await
        }
        _ => tonic::Status::unimplemented(method).into_http(),
    };
    if let Some(status) = lost_with {
        let mut lost = http::Response::new(tonic::body::Body::empty());
        *lost.status_mut() = http::StatusCode::from_bytes(status.as_bytes()).unwrap();
        let fields = lost.headers_mut();
        fields.insert("content-type", "application/grpc".parse().unwrap());
        fields.insert("grpc-status", "14".parse().unwrap());
        fields.insert("grpc-message", "upstream answer lost".parse().unwrap());
        return Ok(lost);
    }
    Ok(reply.map(|body| match drop_answer {
        // The method ran; its answer is lost on the way (the stream is
        // reset), as when the service's connection drops after a commit.
        true => {
            tonic::body::Body::new(http_body_util::StreamBody::new(futures_util::stream::once(
                async { Err::<Frame<Bytes>, Status>(Status::internal("answer lost")) },
            )))
        }
        false => tonic::body::Body::new(TrailMetadata(body, second_status)),
    }))
}

/// `GET /status/{key}`, the route's `reconcile_path`: `404` when no
/// `Place` ran with that key, else `200` with the answer `Place` gave
/// (`placed:m`), as a gRPC body and trailers.
fn status_endpoint(seen: &Seen, key: &str) -> Reply {
    if !seen.ran.lock().unwrap().contains(key) {
        let mut unknown = http::Response::new(tonic::body::Body::empty());
        *unknown.status_mut() = http::StatusCode::NOT_FOUND;
        return unknown;
    }
    let message = [&[0u8, 0, 0, 0, 8][..], b"placed:m"].concat();
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", "0".parse().unwrap());
    let frames = [
        Ok::<_, Status>(Frame::data(Bytes::from(message))),
        Ok(Frame::trailers(trailers)),
    ];
    let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
    let mut ran = http::Response::new(tonic::body::Body::new(body));
    ran.headers_mut()
        .insert("content-type", "application/grpc".parse().unwrap());
    ran
}

type ResponseStream =
    Pin<Box<dyn futures_util::Stream<Item = Result<Vec<u8>, Status>> + Send + 'static>>;

/// Waits `x-delay-ms`, then fails with `x-status` if asked to.
async fn steer(metadata: &tonic::metadata::MetadataMap) -> Result<(), Status> {
    let number = |name: &str| {
        metadata
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
    };
    if let Some(ms) = number("x-delay-ms") {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    match number("x-status") {
        Some(code) => {
            let mut extra = tonic::metadata::MetadataMap::new();
            extra.insert("x-reason", "steered".parse().unwrap());
            Err(Status::with_metadata(
                Code::from_i32(code as i32),
                "steered failure",
                extra,
            ))
        }
        None => Ok(()),
    }
}

fn with_order<T>(mut response: tonic::Response<T>) -> tonic::Response<T> {
    response
        .metadata_mut()
        .insert("x-order", "initial".parse().unwrap());
    response
}

/// Adds `x-trail` to the trailers of every answer: trailing metadata
/// that only a relay of trailers can deliver; and a second `grpc-status`
/// where one is given.
struct TrailMetadata(tonic::body::Body, Option<http::HeaderValue>);

impl http_body::Body for TrailMetadata {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let polled = Pin::new(&mut self.0).poll_frame(cx);
        polled.map(|frame| {
            frame.map(|frame| {
                frame.map(|frame| match frame.into_trailers() {
                    Ok(mut trailers) => {
                        trailers.insert("x-trail", "kept".parse().unwrap());
                        if let Some(second) = self.1.clone() {
                            trailers.append("grpc-status", second);
                        }
                        Frame::trailers(trailers)
                    }
                    Err(frame) => frame,
                })
            })
        })
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }
}

/// A gateway in front of `service` (an HTTP/2 upstream named `demo`):
/// `/orders.Orders/*` a key route, `/shop.*/*` passed through.
async fn gateway_for(service: &GrpcService, tweak: impl FnOnce(&mut Config)) -> RunningGateway {
    let routes = r#"
        [[routes]]
        name = "orders"
        methods = ["POST"]
        path_prefix = "/orders.Orders/"
        upstream = "demo"
        idempotency = "key"

        [[routes]]
        name = "pass"
        path_prefix = "/shop."
        upstream = "demo"
    "#;
    let mut config = support::config(service.addr, routes);
    config.upstreams[0].http2 = true;
    config.upstreams[0].uncertain_hold = Some("3s".into());
    config.server.max_connections = 1000;
    tweak(&mut config);
    gateway::start_for_tests(config).await.unwrap()
}

async fn channel(gateway: &RunningGateway) -> tonic::client::Grpc<tonic::transport::Channel> {
    let url = format!("http://{}", gateway.public_addr);
    let channel = tonic::transport::Endpoint::from_shared(url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    tonic::client::Grpc::new(channel)
}

/// A unary call with `metadata`.
async fn unary(
    client: &mut tonic::client::Grpc<tonic::transport::Channel>,
    path: &'static str,
    message: &[u8],
    metadata: &[(&'static str, &str)],
) -> Result<tonic::Response<Vec<u8>>, Status> {
    let mut request = tonic::Request::new(message.to_vec());
    for (name, value) in metadata {
        request.metadata_mut().insert(*name, value.parse().unwrap());
    }
    client.ready().await.unwrap();
    client
        .unary(request, PathAndQuery::from_static(path), Raw)
        .await
}

/// `Place` with `metadata`, sent again while the gateway answers
/// `UNAVAILABLE` (the first call with its key still running): what a
/// client's retry policy does.
/// A unary call of `/orders.Orders/Place`, the method every test orders by.
async fn place(
    client: &mut tonic::client::Grpc<tonic::transport::Channel>,
    message: &[u8],
    metadata: &[(&'static str, &str)],
) -> Result<tonic::Response<Vec<u8>>, Status> {
    unary(client, "/orders.Orders/Place", message, metadata).await
}

async fn until_answered(
    client: &mut tonic::client::Grpc<tonic::transport::Channel>,
    message: &[u8],
    metadata: &[(&'static str, &str)],
) -> Result<tonic::Response<Vec<u8>>, Status> {
    loop {
        match place(client, message, metadata).await {
            Err(s) if s.code() == Code::Unavailable => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => return other,
        }
    }
}

fn meta<'a>(response: &'a tonic::Response<Vec<u8>>, name: &str) -> Option<&'a str> {
    response.metadata().get(name).and_then(|v| v.to_str().ok())
}

fn status_meta<'a>(status: &'a Status, name: &str) -> Option<&'a str> {
    status.metadata().get(name).and_then(|v| v.to_str().ok())
}

/// Every kind of call goes through a pass-through route with its messages,
/// its metadata and its trailing metadata intact; the service saw
/// `te: trailers` on each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_call_passes_through_with_its_metadata_and_trailers() {
    let service = GrpcService::start().await;
    let gateway = gateway_for(&service, |_| {}).await;
    let mut client = channel(&gateway).await;

    let placed = unary(
        &mut client,
        "/shop.Orders/Place",
        b"o-1",
        &[("x-client", "c")],
    )
    .await
    .unwrap();
    assert_eq!(placed.get_ref(), b"placed:o-1");
    assert_eq!(meta(&placed, "x-order"), Some("initial"));
    assert_eq!(
        meta(&placed, "x-trail"),
        Some("kept"),
        "trailing metadata lost"
    );

    client.ready().await.unwrap();
    let watched = client
        .server_streaming(
            tonic::Request::new(b"w".to_vec()),
            PathAndQuery::from_static("/shop.Orders/Watch"),
            Raw,
        )
        .await
        .unwrap();
    let mut stream = watched.into_inner();
    let mut items = Vec::new();
    while let Some(item) = stream.message().await.unwrap() {
        items.push(item);
    }
    assert_eq!(items, [b"w#1".to_vec(), b"w#2".to_vec(), b"w#3".to_vec()]);
    let trailers = stream.trailers().await.unwrap().expect("trailers");
    assert_eq!(trailers.get("x-trail").unwrap().to_str().unwrap(), "kept");

    client.ready().await.unwrap();
    let parts = futures_util::stream::iter([b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]);
    let batched = client
        .client_streaming(
            tonic::Request::new(parts),
            PathAndQuery::from_static("/shop.Orders/Batch"),
            Raw,
        )
        .await
        .unwrap();
    assert_eq!(batched.get_ref(), b"a+b+c+");
    assert_eq!(meta(&batched, "x-trail"), Some("kept"));

    // Bidirectional: each answer arrives before the next message is sent.
    let (to_service, outgoing) = tokio::sync::mpsc::channel::<Vec<u8>>(1);
    client.ready().await.unwrap();
    let outgoing = tokio_stream_from(outgoing);
    to_service.send(b"one".to_vec()).await.unwrap();
    let chat = client
        .streaming(
            tonic::Request::new(outgoing),
            PathAndQuery::from_static("/shop.Orders/Chat"),
            Raw,
        )
        .await
        .unwrap();
    let mut answers = chat.into_inner();
    assert_eq!(answers.message().await.unwrap().unwrap(), b"echo:one");
    to_service.send(b"two".to_vec()).await.unwrap();
    assert_eq!(answers.message().await.unwrap().unwrap(), b"echo:two");
    drop(to_service);
    assert_eq!(answers.message().await.unwrap(), None);
    assert_eq!(
        answers
            .trailers()
            .await
            .unwrap()
            .unwrap()
            .get("x-trail")
            .unwrap()
            .to_str()
            .unwrap(),
        "kept"
    );

    // A status with trailing metadata of its own.
    let failed = unary(
        &mut client,
        "/shop.Orders/Place",
        b"o-2",
        &[("x-status", "9")],
    )
    .await
    .unwrap_err();
    assert_eq!(failed.code(), Code::FailedPrecondition);
    assert_eq!(failed.message(), "steered failure");
    assert_eq!(status_meta(&failed, "x-reason"), Some("steered"));

    assert_eq!(service.seen.without_te.load(Ordering::SeqCst), 0);
    assert_eq!(service.executions(), 5);
    gateway.shutdown().await;
}

fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::Receiver<Vec<u8>>,
) -> impl futures_util::Stream<Item = Vec<u8>> + Send + 'static {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// The service learns the gateway's deadline: a call without
/// `grpc-timeout`, or with a longer one, is sent with the upstream's
/// `timeout`; a shorter one goes as the gateway keeps it, one value
/// (several are read as the shortest).
#[tokio::test]
async fn the_service_is_told_the_deadline_the_gateway_keeps() {
    let service = GrpcService::start().await;
    let gateway = gateway_for(&service, |_| {}).await;
    let mut client = channel(&gateway).await;
    let timeout_seen = |service: &GrpcService| service.seen.last_timeout.lock().unwrap().clone();
    unary(&mut client, "/shop.Orders/Place", b"t", &[])
        .await
        .unwrap();
    assert_eq!(
        timeout_seen(&service).as_deref(),
        Some("2000000u"),
        "the upstream's 2s"
    );
    unary(
        &mut client,
        "/shop.Orders/Place",
        b"t",
        &[("grpc-timeout", "1H")],
    )
    .await
    .unwrap();
    assert_eq!(timeout_seen(&service).as_deref(), Some("2000000u"));
    unary(
        &mut client,
        "/shop.Orders/Place",
        b"t",
        &[("grpc-timeout", "700m")],
    )
    .await
    .unwrap();
    assert_eq!(timeout_seen(&service).as_deref(), Some("700000u"), "700 ms");
    // Two values: the shortest is kept, and only it reaches the service.
    let two = support::Http::h2c()
        .send(
            "POST",
            &format!("http://{}/shop.Orders/Place", gateway.public_addr),
            &[
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                ("grpc-timeout", "900m"),
                ("grpc-timeout", "1H"),
            ],
            [&[0u8, 0, 0, 0, 1][..], b"t"].concat(),
        )
        .await;
    assert_eq!(two.status, 200, "{two:?}");
    assert_eq!(timeout_seen(&service).as_deref(), Some("900000u"));
    // A request that is not a gRPC call: its `grpc-timeout` binds nothing.
    let plain = support::Http::h2c()
        .send(
            "POST",
            &format!("http://{}/shop.Orders/Place", gateway.public_addr),
            &[
                ("grpc-timeout", "1n"),
                ("te", "trailers"),
                ("x-delay-ms", "200"),
            ],
            [&[0u8, 0, 0, 0, 1][..], b"t"].concat(),
        )
        .await;
    assert_eq!(plain.status, 200, "{plain:?}");
    assert_eq!(timeout_seen(&service).as_deref(), Some("1n"), "rewritten");
    // And the gateway keeps it: a call that runs past its own deadline is
    // answered DEADLINE_EXCEEDED by then. (Sent with a plain HTTP/2
    // client: tonic's would give up at the deadline itself.)
    let started = std::time::Instant::now();
    let late = support::Http::h2c()
        .send(
            "POST",
            &format!("http://{}/shop.Orders/Place", gateway.public_addr),
            &[
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                ("grpc-timeout", "300m"),
                ("x-delay-ms", "1500"),
            ],
            [&[0u8, 0, 0, 0, 1][..], b"t"].concat(),
        )
        .await;
    assert_eq!(late.status, 200);
    assert_eq!(late.header("grpc-status"), Some("4"), "{late:?}");
    assert!(
        late.header("grpc-message")
            .unwrap()
            .contains("upstream-timeout"),
        "{late:?}"
    );
    assert!(started.elapsed() < Duration::from_millis(1200));
    gateway.shutdown().await;
}

/// An HTTP/1.1 client that asks for trailers (`TE: trailers`) gets the
/// gRPC status as chunked trailers: passed through, on a protected
/// route, and in that route's replay.
#[tokio::test]
async fn an_http1_client_that_asks_for_trailers_gets_them_chunked() {
    let service = GrpcService::start().await;
    let gateway = gateway_for(&service, |_| {}).await;
    let call = |path: &'static str, key: Option<&'static str>| {
        let addr = gateway.public_addr;
        async move {
            let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            let message = [&[0u8, 0, 0, 0, 2][..], b"h1"].concat();
            let key = key.map_or(String::new(), |k| format!("idempotency-key: {k}\r\n"));
            let head = format!(
                "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/grpc\r\n\
                 te: trailers\r\n{key}content-length: {}\r\nconnection: close\r\n\r\n",
                message.len()
            );
            tcp.write_all(head.as_bytes()).await.unwrap();
            tcp.write_all(&message).await.unwrap();
            let mut raw = Vec::new();
            tcp.read_to_end(&mut raw).await.unwrap();
            String::from_utf8_lossy(&raw).to_ascii_lowercase()
        }
    };
    for (path, key) in [
        ("/shop.Orders/Place", None),
        ("/orders.Orders/Place", Some("h1-1")),
        ("/orders.Orders/Place", Some("h1-1")),
    ] {
        let text = call(path, key).await;
        assert!(text.starts_with("http/1.1 200"), "{text}");
        assert!(text.contains("transfer-encoding: chunked"), "{text}");
        let last_chunk = text.rfind("\r\n0\r\n").expect("a last chunk");
        let trailers = &text[last_chunk..];
        assert!(trailers.contains("grpc-status: 0"), "{path}: {text}");
        assert!(text.contains("placed:h1"), "{text}");
    }
    assert_eq!(service.executions(), 2, "the replay ran");
    gateway.shutdown().await;
}

/// Hundreds of copies of one unary call with one key, at once, over
/// several connections: the method runs once, every caller gets its
/// message (or `UNAVAILABLE` while it runs: safe to retry), and a later
/// retry replays the message and its trailing metadata, marked replayed.
async fn storm(store: Option<(String, String, String)>, wait: bool) {
    let service = GrpcService::start().await;
    let gateway = gateway_for(&service, |c| {
        if wait {
            c.routes[0].on_concurrent = idemgate::idempotency::OnConcurrent::Wait;
        }
        if let Some((db, redis, prefix)) = store {
            c.store.database_url = db;
            c.store.redis_url = redis;
            c.store.redis_prefix = prefix;
        }
    })
    .await;
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(channel(&gateway).await);
    }
    let mut calls = Vec::new();
    for i in 0..200 {
        let mut client = clients[i % clients.len()].clone();
        calls.push(tokio::spawn(async move {
            place(
                &mut client,
                b"order-9",
                &[("idempotency-key", "storm-1"), ("x-delay-ms", "300")],
            )
            .await
        }));
    }
    let (mut placed, mut in_flight) = (0, 0);
    for call in calls {
        match call.await.unwrap() {
            Ok(answer) => {
                assert_eq!(answer.get_ref(), b"placed:order-9");
                assert_eq!(meta(&answer, "x-trail"), Some("kept"));
                placed += 1;
            }
            Err(status) => {
                assert!(!wait, "{status:?}");
                assert_eq!(status.code(), Code::Unavailable, "{status:?}");
                assert!(status.message().contains("request-in-flight"), "{status:?}");
                in_flight += 1;
            }
        }
    }
    assert_eq!(
        service.executions(),
        1,
        "{placed} placed, {in_flight} in flight"
    );
    assert_eq!(service.peak(), 1);
    assert!(placed >= 1);
    let again = unary(
        &mut clients[0],
        "/orders.Orders/Place",
        b"order-9",
        &[("idempotency-key", "storm-1")],
    )
    .await
    .unwrap();
    assert_eq!(again.get_ref(), b"placed:order-9");
    assert_eq!(meta(&again, "idempotent-replayed"), Some("true"));
    assert_eq!(meta(&again, "x-order"), Some("initial"));
    assert_eq!(
        meta(&again, "x-trail"),
        Some("kept"),
        "the replay lost the trailers"
    );
    assert_eq!(service.executions(), 1);
    gateway.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_one_call_executes_once_reject() {
    storm(None, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_one_call_executes_once_wait() {
    storm(None, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_one_call_executes_once_redis_postgres() {
    let test = "a_storm_of_one_call_executes_once_redis_postgres";
    let Some(db) = support::services::shared_sql(test).await else {
        return;
    };
    let Some((redis, prefix)) = support::services::redis(test).await else {
        return;
    };
    storm(Some((db, redis, prefix)), false).await;
}

/// Two gateways on one store: copies of one call sent to both run once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_run_a_call_once() {
    let test = "two_gateways_run_a_call_once";
    let Some(db) = support::services::shared_sql(test).await else {
        return;
    };
    let Some((redis, prefix)) = support::services::redis(test).await else {
        return;
    };
    let service = GrpcService::start().await;
    let store = |c: &mut Config| {
        c.store.database_url = db.clone();
        c.store.redis_url = redis.clone();
        c.store.redis_prefix = prefix.clone();
    };
    let a = gateway_for(&service, store).await;
    let b = gateway_for(&service, store).await;
    let clients = [channel(&a).await, channel(&b).await];
    let mut calls = Vec::new();
    for i in 0..100 {
        let mut client = clients[i % 2].clone();
        calls.push(tokio::spawn(async move {
            let metadata = [("idempotency-key", "two-1"), ("x-delay-ms", "200")];
            until_answered(&mut client, b"order-2", &metadata).await
        }));
    }
    for call in calls {
        assert_eq!(call.await.unwrap().unwrap().get_ref(), b"placed:order-2");
    }
    assert_eq!(service.executions(), 1);
    assert_eq!(service.peak(), 1);
    a.shutdown().await;
    b.shutdown().await;
}

/// A client that cancels its call mid-flight changes nothing: the call
/// runs to its end once, and the retry replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_call_runs_once_and_its_retry_replays_it() {
    let service = GrpcService::start().await;
    let gateway = gateway_for(&service, |_| {}).await;
    let mut client = channel(&gateway).await;
    let first = {
        let mut client = client.clone();
        tokio::spawn(async move {
            place(
                &mut client,
                b"order-3",
                &[("idempotency-key", "gone-1"), ("x-delay-ms", "400")],
            )
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    first.abort();
    let replayed = until_answered(&mut client, b"order-3", &[("idempotency-key", "gone-1")])
        .await
        .unwrap();
    assert_eq!(replayed.get_ref(), b"placed:order-3");
    assert_eq!(meta(&replayed, "idempotent-replayed"), Some("true"));
    assert_eq!(service.executions(), 1);
    gateway.shutdown().await;
}

/// The gRPC status decides the record: a status the method answered for
/// good is replayed with its trailing metadata; `ABORTED` (it did not
/// act) lets the retry run; `INTERNAL`, `UNAVAILABLE` (what Envoy answers
/// for a lost or late answer) and `RESOURCE_EXHAUSTED` (an answer over
/// the server's limit, made after acting) may mean it acted: the retry is
/// held as uncertain.
#[tokio::test]
async fn the_grpc_status_decides_stored_released_or_uncertain() {
    let service = GrpcService::start().await;
    let gateway = gateway_for(&service, |_| {}).await;
    let client = channel(&gateway).await;
    let place = |key: &'static str, status: Option<&'static str>| {
        let mut client = client.clone();
        async move {
            let mut metadata = vec![("idempotency-key", key)];
            if let Some(status) = status {
                metadata.push(("x-status", status));
            }
            place(&mut client, b"m", &metadata).await
        }
    };

    let refused = place("stored-1", Some("9")).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    let replayed = place("stored-1", None).await.unwrap_err();
    assert_eq!(replayed.code(), Code::FailedPrecondition, "{replayed:?}");
    assert_eq!(replayed.message(), "steered failure");
    assert_eq!(status_meta(&replayed, "x-reason"), Some("steered"));
    assert_eq!(status_meta(&replayed, "idempotent-replayed"), Some("true"));
    assert_eq!(service.executions(), 1);

    let aborted = place("released-1", Some("10")).await.unwrap_err();
    assert_eq!(aborted.code(), Code::Aborted);
    let ran = place("released-1", None).await.unwrap();
    assert_eq!(ran.get_ref(), b"placed:m");
    assert_eq!(meta(&ran, "idempotent-replayed"), None);
    assert_eq!(service.executions(), 3);

    for (key, code, seen) in [
        ("uncertain-1", "13", Code::Internal),
        ("uncertain-2", "14", Code::Unavailable),
        ("uncertain-3", "8", Code::ResourceExhausted),
    ] {
        let first = place(key, Some(code)).await.unwrap_err();
        assert_eq!(first.code(), seen);
        let held = place(key, None).await.unwrap_err();
        assert_eq!(held.code(), Code::Unavailable, "{held:?}");
        assert!(held.message().contains("outcome-uncertain"), "{held:?}");
        assert!(status_meta(&held, "retry-after").is_some());
    }
    assert_eq!(
        service.executions(),
        6,
        "the retry of an uncertain call ran"
    );
    gateway.shutdown().await;
}

/// A proxy's HTTP error that carries a gRPC status (`503` with
/// `UNAVAILABLE`, for a call that ran and whose answer it lost) is judged
/// by that status, as the caller judges it; so is an answer that names
/// two statuses (`OK`, then `ABORTED`): it says two things at once. Either
/// way the retry is held, and the method runs once.
#[tokio::test]
async fn a_grpc_status_beside_an_http_error_or_said_twice_holds_the_retry() {
    let service = GrpcService::start().await;
    let gateway = gateway_for(&service, |_| {}).await;
    let mut client = channel(&gateway).await;
    let cases: [(&str, (&str, &str)); 3] = [
        ("lost-503", ("x-http-status", "503")),
        ("lost-500", ("x-http-status", "500")),
        ("twice-1", ("x-second-status", "10")),
    ];
    for (n, (key, steer)) in (1u64..).zip(cases) {
        // The caller's own answer: whatever its client makes of it.
        let _ = place(&mut client, b"m", &[("idempotency-key", key), steer]).await;
        assert_eq!(service.executions(), n, "{key}: the method ran once");
        let held = place(&mut client, b"m", &[("idempotency-key", key)])
            .await
            .unwrap_err();
        assert_eq!(held.code(), Code::Unavailable, "{key}: {held:?}");
        assert!(
            held.message().contains("outcome-uncertain"),
            "{key}: {held:?}"
        );
        assert_eq!(
            service.executions(),
            n,
            "{key}: the retry ran the method again"
        );
    }
    gateway.shutdown().await;
}

/// The service ran the call and its answer was lost on the way: the call
/// is `UNKNOWN` to its client, and the retry is held (`UNAVAILABLE`,
/// `outcome-uncertain`) instead of running it a second time.
#[tokio::test]
async fn a_lost_answer_is_uncertain_and_its_retry_is_held() {
    let service = GrpcService::start().await;
    let gateway = gateway_for(&service, |_| {}).await;
    let mut client = channel(&gateway).await;
    let lost = place(
        &mut client,
        b"m",
        &[("idempotency-key", "lost-1"), ("x-drop", "1")],
    )
    .await
    .unwrap_err();
    assert_eq!(lost.code(), Code::Unknown, "{lost:?}");
    assert!(lost.message().contains("upstream-broken"), "{lost:?}");
    for _ in 0..3 {
        let held = place(&mut client, b"m", &[("idempotency-key", "lost-1")])
            .await
            .unwrap_err();
        assert_eq!(held.code(), Code::Unavailable, "{held:?}");
        assert!(held.message().contains("outcome-uncertain"), "{held:?}");
    }
    assert_eq!(service.executions(), 1);
    gateway.shutdown().await;
}

/// A route's `reconcile_path` settles a lost answer for a gRPC route as
/// for any other: after the hold, the retry asks the service's status
/// endpoint (HTTP, beside its methods), which says the call ran and with
/// what answer; that answer, trailers and all, is replayed.
#[tokio::test]
async fn a_lost_answer_is_reconciled_through_the_status_endpoint() {
    let service = GrpcService::start().await;
    let gateway = gateway_for(&service, |c| {
        c.routes[0].reconcile_path = Some("/status/{key}".into());
        c.upstreams[0].uncertain_hold = Some("300ms".into());
    })
    .await;
    let mut client = channel(&gateway).await;
    let lost = place(
        &mut client,
        b"m",
        &[("idempotency-key", "settle-1"), ("x-drop", "1")],
    )
    .await
    .unwrap_err();
    assert_eq!(lost.code(), Code::Unknown, "{lost:?}");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let settled = place(&mut client, b"m", &[("idempotency-key", "settle-1")])
        .await
        .unwrap();
    assert_eq!(settled.get_ref(), b"placed:m");
    let again = place(&mut client, b"m", &[("idempotency-key", "settle-1")])
        .await
        .unwrap();
    assert_eq!(again.get_ref(), b"placed:m");
    assert_eq!(meta(&again, "idempotent-replayed"), Some("true"));
    assert_eq!(service.executions(), 1);
    gateway.shutdown().await;
}

/// An answer over `store.max_stored_body_bytes` reaches its caller whole,
/// status and trailers included; its replay says that the call ran once
/// and its answer was not kept (`UNKNOWN`), and runs nothing.
#[tokio::test]
async fn an_answer_too_large_to_keep_reaches_its_caller_and_is_not_run_again() {
    let service = GrpcService::start().await;
    let gateway = gateway_for(&service, |c| c.store.max_stored_body_bytes = 64).await;
    let mut client = channel(&gateway).await;
    let big = vec![b'x'; 4096];
    let first = place(&mut client, &big, &[("idempotency-key", "big-1")])
        .await
        .unwrap();
    assert_eq!(first.get_ref().len(), "placed:".len() + big.len());
    assert_eq!(meta(&first, "x-trail"), Some("kept"));
    let replayed = place(&mut client, &big, &[("idempotency-key", "big-1")])
        .await
        .unwrap_err();
    assert_eq!(replayed.code(), Code::Unknown, "{replayed:?}");
    assert!(replayed.message().contains("ran once"), "{replayed:?}");
    assert_eq!(status_meta(&replayed, "idempotent-replayed"), Some("true"));
    assert_eq!(service.executions(), 1);
    gateway.shutdown().await;
}

/// The gateway's own refusals reach a gRPC client as gRPC statuses
/// naming the problem: a missing key, a reused one, an unknown route, a
/// streaming call on a protected route (client streaming before it runs,
/// server streaming once it answered), a body that is no call.
#[tokio::test]
async fn refusals_are_grpc_statuses_naming_the_problem() {
    let service = GrpcService::start().await;
    let gateway = gateway_for(&service, |_| {}).await;
    let mut client = channel(&gateway).await;

    let missing = place(&mut client, b"m", &[]).await.unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument);
    assert!(
        missing
            .message()
            .starts_with("urn:idemgate:problem:idempotency-key-missing"),
        "{missing:?}"
    );
    assert!(missing.message().ends_with("(route orders)"), "{missing:?}");

    place(&mut client, b"m", &[("idempotency-key", "r-1")])
        .await
        .unwrap();
    let reused = place(&mut client, b"other", &[("idempotency-key", "r-1")])
        .await
        .unwrap_err();
    assert_eq!(reused.code(), Code::FailedPrecondition);
    assert!(
        reused.message().contains("idempotency-key-reused"),
        "{reused:?}"
    );
    assert!(status_meta(&reused, "idempotency-expires").is_some());

    let nowhere = unary(&mut client, "/nowhere.Svc/Call", b"m", &[])
        .await
        .unwrap_err();
    assert_eq!(nowhere.code(), Code::Unimplemented);
    assert!(nowhere.message().contains("route-not-found"), "{nowhere:?}");

    client.ready().await.unwrap();
    let mut request =
        tonic::Request::new(futures_util::stream::iter([b"a".to_vec(), b"b".to_vec()]));
    request
        .metadata_mut()
        .insert("idempotency-key", "s-1".parse().unwrap());
    let streaming = client
        .client_streaming(
            request,
            PathAndQuery::from_static("/orders.Orders/Batch"),
            Raw,
        )
        .await
        .unwrap_err();
    assert_eq!(streaming.code(), Code::Unimplemented);
    assert!(
        streaming.message().contains("streaming-call"),
        "{streaming:?}"
    );
    assert!(
        streaming.message().contains("(route orders)"),
        "{streaming:?}"
    );

    // A server-streaming call looks unary until it answers: it ran, and
    // it is recorded and answered UNIMPLEMENTED, the same to its retry —
    // also when the stream ends with a status that alone would release
    // the call (ABORTED after its messages).
    for (attempt, key, status) in [
        (0, "watch-1", None),
        (1, "watch-1", None),
        (0, "watch-2", Some("10")),
        (1, "watch-2", None),
    ] {
        client.ready().await.unwrap();
        let mut request = tonic::Request::new(b"w".to_vec());
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse().unwrap());
        if let Some(status) = status {
            request
                .metadata_mut()
                .insert("x-status", status.parse().unwrap());
        }
        let answer = client
            .server_streaming(
                request,
                PathAndQuery::from_static("/orders.Orders/Watch"),
                Raw,
            )
            .await;
        let refused = match answer {
            Err(status) => status,
            Ok(stream) => stream.into_inner().message().await.unwrap_err(),
        };
        assert_eq!(refused.code(), Code::Unimplemented, "{refused:?}");
        assert!(refused.message().contains("streaming-call"), "{refused:?}");
        assert!(refused.message().contains("ran once"), "{refused:?}");
        let replayed = status_meta(&refused, "idempotent-replayed");
        assert_eq!(replayed, (attempt == 1).then_some("true"), "{refused:?}");
    }
    assert_eq!(service.executions(), 3, "the first Place and two Watches");

    // No message at all, or bytes that are not whole messages: no call.
    for body in [&b""[..], &[0, 0, 0, 0, 1, b'a', 0][..]] {
        let answer = support::Http::h2c()
            .send(
                "POST",
                &format!("http://{}/orders.Orders/Place", gateway.public_addr),
                &[
                    ("content-type", "application/grpc"),
                    ("te", "trailers"),
                    ("idempotency-key", "bad-1"),
                ],
                body.to_vec(),
            )
            .await;
        assert_eq!(answer.header("grpc-status"), Some("3"), "{answer:?}");
        assert!(
            answer
                .header("grpc-message")
                .unwrap()
                .contains("bad-request-body"),
            "{answer:?}"
        );
    }
    assert_eq!(service.executions(), 3);
    gateway.shutdown().await;
}

/// With the store out of reach, a gRPC call is `UNAVAILABLE` naming
/// `store-unavailable`, with `retry-after`, and nothing is forwarded.
#[tokio::test]
async fn a_store_away_is_unavailable_and_forwards_nothing() {
    let test = "a_store_away_is_unavailable_and_forwards_nothing";
    let Some(url) = support::services::shared_sql(test).await else {
        return;
    };
    let proxy = support::services::FaultProxy::start(support::services::sql_addr(&url)).await;
    let proxied = support::services::via(&url, proxy.port);
    let service = GrpcService::start().await;
    let gateway = gateway_for(&service, |c| {
        c.store.database_url = proxied;
        c.store.timeout = "500ms".into();
    })
    .await;
    let mut client = channel(&gateway).await;
    proxy.set(support::services::Mode::Blackhole);
    let away = place(&mut client, b"m", &[("idempotency-key", "a-1")])
        .await
        .unwrap_err();
    assert_eq!(away.code(), Code::Unavailable);
    assert!(away.message().contains("store-unavailable"), "{away:?}");
    assert_eq!(status_meta(&away, "retry-after"), Some("1"));
    assert_eq!(service.executions(), 0);
    proxy.set(support::services::Mode::Pass);
    gateway.shutdown().await;
}
