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
//! - [`error`]: the one place errors become `application/problem+json`.
//! - [`metrics`]: the Prometheus registry behind `/metrics`.
//! - [`admin`]: `/healthz`, `/readyz`, `/metrics`, `/admin/*`.
//! - [`demo_upstream`]: the order/payment/coupon service the demo, tests and
//!   load tests run against.
//! - [`library`]: the layers as a library, for axum or any tower service
//!   (see `examples/orders.rs`).

pub mod admin;
pub mod callback;
pub mod config;
pub mod consumer;
pub mod demo;
pub mod demo_upstream;
pub mod error;
pub mod gateway;
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
