//! Compatibility with vLLM itself: its own event classes and publisher (from the vLLM wheel), and a
//! Prometheus parser that is not ours.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{Value, json};
use switchyard_e2e::{Sim, free_port, python, run_python, workspace_root};
use switchyard_kv::events::{
    BlockRemoved, BlockStored, EventMessage, ExternalBlockHash, HashEncoding, KvEvent,
    KvEventBatch, REPLAY_END_SEQ, WireFormat, decode_batch, decode_frames, decode_seq,
    encode_batch,
};
use switchyard_loadtest::sim::kv_cache::KvCache;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// The batches of `tests/python/known_batches.py`, as our decoder must see them.
fn known_batches() -> Vec<Vec<KvEvent>> {
    let stored =
        |hashes: Vec<u64>, parent: Option<u64>, tokens: std::ops::Range<u32>| BlockStored {
            block_hashes: hashes.into_iter().map(ExternalBlockHash).collect(),
            parent_block_hash: parent.map(ExternalBlockHash),
            token_ids: tokens.collect(),
            block_size: 16,
            medium: Some("GPU".into()),
            ..Default::default()
        };
    vec![
        vec![KvEvent::BlockStored(stored(vec![1, 2], None, 0..32))],
        vec![KvEvent::BlockStored(BlockStored {
            extra_keys: Some(rmpv::Value::Array(vec![rmpv::Value::Nil])),
            group_idx: Some(0),
            kv_cache_spec_kind: Some("full_attention".into()),
            ..stored(vec![3], Some(2), 32..48)
        })],
        vec![KvEvent::BlockStored(stored(
            vec![u64::MAX - 4],
            None,
            100..116,
        ))],
        vec![KvEvent::BlockStored(BlockStored {
            lora_id: Some(5),
            lora_name: Some("sql-adapter".into()),
            ..stored(vec![9], None, 0..16)
        })],
        vec![
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![ExternalBlockHash(1), ExternalBlockHash(2)],
                medium: Some("GPU".into()),
                group_idx: None,
            }),
            KvEvent::BlockStored(stored(vec![(1 << 63) + 10], None, 200..216)),
        ],
        vec![KvEvent::AllBlocksCleared],
    ]
}

#[test]
fn vllm_encodings_decode_here_and_ours_match_them_byte_for_byte() {
    let lines = run_python("vllm_encode.py", &[]);
    let expected = known_batches();
    let mut seen = 0;
    for line in lines.lines() {
        let record: Value = serde_json::from_str(line).unwrap();
        let index = record["index"].as_u64().unwrap() as usize;
        let bytes: Vec<u8> = (0..record["hex"].as_str().unwrap().len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&record["hex"].as_str().unwrap()[i..i + 2], 16).unwrap())
            .collect();
        let batch = decode_batch(&bytes).unwrap_or_else(|e| panic!("batch {index}: {e}"));
        assert_eq!(batch.events, expected[index], "batch {index}");
        assert_eq!(batch.ts, index as f64 + 0.5);
        assert_eq!(batch.data_parallel_rank, Some(0));
        let hashes = if index == 2 {
            HashEncoding::Bytes
        } else {
            HashEncoding::Int
        };
        assert_eq!(
            encode_batch(&batch, WireFormat::Tagged, hashes),
            bytes,
            "our encoding of batch {index} differs from vLLM's"
        );
        seen += 1;
    }
    assert_eq!(seen, expected.len());
}

#[tokio::test]
async fn vllm_publisher_feeds_our_decoder_live_and_through_replay() {
    // vLLM connects its PUB to a non-wildcard endpoint, so the subscriber binds.
    let mut subscriber = zeromq::SubSocket::new();
    let bound = subscriber
        .bind("tcp://127.0.0.1:0")
        .await
        .unwrap()
        .to_string();
    subscriber.subscribe("").await.unwrap();
    let replay = format!("tcp://127.0.0.1:{}", free_port());
    let mut publisher = Command::new(python())
        .arg(workspace_root().join("tests/python/vllm_publish.py"))
        .args([&bound, &replay])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();

    // Live: every message decodes, with vLLM's topic and increasing sequence numbers. Read until
    // the last known batch has gone out: vLLM's publisher thread answers a replay request with
    // what it has sent so far, so asking earlier races its sending of the known batches.
    let known = known_batches();
    let last_known = known.len() as u64 - 1;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut live: Vec<EventMessage> = Vec::new();
    while live.len() < 3 || live.last().is_some_and(|message| message.seq < last_known) {
        assert!(
            Instant::now() < deadline,
            "no live batches from vLLM's publisher"
        );
        if let Ok(Ok(message)) =
            tokio::time::timeout(Duration::from_secs(1), subscriber.recv()).await
        {
            let message = decode_frames(&message.into_vec()).unwrap();
            assert_eq!(message.topic, Bytes::from_static(b"kv"));
            live.push(message);
        }
    }
    for window in live.windows(2) {
        assert!(window[1].seq > window[0].seq);
    }
    for message in &live {
        let expected = known
            .get(message.seq as usize)
            .cloned()
            .unwrap_or(vec![KvEvent::AllBlocksCleared]);
        assert_eq!(message.batch.events, expected, "seq {}", message.seq);
    }

    // Replay from 0 returns the early batches a late subscriber missed.
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(&replay).await.unwrap();
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&0u64.to_be_bytes()),
    ])
    .unwrap();
    dealer.send(request).await.unwrap();
    let mut replayed: Vec<KvEventBatch> = Vec::new();
    loop {
        let reply = tokio::time::timeout(Duration::from_secs(10), dealer.recv())
            .await
            .unwrap()
            .unwrap()
            .into_vec();
        assert_eq!(
            reply.len(),
            4,
            "replay replies are [empty, topic, seq, payload]"
        );
        if decode_seq(&reply[2]).unwrap() == REPLAY_END_SEQ {
            break;
        }
        let message = decode_frames(&reply[1..]).unwrap();
        assert_eq!(message.seq, replayed.len() as u64);
        replayed.push(message.batch);
    }
    assert!(replayed.len() >= known.len());
    for (index, expected) in known.iter().enumerate() {
        assert_eq!(&replayed[index].events, expected, "replayed batch {index}");
    }

    drop(publisher.stdin.take());
    let _ = publisher.wait();
}

fn chat(model: &str, text: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2})
}

#[tokio::test]
async fn simulator_events_decode_with_vllm_classes_field_by_field() {
    let sim = Sim::start(&[
        "--workers",
        "1",
        "--num-blocks",
        "12",
        "--block-size",
        "4",
        "--time-scale",
        "0.001",
    ]);
    let worker = &sim.workers[0];
    let client = reqwest::Client::new();
    let prompts = [
        "first prompt about rivers and the sea",
        "a second and quite different prompt about mountains",
    ];
    let mut token_lists = Vec::new();
    for text in prompts {
        let tokens: Value = client
            .post(format!("{}/tokenize", worker.url()))
            .json(&chat(&sim.model, text))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let tokens: Vec<u32> = tokens["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let response = client
            .post(format!("{}/v1/chat/completions", worker.url()))
            .json(&chat(&sim.model, text))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        token_lists.push(tokens);
    }
    assert_eq!(
        client
            .post(format!("{}/reset_prefix_cache", worker.url()))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );

    // Decode everything the simulator published, through its replay socket, with vLLM's own decoder.
    let replay = worker.kv_replay.clone().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let batches: Vec<Value> = loop {
        let batches: Vec<Value> = run_python("sim_events_replay.py", &[&replay])
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let cleared = batches.iter().any(|b| {
            b["event_types"]
                .as_array()
                .unwrap()
                .iter()
                .any(|t| t == "AllBlocksCleared")
        });
        if cleared || Instant::now() > deadline {
            break batches;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    let cache = KvCache::new(12, 4, 0);
    let mut stored: Vec<(u64, Option<u64>, Vec<u32>)> = Vec::new();
    let mut removed: Vec<u64> = Vec::new();
    for (position, batch) in batches.iter().enumerate() {
        assert_eq!(
            batch["seq"], position as u64,
            "replay returns every batch in order"
        );
        assert_eq!(batch["topic"], "");
        let body = batch["batch"].as_array().unwrap();
        assert!(body[0].as_f64().unwrap() > 1.7e9, "ts is a Unix time");
        assert_eq!(body[2], 0, "data_parallel_rank");
        for event in body[1].as_array().unwrap() {
            match event["type"].as_str().unwrap() {
                "BlockStored" => {
                    assert_eq!(event["block_size"], 4);
                    assert_eq!(event["medium"], "GPU");
                    assert!(event["lora_id"].is_null() && event["lora_name"].is_null());
                    let hashes: Vec<u64> = event["block_hashes"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|h| h.as_u64().unwrap())
                        .collect();
                    let tokens: Vec<u32> = event["token_ids"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|t| t.as_u64().unwrap() as u32)
                        .collect();
                    assert_eq!(tokens.len(), 4 * hashes.len());
                    let mut parent = event["parent_block_hash"].as_u64();
                    for (hash, block) in hashes.iter().zip(tokens.chunks(4)) {
                        stored.push((*hash, parent, block.to_vec()));
                        parent = Some(*hash);
                    }
                }
                "BlockRemoved" => {
                    assert_eq!(event["medium"], "GPU");
                    removed.extend(
                        event["block_hashes"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|h| h.as_u64().unwrap()),
                    );
                }
                "AllBlocksCleared" => {}
                other => panic!("unexpected event {other}"),
            }
        }
    }
    // Every full prompt block was stored with the hash vLLM's scheme gives it, chained in order.
    for tokens in &token_lists {
        let full = tokens.len() / 4;
        let expected = cache.hashes_of(&tokens[..full * 4]);
        for (index, hash) in expected.iter().enumerate() {
            let (_, parent, block) = stored
                .iter()
                .find(|(h, _, _)| *h == hash.0)
                .unwrap_or_else(|| panic!("block {index} never stored"));
            assert_eq!(block, &tokens[index * 4..index * 4 + 4]);
            assert_eq!(*parent, index.checked_sub(1).map(|p| expected[p].0));
        }
    }
    // The cache holds 12 blocks: the second prompt evicted blocks of the first, and said so.
    assert!(!removed.is_empty(), "no BlockRemoved after eviction");
    assert!(
        removed
            .iter()
            .all(|h| stored.iter().any(|(s, _, _)| s == h)),
        "removed blocks were stored first"
    );
    let last = batches.last().unwrap();
    assert_eq!(last["event_types"], json!(["AllBlocksCleared"]));
}

#[tokio::test]
async fn simulator_metrics_parse_with_prometheus_client() {
    // Blocks of 16 so the short prompt below fills some (vLLM's default is 64).
    let sim = Sim::start(&[
        "--workers",
        "1",
        "--block-size",
        "16",
        "--time-scale",
        "0.001",
        "--no-kv-events",
    ]);
    let worker = &sim.workers[0];
    let client = reqwest::Client::new();
    for _ in 0..2 {
        let response = client
            .post(format!("{}/v1/chat/completions", worker.url()))
            .json(&chat(
                &sim.model,
                "the same prompt twice, long enough to fill a few blocks of sixteen tokens",
            ))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
    }
    let parsed: Value = serde_json::from_str(&run_python(
        "parse_metrics.py",
        &[&format!("{}/metrics", worker.url())],
    ))
    .unwrap();
    let value = |family: &str, sample: &str| -> f64 {
        parsed[family]["samples"]
            .as_array()
            .unwrap_or_else(|| panic!("no family {family} in {parsed}"))
            .iter()
            .find(|s| s[0] == sample)
            .unwrap_or_else(|| panic!("no sample {sample}"))[2]
            .as_f64()
            .unwrap()
    };
    assert_eq!(parsed["vllm:num_requests_running"]["type"], "gauge");
    assert_eq!(
        value("vllm:num_requests_running", "vllm:num_requests_running"),
        0.0
    );
    assert_eq!(
        value("vllm:num_requests_waiting", "vllm:num_requests_waiting"),
        0.0
    );
    let usage = value("vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc");
    assert!((0.0..=1.0).contains(&usage));
    let queries = value(
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_queries_total",
    );
    let hits = value("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total");
    assert!(
        queries > 0.0 && hits > 0.0 && hits < queries,
        "queries {queries}, hits {hits}"
    );
    assert_eq!(
        parsed["vllm:time_to_first_token_seconds"]["type"],
        "histogram"
    );
    assert_eq!(
        value(
            "vllm:time_to_first_token_seconds",
            "vllm:time_to_first_token_seconds_count"
        ),
        2.0
    );
    assert_eq!(
        value("vllm:request_success", "vllm:request_success_total"),
        2.0
    );
    let labels = &parsed["vllm:num_requests_running"]["samples"][0][1];
    assert_eq!(labels["model_name"], sim.model.as_str());
    assert_eq!(labels["engine"], "0");
    let _ = std::io::stdout().flush();
}
