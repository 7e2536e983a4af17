//! `/v1/messages`: passed through to workers that serve it, translated for OpenAI-only pools.

use futures_util::StreamExt;
use serde_json::{Value, json};
use switchyard_e2e::{Proxy, Upstream, UpstreamOptions, pool_config};

fn events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let name = e
                .lines()
                .find_map(|l| l.strip_prefix("event: "))
                .unwrap()
                .to_owned();
            let data = e.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
            (name, serde_json::from_str(data).unwrap())
        })
        .collect()
}

#[tokio::test]
async fn native_pools_receive_messages_unchanged_but_for_the_model_and_the_stream() {
    let worker = Upstream::start_with(
        "native",
        UpstreamOptions {
            anthropic_native: true,
            ..Default::default()
        },
    )
    .await;
    let proxy = Proxy::start(
        &pool_config("p", "served", &[worker.endpoint()], "", &["claude-local"]),
        &[],
    )
    .await;
    let request = json!({"model": "claude-local", "max_tokens": 16, "system": "terse", "messages": [{"role": "user", "content": "hi"}]});
    let response = reqwest::Client::new()
        .post(format!("{}/v1/messages", proxy.url()))
        .header("x-api-key", "client-key")
        .header("anthropic-version", "2023-06-01")
        .json(&request)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    // Asked for whole: streamed from the worker (so the gateway sees its first token) and
    // assembled into the message the client asked for, named as it asked.
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["type"], "message");
    assert_eq!(body["role"], "assistant");
    assert_eq!(body["model"], "claude-local");
    assert_eq!(
        body["content"],
        json!([{"type": "text", "text": "native-0 native-1 native-2 "}])
    );
    assert_eq!(body["stop_reason"], "end_turn");
    assert_eq!(
        body["usage"],
        json!({"input_tokens": 7, "output_tokens": 3})
    );
    let received = worker.received().pop().unwrap();
    assert_eq!(received.path, "/v1/messages");
    let mut expected = request;
    expected["model"] = json!("served");
    expected["stream"] = json!(true);
    assert_eq!(received.json(), expected);
    assert!(!received.headers.contains_key("x-api-key"));
}

#[tokio::test]
async fn openai_only_pools_get_chat_completions_and_answers_come_back_as_messages() {
    let worker = Upstream::start("openai-only").await;
    let proxy = Proxy::start(
        &pool_config(
            "p",
            "served",
            &[worker.endpoint()],
            "  anthropicMessages: translate\n",
            &["claude-compat"],
        ),
        &[],
    )
    .await;
    let client = reqwest::Client::new();
    let request = json!({
        "model": "claude-compat", "max_tokens": 16, "system": "terse",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    });
    let response = client
        .post(format!("{}/v1/messages", proxy.url()))
        .json(&request)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/json")
    );
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["type"], "message");
    assert_eq!(body["model"], "claude-compat");
    // Streamed from the worker (so the gateway saw its first token), assembled, translated.
    assert_eq!(
        body["content"][0]["text"],
        "openai-only-0 openai-only-1 openai-only-2 "
    );
    assert_eq!(body["stop_reason"], "end_turn");
    assert_eq!(body["usage"]["output_tokens"], 3);

    let received = worker.received().pop().unwrap();
    assert_eq!(received.path, "/v1/chat/completions");
    let sent = received.json();
    assert_eq!(sent["model"], "served");
    assert_eq!(
        (&sent["stream"], &sent["stream_options"]["include_usage"]),
        (&json!(true), &json!(true))
    );
    assert_eq!(
        sent["messages"][0],
        json!({"role": "system", "content": "terse"})
    );
    assert_eq!(sent["max_tokens"], 16);

    // Streaming: OpenAI chunks become Anthropic events.
    let mut streaming = request.clone();
    streaming["stream"] = json!(true);
    let response = client
        .post(format!("{}/v1/messages", proxy.url()))
        .json(&streaming)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut text = String::new();
    let mut stream = response.bytes_stream();
    while let Some(chunk) = stream.next().await {
        text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    let events = events(&text);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"message_start"));
    assert_eq!(names.last(), Some(&"message_stop"));
    let joined: String = events
        .iter()
        .filter_map(|(_, d)| d["delta"]["text"].as_str())
        .collect();
    assert_eq!(joined, "openai-only-0 openai-only-1 openai-only-2 ");
    let delta = events.iter().find(|(n, _)| n == "message_delta").unwrap();
    assert_eq!(delta.1["usage"]["output_tokens"], 3);
    assert_eq!(
        worker.received().pop().unwrap().json()["stream_options"]["include_usage"],
        true
    );
}

/// `count_tokens` is answered by the gateway with the pool's chat template and tokenizer: the
/// count is what the worker will see, and nothing reaches the worker.
#[tokio::test]
async fn count_tokens_is_answered_with_the_pools_tokenizer() {
    use switchyard_kv::tokenize::{ChatMessage, PromptTokenizer};
    let (worker, proxy) =
        switchyard_e2e::one_worker_proxy("w1", "served", &["claude-local"], &[]).await;
    let answer = reqwest::Client::new()
        .post(format!("{}/v1/messages/count_tokens", proxy.url()))
        .header("anthropic-version", "2023-06-01")
        .json(&json!({
            "model": "claude-local",
            "system": "Be brief.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Name three rivers."}]}],
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let body: Value = answer.json().await.unwrap();
    let tokenizer = PromptTokenizer::shipped().unwrap();
    let rendered = tokenizer
        .render_chat(&[
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Name three rivers."),
        ])
        .unwrap();
    assert_eq!(
        body["input_tokens"],
        tokenizer.encode(&rendered).unwrap().len()
    );
    assert!(worker.received().is_empty(), "counting reaches no worker");
    let missing = reqwest::Client::new()
        .post(format!("{}/v1/messages/count_tokens", proxy.url()))
        .json(&json!({"model": "claude-local", "messages": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 400);
    let error: Value = missing.json().await.unwrap();
    assert_eq!(error["type"], "error");
}
