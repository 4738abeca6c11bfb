//! Idemgate: an HTTP idempotency gateway, and its idempotency layers as a
//! library.
//!
//! It stands in front of order and payment services and makes sure a retried
//! or duplicated request never makes them execute a business action twice.
//! The gateway is the `idemgate` binary ([`cli`]); the same engine mounts
//! on your own axum handlers through [`library`]:
//!
//! ```
//! use axum::{Router, routing::post};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let idempotency = idemgate::Idempotency::builder()
//!     .database_url("sqlite::memory:")
//!     .build()
//!     .await?;
//! let app: Router = Router::new()
//!     .route("/orders", post(|| async { "created" }))
//!     .route_layer(idempotency.key_layer("create-order"));
//! # let _ = app; Ok(()) }
//! ```
//!
//! # Public API
//!
//! [`library`] (its [`Idempotency`] and [`Builder`] also here) and [`cli`]
//! (the binaries' entry points) are the whole public API. The gateway's
//! modules below are not part of it: the `internals` feature shows them,
//! hidden and with no stability promise, to this package's own tests and
//! benchmarks.
//!
//! # Layout
//!
//! - [`library`]: the layers as a library, for axum or any tower service
//!   (see `examples/orders.rs`).
//! - [`cli`]: the command lines of the `idemgate` and `demo-upstream`
//!   binaries.
//! - `config`: the TOML file, environment overrides, validation.
//! - `gateway`: assembly — one tower stack per route, listeners, shutdown.
//! - `server`: the accept loop, TLS, the choice of HTTP/1.1 or HTTP/2 per
//!   connection, connection hardening, graceful drain.
//! - `tls`: PEM files, rustls configurations for both sides, the
//!   plain-or-TLS stream.
//! - `router`: path and method matching; counts and logs every request.
//! - `proxy`: the streaming proxy (hyper's HTTP/1.1 and HTTP/2 client,
//!   plain or TLS, under a per-worker keep-alive pool), the innermost
//!   service of a route.
//! - `store`: the SQL record (truth) behind a Redis or in-process fast
//!   layer; claims, fencing, retention.
//! - `identity`: the client scope every record is keyed by.
//! - `idempotency`: the engine (claim → hold → replay), the holder that
//!   sees a won claim through whatever its client does, and the policy
//!   layer every protected route runs.
//! - `token`: one-time tokens — `/token`, verification, the token policy.
//! - `callback`: business keys and signatures for callback routes.
//! - `consumer`: the MQ link — RabbitMQ and NATS JetStream consumers that
//!   deliver each message to an upstream once, through the same engine.
//! - `error`: the one `Problem` type (`application/problem+json`) that
//!   each module maps its own errors to.
//! - `hop_by_hop`: connection-specific headers, never forwarded or stored.
//! - `metrics`: the Prometheus registry behind `/metrics`.
//! - `admin`: `/healthz`, `/readyz`, `/metrics`, `/admin/*`.
//! - `demo_upstream`: the order/payment/coupon service the demo, tests and
//!   load tests run against.
//! - `demo`: `idemgate demo`, the gateway and the demo upstream together.
//! - `request_id`: `X-Request-Id`, kept or made (UUID v7).
//!
//! The imports point one way (`tests/layering.rs` fails on a cycle): at the
//! bottom `error`, `identity`, `request_id`, `hop_by_hop`, `tls`, `metrics`;
//! then `store`; then `idempotency` (the engine); then the policies
//! (`token`, `callback`), the `proxy` and the `consumer`; then `router`,
//! `config`, `server`; on top `admin`, `gateway`, `library`, `demo`, `cli`. A lower
//! module that needs configuration takes its own options type
//! (`store::StoreOptions`, `proxy::UpstreamSpec`,
//! `callback::SignatureSpec`), which `config` builds.

#![warn(missing_docs)]

pub mod cli;
pub mod library;

pub use library::{Builder, Idempotency};

// The gateway's modules: `pub`, hidden and unstable with the `internals`
// feature (this package's tests and benchmarks), private otherwise. Their
// `pub` items are the crate's own interface between modules, and some exist
// for the tests only. Written out in pairs rather than by a macro: rustfmt
// (and `cargo fmt --check` in CI) does not follow modules declared inside a
// macro.
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod admin;
#[cfg(not(feature = "internals"))]
#[allow(unreachable_pub, dead_code, unused_imports)]
mod admin;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod callback;
#[cfg(not(feature = "internals"))]
#[allow(unreachable_pub, dead_code, unused_imports)]
mod callback;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod config;
#[cfg(not(feature = "internals"))]
#[allow(unreachable_pub, dead_code, unused_imports)]
mod config;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod consumer;
#[cfg(not(feature = "internals"))]
#[allow(unreachable_pub, dead_code, unused_imports)]
mod consumer;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod demo;
#[cfg(not(feature = "internals"))]
#[allow(unreachable_pub, dead_code, unused_imports)]
mod demo;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod demo_upstream;
#[cfg(not(feature = "internals"))]
#[allow(unreachable_pub, dead_code, unused_imports)]
mod demo_upstream;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod error;
#[cfg(not(feature = "internals"))]
#[allow(unreachable_pub, dead_code, unused_imports)]
mod error;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod gateway;
#[cfg(not(feature = "internals"))]
#[allow(unreachable_pub, dead_code, unused_imports)]
mod gateway;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod hop_by_hop;
#[cfg(not(feature = "internals"))]
#[allow(unreachable_pub, dead_code, unused_imports)]
mod hop_by_hop;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod idempotency;
#[cfg(not(feature = "internals"))]
#[allow(unreachable_pub, dead_code, unused_imports)]
mod idempotency;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod identity;
#[cfg(not(feature = "internals"))]
#[allow(unreachable_pub, dead_code, unused_imports)]
mod identity;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod limits;
#[cfg(not(feature = "internals"))]
#[allow(unreachable_pub, dead_code, unused_imports)]
mod limits;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod metrics;
#[cfg(not(feature = "internals"))]
#[allow(unreachable_pub, dead_code, unused_imports)]
mod metrics;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod proxy;
#[cfg(not(feature = "internals"))]
#[allow(unreachable_pub, dead_code, unused_imports)]
mod proxy;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod request_id;
#[cfg(not(feature = "internals"))]
#[allow(unreachable_pub, dead_code, unused_imports)]
mod request_id;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod router;
#[cfg(not(feature = "internals"))]
#[allow(unreachable_pub, dead_code, unused_imports)]
mod router;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod server;
#[cfg(not(feature = "internals"))]
#[allow(unreachable_pub, dead_code, unused_imports)]
mod server;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod store;
#[cfg(not(feature = "internals"))]
#[allow(unreachable_pub, dead_code, unused_imports)]
mod store;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod tls;
#[cfg(not(feature = "internals"))]
#[allow(unreachable_pub, dead_code, unused_imports)]
mod tls;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod token;
#[cfg(not(feature = "internals"))]
#[allow(unreachable_pub, dead_code, unused_imports)]
mod token;
