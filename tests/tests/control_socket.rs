//! `switchyard-control serve` pushing snapshots to several proxies over its Unix socket: the
//! first snapshot at connect, every edit after, nothing resent when routing did not change,
//! invalid edits kept out, and proxies that keep serving while the control is gone and pick
//! up again when it returns.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use switchyard_e2e::process::Control;
use switchyard_e2e::{Proxy, Upstream, pool_config};

fn write_config(path: &Path, yaml: &str) {
    let temp = path.with_extension("tmp");
    std::fs::write(&temp, yaml).unwrap();
    std::fs::rename(&temp, path).unwrap();
}

async fn served_by(proxy: &Proxy) -> String {
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .json(&json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .to_owned()
}

async fn wait_served_by(proxy: &Proxy, name: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while served_by(proxy).await != name {
        assert!(Instant::now() < deadline, "proxy never switched to {name}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn version(proxy: &Proxy) -> u64 {
    let ready: Value = reqwest::get(format!("{}/ready", proxy.url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    ready["config_version"].as_u64().unwrap()
}

#[tokio::test]
async fn control_pushes_snapshots_to_every_proxy_and_they_survive_its_absence() {
    let first = Upstream::start("first").await;
    let second = Upstream::start("second").await;
    let dir = tempfile::tempdir().unwrap();
    let socket: PathBuf = dir.path().join("control.sock");
    let config = dir.path().join("switchyard.yaml");
    write_config(
        &config,
        &pool_config("p", "m", &[first.endpoint()], "", &["chat"]),
    );
    let control = Control::start_files(&socket, &config).await;
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the socket is for this user only");

    // Two proxies (an old and a new one during an upgrade): both get the snapshot at once.
    let a = Proxy::start_with_control(&socket, &[]).await;
    let b = Proxy::start_with_control(&socket, &[]).await;
    assert_eq!(served_by(&a).await, "first");
    assert_eq!(served_by(&b).await, "first");
    control.wait_log_count("proxy applied snapshot", 2).await;
    let v1 = version(&a).await;
    assert_eq!(v1, version(&b).await);

    // An edit reaches both.
    write_config(
        &config,
        &pool_config("p", "m", &[second.endpoint()], "", &["chat"]),
    );
    wait_served_by(&a, "second").await;
    wait_served_by(&b, "second").await;
    let v2 = version(&a).await;
    assert!(v2 > v1);
    control.wait_log_count("proxy applied snapshot", 4).await;

    // A whitespace-only edit changes the files, not the routing: nothing is resent.
    write_config(
        &config,
        &format!(
            "{}\n\n",
            pool_config("p", "m", &[second.endpoint()], "", &["chat"])
        ),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        control.log().matches("new snapshot").count(),
        1,
        "{}",
        control.log()
    );
    assert_eq!(version(&a).await, v2);

    // An invalid edit is refused by the control; the proxies keep the last good snapshot.
    write_config(
        &config,
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {name: p}\nspec: {model: m}\n",
    );
    control.wait_log_count("configuration rejected", 1).await;
    assert_eq!(served_by(&a).await, "second");

    // The control goes away: the proxies keep serving.
    drop(control);
    for _ in 0..5 {
        assert_eq!(served_by(&a).await, "second");
        assert_eq!(served_by(&b).await, "second");
    }
    // It comes back with a new configuration: the proxies reconnect and take it.
    write_config(
        &config,
        &pool_config("p", "m", &[first.endpoint()], "", &["chat"]),
    );
    let control = Control::start_files(&socket, &config).await;
    wait_served_by(&a, "first").await;
    wait_served_by(&b, "first").await;
    assert!(
        version(&a).await > v2,
        "versions keep increasing across control restarts"
    );
    control.wait_log_count("proxy connected", 2).await;
    assert!(a.log().contains("connected to the control process"));
}
