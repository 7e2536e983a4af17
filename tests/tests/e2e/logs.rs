//! Log levels an operator can page on: a client that hangs up mid-stream is not a gateway error.

use std::time::Duration;

use futures_util::StreamExt;
use switchyard_e2e::{Proxy, Sim, pool_config};

/// Lines at warn or above in a text-format log.
fn loud_lines(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|line| line.contains(" WARN ") || line.contains(" ERROR "))
        .collect()
}

#[tokio::test]
async fn a_client_aborting_a_stream_logs_nothing_at_warn_or_above() {
    // Slow enough that the answer is still streaming when the client hangs up.
    let sim = Sim::start(&["--workers", "1", "--time-scale", "0.2", "--no-kv-events"]);
    let endpoints: Vec<String> = sim.workers.iter().map(|w| w.http.clone()).collect();
    let proxy = Proxy::start(
        &pool_config("local", &sim.model, &endpoints, "", &["default"]),
        &[],
    )
    .await;
    let client = reqwest::Client::new();
    for _ in 0..3 {
        let response = client
            .post(format!("{}/v1/chat/completions", proxy.url()))
            .json(&serde_json::json!({
                "model": "default",
                "messages": [{"role": "user", "content": "tell me a long story"}],
                "max_tokens": 400,
                "stream": true
            }))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let mut body = response.bytes_stream();
        let first = tokio::time::timeout(Duration::from_secs(20), body.next())
            .await
            .expect("a first chunk")
            .expect("stream open")
            .unwrap();
        assert!(!first.is_empty());
        // Hang up mid-stream.
        drop(body);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while proxy.log().matches("request ended by the client").count() < 3 {
        assert!(
            std::time::Instant::now() < deadline,
            "the aborted streams were never logged:\n{}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Each line says when its first token came (the clients saw one before hanging up).
    for line in proxy
        .log()
        .lines()
        .filter(|l| l.contains("request ended by the client"))
    {
        assert!(line.contains(" ttft_ms="), "{line}");
        // And how long the gateway took to choose the worker.
        assert!(line.contains(" routed_us="), "{line}");
    }
    // A request after the aborts still works and is logged at info.
    let answer = client
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .json(&serde_json::json!({
            "model": "default",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let log = proxy.log();
    assert!(
        loud_lines(&log).is_empty(),
        "client aborts were logged at warn or above:\n{}",
        loud_lines(&log).join("\n")
    );
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains("switchyard_client_disconnects_total 3\n"),
        "{metrics}"
    );
}

#[tokio::test]
async fn an_unreachable_worker_is_logged_at_warn() {
    // The other side of the rule: a real upstream failure is loud.
    let dead = format!("127.0.0.1:{}", switchyard_e2e::process::free_port());
    let proxy = Proxy::start(
        &pool_config("local", "m", std::slice::from_ref(&dead), "", &["default"]),
        &[],
    )
    .await;
    let answer = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .json(&serde_json::json!({
            "model": "default",
            "messages": [{"role": "user", "content": "hi"}]
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 502);
    proxy
        .wait_for_log("request failed upstream", Duration::from_secs(10))
        .await;
    let log = proxy.log();
    let failed = log
        .lines()
        .find(|line| line.contains("request failed upstream"))
        .unwrap();
    assert!(failed.contains(" WARN "), "{failed}");
    assert!(
        !log.lines()
            .any(|line| line.contains(" ERROR ") && line.contains("Fail to proxy")),
        "Pingora's own error line was not replaced:\n{log}"
    );
}

#[tokio::test]
async fn debug_logs_hold_no_key_cookie_prompt_or_completion() {
    let provider = switchyard_e2e::Upstream::start_with(
        "COMPLETION-MARKER",
        switchyard_e2e::UpstreamOptions {
            provider_headers: true,
            ..Default::default()
        },
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    std::fs::write(&key, "sk-provider-SECRET").unwrap();
    let config = format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: ExternalProvider\nmetadata: {{name: p}}\nspec: {{baseUrl: \"http://{}/v1\", format: openai, credentials: {{file: \"{}\"}}}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: gpt}}\nspec: {{targets: [{{provider: p, model: gpt}}]}}\n",
        provider.endpoint(),
        key.display()
    );
    let proxy = Proxy::start_with_env(&config, &[], &[("RUST_LOG", "debug")]).await;
    let client = reqwest::Client::new();
    for stream in [false, true] {
        let answer = client
            .post(format!("{}/v1/chat/completions", proxy.url()))
            .header("cookie", "session=CLIENT-COOKIE")
            .json(&serde_json::json!({
                "model": "gpt",
                "stream": stream,
                "messages": [{"role": "user", "content": "PROMPT-MARKER"}]
            }))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 200);
        assert!(answer.text().await.unwrap().contains("COMPLETION-MARKER"));
    }
    proxy
        .wait_for_log("request_id", Duration::from_secs(5))
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let log = proxy.log();
    assert!(
        log.contains("DEBUG"),
        "the proxy did not log at debug:\n{log}"
    );
    for secret in [
        "sk-provider-SECRET",
        "CLIENT-COOKIE",
        "provider-secret",
        "PROMPT-MARKER",
        "COMPLETION-MARKER",
    ] {
        assert!(
            !log.contains(secret),
            "{secret} reached the debug log:\n{}",
            log.lines()
                .filter(|line| line.contains(secret))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}
