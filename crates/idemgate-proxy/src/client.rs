//! Sending one request over a pooled upstream connection with hyper's
//! client (HTTP/1.1 or HTTP/2), and classifying how it failed.
//!
//! hyper reads the answer while the request body is still being written,
//! so an upstream that answers early (a `413` to an upload it will not
//! read) is heard at once instead of after the upstream timeout.
//!
//! A request is re-sent on a fresh connection only when hyper hands it back
//! untouched: the pooled connection turned out closed before a byte of the
//! request was written (`try_send_request`). Anything that fails once bytes
//! may have left is reported as such, never retried.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use axum::body::Body;
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Method, Request, Response, Uri, header};
use http_body::Body as _;
use http_body_util::BodyExt;

use super::connect::{ConnectError, Sender};
use super::headers::{self, ClientAddr};
use super::pool::{Pool, PooledBody};

/// Request bodies up to this size with a known length are read whole
/// before the upstream is contacted (as nginx buffers bodies), so the
/// upstream never waits on a slow client mid-request.
pub(super) const BUFFERED_BODY_BYTES: u64 = 64 * 1024;

/// Why an exchange failed, by how far it got.
#[derive(Debug, thiserror::Error)]
pub(super) enum SendError {
    /// No connection could be opened: nothing was sent.
    #[error("connecting failed: {0}")]
    Connect(String),
    /// Every connection the pool may open stayed in use: nothing was sent.
    #[error("every allowed upstream connection stayed in use")]
    Busy,
    /// The upstream's certificate was refused (or it refused ours):
    /// nothing was sent.
    #[error("{0}")]
    Tls(String),
    /// The client's body is over the limit: the upstream never got a
    /// complete request.
    #[error("request body over the limit")]
    BodyTooLarge,
    /// Reading the client's body failed: the upstream never got a complete
    /// request.
    #[error("reading the request body failed: {0}")]
    RequestBody(String),
    /// The request may have reached the upstream, but no usable answer
    /// came back.
    #[error("{0}")]
    Broken(String),
}

impl From<ConnectError> for SendError {
    fn from(e: ConnectError) -> Self {
        match e {
            ConnectError::Tls(e) => SendError::Tls(e.to_string()),
            ConnectError::Busy => SendError::Busy,
            e => SendError::Connect(e.to_string()),
        }
    }
}

/// Sends a request (the client's head, with `body` in place of its own)
/// and returns the answer with its body streaming.
pub(super) async fn send(
    pool: &Arc<Pool>,
    request: Parts,
    body: Body,
    limit: u64,
) -> Result<Response<Body>, SendError> {
    let to_h2_client = request.version == http::Version::HTTP_2;
    let h1_client_wants_trailers = !to_h2_client && headers::asks_for_trailers(&request.headers);
    let exact = body.size_hint().exact();
    if exact.is_some_and(|len| len > limit) {
        return Err(SendError::BodyTooLarge);
    }
    // Only a streamed body can fail on the client's side mid-request.
    let mut fault = None;
    let body = match exact {
        Some(0) => Body::empty(),
        Some(len) if len <= BUFFERED_BODY_BYTES => Body::from(collect_exact(body, len).await?),
        _ => {
            let shared = Arc::new(AtomicU8::new(FAULT_NONE));
            fault = Some(shared.clone());
            Body::new(Counted {
                inner: body,
                sent: 0,
                declared: exact,
                limit,
                fault: shared,
            })
        }
    };
    // Finding a connection (waiting under a cap, opening, opening again
    // for a pooled one found closed) ends by one deadline, below the
    // upstream timeout: a request that never left is told as such.
    let deadline = pool.deadline();
    let mut checked = pool.checkout_until(deadline).await?;
    let outgoing = upstream_request(pool, request, body, exact, &checked.sender);
    let answer = match try_send(&mut checked.sender, outgoing).await {
        Err(Failed::Unsent(outgoing)) if checked.reused => {
            // The pooled connection closed before the request was written:
            // it never left, so it goes out once more on a new connection.
            tracing::debug!(
                upstream = pool.authority(),
                layer = "proxy",
                "pooled connection was closed; sending on a new one"
            );
            checked = pool.reconnect_until(deadline).await?;
            try_send(&mut checked.sender, *outgoing).await
        }
        other => other,
    };
    let response = match answer {
        Ok(response) => response,
        Err(Failed::Unsent(_)) => {
            return Err(SendError::Connect(
                "the new connection closed before the request was written".into(),
            ));
        }
        Err(Failed::Error(e)) => {
            return Err(
                match fault.map_or(FAULT_NONE, |f| f.load(Ordering::Acquire)) {
                    FAULT_TOO_LARGE => SendError::BodyTooLarge,
                    FAULT_CLIENT => SendError::RequestBody(e.to_string()),
                    _ => classify(&e, checked.first, pool.exact_goaway()),
                },
            );
        }
    };
    let (mut parts, incoming) = response.into_parts();
    let ambiguous = client_head(&mut parts.headers, to_h2_client, h1_client_wants_trailers)?;
    let home = match checked.sender {
        Sender::Http1(sender) if !ambiguous => Some((sender, pool.clone())),
        _ => None,
    };
    Ok(Response::from_parts(
        parts,
        Body::new(PooledBody::new(incoming, home, checked.stream)),
    ))
}

/// The answer's head as the client gets it: connection headers gone,
/// trailers announced to an HTTP/1.1 client that asked for them, values
/// copied out for an HTTP/2 client. Whether the upstream framed it
/// ambiguously (its connection is then not reused).
fn client_head(
    head: &mut http::HeaderMap,
    to_h2_client: bool,
    h1_client_wants_trailers: bool,
) -> Result<bool, SendError> {
    let trailers = h1_client_wants_trailers
        .then(|| headers::trailer_names(head))
        .flatten();
    // Both framings at once: the answer was read as chunked, but a
    // connection whose peer frames ambiguously is not trusted again.
    let ambiguous = headers::strip_response_headers(head).map_err(SendError::Broken)?;
    if let Some(names) = trailers {
        head.insert(header::TRAILER, names);
    }
    if to_h2_client {
        // Only an HTTP/2 client's connection keeps header values (in its
        // HPACK table); an HTTP/1.1 one writes and drops them.
        headers::detach_values(head);
    }
    Ok(ambiguous)
}

/// What a hyper error after the request was handed over means.
///
/// - TLS refused for the first request on a fresh connection: over TLS
///   1.3 the client's handshake ends before the server has checked the
///   client certificate, so a refused certificate arrives as an alert on
///   the first read. The server never accepted the connection, so nothing
///   was processed. Only a refusal's alert
///   ([`crate::tls::is_handshake_refusal`]; a corrupt record after the
///   request left is uncertain), and only for the first request: requests
///   that joined a new HTTP/2 connection may have been processed before an
///   alert.
/// - HTTP/2 `REFUSED_STREAM` on the stream: the upstream says it did not
///   process it (RFC 9113 §8.7).
/// - HTTP/2 graceful `GOAWAY` (`NO_ERROR`) naming a last stream below this
///   one (§6.8: such streams were not processed and may be retried), or
///   refused on a connection that had already received one. h2 gives a
///   remote GOAWAY error to no other stream: the streams at or below the
///   last id go on, and if the connection then dies they
///   get a broken-pipe error instead. A `GOAWAY` with an error code stays
///   uncertain even above the last id: an upstream failing with an error
///   is not trusted to know what it processed, and the retry of an
///   uncertain record still carries the same `Idempotency-Key`.
///   Only on a single-threaded runtime ([`Pool::exact_goaway`]): on a
///   multi-threaded one (the MQ consumers') a request whose stream was
///   opened can get the same error.
/// - Anything else: the request may have been processed.
fn classify(e: &hyper::Error, first: bool, exact_goaway: bool) -> SendError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(cause) = source {
        if first && crate::tls::is_handshake_refusal(cause) {
            return SendError::Tls(e.to_string());
        }
        if let Some(h2) = cause.downcast_ref::<h2::Error>()
            && h2.is_remote()
        {
            let refused = h2.is_reset() && h2.reason() == Some(h2::Reason::REFUSED_STREAM);
            let above_graceful_goaway =
                exact_goaway && h2.is_go_away() && h2.reason() == Some(h2::Reason::NO_ERROR);
            if refused || above_graceful_goaway {
                return SendError::Connect(format!(
                    "the upstream did not process the stream: {h2}"
                ));
            }
        }
        source = cause.source();
    }
    SendError::Broken(e.to_string())
}

enum Failed {
    /// hyper gave the request back: no byte of it was written.
    Unsent(Box<Request<Body>>),
    Error(hyper::Error),
}

async fn try_send(
    sender: &mut Sender,
    request: Request<Body>,
) -> Result<Response<hyper::body::Incoming>, Failed> {
    let answer = match sender {
        Sender::Http1(s) => s.try_send_request(request).await,
        Sender::Http2(s) => s.try_send_request(request).await,
    };
    answer.map_err(|mut e| match e.take_message() {
        Some(request) => Failed::Unsent(Box::new(request)),
        None => Failed::Error(e.into_error()),
    })
}

/// The request as the upstream gets it: origin-form with `Host` set to the
/// upstream over HTTP/1.1, absolute-form (`:scheme`, `:authority`) over
/// HTTP/2; the client's headers filtered in place; the body framed by its
/// length.
fn upstream_request(
    pool: &Pool,
    request: Parts,
    body: Body,
    exact: Option<u64>,
    sender: &Sender,
) -> Request<Body> {
    let Parts {
        method,
        uri,
        mut headers,
        extensions,
        ..
    } = request;
    let target = pool.target();
    let http1 = matches!(sender, Sender::Http1(_));
    headers::filter_request_headers(
        &mut headers,
        extensions.get::<ClientAddr>(),
        uri.authority(),
        http1.then(|| target.host.clone()),
    );
    let mut parts = http::uri::Parts::default();
    parts.path_and_query = Some(
        uri.into_parts()
            .path_and_query
            .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/")),
    );
    if !http1 {
        parts.scheme = Some(target.scheme.clone());
        parts.authority = Some(target.authority.clone());
        // The shared connection's HPACK table would keep the client's
        // buffers alive (see `detach_values`).
        headers::detach_values(&mut headers);
    }
    let uri = Uri::from_parts(parts).unwrap_or_else(|_| Uri::from_static("/"));
    match exact {
        Some(0) if !expects_body(&method) => {}
        Some(len) => {
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
        }
        None => {} // hyper frames it chunked (HTTP/1.1) or by DATA frames
    }
    let mut outgoing = Request::new(body);
    *outgoing.method_mut() = method;
    *outgoing.uri_mut() = uri;
    *outgoing.headers_mut() = headers;
    outgoing
}

/// Methods whose requests carry a body by convention: an empty one is sent
/// as `Content-Length: 0` so that servers requiring a length accept it.
fn expects_body(method: &Method) -> bool {
    *method == Method::POST || *method == Method::PUT || *method == Method::PATCH
}

/// Reads a body of exactly `len` bytes (its declared length).
async fn collect_exact(body: Body, len: u64) -> Result<Bytes, SendError> {
    let data = body
        .collect()
        .await
        .map_err(|e| SendError::RequestBody(e.to_string()))?
        .to_bytes();
    if data.len() as u64 != len {
        return Err(SendError::RequestBody(format!(
            "body of {} bytes, {len} declared",
            data.len()
        )));
    }
    Ok(data)
}

const FAULT_NONE: u8 = 0;
const FAULT_TOO_LARGE: u8 = 1;
const FAULT_CLIENT: u8 = 2;

/// A streamed request body counted against the limit and its declared
/// length. A fault on the client's side ends it with an error, which makes
/// hyper abandon the request mid-body (no last chunk, fewer bytes than
/// declared, or a reset stream), so the upstream can never execute it;
/// `fault` tells the caller that the failure was the client's.
struct Counted {
    inner: Body,
    sent: u64,
    declared: Option<u64>,
    limit: u64,
    fault: Arc<AtomicU8>,
}

impl Counted {
    fn fail(&self, fault: u8, why: String) -> Option<Result<http_body::Frame<Bytes>, axum::Error>> {
        self.fault.store(fault, Ordering::Release);
        Some(Err(axum::Error::new(why)))
    }
}

impl http_body::Body for Counted {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        let frame = match std::pin::Pin::new(&mut this.inner).poll_frame(cx) {
            std::task::Poll::Pending => return std::task::Poll::Pending,
            std::task::Poll::Ready(frame) => frame,
        };
        std::task::Poll::Ready(match frame {
            None => match this.declared {
                Some(len) if this.sent != len => this.fail(
                    FAULT_CLIENT,
                    format!("body of {} bytes, {len} declared", this.sent),
                ),
                _ => None,
            },
            Some(Err(e)) => this.fail(FAULT_CLIENT, e.to_string()),
            Some(Ok(frame)) => match frame.into_data() {
                // Request trailers are not forwarded.
                Err(_) => Some(Ok(http_body::Frame::data(Bytes::new()))),
                Ok(data) => {
                    this.sent += data.len() as u64;
                    if this.sent > this.limit {
                        this.fail(FAULT_TOO_LARGE, "request body over the limit".into())
                    } else if this.declared.is_some_and(|len| this.sent > len) {
                        this.fail(FAULT_CLIENT, "body longer than declared".into())
                    } else {
                        Some(Ok(http_body::Frame::data(data)))
                    }
                }
            },
        })
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// What `send` gives an HTTP/2 client's request when the upstream
    /// answers `raw` (HTTP/1.1 bytes).
    async fn answer_to_an_h2_client(raw: &'static [u8]) -> Response<Body> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let pool = Pool::new(listener.local_addr().unwrap().to_string());
        tokio::spawn(async move {
            let (mut tcp, _) = listener.accept().await.unwrap();
            let mut head = [0u8; 1024];
            let _ = tcp.read(&mut head).await.unwrap();
            tcp.write_all(raw).await.unwrap();
            let _ = tcp.read(&mut head).await;
        });
        let (parts, _) = Request::get("/x")
            .version(http::Version::HTTP_2)
            .body(())
            .unwrap()
            .into_parts();
        send(&pool, parts, Body::empty(), 1024).await.unwrap()
    }

    /// hyper parses an answer's header values as slices of the
    /// connection's read buffer; for an HTTP/2 client the gateway copies
    /// them out (see `headers::detach_values`): here they sit back to back
    /// in one allocation, where slices of the read buffer would have the
    /// header names and `: ` between them.
    #[tokio::test]
    async fn an_answers_header_values_are_copied_out_of_the_read_buffer() {
        let answer = answer_to_an_h2_client(
            b"HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 21:00:00 GMT\r\n\
                  x-one: first\r\nx-two: second\r\ncontent-length: 2\r\n\r\nok",
        )
        .await;
        let values: Vec<&[u8]> = answer.headers().values().map(|v| v.as_bytes()).collect();
        assert_eq!(values.len(), 4);
        for pair in values.windows(2) {
            assert_eq!(
                pair[0].as_ptr().wrapping_add(pair[0].len()),
                pair[1].as_ptr(),
                "values back to back in one allocation of their own"
            );
        }
    }

    /// Trailers go through the same copy (over HTTP/1.1 hyper has copied
    /// them already; an HTTP/2 upstream's can be frame-buffer slices).
    #[tokio::test]
    async fn an_answers_trailer_values_are_copied_out_of_the_read_buffer() {
        let answer = answer_to_an_h2_client(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntrailer: x-one, x-two\r\n\r\n\
                  2\r\nok\r\n0\r\nx-one: first\r\nx-two: second\r\n\r\n",
        )
        .await;
        let collected = answer.into_body().collect().await.unwrap();
        let trailers = collected.trailers().expect("the trailers").clone();
        let values: Vec<&[u8]> = trailers.values().map(|v| v.as_bytes()).collect();
        assert_eq!(values, [b"first".as_slice(), b"second".as_slice()]);
        assert_eq!(
            values[0].as_ptr().wrapping_add(values[0].len()),
            values[1].as_ptr(),
            "values back to back in one allocation of their own"
        );
    }

    /// An upstream that answers every request after `delay`, counting the
    /// connections it accepted and the most requests it held at once.
    async fn counting_upstream(
        delay: Duration,
    ) -> (
        std::net::SocketAddr,
        Arc<std::sync::atomic::AtomicUsize>,
        Arc<std::sync::atomic::AtomicUsize>,
    ) {
        use std::sync::atomic::AtomicUsize;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (accepted, peak) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (counted, peaked) = (accepted.clone(), peak.clone());
        let held = Arc::new(AtomicUsize::new(0));
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::AcqRel);
                let (held, peaked) = (held.clone(), peaked.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |_req| {
                        let (held, peaked) = (held.clone(), peaked.clone());
                        async move {
                            let now = held.fetch_add(1, Ordering::AcqRel) + 1;
                            peaked.fetch_max(now, Ordering::AcqRel);
                            tokio::time::sleep(delay).await;
                            held.fetch_sub(1, Ordering::AcqRel);
                            Ok::<_, std::convert::Infallible>(http::Response::new(
                                http_body_util::Full::new(Bytes::from_static(b"ok")),
                            ))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tcp), service)
                        .await;
                });
            }
        });
        (addr, accepted, peak)
    }

    fn capped_pool(addr: std::net::SocketAddr, cap: usize, connect: Duration) -> Arc<Pool> {
        Pool::with_options(
            addr.to_string(),
            super::super::pool::PoolOptions {
                connect_timeout: Some(connect),
                max_connections: Some(cap),
                ..Default::default()
            },
        )
    }

    async fn get(pool: &Arc<Pool>) -> Result<Response<Body>, SendError> {
        let (parts, _) = Request::get("/x").body(()).unwrap().into_parts();
        let answer = send(pool, parts, Body::empty(), 1024).await?;
        let (parts, body) = answer.into_parts();
        // Read to the end: that is what gives the connection back.
        let body = body.collect().await.unwrap().to_bytes();
        Ok(Response::from_parts(parts, Body::from(body)))
    }

    #[tokio::test]
    async fn a_capped_pool_queues_requests_behind_its_connections() {
        let (addr, accepted, peak) = counting_upstream(Duration::from_millis(5)).await;
        let pool = capped_pool(addr, 4, Duration::from_secs(5));
        let answers = futures_util::future::join_all((0..200).map(|_| get(&pool))).await;
        for answer in answers {
            assert_eq!(answer.expect("every request answered").status(), 200);
        }
        assert!(
            accepted.load(Ordering::Acquire) <= 4,
            "{} connections for a cap of 4",
            accepted.load(Ordering::Acquire)
        );
        assert!(peak.load(Ordering::Acquire) <= 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_that_found_no_connection_in_time_was_never_sent() {
        let (addr, accepted, _) = counting_upstream(Duration::from_secs(3)).await;
        let pool = capped_pool(addr, 1, Duration::from_millis(500));
        let holder = tokio::spawn({
            let pool = pool.clone();
            async move { get(&pool).await.map(|a| a.status()) }
        });
        // The first request holds the only connection for 3 s.
        while accepted.load(Ordering::Acquire) == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let started = tokio::time::Instant::now();
        let queued = get(&pool).await;
        assert!(matches!(queued, Err(SendError::Busy)), "{queued:?}");
        assert!(started.elapsed() <= Duration::from_millis(600));
        assert_eq!(holder.await.unwrap().unwrap(), 200);
        assert_eq!(accepted.load(Ordering::Acquire), 1, "the cap held");
        assert_eq!(get(&pool).await.unwrap().status(), 200, "room again");
    }

    /// A queued request whose client hangs up just as a connection is
    /// handed to it passes the connection on instead of closing it.
    #[tokio::test]
    async fn a_queued_request_that_is_dropped_passes_its_connection_on() {
        let (addr, accepted, _) = counting_upstream(Duration::from_millis(50)).await;
        let pool = capped_pool(addr, 1, Duration::from_secs(5));
        let (parts, _) = Request::get("/x").body(()).unwrap().into_parts();
        let first = send(&pool, parts, Body::empty(), 1024).await.unwrap();
        let queued = tokio::spawn({
            let pool = pool.clone();
            async move { get(&pool).await.map(|a| a.status()) }
        });
        // Let it queue behind the first.
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!queued.is_finished());
        // Reading the first answer to the end hands the connection to the
        // queued request, which is dropped before it runs again.
        let _ = first.into_body().collect().await.unwrap();
        queued.abort();
        assert!(queued.await.unwrap_err().is_cancelled());
        assert_eq!(get(&pool).await.unwrap().status(), 200);
        assert_eq!(
            accepted.load(Ordering::Acquire),
            1,
            "the handed connection was passed on, not closed"
        );
    }

    /// A request whose pooled connection was found closed opens a new one
    /// within the same deadline as its first look: under a cap it waited
    /// for a place once, not twice.
    #[tokio::test(start_paused = true)]
    async fn finding_a_connection_again_shares_the_first_deadline() {
        let (addr, _, _) = counting_upstream(Duration::from_secs(3)).await;
        let pool = capped_pool(addr, 1, Duration::from_millis(500));
        let deadline = pool.deadline();
        tokio::time::sleep(Duration::from_millis(400)).await;
        // The only place is held by a request for 3 s.
        let holder = tokio::spawn({
            let pool = pool.clone();
            async move { get(&pool).await.map(|a| a.status()) }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        let started = tokio::time::Instant::now();
        let again = pool.reconnect_until(deadline).await;
        assert!(matches!(again, Err(ConnectError::Busy)));
        assert!(
            started.elapsed() <= Duration::from_millis(100),
            "waited {:?} past the first deadline",
            started.elapsed()
        );
        assert_eq!(holder.await.unwrap().unwrap(), 200);
    }
}
