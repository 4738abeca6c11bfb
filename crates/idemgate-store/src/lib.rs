//! The idempotency store: the SQL record is the truth, a fast layer sits in
//! front of it.
//!
//! - [`SqlStore`]: SQLite, Postgres or MySQL/MariaDB. Every claim is durable
//!   here before anything is forwarded (docs/semantics.md, rule 1).
//!   Check-and-claim is one atomic statement (rule 2); every write after the
//!   claim carries the claim's fencing epoch, so a paused or late holder can
//!   never overwrite a newer one.
//! - The fast layer: the accelerator — Redis (with this process's copies of
//!   its completed answers in front) or the in-process [`MemoryLayer`]. It
//!   turns concurrent duplicates away and replays finished requests without
//!   touching SQL; whatever it returns is verified before use, and its
//!   failures only send requests down the SQL path.
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
//! # The face
//!
//! Everything another crate uses is exported here, at the root, except the
//! waiters' [`settle`] channel; every other module is private and `pub(crate)` is
//! the default inside them (the `unreachable_pub` lint keeps it so). What
//! only the test suite and the load generators reach — one layer on its
//! own, a single claim without the batch writers, record counts — is behind
//! the `testing` feature, in `testing`.
//!
//! # Layout
//!
//! - `record.rs`, `error.rs`: the vocabulary — [`RecordKey`], [`Record`],
//!   [`Claim`], [`StoredResponse`], [`StoreError`] — which every other
//!   module speaks and which depends on none of them.
//! - `open.rs`: the assembly — [`StoreOptions`] with the `[store]`
//!   defaults, [`open`] and [`open_for_worker`].
//! - `sql.rs`: the durable record, divided by concern (records, batched
//!   writes, the delivery log, the purge log, sweeping, the scope
//!   registry) over one seam for the databases (`sql/dialect.rs`, one
//!   module per database), and whether a commit survives a failover
//!   (`sql/durability.rs`). `url_hosts.rs`: the hosts of a database URL,
//!   for following its primary.
//! - `fast.rs`, `memory.rs`, `redis.rs`, `near.rs` (feature `redis`),
//!   `codec.rs`: the fast layers and what they store.
//! - `tiered.rs`: [`Store`], the fast layer composed with SQL, with its
//!   batch writers (`batch.rs`, `held.rs`).
//! - [`settle`], `purges.rs`, `sweep.rs`, `migrations.rs`: wake-ups across
//!   instances, the purge-log follower, the sweeper, the schema.
//!
//! # Features
//!
//! `sqlite` (default; built from source), `postgres`, `mysql`, `redis`. At least one
//! of the three databases. A URL for a backend the build left out is refused
//! when the store is opened, naming the feature. `testing` opens the
//! internals the test suite needs; nothing in production enables it.

#![warn(missing_docs)]
// What the `testing` feature opens (`testing.rs`) is also built for this
// crate's own unit tests, which use only part of it.
#![cfg_attr(all(test, not(feature = "testing")), allow(dead_code))]

#[cfg(not(any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
compile_error!("idemgate-store needs one of the \"sqlite\", \"postgres\" and \"mysql\" features");

mod batch;
mod codec;
mod error;
mod fast;
mod held;
mod memory;
mod migrations;
#[cfg(feature = "redis")]
mod near;
mod open;
mod purges;
mod record;
#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "redis")]
mod redis_url;
pub mod settle;
mod sql;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod url_hosts;

mod sweep;
mod tiered;

pub use error::StoreError;
pub use memory::{DEFAULT_MAX_BYTES as DEFAULT_MEMORY_MAX_BYTES, MemoryLayer};
pub use open::{
    DEFAULT_DATABASE_URL, DEFAULT_FAST_LAYER_BUDGET, DEFAULT_LEASE, DEFAULT_MAX_STORED_BODY_BYTES,
    DEFAULT_POOL_SIZE, DEFAULT_REDIS_PREFIX, DEFAULT_RETENTION, DEFAULT_SWEEP_INTERVAL,
    DEFAULT_TIMEOUT, StoreOptions, in_memory_refusal, is_in_memory, open, open_for_worker,
};
pub use purges::follow as follow_purges;
pub use record::{
    Claim, Record, RecordKey, RecordState, StoredResponse, after_ms, key_ref, now_ms,
};
pub use sql::{
    DeadLetterClaim, DeliveryLog, Dialect, Durability, Orphaned, Purged, Scoping, SqlSettings,
    SqlStore,
};
pub use sweep::{spawn as spawn_sweeper, sweep_once};
pub use tiered::{Store, StoreSettings};

#[cfg(feature = "testing")]
pub mod testing;
