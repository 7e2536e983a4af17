//! The shipped example configuration (`conf/examples`) end to end: tenants authenticate with
//! hashed keys, and each policy of `policies.yaml` routes or rejects through the real proxy,
//! in front of recording upstreams for the two pools and the external provider.

use reqwest::StatusCode;
use serde_json::{Value, json};
use switchyard_e2e::{Proxy, Upstream, workspace_root};

const CHAT_TEAM: &str = "sk-example-chat-team";
const BATCH: &str = "sk-example-batch";
const ANALYTICS: &str = "sk-example-analytics";
const PROVIDER_KEY: &str = "sk-provider-secret";

struct Gateway {
    large: [Upstream; 2],
    small: Upstream,
    provider: Upstream,
    proxy: Proxy,
    _key_dir: tempfile::TempDir,
}

/// `conf/examples` with the example addresses pointed at test upstreams and the provider key
/// read from a file.
async fn gateway() -> Gateway {
    let large = [
        Upstream::start("large-a").await,
        Upstream::start("large-b").await,
    ];
    let small = Upstream::start("small").await;
    let provider = Upstream::start("provider").await;
    let key_dir = tempfile::tempdir().unwrap();
    let key_file = key_dir.path().join("openai-key");
    std::fs::write(&key_file, format!("{PROVIDER_KEY}\n")).unwrap();
    let examples = workspace_root().join("conf/examples");
    let mut files: Vec<_> = std::fs::read_dir(&examples)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    let mut yaml = String::new();
    for file in files {
        yaml.push_str("\n---\n");
        yaml.push_str(&std::fs::read_to_string(file).unwrap());
    }
    let replacements = [
        ("127.0.0.1:8001", large[0].endpoint()),
        ("127.0.0.1:8002", large[1].endpoint()),
        ("127.0.0.1:8011", small.endpoint()),
        (
            "https://api.openai.com/v1",
            format!("http://{}/v1", provider.endpoint()),
        ),
        (
            "env: OPENAI_API_KEY",
            format!("file: {}", key_file.display()),
        ),
        (
            "loadBalancing: cache-aware",
            "loadBalancing: cache-aware\n  scrapeIntervalMs: 20".to_owned(),
        ),
    ];
    for (from, to) in replacements {
        assert!(yaml.contains(from), "the example no longer contains {from}");
        yaml = yaml.replace(from, &to);
    }
    let proxy = Proxy::start(&yaml, &[]).await;
    Gateway {
        large,
        small,
        provider,
        proxy,
        _key_dir: key_dir,
    }
}

impl Gateway {
    async fn chat(
        &self,
        key: Option<&str>,
        body: Value,
        headers: &[(&str, &str)],
    ) -> (StatusCode, Value, reqwest::header::HeaderMap) {
        let mut request = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", self.proxy.admin_url()))
            .header("x-switchyard-explain", "1")
            .json(&body);
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = request.send().await.unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        (status, response.json().await.unwrap(), headers)
    }

    fn served_by(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        for (name, upstream) in [
            ("large", &self.large[0]),
            ("large", &self.large[1]),
            ("small", &self.small),
            ("provider", &self.provider),
        ] {
            for _ in upstream
                .received()
                .iter()
                .filter(|r| r.path.contains("completions"))
            {
                out.push(name);
            }
        }
        out
    }

    /// Make the large pool look busy (or idle) and wait until the proxy has read it.
    async fn large_load(&self, waiting: u64, running: u64) {
        for upstream in &self.large {
            upstream.set_load(waiting, running);
        }
        for upstream in &self.large {
            upstream.wait_scrapes(2).await;
        }
    }
}

fn ask(model: &str, text: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": text}]})
}

const COMPLEX: &str = "Analyze the trade-offs of our caching architecture step by step.";

#[tokio::test]
async fn keys_map_to_tenants_and_models_are_listed_per_tenant() {
    let g = gateway().await;
    let (status, body, _) = g.chat(None, ask("assistant", "hi"), &[]).await;
    assert_eq!(status, 401);
    assert_eq!(body["error"]["type"], "authentication_error");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("missing API key")
    );
    let (status, body, _) = g.chat(Some("sk-wrong"), ask("assistant", "hi"), &[]).await;
    assert_eq!(status, 401);
    assert_eq!(body["error"]["code"], "invalid_api_key");
    // Anthropic format for /v1/messages, key in x-api-key.
    let response = reqwest::Client::new()
        .post(format!("{}/v1/messages", g.proxy.url()))
        .header("x-api-key", "sk-wrong")
        .json(&json!({"model": "assistant", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "authentication_error");

    // batch-jobs may use the assistant models only.
    let (status, body, _) = g.chat(Some(BATCH), ask("gpt-4.1-mini", "hi"), &[]).await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(body["error"]["code"], "model_not_allowed");

    let models = |key: &'static str| {
        let url = format!("{}/v1/models", g.proxy.url());
        async move {
            let body: Value = reqwest::Client::new()
                .get(url)
                .bearer_auth(key)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            body["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["id"].as_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(
        models(CHAT_TEAM).await,
        ["assistant", "assistant-small", "gpt-4.1-mini"]
    );
    assert_eq!(models(ANALYTICS).await, ["assistant", "assistant-small"]);
    assert_eq!(models(BATCH).await, ["assistant", "assistant-small"]);
    let status = reqwest::Client::new()
        .get(format!("{}/v1/models", g.proxy.url()))
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(status, 401);
    // Keys never reach the upstreams and are never logged.
    assert!(!g.proxy.log().contains(CHAT_TEAM) && !g.proxy.log().contains("sk-wrong"));
}

#[tokio::test]
async fn simple_prompts_go_to_the_small_model() {
    let g = gateway().await;
    let (status, body, headers) = g
        .chat(
            Some(CHAT_TEAM),
            ask("assistant", "What is the capital of France?"),
            &[],
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(g.served_by(), ["small"]);
    assert_eq!(g.small.received()[0].json()["model"], "Qwen/Qwen3-4B");
    let trace = headers["x-switchyard-policy"].to_str().unwrap();
    assert!(
        trace.contains("simple-to-small-model: matched: route"),
        "{trace}"
    );
    assert!(trace.contains("classes=simple"), "{trace}");

    let (status, _, _) = g
        .chat(Some(CHAT_TEAM), ask("assistant", COMPLEX), &[])
        .await;
    assert_eq!(status, 200);
    assert_eq!(
        g.served_by(),
        ["large", "small"],
        "a complex prompt stays on the large model"
    );
}

#[tokio::test]
async fn interactive_traffic_overflows_to_the_provider_when_local_ttft_is_high() {
    let g = gateway().await;
    // Idle: local.
    let (status, _, _) = g
        .chat(Some(CHAT_TEAM), ask("assistant", COMPLEX), &[])
        .await;
    assert_eq!(status, 200);
    assert_eq!(g.served_by(), ["large"]);
    // 5000 requests running on each worker: predicted TTFT 2.5 s > 2 s.
    g.large_load(0, 5000).await;
    let (status, body, headers) = g
        .chat(Some(CHAT_TEAM), ask("assistant", COMPLEX), &[])
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(g.served_by(), ["large", "provider"]);
    let sent = &g.provider.received()[0];
    assert_eq!(sent.path, "/v1/chat/completions");
    assert_eq!(sent.json()["model"], "gpt-4.1-mini");
    assert_eq!(
        sent.headers["authorization"],
        format!("Bearer {PROVIDER_KEY}")
    );
    assert!(
        headers["x-switchyard-policy"]
            .to_str()
            .unwrap()
            .contains("overflow-to-provider: matched: route")
    );
    // batch-jobs is not interactive: it queues locally.
    let (status, _, _) = g.chat(Some(BATCH), ask("assistant", COMPLEX), &[]).await;
    assert_eq!(status, 200);
    assert_eq!(g.served_by(), ["large", "large", "provider"]);
    // Load gone: local again.
    g.large_load(0, 0).await;
    let (status, _, _) = g
        .chat(Some(ANALYTICS), ask("assistant", COMPLEX), &[])
        .await;
    assert_eq!(status, 200);
    assert_eq!(g.served_by(), ["large", "large", "large", "provider"]);
    assert!(!g.proxy.log().contains(PROVIDER_KEY));
}

/// A log line less the fields the gateway makes up itself (the time, request ids, socket
/// addresses, durations): their random digits hold no client text, and "4111" turns up in
/// them by chance now and then (a request id, a port such as 34111). A run of the suite failed
/// here once, not again in eight; the assertion now prints the lines it matched.
fn made_up_fields_removed(line: &str) -> String {
    line.split_whitespace()
        .enumerate()
        .filter(|(at, field)| {
            let time = *at == 0 && field.ends_with('Z') && field.contains('T');
            let made_up = [
                "request_id=",
                "trace_id=",
                "span_id=",
                "ttft_ms=",
                "duration_ms=",
                "routed_us=",
            ]
            .iter()
            .any(|name| field.starts_with(name));
            !(time || made_up || field.contains("127.0.0.1:"))
        })
        .map(|(_, field)| field)
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test]
async fn personal_data_never_leaves_local_pools() {
    let g = gateway().await;
    g.large_load(0, 5000).await;
    let pii = format!("{COMPLEX} Send the result to jane.doe@example.com.");
    let (status, body, headers) = g.chat(Some(CHAT_TEAM), ask("assistant", &pii), &[]).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        g.served_by(),
        ["large"],
        "queued locally instead of overflowing"
    );
    let trace = headers["x-switchyard-policy"].to_str().unwrap();
    assert!(
        trace.contains("overflow-to-provider: matched but skipped"),
        "{trace}"
    );
    assert!(trace.contains("pii.email"), "{trace}");
    // A card number with a valid Luhn digit, via Anthropic's format, to a provider-only model: 503.
    let response = reqwest::Client::new()
        .post(format!("{}/v1/messages", g.proxy.url()))
        .header("x-api-key", CHAT_TEAM)
        .json(&json!({"model": "gpt-4.1-mini", "max_tokens": 5, "messages": [{"role": "user", "content": "Pay with 4111 1111 1111 1111"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 503);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["type"], "overloaded_error");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("must stay on local hardware"),
        "{body}"
    );
    // The same model without personal data goes to the provider.
    let (status, _, _) = g
        .chat(
            Some(CHAT_TEAM),
            ask("gpt-4.1-mini", "Pay with my usual card"),
            &[],
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(g.served_by(), ["large", "provider"]);
    // The prompt text is never logged.
    let log = g.proxy.log();
    let leaked: Vec<&str> = log
        .lines()
        .filter(|line| {
            let text = made_up_fields_removed(line);
            text.contains("jane.doe") || text.contains("4111")
        })
        .collect();
    assert!(
        leaked.is_empty(),
        "prompt text in the proxy's log:\n{}",
        leaked.join("\n")
    );
}

#[tokio::test]
async fn batch_requests_only_when_the_pool_is_quiet() {
    let g = gateway().await;
    let batch = [("x-priority", "batch")];
    let (status, _, _) = g.chat(Some(BATCH), ask("assistant", COMPLEX), &batch).await;
    assert_eq!(status, 200);
    g.large_load(3, 0).await; // 6 waiting across the pool: more than 4
    let (status, body, headers) = g.chat(Some(BATCH), ask("assistant", COMPLEX), &batch).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(headers["retry-after"], "30");
    assert_eq!(body["error"]["type"], "rate_limit_error");
    assert_eq!(body["error"]["code"], "rejected_by_policy");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("lightly loaded")
    );
    // Interactive requests are not affected.
    let (status, _, _) = g.chat(Some(BATCH), ask("assistant", COMPLEX), &[]).await;
    assert_eq!(status, 200);
    g.large_load(2, 0).await; // 4 waiting: admitted again
    let (status, _, _) = g.chat(Some(BATCH), ask("assistant", COMPLEX), &batch).await;
    assert_eq!(status, 200);
    assert_eq!(g.served_by().len(), 3);
    let metrics = g.proxy.metrics().await;
    assert!(
        metrics.contains("switchyard_policy_decisions_total{rule=\"default/gateway/batch-only-when-quiet\",outcome=\"reject\"} 1"),
        "{metrics}"
    );
}
