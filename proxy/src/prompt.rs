//! The request's prompt as the worker will see it: rendered with the pool's chat template,
//! tokenized with its tokenizer, and cut into chained block hashes for the prefix index.
//!
//! Bounded: only the first [`MAX_ROUTING_PROMPT_CHARS`] characters of a prompt are tokenized
//! (cache affinity is decided by the prefix; a longer tail changes nothing but the cost). Rendered
//! prompts seen recently are remembered by their hash, so a retried or repeated prompt is not
//! tokenized again.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};
use switchyard_kv::chat_template::TemplateInputs;
use switchyard_kv::hash::{SequenceHash, sequence_hashes_keyed};
use switchyard_kv::tokenize::{ChatMessage, PromptTokenizer, SpecialTokens, anthropic_chat};
use switchyard_snapshot::snapshot::Tenant;
use xxhash_rust::xxh3::xxh3_64;

use crate::api::Endpoint;
use crate::wire::{PromptInput, RequestBody};

/// Characters of a prompt tokenized for routing.
pub const MAX_ROUTING_PROMPT_CHARS: usize = 400_000;
/// Rendered prompts remembered per pool.
const CACHE_ENTRIES: usize = 512;

/// What routing needs to know about a prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptInfo {
    /// Prompt tokens (of the tokenized prefix, when the prompt was longer than the bound;
    /// estimated from the rest's bytes when only a head was tokenized: see [`analyse`]).
    pub tokens: usize,
    /// Chained hashes of its full blocks (of the head only, when [`PromptInfo::unfinished`]).
    pub hashes: Vec<SequenceHash>,
    /// Set when only a head was tokenized (no worker holds the prompt past it): what
    /// [`finish`] needs to tokenize the whole, off the request's path.
    pub unfinished: Option<Arc<Unfinished>>,
}

/// A prompt tokenized only as far as routing needed.
#[derive(Debug, PartialEq, Eq)]
pub struct Unfinished {
    text: Arc<str>,
    /// The head's hashes, which the whole's must start with.
    head: Vec<SequenceHash>,
    /// Tokens of the head's text (special tokens aside): what the whole adds past them teaches
    /// the pool's rate.
    head_tokens: usize,
    /// Bytes of the text the head covers.
    head_bytes: usize,
    key: u64,
    block_size: usize,
    cache_salt: Option<String>,
    /// Special tokens around the text's own (a completions prompt's BOS), or none.
    special: Arc<SpecialTokens>,
}

#[cfg(test)]
impl Unfinished {
    /// A prompt known by no head, for tests that only pass one around.
    pub(crate) fn for_test(text: &str) -> Unfinished {
        Unfinished {
            text: text.into(),
            head: Vec::new(),
            head_tokens: 0,
            head_bytes: 0,
            key: 0,
            block_size: 16,
            cache_salt: None,
            special: Arc::default(),
        }
    }
}

/// Tokens (at least one block) tokenized at first, enough to estimate the rest by its bytes;
/// while some worker holds all of it, the head grows through the text seen before (free), then
/// by one piece past it, or fourfold when nothing new was seen, until what is left is a
/// [`SHORT_TAIL_BYTES`] tail. One block is enough to know that no worker holds a prompt: its
/// first block is in every prefix a worker could match. A prompt whose beginning the tokenizer
/// has not seen is cut for that first look between words rather than where a cached piece
/// would end ([`PromptTokenizer::encode_first_head`]): on unique prompts that halved what
/// routing tokenized (64 tokens' worth of text instead of one or two 512-byte pieces).
const FIRST_HEAD_TOKENS: usize = 256;
/// A held head whose text leaves less than this, and at most one part in
/// [`SHORT_TAIL_PARTS`] of what the head covers, stops growing: the tail is estimated, not
/// tokenized. It is the new text of a prompt behind a cached prefix (a question after a shared
/// system prompt: a few dozen tokens, a few blocks for every holder of the prefix alike), and
/// tokenizing it is most of what routing would cost that request: its new words go through the
/// tokenizer's pipeline, whose tables a busy proxy finds cold (measured in the bench's
/// shared-prefix run: four or five calls on about 100 bytes, 0.35–1 ms of the request's time,
/// against 0.1 ms for the 2,000 tokens of its cached prefix). The whole is tokenized off the
/// request's path after its first token, as for any head ([`finish`]), so the same prompt
/// again is hashed in full.
const SHORT_TAIL_BYTES: usize = 512;
/// See [`SHORT_TAIL_BYTES`].
const SHORT_TAIL_PARTS: usize = 8;
/// The first head once the pool has learned its prompts' tokens per byte ([`PromptCache`]):
/// while the head's own rate agrees with the learned one within [`RATE_TOLERANCE`], the rest
/// is estimated at the two blended (the learned rate weighing as [`RATE_PRIOR_BYTES`] of
/// text); a text unlike the pool's usual grows to [`FIRST_HEAD_TOKENS`] and is estimated by
/// its own rate. Tokenizing is most of what routing costs a request.
const SMALL_HEAD_TOKENS: usize = 64;
/// A text shorter than this is looked at first by a small head even before the pool has
/// learned its rate: a first head of [`FIRST_HEAD_TOKENS`] would cover all of it (its first try
/// is six bytes a token), so on unique short prompts (a chat's opening question, a
/// classification call) routing would tokenize every prompt whole on the request's path, and
/// a pool of them would never learn its rate (only prompts finished off the path teach it).
/// The rest of such a text, a few hundred tokens at most, is estimated by the head's own rate
/// until the pool's is learned; a worker that holds the head still grows it.
const SHORT_TEXT_BYTES: usize = FIRST_HEAD_TOKENS * 6;
/// How far (relative) a small head's tokens per byte may be from the learned rate.
const RATE_TOLERANCE: f64 = 0.2;
/// Bytes of text the learned rate weighs as, against a small head's own bytes.
const RATE_PRIOR_BYTES: f64 = 1024.0;
/// Prompts finished whole before the learned rate is used.
const RATE_SAMPLES: u32 = 4;
/// What each earlier prompt's text keeps of its weight in the learned rate per later prompt.
const RATE_DECAY: f64 = 0.9;
/// Text past a head shorter than this teaches nothing: mostly the chat template's closing
/// tokens, whose rate is not the prompts'.
const MIN_RATE_BYTES: usize = 512;

/// Entries by key, and keys in insertion order.
#[derive(Debug, Default)]
struct Entries {
    by_key: HashMap<u64, Arc<PromptInfo>>,
    order: VecDeque<u64>,
}

/// Tokens per byte of the text past prompts' heads, learned from the prompts finished whole:
/// decayed sums of tokens and of bytes, so a long text weighs by its length.
#[derive(Debug, Default, Clone, Copy)]
struct Rate {
    tokens: f64,
    bytes: f64,
    samples: u32,
}

/// Recently tokenized prompts, first in first out, the pool's learned tokens per byte, and the
/// special tokens its workers add that its tokenizer does not say it adds.
#[derive(Debug, Default)]
pub struct PromptCache {
    entries: Mutex<Entries>,
    rate: Mutex<Rate>,
    /// Taken from the workers ([`crate::tokenizer_check`]) for the tokenizer of that
    /// [`PromptTokenizer::instance`]; else the tokenizer's own.
    adopted_special: Mutex<Option<(u64, Arc<SpecialTokens>)>>,
}

/// No special tokens (shared: a request without any allocates nothing for them).
static NO_SPECIAL_TOKENS: std::sync::LazyLock<Arc<SpecialTokens>> =
    std::sync::LazyLock::new(Arc::default);

/// A cache-key part for the special tokens around a text (0: none).
fn special_key(special: &SpecialTokens) -> u64 {
    if special.is_empty() {
        return 0;
    }
    let ids: Vec<u8> = special
        .before
        .iter()
        .chain([&u32::MAX])
        .chain(&special.after)
        .flat_map(|id| id.to_le_bytes())
        .collect();
    xxh3_64(&ids).rotate_left(48)
}

impl PromptCache {
    /// The learned tokens per byte of prompt text past a head, once enough prompts taught it.
    fn tokens_per_byte(&self) -> Option<f64> {
        let rate = *self.rate.lock().ok()?;
        (rate.samples >= RATE_SAMPLES && rate.bytes > 0.0).then(|| rate.tokens / rate.bytes)
    }

    /// Learn from a prompt's text past its head: `tokens` in `bytes`.
    fn learn_rate(&self, tokens: usize, bytes: usize) {
        if bytes < MIN_RATE_BYTES {
            return;
        }
        let Ok(mut rate) = self.rate.lock() else {
            return;
        };
        rate.tokens = rate.tokens * RATE_DECAY + tokens as f64;
        rate.bytes = rate.bytes * RATE_DECAY + bytes as f64;
        rate.samples = rate.samples.saturating_add(1);
    }

    fn get(&self, key: u64) -> Option<Arc<PromptInfo>> {
        self.entries.lock().ok()?.by_key.get(&key).cloned()
    }

    /// Forget every prompt, the learned rate and adopted special tokens (another tokenizer
    /// counts them otherwise).
    pub fn clear(&self) {
        self.clear_prompts();
        if let Ok(mut rate) = self.rate.lock() {
            *rate = Rate::default();
        }
        if let Ok(mut adopted) = self.adopted_special.lock() {
            *adopted = None;
        }
    }

    fn clear_prompts(&self) {
        if let Ok(mut entries) = self.entries.lock() {
            *entries = Entries::default();
        }
    }

    /// The special tokens this pool's prompts get from `tokenizer` when a request adds them:
    /// those taken from its workers for it, else its own.
    pub fn special_tokens(&self, tokenizer: &PromptTokenizer) -> Arc<SpecialTokens> {
        self.adopted_special
            .lock()
            .ok()
            .and_then(|adopted| {
                adopted
                    .as_ref()
                    .filter(|(instance, _)| *instance == tokenizer.instance())
                    .map(|(_, special)| special.clone())
            })
            .unwrap_or_else(|| tokenizer.special_tokens().clone())
    }

    /// From now on this pool's prompts get `special` from `tokenizer` when a request adds
    /// special tokens (its workers add those, whatever its tokenizer.json says); the prompts
    /// tokenized before are forgotten.
    pub fn adopt_special_tokens(&self, tokenizer: &PromptTokenizer, special: SpecialTokens) {
        if let Ok(mut adopted) = self.adopted_special.lock() {
            *adopted = Some((tokenizer.instance(), Arc::new(special)));
        }
        self.clear_prompts();
    }

    fn put(&self, key: u64, info: Arc<PromptInfo>) {
        let Ok(mut entries) = self.entries.lock() else {
            return;
        };
        let Entries { by_key, order } = &mut *entries;
        if by_key.insert(key, info).is_none() {
            order.push_back(key);
            while order.len() > CACHE_ENTRIES {
                if let Some(old) = order.pop_front() {
                    by_key.remove(&old);
                }
            }
        }
    }
}

/// What to tokenize: rendered text (and whether the worker adds special tokens around it), or
/// token ids the client sent itself.
enum Prompt {
    Text { text: String, special: bool },
    Tokens(Vec<u32>),
}

fn prompt_of(
    tokenizer: &PromptTokenizer,
    endpoint: Endpoint,
    request: &RequestBody<'_>,
) -> Result<Prompt, String> {
    let render = |messages: &[ChatMessage], inputs: &TemplateInputs| {
        tokenizer
            .render_chat_with(messages, inputs)
            .map_err(|e| e.to_string())
    };
    // vLLM adds the tokenizer's special tokens (a BOS) to a completions prompt unless told not
    // to, to a chat's only when told to (its template carries its own).
    let text = |text: String, by_default: bool| Prompt::Text {
        text,
        special: request.adds_special_tokens(by_default),
    };
    Ok(match endpoint {
        Endpoint::ChatCompletions => text(
            render(&request.chat_messages(), &request.template_inputs())?,
            false,
        ),
        Endpoint::Messages => {
            let (messages, inputs) = anthropic_chat_of(tokenizer, request)?;
            text(render(&messages, &inputs)?, false)
        }
        Endpoint::Responses => text(
            tokenizer
                .render_chat(&request.responses_messages())
                .map_err(|e| e.to_string())?,
            false,
        ),
        Endpoint::Completions => match request.prompt_input() {
            Some(Ok(PromptInput::Text(prompt))) => text(prompt.into_owned(), true),
            Some(Ok(PromptInput::Tokens(ids))) => Prompt::Tokens(ids),
            // A batch of prompts: route by the first.
            Some(Ok(PromptInput::Texts(texts))) => text(
                texts.into_iter().next().ok_or("empty prompt")?.into_owned(),
                true,
            ),
            Some(Ok(PromptInput::TokenBatches(batches))) => {
                Prompt::Tokens(batches.into_iter().next().ok_or("empty prompt")?)
            }
            Some(Err(error)) => return Err(error),
            None => return Err("no prompt".into()),
        },
        // Only the generating endpoints have a prompt the workers prefill.
        _ => return Err("no prompt".into()),
    })
}

/// An Anthropic Messages body as vLLM's `/v1/messages` hands it to the chat template (converted
/// to a chat completion first: see [`switchyard_kv::anthropic`]).
pub fn anthropic_chat_of(
    tokenizer: &PromptTokenizer,
    request: &RequestBody<'_>,
) -> Result<(Vec<ChatMessage>, TemplateInputs), String> {
    let ordered = request.ordered().ok_or("the body is not JSON")?;
    Ok(anthropic_chat(ordered, tokenizer.anthropic_rendering()))
}

fn truncate(text: &str, max_chars: usize) -> &str {
    match text.char_indices().nth(max_chars) {
        Some((byte, _)) => text.get(..byte).unwrap_or(text),
        None => text,
    }
}

/// The `cache_salt` a vLLM worker gets for a request of `tenant` whose client sent `client`.
///
/// A tenant with `cacheIsolation` gets a salt of its own (`t:` and a digest of its name) on
/// every request, so its blocks are never shared with (or timed by) another tenant. A salt the
/// client chose is kept but put in the `c:` namespace (after the tenant's, if any): whatever a
/// client sends, it cannot produce another tenant's salt.
pub fn worker_cache_salt(tenant: Option<&Tenant>, client: Option<&str>) -> Option<String> {
    let isolated = tenant.filter(|t| t.cache_isolation).map(|t| {
        let digest = Sha256::digest(t.name.as_bytes());
        let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
        format!("t:{hex}")
    });
    match (isolated, client) {
        (Some(tenant), Some(client)) => Some(format!("{tenant}/c:{client}")),
        (Some(tenant), None) => Some(tenant),
        (None, Some(client)) => Some(format!("c:{client}")),
        (None, None) => None,
    }
}

/// Tokenize a request for routing (CPU work: call off the async threads for big bodies).
/// `cache_salt` is the salt the worker will get: it keys the first block, as in vLLM.
pub fn analyse(
    tokenizer: &PromptTokenizer,
    cache: &PromptCache,
    endpoint: Endpoint,
    request: &RequestBody<'_>,
    block_size: usize,
    cache_salt: Option<&str>,
    held: &dyn Fn(&[SequenceHash]) -> bool,
) -> Result<Arc<PromptInfo>, String> {
    let hashes = |tokens: &[u32]| sequence_hashes_keyed(tokens, block_size, &[], cache_salt);
    let tokens = match prompt_of(tokenizer, endpoint, request)? {
        Prompt::Tokens(tokens) => tokens,
        Prompt::Text {
            text: whole,
            special: adds_special,
        } => {
            let text = truncate(&whole, MAX_ROUTING_PROMPT_CHARS);
            let salt_key = cache_salt.map_or(0, |salt| xxh3_64(salt.as_bytes()).rotate_left(17));
            // Special tokens (a BOS) go before the text's own tokens, and after them unless the
            // text was cut short here (the worker has more of it).
            let special = if adds_special {
                match cache.special_tokens(tokenizer) {
                    special if text.len() < whole.len() && !special.after.is_empty() => {
                        Arc::new(SpecialTokens {
                            before: special.before.clone(),
                            after: Vec::new(),
                        })
                    }
                    special => special,
                }
            } else {
                NO_SPECIAL_TOKENS.clone()
            };
            let key = xxh3_64(text.as_bytes())
                ^ block_size as u64
                ^ salt_key
                ^ tokenizer.instance().rotate_left(32)
                ^ special_key(&special);
            if let Some(hit) = cache.get(key) {
                return Ok(hit);
            }
            // Only as far as some worker holds the prompt's blocks: past the first block that
            // no worker (and no request in flight) holds, no worker can match, so the rest is
            // counted, not hashed.
            let learned = cache.tokens_per_byte();
            let first = if learned.is_some() || text.len() < SHORT_TEXT_BYTES {
                SMALL_HEAD_TOKENS
            } else {
                FIRST_HEAD_TOKENS
            };
            let mut want = block_size.max(first);
            let mut first_look = true;
            // Where the text seen before ended, when the last step ran through it.
            let mut past = None;
            loop {
                let head = if std::mem::take(&mut first_look) {
                    tokenizer.encode_first_head(text, want)
                } else if let Some(bytes) = past.take() {
                    tokenizer.encode_head_past(text, want, bytes)
                } else {
                    tokenizer.encode_head(text, want)
                };
                let (mut own, mut bytes) = head.map_err(|e| e.to_string())?;
                // Text seen before comes free: where it ends is likely where this prompt's
                // own text begins, so the next step tries one more piece, not four times more.
                let seen = tokenizer.extend_cached(text, &mut own, &mut bytes);
                let own_tokens = own.len();
                if bytes >= text.len() {
                    let tokens = special.wrap(own);
                    let info = Arc::new(PromptInfo {
                        tokens: tokens.len(),
                        hashes: hashes(&tokens),
                        unfinished: None,
                    });
                    cache.put(key, info.clone());
                    return Ok(info);
                }
                let tokens = if special.before.is_empty() {
                    own
                } else {
                    [special.before.as_slice(), &own].concat()
                };
                let head = hashes(&tokens);
                let tail = text.len() - bytes;
                let short_tail =
                    tail < SHORT_TAIL_BYTES && tail.saturating_mul(SHORT_TAIL_PARTS) <= bytes;
                if short_tail || !held(&head) {
                    let own_rate = own_tokens as f64 / bytes.max(1) as f64;
                    let per_byte = match learned {
                        // A long head measures its own text well enough.
                        _ if own_tokens >= FIRST_HEAD_TOKENS => own_rate,
                        Some(rate) if (own_rate / rate - 1.0).abs() <= RATE_TOLERANCE => {
                            (own_tokens as f64 + rate * RATE_PRIOR_BYTES)
                                / (bytes as f64 + RATE_PRIOR_BYTES)
                        }
                        // Unlike the pool's usual text (another script, code, digits): measure
                        // more of it.
                        Some(_) => {
                            want = FIRST_HEAD_TOKENS;
                            continue;
                        }
                        None => own_rate,
                    };
                    let rest = tail as f64 * per_byte;
                    return Ok(Arc::new(PromptInfo {
                        tokens: tokens.len() + rest.round() as usize + special.after.len(),
                        hashes: head.clone(),
                        unfinished: Some(Arc::new(Unfinished {
                            text: Arc::from(text),
                            head,
                            head_tokens: own_tokens,
                            head_bytes: bytes,
                            key,
                            block_size,
                            cache_salt: cache_salt.map(str::to_owned),
                            special,
                        })),
                    }));
                }
                want = if seen {
                    past = Some(bytes);
                    own_tokens + 1
                } else {
                    want.max(own_tokens).saturating_mul(4)
                };
            }
        }
    };
    Ok(Arc::new(PromptInfo {
        tokens: tokens.len(),
        hashes: hashes(&tokens),
        unfinished: None,
    }))
}

/// The whole of a prompt tokenized only as far as routing needed (CPU work: run it on the
/// blocking pool), remembered in `cache` for the next request with the same text.
pub fn finish(
    tokenizer: &PromptTokenizer,
    cache: &PromptCache,
    unfinished: &Unfinished,
) -> Option<Arc<PromptInfo>> {
    // Finished already (for a request that shared it while it was in flight): the same whole,
    // neither tokenized nor learned from twice.
    if let Some(known) = cache.get(unfinished.key) {
        return Some(known);
    }
    let own = tokenizer.encode(&unfinished.text).ok()?;
    let own_tokens = own.len();
    let tokens = unfinished.special.wrap(own);
    let info = Arc::new(PromptInfo {
        tokens: tokens.len(),
        hashes: sequence_hashes_keyed(
            &tokens,
            unfinished.block_size,
            &[],
            unfinished.cache_salt.as_deref(),
        ),
        unfinished: None,
    });
    if !info.hashes.starts_with(&unfinished.head) {
        // Checked at load on sample texts; a prompt found otherwise ends word cuts for good.
        tracing::warn!(
            "a prompt's head did not tokenize as the start of the whole: routing now tokenizes whole prompts with this tokenizer"
        );
        tokenizer.stop_cutting_words();
    } else {
        cache.learn_rate(
            own_tokens.saturating_sub(unfinished.head_tokens),
            unfinished.text.len().saturating_sub(unfinished.head_bytes),
        );
    }
    cache.put(unfinished.key, info.clone());
    Some(info)
}

/// The shipped tokenizer with a post-processor that puts a BOS (id 0) before every text
/// encoded with special tokens, as Llama 3's `tokenizer.json` does.
#[cfg(test)]
pub(crate) fn tokenizer_with_bos() -> PromptTokenizer {
    let mut json: serde_json::Value =
        serde_json::from_slice(switchyard_kv::tokenize::SHIPPED_TOKENIZER_JSON).unwrap();
    let bos = "<｜begin▁of▁sentence｜>";
    json["post_processor"] = serde_json::json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [0], "tokens": [bos]}}
    });
    PromptTokenizer::new(
        &serde_json::to_vec(&json).unwrap(),
        switchyard_kv::tokenize::SHIPPED_CHAT_TEMPLATE,
    )
    .unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`analyse`] of a Chat Completions request without a salt.
    fn analyse_chat(
        tokenizer: &PromptTokenizer,
        cache: &PromptCache,
        request: &RequestBody<'_>,
        block_size: usize,
        held: &dyn Fn(&[SequenceHash]) -> bool,
    ) -> Arc<PromptInfo> {
        analyse(
            tokenizer,
            cache,
            Endpoint::ChatCompletions,
            request,
            block_size,
            None,
            held,
        )
        .unwrap()
    }

    #[test]
    fn chat_prompts_hash_like_the_worker_renders_them() {
        let tokenizer = PromptTokenizer::shipped().unwrap();
        let cache = PromptCache::default();
        let body = br#"{"model":"m","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Tell me about rivers, lakes and the sea in some detail please."}]}"#;
        let parsed = crate::wire::parse(body).unwrap();
        let info = analyse_chat(&tokenizer, &cache, &parsed, 4, &|_| true);
        let rendered = tokenizer
            .render_chat(&switchyard_kv::tokenize::openai_messages(
                &serde_json::from_slice(body).unwrap(),
            ))
            .unwrap();
        let tokens = tokenizer.encode(&rendered).unwrap();
        assert_eq!(info.tokens, tokens.len());
        assert_eq!(info.hashes, sequence_hashes_keyed(&tokens, 4, &[], None));
        // The second time comes from the cache (same Arc).
        let again = analyse_chat(&tokenizer, &cache, &parsed, 4, &|_| true);
        assert!(Arc::ptr_eq(&info, &again));
        // A salted request hashes apart (and is cached apart).
        let salted = analyse(
            &tokenizer,
            &cache,
            Endpoint::ChatCompletions,
            &parsed,
            4,
            Some("t:1"),
            &|_| true,
        )
        .unwrap();
        assert_eq!(
            salted.hashes,
            sequence_hashes_keyed(&tokens, 4, &[], Some("t:1"))
        );
        assert_ne!(salted.hashes, info.hashes);
    }

    /// What the gateway hashes of a chat with tools, tool calls, reasoning, template arguments
    /// and content parts is what the simulator (vLLM's conversion, `openai_chat`) renders, and
    /// each of those inputs changes it.
    #[test]
    fn chats_with_tools_and_template_arguments_hash_like_the_worker_renders_them() {
        let template = "{% if tools %}{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}\
            {% for m in messages %}<{{ m.role }}>\
            {% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{{ p.text }};{% endfor %}{% endif %}\
            {% for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}\
            {{ m.reasoning_content or '' }}{{ m.tool_call_id or '' }}{% endfor %}\
            {% if add_generation_prompt %}<assistant>{% if enable_thinking is false %}<nothink>{% endif %}{% endif %}";
        let tokenizer =
            PromptTokenizer::new(switchyard_kv::tokenize::SHIPPED_TOKENIZER_JSON, template)
                .unwrap();
        let body = r#"{"model":"m","chat_template_kwargs":{"enable_thinking":false},
            "tools":[{"type":"function","function":{"name":"f","parameters":{"z":1,"a":[2]}}}],
            "messages":[{"role":"user","content":[{"type":"text","text":"one"},{"type":"text","text":"two"}]},
              {"role":"assistant","content":null,"reasoning":"why","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{\"y\":1,\"b\":2}"}}]},
              {"role":"tool","tool_call_id":"c","content":"done"}]}"#;
        let worker = |body: &str| {
            let ordered: switchyard_kv::chat_template::TemplateValue =
                serde_json::from_str(body).unwrap();
            let (messages, inputs) = switchyard_kv::tokenize::openai_chat(&ordered);
            let text = tokenizer.render_chat_with(&messages, &inputs).unwrap();
            (text.clone(), tokenizer.encode(&text).unwrap())
        };
        let (text, tokens) = worker(body);
        assert!(text.contains(r#"{"type": "function", "function": {"name": "f", "description": null, "parameters": {"z": 1, "a": [2]}}}"#), "{text}");
        assert!(
            text.contains(r#"f{"y": 1, "b": 2}why"#) && text.ends_with("<assistant><nothink>"),
            "{text}"
        );
        let cache = PromptCache::default();
        let gateway = |body: &str| {
            let parsed = crate::wire::parse(body.as_bytes()).unwrap();
            analyse_chat(&tokenizer, &cache, &parsed, 4, &|_| true)
        };
        let info = gateway(body);
        assert_eq!(info.tokens, tokens.len());
        assert_eq!(info.hashes, sequence_hashes_keyed(&tokens, 4, &[], None));
        // Without each input, another prompt (the gateway follows each one).
        for without in [
            body.replace(r#""chat_template_kwargs":{"enable_thinking":false},"#, ""),
            body.replace(r#""z":1,"#, ""),
            body.replace(r#""reasoning":"why","#, ""),
            body.replace(r#""reasoning":"why","#, r#""reasoning_content":"because","#),
            body.replace(r#""tool_call_id":"c","#, ""),
            // A string part, a refusal, a system message with Claude Code's billing line.
            body.replace(
                r#"{"type":"text","text":"two"}"#,
                r#""two",{"type":"refusal","refusal":"no"},{"type":"image_url","image_url":{"url":"u"}}"#,
            ),
            body.replace(
                r#""messages":["#,
                r#""messages":[{"role":"system","content":"x-anthropic-billing-header: cch=1\nBe brief."},"#,
            ),
        ] {
            let (other, other_tokens) = worker(&without);
            assert_ne!(other, text);
            assert_eq!(
                gateway(&without).hashes,
                sequence_hashes_keyed(&other_tokens, 4, &[], None)
            );
        }
    }

    /// An Anthropic request with tool use is hashed as vLLM's `/v1/messages` renders it: the
    /// simulator's render of the same body, with the tool call and its result in it.
    #[test]
    fn anthropic_requests_hash_as_vllm_converts_them() {
        let template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\
            {% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}\
            {{ m.tool_call_id or '' }}{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}<assistant>";
        let tokenizer =
            PromptTokenizer::new(switchyard_kv::tokenize::SHIPPED_TOKENIZER_JSON, template)
                .unwrap();
        let body = r#"{"model":"m","max_tokens":10,
            "system":[{"type":"text","text":"x-anthropic-billing-header: cch=7"},{"type":"text","text":"Be brief."}],
            "tools":[{"name":"ls","input_schema":{"type":"object"}}],
            "messages":[{"role":"user","content":"List."},
              {"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"ls","input":{"path":"."}}]},
              {"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"a.txt"}]}]}"#;
        let ordered: switchyard_kv::chat_template::TemplateValue =
            serde_json::from_str(body).unwrap();
        let (messages, inputs) =
            switchyard_kv::tokenize::anthropic_chat(&ordered, tokenizer.anthropic_rendering());
        let text = tokenizer.render_chat_with(&messages, &inputs).unwrap();
        assert!(
            text.starts_with(
                "<system>Be brief.<user>List.<assistant>[ls {\"path\": \".\"}]<tool>a.txtt1"
            ),
            "{text}"
        );
        let tokens = tokenizer.encode(&text).unwrap();
        let parsed = crate::wire::parse(body.as_bytes()).unwrap();
        let cache = PromptCache::default();
        let info = analyse(
            &tokenizer,
            &cache,
            Endpoint::Messages,
            &parsed,
            4,
            None,
            &|_| true,
        )
        .unwrap();
        assert_eq!(info.hashes, sequence_hashes_keyed(&tokens, 4, &[], None));
    }

    #[test]
    fn a_completions_prompt_starts_with_the_bos_vllm_adds_to_it() {
        let tokenizer = tokenizer_with_bos();
        let text = "The rivers of the north run cold and fast through the valleys.";
        let mut with_bos = vec![0];
        with_bos.extend(tokenizer.encode(text).unwrap());
        let tokens_of = |body: &str, endpoint: Endpoint| {
            let parsed = crate::wire::parse(body.as_bytes()).unwrap();
            let cache = PromptCache::default();
            let info = analyse(&tokenizer, &cache, endpoint, &parsed, 4, None, &|_| true);
            let info = info.unwrap();
            (info.tokens, info.hashes.clone())
        };
        let completions = format!(r#"{{"model":"m","prompt":"{text}"}}"#);
        assert_eq!(
            tokens_of(&completions, Endpoint::Completions),
            (
                with_bos.len(),
                sequence_hashes_keyed(&with_bos, 4, &[], None)
            )
        );
        // Unless the request says otherwise, as vLLM reads it.
        let without = format!(r#"{{"model":"m","prompt":"{text}","add_special_tokens":false}}"#);
        assert_eq!(
            tokens_of(&without, Endpoint::Completions).0,
            with_bos.len() - 1
        );
        // A chat prompt's template carries its own special tokens: none added by default.
        let chat = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{text}"}}]}}"#);
        let rendered = tokenizer
            .render_chat(&[switchyard_kv::tokenize::ChatMessage::new("user", text)])
            .unwrap();
        let chat_tokens = tokenizer.encode(&rendered).unwrap();
        assert_eq!(
            tokens_of(&chat, Endpoint::ChatCompletions).0,
            chat_tokens.len()
        );
        let asked = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"{text}"}}],"add_special_tokens":true}}"#
        );
        assert_eq!(
            tokens_of(&asked, Endpoint::ChatCompletions).0,
            chat_tokens.len() + 1
        );
    }

    #[test]
    fn a_long_completions_prompt_no_worker_holds_keeps_its_bos_in_head_and_whole() {
        let tokenizer = tokenizer_with_bos();
        let cache = PromptCache::default();
        let text: String = (0..400)
            .map(|i| format!("item{i} lantern orchard "))
            .collect();
        let body = serde_json::json!({"model": "m", "prompt": text}).to_string();
        let parsed = crate::wire::parse(body.as_bytes()).unwrap();
        // No worker holds it: routed by a head, the rest estimated.
        let route = || {
            analyse(
                &tokenizer,
                &cache,
                Endpoint::Completions,
                &parsed,
                4,
                None,
                &|_| false,
            )
            .unwrap()
        };
        let routed = route();
        let unfinished = routed.unfinished.clone().expect("routed by its head");
        let mut whole = vec![0];
        whole.extend(tokenizer.encode(&text).unwrap());
        let whole_hashes = sequence_hashes_keyed(&whole, 4, &[], None);
        assert!(whole_hashes.starts_with(&routed.hashes));
        assert!(routed.hashes.len() < whole_hashes.len());
        let estimate = routed.tokens as f64 / whole.len() as f64;
        assert!((0.8..1.25).contains(&estimate), "{estimate}");
        // Finished off the path: the whole with its BOS, word cuts still trusted.
        let finished = finish(&tokenizer, &cache, &unfinished).unwrap();
        assert_eq!(finished.tokens, whole.len());
        assert_eq!(finished.hashes, whole_hashes);
        assert!(tokenizer.cuts_words());
        // And found whole next time.
        assert!(Arc::ptr_eq(&route(), &finished));
    }

    #[test]
    fn a_prompt_no_worker_holds_is_hashed_only_as_far_as_its_first_blocks() {
        let tokenizer = PromptTokenizer::shipped().unwrap();
        let cache = PromptCache::default();
        let long: String = (0..600)
            .map(|i| format!("river{i} mountain garden "))
            .collect();
        let body =
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": long}]})
                .to_string();
        let parsed = crate::wire::parse(body.as_bytes()).unwrap();
        let rendered = tokenizer.render_chat(&parsed.chat_messages()).unwrap();
        // Tokenized whole by another tokenizer: this one has seen none of the text.
        let reference = PromptTokenizer::shipped().unwrap();
        let tokens = reference.encode(&rendered).unwrap();
        let all = sequence_hashes_keyed(&tokens, 16, &[], None);
        // Nobody holds anything: a head is hashed, the rest estimated.
        let asked = std::cell::Cell::new(0);
        let nobody = |_: &[SequenceHash]| {
            asked.set(asked.get() + 1);
            false
        };
        let head = analyse_chat(&tokenizer, &cache, &parsed, 16, &nobody);
        assert_eq!(asked.get(), 1);
        assert!(
            head.hashes.len() >= 16 && head.hashes.len() < all.len() / 4,
            "{}",
            head.hashes.len()
        );
        assert_eq!(head.hashes, all[..head.hashes.len()]);
        let error = head.tokens.abs_diff(tokens.len()) as f64 / tokens.len() as f64;
        assert!(
            error < 0.1,
            "estimated {} of {} tokens",
            head.tokens,
            tokens.len()
        );
        // The whole, later: exact, and remembered for the same prompt.
        let whole = finish(&tokenizer, &cache, head.unfinished.as_ref().unwrap()).unwrap();
        assert_eq!((whole.tokens, &whole.hashes), (tokens.len(), &all));
        let again = analyse_chat(&tokenizer, &cache, &parsed, 16, &nobody);
        assert!(Arc::ptr_eq(&again, &whole));
        // Held as far as 20 blocks: the head grows past them, then stops.
        let cache = PromptCache::default();
        let twenty = |hashes: &[SequenceHash]| hashes.len() <= 20;
        let deeper = analyse_chat(&tokenizer, &cache, &parsed, 16, &twenty);
        assert!(deeper.hashes.len() > head.hashes.len() && deeper.unfinished.is_some());
        assert_eq!(deeper.hashes, all[..deeper.hashes.len()]);
    }

    #[test]
    fn once_the_pool_has_learned_its_text_a_small_head_estimates_the_rest() {
        let tokenizer = PromptTokenizer::shipped().unwrap();
        let reference = PromptTokenizer::shipped().unwrap();
        let nobody = |_: &[SequenceHash]| false;
        // Texts that share no piece (a repeating text would be found in the segment cache).
        let mix = |i: usize, k: usize, seed: usize| {
            (i.wrapping_mul(31).wrapping_add(k))
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed.wrapping_mul(0x9E37_79B9))
                >> 7
        };
        let words = ["river", "mountain", "garden", "stone", "lake", "cloud"];
        let plain = |seed: usize| -> String {
            (0..1500)
                .map(|i| {
                    format!(
                        "{}{} ",
                        words[mix(i, 0, seed) % words.len()],
                        mix(i, 1, seed) % 997
                    )
                })
                .collect()
        };
        // Made-up words: about twice the tokens per byte.
        let consonants = b"bcdfghjklmnpqrstvwxz";
        let dense = |seed: usize| -> String {
            (0..1500usize)
                .map(|i| {
                    let letter =
                        |k: usize| char::from(consonants[mix(i, k, seed) % consonants.len()]);
                    format!("{}{}{}{} ", letter(1), letter(2), letter(3), letter(4))
                })
                .collect()
        };
        // Tokenized whole (exactly) by another tokenizer, and by routing (head and estimate).
        let routed = |cache: &PromptCache, content: &str| {
            let body =
                serde_json::json!({"model": "m", "messages": [{"role": "user", "content": content}]})
                    .to_string();
            let parsed = crate::wire::parse(body.as_bytes()).unwrap();
            let rendered = tokenizer.render_chat(&parsed.chat_messages()).unwrap();
            let exact = reference.encode(&rendered).unwrap().len();
            let info = analyse_chat(&tokenizer, cache, &parsed, 16, &nobody);
            let error = info.tokens.abs_diff(exact) as f64 / exact as f64;
            assert!(error < 0.1, "estimated {} of {exact} tokens", info.tokens);
            info
        };
        let long_head = FIRST_HEAD_TOKENS / 16;
        let learned = |text: &dyn Fn(usize) -> String| {
            let cache = PromptCache::default();
            // Until RATE_SAMPLES prompts were finished whole, heads are long; each teaches the
            // rate.
            for seed in 0..RATE_SAMPLES as usize {
                let info = routed(&cache, &text(seed));
                assert!(info.hashes.len() >= long_head);
                let unfinished = info.unfinished.as_ref().unwrap();
                let whole = finish(&tokenizer, &cache, unfinished).unwrap();
                assert_eq!(whole.hashes[..info.hashes.len()], info.hashes);
                // Finished again (a request that shared it, then its own first token): the
                // same whole, not tokenized or learned from twice.
                assert!(Arc::ptr_eq(
                    &whole,
                    &finish(&tokenizer, &cache, unfinished).unwrap()
                ));
            }
            assert_eq!(cache.rate.lock().unwrap().samples, RATE_SAMPLES);
            cache
        };
        let fresh = RATE_SAMPLES as usize + 1;
        // Then a new prompt of the same kind is hashed only as far as a small head.
        let small = routed(&learned(&plain), &plain(fresh));
        assert!(
            small.hashes.len() >= 2 && small.hashes.len() < long_head,
            "{} blocks",
            small.hashes.len()
        );
        // Its beginning unseen, that head is cut between words, short of a 512-byte piece.
        let small_bytes = small.unfinished.as_ref().unwrap().head_bytes;
        assert!(small_bytes < 512, "{small_bytes} bytes");
        // Text unlike the pool's (here half as dense) is estimated by its own long head.
        let unlike = routed(&learned(&dense), &plain(fresh));
        assert!(
            unlike.hashes.len() >= long_head,
            "{} blocks",
            unlike.hashes.len()
        );
    }

    #[test]
    fn the_learned_rate_weighs_texts_by_their_length_and_skips_short_tails() {
        let cache = PromptCache::default();
        // Short tails (mostly the chat template's closing tokens) teach nothing.
        for _ in 0..10 {
            cache.learn_rate(5, MIN_RATE_BYTES - 1);
        }
        assert_eq!(cache.rate.lock().unwrap().samples, 0);
        for _ in 1..RATE_SAMPLES {
            cache.learn_rate(1000, 4000);
        }
        assert_eq!(cache.tokens_per_byte(), None, "too few samples yet");
        cache.learn_rate(3000, 6000);
        // Decayed sums: 0.345 tokens per byte, where the average of the four ratios would
        // be 0.3125 (the long text weighs by its length).
        let decayed = |per: f64, last: f64| {
            (per * (RATE_DECAY.powi(3) + RATE_DECAY.powi(2) + RATE_DECAY)) + last
        };
        let expected = decayed(1000.0, 3000.0) / decayed(4000.0, 6000.0);
        let learned = cache.tokens_per_byte().unwrap();
        assert!((learned - expected).abs() < 1e-9, "{learned} vs {expected}");
        assert!(learned > 0.34, "{learned}");
    }

    #[test]
    fn a_prompt_in_flight_is_tokenized_whole_when_a_later_one_shares_its_head() {
        use crate::kv::KvRegistry;
        use switchyard_kv::index::WorkerId;
        let tokenizer = PromptTokenizer::shipped().unwrap();
        let kv =
            KvRegistry::default().pool(&switchyard_snapshot::snapshot::PoolId::new("ns", "p"), 16);
        let system: String = (0..800)
            .map(|i| format!("river{i} mountain garden "))
            .collect();
        let chat = |system: &str, question: &str| {
            serde_json::json!({"model": "m", "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question}]})
            .to_string()
        };
        let analysed = |body: &str| {
            let parsed = crate::wire::parse(body.as_bytes()).unwrap();
            let held = |hashes: &[SequenceHash]| kv.holds_all(hashes, &tokenizer);
            analyse_chat(&tokenizer, &kv.prompts, &parsed, 16, &held)
        };
        // Two prompts nobody holds, sent to workers 0 and 1: known by their heads only.
        let first = analysed(&chat(&system, "What is first?"));
        let lakes: String = (0..800).map(|i| format!("lake{i} valley stone ")).collect();
        let other = analysed(&chat(&lakes, "Hello?"));
        assert!(first.unfinished.is_some() && other.unfinished.is_some());
        let _first = kv.predictions.add(WorkerId(0), first.clone(), 0);
        let _other = kv.predictions.add(WorkerId(1), other.clone(), 0);
        // A second request with the first's system prompt, before any KV event: the first is
        // tokenized whole for it, so it matches the whole system prompt on worker 0.
        let second = analysed(&chat(&system, "And what is second?"));
        let system_blocks = tokenizer.encode(&system).unwrap().len() / 16;
        let overlap = kv.overlap(&second.hashes);
        assert!(
            overlap.depth(WorkerId(0)) as usize >= system_blocks,
            "{} of {system_blocks}",
            overlap.depth(WorkerId(0))
        );
        assert!(second.hashes.len() > first.hashes.len() * 4);
        // The prompt it shares nothing with stays a head.
        let mut unrelated = switchyard_kv::index::Overlap::default();
        kv.predictions.raise(&other.hashes, &mut unrelated);
        assert_eq!(unrelated.depth(WorkerId(1)) as usize, other.hashes.len());
        let tokenized = std::cell::Cell::new(0);
        kv.predictions.finish_under(
            &[other.hashes.clone(), vec![SequenceHash(1)]].concat(),
            |u| {
                tokenized.set(tokenized.get() + 1);
                finish(&tokenizer, &kv.prompts, u)
            },
        );
        assert_eq!(tokenized.get(), 1, "the other prompt is still only a head");
        // Nothing is tokenized for a request that does not run past a head.
        kv.predictions.finish_under(&first.hashes, |_| {
            tokenized.set(tokenized.get() + 1);
            None
        });
        assert_eq!(tokenized.get(), 1);
    }

    #[test]
    fn another_replicas_prompt_in_prefill_is_placed_from_its_sampled_blocks() {
        // Heads of 16 blocks of 16 tokens, and of two of 128: shorter than a sample's stride,
        // found by the sample of the first block.
        for block_size in [16, 128] {
            placed_from_sampled_blocks(block_size, false);
        }
        // With the pieces the first replica tokenized (they ride on its datagrams), the other
        // tokenizes none of the system prompt itself.
        placed_from_sampled_blocks(16, true);
    }

    fn placed_from_sampled_blocks(block_size: usize, share_pieces: bool) {
        use crate::kv::{KvRegistry, PEER_SAMPLE_BLOCKS, PeerPrefixes};
        use switchyard_kv::index::WorkerId;
        // Each replica its own tokenizer (and segment cache), as two processes have.
        let tokenizers = [
            PromptTokenizer::shipped().unwrap(),
            PromptTokenizer::shipped().unwrap(),
        ];
        let pool = switchyard_snapshot::snapshot::PoolId::new("ns", "p");
        // Two replicas in front of the same pool.
        let (sender, receiver) = (
            KvRegistry::default().pool(&pool, block_size),
            KvRegistry::default().pool(&pool, block_size),
        );
        let system: String = (0..800)
            .map(|i| format!("river{i} mountain garden "))
            .collect();
        let chat = |question: &str| {
            serde_json::json!({"model": "m", "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question}]})
            .to_string()
        };
        let analysed = |replica: usize, kv: &crate::kv::PoolKv, body: &str| {
            let tokenizer = &tokenizers[replica];
            let parsed = crate::wire::parse(body.as_bytes()).unwrap();
            let held = |hashes: &[SequenceHash]| kv.holds_all(hashes, tokenizer);
            analyse_chat(tokenizer, &kv.prompts, &parsed, block_size, &held)
        };
        let tokenizer = &tokenizers[0];
        // Both offer the pieces they tokenize to the other from now on.
        for tokenizer in &tokenizers {
            tokenizer.new_pieces(0);
        }
        // The first replica sends a prompt nobody holds to worker 2, and (as a replica with
        // peers does) tokenizes it whole while the worker prefills it.
        let first = analysed(0, &sender, &chat("What is first?"));
        let whole = finish(
            tokenizer,
            &sender.prompts,
            first.unfinished.as_ref().unwrap(),
        )
        .unwrap();
        let prediction = sender.predictions.add(WorkerId(2), first, 0);
        let (predictions, id) = prediction.handle();
        predictions.finish(id, whole.clone());
        let told = sender.predictions.prefilling();
        let [(worker, sampled)] = told.as_slice() else {
            panic!("{told:?}")
        };
        assert_eq!(*worker, WorkerId(2));
        // The first block, every fourth, the last.
        assert_eq!(
            sampled.len(),
            whole.hashes.len().div_ceil(PEER_SAMPLE_BLOCKS) + 1
        );

        // Before it hears of it, the other replica knows the prompt by its head only, and no
        // worker holds it.
        let second = chat("And what is second?");
        let before = analysed(1, &receiver, &second);
        assert!(before.unfinished.is_some());
        assert_eq!(before.hashes.len(), 256 / block_size);
        assert_eq!(receiver.overlap(&before.hashes).deepest(), 0);
        // Told, it tokenizes its own prompt as far as the first's reaches, and places it on
        // worker 2 with the whole system prompt (to within a sample).
        receiver.set_peer_prefixes(PeerPrefixes::new(&told));
        let (pieces, _) = tokenizer.new_pieces(usize::MAX);
        // (What its first look tokenized it has offered already.)
        tokenizers[1].new_pieces(usize::MAX);
        if share_pieces {
            assert!(tokenizers[1].adopt_pieces(&pieces) > 0);
        }
        let after = analysed(1, &receiver, &second);
        let (tokenized, _) = tokenizers[1].new_pieces(usize::MAX);
        assert_eq!(
            tokenized.is_empty(),
            share_pieces,
            "{} pieces",
            tokenized.len()
        );
        let system_blocks = tokenizer.encode(&system).unwrap().len() / block_size;
        let depth = receiver.overlap(&after.hashes).depth(WorkerId(2)) as usize;
        // Through pieces seen before a head stops short of a short tail (the last piece of
        // the system prompt and the question), estimated, as behind one proxy.
        let short_tail_blocks = if share_pieces {
            assert!(after.unfinished.is_some());
            SHORT_TAIL_BYTES / 4 / block_size
        } else {
            0
        };
        assert!(
            depth + PEER_SAMPLE_BLOCKS + short_tail_blocks > system_blocks
                && depth <= after.hashes.len(),
            "{depth} of {system_blocks}"
        );
        assert_eq!(receiver.overlap(&after.hashes).depth(WorkerId(1)), 0);

        // Past its first token the worker's KV events say where the prompt is: the first
        // replica stops telling; once its request ends, it holds no prediction either.
        prediction.prefilled(true);
        assert!(sender.predictions.prefilling().is_empty());
        assert_eq!(sender.predictions.len(), 1);
        drop(prediction);
        assert!(sender.predictions.is_empty());
    }

    #[test]
    fn a_held_head_grows_through_text_seen_before_and_one_piece_past_it() {
        let tokenizer = PromptTokenizer::shipped().unwrap();
        let cache = PromptCache::default();
        let system: String = (0..700).map(|i| format!("river{i} mountain ")).collect();
        let chat = |question: &str| {
            serde_json::json!({"model": "m", "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question}]})
            .to_string()
        };
        let analysed = |body: &str, held: &dyn Fn(&[SequenceHash]) -> bool| {
            let parsed = crate::wire::parse(body.as_bytes()).unwrap();
            analyse_chat(&tokenizer, &cache, &parsed, 64, held)
        };
        // The system prompt is seen once, whole.
        let first = analysed(&chat("Short question?"), &|_| true);
        assert!(first.unfinished.is_none());
        let system_blocks = tokenizer.encode(&system).unwrap().len() / 64;
        // A second prompt behind it with a long text of its own, a worker holding the system
        // prompt's blocks: the head stops a piece past the system prompt, not fourfold beyond.
        let own: String = (0..2000).map(|i| format!("lake{i} stone ")).collect();
        let holder = |hashes: &[SequenceHash]| hashes.len() <= system_blocks;
        let second = analysed(&chat(&own), &holder);
        assert!(second.unfinished.is_some());
        assert!(
            second.hashes.len() >= system_blocks && second.hashes.len() <= system_blocks + 4,
            "{} blocks, the system prompt {system_blocks}",
            second.hashes.len()
        );
        assert_eq!(
            second.hashes[..system_blocks],
            first.hashes[..system_blocks]
        );
    }

    #[test]
    fn a_held_head_leaves_a_short_tail_estimated_and_the_whole_for_later() {
        let tokenizer = PromptTokenizer::shipped().unwrap();
        let cache = PromptCache::default();
        let system: String = (0..700).map(|i| format!("river{i} mountain ")).collect();
        let chat = |system: &str, question: &str| {
            serde_json::json!({"model": "m", "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question}]})
            .to_string()
        };
        let reference = PromptTokenizer::shipped().unwrap();
        let whole_of = |body: &str| {
            let parsed = crate::wire::parse(body.as_bytes()).unwrap();
            let rendered = reference.render_chat(&parsed.chat_messages()).unwrap();
            reference.encode(&rendered).unwrap()
        };
        let asked = std::cell::Cell::new(0);
        let everyone = |_: &[SequenceHash]| {
            asked.set(asked.get() + 1);
            true
        };
        let analysed = |body: &str, block_size: usize| {
            let parsed = crate::wire::parse(body.as_bytes()).unwrap();
            analyse_chat(&tokenizer, &cache, &parsed, block_size, &everyone)
        };
        // The system prompt is seen once, whole.
        let first = chat(&system, "Short question?");
        analysed(&first, 16);
        // A question of a few dozen tokens behind it, every block held: the head stops where the
        // text seen before ends, and the question is estimated, not tokenized.
        let second = chat(
            &system,
            "And what of lakes7 stones3, clouds9 and the long rains?",
        );
        asked.set(0);
        let info = analysed(&second, 16);
        let tokens = whole_of(&second);
        let all = sequence_hashes_keyed(&tokens, 16, &[], None);
        assert!(info.unfinished.is_some());
        assert_eq!(asked.get(), 0, "nothing left worth asking about");
        assert!(
            info.hashes.len() < all.len() && info.hashes.len() + 8 >= all.len(),
            "{} of {} blocks",
            info.hashes.len(),
            all.len()
        );
        assert_eq!(info.hashes, all[..info.hashes.len()]);
        let error = info.tokens.abs_diff(tokens.len()) as f64 / tokens.len() as f64;
        assert!(
            error < 0.02,
            "estimated {} of {}",
            info.tokens,
            tokens.len()
        );
        // Later, off the request's path, the whole: the same prompt again is hashed in full.
        let whole = finish(&tokenizer, &cache, info.unfinished.as_ref().unwrap()).unwrap();
        assert_eq!(whole.hashes, all);
        let again = analysed(&second, 16);
        assert!(Arc::ptr_eq(&again, &whole));
        // A tail that is short but a large part of a short prompt is tokenized: the head would
        // say too little of the prompt.
        let small_system = "You answer in one line.";
        let short = chat(small_system, "Where do rivers1 end?");
        analysed(&short, 4);
        let other = chat(small_system, "Which mountains2 are the oldest, and why so?");
        let info = analysed(&other, 4);
        let tokens = whole_of(&other);
        assert!(info.unfinished.is_none());
        assert_eq!(
            (info.tokens, &info.hashes),
            (tokens.len(), &sequence_hashes_keyed(&tokens, 4, &[], None))
        );
    }

    #[test]
    fn worker_salts_keep_tenants_and_clients_apart() {
        let tenant = |name: &str, isolated: bool| Tenant {
            name: name.into(),
            labels: Default::default(),
            key_sha256: Vec::new(),
            key_secrets: Vec::new(),
            models: Vec::new(),
            rate_limits: Default::default(),
            default: false,
            cache_isolation: isolated,
        };
        let (a, b) = (tenant("ns/a", true), tenant("ns/b", true));
        let open = tenant("ns/open", false);
        let salt_a = worker_cache_salt(Some(&a), None).unwrap();
        assert!(salt_a.starts_with("t:"));
        assert_ne!(Some(salt_a.clone()), worker_cache_salt(Some(&b), None));
        assert_eq!(worker_cache_salt(Some(&open), None), None);
        assert_eq!(worker_cache_salt(None, None), None);
        // A client cannot name another tenant's salt: its own goes to the c: namespace.
        assert_eq!(
            worker_cache_salt(Some(&open), Some(&salt_a)),
            Some(format!("c:{salt_a}"))
        );
        assert_eq!(
            worker_cache_salt(Some(&a), Some("x")),
            Some(format!("{salt_a}/c:x"))
        );
    }

    #[test]
    fn token_id_prompts_and_bounds() {
        let tokenizer = PromptTokenizer::shipped().unwrap();
        let cache = PromptCache::default();
        let info = analyse(
            &tokenizer,
            &cache,
            Endpoint::Completions,
            &crate::wire::parse(br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9]}"#).unwrap(),
            4,
            None,
            &|_| true,
        )
        .unwrap();
        assert_eq!((info.tokens, info.hashes.len()), (9, 2));
        assert_eq!(truncate("héllo", 2), "hé");
        assert!(
            analyse(
                &tokenizer,
                &cache,
                Endpoint::Completions,
                &crate::wire::parse(br#"{"model":"m"}"#).unwrap(),
                4,
                None,
                &|_| true,
            )
            .is_err()
        );
    }
}
