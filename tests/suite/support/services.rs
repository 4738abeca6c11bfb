//! Real services for tests: the shared Postgres, MariaDB and Redis (each
//! test in its own schema, database or key prefix), private Redis instances on free ports for
//! fault tests, and a TCP fault proxy.
//!
//! A missing service skips the test loudly, by name — or fails it when
//! `CI=true`.
#![allow(dead_code, unreachable_pub)]

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::io::AsyncWriteExt;

pub const POSTGRES_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
pub const REDIS_URL: &str = "redis://127.0.0.1:6379/";
pub const MARIADB_URL: &str = "mysql://root@127.0.0.1:3306/test";

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// Reports a missing service: a loud skip, or a failure in CI.
pub fn missing(service: &str, test: &str, why: &str) {
    if in_ci() {
        panic!("{service} is required when CI=true ({test}): {why}");
    }
    // Straight to the process's stderr: libtest captures `eprintln!` of
    // passing tests, and a skip must be seen.
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "SKIPPED (no {service}): {test}: {why}");
}

/// A fresh schema in the shared Postgres; the URL points into it.
pub async fn postgres(test: &str) -> Option<String> {
    let base = std::env::var("IDEMGATE_TEST_DATABASE_URL").unwrap_or_else(|_| POSTGRES_URL.into());
    let schema = format!("t_{}", uuid::Uuid::now_v7().simple());
    let connect = async {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(&base).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&mut conn)
            .await?;
        conn.close().await
    };
    match tokio::time::timeout(Duration::from_secs(5), connect).await {
        Ok(Ok(())) => {
            let sep = if base.contains('?') { '&' } else { '?' };
            Some(format!("{base}{sep}options[search_path]={schema}"))
        }
        Ok(Err(e)) => {
            missing("Postgres", test, &e.to_string());
            None
        }
        Err(_) => {
            missing("Postgres", test, "connect timed out");
            None
        }
    }
}

/// A fresh database in the shared MariaDB (or MySQL); the URL points into
/// it.
pub async fn mariadb(test: &str) -> Option<String> {
    let base = std::env::var("IDEMGATE_TEST_MYSQL_URL").unwrap_or_else(|_| MARIADB_URL.into());
    let database = format!("t_{}", uuid::Uuid::now_v7().simple());
    let connect = async {
        use sqlx::Connection;
        let mut conn = sqlx::MySqlConnection::connect(&base).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
            .execute(&mut conn)
            .await?;
        conn.close().await
    };
    match tokio::time::timeout(Duration::from_secs(5), connect).await {
        Ok(Ok(())) => {
            let (server, _) = base.rsplit_once('/').expect("a database in the URL");
            Some(format!("{server}/{database}"))
        }
        Ok(Err(e)) => {
            missing("MariaDB", test, &e.to_string());
            None
        }
        Err(_) => {
            missing("MariaDB", test, "connect timed out");
            None
        }
    }
}

/// Whether the end-to-end suites run on MariaDB (`IDEMGATE_TEST_SQL=mariadb`)
/// instead of Postgres: `scripts/test.sh` runs them both ways.
pub fn on_mariadb() -> bool {
    std::env::var("IDEMGATE_TEST_SQL").is_ok_and(|v| v == "mariadb" || v == "mysql")
}

/// A fresh schema (Postgres) or database (MariaDB, with
/// `IDEMGATE_TEST_SQL=mariadb`) in the shared server the end-to-end suites
/// run on.
pub async fn shared_sql(test: &str) -> Option<String> {
    if on_mariadb() {
        mariadb(test).await
    } else {
        postgres(test).await
    }
}

/// The `host:port` a database URL names.
pub fn sql_addr(url: &str) -> std::net::SocketAddr {
    let parsed = url::Url::parse(url).expect("a database URL");
    let port = parsed
        .port()
        .unwrap_or(if url.starts_with("mysql") { 3306 } else { 5432 });
    format!("{}:{port}", parsed.host_str().expect("a host"))
        .parse()
        .expect("an IP address")
}

/// `url` pointed at a proxy on 127.0.0.1's `port` instead.
pub fn via(url: &str, port: u16) -> String {
    url.replace(&sql_addr(url).to_string(), &format!("127.0.0.1:{port}"))
}

/// The record table held locked (every claim blocks) by a connection of
/// its own, until [`TableLock::release`].
pub enum TableLock {
    Postgres(sqlx::PgConnection),
    Mysql(sqlx::MySqlConnection),
}

impl TableLock {
    pub async fn take(url: &str) -> TableLock {
        use sqlx::Connection;
        if url.starts_with("mysql") {
            let mut conn = sqlx::MySqlConnection::connect(url).await.unwrap();
            sqlx::query("LOCK TABLES idempotency_records WRITE")
                .execute(&mut conn)
                .await
                .unwrap();
            TableLock::Mysql(conn)
        } else {
            let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
            sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
            sqlx::query("LOCK TABLE idempotency_records IN ACCESS EXCLUSIVE MODE")
                .execute(&mut conn)
                .await
                .unwrap();
            TableLock::Postgres(conn)
        }
    }

    pub async fn release(self) {
        match self {
            TableLock::Postgres(mut c) => {
                sqlx::query("ROLLBACK").execute(&mut c).await.unwrap();
            }
            TableLock::Mysql(mut c) => {
                sqlx::query("UNLOCK TABLES").execute(&mut c).await.unwrap();
            }
        }
    }
}

/// The shared Redis, if it answers, with a key prefix unique to this test.
pub async fn redis(test: &str) -> Option<(String, String)> {
    let url = std::env::var("IDEMGATE_TEST_REDIS_URL").unwrap_or_else(|_| REDIS_URL.into());
    let ping = async {
        let client = redis::Client::open(url.as_str())?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        redis::cmd("PING").query_async::<String>(&mut conn).await
    };
    match tokio::time::timeout(Duration::from_secs(3), ping).await {
        Ok(Ok(_)) => Some((url, format!("t_{}:", uuid::Uuid::now_v7().simple()))),
        Ok(Err(e)) => {
            missing("Redis", test, &e.to_string());
            None
        }
        Err(_) => {
            missing("Redis", test, "ping timed out");
            None
        }
    }
}

/// A redis-server of this test's own, on a free port.
pub struct PrivateRedis {
    pub port: u16,
    child: Child,
    dir: tempfile::TempDir,
}

impl PrivateRedis {
    pub async fn start(test: &str) -> Option<PrivateRedis> {
        let port = super::dead_port();
        let dir = tempfile::tempdir().unwrap();
        let child = match Self::spawn(port, dir.path()) {
            Ok(child) => child,
            Err(e) => {
                missing("Redis", test, &format!("redis-server: {e}"));
                return None;
            }
        };
        let redis = PrivateRedis { port, child, dir };
        if redis.wait_up().await {
            return Some(redis);
        }
        missing("Redis", test, "private redis-server did not start");
        None
    }

    /// No snapshots of its own: the data lives in memory until
    /// [`PrivateRedis::restart_keeping_data`] saves it.
    fn spawn(port: u16, dir: &std::path::Path) -> std::io::Result<Child> {
        Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
            ])
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
    }

    async fn wait_up(&self) -> bool {
        for _ in 0..100 {
            if self.ping().await {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    /// `SAVE`, `kill -9`, and a new server on the same port that loads the
    /// snapshot: every client's connection breaks, nothing is lost.
    pub async fn restart_keeping_data(&mut self) {
        let client = redis::Client::open(self.url().as_str()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        redis::cmd("SAVE")
            .query_async::<()>(&mut conn)
            .await
            .unwrap();
        self.kill();
        self.child = Self::spawn(self.port, self.dir.path()).unwrap();
        assert!(
            self.wait_up().await,
            "the private redis-server did not come back"
        );
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub async fn ping(&self) -> bool {
        let url = self.url();
        let ping = async {
            let client = redis::Client::open(url.as_str())?;
            let mut conn = client.get_multiplexed_async_connection().await?;
            redis::cmd("PING").query_async::<String>(&mut conn).await
        };
        matches!(
            tokio::time::timeout(Duration::from_millis(500), ping).await,
            Ok(Ok(_))
        )
    }

    pub async fn flushall(&self) {
        let client = redis::Client::open(self.url().as_str()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        redis::cmd("FLUSHALL")
            .query_async::<()>(&mut conn)
            .await
            .unwrap();
    }

    /// `kill -9`.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// `kill -STOP` / `kill -CONT`.
    pub fn signal(&self, signal: &str) {
        let _ = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status();
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A TCP proxy that can be told to misbehave.
pub struct FaultProxy {
    pub port: u16,
    mode: tokio::sync::watch::Sender<Mode>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Mode {
    /// Forward bytes both ways.
    Pass,
    /// Accept and read, never forward or answer: the peer hangs.
    Blackhole,
    /// Close every connection at once.
    Refuse,
    /// Wait this long before forwarding a new connection.
    Delay(Duration),
    /// Forward the request, then only this many bytes of the answer, then
    /// close both sides (a reset mid-response).
    CutAfter(usize),
}

impl FaultProxy {
    pub async fn start(target: std::net::SocketAddr) -> FaultProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (mode, watch) = tokio::sync::watch::channel(Mode::Pass);
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    continue;
                };
                let mut watch = watch.clone();
                tokio::spawn(async move {
                    // Mark the current mode seen, so only later changes cut
                    // this connection.
                    let current = *watch.borrow_and_update();
                    match current {
                        Mode::Refuse => return,
                        Mode::Blackhole => {
                            let _ = watch.wait_for(|m| *m == Mode::Refuse).await;
                            return;
                        }
                        Mode::Delay(d) => tokio::time::sleep(d).await,
                        Mode::CutAfter(limit) => {
                            let Ok(outbound) = tokio::net::TcpStream::connect(target).await else {
                                return;
                            };
                            let (mut in_read, mut in_write) = inbound.into_split();
                            let (mut out_read, mut out_write) = outbound.into_split();
                            let upstream = tokio::spawn(async move {
                                let _ = tokio::io::copy(&mut in_read, &mut out_write).await;
                            });
                            let mut left = limit;
                            let mut buf = vec![0u8; 8192];
                            use tokio::io::AsyncReadExt;
                            while left > 0 {
                                let Ok(n) = out_read.read(&mut buf).await else {
                                    break;
                                };
                                if n == 0 {
                                    break;
                                }
                                let n = n.min(left);
                                if in_write.write_all(&buf[..n]).await.is_err() {
                                    break;
                                }
                                left -= n;
                            }
                            upstream.abort();
                            return;
                        }
                        Mode::Pass => {}
                    }
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await else {
                        return;
                    };
                    // Any change of mode cuts live connections (a blackhole
                    // then hangs the reconnect, a refusal resets it).
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = watch.changed() => {
                            let _ = inbound.shutdown().await;
                        }
                    }
                });
            }
        });
        FaultProxy { port, mode, task }
    }

    pub fn set(&self, mode: Mode) {
        let _ = self.mode.send(mode);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
