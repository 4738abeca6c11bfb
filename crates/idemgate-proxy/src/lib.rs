//! The streaming reverse proxy: the innermost service of every route stack.
//!
//! [`Proxy`] forwards one request to one upstream over this worker's pool
//! of keep-alive connections ([`Pool`]) with hyper's client, over HTTP/1.1
//! or HTTP/2, plain or TLS. Bodies
//! stream both ways: a request body over 64 KiB or without a length is
//! never buffered here, only counted against `server.max_body_bytes`
//! (smaller ones are read whole first, as nginx does, so that the request
//! leaves in one write). Policy layers (key, token, callback) sit in front
//! of it and never reach into it; they read how a forward failed from the
//! [`ForwardFailure`] extension on the error response.
//!
//! The proxy never retries a request that may have reached the upstream. It
//! re-sends only a request that hyper handed back unwritten because its
//! pooled connection had closed.
//!
//! # Layout
//!
//! - `service.rs`: [`Proxy`], the tower service, and how its errors become
//!   answers.
//! - `client.rs`, `connect.rs`: hyper's client on one connection, and
//!   connecting (TCP, TLS, ALPN) with what a failure means for a claim.
//! - `pool/`: each worker's keep-alive connections per upstream, HTTP/2
//!   sharing, and the connection cap's queue.
//! - `headers.rs`: what is stripped and added on the way up and down.
//! - [`tls`]: TLS configuration, and the plain-or-TLS stream type.
#![warn(missing_docs)]

mod client;
mod connect;
mod headers;
mod pool;
mod service;
pub mod tls;

pub use headers::{ClientAddr, HOP_BY_HOP, is_hop_by_hop};
pub use pool::{Pool, PoolOptions};
pub use service::{ForwardFailure, Proxy, ProxyError, Upstream, UpstreamSpec};
