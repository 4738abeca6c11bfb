//! Reading bodies the engine must hold: the request (to fingerprint and
//! replay it to the upstream) and the response (to store it).

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http::request::Parts;
use http_body_util::BodyExt;
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
    #[error(
        "the process holds server.max_buffered_bytes of bodies (requests read, answers awaiting their record)"
    )]
    Budget,
}

/// The bytes of request bodies the process holds at once
/// (`server.max_buffered_bytes`, docs/semantics.md, rule 10): protected routes
/// buffer each body whole to fingerprint it, and `max_body_bytes` bounds
/// one body, not how many arrive together (10,000 connections, or 128
/// streams of one HTTP/2 connection, each sending a megabyte). Counted in
/// KiB; a body that would go past the budget is refused (`503`) before
/// anything is claimed. Answers captured for their record count against
/// it too ([`capture`]).
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

/// A response body as captured for storage.
pub enum Captured {
    /// The whole body, within the cap.
    Whole(Bytes),
    /// Over the cap: what was read, and the rest still to stream.
    TooLarge(Bytes, Body),
    /// The upstream connection broke mid-body.
    Broken(String),
}

/// Reads a response body up to `cap` bytes, holding what it keeps against
/// `budget` (`server.max_buffered_bytes`, shared with request bodies) until
/// the returned share is dropped, once the answer is recorded. With the
/// budget spent, the answer is streamed on and recorded without its body,
/// as one over the cap is: answers waiting for their record (a slow or
/// absent store) hold at most the budget, though the copy a slow client is
/// still reading is its connection's, not counted here.
pub async fn capture(mut body: Body, cap: usize, budget: &BodyBudget) -> (Captured, Buffered) {
    let mut held: Buffered = None;
    // Sized from the body's own length when it has one: a buffer grown by
    // doubling holds up to twice the body, and the stored copy (kept for
    // the whole retention by the in-process layer) would hold it all.
    let expected = http_body::Body::size_hint(&body).exact();
    let mut buffer = match expected {
        Some(n) if n as usize <= cap => {
            if budget.take(&mut held, n as usize).is_err() {
                return (Captured::TooLarge(Bytes::new(), body), None);
            }
            BytesMut::with_capacity(n as usize)
        }
        _ => BytesMut::new(),
    };
    // Bytes the share covers so far (it is taken in whole KiB).
    let mut covered = match expected {
        Some(n) if n as usize <= cap => (n as usize).div_ceil(1024) * 1024,
        _ => 0,
    };
    let captured = loop {
        match body.frame().await {
            None => {
                if buffer.capacity() > buffer.len() + buffer.len() / 4 + 64 {
                    // Grown past its length: keep an exact copy instead.
                    break Captured::Whole(Bytes::copy_from_slice(&buffer));
                }
                break Captured::Whole(buffer.freeze());
            }
            Some(Err(e)) => return (Captured::Broken(e.to_string()), None),
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else {
                    continue; // trailers are not stored
                };
                buffer.extend_from_slice(&data);
                if buffer.len() > cap {
                    return (Captured::TooLarge(buffer.freeze(), body), None);
                }
                if buffer.len() > covered {
                    let more = buffer.len() - covered;
                    if budget.take(&mut held, more).is_err() {
                        return (Captured::TooLarge(buffer.freeze(), body), None);
                    }
                    covered += more.div_ceil(1024) * 1024;
                }
            }
        }
    };
    (captured, held)
}

/// `prefix` followed by the rest of `body`, streamed.
pub fn chain(prefix: Bytes, body: Body) -> Body {
    let head = futures_util::stream::once(async move { Ok::<_, axum::Error>(prefix) });
    Body::from_stream(head.chain(body.into_data_stream()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer of known length is counted before a byte is read; with
    /// the budget spent it is passed on whole, nothing kept.
    #[tokio::test]
    async fn an_answer_of_known_length_past_the_budget_is_passed_on_whole() {
        let budget = BodyBudget::new(2048);
        let (first, held) = capture(Body::from(vec![b'a'; 2000]), 4096, &budget).await;
        assert!(matches!(&first, Captured::Whole(b) if b.len() == 2000));
        assert!(held.is_some());
        // The first answer's share is still held: 2 KiB more do not fit.
        let (second, none) = capture(Body::from(vec![b'b'; 2000]), 4096, &budget).await;
        assert!(none.is_none());
        let Captured::TooLarge(prefix, rest) = second else {
            panic!("kept past the budget");
        };
        let whole = axum::body::to_bytes(chain(prefix, rest), usize::MAX)
            .await
            .unwrap();
        assert_eq!(whole, vec![b'b'; 2000]);
        // Given back, it fits.
        drop(held);
        let (third, _) = capture(Body::from(vec![b'c'; 2000]), 4096, &budget).await;
        assert!(matches!(third, Captured::Whole(b) if b.len() == 2000));
    }
}
