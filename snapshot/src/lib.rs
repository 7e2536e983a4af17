//! Switchyard's configuration model, shared by the control process and the proxy.
//!
//! Use it in three steps: read documents ([`parse_paths`] for files and directories,
//! [`parse_str`] for text), [`compile`] them into a [`Snapshot`] (or get every error at once,
//! each naming file, document and field), then hand the snapshot to whoever routes. The snapshot
//! is plain serde data: it crosses the control→proxy socket as JSON and never links Kubernetes.

pub mod compile;
pub mod documents;
pub mod error;
pub mod parse;
pub mod snapshot;

pub use compile::compile;
pub use error::{ConfigError, ConfigErrors};
pub use parse::{EMBEDDED_SOURCE, parse_paths, parse_str};
pub use snapshot::{Model, ModelTarget, Pool, PoolId, Snapshot};

/// Parse and compile in one go: what `switchyard-control check` and the proxy's file loader run.
pub fn load_paths(paths: &[std::path::PathBuf]) -> Result<Snapshot, ConfigErrors> {
    compile(&parse_paths(paths)?)
}

/// Parse and compile one YAML text.
pub fn load_str(source: &str, text: &str) -> Result<Snapshot, ConfigErrors> {
    compile(&parse_str(source, text)?)
}
