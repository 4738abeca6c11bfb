//! The library: `crates/idemgate/examples/orders.rs`, an axum app mounting the
//! key, token and callback layers on its own handlers, started as a real
//! process and driven over HTTP. Its handlers count every execution.

use crate::support;

use std::io::BufRead;
use std::time::Duration;

use support::Http;
use tokio::io::AsyncWriteExt;

struct Example {
    /// Its database file's directory.
    _dir: tempfile::TempDir,
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
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(binary)
        .arg("127.0.0.1:0")
        .env(
            "ORDERS_DATABASE_URL",
            format!("sqlite://{}/orders.db", dir.path().display()),
        )
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line.trim().rsplit(' ').next().unwrap().to_owned();
    Example {
        _dir: dir,
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

// === the library beside an application's own schema and lifetime ===

use axum::body::Body;
use http::{Request, StatusCode};
use idemgate::{Idempotency, OnConcurrent, Signature};
use sqlx::migrate::Migrator;
use tower::ServiceExt;

fn app_migrations() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/suite/fixtures/app_migrations")
}

/// A counting handler behind `layer`, as an axum router.
fn counted<P: idemgate::Policy>(
    layer: idemgate::IdempotencyLayer<P>,
    calls: std::sync::Arc<std::sync::atomic::AtomicU32>,
) -> axum::Router {
    axum::Router::new().route(
        "/orders",
        axum::routing::post(move || {
            let calls = calls.clone();
            async move {
                calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                (StatusCode::CREATED, "ord_1")
            }
        })
        .route_layer(layer),
    )
}

fn order(key: &str) -> Request<Body> {
    Request::post("/orders")
        .header("idempotency-key", key)
        .body(Body::from("{}"))
        .unwrap()
}

/// Idemgate's migrations and the application's own sqlx migrations run on
/// one database in either order, each recorded in its own table: neither
/// side finds the other's versions ("previously applied but missing").
#[tokio::test]
async fn the_librarys_migrations_never_meet_the_applications_own() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/app.db?mode=rwc", dir.path().display());
    let app = Migrator::new(app_migrations()).await.unwrap();
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    // The application first, then Idemgate, then the application again
    // (its next deploy), then Idemgate again.
    app.run(&pool).await.unwrap();
    let idempotency = Idempotency::builder()
        .database_url(&url)
        .build()
        .await
        .unwrap();
    app.run(&pool)
        .await
        .expect("the app's migrator after Idemgate's");
    drop(idempotency);
    Idempotency::builder()
        .database_url(&url)
        .build()
        .await
        .unwrap();
    let ours: Vec<(i64,)> =
        sqlx::query_as("SELECT version FROM _idemgate_migrations ORDER BY version")
            .fetch_all(&pool)
            .await
            .unwrap();
    let all: Vec<(i64,)> = (1..=shipped_migrations("sqlite")).map(|v| (v,)).collect();
    assert_eq!(ours, all);
    let theirs: Vec<(i64,)> =
        sqlx::query_as("SELECT version FROM _sqlx_migrations ORDER BY version")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(theirs, vec![(20240101000000,), (20240102000000,)]);
}

/// A database an earlier release migrated through `_sqlx_migrations`
/// (Idemgate's rows beside the application's) is adopted once: Idemgate's
/// rows move to its own table, nothing is applied twice, and the
/// application's migrator then finds only its own rows.
#[tokio::test]
async fn rows_an_earlier_release_left_in_the_shared_table_are_adopted() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/old.db?mode=rwc", dir.path().display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    // What the earlier release did: its migrations, recorded by sqlx's
    // default migrator in the shared table.
    // (Its three migrations: the fourth came later.)
    let store_migrations = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("crates/idemgate-store/migrations/sqlite");
    let released = dir.path().join("released");
    std::fs::create_dir(&released).unwrap();
    for file in ["0001_records.sql", "0002_purges.sql", "0003_settling.sql"] {
        std::fs::copy(store_migrations.join(file), released.join(file)).unwrap();
    }
    let mut old = Migrator::new(released).await.unwrap();
    old.set_ignore_missing(true);
    old.run(&pool).await.unwrap();
    let mut app = Migrator::new(app_migrations()).await.unwrap();
    app.set_ignore_missing(true);
    app.run(&pool).await.unwrap();
    // The upgrade: the store opens (SQLite's ALTER TABLE ADD COLUMN would
    // fail if its migration 3 ran a second time).
    Idempotency::builder()
        .database_url(&url)
        .build()
        .await
        .unwrap();
    let app = Migrator::new(app_migrations()).await.unwrap();
    app.run(&pool)
        .await
        .expect("only the app's rows are left in _sqlx_migrations");
    let ours: (i64,) = sqlx::query_as("SELECT COUNT(*) FROM _idemgate_migrations")
        .fetch_one(&pool)
        .await
        .unwrap();
    // The three adopted, the later ones applied.
    assert_eq!(ours.0, shipped_migrations("sqlite"));
}

/// How many migrations the store ships for `backend`.
fn shipped_migrations(backend: &str) -> i64 {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("crates/idemgate-store/migrations")
        .join(backend);
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "sql")
        })
        .count() as i64
}

/// On Postgres, `schema` keeps Idemgate's tables and its migrations table
/// in a schema of their own.
#[tokio::test]
async fn a_postgres_schema_of_its_own_holds_every_table() {
    let test = "a_postgres_schema_of_its_own_holds_every_table";
    let Some(url) = support::services::postgres(test).await else {
        return;
    };
    let schema = format!("ig_lib_{}", std::process::id());
    let idempotency = Idempotency::builder()
        .database_url(&url)
        .schema(&schema)
        .build()
        .await
        .unwrap();
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let app = counted(idempotency.key_layer("orders"), calls.clone());
    for _ in 0..2 {
        let answer = app.clone().oneshot(order("pg-1")).await.unwrap();
        assert_eq!(answer.status(), StatusCode::CREATED);
    }
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let tables: Vec<(String,)> = sqlx::query_as(
        "SELECT table_name::text FROM information_schema.tables WHERE table_schema = $1 ORDER BY 1",
    )
    .bind(&schema)
    .fetch_all(&pool)
    .await
    .unwrap();
    let tables: Vec<&str> = tables.iter().map(|t| t.0.as_str()).collect();
    for table in [
        "_idemgate_migrations",
        "idempotency_purges",
        "idempotency_records",
    ] {
        assert!(
            tables.contains(&table),
            "{table} not in {schema}: {tables:?}"
        );
    }
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&pool)
        .await
        .unwrap();
}

/// The common `fn app() -> Router` drops the handle once the layers are
/// mounted: the sweeper lives as long as a layer does, and retires the
/// expired record.
#[tokio::test]
async fn the_sweeper_lives_as_long_as_any_layer() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/sweep.db?mode=rwc", dir.path().display());
    let app = {
        let idempotency = Idempotency::builder()
            .database_url(&url)
            .retention(Duration::from_millis(300))
            .sweep_interval(Duration::from_millis(100))
            .build()
            .await
            .unwrap();
        counted(idempotency.key_layer("orders"), Default::default())
        // The handle is dropped here.
    };
    assert_eq!(
        app.clone().oneshot(order("s-1")).await.unwrap().status(),
        201
    );
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let count = async || -> i64 {
        sqlx::query_as::<_, (i64,)>("SELECT COUNT(*) FROM idempotency_records")
            .fetch_one(&pool)
            .await
            .unwrap()
            .0
    };
    assert_eq!(count().await, 1);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while count().await != 0 {
        assert!(std::time::Instant::now() < deadline, "never swept");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(app);
}

/// A library app follows the purge log as a gateway does: after
/// `idemgate keys purge` returns, the key it was replaying from memory
/// executes again (before: replayed from memory for the whole retention).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_from_the_cli_reaches_a_library_apps_memory() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/purge.db?mode=rwc", dir.path().display());
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let app = {
        let idempotency = Idempotency::builder()
            .database_url(&url)
            .build()
            .await
            .unwrap();
        counted(idempotency.key_layer("orders"), calls.clone())
        // The handle is dropped here: the follower lives with the layers.
    };
    assert_eq!(
        app.clone().oneshot(order("p-1")).await.unwrap().status(),
        201
    );
    let replay = app.clone().oneshot(order("p-1")).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    let config = dir.path().join("cli.toml");
    std::fs::write(&config, format!("[store]\ndatabase_url = \"{url}\"\n")).unwrap();
    let purge = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["keys", "purge", "orders", "p-1", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(
        purge.status.success(),
        "{}",
        String::from_utf8_lossy(&purge.stderr)
    );
    let after = app.clone().oneshot(order("p-1")).await.unwrap();
    assert_eq!(after.status(), 201);
    assert!(
        after.headers().get("idempotent-replayed").is_none(),
        "a purged key was replayed"
    );
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 2);
}

/// What a library user sees on the wire: every answer names its request
/// (`X-Request-Id`, the client's own kept), `/token` takes POST and GET
/// only, `on_concurrent = wait` shares the first answer, and a handler past
/// its deadline is a 504 that says "handler", not "upstream".
#[tokio::test]
async fn library_answers_name_their_request_and_say_what_timed_out() {
    let idempotency = Idempotency::builder()
        .in_memory_for_tests()
        .handler_deadline(Duration::from_millis(300))
        .on_concurrent(OnConcurrent::Wait)
        .build()
        .await
        .unwrap();
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let counted_calls = calls.clone();
    let app = axum::Router::new()
        .route(
            "/orders",
            axum::routing::post(move |body: String| {
                let calls = counted_calls.clone();
                async move {
                    calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let ms = body.trim().parse().unwrap_or(0);
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    (StatusCode::CREATED, "ord")
                }
            })
            .route_layer(idempotency.key_layer("orders")),
        )
        .route_service("/token", idempotency.token_endpoint(&["checkout"]));
    let post = |key: &str, ms: &str| {
        Request::post("/orders")
            .header("idempotency-key", key)
            .body(Body::from(ms.to_owned()))
            .unwrap()
    };
    let first = app.clone().oneshot(post("w-1", "150")).await.unwrap();
    let id = first.headers()["x-request-id"].clone();
    assert_eq!(id.len(), 36, "a UUID: {id:?}");
    let mut kept = post("w-1", "150");
    kept.headers_mut()
        .insert("x-request-id", "client-7".parse().unwrap());
    let replay = app.clone().oneshot(kept).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(
        replay.headers()["x-request-id"],
        id,
        "the executing request's id"
    );
    // Two at once with `wait`: one execution, both 201.
    let (a, b) = tokio::join!(
        app.clone().oneshot(post("w-2", "150")),
        app.clone().oneshot(post("w-2", "150"))
    );
    assert_eq!(
        (a.unwrap().status(), b.unwrap().status()),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 2);
    // Past the deadline.
    let late = app.clone().oneshot(post("w-3", "1000")).await.unwrap();
    assert_eq!(late.status(), StatusCode::GATEWAY_TIMEOUT);
    assert!(late.headers().contains_key("x-request-id"));
    assert_eq!(
        late.headers()["retry-after"],
        "1",
        "held as long as the deadline"
    );
    let body = axum::body::to_bytes(late.into_body(), 10_000)
        .await
        .unwrap();
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        problem["type"], "urn:idemgate:problem:handler-timeout",
        "{problem}"
    );
    assert!(
        problem["title"].as_str().unwrap().contains("handler"),
        "{problem}"
    );
    // What is true, said: the handler may have acted and work it spawned
    // may still run, so the retry is held (its Retry-After), then runs the
    // handler once more.
    let detail = problem["detail"].as_str().unwrap();
    for said in [
        "may have acted",
        "spawned",
        "held for 1s",
        "runs the handler once more",
    ] {
        assert!(detail.contains(said), "{said:?} in {detail}");
    }
    let retry = app.clone().oneshot(post("w-3", "1000")).await.unwrap();
    assert_eq!(retry.status(), StatusCode::BAD_GATEWAY);
    assert_eq!(retry.headers()["retry-after"], "1");
    let body = axum::body::to_bytes(retry.into_body(), 10_000)
        .await
        .unwrap();
    let held: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(held["type"], "urn:idemgate:problem:outcome-uncertain");
    let detail = held["detail"].as_str().unwrap();
    assert!(
        detail.contains("handler") && !detail.contains("upstream"),
        "the library has no upstream: {detail}"
    );
    assert!(
        !held["title"].as_str().unwrap().contains("upstream"),
        "{held}"
    );
    // After the hold (the deadline): the handler runs once more.
    let before = calls.load(std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let after = app.clone().oneshot(post("w-3", "1000")).await.unwrap();
    assert_eq!(after.status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), before + 1);
    // /token.
    for (method, status) in [("POST", 201), ("GET", 201), ("PUT", 405), ("DELETE", 405)] {
        let answer = app
            .clone()
            .oneshot(
                Request::builder()
                    .method(method)
                    .uri("/token")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(answer.status().as_u16(), status, "{method}");
        assert!(answer.headers().contains_key("x-request-id"), "{method}");
        if status == 405 {
            assert_eq!(answer.headers()["allow"], "POST, GET");
        }
    }
}

/// A library callback route can check signatures: a forged delivery is
/// 401 and leaves no record; a signed one executes once. A header-sourced
/// key on a signed route, and a signature without secrets, are refused
/// when the layer is built.
#[tokio::test]
async fn a_library_callback_checks_its_signature_before_anything_is_stored() {
    use idemgate::CallbackError;
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let idempotency = Idempotency::builder()
        .in_memory_for_tests()
        .build()
        .await
        .unwrap();
    let refused = idempotency
        .callback("pay")
        .business_key(&["header:x-trade"])
        .signature(Signature::standard_webhooks(&[secret]))
        .build()
        .err();
    assert_eq!(
        refused,
        Some(CallbackError::UnsignedSource("header:x-trade".into()))
    );
    assert!(matches!(
        idempotency
            .callback("pay")
            .business_key(&["json:/t"])
            .signature(Signature::stripe(&[]))
            .build(),
        Err(CallbackError::Signature(_))
    ));
    assert_eq!(
        idempotency.callback("pay").build().err(),
        Some(CallbackError::NoBusinessKey)
    );
    let layer = idempotency
        .callback("pay")
        .business_key(&["json:/trade_no"])
        .must_match(&["json:/amount"])
        .signature(Signature::standard_webhooks(&[secret]))
        .build()
        .unwrap();
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let app = counted(layer, calls.clone());
    let body = r#"{"trade_no":"T-9","amount":5}"#;
    let delivery = |signature: String| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        let signature = if signature.is_empty() {
            idemgate::callback::signature::sign_standard(
                &base64::Engine::decode(
                    &base64::engine::general_purpose::STANDARD,
                    secret.trim_start_matches("whsec_"),
                )
                .unwrap(),
                "msg_1",
                now,
                body.as_bytes(),
            )
        } else {
            signature
        };
        Request::post("/orders")
            .header("webhook-id", "msg_1")
            .header("webhook-timestamp", now.to_string())
            .header("webhook-signature", signature)
            .body(Body::from(body))
            .unwrap()
    };
    let forged = app
        .clone()
        .oneshot(delivery("v1,Zm9yZ2Vk".into()))
        .await
        .unwrap();
    assert_eq!(forged.status(), StatusCode::UNAUTHORIZED);
    for _ in 0..2 {
        let signed = app.clone().oneshot(delivery(String::new())).await.unwrap();
        assert_eq!(signed.status(), StatusCode::CREATED);
    }
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// The library refuses a store that dies with the process unless the
/// builder is told it is for tests.
#[tokio::test]
async fn an_in_memory_store_needs_the_builder_call_that_says_it_is_for_tests() {
    for url in ["sqlite::memory:", "sqlite://x.db?mode=memory"] {
        let refused = Idempotency::builder().database_url(url).build().await;
        let Err(e) = refused else {
            panic!("{url} was accepted");
        };
        assert!(e.to_string().contains("in-memory"), "{e}");
    }
    assert!(
        Idempotency::builder()
            .in_memory_for_tests()
            .build()
            .await
            .is_ok()
    );
}

/// A gRPC service built with the library: a unary call through the key
/// layer executes once and replays its trailers; a refusal, mapped with
/// `idemgate::grpc::refusal_as_grpc` as docs/grpc.md shows, reaches the
/// client as a gRPC status.
#[tokio::test]
async fn a_grpc_call_through_the_library_executes_once_and_is_refused_in_grpc() {
    use axum::response::IntoResponse;
    use http_body_util::BodyExt;

    let idempotency = Idempotency::builder()
        .in_memory_for_tests()
        .build()
        .await
        .unwrap();
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let counted_calls = calls.clone();
    let place = move || {
        let calls = counted_calls.clone();
        async move {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut trailers = http::HeaderMap::new();
            trailers.insert("grpc-status", "0".parse().unwrap());
            let frames = [
                Ok::<_, std::convert::Infallible>(http_body::Frame::data(
                    bytes::Bytes::from_static(b"\0\0\0\0\x02ok"),
                )),
                Ok(http_body::Frame::trailers(trailers)),
            ];
            let body = Body::new(http_body_util::StreamBody::new(futures_util::stream::iter(
                frames,
            )));
            ([("content-type", "application/grpc")], body).into_response()
        }
    };
    let app = axum::Router::new()
        .route(
            "/shop.Orders/Place",
            axum::routing::post(place).route_layer(idempotency.key_layer("place")),
        )
        .layer(axum::middleware::from_fn(
            |req: Request<Body>, next: axum::middleware::Next| async move {
                let grpc = idemgate::grpc::is_grpc(req.headers());
                let response = next.run(req).await;
                match grpc {
                    true => idemgate::grpc::refusal_as_grpc(response, None),
                    false => response,
                }
            },
        ));
    let call = |key: Option<&str>, message: &'static [u8]| {
        let mut request = Request::post("/shop.Orders/Place")
            .header("content-type", "application/grpc")
            .header("te", "trailers");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        let framed = [&[0u8, 0, 0, 0, message.len() as u8][..], message].concat();
        request.body(Body::from(framed)).unwrap()
    };
    for attempt in 0..2 {
        let answer = app.clone().oneshot(call(Some("g-1"), b"m")).await.unwrap();
        assert_eq!(answer.status(), StatusCode::OK);
        let replayed = answer.headers().get("idempotent-replayed").cloned();
        assert_eq!(replayed.is_some(), attempt == 1);
        let whole = answer.into_body().collect().await.unwrap();
        let trailers = whole.trailers().cloned().expect("trailers");
        assert_eq!(trailers["grpc-status"], "0");
        assert_eq!(&whole.to_bytes()[..], b"\0\0\0\0\x02ok");
    }
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    let reused = app
        .clone()
        .oneshot(call(Some("g-1"), b"other"))
        .await
        .unwrap();
    assert_eq!(reused.status(), StatusCode::OK);
    assert_eq!(reused.headers()["grpc-status"], "9");
    let message = reused.headers()["grpc-message"].to_str().unwrap();
    assert!(message.contains("idempotency-key-reused"), "{message}");
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
}
