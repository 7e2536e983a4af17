//! OpenAI's Responses API in the typed model: `input` (a string, or items: messages, function
//! calls and their outputs, reasoning) and `instructions`, read as vLLM reads them.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;
use switchyard_kv::tokenize::{ChatMessage, push_response_message};

use super::{Content, RequestBody};

/// A Responses request's `input`.
#[derive(Debug)]
pub enum ResponsesInput<'a> {
    /// One user message.
    Text(Cow<'a, str>),
    Items(Vec<InputItem<'a>>),
}

/// One input item: a message (`role` and `content`), a function call (`call_id`, `name`,
/// `arguments`), a function call's `output`, or reasoning. Unknown item types are the worker's
/// to judge.
#[derive(Debug, Default, Deserialize)]
pub struct InputItem<'a> {
    #[serde(rename = "type", borrow, default)]
    pub kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub content: Option<Content<'a>>,
    #[serde(borrow, default)]
    pub call_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub name: Option<Cow<'a, str>>,
    /// A function call's arguments: a JSON string.
    #[serde(borrow, default)]
    pub arguments: Option<Cow<'a, str>>,
    /// A function call's output: a string, or content parts.
    #[serde(borrow, default)]
    pub output: Option<Content<'a>>,
    /// Reasoning text (`content` of reasoning items is parts too; `summary` is the fallback).
    #[serde(borrow, default)]
    pub summary: Option<Content<'a>>,
}

impl InputItem<'_> {
    pub fn is_function_call(&self) -> bool {
        matches!(
            self.kind.as_deref(),
            Some("function_call" | "custom_tool_call")
        )
    }

    pub fn is_function_output(&self) -> bool {
        matches!(
            self.kind.as_deref(),
            Some("function_call_output" | "custom_tool_call_output")
        )
    }

    pub fn is_reasoning(&self) -> bool {
        self.kind.as_deref() == Some("reasoning")
    }
}

/// The Responses API's own fields, checked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResponsesFields {
    pub previous_response_id: Option<String>,
    pub max_output_tokens: Option<u64>,
    /// `store`, true unless set false.
    pub store: bool,
    pub background: bool,
    /// The id the client chose for the response (vLLM's `request_id`).
    pub request_id: Option<String>,
}

impl<'a> RequestBody<'a> {
    /// The Responses API's own fields (`null` is absent); `Err` names the one of a wrong type.
    pub fn responses_fields(&self) -> Result<ResponsesFields, crate::api::ApiError> {
        fn read<'de, T: serde::Deserialize<'de>>(
            raw: Option<&'de RawValue>,
            name: &'static str,
            expected: &str,
        ) -> Result<Option<T>, crate::api::ApiError> {
            match raw.filter(|raw| raw.get() != "null") {
                None => Ok(None),
                Some(raw) => serde_json::from_str(raw.get()).map(Some).map_err(|_| {
                    crate::api::ApiError::invalid(name, format!("'{name}' must be {expected}"))
                }),
            }
        }
        Ok(ResponsesFields {
            previous_response_id: read(
                self.previous_response_id,
                "previous_response_id",
                "a string",
            )?,
            max_output_tokens: read(
                self.max_output_tokens,
                "max_output_tokens",
                "a positive integer",
            )?,
            store: read(self.store, "store", "a boolean")?.unwrap_or(true),
            background: read(self.background, "background", "a boolean")?.unwrap_or(false),
            request_id: read(self.request_id, "request_id", "a string")?,
        })
    }

    /// `instructions` when it is a string.
    pub fn instructions_text(&self) -> Option<Cow<'a, str>> {
        serde_json::from_str(self.instructions?.get()).ok()
    }

    /// The Responses `input`: `None` when absent, `Err` when it is neither a string nor items.
    pub fn responses_input(&self) -> Option<Result<ResponsesInput<'a>, String>> {
        let raw = self.input.filter(|raw| raw.get() != "null")?;
        Some(if raw.get().starts_with('"') {
            serde_json::from_str(raw.get())
                .map(ResponsesInput::Text)
                .map_err(|e| e.to_string())
        } else {
            serde_json::from_str::<Vec<InputItem<'a>>>(raw.get())
                .map(ResponsesInput::Items)
                .map_err(|_| "'input' must be a string or a list of input items".to_owned())
        })
    }

    /// The conversation as vLLM renders a Responses request for its chat template
    /// (`construct_input_messages`; the same rules as `switchyard_kv::tokenize::responses_messages`,
    /// which the simulator uses): `instructions` as the system message, then the input. A
    /// function call or reasoning item joins the assistant message before it; assistant text
    /// joins an assistant message that has none yet. What a `previous_response_id` adds is on
    /// the worker, not here.
    pub fn responses_messages(&self) -> Vec<ChatMessage> {
        let mut out: Vec<(String, Option<String>)> = Vec::new();
        if let Some(instructions) = self.instructions_text().filter(|t| !t.is_empty()) {
            out.push(("system".into(), Some(instructions.into_owned())));
        }
        match self.responses_input() {
            Some(Ok(ResponsesInput::Text(text))) => out.push(("user".into(), Some(text.into()))),
            Some(Ok(ResponsesInput::Items(items))) => {
                for item in &items {
                    let text_of = |content: &Option<Content<'_>>| {
                        content
                            .as_ref()
                            .map_or_else(String::new, Content::template_text)
                    };
                    let (role, text) = if item.is_function_call() || item.is_reasoning() {
                        ("assistant", None)
                    } else if item.is_function_output() {
                        ("tool", Some(text_of(&item.output)))
                    } else {
                        match item.role.as_deref() {
                            Some("assistant") => (
                                "assistant",
                                Some(
                                    item.content
                                        .as_ref()
                                        .map_or_else(String::new, Content::first_text),
                                ),
                            ),
                            Some(role) => (role, Some(text_of(&item.content))),
                            None => continue,
                        }
                    };
                    push_response_message(&mut out, role, text);
                }
            }
            _ => {}
        }
        out.into_iter()
            .map(|(role, content)| ChatMessage::new(&role, &content.unwrap_or_default()))
            .collect()
    }

    /// User turns of a Responses request (a string input is one).
    pub fn responses_user_turns(&self) -> usize {
        match self.responses_input() {
            Some(Ok(ResponsesInput::Text(_))) => 1,
            Some(Ok(ResponsesInput::Items(items))) => items
                .iter()
                .filter(|item| item.role.as_deref() == Some("user"))
                .count(),
            _ => 0,
        }
    }
}

/// Raw fields of a Responses function tool (`{"type": "function", "name", ...}`).
#[derive(Debug, Deserialize)]
pub struct ResponsesTool<'a> {
    #[serde(rename = "type", borrow, default)]
    pub kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub name: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub description: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub parameters: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub strict: Option<&'a RawValue>,
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use switchyard_kv::tokenize::responses_messages;

    #[test]
    fn renders_exactly_what_the_simulator_renders() {
        let bodies = [
            json!({"model": "m", "input": "hi", "instructions": "Be brief."}),
            json!({"model": "m", "input": "hi", "instructions": ""}),
            json!({"model": "m", "input": [
                {"role": "developer", "content": "rules"},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "http://x/y.png"}]},
                {"type": "reasoning", "id": "r1", "summary": []},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "answer"}, {"type": "output_text", "text": "more"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "42"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "parts"}]},
                {"role": "assistant", "content": "first"},
                {"role": "assistant", "content": "second"},
                {"type": "function_call", "call_id": "c3", "name": "g", "arguments": "{\"a\":1}"},
                {"role": "user", "content": "last"},
            ]}),
        ];
        for body in bodies {
            let bytes = body.to_string();
            let typed = super::super::parse(bytes.as_bytes()).unwrap();
            assert_eq!(
                typed.responses_messages(),
                responses_messages(&body),
                "{body}"
            );
        }
    }
}
