//! Property tests (a bounded fuzz run in every `cargo test`): the request parser, both
//! translators and the usage tap take any bytes a client or an upstream can send without
//! panicking, and what they produce is well formed. 256 cases a property by default;
//! `PROPTEST_CASES=20000 cargo test -p switchyard-proxy --test fuzz` runs longer.

use bytes::Bytes;
use proptest::prelude::*;
use serde_json::{Map, Value};
use switchyard_proxy::accounting::UsageTap;
use switchyard_proxy::api::Endpoint;
use switchyard_proxy::request;
use switchyard_proxy::translate::{self, StreamTranslator};
use switchyard_proxy::translate_openai::{self, MessagesStreamTranslator};
use switchyard_proxy::translate_request;

/// Keys the two APIs use, so generated objects reach deep into the parsers.
const KEYS: &[&str] = &[
    "model",
    "messages",
    "role",
    "content",
    "type",
    "text",
    "system",
    "tools",
    "tool_calls",
    "tool_use_id",
    "tool_call_id",
    "function",
    "name",
    "arguments",
    "input",
    "id",
    "stream",
    "stream_options",
    "include_usage",
    "max_tokens",
    "max_completion_tokens",
    "prompt",
    "stop",
    "image_url",
    "url",
    "source",
    "data",
    "usage",
    "choices",
    "delta",
    "index",
    "finish_reason",
    "stop_reason",
    "prompt_tokens",
    "completion_tokens",
    "input_tokens",
    "output_tokens",
    "error",
    "message",
    "tool_choice",
    "temperature",
    "n",
    "user",
    "metadata",
];

/// Values the two APIs give meaning to.
const STRINGS: &[&str] = &[
    "user",
    "assistant",
    "system",
    "tool",
    "developer",
    "text",
    "image_url",
    "image",
    "tool_use",
    "tool_result",
    "function",
    "auto",
    "none",
    "m",
    "",
    "base64",
    "data:image/png;base64,AA==",
    "message_start",
    "content_block_delta",
    "[DONE]",
];

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        (-1e9f64..1e9).prop_map(Value::from),
        prop::sample::select(STRINGS).prop_map(Value::from),
        "\\PC{0,24}".prop_map(Value::from),
    ];
    leaf.prop_recursive(5, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(KEYS), inner), 0..8).prop_map(|fields| {
                Value::Object(
                    fields
                        .into_iter()
                        .map(|(k, v)| (k.to_owned(), v))
                        .collect::<Map<String, Value>>(),
                )
            }),
        ]
    })
}

/// A request-shaped object: the fields the parsers require are there, the rest is arbitrary.
fn request_body() -> impl Strategy<Value = Vec<u8>> {
    (json_value(), json_value(), any::<bool>(), any::<u8>()).prop_map(
        |(messages, extra, stream, tokens)| {
            let mut object = match extra {
                Value::Object(object) => object,
                other => Map::from_iter([("extra".to_owned(), other)]),
            };
            object.insert("model".into(), Value::from("m"));
            object.insert(
                "messages".into(),
                match messages {
                    Value::Array(items) => Value::Array(items),
                    other => Value::Array(vec![other]),
                },
            );
            object.insert("stream".into(), Value::from(stream));
            object.insert("max_tokens".into(), Value::from(tokens));
            serde_json::to_vec(&Value::Object(object)).unwrap_or_default()
        },
    )
}

fn any_body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..512),
        json_value().prop_map(|v| serde_json::to_vec(&v).unwrap_or_default()),
        request_body(),
    ]
}

/// Bytes split into the chunks an upstream stream might arrive in.
fn chunked(body: &[u8], cuts: &[usize]) -> Vec<Bytes> {
    let mut at = 0;
    let mut chunks = Vec::new();
    for cut in cuts {
        let end = (at + cut % 64).min(body.len());
        chunks.push(Bytes::copy_from_slice(
            body.get(at..end).unwrap_or_default(),
        ));
        at = end;
    }
    chunks.push(Bytes::copy_from_slice(body.get(at..).unwrap_or_default()));
    chunks
}

fn sse_of(values: &[Value]) -> Vec<u8> {
    let mut out = Vec::new();
    for value in values {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(&serde_json::to_vec(value).unwrap_or_default());
        out.extend_from_slice(b"\n\n");
    }
    out.extend_from_slice(b"data: [DONE]\n\n");
    out
}

fn is_json(bytes: &[u8]) -> bool {
    serde_json::from_slice::<Value>(bytes).is_ok()
}

proptest! {
    #[test]
    fn the_parser_takes_any_body(body in any_body()) {
        for endpoint in [Endpoint::ChatCompletions, Endpoint::Completions, Endpoint::Messages] {
            if let Ok(parsed) = request::parse(endpoint, &body) {
                // The model splice keeps the body JSON and names the new model.
                let bytes = Bytes::from(body.clone());
                let rewritten = request::with_model(&bytes, &parsed, "upstream/model-1");
                let value: Value = serde_json::from_slice(&rewritten).unwrap();
                prop_assert_eq!(&value["model"], "upstream/model-1");
            }
        }
        for endpoint in [Endpoint::ChatCompletions, Endpoint::Completions] {
            if let Ok(parsed) = request::parse(endpoint, &body) {
                let bytes = Bytes::from(body.clone());
                if let Ok((out, _)) = request::rewrite(&bytes, &parsed, "up", Some("salt"), request::Streaming::AskUsage) {
                    prop_assert!(is_json(&out));
                }
            }
        }
        // The typed model takes any body without panicking, and every reader of it too.
        if let Ok(typed) = switchyard_proxy::wire::parse(&body) {
            let _ = typed.chat_messages();
            let _ = typed.template_inputs();
            let _ = typed.prompt_input();
            let mut texts = 0usize;
            switchyard_policy::classify::PromptText::for_each_text(&typed, &mut |_| texts += 1);
        }
    }

    #[test]
    fn request_translators_take_any_body(body in any_body()) {
        if let Ok(typed) = switchyard_proxy::wire::parse(&body) {
            if let Ok(chat) = translate_request::messages_to_chat(&typed, "m") {
                prop_assert!(is_json(&chat));
            }
            if let Ok(messages) = translate_request::chat_to_messages(&typed, "m") {
                prop_assert!(is_json(&messages));
            }
        }
    }

    #[test]
    fn answer_translators_take_any_answer(body in any_body(), status in 400u16..600) {
        // An answer, or a reason there is none (never an error body after a success status).
        for answer in [
            translate::chat_response_to_message(&body, "alias"),
            translate_openai::message_response_to_chat(&body, "alias"),
        ] {
            prop_assert!(answer.is_err() || answer.as_deref().is_ok_and(is_json));
        }
        prop_assert!(is_json(&translate::error_to_anthropic(status, &body)));
        prop_assert!(is_json(&translate_openai::error_to_openai(status, &body)));
    }

    #[test]
    fn stream_translators_and_the_usage_tap_take_any_stream(
        events in prop::collection::vec(json_value(), 0..8),
        raw in prop::collection::vec(any::<u8>(), 0..256),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
        sse in any::<bool>(),
    ) {
        let body = if sse { sse_of(&events) } else { raw };
        let chunks = chunked(&body, &cuts);
        let mut to_messages = StreamTranslator::new("alias");
        let mut to_chat = MessagesStreamTranslator::new("alias");
        let mut tap = UsageTap::new(true, true);
        for chunk in &chunks {
            let _ = to_messages.feed(chunk);
            let _ = to_chat.feed(chunk);
            let _ = tap.feed(chunk.clone());
        }
        let _ = to_messages.finish();
        let _ = to_chat.finish();
        let _ = tap.finish();
    }
}
