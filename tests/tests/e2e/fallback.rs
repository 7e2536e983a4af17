//! Fallback chains: an ordered model's next target is tried when a target cannot be reached
//! or answers 5xx before its first byte; the client sees one answer (or one error).

use serde_json::{Value, json};
use switchyard_e2e::{Proxy, Upstream, UpstreamOptions, free_port};

fn config(dead: &str, failing: &Upstream, healthy: &Upstream, provider: &Upstream) -> String {
    format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: dead}}\nspec: {{model: m, loadBalancing: round-robin, maxAttempts: 1, connectTimeoutMs: 500, endpoints: [\"{dead}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: failing}}\nspec: {{model: m, loadBalancing: round-robin, endpoints: [\"{}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: healthy}}\nspec: {{model: m-local, loadBalancing: round-robin, endpoints: [\"{}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: ExternalProvider\nmetadata: {{name: cloud}}\nspec: {{baseUrl: \"http://{}/v1\", format: openai}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: unreachable-first}}\nspec: {{strategy: ordered, targets: [{{pool: dead}}, {{provider: cloud, model: cloud-m}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: failing-first}}\nspec: {{strategy: ordered, targets: [{{pool: failing}}, {{pool: healthy}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: all-failing}}\nspec: {{strategy: ordered, targets: [{{pool: dead}}, {{pool: failing}}]}}\n",
        failing.endpoint(),
        healthy.endpoint(),
        provider.endpoint()
    )
}

async fn ask(proxy: &Proxy, model: &str, stream: bool) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .json(&json!({"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn the_next_target_serves_when_one_is_unreachable_or_fails() {
    let dead = format!("127.0.0.1:{}", free_port());
    let failing = Upstream::start_with(
        "failing",
        UpstreamOptions {
            fail_with: Some(503),
            ..Default::default()
        },
    )
    .await;
    let healthy = Upstream::start("healthy").await;
    let provider = Upstream::start("cloud").await;
    let proxy = Proxy::start(&config(&dead, &failing, &healthy, &provider), &[]).await;

    // Connection refused on the only worker of the first target: the provider answers.
    let response = ask(&proxy, "unreachable-first", false).await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert!(
        body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .starts_with("cloud saw")
    );
    assert_eq!(provider.received()[0].json()["model"], "cloud-m");

    // 503 from the first target before any byte: the second pool answers, streaming included.
    for stream in [false, true] {
        let response = ask(&proxy, "failing-first", stream).await;
        assert_eq!(response.status(), 200);
        let text = response.text().await.unwrap();
        assert!(text.contains("healthy"), "{text}");
    }
    assert_eq!(failing.received().len(), 2);
    let sent: Vec<Value> = healthy.received().iter().map(|r| r.json()).collect();
    assert_eq!(sent.len(), 2);
    assert!(
        sent.iter().all(|b| b["model"] == "m-local"),
        "each target gets its own model name"
    );
    assert_eq!(sent[1]["stream_options"]["include_usage"], true);

    // Every target failing: one error, in the client's format.
    let response = ask(&proxy, "all-failing", false).await;
    assert_eq!(response.status(), 503);
    let body: Value = response.json().await.unwrap();
    assert!(body["error"]["message"].is_string(), "{body}");

    let metrics = proxy.metrics().await;
    for line in [
        "switchyard_target_fallbacks_total{from=\"pool default/dead\",to=\"provider default/cloud\"} 1",
        "switchyard_target_fallbacks_total{from=\"pool default/failing\",to=\"pool default/healthy\"} 2",
        "switchyard_target_fallbacks_total{from=\"pool default/dead\",to=\"pool default/failing\"} 1",
    ] {
        assert!(metrics.contains(line), "missing {line}\n{metrics}");
    }
}

#[tokio::test]
async fn a_provider_refusing_the_gateways_key_is_a_502_and_the_next_target_serves() {
    // A provider whose key the gateway holds is revoked: 401 on every request.
    let refusing = Upstream::start_with(
        "refusing",
        UpstreamOptions {
            fail_with: Some(401),
            ..Default::default()
        },
    )
    .await;
    let healthy = Upstream::start("healthy").await;
    let yaml = format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: healthy}}\nspec: {{model: m-local, loadBalancing: round-robin, endpoints: [\"{}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: ExternalProvider\nmetadata: {{name: cloud}}\nspec: {{baseUrl: \"http://{}/v1\", format: openai}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: refused-first}}\nspec: {{strategy: ordered, targets: [{{provider: cloud, model: cloud-m}}, {{pool: healthy}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: refused-only}}\nspec: {{targets: [{{provider: cloud, model: cloud-m}}]}}\n",
        healthy.endpoint(),
        refusing.endpoint()
    );
    let proxy = Proxy::start(&yaml, &[]).await;

    // The next target answers.
    let response = ask(&proxy, "refused-first", false).await;
    assert_eq!(response.status(), 200);
    assert!(response.text().await.unwrap().contains("healthy"));

    // No other target: a 502 that blames the gateway, not the client's key, and does not
    // repeat what the provider said.
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"model": "refused-only", "messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            "/v1/messages",
            json!({"model": "refused-only", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}),
        ),
    ] {
        let response = reqwest::Client::new()
            .post(format!("{}{path}", proxy.url()))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 502, "{path}");
        let error: Value = response.json().await.unwrap();
        let message = if path == "/v1/messages" {
            assert_eq!(error["type"], "error", "{error}");
            assert_eq!(error["error"]["type"], "api_error", "{error}");
            &error["error"]["message"]
        } else {
            assert_eq!(error["error"]["type"], "server_error", "{error}");
            assert_eq!(error["error"]["code"], "upstream_error", "{error}");
            &error["error"]["message"]
        };
        let message = message.as_str().unwrap();
        assert!(message.contains("gateway's credentials"), "{message}");
        assert!(!message.contains("on purpose"), "{message}");
    }
}
