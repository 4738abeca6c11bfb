//! Claim + complete cycles against Postgres at several concurrency levels —
//! the store's share of a first request. `loadtest/store.sh` runs it beside
//! `pgbench` (one-line `INSERT … ON CONFLICT DO NOTHING`) on the same server.
//!
//! `cargo run --release --example store_bench -- URL SECONDS C1,C2,…`

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use idemgate_core::metrics::Metrics;
use idemgate_store::sql::{SqlSettings, SqlStore};
use idemgate_store::{Claim, RecordKey, Store, StoreSettings, StoredResponse};

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let url = args
        .next()
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/test".into());
    let seconds: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(5);
    let levels: Vec<usize> = args
        .next()
        .unwrap_or_else(|| "4,16,64".into())
        .split(',')
        .filter_map(|c| c.parse().ok())
        .collect();
    let max = *levels.iter().max().unwrap_or(&16);
    let sql = SqlStore::connect(&SqlSettings {
        url,
        pool_size: max.min(32) as u32,
        timeout: Duration::from_secs(5),
        tombstone: Duration::ZERO,
        schema: None,
    })
    .await
    .expect("connect");
    sql.migrate().await.expect("migrate");
    let store = Store::new(
        sql,
        None,
        StoreSettings {
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(3600),
            fast_layer_budget: Duration::from_millis(100),
        },
        Arc::new(Metrics::default()),
    );
    let run = uuid::Uuid::now_v7().simple().to_string();
    let response = StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), b"application/json".to_vec())],
        body: Bytes::from_static(b"{\"order\":\"ok\"}"),
        body_kept: true,
        request_id: "bench".into(),
    };
    for concurrency in levels {
        let done = Arc::new(AtomicU64::new(0));
        let deadline = Instant::now() + Duration::from_secs(seconds);
        let workers = (0..concurrency).map(|w| {
            let store = store.clone();
            let done = done.clone();
            let response = response.clone();
            let run = run.clone();
            tokio::spawn(async move {
                let mut i = 0u64;
                while Instant::now() < deadline {
                    let key = RecordKey::new("bench", &run, format!("c{concurrency}-w{w}-{i}"));
                    i += 1;
                    if let Ok(Claim::Won {
                        epoch,
                        expires_at_ms,
                        ..
                    }) = store.claim(&key, "fp", "bench").await
                        && store
                            .complete(&key, epoch, "fp", &response, expires_at_ms)
                            .await
                            .unwrap_or(false)
                    {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        });
        futures_util::future::join_all(workers).await;
        let rate = done.load(Ordering::Relaxed) as f64 / seconds as f64;
        println!("claim+complete c={concurrency}: {rate:.0}/s");
    }
}
