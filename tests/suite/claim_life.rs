//! A claim belongs to the gateway (docs/semantics.md, rule 6): whatever the client,
//! the response body or the database does after a request was forwarded,
//! the outcome is recorded and a retry never executes the action again.
//!
//! Every count is taken on the demo upstream's `/actions/{name}`, which
//! executes on every call (it does not deduplicate by itself): any
//! duplicate that slipped through the gateway shows in the count. Each
//! scenario runs on SQLite (a file, so a second connection can lock it) and
//! on Redis + Postgres.

use crate::support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use support::services;
use support::{Answer, Stack, executions};
use tokio::io::AsyncWriteExt;

const ACTIONS: &str = r#"
    [[routes]]
    name = "act"
    methods = ["POST"]
    path_prefix = "/actions/"
    upstream = "demo"
    idempotency = "key"
"#;

/// Where the records live for one test.
enum Backend {
    Sqlite(tempfile::TempDir),
    RedisShared {
        db: String,
        redis: String,
        prefix: String,
    },
}

impl Backend {
    fn sqlite() -> Backend {
        Backend::Sqlite(tempfile::tempdir().unwrap())
    }

    async fn redis_postgres(test: &str) -> Option<Backend> {
        let db = services::shared_sql(test).await?;
        let (redis, prefix) = services::redis(test).await?;
        Some(Backend::RedisShared { db, redis, prefix })
    }

    fn database_url(&self) -> String {
        match self {
            Backend::Sqlite(dir) => format!("sqlite://{}/records.db", dir.path().display()),
            Backend::RedisShared { db, .. } => db.clone(),
        }
    }

    /// A demo upstream and a gateway on this backend in front of it, with
    /// `lease`, `store.timeout` and the upstream's `timeout`.
    async fn stack(&self, lease: &str, store_timeout: &str, upstream_timeout: &str) -> Stack {
        let upstream = idemgate_demo_upstream::start("127.0.0.1:0").await.unwrap();
        let gateway = self
            .gateway(upstream.addr, lease, store_timeout, upstream_timeout)
            .await;
        Stack {
            upstream,
            gateway,
            http: support::Http::default(),
        }
    }

    async fn gateway(
        &self,
        upstream: SocketAddr,
        lease: &str,
        store_timeout: &str,
        upstream_timeout: &str,
    ) -> idemgate_gateway::gateway::RunningGateway {
        let mut c = support::config(upstream, ACTIONS);
        c.store.database_url = self.database_url();
        if let Backend::RedisShared { redis, prefix, .. } = self {
            c.store.redis_url = redis.clone();
            c.store.redis_prefix = prefix.clone();
        }
        c.store.lease = lease.into();
        c.store.timeout = store_timeout.into();
        c.upstreams[0].timeout = upstream_timeout.into();
        idemgate_gateway::gateway::start_for_tests(c).await.unwrap()
    }

    /// Holds the records table locked (writes block) until the returned
    /// guard's `release`.
    async fn lock(&self) -> Lock {
        use sqlx::Connection;
        match self {
            Backend::Sqlite(_) => {
                let mut conn = sqlx::SqliteConnection::connect(&self.database_url())
                    .await
                    .unwrap();
                sqlx::query("BEGIN EXCLUSIVE")
                    .execute(&mut conn)
                    .await
                    .unwrap();
                Lock::Sqlite(conn)
            }
            Backend::RedisShared { db, .. } => Lock::Shared(services::TableLock::take(db).await),
        }
    }
}

enum Lock {
    Sqlite(sqlx::SqliteConnection),
    Shared(services::TableLock),
}

impl Lock {
    async fn release(self) {
        match self {
            Lock::Sqlite(mut c) => {
                sqlx::query("COMMIT").execute(&mut c).await.unwrap();
            }
            Lock::Shared(lock) => lock.release().await,
        }
    }
}

/// Arms the upstream's next requests with `plan` (`POST /faults`).
async fn arm(stack: &Stack, plan: &'static str) {
    let url = format!("{}/faults", stack.upstream.url());
    let a = stack.http.send("POST", &url, &[], plan).await;
    assert_eq!(a.status, 204);
}

/// A client that sends a keyed POST and hangs up after `after`, as a client
/// with its own short timeout does.
async fn hang_up_after(addr: SocketAddr, path: &str, key: &str, after: Duration) {
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body = "{}";
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: gw\r\nIdempotency-Key: {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(request.as_bytes()).await.unwrap();
    tokio::time::sleep(after).await;
    drop(socket);
}

async fn post(stack: &Stack, path: &str, key: &str) -> Answer {
    stack
        .http
        .send("POST", &stack.url(path), &[("idempotency-key", key)], "{}")
        .await
}

/// Sleeps until `at` after `start`.
async fn at(start: Instant, at: Duration) {
    tokio::time::sleep_until((start + at).into()).await;
}

fn assert_replayed(a: &Answer, when: &str) {
    assert_eq!(a.status, 201, "{when}: {:?}", a.body);
    assert_eq!(a.header("idempotent-replayed"), Some("true"), "{when}");
}

// === the client hangs up before the upstream answers ===

async fn hang_up_case(backend: Backend) {
    let stack = backend.stack("3s", "1s", "10s").await;
    arm(&stack, r#"{"delay_ms":1500,"count":1}"#).await;
    let start = Instant::now();
    hang_up_after(
        stack.gateway.public_addr,
        "/actions/hangup",
        "h-1",
        Duration::from_millis(300),
    )
    .await;
    at(start, Duration::from_secs(2)).await;
    let a = post(&stack, "/actions/hangup", "h-1").await;
    assert_replayed(&a, "retry at 2 s");
    // After the lease: the record is complete, nothing to take over.
    at(start, Duration::from_millis(3500)).await;
    let b = post(&stack, "/actions/hangup", "h-1").await;
    assert_replayed(&b, "retry after the lease");
    assert_eq!(a.body, b.body);
    assert_eq!(executions(&stack, "hangup"), 1);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_does_not_cancel_the_outcome_sqlite() {
    hang_up_case(Backend::sqlite()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_does_not_cancel_the_outcome_redis_postgres() {
    let test = "a_client_that_hangs_up_does_not_cancel_the_outcome_redis_postgres";
    if let Some(backend) = Backend::redis_postgres(test).await {
        hang_up_case(backend).await;
    }
}

// === a slow response body outlives the lease ===

async fn slow_body_case(backend: Backend) {
    let stack = backend.stack("2s", "1s", "10s").await;
    arm(&stack, r#"{"stall_body_ms":3500,"count":1}"#).await;
    let start = Instant::now();
    let first = {
        let http = stack.http.clone();
        let url = stack.url("/actions/slowbody");
        tokio::spawn(async move {
            http.send("POST", &url, &[("idempotency-key", "s-1")], "{}")
                .await
        })
    };
    // 1.5 s and 2.5 s: within and past the first lease, while the body is
    // still coming. The claim is held (renewed), never taken over.
    for t in [1500, 2500] {
        at(start, Duration::from_millis(t)).await;
        let a = post(&stack, "/actions/slowbody", "s-1").await;
        assert_eq!(a.status, 409, "retry at {t} ms: {:?}", a.body);
    }
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    let a = post(&stack, "/actions/slowbody", "s-1").await;
    assert_replayed(&a, "retry after the body");
    assert_eq!(a.body, first.body);
    assert_eq!(executions(&stack, "slowbody"), 1);
    assert_eq!(stack.upstream.state.stats().peak_running, 1);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_body_past_the_lease_keeps_the_claim_sqlite() {
    slow_body_case(Backend::sqlite()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_body_past_the_lease_keeps_the_claim_redis_postgres() {
    let test = "a_slow_body_past_the_lease_keeps_the_claim_redis_postgres";
    if let Some(backend) = Backend::redis_postgres(test).await {
        slow_body_case(backend).await;
    }
}

/// The same on a second gateway sharing the Postgres record: its own
/// process state knows nothing of the first's holder, so only the lease
/// renewed in the store (by the database's clock) keeps the duplicate out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_body_past_the_lease_keeps_the_claim_on_another_instance() {
    let test = "a_slow_body_past_the_lease_keeps_the_claim_on_another_instance";
    let Some(backend) = Backend::redis_postgres(test).await else {
        return;
    };
    let stack = backend.stack("2s", "1s", "10s").await;
    let other = backend
        .gateway(stack.upstream.addr, "2s", "1s", "10s")
        .await;
    arm(&stack, r#"{"stall_body_ms":3500,"count":1}"#).await;
    let start = Instant::now();
    let first = {
        let http = stack.http.clone();
        let url = stack.url("/actions/slowbody");
        tokio::spawn(async move {
            http.send("POST", &url, &[("idempotency-key", "s-2")], "{}")
                .await
        })
    };
    let elsewhere = format!("http://{}/actions/slowbody", other.public_addr);
    for t in [1500, 2500, 3200] {
        at(start, Duration::from_millis(t)).await;
        let a = stack
            .http
            .send("POST", &elsewhere, &[("idempotency-key", "s-2")], "{}")
            .await;
        assert_eq!(a.status, 409, "retry elsewhere at {t} ms: {:?}", a.body);
    }
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    let a = stack
        .http
        .send("POST", &elsewhere, &[("idempotency-key", "s-2")], "{}")
        .await;
    assert_replayed(&a, "retry elsewhere after the body");
    assert_eq!(executions(&stack, "slowbody"), 1);
    assert_eq!(stack.upstream.state.stats().peak_running, 1);
    other.shutdown().await;
    stack.shutdown().await;
}

// === a body slower than the upstream timeout ===

async fn body_past_timeout_case(backend: Backend) {
    let stack = backend.stack("3s", "1s", "1s").await;
    arm(&stack, r#"{"stall_body_ms":2500,"count":1}"#).await;
    let started = Instant::now();
    let a = post(&stack, "/actions/stall", "t-1").await;
    let took = started.elapsed();
    assert_eq!(a.status, 504, "{:?}", a.body);
    assert_eq!(a.problem_type(), "urn:idemgate:problem:upstream-timeout");
    assert!(
        took < Duration::from_millis(2000),
        "answered after {took:?}"
    );
    // The action may have run: the record is uncertain, and the retry is
    // forwarded again (one at a time) for the upstream's own check.
    let shown = stack
        .http
        .get(&stack.admin("/admin/keys/act/t-1"))
        .await
        .json();
    assert_eq!(shown["records"][0]["state"], "uncertain", "{shown}");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiving_the_whole_response_is_bounded_by_the_upstream_timeout_sqlite() {
    body_past_timeout_case(Backend::sqlite()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiving_the_whole_response_is_bounded_by_the_upstream_timeout_redis_postgres() {
    let test = "receiving_the_whole_response_is_bounded_by_the_upstream_timeout_redis_postgres";
    if let Some(backend) = Backend::redis_postgres(test).await {
        body_past_timeout_case(backend).await;
    }
}

// === the completion write fails while the database is locked ===

async fn locked_completion_case(backend: Backend) {
    let stack = backend.stack("3s", "1s", "10s").await;
    arm(&stack, r#"{"delay_ms":1000,"count":1}"#).await;
    let start = Instant::now();
    let first = {
        let http = stack.http.clone();
        let url = stack.url("/actions/locked");
        tokio::spawn(async move {
            http.send("POST", &url, &[("idempotency-key", "l-1")], "{}")
                .await
        })
    };
    at(start, Duration::from_millis(500)).await;
    let lock = backend.lock().await;
    at(start, Duration::from_secs(3)).await;
    lock.release().await;
    let first = first.await.unwrap();
    assert_eq!(
        first.status, 201,
        "the upstream's answer reaches the client"
    );
    let mut replayed = None;
    for t in [3500, 4500, 6000, 9000] {
        at(start, Duration::from_millis(t)).await;
        let a = post(&stack, "/actions/locked", "l-1").await;
        assert!(
            a.status == 201 || a.status == 409,
            "retry at {t} ms: {} {:?}",
            a.status,
            a.body
        );
        if a.status == 201 {
            assert_replayed(&a, "retry");
            replayed = Some(a);
        }
    }
    let replayed = replayed.expect("replayed by 9 s");
    assert_eq!(replayed.body, first.body);
    assert_eq!(executions(&stack, "locked"), 1);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_that_fails_while_the_database_is_locked_is_retried_sqlite() {
    locked_completion_case(Backend::sqlite()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_that_fails_while_the_database_is_locked_is_retried_redis_postgres() {
    let test = "a_completion_that_fails_while_the_database_is_locked_is_retried_redis_postgres";
    if let Some(backend) = Backend::redis_postgres(test).await {
        locked_completion_case(backend).await;
    }
}

// === a hung database with a backlog of first requests ===

async fn hung_database_case(backend: Backend) {
    let stack = backend.stack("3s", "1s", "10s").await;
    let lock = backend.lock().await;
    let started = Instant::now();
    let answers = futures_util::future::join_all((0..500).map(|i| {
        let http = stack.http.clone();
        let url = stack.url(&format!("/actions/hung{}", i % 10));
        async move {
            let key = format!("hung-{i}");
            let a = http
                .send("POST", &url, &[("idempotency-key", key.as_str())], "{}")
                .await;
            (a, started.elapsed())
        }
    }))
    .await;
    for (a, took) in &answers {
        assert_eq!(a.status, 503, "{:?}", a.body);
        // store.timeout bounds every wait, queueing included; a queue that
        // grew with the backlog would answer the last ones after several
        // timeouts.
        assert!(
            *took < Duration::from_millis(2500),
            "answered after {took:?}"
        );
    }
    assert_eq!(stack.upstream.state.stats().total_executions, 0);
    lock.release().await;
    // Nothing was claimed behind the clients' backs: every key is free
    // (a claim the database committed after its client was told 503 is
    // given back at once, not held for the lease) and executes once now.
    for i in 0..20 {
        let path = format!("/actions/hung{}", i % 10);
        let key = format!("hung-{i}");
        let mut a = post(&stack, &path, &key).await;
        for _ in 0..20 {
            if a.status != 409 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            a = post(&stack, &path, &key).await;
        }
        assert_eq!(a.status, 201, "after the lock, {i}: {:?}", a.body);
    }
    assert_eq!(stack.upstream.state.stats().total_executions, 20);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_database_answers_every_queued_client_within_the_store_timeout_sqlite() {
    hung_database_case(Backend::sqlite()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_database_answers_every_queued_client_within_the_store_timeout_redis_postgres() {
    let test =
        "a_hung_database_answers_every_queued_client_within_the_store_timeout_redis_postgres";
    if let Some(backend) = Backend::redis_postgres(test).await {
        hung_database_case(backend).await;
    }
}

// === a graceful shutdown with a claim in flight and its client gone ===

async fn shutdown_case(backend: Backend) {
    let stack = backend.stack("2s", "1s", "10s").await;
    arm(&stack, r#"{"delay_ms":1500,"count":1}"#).await;
    hang_up_after(
        stack.gateway.public_addr,
        "/actions/drain",
        "d-1",
        Duration::from_millis(300),
    )
    .await;
    // The drain SIGTERM starts: the client is gone, so no connection keeps
    // the gateway up — only the claim does, and it is recorded first.
    let Stack {
        upstream,
        gateway,
        http,
    } = stack;
    gateway.shutdown().await;
    // A new gateway on the same records, past the old lease.
    let gateway = backend.gateway(upstream.addr, "2s", "1s", "10s").await;
    let stack = Stack {
        upstream,
        gateway,
        http,
    };
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let a = post(&stack, "/actions/drain", "d-1").await;
    assert_replayed(&a, "after the restart");
    assert_eq!(executions(&stack, "drain"), 1);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_records_the_claims_in_flight_before_it_exits_sqlite() {
    shutdown_case(Backend::sqlite()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_records_the_claims_in_flight_before_it_exits_redis_postgres() {
    let test = "a_shutdown_records_the_claims_in_flight_before_it_exits_redis_postgres";
    if let Some(backend) = Backend::redis_postgres(test).await {
        shutdown_case(backend).await;
    }
}

// === the client hangs up at once, while its claim is being written ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_before_its_claim_is_written_is_still_seen_through() {
    let stack = Backend::sqlite().stack("30s", "1s", "10s").await;
    for i in 0..20 {
        let key = format!("g-{i}");
        hang_up_after(
            stack.gateway.public_addr,
            "/actions/gone",
            &key,
            Duration::ZERO,
        )
        .await;
    }
    // Whatever moment each client left at, every claim that was won is
    // forwarded and recorded: no key stays held for the 30 s lease, and a
    // retry replays instead of executing again.
    let done = support::eventually(Duration::from_secs(5), || async {
        stack
            .gateway
            .metrics
            .claims_in_flight
            .load(std::sync::atomic::Ordering::Relaxed)
            == 0
    })
    .await;
    assert!(done);
    let executed = executions(&stack, "gone");
    for i in 0..20 {
        // A claim the hang-up raced may still be finishing: `409 in
        // flight` until its outcome is recorded, then the replay.
        let mut a = post(&stack, "/actions/gone", &format!("g-{i}")).await;
        for _ in 0..50 {
            if a.status != 409 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            a = post(&stack, "/actions/gone", &format!("g-{i}")).await;
        }
        assert_eq!(a.status, 201, "{i}: {:?}", a.body);
    }
    // Each key ran exactly once: before the hang-up was noticed or on its
    // retry, never both.
    assert_eq!(
        executions(&stack, "gone"),
        20,
        "{executed} ran before the retries"
    );
    for i in 0..20 {
        let a = post(&stack, "/actions/gone", &format!("g-{i}")).await;
        assert_eq!(a.header("idempotent-replayed"), Some("true"));
    }
    stack.shutdown().await;
}

// === SIGTERM to the binary with a slow request in flight, client gone ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_records_the_outcome_of_a_request_whose_client_hung_up() {
    let upstream = idemgate_demo_upstream::start("127.0.0.1:0").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", support::dead_port());
    let config = dir.path().join("idemgate.toml");
    std::fs::write(
        &config,
        format!(
            r#"
            [server]
            listen = "{listen}"
            admin_listen = "127.0.0.1:0"
            shutdown_grace = "10s"
            [store]
            database_url = "sqlite://{}/records.db"
            lease = "3s"
            timeout = "500ms"
            [[upstreams]]
            name = "demo"
            url = "http://{}"
            timeout = "2s"
            {ACTIONS}
            "#,
            dir.path().display(),
            upstream.addr
        ),
    )
    .unwrap();
    let http = support::Http::default();
    let mut gateway = support::spawn_gateway(&config);
    support::wait_up(&http, &format!("http://{listen}/")).await;
    let addr: SocketAddr = listen.parse().unwrap();
    let before = upstream.state.stats().requests;
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = "POST /actions/term HTTP/1.1\r\nHost: gw\r\nIdempotency-Key: t-1\r\n\
                   X-Demo-Delay-Ms: 1500\r\nContent-Length: 2\r\n\r\n{}";
    socket.write_all(request.as_bytes()).await.unwrap();
    // The claim is won and the action is running upstream: now hang up.
    support::reached(&upstream, before + 1).await;
    drop(socket);
    std::process::Command::new("kill")
        .args(["-TERM", &gateway.id().to_string()])
        .status()
        .unwrap();
    // No connection is left, yet the process waits for the claim.
    let status = gateway.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert_eq!(
        upstream.state.stats().executions["term"]
            .values()
            .sum::<u64>(),
        1
    );
    // Restarted past the old lease: the outcome was recorded before exit.
    tokio::time::sleep(Duration::from_millis(3200)).await;
    let mut gateway = support::spawn_gateway(&config);
    support::wait_up(&http, &format!("http://{listen}/")).await;
    let retry = http
        .send(
            "POST",
            &format!("http://{listen}/actions/term"),
            &[("idempotency-key", "t-1"), ("x-demo-delay-ms", "1500")],
            "{}",
        )
        .await;
    assert_eq!(retry.status, 201);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        upstream.state.stats().executions["term"]
            .values()
            .sum::<u64>(),
        1
    );
    gateway.kill().unwrap();
    let _ = gateway.wait();
    upstream.shutdown().await;
}
