//! What the prompt classifier reads of a request: the messages' text (tool calls' arguments
//! and tool inputs included: they can carry personal data too), and separately the text around
//! them (tool definitions, schemas, the end-user id, metadata).

use std::borrow::Cow;

use serde_json::Value;
use serde_json::value::RawValue;
use switchyard_policy::classify::PromptText;

use super::{Content, PromptInput, RequestBody};

impl Content<'_> {
    pub(super) fn visit_text(&self, visit: &mut dyn FnMut(&str)) {
        match self {
            Content::Text(text) => visit(text),
            Content::Parts(parts) => {
                for part in parts {
                    if part.raw.get().starts_with('"') {
                        if let Ok(text) = serde_json::from_str::<Cow<'_, str>>(part.raw.get()) {
                            visit(&text);
                        }
                        continue;
                    }
                    if let Some(text) = &part.fields.text {
                        visit(text);
                    }
                    if let Some(nested) = &part.fields.content {
                        nested.visit_text(visit);
                    }
                    if let Some(input) = part.fields.input {
                        visit_strings(input, visit);
                    }
                }
            }
            Content::Other => {}
        }
    }
}

/// Every string inside a raw JSON value.
pub(super) fn visit_strings(raw: &RawValue, visit: &mut dyn FnMut(&str)) {
    fn walk(value: &Value, visit: &mut dyn FnMut(&str)) {
        match value {
            Value::String(text) => visit(text),
            Value::Array(items) => items.iter().for_each(|v| walk(v, visit)),
            Value::Object(fields) => fields.values().for_each(|v| walk(v, visit)),
            _ => {}
        }
    }
    if let Ok(value) = serde_json::from_str::<Value>(raw.get()) {
        walk(&value, visit);
    }
}

/// What the prompt classifier reads: the messages' text (tool calls' arguments and tool inputs
/// included: they can carry personal data too), and separately the text around them.
impl PromptText for RequestBody<'_> {
    fn for_each_text(&self, visit: &mut dyn FnMut(&str)) {
        if let Some(system) = &self.system {
            system.visit_text(visit);
        }
        for message in self.messages.iter().flatten() {
            if let Some(content) = &message.content {
                content.visit_text(visit);
            }
            for call in message.tool_calls() {
                match call.function.and_then(|f| f.arguments) {
                    Some(raw) if raw.get().starts_with('"') => {
                        if let Ok(text) = serde_json::from_str::<Cow<'_, str>>(raw.get()) {
                            visit(&text);
                        }
                    }
                    Some(raw) => visit_strings(raw, visit),
                    None => {}
                }
            }
        }
        // What pooling models embed or compare, and a Responses request's instructions and
        // input items (every string in them: texts, call arguments, tool outputs), are prompt
        // text too.
        for raw in [
            self.instructions,
            self.input,
            self.text_1,
            self.text_2,
            self.query,
            self.documents,
        ]
        .into_iter()
        .flatten()
        {
            visit_strings(raw, visit);
        }
        match self.prompt_input() {
            Some(Ok(PromptInput::Text(text))) => visit(&text),
            Some(Ok(PromptInput::Texts(texts))) => texts.iter().for_each(|t| visit(t)),
            _ => {}
        }
    }

    fn for_each_other_text(&self, visit: &mut dyn FnMut(&str)) {
        // Tool and function definitions (names, descriptions, schemas), a structured-output
        // schema, the end-user id and metadata reach the model or the provider too.
        for raw in [
            self.tools,
            self.functions,
            self.response_format,
            self.text,
            self.user,
            self.metadata,
        ]
        .into_iter()
        .flatten()
        {
            visit_strings(raw, visit);
        }
        for message in self.messages.iter().flatten() {
            if let Some(name) = message.name {
                visit_strings(name, visit);
            }
        }
    }

    fn user_turns(&self) -> usize {
        match &self.messages {
            Some(messages) => messages.iter().filter(|m| m.role == "user").count(),
            None if self.is_responses => self.responses_user_turns(),
            None => usize::from(self.prompt.is_some()),
        }
    }
}
