//! Listening: the accept loop, connection hardening and graceful shutdown.
//!
//! We run hyper's HTTP/1 connection builder ourselves instead of
//! `axum::serve` because the hardening lives there: hyper's
//! `header_read_timeout` only fires when a timer is installed, so every
//! connection gets a [`TokioTimer`]. A semaphore caps open connections; past
//! the cap the loop stops accepting and the kernel's backlog holds the rest,
//! which keeps memory flat under a connection flood. Shutdown stops accepting
//! first, then lets every in-flight request finish (hyper's graceful
//! shutdown finishes the current exchange and closes keep-alive connections),
//! bounded by a grace period. With several workers, [`balance`] decides
//! which worker serves each new connection.

pub mod balance;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

/// Limits applied to every accepted connection.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub header_read_timeout: Duration,
    pub max_connections: usize,
    pub shutdown_grace: Duration,
}

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

/// Serves HTTP/1.1 on `listener` until `shutdown`, then drains.
///
/// `make_service` is called once per connection with the peer address.
/// A service error closes the connection without an answer (the demo
/// upstream uses that to simulate a lost acknowledgement). With a `seat`,
/// this loop is one of several workers on one socket: it serves the
/// connections the balance leaves here and those other workers hand over.
pub async fn serve<F, S, E>(
    listener: TcpListener,
    make_service: F,
    limits: ConnLimits,
    mut seat: Option<balance::Seat>,
    mut shutdown: ShutdownSignal,
) where
    F: Fn(SocketAddr) -> S,
    S: hyper::service::Service<Request<Incoming>, Response = Response<Body>, Error = E>
        + Send
        + 'static,
    S::Future: Send + 'static,
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    // One builder (and one timer handle) for every connection of this loop.
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true)
        // Answers are mostly small: one flat buffer (head and body copied
        // together) costs less than queueing buffers for `writev`.
        .writev(false);
    loop {
        // Take a connection slot before accepting, so a flood waits in the
        // kernel backlog instead of in our memory.
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
            _ = shutdown.wait() => break,
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
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, layer = "server", "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            (stream, peer, guard) = handed_over(&mut seat) => (stream, peer, Some(guard)),
            _ = shutdown.wait() => break,
        };
        let _ = stream.set_nodelay(true);
        let connection = builder.serve_connection(TokioIo::new(stream), make_service(peer));
        // Boxed once here: the connection's state is large, and unboxed it
        // would be copied whole at every move into the spawned task.
        let connection = Box::pin(graceful.watch(connection));
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
            drop(slot);
            drop(counted);
        });
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
/// connection, recording the peer address on every request.
#[derive(Clone)]
pub struct PeerService<T> {
    service: T,
    peer: crate::proxy::ClientAddr,
}

impl<T> PeerService<T> {
    /// The per-connection factory [`serve`] takes.
    pub fn factory(service: T) -> impl Fn(SocketAddr) -> PeerService<T>
    where
        T: Clone,
    {
        move |peer| PeerService {
            service: service.clone(),
            peer: crate::proxy::ClientAddr::new(peer),
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
        self.service.clone().oneshot(req)
    }
}

/// Binds a listener, naming the config key on failure.
pub async fn bind(
    addr: &str,
    key: &'static str,
) -> Result<TcpListener, crate::gateway::StartError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| crate::gateway::StartError::Bind {
            key,
            addr: addr.to_owned(),
            source,
        })
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
