use switchyard_policy::classify::PromptText;

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

/// The typed request (the gateway's path) gives the chat template what kv's `openai_chat`
/// (the simulator's, from the body as a value) gives it.
#[test]
fn the_chat_template_gets_the_same_messages_as_from_a_value() {
    let body = r#"{"model":"m","messages":[
        {"role":"system","content":[{"type":"text","text":"x-anthropic-billing-header: cch=1\nBe brief."}]},
        {"role":"user","content":[{"type":"text","text":"line\none"},"bare",{"type":"image_url","image_url":{"url":"data:x"}}],"name":"ann"},
        {"role":"assistant","content":[{"type":"refusal","refusal":"no"}],"reasoning_content":"r",
         "tool_calls":[{"type":"function","function":{"arguments":"{\"b\":1,\"a\":2}","name":"f"},"id":"c","index":0}]},
        {"role":"tool","tool_call_id":"c","content":"done"},
        {"role":"assistant","content":null}]}"#;
    let value: switchyard_kv::chat_template::TemplateValue = serde_json::from_str(body).unwrap();
    let (expected, _) = switchyard_kv::tokenize::openai_chat(&value);
    let ours = parse(body.as_bytes()).unwrap().chat_messages();
    assert_eq!(ours, expected);
    assert_eq!(ours[0].content, "Be brief.");
    assert_eq!(ours[2].reasoning.as_deref(), Some("r"));
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
    assert!(matches!(&messages[1].content, Some(Content::Text(Cow::Owned(t))) if t == "esc\naped"));
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

#[test]
fn what_pooling_models_read_is_classified_too() {
    let (main, _, _) = texts(
        r#"{"model":"m","input":["call me at jane@example.com","x"],"query":"q","documents":["d1",{"text":"d2"}]}"#,
    );
    assert_eq!(main, ["call me at jane@example.com", "x", "q", "d1", "d2"]);
}

#[test]
fn parts_of_unexpected_shapes_pass_and_errors_quote_no_values() {
    // A string source (Anthropic's search results) and vLLM's plain-string image_url.
    let body = br#"{"model":"m","messages":[{"role":"user","content":[{"type":"search_result","source":"https://ex.com/secret","content":[{"type":"text","text":"x"}]},{"type":"image_url","image_url":"https://x/cat.png"}]}]}"#;
    let request = parse(body).unwrap();
    let messages = request.messages.unwrap();
    let Some(Content::Parts(parts)) = &messages[0].content else {
        panic!("parts expected");
    };
    assert_eq!(
        parts[1].fields.image_url().as_deref(),
        Some("https://x/cat.png")
    );
    assert!(parts[0].fields.image_source().is_none());
    let error = parse(br#"{"model":"m","messages":[{"role":["my secret"]}]}"#).unwrap_err();
    assert!(!error.message.contains("secret"), "{}", error.message);
    let error = parse(br#"{"model":"m","max_tokens":"my secret"}"#).unwrap_err();
    assert!(!error.message.contains("secret"), "{}", error.message);
    assert!(error.message.contains("max_tokens"), "{}", error.message);
}
