//! Answers kept for their record: the budget they count against and the
//! capture that reads them.
//!
//! A won claim's holder reads the upstream's answer whole, hands it to the
//! client and keeps it until the record is written. `max_stored_body_bytes`
//! bounds one answer, not how many wait for their record together (a store
//! writing slowly, thousands of claims each answered with a megabyte), so
//! they count against one budget, `server.max_captured_bytes`
//! (docs/semantics.md, rule 10):
//!
//! - Each claim reserves `ANSWER_RESERVE_BYTES` (or its route's cap, if
//!   lower) *before* it is made. When the reserves and the answers held
//!   fill the budget, the next claim is refused (`503`), nothing recorded
//!   or forwarded.
//! - An answer within its reserve is kept at once. A larger one takes the
//!   rest of its length from the budget as it arrives — all of it at once
//!   when its length is known, so two answers cannot each hold half of
//!   what both need — and waits for room that records being written give
//!   back, at most `CAPTURE_WAIT`.
//! - Still without room it is kept all the same: the claim was accepted
//!   and its answer is in hand, and a stored answer is replayed with its
//!   body unless it is over the cap. The budget is then passed only by
//!   claims made while it had room (and an operator's reconcile action),
//!   and no new claim is made until it has room again: the held bytes stay
//!   below the budget plus, per claim in flight, its cap. While it is full,
//!   what records give back usually goes to new claims' reserves first,
//!   so a larger answer then waits the whole wait.
//!
//! Counted are answer bytes, not allocations: a body of unknown length
//! grows its buffer by doubling and may hold up to twice its length for a
//! moment.
//!
//! Counted in bytes with an atomic rather than a semaphore: a semaphore's
//! waiters take the permits given back in turn, so one answer waiting for
//! room would refuse every new claim meanwhile, and its permits cannot go
//! past the limit.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use tokio::sync::Notify;
use tokio::time::Instant;

/// An answer body of at most this many bytes is always kept at once: each
/// claim reserves it before it is made.
pub(crate) const ANSWER_RESERVE_BYTES: usize = 64 * 1024;
/// `server.max_captured_bytes`: the reserves of 4,096 claims, or 256
/// answers of the default largest stored size.
pub const DEFAULT_MAX_CAPTURED_BYTES: u64 = 256 * 1024 * 1024;
/// Longest wait for room before a larger answer is kept past the budget.
pub(crate) const CAPTURE_WAIT: Duration = Duration::from_secs(1);
/// At most one warning this often when answers are kept past the budget.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// The process's budget of answer bytes held until their record is
/// written. Cheap to clone.
#[derive(Clone, Debug)]
pub struct AnswerBudget(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    limit: u64,
    held: AtomicU64,
    /// Woken whenever a share is given back.
    freed: Notify,
    /// When answers were last logged as kept past the budget (ms since
    /// `started`; `u64::MAX`: never).
    warned_ms: AtomicU64,
    started: std::time::Instant,
}

impl AnswerBudget {
    /// At most `bytes` held at once (passed only as the module says).
    pub fn new(bytes: u64) -> Self {
        AnswerBudget(Arc::new(Inner {
            limit: bytes,
            held: AtomicU64::new(0),
            freed: Notify::new(),
            warned_ms: AtomicU64::new(u64::MAX),
            started: std::time::Instant::now(),
        }))
    }

    /// A budget no workload reaches (library use, tests).
    pub fn unbounded() -> Self {
        Self::new(u64::MAX / 2)
    }

    /// Bytes held right now: reserves and answers.
    pub fn held(&self) -> u64 {
        self.0.held.load(Ordering::Acquire)
    }

    /// Takes `bytes` if the budget has room for them.
    fn try_take(&self, bytes: u64) -> bool {
        self.0
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes)
                    .filter(|after| *after <= self.0.limit)
            })
            .is_ok()
    }

    /// Whether a warning about keeping past the budget is due now.
    fn warning_due(&self) -> bool {
        let now = self.0.started.elapsed().as_millis() as u64;
        let last = self.0.warned_ms.load(Ordering::Relaxed);
        let due = last == u64::MAX || now.saturating_sub(last) >= WARN_EVERY.as_millis() as u64;
        due && self
            .0
            .warned_ms
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }
}

/// One claim's share of the answer budget, given back when dropped (once
/// its record is written).
#[derive(Debug)]
pub(crate) struct AnswerShare {
    budget: AnswerBudget,
    bytes: u64,
    reserve: u64,
}

/// The budget is full: no claim may be made now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NoRoom;

impl AnswerShare {
    /// The reserve of a claim whose answers are kept up to `cap` bytes, or
    /// `NoRoom` when the budget is full.
    pub(crate) fn reserve(budget: &AnswerBudget, cap: usize) -> Result<Self, NoRoom> {
        let reserve = cap.min(ANSWER_RESERVE_BYTES) as u64;
        if !budget.try_take(reserve) {
            return Err(NoRoom);
        }
        Ok(AnswerShare {
            budget: budget.clone(),
            bytes: reserve,
            reserve,
        })
    }

    /// A share of nothing, to grow from `budget` (an operator's action,
    /// not a claim).
    pub(crate) fn empty(budget: &AnswerBudget) -> Self {
        AnswerShare {
            budget: budget.clone(),
            bytes: 0,
            reserve: 0,
        }
    }

    /// Bytes the share holds.
    #[cfg(test)]
    fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Grows the share to `total` bytes: waits until `until` for room,
    /// then takes it regardless (an answer in hand is never cut).
    async fn cover(&mut self, total: usize, until: Instant) {
        let more = (total as u64).saturating_sub(self.bytes);
        if more == 0 {
            return;
        }
        loop {
            let freed = self.budget.0.freed.notified();
            tokio::pin!(freed);
            // Registered before the check: a share given back between the
            // check and the wait still wakes it.
            freed.as_mut().enable();
            if self.budget.try_take(more) {
                break;
            }
            if tokio::time::timeout_at(until, freed).await.is_err() {
                self.budget.0.held.fetch_add(more, Ordering::AcqRel);
                if self.budget.warning_due() {
                    tracing::warn!(
                        layer = "holder",
                        held_bytes = self.budget.held(),
                        limit_bytes = self.budget.0.limit,
                        "answers kept past server.max_captured_bytes: the store writes records slower than answers arrive; no new claim is made until they are written"
                    );
                }
                break;
            }
        }
        self.bytes += more;
    }

    /// Gives back what the share took beyond its reserve (an answer that
    /// will not be kept: over the cap, broken, or given up on).
    pub(super) fn shrink(&mut self) {
        let extra = self.bytes - self.reserve;
        if extra > 0 {
            self.bytes = self.reserve;
            self.budget.0.held.fetch_sub(extra, Ordering::AcqRel);
            self.budget.0.freed.notify_waiters();
        }
    }
}

impl Drop for AnswerShare {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.budget.0.held.fetch_sub(self.bytes, Ordering::AcqRel);
            self.budget.0.freed.notify_waiters();
        }
    }
}

/// A response body as captured for storage.
pub(crate) enum Captured {
    /// The whole body, within the cap, and its trailers if it had any.
    Whole(Bytes, Option<http::HeaderMap>),
    /// Over the cap: what was read, and the rest still to stream.
    TooLarge(Bytes, Body),
    /// The upstream connection broke mid-body.
    Broken(String),
}

/// Reads a response body up to `cap` bytes, counted in `share`, which
/// waits for room until `until`.
pub(crate) async fn capture(
    mut body: Body,
    cap: usize,
    share: &mut AnswerShare,
    until: Instant,
) -> Captured {
    // Sized from the body's own length when it has one: a buffer grown by
    // doubling holds up to twice the body, and the stored copy (kept for
    // the whole retention by the in-process layer) would hold it all.
    let expected = http_body::Body::size_hint(&body).exact();
    let mut buffer = match expected {
        Some(n) if n as usize > cap => return Captured::TooLarge(Bytes::new(), body),
        Some(n) => {
            share.cover(n as usize, until).await;
            BytesMut::with_capacity(n as usize)
        }
        None => BytesMut::new(),
    };
    let mut trailers = None;
    loop {
        match body.frame().await {
            None => {
                if buffer.capacity() > buffer.len() + buffer.len() / 4 + 64 {
                    // Grown past its length: keep an exact copy instead.
                    return Captured::Whole(Bytes::copy_from_slice(&buffer), trailers);
                }
                return Captured::Whole(buffer.freeze(), trailers);
            }
            Some(Err(e)) => {
                share.shrink();
                return Captured::Broken(e.to_string());
            }
            Some(Ok(frame)) => {
                let data = match frame.into_data() {
                    Ok(data) => data,
                    Err(frame) => {
                        // A gRPC answer's status travels here.
                        trailers = frame.into_trailers().ok();
                        continue;
                    }
                };
                let total = buffer.len() + data.len();
                if total > cap {
                    buffer.extend_from_slice(&data);
                    share.shrink();
                    return Captured::TooLarge(buffer.freeze(), body);
                }
                share.cover(total, until).await;
                buffer.extend_from_slice(&data);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: usize = 1024;

    fn chunks(parts: &[usize]) -> Body {
        let parts: Vec<Result<Bytes, std::io::Error>> = parts
            .iter()
            .map(|n| Ok(Bytes::from(vec![b'a'; *n])))
            .collect();
        Body::from_stream(futures_util::stream::iter(parts))
    }

    /// The length of an answer kept whole.
    fn kept(captured: Captured) -> usize {
        match captured {
            Captured::Whole(bytes, _) => bytes.len(),
            _ => panic!("not kept whole"),
        }
    }

    /// The length kept of an answer of `bytes` (of known length) under a
    /// cap of a megabyte.
    async fn keep(bytes: usize, share: &mut AnswerShare, until: Instant) -> usize {
        kept(capture(Body::from(vec![b'x'; bytes]), 1024 * KIB, share, until).await)
    }

    async fn whole(body: Body) -> usize {
        body.collect().await.unwrap().to_bytes().len()
    }

    #[test]
    fn each_claim_reserves_its_small_answer_before_it_is_made() {
        let budget = AnswerBudget::new(128 * KIB as u64);
        let a = AnswerShare::reserve(&budget, 1024 * KIB).unwrap();
        let _b = AnswerShare::reserve(&budget, 1024 * KIB).unwrap();
        assert_eq!(a.bytes(), ANSWER_RESERVE_BYTES as u64);
        assert_eq!(
            AnswerShare::reserve(&budget, 1024 * KIB).unwrap_err(),
            NoRoom
        );
        drop(a);
        // A route whose cap is lower reserves only its cap.
        let c = AnswerShare::reserve(&budget, 4 * KIB).unwrap();
        assert_eq!(c.bytes(), 4 * KIB as u64);
        assert_eq!(budget.held(), 68 * KIB as u64);
    }

    #[tokio::test(start_paused = true)]
    async fn a_small_answer_is_kept_at_once_whatever_else_is_held() {
        let budget = AnswerBudget::new(128 * KIB as u64);
        let mut a = AnswerShare::reserve(&budget, 1024 * KIB).unwrap();
        let mut b = AnswerShare::reserve(&budget, 1024 * KIB).unwrap();
        let until = Instant::now() + CAPTURE_WAIT;
        let started = Instant::now();
        assert_eq!(
            keep(60 * KIB, &mut a, until).await,
            60 * KIB,
            "a small answer was not kept"
        );
        assert_eq!(
            kept(capture(chunks(&[30 * KIB, 34 * KIB]), 1024 * KIB, &mut b, until).await),
            64 * KIB,
            "a small answer of unknown length was not kept"
        );
        assert_eq!(started.elapsed(), Duration::ZERO, "neither waited");
        assert_eq!(budget.held(), 128 * KIB as u64);
    }

    #[tokio::test(start_paused = true)]
    async fn a_larger_answer_waits_for_room_then_is_kept_past_the_budget() {
        let budget = AnswerBudget::new(128 * KIB as u64);
        let held = AnswerShare::reserve(&budget, 1024 * KIB).unwrap();
        let mut share = AnswerShare::reserve(&budget, 1024 * KIB).unwrap();
        let started = Instant::now();
        let until = started + CAPTURE_WAIT;
        assert_eq!(
            keep(100 * KIB, &mut share, until).await,
            100 * KIB,
            "an answer in hand was not kept"
        );
        assert_eq!(started.elapsed(), CAPTURE_WAIT, "it waited for room first");
        assert_eq!(budget.held(), 164 * KIB as u64, "past the budget");
        // Meanwhile no claim is made.
        assert!(AnswerShare::reserve(&budget, 1024 * KIB).is_err());
        drop((held, share));
        assert_eq!(budget.held(), 0);
        assert!(AnswerShare::reserve(&budget, 1024 * KIB).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn a_larger_answer_takes_the_room_a_record_gives_back() {
        let budget = AnswerBudget::new(192 * KIB as u64);
        let held = AnswerShare::reserve(&budget, 1024 * KIB).unwrap();
        let mut share = AnswerShare::reserve(&budget, 1024 * KIB).unwrap();
        let mut other = AnswerShare::reserve(&budget, 1024 * KIB).unwrap();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            drop(held);
        });
        let started = Instant::now();
        let until = started + CAPTURE_WAIT;
        // Unknown length: grown chunk by chunk.
        let body = chunks(&[50 * KIB, 50 * KIB]);
        assert_eq!(
            kept(capture(body, 1024 * KIB, &mut share, until).await),
            100 * KIB,
            "not kept"
        );
        assert_eq!(started.elapsed(), Duration::from_millis(300));
        assert_eq!(budget.held(), 164 * KIB as u64, "within the budget");
        // While one answer waits, a small one and new claims are not held
        // up by it.
        let waiting = tokio::spawn({
            let budget = budget.clone();
            async move {
                let mut big = AnswerShare::empty(&budget);
                let until = Instant::now() + CAPTURE_WAIT;
                capture(
                    Body::from(vec![b'x'; 100 * KIB]),
                    1024 * KIB,
                    &mut big,
                    until,
                )
                .await;
            }
        });
        tokio::task::yield_now().await;
        assert_eq!(
            keep(10 * KIB, &mut other, until).await,
            10 * KIB,
            "not kept"
        );
        assert_eq!(started.elapsed(), Duration::from_millis(300));
        let fits = AnswerShare::reserve(&budget, 8 * KIB);
        assert!(fits.is_ok(), "a claim was refused while room was left");
        waiting.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_broken_answer_gives_back_what_it_took() {
        let budget = AnswerBudget::new(256 * KIB as u64);
        let mut share = AnswerShare::reserve(&budget, 1024 * KIB).unwrap();
        let parts: Vec<Result<Bytes, std::io::Error>> = vec![
            Ok(Bytes::from(vec![b'a'; 40 * KIB])),
            Ok(Bytes::from(vec![b'a'; 40 * KIB])),
            Err(std::io::Error::other("connection reset")),
        ];
        let body = Body::from_stream(futures_util::stream::iter(parts));
        let until = Instant::now() + CAPTURE_WAIT;
        assert!(matches!(
            capture(body, 1024 * KIB, &mut share, until).await,
            Captured::Broken(_)
        ));
        assert_eq!(budget.held(), ANSWER_RESERVE_BYTES as u64);
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_over_the_cap_takes_nothing_past_its_reserve() {
        let budget = AnswerBudget::new(128 * KIB as u64);
        let mut share = AnswerShare::reserve(&budget, 100 * KIB).unwrap();
        // Known length over the cap: passed on at once.
        match capture(
            Body::from(vec![b'x'; 200 * KIB]),
            100 * KIB,
            &mut share,
            Instant::now(),
        )
        .await
        {
            Captured::TooLarge(prefix, rest) => {
                assert!(prefix.is_empty());
                assert_eq!(
                    whole(super::super::body::chain(prefix, rest)).await,
                    200 * KIB
                );
            }
            _ => panic!("kept over the cap"),
        }
        // Unknown length: the second chunk grows the share past its
        // reserve, the third passes the cap; what was read goes on, the
        // growth is given back.
        let body = chunks(&[40 * KIB, 40 * KIB, 40 * KIB]);
        match capture(body, 100 * KIB, &mut share, Instant::now()).await {
            Captured::TooLarge(prefix, rest) => {
                assert_eq!(prefix.len(), 120 * KIB);
                assert_eq!(
                    whole(super::super::body::chain(prefix, rest)).await,
                    120 * KIB
                );
            }
            _ => panic!("kept over the cap"),
        }
        assert_eq!(share.bytes(), ANSWER_RESERVE_BYTES as u64);
        assert_eq!(budget.held(), ANSWER_RESERVE_BYTES as u64);
    }
}
