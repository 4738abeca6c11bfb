//! One tower stack per route — a policy layer over a proxy to the
//! route's upstream — and the `/token` endpoint, as one worker's router.
//! Built from the plan's route entries alone: what the file said was read
//! and checked once, when the plan was made.

use std::sync::Arc;

use idemgate::idempotency::{Engine, EngineSettings, IdempotencyLayer, KeyPolicy, Reconcile};
use idemgate::token::{TokenEndpoint, TokenPolicy};
use idemgate_proxy::{Proxy, Upstream};
use idemgate_store::Store;
use tower::Layer;

use super::{InForce, StartError};
use crate::config::{PathMatch, PolicyPlan, RouteMatcher, RoutePlan};
use crate::router::{Route, RouteService, Router, TowerHandler};
use crate::status_endpoint::StatusEndpoint;

/// One worker's router: a stack per route, each proxy on this worker's own
/// pool of connections to its upstream, and `/token`.
pub(super) fn build_router(shared: &InForce, store: &Store) -> Result<Router, StartError> {
    // One pool per upstream per call: each worker builds its own router,
    // so connections never leave the thread that drives them.
    let pools: std::collections::HashMap<&str, (Arc<Upstream>, _)> = shared
        .upstreams
        .iter()
        .map(|(name, upstream)| {
            let pool = upstream.worker_pool(shared.workers);
            (name.as_str(), (upstream.clone(), pool))
        })
        .collect();
    let mut routes = Vec::with_capacity(shared.routes.len());
    for route in &shared.routes {
        let (upstream, pool) =
            pools
                .get(route.upstream.as_str())
                .cloned()
                .ok_or_else(|| StartError::Route {
                    route: route.name.clone(),
                    reason: format!("unknown upstream {:?}", route.upstream),
                })?;
        let proxy = Proxy::new(
            pool,
            upstream,
            shared.config.server.max_body_bytes,
            shared.metrics.upstream(&route.upstream),
        );
        routes.push(Route {
            name: route.name.as_str().into(),
            matcher: route.matcher.clone(),
            service: route_service(shared, store, route, proxy),
            counters: shared.metrics.route(&route.name),
            policy: route.policy.name(),
        });
    }
    Ok(Router::with_cors(
        routes,
        Some(token_route(shared)),
        shared.cors.clone(),
    ))
}

/// A route's stack: its proxy alone, or its policy and the engine in front
/// of it.
fn route_service(shared: &InForce, store: &Store, route: &RoutePlan, proxy: Proxy) -> RouteService {
    let reconcile = route
        .reconcile_path
        .as_deref()
        .map(|path| Arc::new(StatusEndpoint::new(proxy.clone(), path)) as Arc<dyn Reconcile>);
    let engine = || {
        Engine::new(
            store.clone(),
            EngineSettings {
                max_body_bytes: shared.config.server.max_body_bytes,
                body_read_timeout: shared.config.server.body_read_timeout.get(),
                max_stored_body_bytes: shared.config.store.max_stored_body_bytes,
                on_concurrent: route.on_concurrent,
                wait_limit: route.outcomes.wait_limit,
                uncertain_hold: route.outcomes.uncertain_hold,
                uncertain_statuses: route.outcomes.uncertain_statuses,
                reconcile: reconcile.clone(),
                budget: shared.budget.clone(),
                body_budget: shared.body_budget.clone(),
                answer_budget: shared.answer_budget.clone(),
                // Records are kept under the route's identity, which a
                // rename may keep (`routes[].id`).
                ..EngineSettings::new(&route.record_id, shared.identity.clone())
            },
            shared.metrics.clone(),
            shared.holders.clone(),
        )
    };
    match &route.policy {
        PolicyPlan::PassThrough => Arc::new(proxy),
        PolicyPlan::Key { require_key } => Arc::new(TowerHandler(
            IdempotencyLayer::new(engine(), KeyPolicy::new(*require_key)).layer(proxy),
        )),
        PolicyPlan::Token => Arc::new(TowerHandler(
            IdempotencyLayer::new(
                engine(),
                TokenPolicy::new(shared.token_keys.clone(), &route.record_id),
            )
            .layer(proxy),
        )),
        PolicyPlan::Callback(policy) => Arc::new(TowerHandler(
            IdempotencyLayer::new(engine(), policy.clone()).layer(proxy),
        )),
    }
}

/// `/token`, for `GET` and `POST`.
fn token_route(shared: &InForce) -> Route {
    Route {
        name: "token".into(),
        matcher: RouteMatcher {
            methods: vec![http::Method::GET, http::Method::POST],
            path: PathMatch::Exact("/token".into()),
        },
        service: Arc::new(TowerHandler(
            TokenEndpoint::new(
                shared.token_keys.clone(),
                shared.config.tokens.ttl.get(),
                shared.identity.clone(),
                Default::default(),
            )
            .binding_ids(shared.token_routes.clone())
            .with_limit(shared.token_limit.clone()),
        )),
        counters: shared.metrics.route("token"),
        policy: "token_endpoint",
    }
}

/// Each route with a `reconcile_path`, by its record identity (what an
/// uncertain record names): its status endpoint on the calling runtime
/// (the admin listener's), and its upstream's timeout.
pub(super) fn reconcilers(shared: &InForce) -> crate::admin::Reconcilers {
    shared
        .routes
        .iter()
        .filter_map(|route| {
            let path = route.reconcile_path.as_deref()?;
            let upstream = shared.upstreams.get(&route.upstream)?;
            let proxy = Proxy::new(
                upstream.pool(),
                upstream.clone(),
                shared.config.server.max_body_bytes,
                shared.metrics.upstream(&route.upstream),
            );
            let endpoint = Arc::new(StatusEndpoint::new(proxy, path)) as Arc<dyn Reconcile>;
            Some((route.record_id.clone(), (endpoint, upstream.timeout)))
        })
        .collect()
}
