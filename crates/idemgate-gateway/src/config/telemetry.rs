//! `[telemetry]`: traces exported over OTLP — the schema, the default
//! service name, and the checks its keys need (the exporter itself is
//! built by the binary, which reads these values).

use serde::Deserialize;

/// The `service.name` exported spans carry.
const DEFAULT_SERVICE_NAME: &str = "idemgate";

/// `[telemetry]`: traces exported over OTLP; off until `otlp_endpoint` is
/// set.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    /// The collector: `http://host:4317` for gRPC, the base URL
    /// (`http://host:4318`) for HTTP/protobuf.
    pub otlp_endpoint: Option<String>,
    /// `"grpc"` (the default) or `"http/protobuf"`.
    #[serde(default)]
    pub otlp_protocol: OtlpProtocol,
    /// The `service.name` resource attribute.
    #[serde(default = "default_service_name")]
    pub service_name: String,
}

/// How spans travel to the collector.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub enum OtlpProtocol {
    /// OTLP/gRPC (port 4317).
    #[default]
    #[serde(rename = "grpc")]
    Grpc,
    /// OTLP/HTTP with protobuf bodies, POSTed to `<endpoint>/v1/traces`
    /// (port 4318).
    #[serde(rename = "http/protobuf")]
    HttpProtobuf,
}

impl OtlpProtocol {
    /// Its name in the configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            OtlpProtocol::Grpc => "grpc",
            OtlpProtocol::HttpProtobuf => "http/protobuf",
        }
    }
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otlp_endpoint: None,
            otlp_protocol: OtlpProtocol::default(),
            service_name: default_service_name(),
        }
    }
}

fn default_service_name() -> String {
    DEFAULT_SERVICE_NAME.into()
}

impl TelemetryConfig {
    /// Checks `[telemetry]`: a collector beside the gateway, a service name.
    pub(super) fn check(&self, add: &mut dyn FnMut(String, String)) {
        if let Some(endpoint) = &self.otlp_endpoint {
            match url::Url::parse(endpoint) {
                Ok(url) if url.scheme() == "http" && url.host().is_some() => {}
                Ok(url) if url.scheme() == "https" => add(
                    "telemetry.otlp_endpoint".into(),
                    format!(
                        "{endpoint:?}: spans are exported in plain HTTP/2 or HTTP to a collector \
                         beside the gateway (an OpenTelemetry Collector or agent on the host or \
                         in the pod), which forwards them over TLS; https is not supported"
                    ),
                ),
                _ => add(
                    "telemetry.otlp_endpoint".into(),
                    format!("{endpoint:?} is not a URL like \"http://127.0.0.1:4317\""),
                ),
            }
        }
        if self.service_name.trim().is_empty() {
            add("telemetry.service_name".into(), "must not be empty".into());
        }
    }
}
