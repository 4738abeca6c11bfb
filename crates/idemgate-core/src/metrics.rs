//! Prometheus metrics, rendered as text on the admin listener's `/metrics`.
//!
//! Every series is known at start-up (routes and upstreams come from the
//! config), so the registry is a set of immutable maps to atomic counters:
//! recording on the hot path is one relaxed atomic add, with no lock and no
//! allocation. A registry belongs to one gateway, so tests that run several
//! gateways in one process never see each other's counts.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// What happened to one request on a route (`outcome` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Sent to the upstream.
    Forwarded,
    /// Answered from the stored outcome.
    Replayed,
    /// A duplicate while the first was in flight (409).
    Conflict,
    /// The key was reused for a different request (422).
    Mismatch,
    /// Refused for bad input (4xx) before anything was forwarded.
    Rejected,
    /// The gateway, store or upstream failed (5xx).
    Error,
}

const OUTCOMES: [Outcome; 6] = [
    Outcome::Forwarded,
    Outcome::Replayed,
    Outcome::Conflict,
    Outcome::Mismatch,
    Outcome::Rejected,
    Outcome::Error,
];

impl Outcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Forwarded => "forwarded",
            Outcome::Replayed => "replayed",
            Outcome::Conflict => "conflict",
            Outcome::Mismatch => "mismatch",
            Outcome::Rejected => "rejected",
            Outcome::Error => "error",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// What ended a waiting duplicate's wait (`by` label of
/// `idemgate_waiter_wakeups_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WakeUp {
    /// The holder in this process published its outcome.
    Holder,
    /// The store announced that the record settled on another instance.
    Announcement,
    /// The safety poll: no word in time (a lost announcement costs this).
    Poll,
}

const WAKE_UPS: [WakeUp; 3] = [WakeUp::Holder, WakeUp::Announcement, WakeUp::Poll];

impl WakeUp {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            WakeUp::Holder => "holder",
            WakeUp::Announcement => "announcement",
            WakeUp::Poll => "poll",
        }
    }
}

/// The fast layers a request can fall back from (`layer` label).
#[derive(Debug, Clone, Copy)]
pub enum FallbackLayer {
    /// Redis (or Redis Cluster).
    Redis,
    /// The in-process layer.
    Memory,
}

const LATENCY_BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

/// A fixed-bucket latency histogram.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, elapsed: Duration) {
        let secs = elapsed.as_secs_f64();
        if let Some(i) = LATENCY_BUCKETS.iter().position(|b| secs <= *b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (bound, bucket) in LATENCY_BUCKETS.iter().zip(&self.buckets) {
            cumulative += bucket.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {cumulative}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}");
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
    }
}

/// Request counters of one route, one per outcome.
#[derive(Debug, Default)]
pub struct RouteCounters([AtomicU64; OUTCOMES.len()]);

impl RouteCounters {
    /// Counts one request.
    pub fn record(&self, outcome: Outcome) {
        self.0[outcome.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// The count of one outcome.
    pub fn get(&self, outcome: Outcome) -> u64 {
        self.0[outcome.index()].load(Ordering::Relaxed)
    }
}

/// What happened to one delivery of a message (`outcome` label of
/// `idemgate_messages_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageOutcome {
    /// Delivered to the upstream, outcome recorded, acknowledged.
    Forwarded,
    /// A repeat of a recorded message: acknowledged without forwarding.
    Duplicate,
    /// Left for the broker to deliver again (upstream failure, store
    /// unreachable, a copy in flight elsewhere).
    Retried,
    /// Moved to the dead-letter queue.
    DeadLettered,
    /// The broker refused an acknowledgement or a dead-letter publish.
    Error,
}

const MESSAGE_OUTCOMES: [MessageOutcome; 5] = [
    MessageOutcome::Forwarded,
    MessageOutcome::Duplicate,
    MessageOutcome::Retried,
    MessageOutcome::DeadLettered,
    MessageOutcome::Error,
];

impl MessageOutcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            MessageOutcome::Forwarded => "forwarded",
            MessageOutcome::Duplicate => "duplicate",
            MessageOutcome::Retried => "retried",
            MessageOutcome::DeadLettered => "dead_lettered",
            MessageOutcome::Error => "error",
        }
    }
}

/// One consumer's counters and broker connection state.
#[derive(Debug, Default)]
pub struct ConsumerCounters {
    outcomes: [AtomicU64; MESSAGE_OUTCOMES.len()],
    /// `None` while connected; otherwise why not (for `/readyz`).
    broker: std::sync::Mutex<Option<String>>,
    connected: std::sync::atomic::AtomicBool,
    connects: AtomicU64,
    /// Deliveries waiting in process right now (store away, a copy in
    /// flight elsewhere).
    waiting: AtomicU64,
}

impl ConsumerCounters {
    /// One more delivery waits in process; the guard counts it done.
    pub fn wait(self: &Arc<Self>) -> Waiting {
        self.waiting.fetch_add(1, Ordering::Relaxed);
        Waiting(self.clone())
    }

    /// Deliveries waiting in process right now.
    pub fn waiting(&self) -> u64 {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Counts one delivery.
    pub fn record(&self, outcome: MessageOutcome) {
        self.outcomes[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// The count of one outcome.
    pub fn get(&self, outcome: MessageOutcome) -> u64 {
        self.outcomes[outcome as usize].load(Ordering::Relaxed)
    }

    /// The broker connection is up.
    pub fn set_connected(&self) {
        *self.broker.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.connected.store(true, Ordering::Relaxed);
        self.connects.fetch_add(1, Ordering::Relaxed);
    }

    /// How many times the broker connection came up.
    pub fn connects(&self) -> u64 {
        self.connects.load(Ordering::Relaxed)
    }

    /// The broker connection is down, and why.
    pub fn set_disconnected(&self, why: impl Into<String>) {
        *self.broker.lock().unwrap_or_else(|p| p.into_inner()) = Some(why.into());
        self.connected.store(false, Ordering::Relaxed);
    }

    /// `Ok` when connected, else the last reason.
    pub fn broker_state(&self) -> Result<(), String> {
        if self.connected.load(Ordering::Relaxed) {
            return Ok(());
        }
        Err(self
            .broker
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .unwrap_or_else(|| "connecting".into()))
    }
}

/// A delivery waiting in process ([`ConsumerCounters::wait`]).
#[derive(Debug)]
pub struct Waiting(Arc<ConsumerCounters>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Where `idemgate_worker_connections` comes from (the server's balance).
pub trait WorkerConnections: Send + Sync + std::fmt::Debug {
    /// Open connections per worker, in worker order.
    fn open_connections(&self) -> Vec<usize>;
}

/// The limit that refused a claim before it was made
/// (`idemgate_claims_refused_total{limit}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimLimit {
    /// `server.max_claims`.
    Process = 0,
    /// The claims one connection may leave live.
    Connection = 1,
    /// `server.max_captured_bytes`: the answers' budget.
    Answers = 2,
}

/// One gateway's metrics.
#[derive(Debug, Default)]
pub struct Metrics {
    routes: Series<RouteCounters>,
    upstreams: Series<Histogram>,
    consumers: Series<ConsumerCounters>,
    /// Configuration reloads (`SIGHUP`): applied, refused.
    reloads: [AtomicU64; 2],
    /// A fingerprint of the configuration in force, secrets left out
    /// (`idemgate_config_info`).
    config_hash: std::sync::Mutex<String>,
    fallback_redis: AtomicU64,
    fallback_memory: AtomicU64,
    /// Claims currently held by this gateway (forwarded, not yet finished).
    pub claims_in_flight: AtomicU64,
    /// Latency of store operations as the engine sees them.
    pub store_latency: Histogram,
    wake_ups: [AtomicU64; WAKE_UPS.len()],
    /// Claims refused before they were made, by [`ClaimLimit`].
    claims_refused: [AtomicU64; 3],
    /// `server.max_claims` as started.
    pub claims_limit: AtomicU64,
    /// Open client connections per worker thread (set once at start).
    workers: std::sync::OnceLock<Arc<dyn WorkerConnections>>,
    /// Gauges read when rendered, registered by the parts that own them.
    gauges: std::sync::Mutex<Vec<Gauge>>,
}

/// The series of one kind, by name. Known at start-up, and grown by a
/// configuration reload (a new route gets its series); read by every
/// render, written only when a stack is built, never per request.
#[derive(Debug)]
struct Series<T>(std::sync::RwLock<BTreeMap<String, Arc<T>>>);

impl<T> Default for Series<T> {
    fn default() -> Self {
        Series(std::sync::RwLock::new(BTreeMap::new()))
    }
}

impl<T: Default> Series<T> {
    fn of<'a>(names: impl Iterator<Item = &'a str>) -> Self {
        Series(std::sync::RwLock::new(
            names.map(|n| (n.to_owned(), Arc::default())).collect(),
        ))
    }

    /// The series named `name`, added when new.
    fn get(&self, name: &str) -> Arc<T> {
        if let Some(found) = self.0.read().unwrap_or_else(|p| p.into_inner()).get(name) {
            return found.clone();
        }
        self.0
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .entry(name.to_owned())
            .or_default()
            .clone()
    }

    /// Every series, by name.
    fn all(&self) -> Vec<(String, Arc<T>)> {
        self.0
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(n, s)| (n.clone(), s.clone()))
            .collect()
    }
}

/// A gauge whose value is read when `/metrics` is rendered.
struct Gauge {
    name: &'static str,
    help: &'static str,
    read: Box<dyn Fn() -> u64 + Send + Sync>,
}

impl std::fmt::Debug for Gauge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

impl Metrics {
    /// A registry with one series per route (and `token`), upstream and
    /// consumer named.
    pub fn new<'a>(
        routes: impl IntoIterator<Item = &'a str>,
        upstreams: impl IntoIterator<Item = &'a str>,
        consumers: impl IntoIterator<Item = &'a str>,
    ) -> Self {
        Metrics {
            routes: Series::of(routes.into_iter().chain(std::iter::once("token"))),
            upstreams: Series::of(upstreams.into_iter()),
            consumers: Series::of(consumers.into_iter()),
            ..Default::default()
        }
    }

    /// Counts a configuration reload: applied (`true`) or refused.
    pub fn reloaded(&self, applied: bool) {
        self.reloads[usize::from(!applied)].fetch_add(1, Ordering::Relaxed);
    }

    /// Says which configuration is in force (a hash of the file).
    pub fn set_config_hash(&self, hash: &str) {
        *self.config_hash.lock().unwrap_or_else(|p| p.into_inner()) = hash.to_owned();
    }

    /// The counters of one route.
    pub fn route(&self, name: &str) -> Arc<RouteCounters> {
        self.routes.get(name)
    }

    /// The latency histogram of one upstream.
    pub fn upstream(&self, name: &str) -> Arc<Histogram> {
        self.upstreams.get(name)
    }

    /// The counters of one consumer.
    pub fn consumer(&self, name: &str) -> Arc<ConsumerCounters> {
        self.consumers.get(name)
    }

    /// Every consumer's counters, by name.
    pub fn consumers(&self) -> Vec<(String, Arc<ConsumerCounters>)> {
        self.consumers.all()
    }

    /// Where the per-worker connection counts come from.
    pub fn set_worker_balance(&self, balance: Arc<dyn WorkerConnections>) {
        let _ = self.workers.set(balance);
    }

    /// Counts a request sent down the SQL path because a fast layer failed.
    pub fn fallback(&self, layer: FallbackLayer) {
        match layer {
            FallbackLayer::Redis => &self.fallback_redis,
            FallbackLayer::Memory => &self.fallback_memory,
        }
        .fetch_add(1, Ordering::Relaxed);
    }

    /// Registers a gauge read at every render (`name` without labels).
    pub fn gauge(
        &self,
        name: &'static str,
        help: &'static str,
        read: impl Fn() -> u64 + Send + Sync + 'static,
    ) {
        self.gauges
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Gauge {
                name,
                help,
                read: Box::new(read),
            });
    }

    /// Counts a claim refused by a full limit.
    pub fn claim_refused(&self, limit: ClaimLimit) {
        self.claims_refused[limit as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one waiting duplicate's wake-up.
    pub fn woken(&self, by: WakeUp) {
        self.wake_ups[by as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// How many waits `by` ended.
    pub fn wake_ups(&self, by: WakeUp) -> u64 {
        self.wake_ups[by as usize].load(Ordering::Relaxed)
    }

    /// How many requests went down the SQL path because `layer` failed.
    pub fn fallbacks(&self, layer: FallbackLayer) -> u64 {
        match layer {
            FallbackLayer::Redis => &self.fallback_redis,
            FallbackLayer::Memory => &self.fallback_memory,
        }
        .load(Ordering::Relaxed)
    }

    /// Prometheus text exposition. (Long by design: one block per metric
    /// family, `HELP`, `TYPE` and its series, in the order a scrape shows
    /// them.)
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        out.push_str("# HELP idemgate_requests_total Requests by route and outcome.\n");
        out.push_str("# TYPE idemgate_requests_total counter\n");
        for (route, counters) in self.routes.all() {
            for outcome in OUTCOMES {
                let _ = writeln!(
                    out,
                    "idemgate_requests_total{{route=\"{route}\",outcome=\"{}\"}} {}",
                    outcome.as_str(),
                    counters.get(outcome)
                );
            }
        }
        let consumers = self.consumers.all();
        if !consumers.is_empty() {
            out.push_str(
                "# HELP idemgate_messages_total Message deliveries by consumer and outcome.\n",
            );
            out.push_str("# TYPE idemgate_messages_total counter\n");
            for (consumer, counters) in &consumers {
                for outcome in MESSAGE_OUTCOMES {
                    let _ = writeln!(
                        out,
                        "idemgate_messages_total{{consumer=\"{consumer}\",outcome=\"{}\"}} {}",
                        outcome.as_str(),
                        counters.get(outcome)
                    );
                }
            }
            out.push_str("# HELP idemgate_messages_waiting Deliveries waiting in process (store away, a copy in flight elsewhere).\n");
            out.push_str("# TYPE idemgate_messages_waiting gauge\n");
            for (consumer, counters) in &consumers {
                let _ = writeln!(
                    out,
                    "idemgate_messages_waiting{{consumer=\"{consumer}\"}} {}",
                    counters.waiting()
                );
            }
            out.push_str("# HELP idemgate_consumer_connected Whether the consumer's broker connection is up.\n");
            out.push_str("# TYPE idemgate_consumer_connected gauge\n");
            for (consumer, counters) in &consumers {
                let _ = writeln!(
                    out,
                    "idemgate_consumer_connected{{consumer=\"{consumer}\"}} {}",
                    u8::from(counters.broker_state().is_ok())
                );
            }
        }
        out.push_str("# HELP idemgate_store_fallback_total Operations sent to SQL because the fast layer failed or was slow.\n");
        out.push_str("# TYPE idemgate_store_fallback_total counter\n");
        for (layer, counter) in [
            ("redis", &self.fallback_redis),
            ("memory", &self.fallback_memory),
        ] {
            let _ = writeln!(
                out,
                "idemgate_store_fallback_total{{layer=\"{layer}\"}} {}",
                counter.load(Ordering::Relaxed)
            );
        }
        out.push_str(
            "# HELP idemgate_upstream_duration_seconds Time to the upstream's response head.\n",
        );
        out.push_str("# TYPE idemgate_upstream_duration_seconds histogram\n");
        for (upstream, histogram) in self.upstreams.all() {
            histogram.render(
                &mut out,
                "idemgate_upstream_duration_seconds",
                &format!("upstream=\"{upstream}\""),
            );
        }
        out.push_str("# HELP idemgate_waiter_wakeups_total What ended the waits of duplicates (on_concurrent = \"wait\").\n");
        out.push_str("# TYPE idemgate_waiter_wakeups_total counter\n");
        for by in WAKE_UPS {
            let _ = writeln!(
                out,
                "idemgate_waiter_wakeups_total{{by=\"{}\"}} {}",
                by.as_str(),
                self.wake_ups(by)
            );
        }
        out.push_str("# HELP idemgate_claims_in_flight Claims this gateway holds right now.\n");
        out.push_str("# TYPE idemgate_claims_in_flight gauge\n");
        let _ = writeln!(
            out,
            "idemgate_claims_in_flight {}",
            self.claims_in_flight.load(Ordering::Relaxed)
        );
        out.push_str("# HELP idemgate_config_reloads_total Configuration reloads (SIGHUP), applied or refused.\n");
        out.push_str("# TYPE idemgate_config_reloads_total counter\n");
        for (i, result) in ["applied", "refused"].iter().enumerate() {
            let _ = writeln!(
                out,
                "idemgate_config_reloads_total{{result=\"{result}\"}} {}",
                self.reloads[i].load(Ordering::Relaxed)
            );
        }
        let hash = self
            .config_hash
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if !hash.is_empty() {
            out.push_str(
                "# HELP idemgate_config_info The configuration in force (a fingerprint of it, secrets left out).\n",
            );
            out.push_str("# TYPE idemgate_config_info gauge\n");
            let _ = writeln!(out, "idemgate_config_info{{hash=\"{hash}\"}} 1");
        }
        out.push_str("# HELP idemgate_claims_limit Claims this gateway may hold at once (server.max_claims).\n");
        out.push_str("# TYPE idemgate_claims_limit gauge\n");
        let _ = writeln!(
            out,
            "idemgate_claims_limit {}",
            self.claims_limit.load(Ordering::Relaxed)
        );
        out.push_str("# HELP idemgate_claims_refused_total Claims refused before they were made, by the limit that was full.\n");
        out.push_str("# TYPE idemgate_claims_refused_total counter\n");
        for (i, limit) in ["process", "connection", "answers"].iter().enumerate() {
            let _ = writeln!(
                out,
                "idemgate_claims_refused_total{{limit=\"{limit}\"}} {}",
                self.claims_refused[i].load(Ordering::Relaxed)
            );
        }
        if let Some(open) = crate::limits::open_descriptors() {
            out.push_str("# HELP idemgate_open_descriptors Descriptors this process has open.\n");
            out.push_str("# TYPE idemgate_open_descriptors gauge\n");
            let _ = writeln!(out, "idemgate_open_descriptors {open}");
        }
        if let Some(limit) = crate::limits::descriptor_limit() {
            out.push_str(
                "# HELP idemgate_descriptor_limit The soft descriptor limit (ulimit -n).\n",
            );
            out.push_str("# TYPE idemgate_descriptor_limit gauge\n");
            let _ = writeln!(out, "idemgate_descriptor_limit {limit}");
        }
        if let Some(balance) = self.workers.get() {
            out.push_str(
                "# HELP idemgate_worker_connections Open client connections per worker thread.\n",
            );
            out.push_str("# TYPE idemgate_worker_connections gauge\n");
            for (worker, open) in balance.open_connections().iter().enumerate() {
                let _ = writeln!(
                    out,
                    "idemgate_worker_connections{{worker=\"{worker}\"}} {open}"
                );
            }
        }
        for gauge in self.gauges.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = writeln!(out, "# HELP {} {}", gauge.name, gauge.help);
            let _ = writeln!(out, "# TYPE {} gauge", gauge.name);
            let _ = writeln!(out, "{} {}", gauge.name, (gauge.read)());
        }
        out.push_str("# HELP idemgate_store_duration_seconds Latency of store operations.\n");
        out.push_str("# TYPE idemgate_store_duration_seconds histogram\n");
        self.store_latency
            .render(&mut out, "idemgate_store_duration_seconds", "op=\"all\"");
        out
    }
}
