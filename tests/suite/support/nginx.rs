//! A private nginx between the gateway and the service: the ingress most
//! services sit behind. It turns a service that drops its connection into
//! `502` and a service slower than `proxy_read_timeout` into `504`, while
//! the service goes on working (docs/semantics.md, rule 11).
//!
//! Installed by `scripts/services.sh` (Debian's `nginx-light`); where it is
//! missing the test says so by name, or fails with `CI=true`.
#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::instances::free_port;
use super::services::missing;

/// One nginx master process and its worker, on a free port.
pub struct Nginx {
    child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl Nginx {
    /// nginx in front of `service`, giving up on an answer after
    /// `read_timeout` (nginx's `proxy_read_timeout`, e.g. `"1s"`). `None`
    /// (after saying so) when nginx is not installed.
    pub async fn start(test: &str, service: SocketAddr, read_timeout: &str) -> Option<Nginx> {
        let Some(binary) = binary() else {
            missing(
                "nginx",
                test,
                "no nginx binary (scripts/services.sh installs nginx-light)",
            );
            return None;
        };
        for _ in 0..3 {
            let dir = tempfile::tempdir().unwrap();
            let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
            let root = dir.path().display().to_string();
            let conf = dir.path().join("nginx.conf");
            std::fs::write(&conf, config(&root, addr, service, read_timeout)).unwrap();
            let log = std::fs::File::create(dir.path().join("stderr.log")).unwrap();
            let child = Command::new(&binary)
                .args(["-e", &format!("{root}/error.log"), "-p", &root, "-c"])
                .arg(&conf)
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap();
            let mut nginx = Nginx { child, addr, dir };
            if nginx.wait_ready().await {
                return Some(nginx);
            }
            // The port was taken meanwhile (or nginx refused to start):
            // say why if it was not the port, and try another.
            let errors = nginx.errors();
            if !errors.contains("Address already in use") {
                panic!("nginx did not start:\n{errors}");
            }
        }
        panic!("nginx found no free port in three tries");
    }

    async fn wait_ready(&mut self) -> bool {
        for _ in 0..100 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if tokio::net::TcpStream::connect(self.addr).await.is_ok() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    /// What nginx logged (its error log and stderr).
    pub fn errors(&self) -> String {
        let read =
            |name: &str| std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default();
        format!("{}{}", read("error.log"), read("stderr.log"))
    }

    /// Its URL, for an `[[upstreams]]` entry.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGKILL to the master leaves its worker: ask it to stop fast
        // (SIGTERM), then reap.
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        for _ in 0..50 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn binary() -> Option<String> {
    ["/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/bin/nginx"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .map(str::to_owned)
}

/// A reverse proxy as an ingress is usually set up: keep-alive to the
/// service, `proxy_read_timeout` as given, and no retry of its own (nginx
/// never retries a POST anyway; `off` makes sure of every method).
fn config(root: &str, listen: SocketAddr, service: SocketAddr, read_timeout: &str) -> String {
    format!(
        r#"
daemon off;
master_process on;
worker_processes 1;
user root;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {root}/body;
    proxy_temp_path {root}/proxy;
    fastcgi_temp_path {root}/fastcgi;
    uwsgi_temp_path {root}/uwsgi;
    scgi_temp_path {root}/scgi;
    upstream service {{
        server {service};
        keepalive 16;
    }}
    server {{
        listen {listen};
        location / {{
            proxy_pass http://service;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_connect_timeout 1s;
            proxy_read_timeout {read_timeout};
            proxy_next_upstream off;
        }}
    }}
}}
"#
    )
}
