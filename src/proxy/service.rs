//! [`Proxy`]: the tower service that forwards one request upstream.

use std::convert::Infallible;
use std::error::Error as StdError;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, Uri, header};
use http_body_util::{LengthLimitError, Limited};
use tower::Service;

use super::client::UpstreamClient;
use super::headers;
use crate::error::Problem;
use crate::metrics::Histogram;

/// The peer address of the connection a request came on (set by the server).
#[derive(Debug, Clone, Copy)]
pub struct ClientAddr(pub SocketAddr);

/// Where a route forwards to.
#[derive(Debug)]
pub struct Upstream {
    pub name: String,
    pub authority: Authority,
    pub timeout: Duration,
}

impl Upstream {
    /// From a validated `[[upstreams]]` entry.
    pub fn from_config(u: &crate::config::UpstreamConfig) -> Result<Upstream, String> {
        let url = url::Url::parse(&u.url).map_err(|e| e.to_string())?;
        let host = url.host_str().ok_or("no host")?;
        let port = url.port_or_known_default().unwrap_or(80);
        let authority = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        Ok(Upstream {
            name: u.name.clone(),
            authority: authority.parse().map_err(|e| format!("{e}"))?,
            timeout: u.timeout.get(),
        })
    }
}

/// Why a forward failed.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("connecting to upstream {0} failed")]
    Connect(String),
    #[error("upstream {0} gave no answer within its timeout")]
    Timeout(String),
    #[error("upstream {upstream} connection failed: {cause}")]
    Broken { upstream: String, cause: String },
    #[error("request body over {limit} bytes")]
    BodyTooLarge { limit: u64 },
    #[error("reading the request body failed: {0}")]
    BadRequestBody(String),
}

/// How a forward failed, attached to the error response so policy layers can
/// decide what the failure means for a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForwardFailure {
    /// The upstream never received the request: safe to execute again.
    NotSent,
    /// The request may have reached the upstream, but no complete answer
    /// came back (timeout, reset): the outcome is uncertain.
    Uncertain,
}

impl ProxyError {
    fn failure(&self) -> ForwardFailure {
        match self {
            ProxyError::Connect(_) | ProxyError::BodyTooLarge { .. } => ForwardFailure::NotSent,
            ProxyError::BadRequestBody(_) => ForwardFailure::NotSent,
            ProxyError::Timeout(_) | ProxyError::Broken { .. } => ForwardFailure::Uncertain,
        }
    }
}

/// Forwards requests to one upstream; the innermost service of a route.
#[derive(Clone)]
pub struct Proxy {
    client: UpstreamClient,
    upstream: Arc<Upstream>,
    max_body_bytes: u64,
    latency: Arc<Histogram>,
}

impl Proxy {
    /// A proxy to `upstream` over the shared `client`, recording the time to
    /// each response head in `latency`.
    pub fn new(
        client: UpstreamClient,
        upstream: Arc<Upstream>,
        max_body_bytes: u64,
        latency: Arc<Histogram>,
    ) -> Self {
        Proxy {
            client,
            upstream,
            max_body_bytes,
            latency,
        }
    }

    async fn forward(self, req: Request<Body>) -> Result<Response<Body>, ProxyError> {
        let limit = self.max_body_bytes;
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|len| len > limit) {
            return Err(ProxyError::BodyTooLarge { limit });
        }

        let (mut parts, body) = req.into_parts();
        // HTTP/1.1 (RFC 9112 §6.3): no Content-Length and no
        // Transfer-Encoding means no body. Decided before the hop-by-hop
        // headers (Transfer-Encoding among them) are stripped.
        let has_body = declared != Some(0)
            && (declared.is_some() || parts.headers.contains_key(header::TRANSFER_ENCODING));
        let client_ip = parts.extensions.get::<ClientAddr>().map(|a| a.0.ip());
        headers::prepare_request(&mut parts.headers, client_ip);
        let path = parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        parts.uri = Uri::builder()
            .scheme(Scheme::HTTP)
            .authority(self.upstream.authority.clone())
            .path_and_query(path)
            .build()
            .map_err(|e| ProxyError::BadRequestBody(e.to_string()))?;
        // Counting, not buffering: a body that grows past the limit while it
        // streams aborts the upstream request, which then never completes.
        // A request that declares an empty body (most GETs) skips the wrapper.
        let body = if has_body {
            Body::new(Limited::new(body, limit as usize))
        } else {
            Body::empty()
        };
        let request = Request::from_parts(parts, body);

        let started = Instant::now();
        let answer =
            tokio::time::timeout(self.upstream.timeout, self.client.request(request)).await;
        self.latency.observe(started.elapsed());
        let response = match answer {
            Err(_) => return Err(ProxyError::Timeout(self.upstream.name.clone())),
            Ok(Err(e)) => return Err(self.classify(e, limit)),
            Ok(Ok(response)) => response,
        };
        let (mut parts, body) = response.into_parts();
        headers::strip_hop_by_hop(&mut parts.headers);
        Ok(Response::from_parts(parts, Body::new(body)))
    }

    fn classify(&self, e: hyper_util::client::legacy::Error, limit: u64) -> ProxyError {
        if e.is_connect() {
            return ProxyError::Connect(self.upstream.name.clone());
        }
        let mut source: Option<&(dyn StdError + 'static)> = Some(&e);
        while let Some(err) = source {
            if err.is::<LengthLimitError>() {
                return ProxyError::BodyTooLarge { limit };
            }
            source = err.source();
        }
        ProxyError::Broken {
            upstream: self.upstream.name.clone(),
            cause: error_chain(&e),
        }
    }
}

fn error_chain(e: &(dyn StdError + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(err) = source {
        text.push_str(": ");
        text.push_str(&err.to_string());
        source = err.source();
    }
    text
}

impl Service<Request<Body>> for Proxy {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // The pooled client queues internally; it is always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            Ok(match this.forward(req).await {
                Ok(response) => response,
                Err(e) => {
                    let failure = e.failure();
                    let mut response = Problem::from(&e).into_response();
                    response.extensions_mut().insert(failure);
                    response
                }
            })
        })
    }
}
