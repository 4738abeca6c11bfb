//! Keep-alive connections to one upstream, owned by one worker thread.
//!
//! Every worker thread builds its own routes, so every worker has its own
//! pool per upstream, and the connections' tasks run on that worker's
//! runtime. Each connection is driven by hyper's client dispatcher, which
//! keeps reading it while it sits idle: an upstream that closes it, or
//! sends bytes no request asked for, has the connection closed at once,
//! and checkout only hands out senders whose connection is open and idle.
//!
//! HTTP/1.1 connections carry one exchange at a time and go back to the
//! pool when their answer's body has been read to the end (see
//! [`PooledBody`]). With `upstreams[].max_connections` a worker opens at
//! most its share of them; past it, requests queue, first come first
//! served, and a returned connection is handed straight to the longest
//! waiting (newcomers cannot overtake them). Waiting and opening share one
//! deadline per request, the connect timeout, so a request that got no
//! connection is reported as never sent (`Busy`), not as an upstream
//! timeout. An HTTP/2 upstream gets multiplexed connections shared
//! by every request of the worker: one, and another whenever every open one
//! carries [`H2_STREAMS_PER_CONNECTION`] streams. Requests that find none
//! with room join the one connection being opened (up to its stream count)
//! instead of each opening its own: a burst on a cold pool opens one
//! connection per hundred requests, not one per request. Waiting for it
//! is bounded by the connect timeout, so a failed open still reports the
//! request as never sent.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use axum::body::Body;
use futures_util::FutureExt as _;
use futures_util::future::{BoxFuture, Shared};
use hyper::client::conn::{http1, http2};
use rustls::pki_types::ServerName;
use tokio::sync::{Semaphore, oneshot};

use super::connect::{ConnectError, Connector, Sender};

mod capped;
use capped::ready_idle;

/// Idle connections are closed after this, well below the keep-alive
/// timeouts of common servers (nginx 75 s; Node's 5 s is the exception), so
/// a request rarely meets a connection the upstream is closing.
pub(super) const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(4);
/// Idle connections kept per upstream per worker; more are closed.
pub(super) const POOL_MAX_IDLE: usize = 1024;

/// Streams the gateway opens on one HTTP/2 upstream connection before it
/// opens another. hyper does not expose the limit the upstream announced
/// (`SETTINGS_MAX_CONCURRENT_STREAMS`); a request past it would wait
/// unsent inside hyper and, if the upstream timeout ends the wait, look
/// like one the upstream may have received (`uncertain`). RFC 9113 §6.5.2
/// recommends allowing at least 100, which is also h2's assumption before
/// the upstream's settings arrive; staying at 100 keeps every request on a
/// stream it can open at once, unless the upstream announces fewer.
pub(super) const H2_STREAMS_PER_CONNECTION: usize = 100;

/// A shared HTTP/2 connection and how many streams it carries.
struct SharedH2 {
    sender: http2::SendRequest<Body>,
    streams: Arc<AtomicUsize>,
    /// Reaper ticks in a row it carried no stream (under the pool's lock).
    quiet_ticks: u32,
}

impl SharedH2 {
    fn try_slot(&self) -> Option<StreamSlot> {
        try_slot(&self.streams)
    }
}

/// A stream counted on `streams`, if it carries fewer than
/// [`H2_STREAMS_PER_CONNECTION`].
fn try_slot(streams: &Arc<AtomicUsize>) -> Option<StreamSlot> {
    streams
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < H2_STREAMS_PER_CONNECTION).then_some(n + 1)
        })
        .ok()
        .map(|_| StreamSlot(streams.clone()))
}

/// An HTTP/2 connection being opened. Requests that join it take one of
/// its streams at once (`streams`, the counter the connection keeps once
/// open), so each waits for exactly this one open, and requests that
/// arrive after it opened cannot take the streams its waiters hold.
struct OpeningH2 {
    done: Shared<BoxFuture<'static, Result<http2::SendRequest<Body>, Arc<ConnectError>>>>,
    streams: Arc<AtomicUsize>,
}

/// One stream counted against its HTTP/2 connection, until dropped (with
/// the answer's body, or with the request that failed).
pub(super) struct StreamSlot(Arc<AtomicUsize>);

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

struct Idle {
    sender: http1::SendRequest<Body>,
    since: Instant,
}

/// An open connection's sender, with the stream it counts for an HTTP/2
/// one.
struct Found(Sender, Option<StreamSlot>);

impl Found {
    /// Checked out as a connection that carried earlier requests.
    fn reused(self) -> Checked {
        Checked {
            sender: self.0,
            reused: true,
            first: false,
            stream: self.1,
        }
    }
}

/// A sender checked out of the pool.
pub(super) struct Checked {
    pub(super) sender: Sender,
    /// Whether it carried an earlier request (a fresh one cannot be stale).
    pub(super) reused: bool,
    /// Whether this request is the first on its connection, right after
    /// the handshake (a TLS alert on it is the handshake's outcome, e.g.
    /// a client certificate the upstream refused, not a broken exchange).
    pub(super) first: bool,
    /// The stream it counts against its HTTP/2 connection.
    pub(super) stream: Option<StreamSlot>,
}

/// How requests name the upstream: computed once, cloned (a reference
/// count) per request.
pub(super) struct Target {
    /// `Host` over HTTP/1.1.
    pub(super) host: http::HeaderValue,
    /// `:scheme` and `:authority` over HTTP/2.
    pub(super) scheme: http::uri::Scheme,
    pub(super) authority: http::uri::Authority,
}

/// The connections to one upstream.
pub struct Pool {
    target: Target,
    connector: Arc<Connector>,
    idle: Mutex<Vec<Idle>>,
    shared_h2: Arc<Mutex<Vec<SharedH2>>>,
    /// The HTTP/2 connection being opened most recently, if one is (full
    /// or not: a request that finds it full starts the next).
    opening_h2: Arc<Mutex<Option<OpeningH2>>>,
    /// Whether this pool's connection tasks share one thread with its
    /// requests (the gateway's workers), see [`Pool::exact_goaway`].
    single_threaded: bool,
    /// Places for HTTP/1.1 connections, when they are capped: each open
    /// connection's task holds one.
    limit: Option<Arc<Semaphore>>,
    /// Requests waiting for an HTTP/1.1 connection to come back (capped
    /// pools only), first come first served: a returned connection is
    /// handed to the longest waiting, so newcomers cannot overtake them.
    /// Locked only under `idle`'s lock.
    waiters: Mutex<VecDeque<oneshot::Sender<http1::SendRequest<Body>>>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("authority", &self.connector.authority())
            .field("tls", &self.connector.is_tls())
            .field("http2", &self.connector.is_http2())
            .finish()
    }
}

/// How a pool reaches its upstream.
#[derive(Clone, Default)]
pub struct PoolOptions {
    /// TLS client settings and the server name to verify, for `https://`.
    pub tls: Option<(Arc<rustls::ClientConfig>, ServerName<'static>)>,
    /// Speak HTTP/2 (ALPN over TLS, prior knowledge over plain TCP).
    pub http2: bool,
    /// Bound on opening one connection (at most five seconds); with
    /// `max_connections`, also on waiting for one.
    pub connect_timeout: Option<Duration>,
    /// At most this many HTTP/1.1 connections at once (an HTTP/2
    /// upstream's requests share connections anyway). A request that
    /// finds them all in use waits for one to come back, for at most the
    /// connect timeout, then fails as never sent.
    pub max_connections: Option<usize>,
}

impl Pool {
    /// A plain HTTP/1.1 pool for `authority` (`host:port`).
    pub fn new(authority: String) -> Arc<Pool> {
        Self::with_options(authority, PoolOptions::default())
    }

    /// A pool for `authority` reached as `options` say. When called inside
    /// a tokio runtime, a reaper task closes idle connections past
    /// `POOL_IDLE_TIMEOUT`; it ends when the pool is dropped.
    ///
    /// A route's upstream timeout bounds the whole exchange; the connect
    /// must fail before it does, so that a request that never left is
    /// reported as never sent (its claim released), not as an uncertain
    /// timeout: the gateway passes half the upstream timeout.
    pub fn with_options(authority: String, options: PoolOptions) -> Arc<Pool> {
        let timeout = options
            .connect_timeout
            .unwrap_or(super::connect::CONNECT_TIMEOUT);
        let target = Target {
            host: http::HeaderValue::from_str(&authority)
                .unwrap_or_else(|_| http::HeaderValue::from_static("localhost")),
            scheme: if options.tls.is_some() {
                http::uri::Scheme::HTTPS
            } else {
                http::uri::Scheme::HTTP
            },
            authority: authority
                .parse()
                .unwrap_or_else(|_| http::uri::Authority::from_static("localhost")),
        };
        let pool = Arc::new(Pool {
            target,
            connector: Arc::new(Connector::new(
                authority,
                options.tls,
                options.http2,
                timeout,
            )),
            idle: Mutex::new(Vec::new()),
            shared_h2: Arc::default(),
            opening_h2: Arc::default(),
            single_threaded: tokio::runtime::Handle::try_current()
                .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread),
            limit: options
                .max_connections
                .filter(|_| !options.http2)
                .map(|n| Arc::new(Semaphore::new(n.max(1)))),
            waiters: Mutex::new(VecDeque::new()),
        });
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(reap(Arc::downgrade(&pool)));
        }
        pool
    }

    /// The `host:port` this pool connects to.
    pub(super) fn authority(&self) -> &str {
        self.connector.authority()
    }

    /// How requests name the upstream.
    /// Whether a graceful HTTP/2 `GOAWAY` error on a request means the
    /// upstream never got it. hyper hands a request to h2, then asks h2
    /// again whether the connection is usable; if the connection's task has
    /// meanwhile read a `GOAWAY` on another thread, the request gets that
    /// error although its stream was opened below the last stream id. On
    /// a single thread the two steps cannot be interleaved.
    pub(super) fn exact_goaway(&self) -> bool {
        self.single_threaded
    }

    pub(super) fn target(&self) -> &Target {
        &self.target
    }

    /// The latest a request that is still looking for a connection may go
    /// on looking (waiting under the cap and opening share it): the
    /// connect timeout from now.
    pub(super) fn deadline(&self) -> tokio::time::Instant {
        tokio::time::Instant::now() + self.connector.timeout()
    }

    /// A sender ready for a request: a pooled idle one, or a new connection.
    #[cfg(test)]
    pub(super) async fn checkout(&self) -> Result<Checked, ConnectError> {
        self.checkout_until(self.deadline()).await
    }

    /// [`Pool::checkout`], looking no later than `deadline`.
    pub(super) async fn checkout_until(
        &self,
        deadline: tokio::time::Instant,
    ) -> Result<Checked, ConnectError> {
        if let Some(found) = self.checkout_idle() {
            return Ok(found.reused());
        }
        self.open_until(deadline, false).await
    }

    /// A sender on a new connection (an HTTP/2 one is shared from now on,
    /// and requests arriving while it opens join it).
    #[cfg(test)]
    pub(super) async fn connect(&self) -> Result<Checked, ConnectError> {
        self.open_until(self.deadline(), true).await
    }

    /// A sender on a new connection, for a request whose pooled one turned
    /// out closed: `deadline` is the one its checkout had, so the two
    /// together stay within one connect timeout.
    pub(super) async fn reconnect_until(
        &self,
        deadline: tokio::time::Instant,
    ) -> Result<Checked, ConnectError> {
        self.open_until(deadline, true).await
    }

    /// `fresh`: a new connection, not another pooled one (the last one
    /// was stale, and the next may be too, after an upstream restart).
    async fn open_until(
        &self,
        deadline: tokio::time::Instant,
        fresh: bool,
    ) -> Result<Checked, ConnectError> {
        if self.connector.is_http2() {
            return self.join_h2().await;
        }
        if let Some(limit) = &self.limit {
            return Box::pin(self.wait_for_h1(limit, deadline, fresh)).await;
        }
        // Opening a connection is large and rare: boxed so it does not
        // inflate every request's future.
        let sender = Box::pin(self.connector.open(None)).await?;
        Ok(Checked {
            sender,
            reused: false,
            first: true,
            stream: None,
        })
    }

    /// A stream on the HTTP/2 connection being opened, opening one if none
    /// is or its streams are all taken. A request waits for one open only,
    /// which the connect timeout bounds (below the upstream timeout), so a
    /// failed open reports it as never sent.
    async fn join_h2(&self) -> Result<Checked, ConnectError> {
        let (done, stream, first) = {
            let mut opening = lock(&self.opening_h2);
            let joined = opening
                .as_ref()
                .and_then(|o| Some((o.done.clone(), try_slot(&o.streams)?, false)));
            match joined {
                Some(joined) => joined,
                None => {
                    // A connection opened since this request looked may
                    // have room (on a multi-threaded runtime the open can
                    // finish in between).
                    if let Some(found) = self.checkout_idle() {
                        return Ok(found.reused());
                    }
                    let (next, stream) = self.open_h2();
                    let joined = (next.done.clone(), stream, true);
                    *opening = Some(next);
                    joined
                }
            }
        };
        match done.clone().await {
            // Closed already: nothing was sent on it.
            Ok(sender) if sender.is_closed() => Err(ConnectError::Io(std::io::Error::other(
                "the new HTTP/2 connection closed at once",
            ))),
            Ok(sender) => Ok(Checked {
                sender: Sender::Http2(sender),
                reused: false,
                first,
                stream: Some(stream),
            }),
            Err(e) => {
                // (The open's task clears the entry itself; this covers
                // one that panicked, so that its error is not served
                // forever.)
                let mut opening = lock(&self.opening_h2);
                if opening.as_ref().is_some_and(|o| o.done.ptr_eq(&done)) {
                    *opening = None;
                }
                Err(e.duplicate())
            }
        }
    }

    /// Starts opening a shared HTTP/2 connection. It runs as a task of its
    /// own, so it completes whether or not its waiters are still there (one
    /// that hangs up leaves no stale open for the next request to inherit).
    /// Once open it is listed with the streams its waiters hold, then stops
    /// being the one opening (unless a newer open has taken that place).
    /// The stream returned is the opener's, counted before the task can
    /// list the connection for others to fill.
    fn open_h2(&self) -> (OpeningH2, StreamSlot) {
        let connector = self.connector.clone();
        let shared = self.shared_h2.clone();
        let opening = self.opening_h2.clone();
        let streams = Arc::new(AtomicUsize::new(1));
        let opener = StreamSlot(streams.clone());
        let counted = streams.clone();
        let task = tokio::spawn(async move {
            let opened = match connector.open(None).await {
                Ok(Sender::Http2(sender)) => {
                    lock(&shared).push(SharedH2 {
                        sender: sender.clone(),
                        streams: counted.clone(),
                        quiet_ticks: 0,
                    });
                    Ok(sender)
                }
                Ok(Sender::Http1(_)) => Err(Arc::new(ConnectError::Io(std::io::Error::other(
                    "an HTTP/1.1 connection where HTTP/2 was asked for",
                )))),
                Err(e) => Err(Arc::new(e)),
            };
            let mut opening = lock(&opening);
            if opening
                .as_ref()
                .is_some_and(|o| Arc::ptr_eq(&o.streams, &counted))
            {
                *opening = None;
            }
            opened
        });
        let done = async move {
            task.await.unwrap_or_else(|e| {
                Err(Arc::new(ConnectError::Io(std::io::Error::other(format!(
                    "opening the connection failed: {e}"
                )))))
            })
        }
        .boxed()
        .shared();
        (OpeningH2 { done, streams }, opener)
    }

    /// The most recently used open, idle connection, if any. Last in, first
    /// out: the warmest connection is the least likely to be closing.
    fn checkout_idle(&self) -> Option<Found> {
        if self.connector.is_http2() {
            let mut shared = lock(&self.shared_h2);
            shared.retain(|h2| !h2.sender.is_closed());
            return shared.iter().find_map(|h2| {
                if !h2.sender.is_ready() {
                    return None;
                }
                let stream = h2.try_slot()?;
                Some(Found(Sender::Http2(h2.sender.clone()), Some(stream)))
            });
        }
        ready_idle(&mut lock(&self.idle)).map(|sender| Found(Sender::Http1(sender), None))
    }

    /// Returns an HTTP/1.1 sender whose exchange ended cleanly.
    pub(super) fn checkin(&self, sender: http1::SendRequest<Body>) {
        if sender.is_closed() {
            return;
        }
        let mut idle = lock(&self.idle);
        let mut sender = sender;
        if self.limit.is_some() {
            let mut waiters = lock(&self.waiters);
            while let Some(waiter) = waiters.pop_front() {
                match waiter.send(sender) {
                    Ok(()) => return,
                    // It stopped waiting: the next one.
                    Err(back) => sender = back,
                }
            }
        }
        if idle.len() < POOL_MAX_IDLE {
            idle.push(Idle {
                sender,
                since: Instant::now(),
            });
        }
    }

    fn close_expired(&self) {
        let now = Instant::now();
        lock(&self.idle).retain(|idle| {
            now.duration_since(idle.since) < POOL_IDLE_TIMEOUT && !idle.sender.is_closed()
        });
        // HTTP/2: the first open connection stays; one opened for a burst
        // is let go once it has carried no stream for two ticks in a row
        // (about POOL_IDLE_TIMEOUT), so load hovering around the stream
        // limit does not open and close connections. Checkout counts a
        // stream under the same lock, and a new connection is listed with
        // its waiters' streams already counted, so none is handed out
        // meanwhile.
        let mut first = true;
        lock(&self.shared_h2).retain_mut(|h2| {
            if h2.streams.load(Ordering::Acquire) == 0 {
                h2.quiet_ticks += 1;
            } else {
                h2.quiet_ticks = 0;
            }
            let keep = !h2.sender.is_closed() && (first || h2.quiet_ticks < 2);
            first &= !keep;
            keep
        });
    }

    /// How many idle connections the pool holds (for tests).
    #[cfg(test)]
    pub(super) fn idle_count(&self) -> usize {
        lock(&self.idle).len()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Nothing panics while holding these locks (push, pop, retain, clone),
    // so a poisoned lock still guards a consistent value.
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

async fn reap(pool: Weak<Pool>) {
    let mut tick = tokio::time::interval(POOL_IDLE_TIMEOUT / 2);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match pool.upgrade() {
            Some(pool) => pool.close_expired(),
            None => return,
        }
    }
}

/// An answer's body that returns its HTTP/1.1 connection to the pool once
/// it has been read to the end. Dropped before the end, it takes the
/// connection with it (hyper closes a connection whose answer was not
/// read, so a half-read answer is never mistaken for the next one).
pub(super) struct PooledBody {
    inner: hyper::body::Incoming,
    home: Option<(http1::SendRequest<Body>, Arc<Pool>)>,
    /// An HTTP/2 answer's stream, counted until the body is dropped.
    _stream: Option<StreamSlot>,
}

impl PooledBody {
    pub(super) fn new(
        inner: hyper::body::Incoming,
        home: Option<(http1::SendRequest<Body>, Arc<Pool>)>,
        stream: Option<StreamSlot>,
    ) -> PooledBody {
        let mut body = PooledBody {
            inner,
            home,
            _stream: stream,
        };
        if http_body::Body::is_end_stream(&body.inner) {
            body.go_home();
        }
        body
    }

    fn go_home(&mut self) {
        if let Some((sender, pool)) = self.home.take() {
            pool.checkin(sender);
        }
    }
}

impl http_body::Body for PooledBody {
    type Data = bytes::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        let polled = std::pin::Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            std::task::Poll::Ready(None) => this.go_home(),
            // Trailers are the last frame there is, whether or not the
            // reader polls again.
            std::task::Poll::Ready(Some(Ok(frame)))
                if frame.is_trailers() || this.inner.is_end_stream() =>
            {
                this.go_home()
            }
            std::task::Poll::Ready(Some(Err(_))) => this.home = None,
            _ => {}
        }
        // An HTTP/2 upstream's trailers can be slices of its frame buffer
        // (hyper copies HTTP/1.1 trailers itself; see
        // `headers::detach_values`).
        polled.map(|frame| {
            frame.map(|frame| {
                frame.map(|frame| match frame.into_trailers() {
                    Ok(mut trailers) => {
                        super::headers::detach_values(&mut trailers);
                        http_body::Frame::trailers(trailers)
                    }
                    Err(frame) => frame,
                })
            })
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
mod tests;
