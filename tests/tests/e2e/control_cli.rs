//! `switchyard-control check` and `explain`, run as a user (or a CI step) runs them.

use std::process::{Command, Output};

use serde_json::Value;
use switchyard_e2e::process::binary;
use switchyard_e2e::workspace_root;

fn control(args: &[&str]) -> Output {
    Command::new(binary("switchyard-control"))
        .args(args)
        .current_dir(workspace_root())
        .output()
        .expect("run switchyard-control")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn check_accepts_the_examples_and_the_default() {
    for path in ["conf/examples", "conf/default.yaml"] {
        let output = control(&["check", path]);
        assert!(output.status.success(), "{path}: {}", text(&output.stderr));
        assert!(text(&output.stdout).starts_with("ok: "));
    }
    let output = control(&[
        "check",
        "conf/kubernetes",
        "conf/examples/models.yaml",
        "conf/examples/policies.yaml",
    ]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let output = control(&["check", "conf/examples"]);
    assert!(
        text(&output.stdout)
            .contains("2 pool(s), 3 model(s), 1 provider(s), 3 tenant(s), 4 policy rule(s)"),
        "{}",
        text(&output.stdout)
    );
}

#[test]
fn check_reports_every_error_with_file_document_and_field() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("a.yaml"),
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {name: p}\nspec: {model: m, endpoints: [\"10.0.0.1:8000\"]}\n---\napiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {name: chat}\nspec: {targets: [{pool: p}]}\n",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("b.yaml"),
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePolicy\nmetadata: {name: rules}\nspec:\n  rules:\n    - name: r1\n      match: {promptClasses: {anyOf: [secret]}}\n      action: {requireLocal: true}\n    - name: r2\n      match: {models: [chta]}\n      action: {reject: {status: 200, message: no}}\n",
    )
    .unwrap();
    let output = control(&["check", dir.path().to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(1));
    let stderr = text(&output.stderr);
    let b = dir.path().join("b.yaml").display().to_string();
    for expected in [
        format!(
            "{b} (document 1): InferencePolicy default/rules: spec.rules[0].match.promptClasses.anyOf[0]: unknown prompt class 'secret'"
        ),
        format!(
            "{b} (document 1): InferencePolicy default/rules: spec.rules[1].match.models[0]: 'chta' matches no InferenceModel; models defined: chat"
        ),
        format!(
            "{b} (document 1): InferencePolicy default/rules: spec.rules[1].action.reject.status: 200 is not an error status (400-599)"
        ),
    ] {
        assert!(
            stderr.contains(&expected),
            "missing {expected:?} in:\n{stderr}"
        );
    }
    assert!(stderr.starts_with("3 configuration error(s)"), "{stderr}");
}

#[test]
fn explain_names_the_rule_the_classes_and_the_target() {
    let output = control(&[
        "explain",
        "--request",
        "conf/examples/requests/long-analysis.json",
        "--tenant",
        "chat-team",
        "--pool-state",
        "conf/examples/requests/busy.yaml",
        "conf/examples",
    ]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    for line in [
        "tenant: chat-team (labels: tier=interactive)",
        "prompt classes: complex",
        "default/gateway/simple-to-small-model: no match: prompt class",
        "matched rule: default/gateway/overflow-to-provider",
        "target: provider default/openai model gpt-4.1-mini",
    ] {
        assert!(stdout.contains(line), "missing {line:?} in:\n{stdout}");
    }
    // Without pool state the large pool is idle: the model's own target.
    let output = control(&[
        "explain",
        "--json",
        "--request",
        "conf/examples/requests/long-analysis.json",
        "--tenant",
        "chat-team",
        "conf/examples",
    ]);
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["matchedRule"], Value::Null);
    assert_eq!(report["targets"][0]["backend"], "pool default/large");
    // Personal data: local required, simple → small pool.
    let output = control(&[
        "explain",
        "--json",
        "--request",
        "conf/examples/requests/pii.json",
        "--tenant",
        "chat-team",
        "--pool-state",
        "conf/examples/requests/busy.yaml",
        "conf/examples",
    ]);
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["requireLocal"], true);
    assert_eq!(
        report["classes"],
        serde_json::json!(["pii", "pii.email", "simple"])
    );
    assert_eq!(report["targets"][0]["backend"], "pool default/small");
    // A batch header on a busy pool: the reject, with its status.
    let output = control(&[
        "explain",
        "--json",
        "--header",
        "x-priority=batch",
        "--request",
        "conf/examples/requests/long-analysis.json",
        "--tenant",
        "batch-jobs",
        "--pool-state",
        "conf/examples/requests/busy.yaml",
        "conf/examples",
    ]);
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["status"], 429);
    assert_eq!(report["retryAfterSeconds"], 30);
    assert_eq!(
        report["matchedRule"],
        "default/gateway/batch-only-when-quiet"
    );
    // Unknown tenant: an error naming the tenants.
    let output = control(&[
        "explain",
        "--request",
        "conf/examples/requests/pii.json",
        "--tenant",
        "nobody",
        "conf/examples",
    ]);
    assert!(!output.status.success());
    assert!(
        text(&output.stderr).contains(
            "no Tenant named 'nobody'; tenants defined: analytics, batch-jobs, chat-team"
        )
    );
}
