//! How much of a pool's recent work comes with each prefix.
//!
//! Every routed prompt adds its work (the prompt tokens its worker had to prefill, plus one)
//! to each of its leading blocks (a block's hash names the whole prefix up to it), and counts
//! fade by half every [`HALF_LIFE_REQUESTS`] requests. A prefix's share is its count over the
//! pool's (plus a prior, [`PRIOR_REQUESTS`]): about 0.92 for a system prompt every request
//! opens with, about 1/16 of that for each of sixteen equally used ones, 1/n for a
//! conversation's own history among n conversations, and little for a popular document whose
//! requests are cache hits among cold prompts that bring most of the prefill. The scorer
//! compares a prefix's share with how many workers hold it: a prefix whose traffic brings more
//! work than its holders' fair share of the pool is worth a copy on another worker
//! ([`crate::scorer`]).
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

/// Leading blocks of a prompt that are counted (past them a prompt's blocks are its own).
pub const MAX_BLOCKS: usize = 1024;

/// Prefixes remembered at most; past it the faded ones are forgotten.
pub const MAX_PREFIXES: usize = 1 << 16;

/// Counts below this many requests of the average work (a prefix last seen about two
/// half-lives ago, once) are forgotten when the table is full.
const FORGET_BELOW: f64 = 0.25;

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
    /// Per prefix: its faded count and the request number it was last brought up to date at.
    prefixes: HashMap<SequenceHash, (f64, u64)>,
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

    /// Forget the faded prefixes, more of them while the table stays above half its size.
    fn forget(&mut self) {
        let mut below = FORGET_BELOW * self.average_work().max(1.0);
        let now = self.requests;
        while self.prefixes.len() > MAX_PREFIXES / 2 {
            self.prefixes
                .retain(|_, (count, at)| faded(*count, *at, now) >= below);
            below *= 2.0;
        }
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
        for hash in hashes.iter().take(MAX_BLOCKS) {
            let entry = state.prefixes.entry(*hash).or_insert((0.0, now));
            *entry = (faded(entry.0, entry.1, now) + work, now);
        }
        if state.prefixes.len() > MAX_PREFIXES {
            state.forget();
        }
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
                Some((count, at)) => faded(*count, *at, state.requests) / total,
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
    fn a_prefix_every_request_shares_has_all_the_traffic_and_each_history_its_own() {
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
        popularity.shares(&prompt(1, 5, 20), &mut shares);
        assert_eq!(shares.len(), 20, "{shares:?}");
        let system = shares[9];
        assert!(system > 0.9 && system <= 1.0, "{shares:?}");
        let own = shares[10];
        assert!(
            own > 0.02 && own < 0.05,
            "one conversation in 32: {shares:?}"
        );
        assert!(shares.windows(2).all(|w| w[1] <= w[0]), "{shares:?}");
        // A prompt no request opened with shares nothing.
        popularity.shares(&prompt(2, 99, 12), &mut shares);
        assert!(shares.is_empty(), "{shares:?}");
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
    fn the_table_forgets_faded_prefixes_when_full() {
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
