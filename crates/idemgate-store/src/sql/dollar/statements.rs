//! The SQL text of every record statement, for Postgres and SQLite.
//!
//! Both databases run the same statements against the same schema; what
//! differs is how each reads its clock. Every lease and expiry is judged by
//! the database's clock (`{now}`, milliseconds since the Unix epoch), never
//! by one gateway's: two instances whose clocks disagree still agree on
//! whether a lease is live, because only the database decides (docs/semantics.md).
//!
//! A fresh record's epoch is the database's clock in microseconds
//! (`{epoch}`), and each takeover adds one. So epochs only ever grow for a
//! key, even across a purge: a holder from before the purge can never match
//! the epoch of the record inserted after it.
//!
//! Parameters in milliseconds (`lease`, `retention`) are durations; the
//! statements add them to `{now}` themselves.

use std::sync::LazyLock;

use crate::sql::SWEEP_BATCH;

/// The statements of one database.
pub(super) struct Statements {
    /// Postgres only: `$1 scope, $2 route, $3 key, $4 fingerprint, $5 lease
    /// ms, $6 request id, $7 retention ms` → `epoch, expires_at` when
    /// inserted.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub claim_insert: String,
    /// Postgres only: the batched insert over arrays `$1..$4, $6` with the
    /// scalar `$5 lease ms, $7 retention ms` → the keys inserted, their
    /// epochs and expiries.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub claim_insert_many: String,
    /// Takes over a record that may be claimed again (the insert's
    /// parameters, and `$8 tombstone ms`) → the new epoch, the expiry, and
    /// whether the attempt it replaced may have reached the upstream.
    pub claim_takeover: String,
    pub select_one: String,
    pub select_by_route_key: String,
    /// `$1` rows at most: the records still uncertain among the most
    /// recently logged ones (`migrations/*/0004_uncertain_log.sql`).
    pub select_uncertain: String,
    /// Forgets uncertain-log entries logged before `$1` (ms).
    pub trim_uncertain_log: String,
    /// `$1 route, $2 key`: a message's failed attempts and whether its
    /// dead-letter copy is stored.
    pub select_delivery: String,
    /// `$1 route, $2 key, $3 first`: counts a failed attempt (the first of
    /// a fresh delivery starts the count over) → the failures so far.
    pub count_delivery_failure: String,
    /// `$1 route, $2 key`: its dead-letter copy is stored (the copy lease
    /// ends with it).
    pub mark_dead_lettered: String,
    /// `$1 route, $2 key, $3 holder (a fresh id per claim, and the copy id
    /// of a first one), $4 lease ms`: takes the copy lease of a message not
    /// yet dead-lettered whose lease is free or lapsed → the copy id (the
    /// row's, once one was given); no row when the copy is stored or
    /// another instance holds the lease.
    pub claim_dead_letter: String,
    /// `$1 route, $2 key, $3 holder, $4 lease ms`: extends the holder's
    /// lease (its publish is not confirmed yet) → whether it still held it.
    pub renew_dead_letter: String,
    /// `$1 route, $2 key, $3 holder`: gives the copy lease back (its copy
    /// was refused).
    pub release_dead_letter: String,
    /// Forgets delivery rows untouched since `$1` (ms).
    pub trim_deliveries: String,
    /// `$1..$3` key, `$4 epoch, $5 status, $6 headers, $7 body, $8
    /// body_kept, $9 request id` → the retention left, in ms, and whether a
    /// duplicate is waiting.
    #[cfg_attr(not(any(test, feature = "testing")), allow(dead_code))]
    pub complete: String,
    /// Postgres only: many completions over arrays `$1..$9`.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub complete_many: String,
    /// [`Self::complete`] for an `uncertain` record whose upstream said the
    /// action ran (reconciliation), fenced by the uncertain epoch.
    pub complete_reconciled: String,
    /// `$1..$3` key, `$4 epoch, $5 state, $6 ms` the record may not be
    /// taken over for (an uncertain record's hold; 0 for a release), `$7
    /// tombstone ms` → whether a duplicate is waiting.
    pub set_state: String,
    /// `$1..$3` key: a duplicate waits for this in-flight record (the
    /// statement that settles it then says so).
    pub mark_watched: String,
    /// `$1..$3` key, `$4 epoch, $5 lease ms, $6 tombstone ms`.
    pub renew: String,
    /// `$1..$3` key: deletes unless held under a live lease.
    pub purge_one: String,
    /// `$1 route, $2 key`, every scope: deletes unless held.
    pub purge_all_scopes: String,
    /// `$1 route, $2 key, $3 scope (NULL: all)`: logs a purge.
    pub log_purge: String,
    /// Purges logged after id `$1`, oldest first.
    pub purges_since: String,
    /// The newest purge id (0 when none).
    pub last_purge: String,
    /// Forgets purges older than `$1` ms.
    pub trim_purges: String,
    /// `$1 tombstone ms`: forgotten rows (retention and tombstone over),
    /// [`SWEEP_BATCH`] at most. The batch is written into the text, not
    /// bound: a generic plan (Postgres's, `sql.rs`) takes a bound LIMIT for
    /// a tenth of the table. On Postgres, `{table}` is the partition swept
    /// row by row (one a live lease still holds).
    pub sweep_delete: String,
    /// Postgres: move forgotten rows (`$1 tombstone ms`) of the partition
    /// `{table}` to the archive in one statement.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub sweep_archive_pg: String,
    /// SQLite: copy the rows forgotten at time `$1` (`$2 tombstone ms`;
    /// then `sweep_delete_at` with the same `$1`, in one transaction: both
    /// must see the same rows, so the time is read once and bound).
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub sweep_archive_copy_sqlite: String,
    /// `sweep_delete` with the time bound as `$1`, `$2 tombstone ms`.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub sweep_delete_at: String,
    /// Tombstones: drops the stored answer of a batch of rows whose
    /// retention ended at or after `$1` and by `$2` (the database's now,
    /// read before) → their expiries. Only the fingerprint is kept (rows
    /// already stripped no longer match, so a watermark may repeat).
    pub strip_expired: String,
    /// The database's clock.
    pub now: String,
}

/// Postgres's clock, in milliseconds; `clock_timestamp()` is the time the
/// expression runs (after any lock wait), not the transaction's start.
#[cfg(feature = "postgres")]
pub(crate) const PG_NOW: &str = "(extract(epoch from clock_timestamp()) * 1000)::bigint";
#[cfg(feature = "postgres")]
const PG_EPOCH: &str = "(extract(epoch from clock_timestamp()) * 1000000)::bigint";
#[cfg(feature = "sqlite")]
pub(crate) const SQLITE_NOW: &str = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)";
#[cfg(feature = "sqlite")]
const SQLITE_EPOCH: &str = "CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER)";

#[cfg(feature = "postgres")]
pub(super) static POSTGRES: LazyLock<Statements> = LazyLock::new(|| {
    // The record table is partitioned by expiry: a row inserted anywhere
    // goes through the functions of `migrations/postgres/0006_partitions.sql`,
    // which keep one row per key across partitions.
    Statements {
        claim_insert: "SELECT epoch, expires_at FROM idempotency_claim(ARRAY[$1::text], \
             ARRAY[$2::text], ARRAY[$3::text], ARRAY[$4::text], $5::int8, ARRAY[$6::text], $7::int8)"
            .to_owned(),
        claim_insert_many: "SELECT scope, route, idem_key, epoch, expires_at FROM idempotency_claim(\
             $1::text[], $2::text[], $3::text[], $4::text[], $5::int8, $6::text[], $7::int8)"
            .to_owned(),
        claim_takeover: "SELECT epoch, expires_at, maybe_ran FROM idempotency_take_over(\
             $1::text, $2::text, $3::text, $4::text, $5::int8, $6::text, $7::int8, $8::int8)"
            .to_owned(),
        ..Statements::with_clock(PG_NOW, PG_EPOCH)
    }
});
#[cfg(feature = "sqlite")]
pub(super) static SQLITE: LazyLock<Statements> = LazyLock::new(|| {
    let mut sqlite = Statements::with_clock(SQLITE_NOW, SQLITE_EPOCH);
    sqlite.sweep_delete = sqlite
        .sweep_delete
        .replace("{table}", "idempotency_records");
    sqlite
});

const COLUMNS: &str = "fingerprint, state, epoch, lease_until, request_id, status, headers, body, \
     body_kept, created_at, updated_at, expires_at, scope, route, idem_key";

// A row is forgotten (swept, free for any request) once its retention and
// its tombstone are over, unless it is still held: under a live lease, or
// uncertain within its hold (a copy may still run at the upstream; deleting
// the row would let a retry be forwarded beside it). The condition is
// repeated in the outer statement so that Postgres re-checks it on a row a
// concurrent takeover just renewed.
const SWEEPABLE: &str = "expires_at + {tomb} <= {now} AND NOT (state IN ('in_flight', 'uncertain') \
     AND lease_until > {now})";

/// Purges spare the same records the sweeper does.
const NOT_HELD: &str = "NOT (state IN ('in_flight', 'uncertain') AND lease_until > {now})";

/// A holder may renew its lease, or put an uncertain hold on its record,
/// only while the lease is live or the record is not yet forgotten
/// (retention and tombstone over): the sweeper may be about to retire a
/// forgotten record with the rest of its partition, having found nothing
/// held there, and it must not become held behind the sweeper's back. The
/// start-up checks already keep every attempt (and so every renewal and
/// mark) within the retention of its claim; this is the second line.
/// A release puts no hold on a record and is never refused by it.
const NOT_FORGOTTEN: &str = "(lease_until > {now} OR expires_at + {tomb} > {now})";

/// A consumed message's dead-letter copy is being made: its lease is live
/// (a NULL lease is none).
const COPYING: &str = "(idempotency_deliveries.copying_until IS NOT NULL \
     AND idempotency_deliveries.copying_until > {now})";

impl Statements {
    /// Every statement's text, with this database's clock. Long by design:
    /// a table, one field per statement, written once for every database
    /// so that the statements that must agree on one schema stand side by
    /// side.
    fn with_clock(now: &str, epoch: &str) -> Statements {
        // For statements that must agree on one instant: the time is `$1`,
        // the tombstone `$2`.
        let fill_at = |text: &str| {
            text.replace("{sweepable}", SWEEPABLE)
                .replace("{tomb}", "$2")
                .replace("{now}", "$1")
                .replace("{batch}", &SWEEP_BATCH.to_string())
        };
        let fill = |text: &str| {
            text.replace("{sweepable}", SWEEPABLE)
                .replace("{not_held}", NOT_HELD)
                .replace("{copying}", COPYING)
                .replace("{columns}", COLUMNS)
                .replace("{now}", now)
                .replace("{epoch}", epoch)
                .replace("{batch}", &SWEEP_BATCH.to_string())
        };
        // The tombstone is a parameter; which one each statement says.
        let fill_tomb = |text: &str, tomb: &str| {
            fill(
                &text
                    .replace("{sweepable}", SWEEPABLE)
                    .replace("{not_forgotten}", NOT_FORGOTTEN)
                    .replace("{tomb}", tomb),
            )
        };
        Statements {
            // Postgres only, through its claim function (`POSTGRES`); SQLite
            // writes every claim as a batch (`sqlite_claim_rows`).
            claim_insert: String::new(),
            // Postgres only, through its claim function (`POSTGRES`).
            claim_insert_many: String::new(),
            // Forgotten (retention and tombstone over) and released records
            // take any fingerprint (the key is free again); within
            // retention, an uncertain record whose hold is over and a
            // lease-expired one only the same request. A record past its
            // retention but within its tombstone is not taken (410, 422).
            // `maybe_ran` is set from the state replaced (SET reads the old
            // row): an uncertain or lease-expired attempt may have acted.
            claim_takeover: fill_tomb(
                "UPDATE idempotency_records SET \
                 epoch = epoch + 1, state = 'in_flight', fingerprint = $4, \
                 lease_until = {now} + $5, request_id = $6, \
                 maybe_ran = CASE WHEN state IN ('uncertain', 'in_flight') \
                             AND expires_at > {now} THEN TRUE ELSE FALSE END, \
                 watched = FALSE, \
                 created_at = CASE WHEN expires_at + {tomb} <= {now} OR state = 'released' \
                              THEN {now} ELSE created_at END, \
                 updated_at = {now}, expires_at = {now} + $7, \
                 status = NULL, headers = NULL, body = NULL, body_kept = FALSE \
                 WHERE scope = $1 AND route = $2 AND idem_key = $3 AND ( \
                   ({sweepable}) OR state = 'released' \
                   OR (fingerprint = $4 AND expires_at > {now} \
                       AND state IN ('uncertain', 'in_flight') AND lease_until <= {now}) \
                 ) RETURNING epoch, expires_at, maybe_ran",
                "$8",
            ),
            select_one: fill(
                "SELECT {columns}, {now} FROM idempotency_records \
                 WHERE scope = $1 AND route = $2 AND idem_key = $3",
            ),
            select_uncertain: fill(
                "SELECT {columns}, {now} FROM idempotency_records \
                 WHERE state = 'uncertain' AND (route, idem_key, scope) IN ( \
                   SELECT route, idem_key, scope FROM idempotency_uncertain \
                   ORDER BY id DESC LIMIT $1) \
                 ORDER BY updated_at DESC",
            ),
            trim_uncertain_log: "DELETE FROM idempotency_uncertain WHERE marked_at < $1".to_owned(),
            select_delivery: "SELECT failures, dead_letter FROM idempotency_deliveries \
                 WHERE route = $1 AND idem_key = $2"
                .to_owned(),
            count_delivery_failure: fill(
                "INSERT INTO idempotency_deliveries (route, idem_key, failures, dead_letter, updated_at) \
                 VALUES ($1, $2, 1, FALSE, {now}) \
                 ON CONFLICT (route, idem_key) DO UPDATE SET \
                   failures = CASE WHEN $3 THEN 1 ELSE idempotency_deliveries.failures + 1 END, \
                   dead_letter = CASE WHEN $3 THEN FALSE ELSE idempotency_deliveries.dead_letter END, \
                   copy_id = CASE WHEN $3 AND NOT {copying} THEN NULL \
                     ELSE idempotency_deliveries.copy_id END, \
                   copying_until = CASE WHEN $3 AND NOT {copying} THEN NULL \
                     ELSE idempotency_deliveries.copying_until END, \
                   updated_at = {now} \
                 RETURNING failures",
            ),
            mark_dead_lettered: fill(
                "INSERT INTO idempotency_deliveries (route, idem_key, failures, dead_letter, updated_at) \
                 VALUES ($1, $2, 0, TRUE, {now}) \
                 ON CONFLICT (route, idem_key) DO UPDATE SET dead_letter = TRUE, \
                   copying_until = NULL, updated_at = {now}",
            ),
            claim_dead_letter: fill(
                "INSERT INTO idempotency_deliveries \
                   (route, idem_key, failures, dead_letter, updated_at, copy_id, copy_holder, \
                    copying_until) \
                 VALUES ($1, $2, 0, FALSE, {now}, $3, $3, {now} + $4) \
                 ON CONFLICT (route, idem_key) DO UPDATE SET \
                   copy_id = COALESCE(idempotency_deliveries.copy_id, $3), \
                   copy_holder = $3, copying_until = {now} + $4, updated_at = {now} \
                 WHERE NOT idempotency_deliveries.dead_letter AND NOT {copying} \
                 RETURNING copy_id",
            ),
            renew_dead_letter: fill(
                "UPDATE idempotency_deliveries SET copying_until = {now} + $4 \
                 WHERE route = $1 AND idem_key = $2 AND copy_holder = $3 AND NOT dead_letter \
                   AND copying_until IS NOT NULL",
            ),
            release_dead_letter: "UPDATE idempotency_deliveries SET copying_until = NULL \
                 WHERE route = $1 AND idem_key = $2 AND copy_holder = $3 AND NOT dead_letter"
                .to_owned(),
            trim_deliveries: "DELETE FROM idempotency_deliveries WHERE updated_at < $1".to_owned(),
            select_by_route_key: fill(
                "SELECT {columns}, {now} FROM idempotency_records \
                 WHERE route = $1 AND idem_key = $2 ORDER BY scope",
            ),
            // Leaves every indexed column alone (HOT-eligible on Postgres):
            // retention counts from the claim.
            complete: fill(
                "UPDATE idempotency_records SET \
                 state = 'completed', status = $5, headers = $6, body = $7, body_kept = $8, \
                 request_id = $9, lease_until = 0, updated_at = {now} \
                 WHERE scope = $1 AND route = $2 AND idem_key = $3 AND epoch = $4 \
                   AND state = 'in_flight' \
                 RETURNING expires_at - {now}, watched",
            ),
            complete_reconciled: fill(
                "UPDATE idempotency_records SET \
                 state = 'completed', status = $5, headers = $6, body = $7, body_kept = $8, \
                 request_id = $9, lease_until = 0, updated_at = {now} \
                 WHERE scope = $1 AND route = $2 AND idem_key = $3 AND epoch = $4 \
                   AND state = 'uncertain' \
                 RETURNING expires_at - {now}, watched",
            ),
            // One round trip and one commit for a whole batch; each row
            // still needs its own epoch to match (fencing).
            complete_many: fill(
                "UPDATE idempotency_records AS r SET \
                 state = 'completed', status = v.status, headers = v.headers, body = v.body, \
                 body_kept = v.body_kept, request_id = v.request_id, lease_until = 0, \
                 updated_at = {now} \
                 FROM UNNEST($1::text[], $2::text[], $3::text[], $4::int8[], $5::int4[], \
                             $6::bytea[], $7::bytea[], $8::bool[], $9::text[]) \
                      AS v(scope, route, idem_key, epoch, status, headers, body, body_kept, \
                           request_id) \
                 WHERE r.scope = v.scope AND r.route = v.route AND r.idem_key = v.idem_key \
                   AND r.epoch = v.epoch AND r.state = 'in_flight' \
                 RETURNING r.scope, r.route, r.idem_key, r.epoch, r.expires_at - {now}, \
                           r.watched",
            ),
            set_state: fill_tomb(
                "UPDATE idempotency_records SET state = $5, \
                 lease_until = CASE WHEN $6 > 0 THEN {now} + $6 ELSE 0 END, updated_at = {now} \
                 WHERE scope = $1 AND route = $2 AND idem_key = $3 AND epoch = $4 \
                   AND state = 'in_flight' AND ($6 = 0 OR {not_forgotten}) \
                 RETURNING watched",
                "$7",
            ),
            mark_watched: fill(
                "UPDATE idempotency_records SET watched = TRUE \
                 WHERE scope = $1 AND route = $2 AND idem_key = $3 AND state = 'in_flight'",
            ),
            renew: fill_tomb(
                "UPDATE idempotency_records SET lease_until = {now} + $5 \
                 WHERE scope = $1 AND route = $2 AND idem_key = $3 AND epoch = $4 \
                   AND state = 'in_flight' AND {not_forgotten}",
                "$6",
            ),
            purge_one: fill(
                "DELETE FROM idempotency_records \
                 WHERE scope = $1 AND route = $2 AND idem_key = $3 AND {not_held}",
            ),
            purge_all_scopes: fill(
                "DELETE FROM idempotency_records WHERE route = $1 AND idem_key = $2 AND {not_held}",
            ),
            log_purge: fill(
                "INSERT INTO idempotency_purges (route, idem_key, scope, purged_at) \
                 VALUES ($1, $2, $3, {now})",
            ),
            purges_since: fill(
                "SELECT id, route, idem_key, scope FROM idempotency_purges \
                 WHERE id > $1 ORDER BY id LIMIT 1000",
            ),
            last_purge: fill("SELECT COALESCE(MAX(id), 0) FROM idempotency_purges"),
            trim_purges: fill("DELETE FROM idempotency_purges WHERE purged_at < {now} - $1"),
            sweep_delete: fill_tomb(
                "DELETE FROM {table} WHERE (route, idem_key, scope) IN ( \
                   SELECT route, idem_key, scope FROM {table} \
                   WHERE {sweepable} ORDER BY expires_at LIMIT {batch}) \
                 AND {sweepable}",
                "$1",
            ),
            sweep_archive_pg: fill_tomb(
                "WITH moved AS ( \
                   DELETE FROM {table} WHERE (route, idem_key, scope) IN ( \
                     SELECT route, idem_key, scope FROM {table} \
                     WHERE {sweepable} ORDER BY expires_at LIMIT {batch}) \
                   AND {sweepable} \
                   RETURNING scope, route, idem_key, fingerprint, state, epoch, request_id, \
                             status, headers, body, body_kept, created_at, updated_at, \
                             expires_at) \
                 INSERT INTO idempotency_archive (scope, route, idem_key, fingerprint, state, \
                   epoch, request_id, status, headers, body, body_kept, created_at, updated_at, \
                   expires_at, archived_at) \
                 SELECT scope, route, idem_key, fingerprint, state, epoch, request_id, status, \
                        headers, body, body_kept, created_at, updated_at, expires_at, {now} \
                 FROM moved",
                "$1",
            ),
            sweep_delete_at: fill_at(
                "DELETE FROM idempotency_records WHERE (route, idem_key, scope) IN ( \
                   SELECT route, idem_key, scope FROM idempotency_records \
                   WHERE {sweepable} ORDER BY expires_at LIMIT {batch}) \
                 AND {sweepable}",
            ),
            now: fill("SELECT {now}"),
            strip_expired: fill(
                "UPDATE idempotency_records SET headers = NULL, body = NULL \
                 WHERE (route, idem_key, scope) IN ( \
                   SELECT route, idem_key, scope FROM idempotency_records \
                   WHERE expires_at >= $1 AND expires_at <= $2 AND body IS NOT NULL \
                     AND NOT (state IN ('in_flight', 'uncertain') AND lease_until > $2) \
                   ORDER BY expires_at LIMIT {batch}) \
                 RETURNING expires_at",
            ),
            sweep_archive_copy_sqlite: fill_at(
                "INSERT INTO idempotency_archive (scope, route, idem_key, fingerprint, state, \
                   epoch, request_id, status, headers, body, body_kept, created_at, updated_at, \
                   expires_at, archived_at) \
                 SELECT scope, route, idem_key, fingerprint, state, epoch, request_id, status, \
                        headers, body, body_kept, created_at, updated_at, expires_at, {now} \
                 FROM idempotency_records WHERE (route, idem_key, scope) IN ( \
                   SELECT route, idem_key, scope FROM idempotency_records \
                   WHERE {sweepable} ORDER BY expires_at LIMIT {batch})",
            ),
        }
    }
}

/// Rows per statement of SQLite's batched writes. A batch is written as a
/// few multi-row statements of these sizes (largest first) rather than one
/// statement per row: each statement is a round trip to the connection's
/// thread, and those round trips, not the database, bounded a batch
/// (`loadtest/README.md`, first requests). A handful of sizes keeps the
/// statement cache to a handful of texts.
#[cfg(feature = "sqlite")]
pub(super) const SQLITE_ROWS: [usize; 4] = [64, 16, 4, 1];

/// SQLite: claims of `rows` fresh keys in one statement. `?1 lease ms, ?2
/// retention ms`, then per row `scope, route, key, fingerprint, request
/// id` → the keys inserted, their epochs and expiries (a key already held,
/// or twice in the statement, returns no row for the later one).
#[cfg(feature = "sqlite")]
pub(super) fn sqlite_claim_rows(rows: usize) -> String {
    let values: Vec<String> = (0..rows)
        .map(|r| {
            let p = 3 + 5 * r;
            format!(
                "(?{}, ?{}, ?{}, ?{}, 'in_flight', {SQLITE_EPOCH}, {SQLITE_NOW} + ?1, ?{}, \
                 {SQLITE_NOW}, {SQLITE_NOW}, {SQLITE_NOW} + ?2, FALSE)",
                p,
                p + 1,
                p + 2,
                p + 3,
                p + 4
            )
        })
        .collect();
    format!(
        "INSERT INTO idempotency_records \
         (scope, route, idem_key, fingerprint, state, epoch, lease_until, request_id, \
          created_at, updated_at, expires_at, body_kept) VALUES {} \
         ON CONFLICT (route, idem_key, scope) DO NOTHING \
         RETURNING scope, route, idem_key, epoch, expires_at",
        values.join(", ")
    )
}

/// SQLite: [`Statements::complete`] for `rows` records in one statement;
/// per row `scope, route, key, epoch, status, headers, body, body_kept,
/// request id` → the keys completed, their epochs, the retention left (ms)
/// and whether a duplicate waits.
#[cfg(feature = "sqlite")]
pub(super) fn sqlite_complete_rows(rows: usize) -> String {
    let values: Vec<String> = (0..rows)
        .map(|r| {
            let p = 1 + 9 * r;
            let params: Vec<String> = (p..p + 9).map(|i| format!("?{i}")).collect();
            format!("({})", params.join(", "))
        })
        .collect();
    format!(
        "WITH v (scope, route, idem_key, epoch, status, headers, body, body_kept, request_id) \
         AS (VALUES {}) \
         UPDATE idempotency_records SET \
         state = 'completed', status = v.status, headers = v.headers, body = v.body, \
         body_kept = v.body_kept, request_id = v.request_id, lease_until = 0, \
         updated_at = {SQLITE_NOW} \
         FROM v WHERE idempotency_records.scope = v.scope \
           AND idempotency_records.route = v.route \
           AND idempotency_records.idem_key = v.idem_key \
           AND idempotency_records.epoch = v.epoch \
           AND idempotency_records.state = 'in_flight' \
         RETURNING idempotency_records.scope, idempotency_records.route, \
           idempotency_records.idem_key, idempotency_records.epoch, \
           idempotency_records.expires_at - {SQLITE_NOW}, idempotency_records.watched",
        values.join(", ")
    )
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;

    /// The numbered parameters a statement text uses, in order of their
    /// numbers (sqlx binds by position and does not check the count).
    fn parameters(text: &str) -> Vec<usize> {
        let mut found: Vec<usize> = text
            .split('?')
            .skip(1)
            .map(|rest| {
                let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                digits.parse().expect("a numbered parameter")
            })
            .collect();
        found.sort_unstable();
        found.dedup();
        found
    }

    #[test]
    fn every_multi_row_statement_numbers_exactly_the_parameters_bound() {
        for rows in SQLITE_ROWS {
            // Claims: lease and retention, then five per row.
            let claims = parameters(&sqlite_claim_rows(rows));
            assert_eq!(
                claims,
                (1..=2 + 5 * rows).collect::<Vec<_>>(),
                "{rows} rows"
            );
            // Completions: nine per row.
            let completions = parameters(&sqlite_complete_rows(rows));
            assert_eq!(
                completions,
                (1..=9 * rows).collect::<Vec<_>>(),
                "{rows} rows"
            );
        }
    }
}
