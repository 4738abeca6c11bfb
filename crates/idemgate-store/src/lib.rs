//! The idempotency store: the SQL record is the truth, a fast layer sits in
//! front of it.
//!
//! - [`sql::SqlStore`]: SQLite or Postgres. Every claim is durable here
//!   before anything is forwarded (docs/semantics.md, rule 1).
//!   Check-and-claim is one atomic statement (rule 2); every write after the
//!   claim carries the claim's fencing epoch, so a paused or late holder can
//!   never overwrite a newer one.
//! - [`FastLayer`]: the accelerator — `redis::RedisLayer` (with this
//!   process's copies of its completed answers in front, `near`) or
//!   [`memory::MemoryLayer`]. It turns concurrent duplicates away and
//!   replays finished requests without touching SQL; whatever it returns is
//!   verified before use, and its failures only send requests down the SQL
//!   path.
//! - [`Store`]: the composition the gateway uses. Every operation is
//!   bounded by `store.timeout`; an unreachable SQL store is an error the
//!   gateway answers 503 (rule 3: fail closed).
//!
//! A record moves `in_flight → completed`, `in_flight → uncertain` (the
//! request reached the upstream, no answer came back) or `in_flight →
//! released` (the attempt failed without effect). `uncertain`, `released`,
//! lease-expired and retention-expired records can be claimed again, which
//! bumps the epoch.
//!
//! # Layout
//!
//! - `record.rs`, `error.rs`: the vocabulary — [`RecordKey`], [`Record`],
//!   [`Claim`], [`StoredResponse`], [`StoreError`] — which every other
//!   module speaks and which depends on none of them.
//! - `open.rs`: the assembly — [`StoreOptions`] with the `[store]`
//!   defaults, [`open`] and [`open_for_worker`].
//! - [`sql`]: the durable record, divided by concern (records, batched
//!   writes, the delivery log, the purge log, sweeping, the scope
//!   registry) over one seam for the databases (`sql/dialect.rs`, one
//!   module per database), and whether a commit survives a failover
//!   (`sql/durability.rs`). `url_hosts.rs`: the hosts of a database URL,
//!   for following its primary.
//! - [`fast`], [`memory`], `redis`, `near` (feature `redis`), [`codec`]: the fast layers
//!   and what they store.
//! - [`tiered`]: [`Store`], the fast layer composed with SQL, with its
//!   batch writers ([`batch`], [`held`]).
//! - [`settle`], [`purges`], [`sweep`], [`migrations`]: wake-ups across
//!   instances, the purge-log follower, the sweeper, the schema.
//!
//! # Features
//!
//! `sqlite` (default; built from source), `postgres`, `mysql`, `redis`. At least one
//! of the three databases. A URL for a backend the build left out is refused
//! when the store is opened, naming the feature.

#![warn(missing_docs)]

#[cfg(not(any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
compile_error!("idemgate-store needs one of the \"sqlite\", \"postgres\" and \"mysql\" features");

mod batch;
pub mod codec;
mod error;
pub mod fast;
mod held;
pub mod memory;
mod migrations;
#[cfg(feature = "redis")]
pub mod near;
mod open;
pub mod purges;
mod record;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "redis")]
mod redis_url;
pub mod settle;
pub mod sql;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod url_hosts;

pub mod sweep;
pub mod tiered;

pub use error::StoreError;
pub use fast::FastLayer;
pub use open::{
    DEFAULT_DATABASE_URL, DEFAULT_FAST_LAYER_BUDGET, DEFAULT_LEASE, DEFAULT_MAX_STORED_BODY_BYTES,
    DEFAULT_POOL_SIZE, DEFAULT_REDIS_PREFIX, DEFAULT_RETENTION, DEFAULT_SWEEP_INTERVAL,
    DEFAULT_TIMEOUT, StoreOptions, in_memory_refusal, is_in_memory, open, open_for_worker,
};
pub use record::{
    Claim, Record, RecordKey, RecordState, StoredResponse, after_ms, key_ref, now_ms,
};
pub use tiered::{Store, StoreSettings};
