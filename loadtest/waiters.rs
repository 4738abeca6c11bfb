//! How soon duplicates waiting on one gateway instance learn the outcome of
//! a request that runs on another (docs/semantics.md, "Waiting duplicates"): `loadtest/waiters.sh`.
//!
//! ```text
//! waiters_bench A_URL B_URL UPSTREAM_URL ROUNDS DUPLICATES DELAY_MS
//! ```
//! Each round: one POST to instance A with a fresh `Idempotency-Key` that
//! the demo upstream holds for DELAY_MS, then DUPLICATES copies of it on
//! instance B (`on_concurrent = "wait"`). A waiter's lag is the time from
//! the first client's answer to its own. Prints one JSON line: lag min,
//! median, p90, max (ms), statuses, and the upstream's executions (one per
//! round when nothing slipped through). Only ever point it at 127.0.0.1.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

async fn post(client: &HttpClient, url: &str, key: &str, delay: Option<u64>) -> (u16, Instant) {
    let mut request = http::Request::post(url).header("idempotency-key", key);
    if let Some(ms) = delay {
        request = request.header("x-demo-delay-ms", ms.to_string());
    }
    let request = request
        .body(Full::new(Bytes::from_static(b"{\"amount\":1}")))
        .unwrap();
    match client.request(request).await {
        Ok(response) => {
            let status = response.status().as_u16();
            let _ = response.into_body().collect().await;
            (status, Instant::now())
        }
        Err(_) => (0, Instant::now()),
    }
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, a, b, upstream, rounds, duplicates, delay] = &args[..] else {
        eprintln!("usage: waiters_bench A_URL B_URL UPSTREAM_URL ROUNDS DUPLICATES DELAY_MS");
        std::process::exit(2);
    };
    let (rounds, duplicates, delay): (usize, usize, u64) = (
        rounds.parse().unwrap(),
        duplicates.parse().unwrap(),
        delay.parse().unwrap(),
    );
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(duplicates + 1)
        .build_http();
    let run = uuid::Uuid::now_v7().simple().to_string();
    let mut lags = Vec::new();
    let mut statuses: BTreeMap<u16, u64> = BTreeMap::new();
    for round in 0..rounds {
        let key = format!("w-{run}-{round}");
        let first = {
            let (client, url, key) = (client.clone(), format!("{a}/actions/wait"), key.clone());
            tokio::spawn(async move { post(&client, &url, &key, Some(delay)).await })
        };
        // The first claim is durable well within this.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let waiters: Vec<_> = (0..duplicates)
            .map(|_| {
                let (client, url, key) = (client.clone(), format!("{b}/actions/wait"), key.clone());
                tokio::spawn(async move { post(&client, &url, &key, None).await })
            })
            .collect();
        let (first_status, first_done) = first.await.unwrap();
        *statuses.entry(first_status).or_default() += 1;
        for waiter in waiters {
            let (status, done) = waiter.await.unwrap();
            *statuses.entry(status).or_default() += 1;
            lags.push(done.saturating_duration_since(first_done));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    lags.sort();
    let ms = |d: Duration| (d.as_secs_f64() * 10_000.0).round() / 10.0;
    let at = |p: f64| ms(lags[((lags.len() as f64 * p) as usize).min(lags.len() - 1)]);
    let stats: serde_json::Value = {
        let response = client
            .get(format!("{upstream}/stats").parse().unwrap())
            .await
            .unwrap();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        serde_json::from_slice(&body).unwrap()
    };
    let executions: u64 = stats["executions"]["wait"]
        .as_object()
        .map(|keys| keys.values().filter_map(|v| v.as_u64()).sum())
        .unwrap_or(0);
    println!(
        "{}",
        serde_json::json!({
            "rounds": rounds,
            "waiters": lags.len(),
            "lag_ms": {"min": ms(lags[0]), "median": at(0.5), "p90": at(0.9), "max": ms(*lags.last().unwrap())},
            "statuses": statuses,
            "executions": executions,
            "peak_copies": stats["peak_copies"],
        })
    );
}
