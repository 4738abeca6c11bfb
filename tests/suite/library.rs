//! The library (SPEC §6): `examples/orders.rs`, an axum app mounting the
//! key, token and callback layers on its own handlers, started as a real
//! process and driven over HTTP. Its handlers count every execution.

use crate::support;

use std::io::BufRead;
use std::time::Duration;

use support::Http;
use tokio::io::AsyncWriteExt;

struct Example {
    child: std::process::Child,
    base: String,
}

impl Drop for Example {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The example's executable: `orders` when `cargo build --example orders`
/// made it (scripts/test.sh does), else the newest `orders-<hash>` that
/// `cargo test --all-targets` built.
fn example_binary(dir: &std::path::Path) -> std::path::PathBuf {
    let plain = dir.join("orders");
    if plain.exists() {
        return plain;
    }
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            name.starts_with("orders-") && !name.contains('.')
        })
        .max_by_key(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
        .unwrap_or_else(|| {
            panic!("build the example first: cargo build --example orders ({dir:?})")
        })
}

/// The `orders` example, built beside this test.
fn start_example() -> Example {
    let exe = std::env::current_exe().unwrap();
    let debug = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let binary = example_binary(&debug.join("examples"));
    let mut child = std::process::Command::new(binary)
        .arg("127.0.0.1:0")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line.trim().rsplit(' ').next().unwrap().to_owned();
    Example {
        child,
        base: format!("http://{addr}"),
    }
}

async fn stats(http: &Http, base: &str) -> serde_json::Value {
    http.get(&format!("{base}/stats")).await.json()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_axum_app_with_the_three_layers_executes_each_action_once() {
    let example = start_example();
    let base = example.base.clone();
    let http = Http::default();
    let orders = format!("{base}/orders");

    // Idempotency-Key: the repeat replays, another body is 422, no key 400.
    let first = http
        .send(
            "POST",
            &orders,
            &[("idempotency-key", "k1")],
            r#"{"item":"book"}"#,
        )
        .await;
    assert_eq!(first.status, 201);
    assert!(first.json()["key"].as_str().unwrap().starts_with("ig-"));
    let again = http
        .send(
            "POST",
            &orders,
            &[("idempotency-key", "k1")],
            r#"{"item":"book"}"#,
        )
        .await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
    let other = http
        .send(
            "POST",
            &orders,
            &[("idempotency-key", "k1")],
            r#"{"item":"pen"}"#,
        )
        .await;
    assert_eq!(other.status, 422);
    assert_eq!(http.send("POST", &orders, &[], "{}").await.status, 400);

    // Tokens: fetched from the app's /token, one action each.
    let token = http
        .send("POST", &format!("{base}/token?route=checkout"), &[], "")
        .await;
    assert_eq!(token.status, 201);
    let token = token.json()["token"].as_str().unwrap().to_owned();
    for _ in 0..3 {
        let a = http
            .send(
                "POST",
                &format!("{base}/checkout"),
                &[("idempotency-token", &token)],
                "{}",
            )
            .await;
        assert_eq!(a.status, 201);
    }
    let forged = http
        .send(
            "POST",
            &format!("{base}/checkout"),
            &[("idempotency-token", "v1.AAAA.BBBB")],
            "{}",
        )
        .await;
    assert_eq!(forged.status, 403);

    // A callback redelivered with a rotated credential: one execution.
    for auth in ["Bearer monday", "Bearer tuesday", "Bearer wednesday"] {
        let a = http
            .send(
                "POST",
                &format!("{base}/payments/notify"),
                &[("authorization", auth)],
                r#"{"trade_no":"T-1","amount":100}"#,
            )
            .await;
        assert_eq!(a.status, 200);
    }

    // A client that hangs up before the handler answers: the handler still
    // runs to the end and its outcome is recorded; the retry replays.
    let addr = base.trim_start_matches("http://").to_owned();
    let mut socket = tokio::net::TcpStream::connect(&addr).await.unwrap();
    socket
        .write_all(
            b"POST /orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: slow-1\r\nX-Slow-Ms: 800\r\n\
              Content-Length: 2\r\n\r\n{}",
        )
        .await
        .unwrap();
    // The example has no "started" signal to wait for: 200 ms stands for
    // "the request has reached the handler" (it takes 800 ms).
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(socket);
    // Retried until the handler is done: `409 in flight` before that.
    let mut retry = None;
    for _ in 0..50 {
        let answer = http
            .send(
                "POST",
                &orders,
                &[("idempotency-key", "slow-1"), ("x-slow-ms", "800")],
                "{}",
            )
            .await;
        if answer.status != 409 {
            retry = Some(answer);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let retry = retry.expect("the handler never finished");
    assert_eq!(retry.status, 201);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));

    let counts = stats(&http, &base).await;
    assert_eq!(counts["orders"], 2, "{counts}");
    assert_eq!(counts["checkouts"], 1, "{counts}");
    assert_eq!(counts["payments"], 1, "{counts}");
}
