//! `switchyard-control`: offline checks of configuration documents with the same compiler the
//! proxy and the control process run.
//!
//! `switchyard-control check conf/` exits 0 when the documents compile and 1 with every error
//! (file, document, field) otherwise: usable as a pre-commit hook or CI step.
//! `switchyard-control explain --request req.json --tenant T conf/` shows which policy rule a
//! request meets, the prompt's classes and the target, with the proxy's own evaluator.
//! `switchyard-control snapshot conf/` prints the compiled snapshot as JSON.
//! `switchyard-control serve --socket /run/switchyard/control.sock conf/` pushes snapshots to
//! proxies started with `--control-socket` and follows edits; `serve --kubernetes` reads the five
//! CRDs and the pools' pods from the API server instead and writes the objects' status.

mod explain;
mod kubernetes;
mod lease;
mod serve;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "switchyard-control",
    version,
    about = "Switchyard control plane tools"
)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Validate YAML documents (files or directories); print every error.
    Check {
        #[arg(required = true, value_name = "PATH")]
        paths: Vec<PathBuf>,
    },
    /// Compile documents and print the resulting snapshot as JSON.
    Snapshot {
        #[arg(required = true, value_name = "PATH")]
        paths: Vec<PathBuf>,
    },
    /// Show how a request would be treated by the policies: rules, prompt classes, target.
    Explain(explain::ExplainArgs),
    /// Push snapshots of the documents to proxies over a Unix socket, following edits.
    Serve(serve::ServeArgs),
}

fn init_tracing(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

fn main() -> anyhow::Result<ExitCode> {
    let args = Args::parse();
    if let Command::Serve(serve) = args.command {
        init_tracing(serve.log_json);
        if serve.kubernetes {
            return serve::run(serve, None);
        }
        if serve.kube.read_secrets {
            eprintln!("--read-secrets only applies with --kubernetes");
            return Ok(ExitCode::from(2));
        }
        return match switchyard_snapshot::load_paths(&serve.paths) {
            Ok(snapshot) => serve::run(serve, Some(snapshot)),
            Err(errors) => {
                eprintln!("{errors}");
                Ok(ExitCode::FAILURE)
            }
        };
    }
    let paths = match &args.command {
        Command::Check { paths } | Command::Snapshot { paths } => paths,
        Command::Explain(explain) => &explain.paths,
        Command::Serve(serve) => &serve.paths,
    };
    let snapshot = match switchyard_snapshot::load_paths(paths) {
        Ok(snapshot) => snapshot,
        Err(errors) => {
            eprintln!("{errors}");
            return Ok(ExitCode::FAILURE);
        }
    };
    match args.command {
        Command::Check { .. } => println!(
            "ok: {} pool(s), {} model(s), {} provider(s), {} tenant(s), {} policy rule(s), fingerprint {}",
            snapshot.pools.len(),
            snapshot.models.len(),
            snapshot.providers.len(),
            snapshot.tenants.len(),
            snapshot.rules.len(),
            snapshot.fingerprint
        ),
        Command::Snapshot { .. } => println!("{}", serde_json::to_string_pretty(&snapshot)?),
        Command::Explain(explain) => return explain::run(&explain, &snapshot),
        Command::Serve(_) => {}
    }
    Ok(ExitCode::SUCCESS)
}
