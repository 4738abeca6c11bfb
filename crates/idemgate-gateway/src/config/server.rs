//! `[server]`: the listeners, connection hardening and the process-wide
//! budgets, with `[server.tls]` and `[server.cors]` — their schema,
//! defaults and the checks each key needs on its own. What compares a key
//! here with another (the admin listener with its token, the budgets with
//! the body limits) is in `validate.rs`.

use std::net::SocketAddr;

use serde::Deserialize;

use super::HumanDuration;

const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9090";
const DEFAULT_HEADER_READ_TIMEOUT: &str = "10s";
const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
const DEFAULT_SHUTDOWN_GRACE: &str = "30s";
const DEFAULT_HTTP2: bool = true;
/// `server.cors.max_age`: what Chromium caps a preflight cache at.
const DEFAULT_CORS_MAX_AGE: &str = "2h";

/// `[server]`: listeners and connection hardening.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// The public listener, `host:port` (default `127.0.0.1:8080`).
    #[serde(default = "default_listen")]
    pub listen: String,
    /// The admin listener: the dashboard, `/healthz`, `/readyz`,
    /// `/metrics`, `/admin/*` (default `127.0.0.1:9090`; not `listen`).
    #[serde(default = "default_admin_listen")]
    pub admin_listen: String,
    /// Larger request bodies are answered 413 and nothing is forwarded.
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: u64,
    /// A client must finish sending its request head within this time.
    #[serde(default = "default_header_read_timeout")]
    pub header_read_timeout: HumanDuration,
    /// A protected route must receive the whole request body within this
    /// (it is buffered to fingerprint it); slower clients get 408.
    #[serde(default = "default_body_read_timeout")]
    pub body_read_timeout: HumanDuration,
    /// Connections beyond this are answered `503 connections-exhausted`
    /// at once (while a reserve of refusals and the descriptors last;
    /// past them they wait in the kernel's accept queue). Split evenly
    /// across worker threads (each counts its own connections: a
    /// shared count could leave a connection waiting on one thread while
    /// another holds the last slot).
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Claims in flight at once across the process (0: twice the
    /// connections the descriptors allow); past it `503 claims-exhausted`.
    #[serde(default)]
    pub max_claims: usize,
    /// Bytes of request bodies buffered at once across the process (the
    /// protected routes read each whole); past it `503 buffers-exhausted`.
    #[serde(default = "default_max_buffered_bytes")]
    pub max_buffered_bytes: u64,
    /// Bytes of upstream answers held across the process until their
    /// record is written. Each claim reserves 64 KiB of it before it is
    /// made (full: `503 buffers-exhausted`); a larger answer waits at most
    /// a second for room, then is kept past it.
    #[serde(default = "default_max_captured_bytes")]
    pub max_captured_bytes: u64,
    /// Threads serving the public listener, each with its own event loop
    /// and upstream connection pool, all accepting from one shared socket;
    /// 0 = one per CPU.
    #[serde(default)]
    pub worker_threads: usize,
    /// How long in-flight requests may take to finish after SIGTERM.
    #[serde(default = "default_shutdown_grace")]
    pub shutdown_grace: HumanDuration,
    /// HTTP/2 beside HTTP/1.1 on the public listener: h2c with prior
    /// knowledge on a plain listener, ALPN `h2` with TLS.
    #[serde(default = "default_http2")]
    pub http2: bool,
    /// `[server.tls]`: terminate TLS on the public listener.
    #[serde(default)]
    pub tls: Option<ServerTlsConfig>,
    /// `[server.cors]`: browser clients on other origins.
    #[serde(default)]
    pub cors: Option<CorsConfig>,
    /// The bearer token `/admin/*` and the dashboard's actions require
    /// (`IDEMGATE_ADMIN_TOKEN` overrides it); empty: none, allowed only on
    /// a loopback `admin_listen`.
    #[serde(default)]
    pub admin_token: String,
    /// A file holding the admin token (its first line), instead of
    /// `admin_token`: kept out of the configuration file.
    #[serde(default)]
    pub admin_token_file: Option<String>,
}

/// `[server.cors]`: which other origins' scripts may call the gateway.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CorsConfig {
    /// `scheme://host[:port]` of each allowed origin (empty: CORS off).
    #[serde(default)]
    pub allow_origins: Vec<String>,
    /// Request headers allowed besides `Content-Type`, `Idempotency-Key`,
    /// `Idempotency-Token` and `X-Request-Id` (e.g. `Authorization`).
    #[serde(default)]
    pub allow_headers: Vec<String>,
    /// Let scripts send cookies and credentials (a cookie session).
    #[serde(default)]
    pub allow_credentials: bool,
    /// How long a browser may cache a preflight's answer.
    #[serde(default = "default_cors_max_age")]
    pub max_age: HumanDuration,
}

/// `[server.tls]`: the public listener's certificate chain and key (PEM).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerTlsConfig {
    /// Path of the PEM certificate chain, leaf first.
    pub cert: String,
    /// Path of the PEM private key.
    pub key: String,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: default_listen(),
            admin_listen: default_admin_listen(),
            max_body_bytes: default_max_body_bytes(),
            header_read_timeout: default_header_read_timeout(),
            body_read_timeout: default_body_read_timeout(),
            max_connections: default_max_connections(),
            max_claims: 0,
            max_buffered_bytes: default_max_buffered_bytes(),
            max_captured_bytes: default_max_captured_bytes(),
            worker_threads: 0,
            shutdown_grace: default_shutdown_grace(),
            http2: default_http2(),
            tls: None,
            cors: None,
            admin_token: String::new(),
            admin_token_file: None,
        }
    }
}

fn default_listen() -> String {
    DEFAULT_LISTEN.into()
}
fn default_admin_listen() -> String {
    DEFAULT_ADMIN_LISTEN.into()
}
/// The library's body limit: a route behind the gateway takes what the
/// same route in a service would.
fn default_max_body_bytes() -> u64 {
    idemgate::DEFAULT_MAX_BODY_BYTES
}
/// 256 bodies of the default largest size, as the library buffers.
fn default_max_buffered_bytes() -> u64 {
    idemgate::DEFAULT_MAX_BUFFERED_BYTES
}
/// The reserves of 4,096 claims, as the library holds.
fn default_max_captured_bytes() -> u64 {
    idemgate::DEFAULT_MAX_CAPTURED_BYTES
}
fn default_header_read_timeout() -> HumanDuration {
    DEFAULT_HEADER_READ_TIMEOUT.into()
}
fn default_body_read_timeout() -> HumanDuration {
    idemgate::DEFAULT_BODY_READ_TIMEOUT.into()
}
fn default_max_connections() -> usize {
    DEFAULT_MAX_CONNECTIONS
}
fn default_shutdown_grace() -> HumanDuration {
    DEFAULT_SHUTDOWN_GRACE.into()
}
fn default_http2() -> bool {
    DEFAULT_HTTP2
}
fn default_cors_max_age() -> HumanDuration {
    DEFAULT_CORS_MAX_AGE.into()
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

    /// Checks each key of `[server]` on its own.
    pub(super) fn check(&self, add: &mut dyn FnMut(String, String)) {
        for (key, value) in [
            ("server.listen", &self.listen),
            ("server.admin_listen", &self.admin_listen),
        ] {
            if value.parse::<SocketAddr>().is_err() {
                add(
                    key.into(),
                    format!("{value:?} is not an address like \"127.0.0.1:8080\""),
                );
            }
        }
        if !self.admin_token.is_empty() && self.admin_token_file.is_some() {
            add(
                "server.admin_token_file".into(),
                "set server.admin_token or server.admin_token_file, not both".into(),
            );
        }
        if self.max_body_bytes == 0 {
            add("server.max_body_bytes".into(), "must be above zero".into());
        }
        if self.max_connections == 0 {
            add("server.max_connections".into(), "must be above zero".into());
        }
        // None of these has a meaningful zero: a zero read timeout fails
        // every request, a zero shutdown grace drops every in-flight one.
        for (key, d) in [
            ("server.header_read_timeout", &self.header_read_timeout),
            ("server.body_read_timeout", &self.body_read_timeout),
            ("server.shutdown_grace", &self.shutdown_grace),
        ] {
            if let Some(reason) = d.problem() {
                add(key.into(), reason);
            }
        }
        if let Some(cors) = &self.cors {
            cors.check(add);
        }
    }
}

impl CorsConfig {
    /// Checks `[server.cors]`: each origin exactly as a browser sends it.
    fn check(&self, add: &mut dyn FnMut(String, String)) {
        if let Some(reason) = self.max_age.problem_unless_zero() {
            add("server.cors.max_age".into(), reason);
        }
        for origin in &self.allow_origins {
            // Exactly what a browser sends as `Origin`: the serialised
            // origin (RFC 6454 §6.1), compared byte for byte.
            let ok = url::Url::parse(origin).is_ok_and(|u| {
                matches!(u.scheme(), "http" | "https")
                    && u.origin().ascii_serialization() == origin.trim_end_matches('/')
            });
            if !ok {
                add(
                    "server.cors.allow_origins".into(),
                    format!(
                        "{origin:?} is not an origin like \"https://shop.example\" (scheme, host, \
                         optional port; no path, no wildcard)"
                    ),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::testing::{MINIMAL, problems_of, reasons_for};
    use crate::config::{Config, IdempotencyMode};
    use std::time::Duration;

    #[test]
    fn minimal_config_is_valid_and_defaulted() {
        let c = Config::parse(MINIMAL, "t").unwrap();
        c.validate("t").unwrap();
        assert_eq!(c.server.listen, DEFAULT_LISTEN);
        assert_eq!(c.store.retention.get(), Duration::from_secs(86_400));
        assert_eq!(c.routes[0].idempotency(), IdempotencyMode::None);
    }

    #[test]
    fn a_zero_or_bad_body_read_timeout_is_refused() {
        for value in ["0s", "0ms", "abc", ""] {
            let text = format!("[server]\nbody_read_timeout = \"{value}\"\n{MINIMAL}");
            let problems = problems_of(&text);
            assert_eq!(
                reasons_for(&problems, "server.body_read_timeout").len(),
                1,
                "{value:?}: {problems:?}"
            );
        }
    }
}
