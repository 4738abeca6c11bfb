//! The admin listener: `/healthz`, `/readyz`, `/metrics` and `/admin/keys`.
//!
//! It is a separate socket (`server.admin_listen`) so that operators can
//! firewall it; none of these paths exist on the public listener.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Deserialize;
use serde_json::json;

use idemgate_core::identity::Identity;
use idemgate_core::metrics::Metrics;
use idemgate_store::Store;

/// What the admin endpoints read.
#[derive(Clone)]
pub struct AdminState {
    pub metrics: Arc<Metrics>,
    pub store: Store,
    /// How `?client=` names a scope (the identity header's value, or a
    /// JWT principal).
    pub identity: Identity,
}

/// The admin router.
pub fn router(state: AdminState) -> axum::Router {
    axum::Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route(
            "/admin/keys/{route}/{*key}",
            get(show_key).delete(purge_key),
        )
        .with_state(state)
}

async fn healthz() -> impl IntoResponse {
    Json(json!({"status": "ok"}))
}

/// Ready when SQL answers; the fast layer's state is reported, not
/// required (the gateway stays correct on the SQL path without it).
async fn readyz(State(state): State<AdminState>) -> Response {
    let (sql, fast) = state.store.readiness().await;
    let fast_state = match &fast {
        None => "none".to_owned(),
        Some(Ok(())) => "ok".to_owned(),
        Some(Err(e)) => format!("degraded: {e}"),
    };
    // A consumer's broker is reported, not required: the HTTP routes do
    // not depend on it, and a load balancer must not take them away.
    let consumers: serde_json::Map<String, serde_json::Value> = state
        .metrics
        .consumers()
        .map(|(name, counters)| {
            let broker = match counters.broker_state() {
                Ok(()) => "connected".to_owned(),
                Err(why) => format!("disconnected: {why}"),
            };
            (name.to_owned(), serde_json::Value::String(broker))
        })
        .collect();
    let body = json!({
        "status": if sql.is_ok() { "ready" } else { "not ready" },
        "consumers": consumers,
        "sql": match &sql { Ok(()) => "ok".to_owned(), Err(e) => e.to_string() },
        "sql_backend": state.store.sql().backend(),
        "fast_layer": state.store.fast_layer_name(),
        "fast_layer_state": fast_state,
    });
    let status = if sql.is_ok() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}

async fn metrics(State(state): State<AdminState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
}

#[derive(Deserialize)]
struct ClientParam {
    /// The client's identity header value, as sent.
    client: Option<String>,
}

async fn show_key(
    State(state): State<AdminState>,
    Path((route, key)): Path<(String, String)>,
    Query(p): Query<ClientParam>,
) -> Response {
    let scope = p.client.map(|c| state.identity.scope_for_operator(&c));
    match state.store.find_for_operator(&route, &key).await {
        Ok(records) => {
            let records: Vec<_> = records
                .iter()
                .filter(|r| scope.as_ref().is_none_or(|s| &r.key.scope == s))
                .map(|r| r.describe())
                .collect();
            let status = if records.is_empty() {
                StatusCode::NOT_FOUND
            } else {
                StatusCode::OK
            };
            (status, Json(json!({"records": records}))).into_response()
        }
        Err(e) => idemgate_core::error::Problem::from(&e).into_response(),
    }
}

async fn purge_key(
    State(state): State<AdminState>,
    Path((route, key)): Path<(String, String)>,
    Query(p): Query<ClientParam>,
) -> Response {
    let scope = p.client.map(|c| state.identity.scope_for_operator(&c));
    match state
        .store
        .purge_for_operator(&route, &key, scope.as_deref())
        .await
    {
        Ok(purged) if purged.held > 0 => {
            tracing::warn!(route = %route, key = %idemgate_store::key_ref(&key), purged = purged.removed, held = purged.held, layer = "admin", "purge refused: a request holds the record");
            idemgate_core::error::Problem::new(idemgate_core::error::Reason::RecordInFlight)
            .detail(format!(
                "{} record(s) purged, {} held under a live lease and kept; purge again once it has finished",
                purged.removed, purged.held
            ))
            .into_response()
        }
        Ok(purged) => {
            if purged.removed > 0 {
                // Other instances' in-process layers follow the purge log;
                // answer once they have.
                tokio::time::sleep(idemgate_store::purges::settle(state.store.sql().timeout()))
                    .await;
            }
            tracing::info!(route = %route, key = %idemgate_store::key_ref(&key), purged = purged.removed, layer = "admin", "records purged");
            Json(json!({"purged": purged.removed})).into_response()
        }
        Err(e) => idemgate_core::error::Problem::from(&e).into_response(),
    }
}
