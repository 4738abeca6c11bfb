//! Assembly: from a validated [`Config`] to running listeners.
//!
//! [`start`] binds both listeners (so tests can pass port 0 and read the real
//! addresses back), builds one stack per route and spawns the serve loops;
//! [`run`] is `idemgate serve`: start, wait for SIGTERM/SIGINT, drain.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::task::JoinHandle;
use tower::ServiceBuilder;
use tower::util::BoxCloneSyncService;
use tower_http::request_id::{PropagateRequestIdLayer, SetRequestIdLayer};

use std::collections::BTreeSet;

use http::HeaderName;
use tower::Layer;

use crate::callback::{CallbackPolicy, KeySource, Verifier};
use crate::config::{Config, Idempotency, PathMatch, RouteKind, RouteMatcher};
use crate::idempotency::{Engine, EngineSettings, IdempotencyLayer, KeyPolicy};
use crate::metrics::Metrics;
use crate::proxy::{Proxy, Upstream, build_client};
use crate::request_id::{MakeRequestUuidV7, X_REQUEST_ID};
use crate::router::{Route, RouteService, Router};
use crate::server::{self, ConnLimits, PeerService, ShutdownTrigger};
use crate::store::Store;
use crate::token::{TokenEndpoint, TokenKeys, TokenPolicy};

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{key} = {addr:?}: cannot listen: {source}")]
    Bind {
        key: &'static str,
        addr: String,
        source: std::io::Error,
    },
    #[error("route {route:?}: {reason}")]
    Route { route: String, reason: String },
    #[error("store ({url}): {source}")]
    Store {
        url: String,
        source: crate::store::StoreError,
    },
}

/// A gateway running in this process.
pub struct RunningGateway {
    /// Where the public listener is bound.
    pub public_addr: SocketAddr,
    /// Where the admin listener is bound.
    pub admin_addr: SocketAddr,
    /// This gateway's metrics.
    pub metrics: Arc<Metrics>,
    /// This gateway's store.
    pub store: Store,
    trigger: ShutdownTrigger,
    sweeper: JoinHandle<()>,
    tasks: Vec<JoinHandle<()>>,
}

impl RunningGateway {
    /// Stops accepting, lets in-flight requests finish, and returns when
    /// both listeners have drained (or the grace period ran out).
    pub async fn shutdown(self) {
        self.trigger.trigger();
        for task in self.tasks {
            let _ = task.await;
        }
        self.sweeper.abort();
    }
}

/// Starts the gateway on the listeners `config` names.
pub async fn start(config: Config) -> Result<RunningGateway, StartError> {
    let public = server::bind(&config.server.listen, "server.listen").await?;
    let admin = server::bind(&config.server.admin_listen, "server.admin_listen").await?;
    let public_addr = public.local_addr().map_err(|source| StartError::Bind {
        key: "server.listen",
        addr: config.server.listen.clone(),
        source,
    })?;
    let admin_addr = admin.local_addr().map_err(|source| StartError::Bind {
        key: "server.admin_listen",
        addr: config.server.admin_listen.clone(),
        source,
    })?;

    let metrics = Arc::new(Metrics::new(&config));
    let (store, memory) = crate::store::open(&config.store, metrics.clone())
        .await
        .map_err(|source| StartError::Store {
            url: redact(&config.store.database_url),
            source,
        })?;
    let sweeper = crate::store::sweep::spawn(
        store.sql().clone(),
        memory,
        config.store.sweep_interval.get(),
        config.store.archive,
    );
    let router = build_router(&config, &metrics, &store)?;
    let app: RouteService = BoxCloneSyncService::new(
        ServiceBuilder::new()
            .layer(SetRequestIdLayer::new(X_REQUEST_ID, MakeRequestUuidV7))
            .layer(PropagateRequestIdLayer::new(X_REQUEST_ID))
            .service(router),
    );

    let limits = ConnLimits {
        header_read_timeout: config.server.header_read_timeout.get(),
        max_connections: config.server.max_connections,
        shutdown_grace: config.server.shutdown_grace.get(),
    };
    let (trigger, signal) = server::shutdown_pair();
    let public_task = tokio::spawn(server::serve(
        public,
        PeerService::factory(app),
        limits,
        signal.clone(),
    ));
    let admin_app = crate::admin::router(crate::admin::AdminState {
        metrics: metrics.clone(),
        store: store.clone(),
    });
    let mut admin_signal = signal;
    let admin_task = tokio::spawn(async move {
        let serving = axum::serve(admin, admin_app)
            .with_graceful_shutdown(async move { admin_signal.wait().await });
        if let Err(e) = serving.await {
            tracing::error!(error = %e, "admin listener failed");
        }
    });
    tracing::info!(
        %public_addr,
        %admin_addr,
        routes = config.routes.len(),
        sql = store.sql().backend(),
        fast_layer = store.fast_layer_name(),
        "idemgate listening"
    );
    Ok(RunningGateway {
        public_addr,
        admin_addr,
        metrics,
        store,
        trigger,
        sweeper,
        tasks: vec![public_task, admin_task],
    })
}

/// `idemgate serve`: runs until SIGTERM or SIGINT, then drains.
pub async fn run(config: Config) -> Result<(), StartError> {
    let gateway = start(config).await?;
    server::termination().await;
    tracing::info!("shutting down: no new connections, finishing in-flight requests");
    gateway.shutdown().await;
    tracing::info!("stopped");
    Ok(())
}

fn build_router(
    config: &Config,
    metrics: &Arc<Metrics>,
    store: &Store,
) -> Result<Router, StartError> {
    let client = build_client();
    let (token_keys, random_secret) = TokenKeys::new(&config.tokens.secret);
    let token_keys = Arc::new(token_keys);
    let identity_header: HeaderName =
        config
            .identity
            .header
            .parse()
            .map_err(|_| StartError::Route {
                route: "identity.header".into(),
                reason: "not a header name".into(),
            })?;
    let token_routes: BTreeSet<String> = config
        .routes
        .iter()
        .filter(|r| r.kind == RouteKind::Sync && r.idempotency() == Idempotency::Token)
        .map(|r| r.name.clone())
        .collect();
    if random_secret && !token_routes.is_empty() {
        tracing::warn!(
            "tokens.secret is empty: using a random secret for this process; tokens will not \
             survive a restart or work across gateway instances (set IDEMGATE_TOKEN_SECRET)"
        );
    }
    let mut upstreams = std::collections::HashMap::new();
    for u in &config.upstreams {
        let upstream = Upstream::from_config(u).map_err(|reason| StartError::Route {
            route: format!("upstream {}", u.name),
            reason,
        })?;
        upstreams.insert(u.name.clone(), Arc::new(upstream));
    }
    let mut routes = Vec::with_capacity(config.routes.len());
    for r in &config.routes {
        let fail = |reason: String| StartError::Route {
            route: r.name.clone(),
            reason,
        };
        let upstream = upstreams
            .get(&r.upstream)
            .cloned()
            .ok_or_else(|| fail(format!("unknown upstream {:?}", r.upstream)))?;
        let proxy = Proxy::new(
            client.clone(),
            upstream,
            config.server.max_body_bytes,
            metrics.upstream(&r.upstream),
        );
        let engine = Engine::new(
            store.clone(),
            EngineSettings {
                route: r.name.as_str().into(),
                identity_header: identity_header.clone(),
                max_body_bytes: config.server.max_body_bytes,
                body_read_timeout: config.server.body_read_timeout.get(),
                max_stored_body_bytes: config.store.max_stored_body_bytes,
                on_concurrent: r.on_concurrent,
                wait_limit: config
                    .upstream(&r.upstream)
                    .map(|u| u.timeout.get())
                    .unwrap_or_default(),
            },
            metrics.clone(),
        );
        let service: RouteService = match (r.kind, r.idempotency()) {
            (RouteKind::Sync, Idempotency::None) => BoxCloneSyncService::new(proxy),
            (RouteKind::Sync, Idempotency::Key) => BoxCloneSyncService::new(
                IdempotencyLayer::new(
                    engine,
                    KeyPolicy {
                        require_key: r.require_key,
                    },
                )
                .layer(proxy),
            ),
            (RouteKind::Sync, Idempotency::Token) => BoxCloneSyncService::new(
                IdempotencyLayer::new(engine, TokenPolicy::new(token_keys.clone(), &r.name))
                    .layer(proxy),
            ),
            (RouteKind::Callback, _) => {
                let sources = r
                    .business_key
                    .iter()
                    .map(|s| KeySource::parse(s))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(fail)?;
                let verifier = r
                    .signature
                    .as_ref()
                    .map(|sig| Verifier::from_config(sig, |name| std::env::var(name).ok()))
                    .transpose()
                    .map_err(fail)?;
                BoxCloneSyncService::new(
                    IdempotencyLayer::new(engine, CallbackPolicy::new(sources, verifier))
                        .layer(proxy),
                )
            }
        };
        routes.push(Route {
            name: r.name.as_str().into(),
            matcher: RouteMatcher::from_route(r).map_err(fail)?,
            service,
            counters: metrics.route(&r.name),
        });
    }
    let token = Route {
        name: "token".into(),
        matcher: RouteMatcher {
            methods: vec![http::Method::GET, http::Method::POST],
            path: PathMatch::Exact("/token".into()),
        },
        service: BoxCloneSyncService::new(TokenEndpoint::new(
            token_keys,
            config.tokens.ttl.get(),
            identity_header,
            token_routes,
        )),
        counters: metrics.route("token"),
    };
    Ok(Router::new(routes, Some(token)))
}

/// A database URL without its password, for messages.
pub fn redact(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) if parsed.password().is_some() => {
            let _ = parsed.set_password(Some("***"));
            parsed.to_string()
        }
        _ => url.to_owned(),
    }
}
