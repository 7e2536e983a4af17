//! The routing ledger: what the proxy counts against each worker of a cache-aware pool while a
//! request is in flight (`switchyard_worker_prefills_pending`, `..._prefill_tokens_pending`,
//! `..._requests_in_flight`, `..._kv_blocks_reserved` on `/metrics`). Prefill is counted until
//! the first token and no longer; the request and its KV blocks until the end; and nothing is
//! left behind on any path: success, a worker error, an unreachable worker, a fallback to a
//! provider, a client that goes away, a worker that falls silent or breaks mid-stream. A whole
//! answer is streamed from the worker and assembled, so it too shows its first token.

use futures_util::StreamExt;
use serde_json::json;
use switchyard_e2e::{Proxy, Upstream, UpstreamOptions, free_port};

/// The ledger of one worker as `/metrics` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Ledger {
    prefills: u64,
    prefill_tokens: u64,
    in_flight: u64,
    kv_blocks: u64,
    /// How long the worker has been on the oldest pending prefill (µs; 0 when none).
    prefill_elapsed_us: u64,
}

async fn ledger(proxy: &Proxy, worker: &str) -> Ledger {
    let metrics = proxy.metrics().await;
    let read = |name: &str| {
        metrics
            .lines()
            .find(|line| line.starts_with(name) && line.contains(&format!("worker=\"{worker}\"")))
            .and_then(|line| line.rsplit(' ').next())
            .and_then(|value| value.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{name} for {worker} missing:\n{metrics}"))
    };
    Ledger {
        prefills: read("switchyard_worker_prefills_pending{") as u64,
        prefill_tokens: read("switchyard_worker_prefill_tokens_pending{") as u64,
        in_flight: read("switchyard_worker_requests_in_flight{") as u64,
        kv_blocks: read("switchyard_worker_kv_blocks_reserved{") as u64,
        prefill_elapsed_us: (read("switchyard_worker_prefill_elapsed_seconds{") * 1e6) as u64,
    }
}

/// One request at the worker, before its first token: its prompt (a few blocks) pending.
fn assert_prefilling(ledger: &Ledger) {
    assert_eq!((ledger.prefills, ledger.in_flight), (1, 1), "{ledger:?}");
    assert!(ledger.prefill_tokens > 100, "{ledger:?}");
}

/// One request at the worker, past its first token: nothing pending, still in flight.
fn assert_decoding(ledger: &Ledger) {
    assert_eq!(
        (ledger.prefills, ledger.prefill_tokens, ledger.in_flight),
        (0, 0, 1),
        "{ledger:?}"
    );
}

/// Wait until the worker's ledger is as `wanted` (within 10 s); returns it.
async fn wait_ledger(proxy: &Proxy, worker: &str, wanted: impl Fn(&Ledger) -> bool) -> Ledger {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let now = ledger(proxy, worker).await;
        if wanted(&now) {
            return now;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{worker} keeps {now:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Wait until the worker's ledger is empty (the request's guards are dropped when its last byte
/// is logged, just after the client saw it).
async fn wait_empty(proxy: &Proxy, worker: &str) {
    wait_ledger(proxy, worker, |now| *now == Ledger::default()).await;
}

/// A test worker whose streamed answers are three chunks, let out one by one by
/// [`Upstream::release`] when `gated`.
async fn three_chunks(name: &str, gated: bool) -> Upstream {
    Upstream::start_with(name, three_chunks_options(gated)).await
}

fn three_chunks_options(gated: bool) -> UpstreamOptions {
    UpstreamOptions {
        gated,
        stream_chunks: Some(3),
        ..Default::default()
    }
}

async fn wait_received(upstream: &Upstream, count: usize) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while upstream.received().len() < count {
        assert!(
            std::time::Instant::now() < deadline,
            "{} got nothing",
            upstream.name()
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

fn config(
    gated: &Upstream,
    stalled: &Upstream,
    failing: &Upstream,
    dead: &str,
    healthy: &Upstream,
    cloud: &Upstream,
) -> String {
    format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: gated}}\nspec: {{model: m, endpoints: [\"{}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: stalled}}\nspec: {{model: m, endpoints: [\"{}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: broken}}\nspec: {{model: m, maxAttempts: 2, connectTimeoutMs: 500, endpoints: [\"{}\", \"{dead}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: mixed}}\nspec: {{model: m, maxAttempts: 2, connectTimeoutMs: 500, endpoints: [\"{dead}\", \"{}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: ExternalProvider\nmetadata: {{name: cloud}}\nspec: {{baseUrl: \"http://{}/v1\", format: openai}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: gated}}\nspec: {{modelName: gated, targets: [{{pool: gated}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: stalled}}\nspec: {{modelName: stalled, targets: [{{pool: stalled}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: falls-back}}\nspec: {{modelName: falls-back, strategy: ordered, targets: [{{pool: broken}}, {{provider: cloud, model: cloud-m}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: retried}}\nspec: {{modelName: retried, targets: [{{pool: mixed}}]}}\n",
        gated.endpoint(),
        stalled.endpoint(),
        failing.endpoint(),
        healthy.endpoint(),
        cloud.endpoint()
    )
}

fn body(model: &str, stream: bool) -> serde_json::Value {
    // Long enough that its uncached prompt is several KV blocks, and new to every worker: these
    // pools name no KV events, so a worker is assumed to keep the prompts it prefilled, and a
    // prompt sent before would count only its last, partial block.
    static SENT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nth = SENT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let content = format!(
        "request {nth}: {}",
        "the ledger counts this prompt until its first token ".repeat(40)
    );
    json!({"model": model, "stream": stream, "max_tokens": 64,
           "messages": [{"role": "user", "content": content}]})
}

/// Send `request` (asking for a whole answer) in the background: its status and answer.
fn ask_whole(
    client: &reqwest::Client,
    url: String,
    request: serde_json::Value,
) -> tokio::task::JoinHandle<(reqwest::StatusCode, serde_json::Value)> {
    let client = client.clone();
    tokio::spawn(async move {
        let response = client.post(&url).json(&request).send().await.unwrap();
        (response.status(), response.json().await.unwrap())
    })
}

#[tokio::test]
async fn prefill_is_released_at_the_first_token_and_everything_at_the_end_on_every_path() {
    let gated = three_chunks("gated", true).await;
    // Never lets a chunk out: its client gives up before the first token.
    let stalled = Upstream::start_with(
        "stalled",
        UpstreamOptions {
            gated: true,
            ..Default::default()
        },
    )
    .await;
    let failing = Upstream::start_with(
        "failing",
        UpstreamOptions {
            fail_with: Some(503),
            ..Default::default()
        },
    )
    .await;
    let dead = format!("127.0.0.1:{}", free_port());
    let healthy = Upstream::start("healthy").await;
    let cloud = Upstream::start("cloud").await;
    let proxy = Proxy::start(
        &config(&gated, &stalled, &failing, &dead, &healthy, &cloud),
        &[],
    )
    .await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", proxy.url());
    let worker = gated.endpoint();

    // A client that goes away before the first token: nothing stays counted.
    let abandoned = tokio::spawn({
        let (client, url) = (client.clone(), url.clone());
        async move {
            let response = client
                .post(&url)
                .json(&body("stalled", true))
                .send()
                .await
                .unwrap();
            let mut chunks = response.bytes_stream();
            chunks.next().await
        }
    });
    wait_received(&stalled, 1).await;
    assert_eq!(ledger(&proxy, &stalled.endpoint()).await.prefills, 1);
    abandoned.abort();
    let _ = abandoned.await;
    wait_empty(&proxy, &stalled.endpoint()).await;

    // A streamed Responses answer (native, in vLLM's order): its opening events come before
    // any token, so the prompt stays pending prefill through them, until the first delta.
    let input = body("gated", true)["messages"][0]["content"].clone();
    let response = client
        .post(format!("{}/v1/responses", proxy.url()))
        .json(&json!({"model": "gated", "stream": true, "max_output_tokens": 64, "input": input}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut chunks = response.bytes_stream();
    let mut seen = String::new();
    while !seen.contains("response.in_progress") {
        seen.push_str(&String::from_utf8_lossy(
            &chunks.next().await.unwrap().unwrap(),
        ));
    }
    let opened = ledger(&proxy, &worker).await;
    assert_prefilling(&opened);
    gated.release(1);
    while !seen.contains("response.output_text.delta") {
        seen.push_str(&String::from_utf8_lossy(
            &chunks.next().await.unwrap().unwrap(),
        ));
    }
    let decoding = ledger(&proxy, &worker).await;
    assert_decoding(&decoding);
    // Exactly the rest (two more deltas and the end), so the next stream starts gated.
    gated.release(3);
    while let Some(chunk) = chunks.next().await {
        chunk.unwrap();
    }
    wait_empty(&proxy, &worker).await;

    // The same answer asked for whole: streamed from the worker and assembled, so the prompt
    // is pending prefill through the opening events and not from the first delta on, while
    // the client still waits for the whole response.
    let whole = ask_whole(
        &client,
        format!("{}/v1/responses", proxy.url()),
        json!({"model": "gated", "max_output_tokens": 64, "input": input}),
    );
    wait_received(&gated, 2).await;
    // (the opening events go out ungated: give them time to arrive)
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let opened = ledger(&proxy, &worker).await;
    assert_eq!((opened.prefills, opened.in_flight), (1, 1), "{opened:?}");
    gated.release(1);
    let decoding = wait_ledger(&proxy, &worker, |now| now.prefills == 0).await;
    assert_decoding(&decoding);
    assert!(!whole.is_finished());
    gated.release(3);
    let (status, answer) = whole.await.unwrap();
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["model"], "gated");
    assert_eq!(
        answer["output"][0]["content"][0]["text"],
        "gated-0 gated-1 gated-2 "
    );
    wait_empty(&proxy, &worker).await;

    // A streamed request: before its first token the prompt is pending prefill...
    let response = client
        .post(&url)
        .json(&body("gated", true))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    wait_received(&gated, 1).await;
    let before = ledger(&proxy, &worker).await;
    assert_prefilling(&before);
    // The worker has been on it since it was sent (what other replicas take as done).
    assert!(before.prefill_elapsed_us > 0, "{before:?}");
    // Uncached prompt and 64 output tokens in blocks of 64.
    assert!(before.kv_blocks >= 2, "{before:?}");
    // ...and at its first token it is not, while the request still decodes and holds its blocks.
    let mut chunks = response.bytes_stream();
    gated.release(1);
    let first = chunks.next().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("gated-0"));
    let decoding = ledger(&proxy, &worker).await;
    assert_eq!(
        decoding,
        Ledger {
            prefills: 0,
            prefill_tokens: 0,
            in_flight: 1,
            kv_blocks: before.kv_blocks,
            prefill_elapsed_us: 0,
        }
    );
    // Its client goes away mid-stream (the worker's stream, still gated, is dropped with it):
    // the decoding request and its blocks are released too. (The Responses stream above and
    // the paths below stream to the end.)
    drop(chunks);
    wait_empty(&proxy, &worker).await;

    // A non-streamed request: the gateway asks the worker for a stream (with usage) and
    // assembles the answer, so the prompt is pending prefill until the worker's first token,
    // although the client sees nothing before the whole answer...
    let whole = ask_whole(&client, url.clone(), body("gated", false));
    wait_received(&gated, 4).await;
    let sent = gated.received().last().unwrap().json();
    assert_eq!(
        (&sent["stream"], &sent["stream_options"]["include_usage"]),
        (&json!(true), &json!(true))
    );
    let before = ledger(&proxy, &worker).await;
    assert_prefilling(&before);
    gated.release(1);
    let decoding = wait_ledger(&proxy, &worker, |now| now.prefills == 0).await;
    assert_decoding(&decoding);
    assert_eq!(decoding.kv_blocks, before.kv_blocks);
    assert!(!whole.is_finished());
    // ...and gets it whole, in its own API's shape, named as it asked, with usage.
    gated.release(4);
    let (status, answer) = whole.await.unwrap();
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["object"], "chat.completion");
    assert_eq!(answer["model"], "gated");
    assert_eq!(
        answer["choices"][0]["message"]["content"],
        "gated-0 gated-1 gated-2 "
    );
    assert_eq!(answer["choices"][0]["finish_reason"], "stop");
    assert_eq!(answer["usage"]["completion_tokens"], 3);
    wait_empty(&proxy, &worker).await;

    // A worker answering 503 and one refusing connections, then the provider; and a retry
    // inside a pool after an unreachable worker (or none needed): streamed and not, every
    // worker tried ends with an empty ledger.
    let paths = [
        ("falls-back", "cloud", [failing.endpoint(), dead.clone()]),
        ("retried", "healthy", [dead.clone(), healthy.endpoint()]),
    ];
    for (model, answered_by, tried) in &paths {
        for stream in [true, false] {
            let response = client
                .post(&url)
                .json(&body(model, stream))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200);
            let text = response.text().await.unwrap();
            assert!(text.contains(answered_by), "{text}");
            for worker in tried {
                wait_empty(&proxy, worker).await;
            }
        }
    }
    assert_eq!(cloud.received().len(), 2);
}

#[tokio::test]
async fn a_worker_that_falls_silent_or_breaks_mid_stream_leaves_nothing_counted() {
    // A worker that accepts requests and then says nothing more, before or after its first
    // token; the proxy gives up after a second of silence (`--upstream-read-timeout-s`). And
    // one whose connection breaks after its first event, as when a worker crashes.
    let silent = three_chunks("silent", true).await;
    let breaking = Upstream::start_with(
        "breaking",
        UpstreamOptions {
            break_after: Some(1),
            ..three_chunks_options(false)
        },
    )
    .await;
    let erring = Upstream::start_with(
        "erring",
        UpstreamOptions {
            error_after: Some(1),
            ..three_chunks_options(false)
        },
    )
    .await;
    let held = Upstream::start_with(
        "held",
        UpstreamOptions {
            gated_whole: true,
            ..Default::default()
        },
    )
    .await;
    let config = format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: silent}}\nspec: {{model: m, endpoints: [\"{}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: breaking}}\nspec: {{model: m, endpoints: [\"{}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: erring}}\nspec: {{model: m, endpoints: [\"{}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: silent}}\nspec: {{modelName: silent, targets: [{{pool: silent}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: breaking}}\nspec: {{modelName: breaking, targets: [{{pool: breaking}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: erring}}\nspec: {{modelName: erring, targets: [{{pool: erring}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: held}}\nspec: {{model: m, endpoints: [\"{}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: held}}\nspec: {{modelName: held, targets: [{{pool: held}}]}}\n",
        silent.endpoint(),
        breaking.endpoint(),
        erring.endpoint(),
        held.endpoint()
    );
    let proxy = Proxy::start(&config, &["--upstream-read-timeout-s", "1"]).await;
    let worker = silent.endpoint();
    let url = format!("{}/v1/chat/completions", proxy.url());
    let client = reqwest::Client::new();
    // The whole exchange, whatever the client sees of it, ends: as a 504, or as a stream cut.
    let finish = |response: reqwest::Response| async move {
        let mut chunks = response.bytes_stream();
        while let Some(Ok(_)) = chunks.next().await {}
    };

    // Silent before the first token: the prompt was pending prefill until the timeout.
    let before = tokio::spawn({
        let (client, url) = (client.clone(), url.clone());
        async move { client.post(&url).json(&body("silent", true)).send().await }
    });
    wait_received(&silent, 1).await;
    assert_eq!(ledger(&proxy, &worker).await.prefills, 1);
    let response = tokio::time::timeout(std::time::Duration::from_secs(10), before)
        .await
        .expect("the proxy gives up on a silent worker")
        .unwrap();
    if let Ok(response) = response {
        assert!(
            response.status() == 504 || response.status() == 200,
            "{}",
            response.status()
        );
        finish(response).await;
    }
    wait_empty(&proxy, &worker).await;

    // Silent after its first token: the request was decoding until the timeout.
    let response = client
        .post(&url)
        .json(&body("silent", true))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut chunks = response.bytes_stream();
    silent.release(1);
    chunks.next().await.unwrap().unwrap();
    let decoding = ledger(&proxy, &worker).await;
    assert_eq!((decoding.prefills, decoding.in_flight), (0, 1));
    let mut rest = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while let Some(Ok(chunk)) = chunks.next().await {
            rest.extend_from_slice(&chunk);
        }
    })
    .await
    .expect("the proxy ends a stream whose worker fell silent");
    // ... with a timeout error in the client's API.
    let rest = String::from_utf8_lossy(&rest);
    assert!(
        rest.contains("\"code\":\"upstream_timeout\"") && rest.ends_with("data: [DONE]\n\n"),
        "{rest}"
    );
    wait_empty(&proxy, &worker).await;

    // A worker whose connection breaks after its first event: the client's stream ends with
    // an error event in its API (vLLM's error chunk, then `[DONE]`) short of the answer's end,
    // and the request leaves nothing counted.
    let response = client
        .post(&url)
        .json(&body("breaking", true))
        .send()
        .await
        .unwrap();
    let status = response.status();
    let mut seen = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        let mut chunks = response.bytes_stream();
        while let Some(Ok(chunk)) = chunks.next().await {
            seen.extend_from_slice(&chunk);
        }
    })
    .await
    .expect("a broken worker's stream ends");
    assert_eq!(breaking.received().len(), 1);
    let seen = String::from_utf8_lossy(&seen);
    if status == 200 {
        let events: Vec<&str> = seen.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(events.len(), 3, "{seen}");
        let error: serde_json::Value =
            serde_json::from_str(events[1].trim_start_matches("data: ")).unwrap();
        assert_eq!(error["error"]["code"], "upstream_error", "{seen}");
        assert_eq!(events[2], "data: [DONE]");
    } else {
        // The break came before the proxy sent the status: a 502 in the client's format.
        assert_eq!(status, 502, "{seen}");
        let error: serde_json::Value = serde_json::from_str(&seen).unwrap();
        assert_eq!(error["error"]["code"], "upstream_error", "{seen}");
    }
    wait_empty(&proxy, &breaking.endpoint()).await;

    // A whole answer the gateway assembles from a stream that breaks, or that ends in vLLM's
    // error event: no answer. An error when no status went out yet (a 502 in the client's
    // format), else the client's connection is cut (as when a worker fails a whole answer
    // half-sent); nothing counted either way.
    for (upstream, model) in [(&breaking, "breaking"), (&erring, "erring")] {
        let result = tokio::time::timeout(std::time::Duration::from_secs(10), async {
            let response = client.post(&url).json(&body(model, false)).send().await?;
            let status = response.status();
            Ok::<_, reqwest::Error>((status, response.json::<serde_json::Value>().await?))
        })
        .await
        .expect("a failed assembly ends");
        if let Ok((status, answer)) = &result {
            assert!(
                status.is_server_error() && answer["error"]["message"].is_string(),
                "{model}: {status} {answer}"
            );
        }
        wait_empty(&proxy, &upstream.endpoint()).await;
    }
    assert_eq!(erring.received().len(), 1);
    // The answer the worker failed after its 200 counts as the worker's error, not a success.
    let metrics = proxy.metrics().await;
    let counted = |outcome: &str| {
        metrics.lines().any(|line| {
            line.starts_with("switchyard_tenant_requests_total{")
                && line.contains("model=\"erring\"")
                && line.contains(&format!("outcome=\"{outcome}\""))
                && line.ends_with(" 1")
        })
    };
    assert!(counted("upstream_error"), "{metrics}");
    assert!(!counted("success"), "{metrics}");

    // A worker that falls silent on a pooled connection is not sent the request again: a read
    // timeout says nothing of whether it is working on it (only a connection it had closed
    // does). Whole answers with logprobs (not assembled from a stream) wait for their head
    // there; the first, let through, leaves a keep-alive connection the second goes out on.
    let whole = || {
        let mut whole = body("held", false);
        whole["logprobs"] = json!(true);
        whole
    };
    held.release(1);
    let response = client.post(&url).json(&whole()).send().await.unwrap();
    assert_eq!(response.status(), 200);
    response.bytes().await.unwrap();
    let chats = || {
        held.received()
            .iter()
            .filter(|r| r.path == "/v1/chat/completions")
            .count()
    };
    assert_eq!(chats(), 1);
    let response = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        client.post(&url).json(&whole()).send(),
    )
    .await
    .expect("the proxy gives up on a silent worker")
    .unwrap();
    assert_eq!(response.status(), 504);
    assert_eq!(chats(), 2, "sent once");
    wait_empty(&proxy, &held.endpoint()).await;
}

/// The routing figures `proxy` would use for `worker` now (`/debug/route`, nothing sent).
async fn scored(proxy: &Proxy, worker: &str) -> (u64, u64) {
    let explained = proxy.debug_route(None, &body("gated", true)).await;
    let score = explained["scores"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["worker"] == worker)
        .cloned()
        .unwrap_or_else(|| panic!("{worker} not scored: {explained}"));
    (
        score["queued_tokens"].as_u64().unwrap(),
        score["running"].as_u64().unwrap(),
    )
}

/// Wait until `proxy` sees `wanted` (queued tokens, running) at `worker`.
async fn wait_scored(proxy: &Proxy, worker: &str, wanted: impl Fn((u64, u64)) -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let now = scored(proxy, worker).await;
        if wanted(now) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "{worker}: {now:?}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Two replicas with `config`, peers of each other, sharing a key. They push their ledgers at
/// every change; the interval (a minute here) only repeats an unchanged one, so whatever a test
/// sees of the other replica came through pushes. The first names no replica that runs, only
/// their host: it learns of the second's port from the datagram the second sends when it
/// starts, to the first's operator port (and to a port nobody listens on).
async fn two_replicas(config: &str) -> (Proxy, Proxy) {
    two_replicas_with(config, &[]).await
}

/// [`two_replicas`], both started with `extra` flags too.
async fn two_replicas_with(config: &str, extra: &[&str]) -> (Proxy, Proxy) {
    let key = key_file("the two replicas' shared secret");
    let key = key.path().to_str().unwrap();
    let minute = "60000";
    let args = |peers: &str| -> Vec<String> {
        let mut args: Vec<String> = [
            "--peers",
            peers,
            "--peer-interval-ms",
            minute,
            "--peers-key-file",
            key,
        ]
        .map(str::to_owned)
        .into();
        args.extend(extra.iter().map(|arg| (*arg).to_owned()));
        args
    };
    let first_args = args("127.0.0.1:1");
    let first_args: Vec<&str> = first_args.iter().map(String::as_str).collect();
    let first = Proxy::start(config, &first_args).await;
    let peers = format!(
        "{},127.0.0.1:1",
        first.admin_url().trim_start_matches("http://")
    );
    let second_args = args(&peers);
    let second_args: Vec<&str> = second_args.iter().map(String::as_str).collect();
    let second = Proxy::start(config, &second_args).await;
    // (The key is read at start: the file may go.)
    (first, second)
}

/// A key file holding `secret` and a newline, as `echo` writes one.
fn key_file(secret: &str) -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), format!("{secret}\n")).unwrap();
    file
}

/// `switchyard_peer_datagrams_total{outcome}` of `proxy` (0 before the first such datagram).
async fn datagrams(proxy: &Proxy, outcome: &str) -> u64 {
    peer_count(proxy, "switchyard_peer_datagrams", outcome).await
}

/// `switchyard_peer_prompt_pieces_total{outcome}` of `proxy` (0 before the first).
async fn prompt_pieces(proxy: &Proxy, outcome: &str) -> u64 {
    peer_count(proxy, "switchyard_peer_prompt_pieces", outcome).await
}

/// `{family}_total{outcome}` of `proxy`, a counter family it always exports (0 before the
/// first count).
async fn peer_count(proxy: &Proxy, family: &str, outcome: &str) -> u64 {
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains(&format!("# TYPE {family} counter")),
        "{metrics}"
    );
    let series = format!("{family}_total{{outcome=\"{outcome}\"}} ");
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(series.as_str()))
        .map_or(0, |value| value.parse().unwrap())
}

/// A gated worker (it answers only when released) and a config of one pool of it, model
/// `gated`. A prefill token costs 0.1 s here, so the worker is taken to do a few of the
/// prompt's hundreds of tokens while a test waits (the gated worker never answers, whatever the
/// model predicts).
async fn gated_pool() -> (Upstream, String) {
    let gated = Upstream::start_with(
        "gated",
        UpstreamOptions {
            gated: true,
            ..Default::default()
        },
    )
    .await;
    let config = format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: gated}}\nspec: {{model: m, scoring: {{prefillMicrosPerToken: 100000}}, endpoints: [\"{}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: gated}}\nspec: {{modelName: gated, targets: [{{pool: gated}}]}}\n",
        gated.endpoint()
    );
    (gated, config)
}

#[tokio::test]
async fn a_replica_counts_another_replicas_requests_like_its_own() {
    let (gated, config) = gated_pool().await;
    let (first, second) = two_replicas(&config).await;
    let worker = gated.endpoint();
    assert_eq!(scored(&second, &worker).await, (0, 0));

    // A request through the first replica, before its first token: the second sees its prompt
    // queued at the worker although it sent nothing there itself...
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", first.url()))
        .json(&body("gated", true))
        .send()
        .await
        .unwrap();
    wait_received(&gated, 1).await;
    let pending = ledger(&first, &worker).await.prefill_tokens;
    assert!(pending > 100);
    // (less the little the worker is taken to have done since the first replica sent it: the
    // first exports how long the worker has been on it, and the second adds the time since)
    wait_scored(&second, &worker, |(queued, _)| {
        queued > pending / 2 && queued <= pending
    })
    .await;
    let elapsed = ledger(&first, &worker).await.prefill_elapsed_us;
    assert!(elapsed > 0);
    // ...then, past its first token, a request decoding there...
    let mut chunks = response.bytes_stream();
    gated.release(1);
    chunks.next().await.unwrap().unwrap();
    wait_scored(&second, &worker, |seen| seen == (0, 1)).await;
    // ...and nothing once it ended.
    gated.release(16);
    while let Some(chunk) = chunks.next().await {
        chunk.unwrap();
    }
    wait_scored(&second, &worker, |seen| seen == (0, 0)).await;
    assert_eq!(ledger(&second, &worker).await, Ledger::default());
}

#[tokio::test]
async fn a_replica_hears_only_the_replicas_that_share_its_key() {
    let (gated, config) = gated_pool().await;
    let worker = gated.endpoint();
    let (first, second) = two_replicas(&config).await;
    // A third process on the same host sends the first its ledger under another key, as a pod
    // of another team that forged one would (or a replica left with an old key).
    let other_key = key_file("another fleet's shared secret");
    let intruder = Proxy::start(
        &config,
        &[
            "--peers",
            first.admin_url().trim_start_matches("http://"),
            "--peer-interval-ms",
            "60000",
            "--peers-key-file",
            other_key.path().to_str().unwrap(),
        ],
    )
    .await;
    let refused = datagrams(&first, "unauthenticated").await;
    let client = reqwest::Client::new();
    let send = |proxy: &Proxy| {
        client
            .post(format!("{}/v1/chat/completions", proxy.url()))
            .json(&body("gated", true))
            .send()
    };
    // Its request, prefilling at the worker, is sent to the first at once and dropped there...
    let intruded = send(&intruder).await.unwrap();
    wait_received(&gated, 1).await;
    wait_ledger(&intruder, &worker, |l| l.prefills == 1).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while datagrams(&first, "unauthenticated").await <= refused {
        assert!(std::time::Instant::now() < deadline, "no datagram refused");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(scored(&first, &worker).await, (0, 0));
    // ...while the second's, under the shared key, counts there as before.
    let shared = send(&second).await.unwrap();
    wait_received(&gated, 2).await;
    let pending = wait_ledger(&second, &worker, |l| l.prefills == 1)
        .await
        .prefill_tokens;
    wait_scored(&first, &worker, |(queued, running)| {
        queued > pending / 2 && queued <= pending && running <= 1
    })
    .await;
    assert!(datagrams(&first, "heard").await > 0);
    let (queued, _) = scored(&first, &worker).await;
    assert!(
        queued <= pending,
        "{queued} of {pending}: the intruder's counted"
    );
    gated.release(64);
    for response in [intruded, shared] {
        response.bytes().await.unwrap();
    }
}

/// How many leading blocks of `body`'s prompt `proxy` takes `worker` to hold (`/debug/route`).
async fn matched_at(proxy: &Proxy, body: &serde_json::Value, worker: &str) -> u64 {
    let explained = proxy.debug_route(None, body).await;
    explained["scores"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["worker"] == worker)
        .and_then(|s| s["matched_blocks"].as_u64())
        .unwrap_or_else(|| panic!("{worker} not scored: {explained}"))
}

/// Two workers that publish no KV events (`gated`: they answer only when released), one
/// and two, behind two replicas (both started with `extra` flags too) in one pool `pair`.
async fn pair_behind_two_replicas(
    gated: bool,
    extra: &[&str],
) -> (Upstream, Upstream, Proxy, Proxy) {
    let (one, two) = (
        three_chunks("one", gated).await,
        three_chunks("two", gated).await,
    );
    let (first, second) = two_replicas_with(&pair_config(&one, &two), extra).await;
    (one, two, first, second)
}

/// One pool `pair` of the workers `one` and `two` (blocks of 16 tokens), model `pair`.
fn pair_config(one: &Upstream, two: &Upstream) -> String {
    format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: pair}}\nspec: {{model: m, blockSize: 16, endpoints: [\"{}\", \"{}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: pair}}\nspec: {{modelName: pair, targets: [{{pool: pair}}]}}\n",
        one.endpoint(),
        two.endpoint()
    )
}

/// `body` posted to `proxy`'s chat completions.
async fn post_chat(proxy: &Proxy, body: &serde_json::Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .json(body)
        .send()
        .await
        .unwrap()
}

/// A system prompt of about a thousand tokens, far longer than the head a prompt nobody holds
/// is first known by.
fn handbook() -> String {
    "Answer as the handbook of the switchyard says, citing the numbers of its rules. ".repeat(70)
}

/// A streamed chat with model `pair`: `question` after `system`.
fn pair_chat(system: &str, question: &str) -> serde_json::Value {
    json!({"model": "pair", "stream": true, "max_tokens": 8, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": question}]})
}

#[tokio::test]
async fn a_replica_follows_a_prefix_another_replica_had_a_worker_without_events_prefill() {
    // Two workers that publish no KV events: what one replica sent where, the other can learn
    // only from that replica.
    let (one, two, first, second) = pair_behind_two_replicas(true, &[]).await;
    let system = handbook();
    let chat = |question: &str| pair_chat(&system, question);
    let probe = chat("What does rule 7 say?");
    for worker in [one.endpoint(), two.endpoint()] {
        assert_eq!(matched_at(&second, &probe, &worker).await, 0);
    }

    // A request through the first replica, before its first token...
    let response = post_chat(&first, &chat("What does rule 1 say?")).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while one.received().len() + two.received().len() == 0 {
        assert!(std::time::Instant::now() < deadline, "nothing sent");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let (holder, other) = if one.received().is_empty() {
        (&two, &one)
    } else {
        (&one, &two)
    };
    // ...the second replica knows where its whole system prompt will be, not only its head
    // (16 blocks), to within a sample of four blocks, and that the other worker holds none of it.
    let system_blocks = switchyard_kv::tokenize::PromptTokenizer::shipped()
        .unwrap()
        .encode(&system)
        .unwrap()
        .len() as u64
        / 16;
    assert!(system_blocks > 40, "{system_blocks}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let matched = matched_at(&second, &probe, &holder.endpoint()).await;
        if matched + 4 > system_blocks {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the second replica places {matched} blocks at {}",
            holder.endpoint()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(matched_at(&second, &probe, &other.endpoint()).await, 0);
    // The first replica tokenized the whole prompt and sent its pieces along: the second
    // looked its own up rather than tokenizing the system prompt again.
    // (It had tokenized the head of its probe, the first few pieces, before.)
    let sent = prompt_pieces(&first, "sent").await;
    let adopted = prompt_pieces(&second, "adopted").await;
    let known = prompt_pieces(&second, "known").await;
    assert!(
        sent >= 8 && adopted >= sent / 2 && adopted + known == sent,
        "{sent} sent, {adopted} adopted, {known} known"
    );

    // Past the first token a worker's KV events would tell where the prompt is; these publish
    // none, so the first replica goes on telling while the request runs...
    let mut chunks = response.bytes_stream();
    holder.release(1);
    chunks.next().await.unwrap().unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(matched_at(&second, &probe, &holder.endpoint()).await + 4 > system_blocks);
    holder.release(16);
    while let Some(chunk) = chunks.next().await {
        chunk.unwrap();
    }
    // ...and once it ended, tells of its end: the second replica assumes the worker holds the
    // prompt as the first does (in its own history of that worker's cache, from the samples).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while assumed_blocks(&second).await < system_blocks {
        assert!(std::time::Instant::now() < deadline, "the end not told");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(assumed_blocks(&first).await >= system_blocks);
    assert!(matched_at(&second, &probe, &holder.endpoint()).await + 4 > system_blocks);
    assert_eq!(matched_at(&second, &probe, &other.endpoint()).await, 0);
}

#[tokio::test]
async fn replicas_with_prompt_pieces_off_share_their_ledgers_and_no_prompt_content() {
    let (one, two, first, second) =
        pair_behind_two_replicas(false, &["--peer-prompt-pieces", "false"]).await;
    let system = handbook();
    let chat = |question: &str| pair_chat(&system, question);
    let response = post_chat(&first, &chat("What does rule 1 say?")).await;
    assert_eq!(response.status(), 200);
    response.bytes().await.unwrap();
    let holder = if one.received().is_empty() {
        &two
    } else {
        &one
    };
    // The second replica learns where the prompt went (the end at a worker without KV events
    // travels in the ledger) ...
    let probe = chat("What does rule 7 say?");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while matched_at(&second, &probe, &holder.endpoint()).await < 40 {
        assert!(std::time::Instant::now() < deadline, "the end not told");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // ... and tokenized it itself: no piece went either way.
    for proxy in [&first, &second] {
        for outcome in ["sent", "adopted", "known", "unused"] {
            assert_eq!(prompt_pieces(proxy, outcome).await, 0, "{outcome}");
        }
    }
}

/// Blocks `proxy` assumes the workers of the pool `pair` hold (they publish no KV events).
async fn assumed_blocks(proxy: &Proxy) -> u64 {
    proxy
        .metrics()
        .await
        .lines()
        .find_map(|l| l.strip_prefix("switchyard_kv_assumed_blocks{pool=\"default/pair\"} "))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}
