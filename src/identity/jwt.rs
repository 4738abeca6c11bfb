//! `[identity.jwt]`: the principal is a verified JWT's claim.
//!
//! The token comes from `Authorization: Bearer …` (the configured identity
//! header). It must be signed with HS256 by the configured secret, or with
//! RS256/ES256 by a key of the JWKS file (chosen by `kid`; a set of one key
//! needs none). `exp` is required, `nbf` honoured, both with a leeway;
//! `iss` and `aud` are checked when configured. `alg: none` and any
//! algorithm the key was not published for are refused. The scope is a
//! hash of the configured issuer and the claim's value: the same person
//! with a refreshed token is the same client.
//!
//! Verification uses the `jsonwebtoken` crate (9.x, on ring, which the TLS
//! stack already builds; the later major versions need a second crypto
//! provider).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderName};
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet, KeyAlgorithm};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};

use super::{IdentityError, hashed};

/// Hash context of JWT principals.
const JWT_CONTEXT: &[u8] = b"idemgate/identity/jwt/v1\0";

/// What a JWT identity is built from (a validated `[identity.jwt]`).
#[derive(Debug, Clone)]
pub struct JwtSettings {
    /// The header carrying `Bearer <jwt>`.
    pub header: HeaderName,
    /// The claim naming the principal (`sub`).
    pub claim: String,
    /// How the signature is checked.
    pub keys: JwtKeys,
    /// Required `iss`, when set (and part of the scope).
    pub issuer: Option<String>,
    /// Required `aud`, when set.
    pub audience: Option<String>,
    /// Clock skew allowed on `exp` and `nbf`.
    pub leeway: Duration,
}

/// Where the verification keys come from.
#[derive(Clone)]
pub enum JwtKeys {
    /// HS256 with this secret.
    Hs256(Vec<u8>),
    /// RS256/ES256 with the keys of a JWKS document (its text).
    Jwks(String),
}

impl std::fmt::Debug for JwtKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JwtKeys::Hs256(_) => f.write_str("Hs256(…)"),
            JwtKeys::Jwks(_) => f.write_str("Jwks(…)"),
        }
    }
}

/// A verifier, keys loaded.
pub struct JwtIdentity {
    header: HeaderName,
    claim: String,
    issuer: String,
    /// By `kid` (`None`: the key used when a token names none).
    keys: HashMap<Option<String>, Arc<(DecodingKey, Validation)>>,
}

impl JwtIdentity {
    /// Loads the keys; an unusable secret or JWKS is an error naming why.
    pub fn new(settings: &JwtSettings) -> Result<JwtIdentity, String> {
        let validation = |alg: Algorithm| {
            let mut v = Validation::new(alg);
            v.leeway = settings.leeway.as_secs();
            v.validate_nbf = true;
            v.set_required_spec_claims(&["exp"]);
            match &settings.issuer {
                Some(iss) => v.set_issuer(&[iss]),
                None => v.iss = None,
            }
            match &settings.audience {
                Some(aud) => v.set_audience(&[aud]),
                None => v.validate_aud = false,
            }
            v
        };
        let mut keys = HashMap::new();
        match &settings.keys {
            JwtKeys::Hs256(secret) => {
                if secret.len() < 32 {
                    return Err("hs256_secret must be at least 32 bytes (RFC 7518 §3.2)".into());
                }
                keys.insert(
                    None,
                    Arc::new((
                        DecodingKey::from_secret(secret),
                        validation(Algorithm::HS256),
                    )),
                );
            }
            JwtKeys::Jwks(text) => {
                let set: JwkSet =
                    serde_json::from_str(text).map_err(|e| format!("not a JWKS document: {e}"))?;
                for jwk in &set.keys {
                    let alg = match (&jwk.algorithm, jwk.common.key_algorithm) {
                        (AlgorithmParameters::RSA(_), None | Some(KeyAlgorithm::RS256)) => {
                            Algorithm::RS256
                        }
                        (
                            AlgorithmParameters::EllipticCurve(ec),
                            None | Some(KeyAlgorithm::ES256),
                        ) if ec.curve == EllipticCurve::P256 => Algorithm::ES256,
                        (_, alg) => {
                            return Err(format!(
                                "key {:?}: only RS256 and ES256 (P-256) keys are accepted, not {alg:?}",
                                jwk.common.key_id
                            ));
                        }
                    };
                    let key = DecodingKey::from_jwk(jwk)
                        .map_err(|e| format!("key {:?}: {e}", jwk.common.key_id))?;
                    keys.insert(jwk.common.key_id.clone(), Arc::new((key, validation(alg))));
                }
                if keys.is_empty() {
                    return Err("the JWKS document has no keys".into());
                }
                if keys.len() == 1 && !keys.contains_key(&None) {
                    // A set of one key verifies tokens that name no kid.
                    let only = keys.values().next().cloned().expect("one key");
                    keys.insert(None, only);
                }
            }
        }
        Ok(JwtIdentity {
            header: settings.header.clone(),
            claim: settings.claim.clone(),
            issuer: settings.issuer.clone().unwrap_or_default(),
            keys,
        })
    }

    /// The scope of a request: anonymous without the header, the verified
    /// principal's otherwise.
    pub fn scope(&self, headers: &HeaderMap) -> Result<String, IdentityError> {
        let mut values = headers.get_all(&self.header).iter();
        let Some(value) = values.next() else {
            return Ok(super::ANONYMOUS_SCOPE.to_owned());
        };
        let invalid = |why: &str| IdentityError::InvalidToken(why.to_owned());
        if values.next().is_some() {
            return Err(IdentityError::Repeated(self.header.to_string()));
        }
        let value = value.to_str().map_err(|_| invalid("not visible ASCII"))?;
        let token = match value.trim().split_once(' ') {
            Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => token.trim(),
            _ => return Err(invalid("not a Bearer token")),
        };
        let header = jsonwebtoken::decode_header(token).map_err(|e| invalid(&e.to_string()))?;
        let key = self
            .keys
            .get(&header.kid)
            .ok_or_else(|| invalid("no key for its kid"))?;
        let (key, validation) = (&key.0, &key.1);
        let data = jsonwebtoken::decode::<serde_json::Map<String, serde_json::Value>>(
            token, key, validation,
        )
        .map_err(|e| invalid(&e.to_string()))?;
        let principal = match data.claims.get(&self.claim) {
            Some(serde_json::Value::String(s)) if !s.is_empty() => s.clone(),
            Some(serde_json::Value::Number(n)) => n.to_string(),
            _ => return Err(invalid(&format!("no {:?} claim", self.claim))),
        };
        Ok(self.scope_of_principal(&principal))
    }

    /// The scope of a principal (the claim's value).
    pub fn scope_of_principal(&self, principal: &str) -> String {
        hashed(JWT_CONTEXT, &[self.issuer.as_bytes(), principal.as_bytes()])
    }
}
