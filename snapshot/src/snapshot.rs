//! The compiled configuration: complete, immutable, versioned. Control builds it, proxies serve it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use crate::documents::{
    AnthropicMessages, Engine, LoadBalancing, PoolTask, ProviderFormat, RangeSpec as Range,
    RateLimitsSpec as RateLimits, ResponsesApi, ScoringSpec as Scoring, SecretKeyRef,
    TargetStrategy, TokenizerSpec as Tokenizer,
};

/// Default time to open a connection to one worker.
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 2_000;
/// Default number of workers one request may be tried on when connecting fails.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;
/// vLLM's own default (`CacheConfig.DEFAULT_BLOCK_SIZE`, 64 since the 0.2x releases; 0.34 has it).
pub const DEFAULT_BLOCK_SIZE: u32 = 64;
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
    #[serde(default)]
    pub providers: BTreeMap<ProviderId, Provider>,
    /// Tenant name → tenant. Empty: authentication is off and every request is anonymous.
    #[serde(default)]
    pub tenants: BTreeMap<String, Tenant>,
    /// Every rule of every `InferencePolicy`, in evaluation order.
    #[serde(default)]
    pub rules: Vec<Rule>,
    /// User-defined prompt classes (the built-in ones are always there).
    #[serde(default)]
    pub classes: Vec<ClassDef>,
    #[serde(default)]
    pub complexity: Complexity,
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
    #[serde(default)]
    pub responses_api: ResponsesApi,
    /// What the pool's model does (the endpoints it serves).
    #[serde(default)]
    pub task: PoolTask,
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
    pub strategy: TargetStrategy,
    /// Targets with weight > 0, in the order written.
    pub targets: Vec<ModelTarget>,
}

/// Identifies an external provider: `namespace/name`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ProviderId(pub String);

impl ProviderId {
    pub fn new(namespace: &str, name: &str) -> ProviderId {
        ProviderId(format!("{namespace}/{name}"))
    }
}

impl std::fmt::Display for ProviderId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Where requests for a target go.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Backend {
    /// Workers of a local pool.
    Pool(PoolId),
    /// An API outside the cluster.
    Provider(ProviderId),
}

impl Backend {
    /// Local hardware: the prompt does not leave the pools of this deployment.
    pub fn is_local(&self) -> bool {
        matches!(self, Backend::Pool(_))
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Backend::Pool(id) => write!(f, "pool {id}"),
            Backend::Provider(id) => write!(f, "provider {id}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelTarget {
    pub backend: Backend,
    /// The model name to send upstream.
    pub upstream_model: String,
    pub weight: u32,
}

/// An OpenAI- or Anthropic-compatible API outside the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Provider {
    pub id: ProviderId,
    /// Without a trailing `/`.
    pub base_url: String,
    pub format: ProviderFormat,
    pub credentials: Option<Credentials>,
    /// Empty: any model.
    pub models: Vec<String>,
    /// CA certificates (PEM) trusted for this provider instead of the system's roots.
    pub ca_file: Option<String>,
    pub connect_timeout_ms: u64,
    pub read_timeout_ms: u64,
    /// Client request headers (lowercase) passed on besides the API's own.
    #[serde(default)]
    pub forward_headers: Vec<String>,
    #[serde(default)]
    pub responses_api: ResponsesApi,
}

/// Where a provider's key is read (by the proxy, when it builds its tables; never logged).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Credentials {
    File(String),
    Env(String),
    /// Resolved by the control process; a proxy loading files cannot read it.
    Secret(SecretKeyRef),
    /// The key itself, read from a Secret by the control process (Kubernetes) and sent to its
    /// proxies over the 0600 control socket.
    Key(SecretValue),
}

/// A credential in clear. `Debug` never shows it; it serializes as the plain string because
/// the control socket must carry it.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SecretValue(String);

impl SecretValue {
    pub fn new(value: String) -> SecretValue {
        SecretValue(value)
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for SecretValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretValue(<redacted>)")
    }
}

pub const DEFAULT_PROVIDER_CONNECT_TIMEOUT_MS: u64 = 5_000;
pub const DEFAULT_PROVIDER_READ_TIMEOUT_MS: u64 = 120_000;

/// A caller.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tenant {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// Lowercase hex SHA-256 of each API key.
    pub key_sha256: Vec<String>,
    /// Keys still to be read from Secrets (Kubernetes; the control process hashes them).
    pub key_secrets: Vec<SecretKeyRef>,
    /// Allowed client-facing model patterns; empty: all.
    pub models: Vec<String>,
    pub rate_limits: RateLimits,
    /// Serves requests that carry no key.
    pub default: bool,
    /// The tenant's prompts get a worker prefix cache of their own (vLLM's `cache_salt`).
    pub cache_isolation: bool,
}

impl Tenant {
    /// May this tenant use the client-facing model `name`?
    pub fn allows_model(&self, name: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|p| glob_match(p, name))
    }
}

/// `*` matches any run of characters; everything else matches itself.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let Some(first) = parts.next() else {
        return text.is_empty();
    };
    let Some(mut rest) = text.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = rest.get(at + part.len()..).unwrap_or_default(),
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

/// One policy rule, references resolved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rule {
    /// `namespace/name` of its `InferencePolicy`.
    pub policy: String,
    pub name: String,
    pub matches: RuleMatch,
    pub action: Action,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleMatch {
    pub tenants: Option<TenantMatch>,
    /// Client-facing model patterns; empty: any.
    pub models: Vec<String>,
    pub classes_any: Vec<String>,
    pub classes_none: Vec<String>,
    pub pool_state: Option<PoolStateMatch>,
    pub stream: Option<bool>,
    pub max_tokens: Option<Range>,
    /// Lowercase header name, and the exact value (`None`: present with any value).
    pub headers: Vec<(String, Option<String>)>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantMatch {
    pub names: Vec<String>,
    pub labels: BTreeMap<String, String>,
    pub anonymous: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolStateMatch {
    /// `None`: the first pool target of the requested model.
    pub pool: Option<PoolId>,
    pub queue_depth: Option<Range>,
    pub running: Option<Range>,
    pub kv_usage_percent: Option<Range>,
    pub predicted_ttft_ms: Option<Range>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Action {
    Route(RouteTarget),
    Reject {
        status: u16,
        message: String,
        /// Sent as `Retry-After`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        retry_after_s: Option<u32>,
    },
    RequireLocal,
    FallThrough,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum RouteTarget {
    /// Another client-facing model: its targets (and strategy) are used.
    Model(String),
    Target(ModelTarget),
}

/// A user-defined prompt class.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClassDef {
    pub name: String,
    pub keywords: Vec<String>,
    pub patterns: Vec<String>,
    pub personal_data: bool,
}

/// Thresholds of the simple/complex classifier.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Complexity {
    pub max_simple_chars: u32,
    pub max_simple_turns: u32,
    pub complex_keywords: Vec<String>,
}

/// Words that mark a request as needing a stronger model.
pub const DEFAULT_COMPLEX_KEYWORDS: [&str; 16] = [
    "prove",
    "proof",
    "derive",
    "step by step",
    "analyze",
    "analyse",
    "refactor",
    "debug",
    "optimize",
    "architecture",
    "algorithm",
    "theorem",
    "trade-offs",
    "compare and contrast",
    "in depth",
    "detailed plan",
];

impl Default for Complexity {
    fn default() -> Complexity {
        Complexity {
            max_simple_chars: 2_000,
            max_simple_turns: 4,
            complex_keywords: DEFAULT_COMPLEX_KEYWORDS
                .iter()
                .map(|k| (*k).to_owned())
                .collect(),
        }
    }
}

/// Prompt classes every deployment has. `pii` is set by any personal-data detector (and by
/// user classes marked `personalData`); the dotted ones name the detector.
pub const BUILTIN_CLASSES: [&str; 9] = [
    "pii",
    "pii.email",
    "pii.phone",
    "pii.payment-card",
    "pii.iban",
    "pii.national-id",
    "simple",
    "complex",
    "code",
];
