//! Claim + complete cycles against Postgres at several concurrency levels —
//! the store's share of a first request. `loadtest/store.sh` runs it beside
//! `pgbench` (one-line `INSERT … ON CONFLICT DO NOTHING`) on the same
//! server; `loadtest/scale.sh` runs it on an empty and a full record table,
//! and beside the sweeper.
//!
//! `cargo run --release --example store_bench -- URL SECONDS C1,C2,… [sweep]`
//!
//! With `sweep`, one sweep (`idemgate_store::sweep_once`, as `idemgate sweep` runs
//! it) starts with each level, and the level runs until it has finished
//! (at least SECONDS): the line then says how long the sweep took and what
//! the claims did meanwhile. Each line carries the cycles' p50 and p99.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use idemgate_core::metrics::Metrics;
use idemgate_store::StoreSettings;
use idemgate_store::{Claim, RecordKey, Store, StoredResponse};
use idemgate_store::{SqlSettings, SqlStore};

/// The gateway's defaults: a day's retention, one partition a day.
const RETENTION: Duration = Duration::from_secs(24 * 3600);

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
    let beside_sweep = args.next().as_deref() == Some("sweep");
    let max = *levels.iter().max().unwrap_or(&16);
    let sql = SqlStore::connect(&SqlSettings {
        url,
        pool_size: max.min(32) as u32 + 2,
        timeout: Duration::from_secs(5),
        tombstone: Duration::ZERO,
        schema: None,
        retention: RETENTION,
        partition_span: idemgate_store::testing::partition_span(
            RETENTION,
            idemgate_store::DEFAULT_SWEEP_INTERVAL,
        ),
    })
    .await
    .expect("connect");
    sql.migrate().await.expect("migrate");
    if levels.is_empty() {
        // `store_bench URL 0 ""`: migrate only; `… 0 "" sweep`: one sweep.
        if beside_sweep {
            let started = Instant::now();
            let removed = idemgate_store::sweep_once(&sql, false)
                .await
                .expect("sweep");
            println!(
                "sweep alone: removed {removed} in {:.2}s",
                started.elapsed().as_secs_f64()
            );
        }
        return;
    }
    let store = Store::new(
        sql.clone(),
        None,
        StoreSettings {
            lease: Duration::from_secs(30),
            retention: RETENTION,
            fast_layer_budget: Duration::from_millis(100),
        },
        Arc::new(Metrics::default()),
    );
    let run = uuid::Uuid::now_v7().simple().to_string();
    let response = StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), b"application/json".to_vec())],
        trailers: Vec::new(),
        body: Bytes::from_static(b"{\"order\":\"ok\"}"),
        body_kept: true,
        request_id: "bench".into(),
    };
    for concurrency in levels {
        let started = Instant::now();
        let sweeping = beside_sweep.then(|| {
            let sql = sql.clone();
            tokio::spawn(async move {
                let removed = idemgate_store::sweep_once(&sql, false)
                    .await
                    .expect("sweep");
                (removed, started.elapsed())
            })
        });
        let min_end = started + Duration::from_secs(seconds);
        let sweep_done = Arc::new(std::sync::atomic::AtomicBool::new(sweeping.is_none()));
        let workers = (0..concurrency).map(|w| {
            let (store, response, run) = (store.clone(), response.clone(), run.clone());
            let sweep_done = sweep_done.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut i = 0u64;
                while Instant::now() < min_end
                    || !sweep_done.load(std::sync::atomic::Ordering::Relaxed)
                {
                    let key = RecordKey::new("bench", &run, format!("c{concurrency}-w{w}-{i}"));
                    i += 1;
                    let cycle = Instant::now();
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
                        latencies.push(cycle.elapsed().as_micros() as u32);
                    }
                }
                latencies
            })
        });
        let workers = futures_util::future::join_all(workers);
        let (workers, swept) = match sweeping {
            Some(sweeping) => {
                let sweep_done = sweep_done.clone();
                let (workers, swept) = tokio::join!(workers, async move {
                    let swept = sweeping.await.unwrap();
                    sweep_done.store(true, std::sync::atomic::Ordering::Relaxed);
                    swept
                });
                (workers, Some(swept))
            }
            None => (workers.await, None),
        };
        let window = started.elapsed();
        let mut all: Vec<u32> = workers.into_iter().flat_map(Result::unwrap).collect();
        all.sort_unstable();
        let at = |q: f64| {
            all.get(((all.len() as f64 * q) as usize).min(all.len().saturating_sub(1)))
                .map_or(0.0, |us| f64::from(*us) / 1000.0)
        };
        let rate = all.len() as f64 / window.as_secs_f64();
        let sweep_note = swept.map_or(String::new(), |(removed, took)| {
            format!(" | sweep removed {removed} in {:.2}s", took.as_secs_f64())
        });
        println!(
            "claim+complete c={concurrency}: {rate:.0}/s p50 {:.2} ms p99 {:.2} ms over {:.1}s{sweep_note}",
            at(0.50),
            at(0.99),
            window.as_secs_f64()
        );
    }
}
