//! What only the MySQL store meets: InnoDB's row locks. A claim that waits
//! on a lock past InnoDB's lock-wait bound is rolled back by the server and
//! run again within `store.timeout`, then fails closed — never read as "no
//! record", never as a claim won.

use crate::support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use idemgate_store::{Claim, RecordKey, StoreError, StoredResponse};
use idemgate_store::{SqlSettings, SqlStore};
use sqlx::Connection;
use support::services;

/// A migrated store on a fresh database, `store.timeout` two seconds (so
/// InnoDB gives a lock wait up after one).
async fn store(test: &str) -> Option<(SqlStore, String)> {
    let url = services::mariadb(test).await?;
    let sql = SqlStore::connect(&SqlSettings {
        url: url.clone(),
        pool_size: 4,
        timeout: Duration::from_secs(2),
        tombstone: Duration::ZERO,
        schema: None,
        retention: Duration::from_secs(60),
        partition_span: Duration::from_secs(60),
    })
    .await
    .unwrap();
    sql.migrate().await.unwrap();
    Some((sql, url))
}

fn answer() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: Vec::new(),
        trailers: Vec::new(),
        body: Bytes::from_static(b"{\"paid\":true}"),
        body_kept: true,
        request_id: "r-1".into(),
    }
}

/// Another session holding the record's row (`SELECT … FOR UPDATE` in an
/// open transaction), as a slow writer or a sweep would.
async fn lock_row(url: &str, key: &str) -> sqlx::MySqlConnection {
    let mut conn = sqlx::MySqlConnection::connect(url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
    sqlx::query("SELECT epoch FROM idempotency_records WHERE idem_key = ? FOR UPDATE")
        .bind(key)
        .fetch_all(&mut conn)
        .await
        .unwrap();
    conn
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_behind_a_held_row_lock_fails_closed_within_the_timeout() {
    let Some((sql, url)) = store("a_claim_behind_a_held_row_lock").await else {
        return;
    };
    let k = RecordKey::new("c_1", "pay", "locked");
    let Claim::Won { epoch, .. } = sql
        .claim(
            &k,
            "fp",
            "r-1",
            Duration::from_secs(30),
            Duration::from_secs(60),
        )
        .await
        .unwrap()
    else {
        panic!("a fresh key");
    };
    sql.complete(&k, epoch, &answer()).await.unwrap().unwrap();
    let mut locker = lock_row(&url, "locked").await;
    let started = Instant::now();
    let refused = sql
        .claim(
            &k,
            "fp",
            "r-2",
            Duration::from_secs(30),
            Duration::from_secs(60),
        )
        .await;
    let waited = started.elapsed();
    assert!(
        matches!(refused, Err(StoreError::Timeout { .. })),
        "{refused:?} after {waited:?}"
    );
    // InnoDB gave the wait up after a second and the claim ran again,
    // until the store's own bound.
    assert!(waited >= Duration::from_millis(1900), "{waited:?}");
    assert!(waited < Duration::from_secs(3), "{waited:?}");
    sqlx::query("ROLLBACK").execute(&mut locker).await.unwrap();
    // Nothing was written meanwhile: the record still replays.
    let replay = sql
        .claim(
            &k,
            "fp",
            "r-3",
            Duration::from_secs(30),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    assert!(
        matches!(&replay, Claim::Completed { response, .. } if response.body == answer().body),
        "{replay:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_lock_wait_timed_out_is_run_again_and_answered() {
    let Some((sql, url)) = store("a_claim_whose_lock_wait_timed_out").await else {
        return;
    };
    let k = RecordKey::new("c_1", "pay", "slow");
    let Claim::Won { epoch, .. } = sql
        .claim(
            &k,
            "fp",
            "r-1",
            Duration::from_secs(30),
            Duration::from_secs(60),
        )
        .await
        .unwrap()
    else {
        panic!("a fresh key");
    };
    sql.complete(&k, epoch, &answer()).await.unwrap().unwrap();
    // Held for 1.4 s: past InnoDB's one-second wait (error 1205), within
    // the store's two seconds.
    let mut locker = lock_row(&url, "slow").await;
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1400)).await;
        sqlx::query("COMMIT").execute(&mut locker).await.unwrap();
    });
    let started = Instant::now();
    let claim = sql
        .claim(
            &k,
            "fp",
            "r-2",
            Duration::from_secs(30),
            Duration::from_secs(60),
        )
        .await;
    let waited = started.elapsed();
    release.await.unwrap();
    assert!(
        matches!(&claim, Ok(Claim::Completed { response, .. }) if response.body == answer().body),
        "{claim:?} after {waited:?}"
    );
    assert!(waited >= Duration::from_millis(1300), "{waited:?}");
}

/// A MySQL URL names several hosts only for a Galera cluster's nodes:
/// servers that could each take writes alone (a primary restarted
/// writable beside the replica promoted in its place) would split the
/// records between them. Two names of one lone server are refused.
#[tokio::test]
async fn several_hosts_that_are_not_galera_nodes_are_refused() {
    let Some(url) = services::mariadb("several_hosts_that_are_not_galera_nodes").await else {
        return;
    };
    let twice = url.replacen("127.0.0.1:3306", "127.0.0.1:3306,127.0.0.1:3306", 1);
    assert_ne!(twice, url, "{url}");
    let refused = SqlStore::connect(&SqlSettings {
        url: twice,
        pool_size: 2,
        timeout: Duration::from_secs(2),
        tombstone: Duration::ZERO,
        schema: None,
        retention: Duration::from_secs(60),
        partition_span: Duration::from_secs(60),
    })
    .await;
    let Err(e) = refused else {
        panic!("two names of one lone server were accepted")
    };
    assert!(e.to_string().contains("Galera"), "{e}");
}
