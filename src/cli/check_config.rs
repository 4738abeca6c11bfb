//! `idemgate check-config`: the listeners, the route table, the consumers
//! and the warnings of a configuration that loaded.

use std::time::Duration;

use idemgate_gateway::config::Config;
use idemgate_store::{Dialect, SqlSettings, SqlStore};

/// How long `check-config` tries to reach the database.
const REACH_WITHIN: Duration = Duration::from_secs(3);

/// Whether the database's commits survive a failover, when it can be
/// reached (a server database; a SQLite file is not opened, let alone
/// created). With `store.require_synchronous`, a database that answers
/// and does not confirm it fails the check, as `serve` would.
pub(super) async fn durability(config: &Config) -> Result<(), String> {
    let url = &config.store.database_url;
    if Dialect::of(url) == Some(Dialect::Sqlite) {
        let line = "unconfirmed: SQLite, one file on one machine";
        println!("\nstore commits: {line}");
        return refuse_unless_synchronous(config, false, line);
    }
    let settings = SqlSettings {
        url: url.clone(),
        pool_size: 1,
        timeout: REACH_WITHIN,
        tombstone: Duration::ZERO,
        schema: None,
        retention: config.store.retention.get(),
        partition_span: config.store.retention.get(),
    };
    let asked = tokio::time::timeout(REACH_WITHIN, async {
        SqlStore::connect(&settings).await?.durability().await
    })
    .await;
    match asked {
        Ok(Ok(d)) => {
            println!("\nstore commits: {d}");
            refuse_unless_synchronous(config, d.survives_failover(), &d.to_string())
        }
        Ok(Err(e)) => {
            println!("\nstore commits: not checked, the database did not answer ({e})");
            Ok(())
        }
        Err(_) => {
            println!(
                "\nstore commits: not checked, the database did not answer within {REACH_WITHIN:?}"
            );
            Ok(())
        }
    }
}

fn refuse_unless_synchronous(config: &Config, synchronous: bool, said: &str) -> Result<(), String> {
    if config.store.require_synchronous && !synchronous {
        Err(format!(
            "store.require_synchronous = true, but the database's commits are {said}: \
             serve would refuse to start"
        ))
    } else {
        Ok(())
    }
}

/// Everything `check-config` prints, in order.
pub(super) fn print(config: &Config) {
    print_endpoints(config);
    print_route_table(config);
    print_warnings(config);
}

/// What a valid config still risks, one line each on stderr (beside the
/// refusals, which go there too); the exit status stays 0.
fn print_warnings(config: &Config) {
    for w in config.warnings() {
        eprintln!("warning: {}: {}", w.key, w.reason);
    }
}

/// Each listener's and each upstream's scheme and protocols.
fn print_endpoints(config: &Config) {
    let server = &config.server;
    let (scheme, protocols) = match (&server.tls, server.http2) {
        (Some(_), true) => ("https", "HTTP/1.1, h2 (ALPN)"),
        (Some(_), false) => ("https", "HTTP/1.1"),
        (None, true) => ("http", "HTTP/1.1, h2c (prior knowledge)"),
        (None, false) => ("http", "HTTP/1.1"),
    };
    println!(
        "{:<20} {:<22} {:<7} PROTOCOLS",
        "LISTENER", "ADDRESS", "SCHEME"
    );
    println!(
        "{:<20} {:<22} {:<7} {protocols}",
        "public", server.listen, scheme
    );
    println!(
        "{:<20} {:<22} {:<7} HTTP/1.1",
        "admin", server.admin_listen, "http"
    );
    println!();
    println!(
        "{:<20} {:<34} {:<7} {:<9} {:<16} {:<16} {:<12} TLS",
        "UPSTREAM", "URL", "SCHEME", "PROTOCOL", "CONNECTIONS", "TIMEOUT / HOLD", "UNCERTAIN"
    );
    for u in &config.upstreams {
        let https = u.url.to_ascii_lowercase().starts_with("https://");
        let protocol = match (u.http2, https) {
            (false, _) => "HTTP/1.1",
            (true, true) => "h2",
            (true, false) => "h2c",
        };
        let tls = if !https {
            "-".to_owned()
        } else {
            let trust = match &u.ca_file {
                Some(ca) => format!("ca_file {ca}"),
                None => "system roots".to_owned(),
            };
            match &u.client_cert {
                Some(cert) => format!("{trust}; client_cert {cert} (mutual TLS)"),
                None => trust,
            }
        };
        let workers = match config.server.worker_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let connections = match (u.http2, u.max_connections) {
            (true, _) => "shared".to_owned(),
            (false, 0) => "no cap".to_owned(),
            (false, n) => format!("{} per worker", (n / workers).max(1)),
        };
        // How long an uncertain outcome keeps its key from being
        // forwarded again (`uncertain_hold`, by default the timeout).
        let timing = format!(
            "{} / {}",
            humantime::format_duration(u.timeout.get()),
            humantime::format_duration(u.uncertain_hold())
        );
        // The answers that leave a record uncertain (rule 11).
        let uncertain = match u.uncertain_statuses.as_slice() {
            [] => "none".to_owned(),
            statuses => statuses
                .iter()
                .map(u16::to_string)
                .collect::<Vec<_>>()
                .join(","),
        };
        println!(
            "{:<20} {:<34} {:<7} {:<9} {:<16} {:<16} {:<12} {tls}",
            u.name,
            u.url,
            if https { "https" } else { "http" },
            protocol,
            connections,
            timing,
            uncertain
        );
    }
    println!();
}

fn print_route_table(config: &Config) {
    println!(
        "{:<20} {:<10} {:<28} {:<12} {:<9} IDEMPOTENCY",
        "ROUTE", "METHODS", "PATH", "UPSTREAM", "KIND"
    );
    for r in &config.routes {
        let methods = if r.methods.is_empty() {
            "*".to_owned()
        } else {
            r.methods.join(",")
        };
        let path = match (&r.path, &r.path_prefix) {
            (Some(p), _) => p.clone(),
            (None, Some(p)) => format!("{p}*"),
            _ => String::new(),
        };
        let policy = match r.kind {
            idemgate_gateway::config::RouteKind::Callback => {
                format!("business_key {}", r.business_key.join("+"))
            }
            idemgate_gateway::config::RouteKind::Sync => r.idempotency().to_string(),
        };
        let policy = match &r.reconcile_path {
            Some(path) => format!("{policy}; reconcile GET {path}"),
            None => policy,
        };
        println!(
            "{:<20} {:<10} {:<28} {:<12} {:<9} {}",
            r.name,
            methods,
            path,
            r.upstream,
            r.kind.to_string(),
            policy
        );
    }
    print_consumer_table(config);
    println!(
        "ok: {} route(s), {} upstream(s), {} consumer(s)",
        config.routes.len(),
        config.upstreams.len(),
        config.consumers.len()
    );
}

fn print_consumer_table(config: &Config) {
    if !config.consumers.is_empty() {
        println!();
        println!(
            "{:<20} {:<9} {:<34} {:<24} {:<12} {:<16} BUSINESS KEY",
            "CONSUMER", "BROKER", "SOURCE", "QUEUE / STREAM", "UPSTREAM", "PATH"
        );
    }
    for c in &config.consumers {
        let (broker, from) = match c.broker() {
            Some(idemgate_gateway::config::Broker::Amqp) => {
                ("rabbitmq", c.queue.clone().unwrap_or_default())
            }
            Some(idemgate_gateway::config::Broker::Nats) => (
                "jetstream",
                format!(
                    "{} / {}",
                    c.stream.as_deref().unwrap_or_default(),
                    c.durable_name()
                ),
            ),
            Some(idemgate_gateway::config::Broker::Redis) => (
                "redis",
                format!(
                    "{} / {}",
                    c.stream.as_deref().unwrap_or_default(),
                    c.group_name()
                ),
            ),
            None => ("?", String::new()),
        };
        println!(
            "{:<20} {:<9} {:<34} {:<24} {:<12} {:<16} {} (prefetch {}, max_deliveries {}, retry_delay {})",
            c.name,
            broker,
            idemgate_gateway::gateway::redact(&c.source),
            from,
            c.upstream,
            c.path,
            c.business_key.join("+"),
            c.prefetch,
            c.max_deliveries,
            humantime::format_duration(c.retry_delay.get()),
        );
    }
}
