//! Every bad input and every unavailable upstream gets a clear error in the client's own format.

use serde_json::{Value, json};
use switchyard_e2e::{Proxy, free_port, one_worker_proxy, pool_config};

struct Answer {
    status: u16,
    body: Value,
}

async fn send(proxy: &Proxy, method: reqwest::Method, path: &str, body: Option<&[u8]>) -> Answer {
    let mut request = reqwest::Client::new().request(method, format!("{}{path}", proxy.url()));
    if let Some(body) = body {
        request = request
            .header("content-type", "application/json")
            .body(body.to_vec());
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    let body =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}"));
    Answer { status, body }
}

fn assert_openai(answer: &Answer, status: u16, message_part: &str) {
    assert_eq!(answer.status, status, "{}", answer.body);
    let message = answer.body["error"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("not an OpenAI error: {}", answer.body));
    assert!(answer.body["error"]["type"].is_string(), "{}", answer.body);
    assert!(
        answer.body["error"].get("code").is_some(),
        "{}",
        answer.body
    );
    assert!(
        message.contains(message_part),
        "{message:?} lacks {message_part:?}"
    );
}

fn assert_anthropic(answer: &Answer, status: u16, error_type: &str, message_part: &str) {
    assert_eq!(answer.status, status, "{}", answer.body);
    assert_eq!(answer.body["type"], "error", "{}", answer.body);
    assert_eq!(answer.body["error"]["type"], error_type, "{}", answer.body);
    let message = answer.body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(message_part),
        "{message:?} lacks {message_part:?}"
    );
}

#[tokio::test]
async fn bad_requests_get_openai_errors_on_openai_paths() {
    let (worker, proxy) = one_worker_proxy("w1", "m", &["m"], &["--max-body-bytes", "4096"]).await;
    let post = reqwest::Method::POST;
    let chat = "/v1/chat/completions";

    assert_openai(
        &send(&proxy, post.clone(), chat, Some(b"{not json")).await,
        400,
        "malformed JSON",
    );
    assert_openai(
        &send(&proxy, post.clone(), chat, Some(b"")).await,
        400,
        "empty",
    );
    assert_openai(
        &send(
            &proxy,
            post.clone(),
            chat,
            Some(br#"{"messages":[{"role":"user","content":"x"}]}"#),
        )
        .await,
        400,
        "'model'",
    );
    assert_openai(
        &send(&proxy, post.clone(), chat, Some(br#"{"model":"m"}"#)).await,
        400,
        "'messages'",
    );
    assert_openai(
        &send(
            &proxy,
            post.clone(),
            "/v1/completions",
            Some(br#"{"model":"m"}"#),
        )
        .await,
        400,
        "'prompt'",
    );
    let unknown = send(
        &proxy,
        post.clone(),
        chat,
        Some(br#"{"model":"nope","messages":[{"role":"user","content":"x"}]}"#),
    )
    .await;
    assert_openai(&unknown, 404, "GET /v1/models");
    assert_eq!(unknown.body["error"]["code"], "model_not_found");
    let big = serde_json::to_vec(
        &json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(5000)}]}),
    )
    .unwrap();
    assert_openai(
        &send(&proxy, post.clone(), chat, Some(&big)).await,
        413,
        "4096",
    );
    assert_openai(
        &send(&proxy, reqwest::Method::GET, chat, None).await,
        405,
        "POST",
    );
    assert_openai(
        &send(&proxy, post.clone(), "/v1/embeddings-typo", Some(b"{}")).await,
        404,
        "unknown path",
    );

    // None of it reached the worker, and the proxy still serves good requests.
    assert!(worker.received().is_empty());
    let ok = send(
        &proxy,
        post,
        chat,
        Some(br#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#),
    )
    .await;
    assert_eq!(ok.status, 200);
}

#[tokio::test]
async fn bad_requests_get_anthropic_errors_on_the_messages_path() {
    let (worker, proxy) = one_worker_proxy("w1", "m", &["m"], &["--max-body-bytes", "4096"]).await;
    let post = reqwest::Method::POST;
    let path = "/v1/messages";
    assert_anthropic(
        &send(&proxy, post.clone(), path, Some(b"{oops")).await,
        400,
        "invalid_request_error",
        "malformed JSON",
    );
    assert_anthropic(
        &send(
            &proxy,
            post.clone(),
            path,
            Some(br#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#),
        )
        .await,
        400,
        "invalid_request_error",
        "max_tokens",
    );
    assert_anthropic(
        &send(&proxy, post.clone(), path, Some(br#"{"model":"claude-x","max_tokens":5,"messages":[{"role":"user","content":"x"}]}"#)).await,
        404,
        "not_found_error",
        "GET /v1/models",
    );
    let big = serde_json::to_vec(&json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x".repeat(5000)}]})).unwrap();
    assert_anthropic(
        &send(&proxy, post, path, Some(&big)).await,
        413,
        "request_too_large",
        "4096",
    );
    assert!(worker.received().is_empty());
}

#[tokio::test]
async fn no_reachable_worker_is_502_and_no_worker_at_all_is_503() {
    let dead = format!("127.0.0.1:{}", free_port());
    let mut yaml = pool_config("dead", "m", &[dead], "  maxAttempts: 2\n", &["dead"]);
    // A Kubernetes-style pool outside Kubernetes has no endpoints until the control process finds pods.
    yaml.push_str(
        "\n---\napiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata:\n  name: empty\nspec:\n  model: m\n  selector: {app: vllm}\n  targetPort: 8000\n",
    );
    yaml.push_str(&switchyard_e2e::model_doc("empty", "empty", None));
    let proxy = Proxy::start(&yaml, &[]).await;
    let body = |model: &str| {
        serde_json::to_vec(&json!({"model": model, "messages": [{"role": "user", "content": "x"}]}))
            .unwrap()
    };
    let answer = send(
        &proxy,
        reqwest::Method::POST,
        "/v1/chat/completions",
        Some(&body("dead")),
    )
    .await;
    assert_openai(&answer, 502, "could not");
    let answer = send(
        &proxy,
        reqwest::Method::POST,
        "/v1/chat/completions",
        Some(&body("empty")),
    )
    .await;
    assert_openai(&answer, 503, "no workers");
    let anthropic = serde_json::to_vec(
        &json!({"model": "dead", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}),
    )
    .unwrap();
    let answer = send(
        &proxy,
        reqwest::Method::POST,
        "/v1/messages",
        Some(&anthropic),
    )
    .await;
    assert_anthropic(&answer, 502, "api_error", "could not");
}

#[tokio::test]
async fn an_invalid_config_at_start_is_refused_with_every_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.yaml");
    std::fs::write(
        &path,
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {name: p}\nspec: {model: m, endpoints: [\"nope\"]}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {name: a}\nspec: {targets: [{pool: missing}]}\n",
    )
    .unwrap();
    let output = std::process::Command::new(switchyard_e2e::process::binary("switchyard-proxy"))
        .arg("--config")
        .arg(&path)
        .arg("--check")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("spec.endpoints[0]"), "{stderr}");
    assert!(stderr.contains("spec.targets[0].pool"), "{stderr}");
    assert!(stderr.contains("bad.yaml"), "{stderr}");
}

#[test]
fn a_tokenizer_that_cannot_be_loaded_is_reported_by_check() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool.yaml");
    std::fs::write(
        &path,
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {name: p}\n\
         spec: {model: m, endpoints: [\"127.0.0.1:9\"], tokenizer: {path: /nonexistent/tokenizer.json, chatTemplate: /nonexistent/t.jinja}}\n\
         ---\napiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {name: m}\nspec: {targets: [{pool: p}]}\n",
    )
    .unwrap();
    let output = std::process::Command::new(switchyard_e2e::process::binary("switchyard-proxy"))
        .arg("--config")
        .arg(&path)
        .arg("--check")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("/nonexistent/tokenizer.json"), "{stderr}");
}

#[test]
fn a_listen_address_that_cannot_be_bound_stops_the_proxy() {
    // Pingora binds on its service threads and only logs a failure; the proxy checks first,
    // so a shared or taken address is an error at start, not a missing listener.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    let [port] = switchyard_e2e::free_ports();
    let same = format!("127.0.0.1:{port}");
    for (listen, admin, flag) in [
        (same.as_str(), same.as_str(), "--admin-listen"),
        (taken.as_str(), "off", "--listen"),
    ] {
        let mut child =
            std::process::Command::new(switchyard_e2e::process::binary("switchyard-proxy"))
                .args(["--listen", listen, "--admin-listen", admin])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
        // A proxy that starts anyway would serve forever: stop it and fail.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if std::time::Instant::now() > deadline {
                child.kill().unwrap();
                child.wait().unwrap();
                break None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
        assert!(
            status.is_some_and(|s| !s.success()),
            "{listen} {admin}: {stderr}"
        );
        // (The shared port may also have been taken by another process meanwhile: then the
        // main listener is the one refused.)
        assert!(
            stderr.contains(&format!("cannot listen on {flag}"))
                || (listen == admin && stderr.contains("cannot listen on --listen")),
            "{stderr}"
        );
    }
}

#[tokio::test]
async fn client_strings_are_escaped_and_bounded_in_errors_and_logs() {
    let (_upstream, proxy) = one_worker_proxy("w1", "m", &["m"], &[]).await;
    let forged = "m\n2026-12-03T00:00:00.000000Z ERROR switchyard_proxy: forged line";
    let huge = "x".repeat(1_000_000);
    for (path, model) in [
        ("/v1/chat/completions", forged),
        ("/v1/messages", forged),
        ("/v1/chat/completions", huge.as_str()),
    ] {
        let body = json!({"model": model, "max_tokens": 4,
                          "messages": [{"role": "user", "content": "hi"}]});
        let answer = send(
            &proxy,
            reqwest::Method::POST,
            path,
            Some(body.to_string().as_bytes()),
        )
        .await;
        assert_eq!(answer.status, 404);
        let message = answer.body["error"]["message"].as_str().unwrap();
        assert!(message.len() < 400, "{} bytes echoed", message.len());
        assert!(!message.contains('\n'), "{message}");
    }
    // Also a 1 MB value quoted by the parser.
    let body = json!({"model": "m", "max_tokens": huge,
                      "messages": [{"role": "user", "content": "hi"}]});
    let answer = send(
        &proxy,
        reqwest::Method::POST,
        "/v1/chat/completions",
        Some(body.to_string().as_bytes()),
    )
    .await;
    assert_eq!(answer.status, 400);
    assert!(answer.body["error"]["message"].as_str().unwrap().len() < 1_200);
    proxy
        .wait_for_log("request rejected", std::time::Duration::from_secs(5))
        .await;
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let log = proxy.log();
    assert!(
        !log.lines()
            .any(|line| line.contains("forged line") && !line.contains("request_id")),
        "a client string forged a log line:\n{log}"
    );
    let longest = log.lines().map(str::len).max().unwrap_or(0);
    assert!(longest < 4_096, "a {longest}-byte log line");
}
