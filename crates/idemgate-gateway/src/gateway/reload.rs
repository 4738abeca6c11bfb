//! `SIGHUP`: the configuration file is read again and what can change
//! without a restart is swapped in whole — routes, upstreams, identity,
//! CORS, token secrets and limits, the admin token and reconcilers, the
//! consumers. Each worker builds its own stacks from the new state and
//! swaps its route table; a request keeps the table it started with, and
//! no connection is closed. Claims in flight, their budgets and the store
//! stay what they are.
//!
//! A file that does not validate is refused with every problem logged, and
//! the running configuration stays. What only a restart can change (the
//! listeners, TLS, worker threads and connection limits, everything under
//! `[store]`) keeps its running value, and the log says which keys differ.

use std::path::Path;
use std::sync::Arc;

use sha2::Digest;

use super::{RunningGateway, Shared, admin_state, consumers};
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

/// A short hash of the configuration text (`idemgate_config_info`).
pub(super) fn config_hash(text: &str) -> String {
    hex::encode(&sha2::Sha256::digest(text.as_bytes())[..8])
}

impl RunningGateway {
    /// Reads `path` again and puts what it says in force (see the module
    /// docs); a file that does not load is refused and logged.
    pub async fn reload(&mut self, path: &Path) {
        let loaded = std::fs::read_to_string(path).map(|text| {
            let hash = config_hash(&text);
            (Config::load(path), hash)
        });
        let (plan, hash) = match loaded {
            Ok((Ok(plan), hash)) => (plan, hash),
            Ok((Err(e), _)) => return self.refused(&e.to_string()),
            Err(e) => return self.refused(&format!("cannot read {}: {e}", path.display())),
        };
        let kept = restart_only(&self.shared.config, &plan.config);
        if !kept.is_empty() {
            tracing::warn!(keys = %kept.join(", "), layer = "reload", "these keys changed but only take effect after a restart; their running values stay");
        }
        let shared = Arc::new(self.shared.reloaded(plan));
        self.admin.replace(admin_state(&shared, &self.store));
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
        self.shared = shared;
        self.metrics.reloaded(true);
        self.metrics.set_config_hash(&hash);
        tracing::info!(
            config = %path.display(),
            hash = %hash,
            routes = self.shared.config.routes.len(),
            consumers = self.shared.config.consumers.len(),
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

/// The keys only a restart applies that `next` changes.
fn restart_only(running: &Config, next: &Config) -> Vec<&'static str> {
    let (a, b) = (&running.server, &next.server);
    let mut changed = Vec::new();
    let mut check = |key, differs: bool| {
        if differs {
            changed.push(key);
        }
    };
    check("server.listen", a.listen != b.listen);
    check("server.admin_listen", a.admin_listen != b.admin_listen);
    check(
        "server.tls",
        format!("{:?}", a.tls) != format!("{:?}", b.tls),
    );
    check("server.http2", a.http2 != b.http2);
    check("telemetry", running.telemetry != next.telemetry);
    check(
        "server.worker_threads",
        a.worker_threads != b.worker_threads,
    );
    check(
        "server.max_connections",
        a.max_connections != b.max_connections,
    );
    check("server.max_claims", a.max_claims != b.max_claims);
    check(
        "server.max_buffered_bytes",
        a.max_buffered_bytes != b.max_buffered_bytes,
    );
    check(
        "server.max_captured_bytes",
        a.max_captured_bytes != b.max_captured_bytes,
    );
    check(
        "server.header_read_timeout",
        a.header_read_timeout.get() != b.header_read_timeout.get(),
    );
    check(
        "server.shutdown_grace",
        a.shutdown_grace.get() != b.shutdown_grace.get(),
    );
    check(
        "store",
        format!("{:?}", running.store) != format!("{:?}", next.store),
    );
    changed
}

impl Shared {
    /// The shared state `plan` describes, keeping what lives for the whole
    /// process: the store, the claims in flight and their budgets, the
    /// metrics, and every key only a restart applies (see
    /// [`restart_only`]).
    fn reloaded(&self, plan: Plan) -> Shared {
        let token_routes = plan.token_routes();
        let Plan {
            mut config,
            identity,
            server_tls: _,
            upstreams,
            routes,
            cors,
            admin_token,
        } = plan;
        config.server = self.config.server.clone();
        config.store = self.config.store.clone();
        let (token_keys, random_secret) =
            idemgate::token::TokenKeys::rotating(&config.tokens.secret_list());
        let upstreams = upstreams
            .into_iter()
            .map(|(name, mut upstream)| {
                upstream.cap_by_default(self.upstream_cap);
                (name, Arc::new(upstream))
            })
            .collect();
        Shared {
            routes,
            cors,
            server_tls: self.server_tls.clone(),
            upstreams,
            metrics: self.metrics.clone(),
            store: self.store.clone(),
            memory: self.memory.clone(),
            token_keys: Arc::new(token_keys),
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
