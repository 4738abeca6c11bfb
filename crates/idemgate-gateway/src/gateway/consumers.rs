//! The `[[consumers]]`: one deliverer each, through the same engine, store
//! and holders as the routes. Built from the plan's consumer entries alone:
//! each source, path and key source was read and checked once, when the
//! plan was made.

use std::sync::Arc;

use idemgate::idempotency::{Engine, EngineSettings};
use idemgate_mq::{ConsumerSettings, Deliverer};
use idemgate_proxy::Proxy;
use idemgate_store::Store;

use super::{InForce, StartError};
use crate::config::OnConcurrent;

/// One deliverer per `[[consumers]]` entry, on the calling runtime: each
/// runs through the same engine, store and holders as the routes, with its
/// name as the route of its records.
pub(super) fn build(shared: &InForce, store: &Store) -> Result<Vec<Arc<Deliverer>>, StartError> {
    let server = &shared.config.server;
    let mut deliverers = Vec::with_capacity(shared.consumers.len());
    for c in &shared.consumers {
        let upstream =
            shared
                .upstreams
                .get(&c.upstream)
                .cloned()
                .ok_or_else(|| StartError::Route {
                    route: format!("consumer {}", c.name),
                    reason: format!("unknown upstream {:?}", c.upstream),
                })?;
        let settings = ConsumerSettings {
            name: c.name.as_str().into(),
            records: c.record_id.as_str().into(),
            source: c.source.clone(),
            path: c.path.clone(),
            sources: c.sources.clone(),
            must_match: c.must_match.clone(),
            prefetch: c.prefetch,
            max_deliveries: c.max_deliveries,
            retry_delay: c.retry_delay,
            upstream_timeout: upstream.timeout,
            shutdown_grace: server.shutdown_grace.get(),
        };
        let engine = Engine::new(
            store.without_fast_layer(),
            EngineSettings {
                max_body_bytes: server.max_body_bytes,
                body_read_timeout: server.body_read_timeout.get(),
                max_stored_body_bytes: shared.config.store.max_stored_body_bytes,
                // Never `wait`: a waiter replays the holder's outcome the
                // moment it exists, before its write is durable, and a
                // consumer acknowledges every replay.
                on_concurrent: OnConcurrent::Reject,
                wait_limit: c.outcomes.wait_limit,
                uncertain_hold: c.outcomes.uncertain_hold,
                uncertain_statuses: c.outcomes.uncertain_statuses,
                budget: shared.budget.clone(),
                body_budget: shared.body_budget.clone(),
                answer_budget: shared.answer_budget.clone(),
                // Never read: a message's records are the consumer's.
                ..EngineSettings::new(&c.record_id, shared.identity.clone())
            },
            shared.metrics.clone(),
            shared.holders.clone(),
        );
        let proxy = Proxy::new(
            upstream.pool(),
            upstream.clone(),
            server.max_body_bytes,
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
