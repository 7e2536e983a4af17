//! Architectural guard: the proxy never links Kubernetes client crates (DESIGN: the snapshot is
//! plain data; only the control process talks to the API server).

use std::process::Command;

use switchyard_e2e::workspace_root;

#[test]
fn the_proxy_does_not_depend_on_kube_or_k8s_openapi() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let output = Command::new(cargo)
        .current_dir(workspace_root())
        .args([
            "tree",
            "--locked",
            "-p",
            "switchyard-proxy",
            "-e",
            "normal,build",
            "--prefix",
            "none",
        ])
        .output()
        .expect("run cargo tree");
    assert!(
        output.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let tree = String::from_utf8_lossy(&output.stdout);
    let crates: Vec<&str> = tree
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .collect();
    assert!(
        crates.contains(&"pingora-proxy"),
        "unexpected cargo tree output:\n{tree}"
    );
    let forbidden: Vec<&&str> = crates
        .iter()
        .filter(|name| name.starts_with("kube") || name.starts_with("k8s-openapi"))
        .collect();
    assert!(
        forbidden.is_empty(),
        "switchyard-proxy depends on {forbidden:?}; keep Kubernetes in the control crate"
    );
}
