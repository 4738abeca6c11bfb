//! The Redis fast layer, shared by every gateway instance.
//!
//! `redis://…` uses one multiplexed connection behind a
//! `ConnectionManager`, which reconnects by itself after Redis restarts;
//! `redis+cluster://host:port,host:port` uses the crate's cluster client;
//! `redis+sentinel://host:port,…/service` asks the Sentinels for the
//! service's master, and asks again after any failure on it (a failover
//! moved it, or it came back as a replica). The fast layer is never the
//! record: a promoted replica that lacks markers or answers the old master
//! had only sends requests down the SQL path, which decides.
//! The connection is made lazily, so the gateway starts (on the SQL path)
//! while Redis is down. Values are [`super::codec`] entries under
//! `<prefix><sha256 of the record key>`.

use std::time::Duration;

use futures_util::future::BoxFuture;
use redis::AsyncCommands;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use tokio::sync::OnceCell;

use super::RecordKey;
use super::codec::{FastEntry, decode_entry, encode_entry};
use super::fast::{FastError, FastLayer, storage_key};
use idemgate_core::metrics::FallbackLayer;

#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

enum Target {
    Single(ConnectionManager),
    Cluster(Box<redis::cluster::ClusterClient>),
    Sentinel(Box<SentinelTarget>),
}

/// The Sentinels, and a connection to the master they named last
/// (dropped after a failure, so that the next call asks them again).
struct SentinelTarget {
    sentinels: tokio::sync::Mutex<redis::sentinel::SentinelClient>,
    master: std::sync::Mutex<Option<ConnectionManager>>,
    config: ConnectionManagerConfig,
    /// Whether a master was connected before (a new one after that is a
    /// move), and when the last move was.
    connected_before: std::sync::atomic::AtomicBool,
    moved_at: std::sync::Mutex<Option<std::time::Instant>>,
}

/// The Redis fast layer.
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
pub struct RedisLayer {
    target: Target,
    cluster: OnceCell<ClusterConnection>,
    prefix: String,
    /// Where settled records are announced (`<prefix>settled`).
    channel: String,
    get_or_mark: redis::Script,
}

/// GET, or SET … PX when absent, in one atomic step and one round trip
/// (a script runs alone on its shard). Answers the existing value and its
/// time to live in milliseconds (Redis's own clock: a copy kept nearer
/// expires with it, whatever the gateway's clock says), or nil.
const GET_OR_MARK: &str = r#"
local existing = redis.call('GET', KEYS[1])
if existing then return {existing, redis.call('PTTL', KEYS[1])} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
"#;

fn backend(e: redis::RedisError) -> FastError {
    FastError::Backend(e.to_string())
}

impl RedisLayer {
    /// A layer for `url`; connects on first use. `budget` bounds how long
    /// a reconnect attempt may take.
    #[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
    #[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
    pub fn new(url: &str, prefix: &str, budget: Duration) -> Result<RedisLayer, FastError> {
        let target = if let Some(nodes) = url.strip_prefix("redis+cluster://") {
            let nodes: Vec<String> = nodes
                .trim_end_matches('/')
                .split(',')
                .map(|n| format!("redis://{n}"))
                .collect();
            Target::Cluster(Box::new(
                redis::cluster::ClusterClient::new(nodes).map_err(backend)?,
            ))
        } else if crate::redis_url::is_sentinel(url) {
            let sentinels = crate::redis_url::sentinels(url).map_err(backend)?;
            Target::Sentinel(Box::new(SentinelTarget {
                sentinels: tokio::sync::Mutex::new(
                    crate::redis_url::sentinel_client(&sentinels).map_err(backend)?,
                ),
                master: std::sync::Mutex::new(None),
                config: manager_config(budget),
                connected_before: std::sync::atomic::AtomicBool::new(false),
                moved_at: std::sync::Mutex::new(None),
            }))
        } else {
            let client = redis::Client::open(url).map_err(backend)?;
            let config = manager_config(budget);
            Target::Single(
                client
                    .get_connection_manager_lazy(config)
                    .map_err(backend)?,
            )
        };
        Ok(RedisLayer {
            target,
            cluster: OnceCell::new(),
            prefix: prefix.to_owned(),
            channel: super::settle::redis_channel(prefix),
            get_or_mark: redis::Script::new(GET_OR_MARK),
        })
    }

    async fn conn(&self) -> Result<Conn, FastError> {
        match &self.target {
            Target::Single(manager) => Ok(Conn::Single(manager.clone())),
            Target::Sentinel(target) => {
                if let Some(manager) = target
                    .master
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone()
                {
                    return Ok(Conn::Single(manager));
                }
                // Asks the Sentinels, which check the server's ROLE is
                // master before naming it.
                let client = target
                    .sentinels
                    .lock()
                    .await
                    .async_get_client()
                    .await
                    .map_err(backend)?;
                let manager = client
                    .get_connection_manager_with_config(target.config.clone())
                    .await
                    .map_err(backend)?;
                *target.master.lock().unwrap_or_else(|p| p.into_inner()) = Some(manager.clone());
                if target
                    .connected_before
                    .swap(true, std::sync::atomic::Ordering::Relaxed)
                {
                    *target.moved_at.lock().unwrap_or_else(|p| p.into_inner()) =
                        Some(std::time::Instant::now());
                }
                Ok(Conn::Single(manager))
            }
            Target::Cluster(client) => {
                let conn = self
                    .cluster
                    .get_or_try_init(|| client.get_async_connection())
                    .await
                    .map_err(backend)?;
                Ok(Conn::Cluster(conn.clone()))
            }
        }
    }
}

impl RedisLayer {
    /// After a failed call: with Sentinels, forget the master, so that the
    /// next call asks them again.
    fn failed<T>(&self, result: Result<T, FastError>) -> Result<T, FastError> {
        if result.is_err()
            && let Target::Sentinel(target) = &self.target
        {
            *target.master.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
        result
    }
}

/// How a single server's connection is kept: `budget` bounds a reconnect.
fn manager_config(budget: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(budget.max(Duration::from_millis(200))))
        .set_response_timeout(Some(budget.max(Duration::from_millis(200))))
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_millis(500))
}

/// Runs `$body` on the layer's connection; a failure of either is passed
/// through [`RedisLayer::failed`].
macro_rules! with_conn {
    ($self:expr, $c:ident => $body:expr) => {{
        let result = async {
            match $self.conn().await? {
                Conn::Single(mut $c) => $body,
                Conn::Cluster(mut $c) => $body,
            }
        }
        .await;
        $self.failed(result)
    }};
}

impl FastLayer for RedisLayer {
    fn layer(&self) -> FallbackLayer {
        FallbackLayer::Redis
    }

    fn get_or_mark<'a>(
        &'a self,
        entry: &'a FastEntry,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<(FastEntry, Duration)>, FastError>> {
        Box::pin(async move {
            let name = storage_key(&self.prefix, entry.key());
            let millis = ttl.as_millis().max(1) as u64;
            let mut invocation = self.get_or_mark.key(&name);
            invocation.arg(encode_entry(entry)).arg(millis);
            let found: Option<(Vec<u8>, i64)> = with_conn!(self, c => {
                invocation.invoke_async(&mut c).await.map_err(backend)
            })?;
            found
                .map(|(bytes, pttl)| {
                    // -1 (no expiry) is not one of ours; count it as none left.
                    let left = Duration::from_millis(pttl.max(0) as u64);
                    decode_entry(&bytes)
                        .map(|entry| (entry, left))
                        .map_err(FastError::Corrupt)
                })
                .transpose()
        })
    }

    fn put<'a>(
        &'a self,
        entry: &'a FastEntry,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), FastError>> {
        Box::pin(async move {
            let name = storage_key(&self.prefix, entry.key());
            let millis = ttl.as_millis().max(1) as u64;
            with_conn!(self, c => {
                c.pset_ex::<_, _, ()>(&name, encode_entry(entry), millis).await.map_err(backend)
            })
        })
    }

    fn remove<'a>(&'a self, key: &'a RecordKey) -> BoxFuture<'a, Result<(), FastError>> {
        Box::pin(async move {
            let name = storage_key(&self.prefix, key);
            with_conn!(self, c => c.del::<_, ()>(&name).await.map_err(backend))
        })
    }

    fn moved_at(&self) -> Option<std::time::Instant> {
        match &self.target {
            Target::Sentinel(target) => *target.moved_at.lock().unwrap_or_else(|p| p.into_inner()),
            _ => None,
        }
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), FastError>> {
        Box::pin(async move {
            with_conn!(self, c => {
                redis::cmd("PING").query_async::<String>(&mut c).await.map(|_| ()).map_err(backend)
            })
        })
    }

    fn announce<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<(), FastError>> {
        Box::pin(async move {
            with_conn!(self, c => {
                c.publish::<_, _, ()>(&self.channel, token).await.map_err(backend)
            })
        })
    }
}
