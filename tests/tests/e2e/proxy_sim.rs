//! The main job end to end: switchyard-proxy in front of simulated vLLM workers, driven by the
//! official SDKs.

use switchyard_e2e::{Proxy, Sim, pool_config, run_python};

#[tokio::test]
async fn sdks_through_the_proxy_to_simulated_vllm_workers() {
    let sim = Sim::start(&["--workers", "1", "--time-scale", "0.001", "--no-kv-events"]);
    let endpoints: Vec<String> = sim.workers.iter().map(|w| w.http.clone()).collect();
    let proxy = Proxy::start(
        &pool_config("local", &sim.model, &endpoints, "", &["default"]),
        &[],
    )
    .await;
    let url = proxy.url();
    let output = tokio::task::spawn_blocking(move || run_python("sdk_sim.py", &[&url, "default"]))
        .await
        .unwrap();
    for check in [
        "openai chat with prefix cache",
        "openai stream",
        "openai completions",
        "anthropic stream",
    ] {
        assert!(
            output.contains(&format!("ok: {check}")),
            "missing {check:?} in:\n{output}"
        );
    }
}

#[tokio::test]
async fn the_embedded_default_config_fronts_three_simulated_workers() {
    // scripts/demo.sh's layout, on free ports: the default config names 127.0.0.1:8001-8003, so
    // this test writes the same documents with the simulator's real ports.
    let sim = Sim::start(&["--workers", "3", "--time-scale", "0.001"]);
    let config = switchyard_e2e::default_config_for(&sim);
    assert!(
        !config.contains("127.0.0.1:800") && !config.contains(":555") && !config.contains(":565")
    );
    let proxy = Proxy::start(&config, &[]).await;
    let client = reqwest::Client::new();
    for _ in 0..6 {
        let response = client
            .post(format!("{}/v1/chat/completions", proxy.url()))
            .json(&serde_json::json!({"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let body: serde_json::Value = response.json().await.unwrap();
        assert_eq!(body["usage"]["completion_tokens"], 2);
    }
}

/// vLLM's tokenizer endpoints through the gateway: routed to a worker of the model's pool (the
/// alias becomes the served name), answered by the worker as vLLM answers them.
#[tokio::test]
async fn tokenize_and_detokenize_reach_a_worker_of_the_models_pool() {
    let sim = Sim::start(&["--workers", "2", "--time-scale", "0.001", "--no-kv-events"]);
    let endpoints: Vec<String> = sim.workers.iter().map(|w| w.http.clone()).collect();
    let proxy = Proxy::start(
        &pool_config("local", &sim.model, &endpoints, "", &["default"]),
        &[],
    )
    .await;
    let client = reqwest::Client::new();
    let post = |base: String, path: &str, body: serde_json::Value| {
        client.post(format!("{base}{path}")).json(&body).send()
    };
    let direct: serde_json::Value = post(
        format!("http://{}", sim.workers[0].http),
        "/tokenize",
        serde_json::json!({"model": sim.model, "prompt": "hello rivers of Europe"}),
    )
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    let through = post(
        proxy.url(),
        "/tokenize",
        serde_json::json!({"model": "default", "prompt": "hello rivers of Europe"}),
    )
    .await
    .unwrap();
    assert_eq!(through.status(), 200);
    let through: serde_json::Value = through.json().await.unwrap();
    assert_eq!(through, direct);
    assert!(through["count"].as_u64().unwrap() > 0);
    let text: serde_json::Value = post(
        proxy.url(),
        "/detokenize",
        serde_json::json!({"model": "default", "tokens": through["tokens"]}),
    )
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    assert_eq!(text["prompt"], "hello rivers of Europe");
    // The gateway routes by model: one is needed, and it must exist.
    let anonymous = post(proxy.url(), "/tokenize", serde_json::json!({"prompt": "x"}))
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 400);
    let unknown = post(
        proxy.url(),
        "/detokenize",
        serde_json::json!({"model": "nope", "tokens": [1]}),
    )
    .await
    .unwrap();
    assert_eq!(unknown.status(), 404);
}

/// An embedding pool of simulated vLLM workers (the pooling runner) behind the gateway, called
/// with the official SDK.
#[tokio::test]
async fn embeddings_reach_a_pool_of_simulated_pooling_workers() {
    let sim = Sim::start(&[
        "--workers",
        "2",
        "--time-scale",
        "0.001",
        "--no-kv-events",
        "--task",
        "embed",
    ]);
    let endpoints: Vec<String> = sim.workers.iter().map(|w| w.http.clone()).collect();
    let proxy = Proxy::start(
        &pool_config(
            "embed",
            &sim.model,
            &endpoints,
            "  task: embed\n  loadBalancing: least-outstanding\n",
            &["embedder"],
        ),
        &[],
    )
    .await;
    let url = proxy.url();
    let output =
        tokio::task::spawn_blocking(move || run_python("sdk_embeddings.py", &[&url, "embedder"]))
            .await
            .unwrap();
    for check in [
        "openai embeddings",
        "openai single embedding",
        "generation refused",
    ] {
        assert!(
            output.contains(&format!("ok: {check}")),
            "missing {check:?} in:\n{output}"
        );
    }
    // The workers refuse generation themselves too, as vLLM's pooling runner does.
    let direct = reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", sim.workers[0].http))
        .json(&serde_json::json!({"model": sim.model, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(direct.status(), 404);
}

/// A cross-encoder pool of simulated workers: scores and rankings through the gateway.
#[tokio::test]
async fn scores_and_rankings_reach_a_pool_of_simulated_cross_encoders() {
    let sim = Sim::start(&[
        "--workers",
        "1",
        "--time-scale",
        "0.001",
        "--no-kv-events",
        "--task",
        "score",
    ]);
    let endpoints: Vec<String> = sim.workers.iter().map(|w| w.http.clone()).collect();
    let proxy = Proxy::start(
        &pool_config(
            "rank",
            &sim.model,
            &endpoints,
            "  task: score\n",
            &["reranker"],
        ),
        &[],
    )
    .await;
    let client = reqwest::Client::new();
    let ranked: serde_json::Value = client
        .post(format!("{}/v1/rerank", proxy.url()))
        .json(&serde_json::json!({
            "model": "reranker",
            "query": "rivers of Europe",
            "documents": ["the Danube and the Rhine", "a teapot", "rivers of Europe"],
            "top_n": 2,
        }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ranked["model"], "reranker", "{ranked}");
    let results = ranked["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    assert_eq!(
        results[0]["index"], 2,
        "the identical text ranks first: {ranked}"
    );
    assert!(results[0]["relevance_score"].as_f64() >= results[1]["relevance_score"].as_f64());
    let scored = client
        .post(format!("{}/v1/score", proxy.url()))
        .json(&serde_json::json!({"model": "reranker", "text_1": "a", "text_2": ["a", "b"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(scored.status(), 200);
    let scored: serde_json::Value = scored.json().await.unwrap();
    assert_eq!(scored["data"].as_array().unwrap().len(), 2);
    assert!(scored["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    // A cross-encoder makes no embeddings: the gateway says so before any worker sees it.
    let refused = client
        .post(format!("{}/v1/embeddings", proxy.url()))
        .json(&serde_json::json!({"model": "reranker", "input": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 400);
}
