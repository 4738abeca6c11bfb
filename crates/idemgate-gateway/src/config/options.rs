//! What each lower module is built from: the config turns its sections
//! into the options types those modules own (`store::StoreOptions`,
//! `proxy::UpstreamSpec`, `callback::SignatureSpec`, the route matcher, the
//! metrics series), so that no module below the gateway reads the config.

use super::*;

impl Config {
    /// A metrics registry with a series for each route, upstream and
    /// consumer of this file.
    pub fn metrics(&self) -> idemgate_core::metrics::Metrics {
        idemgate_core::metrics::Metrics::new(
            self.routes.iter().map(|r| r.name.as_str()),
            self.upstreams.iter().map(|u| u.name.as_str()),
            self.consumers.iter().map(|c| c.name.as_str()),
        )
    }
}

impl StoreConfig {
    /// What the store is opened from.
    pub fn options(&self) -> idemgate_store::StoreOptions {
        idemgate_store::StoreOptions {
            database_url: self.database_url.clone(),
            schema: None,
            redis_url: self.redis_url.clone(),
            redis_prefix: self.redis_prefix.clone(),
            pool_size: self.pool_size,
            timeout: self.timeout.get(),
            lease: self.lease.get(),
            retention: self.retention.get(),
            tombstone: self.tombstone.get(),
            fast_layer_budget: self.fast_layer_budget.get(),
            memory_layer_bytes: self.memory_layer_bytes,
            sweep_interval: self.sweep_interval.get(),
            in_memory_for_tests: false,
        }
    }
}

impl ServerConfig {
    /// The CORS policy of `[server.cors]` (`None`: off, or no origin).
    pub fn cors_policy(&self) -> Result<Option<crate::router::CorsPolicy>, String> {
        match &self.cors {
            Some(c) if !c.allow_origins.is_empty() => crate::router::CorsPolicy::new(
                &c.allow_origins,
                &c.allow_headers,
                c.allow_credentials,
                c.max_age.get(),
            )
            .map(Some),
            _ => Ok(None),
        }
    }
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
        let keys = match (&jwt.hs256_secret, &jwt.hs256_secret_env, &jwt.jwks_file) {
            (Some(secret), None, None) => {
                idemgate_core::identity::JwtKeys::Hs256(secret.as_bytes().to_vec())
            }
            (None, Some(var), None) => match super::secrets::from_env(std::env::var(var).ok()) {
                Some(secret) => idemgate_core::identity::JwtKeys::Hs256(secret.into_bytes()),
                None => {
                    return Err(fail(
                        "hs256_secret_env",
                        format!("the environment variable {var:?} is not set (or blank)"),
                    ));
                }
            },
            (None, None, Some(path)) => match std::fs::read_to_string(path) {
                Ok(text) => idemgate_core::identity::JwtKeys::Jwks(text),
                Err(e) => return Err(fail("jwks_file", format!("{path:?}: {e}"))),
            },
            _ => {
                return Err(fail(
                    "hs256_secret",
                    "set exactly one of hs256_secret, hs256_secret_env or jwks_file".into(),
                ));
            }
        };
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
}

impl SignatureConfig {
    /// What the callback layer builds its verifier from.
    pub fn spec(&self) -> idemgate::callback::SignatureSpec<'_> {
        idemgate::callback::SignatureSpec {
            scheme: self.scheme,
            secrets: &self.secrets,
            secrets_env: self.secrets_env.as_deref(),
            header: self.header.as_deref(),
            tolerance: self.tolerance.get(),
        }
    }
}

impl UpstreamConfig {
    /// What the proxy builds this upstream from.
    pub fn spec(&self) -> idemgate_proxy::UpstreamSpec<'_> {
        idemgate_proxy::UpstreamSpec {
            name: &self.name,
            url: &self.url,
            timeout: self.timeout.get(),
            ca_file: self.ca_file.as_deref(),
            client_cert: self.client_cert.as_deref(),
            client_key: self.client_key.as_deref(),
            http2: self.http2,
            max_connections: self.max_connections,
        }
    }
}

// === impl RouteConfig (matcher) ===

impl RouteConfig {
    /// The route's matcher, or why its paths are wrong.
    pub fn matcher(&self) -> Result<RouteMatcher, String> {
        RouteMatcher::new(
            &self.methods,
            self.path.as_deref(),
            self.path_prefix.as_deref(),
        )
    }
}
