//! vLLM's Responses API (`vllm/entrypoints/openai/responses/`, the simple non-Harmony path):
//! `POST /v1/responses`, streamed (typed events) or not, `GET /v1/responses/{id}` and
//! `POST /v1/responses/{id}/cancel`.
//!
//! As in vLLM, responses are kept in the worker's memory only when the server allows it
//! (`VLLM_ENABLE_RESPONSES_API_STORE=1`, here `--enable-responses-store`); otherwise `store` is
//! silently off and a `previous_response_id` is "not found". A `previous_response_id` puts the
//! stored conversation (its messages less system ones, then its output text) between the new
//! `instructions` and `input`. vLLM has no `DELETE` route: it answers 405 as FastAPI does.
//! Deviations: background mode is not simulated (400), and the store keeps the newest
//! [`STORE_CAPACITY`] responses (vLLM's grows without bound).

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use switchyard_kv::tokenize::{ChatMessage, responses_messages};
use tokio::sync::mpsc;

use super::engine::Output;
use super::http::{
    Failure, Task, Worker, bad_request, collect, error, generation, request_for, route_not_served,
    text_of, unix_now,
};

/// Responses a worker keeps at most (oldest forgotten first).
pub const STORE_CAPACITY: usize = 10_000;

/// A worker's stored responses, when the server allows storing them.
#[derive(Debug, Default)]
pub struct ResponseStore {
    pub enabled: bool,
    inner: Mutex<Stored>,
}

#[derive(Debug, Default)]
struct Stored {
    responses: HashMap<String, (Value, Vec<ChatMessage>)>,
    order: VecDeque<String>,
}

impl ResponseStore {
    pub fn new(enabled: bool) -> ResponseStore {
        ResponseStore {
            enabled,
            inner: Mutex::default(),
        }
    }

    fn get(&self, id: &str) -> Option<(Value, Vec<ChatMessage>)> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.responses.get(id).cloned()
    }

    fn put(&self, id: String, response: Value, messages: Vec<ChatMessage>) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if inner
            .responses
            .insert(id.clone(), (response, messages))
            .is_none()
        {
            inner.order.push_back(id);
        }
        while inner.order.len() > STORE_CAPACITY {
            if let Some(old) = inner.order.pop_front() {
                inner.responses.remove(&old);
            }
        }
    }
}

fn not_found(id: &str) -> Failure {
    error(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!("Response with id '{id}' not found."),
        Some("response_id"),
    )
}

/// What one request asks for, checked.
struct Prepared {
    id: String,
    request: Value,
    messages: Vec<ChatMessage>,
    prompt: Vec<u32>,
    output: Vec<u32>,
    store: bool,
    stream: bool,
    cache_salt: Option<String>,
}

fn prepare(worker: &Worker, body: &[u8]) -> Result<Prepared, Failure> {
    let request = request_for(worker, body)?;
    if !matches!(
        request.get("input"),
        Some(Value::String(_) | Value::Array(_))
    ) {
        return Err(bad_request(
            "1 validation error: 'input' must be a string or a list of input items",
        ));
    }
    let flag = |name: &str| request.get(name).and_then(Value::as_bool);
    let previous = request.get("previous_response_id").and_then(Value::as_str);
    if previous.is_some()
        && request
            .get("previous_input_messages")
            .is_some_and(|v| !v.is_null())
    {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "Only one of `previous_input_messages` and `previous_response_id` can be set.",
            Some("previous_response_id"),
        ));
    }
    let store_asked = flag("store").unwrap_or(true);
    if flag("background").unwrap_or(false) {
        return Err(if store_asked && !worker.responses.enabled {
            error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "This vLLM engine does not support `store=True` and therefore does not support the background mode. To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
                Some("background"),
            )
        } else {
            bad_request("background mode is not simulated")
        });
    }
    // As vLLM: `store` is silently off when the server does not keep responses.
    let store = store_asked && worker.responses.enabled;
    let history = match previous {
        Some(id) => Some(worker.responses.get(id).ok_or_else(|| not_found(id))?),
        None => None,
    };
    // instructions, then the stored conversation (less its system messages, as OpenAI's
    // instructions do not carry over), then its output, then the new input.
    let mut rendered = responses_messages(&request);
    let split = usize::from(
        request
            .get("instructions")
            .and_then(Value::as_str)
            .is_some_and(|text| !text.is_empty()),
    );
    let input = rendered.split_off(split);
    let mut messages = rendered;
    if let Some((response, past)) = &history {
        messages.extend(past.iter().filter(|m| m.role != "system").cloned());
        for item in response["output"].as_array().into_iter().flatten() {
            if item["type"] == "message" {
                for part in item["content"].as_array().into_iter().flatten() {
                    messages.push(ChatMessage::new(
                        "assistant",
                        part["text"].as_str().unwrap_or_default(),
                    ));
                }
            }
        }
    }
    messages.extend(input);
    let prompt = worker
        .tokenizer
        .encode_chat(&messages)
        .map_err(|e| bad_request(e.to_string()))?;
    let max_tokens = request.get("max_output_tokens").and_then(Value::as_u64);
    let (output, cache_salt) = generation(
        worker,
        &request,
        prompt.len(),
        max_tokens,
        "max_output_tokens",
    )?;
    let id = request
        .get("request_id")
        .and_then(Value::as_str)
        .map_or_else(
            || format!("resp_{:032x}", rand::random::<u128>()),
            str::to_owned,
        );
    Ok(Prepared {
        id,
        stream: flag("stream").unwrap_or(false),
        request,
        messages,
        prompt,
        output,
        store,
        cache_salt,
    })
}

/// The response object (`ResponsesResponse.from_request`): the request's settings echoed,
/// the output items, the status and usage.
fn response_object(
    worker: &Worker,
    prepared: &Prepared,
    created: u64,
    status: &str,
    output: Vec<Value>,
    usage: Value,
) -> Value {
    let request = &prepared.request;
    let field = |name: &str, default: Value| request.get(name).cloned().unwrap_or(default);
    json!({
        "id": prepared.id,
        "created_at": created,
        "incomplete_details": if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { Value::Null },
        "instructions": field("instructions", Value::Null),
        "metadata": field("metadata", Value::Null),
        "model": worker.model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": field("parallel_tool_calls", json!(true)),
        "temperature": field("temperature", json!(1.0)),
        "tool_choice": field("tool_choice", json!("auto")),
        "tools": field("tools", json!([])),
        "top_p": field("top_p", json!(1.0)),
        "background": false,
        "max_output_tokens": prepared.output.len(),
        "max_tool_calls": field("max_tool_calls", Value::Null),
        "previous_response_id": field("previous_response_id", Value::Null),
        "prompt": Value::Null,
        "reasoning": field("reasoning", Value::Null),
        "service_tier": field("service_tier", json!("auto")),
        "status": status,
        "text": field("text", Value::Null),
        "top_logprobs": field("top_logprobs", json!(0)),
        "truncation": field("truncation", json!("disabled")),
        "usage": usage,
        "user": field("user", Value::Null),
    })
}

fn usage(prompt: usize, output: usize, cached: usize) -> Value {
    json!({
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0, "input_tokens_per_turn": [prompt], "cached_tokens_per_turn": [cached]},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [output], "tool_output_tokens_per_turn": [0]},
        "total_tokens": prompt + output,
    })
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"id": id, "content": [{"annotations": [], "text": text, "type": "output_text", "logprobs": null}],
           "role": "assistant", "status": status, "type": "message"})
}

/// `POST /v1/responses`.
pub async fn create(State(worker): State<Arc<Worker>>, body: Bytes) -> Response {
    if worker.task != Task::Generate {
        return route_not_served();
    }
    let prepared = match prepare(&worker, &body) {
        Ok(prepared) => prepared,
        Err(failure) => return failure.into_response(),
    };
    let outputs = match worker.engine.submit_salted(
        prepared.prompt.clone(),
        prepared.output.clone(),
        prepared.cache_salt.clone(),
    ) {
        Ok(outputs) => outputs,
        Err(e) => return bad_request(e.to_string()).into_response(),
    };
    let created = unix_now();
    if prepared.stream {
        return stream(worker, prepared, created, outputs);
    }
    let collected = collect(outputs).await;
    let text = text_of(&worker, &collected.tokens);
    let item = message_item(
        &format!("msg_{:032x}", rand::random::<u128>()),
        &text,
        "incomplete",
    );
    // The simulated engine always stops at the token limit: vLLM's "incomplete".
    let response = response_object(
        &worker,
        &prepared,
        created,
        "incomplete",
        vec![item],
        usage(
            prepared.prompt.len(),
            collected.tokens.len(),
            collected.cached_tokens,
        ),
    );
    if prepared.store {
        worker.responses.put(
            prepared.id.clone(),
            response.clone(),
            prepared.messages.clone(),
        );
    }
    axum::Json(response).into_response()
}

/// A streamed response: `response.created`, `response.in_progress`, the message's item and
/// part opened at the first token, one `response.output_text.delta` per token, the closing
/// events, then `response.incomplete` (the token limit) with the whole response.
fn stream(
    worker: Arc<Worker>,
    prepared: Prepared,
    created: u64,
    outputs: mpsc::UnboundedReceiver<Output>,
) -> Response {
    struct State {
        worker: Arc<Worker>,
        prepared: Prepared,
        created: u64,
        outputs: mpsc::UnboundedReceiver<Output>,
        sequence: u64,
        item_id: String,
        text: String,
        generated: usize,
        cached: usize,
        opened: bool,
        done: bool,
    }
    impl State {
        fn event(&mut self, kind: &str, mut data: Value) -> String {
            if let Some(fields) = data.as_object_mut() {
                fields.insert("type".into(), json!(kind));
                fields.insert("sequence_number".into(), json!(self.sequence));
            }
            self.sequence += 1;
            format!("event: {kind}\ndata: {data}\n\n")
        }
    }
    let initial = response_object(
        &worker,
        &prepared,
        created,
        "in_progress",
        Vec::new(),
        Value::Null,
    );
    let mut state = State {
        worker,
        prepared,
        created,
        outputs,
        sequence: 0,
        item_id: format!("msg_{:032x}", rand::random::<u128>()),
        text: String::new(),
        generated: 0,
        cached: 0,
        opened: false,
        done: false,
    };
    let mut head = state.event("response.created", json!({"response": initial}));
    head.push_str(&state.event("response.in_progress", json!({"response": initial})));
    let head = futures_util::stream::once(async move { Ok::<_, Infallible>(Bytes::from(head)) });
    let body = futures_util::stream::unfold(state, |mut state| async move {
        if state.done {
            return None;
        }
        let mut out = String::new();
        match state.outputs.recv().await.unwrap_or(Output::Finished) {
            Output::Started { cached_tokens } => state.cached = cached_tokens,
            Output::Token(token) => {
                let text = state
                    .worker
                    .token_text
                    .get(&token)
                    .cloned()
                    .unwrap_or_default();
                if !state.opened {
                    state.opened = true;
                    let item = json!({"id": state.item_id, "content": [], "role": "assistant",
                                      "status": "in_progress", "type": "message"});
                    out.push_str(&state.event(
                        "response.output_item.added",
                        json!({"output_index": 0, "item": item}),
                    ));
                    let id = state.item_id.clone();
                    out.push_str(&state.event("response.content_part.added", json!({"output_index": 0, "item_id": id, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})));
                }
                state.generated += 1;
                state.text.push_str(&text);
                let id = state.item_id.clone();
                out.push_str(&state.event(
                    "response.output_text.delta",
                    json!({"output_index": 0, "item_id": id, "content_index": 0,
                    "delta": text, "logprobs": []}),
                ));
            }
            Output::Finished => {
                state.done = true;
                let id = state.item_id.clone();
                let text = state.text.clone();
                out.push_str(&state.event(
                    "response.output_text.done",
                    json!({"output_index": 0, "item_id": id, "content_index": 0,
                    "text": text, "logprobs": []}),
                ));
                out.push_str(&state.event(
                    "response.content_part.done",
                    json!({"output_index": 0, "item_id": id, "content_index": 0,
                    "part": {"type": "output_text", "text": text, "annotations": []}}),
                ));
                let item = message_item(&id, &text, "incomplete");
                out.push_str(&state.event(
                    "response.output_item.done",
                    json!({"output_index": 0, "item": item}),
                ));
                let usage = usage(state.prepared.prompt.len(), state.generated, state.cached);
                let response = response_object(
                    &state.worker,
                    &state.prepared,
                    state.created,
                    "incomplete",
                    vec![item],
                    usage,
                );
                if state.prepared.store {
                    state.worker.responses.put(
                        state.prepared.id.clone(),
                        response.clone(),
                        state.prepared.messages.clone(),
                    );
                }
                out.push_str(&state.event("response.incomplete", json!({"response": response})));
            }
        }
        Some((Ok::<_, Infallible>(Bytes::from(out)), state))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(futures_util::StreamExt::chain(
            head, body,
        )))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// `GET /v1/responses/{id}`.
pub async fn retrieve(State(worker): State<Arc<Worker>>, Path(id): Path<String>) -> Response {
    match worker.responses.get(&id) {
        Some((response, _)) => axum::Json(response).into_response(),
        None => not_found(&id).into_response(),
    }
}

/// `POST /v1/responses/{id}/cancel`: only background responses can be, and none are here.
pub async fn cancel(State(worker): State<Arc<Worker>>, Path(id): Path<String>) -> Response {
    match worker.responses.get(&id) {
        Some(_) => error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "Cannot cancel a synchronous response.",
            Some("response_id"),
        )
        .into_response(),
        None => not_found(&id).into_response(),
    }
}
