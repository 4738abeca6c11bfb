//! Webhook signature verification, before anything is stored.
//!
//! A bad signature is 401 and leaves no record, so forged ids can never
//! poison the dedupe table. Three schemes:
//! - `standard-webhooks`: `webhook-id`, `webhook-timestamp`,
//!   `webhook-signature: v1,<base64>` (space-separated list), HMAC-SHA256
//!   over `{id}.{timestamp}.{body}`; secrets `whsec_<base64>`.
//! - `stripe`: `Stripe-Signature: t=<unix>,v1=<hex>[,v1=…]`, HMAC-SHA256
//!   over `{t}.{body}`.
//! - `hmac-sha256`: hex HMAC-SHA256 of the raw body (optionally `sha256=`
//!   prefixed) in the configured header.
//!
//! Several secrets are tried (rotation); every comparison is constant time
//! (`Mac::verify_slice`); timestamped schemes refuse a timestamp further
//! than `tolerance` from now, in either direction (replayed captures).

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use hmac::{Hmac, Mac};
use http::{HeaderMap, HeaderName};
use sha2::Sha256;

/// `signature.scheme`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SignatureScheme {
    /// `webhook-id`, `webhook-timestamp`, `webhook-signature: v1,<base64>`.
    StandardWebhooks,
    /// `Stripe-Signature: t=…,v1=<hex>`.
    Stripe,
    /// Hex HMAC-SHA256 of the raw body in `header`.
    HmacSha256,
}

impl SignatureScheme {
    /// Whether the scheme signs a timestamp (and a tolerance applies).
    pub fn is_timestamped(self) -> bool {
        !matches!(self, SignatureScheme::HmacSha256)
    }
}

impl std::fmt::Display for SignatureScheme {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SignatureScheme::StandardWebhooks => "standard-webhooks",
            SignatureScheme::Stripe => "stripe",
            SignatureScheme::HmacSha256 => "hmac-sha256",
        })
    }
}

/// What a verifier is made from: a validated `[routes.signature]`.
#[derive(Debug, Clone, Copy)]
pub struct SignatureSpec<'a> {
    /// How the deliveries are signed.
    pub scheme: SignatureScheme,
    /// Secrets tried in turn (rotation).
    pub secrets: &'a [String],
    /// An environment variable with more secrets, comma-separated.
    pub secrets_env: Option<&'a str>,
    /// `hmac-sha256`: the header carrying the hex signature.
    pub header: Option<&'a str>,
    /// Timestamped schemes: how far the timestamp may be from now.
    pub tolerance: Duration,
}

/// Why a signature was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    /// A header the scheme needs is absent.
    #[error("the {0} header is missing")]
    Missing(&'static str),
    /// The signature header cannot be read.
    #[error("the signature header is malformed")]
    Malformed,
    /// The signed timestamp is too far from now (a replayed delivery).
    #[error("the signature timestamp is outside the {0:?} tolerance")]
    Stale(Duration),
    /// No configured secret produces this signature.
    #[error("no signature matches any configured secret")]
    NoMatch,
}

/// A route's signature check.
pub struct Verifier {
    scheme: SignatureScheme,
    keys: Vec<Vec<u8>>,
    header: Option<HeaderName>,
    tolerance: Duration,
}

const WEBHOOK_ID: &str = "webhook-id";
const WEBHOOK_TIMESTAMP: &str = "webhook-timestamp";
const WEBHOOK_SIGNATURE: &str = "webhook-signature";
const STRIPE_SIGNATURE: &str = "stripe-signature";

impl Verifier {
    /// Builds the verifier; `env` resolves `secrets_env`.
    pub fn new(
        config: SignatureSpec<'_>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Verifier, String> {
        let mut secrets = config.secrets.to_vec();
        if let Some(name) = config.secrets_env {
            let value = env(name).filter(|v| !v.trim().is_empty()).ok_or_else(|| {
                format!("signature.secrets_env: environment variable {name} is not set")
            })?;
            secrets.extend(
                value
                    .split(',')
                    .map(|s| s.trim().to_owned())
                    .filter(|s| !s.is_empty()),
            );
        }
        if secrets.is_empty() {
            return Err("signature: no secrets (set secrets or secrets_env)".into());
        }
        let keys = secrets
            .iter()
            .map(|s| match (config.scheme, s.strip_prefix("whsec_")) {
                (SignatureScheme::StandardWebhooks, Some(encoded)) => {
                    B64.decode(encoded).map_err(|_| {
                        "signature.secrets: a whsec_ secret must be base64 after the prefix"
                            .to_owned()
                    })
                }
                _ => Ok(s.as_bytes().to_vec()),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let header = match (config.scheme, config.header) {
            (SignatureScheme::HmacSha256, Some(h)) => Some(
                h.parse()
                    .map_err(|_| format!("signature.header: {h:?} is not a header name"))?,
            ),
            (SignatureScheme::HmacSha256, None) => {
                return Err("signature.header is required with scheme = \"hmac-sha256\"".into());
            }
            _ => None,
        };
        Ok(Verifier {
            scheme: config.scheme,
            keys,
            header,
            tolerance: config.tolerance,
        })
    }

    /// Checks the request's signature at `now` (unix seconds).
    pub fn verify(&self, headers: &HeaderMap, body: &[u8], now: i64) -> Result<(), SignatureError> {
        match self.scheme {
            SignatureScheme::StandardWebhooks => {
                let id = text(headers, WEBHOOK_ID)?;
                let timestamp = text(headers, WEBHOOK_TIMESTAMP)?;
                self.fresh(timestamp, now)?;
                let signatures: Vec<Vec<u8>> = text(headers, WEBHOOK_SIGNATURE)?
                    .split(' ')
                    .filter_map(|s| s.strip_prefix("v1,"))
                    .filter_map(|s| B64.decode(s).ok())
                    .collect();
                let signed = [id.as_bytes(), b".", timestamp.as_bytes(), b".", body];
                self.matches(&signatures, &signed)?;
            }
            SignatureScheme::Stripe => {
                let header = text(headers, STRIPE_SIGNATURE)?;
                let mut timestamp = None;
                let mut signatures = Vec::new();
                for item in header.split(',') {
                    match item.trim().split_once('=') {
                        Some(("t", t)) => timestamp = Some(t),
                        Some(("v1", s)) => signatures.extend(hex::decode(s).ok()),
                        _ => {}
                    }
                }
                let timestamp = timestamp.ok_or(SignatureError::Malformed)?;
                self.fresh(timestamp, now)?;
                self.matches(&signatures, &[timestamp.as_bytes(), b".", body])?;
            }
            SignatureScheme::HmacSha256 => {
                let name = self.header.as_ref().ok_or(SignatureError::Malformed)?;
                let value = headers
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .ok_or(SignatureError::Missing("signature"))?;
                let hex_digest = value.strip_prefix("sha256=").unwrap_or(value);
                let signature =
                    hex::decode(hex_digest.trim()).map_err(|_| SignatureError::Malformed)?;
                self.matches(&[signature], &[body])?;
            }
        }
        Ok(())
    }

    fn fresh(&self, timestamp: &str, now: i64) -> Result<(), SignatureError> {
        let t: i64 = timestamp
            .trim()
            .parse()
            .map_err(|_| SignatureError::Malformed)?;
        if (now - t).unsigned_abs() > self.tolerance.as_secs() {
            return Err(SignatureError::Stale(self.tolerance));
        }
        Ok(())
    }

    fn matches(&self, signatures: &[Vec<u8>], signed: &[&[u8]]) -> Result<(), SignatureError> {
        if signatures.is_empty() {
            return Err(SignatureError::Malformed);
        }
        for key in &self.keys {
            let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes any key length");
            for part in signed {
                mac.update(part);
            }
            for signature in signatures {
                if mac.clone().verify_slice(signature).is_ok() {
                    return Ok(());
                }
            }
        }
        Err(SignatureError::NoMatch)
    }
}

fn text<'a>(headers: &'a HeaderMap, name: &'static str) -> Result<&'a str, SignatureError> {
    headers
        .get(name)
        .ok_or(SignatureError::Missing(name))?
        .to_str()
        .map_err(|_| SignatureError::Malformed)
}

/// Signs like a provider would (for tests, demos and load generators).
pub fn sign_hex(secret: &[u8], parts: &[&[u8]]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    for part in parts {
        mac.update(part);
    }
    hex::encode(mac.finalize().into_bytes())
}

/// Standard Webhooks signature for `id`, `timestamp`, `body`.
pub fn sign_standard(secret: &[u8], id: &str, timestamp: i64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body);
    format!("v1,{}", B64.encode(mac.finalize().into_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Owned {
        scheme: SignatureScheme,
        secrets: Vec<String>,
        env: Option<String>,
    }

    impl Owned {
        fn spec(&self) -> SignatureSpec<'_> {
            SignatureSpec {
                scheme: self.scheme,
                secrets: &self.secrets,
                secrets_env: self.env.as_deref(),
                header: Some("x-sig"),
                tolerance: Duration::from_secs(300),
            }
        }
    }

    fn config(scheme: SignatureScheme, secrets: &[&str], env: Option<&str>) -> Owned {
        Owned {
            scheme,
            secrets: secrets.iter().map(|s| s.to_string()).collect(),
            env: env.map(str::to_owned),
        }
    }

    #[test]
    fn secrets_come_from_config_and_environment() {
        let cfg = config(SignatureScheme::HmacSha256, &["a"], Some("HOOK_SECRETS"));
        let v = Verifier::new(cfg.spec(), |name| {
            (name == "HOOK_SECRETS").then(|| "b, c".into())
        })
        .unwrap();
        assert_eq!(v.keys, vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]);
        let missing = Verifier::new(cfg.spec(), |_| None).err().unwrap();
        assert!(missing.contains("HOOK_SECRETS"), "{missing}");
        let none = config(SignatureScheme::Stripe, &[], None);
        assert!(Verifier::new(none.spec(), |_| None).is_err());
    }

    #[test]
    fn timestamps_are_checked_both_ways() {
        let stripe = config(SignatureScheme::Stripe, &["k"], None);
        let v = Verifier::new(stripe.spec(), |_| None).unwrap();
        let body = b"{}";
        let sign = |t: i64| {
            let mut h = HeaderMap::new();
            let sig = sign_hex(b"k", &[t.to_string().as_bytes(), b".", body]);
            h.insert(
                "stripe-signature",
                format!("t={t},v1={sig}").parse().unwrap(),
            );
            h
        };
        assert_eq!(v.verify(&sign(1_000), body, 1_000), Ok(()));
        assert_eq!(v.verify(&sign(1_000), body, 1_300), Ok(()));
        assert!(matches!(
            v.verify(&sign(1_000), body, 1_301),
            Err(SignatureError::Stale(_))
        ));
        assert!(matches!(
            v.verify(&sign(2_000), body, 1_000),
            Err(SignatureError::Stale(_))
        ));
    }
}
