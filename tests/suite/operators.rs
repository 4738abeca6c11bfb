//! What operators run the gateway with: logs a collector can read that
//! never carry a credential, and an admin API that asks who is calling.
//! Real `idemgate serve` processes throughout.

use crate::support;

use std::process::Command;

use idemgate_demo_upstream as demo_upstream;
use support::instances::{self, Instance};
use support::{Answer, Http};

/// Credentials and keys planted in requests; none may reach a log line.
const BEARER: &str = "Bearer PLANTED-bearer-7f3a9c";
const COOKIE: &str = "sid=PLANTED-cookie-51d2e0; theme=dark";
const LONG_KEY: &str = "order-PLANTED-key-0123456789abcdef";
const ADMIN_TOKEN: &str = "PLANTED-admin-token-e4b1";
const WRONG_ADMIN_TOKEN: &str = "PLANTED-wrong-admin-99aa";
const SIGNING_SECRET: &str = "PLANTEDsigningsecret";

fn routes(upstream: std::net::SocketAddr) -> String {
    // Each gateway its own SQLite file (never the working directory's).
    let db = tempfile::tempdir().unwrap().keep().join("records.db");
    format!(
        r#"
        admin_token = "{ADMIN_TOKEN}"

        [store]
        database_url = "sqlite://{}"

        [tokens]
        secret = "PLANTED-token-hmac-secret"

        [[upstreams]]
        name = "demo"
        url = "http://{upstream}"
        timeout = "2s"

        [[routes]]
        name = "actions"
        methods = ["POST"]
        path_prefix = "/actions/"
        upstream = "demo"
        idempotency = "key"

        [[routes]]
        name = "checkout"
        methods = ["POST"]
        path = "/jobs/compensate"
        upstream = "demo"
        idempotency = "token"

        [[routes]]
        name = "hook"
        methods = ["POST"]
        path = "/mq/push"
        upstream = "demo"
        kind = "callback"
        business_key = ["json:/id"]
        [routes.signature]
        scheme = "hmac-sha256"
        header = "X-Signature"
        secrets = ["{SIGNING_SECRET}"]
        "#,
        db.display()
    )
}

/// `body` lines for the `[server]` table go first; the rest after.
fn spawn(upstream: std::net::SocketAddr, env: &[(&str, &str)]) -> Instance {
    let config = routes(upstream);
    let (server, rest) = config.split_once("[store]").unwrap();
    instances::spawn(server, &format!("[store]{rest}"), env)
}

async fn post(http: &Http, url: &str, headers: &[(&str, &str)], body: &str) -> Answer {
    http.send("POST", url, headers, body.to_owned()).await
}

/// Off a terminal the gateway logs one JSON object per line; requests that
/// carry a bearer token, a session cookie, a one-time token, a long key, a
/// wrong admin token and a signed callback (some of them refused, so that
/// problems are logged with their keys) leave none of those secrets in any
/// line, while the key shows up as its reference (`orde…#hash`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_are_json_lines_without_credentials() {
    let upstream = demo_upstream::start("127.0.0.1:0").await.unwrap();
    let debug = "info,idemgate=debug,idemgate_core=debug,idemgate_gateway=debug,\
                 idemgate_store=debug,idemgate_proxy=debug,idemgate_server=debug";
    let gw = spawn(upstream.addr, &[("IDEMGATE_LOG", debug)]);
    instances::wait_ready(&gw).await;
    let http = Http::http1();
    let who = [("authorization", BEARER), ("cookie", COOKIE)];
    let keyed = |key: &'static str| {
        let mut h = who.to_vec();
        h.push(("idempotency-key", key));
        h
    };
    let url = gw.url("/actions/pay");
    assert_eq!(
        post(&http, &url, &keyed(LONG_KEY), "{\"a\":1}")
            .await
            .status,
        201
    );
    let replay = post(&http, &url, &keyed(LONG_KEY), "{\"a\":1}").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        post(&http, &url, &keyed(LONG_KEY), "{\"a\":2}")
            .await
            .status,
        422
    );
    // A token: issued, used, reused for another body, forged.
    let issued = http
        .send(
            "POST",
            &gw.url("/token?route=checkout"),
            &who,
            String::new(),
        )
        .await;
    assert_eq!(issued.status, 201);
    let token = issued.json()["token"].as_str().unwrap().to_owned();
    let mut with_token = who.to_vec();
    with_token.push(("idempotency-token", token.as_str()));
    let used = post(
        &http,
        &gw.url("/jobs/compensate"),
        &with_token,
        "{\"job_id\":\"j-1\",\"step\":\"refund\"}",
    )
    .await;
    assert!(
        used.status.is_success(),
        "{:?} {:?}",
        used.status,
        used.body
    );
    let reused = post(
        &http,
        &gw.url("/jobs/compensate"),
        &with_token,
        "{\"job_id\":\"j-2\",\"step\":\"refund\"}",
    )
    .await;
    assert_eq!(reused.status, 422);
    let forged = format!("{}x", &token[..token.len() - 1]);
    let mut with_forged = who.to_vec();
    with_forged.push(("idempotency-token", forged.as_str()));
    assert_eq!(
        post(&http, &gw.url("/jobs/compensate"), &with_forged, "{}")
            .await
            .status,
        403
    );
    // A callback with a wrong signature.
    let hook = post(
        &http,
        &gw.url("/mq/push"),
        &[("x-signature", "00ff")],
        "{\"id\":\"m-PLANTED-1\"}",
    )
    .await;
    assert_eq!(hook.status, 401);
    // The admin API with a wrong token, then the right one.
    let admin = gw.admin_url(&format!("/admin/keys/actions/{LONG_KEY}"));
    let wrong = format!("Bearer {WRONG_ADMIN_TOKEN}");
    assert_eq!(
        http.send("GET", &admin, &[("authorization", &wrong)], String::new())
            .await
            .status,
        401
    );
    let right = format!("Bearer {ADMIN_TOKEN}");
    assert_eq!(
        http.send("GET", &admin, &[("authorization", &right)], String::new())
            .await
            .status,
        200
    );

    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let log = instances::log_of(&gw);
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(lines.len() >= 8, "too few lines to judge:\n{log}");
    for line in &lines {
        let parsed: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not one JSON object ({e}): {line}"));
        for field in ["timestamp", "level", "target"] {
            assert!(parsed.get(field).is_some(), "no {field}: {line}");
        }
        for secret in [
            "PLANTED-bearer",
            "PLANTED-cookie",
            "PLANTED-key-0123456789",
            "PLANTED-admin-token",
            "PLANTED-wrong-admin",
            "PLANTED-token-hmac",
            SIGNING_SECRET,
            token.as_str(),
            forged.as_str(),
        ] {
            assert!(!line.contains(secret), "{secret:?} logged: {line}");
        }
    }
    let reference = idemgate_store::key_ref(LONG_KEY);
    assert!(
        log.contains(&reference),
        "the key's reference {reference} is never logged:\n{log}"
    );
    upstream.shutdown().await;
}

/// `IDEMGATE_LOG_FORMAT=text` keeps human text off a terminal too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_logs_on_request() {
    let upstream = demo_upstream::start("127.0.0.1:0").await.unwrap();
    let gw = spawn(
        upstream.addr,
        &[("IDEMGATE_LOG", "info"), ("IDEMGATE_LOG_FORMAT", "text")],
    );
    instances::wait_ready(&gw).await;
    let log = instances::log_of(&gw);
    assert!(log.contains("idemgate listening"), "{log}");
    assert!(
        log.lines().all(|l| !l.trim_start().starts_with('{')),
        "{log}"
    );
    upstream.shutdown().await;
}

/// With `server.admin_token`, every `/admin/*` call needs it (401 and a
/// challenge otherwise, nothing purged); `/healthz`, `/readyz` and
/// `/metrics` stay open. `IDEMGATE_ADMIN_TOKEN` and `admin_token_file`
/// set it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_asks_who_is_calling() {
    let upstream = demo_upstream::start("127.0.0.1:0").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("admin-token");
    std::fs::write(&file, "from-a-file\n").unwrap();
    let by_file = {
        let config = routes(upstream.addr).replace(
            &format!("admin_token = \"{ADMIN_TOKEN}\""),
            &format!("admin_token_file = {:?}", file.display().to_string()),
        );
        let (server, rest) = config.split_once("[store]").unwrap();
        instances::spawn(server, &format!("[store]{rest}"), &[])
    };
    let by_env = spawn(upstream.addr, &[("IDEMGATE_ADMIN_TOKEN", "from-the-env")]);
    let by_config = spawn(upstream.addr, &[]);
    let http = Http::http1();
    for (gw, token) in [
        (&by_config, ADMIN_TOKEN),
        (&by_env, "from-the-env"),
        (&by_file, "from-a-file"),
    ] {
        instances::wait_ready(gw).await;
        let key = "a-1";
        let made = post(
            &http,
            &gw.url("/actions/pay"),
            &[("idempotency-key", key)],
            "{}",
        )
        .await;
        assert_eq!(made.status, 201);
        let record = gw.admin_url(&format!("/admin/keys/actions/{key}"));
        for authorization in [
            None,
            Some("Bearer nope".to_owned()),
            Some(format!("Basic {token}")),
        ] {
            let headers: Vec<(&str, &str)> = authorization
                .as_deref()
                .map(|a| vec![("authorization", a)])
                .unwrap_or_default();
            for method in ["GET", "DELETE"] {
                let refused = http.send(method, &record, &headers, String::new()).await;
                assert_eq!(refused.status, 401, "{method} {authorization:?}");
                assert_eq!(
                    refused.problem_type(),
                    "urn:idemgate:problem:admin-unauthorized"
                );
                assert!(
                    refused
                        .header("www-authenticate")
                        .unwrap()
                        .starts_with("Bearer")
                );
            }
        }
        let bearer = format!("Bearer {token}");
        let shown = http
            .send("GET", &record, &[("authorization", &bearer)], String::new())
            .await;
        assert_eq!(shown.status, 200, "{:?}", shown.body);
        assert_eq!(shown.json()["records"][0]["state"], "completed");
        let purged = http
            .send(
                "DELETE",
                &record,
                &[("authorization", &bearer)],
                String::new(),
            )
            .await;
        assert_eq!(purged.json()["purged"], 1);
        for open in ["/healthz", "/readyz", "/metrics"] {
            assert_eq!(http.get(&gw.admin_url(open)).await.status, 200, "{open}");
        }
    }
    upstream.shutdown().await;
}

/// An admin listener other hosts can reach, without a token, is refused
/// by `check-config` and by `serve`, naming the key; with one it starts.
#[test]
fn a_reachable_admin_listener_without_a_token_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().display().to_string();
    let write = |name: &str, token: &str| {
        let path = dir.path().join(name);
        std::fs::write(
            &path,
            format!(
                "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"0.0.0.0:0\"\n{token}\n\
                 [store]\ndatabase_url = \"sqlite://{db}/records.db\"\n\
                 [[upstreams]]\nname = \"o\"\nurl = \"http://127.0.0.1:9\"\n\
                 [[routes]]\nname = \"all\"\npath_prefix = \"/\"\nupstream = \"o\"\n"
            ),
        )
        .unwrap();
        path
    };
    let open = write("open.toml", "");
    for command in ["check-config", "serve"] {
        let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .args([command, "--config"])
            .arg(&open)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{command}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("server.admin_token"), "{command}: {stderr}");
    }
    let guarded = write("guarded.toml", "admin_token = \"t0ken\"");
    let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["check-config", "--config"])
        .arg(&guarded)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The dashboard in a real browser: headless Chromium loads the page from
/// a running gateway (its admin token in the URL's fragment), runs its
/// script, and the rendered DOM shows every route with the counts
/// `/metrics` reports, the upstream, and the uncertain record with its
/// reconcile action; a screenshot is kept in the test's directory. The
/// reconcile action itself then records the upstream's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_what_metrics_and_the_admin_api_say() {
    let Some(chromium) =
        support::browser::chromium("the_dashboard_shows_what_metrics_and_the_admin_api_say")
    else {
        return;
    };
    const ROUTES: &str = r#"
        [[routes]]
        name = "actions"
        methods = ["POST"]
        path_prefix = "/actions/"
        upstream = "demo"
        idempotency = "key"
        reconcile_path = "/actions/by-key/{key}"

        [[routes]]
        name = "pass"
        methods = ["GET"]
        path_prefix = "/stats"
        upstream = "demo"
    "#;
    let stack = support::Stack::start_with(ROUTES, |c| {
        c.server.admin_token = "dash-token".into();
        c.upstreams[0].uncertain_hold = Some("60s".into());
    })
    .await;
    let http = &stack.http;
    let post =
        |key: &'static str, body: &'static str, extra: &'static [(&'static str, &'static str)]| {
            let url = stack.url("/actions/pay");
            async move {
                let mut headers = vec![("idempotency-key", key)];
                headers.extend_from_slice(extra);
                http.send("POST", &url, &headers, body.to_owned()).await
            }
        };
    assert_eq!(post("d-1", "{}", &[]).await.status, 201);
    assert_eq!(post("d-2", "{}", &[]).await.status, 201);
    assert_eq!(
        post("d-1", "{}", &[]).await.header("idempotent-replayed"),
        Some("true")
    );
    assert_eq!(post("d-1", "{\"other\":1}", &[]).await.status, 422);
    assert_eq!(
        post("d-3", "{}", &[("x-demo-drop", "after")]).await.status,
        502
    );
    for _ in 0..3 {
        assert_eq!(http.get(&stack.url("/stats")).await.status, 200);
    }
    let metrics = http.get(&stack.admin("/metrics")).await;
    let count = |route: &str, outcome: &str| -> u64 {
        let prefix = format!("idemgate_requests_total{{route=\"{route}\",outcome=\"{outcome}\"}} ");
        String::from_utf8_lossy(&metrics.body)
            .lines()
            .find_map(|l| l.strip_prefix(&prefix).map(|v| v.trim().parse().unwrap()))
            .unwrap_or(0)
    };
    let dir = tempfile::tempdir().unwrap();
    let page = format!("{}#token=dash-token", stack.admin("/"));
    let dom = chromium.dump_dom(&page, dir.path());
    assert!(
        dom.contains("data-loaded=\"true\""),
        "the script never finished a refresh:\n{dom}"
    );
    for (route, outcome) in [
        ("actions", "forwarded"),
        ("actions", "replayed"),
        ("actions", "mismatch"),
        ("actions", "error"),
        ("pass", "forwarded"),
    ] {
        let row = support::browser::row(&dom, &format!("data-route=\"{route}\""))
            .unwrap_or_else(|| panic!("no row for {route}:\n{dom}"));
        let shown = support::browser::cell(row, &format!("data-outcome=\"{outcome}\""))
            .unwrap_or_else(|| panic!("no {outcome} cell for {route}: {row}"));
        assert_eq!(
            shown,
            count(route, outcome).to_string(),
            "{route} {outcome}: {row}"
        );
    }
    // d-1 and d-2 forwarded; d-3 reached the upstream and its answer was
    // lost: an error.
    assert_eq!(
        (count("actions", "forwarded"), count("actions", "error")),
        (2, 1)
    );
    assert!(dom.contains("data-upstream=\"demo\""), "{dom}");
    let uncertain = support::browser::row(&dom, "<td>d-3</td>")
        .unwrap_or_else(|| panic!("the uncertain record is not listed:\n{dom}"));
    assert!(uncertain.contains("Reconcile"), "{uncertain}");
    let shot = chromium.screenshot(&page, dir.path());
    assert!(std::fs::metadata(&shot).unwrap().len() > 10_000, "{shot:?}");

    // The reconcile action: the demo upstream's status endpoint says the
    // charge ran; its answer becomes the record's outcome.
    let listed = http
        .send(
            "GET",
            &stack.admin("/admin/uncertain"),
            &[("authorization", "Bearer dash-token")],
            String::new(),
        )
        .await
        .json();
    let record = &listed["records"][0];
    assert_eq!(record["key"], "d-3", "{listed}");
    let scope = record["client_scope"].as_str().unwrap();
    let reconciled = http
        .send(
            "POST",
            &stack.admin(&format!("/admin/uncertain/actions/d-3?scope={scope}")),
            &[("authorization", "Bearer dash-token")],
            String::new(),
        )
        .await;
    assert_eq!(reconciled.status, 200, "{:?}", reconciled.body);
    assert_eq!(reconciled.json()["outcome"], "recorded");
    let retry = post("d-3", "{}", &[]).await;
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        support::executions(&stack, "pay"),
        3,
        "d-1, d-2, d-3 once each"
    );
    let after = http
        .send(
            "GET",
            &stack.admin("/admin/uncertain"),
            &[("authorization", "Bearer dash-token")],
            String::new(),
        )
        .await
        .json();
    assert_eq!(after["records"].as_array().unwrap().len(), 0, "{after}");
    stack.shutdown().await;
}

/// One HTTP/1.1 request on a connection kept open across calls; the
/// status and body of its answer.
async fn on_connection(
    socket: &mut tokio::net::TcpStream,
    method: &str,
    path: &str,
) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let request = format!("{method} {path} HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\n\r\n{{}}");
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = socket.read(&mut chunk).await.unwrap();
        assert!(n > 0, "the connection was closed");
        buffer.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buffer).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let length: usize = text[..end]
                .lines()
                .find_map(|l| {
                    let (name, value) = l.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse().ok())?
                })
                .unwrap_or(0);
            if buffer.len() >= end + 4 + length {
                let status = text[9..12].parse().unwrap();
                return (status, text[end + 4..end + 4 + length].to_owned());
            }
        }
    }
}

/// `SIGHUP` re-reads the file: a route added is served on a connection
/// that was open before (none is dropped) while a slow request started
/// before the reload finishes on the table it started with; a token secret
/// rotated in is used at once; the reload is counted and the config hash
/// changes. A file that does not validate is refused, every problem
/// logged, and the running configuration stays; a changed `[store]` is
/// logged as needing a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_without_dropping_a_connection_or_a_request() {
    let upstream = demo_upstream::start("127.0.0.1:0").await.unwrap();
    let db = tempfile::tempdir().unwrap();
    let first = format!(
        r#"
        [store]
        database_url = "sqlite://{}/records.db"

        [tokens]
        secret = "first-secret"

        [[upstreams]]
        name = "demo"
        url = "http://{}"
        timeout = "5s"

        [[routes]]
        name = "actions"
        methods = ["POST"]
        path_prefix = "/actions/"
        upstream = "demo"
        idempotency = "key"
        "#,
        db.path().display(),
        upstream.addr
    );
    let gw = instances::spawn("", &first, &[("IDEMGATE_LOG", "info")]);
    instances::wait_ready(&gw).await;
    let http = Http::http1();
    let metric = async |name: &str| -> String {
        let text =
            String::from_utf8_lossy(&http.get(&gw.admin_url("/metrics")).await.body).into_owned();
        text.lines()
            .filter(|l| l.starts_with(name))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let hash_before = metric("idemgate_config_info").await;
    assert!(hash_before.contains("hash="), "{hash_before}");
    let mut kept = tokio::net::TcpStream::connect(gw.public).await.unwrap();
    assert_eq!(on_connection(&mut kept, "GET", "/stats").await.0, 404);
    // A slow request in flight across the reload.
    let slow = {
        let (http, url) = (http.clone(), gw.url("/actions/slow"));
        tokio::spawn(async move {
            http.send(
                "POST",
                &url,
                &[("idempotency-key", "slow-1"), ("x-demo-delay-ms", "1500")],
                "{}".to_owned(),
            )
            .await
        })
    };
    support::reached(&upstream, 1).await;
    let second = first.replace("first-secret", "second-secret")
        + r#"
        [[routes]]
        name = "stats"
        methods = ["GET"]
        path = "/stats"
        upstream = "demo"
        "#;
    std::fs::write(&gw.config, format!("[server]\nlisten = \"{}\"\nadmin_listen = \"{}\"\nworker_threads = 2\nheader_read_timeout = \"5s\"\nshutdown_grace = \"10s\"\n{second}", gw.public, gw.admin)).unwrap();
    let hup = Command::new("kill")
        .args(["-HUP", &gw.pid().to_string()])
        .status()
        .unwrap();
    assert!(hup.success());
    let served = support::eventually(std::time::Duration::from_secs(10), || async {
        metric("idemgate_config_reloads_total{result=\"applied\"}")
            .await
            .ends_with(" 1")
    })
    .await;
    assert!(served, "{}", instances::log_of(&gw));
    // The same connection, the new route.
    let (status, body) = on_connection(&mut kept, "GET", "/stats").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("executions"), "{body}");
    let slow = slow.await.unwrap();
    assert_eq!(
        slow.status, 201,
        "the request started before the reload: {:?}",
        slow.body
    );
    assert_ne!(metric("idemgate_config_info").await, hash_before);
    // Tokens are signed with the new secret now (one issued and used).
    let issued = http
        .send("POST", &gw.url("/token"), &[], String::new())
        .await;
    assert_eq!(issued.status, 201);

    // An invalid file: refused, logged, the running table stays.
    std::fs::write(
        &gw.config,
        format!(
            "[server]\nlisten = \"{}\"\nadmin_listen = \"{}\"\nno_such_key = 1\n{second}",
            gw.public, gw.admin
        ),
    )
    .unwrap();
    Command::new("kill")
        .args(["-HUP", &gw.pid().to_string()])
        .status()
        .unwrap();
    let refused = support::eventually(std::time::Duration::from_secs(10), || async {
        metric("idemgate_config_reloads_total{result=\"refused\"}")
            .await
            .ends_with(" 1")
    })
    .await;
    assert!(refused);
    assert_eq!(on_connection(&mut kept, "GET", "/stats").await.0, 200);
    let log = instances::log_of(&gw);
    assert!(
        log.contains("no_such_key"),
        "the problem is not logged:\n{log}"
    );

    // A changed [store] is said to need a restart; the rest applies.
    let moved = second.replace("[tokens]", "pool_size = 3\n\n[tokens]");
    std::fs::write(&gw.config, format!("[server]\nlisten = \"{}\"\nadmin_listen = \"{}\"\nworker_threads = 2\nheader_read_timeout = \"5s\"\nshutdown_grace = \"10s\"\n{moved}", gw.public, gw.admin)).unwrap();
    Command::new("kill")
        .args(["-HUP", &gw.pid().to_string()])
        .status()
        .unwrap();
    let applied = support::eventually(std::time::Duration::from_secs(10), || async {
        metric("idemgate_config_reloads_total{result=\"applied\"}")
            .await
            .ends_with(" 2")
    })
    .await;
    assert!(applied);
    let log = instances::log_of(&gw);
    assert!(
        log.contains("only take effect after a restart") && log.contains("store"),
        "{log}"
    );
    assert_eq!(on_connection(&mut kept, "GET", "/stats").await.0, 200);
    upstream.shutdown().await;
}
