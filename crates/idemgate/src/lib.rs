//! Idempotency for axum and tower services: a retried or duplicated request
//! never makes your handler execute a business action twice.
//!
//! See [`Idempotency`] to mount the layers on your own routes. The same
//! engine runs inside the Idemgate gateway, in front of any HTTP upstream.
//!
//! # Layout
//!
//! - [`Idempotency`] and [`Builder`]: what every layer of an application
//!   shares (the store, the sweeper, the purge-log follower, the claims it
//!   holds), and a layer per
//!   route — key, token or callback.
//! - [`idempotency`]: the engine (claim → hold → replay), the holder that
//!   sees a won claim through whatever its client does, and
//!   [`IdempotencyLayer`], which runs a [`Policy`] and the engine in front of
//!   an inner service.
//! - [`token`]: one-time tokens — the `/token` endpoint and the token
//!   policy.
//! - [`callback`]: business keys and signatures for callbacks (payment
//!   notifications, webhooks, pushed messages).
//!
//! The record itself is `idemgate-store`'s; what a refusal looks like and
//! who the client is are `idemgate-core`'s.

#![warn(missing_docs)]

pub mod callback;
pub mod idempotency;
mod library;
pub mod token;

/// gRPC on the wire: a layer's refusals of a gRPC call become gRPC
/// statuses with [`grpc::refusal_as_grpc`] (the gateway's router does this
/// for every route; docs/grpc.md).
pub use idemgate_core::grpc;

pub use callback::CallbackPolicy;
pub use idemgate_store::StoreError;
pub use idempotency::{
    Answer, IdempotencyLayer, IdempotencyService, KeyPolicy, OnConcurrent, Policy, Verdict,
};
pub use library::{
    Builder, CallbackBuilder, CallbackError, DEFAULT_BODY_READ_TIMEOUT, DEFAULT_HANDLER_DEADLINE,
    DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_BUFFERED_BYTES, DEFAULT_MAX_CAPTURED_BYTES,
    DEFAULT_MAX_CLAIMS, DEFAULT_SIGNATURE_TOLERANCE, DEFAULT_TOKEN_TTL, Idempotency, Signature,
};
pub use token::{TokenEndpoint, TokenPolicy};
