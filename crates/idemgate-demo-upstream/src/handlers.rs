//! The demo upstream's HTTP endpoints.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::body::Body;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::json;
use sha2::{Digest, Sha256};

use super::faults::{DropConnection, DropPoint, FaultPlan};
use super::state::{DemoState, Transition};

type AppState = State<Arc<DemoState>>;

/// JSON body without insisting on `Content-Type`: payment providers and
/// hand-typed `curl` commands do not always send it.
struct Lenient<T>(T);

impl<T: serde::de::DeserializeOwned, S: Send + Sync> axum::extract::FromRequest<S> for Lenient<T> {
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Response> {
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(IntoResponse::into_response)?;
        serde_json::from_slice(&bytes).map(Lenient).map_err(|e| {
            (
                StatusCode::BAD_REQUEST,
                Json(json!({"error": e.to_string()})),
            )
                .into_response()
        })
    }
}

/// Every endpoint; business endpoints go through the fault switches.
pub(super) fn router(state: Arc<DemoState>) -> axum::Router {
    let business = axum::Router::new()
        .route("/orders", post(create_order))
        .route("/orders/{id}", get(get_order))
        .route("/coupons/deduct", post(deduct_coupon))
        .route("/callbacks/payment", post(pay_notify))
        .route("/actions/{name}", post(action).put(action))
        .route("/mq/push", post(mq_push))
        .route("/jobs/compensate", post(compensate))
        .route("/echo", any(echo))
        .route("/echo/{*rest}", any(echo))
        .route("/stream", get(stream))
        .layer(middleware::from_fn_with_state(state.clone(), apply_faults));
    axum::Router::new()
        .merge(business)
        .route("/stats", get(stats))
        // Outside the fault switches: armed faults are for the business
        // requests a retry repeats, not for the gateway's question.
        .route("/actions/by-key/{key}", get(action_status))
        .route("/reset", post(reset))
        .route("/faults", post(arm_faults).delete(clear_faults))
        .route("/healthz", get(|| async { Json(json!({"status": "ok"})) }))
        .with_state(state)
}

async fn apply_faults(State(state): AppState, req: Request, next: Next) -> Response {
    state.count_request();
    if let Some(count) = req
        .headers()
        .get("x-delivery-count")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
    {
        state.saw_delivery_count(count);
    }
    // Counts this request as running until its whole body has gone out,
    // and as one copy of its request (by `Idempotency-Key`).
    let running = state.clone().start_running(idempotency_key(req.headers()));
    let armed = state
        .faults
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    let faults = armed.with_headers(req.headers());
    if let Some(delay) = faults.delay {
        tokio::time::sleep(delay).await;
    }
    if let Some(status) = faults.fail_status {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
        return (
            status,
            Json(json!({"error": "demo fault: failing on purpose"})),
        )
            .into_response();
    }
    let mut response = match faults.drop {
        Some(DropPoint::Before) => Response::new(Body::empty()),
        _ => next.run(req).await,
    };
    if faults.drop.is_some() {
        response.extensions_mut().insert(DropConnection);
    }
    if faults.cut_body {
        // Committed; the head and a few bytes go out, then the stream fails
        // and hyper resets the connection mid-body.
        response
            .headers_mut()
            .remove(axum::http::header::CONTENT_LENGTH);
        let chunks: [Result<bytes::Bytes, std::io::Error>; 2] = [
            Ok(bytes::Bytes::from_static(b"{\"partial\":")),
            Err(std::io::Error::other("demo fault: body cut")),
        ];
        *response.body_mut() = Body::from_stream(futures_util::stream::iter(chunks));
    }
    if let Some(stall) = faults.stall_body {
        // Committed; the head and 5 bytes go out, then nothing for `stall`,
        // then the rest.
        let body = std::mem::replace(response.body_mut(), Body::empty());
        let whole = axum::body::to_bytes(body, usize::MAX)
            .await
            .unwrap_or_default();
        let cut = whole.len().min(5);
        let (head, rest) = (whole.slice(..cut), whole.slice(cut..));
        let chunks = futures_util::stream::iter([Ok::<_, std::io::Error>(head)]).chain(
            futures_util::stream::once(async move {
                tokio::time::sleep(stall).await;
                Ok(rest)
            }),
        );
        *response.body_mut() = Body::from_stream(chunks);
    }
    let inner = std::mem::replace(response.body_mut(), Body::empty());
    *response.body_mut() = Body::new(Tracked { inner, running });
    response
}

/// A body that keeps its request counted as running until it is done;
/// framing (the size hint) is the inner body's.
struct Tracked {
    inner: Body,
    #[allow(dead_code)] // held for its Drop
    running: super::state::Running,
}

impl http_body::Body for Tracked {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

fn idempotency_key(headers: &HeaderMap) -> Option<&str> {
    headers.get("idempotency-key").and_then(|v| v.to_str().ok())
}

#[derive(Deserialize)]
struct NewOrder {
    #[serde(default = "default_item")]
    item: String,
    #[serde(default)]
    amount: i64,
    coupon: Option<String>,
}

fn default_item() -> String {
    "demo-item".into()
}

async fn create_order(
    State(state): AppState,
    headers: HeaderMap,
    Lenient(order): Lenient<NewOrder>,
) -> Response {
    let key = idempotency_key(&headers);
    match state.create_order(key, order.item, order.amount, order.coupon) {
        Transition::Done(o) => (
            StatusCode::CREATED,
            Json(json!({"order": o, "repeat": false})),
        ),
        Transition::AlreadyDone(o) => (
            StatusCode::CREATED,
            Json(json!({"order": o, "repeat": true})),
        ),
        Transition::Refused(why) => (StatusCode::CONFLICT, Json(json!({"error": why}))),
        Transition::Unknown => (StatusCode::NOT_FOUND, Json(json!({"error": "unknown"}))),
    }
    .into_response()
}

async fn get_order(State(state): AppState, Path(id): Path<String>) -> Response {
    match state.order(&id) {
        Some(o) => Json(json!({"order": o})).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "unknown order"})),
        )
            .into_response(),
    }
}

#[derive(Deserialize)]
struct Deduct {
    coupon: String,
    order_id: String,
}

async fn deduct_coupon(State(state): AppState, Lenient(d): Lenient<Deduct>) -> Response {
    match state.deduct_coupon(&d.coupon, &d.order_id) {
        Transition::Done(s) => Json(json!({"coupon": d.coupon, "status": s, "repeat": false})),
        Transition::AlreadyDone(s) => {
            Json(json!({"coupon": d.coupon, "status": s, "repeat": true}))
        }
        Transition::Refused(why) => {
            return (StatusCode::CONFLICT, Json(json!({"error": why}))).into_response();
        }
        Transition::Unknown => {
            return (StatusCode::NOT_FOUND, Json(json!({"error": "unknown"}))).into_response();
        }
    }
    .into_response()
}

#[derive(Deserialize)]
struct PayNotify {
    trade_no: String,
    order_id: String,
}

async fn pay_notify(State(state): AppState, Lenient(n): Lenient<PayNotify>) -> Response {
    match state.pay(&n.order_id) {
        Transition::Done(o) => {
            Json(json!({"result": "success", "trade_no": n.trade_no, "order": o, "repeat": false}))
                .into_response()
        }
        Transition::AlreadyDone(o) => {
            Json(json!({"result": "success", "trade_no": n.trade_no, "order": o, "repeat": true}))
                .into_response()
        }
        _ => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "unknown order"})),
        )
            .into_response(),
    }
}

/// Not idempotent on purpose: every call is an execution.
async fn action(
    State(state): AppState,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let key = idempotency_key(&headers).unwrap_or("-").to_owned();
    let execution = state.execute(&name, &key);
    let body = json!({
        "action": name,
        "key": key,
        "execution": execution,
        "execution_id": uuid::Uuid::now_v7().to_string(),
        "body_bytes": body.len(),
    });
    state.remember_answer(&key, body.clone());
    let mut response = (
        StatusCode::CREATED,
        [("x-demo-execution", execution.to_string())],
        Json(body),
    )
        .into_response();
    // `X-Demo-Set-Cookie: v` answers with a session cookie, so tests can see
    // that a replay never hands one client's session to another request.
    if let Some(cookie) = headers.get("x-demo-set-cookie")
        && let Ok(value) = axum::http::HeaderValue::from_bytes(
            format!("session={}", String::from_utf8_lossy(cookie.as_bytes())).as_bytes(),
        )
    {
        response.headers_mut().insert("set-cookie", value);
    }
    // `X-Demo-Response-Bytes: N` pads the answer to N bytes (big responses).
    if let Some(n) = headers
        .get("x-demo-response-bytes")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
    {
        *response.body_mut() = Body::from(vec![b'z'; n]);
    }
    response
}

/// `GET /actions/by-key/{key}`: whether an action ran under this
/// `Idempotency-Key` — `200` with its answer, or `404`. The status endpoint
/// a gateway asks before it forwards an uncertain request again
/// (`reconcile_path = "/actions/by-key/{key}"`).
///
/// `?status=503` answers that status instead (a broken status endpoint);
/// `?delay_ms=N` answers N ms late (a hung one).
async fn action_status(
    State(state): AppState,
    Path(key): Path<String>,
    Query(forced): Query<ForcedStatus>,
) -> Response {
    if let Some(ms) = forced.delay_ms {
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
    if let Some(status) = forced.status.and_then(|s| StatusCode::from_u16(s).ok()) {
        return (status, Json(json!({"error": "demo fault: status forced"}))).into_response();
    }
    match state.answer_for(&key) {
        Some(answer) => (StatusCode::OK, Json(answer)).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "no action ran under this key"})),
        )
            .into_response(),
    }
}

#[derive(Deserialize)]
struct ForcedStatus {
    status: Option<u16>,
    delay_ms: Option<u64>,
}

/// An MQ consumer endpoint that is *not* idempotent on its own: every
/// delivery of `X-Msg-Id` executes (the gateway's callback route dedupes).
async fn mq_push(State(state): AppState, headers: HeaderMap) -> Response {
    let id = headers
        .get("x-msg-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-");
    let topic = headers
        .get("x-topic")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-");
    let execution = state.execute("mq_push", &format!("{topic}/{id}"));
    Json(json!({"ack": true, "msg_id": id, "topic": topic, "execution": execution})).into_response()
}

#[derive(Deserialize)]
struct Compensation {
    job_id: String,
    step: String,
}

/// A compensation job's step, re-run by its scheduler when the commit ACK
/// was lost; executes on every call (the gateway dedupes).
async fn compensate(State(state): AppState, Lenient(c): Lenient<Compensation>) -> Response {
    let execution = state.execute("compensate", &format!("{}/{}", c.job_id, c.step));
    Json(json!({"done": true, "job_id": c.job_id, "step": c.step, "execution": execution}))
        .into_response()
}

/// Echoes what arrived, hashing the body as it streams in.
async fn echo(method: Method, uri: Uri, headers: HeaderMap, body: Body) -> Response {
    let mut hasher = Sha256::new();
    let mut length = 0u64;
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(bytes) => {
                length += bytes.len() as u64;
                hasher.update(&bytes);
            }
            Err(e) => {
                return (
                    StatusCode::BAD_REQUEST,
                    Json(json!({"error": e.to_string()})),
                )
                    .into_response();
            }
        }
    }
    let mut seen: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, value) in &headers {
        seen.entry(name.to_string())
            .or_default()
            .push(String::from_utf8_lossy(value.as_bytes()).into_owned());
    }
    Json(json!({
        "method": method.as_str(),
        "path": uri.path(),
        "query": uri.query(),
        "headers": seen,
        "body_bytes": length,
        "body_sha256": hex::encode(hasher.finalize()),
    }))
    .into_response()
}

#[derive(Deserialize)]
struct StreamParams {
    bytes: u64,
}

/// `GET /stream?bytes=N`: N bytes of `x`, in 64 KiB chunks, generated lazily.
async fn stream(Query(p): Query<StreamParams>) -> Response {
    const CHUNK: u64 = 64 * 1024;
    let chunks = p.bytes.div_ceil(CHUNK);
    let total = p.bytes;
    let body = futures_util::stream::iter((0..chunks).map(move |i| {
        let size = CHUNK.min(total - i * CHUNK) as usize;
        Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b'x'; size]))
    }));
    Body::from_stream(body).into_response()
}

async fn stats(State(state): AppState) -> Response {
    Json(state.stats()).into_response()
}

async fn reset(State(state): AppState) -> Response {
    state.reset();
    *state.faults.lock().unwrap_or_else(|p| p.into_inner()) = FaultPlan::default();
    StatusCode::NO_CONTENT.into_response()
}

async fn arm_faults(State(state): AppState, Lenient(plan): Lenient<FaultPlan>) -> Response {
    *state.faults.lock().unwrap_or_else(|p| p.into_inner()) = plan;
    StatusCode::NO_CONTENT.into_response()
}

async fn clear_faults(State(state): AppState) -> Response {
    *state.faults.lock().unwrap_or_else(|p| p.into_inner()) = FaultPlan::default();
    StatusCode::NO_CONTENT.into_response()
}
