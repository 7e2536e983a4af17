//! How much of a pool's recent work comes with each prefix, from more than one stream.
//!
//! Every routed prompt adds its work (the prompt tokens its worker had to prefill, plus one)
//! to each of its leading blocks (a block's hash names the whole prefix up to it) that another
//! stream used last, and counts fade by half every [`HALF_LIFE_REQUESTS`] requests. A prefix's
//! share is its count over the pool's (plus a prior, [`PRIOR_REQUESTS`]): about 0.92 for a
//! system prompt every request opens with, about 1/16 of that for each of sixteen equally used
//! ones, and little for a popular document whose requests are cache hits among cold prompts
//! that bring most of the prefill. The scorer compares a prefix's share with how many workers
//! hold it: a prefix whose traffic brings more work than its holders' fair share of the pool is
//! worth a copy on another worker ([`crate::scorer`]).
//!
//! **Streams.** A request whose prompt holds the whole prompt of the request that last used its
//! longest known prefix (that prompt's last block hash names all of it), and goes on past it,
//! continues that request: a conversation's next turn, an agent's next step. The two are one
//! stream, which sends one request at a time, so a copy of what they have in common spreads
//! nothing: the next request follows the latest turn. A request adds its work only to the
//! prefixes whose last use was another request's than its predecessor's (the first use of a
//! prefix counts for nothing): a conversation's own history counts for nothing however few
//! conversations share the pool (or however much a turn moved to another worker had to
//! prefill), while the system prompt its turns open with counts whenever other conversations
//! use it in between. A prompt the same as the one of the request that last used it, or one
//! that stops inside it, continues nothing (a second sample, a shorter request sharing a
//! prefix): its work counts.
//!
//! **New streams.** The same count says how much of the pool's traffic continues a stream, and
//! how long the prompts that do are: a pool whose requests mostly continue one serves
//! conversations or agents, and a request there that continues none starts a stream that
//! will keep coming back to the worker it lands on, with prompts about that long
//! ([`PrefixPopularity::new_stream_blocks`]; the scorer places it where it leaves room). The
//! table forgets the prefixes used longest ago (a live history, never shared, has no count to
//! keep it by).
//!
//! Fading per request rather than per second makes the share a fraction of the traffic at any
//! rate. Each gateway replica counts what it routes: with clients spread over the replicas,
//! each sees the same fractions.

use std::collections::HashMap;
use std::sync::Mutex;

use switchyard_kv::hash::SequenceHash;

/// Requests after which a prefix's count has faded to half: long enough that a prefix used by
/// one request in sixteen has a steady share, short enough that a workload's change shows
/// within a few hundred requests.
pub const HALF_LIFE_REQUESTS: f64 = 128.0;

/// Requests the shares are read as if the pool had seen more: the first few requests of a pool
/// say little of what the traffic shares (two requests of one prompt are not a prefix that all
/// traffic uses), so a share is its count over the pool's count plus this many requests of the
/// average work. In a steady state the pool's count is about 185 requests' worth, so a prefix
/// all traffic shares reads 0.92: enough for a copy on every worker of a pool of up to 12, and
/// on all but one or two of larger ones; a prefix at exactly one worker's fair share (1/16 on
/// 16 workers) stays with one holder.
pub const PRIOR_REQUESTS: f64 = 16.0;

/// The share of the pool's recent requests that must continue a stream for a request that
/// continues none to be taken as starting one: below it the pool serves mostly single requests,
/// and a request that continues nothing most likely stays alone.
pub const STREAMS_ABOVE: f64 = 0.5;

/// Leading blocks of a prompt that are counted (past them a prompt's blocks are its own).
pub const MAX_BLOCKS: usize = 1024;

/// Prefixes remembered at most; past it the half used longest ago are forgotten (by when they
/// were last used, not by count: a live conversation's history has a count of nothing).
pub const MAX_PREFIXES: usize = 1 << 16;

#[derive(Debug, Default)]
pub struct PrefixPopularity {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Requests counted so far.
    requests: u64,
    /// The pool's faded request count and work, as of the last request.
    faded_requests: f64,
    total: f64,
    /// Of those, the faded count of requests that continued a stream, and their prompts'
    /// blocks.
    continuing: f64,
    continuing_blocks: f64,
    /// Per prefix: its faded count, and the request that last used it.
    prefixes: HashMap<SequenceHash, Prefix>,
}

#[derive(Debug, Clone, Copy)]
struct Prefix {
    /// The faded count, as of request `at`.
    count: f64,
    /// The number of the request that last used the prefix; the count is up to date as of it.
    at: u64,
    /// That request's prompt length in blocks (all of them, counted or not), and its last
    /// block's hash, which names the whole prompt.
    blocks: usize,
    tail: SequenceHash,
}

/// The factor a count fades by per request.
fn fade_per_request() -> f64 {
    (-std::f64::consts::LN_2 / HALF_LIFE_REQUESTS).exp()
}

/// A count last brought up to date at request `at`, faded to request `now`.
fn faded(count: f64, at: u64, now: u64) -> f64 {
    count * fade_per_request().powf(now.saturating_sub(at) as f64)
}

impl State {
    /// A request's average work lately (0 before the first).
    fn average_work(&self) -> f64 {
        if self.faded_requests > 0.0 {
            self.total / self.faded_requests
        } else {
            0.0
        }
    }

    /// Forget the prefixes used longest ago, down to about half the table (the blocks of one
    /// request share its number: the ones of the request at the cut stay with it).
    fn forget(&mut self) {
        let mut used: Vec<u64> = self.prefixes.values().map(|prefix| prefix.at).collect();
        let Some(cut) = used.len().checked_sub(MAX_PREFIXES / 2) else {
            return;
        };
        let (_, oldest_kept, _) = used.select_nth_unstable(cut);
        let oldest_kept = *oldest_kept;
        self.prefixes.retain(|_, prefix| prefix.at >= oldest_kept);
    }
}

/// The leading blocks of a prompt that are counted.
fn counted(hashes: &[SequenceHash]) -> &[SequenceHash] {
    hashes.get(..MAX_BLOCKS).unwrap_or(hashes)
}

/// What the table knows of a prompt: how many of its leading blocks, and the deepest of them.
struct Known<'a> {
    depth: usize,
    deepest: Option<&'a Prefix>,
}

impl<'a> Known<'a> {
    fn of(prefixes: &'a HashMap<SequenceHash, Prefix>, hashes: &[SequenceHash]) -> Self {
        let (depth, deepest) = counted(hashes)
            .iter()
            .map_while(|hash| prefixes.get(hash))
            .fold((0, None), |(depth, _), prefix| (depth + 1, Some(prefix)));
        Known { depth, deepest }
    }

    /// The request the prompt (its block hashes, those `of` was given) continues: the one that
    /// last used its longest known prefix, if the prompt holds that request's whole prompt and
    /// goes on past it.
    fn predecessor(&self, hashes: &[SequenceHash]) -> Option<u64> {
        let last = self.deepest?;
        let whole = self.depth == last.blocks.min(MAX_BLOCKS)
            && last
                .blocks
                .checked_sub(1)
                .and_then(|tail| hashes.get(tail))
                .is_some_and(|tail| *tail == last.tail);
        (whole && hashes.len() > last.blocks).then_some(last.at)
    }
}

impl PrefixPopularity {
    /// Count one routed prompt (its block hashes, in order) and the prompt tokens its worker
    /// prefills for it.
    pub fn record(&self, hashes: &[SequenceHash], prefill_tokens: usize) {
        let work = 1.0 + prefill_tokens as f64;
        let mut state = crate::lock(&self.state);
        let state = &mut *state;
        let fade = fade_per_request();
        state.requests += 1;
        state.faded_requests = state.faded_requests * fade + 1.0;
        state.total = state.total * fade + work;
        let now = state.requests;
        let predecessor = Known::of(&state.prefixes, hashes).predecessor(hashes);
        let tail = hashes.last().copied().unwrap_or(SequenceHash(0));
        let continues = f64::from(u8::from(predecessor.is_some()));
        state.continuing = state.continuing * fade + continues;
        state.continuing_blocks = state.continuing_blocks * fade + continues * hashes.len() as f64;
        for hash in counted(hashes) {
            let entry = state.prefixes.entry(*hash).or_insert(Prefix {
                count: 0.0,
                at: now,
                blocks: 0,
                tail,
            });
            let shared = entry.blocks > 0 && Some(entry.at) != predecessor;
            *entry = Prefix {
                count: faded(entry.count, entry.at, now) + if shared { work } else { 0.0 },
                at: now,
                blocks: hashes.len(),
                tail,
            };
        }
        if state.prefixes.len() > MAX_PREFIXES {
            state.forget();
        }
    }

    /// The blocks a stream's prompts take, on average, when a prompt of these blocks starts one
    /// in a pool whose requests mostly continue streams ([`STREAMS_ABOVE`]); `None` where most
    /// requests continue none (none yet included), for a prompt that continues a stream, and
    /// for one some worker caches deeper than the table knows it (`cached_blocks`: a stream
    /// another gateway replica placed, or one this table forgot). A prompt the same as the one
    /// of the request that last used it continues nothing and starts a stream (a regenerated
    /// answer); the gateway's own retries are not asked.
    pub fn new_stream_blocks(&self, hashes: &[SequenceHash], cached_blocks: usize) -> Option<f64> {
        let state = crate::lock(&self.state);
        // No warm-up: the conversations a pool starts with are the ones that pile up on the
        // first worker to hold their shared opening.
        if state.continuing <= STREAMS_ABOVE * state.faded_requests {
            return None;
        }
        let known = Known::of(&state.prefixes, hashes);
        let continues = known.predecessor(hashes).is_some();
        (!continues && cached_blocks <= known.depth)
            .then(|| state.continuing_blocks / state.continuing)
    }

    /// The share of the pool's recent work that came with each leading prefix of `hashes`
    /// (non-increasing; 0 for a prefix not seen lately), into `out`.
    pub fn shares(&self, hashes: &[SequenceHash], out: &mut Vec<f64>) {
        out.clear();
        let state = crate::lock(&self.state);
        if state.faded_requests <= 0.0 {
            return;
        }
        let total = state.total + PRIOR_REQUESTS * state.average_work();
        let mut last = 1.0_f64;
        for hash in hashes.iter().take(MAX_BLOCKS) {
            let share = match state.prefixes.get(hash) {
                Some(prefix) => faded(prefix.count, prefix.at, state.requests) / total,
                None => 0.0,
            };
            // A deeper prefix is used by no more requests than the one it extends (its count
            // can only look higher once the shorter one was forgotten).
            last = last.min(share);
            if last <= 0.0 {
                break;
            }
            out.push(last);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(group: u64, conversation: u64, blocks: u64) -> Vec<SequenceHash> {
        // Ten blocks shared by the group, then the conversation's own.
        (0..blocks)
            .map(|block| {
                if block < 10 {
                    SequenceHash(group * 1_000 + block)
                } else {
                    SequenceHash(1_000_000 + conversation * 1_000 + block)
                }
            })
            .collect()
    }

    #[test]
    fn a_prefix_every_conversation_shares_has_all_the_traffic_and_a_history_none() {
        let popularity = PrefixPopularity::default();
        let mut shares = Vec::new();
        // Before any traffic: nothing is shared.
        popularity.shares(&prompt(1, 0, 12), &mut shares);
        assert!(shares.is_empty());
        // 32 conversations taking turns, all opening with group 1's system prompt.
        for turn in 0..20 {
            for conversation in 0..32 {
                popularity.record(&prompt(1, conversation, 12 + turn), 100);
            }
        }
        // The system prompt (10 blocks) comes with nearly all the work; a conversation's own
        // turns are one stream, which shares its history with nobody.
        popularity.shares(&prompt(1, 5, 20), &mut shares);
        assert_eq!(shares.len(), 10, "{shares:?}");
        assert!(shares[9] > 0.9 && shares[9] <= 1.0, "{shares:?}");
        assert!(shares.windows(2).all(|w| w[1] <= w[0]), "{shares:?}");
        // A prompt no request opened with shares nothing.
        popularity.shares(&prompt(2, 99, 12), &mut shares);
        assert!(shares.is_empty(), "{shares:?}");
    }

    #[test]
    fn two_conversations_share_their_system_prompt_but_not_their_histories() {
        let popularity = PrefixPopularity::default();
        let mut shares = Vec::new();
        // Two conversations, long turns: each history is half the traffic, which a count of
        // all the work would read as a prefix two workers' worth of traffic comes with.
        for turn in 0..40 {
            for conversation in 0..2 {
                popularity.record(&prompt(1, conversation, 12 + turn), 2_000);
            }
        }
        popularity.shares(&prompt(1, 1, 52), &mut shares);
        assert_eq!(shares.len(), 10, "{shares:?}");
        assert!(shares[9] > 0.75, "{shares:?}");
        // One conversation alone has nothing shared at all, its system prompt included.
        let alone = PrefixPopularity::default();
        for turn in 0..40 {
            alone.record(&prompt(3, 0, 12 + turn), 2_000);
        }
        alone.shares(&prompt(3, 0, 52), &mut shares);
        assert!(shares.is_empty(), "{shares:?}");
    }

    #[test]
    fn repeats_and_shorter_prompts_are_other_streams() {
        let mut shares = Vec::new();
        // The same prompt again and again (samples of one prompt): each use after the first is
        // another stream's.
        let repeats = PrefixPopularity::default();
        for _ in 0..64 {
            repeats.record(&prompt(1, 0, 12), 100);
        }
        repeats.shares(&prompt(1, 0, 12), &mut shares);
        assert_eq!(shares.len(), 12, "{shares:?}");
        assert!(shares[11] > 0.7, "{shares:?}");
        // A long prompt, then ones that stop inside it: they use what it used.
        let shorter = PrefixPopularity::default();
        for request in 0..64 {
            shorter.record(&prompt(1, 0, 30), 100);
            shorter.record(&prompt(1, 0, 12 + request % 8), 100);
        }
        shorter.shares(&prompt(1, 0, 30), &mut shares);
        assert!(shares.len() >= 12, "{shares:?}");
        assert!(shares[11] > 0.7, "{shares:?}");
        // Past the first `MAX_BLOCKS` blocks a prompt is not counted, yet a longer turn still
        // continues its predecessor and a repeat of it is still another stream.
        let long = PrefixPopularity::default();
        for turn in 0..64 {
            long.record(&prompt(4, 0, MAX_BLOCKS as u64 + 10 + turn), 100);
        }
        long.shares(&prompt(4, 0, MAX_BLOCKS as u64 + 100), &mut shares);
        assert!(shares.is_empty(), "{shares:?}");
        for _ in 0..64 {
            long.record(&prompt(4, 0, MAX_BLOCKS as u64 + 100), 100);
        }
        long.shares(&prompt(4, 0, MAX_BLOCKS as u64 + 100), &mut shares);
        assert_eq!(shares.len(), MAX_BLOCKS, "{shares:?}");
    }

    #[test]
    fn shares_follow_the_traffic_and_the_first_requests_count_for_little() {
        let popularity = PrefixPopularity::default();
        let mut shares = Vec::new();
        popularity.record(&prompt(1, 0, 12), 100);
        popularity.record(&prompt(1, 1, 12), 100);
        popularity.shares(&prompt(1, 2, 12), &mut shares);
        // Two requests of one prompt: not yet a prefix all the traffic shares.
        assert!(shares[0] < 0.2, "{shares:?}");
        // Sixteen groups in turn: each about a sixteenth.
        for request in 0..2_000 {
            popularity.record(&prompt(request % 16, request, 12), 100);
        }
        popularity.shares(&prompt(3, 0, 12), &mut shares);
        assert!(shares[0] > 0.04 && shares[0] < 0.08, "{shares:?}");
        // Then all traffic moves to group 20: within a few half-lives it has most of it (all
        // of it reads as about 0.92, the pool's count being ~185 plus the prior's 16), and
        // group 3's share fades.
        for request in 0..640 {
            popularity.record(&prompt(20, request, 12), 100);
        }
        popularity.shares(&prompt(20, 0, 12), &mut shares);
        assert!(shares[0] > 0.85 && shares[0] < 0.93, "{shares:?}");
        popularity.shares(&prompt(3, 0, 12), &mut shares);
        assert!(shares.first().is_none_or(|s| *s < 0.01), "{shares:?}");
    }

    #[test]
    fn streams_sharing_more_than_the_counted_blocks_are_still_two_streams() {
        // Two conversations whose prompts share their first MAX_BLOCKS + 5 blocks (a long
        // document both discuss), taking turns.
        let shared = (0..MAX_BLOCKS as u64 + 5).map(SequenceHash);
        let turn = |conversation: u64, turn: u64| -> Vec<SequenceHash> {
            shared
                .clone()
                .chain((0..10 * turn).map(|b| SequenceHash(1 << 40 | conversation << 20 | b)))
                .collect()
        };
        let popularity = PrefixPopularity::default();
        for t in 1..40 {
            for conversation in 0..2 {
                popularity.record(&turn(conversation, t), 100);
            }
        }
        // Each turn's predecessor is its own conversation's last turn, not whichever of the two
        // used the counted blocks last: the shared document comes with every turn's work.
        let mut shares = Vec::new();
        popularity.shares(&turn(0, 40), &mut shares);
        assert_eq!(shares.len(), MAX_BLOCKS, "{shares:?}");
        assert!(shares[MAX_BLOCKS - 1] > 0.7, "{shares:?}");
    }

    #[test]
    fn a_full_table_forgets_what_was_used_longest_ago_not_live_histories() {
        let popularity = PrefixPopularity::default();
        // A conversation takes a turn between every 64 unique prompts, far more blocks than
        // the table holds.
        let turn = |t: u64| prompt(1, 0, 12 + t);
        for t in 0..(3 * MAX_PREFIXES as u64 / 64 / 64) {
            popularity.record(&turn(t), 100);
            for request in 0..64 {
                let unique: Vec<SequenceHash> = (0..64)
                    .map(|b| SequenceHash(1 << 40 | (t * 64 + request) << 8 | b))
                    .collect();
                popularity.record(&unique, 100);
            }
        }
        let state = crate::lock(&popularity.state);
        assert!(
            state.prefixes.len() <= MAX_PREFIXES,
            "{}",
            state.prefixes.len()
        );
        // The conversation's history, never shared, is still known: its next turn continues
        // it.
        let last = 3 * MAX_PREFIXES as u64 / 64 / 64 - 1;
        let next = turn(last + 1);
        assert!(
            Known::of(&state.prefixes, &next)
                .predecessor(&next)
                .is_some()
        );
        assert_eq!(
            Known::of(&state.prefixes, &turn(last)).depth,
            turn(last).len()
        );
    }

    #[test]
    fn a_popular_prefix_of_cache_hits_has_little_of_the_work() {
        let popularity = PrefixPopularity::default();
        let mut shares = Vec::new();
        // A quarter of the requests open with document 1 and prefill only their question (30
        // tokens); the rest are cold prompts of their own (2,000 tokens each).
        for request in 0..512 {
            if request % 4 == 0 {
                popularity.record(&prompt(1, request, 12), 30);
            } else {
                popularity.record(&prompt(100 + request, request, 12), 2_000);
            }
        }
        popularity.shares(&prompt(1, 0, 12), &mut shares);
        assert!(shares[0] > 0.001 && shares[0] < 0.01, "{shares:?}");
    }

    #[test]
    fn a_full_table_forgets_the_prefixes_used_longest_ago() {
        let popularity = PrefixPopularity::default();
        // One shared block, then unique ones: far more prefixes than the table holds.
        let shared = SequenceHash(u64::MAX);
        for request in 0..(3 * MAX_PREFIXES as u64 / 64) {
            let hashes: Vec<SequenceHash> = std::iter::once(shared)
                .chain((1..64).map(|b| SequenceHash(request * 64 + b)))
                .collect();
            popularity.record(&hashes, 100);
        }
        let mut shares = Vec::new();
        popularity.shares(&[shared], &mut shares);
        assert!(shares[0] > 0.9, "the shared prefix survives: {shares:?}");
        let state = crate::lock(&popularity.state);
        assert!(
            state.prefixes.len() <= MAX_PREFIXES,
            "{}",
            state.prefixes.len()
        );
        assert!(state.prefixes.len() >= 64, "the latest prompts are kept");
    }
}
