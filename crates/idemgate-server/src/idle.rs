//! HTTP/2 connections with nothing to do are closed (GOAWAY) after
//! `server.header_read_timeout`, as an idle HTTP/1.1 keep-alive connection
//! is by hyper's header-read timer: otherwise a client could hold
//! `max_connections` h2 connections open forever without sending a request
//! (pings keep a silent peer alive). A request counts as in flight from its
//! head until its response body has been sent; a graceful close lets
//! streams in flight finish, and only a connection with none is idle.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response};
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
        // The time first: a watcher that sees zero in flight must also
        // see when it became zero, not an older change.
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.0.changed.notify_one();
    }
}

/// A response body that keeps its request counted until it has been sent
/// (or dropped): a stream still carrying its body is busy, not idle.
struct Counted {
    inner: Body,
    _in_flight: InFlight,
}

impl http_body::Body for Counted {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl<S> hyper::service::Service<Request<Incoming>> for Busy<S>
where
    S: hyper::service::Service<Request<Incoming>, Response = Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, S::Error>> + Send>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        self.activity.in_flight.fetch_add(1, Ordering::AcqRel);
        self.activity.touch();
        self.activity.changed.notify_one();
        let guard = InFlight(self.activity.clone());
        let answer = self.inner.call(req);
        Box::pin(async move {
            // An error answer drops the guard here; an answer hands it to
            // its body.
            let response = answer.await?;
            Ok(response.map(|inner| {
                Body::new(Counted {
                    inner,
                    _in_flight: guard,
                })
            }))
        })
    }
}
