//! The pool's TTFT model learns from answers: a pool configured with coefficients 2x off, in
//! front of a simulated vLLM worker, ends up predicting what the worker does, and `/debug/route`
//! and `/metrics` show the configured and learned model, its error, and each worker's last
//! predicted and observed time to first token.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{Value, json};
use switchyard_e2e::{Proxy, Sim};

/// Slow enough that a first token's time is mostly the worker's: at 0.1 the gateway's own few
/// milliseconds (a debug build on a busy test machine) are a fifth of it, add noise to what
/// the model learns from, and dilute a worker's slowness.
const TIME_SCALE: f64 = 0.2;

/// A prompt of about `words` tokens no other request shares (`tag` makes it unique).
fn prompt(tag: usize, words: usize) -> String {
    (0..words)
        .map(|i| format!("w{}x{}", tag * 7919 + i, i % 13))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Send one streamed chat request to `base` (the proxy or a worker); its time to first token as the client saw it and the
/// prompt tokens the worker counted.
async fn streamed(base: &str, model: &str, content: &str) -> (f64, u64) {
    let sent = Instant::now();
    let response = reqwest::Client::new()
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({"model": model, "max_tokens": 2, "stream": true,
            "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": content}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.bytes_stream();
    let mut first = None;
    let mut text = String::new();
    while let Some(chunk) = body.next().await {
        first.get_or_insert_with(|| sent.elapsed().as_secs_f64());
        text.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
    }
    let prompt_tokens = text
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter_map(|data| serde_json::from_str::<Value>(data).ok())
        .find_map(|event| event["usage"]["prompt_tokens"].as_u64())
        .unwrap_or_else(|| panic!("no usage in the stream:\n{text}"));
    (first.unwrap(), prompt_tokens)
}

/// Slope of `y` on `x` (Theil–Sen: the median of the slopes between every two points apart
/// in `x`). A request stalled by a busy test machine is one outlier among many; a least-squares
/// slope follows it, the median does not (nor does the pool's model, which bounds outliers).
fn slope(points: &[(f64, f64)]) -> f64 {
    let mut slopes: Vec<f64> = points
        .iter()
        .enumerate()
        .flat_map(|(i, a)| points[i + 1..].iter().map(move |b| (a, b)))
        .filter(|(a, b)| (b.0 - a.0).abs() >= 16.0)
        .map(|(a, b)| (b.1 - a.1) / (b.0 - a.0))
        .collect();
    slopes.sort_by(f64::total_cmp);
    slopes[slopes.len() / 2]
}

#[tokio::test]
async fn a_pool_configured_2x_off_learns_its_workers_ttft_from_answers() {
    let sim = Sim::start(&[
        "--workers",
        "1",
        "--time-scale",
        &TIME_SCALE.to_string(),
        "--block-size",
        "16",
    ]);
    let worker = &sim.workers[0];
    // The worker's own cost per prompt token, measured straight from it (no gateway in the
    // way) on cold prompts of a few hundred to a few thousand tokens; the pool is told twice
    // that.
    let worker_url = format!("http://{}", worker.http);
    let words = |i: usize| 60 + (i * 37) % 600;
    let mut direct = Vec::new();
    for i in 0..12 {
        let (ttft, tokens) = streamed(&worker_url, &sim.model, &prompt(1000 + i, words(i))).await;
        direct.push((tokens as f64, ttft));
    }
    let configured_us = (2.0 * slope(&direct) * 1e6).round();
    let yaml = format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: sim}}\nspec:\n  model: {model}\n  blockSize: 16\n  scrapeIntervalMs: 100\n  scoring: {{prefillMicrosPerToken: {configured_us}, runningRequestMicros: 100}}\n  endpoints: [{endpoint}]\n{doc}",
        model = sim.model,
        endpoint = worker.endpoint_yaml(),
        doc = switchyard_e2e::model_doc("default", "sim", None),
    );
    let proxy = Proxy::start(&yaml, &[]).await;
    proxy.wait_subscribed(1).await;

    // One request at a time through the proxy, same lengths; every fourth repeats an earlier
    // prompt, which the worker then reports as cached (when it is still there: the model learns
    // from what the worker says it prefilled). The worker's own cost keeps being measured
    // beside it.
    let mut sent: Vec<String> = Vec::new();
    for i in 0..48 {
        let content = if i % 4 == 3 {
            sent[i / 2 % sent.len()].clone()
        } else {
            let (ttft, tokens) =
                streamed(&worker_url, &sim.model, &prompt(2000 + i, words(i))).await;
            direct.push((tokens as f64, ttft));
            prompt(i, words(i))
        };
        streamed(&proxy.url(), "default", &content).await;
        sent.push(content);
    }
    let measured_us = slope(&direct) * 1e6;
    assert!(
        configured_us / measured_us > 1.6,
        "the premise: the pool is configured far off ({configured_us} µs vs {measured_us:.1} µs measured)"
    );

    // Every streamed answer was learned from (the usage of the last may still be on its way).
    let deadline = Instant::now() + Duration::from_secs(5);
    let explained = loop {
        let explained = proxy
            .debug_route(
                None,
                &json!({"model": "default", "messages": [{"role": "user", "content": "hi"}]}),
            )
            .await;
        if explained["ttft_model"]["observations"].as_u64() >= Some(48) {
            break explained;
        }
        assert!(Instant::now() < deadline, "{explained}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let model = &explained["ttft_model"];
    assert_eq!(model["learning"], true, "{explained}");
    assert_eq!(
        model["configured"]["prefill_us_per_token"].as_f64(),
        Some(configured_us),
        "{model}"
    );
    // Attention is configured as the context at which it matches the weights (the default).
    assert_eq!(
        model["configured"]["attention_context_tokens"].as_f64(),
        Some(32768.0),
        "{model}"
    );
    // The measured slope is what a prompt token added across the prompts sent: the learned
    // model's prefill per token, and the attention the added token brings (a cold prompt of
    // `n` tokens attends to n(n+1)/2 pairs, so across the prompts' range each token added
    // brings about their mean length in pairs).
    let learned = &model["learned"];
    let learned_us = learned["prefill_us_per_token"].as_f64().unwrap();
    let mean_tokens = direct.iter().map(|(tokens, _)| tokens).sum::<f64>() / direct.len() as f64;
    let attention_us = learned["attention_context_tokens"]
        .as_f64()
        .map_or(0.0, |context| learned_us / context * mean_tokens);
    let slope_us = learned_us + attention_us;
    assert!(
        (slope_us / measured_us - 1.0).abs() < 0.25,
        "learned {slope_us:.1} µs per token ({learned_us:.1} and attention), measured {measured_us:.1} µs, configured {configured_us}: {model}"
    );
    let error = model["typical_error"].as_f64().unwrap();
    println!(
        "per prompt token: configured {configured_us} µs, measured {measured_us:.1} µs, learned {slope_us:.1} µs ({learned_us:.1} µs and {attention_us:.1} µs of attention); typical error {error:.3}"
    );
    assert!(error < 0.4, "{model}");
    // The worker's last answer: predicted and observed side by side.
    let last = &explained["scores"][0]["last_answer"];
    assert!(
        last["predicted_ttft_ms"].as_f64().unwrap() > 0.0
            && last["observed_ttft_ms"].as_f64().unwrap() > 0.0,
        "{explained}"
    );
    // And /metrics, for dashboards.
    let metrics = proxy.metrics().await;
    let gauge = metrics
        .lines()
        .find(|l| {
            l.starts_with("switchyard_pool_ttft_model_seconds{")
                && l.contains("term=\"per_prefill_token\"")
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no TTFT model in:\n{metrics}"));
    assert!((gauge * 1e6 / learned_us - 1.0).abs() < 0.3, "{gauge}");
    assert!(metrics.contains("switchyard_pool_ttft_model_error{pool=\"default/sim\"}"));
}

/// The relative speed `/debug/route` shows for each worker of the pool, by address, with how
/// many answers it was learned from.
async fn learned_speeds(proxy: &Proxy) -> Vec<(String, f64, u64)> {
    let explained = proxy
        .debug_route(
            None,
            &json!({"model": "default", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    explained["scores"]
        .as_array()
        .unwrap_or_else(|| panic!("no scores: {explained}"))
        .iter()
        .map(|score| {
            let speed = &score["learned_speed"];
            (
                score["worker"].as_str().unwrap().to_owned(),
                speed["relative_to_pool"].as_f64().unwrap(),
                speed["observations"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[tokio::test]
async fn a_worker_slower_than_the_rest_is_learned_from_ordinary_traffic() {
    // Three simulated workers, the third 1.5x slower (every engine step), behind a pool that
    // learns worker speeds. The traffic is ordinary: prompts of a few hundred tokens whose
    // first tokens come in tens of milliseconds, some of them repeated (then mostly cached).
    let sim = Sim::start(&[
        "--workers",
        "3",
        "--worker-speed",
        "1,1,1.5",
        "--time-scale",
        &TIME_SCALE.to_string(),
        "--block-size",
        "16",
    ]);
    let yaml = format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: sim}}\nspec:\n  model: {model}\n  blockSize: 16\n  scrapeIntervalMs: 100\n  scoring: {{learnWorkerSpeed: true}}\n  endpoints: [{endpoints}]\n{doc}",
        model = sim.model,
        endpoints = sim.endpoints_yaml(),
        doc = switchyard_e2e::model_doc("default", "sim", None),
    );
    let proxy = Proxy::start(&yaml, &[]).await;
    proxy.wait_subscribed(3).await;

    // Three clients, thirty requests each, back to back: about 70 s of the simulator's time
    // (14 s of wall time at its time scale). The slow worker gets the fewest answers to learn
    // from (its queue looks longer, cached repeats go to their holders), and once the nine that
    // make it known say it is slow it is avoided: it ends at 9 or 10, and with 25 requests a
    // client it was one short in some runs.
    let clients = (0..3).map(|client| {
        let url = proxy.url();
        let model = "default".to_owned();
        tokio::spawn(async move {
            let mut ttfts = Vec::new();
            for i in 0..30 {
                let tag = client * 100 + if i % 5 == 4 { i - 2 } else { i };
                let (ttft, _) =
                    streamed(&url, &model, &prompt(3000 + tag, 150 + (tag * 53) % 500)).await;
                ttfts.push(ttft);
            }
            ttfts
        })
    });
    let mut ttfts = Vec::new();
    for client in clients {
        ttfts.extend(client.await.unwrap());
    }
    ttfts.sort_by(f64::total_cmp);
    let median_ms = ttfts[ttfts.len() / 2] * 1000.0;

    let speeds = learned_speeds(&proxy).await;
    println!("median TTFT {median_ms:.1} ms (time scale {TIME_SCALE}); learned: {speeds:?}");
    let slow = &sim.workers[2].http;
    assert_eq!(speeds.len(), 3, "every worker scored: {speeds:?}");
    assert!(speeds.iter().any(|(w, _, _)| w == slow), "{speeds:?}");
    for (worker, relative, observations) in &speeds {
        assert!(
            *observations >= 9,
            "{worker} known from {observations} answers: {speeds:?}"
        );
        if worker == slow {
            assert!(
                (1.25..=1.8).contains(relative),
                "the slow worker: {speeds:?}"
            );
        } else {
            assert_eq!(*relative, 1.0, "{worker}: {speeds:?}");
        }
    }
}
