//! The typed model of an inference request body, OpenAI (chat, legacy completions) and
//! Anthropic (messages) alike, parsed once per request.
//!
//! The structs borrow from the body: a multi-megabyte prompt is not copied unless JSON escapes
//! force it, and no tree of values is built for it. Fields the gateway does not read are not
//! modelled: the body is forwarded as the client sent it (see [`crate::request`] for the byte
//! splices), so unknown fields pass through byte-exact. Nested values only some readers need
//! (tool definitions, tool inputs, a non-text content part) are kept as raw JSON and read here
//! on demand. Validation (what makes a 400), classification ([`PromptText`]), the chat template's
//! input and the routing summary all read this one model.

use std::borrow::Cow;
use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;
use serde_json::value::RawValue;
use switchyard_kv::tokenize::ChatMessage;
use switchyard_policy::classify::PromptText;

use crate::api::ApiError;

/// An inference request body (the union of the three formats' fields the gateway reads).
#[derive(Debug, Deserialize)]
pub struct RequestBody<'a> {
    #[serde(borrow, default)]
    pub model: Option<&'a RawValue>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    /// vLLM's prefix-cache salt, as sent (checked by [`crate::request::parse`]).
    #[serde(borrow, default)]
    pub cache_salt: Option<&'a RawValue>,
    /// Anthropic: the system prompt, a string or text blocks.
    #[serde(borrow, default)]
    pub system: Option<Content<'a>>,
    /// Chat Completions and Messages.
    #[serde(borrow, default)]
    pub messages: Option<Vec<Message<'a>>>,
    /// Legacy completions: a string, strings, token ids or batches of token ids.
    #[serde(borrow, default)]
    pub prompt: Option<&'a RawValue>,
    /// Text that reaches the model or the provider besides the messages.
    #[serde(borrow, default)]
    pub tools: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub functions: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub response_format: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub user: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub metadata: Option<&'a RawValue>,
}

/// OpenAI's `stream_options` (`null` is taken as absent, as vLLM does).
#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// One message of a conversation.
#[derive(Debug, Deserialize)]
pub struct Message<'a> {
    #[serde(borrow)]
    pub role: Cow<'a, str>,
    #[serde(borrow, default)]
    pub content: Option<Content<'a>>,
    #[serde(borrow, default)]
    pub name: Option<&'a RawValue>,
    /// OpenAI assistant tool calls (`function.arguments` is a JSON string).
    #[serde(borrow, default)]
    pub tool_calls: Option<&'a RawValue>,
}

/// Message content: a string, or an array of parts (OpenAI) or blocks (Anthropic).
#[derive(Debug)]
pub enum Content<'a> {
    Text(Cow<'a, str>),
    Parts(Vec<Part<'a>>),
    /// Anything else (left for the worker to refuse).
    Other,
}

/// One content part or block.
#[derive(Debug)]
pub struct Part<'a> {
    /// The part as sent.
    pub raw: &'a RawValue,
    pub fields: PartFields<'a>,
}

/// What the gateway reads of a part (all absent for a part that is not an object).
#[derive(Debug, Default, Deserialize)]
pub struct PartFields<'a> {
    #[serde(rename = "type", borrow, default)]
    pub kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub text: Option<Cow<'a, str>>,
    /// Anthropic `tool_result` blocks nest their content.
    #[serde(borrow, default)]
    pub content: Option<Content<'a>>,
    /// Anthropic `tool_use` blocks carry their arguments as `input`.
    #[serde(borrow, default)]
    pub input: Option<&'a RawValue>,
}

impl<'de: 'a, 'a> Deserialize<'de> for Content<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Content<'a>, D::Error> {
        struct ContentVisitor<'a>(std::marker::PhantomData<&'a ()>);

        impl<'de: 'a, 'a> Visitor<'de> for ContentVisitor<'a> {
            type Value = Content<'a>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or an array of content parts")
            }

            fn visit_borrowed_str<E: de::Error>(self, text: &'de str) -> Result<Content<'a>, E> {
                Ok(Content::Text(Cow::Borrowed(text)))
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<Content<'a>, E> {
                Ok(Content::Text(Cow::Owned(text.to_owned())))
            }

            fn visit_string<E: de::Error>(self, text: String) -> Result<Content<'a>, E> {
                Ok(Content::Text(Cow::Owned(text)))
            }

            fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<Content<'a>, S::Error> {
                let mut parts = Vec::new();
                while let Some(raw) = seq.next_element::<&'de RawValue>()? {
                    let fields = if raw.get().starts_with('{') {
                        serde_json::from_str(raw.get()).map_err(de::Error::custom)?
                    } else {
                        PartFields::default()
                    };
                    parts.push(Part { raw, fields });
                }
                Ok(Content::Parts(parts))
            }

            fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Content<'a>, M::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Content::Other)
            }

            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Content<'a>, E> {
                Ok(Content::Other)
            }

            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Content<'a>, E> {
                Ok(Content::Other)
            }

            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Content<'a>, E> {
                Ok(Content::Other)
            }

            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Content<'a>, E> {
                Ok(Content::Other)
            }
        }

        deserializer.deserialize_any(ContentVisitor(std::marker::PhantomData))
    }
}

/// Parse a request body. Errors name the field at fault, as the clients' own APIs do.
pub fn parse(body: &[u8]) -> Result<RequestBody<'_>, ApiError> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        return Err(ApiError::invalid(
            "body",
            if body.iter().all(u8::is_ascii_whitespace) {
                "request body is empty: send a JSON object with at least \"model\"".to_owned()
            } else {
                "request body must be a JSON object".to_owned()
            },
        ));
    }
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let request: RequestBody<'_> =
        serde_path_to_error::deserialize(&mut deserializer).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if inner.is_syntax() || inner.is_eof() {
                ApiError::invalid("body", format!("malformed JSON: {inner}"))
            } else if path == "." {
                ApiError::invalid("body", format!("invalid request: {inner}"))
            } else {
                ApiError::invalid("body", format!("invalid field '{path}': {inner}"))
            }
        })?;
    deserializer
        .end()
        .map_err(|e| ApiError::invalid("body", format!("malformed JSON: {e}")))?;
    Ok(request)
}

/// The text of a prompt (completions) as the worker takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput<'a> {
    Text(Cow<'a, str>),
    Texts(Vec<Cow<'a, str>>),
    Tokens(Vec<u32>),
    TokenBatches(Vec<Vec<u32>>),
}

impl<'a> RequestBody<'a> {
    /// The legacy completions `prompt`: `None` when absent, `Err` when it is none of the shapes
    /// vLLM takes.
    pub fn prompt_input(&self) -> Option<Result<PromptInput<'a>, String>> {
        let raw = self.prompt?;
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Shape<'a> {
            Text(#[serde(borrow)] Cow<'a, str>),
            Tokens(Vec<u32>),
            Texts(#[serde(borrow)] Vec<Cow<'a, str>>),
            TokenBatches(Vec<Vec<u32>>),
        }
        Some(match serde_json::from_str::<Shape<'a>>(raw.get()) {
            Ok(Shape::Text(text)) => Ok(PromptInput::Text(text)),
            Ok(Shape::Tokens(ids)) if !ids.is_empty() => Ok(PromptInput::Tokens(ids)),
            Ok(Shape::Texts(texts)) if !texts.is_empty() => Ok(PromptInput::Texts(texts)),
            Ok(Shape::TokenBatches(batches)) if !batches.is_empty() => {
                Ok(PromptInput::TokenBatches(batches))
            }
            _ => Err(
                "'prompt' must be a string, a non-empty array of strings, or token ids".to_owned(),
            ),
        })
    }

    /// The conversation as the chat template takes it: `system` first (Anthropic's, when
    /// `with_system`), then every message with its text (parts joined by newlines, as vLLM does
    /// for string templates; other parts as compact JSON so they still count as prompt content).
    pub fn chat_messages(&self, with_system: bool) -> Vec<ChatMessage> {
        let mut out = Vec::new();
        if let Some(system) = self.system.as_ref().filter(|_| with_system) {
            let text = system.template_text();
            if !text.is_empty() {
                out.push(ChatMessage {
                    role: "system".into(),
                    content: text,
                });
            }
        }
        for message in self.messages.iter().flatten() {
            out.push(ChatMessage {
                role: message.role.clone().into_owned(),
                content: message
                    .content
                    .as_ref()
                    .map_or_else(String::new, Content::template_text),
            });
        }
        out
    }
}

impl Content<'_> {
    fn template_text(&self) -> String {
        match self {
            Content::Text(text) => text.clone().into_owned(),
            Content::Parts(parts) => parts
                .iter()
                .map(|part| match &part.fields.text {
                    Some(text) => text.clone().into_owned(),
                    None => compact(part.raw),
                })
                .collect::<Vec<_>>()
                .join("\n"),
            Content::Other => String::new(),
        }
    }

    fn visit_text(&self, visit: &mut dyn FnMut(&str)) {
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

/// A raw value as compact JSON.
fn compact(raw: &RawValue) -> String {
    serde_json::from_str::<Value>(raw.get())
        .map_or_else(|_| raw.get().to_owned(), |v| v.to_string())
}

/// Every string inside a raw JSON value.
fn visit_strings(raw: &RawValue, visit: &mut dyn FnMut(&str)) {
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
            if let Some(calls) = message.tool_calls {
                #[derive(Deserialize)]
                struct Call<'a> {
                    #[serde(borrow, default)]
                    function: Option<Function<'a>>,
                }
                #[derive(Deserialize)]
                struct Function<'a> {
                    #[serde(borrow, default)]
                    arguments: Option<Cow<'a, str>>,
                }
                let calls: Vec<Call<'_>> = serde_json::from_str(calls.get()).unwrap_or_default();
                for arguments in calls
                    .iter()
                    .filter_map(|c| c.function.as_ref()?.arguments.as_ref())
                {
                    visit(arguments);
                }
            }
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
            None => usize::from(self.prompt.is_some()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(body: &str) -> (Vec<String>, Vec<String>, usize) {
        let request = parse(body.as_bytes()).unwrap();
        let mut main = Vec::new();
        request.for_each_text(&mut |t| main.push(t.to_owned()));
        let mut other = Vec::new();
        request.for_each_other_text(&mut |t| other.push(t.to_owned()));
        (main, other, request.user_turns())
    }

    #[test]
    fn reads_openai_anthropic_and_completion_text_like_the_policy_crate() {
        let bodies = [
            r#"{"model":"m","messages":[{"role":"system","content":"sys"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}}]},{"role":"assistant","content":null,"tool_calls":[{"function":{"name":"f","arguments":"{\"q\":1}"}}]},{"role":"user","content":"b","name":"bob"}],"tools":[{"type":"function","function":{"name":"lookup","description":"d"}}],"user":"u1"}"#,
            r#"{"model":"m","system":[{"type":"text","text":"s"}],"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"r"}]}]},{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"n","input":{"email":"e"}}]}],"metadata":{"user_id":"x"}}"#,
            r#"{"model":"m","prompt":["one","two"]}"#,
        ];
        for body in bodies {
            let policy = switchyard_policy::RequestPrompt::parse(body.as_bytes()).unwrap();
            let mut main = Vec::new();
            policy.for_each_text(&mut |t| main.push(t.to_owned()));
            let mut other = Vec::new();
            policy.for_each_other_text(&mut |t| other.push(t.to_owned()));
            other.sort();
            let (ours, mut ours_other, turns) = texts(body);
            ours_other.sort();
            assert_eq!(ours, main, "{body}");
            assert_eq!(ours_other, other, "{body}");
            assert_eq!(turns, policy.user_turns(), "{body}");
        }
        let (main, _, turns) = texts(bodies[0]);
        assert_eq!(main, ["sys", "a", "{\"q\":1}", "b"]);
        assert_eq!(turns, 2);
    }

    #[test]
    fn the_chat_template_gets_the_same_messages_as_from_a_value() {
        let body = r#"{"model":"m","system":"Be brief.","messages":[{"role":"user","content":[{"type":"text","text":"line\none"},{"type":"image_url","image_url":{"url":"data:x"}}]},{"role":"assistant","content":null}]}"#;
        let value: Value = serde_json::from_str(body).unwrap();
        let expected = switchyard_kv::tokenize::anthropic_messages(&value);
        let ours = parse(body.as_bytes()).unwrap().chat_messages(true);
        assert_eq!(
            ours.iter()
                .map(|m| (&m.role, &m.content))
                .collect::<Vec<_>>(),
            expected
                .iter()
                .map(|m| (&m.role, &m.content))
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn text_is_borrowed_unless_escapes_force_a_copy() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"plain"},{"role":"user","content":"esc\naped"}]}"#;
        let request = parse(body).unwrap();
        let messages = request.messages.unwrap();
        assert!(matches!(
            &messages[0].content,
            Some(Content::Text(Cow::Borrowed("plain")))
        ));
        assert!(
            matches!(&messages[1].content, Some(Content::Text(Cow::Owned(t))) if t == "esc\naped")
        );
    }

    #[test]
    fn prompt_shapes() {
        let shape = |prompt: &str| {
            let body = format!(r#"{{"model":"m","prompt":{prompt}}}"#);
            let request = parse(body.as_bytes()).unwrap();
            request.prompt_input().map(|r| r.map(|p| format!("{p:?}")))
        };
        assert_eq!(shape(r#""hi""#), Some(Ok(r#"Text("hi")"#.to_owned())));
        assert_eq!(shape("[1,2]"), Some(Ok("Tokens([1, 2])".to_owned())));
        assert_eq!(
            shape(r#"["a","b"]"#),
            Some(Ok(r#"Texts(["a", "b"])"#.to_owned()))
        );
        assert_eq!(
            shape("[[1],[2,3]]"),
            Some(Ok("TokenBatches([[1], [2, 3]])".to_owned()))
        );
        assert!(matches!(shape("[]"), Some(Err(_))));
        assert!(matches!(shape("7"), Some(Err(_))));
    }
}
