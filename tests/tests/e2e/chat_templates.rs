//! The gateway's chat-template rendering against transformers' own (`render_jinja_template`, run
//! by `tests/python/hf_chat_template.py`), request by request: the prompt text the router hashes
//! must be the text vLLM renders, or no prompt with tools, tool calls, reasoning or template
//! arguments is ever found in a worker's cache.
//!
//! vLLM's side ([tests/python/hf_chat_template.py](../../python/hf_chat_template.py)) runs vLLM's
//! own helpers from its wheel where they load without torch (content format detection,
//! developer roles, Claude Code's billing line, tool-call arguments, the kwargs merge).
//!
//! Templates: a Qwen3-style template with tools, tool calls and thinking
//! (`template_minicpmv45.jinja` from the vLLM wheel, unpacked by scripts/test.sh into
//! `.cache/vllm-0.34.0/`, or `VLLM_SRC`), the shipped ChatML one, and one written here for what
//! those two do not use: block tags without whitespace control (transformers trims them),
//! `bos_token`, `tojson` with arguments, dict methods, a `{% generation %}` block and content
//! given as parts. The requests are sent to both sides as the same JSON text, so object keys
//! keep their order.

use std::io::Write;
use std::process::{Command, Stdio};

use serde_json::{Value, json};
use switchyard_e2e::{python, workspace_root};
use switchyard_kv::chat_template::TemplateValue;
use switchyard_kv::tokenize::{PromptTokenizer, SHIPPED_TOKENIZER_JSON, openai_chat};

/// Block tags on lines of their own, no whitespace control: the output depends on
/// `trim_blocks` and `lstrip_blocks`.
const PLAIN_TEMPLATE: &str = r#"{{ bos_token }}
{% if tools %}
Tools:
  {% for tool in tools %}
{{ tool | tojson(indent=2) }}
  {% endfor %}
{% endif %}
{% for message in messages %}
  {% if message['role'] == 'assistant' %}
<|assistant|>{% generation %}{% for part in message['content'] if part.type == 'text' %}{{ part['text'] | trim }}{% endfor %}
    {% for call in message.tool_calls or [] %}
[{{ call.function.name }}] {{ call.function.arguments | tojson(sort_keys=true, separators=(',', ':')) }}
    {% endfor %}{% endgeneration %}
  {% elif message['role'] == 'tool' %}
<|tool|>{{ message.content }} ({{ message.tool_call_id }})
  {% else %}
<|{{ message['role'] }}|>{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}{{ part.text }}{% if not loop.last %} / {% endif %}{% endfor %}{% endif %}
  {% endif %}
{% endfor %}
{% for key, value in (extra or {}).items() %}{{ key }}={{ value }};{% endfor %}
{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}{{ mode }}{{ enable_thinking }}
{% if add_generation_prompt %}<|assistant|>{% endif %}
"#;

fn vllm_template(name: &str) -> String {
    let source = std::env::var_os("VLLM_SRC")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".cache/vllm-0.34.0"));
    let path = source
        .join("vllm/transformers_utils/chat_templates")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (scripts/test.sh unpacks vLLM's templates)",
            path.display()
        )
    })
}

/// OpenAI requests, as JSON text (keys in the order a client sends them).
fn requests() -> Vec<&'static str> {
    vec![
        r#"{"model": "m", "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]}"#,
        r#"{"model": "m",
            "tools": [
              {"type": "function", "function": {"name": "get_weather", "description": "Wetter für eine Stadt — «heute»",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7.5}}, "required": ["city"]}}},
              {"type": "function", "function": {"name": "now", "parameters": null, "strict": true}, "extra": 1}
            ],
            "messages": [
              {"role": "system", "content": "Use tools."},
              {"role": "user", "content": "Weather in Zürich?"},
              {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"days\": 2, \"city\": \"Zürich\"}"}},
                {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": ""}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21°C"},
              {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "12:00"}, {"type": "text", "text": "UTC"}]},
              {"role": "user", "content": "And tomorrow?"}
            ]}"#,
        r#"{"model": "m", "chat_template_kwargs": {"enable_thinking": false, "extra": {"b": 2, "a": "x"}},
            "messages": [
              {"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "4", "reasoning": "Two and two make four."},
              {"role": "user", "content": [{"type": "text", "text": "And 3+3?"}, {"type": "text", "text": "Be brief."}]}
            ]}"#,
        r#"{"model": "m", "reasoning_effort": "high", "messages": [{"role": "user", "content": "Think."}]}"#,
        r#"{"model": "m", "add_generation_prompt": false, "continue_final_message": true,
            "messages": [{"role": "user", "content": "Finish: roses are"}, {"role": "assistant", "content": "red, violets  "}]}"#,
        r#"{"model": "m", "messages": [{"role": "developer", "content": "Be kind."}, {"role": "user", "content": "Hello", "name": "ann"}, {"role": "developer", "content": "Be brief."}]}"#,
        // Claude Code's billing line, an older reasoning field, a refusal part, tool calls with
        // their keys in another order and extra keys, template arguments that vLLM drops
        // (null, "auto") or takes by name, an "auto" effort.
        r#"{"model": "m", "reasoning_effort": "auto",
            "chat_template_kwargs": {"enable_thinking": null, "mode": "auto", "documents": [{"title": "T", "text": "D"}], "add_generation_prompt": false},
            "messages": [
              {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0; cch=42\nYou are Claude Code."}, {"type": "text", "text": "x-anthropic-billing-header: only"}]},
              {"role": "user", "content": "List files."},
              {"role": "assistant", "content": [{"type": "refusal", "refusal": "Not that one."}], "reasoning_content": "The user wants ls.",
               "tool_calls": [{"type": "function", "function": {"name": "ls", "arguments": "{\"path\": \".\", \"all\": true}", "extra": 1}, "id": "t1", "index": 0}]},
              {"role": "tool", "tool_call_id": "t1", "content": "a.txt"}
            ]}"#,
    ]
}

struct Case {
    template: String,
    special_tokens: Value,
    tokenizer: PromptTokenizer,
}

fn case(template: String) -> Case {
    let config = json!({"bos_token": {"content": "<s>"}, "eos_token": "</s>"});
    let tokenizer = PromptTokenizer::with_config(SHIPPED_TOKENIZER_JSON, &template, Some(&config))
        .unwrap_or_else(|e| panic!("template: {e}"));
    Case {
        template,
        special_tokens: json!({"bos_token": "<s>", "eos_token": "</s>"}),
        tokenizer,
    }
}

/// transformers' rendering of every request under every case, in order.
fn transformers_renders(cases: &[Case]) -> Vec<Value> {
    let mut input = Vec::new();
    for case in cases {
        for request in requests() {
            input.push(json!({
                "template": case.template,
                "special_tokens": case.special_tokens,
                "request": request,
            }));
        }
    }
    let mut child = Command::new(python())
        .arg(workspace_root().join("tests/python/hf_chat_template.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start tests/python/hf_chat_template.py");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(json!({ "cases": input }).to_string().as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "hf_chat_template.py: {}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

#[test]
fn tools_tool_calls_reasoning_and_template_arguments_render_as_transformers_renders_them() {
    let cases = [
        case(vllm_template("template_minicpmv45.jinja")),
        case(vllm_template("template_chatml.jinja")),
        case(PLAIN_TEMPLATE.to_owned()),
    ];
    let expected = transformers_renders(&cases);
    assert_eq!(expected.len(), cases.len() * requests().len());
    let mut mismatches = Vec::new();
    let mut rendered_texts = 0;
    for (i, (case, request)) in cases
        .iter()
        .flat_map(|case| requests().into_iter().map(move |request| (case, request)))
        .enumerate()
    {
        // vLLM's content format, from vLLM's own detection.
        if let Some(format) = expected[i]["format"].as_str() {
            assert_eq!(case.tokenizer.content_format(), format, "case {i}");
        }
        let ordered: TemplateValue = serde_json::from_str(request).unwrap();
        let (messages, inputs) = openai_chat(&ordered);
        let ours = case.tokenizer.render_chat_with(&messages, &inputs);
        match (&expected[i]["text"], ours) {
            (Value::String(theirs), Ok(ours)) => {
                rendered_texts += 1;
                if *theirs != ours {
                    mismatches.push(format!(
                        "case {i} ({} chars of template):\n--- transformers\n{theirs}\n--- switchyard\n{ours}",
                        case.template.len()
                    ));
                }
            }
            (Value::Null, Err(_)) => {}
            (theirs, ours) => mismatches.push(format!(
                "case {i}: transformers {theirs} / {:?}, switchyard {ours:?}",
                expected[i]["error"]
            )),
        }
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n\n"));
    // Every case renders on both sides (none is a shared failure).
    assert_eq!(rendered_texts, expected.len());
}
