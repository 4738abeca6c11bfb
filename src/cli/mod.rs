//! The command lines of the two binaries: `idemgate` (serve, demo,
//! check-config, migrate, keys, sweep) and `demo-upstream`. They live in
//! the library so that the binaries are two lines each and everything the
//! commands use stays private to the crate.

mod check_config;
#[cfg(feature = "otlp")]
mod telemetry;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use idemgate_gateway::config::{Config, DEFAULT_CONFIG_PATH};

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

/// `idemgate [--config FILE] [COMMAND]`: parses the arguments, loads the
/// configuration and runs the command (`serve` by default). Exit code 2 for
/// a configuration that does not load, 1 for a command that fails.
pub fn idemgate() -> ExitCode {
    let cli = Cli::parse();
    let command = cli.command.unwrap_or(Command::Serve);
    let plan = match Config::load(&cli.config) {
        Ok(plan) => plan,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    if let Command::Serve = command {
        return run_to_exit("idemgate", async {
            let exporter = start_logging(&plan.config)?;
            let served = idemgate_gateway::gateway::run(plan, cli.config.clone())
                .await
                .map_err(|e| e.to_string());
            if let Some(exporter) = exporter {
                exporter.shutdown().await;
            }
            served
        });
    }
    init_logging(None);
    let config = plan.config;
    match command {
        Command::Serve => unreachable!("served above"),
        Command::CheckConfig => {
            check_config::print(&config);
            run_to_exit("idemgate", async move {
                check_config::durability(&config).await
            })
        }
        Command::Demo => run_to_exit("idemgate", async {
            crate::demo::run(config).await.map_err(|e| e.to_string())
        }),
        Command::Migrate => run_to_exit("idemgate", async move {
            open_store(&config).await?;
            println!(
                "migrations applied to {}",
                idemgate_gateway::gateway::redact(&config.store.database_url)
            );
            Ok(())
        }),
        Command::Sweep => run_to_exit("idemgate", async move {
            let store = open_store(&config).await?;
            let n = idemgate_store::sweep_once(store.sql(), config.store.archive)
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
        Command::Keys { action } => {
            run_to_exit("idemgate", async move { keys(&config, action).await })
        }
    }
}

async fn open_store(config: &Config) -> Result<idemgate_store::Store, String> {
    let metrics = std::sync::Arc::new(config.metrics());
    idemgate_store::open(&config.store.options(), metrics)
        .await
        .map(|(store, _)| store)
        .map_err(|e| e.to_string())
}

async fn keys(config: &Config, action: KeysAction) -> Result<(), String> {
    let store = open_store(config).await?;
    let identity = config
        .identity
        .identity()
        .map_err(|(key, reason)| format!("{key}: {reason}"))?;
    let scope = |client: &Option<String>| client.as_ref().map(|c| identity.scope_for_operator(c));
    match action {
        KeysAction::Show { route, key, client } => {
            let route = config.record_id_of(&route).to_owned();
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
            let route = config.record_id_of(&route).to_owned();
            // Answered once every gateway's in-process layer has read the
            // purge log (or stopped replaying from memory).
            let purged = store
                .purge_settled(&route, &key, scope(&client).as_deref())
                .await
                .map_err(|e| e.to_string())?;
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

/// Runs `f` on a new multi-threaded runtime; an error is printed after
/// `program:` and exits 1.
fn run_to_exit(
    program: &str,
    f: impl std::future::Future<Output = Result<(), String>>,
) -> ExitCode {
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
    let result = runtime.block_on(f);
    // Work left on the blocking pool (a trace export that outlived its
    // budget) does not hold the exit.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{program}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A layer of the process's subscriber (the log output, the trace export).
type TraceLayer = Box<dyn tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync>;

/// `serve`'s logs, and its trace exporter when `[telemetry]` names a
/// collector (on the running tokio runtime).
#[cfg(feature = "otlp")]
fn start_logging(config: &Config) -> Result<Option<telemetry::Exporter>, String> {
    match telemetry::start(&config.telemetry)? {
        Some((exporter, layer)) => {
            init_logging(Some(layer));
            Ok(Some(exporter))
        }
        None => {
            init_logging(None);
            Ok(None)
        }
    }
}

/// `serve`'s logs; a collector named in `[telemetry]` is refused, by name,
/// by a build without the `otlp` feature.
#[cfg(not(feature = "otlp"))]
fn start_logging(config: &Config) -> Result<Option<NoExporter>, String> {
    if config.telemetry.otlp_endpoint.is_some() {
        return Err(
            "telemetry.otlp_endpoint: this build exports no traces (built without the otlp feature)"
                .into(),
        );
    }
    init_logging(None);
    Ok(None)
}

/// What a build without the `otlp` feature has to flush: nothing.
#[cfg(not(feature = "otlp"))]
enum NoExporter {}

#[cfg(not(feature = "otlp"))]
impl NoExporter {
    async fn shutdown(self) {
        match self {}
    }
}

/// Logs on stderr: human text on a terminal, one JSON object per line
/// otherwise (a collector's input), or as `IDEMGATE_LOG_FORMAT` (`json`,
/// `text`) says. Keys are logged escaped and truncated, clients as their
/// scope hash, never a credential (docs/semantics.md, "Bounds" and rule 4).
/// `traces`, when given, takes the spans meant for export; the log output
/// never shows them.
fn init_logging(traces: Option<TraceLayer>) {
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = tracing_subscriber::EnvFilter::try_from_env("IDEMGATE_LOG")
        // lapin logs every closed channel as an error of its own; the
        // consumer logs the same event once, with the consumer and queue.
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,lapin=off"))
        .add_directive(
            format!("{}=off", idemgate_core::trace::TARGET)
                .parse()
                .expect("a valid directive"),
        );
    use std::io::IsTerminal;
    let terminal = std::io::stderr().is_terminal();
    let json = match std::env::var("IDEMGATE_LOG_FORMAT").as_deref() {
        Ok("json") => true,
        Ok("text") => false,
        Ok(other) => {
            eprintln!("IDEMGATE_LOG_FORMAT={other:?} is neither json nor text; writing text");
            false
        }
        Err(_) => !terminal,
    };
    let logs = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let logs: TraceLayer = if json {
        logs.json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .with_filter(filter)
            .boxed()
    } else {
        // Colours only on a terminal.
        logs.with_ansi(terminal).with_filter(filter).boxed()
    };
    let mut layers = vec![logs];
    layers.extend(traces);
    tracing_subscriber::registry().with(layers).init();
}

/// `demo-upstream [ADDR]`: the demo order/payment/coupon service on its own
/// (default `127.0.0.1:9001`, or `DEMO_UPSTREAM_LISTEN`), until SIGTERM or
/// Ctrl-C.
pub fn demo_upstream() -> ExitCode {
    init_logging(None);
    let addr = std::env::args()
        .nth(1)
        .or_else(|| std::env::var("DEMO_UPSTREAM_LISTEN").ok())
        .unwrap_or_else(|| "127.0.0.1:9001".into());
    run_to_exit("demo-upstream", async move {
        let upstream = idemgate_demo_upstream::start(&addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        println!("demo-upstream listening on http://{}", upstream.addr);
        idemgate_server::termination().await;
        upstream.shutdown().await;
        Ok(())
    })
}
