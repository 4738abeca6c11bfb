//! `[identity]` and `[identity.jwt]`: who a client is — the schema, the
//! defaults, the checks each key needs on its own, and the
//! [`Identity`](idemgate_core::identity::Identity) built from them (the
//! JWKS file read, the secret taken from the environment), once, while
//! the plan is loaded.

use serde::Deserialize;

use super::HumanDuration;

const DEFAULT_IDENTITY_HEADER: &str = "Authorization";
const DEFAULT_JWT_CLAIM: &str = "sub";
const DEFAULT_JWT_LEEWAY: &str = "60s";

/// `[identity]`: who a client is (see [`idemgate_core::identity`]).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentityConfig {
    /// The header that identifies a client (hashed); with `[identity.jwt]`
    /// the header carrying `Bearer <jwt>`.
    #[serde(default = "default_identity_header")]
    pub header: String,
    /// `[identity.jwt]`: scope by a verified claim instead.
    #[serde(default)]
    pub jwt: Option<JwtConfig>,
}

/// `[identity.jwt]`: the principal is a verified JWT's claim.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JwtConfig {
    /// The claim naming the principal.
    #[serde(default = "default_jwt_claim")]
    pub claim: String,
    /// HS256: the shared secret (at least 32 bytes)…
    pub hs256_secret: Option<String>,
    /// …or the environment variable holding it.
    pub hs256_secret_env: Option<String>,
    /// RS256/ES256: a JWKS file (`{"keys": […]}`), read at start-up.
    pub jwks_file: Option<String>,
    /// The one accepted `iss` (a one-element `issuers`).
    pub issuer: Option<String>,
    /// The accepted `iss` values (empty, with no `issuer`: any). The
    /// token's own `iss` is part of the principal either way: the same
    /// claim from two issuers is two clients.
    #[serde(default)]
    pub issuers: Vec<String>,
    /// Required `aud`.
    pub audience: Option<String>,
    /// Clock skew allowed on `exp` and `nbf`.
    #[serde(default = "default_jwt_leeway")]
    pub leeway: HumanDuration,
}

impl Default for IdentityConfig {
    fn default() -> Self {
        IdentityConfig {
            header: default_identity_header(),
            jwt: None,
        }
    }
}

fn default_identity_header() -> String {
    DEFAULT_IDENTITY_HEADER.into()
}
fn default_jwt_claim() -> String {
    DEFAULT_JWT_CLAIM.into()
}
fn default_jwt_leeway() -> HumanDuration {
    DEFAULT_JWT_LEEWAY.into()
}

impl IdentityConfig {
    /// Who a client is, keys loaded (the JWKS file read, the secret taken
    /// from the environment); why not, naming the key.
    pub fn identity(&self) -> Result<idemgate_core::identity::Identity, (String, String)> {
        let header: http::HeaderName = self.header.parse().map_err(|_| {
            (
                "identity.header".to_owned(),
                format!("{:?} is not a header name", self.header),
            )
        })?;
        let Some(jwt) = &self.jwt else {
            return Ok(idemgate_core::identity::Identity::header(header));
        };
        let fail = |key: &str, reason: String| (format!("identity.jwt.{key}"), reason);
        let keys = jwt.keys().map_err(|(key, reason)| fail(key, reason))?;
        let key = match &keys {
            idemgate_core::identity::JwtKeys::Hs256(_) if jwt.hs256_secret_env.is_some() => {
                "hs256_secret_env"
            }
            idemgate_core::identity::JwtKeys::Hs256(_) => "hs256_secret",
            idemgate_core::identity::JwtKeys::Jwks(_) => "jwks_file",
        };
        let settings = idemgate_core::identity::JwtSettings {
            header,
            claim: jwt.claim.clone(),
            keys,
            issuers: jwt.issuer_list(),
            audience: jwt.audience.clone(),
            leeway: jwt.leeway.get(),
        };
        idemgate_core::identity::JwtIdentity::new(&settings)
            .map(|verifier| idemgate_core::identity::Identity::Jwt(std::sync::Arc::new(verifier)))
            .map_err(|reason| fail(key, reason))
    }

    /// Checks each key of `[identity]` on its own (what needs the keys
    /// loaded is judged by [`Self::identity`]).
    pub(super) fn check(&self, add: &mut dyn FnMut(String, String)) {
        let Some(jwt) = &self.jwt else { return };
        if let Some(reason) = jwt.leeway.problem_unless_zero() {
            add("identity.jwt.leeway".into(), reason);
        }
        if jwt.issuer.is_some() && !jwt.issuers.is_empty() {
            add(
                "identity.jwt.issuers".into(),
                "set identity.jwt.issuer or identity.jwt.issuers, not both".into(),
            );
        }
        if jwt.issuer_list().iter().any(|i| i.trim().is_empty()) {
            add(
                "identity.jwt.issuers".into(),
                "an issuer must not be empty".into(),
            );
        }
    }
}

impl JwtConfig {
    /// The accepted issuers: `issuers`, or `issuer` alone.
    pub fn issuer_list(&self) -> Vec<String> {
        match &self.issuer {
            Some(one) if self.issuers.is_empty() => vec![one.clone()],
            _ => self.issuers.clone(),
        }
    }

    /// The verification keys, from exactly one of `hs256_secret`,
    /// `hs256_secret_env` or `jwks_file`; why not, naming the key under
    /// `identity.jwt`.
    fn keys(&self) -> Result<idemgate_core::identity::JwtKeys, (&'static str, String)> {
        match (&self.hs256_secret, &self.hs256_secret_env, &self.jwks_file) {
            (Some(secret), None, None) => Ok(idemgate_core::identity::JwtKeys::Hs256(
                secret.as_bytes().to_vec(),
            )),
            (None, Some(var), None) => match super::secrets::from_env(std::env::var(var).ok()) {
                Some(secret) => Ok(idemgate_core::identity::JwtKeys::Hs256(secret.into_bytes())),
                None => Err((
                    "hs256_secret_env",
                    format!("the environment variable {var:?} is not set (or blank)"),
                )),
            },
            (None, None, Some(path)) => match std::fs::read_to_string(path) {
                Ok(text) => Ok(idemgate_core::identity::JwtKeys::Jwks(text)),
                Err(e) => Err(("jwks_file", format!("{path:?}: {e}"))),
            },
            _ => Err((
                "hs256_secret",
                "set exactly one of hs256_secret, hs256_secret_env or jwks_file".into(),
            )),
        }
    }
}
