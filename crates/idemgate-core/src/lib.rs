//! The vocabulary every Idemgate crate shares, and nothing else: what a
//! refusal looks like, who the client is, how a forward failed, what is
//! counted.
//!
//! # Layout
//!
//! - [`error`]: the one [`Problem`](error::Problem) type
//!   (`application/problem+json`, RFC 9457) that every crate maps its own
//!   errors to, and the catalogue of reasons.
//! - [`identity`]: the client scope every record is keyed by — a principal
//!   header, or a verified JWT claim (feature `jwt`).
//! - [`request_id`]: `X-Request-Id`, kept or made (UUID v7).
//! - [`hop_by_hop`]: connection-specific headers, never forwarded or stored.
//! - [`forward`]: how a forward failed (never sent, or uncertain), as the
//!   innermost service tells the layers above.
//! - [`grpc`]: what a gRPC call looks like on the wire, and the gateway's
//!   refusals as gRPC statuses.
//! - [`client_addr`]: the peer a request came from.
//! - [`handler`]: a route's whole stack behind one object-safe trait.
//! - [`budget`]: claims in flight, counted per process and per connection.
//! - [`limits`]: descriptors, and the budgets sized from them.
//! - [`metrics`]: the Prometheus registry behind `/metrics`.
//! - [`step`]: [`await_boxed!`], a large step of an `async fn` awaited in a
//!   box of its own.
//! - [`trace`]: the span target and the W3C Trace Context hooks the binary
//!   installs when it exports traces.
//!
//! This crate sits at the bottom of the workspace: it depends on no other
//! Idemgate crate.

#![warn(missing_docs)]

pub mod budget;
pub mod client_addr;
pub mod error;
pub mod forward;
pub mod grpc;
pub mod handler;
pub mod hop_by_hop;
pub mod identity;
pub mod limits;
pub mod metrics;
pub mod request_id;
pub mod step;
pub mod trace;
