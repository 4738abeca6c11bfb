//! The `idemgate` command line: parse, load the config, run.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use idemgate::config::{Config, DEFAULT_CONFIG_PATH};

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
            print_route_table(&config);
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
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
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
            r.name, methods, path, r.upstream, r.kind, policy
        );
    }
    println!(
        "ok: {} route(s), {} upstream(s)",
        config.routes.len(),
        config.upstreams.len()
    );
}
