//! `[identity.jwt]`: the principal is a verified JWT's claim.
//!
//! The token comes from `Authorization: Bearer …` (the configured identity
//! header). It must be signed with HS256 by the configured secret, or with
//! RS256/ES256 by a key of the JWKS file (chosen by `kid`; a set of one key
//! needs none). `exp` is required, `nbf` honoured, both with a leeway;
//! `iss` is one of the configured issuers when any are, and `aud` is
//! checked when configured. `alg: none` and any algorithm the key was not
//! published for are refused.
//!
//! The principal is the pair (the token's own `iss`, the claim's value),
//! always: two identity providers trusted side by side (one JWKS holding
//! both their keys, or two issuers listed) each number their users, and
//! the same `sub` from each is two people. Scoped by the claim alone,
//! tenant B's user would be handed tenant A's stored answer. The scope is
//! a hash of both: the same person with a refreshed token is the same
//! client.
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
    /// The accepted `iss` values (empty: any). The token's own `iss` is
    /// part of the scope either way.
    pub issuers: Vec<String>,
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
    /// The one accepted issuer, when exactly one is configured: what an
    /// operator's principal without an issuer is read under.
    only_issuer: Option<String>,
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
            match settings.issuers.as_slice() {
                [] => v.iss = None,
                issuers => {
                    v.set_issuer(issuers);
                    // Listed issuers are required: a token without `iss`
                    // is none of them.
                    v.set_required_spec_claims(&["exp", "iss"]);
                }
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
            only_issuer: match settings.issuers.as_slice() {
                [only] => Some(only.clone()),
                _ => None,
            },
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
        // A token without `iss` (accepted only when no issuer is
        // required) is the empty issuer's.
        let issuer = match data.claims.get("iss") {
            None => "",
            Some(serde_json::Value::String(iss)) => iss.as_str(),
            Some(_) => return Err(invalid("its iss claim is not a string")),
        };
        Ok(scope_of(issuer, &principal))
    }

    /// The claim naming the principal.
    pub fn claim(&self) -> &str {
        &self.claim
    }

    /// The scope of a principal an operator names (`keys show --client`,
    /// `?client=`): `ISSUER PRINCIPAL`, or the principal alone when exactly
    /// one issuer is configured (or the tokens carry none).
    pub fn scope_of_principal(&self, given: &str) -> String {
        match given.trim().rsplit_once(char::is_whitespace) {
            Some((issuer, principal)) => scope_of(issuer.trim(), principal),
            None => scope_of(self.only_issuer.as_deref().unwrap_or(""), given.trim()),
        }
    }
}

/// The scope of the principal `claim` of `issuer`.
fn scope_of(issuer: &str, claim: &str) -> String {
    hashed(JWT_CONTEXT, &[issuer.as_bytes(), claim.as_bytes()])
}

#[cfg(test)]
mod tests {
    use jsonwebtoken::{EncodingKey, Header, encode};
    use serde_json::json;

    use super::*;
    use crate::identity::ANONYMOUS_SCOPE;

    /// A 2048-bit RSA key made for these tests only (openssl genpkey, as
    /// PKCS#1 DER: the crate's PEM reader is a feature left off).
    const RSA_DER: &[u8] = include_bytes!("testdata/rs256-test-key.der");
    /// Its public half as a JWK modulus (base64url).
    const RSA_N: &str = "5FU3CDVfM7s7W8MBzxb0iIowr708b33vaYqOvgk6EQgxk5zaCNnD3ruh6BVkcufhqLJ-tqU1MPGMk8saT6UWMYwOjuUHYs5ahDFtM-0rIKUD5_Z3DYR-x99rHk0Wk4mRzrGmpcZDMHVkydlMvevIzAbMdgz1xuVvBBqO2A8CByz3L8YkDGA3htuAaWadTJY7UdQrp6-lmGMLK0XDPTIqscs95LHPc71y1Mzzma8OteryBWRznjHKZ57mMev784LhRqNNqu7ZNjqTE4ksweDU2m1zuEV3PhIGJYmQEf2wvywrdPQmeAK6rporkBaUphH718FbTShm19yfE5WOVzj5Sw";

    fn now() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
    }

    fn settings(keys: JwtKeys) -> JwtSettings {
        JwtSettings {
            header: http::header::AUTHORIZATION,
            claim: "sub".into(),
            keys,
            issuers: vec!["https://auth.example".into()],
            audience: Some("orders".into()),
            leeway: Duration::from_secs(30),
        }
    }

    fn bearer(token: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::AUTHORIZATION,
            format!("Bearer {token}").parse().unwrap(),
        );
        headers
    }

    fn claims(sub: &str, exp_from_now: i64) -> serde_json::Value {
        json!({
            "sub": sub,
            "iss": "https://auth.example",
            "aud": "orders",
            "exp": now() as i64 + exp_from_now,
        })
    }

    fn sign(
        alg: Algorithm,
        kid: Option<&str>,
        key: &EncodingKey,
        claims: &serde_json::Value,
    ) -> String {
        let mut header = Header::new(alg);
        header.kid = kid.map(str::to_owned);
        encode(&header, claims, key).unwrap()
    }

    /// An ES256 key pair: the signing key, and its JWK.
    fn es256(kid: &str) -> (EncodingKey, serde_json::Value) {
        use base64::Engine as _;
        let pair = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let point = pair.public_key_raw(); // 0x04 || x || y
        let b64 = |b: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
        let jwk = json!({
            "kty": "EC", "crv": "P-256", "kid": kid, "alg": "ES256", "use": "sig",
            "x": b64(&point[1..33]), "y": b64(&point[33..65]),
        });
        let key = EncodingKey::from_ec_der(&pair.serialize_der());
        (key, jwk)
    }

    fn rs256_jwk(kid: &str) -> serde_json::Value {
        json!({"kty": "RSA", "kid": kid, "alg": "RS256", "use": "sig", "n": RSA_N, "e": "AQAB"})
    }

    fn jwks(keys: &[serde_json::Value]) -> JwtKeys {
        JwtKeys::Jwks(json!({ "keys": keys }).to_string())
    }

    #[test]
    fn rs256_and_es256_tokens_verify_by_kid_and_keep_the_scope_across_a_refresh() {
        let (ec_key, ec_jwk) = es256("ec-1");
        let rsa_key = EncodingKey::from_rsa_der(RSA_DER);
        let identity = JwtIdentity::new(&settings(jwks(&[rs256_jwk("rsa-1"), ec_jwk]))).unwrap();
        let by_rsa = sign(
            Algorithm::RS256,
            Some("rsa-1"),
            &rsa_key,
            &claims("alice", 300),
        );
        let by_ec = sign(
            Algorithm::ES256,
            Some("ec-1"),
            &ec_key,
            &claims("alice", 900),
        );
        let a = identity.scope(&bearer(&by_rsa)).unwrap();
        // Another token (another key, another expiry) for the same
        // principal: the same client.
        assert_eq!(identity.scope(&bearer(&by_ec)).unwrap(), a);
        assert_ne!(a, ANONYMOUS_SCOPE);
        let bob = sign(Algorithm::ES256, Some("ec-1"), &ec_key, &claims("bob", 300));
        assert_ne!(identity.scope(&bearer(&bob)).unwrap(), a);
    }

    #[test]
    fn a_token_signed_by_another_key_or_naming_an_unknown_kid_is_refused() {
        let (_, published) = es256("ec-1");
        let (forger, _) = es256("ec-1");
        let identity = JwtIdentity::new(&settings(jwks(&[published, rs256_jwk("rsa-1")]))).unwrap();
        let forged = sign(
            Algorithm::ES256,
            Some("ec-1"),
            &forger,
            &claims("alice", 300),
        );
        assert!(matches!(
            identity.scope(&bearer(&forged)),
            Err(IdentityError::InvalidToken(_))
        ));
        let unknown = sign(
            Algorithm::ES256,
            Some("ec-9"),
            &forger,
            &claims("alice", 300),
        );
        assert!(identity.scope(&bearer(&unknown)).is_err());
        // With two keys a token must say which one.
        let unnamed = sign(Algorithm::ES256, None, &forger, &claims("alice", 300));
        assert!(identity.scope(&bearer(&unnamed)).is_err());
    }

    #[test]
    fn the_same_claim_from_two_issuers_is_two_principals() {
        let secret = JwtKeys::Hs256(vec![7u8; 32]);
        let key = EncodingKey::from_secret(&[7u8; 32]);
        let token = |iss: Option<&str>| {
            let mut c = claims("alice", 300);
            match iss {
                Some(iss) => c["iss"] = json!(iss),
                None => {
                    c.as_object_mut().unwrap().remove("iss");
                }
            }
            sign(Algorithm::HS256, None, &key, &c)
        };
        // No issuer required: any is accepted, and each is its own scope.
        let mut open = settings(secret.clone());
        open.issuers.clear();
        let identity = JwtIdentity::new(&open).unwrap();
        let scope = |iss| identity.scope(&bearer(&token(iss))).unwrap();
        let (a, b) = (
            scope(Some("https://a.example")),
            scope(Some("https://b.example")),
        );
        assert_ne!(a, b, "tenant B's alice is not tenant A's");
        assert_eq!(a, scope(Some("https://a.example")));
        assert_ne!(scope(None), a);
        // An operator names one as "ISSUER PRINCIPAL".
        assert_eq!(identity.scope_of_principal("https://b.example alice"), b);
        // Two issuers listed: both accepted, still apart; a third refused.
        let mut two = settings(secret);
        two.issuers = vec!["https://a.example".into(), "https://b.example".into()];
        let identity = JwtIdentity::new(&two).unwrap();
        let scope = |iss| identity.scope(&bearer(&token(iss)));
        assert_eq!(scope(Some("https://a.example")).unwrap(), a);
        assert_eq!(scope(Some("https://b.example")).unwrap(), b);
        assert!(scope(Some("https://c.example")).is_err());
        assert!(scope(None).is_err(), "an issuer is required");
    }

    #[test]
    fn an_hs256_token_is_refused_by_a_key_published_for_rs256() {
        // Algorithm confusion: the RSA key's public bytes as an HMAC secret.
        let identity = JwtIdentity::new(&settings(jwks(&[rs256_jwk("rsa-1")]))).unwrap();
        let confused = sign(
            Algorithm::HS256,
            Some("rsa-1"),
            &EncodingKey::from_secret(RSA_N.as_bytes()),
            &claims("alice", 300),
        );
        assert!(identity.scope(&bearer(&confused)).is_err());
    }

    #[test]
    fn issuer_audience_expiry_and_leeway_are_checked() {
        let (key, jwk) = es256("ec-1");
        let identity = JwtIdentity::new(&settings(jwks(&[jwk]))).unwrap();
        let scope = |claims: &serde_json::Value| {
            identity.scope(&bearer(&sign(Algorithm::ES256, None, &key, claims)))
        };
        assert!(
            scope(&claims("alice", 300)).is_ok(),
            "a set of one key needs no kid"
        );
        // Expired 10 s ago: within the 30 s leeway. 120 s ago: refused.
        assert!(scope(&claims("alice", -10)).is_ok());
        assert!(scope(&claims("alice", -120)).is_err());
        let mut other_issuer = claims("alice", 300);
        other_issuer["iss"] = json!("https://evil.example");
        assert!(scope(&other_issuer).is_err());
        let mut other_audience = claims("alice", 300);
        other_audience["aud"] = json!("billing");
        assert!(scope(&other_audience).is_err());
        let mut no_expiry = claims("alice", 300);
        no_expiry.as_object_mut().unwrap().remove("exp");
        assert!(scope(&no_expiry).is_err());
        // Not yet valid (nbf two minutes ahead, past the leeway).
        let mut early = claims("alice", 300);
        early["nbf"] = json!(now() + 120);
        assert!(scope(&early).is_err());
    }

    #[test]
    fn keys_other_than_rs256_or_p256_are_refused_at_start() {
        let p384 = json!({"kty": "EC", "crv": "P-384", "kid": "x",
            "x": "iA7lWQLzVrKGEFjfGMfMHfTEZ2KnLiKU7JuNT3E7ygsfE7ygsfE7ygsfE7ygsfE7",
            "y": "iA7lWQLzVrKGEFjfGMfMHfTEZ2KnLiKU7JuNT3E7ygsfE7ygsfE7ygsfE7ygsfE7"});
        assert!(JwtIdentity::new(&settings(jwks(&[p384]))).is_err());
        assert!(JwtIdentity::new(&settings(jwks(&[]))).is_err());
        assert!(JwtIdentity::new(&settings(JwtKeys::Hs256(b"short".to_vec()))).is_err());
    }
}
