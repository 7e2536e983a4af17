//! Documents from a Kubernetes API server: the five Switchyard CRDs and the Pods each
//! `InferencePool` selects, in one namespace, through kube-rs reflectors.
//!
//! Every change of any watched object (debounced a little, so one `kubectl apply -f dir/` makes
//! one snapshot) rebuilds the complete document set and compiles it with the same compiler the
//! files go through. A snapshot whose fingerprint did not change is not published. When the
//! documents do not compile, the last good snapshot stays current and the objects' status says
//! why: `Accepted=False` (reason `Invalid`) with the compiler's field and message on the objects
//! at fault, `Accepted=Unknown` (reason `Pending`) on new or edited objects that are fine but are
//! held back with them. Pools also report how many ready worker pods their selector found.
//!
//! Nothing is built before every reflector has listed its objects once, so a control process
//! that starts (or restarts) never pushes a partial configuration. Every replica builds and
//! pushes; only the holder of a Lease writes status (`lease.rs`).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sha2::{Digest as _, Sha256};
use switchyard_crds::{
    ExternalProvider, InferenceModel, InferencePolicy, InferencePool, ObjectStatus, Tenant,
};
use switchyard_snapshot::documents::SecretKeyRef;
use switchyard_snapshot::documents::{
    Document, EndpointSpec, Kind, ObjectMeta as DocumentMeta, Origin, Spec,
};
use switchyard_snapshot::snapshot::{Credentials, SecretValue};
use switchyard_snapshot::{ConfigError, ConfigErrors, Snapshot};
use tokio::sync::{Notify, watch};

/// Field manager name of the status writes.
const FIELD_MANAGER: &str = "switchyard-control";
/// Condition type written on every object.
const ACCEPTED: &str = "Accepted";
/// How long a burst of watch events is collected before one rebuild.
const DEBOUNCE: Duration = Duration::from_millis(25);
/// Source name of documents in error messages.
const SOURCE: &str = "kubernetes";

#[derive(clap::Args, Debug, Clone)]
pub struct KubernetesArgs {
    /// Namespace whose objects and pods are watched (default: the kubeconfig's or the pod's own).
    #[arg(long, env = "SWITCHYARD_NAMESPACE")]
    pub namespace: Option<String>,
    /// Read the namespace's Secrets to resolve `secretRef`s (tenant keys are hashed here and
    /// only their SHA-256 leaves; provider keys go to the proxies over the control socket).
    /// Needs list/watch on secrets; without it a `secretRef` makes its object invalid.
    #[arg(long)]
    pub read_secrets: bool,
    #[command(flatten)]
    pub lease: crate::lease::LeaseArgs,
}

/// One of the five CRD kinds, as the control process reads it.
trait Watched: Reflected + Serialize {
    const KIND: Kind;
    fn document_spec(&self) -> Spec;
    fn object_status(&self) -> Option<&ObjectStatus>;
}

macro_rules! watched {
    ($type:ty, $kind:ident) => {
        impl Watched for $type {
            const KIND: Kind = Kind::$kind;
            fn document_spec(&self) -> Spec {
                Spec::$kind(self.spec.0.clone())
            }
            fn object_status(&self) -> Option<&ObjectStatus> {
                self.status.as_ref()
            }
        }
    };
}
watched!(InferencePool, InferencePool);
watched!(InferenceModel, InferenceModel);
watched!(InferencePolicy, InferencePolicy);
watched!(Tenant, Tenant);
watched!(ExternalProvider, ExternalProvider);

/// Identity of an object: kind and name (everything is in one namespace).
type ObjectKey = (Kind, String);

/// What the last build knew of one object, for its status.
struct Entry {
    document: Document,
    generation: Option<i64>,
    status: Option<ObjectStatus>,
    /// Pools with a selector: ready pods found.
    endpoints: Option<u32>,
}

struct Stores {
    pools: Store<InferencePool>,
    models: Store<InferenceModel>,
    policies: Store<InferencePolicy>,
    tenants: Store<Tenant>,
    providers: Store<ExternalProvider>,
    pods: Store<Pod>,
    secrets: Option<Store<Secret>>,
}

/// Watch the namespace and publish every new snapshot; runs until the process ends.
pub async fn run(
    args: KubernetesArgs,
    publish: watch::Sender<Option<Arc<Snapshot>>>,
) -> anyhow::Result<()> {
    let client = Client::try_default().await?;
    let namespace = args
        .namespace
        .unwrap_or_else(|| client.default_namespace().to_owned());
    tracing::info!(%namespace, "watching Switchyard objects and pods");
    let changed = Arc::new(Notify::new());
    let stores = Stores {
        pools: reflect(&client, &namespace, &changed),
        models: reflect(&client, &namespace, &changed),
        policies: reflect(&client, &namespace, &changed),
        tenants: reflect(&client, &namespace, &changed),
        providers: reflect(&client, &namespace, &changed),
        pods: reflect(&client, &namespace, &changed),
        // Helm keeps its release records in Secrets; they are never credentials.
        secrets: args.read_secrets.then(|| {
            let config = watcher::Config::default().fields("type!=helm.sh/release.v1");
            reflect_with(&client, &namespace, &changed, config)
        }),
    };
    let ready = async {
        stores.pools.wait_until_ready().await?;
        stores.models.wait_until_ready().await?;
        stores.policies.wait_until_ready().await?;
        stores.tenants.wait_until_ready().await?;
        stores.providers.wait_until_ready().await?;
        if let Some(secrets) = &stores.secrets {
            secrets.wait_until_ready().await?;
        }
        stores.pods.wait_until_ready().await
    };
    ready.await?;
    tracing::info!("every watched kind listed; building the first snapshot");

    let status = StatusWriter {
        client: client.clone(),
        namespace: namespace.clone(),
    };
    // Only the Lease holder writes status; gaining the Lease triggers a rebuild that writes it.
    let writer = crate::lease::elect(client.clone(), &namespace, &args.lease, changed.clone());
    let mut served: HashMap<ObjectKey, Option<i64>> = HashMap::new();
    // Status writes wake the builder too; the same errors are logged once.
    let mut logged_errors = String::new();
    loop {
        // Take the pending notification first so nothing that lands during the build is lost.
        let next = changed.notified();
        tokio::pin!(next);
        next.as_mut().enable();
        let entries = stores.entries(&namespace);
        let documents: Vec<Document> = entries.values().map(|e| e.document.clone()).collect();
        let outcome = switchyard_snapshot::compile(&documents)
            .and_then(|snapshot| resolve_secrets(snapshot, stores.secrets.as_ref(), &namespace));
        let version = match &outcome {
            Ok(snapshot) => {
                let previous = publish.borrow().clone();
                let version = match previous {
                    Some(previous) if previous.fingerprint == snapshot.fingerprint => {
                        previous.version
                    }
                    previous => {
                        let version = crate::serve::next_version(previous.map_or(0, |p| p.version));
                        let snapshot = snapshot.clone().with_version(version);
                        tracing::info!(version, fingerprint = %snapshot.fingerprint, "new snapshot");
                        publish.send_replace(Some(Arc::new(snapshot)));
                        version
                    }
                };
                served = entries
                    .iter()
                    .map(|(key, entry)| (key.clone(), entry.generation))
                    .collect();
                logged_errors.clear();
                Some(version)
            }
            Err(errors) => {
                let rendered = errors.to_string();
                if rendered != logged_errors {
                    errors.log_rejected();
                    logged_errors = rendered;
                }
                None
            }
        };
        if *writer.borrow() {
            let served_version = publish.borrow().as_ref().map(|s| s.version);
            status
                .write_all(
                    &entries,
                    outcome.as_ref().err(),
                    &served,
                    version.or(served_version),
                )
                .await;
        }
        next.await;
        tokio::time::sleep(DEBOUNCE).await;
    }
}

/// What a reflector can watch: a namespaced kind known at compile time.
trait Reflected:
    Resource<DynamicType = (), Scope = NamespaceResourceScope>
    + Clone
    + DeserializeOwned
    + Debug
    + Send
    + Sync
    + 'static
{
}

impl<K> Reflected for K where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + Debug
        + Send
        + Sync
        + 'static
{
}

/// Start a reflector for one kind; every event wakes the builder.
fn reflect<K: Reflected>(client: &Client, namespace: &str, changed: &Arc<Notify>) -> Store<K> {
    reflect_with(client, namespace, changed, watcher::Config::default())
}

fn reflect_with<K: Reflected>(
    client: &Client,
    namespace: &str,
    changed: &Arc<Notify>,
    config: watcher::Config,
) -> Store<K> {
    let api: Api<K> = Api::namespaced(client.clone(), namespace);
    let (store, writer) = reflector::store();
    let stream = watcher(api, config).default_backoff().reflect(writer);
    let changed = changed.clone();
    let kind = K::kind(&()).into_owned();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        let mut failing = false;
        while let Some(event) = stream.next().await {
            match event {
                Ok(_) => {
                    if std::mem::take(&mut failing) {
                        tracing::info!(%kind, "watch recovered");
                    }
                    changed.notify_one();
                }
                Err(error) => {
                    // Retried with backoff; say it once per outage (a missing CRD or RBAC rule
                    // keeps failing until fixed).
                    if !std::mem::replace(&mut failing, true) {
                        tracing::warn!(%kind, %error, "watch failed; retrying (are the CRDs installed and the RBAC rules granted?)");
                    }
                }
            }
        }
    });
    store
}

impl Stores {
    /// The complete document set, with selector pools' endpoints filled from ready pods.
    fn entries(&self, namespace: &str) -> BTreeMap<ObjectKey, Entry> {
        let mut entries = BTreeMap::new();
        collect(&self.pools, namespace, &mut entries);
        collect(&self.models, namespace, &mut entries);
        collect(&self.policies, namespace, &mut entries);
        collect(&self.tenants, namespace, &mut entries);
        collect(&self.providers, namespace, &mut entries);
        let pods = self.pods.state();
        for entry in entries.values_mut() {
            let Spec::InferencePool(pool) = &mut entry.document.spec else {
                continue;
            };
            let Some(port) = pool.target_port.filter(|_| !pool.selector.is_empty()) else {
                continue;
            };
            let mut found: Vec<String> = pods
                .iter()
                .filter(|pod| selects(&pool.selector, pod))
                .filter_map(|pod| ready_address(pod, port))
                .collect();
            found.sort();
            found.dedup();
            entry.endpoints = Some(found.len() as u32);
            pool.endpoints
                .extend(found.into_iter().map(EndpointSpec::Address));
        }
        entries
    }
}

fn collect<K: Watched>(store: &Store<K>, namespace: &str, into: &mut BTreeMap<ObjectKey, Entry>) {
    for object in store.state() {
        if object.meta().deletion_timestamp.is_some() {
            continue;
        }
        let name = object.name_any();
        let document = Document {
            origin: Origin {
                source: format!("{SOURCE} {}/{namespace}/{name}", K::KIND.as_str()),
                index: 0,
            },
            metadata: DocumentMeta {
                name: name.clone(),
                namespace: Some(namespace.to_owned()),
                labels: object.labels().clone(),
                annotations: object.annotations().clone(),
            },
            spec: object.document_spec(),
        };
        into.insert(
            (K::KIND, name),
            Entry {
                document,
                generation: object.meta().generation,
                status: object.object_status().cloned(),
                endpoints: None,
            },
        );
    }
}

/// Put what `secretRef`s point at into the snapshot: tenant keys as their SHA-256, provider keys
/// as the key (it travels to the proxies over the 0600 socket). A missing Secret or key is an
/// error of the object that names it.
fn resolve_secrets(
    mut snapshot: Snapshot,
    secrets: Option<&Store<Secret>>,
    namespace: &str,
) -> Result<Snapshot, ConfigErrors> {
    let mut errors = Vec::new();
    let mut changed = false;
    let read = |reference: &SecretKeyRef| -> Result<String, String> {
        let Some(store) = secrets else {
            return Err(format!(
                "Secret {}: this control process does not read Secrets; start it with \
                 --read-secrets and grant list/watch on secrets (chart: control.readSecrets), \
                 or give the value another way",
                reference.name
            ));
        };
        let secret = store
            .get(&ObjectRef::new(&reference.name).within(namespace))
            .ok_or_else(|| format!("Secret {} not found in {namespace}", reference.name))?;
        let bytes = secret
            .data
            .as_ref()
            .and_then(|d| d.get(&reference.key))
            .ok_or_else(|| format!("Secret {} has no key '{}'", reference.name, reference.key))?;
        let text = std::str::from_utf8(&bytes.0)
            .map_err(|_| {
                format!(
                    "Secret {} key '{}' is not UTF-8",
                    reference.name, reference.key
                )
            })?
            .trim();
        if text.is_empty() {
            return Err(format!(
                "Secret {} key '{}' is empty",
                reference.name, reference.key
            ));
        }
        Ok(text.to_owned())
    };
    for tenant in snapshot.tenants.values_mut() {
        for reference in std::mem::take(&mut tenant.key_secrets) {
            changed = true;
            match read(&reference) {
                Ok(key) => {
                    let digest = format!("{:x}", Sha256::digest(key.as_bytes()));
                    if !tenant.key_sha256.contains(&digest) {
                        tenant.key_sha256.push(digest);
                    }
                }
                Err(message) => errors.push(object_error(
                    Kind::Tenant,
                    namespace,
                    &tenant.name,
                    "spec.apiKeys[].secretRef",
                    message,
                )),
            }
        }
    }
    for provider in snapshot.providers.values_mut() {
        if let Some(Credentials::Secret(reference)) = &provider.credentials {
            changed = true;
            match read(reference) {
                Ok(key) => provider.credentials = Some(Credentials::Key(SecretValue::new(key))),
                Err(message) => errors.push(object_error(
                    Kind::ExternalProvider,
                    namespace,
                    provider.id.0.rsplit('/').next().unwrap_or_default(),
                    "spec.credentials.secretRef",
                    message,
                )),
            }
        }
    }
    if !errors.is_empty() {
        return Err(ConfigErrors(errors));
    }
    if changed {
        snapshot.fingerprint = switchyard_snapshot::compile::fingerprint(&snapshot);
    }
    Ok(snapshot)
}

fn object_error(
    kind: Kind,
    namespace: &str,
    name: &str,
    field: &str,
    message: String,
) -> ConfigError {
    ConfigError {
        source_name: format!("{SOURCE} {}/{namespace}/{name}", kind.as_str()),
        document: format!("{} {namespace}/{name}", kind.as_str()),
        field: field.to_owned(),
        message,
    }
}

/// All of the selector's labels on the pod.
fn selects(selector: &BTreeMap<String, String>, pod: &Pod) -> bool {
    let labels = pod.labels();
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// `ip:port` of a pod that is running, ready and not being deleted.
fn ready_address(pod: &Pod, port: u16) -> Option<String> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    if status.phase.as_deref() != Some("Running") {
        return None;
    }
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    let ip: std::net::IpAddr = status.pod_ip.as_deref()?.parse().ok()?;
    ready.then(|| std::net::SocketAddr::new(ip, port).to_string())
}

struct StatusWriter {
    client: Client,
    namespace: String,
}

impl StatusWriter {
    /// Bring every object's status in line with the last build; unchanged ones are not written.
    async fn write_all(
        &self,
        entries: &BTreeMap<ObjectKey, Entry>,
        errors: Option<&ConfigErrors>,
        served: &HashMap<ObjectKey, Option<i64>>,
        served_version: Option<u64>,
    ) {
        let mut by_object: HashMap<String, Vec<String>> = HashMap::new();
        for error in errors.iter().flat_map(|e| e.iter()) {
            let text = if error.field.is_empty() {
                error.message.clone()
            } else {
                format!("{}: {}", error.field, error.message)
            };
            by_object
                .entry(error.document.clone())
                .or_default()
                .push(text);
        }
        let invalid = by_object.len();
        for ((kind, name), entry) in entries {
            let label = format!("{} {}/{}", kind.as_str(), self.namespace, name);
            let in_snapshot = served.get(&(*kind, name.clone())) == Some(&entry.generation);
            let (status, reason, message, version) = match by_object.get(&label) {
                Some(problems) => ("False", "Invalid", bounded(problems.join("; ")), None),
                None if errors.is_none() || in_snapshot => (
                    "True",
                    "Accepted",
                    "in the snapshot the proxies serve".to_owned(),
                    served_version,
                ),
                None => (
                    "Unknown",
                    "Pending",
                    format!(
                        "valid, but not served yet: {invalid} other object(s) are invalid and \
                         the proxies keep the last good snapshot"
                    ),
                    None,
                ),
            };
            let desired = desired_status(entry, status, reason, message, version);
            if entry.status.as_ref() == Some(&desired) {
                continue;
            }
            if let Err(error) = self.write(*kind, name, &desired).await {
                tracing::warn!(kind = kind.as_str(), %name, %error, "cannot write status");
            }
        }
    }

    async fn write(&self, kind: Kind, name: &str, status: &ObjectStatus) -> kube::Result<()> {
        let resource = match kind {
            Kind::InferencePool => ApiResource::erase::<InferencePool>(&()),
            Kind::InferenceModel => ApiResource::erase::<InferenceModel>(&()),
            Kind::InferencePolicy => ApiResource::erase::<InferencePolicy>(&()),
            Kind::Tenant => ApiResource::erase::<Tenant>(&()),
            Kind::ExternalProvider => ApiResource::erase::<ExternalProvider>(&()),
        };
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &self.namespace, &resource);
        let patch = Patch::Merge(serde_json::json!({ "status": status }));
        api.patch_status(name, &PatchParams::apply(FIELD_MANAGER), &patch)
            .await
            .map(drop)
    }
}

/// Condition messages are bounded (the API allows 32 KiB); a long list of errors is cut at a
/// character boundary with a note.
fn bounded(mut message: String) -> String {
    const LIMIT: usize = 4096;
    if message.len() > LIMIT {
        let mut cut = LIMIT;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
        message.push_str(" … (more: switchyard-control check, or the control's log)");
    }
    message
}

/// The status an object should carry; the transition time is kept while the condition holds.
fn desired_status(
    entry: &Entry,
    status: &str,
    reason: &str,
    message: String,
    snapshot_version: Option<u64>,
) -> ObjectStatus {
    let previous = entry
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == ACCEPTED));
    let last_transition_time = match previous {
        Some(p) if p.status == status => p.last_transition_time.clone(),
        _ => Time(k8s_openapi::jiff::Timestamp::now()),
    };
    ObjectStatus {
        conditions: vec![Condition {
            type_: ACCEPTED.to_owned(),
            status: status.to_owned(),
            reason: reason.to_owned(),
            message,
            observed_generation: entry.generation,
            last_transition_time,
        }],
        observed_generation: entry.generation,
        endpoints: entry.endpoints,
        snapshot_version,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodCondition, PodStatus};

    fn pod(labels: &[(&str, &str)], phase: &str, ready: bool, ip: Option<&str>) -> Pod {
        let mut pod = Pod::default();
        pod.metadata.labels = Some(
            labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        );
        pod.status = Some(PodStatus {
            phase: Some(phase.to_owned()),
            pod_ip: ip.map(str::to_owned),
            conditions: Some(vec![PodCondition {
                type_: "Ready".to_owned(),
                status: if ready { "True" } else { "False" }.to_owned(),
                ..PodCondition::default()
            }]),
            ..PodStatus::default()
        });
        pod
    }

    #[test]
    fn only_ready_running_pods_with_an_ip_are_endpoints() {
        let selector: BTreeMap<String, String> = [("app".to_owned(), "vllm".to_owned())]
            .into_iter()
            .collect();
        let good = pod(
            &[("app", "vllm"), ("x", "y")],
            "Running",
            true,
            Some("10.0.0.7"),
        );
        assert!(selects(&selector, &good));
        assert_eq!(ready_address(&good, 8000).as_deref(), Some("10.0.0.7:8000"));
        let v6 = pod(&[("app", "vllm")], "Running", true, Some("fd00::7"));
        assert_eq!(ready_address(&v6, 8000).as_deref(), Some("[fd00::7]:8000"));
        assert!(!selects(
            &selector,
            &pod(&[("app", "other")], "Running", true, Some("10.0.0.8"))
        ));
        assert_eq!(
            ready_address(&pod(&[], "Running", false, Some("10.0.0.9")), 1),
            None
        );
        assert_eq!(
            ready_address(&pod(&[], "Pending", true, Some("10.0.0.9")), 1),
            None
        );
        assert_eq!(ready_address(&pod(&[], "Running", true, None), 1), None);
    }

    #[test]
    fn long_messages_are_cut_on_a_character_boundary() {
        let long = "é".repeat(5000);
        let cut = bounded(long);
        assert!(cut.len() < 4200);
        assert!(cut.ends_with("the control's log)"));
        assert_eq!(bounded("short".to_owned()), "short");
    }

    #[test]
    fn transition_time_is_kept_while_the_condition_holds() {
        let parsed = switchyard_snapshot::parse::parse_str(
            "test",
            "apiVersion: switchyard.dev/v1alpha1\nkind: Tenant\nmetadata: {name: t}\nspec: {}\n",
        );
        assert!(parsed.errors.is_empty(), "{:?}", parsed.errors);
        let document = parsed.documents.into_iter().next().expect("one document");
        let entry = |status: Option<ObjectStatus>| Entry {
            document: document.clone(),
            generation: Some(3),
            status,
            endpoints: None,
        };
        let first = desired_status(&entry(None), "True", "Accepted", "m".into(), Some(7));
        assert_eq!(first.observed_generation, Some(3));
        assert_eq!(first.snapshot_version, Some(7));
        let again = desired_status(
            &entry(Some(first.clone())),
            "True",
            "Accepted",
            "m".into(),
            Some(7),
        );
        assert_eq!(again, first, "an unchanged status is not rewritten");
        let flipped = desired_status(
            &entry(Some(first.clone())),
            "False",
            "Invalid",
            "x".into(),
            None,
        );
        assert_ne!(flipped.conditions, first.conditions);
    }
}
