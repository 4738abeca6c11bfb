//! The idempotency engine and its policy layers.
//!
//! One engine serves every protected route: scope + key → claim → forward →
//! store the outcome → replay. What differs per route is only where the key
//! comes from, which a [`Policy`] says: the `Idempotency-Key` header
//! ([`KeyPolicy`]), a one-time token ([`crate::token::TokenPolicy`]), or a
//! business key in the request ([`crate::callback`]). [`IdempotencyLayer`]
//! puts a policy and the engine in front of a route's proxy, in the manner of
//! tower-http: Layer, Service, response future.
//!
//! Where each decision is made:
//! - 400 (bad or missing key), 413 (body too large): `layer`, before any
//!   store access; nothing is forwarded or stored.
//! - 409 / wait, 422, replay, 503: [`engine`], from the store's claim answer.
//! - release, uncertain, completion: `holder`, from the forward's outcome,
//!   in a task of its own that the client cannot cancel.

pub mod answer;
pub mod body;
pub mod engine;
mod expires;
mod holder;
mod key;
mod layer;
pub mod outcome;
mod policy;
mod reconcile;
mod stable_key;
mod verdict;

pub use engine::{Engine, EngineSettings, IdempotencyError, OnConcurrent};
pub use holder::Holders;
pub use key::KeyPolicy;
pub use layer::{IdempotencyLayer, IdempotencyService, ResponseFuture};
pub use policy::{Head, Policy};
pub use reconcile::{Reconcile, Reconciled, Reconciliation, reconcile_uncertain};
pub use stable_key::{StableKey, stable_key};
pub use verdict::{Answer, Verdict};

pub use idemgate_core::forward::ForwardFailure;

/// `Idempotency-Key`.
pub const IDEMPOTENCY_KEY: http::HeaderName = http::HeaderName::from_static("idempotency-key");
/// `Idempotent-Replayed: true` marks a replayed response.
pub const IDEMPOTENT_REPLAYED: http::HeaderName =
    http::HeaderName::from_static("idempotent-replayed");
/// `Idempotent-Body-Omitted: true`: the stored response was over the body cap.
pub const IDEMPOTENT_BODY_OMITTED: http::HeaderName =
    http::HeaderName::from_static("idempotent-body-omitted");
