//! Distributed tracing: the seam between the crates that make spans and the
//! binary that exports them (docs/configuration.md, `[telemetry]`).
//!
//! Every crate makes its spans with `tracing` under the target [`TARGET`]
//! (`request`, `store.claim`, `upstream`, `message`, …) and calls
//! [`continue_from`] and [`inject`] for W3C Trace Context (`traceparent`,
//! `tracestate`). Neither knows OpenTelemetry: the binary that exports
//! spans installs a [`Propagation`] once, at start-up. Until it does (traces
//! off, or a library user who exports nothing), [`enabled`] is false, the
//! spans' callsites are disabled by the log filter, and the hot path pays
//! one atomic load per hook.

use std::sync::OnceLock;

use http::HeaderMap;

/// The `tracing` target of every span meant for export. Log output leaves
/// it out; the exporter takes only it.
pub const TARGET: &str = "idemgate::span";

/// How a span is tied to the trace context on the wire.
#[derive(Clone, Copy)]
pub struct Propagation {
    /// Makes the trace context in `headers` (a client's `traceparent`) the
    /// parent of `span`.
    pub extract: fn(&HeaderMap, &tracing::Span),
    /// Writes `span`'s context into `headers` for the next hop, replacing
    /// what was there.
    pub inject: fn(&tracing::Span, &mut HeaderMap),
}

static PROPAGATION: OnceLock<Propagation> = OnceLock::new();

/// Turns tracing on for this process. Only the first call counts; returns
/// whether it was this one.
pub fn install(propagation: Propagation) -> bool {
    PROPAGATION.set(propagation).is_ok()
}

/// Whether spans are exported: the crates make their spans only then.
#[inline]
pub fn enabled() -> bool {
    PROPAGATION.get().is_some()
}

/// `make`'s span when spans are exported, else the empty span (so a
/// library user whose own subscriber shows every target sees none of ours).
#[inline]
pub fn span(make: impl FnOnce() -> tracing::Span) -> tracing::Span {
    if enabled() {
        make()
    } else {
        tracing::Span::none()
    }
}

/// Continues the client's trace in `span` (a request's root span).
pub fn continue_from(headers: &HeaderMap, span: &tracing::Span) {
    if let Some(p) = PROPAGATION.get() {
        (p.extract)(headers, span);
    }
}

/// Writes `span`'s trace context into a request about to leave.
pub fn inject(span: &tracing::Span, headers: &mut HeaderMap) {
    if let Some(p) = PROPAGATION.get() {
        (p.inject)(span, headers);
    }
}
