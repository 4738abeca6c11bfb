//! Many claims or completions in one statement: a Postgres `UNNEST` over
//! one array per column, or one SQLite write transaction (one fsync) — see
//! [`crate::batch`] for who gathers the batches.

use std::borrow::Borrow;
use std::time::Duration;

use sqlx::Row;

#[cfg(feature = "sqlite")]
use super::statements::{SQLITE_ROWS, sqlite_claim_rows, sqlite_complete_rows};
use super::{DollarSql, Pool};
use crate::codec::encode_fields;
use crate::held::HeldConnection;
use crate::record::millis;
use crate::sql::{Completion, NewClaim, left};
#[cfg(feature = "sqlite")]
use crate::sql::{Write, Written};
use crate::{RecordKey, StoreError};

/// The single-claim statement (`claim_insert`) with one claim's
/// parameters bound (Postgres; SQLite writes even one claim as a batch).
#[cfg(feature = "postgres")]
macro_rules! bind_claim {
    ($statement:expr, $c:expr, $lease:expr, $retention:expr) => {
        sqlx::query($statement)
            .bind(&$c.key.scope)
            .bind(&$c.key.route)
            .bind(&$c.key.key)
            .bind(&$c.fingerprint)
            .bind($lease)
            .bind(&$c.request_id)
            .bind($retention)
    };
}

impl DollarSql {
    /// The fresh-key half of a claim, for many keys at once: one statement
    /// (Postgres: `idempotency_claim` over arrays) or one SQLite
    /// transaction of multi-row `INSERT … ON CONFLICT DO NOTHING` (one
    /// commit, a statement per run of `SQLITE_ROWS`). The epoch and expiry
    /// where the row was inserted, i.e. the claim was won. A key twice in one batch
    /// is inserted for its first job only; the second then meets the row
    /// like any duplicate.
    // `held` (and the lease and retention bound as parameters) only
    // Postgres reads. (Long by design: one arm per database's way of
    // inserting a batch.)
    #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
    pub(crate) async fn insert_claims(
        &self,
        batch: &[NewClaim],
        held: &HeldConnection,
    ) -> Result<Vec<Option<(i64, i64)>>, StoreError> {
        let Some(first) = batch.first() else {
            return Ok(Vec::new());
        };
        // One store, one lease and retention: the batch shares them.
        let (lease, retention) = (millis(first.lease), millis(first.retention));
        match &self.pool {
            #[cfg(feature = "postgres")]
            Pool::Postgres(pool) if batch.len() > 1 => {
                let (fresh, unique) = first_of_each_key(batch);
                let mut columns = PgClaimColumns::default();
                for c in unique {
                    columns.push(c);
                }
                let query = || {
                    sqlx::query(self.sql().claim_insert_many.as_str())
                        .bind(&columns.scope)
                        .bind(&columns.route)
                        .bind(&columns.key)
                        .bind(&columns.fingerprint)
                        .bind(lease)
                        .bind(&columns.request_id)
                        .bind(retention)
                };
                let inserted = self
                    .bounded(
                        "claim",
                        self.on_batch_connection(pool, held, async |conn| {
                            let rows = match query().fetch_all(&mut *conn).await {
                                Err(e) if super::partitions::no_partition(&e) => {
                                    self.extend_on(conn, first.retention).await?;
                                    query().fetch_all(&mut *conn).await?
                                }
                                rows => rows?,
                            };
                            rows.iter()
                                .map(|row| {
                                    let won =
                                        (row.try_get::<i64, _>(3)?, row.try_get::<i64, _>(4)?);
                                    Ok((returned_key(row)?, won))
                                })
                                .collect::<Result<std::collections::HashMap<_, _>, sqlx::Error>>()
                        }),
                    )
                    .await?;
                Ok(answer_claims(batch, &fresh, &inserted))
            }
            #[cfg(feature = "postgres")]
            Pool::Postgres(pool) => {
                let c = first;
                let statement = self.sql().claim_insert.as_str();
                let epoch = self
                    .bounded(
                        "claim",
                        self.on_batch_connection(pool, held, async |conn| {
                            let query = || bind_claim!(statement, c, lease, retention);
                            let row = match query().fetch_optional(&mut *conn).await {
                                Err(e) if super::partitions::no_partition(&e) => {
                                    self.extend_on(conn, c.retention).await?;
                                    query().fetch_optional(&mut *conn).await?
                                }
                                row => row?,
                            };
                            row.map(|row| {
                                Ok((row.try_get::<i64, _>(0)?, row.try_get::<i64, _>(1)?))
                            })
                            .transpose()
                        }),
                    )
                    .await?;
                Ok(vec![epoch])
            }
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(pool) => {
                // One write transaction, one fsync, a few statements for
                // the whole batch; a key twice in it is claimed for its
                // first job only.
                let (fresh, unique) = first_of_each_key(batch);
                let inserted = self
                    .sqlite_transaction(
                        pool,
                        "claim",
                        async |tx| sqlite_claims(tx, &unique).await,
                        |inserted| self.release_abandoned(&inserted),
                    )
                    .await?;
                Ok(answer_claims(batch, &fresh, &inserted))
            }
        }
    }

    /// Stores many outcomes at once (see [`crate::batch`]); for each, the
    /// retention left and whether a duplicate waits for it, or `None` where
    /// the epoch no longer holds the claim.
    #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
    pub(crate) async fn complete_many(
        &self,
        batch: &[Completion],
        held: &HeldConnection,
    ) -> Result<Vec<Option<(Duration, bool)>>, StoreError> {
        match &self.pool {
            #[cfg(feature = "postgres")]
            Pool::Postgres(pool) => {
                let mut columns = PgColumns::default();
                for c in batch {
                    columns.push(c);
                }
                let query = sqlx::query(self.sql().complete_many.as_str())
                    .bind(&columns.scope)
                    .bind(&columns.route)
                    .bind(&columns.key)
                    .bind(&columns.epoch)
                    .bind(&columns.status)
                    .bind(&columns.headers)
                    .bind(&columns.body)
                    .bind(&columns.body_kept)
                    .bind(&columns.request_id);
                let done = self
                    .bounded(
                        "complete",
                        self.on_batch_connection(pool, held, async move |conn| {
                            let rows = query.fetch_all(conn).await?;
                            // By key and epoch: a stale holder's completion
                            // beside the live one's must not take its answer.
                            rows.iter()
                                .map(|row| {
                                    let done = (left(row.try_get(4)?), row.try_get::<bool, _>(5)?);
                                    Ok(((returned_key(row)?, row.try_get::<i64, _>(3)?), done))
                                })
                                .collect::<Result<std::collections::HashMap<_, _>, sqlx::Error>>()
                        }),
                    )
                    .await?;
                Ok(batch
                    .iter()
                    .map(|c| done.get(&(c.key.clone(), c.epoch)).copied())
                    .collect())
            }
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(pool) => {
                // One write transaction, one fsync, a few statements for
                // the whole batch. Each row is fenced by its epoch, and
                // answered by key and epoch.
                let items = encoded(batch.iter());
                let done = self
                    .sqlite_transaction(
                        pool,
                        "complete",
                        async |tx| sqlite_completions(tx, &items).await,
                        |_| {},
                    )
                    .await?;
                Ok(batch
                    .iter()
                    .map(|c| done.get(&(c.key.clone(), c.epoch)).copied())
                    .collect())
            }
        }
    }
}

#[cfg(feature = "sqlite")]
impl DollarSql {
    /// Claims and completions of one batch, on SQLite, whose writes go
    /// through its one connection in turn: all of them in one transaction,
    /// one `BEGIN IMMEDIATE`, one commit, one fsync where separate claim and
    /// completion batches took two of each. Postgres writes them apart.
    pub(crate) async fn write_many(&self, batch: &[Write]) -> Result<Vec<Written>, StoreError> {
        #[allow(irrefutable_let_patterns)] // without Postgres
        let Pool::Sqlite(pool) = &self.pool else {
            // Postgres: its statements would commit one after the other
            // here, and a batch retried member by member after the second
            // failed would claim again what the first had already won.
            return Err(StoreError::Unavailable {
                op: "write",
                cause: "claims and completions are written apart on Postgres".into(),
            });
        };
        let claims: Vec<&NewClaim> = batch
            .iter()
            .filter_map(|w| match w {
                Write::Claim(c) => Some(c),
                Write::Complete(_) => None,
            })
            .collect();
        let completions = || {
            batch.iter().filter_map(|w| match w {
                Write::Complete(c) => Some(c),
                Write::Claim(_) => None,
            })
        };
        let (fresh, unique) = first_of_each_key(&claims);
        let items = encoded(completions());
        let (inserted, done) = self
            .sqlite_transaction(
                pool,
                "write",
                async |tx| {
                    let inserted = sqlite_claims(tx, &unique).await?;
                    Ok((inserted, sqlite_completions(tx, &items).await?))
                },
                |(inserted, _)| self.release_abandoned(&inserted),
            )
            .await?;
        let mut won = answer_claims(&claims, &fresh, &inserted).into_iter();
        let mut done = completions().map(|c| done.get(&(c.key.clone(), c.epoch)).copied());
        Ok(batch
            .iter()
            .map(|w| match w {
                Write::Claim(_) => Written::Claim(won.next().flatten()),
                Write::Complete(_) => Written::Complete(done.next().flatten()),
            })
            .collect())
    }
}

/// Which jobs of a claim batch are the first of their key (a key twice in
/// one batch is claimed for its first job only; the second then meets the
/// row like any duplicate), and those jobs.
fn first_of_each_key<C: Borrow<NewClaim>>(batch: &[C]) -> (Vec<bool>, Vec<&NewClaim>) {
    let mut seen = std::collections::HashSet::new();
    let fresh: Vec<bool> = batch.iter().map(|c| seen.insert(&c.borrow().key)).collect();
    let unique = batch
        .iter()
        .zip(&fresh)
        .filter_map(|(c, fresh)| fresh.then_some(c.borrow()))
        .collect();
    (fresh, unique)
}

/// Each job's answer: the epoch and expiry its key was inserted with, for
/// the first job of a key that was.
fn answer_claims<C: Borrow<NewClaim>>(
    batch: &[C],
    fresh: &[bool],
    inserted: &std::collections::HashMap<RecordKey, (i64, i64)>,
) -> Vec<Option<(i64, i64)>> {
    batch
        .iter()
        .zip(fresh)
        .map(|(c, fresh)| {
            fresh
                .then(|| inserted.get(&c.borrow().key).copied())
                .flatten()
        })
        .collect()
}

#[derive(Default)]
#[cfg(feature = "postgres")]
struct PgClaimColumns {
    scope: Vec<String>,
    route: Vec<String>,
    key: Vec<String>,
    fingerprint: Vec<String>,
    request_id: Vec<String>,
}

#[cfg(feature = "postgres")]
impl PgClaimColumns {
    fn push(&mut self, c: &NewClaim) {
        self.scope.push(c.key.scope.clone());
        self.route.push(c.key.route.clone());
        self.key.push(c.key.key.clone());
        self.fingerprint.push(c.fingerprint.clone());
        self.request_id.push(c.request_id.clone());
    }
}

/// A batch as Postgres arrays, one per column.
#[derive(Default)]
#[cfg(feature = "postgres")]
struct PgColumns {
    scope: Vec<String>,
    route: Vec<String>,
    key: Vec<String>,
    epoch: Vec<i64>,
    status: Vec<i32>,
    headers: Vec<Vec<u8>>,
    body: Vec<Vec<u8>>,
    body_kept: Vec<bool>,
    request_id: Vec<String>,
}

#[cfg(feature = "postgres")]
impl PgColumns {
    fn push(&mut self, c: &Completion) {
        self.scope.push(c.key.scope.clone());
        self.route.push(c.key.route.clone());
        self.key.push(c.key.key.clone());
        self.epoch.push(c.epoch);
        self.status.push(i32::from(c.response.status));
        self.headers.push(encode_fields(&c.response));
        self.body.push(c.response.body.to_vec());
        self.body_kept.push(c.response.body_kept);
        self.request_id.push(c.response.request_id.clone());
    }
}

/// The record a batched `… RETURNING scope, route, idem_key, …` row names.
fn returned_key<'r, R>(row: &'r R) -> Result<RecordKey, sqlx::Error>
where
    R: Row,
    usize: sqlx::ColumnIndex<R>,
    String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    Ok(RecordKey {
        scope: row.try_get(0)?,
        route: row.try_get(1)?,
        key: row.try_get(2)?,
    })
}

/// SQLite's multi-row statements, by rows (`SQLITE_ROWS`).
#[cfg(feature = "sqlite")]
type ByRows = std::sync::LazyLock<Vec<(usize, String)>>;

#[cfg(feature = "sqlite")]
fn by_rows(text: fn(usize) -> String) -> Vec<(usize, String)> {
    SQLITE_ROWS.iter().map(|&rows| (rows, text(rows))).collect()
}

#[cfg(feature = "sqlite")]
static SQLITE_CLAIMS: ByRows = ByRows::new(|| by_rows(sqlite_claim_rows));

#[cfg(feature = "sqlite")]
static SQLITE_COMPLETIONS: ByRows = ByRows::new(|| by_rows(sqlite_complete_rows));

/// `items` cut into runs the sizes of `statements` (largest first), each
/// with the statement that writes it.
#[cfg(feature = "sqlite")]
fn sqlite_chunks<'a, T>(
    statements: &'static [(usize, String)],
    mut items: &'a [T],
) -> Vec<(&'static str, &'a [T])> {
    let mut runs = Vec::new();
    for (rows, statement) in statements {
        while items.len() >= *rows {
            let (run, rest) = items.split_at(*rows);
            runs.push((statement.as_str(), run));
            items = rest;
        }
    }
    runs
}

/// A job of a SQLite batch: the record it writes is its first three
/// parameters.
#[cfg(feature = "sqlite")]
trait Keyed {
    fn key(&self) -> &RecordKey;
}

#[cfg(feature = "sqlite")]
impl Keyed for &NewClaim {
    fn key(&self) -> &RecordKey {
        &self.key
    }
}

/// A completion with its headers encoded for the statement.
#[cfg(feature = "sqlite")]
struct Encoded<'a> {
    key: &'a RecordKey,
    epoch: i64,
    response: &'a crate::StoredResponse,
    headers: Vec<u8>,
}

#[cfg(feature = "sqlite")]
impl Keyed for Encoded<'_> {
    fn key(&self) -> &RecordKey {
        self.key
    }
}

#[cfg(feature = "sqlite")]
type SqliteQuery<'q> = sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments>;

#[cfg(feature = "sqlite")]
impl DollarSql {
    /// Releases the claims of a transaction whose `COMMIT` was given up on:
    /// their callers are told the store is unavailable and forward nothing,
    /// and the commit may still land. Each release is fenced by its epoch,
    /// so one whose insert never landed changes nothing.
    fn release_abandoned(&self, inserted: &std::collections::HashMap<RecordKey, (i64, i64)>) {
        for (key, (epoch, _)) in inserted {
            let (sql, key, epoch) = (self.clone(), key.clone(), *epoch);
            tokio::spawn(async move {
                let released = sql
                    .set_state(
                        &key,
                        epoch,
                        crate::RecordState::Released,
                        std::time::Duration::ZERO,
                        "release",
                    )
                    .await;
                tracing::warn!(route = %key.route, key = %key.escaped(), layer = "store", ?released, "claim whose commit outlasted store.timeout; released");
            });
        }
    }

    /// Runs `work` in one SQLite write transaction (`BEGIN IMMEDIATE`: the
    /// write lock is taken up front, so nothing in it meets `SQLITE_BUSY`
    /// halfway) and commits it: one fsync for all it wrote.
    ///
    /// `store.timeout` bounds getting the connection and the writes; one
    /// that runs out rolls the transaction back, and nothing was written.
    /// The `COMMIT` gets a `store.timeout` of its own: once sent it may land
    /// whatever the caller does, so its outcome is waited for rather than
    /// cut short with the writes' budget. A claim it makes durable is then
    /// answered — to its caller, or, when that caller stopped waiting, to
    /// the batcher's orphan hook, which releases it — instead of holding
    /// its key, unanswered, for a lease. Only a `COMMIT` slower than a whole
    /// `store.timeout` (a disk that hangs) is given up on, so that the
    /// writer, and the queue of answers waiting behind it, never wait
    /// without bound; what it would have written is handed to `abandoned`
    /// (which releases the claims it held: it may still land).
    async fn sqlite_transaction<T>(
        &self,
        pool: &sqlx::SqlitePool,
        op: &'static str,
        work: impl AsyncFnOnce(&mut sqlx::SqliteConnection) -> Result<T, sqlx::Error>,
        abandoned: impl FnOnce(T),
    ) -> Result<T, StoreError> {
        let (tx, value) = self
            .bounded(op, async {
                let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
                let value = work(&mut tx).await?;
                Ok((tx, value))
            })
            .await?;
        if let Err(e) = self.bounded(op, tx.commit()).await {
            if matches!(e, StoreError::Timeout { .. }) {
                abandoned(value);
            }
            return Err(e);
        }
        Ok(value)
    }
}

/// Writes `jobs` inside `tx`, a statement per run of `statements`' sizes:
/// `first` binds what every row shares, each job binds its key and then
/// `bind`'s parameters; `read` turns each returned row into an entry of
/// the answer map.
#[cfg(feature = "sqlite")]
async fn sqlite_rows<'q, T: Keyed + 'q, K: std::hash::Hash + Eq, V>(
    tx: &mut sqlx::SqliteConnection,
    statements: &'static [(usize, String)],
    jobs: &'q [T],
    first: impl Fn(SqliteQuery<'q>) -> SqliteQuery<'q>,
    bind: impl Fn(SqliteQuery<'q>, &'q T) -> SqliteQuery<'q>,
    read: impl Fn(&sqlx::sqlite::SqliteRow) -> Result<(K, V), sqlx::Error>,
) -> Result<std::collections::HashMap<K, V>, sqlx::Error> {
    let mut answers = std::collections::HashMap::new();
    for (statement, run) in sqlite_chunks(statements, jobs) {
        let mut query = first(sqlx::query(statement));
        for job in run {
            let key = job.key();
            query = bind(query.bind(&key.scope).bind(&key.route).bind(&key.key), job);
        }
        for row in query.fetch_all(&mut *tx).await? {
            let (key, value) = read(&row)?;
            answers.insert(key, value);
        }
    }
    Ok(answers)
}

/// Claims of distinct fresh keys inside `tx` → the keys inserted, with
/// their epochs and expiries. One store, one lease and retention: the
/// claims share them.
#[cfg(feature = "sqlite")]
async fn sqlite_claims(
    tx: &mut sqlx::SqliteConnection,
    unique: &[&NewClaim],
) -> Result<std::collections::HashMap<RecordKey, (i64, i64)>, sqlx::Error> {
    let Some(first) = unique.first() else {
        return Ok(std::collections::HashMap::new());
    };
    let (lease, retention) = (millis(first.lease), millis(first.retention));
    sqlite_rows(
        tx,
        &SQLITE_CLAIMS,
        unique,
        |q| q.bind(lease).bind(retention),
        |q, c| q.bind(&c.fingerprint).bind(&c.request_id),
        |row| {
            let won = (row.try_get::<i64, _>(3)?, row.try_get::<i64, _>(4)?);
            Ok((returned_key(row)?, won))
        },
    )
    .await
}

/// Completions inside `tx`, each fenced by its epoch → by key and epoch,
/// the retention left and whether a duplicate waits.
#[cfg(feature = "sqlite")]
async fn sqlite_completions(
    tx: &mut sqlx::SqliteConnection,
    items: &[Encoded<'_>],
) -> Result<std::collections::HashMap<(RecordKey, i64), (Duration, bool)>, sqlx::Error> {
    sqlite_rows(
        tx,
        &SQLITE_COMPLETIONS,
        items,
        |q| q,
        |q, c| {
            q.bind(c.epoch)
                .bind(i32::from(c.response.status))
                .bind(&c.headers)
                .bind(c.response.body.as_ref())
                .bind(c.response.body_kept)
                .bind(&c.response.request_id)
        },
        |row| {
            let settled = (left(row.try_get(4)?), row.try_get::<bool, _>(5)?);
            let epoch = row.try_get::<i64, _>(3)?;
            Ok(((returned_key(row)?, epoch), settled))
        },
    )
    .await
}

/// Completions with their headers encoded for SQLite's statements.
#[cfg(feature = "sqlite")]
fn encoded<'a>(batch: impl Iterator<Item = &'a Completion>) -> Vec<Encoded<'a>> {
    batch
        .map(|c| Encoded {
            key: &c.key,
            epoch: c.epoch,
            response: &c.response,
            headers: encode_fields(&c.response),
        })
        .collect()
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;
    use crate::StoredResponse;
    use crate::sql::sqlite_in_memory as store;

    fn claim(key: &str) -> NewClaim {
        NewClaim {
            key: RecordKey::new("scope", "route", key),
            fingerprint: "fp".into(),
            request_id: "rid".into(),
            lease: Duration::from_secs(60),
            retention: Duration::from_secs(3600),
            past_tombstone: false,
        }
    }

    /// 85 rows take every statement size (64 + 16 + 4 + 1); a key twice in
    /// the batch is won by its first job only; each completion lands on
    /// its own record, and a stale epoch in the same statement as the live
    /// one is refused and answered `None`.
    #[tokio::test]
    async fn a_batch_is_cut_into_multi_row_statements_and_answered_row_by_row() {
        let store = store().await;
        let held = HeldConnection::default();
        let mut batch: Vec<NewClaim> = (0..84).map(|i| claim(&format!("k{i}"))).collect();
        batch.insert(40, claim("k3"));
        let won = store.insert_claims(&batch, &held).await.unwrap();
        assert_eq!(won.len(), 85);
        assert!(won[40].is_none(), "a key twice in a batch won twice");
        assert_eq!(won.iter().filter(|w| w.is_some()).count(), 84);
        let mut completions: Vec<Completion> = batch
            .iter()
            .zip(&won)
            .filter_map(|(c, won)| {
                let (epoch, _) = (*won)?;
                let mut response = StoredResponse {
                    status: 201,
                    headers: vec![("content-type".into(), b"text/plain".to_vec())],
                    trailers: Vec::new(),
                    body: bytes::Bytes::from(c.key.key.clone()),
                    body_kept: true,
                    request_id: "rid".into(),
                };
                response.status += u16::from(c.key.key == "k0");
                Some(Completion {
                    key: c.key.clone(),
                    epoch,
                    response,
                })
            })
            .collect();
        // A stale holder of k0 beside the live one, in the same statement.
        let mut stale = completions[0].clone();
        stale.epoch -= 1;
        completions.insert(1, stale);
        let done = store.complete_many(&completions, &held).await.unwrap();
        assert!(done[0].is_some(), "the live completion");
        assert!(done[1].is_none(), "a stale epoch was answered as written");
        assert!(done.iter().skip(2).all(Option::is_some));
        for c in batch.iter().take(84) {
            let record = store.get(&c.key).await.unwrap().unwrap();
            let response = record.response.unwrap();
            assert_eq!(response.body, c.key.key.as_bytes());
            assert_eq!(response.status, if c.key.key == "k0" { 202 } else { 201 });
        }
    }

    /// Claims and completions of one SQLite batch share its transaction;
    /// each write still gets its own answer, in order: a key claimed twice
    /// in the batch is won once, a completion lands on its own record, a
    /// stale epoch is refused.
    #[tokio::test]
    async fn claims_and_completions_in_one_batch_are_answered_each_in_turn() {
        let store = store().await;
        let held = HeldConnection::default();
        let first: Vec<NewClaim> = (0..3).map(|i| claim(&format!("done{i}"))).collect();
        let won = store.insert_claims(&first, &held).await.unwrap();
        let completion = |c: &NewClaim, epoch: i64| {
            Write::Complete(Completion {
                key: c.key.clone(),
                epoch,
                response: StoredResponse {
                    status: 201,
                    headers: Vec::new(),
                    trailers: Vec::new(),
                    body: bytes::Bytes::from(c.key.key.clone()),
                    body_kept: true,
                    request_id: "rid".into(),
                },
            })
        };
        let epochs: Vec<i64> = won.iter().map(|w| w.unwrap().0).collect();
        let batch = vec![
            Write::Claim(claim("fresh0")),
            completion(&first[0], epochs[0]),
            Write::Claim(claim("fresh0")),
            completion(&first[1], epochs[1] - 1),
            Write::Claim(claim("fresh1")),
            completion(&first[2], epochs[2]),
            // A claim of a key that already has a record is not won.
            Write::Claim(claim("done1")),
        ];
        let written = store.write_many(&batch).await.unwrap();
        assert_eq!(written.len(), batch.len());
        assert!(matches!(written[0], Written::Claim(Some(_))), "{written:?}");
        assert!(
            matches!(written[1], Written::Complete(Some(_))),
            "{written:?}"
        );
        assert_eq!(
            written[2],
            Written::Claim(None),
            "a key won twice in one batch"
        );
        assert_eq!(
            written[3],
            Written::Complete(None),
            "a stale epoch completed"
        );
        assert!(matches!(written[4], Written::Claim(Some(_))), "{written:?}");
        assert!(
            matches!(written[5], Written::Complete(Some(_))),
            "{written:?}"
        );
        assert_eq!(written[6], Written::Claim(None), "an existing record won");
        for (c, completed) in first.iter().zip([true, false, true]) {
            let record = store.get(&c.key).await.unwrap().unwrap();
            assert_eq!(record.response.is_some(), completed, "{}", c.key.key);
        }
        for key in ["fresh0", "fresh1"] {
            let record = store.get(&claim(key).key).await.unwrap().unwrap();
            assert!(record.response.is_none(), "{key} is held, not completed");
        }
    }
}
