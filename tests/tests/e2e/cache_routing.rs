//! Cache-aware routing end to end: the real proxy subscribed to simulated vLLM workers' KV events
//! follows where a prompt's prefix is cached; and the event stream's gaps, replays and restarts.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{Value, json};
use switchyard_e2e::{Proxy, Sim, Upstream};
use switchyard_kv::events::{
    BlockStored, ExternalBlockHash, HashEncoding, KvEvent, KvEventBatch, REPLAY_END_SEQ,
    WireFormat, encode_batch,
};
use switchyard_kv::tokenize::{PromptTokenizer, openai_messages};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

fn system_prompt() -> String {
    (0..40)
        .map(|i| format!("Rule {i}: answer precisely and cite section {}. ", i * 7))
        .collect()
}

fn chat(model: &str, system: &str, question: &str) -> Value {
    json!({"model": model, "max_tokens": 2, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": question},
    ]})
}

/// The routing the proxy would do for `body`, without sending it.
async fn explain(proxy: &Proxy, body: &Value) -> Value {
    proxy.debug_route(None, body).await
}

/// One figure of `worker`'s score in an explanation (0 when the worker is not scored).
fn score(explained: &Value, worker: &str, field: &str) -> u64 {
    explained["scores"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["worker"] == worker)
        .map_or(0, |s| s[field].as_u64().unwrap())
}

fn matched(explained: &Value, worker: &str) -> u64 {
    score(explained, worker, "matched_blocks")
}

/// Poll until `condition` holds for the proxy's explanation of `body`.
async fn wait_for(
    proxy: &Proxy,
    body: &Value,
    what: &str,
    condition: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let explained = explain(proxy, body).await;
        if condition(&explained) {
            return explained;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; last: {explained}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Send straight to a worker, bypassing the proxy.
async fn send_direct(worker: &str, body: &Value) {
    let response = reqwest::Client::new()
        .post(format!("http://{worker}/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
}

/// Send through the proxy; returns the worker that served it.
async fn send(proxy: &Proxy, body: &Value) -> String {
    let route = send_explained(proxy, body).await;
    route
        .split("; ")
        .find_map(|part| part.strip_prefix("chosen="))
        .unwrap()
        .to_owned()
}

/// Send through the proxy; returns its routing decision (`x-switchyard-route`).
async fn send_explained(proxy: &Proxy, body: &Value) -> String {
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", proxy.admin_url()))
        .header("x-switchyard-explain", "1")
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let route = response.headers()["x-switchyard-route"]
        .to_str()
        .unwrap()
        .to_owned();
    let _ = response.bytes().await.unwrap();
    route
}

/// `explained` (a probe under `system`) chose `warm` for its cache, and so do four requests
/// sharing the prefix.
async fn follow(proxy: &Proxy, explained: &Value, system: &str, warm: &str) {
    assert_eq!(explained["chosen"], warm, "{explained}");
    assert_eq!(explained["outcome"], "CacheHit", "{explained}");
    for i in 1..5 {
        let body = chat("default", system, &format!("question {i}"));
        // The request before ends in the proxy just after its client has the last byte: until
        // then it counts on the warm worker (on a loaded machine, long enough to be seen).
        wait_for(proxy, &body, "the request before to end", |e| {
            score(e, warm, "in_flight") == 0
        })
        .await;
        let route = send_explained(proxy, &body).await;
        assert!(route.contains(&format!("chosen={warm};")), "{route}");
    }
}

/// Three fast simulated workers of 96 16-token blocks (and `extra` flags), and a proxy with one
/// cache-aware pool of them.
async fn small_fleet(extra: &[&str]) -> (Sim, Proxy) {
    let mut args = vec![
        "--workers",
        "3",
        "--time-scale",
        "0.01",
        "--num-blocks",
        "96",
        "--block-size",
        "16",
    ];
    args.extend_from_slice(extra);
    let sim = Sim::start(&args);
    let yaml = format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: sim}}\nspec:\n  model: {}\n  blockSize: 16\n  scrapeIntervalMs: 100\n  endpoints: [{}]\n{}",
        sim.model,
        sim.endpoints_yaml(),
        switchyard_e2e::model_doc("default", "sim", None)
    );
    let proxy = Proxy::start(&yaml, &[]).await;
    (sim, proxy)
}

/// One simulated worker with 16-token blocks, its time 100x faster.
fn one_worker_of_16_token_blocks() -> Sim {
    Sim::start(&[
        "--workers",
        "1",
        "--time-scale",
        "0.01",
        "--block-size",
        "16",
    ])
}

/// vLLM started with another `--block-size` than the pool's `blockSize`: its events cannot be
/// indexed, and the proxy says so once, naming both sizes.
#[tokio::test]
async fn a_worker_whose_blocks_are_not_the_pools_size_is_named_at_warn() {
    let sim = one_worker_of_16_token_blocks();
    let yaml = format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: sim}}\nspec:\n  model: {}\n  blockSize: 32\n  endpoints: [{}]\n{}",
        sim.model,
        sim.endpoints_yaml(),
        switchyard_e2e::model_doc("default", "sim", None)
    );
    let proxy = Proxy::start(&yaml, &[]).await;
    proxy.wait_subscribed(1).await;
    for question in ["first", "second"] {
        send(&proxy, &chat("default", &system_prompt(), question)).await;
    }
    proxy
        .wait_for_log("not the pool's size", Duration::from_secs(10))
        .await;
    let log = proxy.log();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("not the pool's size"))
        .collect();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    let warning = warnings[0];
    assert!(
        warning.contains(" WARN ")
            && warning.contains("worker_block_size=16")
            && warning.contains("pool_block_size=32"),
        "{warning}"
    );
    let metrics = proxy.metrics().await;
    let series = "switchyard_kv_malformed_events_total{pool=\"default/sim\"} ";
    let malformed: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix(series))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{metrics}"));
    assert!(malformed > 0, "{metrics}");
}

#[tokio::test]
async fn requests_follow_the_worker_that_caches_their_prefix_and_follow_it_after_eviction() {
    let (sim, proxy) = small_fleet(&[]).await;
    proxy.wait_subscribed(sim.workers.len()).await;
    let system = system_prompt();

    // Warm the prefix on whichever worker the proxy picks.
    let warm = send(&proxy, &chat("default", &system, "question 0")).await;
    let probe = chat("default", &system, "question 1");
    let explained = wait_for(&proxy, &probe, "the index to learn the warm prefix", |e| {
        matched(e, &warm) >= 10
    })
    .await;
    // Requests sharing the prefix go to that worker.
    follow(&proxy, &explained, &system, &warm).await;

    // The worker evicts the prefix (other prompts sent straight to it fill its 96 blocks)...
    for i in 0..8 {
        let filler: String = (0..60).map(|j| format!("filler {i} item {j}; ")).collect();
        send_direct(&warm, &chat(&sim.model, &filler, "x")).await;
    }
    wait_for(&proxy, &probe, "BlockRemoved to reach the index", |e| {
        matched(e, &warm) == 0
    })
    .await;

    // ...and once another worker holds it, requests follow it there.
    let other = sim
        .workers
        .iter()
        .map(|w| w.http.clone())
        .find(|w| *w != warm)
        .unwrap();
    send_direct(&other, &chat(&sim.model, &system, "warm elsewhere")).await;
    wait_for(&proxy, &probe, "the index to learn the new holder", |e| {
        matched(e, &other) >= 10
    })
    .await;
    assert_eq!(
        send(&proxy, &chat("default", &system, "question 9")).await,
        other
    );

    // Routing decisions and index size are exported.
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains(
            "switchyard_routing_decisions_total{pool=\"default/sim\",outcome=\"cache_hit\"}"
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains("switchyard_kv_index_blocks{pool=\"default/sim\"}"),
        "{metrics}"
    );
}

/// vLLM without `--kv-events-config`: the pool names no events, and the proxy places prompts
/// by what it had each worker prefill, within the cache size the worker reports.
#[tokio::test]
async fn without_kv_events_requests_follow_what_the_proxy_had_a_worker_prefill() {
    let (sim, proxy) = small_fleet(&["--no-kv-events"]).await;
    assert!(sim.workers.iter().all(|w| w.kv_events.is_none()));
    let system = system_prompt();
    let probe = chat("default", &system, "question 1");
    // Every worker's cache size is scraped (95 usable blocks) before the first request.
    wait_for(&proxy, &probe, "the workers' cache sizes", |e| {
        e["scores"].as_array().is_some_and(|scores| {
            scores.len() == sim.workers.len()
                && scores
                    .iter()
                    .all(|s| s["kv_blocks_free"].as_u64().is_some_and(|free| free > 0))
        })
    })
    .await;

    // Nothing is known before the first request; once it is over, its worker holds the prompt,
    // all of it: the system prompt is over 30 blocks, and a whole answer ends at its first
    // output, when only the head the prompt was routed by (16 blocks) is tokenized.
    let warm = send(&proxy, &chat("default", &system, "question 0")).await;
    // (The request ends in the proxy just after its client has the last byte.)
    let explained = wait_for(&proxy, &probe, "the whole prompt to be assumed held", |e| {
        matched(e, &warm) >= 28
    })
    .await;
    for worker in sim.workers.iter().filter(|w| w.http != warm) {
        assert_eq!(matched(&explained, &worker.http), 0, "{explained}");
    }
    follow(&proxy, &explained, &system, &warm).await;
    let metrics = proxy.metrics().await;
    let assumed = metrics
        .lines()
        .find_map(|l| l.strip_prefix("switchyard_kv_assumed_blocks{pool=\"default/sim\"} "))
        .and_then(|v| v.parse::<u64>().ok());
    assert!(assumed.is_some_and(|blocks| blocks >= 10), "{metrics}");

    // Other prompts the proxy has that worker prefill (over 20 blocks each), past its 95
    // blocks, push the oldest out: the warm prefix was last used before all of them.
    let mut fillers_on_warm = 0;
    for i in 0..200 {
        let filler: String = (0..60).map(|j| format!("filler {i} item {j}; ")).collect();
        if send(&proxy, &chat("default", &filler, "x")).await == warm {
            fillers_on_warm += 1;
            if fillers_on_warm == 8 {
                break;
            }
        }
    }
    assert_eq!(fillers_on_warm, 8);
    wait_for(
        &proxy,
        &probe,
        "the warm prefix to be assumed evicted",
        |e| matched(e, &warm) < 10,
    )
    .await;
}

/// A KV-event publisher under the test's control, encoding exactly as vLLM does.
struct Publisher {
    socket: zeromq::PubSocket,
    endpoint: String,
    replay_endpoint: String,
    /// What the replay socket can serve.
    buffer: Arc<Mutex<BTreeMap<u64, Bytes>>>,
    next_seq: u64,
}

impl Publisher {
    async fn start() -> Publisher {
        let mut socket = zeromq::PubSocket::new();
        let endpoint = socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let mut router = zeromq::RouterSocket::new();
        let replay_endpoint = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let buffer: Arc<Mutex<BTreeMap<u64, Bytes>>> = Arc::default();
        let served = buffer.clone();
        tokio::spawn(async move {
            while let Ok(request) = router.recv().await {
                let frames = request.into_vec();
                let identity = frames[0].clone();
                let start = u64::from_be_bytes(frames[2][..8].try_into().unwrap());
                let batches: Vec<(u64, Bytes)> = served
                    .lock()
                    .unwrap()
                    .range(start..)
                    .map(|(s, p)| (*s, p.clone()))
                    .collect();
                for (seq, payload) in batches {
                    let reply = vec![
                        identity.clone(),
                        Bytes::new(),
                        Bytes::new(),
                        Bytes::copy_from_slice(&seq.to_be_bytes()),
                        payload,
                    ];
                    router
                        .send(ZmqMessage::try_from(reply).unwrap())
                        .await
                        .unwrap();
                }
                let end = vec![
                    identity,
                    Bytes::new(),
                    Bytes::new(),
                    Bytes::copy_from_slice(&REPLAY_END_SEQ.to_be_bytes()),
                    Bytes::new(),
                ];
                router
                    .send(ZmqMessage::try_from(end).unwrap())
                    .await
                    .unwrap();
            }
        });
        Publisher {
            socket,
            endpoint,
            replay_endpoint,
            buffer,
            next_seq: 0,
        }
    }

    /// Buffer the next batch for replay and, when `live`, publish it.
    async fn publish(&mut self, events: Vec<KvEvent>, live: bool) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        let batch = KvEventBatch {
            ts: 0.0,
            events,
            data_parallel_rank: Some(0),
        };
        let payload = Bytes::from(encode_batch(&batch, WireFormat::Tagged, HashEncoding::Int));
        self.buffer.lock().unwrap().insert(seq, payload.clone());
        if live {
            let frames = vec![
                Bytes::new(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ];
            self.socket
                .send(ZmqMessage::try_from(frames).unwrap())
                .await
                .unwrap();
        }
        seq
    }

    /// A publisher restart: numbering starts over and the old batches are gone.
    fn restart(&mut self) {
        self.next_seq = 0;
        self.buffer.lock().unwrap().clear();
    }
}

/// BlockStored for every full 16-token block of the rendered chat prompt.
fn stored(tokenizer: &PromptTokenizer, body: &Value, first_hash: u64) -> KvEvent {
    let tokens = tokenizer.encode_chat(&openai_messages(body)).unwrap();
    let blocks = tokens.len() / 16;
    KvEvent::BlockStored(BlockStored {
        block_hashes: (0..blocks as u64)
            .map(|i| ExternalBlockHash(first_hash + i))
            .collect(),
        parent_block_hash: None,
        token_ids: tokens[..blocks * 16].to_vec(),
        block_size: 16,
        medium: Some("GPU".into()),
        ..Default::default()
    })
}

#[tokio::test]
async fn event_gaps_are_replayed_or_cleared_and_restarts_reset_the_worker() {
    let worker = Upstream::start("w").await;
    let mut publisher = Publisher::start().await;
    let yaml = format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: p}}\nspec:\n  model: m\n  blockSize: 16\n  endpoints: [{{address: \"{}\", kvEvents: \"{}\", kvReplay: \"{}\"}}]\n{}",
        worker.endpoint(),
        publisher.endpoint,
        publisher.replay_endpoint,
        switchyard_e2e::model_doc("m", "p", None)
    );
    let proxy = Proxy::start(&yaml, &[]).await;
    let address = worker.endpoint();
    let tokenizer = PromptTokenizer::shipped().unwrap();
    let first = chat("m", &system_prompt(), "first");
    let second = chat(
        "m",
        &format!("Another system prompt. {}", system_prompt()),
        "second",
    );

    // Batch 0 may go out before the proxy has subscribed (lost, like vLLM's slow joiner); then the
    // first live batch it sees is above 0 and it replays from 0. Either way batch 0 must arrive.
    publisher
        .publish(vec![stored(&tokenizer, &first, 1_000)], true)
        .await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        publisher.publish(vec![], true).await;
        if matched(&explain(&proxy, &first).await, &address) >= 10 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "batch 0 never recovered through replay"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A batch missed in the middle of the stream is fetched from the replay socket.
    publisher
        .publish(vec![stored(&tokenizer, &second, 5_000)], false)
        .await;
    publisher.publish(vec![], true).await;
    wait_for(&proxy, &second, "the missed batch to be replayed", |e| {
        matched(e, &address) >= 10
    })
    .await;

    // A gap the replay buffer no longer covers: the worker's entries can't be trusted and go.
    let lost = publisher
        .publish(vec![KvEvent::AllBlocksCleared], false)
        .await;
    publisher.buffer.lock().unwrap().remove(&lost);
    publisher.publish(vec![], true).await;
    wait_for(
        &proxy,
        &first,
        "the unfillable gap to clear the worker",
        |e| matched(e, &address) == 0,
    )
    .await;
    assert_eq!(matched(&explain(&proxy, &second).await, &address), 0);

    // Rebuild, then restart the publisher: sequence numbers start over and old entries go.
    publisher
        .publish(vec![stored(&tokenizer, &first, 9_000)], true)
        .await;
    wait_for(&proxy, &first, "the new store", |e| {
        matched(e, &address) >= 10
    })
    .await;
    publisher.restart();
    publisher
        .publish(vec![stored(&tokenizer, &second, 20_000)], true)
        .await;
    wait_for(&proxy, &second, "events after the restart", |e| {
        matched(e, &address) >= 10
    })
    .await;
    assert_eq!(
        matched(&explain(&proxy, &first).await, &address),
        0,
        "entries from before the restart were dropped"
    );

    let metrics = proxy.metrics().await;
    let value = |name: &str| -> f64 {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing:\n{metrics}"))
    };
    // The mid-stream gap was replayed (the start-up one only when batch 0 was missed live).
    assert!(value("switchyard_kv_event_gaps_replayed_total") >= 1.0);
    assert!(value("switchyard_kv_event_gaps_cleared_total") >= 1.0);
    assert!(value("switchyard_kv_publisher_restarts_total") >= 1.0);
}

/// The worker's queued prefill as the scorer sees it.
fn queued(explained: &Value, worker: &str) -> u64 {
    score(explained, worker, "queued_tokens")
}

#[tokio::test]
async fn a_streamed_requests_prefill_leaves_the_queue_at_its_first_token() {
    use futures_util::StreamExt;
    // A worker whose stream is held chunk by chunk, so the test decides when the first token
    // comes and the request stays open after it.
    let worker = Upstream::start_with(
        "w1",
        switchyard_e2e::UpstreamOptions {
            stream_chunks: Some(3),
            gated: true,
            ..Default::default()
        },
    )
    .await;
    let proxy = Proxy::start(
        &switchyard_e2e::pool_config("p", "m", &[worker.endpoint()], "", &["m"]),
        &[],
    )
    .await;
    let probe = chat("m", "short", "who?");
    assert_eq!(
        queued(&explain(&proxy, &probe).await, &worker.endpoint()),
        0
    );
    let mut body = chat("m", &system_prompt(), "a streamed question");
    body["stream"] = json!(true);
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    // Sent, no token yet: its whole prompt is queued prefill on that worker.
    let before = queued(&explain(&proxy, &probe).await, &worker.endpoint());
    assert!(
        before > 100,
        "queued prefill before the first token: {before}"
    );
    // The first token arrives; the stream stays open (two chunks still held).
    worker.release(1);
    let mut stream = response.bytes_stream();
    let first = tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .expect("the first chunk")
        .unwrap()
        .unwrap();
    assert!(!first.is_empty());
    assert_eq!(
        queued(&explain(&proxy, &probe).await, &worker.endpoint()),
        0,
        "prefill still counted after the first token"
    );
    worker.release(10);
    while stream.next().await.is_some() {}
}

/// Send as the tenant of `key`; returns the prompt tokens the worker found cached.
async fn cached_tokens_as(proxy: &Proxy, key: &str, body: &Value) -> u64 {
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let answer: Value = response.json().await.unwrap();
    answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens: {answer}"))
}

#[tokio::test]
async fn an_isolated_tenant_keeps_its_cache_to_itself_and_routing_stays_cache_aware() {
    let sim = one_worker_of_16_token_blocks();
    let worker = &sim.workers[0];
    let key = |name: &str| switchyard_e2e::key_sha256(name);
    let yaml = format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: sim}}\nspec:\n  model: {model}\n  blockSize: 16\n  scrapeIntervalMs: 100\n  endpoints: [{endpoint}]\n{doc}---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: Tenant\nmetadata: {{name: private}}\nspec: {{apiKeys: [{{sha256: {a}}}], cacheIsolation: true}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: Tenant\nmetadata: {{name: other}}\nspec: {{apiKeys: [{{sha256: {b}}}]}}\n",
        model = sim.model,
        endpoint = worker.endpoint_yaml(),
        doc = switchyard_e2e::model_doc("default", "sim", None),
        a = key("key-private"),
        b = key("key-other"),
    );
    let proxy = Proxy::start(&yaml, &[]).await;
    proxy.wait_subscribed(1).await;
    let system = system_prompt();
    let prompt = chat("default", &system, "the same question");

    // The isolated tenant's prompt is cached on the worker, and the index knows it is cached
    // for that tenant...
    assert_eq!(cached_tokens_as(&proxy, "key-private", &prompt).await, 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut resend = Instant::now() + Duration::from_secs(2);
    while matched(
        &proxy.debug_route(Some("key-private"), &prompt).await,
        &worker.http,
    ) < 10
    {
        assert!(
            Instant::now() < deadline,
            "the index never learned the salted prefix"
        );
        // The proxy may have subscribed to the worker's events just after that one batch went
        // out (a ZMQ subscriber misses what was published before it joined): the next batch
        // shows the gap and the replay fills it.
        if Instant::now() > resend {
            cached_tokens_as(&proxy, "key-private", &prompt).await;
            resend = Instant::now() + Duration::from_secs(2);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(cached_tokens_as(&proxy, "key-private", &prompt).await >= 160);

    // ...but another tenant sending the very same prompt neither sees it in the routing
    // explanation nor hits it on the worker (no timing signal either).
    assert_eq!(
        matched(
            &proxy.debug_route(Some("key-other"), &prompt).await,
            &worker.http
        ),
        0
    );
    assert_eq!(cached_tokens_as(&proxy, "key-other", &prompt).await, 0);
    // The open tenant's own repeats still share among themselves.
    assert!(cached_tokens_as(&proxy, "key-other", &prompt).await >= 160);
}
