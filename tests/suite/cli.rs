//! The `idemgate` binary: check-config exit codes and SIGTERM draining.

use crate::support;

use std::io::Write;
use std::process::{Command, Stdio};

fn idemgate() -> Command {
    Command::new(env!("CARGO_BIN_EXE_idemgate"))
}

fn write_config(text: &str) -> tempfile::NamedTempFile {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(text.as_bytes()).unwrap();
    file
}

#[test]
fn check_config_prints_the_route_table_of_the_shipped_config() {
    let out = idemgate()
        .args(["check-config", "--config", "config/idemgate.toml"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("ROUTE"), "{stdout}");
    assert!(stdout.contains("read-orders"), "{stdout}");
}

#[test]
fn check_config_reports_every_problem_and_exits_2() {
    let file = write_config(
        r#"
        [server]
        max_captured_bytes = 1024
        [store]
        retention = "a while"
        [[upstreams]]
        name = "orders"
        url = "ftp://x"
        [[routes]]
        name = "a"
        path = "/a"
        upstream = "ghost"
        [[routes]]
        name = "b"
        path_prefix = "/"
        upstream = "orders"
        "#,
    );
    let out = idemgate()
        .args(["check-config", "--config"])
        .arg(file.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    for expected in [
        "store.retention",
        "upstreams[0].url",
        "routes[0].upstream",
        "routes[1]",
        "overlaps",
        "server.max_captured_bytes",
        &file.path().display().to_string(),
    ] {
        assert!(
            stderr.contains(expected),
            "missing {expected:?} in:\n{stderr}"
        );
    }
}

/// Durations each fine alone but together unsafe are refused by
/// `check-config` and by `serve`, naming both keys.
#[test]
fn unsafe_timing_is_refused_naming_both_keys() {
    let file = write_config(
        r#"
        [store]
        retention = "5m"
        lease = "5s"
        [tokens]
        ttl = "10m"
        [[upstreams]]
        name = "orders"
        url = "http://127.0.0.1:9"
        timeout = "10s"
        [[routes]]
        name = "checkout"
        path = "/checkout"
        upstream = "orders"
        idempotency = "token"
        "#,
    );
    for command in ["check-config", "serve"] {
        let out = idemgate()
            .args([command, "--config"])
            .arg(file.path())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{command}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        for expected in [
            "store.retention",
            "tokens.ttl",
            "store.lease",
            "upstreams[0].timeout",
            "store.timeout",
        ] {
            assert!(
                stderr.contains(expected),
                "{command}: missing {expected:?} in:\n{stderr}"
            );
        }
    }
}

#[test]
fn unknown_keys_are_refused_with_the_key_name() {
    let file = write_config("[server]\nlisten = \"127.0.0.1:1\"\nport = 3\n");
    let out = idemgate()
        .args(["check-config", "--config"])
        .arg(file.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("port"));
}

#[tokio::test]
async fn sigterm_finishes_the_in_flight_request_then_exits() {
    let upstream = idemgate_demo_upstream::start("127.0.0.1:0").await.unwrap();
    let listen = format!("127.0.0.1:{}", support::dead_port());
    let db = tempfile::tempdir().unwrap();
    let file = write_config(&format!(
        r#"
        [server]
        listen = "{listen}"
        admin_listen = "127.0.0.1:0"
        [store]
        database_url = "sqlite://{}/records.db"
        [[upstreams]]
        name = "demo"
        url = "http://{}"
        [[routes]]
        name = "all"
        path_prefix = "/"
        upstream = "demo"
        "#,
        db.path().display(),
        upstream.addr
    ));
    let mut child = idemgate()
        .args(["serve", "--config"])
        .arg(file.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let http = support::Http::default();
    let url = format!("http://{listen}/actions/slow");
    support::wait_up(&http, &format!("http://{listen}/echo")).await;
    let slow = tokio::spawn({
        let http = http.clone();
        async move {
            http.send("POST", &url, &[("x-demo-delay-ms", "1000")], "")
                .await
        }
    });
    // wait_up's GET /echo was the first request the upstream saw.
    support::reached(&upstream, 2).await;
    let pid = child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let answer = slow.await.unwrap();
    assert_eq!(answer.status, 201);
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert!(status.success(), "exit status {status}");
    assert_eq!(upstream.state.executions("slow", "-"), 1);
    upstream.shutdown().await;
}

#[test]
fn docker_config_is_valid_too() {
    let out = idemgate()
        .args(["check-config", "--config", "config/docker.toml"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_callback_route_with_a_token_check_is_refused_with_the_reason() {
    let file = write_config(
        r#"
        [[upstreams]]
        name = "payments"
        url = "http://127.0.0.1:9001"
        [[routes]]
        name = "pay-notify"
        methods = ["POST"]
        path = "/callbacks/payment"
        upstream = "payments"
        kind = "callback"
        idempotency = "token"
        business_key = ["json:/trade_no"]
        "#,
    );
    for command in ["check-config", "serve"] {
        let out = idemgate()
            .args([command, "--config"])
            .arg(file.path())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{command}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("routes[0].idempotency"), "{stderr}");
        assert!(stderr.contains("pay-notify"), "{stderr}");
        assert!(stderr.contains("never carry"), "{stderr}");
    }
}

/// `check-config` on `text`: the exit code, stdout and stderr.
fn check_config(text: &str) -> (Option<i32>, String, String) {
    let file = write_config(text);
    let out = idemgate()
        .args(["check-config", "--config"])
        .arg(file.path())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn check_config_refuses_a_zero_body_read_timeout() {
    let (code, _, stderr) = check_config(
        r#"
        [server]
        body_read_timeout = "0s"
        [[upstreams]]
        name = "orders"
        url = "http://127.0.0.1:9001"
        [[routes]]
        name = "all"
        path_prefix = "/"
        upstream = "orders"
        "#,
    );
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("server.body_read_timeout"), "{stderr}");
    assert!(stderr.contains("\"0s\""), "{stderr}");
}

#[test]
fn check_config_refuses_a_header_business_key_on_a_signed_callback_route() {
    let (code, _, stderr) = check_config(
        r#"
        [[upstreams]]
        name = "payments"
        url = "http://127.0.0.1:9001"
        [[routes]]
        name = "pay-notify"
        methods = ["POST"]
        path = "/callbacks/payment"
        upstream = "payments"
        kind = "callback"
        business_key = ["header:X-Msg-Id"]
        [routes.signature]
        scheme = "stripe"
        secrets = ["whsec_test"]
        "#,
    );
    assert_eq!(code, Some(2), "{stderr}");
    for expected in [
        "routes[0].business_key",
        "pay-notify",
        "header:X-Msg-Id",
        "body only",
    ] {
        assert!(
            stderr.contains(expected),
            "missing {expected:?} in:\n{stderr}"
        );
    }
}

#[test]
fn check_config_warns_about_an_hmac_sha256_callback_route_and_exits_0() {
    let (code, stdout, stderr) = check_config(
        r#"
        [[upstreams]]
        name = "payments"
        url = "http://127.0.0.1:9001"
        [[routes]]
        name = "pay-notify"
        methods = ["POST"]
        path = "/callbacks/payment"
        upstream = "payments"
        kind = "callback"
        business_key = ["json:/trade_no"]
        [routes.signature]
        scheme = "hmac-sha256"
        header = "X-Signature"
        secrets = ["k"]
        "#,
    );
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("ok: 1 route(s)"), "{stdout}");
    let warning = stderr
        .lines()
        .find(|l| l.starts_with("warning: routes[0].signature.scheme"))
        .unwrap_or_else(|| panic!("no warning in:\n{stderr}"));
    for expected in ["pay-notify", "hmac-sha256", "timestamp", "retention"] {
        assert!(
            warning.contains(expected),
            "missing {expected:?} in {warning}"
        );
    }
}

#[test]
fn check_config_prints_no_warning_for_the_shipped_configs_but_the_identity_advice() {
    for path in ["config/idemgate.toml", "config/docker.toml"] {
        let out = idemgate()
            .args(["check-config", "--config", path])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{path}: {stderr}");
        // The shipped configs scope by the raw Authorization (safe without
        // an auth proxy in front); check-config says what to use instead.
        let warnings: Vec<_> = stderr
            .lines()
            .filter(|l| l.starts_with("warning:"))
            .collect();
        assert!(!warnings.is_empty(), "{path}: {stderr}");
        for w in warnings {
            assert!(
                w.contains("(identity.header)") && w.contains("X-User-Id"),
                "{path}: {w}"
            );
        }
    }
}

#[test]
fn check_config_shows_each_listener_and_upstream_scheme_and_protocol() {
    let (code, stdout, stderr) = check_config(
        r#"
        [server]
        listen = "127.0.0.1:8443"
        http2 = false
        worker_threads = 2
        [[upstreams]]
        name = "orders"
        url = "http://127.0.0.1:9001"
        http2 = true
        [[upstreams]]
        name = "payments"
        url = "https://localhost:9443"
        [[upstreams]]
        name = "stock"
        url = "http://127.0.0.1:9002"
        max_connections = 10
        uncertain_statuses = [502, 500]
        [[routes]]
        name = "stock"
        path_prefix = "/stock/"
        upstream = "stock"
        [[routes]]
        name = "all"
        path_prefix = "/orders/"
        upstream = "orders"
        [[routes]]
        name = "pay"
        path = "/pay"
        methods = ["POST"]
        upstream = "payments"
        "#,
    );
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    let line = |name: &str| {
        stdout
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} line in {stdout}"))
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(line("public"), "public 127.0.0.1:8443 http HTTP/1.1");
    assert_eq!(
        line("orders"),
        "orders http://127.0.0.1:9001 http h2c shared 10s / 10s 502,504 -"
    );
    assert_eq!(
        line("payments"),
        "payments https://localhost:9443 https HTTP/1.1 no cap 10s / 10s 502,504 system roots"
    );
    assert_eq!(
        line("stock"),
        "stock http://127.0.0.1:9002 http HTTP/1.1 5 per worker 10s / 10s 502,500 -"
    );
}

#[test]
fn check_config_prints_each_consumer_and_refuses_a_bad_message_key() {
    let (code, out, _) = check_config(
        r#"
        [[upstreams]]
        name = "coupons"
        url = "http://127.0.0.1:9001"
        [[consumers]]
        name = "coupon-events"
        source = "amqp://guest:secret@127.0.0.1:5672/%2f"
        queue = "coupon.deduct"
        upstream = "coupons"
        path = "/mq/coupons"
        "#,
    );
    assert_eq!(code, Some(0), "{out}");
    let line = out
        .lines()
        .find(|l| l.starts_with("coupon-events"))
        .unwrap_or_else(|| panic!("no consumer line in {out}"));
    for part in [
        "rabbitmq",
        "coupon.deduct",
        "/mq/coupons",
        "msg:message_id+msg:topic",
    ] {
        assert!(line.contains(part), "{part} not in {line}");
    }
    assert!(
        !out.contains("secret"),
        "the broker password was printed: {out}"
    );
    let (code, _, err) = check_config(
        r#"
        [[upstreams]]
        name = "coupons"
        url = "http://127.0.0.1:9001"
        [[consumers]]
        name = "coupon-events"
        source = "nats://127.0.0.1:4222"
        stream = "COUPONS"
        upstream = "coupons"
        path = "/mq/coupons"
        business_key = ["query:id"]
        "#,
    );
    assert_eq!(code, Some(2));
    assert!(err.contains("consumers[0].business_key"), "{err}");
}

/// The problem catalogue in docs/problems.md lists every reason the code
/// can answer, with the status it is answered with, and no other.
#[test]
fn the_problem_catalogue_lists_every_reason_with_its_status() {
    use idemgate_core::error::Reason;
    let catalogue =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/problems.md")).unwrap();
    let rows: Vec<(u16, String)> = catalogue
        .lines()
        .filter_map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let status = cells.get(1)?.parse().ok()?;
            let slug = cells.get(2)?.trim_matches('`').to_owned();
            Some((status, slug))
        })
        .collect();
    for reason in Reason::ALL {
        assert!(
            rows.contains(&(reason.status().as_u16(), reason.slug().to_owned())),
            "docs/problems.md has no row `| {} | `{}` |`",
            reason.status().as_u16(),
            reason.slug()
        );
    }
    for (status, slug) in &rows {
        assert!(
            Reason::ALL.iter().any(|r| r.slug() == slug),
            "docs/problems.md lists {status} {slug}, which the code never answers"
        );
    }
}

/// "Durable" is a property of the store, checked: a database that dies
/// with the process is refused by `check-config` and `serve`, in each of
/// its spellings, naming the key — after a restart every retry would
/// execute again. (Before, `sqlite::memory:` passed and served.)
#[test]
fn an_in_memory_store_is_refused_by_check_config_and_serve() {
    for url in [
        "sqlite::memory:",
        "sqlite://:memory:",
        "sqlite://records.db?mode=memory",
        "sqlite://records.db?cache=shared&mode=memory",
    ] {
        let file = write_config(&format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
             [store]\ndatabase_url = \"{url}\"\n"
        ));
        for command in ["check-config", "serve"] {
            let out = idemgate()
                .args([command, "--config"])
                .arg(file.path())
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{url} {command}: {stderr}");
            assert!(
                stderr.contains("store.database_url") && stderr.contains("in-memory"),
                "{url} {command}: {stderr}"
            );
        }
    }
}

/// The `environment:` map of one service of `docker-compose.yml`. The file
/// is plain block YAML (two-space indents, `KEY: "value"` pairs), read
/// line by line: no YAML library for one map.
fn compose_environment(service: &str) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docker-compose.yml"))
        .unwrap();
    let mut in_service = false;
    let mut in_environment = false;
    let mut vars = Vec::new();
    for line in text.lines() {
        let indent = line.len() - line.trim_start().len();
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        if indent == 2 {
            in_service = trimmed == format!("{service}:");
            in_environment = false;
        } else if in_service && indent == 4 {
            in_environment = trimmed == "environment:";
        } else if in_service && in_environment && indent == 6 {
            let (key, value) = trimmed.split_once(':').expect("KEY: value");
            vars.push((
                key.trim().to_owned(),
                value.trim().trim_matches('"').to_owned(),
            ));
        }
    }
    vars
}

/// What `docker compose up` would start is checked: the gateway service's
/// environment from `docker-compose.yml`, over the config file it mounts
/// (`config/docker.toml`), passes `check-config`. (Before, it set a public
/// admin listener without a token: the gateway it started refused to run.)
#[test]
fn the_compose_files_gateway_passes_check_config() {
    let environment = compose_environment("idemgate");
    let names: Vec<&str> = environment.iter().map(|(k, _)| k.as_str()).collect();
    for expected in [
        "IDEMGATE_ADMIN_LISTEN",
        "IDEMGATE_DATABASE_URL",
        "IDEMGATE_ADMIN_TOKEN",
    ] {
        assert!(names.contains(&expected), "{expected} not in {names:?}");
    }
    let mut command = idemgate();
    command.args(["check-config", "--config", "config/docker.toml"]);
    for (key, value) in &environment {
        command.env(key, value);
    }
    let out = command.output().unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Without the token, the public admin listener is refused by name.
    let mut command = idemgate();
    command.args(["check-config", "--config", "config/docker.toml"]);
    for (key, value) in environment
        .iter()
        .filter(|(k, _)| k != "IDEMGATE_ADMIN_TOKEN")
    {
        command.env(key, value);
    }
    let out = command.output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("server.admin_token"));
}

/// The same for the gateway of the compose file's `mysql` profile
/// (`docker compose --profile mysql up idemgate-mysql`): its `mysql://`
/// URL, without Redis, over `config/docker.toml`, passes `check-config`,
/// which reads the URL and never connects.
#[test]
fn the_compose_files_mysql_gateway_passes_check_config() {
    let environment = compose_environment("idemgate-mysql");
    let value = |name: &str| {
        environment
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    assert!(
        value("IDEMGATE_DATABASE_URL").is_some_and(|url| url.starts_with("mysql://")),
        "{environment:?}"
    );
    assert!(value("IDEMGATE_ADMIN_TOKEN").is_some(), "{environment:?}");
    assert_eq!(value("IDEMGATE_REDIS_URL"), None, "{environment:?}");
    let mut command = idemgate();
    command
        .args(["check-config", "--config", "config/docker.toml"])
        .env_remove("IDEMGATE_REDIS_URL");
    for (key, value) in &environment {
        command.env(key, value);
    }
    let out = command.output().unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// What a section of the file needs besides the key under test, to parse.
fn section_context(section: &str) -> Option<&'static str> {
    Some(match section {
        "[server]" | "[store]" | "[tokens]" | "[identity]" | "[telemetry]" | "[server.cors]" => "",
        "[identity.jwt]" => "",
        "[[upstreams]]" => "name = \"o\"\nurl = \"http://127.0.0.1:9001\"",
        "[[routes]]" => "name = \"r\"\npath = \"/r\"\nupstream = \"o\"",
        "[[consumers]]" => {
            "name = \"c\"\nsource = \"amqp://127.0.0.1:5672/%2f\"\nupstream = \"o\"\npath = \"/p\""
        }
        _ => return None,
    })
}

/// A cell's default as TOML: its first `literal`, quoted unless it is a
/// number, a boolean, an array or already a string.
fn toml_literal(cell: &str) -> Option<String> {
    let rest = cell.trim().strip_prefix('`')?;
    let literal = &rest[..rest.find('`')?];
    // `<queue>.dlq`: made from another key, not one literal.
    if literal.contains('<') {
        return None;
    }
    let bare = literal.parse::<i64>().is_ok()
        || ["true", "false"].contains(&literal)
        || literal.starts_with('[')
        || literal.starts_with('"');
    Some(if bare {
        literal.to_owned()
    } else {
        format!("{literal:?}")
    })
}

/// The defaults column of docs/configuration.md says what the code does:
/// for every key whose documented default is one literal, a file that sets
/// the key to it reads exactly as one that leaves it out.
#[test]
fn the_documented_defaults_are_the_codes() {
    let page = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/configuration.md"
    ))
    .unwrap();
    let mut section = String::new();
    let mut checked = 0;
    for line in page.lines() {
        if let Some(heading) = line.strip_prefix("## ") {
            section = heading.trim().to_owned();
            continue;
        }
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 4 || !cells[1].starts_with('`') {
            continue;
        }
        let key = cells[1].trim_matches('`');
        let Some(context) = section_context(&section) else {
            continue;
        };
        let Some(literal) = toml_literal(cells[2]) else {
            continue;
        };
        let base = |extra: &str| {
            let upstream = if section == "[[routes]]" || section == "[[consumers]]" {
                "[[upstreams]]\nname = \"o\"\nurl = \"http://127.0.0.1:9001\"\n"
            } else {
                ""
            };
            format!("{upstream}{section}\n{context}\n{extra}\n")
        };
        let without = idemgate_gateway::config::Config::parse(&base(""), "docs")
            .unwrap_or_else(|e| panic!("{section}: {e}"));
        let with =
            idemgate_gateway::config::Config::parse(&base(&format!("{key} = {literal}")), "docs")
                .unwrap_or_else(|e| panic!("{section} {key} = {literal}: {e}"));
        assert_eq!(
            format!("{without:?}"),
            format!("{with:?}"),
            "docs/configuration.md says {section} {key} defaults to {literal}; the code's default differs"
        );
        checked += 1;
    }
    assert!(
        checked >= 40,
        "only {checked} defaults checked: did the page's tables change shape?"
    );
}

/// `check-config` says whether the database's commits survive a failover
/// when it can reach it, and with `store.require_synchronous` a database
/// that does not confirm it fails the check (exit 1), as `serve` would
/// refuse to start. SQLite is never opened for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_says_whether_a_commit_survives_a_failover() {
    let check = |database_url: &str, strict: bool| {
        let file = write_config(&format!(
            r#"
            [store]
            database_url = "{database_url}"
            require_synchronous = {strict}
            [[upstreams]]
            name = "orders"
            url = "http://127.0.0.1:9"
            "#
        ));
        let out = idemgate()
            .args(["check-config", "--config"])
            .arg(file.path())
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let dir = tempfile::tempdir().unwrap();
    let sqlite = format!("sqlite://{}/never.db", dir.path().display());
    let (code, stdout, _) = check(&sqlite, false);
    assert_eq!(code, Some(0));
    assert!(
        stdout.contains("store commits: unconfirmed: SQLite"),
        "{stdout}"
    );
    assert!(
        !dir.path().join("never.db").exists(),
        "check-config created the file"
    );
    let (code, _, stderr) = check(&sqlite, true);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("require_synchronous"), "{stderr}");

    let Some(db) = support::services::shared_sql("check_config_says_whether_a_commit").await else {
        return;
    };
    let (code, stdout, stderr) = check(&db, false);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("store commits: unconfirmed"), "{stdout}");
    let (code, _, stderr) = check(&db, true);
    assert_eq!(code, Some(1), "{stderr}");
    // A database that does not answer: said, and not a failure.
    let gone = format!(
        "postgres://postgres@127.0.0.1:{}/test",
        support::dead_port()
    );
    let (code, stdout, stderr) = check(&gone, true);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("store commits: not checked"), "{stdout}");
}
