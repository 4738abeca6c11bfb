//! Load generator for the scenarios `oha` cannot express: a new
//! `Idempotency-Key` on every request, the token flow (fetch, then use), and
//! the duplicate storm (N clients, one key, at once). Prints one JSON line.
//!
//! ```text
//! loadgen unique URL CONCURRENCY SECONDS      # POST, a fresh key each time (header: $LOADGEN_KEY_HEADER, default Idempotency-Key)
//! loadgen token  BASE PATH CONCURRENCY SECONDS  # POST BASE/token, then POST BASE+PATH with it
//! loadgen storm  URL CLIENTS                  # CLIENTS concurrent POSTs, one key
//! loadgen soak   URL RATE SECONDS DUP_PERCENT  # fixed rate; DUP_PERCENT% reuse a sent key
//! ```
//! Only ever point it at 127.0.0.1: every run is bounded in time or count.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

struct Results {
    latencies: std::sync::Mutex<Vec<Duration>>,
    statuses: std::sync::Mutex<BTreeMap<u16, u64>>,
    errors: AtomicU64,
}

impl Results {
    fn new() -> Arc<Results> {
        Arc::new(Results {
            latencies: Default::default(),
            statuses: Default::default(),
            errors: AtomicU64::new(0),
        })
    }

    fn record(&self, started: Instant, status: Option<u16>) {
        match status {
            Some(s) => {
                *self.statuses.lock().unwrap().entry(s).or_default() += 1;
                self.latencies.lock().unwrap().push(started.elapsed());
            }
            None => {
                self.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn report(&self, mode: &str, elapsed: Duration) {
        let mut latencies = self.latencies.lock().unwrap().clone();
        latencies.sort();
        let pct = |p: f64| {
            latencies
                .get(((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1)))
                .map(|d| d.as_secs_f64() * 1000.0)
                .unwrap_or(0.0)
        };
        let ok: u64 = self
            .statuses
            .lock()
            .unwrap()
            .iter()
            .filter(|(s, _)| **s < 500)
            .map(|(_, n)| n)
            .sum();
        let statuses: BTreeMap<String, u64> = self
            .statuses
            .lock()
            .unwrap()
            .iter()
            .map(|(s, n)| (s.to_string(), *n))
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "mode": mode,
                "requests": latencies.len(),
                "rps": ok as f64 / elapsed.as_secs_f64(),
                "p50_ms": pct(0.50),
                "p99_ms": pct(0.99),
                "statuses": statuses,
                "errors": self.errors.load(Ordering::Relaxed),
                "seconds": elapsed.as_secs_f64(),
            })
        );
    }
}

async fn post(
    client: &HttpClient,
    url: &str,
    headers: &[(&str, &str)],
    body: &'static str,
) -> Option<(u16, Bytes)> {
    let mut req = http::Request::builder().method("POST").uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let response = client
        .request(
            req.body(Full::new(Bytes::from_static(body.as_bytes())))
                .ok()?,
        )
        .await
        .ok()?;
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.ok()?.to_bytes();
    Some((status, body))
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| args.get(i).cloned().unwrap_or_default();
    let num = |i: usize, d: u64| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(d);
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(2048)
        .build(connector);
    let results = Results::new();
    let run = uuid::Uuid::now_v7().simple().to_string();
    match arg(0).as_str() {
        "unique" => {
            let (url, concurrency, seconds) = (arg(1), num(2, 50), num(3, 10));
            // A callback route keys by a header of the provider's (say
            // `X-Msg-Id`); a key route by `Idempotency-Key`.
            let header: &'static str = std::env::var("LOADGEN_KEY_HEADER")
                .ok()
                .filter(|h| !h.is_empty())
                .map(|h| &*h.to_ascii_lowercase().leak())
                .unwrap_or("idempotency-key");
            let deadline = Instant::now() + Duration::from_secs(seconds);
            let started = Instant::now();
            let workers = (0..concurrency).map(|w| {
                let (client, results, url, run) =
                    (client.clone(), results.clone(), url.clone(), run.clone());
                tokio::spawn(async move {
                    let mut i = 0u64;
                    while Instant::now() < deadline {
                        let key = format!("{run}-{w}-{i}");
                        i += 1;
                        let t = Instant::now();
                        let answer = post(&client, &url, &[(header, &key)], "{\"amount\":1}").await;
                        results.record(t, answer.map(|(s, _)| s));
                    }
                })
            });
            futures_util::future::join_all(workers).await;
            results.report("unique", started.elapsed());
        }
        "token" => {
            let (base, path, concurrency, seconds) = (arg(1), arg(2), num(3, 50), num(4, 10));
            let deadline = Instant::now() + Duration::from_secs(seconds);
            let started = Instant::now();
            let workers = (0..concurrency).map(|_| {
                let (client, results, base, path) =
                    (client.clone(), results.clone(), base.clone(), path.clone());
                tokio::spawn(async move {
                    while Instant::now() < deadline {
                        let t = Instant::now();
                        let Some((201, body)) =
                            post(&client, &format!("{base}/token"), &[], "").await
                        else {
                            results.record(t, None);
                            continue;
                        };
                        let token: serde_json::Value =
                            serde_json::from_slice(&body).unwrap_or_default();
                        let token = token["token"].as_str().unwrap_or_default().to_owned();
                        let answer = post(
                            &client,
                            &format!("{base}{path}"),
                            &[("idempotency-token", &token)],
                            "{\"item\":1}",
                        )
                        .await;
                        results.record(t, answer.map(|(s, _)| s));
                    }
                })
            });
            futures_util::future::join_all(workers).await;
            results.report("token-flow", started.elapsed());
        }
        "storm" => {
            let (url, clients) = (arg(1), num(2, 1000));
            let key = format!("storm-{run}");
            let gate = Arc::new(tokio::sync::Barrier::new(clients as usize));
            let started = Instant::now();
            let workers = (0..clients).map(|_| {
                let (client, results, url, key, gate) = (
                    client.clone(),
                    results.clone(),
                    url.clone(),
                    key.clone(),
                    gate.clone(),
                );
                tokio::spawn(async move {
                    gate.wait().await;
                    let t = Instant::now();
                    let answer =
                        post(&client, &url, &[("idempotency-key", &key)], "{\"storm\":1}").await;
                    results.record(t, answer.map(|(s, _)| s));
                })
            });
            futures_util::future::join_all(workers).await;
            results.report("storm", started.elapsed());
        }
        "soak" => {
            let (url, rate, seconds, dup) = (arg(1), num(2, 200), num(3, 600), num(4, 10));
            let sent = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
            let in_flight = Arc::new(tokio::sync::Semaphore::new(512));
            let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let started = Instant::now();
            let deadline = started + Duration::from_secs(seconds);
            let mut i = 0u64;
            let mut tasks = Vec::new();
            while Instant::now() < deadline {
                ticker.tick().await;
                i += 1;
                // Deterministic mix: every (100 / dup)-th request repeats an
                // earlier key, the rest are new.
                let repeat = dup > 0 && i.is_multiple_of(100 / dup.max(1));
                let key = {
                    let mut sent = sent.lock().unwrap();
                    if repeat && !sent.is_empty() {
                        let pick = (i as usize * 7919) % sent.len();
                        sent[pick].clone()
                    } else {
                        let key = format!("soak-{run}-{i}");
                        sent.push(key.clone());
                        key
                    }
                };
                let Ok(permit) = in_flight.clone().acquire_owned().await else {
                    break;
                };
                let (client, results, url) = (client.clone(), results.clone(), url.clone());
                tasks.push(tokio::spawn(async move {
                    let t = Instant::now();
                    let answer =
                        post(&client, &url, &[("idempotency-key", &key)], "{\"soak\":1}").await;
                    results.record(t, answer.map(|(s, _)| s));
                    drop(permit);
                }));
            }
            futures_util::future::join_all(tasks).await;
            let unique = sent.lock().unwrap().len();
            eprintln!("{{\"unique_keys\":{unique}}}");
            results.report("soak", started.elapsed());
        }
        other => {
            eprintln!("unknown mode {other:?}; see the file's docs");
            std::process::exit(2);
        }
    }
}
