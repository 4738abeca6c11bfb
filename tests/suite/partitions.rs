//! Retention at scale on Postgres: the record table is partitioned by
//! expiry, and a key must still have one record, whichever partitions its
//! claims' expiries fall in. Two stores with pools of their own (and two
//! gateway processes) race across partition boundaries; whole partitions
//! are retired (dropped, or kept as an archive) unless a live lease holds
//! one; a table left by an earlier release becomes a partition, its
//! records still answering.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idemgate_core::metrics::Metrics;
use idemgate_demo_upstream as demo_upstream;
use idemgate_store::StoreSettings;
use idemgate_store::{Claim, RecordKey, Store, StoredResponse};
use idemgate_store::{SqlSettings, SqlStore};
use support::{Http, instances, services};

/// The narrowest partition, as these tests' short retentions get.
const SPAN: Duration = Duration::from_secs(1);

async fn sql(url: &str, retention: Duration) -> SqlStore {
    SqlStore::connect(&SqlSettings {
        url: url.to_owned(),
        pool_size: 8,
        timeout: Duration::from_secs(2),
        tombstone: Duration::ZERO,
        schema: None,
        retention,
        // As the gateway sizes them: a partition per retention.
        partition_span: idemgate_store::testing::partition_span(retention, SPAN),
    })
    .await
    .unwrap()
}

fn store(sql: SqlStore, lease: Duration, retention: Duration) -> Store {
    let settings = StoreSettings {
        lease,
        retention,
        fast_layer_budget: Duration::from_millis(200),
    };
    Store::new(sql, None, settings, Arc::new(Metrics::default()))
}

fn key(k: &str) -> RecordKey {
    RecordKey::new("scope-a", "route", k)
}

fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), b"application/json".to_vec())],
        trailers: Vec::new(),
        body: Bytes::from_static(b"{\"ok\":true}"),
        body_kept: true,
        request_id: "req-1".into(),
    }
}

/// A plain connection to the test's schema, for looking at the catalog.
async fn catalog(url: &str) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(url)
        .await
        .unwrap()
}

/// Keys with more than one row, over every partition.
async fn keys_with_two_rows(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT 1 FROM idempotency_records \
         GROUP BY route, idem_key, scope HAVING count(*) > 1) AS twice",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn table_exists(pool: &sqlx::PgPool, name: &str) -> bool {
    sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The partition a key's row is in.
async fn partition_of(pool: &sqlx::PgPool, k: &RecordKey) -> String {
    sqlx::query_scalar(
        "SELECT tableoid::regclass::text FROM idempotency_records \
         WHERE route = $1 AND idem_key = $2 AND scope = $3",
    )
    .bind(&k.route)
    .bind(&k.key)
    .bind(&k.scope)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Sleeps until just past the next whole second: the next partition.
async fn into_the_next_partition() {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let into = Duration::from_nanos(u64::from(now.subsec_nanos()));
    tokio::time::sleep(SPAN - into + Duration::from_millis(50)).await;
}

/// Fresh keys raced by two stores, batched and single claims alike: no
/// unique index spans the partitions, so only the claim's key lock stands
/// between two racing inserts and two winners (two rows) for one key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_keys_raced_by_two_stores_have_one_winner_and_one_row() {
    let Some(url) = services::postgres("fresh_keys_raced_by_two_stores").await else {
        return;
    };
    let a = sql(&url, Duration::from_secs(60)).await;
    a.migrate().await.unwrap();
    let b = sql(&url, Duration::from_secs(60)).await;
    let long = Duration::from_secs(60);
    let (a, b) = (store(a, long, long), store(b, long, long));
    for round in 0..20 {
        let claims = (0..100).map(|i| {
            let store = if i % 2 == 0 { a.clone() } else { b.clone() };
            // Five keys a round, twenty claims each.
            let k = key(&format!("fresh-{round}-{}", i % 5));
            tokio::spawn(async move { (k.key.clone(), store.claim(&k, "fp", "r").await.unwrap()) })
        });
        let mut wins = std::collections::BTreeMap::<String, u32>::new();
        for (k, claim) in futures_util::future::join_all(claims)
            .await
            .into_iter()
            .map(Result::unwrap)
        {
            *wins.entry(k).or_default() += u32::from(matches!(claim, Claim::Won { .. }));
        }
        assert!(wins.values().all(|w| *w == 1), "round {round}: {wins:?}");
    }
    assert_eq!(keys_with_two_rows(&catalog(&url).await).await, 0);
}

/// A key whose record expired in an earlier partition is claimed again by
/// 200 concurrent requests on two stores: the successor's expiry falls in
/// a later partition, and still only one of them wins; the old row is gone
/// (moved, not copied), so the key has one record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_key_reclaimed_across_partitions_has_one_winner() {
    let Some(url) = services::postgres("an_expired_key_reclaimed_across_partitions").await else {
        return;
    };
    let retention = Duration::from_millis(200);
    let lease = Duration::from_secs(60);
    let a = sql(&url, retention).await;
    a.migrate().await.unwrap();
    let b = sql(&url, retention).await;
    let sweeper = a.clone();
    let (a, b) = (store(a, lease, retention), store(b, lease, retention));
    let pool = catalog(&url).await;
    for round in 0..3 {
        let k = key(&format!("again-{round}"));
        // What the sweeper does: partitions a few spans ahead.
        sweeper.extend_partitions().await.unwrap();
        into_the_next_partition().await;
        let epoch = match a.claim(&k, "fp", "first").await.unwrap() {
            Claim::Won { epoch, .. } => epoch,
            other => panic!("{other:?}"),
        };
        assert!(a.complete(&k, epoch, "fp", &response(), 0).await.unwrap());
        let before = partition_of(&pool, &k).await;
        // Past the retention, and into the next partition.
        into_the_next_partition().await;
        let claims = (0..200).map(|i| {
            let store = if i % 2 == 0 { a.clone() } else { b.clone() };
            let k = k.clone();
            tokio::spawn(async move { store.claim(&k, "fp", "again").await.unwrap() })
        });
        let won = futures_util::future::join_all(claims)
            .await
            .into_iter()
            .filter(|c| matches!(c.as_ref().unwrap(), Claim::Won { .. }))
            .count();
        assert_eq!(won, 1, "round {round}");
        let after = partition_of(&pool, &k).await;
        assert_ne!(before, after, "the successor lives in a later partition");
        assert!(!after.ends_with("default"), "{after}");
        assert_eq!(keys_with_two_rows(&pool).await, 0);
    }
}

/// Past its expiries a partition goes whole: dropped, or with
/// `store.archive` detached and kept under an archive name, its rows
/// counted as archived. A partition a live lease still holds stays, and
/// only its free rows are swept; it goes once the lease is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_partitions_are_retired_whole_unless_a_lease_holds_them() {
    let Some(url) = services::postgres("expired_partitions_are_retired_whole").await else {
        return;
    };
    let retention = Duration::from_millis(100);
    let sql_store = sql(&url, retention).await;
    sql_store.migrate().await.unwrap();
    let short = store(sql_store.clone(), Duration::from_millis(1500), retention);
    let pool = catalog(&url).await;

    into_the_next_partition().await;
    let mut dropped = Vec::new();
    for i in 0..20 {
        let k = key(&format!("done-{i}"));
        let Claim::Won { epoch, .. } = short.claim(&k, "fp", "r").await.unwrap() else {
            panic!("not won");
        };
        assert!(
            short
                .complete(&k, epoch, "fp", &response(), 0)
                .await
                .unwrap()
        );
        dropped.push(k);
    }
    let first = partition_of(&pool, &dropped[0]).await;
    into_the_next_partition().await;
    // The next partition: one record whose lease (1.5 s) outlives it.
    let held = key("held");
    assert!(matches!(
        short.claim(&held, "fp", "r").await.unwrap(),
        Claim::Won { .. }
    ));
    let free = key("free");
    let Claim::Won { epoch, .. } = short.claim(&free, "fp", "r").await.unwrap() else {
        panic!("not won");
    };
    assert!(
        short
            .complete(&free, epoch, "fp", &response(), 0)
            .await
            .unwrap()
    );
    let second = partition_of(&pool, &held).await;
    assert_ne!(first, second);
    into_the_next_partition().await;

    assert_eq!(
        idemgate_store::sweep_once(&sql_store, false).await.unwrap(),
        21
    );
    assert!(!table_exists(&pool, &first).await, "{first} dropped whole");
    assert!(table_exists(&pool, &second).await, "{second} is held");
    assert!(short.get(&held).await.unwrap().is_some());
    assert!(short.get(&free).await.unwrap().is_none());

    // The lease runs out: the held partition goes too, kept as archive.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        idemgate_store::sweep_once(&sql_store, true).await.unwrap(),
        1
    );
    assert!(!table_exists(&pool, &second).await);
    let archived = second.replace("idempotency_records_", "idempotency_archive_");
    assert!(table_exists(&pool, &archived).await, "{archived} kept");
    assert_eq!(sql_store.archived().await.unwrap(), 1);
    // Retiring never touched the claims' path: new keys still claim.
    assert!(matches!(
        short.claim(&key("after"), "fp", "r").await.unwrap(),
        Claim::Won { .. }
    ));
}

/// A database an earlier release left (one unpartitioned table) is
/// migrated in place: the table becomes the partition of every expiry up
/// to its newest, its records replay and fence as before, and new claims
/// land in the partitions made ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_left_by_an_earlier_release_becomes_a_partition() {
    let Some(url) = services::postgres("a_table_left_by_an_earlier_release").await else {
        return;
    };
    let long = Duration::from_secs(3600);
    let old = sql(&url, long).await;
    old.migrate_until(Some(5)).await.unwrap();
    let pool = catalog(&url).await;
    // As the previous release wrote them: one completed, one in flight.
    for (k, state, status) in [
        ("kept", "completed", Some(201)),
        ("running", "in_flight", None),
    ] {
        sqlx::query(
            "INSERT INTO idempotency_records (route, idem_key, scope, fingerprint, state, epoch, \
             lease_until, request_id, status, headers, body, body_kept, created_at, updated_at, \
             expires_at) VALUES ('route', $1, 'scope-a', 'fp', $2, 7, \
             (extract(epoch from now()) * 1000)::bigint + 600000, 'old', $3, NULL, \
             '{\"old\":true}', TRUE, 0, 0, (extract(epoch from now()) * 1000)::bigint + 3600000)",
        )
        .bind(k)
        .bind(state)
        .bind(status)
        .execute(&pool)
        .await
        .unwrap();
    }
    drop(old);
    let new = sql(&url, long).await;
    new.migrate().await.unwrap();
    let kind: String = sqlx::query_scalar(
        "SELECT relkind::text FROM pg_class WHERE oid = 'idempotency_records'::regclass",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(kind, "p", "partitioned");
    assert_eq!(
        partition_of(&pool, &key("kept")).await,
        "idempotency_records_legacy"
    );
    let s = store(new, Duration::from_secs(60), long);
    match s.claim(&key("kept"), "fp", "retry").await.unwrap() {
        Claim::Completed { response, .. } => assert_eq!(&response.body[..], b"{\"old\":true}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        s.claim(&key("running"), "fp", "retry").await.unwrap(),
        Claim::InFlight { .. }
    ));
    // The old holder (epoch 7) still completes its claim.
    assert!(
        s.complete(&key("running"), 7, "fp", &response(), 0)
            .await
            .unwrap()
    );
    assert!(matches!(
        s.claim(&key("fresh"), "fp", "r").await.unwrap(),
        Claim::Won { .. }
    ));
    let fresh = partition_of(&pool, &key("fresh")).await;
    assert!(
        fresh.starts_with("idempotency_records_2"),
        "made ahead: {fresh}"
    );
    assert_eq!(keys_with_two_rows(&pool).await, 0);
}

/// Two gateway processes on one Postgres, both sweeping (making and
/// retiring partitions) every 300 ms over a 3 s retention: for seven
/// seconds, each round sends a fresh key's duplicates to both, and the
/// duplicates of a key sent about 1.7 s before (its retry's expiry lies in
/// a later partition than its record). Every key executes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_sweeping_partitions_execute_each_key_once() {
    let test = "two_gateways_sweeping_partitions";
    let Some(db) = services::postgres(test).await else {
        return;
    };
    let upstream = demo_upstream::start("127.0.0.1:0").await.unwrap();
    let body = format!(
        r#"
        [store]
        database_url = "{db}"
        timeout = "500ms"
        lease = "2s"
        retention = "3s"
        sweep_interval = "300ms"

        [[upstreams]]
        name = "demo"
        url = "http://{}"
        timeout = "1s"

        [[routes]]
        name = "actions"
        methods = ["POST"]
        path_prefix = "/actions/"
        upstream = "demo"
        idempotency = "key"
        on_concurrent = "wait"
        "#,
        upstream.addr
    );
    let gateways = instances::start(2, "", &body).await;
    let http = Http::http1();
    let pool = catalog(&db).await;
    let first_partitions: Vec<String> =
        sqlx::query_scalar("SELECT name FROM idempotency_partitions")
            .fetch_all(&pool)
            .await
            .unwrap();
    let rounds = 56;
    for round in 0..rounds {
        let mut keys = vec![format!("k{round}")];
        if round >= 12 {
            keys.push(format!("k{}", round - 12));
        }
        let mut sends = Vec::new();
        for k in &keys {
            for i in 0..8 {
                let url = gateways[i % 2].url(&format!("/actions/{k}"));
                let (http, k) = (http.clone(), k.clone());
                sends.push(tokio::spawn(async move {
                    http.send("POST", &url, &[("idempotency-key", k.as_str())], "{}")
                        .await
                        .status
                }));
            }
        }
        let statuses: Vec<_> = futures_util::future::join_all(sends)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert!(
            statuses.iter().all(|s| *s == 201),
            "round {round}: {statuses:?}"
        );
        tokio::time::sleep(Duration::from_millis(125)).await;
    }
    for round in 0..rounds {
        let name = format!("k{round}");
        let executed = support::executions_at(&upstream, &name);
        assert_eq!(
            executed,
            1,
            "{name}: {:?}",
            upstream.state.stats().executions.get(&name)
        );
    }
    assert_eq!(keys_with_two_rows(&pool).await, 0);
    let now: Vec<String> = sqlx::query_scalar("SELECT name FROM idempotency_partitions")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert!(
        first_partitions.iter().any(|p| !now.contains(p)),
        "a partition was retired while the keys ran: {first_partitions:?} → {now:?}"
    );
    assert!(
        now.iter().any(|p| !first_partitions.contains(p)),
        "a partition was made while the keys ran"
    );
    drop(gateways);
}

/// Every sweeper stopped long enough that a claim's expiry lies past the
/// last partition: the claim (fresh or a takeover) makes the partitions
/// it needs and goes through, instead of failing for want of one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_past_the_last_partition_makes_its_own() {
    let Some(url) = services::postgres("a_claim_past_the_last_partition").await else {
        return;
    };
    // Partitions made for a 1 s retention; records kept 30 s.
    let sql_store = sql(&url, Duration::from_secs(1)).await;
    sql_store.migrate().await.unwrap();
    let pool = catalog(&url).await;
    let last: i64 = sqlx::query_scalar("SELECT max(upper_ms) FROM idempotency_partitions")
        .fetch_one(&pool)
        .await
        .unwrap();
    let kept = Duration::from_secs(30);
    let s = store(sql_store.clone(), Duration::from_millis(100), kept);
    let k = key("far");
    assert!(matches!(
        s.claim(&k, "fp", "r").await.unwrap(),
        Claim::Won { .. }
    ));
    let upper = async || -> i64 {
        sqlx::query_scalar("SELECT max(upper_ms) FROM idempotency_partitions")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let healed = upper().await;
    assert!(healed > last + 25_000, "{last} → {healed}");
    // The lease runs out; the same request takes the record over under a
    // longer retention, and its successor's expiry needs partitions again.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let longer = store(
        sql_store,
        Duration::from_millis(100),
        Duration::from_secs(90),
    );
    assert!(matches!(
        longer.claim(&k, "fp", "again").await.unwrap(),
        Claim::Won {
            maybe_ran: true,
            ..
        }
    ));
    assert!(upper().await > healed + 55_000);
    assert_eq!(keys_with_two_rows(&pool).await, 0);
}

/// The retirement check reads a partition without locking it, so nothing
/// in a partition past its expiries may become held after the check: a
/// holder whose lease lapsed on a record past its retention can neither
/// renew the lease nor put an uncertain hold on the record (the record is
/// forgotten; its key is anyone's). A release, which holds nothing, still
/// goes through. Within the retention all of them work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_lease_past_the_retention_is_never_held_again() {
    let Some(url) = services::postgres("a_lapsed_lease_past_the_retention").await else {
        return;
    };
    let sql_store = sql(&url, Duration::from_millis(300)).await;
    sql_store.migrate().await.unwrap();
    let lease = Duration::from_millis(100);
    let claim = async |name: &str, retention: Duration| match sql_store
        .claim(&key(name), "fp", "r", lease, retention)
        .await
        .unwrap()
    {
        Claim::Won { epoch, .. } => epoch,
        other => panic!("{other:?}"),
    };
    let (late, early) = (
        claim("late", Duration::from_millis(300)).await,
        claim("early", Duration::from_secs(30)).await,
    );
    let held = Duration::from_secs(5);
    tokio::time::sleep(Duration::from_millis(450)).await;
    // Lease lapsed, retention over: refused.
    assert!(!sql_store.renew(&key("late"), late, held).await.unwrap());
    assert_eq!(
        sql_store
            .mark_uncertain(&key("late"), late, held)
            .await
            .unwrap(),
        None
    );
    // A release puts no hold on the record: it is never refused (the
    // key is free again at once, nothing having run).
    assert!(
        sql_store
            .release(&key("late"), late)
            .await
            .unwrap()
            .is_some()
    );
    // Lease lapsed, retention running: the holder may still renew.
    assert!(sql_store.renew(&key("early"), early, held).await.unwrap());
    assert!(
        sql_store
            .mark_uncertain(&key("early"), early, held)
            .await
            .unwrap()
            .is_some()
    );
}

/// Every by-key statement looks in each live partition: a long retention
/// gets wider partitions, not more of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_retention_gets_wide_partitions_not_many() {
    let Some(url) = services::postgres("a_long_retention_gets_wide_partitions").await else {
        return;
    };
    let sql_store = sql(&url, Duration::from_secs(90 * 24 * 3600)).await;
    sql_store.migrate().await.unwrap();
    let made: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_partitions")
        .fetch_one(&catalog(&url).await)
        .await
        .unwrap();
    let most = i64::from(idemgate_store::testing::MAX_LIVE_PARTITIONS) + 3;
    assert!(made <= most, "{made} partitions for a 90-day retention");
}

/// Two deployments sharing one database in schemas of their own: while
/// one is making or retiring its partitions (its locks held, here in an
/// open transaction), the other still makes and retires its own. The
/// locks are advisory, kept per database; their keys name the schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_schemas_partition_work_does_not_hold_up_this_one() {
    let Some(url) = services::postgres("another_schemas_partition_work").await else {
        return;
    };
    let Some(other_url) = services::postgres("another_schemas_partition_work").await else {
        return;
    };
    let retention = Duration::from_millis(100);
    let ours = sql(&url, retention).await;
    ours.migrate().await.unwrap();
    let theirs = sql(&other_url, retention).await;
    theirs.migrate().await.unwrap();
    let short = store(ours.clone(), Duration::from_millis(500), retention);
    into_the_next_partition().await;
    let k = key("done");
    let Claim::Won { epoch, .. } = short.claim(&k, "fp", "r").await.unwrap() else {
        panic!("not won");
    };
    assert!(
        short
            .complete(&k, epoch, "fp", &response(), 0)
            .await
            .unwrap()
    );
    into_the_next_partition().await;

    // The other deployment holds both of its locks.
    let other = catalog(&other_url).await;
    let mut busy = other.begin().await.unwrap();
    sqlx::query("SELECT idempotency_retire('none')")
        .execute(&mut *busy)
        .await
        .unwrap();
    sqlx::query("SELECT idempotency_extend(1000, 0, '0')")
        .execute(&mut *busy)
        .await
        .unwrap();
    assert_eq!(idemgate_store::sweep_once(&ours, false).await.unwrap(), 1);
    assert!(short.get(&k).await.unwrap().is_none());
    assert!(ours.extend_partitions().await.is_ok());
    busy.rollback().await.unwrap();
}
