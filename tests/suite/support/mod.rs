//! Shared test support: a real gateway on `127.0.0.1:0` in front of a real
//! demo upstream, and a small HTTP client.
#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
pub mod brokers;
pub mod browser;
pub mod galera;
pub mod instances;
pub mod nginx;
pub mod pg_private;
pub mod sentinel;
pub mod services;
pub mod tls;

use idemgate_demo_upstream as demo_upstream;
use idemgate_demo_upstream::DemoUpstream;
use idemgate_gateway::config::Config;
use idemgate_gateway::gateway;
use idemgate_gateway::gateway::RunningGateway;

/// A complete answer.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }

    /// The problem `type` of an error answer, after checking the media type.
    pub fn problem_type(&self) -> String {
        assert_eq!(
            self.headers
                .get("content-type")
                .map(|v| v.to_str().unwrap()),
            Some("application/problem+json"),
            "status {} body {:?}",
            self.status,
            String::from_utf8_lossy(&self.body)
        );
        self.json()["type"].as_str().unwrap().to_owned()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    /// `Idempotency-Expires` as a time, after checking it is an HTTP-date.
    pub fn expires(&self) -> std::time::SystemTime {
        let value = self.header("idempotency-expires").unwrap_or_else(|| {
            panic!(
                "no Idempotency-Expires on {} {:?}",
                self.status, self.headers
            )
        });
        httpdate::parse_http_date(value).unwrap_or_else(|e| panic!("{value:?}: {e}"))
    }
}

/// Asserts that every answer names the same key expiry, about `retention`
/// from now (within the test's own runtime).
pub fn assert_same_expiry(answers: &[&Answer], retention: Duration) {
    let first = answers[0].expires();
    let expected = std::time::SystemTime::now() + retention;
    let gap = |a: std::time::SystemTime, b: std::time::SystemTime| {
        a.duration_since(b)
            .or_else(|_| b.duration_since(a))
            .unwrap()
    };
    assert!(
        gap(first, expected) < Duration::from_secs(30),
        "{first:?} vs {expected:?}"
    );
    for answer in answers {
        // HTTP-dates have whole seconds; the in-flight marker's estimate may
        // differ from the record's own by the claim's round trip.
        assert!(
            gap(answer.expires(), first) <= Duration::from_secs(1),
            "{:?}",
            answer.headers
        );
    }
}

/// A test HTTP client.
#[derive(Clone)]
pub struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
}

/// Set to `1` to run a suite's requests over HTTP/2 (h2c with prior
/// knowledge) instead of HTTP/1.1: `scripts/test.sh` runs the key, token
/// and callback suites both ways.
pub const HTTP2_ENV: &str = "IDEMGATE_TEST_HTTP2";

impl Default for Http {
    fn default() -> Self {
        if std::env::var(HTTP2_ENV).is_ok_and(|v| v == "1") {
            Http::h2c()
        } else {
            Http::http1()
        }
    }
}

impl Http {
    /// A client speaking HTTP/1.1.
    pub fn http1() -> Http {
        Http {
            client: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    /// A client speaking HTTP/2 with prior knowledge (h2c): every request
    /// is a stream of one shared connection.
    pub fn h2c() -> Http {
        Http {
            client: Client::builder(TokioExecutor::new())
                .http2_only(true)
                .build_http(),
        }
    }

    pub async fn send(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Answer {
        self.try_send(method, url, headers, body)
            .await
            .unwrap_or_else(|e| panic!("{method} {url}: {e:?}"))
    }

    pub async fn try_send(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Result<Answer, hyper_util::client::legacy::Error> {
        let mut request = Request::builder()
            .method(Method::from_bytes(method.as_bytes()).unwrap())
            .uri(url);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(Full::new(body.into())).unwrap();
        let response = self.client.request(request).await?;
        let (parts, body) = response.into_parts();
        let body = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        Ok(Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }

    pub async fn get(&self, url: &str) -> Answer {
        self.send("GET", url, &[], Bytes::new()).await
    }
}

/// A config for tests: ephemeral ports, one upstream `demo` at `upstream`,
/// and the routes given as TOML.
pub fn config(upstream: SocketAddr, extra: &str) -> Config {
    let text = format!(
        r#"
        [server]
        listen = "127.0.0.1:0"
        admin_listen = "127.0.0.1:0"
        header_read_timeout = "2s"
        shutdown_grace = "10s"

        [store]
        database_url = "sqlite::memory:"

        [[upstreams]]
        name = "demo"
        url = "http://{upstream}"
        timeout = "2s"

        {extra}
        "#
    );
    let mut config = Config::parse(&text, "test").unwrap();
    // Validated as a file would be, on a durable store (an in-memory one
    // is for tests only: `gateway::start_for_tests`).
    let mut checked = config.clone();
    checked.store.database_url = "sqlite://checked.db".into();
    checked.validate("test").unwrap();
    config.server.listen = "127.0.0.1:0".into();
    config
}

/// A pass-through catch-all route.
pub const PASS_THROUGH: &str = r#"
    [[routes]]
    name = "pass"
    path_prefix = "/"
    upstream = "demo"
"#;

/// A demo upstream and a gateway in front of it.
pub struct Stack {
    pub upstream: DemoUpstream,
    pub gateway: RunningGateway,
    pub http: Http,
}

impl Stack {
    pub async fn start(routes: &str) -> Stack {
        Self::start_with(routes, |_| {}).await
    }

    pub async fn start_with(routes: &str, tweak: impl FnOnce(&mut Config)) -> Stack {
        let upstream = demo_upstream::start("127.0.0.1:0").await.unwrap();
        let mut config = config(upstream.addr, routes);
        tweak(&mut config);
        let gateway = gateway::start_for_tests(config).await.unwrap();
        Stack {
            upstream,
            gateway,
            http: Http::default(),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.gateway.public_addr, path)
    }

    pub fn admin(&self, path: &str) -> String {
        format!("http://{}{}", self.gateway.admin_addr, path)
    }

    pub async fn shutdown(self) {
        self.gateway.shutdown().await;
        self.upstream.shutdown().await;
    }
}

/// How many times the demo upstream's `action` really executed, whatever
/// key it carried (`/actions/{name}` executes on every call).
pub fn executions(stack: &Stack, action: &str) -> u64 {
    executions_at(&stack.upstream, action)
}

/// [`executions`] at an upstream of the test's own.
pub fn executions_at(upstream: &DemoUpstream, action: &str) -> u64 {
    upstream
        .state
        .stats()
        .executions
        .get(action)
        .map_or(0, |keys| keys.values().sum())
}

/// Waits until `upstream` has received `n` requests: what a sleep "until
/// the first request is in flight" stood for (its claim is durable before
/// it is forwarded).
pub async fn reached(upstream: &DemoUpstream, n: u64) {
    let got = eventually(Duration::from_secs(10), || async {
        upstream.state.stats().requests >= n
    })
    .await;
    assert!(got, "the upstream never received request {n}");
}

/// A port nothing listens on.
pub fn dead_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

pub async fn eventually<F: std::future::Future<Output = bool>>(
    timeout: Duration,
    mut check: impl FnMut() -> F,
) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// `n` POSTs at once — the i-th to `url(i)` with `headers(i)` — and their
/// answers, in order. The duplicate-storm shape every concurrency test uses.
pub async fn concurrent_posts(
    http: &Http,
    n: usize,
    url: impl Fn(usize) -> String,
    headers: impl Fn(usize) -> Vec<(String, String)>,
    body: &'static str,
) -> Vec<Answer> {
    let tasks = (0..n).map(|i| {
        let http = http.clone();
        let (url, headers) = (url(i), headers(i));
        tokio::spawn(async move {
            let headers: Vec<(&str, &str)> = headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            http.send("POST", &url, &headers, body).await
        })
    });
    futures_util::future::join_all(tasks)
        .await
        .into_iter()
        .map(|answer| answer.expect("request task panicked"))
        .collect()
}

/// Header pairs from string slices, for [`concurrent_posts`].
pub fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The `idemgate` binary serving `config`, output discarded.
pub fn spawn_gateway(config: &std::path::Path) -> std::process::Child {
    std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["serve", "--config"])
        .arg(config)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

/// Waits until something answers HTTP at `url` (any status).
pub async fn wait_up(http: &Http, url: &str) {
    let up = eventually(Duration::from_secs(10), || {
        let http = http.clone();
        let url = url.to_owned();
        async move { http.try_send("GET", &url, &[], "").await.is_ok() }
    })
    .await;
    assert!(up, "nothing came up at {url}");
}

/// A client's retry loop: POSTs until the answer is 201, accepting only 409
/// (a claim still held) on the way; gives up after about eight seconds.
pub async fn retry_through_conflicts(http: &Http, url: &str, key: &str, body: &str) -> Answer {
    for _ in 0..80 {
        let a = http
            .send("POST", url, &[("idempotency-key", key)], body.to_owned())
            .await;
        if a.status == 201 {
            return a;
        }
        assert_eq!(a.status, 409, "{:?}", a.body);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the retry of {key} never went through");
}
