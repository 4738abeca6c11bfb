//! Fault switches: what the demo upstream does wrong on purpose.
//!
//! Per request, through headers: `X-Demo-Delay-Ms: 500`,
//! `X-Demo-Fail-Status: 503`, `X-Demo-Drop: before|after` (drop the
//! connection before acting, or after committing — the lost ACK),
//! `X-Demo-Cut-Body: 1` (commit, send the head and a few body bytes, then
//! reset — a response cut mid-body), `X-Demo-Stall-Body-Ms: 5000` (commit,
//! send the head and 5 body bytes, stall, then the rest — a slow body).
//! Armed for the next N requests, through `POST /faults` with
//! `{"delay_ms": 500, "fail_status": 503, "drop": "after", "count": 1}`
//! (`count` absent: until `DELETE /faults`). Armed faults are what a retrying
//! client meets, since a retry carries the same headers as the first try.

use std::time::Duration;

use http::HeaderMap;
use serde::Deserialize;

/// Marks a response that must not be sent: the connection is dropped.
#[derive(Debug, Clone, Copy)]
pub struct DropConnection;

/// When to drop the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DropPoint {
    /// Before acting: nothing was executed.
    Before,
    /// After committing: executed, but the answer is lost.
    After,
}

/// Faults armed with `POST /faults`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultPlan {
    /// Wait this many milliseconds before handling the request.
    pub delay_ms: Option<u64>,
    /// Answer with this status without acting (an invalid one: 503).
    pub fail_status: Option<u16>,
    /// Drop the connection before acting or after committing.
    pub drop: Option<DropPoint>,
    /// Commit, send the head and a few body bytes, then reset the connection.
    #[serde(default)]
    pub cut_body: bool,
    /// Commit, send the head and 5 body bytes, stall this many milliseconds,
    /// then send the rest.
    pub stall_body_ms: Option<u64>,
    /// How many requests the plan applies to; absent = all until cleared.
    pub count: Option<u64>,
}

/// The faults for one request.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Faults {
    pub delay: Option<Duration>,
    pub fail_status: Option<u16>,
    pub drop: Option<DropPoint>,
    pub cut_body: bool,
    pub stall_body: Option<Duration>,
}

impl FaultPlan {
    /// Takes this request's share of the armed plan.
    pub(super) fn take(&mut self) -> Faults {
        let armed = self.delay_ms.is_some()
            || self.fail_status.is_some()
            || self.drop.is_some()
            || self.cut_body
            || self.stall_body_ms.is_some();
        if !armed || self.count == Some(0) {
            return Faults::default();
        }
        if let Some(n) = self.count.as_mut() {
            *n -= 1;
        }
        Faults {
            delay: self.delay_ms.map(Duration::from_millis),
            fail_status: self.fail_status,
            drop: self.drop,
            cut_body: self.cut_body,
            stall_body: self.stall_body_ms.map(Duration::from_millis),
        }
    }
}

impl Faults {
    /// Header switches override the armed plan.
    pub(super) fn with_headers(mut self, headers: &HeaderMap) -> Self {
        let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        if let Some(ms) = get("x-demo-delay-ms").and_then(|v| v.parse().ok()) {
            self.delay = Some(Duration::from_millis(ms));
        }
        if let Some(status) = get("x-demo-fail-status").and_then(|v| v.parse().ok()) {
            self.fail_status = Some(status);
        }
        if let Some(ms) = get("x-demo-stall-body-ms").and_then(|v| v.parse().ok()) {
            self.stall_body = Some(Duration::from_millis(ms));
        }
        if get("x-demo-cut-body").is_some() {
            self.cut_body = true;
        }
        match get("x-demo-drop") {
            Some("before") => self.drop = Some(DropPoint::Before),
            Some("after") => self.drop = Some(DropPoint::After),
            _ => {}
        }
        self
    }
}
