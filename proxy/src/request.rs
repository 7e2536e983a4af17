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
    /// Responses API: the stored response this request continues.
    pub previous_response_id: Option<String>,
    /// Responses API: the id the client chose for the response (vLLM's `request_id`).
    pub response_id: Option<String>,
    /// Responses API: the answer is to be kept (`store`, true unless set false).
    pub store: bool,
    /// Byte range of the `"model"` value (quotes included) in the body.
    model_span: Range<usize>,
    /// Byte range of the `"cache_salt"` value (`null` included), when there is one.
    cache_salt_span: Option<Range<usize>>,
    /// Byte range of the `"stream_options"` value (an object or `null`), when there is one.
    stream_options_span: Option<Range<usize>>,
    /// Byte range of the `"stream"` value (`null` included), when there is one.
    stream_span: Option<Range<usize>>,
    /// Where a new first field goes: just after the object's opening brace.
    object_start: usize,
}

impl ParsedRequest {
    /// A multipart form (speech to text): its `model` field's text and where its value lies.
    pub fn form(model: String, model_span: Range<usize>, stream: bool) -> ParsedRequest {
        ParsedRequest {
            model_span,
            ..ParsedRequest::bodiless(model, stream)
        }
    }

    /// Where the `model` value lies in the body (JSON: quotes included; a form: the value).
    pub fn model_span(&self) -> &Range<usize> {
        &self.model_span
    }

    /// A request without a body (`GET /v1/responses/{id}` and the like), for `model` as the
    /// client knows it.
    pub fn bodiless(model: String, stream: bool) -> ParsedRequest {
        ParsedRequest {
            model,
            stream,
            max_tokens: Some(0),
            cache_salt: None,
            asks_stream_usage: false,
            previous_response_id: None,
            response_id: None,
            store: false,
            model_span: 0..0,
            cache_salt_span: None,
            stream_options_span: None,
            stream_span: None,
            object_start: 0,
        }
    }
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
    let (model, raw_model) = head.model_name()?;

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
        // vLLM also takes a conversation (`messages`) to embed.
        Endpoint::Embeddings | Endpoint::Pooling
            if head.input.is_none() && head.messages.is_none() =>
        {
            return Err(ApiError::invalid(
                "input",
                "missing required field 'input' (or 'messages')",
            ));
        }
        Endpoint::Responses => match head.responses_input() {
            None => {
                return Err(ApiError::invalid("input", "missing required field 'input'"));
            }
            Some(Err(message)) => return Err(ApiError::invalid("input", message)),
            Some(Ok(_)) => {}
        },
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
        // The rest need only `model` here; their workers check the other fields.
        _ => {}
    }

    let model_span = span_within(body, raw_model.get())
        .ok_or_else(|| ApiError::invalid("model", "could not locate 'model' in the body"))?;
    let cache_salt = head.cache_salt_value()?.map(|(salt, _)| salt);
    // A `null` salt is replaced in place too: one added before it would lose to it.
    let cache_salt_span = head.cache_salt.and_then(|raw| span_within(body, raw.get()));
    let stream_options = head.stream_options()?;
    // The Responses API's own fields mean something on that endpoint only.
    let responses = match endpoint {
        Endpoint::Responses => {
            let fields = head.responses_fields()?;
            if fields.max_output_tokens == Some(0) {
                return Err(ApiError::invalid(
                    "max_output_tokens",
                    "'max_output_tokens' must be at least 1",
                ));
            }
            fields
        }
        _ => Default::default(),
    };
    let object_start = body
        .iter()
        .position(|b| *b == b'{')
        .map_or(0, |brace| brace + 1);
    Ok(ParsedRequest {
        model,
        stream: head.stream().unwrap_or(false),
        max_tokens: match endpoint {
            Endpoint::Responses => responses.max_output_tokens,
            _ => head.max_tokens.or(head.max_completion_tokens),
        },
        asks_stream_usage: stream_options.include_usage.unwrap_or(false),
        previous_response_id: responses.previous_response_id,
        response_id: responses.request_id,
        store: responses.store,
        cache_salt,
        model_span,
        cache_salt_span,
        stream_options_span: head
            .raw_stream_options
            .and_then(|raw| span_within(body, raw.get())),
        stream_span: head.raw_stream.and_then(|raw| span_within(body, raw.get())),
        object_start,
    })
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
    rewrite(body, parsed, upstream_model, None, Streaming::AsSent)
        .map_or_else(|_| body.clone(), |(out, _)| out)
}

/// What the body sent upstream says about streaming.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Streaming {
    /// As the client sent it.
    AsSent,
    /// A streamed request, with `stream_options.include_usage` set (streamed OpenAI answers
    /// carry usage only when asked).
    AskUsage,
    /// A request the client sent unstreamed, streamed (with `stream_options.include_usage`
    /// when `usage`: OpenAI's Chat Completions and Completions streams carry usage only when
    /// asked, Responses and Anthropic streams always): the gateway assembles the answer
    /// ([`crate::assemble`]).
    Stream { usage: bool },
}

/// The body with its `"model"` value replaced by `upstream_model`; when `cache_salt` is given,
/// its `"cache_salt"` set to it (replaced in place, or added as the first field); and its
/// `"stream"` and `stream_options.include_usage` set as `streaming` says. Every other byte
/// stays as the client sent it; no copy when nothing changes. Returns the body and whether the
/// gateway asked for usage on the client's behalf.
pub fn rewrite(
    body: &Bytes,
    parsed: &ParsedRequest,
    upstream_model: &str,
    cache_salt: Option<&str>,
    streaming: Streaming,
) -> Result<(Bytes, bool), ApiError> {
    let mut edits: Vec<(Range<usize>, String)> = Vec::new();
    let mut asked = false;
    if matches!(streaming, Streaming::Stream { .. }) && !parsed.stream {
        match &parsed.stream_span {
            Some(span) => edits.push((span.clone(), "true".to_owned())),
            None => edits.push((
                parsed.object_start..parsed.object_start,
                r#""stream":true,"#.to_owned(),
            )),
        }
    }
    let usage = matches!(
        streaming,
        Streaming::AskUsage | Streaming::Stream { usage: true }
    );
    if usage && !parsed.asks_stream_usage {
        asked = true;
        match &parsed.stream_options_span {
            None => edits.push((
                parsed.object_start..parsed.object_start,
                r#""stream_options":{"include_usage":true},"#.to_owned(),
            )),
            Some(span) => {
                let options = body
                    .get(span.clone())
                    .and_then(|raw| std::str::from_utf8(raw).ok())
                    .unwrap_or("null");
                // `null` is what several client libraries send; vLLM takes it as absent.
                let options = if options == "null" { "{}" } else { options };
                if let Some(options) = wire::with_include_usage(options)? {
                    edits.push((span.clone(), options));
                }
            }
        }
    }
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
        return Ok((body.clone(), asked));
    }
    edits.sort_by_key(|(span, _)| span.start);
    let mut out = BytesMut::with_capacity(body.len() + 64);
    let mut at = 0;
    for (span, replacement) in edits {
        let Some(kept) = body.get(at..span.start) else {
            return Ok((body.clone(), false));
        };
        out.extend_from_slice(kept);
        out.extend_from_slice(replacement.as_bytes());
        at = span.end;
    }
    out.extend_from_slice(body.get(at..).unwrap_or_default());
    Ok((out.freeze(), asked))
}

/// A translated body (a JSON object the gateway wrote) with `"cache_salt"` added first.
pub fn with_leading_cache_salt(body: Bytes, cache_salt: &str) -> Bytes {
    let encoded = serde_json::Value::String(cache_salt.to_owned()).to_string();
    with_first_field(&body, format!("\"cache_salt\":{encoded}").as_bytes()).unwrap_or(body)
}

/// A translated body (a JSON object the gateway wrote, without `stream`) asking for a stream
/// with usage, as the first fields: the answer the client asked for whole is assembled from it.
pub fn with_leading_stream_usage(body: Bytes) -> Bytes {
    with_first_field(
        &body,
        br#""stream":true,"stream_options":{"include_usage":true}"#,
    )
    .unwrap_or(body)
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
        let (out, _) = rewrite(
            &body,
            &parsed,
            "upstream/m",
            Some("c:mine"),
            Streaming::AsSent,
        )
        .unwrap();
        assert_eq!(
            &out[..],
            br#" {"cache_salt":"c:mine","model":"upstream/m","messages":[{"role":"user","content":"x"}]}"#
        );
        // Absent: added first, the rest untouched.
        let body =
            Bytes::from_static(br#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#);
        let parsed = chat(std::str::from_utf8(&body).unwrap()).unwrap();
        assert_eq!(parsed.cache_salt, None);
        let (out, _) = rewrite(&body, &parsed, "m", Some("t:1"), Streaming::AsSent).unwrap();
        assert_eq!(
            &out[..],
            br#"{"cache_salt":"t:1","model":"m","messages":[{"role":"user","content":"x"}]}"#
        );
        assert_eq!(
            rewrite(&body, &parsed, "m", None, Streaming::AsSent)
                .unwrap()
                .0,
            body
        );
        // null is none; anything else but a non-empty string is refused, as vLLM does.
        let null = r#"{"model":"m","cache_salt":null,"messages":[{"role":"user"}]}"#;
        let parsed = chat(null).unwrap();
        assert_eq!(parsed.cache_salt, None);
        // ...and a tenant's salt takes its place (a null after it would win).
        let (out, _) = rewrite(
            &Bytes::from_static(null.as_bytes()),
            &parsed,
            "m",
            Some("t:1"),
            Streaming::AsSent,
        )
        .unwrap();
        assert_eq!(
            &out[..],
            br#"{"model":"m","cache_salt":"t:1","messages":[{"role":"user"}]}"#
        );
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
        let ask = |body: &'static str| {
            let bytes = Bytes::from_static(body.as_bytes());
            let parsed = chat(body).unwrap();
            rewrite(&bytes, &parsed, "m", None, Streaming::AskUsage)
        };
        const HI: &str = r#""messages":[{"role":"user","content":"hi"}]"#;
        let plain: &'static str =
            Box::leak(format!(r#"{{"model":"m","stream":true,{HI}}}"#).into_boxed_str());
        let (body, injected) = ask(plain).unwrap();
        assert!(injected);
        assert_eq!(
            String::from_utf8_lossy(&body),
            format!(
                r#"{{"stream_options":{{"include_usage":true}},"model":"m","stream":true,{HI}}}"#
            )
        );
        let asked: &'static str = Box::leak(
            format!(
                r#"{{"model":"m","stream":true,"stream_options":{{"include_usage":true}},{HI}}}"#
            )
            .into_boxed_str(),
        );
        let (body, injected) = ask(asked).unwrap();
        assert!(!injected);
        assert_eq!(body, Bytes::from_static(asked.as_bytes()));
        let other: &'static str = Box::leak(
            format!(r#"{{"model":"m","stream":true,"stream_options":{{"include_usage":false,"x":1}},{HI}}}"#)
                .into_boxed_str(),
        );
        let (body, injected) = ask(other).unwrap();
        assert!(injected);
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            value["stream_options"],
            serde_json::json!({"include_usage": true, "x": 1})
        );
        assert_eq!(value["messages"][0]["content"], "hi");
        // Not an object: refused when the body is read.
        assert!(chat(&format!(r#"{{"model":"m","stream_options":3,{HI}}}"#)).is_err());
        // A null stream_options is no stream_options, as vLLM reads it.
        let null: &'static str = Box::leak(
            format!(r#"{{"model":"m","stream":true,"stream_options":null,{HI}}}"#).into_boxed_str(),
        );
        let (body, added) = ask(null).unwrap();
        assert!(added);
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(value["stream_options"]["include_usage"], true);
        // Together with the model and the cache salt.
        let parsed = chat(plain).unwrap();
        let (body, _) = rewrite(
            &Bytes::from_static(plain.as_bytes()),
            &parsed,
            "up",
            Some("s"),
            Streaming::AskUsage,
        )
        .unwrap();
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            (value["model"].as_str(), value["cache_salt"].as_str()),
            (Some("up"), Some("s"))
        );
        assert_eq!(value["stream_options"]["include_usage"], true);
    }

    #[test]
    fn a_whole_answer_is_asked_for_as_a_stream_with_usage() {
        const HI: &str = r#""messages":[{"role":"user","content":"hi"}]"#;
        // `stream` false, null or absent: set true in place (or added), usage asked for, the
        // rest byte-exact.
        for (stream, expected) in [
            (
                r#""stream":false,"#,
                r#"{"stream_options":{"include_usage":true},"model":"m","stream":true,"#,
            ),
            (
                r#""stream":null,"#,
                r#"{"stream_options":{"include_usage":true},"model":"m","stream":true,"#,
            ),
            (
                "",
                r#"{"stream":true,"stream_options":{"include_usage":true},"model":"m","#,
            ),
        ] {
            let body = format!(r#"{{"model":"m",{stream}{HI}}}"#);
            let parsed = chat(&body).unwrap();
            assert!(!parsed.stream);
            let (out, _) = rewrite(
                &Bytes::from(body.clone()),
                &parsed,
                "m",
                None,
                Streaming::Stream { usage: true },
            )
            .unwrap();
            assert_eq!(String::from_utf8_lossy(&out), format!("{expected}{HI}}}"));
        }
        // What the worker would answer otherwise is not asked for as a stream.
        for fields in [
            r#""stream_options":{"include_usage":true},"#,
            r#""use_beam_search":true,"#,
            r#""prompt_logprobs":1,"#,
            r#""return_token_ids":true,"#,
            r#""kv_transfer_params":{"do_remote_decode":true},"#,
            r#""logprobs":true,"top_logprobs":2,"#,
            r#""echo":true,"logprobs":2,"#,
        ] {
            let body = format!(r#"{{"model":"m",{fields}{HI}}}"#);
            assert!(
                !wire::parse(body.as_bytes()).unwrap().assemblable(),
                "{body}"
            );
        }
        for fields in [
            "",
            r#""use_beam_search":false,"prompt_logprobs":null,"logprobs":false,"#,
            // A completion's logprobs, or its prompt echoed without them.
            r#""logprobs":2,"#,
            r#""echo":true,"#,
        ] {
            let body = format!(r#"{{"model":"m",{fields}{HI}}}"#);
            assert!(
                wire::parse(body.as_bytes()).unwrap().assemblable(),
                "{body}"
            );
        }
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
