//! The CRD YAML under `crds/` is exactly what the Rust types generate, the schemas are
//! structural (what the API server requires), and documents load through both the kube types
//! and the file compiler.

use std::path::PathBuf;

use serde_json::Value;
use switchyard_crds::{all, file_name, render};

fn crds_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn checked_in_yaml_matches_the_types() {
    let update = std::env::var_os("SWITCHYARD_UPDATE_CRDS").is_some();
    let mut drifted = Vec::new();
    for crd in all() {
        let path = crds_dir().join(file_name(&crd));
        let want = render(&crd).unwrap();
        if update {
            std::fs::write(&path, &want).unwrap();
            // The Helm chart installs the same files.
            let chart_copy = crds_dir()
                .join("../helm/switchyard/crds")
                .join(file_name(&crd));
            std::fs::write(chart_copy, &want).unwrap();
            continue;
        }
        let have = std::fs::read_to_string(&path).unwrap_or_default();
        if have != want {
            drifted.push(path.display().to_string());
        }
    }
    assert!(
        drifted.is_empty(),
        "generated CRDs differ from the checked-in files {drifted:?}; \
         run SWITCHYARD_UPDATE_CRDS=1 cargo test -p switchyard-crds and commit the result"
    );
}

/// Kubernetes' structural-schema rules: every node names a type (unless it preserves unknown
/// fields or is int-or-string), no $ref, and anyOf/oneOf/allOf carry no types of their own.
fn structural_problems(schema: &Value, path: &str, problems: &mut Vec<String>) {
    let Some(node) = schema.as_object() else {
        problems.push(format!("{path}: not an object"));
        return;
    };
    let free = node.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true))
        || node.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true));
    if !free && !node.contains_key("type") {
        problems.push(format!("{path}: no type"));
    }
    if node.contains_key("$ref") {
        problems.push(format!("{path}: $ref"));
    }
    for combinator in ["anyOf", "oneOf", "allOf"] {
        if let Some(Value::Array(branches)) = node.get(combinator) {
            for branch in branches {
                for forbidden in ["type", "default", "nullable", "additionalProperties"] {
                    if branch.get(forbidden).is_some() {
                        problems.push(format!("{path}.{combinator}: {forbidden} inside"));
                    }
                }
            }
        }
    }
    if node.contains_key("properties") && node.contains_key("additionalProperties") {
        problems.push(format!(
            "{path}: properties and additionalProperties together"
        ));
    }
    if let Some(Value::Object(properties)) = node.get("properties") {
        for (name, child) in properties {
            structural_problems(child, &format!("{path}.{name}"), problems);
        }
    }
    if let Some(items) = node.get("items") {
        structural_problems(items, &format!("{path}[]"), problems);
    }
    if let Some(additional @ Value::Object(_)) = node.get("additionalProperties") {
        structural_problems(additional, &format!("{path}{{}}"), problems);
    }
}

#[test]
fn schemas_are_structural_and_carry_validations() {
    let mut problems = Vec::new();
    let mut rules = 0;
    for crd in all() {
        let value = serde_json::to_value(&crd).unwrap();
        let name = crd.metadata.name.clone().unwrap();
        let versions = value["spec"]["versions"].as_array().unwrap();
        assert_eq!(versions.len(), 1);
        let schema = &versions[0]["schema"]["openAPIV3Schema"];
        structural_problems(schema, &name, &mut problems);
        let text = schema.to_string();
        rules += text.matches("x-kubernetes-validations").count();
        assert_eq!(value["spec"]["group"], "switchyard.dev");
        assert_eq!(value["spec"]["scope"], "Namespaced");
        assert!(
            versions[0]["subresources"]["status"].is_object(),
            "{name}: status subresource"
        );
    }
    assert!(problems.is_empty(), "{problems:#?}");
    assert!(rules >= 6, "CEL rules present in the schemas: {rules}");
}

#[test]
fn shipped_documents_load_through_the_kube_types_too() {
    let conf = crds_dir().join("../conf");
    let mut files: Vec<PathBuf> = std::fs::read_dir(conf.join("examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.push(conf.join("default.yaml"));
    let mut kinds = std::collections::BTreeSet::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for document in serde_norway::Deserializer::from_str(&text) {
            let value: Value = serde::Deserialize::deserialize(document).unwrap();
            if value.is_null() {
                continue;
            }
            let kind = value["kind"].as_str().unwrap().to_owned();
            let result = match kind.as_str() {
                "InferencePool" => {
                    serde_json::from_value::<switchyard_crds::InferencePool>(value).map(drop)
                }
                "InferenceModel" => {
                    serde_json::from_value::<switchyard_crds::InferenceModel>(value).map(drop)
                }
                "InferencePolicy" => {
                    serde_json::from_value::<switchyard_crds::InferencePolicy>(value).map(drop)
                }
                "Tenant" => serde_json::from_value::<switchyard_crds::Tenant>(value).map(drop),
                "ExternalProvider" => {
                    serde_json::from_value::<switchyard_crds::ExternalProvider>(value).map(drop)
                }
                other => panic!("{}: unexpected kind {other}", file.display()),
            };
            result.unwrap_or_else(|e| panic!("{}: {kind}: {e}", file.display()));
            kinds.insert(kind);
        }
    }
    assert_eq!(kinds.len(), 5, "the examples use every kind: {kinds:?}");
}
