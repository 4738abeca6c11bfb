//! The admin listener: `/healthz`, `/readyz`, `/metrics` and `/admin/*`.
//!
//! It is a separate socket (`server.admin_listen`) so that operators can
//! firewall it; none of these paths exist on the public listener. The
//! `/admin/*` API can purge records, so it asks who is calling: with
//! `server.admin_token` set, every `/admin/*` request needs
//! `Authorization: Bearer <token>` (`401 admin-unauthorized` otherwise);
//! without one, the listener must be on a loopback address (refused at
//! start-up otherwise). `/healthz`, `/readyz` and `/metrics` stay open, as
//! probes and scrapers expect.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Deserialize;
use serde_json::json;

use idemgate::idempotency::{Reconcile, Reconciliation, reconcile_uncertain};
use idemgate_core::error::{Problem, Reason};
use idemgate_core::identity::Identity;
use idemgate_core::metrics::Metrics;
use idemgate_store::Store;

use crate::config::AdminToken;

/// What the admin endpoints read.
#[derive(Clone)]
pub struct AdminState {
    /// This gateway's metrics.
    pub metrics: Arc<Metrics>,
    /// The store (records to show, purge, list).
    pub store: Store,
    /// How `?client=` names a scope (the identity header's value, or a
    /// JWT principal).
    pub identity: Identity,
    /// The bearer token `/admin/*` requires (`None`: open, on loopback).
    pub token: Option<AdminToken>,
    /// Each route with a `reconcile_path`: its status endpoint, and how
    /// long its answer may take.
    pub reconcilers: Arc<Reconcilers>,
    /// Answers larger than this are recorded without their body.
    pub max_stored_body_bytes: usize,
    /// What answers being recorded may hold (`server.max_captured_bytes`).
    pub answer_budget: idemgate::idempotency::answer::AnswerBudget,
    /// Each route's and consumer's name, with the identity its records
    /// are kept under (`routes[].id`), for paths that name a route.
    pub record_ids: Arc<HashMap<String, String>>,
    /// 1 while the database confirms that a commit survives a failover
    /// (the metric's value; `/readyz` asks again).
    pub commit_survives: Arc<std::sync::atomic::AtomicU64>,
    /// `store.require_synchronous`: not ready unless it does.
    pub require_synchronous: bool,
}

impl AdminState {
    /// The record identity of the route (or consumer) a path names: its
    /// id for a name, else the text as given (an id, or a route gone).
    fn records_of(&self, route: String) -> String {
        self.record_ids.get(&route).cloned().unwrap_or(route)
    }
}

/// Each route with a `reconcile_path`: its status endpoint, and how long
/// its answer may take.
pub type Reconcilers = HashMap<String, (Arc<dyn Reconcile>, Duration)>;

/// Records the uncertain list shows at most.
pub const UNCERTAIN_LIST_LIMIT: i64 = 200;

/// The dashboard: one page, no external assets; it reads `/metrics` and
/// the admin API from the browser.
const DASHBOARD: &str = include_str!("dashboard.html");

/// The admin state in force, swapped whole by a configuration reload.
#[derive(Clone)]
pub struct AdminHandle(Arc<arc_swap::ArcSwap<AdminState>>);

impl AdminHandle {
    /// A handle on `state`.
    pub fn new(state: AdminState) -> Self {
        AdminHandle(Arc::new(arc_swap::ArcSwap::from_pointee(state)))
    }

    /// What a request reads.
    pub fn current(&self) -> Arc<AdminState> {
        self.0.load_full()
    }

    /// Puts `state` in force from the next request on.
    pub fn replace(&self, state: AdminState) {
        self.0.store(Arc::new(state));
    }
}

/// The admin router.
pub fn router(state: AdminHandle) -> axum::Router {
    let admin = axum::Router::new()
        .route(
            "/admin/keys/{route}/{*key}",
            get(show_key).delete(purge_key),
        )
        .route("/admin/uncertain", get(list_uncertain))
        .route(
            "/admin/uncertain/{route}/{*key}",
            axum::routing::post(reconcile_record),
        )
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_token,
        ));
    axum::Router::new()
        .route("/", get(dashboard))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .merge(admin)
        .with_state(state)
}

/// `/admin/*`: the bearer token, when one is configured.
async fn require_token(
    State(handle): State<AdminHandle>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let state = handle.current();
    let Some(token) = &state.token else {
        return next.run(request).await;
    };
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, t)| t.trim());
    match presented {
        Some(candidate) if token.matches(candidate) => next.run(request).await,
        _ => {
            // The route's pattern, never the path: a path names a key.
            let endpoint = request
                .extensions()
                .get::<axum::extract::MatchedPath>()
                .map_or("/admin", |p| p.as_str())
                .to_owned();
            tracing::warn!(endpoint = %endpoint, method = %request.method(), layer = "admin", "admin request without its token refused");
            Problem::new(Reason::AdminUnauthorized)
                .www_authenticate("Bearer realm=\"idemgate-admin\"")
                .into_response()
        }
    }
}

async fn healthz() -> impl IntoResponse {
    Json(json!({"status": "ok"}))
}

/// Ready when SQL answers (and, with `store.require_synchronous`, when
/// the database confirms that a commit survives a failover); the fast
/// layer's state and the commits' durability are reported.
async fn readyz(State(handle): State<AdminHandle>) -> Response {
    let state = handle.current();
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
        .into_iter()
        .map(|(name, counters)| {
            let broker = match counters.broker_state() {
                Ok(()) => "connected".to_owned(),
                Err(why) => format!("disconnected: {why}"),
            };
            (name.to_owned(), serde_json::Value::String(broker))
        })
        .collect();
    // Whether a commit survives a failover, asked afresh: a standby that
    // left turns a synchronous pair into a lone server.
    let durability = match &sql {
        Ok(()) => Some(state.store.sql().durability().await),
        Err(_) => None,
    };
    if let Some(Ok(d)) = &durability {
        state.commit_survives.store(
            u64::from(d.survives_failover()),
            std::sync::atomic::Ordering::Relaxed,
        );
    }
    let synchronous = matches!(&durability, Some(Ok(d)) if d.survives_failover());
    let ready = sql.is_ok() && (synchronous || !state.require_synchronous);
    let body = json!({
        "status": if ready { "ready" } else { "not ready" },
        "consumers": consumers,
        "sql": match &sql { Ok(()) => "ok".to_owned(), Err(e) => e.to_string() },
        "commit_durability": match &durability {
            Some(Ok(d)) => d.name().to_owned(),
            Some(Err(e)) => format!("unknown: {e}"),
            None => "unknown".to_owned(),
        },
        "commit_durability_detail": match &durability {
            Some(Ok(d)) => d.detail().to_owned(),
            _ => String::new(),
        },
        "require_synchronous": state.require_synchronous,
        "sql_backend": state.store.sql().backend(),
        "fast_layer": state.store.fast_layer_name(),
        "fast_layer_state": fast_state,
    });
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}

async fn metrics(State(handle): State<AdminHandle>) -> impl IntoResponse {
    let state = handle.current();
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
    State(handle): State<AdminHandle>,
    Path((route, key)): Path<(String, String)>,
    Query(p): Query<ClientParam>,
) -> Response {
    let state = handle.current();
    let route = state.records_of(route);
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
    State(handle): State<AdminHandle>,
    Path((route, key)): Path<(String, String)>,
    Query(p): Query<ClientParam>,
) -> Response {
    let state = handle.current();
    let route = state.records_of(route);
    let scope = p.client.map(|c| state.identity.scope_for_operator(&c));
    match state
        .store
        .purge_settled(&route, &key, scope.as_deref())
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
            tracing::info!(route = %route, key = %idemgate_store::key_ref(&key), purged = purged.removed, layer = "admin", "records purged");
            Json(json!({"purged": purged.removed})).into_response()
        }
        Err(e) => idemgate_core::error::Problem::from(&e).into_response(),
    }
}

async fn dashboard() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
            // The page runs only its own inline script and talks only to
            // this listener.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                 connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'",
            ),
        ],
        DASHBOARD,
    )
}

/// `GET /admin/uncertain`: the records still `uncertain` among the most
/// recently marked, newest first — the ones a person may have to look at —
/// and whether each route can reconcile.
async fn list_uncertain(State(handle): State<AdminHandle>) -> Response {
    let state = handle.current();
    match state.store.sql().uncertain(UNCERTAIN_LIST_LIMIT).await {
        Ok(records) => {
            let records: Vec<_> = records
                .iter()
                .map(|r| {
                    let mut shown = r.describe();
                    shown["reconcilable"] = state.reconcilers.contains_key(&r.key.route).into();
                    shown
                })
                .collect();
            Json(json!({ "records": records, "limit": UNCERTAIN_LIST_LIMIT })).into_response()
        }
        Err(e) => Problem::from(&e).into_response(),
    }
}

#[derive(Deserialize)]
struct ScopeParam {
    /// The record's client scope, as `/admin/uncertain` shows it.
    scope: String,
}

/// `POST /admin/uncertain/{route}/{key}?scope=…`: asks the route's status
/// endpoint whether the action ran; `200` records its answer as the
/// outcome, `404` leaves the record to its hold (the next retry is then
/// forwarded), anything else changes nothing.
async fn reconcile_record(
    State(handle): State<AdminHandle>,
    Path((route, key)): Path<(String, String)>,
    Query(p): Query<ScopeParam>,
) -> Response {
    let state = handle.current();
    let route = state.records_of(route);
    let Some((reconcile, deadline)) = state.reconcilers.get(&route) else {
        return (
            StatusCode::NOT_FOUND,
            Json(json!({"error": format!("route {route:?} has no reconcile_path")})),
        )
            .into_response();
    };
    let record = idemgate_store::RecordKey::new(p.scope, route.as_str(), key.as_str());
    let found = reconcile_uncertain(
        &state.store,
        reconcile.as_ref(),
        &record,
        state.max_stored_body_bytes,
        &state.answer_budget,
        *deadline,
    )
    .await;
    let (status, outcome) = match found {
        Ok(Reconciliation::Recorded(stored)) => (
            StatusCode::OK,
            json!({"outcome": "recorded", "stored_status": stored}),
        ),
        Ok(Reconciliation::NotRun) => (StatusCode::OK, json!({"outcome": "not-run"})),
        Ok(Reconciliation::NotUncertain) => {
            (StatusCode::CONFLICT, json!({"outcome": "not-uncertain"}))
        }
        Ok(Reconciliation::Failed(why)) => (
            StatusCode::BAD_GATEWAY,
            json!({"outcome": "failed", "reason": why}),
        ),
        Ok(other) => (StatusCode::OK, json!({"outcome": format!("{other:?}")})),
        Err(e) => return Problem::from(&e).into_response(),
    };
    tracing::info!(route = %route, key = %idemgate_store::key_ref(&key), outcome = %outcome["outcome"], layer = "admin", "operator reconciliation");
    (status, Json(outcome)).into_response()
}
