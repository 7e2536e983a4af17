//! The typed model of an inference request body, OpenAI (chat, legacy completions) and
//! Anthropic (messages) alike, and OpenAI's Responses API ([`responses`]), parsed once per
//! request.
//!
//! The structs borrow from the body: a multi-megabyte prompt is not copied unless JSON escapes
//! force it, and no tree of values is built for it. Fields the gateway does not read are not
//! modelled: the body is forwarded as the client sent it (see [`crate::request`] for the byte
//! splices), so unknown fields pass through byte-exact. Nested values only some readers need
//! (tool definitions, tool inputs, a non-text content part) are kept as raw JSON and read here
//! on demand. Validation (what makes a 400), classification ([`PromptText`]), the chat template's
//! input and the routing summary all read this one model.

use std::borrow::Cow;

use serde::Deserialize;
use serde::de::Deserializer;
use serde_json::Value;
use serde_json::value::RawValue;
use switchyard_kv::chat_template::{TemplateInputs, TemplateValue};
use switchyard_kv::tokenize::{ChatMessage, MessageContent};

use crate::api::ApiError;

/// An inference request body (the union of the three formats' fields the gateway reads).
#[derive(Debug, Deserialize)]
pub struct RequestBody<'a> {
    #[serde(borrow, default)]
    pub model: Option<&'a RawValue>,
    /// `stream` as sent (`null` included): read through [`RequestBody::stream`]; the gateway
    /// rewrites it in place when it streams an answer the client asked for whole.
    #[serde(
        borrow,
        default,
        rename = "stream",
        deserialize_with = "boolean_or_null"
    )]
    pub raw_stream: Option<&'a RawValue>,
    /// OpenAI's `stream_options` as sent: see [`RequestBody::stream_options`].
    #[serde(
        borrow,
        default,
        rename = "stream_options",
        deserialize_with = "present"
    )]
    pub raw_stream_options: Option<&'a RawValue>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    /// vLLM's prefix-cache salt, as sent (`null` included: it is rewritten in place).
    #[serde(borrow, default, deserialize_with = "present")]
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
    /// vLLM's `add_special_tokens`, as sent: read through [`RequestBody::adds_special_tokens`].
    #[serde(borrow, default)]
    pub add_special_tokens: Option<&'a RawValue>,
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
    /// Sampling and stopping fields the translations carry over as they are.
    #[serde(borrow, default)]
    pub temperature: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub top_p: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub top_k: Option<&'a RawValue>,
    /// OpenAI: a string or strings.
    #[serde(borrow, default)]
    pub stop: Option<&'a RawValue>,
    /// Anthropic's `stop`.
    #[serde(borrow, default)]
    pub stop_sequences: Option<&'a RawValue>,
    /// OpenAI: choices asked for.
    #[serde(borrow, default)]
    pub n: Option<&'a RawValue>,
    /// A string (OpenAI) or an object (both).
    #[serde(borrow, default)]
    pub tool_choice: Option<&'a RawValue>,
    /// Pooling models: what `/v1/embeddings` and `/pooling` embed, and what `/v1/score` and
    /// `/v1/rerank` compare (strings, token ids, or multimodal parts).
    #[serde(borrow, default)]
    pub input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub text_1: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub text_2: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub query: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub documents: Option<&'a RawValue>,
    /// Responses API: the system text (see [`responses`] for `input`).
    #[serde(borrow, default)]
    pub instructions: Option<&'a RawValue>,
    /// Responses API fields, raw (read through [`RequestBody::responses_fields`] for that API
    /// only: on another endpoint they are the upstream's to judge).
    #[serde(borrow, default)]
    pub previous_response_id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub max_output_tokens: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub store: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub background: Option<&'a RawValue>,
    /// vLLM's `request_id`: on `/v1/responses`, the id the response gets.
    #[serde(borrow, default)]
    pub request_id: Option<&'a RawValue>,
    /// Set by the reader when the body is a Responses API request (`input` and
    /// `instructions` are then a conversation, not texts to embed).
    #[serde(skip)]
    pub is_responses: bool,
    /// The body this was read from ([`parse`] sets it): an Anthropic request is rendered from
    /// it whole, as vLLM converts it.
    #[serde(skip)]
    pub raw: &'a [u8],
    /// `raw` parsed keeping the order of object keys, once (see [`RequestBody::ordered`]).
    #[serde(skip)]
    ordered: std::sync::OnceLock<Option<TemplateValue>>,
    /// Responses API: the output format (`text.format`: text, json_object, json_schema).
    #[serde(borrow, default)]
    pub text: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub parallel_tool_calls: Option<&'a RawValue>,
    /// Responses API: a conversation object of OpenAI's (state the gateway cannot translate).
    #[serde(borrow, default)]
    pub conversation: Option<&'a RawValue>,
    /// Fields whose answer the gateway does not assemble from a stream (see
    /// [`RequestBody::assemblable`]): vLLM's beam search,
    #[serde(borrow, default)]
    pub use_beam_search: Option<&'a RawValue>,
    /// its prompt logprobs (refused with a stream),
    #[serde(borrow, default)]
    pub prompt_logprobs: Option<&'a RawValue>,
    /// its token ids (a stream carries them otherwise than a whole answer),
    #[serde(borrow, default)]
    pub return_token_ids: Option<&'a RawValue>,
    /// its disaggregated prefill's parameters (answered only whole),
    #[serde(borrow, default)]
    pub kv_transfer_params: Option<&'a RawValue>,
    /// logprobs (a chat stream leaves out the tokens its tool and reasoning parsers hold
    /// back; a completion's echoed prompt shifts a stream's text offsets),
    #[serde(borrow, default)]
    pub logprobs: Option<&'a RawValue>,
    /// and the prompt echoed.
    #[serde(borrow, default)]
    pub echo: Option<&'a RawValue>,
    /// Chat template inputs vLLM reads (see [`RequestBody::template_inputs`]).
    #[serde(borrow, default)]
    pub chat_template_kwargs: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub reasoning_effort: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub add_generation_prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub continue_final_message: Option<&'a RawValue>,
}

/// A field that is present, `null` included (serde's `Option` makes `null` absent): the
/// gateway rewrites these in place, and a `null` left after an added field would win.
fn present<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&'de RawValue>::deserialize(deserializer).map(Some)
}

/// A field that is present (`null` included, as [`present`]) and a boolean or `null`.
fn boolean_or_null<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<&'de RawValue>, D::Error> {
    let raw = <&'de RawValue>::deserialize(deserializer)?;
    match raw.get() {
        "true" | "false" | "null" => Ok(Some(raw)),
        _ => Err(serde::de::Error::invalid_type(
            serde::de::Unexpected::Other("a value"),
            &"a boolean",
        )),
    }
}

/// OpenAI's `stream_options` (`null` is taken as absent, as vLLM does).
#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// `stream_options` (an object, as sent) with `include_usage` set; `None` when it already was.
pub fn with_include_usage(options: &str) -> Result<Option<String>, ApiError> {
    let not_object = || ApiError::invalid("stream_options", "'stream_options' must be an object");
    let mut fields: serde_json::Map<String, Value> =
        serde_json::from_str(options).map_err(|_| not_object())?;
    if fields.get("include_usage") == Some(&Value::Bool(true)) {
        return Ok(None);
    }
    fields.insert("include_usage".into(), Value::Bool(true));
    Ok(Some(Value::Object(fields).to_string()))
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
    /// OpenAI assistant tool calls (`function.arguments` is a JSON string): see
    /// [`Message::tool_calls`].
    #[serde(borrow, default, rename = "tool_calls")]
    pub raw_tool_calls: Option<&'a RawValue>,
    /// OpenAI `tool` messages: the call answered.
    #[serde(borrow, default)]
    pub tool_call_id: Option<&'a RawValue>,
    /// vLLM's field for an assistant turn's reasoning (its chat template may render it), and
    /// the older name it renames.
    #[serde(borrow, default)]
    pub reasoning: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub reasoning_content: Option<&'a RawValue>,
}

/// One OpenAI tool call of an assistant message.
#[derive(Debug, Default, Deserialize)]
pub struct ToolCall<'a> {
    #[serde(borrow, default)]
    pub id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub function: Option<FunctionCall<'a>>,
}

#[derive(Debug, Default, Deserialize)]
pub struct FunctionCall<'a> {
    #[serde(borrow, default)]
    pub name: Option<&'a RawValue>,
    /// A JSON string holding the arguments (what OpenAI sends), or the arguments themselves.
    #[serde(borrow, default)]
    pub arguments: Option<&'a RawValue>,
}

impl FunctionCall<'_> {
    /// The arguments as the JSON text OpenAI streams them in (a string value), if they are one.
    pub fn arguments_text(&self) -> Option<String> {
        serde_json::from_str::<String>(self.arguments?.get()).ok()
    }

    /// The arguments as a JSON value: `None` when absent, `Err` when they are a string that is
    /// not JSON.
    pub fn arguments_value(&self) -> Option<Result<Value, serde_json::Error>> {
        let raw = self.arguments?;
        Some(if raw.get().starts_with('"') {
            serde_json::from_str::<String>(raw.get()).and_then(|text| serde_json::from_str(&text))
        } else {
            serde_json::from_str(raw.get())
        })
    }
}

/// A tool definition: Anthropic's fields at the top, OpenAI's under `function`.
#[derive(Debug, Default, Deserialize)]
pub struct ToolDefinition<'a> {
    #[serde(borrow, default)]
    pub name: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub description: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub input_schema: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub function: Option<FunctionDefinition<'a>>,
}

#[derive(Debug, Default, Deserialize)]
pub struct FunctionDefinition<'a> {
    #[serde(borrow, default)]
    pub name: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub description: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub parameters: Option<&'a RawValue>,
}

/// A `tool_choice` object of either API.
#[derive(Debug, Default, Deserialize)]
pub struct ToolChoice<'a> {
    #[serde(rename = "type", borrow, default)]
    pub kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub name: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub function: Option<FunctionDefinition<'a>>,
}

impl<'a> Message<'a> {
    /// The message's tool calls (none when absent, `null` or not an array of calls).
    pub fn tool_calls(&self) -> Vec<ToolCall<'a>> {
        self.raw_tool_calls
            .and_then(|raw| serde_json::from_str(raw.get()).ok())
            .unwrap_or_default()
    }
}

/// A parser's message without the values it quotes (`invalid type: string "..."`): errors are
/// logged, and a quoted value can be prompt text.
fn without_values(error: &serde_json::Error) -> String {
    let mut out = String::new();
    let mut quoted = false;
    for c in error.to_string().chars() {
        match (c, quoted) {
            ('"', false) => {
                quoted = true;
                out.push_str("\"…");
            }
            ('"', true) => {
                quoted = false;
                out.push('"');
            }
            (_, false) => out.push(c),
            (_, true) => {}
        }
    }
    out
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
    let mut request: RequestBody<'_> = serde_path_to_error::deserialize(&mut deserializer)
        .map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if inner.is_syntax() || inner.is_eof() {
                ApiError::invalid("body", format!("malformed JSON: {inner}"))
            } else if path == "." {
                ApiError::invalid(
                    "body",
                    format!("invalid request: {}", without_values(&inner)),
                )
            } else {
                let reason = without_values(&inner);
                ApiError::invalid("body", format!("invalid field '{path}': {reason}"))
            }
        })?;
    deserializer
        .end()
        .map_err(|e| ApiError::invalid("body", format!("malformed JSON: {e}")))?;
    request.raw = body;
    Ok(request)
}

/// A raw value as a tree (it was valid JSON when the body was parsed).
pub fn tree(raw: &RawValue) -> Value {
    serde_json::from_str(raw.get()).unwrap_or(Value::Null)
}

/// A raw value as a tree, `null` when absent.
pub fn tree_or_null(raw: Option<&RawValue>) -> Value {
    raw.map_or(Value::Null, tree)
}

/// One of two shapes.
#[derive(Debug)]
pub enum Either<L, R> {
    Left(L),
    Right(R),
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
    /// The requested model name: `Err` names what is wrong with it.
    pub fn model_name(&self) -> Result<(String, &'a RawValue), ApiError> {
        let raw = self
            .model
            .ok_or_else(|| ApiError::invalid("model", "missing required field 'model'"))?;
        let name: String = serde_json::from_str(raw.get())
            .map_err(|_| ApiError::invalid("model", "'model' must be a string"))?;
        if name.trim().is_empty() {
            return Err(ApiError::invalid("model", "'model' must not be empty"));
        }
        Ok((name, raw))
    }

    /// vLLM's `cache_salt`, checked as vLLM checks it: a non-empty string, or null for none.
    pub fn cache_salt_value(&self) -> Result<Option<(String, &'a RawValue)>, ApiError> {
        let Some(raw) = self.cache_salt.filter(|raw| raw.get() != "null") else {
            return Ok(None);
        };
        serde_json::from_str::<String>(raw.get())
            .ok()
            .filter(|salt| !salt.is_empty())
            .map(|salt| Some((salt, raw)))
            .ok_or_else(|| {
                ApiError::invalid(
                    "cache_salt",
                    "'cache_salt' must be a non-empty string if provided",
                )
            })
    }

    /// `stream`: `None` when absent or `null`.
    pub fn stream(&self) -> Option<bool> {
        match self.raw_stream.map(RawValue::get) {
            Some("true") => Some(true),
            Some("false") => Some(false),
            _ => None,
        }
    }

    /// Whether a worker's streamed answer to this request, assembled, carries what its whole
    /// answer would: not with beam search or prompt logprobs (vLLM answers them whole only),
    /// token ids or KV transfer parameters (a stream carries them otherwise or not at all),
    /// a chat's logprobs (its stream leaves out the tokens a tool or reasoning parser holds
    /// back) or logprobs of an echoed prompt (a stream's text offsets start over), nor when
    /// the client sent `stream_options` without streaming (the worker's to refuse).
    pub fn assemblable(&self) -> bool {
        let set =
            |raw: Option<&RawValue>| raw.is_some_and(|raw| !matches!(raw.get(), "null" | "false"));
        let echoed_logprobs = set(self.echo) && set(self.logprobs);
        !set(self.raw_stream_options)
            && !set(self.prompt_logprobs)
            && !set(self.use_beam_search)
            && !set(self.return_token_ids)
            && !set(self.kv_transfer_params)
            && self.logprobs.is_none_or(|raw| raw.get() != "true")
            && !echoed_logprobs
    }

    /// `stream_options` (absent or `null`: the defaults).
    pub fn stream_options(&self) -> Result<StreamOptions, ApiError> {
        match self.raw_stream_options.filter(|raw| raw.get() != "null") {
            None => Ok(StreamOptions::default()),
            Some(raw) => serde_json::from_str(raw.get()).map_err(|_| {
                ApiError::invalid("stream_options", "'stream_options' must be an object")
            }),
        }
    }

    /// Whether vLLM adds the tokenizer's special tokens (a BOS) to this request's prompt: its
    /// `add_special_tokens` when a boolean, else vLLM's default for the endpoint (true for a
    /// completions prompt, false for a chat's, whose template carries its own).
    pub fn adds_special_tokens(&self, by_default: bool) -> bool {
        match self.add_special_tokens.map(RawValue::get) {
            Some("true") => true,
            Some("false") => false,
            _ => by_default,
        }
    }

    /// Anthropic's `metadata.user_id`.
    pub fn metadata_user_id(&self) -> Option<&'a RawValue> {
        #[derive(Deserialize)]
        struct Metadata<'a> {
            #[serde(borrow, default)]
            user_id: Option<&'a RawValue>,
        }
        serde_json::from_str::<Metadata<'a>>(self.metadata?.get())
            .ok()?
            .user_id
    }

    /// The tool definitions (none when absent or not an array of objects).
    pub fn tool_definitions(&self) -> Result<Vec<ToolDefinition<'a>>, String> {
        match self.tools {
            None => Ok(Vec::new()),
            Some(raw) if raw.get() == "null" => Ok(Vec::new()),
            Some(raw) => {
                serde_json::from_str(raw.get()).map_err(|e| format!("invalid 'tools': {e}"))
            }
        }
    }

    /// `tool_choice`: a string (OpenAI's `auto`, `none`, `required`) or an object.
    pub fn tool_choice(&self) -> Option<Result<Either<Cow<'a, str>, ToolChoice<'a>>, String>> {
        let raw = self.tool_choice.filter(|raw| raw.get() != "null")?;
        Some(if raw.get().starts_with('"') {
            serde_json::from_str(raw.get())
                .map(Either::Left)
                .map_err(|e| e.to_string())
        } else {
            serde_json::from_str(raw.get())
                .map(Either::Right)
                .map_err(|e| format!("invalid 'tool_choice': {e}"))
        })
    }

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

    /// An OpenAI conversation as the chat template takes it: every message with its text
    /// (parts joined by newlines, as vLLM does for string templates; other parts as compact
    /// JSON so they still count as prompt content), its text parts, and the fields vLLM passes
    /// on (an assistant's tool calls and reasoning, a tool answer's call id, a name).
    pub fn chat_messages(&self) -> Vec<ChatMessage> {
        let mut out = Vec::new();
        for message in self.messages.iter().flatten() {
            let chat = ChatMessage::from_content(
                &message.role,
                message
                    .content
                    .as_ref()
                    .map_or(MessageContent::None, Content::message_content),
            );
            let raw = |name: &str| match name {
                "tool_calls" => message.raw_tool_calls,
                "tool_call_id" => message.tool_call_id,
                "name" => message.name,
                "reasoning" => message.reasoning,
                "reasoning_content" => message.reasoning_content,
                _ => None,
            };
            out.push(chat.with_openai_fields(|name| raw(name).and_then(template_value)));
        }
        out
    }

    /// The whole body as a chat template value (object keys in the order sent), parsed on
    /// first use and kept: an Anthropic request is converted from it for every pool that
    /// tokenizes it.
    pub fn ordered(&self) -> Option<&TemplateValue> {
        self.ordered
            .get_or_init(|| serde_json::from_slice(self.raw).ok())
            .as_ref()
    }

    /// What vLLM gives a chat template besides the messages: the request's tools,
    /// `documents`, `chat_template_kwargs`, `reasoning_effort`, `add_generation_prompt` and
    /// `continue_final_message` (see [`TemplateInputs::openai`]).
    pub fn template_inputs(&self) -> TemplateInputs {
        TemplateInputs::openai(|name| {
            let raw = match name {
                "tools" => self.tools,
                "documents" => self.documents,
                "chat_template_kwargs" => self.chat_template_kwargs,
                "reasoning_effort" => self.reasoning_effort,
                "add_generation_prompt" => self.add_generation_prompt,
                "continue_final_message" => self.continue_final_message,
                _ => None,
            };
            raw.and_then(template_value)
        })
    }
}

/// A raw JSON value as a chat template reads it (object keys in the order sent).
fn template_value(raw: &RawValue) -> Option<TemplateValue> {
    serde_json::from_str(raw.get()).ok()
}

mod content;

pub use content::{Content, ImageSource, ImageUrl, Part, PartFields};

pub mod answer;
mod classify;
pub mod responses;

#[cfg(test)]
mod tests;
