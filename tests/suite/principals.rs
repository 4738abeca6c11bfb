//! Who is asking, and what counts as the same request (docs/semantics.md, rule 9):
//! principals, not credential bytes; every header value; callbacks by
//! business key; tokens for browsers (CORS, secret rotation, issue rate).
//! Real gateways over real HTTP/1.1 and HTTP/2 clients; executions counted
//! on the demo's `/actions/{name}`, which does not deduplicate.

use crate::support;

use std::time::Duration;

use base64::Engine as _;
use support::{Answer, Http, Stack, executions};

const SECRET: &str = "a-shared-hs256-secret-of-32-bytes!";

fn jwt(claims: serde_json::Value) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes()),
    )
    .unwrap()
}

fn now() -> i64 {
    idemgate_store::now_ms() / 1000
}

/// An access token for `sub`, issued `age` seconds ago (a refreshed one
/// differs in every byte after the header).
fn access_token(sub: &str, age: i64) -> String {
    jwt(
        serde_json::json!({"sub": sub, "iat": now() - age, "exp": now() - age + 300, "jti": uuid::Uuid::now_v7().to_string()}),
    )
}

const KEY_ROUTE: &str = r#"
    [[routes]]
    name = "act"
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
"#;

fn jwt_routes() -> String {
    format!(
        r#"
        [identity.jwt]
        hs256_secret = "{SECRET}"
        {KEY_ROUTE}
        "#
    )
}

async fn post(
    http: &Http,
    stack: &Stack,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    http.send("POST", &stack.url(path), headers, body.to_owned())
        .await
}

/// The client times out, refreshes its access token and retries: the same
/// principal, so the same record and the same forwarded key — one
/// execution. Over HTTP/1.1 and h2c.
#[tokio::test]
async fn a_retry_with_a_refreshed_jwt_executes_once() {
    let stack = Stack::start(&jwt_routes()).await;
    for (http, key) in [(Http::http1(), "r-1"), (Http::h2c(), "r-2")] {
        let first_token = format!("Bearer {}", access_token("alice", 200));
        let first = post(
            &http,
            &stack,
            "/actions/pay",
            &[("authorization", &first_token), ("idempotency-key", key)],
            "{}",
        )
        .await;
        assert_eq!(first.status, 201, "{:?}", first.body);
        let refreshed = format!("bearer {}", access_token("alice", 0));
        let retry = post(
            &http,
            &stack,
            "/actions/pay",
            &[("authorization", &refreshed), ("idempotency-key", key)],
            "{}",
        )
        .await;
        assert_eq!(retry.status, 201);
        assert_eq!(retry.header("idempotent-replayed"), Some("true"));
        assert_eq!(
            retry.json()["key"],
            first.json()["key"],
            "one forwarded key"
        );
    }
    assert_eq!(executions(&stack, "pay"), 2, "one per logical request");
    // Another principal with the same key is another client.
    let bob = format!("Bearer {}", access_token("bob", 0));
    let other = post(
        &stack.http,
        &stack,
        "/actions/pay",
        &[("authorization", &bob), ("idempotency-key", "r-1")],
        "{}",
    )
    .await;
    assert_eq!(other.status, 201);
    assert_eq!(other.header("idempotent-replayed"), None);
    assert_eq!(executions(&stack, "pay"), 3);
    stack.shutdown().await;
}

/// An invalid token is `401 identity-invalid`, never a fresh scope:
/// forged, expired, a wrong algorithm, no `sub`, not a Bearer token.
#[tokio::test]
async fn an_invalid_jwt_is_401_and_nothing_is_forwarded() {
    let stack = Stack::start(&jwt_routes()).await;
    let forged = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &serde_json::json!({"sub": "alice", "exp": now() + 300}),
        &jsonwebtoken::EncodingKey::from_secret(b"another secret, also 32 bytes long"),
    )
    .unwrap();
    let expired = jwt(serde_json::json!({"sub": "alice", "exp": now() - 3600}));
    let no_sub = jwt(serde_json::json!({"exp": now() + 300}));
    let unsigned = format!(
        "{}.{}.",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(r#"{"alg":"none","typ":"JWT"}"#),
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(format!(r#"{{"sub":"alice","exp":{}}}"#, now() + 300))
    );
    for credential in [
        format!("Bearer {forged}"),
        format!("Bearer {expired}"),
        format!("Bearer {no_sub}"),
        format!("Bearer {unsigned}"),
        "Basic YWxpY2U6cHc=".to_owned(),
    ] {
        let a = post(
            &stack.http,
            &stack,
            "/actions/pay",
            &[("authorization", &credential), ("idempotency-key", "bad")],
            "{}",
        )
        .await;
        assert_eq!(a.status, 401, "{credential}: {:?}", a.body);
        assert_eq!(a.problem_type(), "urn:idemgate:problem:identity-invalid");
        assert!(a.header("www-authenticate").unwrap().starts_with("Bearer"));
        let t = stack
            .http
            .send(
                "POST",
                &stack.url("/token"),
                &[("authorization", &credential)],
                "",
            )
            .await;
        assert_eq!(t.status, 401, "/token with {credential}");
    }
    assert_eq!(stack.upstream.state.stats().requests, 0);
    stack.shutdown().await;
}

/// A token route binds the principal: a token fetched with one access
/// token is used after the client refreshed it.
#[tokio::test]
async fn a_token_outlives_the_refresh_of_its_clients_credential() {
    let stack = Stack::start(&jwt_routes()).await;
    let before = format!("Bearer {}", access_token("alice", 200));
    let issued = stack
        .http
        .send(
            "POST",
            &stack.url("/token?route=checkout"),
            &[("authorization", &before)],
            "",
        )
        .await;
    assert_eq!(issued.status, 201);
    let token = issued.json()["token"].as_str().unwrap().to_owned();
    let after = format!("Bearer {}", access_token("alice", 0));
    for _ in 0..2 {
        let used = post(
            &stack.http,
            &stack,
            "/checkout",
            &[("authorization", &after), ("idempotency-token", &token)],
            "{}",
        )
        .await;
        assert_eq!(
            used.status, 404,
            "forwarded to the demo, which has no /checkout"
        );
    }
    assert_eq!(
        stack.upstream.state.stats().requests,
        1,
        "used once, then replayed"
    );
    // Another principal cannot use it.
    let bob = format!("Bearer {}", access_token("bob", 0));
    let stolen = post(
        &stack.http,
        &stack,
        "/checkout",
        &[("authorization", &bob), ("idempotency-token", &token)],
        "{}",
    )
    .await;
    assert_eq!(stolen.status, 403);
    stack.shutdown().await;
}

/// Without `[identity.jwt]`, the raw `Authorization` is still one client
/// however its scheme is cased.
#[tokio::test]
async fn an_authorization_scheme_is_case_insensitive() {
    let stack = Stack::start(KEY_ROUTE).await;
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let credential = format!("{scheme} same-token");
        let a = post(
            &stack.http,
            &stack,
            "/actions/pay",
            &[("authorization", &credential), ("idempotency-key", "case")],
            "{}",
        )
        .await;
        assert_eq!(a.status, 201);
    }
    assert_eq!(executions(&stack, "pay"), 1);
    stack.shutdown().await;
}

/// `identity.header = "Cookie"`: user B sends user A's key with B's own
/// session, the crumbs split (two HTTP/2 crumbs, or two HTTP/1.1 lines)
/// and the first crumb shared. B's order runs, and B never sees A's answer.
#[tokio::test]
async fn cookie_crumbs_and_repeated_lines_never_share_a_record() {
    let routes = format!("[identity]\nheader = \"Cookie\"\n{KEY_ROUTE}");
    let stack = Stack::start(&routes).await;
    for (http, key) in [(Http::h2c(), "c-h2"), (Http::http1(), "c-h1")] {
        let as_user = |session: &'static str| {
            let http = http.clone();
            let url = stack.url("/actions/order");
            async move {
                http.send(
                    "POST",
                    &url,
                    &[
                        ("cookie", "consent=yes"),
                        ("cookie", session),
                        ("idempotency-key", key),
                        ("x-demo-set-cookie", session),
                    ],
                    "{\"item\":\"book\"}",
                )
                .await
            }
        };
        let a = as_user("session=A").await;
        let b = as_user("session=B").await;
        assert_eq!((a.status.as_u16(), b.status.as_u16()), (201, 201));
        assert_eq!(
            b.header("idempotent-replayed"),
            None,
            "B got A's stored answer"
        );
        assert_ne!(a.json()["execution_id"], b.json()["execution_id"]);
        // The same crumbs in one line are the same client.
        let a_again = http
            .send(
                "POST",
                &stack.url("/actions/order"),
                &[
                    ("cookie", "consent=yes; session=A"),
                    ("idempotency-key", key),
                ],
                "{\"item\":\"book\"}",
            )
            .await;
        assert_eq!(a_again.header("idempotent-replayed"), Some("true"));
        assert_eq!(a_again.json()["execution_id"], a.json()["execution_id"]);
    }
    assert_eq!(
        executions(&stack, "order"),
        4,
        "each user's order ran, over each protocol"
    );
    stack.shutdown().await;
}

/// Any other identity header sent twice is ambiguous: refused, not scoped
/// by its first value.
#[tokio::test]
async fn a_principal_header_sent_twice_is_refused() {
    let routes = format!("[identity]\nheader = \"X-User-Id\"\n{KEY_ROUTE}");
    let stack = Stack::start(&routes).await;
    let a = post(
        &stack.http,
        &stack,
        "/actions/pay",
        &[
            ("x-user-id", "alice"),
            ("x-user-id", "mallory"),
            ("idempotency-key", "dup"),
        ],
        "{}",
    )
    .await;
    assert_eq!(a.status, 400);
    assert_eq!(a.problem_type(), "urn:idemgate:problem:identity-ambiguous");
    assert_eq!(stack.upstream.state.stats().requests, 0);
    stack.shutdown().await;
}

const NOTIFY: &str = r#"
    [[routes]]
    name = "notify"
    methods = ["POST"]
    path_prefix = "/actions/"
    upstream = "demo"
    kind = "callback"
    business_key = ["json:/trade_no"]
    must_match = ["json:/amount"]
"#;

fn notify(trade: &str, amount: u64, stamp: u64) -> String {
    format!(r#"{{"trade_no":"{trade}","amount":{amount},"notify_time":{stamp},"attempt":{stamp}}}"#)
}

async fn deliver(stack: &Stack, body: String, extra: &[(&str, &str)]) -> Answer {
    stack
        .http
        .send("POST", &stack.url("/actions/notify"), extra, body)
        .await
}

/// A provider re-stamps its redeliveries (`notify_time`, attempt): the
/// stored ack is replayed whatever else the body says; another amount for
/// the same trade is `422 business-key-reused` and never forwarded.
#[tokio::test]
async fn a_restamped_callback_replays_and_another_amount_is_refused() {
    let stack = Stack::start(NOTIFY).await;
    let first = deliver(&stack, notify("T-1", 100, 1), &[]).await;
    assert_eq!(first.status, 201);
    for stamp in 2..5 {
        let again = deliver(&stack, notify("T-1", 100, stamp), &[]).await;
        assert_eq!(again.status, 201, "{:?}", again.body);
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
    }
    let other = deliver(&stack, notify("T-1", 999, 5), &[]).await;
    assert_eq!(other.status, 422);
    assert_eq!(
        other.problem_type(),
        "urn:idemgate:problem:business-key-reused"
    );
    support::assert_same_expiry(&[&first, &other], Duration::from_secs(86_400));
    assert_eq!(executions(&stack, "notify"), 1);
    stack.shutdown().await;
}

/// The first delivery was lost before it executed (a 503): every
/// re-stamped retry used to be 422 forever. It is forwarded, once.
#[tokio::test]
async fn a_restamped_retry_of_a_lost_delivery_executes_once() {
    let stack = Stack::start(NOTIFY).await;
    let failed = deliver(
        &stack,
        notify("T-2", 100, 1),
        &[("x-demo-fail-status", "503")],
    )
    .await;
    assert_eq!(failed.status, 503);
    let retry = deliver(&stack, notify("T-2", 100, 2), &[]).await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    let again = deliver(&stack, notify("T-2", 100, 3), &[]).await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(executions(&stack, "notify"), 1);
    stack.shutdown().await;
}

/// An uncertain callback (committed, connection dropped) is taken over by
/// a re-stamped redelivery once its hold is over: the same business key.
#[tokio::test]
async fn an_uncertain_callback_is_taken_over_by_its_business_key() {
    let stack = Stack::start_with(NOTIFY, |c| {
        c.upstreams[0].uncertain_hold = Some("300ms".into());
    })
    .await;
    let lost = deliver(&stack, notify("T-3", 100, 1), &[("x-demo-drop", "after")]).await;
    assert_eq!(lost.status, 502);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let retry = deliver(&stack, notify("T-3", 100, 2), &[]).await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert_eq!(
        retry.header("idempotent-replayed"),
        None,
        "forwarded again, one at a time"
    );
    let again = deliver(&stack, notify("T-3", 100, 3), &[]).await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(executions(&stack, "notify"), 2);
    stack.shutdown().await;
}

/// On a `path_prefix` callback route the path is part of the key: one
/// provider's payment and refund notifications carry the same trade number
/// to two paths, and each is its own action — neither answers for the
/// other, and each redelivery replays its own.
#[tokio::test]
async fn a_prefix_callback_route_keys_each_path_apart() {
    let stack = Stack::start(NOTIFY).await;
    let (paid, refund) = (stack.url("/actions/notify"), stack.url("/actions/refund"));
    async fn send(stack: &Stack, url: &str, stamp: u64) -> Answer {
        let body = notify("T-6", 100, stamp);
        stack.http.send("POST", url, &[], body).await
    }
    assert_eq!(send(&stack, &paid, 1).await.status, 201);
    let first_refund = send(&stack, &refund, 1).await;
    assert_eq!(first_refund.status, 201, "{:?}", first_refund.body);
    assert_eq!(first_refund.header("idempotent-replayed"), None);
    for stamp in 2..4 {
        let replayed = |a: Answer| a.header("idempotent-replayed").map(str::to_owned);
        assert_eq!(
            replayed(send(&stack, &paid, stamp).await).as_deref(),
            Some("true")
        );
        assert_eq!(
            replayed(send(&stack, &refund, stamp).await).as_deref(),
            Some("true")
        );
    }
    assert_eq!(executions(&stack, "notify"), 1);
    assert_eq!(executions(&stack, "refund"), 1);
    stack.shutdown().await;
}

/// Past its retention, a callback's record is taken over by a redelivery
/// even with `store.tombstone` on: a provider retries for days and a `410`
/// is not an acknowledgement it understands. The delivery is forwarded
/// again with the same stable key, for the upstream's own state check.
#[tokio::test]
async fn an_expired_callback_is_forwarded_again_not_refused_by_its_tombstone() {
    let stack = Stack::start_with(NOTIFY, |c| {
        c.store.retention = Duration::from_secs(1).into();
        c.store.tombstone = Duration::from_secs(3600).into();
    })
    .await;
    assert_eq!(
        deliver(&stack, notify("T-5", 100, 1), &[]).await.status,
        201
    );
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let late = deliver(&stack, notify("T-5", 100, 2), &[]).await;
    assert_eq!(late.status, 201, "{:?}", late.body);
    assert_eq!(late.header("idempotent-replayed"), None);
    let again = deliver(&stack, notify("T-5", 100, 3), &[]).await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    let per_key = &stack.upstream.state.stats().executions["notify"];
    assert_eq!(per_key.len(), 1, "one stable key both times: {per_key:?}");
    assert_eq!(per_key.values().sum::<u64>(), 2);
    // A client's key route keeps its tombstone: that half is
    // tests/after_answer.rs's.
    stack.shutdown().await;
}

/// A record written before callbacks were identified by their business
/// key (its fingerprint the whole body's) still answers its exact
/// redelivery after an upgrade.
#[tokio::test]
async fn a_callback_recorded_by_its_body_still_replays() {
    use sha2::Digest;
    let stack = Stack::start(&NOTIFY.replace(
        r#"path_prefix = "/actions/""#,
        r#"path = "/actions/notify""#,
    ))
    .await;
    let body = notify("T-4", 100, 1);
    let mut hash = sha2::Sha256::new();
    hash.update(b"POST\0/actions/notify\0");
    hash.update(body.as_bytes());
    let whole = hex::encode(hash.finalize());
    let key = idemgate_store::RecordKey::new(idemgate::callback::ROUTE_SCOPE, "notify", "T-4");
    let store = &stack.gateway.store;
    let idemgate_store::Claim::Won {
        epoch,
        expires_at_ms,
        ..
    } = store.claim(&key, &whole, "old").await.unwrap()
    else {
        panic!()
    };
    let stored = idemgate_store::StoredResponse {
        status: 200,
        headers: vec![],
        trailers: Vec::new(),
        body: bytes::Bytes::from_static(b"acked by the old version"),
        body_kept: true,
        request_id: "old".into(),
    };
    assert!(
        store
            .complete(&key, epoch, &whole, &stored, expires_at_ms)
            .await
            .unwrap()
    );
    let again = deliver(&stack, body, &[]).await;
    assert_eq!(again.status, 200);
    assert_eq!(&again.body[..], b"acked by the old version");
    assert_eq!(stack.upstream.state.stats().requests, 0);
    stack.shutdown().await;
}

const CORS: &str = r#"
    [server.cors]
    allow_origins = ["https://shop.example"]
"#;

async fn preflight(stack: &Stack, path: &str, origin: &str) -> Answer {
    stack
        .http
        .send(
            "OPTIONS",
            &stack.url(path),
            &[
                ("origin", origin),
                ("access-control-request-method", "POST"),
                (
                    "access-control-request-headers",
                    "idempotency-token, content-type",
                ),
            ],
            "",
        )
        .await
}

/// Browsers on a listed origin: preflights answered by the gateway for
/// `/token` and every route, the idempotency headers allowed and the replay
/// headers exposed; an unlisted origin gets no CORS header; the upstream
/// never sees a preflight.
#[tokio::test]
async fn cors_preflights_are_answered_for_listed_origins_only() {
    let stack = Stack::start_with(KEY_ROUTE, |c| {
        let cors: idemgate_gateway::config::Config =
            idemgate_gateway::config::Config::parse(CORS, "t").unwrap();
        c.server.cors = cors.server.cors;
    })
    .await;
    for path in ["/token", "/actions/pay", "/checkout"] {
        let ok = preflight(&stack, path, "https://shop.example").await;
        assert_eq!(ok.status, 204, "{path}");
        assert_eq!(
            ok.header("access-control-allow-origin"),
            Some("https://shop.example")
        );
        let methods = ok.header("access-control-allow-methods").unwrap();
        assert!(methods.contains("POST"), "{methods}");
        let allowed = ok.header("access-control-allow-headers").unwrap();
        for h in ["idempotency-key", "idempotency-token", "content-type"] {
            assert!(allowed.contains(h), "{allowed}");
        }
        let denied = preflight(&stack, path, "https://evil.example").await;
        assert_eq!(denied.status, 204);
        let cors_headers: Vec<_> = denied
            .headers
            .keys()
            .filter(|k| k.as_str().starts_with("access-control-"))
            .collect();
        assert!(cors_headers.is_empty(), "{cors_headers:?}");
    }
    assert_eq!(
        stack.upstream.state.stats().requests,
        0,
        "no preflight reached it"
    );
    let from = |origin: &'static str| {
        let http = stack.http.clone();
        let url = stack.url("/actions/pay");
        async move {
            http.send(
                "POST",
                &url,
                &[("origin", origin), ("idempotency-key", "cors-1")],
                "{}",
            )
            .await
        }
    };
    let first = from("https://shop.example").await;
    let replay = from("https://shop.example").await;
    for a in [&first, &replay] {
        assert_eq!(
            a.header("access-control-allow-origin"),
            Some("https://shop.example")
        );
        let exposed = a.header("access-control-expose-headers").unwrap();
        for h in [
            "idempotent-replayed",
            "idempotency-expires",
            "retry-after",
            "x-request-id",
        ] {
            assert!(exposed.contains(h), "{exposed}");
        }
        assert!(a.headers.get_all("vary").iter().any(|v| v == "origin"));
    }
    let other = from("https://evil.example").await;
    assert_eq!(other.header("access-control-allow-origin"), None);
    assert_eq!(other.header("access-control-expose-headers"), None);
    stack.shutdown().await;
}

/// `tokens.secrets = ["new", "old"]`: a token signed before the rotation
/// still works; new tokens are signed with the new secret, which a gateway
/// that retired the old one still accepts.
#[tokio::test]
async fn a_rotated_token_secret_signs_with_the_first_and_verifies_with_any() {
    let with = |secrets: &'static [&'static str]| {
        move |c: &mut idemgate_gateway::config::Config| {
            c.tokens.secret = String::new();
            c.tokens.secrets = secrets.iter().map(|s| s.to_string()).collect();
        }
    };
    let before = Stack::start_with(KEY_ROUTE, with(&["old"])).await;
    let old_token = before
        .http
        .send("POST", &before.url("/token?route=checkout"), &[], "")
        .await
        .json()["token"]
        .as_str()
        .unwrap()
        .to_owned();
    before.shutdown().await;
    let rotated = Stack::start_with(KEY_ROUTE, with(&["new", "old"])).await;
    let used = rotated
        .http
        .send(
            "POST",
            &rotated.url("/checkout"),
            &[("idempotency-token", &old_token)],
            "{}",
        )
        .await;
    assert_eq!(used.status, 404, "accepted and forwarded: {:?}", used.body);
    let new_token = rotated
        .http
        .send("POST", &rotated.url("/token?route=checkout"), &[], "")
        .await
        .json()["token"]
        .as_str()
        .unwrap()
        .to_owned();
    rotated.shutdown().await;
    let retired = Stack::start_with(KEY_ROUTE, with(&["new"])).await;
    let old = retired
        .http
        .send(
            "POST",
            &retired.url("/checkout"),
            &[("idempotency-token", &old_token)],
            "{}",
        )
        .await;
    assert_eq!(old.status, 403, "the retired secret's token");
    let new = retired
        .http
        .send(
            "POST",
            &retired.url("/checkout"),
            &[("idempotency-token", &new_token)],
            "{}",
        )
        .await;
    assert_eq!(new.status, 404);
    retired.shutdown().await;
}

/// `tokens.issue_per_minute`: past it a principal gets `429` with
/// `Retry-After`; another principal is not held back.
#[tokio::test]
async fn issuing_tokens_is_limited_per_principal() {
    let stack = Stack::start_with(KEY_ROUTE, |c| c.tokens.issue_per_minute = 3).await;
    let fetch = |who: &'static str| {
        let http = stack.http.clone();
        let url = stack.url("/token");
        async move { http.send("POST", &url, &[("authorization", who)], "").await }
    };
    for _ in 0..3 {
        assert_eq!(fetch("Bearer alice").await.status, 201);
    }
    let limited = fetch("Bearer alice").await;
    assert_eq!(limited.status, 429);
    assert_eq!(
        limited.problem_type(),
        "urn:idemgate:problem:token-rate-limited"
    );
    assert!(
        limited
            .header("retry-after")
            .unwrap()
            .parse::<u64>()
            .unwrap()
            >= 1
    );
    assert_eq!(fetch("Bearer bob").await.status, 201);
    stack.shutdown().await;
}

/// An ES256 key of an identity provider: its signing key and its JWK.
fn idp_key(kid: &str) -> (jsonwebtoken::EncodingKey, serde_json::Value) {
    let pair = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    let point = pair.public_key_raw(); // 0x04 || x || y
    let b64 = |b: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
    let jwk = serde_json::json!({
        "kty": "EC", "crv": "P-256", "kid": kid, "alg": "ES256", "use": "sig",
        "x": b64(&point[1..33]), "y": b64(&point[33..65]),
    });
    (
        jsonwebtoken::EncodingKey::from_ec_der(&pair.serialize_der()),
        jwk,
    )
}

/// Two identity providers trusted side by side (their keys in one JWKS),
/// each with a user `u-1`: tenant B's `u-1` sending the same key and body
/// as tenant A's is another client — executed, never handed A's stored
/// answer. With `issuers` listed, a third provider's token is `401`.
/// (Before, a JWT scope was the claim alone when no issuer was set: B got
/// A's answer and B's order never ran.)
#[tokio::test]
async fn the_same_subject_from_two_issuers_is_two_clients() {
    let (key_a, jwk_a) = idp_key("idp-a");
    let (key_b, jwk_b) = idp_key("idp-b");
    let dir = tempfile::tempdir().unwrap();
    let jwks = dir.path().join("jwks.json");
    std::fs::write(
        &jwks,
        serde_json::json!({"keys": [jwk_a, jwk_b]}).to_string(),
    )
    .unwrap();
    let token = |key: &jsonwebtoken::EncodingKey, kid: &str, iss: &str| {
        let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::ES256);
        header.kid = Some(kid.into());
        let claims = serde_json::json!({"sub": "u-1", "iss": iss, "exp": now() + 300});
        format!(
            "Bearer {}",
            jsonwebtoken::encode(&header, &claims, key).unwrap()
        )
    };
    let a = token(&key_a, "idp-a", "https://a.example");
    let b = token(&key_b, "idp-b", "https://b.example");
    for issuers in [
        "",
        r#"issuers = ["https://a.example", "https://b.example"]"#,
    ] {
        let routes = format!(
            "[identity.jwt]\njwks_file = {:?}\n{issuers}\n{KEY_ROUTE}",
            jwks.display().to_string()
        );
        let stack = Stack::start(&routes).await;
        let order = async |auth: &str| {
            post(
                &stack.http,
                &stack,
                "/actions/pay",
                &[("authorization", auth), ("idempotency-key", "order-7")],
                "{\"amount\":100}",
            )
            .await
        };
        let first = order(&a).await;
        assert_eq!(first.status, 201, "{:?}", first.body);
        let other = order(&b).await;
        assert_eq!(other.status, 201, "{issuers}: {:?}", other.body);
        assert_eq!(other.header("idempotent-replayed"), None, "{issuers}");
        assert_ne!(other.json()["execution_id"], first.json()["execution_id"]);
        assert_ne!(
            other.json()["key"],
            first.json()["key"],
            "two forwarded keys"
        );
        assert_eq!(executions(&stack, "pay"), 2, "{issuers}: B's order ran");
        // Each one's retry is its own replay.
        let again = order(&b).await;
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        assert_eq!(again.json()["execution_id"], other.json()["execution_id"]);
        // A token of an issuer not listed, signed by a trusted key.
        let stranger = token(&key_a, "idp-a", "https://c.example");
        let expected = if issuers.is_empty() { 201 } else { 401 };
        assert_eq!(order(&stranger).await.status, expected, "{issuers}");
        stack.shutdown().await;
    }
}
