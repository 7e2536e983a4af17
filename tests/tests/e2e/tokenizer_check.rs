//! A pool's tokenizer checked against its workers' (`POST /tokenize` on a probe), and a
//! completions prompt hashed with the BOS vLLM gives it: a simulator whose tokenizer.json adds
//! a BOS to every prompt encoded with special tokens (as Llama 3's does), one proxy configured
//! with that tokenizer and one left on the shipped one.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use switchyard_e2e::{Proxy, Sim};

/// The shipped tokenizer.json with a post-processor that puts a BOS before every text encoded
/// with special tokens.
fn tokenizer_with_bos() -> Vec<u8> {
    let mut json: Value =
        serde_json::from_slice(switchyard_kv::tokenize::SHIPPED_TOKENIZER_JSON).unwrap();
    let bos = "<｜begin▁of▁sentence｜>";
    json["post_processor"] = json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [0], "tokens": [bos]}}
    });
    serde_json::to_vec(&json).unwrap()
}

fn pool_yaml(sim: &Sim, tokenizer: &str) -> String {
    format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: sim}}\nspec:\n  model: {}\n  blockSize: 16\n  scrapeIntervalMs: 100\n  endpoints: [{}]\n{tokenizer}{}",
        sim.model,
        sim.endpoints_yaml(),
        switchyard_e2e::model_doc("default", "sim", None)
    )
}

/// The value of `switchyard_pool_tokenizer_agrees` for `prompt`, once the check has one.
async fn agreement(proxy: &Proxy, prompt: &str) -> u64 {
    let series =
        format!("switchyard_pool_tokenizer_agrees{{pool=\"default/sim\",prompt=\"{prompt}\"}} ");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let metrics = proxy.metrics().await;
        if let Some(line) = metrics.lines().find(|l| l.starts_with(&series)) {
            return line[series.len()..].trim().parse().unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "no tokenizer verdict for {prompt}:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The blocks of the completions `prompt` the proxy finds cached on any worker.
async fn matched_blocks(proxy: &Proxy, prompt: &str) -> u64 {
    let explained: Value = reqwest::Client::new()
        .post(format!("{}/debug/route/v1/completions", proxy.admin_url()))
        .json(&json!({"model": "default", "prompt": prompt, "max_tokens": 1}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    explained["scores"]
        .as_array()
        .unwrap_or_else(|| panic!("no scores: {explained}"))
        .iter()
        .filter_map(|s| s["matched_blocks"].as_u64())
        .max()
        .unwrap_or(0)
}

#[tokio::test]
async fn a_pool_knows_whether_its_tokenizer_is_its_workers_and_hashes_completions_with_their_bos() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = dir.path().join("tokenizer.json");
    std::fs::write(&tokenizer, tokenizer_with_bos()).unwrap();
    let template = dir.path().join("chat_template.jinja");
    std::fs::write(&template, switchyard_kv::tokenize::SHIPPED_CHAT_TEMPLATE).unwrap();
    let sim = Sim::start(&[
        "--workers",
        "2",
        "--time-scale",
        "0.01",
        "--block-size",
        "16",
        "--tokenizer",
        tokenizer.to_str().unwrap(),
    ]);
    let configured = Proxy::start(
        &pool_yaml(
            &sim,
            &format!(
                "  tokenizer: {{path: \"{}\", chatTemplate: \"{}\"}}\n",
                tokenizer.display(),
                template.display()
            ),
        ),
        &[],
    )
    .await;
    let shipped = Proxy::start(&pool_yaml(&sim, ""), &[]).await;

    // The configured pool agrees on both; the shipped tokenizer has the same chat template and
    // vocabulary, so chats agree, but it adds no BOS to a completions prompt.
    assert_eq!(agreement(&configured, "chat").await, 1);
    assert_eq!(agreement(&configured, "completions").await, 1);
    assert_eq!(agreement(&shipped, "chat").await, 1);
    assert_eq!(agreement(&shipped, "completions").await, 0);
    shipped
        .wait_for_log("other token ids than its worker", Duration::from_secs(5))
        .await;
    let warning = shipped
        .log()
        .lines()
        .find(|l| l.contains("other token ids than its worker"))
        .unwrap()
        .to_owned();
    assert!(
        warning.contains(" WARN ") && warning.contains("prompt=\"completions\""),
        "{warning}"
    );
    assert!(!configured.log().contains("other token ids"));

    // A completions prompt the worker prefilled is found in its cache by the pool whose
    // tokenizer adds the BOS the worker added, and by no other.
    configured.wait_subscribed(sim.workers.len()).await;
    shipped.wait_subscribed(sim.workers.len()).await;
    let prompt: String = (0..30)
        .map(|i| {
            format!(
                "Clause {i}: the parties agree to terms numbered {}. ",
                i * 3
            )
        })
        .collect();
    let answer = reqwest::Client::new()
        .post(format!("{}/v1/completions", configured.url()))
        .json(&json!({"model": "default", "prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let deadline = Instant::now() + Duration::from_secs(20);
    while matched_blocks(&configured, &prompt).await < 10 {
        assert!(
            Instant::now() < deadline,
            "the configured pool never found the prompt's blocks"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(matched_blocks(&shipped, &prompt).await, 0);
}
