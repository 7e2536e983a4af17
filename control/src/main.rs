//! `switchyard-control`: offline checks of configuration documents with the same compiler the
//! proxy and the control process run.
//!
//! `switchyard-control check conf/` exits 0 when the documents compile and 1 with every error
//! (file, document, field) otherwise: usable as a pre-commit hook or CI step.
//! `switchyard-control snapshot conf/` prints the compiled snapshot as JSON.

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
}

fn main() -> anyhow::Result<ExitCode> {
    let args = Args::parse();
    let (Command::Check { paths } | Command::Snapshot { paths }) = &args.command;
    match switchyard_snapshot::load_paths(paths) {
        Ok(snapshot) => {
            match args.command {
                Command::Check { .. } => println!(
                    "ok: {} pool(s), {} model(s), fingerprint {}",
                    snapshot.pools.len(),
                    snapshot.models.len(),
                    snapshot.fingerprint
                ),
                Command::Snapshot { .. } => {
                    println!("{}", serde_json::to_string_pretty(&snapshot)?)
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(errors) => {
            eprintln!("{errors}");
            Ok(ExitCode::FAILURE)
        }
    }
}
