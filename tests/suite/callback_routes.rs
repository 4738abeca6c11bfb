//! Callback routes end to end (docs/semantics.md, "Callback routes"): business keys,
//! signatures, the lost-ACK incident with a retrying provider.

use crate::support;

use std::time::Duration;

use idemgate::callback::signature::{sign_hex, sign_standard};
use support::{Answer, Stack};

const ROUTES: &str = r#"
    [[routes]]
    name = "pay-notify"
    methods = ["POST"]
    path = "/callbacks/payment"
    upstream = "demo"
    kind = "callback"
    business_key = ["json:/trade_no"]

    [[routes]]
    name = "mq-push"
    methods = ["POST"]
    path = "/mq/push"
    upstream = "demo"
    kind = "callback"
    business_key = ["header:X-Msg-Id", "header:X-Topic"]

    [[routes]]
    name = "coupon-job"
    methods = ["POST"]
    path = "/coupons/deduct"
    upstream = "demo"
    kind = "callback"
    business_key = ["json:/order_id", "json:/coupon"]

    [[routes]]
    name = "jobs"
    methods = ["POST"]
    path = "/jobs/compensate"
    upstream = "demo"
    kind = "callback"
    business_key = ["query:job", "json:/step"]
"#;

async fn create_order(stack: &Stack) -> String {
    let a = stack
        .http
        .send(
            "POST",
            &format!("{}/orders", stack.upstream.url()),
            &[],
            "{\"item\":\"book\",\"amount\":100}",
        )
        .await;
    a.json()["order"]["order_id"].as_str().unwrap().to_owned()
}

/// A payment provider: retries on every non-2xx (and on a dropped
/// connection) with backoff, until it sees a 2xx.
async fn provider(stack: &Stack, path: &str, body: &str) -> (Answer, usize) {
    let mut pause = Duration::from_millis(20);
    for attempt in 1..=10 {
        if let Ok(a) = stack
            .http
            .try_send("POST", &stack.url(path), &[], body.to_owned())
            .await
            && a.status.is_success()
        {
            return (a, attempt);
        }
        tokio::time::sleep(pause).await;
        pause *= 2;
    }
    panic!("the provider never got a 2xx");
}

async fn arm_drop_after_commit(stack: &Stack) {
    let a = stack
        .http
        .send(
            "POST",
            &format!("{}/faults", stack.upstream.url()),
            &[],
            r#"{"drop":"after","count":1}"#,
        )
        .await;
    assert_eq!(a.status, 204);
}

#[tokio::test]
async fn the_incident_lost_ack_then_provider_retries_executes_once() {
    let stack = Stack::start(ROUTES).await;
    // Coupon deduction: committed, the connection dropped, the job retried.
    let order = create_order(&stack).await;
    arm_drop_after_commit(&stack).await;
    let body = format!(r#"{{"coupon":"C-100","order_id":"{order}"}}"#);
    let (ack, attempts) = provider(&stack, "/coupons/deduct", &body).await;
    assert!(attempts >= 2, "the first delivery must have failed");
    assert_eq!(ack.json()["status"], "USED");
    assert_eq!(stack.upstream.state.executions("deduct_coupon", "C-100"), 1);

    // Payment notification: PAID once, the provider finally acknowledged.
    arm_drop_after_commit(&stack).await;
    let notify = format!(r#"{{"trade_no":"T-9","order_id":"{order}"}}"#);
    let (ack, attempts) = provider(&stack, "/callbacks/payment", &notify).await;
    assert!(attempts >= 2);
    assert_eq!(ack.json()["result"], "success");
    assert_eq!(stack.upstream.state.executions("pay_order", &order), 1);
    {
        use std::io::Write as _;
        let stats = stack.upstream.state.stats();
        let _ = writeln!(
            std::io::stderr(),
            "incident: deliveries {} (requests seen upstream), executions deduct_coupon={} pay_order={}",
            stats.requests,
            stats.executions["deduct_coupon"]["C-100"],
            stats.executions["pay_order"][&order]
        );
    }
    // Later redeliveries get the stored acknowledgement, without reaching
    // the upstream (its state machine would hide a forwarded repeat).
    let seen = stack.upstream.state.stats().requests;
    let again = stack
        .http
        .send(
            "POST",
            &stack.url("/callbacks/payment"),
            &[],
            notify.clone(),
        )
        .await;
    assert_eq!(again.status, 200);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(stack.upstream.state.stats().requests, seen);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_concurrent_deliveries_execute_once() {
    let stack = Stack::start(ROUTES).await;
    let statuses: Vec<u16> = support::concurrent_posts(
        &stack.http,
        100,
        |_| stack.url("/mq/push"),
        |_| {
            support::pairs(&[
                ("x-msg-id", "m-1"),
                ("x-topic", "orders"),
                ("x-demo-delay-ms", "100"),
            ])
        },
        "",
    )
    .await
    .iter()
    .map(|a| a.status.as_u16())
    .collect();
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 409),
        "{statuses:?}"
    );
    assert_eq!(stack.upstream.state.executions("mq_push", "orders/m-1"), 1);
    stack.shutdown().await;
}

/// A callback's answers say until when its business key is remembered.
#[tokio::test]
async fn callback_answers_say_until_when_the_business_key_is_remembered() {
    let stack = Stack::start(ROUTES).await;
    let deliver = || async {
        stack
            .http
            .send(
                "POST",
                &stack.url("/mq/push"),
                &[("x-msg-id", "exp-1"), ("x-topic", "orders")],
                "",
            )
            .await
    };
    let first = deliver().await;
    assert_eq!(first.status, 200);
    let again = deliver().await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    support::assert_same_expiry(&[&first, &again], Duration::from_secs(86_400));
    // A duplicate in flight (409) names the same record.
    let slow = |id: &'static str| {
        let http = stack.http.clone();
        let url = stack.url("/mq/push");
        async move {
            let headers = [
                ("x-msg-id", id),
                ("x-topic", "orders"),
                ("x-demo-delay-ms", "500"),
            ];
            http.send("POST", &url, &headers, "").await
        }
    };
    let running = tokio::spawn(slow("exp-2"));
    support::reached(&stack.upstream, 2).await;
    let in_flight = slow("exp-2").await;
    assert_eq!(in_flight.status, 409, "{:?}", in_flight.body);
    let running = running.await.unwrap();
    support::assert_same_expiry(&[&running, &in_flight], Duration::from_secs(86_400));
    stack.shutdown().await;
}

#[tokio::test]
async fn composite_keys_separate_topics() {
    let stack = Stack::start(ROUTES).await;
    for (id, topic) in [("m-1", "a"), ("m-1", "b"), ("m-1", "a")] {
        let a = stack
            .http
            .send(
                "POST",
                &stack.url("/mq/push"),
                &[("x-msg-id", id), ("x-topic", topic)],
                "",
            )
            .await;
        assert_eq!(a.status, 200);
    }
    assert_eq!(stack.upstream.state.executions("mq_push", "a/m-1"), 1);
    assert_eq!(stack.upstream.state.executions("mq_push", "b/m-1"), 1);
    // Query + JSON composite.
    for _ in 0..2 {
        let a = stack
            .http
            .send(
                "POST",
                &stack.url("/jobs/compensate?job=j1"),
                &[],
                r#"{"job_id":"j1","step":"refund"}"#,
            )
            .await;
        assert_eq!(a.status, 200);
    }
    assert_eq!(
        stack.upstream.state.executions("compensate", "j1/refund"),
        1
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn missing_or_malformed_business_keys_are_400_and_leave_nothing() {
    let stack = Stack::start(ROUTES).await;
    type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a str, &'a str);
    let cases: [Case; 6] = [
        (
            "/callbacks/payment",
            &[],
            r#"{"order_id":"o"}"#,
            "business-key-missing",
        ),
        (
            "/callbacks/payment",
            &[],
            r#"{"trade_no":""}"#,
            "business-key-missing",
        ),
        (
            "/callbacks/payment",
            &[],
            "trade_no=T1",
            "business-key-invalid",
        ),
        (
            "/callbacks/payment",
            &[],
            r#"{"trade_no":{"id":1}}"#,
            "business-key-invalid",
        ),
        ("/mq/push", &[("x-msg-id", "m")], "", "business-key-missing"),
        (
            "/jobs/compensate",
            &[],
            r#"{"step":"s"}"#,
            "business-key-missing",
        ),
    ];
    for (path, headers, body, reason) in cases {
        let a = stack
            .http
            .send("POST", &stack.url(path), headers, body.to_owned())
            .await;
        assert_eq!(a.status, 400, "{path} {body}");
        assert_eq!(
            a.problem_type(),
            format!("urn:idemgate:problem:{reason}"),
            "{path} {body}"
        );
    }
    assert_eq!(stack.upstream.state.stats().requests, 0);
    stack.shutdown().await;
}

#[tokio::test]
async fn upstream_failure_releases_so_the_next_delivery_is_processed() {
    let stack = Stack::start(ROUTES).await;
    let headers = [("x-msg-id", "m-5"), ("x-topic", "t")];
    let mut failing = headers.to_vec();
    failing.push(("x-demo-fail-status", "503"));
    assert_eq!(
        stack
            .http
            .send("POST", &stack.url("/mq/push"), &failing, "")
            .await
            .status,
        503
    );
    assert_eq!(
        stack
            .http
            .send("POST", &stack.url("/mq/push"), &headers, "")
            .await
            .status,
        200
    );
    assert_eq!(stack.upstream.state.executions("mq_push", "t/m-5"), 1);
    stack.shutdown().await;
}

#[tokio::test]
async fn an_idempotency_token_is_never_consulted_on_callbacks() {
    let stack = Stack::start(ROUTES).await;
    let a = stack
        .http
        .send(
            "POST",
            &stack.url("/mq/push"),
            &[
                ("x-msg-id", "m"),
                ("x-topic", "t"),
                ("idempotency-token", "garbage"),
            ],
            "",
        )
        .await;
    assert_eq!(a.status, 200);
    stack.shutdown().await;
}

fn signed_route(signature: &str) -> String {
    format!(
        r#"
        [[routes]]
        name = "hook"
        methods = ["POST"]
        path = "/mq/push"
        upstream = "demo"
        kind = "callback"
        business_key = ["json:/id"]
        [routes.signature]
        {signature}
        "#
    )
}

fn now() -> i64 {
    idemgate_store::now_ms() / 1000
}

async fn deliver(stack: &Stack, headers: &[(&str, &str)], body: &str) -> Answer {
    stack
        .http
        .send("POST", &stack.url("/mq/push"), headers, body.to_owned())
        .await
}

async fn assert_refused_without_record(stack: &Stack, a: &Answer, what: &str, id: &str) {
    assert_eq!(a.status, 401, "{what}");
    assert_eq!(
        a.problem_type(),
        "urn:idemgate:problem:signature-invalid",
        "{what}"
    );
    assert!(
        stack
            .gateway
            .store
            .find("hook", id)
            .await
            .unwrap()
            .is_empty(),
        "{what}"
    );
}

#[tokio::test]
async fn stripe_signatures_valid_tampered_expired_and_rotated() {
    let stack = Stack::start(&signed_route(
        r#"scheme = "stripe"
        secrets = ["whsec_old", "whsec_new"]"#,
    ))
    .await;
    let body = r#"{"id":"evt_1"}"#;
    let t = now().to_string();
    for (secret, id) in [("whsec_old", "a"), ("whsec_new", "b")] {
        let delivery = format!(r#"{{"id":"{id}"}}"#);
        let sig = format!(
            "t={t},v1={}",
            sign_hex(
                secret.as_bytes(),
                &[t.as_bytes(), b".", delivery.as_bytes()]
            )
        );
        let a = deliver(&stack, &[("stripe-signature", &sig)], &delivery).await;
        assert_eq!(a.status, 200, "{secret}");
    }
    let sig = format!(
        "t={t},v1={}",
        sign_hex(b"whsec_new", &[t.as_bytes(), b".", body.as_bytes()])
    );
    let tampered = deliver(&stack, &[("stripe-signature", &sig)], r#"{"id":"evt_2"}"#).await;
    assert_refused_without_record(&stack, &tampered, "tampered", "evt_2").await;
    let old = (now() - 600).to_string();
    let sig = format!(
        "t={old},v1={}",
        sign_hex(b"whsec_new", &[old.as_bytes(), b".", body.as_bytes()])
    );
    let expired = deliver(&stack, &[("stripe-signature", &sig)], body).await;
    assert_refused_without_record(&stack, &expired, "expired", "evt_1").await;
    let unknown = format!(
        "t={t},v1={}",
        sign_hex(b"whsec_other", &[t.as_bytes(), b".", body.as_bytes()])
    );
    let a = deliver(&stack, &[("stripe-signature", &unknown)], body).await;
    assert_refused_without_record(&stack, &a, "unknown secret", "evt_1").await;
    let missing = deliver(&stack, &[], body).await;
    assert_refused_without_record(&stack, &missing, "missing", "evt_1").await;
    assert_eq!(stack.upstream.state.stats().requests, 2);
    stack.shutdown().await;
}

#[tokio::test]
async fn standard_webhooks_signatures() {
    use base64::Engine as _;
    let key = b"0123456789abcdef0123456789abcdef";
    let secret = format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode(key)
    );
    let stack = Stack::start(&signed_route(&format!(
        r#"scheme = "standard-webhooks"
        secrets = ["{secret}"]"#
    )))
    .await;
    let body = r#"{"id":"ok","type":"payment.succeeded"}"#;
    let t = now();
    let sig = sign_standard(key, "msg_1", t, body.as_bytes());
    let ts = t.to_string();
    let headers = [
        ("webhook-id", "msg_1"),
        ("webhook-timestamp", ts.as_str()),
        ("webhook-signature", sig.as_str()),
    ];
    assert_eq!(deliver(&stack, &headers, body).await.status, 200);
    // Several signatures in one header: any may match.
    let body2 = r#"{"id":"ok2","type":"payment.succeeded"}"#;
    let sig2 = sign_standard(key, "msg_1", t, body2.as_bytes());
    let both = format!("v1,AAAA {sig2}");
    let headers = [
        ("webhook-id", "msg_1"),
        ("webhook-timestamp", ts.as_str()),
        ("webhook-signature", both.as_str()),
    ];
    assert_eq!(deliver(&stack, &headers, body2).await.status, 200);
    let forged = r#"{"id":"forged"}"#;
    let forged_sig = sign_standard(key, "msg_1", t, forged.as_bytes());
    let headers = [
        ("webhook-id", "msg_2"),
        ("webhook-timestamp", ts.as_str()),
        ("webhook-signature", forged_sig.as_str()),
    ];
    let a = deliver(&stack, &headers, forged).await;
    assert_refused_without_record(&stack, &a, "signature for another id", "forged").await;
    let old = t - 301;
    let stale_sig = sign_standard(key, "msg_1", old, forged.as_bytes());
    let old = old.to_string();
    let headers = [
        ("webhook-id", "msg_1"),
        ("webhook-timestamp", old.as_str()),
        ("webhook-signature", stale_sig.as_str()),
    ];
    let a = deliver(&stack, &headers, forged).await;
    assert_refused_without_record(&stack, &a, "expired", "forged").await;
    stack.shutdown().await;
}

#[tokio::test]
async fn plain_hmac_signatures_with_rotated_secrets() {
    let stack = Stack::start(&signed_route(
        r#"scheme = "hmac-sha256"
        header = "X-Signature"
        secrets = ["retired", "current"]"#,
    ))
    .await;
    for (secret, id) in [("retired", "r"), ("current", "c")] {
        let body = format!(r#"{{"id":"{id}"}}"#);
        let sig = format!("sha256={}", sign_hex(secret.as_bytes(), &[body.as_bytes()]));
        let a = deliver(&stack, &[("x-signature", &sig)], &body).await;
        assert_eq!(a.status, 200, "{secret}");
    }
    let sig = sign_hex(b"current", &[br#"{"id":"c"}"#]);
    let a = deliver(&stack, &[("x-signature", &sig)], r#"{"id":"forged"}"#).await;
    assert_refused_without_record(&stack, &a, "tampered", "forged").await;
    stack.shutdown().await;
}
