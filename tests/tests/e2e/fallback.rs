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
