//! A small in-process stand-in for a vLLM worker: records exactly what it received and answers in
//! OpenAI (and optionally Anthropic) format, streaming included. Streams can be gated so a test
//! decides when each chunk leaves, which proves pass-through without timing assumptions.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::Semaphore;

/// One request as the upstream saw it.
#[derive(Debug, Clone)]
pub struct Received {
    pub method: Method,
    pub path: String,
    /// The query string, when there was one.
    pub query: Option<String>,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Received {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("upstream received JSON")
    }
}

#[derive(Debug, Clone, Default)]
pub struct UpstreamOptions {
    /// Content chunks per streamed answer (default 3).
    pub stream_chunks: Option<usize>,
    /// When set, each streamed chunk waits for a permit from [`Upstream::release`].
    pub gated: bool,
    /// Serve `/v1/messages` (Anthropic format) as vLLM does; otherwise it is a 404.
    pub anthropic_native: bool,
    /// Answer every inference request with this status (an OpenAI error body).
    pub fail_with: Option<u16>,
    /// Answer with the headers a public provider adds ([`PROVIDER_RESPONSE_HEADERS`]).
    pub provider_headers: bool,
    /// Break every stream after this many events (the connection is cut mid-answer, as when a
    /// worker crashes).
    pub break_after: Option<usize>,
    /// End every chat or completions stream with vLLM's error event after this many content
    /// chunks (the engine failed mid-answer; the connection ends cleanly).
    pub error_after: Option<usize>,
    /// A whole (not streamed) answer waits for a permit from [`Upstream::release`] before its
    /// head, as a worker's does until its last token.
    pub gated_whole: bool,
}

/// What a public provider's answers carry besides the content: its own business, not a client's.
pub const PROVIDER_RESPONSE_HEADERS: &[(&str, &str)] = &[
    ("server", "provider-edge/1.2"),
    ("openai-organization", "org-gateway-account"),
    ("x-ratelimit-remaining-requests", "42"),
    ("set-cookie", "__cf_bm=provider-secret"),
];

struct Shared {
    name: String,
    options: UpstreamOptions,
    received: Mutex<Vec<Received>>,
    gate: Semaphore,
    scrapes: std::sync::atomic::AtomicU64,
    /// What `/metrics` reports as waiting and running requests.
    waiting: std::sync::atomic::AtomicU64,
    running: std::sync::atomic::AtomicU64,
    /// The model the last request named (stored responses are answered under it).
    last_model: Mutex<String>,
}

/// A running test upstream; stops when dropped.
pub struct Upstream {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    pub async fn start(name: &str) -> Upstream {
        Upstream::start_with(name, UpstreamOptions::default()).await
    }

    pub async fn start_with(name: &str, options: UpstreamOptions) -> Upstream {
        let shared = Arc::new(Shared {
            name: name.to_owned(),
            options,
            received: Mutex::new(Vec::new()),
            gate: Semaphore::new(0),
            scrapes: std::sync::atomic::AtomicU64::new(0),
            waiting: std::sync::atomic::AtomicU64::new(0),
            running: std::sync::atomic::AtomicU64::new(0),
            last_model: Mutex::default(),
        });
        let app = Router::new()
            .fallback(handle)
            .layer(DefaultBodyLimit::disable())
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind upstream");
        let addr = listener.local_addr().expect("upstream addr");
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Upstream { addr, shared, task }
    }

    /// `host:port` for a pool's endpoints list.
    pub fn endpoint(&self) -> String {
        self.addr.to_string()
    }

    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// How many times `/metrics` was read.
    pub fn scrapes(&self) -> u64 {
        self.shared
            .scrapes
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn received(&self) -> Vec<Received> {
        self.shared
            .received
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default()
    }

    /// Set the queue `/metrics` reports (vLLM's `num_requests_waiting` / `_running`).
    pub fn set_load(&self, waiting: u64, running: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        self.shared.waiting.store(waiting, Relaxed);
        self.shared.running.store(running, Relaxed);
    }

    /// Wait until `/metrics` has been read `more` more times (the proxy saw the current load).
    pub async fn wait_scrapes(&self, more: u64) {
        let target = self.scrapes() + more;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while self.scrapes() < target {
            assert!(
                std::time::Instant::now() < deadline,
                "{} was not scraped",
                self.name()
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    /// Let `chunks` more streamed chunks out (gated upstreams only).
    pub fn release(&self, chunks: usize) {
        self.shared.gate.add_permits(chunks);
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn sse(events: Vec<String>, shared: Arc<Shared>) -> Response {
    sse_opening(events, 0, shared)
}

/// A stream whose first `opening` events go out at once, gated or not (what a server sends
/// before its engine has produced anything).
fn sse_opening(events: Vec<String>, opening: usize, shared: Arc<Shared>) -> Response {
    let stream = futures_util::stream::unfold(
        (events.into_iter().enumerate(), shared),
        move |(mut events, shared)| async move {
            let (index, event) = events.next()?;
            if shared
                .options
                .break_after
                .is_some_and(|after| index >= after)
            {
                let broken = std::io::Error::other("the worker broke mid-stream");
                return Some((Err(broken), (events, shared)));
            }
            if shared.options.gated
                && index >= opening
                && let Ok(permit) = shared.gate.acquire().await
            {
                permit.forget();
            }
            Some((
                Ok::<_, std::io::Error>(Bytes::from(event)),
                (events, shared),
            ))
        },
    );
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .expect("sse response")
}

/// A whole Responses API answer: the request's `instructions` echoed before the model, as
/// vLLM's answer does.
fn whole_response(id: &str, request: &Value, model: &str, text: &str) -> Value {
    json!({
        "id": id, "created_at": 0,
        "instructions": request["instructions"], "model": model, "object": "response",
        "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}],
        "status": "completed",
        "usage": {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 8}, "output_tokens": 3, "total_tokens": 15},
    })
}

async fn handle(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let provider_headers = shared.options.provider_headers;
    // vLLM's CORS middleware allows every origin by default.
    let cross_origin = headers.contains_key(axum::http::header::ORIGIN);
    let mut response = answer(shared, method, uri, headers, body).await;
    if cross_origin {
        response.headers_mut().insert(
            axum::http::header::ACCESS_CONTROL_ALLOW_ORIGIN,
            axum::http::HeaderValue::from_static("*"),
        );
    }
    if provider_headers {
        for (name, value) in PROVIDER_RESPONSE_HEADERS {
            response
                .headers_mut()
                .insert(*name, axum::http::HeaderValue::from_static(value));
        }
    }
    response
}

async fn answer(
    shared: Arc<Shared>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path().to_owned();
    if path == "/metrics" {
        // Cache-aware pools scrape this; it is not a request the tests count.
        shared
            .scrapes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        use std::sync::atomic::Ordering::Relaxed;
        return format!(
            "vllm:num_requests_waiting{{model_name=\"m\",engine=\"0\"}} {}.0\nvllm:num_requests_running{{model_name=\"m\",engine=\"0\"}} {}.0\n",
            shared.waiting.load(Relaxed),
            shared.running.load(Relaxed)
        )
        .into_response();
    }
    if path == "/tokenize" {
        // Cache-aware pools check their tokenizer with it; this fake cannot tokenize, and says
        // so as a server without the route would (not a request the tests count either).
        return StatusCode::NOT_FOUND.into_response();
    }
    if let Ok(mut received) = shared.received.lock() {
        received.push(Received {
            method: method.clone(),
            path: path.clone(),
            query: uri.query().map(str::to_owned),
            headers,
            body: body.clone(),
        });
    }
    if path == "/health" {
        return StatusCode::OK.into_response();
    }
    if let Some(status) = shared.options.fail_with {
        let error = json!({"error": {"message": format!("{} is failing on purpose", shared.name), "type": "InternalServerError", "code": status}});
        return (
            StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            axum::Json(error),
        )
            .into_response();
    }
    // A stored response (Responses API), as OpenAI and vLLM answer for it.
    if let Some(id) = path.strip_prefix("/v1/responses/") {
        let id = id.trim_end_matches("/cancel");
        let served = shared
            .last_model
            .lock()
            .map(|m| m.clone())
            .unwrap_or_default();
        return match method {
            Method::DELETE => {
                axum::Json(json!({"id": id, "object": "response.deleted", "deleted": true}))
                    .into_response()
            }
            _ => axum::Json(
                json!({"id": id, "object": "response", "model": served, "status": "completed",
                "output": [], "usage": {"input_tokens": 4, "output_tokens": 2, "total_tokens": 6}}),
            )
            .into_response(),
        };
    }
    let request: Value = match serde_json::from_slice(&body) {
        Ok(value) => value,
        Err(e) => {
            let error = json!({"error": {"message": format!("upstream could not parse body: {e}"), "type": "BadRequestError", "code": 400}});
            return (StatusCode::BAD_REQUEST, axum::Json(error)).into_response();
        }
    };
    let model = request["model"].as_str().unwrap_or_default().to_owned();
    if let Ok(mut last) = shared.last_model.lock() {
        last.clone_from(&model);
    }
    let stream = request["stream"].as_bool().unwrap_or(false);
    if !stream
        && shared.options.gated_whole
        && let Ok(permit) = shared.gate.acquire().await
    {
        permit.forget();
    }
    let chunks = shared.options.stream_chunks.unwrap_or(3);
    let name = shared.name.clone();
    let reply = format!("{name} saw {} bytes", body.len());
    match path.as_str() {
        "/v1/chat/completions" | "/v1/completions" if stream => {
            let chat = path == "/v1/chat/completions";
            let mut events: Vec<String> = (0..chunks)
                .map(|i| {
                    let text = format!("{name}-{i} ");
                    let choice = if chat {
                        json!({"index": 0, "delta": {"content": text}, "finish_reason": if i + 1 == chunks { json!("stop") } else { Value::Null }})
                    } else {
                        json!({"index": 0, "text": text, "finish_reason": if i + 1 == chunks { json!("stop") } else { Value::Null }})
                    };
                    format!("data: {}\n\n", json!({"id": "cmpl-test", "object": "chat.completion.chunk", "model": model, "choices": [choice]}))
                })
                .collect();
            if let Some(after) = shared.options.error_after {
                events.truncate(after);
                let error = json!({"error": {"message": "the engine failed", "type": "InternalServerError", "param": null, "code": 500}});
                events.push(format!("data: {error}\n\n"));
            } else if request["stream_options"]["include_usage"].as_bool() == Some(true) {
                events.push(format!(
                    "data: {}\n\n",
                    json!({"id": "cmpl-test", "object": "chat.completion.chunk", "model": model, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": chunks, "total_tokens": 7 + chunks}})
                ));
            }
            events.push("data: [DONE]\n\n".to_owned());
            sse(events, shared)
        }
        // A streamed Responses API answer in vLLM's order: `response.created` and
        // `response.in_progress` as soon as the request is accepted, then one delta per token.
        "/v1/responses" if stream => {
            let id = format!("resp_{name}_{}", body.len());
            let opened = json!({"id": id, "object": "response", "model": model, "status": "in_progress", "output": []});
            let event = |kind: &str, data: Value| {
                let mut data = data;
                data["type"] = json!(kind);
                format!("event: {kind}\ndata: {data}\n\n")
            };
            let mut events = vec![
                event("response.created", json!({"response": opened})),
                event("response.in_progress", json!({"response": opened})),
            ];
            events.extend((0..chunks).map(|i| {
                event(
                    "response.output_text.delta",
                    json!({"output_index": 0, "content_index": 0, "delta": format!("{name}-{i} ")}),
                )
            }));
            // The last event carries the whole response, as the non-streamed answer below.
            let text: String = (0..chunks).map(|i| format!("{name}-{i} ")).collect();
            let mut whole = whole_response(&id, &request, &model, &text);
            whole["usage"]["output_tokens"] = json!(chunks);
            events.push(event("response.completed", json!({"response": whole})));
            sse_opening(events, 2, shared)
        }
        // The Responses API (whole answers): the request's `instructions` echoed before the
        // model, as vLLM's answer does.
        "/v1/responses" => axum::Json(whole_response(
            &format!("resp_{name}_{}", body.len()),
            &request,
            &model,
            &reply,
        ))
        .into_response(),
        // Pooling models, in vLLM's shapes: one small vector per input, scores, a ranking.
        "/v1/embeddings" | "/pooling" => {
            let inputs = match &request["input"] {
                Value::Array(items) if items.iter().all(Value::is_string) => items.len(),
                _ => 1,
            };
            let pooling = path == "/pooling";
            let data: Vec<Value> = (0..inputs)
                .map(|index| {
                    let vector = json!([0.25, -0.5, index as f64]);
                    if pooling {
                        json!({"index": index, "object": "pooling", "data": vector})
                    } else {
                        json!({"index": index, "object": "embedding", "embedding": vector})
                    }
                })
                .collect();
            axum::Json(json!({
                "id": "embd-test", "object": "list", "created": 0, "model": model, "data": data,
                "usage": {"prompt_tokens": 5 * inputs, "total_tokens": 5 * inputs, "completion_tokens": 0},
            }))
            .into_response()
        }
        "/v1/score" | "/score" => axum::Json(json!({
            "id": "score-test", "object": "list", "created": 0, "model": model,
            "data": [{"index": 0, "object": "score", "score": 0.75}],
            "usage": {"prompt_tokens": 9, "total_tokens": 9},
        }))
        .into_response(),
        "/v1/rerank" | "/rerank" | "/v2/rerank" => axum::Json(json!({
            "id": "rerank-test", "model": model,
            "results": [{"index": 0, "document": {"text": request["documents"][0]}, "relevance_score": 0.9}],
            "usage": {"total_tokens": 11},
        }))
        .into_response(),
        "/v1/chat/completions" => axum::Json(json!({
            "id": "chatcmpl-test", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
        }))
        .into_response(),
        "/v1/completions" => axum::Json(json!({
            "id": "cmpl-test", "object": "text_completion", "created": 0, "model": model,
            "choices": [{"index": 0, "text": reply, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
        }))
        .into_response(),
        // vLLM's Anthropic stream: `message_start` leaves out what is only a default there
        // (`type`, `role`, the null stop fields).
        "/v1/messages" if shared.options.anthropic_native && stream => {
            let mut events = vec![format!(
                "event: message_start\ndata: {}\n\n",
                json!({"type": "message_start", "message": {"id": "msg_test", "model": model, "content": [], "usage": {"input_tokens": 7, "output_tokens": 0}}})
            )];
            events.push(format!("event: content_block_start\ndata: {}\n\n", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})));
            for i in 0..chunks {
                events.push(format!("event: content_block_delta\ndata: {}\n\n", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": format!("{name}-{i} ")}})));
            }
            events.push(format!("event: content_block_stop\ndata: {}\n\n", json!({"type": "content_block_stop", "index": 0})));
            events.push(format!("event: message_delta\ndata: {}\n\n", json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null}, "usage": {"output_tokens": chunks}})));
            events.push(format!("event: message_stop\ndata: {}\n\n", json!({"type": "message_stop"})));
            sse(events, shared)
        }
        "/v1/messages" if shared.options.anthropic_native => axum::Json(json!({
            "id": "msg_test", "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": reply}], "stop_reason": "end_turn", "stop_sequence": null,
            "usage": {"input_tokens": 7, "output_tokens": 3},
        }))
        .into_response(),
        _ => (
            StatusCode::NOT_FOUND,
            axum::Json(json!({"error": {"message": format!("{path} not served here"), "type": "NotFoundError", "code": 404}})),
        )
            .into_response(),
    }
}
