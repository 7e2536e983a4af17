//! Whole answers put together from a worker's stream.
//!
//! A client that asks a pool for a whole Chat Completions or Completions answer gets one, but
//! the gateway asks the worker for a stream (with usage) and assembles it here. Only a stream
//! shows the moment the first token comes, which is when the worker's prefill is done: the
//! ledger releases the request's prefill then, not when the last token comes, and the pool's
//! TTFT model observes it. The assembled answer has the shape of vLLM's whole answer: the
//! choices' text (and every other text field of the deltas, such as `reasoning_content`)
//! joined, tool calls joined by index, logprobs' arrays joined, the last chunk's usage, and
//! the fields a whole answer names as null. What a stream carries otherwise than a whole
//! answer (token ids, a chat's logprobs, KV transfer parameters...) is never asked for this
//! way: see [`crate::wire::RequestBody::assemblable`].
//!
//! A stream that carries an error, or ends before every choice finished, has no whole answer:
//! [`Assembler::answer`] says why, and the gateway ends the client's connection (its status
//! is sent already), as it would had the worker's connection failed.

use std::collections::BTreeMap;

use bytes::{Bytes, BytesMut};
use serde_json::{Map, Value, json};

use crate::translate::next_event_data;

/// The answer's API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `chat.completion` from `chat.completion.chunk`s.
    Chat,
    /// `text_completion` from `text_completion` chunks.
    Completion,
}

/// One tool call, from its deltas.
#[derive(Debug, Default)]
struct ToolCall {
    id: Option<Value>,
    kind: Option<Value>,
    name: String,
    arguments: String,
}

/// One choice, from its deltas.
#[derive(Debug, Default)]
struct Choice {
    role: Option<Value>,
    /// Text fields (`content`, `reasoning_content`, a completion's `text`...), joined.
    texts: Map<String, Value>,
    /// Other non-null fields of the deltas, the last of each.
    others: Map<String, Value>,
    tool_calls: BTreeMap<u64, ToolCall>,
    logprobs: Option<Value>,
    finish_reason: Option<Value>,
    stop_reason: Option<Value>,
}

/// A stream being assembled into a whole answer.
#[derive(Debug)]
pub struct Assembler {
    kind: Kind,
    pending: BytesMut,
    /// `id`, `created`, `system_fingerprint`: the first chunk's.
    head: Map<String, Value>,
    choices: BTreeMap<u64, Choice>,
    usage: Option<Value>,
    /// The stream said `[DONE]`.
    done: bool,
    /// Why there is no whole answer, once there is none.
    failed: Option<String>,
}

/// The most text an assembled answer keeps pending between events (a stream's event is one
/// token's delta: this much without an event's end is not vLLM's stream).
const MAX_PENDING: usize = 8 << 20;

impl Assembler {
    pub fn new(kind: Kind) -> Assembler {
        Assembler {
            kind,
            pending: BytesMut::new(),
            head: Map::new(),
            choices: BTreeMap::new(),
            usage: None,
            done: false,
            failed: None,
        }
    }

    /// Take a piece of the worker's stream. Returns whether it carried output (an event with
    /// choices: vLLM's first is its first token; an error event is not output).
    pub fn feed(&mut self, chunk: &[u8]) -> bool {
        if self.failed.is_some() {
            return false;
        }
        self.pending.extend_from_slice(chunk);
        let mut output = false;
        while let Some(data) = next_event_data(&mut self.pending) {
            if let Some(data) = data {
                output |= self.event(&data);
            }
        }
        if self.pending.len() > MAX_PENDING {
            self.fail("the worker's stream sent an event too long to assemble");
        }
        output && self.failed.is_none()
    }

    fn fail(&mut self, why: &str) {
        if self.failed.is_none() {
            self.failed = Some(why.to_owned());
        }
        self.pending = BytesMut::new();
    }

    /// Take one event's data; whether it carried choices.
    fn event(&mut self, data: &str) -> bool {
        let data = data.trim();
        if data == "[DONE]" {
            self.done = true;
            return false;
        }
        let Ok(Value::Object(mut chunk)) = serde_json::from_str::<Value>(data) else {
            self.fail("the worker's stream sent an event that is not a JSON object");
            return false;
        };
        // vLLM's error event: `{"error": {...}}`, or (before 0.10) the error object itself.
        let error = match chunk.get("error") {
            Some(error) => Some(error),
            None => (chunk.get("object").and_then(Value::as_str) == Some("error"))
                .then_some(&Value::Null),
        };
        if let Some(error) = error {
            let message = error
                .get("message")
                .or_else(|| chunk.get("message"))
                .and_then(Value::as_str)
                .unwrap_or("unknown error")
                .to_owned();
            self.fail(&format!("the worker's stream ended in an error: {message}"));
            return false;
        }
        for field in ["id", "created", "system_fingerprint"] {
            if let Some(value) = chunk.remove(field).filter(|v| !v.is_null()) {
                self.head.entry(field).or_insert(value);
            }
        }
        if let Some(usage) = chunk.remove("usage").filter(|v| !v.is_null()) {
            self.usage = Some(usage);
        }
        let Some(Value::Array(choices)) = chunk.remove("choices") else {
            return false;
        };
        let output = !choices.is_empty();
        for choice in choices {
            let Value::Object(mut choice) = choice else {
                continue;
            };
            let index = choice.get("index").and_then(Value::as_u64).unwrap_or(0);
            let entry = self.choices.entry(index).or_default();
            match self.kind {
                Kind::Chat => {
                    if let Some(Value::Object(delta)) = choice.remove("delta") {
                        entry.delta(delta);
                    }
                }
                Kind::Completion => {
                    if let Some(text) = choice.remove("text") {
                        entry.text("text", text);
                    }
                }
            }
            if let Some(logprobs) = choice.remove("logprobs").filter(|v| !v.is_null()) {
                match &mut entry.logprobs {
                    Some(known) => join_logprobs(known, logprobs),
                    None => entry.logprobs = Some(logprobs),
                }
            }
            if let Some(reason) = choice.remove("finish_reason").filter(|v| !v.is_null()) {
                entry.finish_reason = Some(reason);
            }
            if let Some(reason) = choice.remove("stop_reason").filter(|v| !v.is_null()) {
                entry.stop_reason = Some(reason);
            }
        }
        output
    }

    /// Why the stream has no whole answer, if it has none.
    fn incomplete(&self) -> Option<String> {
        if let Some(why) = &self.failed {
            return Some(why.clone());
        }
        let unfinished = self.choices.values().any(|c| c.finish_reason.is_none());
        (!self.done || self.choices.is_empty() || unfinished)
            .then(|| "the worker's stream ended before its answer did".to_owned())
    }

    /// The whole answer, naming the model `model`; or why there is none.
    pub fn answer(&mut self, model: &str) -> Result<Bytes, String> {
        if let Some(why) = self.incomplete() {
            return Err(why);
        }
        let object = match self.kind {
            Kind::Chat => "chat.completion",
            Kind::Completion => "text_completion",
        };
        let choices: Vec<Value> = std::mem::take(&mut self.choices)
            .into_iter()
            .map(|(index, choice)| choice.into_json(index, self.kind))
            .collect();
        let mut answer = Map::new();
        answer.insert(
            "id".into(),
            self.head.remove("id").unwrap_or_else(|| json!("")),
        );
        answer.insert("object".into(), json!(object));
        answer.insert(
            "created".into(),
            self.head.remove("created").unwrap_or_else(|| json!(0)),
        );
        answer.insert("model".into(), json!(model));
        answer.insert("choices".into(), Value::Array(choices));
        answer.insert("usage".into(), self.usage.take().unwrap_or(Value::Null));
        answer.insert(
            "system_fingerprint".into(),
            self.head
                .remove("system_fingerprint")
                .unwrap_or(Value::Null),
        );
        // What vLLM's whole answer carries as null unless asked for (requests that ask are
        // not assembled: see `RequestBody::assemblable`).
        for field in ["service_tier", "prompt_logprobs", "kv_transfer_params"] {
            answer.insert(field.into(), Value::Null);
        }
        Ok(Bytes::from(Value::Object(answer).to_string()))
    }
}

impl Choice {
    fn text(&mut self, field: &str, text: Value) {
        let Value::String(text) = text else {
            return;
        };
        match self.texts.get_mut(field) {
            Some(Value::String(known)) => known.push_str(&text),
            _ => {
                self.texts.insert(field.to_owned(), Value::String(text));
            }
        }
    }

    fn delta(&mut self, delta: Map<String, Value>) {
        for (field, value) in delta {
            match (field.as_str(), value) {
                (_, Value::Null) => {}
                ("role", role) => self.role = Some(role),
                ("tool_calls", Value::Array(calls)) => {
                    for call in calls {
                        self.tool_call(call);
                    }
                }
                (_, Value::String(text)) => self.text(&field, Value::String(text)),
                (_, other) => {
                    self.others.insert(field, other);
                }
            }
        }
    }

    fn tool_call(&mut self, call: Value) {
        let Value::Object(mut call) = call else {
            return;
        };
        let index = call.get("index").and_then(Value::as_u64).unwrap_or(0);
        let entry = self.tool_calls.entry(index).or_default();
        if let Some(id) = call.remove("id").filter(|v| !v.is_null()) {
            entry.id.get_or_insert(id);
        }
        if let Some(kind) = call.remove("type").filter(|v| !v.is_null()) {
            entry.kind.get_or_insert(kind);
        }
        if let Some(Value::Object(function)) = call.remove("function") {
            if let Some(Value::String(name)) = function.get("name") {
                entry.name.push_str(name);
            }
            if let Some(Value::String(arguments)) = function.get("arguments") {
                entry.arguments.push_str(arguments);
            }
        }
    }

    fn into_json(self, index: u64, kind: Kind) -> Value {
        let mut out = Map::new();
        out.insert("index".into(), json!(index));
        let mut texts = self.texts;
        match kind {
            Kind::Chat => {
                let mut message = Map::new();
                message.insert(
                    "role".into(),
                    self.role.unwrap_or_else(|| json!("assistant")),
                );
                // `content` null when the model only called tools (its stream opens with an
                // empty one all the same), else a string.
                let content = match texts.remove("content") {
                    Some(Value::String(text)) if text.is_empty() && !self.tool_calls.is_empty() => {
                        Value::Null
                    }
                    Some(content) => content,
                    None if self.tool_calls.is_empty() => json!(""),
                    None => Value::Null,
                };
                message.insert("content".into(), content);
                // vLLM's whole message names these even when null; a client reading
                // `reasoning_content` of a model without reasoning finds it so.
                for field in [
                    "refusal",
                    "annotations",
                    "audio",
                    "function_call",
                    "reasoning_content",
                ] {
                    message.insert(field.into(), Value::Null);
                }
                message.extend(texts);
                message.extend(self.others);
                let calls: Vec<Value> = self
                    .tool_calls
                    .into_values()
                    .map(|call| {
                        json!({
                            "id": call.id.unwrap_or(Value::Null),
                            "type": call.kind.unwrap_or_else(|| json!("function")),
                            "function": {"name": call.name, "arguments": call.arguments},
                        })
                    })
                    .collect();
                message.insert("tool_calls".into(), Value::Array(calls));
                out.insert("message".into(), Value::Object(message));
            }
            Kind::Completion => {
                out.insert(
                    "text".into(),
                    texts.remove("text").unwrap_or_else(|| json!("")),
                );
                for field in ["prompt_logprobs", "prompt_token_ids", "token_ids"] {
                    out.insert(field.into(), Value::Null);
                }
            }
        }
        out.insert("logprobs".into(), self.logprobs.unwrap_or(Value::Null));
        out.insert(
            "finish_reason".into(),
            self.finish_reason.unwrap_or(Value::Null),
        );
        out.insert(
            "stop_reason".into(),
            self.stop_reason.unwrap_or(Value::Null),
        );
        Value::Object(out)
    }
}

/// Join a chunk's logprobs to those before: arrays (a chat answer's `content`, a completion's
/// `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) are appended, other fields
/// replaced when set.
fn join_logprobs(known: &mut Value, more: Value) {
    let (Value::Object(known), Value::Object(more)) = (known, more) else {
        return;
    };
    for (field, value) in more {
        match (known.get_mut(&field), value) {
            (Some(Value::Array(items)), Value::Array(more)) => items.extend(more),
            (_, Value::Null) => {}
            (_, value) => {
                known.insert(field, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(chunks: &[Value]) -> String {
        let mut out: String = chunks.iter().map(|c| format!("data: {c}\n\n")).collect();
        out.push_str("data: [DONE]\n\n");
        out
    }

    /// Feed `stream` cut into pieces of `piece` bytes (events straddle the cuts).
    fn assembled(kind: Kind, stream: &str, piece: usize) -> Result<Value, String> {
        let mut assembler = Assembler::new(kind);
        for part in stream.as_bytes().chunks(piece) {
            assembler.feed(part);
        }
        let answer = assembler.answer("alias")?;
        Ok(serde_json::from_slice(&answer).unwrap())
    }

    #[test]
    fn a_chat_stream_becomes_the_answer_vllm_sends_whole() {
        // vLLM's shapes: a role chunk, content and reasoning deltas, two choices interleaved,
        // logprobs per token, a tool call whose arguments come in pieces, then usage alone.
        let stream = events(&[
            json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "up",
                   "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null},
                               {"index": 1, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}),
            json!({"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"reasoning_content": "think "},
                   "logprobs": {"content": [{"token": "think", "logprob": -0.5}]}, "finish_reason": null}]}),
            json!({"id": "chatcmpl-1", "choices": [{"index": 1, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": ""}}]}, "finish_reason": null}]}),
            json!({"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": "Hel"},
                   "logprobs": {"content": [{"token": "Hel", "logprob": -0.1}]}, "finish_reason": null}]}),
            json!({"id": "chatcmpl-1", "choices": [{"index": 1, "delta": {"tool_calls": [{"index": 0,
                   "function": {"arguments": "{\"city\": "}}]}, "finish_reason": null}]}),
            json!({"id": "chatcmpl-1", "choices": [{"index": 1, "delta": {"tool_calls": [{"index": 0,
                   "function": {"arguments": "\"Paris\"}"}}]}, "finish_reason": "tool_calls"}]}),
            json!({"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": "lo"},
                   "logprobs": {"content": [{"token": "lo", "logprob": -0.2}]}, "finish_reason": "stop", "stop_reason": 42}]}),
            json!({"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14,
                   "prompt_tokens_details": {"cached_tokens": 8}}}),
        ]);
        let nulls = json!({"refusal": null, "annotations": null, "audio": null, "function_call": null, "reasoning_content": null});
        let message = |fields: Value| {
            let mut message = nulls.clone();
            message
                .as_object_mut()
                .unwrap()
                .extend(fields.as_object().unwrap().clone());
            message
        };
        let expected = json!({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 7, "model": "alias",
            "choices": [
                {"index": 0, "message": message(json!({"role": "assistant", "content": "Hello", "reasoning_content": "think ", "tool_calls": []})),
                 "logprobs": {"content": [{"token": "think", "logprob": -0.5}, {"token": "Hel", "logprob": -0.1}, {"token": "lo", "logprob": -0.2}]},
                 "finish_reason": "stop", "stop_reason": 42},
                {"index": 1, "message": message(json!({"role": "assistant", "content": null, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]})),
                 "logprobs": null, "finish_reason": "tool_calls", "stop_reason": null},
            ],
            "usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14, "prompt_tokens_details": {"cached_tokens": 8}},
            "system_fingerprint": null, "service_tier": null, "prompt_logprobs": null, "kv_transfer_params": null,
        });
        // Whole, byte by byte, and with CRLF separators: the same answer.
        for piece in [stream.len(), 1, 7] {
            assert_eq!(assembled(Kind::Chat, &stream, piece).unwrap(), expected);
        }
        let crlf = stream.replace("\n\n", "\r\n\r\n");
        assert_eq!(assembled(Kind::Chat, &crlf, 5).unwrap(), expected);
    }

    #[test]
    fn a_completion_stream_joins_text_and_logprob_arrays() {
        let stream = events(&[
            json!({"id": "cmpl-1", "object": "text_completion", "created": 3, "model": "up",
                   "choices": [{"index": 0, "text": "Hel", "logprobs": {"tokens": ["Hel"], "token_logprobs": [-0.1],
                   "top_logprobs": [{"Hel": -0.1}], "text_offset": [0]}, "finish_reason": null}]}),
            json!({"id": "cmpl-1", "choices": [{"index": 0, "text": "lo", "logprobs": {"tokens": ["lo"], "token_logprobs": [-0.2],
                   "top_logprobs": [{"lo": -0.2}], "text_offset": [3]}, "finish_reason": "length"}]}),
            json!({"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}),
        ]);
        assert_eq!(
            assembled(Kind::Completion, &stream, 11).unwrap(),
            json!({
                "id": "cmpl-1", "object": "text_completion", "created": 3, "model": "alias",
                "choices": [{"index": 0, "text": "Hello",
                             "logprobs": {"tokens": ["Hel", "lo"], "token_logprobs": [-0.1, -0.2],
                                          "top_logprobs": [{"Hel": -0.1}, {"lo": -0.2}], "text_offset": [0, 3]},
                             "finish_reason": "length", "stop_reason": null,
                             "prompt_logprobs": null, "prompt_token_ids": null, "token_ids": null}],
                "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
                "system_fingerprint": null, "service_tier": null, "prompt_logprobs": null, "kv_transfer_params": null,
            })
        );
    }

    #[test]
    fn a_stream_that_errs_or_stops_short_has_no_whole_answer() {
        let opening = json!({"id": "c", "choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": null}]});
        let error = json!({"error": {"message": "engine died", "type": "InternalServerError", "code": 500}});
        let older = json!({"object": "error", "message": "engine died", "type": "InternalServerError", "code": 500});
        // Output is an event with choices; an error event is none.
        let mut assembler = Assembler::new(Kind::Chat);
        assert!(!assembler.feed(format!("data: {error}\n\n").as_bytes()));
        let mut assembler = Assembler::new(Kind::Chat);
        assert!(assembler.feed(format!("data: {opening}\n\n").as_bytes()));
        assert!(!assembler.feed(b"data: [DONE]\n\n"));
        for error in [error, older] {
            let errored = events(&[opening.clone(), error]);
            let why = assembled(Kind::Chat, &errored, 9).unwrap_err();
            assert!(why.contains("engine died"), "{why}");
        }
        // Cut before the end: no [DONE], or a choice without its finish reason.
        let cut = format!("data: {opening}\n\n");
        assert!(assembled(Kind::Chat, &cut, 9).is_err());
        let unfinished = events(&[opening]);
        assert!(assembled(Kind::Chat, &unfinished, 9).is_err());
        assert!(assembled(Kind::Chat, "data: [DONE]\n\n", 9).is_err());
        let garbage = "data: {not json\n\ndata: [DONE]\n\n";
        assert!(assembled(Kind::Chat, garbage, 9).is_err());
    }
}
