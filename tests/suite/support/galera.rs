//! A private three-node Galera cluster (MariaDB with `galera-4`) on free
//! loopback ports, for the fault tests of the MySQL store, and a TCP front
//! that sends each new connection to the first node that accepts it (what
//! HAProxy or MaxScale does in front of a cluster).
//!
//! A machine without `mariadbd` or the Galera provider skips the test
//! loudly; with `CI=true` it fails instead.
#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::instances::free_port;
use super::services::missing;

const MARIADBD: &str = "/usr/sbin/mariadbd";
const PROVIDER: &str = "/usr/lib/galera/libgalera_smm.so";
/// How long one node may take to join (a state transfer by rsync).
const JOIN_WITHIN: Duration = Duration::from_secs(90);

/// One `mariadbd` of the cluster: its client port and the three ports
/// Galera listens on (group communication, incremental and full state
/// transfer).
struct Node {
    port: u16,
    gcomm: u16,
    ist: u16,
    sst: u16,
    datadir: PathBuf,
    child: Option<Child>,
}

pub struct Galera {
    nodes: Vec<Node>,
    _dir: tempfile::TempDir,
    _turn: tokio::sync::MutexGuard<'static, ()>,
}

/// One cluster at a time: three `mariadbd` beside the other tests are
/// all two cores carry.
static ONE_CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| out.stdout.starts_with(b"0\n"))
}

impl Galera {
    /// Three nodes, each synced, with an empty database `test`.
    pub async fn start(test: &str) -> Option<Galera> {
        for binary in [
            MARIADBD,
            PROVIDER,
            "/usr/bin/mariadb-install-db",
            "/usr/bin/rsync",
        ] {
            if !Path::new(binary).exists() {
                missing("Galera", test, &format!("{binary} is not installed"));
                return None;
            }
        }
        let turn = ONE_CLUSTER.lock().await;
        let dir = tempfile::tempdir().unwrap();
        let nodes = (0..3)
            .map(|i| Node {
                port: free_port(),
                gcomm: free_port(),
                ist: free_port(),
                sst: free_port(),
                datadir: dir.path().join(format!("node{i}")),
                child: None,
            })
            .collect();
        let mut cluster = Galera {
            nodes,
            _dir: dir,
            _turn: turn,
        };
        if running_as_root() {
            // mariadbd will not run as root; its files belong to `mysql`.
            let _ = Command::new("chown")
                .args(["-R", "mysql:mysql"])
                .arg(cluster._dir.path())
                .status();
        }
        let install = Command::new("mariadb-install-db")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", cluster.nodes[0].datadir.display()))
            .args(["--auth-root-authentication-method=normal", "--skip-test-db"])
            .args(running_as_root().then_some("--user=mysql"))
            .output();
        if !install.as_ref().is_ok_and(|out| out.status.success()) {
            let why = install.map_or_else(
                |e| e.to_string(),
                |out| String::from_utf8_lossy(&out.stderr).into_owned(),
            );
            missing("Galera", test, &format!("mariadb-install-db failed: {why}"));
            return None;
        }
        for i in 0..3 {
            if let Err(e) = cluster.spawn(i) {
                missing("Galera", test, &format!("{MARIADBD}: {e}"));
                return None;
            }
            if !cluster.wait_synced(i, JOIN_WITHIN).await {
                let log = std::fs::read_to_string(cluster.nodes[i].datadir.join("error.log"))
                    .unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(15).collect();
                missing(
                    "Galera",
                    test,
                    &format!("node {i} did not join the cluster: {tail:#?}"),
                );
                return None;
            }
        }
        cluster.execute(0, "CREATE DATABASE test").await.unwrap();
        Some(cluster)
    }

    /// Starts node `i`: the first bootstraps the cluster, the others join it
    /// through the first's group port.
    fn spawn(&mut self, i: usize) -> std::io::Result<()> {
        let first = self.nodes[0].gcomm;
        let node = &mut self.nodes[i];
        std::fs::create_dir_all(&node.datadir)?;
        if running_as_root() {
            let _ = Command::new("chown")
                .args(["-R", "mysql:mysql"])
                .arg(&node.datadir)
                .status();
        }
        let address = if i == 0 {
            "gcomm://".to_owned()
        } else {
            format!("gcomm://127.0.0.1:{first}")
        };
        let dir = node.datadir.display().to_string();
        let mut command = Command::new(MARIADBD);
        command
            .arg("--no-defaults")
            .args(running_as_root().then_some("--user=mysql"))
            .arg(format!("--datadir={dir}"))
            .arg(format!("--socket={dir}/mysqld.sock"))
            .arg(format!("--pid-file={dir}/mysqld.pid"))
            .arg(format!("--log-error={dir}/error.log"))
            .arg(format!("--port={}", node.port))
            .args(["--bind-address=127.0.0.1", "--skip-name-resolve"])
            .args(["--innodb-buffer-pool-size=64M", "--max-connections=500"])
            .args(["--wsrep-on=ON", &format!("--wsrep-provider={PROVIDER}")])
            .arg(format!("--wsrep-cluster-address={address}"))
            .arg("--wsrep-cluster-name=idemgate-test")
            .arg(format!("--wsrep-node-address=127.0.0.1:{}", node.gcomm))
            .arg(format!(
                "--wsrep-node-incoming-address=127.0.0.1:{}",
                node.port
            ))
            .arg(format!(
                "--wsrep-sst-receive-address=127.0.0.1:{}",
                node.sst
            ))
            .arg("--wsrep-sst-method=rsync")
            .arg(format!(
                "--wsrep-provider-options=gmcast.listen_addr=tcp://127.0.0.1:{};\
                 ist.recv_addr=127.0.0.1:{};gcache.size=16M",
                node.gcomm, node.ist
            ))
            .args(["--binlog-format=ROW", "--innodb-autoinc-lock-mode=2"])
            // A certification failure reaches the client as 1213 instead of
            // being retried by the server once: the gateway's own retry is
            // what the tests see at work.
            .arg("--wsrep-retry-autocommit=0")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        node.child = Some(command.spawn()?);
        Ok(())
    }

    /// The URL of node `i`'s database `test`.
    pub fn url(&self, i: usize) -> String {
        format!("mysql://root@127.0.0.1:{}/test", self.nodes[i].port)
    }

    /// One URL naming nodes `order`, in that order
    /// (`mysql://root@127.0.0.1:p2,127.0.0.1:p0/test`).
    pub fn url_naming(&self, order: &[usize]) -> String {
        let hosts: Vec<String> = order
            .iter()
            .map(|&i| format!("127.0.0.1:{}", self.nodes[i].port))
            .collect();
        format!("mysql://root@{}/test", hosts.join(","))
    }

    pub fn addr(&self, i: usize) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.nodes[i].port))
    }

    /// One statement on node `i`, on a connection of its own.
    pub async fn execute(&self, i: usize, sql: &str) -> Result<(), sqlx::Error> {
        use sqlx::Connection;
        let server = format!("mysql://root@127.0.0.1:{}/", self.nodes[i].port);
        let mut conn = sqlx::MySqlConnection::connect(&server).await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&mut conn)
            .await?;
        conn.close().await
    }

    /// A status variable of node `i` (`wsrep_cluster_status`, …).
    pub async fn status(&self, i: usize, name: &str) -> Option<String> {
        use sqlx::{Connection, Row};
        let server = format!("mysql://root@127.0.0.1:{}/", self.nodes[i].port);
        let read = async {
            let mut conn = sqlx::MySqlConnection::connect(&server).await?;
            // The text protocol: `SHOW` takes no placeholders.
            let row = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("SHOW STATUS LIKE '{name}'")))
                .fetch_one(&mut conn)
                .await?;
            // Decoded as bytes: the server labels the column binary.
            let value: Vec<u8> = row.try_get(1)?;
            let value = String::from_utf8_lossy(&value).into_owned();
            conn.close().await?;
            Ok::<_, sqlx::Error>(value)
        };
        match tokio::time::timeout(Duration::from_secs(2), read).await {
            Ok(Ok(v)) => Some(v),
            _ => None,
        }
    }

    /// Waits until node `i` is part of a primary component and accepts
    /// queries.
    pub async fn wait_synced(&self, i: usize, within: Duration) -> bool {
        super::eventually(within, || async {
            self.status(i, "wsrep_ready").await.as_deref() == Some("ON")
                && self.status(i, "wsrep_cluster_status").await.as_deref() == Some("Primary")
                && self.status(i, "wsrep_local_state_comment").await.as_deref() == Some("Synced")
        })
        .await
    }

    /// Cuts node `i` off from the others (`gmcast.isolate`), or lets it
    /// back. Cut off, a node of three loses its quorum: it stays up and
    /// answers `1047 WSREP has not yet prepared node for application use`.
    pub async fn isolate(&self, i: usize, cut: bool) {
        let value = if cut { 1 } else { 0 };
        self.execute(
            i,
            &format!("SET GLOBAL wsrep_provider_options = 'gmcast.isolate={value}'"),
        )
        .await
        .unwrap();
    }

    /// `kill -9` of node `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Galera {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
    }
}

/// A TCP front over several servers: each new connection goes to the first
/// of `targets` that accepts within half a second, and then stays there.
pub struct FailoverFront {
    pub port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl FailoverFront {
    pub async fn start(targets: Vec<SocketAddr>) -> FailoverFront {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    continue;
                };
                let targets = targets.clone();
                tokio::spawn(async move {
                    for target in targets {
                        let connect = tokio::net::TcpStream::connect(target);
                        if let Ok(Ok(mut server)) =
                            tokio::time::timeout(Duration::from_millis(500), connect).await
                        {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                            return;
                        }
                    }
                });
            }
        });
        FailoverFront { port, task }
    }

    /// `url` (a node's) pointed at this front instead.
    pub fn url(&self, url: &str) -> String {
        super::services::via(url, self.port)
    }
}

impl Drop for FailoverFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}
