//! OpenAI Responses API ⇄ Chat Completions, for pools and providers that only speak Chat
//! Completions (`responsesApi: translate`).
//!
//! Only stateless requests translate: a `previous_response_id`, background mode, an OpenAI
//! `conversation` or a built-in tool (web search, file search, ...) needs an upstream that keeps
//! responses or runs tools, and is answered 501. The request is read from the typed model
//! ([`crate::wire`]); the answer is translated whole, or event by event for streams (the typed
//! events `response.created` … `response.completed` that the SDKs parse).

use bytes::{Bytes, BytesMut};
use serde_json::{Map, Value, json};

use crate::api::{ApiError, ErrorKind};
use crate::translate::next_event_data;
use crate::wire::answer::{self, ChatCompletion, StreamData, UsageFields};
use crate::wire::responses::{InputItem, ResponsesInput, ResponsesTool};
use crate::wire::{Content, Either, RequestBody, tree, tree_or_null};

fn untranslatable(what: &str) -> ApiError {
    ApiError::new(
        ErrorKind::NotImplemented,
        "translation_unsupported",
        format!(
            "this model's upstream speaks only Chat Completions, so /v1/responses is translated, \
             and {what} cannot be: send the whole conversation in 'input' instead"
        ),
    )
}

/// Translate a Responses request into a Chat Completions body.
pub fn responses_to_chat(
    request: &RequestBody<'_>,
    upstream_model: &str,
) -> Result<Bytes, ApiError> {
    let fields = request.responses_fields()?;
    if fields.previous_response_id.is_some() {
        return Err(untranslatable(
            "'previous_response_id' (a response stored upstream)",
        ));
    }
    if fields.background {
        return Err(untranslatable("background mode"));
    }
    if request.conversation.is_some_and(|raw| raw.get() != "null") {
        return Err(untranslatable("'conversation' (state kept upstream)"));
    }
    let mut out = Map::new();
    out.insert("model".into(), Value::String(upstream_model.to_owned()));
    let mut messages: Vec<Value> = Vec::new();
    if let Some(instructions) = request.instructions_text().filter(|t| !t.is_empty()) {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    match request.responses_input() {
        Some(Ok(ResponsesInput::Text(text))) => {
            messages.push(json!({"role": "user", "content": text}));
        }
        Some(Ok(ResponsesInput::Items(items))) => {
            for (index, item) in items.iter().enumerate() {
                chat_message_of(item, index, &mut messages)?;
            }
        }
        Some(Err(message)) => return Err(ApiError::invalid("input", message)),
        None => return Err(ApiError::invalid("input", "missing required field 'input'")),
    }
    out.insert("messages".into(), Value::Array(messages));
    if let Some(max) = fields.max_output_tokens {
        out.insert("max_completion_tokens".into(), json!(max));
    }
    for (name, raw) in [
        ("temperature", request.temperature),
        ("top_p", request.top_p),
        ("user", request.user),
        ("parallel_tool_calls", request.parallel_tool_calls),
    ] {
        if let Some(raw) = raw.filter(|raw| raw.get() != "null") {
            out.insert(name.into(), tree(raw));
        }
    }
    if request.stream() == Some(true) {
        out.insert("stream".into(), Value::Bool(true));
        // The final event carries usage: ask for it.
        out.insert("stream_options".into(), json!({"include_usage": true}));
    }
    if let Some(raw) = request.tools.filter(|raw| raw.get() != "null") {
        let tools: Vec<ResponsesTool<'_>> = serde_json::from_str(raw.get())
            .map_err(|_| ApiError::invalid("tools", "'tools' must be a list of tools"))?;
        let mut chat_tools = Vec::with_capacity(tools.len());
        for tool in &tools {
            match tool.kind.as_deref() {
                Some("function") => {
                    let mut function = Map::new();
                    function.insert("name".into(), tree_or_null(tool.name));
                    if let Some(description) = tool.description {
                        function.insert("description".into(), tree(description));
                    }
                    function.insert(
                        "parameters".into(),
                        tool.parameters
                            .map_or_else(|| json!({"type": "object"}), tree),
                    );
                    if let Some(strict) = tool.strict {
                        function.insert("strict".into(), tree(strict));
                    }
                    chat_tools.push(json!({"type": "function", "function": function}));
                }
                other => {
                    return Err(untranslatable(&format!(
                        "the built-in tool '{}'",
                        other.unwrap_or("?")
                    )));
                }
            }
        }
        if !chat_tools.is_empty() {
            out.insert("tools".into(), Value::Array(chat_tools));
        }
    }
    if let Some(choice) = request.tool_choice() {
        let choice = match choice.map_err(|e| ApiError::invalid("tool_choice", e))? {
            Either::Left(mode) => json!(mode),
            Either::Right(choice) if choice.kind.as_deref() == Some("function") => {
                json!({"type": "function", "function": {"name": tree_or_null(choice.name)}})
            }
            Either::Right(_) => {
                return Err(untranslatable("a 'tool_choice' naming a built-in tool"));
            }
        };
        out.insert("tool_choice".into(), choice);
    }
    if let Some(format) = request
        .text
        .and_then(|raw| serde_json::from_str::<Value>(raw.get()).ok())
        .and_then(|text| text.get("format").cloned())
    {
        match format.get("type").and_then(Value::as_str) {
            Some("json_schema") => {
                let mut schema = Map::new();
                for field in ["name", "schema", "strict", "description"] {
                    if let Some(value) = format.get(field) {
                        schema.insert(field.into(), value.clone());
                    }
                }
                out.insert(
                    "response_format".into(),
                    json!({"type": "json_schema", "json_schema": schema}),
                );
            }
            Some("json_object") => {
                out.insert("response_format".into(), json!({"type": "json_object"}));
            }
            _ => {}
        }
    }
    Ok(Bytes::from(Value::Object(out).to_string()))
}

/// One input item as Chat Completions messages (appended to `messages`; a function call joins
/// the assistant message before it, as vLLM builds its own conversation).
fn chat_message_of(
    item: &InputItem<'_>,
    index: usize,
    messages: &mut Vec<Value>,
) -> Result<(), ApiError> {
    if item.is_reasoning() {
        // Chat Completions takes no reasoning input; the answer it led to follows.
        return Ok(());
    }
    if item.is_function_call() {
        let call = json!({
            "id": item.call_id.as_deref().unwrap_or_default(),
            "type": "function",
            "function": {"name": item.name.as_deref().unwrap_or_default(), "arguments": item.arguments.as_deref().unwrap_or("{}")},
        });
        if let Some(last) = messages.last_mut().and_then(Value::as_object_mut)
            && last.get("role").and_then(Value::as_str) == Some("assistant")
        {
            match last.get_mut("tool_calls").and_then(Value::as_array_mut) {
                Some(calls) => calls.push(call),
                None => {
                    last.insert("tool_calls".into(), json!([call]));
                }
            }
            return Ok(());
        }
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]}));
        return Ok(());
    }
    if item.is_function_output() {
        let output = item.output.as_ref().map_or_else(String::new, parts_text);
        messages.push(json!({
            "role": "tool",
            "tool_call_id": item.call_id.as_deref().unwrap_or_default(),
            "content": output,
        }));
        return Ok(());
    }
    let Some(role) = item.role.as_deref() else {
        return Err(untranslatable(&format!(
            "input[{index}] (an item of type '{}')",
            item.kind.as_deref().unwrap_or("?")
        )));
    };
    let role = if role == "developer" { "system" } else { role };
    let content = match &item.content {
        None => Value::Null,
        Some(Content::Text(text)) => json!(text),
        Some(Content::Parts(parts)) => {
            let mut out = Vec::with_capacity(parts.len());
            for part in parts {
                let fields = &part.fields;
                match fields.kind.as_deref() {
                    Some("input_text" | "output_text" | "text") => {
                        out.push(json!({"type": "text", "text": fields.text.as_deref().unwrap_or_default()}));
                    }
                    Some("input_image") => match fields.image_url() {
                        Some(url) => {
                            out.push(json!({"type": "image_url", "image_url": {"url": url}}))
                        }
                        None => {
                            return Err(untranslatable(&format!(
                                "input[{index}]: an image given by file id"
                            )));
                        }
                    },
                    other => {
                        return Err(untranslatable(&format!(
                            "input[{index}]: a content part of type '{}'",
                            other.unwrap_or("?")
                        )));
                    }
                }
            }
            if role == "assistant" {
                // Assistant content is text in Chat Completions.
                json!(
                    out.iter()
                        .filter_map(|p| p.get("text").and_then(Value::as_str))
                        .collect::<String>()
                )
            } else {
                Value::Array(out)
            }
        }
        Some(Content::Other) => {
            return Err(ApiError::invalid(
                "input",
                format!("input[{index}].content must be a string or a list of parts"),
            ));
        }
    };
    messages.push(json!({"role": role, "content": content}));
    Ok(())
}

/// The text of content (parts' texts joined), for tool outputs.
fn parts_text(content: &Content<'_>) -> String {
    match content {
        Content::Text(text) => text.clone().into_owned(),
        Content::Parts(parts) => parts
            .iter()
            .filter_map(|p| p.fields.text.as_deref())
            .collect::<Vec<_>>()
            .join("\n"),
        Content::Other => String::new(),
    }
}

/// Responses usage from Chat Completions usage.
fn responses_usage(usage: Option<&UsageFields>) -> Value {
    let Some(usage) = usage else {
        return Value::Null;
    };
    let input = usage.prompt_tokens.unwrap_or(0);
    let output = usage.completion_tokens.unwrap_or(0);
    json!({
        "input_tokens": input,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens().unwrap_or(0)},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input + output,
    })
}

/// `completed`, or `incomplete` when the token limit stopped it (and why).
fn status_of(finish_reason: Option<&str>) -> (&'static str, Value) {
    match finish_reason {
        Some("length") => ("incomplete", json!({"reason": "max_output_tokens"})),
        Some("content_filter") => ("incomplete", json!({"reason": "content_filter"})),
        _ => ("completed", Value::Null),
    }
}

/// A response object around `output`.
fn response_object(
    id: &str,
    created: u64,
    client_model: &str,
    status: &str,
    incomplete: Value,
    output: Vec<Value>,
    usage: Value,
) -> Value {
    json!({
        "id": id, "object": "response", "created_at": created, "status": status,
        "error": null, "incomplete_details": incomplete, "instructions": null, "metadata": null,
        "model": client_model, "output": output, "parallel_tool_calls": true,
        "temperature": null, "top_p": null, "tool_choice": "auto", "tools": [],
        "previous_response_id": null, "store": false, "background": false, "text": {"format": {"type": "text"}},
        "usage": usage,
    })
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": []}]})
}

fn call_item(id: &str, call_id: &Value, name: &Value, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name,
           "arguments": arguments, "status": status})
}

/// Translate a whole Chat Completions answer into a Responses answer.
pub fn chat_response_to_responses(body: &[u8], client_model: &str) -> Result<Bytes, String> {
    let Some(response) = answer::parse::<ChatCompletion<'_>>(body) else {
        return Err("the upstream's whole answer is not a Chat Completions answer".to_owned());
    };
    let id = response.id.as_deref().unwrap_or("unknown");
    let choice = response.choices.as_deref().and_then(<[_]>::first);
    let message = choice.and_then(|c| c.message.as_ref());
    let mut output = Vec::new();
    if let Some(Content::Text(text)) = message.and_then(|m| m.content.as_ref())
        && !text.is_empty()
    {
        output.push(message_item(&format!("msg_{id}"), text, "completed"));
    }
    for (n, call) in message
        .and_then(|m| m.tool_calls.as_deref())
        .unwrap_or_default()
        .iter()
        .enumerate()
    {
        let function = call.function.as_ref();
        output.push(call_item(
            &format!("fc_{id}_{n}"),
            &tree_or_null(call.id),
            &tree_or_null(function.and_then(|f| f.name)),
            &function
                .and_then(|f| f.arguments_text())
                .unwrap_or_default(),
            "completed",
        ));
    }
    let (status, incomplete) = status_of(choice.and_then(|c| c.finish_reason.as_deref()));
    let object = response_object(
        &format!("resp_{id}"),
        now(),
        client_model,
        status,
        incomplete,
        output,
        responses_usage(response.usage.as_ref()),
    );
    Ok(Bytes::from(object.to_string()))
}

/// The item being streamed.
#[derive(Debug)]
enum OpenItem {
    Text {
        id: String,
        text: String,
    },
    Call {
        openai_index: u64,
        id: String,
        call_id: Value,
        name: Value,
        arguments: String,
    },
}

/// Turns a Chat Completions SSE stream into Responses events, incrementally.
#[derive(Debug)]
pub struct ResponsesStreamTranslator {
    client_model: String,
    pending: BytesMut,
    id: String,
    created: u64,
    sequence: u64,
    started: bool,
    finished: bool,
    open: Option<OpenItem>,
    /// Items closed so far, as the final response lists them.
    output: Vec<Value>,
    finish_reason: Option<String>,
    usage: Option<UsageFields>,
    /// The upstream said it was done (`[DONE]`).
    done: bool,
}

impl ResponsesStreamTranslator {
    pub fn new(client_model: &str) -> ResponsesStreamTranslator {
        ResponsesStreamTranslator {
            client_model: client_model.to_owned(),
            pending: BytesMut::new(),
            id: String::new(),
            created: now(),
            sequence: 0,
            started: false,
            finished: false,
            open: None,
            output: Vec::new(),
            finish_reason: None,
            usage: None,
            done: false,
        }
    }

    /// Bytes from upstream in; the Responses events they complete out.
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

    /// The end of the upstream body: the open item closed, the final response.
    pub fn finish(&mut self) -> Bytes {
        let mut out = String::new();
        let rest = String::from_utf8_lossy(&std::mem::take(&mut self.pending)).into_owned();
        for line in rest.lines() {
            if let Some(data) = line.strip_prefix("data:") {
                self.on_data(data.trim_start(), &mut out);
            }
        }
        self.close(&mut out);
        Bytes::from(out)
    }

    fn emit(&mut self, out: &mut String, kind: &str, mut data: Map<String, Value>) {
        data.insert("type".into(), json!(kind));
        data.insert("sequence_number".into(), json!(self.sequence));
        self.sequence += 1;
        out.push_str("event: ");
        out.push_str(kind);
        out.push_str("\ndata: ");
        out.push_str(&Value::Object(data).to_string());
        out.push_str("\n\n");
    }

    fn fields(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            _ => Map::new(),
        }
    }

    fn on_data(&mut self, data: &str, out: &mut String) {
        if self.finished {
            return;
        }
        if data == "[DONE]" {
            self.done = true;
            self.close(out);
            return;
        }
        let Some(chunk) = answer::parse::<StreamData<'_>>(data.as_bytes()) else {
            return;
        };
        if let Some(message) = chunk.error_message() {
            self.emit(
                out,
                "error",
                Self::fields(json!({"code": "upstream_error", "message": message, "param": null})),
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
            if !matches!(self.open, Some(OpenItem::Text { .. })) {
                self.close_item(out);
                let id = format!("msg_{}_{}", self.id, self.output.len());
                let index = self.output.len();
                self.emit(out, "response.output_item.added", Self::fields(json!({"output_index": index,
                    "item": {"type": "message", "id": id, "status": "in_progress", "role": "assistant", "content": []}})));
                self.emit(out, "response.content_part.added", Self::fields(json!({"output_index": index, "item_id": id,
                    "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})));
                self.open = Some(OpenItem::Text {
                    id,
                    text: String::new(),
                });
            }
            let index = self.output.len();
            let mut item_id = String::new();
            if let Some(OpenItem::Text { id, text: all }) = &mut self.open {
                all.push_str(text);
                item_id = id.clone();
            }
            self.emit(
                out,
                "response.output_text.delta",
                Self::fields(json!({"output_index": index, "item_id": item_id,
                "content_index": 0, "delta": text, "logprobs": []})),
            );
        }
        for call in delta
            .and_then(|d| d.tool_calls.as_deref())
            .unwrap_or_default()
        {
            let openai_index = call.index.unwrap_or(0);
            let function = call.function.as_ref();
            let same = matches!(&self.open, Some(OpenItem::Call { openai_index: open, .. }) if *open == openai_index);
            if !same {
                self.close_item(out);
                let index = self.output.len();
                let id = format!("fc_{}_{index}", self.id);
                let (call_id, name) = (
                    tree_or_null(call.id),
                    tree_or_null(function.and_then(|f| f.name)),
                );
                self.emit(
                    out,
                    "response.output_item.added",
                    Self::fields(json!({"output_index": index,
                    "item": call_item(&id, &call_id, &name, "", "in_progress")})),
                );
                self.open = Some(OpenItem::Call {
                    openai_index,
                    id,
                    call_id,
                    name,
                    arguments: String::new(),
                });
            }
            let piece = function
                .and_then(|f| f.arguments_text())
                .unwrap_or_default();
            if !piece.is_empty() {
                let index = self.output.len();
                let mut item_id = String::new();
                if let Some(OpenItem::Call { id, arguments, .. }) = &mut self.open {
                    arguments.push_str(&piece);
                    item_id = id.clone();
                }
                self.emit(
                    out,
                    "response.function_call_arguments.delta",
                    Self::fields(json!({"output_index": index,
                    "item_id": item_id, "delta": piece})),
                );
            }
        }
        if let Some(reason) = choice.finish_reason.as_deref() {
            self.finish_reason = Some(reason.to_owned());
        }
    }

    fn start(&mut self, id: Option<&str>, out: &mut String) {
        if self.started {
            return;
        }
        self.started = true;
        self.id = id.unwrap_or("unknown").to_owned();
        let response = response_object(
            &format!("resp_{}", self.id),
            self.created,
            &self.client_model,
            "in_progress",
            Value::Null,
            Vec::new(),
            Value::Null,
        );
        self.emit(
            out,
            "response.created",
            Self::fields(json!({"response": response})),
        );
        self.emit(
            out,
            "response.in_progress",
            Self::fields(json!({"response": response})),
        );
    }

    fn close_item(&mut self, out: &mut String) {
        let index = self.output.len();
        match self.open.take() {
            None => {}
            Some(OpenItem::Text { id, text }) => {
                self.emit(
                    out,
                    "response.output_text.done",
                    Self::fields(json!({"output_index": index, "item_id": id,
                    "content_index": 0, "text": text, "logprobs": []})),
                );
                self.emit(out, "response.content_part.done", Self::fields(json!({"output_index": index, "item_id": id,
                    "content_index": 0, "part": {"type": "output_text", "text": text, "annotations": []}})));
                let item = message_item(&id, &text, "completed");
                self.emit(
                    out,
                    "response.output_item.done",
                    Self::fields(json!({"output_index": index, "item": item.clone()})),
                );
                self.output.push(item);
            }
            Some(OpenItem::Call {
                id,
                call_id,
                name,
                arguments,
                ..
            }) => {
                self.emit(
                    out,
                    "response.function_call_arguments.done",
                    Self::fields(json!({"output_index": index,
                    "item_id": id, "arguments": arguments})),
                );
                let item = call_item(&id, &call_id, &name, &arguments, "completed");
                self.emit(
                    out,
                    "response.output_item.done",
                    Self::fields(json!({"output_index": index, "item": item.clone()})),
                );
                self.output.push(item);
            }
        }
    }

    fn close(&mut self, out: &mut String) {
        if self.finished {
            return;
        }
        self.start(None, out);
        self.finished = true;
        self.close_item(out);
        // An upstream that stopped without saying why (no finish reason, no `[DONE]`) was cut off.
        let cut_off = self.finish_reason.is_none() && !self.done;
        let (status, incomplete) = if cut_off {
            ("failed", Value::Null)
        } else {
            status_of(self.finish_reason.as_deref())
        };
        let mut response = response_object(
            &format!("resp_{}", self.id),
            self.created,
            &self.client_model,
            status,
            incomplete,
            std::mem::take(&mut self.output),
            responses_usage(self.usage.as_ref()),
        );
        if cut_off && let Some(fields) = response.as_object_mut() {
            fields.insert(
                "error".into(),
                json!({"code": "server_error", "message": "the upstream's answer ended before it was complete"}),
            );
        }
        let kind = match status {
            "failed" => "response.failed",
            "incomplete" => "response.incomplete",
            _ => "response.completed",
        };
        self.emit(out, kind, Self::fields(json!({"response": response})));
    }
}

#[cfg(test)]
mod tests;
