//! Whether a pool's tokenizer gives the token ids its workers give.
//!
//! The prefix index knows what a worker holds by hashing the token ids of its KV events, and a
//! request by hashing the ids the pool's tokenizer gives its prompt. A pool whose tokenizer or
//! chat template differs from its workers' (another model's, the shipped default left in place)
//! never finds a prompt cached: routing falls back to queues alone and nothing says so. So once
//! per tokenizer a pool is given, the proxy asks one of its vLLM workers to tokenize two fixed
//! probes (`POST /tokenize`: a short conversation, and a completions prompt, which vLLM gives
//! the tokenizer's special tokens) and compares the ids with its own. A difference is logged at
//! warn with where the ids part, and `switchyard_pool_tokenizer_agrees{pool, prompt}` reads 0
//! (1 when they agree; absent until a worker answered). The probes are fixed text: nothing a
//! client sent.
//!
//! A worker that cannot be reached is tried again (every worker in turn, backing off to a
//! minute); one that answers `/tokenize` with 404 (not vLLM, or a build without the route)
//! ends the check without a verdict.
//!
//! One difference is mended rather than reported: a worker that puts special tokens around a
//! completions prompt (a BOS) that the pool's `tokenizer.json` does not name, as transformers
//! does from `tokenizer_config.json`'s `add_bos_token` for Llama 2, Mistral or DeepSeek: when
//! the worker's ids are the pool's with a few more before or after, the pool's tokenizer adds
//! those from then on (for every pool that loads the same files).

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use switchyard_kv::tokenize::{ChatMessage, PromptTokenizer};
use switchyard_snapshot::PoolId;

use crate::config::ConfigStore;
use crate::kv::ProbeKind;

/// The conversation probe: every role the usual templates render, a few kinds of text.
const PROBE_CHAT: [(&str, &str); 4] = [
    ("system", "You are a helpful assistant. Answer briefly."),
    (
        "user",
        "What is the capital of France? Reply in one word, then spell it backwards.",
    ),
    ("assistant", "Paris. Backwards: sirap."),
    (
        "user",
        "And of Japan? Also give its population in 2020 (roughly), e.g. \"14 million\".",
    ),
];
/// The completions probe.
const PROBE_PROMPT: &str =
    "The quick brown fox jumps over the lazy dog.\nNumbers: 12345, 3.14159; symbols: #@$%&*()";
/// Longest wait between tries.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// What a worker said to one probe.
enum Reply {
    Ids(Vec<u32>),
    /// It answered 404 or 405: no such route (not vLLM), or no such model.
    NoRoute(u16),
    /// Not reached, or no ids in its answer: try again later.
    Failed,
}

/// Check the tokenizer of `pool` (as the live table has it at each try) against its workers
/// until one answers; the verdict goes to the pool's KV state and the log.
pub async fn run(store: Arc<ConfigStore>, pool: PoolId) {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap_or_default();
    let mut backoff = Duration::from_secs(1);
    loop {
        if check(&client, &store, &pool).await {
            return;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One try over the pool's workers; whether the check is over.
async fn check(client: &reqwest::Client, store: &ConfigStore, id: &PoolId) -> bool {
    let Some(table) = store.current() else {
        return false;
    };
    let Some(pool) = table.pool(id) else {
        return true;
    };
    let Some(tokenizer) = pool.tokenizer.clone() else {
        return true;
    };
    let served = pool.config.served_model.as_str();
    for worker in &pool.workers {
        let url = format!("http://{}/tokenize", worker.address);
        let mut verdicts = Vec::new();
        for kind in ProbeKind::ALL {
            match ask(client, &url, &probe_body(kind, served)).await {
                Reply::Ids(theirs) => verdicts.push((kind, theirs)),
                Reply::NoRoute(status) => {
                    tracing::info!(
                        pool = %id,
                        worker = %worker.address,
                        status,
                        "cannot check the pool's tokenizer: the worker answered POST /tokenize with this status (not vLLM, or not the pool's model)"
                    );
                    return true;
                }
                Reply::Failed => break,
            }
        }
        if verdicts.len() < ProbeKind::ALL.len() {
            continue;
        }
        for (kind, theirs) in verdicts {
            let mut ours = probe_ids(&tokenizer, kind).unwrap_or_default();
            if kind == ProbeKind::Completions && ours != theirs {
                // The worker's tokenizer may add a BOS its tokenizer.json does not name
                // (transformers reads `add_bos_token` from tokenizer_config.json): take it.
                let plain = tokenizer.encode(PROBE_PROMPT).unwrap_or_default();
                if tokenizer.adopt_special_tokens(&plain, &theirs) {
                    let (before, after) = tokenizer.special_tokens();
                    tracing::info!(pool = %id, worker = %worker.address, before = ?before, after = ?after, "the pool's tokenizer now adds the special tokens its worker adds to a completions prompt");
                    pool.kv.prompts.clear();
                    ours = probe_ids(&tokenizer, kind).unwrap_or_default();
                }
            }
            let agrees = ours == theirs;
            pool.kv.tokenizer_agreement.set(kind, Some(agrees));
            if agrees {
                tracing::info!(pool = %id, worker = %worker.address, prompt = kind.label(), tokens = ours.len(), "the pool's tokenizer agrees with its workers'");
            } else {
                tracing::warn!(
                    pool = %id,
                    worker = %worker.address,
                    prompt = kind.label(),
                    tokens = ours.len(),
                    worker_tokens = theirs.len(),
                    first_difference = first_difference(&ours, &theirs),
                    "the pool's tokenizer gives a probe prompt other token ids than its worker: routing cannot find such prompts in the workers' KV caches; set the pool's spec.tokenizer to the workers' tokenizer.json and chat template"
                );
            }
        }
        return true;
    }
    false
}

/// The `/tokenize` request for a probe, as vLLM takes it.
fn probe_body(kind: ProbeKind, model: &str) -> Value {
    match kind {
        ProbeKind::Chat => {
            let messages: Vec<Value> = PROBE_CHAT
                .iter()
                .map(|(role, content)| json!({"role": role, "content": content}))
                .collect();
            json!({"model": model, "messages": messages, "add_generation_prompt": true})
        }
        ProbeKind::Completions => json!({"model": model, "prompt": PROBE_PROMPT}),
    }
}

/// The ids the pool's tokenizer gives a probe, as routing tokenizes such a prompt.
fn probe_ids(
    tokenizer: &PromptTokenizer,
    kind: ProbeKind,
) -> Result<Vec<u32>, switchyard_kv::tokenize::TokenizeError> {
    match kind {
        ProbeKind::Chat => {
            let messages: Vec<ChatMessage> = PROBE_CHAT
                .iter()
                .map(|(role, content)| ChatMessage {
                    role: (*role).to_owned(),
                    content: (*content).to_owned(),
                })
                .collect();
            tokenizer.encode_chat(&messages)
        }
        ProbeKind::Completions => tokenizer.encode_with_special_tokens(PROBE_PROMPT),
    }
}

async fn ask(client: &reqwest::Client, url: &str, body: &Value) -> Reply {
    let Ok(response) = client.post(url).json(body).send().await else {
        return Reply::Failed;
    };
    let status = response.status().as_u16();
    if status == 404 || status == 405 {
        return Reply::NoRoute(status);
    }
    if !response.status().is_success() {
        return Reply::Failed;
    }
    let Ok(answer) = response.json::<Value>().await else {
        return Reply::Failed;
    };
    let ids: Option<Vec<u32>> = answer
        .get("tokens")
        .and_then(Value::as_array)
        .and_then(|ids| {
            ids.iter()
                .map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()))
                .collect()
        });
    ids.map_or(Reply::Failed, Reply::Ids)
}

/// Where two id sequences part (the shorter's length when one is the start of the other).
fn first_difference(a: &[u32], b: &[u32]) -> usize {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .unwrap_or(a.len().min(b.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_are_tokenized_as_routing_tokenizes_them() {
        let tokenizer = PromptTokenizer::shipped().unwrap();
        let chat = probe_ids(&tokenizer, ProbeKind::Chat).unwrap();
        let rendered = tokenizer
            .render_chat(&switchyard_kv::tokenize::openai_messages(&probe_body(
                ProbeKind::Chat,
                "m",
            )))
            .unwrap();
        assert_eq!(chat, tokenizer.encode(&rendered).unwrap());
        assert!(rendered.contains("sirap"));
        let completions = probe_ids(&tokenizer, ProbeKind::Completions).unwrap();
        assert_eq!(completions, tokenizer.encode(PROBE_PROMPT).unwrap());
    }

    #[test]
    fn the_first_difference_is_where_the_ids_part() {
        assert_eq!(first_difference(&[1, 2, 3], &[1, 2, 3]), 3);
        assert_eq!(first_difference(&[1, 2, 3], &[1, 9, 3]), 1);
        assert_eq!(first_difference(&[1, 2], &[1, 2, 3]), 2);
        assert_eq!(first_difference(&[], &[7]), 0);
    }
}
