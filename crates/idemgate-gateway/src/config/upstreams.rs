//! `[[upstreams]]`: the services requests are forwarded to — the schema,
//! the defaults, the checks each entry needs on its own, what the proxy
//! builds an upstream from ([`idemgate_proxy::UpstreamSpec`]), and what an
//! engine in front of one takes from it ([`OutcomeSettings`]), computed
//! here once for the routes and the consumers alike.

use std::collections::BTreeSet;
use std::time::Duration;

use idemgate::idempotency::outcome::UncertainStatuses;
use serde::Deserialize;

use super::HumanDuration;

/// `upstreams[].timeout`: how long the gateway waits for an answer. Not
/// the library's handler deadline: that bounds a handler in the same
/// process, this a service across the network.
const DEFAULT_UPSTREAM_TIMEOUT: &str = "10s";
/// `upstreams[].max_connections`: no cap, as nginx (`max_conns`) and
/// HAProxy (`maxconn` per server) default to.
const DEFAULT_UPSTREAM_MAX_CONNECTIONS: usize = 0;

/// `[[upstreams]]`: a service requests are forwarded to.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    /// Unique; routes and consumers refer to it.
    pub name: String,
    /// `http://host:port` or `https://host:port`, no path or query: request
    /// paths are forwarded unchanged.
    pub url: String,
    /// Bound on the whole answer, head and body; past it `504
    /// upstream-timeout` and the record is uncertain (default 10 s).
    #[serde(default = "default_upstream_timeout")]
    pub timeout: HumanDuration,
    /// `https://` only: a PEM bundle trusted instead of the system roots.
    #[serde(default)]
    pub ca_file: Option<String>,
    /// `https://` only: the client certificate chain for mutual TLS.
    #[serde(default)]
    pub client_cert: Option<String>,
    /// `https://` only: the client certificate's private key.
    #[serde(default)]
    pub client_key: Option<String>,
    /// Speak HTTP/2 to this upstream (ALPN over TLS, prior knowledge over
    /// plain HTTP).
    #[serde(default)]
    pub http2: bool,
    /// At most this many HTTP/1.1 connections to it at once (0: no cap),
    /// split over the workers; past it requests wait for a connection to
    /// come back, up to the connect timeout (half the timeout, at most
    /// 5 s), then `503 upstream-busy`.
    #[serde(default = "default_upstream_max_connections")]
    pub max_connections: usize,
    /// How long an uncertain outcome keeps its key from being forwarded
    /// again (a copy may still be running here); default: `timeout`.
    #[serde(default)]
    pub uncertain_hold: Option<HumanDuration>,
    /// Answers that may mean the action ran (5xx only): a proxy in front
    /// of the service sends `502`/`504` for an answer it lost; add `500`
    /// for a service that may fail after its commit. Such an answer makes
    /// the record uncertain, never released.
    #[serde(default = "default_uncertain_statuses")]
    pub uncertain_statuses: Vec<u16>,
}

fn default_upstream_timeout() -> HumanDuration {
    DEFAULT_UPSTREAM_TIMEOUT.into()
}
fn default_upstream_max_connections() -> usize {
    DEFAULT_UPSTREAM_MAX_CONNECTIONS
}
fn default_uncertain_statuses() -> Vec<u16> {
    idemgate::idempotency::outcome::DEFAULT_UNCERTAIN_STATUSES.to_vec()
}

/// What an engine in front of an upstream takes from it: how long a
/// duplicate waits for the first copy's outcome, and which outcomes are
/// uncertain and how long they hold their key. A route and a consumer over
/// the same upstream get the same values.
#[derive(Debug, Clone, Copy, Default)]
pub struct OutcomeSettings {
    /// How long a waiting duplicate waits: the upstream's timeout.
    pub wait_limit: Duration,
    /// How long an uncertain outcome holds its key: `uncertain_hold`, or
    /// the timeout.
    pub uncertain_hold: Duration,
    /// The answers that make an outcome uncertain: `uncertain_statuses`.
    pub uncertain_statuses: UncertainStatuses,
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

    /// How long an uncertain outcome holds its key: `uncertain_hold`, or
    /// the upstream's timeout (the gateway gave up waiting that long; the
    /// upstream usually did not).
    pub fn uncertain_hold(&self) -> Duration {
        self.uncertain_hold
            .as_ref()
            .map_or_else(|| self.timeout.get(), HumanDuration::get)
    }

    /// `uncertain_statuses`, checked (validation refuses a status outside
    /// 5xx; none is taken here for one that slipped through).
    pub fn uncertain_statuses(&self) -> UncertainStatuses {
        UncertainStatuses::new(&self.uncertain_statuses).unwrap_or_default()
    }

    /// What an engine in front of this upstream takes from it.
    pub fn outcome_settings(&self) -> OutcomeSettings {
        OutcomeSettings {
            wait_limit: self.timeout.get(),
            uncertain_hold: self.uncertain_hold(),
            uncertain_statuses: self.uncertain_statuses(),
        }
    }

    /// Checks one entry on its own; `key` names its fields.
    fn check(&self, key: &dyn Fn(&str) -> String, add: &mut dyn FnMut(String, String)) {
        if let Err(reason) = check_upstream_url(&self.url) {
            add(key("url"), reason);
        } else if let Err((field, reason)) = check_upstream_tls(self, key) {
            add(field, reason);
        }
        if let Some(reason) = self.timeout.problem() {
            add(key("timeout"), reason);
        }
        if let Some(reason) = self
            .uncertain_hold
            .as_ref()
            .and_then(|h| h.problem_unless_zero())
        {
            add(key("uncertain_hold"), reason);
        }
        if let Err(status) = UncertainStatuses::new(&self.uncertain_statuses) {
            add(
                key("uncertain_statuses"),
                format!(
                    "{status} is not a 5xx status: only an answer in 500..599 can stand for \
                     one a proxy in front of the service lost (every other status is the \
                     service's own, stored or released as it says)"
                ),
            );
        }
        if self.http2 && self.max_connections > 0 {
            add(
                key("max_connections"),
                "caps HTTP/1.1 upstreams only: an HTTP/2 upstream's requests share connections of 100 streams".into(),
            );
        }
    }
}

/// Checks every `[[upstreams]]` entry, and that each has a name of its
/// own; the names, for what names an upstream.
pub(super) fn check_all<'a>(
    upstreams: &'a [UpstreamConfig],
    add: &mut dyn FnMut(String, String),
) -> BTreeSet<&'a str> {
    let mut names = BTreeSet::new();
    for (i, u) in upstreams.iter().enumerate() {
        let key = |field: &str| format!("upstreams[{i}].{field}");
        if u.name.is_empty() {
            add(key("name"), "must not be empty".into());
        } else if !names.insert(u.name.as_str()) {
            add(key("name"), format!("duplicate upstream name {:?}", u.name));
        }
        u.check(&key, add);
    }
    names
}

/// An upstream URL: `http://` or `https://`, a host, no path or query.
pub(super) fn check_upstream_url(raw: &str) -> Result<(), String> {
    let url = url::Url::parse(raw).map_err(|e| format!("{raw:?} is not a URL: {e}"))?;
    if url.scheme() != "http" && url.scheme() != "https" {
        return Err(format!("{raw:?}: an upstream is http:// or https://"));
    }
    if url.host_str().is_none() {
        return Err(format!("{raw:?} has no host"));
    }
    if !(url.path().is_empty() || url.path() == "/") || url.query().is_some() {
        return Err(format!(
            "{raw:?}: an upstream URL is scheme, host and port only; request paths are forwarded unchanged"
        ));
    }
    Ok(())
}

/// An upstream's TLS files: only on `https://` (they are read with the
/// upstream, when the plan is loaded).
fn check_upstream_tls(
    u: &UpstreamConfig,
    key: &dyn Fn(&str) -> String,
) -> Result<(), (String, String)> {
    let fields = [
        ("ca_file", &u.ca_file),
        ("client_cert", &u.client_cert),
        ("client_key", &u.client_key),
    ];
    if u.url.to_ascii_lowercase().starts_with("https://") {
        return Ok(());
    }
    match fields.iter().find(|(_, v)| v.is_some()) {
        Some((field, _)) => Err((
            key(field),
            "only an https:// upstream uses TLS files".into(),
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;
    use crate::config::testing::MINIMAL;
    use std::time::Duration;

    #[test]
    fn an_uncertain_key_is_held_for_the_upstreams_timeout_unless_told_and_warned() {
        let c = Config::parse(
            &MINIMAL.replace("url = ", "timeout = \"7s\"\n        url = "),
            "t",
        )
        .unwrap();
        c.validate("t").unwrap();
        assert_eq!(c.upstreams[0].uncertain_hold(), Duration::from_secs(7));
        assert!(
            c.warnings()
                .iter()
                .all(|w| !w.key.contains("uncertain_hold"))
        );
        let shorter = MINIMAL.replace(
            "url = ",
            "timeout = \"7s\"\n        uncertain_hold = \"2s\"\n        url = ",
        );
        let c = Config::parse(&shorter, "t").unwrap();
        c.validate("t").unwrap();
        assert_eq!(c.upstreams[0].uncertain_hold(), Duration::from_secs(2));
        let warned = c.warnings();
        let w = warned
            .iter()
            .find(|w| w.key == "upstreams[0].uncertain_hold")
            .expect("warned");
        assert!(w.reason.contains("7s"), "{}", w.reason);
    }
}
