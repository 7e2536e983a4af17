//! Per-tenant accounting and rate limits through the real proxy: token totals equal the usage
//! the upstream reported (streams included, with the usage chunk asked for on the client's
//! behalf and removed again), and limits answer 429 with Retry-After in the client's format.

use futures_util::StreamExt;
use serde_json::{Value, json};
use switchyard_e2e::{Proxy, Upstream, UpstreamOptions};

const KEY_A: &str = "sk-a";
const KEY_B: &str = "sk-b";

fn config(upstream: &Upstream, limits_a: &str, limits_b: &str) -> String {
    format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: p}}\nspec: {{model: served, loadBalancing: round-robin, endpoints: [\"{}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: chat}}\nspec: {{targets: [{{pool: p}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: Tenant\nmetadata: {{name: team-a}}\nspec: {{apiKeys: [{{sha256: a4a6d307ad00fa67176e1099fdbc4f4a09bb527a7f24718a5030f2f173d11f7f}}]{limits_a}}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: Tenant\nmetadata: {{name: team-b}}\nspec: {{apiKeys: [{{sha256: 18519d64d0d18b0e84e43301547425933dc0394576666e8da1ef1790fb64ca9f}}]{limits_b}}}\n",
        upstream.endpoint()
    )
}

async fn post(proxy: &Proxy, key: &str, body: Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .unwrap()
}

fn metric(metrics: &str, name: &str, labels: &str) -> f64 {
    let prefix = format!("{name}{{{labels}}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn token_totals_equal_the_usage_upstreams_reported() {
    let upstream = Upstream::start_with(
        "w",
        UpstreamOptions {
            stream_chunks: Some(4),
            ..Default::default()
        },
    )
    .await;
    let proxy = Proxy::start(&config(&upstream, "", ""), &[]).await;
    let ask = |stream: bool| json!({"model": "chat", "stream": stream, "messages": [{"role": "user", "content": "hi"}]});
    // Two whole answers (assembled from the worker's stream: 7 prompt + 4 completion tokens
    // each) for team-a.
    for _ in 0..2 {
        let response = post(&proxy, KEY_A, ask(false)).await;
        assert_eq!(response.status(), 200);
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["usage"]["completion_tokens"], 4);
    }
    // Three streams (7 + 4 each): the client did not ask for usage and gets none.
    for _ in 0..3 {
        let text = post(&proxy, KEY_A, ask(true)).await.text().await.unwrap();
        assert!(
            !text.contains("usage"),
            "the injected usage chunk reached the client:\n{text}"
        );
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        assert_eq!(text.matches("data: {").count(), 4);
    }
    // team-b asks for usage itself: it gets it, and it is counted once.
    let mut request = ask(true);
    request["stream_options"] = json!({"include_usage": true});
    let text = post(&proxy, KEY_B, request).await.text().await.unwrap();
    assert_eq!(text.matches("\"usage\"").count(), 1, "{text}");
    // Every request went upstream as a stream asking for usage, the whole answers too.
    let streamed: Vec<Value> = upstream
        .received()
        .iter()
        .map(|r| r.json())
        .filter(|b| b["stream"] == true)
        .collect();
    assert_eq!(streamed.len(), 6);
    assert!(
        streamed
            .iter()
            .all(|b| b["stream_options"]["include_usage"] == true)
    );

    // Accounting is written when each request ends; poll briefly for the last one.
    let labels = |tenant: &str| {
        format!("tenant=\"{tenant}\",model=\"chat\",target=\"pool default/p\",outcome=\"success\"")
    };
    let mut metrics = String::new();
    for _ in 0..100 {
        metrics = proxy.metrics().await;
        if metric(
            &metrics,
            "switchyard_tenant_requests_total",
            &labels("team-b"),
        ) == 1.0
        {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(
        metric(
            &metrics,
            "switchyard_tenant_requests_total",
            &labels("team-a")
        ),
        5.0,
        "{metrics}"
    );
    assert_eq!(
        metric(
            &metrics,
            "switchyard_tenant_prompt_tokens_total",
            &labels("team-a")
        ),
        5.0 * 7.0
    );
    assert_eq!(
        metric(
            &metrics,
            "switchyard_tenant_completion_tokens_total",
            &labels("team-a")
        ),
        5.0 * 4.0
    );
    assert_eq!(
        metric(
            &metrics,
            "switchyard_tenant_prompt_tokens_total",
            &labels("team-b")
        ),
        7.0
    );
    assert_eq!(
        metric(
            &metrics,
            "switchyard_tenant_completion_tokens_total",
            &labels("team-b")
        ),
        4.0
    );
    assert_eq!(
        metric(
            &metrics,
            "switchyard_tenant_ttft_seconds_count",
            "tenant=\"team-a\",model=\"chat\""
        ),
        5.0
    );
    assert_eq!(
        metric(
            &metrics,
            "switchyard_tenant_request_duration_seconds_bucket",
            "le=\"+Inf\",tenant=\"team-a\",model=\"chat\""
        ),
        5.0
    );
    // Unknown keys are counted as rejections, without inventing labels.
    let response = post(&proxy, "sk-nobody", ask(false)).await;
    assert_eq!(response.status(), 401);
    let metrics = proxy.metrics().await;
    assert_eq!(
        metric(
            &metrics,
            "switchyard_tenant_rejections_total",
            "tenant=\"anonymous\",model=\"unknown\",reason=\"unauthenticated\""
        ),
        1.0
    );
}

#[tokio::test]
async fn limits_answer_429_with_retry_after_in_the_clients_format() {
    let upstream = Upstream::start_with(
        "w",
        UpstreamOptions {
            stream_chunks: Some(2),
            gated: true,
            ..Default::default()
        },
    )
    .await;
    let proxy = Proxy::start(
        &config(
            &upstream,
            ", rateLimits: {requestsPerMinute: 2}",
            ", rateLimits: {concurrency: 1}",
        ),
        &[],
    )
    .await;
    let ask = json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]});
    for _ in 0..2 {
        assert_eq!(post(&proxy, KEY_A, ask.clone()).await.status(), 200);
    }
    let response = post(&proxy, KEY_A, ask.clone()).await;
    assert_eq!(response.status(), 429);
    let retry_after: u64 = response.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=30).contains(&retry_after), "{retry_after}");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["type"], "rate_limit_error");
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("2 requests per minute")
    );
    // Anthropic clients get Anthropic's shape.
    let response = reqwest::Client::new()
        .post(format!("{}/v1/messages", proxy.url()))
        .header("x-api-key", KEY_A)
        .json(&json!({"model": "chat", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 429);
    assert!(response.headers().contains_key("retry-after"));
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        (body["type"].as_str(), body["error"]["type"].as_str()),
        (Some("error"), Some("rate_limit_error"))
    );

    // team-b: one request at a time. Hold a stream open (the upstream is gated).
    let mut stream_request = ask.clone();
    stream_request["stream"] = json!(true);
    let open = post(&proxy, KEY_B, stream_request.clone()).await;
    assert_eq!(open.status(), 200);
    let second = post(&proxy, KEY_B, ask.clone()).await;
    assert_eq!(second.status(), 429);
    let body: Value = second.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("at most 1 at a time"),
        "{body}"
    );
    // Finish the first: the slot frees.
    upstream.release(10);
    let mut chunks = open.bytes_stream();
    while chunks.next().await.is_some() {}
    // The slot is released when the proxy finishes the request, just after the client has
    // read the end of the stream: a retry may still meet it taken (and is counted as refused).
    let mut admitted = false;
    let mut refused_while_releasing = 0.0;
    for _ in 0..100 {
        upstream.release(10);
        match post(&proxy, KEY_B, ask.clone()).await.status().as_u16() {
            200 => {
                admitted = true;
                break;
            }
            429 => refused_while_releasing += 1.0,
            other => panic!("unexpected status {other}"),
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(admitted, "the concurrency slot was not released");
    let metrics = proxy.metrics().await;
    assert_eq!(
        metric(
            &metrics,
            "switchyard_tenant_rejections_total",
            "tenant=\"team-a\",model=\"chat\",reason=\"requests_per_minute\""
        ),
        2.0,
        "{metrics}"
    );
    assert_eq!(
        metric(
            &metrics,
            "switchyard_tenant_rejections_total",
            "tenant=\"team-b\",model=\"chat\",reason=\"concurrency\""
        ),
        1.0 + refused_while_releasing
    );
}

#[tokio::test]
async fn a_default_tenant_serves_keyless_requests_only_when_configured() {
    let upstream = Upstream::start("w").await;
    let ask = json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]});
    // Off by default: no key is a 401 once tenants exist.
    let proxy = Proxy::start(&config(&upstream, "", ""), &[]).await;
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .json(&ask)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    drop(proxy);
    // team-b as the default tenant: keyless requests are served and counted as team-b; a
    // wrong key is still refused.
    let proxy = Proxy::start(
        &config(&upstream, "", ", default: true, models: [chat]"),
        &[],
    )
    .await;
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .json(&ask)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(post(&proxy, "sk-wrong", ask.clone()).await.status(), 401);
    let mut counted = 0.0;
    for _ in 0..100 {
        let metrics = proxy.metrics().await;
        counted = metric(
            &metrics,
            "switchyard_tenant_requests_total",
            "tenant=\"team-b\",model=\"chat\",target=\"pool default/p\",outcome=\"success\"",
        );
        if counted == 1.0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(counted, 1.0);
}
