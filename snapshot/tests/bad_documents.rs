//! Documents that must be rejected, each with the field and message an operator needs.

const BASE: &str = r#"
apiVersion: switchyard.dev/v1alpha1
kind: InferencePool
metadata: {name: local}
spec: {model: m, endpoints: ["127.0.0.1:1"]}
---
apiVersion: switchyard.dev/v1alpha1
kind: ExternalProvider
metadata: {name: cloud}
spec: {baseUrl: "https://api.example.com/v1", format: openai, models: [gpt]}
---
apiVersion: switchyard.dev/v1alpha1
kind: InferenceModel
metadata: {name: chat}
spec: {targets: [{pool: local}]}
---
apiVersion: switchyard.dev/v1alpha1
kind: Tenant
metadata: {name: team}
spec: {}
"#;

fn document(kind: &str, name: &str, spec: &str) -> String {
    format!(
        "---\napiVersion: switchyard.dev/v1alpha1\nkind: {kind}\nmetadata: {{name: {name}}}\nspec: {spec}\n"
    )
}

fn policy(rules: &str) -> String {
    document("InferencePolicy", "p", &format!("{{rules: [{rules}]}}"))
}

/// (extra documents, document label, field, message fragment)
fn cases() -> Vec<(String, &'static str, &'static str, &'static str)> {
    vec![
        (
            document(
                "InferenceModel",
                "x",
                "{targets: [{pool: local, provider: cloud, model: gpt}]}",
            ),
            "InferenceModel default/x",
            "spec.targets[0]",
            "both a pool and a provider",
        ),
        (
            document("InferenceModel", "x", "{targets: [{provider: cloud}]}"),
            "InferenceModel default/x",
            "spec.targets[0].model",
            "required with a provider",
        ),
        (
            document(
                "InferenceModel",
                "x",
                "{targets: [{provider: cloud, model: other}]}",
            ),
            "InferenceModel default/x",
            "spec.targets[0].model",
            "does not list model 'other'",
        ),
        (
            document(
                "InferenceModel",
                "x",
                "{targets: [{provider: nope, model: gpt}]}",
            ),
            "InferenceModel default/x",
            "spec.targets[0].provider",
            "no ExternalProvider default/nope",
        ),
        (
            document(
                "InferenceModel",
                "x",
                "{strategy: random, targets: [{pool: local}]}",
            ),
            "InferenceModel default/x",
            "spec.strategy",
            "unknown variant",
        ),
        (
            document(
                "ExternalProvider",
                "bad",
                "{baseUrl: \"ftp://x\", format: openai}",
            ),
            "ExternalProvider default/bad",
            "spec.baseUrl",
            "http:// or https://",
        ),
        (
            document(
                "ExternalProvider",
                "bad",
                "{baseUrl: \"https://x\", format: gemini}",
            ),
            "ExternalProvider default/bad",
            "spec.format",
            "unknown variant",
        ),
        (
            document(
                "ExternalProvider",
                "bad",
                "{baseUrl: \"https://x\", format: openai, credentials: {file: a, env: B}}",
            ),
            "ExternalProvider default/bad",
            "spec.credentials",
            "exactly one of",
        ),
        (
            document(
                "ExternalProvider",
                "bad",
                "{baseUrl: \"https://x\", format: openai, forwardHeaders: [anthropic-beta, \"bad header\"]}",
            ),
            "ExternalProvider default/bad",
            "spec.forwardHeaders[1]",
            "not an HTTP header name",
        ),
        (
            document(
                "ExternalProvider",
                "bad",
                "{baseUrl: \"https://x\", format: openai, forwardHeaders: [Authorization]}",
            ),
            "ExternalProvider default/bad",
            "spec.forwardHeaders[0]",
            "set by the gateway",
        ),
        (
            document("Tenant", "t2", "{apiKeys: [{sha256: sk-live-123}]}"),
            "Tenant default/t2",
            "spec.apiKeys[0].sha256",
            "never the key itself",
        ),
        (
            document("Tenant", "t2", "{models: [gpt-5]}"),
            "Tenant default/t2",
            "spec.models[0]",
            "matches no InferenceModel",
        ),
        (
            document("Tenant", "t2", "{rateLimits: {requestsPerMinute: 0}}"),
            "Tenant default/t2",
            "spec.rateLimits.requestsPerMinute",
            "at least 1",
        ),
        (
            format!(
                "{}{}",
                document("Tenant", "a", "{default: true}"),
                document("Tenant", "b", "{default: true}")
            ),
            "Tenant default/b",
            "spec.default",
            "already the default tenant",
        ),
        (
            policy("{name: r, match: {tenants: {names: [nobody]}}, action: {fallThrough: true}}"),
            "InferencePolicy default/p",
            "spec.rules[0].match.tenants.names[0]",
            "no Tenant named 'nobody'",
        ),
        (
            policy("{name: r, match: {models: [gtp-4]}, action: {fallThrough: true}}"),
            "InferencePolicy default/p",
            "spec.rules[0].match.models[0]",
            "matches no InferenceModel",
        ),
        (
            policy(
                "{name: r, match: {promptClasses: {anyOf: [pi]}}, action: {requireLocal: true}}",
            ),
            "InferencePolicy default/p",
            "spec.rules[0].match.promptClasses.anyOf[0]",
            "unknown prompt class 'pi'",
        ),
        (
            policy(
                "{name: r, match: {poolState: {pool: nowhere, queueDepth: {gt: 1}}}, action: {fallThrough: true}}",
            ),
            "InferencePolicy default/p",
            "spec.rules[0].match.poolState.pool",
            "no InferencePool default/nowhere",
        ),
        (
            policy("{name: r, match: {poolState: {}}, action: {fallThrough: true}}"),
            "InferencePolicy default/p",
            "spec.rules[0].match.poolState",
            "at least one of",
        ),
        (
            policy("{name: r, match: {maxTokens: {gt: 10, lt: 5}}, action: {fallThrough: true}}"),
            "InferencePolicy default/p",
            "spec.rules[0].match.maxTokens",
            "can never match",
        ),
        (
            policy(
                "{name: r, match: {poolState: {kvUsagePercent: {gt: 120}}}, action: {fallThrough: true}}",
            ),
            "InferencePolicy default/p",
            "spec.rules[0].match.poolState.kvUsagePercent",
            "up to 100",
        ),
        (
            policy("{name: r, action: {}}"),
            "InferencePolicy default/p",
            "spec.rules[0].action",
            "exactly one of route, reject, requireLocal or fallThrough (0 given)",
        ),
        (
            policy("{name: r, action: {requireLocal: true, fallThrough: true}}"),
            "InferencePolicy default/p",
            "spec.rules[0].action",
            "(2 given)",
        ),
        (
            policy("{name: r, action: {reject: {status: 200, message: ok}}}"),
            "InferencePolicy default/p",
            "spec.rules[0].action.reject.status",
            "not an error status",
        ),
        (
            policy(
                "{name: r, action: {reject: {status: 429, message: busy, retryAfterSeconds: 0}}}",
            ),
            "InferencePolicy default/p",
            "spec.rules[0].action.reject.retryAfterSeconds",
            "between 1 and 86400",
        ),
        (
            policy("{name: r, action: {reject: {status: 429, message: \" \"}}}"),
            "InferencePolicy default/p",
            "spec.rules[0].action.reject.message",
            "the client sees this message",
        ),
        (
            policy("{name: r, action: {route: {inferenceModel: missing}}}"),
            "InferencePolicy default/p",
            "spec.rules[0].action.route.inferenceModel",
            "no InferenceModel named 'missing'",
        ),
        (
            policy("{name: r, action: {route: {provider: cloud}}}"),
            "InferencePolicy default/p",
            "spec.rules[0].action.route.model",
            "required with a provider",
        ),
        (
            policy("{name: r, action: {requireLocal: false}}"),
            "InferencePolicy default/p",
            "spec.rules[0].action.requireLocal",
            "only `true`",
        ),
        (
            policy(
                "{name: r, action: {fallThrough: true}}, {name: r, action: {fallThrough: true}}",
            ),
            "InferencePolicy default/p",
            "spec.rules[1].name",
            "used twice",
        ),
        (
            policy("{name: r, mtach: {}, action: {fallThrough: true}}"),
            "InferencePolicy default/p",
            "spec.rules[0].mtach",
            "unknown field `mtach`, expected one of `name`, `match`, `action`",
        ),
        (
            document(
                "InferencePolicy",
                "p",
                "{classes: [{name: c, patterns: [\"(unclosed\"]}]}",
            ),
            "InferencePolicy default/p",
            "spec.classes[0].patterns[0]",
            "invalid regular expression",
        ),
        (
            document(
                "InferencePolicy",
                "p",
                "{classes: [{name: pii, keywords: [x]}]}",
            ),
            "InferencePolicy default/p",
            "spec.classes[0].name",
            "built-in class",
        ),
        (
            document("InferencePolicy", "p", "{classes: [{name: empty}]}"),
            "InferencePolicy default/p",
            "spec.classes[0]",
            "needs keywords or patterns",
        ),
        (
            format!(
                "{}{}",
                document("InferencePolicy", "a", "{complexity: {maxSimpleChars: 10}}"),
                document("InferencePolicy", "b", "{complexity: {maxSimpleTurns: 2}}")
            ),
            "InferencePolicy default/b",
            "spec.complexity",
            "already set by InferencePolicy default/a",
        ),
    ]
}

#[test]
fn bad_documents_are_rejected_with_field_and_reason() {
    let mut failures = Vec::new();
    for (extra, label, field, fragment) in cases() {
        let text = format!("{BASE}{extra}");
        match switchyard_snapshot::load_str("bad.yaml", &text) {
            Ok(_) => failures.push(format!("accepted: {extra}")),
            Err(errors) => {
                let hit = errors.iter().any(|e| {
                    e.document == label && e.field == field && e.message.contains(fragment)
                });
                if !hit {
                    failures.push(format!(
                        "{extra}\n  want {label} / {field} / '{fragment}'\n  got {errors}"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn the_base_and_the_shipped_examples_compile() {
    switchyard_snapshot::load_str("base.yaml", BASE).unwrap();
    let examples = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../conf/examples");
    let snapshot = switchyard_snapshot::load_paths(&[examples]).unwrap();
    assert_eq!(snapshot.rules.len(), 4);
    assert_eq!(snapshot.tenants.len(), 3);
    assert_eq!(snapshot.providers.len(), 1);
}
