//! One-time tokens end to end (docs/semantics.md, "Token routes").

use crate::support;

use std::time::Duration;

use support::{Answer, Stack};

const ROUTES: &str = r#"
    [[routes]]
    name = "create-order"
    methods = ["POST"]
    path_prefix = "/actions/"
    upstream = "demo"
    idempotency = "token"

    [[routes]]
    name = "other-token-route"
    methods = ["PUT"]
    path_prefix = "/actions/"
    upstream = "demo"
    idempotency = "token"
"#;

async fn token(stack: &Stack, method: &str, query: &str, identity: Option<&str>) -> Answer {
    let headers: Vec<(&str, &str)> = identity.map(|i| ("authorization", i)).into_iter().collect();
    stack
        .http
        .send(method, &stack.url(&format!("/token{query}")), &headers, "")
        .await
}

async fn fetch(stack: &Stack, query: &str) -> String {
    let a = token(stack, "POST", query, None).await;
    assert_eq!(a.status, 201);
    a.json()["token"].as_str().unwrap().to_owned()
}

async fn use_token(
    stack: &Stack,
    path: &str,
    token: &str,
    body: &str,
    extra: &[(&str, &str)],
) -> Answer {
    let mut headers = vec![("idempotency-token", token)];
    headers.extend_from_slice(extra);
    stack
        .http
        .send("POST", &stack.url(path), &headers, body.to_owned())
        .await
}

#[tokio::test]
async fn token_endpoint_issues_self_verifying_tokens() {
    let stack = Stack::start(ROUTES).await;
    for method in ["POST", "GET"] {
        let a = token(&stack, method, "", None).await;
        assert_eq!(a.status, 201, "{method}");
        assert_eq!(a.header("cache-control"), Some("no-store"));
        let v = a.json();
        assert!(v["token"].as_str().unwrap().starts_with("v1."));
        assert_eq!(v["ttl_seconds"], 600);
        let expires = v["expires_at"].as_str().unwrap();
        assert!(expires.ends_with('Z') && expires.contains('T'), "{expires}");
    }
    let a = token(&stack, "POST", "?route=create-order", None).await;
    assert_eq!(a.status, 201);
    let a = token(&stack, "POST", "?route=nope", None).await;
    assert_eq!(a.status, 400);
    assert_eq!(a.problem_type(), "urn:idemgate:problem:unknown-token-route");
    let a = token(&stack, "DELETE", "", None).await;
    assert_eq!(a.status, 405);
    // Issuing writes nothing.
    assert_eq!(stack.gateway.store.sql().records().await.unwrap(), 0);
    stack.shutdown().await;
}

#[tokio::test]
async fn first_use_claims_repeat_replays_other_body_is_422() {
    let stack = Stack::start(ROUTES).await;
    let t = fetch(&stack, "?route=create-order").await;
    let first = use_token(&stack, "/actions/order", &t, "{\"item\":1}", &[]).await;
    assert_eq!(first.status, 201);
    // The token never reaches the upstream; the stable key does.
    let forwarded = first.json()["key"].as_str().unwrap().to_owned();
    assert!(forwarded.starts_with("ig-"));
    let again = use_token(&stack, "/actions/order", &t, "{\"item\":1}", &[]).await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
    let other = use_token(&stack, "/actions/order", &t, "{\"item\":2}", &[]).await;
    assert_eq!(other.status, 422);
    assert_eq!(stack.upstream.state.executions("order", &forwarded), 1);
    support::assert_same_expiry(&[&first, &again, &other], Duration::from_secs(86_400));
    stack.shutdown().await;
}

#[tokio::test]
async fn missing_forged_altered_foreign_and_misrouted_tokens_are_refused_without_the_store() {
    let stack = Stack::start(ROUTES).await;
    let a = stack
        .http
        .send("POST", &stack.url("/actions/o"), &[], "{}")
        .await;
    assert_eq!(a.status, 400);
    assert_eq!(
        a.problem_type(),
        "urn:idemgate:problem:idempotency-token-missing"
    );

    let good = fetch(&stack, "?route=create-order").await;
    let mut altered: Vec<u8> = good.clone().into_bytes();
    altered[6] = if altered[6] == b'A' { b'B' } else { b'A' };
    let altered = String::from_utf8(altered).unwrap();
    let alices = token(&stack, "POST", "", Some("Bearer alice")).await.json()["token"]
        .as_str()
        .unwrap()
        .to_owned();
    let for_put = fetch(&stack, "?route=other-token-route").await;
    let cases = [
        ("forged", "v1.AAAA.BBBB".to_owned()),
        ("truncated", good[..good.len() - 4].to_owned()),
        ("altered", altered),
        ("garbage", "not a token".to_owned()),
        ("another client's", alices),
        ("another route's", for_put),
    ];
    for (what, t) in cases {
        let a = use_token(&stack, "/actions/o", &t, "{}", &[]).await;
        assert_eq!(a.status, 403, "{what}");
        assert_eq!(
            a.problem_type(),
            "urn:idemgate:problem:idempotency-token-invalid",
            "{what}"
        );
    }
    assert_eq!(stack.upstream.state.stats().requests, 0);
    assert_eq!(stack.gateway.store.sql().records().await.unwrap(), 0);
    stack.shutdown().await;
}

#[tokio::test]
async fn a_token_in_flight_is_409() {
    let stack = Stack::start(ROUTES).await;
    let t = fetch(&stack, "").await;
    let url = stack.url("/actions/slow");
    let http = stack.http.clone();
    let t2 = t.clone();
    let first = tokio::spawn(async move {
        http.send(
            "POST",
            &url,
            &[
                ("idempotency-token", t2.as_str()),
                ("x-demo-delay-ms", "500"),
            ],
            "{}",
        )
        .await
    });
    support::reached(&stack.upstream, 1).await;
    let dup = use_token(
        &stack,
        "/actions/slow",
        &t,
        "{}",
        &[("x-demo-delay-ms", "500")],
    )
    .await;
    assert_eq!(dup.status, 409);
    assert!(dup.header("retry-after").is_some());
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    support::assert_same_expiry(&[&first, &dup], Duration::from_secs(86_400));
    stack.shutdown().await;
}

#[tokio::test]
async fn expired_tokens_are_refused_but_a_used_one_keeps_replaying() {
    let stack = Stack::start_with(ROUTES, |c| c.tokens.ttl = "1s".into()).await;
    let used = fetch(&stack, "").await;
    let unused = fetch(&stack, "").await;
    let first = use_token(&stack, "/actions/order", &used, "{}", &[]).await;
    assert_eq!(first.status, 201);
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let a = use_token(&stack, "/actions/order", &unused, "{}", &[]).await;
    assert_eq!(a.status, 403);
    assert_eq!(
        a.problem_type(),
        "urn:idemgate:problem:idempotency-token-expired"
    );
    let replay = use_token(&stack, "/actions/order", &used, "{}", &[]).await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, first.body);
    // An expired token never claims: another body is refused, not run.
    let other = use_token(&stack, "/actions/order", &used, "{\"x\":2}", &[]).await;
    assert_eq!(other.status, 403);
    assert_eq!(stack.upstream.state.stats().total_executions, 1);
    stack.shutdown().await;
}

#[tokio::test]
async fn configured_secret_makes_tokens_work_across_instances() {
    let stack = Stack::start_with(ROUTES, |c| c.tokens.secret = "shared-secret".into()).await;
    let mut config = support::config(stack.upstream.addr, ROUTES);
    config.tokens.secret = "shared-secret".into();
    let second = idemgate_gateway::gateway::start_for_tests(config)
        .await
        .unwrap();
    let t = fetch(&stack, "").await;
    let a = stack
        .http
        .send(
            "POST",
            &format!("http://{}/actions/x", second.public_addr),
            &[("idempotency-token", t.as_str())],
            "{}",
        )
        .await;
    assert_eq!(a.status, 201);
    second.shutdown().await;
    stack.shutdown().await;
}
