//! The official SDKs with tenant keys, through the proxy to providers that speak the other API
//! over TLS (test CA); the providers check what the translation sent them.

use std::process::Command;

use switchyard_e2e::tls::TlsFront;
use switchyard_e2e::{Proxy, Upstream, UpstreamOptions, key_sha256, python, workspace_root};

#[tokio::test]
async fn sdks_with_tenant_keys_reach_tls_providers_in_the_other_format() {
    let claude = Upstream::start_with(
        "claude-tls",
        UpstreamOptions {
            anthropic_native: true,
            ..Default::default()
        },
    )
    .await;
    let gpt = Upstream::start("gpt-tls").await;
    let claude_front = TlsFront::start(claude.addr).await;
    let gpt_front = TlsFront::start(gpt.addr).await;
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("provider-key");
    std::fs::write(&key, "sk-provider").unwrap();
    let yaml = format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: ExternalProvider\nmetadata: {{name: anthropic}}\nspec: {{baseUrl: \"https://127.0.0.1:{}/v1\", format: anthropic, caFile: \"{}\", credentials: {{file: \"{}\"}}, models: [claude-sonnet]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: ExternalProvider\nmetadata: {{name: openai}}\nspec: {{baseUrl: \"https://127.0.0.1:{}/v1\", format: openai, caFile: \"{}\", credentials: {{file: \"{}\"}}, models: [gpt-4.1]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: claude-cloud}}\nspec: {{targets: [{{provider: anthropic, model: claude-sonnet}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: gpt-cloud}}\nspec: {{targets: [{{provider: openai, model: gpt-4.1}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: Tenant\nmetadata: {{name: team}}\nspec: {{apiKeys: [{{sha256: {}}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: Tenant\nmetadata: {{name: limited}}\nspec: {{apiKeys: [{{sha256: {}}}], rateLimits: {{requestsPerMinute: 1}}}}\n",
        claude_front.addr.port(),
        claude_front.ca_file.display(),
        key.display(),
        gpt_front.addr.port(),
        gpt_front.ca_file.display(),
        key.display(),
        key_sha256("sk-team"),
        key_sha256("sk-limited"),
    );
    let proxy = Proxy::start(&yaml, &[]).await;
    let script = workspace_root().join("tests/python/sdk_tenants.py");
    let output = tokio::task::spawn_blocking({
        let url = proxy.url();
        move || Command::new(python()).arg(script).arg(url).output()
    })
    .await
    .unwrap()
    .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "SDK checks failed\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for check in [
        "openai sdk to anthropic provider",
        "openai sdk stream from anthropic provider",
        "anthropic sdk to openai provider",
        "anthropic sdk stream from openai provider",
        "models of the tenant",
        "unknown keys",
        "rate limits",
    ] {
        assert!(
            stdout.contains(&format!("ok: {check}")),
            "missing {check:?} in:\n{stdout}"
        );
    }
    // What the translation sent the providers.
    let to_claude = claude.received();
    assert_eq!(to_claude.len(), 2);
    for request in &to_claude {
        assert_eq!(request.path, "/v1/messages");
        assert_eq!(request.headers["x-api-key"], "sk-provider");
        assert!(request.headers.get("authorization").is_none());
        let body = request.json();
        assert_eq!(body["model"], "claude-sonnet");
        assert!(body["max_tokens"].as_u64().is_some());
        assert!(
            body.get("stream_options").is_none(),
            "an OpenAI-only field reached Anthropic: {body}"
        );
    }
    assert_eq!(to_claude[0].json()["system"], "terse");
    let to_gpt = gpt.received();
    assert_eq!(
        to_gpt.len(),
        3,
        "two SDK calls and the limited tenant's first"
    );
    for request in &to_gpt {
        assert_eq!(request.path, "/v1/chat/completions");
        assert_eq!(request.headers["authorization"], "Bearer sk-provider");
        assert_eq!(request.json()["model"], "gpt-4.1");
    }
}
