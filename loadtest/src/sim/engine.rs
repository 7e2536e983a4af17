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
    pub fn step_seconds(&self, prefill_tokens: usize, decode_seqs: usize, decode_context_tokens: usize) -> f64 {
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
    Started { cached_tokens: usize },
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
    pub fn submit(&self, prompt: Vec<u32>, output_tokens: Vec<u32>) -> Result<mpsc::UnboundedReceiver<Output>, SubmitError> {
        let needed = (prompt.len() + output_tokens.len()).div_ceil(self.block_size);
        if needed > self.capacity_blocks {
            return Err(SubmitError::TooLong {
                needed,
                capacity: self.capacity_blocks,
            });
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let sequence = Sequence::new(prompt, output_tokens, tx);
        self.commands.send(Command::Submit(sequence)).map_err(|_| SubmitError::Stopped)?;
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
    fn new(prompt: Vec<u32>, output_tokens: Vec<u32>, output: mpsc::UnboundedSender<Output>) -> Sequence {
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
pub fn spawn(config: EngineConfig, events: Option<mpsc::UnboundedSender<KvEventBatch>>) -> EngineHandle {
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
            let seconds = self.config.latency.step_seconds(prefill, decode_seqs, context);
            tokio::time::sleep(Duration::from_secs_f64(seconds * self.config.time_scale)).await;
            self.apply(&plan);
            self.flush_events();
            self.update_gauges();
        }
    }

    /// Model seconds between two instants.
    fn model_seconds(&self, from: Instant, to: Instant) -> f64 {
        to.saturating_duration_since(from).as_secs_f64() / self.config.time_scale.max(f64::MIN_POSITIVE)
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
            let cached_blocks = self.cache.cached_prefix(hashes.get(..cacheable.min(hashes.len())).unwrap_or(&[]));
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
            self.stats.record_prefix_lookup(sequence.tokens.len(), cached_tokens);
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
            self.pending_events.push(KvEvent::BlockRemoved(BlockRemoved {
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
                let tokens = sequence.tokens.get(block * block_size..(block + 1) * block_size).unwrap_or(&[]);
                let parent = sequence.block_hashes.last().copied();
                let hash = self.cache.block_hash(parent, tokens);
                sequence.block_hashes.push(hash);
                let registered = sequence.blocks.get(block).is_some_and(|id| self.cache.register(*id, hash));
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
            let ttft = sequence.first_token_at.map(|t| self.model_seconds(sequence.arrived, t));
            let e2e = self.model_seconds(sequence.arrived, now);
            self.stats.record_finished(sequence.prompt_len, sequence.generated, ttft, e2e);
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
        self.stats.set_gauges(self.running.len(), self.waiting.len(), self.cache.usage());
    }
}
