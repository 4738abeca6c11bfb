//! Traces: a real gateway process exporting over OTLP to a receiver in the
//! test (HTTP/protobuf and gRPC), an upstream that records the
//! `traceparent` it was sent, and the spans decoded as a collector would.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message;

use crate::support::{self, Http, dead_port, eventually};

/// One exported span, as the receiver decoded it.
#[derive(Debug, Clone)]
struct Exported {
    name: String,
    trace_id: String,
    span_id: String,
    parent: String,
    kind: i32,
    attributes: BTreeMap<String, String>,
    service: String,
}

#[derive(Clone, Default)]
struct Received(Arc<Mutex<Vec<Exported>>>);

impl Received {
    fn spans(&self) -> Vec<Exported> {
        self.0.lock().unwrap().clone()
    }

    fn take(&self, request: ExportTraceServiceRequest) {
        let mut spans = self.0.lock().unwrap();
        for resource in request.resource_spans {
            let service = resource
                .resource
                .iter()
                .flat_map(|r| r.attributes.iter())
                .find(|a| a.key == "service.name")
                .map(|a| text(a.value.as_ref().and_then(|v| v.value.as_ref())))
                .unwrap_or_default();
            for scope in resource.scope_spans {
                for span in scope.spans {
                    spans.push(Exported {
                        name: span.name,
                        trace_id: hex::encode(&span.trace_id),
                        span_id: hex::encode(&span.span_id),
                        parent: hex::encode(&span.parent_span_id),
                        kind: span.kind,
                        attributes: span
                            .attributes
                            .iter()
                            .map(|a| {
                                (
                                    a.key.clone(),
                                    text(a.value.as_ref().and_then(|v| v.value.as_ref())),
                                )
                            })
                            .collect(),
                        service: service.clone(),
                    });
                }
            }
        }
    }

    /// Waits for a span named `name` that `matches`.
    async fn wait_for(&self, name: &str, matches: impl Fn(&Exported) -> bool) -> Exported {
        let found = eventually(Duration::from_secs(15), || async {
            self.spans().iter().any(|s| s.name == name && matches(s))
        })
        .await;
        assert!(found, "no {name:?} span came; got {:#?}", self.spans());
        self.spans()
            .into_iter()
            .find(|s| s.name == name && matches(s))
            .unwrap()
    }
}

fn text(value: Option<&Value>) -> String {
    match value {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(n)) => n.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

/// Serves `handler` on a fresh port of 127.0.0.1, over HTTP/1.1 or (`h2`)
/// HTTP/2 without TLS; the port.
async fn serve<F, Fut, B>(h2: bool, handler: F) -> u16
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Response<B>> + Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let handler = handler.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let answer = handler(req);
                    async move { Ok::<_, Infallible>(answer.await) }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = if h2 {
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(io, service)
                        .await
                } else {
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, service)
                        .await
                };
            });
        }
    });
    port
}

/// An OTLP/HTTP receiver (`POST /v1/traces`, protobuf).
async fn http_receiver() -> (u16, Received) {
    let received = Received::default();
    let sink = received.clone();
    let port = serve(false, move |req: Request<Incoming>| {
        let sink = sink.clone();
        async move {
            assert_eq!(req.uri().path(), "/v1/traces");
            let body = req.into_body().collect().await.unwrap().to_bytes();
            sink.take(ExportTraceServiceRequest::decode(body).unwrap());
            Response::builder()
                .header("content-type", "application/x-protobuf")
                .body(Full::new(Bytes::new()))
                .unwrap()
        }
    })
    .await;
    (port, received)
}

/// An OTLP/gRPC receiver: HTTP/2 without TLS, the `Export` method's
/// length-prefixed message in, an empty answer and `grpc-status: 0` out.
async fn grpc_receiver() -> (u16, Received) {
    let received = Received::default();
    let sink = received.clone();
    let port = serve(true, move |req: Request<Incoming>| {
        let sink = sink.clone();
        async move {
            assert_eq!(
                req.uri().path(),
                "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
            );
            let body = req.into_body().collect().await.unwrap().to_bytes();
            // 1 byte "compressed", 4 bytes length, the message.
            assert_eq!(body[0], 0, "uncompressed");
            let length = u32::from_be_bytes(body[1..5].try_into().unwrap()) as usize;
            sink.take(ExportTraceServiceRequest::decode(&body[5..5 + length]).unwrap());
            let frames = futures_util::stream::iter([
                Ok::<_, Infallible>(Frame::data(Bytes::from_static(&[0, 0, 0, 0, 0]))),
                Ok(Frame::trailers({
                    let mut trailers = http::HeaderMap::new();
                    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
                    trailers
                })),
            ]);
            Response::builder()
                .header("content-type", "application/grpc")
                .body(StreamBody::new(frames))
                .unwrap()
        }
    })
    .await;
    (port, received)
}

/// An upstream that answers 201 and records the `traceparent` of each
/// request (`None` when it carried none).
async fn recording_upstream() -> (u16, Arc<Mutex<Vec<Option<String>>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let port = serve(false, move |req: Request<Incoming>| {
        let record = record.clone();
        async move {
            let parent = req
                .headers()
                .get("traceparent")
                .map(|v| v.to_str().unwrap().to_owned());
            record.lock().unwrap().push(parent);
            let _ = req.into_body().collect().await;
            Response::builder()
                .status(201)
                .body(Full::new(Bytes::from_static(b"{\"ok\":true}")))
                .unwrap()
        }
    })
    .await;
    (port, seen)
}

struct Traced {
    public: u16,
    admin: u16,
    child: std::process::Child,
    _dir: tempfile::TempDir,
}

impl Drop for Traced {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A gateway process with a key route and a pass-through route to
/// `upstream`, and `telemetry` as its `[telemetry]` section.
async fn gateway(upstream: u16, telemetry: &str, extra: &str) -> Traced {
    let dir = tempfile::tempdir().unwrap();
    let (public, admin) = (dead_port(), dead_port());
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:{public}\"\nadmin_listen = \"127.0.0.1:{admin}\"\n\
         [store]\ndatabase_url = \"sqlite://{}/records.db\"\n\
         [identity]\nheader = \"X-User-Id\"\n\
         [[upstreams]]\nname = \"up\"\nurl = \"http://127.0.0.1:{upstream}\"\n\
         [[routes]]\nname = \"orders\"\nmethods = [\"POST\"]\npath_prefix = \"/orders\"\n\
         upstream = \"up\"\nidempotency = \"key\"\n\
         [[routes]]\nname = \"pass\"\nmethods = [\"GET\"]\npath_prefix = \"/pass\"\nupstream = \"up\"\n\
         {extra}\n{telemetry}\n",
        dir.path().display()
    );
    let path = dir.path().join("idemgate.toml");
    std::fs::write(&path, text).unwrap();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["serve", "--config"])
        .arg(&path)
        // Batches leave every 100 ms instead of 5 s.
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let http = Http::default();
    support::wait_up(&http, &format!("http://127.0.0.1:{admin}/healthz")).await;
    Traced {
        public,
        admin,
        child,
        _dir: dir,
    }
}

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

/// A request is a span (route, policy, outcome, status) continuing the
/// client's `traceparent`, with store and upstream children; the upstream
/// receives the trace with the gateway's upstream span as its parent; a
/// replay is a span of its own with no upstream child.
#[tokio::test]
async fn a_request_is_a_span_tree_in_the_clients_trace_and_the_upstream_continues_it() {
    let (collector, received) = http_receiver().await;
    let (upstream, seen) = recording_upstream().await;
    let gw = gateway(
        upstream,
        &format!(
            "[telemetry]\notlp_endpoint = \"http://127.0.0.1:{collector}\"\n\
             otlp_protocol = \"http/protobuf\"\nservice_name = \"orders-gateway\""
        ),
        "",
    )
    .await;
    let http = Http::default();
    let url = format!("http://127.0.0.1:{}/orders", gw.public);
    let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let headers = [
        ("Idempotency-Key", "trace-1"),
        ("X-User-Id", "alice"),
        ("traceparent", traceparent.as_str()),
        // Naming the trace context as hop-by-hop does not strip the
        // gateway's own upstream context.
        ("Connection", "keep-alive, traceparent, tracestate"),
        ("Content-Type", "application/json"),
    ];
    let first = http.send("POST", &url, &headers, r#"{"amount":5}"#).await;
    assert_eq!(first.status, 201);

    let request = received
        .wait_for("POST orders", |s| {
            s.trace_id == CLIENT_TRACE
                && s.attributes
                    .get("outcome")
                    .is_some_and(|o| o == "forwarded")
        })
        .await;
    assert_eq!(
        request.parent, CLIENT_SPAN,
        "the client's span is the parent"
    );
    assert_eq!(request.service, "orders-gateway");
    assert_eq!(request.kind, 2, "SPAN_KIND_SERVER");
    assert_eq!(request.attributes["route"], "orders");
    assert_eq!(request.attributes["policy"], "key");
    assert_eq!(request.attributes["http.response.status_code"], "201");
    for child in ["store.claim", "store.complete", "POST up"] {
        let span = received
            .wait_for(child, |s| s.trace_id == CLIENT_TRACE)
            .await;
        assert_eq!(
            span.parent, request.span_id,
            "{child} is a child of the request"
        );
    }
    let upstream_span = received
        .wait_for("POST up", |s| s.trace_id == CLIENT_TRACE)
        .await;
    assert_eq!(upstream_span.kind, 3, "SPAN_KIND_CLIENT");
    assert_eq!(upstream_span.attributes["http.response.status_code"], "201");
    // What reached the upstream: the client's trace, the gateway's span.
    let sent = seen.lock().unwrap()[0]
        .clone()
        .expect("a traceparent upstream");
    assert_eq!(
        sent,
        format!("00-{CLIENT_TRACE}-{}-01", upstream_span.span_id)
    );

    // The retry: replayed, one more request span, no second upstream span.
    let replay_parent = format!("00-{CLIENT_TRACE}-{}-01", "1111111111111111");
    let replay_headers = [
        ("Idempotency-Key", "trace-1"),
        ("X-User-Id", "alice"),
        ("traceparent", replay_parent.as_str()),
        ("Content-Type", "application/json"),
    ];
    let again = http
        .send("POST", &url, &replay_headers, r#"{"amount":5}"#)
        .await;
    assert_eq!(again.status, 201);
    let replayed = received
        .wait_for("POST orders", |s| {
            s.attributes.get("outcome").is_some_and(|o| o == "replayed")
        })
        .await;
    assert_eq!(replayed.parent, "1111111111111111");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let upstream_spans = received
        .spans()
        .iter()
        .filter(|s| s.name == "POST up")
        .count();
    assert_eq!(upstream_spans, 1, "the replay never reached the upstream");
    assert_eq!(seen.lock().unwrap().len(), 1);
}

/// Over gRPC (the default protocol), a request without a `traceparent`
/// starts a trace; the upstream receives that trace's id.
#[tokio::test]
async fn over_grpc_a_request_without_traceparent_starts_the_trace_the_upstream_sees() {
    let (collector, received) = grpc_receiver().await;
    let (upstream, seen) = recording_upstream().await;
    let gw = gateway(
        upstream,
        &format!("[telemetry]\notlp_endpoint = \"http://127.0.0.1:{collector}\""),
        "",
    )
    .await;
    let http = Http::default();
    let answer = http
        .get(&format!("http://127.0.0.1:{}/pass/x", gw.public))
        .await;
    assert_eq!(answer.status, 201);
    let request = received
        .wait_for("GET pass", |s| {
            s.attributes.get("route").is_some_and(|r| r == "pass")
        })
        .await;
    assert_eq!(request.parent, "", "a root span");
    assert_eq!(request.attributes["policy"], "pass_through");
    assert_eq!(request.service, "idemgate");
    let sent = seen.lock().unwrap()[0]
        .clone()
        .expect("a traceparent upstream");
    assert_eq!(sent.split('-').nth(1), Some(request.trace_id.as_str()));
}

/// Traces off (no `[telemetry]`): the client's `traceparent` reaches the
/// upstream untouched, as any other end-to-end header.
#[tokio::test]
async fn without_telemetry_the_clients_traceparent_passes_through_unchanged() {
    let (upstream, seen) = recording_upstream().await;
    let gw = gateway(upstream, "", "").await;
    let http = Http::default();
    let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let answer = http
        .send(
            "GET",
            &format!("http://127.0.0.1:{}/pass/x", gw.public),
            &[("traceparent", traceparent.as_str())],
            "",
        )
        .await;
    assert_eq!(answer.status, 201);
    assert_eq!(
        seen.lock().unwrap()[0].as_deref(),
        Some(traceparent.as_str())
    );
    let _ = gw.admin;
}

/// A consumed message is a span (consumer, outcome) continuing the
/// producer's `traceparent` field, with the upstream call as its child.
#[tokio::test]
async fn a_consumed_message_is_a_span_continuing_the_producers_trace() {
    let Some(stream) = crate::support::brokers::RedisStream::new("traces_message", None).await
    else {
        return;
    };
    let (collector, received) = http_receiver().await;
    let (upstream, seen) = recording_upstream().await;
    let consumer = crate::support::brokers::consumer_toml(
        "events",
        &stream.url,
        &format!("stream = \"{}\"\ngroup = \"g\"", stream.name),
        "/orders/from-queue",
        r#"business_key = ["msg:header:order_id"]"#,
    )
    .replace("upstream = \"demo\"", "upstream = \"up\"");
    let gw = gateway(
        upstream,
        &format!(
            "[telemetry]\notlp_endpoint = \"http://127.0.0.1:{collector}\"\n\
             otlp_protocol = \"http/protobuf\""
        ),
        &consumer,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let producer = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    stream
        .add(&[("order_id", "t-1"), ("traceparent", producer.as_str())])
        .await;
    let message = received
        .wait_for("process events", |s| s.trace_id == CLIENT_TRACE)
        .await;
    assert_eq!(message.parent, CLIENT_SPAN);
    assert_eq!(message.kind, 5, "SPAN_KIND_CONSUMER");
    assert_eq!(message.attributes["consumer"], "events");
    assert_eq!(message.attributes["outcome"], "forwarded");
    let upstream_span = received
        .wait_for("POST up", |s| s.trace_id == CLIENT_TRACE)
        .await;
    assert_eq!(upstream_span.parent, message.span_id);
    let sent = seen.lock().unwrap()[0]
        .clone()
        .expect("a traceparent upstream");
    assert_eq!(
        sent,
        format!("00-{CLIENT_TRACE}-{}-01", upstream_span.span_id)
    );
    drop(gw);
    stream.delete().await;
}

/// `[telemetry]` is checked at start-up: a URL, plain HTTP to a collector
/// beside the gateway, a known protocol, a service name.
#[test]
fn telemetry_settings_are_checked_by_name() {
    use idemgate_gateway::config::Config;
    let refused = |section: &str| {
        let config = Config::parse(section, "test").map_err(|e| e.to_string())?;
        config
            .validate("test")
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let https = refused("[telemetry]\notlp_endpoint = \"https://collector:4317\"").unwrap_err();
    assert!(https.contains("telemetry.otlp_endpoint"), "{https}");
    let garbage = refused("[telemetry]\notlp_endpoint = \"collector\"").unwrap_err();
    assert!(garbage.contains("telemetry.otlp_endpoint"), "{garbage}");
    let protocol =
        refused("[telemetry]\notlp_endpoint = \"http://c:4317\"\notlp_protocol = \"http/json\"")
            .unwrap_err();
    assert!(
        protocol.contains("otlp_protocol") || protocol.contains("http/json"),
        "{protocol}"
    );
    let service = refused("[telemetry]\notlp_endpoint = \"http://c:4317\"\nservice_name = \" \"")
        .unwrap_err();
    assert!(service.contains("telemetry.service_name"), "{service}");
    refused(
        "[telemetry]\notlp_endpoint = \"http://127.0.0.1:4318\"\notlp_protocol = \"http/protobuf\"",
    )
    .unwrap();
}
