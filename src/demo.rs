//! `idemgate demo`: the gateway and the demo upstream together, on the
//! embedded store, with example `curl` commands printed — a newcomer's first
//! command, needing no services.

use std::collections::BTreeSet;

use idemgate_gateway::config::{Config, DEFAULT_DATABASE_URL};
use idemgate_gateway::gateway::{self, StartError};

/// Why the demo could not start.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DemoError {
    #[error("demo upstream on {addr}: {source}")]
    Upstream {
        addr: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Gateway(#[from] StartError),
}

/// Runs the demo until SIGTERM or SIGINT.
pub(crate) async fn run(mut config: Config) -> Result<(), DemoError> {
    // The demo always runs on the embedded default store, whatever the
    // environment says, so it works on a machine without services.
    config.store.database_url = DEFAULT_DATABASE_URL.into();
    config.store.redis_url.clear();

    let authorities: BTreeSet<String> = config
        .upstreams
        .iter()
        .filter_map(|u| url::Url::parse(&u.url).ok())
        .filter_map(|u| Some(format!("{}:{}", u.host_str()?, u.port_or_known_default()?)))
        .collect();
    let mut upstreams = Vec::new();
    for addr in &authorities {
        let upstream = idemgate_demo_upstream::start(addr)
            .await
            .map_err(|source| DemoError::Upstream {
                addr: addr.clone(),
                source,
            })?;
        upstreams.push(upstream);
    }
    let gateway = gateway::start(config.clone()).await?;
    print_guide(
        &config,
        gateway.public_addr,
        gateway.admin_addr,
        &authorities,
    );
    idemgate_server::termination().await;
    gateway.shutdown().await;
    for upstream in upstreams {
        upstream.shutdown().await;
    }
    Ok(())
}

fn print_guide(
    config: &Config,
    public: std::net::SocketAddr,
    admin: std::net::SocketAddr,
    upstreams: &BTreeSet<String>,
) {
    let g = format!("http://{public}");
    let upstream = upstreams.iter().next().cloned().unwrap_or_default();
    println!(
        r#"
Idemgate demo is running.
  gateway        {g}
  admin          http://{admin}   (/healthz /readyz /metrics)
  demo upstream  http://{upstream}   (GET /stats shows every real execution)
  store          {db} (embedded) with the in-process fast layer
  routes         {routes}

Try it (another terminal):

  # 1. A one-time token, then an order placed with it
  TOKEN=$(curl -s -X POST '{g}/token?route=create-order' | sed 's/.*"token":"\([^"]*\)".*/\1/')
  curl -s -i -X POST {g}/orders -H "Idempotency-Token: $TOKEN" -d '{{"item":"book","amount":100}}'

  # 2. The same request again (a double click, a client retry): replayed,
  #    with Idempotent-Replayed: true; the upstream is not called
  curl -s -i -X POST {g}/orders -H "Idempotency-Token: $TOKEN" -d '{{"item":"book","amount":100}}'

  # 3. The same token for another order: 422
  curl -s -i -X POST {g}/orders -H "Idempotency-Token: $TOKEN" -d '{{"item":"pen","amount":1}}'

  # 4. An API call with an Idempotency-Key, sent twice
  curl -s -i -X POST {g}/coupons/deduct -H 'Idempotency-Key: deduct-42' -d '{{"coupon":"C1","order_id":"ord_1"}}'
  curl -s -i -X POST {g}/coupons/deduct -H 'Idempotency-Key: deduct-42' -d '{{"coupon":"C1","order_id":"ord_1"}}'

  # 5. A payment provider notifies twice (it retries until it sees a 2xx):
  #    the order moves to PAID once; the duplicate gets the stored ack
  ORDER=$(curl -s -X POST http://{upstream}/orders -d '{{"item":"book"}}' | sed 's/.*"order_id":"\([^"]*\)".*/\1/')
  curl -s -i -X POST {g}/callbacks/payment -d "{{\"trade_no\":\"T-1\",\"order_id\":\"$ORDER\"}}"
  curl -s -i -X POST {g}/callbacks/payment -d "{{\"trade_no\":\"T-1\",\"order_id\":\"$ORDER\"}}"

  # 6. The lost ACK: the charge commits, then the connection drops (502).
  #    The retry is answered from the upstream's status endpoint
  #    (reconcile_path), replayed, not executed a second time
  curl -s -i -X POST {g}/actions/charge -H 'Idempotency-Key: charge-7' -H 'X-Demo-Drop: after' -d '{{"amount":5}}'
  curl -s -i -X POST {g}/actions/charge -H 'Idempotency-Key: charge-7' -d '{{"amount":5}}'

  # 7. What really executed upstream: each action once
  curl -s http://{upstream}/stats

  # Reads pass straight through
  curl -s {g}/orders/ord_unknown

  # 8. With RabbitMQ on 127.0.0.1:5672 (consumers: {consumers}):
  #    the same message published three times, executed once
  #    (rabbitmqadmin needs: rabbitmq-plugins enable rabbitmq_management)
  rabbitmqadmin declare queue name=coupon.events durable=true
  for i in 1 2 3; do rabbitmqadmin publish exchange=amq.default routing_key=coupon.events \
    payload='{{"coupon":"C1"}}' properties='{{"message_id":"m-1"}}'; done
  curl -s http://{upstream}/stats      # mq_push: one execution for coupon.events/m-1
  curl -s http://{admin}/readyz        # each consumer's broker connection

Stop with Ctrl-C.
"#,
        db = config.store.database_url,
        consumers = if config.consumers.is_empty() {
            "none configured".to_owned()
        } else {
            config
                .consumers
                .iter()
                .map(|c| c.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        },
        routes = config
            .routes
            .iter()
            .map(|r| r.name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
    );
}
