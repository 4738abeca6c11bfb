//! Several real gateway processes (`idemgate serve`) on one store: what
//! each instance knows must reach the others through the store (docs/semantics.md,
//! rule 8), so the tests that check a rule across instances run separate
//! processes, with nothing shared but the database (and Redis).
#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{Http, eventually};

/// One `idemgate serve` process.
pub struct Instance {
    child: Child,
    /// The public listener.
    pub public: SocketAddr,
    /// The admin listener.
    pub admin: SocketAddr,
    /// Its config file (kept for a restart).
    pub config: PathBuf,
    /// What its `admin_listen` says (an address on all interfaces, or the
    /// loopback address of `admin`).
    admin_bind: String,
    _dir: tempfile::TempDir,
}

impl Instance {
    /// A URL on its public listener.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.public, path)
    }

    /// A URL on its admin listener.
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Rewrites its config file: the same listeners, then `server` (more
    /// `[server]` keys) and `body`.
    pub fn rewrite(&self, server: &str, body: &str) {
        std::fs::write(
            &self.config,
            config_text(&self.public, &self.admin_bind, server, body),
        )
        .unwrap();
    }

    /// Sends `SIGHUP` (reload the config file).
    pub fn hup(&self) {
        let sent = Command::new("kill")
            .args(["-HUP", &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
    }

    /// Whether the process has exited (and how).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

/// A config file's text: the listeners and the test defaults, `server`
/// (more `[server]` keys), then `body`.
fn config_text(public: &SocketAddr, admin_bind: &str, server: &str, body: &str) -> String {
    format!(
        "[server]\nlisten = \"{public}\"\nadmin_listen = \"{admin_bind}\"\nworker_threads = 2\n\
         header_read_timeout = \"5s\"\nshutdown_grace = \"10s\"\n{server}\n{body}"
    )
}

impl Drop for Instance {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port free right now on 127.0.0.1, for a server another process will
/// bind: below the kernel's ephemeral range, in turn. A port the kernel
/// hands out (`bind` to port 0) goes back to that range when the check's
/// listener closes, and the next outgoing connection of any test may take
/// it before the server binds it (seen: a Galera node's group port, taken
/// by a client socket during the suite). Ports below the range are never
/// given to outgoing connections; each is offered once per process, from
/// an offset of the process id (two suites at once may still meet, as
/// any two processes picking ports may). Where no port there binds, the
/// kernel's choice, as before.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const SPAN: u32 = 10_000;
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    if ephemeral_low < SPAN + 1_024 {
        // No room below the range: the kernel's choice, as before.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        return listener.local_addr().unwrap().port();
    }
    let low = ephemeral_low - SPAN;
    let start = std::process::id().wrapping_mul(7_919) % SPAN;
    for _ in 0..SPAN {
        let turn = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = (low + (start + turn) % SPAN) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// Starts `n` gateways, each with the config `body` (TOML without
/// `[server]` listen keys, which are added) and waits until each answers.
/// `server` is extra `[server]` keys.
/// A port picked free can be taken by another test before the gateway
/// binds it: such an instance is started again on new ports.
pub async fn start(n: usize, server: &str, body: &str) -> Vec<Instance> {
    let mut instances: Vec<Instance> = (0..n).map(|_| spawn(server, body, &[])).collect();
    for instance in &mut instances {
        for _ in 0..3 {
            if is_ready(instance).await || !log_of(instance).contains("Address already in use") {
                break;
            }
            *instance = spawn(server, body, &[]);
        }
        wait_ready(instance).await;
    }
    instances
}

/// Whether the instance's admin listener answers within 20 s (or its
/// process has exited).
async fn is_ready(instance: &mut Instance) -> bool {
    let http = Http::http1();
    let url = instance.admin_url("/healthz");
    let child = &mut instance.child;
    let mut exited = false;
    let up = eventually(Duration::from_secs(20), || {
        exited = exited || matches!(child.try_wait(), Ok(Some(_)));
        let (http, url, gone) = (http.clone(), url.clone(), exited);
        async move { gone || http.try_send("GET", &url, &[], "").await.is_ok() }
    })
    .await;
    up && !exited
}

/// One gateway process with `env` set, not yet known to be up.
pub fn spawn(server: &str, body: &str, env: &[(&str, &str)]) -> Instance {
    spawn_on("127.0.0.1", server, body, env)
}

/// [`spawn`], its admin listener bound on `admin_host` (`0.0.0.0`: reachable
/// from other hosts) and reached on loopback.
pub fn spawn_on(admin_host: &str, server: &str, body: &str, env: &[(&str, &str)]) -> Instance {
    let dir = tempfile::tempdir().unwrap();
    let public: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let admin_bind = format!("{admin_host}:{}", admin.port());
    let config = dir.path().join("idemgate.toml");
    std::fs::write(&config, config_text(&public, &admin_bind, server, body)).unwrap();
    let log = std::fs::File::create(dir.path().join("gateway.log")).unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_idemgate"));
    command
        .args(["serve", "--config"])
        .arg(&config)
        .env("IDEMGATE_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(log);
    for (k, v) in env {
        command.env(k, v);
    }
    let child = command.spawn().unwrap();
    Instance {
        child,
        public,
        admin,
        config,
        admin_bind,
        _dir: dir,
    }
}

/// Waits until the instance's admin listener answers `/healthz`.
pub async fn wait_ready(instance: &Instance) {
    let http = Http::http1();
    let url = instance.admin_url("/healthz");
    let up = eventually(Duration::from_secs(20), || {
        let (http, url) = (http.clone(), url.clone());
        async move { http.try_send("GET", &url, &[], "").await.is_ok() }
    })
    .await;
    if !up {
        let log =
            std::fs::read_to_string(instance._dir.path().join("gateway.log")).unwrap_or_default();
        panic!("gateway on {} never came up:\n{log}", instance.public);
    }
}

/// The log the instance wrote so far.
pub fn log_of(instance: &Instance) -> String {
    std::fs::read_to_string(instance._dir.path().join("gateway.log")).unwrap_or_default()
}
