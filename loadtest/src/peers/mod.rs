//! Routers the benchmark runs in its own process, in front of the simulated workers, next to
//! the real ones (switchyard-proxy, vllm-router): the [`oracle`] (routes on each engine's own
//! TTFT prediction) and faithful re-implementations of two peers that cannot run here, llm-d's
//! default precise-prefix-cache profile ([`llmd`]) and NVIDIA Dynamo's KV router cost
//! ([`dynamo`]). Each module cites the source it follows.
//!
//! Use [`start`] to serve one on a port; it runs until the returned [`Running`] is dropped.
//! Prompts are tokenized with the simulator's tokenizer and chat template and hashed into
//! blocks the way the prefix index keys the workers' KV events, so the index's matches are the
//! workers' real cache contents (as far as their events tell).

pub mod dynamo;
pub mod fleet;
pub mod llmd;
pub mod oracle;
pub mod proxy;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde_json::Value;
use switchyard_kv::hash::{SequenceHash, sequence_hashes_keyed};
use switchyard_kv::tokenize::{PromptTokenizer, openai_chat};
use tokio::task::JoinHandle;

pub use fleet::WorkerAddress;
use proxy::{ChooseError, Policy};

/// Which in-process router to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerKind {
    Oracle,
    Llmd,
    Dynamo,
}

/// How often llm-d's gauges are scraped (switchyard's benchmark pools use the same).
pub const SCRAPE_INTERVAL: Duration = Duration::from_millis(100);

/// A prompt as the index sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptBlocks {
    /// Prompt tokens, chat template applied.
    pub tokens: usize,
    /// Chained hashes of its full blocks.
    pub hashes: Vec<SequenceHash>,
}

/// Tokenize a chat request as the workers do (its messages and template inputs through the chat
/// template: tools, tool calls, `chat_template_kwargs`, as the gateway and vLLM render them)
/// and hash its full blocks as the index keys them (on the blocking pool: a long prompt takes
/// a while).
pub async fn prompt_blocks(
    tokenizer: &Arc<PromptTokenizer>,
    request: &proxy::Request,
    block_size: usize,
) -> Result<PromptBlocks, ChooseError> {
    let (tokenizer, body, json) = (
        tokenizer.clone(),
        request.body.clone(),
        request.json.clone(),
    );
    tokio::task::spawn_blocking(move || {
        // The body as sent: its object keys in order, which templates print.
        let ordered: switchyard_kv::chat_template::TemplateValue =
            serde_json::from_slice(&body).map_err(|e| ChooseError::Tokenize(e.to_string()))?;
        let (messages, inputs) = openai_chat(&ordered);
        let tokens = tokenizer
            .render_chat_with(&messages, &inputs)
            .and_then(|text| tokenizer.encode(&text))
            .map_err(|e| ChooseError::Tokenize(e.to_string()))?;
        let cache_salt = json
            .get("cache_salt")
            .and_then(Value::as_str)
            .filter(|salt| !salt.is_empty());
        Ok(PromptBlocks {
            tokens: tokens.len(),
            hashes: sequence_hashes_keyed(&tokens, block_size, &[], cache_salt),
        })
    })
    .await
    .map_err(|e| ChooseError::Tokenize(e.to_string()))?
}

/// A started router; its tasks stop when this is dropped.
pub struct Running {
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Serve `kind` on 127.0.0.1:`port` in front of `workers` (their tokenizer is the shipped
/// one); ready when this returns.
pub async fn start(
    kind: PeerKind,
    workers: &[WorkerAddress],
    block_size: usize,
    port: u16,
    seed: u64,
) -> anyhow::Result<Running> {
    let urls: Vec<String> = workers
        .iter()
        .map(|w| format!("http://{}", w.http))
        .collect();
    let rng = StdRng::seed_from_u64(seed);
    let mut tasks = Vec::new();
    let policy: Arc<dyn Policy> = match kind {
        PeerKind::Oracle => Arc::new(oracle::Oracle {
            workers: urls.clone(),
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(64)
                .build()?,
            deciding: Arc::new(tokio::sync::Mutex::new(())),
            rng: Mutex::new(rng),
        }),
        PeerKind::Llmd | PeerKind::Dynamo => {
            let tokenizer =
                Arc::new(PromptTokenizer::shipped().context("loading the shipped tokenizer")?);
            let fleet = Arc::new(fleet::Fleet::new(workers.len(), block_size));
            let scrape = (kind == PeerKind::Llmd).then_some(SCRAPE_INTERVAL);
            tasks.extend(fleet::start(&fleet, workers, scrape).await?);
            if kind == PeerKind::Llmd {
                Arc::new(llmd::Llmd {
                    fleet,
                    tokenizer,
                    block_size,
                    rng: Mutex::new(rng),
                })
            } else {
                Arc::new(dynamo::Dynamo::new(fleet, tokenizer, block_size, rng))
            }
        }
    };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .with_context(|| format!("listening on 127.0.0.1:{port}"))?;
    // TCP_NODELAY, as the gateways they stand for (and the simulated workers) set it.
    let listener = crate::sim::nodelay(listener);
    let app = proxy::router(urls, policy);
    tasks.push(tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::error!(%error, "peer router stopped");
        }
    }));
    Ok(Running { tasks })
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_kv::events::{BlockStored, KvEvent, KvEventBatch};
    use switchyard_kv::index::{Overlap, PrefixIndex, WorkerId};

    /// The blocks a policy hashes for a chat request are the ones the index builds from a
    /// worker's BlockStored events for the same prompt.
    #[tokio::test]
    async fn prompt_blocks_match_what_the_index_builds_from_events() {
        let tokenizer = Arc::new(PromptTokenizer::shipped().unwrap());
        let json = serde_json::json!({"model": "m", "messages": [
            {"role": "system", "content": "Answer in French. ".repeat(80)},
            {"role": "user", "content": "Bonjour"}]});
        let request = proxy::Request {
            body: json.to_string().into(),
            json: Arc::new(json),
        };
        let prompt = prompt_blocks(&tokenizer, &request, 16).await.unwrap();
        let tokens = tokenizer
            .encode_chat(&switchyard_kv::tokenize::openai_messages(&request.json))
            .unwrap();
        assert_eq!(prompt.tokens, tokens.len());
        assert_eq!(prompt.hashes.len(), tokens.len() / 16);

        let index = PrefixIndex::new(16);
        let stored = 5;
        let event = KvEvent::BlockStored(BlockStored {
            block_hashes: (0..stored)
                .map(|i| switchyard_kv::events::ExternalBlockHash(1000 + i))
                .collect(),
            parent_block_hash: None,
            token_ids: tokens[..16 * stored as usize].to_vec(),
            block_size: 16,
            ..BlockStored::default()
        });
        let batch = KvEventBatch {
            ts: 0.0,
            events: vec![event],
            data_parallel_rank: None,
        };
        index.apply_batch(WorkerId(1), &batch);
        let mut overlap = Overlap::default();
        index.overlap_into(&prompt.hashes, 2, &mut overlap);
        assert_eq!(
            (overlap.depth(WorkerId(0)), overlap.depth(WorkerId(1))),
            (0, 5)
        );
    }
}
