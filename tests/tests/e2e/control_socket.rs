//! `switchyard-control serve` pushing snapshots to several proxies over its Unix socket: the
//! first snapshot at connect, every edit after, nothing resent when routing did not change,
//! invalid edits kept out, and proxies that keep serving while the control is gone and pick
//! up again when it returns.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use switchyard_e2e::process::Control;
use switchyard_e2e::{Proxy, Upstream, pool_config};

fn write_config(path: &Path, yaml: &str) {
    let temp = path.with_extension("tmp");
    std::fs::write(&temp, yaml).unwrap();
    std::fs::rename(&temp, path).unwrap();
}

async fn served_by(proxy: &Proxy) -> String {
    switchyard_e2e::served_by(&reqwest::Client::new(), &proxy.url(), "chat", None)
        .await
        .unwrap()
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
    let v1 = a.config_version().await;
    assert_eq!(v1, b.config_version().await);

    // An edit reaches both.
    write_config(
        &config,
        &pool_config("p", "m", &[second.endpoint()], "", &["chat"]),
    );
    a.wait_served_by("chat", None, "second").await;
    b.wait_served_by("chat", None, "second").await;
    let v2 = a.config_version().await;
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
    assert_eq!(a.config_version().await, v2);

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
    a.wait_served_by("chat", None, "first").await;
    b.wait_served_by("chat", None, "first").await;
    assert!(
        a.config_version().await > v2,
        "versions keep increasing across control restarts"
    );
    control.wait_log_count("proxy connected", 2).await;
    assert!(a.log().contains("connected to the control process"));
}
