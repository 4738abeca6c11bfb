//! A private Redis master, its replica and one Sentinel watching them, on
//! free loopback ports: a Sentinel failover in a test.
#![allow(dead_code, unreachable_pub)]

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::instances::free_port;
use super::services::missing;

/// The service name the Sentinel monitors.
pub const SERVICE: &str = "idemgate";

pub struct SentinelSet {
    pub master: u16,
    pub replica: u16,
    pub sentinel: u16,
    children: Vec<Option<Child>>,
    _dir: tempfile::TempDir,
}

fn redis_server(args: &[String]) -> std::io::Result<Child> {
    Command::new("redis-server")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
}

async fn ping(port: u16) -> Option<String> {
    let role = async {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        let role: redis::Value = redis::cmd("ROLE").query_async(&mut conn).await?;
        Ok::<_, redis::RedisError>(format!("{role:?}"))
    };
    tokio::time::timeout(Duration::from_millis(500), role)
        .await
        .ok()
        .and_then(Result::ok)
}

impl SentinelSet {
    pub async fn start(test: &str) -> Option<SentinelSet> {
        let dir = tempfile::tempdir().unwrap();
        let (master, replica, sentinel) = (free_port(), free_port(), free_port());
        let base = |port: u16| {
            vec![
                "--port".to_owned(),
                port.to_string(),
                "--bind".into(),
                "127.0.0.1".into(),
                "--save".into(),
                String::new(),
                "--appendonly".into(),
                "no".into(),
                "--dir".into(),
                dir.path().display().to_string(),
                "--dbfilename".into(),
                format!("dump-{port}.rdb"),
            ]
        };
        let conf = dir.path().join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {sentinel}\nbind 127.0.0.1\n\
                 sentinel monitor {SERVICE} 127.0.0.1 {master} 1\n\
                 sentinel down-after-milliseconds {SERVICE} 500\n\
                 sentinel failover-timeout {SERVICE} 2000\n"
            ),
        )
        .unwrap();
        let mut replica_args = base(replica);
        replica_args.extend(["--replicaof".into(), "127.0.0.1".into(), master.to_string()]);
        let started = (|| {
            Ok::<_, std::io::Error>(vec![
                Some(redis_server(&base(master))?),
                Some(redis_server(&replica_args)?),
                Some(redis_server(&[
                    conf.display().to_string(),
                    "--sentinel".into(),
                ])?),
            ])
        })();
        let children = match started {
            Ok(children) => children,
            Err(e) => {
                missing("Redis", test, &format!("redis-server: {e}"));
                return None;
            }
        };
        let set = SentinelSet {
            master,
            replica,
            sentinel,
            children,
            _dir: dir,
        };
        // The replica in sync and the Sentinel aware of it.
        let ready = super::eventually(Duration::from_secs(20), || async {
            ping(set.replica)
                .await
                .is_some_and(|r| r.contains("connected"))
                && set.sentinel_knows_the_replica().await
        })
        .await;
        if !ready {
            missing(
                "Redis",
                test,
                "the private master, replica and Sentinel did not come up",
            );
            return None;
        }
        Some(set)
    }

    async fn sentinel_knows_the_replica(&self) -> bool {
        let asked = async {
            let client = redis::Client::open(format!("redis://127.0.0.1:{}/", self.sentinel))?;
            let mut conn = client.get_multiplexed_async_connection().await?;
            let replicas: Vec<redis::Value> = redis::cmd("SENTINEL")
                .arg("REPLICAS")
                .arg(SERVICE)
                .query_async(&mut conn)
                .await?;
            Ok::<_, redis::RedisError>(!replicas.is_empty())
        };
        matches!(
            tokio::time::timeout(Duration::from_millis(500), asked).await,
            Ok(Ok(true))
        )
    }

    /// The master the Sentinel names now.
    pub async fn master_port(&self) -> Option<u16> {
        let asked = async {
            let client = redis::Client::open(format!("redis://127.0.0.1:{}/", self.sentinel))?;
            let mut conn = client.get_multiplexed_async_connection().await?;
            let addr: Vec<String> = redis::cmd("SENTINEL")
                .arg("GET-MASTER-ADDR-BY-NAME")
                .arg(SERVICE)
                .query_async(&mut conn)
                .await?;
            Ok::<_, redis::RedisError>(addr.get(1).and_then(|p| p.parse().ok()))
        };
        tokio::time::timeout(Duration::from_millis(500), asked)
            .await
            .ok()
            .and_then(Result::ok)
            .flatten()
    }

    /// `redis+sentinel://…/service`.
    pub fn url(&self) -> String {
        format!("redis+sentinel://127.0.0.1:{}/{SERVICE}", self.sentinel)
    }

    /// `kill -9` of the master.
    pub fn kill_master(&mut self) {
        if let Some(mut child) = self.children[0].take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for SentinelSet {
    fn drop(&mut self) {
        for child in self.children.iter_mut().filter_map(Option::take) {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
