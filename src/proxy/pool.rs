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
//! [`PooledBody`]). An HTTP/2 upstream gets multiplexed connections shared
//! by every request of the worker: one, and another whenever every open one
//! carries [`H2_STREAMS_PER_CONNECTION`] streams.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use axum::body::Body;
use hyper::client::conn::{http1, http2};
use rustls::pki_types::ServerName;

use super::connect::{ConnectError, Connector, Sender};

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
    fn new(sender: http2::SendRequest<Body>) -> SharedH2 {
        SharedH2 {
            sender,
            streams: Arc::new(AtomicUsize::new(0)),
            quiet_ticks: 0,
        }
    }

    fn slot(&self) -> StreamSlot {
        self.streams.fetch_add(1, Ordering::AcqRel);
        StreamSlot(self.streams.clone())
    }
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

/// A sender checked out of the pool.
pub(super) struct Checked {
    pub(super) sender: Sender,
    /// Whether it carried an earlier request (a fresh one cannot be stale).
    pub(super) reused: bool,
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
    connector: Connector,
    idle: Mutex<Vec<Idle>>,
    shared_h2: Mutex<Vec<SharedH2>>,
    /// Whether this pool's connection tasks share one thread with its
    /// requests (the gateway's workers), see [`Pool::exact_goaway`].
    single_threaded: bool,
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
    /// Bound on opening one connection (at most five seconds).
    pub connect_timeout: Option<Duration>,
}

impl Pool {
    /// A plain HTTP/1.1 pool for `authority` (`host:port`).
    pub fn new(authority: String) -> Arc<Pool> {
        Self::with_options(authority, PoolOptions::default())
    }

    /// A pool for `authority` reached as `options` say. When called inside
    /// a tokio runtime, a reaper task closes idle connections past
    /// [`POOL_IDLE_TIMEOUT`]; it ends when the pool is dropped.
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
            connector: Connector::new(authority, options.tls, options.http2, timeout),
            idle: Mutex::new(Vec::new()),
            shared_h2: Mutex::new(Vec::new()),
            single_threaded: tokio::runtime::Handle::try_current()
                .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread),
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

    /// A sender ready for a request: a pooled idle one, or a new connection.
    pub(super) async fn checkout(&self) -> Result<Checked, ConnectError> {
        if let Some((sender, stream)) = self.checkout_idle() {
            return Ok(Checked {
                sender,
                reused: true,
                stream,
            });
        }
        self.connect().await
    }

    /// A sender on a new connection (an HTTP/2 one is shared from now on).
    pub(super) async fn connect(&self) -> Result<Checked, ConnectError> {
        // Opening a connection is large and rare: boxed so it does not
        // inflate every request's future.
        let sender = Box::pin(self.connector.open()).await?;
        let stream = match &sender {
            Sender::Http2(h2) => {
                let shared = SharedH2::new(h2.clone());
                let slot = shared.slot();
                lock(&self.shared_h2).push(shared);
                Some(slot)
            }
            Sender::Http1(_) => None,
        };
        Ok(Checked {
            sender,
            reused: false,
            stream,
        })
    }

    /// The most recently used open, idle connection, if any. Last in, first
    /// out: the warmest connection is the least likely to be closing.
    fn checkout_idle(&self) -> Option<(Sender, Option<StreamSlot>)> {
        if self.connector.is_http2() {
            let mut shared = lock(&self.shared_h2);
            shared.retain(|h2| !h2.sender.is_closed());
            return shared
                .iter()
                .find(|h2| {
                    h2.sender.is_ready()
                        && h2.streams.load(Ordering::Acquire) < H2_STREAMS_PER_CONNECTION
                })
                .map(|h2| (Sender::Http2(h2.sender.clone()), Some(h2.slot())));
        }
        let mut idle = lock(&self.idle);
        // Open but not yet idle (its dispatcher has not run since the
        // answer ended): kept for the next checkout, not closed.
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
                break Some((Sender::Http1(entry.sender), None));
            }
            settling.push(entry);
        };
        idle.extend(settling.into_iter().rev());
        found
    }

    /// Returns an HTTP/1.1 sender whose exchange ended cleanly.
    pub(super) fn checkin(&self, sender: http1::SendRequest<Body>) {
        if sender.is_closed() {
            return;
        }
        let mut idle = lock(&self.idle);
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
        // stream under the same lock, so none is handed out meanwhile.
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
        polled
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
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;

    #[tokio::test]
    async fn a_connection_closed_while_idle_is_not_handed_out() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let pool = Pool::new(listener.local_addr().unwrap().to_string());
        let Sender::Http1(sender) = pool.connect().await.unwrap().sender else {
            panic!("an HTTP/1.1 pool");
        };
        let (mut server_side, _) = listener.accept().await.unwrap();
        let mut sender = sender;
        sender.ready().await.unwrap();
        pool.checkin(sender);
        assert_eq!(pool.idle_count(), 1);
        let live = pool.checkout().await.expect("a live idle connection");
        assert!(live.reused, "the idle connection is reused");
        let Sender::Http1(sender) = live.sender else {
            panic!("an HTTP/1.1 pool");
        };
        pool.checkin(sender);
        server_side.shutdown().await.unwrap();
        drop(server_side);
        // hyper's dispatcher reads the idle connection and sees its end.
        for _ in 0..100 {
            match pool.checkout_idle() {
                None => break,
                Some((Sender::Http1(sender), _)) => pool.checkin(sender),
                Some((Sender::Http2(_), _)) => panic!("an HTTP/1.1 pool"),
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(pool.idle_count(), 0, "the closed connection is dropped");
    }

    #[tokio::test]
    async fn a_full_h2_connection_gets_a_sibling_that_is_let_go_when_idle() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                tokio::spawn(async move {
                    // Only the handshake: no request is sent in this test.
                    if let Ok(mut connection) = h2::server::handshake(tcp).await {
                        while connection.accept().await.is_some() {}
                    }
                });
            }
        });
        let options = PoolOptions {
            http2: true,
            ..PoolOptions::default()
        };
        let pool = Pool::with_options(addr.to_string(), options);
        let mut slots = Vec::new();
        for _ in 0..=H2_STREAMS_PER_CONNECTION {
            slots.push(pool.checkout().await.unwrap().stream.unwrap());
        }
        assert_eq!(
            lock(&pool.shared_h2).len(),
            2,
            "the 101st stream opened a second"
        );
        // Both carry streams: the reaper keeps both.
        pool.close_expired();
        assert_eq!(lock(&pool.shared_h2).len(), 2);
        let first = lock(&pool.shared_h2)[0].streams.clone();
        assert_eq!(first.load(Ordering::Acquire), H2_STREAMS_PER_CONNECTION);
        slots.clear();
        assert_eq!(
            first.load(Ordering::Acquire),
            0,
            "dropped slots are uncounted"
        );
        pool.close_expired();
        assert_eq!(
            lock(&pool.shared_h2).len(),
            2,
            "one quiet tick is not idle yet"
        );
        pool.close_expired();
        assert_eq!(lock(&pool.shared_h2).len(), 1, "the idle sibling is let go");
        let again = pool.checkout().await.unwrap();
        assert!(again.reused, "the first connection is still shared");
    }
}
