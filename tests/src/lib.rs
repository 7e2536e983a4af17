//! Harness for Switchyard's end-to-end tests: builds and starts the real binaries on 127.0.0.1,
//! runs small in-process test upstreams, and cleans up every child it started.
//!
//! Use: `let upstream = Upstream::start("w1").await; let proxy = Proxy::start(&config_yaml(..), &[]).await;`
//! then talk HTTP to `proxy.url()`.

pub mod kube;
pub mod process;
pub mod tls;
pub mod upstream;

pub use process::{Proxy, Sim, SimWorker, free_port, free_ports, workspace_root};
pub use upstream::{Received, Upstream, UpstreamOptions};

/// A config with one pool (`pool`, serving `served`) over `endpoints`, and aliases → that pool.
pub fn pool_config(
    pool: &str,
    served: &str,
    endpoints: &[String],
    extra_pool_spec: &str,
    aliases: &[&str],
) -> String {
    let mut yaml = format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata:\n  name: {pool}\nspec:\n  model: {served}\n  endpoints: [{}]\n{extra_pool_spec}",
        endpoints.join(", ")
    );
    for alias in aliases {
        yaml.push_str(&model_doc(alias, pool, None));
    }
    yaml
}

/// An InferenceModel document named after `alias` (sanitised) pointing at `pool`.
pub fn model_doc(alias: &str, pool: &str, upstream_model: Option<&str>) -> String {
    let name: String = alias
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let model_line = upstream_model
        .map(|m| format!("\n      model: {m}"))
        .unwrap_or_default();
    format!(
        "\n---\napiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata:\n  name: {name}\nspec:\n  modelName: \"{alias}\"\n  targets:\n    - pool: {pool}{model_line}\n"
    )
}

/// Python with the test clients and vLLM's event code (`scripts/test.sh` makes `.venv`), or
/// `SWITCHYARD_PYTHON`.
pub fn python() -> std::path::PathBuf {
    if let Some(path) = std::env::var_os("SWITCHYARD_PYTHON") {
        return std::path::PathBuf::from(path);
    }
    let venv = workspace_root().join(".venv/bin/python");
    assert!(
        venv.exists(),
        "{} is missing: run scripts/test.sh (it creates the venv with the SDKs and vLLM's event code)",
        venv.display()
    );
    venv
}

/// Run `tests/python/<script>` with `args`; panics with its output unless it exits 0.
pub fn run_python(script: &str, args: &[&str]) -> String {
    let output = std::process::Command::new(python())
        .arg(workspace_root().join("tests/python").join(script))
        .args(args)
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{script} failed\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// One recording test upstream named `worker` serving `served`, and a proxy in front of it whose
/// pool `p` answers to `aliases`, started with extra `args`.
pub async fn one_worker_proxy(
    worker: &str,
    served: &str,
    aliases: &[&str],
    args: &[&str],
) -> (Upstream, Proxy) {
    let upstream = Upstream::start(worker).await;
    let proxy = Proxy::start(
        &pool_config("p", served, &[upstream.endpoint()], "", aliases),
        args,
    )
    .await;
    (upstream, proxy)
}

/// What a `Tenant` stores for an API key: its SHA-256 in lowercase hex.
pub fn key_sha256(key: &str) -> String {
    use sha2::Digest;
    format!("{:x}", sha2::Sha256::digest(key.as_bytes()))
}

/// Which test upstream answered a chat request for `model` (the first word of its reply: `name
/// saw ...` whole, or `name-0 name-1 ...` when the gateway assembled it from the worker's stream),
/// or the failure with its status and body.
pub async fn served_by(
    http: &reqwest::Client,
    proxy_url: &str,
    model: &str,
    key: Option<&str>,
) -> Result<String, String> {
    let mut request = http.post(format!("{proxy_url}/v1/chat/completions")).json(
        &serde_json::json!({"model": model, "messages": [{"role": "user", "content": "hi"}]}),
    );
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await.map_err(|e| e.to_string())?;
    let status = response.status();
    let body: serde_json::Value = response.json().await.map_err(|e| e.to_string())?;
    if status != 200 {
        return Err(format!("{status}: {body}"));
    }
    Ok(body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .split(' ')
        .next()
        .map(|word| word.strip_suffix("-0").unwrap_or(word))
        .unwrap_or_default()
        .to_owned())
}

/// conf/default.yaml (the embedded default) with the simulator's real ports in place of
/// 127.0.0.1:8001-8003 and their KV-event sockets.
pub fn default_config_for(sim: &Sim) -> String {
    let mut config =
        std::fs::read_to_string(workspace_root().join("conf/default.yaml")).expect("default.yaml");
    for (index, worker) in sim.workers.iter().enumerate() {
        config = config.replace(&format!("127.0.0.1:800{}", index + 1), &worker.http);
        if let (Some(events), Some(replay)) = (&worker.kv_events, &worker.kv_replay) {
            config = config
                .replace(&format!("tcp://127.0.0.1:555{}", 7 + index), events)
                .replace(&format!("tcp://127.0.0.1:565{}", 7 + index), replay);
        }
    }
    config
}
