//! Rendering a conversation with a model's chat template the way vLLM does, so the gateway's
//! prompt text (and so its token ids and block hashes) is the worker's.
//!
//! Two halves, each following the code it mirrors:
//! - The Jinja environment is transformers' (`_cached_compile_jinja_template` and
//!   `render_jinja_template` in `transformers/utils/chat_template_utils.py`, 5.x, which vLLM 0.34
//!   calls through `apply_chat_template`): `trim_blocks` and `lstrip_blocks`, `tojson` as Python's
//!   `json.dumps` (no HTML escaping, `", "` and `": "` separators, `indent`, `separators`,
//!   `sort_keys`, `ensure_ascii`), `raise_exception`, `strftime_now`, Python's string and dict
//!   methods (`.strip()`, `.split()`, `.items()`), the `{% generation %}` block, the tokenizer's
//!   special tokens as variables (`bos_token`, `eos_token`, ...), and a message's reasoning under
//!   all three names (`thinking`, `reasoning_content`, `reasoning`).
//! - What the template is given is vLLM's (`vllm/renderers/chat_utils/chat_message.py` and
//!   `vllm/renderers/hf.py`, 0.34): each message's `role` and `content` (a string, or the text
//!   parts for a template that loops over a message's content), an assistant's `tool_calls` with
//!   their arguments as objects, a tool answer's `tool_call_id`, `name`; the request's `tools`
//!   (as vLLM's pydantic models dump them), `documents`, `add_generation_prompt`,
//!   `continue_final_message` and `chat_template_kwargs`.

use std::fmt::Write as _;

use indexmap::IndexMap;
use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

use crate::anthropic::AnthropicRendering;
use crate::tokenize::{ChatMessage, TokenizeError};

/// A value as a chat template sees it (parse JSON into one with `serde_json::from_str`: object
/// keys keep their order).
pub use minijinja::Value as TemplateValue;

const TEMPLATE_NAME: &str = "chat";

/// What vLLM passes a chat template besides the messages (`apply_chat_template`'s arguments).
#[derive(Debug, Clone)]
pub struct TemplateInputs {
    /// The request's tools, each as vLLM dumps `ChatCompletionToolsParam` (see [`openai_tools`]).
    pub tools: Option<Value>,
    pub documents: Option<Value>,
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    /// `chat_template_kwargs` and the request fields vLLM adds to them (`reasoning_effort`, and
    /// `enable_thinking` with it), in order; later ones win.
    pub kwargs: Vec<(String, Value)>,
}

impl Default for TemplateInputs {
    fn default() -> Self {
        TemplateInputs {
            tools: None,
            documents: None,
            add_generation_prompt: true,
            continue_final_message: false,
            kwargs: Vec::new(),
        }
    }
}

impl TemplateInputs {
    /// The inputs of an OpenAI Chat Completions request, `field(name)` giving one of its fields
    /// (parsed keeping the order of object keys: `tojson` prints them in that order). As
    /// `ChatCompletionRequest.build_chat_params`, `OnlineRenderer.preprocess_chat` and
    /// `ChatParams.with_defaults` merge them: `chat_template_kwargs` less its null and `"auto"`
    /// values, under `add_generation_prompt`, `continue_final_message`, `documents` and
    /// `reasoning_effort` (with `enable_thinking` unless the user set it), each of those four
    /// only when given (`"auto"` effort still turns thinking on); the user's `tools` over the
    /// request's. The gateway does not know a
    /// worker's `--default-chat-template-kwargs`.
    pub fn openai(field: impl Fn(&str) -> Option<Value>) -> TemplateInputs {
        let flag = |name: &str, default: bool| {
            field(name)
                .filter(|value| value.kind() == ValueKind::Bool)
                .map_or(default, |value| value.is_true())
        };
        let mut kwargs: Vec<(String, Value)> = Vec::new();
        let mut user_thinking = false;
        if let Some(user) = field("chat_template_kwargs")
            && user.kind() == ValueKind::Map
            && let Ok(keys) = user.try_iter()
        {
            for key in keys {
                if let (Some(name), Ok(value)) = (key.as_str(), user.get_item(&key)) {
                    user_thinking |= name == "enable_thinking";
                    if given(&value) && value.as_str() != Some("auto") {
                        kwargs.push((name.to_owned(), value));
                    }
                }
            }
        }
        let mut take = |name: &str| {
            let at = kwargs.iter().position(|(key, _)| key == name)?;
            Some(kwargs.remove(at).1)
        };
        let user_tools = take("tools");
        let user_documents = take("documents");
        // The request's own fields, which vLLM passes by name.
        take("add_generation_prompt");
        take("continue_final_message");
        let set = |kwargs: &mut Vec<(String, Value)>, name: &str, value: Value| {
            kwargs.retain(|(key, _)| key != name);
            kwargs.push((name.to_owned(), value));
        };
        if let Some(effort) = field("reasoning_effort").filter(given) {
            if !user_thinking {
                let thinking = effort.as_str() != Some("none");
                set(&mut kwargs, "enable_thinking", Value::from(thinking));
            }
            // "auto" is left out of the merge, the thinking it implies is not.
            if effort.as_str() != Some("auto") {
                set(&mut kwargs, "reasoning_effort", effort);
            }
        }
        let documents = field("documents").filter(given).or(user_documents);
        let tools = user_tools.or_else(|| {
            field("tools")
                .filter(|tools| tools.kind() == ValueKind::Seq)
                .map(|tools| openai_tools(&tools))
        });
        TemplateInputs {
            tools,
            documents,
            add_generation_prompt: flag("add_generation_prompt", true),
            continue_final_message: flag("continue_final_message", false),
            kwargs,
        }
    }
}

/// An OpenAI request's `tools` as vLLM hands them to the template: `[tool.model_dump() for tool
/// in request.tools]`, where `ChatCompletionToolsParam` keeps `type` and `function` (and
/// `defer_loading` when set), and `FunctionDefinition` keeps `name`, `description` and
/// `parameters` (null when absent) and `strict` and `defer_loading` when set; other keys are
/// dropped.
pub fn openai_tools(tools: &Value) -> Value {
    let items = tools.try_iter().map(|items| items.collect::<Vec<_>>());
    Value::from(
        items
            .unwrap_or_default()
            .into_iter()
            .map(|tool| {
                let attr = |value: &Value, name: &str| {
                    value.get_attr(name).ok().filter(|v| !v.is_undefined())
                };
                let set = |value: &Value, name: &str| attr(value, name).filter(given);
                let function = attr(&tool, "function").unwrap_or_default();
                let defer = set(&tool, "defer_loading");
                let mut dumped_function: IndexMap<Value, Value> = IndexMap::new();
                for name in ["name", "description", "parameters"] {
                    dumped_function.insert(
                        Value::from(name),
                        attr(&function, name).unwrap_or(Value::from(())),
                    );
                }
                if let Some(strict) = set(&function, "strict") {
                    dumped_function.insert(Value::from("strict"), strict);
                }
                if let Some(defer) = set(&function, "defer_loading").or_else(|| defer.clone()) {
                    dumped_function.insert(Value::from("defer_loading"), defer);
                }
                let mut dumped: IndexMap<Value, Value> = IndexMap::new();
                dumped.insert(
                    Value::from("type"),
                    attr(&tool, "type").unwrap_or(Value::from("function")),
                );
                dumped.insert(Value::from("function"), Value::from_object(dumped_function));
                if let Some(defer) = defer {
                    dumped.insert(Value::from("defer_loading"), defer);
                }
                Value::from_object(dumped)
            })
            .collect::<Vec<_>>(),
    )
}

/// An assistant message's `tool_calls` as vLLM leaves them: validated as OpenAI's
/// `ChatCompletionMessageToolCallParam` (keys `id`, `function` with `arguments` and `name`, and
/// `type`, in that order; others dropped), then by `_postprocess_messages` the arguments parsed
/// from their JSON string into an object (`{}` when empty, not JSON, or not an object). `None`
/// for an empty list (the message then renders as plain text) or anything but a list.
pub fn openai_tool_calls(calls: &Value) -> Option<Value> {
    if calls.kind() != ValueKind::Seq || calls.len() == Some(0) {
        return None;
    }
    let calls: Vec<Value> = calls.try_iter().ok()?.collect();
    Some(Value::from(
        calls
            .into_iter()
            .map(|call| {
                if call.kind() != ValueKind::Map {
                    return call;
                }
                let field = |value: &Value, name: &str| {
                    value.get_attr(name).ok().filter(|v| !v.is_undefined())
                };
                let mut out: IndexMap<Value, Value> = IndexMap::new();
                if let Some(id) = field(&call, "id") {
                    out.insert(Value::from("id"), id);
                }
                let function = field(&call, "function").unwrap_or_default();
                let mut dumped: IndexMap<Value, Value> = IndexMap::new();
                dumped.insert(
                    Value::from("arguments"),
                    object_arguments(&field(&function, "arguments").unwrap_or_default()),
                );
                if let Some(name) = field(&function, "name") {
                    dumped.insert(Value::from("name"), name);
                }
                out.insert(Value::from("function"), Value::from_object(dumped));
                out.insert(
                    Value::from("type"),
                    field(&call, "type").unwrap_or(Value::from("function")),
                );
                Value::from_object(out)
            })
            .collect::<Vec<_>>(),
    ))
}

fn object_arguments(arguments: &Value) -> Value {
    let parsed = match arguments.as_str() {
        Some("") => None,
        Some(text) => serde_json::from_str::<Value>(text).ok(),
        None if arguments.is_true() => Some(arguments.clone()),
        None => None,
    };
    parsed
        .filter(|value| value.kind() == ValueKind::Map)
        .unwrap_or_else(empty_object)
}

fn empty_object() -> Value {
    Value::from_object(IndexMap::<Value, Value>::new())
}

/// A compiled chat template and what vLLM decides about it once.
pub(crate) struct ChatTemplate {
    env: Environment<'static>,
    /// vLLM's "openai" content format (`_detect_content_format`): the template loops over a
    /// message's content, so content is given as a list of `{"type": "text", "text": ...}`.
    parts_content: bool,
    /// The template names the `developer` role (else vLLM renders those messages as `system`).
    developer_role: bool,
    /// `bos_token`, `eos_token`, ... (`special_tokens_map`), under the request's kwargs.
    special_tokens: Vec<(String, String)>,
    /// The template refuses a system message after the first (vLLM's Anthropic endpoint then
    /// merges them into the leading one).
    merge_inline_system: bool,
    /// vLLM's reasoning effort for Anthropic requests with thinking disabled, found on first use.
    disabled_thinking_effort: std::sync::OnceLock<&'static str>,
}

impl ChatTemplate {
    pub(crate) fn new(
        source: &str,
        special_tokens: Vec<(String, String)>,
    ) -> Result<ChatTemplate, TokenizeError> {
        let mut env = sandbox()?;
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, without_generation_tags(source))
            .map_err(TokenizeError::Template)?;
        Ok(ChatTemplate {
            env,
            parts_content: loops_over_content(source),
            developer_role: source.contains("\"developer\"") || source.contains("'developer'"),
            special_tokens,
            merge_inline_system: requires_system_first(source),
            disabled_thinking_effort: std::sync::OnceLock::new(),
        })
    }

    /// How vLLM's Anthropic endpoint treats this template (see [`AnthropicRendering`]).
    pub(crate) fn anthropic_rendering(&self) -> AnthropicRendering {
        AnthropicRendering {
            merge_inline_system: self.merge_inline_system,
            disabled_thinking_effort: self.disabled_thinking_effort(),
        }
    }

    /// vLLM's `DisabledThinkingEffortResolver._probe`: `"none"`, unless the template refuses it
    /// for a one-message chat, or renders it as it renders some thinking effort (then `"low"`).
    fn disabled_thinking_effort(&self) -> &'static str {
        self.disabled_thinking_effort.get_or_init(|| {
            let hi = [ChatMessage::new("user", "Hi")];
            let render = |effort: &str| {
                let inputs = TemplateInputs::openai(|name| match name {
                    "reasoning_effort" => Some(Value::from(effort)),
                    _ => None,
                });
                self.render(&hi, &inputs).ok()
            };
            let Some(none) = render("none") else {
                return "low";
            };
            let ignored = ["low", "medium", "high", "xhigh", "max"]
                .iter()
                .any(|effort| render(effort).as_ref() == Some(&none));
            if ignored { "low" } else { "none" }
        })
    }

    /// vLLM's content format for this template: `"openai"` when messages' content is given as
    /// parts, else `"string"`.
    pub(crate) fn content_format(&self) -> &'static str {
        if self.parts_content {
            "openai"
        } else {
            "string"
        }
    }

    pub(crate) fn set_special_tokens(&mut self, special_tokens: Vec<(String, String)>) {
        self.special_tokens = special_tokens;
    }

    pub(crate) fn render(
        &self,
        messages: &[ChatMessage],
        inputs: &TemplateInputs,
    ) -> Result<String, TokenizeError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(TokenizeError::Template)?;
        let mut conversation: Vec<IndexMap<Value, Value>> =
            messages.iter().map(|m| self.message_map(m)).collect();
        if !self.developer_role && messages.iter().any(|m| m.role == "developer") {
            conversation = developer_as_system(conversation);
        }
        // continue_final_message: the final message's text (its last text part) gets a tag,
        // and the render is cut where the tag is (transformers' `render_jinja_template`).
        let continue_tag = "CONTINUE_FINAL_MESSAGE_TAG ";
        if inputs.continue_final_message {
            let tagged = conversation
                .last_mut()
                .and_then(|last| last.get_mut(&Value::from("content")))
                .is_some_and(|content| tag_final_text(content, continue_tag));
            if !tagged {
                return Err(template_error(
                    "continue_final_message is set but the final message has no text to continue",
                ));
            }
        }
        let values: Vec<Value> = conversation.into_iter().map(Value::from_object).collect();
        let mut context: IndexMap<Value, Value> = IndexMap::new();
        for (name, token) in &self.special_tokens {
            context.insert(Value::from(name.as_str()), Value::from(token.as_str()));
        }
        for (name, value) in &inputs.kwargs {
            context.insert(Value::from(name.as_str()), value.clone());
        }
        context.insert(Value::from("messages"), Value::from(values));
        context.insert(
            Value::from("tools"),
            inputs.tools.clone().unwrap_or(Value::from(())),
        );
        context.insert(
            Value::from("documents"),
            inputs.documents.clone().unwrap_or(Value::from(())),
        );
        context.insert(
            Value::from("add_generation_prompt"),
            Value::from(inputs.add_generation_prompt),
        );
        let rendered = template
            .render(Value::from_object(context))
            .map_err(TokenizeError::Template)?;
        if !inputs.continue_final_message {
            return Ok(rendered);
        }
        let Some(at) = rendered.rfind(continue_tag.trim()) else {
            return Err(template_error(
                "continue_final_message is set but the final message does not appear in the chat",
            ));
        };
        let mut rendered = rendered;
        if rendered.get(at..at + continue_tag.len()) == Some(continue_tag) {
            rendered.truncate(at);
        } else {
            rendered.truncate(at);
            rendered.truncate(rendered.trim_end().len());
        }
        Ok(rendered)
    }

    /// One message as the template sees it, keys in the order vLLM builds them (then
    /// transformers' reasoning aliases: `thinking` first, `reasoning_content` last).
    fn message_map(&self, message: &ChatMessage) -> IndexMap<Value, Value> {
        let mut map: IndexMap<Value, Value> = IndexMap::new();
        let reasoning = message.reasoning.as_deref().map(Value::from);
        if let Some(reasoning) = &reasoning {
            map.insert(Value::from("thinking"), reasoning.clone());
        }
        map.insert(Value::from("role"), Value::from(message.role.as_str()));
        let content = if self.parts_content {
            let parts: Vec<Value> = match &message.parts {
                Some(parts) => parts.iter().map(|text| text_part(text)).collect(),
                None => vec![text_part(&message.content)],
            };
            // vLLM hands a tool answer's text parts over as one string.
            if message.role == "tool" {
                Value::from(message.content.as_str())
            } else {
                Value::from(parts)
            }
        } else {
            Value::from(message.content.as_str())
        };
        map.insert(Value::from("content"), content);
        if let Some(calls) = &message.tool_calls {
            map.insert(Value::from("tool_calls"), calls.clone());
        }
        if let Some(reasoning) = &reasoning {
            map.insert(Value::from("reasoning"), reasoning.clone());
        }
        if let Some(id) = &message.tool_call_id {
            map.insert(Value::from("tool_call_id"), id.clone());
        }
        if let Some(name) = &message.name {
            map.insert(Value::from("name"), Value::from(name.as_str()));
        }
        if let Some(reasoning) = reasoning {
            map.insert(Value::from("reasoning_content"), reasoning);
        }
        map
    }
}

/// Whether a field was given a value (not absent, not null).
pub(crate) fn given(value: &Value) -> bool {
    !value.is_none() && !value.is_undefined()
}

fn text_part(text: &str) -> Value {
    let mut part: IndexMap<Value, Value> = IndexMap::new();
    part.insert(Value::from("type"), Value::from("text"));
    part.insert(Value::from("text"), Value::from(text));
    Value::from_object(part)
}

fn template_error(message: &str) -> TokenizeError {
    TokenizeError::Template(Error::new(ErrorKind::InvalidOperation, message.to_owned()))
}

/// vLLM's `_convert_developer_to_system` then `_consolidate_system_messages`, on the
/// conversation as built for the template: developer messages become system ones, and system
/// messages anywhere but first are merged into one at the start, their texts (parts joined by
/// newlines) joined by a blank line, as a plain string.
fn developer_as_system(conversation: Vec<IndexMap<Value, Value>>) -> Vec<IndexMap<Value, Value>> {
    let role = Value::from("role");
    let is = |m: &IndexMap<Value, Value>, name: &str| {
        m.get(&role).and_then(|r| r.as_str().map(|r| r == name)) == Some(true)
    };
    let converted: Vec<IndexMap<Value, Value>> = conversation
        .into_iter()
        .map(|mut m| {
            if is(&m, "developer") {
                m.insert(role.clone(), Value::from("system"));
            }
            m
        })
        .collect();
    let systems = converted.iter().filter(|m| is(m, "system")).count();
    let first_is_system = converted.first().is_some_and(|m| is(m, "system"));
    if systems == 0 || (systems == 1 && first_is_system) {
        return converted;
    }
    let text = |content: Option<&Value>| -> String {
        let Some(content) = content else {
            return String::new();
        };
        if let Some(text) = content.as_str() {
            return text.to_owned();
        }
        content
            .try_iter()
            .map(|parts| {
                parts
                    .filter_map(|part| {
                        part.as_str().map(str::to_owned).or_else(|| {
                            part.get_attr("text")
                                .ok()
                                .and_then(|t| t.as_str().map(str::to_owned))
                        })
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .unwrap_or_default()
    };
    let texts: Vec<String> = converted
        .iter()
        .filter(|m| is(m, "system"))
        .map(|m| text(m.get(&Value::from("content"))))
        .filter(|t| !t.is_empty())
        .collect();
    let mut merged: IndexMap<Value, Value> = IndexMap::new();
    merged.insert(role.clone(), Value::from("system"));
    merged.insert(Value::from("content"), Value::from(texts.join("\n\n")));
    std::iter::once(merged)
        .chain(converted.into_iter().filter(|m| !is(m, "system")))
        .collect()
}

/// Append `tag` to a message's content: a string, or the last part with a `text` (transformers'
/// `continue_final_message`). False when there is no text to continue.
fn tag_final_text(content: &mut Value, tag: &str) -> bool {
    if let Some(text) = content.as_str() {
        *content = Value::from(format!("{text}{tag}"));
        return true;
    }
    let Ok(parts) = content.try_iter() else {
        return false;
    };
    let mut parts: Vec<Value> = parts.collect();
    let Some(last_text) = parts
        .iter()
        .rposition(|part| part.get_attr("text").is_ok_and(|t| !t.is_undefined()))
    else {
        return false;
    };
    let Some(part) = parts.get_mut(last_text) else {
        return false;
    };
    let mut tagged: IndexMap<Value, Value> = IndexMap::new();
    if let Ok(keys) = part.try_iter() {
        for key in keys {
            let value = part.get_item(&key).unwrap_or_default();
            let value = if key.as_str() == Some("text") {
                Value::from(format!("{}{tag}", value.as_str().unwrap_or_default()))
            } else {
                value
            };
            tagged.insert(key, value);
        }
    }
    *part = Value::from_object(tagged);
    *content = Value::from(parts);
    true
}

/// Jinja2's sandbox as transformers and vLLM's probes configure it: `trim_blocks`,
/// `lstrip_blocks`, Python's string and dict methods (the rest of transformers' globals are
/// [`ChatTemplate::new`]'s).
fn sandbox() -> Result<Environment<'static>, TokenizeError> {
    let mut env = Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(TokenizeError::Template)?,
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    Ok(env)
}

/// vLLM's `_detect_merge_inline_system`: whether rendering system, user, system, user fails in
/// a plain sandboxed environment (`trim_blocks`, `lstrip_blocks`, loop controls; no
/// `raise_exception`, so a template that calls it fails too).
fn requires_system_first(source: &str) -> bool {
    if source.is_empty() {
        return true;
    }
    let Ok(mut env) = sandbox() else {
        return true;
    };
    // As written: vLLM's probe environment knows no `{% generation %}` tag either.
    if env
        .add_template_owned(TEMPLATE_NAME, source.to_owned())
        .is_err()
    {
        return true;
    }
    let message = |role: &str| {
        let mut m: IndexMap<Value, Value> = IndexMap::new();
        m.insert(Value::from("role"), Value::from(role));
        m.insert(Value::from("content"), Value::from("t"));
        Value::from_object(m)
    };
    let mut context: IndexMap<Value, Value> = IndexMap::new();
    context.insert(
        Value::from("messages"),
        Value::from(vec![
            message("system"),
            message("user"),
            message("system"),
            message("user"),
        ]),
    );
    context.insert(Value::from("add_generation_prompt"), Value::from(false));
    env.get_template(TEMPLATE_NAME)
        .and_then(|template| template.render(Value::from_object(context)))
        .is_err()
}

/// The template with transformers' `{% generation %}` ... `{% endgeneration %}` (its assistant
/// mask marker, which renders its body) as an always-true `if`, whitespace control kept.
fn without_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let (before, tag) = rest.split_at(start);
        out.push_str(before);
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let (tag, after) = tag.split_at(end + 2);
        let inner = tag
            .trim_start_matches("{%")
            .trim_end_matches("%}")
            .trim_start_matches(['-', '+'])
            .trim_end_matches(['-', '+'])
            .trim();
        let open = tag
            .get(..3)
            .filter(|o| o.ends_with(['-', '+']))
            .unwrap_or("{%");
        let close = tag
            .get(tag.len() - 3..)
            .filter(|c| c.starts_with(['-', '+']))
            .unwrap_or("%}");
        match inner {
            "generation" => write!(out, "{open} if true {close}"),
            "endgeneration" => write!(out, "{open} endif {close}"),
            _ => write!(out, "{tag}"),
        }
        .ok();
        rest = after;
    }
    out.push_str(rest);
    out
}

/// Whether the template loops over a message's content (vLLM's `_detect_content_format`
/// finds such a `for` in the template's syntax tree; this reads the tags): a `for` over
/// `X['content']`, `X["content"]` or `X.content` where `X` is a loop variable over the
/// messages (or over a variable set from them), or over a variable named `content` (vLLM: one
/// outside a macro; aliases through namespaces and macro parameters are not followed here).
fn loops_over_content(source: &str) -> bool {
    let tags = block_tags(source);
    let mut conversations = vec!["messages".to_owned()];
    // Variables set from the messages (`set loop_messages = messages[1:]`), transitively.
    loop {
        let before = conversations.len();
        for tag in &tags {
            if let Some((name, value)) = tag
                .strip_prefix("set ")
                .and_then(|rest| rest.split_once('='))
            {
                let name = name.trim();
                if is_identifier(name)
                    && !conversations.iter().any(|c| c == name)
                    && conversations
                        .iter()
                        .any(|c| reads_variable(value.trim(), c))
                {
                    conversations.push(name.to_owned());
                }
            }
        }
        if conversations.len() == before {
            break;
        }
    }
    let loops: Vec<(&str, &str)> = tags
        .iter()
        .filter_map(|tag| {
            let rest = tag.strip_prefix("for ")?;
            let (target, iterable) = rest.split_once(" in ")?;
            // `for x in xs if cond` and `for x in xs recursive`: the iterable is `xs`.
            let iterable = iterable.split(" if ").next().unwrap_or(iterable).trim();
            let iterable = iterable.strip_suffix(" recursive").unwrap_or(iterable);
            Some((target.trim(), iterable.trim()))
        })
        .collect();
    let items: Vec<&str> = loops
        .iter()
        .filter(|(_, iterable)| conversations.iter().any(|c| reads_variable(iterable, c)))
        .map(|(target, _)| *target)
        .filter(|target| is_identifier(target))
        .collect();
    loops.iter().any(|(_, iterable)| {
        *iterable == "content"
            || items.iter().any(|item| {
                ["['content']", "[\"content\"]", ".content"]
                    .iter()
                    .any(|access| reads_variable(iterable, &format!("{item}{access}")))
            })
    })
}

/// The inside of every `{% ... %}` tag, whitespace control and outer spaces removed.
fn block_tags(source: &str) -> Vec<&str> {
    let mut tags = Vec::new();
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let Some(after_open) = rest.get(start + 2..) else {
            break;
        };
        let Some(end) = after_open.find("%}") else {
            break;
        };
        let inner = after_open.get(..end).unwrap_or_default();
        tags.push(inner.trim_matches(['-', '+']).trim());
        rest = after_open.get(end + 2..).unwrap_or_default();
    }
    tags
}

fn is_identifier(name: &str) -> bool {
    !name.is_empty()
        && name.chars().all(|c| c.is_alphanumeric() || c == '_')
        && !name.starts_with(|c: char| c.is_ascii_digit())
}

/// Whether `expression` is `variable`, or `variable` followed by a slice, a filter or a test
/// (not by more of a name, or an attribute or item of it).
fn reads_variable(expression: &str, variable: &str) -> bool {
    let Some(rest) = expression.strip_prefix(variable) else {
        return false;
    };
    let rest = rest.trim_start();
    rest.is_empty()
        || rest.starts_with('|')
        || rest.starts_with(" is ")
        || rest.starts_with("is ")
        || rest.starts_with("[:")
        || rest.starts_with("[::")
        || rest
            .strip_prefix('[')
            .is_some_and(|slice| slice.split(']').next().is_some_and(|s| s.contains(':')))
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// transformers' `strftime_now`: the local time in a `strftime` format.
fn strftime_now(format: String) -> Result<Value, Error> {
    let items: Vec<chrono::format::Item> = chrono::format::StrftimeItems::new(&format).collect();
    if items.contains(&chrono::format::Item::Error) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format {format:?}"),
        ));
    }
    let mut out = String::new();
    write!(
        out,
        "{}",
        chrono::Local::now().format_with_items(items.into_iter())
    )
    .map_err(|_| Error::new(ErrorKind::InvalidOperation, "strftime_now failed"))?;
    Ok(Value::from(out))
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, arguments by position or by name.
fn tojson(value: Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let arg = |index: usize, name: &str| -> Result<Option<Value>, Error> {
        let named: Option<Value> = kwargs.get(name)?;
        Ok(named.or_else(|| args.get(index).cloned()))
    };
    let ensure_ascii = arg(0, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let indent = match arg(1, "indent")? {
        Some(indent) if indent.is_none() || indent.is_undefined() => None,
        Some(indent) => Some(match indent.as_str() {
            Some(text) => text.to_owned(),
            None => " ".repeat(usize::try_from(indent.as_i64().unwrap_or(0)).unwrap_or(0)),
        }),
        None => None,
    };
    let (item_separator, key_separator) = match arg(2, "separators")? {
        Some(pair) if pair.kind() == ValueKind::Seq => (
            pair.get_item(&Value::from(0))?
                .as_str()
                .unwrap_or(",")
                .to_owned(),
            pair.get_item(&Value::from(1))?
                .as_str()
                .unwrap_or(":")
                .to_owned(),
        ),
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let sort_keys = arg(3, "sort_keys")?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let options = JsonOptions {
        ensure_ascii,
        indent,
        item_separator,
        key_separator,
        sort_keys,
    };
    let mut out = String::new();
    python_json(&value, &options, 0, &mut out)?;
    Ok(Value::from(out))
}

struct JsonOptions {
    ensure_ascii: bool,
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
}

/// Python's `json.dumps` of one value.
#[cfg(test)]
pub(crate) fn python_json_string(value: &Value) -> Result<String, Error> {
    let options = JsonOptions {
        ensure_ascii: false,
        indent: None,
        item_separator: ", ".into(),
        key_separator: ": ".into(),
        sort_keys: false,
    };
    let mut out = String::new();
    python_json(value, &options, 0, &mut out)?;
    Ok(out)
}

fn python_json(
    value: &Value,
    options: &JsonOptions,
    depth: usize,
    out: &mut String,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => python_number(value, out),
        ValueKind::String => python_string(value.as_str().unwrap_or_default(), options, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            python_container(out, options, depth, '[', ']', items.len(), |i, out| {
                let item = items.get(i).cloned().unwrap_or_default();
                python_json(&item, options, depth + 1, out)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if options.sort_keys {
                keys.sort_by_key(key_text);
            }
            python_container(out, options, depth, '{', '}', keys.len(), |i, out| {
                let key = keys.get(i).cloned().unwrap_or_default();
                python_string(&key_text(&key), options, out);
                out.push_str(&options.key_separator);
                python_json(&value.get_item(&key)?, options, depth + 1, out)
            })?;
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("Object of type {kind} is not JSON serializable"),
            ));
        }
    }
    Ok(())
}

/// A dict key as `json.dumps` writes it: strings as they are, numbers and booleans as text.
fn key_text(key: &Value) -> String {
    match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_owned(),
        ValueKind::None | ValueKind::Undefined => "null".into(),
        ValueKind::Bool => if key.is_true() { "true" } else { "false" }.into(),
        ValueKind::Number => {
            let mut text = String::new();
            python_number(key, &mut text);
            text
        }
        _ => key.to_string(),
    }
}

fn python_container(
    out: &mut String,
    options: &JsonOptions,
    depth: usize,
    open: char,
    close: char,
    len: usize,
    mut item: impl FnMut(usize, &mut String) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(indent) = &options.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    };
    for i in 0..len {
        if i > 0 {
            out.push_str(&options.item_separator);
        }
        newline(out, depth + 1);
        item(i, out)?;
    }
    newline(out, depth);
    out.push(close);
    Ok(())
}

/// Python's `repr` of an int or a float (`json.dumps` writes floats with `float.__repr__`).
fn python_number(value: &Value, out: &mut String) {
    if value.is_integer() {
        out.push_str(&value.to_string());
        return;
    }
    let Ok(number) = f64::try_from(value.clone()) else {
        out.push_str(&value.to_string());
        return;
    };
    if number.is_nan() {
        out.push_str("NaN");
    } else if number.is_infinite() {
        out.push_str(if number > 0.0 {
            "Infinity"
        } else {
            "-Infinity"
        });
    } else {
        out.push_str(&python_float_repr(number));
    }
}

/// `float.__repr__`: the shortest digits that read back as the same float, in positional
/// notation when the decimal exponent is in [-4, 16), else as `d.ddde+XX`.
fn python_float_repr(number: f64) -> String {
    // Rust's `{:e}` gives the same shortest digits: "1.2345e-7", "1e16", "-3.5e0".
    let scientific = format!("{number:e}");
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if negative { "-" } else { "" };
    if (-4..16).contains(&exponent) {
        let point = exponent + 1;
        let text = if point <= 0 {
            format!("0.{}{}", "0".repeat(point.unsigned_abs() as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            let (whole, fraction) = digits.split_at(point as usize);
            format!("{whole}.{fraction}")
        };
        format!("{sign}{text}")
    } else {
        let (first, rest) = digits.split_at(1.min(digits.len()));
        let fraction = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let exponent_sign = if exponent < 0 { '-' } else { '+' };
        format!(
            "{sign}{first}{fraction}e{exponent_sign}{:02}",
            exponent.unsigned_abs()
        )
    }
}

/// A JSON string as `json.dumps` writes it: `"`, `\` and control characters escaped (`\n`,
/// `\r`, `\t`, `\b`, `\f`, else `\u00XX`); with `ensure_ascii` every non-ASCII character too,
/// as `\uXXXX` (surrogate pairs beyond the BMP).
fn python_string(text: &str, options: &JsonOptions, out: &mut String) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (options.ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    write!(out, "\\u{unit:04x}").ok();
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// The special tokens of a `tokenizer_config.json` (`bos_token`, ... as strings or as
/// `{"content": ...}`), as transformers' `special_tokens_map` names them.
pub(crate) fn special_tokens_of_config(config: &serde_json::Value) -> Vec<(String, String)> {
    [
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
    ]
    .iter()
    .filter_map(|name| {
        let token = config.get(*name)?;
        let text = token
            .as_str()
            .or_else(|| token.get("content").and_then(serde_json::Value::as_str))?;
        Some(((*name).to_owned(), text.to_owned()))
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Value {
        serde_json::from_str(json).unwrap_or_default()
    }

    fn render(template: &str, messages: &[ChatMessage], inputs: &TemplateInputs) -> String {
        ChatTemplate::new(template, vec![("bos_token".into(), "<s>".into())])
            .and_then(|t| t.render(messages, inputs))
            .unwrap_or_else(|e| format!("error: {e}"))
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let value = parse(r#"{"b": [1, 2.5, 1e-7, 1e16, 100.0, true, null], "a": "é\n\"<>&"}"#);
        assert_eq!(
            python_json_string(&value).ok().as_deref(),
            Some(r#"{"b": [1, 2.5, 1e-07, 1e+16, 100.0, true, null], "a": "é\n\"<>&"}"#)
        );
        let template = "{{ x | tojson(indent=2, sort_keys=true) }}|{{ x | tojson(ensure_ascii=true, separators=[',', ':']) }}";
        let env = ChatTemplate::new(template, Vec::new()).ok();
        let mut context: IndexMap<Value, Value> = IndexMap::new();
        context.insert(Value::from("x"), value);
        let rendered = env
            .as_ref()
            .and_then(|t| t.env.get_template(TEMPLATE_NAME).ok())
            .and_then(|t| t.render(Value::from_object(context)).ok());
        assert_eq!(
            rendered.as_deref(),
            Some(
                "{\n  \"a\": \"é\\n\\\"<>&\",\n  \"b\": [\n    1,\n    2.5,\n    1e-07,\n    1e+16,\n    100.0,\n    true,\n    null\n  ]\n}|{\"b\":[1,2.5,1e-07,1e+16,100.0,true,null],\"a\":\"\\u00e9\\n\\\"<>&\"}"
            )
        );
        assert_eq!(python_float_repr(0.0001), "0.0001");
        assert_eq!(python_float_repr(-123456.789), "-123456.789");
        assert_eq!(python_float_repr(1.5e300), "1.5e+300");
    }

    #[test]
    fn blocks_are_trimmed_as_transformers_does() {
        let template = "{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content.strip() }}]\n  {% endif %}\n{% endfor %}\n{{ bos_token }}{% generation %}{{ messages|length }}{% endgeneration %}\n";
        let messages = [
            ChatMessage::new("user", "  hi  "),
            ChatMessage::new("assistant", "x"),
        ];
        assert_eq!(
            render(template, &messages, &TemplateInputs::default()),
            "[hi]\n<s>2"
        );
        assert!(
            render(
                "{{ raise_exception('roles must alternate') }}",
                &messages,
                &TemplateInputs::default()
            )
            .contains("roles must alternate")
        );
    }

    #[test]
    fn tools_and_tool_calls_are_given_as_vllm_dumps_them() {
        let tools = openai_tools(&parse(
            r#"[{"type": "function", "function": {"name": "f", "parameters": {"z": 1, "a": 2}, "extra": 3}}]"#,
        ));
        assert_eq!(
            python_json_string(&tools).ok().as_deref(),
            Some(
                r#"[{"type": "function", "function": {"name": "f", "description": null, "parameters": {"z": 1, "a": 2}}}]"#
            )
        );
        let calls = openai_tool_calls(&parse(
            r#"[{"type": "function", "id": "c1", "function": {"name": "f", "arguments": "{\"q\": \"x\", \"a\": 1}", "x": 2}, "index": 0},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]"#,
        ));
        assert_eq!(
            calls
                .as_ref()
                .and_then(|c| python_json_string(c).ok())
                .as_deref(),
            Some(
                r#"[{"id": "c1", "function": {"arguments": {"q": "x", "a": 1}, "name": "f"}, "type": "function"}, {"id": "c2", "function": {"arguments": {}, "name": "g"}, "type": "function"}]"#
            )
        );
        assert!(openai_tool_calls(&parse("[]")).is_none());
    }

    #[test]
    fn request_fields_become_template_kwargs_as_vllm_merges_them() {
        let request = parse(
            r#"{"chat_template_kwargs": {"enable_thinking": false, "add_generation_prompt": true, "x": 1, "y": null, "z": "auto", "documents": [1]},
                "reasoning_effort": "high", "continue_final_message": true, "add_generation_prompt": false}"#,
        );
        let inputs = TemplateInputs::openai(|name| request.get_attr(name).ok());
        assert!(!inputs.add_generation_prompt);
        assert!(inputs.continue_final_message);
        assert_eq!(
            inputs.documents.map(|d| d.to_string()).as_deref(),
            Some("[1]")
        );
        let kwargs: Vec<String> = inputs
            .kwargs
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        assert_eq!(
            kwargs,
            ["enable_thinking=False", "x=1", "reasoning_effort=high"]
        );
        let none = parse(r#"{"reasoning_effort": "none"}"#);
        let inputs = TemplateInputs::openai(|name| none.get_attr(name).ok());
        assert!(inputs.add_generation_prompt);
        assert_eq!(
            inputs
                .kwargs
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>(),
            ["enable_thinking=False", "reasoning_effort=none"]
        );
    }

    #[test]
    fn content_is_given_as_parts_to_a_template_that_loops_over_it() {
        let loops = "{% for message in messages %}{% for part in message['content'] %}{{ part.text }};{% endfor %}{% endfor %}";
        let mut parted = ChatMessage::new("user", "a\nb");
        parted.parts = Some(vec!["a".into(), "b".into()]);
        let messages = [parted, ChatMessage::new("assistant", "c")];
        assert_eq!(
            render(loops, &messages, &TemplateInputs::default()),
            "a;b;c;"
        );
        assert!(loops_over_content(
            "{%- set msgs = messages[1:] %}{% for m in msgs %}{% for c in m.content | selectattr('type') %}{% endfor %}{% endfor %}"
        ));
        assert!(!loops_over_content(
            "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        ));
        assert!(!loops_over_content(crate::tokenize::SHIPPED_CHAT_TEMPLATE));
    }

    #[test]
    fn developer_messages_become_one_system_message_where_the_template_has_no_such_role() {
        let template = "{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}";
        let messages = [
            ChatMessage::new("system", "s"),
            ChatMessage::new("user", "u"),
            ChatMessage::new("developer", "d"),
        ];
        assert_eq!(
            render(template, &messages, &TemplateInputs::default()),
            "system:s\n\nd|user:u|"
        );
        let named = "{# 'developer' #}".to_owned() + template;
        assert_eq!(
            render(&named, &messages, &TemplateInputs::default()),
            "system:s|user:u|developer:d|"
        );
    }

    #[test]
    fn a_final_message_is_continued_where_it_ends() {
        let template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";
        let messages = [
            ChatMessage::new("user", "Hi"),
            ChatMessage::new("assistant", "Hello, I"),
        ];
        let inputs = TemplateInputs {
            add_generation_prompt: false,
            continue_final_message: true,
            ..TemplateInputs::default()
        };
        assert_eq!(
            render(template, &messages, &inputs),
            "<user>Hi</s>\n<assistant>Hello, I"
        );
    }
}
