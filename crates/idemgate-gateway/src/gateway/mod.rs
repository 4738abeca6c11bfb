//! Assembly: from a [`Plan`] (a validated, loaded configuration) to
//! running listeners, in named phases.
//!
//! [`start_plan`] binds both listeners (so tests can pass port 0 and read the real
//! addresses back), builds one stack per route and spawns the serve loops;
//! [`run`] is `idemgate serve`: start, wait for SIGTERM/SIGINT, drain.

use std::net::SocketAddr;
use std::sync::Arc;

use idemgate::idempotency::Holders;
use idemgate::token::TokenKeys;
use idemgate_core::budget::ClaimBudget;
use idemgate_core::identity::Identity;
use idemgate_core::metrics::Metrics;
use idemgate_proxy::Upstream;
use idemgate_server::{ConnLimits, ShutdownTrigger};
use idemgate_store::Store;
use tokio::task::JoinHandle;

use crate::config::{Config, ConsumerPlan, Plan, RoutePlan};

mod consumers;
mod reload;
mod routes;
mod scopes;
mod workers;

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A listener could not be bound (or a worker could not take it up).
    #[error("{key} = {addr:?}: cannot listen: {source}")]
    Bind {
        /// The config key naming the address (`server.listen` or
        /// `server.admin_listen`).
        key: &'static str,
        /// The address as configured or resolved.
        addr: String,
        /// Why binding failed.
        source: std::io::Error,
    },
    /// A route's or consumer's stack could not be built (an unknown
    /// upstream), or a worker thread failed to start.
    #[error("route {route:?}: {reason}")]
    Route {
        /// The route's name (`consumer <name>`, or the config key at fault).
        route: String,
        /// What went wrong.
        reason: String,
    },
    /// The store could not be opened, or the record scopes not registered.
    #[error("store ({url}): {source}")]
    Store {
        /// `store.database_url`, its password masked.
        url: String,
        /// The store's error.
        source: idemgate_store::StoreError,
    },
    /// The configuration was refused, or would put live records out of
    /// reach.
    #[error("{0}")]
    Config(crate::config::ConfigError),
    /// `store.require_synchronous` is set and the database does not
    /// confirm that a commit survives a failover.
    #[error(
        "store.require_synchronous = true, but the database's commits are {durability}; \
         refusing to serve"
    )]
    NotSynchronous {
        /// What the database said.
        durability: idemgate_store::Durability,
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
    /// The shared state in force, and where the workers hear of a new one.
    shared: Arc<InForce>,
    tables: tokio::sync::watch::Sender<Arc<InForce>>,
    admin: crate::admin::AdminHandle,
    stop_consumers: tokio_util::sync::CancellationToken,
    consumers: idemgate_mq::Consumers,
    sweeper: JoinHandle<()>,
    purge_follower: JoinHandle<()>,
    tasks: Vec<JoinHandle<()>>,
    workers: Vec<std::thread::JoinHandle<()>>,
    /// 1 while the database confirms its commits survive a failover.
    commit_survives: Arc<std::sync::atomic::AtomicU64>,
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
        self.purge_follower.abort();
    }
}

/// Starts the gateway `config` describes, loading what it names (for a
/// configuration built in code; `idemgate serve` validates first and
/// starts from the [`Plan`]).
pub async fn start(config: Config) -> Result<RunningGateway, StartError> {
    start_plan(Plan::load(config).map_err(StartError::Config)?).await
}

/// [`start`], for tests: the store may be an in-memory database
/// (`sqlite::memory:`), which a real start refuses.
pub async fn start_for_tests(config: Config) -> Result<RunningGateway, StartError> {
    let mut plan = Plan::load(config).map_err(StartError::Config)?;
    plan.in_memory_store_for_tests = true;
    start_plan(plan).await
}

/// Connections each worker may hold past its share of `max_connections`
/// only to answer them `503 connections-exhausted`, however small the cap.
const MIN_REFUSALS_AT_CAP: usize = 16;

/// (Long by design: the start-up phases in order, one step each.)
/// Starts the gateway on the listeners the plan names, in phases: the
/// admin listener, the store, the shared state, the public listener's
/// workers, the consumers, and the admin routes.
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
pub async fn start_plan(plan: Plan) -> Result<RunningGateway, StartError> {
    let (admin, admin_addr) = bind(&plan.config.server.admin_listen, "server.admin_listen").await?;
    let metrics = Arc::new(plan.config.metrics());
    let records = Records::open(&plan.config, plan.in_memory_store_for_tests, &metrics).await?;
    let commit_survives = commit_durability(&plan.config, &records.store, &metrics).await?;
    // Records keep their identity: a configuration that would put live
    // records out of reach does not start.
    let scopings = scopes::check(&records.store, &plan, "the configuration")
        .await
        .map_err(StartError::Config)?;
    scopes::register(&records.store, &scopings)
        .await
        .map_err(|source| StartError::Store {
            url: redact(&plan.config.store.database_url),
            source,
        })?;
    let threads = match plan.config.server.worker_threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let budgets = descriptor_budgets(&plan, threads);
    metrics.claims_limit.store(
        budgets.max_claims as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
    let shared = Arc::new(InForce::new(plan, &metrics, &records, &budgets, threads));
    let answers = shared.answer_budget.clone();
    metrics.gauge(
        "idemgate_answer_bytes_held",
        "Bytes of upstream answers held or reserved until their record is written (server.max_captured_bytes; passed only by answers already in hand).",
        move || answers.held(),
    );
    // Built once here so that a bad route fails the start, not a thread.
    routes::build_router(&shared, &records.store)?;
    if shared.random_secret && !shared.token_routes.is_empty() {
        tracing::warn!(
            "tokens.secret is empty: using a random secret for this process; tokens will not \
             survive a restart or work across gateway instances (set IDEMGATE_TOKEN_SECRET)"
        );
    }
    let (trigger, signal) = idemgate_server::shutdown_pair();
    let (tables, subscribed) = tokio::sync::watch::channel(shared.clone());
    let limits = ConnLimits {
        header_read_timeout: shared.config.server.header_read_timeout.get(),
        max_connections: budgets.max_connections.div_ceil(threads),
        // At the cap, newcomers are answered 503 at once, a quarter of the
        // cap more at a time (the descriptors permitting), instead of
        // waiting unanswered in the backlog.
        refuse_at_cap: (budgets.max_connections.div_ceil(threads) / 4).max(MIN_REFUSALS_AT_CAP),
        claims_per_connection: budgets.claims_per_connection,
        shutdown_grace: shared.config.server.shutdown_grace.get(),
        http2: shared.config.server.http2,
        tls: shared.server_tls.clone(),
    };
    let (public_addr, workers) =
        match workers::spawn(&shared, &subscribed, limits, &signal, threads).await {
            Ok(started) => started,
            Err(e) => {
                trigger.trigger();
                return Err(e);
            }
        };
    let stop_consumers = tokio_util::sync::CancellationToken::new();
    let consumers = idemgate_mq::Consumers::spawn(
        consumers::build(&shared, &records.store)?,
        stop_consumers.clone(),
    );
    let admin_handle =
        crate::admin::AdminHandle::new(admin_state(&shared, &records.store, &commit_survives));
    let admin_task = serve_admin(admin, admin_handle.clone(), signal);
    tracing::info!(
        %public_addr,
        %admin_addr,
        routes = shared.routes.len(),
        consumers = shared.consumers.len(),
        workers = threads,
        sql = records.store.sql().backend(),
        fast_layer = records.store.fast_layer_name(),
        "idemgate listening"
    );
    Ok(RunningGateway {
        public_addr,
        admin_addr,
        metrics,
        store: records.store,
        trigger,
        shared,
        tables,
        admin: admin_handle,
        stop_consumers,
        consumers,
        sweeper: records.sweeper,
        purge_follower: records.purge_follower,
        tasks: vec![admin_task],
        workers,
        commit_survives,
    })
}

/// Asks the database whether a commit survives a failover, says so, and
/// refuses to start when `store.require_synchronous` wants it and it does
/// not. The answer is kept for the metric
/// `idemgate_store_commit_survives_failover` (`/readyz` asks again).
async fn commit_durability(
    config: &Config,
    store: &Store,
    metrics: &Metrics,
) -> Result<Arc<std::sync::atomic::AtomicU64>, StartError> {
    let durability = match store.sql().durability().await {
        Ok(durability) => durability,
        // A database that will not say (a compatible server without the
        // views asked): unknown, which only require_synchronous refuses.
        Err(source) if config.store.require_synchronous => {
            return Err(StartError::Store {
                url: redact(&config.store.database_url),
                source,
            });
        }
        Err(e) => idemgate_store::Durability::Unconfirmed(format!("the database did not say: {e}")),
    };
    if config.store.require_synchronous && !durability.survives_failover() {
        return Err(StartError::NotSynchronous { durability });
    }
    match &durability {
        idemgate_store::Durability::Asynchronous(_) => tracing::warn!(
            durability = durability.name(),
            detail = durability.detail(),
            layer = "sql",
            "a failover of the database can lose the last commits: a claim or an answer a client \
             saw could vanish, and its retry execute again (store.require_synchronous refuses this)"
        ),
        _ => tracing::info!(
            durability = durability.name(),
            detail = durability.detail(),
            layer = "sql",
            "the database's commits"
        ),
    }
    let survives = Arc::new(std::sync::atomic::AtomicU64::new(u64::from(
        durability.survives_failover(),
    )));
    let read = survives.clone();
    metrics.gauge(
        "idemgate_store_commit_survives_failover",
        "1 when the database confirmed, at start or at the last /readyz, that a commit survives a failover (a synchronous standby, a Galera quorum, lossless semi-synchronous replication); 0 otherwise.",
        move || read.load(std::sync::atomic::Ordering::Relaxed),
    );
    Ok(survives)
}

/// Binds a listener named by the configuration key `key`.
async fn bind(
    addr: &str,
    key: &'static str,
) -> Result<(tokio::net::TcpListener, SocketAddr), StartError> {
    let fail = |source| StartError::Bind {
        key,
        addr: addr.to_owned(),
        source,
    };
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(fail)?;
    let local = listener.local_addr().map_err(fail)?;
    Ok((listener, local))
}

/// The store and its background work, on the calling runtime.
struct Records {
    store: Store,
    memory: Arc<idemgate_store::MemoryLayer>,
    sweeper: JoinHandle<()>,
    purge_follower: JoinHandle<()>,
}

impl Records {
    async fn open(
        config: &Config,
        in_memory_for_tests: bool,
        metrics: &Arc<Metrics>,
    ) -> Result<Records, StartError> {
        let options = idemgate_store::StoreOptions {
            in_memory_for_tests,
            ..config.store.options()
        };
        let (store, memory) = idemgate_store::open(&options, metrics.clone())
            .await
            .map_err(|source| StartError::Store {
                url: redact(&config.store.database_url),
                source,
            })?;
        let sweeper = idemgate_store::spawn_sweeper(
            store.sql().clone(),
            Some(memory.clone()),
            config.store.sweep_interval.get(),
            config.store.archive,
        );
        // Purges made elsewhere (the CLI, another instance) reach this
        // process's in-process layer (the fast layer, or the copies of
        // completed answers kept in front of Redis) through the purge log.
        let purge_follower = idemgate_store::follow_purges(store.sql().clone(), memory.clone());
        let held = memory.clone();
        metrics.gauge(
            "idemgate_memory_layer_bytes",
            "Bytes the in-process layer holds: the fast layer, or with Redis the answers kept near (store.memory_layer_bytes at most).",
            move || held.bytes() as u64,
        );
        Ok(Records {
            store,
            memory,
            sweeper,
            purge_follower,
        })
    }
}

/// The state in force: what every worker thread builds its route stacks
/// from (a reload swaps in a new one).
struct InForce {
    config: Config,
    /// Every route, built.
    routes: Vec<RoutePlan>,
    /// Every consumer, built.
    consumers: Vec<ConsumerPlan>,
    cors: Option<crate::router::CorsPolicy>,
    /// `[server.tls]`, loaded.
    server_tls: Option<Arc<rustls::ServerConfig>>,
    /// Every upstream by name, TLS settings loaded.
    upstreams: std::collections::HashMap<String, Arc<Upstream>>,
    metrics: Arc<Metrics>,
    /// The main runtime's store (admin, sweeper); workers open their own.
    store: Store,
    memory: Arc<idemgate_store::MemoryLayer>,
    token_keys: Arc<TokenKeys>,
    /// No token secret was configured: a random one signs.
    random_secret: bool,
    /// Each token route's name and the identity its tokens bind to.
    token_routes: std::collections::BTreeMap<String, String>,
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
    /// The process's answers held until their record is written.
    answer_budget: idemgate::idempotency::answer::AnswerBudget,
    /// The admin API's bearer token.
    admin_token: Option<crate::config::AdminToken>,
    /// The default cap on an upstream's HTTP/1.1 connections (the
    /// descriptors' share), for upstreams a reload adds.
    upstream_cap: usize,
}

impl InForce {
    fn new(
        plan: Plan,
        metrics: &Arc<Metrics>,
        records: &Records,
        budgets: &idemgate_core::limits::Budgets,
        workers: usize,
    ) -> InForce {
        let token_routes = plan.token_routes();
        let Plan {
            config,
            identity,
            server_tls,
            upstreams,
            routes,
            consumers,
            cors,
            admin_token,
            in_memory_store_for_tests: _,
        } = plan;
        let (token_keys, random_secret) = TokenKeys::rotating(&config.tokens.secret_list());
        let upstreams = upstreams
            .into_iter()
            .map(|(name, mut upstream)| {
                // No cap configured: the descriptors' share is the cap.
                upstream.cap_by_default(budgets.upstream_connections);
                (name, Arc::new(upstream))
            })
            .collect();
        InForce {
            admin_token,
            upstream_cap: budgets.upstream_connections,
            routes,
            consumers,
            cors,
            server_tls,
            upstreams,
            metrics: metrics.clone(),
            store: records.store.clone(),
            memory: records.memory.clone(),
            token_keys: Arc::new(token_keys),
            random_secret,
            token_routes,
            workers,
            holders: Arc::new(Holders::default()),
            identity,
            budget: ClaimBudget::new(budgets.max_claims),
            body_budget: idemgate::idempotency::body::BodyBudget::new(
                config.server.max_buffered_bytes,
            ),
            answer_budget: idemgate::idempotency::answer::AnswerBudget::new(
                config.server.max_captured_bytes,
            ),
            // One limit for the process, not one per worker.
            token_limit: idemgate::token::IssueLimit::per_minute(config.tokens.issue_per_minute)
                .map(Arc::new),
            config,
        }
    }
}

/// What the admin API reads, from the shared state in force.
fn admin_state(
    shared: &InForce,
    store: &Store,
    commit_survives: &Arc<std::sync::atomic::AtomicU64>,
) -> crate::admin::AdminState {
    crate::admin::AdminState {
        commit_survives: commit_survives.clone(),
        require_synchronous: shared.config.store.require_synchronous,
        metrics: shared.metrics.clone(),
        store: store.clone(),
        identity: shared.identity.clone(),
        token: shared.admin_token.clone(),
        reconcilers: Arc::new(routes::reconcilers(shared)),
        max_stored_body_bytes: shared.config.store.max_stored_body_bytes,
        answer_budget: shared.answer_budget.clone(),
        record_ids: Arc::new(
            shared
                .routes
                .iter()
                .map(|r| (r.name.clone(), r.record_id.clone()))
                .chain(
                    shared
                        .consumers
                        .iter()
                        .map(|c| (c.name.clone(), c.record_id.clone())),
                )
                .collect(),
        ),
    }
}

/// The admin listener's routes, served until the shutdown signal.
fn serve_admin(
    admin: tokio::net::TcpListener,
    handle: crate::admin::AdminHandle,
    mut signal: idemgate_server::ShutdownSignal,
) -> JoinHandle<()> {
    let admin_app = crate::admin::router(handle);
    tokio::spawn(async move {
        let serving = axum::serve(admin, admin_app)
            .with_graceful_shutdown(async move { signal.wait().await });
        if let Err(e) = serving.await {
            tracing::error!(error = %e, "admin listener failed");
        }
    })
}

/// The descriptor limit (raised to its hard limit first) and the budgets it
/// allows, said once in the log when it lowers what the file asks for.
fn descriptor_budgets(plan: &Plan, workers: usize) -> idemgate_core::limits::Budgets {
    let config = &plan.config;
    let limit = idemgate_core::limits::raise_descriptor_limit();
    // The store's pools, Redis (one per worker and the main runtime), and
    // each consumer's broker connection and dead-letter channel.
    let reserve = idemgate_core::limits::BASE_RESERVE
        + config.store.pool_size as usize * 2
        + (workers + 1) * 2
        + plan.consumers.len() * 4;
    let budgets = idemgate_core::limits::budgets(
        limit,
        reserve,
        plan.upstreams.len(),
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

/// `idemgate serve`: runs until SIGTERM or SIGINT, then drains; `SIGHUP`
/// re-reads `path` (see [`RunningGateway::reload`]).
pub async fn run(plan: Plan, path: std::path::PathBuf) -> Result<(), StartError> {
    let fingerprint = plan.config.fingerprint();
    let mut gateway = start_plan(plan).await?;
    gateway.metrics.set_config_hash(&fingerprint);
    let mut hangups = reload::hangups();
    let terminated = idemgate_server::termination();
    tokio::pin!(terminated);
    loop {
        tokio::select! {
            () = &mut terminated => break,
            Some(()) = hangups.recv() => gateway.reload(&path).await,
        }
    }
    tracing::info!("shutting down: no new connections, finishing in-flight requests");
    gateway.shutdown().await;
    tracing::info!("stopped");
    Ok(())
}

/// A URL without its password, for messages.
pub use idemgate_core::error::redact_url as redact;
