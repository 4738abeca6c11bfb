//! The policy of `kind = "callback"` routes: verify, then read the business
//! key from the buffered request. An `Idempotency-Token` is never consulted,
//! and records are scoped by the route, not by a client credential.

use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;

use super::key::{KeySource, business_key, match_values};
use super::signature::Verifier;
use crate::idempotency::{Head, Policy};
use idemgate_core::error::{Problem, Reason};
use idemgate_store::RecordKey;

/// Reads a callback's business key, after its signature checked out.
#[derive(Clone)]
pub struct CallbackPolicy {
    sources: Arc<[KeySource]>,
    verifier: Option<Arc<Verifier>>,
    /// Fields a redelivery must repeat (`routes[].must_match`), and their
    /// names as configured.
    must_match: Arc<[KeySource]>,
    must_match_names: Arc<[String]>,
    /// The request path is part of the key (a `path_prefix` route: one
    /// provider's payment and refund notifications carry the same trade
    /// number to two paths, and are two actions).
    by_path: bool,
}

impl CallbackPolicy {
    /// A policy over validated sources and an optional verifier.
    pub fn new(sources: Vec<KeySource>, verifier: Option<Verifier>) -> Self {
        CallbackPolicy {
            sources: sources.into(),
            verifier: verifier.map(Arc::new),
            must_match: Arc::new([]),
            must_match_names: Arc::new([]),
            by_path: false,
        }
    }

    /// Makes the request path part of every key: for a route that serves
    /// several paths (`path_prefix`), where one business key may name a
    /// different action on each.
    pub fn scoped_by_path(mut self) -> Self {
        self.by_path = true;
        self
    }

    /// Fields a redelivery with the same business key must repeat; one that
    /// differs is refused `422` (and logged as an error).
    pub fn with_must_match(mut self, fields: Vec<KeySource>) -> Self {
        self.must_match_names = fields.iter().map(KeySource::describe).collect();
        self.must_match = fields.into();
        self
    }
}

/// The scope of every callback record: the route is the sender, so the
/// records are the route's, not a credential's (client scopes are
/// `anonymous` or `c_<hex>`, never this).
pub const ROUTE_SCOPE: &str = "route";

impl Policy for CallbackPolicy {
    const LAYER: &'static str = "callback";

    const CLIENT_SCOPED: bool = false;

    const TOMBSTONED: bool = false;

    /// A redelivery is the same delivery whenever its business key is:
    /// providers re-stamp retries (`notify_time`, attempt counters), and a
    /// whole-body fingerprint would refuse them forever (docs/semantics.md, rule 9).
    fn fingerprint(&self, parts: &Parts, body: &Bytes, key: &str) -> Option<String> {
        let values = match_values(&self.must_match, parts, body);
        let fields = self
            .must_match_names
            .iter()
            .zip(&values)
            .map(|(name, value)| (name.as_str(), value.as_deref()));
        Some(crate::idempotency::body::key_fingerprint(key, fields))
    }

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
                .verify(&parts.headers, body, idemgate_store::now_ms() / 1000)
                .map_err(|e| Problem::new(Reason::SignatureInvalid).detail(e.to_string()))?;
        }
        let key = business_key(&self.sources, parts, body).map_err(|e| {
            let reason = match e {
                super::key::BusinessKeyError::Missing(_) => Reason::BusinessKeyMissing,
                super::key::BusinessKeyError::Invalid { .. } => Reason::BusinessKeyInvalid,
            };
            Problem::new(reason).detail(e.to_string())
        })?;
        Ok(match self.by_path {
            // A path never holds a raw space: the two halves cannot blur.
            true => format!("{} {key}", parts.uri.path()),
            false => key,
        })
    }
}
