//! Many claims or completions per statement on MySQL: multi-row
//! statements in runs of [`statements::ROWS`](super::statements::ROWS),
//! each followed by a read of what it left (InnoDB has no `RETURNING`).
//!
//! Every statement runs in autocommit, and a batch that met a deadlock
//! halfway runs again whole, which repeats nothing: a batch of claims
//! carries one token for all its tries, so a row its first try inserted is
//! found as its own on the second; a completion is found done by its
//! epoch and state. Rows are written in key order, so that two batches
//! that share keys lock them in the same order.

use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::Duration;

use sqlx::Row;
use sqlx::mysql::MySqlConnection;

use super::records::{Query, bind_key};
use super::statements::{self as s, ROWS};
use super::{MysqlSql, claim_token};
use crate::codec::encode_fields;
use crate::held::HeldConnection;
use crate::record::millis;
use crate::sql::{Completion, NewClaim, left};
use crate::{RecordKey, StoreError};

/// One statement text per run size, largest first.
type ByRows = LazyLock<Vec<(usize, String)>>;

static CLAIM_ROWS: ByRows = LazyLock::new(|| ROWS.map(|n| (n, s::claim_rows(n))).to_vec());
static CLAIMED_ROWS: ByRows = LazyLock::new(|| ROWS.map(|n| (n, s::claimed_rows(n))).to_vec());
static COMPLETE_ROWS: ByRows = LazyLock::new(|| ROWS.map(|n| (n, s::complete_rows(n))).to_vec());
static COMPLETED_ROWS: ByRows = LazyLock::new(|| ROWS.map(|n| (n, s::completed_rows(n))).to_vec());

/// `jobs` cut into runs of the sizes in `statements` (largest first), each
/// with its statement text.
fn runs<'a, T>(
    statements: &'static [(usize, String)],
    mut jobs: &'a [T],
) -> Vec<(&'static str, &'a [T])> {
    let mut cut = Vec::new();
    for (size, text) in statements {
        while jobs.len() >= *size {
            let (run, rest) = jobs.split_at(*size);
            cut.push((text.as_str(), run));
            jobs = rest;
        }
    }
    cut
}

impl MysqlSql {
    /// The fresh-key half of a claim, for many keys at once: the epoch and
    /// expiry where this batch inserted the row (its token is on it). A key
    /// twice in one batch is claimed for its first job only.
    pub(crate) async fn insert_claims(
        &self,
        batch: &[NewClaim],
        _held: &HeldConnection,
    ) -> Result<Vec<Option<(i64, i64)>>, StoreError> {
        let mut seen = std::collections::HashSet::new();
        let fresh: Vec<bool> = batch.iter().map(|c| seen.insert(&c.key)).collect();
        let mut unique: Vec<&NewClaim> = batch
            .iter()
            .zip(&fresh)
            .filter_map(|(c, fresh)| fresh.then_some(c))
            .collect();
        unique.sort_by(|a, b| key_order(&a.key, &b.key));
        let token = claim_token();
        let runs = runs(&CLAIM_ROWS, &unique);
        let inserted = run!(self, "claim", |conn| insert_runs(conn, &runs, &token).await).await?;
        Ok(batch
            .iter()
            .zip(&fresh)
            .map(|(c, fresh)| fresh.then(|| inserted.get(&c.key).copied()).flatten())
            .collect())
    }

    /// Stores many outcomes at once; for each, the retention left and
    /// whether a duplicate waits, or `None` where its epoch no longer holds
    /// the claim. Each run is one fenced multi-row `UPDATE` and one read of
    /// the rows it touched.
    pub(crate) async fn complete_many(
        &self,
        batch: &[Completion],
        _held: &HeldConnection,
    ) -> Result<Vec<Option<(Duration, bool)>>, StoreError> {
        let mut sorted: Vec<&Completion> = batch.iter().collect();
        sorted.sort_by(|a, b| key_order(&a.key, &b.key));
        let encoded: Vec<(&Completion, Vec<u8>)> = sorted
            .into_iter()
            .map(|c| (c, encode_fields(&c.response)))
            .collect();
        let done = run!(self, "complete", |conn| {
            let mut done = HashMap::new();
            for (text, run) in runs(&COMPLETE_ROWS, &encoded) {
                let mut query = sqlx::query(text);
                for (c, headers) in run {
                    query = bind_key(query, &c.key)
                        .bind(c.epoch)
                        .bind(i32::from(c.response.status))
                        .bind(headers.as_slice())
                        .bind(c.response.body.as_ref())
                        .bind(c.response.body_kept)
                        .bind(&c.response.request_id);
                }
                query.execute(&mut *conn).await?;
                let read = texts_for(&COMPLETED_ROWS, run.len());
                let mut query = sqlx::query(read);
                for (c, _) in run {
                    query = bind_key(query, &c.key);
                }
                for row in query.fetch_all(&mut *conn).await? {
                    let state: String = row.try_get(4)?;
                    if state == "completed" {
                        let settled = (left(row.try_get(5)?), row.try_get::<bool, _>(6)?);
                        done.insert((returned_key(&row)?, row.try_get::<i64, _>(3)?), settled);
                    }
                }
            }
            Ok(done)
        })
        .await?;
        // By key and epoch: a row completed under another epoch is not
        // this completion's.
        Ok(batch
            .iter()
            .map(|c| done.get(&(c.key.clone(), c.epoch)).copied())
            .collect())
    }

    /// Claims and completions together are SQLite's; MySQL writes them
    /// apart.
    #[cfg(feature = "sqlite")]
    pub(crate) async fn write_many(
        &self,
        _batch: &[crate::sql::Write],
    ) -> Result<Vec<crate::sql::Written>, StoreError> {
        Err(StoreError::Unavailable {
            op: "write",
            cause: "claims and completions are written apart on MySQL".into(),
        })
    }
}

/// The rows `runs` inserts, each followed by the read of which rows carry
/// its token: the key → epoch and expiry of each row it inserted.
async fn insert_runs(
    conn: &mut MySqlConnection,
    runs: &[(&'static str, &[&NewClaim])],
    token: &[u8; 16],
) -> Result<HashMap<RecordKey, (i64, i64)>, sqlx::Error> {
    let mut inserted = HashMap::new();
    for (text, run) in runs {
        let mut query: Query<'_> = sqlx::query(*text);
        for c in run.iter() {
            query = bind_key(query, &c.key)
                .bind(&c.fingerprint)
                .bind(millis(c.lease))
                .bind(&c.request_id)
                .bind(millis(c.retention))
                .bind(&token[..]);
        }
        query.execute(&mut *conn).await?;
        let mut read = sqlx::query(texts_for(&CLAIMED_ROWS, run.len())).bind(&token[..]);
        for c in run.iter() {
            read = bind_key(read, &c.key);
        }
        for row in read.fetch_all(&mut *conn).await? {
            let won = (row.try_get::<i64, _>(3)?, row.try_get::<i64, _>(4)?);
            inserted.insert(returned_key(&row)?, won);
        }
    }
    Ok(inserted)
}

/// The text in `statements` for a run of `rows`.
fn texts_for(statements: &'static [(usize, String)], rows: usize) -> &'static str {
    statements
        .iter()
        .find(|(n, _)| *n == rows)
        .map(|(_, text)| text.as_str())
        .expect("a run is one of the sizes")
}

/// The record key of a row that starts with [`s::KEY_COLUMNS`].
fn returned_key(row: &sqlx::mysql::MySqlRow) -> Result<RecordKey, sqlx::Error> {
    Ok(RecordKey {
        route: row.try_get(0)?,
        key: row.try_get(1)?,
        scope: row.try_get(2)?,
    })
}

/// The primary key's order, as bytes.
fn key_order(a: &RecordKey, b: &RecordKey) -> std::cmp::Ordering {
    (a.route.as_bytes(), a.key.as_bytes(), a.scope.as_bytes()).cmp(&(
        b.route.as_bytes(),
        b.key.as_bytes(),
        b.scope.as_bytes(),
    ))
}
