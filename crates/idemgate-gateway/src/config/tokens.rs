//! `[tokens]`: the one-time tokens `/token` issues — the schema, the
//! default lifetime (the library's), the secrets in rotation order, and
//! the checks each key needs on its own. The retention a token needs is
//! compared with `tokens.ttl` in `validate.rs`.

use serde::Deserialize;

use super::HumanDuration;

/// `[tokens]`: one-time tokens issued by `/token`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenConfig {
    /// Lifetime of a token (default 10 min).
    #[serde(default = "default_token_ttl")]
    pub ttl: HumanDuration,
    /// The HMAC secret (a one-element `secrets`).
    #[serde(default)]
    pub secret: String,
    /// Rotation: sign with the first, verify with any.
    #[serde(default)]
    pub secrets: Vec<String>,
    /// Tokens one principal may be issued per minute (0: no limit); past
    /// it `429` with `Retry-After`.
    #[serde(default)]
    pub issue_per_minute: u32,
}

impl Default for TokenConfig {
    fn default() -> Self {
        TokenConfig {
            ttl: default_token_ttl(),
            secret: String::new(),
            secrets: Vec::new(),
            issue_per_minute: 0,
        }
    }
}

fn default_token_ttl() -> HumanDuration {
    idemgate::DEFAULT_TOKEN_TTL.into()
}

impl TokenConfig {
    /// The token secrets, newest first: `secrets`, or `secret` alone.
    pub fn secret_list(&self) -> Vec<&str> {
        if self.secrets.is_empty() {
            vec![self.secret.as_str()]
        } else {
            self.secrets.iter().map(String::as_str).collect()
        }
    }

    /// Checks each key of `[tokens]` on its own (its secrets trimmed).
    pub(super) fn check(&self, add: &mut dyn FnMut(String, String)) {
        // A zero lifetime would issue tokens already expired.
        if let Some(reason) = self.ttl.problem() {
            add("tokens.ttl".into(), reason);
        }
        if !self.secret.is_empty() && !self.secrets.is_empty() {
            add(
                "tokens.secrets".into(),
                "set tokens.secret or tokens.secrets, not both (IDEMGATE_TOKEN_SECRET sets \
                 tokens.secret): secrets = [\"new\", \"old\"] signs with the first and verifies \
                 with any"
                    .into(),
            );
        }
        if self.secrets.iter().any(String::is_empty) {
            add(
                "tokens.secrets".into(),
                "a secret must not be empty (or blank)".into(),
            );
        }
    }
}
