//! Switchyard's five CustomResourceDefinitions (group `switchyard.dev`, version `v1alpha1`).
//!
//! The spec types live in `switchyard-snapshot` (plain serde + schemars, no Kubernetes), so the
//! proxy and the file loader never link kube; this crate wraps each spec in a kube-derived
//! custom resource for the control process. [`all`] returns the CRDs; the YAML under `crds/` is
//! generated from them (`SWITCHYARD_UPDATE_CRDS=1 cargo test -p switchyard-crds`) and a test
//! fails when it drifts.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use kube::CustomResourceExt;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use switchyard_snapshot::documents::{
    ExternalProviderSpec, InferenceModelSpec, InferencePolicySpec, InferencePoolSpec, TenantSpec,
};

pub const GROUP: &str = "switchyard.dev";
pub const VERSION: &str = "v1alpha1";

/// What the control process reports on every object.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ObjectStatus {
    /// `Accepted` (True, or False with the compiler's reason).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` the conditions describe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Pools: worker endpoints found through the selector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints: Option<u32>,
    /// The snapshot version that includes this object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_version: Option<u64>,
}

/// `InferencePool` spec as a custom resource.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "switchyard.dev",
    version = "v1alpha1",
    kind = "InferencePool",
    plural = "inferencepools",
    shortname = "ipool",
    namespaced,
    status = "ObjectStatus",
    printcolumn = r#"{"name":"Model","type":"string","jsonPath":".spec.model"}"#,
    printcolumn = r#"{"name":"Endpoints","type":"integer","jsonPath":".status.endpoints"}"#,
    printcolumn = r#"{"name":"Accepted","type":"string","jsonPath":".status.conditions[?(@.type==\"Accepted\")].status"}"#
)]
#[serde(transparent)]
pub struct InferencePoolResource(pub InferencePoolSpec);

/// `InferenceModel` spec as a custom resource.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "switchyard.dev",
    version = "v1alpha1",
    kind = "InferenceModel",
    plural = "inferencemodels",
    shortname = "imodel",
    namespaced,
    status = "ObjectStatus",
    printcolumn = r#"{"name":"Model name","type":"string","jsonPath":".spec.modelName"}"#,
    printcolumn = r#"{"name":"Accepted","type":"string","jsonPath":".status.conditions[?(@.type==\"Accepted\")].status"}"#
)]
#[serde(transparent)]
pub struct InferenceModelResource(pub InferenceModelSpec);

/// `InferencePolicy` spec as a custom resource.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "switchyard.dev",
    version = "v1alpha1",
    kind = "InferencePolicy",
    plural = "inferencepolicies",
    shortname = "ipolicy",
    namespaced,
    status = "ObjectStatus",
    printcolumn = r#"{"name":"Priority","type":"integer","jsonPath":".spec.priority"}"#,
    printcolumn = r#"{"name":"Accepted","type":"string","jsonPath":".status.conditions[?(@.type==\"Accepted\")].status"}"#
)]
#[serde(transparent)]
pub struct InferencePolicyResource(pub InferencePolicySpec);

/// `Tenant` spec as a custom resource.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "switchyard.dev",
    version = "v1alpha1",
    kind = "Tenant",
    plural = "tenants",
    namespaced,
    status = "ObjectStatus",
    printcolumn = r#"{"name":"Accepted","type":"string","jsonPath":".status.conditions[?(@.type==\"Accepted\")].status"}"#
)]
#[serde(transparent)]
pub struct TenantResource(pub TenantSpec);

/// `ExternalProvider` spec as a custom resource.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "switchyard.dev",
    version = "v1alpha1",
    kind = "ExternalProvider",
    plural = "externalproviders",
    shortname = "xprovider",
    namespaced,
    status = "ObjectStatus",
    printcolumn = r#"{"name":"Base URL","type":"string","jsonPath":".spec.baseUrl"}"#,
    printcolumn = r#"{"name":"Format","type":"string","jsonPath":".spec.format"}"#,
    printcolumn = r#"{"name":"Accepted","type":"string","jsonPath":".status.conditions[?(@.type==\"Accepted\")].status"}"#
)]
#[serde(transparent)]
pub struct ExternalProviderResource(pub ExternalProviderSpec);

/// Every CRD, in a stable order.
pub fn all() -> Vec<CustomResourceDefinition> {
    vec![
        InferencePool::crd(),
        InferenceModel::crd(),
        InferencePolicy::crd(),
        Tenant::crd(),
        ExternalProvider::crd(),
    ]
}

/// File name of a CRD under `crds/`: `<plural>.<group>.yaml`.
pub fn file_name(crd: &CustomResourceDefinition) -> String {
    format!("{}.yaml", crd.metadata.name.as_deref().unwrap_or("unnamed"))
}

/// The YAML checked in for a CRD (with a header saying it is generated).
pub fn render(crd: &CustomResourceDefinition) -> Result<String, serde_norway::Error> {
    let body = serde_norway::to_string(crd)?;
    Ok(format!(
        "# Generated from crds/src/lib.rs and snapshot/src/documents.rs; do not edit.\n\
         # Regenerate: SWITCHYARD_UPDATE_CRDS=1 cargo test -p switchyard-crds\n{body}"
    ))
}
