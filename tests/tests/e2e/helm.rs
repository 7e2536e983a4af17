//! The Helm chart: `helm lint` and `helm template` with a Helm built from its Go modules
//! (`scripts/tools.sh`), and the rendered manifests checked for what the layout promises.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;
use switchyard_e2e::process::binary;
use switchyard_e2e::workspace_root;

fn helm() -> PathBuf {
    let path = std::env::var_os("SWITCHYARD_HELM")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".cache/tools/helm"));
    assert!(
        path.exists(),
        "{} is missing: run scripts/tools.sh (scripts/test.sh does)",
        path.display()
    );
    path
}

/// `helm args` from the workspace root; its stdout (the test fails if helm does).
pub(crate) fn run_helm(args: &[&str]) -> String {
    run_helm_with(args, |_| {})
}

/// [`run_helm`] with `configure` adding to the command (flags after `args`, environment).
pub(crate) fn run_helm_with(args: &[&str], configure: impl FnOnce(&mut Command)) -> String {
    let mut command = Command::new(helm());
    command.args(args).current_dir(workspace_root());
    configure(&mut command);
    let output = command.output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "helm {args:?} failed\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

fn documents(text: &str) -> Vec<Value> {
    serde_norway::Deserializer::from_str(text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .filter(|v: &Value| !v.is_null())
        .collect()
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

#[test]
fn chart_lints_renders_and_keeps_its_promises() {
    let lint = run_helm(&["lint", "--strict", "helm/switchyard"]);
    assert!(lint.contains("0 chart(s) failed"), "{lint}");
    let rendered = run_helm(&["template", "gw", "helm/switchyard", "--include-crds"]);
    let docs = documents(&rendered);
    assert_eq!(of_kind(&docs, "CustomResourceDefinition").len(), 5);
    // Default: the control reads the CRDs; no ConfigMap of documents, a Role for exactly that.
    assert_eq!(of_kind(&docs, "ConfigMap").len(), 1);
    let role = of_kind(&docs, "Role")[0];
    let verbs: Vec<String> = role["rules"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r["verbs"].as_array().unwrap().iter())
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    assert!(
        verbs
            .iter()
            .all(|v| ["list", "watch", "patch", "create", "get", "update"].contains(&v.as_str())),
        "{verbs:?}"
    );
    // get/update only on the election Lease, by name.
    for rule in role["rules"].as_array().unwrap() {
        let verbs = rule["verbs"].to_string();
        if verbs.contains("get") || verbs.contains("update") {
            assert_eq!(rule["resources"], serde_json::json!(["leases"]), "{rule}");
            assert_eq!(
                rule["resourceNames"],
                serde_json::json!(["gw-control"]),
                "{rule}"
            );
        }
    }
    assert!(role.to_string().contains("secrets"));
    assert!(
        !documents(&run_helm(&[
            "template",
            "gw",
            "helm/switchyard",
            "--set",
            "control.readSecrets=false",
        ]))
        .iter()
        .any(|d| d["kind"] == "Role" && d.to_string().contains("secrets")),
        "readSecrets=false still grants secrets"
    );
    assert_eq!(
        of_kind(&docs, "RoleBinding")[0]["roleRef"]["name"],
        "gw-control"
    );
    // The tenants' Service, and a headless one by which the two replicas find each other.
    let services = of_kind(&docs, "Service");
    assert_eq!(services.len(), 2);
    let peers = services
        .iter()
        .find(|s| s["spec"]["clusterIP"] == "None")
        .expect("headless peers Service");
    assert_eq!(peers["spec"]["clusterIP"], "None");
    assert_eq!(peers["spec"]["ports"][0]["targetPort"], "admin");
    // The replicas' ledgers travel as datagrams on the admin port.
    assert_eq!(peers["spec"]["ports"][1]["targetPort"], "ledgers");
    assert_eq!(peers["spec"]["ports"][1]["protocol"], "UDP");
    // ...tagged under a key of their own, made at install (kept on upgrades through `lookup`,
    // which `helm template` cannot show), mounted for the proxy only.
    let secret = of_kind(&docs, "Secret")[0];
    assert_eq!(secret["metadata"]["name"], "gw-peers-key");
    let key = secret["data"]["key"].as_str().unwrap();
    assert!(key.len() >= 64, "{key}: 48 random characters, base64");
    let account = of_kind(&docs, "ServiceAccount")[0];
    assert_eq!(account["automountServiceAccountToken"], false);

    let deployment = of_kind(&docs, "Deployment")[0];
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["automountServiceAccountToken"], false);
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    let containers = pod["containers"].as_array().unwrap();
    let names: Vec<&str> = containers
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["control", "proxy"]);
    let proxy = &containers[1];
    let command = proxy["command"].to_string();
    assert!(
        command.contains(r#""--peers-key-file","/var/run/switchyard-peers/key""#),
        "{command}"
    );
    let mounted = |container: &Value| container["volumeMounts"].to_string().contains("peers-key");
    assert!(mounted(proxy) && !mounted(&containers[0]));
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "peers-key")
        .unwrap();
    assert_eq!(volume["secret"]["secretName"], "gw-peers-key");
    assert_eq!(volume["secret"]["defaultMode"], 0o440);
    let socket = "/run/switchyard/control.sock";
    for container in containers {
        let command: Vec<&str> = container["command"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert!(command.contains(&socket), "{command:?}");
        let mounts = container["volumeMounts"].as_array().unwrap();
        assert!(
            mounts
                .iter()
                .any(|m| m["name"] == "control-socket" && m["mountPath"] == "/run/switchyard")
        );
        assert_eq!(container["securityContext"]["readOnlyRootFilesystem"], true);
        assert!(container["resources"]["requests"].is_object());
    }
    // Only the control container holds an API token.
    let token_mounts = |c: &Value| {
        c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["name"] == "api-token")
            .count()
    };
    assert_eq!(token_mounts(&containers[0]), 1);
    assert_eq!(token_mounts(&containers[1]), 0);
    assert!(
        containers[0]["command"]
            .to_string()
            .contains("--kubernetes")
    );
    let proxy = &containers[1];
    assert_eq!(proxy["readinessProbe"]["httpGet"]["path"], "/ready");
    assert_eq!(proxy["livenessProbe"]["httpGet"]["path"], "/health");
    // The operator's listener: its own port, scraped through the pod's annotations, and not in
    // the tenants' Service.
    let command = proxy["command"].to_string();
    assert!(
        command.contains(r#""--admin-listen","0.0.0.0:9090""#),
        "{command}"
    );
    assert!(
        command.contains(r#""--header-timeout-s","10""#),
        "{command}"
    );
    assert!(
        proxy["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == "admin" && p["containerPort"] == 9090)
    );
    assert!(proxy["ports"].as_array().unwrap().iter().any(|p| {
        p["name"] == "ledgers" && p["containerPort"] == 9090 && p["protocol"] == "UDP"
    }));
    let annotations = &deployment["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/port"], "9090");
    assert_eq!(annotations["prometheus.io/path"], "/metrics");
    let service_ports = of_kind(&docs, "Service")[0]["spec"]["ports"].to_string();
    assert!(!service_ports.contains("admin"), "{service_ports}");
    let volumes = pod["volumes"].as_array().unwrap();
    assert!(
        volumes
            .iter()
            .any(|v| v["name"] == "control-socket" && v["emptyDir"]["medium"] == "Memory")
    );

    // The chart's CRDs are the generated ones, byte for byte.
    for entry in std::fs::read_dir(workspace_root().join("crds")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let name = path.file_name().unwrap();
            let copy = workspace_root().join("helm/switchyard/crds").join(name);
            assert_eq!(
                std::fs::read(&path).unwrap(),
                std::fs::read(&copy).unwrap_or_default(),
                "{} differs from crds/; copy it again",
                copy.display()
            );
        }
    }

    // configSource files: the documents as a ConfigMap, no Role, no token anywhere.
    let files = documents(&run_helm(&[
        "template",
        "gw",
        "helm/switchyard",
        "--set",
        "configSource=files",
    ]));
    assert!(of_kind(&files, "Role").is_empty());
    assert!(!files.iter().any(|d| d.to_string().contains("api-token")));
    // The shipped documents compile with the control process's own compiler.
    let config = of_kind(&files, "ConfigMap")
        .into_iter()
        .find(|c| c["metadata"]["name"] == "gw-config")
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    for (file, text) in config["data"].as_object().unwrap() {
        std::fs::write(dir.path().join(file), text.as_str().unwrap()).unwrap();
    }
    let check = Command::new(binary("switchyard-control"))
        .arg("check")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );

    // The dashboard is valid JSON over the per-tenant metrics.
    let dashboard = of_kind(&docs, "ConfigMap")
        .into_iter()
        .find(|c| c["metadata"]["name"] == "gw-dashboard")
        .unwrap();
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let json: Value = serde_json::from_str(
        dashboard["data"]["switchyard-tenants.json"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let exprs = json.to_string();
    for metric in [
        "switchyard_tenant_requests_total",
        "switchyard_tenant_ttft_seconds_bucket",
        "switchyard_tenant_rejections_total",
    ] {
        assert!(exprs.contains(metric), "dashboard lacks {metric}");
    }

    // Values flow through.
    let rendered = run_helm(&[
        "template",
        "gw",
        "helm/switchyard",
        "--set",
        "replicas=3",
        "--set",
        "logJson=false",
        "--set",
        "dashboard.enabled=false",
        "--set",
        "otlp.endpoint=http://collector.observability:4317",
    ]);
    let docs = documents(&rendered);
    let deployment = of_kind(&docs, "Deployment")[0];
    assert_eq!(deployment["spec"]["replicas"], 3);
    let proxy = &deployment["spec"]["template"]["spec"]["containers"][1];
    let proxy_command = proxy["command"].to_string();
    let peers_name = peers["metadata"]["name"].as_str().unwrap();
    assert!(
        proxy_command.contains(&format!("\"--peers\",\"{peers_name}.default.svc:9090\"")),
        "{proxy_command}"
    );
    assert!(!proxy_command.contains("--log-json"), "{proxy_command}");
    // Prompt pieces travel with the ledgers unless turned off.
    assert!(
        !proxy_command.contains("--peer-prompt-pieces"),
        "{proxy_command}"
    );
    let no_pieces = documents(&run_helm(&[
        "template",
        "gw",
        "helm/switchyard",
        "--set",
        "proxy.sharePromptPieces=false",
    ]));
    let command = of_kind(&no_pieces, "Deployment")[0]["spec"]["template"]["spec"]["containers"][1]
        ["command"]
        .to_string();
    assert!(
        command.contains(r#""--peer-prompt-pieces","false""#),
        "{command}"
    );
    let env = proxy["env"].to_string();
    assert!(
        env.contains("OTEL_EXPORTER_OTLP_ENDPOINT") && env.contains("collector.observability:4317"),
        "{env}"
    );
    assert!(of_kind(&docs, "ConfigMap").is_empty());

    // A key of the operator's own: no Secret made, theirs mounted.
    let own_key = documents(&run_helm(&[
        "template",
        "gw",
        "helm/switchyard",
        "--set",
        "proxy.peersKeySecret=fleet-key",
    ]));
    assert!(of_kind(&own_key, "Secret").is_empty());
    let deployment = of_kind(&own_key, "Deployment")[0].to_string();
    assert!(
        deployment.contains(r#""secretName":"fleet-key""#),
        "{deployment}"
    );

    // One replica has no peers, and no key.
    let single = documents(&run_helm(&[
        "template",
        "gw",
        "helm/switchyard",
        "--set",
        "replicas=1",
    ]));
    assert_eq!(of_kind(&single, "Service").len(), 1);
    assert!(of_kind(&single, "Secret").is_empty());
    let deployment = of_kind(&single, "Deployment")[0].to_string();
    assert!(
        !deployment.contains("--peers") && !deployment.contains("peers-key"),
        "{deployment}"
    );
}
