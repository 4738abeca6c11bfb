//! Token issue and verification.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use hmac::{Hmac, Mac};
use sha2::Sha256;

const VERSION: &str = "v1";
const MAC_CONTEXT: &[u8] = b"idemgate/token/v1\0";
const ID_BYTES: usize = 16;

/// Why a token was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Not a token's shape.
    #[error("the token is malformed")]
    Malformed,
    /// Its MAC does not verify under any secret, for this client.
    #[error("the token's signature does not match (forged, altered, or another client's)")]
    BadSignature,
}

/// What a verified token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenClaims {
    /// 32 hex characters; the record key on token routes.
    pub id: String,
    /// Unix seconds.
    pub expires_at: i64,
    /// The route it is bound to, if any.
    pub route: Option<String>,
}

/// The HMAC keys: tokens are signed with the first and verified with any
/// (rotation: `tokens.secrets = ["new", "old"]`).
pub struct TokenKeys {
    secrets: Vec<Vec<u8>>,
}

impl TokenKeys {
    /// Keys from the configured secret; an empty secret makes a random one
    /// (the returned flag says so, for the start-up warning).
    pub fn new(secret: &str) -> (TokenKeys, bool) {
        Self::rotating(&[secret])
    }

    /// Keys from `secrets`, newest first; none (or only empty ones) makes a
    /// random one, as [`Self::new`] does.
    pub fn rotating(secrets: &[&str]) -> (TokenKeys, bool) {
        let secrets: Vec<Vec<u8>> = secrets
            .iter()
            .filter(|s| !s.is_empty())
            .map(|s| s.as_bytes().to_vec())
            .collect();
        if secrets.is_empty() {
            let mut random = vec![0u8; 32];
            getrandom::fill(&mut random).expect("the OS random source");
            (
                TokenKeys {
                    secrets: vec![random],
                },
                true,
            )
        } else {
            (TokenKeys { secrets }, false)
        }
    }

    fn mac(&self, payload: &[u8], scope: &str) -> Hmac<Sha256> {
        self.mac_with(&self.secrets[0], payload, scope)
    }

    fn mac_with(&self, secret: &[u8], payload: &[u8], scope: &str) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
        mac.update(MAC_CONTEXT);
        mac.update(payload);
        mac.update(&(scope.len() as u64).to_be_bytes());
        mac.update(scope.as_bytes());
        mac
    }

    /// Issues a token for `scope`, optionally bound to `route`.
    pub fn issue(
        &self,
        route: Option<&str>,
        scope: &str,
        expires_at: i64,
    ) -> (String, TokenClaims) {
        let mut id = [0u8; ID_BYTES];
        getrandom::fill(&mut id).expect("the OS random source");
        let route_bytes = route.unwrap_or_default().as_bytes();
        let mut payload = Vec::with_capacity(ID_BYTES + 8 + 2 + route_bytes.len());
        payload.extend_from_slice(&id);
        payload.extend_from_slice(&expires_at.to_be_bytes());
        payload.extend_from_slice(&(route_bytes.len() as u16).to_be_bytes());
        payload.extend_from_slice(route_bytes);
        let tag = self.mac(&payload, scope).finalize().into_bytes();
        let token = format!("{VERSION}.{}.{}", B64.encode(&payload), B64.encode(tag));
        let claims = TokenClaims {
            id: hex::encode(id),
            expires_at,
            route: route.map(str::to_owned),
        };
        (token, claims)
    }

    /// Checks the token's MAC for `scope` (constant time) and decodes it.
    /// Expiry and route binding are the caller's to judge.
    pub fn verify(&self, token: &str, scope: &str) -> Result<TokenClaims, TokenError> {
        let mut parts = token.split('.');
        let (Some(VERSION), Some(payload), Some(tag), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(TokenError::Malformed);
        };
        let payload = B64.decode(payload).map_err(|_| TokenError::Malformed)?;
        let tag = B64.decode(tag).map_err(|_| TokenError::Malformed)?;
        // Every secret is tried (each comparison in constant time): a token
        // signed before a rotation stays valid under the old secret.
        let authentic = self.secrets.iter().any(|secret| {
            self.mac_with(secret, &payload, scope)
                .verify_slice(&tag)
                .is_ok()
        });
        if !authentic {
            return Err(TokenError::BadSignature);
        }
        // Authentic from here on: the layout is ours.
        if payload.len() < ID_BYTES + 10 {
            return Err(TokenError::Malformed);
        }
        let (id, rest) = payload.split_at(ID_BYTES);
        let (expiry, rest) = rest.split_at(8);
        let (len, route) = rest.split_at(2);
        let len = u16::from_be_bytes([len[0], len[1]]) as usize;
        if route.len() != len {
            return Err(TokenError::Malformed);
        }
        let route = String::from_utf8(route.to_vec()).map_err(|_| TokenError::Malformed)?;
        Ok(TokenClaims {
            id: hex::encode(id),
            expires_at: i64::from_be_bytes(expiry.try_into().map_err(|_| TokenError::Malformed)?),
            route: (!route.is_empty()).then_some(route),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_verify_only_for_their_client_and_unaltered() {
        let (keys, _) = TokenKeys::new("secret");
        let (token, claims) = keys.issue(Some("create-order"), "alice", 2_000_000_000);
        assert_eq!(keys.verify(&token, "alice").unwrap(), claims);
        assert_eq!(keys.verify(&token, "bob"), Err(TokenError::BadSignature));
        let (other_keys, _) = TokenKeys::new("another secret");
        assert_eq!(
            other_keys.verify(&token, "alice"),
            Err(TokenError::BadSignature)
        );
        // Flip one payload character.
        let mut altered: Vec<char> = token.chars().collect();
        altered[5] = if altered[5] == 'A' { 'B' } else { 'A' };
        let altered: String = altered.into_iter().collect();
        assert!(keys.verify(&altered, "alice").is_err());
        assert_eq!(
            keys.verify(&token[..token.len() - 3], "alice"),
            Err(TokenError::BadSignature)
        );
        assert_eq!(keys.verify("v1.x", "alice"), Err(TokenError::Malformed));
        assert_eq!(keys.verify("", "alice"), Err(TokenError::Malformed));
        let (unbound, c) = keys.issue(None, "alice", 1);
        assert_eq!(keys.verify(&unbound, "alice").unwrap().route, None);
        assert_ne!(c.id, claims.id);
    }

    #[test]
    fn a_rotation_signs_with_the_first_secret_and_verifies_with_any() {
        let (old, _) = TokenKeys::new("old");
        let (rotated, _) = TokenKeys::rotating(&["new", "old"]);
        let (before, claims) = old.issue(None, "alice", 2_000_000_000);
        assert_eq!(rotated.verify(&before, "alice").unwrap(), claims);
        let (after, _) = rotated.issue(None, "alice", 2_000_000_000);
        assert_eq!(old.verify(&after, "alice"), Err(TokenError::BadSignature));
        let (retired, _) = TokenKeys::rotating(&["new"]);
        assert_eq!(
            retired.verify(&before, "alice"),
            Err(TokenError::BadSignature)
        );
        assert!(retired.verify(&after, "alice").is_ok());
    }
}
