//! The streaming reverse proxy: the innermost service of every route stack.
//!
//! [`Proxy`] forwards one request to one upstream over a shared, pooled
//! hyper-util client (keep-alive to upstreams) and streams both bodies: the
//! request body is never buffered here, only counted against
//! `server.max_body_bytes`. Policy layers (key, token, callback) sit in front
//! of it and never reach into it; they read how a forward failed from the
//! [`ForwardFailure`] extension on the error response.
//!
//! The proxy never retries a request by itself. The pooled client only
//! re-sends a request that was never written to a socket (a pooled connection
//! closed while the request waited for it), which cannot have reached the
//! upstream.

mod client;
mod headers;
mod service;

pub use client::{UpstreamClient, build_client};
pub use headers::{HOP_BY_HOP, strip_hop_by_hop};
pub use service::{ClientAddr, ForwardFailure, Proxy, ProxyError, Upstream};
