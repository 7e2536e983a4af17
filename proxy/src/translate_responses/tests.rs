use serde_json::{Value, json};

use super::*;
use crate::wire;

fn translate(body: Value) -> Result<Value, ApiError> {
    let text = body.to_string();
    let typed = wire::parse(text.as_bytes()).unwrap();
    responses_to_chat(&typed, "up/model").map(|bytes| serde_json::from_slice(&bytes).unwrap())
}

#[test]
fn requests_become_chat_completions() {
    let chat = translate(json!({
        "model": "alias", "instructions": "Be brief.", "max_output_tokens": 50, "temperature": 0.2,
        "stream": true, "parallel_tool_calls": false,
        "input": [
            {"role": "developer", "content": "rules"},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "what is in"},
                {"type": "input_image", "image_url": "https://x/cat.png"}]},
            {"type": "reasoning", "id": "r", "summary": []},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me look"}]},
            {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{\"q\":1}"},
            {"type": "function_call", "call_id": "c2", "name": "lookup", "arguments": "{\"q\":2}"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
        ],
        "tools": [{"type": "function", "name": "lookup", "description": "d", "parameters": {"type": "object"}, "strict": true}],
        "tool_choice": {"type": "function", "name": "lookup"},
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": true}},
    }))
    .unwrap();
    assert_eq!(chat["model"], "up/model");
    assert_eq!(chat["max_completion_tokens"], 50);
    assert_eq!(chat["stream_options"]["include_usage"], true);
    assert_eq!(chat["parallel_tool_calls"], false);
    let messages = chat["messages"].as_array().unwrap();
    assert_eq!(
        messages[0],
        json!({"role": "system", "content": "Be brief."})
    );
    assert_eq!(messages[1], json!({"role": "system", "content": "rules"}));
    assert_eq!(
        messages[2]["content"],
        json!([{"type": "text", "text": "what is in"}, {"type": "image_url", "image_url": {"url": "https://x/cat.png"}}])
    );
    // The calls join the assistant message before them.
    assert_eq!(messages[3]["content"], "let me look");
    assert_eq!(messages[3]["tool_calls"].as_array().unwrap().len(), 2);
    assert_eq!(
        messages[3]["tool_calls"][1]["function"]["arguments"],
        "{\"q\":2}"
    );
    assert_eq!(
        messages[4],
        json!({"role": "tool", "tool_call_id": "c1", "content": "one"})
    );
    assert_eq!(messages.len(), 5);
    assert_eq!(chat["tools"][0]["function"]["name"], "lookup");
    assert_eq!(chat["tools"][0]["function"]["strict"], true);
    assert_eq!(
        chat["tool_choice"],
        json!({"type": "function", "function": {"name": "lookup"}})
    );
    assert_eq!(chat["response_format"]["json_schema"]["name"], "s");
}

#[test]
fn stateful_requests_do_not_translate() {
    for body in [
        json!({"model": "m", "input": "x", "previous_response_id": "resp_1"}),
        json!({"model": "m", "input": "x", "background": true}),
        json!({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}),
        json!({"model": "m", "input": "x", "conversation": "conv_1"}),
    ] {
        let error = translate(body.clone()).unwrap_err();
        assert_eq!(error.status(), 501, "{body}");
        assert_eq!(error.code, "translation_unsupported");
    }
}

#[test]
fn whole_answers_become_response_objects() {
    let chat = json!({"id": "abc", "object": "chat.completion", "model": "up/model", "choices": [{"index": 0,
        "message": {"role": "assistant", "content": "hello", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        "finish_reason": "length"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}}});
    let out: Value = serde_json::from_slice(
        &chat_response_to_responses(chat.to_string().as_bytes(), "alias").unwrap(),
    )
    .unwrap();
    assert_eq!(out["object"], "response");
    assert_eq!(out["model"], "alias");
    assert_eq!(out["status"], "incomplete");
    assert_eq!(out["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(out["output"][0]["content"][0]["text"], "hello");
    assert_eq!(out["output"][1]["type"], "function_call");
    assert_eq!(out["output"][1]["call_id"], "call_1");
    assert_eq!(out["usage"]["input_tokens"], 10);
    assert_eq!(out["usage"]["input_tokens_details"]["cached_tokens"], 8);
    assert_eq!(out["usage"]["total_tokens"], 13);
}

fn events(text: &str) -> Vec<Value> {
    text.split("\n\n")
        .filter_map(|event| event.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(|data| serde_json::from_str(data).unwrap())
        .collect()
}

#[test]
fn streams_become_typed_events_split_anywhere() {
    let chunks = [
        r#"{"id":"c9","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
        r#"{"id":"c9","choices":[{"index":0,"delta":{"content":"Hel"}}]}"#,
        r#"{"id":"c9","choices":[{"index":0,"delta":{"content":"lo"}}]}"#,
        r#"{"id":"c9","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","function":{"name":"f","arguments":"{\"a\""}}]}}]}"#,
        r#"{"id":"c9","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":":1}"}}]},"finish_reason":"tool_calls"}]}"#,
        r#"{"id":"c9","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":4}}"#,
    ];
    let upstream: String = chunks
        .iter()
        .map(|c| format!("data: {c}\n\n"))
        .chain(["data: [DONE]\n\n".to_owned()])
        .collect();
    for cut in [1, 50, 200, upstream.len() - 3] {
        let mut translator = ResponsesStreamTranslator::new("alias");
        let mut out = Vec::new();
        out.extend_from_slice(&translator.feed(&upstream.as_bytes()[..cut]));
        out.extend_from_slice(&translator.feed(&upstream.as_bytes()[cut..]));
        out.extend_from_slice(&translator.finish());
        let events = events(&String::from_utf8(out).unwrap());
        let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ],
            "cut at {cut}"
        );
        let sequence: Vec<u64> = events
            .iter()
            .map(|e| e["sequence_number"].as_u64().unwrap())
            .collect();
        assert_eq!(sequence, (0..events.len() as u64).collect::<Vec<_>>());
        let done = events.last().unwrap();
        assert_eq!(done["response"]["model"], "alias");
        assert_eq!(done["response"]["output"][0]["content"][0]["text"], "Hello");
        assert_eq!(done["response"]["output"][1]["arguments"], "{\"a\":1}");
        assert_eq!(done["response"]["usage"]["output_tokens"], 4);
    }
}

#[test]
fn a_stream_cut_off_upstream_ends_failed() {
    let mut translator = ResponsesStreamTranslator::new("alias");
    let mut out = translator
        .feed(b"data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n")
        .to_vec();
    out.extend_from_slice(&translator.finish());
    let events = events(&String::from_utf8(out).unwrap());
    let last = events.last().unwrap();
    assert_eq!(last["type"], "response.failed");
    assert_eq!(last["response"]["status"], "failed");
    assert_eq!(last["response"]["output"][0]["content"][0]["text"], "Hel");
}
