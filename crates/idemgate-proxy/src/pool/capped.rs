//! HTTP/1.1 connections under `upstreams[].max_connections`: the queue.
//!
//! A worker's requests past its share wait, first come first served, for
//! a returned connection, which `Pool::checkin` hands straight to the
//! longest waiting (under the idle list's lock, which registering a waiter
//! also takes, so no hand-off is missed), or for a place freed by a
//! connection that closed. Waiting and opening end by the request's one
//! deadline, so a request that got no connection fails as never sent.

use std::sync::Arc;

use axum::body::Body;
use hyper::client::conn::http1;
use tokio::sync::{Semaphore, oneshot};

use super::{Checked, Found, Idle, POOL_IDLE_TIMEOUT, Pool, lock};
use crate::connect::{ConnectError, Sender};

impl Pool {
    /// An HTTP/1.1 connection under the cap: an idle one (unless `fresh`),
    /// a new one while there is room, else the next to come back (or a
    /// place freed by one that closed), first come first served. Waiting
    /// and opening end at `deadline`, below the upstream timeout, so a
    /// request that got no connection is reported as never sent
    /// (`Busy`), not as timed out upstream.
    pub(super) async fn wait_for_h1(
        &self,
        limit: &Arc<Semaphore>,
        deadline: tokio::time::Instant,
        fresh: bool,
    ) -> Result<Checked, ConnectError> {
        let mut waited = false;
        loop {
            let next = {
                let mut idle = lock(&self.idle);
                if !fresh && let Some(sender) = ready_idle(&mut idle) {
                    return Ok(reused_h1(sender));
                }
                if let Ok(place) = limit.clone().try_acquire_owned() {
                    Next::Open(place)
                } else if let Some(sender) = (!fresh).then(|| settling_idle(&mut idle)).flatten() {
                    // Came back, its dispatcher yet to run: a scheduler
                    // turn from ready, and no one would hand it over again.
                    Next::Settling(sender)
                } else {
                    let (tx, rx) = oneshot::channel();
                    let mut waiters = lock(&self.waiters);
                    // Those that stopped waiting (timed out, or got a
                    // place) are only removed by a checkin: swept here as
                    // the queue grows.
                    if waiters.len() >= 64 && waiters.len().is_power_of_two() {
                        waiters.retain(|w| !w.is_closed());
                    }
                    waiters.push_back(tx);
                    Next::Wait(HandOff { rx, pool: self })
                }
            };
            let mut sender = match next {
                Next::Open(place) => return self.open_h1_until(place, deadline, waited).await,
                Next::Settling(sender) => {
                    waited = true;
                    sender
                }
                Next::Wait(mut handed) => {
                    waited = true;
                    let handed_over = tokio::select! {
                        sender = &mut handed.rx => sender.ok(),
                        place = limit.clone().acquire_owned() => {
                            drop(handed); // a connection handed meanwhile goes on
                            match place {
                                Ok(place) => return self.open_h1_until(place, deadline, true).await,
                                Err(_) => None,
                            }
                        }
                        () = tokio::time::sleep_until(deadline) => return Err(ConnectError::Busy),
                    };
                    match handed_over {
                        Some(sender) => sender,
                        None => continue,
                    }
                }
            };
            match tokio::time::timeout_at(deadline, sender.ready()).await {
                Ok(Ok(())) => return Ok(reused_h1(sender)),
                // Closed: its place comes back when its task ends.
                Ok(Err(_)) => continue,
                Err(_) => {
                    self.checkin(sender);
                    return Err(ConnectError::Busy);
                }
            }
        }
    }

    /// Opens a connection in `place`, by `deadline`. A request that waited
    /// for its place and then ran out of time was held up by the cap
    /// (`Busy`); one that did not wait met a connect that timed out.
    async fn open_h1_until(
        &self,
        place: tokio::sync::OwnedSemaphorePermit,
        deadline: tokio::time::Instant,
        waited: bool,
    ) -> Result<Checked, ConnectError> {
        let sender = match tokio::time::timeout_at(deadline, self.connector.open(Some(place))).await
        {
            Ok(opened) => opened?,
            Err(_) if waited => return Err(ConnectError::Busy),
            Err(_) => {
                return Err(ConnectError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "connect timed out",
                )));
            }
        };
        Ok(Checked {
            sender,
            reused: false,
            first: true,
            stream: None,
        })
    }
}

/// What a request under the cap does next, decided under the idle lock.
enum Next<'a> {
    /// Open a connection in this free place.
    Open(tokio::sync::OwnedSemaphorePermit),
    /// Wait for this returned connection to become ready.
    Settling(http1::SendRequest<Body>),
    /// Queue for the next connection to come back.
    Wait(HandOff<'a>),
}

/// A request's place in the queue for a returned HTTP/1.1 connection. A
/// request that stops waiting (it got a place, ran out of time, or its
/// client hung up) passes on a connection handed to it meanwhile.
struct HandOff<'a> {
    rx: oneshot::Receiver<http1::SendRequest<Body>>,
    pool: &'a Pool,
}

impl Drop for HandOff<'_> {
    fn drop(&mut self) {
        self.rx.close();
        if let Ok(sender) = self.rx.try_recv() {
            self.pool.checkin(sender);
        }
    }
}

/// The most recently used open, ready idle HTTP/1.1 connection, taken out
/// of `idle`. Last in, first out: the warmest connection is the least
/// likely to be closing. Open but not yet ready ones (their dispatcher has
/// not run since the answer ended) stay for the next checkout.
pub(super) fn ready_idle(idle: &mut Vec<Idle>) -> Option<http1::SendRequest<Body>> {
    let mut settling = Vec::new();
    let found = loop {
        let Some(entry) = idle.pop() else { break None };
        if entry.since.elapsed() >= POOL_IDLE_TIMEOUT {
            idle.clear(); // everything below it is older still
            break None;
        }
        if entry.sender.is_closed() {
            continue;
        }
        if entry.sender.is_ready() {
            break Some(entry.sender);
        }
        settling.push(entry);
    };
    idle.extend(settling.into_iter().rev());
    found
}

/// The most recently returned open HTTP/1.1 connection that is not ready
/// yet, taken out of `idle`.
fn settling_idle(idle: &mut Vec<Idle>) -> Option<http1::SendRequest<Body>> {
    let at = idle
        .iter()
        .rposition(|e| !e.sender.is_closed() && e.since.elapsed() < POOL_IDLE_TIMEOUT)?;
    Some(idle.remove(at).sender)
}

fn reused_h1(sender: http1::SendRequest<Body>) -> Checked {
    Found(Sender::Http1(sender), None).reused()
}
