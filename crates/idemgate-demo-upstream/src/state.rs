//! The demo's business state: orders, coupons, and execution counters.
//!
//! One std `Mutex` guards everything: every transition is a few map
//! operations with no `.await` inside, so a blocking lock held for
//! microseconds is cheaper than an async one, and holding it across the
//! check and the write is what makes each transition atomic — the same job a
//! database transaction does in a real service.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use super::faults::FaultPlan;

/// All state of one demo upstream.
#[derive(Default)]
pub struct DemoState {
    business: Mutex<Business>,
    pub(super) faults: Mutex<FaultPlan>,
    requests: AtomicU64,
    running: AtomicU64,
    peak_running: AtomicU64,
    http2_requests: AtomicU64,
    /// Copies of one request running at once, by its `Idempotency-Key`.
    copies: Mutex<Copies>,
    /// Every `X-Delivery-Count` a consumer sent, in arrival order.
    delivery_counts: Mutex<Vec<u64>>,
}

#[derive(Default)]
struct Copies {
    running: HashMap<String, u64>,
    peak: u64,
}

/// A business request being served; dropped when its body has gone out.
pub(super) struct Running(std::sync::Arc<DemoState>, Option<String>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
        if let Some(key) = self.1.take() {
            let mut copies = self.0.copies.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(n) = copies.running.get_mut(&key) {
                *n -= 1;
                if *n == 0 {
                    copies.running.remove(&key);
                }
            }
        }
    }
}

#[derive(Default)]
struct Business {
    orders: HashMap<String, Order>,
    orders_by_key: HashMap<String, String>,
    used_coupons: HashMap<String, String>,
    executions: BTreeMap<String, BTreeMap<String, u64>>,
    /// The answer of the last `/actions/{name}` executed under a key, for
    /// the status endpoint (reconciliation).
    answers: HashMap<String, serde_json::Value>,
}

/// An order and where it stands.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Order {
    pub order_id: String,
    pub status: &'static str,
    pub item: String,
    pub amount: i64,
    pub coupon: Option<String>,
}

/// `GET /stats`.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Stats {
    /// action → key → how many times it really executed.
    pub executions: BTreeMap<String, BTreeMap<String, u64>>,
    /// Sum of all executions.
    pub total_executions: u64,
    /// Requests received, including repeats that did nothing.
    pub requests: u64,
    /// Most business requests ever served at once (head to end of body).
    #[serde(default)]
    pub peak_running: u64,
    /// Requests that arrived over HTTP/2.
    #[serde(default)]
    pub http2_requests: u64,
    /// Most copies of one request (one `Idempotency-Key`) ever served at
    /// once: above 1, a duplicate ran beside its first copy.
    #[serde(default)]
    pub peak_copies: u64,
    /// Every `X-Delivery-Count` received, in arrival order (an MQ
    /// consumer's count of its attempts).
    #[serde(default)]
    pub delivery_counts: Vec<u64>,
}

/// The answer of a state transition.
pub(super) enum Transition<T> {
    Done(T),
    AlreadyDone(T),
    Refused(&'static str),
    Unknown,
}

impl DemoState {
    fn lock(&self) -> std::sync::MutexGuard<'_, Business> {
        // A panic while holding the lock cannot leave a half-applied
        // transition (each is a few infallible map operations), so a
        // poisoned lock is safe to keep using.
        self.business.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn count_request(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn start_running(self: std::sync::Arc<Self>, key: Option<&str>) -> Running {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak_running.fetch_max(now, Ordering::SeqCst);
        if let Some(key) = key {
            let mut copies = self.copies.lock().unwrap_or_else(|p| p.into_inner());
            let n = copies.running.entry(key.to_owned()).or_default();
            *n += 1;
            let n = *n;
            copies.peak = copies.peak.max(n);
        }
        Running(self.clone(), key.map(str::to_owned))
    }

    /// How many times `action` executed for `key`.
    pub fn executions(&self, action: &str, key: &str) -> u64 {
        self.lock()
            .executions
            .get(action)
            .and_then(|keys| keys.get(key))
            .copied()
            .unwrap_or(0)
    }

    /// Every counter.
    pub fn stats(&self) -> Stats {
        let business = self.lock();
        Stats {
            total_executions: business.executions.values().flat_map(|k| k.values()).sum(),
            executions: business.executions.clone(),
            requests: self.requests.load(Ordering::Relaxed),
            peak_running: self.peak_running.load(Ordering::SeqCst),
            http2_requests: self.http2_requests.load(Ordering::Relaxed),
            peak_copies: self.copies.lock().unwrap_or_else(|p| p.into_inner()).peak,
            delivery_counts: self
                .delivery_counts
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        }
    }

    /// Notes a consumer's `X-Delivery-Count`.
    pub(super) fn saw_delivery_count(&self, count: u64) {
        self.delivery_counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(count);
    }

    /// Counts a request that arrived over HTTP/2.
    pub(super) fn saw_http2(&self) {
        self.http2_requests.fetch_add(1, Ordering::Relaxed);
    }

    /// Forgets everything (tests, demos).
    pub fn reset(&self) {
        *self.lock() = Business::default();
        self.requests.store(0, Ordering::Relaxed);
        self.peak_running.store(0, Ordering::SeqCst);
        self.http2_requests.store(0, Ordering::Relaxed);
        self.copies.lock().unwrap_or_else(|p| p.into_inner()).peak = 0;
        self.delivery_counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// A non-idempotent action: executes every time; returns the count.
    pub(super) fn execute(&self, action: &str, key: &str) -> u64 {
        let mut business = self.lock();
        record(&mut business, action, key)
    }

    /// Remembers the answer an action executed under `key` gave.
    pub(super) fn remember_answer(&self, key: &str, answer: serde_json::Value) {
        self.lock().answers.insert(key.to_owned(), answer);
    }

    /// The answer of the last action executed under `key`, if one ran.
    pub(super) fn answer_for(&self, key: &str) -> Option<serde_json::Value> {
        self.lock().answers.get(key).cloned()
    }

    /// Creates an order (deducting its coupon in the same step), unless the
    /// idempotency key already created one.
    pub(super) fn create_order(
        &self,
        key: Option<&str>,
        item: String,
        amount: i64,
        coupon: Option<String>,
    ) -> Transition<Order> {
        let mut business = self.lock();
        if let Some(existing) = key
            .and_then(|k| business.orders_by_key.get(k))
            .and_then(|id| business.orders.get(id))
        {
            return Transition::AlreadyDone(existing.clone());
        }
        if let Some(c) = &coupon
            && business.used_coupons.contains_key(c)
        {
            return Transition::Refused("coupon already used");
        }
        let order_id = format!("ord_{}", uuid::Uuid::now_v7().simple());
        let order = Order {
            order_id: order_id.clone(),
            status: "WAIT_PAY",
            item,
            amount,
            coupon: coupon.clone(),
        };
        if let Some(c) = coupon {
            business.used_coupons.insert(c.clone(), order_id.clone());
            record(&mut business, "deduct_coupon", &c);
        }
        if let Some(k) = key {
            business
                .orders_by_key
                .insert(k.to_owned(), order_id.clone());
        }
        business.orders.insert(order_id.clone(), order.clone());
        record(&mut business, "create_order", key.unwrap_or(&order_id));
        Transition::Done(order)
    }

    /// `UNUSED → USED`; a repeat for the same order answers success.
    pub(super) fn deduct_coupon(&self, coupon: &str, order_id: &str) -> Transition<String> {
        let mut business = self.lock();
        match business.used_coupons.get(coupon) {
            Some(owner) if owner == order_id => Transition::AlreadyDone("USED".into()),
            Some(_) => Transition::Refused("coupon already used by another order"),
            None => {
                business
                    .used_coupons
                    .insert(coupon.to_owned(), order_id.to_owned());
                record(&mut business, "deduct_coupon", coupon);
                Transition::Done("USED".into())
            }
        }
    }

    /// `WAIT_PAY → PAID`, only from `WAIT_PAY`.
    pub(super) fn pay(&self, order_id: &str) -> Transition<Order> {
        let mut business = self.lock();
        let Some(order) = business.orders.get_mut(order_id) else {
            return Transition::Unknown;
        };
        if order.status == "PAID" {
            return Transition::AlreadyDone(order.clone());
        }
        order.status = "PAID";
        let paid = order.clone();
        record(&mut business, "pay_order", order_id);
        Transition::Done(paid)
    }

    /// Looks an order up.
    pub(super) fn order(&self, order_id: &str) -> Option<Order> {
        self.lock().orders.get(order_id).cloned()
    }
}

fn record(business: &mut Business, action: &str, key: &str) -> u64 {
    let count = business
        .executions
        .entry(action.to_owned())
        .or_default()
        .entry(key.to_owned())
        .or_default();
    *count += 1;
    *count
}
