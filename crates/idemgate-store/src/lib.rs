//! The idempotency store: the SQL record is the truth, a fast layer sits in
//! front of it.
//!
//! - [`sql::SqlStore`]: Postgres or SQLite, same code and same schema. Every
//!   claim is durable here before anything is forwarded (docs/semantics.md, rule 1).
//!   Check-and-claim is one atomic statement (rule 2); every write after the
//!   claim carries the claim's fencing epoch, so a paused or late holder can
//!   never overwrite a newer one.
//! - [`FastLayer`]: the accelerator — [`redis::RedisLayer`] (with this
//!   process's copies of its completed answers in front, [`near`]) or
//!   [`memory::MemoryLayer`]. It turns concurrent duplicates away and
//!   replays finished requests without touching SQL; whatever it returns is
//!   verified before use, and its failures only send requests down the SQL
//!   path.
//! - [`tiered::Store`]: the composition the gateway uses. Every operation is
//!   bounded by `store.timeout`; an unreachable SQL store is an error the
//!   gateway answers 503 (rule 3: fail closed).
//!
//! A record moves `in_flight → completed`, `in_flight → uncertain` (the
//! request reached the upstream, no answer came back) or `in_flight →
//! released` (the attempt failed without effect). `uncertain`, `released`,
//! lease-expired and retention-expired records can be claimed again, which
//! bumps the epoch.

//! # Features
//!
//! `sqlite` (default; built from source), `postgres`, `redis`. At least one
//! of the two databases. A URL for a backend the build left out is refused
//! when the store is opened, naming the feature.

// With a backend left out, its half of the code is compiled out and some
// shared helpers go unused; CI lints the build with every backend.
#![cfg_attr(
    not(all(feature = "sqlite", feature = "postgres", feature = "redis")),
    allow(dead_code, unused_imports, unused_variables)
)]

#[cfg(not(any(feature = "sqlite", feature = "postgres")))]
compile_error!("idemgate-store needs the \"sqlite\" or the \"postgres\" feature");

pub mod batch;
pub mod codec;
pub mod fast;
pub mod held;
pub mod memory;
pub mod migrations;
#[cfg(feature = "redis")]
pub mod near;
pub mod purges;
#[cfg(feature = "redis")]
pub mod redis;
pub mod settle;
pub mod sql;
mod statements;
pub mod sweep;
pub mod tiered;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

pub use fast::FastLayer;
pub use tiered::{Store, StoreSettings};

/// Which record: (client scope, route, key) — docs/semantics.md, rule 4.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RecordKey {
    /// Hash of the client identity (see [`idemgate_core::identity`]).
    pub scope: String,
    /// The route name.
    pub route: String,
    /// The client's key, the token id, or the business key.
    pub key: String,
}

impl RecordKey {
    /// A key from its three parts.
    pub fn new(scope: impl Into<String>, route: impl Into<String>, key: impl Into<String>) -> Self {
        RecordKey {
            scope: scope.into(),
            route: route.into(),
            key: key.into(),
        }
    }

    /// The key as logs show it: never raw, see [`key_ref`].
    pub fn escaped(&self) -> String {
        key_ref(&self.key)
    }
}

/// How logs name a client's key: its first 4 characters, escaped, and a
/// short hash of the whole (`abcd…#1a2b3c4d`). Enough to tell keys apart
/// and to match `keys show` output, never enough to reuse the key.
pub fn key_ref(key: &str) -> String {
    use sha2::Digest;
    let hash = sha2::Sha256::digest(key.as_bytes());
    let prefix: String = key.chars().take(4).collect();
    format!("{}…#{}", prefix.escape_debug(), hex::encode(&hash[..4]))
}

/// Where a record stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordState {
    InFlight,
    Completed,
    Uncertain,
    Released,
}

impl RecordState {
    /// The column value.
    pub fn as_str(self) -> &'static str {
        match self {
            RecordState::InFlight => "in_flight",
            RecordState::Completed => "completed",
            RecordState::Uncertain => "uncertain",
            RecordState::Released => "released",
        }
    }

    fn parse(text: &str) -> Result<RecordState, StoreError> {
        Ok(match text {
            "in_flight" => RecordState::InFlight,
            "completed" => RecordState::Completed,
            "uncertain" => RecordState::Uncertain,
            "released" => RecordState::Released,
            other => return Err(StoreError::Corrupt(format!("unknown state {other:?}"))),
        })
    }
}

/// A finished request's outcome, as replayed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: u16,
    /// End-to-end headers, in order (no hop-by-hop, no `Set-Cookie`).
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Bytes,
    /// False when the body was over `store.max_stored_body_bytes`: the
    /// outcome is recorded (never re-executed) but the body is not kept.
    pub body_kept: bool,
    /// The `X-Request-Id` of the request that produced it.
    pub request_id: String,
}

/// One record as stored.
#[derive(Debug, Clone)]
pub struct Record {
    pub key: RecordKey,
    pub fingerprint: String,
    pub state: RecordState,
    pub epoch: i64,
    pub lease_until_ms: i64,
    pub request_id: String,
    pub response: Option<StoredResponse>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    pub expires_at_ms: i64,
    /// When its tombstone ends (`expires_at_ms` when tombstones are off):
    /// between the two, the key answers 410 for the same request.
    pub forgotten_at_ms: i64,
    /// The database's clock when the record was read: leases and expiries
    /// are judged against it, never against this gateway's clock.
    pub read_at_ms: i64,
}

/// What a claim found. Every answer about an existing record carries the
/// record's expiry (`Idempotency-Expires`), in ms since the Unix epoch by
/// the database's clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// This request holds the claim under `epoch`: forward it.
    Won {
        epoch: i64,
        expires_at_ms: i64,
        /// The attempt this claim replaced may have reached the upstream
        /// (it was uncertain, or its holder's lease ran out): ask the
        /// upstream before forwarding again, where the route can.
        maybe_ran: bool,
    },
    /// Another request with this key is running.
    InFlight {
        retry_after: Duration,
        expires_at_ms: i64,
    },
    /// The same request reached the upstream and no answer came back; a
    /// copy may still be running there for `retry_after`, and until then
    /// nothing is forwarded (docs/semantics.md, rule 8).
    Uncertain {
        epoch: i64,
        retry_after: Duration,
        expires_at_ms: i64,
    },
    /// The request already finished: replay this.
    Completed {
        response: StoredResponse,
        expires_at_ms: i64,
    },
    /// The key was used for a different request.
    Mismatch { expires_at_ms: i64 },
    /// The same request, after its record's retention, within its
    /// tombstone (`store.tombstone`): 410, never executed again.
    Expired { forgotten_at_ms: i64 },
}

impl Claim {
    /// Until when the answer's record is remembered: its retention's end,
    /// or for a tombstone the tombstone's end.
    pub fn expires_at_ms(&self) -> i64 {
        match self {
            Claim::Won { expires_at_ms, .. }
            | Claim::InFlight { expires_at_ms, .. }
            | Claim::Uncertain { expires_at_ms, .. }
            | Claim::Completed { expires_at_ms, .. }
            | Claim::Mismatch { expires_at_ms } => *expires_at_ms,
            Claim::Expired { forgotten_at_ms } => *forgotten_at_ms,
        }
    }
}

/// Why a store operation failed. Every variant means "fail closed".
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database refused or dropped the operation.
    #[error("SQL store unavailable during {op}: {cause}")]
    Unavailable {
        /// The operation (`claim`, `complete`, `connect`, …).
        op: &'static str,
        /// The database's error, its URL credentials redacted.
        cause: String,
    },
    /// The database did not answer within the store timeout.
    #[error("SQL store did not answer {op} within {after:?}")]
    Timeout {
        /// The operation (`claim`, `complete`, `connect`, …).
        op: &'static str,
        /// The store timeout that passed.
        after: Duration,
    },
    /// A record could not be decoded.
    #[error("stored record is corrupt: {0}")]
    Corrupt(String),
    /// The schema migrations could not be applied.
    #[error("migrations failed: {0}")]
    Migrate(String),
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}

/// Adds a duration to a millisecond timestamp.
pub fn after_ms(base: i64, d: Duration) -> i64 {
    base.saturating_add(d.as_millis().min(i64::MAX as u128) as i64)
}

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
    pub lease: Duration,
    pub retention: Duration,
    /// How long a record is kept as a fingerprint-only tombstone after its
    /// retention (zero: not at all).
    pub tombstone: Duration,
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
            redis::RedisLayer::new(
                &config.redis_url,
                &config.redis_prefix,
                config.fast_layer_budget,
            )
            .map_err(|e| StoreError::Unavailable {
                op: "redis",
                cause: e.to_string(),
            })?,
        );
        Ok(Arc::new(near::NearLayer::new(redis, memory)))
    }
    #[cfg(not(feature = "redis"))]
    Err(StoreError::Unavailable {
        op: "redis",
        cause: "this build has no Redis support (the idemgate-store feature \"redis\")".into(),
    })
}

impl Record {
    /// Whether the record is held under a live lease (by the database's
    /// clock when it was read).
    ///
    /// Uncertain records count while their hold runs (a copy may still be
    /// running at the upstream): neither the sweeper nor a purge removes a
    /// held record.
    pub fn is_held(&self) -> bool {
        matches!(self.state, RecordState::InFlight | RecordState::Uncertain)
            && self.lease_until_ms > self.read_at_ms
    }

    /// The record for operators (`idemgate keys show`, `/admin/keys`):
    /// state, epoch, lease, fingerprint, stored status and ages.
    pub fn describe(&self) -> serde_json::Value {
        let now = self.read_at_ms;
        let age = |ms: i64| format!("{:.1}s", (now - ms) as f64 / 1000.0);
        let left = |ms: i64| format!("{:.1}s", (ms - now) as f64 / 1000.0);
        // Past its retention a record only says "expired" (tombstone) or is
        // waiting for the sweep; its stored state stays what it was.
        let phase = if self.expires_at_ms > now || self.is_held() {
            "live"
        } else if self.forgotten_at_ms > now {
            "tombstone"
        } else {
            "forgotten"
        };
        serde_json::json!({
            "route": self.key.route,
            "key": self.key.key,
            "client_scope": self.key.scope,
            "state": self.state.as_str(),
            "phase": phase,
            "epoch": self.epoch,
            "lease_left": if self.state == RecordState::InFlight { Some(left(self.lease_until_ms)) } else { None },
            // An uncertain record is not taken over before this.
            "hold_left": if self.state == RecordState::Uncertain && self.lease_until_ms > now { Some(left(self.lease_until_ms)) } else { None },
            "fingerprint": self.fingerprint,
            "request_id": self.request_id,
            "stored_status": self.response.as_ref().map(|r| r.status),
            "stored_body_bytes": self.response.as_ref().map(|r| r.body.len()),
            "body_kept": self.response.as_ref().map(|r| r.body_kept),
            "age": age(self.created_at_ms),
            "updated": age(self.updated_at_ms),
            "expires_in": left(self.expires_at_ms),
            "forgotten_in": left(self.forgotten_at_ms),
        })
    }
}

/// Its answer to the client: the one problem type every module maps to.
impl From<&StoreError> for idemgate_core::error::Problem {
    fn from(e: &StoreError) -> Self {
        idemgate_core::error::Problem::new(idemgate_core::error::Reason::StoreUnavailable)
            .detail("the request was not forwarded; retry later with the same key")
            .retry_after(1)
            .logged("store", e.to_string())
    }
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
