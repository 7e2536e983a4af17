//! An Anthropic Messages request as vLLM's `/v1/messages` turns it into a chat completion
//! before rendering it (`AnthropicServingMessages.to_chat_completion_request` in
//! `vllm/entrypoints/anthropic/serving.py`, 0.34): the system prompt and its blocks, `tool_use`
//! blocks as tool calls, `tool_result` blocks as tool messages, thinking blocks as reasoning,
//! tools, and `thinking` and `output_config.effort` as a reasoning effort. The result is an
//! OpenAI request ([`crate::tokenize::openai_chat`] renders it).

use indexmap::IndexMap;
use minijinja::Value;
use minijinja::value::ValueKind;

use crate::chat_template::given;

/// The first line of a system text Claude Code adds, which changes with every request.
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// How a pool's template takes what Anthropic requests carry (decided by vLLM once per
/// template, see [`crate::tokenize::PromptTokenizer::anthropic_rendering`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AnthropicRendering {
    /// The template refuses a system message after the first: inline system messages are
    /// merged into the leading one (`_detect_merge_inline_system`).
    pub merge_inline_system: bool,
    /// The reasoning effort a request with thinking disabled gets: `"none"`, or `"low"` where
    /// the template refuses or ignores `"none"` (`DisabledThinkingEffortResolver`).
    pub disabled_thinking_effort: &'static str,
}

/// The chat completion request vLLM makes of an Anthropic Messages `request` (parsed keeping
/// the order of object keys), as far as its chat template sees it.
pub fn anthropic_as_openai(request: &Value, rendering: AnthropicRendering) -> Value {
    let attr = |value: &Value, name: &str| value.get_attr(name).ok().filter(given);
    let messages: Vec<Value> = attr(request, "messages")
        .filter(|m| m.kind() == ValueKind::Seq)
        .and_then(|m| m.try_iter().ok())
        .map(Iterator::collect)
        .unwrap_or_default();
    let mut out: Vec<Value> = Vec::new();

    // The system prompt: a string as it is, text blocks but Claude Code's billing line.
    let mut system: Vec<String> = Vec::new();
    match attr(request, "system") {
        // An empty string is no system prompt (vLLM's `if anthropic_request.system`).
        Some(text) if text.kind() == ValueKind::String => {
            system.extend(text.as_str().filter(|t| !t.is_empty()).map(str::to_owned));
        }
        Some(blocks) => system.extend(system_block_texts(&blocks)),
        None => {}
    }
    let role_of = |m: &Value| attr(m, "role").and_then(|r| r.as_str().map(str::to_owned));
    if rendering.merge_inline_system {
        for message in messages
            .iter()
            .filter(|m| role_of(m).as_deref() == Some("system"))
        {
            if let Some(text) = system_text(message) {
                system.push(text);
            }
        }
    }
    if !system.is_empty() {
        out.push(map([
            ("role", Value::from("system")),
            ("content", Value::from(system.concat())),
        ]));
    }

    for message in &messages {
        let role = role_of(message).unwrap_or_default();
        if role == "system" {
            if !rendering.merge_inline_system
                && let Some(text) = system_text(message)
            {
                out.push(map([
                    ("role", Value::from("system")),
                    ("content", Value::from(text)),
                ]));
            }
            continue;
        }
        let content = attr(message, "content").unwrap_or_default();
        if let Some(text) = content.as_str() {
            out.push(map([
                ("role", Value::from(role.as_str())),
                ("content", Value::from(text)),
            ]));
            continue;
        }
        let mut parts: Vec<Value> = Vec::new();
        let mut calls: Vec<Value> = Vec::new();
        let mut reasoning: Vec<String> = Vec::new();
        for block in content.try_iter().into_iter().flatten() {
            let text_of =
                |name: &str| attr(&block, name).and_then(|t| t.as_str().map(str::to_owned));
            match text_of("type").as_deref() {
                Some("text") => {
                    if let Some(text) = text_of("text").filter(|t| !t.is_empty()) {
                        parts.push(map([
                            ("type", Value::from("text")),
                            ("text", Value::from(text)),
                        ]));
                    }
                }
                Some("image") => {
                    if let Some(source) = attr(&block, "source") {
                        parts.push(image_part(&source));
                    }
                }
                Some("thinking") => reasoning.extend(text_of("thinking")),
                Some("tool_use") => {
                    let id = text_of("id").filter(|id| !id.is_empty());
                    let arguments = attr(&block, "input")
                        .filter(Value::is_true)
                        .unwrap_or_else(|| Value::from_object(IndexMap::<Value, Value>::new()));
                    calls.push(map([
                        ("id", Value::from(id.unwrap_or_else(call_id))),
                        ("type", Value::from("function")),
                        (
                            "function",
                            map([
                                ("name", Value::from(text_of("name").unwrap_or_default())),
                                ("arguments", arguments),
                            ]),
                        ),
                    ]));
                }
                Some("tool_result") if role == "user" => tool_result(&block, &mut out),
                Some("tool_result") => {
                    let result = attr(&block, "content")
                        .filter(Value::is_true)
                        .map(|c| c.as_str().map_or_else(|| c.to_string(), str::to_owned))
                        .unwrap_or_default();
                    parts.push(map([
                        ("type", Value::from("text")),
                        ("text", Value::from(format!("Tool result: {result}"))),
                    ]));
                }
                _ => {}
            }
        }
        let mut converted: IndexMap<Value, Value> = IndexMap::new();
        converted.insert(Value::from("role"), Value::from(role.as_str()));
        if !reasoning.is_empty() {
            converted.insert(Value::from("reasoning"), Value::from(reasoning.concat()));
        }
        let has_calls = !calls.is_empty();
        if has_calls {
            converted.insert(Value::from("tool_calls"), Value::from(calls));
        }
        let single_text = match parts.as_slice() {
            [part] => part
                .get_attr("type")
                .ok()
                .filter(|t| t.as_str() == Some("text"))
                .and_then(|_| part.get_attr("text").ok()),
            _ => None,
        };
        if let Some(text) = single_text {
            converted.insert(Value::from("content"), text);
        } else if !parts.is_empty() {
            converted.insert(Value::from("content"), Value::from(parts));
        } else if role == "user" {
            // Nothing but tool results: those are the tool messages already added.
            continue;
        }
        out.push(Value::from_object(converted));
    }

    let mut request_out: IndexMap<Value, Value> = IndexMap::new();
    request_out.insert(Value::from("messages"), Value::from(out));
    if let Some(kwargs) = attr(request, "chat_template_kwargs") {
        request_out.insert(Value::from("chat_template_kwargs"), kwargs);
    }
    let mut effort = attr(request, "output_config").and_then(|c| attr(&c, "effort"));
    if let Some(thinking) = attr(request, "thinking")
        && matches!(
            attr(&thinking, "type")
                .and_then(|t| t.as_str().map(str::to_owned))
                .as_deref(),
            Some("disabled" | "between_tools")
        )
    {
        effort = Some(Value::from(rendering.disabled_thinking_effort));
    }
    if let Some(effort) = effort {
        request_out.insert(Value::from("reasoning_effort"), effort);
    }
    if let Some(tools) = attr(request, "tools").filter(|t| t.kind() == ValueKind::Seq) {
        let tools: Vec<Value> = tools
            .try_iter()
            .into_iter()
            .flatten()
            .map(|tool| {
                let field = |name: &str| attr(&tool, name).unwrap_or(Value::from(()));
                map([
                    ("type", Value::from("function")),
                    (
                        "function",
                        map([
                            ("name", field("name")),
                            ("description", field("description")),
                            ("parameters", object_schema(field("input_schema"))),
                            ("strict", field("strict")),
                            ("defer_loading", field("defer_loading")),
                        ]),
                    ),
                ])
            })
            .collect();
        request_out.insert(Value::from("tools"), Value::from(tools));
    }
    Value::from_object(request_out)
}

/// A tool's `input_schema` as vLLM's `AnthropicTool` validates it: `"type": "object"` added
/// (last) when it has no type.
fn object_schema(schema: Value) -> Value {
    if schema.kind() != ValueKind::Map || schema.get_attr("type").is_ok_and(|t| !t.is_undefined()) {
        return schema;
    }
    let mut out: IndexMap<Value, Value> = IndexMap::new();
    for key in schema.try_iter().into_iter().flatten() {
        let value = schema.get_item(&key).unwrap_or_default();
        out.insert(key, value);
    }
    out.insert(Value::from("type"), Value::from("object"));
    Value::from_object(out)
}

fn map<const N: usize>(entries: [(&str, Value); N]) -> Value {
    Value::from_object(
        entries
            .into_iter()
            .map(|(key, value)| (Value::from(key), value))
            .collect::<IndexMap<Value, Value>>(),
    )
}

/// vLLM's id for a `tool_use` block without one: `call_<unix seconds>`.
fn call_id() -> String {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!("call_{seconds}")
}

/// The texts of a system prompt's text blocks, but empty ones and Claude Code's billing line.
fn system_block_texts(blocks: &Value) -> Vec<String> {
    blocks
        .try_iter()
        .into_iter()
        .flatten()
        .filter(|block| {
            block
                .get_attr("type")
                .ok()
                .and_then(|t| t.as_str().map(|t| t == "text"))
                == Some(true)
        })
        .filter_map(|block| {
            block
                .get_attr("text")
                .ok()
                .and_then(|t| t.as_str().map(str::to_owned))
        })
        .filter(|text| !text.is_empty() && !text.starts_with(BILLING_HEADER))
        .collect()
}

/// A system message's text (`_extract_system_text`): a string unless it is the billing line,
/// or its text blocks joined.
fn system_text(message: &Value) -> Option<String> {
    let content = message.get_attr("content").ok()?;
    if let Some(text) = content.as_str() {
        return (!text.is_empty() && !text.starts_with(BILLING_HEADER)).then(|| text.to_owned());
    }
    let texts = system_block_texts(&content);
    (!texts.is_empty()).then(|| texts.concat())
}

/// An Anthropic image source as the OpenAI part vLLM makes of it.
fn image_part(source: &Value) -> Value {
    let field = |name: &str| {
        source
            .get_attr(name)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
    };
    let url = if field("type").as_deref() == Some("url") {
        field("url").unwrap_or_default()
    } else {
        format!(
            "data:{};base64,{}",
            field("media_type").unwrap_or_else(|| "image/jpeg".into()),
            field("data").unwrap_or_default()
        )
    };
    map([
        ("type", Value::from("image_url")),
        ("image_url", map([("url", Value::from(url))])),
    ])
}

/// A user's `tool_result` block as vLLM adds it (`_convert_user_tool_result`): a tool message
/// with its text (text items joined by newlines; tool references first when there are any),
/// then a user message with its images.
fn tool_result(block: &Value, out: &mut Vec<Value>) {
    let content = block.get_attr("content").ok().unwrap_or_default();
    let mut text = String::new();
    let mut images: Vec<Value> = Vec::new();
    let mut references: Vec<Value> = Vec::new();
    if let Some(string) = content.as_str() {
        text = string.to_owned();
    } else if content.kind() == ValueKind::Seq {
        let mut texts: Vec<String> = Vec::new();
        for item in content.try_iter().into_iter().flatten() {
            let field = |name: &str| {
                item.get_attr(name)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
            };
            match field("type").as_deref() {
                Some("text") => texts.push(field("text").unwrap_or_default()),
                Some("image") => {
                    if let Ok(source) = item.get_attr("source") {
                        images.push(image_part(&source));
                    }
                }
                Some("tool_reference") => {
                    if let Some(name) = field("tool_name").or_else(|| field("name")) {
                        references.push(map([
                            ("type", Value::from("tool_reference")),
                            ("name", Value::from(name)),
                        ]));
                    }
                }
                _ => {}
            }
        }
        text = texts.join("\n");
    }
    let content = if references.is_empty() {
        Value::from(text)
    } else {
        if !text.is_empty() {
            references.push(map([
                ("type", Value::from("text")),
                ("text", Value::from(text)),
            ]));
        }
        Value::from(references)
    };
    let id = block
        .get_attr("tool_use_id")
        .ok()
        .filter(given)
        .unwrap_or(Value::from(""));
    out.push(map([
        ("role", Value::from("tool")),
        ("tool_call_id", id),
        ("content", content),
    ]));
    if !images.is_empty() {
        out.push(map([
            ("role", Value::from("user")),
            ("content", Value::from(images)),
        ]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenize::{ChatMessage, PromptTokenizer, anthropic_chat};

    fn parse(json: &str) -> Value {
        serde_json::from_str(json).unwrap_or_default()
    }

    fn json(value: &Value) -> Option<String> {
        crate::chat_template::python_json_string(value).ok()
    }

    /// A Claude Code turn: its system prompt with the billing line, thinking, a tool call and
    /// its result, tools, thinking disabled.
    const REQUEST: &str = r#"{"model": "m", "max_tokens": 100, "thinking": {"type": "disabled"},
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=9"}, {"type": "text", "text": "You are Claude Code."}],
        "tools": [{"name": "Bash", "description": "Run a command", "input_schema": {"properties": {"command": {"type": "string"}}}}],
        "messages": [
          {"role": "user", "content": "List the files."},
          {"role": "assistant", "content": [{"type": "thinking", "thinking": "Use ls.", "signature": "s"}, {"type": "text", "text": "Listing."},
            {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls", "cwd": "."}}]},
          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "a.txt"}, {"type": "text", "text": "b.txt"}]}]},
          {"role": "user", "content": [{"type": "text", "text": "Thanks."}]}
        ]}"#;

    #[test]
    fn a_claude_code_turn_becomes_the_chat_vllm_renders() {
        let rendering = AnthropicRendering {
            merge_inline_system: false,
            disabled_thinking_effort: "none",
        };
        let converted = anthropic_as_openai(&parse(REQUEST), rendering);
        let (messages, inputs) = crate::tokenize::openai_chat(&converted);
        let roles: Vec<&str> = messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        assert_eq!(messages[0].content, "You are Claude Code.");
        assert_eq!(messages[2].content, "Listing.");
        assert_eq!(messages[2].reasoning.as_deref(), Some("Use ls."));
        assert_eq!(
            messages[2].tool_calls.as_ref().and_then(json).as_deref(),
            Some(
                r#"[{"id": "toolu_1", "function": {"arguments": {"command": "ls", "cwd": "."}, "name": "Bash"}, "type": "function"}]"#
            )
        );
        assert_eq!(messages[3].content, "a.txt\nb.txt");
        assert_eq!(
            messages[3].tool_call_id.as_ref().and_then(|v| v.as_str()),
            Some("toolu_1")
        );
        assert_eq!(messages[4], ChatMessage::new("user", "Thanks."));
        assert_eq!(
            inputs.tools.as_ref().and_then(json).as_deref(),
            Some(
                r#"[{"type": "function", "function": {"name": "Bash", "description": "Run a command", "parameters": {"properties": {"command": {"type": "string"}}, "type": "object"}}}]"#
            )
        );
        let kwargs: Vec<String> = inputs
            .kwargs
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        assert_eq!(kwargs, ["enable_thinking=False", "reasoning_effort=none"]);
    }

    #[test]
    fn inline_system_messages_are_merged_where_the_template_wants_one_system_message_first() {
        let strict = "{% for m in messages %}{% if m.role == 'system' and not loop.first %}{{ raise_exception('System message must be at the beginning.') }}{% endif %}<{{ m.role }}>{{ m.content }}{% endfor %}";
        let tokenizer = PromptTokenizer::new(crate::tokenize::SHIPPED_TOKENIZER_JSON, strict)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(tokenizer.anthropic_rendering().merge_inline_system);
        let shipped = PromptTokenizer::shipped().unwrap_or_else(|e| panic!("{e}"));
        assert!(!shipped.anthropic_rendering().merge_inline_system);
        // ChatML has no thinking switch: "none" renders as every effort does, so vLLM sends "low".
        assert_eq!(
            shipped.anthropic_rendering().disabled_thinking_effort,
            "low"
        );
        // A template that turns thinking off for "none" gets "none".
        let switch = "{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking is false %}<nothink>{% endif %}";
        let thinking = PromptTokenizer::new(crate::tokenize::SHIPPED_TOKENIZER_JSON, switch)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            thinking.anthropic_rendering().disabled_thinking_effort,
            "none"
        );

        let request = parse(
            r#"{"system": "Base.", "messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "Reminder."}, {"role": "system", "content": ""}, {"role": "user", "content": "b"}]}"#,
        );
        let (merged, _) = anthropic_chat(&request, tokenizer.anthropic_rendering());
        assert_eq!(merged[0], ChatMessage::new("system", "Base.Reminder."));
        assert_eq!(merged.len(), 3);
        let (kept, _) = anthropic_chat(&request, shipped.anthropic_rendering());
        assert_eq!(kept[2], ChatMessage::new("system", "Reminder."));
        assert_eq!(kept.len(), 4);
        // An empty system prompt is none.
        let (none, _) = anthropic_chat(
            &parse(r#"{"system": "", "messages": [{"role": "user", "content": "a"}]}"#),
            shipped.anthropic_rendering(),
        );
        assert_eq!(none, [ChatMessage::new("user", "a")]);
        assert_eq!(
            tokenizer
                .render_chat_with(&merged, &crate::chat_template::TemplateInputs::default())
                .ok()
                .as_deref(),
            Some("<system>Base.Reminder.<user>a<user>b")
        );
    }
}
