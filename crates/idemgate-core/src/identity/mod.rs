//! Client identity: which scope a request's records live in (docs/semantics.md,
//! rules 4 and 9).
//!
//! A scope names a principal, never the bytes of a credential. Two sources:
//!
//! - a header ([`Identity::Header`]), hashed. The principal header an auth
//!   proxy sets in front (`X-User-Id`, oauth2-proxy's
//!   `X-Auth-Request-User`, Envoy's `ext_authz` headers) is the trusted
//!   case. A raw credential works too, canonicalised so that the same
//!   credential always hashes alike: an `Authorization` scheme is
//!   case-insensitive (RFC 9110 §11.1: `bearer x` is `Bearer x`), and a
//!   `Cookie` is every crumb in order, however the client split them
//!   (HTTP/2 crumbs, several HTTP/1.1 lines: RFC 9113 §8.2.3). Any other
//!   header sent more than once is refused (`400`): which value would be
//!   the principal is ambiguous, and scoping by the first alone let one
//!   user read another's answers.
//! - a verified JWT claim ([`Identity::Jwt`], `[identity.jwt]`): the token
//!   from `Authorization: Bearer …`, its signature checked (HS256 with a
//!   secret, RS256/ES256 with a JWKS file), `exp`/`nbf` and optionally
//!   `iss`/`aud`; the scope is a hash of the issuer and the claim (`sub`
//!   by default). A refreshed token keeps its principal and so its scope;
//!   an invalid token is `401`, never a fresh scope.
//!
//! A request without the header is in the anonymous scope. The raw value
//! is never stored or logged, only its hash.

#[cfg(feature = "jwt")]
mod jwt;

#[cfg(feature = "jwt")]
pub use jwt::{JwtIdentity, JwtKeys, JwtSettings};

use http::{HeaderMap, HeaderName};
use sha2::{Digest, Sha256};

use crate::error::{Problem, Reason};

/// The scope of requests without the identity header.
pub const ANONYMOUS_SCOPE: &str = "anonymous";

/// Where a request's principal comes from.
#[derive(Clone)]
pub enum Identity {
    /// A header's value, canonicalised and hashed.
    Header(HeaderName),
    /// A verified JWT's claim.
    #[cfg(feature = "jwt")]
    Jwt(std::sync::Arc<JwtIdentity>),
}

/// Why a request's principal could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// The identity header came more than once (and is not `Cookie`).
    #[error("the identity header {0} was sent more than once")]
    Repeated(String),
    /// The header is not valid text.
    #[error("the identity header {0} is not visible ASCII")]
    Unreadable(String),
    /// The JWT is missing its scheme, malformed, forged, expired or lacks
    /// the claim.
    #[error("the bearer token is not valid: {0}")]
    InvalidToken(String),
}

impl Identity {
    /// The identity of `header` (the default: `Authorization`).
    pub fn header(name: HeaderName) -> Self {
        Identity::Header(name)
    }

    /// The scope of a request.
    pub fn scope(&self, headers: &HeaderMap) -> Result<String, IdentityError> {
        match self {
            Identity::Header(name) => match canonical(headers, name)? {
                None => Ok(ANONYMOUS_SCOPE.to_owned()),
                Some(value) => Ok(hashed(IDENTITY_CONTEXT, &[value.as_bytes()])),
            },
            #[cfg(feature = "jwt")]
            Identity::Jwt(jwt) => jwt.scope(headers),
        }
    }

    /// The scope an operator names (`keys show --client`, `?client=`):
    /// the identity header's value as the client sends it, or with a JWT
    /// identity the principal itself (the claim's value).
    pub fn scope_for_operator(&self, given: &str) -> String {
        match self {
            Identity::Header(name) => {
                let mut headers = HeaderMap::new();
                match http::HeaderValue::from_str(given) {
                    Ok(value) => {
                        headers.insert(name.clone(), value);
                        self.scope(&headers)
                            .unwrap_or_else(|_| hashed(IDENTITY_CONTEXT, &[given.as_bytes()]))
                    }
                    Err(_) => hashed(IDENTITY_CONTEXT, &[given.as_bytes()]),
                }
            }
            #[cfg(feature = "jwt")]
            Identity::Jwt(jwt) => jwt.scope_of_principal(given),
        }
    }

    /// What makes a scope, as text (`header:x-user-id`, `jwt:sub`): the
    /// records a client-scoped route keeps are found only while this stays
    /// the same (the gateway refuses a change while such records are live).
    pub fn describe(&self) -> String {
        match self {
            Identity::Header(name) => format!("header:{name}"),
            #[cfg(feature = "jwt")]
            Identity::Jwt(jwt) => format!("jwt:{}", jwt.claim()),
        }
    }

    /// What `check-config` says about this source: `Some(advice)` when it
    /// is a credential that rotates (raw `Authorization`, `Cookie`).
    pub fn rotating_credential(&self) -> Option<&'static str> {
        match self {
            Identity::Header(name) if name == http::header::AUTHORIZATION => Some(
                "a raw Authorization credential: a refreshed token is a new client (a second \
                 execution under a new forwarded key); set identity.header to the principal \
                 header your auth proxy sets (e.g. \"X-User-Id\"), or [identity.jwt] to scope by \
                 a verified claim",
            ),
            Identity::Header(name) if name == http::header::COOKIE => Some(
                "the whole Cookie header: a refreshed session (or any cookie the browser adds) is \
                 a new client; set identity.header to the principal header your auth proxy sets \
                 (e.g. \"X-User-Id\")",
            ),
            _ => None,
        }
    }
}

/// Hash context of header identities (the same since the first release, so
/// that scopes of canonical values did not change with canonicalisation).
const IDENTITY_CONTEXT: &[u8] = b"idemgate/identity/v1\0";

/// A scope: a domain-separated hash of `parts`.
pub(crate) fn hashed(context: &[u8], parts: &[&[u8]]) -> String {
    let mut hash = Sha256::new();
    hash.update(context);
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            hash.update((part.len() as u64).to_be_bytes());
        }
        hash.update(part);
    }
    // 128 bits: collisions are out of reach, and the column stays short.
    format!("c_{}", hex::encode(&hash.finalize()[..16]))
}

/// The identity header's value as the scope hashes it; `None` when absent.
fn canonical(headers: &HeaderMap, name: &HeaderName) -> Result<Option<String>, IdentityError> {
    let mut values = headers.get_all(name).iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    let text = |v: &http::HeaderValue| {
        v.to_str()
            .map(str::to_owned)
            .map_err(|_| IdentityError::Unreadable(name.to_string()))
    };
    if name == http::header::COOKIE {
        // Every crumb, in order, as one `a=1; b=2` line (RFC 9113 §8.2.3):
        // split lines and HTTP/2 crumbs give the same scope as one line.
        let mut crumbs = Vec::new();
        for value in std::iter::once(first).chain(values) {
            for crumb in text(value)?.split(';') {
                let crumb = crumb.trim();
                if !crumb.is_empty() {
                    crumbs.push(crumb.to_owned());
                }
            }
        }
        return Ok(Some(crumbs.join("; ")));
    }
    if values.next().is_some() {
        return Err(IdentityError::Repeated(name.to_string()));
    }
    let value = text(first)?;
    if name == http::header::AUTHORIZATION {
        return Ok(Some(canonical_credentials(&value)));
    }
    Ok(Some(value))
}

/// `Authorization`: the scheme case-insensitive (written the way most
/// clients write it, `Bearer`, `Basic`), one space before the credentials.
fn canonical_credentials(value: &str) -> String {
    let value = value.trim();
    match value.split_once(' ') {
        Some((scheme, rest)) => {
            let mut chars = scheme.chars();
            let scheme: String = chars
                .next()
                .map(|c| c.to_ascii_uppercase())
                .into_iter()
                .chain(chars.map(|c| c.to_ascii_lowercase()))
                .collect();
            format!("{scheme} {}", rest.trim_start())
        }
        None => value.to_owned(),
    }
}

/// Its answer to the client: the one problem type every module maps to.
impl From<&IdentityError> for Problem {
    fn from(e: &IdentityError) -> Self {
        match e {
            IdentityError::Repeated(_) | IdentityError::Unreadable(_) => {
                Problem::new(Reason::IdentityAmbiguous).detail(format!("{e}; send it once"))
            }
            IdentityError::InvalidToken(_) => Problem::new(Reason::IdentityInvalid)
                .detail("send a valid, unexpired token; nothing was stored or forwarded")
                .www_authenticate("Bearer error=\"invalid_token\""),
        }
        .logged("identity", e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(pairs: &[(&str, &str)], identity: &Identity) -> Result<String, IdentityError> {
        let mut headers = HeaderMap::new();
        for (k, v) in pairs {
            headers.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        identity.scope(&headers)
    }

    #[test]
    fn scopes_differ_per_identity_and_hide_it() {
        let auth = Identity::header(http::header::AUTHORIZATION);
        let a = scope(&[("authorization", "Bearer alice")], &auth).unwrap();
        let b = scope(&[("authorization", "Bearer bob")], &auth).unwrap();
        assert_ne!(a, b);
        assert_ne!(a, ANONYMOUS_SCOPE);
        assert!(!a.contains("alice"));
        assert_eq!(scope(&[], &auth).unwrap(), ANONYMOUS_SCOPE);
    }

    #[test]
    fn an_authorization_scheme_is_case_insensitive() {
        let auth = Identity::header(http::header::AUTHORIZATION);
        let canonical = scope(&[("authorization", "Bearer tok")], &auth).unwrap();
        for variant in ["bearer tok", "BEARER tok", "Bearer  tok", " Bearer tok"] {
            assert_eq!(
                scope(&[("authorization", variant)], &auth).unwrap(),
                canonical,
                "{variant}"
            );
        }
        assert_ne!(
            scope(&[("authorization", "Bearer TOK")], &auth).unwrap(),
            canonical
        );
        // A canonical credential hashes as it always did.
        assert_eq!(canonical, hashed(IDENTITY_CONTEXT, &[b"Bearer tok"]));
    }

    #[test]
    fn every_cookie_crumb_counts_however_it_was_split() {
        let cookie = Identity::header(http::header::COOKIE);
        let line = scope(&[("cookie", "consent=yes; session=A")], &cookie).unwrap();
        let crumbs = scope(
            &[("cookie", "consent=yes"), ("cookie", "session=A")],
            &cookie,
        )
        .unwrap();
        assert_eq!(line, crumbs);
        let other = scope(
            &[("cookie", "consent=yes"), ("cookie", "session=B")],
            &cookie,
        )
        .unwrap();
        assert_ne!(crumbs, other, "scoped by the first crumb alone");
    }

    #[test]
    fn another_header_sent_twice_is_refused() {
        let user = Identity::header(HeaderName::from_static("x-user-id"));
        assert_eq!(
            scope(&[("x-user-id", "alice"), ("x-user-id", "bob")], &user),
            Err(IdentityError::Repeated("x-user-id".into()))
        );
        let auth = Identity::header(http::header::AUTHORIZATION);
        assert!(
            scope(
                &[("authorization", "Bearer a"), ("authorization", "Bearer b")],
                &auth
            )
            .is_err()
        );
    }
}
