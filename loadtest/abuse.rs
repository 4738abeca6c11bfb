//! The clients of `loadtest/abuse.sh`: a steady legitimate client, and the
//! abusive ones it runs beside. Prints one JSON line per run. Only ever
//! point it at 127.0.0.1: every run is bounded in time or count.
//!
//! ```text
//! abuse_bench legit     URL RATE SECONDS          # fresh-key POSTs at RATE/s on 16 kept connections
//!                                                 # (LEGIT_TRACE=FILE: each request's start and latency, ms)
//! abuse_bench hangup    ADDR COUNT DELAY_MS       # POST with a fresh key, then hang up; COUNT of them
//! abuse_bench resets    ADDR COUNT DELAY_MS       # one h2c connection: HEADERS, RST_STREAM 5 ms later
//! abuse_bench big       URL COUNT BYTES            # fresh keys whose answers are BYTES long
//! abuse_bench slowloris ADDR CONNS SECONDS h1|h2  # connections that send a byte now and then
//! abuse_bench atcap     ADDR FILL DELAY_MS NEW    # FILL hang-ups whose claims run DELAY_MS fill
//!                                                 # max_connections; then NEW newcomers, one
//!                                                 # connection each: how long each waited, for what
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::io::AsyncWriteExt;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn run_id() -> String {
    uuid::Uuid::now_v7().simple().to_string()
}

/// Connections the legitimate client opens before it starts and keeps for
/// the whole run, as a service's HTTP client keeps its pool. A connection
/// opened in the middle of a connection flood queues in the kernel's
/// backlog behind the flood, however well the gateway serves those it
/// has (loadtest/README.md).
const LEGIT_CONNECTIONS: usize = 16;

async fn legit(url: &str, rate: u64, seconds: u64) {
    let uri: http::Uri = url.parse().expect("legit URL");
    let addr = format!(
        "{}:{}",
        uri.host().expect("legit URL host"),
        uri.port_u16().unwrap_or(80)
    );
    let run = run_id();
    let latencies = Arc::new(std::sync::Mutex::new(Vec::new()));
    let errors = Arc::new(AtomicU64::new(0));
    // Each request is a (number, when it was due) on this queue; a free
    // connection takes the next. Latency counts from when it was due, so
    // a wait for a free connection is in it.
    let (due, queue) = tokio::sync::mpsc::unbounded_channel::<(u64, Instant)>();
    let queue = Arc::new(tokio::sync::Mutex::new(queue));
    let zero = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..LEGIT_CONNECTIONS {
        let mut sender = connect_http1(&addr).await.expect("legit connection");
        let (queue, latencies, errors, addr, path, run) = (
            queue.clone(),
            latencies.clone(),
            errors.clone(),
            addr.clone(),
            uri.path_and_query().map_or("/", |p| p.as_str()).to_owned(),
            run.clone(),
        );
        tasks.push(tokio::spawn(async move {
            loop {
                let Some((i, started)) = queue.lock().await.recv().await else {
                    return;
                };
                let request = http::Request::post(&path)
                    .header("host", &addr)
                    .header("idempotency-key", format!("legit-{run}-{i}"))
                    .body(Full::new(Bytes::from_static(b"{}")))
                    .unwrap();
                let answer = tokio::time::timeout(Duration::from_secs(10), async {
                    let response = sender.send_request(request).await?;
                    let status = response.status();
                    response.into_body().collect().await?;
                    Ok::<_, hyper::Error>(status.is_success())
                })
                .await;
                if matches!(answer, Ok(Ok(true))) {
                    let at = started.duration_since(zero);
                    latencies.lock().unwrap().push((started.elapsed(), at));
                } else {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
                if !matches!(answer, Ok(Ok(_))) {
                    // Closed or stuck: the next request gets a new one
                    // (each failed try an error of its own).
                    loop {
                        match connect_http1(&addr).await {
                            Ok(fresh) => break sender = fresh,
                            Err(_) => {
                                errors.fetch_add(1, Ordering::Relaxed);
                                tokio::time::sleep(Duration::from_millis(100)).await;
                            }
                        }
                    }
                }
            }
        }));
    }
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
    let until = Instant::now() + Duration::from_secs(seconds);
    let mut i = 0u64;
    while Instant::now() < until {
        ticker.tick().await;
        i += 1;
        let _ = due.send((i, Instant::now()));
    }
    drop(due);
    for task in tasks {
        let _ = task.await;
    }
    let latencies = latencies.lock().unwrap().clone();
    if let Ok(path) = std::env::var("LEGIT_TRACE") {
        // When the slow ones started: the abuse's phases show.
        let lines: String = latencies
            .iter()
            .map(|(took, at)| format!("{:.1} {:.2}\n", ms(*at), ms(*took)))
            .collect();
        std::fs::write(path, lines).expect("LEGIT_TRACE is writable");
    }
    let mut latencies: Vec<Duration> = latencies.into_iter().map(|(took, _)| took).collect();
    latencies.sort();
    let at = |p: f64| {
        latencies
            .get(((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1)))
            .map(|d| (ms(*d) * 10.0).round() / 10.0)
            .unwrap_or(0.0)
    };
    println!(
        "{}",
        serde_json::json!({
            "ok": latencies.len(),
            "errors": errors.load(Ordering::Relaxed),
            "p50_ms": at(0.5),
            "p99_ms": at(0.99),
            "max_ms": at(1.0),
        })
    );
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// One HTTP/1.1 keep-alive connection.
async fn connect_http1(
    addr: &str,
) -> Result<
    hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    Box<dyn std::error::Error + Send + Sync>,
> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    Ok(sender)
}

async fn hangup(addr: &str, count: u64, delay_ms: u64) {
    let run = run_id();
    let mut tasks = Vec::new();
    for i in 0..count {
        let (addr, key) = (addr.to_owned(), format!("hang-{run}-{i}"));
        tasks.push(tokio::spawn(async move {
            let Ok(mut socket) = tokio::net::TcpStream::connect(&addr).await else {
                return false;
            };
            let request = format!(
                "POST /actions/abuse HTTP/1.1\r\nHost: gw\r\nIdempotency-Key: {key}\r\n\
                 X-Demo-Delay-Ms: {delay_ms}\r\nContent-Length: 2\r\n\r\n{{}}"
            );
            socket.write_all(request.as_bytes()).await.is_ok()
        }));
        if i % 100 == 99 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let mut sent = 0;
    for task in tasks {
        sent += u64::from(task.await.unwrap_or(false));
    }
    println!("{}", serde_json::json!({"sent": sent}));
}

/// Fills the connection cap with `fill` hang-ups whose claims run
/// `delay_ms`, then sends `newcomers` requests, each on a connection of
/// its own, 20 ms apart: how long each waited for its answer's first
/// bytes, and what it was (a refusal, an answer, nothing within 10 s).
async fn atcap(addr: &str, fill: u64, delay_ms: u64, newcomers: u64) {
    use tokio::io::AsyncReadExt;
    hangup_quiet(addr, fill, delay_ms).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let run = run_id();
    let mut tasks = Vec::new();
    for i in 0..newcomers {
        let (addr, key) = (addr.to_owned(), format!("new-{run}-{i}"));
        tasks.push(tokio::spawn(async move {
            let started = Instant::now();
            let mut socket = tokio::net::TcpStream::connect(&addr).await.ok()?;
            let request = format!(
                "POST /actions/newcomer HTTP/1.1\r\nHost: gw\r\nIdempotency-Key: {key}\r\n\
                 Content-Length: 2\r\n\r\n{{}}"
            );
            socket.write_all(request.as_bytes()).await.ok()?;
            let mut head = [0u8; 12];
            tokio::time::timeout(Duration::from_secs(10), socket.read_exact(&mut head))
                .await
                .ok()?
                .ok()?;
            let status = String::from_utf8_lossy(&head[9..12]).into_owned();
            Some((status, started.elapsed().as_millis() as u64))
        }));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (mut refused, mut served, mut unanswered, mut waits) = (0u64, 0u64, 0u64, Vec::new());
    for task in tasks {
        match task.await.ok().flatten() {
            Some((status, ms)) => {
                waits.push(ms);
                if status == "503" {
                    refused += 1;
                } else {
                    served += 1;
                }
            }
            None => unanswered += 1,
        }
    }
    waits.sort_unstable();
    let at = |q: f64| {
        waits
            .get(((waits.len() as f64 * q) as usize).min(waits.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    println!(
        "{}",
        serde_json::json!({
            "newcomers": newcomers, "refused_503": refused, "served": served,
            "unanswered_10s": unanswered, "p50_wait_ms": at(0.5), "p99_wait_ms": at(0.99),
            "max_wait_ms": waits.last().copied().unwrap_or(0),
        })
    );
}

/// [`hangup`] without its summary line.
async fn hangup_quiet(addr: &str, count: u64, delay_ms: u64) {
    let run = run_id();
    let mut tasks = Vec::new();
    for i in 0..count {
        let (addr, key) = (addr.to_owned(), format!("fill-{run}-{i}"));
        tasks.push(tokio::spawn(async move {
            if let Ok(mut socket) = tokio::net::TcpStream::connect(&addr).await {
                let request = format!(
                    "POST /actions/abuse HTTP/1.1\r\nHost: gw\r\nIdempotency-Key: {key}\r\n\
                     X-Demo-Delay-Ms: {delay_ms}\r\nContent-Length: 2\r\n\r\n{{}}"
                );
                let _ = socket.write_all(request.as_bytes()).await;
            }
        }));
    }
    for task in tasks {
        let _ = task.await;
    }
}

async fn resets(addr: &str, count: u64, delay_ms: u64) {
    let run = run_id();
    let Ok(tcp) = tokio::net::TcpStream::connect(addr).await else {
        println!("{}", serde_json::json!({"error": "connect"}));
        return;
    };
    let Ok((client, connection)) = h2::client::handshake(tcp).await else {
        println!("{}", serde_json::json!({"error": "handshake"}));
        return;
    };
    let driver = tokio::spawn(connection);
    let (mut sent, mut refused) = (0u64, false);
    for i in 0..count {
        let Ok(mut client) = client.clone().ready().await else {
            refused = true;
            break;
        };
        let request = http::Request::post("http://gw/actions/abuse")
            .header("idempotency-key", format!("rst-{run}-{i}"))
            .header("x-demo-delay-ms", delay_ms.to_string())
            .body(())
            .unwrap();
        match client.send_request(request, true) {
            Ok((response, _)) => {
                sent += 1;
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(Duration::from_millis(5), response).await;
                });
            }
            Err(_) => {
                refused = true;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let closed = tokio::time::timeout(Duration::from_secs(10), driver)
        .await
        .is_ok();
    println!(
        "{}",
        serde_json::json!({"sent": sent, "refused_new_streams": refused, "closed": closed})
    );
}

async fn big(url: &str, count: u64, bytes: u64) {
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let run = run_id();
    let mut ok = 0;
    for wave in 0..count.div_ceil(20) {
        let tasks: Vec<_> = (0..20.min(count - wave * 20))
            .map(|i| {
                let (client, url) = (client.clone(), url.to_owned());
                let key = format!("big-{run}-{wave}-{i}");
                tokio::spawn(async move {
                    let request = http::Request::post(&url)
                        .header("idempotency-key", key)
                        .header("x-demo-response-bytes", bytes.to_string())
                        .body(Full::new(Bytes::from_static(b"{}")))
                        .unwrap();
                    match client.request(request).await {
                        Ok(response) => response.into_body().collect().await.is_ok(),
                        Err(_) => false,
                    }
                })
            })
            .collect();
        for task in tasks {
            ok += u64::from(task.await.unwrap_or(false));
        }
    }
    println!("{}", serde_json::json!({"ok": ok}));
}

async fn slowloris(addr: &str, conns: u64, seconds: u64, h2: bool) {
    let until = Instant::now() + Duration::from_secs(seconds);
    let opened = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..conns)
        .map(|_| {
            let (addr, opened) = (addr.to_owned(), opened.clone());
            tokio::spawn(async move {
                while Instant::now() < until {
                    let Ok(mut socket) = tokio::net::TcpStream::connect(&addr).await else {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    };
                    opened.fetch_add(1, Ordering::Relaxed);
                    let start: &[u8] = if h2 {
                        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                    } else {
                        b"POST /actions/abuse HTTP/1.1\r\nHost: gw\r\n"
                    };
                    if socket.write_all(start).await.is_err() {
                        continue;
                    }
                    // A byte now and then, never a whole head.
                    while Instant::now() < until {
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        if socket.write_all(b"X").await.is_err() {
                            break;
                        }
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        let _ = task.await;
    }
    println!(
        "{}",
        serde_json::json!({"connections_opened": opened.load(Ordering::Relaxed)})
    );
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n = |i: usize| -> u64 { args[i].parse().unwrap() };
    match args.get(1).map(String::as_str) {
        Some("legit") => legit(&args[2], n(3), n(4)).await,
        Some("hangup") => hangup(&args[2], n(3), n(4)).await,
        Some("resets") => resets(&args[2], n(3), n(4)).await,
        Some("big") => big(&args[2], n(3), n(4)).await,
        Some("slowloris") => slowloris(&args[2], n(3), n(4), args[5] == "h2").await,
        Some("atcap") => atcap(&args[2], n(3), n(4), n(5)).await,
        _ => {
            eprintln!("usage: see loadtest/abuse.rs");
            std::process::exit(2);
        }
    }
}
