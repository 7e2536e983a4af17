//! The control process against a real Kubernetes API server (kube-apiserver + etcd built from
//! their Go modules by scripts/tools.sh), with RBAC on and the control running as the Helm
//! chart's service account, so the chart's Role is what it gets.
//!
//! One scenario, in order: the rendered chart applies (CRDs, Namespace-scoped objects, RBAC) and
//! the shipped examples pass server-side validation; the Role denies what it should; pools find
//! their workers through pod selectors; tenant and provider keys come from Secrets; the proxy
//! routes as the objects say; a second replica runs without the two rewriting status; a policy
//! edit under load switches routing without a failed request; an invalid object gets
//! `Accepted=False` with the reason while the proxy keeps the last good snapshot; the control is
//! killed under load, the other replica takes the status Lease over, the proxy never stops
//! serving and follows edits again after the restart; a pod that stops being ready leaves its
//! pool.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use switchyard_crds::{InferenceModel, InferencePolicy, InferencePool, Tenant};
use switchyard_e2e::kube::{ADMIN_TOKEN, Cluster, User, apply, apply_dry_run};
use switchyard_e2e::process::Control;
use switchyard_e2e::{Proxy, Upstream, key_sha256, workspace_root};

use crate::helm::{run_helm, run_helm_with};

const NAMESPACE: &str = "switchyard";
const RELEASE: &str = "gw";
const CONTROL_TOKEN: &str = "switchyard-test-control";
/// The identity a pod of the chart's Deployment has (its ServiceAccount).
const CONTROL_USER: &str = "system:serviceaccount:switchyard:gw";
const KEY: &str = "sk-kube-test-key";
/// Held in Secrets only.
const SECRET_KEY: &str = "sk-from-a-secret";
const PROVIDER_KEY: &str = "provider-token-in-a-secret";

fn helm_template() -> String {
    run_helm(&[
        "template",
        RELEASE,
        "helm/switchyard",
        "--include-crds",
        "--namespace",
        NAMESPACE,
    ])
}

fn split_documents(yaml: &str) -> Vec<String> {
    serde_norway::Deserializer::from_str(yaml)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .filter(|v: &Value| !v.is_null())
        .map(|v: Value| serde_norway::to_string(&v).unwrap())
        .collect()
}

/// Apply the rendered chart as an administrator would: CRDs, wait until they serve, the rest.
async fn install_chart(admin: &kube::Client) {
    let rendered = helm_template();
    let (crds, rest): (Vec<String>, Vec<String>) = split_documents(&rendered)
        .into_iter()
        .partition(|d| d.contains("kind: CustomResourceDefinition"));
    assert_eq!(crds.len(), 5);
    for crd in &crds {
        apply(admin, NAMESPACE, crd).await.unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while Api::<InferencePolicy>::namespaced(admin.clone(), NAMESPACE)
        .list(&Default::default())
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "CRDs never served");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let kinds: Vec<String> = rest
        .iter()
        .map(|d| {
            let v: Value = serde_norway::from_str(d).unwrap();
            v["kind"].as_str().unwrap().to_owned()
        })
        .collect();
    for kind in [
        "ServiceAccount",
        "Secret",
        "Role",
        "RoleBinding",
        "Service",
        "Deployment",
    ] {
        assert!(
            kinds.iter().any(|k| k == kind),
            "chart lacks a {kind}: {kinds:?}"
        );
    }
    for document in &rest {
        apply(admin, NAMESPACE, document).await.unwrap();
    }
}

/// A worker pod as a kubelet would report it: running, ready, with an IP.
async fn create_worker_pod(admin: &kube::Client, name: &str, pool: &str) {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NAMESPACE);
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "vllm", "pool": pool}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    set_pod_ready(admin, name, true).await;
}

async fn set_pod_ready(admin: &kube::Client, name: &str, ready: bool) {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NAMESPACE);
    let status = json!({"status": {
        "phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
        "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]
    }});
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
}

fn pool_yaml(name: &str, port: u16) -> String {
    format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: {name}}}\nspec:\n  model: m\n  selector: {{app: vllm, pool: {name}}}\n  targetPort: {port}\n  scrapeIntervalMs: 50\n"
    )
}

/// Apply the `routing` policy with `action` for model `chat`.
async fn apply_policy(admin: &kube::Client, action: &str) {
    apply(admin, NAMESPACE, &policy_yaml(action)).await.unwrap();
}

fn policy_yaml(action: &str) -> String {
    format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePolicy\nmetadata: {{name: routing}}\nspec:\n  rules:\n    - name: chat-goes-somewhere\n      match: {{models: [chat]}}\n      action: {action}\n"
    )
}

async fn served_by(http: &reqwest::Client, proxy: &str) -> Result<String, String> {
    switchyard_e2e::served_by(http, proxy, "chat", Some(KEY)).await
}

/// One request under load: when it was sent, when its answer came, and which upstream gave it
/// (or the failure).
struct Answer {
    sent: Instant,
    answered: Instant,
    result: Result<String, String>,
}

/// Four clients sending requests back to back until stopped; every answer with its time.
struct Load {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Vec<Answer>>>,
}

impl Load {
    fn start(proxy: String) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..4)
            .map(|_| {
                let (stop, proxy) = (stop.clone(), proxy.clone());
                tokio::spawn(async move {
                    let http = reqwest::Client::new();
                    let mut answers = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        let sent = Instant::now();
                        let result = served_by(&http, &proxy).await;
                        answers.push(Answer {
                            sent,
                            answered: Instant::now(),
                            result,
                        });
                    }
                    answers
                })
            })
            .collect();
        Load { stop, tasks }
    }

    /// Stop, and check that every request was answered by an upstream.
    async fn finish_all_answered(self, when: &str) -> Vec<Answer> {
        let answers = self.finish().await;
        let failures: Vec<&String> = answers
            .iter()
            .filter_map(|a| a.result.as_ref().err())
            .collect();
        assert!(failures.is_empty(), "requests failed {when}: {failures:?}");
        answers
    }

    async fn finish(self) -> Vec<Answer> {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        for task in self.tasks {
            all.extend(task.await.unwrap());
        }
        all.sort_by_key(|a| a.answered);
        all
    }
}

/// The `Accepted` condition and the whole status of an object, once its status says `want`.
async fn wait_accepted<K>(admin: &kube::Client, name: &str, want: &str) -> Value
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
{
    let resource = kube::discovery::ApiResource::erase::<K>(&());
    let api: Api<DynamicObject> = Api::namespaced_with(admin.clone(), NAMESPACE, &resource);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let object = api.get(name).await.unwrap();
        let status = object.data["status"].clone();
        let accepted = status["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == "Accepted");
        if accepted.is_some_and(|c| c["status"] == want) {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "{} {name} never got Accepted={want}; status: {status}",
            resource.kind
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn start_control(
    socket: &std::path::Path,
    kubeconfig: &std::path::Path,
) -> impl std::future::Future<Output = Control> {
    let kubeconfig = kubeconfig.display().to_string();
    let socket = socket.to_path_buf();
    async move {
        Control::start(
            &socket,
            &[
                "--kubernetes",
                "--namespace",
                NAMESPACE,
                "--read-secrets",
                // The chart's Role allows exactly this Lease (RELEASE-control).
                "--lease-name",
                "gw-control",
                "--lease-duration-s",
                "2",
            ],
            &[("KUBECONFIG", kubeconfig.as_str()), ("RUST_LOG", "info")],
        )
        .await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_on_a_real_api_server() {
    let cluster = Cluster::start(&[User {
        token: CONTROL_TOKEN,
        name: CONTROL_USER,
        groups: &[
            "system:serviceaccounts",
            "system:serviceaccounts:switchyard",
        ],
    }])
    .await;
    let admin = cluster.client(ADMIN_TOKEN, NAMESPACE).await;
    apply(
        &admin,
        NAMESPACE,
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: switchyard}\n",
    )
    .await
    .unwrap();

    // The chart: CRDs, ServiceAccount, Role + RoleBinding, Service, Deployment, dashboard.
    install_chart(&admin).await;

    // The shipped Kubernetes examples pass the API server's own validation (schemas, CEL).
    for file in [
        "conf/kubernetes/pools.yaml",
        "conf/kubernetes/providers.yaml",
        "conf/kubernetes/tenants.yaml",
        "conf/examples/models.yaml",
        "conf/examples/policies.yaml",
    ] {
        let yaml = std::fs::read_to_string(workspace_root().join(file)).unwrap();
        apply_dry_run(&admin, NAMESPACE, &yaml)
            .await
            .unwrap_or_else(|e| panic!("{file}: {e}"));
    }

    // The chart's Role is all the control gets: no spec writes, nothing outside its namespace.
    let as_control = cluster.client(CONTROL_TOKEN, NAMESPACE).await;
    let denied = Api::<InferencePolicy>::namespaced(as_control.clone(), NAMESPACE)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "switchyard.dev/v1alpha1", "kind": "InferencePolicy",
                "metadata": {"name": "sneaky"}, "spec": {"rules": []}
            }))
            .unwrap(),
        )
        .await
        .unwrap_err();
    assert!(denied.to_string().contains("forbidden"), "{denied}");
    let denied = Api::<Pod>::namespaced(as_control.clone(), "default")
        .list(&Default::default())
        .await
        .unwrap_err();
    assert!(denied.to_string().contains("forbidden"), "{denied}");

    // Workers, found through pod selectors.
    let large = Upstream::start("large").await;
    let small = Upstream::start("small").await;
    create_worker_pod(&admin, "large-0", "large").await;
    create_worker_pod(&admin, "small-0", "small").await;
    let port = |u: &Upstream| {
        u.endpoint()
            .rsplit(':')
            .next()
            .unwrap()
            .parse::<u16>()
            .unwrap()
    };
    let tenant = format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: Tenant\nmetadata: {{name: team}}\nspec: {{apiKeys: [{{sha256: {}}}]}}\n",
        key_sha256(KEY)
    );
    // Keys in Secrets: a tenant's (hashed by the control) and a provider's (sent to the proxy).
    let cloud = Upstream::start("cloud").await;
    let secrets = format!(
        "apiVersion: v1\nkind: Secret\nmetadata: {{name: team2-key}}\nstringData: {{key: \"{SECRET_KEY}\\n\"}}\n---\n\
         apiVersion: v1\nkind: Secret\nmetadata: {{name: provider-key}}\nstringData: {{token: {PROVIDER_KEY}}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: Tenant\nmetadata: {{name: team2}}\nspec: {{apiKeys: [{{secretRef: {{name: team2-key, key: key}}}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: ExternalProvider\nmetadata: {{name: cloud}}\nspec: {{baseUrl: \"http://{}/v1\", format: openai, credentials: {{secretRef: {{name: provider-key, key: token}}}}}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: cloud-chat}}\nspec: {{targets: [{{provider: cloud, model: gpt-x}}]}}\n",
        cloud.endpoint()
    );
    apply(&admin, NAMESPACE, &secrets).await.unwrap();
    let objects = [
        pool_yaml("large", port(&large)),
        pool_yaml("small", port(&small)),
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {name: chat}\nspec: {targets: [{pool: large}]}\n".to_owned(),
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {name: chat-small}\nspec: {targets: [{pool: small}]}\n".to_owned(),
        tenant,
    ]
    .join("---\n");
    apply(&admin, NAMESPACE, &objects).await.unwrap();
    apply_policy(&admin, "{route: {inferenceModel: chat-small}}").await;

    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("control.sock");
    let kubeconfig = cluster.kubeconfig(CONTROL_TOKEN, NAMESPACE);
    let mut control = start_control(&socket, &kubeconfig).await;
    let proxy = Proxy::start_with_control(&socket, &[]).await;
    control.wait_log_count("proxy applied snapshot", 1).await;

    // Routing follows the objects: the policy sends `chat` to the small pool; the tenant's key
    // works and others do not.
    proxy.wait_served_by("chat", Some(KEY), "small").await;
    let http = reqwest::Client::new();
    let anonymous = http
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .json(&json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);
    let via_secrets = http
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .bearer_auth(SECRET_KEY)
        .json(&json!({"model": "cloud-chat", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(via_secrets.status(), 200, "{:?}", via_secrets.text().await);
    let sent = cloud.received();
    assert_eq!(
        sent[0].headers.get("authorization").unwrap(),
        &format!("Bearer {PROVIDER_KEY}"),
        "the provider gets the key from its Secret"
    );
    assert!(
        !control.log().contains(PROVIDER_KEY) && !control.log().contains(SECRET_KEY),
        "a key reached the control's log"
    );
    // A secretRef to a missing key makes that object invalid, with the reason.
    apply(
        &admin,
        NAMESPACE,
        "apiVersion: switchyard.dev/v1alpha1\nkind: Tenant\nmetadata: {name: team3}\nspec: {apiKeys: [{secretRef: {name: team2-key, key: nope}}]}\n",
    )
    .await
    .unwrap();
    let team3 = wait_accepted::<Tenant>(&admin, "team3", "False").await;
    assert!(
        team3["conditions"][0]["message"]
            .as_str()
            .unwrap()
            .contains("Secret team2-key has no key 'nope'"),
        "{team3}"
    );
    Api::<Tenant>::namespaced(admin.clone(), NAMESPACE)
        .delete("team3", &Default::default())
        .await
        .unwrap();
    wait_accepted::<Tenant>(&admin, "team2", "True").await;

    // Status written back with the chart's RBAC: accepted, endpoints found.
    let pool_status = wait_accepted::<InferencePool>(&admin, "large", "True").await;
    assert_eq!(pool_status["endpoints"], 1, "{pool_status}");
    assert!(pool_status["snapshotVersion"].as_u64().unwrap() > 0);
    wait_accepted::<InferencePolicy>(&admin, "routing", "True").await;
    wait_accepted::<Tenant>(&admin, "team", "True").await;

    // A second replica (its own control and proxy, as the chart's second pod): it routes the
    // same, and the two controls do not fight over status (only the Lease holder writes).
    let socket2 = dir.path().join("control2.sock");
    let control2 = start_control(&socket2, &kubeconfig).await;
    let proxy2 = Proxy::start_with_control(&socket2, &[]).await;
    proxy2.wait_served_by("chat", Some(KEY), "small").await;
    let lease = Api::<Lease>::namespaced(admin.clone(), NAMESPACE)
        .get("gw-control")
        .await
        .unwrap();
    assert!(lease.spec.unwrap().holder_identity.is_some());
    let versions = resource_versions(&admin).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        resource_versions(&admin).await,
        versions,
        "objects kept being rewritten with two controls running"
    );

    // Edit the policy under load, five times back and forth: every request answered, and after
    // the first answer from the new target every request sent later goes there too (a snapshot
    // swap is atomic; answers to requests sent before it may still arrive). The delay from the
    // apply to the first answer from the new target is printed; tests do not assert on time
    // beyond the 20 s wait.
    let load = Load::start(proxy.url());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut edits = Vec::new();
    for (action, target) in [
        ("{fallThrough: true}", "large"),
        ("{route: {inferenceModel: chat-small}}", "small"),
        ("{fallThrough: true}", "large"),
        ("{route: {inferenceModel: chat-small}}", "small"),
        ("{fallThrough: true}", "large"),
    ] {
        let edited = Instant::now();
        apply_policy(&admin, action).await;
        proxy.wait_served_by("chat", Some(KEY), target).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        edits.push((edited, target));
    }
    let answers = load.finish_all_answered("during the edits").await;
    let mut delays = Vec::new();
    for (index, (edited, target)) in edits.iter().enumerate() {
        let next_edit = edits.get(index + 1).map(|(at, _)| *at);
        let before_next = |a: &&Answer| next_edit.is_none_or(|next| a.sent < next);
        let first_new = answers
            .iter()
            .filter(before_next)
            .find(|a| a.sent > *edited && a.result.as_deref() == Ok(*target))
            .unwrap();
        assert!(
            answers
                .iter()
                .filter(before_next)
                .filter(|a| a.sent > first_new.answered)
                .all(|a| a.result.as_deref() == Ok(*target)),
            "old routing came back after edit {index}"
        );
        delays.push(first_new.answered.duration_since(*edited).as_millis());
    }
    let mut sorted = delays.clone();
    sorted.sort_unstable();
    eprintln!(
        "policy edits under load: {} requests, 0 failed; new routing after the apply was sent \
         (ms): {delays:?}, median {}, max {}",
        answers.len(),
        sorted[sorted.len() / 2],
        sorted[sorted.len() - 1]
    );

    // An invalid object (the API server's schema accepts it, the compiler does not): its status
    // says why, and the proxy keeps the snapshot it has.
    let before = proxy.config_version().await;
    apply(
        &admin,
        NAMESPACE,
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {name: broken}\nspec: {targets: [{pool: nowhere}]}\n",
    )
    .await
    .unwrap();
    let broken = wait_accepted::<InferenceModel>(&admin, "broken", "False").await;
    let condition = &broken["conditions"][0];
    assert_eq!(condition["reason"], "Invalid");
    let message = condition["message"].as_str().unwrap();
    assert!(
        message.contains("spec.targets[0].pool") && message.contains("nowhere"),
        "{message}"
    );
    // Objects already served stay accepted; the proxy did not move.
    wait_accepted::<InferencePolicy>(&admin, "routing", "True").await;
    assert_eq!(proxy.config_version().await, before);
    proxy.wait_served_by("chat", Some(KEY), "large").await;
    // An edit held back by the broken object is reported as pending, not accepted.
    apply_policy(&admin, "{route: {inferenceModel: chat-small}}").await;
    let pending = wait_accepted::<InferencePolicy>(&admin, "routing", "Unknown").await;
    assert_eq!(pending["conditions"][0]["reason"], "Pending", "{pending}");
    assert_eq!(proxy.config_version().await, before);
    // What the CRD's own rules catch never reaches the control: the API server refuses it.
    let refused = apply(
        &admin,
        NAMESPACE,
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {name: both}\nspec: {targets: [{pool: large, provider: cloud, model: x}]}\n",
    )
    .await
    .unwrap_err();
    assert!(
        refused.contains("exactly one of pool or provider"),
        "{refused}"
    );
    // Fixing the broken object releases the held-back edit.
    Api::<InferenceModel>::namespaced(admin.clone(), NAMESPACE)
        .delete("broken", &Default::default())
        .await
        .unwrap();
    proxy.wait_served_by("chat", Some(KEY), "small").await;
    wait_accepted::<InferencePolicy>(&admin, "routing", "True").await;

    // The control dies under load: the proxy keeps serving its last snapshot throughout, and
    // follows edits again once a new control is up.
    let load = Load::start(proxy.url());
    tokio::time::sleep(Duration::from_millis(200)).await;
    control.kill();
    apply_policy(&admin, "{fallThrough: true}").await;
    // The other replica follows the edit, takes the Lease over and reports it.
    proxy2.wait_served_by("chat", Some(KEY), "large").await;
    let generation = Api::<InferencePolicy>::namespaced(admin.clone(), NAMESPACE)
        .get("routing")
        .await
        .unwrap()
        .metadata
        .generation;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status = wait_accepted::<InferencePolicy>(&admin, "routing", "True").await;
        if status["observedGeneration"].as_i64() == generation {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no replica reported the edit: {status}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        served_by(&http, &proxy.url()).await.as_deref(),
        Ok("small"),
        "nothing can change routing while the control is down"
    );
    let control = start_control(&socket, &kubeconfig).await;
    proxy.wait_served_by("chat", Some(KEY), "large").await;
    let answers = load.finish_all_answered("while the control was gone").await;
    eprintln!(
        "control killed and restarted under load: {} requests, 0 failed",
        answers.len()
    );
    control.wait_log_count("proxy applied snapshot", 1).await;

    // A worker pod that stops being ready leaves its pool.
    set_pod_ready(&admin, "large-0", false).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status = wait_accepted::<InferencePool>(&admin, "large", "True").await;
        if status["endpoints"] == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "pool kept its unready pod: {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop((control, control2, proxy, proxy2));
    drop(cluster);
}

/// resourceVersion of every Switchyard object in the namespace, to notice rewrites.
async fn resource_versions(admin: &kube::Client) -> Vec<(String, String)> {
    let mut versions = Vec::new();
    for resource in [
        kube::discovery::ApiResource::erase::<InferencePool>(&()),
        kube::discovery::ApiResource::erase::<InferenceModel>(&()),
        kube::discovery::ApiResource::erase::<InferencePolicy>(&()),
        kube::discovery::ApiResource::erase::<Tenant>(&()),
    ] {
        let api: Api<DynamicObject> = Api::namespaced_with(admin.clone(), NAMESPACE, &resource);
        for object in api.list(&Default::default()).await.unwrap() {
            versions.push((
                format!(
                    "{}/{}",
                    resource.kind,
                    object.metadata.name.unwrap_or_default()
                ),
                object.metadata.resource_version.unwrap_or_default(),
            ));
        }
    }
    versions
}

/// `helm` against `cluster` as its administrator, in `namespace`.
fn helm_on(cluster: &Cluster, namespace: &str, args: &[&str]) -> String {
    let kubeconfig = cluster.kubeconfig(ADMIN_TOKEN, namespace);
    let home = tempfile::tempdir().unwrap();
    run_helm_with(args, |command| {
        command
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["--namespace", namespace])
            // No user's Helm settings or cache.
            .env("HELM_CONFIG_HOME", home.path().join("config"))
            .env("HELM_CACHE_HOME", home.path().join("cache"))
            .env("HELM_DATA_HOME", home.path().join("data"));
    })
}

#[tokio::test]
async fn the_chart_keeps_the_replicas_key_across_upgrades() {
    use k8s_openapi::api::core::v1::Secret;
    let cluster = Cluster::start(&[]).await;
    let namespace = "keys";
    let admin = cluster.client(ADMIN_TOKEN, namespace).await;
    apply(
        &admin,
        namespace,
        &format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: {namespace}}}\n"),
    )
    .await
    .unwrap();
    let secrets: Api<Secret> = Api::namespaced(admin, namespace);
    let key = |secret: Secret| secret.data.unwrap()["key"].0.clone();
    // `helm install`, as a user would (the CRDs from the chart's crds/ directory): the chart
    // makes the key with `lookup` finding none.
    helm_on(&cluster, namespace, &["install", "gw", "helm/switchyard"]);
    let made = key(secrets.get("gw-peers-key").await.unwrap());
    assert_eq!(made.len(), 48, "{}", String::from_utf8_lossy(&made));
    // An upgrade that renders the Secret again finds the live one and keeps its key: replicas
    // started before and after it still hear each other.
    helm_on(
        &cluster,
        namespace,
        &["upgrade", "gw", "helm/switchyard", "--set", "replicas=3"],
    );
    assert_eq!(key(secrets.get("gw-peers-key").await.unwrap()), made);
    // A key of the operator's own replaces the chart's.
    helm_on(
        &cluster,
        namespace,
        &[
            "upgrade",
            "gw",
            "helm/switchyard",
            "--set",
            "proxy.peersKeySecret=fleet-key",
        ],
    );
    assert!(secrets.get_opt("gw-peers-key").await.unwrap().is_none());
}
