//! What a worker without a KV event feed is assumed to hold: the prompts this proxy had it
//! prefill, kept the way vLLM keeps them.
//!
//! vLLM publishes KV events only when started with `--kv-events-config`. For a worker that
//! does not (its endpoint names no `kvEvents`) the prefix index learns nothing, and what this
//! proxy sent it counts ([`crate::kv::Predictions`]) only while the request runs: a
//! conversation's next turn, or the next question under a system prompt after a quiet moment,
//! would find no worker holding its prefix and be placed by queue alone, its history prefilled
//! again wherever that sends it. So for such a worker the proxy keeps, when a request that was
//! prefilled there ends, the blocks of its prompt (as far as it was tokenized) in the order
//! vLLM frees them. vLLM's block pool puts a finished request's blocks at the tail of its free
//! queue, the last block first, and evicts from the head when it needs room; a block a later
//! request reuses leaves the queue and comes back at the tail when that one ends. The blocks
//! kept here are therefore the most recently freed ones, as many as the worker's cache has
//! (`vllm:cache_config_info`), a prompt's first blocks the last of it to go.
//!
//! Other gateway replicas (`--peers`) tell of the requests they had such a worker prefill when
//! those end ([`crate::peers`]), by a sample of each prompt's blocks; they are kept here as this
//! proxy's own, each sampled block standing for the blocks since the one before.
//!
//! It is a guess from routed requests alone, as the cache-aware policies of routers without KV
//! events make it (vllm-router's `cache_aware` tree, Dynamo's approximate indexer): what other
//! clients put in the worker's cache, and the blocks its answers take, are not seen, so it errs
//! toward holding more than the worker does. A wrong guess
//! costs the request a cold prefill, as having no guess would, on a worker chosen for a cache
//! it no longer has. A worker that has a feed is never guessed about: its events say what it
//! holds.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use switchyard_kv::hash::SequenceHash;
use switchyard_kv::index::{Overlap, WorkerId};

use crate::lock;

/// The cache assumed for a worker that does not report its size (`vllm:cache_config_info`,
/// which vLLM serves): 1,024 blocks (65,536 tokens of 64-token blocks), a small cache for a
/// data-centre card, so that a guess without the size errs toward forgetting.
pub const UNREPORTED_CAPACITY_BLOCKS: usize = 1024;

/// Per worker, the blocks of the prompts it prefilled for this proxy, most recently freed last.
#[derive(Debug, Default)]
pub struct RoutedHistory {
    workers: Mutex<HashMap<WorkerId, Freed>>,
}

/// One worker's assumed cache: the `capacity` blocks most recently freed (a block freed again
/// counts from its last free).
#[derive(Debug, Default)]
struct Freed {
    /// Each held block's last free, and how many blocks it stands for: one, or for a block
    /// another gateway replica told of by a sample of its prompt, the blocks since the sample
    /// before it (its hash stands for the whole prefix it ends).
    last_freed: HashMap<SequenceHash, (u64, usize)>,
    /// Frees in order, oldest first; one whose block was freed again since is stale.
    queue: VecDeque<(u64, SequenceHash)>,
    clock: u64,
    /// Blocks held: what the held entries stand for, summed.
    held: usize,
    /// The most blocks one entry has stood for: a held prefix is found by entries at most this
    /// far apart.
    widest: usize,
}

impl Freed {
    /// A request that held `blocks` (a prompt's, first to last, each with the blocks it stands
    /// for) ended: vLLM frees them last block first; then, past `capacity`, the oldest go.
    fn free(&mut self, blocks: &[(SequenceHash, usize)], capacity: usize) {
        for (hash, span) in blocks.iter().rev() {
            self.clock += 1;
            // A block stands for what its last free says: freed by a sample, the blocks before
            // it this free did not name were freed too (they may still be held apart, older,
            // and count twice until they go).
            let span = (*span).clamp(1, capacity.max(1));
            if let Some((_, before)) = self.last_freed.insert(*hash, (self.clock, span)) {
                self.held = self.held.saturating_sub(before);
            }
            self.held = self.held.saturating_add(span);
            self.widest = self.widest.max(span);
            self.queue.push_back((self.clock, *hash));
        }
        while self.held > capacity {
            let Some((at, hash)) = self.queue.pop_front() else {
                break;
            };
            if let Some((freed, span)) = self.last_freed.get(&hash).copied()
                && freed == at
            {
                self.last_freed.remove(&hash);
                self.held = self.held.saturating_sub(span);
            }
        }
        // Blocks freed again leave stale entries behind: drop them once they outnumber the live.
        if self.queue.len() > 2 * self.last_freed.len() + 64 {
            let last_freed = &self.last_freed;
            self.queue
                .retain(|(at, hash)| last_freed.get(hash).is_some_and(|(freed, _)| freed == at));
        }
    }

    /// How many leading blocks of `request` are held: up to its deepest held block. A prompt's
    /// first blocks are freed last and so evicted last, and a block freed again frees the
    /// prefix before it again too: what is held of a prefix is its start, so the held blocks of
    /// a request lie at most [`Freed::widest`] apart up to the deepest.
    fn depth(&self, request: &[SequenceHash]) -> usize {
        let (mut depth, mut missed) = (0, 0);
        for (at, hash) in request.iter().enumerate() {
            if self.last_freed.contains_key(hash) {
                depth = at + 1;
                missed = 0;
            } else {
                missed += 1;
                if missed >= self.widest.max(1) {
                    break;
                }
            }
        }
        depth
    }
}

impl RoutedHistory {
    /// A request prefilled at `worker` ended: it is assumed to hold `blocks` (the prompt's
    /// block hashes, in order) now, in a cache of `capacity` blocks.
    pub fn freed(&self, worker: WorkerId, blocks: &[SequenceHash], capacity: usize) {
        let blocks: Vec<(SequenceHash, usize)> = blocks.iter().map(|hash| (*hash, 1)).collect();
        self.free(worker, &blocks, capacity);
    }

    /// Another gateway replica's request prefilled at `worker` ended: it told of the prompt by
    /// `samples`, the hashes of some of its blocks with the number of blocks up to each (of
    /// the whole prompt, increasing; [`crate::kv::Predictions::recent_frees`]). Samples out of
    /// order end it there; a sample standing for more blocks than the cache has counts as the
    /// cache. Prompts that share a prefix (a conversation's turns) are told by samples that
    /// overlap by up to a sample's blocks where the shorter one ends, so a history fed by the
    /// other replicas counts a few blocks more than it holds and forgets that much sooner.
    pub fn freed_sampled(
        &self,
        worker: WorkerId,
        samples: &[(usize, SequenceHash)],
        capacity: usize,
    ) {
        let mut blocks = Vec::with_capacity(samples.len());
        let mut before = 0;
        for (upto, hash) in samples {
            if *upto <= before {
                break;
            }
            blocks.push((*hash, upto - before));
            before = *upto;
        }
        self.free(worker, &blocks, capacity);
    }

    fn free(&self, worker: WorkerId, blocks: &[(SequenceHash, usize)], capacity: usize) {
        if blocks.is_empty() {
            return;
        }
        lock(&self.workers)
            .entry(worker)
            .or_default()
            .free(blocks, capacity.max(1));
    }

    /// Raise each worker's depth in `overlap` to the leading blocks of `request` it is assumed
    /// to hold. Returns how far they may reach: a block another replica told of by a sample
    /// may be followed by as many as the samples stand for (so `request`, a prompt's head, may
    /// be held further than its blocks known here say).
    pub fn raise(&self, request: &[SequenceHash], overlap: &mut Overlap) -> usize {
        let mut reach = 0;
        for (worker, freed) in lock(&self.workers).iter() {
            let depth = freed.depth(request);
            if depth > 0 {
                overlap.raise(*worker, u32::try_from(depth).unwrap_or(u32::MAX));
                reach = reach.max(depth.saturating_add(freed.widest.max(1) - 1));
            }
        }
        reach
    }

    /// Forget what `worker` is assumed to hold (it left the pool, or its KV events now say).
    pub fn forget(&self, worker: WorkerId) {
        lock(&self.workers).remove(&worker);
    }

    /// Blocks assumed held, over all workers (for metrics).
    pub fn blocks(&self) -> usize {
        lock(&self.workers).values().map(|freed| freed.held).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hashes(range: std::ops::Range<u64>) -> Vec<SequenceHash> {
        range.map(SequenceHash).collect()
    }

    fn depths(history: &RoutedHistory, request: &[SequenceHash]) -> Vec<u32> {
        let mut overlap = Overlap::default();
        history.raise(request, &mut overlap);
        (0..3).map(|w| overlap.depth(WorkerId(w))).collect()
    }

    #[test]
    fn a_prompt_is_held_where_it_was_prefilled_as_far_as_it_goes() {
        let history = RoutedHistory::default();
        history.freed(WorkerId(1), &hashes(0..6), 100);
        // The same prefix, then a different turn.
        let mut next = hashes(0..4);
        next.extend(hashes(50..53));
        assert_eq!(depths(&history, &next), [0, 4, 0]);
        assert_eq!(depths(&history, &hashes(10..20)), [0, 0, 0]);
        assert_eq!(history.blocks(), 6);
        history.forget(WorkerId(1));
        assert_eq!(depths(&history, &next), [0, 0, 0]);
    }

    #[test]
    fn the_least_recently_freed_go_first_a_prompts_tail_before_its_head() {
        let history = RoutedHistory::default();
        let (a, b) = (hashes(0..4), hashes(100..104));
        history.freed(WorkerId(0), &a, 8);
        history.freed(WorkerId(0), &b, 8);
        // Reusing `a` frees it again: now `b` is the older.
        history.freed(WorkerId(0), &a, 8);
        let c = hashes(200..203);
        history.freed(WorkerId(0), &c, 8);
        // Three of `b`'s blocks had to go, its last three (freed before its first).
        assert_eq!(depths(&history, &b), [1, 0, 0]);
        assert_eq!(depths(&history, &a), [4, 0, 0]);
        assert_eq!(depths(&history, &c), [3, 0, 0]);
        assert_eq!(history.blocks(), 8);
    }

    /// `prompt` told by the hashes of the blocks `upto` (counted from 1) end.
    fn sampled(prompt: &[SequenceHash], upto: &[usize]) -> Vec<(usize, SequenceHash)> {
        upto.iter().map(|u| (*u, prompt[u - 1])).collect()
    }

    #[test]
    fn a_prompt_another_replica_told_of_by_samples_is_held_to_its_deepest_sample() {
        let history = RoutedHistory::default();
        // Ten blocks, told by the hashes of the 1st, 4th, 8th and 10th.
        let prompt = hashes(0..10);
        history.freed_sampled(WorkerId(1), &sampled(&prompt, &[1, 4, 8, 10]), 100);
        assert_eq!(history.blocks(), 10);
        assert_eq!(depths(&history, &prompt), [0, 10, 0]);
        // A head of two blocks is held as far as the first, and may be held up to the 4th.
        let mut overlap = Overlap::default();
        assert_eq!(history.raise(&prompt[..2], &mut overlap), 4);
        assert_eq!(overlap.depth(WorkerId(1)), 1);
        // A request that shares nine of them is held as far as the 8th (a sample's hash stands
        // for the prefix it ends); one that shares three, as far as the 1st.
        let mut next = hashes(0..9);
        next.extend(hashes(50..55));
        assert_eq!(depths(&history, &next), [0, 8, 0]);
        let mut short = hashes(0..3);
        short.extend(hashes(60..70));
        assert_eq!(depths(&history, &short), [0, 1, 0]);

        // This replica's own prompt there counts beside it, and past 12 blocks the least
        // recently freed goes: the prompt's last sample (freed first), the two blocks it stood for.
        history.freed(WorkerId(1), &hashes(100..104), 12);
        assert_eq!(history.blocks(), 12);
        assert_eq!(depths(&history, &prompt), [0, 8, 0]);
        assert_eq!(depths(&history, &hashes(100..104)), [0, 4, 0]);
        // Freed block by block, each sampled block stands for itself.
        history.freed(WorkerId(1), &prompt, 100);
        assert_eq!(history.blocks(), 14);
        assert_eq!(depths(&history, &prompt), [0, 10, 0]);

        // Samples out of order end the prompt there.
        history.freed_sampled(WorkerId(2), &sampled(&hashes(200..208), &[4, 4, 8]), 100);
        assert_eq!(depths(&history, &hashes(200..208)), [0, 0, 4]);
    }

    #[test]
    fn a_prompt_held_block_by_block_then_freed_by_another_replicas_samples_is_held_by_them() {
        let history = RoutedHistory::default();
        let prompt = hashes(0..10);
        history.freed(WorkerId(0), &prompt, 100);
        // Another replica's request of the same prompt ends: its samples are the latest frees,
        // the blocks between them (this replica's, freed before) the oldest...
        history.freed_sampled(WorkerId(0), &sampled(&prompt, &[1, 4, 8, 10]), 100);
        // ...and go first: the prompt is still held, by the samples, to its end.
        history.freed(WorkerId(0), &hashes(100..104), 14);
        assert_eq!(depths(&history, &prompt), [10, 0, 0]);
        assert_eq!(history.blocks(), 14);
        // A span past the cache's size counts as the cache.
        history.freed_sampled(WorkerId(1), &[(usize::MAX, SequenceHash(7))], 50);
        assert_eq!(history.blocks(), 14 + 50);
    }

    #[test]
    fn frees_of_the_same_blocks_do_not_pile_up() {
        let history = RoutedHistory::default();
        let prompt = hashes(0..32);
        for _ in 0..1_000 {
            history.freed(WorkerId(2), &prompt, 1_000);
        }
        let workers = lock(&history.workers);
        let freed = workers
            .get(&WorkerId(2))
            .map(|f| (f.last_freed.len(), f.queue.len()));
        assert!(
            freed.is_some_and(|(held, queued)| held == 32 && queued <= 2 * 32 + 64 + 32),
            "{freed:?}"
        );
    }
}
