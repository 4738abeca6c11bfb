//! The `[[consumers]]`: one deliverer each, through the same engine, store
//! and holders as the routes.

use std::sync::Arc;

use idemgate::idempotency::{Engine, EngineSettings};
use idemgate_proxy::Proxy;
use idemgate_store::Store;

use super::{Shared, StartError};

/// One deliverer per `[[consumers]]` entry, on the calling runtime: each
/// runs through the same engine, store and holders as the routes, with its
/// name as the route of its records.
pub(super) fn build(
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
                dead_letter: match c.dead_letter.as_deref() {
                    Some(crate::config::DEAD_LETTER_EXCHANGE) => idemgate_mq::DeadLetters::Dlx,
                    _ => idemgate_mq::DeadLetters::Queue(c.dead_letter_name()),
                },
            },
            Some(Broker::Nats) => Source::Nats {
                url: c.source.clone(),
                stream: c.stream.clone().unwrap_or_default(),
                durable: c.durable_name().to_owned(),
                dead_letter: c.dead_letter_name(),
            },
            Some(Broker::Redis) => Source::Redis(idemgate_mq::StreamSource {
                url: c.source.clone(),
                stream: c.stream.clone().unwrap_or_default(),
                group: c.group_name().to_owned(),
                claim_idle: c.claim_idle.get(),
                dead_letter: c.dead_letter_name(),
            }),
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
            records: c.record_id().into(),
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
            store.without_fast_layer(),
            EngineSettings {
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
                uncertain_statuses: config
                    .upstream(&c.upstream)
                    .map(|u| u.uncertain_statuses())
                    .unwrap_or_default(),
                budget: shared.budget.clone(),
                body_budget: shared.body_budget.clone(),
                answer_budget: shared.answer_budget.clone(),
                // Never read: a message's records are the consumer's.
                ..EngineSettings::new(c.record_id(), shared.identity.clone())
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
