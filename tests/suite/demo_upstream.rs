//! The demo upstream's business state machine and fault switches: the
//! innermost idempotency layer the gateway forwards stable keys to.

use crate::support;

use support::Http;

#[tokio::test]
async fn coupon_deduction_and_payment_are_state_machines() {
    let up = idemgate_demo_upstream::start("127.0.0.1:0").await.unwrap();
    let http = Http::default();
    let base = up.url();
    let order = http
        .send(
            "POST",
            &format!("{base}/orders"),
            &[("idempotency-key", "k1")],
            r#"{"item":"book","amount":100}"#,
        )
        .await;
    assert_eq!(order.status, 201);
    let id = order.json()["order"]["order_id"]
        .as_str()
        .unwrap()
        .to_owned();
    // The same key again creates nothing new.
    let again = http
        .send(
            "POST",
            &format!("{base}/orders"),
            &[("idempotency-key", "k1")],
            r#"{"item":"book","amount":100}"#,
        )
        .await;
    assert_eq!(again.json()["order"]["order_id"], id.as_str());
    assert_eq!(again.json()["repeat"], true);
    assert_eq!(up.state.executions("create_order", "k1"), 1);

    let deduct = format!(r#"{{"coupon":"C1","order_id":"{id}"}}"#);
    for repeat in [false, true, true] {
        let a = http
            .send(
                "POST",
                &format!("{base}/coupons/deduct"),
                &[],
                deduct.clone(),
            )
            .await;
        assert_eq!(a.status, 200);
        assert_eq!(a.json()["repeat"], repeat);
    }
    assert_eq!(up.state.executions("deduct_coupon", "C1"), 1);
    let other = http
        .send(
            "POST",
            &format!("{base}/coupons/deduct"),
            &[],
            r#"{"coupon":"C1","order_id":"other"}"#,
        )
        .await;
    assert_eq!(other.status, 409);

    let notify = format!(r#"{{"trade_no":"T1","order_id":"{id}"}}"#);
    for repeat in [false, true] {
        let a = http
            .send(
                "POST",
                &format!("{base}/callbacks/payment"),
                &[],
                notify.clone(),
            )
            .await;
        assert_eq!(a.status, 200);
        assert_eq!(a.json()["result"], "success");
        assert_eq!(a.json()["repeat"], repeat);
        assert_eq!(a.json()["order"]["status"], "PAID");
    }
    assert_eq!(up.state.executions("pay_order", &id), 1);
    let unknown = http
        .send(
            "POST",
            &format!("{base}/callbacks/payment"),
            &[],
            r#"{"trade_no":"T2","order_id":"nope"}"#,
        )
        .await;
    assert_eq!(unknown.status, 404);
    up.shutdown().await;
}

#[tokio::test]
async fn lost_ack_commits_then_drops_the_connection() {
    let up = idemgate_demo_upstream::start("127.0.0.1:0").await.unwrap();
    let http = Http::default();
    let base = up.url();
    let lost = http
        .try_send(
            "POST",
            &format!("{base}/actions/deduct"),
            &[("x-demo-drop", "after"), ("idempotency-key", "k")],
            "",
        )
        .await;
    assert!(lost.is_err(), "expected a dropped connection, got {lost:?}");
    assert_eq!(
        up.state.executions("deduct", "k"),
        1,
        "committed before the drop"
    );
    let before = http
        .try_send(
            "POST",
            &format!("{base}/actions/deduct"),
            &[("x-demo-drop", "before"), ("idempotency-key", "k2")],
            "",
        )
        .await;
    assert!(before.is_err());
    assert_eq!(
        up.state.executions("deduct", "k2"),
        0,
        "dropped before acting"
    );
    up.shutdown().await;
}

#[tokio::test]
async fn armed_faults_apply_to_the_next_n_requests() {
    let up = idemgate_demo_upstream::start("127.0.0.1:0").await.unwrap();
    let http = Http::default();
    let base = up.url();
    let armed = http
        .send(
            "POST",
            &format!("{base}/faults"),
            &[],
            r#"{"fail_status":503,"count":2}"#,
        )
        .await;
    assert_eq!(armed.status, 204);
    let statuses: Vec<u16> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(
                http.send("POST", &format!("{base}/actions/a"), &[], "")
                    .await
                    .status
                    .as_u16(),
            );
        }
        v
    };
    assert_eq!(statuses, [503, 503, 201]);
    assert_eq!(
        up.state.executions("a", "-"),
        1,
        "failed requests did not execute"
    );
    let stats = http.get(&format!("{base}/stats")).await.json();
    assert_eq!(stats["executions"]["a"]["-"], 1);
    assert_eq!(stats["requests"], 3);
    up.shutdown().await;
}
