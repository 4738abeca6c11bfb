//! Assembly: what a store is opened from ([`StoreOptions`], with the
//! defaults of `[store]` as typed constants, their one home), and the
//! opening itself — the SQL store migrated, the in-process layer, the fast
//! layer (Redis with each process's copies in front, or the in-process
//! layer), the wake-up channel — for the main runtime ([`open`]) and for
//! each worker thread ([`open_for_worker`]).

use std::sync::Arc;
use std::time::Duration;

use crate::fast::FastLayer;
use crate::settle;
use crate::tiered::StoreSettings;
use crate::{Store, StoreError, memory, sql};

/// The embedded store a fresh checkout runs on.
pub const DEFAULT_DATABASE_URL: &str = "sqlite://data/idemgate.db";
/// How long a finished request replays (Stripe keeps keys 24 h).
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 3600);
/// How long a claim outlives a crashed holder; renewed while it runs.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// The bound on every store operation (then 503).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);
/// A fast-layer answer slower than this falls back to SQL.
pub const DEFAULT_FAST_LAYER_BUDGET: Duration = Duration::from_millis(100);
/// Connections in the SQL pool.
pub const DEFAULT_POOL_SIZE: u32 = 16;
/// The prefix of every Redis key.
pub const DEFAULT_REDIS_PREFIX: &str = "idemgate:";
/// How often expired records are retired.
pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(60);
/// Answers larger than this are recorded without their body.
pub const DEFAULT_MAX_STORED_BODY_BYTES: usize = 1024 * 1024;

/// What a store is opened from (a validated `[store]`, or the library's
/// builder).
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// `sqlite://PATH`, `sqlite::memory:` or `postgres://…`.
    pub database_url: String,
    /// Postgres: the schema the store's tables (and its migrations table)
    /// live in, created when missing; `None`: the connection's
    /// `search_path`.
    pub schema: Option<String>,
    /// Empty: the in-process fast layer.
    pub redis_url: String,
    /// The prefix of every Redis key (and of the waiters' channel).
    pub redis_prefix: String,
    /// Connections in the SQL pool.
    pub pool_size: u32,
    /// Bound on every store operation.
    pub timeout: Duration,
    /// How long a claim outlives a crashed holder (renewed while it runs).
    pub lease: Duration,
    /// How long a finished request replays.
    pub retention: Duration,
    /// How long a record is kept as a fingerprint-only tombstone after its
    /// retention (zero: not at all).
    pub tombstone: Duration,
    /// A fast-layer answer slower than this falls back to SQL.
    pub fast_layer_budget: Duration,
    /// Bytes the in-process fast layer may hold.
    pub memory_layer_bytes: usize,
    /// How often the sweeper runs (Postgres sizes its partitions by it).
    pub sweep_interval: Duration,
    /// For tests only: accept a database that lives and dies with the
    /// process (`sqlite::memory:`, `mode=memory`). Refused otherwise: every
    /// record would vanish with a restart, and every retry after it would
    /// execute again.
    pub in_memory_for_tests: bool,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            database_url: DEFAULT_DATABASE_URL.into(),
            schema: None,
            redis_url: String::new(),
            redis_prefix: DEFAULT_REDIS_PREFIX.into(),
            pool_size: DEFAULT_POOL_SIZE,
            timeout: DEFAULT_TIMEOUT,
            lease: DEFAULT_LEASE,
            retention: DEFAULT_RETENTION,
            tombstone: Duration::ZERO,
            fast_layer_budget: DEFAULT_FAST_LAYER_BUDGET,
            memory_layer_bytes: memory::DEFAULT_MAX_BYTES,
            sweep_interval: DEFAULT_SWEEP_INTERVAL,
            in_memory_for_tests: false,
        }
    }
}

/// Whether `database_url` names a database that dies with the process: an
/// in-memory SQLite database (`sqlite::memory:`, `sqlite://:memory:`, an
/// empty path, or `mode=memory`), whose records a restart forgets.
pub fn is_in_memory(database_url: &str) -> bool {
    let Some(rest) = database_url.strip_prefix("sqlite:") else {
        return false;
    };
    let rest = rest.strip_prefix("//").unwrap_or(rest);
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    path.is_empty()
        || path == ":memory:"
        || path.starts_with("file::memory:")
        || query
            .split('&')
            .any(|pair| pair.eq_ignore_ascii_case("mode=memory"))
}

/// Why an in-memory database is refused, naming the URL's key.
pub fn in_memory_refusal(key: &str, database_url: &str) -> String {
    format!(
        "{key} = {database_url:?} is an in-memory database: every record dies with the process, \
         so after a restart every retry executes again; use sqlite://PATH (a file) or \
         postgres://… (in-memory stores are for tests, by the library builder's \
         in_memory_for_tests())"
    )
}

/// The store the options ask for, with its migrations applied, plus the
/// in-process layer (the fast layer, or with Redis the copies of completed
/// answers kept near) for the sweeper to trim, the purge log to reach and
/// worker stores to share.
pub async fn open(
    config: &StoreOptions,
    metrics: Arc<idemgate_core::metrics::Metrics>,
) -> Result<(Store, Arc<memory::MemoryLayer>), StoreError> {
    if is_in_memory(&config.database_url) && !config.in_memory_for_tests {
        return Err(StoreError::Unavailable {
            op: "connect",
            cause: in_memory_refusal("the database URL", &config.database_url),
        });
    }
    let sql = sql::SqlStore::connect(&sql_settings(config, config.pool_size)).await?;
    sql.migrate().await?;
    // The in-process layer is the fast layer, or, with Redis, holds this
    // process's copies of completed answers (`near`).
    let memory = Arc::new(memory::MemoryLayer::with_budget(
        memory::DEFAULT_MAX_ENTRIES,
        config.memory_layer_bytes,
    ));
    let fast = fast_layer(config, memory.clone())?;
    let channel = if !config.redis_url.is_empty() {
        settle::Channel::Redis
    } else if sql.backend() == "postgres" {
        settle::Channel::Postgres
    } else {
        settle::Channel::Local
    };
    let settlements = Arc::new(settle::Settlements::default());
    settlements.listen(channel, config);
    let store = Store::with_settlements(
        sql,
        Some(fast),
        settings_of(config),
        metrics,
        settlements,
        channel,
    );
    Ok((store, memory))
}

/// A store for one worker thread's event loop, built on that loop.
///
/// Postgres sockets and the Redis connection belong to the runtime that
/// opened them, so each worker opens its own (a share of `store.pool_size`)
/// and runs its own batch writers: a protected request never leaves its
/// thread. With SQLite the workers share the main store whole: sqlx drives
/// SQLite from its own thread anyway, and one set of batch writers makes the
/// biggest transactions on its single connection (fewest fsyncs); the
/// in-process fast layer is one map for the whole process.
pub async fn open_for_worker(
    config: &StoreOptions,
    shared: &Store,
    memory: Arc<memory::MemoryLayer>,
    metrics: Arc<idemgate_core::metrics::Metrics>,
    workers: usize,
) -> Result<Store, StoreError> {
    if shared.sql().backend() == "sqlite" {
        return Ok(shared.clone());
    }
    let share = (config.pool_size as usize).div_ceil(workers.max(1)).max(2) as u32;
    let sql = sql::SqlStore::connect(&sql_settings(config, share)).await?;
    let fast = fast_layer(config, memory)?;
    Ok(Store::with_settlements(
        sql,
        Some(fast),
        settings_of(config),
        metrics,
        shared.settlements().clone(),
        shared.channel(),
    ))
}

fn sql_settings(config: &StoreOptions, pool_size: u32) -> sql::SqlSettings {
    sql::SqlSettings {
        url: config.database_url.clone(),
        pool_size,
        timeout: config.timeout,
        tombstone: config.tombstone,
        schema: config.schema.clone(),
        retention: config.retention,
        partition_span: sql::partition_span(config.retention, config.sweep_interval),
    }
}

fn settings_of(config: &StoreOptions) -> StoreSettings {
    StoreSettings {
        lease: config.lease,
        retention: config.retention,
        fast_layer_budget: config.fast_layer_budget,
    }
}

fn fast_layer(
    config: &StoreOptions,
    memory: Arc<memory::MemoryLayer>,
) -> Result<Arc<dyn FastLayer>, StoreError> {
    if config.redis_url.is_empty() {
        return Ok(memory);
    }
    #[cfg(feature = "redis")]
    {
        let redis: Arc<dyn FastLayer> = Arc::new(
            crate::redis::RedisLayer::new(
                &config.redis_url,
                &config.redis_prefix,
                config.fast_layer_budget,
            )
            .map_err(|e| StoreError::Unavailable {
                op: "redis",
                cause: e.to_string(),
            })?,
        );
        Ok(Arc::new(crate::near::NearLayer::new(redis, memory)))
    }
    #[cfg(not(feature = "redis"))]
    Err(StoreError::Unavailable {
        op: "redis",
        cause: "this build has no Redis support (the idemgate-store feature \"redis\")".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_memory_databases_are_told_from_files() {
        for url in [
            "sqlite::memory:",
            "sqlite://:memory:",
            "sqlite:",
            "sqlite://",
            "sqlite://x.db?mode=memory",
            "sqlite:x.db?cache=shared&mode=memory",
            "sqlite::memory:?cache=shared",
            "sqlite://file::memory:",
        ] {
            assert!(is_in_memory(url), "{url}");
        }
        for url in [
            "sqlite://data/idemgate.db",
            "sqlite:records.db",
            "sqlite:///tmp/x.db?mode=rwc",
            "postgres://u@h/db",
            "mysql://u@h/db",
        ] {
            assert!(!is_in_memory(url), "{url}");
        }
    }

    #[tokio::test]
    async fn opening_an_in_memory_store_is_refused_unless_for_tests() {
        let metrics = Arc::new(idemgate_core::metrics::Metrics::default());
        let options = StoreOptions {
            database_url: "sqlite::memory:".into(),
            ..StoreOptions::default()
        };
        let refused = open(&options, metrics.clone()).await;
        assert!(refused.is_err_and(|e| e.to_string().contains("in-memory")));
        let allowed = StoreOptions {
            in_memory_for_tests: true,
            ..options
        };
        assert!(open(&allowed, metrics).await.is_ok());
    }
}
