//! HTTP/2 connections with nothing to do are closed (GOAWAY) after
//! `server.header_read_timeout`, as an idle HTTP/1.1 keep-alive connection
//! is by hyper's header-read timer: otherwise a client could hold
//! `max_connections` h2 connections open forever without sending a request
//! (pings keep a silent peer alive). A graceful close lets streams in
//! flight finish; only a connection with none is idle.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::Request;
use hyper::body::Incoming;
use tokio::sync::Notify;
use tokio::time::Instant;

/// Requests in flight on one connection, and when that last changed.
#[derive(Debug)]
pub(super) struct Activity {
    in_flight: AtomicUsize,
    last_change: Mutex<Instant>,
    changed: Notify,
}

impl Activity {
    pub(super) fn new() -> Arc<Activity> {
        Arc::new(Activity {
            in_flight: AtomicUsize::new(0),
            last_change: Mutex::new(Instant::now()),
            changed: Notify::new(),
        })
    }

    fn touch(&self) {
        *self.last_change.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        self.changed.notify_one();
    }

    fn last_change(&self) -> Instant {
        *self.last_change.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Resolves once no request has been in flight for `timeout`.
    pub(super) async fn idle_for(&self, timeout: Duration) {
        loop {
            if self.in_flight.load(Ordering::Acquire) > 0 {
                self.changed.notified().await;
                continue;
            }
            let since = self.last_change();
            tokio::select! {
                _ = tokio::time::sleep_until(since + timeout) => {
                    if self.in_flight.load(Ordering::Acquire) == 0 && self.last_change() == since {
                        return;
                    }
                }
                _ = self.changed.notified() => {}
            }
        }
    }
}

/// Counts a connection's requests in flight, head to answer.
#[derive(Clone)]
pub(super) struct Busy<S> {
    pub(super) inner: S,
    pub(super) activity: Arc<Activity>,
}

/// Marks its request finished when dropped (answered or reset).
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.0.touch();
    }
}

impl<S> hyper::service::Service<Request<Incoming>> for Busy<S>
where
    S: hyper::service::Service<Request<Incoming>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        self.activity.in_flight.fetch_add(1, Ordering::AcqRel);
        self.activity.touch();
        let guard = InFlight(self.activity.clone());
        let answer = self.inner.call(req);
        Box::pin(async move {
            let answered = answer.await;
            drop(guard);
            answered
        })
    }
}
