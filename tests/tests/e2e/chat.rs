//! Chat, completions and streaming through the real proxy to test upstreams.

use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{Value, json};
use switchyard_e2e::{Proxy, Upstream, UpstreamOptions, one_worker_proxy, pool_config};

#[tokio::test]
async fn non_streaming_chat_resolves_the_alias_and_rewrites_only_the_model() {
    let (worker, proxy) = one_worker_proxy("w1", "Qwen/Qwen3-27B", &["fast"], &[]).await;
    let request = json!({
        "model": "fast",
        "messages": [{"role": "user", "content": "say \"model\": hi ünïcode"}],
        "temperature": 0.2,
        "max_tokens": 5
    });
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .header("authorization", "Bearer client-secret")
        .json(&request)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert!(response.headers().contains_key("x-request-id"));
    // Answers name the model as the client did; the header says what served it.
    assert_eq!(
        response.headers()["x-switchyard-served-model"],
        "Qwen/Qwen3-27B"
    );
    assert_eq!(response.headers()["content-type"], "application/json");
    // The worker streamed it (so the gateway saw its first token) and the gateway assembled
    // the whole answer the client asked for.
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["model"], "fast");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["content"], "w1-0 w1-1 w1-2 ");
    assert_eq!(body["usage"]["total_tokens"], 10);

    let received = worker.received();
    assert_eq!(received.len(), 1);
    assert_eq!(received[0].path, "/v1/chat/completions");
    let mut expected = request.clone();
    expected["model"] = json!("Qwen/Qwen3-27B");
    expected["stream"] = json!(true);
    expected["stream_options"] = json!({"include_usage": true});
    assert_eq!(
        received[0].json(),
        expected,
        "only the model name and the stream's fields may change on the way"
    );
    assert!(
        !received[0].headers.contains_key("authorization"),
        "client credentials must not reach workers"
    );
    assert_eq!(
        received[0].headers["content-length"].to_str().unwrap(),
        received[0].body.len().to_string()
    );
}

#[tokio::test]
async fn completions_endpoint_is_forwarded() {
    let (worker, proxy) = one_worker_proxy("w1", "base", &["base"], &[]).await;
    let response = reqwest::Client::new()
        .post(format!("{}/v1/completions", proxy.url()))
        .json(&json!({"model": "base", "prompt": "Once upon"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["choices"][0]["text"], "w1-0 w1-1 w1-2 ");
    assert_eq!(worker.received()[0].path, "/v1/completions");
    assert_eq!(worker.received()[0].json()["stream"], true);
}

#[tokio::test]
async fn streaming_passes_each_chunk_through_before_the_next_exists() {
    let worker = Upstream::start_with(
        "w1",
        UpstreamOptions {
            stream_chunks: Some(3),
            gated: true,
            ..Default::default()
        },
    )
    .await;
    // The alias differs from the served name: every chunk is renamed, still one by one.
    let proxy = Proxy::start(
        &pool_config("p", "org/served-m", &[worker.endpoint()], "", &["m"]),
        &[],
    )
    .await;
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .json(
            &json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut stream = response.bytes_stream();
    let mut seen = String::new();
    // The upstream sends chunk i only after we release it, so each chunk must arrive on its own:
    // a proxy that buffered would deadlock here (bounded by the timeout).
    for i in 0..3 {
        worker.release(1);
        while !seen.contains(&format!("w1-{i} ")) {
            let chunk = tokio::time::timeout(Duration::from_secs(10), stream.next())
                .await
                .unwrap_or_else(|_| panic!("chunk {i} never arrived; got {seen:?}"))
                .expect("stream ended early")
                .unwrap();
            seen.push_str(std::str::from_utf8(&chunk).unwrap());
        }
        assert!(!seen.contains(&format!("w1-{} ", i + 1)));
    }
    // The usage chunk the proxy asked for on the client's behalf (removed on the way), then [DONE].
    worker.release(2);
    while let Some(chunk) = tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .unwrap()
    {
        seen.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    assert!(seen.ends_with("data: [DONE]\n\n"), "{seen}");
    assert!(!seen.contains("usage"), "{seen}");
    assert!(seen.contains("\"model\":\"m\""), "{seen}");
    assert!(!seen.contains("org/served-m"), "{seen}");
}

/// A whole-answer request's body as a worker gets it: asked to stream with usage (the gateway
/// assembles the answer), those two fields added first and every other byte as sent.
fn streamed_for_assembly(body: &[u8]) -> Vec<u8> {
    let mut out = br#"{"stream":true,"stream_options":{"include_usage":true},"#.to_vec();
    out.extend_from_slice(&body[1..]);
    out
}

#[tokio::test]
async fn multi_megabyte_body_arrives_upstream_byte_for_byte() {
    let (worker, proxy) = one_worker_proxy("w1", "served-name", &["alias"], &[]).await;
    let client = reqwest::Client::new();
    // Sizes around Pingora's 64 KiB retry buffer and well past it.
    for size in [10, 65_535, 65_536, 70_000, 200_000, 5 * 1024 * 1024] {
        let prompt: String = (0..size)
            .map(|i| char::from(b'a' + (i % 26) as u8))
            .collect();
        let body = json!({"model": "alias", "messages": [{"role": "user", "content": prompt}]});
        let response = client
            .post(format!("{}/v1/chat/completions", proxy.url()))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "size {size}");
        let received = worker.received().pop().unwrap();
        let mut expected = body.clone();
        expected["model"] = json!("served-name");
        assert_eq!(
            received.body,
            streamed_for_assembly(&serde_json::to_vec(&expected).unwrap()),
            "size {size}"
        );
    }
}

#[tokio::test]
async fn chunked_request_bodies_are_forwarded_with_a_content_length() {
    let (worker, proxy) = one_worker_proxy("w1", "m", &["m"], &[]).await;
    let body = serde_json::to_vec(
        &json!({"model": "m", "messages": [{"role": "user", "content": "chunked"}]}),
    )
    .unwrap();
    let pieces: Vec<Result<Vec<u8>, std::io::Error>> =
        body.chunks(7).map(|c| Ok(c.to_vec())).collect();
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .header("content-type", "application/json")
        .body(reqwest::Body::wrap_stream(futures_util::stream::iter(
            pieces,
        )))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let received = worker.received().pop().unwrap();
    assert_eq!(received.body, streamed_for_assembly(&body));
    assert_eq!(
        received.headers["content-length"],
        received.body.len().to_string().as_str()
    );
    assert!(!received.headers.contains_key("transfer-encoding"));

    // Without a length, a body past Pingora's replay buffer cannot be forwarded safely: 411.
    let big = serde_json::to_vec(
        &json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(100_000)}]}),
    )
    .unwrap();
    let pieces: Vec<Result<Vec<u8>, std::io::Error>> =
        big.chunks(8192).map(|c| Ok(c.to_vec())).collect();
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .body(reqwest::Body::wrap_stream(futures_util::stream::iter(
            pieces,
        )))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 411);
    let error: Value = response.json().await.unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("Content-Length")
    );
}

#[tokio::test]
async fn models_lists_the_aliases() {
    let (_worker, proxy) = one_worker_proxy("w1", "m", &["alpha", "org/beta"], &[]).await;
    let client = reqwest::Client::new();
    let body: Value = client
        .get(format!("{}/v1/models", proxy.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(body["object"], "list");
    let ids: Vec<&str> = body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["alpha", "org/beta"]);
    let anthropic: Value = client
        .get(format!("{}/v1/models", proxy.url()))
        .header("anthropic-version", "2023-06-01")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(anthropic["data"][0]["type"], "model");
    assert_eq!(anthropic["has_more"], false);
    // One model, by id: slashes raw or percent-encoded; unknown ids are 404 in the caller's
    // format.
    for path in ["org/beta", "org%2Fbeta"] {
        let one: Value = client
            .get(format!("{}/v1/models/{path}", proxy.url()))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(
            (one["id"].as_str(), one["object"].as_str()),
            (Some("org/beta"), Some("model"))
        );
    }
    let missing = client
        .get(format!("{}/v1/models/gamma", proxy.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    let missing: Value = missing.json().await.unwrap();
    assert_eq!(missing["error"]["code"], "model_not_found");
    let missing: Value = client
        .get(format!("{}/v1/models/gamma", proxy.url()))
        .header("anthropic-version", "2023-06-01")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(missing["type"], "error");
    assert_eq!(missing["error"]["type"], "not_found_error");
    let health = client
        .get(format!("{}/health", proxy.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
}

#[tokio::test]
async fn http2_cleartext_clients_are_served() {
    let (worker, proxy) = one_worker_proxy("w1", "m", &["m"], &[]).await;
    let client = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let response = client
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": "over h2"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.version(), reqwest::Version::HTTP_2);
    assert_eq!(response.status(), 200);
    assert_eq!(worker.received().len(), 1);
}

/// What several client libraries send: JSON nulls for options they leave unset. vLLM takes them
/// as absent, and so does the gateway (the usage it asks for replaces the null in place).
#[tokio::test]
async fn nulls_client_libraries_send_are_taken_as_absent() {
    let (worker, proxy) = one_worker_proxy("w1", "m", &["chat"], &[]).await;
    let body = serde_json::json!({
        "model": "chat",
        "stream": true,
        "stream_options": null,
        "max_tokens": null,
        "n": null,
        "tools": null,
        "tool_choice": null,
        "cache_salt": null,
        "messages": [{"role": "user", "content": "hi"}],
    });
    let answer = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let text = answer.text().await.unwrap();
    assert!(text.contains("data: [DONE]"), "{text}");
    assert!(
        !text.contains("\"usage\":{"),
        "the usage chunk the gateway asked for is not the client's: {text}"
    );
    let sent = worker.received().pop().unwrap();
    let raw = String::from_utf8_lossy(&sent.body).into_owned();
    assert_eq!(raw.matches("\"stream_options\"").count(), 1, "{raw}");
    assert_eq!(sent.json()["stream_options"]["include_usage"], true);
    assert_eq!(sent.json()["model"], "m");
}
