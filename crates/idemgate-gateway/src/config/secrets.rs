//! Secrets in the configuration: the admin token, the token secrets, the
//! JWT secret, the callback signature secrets, and the passwords in store
//! and broker URLs.
//!
//! Two rules live here. A secret is trimmed before any check reads it, and
//! one that is blank after trimming is absent: a template that rendered
//! `" "` or an environment variable that ends in a newline must not pass
//! "a public admin listener needs a token" and then count as no token.
//! And nothing derived from a secret is published: the configuration's
//! fingerprint (`idemgate_config_info`, the reload log) is taken over the
//! configuration with every secret left out, so a short admin token cannot
//! be guessed offline from `/metrics`.

use sha2::Digest;

use super::Config;
use idemgate_core::error::redact_url as redact;

/// What a secret left out reads as.
const LEFT_OUT: &str = "<secret>";

impl Config {
    /// This configuration with every secret trimmed (blank: absent).
    pub(super) fn with_secrets_trimmed(mut self) -> Config {
        trim(&mut self.server.admin_token);
        trim(&mut self.tokens.secret);
        // A blank entry of a list stays blank, for validation to refuse by
        // name: the operator wrote an entry and it holds nothing.
        for secret in &mut self.tokens.secrets {
            trim(secret);
        }
        if let Some(jwt) = &mut self.identity.jwt {
            jwt.hs256_secret = jwt
                .hs256_secret
                .take()
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty());
        }
        for route in &mut self.routes {
            if let Some(signature) = &mut route.signature {
                for secret in &mut signature.secrets {
                    trim(secret);
                }
            }
        }
        self
    }

    /// A short fingerprint of what runs, secrets left out: which
    /// configuration is in force (`idemgate_config_info`), safe to publish.
    pub fn fingerprint(&self) -> String {
        let text = format!("{:?}", self.without_secrets());
        hex::encode(&sha2::Sha256::digest(text.as_bytes())[..8])
    }

    /// A copy with every secret replaced (URL passwords redacted).
    fn without_secrets(&self) -> Config {
        let mut c = self.clone();
        let hide = |s: &mut String| {
            if !s.is_empty() {
                *s = LEFT_OUT.into();
            }
        };
        hide(&mut c.server.admin_token);
        hide(&mut c.tokens.secret);
        c.tokens.secrets.iter_mut().for_each(hide);
        if let Some(jwt) = &mut c.identity.jwt
            && let Some(secret) = &mut jwt.hs256_secret
        {
            hide(secret);
        }
        for route in &mut c.routes {
            if let Some(signature) = &mut route.signature {
                signature.secrets.iter_mut().for_each(hide);
            }
        }
        c.store.database_url = redact(&c.store.database_url);
        c.store.redis_url = redact(&c.store.redis_url);
        for consumer in &mut c.consumers {
            consumer.source = redact(&consumer.source);
        }
        c
    }
}

fn trim(secret: &mut String) {
    let trimmed = secret.trim();
    if trimmed.len() != secret.len() {
        *secret = trimmed.to_owned();
    }
}

/// A secret read from the environment, trimmed; `None` when unset or blank.
pub(super) fn from_env(value: Option<String>) -> Option<String> {
    value.map(|v| v.trim().to_owned()).filter(|v| !v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(text: &str) -> Config {
        Config::parse(text, "t").unwrap()
    }

    #[test]
    fn a_blank_or_padded_admin_token_is_judged_after_trimming() {
        let public = "[server]\nadmin_listen = \"0.0.0.0:9090\"\n";
        for blank in ["\" \"", "\"\\n\"", "\"\\t \\r\\n\""] {
            let text = format!("{public}admin_token = {blank}\n");
            let err = parsed(&text).validate("t").unwrap_err();
            assert!(
                err.problems().iter().any(|p| p.key == "server.admin_token"),
                "{blank}: {err}"
            );
        }
        // From the environment: a trailing newline is not part of it, and
        // a blank value is none.
        let mut c = parsed(public);
        c.apply_env(|name| (name == "IDEMGATE_ADMIN_TOKEN").then(|| " \n".to_owned()));
        assert!(c.validate("t").is_err());
        let mut c = parsed(public);
        c.apply_env(|name| (name == "IDEMGATE_ADMIN_TOKEN").then(|| "s3cret\n".to_owned()));
        let plan = c.validate("t").unwrap();
        let token = plan.admin_token.expect("a token");
        assert!(token.matches("s3cret"));
        assert!(!token.matches("s3cret\n"));
    }

    #[test]
    fn blank_secrets_are_absent_or_refused_by_name() {
        let text = r#"
            [tokens]
            secrets = ["new", " "]
        "#;
        let err = parsed(text).validate("t").unwrap_err();
        assert!(
            err.problems().iter().any(|p| p.key == "tokens.secrets"),
            "{err}"
        );
        let text = r#"
            [identity.jwt]
            hs256_secret = "   "
        "#;
        let err = parsed(text).validate("t").unwrap_err();
        assert!(
            err.problems()
                .iter()
                .any(|p| p.key.starts_with("identity.jwt.")),
            "{err}"
        );
    }

    #[test]
    fn the_fingerprint_leaves_every_secret_out() {
        let text = |token: &str, secret: &str, password: &str| {
            format!(
                r#"
                [server]
                admin_token = "{token}"
                [store]
                database_url = "postgres://u:{password}@db/x"
                [tokens]
                secret = "{secret}"
                "#
            )
        };
        let a = parsed(&text("adm-1x", "tok-1x", "pw-1x"));
        let b = parsed(&text("adm-2x", "tok-2x", "pw-2x"));
        assert_eq!(a.fingerprint(), b.fingerprint(), "secrets move nothing");
        let shown = format!("{:?}", a.without_secrets());
        for secret in ["adm-1x", "tok-1x", "pw-1x"] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        // Everything else does.
        let c = parsed(&text("adm-1x", "tok-1x", "pw-1x").replace("@db/", "@db2/"));
        assert_ne!(a.fingerprint(), c.fingerprint());
    }
}
