//! Private Postgres servers (`initdb` + `postgres` on free loopback ports)
//! for the failover tests, and a front that moves: a TCP relay whose
//! target can be switched, as a VIP or a DNS name moves in a failover.
//! Connections it relayed before a switch stay where they were.
//!
//! A machine without the server binaries skips the test loudly; with
//! `CI=true` it fails instead.
#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::instances::free_port;
use super::services::missing;

fn bin_dir() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|p| p.join("initdb").exists())
        .collect();
    dirs.sort();
    dirs.pop()
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| out.stdout.starts_with(b"0\n"))
}

/// `program` as the `postgres` user when this process is root (the server
/// refuses to run as root).
fn as_postgres(program: PathBuf) -> Command {
    if running_as_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

/// One Postgres server of this test's own.
pub struct PrivatePostgres {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
    bin: PathBuf,
}

impl PrivatePostgres {
    /// A fresh cluster (trust authentication, user `postgres`), started.
    pub async fn start(test: &str) -> Option<PrivatePostgres> {
        let Some(bin) = bin_dir() else {
            missing(
                "Postgres server binaries",
                test,
                "no /usr/lib/postgresql/*/bin/initdb",
            );
            return None;
        };
        let dir = tempfile::tempdir().unwrap();
        if running_as_root() {
            let _ = Command::new("chown")
                .args(["-R", "postgres"])
                .arg(dir.path())
                .status();
        }
        let data = dir.path().join("data");
        let init = as_postgres(bin.join("initdb"))
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(&data)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if !init.is_ok_and(|s| s.success()) {
            missing("Postgres server binaries", test, "initdb failed");
            return None;
        }
        let mut server = PrivatePostgres {
            port: free_port(),
            dir,
            child: None,
            bin,
        };
        server.spawn();
        if !server.wait_up().await {
            missing(
                "Postgres server binaries",
                test,
                "the private server did not start",
            );
            return None;
        }
        Some(server)
    }

    /// A streaming standby of this server (`pg_basebackup -R`), started,
    /// named `standby` in `application_name`. Asynchronous until the
    /// primary names it in `synchronous_standby_names`.
    pub async fn standby(&self, test: &str) -> Option<PrivatePostgres> {
        let dir = tempfile::tempdir().unwrap();
        if running_as_root() {
            let _ = Command::new("chown")
                .args(["-R", "postgres"])
                .arg(dir.path())
                .status();
        }
        let data = dir.path().join("data");
        let backup = as_postgres(self.bin.join("pg_basebackup"))
            .arg("-d")
            .arg(format!(
                "host=127.0.0.1 port={} user=postgres application_name=standby",
                self.port
            ))
            .args(["-R", "-X", "stream", "-D"])
            .arg(&data)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if !backup.is_ok_and(|s| s.success()) {
            missing("Postgres server binaries", test, "pg_basebackup failed");
            return None;
        }
        let mut standby = PrivatePostgres {
            port: free_port(),
            dir,
            child: None,
            bin: self.bin.clone(),
        };
        standby.spawn();
        if !standby.wait_up().await {
            missing(
                "Postgres server binaries",
                test,
                "the standby did not start",
            );
            return None;
        }
        Some(standby)
    }

    /// Standbys streaming from this server now (`pg_stat_replication`),
    /// and how many of them are synchronous.
    pub async fn standbys(&self) -> (i64, i64) {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(&self.url()).await.unwrap();
        sqlx::query_as(
            "SELECT count(*), count(*) FILTER (WHERE sync_state = 'sync') FROM pg_stat_replication",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap()
    }

    /// `ALTER SYSTEM SET name = 'value'`, reloaded.
    pub async fn set(&self, name: &str, value: &str) {
        self.execute(&format!("ALTER SYSTEM SET {name} = '{value}'"))
            .await
            .unwrap();
        self.execute("SELECT pg_reload_conf()").await.unwrap();
    }

    /// Promotes a standby to primary.
    pub async fn promote(&self) {
        self.execute("SELECT pg_promote()").await.unwrap();
    }

    fn spawn(&mut self) {
        let data = self.dir.path().join("data");
        let child = as_postgres(self.bin.join("postgres"))
            .arg("-D")
            .arg(&data)
            .args([
                "-p",
                &self.port.to_string(),
                "-c",
                "listen_addresses=127.0.0.1",
            ])
            .arg("-c")
            .arg(format!(
                "unix_socket_directories={}",
                self.dir.path().display()
            ))
            .args(["-c", "fsync=off", "-c", "max_connections=200"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // A group of its own: the kill takes the postmaster and every
            // backend at once, as a machine that dies does.
            .process_group(0)
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    async fn wait_up(&self) -> bool {
        super::eventually(Duration::from_secs(30), || async {
            self.execute("SELECT 1").await.is_ok()
        })
        .await
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// One statement on a connection of its own.
    pub async fn execute(&self, sql: &str) -> Result<(), sqlx::Error> {
        use sqlx::Connection;
        let connect = sqlx::PgConnection::connect(&self.url());
        let mut conn = tokio::time::timeout(Duration::from_secs(2), connect)
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)??;
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&mut conn)
            .await?;
        conn.close().await
    }

    /// Every transaction read-only from now on, in the sessions already
    /// open too (`default_transaction_read_only`, reloaded): what a fenced
    /// old primary, or one restarted as a standby, answers a write with
    /// (SQLSTATE 25006).
    pub async fn set_read_only(&self, read_only: bool) {
        let value = if read_only { "on" } else { "off" };
        // Two round trips: ALTER SYSTEM refuses the implicit transaction
        // of a multi-statement query.
        self.execute(&format!(
            "ALTER SYSTEM SET default_transaction_read_only = {value}"
        ))
        .await
        .unwrap();
        self.execute("SELECT pg_reload_conf()").await.unwrap();
    }

    /// `kill -9` of the server: the postmaster and all its backends.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-9", "--", &format!("-{}", child.id())])
                .status();
            let _ = child.wait();
        }
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A TCP relay to one target at a time; [`MovingFront::point_at`] moves
/// new connections, and the ones already relayed stay.
pub struct MovingFront {
    pub port: u16,
    target: Arc<Mutex<SocketAddr>>,
    task: tokio::task::JoinHandle<()>,
}

impl MovingFront {
    pub async fn start(target: SocketAddr) -> MovingFront {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let target = Arc::new(Mutex::new(target));
        let current = target.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    continue;
                };
                let to = *current.lock().unwrap();
                tokio::spawn(async move {
                    if let Ok(mut server) = tokio::net::TcpStream::connect(to).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        MovingFront { port, target, task }
    }

    pub fn point_at(&self, target: SocketAddr) {
        *self.target.lock().unwrap() = target;
    }

    /// `url` (a server's) pointed at this front instead.
    pub fn url(&self, url: &str) -> String {
        super::services::via(url, self.port)
    }
}

impl Drop for MovingFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}
