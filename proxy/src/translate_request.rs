//! Request bodies from one API into the other, read from the typed model ([`crate::wire`]):
//! Anthropic Messages → OpenAI Chat Completions (targets that only speak OpenAI) and Chat
//! Completions → Messages (Anthropic-format providers). Answers go back in `translate` and
//! `translate_openai`.

use bytes::Bytes;
use serde_json::{Map, Value, json};

use crate::api::ApiError;
use crate::wire::{Content, Either, Message, Part, RequestBody, tree, tree_or_null};

/// Anthropic requires `max_tokens`; OpenAI clients often leave it out.
pub const DEFAULT_MAX_TOKENS: u64 = 4096;

fn kind<'p>(part: &'p Part<'_>) -> Option<&'p str> {
    part.fields.kind.as_deref()
}

/// Translate an Anthropic Messages request into an OpenAI Chat Completions body.
pub fn messages_to_chat(
    request: &RequestBody<'_>,
    upstream_model: &str,
) -> Result<Bytes, ApiError> {
    let mut out = Map::new();
    out.insert("model".into(), Value::String(upstream_model.to_owned()));

    let mut messages = Vec::new();
    if let Some(system) = &request.system {
        let text = block_text(system, "system")?;
        if !text.is_empty() {
            messages.push(json!({"role": "system", "content": text}));
        }
    }
    let input = request
        .messages
        .as_deref()
        .ok_or_else(|| ApiError::invalid("messages", "'messages' must be an array"))?;
    for (index, message) in input.iter().enumerate() {
        chat_messages_of(message, index, &mut messages)?;
    }
    out.insert("messages".into(), Value::Array(messages));

    if let Some(max_tokens) = request.max_tokens {
        out.insert("max_tokens".into(), json!(max_tokens));
    }
    for (name, raw) in [
        ("temperature", request.temperature),
        ("top_p", request.top_p),
        ("top_k", request.top_k),
        ("stop", request.stop_sequences),
    ] {
        if let Some(raw) = raw {
            out.insert(name.into(), tree(raw));
        }
    }
    if let Some(user) = request.metadata_user_id() {
        out.insert("user".into(), tree(user));
    }
    if request.stream() == Some(true) {
        out.insert("stream".into(), Value::Bool(true));
        // Anthropic's final event carries usage; ask the worker for it.
        out.insert("stream_options".into(), json!({"include_usage": true}));
    }
    let definitions = request
        .tool_definitions()
        .map_err(|_| ApiError::invalid("tools", "'tools' must be an array of tool definitions"))?;
    if request.tools.is_some_and(|raw| raw.get() != "null") {
        let tools: Vec<Value> = definitions
            .iter()
            .map(|tool| {
                json!({
                    "type": "function",
                    "function": {
                        "name": tree_or_null(tool.name),
                        "description": tree_or_null(tool.description),
                        "parameters": tool.input_schema.map_or_else(|| json!({"type": "object"}), tree),
                    }
                })
            })
            .collect();
        out.insert("tools".into(), Value::Array(tools));
    }
    if let Some(choice) = request.tool_choice() {
        let unknown = || ApiError::invalid("tool_choice", "unknown 'tool_choice.type'");
        let choice = match choice {
            Ok(Either::Right(choice)) => choice,
            _ => return Err(unknown()),
        };
        let translated = match choice.kind.as_deref() {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => {
                json!({"type": "function", "function": {"name": tree_or_null(choice.name)}})
            }
            _ => return Err(unknown()),
        };
        out.insert("tool_choice".into(), translated);
    }
    Ok(Bytes::from(Value::Object(out).to_string()))
}

/// Text of a string or of the text blocks of a block array, joined by newlines.
fn block_text(content: &Content<'_>, field: &'static str) -> Result<String, ApiError> {
    match content {
        Content::Text(text) => Ok(text.clone().into_owned()),
        Content::Parts(parts) => Ok(parts
            .iter()
            .filter(|part| kind(part) == Some("text"))
            .filter_map(|part| part.fields.text.as_deref())
            .collect::<Vec<_>>()
            .join("\n")),
        Content::Other => Err(ApiError::invalid(
            field,
            format!("'{field}' must be a string or an array of content blocks"),
        )),
    }
}

/// The Chat Completions messages of one Anthropic message (tool results become `tool`
/// messages of their own).
fn chat_messages_of(
    message: &Message<'_>,
    index: usize,
    out: &mut Vec<Value>,
) -> Result<(), ApiError> {
    let role = message.role.as_ref();
    let blocks = match &message.content {
        Some(Content::Text(text)) => {
            out.push(json!({"role": role, "content": text}));
            return Ok(());
        }
        Some(Content::Parts(blocks)) => blocks,
        _ => {
            return Err(ApiError::invalid(
                "messages",
                format!("messages[{index}].content must be a string or an array of content blocks"),
            ));
        }
    };
    let mut parts = Vec::new();
    let mut texts: Vec<&str> = Vec::new();
    let mut tool_calls = Vec::new();
    for block in blocks {
        let fields = &block.fields;
        match kind(block) {
            Some("text") => {
                texts.extend(fields.text.as_deref());
                parts.push(json!({"type": "text", "text": fields.text}));
            }
            Some("image") => {
                let source = fields.image_source();
                let source = source.as_ref();
                let url = match source.and_then(|s| s.kind.as_deref()) {
                    Some("base64") => format!(
                        "data:{};base64,{}",
                        source.and_then(|s| s.media_type.as_deref()).unwrap_or("image/png"),
                        source.and_then(|s| s.data.as_deref()).unwrap_or_default()
                    ),
                    Some("url") => source
                        .and_then(|s| s.url.as_deref())
                        .unwrap_or_default()
                        .to_owned(),
                    _ => {
                        return Err(ApiError::invalid(
                            "messages",
                            format!("messages[{index}]: image source must be base64 or url"),
                        ));
                    }
                };
                parts.push(json!({"type": "image_url", "image_url": {"url": url}}));
            }
            Some("tool_use") => tool_calls.push(json!({
                "id": tree_or_null(fields.id),
                "type": "function",
                "function": {
                    "name": tree_or_null(fields.name),
                    "arguments": fields.input.map_or_else(|| "{}".to_owned(), |input| tree(input).to_string()),
                }
            })),
            Some("tool_result") => {
                let text = match &fields.content {
                    Some(content) => block_text(content, "messages")?,
                    None => String::new(),
                };
                out.push(json!({"role": "tool", "tool_call_id": tree_or_null(fields.tool_use_id), "content": text}));
            }
            // Reasoning blocks from earlier turns have no Chat Completions form; drop them.
            Some("thinking" | "redacted_thinking") => {}
            other => {
                return Err(ApiError::invalid(
                    "messages",
                    format!("messages[{index}]: unsupported content block type {other:?}"),
                ));
            }
        }
    }
    if role == "assistant" {
        let mut message = Map::new();
        message.insert("role".into(), json!("assistant"));
        message.insert(
            "content".into(),
            if texts.is_empty() {
                Value::Null
            } else {
                Value::String(texts.join(""))
            },
        );
        if !tool_calls.is_empty() {
            message.insert("tool_calls".into(), Value::Array(tool_calls));
        }
        out.push(Value::Object(message));
    } else if !parts.is_empty() {
        out.push(json!({"role": role, "content": parts}));
    }
    Ok(())
}

/// Text of OpenAI content: a string, or its parts' text joined.
fn text_content(content: Option<&Content<'_>>, index: usize) -> Result<String, ApiError> {
    match content {
        None => Ok(String::new()),
        Some(Content::Text(text)) => Ok(text.clone().into_owned()),
        Some(Content::Parts(parts)) => Ok(parts
            .iter()
            .filter_map(|p| p.fields.text.as_deref())
            .collect::<Vec<_>>()
            .join("")),
        Some(Content::Other) => Err(ApiError::invalid(
            "messages",
            format!("messages[{index}].content must be a string or an array of parts"),
        )),
    }
}

/// One OpenAI content part as an Anthropic content block.
fn block_of(part: &Part<'_>, index: usize) -> Result<Value, ApiError> {
    match kind(part) {
        Some("text") => {
            Ok(json!({"type": "text", "text": part.fields.text.as_deref().unwrap_or("")}))
        }
        Some("image_url") => {
            let url = part.fields.image_url().unwrap_or_default();
            match url
                .strip_prefix("data:")
                .and_then(|rest| rest.split_once(";base64,"))
            {
                Some((media_type, data)) => Ok(
                    json!({"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}),
                ),
                None => Ok(json!({"type": "image", "source": {"type": "url", "url": url}})),
            }
        }
        other => Err(ApiError::invalid(
            "messages",
            format!(
                "messages[{index}]: content part type {other:?} cannot be sent to an Anthropic provider"
            ),
        )),
    }
}

/// Append a message, merging it into the previous one when the role repeats (Anthropic wants
/// user and assistant turns to alternate; tool results are user turns).
fn push_turn(messages: &mut Vec<Value>, role: &str, mut blocks: Vec<Value>) {
    if blocks.is_empty() {
        return;
    }
    if let Some(last) = messages.last_mut()
        && last.get("role").and_then(Value::as_str) == Some(role)
        && let Some(Value::Array(existing)) = last.get_mut("content")
    {
        existing.append(&mut blocks);
        return;
    }
    messages.push(json!({"role": role, "content": blocks}));
}

/// Translate a Chat Completions request into a Messages request for `upstream_model`.
pub fn chat_to_messages(
    request: &RequestBody<'_>,
    upstream_model: &str,
) -> Result<Bytes, ApiError> {
    match request
        .n
        .filter(|n| n.get() != "null")
        .map(|n| n.get().parse::<u64>())
    {
        Some(Ok(1)) | None => {}
        Some(Ok(n)) if n > 1 => {
            return Err(ApiError::invalid(
                "n",
                "this model is served by an Anthropic-format provider, which returns one choice: n must be 1",
            ));
        }
        Some(_) => return Err(ApiError::invalid("n", "'n' must be a positive integer")),
    }
    let input = request
        .messages
        .as_deref()
        .ok_or_else(|| ApiError::invalid("messages", "'messages' must be an array"))?;
    let mut system = Vec::new();
    let mut messages: Vec<Value> = Vec::new();
    for (index, message) in input.iter().enumerate() {
        let content = message.content.as_ref();
        match message.role.as_ref() {
            "system" | "developer" => {
                let text = text_content(content, index)?;
                if !text.is_empty() {
                    system.push(text);
                }
            }
            "tool" => {
                let text = text_content(content, index)?;
                push_turn(
                    &mut messages,
                    "user",
                    vec![
                        json!({"type": "tool_result", "tool_use_id": tree_or_null(message.tool_call_id), "content": text}),
                    ],
                );
            }
            role @ ("user" | "assistant") => {
                let mut blocks = match content {
                    None => Vec::new(),
                    Some(Content::Text(text)) if text.is_empty() => Vec::new(),
                    Some(Content::Text(text)) => vec![json!({"type": "text", "text": text})],
                    Some(Content::Parts(parts)) => parts
                        .iter()
                        .map(|p| block_of(p, index))
                        .collect::<Result<_, _>>()?,
                    Some(Content::Other) => {
                        return Err(ApiError::invalid(
                            "messages",
                            format!(
                                "messages[{index}].content must be a string or an array of parts"
                            ),
                        ));
                    }
                };
                for call in message.tool_calls() {
                    let function = call.function.as_ref();
                    let input = match function.and_then(|f| f.arguments_value()) {
                        None => json!({}),
                        Some(Ok(input)) => input,
                        Some(Err(_)) => {
                            return Err(ApiError::invalid(
                                "messages",
                                format!(
                                    "messages[{index}]: tool call arguments must be a JSON object"
                                ),
                            ));
                        }
                    };
                    blocks.push(json!({
                        "type": "tool_use",
                        "id": tree_or_null(call.id),
                        "name": tree_or_null(function.and_then(|f| f.name)),
                        "input": input,
                    }));
                }
                push_turn(&mut messages, role, blocks);
            }
            other => {
                return Err(ApiError::invalid(
                    "messages",
                    format!("messages[{index}]: unknown role '{other}'"),
                ));
            }
        }
    }
    let mut out = Map::new();
    out.insert("model".into(), json!(upstream_model));
    if !system.is_empty() {
        out.insert("system".into(), json!(system.join("\n\n")));
    }
    out.insert("messages".into(), Value::Array(messages));
    let max_tokens = request
        .max_completion_tokens
        .or(request.max_tokens)
        .unwrap_or(DEFAULT_MAX_TOKENS);
    out.insert("max_tokens".into(), json!(max_tokens));
    for (name, raw) in [
        ("temperature", request.temperature),
        ("top_p", request.top_p),
    ] {
        if let Some(raw) = raw {
            out.insert(name.into(), tree(raw));
        }
    }
    if let Some(stream) = request.stream() {
        out.insert("stream".into(), Value::Bool(stream));
    }
    match request.stop.map(tree) {
        Some(Value::String(stop)) => {
            out.insert("stop_sequences".into(), json!([stop]));
        }
        Some(stops @ Value::Array(_)) => {
            out.insert("stop_sequences".into(), stops);
        }
        _ => {}
    }
    if let Some(user) = request.user {
        out.insert("metadata".into(), json!({"user_id": tree(user)}));
    }
    let definitions = request
        .tool_definitions()
        .map_err(|_| ApiError::invalid("tools", "'tools' must be an array of function tools"))?;
    if request.tools.is_some_and(|raw| raw.get() != "null") {
        let tools = definitions
            .iter()
            .enumerate()
            .map(|(index, tool)| {
                let Some(f) = tool.function.as_ref() else {
                    return Err(ApiError::invalid(
                        "tools",
                        format!(
                            "tools[{index}] is not a function tool: {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": ...}}}}"
                        ),
                    ));
                };
                Ok(json!({
                    "name": tree_or_null(f.name),
                    "description": f.description.map_or_else(|| json!(""), tree),
                    "input_schema": f.parameters.map_or_else(|| json!({"type": "object"}), tree),
                }))
            })
            .collect::<Result<Vec<Value>, ApiError>>()?;
        out.insert("tools".into(), Value::Array(tools));
    }
    let bad_choice = || {
        ApiError::invalid(
            "tool_choice",
            "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
        )
    };
    match request.tool_choice() {
        Some(Ok(Either::Left(choice))) => {
            let translated = match choice.as_ref() {
                "required" => json!({"type": "any"}),
                "none" => json!({"type": "none"}),
                "auto" => json!({"type": "auto"}),
                _ => return Err(bad_choice()),
            };
            out.insert("tool_choice".into(), translated);
        }
        Some(Ok(Either::Right(choice))) => {
            let name = choice
                .function
                .and_then(|f| f.name)
                .ok_or_else(bad_choice)?;
            out.insert(
                "tool_choice".into(),
                json!({"type": "tool", "name": tree(name)}),
            );
        }
        Some(Err(_)) => return Err(bad_choice()),
        None => {}
    }
    Ok(Bytes::from(Value::Object(out).to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str) -> RequestBody<'_> {
        crate::wire::parse(body.as_bytes()).unwrap()
    }

    #[test]
    fn malformed_tools_choices_and_n_are_refused_not_dropped() {
        let refused = |body: &str| {
            chat_to_messages(&parse(body), "m")
                .err()
                .unwrap_or_else(|| panic!("accepted {body}"))
                .param
        };
        let chat = |extra: &str| {
            format!(r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}]{extra}}}"#)
        };
        for (extra, param) in [
            (r#","tools":{"type":"function"}"#, "tools"),
            // Anthropic's tool shape sent to the Chat Completions endpoint.
            (
                r#","tools":[{"name":"f","input_schema":{"type":"object"}}]"#,
                "tools",
            ),
            (r#","tool_choice":5"#, "tool_choice"),
            (r#","tool_choice":"sometimes""#, "tool_choice"),
            (r#","tool_choice":{"type":"function"}"#, "tool_choice"),
            (r#","n":0"#, "n"),
            (r#","n":"2""#, "n"),
            (r#","n":2.0"#, "n"),
            (r#","n":2"#, "n"),
        ] {
            assert_eq!(refused(&chat(extra)), Some(param), "{extra}");
        }
        for extra in [
            r#","n":1"#,
            r#","n":null"#,
            r#","tools":null"#,
            r#","tool_choice":"auto""#,
        ] {
            assert!(
                chat_to_messages(&parse(&chat(extra)), "m").is_ok(),
                "{extra}"
            );
        }
        let messages = r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}],"tools":{"name":"f"}}"#;
        assert_eq!(
            messages_to_chat(&parse(messages), "m")
                .err()
                .map(|e| e.param),
            Some(Some("tools"))
        );
    }

    #[test]
    fn request_translation_covers_system_blocks_tools_and_stream() {
        let body = json!({
            "model": "claude-alias", "max_tokens": 64, "stream": true,
            "system": [{"type": "text", "text": "be brief"}],
            "stop_sequences": ["END"],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}
            ],
            "tools": [{"name": "weather", "description": "d", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"}
        });
        let out: Value =
            serde_json::from_slice(&messages_to_chat(&parse(&body.to_string()), "qwen").unwrap())
                .unwrap();
        assert_eq!(out["model"], "qwen");
        assert_eq!(
            out["messages"][0],
            json!({"role": "system", "content": "be brief"})
        );
        assert_eq!(out["messages"][1]["content"][0]["text"], "weather?");
        assert_eq!(
            out["messages"][2]["tool_calls"][0]["function"]["arguments"],
            "{\"city\":\"Oslo\"}"
        );
        assert_eq!(
            out["messages"][3],
            json!({"role": "tool", "tool_call_id": "t1", "content": "sunny"})
        );
        assert_eq!(out["stop"], json!(["END"]));
        assert_eq!(out["stream_options"]["include_usage"], true);
        assert_eq!(out["tools"][0]["function"]["name"], "weather");
        assert_eq!(out["tool_choice"], "required");
    }

    #[test]
    fn requests_become_messages_with_system_tools_and_alternating_turns() {
        let body = json!({
            "model": "alias", "max_completion_tokens": 99, "stream": true, "stop": "END", "user": "u1",
            "temperature": 0.2,
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"q\":1}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
                {"role": "user", "content": "and?"},
            ],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "tool_choice": "required",
        });
        let out: Value = serde_json::from_slice(
            &chat_to_messages(&parse(&body.to_string()), "claude-x").unwrap(),
        )
        .unwrap();
        assert_eq!(out["model"], "claude-x");
        assert_eq!(out["system"], "be brief");
        assert_eq!(out["max_tokens"], 99);
        assert_eq!(out["stop_sequences"], json!(["END"]));
        assert_eq!(out["metadata"]["user_id"], "u1");
        assert_eq!(out["tool_choice"], json!({"type": "any"}));
        assert_eq!(out["tools"][0]["input_schema"], json!({"type": "object"}));
        let messages = out["messages"].as_array().unwrap();
        let roles: Vec<&str> = messages
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(
            roles,
            ["user", "assistant", "user"],
            "tool result and next user turn merged"
        );
        assert_eq!(
            messages[0]["content"][1]["source"],
            json!({"type": "base64", "media_type": "image/png", "data": "AAAA"})
        );
        assert_eq!(
            messages[1]["content"][0],
            json!({"type": "tool_use", "id": "c1", "name": "f", "input": {"q": 1}})
        );
        assert_eq!(messages[2]["content"][0]["type"], "tool_result");
        assert_eq!(
            messages[2]["content"][1],
            json!({"type": "text", "text": "and?"})
        );
        let no_max: Value = serde_json::from_slice(
            &chat_to_messages(
                &parse(r#"{"messages":[{"role":"user","content":"x"}]}"#),
                "m",
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(no_max["max_tokens"], DEFAULT_MAX_TOKENS);
        assert!(chat_to_messages(&parse(r#"{"n":2,"messages":[]}"#), "m").is_err());
        // Arguments sent as an object (some clients do) are taken as they are.
        let object_arguments = r#"{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c","function":{"name":"f","arguments":{"q":2}}}]}]}"#;
        let out: Value =
            serde_json::from_slice(&chat_to_messages(&parse(object_arguments), "m").unwrap())
                .unwrap();
        assert_eq!(out["messages"][0]["content"][0]["input"], json!({"q": 2}));
    }
}
