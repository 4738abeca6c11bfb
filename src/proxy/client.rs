//! Sending one request over a pooled upstream connection.
//!
//! The exchange runs inside the task of the client's own connection: the
//! head (and a small body) leave in one write, the answer is read into the
//! connection's buffer, and when the whole answer arrived with its head it
//! is handed on as one buffer and the connection goes straight back to the
//! pool. There is no connection task and no channel in between; that is
//! what makes pass-through cost about what nginx's costs.
//!
//! A request is re-sent on a fresh connection only when it could not have
//! reached the upstream: its write to a pooled connection failed and the
//! whole request, body included, is still in hand. Anything else that
//! fails once bytes may have left is reported as such, never retried.

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use http::request::Parts;
use http::{Method, Response};
use http_body::Body as _;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::body::{Remaining, UpstreamBody};
use super::headers::{self, ClientAddr};
use super::pool::{Conn, Pool};
use super::wire::{
    self, BodyFraming, ChunkedDecoder, Decoded, LAST_CHUNK, RequestFraming, ResponseHead, WireError,
};

/// Request bodies up to this size with a known length are read whole
/// before the upstream is contacted and written with the head in one go
/// (as nginx buffers bodies); larger or chunked bodies stream.
pub(super) const BUFFERED_BODY_BYTES: u64 = 64 * 1024;
/// Read buffer headroom kept before each read of a response head.
const HEAD_READ_BYTES: usize = 8 * 1024;

/// Why an exchange failed, by how far it got.
#[derive(Debug, thiserror::Error)]
pub(super) enum SendError {
    /// No connection could be opened: nothing was sent.
    #[error("connecting failed: {0}")]
    Connect(io::Error),
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

/// Sends a request (the client's head, with `body` in place of its own)
/// and reads the answer's head.
pub(super) async fn send(
    pool: &Arc<Pool>,
    request: &Parts,
    body: Body,
    limit: u64,
) -> Result<Response<Body>, SendError> {
    let method = &request.method;
    let exact = body.size_hint().exact();
    if exact.is_some_and(|len| len > limit) {
        return Err(SendError::BodyTooLarge);
    }
    let framing = match exact {
        Some(0) if !expects_body(method) => RequestFraming::None,
        Some(len) => RequestFraming::Length(len),
        None => RequestFraming::Chunked,
    };
    let mut head = Vec::with_capacity(512);
    wire::encode_request_head(
        &mut head,
        method,
        request.uri.path_and_query().map_or("/", |p| p.as_str()),
        pool.authority(),
        |out| {
            headers::write_request_headers(
                out,
                &request.headers,
                request.extensions.get::<ClientAddr>(),
            )
        },
        framing,
    );
    let (mut conn, streaming) = match framing {
        RequestFraming::Length(len) if len <= BUFFERED_BODY_BYTES => {
            // Read the small body first, then the whole request is one
            // buffer: one write, and safe to re-send if that write fails.
            let data = collect_exact(body, len).await?;
            head.extend_from_slice(&data);
            (write_whole(pool, &head).await?, None)
        }
        RequestFraming::None => (write_whole(pool, &head).await?, None),
        _ => {
            let mut conn = open(pool).await?;
            if let Err(e) = conn.stream.write_all(&head).await {
                return Err(SendError::Broken(format!(
                    "writing the request failed: {e}"
                )));
            }
            (conn, Some(body))
        }
    };
    if let Some(body) = streaming {
        match Box::pin(stream_body(&mut conn, body, framing, limit)).await {
            Ok(()) => {}
            Err(StreamError::Client(e)) => return Err(e),
            // The upstream stopped reading: it may have answered early
            // (a 413, say); take that answer if there is one.
            Err(StreamError::Write(e)) => {
                return match Box::pin(read_head(&mut conn, method)).await {
                    Ok(mut head) => {
                        head.reusable = false;
                        Ok(into_response(head, conn, pool))
                    }
                    Err(_) => Err(SendError::Broken(format!(
                        "writing the request body failed: {e}"
                    ))),
                };
            }
        }
    }
    let head = read_head(&mut conn, method).await?;
    Ok(into_response(head, conn, pool))
}

/// Methods whose requests carry a body by convention: an empty one is sent
/// as `Content-Length: 0` so that servers requiring a length accept it.
fn expects_body(method: &Method) -> bool {
    *method == Method::POST || *method == Method::PUT || *method == Method::PATCH
}

async fn open(pool: &Pool) -> Result<Conn, SendError> {
    match pool.checkout() {
        Some(conn) => Ok(conn),
        None => connect(pool).await,
    }
}

/// Opens a new connection. The connect future (name resolution, connect,
/// timeout) is large and rarely needed, so it lives in its own allocation
/// instead of inflating every request's future, which is moved several
/// times per request. Large and chunked bodies are boxed for the same
/// reason.
async fn connect(pool: &Pool) -> Result<Conn, SendError> {
    Box::pin(pool.connect()).await.map_err(SendError::Connect)
}

/// Writes a whole request, re-sending it once on a fresh connection when
/// the write to a pooled one fails (the upstream closed it; the request
/// never arrived whole, so it cannot have executed).
async fn write_whole(pool: &Pool, request: &[u8]) -> Result<Conn, SendError> {
    let mut conn = open(pool).await?;
    match conn.stream.write_all(request).await {
        Ok(()) => Ok(conn),
        Err(e) if conn.reused => {
            tracing::debug!(upstream = pool.authority(), error = %e, "pooled connection was closed; re-sending on a new one");
            let mut fresh = connect(pool).await?;
            fresh
                .stream
                .write_all(request)
                .await
                .map_err(|e| SendError::Broken(format!("writing the request failed: {e}")))?;
            Ok(fresh)
        }
        Err(e) => Err(SendError::Broken(format!(
            "writing the request failed: {e}"
        ))),
    }
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

enum StreamError {
    /// The client's side failed: the upstream got an incomplete request.
    Client(SendError),
    /// Writing to the upstream failed.
    Write(io::Error),
}

/// Streams a large or chunked body to the upstream, counting it against
/// `limit`. On a client-side failure the request is left incomplete on the
/// wire (no last chunk, or fewer bytes than declared) so that the upstream
/// can never execute it.
async fn stream_body(
    conn: &mut Conn,
    mut body: Body,
    framing: RequestFraming,
    limit: u64,
) -> Result<(), StreamError> {
    let mut sent: u64 = 0;
    let mut out = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame =
            frame.map_err(|e| StreamError::Client(SendError::RequestBody(e.to_string())))?;
        let Ok(data) = frame.into_data() else {
            continue; // request trailers are not forwarded
        };
        sent += data.len() as u64;
        if sent > limit {
            return Err(StreamError::Client(SendError::BodyTooLarge));
        }
        match framing {
            RequestFraming::Length(len) if sent > len => {
                return Err(StreamError::Client(SendError::RequestBody(
                    "body longer than declared".into(),
                )));
            }
            RequestFraming::Chunked => {
                out.clear();
                wire::encode_chunk(&mut out, &data);
                conn.stream.write_all(&out).await
            }
            _ => conn.stream.write_all(&data).await,
        }
        .map_err(StreamError::Write)?;
    }
    match framing {
        RequestFraming::Length(len) if sent != len => Err(StreamError::Client(
            SendError::RequestBody(format!("body of {sent} bytes, {len} declared")),
        )),
        RequestFraming::Chunked => conn
            .stream
            .write_all(LAST_CHUNK)
            .await
            .map_err(StreamError::Write),
        _ => Ok(()),
    }
}

async fn read_head(conn: &mut Conn, method: &Method) -> Result<ResponseHead, SendError> {
    loop {
        // A pooled connection's buffer is empty until the answer arrives.
        if !conn.read_buf.is_empty() {
            match wire::parse_response_head(&mut conn.read_buf, method) {
                Ok(Some(head)) => return Ok(head),
                Ok(None) => {}
                Err(e) => return Err(SendError::Broken(e.to_string())),
            }
        }
        if conn.read_buf.capacity() - conn.read_buf.len() < HEAD_READ_BYTES / 2 {
            conn.read_buf.reserve(HEAD_READ_BYTES);
        }
        match conn.stream.read_buf(&mut conn.read_buf).await {
            Ok(0) => {
                return Err(SendError::Broken(
                    "connection closed before message completed".into(),
                ));
            }
            Ok(_) => {}
            Err(e) => return Err(SendError::Broken(format!("reading the answer failed: {e}"))),
        }
    }
}

/// The answer as a response: whole when its body is already buffered (the
/// connection then goes back to the pool at once), streamed otherwise.
fn into_response(head: ResponseHead, mut conn: Conn, pool: &Arc<Pool>) -> Response<Body> {
    let ResponseHead {
        status,
        headers,
        framing,
        reusable,
    } = head;
    let body = match framing {
        BodyFraming::Empty => {
            if reusable {
                pool.checkin(conn);
            }
            Body::empty()
        }
        BodyFraming::Length(len) if (conn.read_buf.len() as u64) >= len => {
            let data = conn.read_buf.split_to(len as usize).freeze();
            if reusable {
                pool.checkin(conn);
            }
            Body::from(data)
        }
        BodyFraming::Length(len) => Body::new(UpstreamBody::new(
            conn,
            pool.clone(),
            Remaining::Length(len),
            VecDeque::new(),
            reusable,
        )),
        BodyFraming::Chunked => chunked_body(conn, pool, reusable),
        BodyFraming::UntilClose => Body::new(UpstreamBody::new(
            conn,
            pool.clone(),
            Remaining::UntilClose,
            VecDeque::new(),
            false,
        )),
    };
    let mut response = Response::new(body);
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}

/// A chunked body: decoded whole from the buffer when its last chunk is
/// already there, streamed otherwise. A malformed chunk becomes a body
/// error, so the client sees a broken answer rather than a wrong one.
fn chunked_body(mut conn: Conn, pool: &Arc<Pool>, reusable: bool) -> Body {
    let mut decoder = ChunkedDecoder::default();
    let mut decoded = VecDeque::new();
    loop {
        match decoder.decode(&mut conn.read_buf) {
            Ok(Decoded::Data(data)) => decoded.push_back(data),
            Ok(Decoded::Done) => {
                if reusable {
                    pool.checkin(conn);
                }
                return match decoded.len() {
                    0 => Body::empty(),
                    1 => Body::from(decoded.pop_front().unwrap_or_default()),
                    _ => {
                        let mut whole = BytesMut::new();
                        decoded.iter().for_each(|d| whole.extend_from_slice(d));
                        Body::from(whole.freeze())
                    }
                };
            }
            Ok(Decoded::NeedMore) => {
                return Body::new(UpstreamBody::new(
                    conn,
                    pool.clone(),
                    Remaining::Chunked(decoder),
                    decoded,
                    reusable,
                ));
            }
            Err(e) => {
                return Body::new(http_body_util::StreamBody::new(futures_util::stream::once(
                    async move { Err::<http_body::Frame<Bytes>, WireError>(e) },
                )));
            }
        }
    }
}
