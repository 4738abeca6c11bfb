//! The store conformance suite, run against every combination the gateway
//! supports: SQLite alone, Postgres alone, Redis + Postgres, and the
//! in-process layer + SQLite. Real servers, never mocks; every test has its
//! own schema, key prefix or database file.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idemgate_core::metrics::{FallbackLayer, Metrics};
use idemgate_store::MemoryLayer;
use idemgate_store::StoreSettings;
use idemgate_store::testing::FastLayer;
use idemgate_store::testing::RedisLayer;
use idemgate_store::{Claim, RecordKey, RecordState, Store, StoredResponse, sweep_once};
use idemgate_store::{DeadLetterClaim, SqlSettings, SqlStore};
use support::services;

#[derive(Clone, Copy, Debug)]
enum Backend {
    Sqlite,
    Postgres,
    RedisPostgres,
    MemorySqlite,
    Mysql,
    RedisMysql,
}

struct Opened {
    store: Store,
    metrics: Arc<Metrics>,
    _dir: Option<tempfile::TempDir>,
}

/// Every conformance test ends with the fast layer having answered every
/// call it was asked: a suite on "Redis + Postgres" whose Redis calls all
/// fell back would only have tested Postgres.
impl Drop for Opened {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        for layer in [FallbackLayer::Redis, FallbackLayer::Memory] {
            assert_eq!(
                self.metrics.fallbacks(layer),
                0,
                "{layer:?} fell back: the fast layer was not what this test exercised"
            );
        }
    }
}

/// Past a 100 ms retention, and past the end of the one-second Postgres
/// partition its expiry falls in (a partition is retired whole).
const PAST_PARTITION: Duration = Duration::from_millis(1300);

async fn sql_store(
    backend: Backend,
    test: &str,
    tombstone: Duration,
    retention: Duration,
) -> Option<(SqlStore, Option<tempfile::TempDir>)> {
    let (url, dir) = match backend {
        Backend::Sqlite | Backend::MemorySqlite => {
            let dir = tempfile::tempdir().unwrap();
            (
                format!("sqlite://{}/records.db", dir.path().display()),
                Some(dir),
            )
        }
        Backend::Postgres | Backend::RedisPostgres => (services::postgres(test).await?, None),
        Backend::Mysql | Backend::RedisMysql => (services::mariadb(test).await?, None),
    };
    let sql = SqlStore::connect(&SqlSettings {
        url,
        pool_size: 8,
        timeout: Duration::from_secs(2),
        tombstone,
        schema: None,
        retention,
        // As the gateway sizes them, with a sweep every second.
        partition_span: idemgate_store::testing::partition_span(retention, Duration::from_secs(1)),
    })
    .await
    .unwrap();
    sql.migrate().await.unwrap();
    Some((sql, dir))
}

async fn open(
    backend: Backend,
    test: &str,
    lease: Duration,
    retention: Duration,
) -> Option<Opened> {
    open_with_tombstone(backend, test, lease, retention, Duration::ZERO).await
}

async fn open_with_tombstone(
    backend: Backend,
    test: &str,
    lease: Duration,
    retention: Duration,
    tombstone: Duration,
) -> Option<Opened> {
    let (sql, dir) = sql_store(backend, test, tombstone, retention).await?;
    let fast: Option<Arc<dyn FastLayer>> = match backend {
        Backend::Sqlite | Backend::Postgres | Backend::Mysql => None,
        Backend::MemorySqlite => Some(Arc::new(MemoryLayer::new(10_000))),
        // As the gateway composes it: Redis behind this process's copies
        // of the answers it replays.
        Backend::RedisPostgres | Backend::RedisMysql => {
            let (url, prefix) = services::redis(test).await?;
            let redis = RedisLayer::new(&url, &prefix, Duration::from_millis(200)).unwrap();
            Some(Arc::new(idemgate_store::testing::NearLayer::new(
                Arc::new(redis),
                Arc::new(MemoryLayer::new(10_000)),
            )))
        }
    };
    let metrics = Arc::new(Metrics::default());
    let settings = StoreSettings {
        lease,
        retention,
        fast_layer_budget: Duration::from_millis(200),
    };
    Some(Opened {
        store: Store::new(sql, fast, settings, metrics.clone()),
        metrics,
        _dir: dir,
    })
}

fn response(body: &'static str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), b"application/json".to_vec())],
        trailers: Vec::new(),
        body: Bytes::from_static(body.as_bytes()),
        body_kept: true,
        request_id: "req-1".into(),
    }
}

fn key(k: &str) -> RecordKey {
    RecordKey::new("scope-a", "route", k)
}

const LONG: Duration = Duration::from_secs(60);

/// The epoch of a won claim.
fn won(claim: Claim) -> i64 {
    match claim {
        Claim::Won { epoch, .. } => epoch,
        other => panic!("expected a won claim, got {other:?}"),
    }
}

/// The expiry every answer carries.
fn completed(claim: Claim) -> StoredResponse {
    match claim {
        Claim::Completed { response, .. } => response,
        other => panic!("expected a completed record, got {other:?}"),
    }
}

async fn concurrent_claims_have_one_winner(backend: Backend, test: &str) {
    let Some(o) = open(backend, test, LONG, LONG).await else {
        return;
    };
    let k = key("storm");
    let claims = (0..200).map(|_| {
        let store = o.store.clone();
        let k = k.clone();
        tokio::spawn(async move { store.claim(&k, "fp", "rid").await.unwrap() })
    });
    let results = futures_util::future::join_all(claims).await;
    let won = results
        .iter()
        .filter(|r| matches!(r.as_ref().unwrap(), Claim::Won { .. }))
        .count();
    let in_flight = results
        .iter()
        .filter(|r| matches!(r.as_ref().unwrap(), Claim::InFlight { .. }))
        .count();
    assert_eq!((won, in_flight), (1, 199), "{backend:?}");
}

/// A burst of claims and completions, batched however the writers cut it:
/// each key, claimed twice at once, has one winner; each completion lands
/// on its own record, and one with a stale epoch is refused. (Fixed batches
/// through every SQLite statement size: `crates/idemgate-store/src/sql/dollar/batched.rs`.)
async fn a_burst_is_written_row_by_row_correctly(backend: Backend, test: &str) {
    let Some(o) = open(backend, test, LONG, LONG).await else {
        return;
    };
    let keys: Vec<RecordKey> = (0..150).map(|i| key(&format!("burst-{i}"))).collect();
    let claims = keys.iter().chain(&keys).map(|k| {
        let (store, k) = (o.store.clone(), k.clone());
        tokio::spawn(async move { (k.clone(), store.claim(&k, "fp", "rid").await.unwrap()) })
    });
    let mut epochs = std::collections::HashMap::new();
    for claimed in futures_util::future::join_all(claims).await {
        let (k, claim) = claimed.unwrap();
        match claim {
            Claim::Won { epoch, .. } => assert!(epochs.insert(k, epoch).is_none(), "two winners"),
            Claim::InFlight { .. } => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(epochs.len(), 150, "{backend:?}");
    let completions = epochs.iter().map(|(k, epoch)| {
        let (store, k, epoch) = (o.store.clone(), k.clone(), *epoch);
        let body: &'static str = Box::leak(format!("{{\"key\":\"{}\"}}", k.key).into_boxed_str());
        tokio::spawn(async move { store.complete(&k, epoch, "fp", &response(body), 0).await })
    });
    let stale = {
        let (store, k, epoch) = (o.store.clone(), keys[0].clone(), epochs[&keys[0]]);
        tokio::spawn(async move {
            store
                .complete(&k, epoch - 1, "fp", &response("{}"), 0)
                .await
        })
    };
    let (done, stale) = tokio::join!(futures_util::future::join_all(completions), stale);
    assert!(done.into_iter().all(|d| d.unwrap().unwrap()), "{backend:?}");
    assert!(!stale.unwrap().unwrap(), "a stale epoch was accepted");
    for k in &keys {
        let stored = completed(o.store.claim(k, "fp", "rid2").await.unwrap());
        assert_eq!(
            stored.body,
            format!("{{\"key\":\"{}\"}}", k.key).into_bytes()
        );
    }
}

/// A second store with a pool of its own on `sql`'s database (another
/// gateway's, as far as the database can tell).
async fn another_store_on(sql: &SqlStore, dir: Option<&tempfile::TempDir>) -> SqlStore {
    let url = match dir {
        Some(dir) => format!("sqlite://{}/records.db", dir.path().display()),
        None => sql.url_for_tests().to_owned(),
    };
    SqlStore::connect(&SqlSettings {
        url,
        pool_size: 8,
        timeout: Duration::from_secs(2),
        tombstone: Duration::ZERO,
        schema: None,
        retention: LONG,
        partition_span: idemgate_store::testing::partition_span(LONG, Duration::from_secs(1)),
    })
    .await
    .unwrap()
}

/// Check-and-claim is one atomic statement, not a read then a write: two
/// stores with pools of their own (as two gateway instances have) race on
/// one key, and the database alone decides. A single store's batch writer
/// serialises its own claims, so it could not show this.
async fn independent_stores_racing_have_one_winner(backend: Backend, test: &str) {
    let (sql_a, dir) = match sql_store(backend, test, Duration::ZERO, LONG).await {
        Some(s) => s,
        None => return,
    };
    let sql_b = another_store_on(&sql_a, dir.as_ref()).await;
    let settings = StoreSettings {
        lease: LONG,
        retention: LONG,
        fast_layer_budget: Duration::from_millis(200),
    };
    let a = Store::new(sql_a, None, settings, Arc::new(Metrics::default()));
    let b = Store::new(sql_b, None, settings, Arc::new(Metrics::default()));
    for round in 0..5 {
        let k = key(&format!("race-{round}"));
        let claims = (0..100).map(|i| {
            let store = if i % 2 == 0 { a.clone() } else { b.clone() };
            let k = k.clone();
            tokio::spawn(async move { store.claim(&k, "fp", "rid").await.unwrap() })
        });
        let won = futures_util::future::join_all(claims)
            .await
            .into_iter()
            .filter(|r| matches!(r.as_ref().unwrap(), Claim::Won { .. }))
            .count();
        assert_eq!(won, 1, "{backend:?} round {round}");
    }
}

/// Who may publish `key`'s dead-letter copy, asked of `store` as `holder`.
async fn copy_lease(store: &SqlStore, key: &str, holder: &str, lease: Duration) -> DeadLetterClaim {
    store
        .claim_dead_letter("orders", key, holder, lease)
        .await
        .unwrap()
}

/// A consumed message's dead-letter copy has one publisher: of a hundred
/// instances deciding its end at once (two stores, pools of their own),
/// one takes the copy lease; the rest find it busy, then the copy stored.
/// A publisher that died leaves the lease to lapse, and its successor
/// publishes under the same copy id; a live one renews it; a refused copy
/// gives the lease back, and only its own holder can.
async fn a_dead_letter_copy_has_one_publisher(backend: Backend, test: &str) {
    let Some((a, dir)) = sql_store(backend, test, Duration::ZERO, LONG).await else {
        return;
    };
    let b = another_store_on(&a, dir.as_ref()).await;
    let (a, b) = (Arc::new(a), Arc::new(b));
    let claims = (0..100).map(|i| {
        let store = if i % 2 == 0 { a.clone() } else { b.clone() };
        tokio::spawn(async move {
            store
                .claim_dead_letter("orders", "o-1", &format!("copy-{i}"), LONG)
                .await
                .unwrap()
        })
    });
    let claims: Vec<_> = futures_util::future::join_all(claims)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let winners: Vec<_> = claims
        .iter()
        .filter_map(|c| match c {
            DeadLetterClaim::Won(copy) => Some(copy.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(winners.len(), 1, "{backend:?}: {claims:?}");
    assert!(
        claims
            .iter()
            .all(|c| matches!(c, DeadLetterClaim::Won(_) | DeadLetterClaim::Busy))
    );
    // Stored: every later decision acknowledges, on either store.
    a.mark_dead_lettered("orders", "o-1").await.unwrap();
    for store in [&a, &b] {
        assert_eq!(
            copy_lease(store, "o-1", "late", LONG).await,
            DeadLetterClaim::Copied
        );
    }
    // A publisher that died: its lease lapses, and the copy is made again
    // under its id, by a holder of its own.
    let short = Duration::from_millis(300);
    assert_eq!(
        copy_lease(&a, "o-2", "first", short).await,
        DeadLetterClaim::Won("first".into())
    );
    assert_eq!(
        copy_lease(&b, "o-2", "second", short).await,
        DeadLetterClaim::Busy
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        copy_lease(&b, "o-2", "second", LONG).await,
        DeadLetterClaim::Won("first".into())
    );
    // The late first holder can neither renew nor give back its
    // successor's lease.
    assert!(
        !a.renew_dead_letter("orders", "o-2", "first", LONG)
            .await
            .unwrap()
    );
    a.release_dead_letter("orders", "o-2", "first")
        .await
        .unwrap();
    assert_eq!(
        copy_lease(&a, "o-2", "third", LONG).await,
        DeadLetterClaim::Busy
    );
    // A fresh publish of the key while a copy is being made leaves that
    // lease alone.
    a.count_delivery_failure("orders", "o-2", true)
        .await
        .unwrap();
    assert_eq!(
        copy_lease(&a, "o-2", "third", LONG).await,
        DeadLetterClaim::Busy
    );
    // Refused by the broker: given back by its holder.
    b.release_dead_letter("orders", "o-2", "second")
        .await
        .unwrap();
    assert_eq!(
        copy_lease(&a, "o-2", "third", LONG).await,
        DeadLetterClaim::Won("first".into())
    );
    // Once no copy is being made, a fresh publish of the key starts over:
    // a new copy, a new id.
    a.release_dead_letter("orders", "o-2", "third")
        .await
        .unwrap();
    a.count_delivery_failure("orders", "o-2", true)
        .await
        .unwrap();
    assert_eq!(
        copy_lease(&b, "o-2", "fresh", LONG).await,
        DeadLetterClaim::Won("fresh".into())
    );
    // A slow publisher renews its lease: nobody takes it over while it
    // keeps renewing.
    assert_eq!(
        copy_lease(&a, "o-3", "slow", short).await,
        DeadLetterClaim::Won("slow".into())
    );
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            a.renew_dead_letter("orders", "o-3", "slow", short)
                .await
                .unwrap()
        );
        assert_eq!(
            copy_lease(&b, "o-3", "eager", short).await,
            DeadLetterClaim::Busy
        );
    }
}

async fn completed_claims_replay_and_mismatch(backend: Backend, test: &str) {
    let Some(o) = open(backend, test, LONG, LONG).await else {
        return;
    };
    let k = key("done");
    let epoch = won(o.store.claim(&k, "fp", "rid").await.unwrap());
    assert!(matches!(
        o.store.claim(&k, "other", "rid2").await.unwrap(),
        Claim::Mismatch { .. }
    ));
    assert!(
        o.store
            .complete(&k, epoch, "fp", &response("{\"ok\":1}"), 0)
            .await
            .unwrap()
    );
    assert_eq!(
        completed(o.store.claim(&k, "fp", "rid3").await.unwrap()),
        response("{\"ok\":1}")
    );
    assert!(matches!(
        o.store.claim(&k, "other", "rid4").await.unwrap(),
        Claim::Mismatch { .. }
    ));
    // Another client's scope with the same key is a different record.
    let other_client = RecordKey::new("scope-b", "route", "done");
    assert!(matches!(
        o.store.claim(&other_client, "other", "r").await.unwrap(),
        Claim::Won { .. }
    ));
    let record = o.store.get(&k).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Completed);
    assert_eq!(
        record.response.unwrap().body,
        Bytes::from_static(b"{\"ok\":1}")
    );
}

/// A key is its bytes: keys that a case-, accent- or space-insensitive
/// collation would take for one (MySQL's defaults, MariaDB's PAD SPACE)
/// are different records, each with its own answer — never another
/// client's.
async fn keys_that_differ_in_case_or_trailing_space_are_different_records(
    backend: Backend,
    test: &str,
) {
    let Some(o) = open(backend, test, LONG, LONG).await else {
        return;
    };
    let keys = [
        "Order-1",
        "order-1",
        "order-1 ",
        "orde\u{301}r-1",
        "ORDER-1\t",
    ];
    for (i, k) in keys.iter().enumerate() {
        let k = key(k);
        let epoch = won(o.store.claim(&k, "fp", "rid").await.unwrap());
        let body: &'static str = Box::leak(format!("{{\"n\":{i}}}").into_boxed_str());
        assert!(
            o.store
                .complete(&k, epoch, "fp", &response(body), 0)
                .await
                .unwrap()
        );
    }
    for (i, k) in keys.iter().enumerate() {
        let replay = completed(o.store.claim(&key(k), "fp", "again").await.unwrap());
        assert_eq!(replay.body, format!("{{\"n\":{i}}}"), "{k:?}");
    }
    // The route and the client scope compare as bytes too.
    let upper = RecordKey::new("SCOPE-A", "route", "Order-1");
    won(o.store.claim(&upper, "fp", "rid").await.unwrap());
    let spaced = RecordKey::new("scope-a", "route ", "Order-1");
    won(o.store.claim(&spaced, "fp", "rid").await.unwrap());
}

async fn expired_lease_is_taken_over_and_the_old_holder_fenced(backend: Backend, test: &str) {
    let Some(o) = open(backend, test, Duration::from_millis(200), LONG).await else {
        return;
    };
    let k = key("lease");
    let first = won(o.store.claim(&k, "fp", "a").await.unwrap());
    assert!(matches!(
        o.store.claim(&k, "fp", "b").await.unwrap(),
        Claim::InFlight { .. }
    ));
    tokio::time::sleep(Duration::from_millis(350)).await;
    let second = won(o.store.claim(&k, "fp", "c").await.unwrap());
    assert!(second > first);
    // The paused first holder wakes up: its writes are refused.
    assert!(
        !o.store
            .complete(&k, first, "fp", &response("late"), 0)
            .await
            .unwrap()
    );
    assert!(!o.store.release(&k, first).await.unwrap());
    assert!(!o.store.renew(&k, first).await.unwrap());
    assert!(
        o.store
            .complete(&k, second, "fp", &response("new"), 0)
            .await
            .unwrap()
    );
    assert_eq!(
        completed(o.store.claim(&k, "fp", "d").await.unwrap()),
        response("new")
    );
}

async fn released_claims_can_be_claimed_again(backend: Backend, test: &str) {
    let Some(o) = open(backend, test, LONG, LONG).await else {
        return;
    };
    let k = key("release");
    let epoch = won(o.store.claim(&k, "fp", "a").await.unwrap());
    assert!(o.store.release(&k, epoch).await.unwrap());
    let again = won(o.store.claim(&k, "fp2", "b").await.unwrap());
    assert!(again > epoch);
    assert!(
        !o.store
            .complete(&k, epoch, "fp", &response("stale"), 0)
            .await
            .unwrap()
    );
}

async fn uncertain_records_are_retried_by_the_same_request_only(backend: Backend, test: &str) {
    let Some(o) = open(backend, test, LONG, LONG).await else {
        return;
    };
    let k = key("uncertain");
    let epoch = won(o.store.claim(&k, "fp", "a").await.unwrap());
    assert!(
        o.store
            .mark_uncertain(&k, epoch, Duration::ZERO)
            .await
            .unwrap()
    );
    assert_eq!(
        o.store.get(&k).await.unwrap().unwrap().state,
        RecordState::Uncertain
    );
    assert!(matches!(
        o.store.claim(&k, "other", "b").await.unwrap(),
        Claim::Mismatch { .. }
    ));
    let retry = won(o.store.claim(&k, "fp", "c").await.unwrap());
    assert!(retry > epoch);
    // One at a time: while the retry runs, a further retry is in flight.
    assert!(matches!(
        o.store.claim(&k, "fp", "d").await.unwrap(),
        Claim::InFlight { .. }
    ));
}

async fn sweep_removes_or_archives_expired_records(backend: Backend, test: &str) {
    let Some(o) = open(backend, test, LONG, Duration::from_millis(100)).await else {
        return;
    };
    for i in 0..3 {
        let k = key(&format!("old-{i}"));
        let epoch = won(o.store.claim(&k, "fp", "r").await.unwrap());
        assert!(
            o.store
                .complete(&k, epoch, "fp", &response("x"), 0)
                .await
                .unwrap()
        );
    }
    // Held under a live lease: kept even past its retention.
    let held = key("held");
    assert!(matches!(
        o.store.claim(&held, "fp", "r").await.unwrap(),
        Claim::Won { .. }
    ));
    tokio::time::sleep(PAST_PARTITION).await;
    assert_eq!(sweep_once(o.store.sql(), false).await.unwrap(), 3);
    assert!(o.store.get(&key("old-0")).await.unwrap().is_none());
    assert!(o.store.get(&held).await.unwrap().is_some());
    // Archive mode moves rows instead.
    let k = key("archived");
    let epoch = won(o.store.claim(&k, "fp", "r").await.unwrap());
    assert!(
        o.store
            .complete(&k, epoch, "fp", &response("x"), 0)
            .await
            .unwrap()
    );
    tokio::time::sleep(PAST_PARTITION).await;
    assert_eq!(sweep_once(o.store.sql(), true).await.unwrap(), 1);
    assert_eq!(o.store.sql().archived().await.unwrap(), 1);
    assert!(o.store.get(&k).await.unwrap().is_none());
}

async fn purge_removes_every_scope(backend: Backend, test: &str) {
    let Some(o) = open(backend, test, LONG, LONG).await else {
        return;
    };
    for scope in ["s1", "s2"] {
        let k = RecordKey::new(scope, "route", "purge-me");
        let epoch = won(o.store.claim(&k, "fp", "r").await.unwrap());
        assert!(
            o.store
                .complete(&k, epoch, "fp", &response("x"), 0)
                .await
                .unwrap()
        );
    }
    assert_eq!(o.store.find("route", "purge-me").await.unwrap().len(), 2);
    let purged = |removed, held| idemgate_store::Purged { removed, held };
    assert_eq!(
        o.store
            .purge("route", "purge-me", Some("s1"))
            .await
            .unwrap(),
        purged(1, 0)
    );
    assert_eq!(
        o.store.purge("route", "purge-me", None).await.unwrap(),
        purged(1, 0)
    );
    let k = RecordKey::new("s2", "route", "purge-me");
    let first = won(o.store.claim(&k, "fp", "r").await.unwrap());
    // A record under a live lease is never purged: a purge must not let a
    // second request run beside the first.
    assert_eq!(
        o.store.purge("route", "purge-me", None).await.unwrap(),
        purged(0, 1)
    );
    assert!(matches!(
        o.store.claim(&k, "fp", "r2").await.unwrap(),
        Claim::InFlight { .. }
    ));
    // Once finished it may be purged; the key's next record gets a larger
    // epoch, so the old holder's late writes can never match it.
    assert!(o.store.release(&k, first).await.unwrap());
    assert_eq!(
        o.store.purge("route", "purge-me", None).await.unwrap(),
        purged(1, 0)
    );
    let second = won(o.store.claim(&k, "fp", "r3").await.unwrap());
    assert!(second > first, "epochs only grow: {first} then {second}");
    assert!(!o.store.release(&k, first).await.unwrap());
    assert!(
        !o.store
            .mark_uncertain(&k, first, Duration::ZERO)
            .await
            .unwrap()
    );
    assert!(
        !o.store
            .complete(&k, first, "fp", &response("stale"), 0)
            .await
            .unwrap()
    );
}

/// An uncertain record is not taken over while its hold runs (a copy may
/// still be running at the upstream): the same request is told so, with
/// how long is left, by the database's clock. After the hold the one retry
/// that takes it over learns that the attempt before it may have acted.
async fn an_uncertain_record_is_held_then_taken_over_once(backend: Backend, test: &str) {
    let Some(o) = open(backend, test, LONG, LONG).await else {
        return;
    };
    let k = key("held-uncertain");
    let epoch = won(o.store.claim(&k, "fp", "a").await.unwrap());
    assert!(
        o.store
            .mark_uncertain(&k, epoch, Duration::from_millis(600))
            .await
            .unwrap()
    );
    match o.store.claim(&k, "fp", "b").await.unwrap() {
        Claim::Uncertain {
            epoch: e,
            retry_after,
            ..
        } => {
            assert_eq!(e, epoch);
            assert!(retry_after > Duration::from_millis(300), "{retry_after:?}");
        }
        other => panic!("a held uncertain record was {other:?}"),
    }
    assert!(matches!(
        o.store.claim(&k, "other", "c").await.unwrap(),
        Claim::Mismatch { .. }
    ));
    // Nor may an operator purge it while the copy may run: a retry would
    // then be forwarded beside it.
    let purged = o
        .store
        .purge("route", "held-uncertain", None)
        .await
        .unwrap();
    assert_eq!((purged.removed, purged.held), (0, 1));
    tokio::time::sleep(Duration::from_millis(700)).await;
    let claims = (0..50).map(|_| {
        let (store, k) = (o.store.clone(), k.clone());
        tokio::spawn(async move { store.claim(&k, "fp", "d").await.unwrap() })
    });
    let answers: Vec<Claim> = futures_util::future::join_all(claims)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let takeovers: Vec<_> = answers
        .iter()
        .filter_map(|c| match c {
            Claim::Won { maybe_ran, .. } => Some(*maybe_ran),
            _ => None,
        })
        .collect();
    assert_eq!(
        takeovers,
        [true],
        "one takeover, told the last attempt may have run"
    );
    // A release is a clean slate: no attempt left that may have acted.
    let retry = match answers.iter().find(|c| matches!(c, Claim::Won { .. })) {
        Some(Claim::Won { epoch, .. }) => *epoch,
        _ => unreachable!(),
    };
    assert!(o.store.release(&k, retry).await.unwrap());
    assert!(matches!(
        o.store.claim(&k, "fp", "e").await.unwrap(),
        Claim::Won {
            maybe_ran: false,
            ..
        }
    ));
}

/// Reconciliation's answer completes an uncertain record, fenced by that
/// record's epoch: only the uncertain attempt it describes.
async fn a_reconciled_answer_completes_only_its_uncertain_record(backend: Backend, test: &str) {
    let Some(o) = open(backend, test, LONG, LONG).await else {
        return;
    };
    let k = key("reconciled");
    let epoch = won(o.store.claim(&k, "fp", "a").await.unwrap());
    // Not uncertain yet: refused.
    assert!(
        !o.store
            .complete_reconciled(&k, epoch, "fp", &response("ran"), 0)
            .await
            .unwrap()
    );
    assert!(o.store.mark_uncertain(&k, epoch, LONG).await.unwrap());
    assert!(
        !o.store
            .complete_reconciled(&k, epoch + 1, "fp", &response("ran"), 0)
            .await
            .unwrap()
    );
    assert!(
        o.store
            .complete_reconciled(&k, epoch, "fp", &response("ran"), 0)
            .await
            .unwrap()
    );
    assert_eq!(
        completed(o.store.claim(&k, "fp", "b").await.unwrap()),
        response("ran")
    );
}

/// Every answer names the record's expiry: its claim plus the retention,
/// by the database's clock, the same on the claim and on every replay.
async fn every_answer_carries_the_records_expiry(backend: Backend, test: &str) {
    let retention = Duration::from_secs(3600);
    let Some(o) = open(backend, test, LONG, retention).await else {
        return;
    };
    let k = key("expiry");
    let before = idemgate_store::now_ms();
    let (epoch, expires) = match o.store.claim(&k, "fp", "a").await.unwrap() {
        Claim::Won {
            epoch,
            expires_at_ms,
            ..
        } => (epoch, expires_at_ms),
        other => panic!("{other:?}"),
    };
    let expected = before + retention.as_millis() as i64;
    assert!(
        (expires - expected).abs() < 5_000,
        "{expires} vs {expected}"
    );
    let in_flight = o.store.claim(&k, "fp", "b").await.unwrap();
    assert!(matches!(in_flight, Claim::InFlight { .. }));
    assert!((in_flight.expires_at_ms() - expires).abs() < 5_000);
    assert!(
        o.store
            .complete(&k, epoch, "fp", &response("x"), expires)
            .await
            .unwrap()
    );
    for _ in 0..2 {
        // Once from SQL, once from the fast layer it re-cached.
        let replay = o.store.claim(&k, "fp", "c").await.unwrap();
        assert_eq!(replay.expires_at_ms(), expires, "{replay:?}");
        let mismatch = o.store.claim(&k, "other", "d").await.unwrap();
        assert_eq!(mismatch.expires_at_ms(), expires, "{mismatch:?}");
    }
}

/// `store.tombstone`: after the retention the same request is told the key
/// expired (never executed again) and another request is a mismatch, even
/// once the sweep has dropped the stored answer; after the tombstone the
/// sweep forgets the record and the key is new.
async fn a_tombstone_outlives_the_retention_then_is_swept(backend: Backend, test: &str) {
    let retention = Duration::from_millis(300);
    let tombstone = Duration::from_millis(1500);
    let Some(o) = open_with_tombstone(backend, test, LONG, retention, tombstone).await else {
        return;
    };
    let k = key("tomb");
    let epoch = won(o.store.claim(&k, "fp", "a").await.unwrap());
    assert!(
        o.store
            .complete(&k, epoch, "fp", &response("done"), 0)
            .await
            .unwrap()
    );
    tokio::time::sleep(Duration::from_millis(450)).await;
    assert!(matches!(
        o.store.claim(&k, "fp", "b").await.unwrap(),
        Claim::Expired { .. }
    ));
    assert!(matches!(
        o.store.claim(&k, "other", "c").await.unwrap(),
        Claim::Mismatch { .. }
    ));
    // The sweep keeps the tombstone and drops its answer.
    assert_eq!(sweep_once(o.store.sql(), false).await.unwrap(), 0);
    let record = o.store.get(&k).await.unwrap().expect("tombstone kept");
    assert_eq!(record.describe()["phase"], "tombstone");
    let kept = record.response.expect("its status stays");
    assert!(kept.body.is_empty() && kept.headers.is_empty(), "{kept:?}");
    assert!(matches!(
        o.store.claim(&k, "fp", "d").await.unwrap(),
        Claim::Expired { .. }
    ));
    // The tombstone's end, then its partition's.
    tokio::time::sleep(Duration::from_millis(1500) + PAST_PARTITION).await;
    assert_eq!(sweep_once(o.store.sql(), false).await.unwrap(), 1);
    assert!(o.store.get(&k).await.unwrap().is_none());
    assert!(matches!(
        o.store.claim(&k, "fp", "e").await.unwrap(),
        Claim::Won {
            maybe_ran: false,
            ..
        }
    ));
}

macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod sqlite { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::$name(Backend::Sqlite, concat!("sqlite::", stringify!($name))).await } )* }
        mod postgres { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::$name(Backend::Postgres, concat!("postgres::", stringify!($name))).await } )* }
        mod redis_postgres { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::$name(Backend::RedisPostgres, concat!("redis_postgres::", stringify!($name))).await } )* }
        mod memory_sqlite { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::$name(Backend::MemorySqlite, concat!("memory_sqlite::", stringify!($name))).await } )* }
        mod mysql { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::$name(Backend::Mysql, concat!("mysql::", stringify!($name))).await } )* }
        mod redis_mysql { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::$name(Backend::RedisMysql, concat!("redis_mysql::", stringify!($name))).await } )* }
    };
}

conformance!(
    concurrent_claims_have_one_winner,
    a_burst_is_written_row_by_row_correctly,
    independent_stores_racing_have_one_winner,
    completed_claims_replay_and_mismatch,
    expired_lease_is_taken_over_and_the_old_holder_fenced,
    released_claims_can_be_claimed_again,
    uncertain_records_are_retried_by_the_same_request_only,
    sweep_removes_or_archives_expired_records,
    purge_removes_every_scope,
    an_uncertain_record_is_held_then_taken_over_once,
    a_reconciled_answer_completes_only_its_uncertain_record,
    every_answer_carries_the_records_expiry,
    a_tombstone_outlives_the_retention_then_is_swept,
    a_dead_letter_copy_has_one_publisher,
    keys_that_differ_in_case_or_trailing_space_are_different_records,
);
