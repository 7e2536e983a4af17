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
#[schemars(schema_with = "endpoint_schema")]
pub enum EndpointSpec {
    Address(String),
    Detailed(DetailedEndpoint),
}

/// A string or an object is not a structural schema (Kubernetes requires one type per node), so
/// the CRD accepts any value here and the compiler checks it, naming the field.
fn endpoint_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "description": "host:port of a worker, or {address, kvEvents, kvReplay}",
        "x-kubernetes-preserve-unknown-fields": true
    })
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
    /// Path of a Hugging Face `tokenizer.json` (a `tokenizer_config.json` beside it gives the
    /// chat template its special tokens: `bos_token`, `eos_token`, ...).
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
    /// The context length at which a prompt token's attention takes as long as the rest of its
    /// prefill (its weights' GEMMs): each prefilled token after `c` tokens of context costs
    /// `prefillMicrosPerToken × (1 + c / attentionContextTokens)`, so a long cold prompt costs
    /// more than its length says. Default 32768 (about 20,000 for a ~27B model with FP8 weights,
    /// 30,000 to 50,000 for Llama-3 8B and 70B in BF16); learned online like the rest. 0 leaves
    /// attention out of the model.
    #[serde(default = "default_attention_context_tokens")]
    pub attention_context_tokens: u32,
    /// Workers predicted within this much of the best are treated as tied and load is spread
    /// (at least: a worker is also tied where the learned model's typical error covers the
    /// terms in which its prediction differs from the best's).
    #[serde(default = "default_tie_micros")]
    pub tie_tolerance_micros: u32,
    /// Learn each worker's speed relative to the pool from its observed first tokens and scale
    /// its predictions by it (a fleet of unequal cards, a throttled card, a node shared with
    /// another job). On by default: a speed counts after nine cold answers, and one within 20%
    /// of the pool's is taken as equal, so equal workers stay equal; `false` predicts every
    /// worker at the pool's speed.
    #[serde(default = "default_true")]
    pub learn_worker_speed: bool,
    /// Learn the pool's coefficients online from its streamed answers (their time to first
    /// token and the cached tokens the worker reports), starting from the configured ones. On
    /// by default; `false` keeps the configured coefficients as they are.
    #[serde(default = "default_true")]
    pub learn_coefficients: bool,
    /// Copy a prefix whose requests bring more of the pool's recent prefill than its holders'
    /// fair share (a system prompt every conversation opens with, held by one worker) to the
    /// worker where the request waits least, its prefill not charged in the choice. On by
    /// default; `false` charges every copy in full, as for a prompt no other request shares.
    #[serde(default = "default_true")]
    pub replicate_shared_prefixes: bool,
}

fn default_true() -> bool {
    true
}

fn default_prefill_micros() -> u32 {
    300
}
fn default_running_micros() -> u32 {
    500
}
fn default_attention_context_tokens() -> u32 {
    32_768
}
fn default_tie_micros() -> u32 {
    5_000
}

impl Default for ScoringSpec {
    fn default() -> ScoringSpec {
        ScoringSpec {
            prefill_micros_per_token: default_prefill_micros(),
            running_request_micros: default_running_micros(),
            attention_context_tokens: default_attention_context_tokens(),
            tie_tolerance_micros: default_tie_micros(),
            learn_worker_speed: true,
            learn_coefficients: true,
            replicate_shared_prefixes: true,
        }
    }
}

/// What the pool's model does, which decides the endpoints its workers serve (vLLM's runner:
/// a generative model, or a pooling model loaded for embeddings or for scores).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum PoolTask {
    /// Chat, completions, messages (and the tokenizer endpoints).
    #[default]
    Generate,
    /// `/v1/embeddings` and `/pooling` (and `/v1/score`, `/v1/rerank` by similarity).
    Embed,
    /// A cross-encoder: `/v1/score`, `/v1/rerank` and `/pooling`.
    Score,
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

/// Whether an upstream serves the OpenAI Responses API (`/v1/responses`) itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ResponsesApi {
    /// Forward `/v1/responses` unchanged (vLLM and OpenAI serve it).
    #[default]
    Native,
    /// Translate `/v1/responses` to `/v1/chat/completions` and the answer back (stateless
    /// requests only: no `previous_response_id`, no background mode, function tools only).
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
    /// Whether the workers serve `/v1/responses` (`native`, vLLM) or it is translated to Chat
    /// Completions (`translate`).
    #[serde(default)]
    pub responses_api: ResponsesApi,
    /// What the pool's model does: `generate` (default), `embed` or `score`.
    #[serde(default)]
    pub task: PoolTask,
    /// Time allowed to open a TCP connection to one worker before trying another.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connect_timeout_ms: Option<u64>,
    /// How many workers one request may be tried on when connecting fails (1 = no retry).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    /// Tokens per KV block (vLLM `--block-size`, default 64 as in vLLM).
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

/// One target of an `InferenceModel`: a pool's model or an external provider's model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "has(self.pool) != has(self.provider)", "message": "a target names exactly one of pool or provider"},
    {"rule": "!has(self.provider) || has(self.model)", "message": "a provider target must name the provider's model"}
]))]
pub struct ModelTargetSpec {
    /// Name of an `InferencePool` in the same namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Name of an `ExternalProvider` in the same namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// Model name to send upstream; defaults to the pool's served model (required for providers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Relative share of requests (default 1); 0 keeps the target listed but unused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
}

/// How an `InferenceModel` chooses among its targets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum TargetStrategy {
    /// Spread requests by `weight`.
    #[default]
    Weighted,
    /// The first usable target in the order written; later ones are the fallback chain.
    Ordered,
}

/// `InferenceModel`: a client-facing model name and where its requests go.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InferenceModelSpec {
    /// The name clients put in `"model"`; defaults to `metadata.name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_name: Option<String>,
    #[serde(default)]
    pub strategy: TargetStrategy,
    #[schemars(length(min = 1))]
    pub targets: Vec<ModelTargetSpec>,
}

/// A reference to one key of a Kubernetes Secret.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SecretKeyRef {
    pub name: String,
    pub key: String,
}

/// One API key of a tenant. Keys are never written in clear: give the SHA-256 of the key, or a
/// Secret the control process reads and hashes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "has(self.sha256) != has(self.secretRef)", "message": "give exactly one of sha256 or secretRef"}
]))]
pub struct ApiKeySpec {
    /// Lowercase hex SHA-256 of the key (`printf %s "$KEY" | sha256sum`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9a-f]{64}$"))]
    pub sha256: Option<String>,
    /// A Secret holding the key in clear (Kubernetes only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretKeyRef>,
}

/// Per-tenant limits; absent fields mean unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RateLimitsSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub requests_per_minute: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub tokens_per_minute: Option<u64>,
    /// Requests of this tenant in flight at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub concurrency: Option<u32>,
}

/// `Tenant`: who is calling. Policies match on its name and `metadata.labels`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TenantSpec {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub api_keys: Vec<ApiKeySpec>,
    /// Client-facing model names the tenant may use (`*` wildcards allowed); empty: every model.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limits: Option<RateLimitsSpec>,
    /// Requests without an API key are served as this tenant (at most one tenant; off by default).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub default: bool,
    /// Keep this tenant's prompts in a prefix cache of their own on the workers: the gateway sets
    /// vLLM's `cache_salt` on every request of the tenant, so no other tenant can hit (or time)
    /// its cached blocks. Routing stays cache-aware within the tenant.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cache_isolation: bool,
}

/// The API an external provider speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ProviderFormat {
    /// OpenAI Chat Completions (`/chat/completions` under the base URL).
    Openai,
    /// Anthropic Messages (`/messages` under the base URL).
    Anthropic,
}

/// Where a provider's credential comes from.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "(has(self.secretRef) ? 1 : 0) + (has(self.file) ? 1 : 0) + (has(self.env) ? 1 : 0) == 1", "message": "give exactly one of secretRef, file or env"}
]))]
pub struct CredentialsSpec {
    /// A Secret key (Kubernetes; the control process resolves it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretKeyRef>,
    /// A file holding the key (a mounted Secret, outside Kubernetes a local file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    /// An environment variable of the proxy holding the key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<String>,
}

/// `ExternalProvider`: an OpenAI- or Anthropic-compatible API outside the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExternalProviderSpec {
    /// e.g. `https://api.openai.com/v1`; the API path is appended.
    #[schemars(regex(pattern = r"^https?://"))]
    pub base_url: String,
    pub format: ProviderFormat,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials: Option<CredentialsSpec>,
    /// Models the provider serves; targets naming another model are errors. Empty: any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
    /// PEM file of the CA certificates to trust for this provider (a private gateway, a test
    /// CA); default: the system's roots. Only with an https:// base URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub connect_timeout_ms: Option<u64>,
    /// Longest wait for the provider's first byte, and between bytes of a stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub read_timeout_ms: Option<u64>,
    /// Client request headers passed on to this provider (e.g. `anthropic-beta`,
    /// `openai-organization`). By default none are: the provider gets the body, the API's
    /// content headers, `anthropic-version`, and what the gateway sets (its key, host, request id).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub forward_headers: Vec<String>,
    /// OpenAI-format providers: whether they serve `/v1/responses` (`native`, OpenAI) or it is
    /// translated to Chat Completions (`translate`, for Chat-only compatible APIs).
    #[serde(default)]
    pub responses_api: ResponsesApi,
}

/// A numeric comparison; every bound given must hold.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RangeSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gt: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gte: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lt: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lte: Option<u64>,
}

/// Which tenants a rule applies to: any of `names`, and (when given) all of `labels`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TenantMatchSpec {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub names: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Match requests that carry no tenant (no Tenant documents, or no key with no default tenant).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub anonymous: bool,
}

/// Prompt classes a rule looks for.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClassMatchSpec {
    /// The prompt has at least one of these classes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub any_of: Vec<String>,
    /// The prompt has none of these classes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub none_of: Vec<String>,
}

/// Live state of a pool, as this proxy sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolStateMatchSpec {
    /// The pool to look at; default: the first pool target of the requested model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Requests waiting across the pool's workers (vLLM `num_requests_waiting`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_depth: Option<RangeSpec>,
    /// Requests running across the pool's workers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running: Option<RangeSpec>,
    /// Mean KV-cache usage of the workers, in percent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_usage_percent: Option<RangeSpec>,
    /// Predicted time to first token on the best worker for this prompt, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_ttft_ms: Option<RangeSpec>,
}

/// What a rule looks at; every field given must hold (an empty match matches everything).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RuleMatchSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenants: Option<TenantMatchSpec>,
    /// Requested (client-facing) model names; `*` wildcards allowed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_classes: Option<ClassMatchSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_state: Option<PoolStateMatchSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// `max_tokens` (or `max_completion_tokens`) of the request; a request without one never matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<RangeSpec>,
    /// Request headers: exact value, or `*` for "present".
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
}

/// Where a `route` action sends the request: another client-facing model, a pool or a provider.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "(has(self.inferenceModel) ? 1 : 0) + (has(self.pool) ? 1 : 0) + (has(self.provider) ? 1 : 0) == 1", "message": "route names exactly one of inferenceModel, pool or provider"}
]))]
pub struct RouteSpec {
    /// A client-facing model name (an `InferenceModel`): its targets are used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference_model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// Upstream model name with `pool` (default: the pool's model) or `provider` (required).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

/// A rejection: HTTP status and a message the client sees.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RejectSpec {
    #[schemars(range(min = 400, max = 599))]
    pub status: u16,
    #[schemars(length(min = 1))]
    pub message: String,
    /// Sent as `Retry-After` (seconds): when a client that honours it (the OpenAI and
    /// Anthropic SDKs do) should try again, for a rule that sheds load (429, 503).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 86400))]
    pub retry_after_seconds: Option<u32>,
}

/// What a matching rule does: exactly one of these.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "(has(self.route) ? 1 : 0) + (has(self.reject) ? 1 : 0) + (has(self.requireLocal) ? 1 : 0) + (has(self.fallThrough) ? 1 : 0) == 1", "message": "an action is exactly one of route, reject, requireLocal or fallThrough"}
]))]
pub struct ActionSpec {
    /// Send the request there and stop evaluating.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<RouteSpec>,
    /// Answer with this error and stop evaluating.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reject: Option<RejectSpec>,
    /// Keep the request on local pools whatever later rules say (evaluation continues; a
    /// request with no local target is answered 503).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub require_local: Option<bool>,
    /// Stop evaluating and use the requested model's own targets (exempts from later rules).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fall_through: Option<bool>,
}

/// One rule of a policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RuleSpec {
    /// Shown by `explain`, in metrics and traces.
    #[schemars(length(min = 1, max = 63))]
    pub name: String,
    #[serde(default, rename = "match")]
    pub matches: RuleMatchSpec,
    pub action: ActionSpec,
}

/// A user-defined prompt class.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "(has(self.keywords) ? size(self.keywords) : 0) + (has(self.patterns) ? size(self.patterns) : 0) > 0", "message": "a class needs keywords or patterns"}
]))]
pub struct ClassSpec {
    #[schemars(length(min = 1, max = 63))]
    pub name: String,
    /// Case-insensitive words or phrases (matched at word boundaries).
    #[serde(default)]
    pub keywords: Vec<String>,
    /// Regular expressions (Rust `regex` syntax).
    #[serde(default)]
    pub patterns: Vec<String>,
    /// A prompt of this class also counts as personal data (`pii`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub personal_data: bool,
}

/// Thresholds of the built-in simple/complex classifier.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ComplexitySpec {
    /// Prompts longer than this many characters are complex (default 2000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_simple_chars: Option<u32>,
    /// Conversations with more user turns than this are complex (default 4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_simple_turns: Option<u32>,
    /// Words or phrases that make a prompt complex (default: a built-in list such as "prove",
    /// "step by step", "refactor"); replaces the built-in list when given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub complex_keywords: Option<Vec<String>>,
}

/// `InferencePolicy`: ordered rules, and the prompt classes they use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InferencePolicySpec {
    /// Policies run in ascending priority (then by namespace/name); default 100.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// At most 256 per policy (the bound keeps the CRD's CEL rules within the API server's
    /// cost budget).
    #[serde(default)]
    #[schemars(length(max = 256))]
    pub rules: Vec<RuleSpec>,
    /// Prompt classes these (and other) policies may name, besides the built-in ones.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub classes: Vec<ClassSpec>,
    /// Tuning of the built-in simple/complex classifier (at most one policy sets it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub complexity: Option<ComplexitySpec>,
}

/// The kinds of document the compiler understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    InferencePool,
    InferenceModel,
    InferencePolicy,
    Tenant,
    ExternalProvider,
}

impl Kind {
    pub const ALL: [Kind; 5] = [
        Kind::InferencePool,
        Kind::InferenceModel,
        Kind::InferencePolicy,
        Kind::Tenant,
        Kind::ExternalProvider,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::InferencePool => "InferencePool",
            Kind::InferenceModel => "InferenceModel",
            Kind::InferencePolicy => "InferencePolicy",
            Kind::Tenant => "Tenant",
            Kind::ExternalProvider => "ExternalProvider",
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
    InferencePolicy(InferencePolicySpec),
    Tenant(TenantSpec),
    ExternalProvider(ExternalProviderSpec),
}

impl Spec {
    pub fn kind(&self) -> Kind {
        match self {
            Spec::InferencePool(_) => Kind::InferencePool,
            Spec::InferenceModel(_) => Kind::InferenceModel,
            Spec::InferencePolicy(_) => Kind::InferencePolicy,
            Spec::Tenant(_) => Kind::Tenant,
            Spec::ExternalProvider(_) => Kind::ExternalProvider,
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
    /// 1-based position of the document in a multi-document file; 0 for a source that is a
    /// single object (a Kubernetes object).
    pub index: usize,
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.index {
            // One object per source (an API object): its name says it all.
            0 => f.write_str(&self.source),
            index => write!(f, "{} (document {index})", self.source),
        }
    }
}
