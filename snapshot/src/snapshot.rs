//! The compiled configuration: complete, immutable, versioned. Control builds it, proxies serve it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use crate::documents::{
    AnthropicMessages, Engine, LoadBalancing, ScoringSpec as Scoring, TokenizerSpec as Tokenizer,
};

/// Default time to open a connection to one worker.
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 2_000;
/// Default number of workers one request may be tried on when connecting fails.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;
/// vLLM's default block size.
pub const DEFAULT_BLOCK_SIZE: u32 = 16;
pub const DEFAULT_METRICS_PATH: &str = "/metrics";
pub const DEFAULT_SCRAPE_INTERVAL_MS: u64 = 250;

/// Identifies a pool: `namespace/name`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PoolId(pub String);

impl PoolId {
    pub fn new(namespace: &str, name: &str) -> PoolId {
        PoolId(format!("{namespace}/{name}"))
    }
}

impl std::fmt::Display for PoolId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Everything a proxy needs to route, as one value that is replaced whole.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Increases with every snapshot a source publishes; 0 until a source assigns one.
    pub version: u64,
    /// sha256 of the compiled content (without the version): equal fingerprints, equal routing.
    pub fingerprint: String,
    pub pools: BTreeMap<PoolId, Pool>,
    /// Client-facing model name → where it goes.
    pub models: BTreeMap<String, Model>,
}

impl Snapshot {
    pub fn with_version(mut self, version: u64) -> Snapshot {
        self.version = version;
        self
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pool {
    pub id: PoolId,
    pub engine: Engine,
    /// The model name the workers serve.
    pub served_model: String,
    /// The workers, sorted by address and deduplicated.
    pub endpoints: Vec<Endpoint>,
    pub load_balancing: LoadBalancing,
    pub anthropic_messages: AnthropicMessages,
    pub connect_timeout_ms: u64,
    pub max_attempts: u32,
    pub block_size: u32,
    /// `None`: the tokenizer shipped with Switchyard.
    pub tokenizer: Option<Tokenizer>,
    pub kv_topic: String,
    pub metrics_path: String,
    pub scrape_interval_ms: u64,
    pub scoring: Scoring,
}

/// One worker of a pool.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Endpoint {
    /// `host:port` of its HTTP server.
    pub address: String,
    /// ZMQ endpoint of its KV-event PUB socket, when it publishes events.
    pub kv_events: Option<String>,
    /// ZMQ endpoint of its replay socket.
    pub kv_replay: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Model {
    /// The name clients use.
    pub name: String,
    /// Where the `InferenceModel` that defines it lives (`namespace/name`).
    pub defined_by: String,
    /// Targets with weight > 0, in the order written.
    pub targets: Vec<ModelTarget>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelTarget {
    pub pool: PoolId,
    /// The model name to send upstream.
    pub upstream_model: String,
    pub weight: u32,
}
