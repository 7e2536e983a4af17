//! Whole answers put together from a worker's stream.
//!
//! A client that asks a pool for a whole Chat Completions, Completions, Responses or Anthropic
//! Messages answer gets one, but the gateway asks the worker for a stream (OpenAI's with
//! usage) and assembles it here: a Responses stream's last event carries the whole response;
//! an Anthropic message is its `message_start`, its content blocks and `message_delta`. Only a
//! stream shows the moment the first token comes, which is when the worker's prefill is done:
//! the ledger releases the request's prefill then, not when the last token comes, and the
//! pool's TTFT model observes it. The assembled answer has the shape of vLLM's whole answer:
//! the choices' text (and every other text field of the deltas, such as `reasoning_content`)
//! joined, tool calls joined by index, logprobs' arrays joined, the last chunk's usage, and the
//! fields a whole answer names as null. What a stream carries otherwise than a whole answer
//! (token ids, a chat's logprobs, KV transfer parameters...) is never asked for this way: see
//! [`crate::wire::RequestBody::assemblable`].
//!
//! A stream that carries an error, or ends before its answer did (a choice unfinished, no
//! final event or `message_stop`), has no whole answer: [`Assembler::answer`] says why, and
//! the gateway ends the client's connection (its status is sent already), as it would had the
//! worker's connection failed.

use std::collections::BTreeMap;

use bytes::{Bytes, BytesMut};
use serde_json::{Map, Value, json};

use crate::translate::{event_data, find_event_end};

/// The answer's API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `chat.completion` from `chat.completion.chunk`s.
    Chat,
    /// `text_completion` from `text_completion` chunks.
    Completion,
    /// A Responses API `response`: the one its stream's last event carries whole.
    Response,
    /// An Anthropic `message` from its events.
    Message,
}

/// The events a Responses API stream opens with before any output: vLLM sends both as soon as
/// it has accepted the request, before its engine yields a token (`responses_stream_generator`).
pub const OPENING_EVENTS: [&str; 2] = ["response.created", "response.in_progress"];
/// The error a stream's event carries: vLLM's `{"error": {...}}` (Anthropic's `{"type": "error",
/// "error": {...}}` too), or the event itself when it is one (`Value::Null`; its message is
/// beside): `"object": "error"` before vLLM 0.10, a Responses stream's `"type": "error"`.
pub fn stream_error(event: &Map<String, Value>) -> Option<&Value> {
    let names_error = |field: &str| event.get(field).and_then(Value::as_str) == Some("error");
    match event.get("error") {
        Some(error) => Some(error),
        None => (names_error("object") || names_error("type")).then_some(&Value::Null),
    }
}

/// The Responses API events that end a stream with the whole response.
const FINAL_EVENTS: [&str; 3] = [
    "response.completed",
    "response.incomplete",
    "response.failed",
];

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
    /// A Responses stream's whole response, from its final event; an Anthropic stream's
    /// message, from `message_start` and `message_delta`.
    response: Option<Map<String, Value>>,
    /// An Anthropic stream's content blocks by index, and each tool call's input as sent.
    blocks: BTreeMap<u64, (Map<String, Value>, String)>,
    /// How far into `pending` no event's end was found (a long event, such as a Responses
    /// stream's final one, is not searched again from its start with every piece).
    searched: usize,
    /// The stream said `[DONE]` (a Responses stream: sent its final event; an Anthropic one:
    /// `message_stop`).
    done: bool,
    /// Why there is no whole answer, once there is none.
    failed: Option<String>,
}

/// The most an assembled answer keeps pending between events: a chat, completions or
/// Anthropic event is one token's delta, but a Responses stream's final event is the whole
/// response (its instructions, tools and output, with logprobs when asked: about 1.5 kB per
/// token), so this is far past any answer vLLM gives whole.
const MAX_PENDING: usize = 64 << 20;

impl Assembler {
    pub fn new(kind: Kind) -> Assembler {
        Assembler {
            kind,
            pending: BytesMut::new(),
            head: Map::new(),
            choices: BTreeMap::new(),
            usage: None,
            response: None,
            blocks: BTreeMap::new(),
            searched: 0,
            done: false,
            failed: None,
        }
    }

    /// Take a piece of the worker's stream. Returns whether it carried output (vLLM's first
    /// is its first token; an error event is not output).
    pub fn feed(&mut self, chunk: &[u8]) -> bool {
        if self.failed.is_some() {
            return false;
        }
        self.pending.extend_from_slice(chunk);
        let mut output = false;
        loop {
            // A separator may straddle the last piece's end: look from a little before it.
            let from = self.searched.saturating_sub(3);
            let Some((end, separator)) = self.pending.get(from..).and_then(find_event_end) else {
                self.searched = self.pending.len();
                break;
            };
            let event = self.pending.split_to(from + end + separator);
            self.searched = 0;
            if let Some(data) = event_data(event.get(..from + end).unwrap_or_default()) {
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
        self.searched = 0;
    }

    /// Take one event's data; whether it carried output (choices; for the Responses and
    /// Anthropic streams see `response_event` and `message_event`).
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
        if let Some(error) = stream_error(&chunk) {
            let message = error
                .get("message")
                .or_else(|| chunk.get("message"))
                .and_then(Value::as_str)
                .unwrap_or("unknown error")
                .to_owned();
            self.fail(&format!("the worker's stream ended in an error: {message}"));
            return false;
        }
        match self.kind {
            Kind::Response => return self.response_event(chunk),
            Kind::Message => return self.message_event(chunk),
            Kind::Chat | Kind::Completion => {}
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
            if self.kind == Kind::Chat {
                if let Some(Value::Object(delta)) = choice.remove("delta") {
                    entry.delta(delta);
                }
            } else if let Some(text) = choice.remove("text") {
                entry.text("text", text);
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

    /// One event of a Responses stream (`type` names it): whether it is output (anything past
    /// the opening events); the final one carries the whole response.
    fn response_event(&mut self, mut event: Map<String, Value>) -> bool {
        // (`error` events: see `event`.)
        let kind = event.get("type").and_then(Value::as_str).unwrap_or("");
        if OPENING_EVENTS.contains(&kind) {
            return false;
        }
        if FINAL_EVENTS.contains(&kind) {
            match event.remove("response") {
                Some(Value::Object(response)) => {
                    self.response = Some(response);
                    self.done = true;
                }
                _ => self.fail("the worker's stream ended without its response"),
            }
        }
        true
    }

    /// One event of an Anthropic stream (`type` names it): whether it is output (anything but
    /// `ping`: vLLM sends `message_start` with its first chat chunk, at the first token, and a
    /// reasoning or tool-calling model's first block may come several tokens later).
    fn message_event(&mut self, mut event: Map<String, Value>) -> bool {
        let index = event.get("index").and_then(Value::as_u64).unwrap_or(0);
        match event.get("type").and_then(Value::as_str).unwrap_or("") {
            "message_start" => {
                if let Some(Value::Object(message)) = event.remove("message") {
                    self.response = Some(message);
                }
                true
            }
            "content_block_start" => {
                if let Some(Value::Object(block)) = event.remove("content_block") {
                    self.blocks.insert(index, (block, String::new()));
                }
                true
            }
            "content_block_delta" => {
                let Some((block, input)) = self.blocks.get_mut(&index) else {
                    self.fail("the worker's stream added to a content block it never started");
                    return false;
                };
                let Some(Value::Object(delta)) = event.remove("delta") else {
                    return true;
                };
                for (field, value) in delta {
                    match (field.as_str(), value) {
                        ("type", _) => {}
                        // A tool call's input arrives as pieces of its JSON text.
                        ("partial_json", Value::String(piece)) => input.push_str(&piece),
                        (_, Value::String(piece)) => match block.get_mut(&field) {
                            Some(Value::String(known)) => known.push_str(&piece),
                            _ => {
                                block.insert(field, Value::String(piece));
                            }
                        },
                        _ => {}
                    }
                }
                true
            }
            "message_delta" => {
                if let Some(message) = &mut self.response {
                    if let Some(Value::Object(delta)) = event.remove("delta") {
                        message.extend(delta);
                    }
                    if let Some(Value::Object(usage)) = event.remove("usage") {
                        match message.get_mut("usage") {
                            Some(Value::Object(known)) => known.extend(usage),
                            _ => {
                                message.insert("usage".into(), Value::Object(usage));
                            }
                        }
                    }
                }
                true
            }
            "message_stop" => {
                self.done = true;
                true
            }
            // (`error` events: see `event`.)
            _ => false,
        }
    }

    /// The assembled Anthropic message: its content blocks in order, each tool call's input
    /// parsed from its pieces.
    fn message(&mut self) -> Result<Map<String, Value>, String> {
        let mut message = self.response.take().unwrap_or_default();
        // vLLM's `message_start` leaves out what is only a default there; its whole message
        // names both.
        message.entry("type").or_insert_with(|| json!("message"));
        message.entry("role").or_insert_with(|| json!("assistant"));
        let mut content = Vec::with_capacity(self.blocks.len());
        for (_, (mut block, input)) in std::mem::take(&mut self.blocks) {
            if !input.is_empty() {
                let parsed = serde_json::from_str::<Value>(&input)
                    .map_err(|_| "a tool call's input in the worker's stream is not JSON")?;
                block.insert("input".into(), parsed);
            }
            content.push(Value::Object(block));
        }
        message.insert("content".into(), Value::Array(content));
        Ok(message)
    }

    /// Why the stream has no whole answer, if it has none.
    fn incomplete(&self) -> Option<String> {
        if let Some(why) = &self.failed {
            return Some(why.clone());
        }
        let unfinished = match self.kind {
            Kind::Response | Kind::Message => self.response.is_none(),
            Kind::Chat | Kind::Completion => {
                self.choices.is_empty() || self.choices.values().any(|c| c.finish_reason.is_none())
            }
        };
        (!self.done || unfinished)
            .then(|| "the worker's stream ended before its answer did".to_owned())
    }

    /// The whole answer, naming the model `model`; or why there is none.
    pub fn answer(&mut self, model: &str) -> Result<Bytes, String> {
        if let Some(why) = self.incomplete() {
            return Err(why);
        }
        let mut whole = match self.kind {
            Kind::Chat | Kind::Completion => self.choices_answer(),
            Kind::Response => self.response.take().unwrap_or_default(),
            Kind::Message => self.message()?,
        };
        whole.insert("model".into(), json!(model));
        Ok(Bytes::from(Value::Object(whole).to_string()))
    }

    /// The assembled Chat Completions or Completions answer (its `model` set by `answer`).
    fn choices_answer(&mut self) -> Map<String, Value> {
        let chat = self.kind == Kind::Chat;
        let choices: Vec<Value> = std::mem::take(&mut self.choices)
            .into_iter()
            .map(|(index, choice)| choice.into_json(index, chat))
            .collect();
        let mut answer = Map::new();
        answer.insert(
            "id".into(),
            self.head.remove("id").unwrap_or_else(|| json!("")),
        );
        answer.insert(
            "object".into(),
            json!(if chat {
                "chat.completion"
            } else {
                "text_completion"
            }),
        );
        answer.insert(
            "created".into(),
            self.head.remove("created").unwrap_or_else(|| json!(0)),
        );
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
        answer
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

    /// The choice as a whole answer's: a chat message (`chat`), or a completion's text.
    fn into_json(self, index: u64, chat: bool) -> Value {
        let mut out = Map::new();
        out.insert("index".into(), json!(index));
        let mut texts = self.texts;
        if chat {
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
        } else {
            out.insert(
                "text".into(),
                texts.remove("text").unwrap_or_else(|| json!("")),
            );
            for field in ["prompt_logprobs", "prompt_token_ids", "token_ids"] {
                out.insert(field.into(), Value::Null);
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
    fn a_responses_stream_is_whole_in_its_last_event_and_output_starts_past_the_opening() {
        let response = json!({"id": "resp_1", "object": "response", "model": "up", "status": "completed",
                              "instructions": "terse", "output": [{"type": "message", "content": [{"type": "output_text", "text": "Hi"}]}],
                              "usage": {"input_tokens": 5, "output_tokens": 1, "total_tokens": 6}});
        let event = |kind: &str, data: Value| {
            let mut data = data;
            data["type"] = json!(kind);
            format!("event: {kind}\ndata: {data}\n\n")
        };
        let opening = [
            event(
                "response.created",
                json!({"response": {"id": "resp_1", "status": "in_progress"}}),
            ),
            event(
                "response.in_progress",
                json!({"response": {"id": "resp_1", "status": "in_progress"}}),
            ),
        ];
        let delta = event("response.output_text.delta", json!({"delta": "Hi"}));
        let mut assembler = Assembler::new(Kind::Response);
        for piece in &opening {
            assert!(!assembler.feed(piece.as_bytes()), "{piece}");
        }
        assert!(assembler.feed(delta.as_bytes()));
        assert!(assembler.answer("alias").is_err(), "no final event yet");
        for last in ["response.completed", "response.incomplete"] {
            let stream = format!(
                "{}{delta}{}",
                opening.concat(),
                event(last, json!({"response": response}))
            );
            let mut expected = response.clone();
            expected["model"] = json!("alias");
            assert_eq!(assembled(Kind::Response, &stream, 13).unwrap(), expected);
        }
        let failed = format!(
            "{}{}",
            opening.concat(),
            event(
                "error",
                json!({"message": "engine died", "code": "server_error"})
            )
        );
        let why = assembled(Kind::Response, &failed, 13).unwrap_err();
        assert!(why.contains("engine died"), "{why}");
    }

    #[test]
    fn an_anthropic_stream_becomes_its_message_with_thinking_text_and_a_tool_call() {
        let event = |data: Value| {
            format!(
                "event: {}\ndata: {data}\n\n",
                data["type"].as_str().unwrap()
            )
        };
        // vLLM's `message_start` names no `type` or `role` (defaults there, left out).
        let start = event(
            json!({"type": "message_start", "message": {"id": "msg_1", "model": "up",
            "content": [], "usage": {"input_tokens": 9, "output_tokens": 1}}}),
        );
        let rest = [
            json!({"type": "ping"}),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "hm"}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "sig"}}),
            json!({"type": "content_block_stop", "index": 0}),
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Hel"}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "lo"}}),
            json!({"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}}),
            json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{\"city\": "}}),
            json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "\"Paris\"}"}}),
            json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null}, "usage": {"output_tokens": 12}}),
            json!({"type": "message_stop"}),
        ];
        // vLLM sends `message_start` at the first token; `ping` is no output.
        let mut assembler = Assembler::new(Kind::Message);
        assert!(!assembler.feed(event(rest[0].clone()).as_bytes()));
        assert!(assembler.feed(start.as_bytes()));
        let stream: String = std::iter::once(start)
            .chain(rest.iter().cloned().map(event))
            .collect();
        assert_eq!(
            assembled(Kind::Message, &stream, 17).unwrap(),
            json!({"id": "msg_1", "type": "message", "role": "assistant", "model": "alias",
                   "content": [
                       {"type": "thinking", "thinking": "hm", "signature": "sig"},
                       {"type": "text", "text": "Hello"},
                       {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                   ],
                   "stop_reason": "tool_use", "stop_sequence": null,
                   "usage": {"input_tokens": 9, "output_tokens": 12}})
        );
        // A delta to a block that never started: no whole message.
        let orphan = event(
            json!({"type": "content_block_delta", "index": 7, "delta": {"type": "text_delta", "text": "x"}}),
        );
        let opened = stream.split_inclusive("\n\n").next().unwrap();
        let why = assembled(Kind::Message, &format!("{opened}{orphan}"), 17).unwrap_err();
        assert!(why.contains("never started"), "{why}");
        let error = event(
            json!({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}),
        );
        let opened = stream.split_inclusive("\n\n").take(3).collect::<String>();
        let why = assembled(Kind::Message, &format!("{opened}{error}"), 17).unwrap_err();
        assert!(why.contains("busy"), "{why}");
        // No `message_stop`: no whole message.
        let cut = stream.rsplit_once("event: message_stop").unwrap().0;
        assert!(assembled(Kind::Message, cut, 17).is_err());
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
