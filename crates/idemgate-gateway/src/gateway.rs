//! Assembly: from a validated [`Config`] to running listeners.
//!
//! [`start`] binds both listeners (so tests can pass port 0 and read the real
//! addresses back), builds one stack per route and spawns the serve loops;
//! [`run`] is `idemgate serve`: start, wait for SIGTERM/SIGINT, drain.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::task::JoinHandle;

use std::collections::BTreeSet;

use tower::Layer;

use crate::config::{Config, Idempotency, PathMatch, RouteKind, RouteMatcher};
use idemgate::callback::{CallbackPolicy, KeySource, Verifier};
use idemgate::idempotency::{
    Engine, EngineSettings, Holders, IdempotencyLayer, KeyPolicy, Reconcile,
};
use idemgate_core::budget::ClaimBudget;
use idemgate_core::identity::Identity;
use idemgate_core::metrics::Metrics;
use idemgate_proxy::{Proxy, Upstream};

use crate::router::{Route, RouteService, Router, TowerHandler};
use crate::status_endpoint::StatusEndpoint;
use idemgate::token::{TokenEndpoint, TokenKeys, TokenPolicy};
use idemgate_server::{ConnLimits, PeerService, ShutdownTrigger};
use idemgate_store::Store;

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
        source: idemgate_store::StoreError,
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
    stop_consumers: tokio_util::sync::CancellationToken,
    consumers: idemgate_mq::Consumers,
    sweeper: JoinHandle<()>,
    purge_follower: Option<JoinHandle<()>>,
    tasks: Vec<JoinHandle<()>>,
    workers: Vec<std::thread::JoinHandle<()>>,
}

impl RunningGateway {
    /// Stops accepting, lets in-flight requests finish, and returns when
    /// both listeners have drained (or the grace period ran out).
    pub async fn shutdown(self) {
        self.trigger.trigger();
        // Consumers stop taking messages and finish those in hand within
        // the grace, while the listeners drain.
        self.stop_consumers.cancel();
        self.consumers.join().await;
        for task in self.tasks {
            let _ = task.await;
        }
        let workers = self.workers;
        let _ = tokio::task::spawn_blocking(move || {
            for worker in workers {
                let _ = worker.join();
            }
        })
        .await;
        self.sweeper.abort();
        if let Some(follower) = self.purge_follower {
            follower.abort();
        }
    }
}

/// Starts the gateway on the listeners `config` names.
///
/// The public listener is served by `server.worker_threads` threads, each
/// with a single-threaded event loop, its own handle of one shared
/// listening socket (whichever worker is free accepts next, and hands the
/// connection on when it already serves more than its share) and its own
/// route stacks and upstream connection pool, so a pass-through request
/// never crosses threads — the cross-thread wake-ups of a shared
/// work-stealing pool were the largest cost in the pass-through profile.
/// The store, the admin listener and the sweeper stay on the calling
/// runtime; each worker opens its own store connections on its own loop
/// (see [`idemgate_store::open_for_worker`]).
pub async fn start(config: Config) -> Result<RunningGateway, StartError> {
    let admin = tokio::net::TcpListener::bind(&config.server.admin_listen)
        .await
        .map_err(|source| StartError::Bind {
            key: "server.admin_listen",
            addr: config.server.admin_listen.clone(),
            source,
        })?;
    let admin_addr = admin.local_addr().map_err(|source| StartError::Bind {
        key: "server.admin_listen",
        addr: config.server.admin_listen.clone(),
        source,
    })?;

    let metrics = Arc::new(config.metrics());
    let (store, memory) = idemgate_store::open(&config.store.options(), metrics.clone())
        .await
        .map_err(|source| StartError::Store {
            url: redact(&config.store.database_url),
            source,
        })?;
    let sweeper = idemgate_store::sweep::spawn(
        store.sql().clone(),
        memory.clone(),
        config.store.sweep_interval.get(),
        config.store.archive,
    );
    // Purges made elsewhere (the CLI, another instance) reach this
    // process's in-process fast layer through the purge log.
    let purge_follower = memory
        .clone()
        .map(|memory| idemgate_store::purges::follow(store.sql().clone(), memory));
    if let Some(memory) = memory.clone() {
        metrics.gauge(
            "idemgate_memory_layer_bytes",
            "Bytes the in-process fast layer holds (store.memory_layer_bytes at most).",
            move || memory.bytes() as u64,
        );
    }
    let (token_keys, random_secret) = TokenKeys::rotating(&config.tokens.secret_list());
    // Loaded once (a JWKS file is read here), shared by every worker.
    let identity = config
        .identity
        .identity()
        .map_err(|(route, reason)| StartError::Route { route, reason })?;
    let threads = match config.server.worker_threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let budgets = descriptor_budgets(&config, threads);
    metrics.claims_limit.store(
        budgets.max_claims as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
    // Built once for every worker: an https upstream's TLS settings read
    // their PEM files (and the system roots) here, not once per worker.
    let mut upstreams = std::collections::HashMap::new();
    for u in &config.upstreams {
        let mut spec = u.spec();
        if spec.max_connections == 0 && !spec.http2 {
            // No cap configured: the descriptors' share is the cap.
            spec.max_connections = budgets.upstream_connections;
        }
        let upstream = Upstream::new(spec).map_err(|reason| StartError::Route {
            route: format!("upstream {}", u.name),
            reason,
        })?;
        upstreams.insert(u.name.clone(), Arc::new(upstream));
    }
    let shared = Arc::new(Shared {
        upstreams,
        config: config.clone(),
        metrics: metrics.clone(),
        store: store.clone(),
        memory,
        token_keys: Arc::new(token_keys),
        workers: threads,
        holders: Arc::new(Holders::default()),
        identity: identity.clone(),
        budget: ClaimBudget::new(budgets.max_claims),
        body_budget: idemgate::idempotency::body::BodyBudget::new(config.server.max_buffered_bytes),
        // One limit for the process, not one per worker.
        token_limit: idemgate::token::IssueLimit::per_minute(config.tokens.issue_per_minute)
            .map(Arc::new),
    });
    // Build once here so that a bad route fails the start, not a thread.
    let token_routes = build_router(&shared, &store)?.1;
    if random_secret && !token_routes.is_empty() {
        tracing::warn!(
            "tokens.secret is empty: using a random secret for this process; tokens will not \
             survive a restart or work across gateway instances (set IDEMGATE_TOKEN_SECRET)"
        );
    }

    let tls = match &config.server.tls {
        None => None,
        Some(tls) => Some(
            idemgate_proxy::tls::server_config(
                ("server.tls.cert", &tls.cert),
                ("server.tls.key", &tls.key),
                config.server.http2,
            )
            .map_err(|e| StartError::Route {
                route: e.key.clone(),
                reason: e.to_string(),
            })?,
        ),
    };
    let limits = ConnLimits {
        header_read_timeout: config.server.header_read_timeout.get(),
        max_connections: budgets.max_connections.div_ceil(threads),
        claims_per_connection: budgets.claims_per_connection,
        shutdown_grace: config.server.shutdown_grace.get(),
        http2: config.server.http2,
        tls,
    };
    let (trigger, signal) = idemgate_server::shutdown_pair();
    let requested: SocketAddr =
        config
            .server
            .listen
            .parse()
            .map_err(|e: std::net::AddrParseError| StartError::Bind {
                key: "server.listen",
                addr: config.server.listen.clone(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e),
            })?;
    // One listening socket, shared by every worker: each registers its own
    // handle of it with its own event loop, and whichever worker is free
    // accepts next — as nginx's workers share theirs. (Per-worker
    // `SO_REUSEPORT` sockets split connections by a hash, unevenly for a
    // few dozen keep-alive clients, and let a second gateway silently share
    // the port.)
    let listener = idemgate_server::bind_shared(requested).map_err(|source| StartError::Bind {
        key: "server.listen",
        addr: requested.to_string(),
        source,
    })?;
    let (balance, seats) = idemgate_server::balance::Balance::new(threads);
    metrics.set_worker_balance(balance);
    let mut workers = Vec::with_capacity(threads);
    let mut public_addr = requested;
    for (i, seat) in seats.into_iter().enumerate() {
        let (ready, bound) = tokio::sync::oneshot::channel();
        let handle = listener.try_clone().map_err(|source| StartError::Bind {
            key: "server.listen",
            addr: requested.to_string(),
            source,
        })?;
        workers.push(spawn_worker(
            i,
            handle,
            seat,
            shared.clone(),
            limits.clone(),
            signal.clone(),
            ready,
        ));
        match bound.await {
            Ok(Ok(addr)) => public_addr = addr,
            Ok(Err(e)) => {
                trigger.trigger();
                return Err(e);
            }
            Err(_) => {
                trigger.trigger();
                return Err(StartError::Route {
                    route: "server.worker_threads".into(),
                    reason: "a worker thread failed to start".into(),
                });
            }
        }
    }
    // Only the workers' handles keep the socket open from here on, so it
    // closes when the last worker stops accepting.
    drop(listener);

    let stop_consumers = tokio_util::sync::CancellationToken::new();
    let consumers =
        idemgate_mq::Consumers::spawn(build_consumers(&shared, &store)?, stop_consumers.clone());

    let admin_app = crate::admin::router(crate::admin::AdminState {
        metrics: metrics.clone(),
        store: store.clone(),
        identity,
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
        consumers = config.consumers.len(),
        workers = threads,
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
        stop_consumers,
        consumers,
        sweeper,
        purge_follower,
        tasks: vec![admin_task],
        workers,
    })
}

/// What every worker thread builds its route stacks from.
struct Shared {
    /// Every upstream by name, TLS settings loaded.
    upstreams: std::collections::HashMap<String, Arc<Upstream>>,
    config: Config,
    metrics: Arc<Metrics>,
    /// The main runtime's store (admin, sweeper); workers open their own.
    store: Store,
    memory: Option<Arc<idemgate_store::memory::MemoryLayer>>,
    token_keys: Arc<TokenKeys>,
    workers: usize,
    /// Every claim this process holds, across workers.
    holders: Arc<Holders>,
    /// Who a client is.
    identity: Identity,
    /// `tokens.issue_per_minute`, shared by every worker.
    token_limit: Option<Arc<idemgate::token::IssueLimit>>,
    /// The process's claims in flight, across workers and consumers.
    budget: ClaimBudget,
    /// The process's buffered request bodies.
    body_budget: idemgate::idempotency::body::BodyBudget,
}

/// One public-listener thread: its own event loop, socket and stacks.
fn spawn_worker(
    index: usize,
    listener: std::net::TcpListener,
    seat: idemgate_server::balance::Seat,
    shared: Arc<Shared>,
    limits: ConnLimits,
    signal: idemgate_server::ShutdownSignal,
    ready: tokio::sync::oneshot::Sender<Result<SocketAddr, StartError>>,
) -> std::thread::JoinHandle<()> {
    let key = "server.listen";
    let addr = listener
        .local_addr()
        .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
    std::thread::Builder::new()
        .name(format!("idemgate-worker-{index}"))
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(source) => {
                    let _ = ready.send(Err(StartError::Bind {
                        key,
                        addr: addr.to_string(),
                        source,
                    }));
                    return;
                }
            };
            runtime.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(listener) => listener,
                    Err(source) => {
                        let _ = ready.send(Err(StartError::Bind {
                            key,
                            addr: addr.to_string(),
                            source,
                        }));
                        return;
                    }
                };
                let bound = listener.local_addr().unwrap_or(addr);
                let store = match idemgate_store::open_for_worker(
                    &shared.config.store.options(),
                    &shared.store,
                    shared.memory.clone(),
                    shared.metrics.clone(),
                    shared.workers,
                )
                .await
                {
                    Ok(store) => store,
                    Err(source) => {
                        let _ = ready.send(Err(StartError::Store {
                            url: redact(&shared.config.store.database_url),
                            source,
                        }));
                        return;
                    }
                };
                let router = match build_router(&shared, &store) {
                    Ok((router, _)) => router,
                    Err(e) => {
                        let _ = ready.send(Err(e));
                        return;
                    }
                };
                let _ = ready.send(Ok(bound));
                // Claims outlive their connections: after the drain starts,
                // this loop stays up until the claims held here are
                // recorded, within the same grace.
                let mut stopping = signal.clone();
                let holders = shared.holders.clone();
                let grace = limits.shutdown_grace;
                let serving = idemgate_server::serve(
                    listener,
                    PeerService::factory(router),
                    limits,
                    Some(seat),
                    signal,
                );
                let held = async move {
                    stopping.wait().await;
                    holders.drain(grace).await;
                };
                tokio::join!(serving, held);
            });
        })
        .expect("spawning a worker thread")
}

/// The descriptor limit (raised to its hard limit first) and the budgets it
/// allows, said once in the log when it lowers what the file asks for.
fn descriptor_budgets(config: &Config, workers: usize) -> idemgate_core::limits::Budgets {
    let limit = idemgate_core::limits::raise_descriptor_limit();
    // The store's pools, Redis (one per worker and the main runtime), and
    // each consumer's broker connection and dead-letter channel.
    let reserve = idemgate_core::limits::BASE_RESERVE
        + config.store.pool_size as usize * 2
        + (workers + 1) * 2
        + config.consumers.len() * 4;
    let budgets = idemgate_core::limits::budgets(
        limit,
        reserve,
        config.upstreams.len(),
        config.server.max_connections,
        config.server.max_claims,
    );
    if budgets.max_connections < config.server.max_connections {
        tracing::warn!(
            descriptor_limit = ?limit,
            reserve,
            max_connections = budgets.max_connections,
            configured = config.server.max_connections,
            layer = "server",
            "the descriptor limit lowers server.max_connections; raise it (ulimit -n, systemd LimitNOFILE) to at least {} for the configured value",
            config.server.max_connections * 2 + reserve
        );
    }
    tracing::info!(
        descriptor_limit = ?limit,
        max_connections = budgets.max_connections,
        max_claims = budgets.max_claims,
        claims_per_connection = budgets.claims_per_connection,
        upstream_connections = budgets.upstream_connections,
        layer = "server",
        "budgets"
    );
    budgets
}

/// `idemgate serve`: runs until SIGTERM or SIGINT, then drains.
pub async fn run(config: Config) -> Result<(), StartError> {
    let gateway = start(config).await?;
    idemgate_server::termination().await;
    tracing::info!("shutting down: no new connections, finishing in-flight requests");
    gateway.shutdown().await;
    tracing::info!("stopped");
    Ok(())
}

/// One deliverer per `[[consumers]]` entry, on the calling runtime: each
/// runs through the same engine, store and holders as the routes, with its
/// name as the route of its records.
fn build_consumers(
    shared: &Shared,
    store: &Store,
) -> Result<Vec<Arc<idemgate_mq::Deliverer>>, StartError> {
    use crate::config::Broker;
    use idemgate_mq::{ConsumerSettings, Deliverer, MessageKeySource, Source};
    let config = &shared.config;
    let mut deliverers = Vec::with_capacity(config.consumers.len());
    for c in &config.consumers {
        let fail = |reason: String| StartError::Route {
            route: format!("consumer {}", c.name),
            reason,
        };
        let upstream = shared
            .upstreams
            .get(&c.upstream)
            .cloned()
            .ok_or_else(|| fail(format!("unknown upstream {:?}", c.upstream)))?;
        let source = match c.broker() {
            Some(Broker::Amqp) => Source::Amqp {
                url: c.source.clone(),
                queue: c.queue.clone().unwrap_or_default(),
                dead_letter: c.dead_letter_name(),
            },
            Some(Broker::Nats) => Source::Nats {
                url: c.source.clone(),
                stream: c.stream.clone().unwrap_or_default(),
                durable: c.durable_name().to_owned(),
                dead_letter: c.dead_letter_name(),
            },
            None => return Err(fail("unknown broker scheme".into())),
        };
        let sources = c
            .business_key
            .iter()
            .map(|s| MessageKeySource::parse(s))
            .collect::<Result<Vec<_>, _>>()
            .map_err(fail)?;
        let must_match = c
            .must_match
            .iter()
            .map(|s| MessageKeySource::parse(s))
            .collect::<Result<Vec<_>, _>>()
            .map_err(fail)?;
        let settings = ConsumerSettings {
            name: c.name.as_str().into(),
            source,
            path: c
                .path
                .parse()
                .map_err(|_| fail(format!("{:?} is not a path", c.path)))?,
            sources: sources.into(),
            must_match: must_match.into(),
            prefetch: c.prefetch,
            max_deliveries: c.max_deliveries,
            retry_delay: c.retry_delay.get(),
            upstream_timeout: upstream.timeout,
            shutdown_grace: config.server.shutdown_grace.get(),
        };
        let engine = Engine::new(
            store.clone(),
            EngineSettings {
                route: c.name.as_str().into(),
                // Never read: a message's records are the consumer's.
                identity: shared.identity.clone(),
                max_body_bytes: config.server.max_body_bytes,
                body_read_timeout: config.server.body_read_timeout.get(),
                max_stored_body_bytes: config.store.max_stored_body_bytes,
                // Never `wait`: a waiter replays the holder's outcome the
                // moment it exists, before its write is durable, and a
                // consumer acknowledges every replay.
                on_concurrent: crate::config::OnConcurrent::Reject,
                wait_limit: upstream.timeout,
                uncertain_hold: config
                    .upstream(&c.upstream)
                    .map(|u| u.uncertain_hold())
                    .unwrap_or(upstream.timeout),
                reconcile: None,
                budget: shared.budget.clone(),
                body_budget: shared.body_budget.clone(),
                in_process: false,
                keep_alive: None,
            },
            shared.metrics.clone(),
            shared.holders.clone(),
        );
        let proxy = Proxy::new(
            upstream.pool(),
            upstream.clone(),
            config.server.max_body_bytes,
            shared.metrics.upstream(&c.upstream),
        );
        deliverers.push(Arc::new(Deliverer::new(
            settings,
            engine,
            proxy,
            shared.metrics.consumer(&c.name),
        )));
    }
    Ok(deliverers)
}

fn build_router(shared: &Shared, store: &Store) -> Result<(Router, BTreeSet<String>), StartError> {
    let Shared {
        config,
        metrics,
        token_keys,
        ..
    } = shared;
    let token_routes: BTreeSet<String> = config
        .routes
        .iter()
        .filter(|r| r.kind == RouteKind::Sync && r.idempotency() == Idempotency::Token)
        .map(|r| r.name.clone())
        .collect();
    // One pool per upstream per call: each worker builds its own router,
    // so connections never leave the thread that drives them.
    let upstreams: std::collections::HashMap<&str, (Arc<Upstream>, _)> = shared
        .upstreams
        .iter()
        .map(|(name, upstream)| {
            let pool = upstream.worker_pool(shared.workers);
            (name.as_str(), (upstream.clone(), pool))
        })
        .collect();
    let mut routes = Vec::with_capacity(config.routes.len());
    for r in &config.routes {
        let fail = |reason: String| StartError::Route {
            route: r.name.clone(),
            reason,
        };
        let (upstream, pool) = upstreams
            .get(r.upstream.as_str())
            .cloned()
            .ok_or_else(|| fail(format!("unknown upstream {:?}", r.upstream)))?;
        let proxy = Proxy::new(
            pool,
            upstream,
            config.server.max_body_bytes,
            metrics.upstream(&r.upstream),
        );
        let upstream_config = config.upstream(&r.upstream);
        let reconcile = r
            .reconcile_path
            .as_deref()
            .map(|path| Arc::new(StatusEndpoint::new(proxy.clone(), path)) as Arc<dyn Reconcile>);
        let engine = Engine::new(
            store.clone(),
            EngineSettings {
                route: r.name.as_str().into(),
                identity: shared.identity.clone(),
                max_body_bytes: config.server.max_body_bytes,
                body_read_timeout: config.server.body_read_timeout.get(),
                max_stored_body_bytes: config.store.max_stored_body_bytes,
                on_concurrent: r.on_concurrent,
                wait_limit: upstream_config.map(|u| u.timeout.get()).unwrap_or_default(),
                uncertain_hold: upstream_config
                    .map(|u| u.uncertain_hold())
                    .unwrap_or_default(),
                reconcile,
                budget: shared.budget.clone(),
                body_budget: shared.body_budget.clone(),
                in_process: false,
                keep_alive: None,
            },
            metrics.clone(),
            shared.holders.clone(),
        );
        let service: RouteService = match (r.kind, r.idempotency()) {
            (RouteKind::Sync, Idempotency::None) => Arc::new(proxy),
            (RouteKind::Sync, Idempotency::Key) => Arc::new(TowerHandler(
                IdempotencyLayer::new(engine, KeyPolicy::new(r.require_key)).layer(proxy),
            )),
            (RouteKind::Sync, Idempotency::Token) => Arc::new(TowerHandler(
                IdempotencyLayer::new(engine, TokenPolicy::new(token_keys.clone(), &r.name))
                    .layer(proxy),
            )),
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
                    .map(|sig| Verifier::new(sig.spec(), |name| std::env::var(name).ok()))
                    .transpose()
                    .map_err(fail)?;
                let must_match = r
                    .must_match
                    .iter()
                    .map(|s| KeySource::parse(s))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(fail)?;
                let mut policy = CallbackPolicy::new(sources, verifier).with_must_match(must_match);
                if r.path_prefix.is_some() {
                    policy = policy.scoped_by_path();
                }
                Arc::new(TowerHandler(
                    IdempotencyLayer::new(engine, policy).layer(proxy),
                ))
            }
        };
        routes.push(Route {
            name: r.name.as_str().into(),
            matcher: r.matcher().map_err(fail)?,
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
        service: Arc::new(TowerHandler(
            TokenEndpoint::new(
                token_keys.clone(),
                config.tokens.ttl.get(),
                shared.identity.clone(),
                token_routes.clone(),
            )
            .with_limit(shared.token_limit.clone()),
        )),
        counters: metrics.route("token"),
    };
    let cors = config
        .server
        .cors_policy()
        .map_err(|reason| StartError::Route {
            route: "server.cors".into(),
            reason,
        })?;
    Ok((Router::with_cors(routes, Some(token), cors), token_routes))
}

/// A URL without its password, for messages.
pub use idemgate_core::error::redact_url as redact;
