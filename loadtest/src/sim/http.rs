//! The simulated worker's HTTP surface, shaped like vLLM's OpenAI-compatible server:
//! `/v1/chat/completions`, `/v1/completions`, `/v1/messages`, `/v1/responses` (see
//! [`super::responses`]), `/v1/models`, `/tokenize`,
//! `/reset_prefix_cache`, `/health`, `/metrics`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use switchyard_kv::tokenize::{PromptTokenizer, anthropic_chat, openai_chat};
use tokio::sync::mpsc;

use super::audio;
use super::engine::{EngineHandle, Output};
use super::responses::{self, ResponseStore};

/// Everything one worker's handlers share.
pub struct Worker {
    /// The served model name (`--served-model-name`).
    pub model: String,
    pub engine: EngineHandle,
    pub tokenizer: Arc<PromptTokenizer>,
    pub max_model_len: usize,
    pub default_max_tokens: usize,
    pub task: Task,
    /// Tokens generated in turn (whole English words, so each decodes on its own).
    pub output_vocab: Arc<Vec<u32>>,
    pub token_text: Arc<HashMap<u32, String>>,
    /// Responses kept for `previous_response_id` and `GET /v1/responses/{id}`.
    pub responses: ResponseStore,
}

impl Worker {
    /// Build the token vocabulary generated answers are made of.
    pub fn output_vocabulary(tokenizer: &PromptTokenizer) -> (Vec<u32>, HashMap<u32, String>) {
        const TEXT: &str = " The quick brown fox jumps over the lazy dog while the simulated engine keeps \
                            producing plausible words one token at a time for every request it serves";
        let ids = tokenizer.encode(TEXT).unwrap_or_default();
        let text = ids
            .iter()
            .map(|id| (*id, tokenizer.decode(&[*id])))
            .collect();
        (ids, text)
    }
}

pub fn router(worker: Arc<Worker>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/pooling", post(pooling))
        .route("/v1/score", post(score))
        .route("/score", post(score))
        .route("/v1/rerank", post(rerank))
        .route("/rerank", post(rerank))
        .route("/v2/rerank", post(rerank))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(messages))
        .route("/v1/responses", post(responses::create))
        .route("/v1/audio/transcriptions", post(audio::transcriptions))
        .route("/v1/audio/translations", post(audio::translations))
        .route("/v1/responses/{id}", get(responses::retrieve))
        .route("/v1/responses/{id}/cancel", post(responses::cancel))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", get(metrics))
        .route("/debug/predicted_ttft", post(super::debug::predicted_ttft))
        // FastAPI's answer for a method a route does not take (vLLM has no DELETE
        // /v1/responses/{id}, for one).
        .method_not_allowed_fallback(|| async {
            (
                StatusCode::METHOD_NOT_ALLOWED,
                axum::Json(json!({"detail": "Method Not Allowed"})),
            )
        })
        .layer(DefaultBodyLimit::disable())
        .with_state(worker)
}

/// An error answered in vLLM's error body.
pub(super) struct Failure {
    status: StatusCode,
    kind: &'static str,
    message: String,
    param: Option<&'static str>,
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let body = json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status.as_u16()}});
        (self.status, axum::Json(body)).into_response()
    }
}

pub(super) fn error(
    status: StatusCode,
    kind: &'static str,
    message: impl Into<String>,
    param: Option<&'static str>,
) -> Failure {
    Failure {
        status,
        kind,
        message: message.into(),
        param,
    }
}

pub(super) fn bad_request(message: impl Into<String>) -> Failure {
    error(StatusCode::BAD_REQUEST, "BadRequestError", message, None)
}

/// What a simulated model does, as vLLM's runners do: generate, or embed (pooling).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Task {
    #[default]
    Generate,
    /// An embedding model: `/v1/embeddings`, `/pooling`, and scores by cosine similarity.
    Embed,
    /// A cross-encoder: `/v1/score`, `/v1/rerank`, `/pooling`.
    Score,
}

/// Dimensions of a simulated embedding.
const EMBEDDING_DIMS: usize = 32;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat,
    Completions,
    Messages,
}

struct Prepared {
    prompt: Vec<u32>,
    output: Vec<u32>,
    stream: bool,
    include_usage: bool,
    request_model: String,
    cache_salt: Option<String>,
}

/// The request body, for this worker's model (vLLM's 404 for another).
pub(super) fn request_for(worker: &Worker, body: &[u8]) -> Result<Value, Failure> {
    let request: Value =
        serde_json::from_slice(body).map_err(|e| bad_request(format!("invalid JSON body: {e}")))?;
    let model = request
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if model != worker.model {
        return Err(error(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            format!("The model `{model}` does not exist."),
            Some("model"),
        ));
    }
    Ok(request)
}

/// A prompt's tokens as vLLM builds them: with the tokenizer's special tokens (a BOS) when the
/// request's `add_special_tokens` says so, else when `by_default` (true for a completions prompt,
/// false for a chat's, whose template carries its own).
fn encode_prompt(
    worker: &Worker,
    request: &Value,
    text: &str,
    by_default: bool,
) -> Result<Vec<u32>, switchyard_kv::tokenize::TokenizeError> {
    let special = request
        .get("add_special_tokens")
        .and_then(Value::as_bool)
        .unwrap_or(by_default);
    if special {
        worker.tokenizer.encode_with_special_tokens(text)
    } else {
        worker.tokenizer.encode(text)
    }
}

/// A chat request's prompt tokens as vLLM builds them: its messages and template inputs (tools,
/// `chat_template_kwargs`, ...) through the chat template, then the tokenizer. `None`: no
/// messages.
pub(super) fn chat_prompt(
    worker: &Worker,
    request: &Value,
    body: &[u8],
) -> Option<Result<Vec<u32>, switchyard_kv::tokenize::TokenizeError>> {
    // Parsed again keeping the order of object keys: templates print tools with `tojson`.
    let ordered: switchyard_kv::chat_template::TemplateValue =
        serde_json::from_slice(body).unwrap_or_default();
    let (messages, inputs) = openai_chat(&ordered);
    if messages.is_empty() {
        return None;
    }
    Some(
        worker
            .tokenizer
            .render_chat_with(&messages, &inputs)
            .and_then(|text| encode_prompt(worker, request, &text, false)),
    )
}

fn prepare(worker: &Worker, api: Api, body: &[u8]) -> Result<Prepared, Failure> {
    let request = request_for(worker, body)?;
    let prompt = match api {
        Api::Chat => chat_prompt(worker, &request, body)
            .ok_or_else(|| bad_request("messages must be a non-empty list"))?,
        Api::Messages => {
            // As vLLM's /v1/messages: converted to a chat completion, then rendered.
            let ordered: switchyard_kv::chat_template::TemplateValue =
                serde_json::from_slice(body).unwrap_or_default();
            let (messages, inputs) =
                anthropic_chat(&ordered, worker.tokenizer.anthropic_rendering());
            if messages.is_empty() {
                return Err(bad_request("messages must be a non-empty list"));
            }
            worker
                .tokenizer
                .render_chat_with(&messages, &inputs)
                .and_then(|text| worker.tokenizer.encode(&text))
        }
        Api::Completions => match request.get("prompt") {
            Some(Value::String(text)) => encode_prompt(worker, &request, text, true),
            Some(Value::Array(items)) if !items.is_empty() && items.iter().all(Value::is_u64) => {
                Ok(items
                    .iter()
                    .filter_map(Value::as_u64)
                    .map(|t| t as u32)
                    .collect())
            }
            _ => {
                return Err(bad_request(
                    "prompt must be a string or a list of token ids",
                ));
            }
        },
    }
    .map_err(|e| bad_request(e.to_string()))?;
    let max_tokens = request
        .get("max_tokens")
        .or_else(|| request.get("max_completion_tokens"))
        .and_then(Value::as_u64);
    let (output, cache_salt) =
        generation(worker, &request, prompt.len(), max_tokens, "max_tokens")?;
    Ok(Prepared {
        prompt,
        output,
        stream: request
            .get("stream")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        include_usage: request
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false),
        request_model: worker.model.clone(),
        cache_salt,
    })
}

/// What a generation request produces and how it is salted, checked as vLLM checks them: the
/// output tokens (`max_tokens`, called `field` in the request's API, or the worker's default;
/// at least 1; prompt and output within `--max-model-len`) and the `cache_salt`.
pub(super) fn generation(
    worker: &Worker,
    request: &Value,
    prompt_len: usize,
    max_tokens: Option<u64>,
    field: &str,
) -> Result<(Vec<u32>, Option<String>), Failure> {
    let max_tokens = max_tokens.map_or(worker.default_max_tokens, |n| n as usize);
    if max_tokens == 0 {
        return Err(bad_request(format!("{field} must be at least 1")));
    }
    if prompt_len + max_tokens > worker.max_model_len {
        return Err(bad_request(format!(
            "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the messages, {} in the completion). Please reduce the length of the messages or completion.",
            worker.max_model_len,
            prompt_len + max_tokens,
            prompt_len,
            max_tokens
        )));
    }
    // vLLM's protocol check: "Parameter 'cache_salt' must be a non-empty string if provided."
    let cache_salt = match request.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(salt)) if !salt.is_empty() => Some(salt.clone()),
        Some(_) => {
            return Err(bad_request(
                "Parameter 'cache_salt' must be a non-empty string if provided.",
            ));
        }
    };
    let vocab = &worker.output_vocab;
    let offset = prompt_len % vocab.len().max(1);
    let output = (0..max_tokens)
        .filter_map(|i| vocab.get((offset + i) % vocab.len().max(1)).copied())
        .collect();
    Ok((output, cache_salt))
}

pub(super) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn request_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// Everything a finished request produced.
pub(super) struct Collected {
    pub(super) tokens: Vec<u32>,
    pub(super) cached_tokens: usize,
}

pub(super) async fn collect(mut outputs: mpsc::UnboundedReceiver<Output>) -> Collected {
    let mut collected = Collected {
        tokens: Vec::new(),
        cached_tokens: 0,
    };
    while let Some(output) = outputs.recv().await {
        match output {
            Output::Started { cached_tokens } => collected.cached_tokens = cached_tokens,
            Output::Token(token) => collected.tokens.push(token),
            Output::Finished => break,
        }
    }
    collected
}

pub(super) fn text_of(worker: &Worker, tokens: &[u32]) -> String {
    tokens
        .iter()
        .filter_map(|t| worker.token_text.get(t).map(String::as_str))
        .collect()
}

async fn chat_completions(State(worker): State<Arc<Worker>>, body: Bytes) -> Response {
    serve(worker, Api::Chat, body).await
}

async fn completions(State(worker): State<Arc<Worker>>, body: Bytes) -> Response {
    serve(worker, Api::Completions, body).await
}

async fn messages(State(worker): State<Arc<Worker>>, body: Bytes) -> Response {
    serve(worker, Api::Messages, body).await
}

/// What vLLM answers for a route its runner does not register.
pub(super) fn route_not_served() -> Response {
    (
        StatusCode::NOT_FOUND,
        axum::Json(json!({"detail": "Not Found"})),
    )
        .into_response()
}

async fn embeddings(State(worker): State<Arc<Worker>>, body: Bytes) -> Response {
    embed(worker, false, body).await
}

async fn pooling(State(worker): State<Arc<Worker>>, body: Bytes) -> Response {
    embed(worker, true, body).await
}

/// vLLM's pooling runner: each input is prefilled (queued like any request) and pooled into a
/// vector; usage counts the input tokens.
async fn embed(worker: Arc<Worker>, pooling: bool, body: Bytes) -> Response {
    let served = match worker.task {
        Task::Embed => true,
        Task::Score => pooling,
        Task::Generate => false,
    };
    if !served {
        return route_not_served();
    }
    let request = match request_for(&worker, &body) {
        Ok(request) => request,
        Err(failure) => return failure.into_response(),
    };
    let inputs: Vec<Vec<u32>> = match request.get("input").unwrap_or(&Value::Null) {
        Value::String(text) => vec![worker.tokenizer.encode(text).unwrap_or_default()],
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_string) => items
            .iter()
            .map(|t| {
                worker
                    .tokenizer
                    .encode(t.as_str().unwrap_or_default())
                    .unwrap_or_default()
            })
            .collect(),
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_u64) => {
            vec![
                items
                    .iter()
                    .filter_map(Value::as_u64)
                    .map(|t| t as u32)
                    .collect(),
            ]
        }
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_array) => items
            .iter()
            .map(|ids| {
                ids.as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_u64)
                    .map(|t| t as u32)
                    .collect()
            })
            .collect(),
        _ => return bad_request("'input' must be a string, strings or token ids").into_response(),
    };
    let mut data = Vec::with_capacity(inputs.len());
    let mut prompt_tokens = 0;
    for (index, tokens) in inputs.into_iter().enumerate() {
        if tokens.len() > worker.max_model_len {
            return bad_request(format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens in the input for embedding generation. Please reduce the length of the input.",
                worker.max_model_len,
                tokens.len()
            ))
            .into_response();
        }
        prompt_tokens += tokens.len();
        let vector = embedding_of(&tokens);
        // A pooling request is a prefill: it waits for its turn like any other request.
        let first = tokens.first().copied().unwrap_or(0);
        match worker.engine.submit(tokens, vec![first]) {
            Ok(outputs) => {
                collect(outputs).await;
            }
            Err(e) => return bad_request(e.to_string()).into_response(),
        }
        data.push(if pooling {
            json!({"index": index, "object": "pooling", "data": vector})
        } else {
            json!({"index": index, "object": "embedding", "embedding": vector})
        });
    }
    let id = request_id();
    axum::Json(json!({
        "id": if pooling { format!("pool-{id}") } else { format!("embd-{id}") },
        "object": "list", "created": unix_now(), "model": worker.model, "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0, "prompt_tokens_details": null},
    }))
    .into_response()
}

async fn score(State(worker): State<Arc<Worker>>, body: Bytes) -> Response {
    compare(worker, false, body).await
}

async fn rerank(State(worker): State<Arc<Worker>>, body: Bytes) -> Response {
    compare(worker, true, body).await
}

/// vLLM's `/v1/score` (`text_1` against each of `text_2`) and `/v1/rerank` (`query` against
/// each of `documents`, best first, `top_n` kept): each pair is one prefill; the score is the
/// cosine of the two texts' simulated embeddings, mapped to 0..1.
async fn compare(worker: Arc<Worker>, rerank: bool, body: Bytes) -> Response {
    if worker.task == Task::Generate {
        return route_not_served();
    }
    let request = match request_for(&worker, &body) {
        Ok(request) => request,
        Err(failure) => return failure.into_response(),
    };
    let texts = |field: &str| -> Option<Vec<String>> {
        match request.get(field)? {
            Value::String(text) => Some(vec![text.clone()]),
            Value::Array(items) => items
                .iter()
                .map(|i| i.as_str().map(str::to_owned))
                .collect(),
            _ => None,
        }
    };
    let (query, documents) = if rerank {
        (texts("query"), texts("documents"))
    } else {
        (texts("text_1"), texts("text_2"))
    };
    let (Some(query), Some(documents)) = (query.and_then(|q| q.into_iter().next()), documents)
    else {
        let fields = if rerank {
            "'query' and 'documents'"
        } else {
            "'text_1' and 'text_2'"
        };
        return bad_request(format!("{fields} must be strings")).into_response();
    };
    let encode = |text: &str| worker.tokenizer.encode(text).unwrap_or_default();
    let query_tokens = encode(&query);
    let query_vector = embedding_of(&query_tokens);
    let mut scored = Vec::with_capacity(documents.len());
    let mut total_tokens = 0;
    for (index, document) in documents.iter().enumerate() {
        let tokens = encode(document);
        let vector = embedding_of(&tokens);
        let cosine: f64 = query_vector.iter().zip(&vector).map(|(a, b)| a * b).sum();
        let pair: Vec<u32> = query_tokens.iter().chain(&tokens).copied().collect();
        total_tokens += pair.len();
        let first = pair.first().copied().unwrap_or(0);
        match worker.engine.submit(pair, vec![first]) {
            Ok(outputs) => {
                collect(outputs).await;
            }
            Err(e) => return bad_request(e.to_string()).into_response(),
        }
        scored.push((index, document, (cosine + 1.0) / 2.0));
    }
    let id = request_id();
    if !rerank {
        let data: Vec<Value> = scored
            .iter()
            .map(|(index, _, score)| json!({"index": index, "object": "score", "score": score}))
            .collect();
        return axum::Json(json!({
            "id": format!("score-{id}"), "object": "list", "created": unix_now(), "model": worker.model,
            "data": data, "usage": {"prompt_tokens": total_tokens, "total_tokens": total_tokens},
        }))
        .into_response();
    }
    scored.sort_by(|a, b| b.2.total_cmp(&a.2));
    let top_n = request
        .get("top_n")
        .and_then(Value::as_u64)
        .map_or(scored.len(), |n| n as usize);
    let results: Vec<Value> = scored
        .iter()
        .take(top_n)
        .map(|(index, document, score)| {
            json!({"index": index, "document": {"text": document}, "relevance_score": score})
        })
        .collect();
    axum::Json(json!({
        "id": format!("rerank-{id}"), "model": worker.model,
        "usage": {"total_tokens": total_tokens}, "results": results,
    }))
    .into_response()
}

/// A deterministic unit vector of `tokens` (same input, same vector).
fn embedding_of(tokens: &[u32]) -> Vec<f64> {
    let mut vector = vec![0.0f64; EMBEDDING_DIMS];
    for (position, token) in tokens.iter().enumerate() {
        let digest = Sha256::digest(
            [u64::from(*token), position as u64]
                .map(u64::to_le_bytes)
                .concat(),
        );
        let hash = digest
            .iter()
            .take(8)
            .fold(0u64, |acc, byte| (acc << 8) | u64::from(*byte));
        if let Some(slot) = vector.get_mut((hash % EMBEDDING_DIMS as u64) as usize) {
            *slot += if hash & (1 << 40) == 0 { 1.0 } else { -1.0 };
        }
    }
    let norm = vector
        .iter()
        .map(|v| v * v)
        .sum::<f64>()
        .sqrt()
        .max(f64::MIN_POSITIVE);
    vector.iter().map(|v| v / norm).collect()
}

async fn serve(worker: Arc<Worker>, api: Api, body: Bytes) -> Response {
    if worker.task != Task::Generate {
        return route_not_served();
    }
    let prepared = match prepare(&worker, api, &body) {
        Ok(prepared) => prepared,
        Err(failure) => return failure.into_response(),
    };
    let prompt_len = prepared.prompt.len();
    let expected = prepared.output.len();
    let outputs =
        match worker
            .engine
            .submit_salted(prepared.prompt, prepared.output, prepared.cache_salt)
        {
            Ok(outputs) => outputs,
            Err(e) => return bad_request(e.to_string()).into_response(),
        };
    let id = request_id();
    if prepared.stream {
        let stream = StreamState {
            worker,
            api,
            id: match api {
                Api::Chat => format!("chatcmpl-{id}"),
                Api::Completions => format!("cmpl-{id}"),
                Api::Messages => id,
            },
            model: prepared.request_model,
            created: unix_now(),
            prompt_len,
            include_usage: prepared.include_usage,
            outputs,
            cached_tokens: 0,
            generated: 0,
            expected,
            started: false,
            done: false,
        };
        return stream_response(stream);
    }
    let collected = collect(outputs).await;
    let text = text_of(&worker, &collected.tokens);
    let completion = collected.tokens.len();
    let created = unix_now();
    let body = match api {
        Api::Chat => json!({
            "id": format!("chatcmpl-{id}"), "object": "chat.completion", "created": created, "model": prepared.request_model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": "length"}],
            "usage": usage(prompt_len, completion, collected.cached_tokens),
        }),
        Api::Completions => json!({
            "id": format!("cmpl-{id}"), "object": "text_completion", "created": created, "model": prepared.request_model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": "length"}],
            "usage": usage(prompt_len, completion, collected.cached_tokens),
        }),
        Api::Messages => json!({
            "id": format!("msg_{id}"), "type": "message", "role": "assistant", "model": prepared.request_model,
            "content": [{"type": "text", "text": text}], "stop_reason": "max_tokens", "stop_sequence": null,
            "usage": {"input_tokens": prompt_len - collected.cached_tokens, "output_tokens": completion, "cache_read_input_tokens": collected.cached_tokens},
        }),
    };
    axum::Json(body).into_response()
}

/// State carried through a streamed answer.
struct StreamState {
    worker: Arc<Worker>,
    api: Api,
    id: String,
    model: String,
    created: u64,
    prompt_len: usize,
    include_usage: bool,
    outputs: mpsc::UnboundedReceiver<Output>,
    cached_tokens: usize,
    generated: usize,
    expected: usize,
    started: bool,
    done: bool,
}

impl StreamState {
    fn chunk(&self, delta: Value, finish: Option<&str>) -> String {
        let choice = match self.api {
            Api::Completions => {
                json!({"index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")), "logprobs": null, "finish_reason": finish})
            }
            _ => json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}),
        };
        let object = if self.api == Api::Completions {
            "text_completion"
        } else {
            "chat.completion.chunk"
        };
        format!(
            "data: {}\n\n",
            json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [choice]})
        )
    }

    fn event(name: &str, data: Value) -> String {
        format!("event: {name}\ndata: {data}\n\n")
    }

    /// SSE text for one engine output (may be empty).
    fn render(&mut self, output: Output) -> String {
        let mut out = String::new();
        match output {
            Output::Started { cached_tokens } => {
                self.cached_tokens = cached_tokens;
                if !self.started {
                    self.started = true;
                    match self.api {
                        Api::Chat => out.push_str(
                            &self.chunk(json!({"role": "assistant", "content": ""}), None),
                        ),
                        Api::Completions => {}
                        Api::Messages => {
                            out.push_str(&Self::event("message_start", json!({"type": "message_start", "message": {
                                "id": format!("msg_{}", self.id), "type": "message", "role": "assistant", "model": self.model,
                                "content": [], "stop_reason": null, "stop_sequence": null,
                                "usage": {"input_tokens": self.prompt_len - cached_tokens, "output_tokens": 0, "cache_read_input_tokens": cached_tokens}}})));
                            out.push_str(&Self::event("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})));
                        }
                    }
                }
            }
            Output::Token(token) => {
                self.generated += 1;
                let text = self
                    .worker
                    .token_text
                    .get(&token)
                    .cloned()
                    .unwrap_or_default();
                let last = self.generated >= self.expected;
                match self.api {
                    Api::Messages => out.push_str(&Self::event("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}))),
                    _ => out.push_str(&self.chunk(json!({"content": text}), last.then_some("length"))),
                }
            }
            Output::Finished => {
                self.done = true;
                match self.api {
                    Api::Messages => {
                        out.push_str(&Self::event(
                            "content_block_stop",
                            json!({"type": "content_block_stop", "index": 0}),
                        ));
                        out.push_str(&Self::event("message_delta", json!({"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": null}, "usage": {"output_tokens": self.generated}})));
                        out.push_str(&Self::event(
                            "message_stop",
                            json!({"type": "message_stop"}),
                        ));
                    }
                    _ => {
                        if self.include_usage {
                            let object = if self.api == Api::Completions {
                                "text_completion"
                            } else {
                                "chat.completion.chunk"
                            };
                            out.push_str(&format!(
                                "data: {}\n\n",
                                json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [],
                                       "usage": usage(self.prompt_len, self.generated, self.cached_tokens)})
                            ));
                        }
                        out.push_str("data: [DONE]\n\n");
                    }
                }
            }
        }
        out
    }
}

fn stream_response(state: StreamState) -> Response {
    let stream = futures_util::stream::unfold(state, |mut state| async move {
        if state.done {
            return None;
        }
        let output = state.outputs.recv().await.unwrap_or(Output::Finished);
        let text = state.render(output);
        Some((Ok::<_, Infallible>(Bytes::from(text)), state))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

async fn models(State(worker): State<Arc<Worker>>) -> Response {
    axum::Json(json!({"object": "list", "data": [{
        "id": worker.model, "object": "model", "created": unix_now(), "owned_by": "vllm",
        "root": worker.model, "parent": null, "max_model_len": worker.max_model_len,
    }]}))
    .into_response()
}

async fn tokenize(State(worker): State<Arc<Worker>>, body: Bytes) -> Response {
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return bad_request("invalid JSON body").into_response();
    };
    let tokens = if request.get("messages").is_some() {
        chat_prompt(&worker, &request, &body).unwrap_or_else(|| Ok(Vec::new()))
    } else {
        let prompt = request.get("prompt").and_then(Value::as_str);
        encode_prompt(&worker, &request, prompt.unwrap_or_default(), true)
    };
    match tokens {
        Ok(tokens) => axum::Json(
            json!({"count": tokens.len(), "max_model_len": worker.max_model_len, "tokens": tokens}),
        )
        .into_response(),
        Err(e) => bad_request(e.to_string()).into_response(),
    }
}

/// vLLM's `/detokenize`: token ids back to text (`{"prompt": ...}`).
async fn detokenize(State(worker): State<Arc<Worker>>, body: Bytes) -> Response {
    #[derive(serde::Deserialize)]
    struct Request {
        tokens: Vec<u32>,
    }
    match serde_json::from_slice::<Request>(&body) {
        Ok(request) => {
            axum::Json(json!({"prompt": worker.tokenizer.decode(&request.tokens)})).into_response()
        }
        Err(e) => bad_request(format!("invalid request: {e}")).into_response(),
    }
}

async fn reset_prefix_cache(State(worker): State<Arc<Worker>>) -> Response {
    if worker.engine.reset_prefix_cache().await {
        StatusCode::OK.into_response()
    } else {
        error(
            StatusCode::CONFLICT,
            "ConflictError",
            "requests are running; the prefix cache was not reset",
            None,
        )
        .into_response()
    }
}

async fn metrics(State(worker): State<Arc<Worker>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        worker.engine.stats.render(&worker.model),
    )
        .into_response()
}
