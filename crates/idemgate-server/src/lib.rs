//! Listening: the accept loop, TLS, connection hardening and graceful
//! shutdown.
//!
//! We run hyper's connection builders ourselves instead of `axum::serve`
//! because the hardening lives there: hyper's `header_read_timeout` only
//! fires when a timer is installed, so every connection gets a
//! [`TokioTimer`]. One port speaks HTTP/1.1 and HTTP/2: with TLS, ALPN
//! decides; on plain TCP the first bytes are peeked at (within the header
//! read timeout) for the HTTP/2 preface a prior-knowledge client sends,
//! and the connection goes to hyper's HTTP/1 or HTTP/2 server, so neither
//! pays for a sniffing wrapper on every read. A semaphore caps
//! open connections; past the cap the loop stops accepting and the kernel's
//! backlog holds the rest, which keeps memory flat under a connection
//! flood. HTTP/2 connections are capped in streams, header bytes and the
//! resets a client may make (the rapid-reset attack, CVE-2023-44487, is
//! answered by hyper's `h2` with `GOAWAY` once a client resets more streams
//! than it may). The loop accepts one connection per scheduler turn, so a
//! burst of new connections cannot queue ahead of the requests of those
//! already open. Shutdown stops accepting first, then lets every in-flight
//! request finish (hyper's graceful shutdown finishes the current exchange
//! and closes keep-alive connections), bounded by a grace period. With
//! several workers, [`balance`] decides which worker serves each new
//! connection.
//!
//! # Layout
//!
//! - `lib.rs`: [`serve`] — the accept loop, refusals at the cap, TLS, the
//!   protocol per connection, the graceful drain — and [`ConnLimits`].
//! - [`balance`]: which worker serves each new connection.
//! - `idle.rs`: closing HTTP/2 connections with nothing to do.
#![warn(missing_docs)]

pub mod balance;
mod idle;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

use idemgate_core::budget::{CLAIMS_PER_CONNECTION, ConnectionClaims};

/// An idle HTTP/2 connection is pinged this often; one that does not
/// answer within hyper's keep-alive timeout (20 s) is closed.
pub const H2_KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// Streams one HTTP/2 connection may have open at once (nginx's default
/// is 128, Envoy's 100): each is a request.
/// A connection's claims are bounded by the same number.
pub const H2_MAX_CONCURRENT_STREAMS: u32 = CLAIMS_PER_CONNECTION as u32;
/// Bytes of headers one HTTP/2 request may carry, decoded.
pub const H2_MAX_HEADER_LIST_BYTES: u32 = 64 * 1024;
/// Streams a client may open and reset before the gateway served them;
/// more and the connection is closed with `GOAWAY` (rapid reset).
pub const H2_MAX_PENDING_RESET_STREAMS: usize = 20;
/// Streams the gateway may reset for a client's protocol errors before it
/// closes the connection.
pub const H2_MAX_LOCAL_ERROR_RESETS: usize = 256;

/// How every accepted connection is served.
#[derive(Debug, Clone)]
pub struct ConnLimits {
    /// Bound on the TLS handshake and on each HTTP/1.1 request head.
    pub header_read_timeout: Duration,
    /// Connections this loop serves at once; each holds a slot until its
    /// last claim ends.
    pub max_connections: usize,
    /// Connections past `max_connections` a loop may hold at once only to
    /// refuse them (`503 connections-exhausted` with `Retry-After`, then
    /// close), while descriptors remain: a newcomer at the cap learns so
    /// at once instead of waiting unanswered in the kernel's backlog. Past
    /// these (or with 0), accept waits for a slot.
    pub refuse_at_cap: usize,
    /// Claims one connection may leave live (see
    /// [`idemgate_core::budget`]).
    pub claims_per_connection: usize,
    /// After shutdown, how long open connections may take to drain before
    /// the loop returns anyway.
    pub shutdown_grace: Duration,
    /// HTTP/2 beside HTTP/1.1.
    pub http2: bool,
    /// Terminate TLS with this configuration.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

impl ConnLimits {
    /// Plain HTTP/1.1 and h2c with these bounds.
    pub fn plain(
        header_read_timeout: Duration,
        max_connections: usize,
        shutdown_grace: Duration,
    ) -> Self {
        ConnLimits {
            header_read_timeout,
            max_connections,
            refuse_at_cap: 0,
            claims_per_connection: CLAIMS_PER_CONNECTION,
            shutdown_grace,
            http2: true,
            tls: None,
        }
    }

    /// The HTTP/1.1 builder every connection of a loop shares (with one
    /// timer handle).
    fn http1(&self) -> http1::Builder {
        let mut builder = http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(self.header_read_timeout)
            .keep_alive(true)
            // Answers are mostly small: one flat buffer (head and body
            // copied together) costs less than queueing buffers for
            // `writev`.
            .writev(false);
        builder
    }

    /// The HTTP/2 builder every connection of a loop shares.
    fn http2(&self) -> http2::Builder<TokioExecutor> {
        let mut builder = http2::Builder::new(TokioExecutor::new());
        builder
            .timer(TokioTimer::new())
            .max_concurrent_streams(H2_MAX_CONCURRENT_STREAMS)
            .max_header_list_size(H2_MAX_HEADER_LIST_BYTES)
            .max_pending_accept_reset_streams(H2_MAX_PENDING_RESET_STREAMS)
            .max_local_error_reset_streams(H2_MAX_LOCAL_ERROR_RESETS)
            .keep_alive_interval(H2_KEEP_ALIVE_INTERVAL);
        builder
    }
}

/// The HTTP/2 client preface (RFC 9113 §3.4).
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Which protocol a connection speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Http1,
    Http2,
}

/// Reads (without consuming) the first bytes of a plain connection, until
/// they are the HTTP/2 preface or cannot be: h2c with prior knowledge, or
/// HTTP/1.1. `None` when the client closes or stays silent past
/// `deadline`, so a connection that never speaks holds its slot no longer
/// than a slow request head would.
async fn sniff(stream: &tokio::net::TcpStream, within: Duration) -> Option<Protocol> {
    let deadline = tokio::time::Instant::now() + within;
    let mut seen = [0u8; 24];
    let mut pause = SNIFF_RETRY;
    loop {
        // (`timeout_at` polls the peek first, which would answer with the
        // same partial preface forever once the deadline has passed.)
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        let n = tokio::time::timeout_at(deadline, stream.peek(&mut seen))
            .await
            .ok()?
            .ok()?;
        if n == 0 {
            return None;
        }
        if seen[..n] != H2_PREFACE[..n] {
            return Some(Protocol::Http1);
        }
        if n == H2_PREFACE.len() {
            return Some(Protocol::Http2);
        }
        // Part of the preface so far: wait for the rest (peek would see
        // the same bytes again at once), backing off so that a client
        // dribbling a preface costs a few wake-ups, not hundreds.
        tokio::time::sleep_until(deadline.min(tokio::time::Instant::now() + pause)).await;
        pause = (pause * 2).min(SNIFF_RETRY_MAX);
    }
}

/// First and longest pause between peeks at a partial HTTP/2 preface.
const SNIFF_RETRY: Duration = Duration::from_millis(2);
const SNIFF_RETRY_MAX: Duration = Duration::from_millis(200);

/// What a served connection runs over.
type ServerStream =
    idemgate_proxy::tls::Stream<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>;

/// Tells serve loops to stop; cloneable receivers wait for it.
#[derive(Debug, Clone)]
pub struct ShutdownSignal(watch::Receiver<bool>);

/// The sending half of [`ShutdownSignal`].
#[derive(Debug)]
pub struct ShutdownTrigger(watch::Sender<bool>);

/// A linked trigger and signal.
pub fn shutdown_pair() -> (ShutdownTrigger, ShutdownSignal) {
    let (tx, rx) = watch::channel(false);
    (ShutdownTrigger(tx), ShutdownSignal(rx))
}

impl ShutdownTrigger {
    /// Asks every linked serve loop to stop.
    pub fn trigger(&self) {
        let _ = self.0.send(true);
    }
}

impl ShutdownSignal {
    /// Resolves once shutdown was triggered (at once if it already was).
    pub async fn wait(&mut self) {
        let _ = self.0.wait_for(|stop| *stop).await;
    }
}

/// Serves HTTP/1.1 and HTTP/2 on `listener` until `shutdown`, then drains.
/// (Long by design: one accept loop whose steps — a slot or a refusal,
/// accept or hand-over, spawn — share its locals, each step commented.)
///
/// `make_service` is called once per connection with the peer address,
/// whether it came over TLS, and the connection's claims (which hold its
/// `max_connections` slot until the last of them ends: see
/// [`idemgate_core::budget`]). A service error closes the connection without
/// an answer (the demo upstream uses that to simulate a lost
/// acknowledgement). With a `seat`, this loop is one of several workers on
/// one socket: it serves the connections the balance leaves here and those
/// other workers hand over. At the cap, up to `limits.refuse_at_cap`
/// connections more are accepted only to be answered `503` (see
/// `refuse`).
pub async fn serve<F, S, E>(
    listener: TcpListener,
    make_service: F,
    limits: ConnLimits,
    mut seat: Option<balance::Seat>,
    mut shutdown: ShutdownSignal,
) where
    F: Fn(SocketAddr, bool, ConnectionClaims) -> S,
    S: hyper::service::Service<Request<Incoming>, Response = Response<Body>, Error = E>
        + Send
        + 'static,
    S::Future: Send + 'static,
    E: Into<Box<dyn std::error::Error + Send + Sync>> + 'static,
{
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let refusals = Arc::new(Semaphore::new(limits.refuse_at_cap));
    let builders = Arc::new((limits.http1(), limits.http2()));
    let acceptor = limits.tls.clone().map(tokio_rustls::TlsAcceptor::from);
    let how = Arc::new(Accepting {
        acceptor,
        http2: limits.http2,
        handshake_timeout: limits.header_read_timeout,
        builders,
    });
    loop {
        // One connection per turn (nginx's `multi_accept off`), whichever
        // way the last one went (served here, handed over, refused): a
        // burst of new connections, each ready at once, would otherwise be
        // accepted a whole coop budget at a time (128) and queue that many
        // tasks ahead of the connections already served, whose requests
        // then wait for all of them (a legitimate client's p99 tripled
        // beside a hang-up storm, loadtest/README.md). Yielding puts this
        // loop behind the work already queued and behind the event loop's
        // next look at the sockets.
        tokio::task::yield_now().await;
        // Take a connection slot before accepting, so a flood waits in the
        // kernel backlog instead of in our memory — or, at the cap and
        // while the refusals' reserve and the descriptors last, a place to
        // refuse it from.
        let admit = match slots.clone().try_acquire_owned() {
            Ok(slot) => Admit::Serve(slot),
            Err(tokio::sync::TryAcquireError::Closed) => break,
            Err(tokio::sync::TryAcquireError::NoPermits) => tokio::select! {
                biased;
                slot = slots.clone().acquire_owned() => match slot {
                    Ok(slot) => Admit::Serve(slot),
                    Err(_) => break,
                },
                refusal = refusals.clone().acquire_owned(), if descriptors_left() => match refusal {
                    Ok(refusal) => Admit::Refuse(refusal),
                    Err(_) => break,
                },
                _ = shutdown.wait() => break,
            },
        };
        let (stream, peer, counted) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => match &seat {
                    None => (stream, peer, None),
                    Some(seat) => match seat.place(stream, peer) {
                        Some((stream, guard)) => (stream, peer, Some(guard)),
                        // Another worker serves it; this slot stays free.
                        None => continue,
                    },
                },
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning, and
                    // say so once a minute, not once per try.
                    accept_failed(&e, limits.max_connections - slots.available_permits());
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            (stream, peer, guard) = handed_over(&mut seat) => (stream, peer, Some(guard)),
            _ = shutdown.wait() => break,
        };
        let _ = stream.set_nodelay(true);
        let slot = match admit {
            Admit::Serve(slot) => slot,
            Admit::Refuse(refusal) => {
                tokio::spawn(Box::pin(refuse(
                    how.clone(),
                    stream,
                    peer,
                    refusal,
                    counted,
                )));
                continue;
            }
        };
        // The slot now belongs to the connection's claims: a claim that
        // outlives its connection keeps it taken.
        let claims = ConnectionClaims::new(Some(slot), limits.claims_per_connection);
        let service = make_service(peer, how.acceptor.is_some(), claims.clone());
        let watcher = graceful.watcher();
        let how = how.clone();
        let mut stopping = shutdown.clone();
        // Boxed once here: the connection's state is large, and unboxed it
        // would be copied whole at every move into the spawned task.
        tokio::spawn(Box::pin(async move {
            let Some((stream, protocol)) = how.open(stream, peer).await else {
                return;
            };
            let io = TokioIo::new(stream);
            let ended = match protocol {
                Protocol::Http1 => {
                    watcher
                        .watch(how.builders.0.serve_connection(io, service))
                        .await
                }
                Protocol::Http2 => {
                    // Watched by hand: the drain counts this connection
                    // for as long as `watcher` lives, and the connection
                    // is closed gracefully on shutdown or when idle.
                    let _counted_in_drain = watcher;
                    let activity = idle::Activity::new();
                    let service = idle::Busy {
                        inner: service,
                        activity: activity.clone(),
                    };
                    let conn = how.builders.1.serve_connection(io, service);
                    tokio::pin!(conn);
                    let mut closing = false;
                    loop {
                        tokio::select! {
                            ended = conn.as_mut() => break ended,
                            _ = stopping.wait(), if !closing => {
                                conn.as_mut().graceful_shutdown();
                                closing = true;
                            }
                            // Resets left more claims running than the
                            // connection may have streams: no new stream
                            // (GOAWAY), the claims finish on their own.
                            _ = claims.too_many(), if !closing => {
                                tracing::warn!(%peer, claims = claims.live(), layer = "server", "connection left its limit of claims behind; GOAWAY");
                                conn.as_mut().graceful_shutdown();
                                closing = true;
                            }
                            _ = activity.idle_for(how.handshake_timeout), if !closing => {
                                tracing::debug!(%peer, layer = "server", "idle HTTP/2 connection closed");
                                conn.as_mut().graceful_shutdown();
                                closing = true;
                            }
                        }
                    }
                }
            };
            if let Err(e) = ended {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
            drop(claims);
            drop(counted);
        }));
    }
    // Stop accepting: close the listening socket before draining.
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => tracing::debug!("all connections drained"),
        _ = tokio::time::sleep(limits.shutdown_grace) => {
            tracing::warn!(grace = ?limits.shutdown_grace, "shutdown grace elapsed with requests still running");
        }
    }
}

/// What a connection may be accepted for.
enum Admit {
    /// A `max_connections` slot: serve it.
    Serve(tokio::sync::OwnedSemaphorePermit),
    /// A place in the refusals' reserve: answer `503` and close.
    Refuse(tokio::sync::OwnedSemaphorePermit),
}

/// How every connection of a loop is opened: TLS (or not), the protocol,
/// the builders.
struct Accepting {
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    http2: bool,
    handshake_timeout: Duration,
    builders: Arc<(http1::Builder, http2::Builder<TokioExecutor>)>,
}

impl Accepting {
    /// The stream to serve and its protocol: TLS terminated (ALPN decides),
    /// or a plain connection sniffed for the HTTP/2 preface. `None` when
    /// the handshake failed or the client stayed silent past the timeout.
    async fn open(
        &self,
        stream: tokio::net::TcpStream,
        peer: SocketAddr,
    ) -> Option<(ServerStream, Protocol)> {
        match &self.acceptor {
            None if !self.http2 => {
                Some((idemgate_proxy::tls::Stream::Plain(stream), Protocol::Http1))
            }
            None => {
                let protocol = sniff(&stream, self.handshake_timeout).await?;
                Some((idemgate_proxy::tls::Stream::Plain(stream), protocol))
            }
            Some(acceptor) => {
                match tokio::time::timeout(self.handshake_timeout, acceptor.accept(stream)).await {
                    Ok(Ok(tls)) => {
                        // ALPN decides: the listener offers h2 only when
                        // HTTP/2 is on.
                        let protocol = match tls.get_ref().1.alpn_protocol() {
                            Some(idemgate_proxy::tls::ALPN_H2) => Protocol::Http2,
                            _ => Protocol::Http1,
                        };
                        Some((idemgate_proxy::tls::Stream::Tls(Box::new(tls)), protocol))
                    }
                    Ok(Err(e)) => {
                        tracing::debug!(%peer, error = %e, layer = "server", "TLS handshake failed");
                        None
                    }
                    Err(_) => {
                        tracing::debug!(%peer, layer = "server", "TLS handshake timed out");
                        None
                    }
                }
            }
        }
    }
}

/// Descriptors kept free of refusals: past them accept waits for a slot
/// (and the kernel's backlog holds the rest), so refusing never takes the
/// descriptors the store and the upstreams need.
const REFUSAL_DESCRIPTOR_MARGIN: u64 = 32;

/// Whether a refusal may take one more descriptor.
fn descriptors_left() -> bool {
    match (
        idemgate_core::limits::descriptor_limit(),
        idemgate_core::limits::open_descriptors(),
    ) {
        (Some(limit), Some(open)) => {
            (open as u64).saturating_add(REFUSAL_DESCRIPTOR_MARGIN) < limit
        }
        _ => true,
    }
}

/// A connection accepted past `max_connections`: its first request is
/// answered `503 connections-exhausted` with `Retry-After` and the
/// connection is closed (HTTP/1.1: `Connection: close`; HTTP/2: GOAWAY),
/// within the header-read timeout, handshake included. The client learns
/// at once that it should come back, instead of waiting unanswered in the
/// backlog; nothing is read past the request head, claimed or forwarded.
async fn refuse(
    how: Arc<Accepting>,
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    _refusal: tokio::sync::OwnedSemaphorePermit,
    _counted: Option<balance::ConnGuard>,
) {
    refused_at_cap(peer);
    let deadline = how.handshake_timeout;
    let _ = tokio::time::timeout(deadline, async {
        let Some((stream, protocol)) = how.open(stream, peer).await else {
            return;
        };
        let io = TokioIo::new(stream);
        let answered = Arc::new(tokio::sync::Notify::new());
        let service = Refusal {
            answered: answered.clone(),
        };
        match protocol {
            Protocol::Http1 => {
                let _ = how.builders.0.serve_connection(io, service).await;
            }
            Protocol::Http2 => {
                let conn = how.builders.1.serve_connection(io, service);
                tokio::pin!(conn);
                tokio::select! {
                    _ = conn.as_mut() => return,
                    _ = answered.notified() => conn.as_mut().graceful_shutdown(),
                }
                let _ = conn.await;
            }
        }
    })
    .await;
}

/// Answers every request `503 connections-exhausted`.
#[derive(Clone)]
struct Refusal {
    answered: Arc<tokio::sync::Notify>,
}

impl hyper::service::Service<Request<Incoming>> for Refusal {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response<Body>, Infallible>>;

    fn call(&self, _req: Request<Incoming>) -> Self::Future {
        let mut response =
            idemgate_core::error::Problem::new(idemgate_core::error::Reason::ConnectionsExhausted)
                .detail(
                    "the gateway serves as many connections as it may (server.max_connections, or \
             what its descriptors allow); nothing was read, claimed or forwarded: retry shortly",
                )
                .retry_after(idemgate_core::error::IN_FLIGHT_RETRY_AFTER_SECS)
                .into_response();
        response.headers_mut().insert(
            http::header::CONNECTION,
            http::HeaderValue::from_static("close"),
        );
        self.answered.notify_one();
        std::future::ready(Ok(response))
    }
}

/// Logs connections refused at the cap, at most once a minute per process.
fn refused_at_cap(peer: SocketAddr) {
    static LAST: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);
    let mut last = LAST.lock().unwrap_or_else(|p| p.into_inner());
    if last.is_none_or(|at| at.elapsed() >= Duration::from_secs(60)) {
        *last = Some(std::time::Instant::now());
        tracing::warn!(%peer, layer = "server", "at max_connections: new connections are answered 503 connections-exhausted (logged once a minute)");
    }
}

/// Logs a failed `accept` at most once a minute per process, with what
/// was open.
fn accept_failed(e: &std::io::Error, open: usize) {
    static LAST: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);
    let mut last = LAST.lock().unwrap_or_else(|p| p.into_inner());
    if last.is_none_or(|at| at.elapsed() >= Duration::from_secs(60)) {
        *last = Some(std::time::Instant::now());
        tracing::warn!(error = %e, open_connections = open, descriptor_limit = ?idemgate_core::limits::descriptor_limit(), layer = "server", "accept failed; backing off (logged once a minute)");
    }
}

/// The next connection another worker handed to this one; never, without
/// a seat.
async fn handed_over(
    seat: &mut Option<balance::Seat>,
) -> (tokio::net::TcpStream, SocketAddr, balance::ConnGuard) {
    match seat {
        Some(seat) => seat.handed().await,
        None => std::future::pending().await,
    }
}

/// Adapts a cloneable tower service (body: axum's) to hyper, one per
/// connection, recording the peer address and the connection's claims on
/// every request.
#[derive(Clone)]
pub struct PeerService<T> {
    service: T,
    peer: idemgate_core::client_addr::ClientAddr,
    claims: ConnectionClaims,
}

impl<T> PeerService<T> {
    /// The per-connection factory [`serve`] takes.
    pub fn factory(service: T) -> impl Fn(SocketAddr, bool, ConnectionClaims) -> PeerService<T>
    where
        T: Clone,
    {
        move |peer, tls, claims| PeerService {
            service: service.clone(),
            peer: if tls {
                idemgate_core::client_addr::ClientAddr::secure(peer)
            } else {
                idemgate_core::client_addr::ClientAddr::new(peer)
            },
            claims,
        }
    }
}

impl<T> hyper::service::Service<Request<Incoming>> for PeerService<T>
where
    T: tower::Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    T::Future: Send,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = tower::util::Oneshot<T, Request<Body>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        use tower::ServiceExt;
        let mut req = req.map(Body::new);
        req.extensions_mut().insert(self.peer.clone());
        req.extensions_mut().insert(self.claims.clone());
        self.service.clone().oneshot(req)
    }
}

/// The public listening socket, non-blocking, ready to be shared by the
/// worker threads (each turns a `try_clone` of it into its own tokio
/// listener). Binding it once means a port already in use is an error, as
/// it should be, rather than a socket shared with another process.
pub fn bind_shared(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    let listener = socket.listen(1024)?.into_std()?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Resolves on SIGTERM or SIGINT.
pub async fn termination() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing the SIGTERM handler");
        tokio::select! {
            _ = interrupt => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
}

#[cfg(test)]
mod tests;
