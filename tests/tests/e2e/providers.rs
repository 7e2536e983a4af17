//! External providers: an OpenAI client reaching an Anthropic-format provider and an Anthropic
//! client reaching an OpenAI-format provider, whole and streamed, with the provider's key and
//! not the client's.

use serde_json::{Value, json};
use switchyard_e2e::{Proxy, Upstream, UpstreamOptions};

const PROVIDER_KEY: &str = "sk-provider";

struct Setup {
    anthropic: Upstream,
    openai: Upstream,
    proxy: Proxy,
    _dir: tempfile::TempDir,
}

async fn setup() -> Setup {
    let anthropic = Upstream::start_with(
        "claude",
        UpstreamOptions {
            anthropic_native: true,
            stream_chunks: Some(3),
            ..Default::default()
        },
    )
    .await;
    let openai = Upstream::start_with(
        "gpt",
        UpstreamOptions {
            stream_chunks: Some(2),
            ..Default::default()
        },
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    std::fs::write(&key, PROVIDER_KEY).unwrap();
    let yaml = format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: ExternalProvider\nmetadata: {{name: anthropic}}\nspec: {{baseUrl: \"http://{}/v1\", format: anthropic, credentials: {{file: \"{}\"}}}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: ExternalProvider\nmetadata: {{name: openai}}\nspec: {{baseUrl: \"http://{}/v1/\", format: openai, credentials: {{file: \"{}\"}}}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: claude}}\nspec: {{targets: [{{provider: anthropic, model: claude-sonnet}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: gpt}}\nspec: {{targets: [{{provider: openai, model: gpt-4.1}}]}}\n",
        anthropic.endpoint(),
        key.display(),
        openai.endpoint(),
        key.display()
    );
    let proxy = Proxy::start(&yaml, &[]).await;
    Setup {
        anthropic,
        openai,
        proxy,
        _dir: dir,
    }
}

impl Setup {
    /// POST /v1/chat/completions and read the whole answer as text (streams included).
    async fn chat_text(&self, body: &Value) -> String {
        reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", self.proxy.url()))
            .json(body)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}

fn data_events(text: &str) -> Vec<Value> {
    text.split("\n\n")
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[tokio::test]
async fn openai_clients_reach_anthropic_providers() {
    let s = setup().await;
    let client = reqwest::Client::new();
    let request = json!({"model": "claude", "messages": [{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}], "max_tokens": 50});
    let response = client
        .post(format!("{}/v1/chat/completions", s.proxy.url()))
        .bearer_auth("client-key")
        .json(&request)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "claude");
    assert!(
        body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .starts_with("claude saw")
    );
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(body["usage"]["prompt_tokens"], 7);
    let sent = &s.anthropic.received()[0];
    assert_eq!(sent.path, "/v1/messages");
    assert_eq!(sent.headers["x-api-key"], PROVIDER_KEY);
    assert_eq!(sent.headers["anthropic-version"], "2023-06-01");
    assert!(
        sent.headers.get("authorization").is_none(),
        "the client's key must not leave"
    );
    let sent = sent.json();
    assert_eq!(sent["model"], "claude-sonnet");
    assert_eq!(sent["system"], "terse");
    assert_eq!(sent["max_tokens"], 50);
    assert_eq!(
        sent["messages"],
        json!([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    );

    // Streamed: OpenAI chunks, no usage chunk unless asked.
    let mut stream_request = request.clone();
    stream_request["stream"] = json!(true);
    let text = s.chat_text(&stream_request).await;
    let chunks = data_events(&text);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, "claude-0 claude-1 claude-2 ");
    assert!(chunks.iter().all(|c| c.get("usage").is_none()), "{text}");
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
    stream_request["stream_options"] = json!({"include_usage": true});
    let text = s.chat_text(&stream_request).await;
    let usage: Vec<Value> = data_events(&text)
        .into_iter()
        .filter(|c| c.get("usage").is_some())
        .collect();
    assert_eq!(usage.len(), 1, "{text}");
    assert_eq!(usage[0]["usage"]["completion_tokens"], 3);
    assert_eq!(usage[0]["choices"], json!([]));
}

#[tokio::test]
async fn anthropic_clients_reach_openai_providers() {
    let s = setup().await;
    let response = reqwest::Client::new()
        .post(format!("{}/v1/messages", s.proxy.url()))
        .header("x-api-key", "client-key")
        .header("anthropic-version", "2023-06-01")
        .json(&json!({"model": "gpt", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["type"], "message");
    assert!(
        body["content"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with("gpt saw")
    );
    let sent = &s.openai.received()[0];
    assert_eq!(
        sent.path, "/v1/chat/completions",
        "base URL with a trailing slash"
    );
    assert_eq!(
        sent.headers["authorization"],
        format!("Bearer {PROVIDER_KEY}")
    );
    assert!(sent.headers.get("x-api-key").is_none());
    assert_eq!(sent.json()["model"], "gpt-4.1");
    // Legacy completions cannot go to an Anthropic provider: a clear 501.
    let response = reqwest::Client::new()
        .post(format!("{}/v1/completions", s.proxy.url()))
        .json(&json!({"model": "claude", "prompt": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 501);
    let body: Value = response.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("legacy completions"),
        "{body}"
    );
}

#[tokio::test]
async fn providers_over_tls_trust_their_ca_file_and_nothing_else() {
    let openai = Upstream::start("tls-gpt").await;
    let anthropic = Upstream::start_with(
        "tls-claude",
        UpstreamOptions {
            anthropic_native: true,
            ..Default::default()
        },
    )
    .await;
    let openai_tls = switchyard_e2e::tls::TlsFront::start(openai.addr).await;
    let anthropic_tls = switchyard_e2e::tls::TlsFront::start(anthropic.addr).await;
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    std::fs::write(&key, PROVIDER_KEY).unwrap();
    let yaml = format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: ExternalProvider\nmetadata: {{name: trusted}}\nspec: {{baseUrl: \"https://127.0.0.1:{}/v1\", format: openai, caFile: \"{}\", credentials: {{file: \"{}\"}}}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: ExternalProvider\nmetadata: {{name: claude-tls}}\nspec: {{baseUrl: \"https://127.0.0.1:{}/v1\", format: anthropic, caFile: \"{}\", credentials: {{file: \"{}\"}}}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: ExternalProvider\nmetadata: {{name: untrusted}}\nspec: {{baseUrl: \"https://127.0.0.1:{}/v1\", format: openai}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: trusted}}\nspec: {{targets: [{{provider: trusted, model: gpt-4.1}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: claude}}\nspec: {{targets: [{{provider: claude-tls, model: claude-sonnet}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: untrusted}}\nspec: {{targets: [{{provider: untrusted, model: gpt-4.1}}]}}\n",
        openai_tls.addr.port(),
        openai_tls.ca_file.display(),
        key.display(),
        anthropic_tls.addr.port(),
        anthropic_tls.ca_file.display(),
        key.display(),
        openai_tls.addr.port(),
    );
    let proxy = Proxy::start(&yaml, &[]).await;
    let client = reqwest::Client::new();
    let ask = |model: &str, stream: bool| json!({"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]});
    for stream in [false, true] {
        let response = client
            .post(format!("{}/v1/chat/completions", proxy.url()))
            .json(&ask("trusted", stream))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert!(response.text().await.unwrap().contains("tls-gpt"));
        let response = client
            .post(format!("{}/v1/chat/completions", proxy.url()))
            .json(&ask("claude", stream))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert!(response.text().await.unwrap().contains("tls-claude"));
    }
    let sent = openai.received();
    assert_eq!(sent.len(), 2);
    assert_eq!(
        sent[0].headers["authorization"],
        format!("Bearer {PROVIDER_KEY}")
    );
    assert_eq!(anthropic.received()[0].headers["x-api-key"], PROVIDER_KEY);
    // The same server without its CA: the certificate is not trusted, nothing is sent.
    let response = client
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .json(&ask("untrusted", false))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 502);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["type"], "server_error");
    assert_eq!(openai.received().len(), 2);
}

#[tokio::test]
async fn a_silent_provider_times_out_by_its_own_read_timeout() {
    // Accepts connections and never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let yaml = format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: ExternalProvider\nmetadata: {{name: silent}}\nspec: {{baseUrl: \"http://{addr}/v1\", format: openai, readTimeoutMs: 300}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: slow}}\nspec: {{targets: [{{provider: silent, model: m}}]}}\n"
    );
    // The proxy-wide read timeout is an hour: only the provider's own 300 ms can answer in time.
    let proxy = Proxy::start(&yaml, &["--upstream-read-timeout-s", "3600"]).await;
    let request = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .json(&json!({"model": "slow", "messages": [{"role": "user", "content": "hi"}]}))
        .send();
    let response = tokio::time::timeout(std::time::Duration::from_secs(60), request)
        .await
        .expect("the provider's read timeout did not apply")
        .unwrap();
    assert_eq!(response.status(), 504);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "upstream_timeout");
    holder.abort();
}

#[tokio::test]
async fn providers_see_only_the_apis_headers_and_clients_none_of_the_providers() {
    use switchyard_e2e::upstream::PROVIDER_RESPONSE_HEADERS;
    let options = || UpstreamOptions {
        provider_headers: true,
        ..Default::default()
    };
    let strict = Upstream::start_with("strict", options()).await;
    let listed = Upstream::start_with("listed", options()).await;
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    std::fs::write(&key, PROVIDER_KEY).unwrap();
    let yaml = format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: ExternalProvider\nmetadata: {{name: strict}}\nspec: {{baseUrl: \"http://{}/v1\", format: openai, credentials: {{file: \"{}\"}}}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: ExternalProvider\nmetadata: {{name: listed}}\nspec: {{baseUrl: \"http://{}/v1\", format: openai, credentials: {{file: \"{}\"}}, forwardHeaders: [OpenAI-Organization]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: strict}}\nspec: {{targets: [{{provider: strict, model: gpt}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: listed}}\nspec: {{targets: [{{provider: listed, model: gpt}}]}}\n",
        strict.endpoint(),
        key.display(),
        listed.endpoint(),
        key.display()
    );
    let proxy = Proxy::start(&yaml, &[]).await;
    for (model, upstream) in [("strict", &strict), ("listed", &listed)] {
        for stream in [false, true] {
            let response = reqwest::Client::new()
                .post(format!("{}/v1/chat/completions", proxy.url()))
                .header("cookie", "session=client-secret")
                .header("openai-organization", "org-client")
                .header("openai-project", "proj-client")
                .header("anthropic-beta", "tools-2024")
                .header("x-internal-auth", "client-secret")
                .json(&json!({"model": model, "stream": stream,
                              "messages": [{"role": "user", "content": "hi"}]}))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200);
            for (name, _) in PROVIDER_RESPONSE_HEADERS {
                assert!(
                    response.headers().get(*name).is_none(),
                    "{model}: the provider's {name} reached the client"
                );
            }
            assert!(response.headers().get("x-request-id").is_some());
            let _ = response.text().await.unwrap();
            let received = upstream.received().pop().unwrap();
            let sent = |name: &str| {
                received
                    .headers
                    .get(name)
                    .map(|v| v.to_str().unwrap().to_owned())
            };
            for name in [
                "cookie",
                "openai-project",
                "anthropic-beta",
                "x-internal-auth",
            ] {
                assert_eq!(sent(name), None, "{model} received the client's {name}");
            }
            let organization = (model == "listed").then(|| "org-client".to_owned());
            assert_eq!(sent("openai-organization"), organization, "{model}");
            assert_eq!(
                sent("authorization"),
                Some(format!("Bearer {PROVIDER_KEY}"))
            );
            assert_eq!(sent("content-type").as_deref(), Some("application/json"));
        }
    }
}
