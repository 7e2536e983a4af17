//! Choosing a worker by predicted time to first token.
//!
//! formula(worker)        = fixed + prefill_cost × (queued_prefill_tokens + uncached_prompt_tokens)
//!                          + attention_cost × (their attention pairs)
//!                          + running_cost × running_requests
//! predicted_ttft(worker) = relative_speed(worker) × formula(worker)
//!
//! - The coefficients are the pool's TTFT model ([`crate::calibration::PoolCalibration`]):
//!   learned online from its streamed answers, starting from the configured `scoring` (which
//!   has no fixed part), unless the pool sets `scoring.learnCoefficients: false`.
//! - Uncached tokens come from the prefix index: what the worker's KV cache already holds of
//!   this prompt. Each attends to the tokens before it, cached or not: `uncached × cached +
//!   uncached × (uncached + 1) / 2` pairs ([`PrefillWork`]), so a long prompt's cold prefill
//!   costs more per token than a short one's, and a held history saves more than its length.
//!   The queue's pairs per token are those of this proxy's pending prefills at the worker (the
//!   pool's average routed prefill's for others' requests, or when none is pending).
//! - Queued prefill is what this proxy has sent that has not produced a first token yet, less
//!   what the worker has done of it since it started on the oldest (prefill is first come, first
//!   served), plus the waiting requests of others (the worker's reported queue less this proxy's
//!   own, at the last scrape) times the pool's average prefill.
//! - Other gateway replicas' requests ([`crate::peers`], when configured) count like this
//!   proxy's, from the ledgers they push at each change: their pending prefill tokens are queued,
//!   their decoding requests running, and a scrape adds only what no replica explains.
//! - Running requests are this proxy's decoding ones plus others' as last scraped. This proxy's
//!   own requests therefore count at once, not a scrape interval late, and several gateway
//!   replicas still see each other's load.
//! - The relative speed is learned per worker from observed first tokens, relative to the
//!   pool's median worker ([`crate::calibration`]): a worker slower than the rest is predicted
//!   slower; an error all workers share cancels out. A pool with
//!   `scoring.learnWorkerSpeed: false` predicts every worker at 1.
//!
//! A worker whose KV cache cannot hold the request now would leave it waiting, or preempt a
//! running request to make room: it is chosen only when no healthy worker has room. The request
//! needs every block of its prompt that no request running there holds, and the output it may
//! generate: a block the worker caches but nobody runs is a free block to vLLM (evicted on
//! demand), taken out of the free ones by the request that hits it, so a conversation's own
//! history, cached and idle between its turns, makes no room; a system prompt its other
//! conversations are running there does. This proxy knows what its own requests hold
//! ([`crate::worker::WorkerState::held_prefix_blocks`]); others' are not known and count as
//! needed. The free blocks: the worker's size from `vllm:cache_config_info`, less others' use
//! from `kv_cache_usage_perc` at the last scrape and this proxy's reservations live.
//!
//! Staying on the cached worker is therefore only worth it until its own backlog outweighs the
//! prefill another worker would redo: cache affinity alone would hot-spot one worker. But while
//! every worker has a backlog, the prefill a copy adds delays the requests arriving after it
//! too: the choice's cost is then its TTFT plus its own prefill times the arrivals each worker
//! sees before the shortest backlog clears (see [`decide`]); with a worker idle, its TTFT alone.
//! A prefix whose traffic brings more of the pool's recent work than its holders' fair share of
//! the pool ([`crate::popularity`]: share × eligible workers > holders; a system prompt every
//! conversation opens with, held by one worker of three) is scored as held by the workers that
//! lack it: its copy's prefill is not charged. Otherwise each request, alone, finds the holder
//! faster than a cold copy, all of them stay, and every burst of that traffic queues on the
//! one holder while the others idle (the per-request oracle does the same). The copy's
//! prefill is real (the request's predicted TTFT keeps it): it is paid once, where the queue
//! is shorter, and spreads every later request. A conversation's own history is one stream's,
//! shared with nobody (its next turn follows the latest copy), and is charged as before.
//!
//! A choice also costs the traffic whose cached blocks it evicts. The blocks this proxy's
//! requests freed at a worker within the pool's reuse horizon (a conversation between its
//! turns, a prefix the next request shares; [`crate::kv::PoolKv::reuse_horizon`], measured from
//! how soon prompts come back for freed blocks) are free to vLLM but wanted: a request that
//! needs more than the worker's other free blocks evicts them (vLLM evicts the least recently
//! freed first), and whoever comes back for them prefills them again. The choice's cost adds
//! that prefill.
//!
//! A request that starts a stream, in a pool whose traffic is mostly streams (conversations,
//! agents; [`crate::popularity::PrefixPopularity::new_stream_blocks`]), decides where the
//! stream's later requests find their history, and so where its room must come from while its
//! prompts grow. It is placed among the workers whose room (free blocks less the wanted ones)
//! is within one of the pool's streams of the most, then by cost: a worker holding the shared
//! opening of every conversation would otherwise win each new one on its TTFT until its
//! conversations evict each other's histories.
//!
//! Workers within `tie_tolerance` of the best cost, or within the model's error spread of the
//! terms in which their prediction differs from the best's ([`near_tie`]), are tied, and the one
//! holding most of the prompt, then the one with fewest requests in flight, then the one this
//! proxy sent a request to longest ago (a random one of those never sent to) wins: load spreads
//! where the cache does not decide, and idle workers take turns.

use std::fmt::Write;

use rand::Rng;
use switchyard_kv::index::Overlap;

use crate::calibration::{Coefficients, PrefillWork, Speed, median_ratio};
use crate::prompt::PromptInfo;
use crate::routing::PoolRuntime;

/// One worker's numbers for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerScore {
    /// Position in `PoolRuntime::workers`.
    pub position: usize,
    pub matched_blocks: u32,
    pub cached_tokens: usize,
    pub uncached_tokens: usize,
    /// Uncached tokens of a prefix whose traffic brings more work than its holders' fair share:
    /// a copy here spreads that traffic, and the choice's cost does not charge their prefill
    /// ([`decide`]).
    pub replicated_tokens: usize,
    pub queued_tokens: usize,
    /// The attention pairs of those queued tokens ([`PrefillWork`]).
    pub queued_pairs: f64,
    pub running: u64,
    pub in_flight: usize,
    /// Requests the other replicas have in flight there, as they last reported them.
    pub peers_in_flight: u64,
    /// The number of this proxy's latest request to the worker (smaller: longer ago; 0: never).
    pub last_sent: u64,
    pub healthy: bool,
    /// KV blocks the request needs from the worker's free ones (prompt blocks no request of this
    /// proxy's there holds, and output), and the worker's free blocks (`None`: it does not
    /// report its cache size).
    pub kv_blocks_needed: u64,
    pub kv_blocks_free: Option<u64>,
    /// Free blocks not wanted by the traffic that freed them within the pool's reuse horizon:
    /// the room left for traffic to come (`None` where the free blocks are unknown).
    pub room_blocks: Option<u64>,
    /// Tokens of others' cached history the request's blocks would evict here: blocks this
    /// proxy's requests freed within the pool's reuse horizon, which the worker gives up once
    /// its other free blocks are taken ([`crate::kv::PoolKv::reuse_horizon`]).
    pub evicted_tokens: usize,
    /// The formula's prediction (pool coefficients), before the worker's learned speed.
    pub formula_ttft_s: f64,
    /// The worker's learned speed (observed over predicted TTFT).
    pub speed: Speed,
    /// That speed relative to the pool's median worker: predicted = relative × formula.
    pub relative_speed: f64,
    pub predicted_ttft_s: f64,
    /// What the choice costs: the predicted TTFT plus, while every worker has a backlog, the
    /// delay its own prefill adds for the requests that will arrive behind it ([`decide`]).
    pub cost_s: f64,
}

impl WorkerScore {
    /// The prefill predicted to be queued ahead of the request.
    pub fn queued(&self) -> PrefillWork {
        PrefillWork {
            tokens: self.queued_tokens as f64,
            pairs: self.queued_pairs,
        }
    }

    /// The request's own prefill: its uncached tokens after its cached ones.
    pub fn own_prefill(&self) -> PrefillWork {
        PrefillWork::after(self.cached_tokens, self.uncached_tokens)
    }

    /// The part of that prefill that copies a shared prefix (the first uncached tokens).
    fn copy_prefill(&self) -> PrefillWork {
        PrefillWork::after(self.cached_tokens, self.replicated_tokens)
    }
}

/// What decided a routing choice (for metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The chosen worker holds part of the prompt and no worker holds more.
    CacheHit,
    /// No worker holds any of the prompt.
    NoCache,
    /// A worker holding more of the prompt was passed over because its queue was longer.
    Spread,
    /// A worker holding more of the prompt was passed over to copy a prefix whose traffic
    /// brings more work than its holders' fair share.
    Replicate,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub chosen: usize,
    pub outcome: Outcome,
    pub prompt_tokens: usize,
    /// KV blocks of the request that no block hash names ([`unhashed_kv_blocks`]).
    pub unhashed_kv_blocks: u64,
    /// For a request that starts a stream in a pool of streams, the blocks the pool's streams
    /// take: it was placed among the workers that leave room for one.
    pub new_stream_blocks: Option<f64>,
    pub scores: Vec<WorkerScore>,
}

impl Decision {
    /// The numbers of the worker at `position`, if it was scored.
    pub fn score(&self, position: usize) -> Option<&WorkerScore> {
        self.scores.iter().find(|s| s.position == position)
    }

    /// The numbers of the chosen worker.
    pub fn chosen_score(&self) -> Option<&WorkerScore> {
        self.score(self.chosen)
    }

    /// A one-line explanation for the `x-switchyard-route` header and logs.
    pub fn explain(&self, pool: &PoolRuntime) -> String {
        let mut out = String::new();
        let address = |position: usize| {
            pool.workers
                .get(position)
                .map_or("?", |w| w.address.as_str())
        };
        let _ = write!(
            out,
            "policy=cache-aware; chosen={}; outcome={:?}; prompt_tokens={}",
            address(self.chosen),
            self.outcome,
            self.prompt_tokens
        );
        if let Some(blocks) = self.new_stream_blocks {
            let _ = write!(out, "; new_stream_blocks={blocks:.0}");
        }
        for score in &self.scores {
            let _ = write!(
                out,
                "; {} matched_blocks={} cached_tokens={} replicated_tokens={} queued_tokens={} running={} in_flight={} peers_in_flight={} healthy={} kv_blocks_needed={} kv_blocks_free={} kv_room_blocks={} evicted_tokens={} predicted_ttft_ms={:.1} cost_ms={:.1} formula_ttft_ms={:.1} relative_speed={:.2}",
                address(score.position),
                score.matched_blocks,
                score.cached_tokens,
                score.replicated_tokens,
                score.queued_tokens,
                score.running,
                score.in_flight,
                score.peers_in_flight,
                score.healthy,
                score.kv_blocks_needed,
                score
                    .kv_blocks_free
                    .map_or_else(|| "unknown".to_owned(), |free| free.to_string()),
                score
                    .room_blocks
                    .map_or_else(|| "unknown".to_owned(), |room| room.to_string()),
                score.evicted_tokens,
                score.predicted_ttft_s * 1000.0,
                score.cost_s * 1000.0,
                score.formula_ttft_s * 1000.0,
                score.relative_speed
            );
        }
        out
    }
}

/// Score the pool's workers for `prompt` (tokenized for this pool; `None`: routed by queue
/// alone) and up to `output_tokens` generated, against what the prefix index holds and what the
/// pool's workers are predicted to hold, and choose one.
pub fn decide_for_prompt(
    pool: &PoolRuntime,
    prompt: Option<&PromptInfo>,
    output_tokens: usize,
    exclude: &[usize],
) -> Option<Decision> {
    let (tokens, overlap) = match prompt {
        Some(prompt) => (prompt.tokens, pool.kv.overlap(&prompt.hashes)),
        None => (0, Overlap::default()),
    };
    let mut shares = Vec::new();
    if let Some(prompt) = prompt.filter(|_| pool.config.scoring.replicate_shared_prefixes) {
        let deepest = (overlap.deepest() as usize).min(prompt.hashes.len());
        let held = prompt.hashes.get(..deepest).unwrap_or_default();
        pool.kv.popularity.shares(held, &mut shares);
    }
    let hashes = prompt.map_or(&[][..], |prompt| prompt.hashes.as_slice());
    // A retry (some worker already tried) goes wherever it is answered soonest.
    let new_stream_blocks = prompt.filter(|_| exclude.is_empty()).and_then(|_| {
        pool.kv
            .popularity
            .new_stream_blocks(hashes, overlap.deepest() as usize)
    });
    let ask = Ask {
        prompt_tokens: tokens,
        hashes,
        output_tokens,
        overlap: &overlap,
        shares: &shares,
        new_stream_blocks,
    };
    decide(pool, &ask, exclude)
}

/// What one request asks of a pool, as the scorer sees it: its prompt and what the pool knows of
/// that prompt.
#[derive(Clone, Copy, Debug)]
pub struct Ask<'a> {
    /// Tokens of the prompt (0 where it is routed by queue alone).
    pub prompt_tokens: usize,
    /// Hashes of the prompt's full blocks.
    pub hashes: &'a [switchyard_kv::hash::SequenceHash],
    /// Tokens it may generate (its KV blocks are needed until it ends).
    pub output_tokens: usize,
    /// How many of the prompt's leading blocks each worker holds.
    pub overlap: &'a Overlap,
    /// The share of the pool's recent work that came with each of the prompt's leading
    /// prefixes, as deep as any worker holds it ([`crate::popularity`]).
    pub shares: &'a [f64],
    /// For a prompt that starts a stream in a pool of streams, the blocks the pool's streams
    /// take ([`crate::popularity`]).
    pub new_stream_blocks: Option<f64>,
}

/// The pool's TTFT model: learned from its answers (`scoring.learnCoefficients`, the default),
/// else as configured; the error its predictions share (a scale, `exp(bias)`: 1 when unknown)
/// and the error that differs between them (`None` before its first answer, or when it does
/// not learn).
pub fn model(pool: &PoolRuntime) -> (Coefficients, f64, Option<f64>) {
    let configured = Coefficients::configured(&pool.config.scoring);
    if pool.config.scoring.learn_coefficients {
        let fit = pool.kv.calibration.fit(configured);
        let scale = fit.bias.map_or(1.0, |bias| bias.clamp(-3.0, 3.0).exp());
        (fit.learned, scale, fit.spread)
    } else {
        (configured, 1.0, None)
    }
}

/// A choice's terms: fixed, prefill (queued and uncached tokens, less a copy of a shared
/// prefix) and running requests, each scaled by the worker's relative speed.
fn terms(score: &WorkerScore, model: &Coefficients) -> [f64; 3] {
    let speed = score.relative_speed;
    let prefill = score
        .queued()
        .plus(score.own_prefill())
        .less(score.copy_prefill());
    [
        speed * model.fixed_s,
        speed * model.prefill_s(prefill),
        speed * model.running_s_per_request * score.running as f64,
    ]
}

/// The model's error spread that near-ties use, at most: a model whose predictions are typically
/// this far off (ln 1.65) still orders two workers whose queues differ in prefill alone, and at
/// an error of 1 every worker would tie with the best (the sum of a prediction's term
/// differences is never less than the difference of the predictions), leaving cache affinity
/// alone to choose.
const MAX_TIE_ERROR: f64 = 0.5;

/// Whether `other` is as good as `best` for all the model can tell: its cost within `floor`
/// seconds of the best's, or within `error` (the model's error spread) of the terms in which
/// the two predictions differ.
fn near_tie(
    best: &WorkerScore,
    other: &WorkerScore,
    model: &Coefficients,
    error: f64,
    floor: f64,
) -> bool {
    let differing: f64 = terms(other, model)
        .iter()
        .zip(terms(best, model))
        .map(|(a, b)| (a - b).abs())
        .sum();
    other.cost_s <= best.cost_s + floor.max(error * differing)
}

/// Per leading block of the prompt (as deep as `shares` goes): whether the work that comes with
/// the prefix up to it is more than its holders among the eligible workers carry as their fair
/// share of the pool (share × eligible workers > holders).
fn replicable_blocks(
    scores: &[WorkerScore],
    eligible: &impl Fn(&&WorkerScore) -> bool,
    shares: &[f64],
    eligible_count: usize,
) -> Vec<bool> {
    shares
        .iter()
        .enumerate()
        .map(|(block, share)| {
            let holders = scores
                .iter()
                .filter(eligible)
                .filter(|s| s.matched_blocks as usize > block)
                .count();
            share * eligible_count as f64 > holders as f64
        })
        .collect()
}

/// The prefill of a choice's copy of a shared prefix, which its cost does not charge.
fn copy_credit_s(score: &WorkerScore, model: &Coefficients) -> f64 {
    score.relative_speed * model.prefill_s(score.copy_prefill())
}

/// Output tokens a request counts for in the KV cache at most (2^24: past every model's
/// context). A larger `max_tokens`, which the worker will refuse, counts as this bound, not as
/// an overflow of the ledger's reservations.
const MAX_OUTPUT_TOKENS: usize = 1 << 24;

/// KV blocks a request holds that no block hash names, wherever it runs: its prompt past the
/// `hashed` full blocks (the last partial block; a prompt tokenized only in part), and the
/// output it may generate.
pub fn unhashed_kv_blocks(
    prompt_tokens: usize,
    hashed: usize,
    output_tokens: usize,
    block_size: usize,
) -> u64 {
    let rest = prompt_tokens.saturating_sub(hashed.saturating_mul(block_size));
    rest.saturating_add(output_tokens.min(MAX_OUTPUT_TOKENS))
        .div_ceil(block_size.max(1)) as u64
}

/// Score every eligible worker (not in `exclude`, address resolved) and choose one for `ask`.
pub fn decide(pool: &PoolRuntime, ask: &Ask<'_>, exclude: &[usize]) -> Option<Decision> {
    let Ask {
        prompt_tokens,
        hashes,
        output_tokens,
        overlap,
        shares,
        new_stream_blocks,
    } = *ask;
    let scoring = pool.config.scoring;
    let (model, scale, error) = model(pool);
    let tolerance = f64::from(scoring.tie_tolerance_micros) / 1e6;
    let block_size = pool.kv.index.block_size();
    // Others' queued requests are as long as the pool's average prompt (this one's before any).
    let average_prefill = match pool.kv.prefill_tokens_average() {
        average if average > 0.0 => average,
        _ => prompt_tokens as f64,
    };
    // ... and as long in attention per token as the pool's average prefill (this one's,
    // cold, before any).
    let average_pairs_per_token = match pool.kv.prefill_pairs_per_token() {
        pairs if pairs > 0.0 => pairs,
        _ => PrefillWork::after(0, prompt_tokens).pairs_per_token(),
    };

    let speeds: Vec<Speed> = pool.workers.iter().map(|w| w.ttft.speed(&model)).collect();
    let median = if scoring.learn_worker_speed {
        median_ratio(&speeds)
    } else {
        None
    };
    let unstored_blocks = pool.kv.unstored_prefill_blocks();
    let reuse_horizon = pool.kv.reuse_horizon();
    let unhashed_blocks =
        unhashed_kv_blocks(prompt_tokens, hashes.len(), output_tokens, block_size);
    let mut scores = Vec::with_capacity(pool.workers.len());
    for (position, worker) in pool.workers.iter().enumerate() {
        if exclude.contains(&position) || worker.socket.is_none() {
            continue;
        }
        let slot = pool.slots.get(position);
        let matched_blocks = slot.map_or(0, |slot| overlap.depth(*slot));
        let cached_tokens = (matched_blocks as usize * block_size).min(prompt_tokens);
        let uncached_tokens = prompt_tokens - cached_tokens;
        // This proxy's requests count live; a scrape adds only what they do not explain.
        let load = &worker.load;
        let others_queue = (load.others_waiting() as f64 * average_prefill) as usize;
        // Prefill is first come, first served: what the worker did since it started on the
        // oldest of ours is no longer queued.
        let speed = speeds.get(position).copied().unwrap_or_default();
        let relative_speed = speed.relative_to(median);
        // ... and so has it on the other replicas' oldest (as they reported it, plus the time
        // since the read). The worker works off one queue: the longer of the two stretches
        // counts, but each only against its own side's tokens (a peer's long wait says nothing
        // of prompts this proxy sent a moment ago, nor ours of theirs).
        let peers = load.peers();
        // The worker's queue is as long in attention per token as this proxy's prefills
        // there, or without any, the pool's.
        let own_pending = worker.pending_prefill();
        let pairs_per_token = if own_pending.tokens > 0.0 {
            own_pending.pairs_per_token()
        } else {
            average_pairs_per_token
        };
        let token_cost = model.prefill_s(PrefillWork::at(1, pairs_per_token));
        // A prefill token takes the model's time times the scale all its predictions share
        // (while the model learns, it may be several times off in seconds and still order the
        // workers right).
        let done_in = |elapsed: std::time::Duration, tokens: usize| {
            if token_cost > 0.0 {
                let done = elapsed.as_secs_f64() / (token_cost * scale * relative_speed);
                (done as usize).min(tokens)
            } else {
                0
            }
        };
        let (own_tokens, peer_tokens) =
            (own_pending.tokens as usize, peers.prefill_tokens as usize);
        let peers_elapsed = std::time::Duration::from_micros(peers.prefill_elapsed_us);
        let done =
            done_in(worker.prefill_elapsed(), own_tokens).max(done_in(peers_elapsed, peer_tokens));
        // The elapsed time says how far the worker got if the model's cost per token is right;
        // its KV events say what it has not even scheduled yet (a long prompt it is still
        // chunking while the model, learned mostly from short ones, takes it for done).
        let unstored = slot
            .and_then(|slot| unstored_blocks.get(usize::from(slot.0)))
            .map_or(0, |blocks| (blocks * block_size).min(own_tokens));
        let queued_tokens = own_tokens
            .saturating_add(peer_tokens)
            .saturating_sub(done)
            .max(unstored)
            .saturating_add(others_queue);
        let queued = PrefillWork::at(queued_tokens.saturating_sub(others_queue), pairs_per_token)
            .plus(PrefillWork::at(others_queue, average_pairs_per_token));
        let own_prefill = PrefillWork::after(cached_tokens, uncached_tokens);
        let in_flight = worker.in_flight();
        let own_decoding = (in_flight as u64).saturating_sub(load.own_pending());
        let peers_decoding = peers.in_flight.saturating_sub(peers.prefills);
        let running = own_decoding
            .saturating_add(peers_decoding)
            .saturating_add(load.others_running());
        let formula_ttft_s = model.predict(queued.plus(own_prefill), running as f64);
        let predicted_ttft_s = relative_speed * formula_ttft_s;
        // The worker takes from its free blocks every block of the request that no running
        // request holds, cached or not: a cached block nobody runs is free (evicted on demand),
        // and a conversation's own history is cached and free between its turns. The blocks
        // this proxy's requests there hold are known; others' are not, and count as needed.
        let held = worker.held_prefix_blocks(hashes);
        let kv_blocks_needed = ((hashes.len() - held) as u64).saturating_add(unhashed_blocks);
        let kv_blocks_free = load.free_kv_blocks();
        // Blocks others' requests freed here a moment ago (a conversation between its turns, a
        // prefix the next request shares) are free but wanted: the worker evicts them once
        // the request has taken its other free blocks, and whoever comes back for them
        // prefills them again.
        let wanted =
            reuse_horizon.map_or(0, |horizon| worker.recently_freed_blocks(hashes, horizon));
        let evicted_blocks = kv_blocks_free.map_or(0, |free| {
            kv_blocks_needed
                .saturating_add(wanted)
                .saturating_sub(free)
                .min(wanted)
        });
        let evicted_tokens = (evicted_blocks as usize).saturating_mul(block_size);
        let room_blocks = kv_blocks_free.map(|free| free.saturating_sub(wanted));
        scores.push(WorkerScore {
            position,
            matched_blocks,
            cached_tokens,
            uncached_tokens,
            replicated_tokens: 0,
            queued_tokens,
            queued_pairs: queued.pairs,
            running,
            in_flight,
            peers_in_flight: peers.in_flight,
            last_sent: worker.last_sent(),
            healthy: load.healthy(),
            kv_blocks_needed,
            kv_blocks_free,
            room_blocks,
            evicted_tokens,
            formula_ttft_s,
            speed,
            relative_speed,
            predicted_ttft_s,
            cost_s: predicted_ttft_s,
        });
    }
    // Healthy workers with room for the request; else healthy ones; else any.
    let fits = |s: &WorkerScore| {
        s.kv_blocks_free
            .is_none_or(|free| s.kv_blocks_needed <= free)
    };
    let any_healthy = scores.iter().any(|s| s.healthy);
    let any_room = scores.iter().any(|s| s.healthy && fits(s));
    let usable = |s: &&WorkerScore| {
        if any_room {
            s.healthy && fits(s)
        } else {
            s.healthy || !any_healthy
        }
    };
    // A request that starts a stream (in a pool whose traffic is mostly streams: conversations,
    // agents) brings it back to the worker it lands on turn after turn, its prompts growing to
    // the pool's streams' size, and a stream moved later prefills its whole history again. So
    // it starts where it leaves room: at a worker whose room (free blocks not wanted by the
    // traffic that freed them) is within one stream of the most. A worker that holds the
    // prompt's shared opening but is filling up with streams would win it on its TTFT alone,
    // and then every stream there would thrash its cache for want of room. Workers that do not
    // report their cache size are not compared.
    let most_room = new_stream_blocks.and_then(|_| {
        scores
            .iter()
            .filter(usable)
            .filter_map(|s| s.room_blocks)
            .max()
    });
    let leaves_room = |s: &&WorkerScore| match (new_stream_blocks, most_room, s.room_blocks) {
        (Some(stream), Some(most), Some(room)) => room as f64 + stream >= most as f64,
        _ => true,
    };
    let eligible = |s: &&WorkerScore| usable(s) && leaves_room(s);
    // While every eligible worker has prefill queued, the fleet is behind: a prefill added now
    // delays the requests that arrive before the shortest backlog clears, wherever they go, so
    // a choice is charged its own prefill times the arrivals each worker will see in that
    // time. A hit saves the fleet work; a copy of a prefix to a shorter queue spends it. With
    // any worker idle the charge is zero and the choice is the request's own TTFT.
    let backlog_s = scores
        .iter()
        .filter(eligible)
        .map(|s| s.relative_speed * model.prefill_s(s.queued()))
        .fold(f64::INFINITY, f64::min);
    let eligible_count = scores.iter().filter(eligible).count().max(1);
    let behind = if backlog_s.is_finite() {
        pool.kv.arrival_rate() * backlog_s * scale / eligible_count as f64
    } else {
        0.0
    };
    // A prefix whose traffic brings more work than its holders' fair share of the pool
    // (share × eligible workers > holders) keeps its traffic on too few workers: whatever their
    // queues now, the next burst of it queues there while other workers idle, and every request
    // sees the same choice (stay with the holder, or pay the whole prefix's prefill elsewhere)
    // until one pays it. So a worker lacking such blocks is scored as if it held them: the
    // copy's prefill is paid once, by this request, and spreads all later ones. Prefixes held
    // as widely as their traffic, and a conversation's own history (one stream's, shared with
    // nobody), are charged as before.
    let replicated = replicable_blocks(&scores, &eligible, shares, eligible_count);
    for score in &mut scores {
        let missing = replicated
            .iter()
            .skip(score.matched_blocks as usize)
            .filter(|under| **under)
            .count();
        score.replicated_tokens = (missing * block_size).min(score.uncached_tokens);
        let evicted = PrefillWork::at(score.evicted_tokens, average_pairs_per_token);
        score.cost_s = score.predicted_ttft_s - copy_credit_s(score, &model)
            + behind * score.relative_speed * model.prefill_s(score.own_prefill())
            + score.relative_speed * model.prefill_s(evicted);
    }
    let best = scores
        .iter()
        .filter(eligible)
        .min_by(|a, b| a.cost_s.total_cmp(&b.cost_s))?;
    // Near-ties: within the configured tolerance, or within what the model's error spread
    // could make of the terms in which the two predictions differ (a worker with a
    // longer queue but fewer running requests than the best is only as far behind as the
    // model's prefill/running balance is right; two queues that differ in tokens alone are
    // ordered by them whatever the coefficients).
    let error = error.unwrap_or(0.0).min(MAX_TIE_ERROR);
    let tied: Vec<&WorkerScore> = scores
        .iter()
        .filter(eligible)
        .filter(|s| near_tie(best, s, &model, error, tolerance))
        .collect();
    // Among near-ties, the worker holding more of the prompt keeps it (its cache then serves the
    // next request too); with equal holdings, the one with fewest requests in flight (this
    // proxy's and, behind several replicas, the others' as they last reported them: one proxy
    // would see them all); then the one this proxy sent a request to longest ago. On prompts no
    // worker holds, idle workers tie at every arrival: a random pick would hand each worker a
    // Poisson share of them, two prefills landing on one worker's next step by chance while
    // another has none, where taking turns spaces each worker's arrivals as round-robin does
    // (which beat a random pick at p90 by 10% on short unique prompts at 12 requests/s; see the
    // README).
    let rank = |s: &WorkerScore| {
        (
            std::cmp::Reverse(s.matched_blocks),
            (s.in_flight as u64).saturating_add(s.peers_in_flight),
            s.last_sent,
        )
    };
    let first = tied.iter().map(|s| rank(s)).min()?;
    let firsts: Vec<&&WorkerScore> = tied.iter().filter(|s| rank(s) == first).collect();
    let pick = rand::rng().random_range(0..firsts.len().max(1));
    let chosen = firsts.get(pick).map(|s| (s.position, s.matched_blocks))?;
    let most_matched = scores
        .iter()
        .filter(usable)
        .map(|s| s.matched_blocks)
        .max()
        .unwrap_or(0);
    // A copy only when the credit decided it: charged in full, the chosen worker would have
    // cost more than a worker holding the most.
    let best_holder = scores
        .iter()
        .filter(eligible)
        .filter(|s| s.matched_blocks == most_matched)
        .map(|s| s.cost_s)
        .fold(f64::INFINITY, f64::min);
    let copies = scores.iter().any(|s| {
        s.position == chosen.0
            && s.replicated_tokens > 0
            && s.cost_s + copy_credit_s(s, &model) > best_holder
    });
    let outcome = if most_matched > chosen.1 && copies {
        Outcome::Replicate
    } else if most_matched > chosen.1 {
        Outcome::Spread
    } else if chosen.1 > 0 {
        Outcome::CacheHit
    } else {
        Outcome::NoCache
    };
    Some(Decision {
        chosen: chosen.0,
        outcome,
        prompt_tokens,
        unhashed_kv_blocks: unhashed_blocks,
        new_stream_blocks,
        scores,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use switchyard_kv::events::{BlockStored, ExternalBlockHash, KvEvent};
    use switchyard_kv::hash::sequence_hashes;
    use switchyard_kv::index::WorkerId;

    use super::*;
    use crate::kv::KvRegistry;
    use crate::routing::{EndpointRegistry, PendingPrefill, RoutingTable};

    fn table() -> RoutingTable {
        table_with("")
    }

    /// A pool of three workers, with `extra` added to its spec.
    fn table_with(extra: &str) -> RoutingTable {
        let yaml = format!(
            "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: p}}\n\
             spec: {{model: m, blockSize: 4, endpoints: [\"127.0.0.1:1\", \"127.0.0.1:2\", \"127.0.0.1:3\"]{extra}}}\n"
        );
        let snapshot = switchyard_snapshot::load_str("test", &yaml).unwrap();
        RoutingTable::build(
            Arc::new(snapshot),
            &EndpointRegistry::default(),
            &KvRegistry::default(),
        )
        .unwrap()
    }

    fn store(pool: &PoolRuntime, position: usize, tokens: &[u32]) {
        let hashes: Vec<ExternalBlockHash> = (0..tokens.len() / 4)
            .map(|i| ExternalBlockHash(1000 * position as u64 + i as u64))
            .collect();
        pool.kv.index.apply(
            pool.slots[position],
            &KvEvent::BlockStored(BlockStored {
                block_hashes: hashes,
                token_ids: tokens.to_vec(),
                block_size: 4,
                ..Default::default()
            }),
        );
    }

    fn overlap(pool: &PoolRuntime, tokens: &[u32]) -> Overlap {
        let mut out = Overlap::default();
        pool.kv
            .index
            .overlap_into(&sequence_hashes(tokens, 4), pool.kv.slot_count(), &mut out);
        out
    }

    /// A prompt of `prompt_tokens` that `overlap` finds, without hashes, output, shares or a
    /// stream to start.
    fn ask(prompt_tokens: usize, overlap: &Overlap) -> Ask<'_> {
        Ask {
            prompt_tokens,
            hashes: &[],
            output_tokens: 0,
            overlap,
            shares: &[],
            new_stream_blocks: None,
        }
    }

    #[test]
    fn the_cached_worker_wins_until_its_backlog_outweighs_the_saved_prefill() {
        let table = table();
        let pool = table.pools().next().unwrap();
        let prompt: Vec<u32> = (0..400).collect();
        store(pool, 1, &prompt[..396]);
        let lookup = overlap(pool, &prompt);
        assert_eq!(lookup.depth(WorkerId(pool.slots[1].0)), 99);

        let first = decide(pool, &ask(400, &lookup), &[]).unwrap();
        assert_eq!(first.chosen, 1);
        assert_eq!(first.outcome, Outcome::CacheHit);
        assert_eq!(first.scores[1].uncached_tokens, 4);

        // Pile prefill work onto the cached worker: it stays best while its backlog is smaller
        // than the 396 tokens the others would have to prefill...
        let _some = PendingPrefill::start(&pool.workers[1], PrefillWork::after(0, 300));
        assert_eq!(decide(pool, &ask(400, &lookup), &[]).unwrap().chosen, 1);
        // ...and loses once the backlog is larger (no hot spot).
        let _more = PendingPrefill::start(&pool.workers[1], PrefillWork::after(0, 200));
        let spread = decide(pool, &ask(400, &lookup), &[]).unwrap();
        assert_ne!(spread.chosen, 1);
        assert_eq!(spread.outcome, Outcome::Spread);
        assert!(spread.explain(pool).contains("matched_blocks=99"));
    }

    /// A long prompt's cold prefill costs more per token than a short one's: each token attends
    /// to all before it. A worker holding most of a 20,000-token prompt behind 18,000 tokens of
    /// short prompts is faster than an idle cold one (7.4 s against 7.8 s at the default
    /// attention), though a model linear in tokens says otherwise (6.6 s against 6.0 s).
    #[test]
    fn a_long_cold_prefill_pays_for_its_attention() {
        for (extra, holder_wins) in [
            ("", true),
            (", scoring: {attentionContextTokens: 0}", false),
        ] {
            let table = table_with(extra);
            let pool = table.pools().next().unwrap();
            let prompt: Vec<u32> = (0..20_000).collect();
            store(pool, 1, &prompt[..16_000]);
            let _queue: Vec<PendingPrefill> = (0..10)
                .map(|_| PendingPrefill::start(&pool.workers[1], PrefillWork::after(0, 1_800)))
                .collect();
            let _busy = PendingPrefill::start(&pool.workers[2], PrefillWork::after(0, 30_000));
            let decision = decide(pool, &ask(20_000, &overlap(pool, &prompt)), &[]).unwrap();
            let (holder, cold) = (&decision.scores[1], &decision.scores[0]);
            assert_eq!((holder.cached_tokens, cold.cached_tokens), (16_000, 0));
            assert_eq!(
                decision.chosen == 1,
                holder_wins,
                "{extra}: {:?}",
                decision.scores
            );
            let predicted = |score: &WorkerScore| score.predicted_ttft_s;
            let expected = if holder_wins { (7.4, 7.8) } else { (6.6, 6.0) };
            assert!(
                (predicted(holder) - expected.0).abs() < 0.05
                    && (predicted(cold) - expected.1).abs() < 0.05,
                "{extra}: {:?}",
                decision.scores
            );
        }
    }

    /// Idle workers tie on a prompt nobody holds: they take turns, each seeing every third
    /// request as under round-robin, not a random share of them.
    #[test]
    fn idle_workers_tied_on_an_unheld_prompt_take_turns() {
        use crate::routing::InFlight;
        let table = table();
        let pool = table.pools().next().unwrap();
        let lookup = overlap(pool, &[1, 2, 3, 4]);
        let chosen: Vec<usize> = (0..12)
            .map(|_| {
                let decision = decide(pool, &ask(4, &lookup), &[]).unwrap();
                assert_eq!(decision.outcome, Outcome::NoCache);
                // Sent and answered at once: the workers stay idle, only the turn moves on.
                drop(InFlight::start(&pool.workers[decision.chosen]));
                decision.chosen
            })
            .collect();
        let mut first_round = chosen[..3].to_vec();
        first_round.sort_unstable();
        assert_eq!(first_round, [0, 1, 2], "{chosen:?}");
        for (i, worker) in chosen.iter().enumerate().skip(3) {
            assert_eq!(*worker, chosen[i - 3], "{chosen:?}");
        }
        // A worker with a request in flight is passed over whatever its turn.
        let next = chosen[0];
        let _busy = InFlight::start(&pool.workers[next]);
        assert_ne!(decide(pool, &ask(4, &lookup), &[]).unwrap().chosen, next);
    }

    /// Behind several replicas, a request another replica has in flight counts in the
    /// tie-break as one of this proxy's would: one proxy in front of the fleet would see both.
    #[test]
    fn near_ties_count_the_other_replicas_requests_in_flight() {
        let table = table();
        let pool = table.pools().next().unwrap();
        let lookup = overlap(pool, &[1, 2, 3, 4]);
        // Another replica decodes one request on workers 0 and 2: half a millisecond more
        // each, well within the tie tolerance.
        for position in [0, 2] {
            pool.workers[position]
                .load
                .set_peers(crate::peers::PeerLedger {
                    in_flight: 1,
                    ..Default::default()
                });
        }
        for _ in 0..20 {
            let decision = decide(pool, &ask(4, &lookup), &[]).unwrap();
            assert_eq!(decision.chosen, 1);
            assert_eq!(decision.scores[0].running, 1);
            assert_eq!(decision.scores[0].peers_in_flight, 1);
            assert_eq!(decision.scores[0].in_flight, 0);
        }
        // Excluded, worker 1 leaves two tied workers alike in flight: either may be chosen.
        let mut seen = [0; 3];
        for _ in 0..60 {
            seen[decide(pool, &ask(4, &lookup), &[1]).unwrap().chosen] += 1;
        }
        assert!(seen[0] > 0 && seen[2] > 0, "{seen:?}");
    }

    #[test]
    fn own_requests_count_at_once_and_a_scrape_adds_only_others() {
        use crate::routing::InFlight;
        let table = table();
        let pool = table.pools().next().unwrap();
        let lookup = overlap(pool, &[1, 2, 3, 4]);
        // Worker 0 decodes two of ours, worker 1 prefills one of ours: no scrape needed.
        let _a = InFlight::start(&pool.workers[0]);
        let _b = InFlight::start(&pool.workers[0]);
        let _c = InFlight::start(&pool.workers[1]);
        let _c_prefill = PendingPrefill::start(&pool.workers[1], PrefillWork::after(0, 500));
        let decision = decide(pool, &ask(4, &lookup), &[]).unwrap();
        assert_eq!(
            (decision.scores[0].running, decision.scores[0].queued_tokens),
            (2, 0)
        );
        assert_eq!(
            (decision.scores[1].running, decision.scores[1].queued_tokens),
            (0, 500)
        );
        assert_eq!(decision.chosen, 2);
        // Worker 2 reports requests this proxy did not send (another replica's): they count.
        pool.workers[2].load.update_from_metrics(
            "vllm:num_requests_waiting 4\nvllm:num_requests_running 6\n",
            10,
        );
        let decision = decide(pool, &ask(4, &lookup), &[]).unwrap();
        assert_eq!(decision.scores[2].running, 6);
        assert!(decision.scores[2].queued_tokens > 0);
        // Another replica's one request, prefilling `tokens` for `elapsed_us` when read.
        let prefilling = |prefill_tokens, prefill_elapsed_us| crate::peers::PeerLedger {
            prefills: 1,
            prefill_tokens,
            in_flight: 1,
            prefill_elapsed_us,
            ..Default::default()
        };
        // Another replica prefills 3,000 tokens on worker 1 and decodes one request on worker 0:
        // counted like ours.
        pool.workers[1].load.set_peers(prefilling(3000, 0));
        pool.workers[0].load.set_peers(crate::peers::PeerLedger {
            in_flight: 1,
            ..Default::default()
        });
        let decision = decide(pool, &ask(4, &lookup), &[]).unwrap();
        // (Less what the worker did since the ledger was read: a token per 300 µs.)
        let queued = decision.scores[1].queued_tokens;
        assert!((3400..=3500).contains(&queued), "{queued}");
        // The replica had been on it for 0.3 s when it was read: about 1,000 tokens are done
        // (300 µs a token, and its attention: 2 µs more for the 250 tokens before it, on
        // average, in the worker's queue of our 500).
        pool.workers[1].load.set_peers(prefilling(3000, 300_000));
        let queued = decide(pool, &ask(4, &lookup), &[]).unwrap().scores[1].queued_tokens;
        assert!((2400..=2520).contains(&queued), "{queued}");
        // A peer's long wait (10 s: 33,000 tokens' time) counts only against its own 1,000:
        // a prompt this proxy has just sent there stays queued.
        pool.workers[1].load.set_peers(prefilling(1000, 10_000_000));
        let before = decide(pool, &ask(4, &lookup), &[]).unwrap().scores[1].queued_tokens;
        let _ours = PendingPrefill::start(&pool.workers[1], PrefillWork::after(0, 3000));
        let queued = decide(pool, &ask(4, &lookup), &[]).unwrap().scores[1].queued_tokens;
        assert!(queued >= before + 2900, "{before} then {queued}");
        assert_eq!(decision.scores[0].running, 3);
        pool.workers[0].load.set_peers(Default::default());
        // Worker 0 reports only ours: nothing is counted twice.
        pool.workers[0]
            .load
            .update_from_metrics("vllm:num_requests_running 2\n", 10);
        assert_eq!(
            decide(pool, &ask(4, &lookup), &[]).unwrap().scores[0].running,
            2
        );
    }

    #[test]
    fn what_the_workers_events_have_not_stored_stays_queued_whatever_the_time_says() {
        use std::sync::atomic::Ordering;
        // A model that takes a token for a microsecond's work.
        let table = table_with(", scoring: {prefillMicrosPerToken: 1}");
        let pool = table.pools().next().unwrap();
        let lookup = overlap(pool, &[1, 2, 3, 4]);
        let prompt = |tokens: &[u32]| {
            Arc::new(crate::prompt::PromptInfo {
                tokens: tokens.len(),
                hashes: sequence_hashes(tokens, 4),
                unfinished: None,
            })
        };
        // Worker 1 is sent a cold prompt of 4,000 tokens (1,000 blocks of 4) and one of 2,000
        // whose hashes its events will never match (a template the gateway cannot reproduce),
        // and has been on them for 20 ms: by the model's cost the time says both are done.
        let long: Vec<u32> = (10_000..14_000).collect();
        let unmatched: Vec<u32> = (20_000..22_000).collect();
        let _pending = PendingPrefill::start(&pool.workers[1], PrefillWork::after(0, long.len()));
        let _other =
            PendingPrefill::start(&pool.workers[1], PrefillWork::after(0, unmatched.len()));
        let prediction = pool.kv.predictions.add(pool.slots[1], prompt(&long), 0);
        let _never = pool
            .kv
            .predictions
            .add(pool.slots[1], prompt(&unmatched), 0);
        // Worker 0, a prompt of 200 tokens, of which 100 are pending there.
        let short: Vec<u32> = (30_000..30_200).collect();
        let _short = PendingPrefill::start(&pool.workers[0], PrefillWork::after(0, 100));
        let _short_prediction = pool.kv.predictions.add(pool.slots[0], prompt(&short), 0);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let queued = |pool: &PoolRuntime, position: usize| {
            decide(pool, &ask(4, &lookup), &[]).unwrap().scores[position].queued_tokens
        };
        assert_eq!((queued(pool, 0), queued(pool, 1)), (0, 0));
        // Its KV events have stored the first 100 blocks of the long one (vLLM stores a block
        // when it schedules it): 900 are still to come.
        store(pool, 1, &long[..400]);
        assert_eq!(
            queued(pool, 1),
            0,
            "a silent event stream: the time decides"
        );
        // A batch has just come: the stream is live.
        pool.kv.stream_stats(pool.slots[1]).batch_applied();
        assert_eq!(
            queued(pool, 1),
            3_600,
            "the unmatched prompt is not counted"
        );
        store(pool, 1, &long[..3_000]);
        assert_eq!(queued(pool, 1), 1_000);
        // Worker 0 is not charged for them; its own prompt, of which its events have stored 10
        // of 50 blocks, counts as far as it is pending here (100 tokens).
        assert_eq!(queued(pool, 0), 0, "worker 0's stream is silent");
        store(pool, 0, &short[..40]);
        pool.kv.stream_stats(pool.slots[0]).batch_applied();
        assert_eq!(queued(pool, 0), 100);
        assert_eq!(queued(pool, 1), 1_000);
        // Past its first token the prompt is no longer waited for, stored or not.
        prediction.prefilled(true);
        assert_eq!(queued(pool, 1), 0);
        // Worker 0's entries were dropped (a gap its replay could not fill): what its events
        // said of the prompt before no longer counts.
        let stream = pool.kv.stream_stats(pool.slots[0]);
        stream.gaps_cleared.fetch_add(1, Ordering::Relaxed);
        assert_eq!(queued(pool, 0), 0);
    }

    #[test]
    fn a_worker_learned_to_be_slow_gets_less_of_the_work() {
        // Learned by default.
        let table = table();
        let pool = table.pools().next().unwrap();
        let lookup = overlap(pool, &[1, 2, 3, 4]);
        // Cold prompts of 1,000 tokens and more, nothing queued ahead.
        let (model, _, _) = model(pool);
        let answer = |i: u32, slower: f64| {
            let tokens = 1_000 + 20 * i as usize;
            let own_prefill = PrefillWork::after(0, tokens);
            let predicted_s = model.predict(own_prefill, 0.0);
            crate::calibration::SpeedAnswer {
                predicted_s,
                queued_tokens: 0,
                own_prefill,
                running: 0,
                observed_s: slower * predicted_s,
            }
        };
        // Worker 0 turned out 1.5x slower than the others on its recent first tokens.
        for i in 0..60 {
            pool.workers[0].ttft.observe(answer(i, 1.5), &model);
            pool.workers[1].ttft.observe(answer(i, 1.0), &model);
            pool.workers[2].ttft.observe(answer(i, 1.0), &model);
        }
        // Both other workers have one prompt of ours queued; worker 0 a shorter one, which is
        // still slower there.
        let _a = PendingPrefill::start(&pool.workers[0], PrefillWork::after(0, 1_200));
        let _b = PendingPrefill::start(&pool.workers[1], PrefillWork::after(0, 1_500));
        let _c = PendingPrefill::start(&pool.workers[2], PrefillWork::after(0, 1_500));
        let decision = decide(pool, &ask(4, &lookup), &[]).unwrap();
        assert_ne!(decision.chosen, 0, "{:?}", decision.scores);
        let slow = &decision.scores[0];
        assert!((slow.relative_speed - 1.5).abs() < 0.05, "{slow:?}");
        assert!(slow.predicted_ttft_s > slow.formula_ttft_s);
        assert!(decision.explain(pool).contains("relative_speed=1.50"));

        // With the pool setting off the speed is observed (explain shows it) but not used.
        let plain = table_with(", scoring: {learnWorkerSpeed: false}");
        let pool = plain.pools().next().unwrap();
        for i in 0..10 {
            pool.workers[0].ttft.observe(answer(i, 1.5), &model);
            pool.workers[1].ttft.observe(answer(i, 1.0), &model);
        }
        let decision = decide(pool, &ask(4, &lookup), &[]).unwrap();
        assert_eq!(decision.scores[0].relative_speed, 1.0);
        assert!(decision.scores[0].speed.known());
    }

    #[test]
    fn predictions_use_the_learned_coefficients_unless_the_pool_keeps_its_own() {
        use crate::calibration::{Coefficients, Observation};
        let teach = |pool: &PoolRuntime| {
            let configured = Coefficients::configured(&pool.config.scoring);
            // The workers prefill twice as fast as configured (150 µs a token, not 300).
            for i in 0..200 {
                let prefill = PrefillWork::after(0, (i % 40) * 100);
                pool.kv.calibration.observe(
                    configured,
                    &Observation {
                        prefill,
                        running: 0.0,
                        ttft_s: configured.predict(prefill, 0.0) / 2.0,
                    },
                );
            }
        };
        let prompt: Vec<u32> = (0..2000).collect();
        for (extra, expected) in [("", 0.5), (", scoring: {learnCoefficients: false}", 1.0)] {
            let table = table_with(extra);
            let pool = table.pools().next().unwrap();
            teach(pool);
            let configured = Coefficients::configured(&pool.config.scoring);
            let decision = decide(pool, &ask(2000, &overlap(pool, &prompt)), &[]).unwrap();
            let ratio = decision.scores[0].formula_ttft_s
                / configured.predict(PrefillWork::after(0, 2000), 0.0);
            assert!(
                (ratio / expected - 1.0).abs() < 0.1,
                "{extra}: {ratio} of the configured model"
            );
        }
    }

    #[test]
    fn near_ties_widen_with_the_model_error_only_where_the_terms_disagree() {
        let model = Coefficients {
            fixed_s: 0.0,
            prefill_s_per_token: 300e-6,
            attention_s_per_pair: 0.0,
            running_s_per_request: 500e-6,
        };
        let score = |queued_tokens: usize, running: u64| {
            let formula = model.predict(PrefillWork::at(queued_tokens, 0.0), running as f64);
            WorkerScore {
                position: 0,
                matched_blocks: 0,
                cached_tokens: 0,
                uncached_tokens: 0,
                replicated_tokens: 0,
                queued_tokens,
                queued_pairs: 0.0,
                running,
                in_flight: 0,
                peers_in_flight: 0,
                last_sent: 0,
                healthy: true,
                kv_blocks_needed: 0,
                kv_blocks_free: None,
                room_blocks: None,
                evicted_tokens: 0,
                formula_ttft_s: formula,
                speed: Speed::default(),
                relative_speed: 1.0,
                predicted_ttft_s: formula,
                cost_s: formula,
            }
        };
        let best = score(1000, 0);
        // 20 ms behind on the balance of prefill (-300 ms) against running (+320 ms): tied at
        // a 10% error (62 ms of slack), not at none (the 5 ms floor).
        let balanced = score(0, 640);
        assert!(near_tie(&best, &balanced, &model, 0.1, 0.005));
        assert!(!near_tie(&best, &balanced, &model, 0.0, 0.005));
        // 30 ms behind on prefill alone: the coefficients cannot reorder a longer queue, so
        // even a 50% error leaves it 15 ms short.
        let longer = score(1100, 0);
        assert!(!near_tie(&best, &longer, &model, 0.5, 0.005));
        assert!(near_tie(&best, &longer, &model, 0.5, 0.031));
    }

    #[test]
    fn the_holder_keeps_a_prompt_when_the_model_cannot_tell_it_from_a_cold_worker() {
        use crate::calibration::Observation;
        let table = table();
        let pool = table.pools().next().unwrap();
        // A 1,000-token prompt. Worker 1 holds it and runs 640 requests; worker 0 holds none of
        // it and runs none (predicted some 20 ms better); worker 2 holds 600 tokens of it and
        // runs 640 (120 ms worse than worker 1).
        let prompt: Vec<u32> = (0..1000).collect();
        store(pool, 1, &prompt[..996]);
        store(pool, 2, &prompt[..600]);
        let lookup = overlap(pool, &prompt);
        for position in [1, 2] {
            pool.workers[position].load.update_from_metrics(
                "vllm:num_requests_waiting 0\nvllm:num_requests_running 640\n",
                10,
            );
        }
        let chosen = |pool: &PoolRuntime| {
            let mut counts = [0usize; 3];
            for _ in 0..50 {
                counts[decide(pool, &ask(1000, &lookup), &[]).unwrap().chosen] += 1;
            }
            counts
        };
        // A model that has not answered yet has no error: the best prediction wins.
        assert_eq!(chosen(pool), [50, 0, 0]);
        // Answers 15% either side of the configured model: a typical error of about 0.15, so
        // worker 1's 20 ms are within what the model can tell, and its cache keeps the prompt.
        let configured = Coefficients::configured(&pool.config.scoring);
        for i in 0..400 {
            let prefill = PrefillWork::after(0, (i % 40) * 100);
            let running = (i % 7) as f64 * 100.0;
            let noise = if i % 2 == 0 { 1.15 } else { 0.85 };
            pool.kv.calibration.observe(
                configured,
                &Observation {
                    prefill,
                    running,
                    ttft_s: configured.predict(prefill, running) * noise,
                },
            );
        }
        let error = pool.kv.calibration.fit(configured).error.unwrap();
        assert!((0.1..0.25).contains(&error), "{error}");
        let decision = decide(pool, &ask(1000, &lookup), &[]).unwrap();
        let behind = |position: usize| {
            decision.scores[position].predicted_ttft_s - decision.scores[0].predicted_ttft_s
        };
        assert!(
            behind(1) > 0.005 && behind(2) > 0.1,
            "{:?}",
            decision.scores
        );
        assert_eq!(chosen(pool), [0, 50, 0]);
    }

    #[test]
    fn a_model_off_by_a_shared_scale_converts_seconds_at_that_scale() {
        use crate::calibration::Observation;
        let table = table();
        let pool = table.pools().next().unwrap();
        assert_eq!(model(pool).1, 1.0);
        // The workers answer four times faster than configured, every time.
        let configured = Coefficients::configured(&pool.config.scoring);
        for i in 0..5 {
            let prefill = PrefillWork::after(0, 1000 + i * 500);
            pool.kv.calibration.observe(
                configured,
                &Observation {
                    prefill,
                    running: 0.0,
                    ttft_s: configured.predict(prefill, 0.0) / 4.0,
                },
            );
        }
        // Its seconds are the worker's once scaled: what the model learned from the first answers
        // is not corrected a second time by the scale.
        let (learned, scale, spread) = model(pool);
        assert!(learned.prefill_s_per_token < 0.6 * configured.prefill_s_per_token);
        for tokens in [1000, 4000] {
            let prefill = PrefillWork::after(0, tokens);
            let off =
                learned.predict(prefill, 0.0) * scale / (configured.predict(prefill, 0.0) / 4.0);
            assert!(off > 0.8 && off < 1.25, "{tokens}: {off}, scale {scale}");
        }
        assert!(spread.is_some());
        // A pool that keeps its coefficients keeps its scale too.
        let fixed = table_with(", scoring: {learnCoefficients: false}");
        let fixed = fixed.pools().next().unwrap();
        assert_eq!(model(fixed), (configured, 1.0, None));
    }

    #[test]
    fn a_fleet_that_is_behind_keeps_prompts_where_they_are_cached() {
        let table = table();
        let pool = table.pools().next().unwrap();
        // A 1,000-token prompt that worker 1 holds. Every worker has prefill queued: worker 1
        // 3,000 tokens, worker 0 1,500 (so the request's own TTFT is some 150 ms better there,
        // copying the prompt), worker 2 2,500.
        let prompt: Vec<u32> = (0..1000).collect();
        store(pool, 1, &prompt[..996]);
        let lookup = overlap(pool, &prompt);
        let _holder = PendingPrefill::start(&pool.workers[1], PrefillWork::after(0, 3000));
        let _shorter = PendingPrefill::start(&pool.workers[0], PrefillWork::after(0, 1500));
        let longer = PendingPrefill::start(&pool.workers[2], PrefillWork::after(0, 2500));
        // Nothing has arrived yet: no charge, the request's own TTFT decides.
        let alone = decide(pool, &ask(1000, &lookup), &[]).unwrap();
        assert_eq!(alone.chosen, 0, "{:?}", alone.scores);
        assert!(alone.scores.iter().all(|s| s.cost_s == s.predicted_ttft_s));
        // Requests arriving fast: copying 1,000 tokens delays every one of them that comes
        // before the shortest backlog clears, so the holder keeps the prompt.
        for _ in 0..20 {
            pool.kv.record_arrival();
        }
        assert!(pool.kv.arrival_rate() > 100.0);
        let behind = decide(pool, &ask(1000, &lookup), &[]).unwrap();
        assert_eq!(behind.chosen, 1, "{:?}", behind.scores);
        assert_eq!(behind.outcome, Outcome::CacheHit);
        assert!(behind.scores[0].cost_s > behind.scores[0].predicted_ttft_s);
        // With one worker idle the fleet is not behind: copying to it costs nobody a wait.
        drop(longer);
        let idle = decide(pool, &ask(1000, &lookup), &[]).unwrap();
        assert_eq!(idle.chosen, 2, "{:?}", idle.scores);
        assert!(idle.scores.iter().all(|s| s.cost_s == s.predicted_ttft_s));
    }

    #[test]
    fn a_worker_without_room_in_its_kv_cache_is_passed_over() {
        use crate::routing::KvReservation;
        let table = table();
        let pool = table.pools().next().unwrap();
        let prompt: Vec<u32> = (0..400).collect();
        let hashes = sequence_hashes(&prompt, 4);
        store(pool, 1, &prompt);
        let lookup = overlap(pool, &prompt);
        // The prompt, and 200 tokens of output.
        let request = Ask {
            hashes: &hashes,
            output_tokens: 200,
            ..ask(400, &lookup)
        };
        // Each worker has 1,000 usable blocks of 4 tokens (1,001 with vLLM's null block).
        let scrape = |position: usize, usage: &str| {
            pool.workers[position].load.update_from_metrics(
                &format!("vllm:kv_cache_usage_perc {usage}\nvllm:cache_config_info{{num_gpu_blocks=\"1001\"}} 1\n"),
                10,
            );
        };
        // Worker 1 is 85% used by others and holds the whole prompt in its cache, but no
        // request runs it: those cached blocks are free blocks to vLLM, which the request takes
        // out of the free ones by hitting them. It needs its 100 prompt blocks and its output,
        // 200 tokens = 50 blocks, there as anywhere, and there are 150.
        for (position, usage) in [(0, "0.1"), (1, "0.85"), (2, "0.1")] {
            scrape(position, usage);
        }
        let fits = decide(pool, &request, &[]).unwrap();
        assert_eq!(fits.chosen, 1, "{:?}", fits.scores);
        assert!(fits.scores.iter().all(|s| s.kv_blocks_needed == 150));
        assert_eq!(fits.scores[1].kv_blocks_free, Some(150));
        assert_eq!(fits.unhashed_kv_blocks, 50);
        // 90% used: the cached worker has too little room for it, and is passed over although
        // only 50 blocks of the request are new there (a conversation's history, cached but
        // idle between its turns, does not make room).
        scrape(1, "0.9");
        let passed = decide(pool, &request, &[]).unwrap();
        assert_ne!(passed.chosen, 1, "{:?}", passed.scores);
        assert!(
            passed
                .explain(pool)
                .contains("kv_blocks_needed=150 kv_blocks_free=100")
        );
        // This proxy's own request there runs the first 80 blocks of the prompt: the worker
        // holds them once for both, and the request needs 20 more and its output.
        let running = KvReservation::start(&pool.workers[1], &hashes[..80], 5);
        scrape(1, "0.9");
        assert_eq!(pool.workers[1].load.free_kv_blocks(), Some(100));
        let shares = decide(pool, &request, &[]).unwrap();
        assert_eq!(shares.chosen, 1, "{:?}", shares.scores);
        assert_eq!(shares.scores[1].kv_blocks_needed, 70);
        assert_eq!(shares.scores[0].kv_blocks_needed, 150);
        drop(running);
        // When no worker has room, the scorer still chooses (the best by time).
        let _others = [
            KvReservation::start(&pool.workers[0], &[], 800),
            KvReservation::start(&pool.workers[2], &[], 800),
        ];
        assert_eq!(decide(pool, &request, &[]).unwrap().chosen, 1);
        // A `max_tokens` no model has room for counts as the bound, not as an overflow.
        let huge = decide(
            pool,
            &Ask {
                output_tokens: usize::MAX,
                ..request
            },
            &[],
        )
        .unwrap();
        assert_eq!(
            huge.scores[1].kv_blocks_needed,
            100 + MAX_OUTPUT_TOKENS.div_ceil(4) as u64
        );
    }

    #[test]
    fn a_request_that_would_evict_a_conversation_between_its_turns_pays_for_its_prefill() {
        use crate::routing::KvReservation;
        let table = table();
        let pool = table.pools().next().unwrap();
        // Workers of 1,000 blocks of 4 tokens, 100 of them used by others.
        for position in 0..3 {
            pool.workers[position].load.update_from_metrics(
                "vllm:kv_cache_usage_perc 0.1\nvllm:cache_config_info{num_gpu_blocks=\"1001\"} 1\n",
                10,
            );
        }
        // A conversation of 3,200 tokens (800 blocks) just finished its turn on worker 0: its
        // blocks are cached there, free to vLLM, and it comes back for them.
        let history: Vec<u32> = (10_000..13_200).collect();
        drop(KvReservation::start(
            &pool.workers[0],
            &sequence_hashes(&history, 4),
            0,
        ));
        // A new 400-token prompt with 200 tokens of output needs 150 blocks: worker 0 has 900
        // free, but only 100 besides the conversation's.
        let prompt: Vec<u32> = (0..400).collect();
        let hashes = sequence_hashes(&prompt, 4);
        let lookup = overlap(pool, &prompt);
        let request = Ask {
            hashes: &hashes,
            output_tokens: 200,
            ..ask(400, &lookup)
        };
        // Before any prompt has come back for freed blocks, nothing freed is known to be wanted.
        assert_eq!(pool.kv.reuse_horizon(), None);
        let unknown = decide(pool, &request, &[]).unwrap();
        assert!(unknown.scores.iter().all(|s| s.evicted_tokens == 0));
        // Prompts come back about a minute after their history is freed: what was freed a
        // moment ago is wanted for four.
        pool.kv.record_reuse(std::time::Duration::from_secs(60));
        assert_eq!(
            pool.kv.reuse_horizon(),
            Some(std::time::Duration::from_secs(240))
        );
        for _ in 0..3 {
            let decision = decide(pool, &request, &[]).unwrap();
            let evicting = &decision.scores[0];
            assert_eq!(evicting.evicted_tokens, 200, "{:?}", decision.scores);
            assert!(decision.scores[1..].iter().all(|s| s.evicted_tokens == 0));
            // Its 50 blocks' prefill (60 ms at 300 µs a token) is charged to the choice, not to
            // the request's own predicted time.
            assert_eq!(
                evicting.predicted_ttft_s,
                decision.scores[1].predicted_ttft_s
            );
            assert!(evicting.cost_s > decision.scores[1].cost_s + 0.05);
            assert_ne!(decision.chosen, 0);
        }
        // The conversation's own next turn takes none of that room: it hits its history.
        let next: Vec<u32> = (10_000..13_300).collect();
        let next_hashes = sequence_hashes(&next, 4);
        let own = decide(
            pool,
            &Ask {
                hashes: &next_hashes,
                ..ask(3300, &overlap(pool, &next))
            },
            &[],
        )
        .unwrap();
        assert_eq!(own.scores[0].evicted_tokens, 0, "{:?}", own.scores);
    }

    #[test]
    fn a_new_stream_starts_where_it_leaves_room_for_one() {
        use crate::prompt::PromptInfo;
        use crate::routing::KvReservation;
        // A 400-token system prompt (100 blocks) every conversation opens with, then 200
        // tokens (50 blocks) a turn.
        let system: Vec<u32> = (0..400).collect();
        let turn = |n: u32, turns: u32| -> Vec<u32> {
            system
                .iter()
                .copied()
                .chain((0..200 * turns).map(|i| 100_000 * (n + 1) + i))
                .collect()
        };
        let hashes = |tokens: &[u32]| sequence_hashes(tokens, 4);
        // Workers of 1,000 blocks, 100 of them used by others. Three conversations are under
        // way on worker 1, between their fourth and fifth turns: their 600 blocks of history
        // are free to vLLM and wanted (prompts come back a minute after their blocks are
        // freed). `traffic` records what else the pool has routed.
        let pool_with = |table: &RoutingTable, traffic: &dyn Fn(&PoolRuntime)| {
            let pool = table.pools().next().unwrap();
            for position in 0..3 {
                pool.workers[position].load.update_from_metrics(
                    "vllm:kv_cache_usage_perc 0.1\nvllm:cache_config_info{num_gpu_blocks=\"1001\"} 1\n",
                    10,
                );
            }
            for n in 0..3 {
                store(pool, 1, &turn(n, 4));
                drop(KvReservation::start(
                    &pool.workers[1],
                    &hashes(&turn(n, 4)),
                    0,
                ));
            }
            pool.kv.record_reuse(std::time::Duration::from_secs(60));
            traffic(pool);
        };
        let decide_turn = |pool: &PoolRuntime, tokens: &[u32]| {
            let prompt = PromptInfo {
                tokens: tokens.len(),
                hashes: hashes(tokens),
                unfinished: None,
            };
            decide_for_prompt(pool, Some(&prompt), 0, &[]).unwrap()
        };

        // The pool's traffic is those conversations' turns and two others': fifteen of twenty
        // requests continued a stream, with prompts of 250 blocks on average.
        let conversations = table();
        pool_with(&conversations, &|pool| {
            for t in 1..=4 {
                for n in 0..5 {
                    pool.kv.popularity.record(&hashes(&turn(n, t)), 200);
                }
            }
        });
        let pool = conversations.pools().next().unwrap();
        // A new conversation would prefill least on worker 1, which holds the system prompt;
        // but with 300 blocks of room there against 900 elsewhere it would squeeze the three
        // conversations' next turns: it starts elsewhere.
        let new = decide_turn(pool, &turn(9, 1));
        let streams = new.new_stream_blocks.unwrap();
        assert!((245.0..=260.0).contains(&streams), "{streams}");
        assert_eq!(new.scores[1].room_blocks, Some(300), "{:?}", new.scores);
        assert_eq!(new.scores[0].room_blocks, Some(900));
        assert_ne!(new.chosen, 1);
        let chosen = new.chosen_score().unwrap();
        assert!(new.scores[1].predicted_ttft_s < chosen.predicted_ttft_s);
        assert!(
            new.explain(pool)
                .contains(&format!("new_stream_blocks={streams:.0}"))
        );
        assert!(new.explain(pool).contains("kv_room_blocks=300"));
        // A conversation's next turn continues its stream: it stays with its history.
        let next = decide_turn(pool, &turn(0, 5));
        assert_eq!(next.new_stream_blocks, None);
        assert_eq!(next.chosen, 1);
        // A retry after worker 0 failed the new conversation's first turn is placed by cost.
        let prompt = PromptInfo {
            tokens: turn(9, 1).len(),
            hashes: hashes(&turn(9, 1)),
            unfinished: None,
        };
        let retry = decide_for_prompt(pool, Some(&prompt), 0, &[0]).unwrap();
        assert_eq!(retry.new_stream_blocks, None);
        assert_eq!(retry.chosen, 1);
        // A conversation this proxy never routed whose history a worker caches (another gateway
        // replica placed it) is not a new one either.
        store(pool, 2, &turn(7, 3));
        let elsewhere = decide_turn(pool, &turn(7, 4));
        assert_eq!(elsewhere.new_stream_blocks, None);
        assert_eq!(elsewhere.chosen, 2);

        // Where the traffic is single requests opening with the system prompt, a request that
        // continues nothing most likely stays alone: the cached worker takes it.
        let singles = table();
        pool_with(&singles, &|pool| {
            for n in 10..30 {
                pool.kv.popularity.record(&hashes(&turn(n, 1)), 200);
            }
        });
        let pool = singles.pools().next().unwrap();
        let single = decide_turn(pool, &turn(9, 1));
        assert_eq!(single.new_stream_blocks, None);
        assert_eq!(single.chosen, 1);
    }

    #[test]
    fn ties_spread_and_exclusions_hold() {
        let table = table();
        let pool = table.pools().next().unwrap();
        let lookup = overlap(pool, &[1, 2, 3, 4]);
        let mut seen = [0; 3];
        for _ in 0..300 {
            let decision = decide(pool, &ask(4, &lookup), &[]).unwrap();
            assert_eq!(decision.outcome, Outcome::NoCache);
            seen[decision.chosen] += 1;
        }
        assert!(seen.iter().all(|n| *n > 30), "{seen:?}");
        for _ in 0..20 {
            assert_eq!(decide(pool, &ask(4, &lookup), &[0, 2]).unwrap().chosen, 1);
        }
        assert!(decide(pool, &ask(4, &lookup), &[0, 1, 2]).is_none());
    }

    #[test]
    fn a_prefix_more_traffic_shares_than_its_holders_carry_is_copied_once_they_queue() {
        use crate::prompt::PromptInfo;
        let table = table();
        let pool = table.pools().next().unwrap();
        // A 380-token system prompt (95 blocks) every conversation opens with, worker 1 holds.
        let system: Vec<u32> = (0..380).collect();
        store(pool, 1, &system);
        let conversation = |n: u32| -> Vec<u32> {
            system
                .iter()
                .copied()
                .chain((0..20).map(|i| 10_000 + 100 * n + i))
                .collect()
        };
        let prompt = PromptInfo {
            tokens: 400,
            hashes: sequence_hashes(&conversation(99), 4),
            unfinished: None,
        };
        let route = || decide_for_prompt(pool, Some(&prompt), 0, &[]).unwrap();
        // Before any traffic nothing is shared, and a queue shorter than the system prompt's
        // prefill keeps the request on its holder.
        let queued = PendingPrefill::start(&pool.workers[1], PrefillWork::after(0, 250));
        let alone = route();
        assert!(alone.scores.iter().all(|s| s.replicated_tokens == 0));
        assert_eq!((alone.chosen, alone.outcome), (1, Outcome::CacheHit));
        // 64 conversations' first turns went through this pool: the system prompt comes with
        // most of the work (0.77 with the prior: 2.3 workers' worth) and one worker holds it.
        // The others are scored without its prefill, and a copy goes to one of them.
        for n in 0..64 {
            pool.kv
                .popularity
                .record(&sequence_hashes(&conversation(n), 4), 20);
        }
        let copy = route();
        assert_eq!(copy.scores[1].replicated_tokens, 0);
        assert_ne!(copy.chosen, 1);
        assert_eq!(copy.outcome, Outcome::Replicate);
        assert!(copy.explain(pool).contains("replicated_tokens=380"));
        // The predicted TTFT is still the copy's: its prefill is real, only not charged.
        let chosen = copy.chosen_score().unwrap();
        assert!(chosen.predicted_ttft_s > chosen.cost_s, "{chosen:?}");
        // Behind a queue longer than the whole prefill the holder would lose anyway: a spread,
        // not a copy the credit made.
        let longer = PendingPrefill::start(&pool.workers[1], PrefillWork::after(0, 1_000));
        let spread = route();
        assert_ne!(spread.chosen, 1);
        assert_eq!(spread.outcome, Outcome::Spread);
        drop(longer);
        drop(queued);
        // With nothing queued the holder keeps it.
        let idle = route();
        assert_eq!((idle.chosen, idle.outcome), (1, Outcome::CacheHit));
        assert_eq!(idle.scores[0].replicated_tokens, 380);

        // Half the work needs 1.5 workers: one holder of three is too few, two are enough.
        fn with_shares(pool: &PoolRuntime, lookup: &Overlap, shares: &[f64]) -> Decision {
            let request = Ask {
                shares,
                ..ask(400, lookup)
            };
            decide(pool, &request, &[]).unwrap()
        }
        let lookup = overlap(pool, &conversation(99));
        let one = with_shares(pool, &lookup, &[0.5; 95]);
        assert_eq!(one.scores[0].replicated_tokens, 380);
        store(pool, 2, &system);
        let lookup = overlap(pool, &conversation(99));
        let two = with_shares(pool, &lookup, &[0.5; 95]);
        assert!(
            two.scores.iter().all(|s| s.replicated_tokens == 0),
            "{two:?}"
        );
        // All of it on two holders of three: the third is scored as holding it.
        let all = with_shares(pool, &lookup, &[1.0; 95]);
        assert_eq!(all.scores[0].replicated_tokens, 380);
    }

    #[test]
    fn a_conversations_own_history_is_not_copied_for_its_share() {
        let table = table();
        let pool = table.pools().next().unwrap();
        // Worker 1 holds a conversation: the system prompt every conversation shares (40
        // blocks, now on every worker) and this one's own earlier turns (60 blocks).
        let history: Vec<u32> = (0..400).collect();
        for position in 0..3 {
            store(pool, position, &history[..160]);
        }
        store(pool, 1, &history);
        let mut shares = vec![1.0; 40];
        shares.extend([1.0 / 32.0; 60]);
        let lookup = overlap(pool, &history);
        let _queued = PendingPrefill::start(&pool.workers[1], PrefillWork::after(0, 60));
        let decision = decide(
            pool,
            &Ask {
                shares: &shares,
                ..ask(400, &lookup)
            },
            &[],
        )
        .unwrap();
        assert_eq!((decision.chosen, decision.outcome), (1, Outcome::CacheHit));
        assert!(decision.scores.iter().all(|s| s.replicated_tokens == 0));
    }

    #[test]
    fn a_pool_can_turn_the_copies_off() {
        use crate::prompt::PromptInfo;
        let table = table_with(", scoring: {replicateSharedPrefixes: false}");
        let pool = table.pools().next().unwrap();
        let system: Vec<u32> = (0..380).collect();
        store(pool, 1, &system);
        let mut tokens = system.clone();
        tokens.extend(10_000..10_020);
        for _ in 0..64 {
            pool.kv.popularity.record(&sequence_hashes(&tokens, 4), 20);
        }
        let _queued = PendingPrefill::start(&pool.workers[1], PrefillWork::after(0, 250));
        let prompt = PromptInfo {
            tokens: 400,
            hashes: sequence_hashes(&tokens, 4),
            unfinished: None,
        };
        let decision = decide_for_prompt(pool, Some(&prompt), 0, &[]).unwrap();
        assert_eq!((decision.chosen, decision.outcome), (1, Outcome::CacheHit));
        assert!(decision.scores.iter().all(|s| s.replicated_tokens == 0));
    }
}
