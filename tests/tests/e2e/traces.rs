//! OTLP traces into a real OpenTelemetry Collector (built from its Go modules by
//! scripts/tools.sh: otlp receiver → file exporter): one span per request with the routing facts,
//! the caller's trace continued, the gateway's span context passed to the worker in
//! `traceparent`, no prompt text; over gRPC and over HTTP/protobuf.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use switchyard_e2e::{
    Proxy, Sim, Upstream, default_config_for, free_port, free_ports, key_sha256, workspace_root,
};

const KEY: &str = "sk-trace-test";
const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";
/// Appears in every prompt; must never reach the collector.
const SECRET_MARKER: &str = "PROMPT-TEXT-MUST-NOT-LEAK-7351";

struct Collector {
    child: Child,
    grpc: u16,
    http: u16,
    file: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Collector {
    async fn start() -> Collector {
        let binary = workspace_root().join(".cache/tools/otelcol");
        assert!(
            binary.exists(),
            "{} is missing: run scripts/tools.sh (scripts/test.sh does)",
            binary.display()
        );
        let dir = tempfile::tempdir().unwrap();
        let [grpc, http] = free_ports();
        let file = dir.path().join("traces.jsonl");
        let config = format!(
            "receivers:\n  otlp:\n    protocols:\n      grpc: {{endpoint: \"127.0.0.1:{grpc}\"}}\n      http: {{endpoint: \"127.0.0.1:{http}\"}}\n\
             exporters:\n  file:\n    path: {}\n    flush_interval: 100ms\n\
             service:\n  telemetry:\n    metrics: {{level: none}}\n    logs: {{level: warn}}\n  pipelines:\n    traces: {{receivers: [otlp], exporters: [file]}}\n",
            file.display()
        );
        let config_path = dir.path().join("otelcol.yaml");
        std::fs::write(&config_path, config).unwrap();
        let child = Command::new(binary)
            .arg("--config")
            .arg(&config_path)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let collector = Collector {
            child,
            grpc,
            http,
            file,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", collector.grpc)).is_err()
            || std::net::TcpStream::connect(("127.0.0.1", collector.http)).is_err()
        {
            assert!(Instant::now() < deadline, "collector never listened");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        collector
    }

    fn raw(&self) -> String {
        std::fs::read_to_string(&self.file).unwrap_or_default()
    }

    /// Every span the collector wrote, with its resource's service name.
    fn spans(&self) -> Vec<(String, Value)> {
        let mut spans = Vec::new();
        for line in self.raw().lines().filter(|l| !l.trim().is_empty()) {
            let batch: Value = serde_json::from_str(line).unwrap();
            for resource in batch["resourceSpans"].as_array().into_iter().flatten() {
                let service = attribute(&resource["resource"], "service.name")
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default();
                for scope in resource["scopeSpans"].as_array().into_iter().flatten() {
                    for span in scope["spans"].as_array().into_iter().flatten() {
                        spans.push((service.clone(), span.clone()));
                    }
                }
            }
        }
        spans
    }

    /// Wait for a span of `service` that `accept` likes.
    async fn wait_span(&self, service: &str, accept: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some((_, span)) = self
                .spans()
                .into_iter()
                .find(|(s, span)| s == service && accept(span))
            {
                return span;
            }
            assert!(
                Instant::now() < deadline,
                "no matching span from {service}; collector has:\n{}",
                self.raw()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An attribute's OTLP JSON value (`{"stringValue": ..}`, `{"intValue": "5"}`, ...) as JSON.
fn attribute(holder: &Value, key: &str) -> Option<Value> {
    let value = holder["attributes"]
        .as_array()?
        .iter()
        .find(|a| a["key"] == key)?["value"]
        .clone();
    let object = value.as_object()?;
    let (kind, inner) = object.iter().next()?;
    Some(match (kind.as_str(), inner) {
        ("intValue", Value::String(text)) => json!(text.parse::<i64>().ok()?),
        _ => inner.clone(),
    })
}

fn config(sim: &Sim, recorder: &Upstream) -> String {
    let mut config = default_config_for(sim);
    let key_sha256 = key_sha256(KEY);
    config.push_str(&format!(
        "\n---\napiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: recorder}}\nspec: {{model: rec, endpoints: [\"{}\"], loadBalancing: least-outstanding}}\n\
         ---\napiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: rec}}\nspec: {{targets: [{{pool: recorder}}]}}\n\
         ---\napiVersion: switchyard.dev/v1alpha1\nkind: Tenant\nmetadata: {{name: tracing-team}}\nspec: {{apiKeys: [{{sha256: {key_sha256}}}]}}\n\
         ---\napiVersion: switchyard.dev/v1alpha1\nkind: InferencePolicy\nmetadata: {{name: traced}}\nspec:\n  rules:\n    - name: default-model-stays\n      match: {{models: [default]}}\n      action: {{fallThrough: true}}\n",
        recorder.endpoint()
    ));
    config
}

async fn chat(proxy: &Proxy, model: &str, prompt: &str, traceparent: Option<&str>) -> Value {
    let mut request = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", proxy.url()))
        .bearer_auth(KEY)
        .json(&json!({"model": model, "max_tokens": 2,
                      "messages": [{"role": "user", "content": prompt}]}));
    if let Some(traceparent) = traceparent {
        request = request.header("traceparent", traceparent);
    }
    let response = request.send().await.unwrap();
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

async fn traced_proxy(
    collector: &Collector,
    sim: &Sim,
    recorder: &Upstream,
    protocol: &str,
    service: &str,
    extra_env: &[(&str, &str)],
) -> Proxy {
    let endpoint = match protocol {
        "grpc" => format!("http://127.0.0.1:{}", collector.grpc),
        _ => format!("http://127.0.0.1:{}", collector.http),
    };
    let mut env = vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", protocol),
        ("OTEL_SERVICE_NAME", service),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    env.extend_from_slice(extra_env);
    Proxy::start_with_env(&config(sim, recorder), &[], &env).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_spans_reach_a_real_collector() {
    let collector = Collector::start().await;
    let sim = Sim::start(&["--workers", "3", "--time-scale", "0.001"]);
    let recorder = Upstream::start("recorder").await;
    let proxy = traced_proxy(&collector, &sim, &recorder, "grpc", "switchyard-grpc", &[]).await;

    // The caller's trace continues through the gateway to the worker.
    let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    chat(
        &proxy,
        "rec",
        &format!("hello {SECRET_MARKER}"),
        Some(&traceparent),
    )
    .await;
    let span = collector
        .wait_span("switchyard-grpc", |s| s["traceId"] == CLIENT_TRACE)
        .await;
    assert_eq!(span["parentSpanId"], CLIENT_SPAN);
    assert_eq!(span["name"], "POST /v1/chat/completions");
    assert_eq!(span["kind"], 2, "a server span: {span}");
    let upstream_traceparent = recorder.received()[0]
        .headers
        .get("traceparent")
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        upstream_traceparent,
        format!("00-{CLIENT_TRACE}-{}-01", span["spanId"].as_str().unwrap()),
        "the worker gets the gateway's span as its parent"
    );
    assert_eq!(
        attribute(&span, "switchyard.tenant"),
        Some(json!("tracing-team"))
    );
    assert_eq!(attribute(&span, "gen_ai.request.model"), Some(json!("rec")));
    assert_eq!(
        attribute(&span, "switchyard.target"),
        Some(json!("pool default/recorder"))
    );
    assert_eq!(
        attribute(&span, "switchyard.worker"),
        Some(json!(recorder.endpoint()))
    );
    assert_eq!(
        attribute(&span, "http.response.status_code"),
        Some(json!(200))
    );
    assert!(
        attribute(&span, "switchyard.ttft.actual_ms").is_some(),
        "{span}"
    );

    // Cache-aware routing: the policy rule, the matched prefix and both TTFTs. The same long
    // prompt again, until the workers' KV events have told the index about it.
    let prompt = format!(
        "{SECRET_MARKER} {}",
        "Summarise the quarterly report for the board in three sentences. ".repeat(12)
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let cached = loop {
        chat(&proxy, "default", &prompt, None).await;
        let spans = collector.spans();
        if let Some((_, span)) = spans.into_iter().find(|(service, span)| {
            service == "switchyard-grpc"
                && attribute(span, "switchyard.prefix.matched_tokens")
                    .and_then(|v| v.as_i64())
                    .is_some_and(|t| t > 0)
        }) {
            break span;
        }
        assert!(
            Instant::now() < deadline,
            "no span with matched prefix tokens:\n{}",
            collector.raw()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        attribute(&cached, "switchyard.policy.rule"),
        Some(json!("default/traced/default-model-stays"))
    );
    assert_eq!(
        attribute(&cached, "switchyard.target"),
        Some(json!("pool default/local"))
    );
    let worker = attribute(&cached, "switchyard.worker").unwrap();
    assert!(
        sim.workers.iter().any(|w| json!(w.http) == worker),
        "{worker} is not a simulated worker"
    );
    let predicted = attribute(&cached, "switchyard.ttft.predicted_ms").unwrap();
    assert!(predicted.as_f64().unwrap() >= 0.0, "{cached}");
    assert!(attribute(&cached, "switchyard.ttft.actual_ms").is_some());
    assert!(attribute(&cached, "gen_ai.usage.input_tokens").is_some());
    eprintln!("a cache-aware request's span: {cached}");

    // The same over OTLP/HTTP (protobuf), the other protocol collectors listen on.
    let http_proxy = traced_proxy(
        &collector,
        &sim,
        &recorder,
        "http/protobuf",
        "switchyard-http",
        &[],
    )
    .await;
    chat(
        &http_proxy,
        "rec",
        &format!("over http {SECRET_MARKER}"),
        None,
    )
    .await;
    let span = collector.wait_span("switchyard-http", |_| true).await;
    assert_eq!(
        attribute(&span, "switchyard.tenant"),
        Some(json!("tracing-team"))
    );
    assert!(
        span["parentSpanId"].as_str().unwrap_or("").is_empty(),
        "no caller trace: a root span, not {span}"
    );

    // The chart's sampling settings: a ratio of 0 drops the gateway's own traces, and a caller's
    // sampled trace is still followed (parent-based), with the context passed on either way.
    let sampled = traced_proxy(
        &collector,
        &sim,
        &recorder,
        "grpc",
        "switchyard-sampled",
        &[
            ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
            ("OTEL_TRACES_SAMPLER_ARG", "0.0"),
        ],
    )
    .await;
    for _ in 0..5 {
        chat(&sampled, "rec", "unsampled", None).await;
    }
    let followed = "00-11111111111111111111111111111111-2222222222222222-01";
    chat(&sampled, "rec", "sampled by the caller", Some(followed)).await;
    let span = collector
        .wait_span("switchyard-sampled", |s| {
            s["traceId"] == "11111111111111111111111111111111"
        })
        .await;
    assert_eq!(span["parentSpanId"], "2222222222222222");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let from_sampled = collector
        .spans()
        .iter()
        .filter(|(service, _)| service == "switchyard-sampled")
        .count();
    assert_eq!(
        from_sampled, 1,
        "ratio 0 still exported the gateway's own traces"
    );
    let unsampled = recorder.received();
    let unsampled = unsampled
        .iter()
        .rev()
        .nth(1)
        .and_then(|r| r.headers.get("traceparent"))
        .and_then(|v| v.to_str().ok())
        .unwrap();
    assert!(
        unsampled.ends_with("-00"),
        "an unsampled context goes upstream: {unsampled}"
    );

    // A collector that is down costs requests nothing: export happens off the request path.
    let nowhere = format!("http://127.0.0.1:{}", free_port());
    let orphan = Proxy::start_with_env(
        &config(&sim, &recorder),
        &[],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", nowhere.as_str()),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "500"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    )
    .await;
    for _ in 0..20 {
        chat(&orphan, "rec", "collector down", None).await;
    }
    // ... and the operator hears about it, once.
    orphan
        .wait_for_log("cannot export traces", Duration::from_secs(20))
        .await;
    assert_eq!(orphan.log().matches("cannot export traces").count(), 1);

    // Probes are not traced, and no prompt text ever reaches the collector.
    reqwest::get(format!("{}/health", proxy.url()))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        !collector
            .spans()
            .iter()
            .any(|(_, s)| s["name"].as_str().unwrap_or("").contains("health")),
        "health probes were traced"
    );
    assert!(
        !collector.raw().contains(SECRET_MARKER),
        "prompt text reached the collector"
    );
    assert!(
        !collector.raw().contains(KEY),
        "an API key reached the collector"
    );
}
