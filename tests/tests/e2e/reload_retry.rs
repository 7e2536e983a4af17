//! Hot reload of the config file, and retry of a request on another worker when one is down.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use switchyard_e2e::{Proxy, Upstream, free_port, model_doc};

fn two_pools(a: &Upstream, b: &Upstream, alias_target: &str) -> String {
    format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: pool-a}}\nspec: {{model: model-a, endpoints: [\"{}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: pool-b}}\nspec: {{model: model-b, endpoints: [\"{}\"]}}\n{}",
        a.endpoint(),
        b.endpoint(),
        model_doc("team-model", alias_target, None)
    )
}

async fn served_by(proxy: &Proxy) -> (u16, String) {
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .json(&json!({"model": "team-model", "messages": [{"role": "user", "content": "who?"}]}))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap();
    (
        status,
        body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    )
}

#[tokio::test]
async fn config_edits_apply_live_and_a_broken_edit_keeps_the_last_good_one() {
    let a = Upstream::start("worker-a").await;
    let b = Upstream::start("worker-b").await;
    let proxy = Proxy::start(
        &two_pools(&a, &b, "pool-a"),
        &["--reload-interval-ms", "100"],
    )
    .await;
    assert!(served_by(&proxy).await.1.starts_with("worker-a"));

    proxy.write_config(&two_pools(&a, &b, "pool-b"));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, who) = served_by(&proxy).await;
        assert_eq!(status, 200, "no request may fail during a reload");
        if who.starts_with("worker-b") {
            break;
        }
        assert!(Instant::now() < deadline, "alias change never took effect");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(b.received().last().unwrap().json()["model"], "model-b");
    let ready: Value = reqwest::get(format!("{}/ready", proxy.url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ready["config_version"], 2);

    // A broken edit: the proxy reports it and keeps routing with the last good snapshot.
    proxy.write_config(
        &two_pools(&a, &b, "pool-b").replace("{model: model-b,", "{model: model-b, bogusField: 1,"),
    );
    proxy
        .wait_for_log("configuration rejected", Duration::from_secs(10))
        .await;
    assert!(
        proxy.log().contains("bogusField"),
        "the error names the field:\n{}",
        proxy.log()
    );
    for _ in 0..5 {
        let (status, who) = served_by(&proxy).await;
        assert_eq!(status, 200);
        assert!(who.starts_with("worker-b"), "{who}");
    }

    // Fixing the file applies again.
    proxy.write_config(&two_pools(&a, &b, "pool-a"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !served_by(&proxy).await.1.starts_with("worker-a") {
        assert!(Instant::now() < deadline, "fixed config never applied");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn an_emptied_or_cut_config_file_keeps_the_last_good_config() {
    let a = Upstream::start("worker-a").await;
    let b = Upstream::start("worker-b").await;
    let good = two_pools(&a, &b, "pool-a");
    let proxy = Proxy::start(&good, &["--reload-interval-ms", "50"]).await;
    let version = proxy.config_version().await;
    // `> file` truncates in place (no atomic rename), then a cut at a document boundary that
    // leaves the pools but no model.
    let cut = good
        .split("\n---\n")
        .filter(|document| !document.contains("kind: InferenceModel"))
        .collect::<Vec<_>>()
        .join("\n---\n");
    for (broken, reason) in [
        ("", "holds no documents"),
        (cut.as_str(), "defines no InferenceModel"),
    ] {
        std::fs::write(&proxy.config_path, broken).unwrap();
        proxy.wait_for_log(reason, Duration::from_secs(10)).await;
        for _ in 0..5 {
            let (status, who) = served_by(&proxy).await;
            assert_eq!(status, 200, "requests must keep being served");
            assert!(who.starts_with("worker-a"), "{who}");
        }
        assert_eq!(proxy.config_version().await, version);
        let ready = reqwest::get(format!("{}/ready", proxy.url()))
            .await
            .unwrap();
        assert_eq!(ready.status(), 200);
    }
    // `--check` refuses both, with the reason.
    let check = std::process::Command::new(switchyard_e2e::process::binary("switchyard-proxy"))
        .args(["--check", "--config"])
        .arg(&proxy.config_path)
        .output()
        .unwrap();
    assert!(!check.status.success());
    assert!(
        String::from_utf8_lossy(&check.stderr).contains("defines no InferenceModel"),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );
}

#[tokio::test]
async fn a_dead_worker_is_skipped_by_retrying_on_another() {
    let live = Upstream::start("live").await;
    let dead = format!("127.0.0.1:{}", free_port());
    let yaml = format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: p}}\nspec: {{model: m, loadBalancing: round-robin, endpoints: [\"{dead}\", \"{}\"]}}\n{}",
        live.endpoint(),
        model_doc("team-model", "p", None)
    );
    let proxy = Proxy::start(&yaml, &[]).await;
    for _ in 0..6 {
        let (status, who) = served_by(&proxy).await;
        assert_eq!(status, 200);
        assert!(who.starts_with("live"), "{who}");
    }
    assert_eq!(
        live.received().len(),
        6,
        "each request reached the live worker exactly once"
    );
    // Round-robin sent about half of the first attempts to the dead worker; those were retried.
    assert!(
        proxy.log().contains("could not connect to worker"),
        "{}",
        proxy.log()
    );
}
