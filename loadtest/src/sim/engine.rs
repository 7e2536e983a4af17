//! The simulated engine: vLLM-style continuous batching over a paged KV cache, with step times
//! from a latency model instead of a GPU.
//!
//! Each step schedules running requests first (decode: one token; prefill: a chunk), then admits
//! waiting requests first-come-first-served while the token budget, `max_num_seqs` and the KV cache
//! allow, reusing cached prefix blocks. The step takes `LatencyModel::step_seconds` of model time,
//! scaled by `time_scale` into wall time. TTFT therefore comes out of queueing and uncached
//! prefill work, exactly as the model predicts; nothing is drawn at random.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use switchyard_kv::events::{BlockRemoved, BlockStored, ExternalBlockHash, KvEvent, KvEventBatch};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::kv_cache::{BlockId, KvCache};
use super::metrics::EngineStats;

/// Step cost in model seconds. Defaults describe one NVIDIA L40S (48 GB, 864 GB/s, 362 dense FP8
/// TFLOPS) serving a ~27B dense model in FP8 with vLLM; see `loadtest/README.md` for the derivation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyModel {
    /// Scheduling, sampling and launch overhead of every step.
    pub step_overhead_s: f64,
    /// Prefill compute per uncached prompt token (2 × 27e9 FLOP at ~50% of 362 TFLOPS ≈ 0.3 ms).
    pub prefill_s_per_token: f64,
    /// Reading the weights once per decode step (27 GB at 864 GB/s ≈ 31 ms).
    pub decode_base_s: f64,
    /// Extra compute per sequence in a decode batch.
    pub decode_s_per_seq: f64,
    /// Reading one token of KV cache per decode step (~256 KB at 864 GB/s ≈ 0.3 µs).
    pub decode_s_per_context_token: f64,
}

impl Default for LatencyModel {
    fn default() -> LatencyModel {
        LatencyModel {
            step_overhead_s: 0.003,
            prefill_s_per_token: 0.000_3,
            decode_base_s: 0.032,
            decode_s_per_seq: 0.000_05,
            decode_s_per_context_token: 0.000_000_3,
        }
    }
}

impl LatencyModel {
    /// Model time of one step with `prefill_tokens` of prefill and `decode_seqs` decoding
    /// sequences holding `decode_context_tokens` tokens of context between them.
    pub fn step_seconds(
        &self,
        prefill_tokens: usize,
        decode_seqs: usize,
        decode_context_tokens: usize,
    ) -> f64 {
        let mut seconds = self.step_overhead_s + prefill_tokens as f64 * self.prefill_s_per_token;
        if decode_seqs > 0 {
            seconds += self.decode_base_s
                + decode_seqs as f64 * self.decode_s_per_seq
                + decode_context_tokens as f64 * self.decode_s_per_context_token;
        }
        seconds
    }
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub latency: LatencyModel,
    /// Wall seconds per model second (0.01 runs 100× faster than the modelled GPU).
    pub time_scale: f64,
    pub hash_seed: u64,
}

impl Default for EngineConfig {
    fn default() -> EngineConfig {
        EngineConfig {
            // ~14 GB of KV at ~256 KB per token (64 layers, 8 KV heads × 128, bf16) ≈ 53k tokens.
            num_blocks: 3_300,
            block_size: 16,
            max_num_seqs: 128,
            max_num_batched_tokens: 8_192,
            latency: LatencyModel::default(),
            time_scale: 1.0,
            hash_seed: 0,
        }
    }
}

/// What the engine tells the HTTP layer about one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Admitted; this many prompt tokens came from the prefix cache.
    Started {
        cached_tokens: usize,
    },
    Token(u32),
    Finished,
}

/// Why a request cannot be taken at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the prompt needs {needed} KV blocks but the cache holds {capacity}")]
    TooLong { needed: usize, capacity: usize },
    #[error("the engine has stopped")]
    Stopped,
}

enum Command {
    Submit(Sequence),
    Reset(oneshot::Sender<bool>),
}

/// Cheap to clone; every HTTP handler of a worker holds one.
#[derive(Clone)]
pub struct EngineHandle {
    commands: mpsc::UnboundedSender<Command>,
    capacity_blocks: usize,
    block_size: usize,
    pub stats: Arc<EngineStats>,
}

impl EngineHandle {
    /// Queue a request. `output_tokens` are the tokens it will generate, in order.
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        output_tokens: Vec<u32>,
    ) -> Result<mpsc::UnboundedReceiver<Output>, SubmitError> {
        let needed = (prompt.len() + output_tokens.len()).div_ceil(self.block_size);
        if needed > self.capacity_blocks {
            return Err(SubmitError::TooLong {
                needed,
                capacity: self.capacity_blocks,
            });
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let sequence = Sequence::new(prompt, output_tokens, tx);
        self.commands
            .send(Command::Submit(sequence))
            .map_err(|_| SubmitError::Stopped)?;
        Ok(rx)
    }

    /// Clear the prefix cache; false while requests hold blocks (as vLLM refuses then).
    pub async fn reset_prefix_cache(&self) -> bool {
        let (tx, rx) = oneshot::channel();
        if self.commands.send(Command::Reset(tx)).is_err() {
            return false;
        }
        rx.await.unwrap_or(false)
    }
}

struct Sequence {
    /// Prompt followed by the tokens generated so far.
    tokens: Vec<u32>,
    prompt_len: usize,
    output_tokens: Vec<u32>,
    generated: usize,
    /// Tokens whose KV is computed.
    computed: usize,
    blocks: Vec<BlockId>,
    /// Chained hash of each full computed block.
    block_hashes: Vec<ExternalBlockHash>,
    output: mpsc::UnboundedSender<Output>,
    arrived: Instant,
    started: bool,
    first_token_at: Option<Instant>,
}

impl Sequence {
    fn new(
        prompt: Vec<u32>,
        output_tokens: Vec<u32>,
        output: mpsc::UnboundedSender<Output>,
    ) -> Sequence {
        Sequence {
            prompt_len: prompt.len(),
            tokens: prompt,
            output_tokens,
            generated: 0,
            computed: 0,
            blocks: Vec::new(),
            block_hashes: Vec::new(),
            output,
            arrived: Instant::now(),
            started: false,
            first_token_at: None,
        }
    }
}

/// Start an engine on the current tokio runtime. Batches of KV events go to `events` when given.
pub fn spawn(
    config: EngineConfig,
    events: Option<mpsc::UnboundedSender<KvEventBatch>>,
) -> EngineHandle {
    let (commands, rx) = mpsc::unbounded_channel();
    let stats = Arc::new(EngineStats::default());
    let handle = EngineHandle {
        commands,
        capacity_blocks: config.num_blocks,
        block_size: config.block_size,
        stats: stats.clone(),
    };
    let engine = Engine {
        cache: KvCache::new(config.num_blocks, config.block_size, config.hash_seed),
        config,
        waiting: VecDeque::new(),
        running: Vec::new(),
        pending_events: Vec::new(),
        events,
        stats,
    };
    tokio::spawn(engine.run(rx));
    handle
}

struct Engine {
    config: EngineConfig,
    cache: KvCache,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    pending_events: Vec<KvEvent>,
    events: Option<mpsc::UnboundedSender<KvEventBatch>>,
    stats: Arc<EngineStats>,
}

/// One scheduled piece of work: tokens of `running[index]` computed this step.
struct Scheduled {
    index: usize,
    tokens: usize,
}

impl Engine {
    async fn run(mut self, mut commands: mpsc::UnboundedReceiver<Command>) {
        loop {
            while let Ok(command) = commands.try_recv() {
                self.handle(command);
            }
            if self.running.is_empty() && self.waiting.is_empty() {
                match commands.recv().await {
                    Some(command) => {
                        self.handle(command);
                        continue;
                    }
                    None => return,
                }
            }
            let plan = self.schedule();
            self.update_gauges();
            if plan.is_empty() {
                // Nothing fits (every request is waiting on blocks held by nobody): wait for news.
                match commands.recv().await {
                    Some(command) => self.handle(command),
                    None => return,
                }
                continue;
            }
            let (prefill, decode_seqs, context) = self.step_shape(&plan);
            let seconds = self
                .config
                .latency
                .step_seconds(prefill, decode_seqs, context);
            tokio::time::sleep(Duration::from_secs_f64(seconds * self.config.time_scale)).await;
            self.apply(&plan);
            self.flush_events();
            self.update_gauges();
        }
    }

    /// Model seconds between two instants.
    fn model_seconds(&self, from: Instant, to: Instant) -> f64 {
        to.saturating_duration_since(from).as_secs_f64()
            / self.config.time_scale.max(f64::MIN_POSITIVE)
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Submit(sequence) => self.waiting.push_back(sequence),
            Command::Reset(reply) => {
                let done = self.cache.reset();
                if done {
                    self.pending_events.push(KvEvent::AllBlocksCleared);
                    self.flush_events();
                }
                let _ = reply.send(done);
            }
        }
    }

    fn step_shape(&self, plan: &[Scheduled]) -> (usize, usize, usize) {
        let (mut prefill, mut decode_seqs, mut context) = (0, 0, 0);
        for item in plan {
            let Some(sequence) = self.running.get(item.index) else {
                continue;
            };
            // Decode: the one token left is the last one sampled.
            if sequence.generated > 0 && sequence.tokens.len() - sequence.computed == 1 {
                decode_seqs += 1;
                context += sequence.computed;
            } else {
                prefill += item.tokens;
            }
        }
        (prefill, decode_seqs, context)
    }

    fn schedule(&mut self) -> Vec<Scheduled> {
        // Requests whose clients went away free their blocks now.
        let mut gone = Vec::new();
        self.running.retain(|s| {
            let keep = !s.output.is_closed();
            if !keep {
                gone.extend(s.blocks.iter().copied());
            }
            keep
        });
        self.cache.release(&gone);
        self.waiting.retain(|s| !s.output.is_closed());

        let mut budget = self.config.max_num_batched_tokens;
        let mut plan = Vec::new();
        let mut index = 0;
        while index < self.running.len() && budget > 0 {
            let Some(sequence) = self.running.get(index) else {
                break;
            };
            let tokens = (sequence.tokens.len() - sequence.computed).min(budget);
            let needed = (sequence.computed + tokens).div_ceil(self.config.block_size);
            let missing = needed.saturating_sub(sequence.blocks.len());
            if missing > 0 {
                match self.cache.allocate(missing) {
                    Some(allocation) => {
                        self.note_evictions(allocation.evicted);
                        if let Some(sequence) = self.running.get_mut(index) {
                            sequence.blocks.extend(allocation.blocks);
                        }
                    }
                    None => {
                        // Out of blocks: preempt the newest request (recompute later), as vLLM does.
                        let victim = if self.running.len() > index + 1 {
                            self.running.pop()
                        } else {
                            Some(self.running.remove(index))
                        };
                        if let Some(victim) = victim {
                            self.preempt(victim);
                        }
                        continue;
                    }
                }
            }
            plan.push(Scheduled { index, tokens });
            budget -= tokens;
            index += 1;
        }

        while budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(mut sequence) = self.waiting.pop_front() else {
                break;
            };
            let hashes = self.cache.hashes_of(&sequence.tokens);
            // The last prompt token is always recomputed, so a fully cached prompt still prefills one token.
            let cacheable = (sequence.tokens.len().saturating_sub(1)) / self.config.block_size;
            let cached_blocks = self
                .cache
                .cached_prefix(hashes.get(..cacheable.min(hashes.len())).unwrap_or(&[]));
            let prefix = hashes.get(..cached_blocks).unwrap_or(&[]);
            let acquired = self.cache.acquire_cached(prefix);
            let total_blocks = sequence.tokens.len().div_ceil(self.config.block_size);
            let Some(allocation) = self.cache.allocate(total_blocks - acquired.len()) else {
                self.cache.release(&acquired);
                self.waiting.push_front(sequence);
                break;
            };
            self.note_evictions(allocation.evicted);
            let cached_tokens = acquired.len() * self.config.block_size;
            sequence.block_hashes = prefix.to_vec();
            sequence.blocks = acquired;
            sequence.blocks.extend(allocation.blocks);
            sequence.computed = cached_tokens;
            self.stats
                .record_prefix_lookup(sequence.tokens.len(), cached_tokens);
            if !sequence.started {
                sequence.started = true;
                let _ = sequence.output.send(Output::Started { cached_tokens });
            }
            let tokens = (sequence.tokens.len() - sequence.computed).min(budget);
            budget -= tokens;
            plan.push(Scheduled {
                index: self.running.len(),
                tokens,
            });
            self.running.push(sequence);
        }
        plan
    }

    fn preempt(&mut self, mut sequence: Sequence) {
        self.cache.release(&sequence.blocks);
        sequence.blocks.clear();
        sequence.block_hashes.clear();
        sequence.computed = 0;
        self.stats.record_preemption();
        self.waiting.push_front(sequence);
    }

    fn note_evictions(&mut self, evicted: Vec<ExternalBlockHash>) {
        if !evicted.is_empty() {
            self.pending_events
                .push(KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: evicted,
                    medium: Some("GPU".into()),
                    group_idx: None,
                }));
        }
    }

    fn apply(&mut self, plan: &[Scheduled]) {
        let now = Instant::now();
        let block_size = self.config.block_size;
        let mut finished = Vec::new();
        for item in plan {
            let Some(sequence) = self.running.get_mut(item.index) else {
                continue;
            };
            sequence.computed += item.tokens;

            // Blocks that just became full enter the prefix cache (vLLM's BlockStored).
            let full = sequence.computed / block_size;
            let mut stored: Option<BlockStored> = None;
            for block in sequence.block_hashes.len()..full {
                let tokens = sequence
                    .tokens
                    .get(block * block_size..(block + 1) * block_size)
                    .unwrap_or(&[]);
                let parent = sequence.block_hashes.last().copied();
                let hash = self.cache.block_hash(parent, tokens);
                sequence.block_hashes.push(hash);
                let registered = sequence
                    .blocks
                    .get(block)
                    .is_some_and(|id| self.cache.register(*id, hash));
                if !registered {
                    // A duplicate of a block another request cached first: close the current run.
                    if let Some(run) = stored.take() {
                        self.pending_events.push(KvEvent::BlockStored(run));
                    }
                    continue;
                }
                let run = stored.get_or_insert_with(|| BlockStored {
                    parent_block_hash: parent,
                    block_size: block_size as u32,
                    medium: Some("GPU".into()),
                    ..Default::default()
                });
                run.block_hashes.push(hash);
                run.token_ids.extend_from_slice(tokens);
            }
            if let Some(run) = stored {
                self.pending_events.push(KvEvent::BlockStored(run));
            }

            if sequence.computed < sequence.tokens.len() {
                continue; // mid-prefill
            }
            let Some(&token) = sequence.output_tokens.get(sequence.generated) else {
                finished.push(item.index);
                continue;
            };
            sequence.tokens.push(token);
            sequence.generated += 1;
            if sequence.first_token_at.is_none() {
                sequence.first_token_at = Some(now);
            }
            let _ = sequence.output.send(Output::Token(token));
            if sequence.generated >= sequence.output_tokens.len() {
                finished.push(item.index);
            }
        }
        finished.sort_unstable();
        for index in finished.into_iter().rev() {
            if index >= self.running.len() {
                continue;
            }
            let sequence = self.running.remove(index);
            self.cache.release(&sequence.blocks);
            let _ = sequence.output.send(Output::Finished);
            let ttft = sequence
                .first_token_at
                .map(|t| self.model_seconds(sequence.arrived, t));
            let e2e = self.model_seconds(sequence.arrived, now);
            self.stats
                .record_finished(sequence.prompt_len, sequence.generated, ttft, e2e);
        }
    }

    fn flush_events(&mut self) {
        if self.pending_events.is_empty() {
            return;
        }
        let events = std::mem::take(&mut self.pending_events);
        if let Some(sender) = &self.events {
            let ts = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            let _ = sender.send(KvEventBatch {
                ts,
                events,
                data_parallel_rank: Some(0),
            });
        }
    }

    fn update_gauges(&self) {
        self.stats
            .set_gauges(self.running.len(), self.waiting.len(), self.cache.usage());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Submit and wait: (cached tokens, time to first token, generated tokens).
    async fn run_one(
        engine: &EngineHandle,
        prompt: Vec<u32>,
        output: Vec<u32>,
    ) -> (usize, Duration, Vec<u32>) {
        let start = Instant::now();
        let mut outputs = engine.submit(prompt, output).unwrap();
        let (mut cached, mut ttft, mut tokens) = (0, None, Vec::new());
        while let Some(output) = outputs.recv().await {
            match output {
                Output::Started { cached_tokens } => cached = cached_tokens,
                Output::Token(token) => {
                    ttft.get_or_insert_with(|| start.elapsed());
                    tokens.push(token);
                }
                Output::Finished => break,
            }
        }
        (cached, ttft.unwrap(), tokens)
    }

    fn assert_close(measured: Duration, predicted_seconds: f64, steps: u32) {
        // Tokio timers tick in whole milliseconds: allow one per step.
        let error = (measured.as_secs_f64() - predicted_seconds).abs();
        assert!(
            error <= 0.001 * f64::from(steps) + 1e-9,
            "measured {measured:?}, predicted {predicted_seconds}s"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn prefix_reuse_lowers_ttft_by_exactly_the_prefill_it_saves() {
        let config = EngineConfig::default();
        let latency = config.latency;
        let engine = spawn(config, None);
        let prompt: Vec<u32> = (0..1000).collect();
        let (cached, cold, tokens) = run_one(&engine, prompt.clone(), vec![7, 8, 9]).await;
        assert_eq!((cached, tokens), (0, vec![7, 8, 9]));
        assert_close(cold, latency.step_seconds(1000, 0, 0), 1);

        // Same first 960 tokens (60 full blocks), different tail.
        let mut shared = prompt.clone();
        for token in shared.iter_mut().skip(960) {
            *token += 5000;
        }
        let (cached, warm, _) = run_one(&engine, shared, vec![1]).await;
        assert_eq!(cached, 960);
        assert_close(warm, latency.step_seconds(40, 0, 0), 1);
        let saved = cold.as_secs_f64() - warm.as_secs_f64();
        assert!(
            (saved - 960.0 * latency.prefill_s_per_token).abs() <= 0.002,
            "saved {saved}s"
        );

        // An identical prompt still recomputes its last block (vLLM never caches the last token).
        let (cached, _, _) = run_one(&engine, prompt, vec![1]).await;
        assert_eq!(cached, 992);
        assert_eq!(engine.stats.prefix_hits(), 960 + 992);
    }

    #[tokio::test(start_paused = true)]
    async fn queued_requests_wait_for_capacity_and_chunked_prefill_splits_long_prompts() {
        let config = EngineConfig {
            max_num_seqs: 1,
            max_num_batched_tokens: 512,
            ..EngineConfig::default()
        };
        let latency = config.latency;
        let engine = spawn(config, None);
        let first = tokio::spawn({
            let engine = engine.clone();
            async move { run_one(&engine, (0..1000).collect(), vec![1, 2]).await }
        });
        tokio::task::yield_now().await;
        let second = run_one(&engine, (5000..5100).collect(), vec![1]).await;
        let first = first.await.unwrap();
        // 1000 tokens in chunks of 512: two prefill steps, the second samples the first token.
        assert_close(
            first.1,
            latency.step_seconds(512, 0, 0) + latency.step_seconds(488, 0, 0),
            2,
        );
        // The second request waits for the first to finish (one decode step after its prefill).
        let predicted = latency.step_seconds(512, 0, 0)
            + latency.step_seconds(488, 0, 0)
            + latency.step_seconds(0, 1, 1001)
            + latency.step_seconds(100, 0, 0);
        assert_close(second.1, predicted, 4);
    }

    #[tokio::test(start_paused = true)]
    async fn eviction_publishes_block_removed_for_the_least_recently_used_blocks() {
        let config = EngineConfig {
            num_blocks: 8,
            block_size: 4,
            ..EngineConfig::default()
        };
        let (tx, mut rx) = mpsc::unbounded_channel();
        let cache = KvCache::new(8, 4, config.hash_seed);
        let engine = spawn(config, Some(tx));
        let a: Vec<u32> = (0..16).collect();
        let a_hashes = cache.hashes_of(&a);
        run_one(&engine, a.clone(), vec![1]).await;
        let stored = rx.recv().await.unwrap();
        assert_eq!(stored.data_parallel_rank, Some(0));
        let [KvEvent::BlockStored(stored)] = stored.events.as_slice() else {
            panic!("{stored:?}")
        };
        assert_eq!(stored.block_hashes, a_hashes);
        assert_eq!(stored.parent_block_hash, None);
        assert_eq!(stored.token_ids, a);
        assert_eq!(stored.block_size, 4);

        // 7 new blocks: 4 never used, then 3 of A's, evicted tail first (A's prefix lives longest).
        let b: Vec<u32> = (100..128).collect();
        run_one(&engine, b.clone(), vec![1]).await;
        let batch = rx.recv().await.unwrap();
        let removed: Vec<_> = batch
            .events
            .iter()
            .filter_map(|e| match e {
                KvEvent::BlockRemoved(r) => Some(r.block_hashes.clone()),
                _ => None,
            })
            .flatten()
            .collect();
        assert_eq!(removed, vec![a_hashes[3], a_hashes[2], a_hashes[1]]);
        assert!(batch.events.iter().any(
            |e| matches!(e, KvEvent::BlockStored(s) if s.block_hashes == cache.hashes_of(&b))
        ));

        // Only A's first block is still cached.
        let (cached, _, _) = run_one(&engine, a, vec![1]).await;
        assert_eq!(cached, 4);
        assert!(engine.reset_prefix_cache().await);
        let cleared = loop {
            let batch = rx.recv().await.unwrap();
            if batch.events.contains(&KvEvent::AllBlocksCleared) {
                break batch;
            }
        };
        assert_eq!(cleared.events, vec![KvEvent::AllBlocksCleared]);
    }

    #[tokio::test(start_paused = true)]
    async fn running_out_of_blocks_preempts_and_still_finishes_everything() {
        let config = EngineConfig {
            num_blocks: 6,
            block_size: 4,
            ..EngineConfig::default()
        };
        let engine = spawn(config, None);
        let long_answer: Vec<u32> = (0..10).collect();
        let jobs: Vec<_> = (0..2u32)
            .map(|i| {
                let engine = engine.clone();
                let answer = long_answer.clone();
                tokio::spawn(async move {
                    run_one(&engine, (i * 100..i * 100 + 8).collect(), answer).await
                })
            })
            .collect();
        for job in jobs {
            assert_eq!(job.await.unwrap().2, long_answer);
        }
        let metrics = engine.stats.render("m");
        assert!(
            !metrics.contains("vllm:num_preemptions_total{model_name=\"m\",engine=\"0\"} 0"),
            "{metrics}"
        );
    }

    #[test]
    fn oversized_requests_are_refused_up_front() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let engine = spawn(
                EngineConfig {
                    num_blocks: 2,
                    block_size: 4,
                    ..EngineConfig::default()
                },
                None,
            );
            let error = engine.submit((0..9).collect(), vec![1]).unwrap_err();
            assert_eq!(
                error,
                SubmitError::TooLong {
                    needed: 3,
                    capacity: 2
                }
            );
        });
    }
}
