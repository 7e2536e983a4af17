//! The official `openai` and `anthropic` Python SDKs as clients of the real proxy.
//! Needs the venv that `scripts/test.sh` creates (or `SWITCHYARD_PYTHON` pointing at a Python
//! that has both SDKs).

use std::process::Command;

use switchyard_e2e::{Proxy, Upstream, UpstreamOptions, model_doc, python, workspace_root};

#[tokio::test]
async fn official_sdks_work_through_the_proxy_streaming_included() {
    let native = Upstream::start_with(
        "native",
        UpstreamOptions {
            anthropic_native: true,
            ..Default::default()
        },
    )
    .await;
    let openai_only = Upstream::start("openai-only").await;
    let embedder = Upstream::start("embedder").await;
    let yaml = format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: vllm}}\nspec: {{model: served-a, endpoints: [\"{}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: compat}}\nspec: {{model: served-b, anthropicMessages: translate, endpoints: [\"{}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: embed}}\nspec: {{model: served-e, task: embed, endpoints: [\"{}\"]}}\n{}{}{}",
        native.endpoint(),
        openai_only.endpoint(),
        embedder.endpoint(),
        model_doc("chat-model", "vllm", None),
        model_doc("claude-compat", "compat", None),
        model_doc("embedder", "embed", None),
    );
    let proxy = Proxy::start(&yaml, &[]).await;
    let script = workspace_root().join("tests/python/sdk_clients.py");
    let output = tokio::task::spawn_blocking({
        let url = proxy.url();
        move || Command::new(python()).arg(script).arg(url).output()
    })
    .await
    .unwrap()
    .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "SDK checks failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    for check in [
        "openai chat",
        "openai stream",
        "openai models",
        "openai embeddings",
        "openai errors",
        "anthropic models",
        "anthropic count tokens",
        "anthropic native",
        "anthropic stream translated",
        "anthropic errors",
    ] {
        assert!(
            stdout.contains(&format!("ok: {check}")),
            "missing {check:?} in:\n{stdout}"
        );
    }
    assert!(native.received().iter().any(|r| r.path == "/v1/messages"));
    assert!(
        openai_only
            .received()
            .iter()
            .any(|r| r.path == "/v1/chat/completions")
    );
}
