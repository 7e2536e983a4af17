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
    /// Uniformly at random: what a Kubernetes Service does.
    Random,
    /// Each worker in turn.
    RoundRobin,
    /// The worker with the fewest requests in flight from this proxy; ties broken at random.
    #[default]
    LeastOutstanding,
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
    /// Static worker addresses, `host:port`, for use outside Kubernetes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<String>,
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
