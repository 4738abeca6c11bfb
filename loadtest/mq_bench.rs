//! Messages per second delivered once through Idemgate's RabbitMQ consumer
//! (Redis + Postgres), beside a bare consumer that forwards each message
//! over HTTP and acks it without deduplication — same broker, same
//! upstream, same prefetch, in one run. `loadtest/mq.sh` runs it.
//!
//! `cargo run --release --example mq_bench -- MESSAGES ROUNDS`
//!
//! Each round publishes MESSAGES distinct messages (confirmed) while the
//! consumer runs, and measures until the upstream has received all of them:
//! throughput = MESSAGES / (last arrival − first publish), and the p50/p99
//! time from publish to upstream arrival (the publish time travels in the
//! body).

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};

const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
fn prefetch() -> u16 {
    std::env::var("IDEMGATE_BENCH_PREFETCH")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(32)
}

fn now_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// The upstream: records each arrival's publish-to-here latency.
#[derive(Default)]
struct Arrivals {
    latencies: Mutex<Vec<u64>>,
}

async fn upstream(arrivals: Arc<Arrivals>) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let arrivals = arrivals.clone();
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                        let arrivals = arrivals.clone();
                        async move {
                            let body = req
                                .into_body()
                                .collect()
                                .await
                                .map(|b| b.to_bytes())
                                .unwrap_or_default();
                            let sent: u64 = std::str::from_utf8(&body)
                                .ok()
                                .and_then(|s| s.trim().parse().ok())
                                .unwrap_or(0);
                            arrivals
                                .latencies
                                .lock()
                                .unwrap()
                                .push(now_micros().saturating_sub(sent));
                            Ok::<_, Infallible>(
                                Response::builder()
                                    .status(201)
                                    .body(Full::new(Bytes::from_static(b"{\"ok\":true}")))
                                    .unwrap(),
                            )
                        }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

/// The bare consumer: forward, ack after the answer, no deduplication.
async fn bare_consumer(queue: String, upstream: std::net::SocketAddr) {
    let conn = Connection::connect(AMQP, ConnectionProperties::default())
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    channel
        .basic_qos(prefetch(), BasicQosOptions::default())
        .await
        .unwrap();
    let mut consumer = channel
        .basic_consume(
            queue.as_str().into(),
            "bare".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let url: hyper::Uri = format!("http://{upstream}/mq").parse().unwrap();
    while let Some(Ok(delivery)) = consumer.next().await {
        let client = client.clone();
        let url = url.clone();
        tokio::spawn(async move {
            let request = Request::post(url)
                .header("content-type", "text/plain")
                .body(Full::new(Bytes::from(delivery.data.clone())))
                .unwrap();
            if let Ok(response) = client.request(request).await {
                let _ = response.into_body().collect().await;
                let _ = delivery.ack(BasicAckOptions::default()).await;
            }
        });
    }
    drop(conn);
}

async fn publish_round(queue: &str, messages: usize, round: usize) -> Instant {
    let conn = Connection::connect(AMQP, ConnectionProperties::default())
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let started = Instant::now();
    for i in 0..messages {
        let properties = BasicProperties::default()
            .with_message_id(format!("r{round}-m{i}").into())
            .with_delivery_mode(2);
        channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                now_micros().to_string().as_bytes(),
                properties,
            )
            .await
            .unwrap();
    }
    channel.wait_for_confirms().await.unwrap();
    started
}

struct Figures {
    per_second: f64,
    p50_ms: f64,
    p99_ms: f64,
    /// CPU per message, µs: RabbitMQ, Postgres, this process (publisher,
    /// consumer — bare or the gateway — and upstream).
    cpu: [f64; 3],
}

/// CPU time so far, in clock ticks, of RabbitMQ (`beam.smp`), every
/// Postgres process, and this process — from `/proc`, so that a round's
/// cost per message can be split by party.
fn cpu_ticks() -> [u64; 3] {
    let me = std::process::id().to_string();
    let mut ticks = [0u64; 3];
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return ticks;
    };
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) state …`: utime and stime are the 14th and 15th fields.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = &stat[open + 1..close];
        let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
        let used = fields
            .get(11)
            .and_then(|u| u.parse::<u64>().ok())
            .unwrap_or(0)
            + fields
                .get(12)
                .and_then(|s| s.parse::<u64>().ok())
                .unwrap_or(0);
        let party = match comm {
            "beam.smp" => 0,
            "postgres" => 1,
            _ if pid == me => 2,
            _ => continue,
        };
        ticks[party] += used;
    }
    ticks
}

/// Microseconds per clock tick (`getconf CLK_TCK`, 100 on Linux).
const MICROS_PER_TICK: f64 = 10_000.0;

async fn measure(queue: &str, arrivals: &Arrivals, messages: usize, round: usize) -> Figures {
    arrivals.latencies.lock().unwrap().clear();
    let before = cpu_ticks();
    let started = publish_round(queue, messages, round).await;
    loop {
        if arrivals.latencies.lock().unwrap().len() >= messages {
            break;
        }
        if started.elapsed() > Duration::from_secs(300) {
            panic!(
                "round {round}: only {} of {messages} arrived",
                arrivals.latencies.lock().unwrap().len()
            );
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = started.elapsed();
    let after = cpu_ticks();
    let cpu = std::array::from_fn(|i| {
        after[i].saturating_sub(before[i]) as f64 * MICROS_PER_TICK / messages as f64
    });
    let mut latencies = arrivals.latencies.lock().unwrap().clone();
    latencies.sort_unstable();
    let at = |q: f64| {
        latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)] as f64 / 1000.0
    };
    Figures {
        per_second: messages as f64 / elapsed.as_secs_f64(),
        p50_ms: at(0.50),
        p99_ms: at(0.99),
        cpu,
    }
}

async fn fresh_queue(name: &str) {
    let conn = Connection::connect(AMQP, ConnectionProperties::default())
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    let _ = channel
        .queue_delete(name.into(), QueueDeleteOptions::default())
        .await;
    channel
        .queue_declare(
            name.into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let messages: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(5000);
    let rounds: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(3);
    let database = std::env::var("IDEMGATE_BENCH_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let redis = std::env::var("IDEMGATE_BENCH_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    let tag = uuid::Uuid::now_v7().simple().to_string();
    let prefetch = prefetch();

    let arrivals = Arc::new(Arrivals::default());
    let up = upstream(arrivals.clone()).await;

    let bare_queue = format!("bench.bare.{tag}");
    fresh_queue(&bare_queue).await;
    tokio::spawn(bare_consumer(bare_queue.clone(), up));

    let gate_queue = format!("bench.idemgate.{tag}");
    fresh_queue(&gate_queue).await;
    let text = format!(
        r#"
        [server]
        listen = "127.0.0.1:0"
        admin_listen = "127.0.0.1:0"
        [store]
        database_url = "{database}"
        redis_url = "{redis}"
        redis_prefix = "bench:{tag}:"
        [[upstreams]]
        name = "up"
        url = "http://{up}"
        [[consumers]]
        name = "bench-{tag}"
        source = "{AMQP}"
        queue = "{gate_queue}"
        upstream = "up"
        path = "/mq"
        prefetch = {prefetch}
        "#
    );
    let config = idemgate_gateway::config::Config::parse(&text, "bench").unwrap();
    config.validate("bench").unwrap();
    let gateway = idemgate_gateway::gateway::start(config).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;

    println!(
        "| round | bare msg/s | idemgate msg/s | ratio | bare p50 / p99 ms | idemgate p50 / p99 ms | bare CPU µs/msg RabbitMQ / Postgres / bench | idemgate CPU µs/msg RabbitMQ / Postgres / bench |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    // Warm-up, then alternating rounds so drift hits both alike.
    let _ = measure(&bare_queue, &arrivals, messages / 5, 1000).await;
    let _ = measure(&gate_queue, &arrivals, messages / 5, 1000).await;
    for round in 0..rounds {
        let bare = measure(&bare_queue, &arrivals, messages, round).await;
        let gate = measure(&gate_queue, &arrivals, messages, round).await;
        println!(
            "| {round} | {:.0} | {:.0} | {:.2}× | {:.1} / {:.1} | {:.1} / {:.1} | {:.0} / {:.0} / {:.0} | {:.0} / {:.0} / {:.0} |",
            bare.per_second,
            gate.per_second,
            gate.per_second / bare.per_second,
            bare.p50_ms,
            bare.p99_ms,
            gate.p50_ms,
            gate.p99_ms,
            bare.cpu[0],
            bare.cpu[1],
            bare.cpu[2],
            gate.cpu[0],
            gate.cpu[1],
            gate.cpu[2],
        );
    }
    gateway.shutdown().await;
}
