//! `[store]`: the durable record and its fast layer — the schema, the
//! defaults, the checks each key needs on its own, and the
//! [`idemgate_store::StoreOptions`] the store is opened from.
//!
//! Every default the store crate has a constant for is that constant, so
//! the gateway and the library open the same store from an empty section.
//! What compares two durations (the lease with `store.timeout`, the
//! retention with the upstreams) is in `validate.rs`.

use serde::Deserialize;

use super::HumanDuration;

/// The embedded store every fresh checkout runs on.
pub use idemgate_store::DEFAULT_DATABASE_URL;

/// `store.tombstone`: off, as the spec's default; an expired key then
/// executes again, as after Stripe's 24 h.
const DEFAULT_TOMBSTONE: &str = "0s";

/// `[store]`: the durable record and its fast layer.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    /// The durable record: `sqlite:…`, `postgres://…` (`postgresql://…`)
    /// or `mysql://…` (`mariadb://…`); a database that dies with the
    /// process is refused.
    #[serde(default = "default_database_url")]
    pub database_url: String,
    /// The fast layer: empty for in process; `redis://…` or `rediss://…`;
    /// `redis+cluster://host:port,…` for Redis Cluster;
    /// `redis+sentinel://host:port,…/service` for Redis Sentinel.
    #[serde(default)]
    pub redis_url: String,
    /// How long a record lives, counted from its claim (default 24 h).
    #[serde(default = "default_retention")]
    pub retention: HumanDuration,
    /// How long a claim outlives a gateway that died; renewed every third
    /// of it while the request runs (default 30 s).
    #[serde(default = "default_lease")]
    pub lease: HumanDuration,
    /// Bound on every store operation, queueing included; past it `503
    /// store-unavailable` (default 2 s).
    #[serde(default = "default_store_timeout")]
    pub timeout: HumanDuration,
    /// How often expired records are swept; on Postgres it also sizes the
    /// record table's partitions (default 1 min).
    #[serde(default = "default_sweep_interval")]
    pub sweep_interval: HumanDuration,
    /// Keep expired records in an archive table instead of deleting them.
    #[serde(default)]
    pub archive: bool,
    /// After `retention`, how long a record is kept as a fingerprint-only
    /// tombstone: the same request gets 410 instead of executing again.
    #[serde(default = "default_tombstone")]
    pub tombstone: HumanDuration,
    /// A fast-layer answer slower than this sends the request down the SQL
    /// path (and is counted in `idemgate_store_fallback_total`).
    #[serde(default = "default_fast_layer_budget")]
    pub fast_layer_budget: HumanDuration,
    /// Response bodies larger than this are recorded without their body.
    #[serde(default = "default_max_stored_body_bytes")]
    pub max_stored_body_bytes: usize,
    /// Bytes the in-process fast layer may hold (least recently used
    /// answers go first; replays then come from SQL).
    #[serde(default = "default_memory_layer_bytes")]
    pub memory_layer_bytes: usize,
    /// Connections in the SQL pool.
    #[serde(default = "default_pool_size")]
    pub pool_size: u32,
    /// Prefix of every Redis key this gateway writes.
    #[serde(default = "default_redis_prefix")]
    pub redis_prefix: String,
    /// Refuse to serve (and fail `/readyz`) unless the database confirms
    /// that a commit survives a failover: a synchronous Postgres standby, a
    /// Galera quorum, lossless semi-synchronous replication.
    #[serde(default)]
    pub require_synchronous: bool,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            database_url: default_database_url(),
            redis_url: String::new(),
            retention: default_retention(),
            lease: default_lease(),
            timeout: default_store_timeout(),
            sweep_interval: default_sweep_interval(),
            archive: false,
            tombstone: default_tombstone(),
            fast_layer_budget: default_fast_layer_budget(),
            max_stored_body_bytes: default_max_stored_body_bytes(),
            memory_layer_bytes: default_memory_layer_bytes(),
            pool_size: default_pool_size(),
            redis_prefix: default_redis_prefix(),
            require_synchronous: false,
        }
    }
}

fn default_database_url() -> String {
    DEFAULT_DATABASE_URL.into()
}
fn default_retention() -> HumanDuration {
    idemgate_store::DEFAULT_RETENTION.into()
}
fn default_lease() -> HumanDuration {
    idemgate_store::DEFAULT_LEASE.into()
}
fn default_store_timeout() -> HumanDuration {
    idemgate_store::DEFAULT_TIMEOUT.into()
}
fn default_sweep_interval() -> HumanDuration {
    idemgate_store::DEFAULT_SWEEP_INTERVAL.into()
}
fn default_fast_layer_budget() -> HumanDuration {
    idemgate_store::DEFAULT_FAST_LAYER_BUDGET.into()
}
fn default_max_stored_body_bytes() -> usize {
    idemgate_store::DEFAULT_MAX_STORED_BODY_BYTES
}
fn default_tombstone() -> HumanDuration {
    DEFAULT_TOMBSTONE.into()
}
fn default_memory_layer_bytes() -> usize {
    idemgate_store::DEFAULT_MEMORY_MAX_BYTES
}
fn default_pool_size() -> u32 {
    idemgate_store::DEFAULT_POOL_SIZE
}
fn default_redis_prefix() -> String {
    idemgate_store::DEFAULT_REDIS_PREFIX.into()
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

    /// Checks each key of `[store]` on its own.
    pub(super) fn check(&self, add: &mut dyn FnMut(String, String)) {
        if self.memory_layer_bytes == 0 {
            add(
                "store.memory_layer_bytes".into(),
                "must be above zero (the in-process fast layer needs room for its in-flight markers)"
                    .into(),
            );
        }
        // None of these has a meaningful zero: a zero store timeout fails
        // every request, a zero lease or retention protects nothing, a zero
        // sweep interval or budget spins.
        for (key, d) in [
            ("store.retention", &self.retention),
            ("store.lease", &self.lease),
            ("store.timeout", &self.timeout),
            ("store.sweep_interval", &self.sweep_interval),
            ("store.fast_layer_budget", &self.fast_layer_budget),
        ] {
            if let Some(reason) = d.problem() {
                add(key.into(), reason);
            }
        }
        if let Some(reason) = self.tombstone.problem_unless_zero() {
            add("store.tombstone".into(), reason);
        }
        self.check_urls(add);
        if self.pool_size == 0 {
            add("store.pool_size".into(), "must be above zero".into());
        }
    }

    /// `database_url` and `redis_url`: a backend the store can open.
    fn check_urls(&self, add: &mut dyn FnMut(String, String)) {
        let db = &self.database_url;
        if idemgate_store::is_in_memory(db) {
            add(
                "store.database_url".into(),
                idemgate_store::in_memory_refusal("store.database_url", db),
            );
        }
        if idemgate_store::Dialect::of(db).is_none() {
            add(
                "store.database_url".into(),
                format!(
                    "{db:?} must start with sqlite:, postgres://, postgresql://, mysql:// or \
                     mariadb://"
                ),
            );
        }
        let redis = &self.redis_url;
        let redis_ok = [
            "redis://",
            "rediss://",
            "redis+cluster://",
            "redis+sentinel://",
        ]
        .iter()
        .any(|scheme| redis.starts_with(scheme));
        if !redis.is_empty() && !redis_ok {
            add(
                "store.redis_url".into(),
                format!(
                    "{redis:?} must be empty (in-process fast layer), redis://…, \
                     redis+cluster://… or redis+sentinel://…/service"
                ),
            );
        }
    }
}
