//! llm-d's default scheduling profile for precise prefix-cache routing, re-implemented for the
//! benchmark (read, not copied; Apache-2.0 sources):
//!
//! - the profile: `llm-d/llm-d-inference-scheduler` `deploy/config/epp-precise-prefix-cache-config.yaml`:
//!   `precise-prefix-cache-scorer` weight 2, `kv-cache-utilization-scorer` weight 1,
//!   `queue-scorer` weight 1, `max-score-picker`;
//! - the sum: Gateway API Inference Extension `SchedulerProfile.runScorerPlugins`, each pod's
//!   score is Σ weight × scorer score (every scorer answers in [0, 1]);
//! - prefix: `llm-d-inference-scheduler` `pkg/plugins/scorer/precise_prefix_cache.go` with
//!   `llm-d/llm-d-kv-cache` `pkg/kvcache/kvblock_scorer.go` (`LongestPrefixScorer`): a pod's raw
//!   score is how many of the prompt's blocks it holds consecutively from the first (GPU tier
//!   weight 1); only pods holding the first block get a raw score; then
//!   `indexedScoresToNormalizedScoredPods` (`pkg/plugins/scorer/utils.go`) scales raw scores by
//!   min–max over the pods that have one (1 when they are all equal) and gives 0 to the rest;
//! - KV utilisation: GIE `kvcacheutilizationscorer/kvcache_utilization.go`, 1 − `vllm:kv_cache_usage_perc`;
//! - queue: GIE `queuescorer/queue.go`, (max − waiting) / (max − min) of `vllm:num_requests_waiting`
//!   over the candidates, 1 for all when they are equal;
//! - picker: GIE `maxscorepicker/max_score_picker.go`, shuffle then highest score (random ties).
//!
//! The index is built from the workers' KV events like the kv-cache manager's, keyed by token
//! content instead of vLLM's hash (so no `PYTHONHASHSEED` to match); gauges are scraped every
//! 100 ms (GIE's default refresh is 50 ms). Filters (`decode-filter`) have nothing to remove
//! in an aggregated fleet and are left out.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use switchyard_kv::index::WorkerId;
use switchyard_kv::tokenize::PromptTokenizer;

use super::fleet::Fleet;
use super::proxy::{Choice, ChooseError, Policy, Request};

pub const PREFIX_CACHE_WEIGHT: f64 = 2.0;
pub const KV_CACHE_UTILIZATION_WEIGHT: f64 = 1.0;
pub const QUEUE_WEIGHT: f64 = 1.0;

/// What llm-d's scorers read about one worker.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Candidate {
    /// Leading prompt blocks the worker holds (the index's longest consecutive match).
    pub matched_blocks: u32,
    /// `vllm:num_requests_waiting`, as last scraped.
    pub waiting: f64,
    /// `vllm:kv_cache_usage_perc`, as last scraped.
    pub kv_usage: f64,
}

/// The precise prefix-cache scorer: min–max normalised consecutive matches among the workers
/// holding the first block, 0 for the others.
pub fn prefix_cache_scores(candidates: &[Candidate]) -> Vec<f64> {
    let matched = candidates.iter().filter(|c| c.matched_blocks > 0);
    let min = matched.clone().map(|c| c.matched_blocks).min();
    let max = matched.map(|c| c.matched_blocks).max();
    candidates
        .iter()
        .map(|c| match (min, max) {
            _ if c.matched_blocks == 0 => 0.0,
            (Some(min), Some(max)) if max > min => {
                f64::from(c.matched_blocks - min) / f64::from(max - min)
            }
            _ => 1.0,
        })
        .collect()
}

/// The KV-cache utilisation scorer: the free share of the cache.
pub fn kv_cache_utilization_scores(candidates: &[Candidate]) -> Vec<f64> {
    candidates.iter().map(|c| 1.0 - c.kv_usage).collect()
}

/// The queue scorer: shorter waiting queues score higher, min–max over the candidates.
pub fn queue_scores(candidates: &[Candidate]) -> Vec<f64> {
    let min = candidates
        .iter()
        .map(|c| c.waiting)
        .fold(f64::INFINITY, f64::min);
    let max = candidates
        .iter()
        .map(|c| c.waiting)
        .fold(f64::NEG_INFINITY, f64::max);
    candidates
        .iter()
        .map(|c| {
            if max > min {
                (max - c.waiting) / (max - min)
            } else {
                1.0
            }
        })
        .collect()
}

/// The profile's weighted sum per worker.
pub fn total_scores(candidates: &[Candidate]) -> Vec<f64> {
    let prefix = prefix_cache_scores(candidates);
    let kv = kv_cache_utilization_scores(candidates);
    let queue = queue_scores(candidates);
    prefix
        .iter()
        .zip(&kv)
        .zip(&queue)
        .map(|((p, k), q)| {
            PREFIX_CACHE_WEIGHT * p + KV_CACHE_UTILIZATION_WEIGHT * k + QUEUE_WEIGHT * q
        })
        .collect()
}

/// The max-score picker: the highest score, ties broken uniformly at random.
pub fn pick_max(scores: &[f64], rng: &mut impl rand::Rng) -> Option<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.shuffle(rng);
    let score = |i: usize| scores.get(i).copied().unwrap_or(f64::NEG_INFINITY);
    // Stable: among equal scores the shuffled order decides.
    order.sort_by(|a, b| score(*b).total_cmp(&score(*a)));
    order.first().copied()
}

/// llm-d's profile over the observed fleet.
pub struct Llmd {
    pub fleet: Arc<Fleet>,
    pub tokenizer: Arc<PromptTokenizer>,
    pub block_size: usize,
    pub rng: Mutex<StdRng>,
}

#[async_trait]
impl Policy for Llmd {
    async fn choose(&self, request: &Request) -> Result<Choice, ChooseError> {
        let prompt = super::prompt_blocks(&self.tokenizer, request, self.block_size).await?;
        let workers = self.fleet.workers();
        let overlap = self.fleet.overlap(&prompt.hashes);
        let candidates: Vec<Candidate> = (0..workers)
            .map(|worker| {
                let gauges = self.fleet.gauges(worker);
                Candidate {
                    matched_blocks: u16::try_from(worker)
                        .map_or(0, |id| overlap.depth(WorkerId(id))),
                    waiting: gauges.waiting,
                    kv_usage: gauges.kv_usage,
                }
            })
            .collect();
        let scores = total_scores(&candidates);
        let worker = {
            let mut rng = self
                .rng
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            pick_max(&scores, &mut *rng)
        }
        .ok_or(ChooseError::NoWorker)?;
        Ok(Choice {
            worker,
            lease: None,
            hold_until_queued: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn candidate(matched_blocks: u32, waiting: f64, kv_usage: f64) -> Candidate {
        Candidate {
            matched_blocks,
            waiting,
            kv_usage,
        }
    }

    #[test]
    fn scores_combine_prefix_twice_kv_and_queue_once() {
        // Worker 0 holds 10 blocks but is loaded; worker 1 holds 4; worker 2 holds nothing and
        // is idle.
        let fleet = [
            candidate(10, 4.0, 0.8),
            candidate(4, 2.0, 0.5),
            candidate(0, 0.0, 0.1),
        ];
        assert_eq!(prefix_cache_scores(&fleet), [1.0, 0.0, 0.0]);
        assert_eq!(queue_scores(&fleet), [0.0, 0.5, 1.0]);
        let kv = kv_cache_utilization_scores(&fleet);
        assert!((kv[0] - 0.2).abs() < 1e-12 && (kv[2] - 0.9).abs() < 1e-12);
        let total = total_scores(&fleet);
        let expected = [2.0 + 0.2, 0.5 + 0.5, 0.9 + 1.0];
        for (got, want) in total.iter().zip(expected) {
            assert!((got - want).abs() < 1e-12, "{total:?}");
        }
        let mut rng = StdRng::seed_from_u64(1);
        assert_eq!(pick_max(&total, &mut rng), Some(0));

        // One holder of the first block scores 1 even with a short match; equal queues score 1.
        let lone = [candidate(1, 3.0, 0.0), candidate(0, 3.0, 0.0)];
        assert_eq!(prefix_cache_scores(&lone), [1.0, 0.0]);
        assert_eq!(queue_scores(&lone), [1.0, 1.0]);
        assert_eq!(pick_max(&total_scores(&lone), &mut rng), Some(0));
    }

    #[test]
    fn ties_are_broken_at_random() {
        let mut rng = StdRng::seed_from_u64(7);
        let mut seen = [0usize; 3];
        for _ in 0..300 {
            let index = pick_max(&[1.0, 3.0, 3.0], &mut rng).unwrap();
            seen[index] += 1;
        }
        assert_eq!(seen[0], 0);
        assert!(seen[1] > 100 && seen[2] > 100, "{seen:?}");
        assert_eq!(pick_max(&[], &mut rng), None);
    }
}
