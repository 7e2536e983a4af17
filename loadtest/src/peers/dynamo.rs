//! NVIDIA Dynamo's KV router cost, re-implemented for the benchmark (read, not copied;
//! Apache-2.0 sources in `ai-dynamo/dynamo`):
//!
//! - `lib/kv-router/src/scheduling/selector.rs`, `DefaultWorkerSelector::worker_logit`:
//!   `logit = overlap_score_weight × prefill_blocks + decode_blocks`, with
//!   `prefill_blocks = prefill_tokens / block_size`; lower is better;
//! - the per-worker inputs come from the router's own ledger of the requests it routed
//!   (`ActiveSequences` in `lib/llm/src/kv_router/sequence.rs`, `potential_blocks_and_tokens`):
//!   `prefill_tokens = active prefill tokens + (isl − overlap × block_size)`, where a request's
//!   uncached tokens count as active prefill until its first output token
//!   (`mark_prefill_completed`), and `decode_blocks = active unique blocks + the request's
//!   blocks not among them`, a request's blocks being released when it ends (`free`);
//!   `overlap` is the worker's consecutive prefix match in the index fed by KV events;
//! - selection: `router_temperature` 0 takes the lowest logit, ties to the worker with the
//!   smallest tree (fewest indexed blocks), then uniformly at random; above 0, `softmax_sample`
//!   samples from the softmax of the negated logits rescaled by their range;
//! - defaults: `KvRouterConfig::default()` in `lib/kv-router/src/scheduling/config.rs`:
//!   overlap weight 1 (`overlap_score_credit` 1 × `prefill_load_scale` 1), temperature 0,
//!   prefill tokens tracked, output blocks not tracked.
//!
//! Not reproduced: the router queue (`router_queue_threshold` 16: it holds requests only when
//! every worker has over 16 × `max_num_batched_tokens` of pending prefill, far beyond these
//! benchmarks), replica sync and lower cache tiers. Dynamo reads no `/metrics` for this cost.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use rand::Rng;
use rand::rngs::StdRng;
use switchyard_kv::hash::SequenceHash;
use switchyard_kv::index::WorkerId;
use switchyard_kv::tokenize::PromptTokenizer;

use super::fleet::Fleet;
use super::proxy::{Choice, ChooseError, Lease, Policy, Request};

/// Dynamo's default `overlap_score_weight` (`overlap_score_credit` × `prefill_load_scale`).
pub const OVERLAP_SCORE_WEIGHT: f64 = 1.0;
/// Dynamo's default `router_temperature`.
pub const ROUTER_TEMPERATURE: f64 = 0.0;

/// The requests this router sent one worker that have not ended.
#[derive(Debug, Default)]
pub struct ActiveSequences {
    /// Block → active requests holding it.
    unique_blocks: HashMap<SequenceHash, usize>,
    /// Request → its blocks.
    blocks: HashMap<u64, Vec<SequenceHash>>,
    /// Request → uncached prompt tokens, until its first token.
    prefill_tokens: HashMap<u64, usize>,
    /// Σ `prefill_tokens`.
    active_tokens: usize,
}

impl ActiveSequences {
    pub fn add(&mut self, request: u64, blocks: Vec<SequenceHash>, prefill_tokens: usize) {
        for block in &blocks {
            *self.unique_blocks.entry(*block).or_default() += 1;
        }
        self.blocks.insert(request, blocks);
        self.prefill_tokens.insert(request, prefill_tokens);
        self.active_tokens += prefill_tokens;
    }

    pub fn mark_prefill_completed(&mut self, request: u64) {
        if let Some(tokens) = self.prefill_tokens.remove(&request) {
            self.active_tokens = self.active_tokens.saturating_sub(tokens);
        }
    }

    pub fn free(&mut self, request: u64) {
        self.mark_prefill_completed(request);
        for block in self.blocks.remove(&request).unwrap_or_default() {
            if let Some(count) = self.unique_blocks.get_mut(&block) {
                *count -= 1;
                if *count == 0 {
                    self.unique_blocks.remove(&block);
                }
            }
        }
    }

    pub fn active_blocks(&self) -> usize {
        self.unique_blocks.len()
    }

    pub fn active_tokens(&self) -> usize {
        self.active_tokens
    }

    /// The request's blocks this worker's active requests do not hold.
    pub fn new_blocks(&self, blocks: &[SequenceHash]) -> usize {
        blocks
            .iter()
            .filter(|block| !self.unique_blocks.contains_key(block))
            .count()
    }
}

/// One worker's cost for a request of `isl` tokens (`prompt_blocks` its full blocks) of which
/// `overlap_blocks` are cached there.
pub fn worker_logit(
    active: &ActiveSequences,
    prompt_blocks: &[SequenceHash],
    isl: usize,
    overlap_blocks: usize,
    block_size: usize,
) -> f64 {
    let new_tokens = isl.saturating_sub(overlap_blocks * block_size);
    let prefill_tokens = active.active_tokens() + new_tokens;
    let decode_blocks = active.active_blocks() + active.new_blocks(prompt_blocks);
    OVERLAP_SCORE_WEIGHT * prefill_tokens as f64 / block_size.max(1) as f64 + decode_blocks as f64
}

/// Dynamo's `softmax_sample` on cost logits with a uniform `sample` in [0, 1): temperature 0
/// takes the lowest logit (first of equals); otherwise the logits are negated and rescaled by
/// their range so the lowest cost gets the highest probability.
pub fn softmax_sample(logits: &[f64], temperature: f64, sample: f64) -> Option<usize> {
    if temperature == 0.0 {
        return logits
            .iter()
            .enumerate()
            .min_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i);
    }
    let min = logits.iter().copied().fold(f64::INFINITY, f64::min);
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = if max > min {
        let scale = -1.0 / ((max - min) * temperature);
        logits
            .iter()
            .map(|l| (l * scale - min * scale).exp())
            .collect()
    } else {
        vec![1.0; logits.len()]
    };
    let total: f64 = weights.iter().sum();
    let mut cumulative = 0.0;
    for (i, weight) in weights.iter().enumerate() {
        cumulative += weight / total;
        if sample <= cumulative {
            return Some(i);
        }
    }
    logits.len().checked_sub(1)
}

/// Dynamo's selection: temperature 0 takes the lowest logit, ties to the smallest tree, then at
/// random; otherwise [`softmax_sample`].
pub fn select(logits: &[f64], tree_sizes: &[usize], rng: &mut impl Rng) -> Option<usize> {
    if ROUTER_TEMPERATURE != 0.0 {
        return softmax_sample(logits, ROUTER_TEMPERATURE, rng.random());
    }
    let best = logits.iter().copied().fold(f64::INFINITY, f64::min);
    let tied: Vec<usize> = (0..logits.len())
        .filter(|i| logits.get(*i) == Some(&best))
        .collect();
    let tree = |i: &usize| tree_sizes.get(*i).copied().unwrap_or(0);
    let smallest = tied.iter().map(tree).min()?;
    let smallest_trees: Vec<usize> = tied.into_iter().filter(|i| tree(i) == smallest).collect();
    smallest_trees
        .get(rng.random_range(0..smallest_trees.len()))
        .copied()
}

struct Ledger {
    workers: Vec<ActiveSequences>,
    next_request: u64,
    rng: StdRng,
}

/// Dynamo's KV router over the observed fleet and its own ledger.
pub struct Dynamo {
    fleet: Arc<Fleet>,
    tokenizer: Arc<PromptTokenizer>,
    block_size: usize,
    ledger: Arc<Mutex<Ledger>>,
}

impl Dynamo {
    pub fn new(
        fleet: Arc<Fleet>,
        tokenizer: Arc<PromptTokenizer>,
        block_size: usize,
        rng: StdRng,
    ) -> Dynamo {
        let workers = (0..fleet.workers())
            .map(|_| ActiveSequences::default())
            .collect();
        Dynamo {
            fleet,
            tokenizer,
            block_size,
            ledger: Arc::new(Mutex::new(Ledger {
                workers,
                next_request: 0,
                rng,
            })),
        }
    }
}

fn lock(ledger: &Mutex<Ledger>) -> std::sync::MutexGuard<'_, Ledger> {
    ledger
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A routed request in the ledger: prefill done at its first token, freed when dropped.
struct ActiveRequest {
    ledger: Arc<Mutex<Ledger>>,
    worker: usize,
    request: u64,
}

impl Lease for ActiveRequest {
    fn first_token(&mut self) {
        if let Some(active) = lock(&self.ledger).workers.get_mut(self.worker) {
            active.mark_prefill_completed(self.request);
        }
    }
}

impl Drop for ActiveRequest {
    fn drop(&mut self) {
        if let Some(active) = lock(&self.ledger).workers.get_mut(self.worker) {
            active.free(self.request);
        }
    }
}

#[async_trait]
impl Policy for Dynamo {
    async fn choose(&self, request: &Request) -> Result<Choice, ChooseError> {
        let prompt = super::prompt_blocks(&self.tokenizer, request, self.block_size).await?;
        let workers = self.fleet.workers();
        let overlap = self.fleet.overlap(&prompt.hashes);
        let slot = |worker: usize| u16::try_from(worker).map(WorkerId).ok();
        let tree_sizes: Vec<usize> = (0..workers)
            .map(|w| slot(w).map_or(0, |id| self.fleet.index.worker_blocks(id)))
            .collect();
        // One decision at a time, as Dynamo's scheduler task makes them: each sees the last.
        let mut ledger = lock(&self.ledger);
        let logits: Vec<f64> = ledger
            .workers
            .iter()
            .enumerate()
            .map(|(w, active)| {
                let overlap_blocks = slot(w).map_or(0, |id| overlap.depth(id)) as usize;
                worker_logit(
                    active,
                    &prompt.hashes,
                    prompt.tokens,
                    overlap_blocks,
                    self.block_size,
                )
            })
            .collect();
        let worker = select(&logits, &tree_sizes, &mut ledger.rng).ok_or(ChooseError::NoWorker)?;
        let overlap_blocks = slot(worker).map_or(0, |id| overlap.depth(id)) as usize;
        let new_tokens = prompt
            .tokens
            .saturating_sub(overlap_blocks * self.block_size);
        let request_id = ledger.next_request;
        ledger.next_request += 1;
        if let Some(active) = ledger.workers.get_mut(worker) {
            active.add(request_id, prompt.hashes, new_tokens);
        }
        drop(ledger);
        Ok(Choice {
            worker,
            lease: Some(Box::new(ActiveRequest {
                ledger: self.ledger.clone(),
                worker,
                request: request_id,
            })),
            hold_until_queued: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn blocks(range: std::ops::Range<u64>) -> Vec<SequenceHash> {
        range.map(SequenceHash).collect()
    }

    #[test]
    fn the_cost_is_prefill_blocks_plus_decode_blocks() {
        let mut busy = ActiveSequences::default();
        // An active request of 4 blocks (256 tokens) still prefilling 192 of them.
        busy.add(1, blocks(0..4), 192);
        assert_eq!((busy.active_blocks(), busy.active_tokens()), (4, 192));
        // A 640-token request sharing the first 2 blocks, 2 of them cached on this worker:
        // prefill (192 + 640 − 128) / 64 = 11, decode 4 active + 8 new = 12.
        let prompt = [blocks(0..2), blocks(100..108)].concat();
        let logit = worker_logit(&busy, &prompt, 640, 2, 64);
        assert!((logit - 23.0).abs() < 1e-12, "{logit}");
        // An idle worker without the prefix: 640 / 64 + 10 = 20.
        let idle = ActiveSequences::default();
        assert!((worker_logit(&idle, &prompt, 640, 0, 64) - 20.0).abs() < 1e-12);

        // The first token ends the prefill; the end frees the blocks.
        busy.mark_prefill_completed(1);
        assert_eq!(busy.active_tokens(), 0);
        busy.add(2, blocks(2..6), 64);
        busy.free(1);
        assert_eq!((busy.active_blocks(), busy.active_tokens()), (4, 64));
        busy.free(2);
        assert_eq!((busy.active_blocks(), busy.active_tokens()), (0, 0));
    }

    #[test]
    fn temperature_zero_takes_the_argmin_and_breaks_ties_by_tree_size() {
        let mut rng = StdRng::seed_from_u64(3);
        assert_eq!(softmax_sample(&[5.0, 3.0, 7.0, 3.5], 0.0, 0.99), Some(1));
        assert_eq!(select(&[5.0, 3.0, 7.0], &[0, 0, 0], &mut rng), Some(1));
        // Tied logits: the smaller tree wins.
        assert_eq!(select(&[2.0, 2.0, 9.0], &[40, 10, 0], &mut rng), Some(1));
        assert_eq!(select(&[], &[], &mut rng), None);
    }

    #[test]
    fn a_positive_temperature_favours_lower_costs() {
        let logits = [1.0, 2.0, 3.0];
        // At temperature 1 the weights are e^0, e^-0.5, e^-1 (range-normalised).
        let total = 1.0 + (-0.5f64).exp() + (-1.0f64).exp();
        let first = 1.0 / total;
        assert_eq!(softmax_sample(&logits, 1.0, first - 1e-9), Some(0));
        assert_eq!(softmax_sample(&logits, 1.0, first + 1e-9), Some(1));
        assert_eq!(softmax_sample(&logits, 1.0, 0.999_999), Some(2));
        assert_eq!(softmax_sample(&[4.0, 4.0], 0.5, 0.6), Some(1));
    }
}
