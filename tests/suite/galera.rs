//! The MySQL store on a Galera cluster (every node writable, writes
//! certified at commit): gateways on different nodes, a node killed under a
//! storm, a node cut from its quorum. Each test starts a private
//! three-node cluster and counts executions at an upstream path that does
//! not deduplicate (`/actions/{name}`).

use crate::support;

use std::time::Duration;

use support::galera::{FailoverFront, Galera};
use support::{Stack, concurrent_posts, pairs};

const KEY_ROUTES: &str = r#"
    [[routes]]
    name = "act"
    methods = ["POST"]
    path_prefix = "/actions/"
    upstream = "demo"
    idempotency = "key"
"#;

const STORE_UNAVAILABLE: &str = "urn:idemgate:problem:store-unavailable";

/// Every key executed at most once, and no two copies of one ever ran
/// side by side.
fn assert_at_most_once(stack: &Stack, keys: usize) {
    let stats = stack.upstream.state.stats();
    for k in 0..keys {
        let action = format!("g{k}");
        let runs = stats
            .executions
            .get(&action)
            .map_or(0, |by_key| by_key.values().sum::<u64>());
        assert!(runs <= 1, "{action} executed {runs} times");
    }
    assert!(stats.peak_copies <= 1, "peak copies {}", stats.peak_copies);
}

/// `requests` posts over `keys` keys (`/actions/g{k}`, key `key-{k}`), one
/// every 7 ms, each taking `delay_ms` at the upstream: their answers.
fn spread_storm(
    stack: &Stack,
    requests: usize,
    keys: usize,
    delay_ms: &'static str,
) -> tokio::task::JoinHandle<Vec<support::Answer>> {
    let http = stack.http.clone();
    let base = stack.url("/actions/");
    tokio::spawn(async move {
        let tasks = (0..requests).map(|i| {
            let (http, base) = (http.clone(), base.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(7 * i as u64)).await;
                let key = format!("key-{}", i % keys);
                http.send(
                    "POST",
                    &format!("{base}g{}", i % keys),
                    &[("idempotency-key", &key), ("x-demo-delay-ms", delay_ms)],
                    "{}",
                )
                .await
            })
        });
        futures_util::future::join_all(tasks)
            .await
            .into_iter()
            .map(|answer| answer.expect("request task panicked"))
            .collect()
    })
}

/// Each answer ran, replayed, waited its turn, or was refused with
/// nothing forwarded (`503 store-unavailable`).
fn answered_or_refused(answers: Vec<support::Answer>) {
    for a in &answers {
        match a.status.as_u16() {
            200 | 201 | 409 => {}
            503 => assert_eq!(a.problem_type(), STORE_UNAVAILABLE),
            other => panic!("{other} {:?}", String::from_utf8_lossy(&a.body)),
        }
    }
}

/// Two gateways, each on its own node, take a storm of duplicates split
/// across both: Galera certifies the conflicting claims at commit, the
/// losers are retried and find the winner's row. One execution per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_two_galera_nodes_execute_each_key_once() {
    let Some(cluster) = Galera::start("two_gateways_on_two_galera_nodes").await else {
        return;
    };
    let stack = Stack::start_with(KEY_ROUTES, |c| {
        c.store.database_url = cluster.url(0);
        c.store.timeout = "3s".into();
        c.server.max_connections = 1000;
    })
    .await;
    let mut config = support::config(stack.upstream.addr, KEY_ROUTES);
    config.store.database_url = cluster.url(1);
    config.store.timeout = "3s".into();
    config.server.max_connections = 1000;
    let second = idemgate_gateway::gateway::start_for_tests(config)
        .await
        .unwrap();
    let gateways = [
        stack.gateway.public_addr.to_string(),
        second.public_addr.to_string(),
    ];
    const KEYS: usize = 20;
    let answers = concurrent_posts(
        &stack.http,
        400,
        |i| format!("http://{}/actions/g{}", gateways[i % 2], (i / 2) % KEYS),
        |i| {
            let key = format!("key-{}", (i / 2) % KEYS);
            pairs(&[("idempotency-key", &key), ("x-demo-delay-ms", "150")])
        },
        "{}",
    )
    .await;
    for a in &answers {
        assert!(
            a.status == 201 || a.status == 409 || a.status == 200,
            "{} {:?}",
            a.status,
            String::from_utf8_lossy(&a.body)
        );
    }
    assert_at_most_once(&stack, KEYS);
    // Every key ran: each answered 201 to someone, its retries replay it.
    for k in 0..KEYS {
        let url = format!("http://{}/actions/g{k}", gateways[k % 2]);
        let a =
            support::retry_through_conflicts(&stack.http, &url, &format!("key-{k}"), "{}").await;
        assert_eq!(a.header("idempotent-replayed"), Some("true"));
    }
    let stats = stack.upstream.state.stats();
    assert_eq!(stats.total_executions, KEYS as u64);
    second.shutdown().await;
    stack.shutdown().await;
}

/// The node a gateway writes through is killed under a storm of
/// duplicates. Requests whose store operations die with it fail closed
/// (`503`, nothing forwarded); the front sends new connections to another
/// node and the gateway serves through it; no key runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_galera_node_killed_mid_storm_fails_closed_then_serves_through_another() {
    let Some(mut cluster) = Galera::start("a_galera_node_killed_mid_storm").await else {
        return;
    };
    let front = FailoverFront::start(vec![cluster.addr(0), cluster.addr(1)]).await;
    let stack = Stack::start_with(KEY_ROUTES, |c| {
        c.store.database_url = front.url(&cluster.url(0));
        c.store.timeout = "2s".into();
        // A claim the kill orphaned is taken over this soon.
        c.store.lease = "6s".into();
        c.server.max_connections = 1000;
    })
    .await;
    const KEYS: usize = 100;
    // Spread over about two seconds, so that the kill meets claims being
    // written as well as outcomes.
    let storm = spread_storm(&stack, 300, KEYS, "300");
    support::reached(&stack.upstream, 10).await;
    cluster.kill(0);
    answered_or_refused(storm.await.unwrap());
    assert_at_most_once(&stack, KEYS);
    // Through the second node: a fresh key runs, and every key of the storm
    // runs once its retry gets through (a claim orphaned by the kill waits
    // out its lease).
    // Each try a new key: a try that got 503 may have left its claim
    // behind, held for its lease.
    let tries = std::sync::atomic::AtomicUsize::new(0);
    let fresh = support::eventually(Duration::from_secs(20), || async {
        let key = format!(
            "fresh-{}",
            tries.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let url = stack.url(&format!("/actions/{key}"));
        let a = stack
            .http
            .send("POST", &url, &[("idempotency-key", &key)], "{}")
            .await;
        a.status == 201
    })
    .await;
    assert!(fresh, "the gateway never served through the second node");
    for k in 0..KEYS {
        let url = format!("{}g{k}", stack.url("/actions/"));
        let answered = support::eventually(Duration::from_secs(20), || async {
            let a = stack
                .http
                .send(
                    "POST",
                    &url,
                    &[("idempotency-key", &format!("key-{k}"))],
                    "{}",
                )
                .await;
            match a.status.as_u16() {
                200 | 201 => true,
                409 | 503 => false,
                other => panic!("{other} {:?}", String::from_utf8_lossy(&a.body)),
            }
        })
        .await;
        assert!(answered, "key-{k} never answered");
    }
    assert_at_most_once(&stack, KEYS);
    stack.shutdown().await;
}

/// A node cut from the other two loses its quorum and refuses every query
/// (`1047`). The gateway on it answers `503 store-unavailable` and forwards
/// nothing; once the node rejoins, it serves again by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_galera_node_cut_from_its_quorum_answers_503_and_forwards_nothing() {
    let Some(cluster) = Galera::start("a_galera_node_cut_from_its_quorum").await else {
        return;
    };
    let stack = Stack::start_with(KEY_ROUTES, |c| {
        c.store.database_url = cluster.url(2);
        c.store.timeout = "1s".into();
    })
    .await;
    let first = stack
        .http
        .send(
            "POST",
            &stack.url("/actions/before"),
            &[("idempotency-key", "before")],
            "{}",
        )
        .await;
    assert_eq!(first.status, 201);

    cluster.isolate(2, true).await;
    let cut = support::eventually(Duration::from_secs(30), || async {
        cluster.status(2, "wsrep_cluster_status").await.as_deref() == Some("non-Primary")
    })
    .await;
    assert!(cut, "the isolated node kept its quorum");
    let requests = stack.upstream.state.stats().requests;
    for k in 0..20 {
        let key = format!("cut-{k}");
        let a = stack
            .http
            .send(
                "POST",
                &stack.url("/actions/cut"),
                &[("idempotency-key", &key)],
                "{}",
            )
            .await;
        assert_eq!(a.status, 503, "{:?}", String::from_utf8_lossy(&a.body));
        assert_eq!(a.problem_type(), STORE_UNAVAILABLE);
    }
    assert_eq!(
        stack.upstream.state.stats().requests,
        requests,
        "forwarded without quorum"
    );

    cluster.isolate(2, false).await;
    assert!(
        cluster.wait_synced(2, Duration::from_secs(60)).await,
        "the node did not rejoin"
    );
    let back = support::eventually(Duration::from_secs(20), || async {
        stack
            .http
            .send(
                "POST",
                &stack.url("/actions/cut"),
                &[("idempotency-key", "cut-0")],
                "{}",
            )
            .await
            .status
            == 201
    })
    .await;
    assert!(
        back,
        "the gateway did not serve again after the node rejoined"
    );
    assert_eq!(support::executions(&stack, "cut"), 1);
    stack.shutdown().await;
}

/// A gateway whose URL names every node follows the cluster by itself, no
/// front needed: when its node loses its quorum, and (once that node is
/// back) when the node it moved to is killed under a storm of duplicates,
/// it answers `503` meanwhile
/// (nothing forwarded unclaimed) and serves through the next node that
/// takes writes within seconds. No key runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_url_naming_every_node_follows_the_cluster_past_a_cut_and_a_kill() {
    let Some(mut cluster) = Galera::start("a_url_naming_every_node_follows").await else {
        return;
    };
    // A URL whose other nodes do not answer: one node alone does not
    // choose the cluster (it might be a node started alone beside its
    // stopped cluster); the store is not opened.
    let (dead1, dead2) = (
        support::instances::free_port(),
        support::instances::free_port(),
    );
    let lone = cluster.url(0).replacen(
        "/test",
        &format!(",127.0.0.1:{dead1},127.0.0.1:{dead2}/test"),
        1,
    );
    let refused = idemgate_store::SqlStore::connect(&idemgate_store::SqlSettings {
        url: lone,
        pool_size: 2,
        timeout: Duration::from_secs(2),
        tombstone: Duration::ZERO,
        schema: None,
        retention: Duration::from_secs(60),
        partition_span: Duration::from_secs(60),
    })
    .await;
    let Err(e) = refused else {
        panic!("one node of three chose the cluster")
    };
    assert!(e.to_string().contains("1 of the 3 hosts"), "{e}");
    let stack = Stack::start_with(KEY_ROUTES, |c| {
        c.store.database_url = cluster.url_naming(&[2, 0, 1]);
        c.store.timeout = "2s".into();
        c.store.lease = "6s".into();
        c.server.max_connections = 1000;
    })
    .await;
    let tries = std::sync::atomic::AtomicUsize::new(0);
    // Fresh keys until one runs; every other answer must be a refusal that
    // forwarded nothing.
    let serves = || async {
        let key = format!(
            "fresh-{}",
            tries.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let url = stack.url(&format!("/actions/{key}"));
        let a = stack
            .http
            .send("POST", &url, &[("idempotency-key", &key)], "{}")
            .await;
        match a.status.as_u16() {
            201 => true,
            503 => {
                assert_eq!(a.problem_type(), STORE_UNAVAILABLE);
                false
            }
            other => panic!("{other} {:?}", String::from_utf8_lossy(&a.body)),
        }
    };
    assert!(serves().await);

    cluster.isolate(2, true).await;
    let cut = support::eventually(Duration::from_secs(30), || async {
        cluster.status(2, "wsrep_cluster_status").await.as_deref() == Some("non-Primary")
    })
    .await;
    assert!(cut, "the isolated node kept its quorum");
    let started = std::time::Instant::now();
    assert!(
        support::eventually(Duration::from_secs(15), serves).await,
        "the gateway stayed on the node without quorum"
    );
    eprintln!(
        "served through another node {:?} after the cut",
        started.elapsed()
    );

    // The cut node rejoins (two nodes of three must stay for a quorum);
    // then the node the gateway moved to dies under a storm of
    // duplicates.
    cluster.isolate(2, false).await;
    assert!(
        cluster.wait_synced(2, Duration::from_secs(60)).await,
        "the node did not rejoin"
    );
    const KEYS: usize = 50;
    let storm = spread_storm(&stack, 200, KEYS, "200");
    support::reached(&stack.upstream, 5).await;
    cluster.kill(0);
    let killed = std::time::Instant::now();
    answered_or_refused(storm.await.unwrap());
    assert!(
        support::eventually(Duration::from_secs(15), serves).await,
        "the gateway never served through the last node"
    );
    eprintln!(
        "served through the last node {:?} after the kill",
        killed.elapsed()
    );
    assert_at_most_once(&stack, KEYS);
    stack.shutdown().await;
}
