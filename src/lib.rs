//! Idemgate: an HTTP idempotency gateway.
//!
//! It stands in front of order and payment services and makes sure a retried
//! or duplicated request never makes them execute a business action twice.
//!
//! # Layout
//!
//! - [`config`]: the TOML file, environment overrides, validation.
//! - [`gateway`]: assembly — one tower stack per route, listeners, shutdown.
//! - [`server`]: the accept loop, TLS, the choice of HTTP/1.1 or HTTP/2 per
//!   connection, connection hardening, graceful drain.
//! - [`tls`]: PEM files, rustls configurations for both sides, the
//!   plain-or-TLS stream.
//! - [`router`]: path and method matching; counts and logs every request.
//! - [`proxy`]: the streaming proxy (hyper's HTTP/1.1 and HTTP/2 client,
//!   plain or TLS, under a per-worker keep-alive pool), the innermost
//!   service of a route.
//! - [`store`]: the SQL record (truth) behind a Redis or in-process fast
//!   layer; claims, fencing, retention.
//! - [`identity`]: the client scope every record is keyed by.
//! - [`idempotency`]: the engine (claim → hold → replay), the holder that
//!   sees a won claim through whatever its client does, and the policy
//!   layer every protected route runs.
//! - [`token`]: one-time tokens — `/token`, verification, the token policy.
//! - [`callback`]: business keys and signatures for callback routes.
//! - [`consumer`]: the MQ link — RabbitMQ and NATS JetStream consumers that
//!   deliver each message to an upstream once, through the same engine.
//! - [`error`]: the one `Problem` type (`application/problem+json`) that
//!   each module maps its own errors to.
//! - [`hop_by_hop`]: connection-specific headers, never forwarded or stored.
//! - [`metrics`]: the Prometheus registry behind `/metrics`.
//! - [`admin`]: `/healthz`, `/readyz`, `/metrics`, `/admin/*`.
//! - [`demo_upstream`]: the order/payment/coupon service the demo, tests and
//!   load tests run against.
//! - [`library`]: the layers as a library, for axum or any tower service
//!   (see `examples/orders.rs`).
//!
//! The imports point one way (`tests/layering.rs` fails on a cycle): at the
//! bottom `error`, `identity`, `request_id`, `hop_by_hop`, `tls`, `metrics`;
//! then `store`; then `idempotency` (the engine); then the policies
//! (`token`, `callback`), the `proxy` and the `consumer`; then `router`,
//! `config`, `server`; on top `admin`, `gateway`, `library`, `demo`. A lower
//! module that needs configuration takes its own options type
//! (`store::StoreOptions`, `proxy::UpstreamSpec`,
//! `callback::SignatureSpec`), which `config` builds.

pub mod admin;
pub mod callback;
pub mod config;
pub mod consumer;
pub mod demo;
pub mod demo_upstream;
pub mod error;
pub mod gateway;
pub mod hop_by_hop;
pub mod idempotency;
pub mod identity;
pub mod library;
pub mod metrics;
pub mod proxy;
pub mod request_id;
pub mod router;
pub mod server;
pub mod store;
pub mod tls;
pub mod token;
