//! The store under real faults: a private Redis killed, paused, flushed or
//! poisoned; Postgres made unreachable behind a fault proxy. The SQL record
//! keeps the answer right, and an unreachable SQL store fails closed, fast.

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use idemgate_core::metrics::Metrics;
use idemgate_store::StoreSettings;
use idemgate_store::testing::FastLayer;
use idemgate_store::testing::RedisLayer;
use idemgate_store::testing::storage_key;
use idemgate_store::{Claim, RecordKey, Store, StoreError};
use idemgate_store::{SqlSettings, SqlStore};
use support::services::{self, FaultProxy, Mode, PrivateRedis};

const PREFIX: &str = "idemgate-test:";

async fn redis_store(test: &str) -> Option<(Store, PrivateRedis, Arc<Metrics>)> {
    let redis = PrivateRedis::start(test).await?;
    let url = services::shared_sql(test).await?;
    let sql = SqlStore::connect(&SqlSettings {
        url,
        pool_size: 8,
        timeout: Duration::from_secs(2),
        tombstone: Duration::ZERO,
        schema: None,
        retention: settings().retention,
        partition_span: settings().retention,
    })
    .await
    .unwrap();
    sql.migrate().await.unwrap();
    // As the gateway composes it: Redis behind this process's copies of
    // the answers it replays.
    let fast: Arc<dyn FastLayer> = Arc::new(idemgate_store::testing::NearLayer::new(
        Arc::new(RedisLayer::new(&redis.url(), PREFIX, Duration::from_millis(100)).unwrap()),
        Arc::new(idemgate_store::MemoryLayer::new(10_000)),
    ));
    let metrics = Arc::new(Metrics::default());
    Some((
        Store::new(sql, Some(fast), settings(), metrics.clone()),
        redis,
        metrics,
    ))
}

fn settings() -> StoreSettings {
    StoreSettings {
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(60),
        fast_layer_budget: Duration::from_millis(100),
    }
}

/// A store on Postgres alone (no fast layer) at `url`.
async fn sql_store(url: String, timeout: Duration) -> Store {
    let sql = SqlStore::connect(&SqlSettings {
        url,
        pool_size: 4,
        timeout,
        tombstone: Duration::ZERO,
        schema: None,
        retention: settings().retention,
        partition_span: settings().retention,
    })
    .await
    .unwrap();
    sql.migrate().await.unwrap();
    Store::new(sql, None, settings(), Arc::new(Metrics::default()))
}

fn fallbacks(metrics: &Metrics) -> u64 {
    let text = metrics.render();
    text.lines()
        .find(|l| l.starts_with("idemgate_store_fallback_total{layer=\"redis\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap()
}

async fn storm(store: &Store, key: &RecordKey, n: usize) -> (usize, usize) {
    let claims = (0..n).map(|_| {
        let store = store.clone();
        let key = key.clone();
        tokio::spawn(async move { store.claim(&key, "fp", "r").await.unwrap() })
    });
    let results = futures_util::future::join_all(claims).await;
    let won = results
        .iter()
        .filter(|r| matches!(r.as_ref().unwrap(), Claim::Won { .. }))
        .count();
    (won, n - won)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_flushed_between_claim_and_duplicate_still_one_winner() {
    let Some((store, redis, _)) = redis_store("redis_flushed_between_claim_and_duplicate").await
    else {
        return;
    };
    let key = RecordKey::new("s", "r", "flushed");
    assert!(matches!(
        store.claim(&key, "fp", "r").await.unwrap(),
        Claim::Won { .. }
    ));
    redis.flushall().await;
    let (won, _) = storm(&store, &key, 100).await;
    assert_eq!(won, 0, "a duplicate won after Redis lost its keys");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_before_and_during_a_storm_falls_back_to_sql() {
    let Some((store, mut redis, metrics)) =
        redis_store("redis_killed_before_and_during_a_storm").await
    else {
        return;
    };
    // Killed mid-storm.
    let key = RecordKey::new("s", "r", "mid-storm");
    let store2 = store.clone();
    let key2 = key.clone();
    let storm_task = tokio::spawn(async move { storm(&store2, &key2, 300).await });
    tokio::time::sleep(Duration::from_millis(5)).await;
    redis.kill();
    let (won, _) = storm_task.await.unwrap();
    assert_eq!(won, 1);
    // Dead before the storm.
    let key = RecordKey::new("s", "r", "after-kill");
    let (won, _) = storm(&store, &key, 200).await;
    assert_eq!(won, 1);
    assert!(fallbacks(&metrics) > 0, "fallbacks were not counted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_redis_costs_the_budget_not_correctness() {
    let Some((store, redis, metrics)) = redis_store("paused_redis_costs_the_budget").await else {
        return;
    };
    let key = RecordKey::new("s", "r", "paused");
    redis.signal("-STOP");
    let started = Instant::now();
    let (won, _) = storm(&store, &key, 50).await;
    redis.signal("-CONT");
    assert_eq!(won, 1);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?}",
        started.elapsed()
    );
    assert!(fallbacks(&metrics) >= 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poisoned_redis_values_never_override_sql() {
    let Some((store, redis, metrics)) = redis_store("poisoned_redis_values").await else {
        return;
    };
    let key = RecordKey::new("s", "r", "poisoned");
    let Claim::Won { .. } = store.claim(&key, "fp", "r").await.unwrap() else {
        panic!()
    };
    let client = redis::Client::open(redis.url().as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    // Garbage, and a well-formed completed entry for another scope.
    for poison in [
        b"{\"status\":200,\"body\":\"free money\"}".to_vec(),
        idemgate_store::testing::encode_entry(&idemgate_store::testing::FastEntry::Completed {
            key: RecordKey::new("other-client", "r", "poisoned"),
            fingerprint: "fp".into(),
            response: idemgate_store::StoredResponse {
                status: 200,
                headers: vec![],
                trailers: Vec::new(),
                body: bytes::Bytes::from_static(b"someone else's"),
                body_kept: true,
                request_id: "x".into(),
            },
            expires_at_ms: i64::MAX,
        }),
    ] {
        redis::cmd("SET")
            .arg(storage_key(PREFIX, &key))
            .arg(poison)
            .query_async::<()>(&mut conn)
            .await
            .unwrap();
        let answer = store.claim(&key, "fp", "r2").await.unwrap();
        assert!(matches!(answer, Claim::InFlight { .. }), "{answer:?}");
    }
    assert!(fallbacks(&metrics) >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_postgres_fails_closed_within_the_timeout_and_recovers() {
    let test = "unreachable_postgres_fails_closed";
    let Some(url) = services::shared_sql(test).await else {
        return;
    };
    let proxy = FaultProxy::start(services::sql_addr(&url)).await;
    let proxied = services::via(&url, proxy.port);
    let store = sql_store(proxied, Duration::from_millis(500)).await;
    let key = RecordKey::new("s", "r", "down");
    for mode in [Mode::Blackhole, Mode::Refuse] {
        proxy.set(mode);
        let started = Instant::now();
        let err = store.claim(&key, "fp", "r").await.unwrap_err();
        assert!(
            matches!(
                err,
                StoreError::Timeout { .. } | StoreError::Unavailable { .. }
            ),
            "{err:?}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{mode:?} took {:?}",
            started.elapsed()
        );
    }
    proxy.set(Mode::Pass);
    // A claim racing the cut may have committed with its answer lost; that
    // key then correctly reads "in flight". Recovery is judged on a fresh key.
    let fresh = RecordKey::new("s", "r", "after-recovery");
    let recovered = support::eventually(Duration::from_secs(10), || {
        let store = store.clone();
        let fresh = fresh.clone();
        async move { matches!(store.claim(&fresh, "fp", "r").await, Ok(Claim::Won { .. })) }
    })
    .await;
    assert!(
        recovered,
        "the store did not recover once Postgres was back"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_postgres_connections_killed_while_idle_are_replaced_not_failed() {
    let test = "pooled_postgres_connections_killed_while_idle";
    let Some(url) = services::postgres(test).await else {
        return;
    };
    // A name to find this pool's backends by, and only them.
    let app = format!("idemgate_{}", uuid::Uuid::now_v7().simple());
    let store = sql_store(
        format!("{url}&application_name={app}"),
        Duration::from_secs(2),
    )
    .await;
    let claim = |key: &str| {
        let store = store.clone();
        let key = RecordKey::new("s", "r", key);
        async move { store.claim(&key, "fp", "r").await }
    };
    assert!(matches!(claim("before").await, Ok(Claim::Won { .. })));
    // Postgres drops every connection of the pool (a restart, a failover,
    // an idle-connection reaper in between) while the pool is idle.
    let base = url.split('?').next().unwrap().to_owned();
    kill_backends(&base, &app).await;
    // Past the idle threshold, a checkout pings and replaces dead connections
    // (the batch writer's kept one included): the very next claim succeeds,
    // none fails on a dead connection.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for i in 0..8 {
        let result = claim(&format!("after-{i}")).await;
        assert!(
            matches!(result, Ok(Claim::Won { .. })),
            "claim {i}: {result:?}"
        );
    }
    // Killed again with no pause (a restart under load): a batch that meets
    // a dead connection fails closed, that connection is dropped, and
    // claims recover once each dead one has been met (at most the writer's
    // kept connection and the pool's four).
    kill_backends(&base, &app).await;
    let mut outcomes = Vec::new();
    for i in 0..12 {
        let result = claim(&format!("busy-{i}")).await;
        assert!(
            matches!(
                result,
                Ok(Claim::Won { .. }) | Err(StoreError::Unavailable { .. })
            ),
            "claim {i}: {result:?}"
        );
        outcomes.push(result.is_ok());
    }
    assert!(
        outcomes.iter().filter(|ok| !**ok).count() <= 5,
        "{outcomes:?}"
    );
    assert!(outcomes[9..].iter().all(|ok| *ok), "{outcomes:?}");
}

/// Terminates every Postgres backend of the pool named `app`.
async fn kill_backends(base: &str, app: &str) {
    use sqlx::Connection;
    let mut admin = sqlx::PgConnection::connect(base).await.unwrap();
    let killed: Vec<(bool,)> = sqlx::query_as(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
    )
    .bind(app)
    .fetch_all(&mut admin)
    .await
    .unwrap();
    assert!(!killed.is_empty(), "no backend of the pool was found");
}

/// A purge this process could not read about must not be replayed from
/// its memory: when the purge log cannot be read (here its table is gone),
/// the answers the in-process layer holds stop being replayed within the
/// purge's wait, `SETTLE` — the same for every process whatever its own
/// `store.timeout` (here 10 s: the purger may have been given 500 ms).
/// Before: the follower logged the failure and the layer kept replaying;
/// then, its trust was derived from its own timeout (11.3 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_that_cannot_read_the_purge_log_stops_replays_from_memory() {
    use idemgate_store::MemoryLayer;
    use idemgate_store::testing::FastEntry;
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/follow.db?mode=rwc", dir.path().display());
    let sql = SqlStore::connect(&SqlSettings {
        url: url.clone(),
        pool_size: 2,
        timeout: Duration::from_secs(10),
        tombstone: Duration::ZERO,
        schema: None,
        retention: settings().retention,
        partition_span: settings().retention,
    })
    .await
    .unwrap();
    sql.migrate().await.unwrap();
    let memory = Arc::new(MemoryLayer::new(100));
    let key = RecordKey::new("s", "orders", "k-1");
    let entry = FastEntry::Completed {
        key: key.clone(),
        fingerprint: "fp".into(),
        response: idemgate_store::StoredResponse {
            status: 201,
            headers: vec![],
            trailers: Vec::new(),
            body: bytes::Bytes::from_static(b"{}"),
            body_kept: true,
            request_id: "rid".into(),
        },
        expires_at_ms: 0,
    };
    memory.put(&entry, Duration::from_secs(60)).await.unwrap();
    let follower = idemgate_store::follow_purges(sql.clone(), memory.clone());
    // Reads succeed: what it holds stays.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(memory.peek(&key).is_some());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    sqlx::query("DROP TABLE idempotency_purges")
        .execute(&pool)
        .await
        .unwrap();
    let deadline =
        Instant::now() + idemgate_store::testing::PURGE_SETTLE + Duration::from_millis(500);
    while memory.peek(&key).is_some() {
        assert!(
            Instant::now() < deadline,
            "still replayable after the log failed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    follower.abort();
}
