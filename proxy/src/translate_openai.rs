//! OpenAI Chat Completions → Anthropic Messages: requests to Anthropic-format providers, and
//! their answers (whole or streamed) back into Chat Completions for OpenAI clients. The other
//! direction lives in `translate`.

use bytes::{Bytes, BytesMut};
use serde_json::{Map, Value, json};

use crate::api::{ClientFormat, Endpoint};
use crate::translate::find_event_end;
use crate::wire::answer::{self, MessageResponse, StreamData, UsageFields};
use crate::wire::{tree, tree_or_null};

fn finish_reason(stop_reason: Option<&str>) -> Value {
    match stop_reason {
        Some("end_turn" | "stop_sequence" | "pause_turn") => json!("stop"),
        Some("max_tokens") => json!("length"),
        Some("tool_use") => json!("tool_calls"),
        Some("refusal") => json!("content_filter"),
        Some(_) => json!("stop"),
        None => Value::Null,
    }
}

/// Anthropic usage in OpenAI's shape (cached input counted in the prompt, as OpenAI does).
fn openai_usage(usage: &UsageFields) -> Value {
    let cached = usage.cache_read_input_tokens.unwrap_or(0);
    let prompt =
        usage.input_tokens.unwrap_or(0) + cached + usage.cache_creation_input_tokens.unwrap_or(0);
    let completion = usage.output_tokens.unwrap_or(0);
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// Translate a whole Messages response into a Chat Completions response.
pub fn message_response_to_chat(body: &[u8], client_model: &str) -> Result<Bytes, String> {
    let Some(response) = answer::parse::<MessageResponse<'_>>(body) else {
        return Err("the upstream's whole answer is not a Messages answer".to_owned());
    };
    let mut text = String::new();
    let mut tool_calls = Vec::new();
    for block in response.content.iter().flatten() {
        match block.kind.as_deref() {
            Some("text") => text.push_str(block.text.as_deref().unwrap_or_default()),
            Some("tool_use") => tool_calls.push(json!({
                "id": tree_or_null(block.id),
                "type": "function",
                "function": {
                    "name": tree_or_null(block.name),
                    "arguments": block.input.map_or_else(|| "{}".to_owned(), |input| tree(input).to_string()),
                }
            })),
            _ => {}
        }
    }
    let mut message = Map::new();
    message.insert("role".into(), json!("assistant"));
    message.insert(
        "content".into(),
        if text.is_empty() && !tool_calls.is_empty() {
            Value::Null
        } else {
            json!(text)
        },
    );
    if !tool_calls.is_empty() {
        message.insert("tool_calls".into(), Value::Array(tool_calls));
    }
    let id = response.id.as_deref().unwrap_or("unknown");
    Ok(Bytes::from(
        json!({
            "id": format!("chatcmpl-{id}"),
            "object": "chat.completion",
            "created": unix_now(),
            "model": client_model,
            "choices": [{
                "index": 0,
                "message": message,
                "finish_reason": finish_reason(response.stop_reason.as_deref()),
            }],
            "usage": openai_usage(&response.usage.unwrap_or_default()),
        })
        .to_string(),
    ))
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Translate an upstream error body (Anthropic shape or anything else) into an OpenAI error.
pub fn error_to_openai(status: u16, body: &[u8]) -> Bytes {
    crate::translate::upstream_error(status, body, ClientFormat::OpenAi)
}

/// Turns an Anthropic Messages SSE stream into Chat Completions chunks, incrementally.
#[derive(Debug)]
pub struct MessagesStreamTranslator {
    client_model: String,
    pending: BytesMut,
    id: String,
    created: u64,
    /// Anthropic block index → OpenAI tool-call index, for tool_use blocks.
    tool_blocks: Vec<(u64, u64)>,
    /// Usage fields as they arrive (input in message_start, output in message_delta).
    usage: UsageFields,
    finished: bool,
}

impl MessagesStreamTranslator {
    pub fn new(client_model: &str) -> MessagesStreamTranslator {
        MessagesStreamTranslator {
            client_model: client_model.to_owned(),
            pending: BytesMut::new(),
            id: "chatcmpl-unknown".to_owned(),
            created: unix_now(),
            tool_blocks: Vec::new(),
            usage: UsageFields::default(),
            finished: false,
        }
    }

    /// Feed bytes from upstream; returns the Chat Completions chunks they complete.
    pub fn feed(&mut self, chunk: &[u8]) -> Bytes {
        self.pending.extend_from_slice(chunk);
        let mut out = String::new();
        while let Some((end, separator)) = find_event_end(&self.pending) {
            let event = self.pending.split_to(end + separator);
            let text = String::from_utf8_lossy(&event).into_owned();
            for line in text.lines() {
                if let Some(data) = line.strip_prefix("data:") {
                    self.on_event(data.trim(), &mut out);
                }
            }
        }
        Bytes::from(out)
    }

    /// The end of the upstream body: a stream the upstream ended short of its `message_stop`
    /// ends with an error chunk and `[DONE]`.
    pub fn finish(&mut self) -> Bytes {
        let mut out = self.feed(b"\n\n").to_vec();
        if !self.finished {
            out.extend_from_slice(
                &crate::translate::cut_short().stream_event(Endpoint::ChatCompletions, 0),
            );
            self.finished = true;
        }
        Bytes::from(out)
    }

    fn chunk(&self, delta: Value, finish: Value, out: &mut String) {
        let chunk = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.client_model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        });
        out.push_str("data: ");
        out.push_str(&chunk.to_string());
        out.push_str("\n\n");
    }

    fn on_event(&mut self, data: &str, out: &mut String) {
        if self.finished {
            return;
        }
        let Some(event) = answer::parse::<StreamData<'_>>(data.as_bytes()) else {
            return;
        };
        match event.kind.as_deref() {
            Some("message_start") => {
                let message = event.message.as_ref();
                if let Some(id) = message.and_then(|m| m.id.as_deref()) {
                    self.id = format!("chatcmpl-{id}");
                }
                if let Some(usage) = message.and_then(|m| m.usage.as_ref()) {
                    self.usage.update(usage);
                }
                self.chunk(
                    json!({"role": "assistant", "content": ""}),
                    Value::Null,
                    out,
                );
            }
            Some("content_block_start") => {
                let block = event.content_block.as_ref();
                if block.and_then(|b| b.kind.as_deref()) == Some("tool_use") {
                    let anthropic_index = event.index.unwrap_or(0);
                    let openai_index = self.tool_blocks.len() as u64;
                    self.tool_blocks.push((anthropic_index, openai_index));
                    self.chunk(
                        json!({"tool_calls": [{"index": openai_index, "id": tree_or_null(block.and_then(|b| b.id)), "type": "function", "function": {"name": tree_or_null(block.and_then(|b| b.name)), "arguments": ""}}]}),
                        Value::Null,
                        out,
                    );
                }
            }
            Some("content_block_delta") => {
                let delta = event.delta.as_ref();
                match delta.and_then(|d| d.kind.as_deref()) {
                    Some("text_delta") => {
                        let text = delta.and_then(|d| d.text).map_or_else(|| json!(""), tree);
                        self.chunk(json!({"content": text}), Value::Null, out);
                    }
                    Some("input_json_delta") => {
                        let anthropic_index = event.index.unwrap_or(0);
                        let openai_index = self
                            .tool_blocks
                            .iter()
                            .find(|(a, _)| *a == anthropic_index)
                            .map_or(0, |(_, o)| *o);
                        let partial = delta
                            .and_then(|d| d.partial_json)
                            .map_or_else(|| json!(""), tree);
                        self.chunk(
                            json!({"tool_calls": [{"index": openai_index, "function": {"arguments": partial}}]}),
                            Value::Null,
                            out,
                        );
                    }
                    _ => {}
                }
            }
            Some("message_delta") => {
                if let Some(usage) = &event.usage {
                    self.usage.update(usage);
                }
                let stop = event.delta.as_ref().and_then(|d| d.stop_reason.as_deref());
                self.chunk(json!({}), finish_reason(stop.or(Some("end_turn"))), out);
            }
            Some("message_stop") => {
                // The usage chunk (OpenAI's include_usage form); the proxy removes it for
                // clients that did not ask for it.
                let usage = json!({
                    "id": self.id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.client_model,
                    "choices": [],
                    "usage": openai_usage(&self.usage),
                });
                out.push_str("data: ");
                out.push_str(&usage.to_string());
                out.push_str("\n\ndata: [DONE]\n\n");
                self.finished = true;
            }
            Some("error") => {
                let message = event
                    .error_message()
                    .unwrap_or_else(|| "upstream error".to_owned());
                out.push_str("data: ");
                out.push_str(&json!({"error": {"message": message, "type": "server_error", "param": null, "code": "upstream_error"}}).to_string());
                out.push_str("\n\ndata: [DONE]\n\n");
                self.finished = true;
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_messages_stream_cut_short_ends_with_an_error_chunk() {
        let start =
            r#"{"type":"message_start","message":{"id":"msg_1","usage":{"input_tokens":3}}}"#;
        let delta =
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hi"}}"#;
        let mut cut = MessagesStreamTranslator::new("alias");
        let events = format!(
            "event: message_start\ndata: {start}\n\nevent: content_block_delta\ndata: {delta}\n\n"
        );
        let mut out = String::from_utf8(cut.feed(events.as_bytes()).to_vec()).unwrap();
        out.push_str(std::str::from_utf8(&cut.finish()).unwrap());
        let error = out
            .split("\n\n")
            .find(|event| event.contains("\"error\""))
            .unwrap_or_else(|| panic!("{out}"));
        let error: Value = serde_json::from_str(error.trim_start_matches("data: ")).unwrap();
        assert_eq!(error["error"]["code"], "upstream_error");
        assert!(out.ends_with("data: [DONE]\n\n"), "{out}");
        assert!(!out.contains("finish_reason\":\"stop"), "{out}");
    }

    #[test]
    fn whole_answers_and_errors_become_openai() {
        let body = json!({"id": "msg_1", "type": "message", "content": [{"type": "text", "text": "hi"}, {"type": "tool_use", "id": "t", "name": "f", "input": {"a": 1}}], "stop_reason": "tool_use", "usage": {"input_tokens": 3, "cache_read_input_tokens": 10, "output_tokens": 5}});
        let out: Value = serde_json::from_slice(
            &message_response_to_chat(body.to_string().as_bytes(), "alias").unwrap(),
        )
        .unwrap();
        assert_eq!(out["model"], "alias");
        assert_eq!(out["choices"][0]["message"]["content"], "hi");
        assert_eq!(
            out["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
            "{\"a\":1}"
        );
        assert_eq!(out["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(
            out["usage"],
            json!({"prompt_tokens": 13, "completion_tokens": 5, "total_tokens": 18, "prompt_tokens_details": {"cached_tokens": 10}})
        );
        let error: Value = serde_json::from_slice(&error_to_openai(
            529,
            br#"{"type":"error","error":{"type":"overloaded_error","message":"busy"}}"#,
        ))
        .unwrap();
        assert_eq!(error["error"]["message"], "busy");
        assert_eq!(error["error"]["type"], "server_error");
    }

    #[test]
    fn streams_become_chunks_split_anywhere() {
        let events = [
            (
                "message_start",
                json!({"type": "message_start", "message": {"id": "msg_9", "usage": {"input_tokens": 4, "output_tokens": 1}}}),
            ),
            (
                "content_block_start",
                json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            ),
            (
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}}),
            ),
            (
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "lo"}}),
            ),
            (
                "content_block_start",
                json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "t1", "name": "f"}}),
            ),
            (
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"a\":"}}),
            ),
            (
                "message_delta",
                json!({"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 7}}),
            ),
            ("message_stop", json!({"type": "message_stop"})),
        ];
        let text: String = events
            .iter()
            .map(|(name, data)| format!("event: {name}\ndata: {data}\n\n"))
            .collect();
        let mut translator = MessagesStreamTranslator::new("alias");
        let mut out = Vec::new();
        for piece in text.as_bytes().chunks(7) {
            out.extend_from_slice(&translator.feed(piece));
        }
        out.extend_from_slice(&translator.finish());
        let out = String::from_utf8(out).unwrap();
        let chunks: Vec<Value> = out
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        assert!(out.ends_with("data: [DONE]\n\n"));
        assert_eq!(out.matches("[DONE]").count(), 1);
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(chunks[0]["id"], "chatcmpl-msg_9");
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(text, "Hello");
        assert_eq!(
            chunks[3]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"],
            "f"
        );
        assert_eq!(
            chunks[4]["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"],
            "{\"a\":"
        );
        assert_eq!(chunks[5]["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(chunks[6]["choices"], json!([]));
        assert_eq!(chunks[6]["usage"]["prompt_tokens"], 4);
        assert_eq!(chunks[6]["usage"]["completion_tokens"], 7);
    }
}
