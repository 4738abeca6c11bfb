//! A real nginx between the gateway and the service, as most services are
//! deployed (docs/semantics.md, rule 11): its `502` for a service that
//! committed and dropped the connection, and its `504` for a service still
//! working past `proxy_read_timeout`, may each mean the action ran. The
//! record becomes `uncertain`, exactly as after a lost connection: held
//! while a copy may still run, reconciled through the status endpoint,
//! never released for a retry to execute beside it.
//!
//! Real `idemgate serve` processes on one Postgres schema, one and two of
//! them, in front of nginx in front of the demo upstream, whose
//! `/actions/{name}` does not deduplicate: it executes on every call and
//! counts the copies of one `Idempotency-Key` running at once.

use crate::support;

use std::time::Duration;

use idemgate_demo_upstream as demo_upstream;
use idemgate_demo_upstream::DemoUpstream;
use support::instances::{self, Instance};
use support::nginx::Nginx;
use support::{Answer, Http, eventually, executions_at, services};

struct Setup {
    upstream: DemoUpstream,
    // Dropped after the gateways.
    _nginx: Nginx,
    gateways: Vec<Instance>,
    http: Http,
}

impl Setup {
    /// `count` gateways → nginx (giving up after `nginx_timeout`) → the demo
    /// upstream; the gateways wait `gateway_timeout` for an answer and
    /// hold an uncertain key as long (the default hold). `upstream` adds
    /// keys to the upstream, `route` to the `/actions/` route.
    async fn start(
        test: &str,
        count: usize,
        (nginx_timeout, gateway_timeout): (&str, &str),
        upstream: &str,
        route: &str,
    ) -> Option<Setup> {
        let db = services::shared_sql(test).await?;
        let service = demo_upstream::start("127.0.0.1:0").await.unwrap();
        let nginx = Nginx::start(test, service.addr, nginx_timeout).await?;
        let body = format!(
            r#"
            [store]
            database_url = "{db}"
            timeout = "1s"
            lease = "10s"

            [[upstreams]]
            name = "demo"
            url = "{nginx}"
            timeout = "{gateway_timeout}"
            {upstream}

            [[routes]]
            name = "actions"
            methods = ["POST"]
            path_prefix = "/actions/"
            upstream = "demo"
            {route}
            "#,
            nginx = nginx.url(),
        );
        let gateways = instances::start(count, "", &body).await;
        Some(Setup {
            upstream: service,
            _nginx: nginx,
            gateways,
            http: Http::http1(),
        })
    }

    fn other(&self) -> &Instance {
        self.gateways.last().unwrap()
    }

    async fn post(&self, on: &Instance, key: &str, extra: &[(&str, &str)]) -> Answer {
        let mut headers = vec![("idempotency-key", key)];
        headers.extend_from_slice(extra);
        let body = format!("{{\"id\":\"{key}\",\"amount\":100}}");
        self.http
            .send("POST", &on.url("/actions/pay"), &headers, body)
            .await
    }

    fn peak_copies(&self) -> u64 {
        self.upstream.state.stats().peak_copies
    }
}

const KEY_ROUTE: &str = r#"idempotency = "key""#;
/// A payment provider's notification, keyed by its own id in the body.
const CALLBACK_ROUTE: &str = r#"kind = "callback"
            business_key = ["json:/id"]"#;
const RECONCILE: &str = r#"reconcile_path = "/actions/by-key/{key}""#;

/// The lost ACK behind an ingress: the service commits and its connection
/// drops; nginx answers `502`. The client gets that `502` as nginx sent
/// it, the record is uncertain, and the retry — at once, on either
/// instance — is answered from the service's status endpoint: replayed,
/// never executed a second time. (Read as "a 5xx: nothing happened", the
/// claim was released and the retry executed again.)
async fn a_lost_ack_behind_nginx_is_reconciled(test: &str, count: usize, kind: &str) {
    let route = format!("{kind}\n{RECONCILE}");
    let Some(s) = Setup::start(test, count, ("5s", "5s"), "", &route).await else {
        return;
    };
    let lost = s
        .post(&s.gateways[0], "lost-1", &[("x-demo-drop", "after")])
        .await;
    assert_eq!(lost.status, 502, "{:?}", lost.body);
    assert!(
        String::from_utf8_lossy(&lost.body).contains("nginx"),
        "nginx's own answer is relayed: {:?}",
        lost.body
    );
    assert!(lost.header("idempotency-expires").is_some());
    assert_eq!(executions_at(&s.upstream, "pay"), 1);
    for on in [s.other(), &s.gateways[0]] {
        let retry = s.post(on, "lost-1", &[]).await;
        assert_eq!(retry.status, 200, "{:?}", retry.body);
        assert_eq!(retry.header("idempotent-replayed"), Some("true"));
        assert_eq!(retry.json()["execution"], 1, "the first execution's answer");
    }
    assert_eq!(executions_at(&s.upstream, "pay"), 1, "never executed again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_ack_behind_nginx_one_instance() {
    a_lost_ack_behind_nginx_is_reconciled("lost_ack_behind_nginx_one_instance", 1, KEY_ROUTE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_ack_behind_nginx_two_instances() {
    a_lost_ack_behind_nginx_is_reconciled("lost_ack_behind_nginx_two_instances", 2, KEY_ROUTE)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_ack_behind_nginx_on_a_callback_route() {
    a_lost_ack_behind_nginx_is_reconciled(
        "lost_ack_behind_nginx_on_a_callback_route",
        2,
        CALLBACK_ROUTE,
    )
    .await;
}

/// nginx stops waiting after 1 s and answers `504`; the service works 3 s
/// and commits. The client's retry right after its `504`, a storm of
/// duplicates on every instance, and a double click meanwhile are each
/// told `502 outcome-uncertain` with a `Retry-After`: nothing is forwarded
/// while the first copy runs. After the hold (the gateway's own timeout,
/// 5 s), one retry is forwarded with the same key — one copy at a time.
/// (Read as "a 5xx: nothing happened", the retry ran beside the first copy:
/// two at once.)
async fn nginx_giving_up_first_never_puts_a_second_copy_beside_the_first(test: &str, count: usize) {
    let route = format!("{KEY_ROUTE}\non_concurrent = \"wait\"");
    let Some(s) = Setup::start(test, count, ("1s", "5s"), "", &route).await else {
        return;
    };
    let started = std::time::Instant::now();
    let first = s
        .post(&s.gateways[0], "slow-1", &[("x-demo-delay-ms", "3000")])
        .await;
    assert_eq!(first.status, 504, "{:?}", first.body);
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "nginx's 504"
    );
    let storm = (0..30).map(|i| {
        let (http, url) = (s.http.clone(), s.gateways[i % count].url("/actions/pay"));
        tokio::spawn(async move {
            http.send(
                "POST",
                &url,
                &[("idempotency-key", "slow-1"), ("x-demo-delay-ms", "3000")],
                "{\"id\":\"slow-1\",\"amount\":100}",
            )
            .await
        })
    });
    for answer in futures_util::future::join_all(storm).await {
        let answer = answer.unwrap();
        assert_eq!(answer.status, 502, "{:?}", answer.body);
        assert_eq!(
            answer.problem_type(),
            "urn:idemgate:problem:outcome-uncertain"
        );
        let retry_after: u64 = answer.header("retry-after").unwrap().parse().unwrap();
        assert!((1..=5).contains(&retry_after), "{retry_after}");
    }
    let retry = s.post(s.other(), "slow-1", &[]).await;
    assert_eq!(
        retry.status, 502,
        "the retry after its 504: {:?}",
        retry.body
    );
    let committed = eventually(Duration::from_secs(5), || async {
        executions_at(&s.upstream, "pay") == 1
    })
    .await;
    assert!(committed, "{:?}", s.upstream.state.stats());
    assert_eq!(s.peak_copies(), 1, "nothing ran beside the first copy");
    // After the hold (5 s from nginx's answer at 1 s): a burst of retries,
    // one forwarded, the others wait for its answer (the service does not
    // deduplicate here; its own key check would be the last layer).
    tokio::time::sleep(Duration::from_millis(6500).saturating_sub(started.elapsed())).await;
    let retries = (0..20).map(|i| {
        let (http, url) = (s.http.clone(), s.gateways[i % count].url("/actions/pay"));
        tokio::spawn(async move {
            http.send(
                "POST",
                &url,
                &[("idempotency-key", "slow-1")],
                "{\"id\":\"slow-1\",\"amount\":100}",
            )
            .await
        })
    });
    let answers = futures_util::future::join_all(retries).await;
    assert!(
        answers.iter().all(|a| a.as_ref().unwrap().status == 201),
        "{:?}",
        answers
            .iter()
            .map(|a| a.as_ref().unwrap().status)
            .collect::<Vec<_>>()
    );
    assert_eq!(executions_at(&s.upstream, "pay"), 2, "one retry forwarded");
    assert_eq!(s.peak_copies(), 1, "never two copies at once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_gives_up_first_one_instance() {
    nginx_giving_up_first_never_puts_a_second_copy_beside_the_first(
        "nginx_gives_up_first_one_instance",
        1,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_gives_up_first_two_instances() {
    nginx_giving_up_first_never_puts_a_second_copy_beside_the_first(
        "nginx_gives_up_first_two_instances",
        2,
    )
    .await;
}

/// `uncertain_statuses = []`: a service reached with nothing in between,
/// whose 5xx always means it did nothing. nginx's 502 then releases the
/// claim and the retry is forwarded at once — the operator said so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_uncertain_list_releases_every_5xx() {
    let test = "an_empty_uncertain_list_releases_every_5xx";
    let Some(s) = Setup::start(test, 1, ("5s", "5s"), "uncertain_statuses = []", KEY_ROUTE).await
    else {
        return;
    };
    let lost = s
        .post(&s.gateways[0], "plain-1", &[("x-demo-drop", "after")])
        .await;
    assert_eq!(lost.status, 502);
    let retry = s.post(&s.gateways[0], "plain-1", &[]).await;
    assert_eq!(retry.status, 201, "released: {:?}", retry.body);
    assert_eq!(executions_at(&s.upstream, "pay"), 2);
}

/// The MQ link follows the same rule: a message whose delivery got nginx's
/// `504` (the service still working past nginx's timeout) is redelivered
/// by the broker at once, but not forwarded while its first copy may still
/// run — its record is uncertain for the upstream's timeout; only then is
/// it forwarded again, with the same key. (Read as "a 5xx: nothing
/// happened", the redelivery ran beside the first copy: two at once.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumed_message_behind_nginx_is_never_forwarded_beside_its_first_copy() {
    let test = "a_consumed_message_behind_nginx_is_never_forwarded_beside_its_first_copy";
    let Some(stream) = support::brokers::RedisStream::new(test, None).await else {
        return;
    };
    let service = demo_upstream::start("127.0.0.1:0").await.unwrap();
    let Some(nginx) = Nginx::start(test, service.addr, "1s").await else {
        return;
    };
    let consumer = stream.consumer(
        "orders",
        "/actions/mq",
        r#"business_key = ["msg:header:order_id"]"#,
    );
    let mut config = support::config(nginx.addr, &consumer);
    config.upstreams[0].timeout = "4s".into();
    config.store.lease = "10s".into();
    let gateway = idemgate_gateway::gateway::start_for_tests(config)
        .await
        .unwrap();
    let http = Http::http1();
    // The first delivery takes 3 s at the service; nginx gives up at 1 s.
    let armed = http
        .send(
            "POST",
            &format!("{}/faults", service.url()),
            &[],
            r#"{"delay_ms": 3000, "count": 1}"#,
        )
        .await;
    assert!(armed.status.is_success());
    tokio::time::sleep(Duration::from_millis(500)).await;
    stream.add(&[("order_id", "o-1"), ("body", "{}")]).await;
    // Past the first copy's commit, before the hold (4 s from nginx's
    // answer) ends: one execution, redeliveries refused meanwhile.
    tokio::time::sleep(Duration::from_millis(4000)).await;
    let stats = service.state.stats();
    assert_eq!(executions_at(&service, "mq"), 1, "{stats:?}");
    assert_eq!(stats.peak_copies, 1, "{stats:?}");
    // After the hold the message is forwarded again with the same key
    // (the service's own check is the last layer) and acknowledged.
    let again = eventually(Duration::from_secs(10), || async {
        executions_at(&service, "mq") == 2 && stream.pending("g").await == 0
    })
    .await;
    assert!(again, "{:?}", service.state.stats());
    assert_eq!(service.state.stats().peak_copies, 1, "never two at once");
    gateway.shutdown().await;
    stream.delete().await;
}
