//! A real Kubernetes API server for the tests: etcd and kube-apiserver built from their Go
//! modules by `scripts/tools.sh` (cached in `.cache/tools`), started on 127.0.0.1 with a
//! throwaway CA, static bearer tokens and RBAC on. No kubelet, scheduler or controllers run:
//! tests create Pods and set their status themselves, as a kubelet would.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::GroupVersionKind;
use kube::discovery::Scope;

use crate::process::{free_ports, workspace_root};
use crate::tls::TestCerts;

/// Token of the cluster administrator (group `system:masters`).
pub const ADMIN_TOKEN: &str = "switchyard-test-admin";

/// A user the API server knows by a static token; RBAC decides what it may do.
pub struct User<'a> {
    pub token: &'a str,
    pub name: &'a str,
    pub groups: &'a [&'a str],
}

/// A running etcd + kube-apiserver pair, stopped on drop.
pub struct Cluster {
    pub url: String,
    dir: tempfile::TempDir,
    etcd: Child,
    apiserver: Child,
}

fn tool(name: &str) -> PathBuf {
    let path = workspace_root().join(".cache/tools").join(name);
    assert!(
        path.exists(),
        "{} is missing: run scripts/tools.sh (scripts/test.sh does); it builds {name} from its Go modules",
        path.display()
    );
    path
}

fn log_file(dir: &Path, name: &str) -> std::fs::File {
    std::fs::File::create(dir.join(name)).expect("create log file")
}

impl Cluster {
    /// Start etcd and the API server; returns once `/readyz` answers 200.
    pub async fn start(users: &[User<'_>]) -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path();
        let certs = TestCerts::generate();
        std::fs::write(path.join("ca.pem"), &certs.ca_pem).expect("ca");
        std::fs::write(path.join("serving.pem"), certs.leaf.pem()).expect("cert");
        std::fs::write(path.join("serving.key"), certs.leaf_key.serialize_pem()).expect("key");
        let signing = rcgen::KeyPair::generate().expect("service account key");
        std::fs::write(path.join("sa.key"), signing.serialize_pem()).expect("sa key");
        std::fs::write(path.join("sa.pub"), signing.public_key_pem()).expect("sa public key");
        let mut tokens = format!("{ADMIN_TOKEN},admin,admin,\"system:masters\"\n");
        for user in users {
            tokens.push_str(&format!(
                "{},{},{},\"{}\"\n",
                user.token,
                user.name,
                user.name,
                user.groups.join(",")
            ));
        }
        std::fs::write(path.join("tokens.csv"), tokens).expect("tokens");

        // The apiserver's port too: etcd may not have bound its two yet when it is chosen.
        let [client_port, peer_port, port] = free_ports();
        let etcd_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let etcd = Command::new(tool("etcd"))
            .arg("--data-dir")
            .arg(path.join("etcd"))
            .args(["--listen-client-urls", &etcd_url])
            .args(["--advertise-client-urls", &etcd_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("default={peer_url}")])
            .args(["--log-level", "warn", "--unsafe-no-fsync"])
            .stdout(Stdio::null())
            .stderr(log_file(path, "etcd.log"))
            .spawn()
            .expect("start etcd");

        let file = |name: &str| path.join(name).display().to_string();
        let apiserver = Command::new(tool("kube-apiserver"))
            .args(["--etcd-servers", &etcd_url])
            .args([
                "--bind-address",
                "127.0.0.1",
                "--advertise-address",
                "127.0.0.1",
            ])
            .args(["--secure-port", &port.to_string()])
            .args(["--tls-cert-file", &file("serving.pem")])
            .args(["--tls-private-key-file", &file("serving.key")])
            .args(["--cert-dir", &file("certs")])
            .args(["--token-auth-file", &file("tokens.csv")])
            .args(["--authorization-mode", "RBAC"])
            .args(["--service-account-issuer", "https://kubernetes.default.svc"])
            .args(["--service-account-key-file", &file("sa.pub")])
            .args(["--service-account-signing-key-file", &file("sa.key")])
            .args(["--service-cluster-ip-range", "10.96.0.0/16"])
            // No controllers run, so nothing would create service-account tokens; and the
            // default endpoint reconciler refuses a loopback advertise address.
            .args(["--disable-admission-plugins", "ServiceAccount"])
            .args(["--endpoint-reconciler-type", "none"])
            .stdout(Stdio::null())
            .stderr(log_file(path, "apiserver.log"))
            .spawn()
            .expect("start kube-apiserver");
        let mut cluster = Cluster {
            url: format!("https://127.0.0.1:{port}"),
            dir,
            etcd,
            apiserver,
        };
        cluster.wait_ready(Duration::from_secs(90)).await;
        cluster
    }

    async fn wait_ready(&mut self, timeout: Duration) {
        let ca = reqwest::Certificate::from_pem(
            &std::fs::read(self.dir.path().join("ca.pem")).expect("ca"),
        )
        .expect("ca pem");
        let http = reqwest::Client::builder()
            .add_root_certificate(ca)
            .build()
            .expect("client");
        let deadline = Instant::now() + timeout;
        loop {
            for (name, exited) in [
                ("etcd", self.etcd.try_wait()),
                ("kube-apiserver", self.apiserver.try_wait()),
            ] {
                if let Ok(Some(status)) = exited {
                    panic!("{name} exited with {status}\n{}", self.logs());
                }
            }
            if let Ok(response) = http
                .get(format!("{}/readyz", self.url))
                .bearer_auth(ADMIN_TOKEN)
                .send()
                .await
                && response.status() == 200
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "API server not ready in {timeout:?}\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The tail of etcd's and the API server's logs, for failure messages.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for name in ["etcd.log", "apiserver.log"] {
            let text = std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!("--- {name}\n"));
            for line in &lines[lines.len().saturating_sub(30)..] {
                out.push_str(line);
                out.push('\n');
            }
        }
        out
    }

    /// A kubeconfig file for `token`, defaulting to `namespace`.
    pub fn kubeconfig(&self, token: &str, namespace: &str) -> PathBuf {
        let file = self.dir.path().join(format!("kubeconfig-{token}"));
        let ca = self.dir.path().join("ca.pem");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {}\n    certificate-authority: {}\nusers:\n- name: user\n  user:\n    token: {token}\ncontexts:\n- name: test\n  context:\n    cluster: test\n    user: user\n    namespace: {namespace}\ncurrent-context: test\n",
            self.url,
            ca.display()
        );
        std::fs::write(&file, text).expect("write kubeconfig");
        file
    }

    /// A kube client authenticated by `token`.
    pub async fn client(&self, token: &str, namespace: &str) -> kube::Client {
        let kubeconfig =
            Kubeconfig::read_from(self.kubeconfig(token, namespace)).expect("read kubeconfig");
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .expect("kube config");
        kube::Client::try_from(config).expect("kube client")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for child in [&mut self.apiserver, &mut self.etcd] {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `kubectl apply --server-side` of every document in `yaml`; namespaced objects without a
/// namespace land in `namespace`. Returns the first error with the object it concerns.
pub async fn apply(client: &kube::Client, namespace: &str, yaml: &str) -> Result<(), String> {
    apply_with(client, namespace, yaml, false).await
}

/// [`apply`] with `--dry-run=server`: the API server validates (schema, CEL rules) and stores
/// nothing.
pub async fn apply_dry_run(
    client: &kube::Client,
    namespace: &str,
    yaml: &str,
) -> Result<(), String> {
    apply_with(client, namespace, yaml, true).await
}

async fn apply_with(
    client: &kube::Client,
    namespace: &str,
    yaml: &str,
    dry_run: bool,
) -> Result<(), String> {
    let mut params = PatchParams::apply("switchyard-tests").force();
    params.dry_run = dry_run;
    for document in serde_norway::Deserializer::from_str(yaml) {
        let value: serde_json::Value =
            serde::Deserialize::deserialize(document).map_err(|e| format!("bad YAML: {e}"))?;
        if value.is_null() {
            continue;
        }
        let object: DynamicObject =
            serde_json::from_value(value).map_err(|e| format!("not an object: {e}"))?;
        let types = object
            .types
            .clone()
            .ok_or("document without apiVersion/kind")?;
        let gvk = GroupVersionKind::try_from(&types).map_err(|e| e.to_string())?;
        let name = object
            .metadata
            .name
            .clone()
            .ok_or("document without a name")?;
        let (resource, capabilities) = kube::discovery::pinned_kind(client, &gvk)
            .await
            .map_err(|e| format!("{} {name}: {e}", gvk.kind))?;
        let api: Api<DynamicObject> = match capabilities.scope {
            Scope::Namespaced => Api::namespaced_with(
                client.clone(),
                object.metadata.namespace.as_deref().unwrap_or(namespace),
                &resource,
            ),
            Scope::Cluster => Api::all_with(client.clone(), &resource),
        };
        api.patch(&name, &params, &Patch::Apply(&object))
            .await
            .map_err(|e| format!("{} {name}: {e}", gvk.kind))?;
    }
    Ok(())
}
