//! [`Proxy`]: the tower service that forwards one request upstream.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use http::uri::Authority;
use http::{Request, Response};
use tower::Service;

use super::client::{self, SendError};
use super::pool::{Pool, PoolOptions};
use idemgate_core::error::{Problem, Reason};
use idemgate_core::handler::{Handler, HandlerFuture};
use idemgate_core::metrics::Histogram;
use idemgate_core::trace;
use rustls::pki_types::ServerName;
use tracing::Instrument;

/// Where a route forwards to.
#[derive(Debug)]
pub struct Upstream {
    /// Its `[[upstreams]]` name, as logs, metrics and errors show it.
    pub name: String,
    /// `host:port` connected to (IPv6 hosts bracketed), from its URL.
    pub authority: Authority,
    /// Bound on the whole answer, head and body; connects get half of it.
    pub timeout: Duration,
    /// `https://`: TLS settings and the name the certificate must carry.
    pub tls: Option<(Arc<rustls::ClientConfig>, ServerName<'static>)>,
    /// Speak HTTP/2 to it.
    pub http2: bool,
    /// The cap on HTTP/1.1 connections to it across the workers (0: none).
    pub max_connections: usize,
}

/// What an upstream is made from: a validated `[[upstreams]]` entry.
#[derive(Debug, Clone, Copy)]
pub struct UpstreamSpec<'a> {
    /// The entry's `name`.
    pub name: &'a str,
    /// The entry's `url`: `http://host:port` or `https://host:port`.
    pub url: &'a str,
    /// The entry's `timeout`: bound on the whole answer.
    pub timeout: Duration,
    /// `https://` only: PEM trust anchors instead of the system roots.
    pub ca_file: Option<&'a str>,
    /// `https://` only: the client certificate and key (mutual TLS).
    pub client_cert: Option<&'a str>,
    /// `https://` only: the private key of `client_cert`.
    pub client_key: Option<&'a str>,
    /// Speak HTTP/2 to it.
    pub http2: bool,
    /// The cap on HTTP/1.1 connections to it across the workers (0: none).
    pub max_connections: usize,
}

impl Upstream {
    /// From a validated `[[upstreams]]` entry; reads its TLS files.
    pub fn new(u: UpstreamSpec<'_>) -> Result<Upstream, String> {
        Self::new_at(u, "upstreams[]").map_err(|(_, reason)| reason)
    }

    /// The same, its errors naming the configuration key under `prefix`
    /// (`upstreams[2]`): which file could not be used, and why. The TLS
    /// files are read here, once.
    pub fn new_at(u: UpstreamSpec<'_>, prefix: &str) -> Result<Upstream, (String, String)> {
        let url_key = || format!("{prefix}.url");
        let url = url::Url::parse(u.url).map_err(|e| (url_key(), e.to_string()))?;
        let host = url
            .host_str()
            .ok_or_else(|| (url_key(), "no host".to_owned()))?;
        let port = url.port_or_known_default().unwrap_or(80);
        let authority = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let tls = match url.scheme() {
            "https" => {
                let keys =
                    ["ca_file", "client_cert", "client_key"].map(|f| format!("{prefix}.{f}"));
                let files = crate::tls::ClientFiles {
                    ca_file: u.ca_file.map(|p| (keys[0].as_str(), p)),
                    client_cert: u.client_cert.map(|p| (keys[1].as_str(), p)),
                    client_key: u.client_key.map(|p| (keys[2].as_str(), p)),
                };
                let config = crate::tls::client_config(&files, u.http2)
                    .map_err(|e| (e.key.clone(), e.to_string()))?;
                let name = ServerName::try_from(host.trim_matches(['[', ']']).to_owned())
                    .map_err(|e| (url_key(), format!("{host:?} is not a TLS server name: {e}")))?;
                Some((config, name))
            }
            _ => None,
        };
        Ok(Upstream {
            name: u.name.to_owned(),
            authority: authority.parse().map_err(|e| (url_key(), format!("{e}")))?,
            timeout: u.timeout,
            tls,
            http2: u.http2,
            max_connections: u.max_connections,
        })
    }

    /// Caps its HTTP/1.1 connections at `cap` when no cap was configured
    /// (the descriptors' share: see `idemgate_core::limits`).
    pub fn cap_by_default(&mut self, cap: usize) {
        if self.max_connections == 0 && !self.http2 {
            self.max_connections = cap;
        }
    }

    /// A pool of connections to it, uncapped (the MQ consumers', whose
    /// deliveries `prefetch` bounds). Connects are bounded by half the
    /// upstream's timeout: a connect that hangs is "never sent" and must
    /// be told before the exchange times out.
    pub fn pool(&self) -> Arc<Pool> {
        self.pool_with(None)
    }

    /// One worker's pool, with its share of `max_connections` (rounded
    /// down, at least one).
    pub fn worker_pool(&self, workers: usize) -> Arc<Pool> {
        let share =
            (self.max_connections > 0).then(|| (self.max_connections / workers.max(1)).max(1));
        self.pool_with(share)
    }

    fn pool_with(&self, max_connections: Option<usize>) -> Arc<Pool> {
        Pool::with_options(
            self.authority.to_string(),
            PoolOptions {
                tls: self.tls.clone(),
                http2: self.http2,
                connect_timeout: Some(self.timeout / 2),
                max_connections,
            },
        )
    }
}

/// Why a forward failed.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// No connection to the named upstream could be made: nothing was sent.
    #[error("connecting to upstream {0} failed")]
    Connect(String),
    /// The upstream's certificate was refused (or it refused ours): nothing
    /// was sent.
    #[error("TLS with upstream {upstream} failed: {cause}")]
    Tls {
        /// The upstream's name.
        upstream: String,
        /// What TLS reported.
        cause: String,
    },
    /// The named upstream's answer did not arrive within its `timeout`: it
    /// may have acted.
    #[error("upstream {0} gave no answer within its timeout")]
    Timeout(String),
    /// No connection under the named upstream's `max_connections` came free
    /// within the connect timeout: nothing was sent.
    #[error("every allowed connection to upstream {0} stayed in use")]
    Busy(String),
    /// The request may have reached the upstream, but no usable answer came
    /// back: it may have acted.
    #[error("upstream {upstream} connection failed: {cause}")]
    Broken {
        /// The upstream's name.
        upstream: String,
        /// What the connection reported.
        cause: String,
    },
    /// The client's body is over `server.max_body_bytes`: the upstream never
    /// got a complete request.
    #[error("request body over {limit} bytes")]
    BodyTooLarge {
        /// The limit, in bytes.
        limit: u64,
    },
    /// Reading the client's body failed: the upstream never got a complete
    /// request.
    #[error("reading the request body failed: {0}")]
    BadRequestBody(String),
}

pub use idemgate_core::forward::ForwardFailure;

impl ProxyError {
    fn failure(&self) -> ForwardFailure {
        match self {
            ProxyError::Connect(_) | ProxyError::BodyTooLarge { .. } => ForwardFailure::NotSent,
            ProxyError::Tls { .. } | ProxyError::Busy(_) => ForwardFailure::NotSent,
            ProxyError::BadRequestBody(_) => ForwardFailure::NotSent,
            ProxyError::Timeout(_) | ProxyError::Broken { .. } => ForwardFailure::Uncertain,
        }
    }
}

/// Forwards requests to one upstream; the innermost service of a route.
#[derive(Clone)]
pub struct Proxy {
    pool: Arc<Pool>,
    upstream: Arc<Upstream>,
    max_body_bytes: u64,
    latency: Arc<Histogram>,
}

impl Proxy {
    /// A proxy to `upstream` over `pool` (this worker's connections to it),
    /// recording the time to each response head in `latency`.
    pub fn new(
        pool: Arc<Pool>,
        upstream: Arc<Upstream>,
        max_body_bytes: u64,
        latency: Arc<Histogram>,
    ) -> Self {
        Proxy {
            pool,
            upstream,
            max_body_bytes,
            latency,
        }
    }

    async fn forward(self, req: Request<Body>) -> Result<Response<Body>, ProxyError> {
        let limit = self.max_body_bytes;
        // The client frames the body from its size hint: a declared length
        // over the limit is refused before anything is read or sent, and a
        // request with neither Content-Length nor Transfer-Encoding has an
        // empty body (RFC 9112 §6.3).
        let (mut parts, body) = req.into_parts();
        let timeout = call_deadline(&mut parts.headers, self.upstream.timeout);

        let started = Instant::now();
        let answer = if trace::enabled() {
            // The upstream continues this span's trace: `traceparent` names
            // it as the parent (replacing the client's, which is its parent).
            let span = tracing::info_span!(
                target: trace::TARGET,
                "upstream",
                otel.name = %format_args!("{} {}", parts.method, self.upstream.name),
                otel.kind = "client",
                otel.status_code = tracing::field::Empty,
                upstream = %self.upstream.name,
                http.request.method = %parts.method,
                http.response.status_code = tracing::field::Empty,
            );
            trace::inject(&span, &mut parts.headers);
            let send = client::send(&self.pool, parts, body, limit);
            let answer = tokio::time::timeout(timeout, send)
                .instrument(span.clone())
                .await;
            match &answer {
                Ok(Ok(response)) => {
                    span.record("http.response.status_code", response.status().as_u16());
                }
                _ => {
                    span.record("otel.status_code", "ERROR");
                }
            }
            answer
        } else {
            tokio::time::timeout(timeout, client::send(&self.pool, parts, body, limit)).await
        };
        self.latency.observe(started.elapsed());
        let response = match answer {
            Err(_) => return Err(ProxyError::Timeout(self.upstream.name.clone())),
            Ok(Err(e)) => return Err(self.classify(e, limit)),
            Ok(Ok(response)) => response,
        };
        Ok(response)
    }

    fn classify(&self, e: SendError, limit: u64) -> ProxyError {
        let upstream = self.upstream.name.clone();
        match e {
            SendError::Connect(_) => ProxyError::Connect(upstream),
            SendError::Busy => ProxyError::Busy(upstream),
            SendError::Tls(cause) => ProxyError::Tls { upstream, cause },
            SendError::BodyTooLarge => ProxyError::BodyTooLarge { limit },
            SendError::RequestBody(cause) => ProxyError::BadRequestBody(cause),
            SendError::Broken(cause) => ProxyError::Broken { upstream, cause },
        }
    }
}

/// How long the gateway waits for an answer: the upstream's `timeout`, or a
/// gRPC call's own `grpc-timeout` when that is shorter. A gRPC call
/// without one, or with a longer one, is sent with the upstream's, so that
/// the service stops working on the call when the gateway stops waiting
/// for it (a copy still running after the gateway gave up is what makes a
/// record uncertain).
fn call_deadline(headers: &mut http::HeaderMap, upstream: Duration) -> Duration {
    use idemgate_core::grpc;
    if !grpc::is_grpc(headers) {
        // Not a gRPC call: its `grpc-timeout` means nothing to the
        // upstream, which would go on working past it.
        return upstream;
    }
    let deadline = grpc::timeout(headers).map_or(upstream, |asked| asked.min(upstream));
    // One value, the one kept: several would let the service read another.
    headers.insert(grpc::GRPC_TIMEOUT, grpc::timeout_value(deadline));
    deadline
}

impl Proxy {
    /// Forwards and answers: a failed forward becomes its problem response,
    /// tagged with how far the request got.
    pub async fn answer(self, req: Request<Body>) -> Response<Body> {
        match self.forward(req).await {
            Ok(response) => response,
            Err(e) => {
                let failure = e.failure();
                let mut response = Problem::from(&e).into_response();
                response.extensions_mut().insert(failure);
                response
            }
        }
    }
}

/// A pass-through route is the proxy alone, called without a tower clone.
impl Handler for Proxy {
    fn call(&self, req: Request<Body>) -> HandlerFuture {
        Box::pin(self.clone().answer(req))
    }
}

impl Service<Request<Body>> for Proxy {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Connections are opened on demand; it is always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let answer = self.clone().answer(req);
        Box::pin(async move { Ok(answer.await) })
    }
}

/// Its answer to the client: the one problem type every module maps to.
impl From<&ProxyError> for idemgate_core::error::Problem {
    fn from(e: &ProxyError) -> Self {
        use ProxyError as E;
        let p = match e {
            E::Connect(_) => idemgate_core::error::Problem::new(Reason::UpstreamUnavailable),
            E::Tls { .. } => idemgate_core::error::Problem::new(Reason::UpstreamTls)
                .detail("nothing was sent upstream; the request can be retried"),
            E::Busy(_) => idemgate_core::error::Problem::new(Reason::UpstreamBusy)
                .detail("nothing was sent upstream; the request can be retried")
                .retry_after(1),
            E::Timeout(_) => idemgate_core::error::Problem::new(Reason::UpstreamTimeout),
            E::Broken { .. } => idemgate_core::error::Problem::new(Reason::UpstreamBroken),
            E::BodyTooLarge { limit } => idemgate_core::error::Problem::new(Reason::BodyTooLarge)
                .detail(format!(
                    "request bodies are limited to {limit} bytes; nothing was forwarded"
                )),
            E::BadRequestBody(_) => idemgate_core::error::Problem::new(Reason::BadRequestBody),
        };
        p.logged("proxy", e.to_string())
    }
}
