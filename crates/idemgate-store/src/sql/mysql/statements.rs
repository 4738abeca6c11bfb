//! The SQL text of every MySQL / MariaDB statement.
//!
//! Placeholders are `?`, bound in the order they appear: each statement's
//! doc says that order. The record key is bound `route, idem_key, scope`,
//! the primary key's order. Every lease and expiry is judged by the
//! database's clock (`{now}`, milliseconds since the Unix epoch), and a
//! fresh record's epoch is that clock in microseconds (`{epoch}`), as in
//! every store (`sql/dollar/statements.rs`).
//!
//! Text columns are stored as bytes (compared as bytes) and read through
//! `CONVERT(… USING utf8mb4)`: the driver decodes a `String` only from a
//! column that has a character set.

use std::sync::LazyLock;

use crate::sql::SWEEP_BATCH;

/// The database's clock in microseconds. `UTC_TIMESTAMP(6)` keeps one value
/// for a whole statement (every comparison in it agrees) and, unlike
/// `UNIX_TIMESTAMP`, has no 2038 limit on MariaDB and reads no time zone.
const EPOCH: &str = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))";

/// The database's clock in milliseconds, an integer (`DIV`): every
/// expression built on it stays a `BIGINT`.
const NOW: &str = "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)";

/// The record key, in the primary key's order.
pub(super) const KEY_IS: &str = "route = ? AND idem_key = ? AND scope = ?";

/// A record still held: under a live lease, or uncertain within its hold.
const HELD: &str = "(state IN ('in_flight', 'uncertain') AND lease_until > {now})";

/// A record's columns as [`crate::sql::rows::RawRecord::read`] takes them
/// (the read's `{now}` follows).
const COLUMNS: &str = "CONVERT(fingerprint USING utf8mb4), state, epoch, lease_until, \
     CONVERT(request_id USING utf8mb4), status, headers, body, body_kept, created_at, \
     updated_at, expires_at, CONVERT(scope USING utf8mb4), CONVERT(route USING utf8mb4), \
     CONVERT(idem_key USING utf8mb4)";

/// The record key of a returned row.
pub(super) const KEY_COLUMNS: &str = "CONVERT(route USING utf8mb4), \
     CONVERT(idem_key USING utf8mb4), CONVERT(scope USING utf8mb4)";

fn fill(text: &str) -> String {
    text.replace("{held}", HELD)
        .replace("{columns}", COLUMNS)
        .replace("{key_columns}", KEY_COLUMNS)
        .replace("{key}", KEY_IS)
        .replace("{now}", NOW)
        .replace("{epoch}", EPOCH)
        .replace("{batch}", &SWEEP_BATCH.to_string())
}

/// Statements built once, on first use.
macro_rules! statement {
    ($(#[$doc:meta])* $name:ident = $text:expr) => {
        $(#[$doc])*
        pub(super) static $name: LazyLock<String> = LazyLock::new(|| fill($text));
    };
}

/// Rows per statement of the batched claims and completions: a batch is
/// cut into runs of these sizes (largest first), so that the connection's
/// statement cache holds a handful of texts.
pub(super) const ROWS: [usize; 4] = [64, 16, 4, 1];

/// Claims of `rows` fresh keys: per row `route, key, scope, fingerprint,
/// lease ms, request id, retention ms, token`. A key already present is
/// left untouched (and keeps its own token).
pub(super) fn claim_rows(rows: usize) -> String {
    let row =
        fill("(?, ?, ?, ?, 'in_flight', {epoch}, {now} + ?, ?, {now}, {now}, {now} + ?, FALSE, ?)");
    format!(
        "INSERT INTO idempotency_records (route, idem_key, scope, fingerprint, state, epoch, \
         lease_until, request_id, created_at, updated_at, expires_at, body_kept, claim_token) \
         VALUES {} ON DUPLICATE KEY UPDATE claim_token = claim_token",
        vec![row; rows].join(", ")
    )
}

/// Which of `rows` keys carry a token: `token`, then per row the key →
/// each such row's key, epoch and expiry.
pub(super) fn claimed_rows(rows: usize) -> String {
    format!(
        "SELECT {KEY_COLUMNS}, epoch, expires_at FROM idempotency_records \
         WHERE claim_token = ? AND ({})",
        keys_are(rows)
    )
}

/// `rows` record keys, each bound `route, key, scope`: an OR of primary
/// key lookups, which both servers answer from the primary key.
pub(super) fn keys_are(rows: usize) -> String {
    vec![format!("({KEY_IS})"); rows].join(" OR ")
}

/// Completions of `rows` records: per row `route, key, scope, epoch,
/// status, headers, body, body_kept, request id`. Each row is fenced by
/// its epoch.
pub(super) fn complete_rows(rows: usize) -> String {
    let first = "SELECT CAST(? AS BINARY) AS route, CAST(? AS BINARY) AS idem_key, \
         CAST(? AS BINARY) AS scope, CAST(? AS SIGNED) AS epoch, CAST(? AS SIGNED) AS status, \
         ? AS headers, ? AS body, ? AS body_kept, ? AS request_id";
    let more = " UNION ALL SELECT CAST(? AS BINARY), CAST(? AS BINARY), CAST(? AS BINARY), \
         CAST(? AS SIGNED), CAST(? AS SIGNED), ?, ?, ?, ?";
    fill(&format!(
        "UPDATE idempotency_records AS r JOIN ({first}{}) AS v \
           ON r.route = v.route AND r.idem_key = v.idem_key AND r.scope = v.scope \
           AND r.epoch = v.epoch \
         SET r.state = 'completed', r.status = v.status, r.headers = v.headers, \
           r.body = v.body, r.body_kept = v.body_kept, r.request_id = v.request_id, \
           r.lease_until = 0, r.updated_at = {{now}} \
         WHERE r.state = 'in_flight'",
        more.repeat(rows - 1)
    ))
}

/// What completions of `rows` keys left: per row the key → each row's key,
/// epoch, state, retention left (ms) and whether a duplicate waits.
pub(super) fn completed_rows(rows: usize) -> String {
    fill(&format!(
        "SELECT {{key_columns}}, epoch, state, expires_at - {{now}}, watched \
         FROM idempotency_records WHERE {}",
        keys_are(rows)
    ))
}

statement! {
    /// Takes over a record that may be claimed again: `tombstone ms,
    /// token, fingerprint, lease ms, request id, retention ms`, the key,
    /// `tombstone ms, fingerprint`. Forgotten (retention and tombstone
    /// over) and released records take any fingerprint; within retention,
    /// an uncertain record whose hold is over and a lease-expired one only
    /// the same request. The assignments run left to right, each seeing
    /// the ones before: `maybe_ran` and `created_at` read the row as it
    /// was, before `state` and `expires_at` change.
    TAKEOVER = "UPDATE idempotency_records SET \
         maybe_ran = (state IN ('uncertain', 'in_flight') AND expires_at > {now}), \
         created_at = IF(expires_at + ? <= {now} OR state = 'released', {now}, created_at), \
         claim_token = ?, epoch = epoch + 1, state = 'in_flight', fingerprint = ?, \
         lease_until = {now} + ?, request_id = ?, watched = FALSE, updated_at = {now}, \
         expires_at = {now} + ?, status = NULL, headers = NULL, body = NULL, body_kept = FALSE \
         WHERE {key} AND ( \
           (expires_at + ? <= {now} AND NOT {held}) OR state = 'released' \
           OR (fingerprint = ? AND expires_at > {now} \
               AND state IN ('uncertain', 'in_flight') AND lease_until <= {now}))"
}

statement! {
    /// The claim a takeover made: the key, `token` → epoch, expiry, and
    /// whether the attempt it replaced may have acted.
    TAKEN = "SELECT epoch, expires_at, maybe_ran FROM idempotency_records \
         WHERE {key} AND claim_token = ?"
}

statement! {
    /// One record: the key.
    SELECT_ONE = "SELECT {columns}, {now} FROM idempotency_records WHERE {key}"
}

statement! {
    /// Every scope's record: `route, key`.
    SELECT_BY_ROUTE_KEY = "SELECT {columns}, {now} FROM idempotency_records \
         WHERE route = ? AND idem_key = ? ORDER BY scope"
}

statement! {
    /// The records still uncertain among the `limit` most recently logged.
    SELECT_UNCERTAIN = "SELECT {columns}, {now} FROM idempotency_records AS r JOIN ( \
           SELECT DISTINCT route AS u_route, idem_key AS u_key, scope AS u_scope FROM ( \
             SELECT route, idem_key, scope FROM idempotency_uncertain ORDER BY id DESC LIMIT ? \
           ) AS recent) AS u \
         ON r.route = u.u_route AND r.idem_key = u.u_key AND r.scope = u.u_scope \
         WHERE r.state = 'uncertain' ORDER BY r.updated_at DESC"
}

statement! {
    /// Stores an outcome: `status, headers, body, body_kept, request id`,
    /// the key, `epoch`.
    #[cfg(any(test, feature = "testing"))]
    COMPLETE = "UPDATE idempotency_records SET state = 'completed', status = ?, headers = ?, \
         body = ?, body_kept = ?, request_id = ?, lease_until = 0, updated_at = {now} \
         WHERE {key} AND epoch = ? AND state = 'in_flight'"
}

statement! {
    /// [`COMPLETE`] for an `uncertain` record that reconciliation found
    /// acted, fenced by the uncertain epoch.
    COMPLETE_RECONCILED = "UPDATE idempotency_records SET state = 'completed', status = ?, \
         headers = ?, body = ?, body_kept = ?, request_id = ?, lease_until = 0, \
         updated_at = {now} \
         WHERE {key} AND epoch = ? AND state = 'uncertain'"
}

statement! {
    /// What a fenced write left: the key, `epoch` → retention left (ms),
    /// whether a duplicate waits.
    SETTLED = "SELECT expires_at - {now}, watched FROM idempotency_records \
         WHERE {key} AND epoch = ?"
}

statement! {
    /// Releases or marks uncertain: `hold ms, hold ms, state`, the key,
    /// `epoch, hold ms, tombstone ms`. A hold is put only on a record not
    /// yet forgotten (see `sql/dollar/statements.rs`, `NOT_FORGOTTEN`).
    SET_STATE = "UPDATE idempotency_records SET \
         lease_until = IF(? > 0, {now} + ?, 0), state = ?, updated_at = {now} \
         WHERE {key} AND epoch = ? AND state = 'in_flight' \
           AND (? = 0 OR lease_until > {now} OR expires_at + ? > {now})"
}

statement! {
    /// Logs a record marked uncertain: the key, `epoch`.
    LOG_UNCERTAIN = "INSERT INTO idempotency_uncertain (route, idem_key, scope, epoch, marked_at) \
         VALUES (?, ?, ?, ?, {now})"
}

statement! {
    /// A duplicate waits for this in-flight record: the key.
    MARK_WATCHED = "UPDATE idempotency_records SET watched = TRUE \
         WHERE {key} AND state = 'in_flight'"
}

statement! {
    /// Extends a lease: `lease ms`, the key, `epoch, tombstone ms`.
    RENEW = "UPDATE idempotency_records SET lease_until = {now} + ? \
         WHERE {key} AND epoch = ? AND state = 'in_flight' \
           AND (lease_until > {now} OR expires_at + ? > {now})"
}

statement! {
    /// Deletes one record unless held: the key.
    PURGE_ONE = "DELETE FROM idempotency_records WHERE {key} AND NOT {held}"
}

statement! {
    /// Deletes a key in every scope unless held: `route, key`.
    PURGE_ALL_SCOPES = "DELETE FROM idempotency_records \
         WHERE route = ? AND idem_key = ? AND NOT {held}"
}

statement! {
    /// Logs a purge: `route, key, scope (NULL: all)`.
    LOG_PURGE = "INSERT INTO idempotency_purges (route, idem_key, scope, purged_at) \
         VALUES (?, ?, ?, {now})"
}

statement! {
    /// Purges logged after id `last`, oldest first.
    PURGES_SINCE = "SELECT id, CONVERT(route USING utf8mb4), CONVERT(idem_key USING utf8mb4), \
         CONVERT(scope USING utf8mb4) FROM idempotency_purges WHERE id > ? ORDER BY id LIMIT 1000"
}

/// The newest purge id (0 when none).
pub(super) const LAST_PURGE: &str = "SELECT COALESCE(MAX(id), 0) FROM idempotency_purges";

statement! {
    /// Forgets purges older than `age ms`.
    TRIM_PURGES = "DELETE FROM idempotency_purges WHERE purged_at < {now} - ?"
}

statement! {
    /// A message's failed attempts and whether its copy is stored: `route, key`.
    SELECT_DELIVERY = "SELECT CAST(failures AS SIGNED), dead_letter FROM idempotency_deliveries \
         WHERE route = ? AND idem_key = ?"
}

statement! {
    /// Counts a failed attempt: `route, key, first ×4` (a fresh delivery
    /// starts the count over and frees a lapsed copy lease).
    COUNT_DELIVERY_FAILURE = "INSERT INTO idempotency_deliveries \
           (route, idem_key, failures, dead_letter, updated_at) VALUES (?, ?, 1, FALSE, {now}) \
         ON DUPLICATE KEY UPDATE failures = IF(?, 1, failures + 1), \
           dead_letter = IF(?, FALSE, dead_letter), \
           copy_id = IF(? AND NOT (copying_until IS NOT NULL AND copying_until > {now}), \
             NULL, copy_id), \
           copying_until = IF(? AND NOT (copying_until IS NOT NULL AND copying_until > {now}), \
             NULL, copying_until), \
           updated_at = {now}"
}

statement! {
    /// The copy is stored (its lease ends with it): `route, key`.
    MARK_DEAD_LETTERED = "INSERT INTO idempotency_deliveries \
           (route, idem_key, failures, dead_letter, updated_at) VALUES (?, ?, 0, TRUE, {now}) \
         ON DUPLICATE KEY UPDATE dead_letter = TRUE, copying_until = NULL, updated_at = {now}"
}

statement! {
    /// Takes the copy lease of a message not yet dead-lettered whose lease
    /// is free or lapsed: `route, key, holder, holder, lease ms, holder,
    /// holder, lease ms`. `copying_until`, which the condition reads, is
    /// assigned last.
    CLAIM_DEAD_LETTER = "INSERT INTO idempotency_deliveries \
           (route, idem_key, failures, dead_letter, updated_at, copy_id, copy_holder, \
            copying_until) VALUES (?, ?, 0, FALSE, {now}, ?, ?, {now} + ?) \
         ON DUPLICATE KEY UPDATE \
           copy_id = IF(NOT dead_letter AND NOT (copying_until IS NOT NULL \
             AND copying_until > {now}), COALESCE(copy_id, ?), copy_id), \
           copy_holder = IF(NOT dead_letter AND NOT (copying_until IS NOT NULL \
             AND copying_until > {now}), ?, copy_holder), \
           updated_at = {now}, \
           copying_until = IF(NOT dead_letter AND NOT (copying_until IS NOT NULL \
             AND copying_until > {now}), {now} + ?, copying_until)"
}

statement! {
    /// Who holds a message's copy lease: `route, key` → copy id, holder,
    /// whether the copy is stored.
    DEAD_LETTER_HOLDER = "SELECT CONVERT(copy_id USING utf8mb4), \
         CONVERT(copy_holder USING utf8mb4), dead_letter FROM idempotency_deliveries \
         WHERE route = ? AND idem_key = ?"
}

statement! {
    /// Extends the holder's copy lease: `lease ms, route, key, holder`.
    RENEW_DEAD_LETTER = "UPDATE idempotency_deliveries SET copying_until = {now} + ? \
         WHERE route = ? AND idem_key = ? AND copy_holder = ? AND NOT dead_letter \
           AND copying_until IS NOT NULL"
}

/// Gives the copy lease back: `route, key, holder`.
pub(super) const RELEASE_DEAD_LETTER: &str = "UPDATE idempotency_deliveries \
     SET copying_until = NULL \
     WHERE route = ? AND idem_key = ? AND copy_holder = ? AND NOT dead_letter";

/// Forgets delivery rows untouched since `ms`.
pub(super) const TRIM_DELIVERIES: &str = "DELETE FROM idempotency_deliveries WHERE updated_at < ?";

/// Forgets uncertain-log entries logged before `ms`.
pub(super) const TRIM_UNCERTAIN_LOG: &str = "DELETE FROM idempotency_uncertain WHERE marked_at < ?";

statement! {
    /// The database's clock.
    NOW_MS = "SELECT {now}"
}

/// Forgotten rows (retention and tombstone over, not held) at `now`, at
/// most a batch, oldest first: `now, tombstone ms, now`. The expiry is
/// compared bare, so the expiry index finds them.
const FORGOTTEN_AT: &str = "expires_at <= ? - ? AND NOT (state IN ('in_flight', 'uncertain') \
     AND lease_until > ?)";

statement! {
    /// Deletes a batch of forgotten rows: `now, tombstone ms, now`.
    SWEEP_DELETE = &format!(
        "DELETE FROM idempotency_records WHERE {FORGOTTEN_AT} ORDER BY expires_at LIMIT {{batch}}"
    )
}

statement! {
    /// Locks a batch of forgotten rows to archive: `now, tombstone ms, now`
    /// → their keys.
    SWEEP_LOCK = &format!(
        "SELECT {{key_columns}} FROM idempotency_records WHERE {FORGOTTEN_AT} \
         ORDER BY expires_at LIMIT {{batch}} FOR UPDATE"
    )
}

/// Copies `rows` locked rows to the archive: `now`, then per row the key.
pub(super) fn archive_rows(rows: usize) -> String {
    format!(
        "INSERT INTO idempotency_archive (route, idem_key, scope, fingerprint, state, epoch, \
           request_id, status, headers, body, body_kept, created_at, updated_at, expires_at, \
           archived_at) \
         SELECT route, idem_key, scope, fingerprint, state, epoch, request_id, status, headers, \
           body, body_kept, created_at, updated_at, expires_at, ? \
         FROM idempotency_records WHERE {}",
        keys_are(rows)
    )
}

/// Deletes `rows` locked rows: per row the key.
pub(super) fn delete_rows(rows: usize) -> String {
    format!("DELETE FROM idempotency_records WHERE {}", keys_are(rows))
}

statement! {
    /// The newest expiry of a batch of tombstones still holding an answer:
    /// `from, now, now` → the batch's last expiry (NULL when none).
    STRIP_UNTIL = "SELECT MAX(expires_at) FROM ( \
           SELECT expires_at FROM idempotency_records \
           WHERE expires_at >= ? AND expires_at <= ? AND body IS NOT NULL \
             AND NOT (state IN ('in_flight', 'uncertain') AND lease_until > ?) \
           ORDER BY expires_at LIMIT {batch}) AS batch"
}

/// Drops the answers of tombstones expired from `from` to `until`: `from,
/// until, now`.
pub(super) const STRIP: &str = "UPDATE idempotency_records SET headers = NULL, body = NULL \
     WHERE expires_at >= ? AND expires_at <= ? AND body IS NOT NULL \
       AND NOT (state IN ('in_flight', 'uncertain') AND lease_until > ?)";

/// Rows in the record table.
#[cfg(any(test, feature = "testing"))]
pub(super) const COUNT_RECORDS: &str = "SELECT COUNT(*) FROM idempotency_records";

/// Rows in the archive.
#[cfg(any(test, feature = "testing"))]
pub(super) const COUNT_ARCHIVE: &str = "SELECT COUNT(*) FROM idempotency_archive";

/// The scope registry.
pub(super) const SCOPES: &str = "SELECT CONVERT(route USING utf8mb4), \
     CONVERT(records USING utf8mb4), CONVERT(scope USING utf8mb4) FROM idempotency_scopes";

statement! {
    /// Registers a namespace: `route, records, scope, records, scope`.
    REGISTER_SCOPE = "INSERT INTO idempotency_scopes (route, records, scope, updated_at) \
         VALUES (?, ?, ?, {now}) \
         ON DUPLICATE KEY UPDATE records = ?, scope = ?, updated_at = {now}"
}

/// Forgets a namespace: `route`.
pub(super) const FORGET_SCOPE: &str = "DELETE FROM idempotency_scopes WHERE route = ?";

statement! {
    /// A namespace's live records and when the last is forgotten: `tomb,
    /// tomb, route, tomb`.
    LIVE_IN_SCOPE = "SELECT COUNT(*), COALESCE(MAX(CASE WHEN lease_until > expires_at + ? \
           THEN lease_until ELSE expires_at + ? END), 0) \
         FROM idempotency_records WHERE route = ? AND (expires_at + ? > {now} OR {held})"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_multi_row_statement_has_its_rows_placeholders() {
        let count = |text: &str| text.matches('?').count();
        for rows in ROWS {
            assert_eq!(count(&claim_rows(rows)), 8 * rows, "{rows}");
            assert_eq!(count(&claimed_rows(rows)), 1 + 3 * rows, "{rows}");
            assert_eq!(count(&complete_rows(rows)), 9 * rows, "{rows}");
            assert_eq!(count(&completed_rows(rows)), 3 * rows, "{rows}");
        }
        assert_eq!(count(&TAKEOVER), 11);
        assert_eq!(count(&SET_STATE), 9);
        assert_eq!(count(&CLAIM_DEAD_LETTER), 8);
        assert_eq!(count(&COUNT_DELIVERY_FAILURE), 6);
        assert_eq!(count(&LIVE_IN_SCOPE), 4);
    }
}
