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

/// The blocks of the completions request `body` the proxy finds cached on any worker.
async fn matched_blocks(proxy: &Proxy, body: &Value) -> u64 {
    let explained = proxy.debug_route_at("/v1/completions", None, body).await;
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
    let file = |name: &str, contents: &[u8]| {
        let path = dir.path().join(name);
        std::fs::write(&path, contents).unwrap();
        path
    };
    let shipped_template = switchyard_kv::tokenize::SHIPPED_CHAT_TEMPLATE;
    let tokenizer = file("tokenizer.json", &tokenizer_with_bos());
    let template = file("chat_template.jinja", shipped_template.as_bytes());
    // Another model's template: every conversation opens with a line the workers' does not.
    let other_template = file(
        "other_template.jinja",
        format!("Policy v2\n{shipped_template}").as_bytes(),
    );
    // The workers' template with tools rendered: conversations without tools render alike.
    let tools_template = file(
        "tools_template.jinja",
        format!("{{% if tools %}}Tools: {{{{ tools | tojson }}}}\n{{% endif %}}{shipped_template}")
            .as_bytes(),
    );
    let shipped_json = file(
        "shipped.json",
        switchyard_kv::tokenize::SHIPPED_TOKENIZER_JSON,
    );
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
    let tokenizer_yaml = |json: &std::path::Path, template: &std::path::Path| {
        format!(
            "  tokenizer: {{path: \"{}\", chatTemplate: \"{}\"}}\n",
            json.display(),
            template.display()
        )
    };
    let same = Proxy::start(
        &pool_yaml(&sim, &tokenizer_yaml(&tokenizer, &template)),
        &[],
    )
    .await;
    // Without the BOS in its tokenizer.json, and with another chat template.
    let other = Proxy::start(
        &pool_yaml(&sim, &tokenizer_yaml(&shipped_json, &other_template)),
        &[],
    )
    .await;

    let with_tools = Proxy::start(
        &pool_yaml(&sim, &tokenizer_yaml(&tokenizer, &tools_template)),
        &[],
    )
    .await;

    assert_eq!(agreement(&same, "chat").await, 1);
    assert_eq!(agreement(&same, "completions").await, 1);
    assert_eq!(agreement(&same, "tools").await, 1);
    assert!(
        !same.log().contains("other token ids")
            && !same.log().contains("now get the special tokens")
    );
    // The other template renders conversations differently: said, at warn.
    assert_eq!(agreement(&other, "chat").await, 0);
    other
        .wait_for_log("other token ids than its worker", Duration::from_secs(5))
        .await;
    let warning = other
        .log()
        .lines()
        .find(|l| l.contains("other token ids than its worker") && l.contains("prompt=\"chat\""))
        .unwrap()
        .to_owned();
    assert!(warning.contains(" WARN "), "{warning}");
    // And a conversation with a tool call, which it renders differently too.
    assert_eq!(agreement(&other, "tools").await, 0);
    // A template that differs only where tools are: the conversation probe agrees, the one
    // with a tool call does not.
    assert_eq!(agreement(&with_tools, "chat").await, 1);
    assert_eq!(agreement(&with_tools, "tools").await, 0);
    with_tools
        .wait_for_log("other token ids than its worker", Duration::from_secs(5))
        .await;
    assert!(with_tools.log().lines().any(|l| l.contains(" WARN ")
        && l.contains("other token ids than its worker")
        && l.contains("prompt=\"tools\"")));
    drop(with_tools);
    // The worker's ids for a completions prompt are the pool's behind a BOS: taken.
    assert_eq!(agreement(&other, "completions").await, 1);
    assert!(
        other
            .log()
            .contains("now get the special tokens its worker gives them"),
        "{}",
        other.log()
    );

    // A completions prompt the worker prefilled (BOS first) is found in its cache by both.
    same.wait_subscribed(sim.workers.len()).await;
    other.wait_subscribed(sim.workers.len()).await;
    let prompt: String = (0..30)
        .map(|i| {
            format!(
                "Clause {i}: the parties agree to terms numbered {}. ",
                i * 3
            )
        })
        .collect();
    let answer = reqwest::Client::new()
        .post(format!("{}/v1/completions", same.url()))
        .json(&json!({"model": "default", "prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let routed = json!({"model": "default", "prompt": prompt, "max_tokens": 1});
    for proxy in [&same, &other] {
        let deadline = Instant::now() + Duration::from_secs(20);
        while matched_blocks(proxy, &routed).await < 10 {
            assert!(
                Instant::now() < deadline,
                "the pool never found the prompt's blocks"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // Without the BOS (the request asks for none) the same text matches nothing.
    let without =
        json!({"model": "default", "prompt": prompt, "max_tokens": 1, "add_special_tokens": false});
    assert_eq!(matched_blocks(&same, &without).await, 0);
}
