//! The states a record enters after its first answer — uncertain, expired,
//! waited for — hold the same rules on every instance (docs/semantics.md, rule 8).
//!
//! Every test runs real `idemgate serve` processes on one Postgres schema,
//! two of them and (for comparison) one, in front of the demo upstream,
//! whose `/actions/{name}` does not deduplicate: it executes on every call
//! and counts the copies of one `Idempotency-Key` running at once.

use crate::support;

use std::net::SocketAddr;
use std::time::Duration;

use idemgate_demo_upstream as demo_upstream;
use idemgate_demo_upstream::DemoUpstream;
use support::instances::{self, Instance};
use support::{Answer, Http, eventually, executions_at, services};

/// The gateways' config: an upstream that times out after 2 s and holds
/// an uncertain key for 1 s (timings kept short; the defaults are the
/// upstream's timeout), a waiting key route.
fn config(db: &str, upstream: SocketAddr, store: &str, route: &str) -> String {
    format!(
        r#"
        [store]
        database_url = "{db}"
        timeout = "1s"
        lease = "4s"
        {store}

        [[upstreams]]
        name = "demo"
        url = "http://{upstream}"
        timeout = "2s"
        uncertain_hold = "1500ms"

        [[routes]]
        name = "actions"
        methods = ["POST"]
        path_prefix = "/actions/"
        upstream = "demo"
        idempotency = "key"
        on_concurrent = "wait"
        {route}
        "#
    )
}

struct Setup {
    upstream: DemoUpstream,
    gateways: Vec<Instance>,
    http: Http,
}

impl Setup {
    async fn start(test: &str, count: usize, store: &str, route: &str) -> Option<Setup> {
        let db = services::shared_sql(test).await?;
        let upstream = demo_upstream::start("127.0.0.1:0").await.unwrap();
        let body = config(&db, upstream.addr, store, route);
        let gateways = instances::start(count, "", &body).await;
        Some(Setup {
            upstream,
            gateways,
            http: Http::http1(),
        })
    }

    /// The instance a duplicate goes to: the other one, or the only one.
    fn other(&self) -> &Instance {
        self.gateways.last().unwrap()
    }

    async fn post(&self, on: &Instance, key: &str, extra: &[(&str, &str)]) -> Answer {
        let mut headers = vec![("idempotency-key", key)];
        headers.extend_from_slice(extra);
        self.http
            .send(
                "POST",
                &on.url("/actions/pay"),
                &headers,
                "{\"amount\":100}",
            )
            .await
    }

    fn peak_copies(&self) -> u64 {
        self.upstream.state.stats().peak_copies
    }
}

fn retry_after(answer: &Answer) -> u64 {
    answer
        .header("retry-after")
        .unwrap_or_else(|| panic!("no Retry-After: {:?}", answer.headers))
        .parse()
        .unwrap()
}

/// Upstream timeout 2 s, handler 4 s: the first copy is still running
/// when the gateway gives up. A double click 0.5 s later (waiting, on the
/// other instance or the same one) and the client's own retry right after
/// its 504 are each told `502 outcome-uncertain` with a `Retry-After`,
/// never forwarded beside the running copy. After the hold, one retry is
/// forwarded — one copy at a time at the upstream.
async fn an_uncertain_record_is_never_forwarded_beside_its_running_copy(test: &str, count: usize) {
    let Some(s) = Setup::start(test, count, "", "").await else {
        return;
    };
    let first = {
        let http = s.http.clone();
        let url = s.gateways[0].url("/actions/pay");
        tokio::spawn(async move {
            http.send(
                "POST",
                &url,
                &[("idempotency-key", "u-1"), ("x-demo-delay-ms", "4000")],
                "{\"amount\":100}",
            )
            .await
        })
    };
    support::reached(&s.upstream, 1).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let double_click = s
        .post(s.other(), "u-1", &[("x-demo-delay-ms", "4000")])
        .await;
    let first = first.await.unwrap();
    assert_eq!(first.status, 504, "{:?}", first.body);
    assert_eq!(double_click.status, 502, "{:?}", double_click.body);
    // Both still name the record: its key is remembered until then.
    for answer in [&first, &double_click] {
        assert!(
            answer.header("idempotency-expires").is_some(),
            "{:?}",
            answer.headers
        );
    }
    assert_eq!(
        double_click.problem_type(),
        "urn:idemgate:problem:outcome-uncertain"
    );
    assert!(retry_after(&double_click) >= 1);
    // The client retries at once after its 504, on either instance.
    for on in &s.gateways {
        let retry = s.post(on, "u-1", &[]).await;
        assert_eq!(retry.status, 502, "{:?}", retry.body);
        assert_eq!(
            retry.problem_type(),
            "urn:idemgate:problem:outcome-uncertain"
        );
        assert!(retry_after(&retry) >= 1);
    }
    // The first copy commits at 4 s; nothing ran beside it.
    let done = eventually(Duration::from_secs(5), || async {
        executions_at(&s.upstream, "pay") == 1
    })
    .await;
    assert!(done, "{:?}", s.upstream.state.stats());
    assert_eq!(s.peak_copies(), 1);
    // After the hold: a burst of retries on every instance, one forwarded.
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let retries = (0..20).map(|i| {
        let (http, url) = (s.http.clone(), s.gateways[i % count].url("/actions/pay"));
        tokio::spawn(async move {
            http.send(
                "POST",
                &url,
                &[("idempotency-key", "u-1")],
                "{\"amount\":100}",
            )
            .await
        })
    });
    let answers = futures_util::future::join_all(retries).await;
    for answer in answers {
        let answer = answer.unwrap();
        assert_eq!(answer.status, 201, "{:?}", answer.body);
    }
    assert_eq!(executions_at(&s.upstream, "pay"), 2, "one retry forwarded");
    assert_eq!(s.peak_copies(), 1, "never two copies at once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncertain_two_instances() {
    an_uncertain_record_is_never_forwarded_beside_its_running_copy("uncertain_two_instances", 2)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncertain_one_instance() {
    an_uncertain_record_is_never_forwarded_beside_its_running_copy("uncertain_one_instance", 1)
        .await;
}

const RECONCILE: &str = r#"reconcile_path = "/actions/by-key/{key}""#;

/// The lost ACK: the action commits, the connection drops before the
/// answer. The retry (at once, on either instance) is answered from the
/// upstream's status endpoint: replayed, never forwarded a second time.
async fn a_lost_ack_is_answered_by_reconciliation(test: &str, count: usize) {
    let Some(s) = Setup::start(test, count, "", RECONCILE).await else {
        return;
    };
    let lost = s
        .post(&s.gateways[0], "r-1", &[("x-demo-drop", "after")])
        .await;
    assert_eq!(lost.status, 502, "{:?}", lost.body);
    assert_eq!(executions_at(&s.upstream, "pay"), 1);
    let retry = s.post(s.other(), "r-1", &[]).await;
    assert_eq!(retry.status, 200, "{:?}", retry.body);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        retry.json()["execution"],
        1,
        "the first execution's own answer"
    );
    for on in &s.gateways {
        let again = s.post(on, "r-1", &[]).await;
        assert_eq!(again.status, 200);
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
    }
    assert_eq!(executions_at(&s.upstream, "pay"), 1, "never executed again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_ack_reconciled_two_instances() {
    a_lost_ack_is_answered_by_reconciliation("lost_ack_reconciled_two_instances", 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_ack_reconciled_one_instance() {
    a_lost_ack_is_answered_by_reconciliation("lost_ack_reconciled_one_instance", 1).await;
}

/// The connection drops before the action ran: the status endpoint says
/// `404`. Within the hold that proves nothing yet (a copy may still be on
/// its way), so the retry waits; after it, one retry is forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_run_is_forwarded_once_after_the_hold() {
    let test = "not_run_is_forwarded_once_after_the_hold";
    let Some(s) = Setup::start(test, 2, "", RECONCILE).await else {
        return;
    };
    let dropped = s
        .post(&s.gateways[0], "n-1", &[("x-demo-drop", "before")])
        .await;
    assert_eq!(dropped.status, 502, "{:?}", dropped.body);
    let early = s.post(&s.gateways[1], "n-1", &[]).await;
    assert_eq!(early.status, 502);
    assert_eq!(
        early.problem_type(),
        "urn:idemgate:problem:outcome-uncertain"
    );
    assert_eq!(executions_at(&s.upstream, "pay"), 0);
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let retries = (0..20).map(|i| {
        let (http, url) = (s.http.clone(), s.gateways[i % 2].url("/actions/pay"));
        tokio::spawn(async move {
            http.send(
                "POST",
                &url,
                &[("idempotency-key", "n-1")],
                "{\"amount\":100}",
            )
            .await
        })
    });
    for answer in futures_util::future::join_all(retries).await {
        let answer = answer.unwrap();
        assert_eq!(answer.status, 201, "{:?}", answer.body);
    }
    assert_eq!(executions_at(&s.upstream, "pay"), 1);
    assert_eq!(s.peak_copies(), 1);
}

/// A status endpoint that answers neither 200 nor 404 proves nothing: the
/// retry is `502 reconcile-failed`, nothing is forwarded, the record stays
/// uncertain (and the next retry asks again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_endpoint_that_cannot_say_forwards_nothing() {
    let test = "a_status_endpoint_that_cannot_say_forwards_nothing";
    cannot_say(test, "status=503").await;
}

/// The same for a status endpoint that does not answer within the
/// upstream's timeout: not knowing is not "it did not run".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_endpoint_that_times_out_forwards_nothing() {
    let test = "a_status_endpoint_that_times_out_forwards_nothing";
    cannot_say(test, "delay_ms=3000").await;
}

async fn cannot_say(test: &str, query: &str) {
    let route = format!(r#"reconcile_path = "/actions/by-key/{{key}}?{query}""#);
    let Some(s) = Setup::start(test, 2, "", &route).await else {
        return;
    };
    let lost = s
        .post(&s.gateways[0], "f-1", &[("x-demo-drop", "after")])
        .await;
    assert_eq!(lost.status, 502);
    tokio::time::sleep(Duration::from_millis(1600)).await;
    for on in [&s.gateways[1], &s.gateways[0], &s.gateways[1]] {
        let retry = s.post(on, "f-1", &[]).await;
        assert_eq!(retry.status, 502, "{:?}", retry.body);
        assert_eq!(
            retry.problem_type(),
            "urn:idemgate:problem:reconcile-failed"
        );
        assert!(
            retry.header("idempotency-expires").is_some(),
            "{:?}",
            retry.headers
        );
    }
    assert_eq!(
        executions_at(&s.upstream, "pay"),
        1,
        "never forwarded again"
    );
    let record: serde_json::Value = s
        .http
        .get(&s.gateways[0].admin_url("/admin/keys/actions/f-1"))
        .await
        .json();
    assert_eq!(record["records"][0]["state"], "uncertain", "{record}");
}

/// `store.tombstone`: past the retention, through a real sweep, the same
/// request is `410 idempotency-key-expired` on every instance and another
/// request `422`; past the tombstone, the sweep forgets the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tombstone_answers_410_through_a_sweep_on_every_instance() {
    let test = "a_tombstone_answers_410_through_a_sweep_on_every_instance";
    let store = r#"
        retention = "7s"
        tombstone = "6s"
        sweep_interval = "500ms"
    "#;
    let Some(s) = Setup::start(test, 2, store, "").await else {
        return;
    };
    let first = s.post(&s.gateways[0], "t-1", &[]).await;
    assert_eq!(first.status, 201);
    let expires = httpdate::parse_http_date(first.header("idempotency-expires").unwrap()).unwrap();
    assert!(expires > std::time::SystemTime::now() + Duration::from_secs(5));
    tokio::time::sleep(Duration::from_millis(8000)).await;
    for on in &s.gateways {
        let late = s.post(on, "t-1", &[]).await;
        assert_eq!(late.status, 410, "{:?}", late.body);
        assert_eq!(
            late.problem_type(),
            "urn:idemgate:problem:idempotency-key-expired"
        );
        assert!(late.header("idempotency-expires").is_some());
        let other = s
            .http
            .send(
                "POST",
                &on.url("/actions/pay"),
                &[("idempotency-key", "t-1")],
                "{}",
            )
            .await;
        assert_eq!(other.status, 422, "{:?}", other.body);
    }
    let record: serde_json::Value = s
        .http
        .get(&s.gateways[1].admin_url("/admin/keys/actions/t-1"))
        .await
        .json();
    assert_eq!(record["records"][0]["phase"], "tombstone", "{record}");
    assert_eq!(
        record["records"][0]["stored_body_bytes"], 0,
        "the sweep dropped the answer"
    );
    assert_eq!(executions_at(&s.upstream, "pay"), 1);
    // Past the tombstone the sweeper forgets the key: it is new again.
    tokio::time::sleep(Duration::from_millis(6000)).await;
    let again = s.post(&s.gateways[1], "t-1", &[]).await;
    assert_eq!(again.status, 201, "{:?}", again.body);
    assert_eq!(again.header("idempotent-replayed"), None);
    assert_eq!(executions_at(&s.upstream, "pay"), 2);
}

/// Twenty duplicates wait on the other instance while the first request
/// runs 600 ms (less than the 1 s safety poll): each learns the outcome
/// from the store's announcement (no poll ended any wait), and the
/// upstream ran once.
async fn waiters_elsewhere_are_woken_by_announcement(test: &str, store: &str) {
    let Some(s) = Setup::start(test, 2, store, "").await else {
        return;
    };
    let first = {
        let (http, url) = (s.http.clone(), s.gateways[0].url("/actions/pay"));
        tokio::spawn(async move {
            http.send(
                "POST",
                &url,
                &[("idempotency-key", "w-1"), ("x-demo-delay-ms", "600")],
                "{\"amount\":100}",
            )
            .await
        })
    };
    support::reached(&s.upstream, 1).await;
    let waiters = (0..20).map(|_| {
        let (http, url) = (s.http.clone(), s.gateways[1].url("/actions/pay"));
        tokio::spawn(async move {
            http.send(
                "POST",
                &url,
                &[("idempotency-key", "w-1")],
                "{\"amount\":100}",
            )
            .await
        })
    });
    let answers = futures_util::future::join_all(waiters).await;
    assert_eq!(first.await.unwrap().status, 201);
    for answer in answers {
        let answer = answer.unwrap();
        assert_eq!(answer.status, 201, "{:?}", answer.body);
        assert_eq!(answer.header("idempotent-replayed"), Some("true"));
    }
    assert_eq!(executions_at(&s.upstream, "pay"), 1);
    let metrics = s.http.get(&s.gateways[1].admin_url("/metrics")).await;
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    let count = |by: &str| -> u64 {
        let line = format!("idemgate_waiter_wakeups_total{{by=\"{by}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(line.as_str()))
            .unwrap_or_else(|| panic!("no {line} in {text}"))
            .parse()
            .unwrap()
    };
    if store.is_empty() && services::on_mariadb() {
        // No channel between instances on MariaDB without Redis: the
        // waiters learn the outcome at their safety poll.
        assert_eq!(count("announcement"), 0, "{text}");
        assert!(count("poll") >= 1, "{text}");
    } else {
        assert!(count("announcement") >= 1, "{text}");
        assert_eq!(count("poll"), 0, "a wait ended by polling: {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
/// On MariaDB (`IDEMGATE_TEST_SQL=mariadb`), which has no `NOTIFY`: woken
/// by their safety poll, still with one execution.
async fn waiters_woken_by_postgres_notify() {
    waiters_elsewhere_are_woken_by_announcement("waiters_woken_by_postgres_notify", "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_woken_by_redis_pubsub() {
    let test = "waiters_woken_by_redis_pubsub";
    let Some((url, prefix)) = services::redis(test).await else {
        return;
    };
    let store = format!("redis_url = \"{url}\"\nredis_prefix = \"{prefix}\"");
    waiters_elsewhere_are_woken_by_announcement(test, &store).await;
}

/// A release (the first attempt failed with a 5xx) wakes the waiters on
/// the other instance: one of them is forwarded, the rest replay it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_elsewhere_lets_exactly_one_waiter_through() {
    let test = "a_release_elsewhere_lets_exactly_one_waiter_through";
    let Some(s) = Setup::start(test, 2, "", "").await else {
        return;
    };
    s.http
        .send(
            "POST",
            &format!("{}/faults", s.upstream.url()),
            &[],
            r#"{"delay_ms": 800, "fail_status": 503, "count": 1}"#,
        )
        .await;
    let first = {
        let (http, url) = (s.http.clone(), s.gateways[0].url("/actions/pay"));
        tokio::spawn(async move {
            http.send(
                "POST",
                &url,
                &[("idempotency-key", "x-1")],
                "{\"amount\":100}",
            )
            .await
        })
    };
    support::reached(&s.upstream, 1).await;
    let waiters = (0..10).map(|_| {
        let (http, url) = (s.http.clone(), s.gateways[1].url("/actions/pay"));
        tokio::spawn(async move {
            http.send(
                "POST",
                &url,
                &[("idempotency-key", "x-1")],
                "{\"amount\":100}",
            )
            .await
        })
    });
    let answers = futures_util::future::join_all(waiters).await;
    assert_eq!(first.await.unwrap().status, 503);
    let mut replayed = 0;
    for answer in answers {
        let answer = answer.unwrap();
        assert_eq!(answer.status, 201, "{:?}", answer.body);
        replayed += usize::from(answer.header("idempotent-replayed") == Some("true"));
    }
    assert_eq!(replayed, 9, "one waiter forwarded, nine replayed");
    assert_eq!(executions_at(&s.upstream, "pay"), 1);
    assert_eq!(s.peak_copies(), 1);
}

/// An operator's purge on one instance never frees a key whose copy may
/// still run on another: a live claim and an uncertain record within its
/// hold are both kept (`409 record-in-flight`); once settled, the purge
/// goes through and the key is new on every instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_elsewhere_never_frees_a_running_or_uncertain_key() {
    let test = "a_purge_elsewhere_never_frees_a_running_or_uncertain_key";
    let Some(s) = Setup::start(test, 2, "", "").await else {
        return;
    };
    let purge = |key: &str| {
        let (http, url) = (
            s.http.clone(),
            s.gateways[1].admin_url(&format!("/admin/keys/actions/{key}")),
        );
        async move { http.send("DELETE", &url, &[], "").await }
    };
    let running = {
        let (http, url) = (s.http.clone(), s.gateways[0].url("/actions/pay"));
        tokio::spawn(async move {
            http.send(
                "POST",
                &url,
                &[("idempotency-key", "p-1"), ("x-demo-delay-ms", "4000")],
                "{\"amount\":100}",
            )
            .await
        })
    };
    support::reached(&s.upstream, 1).await;
    let refused = purge("p-1").await;
    assert_eq!(refused.status, 409, "{:?}", refused.body);
    assert_eq!(
        refused.problem_type(),
        "urn:idemgate:problem:record-in-flight"
    );
    // Timed out at 2 s: uncertain, the copy still running upstream.
    assert_eq!(running.await.unwrap().status, 504);
    let refused = purge("p-1").await;
    assert_eq!(
        refused.status, 409,
        "an uncertain key within its hold: {:?}",
        refused.body
    );
    let retry = s.post(&s.gateways[1], "p-1", &[]).await;
    assert_eq!(retry.status, 502);
    // After the copy and the hold: purged, and new everywhere.
    let done = eventually(Duration::from_secs(5), || async {
        executions_at(&s.upstream, "pay") == 1
    })
    .await;
    assert!(done);
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let purged = purge("p-1").await;
    assert_eq!(purged.status, 200, "{:?}", purged.body);
    let fresh = s.post(&s.gateways[0], "p-1", &[]).await;
    assert_eq!(fresh.status, 201);
    assert_eq!(fresh.header("idempotent-replayed"), None);
    assert_eq!(executions_at(&s.upstream, "pay"), 2);
    assert_eq!(s.peak_copies(), 1);
}

/// The operators' list of uncertain records (`GET /admin/uncertain`, the
/// dashboard's) is the store's: a record made uncertain on one instance is
/// listed by the other, with its hold, and leaves the list once a retry
/// has taken it over and completed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_uncertain_list_is_the_stores_on_every_instance() {
    let test = "the_uncertain_list_is_the_stores_on_every_instance";
    let Some(s) = Setup::start(test, 2, "", "").await else {
        return;
    };
    let lost = s
        .post(&s.gateways[0], "list-1", &[("x-demo-drop", "after")])
        .await;
    assert_eq!(lost.status, 502);
    let listed: serde_json::Value = s
        .http
        .get(&s.gateways[1].admin_url("/admin/uncertain"))
        .await
        .json();
    let records = listed["records"].as_array().unwrap();
    assert_eq!(records.len(), 1, "{listed}");
    assert_eq!(records[0]["key"], "list-1");
    assert_eq!(records[0]["state"], "uncertain");
    assert!(records[0]["hold_left"].is_string(), "{listed}");
    assert_eq!(records[0]["reconcilable"], false);
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let retry = s.post(&s.gateways[1], "list-1", &[]).await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    let after: serde_json::Value = s
        .http
        .get(&s.gateways[0].admin_url("/admin/uncertain"))
        .await
        .json();
    assert_eq!(after["records"].as_array().unwrap().len(), 0, "{after}");
}

/// With Redis as the fast layer each instance keeps a copy of the answers
/// it replays (no Redis round trip per replay); a purge made on another
/// instance still reaches that copy before the purge is answered, and the
/// key executes again there. The second instance replays twice first, so
/// its copy is in use when the purge comes; with the copy not following
/// the purge log it would replay the purged key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_elsewhere_reaches_the_answers_an_instance_keeps_near() {
    let test = "a_purge_elsewhere_reaches_the_answers_an_instance_keeps_near";
    let Some((url, prefix)) = services::redis(test).await else {
        return;
    };
    let store = format!("redis_url = \"{url}\"\nredis_prefix = \"{prefix}\"");
    let Some(s) = Setup::start(test, 2, &store, "").await else {
        return;
    };
    let (a, b) = (&s.gateways[0], &s.gateways[1]);
    assert_eq!(s.post(a, "near-1", &[]).await.status, 201);
    for _ in 0..2 {
        let replay = s.post(b, "near-1", &[]).await;
        assert_eq!(replay.status, 201);
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    }
    let metrics = s.http.get(&b.admin_url("/metrics")).await;
    let kept: u64 = String::from_utf8_lossy(&metrics.body)
        .lines()
        .find_map(|l| {
            l.strip_prefix("idemgate_memory_layer_bytes ")?
                .trim()
                .parse()
                .ok()
        })
        .expect("idemgate_memory_layer_bytes");
    assert!(kept > 0, "the replaying instance keeps no copy");
    let purged = s
        .http
        .send(
            "DELETE",
            &a.admin_url("/admin/keys/actions/near-1"),
            &[],
            "",
        )
        .await;
    assert_eq!(purged.status, 200, "{:?}", purged.body);
    let fresh = s.post(b, "near-1", &[]).await;
    assert_eq!(fresh.status, 201);
    assert_eq!(
        fresh.header("idempotent-replayed"),
        None,
        "a purged key was replayed from an instance's copy"
    );
    assert_eq!(executions_at(&s.upstream, "pay"), 2);
}
