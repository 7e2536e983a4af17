//! Anthropic Messages ⇄ OpenAI Chat Completions, for targets that only speak OpenAI.
//!
//! Requests are translated whole; responses either whole (non-streaming, errors) or event by
//! event (streaming) so a translated stream still reaches the client chunk by chunk.

use bytes::{Bytes, BytesMut};
use serde_json::{Value, json};

use crate::api::{ApiError, ClientFormat, Endpoint, ErrorKind};
use crate::wire::answer::{self, ChatCompletion, ErrorBody, StreamData, UsageFields};
use crate::wire::{Content, tree_or_null};

fn stop_reason(finish_reason: Option<&str>) -> Value {
    match finish_reason {
        Some("stop") => json!("end_turn"),
        Some("length") => json!("max_tokens"),
        Some("tool_calls") | Some("function_call") => json!("tool_use"),
        Some(_) => json!("end_turn"),
        None => Value::Null,
    }
}

fn anthropic_usage(usage: Option<&UsageFields>) -> Value {
    let usage = usage.cloned().unwrap_or_default();
    let cached = usage.cached_tokens().unwrap_or(0);
    json!({
        "input_tokens": usage.prompt_tokens.unwrap_or(0).saturating_sub(cached),
        "output_tokens": usage.completion_tokens.unwrap_or(0),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    })
}

/// Translate a whole (non-streaming) Chat Completions response into a Messages response.
pub fn chat_response_to_message(body: &[u8], client_model: &str) -> Result<Bytes, String> {
    let Some(response) = answer::parse::<ChatCompletion<'_>>(body) else {
        return Err("the upstream's whole answer is not a Chat Completions answer".to_owned());
    };
    let choice = response.choices.as_deref().and_then(<[_]>::first);
    let message = choice.and_then(|c| c.message.as_ref());
    let mut content = Vec::new();
    if let Some(Content::Text(text)) = message.and_then(|m| m.content.as_ref())
        && !text.is_empty()
    {
        content.push(json!({"type": "text", "text": text}));
    }
    for call in message
        .and_then(|m| m.tool_calls.as_deref())
        .unwrap_or_default()
    {
        let function = call.function.as_ref();
        let input = match function.and_then(|f| f.arguments_value()) {
            Some(Ok(input)) => input,
            _ => json!({}),
        };
        content.push(json!({
            "type": "tool_use",
            "id": tree_or_null(call.id),
            "name": tree_or_null(function.and_then(|f| f.name)),
            "input": input,
        }));
    }
    let id = response.id.as_deref().unwrap_or("unknown");
    Ok(Bytes::from(
        json!({
            "id": format!("msg_{id}"),
            "type": "message",
            "role": "assistant",
            "model": client_model,
            "content": content,
            "stop_reason": stop_reason(choice.and_then(|c| c.finish_reason.as_deref())),
            "stop_sequence": Value::Null,
            "usage": anthropic_usage(response.usage.as_ref()),
        })
        .to_string(),
    ))
}

/// The message of an upstream error body (`error.message`, `error` as a string, or a top-level
/// `message`), whatever API it speaks.
pub(crate) fn upstream_error_message(status: u16, body: &[u8]) -> String {
    answer::parse::<ErrorBody<'_>>(body)
        .and_then(|error| error.message())
        .unwrap_or_else(|| format!("upstream answered with status {status}"))
}

/// What a client of a translated stream is told when the upstream's stream ended before its
/// answer did (no finish reason, no end event).
pub(crate) fn cut_short() -> ApiError {
    ApiError::new(
        ErrorKind::BadGateway,
        "upstream_error",
        "the upstream's stream ended before its answer did",
    )
}

/// An upstream's 401 or 403: a refusal of the gateway's own credentials (a provider's key, a
/// worker's `--api-key`; the client's own were checked by the gateway and are never
/// forwarded).
pub(crate) fn refused_credentials(status: u16) -> bool {
    matches!(status, 401 | 403)
}

/// What an upstream's error status is for the client. A refusal of the gateway's credentials
/// ([`refused_credentials`]) is the gateway's fault, a 502, not the client's key.
pub(crate) fn upstream_error_kind(status: u16) -> ErrorKind {
    match status {
        400 | 422 => ErrorKind::InvalidRequest,
        401 | 403 => ErrorKind::BadGateway,
        404 => ErrorKind::NotFound,
        413 => ErrorKind::PayloadTooLarge,
        503 | 529 => ErrorKind::Unavailable,
        504 => ErrorKind::GatewayTimeout,
        400..=499 => ErrorKind::Status(status),
        _ => ErrorKind::BadGateway,
    }
}

/// An upstream error body (any API's shape, or none) as an error of the client's `format`. A
/// refusal of the gateway's credentials says so, not what the upstream said (it may quote a
/// piece of the gateway's key).
pub(crate) fn upstream_error(status: u16, body: &[u8], format: ClientFormat) -> Bytes {
    let message = if refused_credentials(status) {
        format!(
            "the upstream refused the gateway's credentials (status {status}): the gateway's configuration, not the client's key, needs fixing"
        )
    } else {
        upstream_error_message(status, body)
    };
    ApiError::new(upstream_error_kind(status), "upstream_error", message).body(format)
}

/// Translate an upstream error body (OpenAI shape or anything else) into an Anthropic error.
pub fn error_to_anthropic(status: u16, body: &[u8]) -> Bytes {
    upstream_error(status, body, ClientFormat::Anthropic)
}

/// Turns an OpenAI Chat Completions SSE stream into Anthropic Messages SSE events, incrementally.
#[derive(Debug)]
pub struct StreamTranslator {
    client_model: String,
    pending: BytesMut,
    started: bool,
    finished: bool,
    /// Index and kind of the content block now open.
    open_block: Option<(usize, OpenBlock)>,
    next_block: usize,
    stop_reason: Value,
    usage: Option<UsageFields>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpenBlock {
    Text,
    Tool { openai_index: u64 },
}

impl StreamTranslator {
    pub fn new(client_model: &str) -> StreamTranslator {
        StreamTranslator {
            client_model: client_model.to_owned(),
            pending: BytesMut::new(),
            started: false,
            finished: false,
            open_block: None,
            next_block: 0,
            stop_reason: Value::Null,
            usage: None,
        }
    }

    /// Feed bytes from upstream; returns the Anthropic events they complete.
    pub fn feed(&mut self, chunk: &[u8]) -> Bytes {
        self.pending.extend_from_slice(chunk);
        let mut out = String::new();
        while let Some(data) = next_event_data(&mut self.pending) {
            if let Some(data) = data {
                self.on_data(&data, &mut out);
            }
        }
        Bytes::from(out)
    }

    /// Call at the end of the upstream body: closes the message if the upstream finished its
    /// answer (a finish reason) without closing the stream, or ends it with an error event if
    /// the upstream's stream ended short of its answer.
    pub fn finish(&mut self) -> Bytes {
        let mut out = String::new();
        if !self.pending.is_empty() {
            let rest = String::from_utf8_lossy(&self.pending).into_owned();
            self.pending.clear();
            for line in rest.lines() {
                if let Some(data) = line.strip_prefix("data:") {
                    self.on_data(data.trim_start(), &mut out);
                }
            }
        }
        if !self.finished && self.stop_reason.is_null() {
            self.finished = true;
            out.push_str(&String::from_utf8_lossy(
                &cut_short().stream_event(Endpoint::Messages, 0),
            ));
        }
        self.close(&mut out);
        Bytes::from(out)
    }

    fn on_data(&mut self, data: &str, out: &mut String) {
        if self.finished {
            return;
        }
        if data == "[DONE]" {
            self.close(out);
            return;
        }
        let Some(chunk) = answer::parse::<StreamData<'_>>(data.as_bytes()) else {
            return;
        };
        if let Some(message) = chunk.error_message() {
            emit(
                out,
                "error",
                &json!({"type": "error", "error": {"type": "api_error", "message": message}}),
            );
            self.finished = true;
            return;
        }
        self.start(chunk.id.as_deref(), out);
        if let Some(usage) = &chunk.usage {
            self.usage = Some(usage.clone());
        }
        let Some(choice) = chunk.choices.as_deref().and_then(<[_]>::first) else {
            return;
        };
        let delta = choice.delta.as_ref();
        if let Some(text) = delta.and_then(|d| d.content.as_deref())
            && !text.is_empty()
        {
            if !matches!(self.open_block, Some((_, OpenBlock::Text))) {
                let index = self.open(OpenBlock::Text, out);
                emit(
                    out,
                    "content_block_start",
                    &json!({"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}),
                );
            }
            let index = self.open_block.map_or(0, |(i, _)| i);
            emit(
                out,
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}}),
            );
        }
        for call in delta
            .and_then(|d| d.tool_calls.as_deref())
            .unwrap_or_default()
        {
            let openai_index = call.index.unwrap_or(0);
            let function = call.function.as_ref();
            if !matches!(self.open_block, Some((_, OpenBlock::Tool { openai_index: open })) if open == openai_index)
            {
                let index = self.open(OpenBlock::Tool { openai_index }, out);
                emit(
                    out,
                    "content_block_start",
                    &json!({
                        "type": "content_block_start",
                        "index": index,
                        "content_block": {"type": "tool_use", "id": tree_or_null(call.id), "name": tree_or_null(function.and_then(|f| f.name)), "input": {}},
                    }),
                );
            }
            let arguments = function.and_then(|f| f.arguments_text());
            if let Some(arguments) = arguments.filter(|a| !a.is_empty()) {
                let index = self.open_block.map_or(0, |(i, _)| i);
                emit(
                    out,
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": arguments}}),
                );
            }
        }
        if let Some(reason) = choice.finish_reason.as_deref() {
            self.stop_reason = stop_reason(Some(reason));
        }
    }

    fn start(&mut self, id: Option<&str>, out: &mut String) {
        if self.started {
            return;
        }
        self.started = true;
        let id = id.unwrap_or("unknown");
        emit(
            out,
            "message_start",
            &json!({
                "type": "message_start",
                "message": {
                    "id": format!("msg_{id}"), "type": "message", "role": "assistant",
                    "model": self.client_model, "content": [], "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": 0, "output_tokens": 0},
                }
            }),
        );
    }

    fn open(&mut self, kind: OpenBlock, out: &mut String) -> usize {
        self.close_block(out);
        let index = self.next_block;
        self.next_block += 1;
        self.open_block = Some((index, kind));
        index
    }

    fn close_block(&mut self, out: &mut String) {
        if let Some((index, _)) = self.open_block.take() {
            emit(
                out,
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": index}),
            );
        }
    }

    fn close(&mut self, out: &mut String) {
        if self.finished {
            return;
        }
        self.finished = true;
        if !self.started {
            self.start(None, out);
        }
        self.close_block(out);
        let usage = anthropic_usage(self.usage.as_ref());
        emit(
            out,
            "message_delta",
            &json!({
                "type": "message_delta",
                "delta": {"stop_reason": if self.stop_reason.is_null() { json!("end_turn") } else { self.stop_reason.clone() }, "stop_sequence": null},
                "usage": usage,
            }),
        );
        emit(out, "message_stop", &json!({"type": "message_stop"}));
    }
}

fn emit(out: &mut String, event: &str, data: &Value) {
    out.push_str("event: ");
    out.push_str(event);
    out.push_str("\ndata: ");
    out.push_str(&data.to_string());
    out.push_str("\n\n");
}

/// Take the first complete SSE event off `pending`: its `data:` lines joined (`None` inside
/// when it has none); `None` when no event is complete yet.
pub(crate) fn next_event_data(pending: &mut BytesMut) -> Option<Option<String>> {
    let (end, separator) = find_event_end(pending)?;
    let event = pending.split_to(end + separator);
    Some(event_data(event.get(..end).unwrap_or_default()))
}

/// An SSE event's `data:` lines joined (`None` when it has none); `event` without its
/// separator.
pub(crate) fn event_data(event: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(event);
    let data: Vec<&str> = text
        .lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .map(str::trim_start)
        .collect();
    (!data.is_empty()).then(|| data.join("\n"))
}

/// End of the first complete SSE event in `buffer` and the length of its separator.
pub(crate) fn find_event_end(buffer: &[u8]) -> Option<(usize, usize)> {
    let lf = buffer.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = buffer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_cut_short_ends_with_an_error_event_not_a_stop() {
        let chunk = r#"data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}]}"#;
        let mut cut = StreamTranslator::new("alias");
        let mut out =
            String::from_utf8(cut.feed(format!("{chunk}\n\n").as_bytes()).to_vec()).unwrap();
        out.push_str(std::str::from_utf8(&cut.finish()).unwrap());
        assert!(out.contains("event: error\ndata: "), "{out}");
        assert!(out.contains("ended before its answer did"), "{out}");
        assert!(!out.contains("message_stop"), "{out}");
        // A finish reason without `[DONE]`: the answer is whole, the message closes.
        let last = r#"data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#;
        let mut whole = StreamTranslator::new("alias");
        let mut out = String::from_utf8(
            whole
                .feed(format!("{chunk}\n\n{last}\n\n").as_bytes())
                .to_vec(),
        )
        .unwrap();
        out.push_str(std::str::from_utf8(&whole.finish()).unwrap());
        assert!(
            out.ends_with("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"),
            "{out}"
        );
        assert!(!out.contains("event: error"), "{out}");
    }

    #[test]
    fn response_translation_maps_content_and_usage() {
        let body = json!({
            "id": "c1", "choices": [{"message": {"role": "assistant", "content": "hi"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}
        });
        let out: Value = serde_json::from_slice(
            &chat_response_to_message(body.to_string().as_bytes(), "alias").unwrap(),
        )
        .unwrap();
        assert_eq!(out["type"], "message");
        assert_eq!(out["model"], "alias");
        assert_eq!(out["content"][0], json!({"type": "text", "text": "hi"}));
        assert_eq!(out["stop_reason"], "max_tokens");
        assert_eq!(out["usage"]["input_tokens"], 6);
        assert_eq!(out["usage"]["cache_read_input_tokens"], 4);
        assert_eq!(out["usage"]["output_tokens"], 3);
    }

    fn events(text: &str) -> Vec<(String, Value)> {
        text.split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                let mut lines = e.lines();
                let name = lines
                    .next()
                    .unwrap()
                    .strip_prefix("event: ")
                    .unwrap()
                    .to_owned();
                let data = lines.next().unwrap().strip_prefix("data: ").unwrap();
                (name, serde_json::from_str(data).unwrap())
            })
            .collect()
    }

    #[test]
    fn stream_translation_survives_arbitrary_chunk_boundaries() {
        let upstream = concat!(
            "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
            "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n",
            "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"},\"finish_reason\":\"stop\"}]}\n\n",
            "data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n\n",
            "data: [DONE]\n\n"
        );
        for split in [1, 7, 50, upstream.len()] {
            let mut translator = StreamTranslator::new("alias");
            let mut out = Vec::new();
            for piece in upstream.as_bytes().chunks(split) {
                out.extend_from_slice(&translator.feed(piece));
            }
            out.extend_from_slice(&translator.finish());
            let events = events(std::str::from_utf8(&out).unwrap());
            let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(
                names,
                [
                    "message_start",
                    "content_block_start",
                    "content_block_delta",
                    "content_block_delta",
                    "content_block_stop",
                    "message_delta",
                    "message_stop"
                ],
                "split {split}"
            );
            assert_eq!(events[0].1["message"]["model"], "alias");
            let text: String = events
                .iter()
                .filter_map(|(_, d)| d["delta"]["text"].as_str())
                .collect();
            assert_eq!(text, "Hello");
            assert_eq!(events[5].1["delta"]["stop_reason"], "end_turn");
            assert_eq!(events[5].1["usage"]["output_tokens"], 2);
        }
    }

    #[test]
    fn stream_translation_emits_tool_use_blocks() {
        let upstream = concat!(
            "data: {\"id\":\"c2\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"weather\",\"arguments\":\"\"}}]}}]}\n\n",
            "data: {\"id\":\"c2\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\\\"city\\\":\"}}]}}]}\n\n",
            "data: {\"id\":\"c2\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"\\\"Oslo\\\"}\"}}]},\"finish_reason\":\"tool_calls\"}]}\n\n",
            "data: [DONE]\n\n"
        );
        let mut translator = StreamTranslator::new("alias");
        let mut out = translator.feed(upstream.as_bytes()).to_vec();
        out.extend_from_slice(&translator.finish());
        let events = events(std::str::from_utf8(&out).unwrap());
        assert_eq!(events[1].1["content_block"]["type"], "tool_use");
        assert_eq!(events[1].1["content_block"]["name"], "weather");
        let json: String = events
            .iter()
            .filter_map(|(_, d)| d["delta"]["partial_json"].as_str())
            .collect();
        assert_eq!(json, "{\"city\":\"Oslo\"}");
        let delta = events.iter().find(|(n, _)| n == "message_delta").unwrap();
        assert_eq!(delta.1["delta"]["stop_reason"], "tool_use");
    }
}
