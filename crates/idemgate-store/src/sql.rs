//! The durable record: the source of truth (docs/semantics.md, rules 1–3).
//!
//! [`SqlStore`] is the one face every part of the gateway talks to. Behind
//! it, one implementation per family of databases ([`Dialect`]):
//!
//! - `dollar.rs`: Postgres and SQLite, one body of statements (`$N`
//!   placeholders, `RETURNING`, `ON CONFLICT`), each statement atomic on
//!   its own; what differs between the two (connecting, batched writes,
//!   Postgres's partitions) in a module each under `dollar/`.
//! - `mysql.rs`: MySQL 8 and MariaDB on InnoDB (`?` placeholders, no
//!   `RETURNING`; its deadlocks and lock waits retried).
//!
//! Every claim is one atomic step; every write after it carries the
//! claim's fencing epoch; every lease and expiry is judged by the
//! database's clock. The face is divided by concern: records, batched
//! writes, the MQ link's delivery log ([`DeliveryLog`]), the purge log,
//! sweeping, and the registry of what scopes each route's records.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::{Claim, Record, RecordKey, RecordState, StoreError, StoredResponse};

mod dialect;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod dollar;
mod durability;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod primary;
mod rows;

pub use dialect::Dialect;
pub use durability::Durability;

/// Rows moved per sweep statement: small enough that a sweep never holds
/// locks for long, large enough to keep up.
pub(crate) const SWEEP_BATCH: i64 = 500;

/// The SQL record store: one face over the implementation of its database.
#[derive(Clone)]
pub struct SqlStore {
    backend: Backend,
}

/// The implementation a store runs on.
#[derive(Clone)]
enum Backend {
    /// Postgres or SQLite.
    #[cfg(any(feature = "sqlite", feature = "postgres"))]
    Dollar(dollar::DollarSql),
    /// MySQL or MariaDB.
    #[cfg(feature = "mysql")]
    Mysql(mysql::MysqlSql),
}

/// Runs `$call` on whichever implementation `$self` has: the one place the
/// face meets its databases.
macro_rules! on_backend {
    ($self:expr, $b:ident => $call:expr) => {
        match &$self.backend {
            #[cfg(any(feature = "sqlite", feature = "postgres"))]
            Backend::Dollar($b) => $call,
            #[cfg(feature = "mysql")]
            Backend::Mysql($b) => $call,
        }
    };
}

// === impl SqlStore: connection ===

impl SqlStore {
    /// Connects (creating a SQLite file and its directory when missing).
    pub async fn connect(settings: &SqlSettings) -> Result<SqlStore, StoreError> {
        let dialect = Dialect::of(&settings.url).ok_or_else(|| StoreError::Unavailable {
            op: "connect",
            cause: format!(
                "{:?} names no database this store knows (sqlite:, postgres://, mysql://)",
                settings.url
            ),
        })?;
        let backend = match dialect {
            #[cfg(feature = "mysql")]
            Dialect::Mysql => Backend::Mysql(mysql::MysqlSql::connect(settings).await?),
            #[cfg(any(feature = "sqlite", feature = "postgres"))]
            Dialect::Postgres | Dialect::Sqlite => {
                Backend::Dollar(dollar::DollarSql::connect(settings).await?)
            }
            #[allow(unreachable_patterns)] // every database built in
            other => return Err(dialect::not_built(other)),
        };
        Ok(SqlStore { backend })
    }

    /// Applies the migrations of this store's database (and, on Postgres,
    /// makes the partitions the next claims land in).
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    pub(crate) async fn migrate(&self) -> Result<(), StoreError> {
        on_backend!(self, b => b.migrate().await)
    }

    /// The migrations up to `version` only: a database as an earlier
    /// release left it (upgrade tests).
    #[doc(hidden)]
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    #[cfg(any(test, feature = "testing"))]
    pub(crate) async fn migrate_until(&self, version: Option<i64>) -> Result<(), StoreError> {
        on_backend!(self, b => b.migrate_until(version).await)
    }

    /// The bound on every operation (`store.timeout`).
    pub(crate) fn timeout(&self) -> Duration {
        on_backend!(self, b => b.timeout())
    }

    /// `postgres`, `sqlite` or `mysql`.
    pub fn backend(&self) -> &'static str {
        self.dialect().name()
    }

    /// Which database this store runs on.
    pub(crate) fn dialect(&self) -> Dialect {
        on_backend!(self, b => b.dialect())
    }

    /// `SELECT 1`, for `/readyz`.
    pub(crate) async fn ping(&self) -> Result<(), StoreError> {
        on_backend!(self, b => b.ping().await)
    }

    /// Whether a commit this store makes survives a failover of its
    /// database, as the database says now.
    pub async fn durability(&self) -> Result<Durability, StoreError> {
        on_backend!(self, b => b.durability().await)
    }

    /// How long a record stays a tombstone after its retention.
    pub(crate) fn tombstone(&self) -> Duration {
        on_backend!(self, b => b.tombstone())
    }

    /// The URL this store connected to (tests open a second store on it).
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn url_for_tests(&self) -> &str {
        on_backend!(self, b => b.url_for_tests())
    }
}

// === impl SqlStore: records ===

impl SqlStore {
    /// Claims `key` for a request with `fingerprint`, on a connection of its
    /// own, for tools and tests: the gateway claims through [`crate::Store`],
    /// whose batch writer releases a claim that committed after its caller
    /// stopped waiting.
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    #[cfg(any(test, feature = "testing"))]
    pub(crate) async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &str,
        request_id: &str,
        lease: Duration,
        retention: Duration,
    ) -> Result<Claim, StoreError> {
        let job = NewClaim {
            key: key.clone(),
            fingerprint: fingerprint.to_owned(),
            request_id: request_id.to_owned(),
            lease,
            retention,
            past_tombstone: false,
        };
        // A record deleted (purged, swept) between the insert and the
        // takeover makes both find nothing; the loop then claims again.
        // Not a batch writer: a connection of its own, returned at the end.
        let unbatched = crate::held::HeldConnection::default();
        for _ in 0..3 {
            let inserted = self
                .insert_claims(std::slice::from_ref(&job), &unbatched)
                .await?;
            if let Some((epoch, expires_at_ms)) = inserted[0] {
                return Ok(Claim::Won {
                    epoch,
                    expires_at_ms,
                    maybe_ran: false,
                });
            }
            if let Some((claim, _)) = self.claim_existing(&job).await? {
                return Ok(claim);
            }
        }
        Err(StoreError::Unavailable {
            op: "claim",
            cause: "the record kept disappearing between statements".into(),
        })
    }

    /// The existing-key half of a claim: take the record over if it may be
    /// taken, else read it to answer, with the record's retention left.
    /// `None` when the row vanished.
    pub(crate) async fn claim_existing(
        &self,
        c: &NewClaim,
    ) -> Result<Option<(Claim, Duration)>, StoreError> {
        on_backend!(self, b => b.claim_existing(c).await)
    }

    /// Reads one record.
    pub(crate) async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        on_backend!(self, b => b.get(key).await)
    }

    /// Every record of `route` and `key`, whatever the client scope.
    pub(crate) async fn find(&self, route: &str, key: &str) -> Result<Vec<Record>, StoreError> {
        on_backend!(self, b => b.find(route, key).await)
    }

    /// The records still `uncertain` among the `limit` most recently
    /// marked, newest first.
    pub async fn uncertain(&self, limit: i64) -> Result<Vec<Record>, StoreError> {
        on_backend!(self, b => b.uncertain(limit).await)
    }

    /// Stores the outcome; the retention left and whether a duplicate
    /// waits for it, or `None` when `epoch` no longer holds the claim.
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    #[cfg(any(test, feature = "testing"))]
    pub(crate) async fn complete(
        &self,
        key: &RecordKey,
        epoch: i64,
        response: &StoredResponse,
    ) -> Result<Option<(Duration, bool)>, StoreError> {
        on_backend!(self, b => b.complete(key, epoch, response).await)
    }

    /// Stores the answer reconciliation got for an `uncertain` record,
    /// fenced by that record's epoch.
    pub(crate) async fn complete_reconciled(
        &self,
        key: &RecordKey,
        epoch: i64,
        response: &StoredResponse,
    ) -> Result<Option<(Duration, bool)>, StoreError> {
        on_backend!(self, b => b.complete_reconciled(key, epoch, response).await)
    }

    /// Gives the claim up (nothing happened upstream): whether a duplicate
    /// waits for it, or `None` when `epoch` no longer holds it.
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    pub(crate) async fn release(
        &self,
        key: &RecordKey,
        epoch: i64,
    ) -> Result<Option<bool>, StoreError> {
        on_backend!(self, b => b.set_state(key, epoch, RecordState::Released, Duration::ZERO, "release").await)
    }

    /// Records that the outcome is unknown: nothing is forwarded for
    /// `hold`, then the next retry may take over.
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    pub(crate) async fn mark_uncertain(
        &self,
        key: &RecordKey,
        epoch: i64,
        hold: Duration,
    ) -> Result<Option<bool>, StoreError> {
        on_backend!(self, b => b.set_state(key, epoch, RecordState::Uncertain, hold, "mark_uncertain").await)
    }

    /// Says a duplicate waits for `key` while it is in flight; false when
    /// it is not in flight (any more).
    pub(crate) async fn mark_watched(&self, key: &RecordKey) -> Result<bool, StoreError> {
        on_backend!(self, b => b.mark_watched(key).await)
    }

    /// Extends a running claim's lease to `lease` from now; false when it
    /// was taken over.
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    pub(crate) async fn renew(
        &self,
        key: &RecordKey,
        epoch: i64,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        on_backend!(self, b => b.renew(key, epoch, lease).await)
    }

    /// Tells every instance listening on the database that the record with
    /// this hash settled (Postgres `NOTIFY`; nothing elsewhere).
    pub(crate) async fn announce(&self, token: &str) -> Result<(), StoreError> {
        on_backend!(self, b => b.announce(token).await)
    }

    /// Deletes one record, or with `scope = None` the key in every scope —
    /// except a record held under a live lease, which is never purged.
    pub(crate) async fn purge(
        &self,
        route: &str,
        key: &str,
        scope: Option<&str>,
    ) -> Result<Purged, StoreError> {
        on_backend!(self, b => b.purge(route, key, scope).await)
    }

    /// Rows in the record table (operators, tests).
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    #[cfg(any(test, feature = "testing"))]
    pub(crate) async fn records(&self) -> Result<i64, StoreError> {
        on_backend!(self, b => b.records().await)
    }
}

// === impl SqlStore: batched writes ===

impl SqlStore {
    /// The fresh-key half of a claim, for many keys at once: the epoch and
    /// expiry where the row was inserted, i.e. the claim was won.
    pub(crate) async fn insert_claims(
        &self,
        batch: &[NewClaim],
        held: &crate::held::HeldConnection,
    ) -> Result<Vec<Option<(i64, i64)>>, StoreError> {
        on_backend!(self, b => b.insert_claims(batch, held).await)
    }

    /// Stores many outcomes at once; for each, the retention left and
    /// whether a duplicate waits, or `None` where the epoch no longer
    /// holds the claim.
    pub(crate) async fn complete_many(
        &self,
        batch: &[Completion],
        held: &crate::held::HeldConnection,
    ) -> Result<Vec<Option<(Duration, bool)>>, StoreError> {
        on_backend!(self, b => b.complete_many(batch, held).await)
    }

    /// Claims and completions of one batch in one transaction (SQLite;
    /// refused elsewhere).
    #[cfg(feature = "sqlite")]
    pub(crate) async fn write_many(&self, batch: &[Write]) -> Result<Vec<Written>, StoreError> {
        on_backend!(self, b => b.write_many(batch).await)
    }
}

// === impl SqlStore: the delivery log ===

impl SqlStore {
    /// A consumed message's failed upstream attempts and whether its
    /// dead-letter copy is stored (`0`, `false` when it never failed).
    pub(crate) async fn delivery(&self, route: &str, key: &str) -> Result<(u32, bool), StoreError> {
        on_backend!(self, b => b.delivery(route, key).await)
    }

    /// Counts a failed upstream attempt of a consumed message, for every
    /// instance; `first`: a fresh delivery starts the count over.
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    pub(crate) async fn count_delivery_failure(
        &self,
        route: &str,
        key: &str,
        first: bool,
    ) -> Result<u32, StoreError> {
        on_backend!(self, b => b.count_delivery_failure(route, key, first).await)
    }

    /// Says a consumed message's dead-letter copy is stored.
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    pub(crate) async fn mark_dead_lettered(
        &self,
        route: &str,
        key: &str,
    ) -> Result<(), StoreError> {
        on_backend!(self, b => b.mark_dead_lettered(route, key).await)
    }

    /// Takes the lease to publish a consumed message's dead-letter copy for
    /// `lease` (see [`DeadLetterClaim`]).
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    pub(crate) async fn claim_dead_letter(
        &self,
        route: &str,
        key: &str,
        holder: &str,
        lease: Duration,
    ) -> Result<DeadLetterClaim, StoreError> {
        on_backend!(self, b => b.claim_dead_letter(route, key, holder, lease).await)
    }

    /// Extends `holder`'s copy lease; whether it still held it.
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    pub(crate) async fn renew_dead_letter(
        &self,
        route: &str,
        key: &str,
        holder: &str,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        on_backend!(self, b => b.renew_dead_letter(route, key, holder, lease).await)
    }

    /// Gives back the copy lease `holder` won (a lease that passed to
    /// another holder is left alone).
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    pub(crate) async fn release_dead_letter(
        &self,
        route: &str,
        key: &str,
        holder: &str,
    ) -> Result<(), StoreError> {
        on_backend!(self, b => b.release_dead_letter(route, key, holder).await)
    }

    /// Forgets delivery rows untouched since `before_ms`.
    pub(crate) async fn trim_deliveries(&self, before_ms: i64) -> Result<u64, StoreError> {
        on_backend!(self, b => b.trim_deliveries(before_ms).await)
    }
}

// === impl SqlStore: the purge log ===

impl SqlStore {
    /// Purges logged after `last` (oldest first, at most 1,000).
    pub(crate) async fn purges_since(&self, last: i64) -> Result<Vec<LoggedPurge>, StoreError> {
        on_backend!(self, b => b.purges_since(last).await)
    }

    /// The newest logged purge's id.
    pub(crate) async fn last_purge(&self) -> Result<i64, StoreError> {
        on_backend!(self, b => b.last_purge().await)
    }

    /// Forgets logged purges older than `age`.
    pub(crate) async fn trim_purges(&self, age: Duration) -> Result<u64, StoreError> {
        on_backend!(self, b => b.trim_purges(age).await)
    }
}

// === impl SqlStore: sweeping ===

impl SqlStore {
    /// Retires what a database can retire whole (Postgres: expired
    /// partitions, detached and dropped or kept): the rows removed, and the
    /// tables left to sweep row by row.
    pub(crate) async fn retire(&self, archive: bool) -> Result<(u64, Vec<String>), StoreError> {
        on_backend!(self, b => b.retire(archive).await)
    }

    /// Removes (or archives) one batch of expired records of `table`;
    /// returns how many.
    pub(crate) async fn sweep_batch(&self, archive: bool, table: &str) -> Result<u64, StoreError> {
        on_backend!(self, b => b.sweep_batch(archive, table).await)
    }

    /// With tombstones on: drops the stored answers of records whose
    /// retention ended at or after `after` (ms), one batch; returns how
    /// many and the watermark to pass next time.
    pub(crate) async fn strip_batch(&self, after: i64) -> Result<(u64, i64), StoreError> {
        on_backend!(self, b => b.strip_batch(after).await)
    }

    /// Forgets uncertain-log entries older than `before_ms`.
    pub(crate) async fn trim_uncertain_log(&self, before_ms: i64) -> Result<u64, StoreError> {
        on_backend!(self, b => b.trim_uncertain_log(before_ms).await)
    }

    /// Rows archived (operators, tests).
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    #[cfg(any(test, feature = "testing"))]
    pub(crate) async fn archived(&self) -> Result<i64, StoreError> {
        on_backend!(self, b => b.archived().await)
    }

    /// Postgres: makes the partitions the next claims land in; the number
    /// made (nothing to do elsewhere).
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    #[cfg(any(test, feature = "testing"))]
    pub(crate) async fn extend_partitions(&self) -> Result<u32, StoreError> {
        on_backend!(self, b => b.extend_partitions().await)
    }
}

// === impl SqlStore: what scopes records ===

impl SqlStore {
    /// Every namespace the registry knows that `planned` would drop or
    /// scope otherwise while records under it are live, with their count.
    pub async fn orphaned_by(
        &self,
        planned: &BTreeMap<String, Scoping>,
    ) -> Result<Vec<Orphaned>, StoreError> {
        on_backend!(self, b => b.orphaned_by(planned).await)
    }

    /// Records `planned` as what the records are written under from now on,
    /// and forgets the namespaces it drops.
    pub async fn register_scopes(
        &self,
        planned: &BTreeMap<String, Scoping>,
    ) -> Result<(), StoreError> {
        on_backend!(self, b => b.register_scopes(planned).await)
    }
}

// === vocabulary ===

/// One write of a lane that claims and completes together (see
/// [`SqlStore::write_many`]).
#[derive(Debug, Clone)]
// Only SQLite sends claims and completions down one lane.
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
pub(crate) enum Write {
    /// A fresh key's claim.
    Claim(NewClaim),
    /// An outcome to store.
    Complete(Completion),
}

/// A [`Write`]'s answer: the claim's epoch and expiry where it was won;
/// the completion's retention left and whether a duplicate waits, where
/// its epoch still held the claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
pub(crate) enum Written {
    /// The claim's epoch and expiry, where it was won.
    Claim(Option<(i64, i64)>),
    /// The retention left and whether a duplicate waits, where the
    /// completion's epoch still held the claim.
    Complete(Option<(Duration, bool)>),
}

/// One claim of a key, as [`SqlStore::insert_claims`] takes it.
#[derive(Debug, Clone)]
pub(crate) struct NewClaim {
    /// Which record.
    pub key: RecordKey,
    /// The request's fingerprint.
    pub fingerprint: String,
    /// Its `X-Request-Id`.
    pub request_id: String,
    /// The claim's first lease.
    pub lease: Duration,
    /// The record's retention, from now.
    pub retention: Duration,
    /// Take a record past its retention over even within its tombstone
    /// (a sender's redelivery, not a client's retry).
    pub past_tombstone: bool,
}

/// One completion waiting to be written.
#[derive(Debug, Clone)]
pub(crate) struct Completion {
    /// Which record.
    pub key: RecordKey,
    /// The claim's epoch: the write is fenced by it.
    pub epoch: i64,
    /// The outcome to store.
    pub response: StoredResponse,
}

/// Who publishes a consumed message's dead-letter copy
/// (`SqlStore::claim_dead_letter`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeadLetterClaim {
    /// This caller, under this copy id.
    Won(String),
    /// Nobody: the copy is stored.
    Copied,
    /// Another instance, under a live lease.
    Busy,
}

/// One consumer's delivery log: its messages' failed attempts and the
/// leases on their dead-letter copies, kept under the consumer's record
/// identity. The handle the MQ link holds, so that it reaches nothing of
/// the store but what it owns.
#[derive(Clone)]
pub struct DeliveryLog {
    sql: SqlStore,
    consumer: std::sync::Arc<str>,
}

impl DeliveryLog {
    /// The log of the consumer whose records are kept under `consumer`.
    pub(crate) fn new(sql: SqlStore, consumer: &str) -> DeliveryLog {
        DeliveryLog {
            sql,
            consumer: consumer.into(),
        }
    }

    /// A message's failed attempts and whether its dead-letter copy is
    /// stored (see `SqlStore::delivery`).
    pub async fn delivery(&self, key: &str) -> Result<(u32, bool), StoreError> {
        self.sql.delivery(&self.consumer, key).await
    }

    /// Counts a failed attempt (see `SqlStore::count_delivery_failure`).
    pub async fn count_failure(&self, key: &str, first: bool) -> Result<u32, StoreError> {
        self.sql
            .count_delivery_failure(&self.consumer, key, first)
            .await
    }

    /// Says the message's dead-letter copy is stored.
    pub async fn mark_dead_lettered(&self, key: &str) -> Result<(), StoreError> {
        self.sql.mark_dead_lettered(&self.consumer, key).await
    }

    /// Takes the lease to publish the message's dead-letter copy (see
    /// `SqlStore::claim_dead_letter`).
    pub async fn claim_dead_letter(
        &self,
        key: &str,
        holder: &str,
        lease: Duration,
    ) -> Result<DeadLetterClaim, StoreError> {
        self.sql
            .claim_dead_letter(&self.consumer, key, holder, lease)
            .await
    }

    /// Extends `holder`'s copy lease (see `SqlStore::renew_dead_letter`).
    pub async fn renew_dead_letter(
        &self,
        key: &str,
        holder: &str,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.sql
            .renew_dead_letter(&self.consumer, key, holder, lease)
            .await
    }

    /// Gives the copy lease back (see `SqlStore::release_dead_letter`).
    pub async fn release_dead_letter(&self, key: &str, holder: &str) -> Result<(), StoreError> {
        self.sql
            .release_dead_letter(&self.consumer, key, holder)
            .await
    }

    /// Whether an attempt of the message is open (a record held under a
    /// live lease, or uncertain within its hold), on any instance.
    pub async fn attempt_open(&self, key: &str) -> Result<bool, StoreError> {
        let records = self.sql.find(&self.consumer, key).await?;
        Ok(records.iter().any(crate::Record::is_held))
    }

    /// The store's bound on one operation.
    pub fn timeout(&self) -> Duration {
        self.sql.timeout()
    }
}

/// One logged purge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LoggedPurge {
    /// Its place in the log (ids only grow).
    pub id: i64,
    /// The purged record's route identity.
    pub route: String,
    /// The purged key.
    pub key: String,
    /// `None`: every scope.
    pub scope: Option<String>,
}

/// What a purge did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Purged {
    /// Records deleted.
    pub removed: u64,
    /// Records left because they are held under a live lease.
    pub held: u64,
}

/// What a configuration says of one record namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scoping {
    /// The namespace its records sit under (the route column): the route's
    /// identity, or `/token` for every token route.
    pub records: String,
    /// What makes its record keys, as text (`key;identity=header:x-user-id`).
    pub scope: String,
}

/// A namespace a configuration would put out of reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Orphaned {
    /// The namespace's name in the registry (a route's or consumer's id).
    pub route: String,
    /// What scoped its records.
    pub was: String,
    /// What the configuration would scope them by (`None`: nothing keeps
    /// them — the route was removed, renamed without `id`, or is no longer
    /// protected).
    pub now: Option<String>,
    /// Its records still live or retained (within retention, tombstone or
    /// a lease).
    pub live: u64,
    /// When the last of them is forgotten (ms since the Unix epoch, by the
    /// database's clock).
    pub until_ms: i64,
}

/// Connection settings of the SQL store.
#[derive(Debug, Clone)]
pub struct SqlSettings {
    /// The database URL (`sqlite:…`, `postgres://…`).
    pub url: String,
    /// Connections in the pool.
    pub pool_size: u32,
    /// Bound on every operation, and on waiting for a pooled connection.
    pub timeout: Duration,
    /// How long a record stays a fingerprint-only tombstone after its
    /// retention (zero: forgotten at once).
    pub tombstone: Duration,
    /// Postgres: the schema the tables live in (see
    /// [`super::StoreOptions::schema`]).
    pub schema: Option<String>,
    /// `store.retention`: Postgres makes partitions this far ahead.
    pub retention: Duration,
    /// Postgres: the span of expiries one partition holds (see
    /// `partition_span`).
    pub partition_span: Duration,
}

/// The narrowest span of expiries one Postgres partition holds.
pub(crate) const MIN_PARTITION_SPAN: Duration = Duration::from_secs(1);

/// The widest span of expiries one Postgres partition holds.
pub(crate) const MAX_PARTITION_SPAN: Duration = Duration::from_secs(24 * 3600);

/// Partitions that hold live records and tombstones, at most: every by-key
/// statement probes each one (the key does not name its partition), so a
/// retention (plus tombstone) longer than this many days gets wider spans
/// instead of more partitions.
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
#[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
pub const MAX_LIVE_PARTITIONS: u32 = 16;

/// The span of one Postgres partition: the retention, or the sweep
/// interval where that is longer (so a sweep never has more than a few
/// partitions to make or retire), within a second and a day. Records live
/// at most one span past their retention before their partition goes.
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
pub fn partition_span(retention: Duration, sweep_interval: Duration) -> Duration {
    retention
        .max(sweep_interval)
        .clamp(MIN_PARTITION_SPAN, MAX_PARTITION_SPAN)
}

/// A schema name as the store accepts it: a plain lowercase SQL
/// identifier, so it needs no quoting anywhere.
#[cfg(feature = "postgres")]
pub(crate) fn check_schema(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    if first_ok
        && name.len() <= 63
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        Ok(())
    } else {
        Err(format!(
            "schema {name:?} must be a lowercase identifier ([a-z_][a-z0-9_]*, at most 63 bytes)"
        ))
    }
}

/// Bounds one operation by `limit` and names it in errors.
async fn bounded_by<T>(
    op: &'static str,
    limit: Duration,
    work: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(limit, work).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(StoreError::Unavailable {
            op,
            cause: e.to_string(),
        }),
        Err(_) => Err(StoreError::Timeout { op, after: limit }),
    }
}

/// Milliseconds left, as a duration (zero when past).
fn left(ms: i64) -> Duration {
    Duration::from_millis(ms.max(0) as u64)
}

/// A migrated SQLite store in memory, retention an hour: for unit tests.
#[cfg(all(test, feature = "sqlite"))]
pub(crate) async fn sqlite_in_memory() -> SqlStore {
    let store = SqlStore::connect(&SqlSettings {
        url: "sqlite::memory:".into(),
        pool_size: 1,
        timeout: Duration::from_secs(5),
        tombstone: Duration::ZERO,
        schema: None,
        retention: Duration::from_secs(3600),
        partition_span: Duration::from_secs(3600),
    })
    .await
    .unwrap();
    store.migrate().await.unwrap();
    store
}
