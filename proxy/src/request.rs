//! Reading the request JSON: validate what routing needs, and rewrite the model name in place.
//!
//! The body is scanned once with borrowed views (no tree of values is built for a multi-megabyte
//! prompt), and the model name is replaced by splicing bytes so everything else reaches the worker
//! exactly as the client sent it.

use std::ops::Range;

use bytes::{Bytes, BytesMut};

use crate::api::{ApiError, Endpoint};
use crate::wire::{self, Message, RequestBody};

/// What routing needs from a request body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedRequest {
    /// The model the client asked for.
    pub model: String,
    pub stream: bool,
    /// `max_tokens`, or OpenAI's newer `max_completion_tokens`.
    pub max_tokens: Option<u64>,
    /// vLLM's `cache_salt` as the client sent it.
    pub cache_salt: Option<String>,
    /// `stream_options.include_usage` is set: the client wants usage in its stream.
    pub asks_stream_usage: bool,
    /// Byte range of the `"model"` value (quotes included) in the body.
    model_span: Range<usize>,
    /// Byte range of the `"cache_salt"` value, when there is one.
    cache_salt_span: Option<Range<usize>>,
    /// Where a new first field goes: just after the object's opening brace.
    object_start: usize,
}

/// Parse and validate a request body for `endpoint` (tests and tools; the gateway parses once
/// with [`wire::parse`] and summarises with [`summarise`]).
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<ParsedRequest, ApiError> {
    summarise(endpoint, body, &wire::parse(body)?)
}

/// Validate a parsed request for `endpoint` and summarise what routing needs. `body` is the
/// bytes `head` was parsed from (for the byte ranges of the fields the gateway rewrites).
pub fn summarise(
    endpoint: Endpoint,
    body: &[u8],
    head: &RequestBody<'_>,
) -> Result<ParsedRequest, ApiError> {
    let raw_model = head
        .model
        .ok_or_else(|| ApiError::invalid("model", "missing required field 'model'"))?;
    let model: String = serde_json::from_str(raw_model.get())
        .map_err(|_| ApiError::invalid("model", "'model' must be a string"))?;
    if model.trim().is_empty() {
        return Err(ApiError::invalid("model", "'model' must not be empty"));
    }

    match endpoint {
        Endpoint::ChatCompletions => require_messages(head.messages.as_deref())?,
        Endpoint::Messages => {
            require_messages(head.messages.as_deref())?;
            match head.max_tokens {
                Some(0) => {
                    return Err(ApiError::invalid(
                        "max_tokens",
                        "'max_tokens' must be at least 1",
                    ));
                }
                Some(_) => {}
                None => {
                    return Err(ApiError::invalid(
                        "max_tokens",
                        "missing required field 'max_tokens'",
                    ));
                }
            }
        }
        Endpoint::Completions => match head.prompt_input() {
            None => {
                return Err(ApiError::invalid(
                    "prompt",
                    "missing required field 'prompt'",
                ));
            }
            Some(Err(message)) => return Err(ApiError::invalid("prompt", message)),
            Some(Ok(_)) => {}
        },
        Endpoint::Models | Endpoint::Health | Endpoint::Ready | Endpoint::Metrics => {}
    }

    let model_span = span_within(body, raw_model.get())
        .ok_or_else(|| ApiError::invalid("model", "could not locate 'model' in the body"))?;
    // As vLLM checks it: a non-empty string, or null for none.
    let (cache_salt, cache_salt_span) = match head.cache_salt {
        Some(raw) if raw.get() != "null" => {
            let salt: String = serde_json::from_str(raw.get())
                .ok()
                .filter(|salt: &String| !salt.is_empty())
                .ok_or_else(|| {
                    ApiError::invalid(
                        "cache_salt",
                        "'cache_salt' must be a non-empty string if provided",
                    )
                })?;
            (Some(salt), span_within(body, raw.get()))
        }
        _ => (None, None),
    };
    let object_start = body
        .iter()
        .position(|b| *b == b'{')
        .map_or(0, |brace| brace + 1);
    Ok(ParsedRequest {
        model,
        stream: head.stream.unwrap_or(false),
        max_tokens: head.max_tokens.or(head.max_completion_tokens),
        asks_stream_usage: head
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        cache_salt,
        model_span,
        cache_salt_span,
        object_start,
    })
}

/// Ask for `usage` in a streamed OpenAI answer (`stream_options.include_usage`). Returns the
/// body and whether the proxy added the request (so the usage chunk is the proxy's to remove);
/// a body whose client already asked is returned unchanged.
pub fn with_stream_usage(body: Bytes) -> Result<(Bytes, bool), ApiError> {
    if !body.windows(16).any(|w| w == b"\"stream_options\"") {
        // No stream_options at all: add ours right after the opening brace, bytes untouched.
        // Only an object can take it: anything else is left for the parser to refuse.
        return Ok(
            match with_first_field(&body, br#""stream_options":{"include_usage":true}"#) {
                Some(out) => (out, true),
                None => (body, false),
            },
        );
    }
    let mut request: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&body)
        .map_err(|e| ApiError::invalid("body", format!("malformed JSON: {e}")))?;
    let options = request
        .entry("stream_options")
        .or_insert_with(|| serde_json::Value::Object(serde_json::Map::new()));
    // `"stream_options": null` is what several client libraries send; vLLM takes it as absent.
    if options.is_null() {
        *options = serde_json::Value::Object(serde_json::Map::new());
    }
    let Some(options) = options.as_object_mut() else {
        return Err(ApiError::invalid(
            "stream_options",
            "'stream_options' must be an object",
        ));
    };
    if options
        .get("include_usage")
        .and_then(serde_json::Value::as_bool)
        == Some(true)
    {
        return Ok((body, false));
    }
    options.insert("include_usage".into(), serde_json::Value::Bool(true));
    let bytes = serde_json::to_vec(&request)
        .map_err(|e| ApiError::invalid("body", format!("cannot rewrite the body: {e}")))?;
    Ok((Bytes::from(bytes), true))
}

fn require_messages(messages: Option<&[Message<'_>]>) -> Result<(), ApiError> {
    match messages {
        None => Err(ApiError::invalid(
            "messages",
            "missing required field 'messages'",
        )),
        Some([]) => Err(ApiError::invalid(
            "messages",
            "'messages' must contain at least one message",
        )),
        Some(_) => Ok(()),
    }
}

/// The byte range of `part` inside `whole`, when `part` is a slice of it.
fn span_within(whole: &[u8], part: &str) -> Option<Range<usize>> {
    let start = (part.as_ptr() as usize).checked_sub(whole.as_ptr() as usize)?;
    let end = start.checked_add(part.len())?;
    (whole.get(start..end)? == part.as_bytes()).then_some(start..end)
}

/// The body with its `"model"` value replaced by `upstream_model` (no copy when unchanged).
pub fn with_model(body: &Bytes, parsed: &ParsedRequest, upstream_model: &str) -> Bytes {
    rewrite(body, parsed, upstream_model, None)
}

/// The body with its `"model"` value replaced by `upstream_model` and, when `cache_salt` is
/// given, its `"cache_salt"` set to it (replaced in place, or added as the first field). Every
/// other byte stays as the client sent it; no copy when nothing changes.
pub fn rewrite(
    body: &Bytes,
    parsed: &ParsedRequest,
    upstream_model: &str,
    cache_salt: Option<&str>,
) -> Bytes {
    let mut edits: Vec<(Range<usize>, String)> = Vec::new();
    if parsed.model != upstream_model {
        let encoded = serde_json::Value::String(upstream_model.to_owned()).to_string();
        edits.push((parsed.model_span.clone(), encoded));
    }
    if let Some(salt) = cache_salt
        && parsed.cache_salt.as_deref() != Some(salt)
    {
        let encoded = serde_json::Value::String(salt.to_owned()).to_string();
        match &parsed.cache_salt_span {
            Some(span) => edits.push((span.clone(), encoded)),
            None => edits.push((
                parsed.object_start..parsed.object_start,
                format!("\"cache_salt\":{encoded},"),
            )),
        }
    }
    if edits.is_empty() {
        return body.clone();
    }
    edits.sort_by_key(|(span, _)| span.start);
    let mut out = BytesMut::with_capacity(body.len() + 64);
    let mut at = 0;
    for (span, replacement) in edits {
        let Some(kept) = body.get(at..span.start) else {
            return body.clone();
        };
        out.extend_from_slice(kept);
        out.extend_from_slice(replacement.as_bytes());
        at = span.end;
    }
    out.extend_from_slice(body.get(at..).unwrap_or_default());
    out.freeze()
}

/// A translated body (a JSON object the gateway wrote) with `"cache_salt"` added first.
pub fn with_leading_cache_salt(body: Bytes, cache_salt: &str) -> Bytes {
    let encoded = serde_json::Value::String(cache_salt.to_owned()).to_string();
    with_first_field(&body, format!("\"cache_salt\":{encoded}").as_bytes()).unwrap_or(body)
}

/// `body` with `field` (`"name":value`) added as the object's first member, every other byte
/// untouched; `None` when `body` does not start with an object.
fn with_first_field(body: &[u8], field: &[u8]) -> Option<Bytes> {
    let open = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body.get(open) != Some(&b'{') {
        return None;
    }
    let rest = body.get(open + 1..).unwrap_or_default();
    let empty = rest.iter().all(u8::is_ascii_whitespace)
        || rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
    let mut out = BytesMut::with_capacity(body.len() + field.len() + 1);
    out.extend_from_slice(body.get(..=open).unwrap_or_default());
    out.extend_from_slice(field);
    if !empty {
        out.extend_from_slice(b",");
    }
    out.extend_from_slice(rest);
    Some(out.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<ParsedRequest, ApiError> {
        parse(Endpoint::ChatCompletions, body.as_bytes())
    }

    #[test]
    fn cache_salt_is_read_checked_and_rewritten_in_place() {
        let body = Bytes::from_static(
            br#" {"cache_salt":"mine","model":"m","messages":[{"role":"user","content":"x"}]}"#,
        );
        let parsed = chat(std::str::from_utf8(&body).unwrap()).unwrap();
        assert_eq!(parsed.cache_salt.as_deref(), Some("mine"));
        let out = rewrite(&body, &parsed, "upstream/m", Some("c:mine"));
        assert_eq!(
            &out[..],
            br#" {"cache_salt":"c:mine","model":"upstream/m","messages":[{"role":"user","content":"x"}]}"#
        );
        // Absent: added first, the rest untouched.
        let body =
            Bytes::from_static(br#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#);
        let parsed = chat(std::str::from_utf8(&body).unwrap()).unwrap();
        assert_eq!(parsed.cache_salt, None);
        let out = rewrite(&body, &parsed, "m", Some("t:1"));
        assert_eq!(
            &out[..],
            br#"{"cache_salt":"t:1","model":"m","messages":[{"role":"user","content":"x"}]}"#
        );
        assert_eq!(rewrite(&body, &parsed, "m", None), body);
        // null is none; anything else but a non-empty string is refused, as vLLM does.
        let parsed =
            chat(r#"{"model":"m","cache_salt":null,"messages":[{"role":"user"}]}"#).unwrap();
        assert_eq!(parsed.cache_salt, None);
        for bad in [r#""""#, "3", r#"["a"]"#] {
            let error = chat(&format!(
                r#"{{"model":"m","cache_salt":{bad},"messages":[{{"role":"user"}}]}}"#
            ))
            .unwrap_err();
            assert_eq!(error.param, Some("cache_salt"), "{bad}");
        }
        assert_eq!(
            &with_leading_cache_salt(Bytes::from_static(br#"{"model":"m"}"#), "s")[..],
            br#"{"cache_salt":"s","model":"m"}"#
        );
    }

    #[test]
    fn stream_usage_is_requested_once() {
        let (body, injected) =
            with_stream_usage(Bytes::from_static(br#"{"model":"m","stream":true}"#)).unwrap();
        assert!(injected);
        assert_eq!(
            &body[..],
            br#"{"stream_options":{"include_usage":true},"model":"m","stream":true}"#
        );
        let asked =
            Bytes::from_static(br#"{"stream":true,"stream_options":{"include_usage":true}}"#);
        assert_eq!(with_stream_usage(asked.clone()).unwrap(), (asked, false));
        let (body, injected) = with_stream_usage(Bytes::from_static(
            br#"{"stream":true,"stream_options":{"include_usage":false,"x":1}}"#,
        ))
        .unwrap();
        assert!(injected);
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            value["stream_options"],
            serde_json::json!({"include_usage": true, "x": 1})
        );
        assert!(with_stream_usage(Bytes::from_static(br#"{"stream_options":3}"#)).is_err());
        // Not an object: left alone (the first brace is inside a string here).
        let array = Bytes::from_static(br#"[["{"]]"#);
        assert_eq!(with_stream_usage(array.clone()).unwrap(), (array, false));
        // A null stream_options is no stream_options, as vLLM reads it.
        let (body, added) = with_stream_usage(Bytes::from_static(
            br#"{"stream":true,"stream_options":null}"#,
        ))
        .unwrap();
        assert!(added);
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(value["stream_options"]["include_usage"], true);
    }

    #[test]
    fn reads_model_and_stream() {
        let parsed =
            chat(r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#)
                .unwrap();
        assert_eq!(parsed.model, "m");
        assert!(parsed.stream);
    }

    #[test]
    fn rewrites_only_the_model_value() {
        let text = r#"{ "messages":[{"role":"user","content":"\"model\": x"}], "model" : "alias\u0041", "n":1}"#;
        let body = Bytes::from(text);
        let parsed = chat(text).unwrap();
        assert_eq!(parsed.model, "aliasA");
        let out = with_model(&body, &parsed, "Org/real \"model\"");
        let value: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(value["model"], "Org/real \"model\"");
        assert_eq!(value["messages"][0]["content"], "\"model\": x");
        assert_eq!(value["n"], 1);
    }

    #[test]
    fn rejects_bad_bodies_with_a_reason() {
        let cases = [
            ("", "empty"),
            ("[1]", "JSON object"),
            ("{\"model\":", "malformed JSON"),
            (
                r#"{"messages":[{"role":"user"}]}"#,
                "missing required field 'model'",
            ),
            (
                r#"{"model":5,"messages":[{"role":"user"}]}"#,
                "must be a string",
            ),
            (r#"{"model":"m"}"#, "missing required field 'messages'"),
            (r#"{"model":"m","messages":[]}"#, "at least one message"),
            (
                r#"{"model":"m","messages":[{"content":"x"}]}"#,
                "messages[0]",
            ),
            (
                r#"{"model":"m","stream":"yes","messages":[{"role":"user"}]}"#,
                "stream",
            ),
            (
                r#"{"model":"m","model":"n","messages":[{"role":"user"}]}"#,
                "duplicate field",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user"}]} trailing"#,
                "malformed JSON",
            ),
        ];
        for (body, expected) in cases {
            let error = chat(body).unwrap_err();
            assert_eq!(error.status(), 400, "{body}");
            assert!(
                error.message.contains(expected),
                "{body}: {}",
                error.message
            );
        }
    }

    #[test]
    fn completions_need_a_prompt_and_messages_need_max_tokens() {
        assert!(parse(Endpoint::Completions, br#"{"model":"m","prompt":"hi"}"#).is_ok());
        assert!(parse(Endpoint::Completions, br#"{"model":"m","prompt":[1,2,3]}"#).is_ok());
        assert!(parse(Endpoint::Completions, br#"{"model":"m"}"#).is_err());
        assert!(parse(Endpoint::Completions, br#"{"model":"m","prompt":{}}"#).is_err());
        let messages = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
        let error = parse(Endpoint::Messages, messages).unwrap_err();
        assert!(error.message.contains("max_tokens"));
        let ok = br#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}"#;
        assert!(parse(Endpoint::Messages, ok).is_ok());
    }
}
