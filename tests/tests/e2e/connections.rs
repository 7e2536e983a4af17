//! Hostile and careless clients at the connection level: slow or malformed heads, broken framing,
//! stalled bodies, pipelining, too many connections, and the operator's surface kept off the
//! tenants' listener.

use std::time::Duration;

use serde_json::{Value, json};
use switchyard_e2e::{Proxy, Upstream, UpstreamOptions, one_worker_proxy, pool_config};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Everything the proxy sends until it closes the connection; panics if it is still open after
/// `limit` (far above any deadline under test: the point is that it closes at all).
async fn read_to_close(stream: &mut TcpStream, limit: Duration) -> String {
    let mut answer = Vec::new();
    tokio::time::timeout(limit, stream.read_to_end(&mut answer))
        .await
        .unwrap_or_else(|_| {
            panic!(
                "connection still open after {limit:?}; got so far: {}",
                String::from_utf8_lossy(&answer)
            )
        })
        .ok();
    String::from_utf8_lossy(&answer).into_owned()
}

async fn connect(proxy: &Proxy) -> TcpStream {
    TcpStream::connect(("127.0.0.1", proxy.port)).await.unwrap()
}

/// Write `request` on a new connection and read everything until the proxy closes it.
async fn exchange(proxy: &Proxy, request: &[u8]) -> String {
    let mut stream = connect(proxy).await;
    stream.write_all(request).await.unwrap();
    read_to_close(&mut stream, LONG).await
}

/// Status and JSON body of the one answer in `raw`.
fn answer(raw: &str) -> (u16, Value) {
    let status = raw
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {raw:?}"));
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, body)| body)
        .unwrap_or_default();
    let body = serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {raw:?}"));
    (status, body)
}

fn closes(raw: &str) -> bool {
    raw.to_ascii_lowercase()
        .contains("\r\nconnection: close\r\n")
}

const LONG: Duration = Duration::from_secs(30);

/// Send `start`, then one more header byte every 200 ms for as long as the connection takes
/// them; everything the proxy answered before it closed (within [`LONG`]).
async fn drip(proxy: &Proxy, start: &[u8]) -> String {
    let mut stream = connect(proxy).await;
    stream.write_all(start).await.unwrap();
    let (mut reader, mut writer) = stream.into_split();
    let dripping = tokio::spawn(async move {
        for _ in 0..150 {
            if writer.write_all(b"a").await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    let mut raw = Vec::new();
    tokio::time::timeout(LONG, reader.read_to_end(&mut raw))
        .await
        .expect("a dripping head must not hold the connection")
        .ok();
    dripping.abort();
    String::from_utf8_lossy(&raw).into_owned()
}

#[tokio::test]
async fn malformed_heads_get_api_errors_and_the_connection_closes() {
    let (_worker, proxy) = one_worker_proxy("w1", "m", &["m"], &[]).await;

    // A request line that is not HTTP: answered at once, not after a timeout.
    let mut stream = connect(&proxy).await;
    stream.write_all(b"garbage\r\n").await.unwrap();
    let raw = read_to_close(&mut stream, LONG).await;
    let (status, body) = answer(&raw);
    assert_eq!(status, 400, "{raw}");
    assert_eq!(body["error"]["code"], "invalid_http_request", "{raw}");

    // 300 header fields on the Anthropic path: 431 in Anthropic's shape.
    let mut stream = connect(&proxy).await;
    let mut head = b"POST /v1/messages HTTP/1.1\r\nhost: x\r\n".to_vec();
    for i in 0..300 {
        head.extend_from_slice(format!("x-field-{i}: y\r\n").as_bytes());
    }
    head.extend_from_slice(b"content-length: 2\r\n\r\n{}");
    stream.write_all(&head).await.unwrap();
    let raw = read_to_close(&mut stream, LONG).await;
    let (status, body) = answer(&raw);
    assert_eq!(status, 431, "{raw}");
    assert_eq!(body["type"], "error", "{raw}");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{raw}");
    assert!(closes(&raw), "{raw}");

    // A 1.5 MB header: 431 in OpenAI's shape on an OpenAI path, without reading it all.
    let mut stream = connect(&proxy).await;
    let mut head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-big: ".to_vec();
    head.extend(std::iter::repeat_n(b'a', 1_500_000));
    head.extend_from_slice(b"\r\n\r\n");
    // The proxy answers and closes before the client is done writing; that write may fail.
    let _ = stream.write_all(&head).await;
    let raw = read_to_close(&mut stream, LONG).await;
    let (status, body) = answer(&raw);
    assert_eq!(status, 431, "{raw}");
    assert_eq!(body["error"]["code"], "request_header_too_large", "{raw}");

    // Conflicting Content-Length: 400, Anthropic shape on /v1/messages.
    let raw = exchange(&proxy, b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ncontent-length: 7\r\n\r\n{}").await;
    let (status, body) = answer(&raw);
    assert_eq!(status, 400, "{raw}");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{raw}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("Content-Length"),
        "{raw}"
    );

    let metrics = proxy.metrics().await;
    for reason in ["malformed_head", "head_too_large"] {
        assert!(
            metrics.contains(&format!(
                "switchyard_connections_refused_total{{reason=\"{reason}\"}}"
            )),
            "{reason} not counted:\n{metrics}"
        );
    }
}

#[tokio::test]
async fn slow_heads_stalled_bodies_and_idle_connections_are_closed() {
    let (_worker, proxy) = one_worker_proxy(
        "w1",
        "m",
        &["m"],
        &[
            "--header-timeout-s",
            "1",
            "--body-timeout-s",
            "1",
            "--idle-timeout-s",
            "1",
        ],
    )
    .await;

    // One header byte every 200 ms: the head deadline holds although every read makes progress.
    let raw = drip(&proxy, b"POST /v1/messages HTTP/1.1\r\nx-slow: ").await;
    let (status, body) = answer(&raw);
    assert_eq!(status, 408, "{raw}");
    assert_eq!(body["type"], "error", "Anthropic shape: {raw}");

    // A body that stops halfway: 408 and closed.
    let raw = exchange(&proxy, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\":").await;
    let (status, body) = answer(&raw);
    assert_eq!(status, 408, "{raw}");
    assert_eq!(body["error"]["code"], "request_timeout", "{raw}");
    assert!(closes(&raw), "{raw}");

    // A kept-alive connection that goes quiet after one answer is closed.
    let raw = exchange(&proxy, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n").await;
    assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");
    assert_eq!(raw.matches("HTTP/1.1").count(), 1, "{raw}");

    // The next head on a kept-alive connection has a deadline too.
    let raw = drip(
        &proxy,
        b"GET /health HTTP/1.1\r\nhost: x\r\n\r\nGET /health HTTP/1.1\r\nx-slow: ",
    )
    .await;
    assert_eq!(raw.matches("HTTP/1.1 200").count(), 1, "{raw}");
}

#[tokio::test]
async fn framing_errors_close_and_pipelined_requests_are_all_answered() {
    let (worker, proxy) = one_worker_proxy("w1", "m", &["m"], &[]).await;

    // A bad chunk size: 400, closed, and the request behind it on the same connection is not
    // taken from the broken stream.
    let raw = exchange(&proxy, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\nZZ\r\nab\r\n0\r\n\r\nGET /health HTTP/1.1\r\nhost: x\r\n\r\n").await;
    let (status, body) = answer(&raw);
    assert_eq!(status, 400, "{raw}");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{raw}");
    assert!(closes(&raw), "{raw}");
    assert_eq!(raw.matches("HTTP/1.1").count(), 1, "{raw}");

    // Three requests written back to back: three answers, in order.
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let mut pipeline = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{chat}",
        chat.len()
    );
    pipeline.push_str("GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n");
    pipeline.push_str("GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    let mut stream = connect(&proxy).await;
    stream.write_all(pipeline.as_bytes()).await.unwrap();
    let raw = read_to_close(&mut stream, LONG).await;
    assert_eq!(raw.matches("HTTP/1.1 200").count(), 3, "{raw}");
    let models = raw.find("\"object\":\"list\"").expect("models answer");
    let health = raw.find("{\"status\":\"ok\"}").expect("health answer");
    assert!(models < health, "answers out of order: {raw}");
    assert_eq!(worker.received().len(), 1);
}

/// Two requests pipelined on one connection, the second asking to close it: everything the proxy
/// answered before it closed.
async fn two_on_one_connection(proxy: &Proxy, path: &str, body: &Value) -> String {
    let body = body.to_string();
    let request = |close: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{close}\r\n{body}",
            body.len()
        )
    };
    let mut stream = connect(proxy).await;
    let pipeline = request("") + &request("connection: close\r\n");
    stream.write_all(pipeline.as_bytes()).await.unwrap();
    read_to_close(&mut stream, LONG).await
}

#[tokio::test]
async fn answers_the_gateway_rewrites_keep_the_connection_open() {
    // The worker answers whole with a Content-Length under its own model name; the gateway
    // renames the model to the client's alias, so the length changes and the body goes chunked.
    // Framed by closing the connection instead, the first answer would be the only one.
    let worker = Upstream::start("w1").await;
    let proxy = Proxy::start(
        &pool_config(
            "p",
            "org/served",
            &[worker.endpoint()],
            "  task: embed\n",
            &["alias"],
        ),
        &[],
    )
    .await;
    let embed = json!({"model": "alias", "input": "hello"});
    let raw = two_on_one_connection(&proxy, "/v1/embeddings", &embed).await;
    assert_eq!(raw.matches("HTTP/1.1 200").count(), 2, "{raw}");
    assert_eq!(raw.matches("\"model\":\"alias\"").count(), 2, "{raw}");
    assert!(!raw.contains("org/served\""), "{raw}");
    assert_eq!(
        raw.to_ascii_lowercase()
            .matches("transfer-encoding: chunked")
            .count(),
        2,
        "{raw}"
    );

    // An HTTP/1.0 client cannot take chunks: its answer ends with the connection, whole.
    let body = embed.to_string();
    let raw = exchange(
        &proxy,
        format!(
            "POST /v1/embeddings HTTP/1.0\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await;
    let (status, answer) = answer(&raw);
    assert_eq!((status, &answer["model"]), (200, &json!("alias")), "{raw}");
    assert!(
        !raw.to_ascii_lowercase().contains("transfer-encoding"),
        "{raw}"
    );

    // An error the worker answered whole is rewritten the same way.
    let failing = Upstream::start_with(
        "w2",
        UpstreamOptions {
            fail_with: Some(400),
            ..Default::default()
        },
    )
    .await;
    let proxy = Proxy::start(
        &pool_config("p", "org/served", &[failing.endpoint()], "", &["alias"]),
        &[],
    )
    .await;
    let chat = json!({"model": "alias", "messages": [{"role": "user", "content": "hi"}]});
    let raw = two_on_one_connection(&proxy, "/v1/chat/completions", &chat).await;
    assert_eq!(raw.matches("HTTP/1.1 400").count(), 2, "{raw}");
    assert_eq!(
        raw.to_ascii_lowercase()
            .matches("transfer-encoding: chunked")
            .count(),
        2,
        "{raw}"
    );
    assert_eq!(failing.received().len(), 2);
}

#[tokio::test]
async fn connections_beyond_the_per_client_limit_are_refused() {
    let (_worker, proxy) =
        one_worker_proxy("w1", "m", &["m"], &["--max-connections-per-client", "2"]).await;
    // Two kept-alive connections, each admitted for sure (one answer read on each). The
    // harness's readiness probe may still hold a slot for a moment after it hung up.
    let mut held = Vec::new();
    let deadline = tokio::time::Instant::now() + LONG;
    while held.len() < 2 {
        let mut stream = connect(&proxy).await;
        stream
            .write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut answer = vec![0u8; 4096];
        let n = stream.read(&mut answer).await.unwrap_or(0);
        if answer[..n].starts_with(b"HTTP/1.1 200") {
            held.push(stream);
        } else {
            assert!(tokio::time::Instant::now() < deadline);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let mut third = connect(&proxy).await;
    let raw = read_to_close(&mut third, LONG).await;
    let (status, body) = answer(&raw);
    assert_eq!(status, 503, "{raw}");
    assert_eq!(body["error"]["code"], "too_many_connections", "{raw}");
    assert!(raw.to_ascii_lowercase().contains("retry-after: 1"), "{raw}");

    // A slot comes back when a connection closes.
    drop(held.pop());
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        let mut stream = connect(&proxy).await;
        stream
            .write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let raw = read_to_close(&mut stream, LONG).await;
        if raw.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{raw}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains("switchyard_connections_refused_total{reason=\"client_limit\"}"),
        "{metrics}"
    );
}

/// What `base` serves of the operator's surface: `/metrics` status and whether it lists the
/// connection gauge, `/debug/route` status, and whether explain output comes back.
async fn operator_surface(base: &str) -> (u16, bool, u16, bool) {
    let http = reqwest::Client::new();
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let metrics = http.get(format!("{base}/metrics")).send().await.unwrap();
    let metrics_status = metrics.status().as_u16();
    if metrics_status == 200 {
        assert_eq!(
            metrics.headers()["content-type"],
            "application/openmetrics-text; version=1.0.0; charset=utf-8"
        );
    }
    let text = metrics.text().await.unwrap();
    let gauge = text.contains("switchyard_open_connections");
    if gauge {
        assert!(text.ends_with("# EOF\n"), "not OpenMetrics text:\n{text}");
    }
    let debug = http
        .post(format!("{base}/debug/route/v1/chat/completions"))
        .json(&chat)
        .send()
        .await
        .unwrap();
    let explained = http
        .post(format!("{base}/v1/chat/completions"))
        .header("x-switchyard-explain", "1")
        .json(&chat)
        .send()
        .await
        .unwrap();
    assert_eq!(explained.status(), 200);
    let route = explained.headers().get("x-switchyard-route").is_some();
    (metrics_status, gauge, debug.status().as_u16(), route)
}

#[tokio::test]
async fn the_operator_surface_is_only_on_the_admin_listener() {
    let (_worker, proxy) = one_worker_proxy("w1", "m", &["m"], &[]).await;
    // Tenants' listener: no metrics, no debug route, explain ignored.
    assert_eq!(
        operator_surface(&proxy.url()).await,
        (404, false, 404, false)
    );
    // Admin listener: all three.
    assert_eq!(
        operator_surface(&proxy.admin_url()).await,
        (200, true, 200, true)
    );

    // Opting in serves them on the one listener.
    let (_worker, single) =
        one_worker_proxy("w2", "m", &["m"], &["--admin-on-main-listener"]).await;
    assert_eq!(
        operator_surface(&single.url()).await,
        (200, true, 200, true)
    );
}
