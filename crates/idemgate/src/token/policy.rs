//! The policy of `idempotency = "token"` routes.

use std::sync::Arc;

use std::convert::Infallible;

use bytes::Bytes;
use http::request::Parts;

use super::codec::TokenKeys;
use crate::idempotency::{Head, Policy};
use idemgate_core::error::{Problem, Reason};
use idemgate_store::RecordKey;

/// `Idempotency-Token`.
pub const IDEMPOTENCY_TOKEN: http::HeaderName = http::HeaderName::from_static("idempotency-token");

/// Reads and verifies `Idempotency-Token`; the token id is the record key.
#[derive(Clone)]
pub struct TokenPolicy {
    keys: Arc<TokenKeys>,
    route: Arc<str>,
}

impl TokenPolicy {
    /// The policy of `route`.
    pub fn new(keys: Arc<TokenKeys>, route: &str) -> Self {
        TokenPolicy {
            keys,
            route: route.into(),
        }
    }
}

fn invalid(detail: &str) -> Problem {
    Problem::new(Reason::IdempotencyTokenInvalid)
        .detail(format!("{detail}; fetch a new token from /token"))
}

/// The record namespace of every token, whatever route it is used on (a
/// route name cannot hold `/`).
pub const TOKEN_RECORDS: &str = "/token";

impl Policy for TokenPolicy {
    const LAYER: &'static str = "token";

    fn record_key(&self, client_scope: String, _route: &str, key: String) -> RecordKey {
        // A token is one action: a token issued without `?route=` must
        // execute on at most one route, so its record is the token id's,
        // not the route's (its use on another route is a different request:
        // 422).
        RecordKey::new(client_scope, TOKEN_RECORDS, key)
    }

    type BodyKey = Infallible;

    fn key_in_body(&self, from: Infallible, _: &Parts, _: &Bytes) -> Result<String, Problem> {
        match from {}
    }

    fn key_in_head(&self, parts: &Parts, scope: &str) -> Result<Head, Problem> {
        let mut values = parts.headers.get_all(IDEMPOTENCY_TOKEN).iter();
        let Some(value) = values.next() else {
            return Err(Problem::new(Reason::IdempotencyTokenMissing).detail(
                "fetch a one-time token from POST /token and send it as Idempotency-Token",
            ));
        };
        if values.next().is_some() {
            return Err(invalid("more than one Idempotency-Token header"));
        }
        let token = value
            .to_str()
            .map_err(|_| invalid("the token is malformed"))?;
        let claims = self
            .keys
            .verify(token, scope)
            .map_err(|e| invalid(&e.to_string()))?;
        if let Some(bound) = &claims.route
            && **bound != *self.route
        {
            return Err(invalid("the token was issued for another route"));
        }
        if claims.expires_at <= idemgate_store::now_ms() / 1000 {
            let refusal = Problem::new(Reason::IdempotencyTokenExpired)
                .detail("fetch a new token from /token");
            return Ok(Head::ReplayOnly {
                key: claims.id,
                refusal,
            });
        }
        Ok(Head::Key(claims.id))
    }

    fn strip(&self, headers: &mut http::HeaderMap) {
        // The token is the gateway's credential, not the upstream's; the
        // upstream gets the stable Idempotency-Key instead.
        headers.remove(IDEMPOTENCY_TOKEN);
    }
}
