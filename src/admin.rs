//! The admin listener: `/healthz`, `/readyz`, `/metrics` and `/admin/*`.
//!
//! It is a separate socket (`server.admin_listen`) so that operators can
//! firewall it; none of these paths exist on the public listener.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use serde_json::json;

use crate::metrics::Metrics;

/// What the admin endpoints read.
#[derive(Clone)]
pub struct AdminState {
    pub metrics: Arc<Metrics>,
}

/// The admin router.
pub fn router(state: AdminState) -> axum::Router {
    axum::Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn healthz() -> impl IntoResponse {
    Json(json!({"status": "ok"}))
}

async fn readyz(State(_state): State<AdminState>) -> impl IntoResponse {
    (StatusCode::OK, Json(json!({"status": "ready"})))
}

async fn metrics(State(state): State<AdminState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
}
