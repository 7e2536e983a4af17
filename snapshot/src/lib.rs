//! Switchyard's configuration model, shared by the control process and the proxy.
//!
//! Use it in three steps: read documents ([`parse_paths`] for files and directories,
//! [`parse_str`] for text), [`compile`] them into a [`Snapshot`] (or get every error at once,
//! each naming file, document and field), then hand the snapshot to whoever routes. The snapshot
//! is plain serde data: it crosses the control→proxy socket as JSON and never links Kubernetes.

pub mod compile;
pub mod compile_policy;
pub mod documents;
pub mod error;
pub mod parse;
pub mod snapshot;
pub mod wire;

pub use compile::compile;
pub use error::{ConfigError, ConfigErrors};
pub use parse::{EMBEDDED_SOURCE, Parsed, parse_paths, parse_str};
pub use snapshot::{Model, ModelTarget, Pool, PoolId, Snapshot};

/// Parse and compile in one go: what `switchyard-control check` and the proxy's file loader run.
/// Every error is reported: those of reading and those of compiling the documents that could be read.
///
/// Files must define at least one `InferenceModel`: a set that serves no model (a file cut at a
/// document boundary, a directory emptied by mistake) would answer every request 404, so it is
/// an error here, and watchers keep the last good configuration instead.
pub fn load_paths(paths: &[std::path::PathBuf]) -> Result<Snapshot, ConfigErrors> {
    let snapshot = compile::compile_parsed(parse_paths(paths))?;
    if snapshot.models.is_empty() {
        let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
        return Err(ConfigErrors(vec![ConfigError {
            source_name: names.join(", "),
            document: "configuration".to_owned(),
            field: String::new(),
            message: "defines no InferenceModel, so every request would be answered 404 \
                      (a cut or emptied file?)"
                .to_owned(),
        }]));
    }
    Ok(snapshot)
}

/// Parse and compile one YAML text.
pub fn load_str(source: &str, text: &str) -> Result<Snapshot, ConfigErrors> {
    compile::compile_parsed(parse_str(source, text))
}

#[cfg(test)]
mod tests {
    use super::*;

    const POOL: &str = "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {name: p}\nspec: {model: m, endpoints: [\"10.0.0.1:8000\", \"10.0.0.2:8000\"]}\n";

    fn model(name: &str, body: &str) -> String {
        format!(
            "---\napiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: {name}}}\nspec: {body}\n"
        )
    }

    #[test]
    fn compiles_pools_and_aliases() {
        let text = format!(
            "{POOL}{}{}",
            model(
                "a",
                "{modelName: \"Org/Alias\", targets: [{pool: p, model: other, weight: 3}, {pool: p, weight: 0}]}"
            ),
            model("plain", "{targets: [{pool: p}]}")
        );
        let snapshot = load_str("t.yaml", &text).unwrap();
        let pool = &snapshot.pools[&PoolId::new("default", "p")];
        let addresses: Vec<&str> = pool.endpoints.iter().map(|e| e.address.as_str()).collect();
        assert_eq!(addresses, ["10.0.0.1:8000", "10.0.0.2:8000"]);
        assert_eq!(pool.load_balancing, snapshot::LoadBalancing::CacheAware);
        assert_eq!(pool.block_size, 64);
        assert_eq!(pool.endpoints[0].kv_events, None);
        assert_eq!(pool.max_attempts, snapshot::DEFAULT_MAX_ATTEMPTS);
        let alias = &snapshot.models["Org/Alias"];
        assert_eq!(alias.targets.len(), 1, "weight 0 targets are dropped");
        assert_eq!(alias.targets[0].upstream_model, "other");
        assert_eq!(alias.targets[0].weight, 3);
        assert_eq!(snapshot.models["plain"].targets[0].upstream_model, "m");
        assert_eq!(snapshot.version, 0);
    }

    #[test]
    fn reports_every_error_with_source_document_and_field() {
        let text = format!(
            "{}{}{}{}---\napiVersion: v1\nkind: Gadget\nmetadata: {{name: x}}\nspec: {{}}\n",
            POOL.replace("10.0.0.2:8000", "http://10.0.0.2"),
            model("a", "{targets: [{pool: missing}]}"),
            model("b", "{targets: [{pool: p, wieght: 2}]}"),
            model("Bad_Name", "{targets: []}"),
        );
        let errors = load_str("conf/team.yaml", &text).unwrap_err();
        let rendered = errors.to_string();
        let expect = [
            ("InferencePool default/p", "spec.endpoints[1]", "scheme"),
            (
                "InferenceModel default/a",
                "spec.targets[0].pool",
                "no InferencePool default/missing",
            ),
            ("InferenceModel default/b", "spec.targets[0]", "wieght"),
            (
                "InferenceModel default/Bad_Name",
                "metadata.name",
                "not a valid object name",
            ),
            (
                "InferenceModel default/Bad_Name",
                "spec.targets",
                "at least one target",
            ),
            ("document 5", "apiVersion", "unsupported apiVersion 'v1'"),
            ("document 5", "kind", "unknown kind 'Gadget'"),
        ];
        for (document, field, message) in expect {
            assert!(
                errors.iter().any(|e| e.document == document
                    && e.field.starts_with(field)
                    && e.message.contains(message)),
                "missing {document} / {field} / {message} in:\n{rendered}"
            );
        }
        assert!(
            errors
                .iter()
                .all(|e| e.source_name.starts_with("conf/team.yaml")),
            "{rendered}"
        );
    }

    #[test]
    fn duplicate_names_and_yaml_syntax_errors_are_reported() {
        let text = format!(
            "{POOL}---\n{POOL}{}{}",
            model("a", "{modelName: x, targets: [{pool: p}]}"),
            model("b", "{modelName: x, targets: [{pool: p}]}")
        );
        let errors = load_str("t", &text).unwrap_err().to_string();
        assert!(
            errors.contains("duplicate InferencePool default/p"),
            "{errors}"
        );
        assert!(
            errors.contains("model name 'x' is already defined"),
            "{errors}"
        );
        let errors = load_str("t", "kind: [unclosed").unwrap_err().to_string();
        assert!(errors.contains("invalid YAML"), "{errors}");
    }

    #[test]
    fn directories_load_in_name_order_and_fingerprints_track_content() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("10-pool.yaml"), POOL).unwrap();
        std::fs::write(
            dir.path().join("20-model.yml"),
            model("a", "{targets: [{pool: p}]}"),
        )
        .unwrap();
        std::fs::write(dir.path().join("notes.txt"), "not yaml").unwrap();
        let first = load_paths(&[dir.path().to_path_buf()]).unwrap();
        let again = load_paths(&[dir.path().to_path_buf()]).unwrap();
        assert_eq!(first.fingerprint, again.fingerprint);
        std::fs::write(
            dir.path().join("20-model.yml"),
            model("a", "{modelName: b, targets: [{pool: p}]}"),
        )
        .unwrap();
        let changed = load_paths(&[dir.path().to_path_buf()]).unwrap();
        assert_ne!(first.fingerprint, changed.fingerprint);
        let missing = load_paths(&[dir.path().join("nope.yaml")])
            .unwrap_err()
            .to_string();
        assert!(
            missing.contains("nope.yaml") && missing.contains("cannot read"),
            "{missing}"
        );
    }

    #[test]
    fn empty_files_and_configurations_that_serve_no_model_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("gateway.yaml");
        let good = format!("{POOL}{}", model("a", "{targets: [{pool: p}]}"));
        std::fs::write(&file, &good).unwrap();
        assert!(load_paths(std::slice::from_ref(&file)).is_ok());
        // `> gateway.yaml`, or only comments left.
        for empty in ["", "\n\n", "# being edited\n", "---\n"] {
            std::fs::write(&file, empty).unwrap();
            let error = load_paths(std::slice::from_ref(&file))
                .unwrap_err()
                .to_string();
            assert!(error.contains("holds no documents"), "{empty:?}: {error}");
        }
        // Cut at a document boundary: the pool is left, the model is gone.
        std::fs::write(&file, POOL).unwrap();
        let error = load_paths(std::slice::from_ref(&file))
            .unwrap_err()
            .to_string();
        assert!(error.contains("defines no InferenceModel"), "{error}");
        // One empty file next to good ones is still an error, named by its path.
        std::fs::write(&file, &good).unwrap();
        std::fs::write(dir.path().join("extra.yaml"), "").unwrap();
        let error = load_paths(&[dir.path().to_path_buf()])
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("extra.yaml") && error.contains("holds no documents"),
            "{error}"
        );
        // Text compiled on its own (the embedded default, tests) is not a file set.
        assert!(load_str("text", POOL).is_ok());
    }

    #[test]
    fn kv_event_sockets_come_from_the_pool_or_the_endpoint() {
        let text = "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {name: p}\nspec:\n  model: m\n  blockSize: 32\n  kvEvents: {port: 5557, replayPort: 5657}\n  endpoints:\n    - 10.0.0.1:8000\n    - {address: \"127.0.0.1:8002\", kvEvents: \"tcp://127.0.0.1:6000\"}\n";
        let snapshot = load_str("t", text).unwrap();
        let pool = &snapshot.pools[&PoolId::new("default", "p")];
        assert_eq!(pool.block_size, 32);
        assert_eq!(pool.endpoints[0].address, "10.0.0.1:8000");
        assert_eq!(
            pool.endpoints[0].kv_events.as_deref(),
            Some("tcp://10.0.0.1:5557")
        );
        assert_eq!(
            pool.endpoints[0].kv_replay.as_deref(),
            Some("tcp://10.0.0.1:5657")
        );
        assert_eq!(
            pool.endpoints[1].kv_events.as_deref(),
            Some("tcp://127.0.0.1:6000")
        );
        assert_eq!(
            pool.endpoints[1].kv_replay.as_deref(),
            Some("tcp://127.0.0.1:5657")
        );
        let bad = text.replace("tcp://127.0.0.1:6000", "127.0.0.1:6000");
        let errors = load_str("t", &bad).unwrap_err().to_string();
        assert!(errors.contains("spec.endpoints[1].kvEvents"), "{errors}");
    }

    #[test]
    fn the_shipped_configs_compile() {
        let conf = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../conf");
        let snapshot = load_paths(&[conf]).unwrap();
        assert!(!snapshot.models.is_empty());
    }
}
