//! Pooling models through the gateway: embeddings, pooling, scores and rankings reach pools of
//! the right task, answer under the client's alias, count per tenant, and embeddings fall back
//! to an OpenAI-format provider.

use serde_json::{Value, json};
use switchyard_e2e::{Proxy, Upstream, UpstreamOptions, key_sha256};

async fn post(url: String, key: &str, body: Value) -> (u16, Value) {
    let response = reqwest::Client::new()
        .post(url)
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn pooling_requests_reach_pools_of_their_task_and_count_per_tenant() {
    let embed = Upstream::start("embed").await;
    let reranker = Upstream::start("reranker").await;
    let chat = Upstream::start("chat").await;
    let cloud = Upstream::start_with("cloud", UpstreamOptions::default()).await;
    let yaml = format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: embed}}\nspec: {{model: org/embedder, task: embed, endpoints: [\"{}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: rerank}}\nspec: {{model: org/reranker, task: score, endpoints: [\"{}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: chat}}\nspec: {{model: org/chat, endpoints: [\"{}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: dead}}\nspec: {{model: org/embedder, task: embed, endpoints: [\"127.0.0.1:1\"], maxAttempts: 1}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: ExternalProvider\nmetadata: {{name: cloud}}\nspec: {{baseUrl: \"http://{}/v1\", format: openai}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: embedder}}\nspec: {{targets: [{{pool: embed}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: reranker}}\nspec: {{targets: [{{pool: rerank}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: chat}}\nspec: {{targets: [{{pool: chat}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: embedder-with-fallback}}\nspec: {{strategy: ordered, targets: [{{pool: dead}}, {{provider: cloud, model: text-embedding-3-small}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: Tenant\nmetadata: {{name: search}}\nspec: {{apiKeys: [{{sha256: {}}}]}}\n",
        embed.endpoint(),
        reranker.endpoint(),
        chat.endpoint(),
        cloud.endpoint(),
        key_sha256("search-key"),
    );
    let proxy = Proxy::start(&yaml, &[]).await;
    let url = |path: &str| format!("{}{path}", proxy.url());

    let (status, body) = post(
        url("/v1/embeddings"),
        "search-key",
        json!({"model": "embedder", "input": ["a river", "a lake"]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"].as_array().unwrap().len(), 2);
    assert_eq!(
        body["model"], "embedder",
        "the client's alias names the model"
    );
    assert_eq!(
        embed.received().pop().unwrap().json()["model"],
        "org/embedder"
    );

    let (status, body) = post(
        url("/pooling"),
        "search-key",
        json!({"model": "embedder", "input": "x"}),
    )
    .await;
    assert_eq!(
        (status, body["data"][0]["object"].as_str()),
        (200, Some("pooling"))
    );
    let (status, body) = post(
        url("/v1/rerank"),
        "search-key",
        json!({"model": "reranker", "query": "rivers", "documents": ["the Danube", "a teapot"]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["model"], "reranker");
    assert_eq!(reranker.received().pop().unwrap().path, "/v1/rerank");
    let (status, _) = post(
        url("/score"),
        "search-key",
        json!({"model": "reranker", "text_1": "rivers", "text_2": "the Danube"}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(reranker.received().pop().unwrap().path, "/score");

    // The wrong kind of model says so, and never reaches a worker.
    let (status, body) = post(
        url("/v1/embeddings"),
        "search-key",
        json!({"model": "chat", "input": "x"}),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["code"], "model_task_mismatch");
    let (status, body) = post(
        url("/v1/chat/completions"),
        "search-key",
        json!({"model": "embedder", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("embedding model"),
        "{body}"
    );
    assert!(chat.received().is_empty());
    let (status, body) = post(
        url("/v1/embeddings"),
        "search-key",
        json!({"model": "embedder"}),
    )
    .await;
    assert_eq!(
        (status, body["error"]["param"].as_str()),
        (400, Some("input"))
    );

    // An unreachable embedding pool falls back to the provider's /embeddings.
    let (status, body) = post(
        url("/v1/embeddings"),
        "search-key",
        json!({"model": "embedder-with-fallback", "input": "a river"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let sent = cloud.received().pop().unwrap();
    assert_eq!(sent.path, "/v1/embeddings");
    assert_eq!(sent.json()["model"], "text-embedding-3-small");

    // Input tokens are counted per tenant, from the usage the workers report.
    let metrics = reqwest::get(format!("{}/metrics", proxy.admin_url()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let line = metrics
        .lines()
        .find(|l| {
            l.starts_with("switchyard_tenant_prompt_tokens_total")
                && l.contains("tenant=\"search\"")
                && l.contains("target=\"pool default/embed\"")
        })
        .unwrap_or_else(|| panic!("no prompt-token series for the embed pool:\n{metrics}"));
    assert!(
        line.ends_with(" 15"),
        "2 inputs and 1 input, 5 tokens each: {line}"
    );
}
