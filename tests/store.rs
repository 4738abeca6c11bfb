//! The store conformance suite, run against every combination the gateway
//! supports: SQLite alone, Postgres alone, Redis + Postgres, and the
//! in-process layer + SQLite. Real servers, never mocks; every test has its
//! own schema, key prefix or database file.

mod support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idemgate::metrics::{FallbackLayer, Metrics};
use idemgate::store::memory::MemoryLayer;
use idemgate::store::redis::RedisLayer;
use idemgate::store::sql::{SqlSettings, SqlStore};
use idemgate::store::{
    Claim, FastLayer, RecordKey, RecordState, Store, StoreSettings, StoredResponse, sweep,
};
use support::services;

#[derive(Clone, Copy, Debug)]
enum Backend {
    Sqlite,
    Postgres,
    RedisPostgres,
    MemorySqlite,
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

async fn sql_store(backend: Backend, test: &str) -> Option<(SqlStore, Option<tempfile::TempDir>)> {
    let (url, dir) = match backend {
        Backend::Sqlite | Backend::MemorySqlite => {
            let dir = tempfile::tempdir().unwrap();
            (
                format!("sqlite://{}/records.db", dir.path().display()),
                Some(dir),
            )
        }
        Backend::Postgres | Backend::RedisPostgres => (services::postgres(test).await?, None),
    };
    let sql = SqlStore::connect(&SqlSettings {
        url,
        pool_size: 8,
        timeout: Duration::from_secs(2),
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
    let (sql, dir) = sql_store(backend, test).await?;
    let fast: Option<Arc<dyn FastLayer>> = match backend {
        Backend::Sqlite | Backend::Postgres => None,
        Backend::MemorySqlite => Some(Arc::new(MemoryLayer::new(10_000))),
        Backend::RedisPostgres => {
            let (url, prefix) = services::redis(test).await?;
            Some(Arc::new(
                RedisLayer::new(&url, &prefix, Duration::from_millis(200)).unwrap(),
            ))
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
        body: Bytes::from_static(body.as_bytes()),
        body_kept: true,
        request_id: "req-1".into(),
    }
}

fn key(k: &str) -> RecordKey {
    RecordKey::new("scope-a", "route", k)
}

const LONG: Duration = Duration::from_secs(60);

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

/// Check-and-claim is one atomic statement, not a read then a write: two
/// stores with pools of their own (as two gateway instances have) race on
/// one key, and the database alone decides. A single store's batch writer
/// serialises its own claims, so it could not show this.
async fn independent_stores_racing_have_one_winner(backend: Backend, test: &str) {
    let (sql_a, dir) = match sql_store(backend, test).await {
        Some(s) => s,
        None => return,
    };
    let url = match (&backend, &dir) {
        (Backend::Sqlite | Backend::MemorySqlite, Some(dir)) => {
            format!("sqlite://{}/records.db", dir.path().display())
        }
        _ => sql_a.url_for_tests().to_owned(),
    };
    let sql_b = SqlStore::connect(&SqlSettings {
        url,
        pool_size: 8,
        timeout: Duration::from_secs(2),
    })
    .await
    .unwrap();
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

async fn completed_claims_replay_and_mismatch(backend: Backend, test: &str) {
    let Some(o) = open(backend, test, LONG, LONG).await else {
        return;
    };
    let k = key("done");
    let Claim::Won { epoch } = o.store.claim(&k, "fp", "rid").await.unwrap() else {
        panic!()
    };
    assert_eq!(
        o.store.claim(&k, "other", "rid2").await.unwrap(),
        Claim::Mismatch
    );
    assert!(
        o.store
            .complete(&k, epoch, "fp", &response("{\"ok\":1}"))
            .await
            .unwrap()
    );
    assert_eq!(
        o.store.claim(&k, "fp", "rid3").await.unwrap(),
        Claim::Completed(response("{\"ok\":1}"))
    );
    assert_eq!(
        o.store.claim(&k, "other", "rid4").await.unwrap(),
        Claim::Mismatch
    );
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

async fn expired_lease_is_taken_over_and_the_old_holder_fenced(backend: Backend, test: &str) {
    let Some(o) = open(backend, test, Duration::from_millis(200), LONG).await else {
        return;
    };
    let k = key("lease");
    let Claim::Won { epoch: first } = o.store.claim(&k, "fp", "a").await.unwrap() else {
        panic!()
    };
    assert!(matches!(
        o.store.claim(&k, "fp", "b").await.unwrap(),
        Claim::InFlight { .. }
    ));
    tokio::time::sleep(Duration::from_millis(350)).await;
    let Claim::Won { epoch: second } = o.store.claim(&k, "fp", "c").await.unwrap() else {
        panic!("expired lease not taken over")
    };
    assert!(second > first);
    // The paused first holder wakes up: its writes are refused.
    assert!(
        !o.store
            .complete(&k, first, "fp", &response("late"))
            .await
            .unwrap()
    );
    assert!(!o.store.release(&k, first).await.unwrap());
    assert!(!o.store.renew(&k, first).await.unwrap());
    assert!(
        o.store
            .complete(&k, second, "fp", &response("new"))
            .await
            .unwrap()
    );
    assert_eq!(
        o.store.claim(&k, "fp", "d").await.unwrap(),
        Claim::Completed(response("new"))
    );
}

async fn released_claims_can_be_claimed_again(backend: Backend, test: &str) {
    let Some(o) = open(backend, test, LONG, LONG).await else {
        return;
    };
    let k = key("release");
    let Claim::Won { epoch } = o.store.claim(&k, "fp", "a").await.unwrap() else {
        panic!()
    };
    assert!(o.store.release(&k, epoch).await.unwrap());
    let Claim::Won { epoch: again } = o.store.claim(&k, "fp2", "b").await.unwrap() else {
        panic!("released key not claimable")
    };
    assert!(again > epoch);
    assert!(
        !o.store
            .complete(&k, epoch, "fp", &response("stale"))
            .await
            .unwrap()
    );
}

async fn uncertain_records_are_retried_by_the_same_request_only(backend: Backend, test: &str) {
    let Some(o) = open(backend, test, LONG, LONG).await else {
        return;
    };
    let k = key("uncertain");
    let Claim::Won { epoch } = o.store.claim(&k, "fp", "a").await.unwrap() else {
        panic!()
    };
    assert!(o.store.mark_uncertain(&k, epoch).await.unwrap());
    assert_eq!(
        o.store.get(&k).await.unwrap().unwrap().state,
        RecordState::Uncertain
    );
    assert_eq!(
        o.store.claim(&k, "other", "b").await.unwrap(),
        Claim::Mismatch
    );
    let Claim::Won { epoch: retry } = o.store.claim(&k, "fp", "c").await.unwrap() else {
        panic!()
    };
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
        let Claim::Won { epoch } = o.store.claim(&k, "fp", "r").await.unwrap() else {
            panic!()
        };
        assert!(
            o.store
                .complete(&k, epoch, "fp", &response("x"))
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
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(sweep::sweep_once(o.store.sql(), false).await.unwrap(), 3);
    assert!(o.store.get(&key("old-0")).await.unwrap().is_none());
    assert!(o.store.get(&held).await.unwrap().is_some());
    // Archive mode moves rows instead.
    let k = key("archived");
    let Claim::Won { epoch } = o.store.claim(&k, "fp", "r").await.unwrap() else {
        panic!()
    };
    assert!(
        o.store
            .complete(&k, epoch, "fp", &response("x"))
            .await
            .unwrap()
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(sweep::sweep_once(o.store.sql(), true).await.unwrap(), 1);
    assert_eq!(o.store.sql().archived().await.unwrap(), 1);
    assert!(o.store.get(&k).await.unwrap().is_none());
}

async fn purge_removes_every_scope(backend: Backend, test: &str) {
    let Some(o) = open(backend, test, LONG, LONG).await else {
        return;
    };
    for scope in ["s1", "s2"] {
        let k = RecordKey::new(scope, "route", "purge-me");
        let Claim::Won { epoch } = o.store.claim(&k, "fp", "r").await.unwrap() else {
            panic!()
        };
        assert!(
            o.store
                .complete(&k, epoch, "fp", &response("x"))
                .await
                .unwrap()
        );
    }
    assert_eq!(o.store.find("route", "purge-me").await.unwrap().len(), 2);
    let purged = |removed, held| idemgate::store::sql::Purged { removed, held };
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
    let Claim::Won { epoch: first } = o.store.claim(&k, "fp", "r").await.unwrap() else {
        panic!("purged key not reusable")
    };
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
    let Claim::Won { epoch: second } = o.store.claim(&k, "fp", "r3").await.unwrap() else {
        panic!()
    };
    assert!(second > first, "epochs only grow: {first} then {second}");
    assert!(!o.store.release(&k, first).await.unwrap());
    assert!(!o.store.mark_uncertain(&k, first).await.unwrap());
    assert!(
        !o.store
            .complete(&k, first, "fp", &response("stale"))
            .await
            .unwrap()
    );
}

macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod sqlite { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::$name(Backend::Sqlite, concat!("sqlite::", stringify!($name))).await } )* }
        mod postgres { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::$name(Backend::Postgres, concat!("postgres::", stringify!($name))).await } )* }
        mod redis_postgres { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::$name(Backend::RedisPostgres, concat!("redis_postgres::", stringify!($name))).await } )* }
        mod memory_sqlite { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::$name(Backend::MemorySqlite, concat!("memory_sqlite::", stringify!($name))).await } )* }
    };
}

conformance!(
    concurrent_claims_have_one_winner,
    independent_stores_racing_have_one_winner,
    completed_claims_replay_and_mismatch,
    expired_lease_is_taken_over_and_the_old_holder_fenced,
    released_claims_can_be_claimed_again,
    uncertain_records_are_retried_by_the_same_request_only,
    sweep_removes_or_archives_expired_records,
    purge_removes_every_scope,
);
