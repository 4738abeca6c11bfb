//! A Postgres store that moves: the pool's server turns read-only under
//! pooled connections while a VIP moves to a new primary, and a URL that
//! names several hosts. Each test runs private servers of its own and
//! counts executions at an upstream path that does not deduplicate.

use crate::support;

use std::time::{Duration, Instant};

use idemgate_store::{SqlSettings, SqlStore};
use support::Stack;
use support::pg_private::{MovingFront, PrivatePostgres};

const KEY_ROUTES: &str = r#"
    [[routes]]
    name = "act"
    methods = ["POST"]
    path_prefix = "/actions/"
    upstream = "demo"
    idempotency = "key"
"#;

const STORE_UNAVAILABLE: &str = "urn:idemgate:problem:store-unavailable";

/// The store's tables on `url`, as a failover target has them (a real
/// standby has them by replication).
async fn migrate(url: &str) {
    let sql = SqlStore::connect(&SqlSettings {
        url: url.to_owned(),
        pool_size: 2,
        timeout: Duration::from_secs(5),
        tombstone: Duration::ZERO,
        schema: None,
        retention: Duration::from_secs(3600),
        partition_span: Duration::from_secs(3600),
    })
    .await
    .unwrap();
    sql.migrate().await.unwrap();
}

/// Fresh keys, one every 50 ms, until three in a row are answered 201 or
/// `within` passes: how long the gateway took, and every answer on the
/// way (only 201 or `503 store-unavailable` are allowed).
async fn until_served(stack: &Stack, tag: &str, within: Duration) -> (Option<Duration>, Vec<u16>) {
    let started = Instant::now();
    let mut statuses = Vec::new();
    let mut in_a_row = 0;
    let mut i = 0;
    while started.elapsed() < within {
        let key = format!("{tag}-{i}");
        i += 1;
        let a = stack
            .http
            .send(
                "POST",
                &stack.url(&format!("/actions/{tag}")),
                &[("idempotency-key", &key)],
                "{}",
            )
            .await;
        match a.status.as_u16() {
            201 => in_a_row += 1,
            503 => {
                assert_eq!(a.problem_type(), STORE_UNAVAILABLE);
                in_a_row = 0;
            }
            other => panic!("{other} {:?}", String::from_utf8_lossy(&a.body)),
        }
        statuses.push(a.status.as_u16());
        if in_a_row == 3 {
            return (Some(started.elapsed()), statuses);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (None, statuses)
}

/// Each of the actions `{prefix}0` … ran exactly once, and no two copies
/// of one key ever ran at once.
fn each_ran_once(stack: &Stack, prefix: &str, keys: usize) {
    let stats = stack.upstream.state.stats();
    for k in 0..keys {
        let runs: u64 = stats
            .executions
            .get(&format!("{prefix}{k}"))
            .map_or(0, |by_key| by_key.values().sum());
        assert_eq!(runs, 1, "{prefix}{k} ran {runs} times");
    }
    assert!(stats.peak_copies <= 1, "peak copies {}", stats.peak_copies);
}

/// Every key that was answered 201 ran once; none that got 503 ran.
fn assert_ran_once_each(stack: &Stack, tag: &str, statuses: &[u16]) {
    let served = statuses.iter().filter(|s| **s == 201).count() as u64;
    let stats = stack.upstream.state.stats();
    let by_key = stats.executions.get(tag).cloned().unwrap_or_default();
    assert!(by_key.values().all(|n| *n == 1), "{by_key:?}");
    assert_eq!(by_key.values().sum::<u64>(), served, "{by_key:?}");
}

/// A VIP moves to the new primary while the old one turns read-only under
/// the gateway's pooled connections (SQLSTATE 25006 on every write). The
/// gateway fails closed, closes those connections instead of reusing them,
/// and serves through the new primary within seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_connections_to_a_server_gone_read_only_are_left_for_the_new_primary() {
    let test = "pooled_connections_to_a_server_gone_read_only";
    let Some(old) = PrivatePostgres::start(test).await else {
        return;
    };
    let Some(new) = PrivatePostgres::start(test).await else {
        return;
    };
    migrate(&new.url()).await;
    let front = MovingFront::start(old.addr()).await;
    let stack = Stack::start_with(KEY_ROUTES, |c| {
        c.store.database_url = front.url(&old.url());
        c.store.timeout = "1s".into();
    })
    .await;
    // Several pooled connections, all to the old primary.
    let warm = support::concurrent_posts(
        &stack.http,
        20,
        |i| stack.url(&format!("/actions/warm{i}")),
        |i| support::pairs(&[("idempotency-key", &format!("w{i}"))]),
        "{}",
    )
    .await;
    assert!(warm.iter().all(|a| a.status == 201));

    front.point_at(new.addr());
    old.set_read_only(true).await;
    let (took, statuses) = until_served(&stack, "moved", Duration::from_secs(15)).await;
    let took = took.unwrap_or_else(|| panic!("never served by the new primary: {statuses:?}"));
    assert!(took < Duration::from_secs(10), "{took:?} {statuses:?}");
    assert_ran_once_each(&stack, "moved", &statuses);
    stack.shutdown().await;
}

/// `database_url` names several hosts, libpq's way: the gateway starts on
/// the one that takes writes (the first is a standby), and when the roles
/// swap it follows, failing closed in between.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_url_naming_several_hosts_follows_the_writable_one() {
    let test = "a_url_naming_several_hosts";
    let Some(a) = PrivatePostgres::start(test).await else {
        return;
    };
    let Some(b) = PrivatePostgres::start(test).await else {
        return;
    };
    migrate(&a.url()).await;
    migrate(&b.url()).await;
    b.set_read_only(true).await;
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        b.port, a.port
    );
    let stack = Stack::start_with(KEY_ROUTES, |c| {
        c.store.database_url = url;
        c.store.timeout = "1s".into();
    })
    .await;
    let (took, statuses) = until_served(&stack, "first", Duration::from_secs(5)).await;
    assert!(took.is_some(), "{statuses:?}");
    assert!(statuses.iter().all(|s| *s == 201), "{statuses:?}");
    assert!(rows(&a).await >= 3, "the claims went to the standby");
    assert_eq!(rows(&b).await, 0);

    a.set_read_only(true).await;
    b.set_read_only(false).await;
    let (took, statuses) = until_served(&stack, "swapped", Duration::from_secs(15)).await;
    let took = took.unwrap_or_else(|| panic!("never followed the primary: {statuses:?}"));
    assert!(took < Duration::from_secs(10), "{took:?} {statuses:?}");
    assert!(rows(&b).await >= 3, "the claims did not follow the primary");
    assert_ran_once_each(&stack, "swapped", &statuses);
    stack.shutdown().await;
}

/// Records on `server`.
async fn rows(server: &PrivatePostgres) -> i64 {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(&server.url()).await.unwrap();
    sqlx::query_scalar("SELECT COUNT(*) FROM idempotency_records")
        .fetch_one(&mut conn)
        .await
        .unwrap()
}

/// What `/readyz` and the metric say of the store's commits.
async fn durability(stack: &Stack) -> (u16, String, String) {
    let ready = stack.http.get(&stack.admin("/readyz")).await;
    let body = ready.json();
    let metrics = stack.http.get(&stack.admin("/metrics")).await;
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    let gauge = text
        .lines()
        .find(|l| l.starts_with("idemgate_store_commit_survives_failover "))
        .unwrap_or_else(|| panic!("no gauge in {text}"))
        .rsplit(' ')
        .next()
        .unwrap()
        .to_owned();
    (
        ready.status.as_u16(),
        body["commit_durability"].as_str().unwrap().to_owned(),
        gauge,
    )
}

/// A primary with a streaming standby: asynchronous, the gateway says a
/// commit can be lost (`/readyz`, the metric); once the primary names the
/// standby synchronous, it says a commit survives. A lone server is
/// "unconfirmed". `store.require_synchronous` refuses to start on the
/// first and the last, and `/readyz` fails once a synchronous pair loses
/// its synchronous setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_says_whether_a_commit_survives_a_failover() {
    let test = "the_gateway_says_whether_a_commit_survives_a_failover";
    let Some(primary) = PrivatePostgres::start(test).await else {
        return;
    };
    let Some(_standby) = primary.standby(test).await else {
        return;
    };
    let streaming = support::eventually(Duration::from_secs(20), || async {
        primary.standbys().await.0 == 1
    })
    .await;
    assert!(streaming, "the standby never streamed");
    let stack = Stack::start_with(KEY_ROUTES, |c| c.store.database_url = primary.url()).await;
    let (status, said, gauge) = durability(&stack).await;
    assert_eq!(
        (status, said.as_str(), gauge.as_str()),
        (200, "asynchronous", "0")
    );

    // Not served with require_synchronous: the start is refused by name.
    let mut config = support::config(stack.upstream.addr, KEY_ROUTES);
    config.store.database_url = primary.url();
    config.store.require_synchronous = true;
    let refused = idemgate_gateway::gateway::start_for_tests(config.clone()).await;
    let Err(e) = refused else {
        panic!("started on an asynchronous standby with require_synchronous");
    };
    assert!(e.to_string().contains("require_synchronous"), "{e}");

    primary.set("synchronous_standby_names", "*").await;
    let synchronous = support::eventually(Duration::from_secs(20), || async {
        durability(&stack).await.1 == "synchronous"
    })
    .await;
    assert!(synchronous, "{:?}", durability(&stack).await);
    assert_eq!(durability(&stack).await.2, "1");
    let strict = idemgate_gateway::gateway::start_for_tests(config)
        .await
        .expect("a synchronous pair serves with require_synchronous");
    let ready = stack
        .http
        .get(&format!("http://{}/readyz", strict.admin_addr))
        .await;
    assert_eq!(ready.status, 200);

    // The operator turns synchronous replication off: the strict gateway
    // is not ready any more, the other one says so and stays ready.
    primary.set("synchronous_standby_names", "").await;
    let dropped = support::eventually(Duration::from_secs(20), || async {
        stack
            .http
            .get(&format!("http://{}/readyz", strict.admin_addr))
            .await
            .status
            == 503
    })
    .await;
    assert!(dropped, "the strict gateway stayed ready");
    assert_eq!(
        durability(&stack).await,
        (200, "asynchronous".into(), "0".into())
    );
    strict.shutdown().await;
    stack.shutdown().await;

    // A lone server: unconfirmed, and refused with require_synchronous.
    let Some(lone) = PrivatePostgres::start(test).await else {
        return;
    };
    let stack = Stack::start_with(KEY_ROUTES, |c| c.store.database_url = lone.url()).await;
    assert_eq!(
        durability(&stack).await,
        (200, "unconfirmed".into(), "0".into())
    );
    let mut config = support::config(stack.upstream.addr, KEY_ROUTES);
    config.store.database_url = lone.url();
    config.store.require_synchronous = true;
    assert!(
        idemgate_gateway::gateway::start_for_tests(config)
            .await
            .is_err()
    );
    stack.shutdown().await;
}

/// The real thing: a primary with a synchronous standby, two gateways on
/// a URL naming both, clients retrying their keys. The primary is killed
/// (`kill -9`) mid-load and the standby promoted. The gateways fail closed
/// meanwhile, follow the new primary, and every key a client saw
/// answered replays from it; no key ran twice, no two copies ran at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_primary_and_a_promoted_synchronous_standby_lose_no_claim() {
    let test = "a_killed_primary_and_a_promoted_synchronous_standby";
    let Some(mut primary) = PrivatePostgres::start(test).await else {
        return;
    };
    let Some(standby) = primary.standby(test).await else {
        return;
    };
    primary.set("synchronous_standby_names", "*").await;
    let synchronous = support::eventually(Duration::from_secs(20), || async {
        primary.standbys().await.1 == 1
    })
    .await;
    assert!(synchronous, "the standby never became synchronous");
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres",
        primary.port, standby.port
    );
    let tweak = |c: &mut idemgate_gateway::config::Config| {
        c.store.database_url = url.clone();
        c.store.timeout = "1s".into();
        // A claim whose commit the kill cut off is held this long.
        c.store.lease = "6s".into();
        c.store.require_synchronous = true;
    };
    let stack = Stack::start_with(KEY_ROUTES, tweak).await;
    let mut config = support::config(stack.upstream.addr, KEY_ROUTES);
    tweak(&mut config);
    let second = idemgate_gateway::gateway::start_for_tests(config)
        .await
        .unwrap();
    let gateways = [
        stack.gateway.public_addr.to_string(),
        second.public_addr.to_string(),
    ];

    // 60 clients, started 50 ms apart, each sending its key (alternately
    // to either gateway) until it is answered 201.
    const KEYS: usize = 60;
    let clients: Vec<_> = (0..KEYS)
        .map(|k| {
            let http = stack.http.clone();
            let gateways = gateways.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(50 * k as u64)).await;
                for attempt in 0.. {
                    let url = format!("http://{}/actions/f{k}", gateways[(k + attempt) % 2]);
                    let a = http
                        .send(
                            "POST",
                            &url,
                            &[
                                ("idempotency-key", &format!("k{k}")),
                                ("x-demo-delay-ms", "200"),
                            ],
                            "{}",
                        )
                        .await;
                    match a.status.as_u16() {
                        201 => return a.body,
                        409 | 503 => tokio::time::sleep(Duration::from_millis(100)).await,
                        other => panic!("{other} {:?}", String::from_utf8_lossy(&a.body)),
                    }
                    assert!(attempt < 600, "k{k} never answered");
                }
                unreachable!()
            })
        })
        .collect();
    support::reached(&stack.upstream, 15).await;
    let killed = Instant::now();
    primary.kill();
    standby.promote().await;
    let (back, statuses) = until_served(&stack, "after", Duration::from_secs(20)).await;
    let back = back.unwrap_or_else(|| panic!("not back after the failover: {statuses:?}"));
    assert!(
        killed.elapsed() < Duration::from_secs(15) + back,
        "{back:?}"
    );
    assert!(back < Duration::from_secs(15), "back after {back:?}");

    let mut answers = Vec::new();
    for client in clients {
        answers.push(client.await.unwrap());
    }
    each_ran_once(&stack, "f", KEYS);
    // Every answer a client saw is on the new primary: it replays, the
    // same, through either gateway. (An answer reaches its client before
    // its record is written; a write the kill interrupted is written again
    // on the new primary, meanwhile a retry gets 409.)
    for (k, body) in answers.iter().enumerate() {
        for gateway in &gateways {
            let url = format!("http://{gateway}/actions/f{k}");
            let mut replayed = None;
            for _ in 0..200 {
                let a = stack
                    .http
                    .send("POST", &url, &[("idempotency-key", &format!("k{k}"))], "{}")
                    .await;
                match a.status.as_u16() {
                    201 => {
                        replayed = Some(a);
                        break;
                    }
                    409 => tokio::time::sleep(Duration::from_millis(100)).await,
                    other => panic!("k{k}: {other} {:?}", String::from_utf8_lossy(&a.body)),
                }
            }
            let a = replayed.unwrap_or_else(|| panic!("k{k} never replayed"));
            assert_eq!(a.header("idempotent-replayed"), Some("true"));
            assert_eq!(&a.body, body, "k{k}");
        }
    }
    // And nothing ran again while the outcomes were being written.
    each_ran_once(&stack, "f", KEYS);
    second.shutdown().await;
    stack.shutdown().await;
}

/// Redis Sentinel as the fast layer (`redis+sentinel://…/service`): the
/// master is killed under 40 retrying clients and the Sentinel promotes
/// its replica, which may lack the last markers and answers. SQL decides
/// meanwhile: every key runs once, no two copies at once, every answer a
/// client saw replays; and the gateway finds the new master by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_of_the_fast_layer_lets_no_retry_through() {
    let test = "a_sentinel_failover_of_the_fast_layer";
    let Some(mut redis) = support::sentinel::SentinelSet::start(test).await else {
        return;
    };
    let Some(db) = support::services::shared_sql(test).await else {
        return;
    };
    let stack = Stack::start_with(KEY_ROUTES, |c| {
        c.store.database_url = db;
        c.store.redis_url = redis.url();
        c.store.timeout = "1s".into();
    })
    .await;
    let fast_layer_ok = || async {
        let ready = stack.http.get(&stack.admin("/readyz")).await;
        ready.json()["fast_layer_state"] == "ok"
    };
    assert!(support::eventually(Duration::from_secs(10), fast_layer_ok).await);

    const KEYS: usize = 40;
    let clients: Vec<_> = (0..KEYS)
        .map(|k| {
            let http = stack.http.clone();
            let url = stack.url(&format!("/actions/s{k}"));
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(50 * k as u64)).await;
                for attempt in 0.. {
                    let a = http
                        .send(
                            "POST",
                            &url,
                            &[
                                ("idempotency-key", &format!("s{k}")),
                                ("x-demo-delay-ms", "100"),
                            ],
                            "{}",
                        )
                        .await;
                    match a.status.as_u16() {
                        201 => return a.body,
                        409 | 503 => tokio::time::sleep(Duration::from_millis(100)).await,
                        other => panic!("{other} {:?}", String::from_utf8_lossy(&a.body)),
                    }
                    assert!(attempt < 300, "s{k} never answered");
                }
                unreachable!()
            })
        })
        .collect();
    support::reached(&stack.upstream, 10).await;
    let old = redis.master;
    redis.kill_master();
    let mut answers = Vec::new();
    for client in clients {
        answers.push(client.await.unwrap());
    }
    let promoted = support::eventually(Duration::from_secs(20), || async {
        redis.master_port().await.is_some_and(|p| p != old)
    })
    .await;
    assert!(promoted, "the Sentinel never promoted the replica");
    assert!(
        support::eventually(Duration::from_secs(15), fast_layer_ok).await,
        "the gateway never found the new master"
    );
    for (k, body) in answers.iter().enumerate() {
        let a = stack
            .http
            .send(
                "POST",
                &stack.url(&format!("/actions/s{k}")),
                &[("idempotency-key", &format!("s{k}"))],
                "{}",
            )
            .await;
        assert_eq!(
            a.status,
            201,
            "s{k}: {:?}",
            String::from_utf8_lossy(&a.body)
        );
        assert_eq!(a.header("idempotent-replayed"), Some("true"));
        assert_eq!(&a.body, body, "s{k}");
    }
    each_ran_once(&stack, "s", KEYS);
    stack.shutdown().await;
}
