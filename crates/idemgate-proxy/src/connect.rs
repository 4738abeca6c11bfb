//! Opening one upstream connection: TCP, then TLS for `https://`, then
//! hyper's HTTP/1.1 or HTTP/2 handshake, with the connection's task
//! spawned on the calling worker's runtime.
//!
//! Every failure here happens before any byte of a request left, so each
//! is "never sent"; [`ConnectError::Tls`] keeps a refused certificate apart
//! from an unreachable host because the operator's fix differs.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;

use crate::tls::{self, Stream};

/// How long opening a connection may take at most (every resolved address
/// and the TLS handshake).
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How often an HTTP/2 upstream connection is pinged, and how long the
/// answer may take before the connection is closed.
const H2_KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);
const H2_KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// The byte stream under an upstream connection.
pub(super) type UpstreamStream = Stream<tokio_rustls::client::TlsStream<TcpStream>>;

/// A request sender on a fresh connection.
pub(super) enum Sender {
    Http1(http1::SendRequest<Body>),
    Http2(http2::SendRequest<Body>),
}

/// Why no connection could be opened.
#[derive(Debug, thiserror::Error)]
pub(super) enum ConnectError {
    #[error("{0}")]
    Io(io::Error),
    /// The TLS handshake refused the upstream (or the upstream refused us).
    #[error("TLS handshake failed: {0}")]
    Tls(io::Error),
    #[error("HTTP handshake failed: {0}")]
    Handshake(hyper::Error),
    /// Every connection the pool may open is in use, and none came back
    /// in time (`upstreams[].max_connections`): nothing was sent.
    #[error("every allowed connection to the upstream stayed in use")]
    Busy,
}

impl ConnectError {
    /// The same failure, for another request that waited on the same
    /// connection (the sources are not `Clone`): a TLS failure stays one.
    pub(super) fn duplicate(&self) -> ConnectError {
        match self {
            ConnectError::Io(e) => ConnectError::Io(io::Error::new(e.kind(), e.to_string())),
            ConnectError::Tls(e) => ConnectError::Tls(io::Error::new(e.kind(), e.to_string())),
            ConnectError::Handshake(e) => {
                ConnectError::Io(io::Error::other(format!("HTTP handshake failed: {e}")))
            }
            ConnectError::Busy => ConnectError::Busy,
        }
    }
}

/// How to reach one upstream.
pub(super) struct Connector {
    /// `host:port`, resolved at every connect.
    authority: String,
    /// TLS settings and the name the certificate must carry, for `https://`.
    tls: Option<(tokio_rustls::TlsConnector, ServerName<'static>)>,
    http2: bool,
    timeout: Duration,
}

impl Connector {
    pub(super) fn new(
        authority: String,
        tls: Option<(Arc<rustls::ClientConfig>, ServerName<'static>)>,
        http2: bool,
        timeout: Duration,
    ) -> Connector {
        Connector {
            authority,
            tls: tls.map(|(config, name)| (tokio_rustls::TlsConnector::from(config), name)),
            http2,
            timeout: timeout.min(CONNECT_TIMEOUT),
        }
    }

    pub(super) fn authority(&self) -> &str {
        &self.authority
    }

    pub(super) fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    pub(super) fn is_http2(&self) -> bool {
        self.http2
    }

    /// The bound on opening one connection.
    pub(super) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Opens a connection and returns its sender; the connection is driven
    /// by a task on this runtime until every sender is dropped. `held`
    /// (a place under the pool's connection cap) lives as long as that
    /// task.
    pub(super) async fn open(
        &self,
        held: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Result<Sender, ConnectError> {
        let io = tokio::time::timeout(self.timeout, self.stream())
            .await
            .map_err(|_| {
                ConnectError::Io(io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))
            })??;
        if self.http2
            && let Stream::Tls(tls) = &io
            && tls.get_ref().1.alpn_protocol() != Some(tls::ALPN_H2)
        {
            // Only h2 was offered; an upstream that ignored ALPN speaks
            // something else, and nothing has been sent yet.
            return Err(ConnectError::Tls(io::Error::other(
                "http2 = true, but the upstream did not agree to h2 over ALPN",
            )));
        }
        let io = TokioIo::new(io);
        if self.http2 {
            let (sender, connection) = http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                // A frozen upstream or a silent partition closes the shared
                // connection instead of swallowing every request for as
                // long as TCP keeps retransmitting.
                .keep_alive_interval(H2_KEEP_ALIVE_INTERVAL)
                .keep_alive_timeout(H2_KEEP_ALIVE_TIMEOUT)
                .keep_alive_while_idle(true)
                .handshake(io)
                .await
                .map_err(ConnectError::Handshake)?;
            tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::debug!(layer = "proxy", error = %e, "upstream h2 connection ended");
                }
            });
            Ok(Sender::Http2(sender))
        } else {
            let (sender, connection) = http1::Builder::new()
                // Most answers are small: one flat write beats `writev`.
                .writev(false)
                .handshake(io)
                .await
                .map_err(ConnectError::Handshake)?;
            tokio::spawn(async move {
                let _held = held;
                if let Err(e) = connection.await {
                    tracing::debug!(layer = "proxy", error = %e, "upstream connection ended");
                }
            });
            Ok(Sender::Http1(sender))
        }
    }

    async fn stream(&self) -> Result<UpstreamStream, ConnectError> {
        let tcp = self.tcp().await.map_err(ConnectError::Io)?;
        match &self.tls {
            None => Ok(Stream::Plain(tcp)),
            Some((connector, name)) => {
                let tls = connector.connect(name.clone(), tcp).await.map_err(|e| {
                    if tls::is_tls_refusal(&e) {
                        ConnectError::Tls(e)
                    } else {
                        ConnectError::Io(e)
                    }
                })?;
                Ok(Stream::Tls(Box::new(tls)))
            }
        }
    }

    /// Tries each resolved address in turn.
    async fn tcp(&self) -> io::Result<TcpStream> {
        let mut last = io::Error::new(io::ErrorKind::NotFound, "no address resolved");
        for addr in tokio::net::lookup_host(self.authority.as_str()).await? {
            match connect_one(addr).await {
                Ok(stream) => return Ok(stream),
                Err(e) => last = e,
            }
        }
        Err(last)
    }
}

async fn connect_one(addr: SocketAddr) -> io::Result<TcpStream> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    Ok(stream)
}
