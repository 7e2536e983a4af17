//! The CRD-shaped documents operators write (YAML files or Kubernetes objects), as plain serde types.
//!
//! These are the wire types of configuration: they mirror what a user types, use Kubernetes'
//! camelCase field names, and reject unknown fields so a typo is an error instead of a silent
//! default. The compiler (`crate::compile`) turns them into the domain [`crate::Snapshot`].

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The API group and version every Switchyard document carries.
pub const API_VERSION: &str = "switchyard.dev/v1alpha1";

/// Namespace used when a document does not name one (files outside Kubernetes).
pub const DEFAULT_NAMESPACE: &str = "default";

/// Kubernetes-style object metadata; only the parts the compiler reads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ObjectMeta {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

impl ObjectMeta {
    /// The namespace, defaulted for documents that come from files.
    pub fn namespace_or_default(&self) -> &str {
        self.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE)
    }
}

/// The serving engine behind a pool. Only vLLM today; the field exists so that documents written
/// now stay valid when other engines arrive.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    #[default]
    Vllm,
}

/// How the proxy picks a worker inside a pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum LoadBalancing {
    /// The worker predicted to return the first token soonest, from its queue and from how much
    /// of the prompt its KV cache already holds (needs KV events for the cache part).
    #[default]
    CacheAware,
    /// Uniformly at random: what a Kubernetes Service does.
    Random,
    /// Each worker in turn.
    RoundRobin,
    /// The worker with the fewest requests in flight from this proxy; ties broken at random.
    LeastOutstanding,
}

/// A static worker: `host:port`, or an object naming its KV-event sockets too (for several
/// workers on one host, whose event ports differ).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum EndpointSpec {
    Address(String),
    Detailed(DetailedEndpoint),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DetailedEndpoint {
    /// `host:port` of the worker's HTTP server.
    pub address: String,
    /// ZMQ endpoint of its KV-event PUB socket, e.g. `tcp://10.0.0.7:5557`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<String>,
    /// ZMQ endpoint of its replay ROUTER socket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_replay: Option<String>,
}

/// Where every worker of the pool publishes KV events (vLLM `--kv-events-config`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KvEventsSpec {
    /// PUB port on each worker's host (vLLM's default is 5557).
    pub port: u16,
    /// Replay ROUTER port on each worker's host, when vLLM runs with a `replay_endpoint`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_port: Option<u16>,
    /// ZMQ topic (vLLM's default is empty: everything).
    #[serde(default)]
    pub topic: String,
}

/// The tokenizer the workers use, so the router hashes the same tokens.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TokenizerSpec {
    /// Path of a Hugging Face `tokenizer.json`.
    pub path: String,
    /// Path of the Jinja chat template.
    pub chat_template: String,
}

/// Coefficients of the predicted-TTFT score, in microseconds (integers keep CRDs float-free).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ScoringSpec {
    /// Prefill time per uncached prompt token (default 300 µs: a ~27B model on one L40S).
    #[serde(default = "default_prefill_micros")]
    pub prefill_micros_per_token: u32,
    /// Added time per request already running on the worker (decode steps slow prefill).
    #[serde(default = "default_running_micros")]
    pub running_request_micros: u32,
    /// Workers predicted within this much of the best are treated as tied and load is spread.
    #[serde(default = "default_tie_micros")]
    pub tie_tolerance_micros: u32,
}

fn default_prefill_micros() -> u32 {
    300
}
fn default_running_micros() -> u32 {
    500
}
fn default_tie_micros() -> u32 {
    5_000
}

impl Default for ScoringSpec {
    fn default() -> ScoringSpec {
        ScoringSpec {
            prefill_micros_per_token: default_prefill_micros(),
            running_request_micros: default_running_micros(),
            tie_tolerance_micros: default_tie_micros(),
        }
    }
}

/// Whether the pool's workers serve the Anthropic Messages API (`/v1/messages`) themselves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum AnthropicMessages {
    /// Forward `/v1/messages` unchanged (vLLM serves it natively).
    #[default]
    Native,
    /// Translate `/v1/messages` to `/v1/chat/completions` and the answer back.
    Translate,
}

/// `InferencePool`: a set of model-server workers that serve one model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InferencePoolSpec {
    #[serde(default)]
    pub engine: Engine,
    /// The model name the workers serve (vLLM `--served-model-name`).
    pub model: String,
    /// Label selector of the worker pods (Kubernetes only; the control process fills endpoints).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub selector: BTreeMap<String, String>,
    /// The workers' HTTP port when they are found through `selector`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_port: Option<u16>,
    /// Static workers, for use outside Kubernetes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<EndpointSpec>,
    #[serde(default)]
    pub load_balancing: LoadBalancing,
    #[serde(default)]
    pub anthropic_messages: AnthropicMessages,
    /// Time allowed to open a TCP connection to one worker before trying another.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connect_timeout_ms: Option<u64>,
    /// How many workers one request may be tried on when connecting fails (1 = no retry).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    /// Tokens per KV block (vLLM `--block-size`, default 16).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// KV-event sockets of every worker (per-endpoint sockets override).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<KvEventsSpec>,
    /// Default: the tokenizer shipped with Switchyard (conf/tokenizer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<TokenizerSpec>,
    /// Path of the workers' Prometheus metrics (default `/metrics`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_path: Option<String>,
    /// How often each worker's metrics are read (default 250 ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scrape_interval_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scoring: Option<ScoringSpec>,
}

/// One target of an `InferenceModel`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ModelTargetSpec {
    /// Name of an `InferencePool` in the same namespace.
    pub pool: String,
    /// Model name to send upstream; defaults to the pool's served model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Relative share of requests (default 1); 0 keeps the target listed but unused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
}

/// `InferenceModel`: a client-facing model name and where its requests go.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InferenceModelSpec {
    /// The name clients put in `"model"`; defaults to `metadata.name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_name: Option<String>,
    pub targets: Vec<ModelTargetSpec>,
}

/// The kinds of document the compiler understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    InferencePool,
    InferenceModel,
}

impl Kind {
    pub const ALL: [Kind; 2] = [Kind::InferencePool, Kind::InferenceModel];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::InferencePool => "InferencePool",
            Kind::InferenceModel => "InferenceModel",
        }
    }

    pub fn parse(kind: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == kind)
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A parsed document of a known kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Spec {
    InferencePool(InferencePoolSpec),
    InferenceModel(InferenceModelSpec),
}

impl Spec {
    pub fn kind(&self) -> Kind {
        match self {
            Spec::InferencePool(_) => Kind::InferencePool,
            Spec::InferenceModel(_) => Kind::InferenceModel,
        }
    }
}

/// A document with its metadata and where it came from, ready for the compiler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Document {
    pub origin: Origin,
    pub metadata: ObjectMeta,
    pub spec: Spec,
}

/// Where a document came from, for error messages.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Origin {
    /// File path or other source name (`<embedded default>`, `kubernetes`).
    pub source: String,
    /// 1-based position of the document in a multi-document file.
    pub index: usize,
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (document {})", self.source, self.index)
    }
}
