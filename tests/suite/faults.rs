//! The gateway under real faults, end to end: the demo upstream's execution
//! counter is the oracle — never twice, never lost.

use crate::support;

use std::os::unix::process::CommandExt;

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use support::services::{self, PrivateRedis};
use support::{Http, Stack, retry_through_conflicts, spawn_gateway, wait_up};

const KEY_ROUTES: &str = r#"
    [[routes]]
    name = "act"
    methods = ["POST"]
    path_prefix = "/actions/"
    upstream = "demo"
    idempotency = "key"

    [[routes]]
    name = "orders"
    methods = ["POST"]
    path = "/orders"
    upstream = "demo"
    idempotency = "key"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_table_is_503_within_the_timeout_and_service_recovers() {
    let test = "a_locked_table_is_503_within_the_timeout";
    let Some(url) = services::shared_sql(test).await else {
        return;
    };
    let stack = Stack::start_with(KEY_ROUTES, |c| {
        c.store.database_url = url.clone();
        c.store.timeout = "500ms".into();
    })
    .await;
    let locker = services::TableLock::take(&url).await;
    let started = Instant::now();
    let a = stack
        .http
        .send(
            "POST",
            &stack.url("/actions/locked"),
            &[("idempotency-key", "k")],
            "{}",
        )
        .await;
    assert_eq!(a.status, 503);
    assert_eq!(a.problem_type(), "urn:idemgate:problem:store-unavailable");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        stack.upstream.state.stats().requests,
        0,
        "forwarded without a claim"
    );
    locker.release().await;
    let http = stack.http.clone();
    let url2 = stack.url("/actions/locked");
    let recovered = support::eventually(Duration::from_secs(10), || {
        let http = http.clone();
        let url2 = url2.clone();
        async move {
            let a = http
                .send("POST", &url2, &[("idempotency-key", "after")], "{}")
                .await;
            a.status == 201
        }
    })
    .await;
    assert!(
        recovered,
        "the gateway did not recover once the lock was released"
    );
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_sharing_redis_and_postgres_execute_a_split_storm_once() {
    let test = "two_instances_sharing_redis_and_postgres";
    let Some(db) = services::shared_sql(test).await else {
        return;
    };
    let Some((redis, prefix)) = services::redis(test).await else {
        return;
    };
    let stack = Stack::start_with(KEY_ROUTES, |c| {
        c.store.database_url = db.clone();
        c.store.redis_url = redis.clone();
        c.store.redis_prefix = prefix.clone();
        c.server.max_connections = 1000;
    })
    .await;
    let mut config = support::config(stack.upstream.addr, KEY_ROUTES);
    config.store.database_url = db;
    config.store.redis_url = redis;
    config.store.redis_prefix = prefix;
    let second = idemgate_gateway::gateway::start_for_tests(config)
        .await
        .unwrap();
    let urls = [
        stack.url("/actions/split"),
        format!("http://{}/actions/split", second.public_addr),
    ];
    let statuses: Vec<u16> = support::concurrent_posts(
        &stack.http,
        400,
        |i| urls[i % 2].clone(),
        |_| support::pairs(&[("idempotency-key", "split"), ("x-demo-delay-ms", "150")]),
        "{}",
    )
    .await
    .iter()
    .map(|a| a.status.as_u16())
    .collect();
    assert!(
        statuses.iter().all(|s| *s == 201 || *s == 409),
        "{statuses:?}"
    );
    assert_eq!(stack.upstream.state.stats().total_executions, 1);
    second.shutdown().await;
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_mid_storm_through_the_gateway_still_executes_once() {
    let test = "redis_killed_mid_storm_through_the_gateway";
    let Some(mut redis) = PrivateRedis::start(test).await else {
        return;
    };
    let Some(db) = services::shared_sql(test).await else {
        return;
    };
    let stack = Stack::start_with(KEY_ROUTES, |c| {
        c.store.database_url = db;
        c.store.redis_url = redis.url();
        c.server.max_connections = 1000;
    })
    .await;
    let http = stack.http.clone();
    let url = stack.url("/actions/storm");
    let storm = tokio::spawn(async move {
        support::concurrent_posts(
            &http,
            300,
            |_| url.clone(),
            |_| support::pairs(&[("idempotency-key", "storm"), ("x-demo-delay-ms", "300")]),
            "{}",
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(30)).await;
    redis.kill();
    let statuses: Vec<u16> = storm
        .await
        .unwrap()
        .iter()
        .map(|a| a.status.as_u16())
        .collect();
    assert!(
        statuses.iter().all(|s| *s == 201 || *s == 409),
        "{statuses:?}"
    );
    assert_eq!(stack.upstream.state.stats().total_executions, 1);
    // With Redis gone entirely, new keys still work on the SQL path.
    let a = stack
        .http
        .send(
            "POST",
            &stack.url("/actions/after"),
            &[("idempotency-key", "a")],
            "{}",
        )
        .await;
    assert_eq!(a.status, 201);
    let again = stack
        .http
        .send(
            "POST",
            &stack.url("/actions/after"),
            &[("idempotency-key", "a")],
            "{}",
        )
        .await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    stack.shutdown().await;
}

/// A config file for the `idemgate` binary in `dir` with `store` as its
/// `[store]` table and key routes to the upstream at `upstream`.
fn write_binary_config(
    dir: &std::path::Path,
    name: &str,
    listen: &str,
    admin: &str,
    store: &str,
    upstream: (&str, &str),
) -> std::path::PathBuf {
    let (upstream, timeout) = upstream;
    let path = dir.join(name);
    std::fs::write(
        &path,
        format!(
            r#"
            [server]
            listen = "{listen}"
            admin_listen = "{admin}"
            [store]
            {store}
            [[upstreams]]
            name = "demo"
            url = "http://{upstream}"
            timeout = "{timeout}"
            {KEY_ROUTES}
            "#
        ),
    )
    .unwrap();
    path
}

/// Key routes, a 3 s lease (the shortest the 2.5 s upstream timeout and
/// 500 ms store timeout allow), and one SQLite file per directory (so
/// every config written in one directory shares the records).
fn binary_config(
    dir: &std::path::Path,
    name: &str,
    listen: &str,
    admin: &str,
    upstream: &str,
) -> std::path::PathBuf {
    let store = format!(
        "database_url = \"sqlite://{}/records.db\"\nlease = \"3s\"\ntimeout = \"500ms\"",
        dir.display()
    );
    write_binary_config(dir, name, listen, admin, &store, (upstream, "2500ms"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_killed_mid_request_then_restarted_executes_at_most_once() {
    let upstream = idemgate_demo_upstream::start("127.0.0.1:0").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", support::dead_port());
    let config = binary_config(
        dir.path(),
        "idemgate.toml",
        &listen,
        "127.0.0.1:0",
        &upstream.addr.to_string(),
    );
    let http = Http::default();
    let mut gateway = spawn_gateway(&config);
    wait_up(&http, &format!("http://{listen}/")).await;
    let order = r#"{"item":"book","amount":100,"coupon":"ONCE"}"#;
    let url = format!("http://{listen}/orders");
    // The upstream commits after 800 ms; the gateway dies at 300 ms, after
    // its claim was durable and the request was forwarded.
    let in_flight = {
        let http = http.clone();
        let url = url.clone();
        tokio::spawn(async move {
            http.try_send(
                "POST",
                &url,
                &[("idempotency-key", "order-1"), ("x-demo-delay-ms", "800")],
                order,
            )
            .await
        })
    };
    // Not "the upstream has the head": the whole request must be there
    // for the upstream to commit after its delay.
    tokio::time::sleep(Duration::from_millis(300)).await;
    gateway.kill().unwrap();
    gateway.wait().unwrap();
    assert!(
        in_flight.await.unwrap().is_err(),
        "the client saw the gateway die"
    );
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(
        upstream.state.executions("deduct_coupon", "ONCE"),
        1,
        "the upstream did commit"
    );

    let mut gateway = spawn_gateway(&config);
    wait_up(&http, &format!("http://{listen}/")).await;
    // Until the dead holder's lease runs out, retries are told to wait…
    // …then one retry takes over (epoch 2) and is forwarded with the same
    // key; the upstream's state check answers it without a second deduction.
    let answer = retry_through_conflicts(&http, &url, "order-1", order).await;
    assert_eq!(answer.json()["repeat"], true);
    assert_eq!(upstream.state.executions("deduct_coupon", "ONCE"), 1);
    assert_eq!(
        upstream.state.stats().executions["create_order"]
            .values()
            .sum::<u64>(),
        1
    );
    gateway.kill().unwrap();
    gateway.wait().unwrap();
    upstream.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_instance_past_its_lease_is_fenced_when_it_wakes() {
    let upstream = idemgate_demo_upstream::start("127.0.0.1:0").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ports: Vec<u16> = (0..3).map(|_| support::dead_port()).collect();
    let upstream_addr = upstream.addr.to_string();
    let at = |port: u16| format!("127.0.0.1:{port}");
    let a_config = binary_config(
        dir.path(),
        "a.toml",
        &at(ports[0]),
        "127.0.0.1:0",
        &upstream_addr,
    );
    let b_config = binary_config(
        dir.path(),
        "b.toml",
        &at(ports[1]),
        &at(ports[2]),
        &upstream_addr,
    );
    let http = Http::default();
    // One after the other: two processes migrating a fresh SQLite file at
    // the same instant collide (several instances belong on Postgres; this
    // test uses SQLite to run without services).
    let mut a = spawn_gateway(&a_config);
    wait_up(&http, &format!("http://127.0.0.1:{}/", ports[0])).await;
    let mut b = spawn_gateway(&b_config);
    wait_up(&http, &format!("http://127.0.0.1:{}/", ports[1])).await;
    let order = r#"{"item":"book","amount":100}"#;
    let first = {
        let http = http.clone();
        let url = format!("http://127.0.0.1:{}/orders", ports[0]);
        tokio::spawn(async move {
            http.send(
                "POST",
                &url,
                &[
                    ("idempotency-key", "f"),
                    ("x-request-id", "req-A"),
                    ("x-demo-delay-ms", "2000"),
                ],
                order,
            )
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let signal = |child: &Child, sig: &str| {
        Command::new("kill")
            .args([sig, &child.id().to_string()])
            .status()
            .unwrap();
    };
    signal(&a, "-STOP");
    // A holds epoch 1 but cannot renew; after its lease, B takes over.
    tokio::time::sleep(Duration::from_millis(3200)).await;
    let second = {
        let http = http.clone();
        let url = format!("http://127.0.0.1:{}/orders", ports[1]);
        tokio::spawn(async move {
            http.send(
                "POST",
                &url,
                &[
                    ("idempotency-key", "f"),
                    ("x-request-id", "req-B"),
                    ("x-demo-delay-ms", "2000"),
                ],
                order,
            )
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(800)).await;
    // A wakes up with the upstream's answer in its socket and tries to
    // record epoch 1. It slept past its lease, so (the lease outlasts the
    // upstream timeout) also past its own timeout: its client gets the
    // answer or, when the timer is seen first, 504 — and either write is
    // refused by the fence.
    signal(&a, "-CONT");
    let first = first.await.unwrap();
    assert!(
        first.status == 201 || first.status == 504,
        "A's client: {} {:?}",
        first.status,
        first.body
    );
    let second = second.await.unwrap();
    assert_eq!(second.status, 201);
    assert_eq!(
        second.json()["repeat"],
        true,
        "the upstream's state check answered the takeover"
    );
    let record = http
        .get(&format!(
            "http://127.0.0.1:{}/admin/keys/orders/f",
            ports[2]
        ))
        .await
        .json();
    let record = &record["records"][0];
    // B's takeover: one past A's epoch (epochs start at the database's
    // clock in microseconds and only grow).
    assert!(
        record["epoch"].as_i64().unwrap() > 1_000_000_000_000_000,
        "{record}"
    );
    assert_eq!(record["state"], "completed");
    assert_eq!(
        record["request_id"], "req-B",
        "A's late completion overwrote B's: {record}"
    );
    assert_eq!(
        upstream.state.stats().executions["create_order"]
            .values()
            .sum::<u64>(),
        1
    );
    for child in [&mut a, &mut b] {
        child.kill().unwrap();
        child.wait().unwrap();
    }
    upstream.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_killed_between_claim_and_forward_then_restarted_executes_once() {
    use support::services::{FaultProxy, Mode};
    let upstream = idemgate_demo_upstream::start("127.0.0.1:0").await.unwrap();
    // The gateway reaches the upstream through a proxy that, for now,
    // swallows every connection: the claim is made, the request never
    // arrives.
    let proxy = FaultProxy::start(upstream.addr).await;
    proxy.set(Mode::Blackhole);
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", support::dead_port());
    let config = binary_config(
        dir.path(),
        "idemgate.toml",
        &listen,
        "127.0.0.1:0",
        &format!("127.0.0.1:{}", proxy.port),
    );
    let http = Http::default();
    let mut gateway = spawn_gateway(&config);
    wait_up(&http, &format!("http://{listen}/")).await;
    let url = format!("http://{listen}/actions/charge");
    let first = {
        let (http, url) = (http.clone(), url.clone());
        tokio::spawn(async move {
            http.try_send(
                "POST",
                &url,
                &[("idempotency-key", "charge-1")],
                "{\"amount\":5}",
            )
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(400)).await;
    gateway.kill().unwrap();
    gateway.wait().unwrap();
    assert!(first.await.unwrap().is_err());
    assert_eq!(
        upstream.state.stats().requests,
        0,
        "nothing reached the upstream"
    );

    proxy.set(Mode::Pass);
    let mut gateway = spawn_gateway(&config);
    wait_up(&http, &format!("http://{listen}/")).await;
    let answer = retry_through_conflicts(&http, &url, "charge-1", "{\"amount\":5}").await;
    let forwarded_key = answer.json()["key"].as_str().unwrap().to_owned();
    // And from now on it replays.
    let again = http
        .send(
            "POST",
            &url,
            &[("idempotency-key", "charge-1")],
            "{\"amount\":5}",
        )
        .await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(upstream.state.executions("charge", &forwarded_key), 1);
    gateway.kill().unwrap();
    gateway.wait().unwrap();
    upstream.shutdown().await;
}

/// Key routes on Postgres `db`, a 4 s lease over a 3.5 s upstream timeout.
fn postgres_config(
    dir: &std::path::Path,
    name: &str,
    listen: &str,
    db: &str,
    upstream: &str,
) -> std::path::PathBuf {
    let store = format!("database_url = \"{db}\"\nlease = \"4s\"\ntimeout = \"500ms\"");
    write_binary_config(
        dir,
        name,
        listen,
        "127.0.0.1:0",
        &store,
        (upstream, "3500ms"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_whose_clock_runs_ahead_cannot_take_over_a_live_claim() {
    let test = "an_instance_whose_clock_runs_ahead_cannot_take_over_a_live_claim";
    let Some(db) = services::shared_sql(test).await else {
        return;
    };
    if Command::new("faketime").arg("--version").output().is_err() {
        services::missing("faketime", test, "the faketime command is not installed");
        return;
    }
    let upstream = idemgate_demo_upstream::start("127.0.0.1:0").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (a_port, b_port) = (support::dead_port(), support::dead_port());
    let up = upstream.addr.to_string();
    let a_config = postgres_config(
        dir.path(),
        "a.toml",
        &format!("127.0.0.1:{a_port}"),
        &db,
        &up,
    );
    let b_config = postgres_config(
        dir.path(),
        "b.toml",
        &format!("127.0.0.1:{b_port}"),
        &db,
        &up,
    );
    let http = Http::default();
    let mut a = spawn_gateway(&a_config);
    wait_up(&http, &format!("http://127.0.0.1:{a_port}/")).await;
    // B's wall clock runs 6 s ahead (its monotonic clock is left alone, so
    // its timers behave): by its own clock, A's 4 s lease is long over.
    let mut b = Command::new("faketime")
        .args(["-f", "+6s"])
        .arg(env!("CARGO_BIN_EXE_idemgate"))
        .args(["serve", "--config"])
        .arg(&b_config)
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        // `faketime` forks the gateway and waits for it: killing faketime
        // alone would leave the gateway running, so B gets a process
        // group of its own and the whole group is killed.
        .process_group(0)
        .spawn()
        .unwrap();
    wait_up(&http, &format!("http://127.0.0.1:{b_port}/")).await;
    let first = {
        let http = http.clone();
        let url = format!("http://127.0.0.1:{a_port}/actions/skew");
        tokio::spawn(async move {
            http.send(
                "POST",
                &url,
                &[("idempotency-key", "s"), ("x-demo-delay-ms", "3000")],
                "{}",
            )
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let b_url = format!("http://127.0.0.1:{b_port}/actions/skew");
    for _ in 0..4 {
        let retry = http
            .send("POST", &b_url, &[("idempotency-key", "s")], "{}")
            .await;
        assert_eq!(
            retry.status, 409,
            "B took over A's live claim: {:?}",
            retry.body
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(first.await.unwrap().status, 201);
    let replay = http
        .send("POST", &b_url, &[("idempotency-key", "s")], "{}")
        .await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        upstream.state.stats().executions["skew"]
            .values()
            .sum::<u64>(),
        1
    );
    a.kill().unwrap();
    let _ = Command::new("kill")
        .args(["-s", "KILL", "--", &format!("-{}", b.id())])
        .status();
    let _ = (a.wait(), b.wait());
    upstream.shutdown().await;
}
