//! The Redis layer on a real Redis Cluster: three local nodes on free ports,
//! created with `redis-cli --cluster create`, and a duplicate storm through
//! the gateway on top of it.

use crate::support;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use support::Stack;
use support::services;

struct Cluster {
    nodes: Vec<Child>,
    ports: Vec<u16>,
    _dir: tempfile::TempDir,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            let _ = node.kill();
            let _ = node.wait();
        }
    }
}

async fn start_cluster(test: &str) -> Option<Cluster> {
    let dir = tempfile::tempdir().unwrap();
    let ports: Vec<u16> = (0..3).map(|_| support::dead_port()).collect();
    let mut nodes = Vec::new();
    for port in &ports {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                &format!("nodes-{port}.conf"),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                &dir.path().display().to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        match child {
            Ok(child) => nodes.push(child),
            Err(e) => {
                services::missing("Redis", test, &format!("redis-server: {e}"));
                return None;
            }
        }
    }
    let cluster = Cluster {
        nodes,
        ports,
        _dir: dir,
    };
    let addresses: Vec<String> = cluster
        .ports
        .iter()
        .map(|p| format!("127.0.0.1:{p}"))
        .collect();
    let mut created = false;
    for _ in 0..50 {
        let status = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addresses)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if status.is_ok_and(|s| s.success()) {
            created = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // redis-server is here (the nodes started): a cluster that does not
    // form is a failure of this test, never a missing service.
    assert!(created, "{test}: redis-cli --cluster create failed");
    for _ in 0..100 {
        let info = Command::new("redis-cli")
            .args(["-p", &cluster.ports[0].to_string(), "cluster", "info"])
            .output();
        if info.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("cluster_state:ok")) {
            return Some(cluster);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{test}: the cluster never reached cluster_state:ok");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_on_a_three_node_redis_cluster_executes_once() {
    let test = "a_storm_on_a_three_node_redis_cluster_executes_once";
    let Some(cluster) = start_cluster(test).await else {
        return;
    };
    let Some(db) = services::shared_sql(test).await else {
        return;
    };
    let url = format!(
        "redis+cluster://{}",
        cluster
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",")
    );
    let routes = r#"
        [[routes]]
        name = "act"
        methods = ["POST"]
        path_prefix = "/actions/"
        upstream = "demo"
        idempotency = "key"
    "#;
    let stack = Stack::start_with(routes, |c| {
        c.store.database_url = db;
        c.store.redis_url = url;
        c.store.fast_layer_budget = "1s".into();
        c.server.max_connections = 1000;
    })
    .await;
    let ready = stack.http.get(&stack.admin("/readyz")).await.json();
    assert_eq!(ready["fast_layer"], "redis");
    assert_eq!(ready["fast_layer_state"], "ok", "{ready}");
    // Keys land on different slots, so every node serves some of them.
    for round in 0..2 {
        let statuses: Vec<u16> = support::concurrent_posts(
            &stack.http,
            300,
            |_| stack.url("/actions/cluster"),
            |i| {
                let key = format!("key-{}-{round}", i % 10);
                support::pairs(&[
                    ("idempotency-key", key.as_str()),
                    ("x-demo-delay-ms", "100"),
                ])
            },
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
    }
    let stats = stack.upstream.state.stats();
    assert_eq!(stats.total_executions, 20, "10 keys x 2 rounds: {stats:?}");
    assert!(stats.executions["cluster"].values().all(|n| *n == 1));
    let metrics =
        String::from_utf8(stack.http.get(&stack.admin("/metrics")).await.body.to_vec()).unwrap();
    assert!(
        metrics.contains("idemgate_store_fallback_total{layer=\"redis\"} 0"),
        "the cluster layer fell back to SQL: {metrics}"
    );
    stack.shutdown().await;
}
