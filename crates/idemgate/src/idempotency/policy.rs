//! [`Policy`]: where a route's idempotency key comes from — the
//! `Idempotency-Key` header, a one-time token, or a business key in the
//! body — and what the engine asks of it.

use std::convert::Infallible;

use bytes::Bytes;
use http::HeaderMap;
use http::request::Parts;
use idemgate_core::error::Problem;
use idemgate_store::RecordKey;

/// What a policy read from the request head. `B` is what the policy hands
/// to its own [`Policy::key_in_body`] when the key is in the body; policies
/// that never read one use [`Infallible`], so `FromBody` cannot be built for
/// them and no route can ask a policy for a body key it does not read.
#[derive(Debug, Clone)]
pub enum Head<B = Infallible> {
    /// Protect the request under this key.
    Key(String),
    /// Forward without protection (a key route with `require_key = false`
    /// and no key).
    Bypass,
    /// The key is in the body: read it first ([`Policy::key_in_body`]).
    FromBody(B),
    /// Only replay a finished outcome stored under this key; otherwise
    /// answer `refusal` (a used token past its expiry).
    ReplayOnly {
        /// The key.
        key: String,
        /// The answer when nothing is stored under it.
        refusal: Problem,
    },
}

/// Where a route's idempotency key comes from.
pub trait Policy: Clone + Send + Sync + 'static {
    /// The layer's name in logs (`key`, `token`, `callback`).
    const LAYER: &'static str;

    /// Whether the records are the client's (scoped by its principal). A
    /// callback's or message's records are the sender's: its identity is
    /// not read at all (a provider's rotating credential must neither
    /// change the record nor be refused).
    const CLIENT_SCOPED: bool = true;

    /// Whether a record past its retention answers from its tombstone
    /// (`410`, `422`: a client's retry must learn its key is gone), or is
    /// taken over by the same key (a sender's redelivery: a payment
    /// provider retries for days and understands only a 2xx, so the
    /// delivery is forwarded again with the same stable key and the
    /// upstream's own state check answers it).
    const TOMBSTONED: bool = true;

    /// What [`Head::FromBody`] carries to [`Policy::key_in_body`]:
    /// [`Infallible`] for a policy whose key is never in the body.
    type BodyKey: Send + 'static;

    /// Reads the key from the head, or refuses the request (4xx) before its
    /// body is read and before any store access.
    fn key_in_head(&self, parts: &Parts, scope: &str) -> Result<Head<Self::BodyKey>, Problem>;

    /// Reads the key from the buffered body (callback routes), after the
    /// head said [`Head::FromBody`]. A policy with `BodyKey = Infallible`
    /// writes `match from {}`: it can never be called.
    fn key_in_body(
        &self,
        from: Self::BodyKey,
        parts: &Parts,
        body: &Bytes,
    ) -> Result<String, Problem>;

    /// Removes what must not reach the upstream (client credentials such as
    /// the one-time token).
    fn strip(&self, _headers: &mut HeaderMap) {}

    /// The request's fingerprint when it is not the whole request's (method,
    /// path and query, and body; `None`): a callback or message is the same
    /// request whenever its business key is, and its `must_match` fields
    /// agree (see [`super::body::key_fingerprint`]).
    fn fingerprint(&self, _parts: &Parts, _body: &Bytes, _key: &str) -> Option<String> {
        None
    }

    /// Which record a key names (docs/semantics.md, rule 4): by default the client's
    /// scope, the route and the key. Policies whose keys are not the
    /// client's own say otherwise (a callback's sender rotates credentials;
    /// a token is one action whatever route it is used on).
    fn record_key(&self, client_scope: String, route: &str, key: String) -> RecordKey {
        RecordKey::new(client_scope, route, key)
    }
}
