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

#[tokio::test]
async fn official_sdks_raise_a_worker_failing_mid_stream_as_an_api_error() {
    // Workers that send their first events, then nothing: the proxy gives up after a second
    // (`--upstream-read-timeout-s`) and ends the stream with an error event in the client's API.
    let chat = Upstream::start_with(
        "silent-chat",
        UpstreamOptions {
            gated: true,
            ..Default::default()
        },
    )
    .await;
    let messages = Upstream::start_with(
        "silent-messages",
        UpstreamOptions {
            gated: true,
            anthropic_native: true,
            ..Default::default()
        },
    )
    .await;
    let yaml = format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: chat}}\nspec: {{model: m, endpoints: [\"{}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: messages}}\nspec: {{model: m, endpoints: [\"{}\"]}}\n{}{}",
        chat.endpoint(),
        messages.endpoint(),
        model_doc("silent-chat", "chat", None),
        model_doc("silent-messages", "messages", None),
    );
    let proxy = Proxy::start(&yaml, &["--upstream-read-timeout-s", "1"]).await;
    let script = workspace_root().join("tests/python/sdk_stream_failure.py");
    let run = tokio::task::spawn_blocking({
        let url = proxy.url();
        move || Command::new(python()).arg(script).arg(url).output()
    });
    // The first chunk of the chat stream; message_start and the first block of the message.
    for (upstream, events) in [(&chat, 1), (&messages, 2)] {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while upstream.received().is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "no request reached the worker"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        upstream.release(events);
    }
    let output = run.await.unwrap().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "SDK checks failed\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("ok: openai stream failure"), "{stdout}");
    assert!(stdout.contains("ok: anthropic stream failure"), "{stdout}");
}
