//! The policy of `kind = "callback"` routes: verify, then read the business
//! key from the buffered request. An `Idempotency-Token` is never consulted,
//! and records are scoped by the route, not by a client credential.

use std::sync::Arc;

use bytes::Bytes;
use http::StatusCode;
use http::request::Parts;

use super::key::{KeySource, business_key};
use super::signature::Verifier;
use crate::error::Problem;
use crate::idempotency::{Head, Policy};
use crate::store::RecordKey;

/// Reads a callback's business key, after its signature checked out.
#[derive(Clone)]
pub struct CallbackPolicy {
    sources: Arc<[KeySource]>,
    verifier: Option<Arc<Verifier>>,
}

impl CallbackPolicy {
    /// A policy over validated sources and an optional verifier.
    pub(crate) fn new(sources: Vec<KeySource>, verifier: Option<Verifier>) -> Self {
        CallbackPolicy {
            sources: sources.into(),
            verifier: verifier.map(Arc::new),
        }
    }
}

/// The scope of every callback record: the route is the sender, so the
/// records are the route's, not a credential's (client scopes are
/// `anonymous` or `c_<hex>`, never this).
pub const ROUTE_SCOPE: &str = "route";

impl Policy for CallbackPolicy {
    const LAYER: &'static str = "callback";

    fn record_key(&self, _client_scope: String, route: &str, key: String) -> RecordKey {
        // Providers rotate their credentials between redeliveries (Pub/Sub
        // OIDC tokens, Event Grid): a redelivery must find the first
        // delivery's record whatever `Authorization` it carries.
        RecordKey::new(ROUTE_SCOPE, route, key)
    }

    type BodyKey = ();

    fn key_in_head(&self, _parts: &Parts, _scope: &str) -> Result<Head<()>, Problem> {
        Ok(Head::FromBody(()))
    }

    fn key_in_body(&self, (): (), parts: &Parts, body: &Bytes) -> Result<String, Problem> {
        // Signature first: an unauthenticated request must not even have
        // its key read, let alone stored.
        if let Some(verifier) = &self.verifier {
            verifier
                .verify(&parts.headers, body, crate::store::now_ms() / 1000)
                .map_err(|e| {
                    Problem::new(
                        StatusCode::UNAUTHORIZED,
                        "signature-invalid",
                        "The callback's signature could not be verified",
                    )
                    .detail(e.to_string())
                })?;
        }
        business_key(&self.sources, parts, body).map_err(|e| {
            let (reason, title) = match e {
                super::key::KeyError::Missing(_) => (
                    "business-key-missing",
                    "The callback carries no business key",
                ),
                super::key::KeyError::Invalid { .. } => (
                    "business-key-invalid",
                    "The callback's business key cannot be read",
                ),
            };
            Problem::new(StatusCode::BAD_REQUEST, reason, title).detail(e.to_string())
        })
    }
}
