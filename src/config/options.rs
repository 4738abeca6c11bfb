//! What each lower module is built from: the config turns its sections
//! into the options types those modules own (`store::StoreOptions`,
//! `proxy::UpstreamSpec`, `callback::SignatureSpec`, the route matcher, the
//! metrics series), so that no module below the gateway reads the config.

use super::*;

impl Config {
    /// A metrics registry with a series for each route, upstream and
    /// consumer of this file.
    pub fn metrics(&self) -> crate::metrics::Metrics {
        crate::metrics::Metrics::new(
            self.routes.iter().map(|r| r.name.as_str()),
            self.upstreams.iter().map(|u| u.name.as_str()),
            self.consumers.iter().map(|c| c.name.as_str()),
        )
    }
}

impl StoreConfig {
    /// What the store is opened from.
    pub fn options(&self) -> crate::store::StoreOptions {
        crate::store::StoreOptions {
            database_url: self.database_url.clone(),
            redis_url: self.redis_url.clone(),
            redis_prefix: self.redis_prefix.clone(),
            pool_size: self.pool_size,
            timeout: self.timeout.get(),
            lease: self.lease.get(),
            retention: self.retention.get(),
            tombstone: self.tombstone.get(),
            fast_layer_budget: self.fast_layer_budget.get(),
        }
    }
}

impl SignatureConfig {
    /// What the callback layer builds its verifier from.
    pub fn spec(&self) -> crate::callback::SignatureSpec<'_> {
        crate::callback::SignatureSpec {
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
    pub fn spec(&self) -> crate::proxy::UpstreamSpec<'_> {
        crate::proxy::UpstreamSpec {
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
