//! Reading the request bodies the engine must hold: to fingerprint them
//! and replay them to the upstream. Answers are kept by `answer`.

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http::request::Parts;
use sha2::{Digest, Sha256};

/// Why a request body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// Over the route's body limit.
    #[error("request body over {limit} bytes")]
    TooLarge {
        /// The limit, in bytes.
        limit: u64,
    },
    /// The body could not be read (the client's stream failed).
    #[error("reading the request body failed: {0}")]
    Broken(String),
    /// Buffering it would pass the process's budget of buffered bodies.
    #[error("the process holds server.max_buffered_bytes of request bodies")]
    Budget,
}

/// The bytes of request bodies the process holds at once
/// (`server.max_buffered_bytes`, docs/semantics.md, rule 10): protected routes
/// buffer each body whole to fingerprint it, and `max_body_bytes` bounds
/// one body, not how many arrive together (10,000 connections, or 128
/// streams of one HTTP/2 connection, each sending a megabyte). Counted in
/// KiB; a body that would go past the budget is refused (`503`) before
/// anything is claimed.
#[derive(Clone, Debug)]
pub struct BodyBudget(std::sync::Arc<tokio::sync::Semaphore>);

/// A body's share of the budget, given back when dropped.
pub type Buffered = Option<tokio::sync::OwnedSemaphorePermit>;

impl BodyBudget {
    /// At most `bytes` buffered at once.
    pub fn new(bytes: u64) -> Self {
        let kib = usize::try_from(bytes / 1024)
            .unwrap_or(usize::MAX)
            .min(tokio::sync::Semaphore::MAX_PERMITS);
        BodyBudget(std::sync::Arc::new(tokio::sync::Semaphore::new(kib.max(1))))
    }

    /// A budget no workload reaches (library use, tests).
    pub fn unbounded() -> Self {
        BodyBudget(std::sync::Arc::new(tokio::sync::Semaphore::new(
            tokio::sync::Semaphore::MAX_PERMITS,
        )))
    }

    /// Takes `bytes` more for `held` (growing it), or fails.
    fn take(&self, held: &mut Buffered, bytes: usize) -> Result<(), BodyError> {
        let kib = u32::try_from(bytes.div_ceil(1024)).map_err(|_| BodyError::Budget)?;
        if kib == 0 {
            return Ok(());
        }
        let more = self
            .0
            .clone()
            .try_acquire_many_owned(kib)
            .map_err(|_| BodyError::Budget)?;
        match held {
            Some(permit) => permit.merge(more),
            None => *held = Some(more),
        }
        Ok(())
    }
}

/// Reads the request body (at most `limit` bytes, counted against
/// `budget`), hashing it as it arrives: fingerprint = SHA-256 over method,
/// path and query, and body.
pub async fn read_and_fingerprint(
    parts: &Parts,
    body: Body,
    limit: u64,
    budget: &BodyBudget,
) -> Result<(Bytes, String, Buffered), BodyError> {
    let declared = parts
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit) {
        return Err(BodyError::TooLarge { limit });
    }
    let mut buffered: Buffered = None;
    // A declared length is taken up front: a body that cannot fit is
    // refused before a byte of it is read.
    if let Some(len) = declared {
        budget.take(&mut buffered, len as usize)?;
    }
    let mut hash = Sha256::new();
    hash.update(parts.method.as_str().as_bytes());
    hash.update([0]);
    let target = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    hash.update(target.as_bytes());
    hash.update([0]);
    let mut buffer = BytesMut::with_capacity(declared.unwrap_or(0) as usize);
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| BodyError::Broken(e.to_string()))?;
        if (buffer.len() + chunk.len()) as u64 > limit {
            return Err(BodyError::TooLarge { limit });
        }
        if declared.is_none() {
            budget.take(&mut buffered, chunk.len())?;
        }
        hash.update(&chunk);
        buffer.extend_from_slice(&chunk);
    }
    Ok((buffer.freeze(), hex::encode(hash.finalize()), buffered))
}

/// The fingerprint of a request identified by its business key (a
/// callback, a message) rather than by its bytes: the key and the values
/// of the `must_match` fields (`None`: absent), so that a redelivery
/// re-stamped with a new timestamp or attempt counter is the same request,
/// and one whose amount changed is not. A domain of its own: never equal
/// to a whole-request fingerprint.
pub fn key_fingerprint<'a>(
    key: &str,
    fields: impl IntoIterator<Item = (&'a str, Option<&'a str>)>,
) -> String {
    let mut hash = Sha256::new();
    hash.update(b"idemgate/fingerprint/business-key/v1\0");
    let part = |hash: &mut Sha256, bytes: &[u8]| {
        hash.update((bytes.len() as u64).to_be_bytes());
        hash.update(bytes);
    };
    part(&mut hash, key.as_bytes());
    for (name, value) in fields {
        part(&mut hash, name.as_bytes());
        match value {
            Some(value) => part(&mut hash, value.as_bytes()),
            // Absent differs from every value, the empty one included.
            None => hash.update(u64::MAX.to_be_bytes()),
        }
    }
    format!("k1:{}", hex::encode(hash.finalize()))
}

/// `prefix` followed by the rest of `body`, streamed, its trailers
/// included (a gRPC answer's status travels in them).
pub fn chain(prefix: Bytes, body: Body) -> Body {
    Body::new(Chained {
        prefix: Some(prefix).filter(|p| !p.is_empty()),
        rest: body,
    })
}

struct Chained {
    prefix: Option<Bytes>,
    rest: Body,
}

impl http_body::Body for Chained {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        if let Some(prefix) = self.prefix.take() {
            return std::task::Poll::Ready(Some(Ok(http_body::Frame::data(prefix))));
        }
        std::pin::Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.rest.is_end_stream()
    }
}
