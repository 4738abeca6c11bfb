//! `[telemetry]`: the spans the crates make under
//! [`idemgate_core::trace::TARGET`], exported over OTLP (docs/configuration.md).
//!
//! The exporter is OpenTelemetry's own (`opentelemetry-otlp`, gRPC through
//! tonic or HTTP/protobuf through hyper), fed by the SDK's batch processor
//! on the gateway's tokio runtime: a span is queued when it closes (2048 at
//! most, `OTEL_BSP_MAX_QUEUE_SIZE`; past that it is dropped and counted,
//! never waited for) and sent in batches every 5 s (`OTEL_BSP_SCHEDULE_DELAY`).
//! `tracing-opentelemetry` turns the `tracing` spans into OpenTelemetry
//! spans; W3C Trace Context (`traceparent`, `tracestate`) is read from
//! clients and written upstream through the hooks installed here.

use http::HeaderMap;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TracerProvider};
use opentelemetry_http::{HeaderExtractor, HeaderInjector};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::Targets;

use idemgate_core::trace::{self, Propagation};
use idemgate_gateway::config::{OtlpProtocol, TelemetryConfig};

use super::TraceLayer;

/// How long shutdown waits for the collector to take the spans still
/// queued.
const SHUTDOWN_BUDGET: std::time::Duration = std::time::Duration::from_secs(5);

/// The running exporter; [`Exporter::shutdown`] sends what is queued.
pub(super) struct Exporter {
    provider: SdkTracerProvider,
}

/// With `otlp_endpoint` set: the exporter (on the current tokio runtime),
/// the layer that feeds it, and the propagation hooks installed.
pub(super) fn start(config: &TelemetryConfig) -> Result<Option<(Exporter, TraceLayer)>, String> {
    let Some(endpoint) = config.otlp_endpoint.as_deref() else {
        return Ok(None);
    };
    let exporter = match config.otlp_protocol {
        OtlpProtocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .build(),
        // The base URL, as for the collector's other signals.
        OtlpProtocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(format!("{}/v1/traces", endpoint.trim_end_matches('/')))
            .build(),
    }
    .map_err(|e| format!("telemetry.otlp_endpoint {endpoint:?}: {e}"))?;
    let processor =
        BatchSpanProcessor::builder(exporter, opentelemetry_sdk::runtime::Tokio).build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_resource(
            Resource::builder()
                .with_service_name(config.service_name.clone())
                .build(),
        )
        .build();
    let tracer = provider.tracer("idemgate");
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(Targets::new().with_target(trace::TARGET, tracing::Level::INFO))
        .boxed();
    trace::install(Propagation { extract, inject });
    tracing::info!(endpoint = %endpoint, protocol = config.otlp_protocol.as_str(), service = %config.service_name, layer = "telemetry", "exporting traces over OTLP");
    Ok(Some((Exporter { provider }, layer)))
}

impl Exporter {
    /// Exports the spans still queued, then stops.
    pub(super) async fn shutdown(self) {
        // The SDK blocks the calling thread until its export task answers;
        // that task runs on this runtime.
        // Bounded: a collector that does not answer must not hold the
        // process past an orchestrator's grace period (the spans still
        // queued are then lost, never the records).
        let provider = self.provider;
        let stopped = tokio::time::timeout(
            SHUTDOWN_BUDGET,
            tokio::task::spawn_blocking(move || provider.shutdown()),
        )
        .await;
        match stopped {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => {
                tracing::warn!(error = %e, layer = "telemetry", "the trace exporter did not stop cleanly");
            }
            Ok(Err(_)) | Err(_) => {
                tracing::warn!(budget = ?SHUTDOWN_BUDGET, layer = "telemetry", "the collector did not take the last spans in time; they are dropped");
            }
        }
    }
}

fn extract(headers: &HeaderMap, span: &tracing::Span) {
    let parent = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    // No (or an unreadable) traceparent: the span starts a trace.
    if parent.span().span_context().is_valid() {
        let _ = span.set_parent(parent);
    }
}

fn inject(span: &tracing::Span, headers: &mut HeaderMap) {
    TraceContextPropagator::new().inject_context(&span.context(), &mut HeaderInjector(headers));
    // The propagator writes `tracestate` even when it has no entries.
    if headers
        .get("tracestate")
        .is_some_and(|v| v.as_bytes().is_empty())
    {
        headers.remove("tracestate");
    }
}
