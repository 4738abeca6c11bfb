//! An order service that mounts Idemgate's layers on its own axum handlers:
//! an `Idempotency-Key` route, a one-time-token route with its
//! `/token` endpoint, and a payment callback deduplicated by `trade_no`.
//!
//! ```sh
//! cargo run -p idemgate --example orders -- 127.0.0.1:3000
//! curl -i -X POST localhost:3000/orders -H 'Idempotency-Key: k1' -d '{"item":"book"}'
//! curl -i -X POST localhost:3000/orders -H 'Idempotency-Key: k1' -d '{"item":"book"}'   # replayed
//! curl -s localhost:3000/stats                                                            # one order
//! ```
//!
//! Records live in `ORDERS_DATABASE_URL` (default: SQLite in memory).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use axum::{Json, Router};
use idemgate::Idempotency;
use serde_json::{Value, json};

/// What the business really did: each counter moves once per execution.
#[derive(Default)]
struct Counts {
    orders: AtomicU64,
    checkouts: AtomicU64,
    payments: AtomicU64,
}

type Shared = State<Arc<Counts>>;

/// Creates an order; `X-Slow-Ms` makes it take its time (to try a client
/// that hangs up before the answer).
async fn create_order(State(counts): Shared, headers: HeaderMap) -> (StatusCode, Json<Value>) {
    if let Some(ms) = headers
        .get("x-slow-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
    {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let n = counts.orders.fetch_add(1, Ordering::SeqCst) + 1;
    // The stable key the layer forwards: the handler's own state check
    // would key on it.
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    (StatusCode::CREATED, Json(json!({"order": n, "key": key})))
}

async fn checkout(State(counts): Shared) -> (StatusCode, Json<Value>) {
    let n = counts.checkouts.fetch_add(1, Ordering::SeqCst) + 1;
    (StatusCode::CREATED, Json(json!({"checkout": n})))
}

async fn payment_notify(State(counts): Shared) -> Json<Value> {
    counts.payments.fetch_add(1, Ordering::SeqCst);
    Json(json!({"result": "success"}))
}

async fn stats(State(counts): Shared) -> Json<Value> {
    Json(json!({
        "orders": counts.orders.load(Ordering::SeqCst),
        "checkouts": counts.checkouts.load(Ordering::SeqCst),
        "payments": counts.payments.load(Ordering::SeqCst),
    }))
}

/// The application: plain axum routes, each with the layer that fits its
/// callers.
fn app(idempotency: &Idempotency, counts: Arc<Counts>) -> Result<Router, idemgate::CallbackError> {
    Ok(Router::new()
        .route(
            "/orders",
            post(create_order).route_layer(idempotency.key_layer("create-order")),
        )
        .route(
            "/checkout",
            post(checkout).route_layer(idempotency.token_layer("checkout")),
        )
        .route_service("/token", idempotency.token_endpoint(&["checkout"]))
        .route(
            "/payments/notify",
            post(payment_notify)
                .route_layer(idempotency.callback_layer("pay-notify", &["json:/trade_no"])?),
        )
        .route("/stats", get(stats))
        .with_state(counts))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:3000".into());
    // A file: the records must outlive the process, or a retry after a
    // restart would execute again.
    let database_url =
        std::env::var("ORDERS_DATABASE_URL").unwrap_or_else(|_| "sqlite://data/orders.db".into());
    let idempotency = Idempotency::builder()
        .database_url(database_url)
        .handler_deadline(Duration::from_secs(5))
        .build()
        .await?;
    let app = app(&idempotency, Arc::default())?;
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("orders listening on {}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
