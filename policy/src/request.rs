//! The text of an OpenAI or Anthropic request body, for classification.

use serde_json::Value;

use crate::classify::PromptText;

/// A request body's message text: OpenAI chat (`messages[].content` as a string or parts),
/// Anthropic Messages (`system`, content blocks, tool results) and completions (`prompt`).
#[derive(Debug, Clone)]
pub struct RequestPrompt {
    body: Value,
}

impl RequestPrompt {
    pub fn new(body: Value) -> RequestPrompt {
        RequestPrompt { body }
    }

    /// `None` when the bytes are not a JSON object.
    pub fn parse(body: &[u8]) -> Option<RequestPrompt> {
        match serde_json::from_slice::<Value>(body) {
            Ok(value @ Value::Object(_)) => Some(RequestPrompt::new(value)),
            _ => None,
        }
    }
}

fn visit_content(content: &Value, visit: &mut dyn FnMut(&str)) {
    match content {
        Value::String(text) => visit(text),
        Value::Array(parts) => {
            for part in parts {
                match part {
                    Value::String(text) => visit(text),
                    Value::Object(fields) => {
                        // Text parts and blocks carry `text`; tool results nest `content`;
                        // tool calls carry their arguments as `input` (Anthropic).
                        if let Some(Value::String(text)) = fields.get("text") {
                            visit(text);
                        }
                        if let Some(nested) = fields.get("content") {
                            visit_content(nested, visit);
                        }
                        if let Some(input) = fields.get("input") {
                            visit_json(input, visit);
                        }
                    }
                    _ => {}
                }
            }
        }
        _ => {}
    }
}

/// Every string inside a JSON value (tool arguments can carry personal data too).
fn visit_json(value: &Value, visit: &mut dyn FnMut(&str)) {
    match value {
        Value::String(text) => visit(text),
        Value::Array(items) => items.iter().for_each(|v| visit_json(v, visit)),
        Value::Object(fields) => fields.values().for_each(|v| visit_json(v, visit)),
        _ => {}
    }
}

impl PromptText for RequestPrompt {
    fn for_each_text(&self, visit: &mut dyn FnMut(&str)) {
        if let Some(system) = self.body.get("system") {
            visit_content(system, visit);
        }
        if let Some(Value::Array(messages)) = self.body.get("messages") {
            for message in messages {
                if let Some(content) = message.get("content") {
                    visit_content(content, visit);
                }
                // OpenAI tool calls: arguments are a JSON string.
                if let Some(Value::Array(calls)) = message.get("tool_calls") {
                    for call in calls {
                        if let Some(Value::String(arguments)) =
                            call.get("function").and_then(|f| f.get("arguments"))
                        {
                            visit(arguments);
                        }
                    }
                }
            }
        }
        if let Some(prompt) = self.body.get("prompt") {
            visit_content(prompt, visit);
        }
    }

    fn for_each_other_text(&self, visit: &mut dyn FnMut(&str)) {
        // Tool and function definitions (names, descriptions, schemas), a structured-output
        // schema, the end-user id and metadata reach the model or the provider too.
        for key in ["tools", "functions", "response_format", "user", "metadata"] {
            if let Some(value) = self.body.get(key) {
                visit_json(value, visit);
            }
        }
        if let Some(Value::Array(messages)) = self.body.get("messages") {
            for message in messages {
                if let Some(Value::String(name)) = message.get("name") {
                    visit(name);
                }
            }
        }
    }

    fn user_turns(&self) -> usize {
        match self.body.get("messages") {
            Some(Value::Array(messages)) => messages
                .iter()
                .filter(|m| m.get("role").and_then(Value::as_str) == Some("user"))
                .count(),
            _ => usize::from(self.body.get("prompt").is_some()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(body: &str) -> (Vec<String>, usize) {
        let prompt = RequestPrompt::parse(body.as_bytes()).unwrap();
        let mut out = Vec::new();
        prompt.for_each_text(&mut |t| out.push(t.to_owned()));
        (out, prompt.user_turns())
    }

    #[test]
    fn reads_openai_anthropic_and_completion_text() {
        let (t, turns) = texts(
            r#"{"messages":[{"role":"system","content":"sys"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}}]},{"role":"assistant","content":null,"tool_calls":[{"function":{"name":"f","arguments":"{\"q\":1}"}}]},{"role":"user","content":"b"}]}"#,
        );
        assert_eq!(t, ["sys", "a", "{\"q\":1}", "b"]);
        assert_eq!(turns, 2);
        let (t, turns) = texts(
            r#"{"system":[{"type":"text","text":"s"}],"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"r"}]}]},{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"n","input":{"email":"e"}}]}]}"#,
        );
        assert_eq!(t, ["s", "r", "e"]);
        assert_eq!(turns, 1);
        let (t, turns) = texts(r#"{"prompt":["x","y"]}"#);
        assert_eq!(t, ["x", "y"]);
        assert_eq!(turns, 1);
    }

    #[test]
    fn other_strings_are_visited_apart_from_the_prompt() {
        let prompt = RequestPrompt::parse(
            br#"{"messages":[{"role":"user","name":"ann","content":"hi"}],"user":"u-1","metadata":{"k":"m"},"tools":[{"type":"function","function":{"name":"f","description":"d","parameters":{"properties":{"q":{"description":"p"}}}}}]}"#,
        )
        .unwrap();
        let mut main = Vec::new();
        prompt.for_each_text(&mut |t| main.push(t.to_owned()));
        assert_eq!(main, ["hi"]);
        let mut other = Vec::new();
        prompt.for_each_other_text(&mut |t| other.push(t.to_owned()));
        for expected in ["function", "f", "d", "p", "u-1", "m", "ann"] {
            assert!(
                other.iter().any(|t| t == expected),
                "{expected} in {other:?}"
            );
        }
    }
}
