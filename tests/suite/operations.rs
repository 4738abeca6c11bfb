//! Operations: `/readyz`, `/admin/keys`, and the `migrate`, `keys` and
//! `sweep` commands, against real stores.

use crate::support;

use std::io::Write;
use std::process::Command;
use std::time::Duration;

use bytes::Bytes;
use idemgate_core::identity::{ANONYMOUS_SCOPE, Identity};
use idemgate_store::{Claim, RecordKey, StoredResponse};
use support::services::{self, FaultProxy, Mode};
use support::{PASS_THROUGH, Stack};

fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![],
        trailers: Vec::new(),
        body: Bytes::from_static(b"{}"),
        body_kept: true,
        request_id: "rid".into(),
    }
}

#[tokio::test]
async fn readyz_reports_sql_and_the_fast_layer() {
    let stack = Stack::start(PASS_THROUGH).await;
    let a = stack.http.get(&stack.admin("/readyz")).await;
    assert_eq!(a.status, 200);
    let v = a.json();
    assert_eq!(v["status"], "ready");
    assert_eq!(v["sql"], "ok");
    assert_eq!(v["sql_backend"], "sqlite");
    assert_eq!(v["fast_layer"], "memory");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_503_while_postgres_is_unreachable() {
    let test = "readyz_is_503_while_postgres_is_unreachable";
    let Some(url) = services::shared_sql(test).await else {
        return;
    };
    let Some((redis_url, prefix)) = services::redis(test).await else {
        return;
    };
    let proxy = FaultProxy::start(services::sql_addr(&url)).await;
    let proxied = services::via(&url, proxy.port);
    let stack = Stack::start_with(PASS_THROUGH, |c| {
        c.store.database_url = proxied;
        c.store.redis_url = redis_url;
        c.store.redis_prefix = prefix;
        c.store.timeout = "500ms".into();
    })
    .await;
    let a = stack.http.get(&stack.admin("/readyz")).await;
    assert_eq!(a.status, 200);
    assert_eq!(a.json()["fast_layer"], "redis");
    assert_eq!(a.json()["fast_layer_state"], "ok");
    proxy.set(Mode::Blackhole);
    let started = std::time::Instant::now();
    let a = stack.http.get(&stack.admin("/readyz")).await;
    assert_eq!(a.status, 503, "{:?}", a.json());
    assert!(started.elapsed() < Duration::from_secs(2));
    proxy.set(Mode::Pass);
    let http = stack.http.clone();
    let url = stack.admin("/readyz");
    assert!(
        support::eventually(Duration::from_secs(10), || {
            let http = http.clone();
            let url = url.clone();
            async move { http.get(&url).await.status == 200 }
        })
        .await
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn admin_keys_show_and_purge_records() {
    let stack = Stack::start(PASS_THROUGH).await;
    let store = &stack.gateway.store;
    for client in ["Bearer alice", "Bearer bob"] {
        let key = RecordKey::new(
            Identity::header(http::header::AUTHORIZATION).scope_for_operator(client),
            "orders",
            "k/1",
        );
        let Claim::Won { epoch, .. } = store.claim(&key, "fp", "rid").await.unwrap() else {
            panic!()
        };
        assert!(
            store
                .complete(&key, epoch, "fp", &response(), 0)
                .await
                .unwrap()
        );
    }
    let a = stack.http.get(&stack.admin("/admin/keys/orders/k/1")).await;
    assert_eq!(a.status, 200);
    let records = a.json()["records"].as_array().unwrap().clone();
    assert_eq!(records.len(), 2);
    assert_eq!(records[0]["state"], "completed");
    assert_eq!(records[0]["stored_status"], 201);
    assert!(!a.json().to_string().contains("alice"), "identity leaked");
    let a = stack
        .http
        .get(&stack.admin("/admin/keys/orders/k/1?client=Bearer%20alice"))
        .await;
    assert_eq!(a.json()["records"].as_array().unwrap().len(), 1);
    let a = stack
        .http
        .send(
            "DELETE",
            &stack.admin("/admin/keys/orders/k/1?client=Bearer%20alice"),
            &[],
            "",
        )
        .await;
    assert_eq!(a.json()["purged"], 1);
    let a = stack
        .http
        .send("DELETE", &stack.admin("/admin/keys/orders/k/1"), &[], "")
        .await;
    assert_eq!(a.json()["purged"], 1);
    assert_eq!(
        stack
            .http
            .get(&stack.admin("/admin/keys/orders/k/1"))
            .await
            .status,
        404
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn migrate_keys_and_sweep_commands_work_on_the_embedded_store() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}/ops.db", dir.path().display());
    let mut file = tempfile::NamedTempFile::new().unwrap();
    write!(
        file,
        "[store]\ndatabase_url = \"{db}\"\nretention = \"1s\"\n[[upstreams]]\nname = \"o\"\nurl = \"http://127.0.0.1:9\"\n"
    )
    .unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .args(args)
            .arg("--config")
            .arg(file.path())
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, out, err) = run(&["migrate"]);
    assert_eq!(code, Some(0), "{out}{err}");
    // A record written the way the gateway writes it.
    let sql = idemgate_store::SqlStore::connect(&idemgate_store::SqlSettings {
        url: db.clone(),
        pool_size: 1,
        timeout: Duration::from_secs(2),
        tombstone: Duration::ZERO,
        schema: None,
        retention: Duration::from_secs(86_400),
        partition_span: Duration::from_secs(86_400),
    })
    .await
    .unwrap();
    let key = RecordKey::new(ANONYMOUS_SCOPE, "orders", "key-1");
    let Claim::Won { epoch, .. } = sql
        .claim(
            &key,
            "fp",
            "rid",
            Duration::from_secs(30),
            Duration::from_millis(1),
        )
        .await
        .unwrap()
    else {
        panic!()
    };
    assert!(
        sql.complete(&key, epoch, &response())
            .await
            .unwrap()
            .is_some()
    );
    let (code, out, err) = run(&["keys", "show", "orders", "key-1"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("\"state\": \"completed\""), "{out}");
    assert!(out.contains(&format!("\"epoch\": {epoch}")), "{out}");
    assert!(out.contains("\"stored_status\": 201"), "{out}");
    let (code, _, err) = run(&["keys", "show", "orders", "nope"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("no record"), "{err}");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (code, out, _) = run(&["sweep"]);
    assert_eq!(code, Some(0));
    assert!(out.contains("deleted 1 expired record"), "{out}");
    let (code, out, _) = run(&["keys", "purge", "orders", "key-1"]);
    assert_eq!(code, Some(0));
    assert!(out.contains("purged 0"), "{out}");
}

#[tokio::test]
async fn the_sweeper_runs_every_sweep_interval() {
    let stack = Stack::start_with(PASS_THROUGH, |c| {
        c.store.retention = "200ms".into();
        c.store.sweep_interval = "300ms".into();
    })
    .await;
    let store = &stack.gateway.store;
    let key = RecordKey::new("s", "orders", "old");
    let Claim::Won { epoch, .. } = store.claim(&key, "fp", "rid").await.unwrap() else {
        panic!()
    };
    assert!(
        store
            .complete(&key, epoch, "fp", &response(), 0)
            .await
            .unwrap()
    );
    let store = store.clone();
    let swept = support::eventually(Duration::from_secs(5), || {
        let store = store.clone();
        let key = key.clone();
        async move { store.get(&key).await.unwrap().is_none() }
    })
    .await;
    assert!(swept, "the expired record was never swept");
    stack.shutdown().await;
}
