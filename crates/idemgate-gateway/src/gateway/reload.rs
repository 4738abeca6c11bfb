//! `SIGHUP`: the configuration file is read again and what can change
//! without a restart is swapped in whole — routes, upstreams, identity,
//! CORS, token secrets and limits, the admin token and reconcilers, the
//! consumers. Each worker builds its own stacks from the new state and
//! swaps its route table; a request keeps the table it started with, and
//! no connection is closed. Claims in flight, their budgets and the store
//! stay what they are.
//!
//! What is validated is what will run (docs/semantics.md, rule 12). The
//! keys only a restart applies (the listeners, TLS, worker threads and
//! connection limits, telemetry, everything under `[store]`) keep their
//! running values, and the file's other keys are checked beside them with
//! every start-up check: a longer upstream timeout against the running
//! retention, a new admin token against the admin listener that stays. A
//! file that does not validate so is refused with every problem logged and
//! counted, and the running configuration stays; the log says which
//! restart-only keys differ. A random token secret (no secret configured)
//! is drawn once per process: a reload keeps it, so no issued token turns
//! invalid under a client that would then fetch another and pay twice.

use std::path::Path;
use std::sync::Arc;

use super::{InForce, RunningGateway, admin_state, consumers};
use crate::config::{Config, Plan};

/// `SIGHUP`s, one message each (none where the platform has no signals).
pub(super) fn hangups() -> tokio::sync::mpsc::Receiver<()> {
    let (send, receive) = tokio::sync::mpsc::channel(1);
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::hangup()) {
            Ok(mut hangup) => {
                tokio::spawn(async move {
                    while hangup.recv().await.is_some() {
                        // Several at once are one reload.
                        let _ = send.try_send(());
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, layer = "reload", "cannot listen for SIGHUP; reloading is off")
            }
        }
    }
    #[cfg(not(unix))]
    drop(send);
    receive
}

impl RunningGateway {
    /// Reads `path` again and puts what it says in force (see the module
    /// docs); a file that does not validate as what would run is refused
    /// and logged.
    pub async fn reload(&mut self, path: &Path) {
        let origin = path.display().to_string();
        let next = match Config::read(path) {
            Ok(next) => next,
            Err(e) => return self.refused(&e.to_string()),
        };
        let (next, kept) = next.keeping_restart_only(&self.shared.config);
        if !kept.is_empty() {
            tracing::warn!(keys = %kept.join(", "), layer = "reload", "these keys changed but only take effect after a restart; their running values stay, and the file was checked with them");
        }
        let plan = match next.validate(&origin) {
            Ok(plan) => plan,
            Err(e) => return self.refused(&e.to_string()),
        };
        // Records keep their identity (rule 12): no live record is moved
        // out of reach by a rename, a removal or a new identity source.
        let scopings = match super::scopes::check(&self.store, &plan, &origin).await {
            Ok(scopings) => scopings,
            Err(e) => return self.refused(&e.to_string()),
        };
        let fingerprint = plan.config.fingerprint();
        let shared = Arc::new(self.shared.reloaded(plan));
        self.admin
            .replace(admin_state(&shared, &self.store, &self.commit_survives));
        // The consumers: the old ones finish the messages in hand (within
        // the grace), the new ones start.
        self.stop_consumers.cancel();
        let old = std::mem::replace(
            &mut self.consumers,
            idemgate_mq::Consumers::spawn(Vec::new(), self.stop_consumers.clone()),
        );
        old.join().await;
        self.stop_consumers = tokio_util::sync::CancellationToken::new();
        match consumers::build(&shared, &self.store) {
            Ok(deliverers) => {
                self.consumers =
                    idemgate_mq::Consumers::spawn(deliverers, self.stop_consumers.clone())
            }
            Err(e) => {
                tracing::error!(error = %e, layer = "reload", "the consumers could not be rebuilt")
            }
        }
        // Every worker rebuilds its route table from this.
        let _ = self.tables.send(shared.clone());
        if let Err(e) = super::scopes::register(&self.store, &scopings).await {
            tracing::warn!(error = %e, layer = "reload", "the records' scopes could not be registered; the next start or reload checks against the previous ones");
        }
        self.shared = shared;
        self.metrics.reloaded(true);
        self.metrics.set_config_hash(&fingerprint);
        tracing::info!(
            config = %origin,
            fingerprint = %fingerprint,
            routes = self.shared.routes.len(),
            consumers = self.shared.consumers.len(),
            layer = "reload",
            "configuration reloaded"
        );
    }

    fn refused(&self, problems: &str) {
        self.metrics.reloaded(false);
        for line in problems.lines().filter(|l| !l.trim().is_empty()) {
            tracing::error!(problem = %line.trim(), layer = "reload", "configuration refused; the running one stays");
        }
    }
}

impl Config {
    /// This configuration as a reload of `running` would run it: every key
    /// only a restart applies at its running value. With the keys whose
    /// value in this file differs (and does not run).
    fn keeping_restart_only(mut self, running: &Config) -> (Config, Vec<&'static str>) {
        let mut differ = Vec::new();
        let (was, next) = (&running.server, &mut self.server);
        let mut keep = |key, differs: bool| {
            if differs {
                differ.push(key);
            }
        };
        keep("server.listen", was.listen != next.listen);
        keep("server.admin_listen", was.admin_listen != next.admin_listen);
        keep(
            "server.tls",
            format!("{:?}", was.tls) != format!("{:?}", next.tls),
        );
        keep("server.http2", was.http2 != next.http2);
        keep(
            "server.worker_threads",
            was.worker_threads != next.worker_threads,
        );
        keep(
            "server.max_connections",
            was.max_connections != next.max_connections,
        );
        keep("server.max_claims", was.max_claims != next.max_claims);
        keep(
            "server.max_buffered_bytes",
            was.max_buffered_bytes != next.max_buffered_bytes,
        );
        keep(
            "server.max_captured_bytes",
            was.max_captured_bytes != next.max_captured_bytes,
        );
        keep(
            "server.header_read_timeout",
            was.header_read_timeout.get() != next.header_read_timeout.get(),
        );
        keep(
            "server.shutdown_grace",
            was.shutdown_grace.get() != next.shutdown_grace.get(),
        );
        keep("telemetry", running.telemetry != self.telemetry);
        keep(
            "store",
            format!("{:?}", running.store) != format!("{:?}", self.store),
        );
        let next = &mut self.server;
        next.listen = was.listen.clone();
        next.admin_listen = was.admin_listen.clone();
        next.tls = was.tls.clone();
        next.http2 = was.http2;
        next.worker_threads = was.worker_threads;
        next.max_connections = was.max_connections;
        next.max_claims = was.max_claims;
        next.max_buffered_bytes = was.max_buffered_bytes;
        next.max_captured_bytes = was.max_captured_bytes;
        next.header_read_timeout = was.header_read_timeout.clone();
        next.shutdown_grace = was.shutdown_grace.clone();
        self.telemetry = running.telemetry.clone();
        self.store = running.store.clone();
        (self, differ)
    }
}

impl InForce {
    /// The shared state `plan` describes, keeping what lives for the whole
    /// process: the store, the claims in flight and their budgets, the
    /// metrics, the random token secret. `plan` carries the running values
    /// of the keys only a restart applies (see
    /// [`Config::keeping_restart_only`]).
    fn reloaded(&self, plan: Plan) -> InForce {
        let token_routes = plan.token_routes();
        let Plan {
            config,
            identity,
            server_tls: _,
            upstreams,
            routes,
            consumers,
            cors,
            admin_token,
            in_memory_store_for_tests: _,
        } = plan;
        let (token_keys, random_secret) =
            match idemgate::token::TokenKeys::rotating(&config.tokens.secret_list()) {
                // Still no secret: the process's random one goes on signing.
                (_, true) if self.random_secret => (self.token_keys.clone(), true),
                (keys, random) => (Arc::new(keys), random),
            };
        let upstreams = upstreams
            .into_iter()
            .map(|(name, mut upstream)| {
                upstream.cap_by_default(self.upstream_cap);
                (name, Arc::new(upstream))
            })
            .collect();
        InForce {
            routes,
            consumers,
            cors,
            server_tls: self.server_tls.clone(),
            upstreams,
            metrics: self.metrics.clone(),
            store: self.store.clone(),
            memory: self.memory.clone(),
            token_keys,
            random_secret,
            token_routes,
            workers: self.workers,
            holders: self.holders.clone(),
            identity,
            budget: self.budget.clone(),
            body_budget: self.body_budget.clone(),
            answer_budget: self.answer_budget.clone(),
            token_limit: idemgate::token::IssueLimit::per_minute(config.tokens.issue_per_minute)
                .map(Arc::new),
            admin_token,
            upstream_cap: self.upstream_cap,
            config,
        }
    }
}
