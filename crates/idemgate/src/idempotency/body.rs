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
    pub fn take(&self, held: &mut Buffered, bytes: usize) -> Result<(), BodyError> {
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

/// An answer body of at most this many bytes is always kept for its
/// record: each claim reserves it from the answer budget before it is made.
pub const ANSWER_RESERVE_BYTES: usize = 64 * 1024;
/// `server.max_captured_bytes`: 4,096 claims' reserves, or 256 answers of
/// the default largest stored size.
pub const DEFAULT_MAX_CAPTURED_BYTES: u64 = 256 * 1024 * 1024;
/// Longest wait for answer budget before a larger answer is passed on
/// without keeping its body: the budget frees as records are written.
pub const CAPTURE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// One claim's share of the budget of answer bodies held until their
/// record is written (`server.max_captured_bytes`, docs/semantics.md,
/// rule 10). `max_stored_body_bytes` bounds one answer, not how many wait
/// for their record together (a store writing slowly, 20,000 claims each
/// answered with a megabyte). The share is taken when the claim is counted,
/// before it is made: [`ANSWER_RESERVE_BYTES`] (or the route's whole cap,
/// if lower), so an answer that small is always kept whatever else is
/// held. A larger answer grows its share while it arrives — all at once
/// when its length is known — waiting at most [`CAPTURE_WAIT`]; when there
/// is no room it is passed on whole and recorded without its body, as an
/// answer over the cap is. Given back when the holder has finished.
pub struct AnswerShare {
    budget: BodyBudget,
    held: Buffered,
}

impl AnswerShare {
    /// The reserve for an answer of at most `cap` bytes, or `Budget` when
    /// the process holds `server.max_captured_bytes` already.
    pub fn reserve(budget: &BodyBudget, cap: usize) -> Result<Self, BodyError> {
        let mut held = None;
        budget.take(&mut held, cap.min(ANSWER_RESERVE_BYTES))?;
        Ok(AnswerShare {
            budget: budget.clone(),
            held,
        })
    }

    /// A share of a budget no workload reaches (tests).
    pub fn unbounded() -> Self {
        AnswerShare {
            budget: BodyBudget::unbounded(),
            held: None,
        }
    }

    /// Bytes the share covers.
    pub fn bytes(&self) -> usize {
        self.held.as_ref().map_or(0, |p| p.num_permits() * 1024)
    }

    /// Grows the share to `total` bytes, waiting until `until` for room;
    /// false when there was none.
    async fn cover(&mut self, total: usize, until: tokio::time::Instant) -> bool {
        let Ok(want) = u32::try_from(total.div_ceil(1024)) else {
            return false;
        };
        let held = self.held.as_ref().map_or(0, |p| p.num_permits() as u32);
        if want <= held {
            return true;
        }
        let more = self.budget.0.clone().try_acquire_many_owned(want - held);
        let more = match more {
            Ok(more) => more,
            Err(_) => {
                let wait = self.budget.0.clone().acquire_many_owned(want - held);
                match tokio::time::timeout_at(until, wait).await {
                    Ok(Ok(more)) => more,
                    _ => return false,
                }
            }
        };
        match &mut self.held {
            Some(permit) => permit.merge(more),
            None => self.held = Some(more),
        }
        true
    }
}

/// A response body as captured for storage.
pub enum Captured {
    /// The whole body, within the cap.
    Whole(Bytes),
    /// Over the cap: what was read, and the rest still to stream.
    TooLarge(Bytes, Body),
    /// Within the cap, but the answer budget had no room for it within
    /// [`CAPTURE_WAIT`]: what was read, and the rest still to stream.
    NoRoom(Bytes, Body),
    /// The upstream connection broke mid-body.
    Broken(String),
}

/// Reads a response body up to `cap` bytes, kept within `share`, which may
/// wait for room until `until`.
pub async fn capture(
    mut body: Body,
    cap: usize,
    share: &mut AnswerShare,
    until: tokio::time::Instant,
) -> Captured {
    // Sized from the body's own length when it has one: a buffer grown by
    // doubling holds up to twice the body, and the stored copy (kept for
    // the whole retention by the in-process layer) would hold it all.
    let expected = http_body::Body::size_hint(&body).exact();
    let mut buffer = match expected {
        Some(n) if n as usize <= cap => {
            // Room for the whole answer at once: growing chunk by chunk,
            // two answers could each hold half of what both need.
            if !share.cover(n as usize, until).await {
                return Captured::NoRoom(Bytes::new(), body);
            }
            BytesMut::with_capacity(n as usize)
        }
        _ => BytesMut::new(),
    };
    loop {
        match body.frame().await {
            None => {
                if buffer.capacity() > buffer.len() + buffer.len() / 4 + 64 {
                    // Grown past its length: keep an exact copy instead.
                    return Captured::Whole(Bytes::copy_from_slice(&buffer));
                }
                return Captured::Whole(buffer.freeze());
            }
            Some(Err(e)) => return Captured::Broken(e.to_string()),
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else {
                    continue; // trailers are not stored
                };
                let total = buffer.len() + data.len();
                buffer.extend_from_slice(&data);
                if total > cap {
                    return Captured::TooLarge(buffer.freeze(), body);
                }
                if !share.cover(total, until).await {
                    return Captured::NoRoom(buffer.freeze(), body);
                }
            }
        }
    }
}

/// `prefix` followed by the rest of `body`, streamed.
pub fn chain(prefix: Bytes, body: Body) -> Body {
    let head = futures_util::stream::once(async move { Ok::<_, axum::Error>(prefix) });
    Body::from_stream(head.chain(body.into_data_stream()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::time::Instant;

    const KIB: usize = 1024;

    fn chunks(parts: &[usize]) -> Body {
        let parts: Vec<Result<Bytes, std::io::Error>> = parts
            .iter()
            .map(|n| Ok(Bytes::from(vec![b'a'; *n])))
            .collect();
        Body::from_stream(futures_util::stream::iter(parts))
    }

    async fn whole(body: Body) -> usize {
        body.collect().await.unwrap().to_bytes().len()
    }

    #[test]
    fn each_claim_reserves_its_small_answer_before_it_is_made() {
        let budget = BodyBudget::new(128 * KIB as u64);
        let a = AnswerShare::reserve(&budget, 1024 * KIB).unwrap();
        let _b = AnswerShare::reserve(&budget, 1024 * KIB).unwrap();
        assert_eq!(a.bytes(), ANSWER_RESERVE_BYTES);
        assert!(AnswerShare::reserve(&budget, 1024 * KIB).is_err());
        drop(a);
        // A route whose cap is lower reserves only its cap.
        let c = AnswerShare::reserve(&budget, 4 * KIB).unwrap();
        assert_eq!(c.bytes(), 4 * KIB);
    }

    #[tokio::test(start_paused = true)]
    async fn a_small_answer_is_kept_whatever_else_is_held() {
        let budget = BodyBudget::new(128 * KIB as u64);
        let mut a = AnswerShare::reserve(&budget, 1024 * KIB).unwrap();
        let mut b = AnswerShare::reserve(&budget, 1024 * KIB).unwrap();
        let until = Instant::now() + CAPTURE_WAIT;
        let started = Instant::now();
        match capture(Body::from(vec![b'x'; 60 * KIB]), 1024 * KIB, &mut a, until).await {
            Captured::Whole(bytes) => assert_eq!(bytes.len(), 60 * KIB),
            _ => panic!("a small answer was not kept"),
        }
        match capture(chunks(&[30 * KIB, 34 * KIB]), 1024 * KIB, &mut b, until).await {
            Captured::Whole(bytes) => assert_eq!(bytes.len(), 64 * KIB),
            _ => panic!("a small answer of unknown length was not kept"),
        }
        assert_eq!(started.elapsed(), Duration::ZERO, "neither waited");
    }

    #[tokio::test(start_paused = true)]
    async fn a_larger_answer_without_room_is_passed_on_after_the_wait() {
        let budget = BodyBudget::new(128 * KIB as u64);
        let _held = AnswerShare::reserve(&budget, 1024 * KIB).unwrap();
        let mut share = AnswerShare::reserve(&budget, 1024 * KIB).unwrap();
        // Known length: room for all of it at once, or none is taken.
        let started = Instant::now();
        let until = started + CAPTURE_WAIT;
        match capture(
            Body::from(vec![b'x'; 100 * KIB]),
            1024 * KIB,
            &mut share,
            until,
        )
        .await
        {
            Captured::NoRoom(prefix, rest) => {
                assert_eq!(started.elapsed(), CAPTURE_WAIT);
                assert_eq!(whole(chain(prefix, rest)).await, 100 * KIB);
            }
            _ => panic!("kept beyond the budget"),
        }
        assert_eq!(share.bytes(), ANSWER_RESERVE_BYTES, "nothing taken");
        // Unknown length: grown chunk by chunk; what was read goes on.
        let until = Instant::now() + CAPTURE_WAIT;
        let body = chunks(&[50 * KIB, 50 * KIB, 50 * KIB]);
        match capture(body, 1024 * KIB, &mut share, until).await {
            Captured::NoRoom(prefix, rest) => {
                assert_eq!(prefix.len(), 100 * KIB, "stopped at the second chunk");
                assert_eq!(whole(chain(prefix, rest)).await, 150 * KIB);
            }
            _ => panic!("kept beyond the budget"),
        }
        assert_eq!(share.bytes(), ANSWER_RESERVE_BYTES);
    }

    #[tokio::test(start_paused = true)]
    async fn a_larger_answer_waits_for_room_a_record_gives_back() {
        let budget = BodyBudget::new(128 * KIB as u64);
        let held = AnswerShare::reserve(&budget, 1024 * KIB).unwrap();
        let mut share = AnswerShare::reserve(&budget, 1024 * KIB).unwrap();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            drop(held);
        });
        let started = Instant::now();
        let until = started + CAPTURE_WAIT;
        match capture(
            Body::from(vec![b'x'; 100 * KIB]),
            1024 * KIB,
            &mut share,
            until,
        )
        .await
        {
            Captured::Whole(bytes) => assert_eq!(bytes.len(), 100 * KIB),
            _ => panic!("not kept once room was given back"),
        }
        assert_eq!(started.elapsed(), Duration::from_millis(300));
        assert_eq!(share.bytes(), 100 * KIB);
    }
}
