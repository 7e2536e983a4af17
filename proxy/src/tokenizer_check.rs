//! Whether a pool's tokenizer gives the token ids its workers give.
//!
//! The prefix index knows what a worker holds by hashing the token ids of its KV events, and a
//! request by hashing the ids the pool's tokenizer gives its prompt. A pool whose tokenizer or
//! chat template differs from its workers' (another model's, the shipped default left in place)
//! never finds a prompt cached: routing falls back to queues alone and nothing says so. So once
//! per tokenizer, served model and block size a pool is given, the proxy asks its vLLM workers
//! to tokenize two fixed probes (`POST /tokenize`: a short conversation, and a completions
//! prompt, which vLLM gives the tokenizer's special tokens) and compares the first answer to
//! each with the ids routing would hash. A difference is logged at warn with where the ids
//! part, and `switchyard_pool_tokenizer_agrees{pool, prompt}` reads 0 (1 when they agree;
//! absent until a worker answered). The probes are fixed text: nothing a client sent.
//!
//! One difference is mended rather than reported: a worker that puts special tokens around a
//! completions prompt (a BOS) other than those the pool's `tokenizer.json` names, as
//! transformers does from `tokenizer_config.json`'s `add_bos_token` for Llama 2, Mistral or
//! DeepSeek. When the worker's ids are the pool's plain ones with a few more before or after,
//! the pool adds those from then on (that pool alone: see [`PromptCache::adopt_special_tokens`]).
//!
//! A worker that cannot be reached, or answers 5xx, 408 or 429, is tried again (every worker in
//! turn, then again after a wait that doubles up to a minute). One that answers a probe with
//! another 4xx (404: not vLLM, or not the pool's model; 400: a template that refuses the probe;
//! an authenticating sidecar) is not asked it again, said once at info; a probe every worker
//! refused has no verdict.
//!
//! [`PromptCache::adopt_special_tokens`]: crate::prompt::PromptCache::adopt_special_tokens

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use switchyard_kv::chat_template::TemplateValue;
use switchyard_kv::tokenize::{PromptTokenizer, SpecialTokens, openai_chat};
use switchyard_snapshot::PoolId;

use crate::config::ConfigStore;
use crate::kv::ProbeKind;
use crate::routing::PoolRuntime;

/// The conversation probe: both roles every template renders (no system message: some
/// templates refuse one), a few kinds of text.
const PROBE_CHAT: [(&str, &str); 3] = [
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
/// The tools probe: a conversation with a tool, a call of it and its answer, sent as written
/// (both sides read its keys in this order; the call's and the tool's are not sorted).
const PROBE_TOOLS: &str = r#"{"messages": [
  {"role": "user", "content": "What is the weather in Paris today?"},
  {"role": "assistant", "content": null, "tool_calls": [{"type": "function", "id": "call_probe",
    "function": {"name": "get_weather", "arguments": "{\"unit\": \"celsius\", \"city\": \"Paris\"}"}}]},
  {"role": "tool", "tool_call_id": "call_probe", "content": "Sunny, 21 degrees."},
  {"role": "user", "content": "And tomorrow?"}],
 "tools": [{"type": "function", "function": {"name": "get_weather",
   "description": "The weather in a city on a given day.",
   "parameters": {"type": "object", "properties": {"unit": {"type": "string",
     "enum": ["celsius", "fahrenheit"]}, "city": {"type": "string"}}, "required": ["city"]}}}],
 "add_generation_prompt": true}"#;
/// The completions probe.
const PROBE_PROMPT: &str =
    "The quick brown fox jumps over the lazy dog.\nNumbers: 12345, 3.14159; symbols: #@$%&*()";
/// Longest wait between tries.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// What a worker said to one probe.
#[derive(Debug, PartialEq)]
enum Reply {
    Ids(Vec<u32>),
    /// A client error other than 408 and 429 (404: no such route, not vLLM, or no such model;
    /// 400: its template refused the probe): this probe is not asked of it again.
    Refused(u16),
    /// Not reached, a server error, or an answer without ids: try again later.
    Failed,
}

/// Where the check of the pool stands.
#[derive(Debug, Default)]
struct Progress {
    /// Probes with their verdict (or none to be had).
    done: Vec<ProbeKind>,
    /// Workers that answered a probe with a client error, per probe.
    refused: Vec<(ProbeKind, String)>,
}

impl Progress {
    fn refused_by(&self, kind: ProbeKind, worker: &str) -> bool {
        self.refused.iter().any(|(k, w)| *k == kind && w == worker)
    }
}

/// Check the tokenizer of `pool` (as the live table has it at each try) against its workers
/// until each probe has its verdict or every worker refused it.
pub async fn run(store: Arc<ConfigStore>, pool: PoolId) {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap_or_default();
    let mut progress = Progress::default();
    let mut backoff = Duration::from_secs(1);
    loop {
        if check(&client, &store, &pool, &mut progress).await {
            return;
        }
        tracing::debug!(pool = %pool, "the tokenizer probes are not all answered; trying again");
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One try over the pool's workers; whether the check is over.
async fn check(
    client: &reqwest::Client,
    store: &ConfigStore,
    id: &PoolId,
    progress: &mut Progress,
) -> bool {
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
        let address = worker.address.as_str();
        let url = format!("http://{address}/tokenize");
        for kind in ProbeKind::ALL {
            if progress.done.contains(&kind) || progress.refused_by(kind, address) {
                continue;
            }
            match ask(client, &url, &probe_body(kind, served)).await {
                Reply::Ids(theirs) => {
                    progress.done.push(kind);
                    judge(store, pool, &tokenizer, address, kind, &theirs);
                }
                Reply::Refused(status) => {
                    tracing::info!(pool = %id, worker = address, prompt = kind.label(), status, "the worker refused a tokenizer probe (404: not vLLM, or not the pool's model; 400: its template refused it); asking the pool's other workers");
                    progress.refused.push((kind, address.to_owned()));
                }
                Reply::Failed => {}
            }
        }
    }
    // A probe every worker refused has no verdict to wait for.
    for kind in ProbeKind::ALL {
        let everyone = pool
            .workers
            .iter()
            .all(|worker| progress.refused_by(kind, &worker.address));
        if !progress.done.contains(&kind) && !pool.workers.is_empty() && everyone {
            progress.done.push(kind);
            tracing::info!(pool = %id, prompt = kind.label(), "cannot check the pool's tokenizer on this probe: every worker refused it");
        }
    }
    ProbeKind::ALL
        .iter()
        .all(|kind| progress.done.contains(kind))
}

/// Compare a worker's ids for a probe with the pool's and record the verdict, unless the pool
/// has been given another tokenizer (or rebuilt) since: its own check will say.
fn judge(
    store: &ConfigStore,
    checked: &PoolRuntime,
    tokenizer: &Arc<PromptTokenizer>,
    worker: &str,
    kind: ProbeKind,
    theirs: &[u32],
) {
    let id = &checked.config.id;
    let current = store.current();
    let still = current
        .as_ref()
        .and_then(|table| table.pool(id))
        .filter(|pool| {
            Arc::ptr_eq(&pool.kv, &checked.kv)
                && pool
                    .tokenizer
                    .as_ref()
                    .is_some_and(|t| Arc::ptr_eq(t, tokenizer))
        });
    let Some(pool) = still else {
        return;
    };
    let prompts = &pool.kv.prompts;
    let Ok(mut ours) = probe_ids(tokenizer, &prompts.special_tokens(tokenizer), kind) else {
        tracing::info!(pool = %id, prompt = kind.label(), "cannot check the pool's tokenizer: it cannot tokenize the probe itself");
        return;
    };
    if theirs.is_empty() || ours.is_empty() {
        tracing::info!(pool = %id, worker, prompt = kind.label(), "cannot check the pool's tokenizer: no ids for the probe");
        return;
    }
    if kind == ProbeKind::Completions && ours != theirs {
        // The worker's tokenizer may add special tokens its tokenizer.json does not name.
        let plain = probe_ids(tokenizer, &SpecialTokens::default(), kind).unwrap_or_default();
        if let Some(special) = SpecialTokens::around(&plain, theirs) {
            tracing::info!(pool = %id, worker, before = ?special.before, after = ?special.after, "the pool's completions prompts now get the special tokens its worker gives them");
            prompts.adopt_special_tokens(tokenizer, special);
            ours =
                probe_ids(tokenizer, &prompts.special_tokens(tokenizer), kind).unwrap_or_default();
        }
    }
    let agrees = ours == theirs;
    pool.kv
        .tokenizer_agreement
        .set(kind, tokenizer.instance(), agrees);
    if agrees {
        tracing::info!(pool = %id, worker, prompt = kind.label(), tokens = ours.len(), "the pool's tokenizer agrees with its workers'");
    } else {
        tracing::warn!(
            pool = %id,
            worker,
            prompt = kind.label(),
            tokens = ours.len(),
            worker_tokens = theirs.len(),
            first_difference = first_difference(&ours, theirs),
            "the pool's tokenizer gives a probe prompt other token ids than its worker: routing cannot find such prompts in the workers' KV caches; set the pool's spec.tokenizer to the workers' tokenizer.json and chat template"
        );
    }
}

/// The `/tokenize` request for a probe, as vLLM takes it: the JSON text sent (the tools probe's
/// keys in the order written, which `tojson` prints).
fn probe_body(kind: ProbeKind, model: &str) -> String {
    match kind {
        ProbeKind::Chat => {
            let messages: Vec<Value> = PROBE_CHAT
                .iter()
                .map(|(role, content)| json!({"role": role, "content": content}))
                .collect();
            json!({"model": model, "messages": messages, "add_generation_prompt": true}).to_string()
        }
        ProbeKind::Completions => json!({"model": model, "prompt": PROBE_PROMPT}).to_string(),
        ProbeKind::Tools => format!(
            "{{\"model\": {}, {}",
            Value::from(model),
            PROBE_TOOLS.trim_start().trim_start_matches('{')
        ),
    }
}

/// The ids routing hashes for a probe: a chat rendered by the template, a completions prompt
/// with `special` around it (vLLM adds special tokens there by default).
fn probe_ids(
    tokenizer: &PromptTokenizer,
    special: &SpecialTokens,
    kind: ProbeKind,
) -> Result<Vec<u32>, switchyard_kv::tokenize::TokenizeError> {
    match kind {
        ProbeKind::Completions => Ok(special.wrap(tokenizer.encode(PROBE_PROMPT)?)),
        ProbeKind::Chat | ProbeKind::Tools => {
            // From the body the worker is sent, read as the worker reads it.
            let ordered: TemplateValue =
                serde_json::from_str(&probe_body(kind, "")).unwrap_or_default();
            let (messages, inputs) = openai_chat(&ordered);
            tokenizer.encode(&tokenizer.render_chat_with(&messages, &inputs)?)
        }
    }
}

async fn ask(client: &reqwest::Client, url: &str, body: &str) -> Reply {
    let request = client
        .post(url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body.to_owned());
    let Ok(response) = request.send().await else {
        return Reply::Failed;
    };
    match classify(response.status().as_u16()) {
        Some(reply) => reply,
        None => match response.json::<Value>().await {
            Ok(answer) => ids(&answer).map_or(Reply::Failed, Reply::Ids),
            Err(_) => Reply::Failed,
        },
    }
}

/// What a status alone says (`None`: a success, whose body has the ids).
fn classify(status: u16) -> Option<Reply> {
    match status {
        200..=299 => None,
        408 | 429 => Some(Reply::Failed),
        400..=499 => Some(Reply::Refused(status)),
        _ => Some(Reply::Failed),
    }
}

/// vLLM's `/tokenize` answer's ids.
fn ids(answer: &Value) -> Option<Vec<u32>> {
    answer
        .get("tokens")?
        .as_array()?
        .iter()
        .map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()))
        .collect()
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
    use crate::api::Endpoint;
    use crate::prompt::{PromptCache, analyse};

    /// The ids routing hashes for a probe's request, through the request path's own
    /// tokenization (block size 1: one hash per token, so equal hashes mean equal ids).
    fn routed_hashes(
        tokenizer: &PromptTokenizer,
        cache: &PromptCache,
        kind: ProbeKind,
    ) -> Vec<switchyard_kv::hash::SequenceHash> {
        let body = probe_body(kind, "m").into_bytes();
        let parsed = crate::wire::parse(&body).unwrap();
        let endpoint = match kind {
            ProbeKind::Chat | ProbeKind::Tools => Endpoint::ChatCompletions,
            ProbeKind::Completions => Endpoint::Completions,
        };
        analyse(tokenizer, cache, endpoint, &parsed, 1, None, &|_| true)
            .unwrap()
            .hashes
            .clone()
    }

    #[test]
    fn probes_are_the_ids_routing_hashes_for_such_requests() {
        let hashes = |ids: &[u32]| switchyard_kv::hash::sequence_hashes_keyed(ids, 1, &[], None);
        let with_bos = crate::prompt::tokenizer_with_bos();
        for tokenizer in [PromptTokenizer::shipped().unwrap(), with_bos] {
            let cache = PromptCache::default();
            for kind in ProbeKind::ALL {
                let probe = probe_ids(&tokenizer, &cache.special_tokens(&tokenizer), kind).unwrap();
                assert_eq!(hashes(&probe), routed_hashes(&tokenizer, &cache, kind));
            }
            // Special tokens taken from the workers are what both use from then on.
            let adopted = SpecialTokens {
                before: vec![1, 2],
                after: vec![3],
            };
            cache.adopt_special_tokens(&tokenizer, adopted.clone());
            let probe = probe_ids(
                &tokenizer,
                &cache.special_tokens(&tokenizer),
                ProbeKind::Completions,
            )
            .unwrap();
            assert_eq!(probe.first(), Some(&1));
            assert_eq!(probe.last(), Some(&3));
            assert_eq!(
                hashes(&probe),
                routed_hashes(&tokenizer, &cache, ProbeKind::Completions)
            );
            // Taken for this tokenizer only: another (a reloaded pool's) uses its own.
            let another = PromptTokenizer::shipped().unwrap();
            assert_eq!(cache.special_tokens(&another), *another.special_tokens());
        }
    }

    #[test]
    fn client_errors_refuse_the_probe_and_the_rest_try_again() {
        assert_eq!(classify(200), None);
        assert_eq!(classify(404), Some(Reply::Refused(404)));
        assert_eq!(classify(405), Some(Reply::Refused(405)));
        assert_eq!(classify(400), Some(Reply::Refused(400)));
        assert_eq!(classify(401), Some(Reply::Refused(401)));
        assert_eq!(classify(422), Some(Reply::Refused(422)));
        assert_eq!(classify(408), Some(Reply::Failed));
        assert_eq!(classify(429), Some(Reply::Failed));
        assert_eq!(classify(503), Some(Reply::Failed));
        assert_eq!(
            ids(&json!({"count": 2, "tokens": [7, 8]})),
            Some(vec![7, 8])
        );
        assert_eq!(ids(&json!({"tokens": [-1]})), None);
        assert_eq!(ids(&json!({"choices": []})), None);
    }

    #[test]
    fn the_first_difference_is_where_the_ids_part() {
        assert_eq!(first_difference(&[1, 2, 3], &[1, 2, 3]), 3);
        assert_eq!(first_difference(&[1, 2, 3], &[1, 9, 3]), 1);
        assert_eq!(first_difference(&[1, 2], &[1, 2, 3]), 2);
        assert_eq!(first_difference(&[], &[7]), 0);
    }
}
