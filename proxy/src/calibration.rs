//! The TTFT model, learned online: the pool's coefficients and each worker's speed.
//!
//! **The pool's coefficients** ([`PoolCalibration`]). The scorer predicts a worker's time to
//! first token as `fixed + prefill × tokens + attention × pairs + running × requests`
//! ([`Coefficients`]; `pairs`: what the prefilled tokens attend to, [`PrefillWork`]); the
//! configured values (`scoring.prefillMicrosPerToken`, `attentionContextTokens`,
//! `runningRequestMicros`) are where the model starts, not what it keeps. Every streamed answer
//! is one observation: the tokens the request waited for (the prefill queued ahead of it at the
//! decision, plus its own uncached prompt as the worker reported it, `prompt_tokens` less
//! `prompt_tokens_details.cached_tokens`, or as the prefix index predicted it when the worker
//! does not report details) and their pairs, the requests running there, and the time the
//! first token took. A Kalman filter over the four coefficients (a Bayesian linear regression whose
//! prior is the configuration, with a little process noise so it follows a fleet that changes)
//! learns them: with coefficients 2x off, a few dozen answers are enough. Each observation's error
//! is relative (a 50 ms miss matters on a 100 ms prediction, not on a 5 s one), outliers (a
//! preemption, a stalled connection) count for at most three standard deviations, and the
//! coefficients stay within a factor of [`COEFFICIENT_RANGE`] of the configuration. The typical
//! relative error of the predictions, measured before each update, is kept too: `/debug/route` and
//! `/metrics` show it beside the coefficients.
//!
//! **Each worker's speed** ([`TtftCalibration`]). A real fleet is heterogeneous (another GPU,
//! a thermally throttled card, a worker sharing its node). Each worker therefore keeps its
//! latest [`RECENT_RATIOS`] qualifying answers (the request's uncached prompt, the requests
//! running, the time from sending it to its first body chunk), and its speed is the median of
//! their ratios to what the pool's model *now* predicts for them. Every worker is judged
//! against the same model, however long ago its answers came: while the pool's model learns
//! (from a configuration 5x off, say), a ratio fixed at the time of the answer would make the
//! workers measured early look several times slower or faster than those measured later, and
//! the router would avoid or flood them for it. The median: one answer that waited out a long
//! decode step, or met a stall of the network, moves it little.
//!
//! What qualifies: a request nothing was predicted to be queued ahead of, whose own prefill
//! (the worker's count of its uncached tokens when it reports cached ones) is at least half of
//! its prediction (a cold or mostly uncached prompt), and that took at least
//! [`MIN_OBSERVED_S`]. A mostly cached prompt's time is the step it waited for, the network and
//! the batch it joined; a queued one's is how much of the queue the worker's batches overlap,
//! which the linear model gets wrong in proportion to the queue (a busy worker would look
//! faster the busier it is, and draw still more traffic). Neither says much about the card,
//! both vary with each worker's traffic mix. The rule is relative, so it holds at every scale:
//! a fleet whose prompts take 40 ms as one whose take 4 s.
//!
//! What the scorer uses is that ratio *relative to the pool's median worker* (a worker not known
//! yet counts as the pool's answers so far say): only relative speed changes which worker is
//! best. An error every worker shares (a busy period the model underestimates everywhere)
//! cancels out instead of pushing every prediction around, and a worker that is avoided for a
//! while keeps its relative speed rather than drifting.
//!
//! Used unless the pool sets `scoring.learnWorkerSpeed: false`. On equal workers the ratios
//! still differ a little with each worker's traffic mix, so a speed counts only after a full
//! window of answers, and one within [`SAME_SPEED`] of the pool's is taken as equal.

use std::collections::VecDeque;
use std::sync::Mutex;

use switchyard_snapshot::snapshot::Scoring;

/// Ratios a worker's speed is the median of.
const RECENT_RATIOS: usize = 9;
/// Answers faster than this are not learned from.
const MIN_OBSERVED_S: f64 = 0.005;
/// Nor those whose prediction's own prefill term is less than this share of it.
const MIN_PREFILL_SHARE: f64 = 0.5;
/// Observations a worker needs before its speed counts: a full window. Single answers of one
/// worker scatter by about 20% (the step each waited out, the batch it joined), so the median
/// of five is off by about 11% and an equal worker crosses the ±20% band of [`SAME_SPEED`] in
/// a run now and then; the median of nine, about 8%, rarely.
const MIN_OBSERVATIONS: u64 = RECENT_RATIOS as u64;
/// Relative speeds are kept within this range, whatever the data says.
const RELATIVE_RANGE: (f64, f64) = (0.5, 3.0);
/// Relative speeds this close to 1 are taken as 1: identical workers measured with noise must
/// not look different (the shared-prefix benchmark's tail doubled without it).
const SAME_SPEED: f64 = 0.2;

/// One worker's learned speed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Speed {
    /// Observed over predicted time to first token (1: as the formula says).
    pub ratio: f64,
    /// Streamed requests learned from.
    pub observations: u64,
    /// The last streamed request's predicted and observed time to first token, in seconds
    /// (also when it was too short to learn from).
    pub last: Option<(f64, f64)>,
}

impl Default for Speed {
    /// Nothing learned: as the formula says.
    fn default() -> Self {
        Speed {
            ratio: 1.0,
            observations: 0,
            last: None,
        }
    }
}

impl Speed {
    /// Whether enough has been seen for the ratio to count.
    pub fn known(&self) -> bool {
        self.observations >= MIN_OBSERVATIONS
    }

    /// This worker's time to first token as a multiple of the formula's, relative to a pool
    /// whose median worker has `median_ratio` (1 until this worker is known).
    pub fn relative_to(&self, median_ratio: Option<f64>) -> f64 {
        match median_ratio {
            Some(median) if self.known() && median > 0.0 => {
                let relative = (self.ratio / median).clamp(RELATIVE_RANGE.0, RELATIVE_RANGE.1);
                if (relative - 1.0).abs() < SAME_SPEED {
                    1.0
                } else {
                    relative
                }
            }
            _ => 1.0,
        }
    }
}

/// The ratio of the pool's median worker among `speeds`, if any is known. A worker not known
/// yet counts as the pool's answers so far say a worker is (all workers' ratios, each weighing
/// as its answers: what the model's error is for cold prompts): with three workers, one known
/// slow and one known normal, the median is the normal one's, not the slow one's, and a worker
/// does not take the pool's traffic for being faster than the only other one known. With an
/// even count, the geometric mean of the middle two.
pub fn median_ratio(speeds: &[Speed]) -> Option<f64> {
    if !speeds.iter().any(Speed::known) {
        return None;
    }
    let pool = combined(speeds.iter().copied()).map_or(1.0, |s| s.ratio);
    let mut ratios: Vec<f64> = speeds
        .iter()
        .map(|s| if s.known() { s.ratio } else { pool })
        .collect();
    ratios.sort_by(f64::total_cmp);
    median(&ratios)
}

/// The median of sorted positive `ratios` (of an even count, the geometric mean of the middle
/// two); `None` when empty.
fn median(ratios: &[f64]) -> Option<f64> {
    let upper = ratios.len() / 2;
    let lower = ratios.len().saturating_sub(1) / 2;
    match (ratios.get(lower), ratios.get(upper)) {
        (Some(a), Some(b)) => Some((a * b).sqrt()),
        _ => None,
    }
}

/// Speeds of one worker learned from different answers (several gateway replicas' each) as
/// one: the geometric mean of their ratios, each weighing as its observations (at most as many
/// as its median remembers, [`RECENT_RATIOS`]), the observations summed; the first's last
/// request. `None` only when given none.
pub fn combined(speeds: impl IntoIterator<Item = Speed>) -> Option<Speed> {
    let memory = RECENT_RATIOS as u64;
    let mut first: Option<Speed> = None;
    let (mut weighted, mut weights, mut observations) = (0.0, 0.0, 0u64);
    for speed in speeds {
        first.get_or_insert(speed);
        if speed.observations == 0 || !(speed.ratio.is_finite() && speed.ratio > 0.0) {
            continue;
        }
        let weight = speed.observations.min(memory) as f64;
        weighted += weight * speed.ratio.clamp(0.05, 20.0).ln();
        weights += weight;
        observations = observations.saturating_add(speed.observations);
    }
    let first = first?;
    if weights == 0.0 {
        return Some(first);
    }
    Some(Speed {
        ratio: (weighted / weights).exp(),
        observations,
        last: first.last,
    })
}

/// One worker's calibration: what this replica learned from its answers, and what the other
/// gateway replicas learned from theirs ([`crate::peers`]).
#[derive(Debug, Default)]
pub struct TtftCalibration {
    own: Mutex<Answers>,
    /// One per other replica that has learned the worker.
    peers: Mutex<Vec<Speed>>,
}

/// The answers a worker's speed is learned from.
#[derive(Debug, Default)]
struct Answers {
    /// The latest [`RECENT_RATIOS`] that qualified: (the request's own prefill, running
    /// requests, seconds to the first token).
    recent: VecDeque<(PrefillWork, f64, f64)>,
    /// How many qualified, ever.
    observations: u64,
    /// The last streamed request's predicted and observed seconds, qualified or not.
    last: Option<(f64, f64)>,
}

impl TtftCalibration {
    /// The worker's speed against the pool's `model` as it is now, from every replica's
    /// answers: with two replicas each sees half of them, and alone would take twice as long
    /// to learn a slow worker.
    pub fn speed(&self, model: &Coefficients) -> Speed {
        let own = self.own(model);
        let peers = crate::lock(&self.peers);
        if peers.is_empty() {
            return own;
        }
        combined(std::iter::once(own).chain(peers.iter().copied())).unwrap_or(own)
    }

    /// What this replica learned from its own answers (what it tells the others): the median
    /// of their ratios to what `model` predicts for them. Every worker is measured against the
    /// same model, the pool's current one, whenever its answers came: a model that was 5x off
    /// at first would otherwise leave the workers measured then looking 5x slower than those
    /// measured later (and, avoided for it, never measured again).
    pub fn own(&self, model: &Coefficients) -> Speed {
        let answers = crate::lock(&self.own);
        let mut ratios: Vec<f64> = answers
            .recent
            .iter()
            .filter_map(|&(prefill, running, observed_s)| {
                let predicted = model.predict(prefill, running);
                (predicted > 0.0).then(|| (observed_s / predicted).clamp(0.05, 20.0))
            })
            .collect();
        ratios.sort_by(f64::total_cmp);
        Speed {
            ratio: median(&ratios).unwrap_or(1.0),
            observations: answers.observations,
            last: answers.last,
        }
    }

    /// What each of the other replicas learned (replacing what they said before).
    pub(crate) fn set_peers(&self, mut peers: Vec<Speed>) {
        peers.retain(|p| p.observations > 0);
        *crate::lock(&self.peers) = peers;
    }

    /// Learn from one streamed answer, judged by the pool's `model` as it is now.
    pub fn observe(&self, answer: SpeedAnswer, model: &Coefficients) {
        let SpeedAnswer {
            predicted_s,
            queued_tokens,
            own_prefill,
            running,
            observed_s,
        } = answer;
        if !(predicted_s.is_finite() && observed_s.is_finite()) || observed_s <= 0.0 {
            return;
        }
        let mut answers = crate::lock(&self.own);
        answers.last = Some((predicted_s, observed_s));
        let running = running as f64;
        let own_prefill_s = model.prefill_s(own_prefill);
        let mostly_own_prefill = own_prefill_s > 0.0
            && own_prefill_s >= MIN_PREFILL_SHARE * model.predict(own_prefill, running);
        if queued_tokens > 0 || observed_s < MIN_OBSERVED_S || !mostly_own_prefill {
            return;
        }
        if answers.recent.len() == RECENT_RATIOS {
            answers.recent.pop_front();
        }
        answers.recent.push_back((own_prefill, running, observed_s));
        answers.observations += 1;
    }
}

/// One streamed answer, as a worker's speed learns from it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpeedAnswer {
    /// What the scorer predicted for it, before the worker's speed (shown as its last answer).
    pub predicted_s: f64,
    /// Prefill tokens predicted to be queued ahead of the request.
    pub queued_tokens: usize,
    /// The request's own prefill: its uncached prompt tokens after its cached ones, as the
    /// worker counted them when it reports cached tokens, else as the prefix index predicted.
    pub own_prefill: PrefillWork,
    /// Requests running on the worker at the decision.
    pub running: u64,
    /// Seconds from sending the request to its first token.
    pub observed_s: f64,
}

/// Prefill work: the prompt tokens a worker computes, and the (query, key) pairs of their
/// attention. A chunk of `n` tokens after `c` tokens of context attends to `n × c + n(n+1)/2`
/// pairs: a token's weights cost the same wherever it sits, its attention grows with the
/// context before it (on a ~27B model with FP8 weights a cold 25k-token prompt spends about 40%
/// of its prefill in attention, a 1k-token one 2–3%).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefillWork {
    pub tokens: f64,
    pub pairs: f64,
}

impl PrefillWork {
    /// `tokens` prefilled after `context` tokens already computed (cached).
    pub fn after(context: usize, tokens: usize) -> PrefillWork {
        let (context, tokens) = (context as f64, tokens as f64);
        PrefillWork {
            tokens,
            pairs: tokens * context + tokens * (tokens + 1.0) / 2.0,
        }
    }

    /// `tokens` whose attention is `pairs_per_token` pairs each, on average.
    pub fn at(tokens: usize, pairs_per_token: f64) -> PrefillWork {
        let tokens = tokens as f64;
        PrefillWork {
            tokens,
            pairs: tokens * pairs_per_token.max(0.0),
        }
    }

    pub fn plus(self, other: PrefillWork) -> PrefillWork {
        PrefillWork {
            tokens: self.tokens + other.tokens,
            pairs: self.pairs + other.pairs,
        }
    }

    /// This work less `other` (a part of it), never below nothing.
    pub fn less(self, other: PrefillWork) -> PrefillWork {
        PrefillWork {
            tokens: (self.tokens - other.tokens).max(0.0),
            pairs: (self.pairs - other.pairs).max(0.0),
        }
    }

    /// Pairs per token (0 for no tokens).
    pub fn pairs_per_token(&self) -> f64 {
        if self.tokens > 0.0 {
            self.pairs / self.tokens
        } else {
            0.0
        }
    }
}

/// The pool's TTFT model, in seconds: `fixed + prefill × tokens + attention × pairs + running ×
/// requests`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Coefficients {
    /// Time every first token takes (a scheduler step, sampling, the network).
    pub fixed_s: f64,
    /// Per prompt token prefilled ahead of and for the request (its weights' GEMMs).
    pub prefill_s_per_token: f64,
    /// Per (query, key) pair of that prefill's attention ([`PrefillWork`]).
    pub attention_s_per_pair: f64,
    /// Per request already running on the worker (decode steps share the batch).
    pub running_s_per_request: f64,
}

impl Coefficients {
    /// The pool's configured coefficients (no fixed part). Attention is configured as the
    /// context at which a token's attention takes as long as its weights
    /// (`scoring.attentionContextTokens`; 0: not modelled).
    pub fn configured(scoring: &Scoring) -> Coefficients {
        let prefill_s_per_token = f64::from(scoring.prefill_micros_per_token) / 1e6;
        let attention_s_per_pair = match scoring.attention_context_tokens {
            0 => 0.0,
            context => prefill_s_per_token / f64::from(context),
        };
        Coefficients {
            fixed_s: 0.0,
            prefill_s_per_token,
            attention_s_per_pair,
            running_s_per_request: f64::from(scoring.running_request_micros) / 1e6,
        }
    }

    /// The predicted time to first token behind `prefill` (queued and the request's own) with
    /// `running` requests running.
    pub fn predict(&self, prefill: PrefillWork, running: f64) -> f64 {
        self.fixed_s + self.prefill_s(prefill) + self.running_s_per_request * running
    }

    /// The time `work` takes to prefill.
    pub fn prefill_s(&self, work: PrefillWork) -> f64 {
        self.prefill_s_per_token * work.tokens + self.attention_s_per_pair * work.pairs
    }

    /// As the filter's state: features are scaled (thousands of tokens, ten millions of pairs,
    /// tens of requests) so the coefficients are of similar size.
    fn to_state(self) -> [f64; FEATURES] {
        [
            self.fixed_s,
            self.prefill_s_per_token * TOKEN_UNIT,
            self.attention_s_per_pair * PAIR_UNIT,
            self.running_s_per_request * RUNNING_UNIT,
        ]
    }

    fn from_state(state: [f64; FEATURES]) -> Coefficients {
        let [fixed, prefill, attention, running] = state;
        Coefficients {
            fixed_s: fixed,
            prefill_s_per_token: prefill / TOKEN_UNIT,
            attention_s_per_pair: attention / PAIR_UNIT,
            running_s_per_request: running / RUNNING_UNIT,
        }
    }
}

/// The model's features: fixed, prefill tokens, attention pairs, running requests.
const FEATURES: usize = 4;
/// Units of the filter's features.
const TOKEN_UNIT: f64 = 1000.0;
const PAIR_UNIT: f64 = 1e7;
const RUNNING_UNIT: f64 = 10.0;
/// Prior standard deviation of the fixed part (seconds); the others' is their configured value
/// (a 2x error is one standard deviation away).
const FIXED_PRIOR_S: f64 = 0.02;
/// Learned coefficients stay within this factor of the configured ones.
pub const COEFFICIENT_RANGE: f64 = 8.0;
/// Relative standard deviation of one observation around the model, and its floor in seconds.
const OBSERVATION_ERROR: f64 = 0.2;
const OBSERVATION_FLOOR_S: f64 = 0.01;
/// Process noise per observation, as a fraction of the prior standard deviation: the model
/// keeps following a fleet that changes (after 1,000 answers the coefficients may have walked
/// about a third of their prior spread).
const DRIFT: f64 = 0.01;
/// An observation counts for at most this many standard deviations of its innovation.
const OUTLIER_SIGMAS: f64 = 3.0;
/// Weight of a new observation in the typical error.
const ERROR_RATE: f64 = 0.05;
/// An answer counts in the error spread and bias as at most this many times off the bias (the
/// filter's outlier rule, for the statistics the scorer's ties and its seconds-to-tokens use).
const OUTLIER_RATIO: f64 = 3.0;

/// What the pool has learned.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fit {
    pub configured: Coefficients,
    pub learned: Coefficients,
    /// Answers learned from.
    pub observations: u64,
    /// Typical relative error of the predictions (mean |ln(observed / predicted)|, each taken
    /// before the observation taught the model); `None` before the first.
    pub error: Option<f64>,
    /// The part of that error the model's predictions share now: mean ln(observed /
    /// predicted), less what the model has learned since (each update's move of the answer's
    /// prediction). A scale all workers share does not change which is best, only how much
    /// work a second of the worker's time is (`exp(bias)` times the model's).
    pub bias: Option<f64>,
    /// The part that differs from one prediction to the next: mean |ln(observed / predicted)
    /// − bias|, each at most ln 3, what can reorder two workers.
    pub spread: Option<f64>,
}

/// One streamed answer, as the pool's model sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Observation {
    /// What the worker prefilled before this request's first token: the queue ahead of it and
    /// its own uncached prompt.
    pub prefill: PrefillWork,
    /// Requests running on the worker when it was chosen.
    pub running: f64,
    /// Seconds to the first token, divided by the worker's relative speed (the pool's model
    /// describes its median worker).
    pub ttft_s: f64,
}

#[derive(Debug, Clone)]
struct FilterState {
    configured: Coefficients,
    mean: [f64; FEATURES],
    covariance: [[f64; FEATURES]; FEATURES],
    prior_sd: [f64; FEATURES],
    observations: u64,
    error: Option<f64>,
    bias: Option<f64>,
    spread: Option<f64>,
}

impl FilterState {
    fn new(configured: Coefficients) -> FilterState {
        let mean = configured.to_state();
        let [_, prefill, attention, running] = mean;
        let prior_sd = [
            FIXED_PRIOR_S,
            prefill.max(1e-3),
            attention.max(1e-3),
            running.max(1e-3),
        ];
        let mut covariance = [[0.0; FEATURES]; FEATURES];
        add_to_diagonal(&mut covariance, prior_sd.map(|sd| sd * sd));
        FilterState {
            configured,
            mean,
            covariance,
            prior_sd,
            observations: 0,
            error: None,
            bias: None,
            spread: None,
        }
    }

    fn fit(&self) -> Fit {
        Fit {
            configured: self.configured,
            learned: Coefficients::from_state(self.mean),
            observations: self.observations,
            error: self.error,
            bias: self.bias,
            spread: self.spread,
        }
    }

    fn update(&mut self, observation: &Observation) {
        let x = [
            1.0,
            observation.prefill.tokens / TOKEN_UNIT,
            observation.prefill.pairs / PAIR_UNIT,
            observation.running / RUNNING_UNIT,
        ];
        let y = observation.ttft_s;
        let dot = |a: &[f64; FEATURES], b: &[f64; FEATURES]| {
            a.iter().zip(b).map(|(a, b)| a * b).sum::<f64>()
        };
        add_to_diagonal(
            &mut self.covariance,
            self.prior_sd.map(|sd| (DRIFT * sd).powi(2)),
        );
        let predicted = dot(&self.mean, &x);
        let ratio = (predicted > OBSERVATION_FLOOR_S / 10.0).then(|| (y / predicted).ln());
        let px = self.covariance.map(|row| dot(&row, &x));
        let noise = (OBSERVATION_ERROR * predicted.max(OBSERVATION_FLOOR_S)).powi(2);
        let innovation_variance = dot(&x, &px) + noise;
        let bound = OUTLIER_SIGMAS * innovation_variance.sqrt();
        let innovation = (y - predicted).clamp(-bound, bound);
        let gain = px.map(|p| p / innovation_variance);
        for (m, k) in self.mean.iter_mut().zip(gain) {
            *m += k * innovation;
        }
        for (row, k) in self.covariance.iter_mut().zip(gain) {
            for (cell, p) in row.iter_mut().zip(px) {
                *cell -= k * p;
            }
        }
        // Within the plausible range of the configuration (attention configured as none stays
        // none).
        let [
            _,
            configured_prefill,
            configured_attention,
            configured_running,
        ] = self.configured.to_state();
        let [fixed, prefill, attention, running] = &mut self.mean;
        *fixed = fixed.clamp(0.0, 1.0);
        *prefill = prefill.clamp(
            configured_prefill / COEFFICIENT_RANGE,
            (configured_prefill * COEFFICIENT_RANGE).max(1e-3),
        );
        *attention = attention.clamp(
            configured_attention / COEFFICIENT_RANGE,
            configured_attention * COEFFICIENT_RANGE,
        );
        *running = running.clamp(0.0, (configured_running * COEFFICIENT_RANGE).max(1e-2));
        self.observations += 1;
        if let Some(ratio) = ratio {
            self.learn_error(ratio, (dot(&self.mean, &x) / predicted).ln());
        }
    }

    /// Learn the model's error from one answer's `ratio`, ln(observed / predicted) before the
    /// update, given that the update moved this answer's prediction by `moved` (ln(after /
    /// before)).
    fn learn_error(&mut self, ratio: f64, moved: f64) {
        let average = |last: Option<f64>, value: f64| match last {
            None => value,
            Some(last) => last + ERROR_RATE * (value - last),
        };
        self.error = Some(average(self.error, ratio.abs()));
        // The bias is the error the model's predictions share *now*: the first answer's ratio
        // (as far as the coefficients' range allows), then each answer's deviation from it,
        // clipped like an outlier; and whatever the update just moved the model by is no longer
        // an error of it (the filter learns a shared scale within a few answers, and a bias
        // remembered from before would correct it twice).
        let range = COEFFICIENT_RANGE.ln();
        let (bias, off) = match self.bias {
            None => (ratio.clamp(-range, range), 0.0),
            Some(bias) => {
                let off = (ratio - bias).clamp(-OUTLIER_RATIO.ln(), OUTLIER_RATIO.ln());
                (bias + ERROR_RATE * off, off)
            }
        };
        self.spread = Some(average(self.spread, off.abs()));
        let moved = if moved.is_finite() { moved } else { 0.0 };
        self.bias = Some((bias - moved).clamp(-range, range));
    }
}

/// Add `values` to the diagonal of `matrix`.
fn add_to_diagonal(matrix: &mut [[f64; FEATURES]; FEATURES], values: [f64; FEATURES]) {
    for (i, (row, value)) in matrix.iter_mut().zip(values).enumerate() {
        if let Some(cell) = row.get_mut(i) {
            *cell += value;
        }
    }
}

/// This replica's latest observations a pool keeps for the other replicas: every ledger
/// datagram carries them all, so one lost is repaired by the next.
pub const SHARED_OBSERVATIONS: usize = 16;

/// The pool's coefficients, learned from its answers (and, behind several gateway replicas,
/// from theirs: [`crate::peers`]). Starts (and starts over when the configuration changes)
/// from the configured ones.
#[derive(Debug, Default)]
pub struct PoolCalibration {
    state: Mutex<Option<FilterState>>,
    /// This replica's latest observations, numbered from 1, for the other replicas.
    recent: Mutex<(u64, std::collections::VecDeque<(u64, Observation)>)>,
}

impl PoolCalibration {
    /// What the pool has learned, for a pool configured with `configured`.
    pub fn fit(&self, configured: Coefficients) -> Fit {
        match &*crate::lock(&self.state) {
            Some(state) if state.configured == configured => state.fit(),
            _ => FilterState::new(configured).fit(),
        }
    }

    /// Learn from one answer of this replica's.
    pub fn observe(&self, configured: Coefficients, observation: &Observation) {
        if self.learn(configured, observation) {
            let mut recent = crate::lock(&self.recent);
            let (last, observations) = &mut *recent;
            *last += 1;
            observations.push_back((*last, *observation));
            while observations.len() > SHARED_OBSERVATIONS {
                observations.pop_front();
            }
        }
    }

    /// Learn from an answer another replica observed (not passed on: each replica tells only
    /// its own).
    pub fn observe_peer(&self, configured: Coefficients, observation: &Observation) {
        self.learn(configured, observation);
    }

    /// This replica's latest observations, numbered (increasing).
    pub fn recent(&self) -> Vec<(u64, Observation)> {
        crate::lock(&self.recent).1.iter().copied().collect()
    }

    /// Update the model with `observation`; false when it says nothing (not finite, no time).
    fn learn(&self, configured: Coefficients, observation: &Observation) -> bool {
        let usable = [
            observation.prefill.tokens,
            observation.prefill.pairs,
            observation.running,
            observation.ttft_s,
        ]
        .iter()
        .all(|v| v.is_finite() && *v >= 0.0)
            && observation.ttft_s > 0.0;
        if !usable {
            return false;
        }
        let mut state = crate::lock(&self.state);
        let state = match &mut *state {
            Some(state) if state.configured == configured => state,
            other => other.insert(FilterState::new(configured)),
        };
        state.update(observation);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The model the workers' tests are measured against: 1 ms a prompt token, 10 ms a running
    /// request (no attention: a speed is a ratio, whatever the model's terms).
    const MODEL: Coefficients = Coefficients {
        fixed_s: 0.0,
        prefill_s_per_token: 1e-3,
        attention_s_per_pair: 0.0,
        running_s_per_request: 1e-2,
    };

    /// A cold prompt of `tokens`, nothing queued ahead or running, answered in `observed_s`.
    fn answer(tokens: usize, observed_s: f64) -> SpeedAnswer {
        SpeedAnswer {
            predicted_s: MODEL.predict(PrefillWork::after(0, tokens), 0.0),
            queued_tokens: 0,
            own_prefill: PrefillWork::after(0, tokens),
            running: 0,
            observed_s,
        }
    }

    #[test]
    fn starts_as_the_formula_and_skips_what_says_nothing_about_speed() {
        let calibration = TtftCalibration::default();
        // Faster than the network's jitter; mostly a cached prompt among many running (the
        // step it waited for, the batch it joined); behind a queue (how much of it the
        // worker's batches overlap is the model's error there: a busy worker would look faster
        // for it); nothing to prefill; nonsense.
        calibration.observe(answer(3, 0.004), &MODEL);
        let cached = SpeedAnswer {
            running: 20,
            ..answer(80, 0.6)
        };
        calibration.observe(cached, &MODEL);
        let queued = SpeedAnswer {
            queued_tokens: 1_000,
            ..answer(300, 0.2)
        };
        calibration.observe(queued, &MODEL);
        calibration.observe(answer(0, 0.05), &MODEL);
        calibration.observe(answer(100, f64::NAN), &MODEL);
        let speed = calibration.speed(&MODEL);
        assert_eq!((speed.ratio, speed.observations), (1.0, 0));
        assert_eq!(
            speed.last,
            Some((0.0, 0.05)),
            "the last is shown all the same"
        );
        assert_eq!(speed.relative_to(Some(2.0)), 1.0);
        // A prefill of 20 ms counts as one of 2 s does: the rule is relative, not a duration.
        calibration.observe(answer(20, 0.03), &MODEL);
        calibration.observe(answer(2_000, 3.0), &MODEL);
        let speed = calibration.speed(&MODEL);
        assert_eq!(speed.observations, 2);
        assert!((speed.ratio - 1.5).abs() < 1e-9, "{}", speed.ratio);
        // Against the model as it is now: once the pool's model has learned that prompts take
        // 1.5 ms a token, this worker is as fast as predicted.
        let learned = Coefficients {
            prefill_s_per_token: 1.5e-3,
            ..MODEL
        };
        assert!((calibration.speed(&learned).ratio - 1.0).abs() < 1e-9);
        // A model that predicts nothing for them leaves them out rather than counting as 1.
        let nothing = Coefficients {
            prefill_s_per_token: 0.0,
            ..MODEL
        };
        assert_eq!(calibration.speed(&nothing).ratio, 1.0);
    }

    #[test]
    fn a_speed_is_the_median_of_the_latest_answers() {
        let calibration = TtftCalibration::default();
        let ratio = |calibration: &TtftCalibration| calibration.speed(&MODEL).ratio;
        // One answer that waited out a long step does not make the worker slow.
        for observed in [1.2, 1.1, 4.0, 1.3, 1.2] {
            calibration.observe(answer(1_000, observed), &MODEL);
        }
        assert!((ratio(&calibration) - 1.2).abs() < 1e-9);
        assert!(
            !calibration.speed(&MODEL).known(),
            "five answers are not yet a speed"
        );
        // An even count: the geometric mean of the middle two.
        calibration.observe(answer(1_000, 1.5), &MODEL);
        assert!((ratio(&calibration) - (1.2f64 * 1.3).sqrt()).abs() < 1e-9);
        // The worker slows down: once most of its latest nine say so, so does its speed.
        for _ in 0..5 {
            calibration.observe(answer(1_000, 2.0), &MODEL);
        }
        assert_eq!(ratio(&calibration), 2.0);
        assert_eq!(calibration.speed(&MODEL).observations, 11);
        assert!(calibration.speed(&MODEL).known());
    }

    #[test]
    fn a_pool_keeps_its_latest_answers_for_the_other_replicas_and_learns_theirs() {
        let configured = Coefficients {
            fixed_s: 0.0,
            prefill_s_per_token: 1e-4,
            attention_s_per_pair: 1e-8,
            running_s_per_request: 1e-3,
        };
        let answer = |ttft_s| Observation {
            prefill: PrefillWork::after(0, 1_000),
            running: 2.0,
            ttft_s,
        };
        let (own, told) = (PoolCalibration::default(), PoolCalibration::default());
        for i in 0..(SHARED_OBSERVATIONS + 4) {
            own.observe(configured, &answer(0.2 + i as f64 / 100.0));
        }
        own.observe(configured, &answer(f64::NAN));
        let recent = own.recent();
        assert_eq!(recent.len(), SHARED_OBSERVATIONS);
        assert_eq!(recent.first().map(|(n, _)| *n), Some(5));
        assert_eq!(recent.last().map(|(n, _)| *n), Some(20));
        // Another replica's answers teach as its own would, and are not passed on.
        for (_, observation) in &recent {
            told.observe_peer(configured, observation);
        }
        assert!(told.recent().is_empty());
        let (a, b) = (own.fit(configured), told.fit(configured));
        assert!(b.learned != configured, "learned nothing");
        assert!(a.learned.prefill_s_per_token > configured.prefill_s_per_token);
        assert!(b.learned.prefill_s_per_token > configured.prefill_s_per_token);
    }

    #[test]
    fn a_replica_learns_a_worker_from_the_other_replicas_answers_too() {
        // Each of two replicas sees five of a worker 1.5x slower than predicted: neither
        // knows it alone (nine observations are needed), together they do.
        let (one, two) = (TtftCalibration::default(), TtftCalibration::default());
        for _ in 0..5 {
            one.observe(answer(500, 0.75), &MODEL);
            two.observe(answer(1_000, 1.5), &MODEL);
        }
        assert!(!one.speed(&MODEL).known());
        one.set_peers(vec![two.own(&MODEL)]);
        let speed = one.speed(&MODEL);
        assert!(speed.known());
        assert!((speed.ratio - 1.5).abs() < 1e-9, "{}", speed.ratio);
        assert_eq!(
            speed.last,
            Some((0.5, 0.75)),
            "this replica's own last request"
        );
        // What it tells the others is its own alone (no echo of theirs).
        assert_eq!(one.own(&MODEL).observations, 5);

        // Weighed by observations, each at most as many as its median remembers (nine).
        let ratio = |ratio, observations| Speed {
            ratio,
            observations,
            last: None,
        };
        let both = combined([ratio(2.0, 30), ratio(1.0, 10)]).unwrap();
        assert!((both.ratio - 2f64.sqrt()).abs() < 1e-9, "{}", both.ratio);
        assert_eq!(both.observations, 40);
        let skewed = combined([ratio(2.0, 5), ratio(1.0, 10)]).unwrap();
        assert!((skewed.ratio - 2f64.powf(5.0 / 14.0)).abs() < 1e-9);
        // Nothing learned, or nonsense from a peer, changes nothing.
        assert_eq!(
            combined([ratio(1.2, 6), ratio(f64::NAN, 9)]).unwrap().ratio,
            1.2
        );
        assert_eq!(combined([ratio(1.0, 0)]).unwrap().observations, 0);
        assert_eq!(combined([]), None);
        // A third replica: each weighs as its own observations, not the others' summed.
        let three = TtftCalibration::default();
        for _ in 0..10 {
            three.observe(answer(1_000, 1.0), &MODEL);
        }
        one.set_peers(vec![two.own(&MODEL), three.own(&MODEL)]);
        let expected = (1.5f64.ln() * 10.0 / 19.0).exp();
        assert!((one.speed(&MODEL).ratio - expected).abs() < 1e-9);
        one.set_peers(Vec::new());
        assert_eq!(one.speed(&MODEL), one.own(&MODEL));
    }

    #[test]
    fn a_slow_worker_stands_out_and_a_shared_error_cancels() {
        // The coefficients are 2x off for everyone, and the third worker is 1.5x slower still.
        let workers: Vec<TtftCalibration> = (0..3).map(|_| TtftCalibration::default()).collect();
        let mut seed = 1u64;
        for _ in 0..60 {
            for (i, worker) in workers.iter().enumerate() {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let tokens = 100 + (seed >> 54) as usize;
                let noise = 0.9 + 0.2 * ((seed >> 20) & 0xff) as f64 / 255.0;
                let slow = if i == 2 { 1.5 } else { 1.0 };
                let truth = 2.0 * slow * MODEL.predict(PrefillWork::after(0, tokens), 0.0) * noise;
                worker.observe(answer(tokens, truth), &MODEL);
            }
        }
        let speeds: Vec<Speed> = workers.iter().map(|w| w.speed(&MODEL)).collect();
        let median = median_ratio(&speeds);
        let relative: Vec<f64> = workers
            .iter()
            .map(|w| w.speed(&MODEL).relative_to(median))
            .collect();
        assert_eq!((relative[0], relative[1]), (1.0, 1.0));
        assert!((relative[2] - 1.5).abs() < 0.15, "{relative:?}");
    }

    #[test]
    fn a_worker_not_known_yet_counts_as_the_pools_answers_say() {
        let speed = |ratio, observations| Speed {
            ratio,
            observations,
            last: None,
        };
        // The model predicts every cold prompt at a fifth of its time (configured 5x off, not
        // learning): a known worker at 5 is as fast as the two the pool has barely heard from,
        // not 5x slower than them.
        let speeds = [speed(5.0, 9), speed(5.2, 2), speed(4.8, 1)];
        let median = median_ratio(&speeds);
        assert_eq!(speeds[0].relative_to(median), 1.0);
        // One known slow, one known normal, one not known: the median is near the normal one
        // (the pool's answers, the slow worker's among them, put the unknown one at 1.20), so
        // the slow one is slow and the normal one not fast (with the known workers' median
        // alone it was 0.67, and drew the pool's traffic).
        let speeds = [speed(1.5, 9), speed(1.0, 12), speed(1.0, 2)];
        let median = median_ratio(&speeds);
        let slow = speeds[0].relative_to(median);
        assert!((1.2..1.5).contains(&slow), "{slow} against {median:?}");
        assert_eq!(speeds[1].relative_to(median), 1.0);
        // Nobody known: no median.
        assert_eq!(median_ratio(&[speed(2.0, 4), Speed::default()]), None);
    }

    /// Answers of a worker whose true model is `truth`, in a mix of queues, prompts (up to 4,000
    /// new tokens after up to `context` cached ones) and running batches, with ±10% noise.
    fn answers(
        truth: Coefficients,
        count: usize,
        context: f64,
        seed: &mut u64,
    ) -> Vec<Observation> {
        let mut next = || {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (*seed >> 11) as f64 / (1u64 << 53) as f64
        };
        (0..count)
            .map(|_| {
                let tokens = (4000.0 * next() * next()) as usize;
                let context = if context > 0.0 {
                    (context * next()) as usize
                } else {
                    0
                };
                let prefill = PrefillWork::after(context, tokens);
                let running = (20.0 * next()).floor();
                let noise = 0.9 + 0.2 * next();
                Observation {
                    prefill,
                    running,
                    ttft_s: truth.predict(prefill, running) * noise,
                }
            })
            .collect()
    }

    #[test]
    fn coefficients_2x_off_are_learned_from_a_minute_of_answers() {
        let scoring = Scoring {
            prefill_micros_per_token: 600,
            running_request_micros: 1000,
            attention_context_tokens: 20_000,
            ..Scoring::default()
        };
        let configured = Coefficients::configured(&scoring);
        let truth = Coefficients {
            fixed_s: 0.02,
            prefill_s_per_token: 300e-6,
            attention_s_per_pair: 300e-6 / 20_000.0,
            running_s_per_request: 500e-6,
        };
        let pool = PoolCalibration::default();
        assert_eq!(pool.fit(configured).learned, configured);
        assert_eq!(pool.fit(configured).error, None);
        // A minute at two answers a second.
        let mut seed = 7;
        let before: f64 = answers(truth, 20, 24_000.0, &mut seed)
            .iter()
            .map(|o| {
                (configured.predict(o.prefill, o.running) / o.ttft_s)
                    .ln()
                    .abs()
            })
            .sum::<f64>()
            / 20.0;
        for observation in answers(truth, 120, 24_000.0, &mut seed) {
            pool.observe(configured, &observation);
        }
        let fit = pool.fit(configured);
        assert_eq!(fit.observations, 120);
        let learned = fit.learned;
        let close = |a: f64, b: f64, within: f64| (a / b - 1.0).abs() < within;
        assert!(
            close(learned.prefill_s_per_token, truth.prefill_s_per_token, 0.1),
            "{learned:?}"
        );
        assert!(
            close(
                learned.attention_s_per_pair,
                truth.attention_s_per_pair,
                0.2
            ),
            "{learned:?}"
        );
        assert!(
            close(
                learned.running_s_per_request,
                truth.running_s_per_request,
                0.5
            ),
            "{learned:?}"
        );
        // The predictions' error came down from the configuration's (~2x, ln 2 = 0.69) to about
        // the noise.
        let error = fit.error.unwrap();
        assert!(
            before > 0.5 && error < 0.2,
            "before {before}, after {error}"
        );
        // A new configuration starts over from itself.
        let other = Coefficients::configured(&Scoring::default());
        assert_eq!(pool.fit(other).observations, 0);
    }

    #[test]
    fn a_shared_scale_is_bias_and_what_reorders_is_spread() {
        let configured = Coefficients::configured(&Scoring::default());
        // Five times faster than configured, exactly: the first answers are all off by the same
        // factor, which says how long a token takes, not which worker is best.
        let scaled = PoolCalibration::default();
        let mut seed = 5;
        for mut observation in answers(configured, 10, 0.0, &mut seed) {
            observation.ttft_s = configured.predict(observation.prefill, observation.running) / 5.0;
            scaled.observe(configured, &observation);
        }
        let fit = scaled.fit(configured);
        let (error, bias, spread) = (fit.error.unwrap(), fit.bias.unwrap(), fit.spread.unwrap());
        assert!(error > 0.8, "{fit:?}");
        assert!(spread < error / 2.0, "{fit:?}");
        // The filter has learned most of the scale; the bias is what its predictions still
        // miss, not the first answers' miss counted again.
        for tokens in [500, 2000, 8000] {
            let prefill = PrefillWork::after(0, tokens);
            let truth = configured.predict(prefill, 2.0) / 5.0;
            let scaled_prediction = fit.learned.predict(prefill, 2.0) * bias.exp();
            let off = scaled_prediction / truth;
            assert!(off > 0.8 && off < 1.25, "{tokens}: {off} {fit:?}");
        }
        // Right on average but ±30% from one answer to the next: no bias, all spread.
        let noisy = PoolCalibration::default();
        for (i, mut observation) in answers(configured, 40, 0.0, &mut seed)
            .into_iter()
            .enumerate()
        {
            let noise = if i % 2 == 0 { 1.3 } else { 1.0 / 1.3 };
            observation.ttft_s =
                configured.predict(observation.prefill, observation.running) * noise;
            noisy.observe(configured, &observation);
        }
        let fit = noisy.fit(configured);
        assert!(fit.bias.unwrap().abs() < 0.1, "{fit:?}");
        assert!(fit.spread.unwrap() > 0.15, "{fit:?}");
    }

    #[test]
    fn outliers_and_nonsense_do_not_throw_the_model() {
        let configured = Coefficients::configured(&Scoring::default());
        let pool = PoolCalibration::default();
        let mut seed = 3;
        for (i, mut observation) in answers(configured, 200, 0.0, &mut seed)
            .into_iter()
            .enumerate()
        {
            // Every tenth answer stalled for 30 s (a preemption, a slow client connection).
            if i % 10 == 0 {
                observation.ttft_s += 30.0;
            }
            pool.observe(configured, &observation);
        }
        pool.observe(
            configured,
            &Observation {
                prefill: PrefillWork {
                    tokens: f64::NAN,
                    pairs: 0.0,
                },
                running: 1.0,
                ttft_s: 1.0,
            },
        );
        pool.observe(
            configured,
            &Observation {
                prefill: PrefillWork::after(0, 10),
                running: 1.0,
                ttft_s: -1.0,
            },
        );
        let fit = pool.fit(configured);
        assert_eq!(fit.observations, 200);
        let ratio = fit.learned.prefill_s_per_token / configured.prefill_s_per_token;
        assert!((0.8..1.6).contains(&ratio), "{fit:?}");
        assert!(fit.learned.fixed_s < 0.5, "{fit:?}");
        // Nor its error statistics: a stalled answer counts as three times off, not thirty.
        let (bias, spread) = (fit.bias.unwrap(), fit.spread.unwrap());
        assert!(bias.abs() < 0.3 && spread < 0.3, "{fit:?}");
    }
}
