//! The typed model of answers, both APIs: whole responses, stream chunks (OpenAI) and stream
//! events (Anthropic), error bodies, and usage. The answer translations and the usage tap read
//! answers through these and nothing else.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use super::{Content, FunctionCall, PartFields, ToolCall};

/// `usage` as either API reports it (fields of both; absent ones are `None`).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct UsageFields {
    #[serde(default)]
    pub prompt_tokens: Option<u64>,
    #[serde(default)]
    pub completion_tokens: Option<u64>,
    #[serde(default)]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
    #[serde(default)]
    pub input_tokens: Option<u64>,
    #[serde(default)]
    pub output_tokens: Option<u64>,
    #[serde(default)]
    pub cache_read_input_tokens: Option<u64>,
    #[serde(default)]
    pub cache_creation_input_tokens: Option<u64>,
    /// Responses API: cached input, counted inside `input_tokens`.
    #[serde(default)]
    pub input_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct PromptTokensDetails {
    #[serde(default)]
    pub cached_tokens: Option<u64>,
}

impl UsageFields {
    /// OpenAI's cached prompt tokens.
    pub fn cached_tokens(&self) -> Option<u64> {
        self.prompt_tokens_details.as_ref()?.cached_tokens
    }

    /// Take the fields `later` reports (Anthropic streams report input first, output last).
    pub fn update(&mut self, later: &UsageFields) {
        macro_rules! take {
            ($($field:ident),*) => {$(
                if later.$field.is_some() {
                    self.$field = later.$field.clone();
                }
            )*};
        }
        take!(
            prompt_tokens,
            completion_tokens,
            prompt_tokens_details,
            input_tokens,
            output_tokens,
            cache_read_input_tokens,
            cache_creation_input_tokens,
            input_tokens_details
        );
    }
}

/// An error body: OpenAI's and Anthropic's `error.message`, `error` as a string, a top-level
/// `message`, or FastAPI's `detail` (a string, or its validation errors' `msg`s).
#[derive(Debug, Default, Deserialize)]
pub struct ErrorBody<'a> {
    #[serde(borrow, default)]
    pub error: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub message: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub detail: Option<&'a RawValue>,
}

#[derive(Debug, Default, Deserialize)]
struct ErrorObject<'a> {
    #[serde(borrow, default)]
    message: Option<Cow<'a, str>>,
}

/// One of FastAPI's validation errors: where (`["body", "max_tokens"]`) and what.
#[derive(Debug, Default, Deserialize)]
struct ValidationError<'a> {
    #[serde(borrow, default)]
    msg: Option<Cow<'a, str>>,
    #[serde(default)]
    loc: Vec<serde_json::Value>,
}

impl ValidationError<'_> {
    /// `body.max_tokens: Input should be a valid integer`.
    fn said(self) -> Option<String> {
        let msg = self.msg?;
        let at: Vec<String> = self
            .loc
            .iter()
            .map(|part| match part {
                serde_json::Value::String(name) => name.clone(),
                other => other.to_string(),
            })
            .collect();
        Some(if at.is_empty() {
            msg.into_owned()
        } else {
            format!("{}: {msg}", at.join("."))
        })
    }
}

impl ErrorBody<'_> {
    /// The message, wherever the body put it.
    pub fn message(&self) -> Option<String> {
        let from_error = self.error.and_then(|raw| {
            if raw.get().starts_with('"') {
                serde_json::from_str::<String>(raw.get()).ok()
            } else {
                serde_json::from_str::<ErrorObject<'_>>(raw.get())
                    .ok()?
                    .message
                    .map(Cow::into_owned)
            }
        });
        let from_detail = || {
            let raw = self.detail?.get();
            if raw.starts_with('"') {
                return serde_json::from_str::<String>(raw).ok();
            }
            let messages: Vec<String> = serde_json::from_str::<Vec<ValidationError<'_>>>(raw)
                .ok()?
                .into_iter()
                .filter_map(ValidationError::said)
                .collect();
            (!messages.is_empty()).then(|| messages.join("; "))
        };
        from_error
            .or_else(|| self.message.clone().map(Cow::into_owned))
            .or_else(from_detail)
    }
}

/// A whole OpenAI Chat Completions response.
#[derive(Debug, Default, Deserialize)]
pub struct ChatCompletion<'a> {
    #[serde(borrow, default)]
    pub id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub choices: Option<Vec<Choice<'a>>>,
    #[serde(default, deserialize_with = "usage_object")]
    pub usage: Option<UsageFields>,
}

#[derive(Debug, Default, Deserialize)]
pub struct Choice<'a> {
    #[serde(borrow, default)]
    pub message: Option<AssistantMessage<'a>>,
    #[serde(borrow, default)]
    pub finish_reason: Option<Cow<'a, str>>,
}

#[derive(Debug, Default, Deserialize)]
pub struct AssistantMessage<'a> {
    #[serde(borrow, default)]
    pub content: Option<Content<'a>>,
    #[serde(borrow, default)]
    pub tool_calls: Option<Vec<ToolCall<'a>>>,
}

/// One data payload of a stream, either API: an OpenAI chunk (`choices`, `usage`, `error`) or an
/// Anthropic event (`type`, `message`, `index`, `content_block`, `delta`, `usage`, `error`).
#[derive(Debug, Default, Deserialize)]
pub struct StreamData<'a> {
    #[serde(borrow, default)]
    pub id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub choices: Option<Vec<ChunkChoice<'a>>>,
    #[serde(default, deserialize_with = "usage_object")]
    pub usage: Option<UsageFields>,
    #[serde(borrow, default)]
    pub error: Option<&'a RawValue>,
    #[serde(rename = "type", borrow, default)]
    pub kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub message: Option<EventMessage<'a>>,
    #[serde(default)]
    pub index: Option<u64>,
    #[serde(borrow, default)]
    pub content_block: Option<PartFields<'a>>,
    #[serde(borrow, default)]
    pub delta: Option<EventDelta<'a>>,
    /// Responses API events: the response (`response.created`, `response.completed`, ...).
    #[serde(borrow, default)]
    pub response: Option<EventMessage<'a>>,
}

/// `usage` only when it is an object (`null` and other shapes count as absent).
fn usage_object<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<UsageFields>, D::Error> {
    let raw = Option::<&RawValue>::deserialize(deserializer)?;
    Ok(raw
        .filter(|raw| raw.get().starts_with('{'))
        .and_then(|raw| serde_json::from_str(raw.get()).ok()))
}

impl StreamData<'_> {
    /// The error's message, when the payload is an error.
    pub fn error_message(&self) -> Option<String> {
        self.error.map(|raw| {
            ErrorBody {
                error: Some(raw),
                ..ErrorBody::default()
            }
            .message()
            .unwrap_or_else(|| "upstream error".to_owned())
        })
    }

    /// The usage the payload reports: its own, or its message's (Anthropic `message_start`).
    pub fn reported_usage(&self) -> Option<&UsageFields> {
        self.usage
            .as_ref()
            .or_else(|| self.message.as_ref()?.usage.as_ref())
            .or_else(|| self.response.as_ref()?.usage.as_ref())
    }
}

#[derive(Debug, Default, Deserialize)]
pub struct ChunkChoice<'a> {
    #[serde(borrow, default)]
    pub delta: Option<ChunkDelta<'a>>,
    #[serde(borrow, default)]
    pub finish_reason: Option<Cow<'a, str>>,
}

#[derive(Debug, Default, Deserialize)]
pub struct ChunkDelta<'a> {
    #[serde(borrow, default)]
    pub content: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub tool_calls: Option<Vec<ToolCallDelta<'a>>>,
}

/// A piece of a streamed tool call.
#[derive(Debug, Default, Deserialize)]
pub struct ToolCallDelta<'a> {
    #[serde(default)]
    pub index: Option<u64>,
    #[serde(borrow, default)]
    pub id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub function: Option<FunctionCall<'a>>,
}

/// The message of Anthropic's `message_start`, or the response of a Responses API event.
#[derive(Debug, Default, Deserialize)]
pub struct EventMessage<'a> {
    #[serde(borrow, default)]
    pub id: Option<Cow<'a, str>>,
    #[serde(default, deserialize_with = "usage_object")]
    pub usage: Option<UsageFields>,
}

/// The delta of Anthropic's `content_block_delta` and `message_delta`.
#[derive(Debug, Default, Deserialize)]
pub struct EventDelta<'a> {
    #[serde(rename = "type", borrow, default)]
    pub kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub text: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub partial_json: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub stop_reason: Option<Cow<'a, str>>,
}

/// A whole Anthropic Messages response.
#[derive(Debug, Default, Deserialize)]
pub struct MessageResponse<'a> {
    #[serde(borrow, default)]
    pub id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub content: Option<Vec<PartFields<'a>>>,
    #[serde(borrow, default)]
    pub stop_reason: Option<Cow<'a, str>>,
    #[serde(default, deserialize_with = "usage_object")]
    pub usage: Option<UsageFields>,
}

/// What the usage tap reads of a whole answer, any API (and a Responses answer's id).
#[derive(Debug, Default, Deserialize)]
pub struct AnswerUsage {
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    pub object: Option<String>,
    #[serde(default, deserialize_with = "usage_object")]
    pub usage: Option<UsageFields>,
}

/// Parse a whole answer or a stream payload; `None` when it is not that shape.
pub fn parse<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Option<T> {
    serde_json::from_slice(bytes).ok()
}
