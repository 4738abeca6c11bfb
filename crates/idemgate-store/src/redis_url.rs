//! The Redis servers a `store.redis_url` names: one server (`redis://`,
//! `rediss://`), a cluster's seed nodes (`redis+cluster://h:p,h:p`), or
//! the Sentinels that know which server is the master of a service
//! (`redis+sentinel://[user:pass@]h:p,h:p/service`, RFC-less but the
//! form redis-py and Lettuce read). The fast layer (`redis.rs`) and the
//! waiters' subscription (`settle.rs`) both open their connections here.

use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{ConnectionAddr, RedisConnectionInfo, RedisError};

const SENTINEL_SCHEME: &str = "redis+sentinel://";

/// The Sentinels of a `redis+sentinel://` URL, and the master service they
/// are asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Sentinels {
    /// `(host, port)` of each Sentinel, in the URL's order.
    pub(crate) nodes: Vec<(String, u16)>,
    /// The monitored service's name (the URL's path).
    pub(crate) service: String,
    /// Credentials for the master (not the Sentinels).
    pub(crate) username: Option<String>,
    pub(crate) password: Option<String>,
}

/// Whether `url` names Sentinels.
pub(crate) fn is_sentinel(url: &str) -> bool {
    url.starts_with(SENTINEL_SCHEME)
}

fn invalid(what: String) -> RedisError {
    RedisError::from((
        redis::ErrorKind::InvalidClientConfig,
        "redis+sentinel URL",
        what,
    ))
}

/// Parses a `redis+sentinel://` URL.
pub(crate) fn sentinels(url: &str) -> Result<Sentinels, RedisError> {
    let rest = url
        .strip_prefix(SENTINEL_SCHEME)
        .ok_or_else(|| invalid(format!("{url:?} is not redis+sentinel://")))?;
    let (authority, service) = rest
        .split_once('/')
        .ok_or_else(|| invalid("no service name: redis+sentinel://host:port/<service>".into()))?;
    let service = service.trim_end_matches('/').to_owned();
    if service.is_empty() {
        return Err(invalid(
            "no service name: redis+sentinel://host:port/<service>".into(),
        ));
    }
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((user, hosts)) => (Some(user), hosts),
        None => (None, authority),
    };
    let (username, password) = match userinfo {
        None => (None, None),
        Some(info) => {
            let decode =
                |s: &str| percent_decode(s).ok_or_else(|| invalid("a malformed %-escape".into()));
            match info.split_once(':') {
                Some((user, pass)) => (
                    Some(decode(user)?).filter(|u| !u.is_empty()),
                    Some(decode(pass)?),
                ),
                None => (Some(decode(info)?), None),
            }
        }
    };
    let mut nodes = Vec::new();
    for host in hosts.split(',') {
        let (name, port) = match host.rsplit_once(':') {
            Some((name, port)) => (
                name,
                port.parse::<u16>()
                    .map_err(|_| invalid("an invalid Sentinel port".into()))?,
            ),
            None => (host, 26379),
        };
        if name.is_empty() {
            return Err(invalid("an empty Sentinel host".into()));
        }
        nodes.push((name.to_owned(), port));
    }
    Ok(Sentinels {
        nodes,
        service,
        username,
        password,
    })
}

/// `%XX` escapes decoded (credentials may hold `@`, `:` or `,`).
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// A client for the Sentinels' current master of the service.
pub(crate) fn sentinel_client(sentinels: &Sentinels) -> Result<SentinelClient, RedisError> {
    let addrs: Vec<ConnectionAddr> = sentinels
        .nodes
        .iter()
        .map(|(host, port)| ConnectionAddr::Tcp(host.clone(), *port))
        .collect();
    let mut master = RedisConnectionInfo::default();
    if let Some(user) = &sentinels.username {
        master = master.set_username(user);
    }
    if let Some(pass) = &sentinels.password {
        master = master.set_password(pass);
    }
    SentinelClient::build(
        addrs,
        sentinels.service.clone(),
        Some(SentinelNodeConnectionInfo::default().set_redis_connection_info(master)),
        SentinelServerType::Master,
    )
}

/// A client for the server to subscribe and publish on: the one server;
/// a cluster's first seed node (Redis Cluster forwards every `PUBLISH` to
/// all its nodes); the Sentinels' master now (a replica would hear the
/// master's messages too, but a promoted one is where they are published
/// next).
pub(crate) async fn pubsub_client(url: &str) -> Result<redis::Client, RedisError> {
    if is_sentinel(url) {
        return sentinel_client(&sentinels(url)?)?.async_get_client().await;
    }
    match url.strip_prefix("redis+cluster://") {
        Some(nodes) => {
            let first = nodes.trim_end_matches('/').split(',').next().unwrap_or("");
            redis::Client::open(format!("redis://{first}"))
        }
        None => redis::Client::open(url),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sentinel_url_names_its_nodes_service_and_master_credentials() {
        let s = sentinels("redis+sentinel://:p%40ss@h1:26379,h2:26380/mymaster").unwrap();
        assert_eq!(
            s.nodes,
            vec![("h1".to_owned(), 26379), ("h2".to_owned(), 26380)]
        );
        assert_eq!(s.service, "mymaster");
        assert_eq!(s.username, None);
        assert_eq!(s.password.as_deref(), Some("p@ss"));
        let s = sentinels("redis+sentinel://h1/cache/").unwrap();
        assert_eq!(s.nodes, vec![("h1".to_owned(), 26379)]);
        assert_eq!(s.service, "cache");
    }

    #[test]
    fn a_sentinel_url_without_a_service_is_refused() {
        assert!(sentinels("redis+sentinel://h1:26379").is_err());
        assert!(sentinels("redis+sentinel://h1:26379/").is_err());
        assert!(sentinels("redis+sentinel://h1:x/m").is_err());
    }
}
