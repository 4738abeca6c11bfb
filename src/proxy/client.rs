//! The one pooled HTTP client shared by every upstream.

use std::time::Duration;

use axum::body::Body;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

/// Idle pooled connections are closed after this, well below the keep-alive
/// timeouts of common servers (nginx 75 s, Node 5 s is the exception), so a
/// request rarely meets a connection the upstream is closing.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(4);
const POOL_MAX_IDLE_PER_HOST: usize = 1024;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The client type every [`super::Proxy`] shares.
pub type UpstreamClient = Client<HttpConnector, Body>;

/// Builds the shared client: HTTP/1.1, keep-alive pool, `TCP_NODELAY`.
pub fn build_client() -> UpstreamClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
    connector.enforce_http(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .pool_max_idle_per_host(POOL_MAX_IDLE_PER_HOST)
        .pool_timer(TokioTimer::new())
        .timer(TokioTimer::new())
        .build(connector)
}
