//! The Idemgate gateway: a reverse proxy whose protected routes run the
//! idempotency engine in front of an upstream.
//!
//! # Layout
//!
//! - [`config`]: the TOML file, environment overrides, validation into a
//!   typed plan, and what each lower crate is built from.
//! - [`router`]: path and method matching, CORS preflights; counts and logs
//!   every request.
//! - [`gateway`]: start-up in named phases — one tower stack per route,
//!   listeners, consumers, shutdown.
//! - [`admin`]: `/healthz`, `/readyz`, `/metrics`, `/admin/*`.
//! - [`status_endpoint`]: reconciliation over a route's own upstream.

#![warn(missing_docs)]

pub mod admin;
pub mod config;
pub mod gateway;
pub mod router;
pub mod status_endpoint;
