//! The `idemgate` command line: parse, load the config, run.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use idemgate::config::{Config, DEFAULT_CONFIG_PATH};

/// jemalloc instead of glibc malloc: the proxy path allocates and frees
/// many small buffers per request (header maps, body frames, boxed
/// futures); jemalloc costs the fewest instructions per request within the
/// memory budget (the comparison is in `loadtest/README.md`).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(name = "idemgate", version, about = "HTTP idempotency gateway")]
struct Cli {
    /// Configuration file.
    #[arg(long, global = true, default_value = DEFAULT_CONFIG_PATH)]
    config: PathBuf,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway (the default).
    Serve,
    /// Run the gateway and the demo upstream on the embedded store.
    Demo,
    /// Validate the configuration and print the route table.
    CheckConfig,
    /// Apply the SQL migrations (serve also applies them).
    Migrate,
    /// Inspect or remove idempotency records.
    Keys {
        #[command(subcommand)]
        action: KeysAction,
    },
    /// Delete (or archive) expired records now.
    Sweep,
}

#[derive(Subcommand)]
enum KeysAction {
    /// Print the record(s) of ROUTE and KEY: state, epoch, lease, fingerprint, status, ages.
    Show {
        route: String,
        key: String,
        /// The client's identity header value; default: every client.
        #[arg(long)]
        client: Option<String>,
    },
    /// Remove the record(s) of ROUTE and KEY from SQL and the fast layer.
    Purge {
        route: String,
        key: String,
        /// The client's identity header value; default: every client.
        #[arg(long)]
        client: Option<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    let command = cli.command.unwrap_or(Command::Serve);
    let config = match Config::load(&cli.config) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    match command {
        Command::CheckConfig => {
            print_endpoints(&config);
            print_route_table(&config);
            print_warnings(&config);
            ExitCode::SUCCESS
        }
        Command::Serve => block_on(async {
            idemgate::gateway::run(config)
                .await
                .map_err(|e| e.to_string())
        }),
        Command::Demo => {
            block_on(async { idemgate::demo::run(config).await.map_err(|e| e.to_string()) })
        }
        Command::Migrate => block_on(async move {
            open_store(&config).await?;
            println!(
                "migrations applied to {}",
                idemgate::gateway::redact(&config.store.database_url)
            );
            Ok(())
        }),
        Command::Sweep => block_on(async move {
            let store = open_store(&config).await?;
            let n = idemgate::store::sweep::sweep_once(store.sql(), config.store.archive)
                .await
                .map_err(|e| e.to_string())?;
            let verb = if config.store.archive {
                "archived"
            } else {
                "deleted"
            };
            println!("{verb} {n} expired record(s)");
            Ok(())
        }),
        Command::Keys { action } => block_on(async move { keys(&config, action).await }),
    }
}

async fn open_store(config: &Config) -> Result<idemgate::store::Store, String> {
    let metrics = std::sync::Arc::new(config.metrics());
    idemgate::store::open(&config.store.options(), metrics)
        .await
        .map(|(store, _)| store)
        .map_err(|e| e.to_string())
}

async fn keys(config: &Config, action: KeysAction) -> Result<(), String> {
    let store = open_store(config).await?;
    let scope = |client: &Option<String>| {
        client
            .as_ref()
            .map(|c| idemgate::identity::client_scope(Some(c.as_bytes())))
    };
    match action {
        KeysAction::Show { route, key, client } => {
            let scope = scope(&client);
            let records: Vec<_> = store
                .find_for_operator(&route, &key)
                .await
                .map_err(|e| e.to_string())?
                .into_iter()
                .filter(|r| scope.as_ref().is_none_or(|s| &r.key.scope == s))
                .map(|r| r.describe())
                .collect();
            if records.is_empty() {
                return Err(format!(
                    "no record for route {route:?} key {:?}",
                    key.escape_debug().to_string()
                ));
            }
            for record in records {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&record).unwrap_or_default()
                );
            }
            Ok(())
        }
        KeysAction::Purge { route, key, client } => {
            let purged = store
                .purge_for_operator(&route, &key, scope(&client).as_deref())
                .await
                .map_err(|e| e.to_string())?;
            if purged.removed > 0 {
                // Until every gateway's in-process fast layer has read the
                // purge log, one of them could still replay the key.
                tokio::time::sleep(idemgate::store::purges::settle(config.store.timeout.get()))
                    .await;
            }
            println!("purged {} record(s)", purged.removed);
            if purged.held > 0 {
                // A purge never lets a second request run beside the first.
                return Err(format!(
                    "record-in-flight: {} record(s) held under a live lease were kept; purge again once the request has finished",
                    purged.held
                ));
            }
            Ok(())
        }
    }
}

fn block_on(f: impl std::future::Future<Output = Result<(), String>>) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(f) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idemgate: {e}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("IDEMGATE_LOG")
        // lapin logs every closed channel as an error of its own; the
        // consumer logs the same event once, with the consumer and queue.
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,lapin=off"));
    // Colours only on a terminal: log files and collectors get plain text.
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
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
        "{:<20} {:<34} {:<7} {:<9} TLS",
        "UPSTREAM", "URL", "SCHEME", "PROTOCOL"
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
        println!(
            "{:<20} {:<34} {:<7} {:<9} {tls}",
            u.name,
            u.url,
            if https { "https" } else { "http" },
            protocol
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
            idemgate::config::RouteKind::Callback => {
                format!("business_key {}", r.business_key.join("+"))
            }
            idemgate::config::RouteKind::Sync => r.idempotency().to_string(),
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
    if !config.consumers.is_empty() {
        println!();
        println!(
            "{:<20} {:<9} {:<34} {:<24} {:<12} {:<16} BUSINESS KEY",
            "CONSUMER", "BROKER", "SOURCE", "QUEUE / STREAM", "UPSTREAM", "PATH"
        );
    }
    for c in &config.consumers {
        let (broker, from) = match c.broker() {
            Some(idemgate::config::Broker::Amqp) => {
                ("rabbitmq", c.queue.clone().unwrap_or_default())
            }
            Some(idemgate::config::Broker::Nats) => (
                "jetstream",
                format!(
                    "{} / {}",
                    c.stream.as_deref().unwrap_or_default(),
                    c.durable_name()
                ),
            ),
            None => ("?", String::new()),
        };
        println!(
            "{:<20} {:<9} {:<34} {:<24} {:<12} {:<16} {} (prefetch {}, max_deliveries {}, retry_delay {})",
            c.name,
            broker,
            idemgate::gateway::redact(&c.source),
            from,
            c.upstream,
            c.path,
            c.business_key.join("+"),
            c.prefetch,
            c.max_deliveries,
            humantime::format_duration(c.retry_delay.get()),
        );
    }
    println!(
        "ok: {} route(s), {} upstream(s), {} consumer(s)",
        config.routes.len(),
        config.upstreams.len(),
        config.consumers.len()
    );
}
