//! What a reload (`SIGHUP`) may change, against real `idemgate serve`
//! processes (docs/semantics.md, rule 12): a reload is validated as the
//! configuration that will run — the keys only a restart applies at their
//! running values — or refused as a whole, the running configuration
//! staying; a random token secret survives it.

use crate::support;

use std::time::Duration;

use idemgate_demo_upstream as demo_upstream;
use support::instances::{self, Instance};
use support::{Http, eventually, executions_at};

/// The value of the `/metrics` series `name` (0 when absent).
async fn metric(http: &Http, gw: &Instance, name: &str) -> u64 {
    let text =
        String::from_utf8_lossy(&http.get(&gw.admin_url("/metrics")).await.body).into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0)
}

const APPLIED: &str = "idemgate_config_reloads_total{result=\"applied\"}";
const REFUSED: &str = "idemgate_config_reloads_total{result=\"refused\"}";

/// Sends `SIGHUP` and waits until `series` has counted it.
async fn reload_counted(http: &Http, gw: &Instance, series: &str) {
    let before = metric(http, gw, series).await;
    gw.hup();
    let counted = eventually(Duration::from_secs(10), || async {
        metric(http, gw, series).await > before
    })
    .await;
    assert!(
        counted,
        "the reload was not counted as {series}:\n{}",
        instances::log_of(gw)
    );
}

/// A store that keeps records 20 s (its lease 8 s) and a token route over
/// an upstream that times out after `timeout`, tokens valid for `ttl`,
/// plus `store` keys.
fn tokens_config(
    db: &str,
    upstream: std::net::SocketAddr,
    timeout: &str,
    ttl: &str,
    store: &str,
) -> String {
    format!(
        r#"
        [store]
        database_url = "sqlite://{db}"
        {store}

        [tokens]
        secret = "a-secret-for-this-test"
        ttl = "{ttl}"

        [[upstreams]]
        name = "demo"
        url = "http://{upstream}"
        timeout = "{timeout}"

        [[routes]]
        name = "pay"
        methods = ["POST"]
        path_prefix = "/actions/"
        upstream = "demo"
        idempotency = "token"
        "#
    )
}

/// A file that is valid on its own — a longer upstream timeout and token
/// lifetime, with a `[store]` that matches them — but whose `[store]`
/// only applies on a restart. Checked with the store that keeps running
/// (a 20 s retention, an 8 s lease), it would let a token outlive its
/// record and a claim's lease end before its copy: refused, naming the
/// keys, and the running token lifetime stays. (Before, the check ran on
/// the file while the old store ran beside its new timeouts.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_is_checked_with_the_store_that_keeps_running() {
    let upstream = demo_upstream::start("127.0.0.1:0").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("records.db").display().to_string();
    let store = "retention = \"20s\"\nlease = \"8s\"";
    let gw = instances::spawn(
        "",
        &tokens_config(&db, upstream.addr, "5s", "15s", store),
        &[],
    );
    instances::wait_ready(&gw).await;
    let http = Http::http1();
    let ttl = async || {
        let issued = http.send("POST", &gw.url("/token"), &[], "").await;
        assert_eq!(issued.status, 201, "{:?}", issued.body);
        issued.json()["ttl_seconds"].as_u64().unwrap()
    };
    assert_eq!(ttl().await, 15);

    let longer = "retention = \"10m\"\nlease = \"15s\"";
    gw.rewrite("", &tokens_config(&db, upstream.addr, "10s", "5m", longer));
    reload_counted(&http, &gw, REFUSED).await;
    let log = instances::log_of(&gw);
    for named in [
        "store.lease",
        "store.retention",
        "tokens.ttl",
        "upstreams[0].timeout",
        "only take effect after a restart",
    ] {
        assert!(log.contains(named), "{named} is not named:\n{log}");
    }
    assert_eq!(ttl().await, 15, "the running configuration stays");
    assert_eq!(metric(&http, &gw, APPLIED).await, 0);

    // The same file with the running store's values is applied.
    gw.rewrite("", &tokens_config(&db, upstream.addr, "5s", "20s", store));
    reload_counted(&http, &gw, APPLIED).await;
    assert_eq!(ttl().await, 20);
}

/// The admin listener is reachable from other hosts, with a token. A
/// reload that moves it to loopback and drops the token is judged as it
/// would run: the listener only moves on a restart, so it would stay
/// public without a token — refused, and the token still guards the admin
/// API. (Before, the token was dropped while the listener stayed public.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_drops_a_public_admin_listeners_token_is_refused() {
    let upstream = demo_upstream::start("127.0.0.1:0").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("records.db").display().to_string();
    let body = tokens_config(
        &db,
        upstream.addr,
        "5s",
        "15s",
        "retention = \"20s\"\nlease = \"8s\"",
    );
    let gw = instances::spawn_on("0.0.0.0", "admin_token = \"s3cret-admin\"", &body, &[]);
    instances::wait_ready(&gw).await;
    let http = Http::http1();
    let admin = |token: Option<&'static str>| {
        let (http, url) = (http.clone(), gw.admin_url("/admin/uncertain"));
        async move {
            let auth = token.map(|t| format!("Bearer {t}"));
            let headers: Vec<(&str, &str)> =
                auth.iter().map(|a| ("authorization", a.as_str())).collect();
            http.send("GET", &url, &headers, "").await.status
        }
    };
    assert_eq!(admin(None).await, 401);
    assert_eq!(admin(Some("s3cret-admin")).await, 200);

    let moved = format!(
        "[server]\nlisten = \"{}\"\nadmin_listen = \"{}\"\nworker_threads = 2\n{body}",
        gw.public, gw.admin
    );
    std::fs::write(&gw.config, moved).unwrap();
    reload_counted(&http, &gw, REFUSED).await;
    let log = instances::log_of(&gw);
    assert!(log.contains("server.admin_token"), "{log}");
    assert!(log.contains("server.admin_listen"), "{log}");
    assert_eq!(
        admin(None).await,
        401,
        "the token still guards the admin API"
    );
    assert_eq!(admin(Some("s3cret-admin")).await, 200);
}

/// With no `tokens.secret`, each process signs with a random secret of its
/// own. A reload — even of an unchanged file — keeps it: a token issued
/// before is used after, once, and replayed. (Before, every reload drew a
/// new one: every issued token was `403 … fetch a new token`, and a client
/// that did so paid twice.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_random_token_secret_survives_a_reload() {
    let upstream = demo_upstream::start("127.0.0.1:0").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("records.db").display().to_string();
    let body = tokens_config(
        &db,
        upstream.addr,
        "5s",
        "15s",
        "retention = \"20s\"\nlease = \"8s\"",
    )
    .replace("secret = \"a-secret-for-this-test\"", "");
    let gw = instances::spawn("", &body, &[]);
    instances::wait_ready(&gw).await;
    let http = Http::http1();
    let issued = http.send("POST", &gw.url("/token"), &[], "").await;
    assert_eq!(issued.status, 201);
    let token = issued.json()["token"].as_str().unwrap().to_owned();
    reload_counted(&http, &gw, APPLIED).await;
    let pay = async || {
        http.send(
            "POST",
            &gw.url("/actions/pay"),
            &[("idempotency-token", token.as_str())],
            "{\"amount\":1}",
        )
        .await
    };
    let first = pay().await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let again = pay().await;
    assert_eq!(again.status, 201);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(executions_at(&upstream, "pay"), 1);
}

/// `/metrics` is open to all: the configuration fingerprint it publishes
/// leaves every secret out, so a reload that only rotates the admin token
/// and the token secret leaves it as it was, and nothing on the page can
/// be used to guess a secret offline. (Before, it was a hash of the whole
/// file, secrets included.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_published_fingerprint_leaves_secrets_out() {
    let upstream = demo_upstream::start("127.0.0.1:0").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("records.db").display().to_string();
    let body = tokens_config(
        &db,
        upstream.addr,
        "5s",
        "15s",
        "retention = \"20s\"\nlease = \"8s\"",
    );
    let gw = instances::spawn("admin_token = \"adm-short\"", &body, &[]);
    instances::wait_ready(&gw).await;
    let http = Http::http1();
    let info = async || {
        let text =
            String::from_utf8_lossy(&http.get(&gw.admin_url("/metrics")).await.body).into_owned();
        assert!(!text.contains("adm-short") && !text.contains("a-secret-for-this-test"));
        text.lines()
            .find(|l| l.starts_with("idemgate_config_info"))
            .unwrap()
            .to_owned()
    };
    let before = info().await;
    gw.rewrite(
        "admin_token = \"adm-other\"",
        &body.replace("a-secret-for-this-test", "another-secret-now"),
    );
    reload_counted(&http, &gw, APPLIED).await;
    assert_eq!(info().await, before, "secrets move nothing");
    gw.rewrite(
        "admin_token = \"adm-other\"",
        &body.replace("\"5s\"", "\"6s\""),
    );
    reload_counted(&http, &gw, APPLIED).await;
    assert_ne!(info().await, before, "everything else does");
}

/// Two gateways on one Postgres schema with a key route `pay` and a token
/// route `checkout`, their upstream taking `delay` per request.
fn scoped_config(db: &str, upstream: std::net::SocketAddr, identity: &str, pay: &str) -> String {
    format!(
        r#"
        [store]
        database_url = "{db}"
        lease = "8s"

        [tokens]
        secret = "a-secret-for-this-test"

        [identity]
        header = "{identity}"

        [[upstreams]]
        name = "demo"
        url = "http://{upstream}"
        timeout = "5s"

        [[routes]]
        {pay}
        methods = ["POST"]
        path_prefix = "/actions/"
        upstream = "demo"
        idempotency = "key"

        [[routes]]
        name = "checkout"
        methods = ["POST"]
        path = "/checkout"
        upstream = "demo"
        idempotency = "token"
        "#
    )
}

/// Records keep their identity across reloads of two running instances
/// with a claim live on one of them. A rename without `id` and a switch of
/// the identity header (as check-config advises for a raw credential)
/// would each put the live and retained records out of reach — a second
/// copy beside the running one, the answered request executed again: each
/// is refused on both instances, naming the route and the count, and the
/// running configuration goes on replaying. A rename that keeps `id` is
/// applied: the running request completes, and its retry on the other
/// instance replays it. (Before, every one of them was applied silently.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_never_moves_live_records_to_another_scope() {
    let test = "a_reload_never_moves_live_records_to_another_scope";
    let Some(db) = support::services::shared_sql(test).await else {
        return;
    };
    let upstream = demo_upstream::start("127.0.0.1:0").await.unwrap();
    let named = |id: &str| format!("name = \"pay\"{id}");
    let first = scoped_config(&db, upstream.addr, "X-User-Id", &named(""));
    let gateways = instances::start(2, "", &first).await;
    let http = Http::http1();
    let pay = |on: &Instance, key: &'static str, extra: &'static [(&'static str, &'static str)]| {
        let (http, url) = (http.clone(), on.url("/actions/pay"));
        async move {
            let mut headers = vec![("idempotency-key", key), ("x-user-id", "alice")];
            headers.extend_from_slice(extra);
            http.send("POST", &url, &headers, "{\"amount\":100}").await
        }
    };
    let answered = pay(&gateways[0], "done-1", &[]).await;
    assert_eq!(answered.status, 201);
    // A claim live on the first instance while the reloads come.
    let running = tokio::spawn(pay(&gateways[0], "live-1", &[("x-demo-delay-ms", "2500")]));
    support::reached(&upstream, 2).await;

    let renamed = scoped_config(&db, upstream.addr, "X-User-Id", "name = \"payments\"");
    let reidentified = scoped_config(&db, upstream.addr, "Authorization", &named(""));
    for refused in [&renamed, &reidentified] {
        for gw in &gateways {
            gw.rewrite("", refused);
            reload_counted(&http, gw, REFUSED).await;
            let log = instances::log_of(gw);
            assert!(
                log.contains(r#"\"pay\""#) && log.contains("2 live or retained record(s)"),
                "{log}"
            );
        }
    }
    // Still the running configuration: the retry on the other instance is
    // told the first is in flight, the answered one replays.
    let during = pay(&gateways[1], "live-1", &[]).await;
    assert_eq!(during.status, 409, "{:?}", during.body);
    let replayed = pay(&gateways[1], "done-1", &[]).await;
    assert_eq!(replayed.header("idempotent-replayed"), Some("true"));

    // A rename that keeps the records' identity.
    let kept = scoped_config(
        &db,
        upstream.addr,
        "X-User-Id",
        "name = \"payments\"\nid = \"pay\"",
    );
    for gw in &gateways {
        gw.rewrite("", &kept);
        reload_counted(&http, gw, APPLIED).await;
    }
    assert_eq!(running.await.unwrap().status, 201);
    for (key, gw) in [("live-1", &gateways[1]), ("done-1", &gateways[0])] {
        let retry = pay(gw, key, &[]).await;
        assert_eq!(retry.status, 201);
        assert_eq!(retry.header("idempotent-replayed"), Some("true"), "{key}");
    }
    assert_eq!(executions_at(&upstream, "pay"), 2, "each request once");
    assert_eq!(upstream.state.stats().peak_copies, 1);
}

/// The same refusal at start-up: a gateway restarted with its key route
/// renamed (no `id`) while the route's records are retained does not
/// serve; it exits naming the route and the count. Restarted with the
/// old name, it replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_that_would_orphan_records_does_not_serve() {
    let upstream = demo_upstream::start("127.0.0.1:0").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}/records.db", dir.path().display());
    let first = scoped_config(&db, upstream.addr, "X-User-Id", "name = \"pay\"");
    let gw = instances::spawn("", &first, &[]);
    instances::wait_ready(&gw).await;
    let http = Http::http1();
    let headers = [("idempotency-key", "k-1"), ("x-user-id", "bob")];
    let answered = http
        .send("POST", &gw.url("/actions/pay"), &headers, "{}")
        .await;
    assert_eq!(answered.status, 201);
    drop(gw);

    let renamed = scoped_config(&db, upstream.addr, "X-User-Id", "name = \"payments\"");
    let mut gw = instances::spawn("", &renamed, &[]);
    let exited = eventually(Duration::from_secs(10), || {
        let done = gw.exited().is_some();
        async move { done }
    })
    .await;
    assert!(exited, "it served: {}", instances::log_of(&gw));
    assert!(!gw.exited().unwrap().success());
    let log = instances::log_of(&gw);
    assert!(
        log.contains("\"pay\"") && log.contains("1 live or retained record(s)"),
        "{log}"
    );
    drop(gw);

    let gw = instances::spawn("", &first, &[]);
    instances::wait_ready(&gw).await;
    let again = http
        .send("POST", &gw.url("/actions/pay"), &headers, "{}")
        .await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(executions_at(&upstream, "pay"), 1);
}
