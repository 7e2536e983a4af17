//! The simulated engine: vLLM v1's scheduler over vLLM's block pool, with step times from a
//! latency model instead of a GPU.
//!
//! One step follows `Scheduler.schedule` and `update_from_output` (vLLM 0.34,
//! `v1/core/sched/scheduler.py`, FCFS policy, chunked prefill and prefix caching on):
//! 1. Running requests first, in order: each gets `min(tokens left, budget)` new tokens and the
//!    blocks for just that chunk (`KVCacheManager.allocate_slots`); when the pool is out of
//!    blocks the last running request is preempted (blocks freed, progress dropped, back to the
//!    front of the waiting queue) until the allocation fits or the request preempted itself.
//! 2. Only if nobody was preempted, waiting requests are admitted first come first served while
//!    `max_num_seqs` and the token budget allow: the longest cached prefix is looked up (never
//!    the last prompt token: `get_max_cache_hit_length`), and the request is admitted only if its
//!    whole sequence fits in the free blocks (`scheduler_reserve_full_isl`); the first that does
//!    not fit stops admission.
//! 3. Blocks whose tokens are all scheduled enter the prefix cache at once (`cache_blocks`
//!    inside `allocate_slots`), before the step runs, so a request admitted later in the same
//!    step already hits them. The step's KV events are published when it starts, as vLLM's
//!    default async scheduling publishes them (events of step N+1 go out when step N's output
//!    is processed).
//! 4. After the step, every request whose prompt is now computed samples one token; the first
//!    one is when the HTTP layer sends its first chunk (vLLM's serving layer only yields once an
//!    engine output carries a token). Finished requests free their blocks tail first.
//!
//! The step takes `LatencyModel::step_seconds` of model time, times the worker's
//! `step_time_multiplier`, scaled by `time_scale` into wall time. Nothing is drawn at random.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use switchyard_kv::events::{ExternalBlockHash, KvEvent, KvEventBatch};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::gpu::GpuProfile;
use super::kv_cache::{BlockId, KvCache};
use super::metrics::EngineStats;

/// Step cost in model seconds: a roofline of one forward pass (see `gpu.rs` for where each
/// figure comes from).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyModel {
    /// Scheduling, sampling and launch overhead of every step.
    pub step_overhead_s: f64,
    /// Weight GEMMs per token in the batch (2 × parameters FLOP at the card's FP8 rate).
    pub prefill_s_per_token: f64,
    /// Attention per (query, key) pair of a prefill chunk: a chunk of n tokens after c tokens
    /// of context costs n × c + n(n+1)/2 pairs, so a long cached prefix still costs something.
    pub attention_s_per_token_pair: f64,
    /// Reading every weight once: the floor of any forward pass.
    pub decode_base_s: f64,
    /// Extra work per decoding sequence (sampling, bookkeeping).
    pub decode_s_per_seq: f64,
    /// Reading one token of a decoding sequence's KV cache.
    pub decode_s_per_context_token: f64,
}

impl Default for LatencyModel {
    fn default() -> LatencyModel {
        GpuProfile::L40s48gb.latency(&super::gpu::ModelShape::DENSE_27B)
    }
}

/// What one step computes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepShape {
    /// Prompt tokens computed (all prefill chunks).
    pub prefill_tokens: usize,
    /// (query, key) pairs of the prefill chunks' attention.
    pub prefill_attention_pairs: usize,
    /// Sequences decoding one token each.
    pub decode_seqs: usize,
    /// Context tokens those sequences read.
    pub decode_context_tokens: usize,
}

impl StepShape {
    /// Add a prefill chunk of `tokens` after `context` tokens already computed.
    pub fn add_prefill(&mut self, context: usize, tokens: usize) {
        self.prefill_tokens += tokens;
        self.prefill_attention_pairs += tokens * context + tokens * (tokens + 1) / 2;
    }

    pub fn add_decode(&mut self, context: usize) {
        self.decode_seqs += 1;
        self.decode_context_tokens += context;
    }
}

impl LatencyModel {
    /// Model time of one step: the longer of reading the weights and the batch's GEMMs, plus
    /// attention, per-sequence work and KV reads.
    pub fn step_seconds(&self, shape: &StepShape) -> f64 {
        let batch_tokens = (shape.prefill_tokens + shape.decode_seqs) as f64;
        self.step_overhead_s
            + self
                .decode_base_s
                .max(batch_tokens * self.prefill_s_per_token)
            + shape.prefill_attention_pairs as f64 * self.attention_s_per_token_pair
            + shape.decode_seqs as f64 * self.decode_s_per_seq
            + shape.decode_context_tokens as f64 * self.decode_s_per_context_token
    }
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// KV blocks, vLLM's null block included.
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub latency: LatencyModel,
    /// Wall seconds per model second (0.01 runs 100× faster than the modelled GPU).
    pub time_scale: f64,
    pub hash_seed: u64,
    /// This worker's step time relative to the latency model (1.5: a card 1.5× slower), so a
    /// fleet can be heterogeneous.
    pub step_time_multiplier: f64,
}

impl Default for EngineConfig {
    /// One L40S as vLLM 0.34 configures it (`GpuProfile::L40s48gb`).
    fn default() -> EngineConfig {
        GpuProfile::L40s48gb.engine_config()
    }
}

/// What the engine tells the HTTP layer about one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Sent with the first token, just before it: this many prompt tokens came from the prefix
    /// cache when the request was first scheduled (vLLM's `num_cached_tokens`).
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
    Submit(Box<Sequence>),
    Reset(oneshot::Sender<bool>),
    Predict(Box<PredictRequest>),
}

/// A request the oracle asks about: what its TTFT would be if it arrived now.
struct PredictRequest {
    prompt: Vec<u32>,
    cache_salt: Option<String>,
    reply: oneshot::Sender<Prediction>,
}

/// The engine's own answer to "what TTFT would this request get if it arrived now?".
///
/// It is computed by running a copy of this engine's scheduler, block pool, queues and latency
/// model forward from the present state, with the request appended to the waiting queue, until
/// it samples its first token. Every figure the real engine would use is exact: the queues, the
/// tokens each request still has to prefill, the prefix cache (same block hashing, eviction,
/// admission rules) and the step costs, including the rest of a step already running. It is
/// still a prediction: requests that arrive later than "now" but are scheduled before this one
/// (none under FCFS, but they change the batches it shares) are not known, the HTTP hop between
/// the question and the real submission is ignored, and nothing here is random, so the only
/// error is future arrivals.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Prediction {
    /// Model seconds from now to the first token; `None` when the current state can never admit
    /// it (it waits on blocks nobody will free until a new request arrives).
    pub predicted_ttft_s: Option<f64>,
    /// Prompt tokens the prefix cache would supply when it is admitted (the dry run's hit).
    pub cached_tokens: usize,
    /// Prompt tokens cached now (the hit if it were admitted at this instant).
    pub cached_tokens_now: usize,
    /// Queue lengths now (waiting includes requests submitted during the running step).
    pub waiting: usize,
    pub running: usize,
    /// Scheduler steps the dry run took (the running step counts as one).
    pub steps: usize,
}

/// A dry run gives up after this many steps (a request this far back is never the argmin).
const PREDICTION_MAX_STEPS: usize = 100_000;

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
        self.submit_salted(prompt, output_tokens, None)
    }

    /// [`EngineHandle::submit`] for a request with vLLM's `cache_salt`: it shares cached blocks
    /// only with requests of the same salt.
    pub fn submit_salted(
        &self,
        prompt: Vec<u32>,
        output_tokens: Vec<u32>,
        cache_salt: Option<String>,
    ) -> Result<mpsc::UnboundedReceiver<Output>, SubmitError> {
        let needed = (prompt.len() + output_tokens.len()).div_ceil(self.block_size);
        if needed > self.capacity_blocks {
            return Err(SubmitError::TooLong {
                needed,
                capacity: self.capacity_blocks,
            });
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let mut sequence = Sequence::new(prompt, output_tokens, tx);
        sequence.cache_salt = cache_salt;
        self.commands
            .send(Command::Submit(Box::new(sequence)))
            .map_err(|_| SubmitError::Stopped)?;
        Ok(rx)
    }

    /// The TTFT this prompt would get if it arrived now (see [`Prediction`]); `None` when the
    /// engine has stopped. Answered at once, also while a step runs.
    pub async fn predict_ttft(
        &self,
        prompt: Vec<u32>,
        cache_salt: Option<String>,
    ) -> Option<Prediction> {
        let (reply, rx) = oneshot::channel();
        let request = PredictRequest {
            prompt,
            cache_salt,
            reply,
        };
        self.commands
            .send(Command::Predict(Box::new(request)))
            .ok()?;
        rx.await.ok()
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
    /// Tokens whose KV is computed (vLLM's `num_computed_tokens`).
    computed: usize,
    blocks: Vec<BlockId>,
    /// Chained hash of every full block of `tokens` (vLLM's `request.block_hashes`).
    block_hashes: Vec<ExternalBlockHash>,
    /// vLLM's per-request `cache_salt`: an extra key of the first block's hash.
    cache_salt: Option<String>,
    /// Leading blocks already in the prefix cache (the manager's `num_cached_block`).
    cached_blocks: usize,
    /// Prefix-cache hit when first scheduled (vLLM's `num_cached_tokens`).
    cached_tokens: Option<usize>,
    preemptions: usize,
    output: mpsc::UnboundedSender<Output>,
    arrived: Instant,
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
            cache_salt: None,
            cached_blocks: 0,
            cached_tokens: None,
            preemptions: 0,
            output,
            arrived: Instant::now(),
            first_token_at: None,
        }
    }

    /// A copy for a dry run, with its own output channel (closed if the original's is, so the
    /// copy is aborted exactly when the original would be); the receiver must be kept alive.
    fn dry_copy(&self) -> (Sequence, Option<mpsc::UnboundedReceiver<Output>>) {
        let (output, rx) = mpsc::unbounded_channel();
        let copy = Sequence {
            tokens: self.tokens.clone(),
            prompt_len: self.prompt_len,
            output_tokens: self.output_tokens.clone(),
            generated: self.generated,
            computed: self.computed,
            blocks: self.blocks.clone(),
            block_hashes: self.block_hashes.clone(),
            cache_salt: self.cache_salt.clone(),
            cached_blocks: self.cached_blocks,
            cached_tokens: self.cached_tokens,
            preemptions: self.preemptions,
            output,
            arrived: self.arrived,
            first_token_at: self.first_token_at,
        };
        (copy, (!self.output.is_closed()).then_some(rx))
    }

    /// Hash the blocks that became full since the last call.
    fn update_hashes(&mut self, cache: &KvCache) {
        let size = cache.block_size();
        for block in self.block_hashes.len()..self.tokens.len() / size {
            let tokens = self
                .tokens
                .get(block * size..(block + 1) * size)
                .unwrap_or(&[]);
            let hash = cache.block_hash_salted(
                self.block_hashes.last().copied(),
                tokens,
                self.cache_salt.as_deref(),
            );
            self.block_hashes.push(hash);
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
    stats.set_cache_config(config.block_size, config.num_blocks);
    let cache = KvCache::new(config.num_blocks, config.block_size, config.hash_seed);
    let handle = EngineHandle {
        commands,
        capacity_blocks: cache.capacity(),
        block_size: config.block_size,
        stats: stats.clone(),
    };
    let engine = Engine {
        cache,
        config,
        waiting: VecDeque::new(),
        running: Vec::new(),
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
            self.publish_events();
            if plan.is_empty() {
                // Nothing fits (every request is waiting on blocks held by nobody): wait for news.
                self.update_gauges();
                match commands.recv().await {
                    Some(command) => self.handle(command),
                    None => return,
                }
                continue;
            }
            let seconds = self.config.latency.step_seconds(&self.step_shape(&plan))
                * self.config.step_time_multiplier;
            let step_end =
                Instant::now() + Duration::from_secs_f64(seconds * self.config.time_scale);
            // While the step runs, predictions are answered at once; everything else waits for
            // the step to end, as it would in the loop above.
            let mut deferred = Vec::new();
            let mut open = true;
            loop {
                tokio::select! {
                    () = tokio::time::sleep_until(step_end) => break,
                    command = commands.recv(), if open => match command {
                        Some(Command::Predict(request)) => {
                            let prediction =
                                self.predict(Some((&plan, step_end)), &deferred, &request);
                            let _ = request.reply.send(prediction);
                        }
                        Some(command) => deferred.push(command),
                        None => open = false,
                    },
                }
            }
            self.apply(&plan);
            self.publish_events();
            self.update_gauges();
            for command in deferred {
                self.handle(command);
            }
        }
    }

    /// Run a copy of this engine forward with `request` appended to the waiting queue until it
    /// samples its first token (see [`Prediction`]). `in_flight` is the step now running and
    /// when it ends; `deferred` the commands that arrived during it (submissions join the
    /// queue when it ends, ahead of this request).
    fn predict(
        &self,
        in_flight: Option<(&[Scheduled], Instant)>,
        deferred: &[Command],
        request: &PredictRequest,
    ) -> Prediction {
        let mut receivers = Vec::new();
        let mut copy_of = |sequence: &Sequence| {
            let (copy, rx) = sequence.dry_copy();
            receivers.extend(rx);
            copy
        };
        let running = self.running.iter().map(&mut copy_of).collect();
        let mut waiting: VecDeque<Sequence> = self.waiting.iter().map(&mut copy_of).collect();
        let submitted: Vec<Sequence> = deferred
            .iter()
            .filter_map(|command| match command {
                Command::Submit(sequence) => Some(copy_of(sequence)),
                _ => None,
            })
            .collect();
        let mut dry = Engine {
            config: self.config.clone(),
            cache: self.cache.clone(),
            waiting: VecDeque::new(),
            running,
            events: None,
            stats: Arc::new(EngineStats::default()),
        };
        let (mut elapsed, mut steps) = (0.0, 0);
        dry.waiting.append(&mut waiting);
        if let Some((plan, step_end)) = in_flight {
            elapsed = self.model_seconds(Instant::now(), step_end);
            steps = 1;
            dry.apply(plan);
        }
        for mut sequence in submitted {
            sequence.update_hashes(&dry.cache);
            dry.waiting.push_back(sequence);
        }
        let (output, mut first) = mpsc::unbounded_channel();
        let mut probe = Sequence::new(request.prompt.clone(), vec![0], output);
        probe.cache_salt = request.cache_salt.clone();
        probe.update_hashes(&dry.cache);
        let size = self.config.block_size;
        let max_hit_blocks = probe.tokens.len().saturating_sub(1) / size;
        let cached_tokens_now = self
            .cache
            .longest_cache_hit(
                probe
                    .block_hashes
                    .get(..max_hit_blocks.min(probe.block_hashes.len()))
                    .unwrap_or(&[]),
            )
            .len()
            * size;
        let queued = (dry.waiting.len(), dry.running.len());
        dry.waiting.push_back(probe);
        let mut prediction = Prediction {
            predicted_ttft_s: None,
            cached_tokens: 0,
            cached_tokens_now,
            waiting: queued.0,
            running: queued.1,
            steps,
        };
        while prediction.steps < PREDICTION_MAX_STEPS {
            let plan = dry.schedule();
            if plan.is_empty() {
                break;
            }
            elapsed += dry.config.latency.step_seconds(&dry.step_shape(&plan))
                * dry.config.step_time_multiplier;
            prediction.steps += 1;
            dry.apply(&plan);
            if let Ok(Output::Started { cached_tokens }) = first.try_recv() {
                prediction.predicted_ttft_s = Some(elapsed);
                prediction.cached_tokens = cached_tokens;
                break;
            }
        }
        prediction
    }

    /// Model seconds between two instants.
    fn model_seconds(&self, from: Instant, to: Instant) -> f64 {
        to.saturating_duration_since(from).as_secs_f64()
            / self.config.time_scale.max(f64::MIN_POSITIVE)
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Submit(mut sequence) => {
                sequence.update_hashes(&self.cache);
                self.waiting.push_back(*sequence);
            }
            Command::Reset(reply) => {
                let done = self.cache.reset();
                self.publish_events();
                let _ = reply.send(done);
            }
            Command::Predict(request) => {
                let prediction = self.predict(None, &[], &request);
                let _ = request.reply.send(prediction);
            }
        }
    }

    fn step_shape(&self, plan: &[Scheduled]) -> StepShape {
        let mut shape = StepShape::default();
        for item in plan {
            let Some(sequence) = self.running.get(item.index) else {
                continue;
            };
            // Decode: the one token left is the last one sampled.
            if sequence.generated > 0 && item.tokens == 1 {
                shape.add_decode(sequence.computed);
            } else {
                shape.add_prefill(sequence.computed, item.tokens);
            }
        }
        shape
    }

    fn schedule(&mut self) -> Vec<Scheduled> {
        // Requests whose clients went away free their blocks now (vLLM aborts them).
        let mut index = 0;
        while index < self.running.len() {
            if self
                .running
                .get(index)
                .is_some_and(|s| s.output.is_closed())
            {
                let gone = self.running.remove(index);
                self.cache.free_blocks(gone.blocks.iter().rev().copied());
            } else {
                index += 1;
            }
        }
        self.waiting.retain(|s| !s.output.is_closed());

        let mut budget = self.config.max_num_batched_tokens;
        let mut plan = Vec::new();
        let mut preempted_any = false;
        let mut index = 0;
        'running: while index < self.running.len() && budget > 0 {
            let Some(sequence) = self.running.get(index) else {
                break;
            };
            let tokens = (sequence.tokens.len() - sequence.computed).min(budget);
            loop {
                if self.allocate_chunk(index, tokens) {
                    break;
                }
                // Out of blocks: preempt the last running request (FCFS's lowest priority).
                let Some(victim) = self.running.pop() else {
                    break 'running;
                };
                preempted_any = true;
                let preempted_itself = self.running.len() == index;
                self.preempt(victim);
                if preempted_itself {
                    break 'running;
                }
            }
            plan.push(Scheduled { index, tokens });
            budget -= tokens;
            index += 1;
        }

        // vLLM admits nobody in a step that had to preempt.
        while !preempted_any && budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(sequence) = self.waiting.front() else {
                break;
            };
            let size = self.config.block_size;
            // The last prompt token is always recomputed (`get_max_cache_hit_length`).
            let max_hit_blocks = (sequence.tokens.len() - 1) / size;
            let hit = self.cache.longest_cache_hit(
                sequence
                    .block_hashes
                    .get(..max_hit_blocks.min(sequence.block_hashes.len()))
                    .unwrap_or(&[]),
            );
            let hit_tokens = hit.len() * size;
            // The whole sequence must fit: blocks beyond the hit, plus hit blocks that sit in
            // the free queue (touching them takes them out of it).
            let free_hits = hit.iter().filter(|&&id| self.cache.is_free(id)).count();
            let needed = sequence.tokens.len().div_ceil(size) - hit.len() + free_hits;
            if needed > self.cache.num_free() {
                break;
            }
            let Some(mut sequence) = self.waiting.pop_front() else {
                break;
            };
            let tokens = (sequence.tokens.len() - hit_tokens).min(budget);
            self.cache.touch(&hit);
            sequence.cached_blocks = hit.len();
            sequence.blocks = hit;
            sequence.computed = hit_tokens;
            // Lookups of resumed (preempted) requests are not in vLLM's prefix-cache counters.
            if sequence.preemptions == 0 {
                self.stats
                    .record_prefix_lookup(sequence.tokens.len(), hit_tokens);
            }
            sequence.cached_tokens.get_or_insert(hit_tokens);
            self.running.push(sequence);
            let index = self.running.len() - 1;
            // Fits by the check above.
            if !self.allocate_chunk(index, tokens) {
                break;
            }
            plan.push(Scheduled { index, tokens });
            budget -= tokens;
        }
        plan
    }

    /// Blocks for `tokens` more tokens of `running[index]`, then cache the blocks those tokens
    /// fill (`allocate_slots` → `cache_blocks`). False, with nothing changed, when the pool has
    /// too few free blocks.
    fn allocate_chunk(&mut self, index: usize, tokens: usize) -> bool {
        let size = self.config.block_size;
        let Some(sequence) = self.running.get_mut(index) else {
            return false;
        };
        let needed = (sequence.computed + tokens)
            .div_ceil(size)
            .saturating_sub(sequence.blocks.len());
        if needed > 0 {
            let Some(blocks) = self.cache.get_new_blocks(needed) else {
                return false;
            };
            sequence.blocks.extend(blocks);
        }
        let full = ((sequence.computed + tokens).min(sequence.tokens.len()) / size)
            .min(sequence.block_hashes.len());
        self.cache.cache_full_blocks(
            &sequence.blocks,
            &sequence.block_hashes,
            &sequence.tokens,
            sequence.cached_blocks,
            full,
            sequence.cache_salt.as_deref(),
        );
        sequence.cached_blocks = sequence.cached_blocks.max(full);
        true
    }

    fn preempt(&mut self, mut sequence: Sequence) {
        self.cache
            .free_blocks(sequence.blocks.iter().rev().copied());
        sequence.blocks.clear();
        sequence.cached_blocks = 0;
        sequence.computed = 0;
        sequence.preemptions += 1;
        self.stats.record_preemption();
        self.waiting.push_front(sequence);
    }

    fn apply(&mut self, plan: &[Scheduled]) {
        let now = Instant::now();
        let mut finished = Vec::new();
        for item in plan {
            let Some(sequence) = self.running.get_mut(item.index) else {
                continue;
            };
            sequence.computed += item.tokens;
            if sequence.computed < sequence.tokens.len() {
                continue; // mid-prefill: no output yet
            }
            let Some(&token) = sequence.output_tokens.get(sequence.generated) else {
                finished.push(item.index);
                continue;
            };
            sequence.tokens.push(token);
            sequence.generated += 1;
            sequence.update_hashes(&self.cache);
            if sequence.first_token_at.is_none() {
                sequence.first_token_at = Some(now);
                let _ = sequence.output.send(Output::Started {
                    cached_tokens: sequence.cached_tokens.unwrap_or(0),
                });
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
            self.cache
                .free_blocks(sequence.blocks.iter().rev().copied());
            let _ = sequence.output.send(Output::Finished);
            let ttft = sequence
                .first_token_at
                .map(|t| self.model_seconds(sequence.arrived, t));
            let e2e = self.model_seconds(sequence.arrived, now);
            self.stats
                .record_finished(sequence.prompt_len, sequence.generated, ttft, e2e);
        }
    }

    /// Send the pool's queued events as one batch (`take_events` → publisher).
    fn publish_events(&mut self) {
        let events: Vec<KvEvent> = self.cache.take_events();
        if events.is_empty() {
            return;
        }
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

    /// What one request saw, with times measured from its submission.
    struct Seen {
        cached: usize,
        started_at: Duration,
        ttft: Duration,
        tokens: Vec<u32>,
    }

    async fn run_one(engine: &EngineHandle, prompt: Vec<u32>, output: Vec<u32>) -> Seen {
        let start = Instant::now();
        let outputs = engine.submit(prompt, output).unwrap();
        collect(start, outputs).await
    }

    async fn collect(start: Instant, mut outputs: mpsc::UnboundedReceiver<Output>) -> Seen {
        let (mut cached, mut started_at, mut ttft, mut tokens) = (0, None, None, Vec::new());
        while let Some(output) = outputs.recv().await {
            match output {
                Output::Started { cached_tokens } => {
                    cached = cached_tokens;
                    started_at = Some(start.elapsed());
                }
                Output::Token(token) => {
                    ttft.get_or_insert_with(|| start.elapsed());
                    tokens.push(token);
                }
                Output::Finished => break,
            }
        }
        Seen {
            cached,
            started_at: started_at.unwrap(),
            ttft: ttft.unwrap(),
            tokens,
        }
    }

    fn assert_close(measured: Duration, predicted_seconds: f64, steps: u32) {
        // Tokio timers tick in whole milliseconds: allow one per step.
        let error = (measured.as_secs_f64() - predicted_seconds).abs();
        assert!(
            error <= 0.001 * f64::from(steps) + 1e-9,
            "measured {measured:?}, predicted {predicted_seconds}s"
        );
    }

    fn prefill(context: usize, tokens: usize) -> StepShape {
        let mut shape = StepShape::default();
        shape.add_prefill(context, tokens);
        shape
    }

    fn stored(batch: &KvEventBatch) -> Vec<(Option<ExternalBlockHash>, Vec<ExternalBlockHash>)> {
        batch
            .events
            .iter()
            .filter_map(|e| match e {
                KvEvent::BlockStored(s) => Some((s.parent_block_hash, s.block_hashes.clone())),
                _ => None,
            })
            .collect()
    }

    fn removed(batch: &KvEventBatch) -> Vec<ExternalBlockHash> {
        crate::sim::kv_cache::tests::removed(&batch.events)
    }

    /// An engine of 8 usable blocks of 4 tokens publishing events, and a cache that hashes as
    /// it does.
    fn small_engine_with_events() -> (EngineHandle, mpsc::UnboundedReceiver<KvEventBatch>, KvCache)
    {
        let config = EngineConfig {
            num_blocks: 9,
            block_size: 4,
            ..EngineConfig::default()
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let cache = KvCache::new(9, 4, config.hash_seed);
        (spawn(config, Some(tx)), rx, cache)
    }

    #[test]
    fn prefill_costs_more_after_a_long_cached_prefix_and_never_less_than_a_weight_read() {
        let latency = LatencyModel::default();
        let cold = latency.step_seconds(&prefill(0, 40));
        let after_prefix = latency.step_seconds(&prefill(8_000, 40));
        assert!(after_prefix > cold, "{after_prefix} <= {cold}");
        // A tiny prefill still reads every weight once.
        assert!(cold >= latency.decode_base_s + latency.step_overhead_s);
        // Big prefills are compute bound.
        let big = latency.step_seconds(&prefill(0, 2_000));
        assert!(big > 2_000.0 * latency.prefill_s_per_token);
    }

    #[tokio::test(start_paused = true)]
    async fn prefix_reuse_lowers_ttft_and_the_first_chunk_waits_for_the_first_token() {
        let config = EngineConfig::default();
        let latency = config.latency;
        let engine = spawn(config, None);
        let prompt: Vec<u32> = (0..1024).collect();
        let cold = run_one(&engine, prompt.clone(), vec![7, 8, 9]).await;
        assert_eq!((cold.cached, cold.tokens), (0, vec![7, 8, 9]));
        assert_close(cold.ttft, latency.step_seconds(&prefill(0, 1024)), 1);
        // vLLM sends nothing before the first engine output.
        assert_eq!(cold.started_at, cold.ttft);

        // Same first 960 tokens (15 blocks of 64), different tail.
        let mut shared = prompt.clone();
        for token in shared.iter_mut().skip(960) {
            *token += 5000;
        }
        let warm = run_one(&engine, shared, vec![1]).await;
        assert_eq!(warm.cached, 960);
        assert_close(warm.ttft, latency.step_seconds(&prefill(960, 64)), 1);

        // An identical prompt of whole blocks still recomputes its last block.
        let again = run_one(&engine, prompt, vec![1]).await;
        assert_eq!(again.cached, 960);
        assert_eq!(engine.stats.prefix_hits(), 960 + 960);
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
        let prefill_steps =
            latency.step_seconds(&prefill(0, 512)) + latency.step_seconds(&prefill(512, 488));
        assert_close(first.ttft, prefill_steps, 2);
        // The second request waits for the first to finish (one decode step after its prefill).
        let mut decode = StepShape::default();
        decode.add_decode(1000);
        let predicted =
            prefill_steps + latency.step_seconds(&decode) + latency.step_seconds(&prefill(0, 100));
        assert_close(second.ttft, predicted, 4);
    }

    #[tokio::test(start_paused = true)]
    async fn blocks_are_allocated_per_scheduled_chunk() {
        let config = EngineConfig {
            max_num_batched_tokens: 512,
            ..EngineConfig::default()
        };
        let latency = config.latency;
        let capacity = (config.num_blocks - 1) as f64;
        let engine = spawn(config, None);
        let _outputs = engine.submit((0..1000).collect(), vec![1]).unwrap();
        // Just after the first chunk: 8 blocks held for 512 tokens, not 16 for the prompt.
        let first_step = latency.step_seconds(&prefill(0, 512));
        tokio::time::sleep(Duration::from_secs_f64(first_step + 0.000_5)).await;
        let held = (engine.stats.kv_usage() * capacity).round();
        assert_eq!(held, 8.0);
    }

    #[tokio::test(start_paused = true)]
    async fn blocks_are_stored_when_scheduled_and_published_before_the_step_ends() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let config = EngineConfig::default();
        let cache = KvCache::new(config.num_blocks, config.block_size, config.hash_seed);
        let engine = spawn(config, Some(tx));
        let prompt: Vec<u32> = (0..200).collect();
        let mut outputs = engine.submit(prompt.clone(), vec![1]).unwrap();
        let batch = rx.recv().await.unwrap();
        // Published as the step starts: no output exists yet.
        assert!(outputs.try_recv().is_err());
        let hashes = cache.hashes_of(&prompt);
        assert_eq!(stored(&batch), vec![(None, hashes.clone())]);
        let KvEvent::BlockStored(event) = &batch.events[0] else {
            panic!("{batch:?}")
        };
        assert_eq!(event.token_ids, prompt[..192].to_vec());
        assert_eq!((event.block_size, event.group_idx), (64, Some(0)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_admitted_in_the_same_step_hits_blocks_scheduled_before_it() {
        let engine = spawn(EngineConfig::default(), None);
        let start = Instant::now();
        let shared: Vec<u32> = (0..128).collect();
        let a = engine
            .submit([shared.clone(), (1000..1050).collect()].concat(), vec![1])
            .unwrap();
        let b = engine
            .submit([shared, (2000..2050).collect()].concat(), vec![1])
            .unwrap();
        let (a, b) = tokio::join!(collect(start, a), collect(start, b));
        assert_eq!(a.cached, 0);
        assert_eq!(
            b.cached, 128,
            "vLLM caches scheduled blocks before computing them"
        );
        assert_eq!(a.ttft, b.ttft, "both were admitted in one step");
    }

    #[tokio::test(start_paused = true)]
    async fn identical_blocks_computed_twice_are_stored_and_removed_once_per_copy() {
        let (engine, mut rx, cache) = small_engine_with_events();
        let start = Instant::now();
        // Two identical prompts of two whole blocks in one step: the second hits the first
        // block and recomputes the last one, a second copy of the same content.
        let prompt: Vec<u32> = (0..8).collect();
        let hashes = cache.hashes_of(&prompt);
        let a = engine.submit(prompt.clone(), vec![1]).unwrap();
        let b = engine.submit(prompt.clone(), vec![1]).unwrap();
        let (_, b) = tokio::join!(collect(start, a), collect(start, b));
        assert_eq!(b.cached, 4);
        let batch = rx.recv().await.unwrap();
        assert_eq!(
            stored(&batch),
            vec![(None, hashes.clone()), (Some(hashes[0]), vec![hashes[1]])]
        );
        // Seven blocks of other content: both copies of the second block are evicted, each
        // reported, while the first block (freed last) survives.
        run_one(&engine, (100..128).collect(), vec![1]).await;
        let mut gone = Vec::new();
        while let Ok(batch) = rx.try_recv() {
            gone.extend(removed(&batch));
        }
        assert_eq!(gone, vec![hashes[1], hashes[1]]);
        assert_eq!(run_one(&engine, prompt, vec![1]).await.cached, 4);
    }

    #[tokio::test(start_paused = true)]
    async fn eviction_publishes_block_removed_for_the_least_recently_used_blocks() {
        let (engine, mut rx, cache) = small_engine_with_events();
        let a: Vec<u32> = (0..16).collect();
        let a_hashes = cache.hashes_of(&a);
        run_one(&engine, a.clone(), vec![1]).await;
        let batch = rx.recv().await.unwrap();
        assert_eq!(batch.data_parallel_rank, Some(0));
        // All four prompt blocks are full once the prompt is scheduled: stored at once.
        let KvEvent::BlockStored(event) = &batch.events[0] else {
            panic!("{batch:?}")
        };
        assert_eq!(event.block_hashes, a_hashes);
        assert_eq!(event.parent_block_hash, None);
        assert_eq!(event.token_ids, a);
        assert_eq!(event.block_size, 4);

        // 7 new blocks: 4 never used, then 3 of A's, evicted tail first (A's prefix lives longest).
        let b: Vec<u32> = (100..128).collect();
        run_one(&engine, b.clone(), vec![1]).await;
        let batch = rx.recv().await.unwrap();
        assert_eq!(removed(&batch), vec![a_hashes[3], a_hashes[2], a_hashes[1]]);
        assert!(
            stored(&batch)
                .iter()
                .any(|(_, hashes)| *hashes == cache.hashes_of(&b))
        );

        // Only A's first block is still cached.
        assert_eq!(run_one(&engine, a, vec![1]).await.cached, 4);
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
            num_blocks: 7,
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
            assert_eq!(job.await.unwrap().tokens, long_answer);
        }
        let metrics = engine.stats.render("m");
        assert!(
            !metrics.contains("vllm:num_preemptions_total{model_name=\"m\",engine=\"0\"} 0"),
            "{metrics}"
        );
        // The cache size a router reads, as vLLM's info gauge labels it (null block included).
        assert!(
            metrics.contains("block_size=\"4\"") && metrics.contains("num_gpu_blocks=\"7\""),
            "{metrics}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_slower_worker_takes_proportionally_longer() {
        let config = EngineConfig {
            step_time_multiplier: 1.5,
            ..EngineConfig::default()
        };
        let step = config.latency.step_seconds(&prefill(0, 300));
        let engine = spawn(config, None);
        let seen = run_one(&engine, (0..300).collect(), vec![1]).await;
        assert_close(seen.ttft, 1.5 * step, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_prediction_is_the_ttft_the_request_then_gets_when_nothing_else_arrives() {
        let config = EngineConfig {
            max_num_batched_tokens: 512,
            ..EngineConfig::default()
        };
        let latency = config.latency;
        let engine = spawn(config, None);
        // Idle: one prefill step.
        let alone = engine.predict_ttft((0..300).collect(), None).await.unwrap();
        assert_close(
            Duration::from_secs_f64(alone.predicted_ttft_s.unwrap()),
            latency.step_seconds(&prefill(0, 300)),
            0,
        );
        assert_eq!(
            (alone.waiting, alone.running, alone.cached_tokens),
            (0, 0, 0)
        );

        // Busy: a 1,500-token request decoding 20 tokens; ask in the middle of its first step.
        let start = Instant::now();
        let first = engine
            .submit((0..1500).collect(), (0..20).collect())
            .unwrap();
        tokio::time::sleep(Duration::from_secs_f64(
            latency.step_seconds(&prefill(0, 512)) / 2.0,
        ))
        .await;
        let prompt: Vec<u32> = (5000..5700).collect();
        let predicted = engine.predict_ttft(prompt.clone(), None).await.unwrap();
        assert_eq!((predicted.waiting, predicted.running), (0, 1));
        // The question queued nothing: the real request now gets exactly that TTFT.
        let asked_at = Instant::now();
        let seen = collect(asked_at, engine.submit(prompt, vec![1]).unwrap()).await;
        let predicted_s = predicted.predicted_ttft_s.unwrap();
        assert!(predicted_s > alone.predicted_ttft_s.unwrap());
        assert_close(seen.ttft, predicted_s, predicted.steps as u32);
        drop((first, start));
    }

    #[tokio::test(start_paused = true)]
    async fn a_prediction_counts_the_prefix_cache_and_requests_submitted_during_the_step() {
        let engine = spawn(EngineConfig::default(), None);
        let shared: Vec<u32> = (0..1024).collect();
        run_one(&engine, shared.clone(), vec![1]).await;
        let warm = [shared.clone(), (9000..9100).collect()].concat();
        let cold: Vec<u32> = (20_000..21_124).collect();
        let hit = engine.predict_ttft(warm.clone(), None).await.unwrap();
        let miss = engine.predict_ttft(cold.clone(), None).await.unwrap();
        assert_eq!((hit.cached_tokens, hit.cached_tokens_now), (1024, 1024));
        assert_eq!(miss.cached_tokens, 0);
        assert!(hit.predicted_ttft_s.unwrap() < miss.predicted_ttft_s.unwrap());

        // A request submitted while a step runs is ahead of the question in the queue.
        let _busy = engine.submit((30_000..32_000).collect(), vec![1]).unwrap();
        tokio::task::yield_now().await;
        let _queued = engine.submit(cold.clone(), vec![1]).unwrap();
        let behind = engine.predict_ttft(warm, None).await.unwrap();
        assert_eq!(behind.waiting, 1, "{behind:?}");
        assert!(behind.predicted_ttft_s.unwrap() > hit.predicted_ttft_s.unwrap());
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
                    num_blocks: 3,
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
