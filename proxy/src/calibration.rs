//! The TTFT model, learned online: the pool's coefficients and each worker's speed.
//!
//! **The pool's coefficients** ([`PoolCalibration`]). The scorer predicts a worker's time to
//! first token as `fixed + prefill × tokens + running × requests` ([`Coefficients`]); the
//! configured values (`scoring.prefillMicrosPerToken`, `runningRequestMicros`) are where the
//! model starts, not what it keeps. Every streamed answer is one observation: the tokens the
//! request waited for (the prefill queued ahead of it at the decision, plus its own uncached
//! prompt as the worker reported it, `prompt_tokens` less `prompt_tokens_details.cached_tokens`,
//! or as the prefix index predicted it when the worker does not report details), the requests
//! running there, and the time the first token took. A Kalman filter over the three
//! coefficients (a Bayesian linear regression whose prior is the configuration, with a little
//! process noise so it follows a fleet that changes) learns them: with coefficients 2x off, a
//! few dozen answers are enough. Each observation's error is relative (a 50 ms miss matters
//! on a 100 ms prediction, not on a 5 s one), outliers (a preemption, a stalled connection)
//! count for at most three standard deviations, and the coefficients stay within a factor of
//! [`COEFFICIENT_RANGE`] of the configuration. The typical relative error of the predictions,
//! measured before each update, is kept too: `/debug/route` and `/metrics` show it beside the
//! coefficients.
//!
//! **Each worker's speed** ([`TtftCalibration`]). A real fleet is heterogeneous (another GPU,
//! a thermally throttled card, a worker sharing its node). Each worker therefore keeps the
//! ratio of its observed time to first token (from sending a streamed request to its first
//! body chunk) over the model's prediction at that moment, as an exponential average in log
//! space over its recent requests.
//!
//! What the scorer uses is that ratio *relative to the pool's median worker*: only relative speed
//! changes which worker is best. An error every worker shares (what the pool's coefficients
//! have not learned yet, a busy period the model underestimates everywhere) cancels out instead
//! of pushing every prediction around, and a worker that is avoided for a while keeps its last
//! relative speed rather than drifting. Observations whose prediction is short (under 300 ms: a
//! mostly cached prompt on an idle worker) say more about fixed per-step costs than about speed
//! and are skipped.
//!
//! Used only by pools with `scoring.learnWorkerSpeed` (off by default): on equal workers the
//! learned ratios still differ with each worker's traffic mix, which cost the shared-prefix tail.

use std::sync::Mutex;

use switchyard_snapshot::snapshot::Scoring;

/// Weight of a new observation in the average.
const LEARNING_RATE: f64 = 0.1;
/// Predictions shorter than this are not learned from.
const MIN_PREDICTION_S: f64 = 0.3;
/// Observations a worker needs before its speed counts.
const MIN_OBSERVATIONS: u64 = 5;
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

/// The median ratio of the known workers among `speeds`, if any is known.
pub fn median_ratio(speeds: impl Iterator<Item = Speed>) -> Option<f64> {
    let mut ratios: Vec<f64> = speeds.filter(Speed::known).map(|s| s.ratio).collect();
    if ratios.is_empty() {
        return None;
    }
    ratios.sort_by(f64::total_cmp);
    ratios.get(ratios.len() / 2).copied()
}

/// Speeds of one worker learned from different answers (several gateway replicas' each) as
/// one: the geometric mean of their ratios, each weighing as its observations (at most as many
/// as its average remembers, `1 / LEARNING_RATE`), the observations summed; the first's last
/// request. `None` only when given none.
pub fn combined(speeds: impl IntoIterator<Item = Speed>) -> Option<Speed> {
    let memory = (1.0 / LEARNING_RATE).round() as u64;
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
    speed: Mutex<Speed>,
    /// One per other replica that has learned the worker.
    peers: Mutex<Vec<Speed>>,
}

impl TtftCalibration {
    /// The worker's speed from every replica's answers: with two replicas each sees half of
    /// them, and alone would take twice as long to learn a slow worker.
    pub fn speed(&self) -> Speed {
        let own = self.own();
        let peers = crate::lock(&self.peers);
        if peers.is_empty() {
            return own;
        }
        combined(std::iter::once(own).chain(peers.iter().copied())).unwrap_or(own)
    }

    /// What this replica learned from its own answers (what it tells the others).
    pub fn own(&self) -> Speed {
        *crate::lock(&self.speed)
    }

    /// What each of the other replicas learned (replacing what they said before).
    pub(crate) fn set_peers(&self, mut peers: Vec<Speed>) {
        peers.retain(|p| p.observations > 0);
        *crate::lock(&self.peers) = peers;
    }

    /// Learn from one streamed request: the formula said `predicted_s`, the first token came
    /// after `observed_s`.
    pub fn observe(&self, predicted_s: f64, observed_s: f64) {
        if !(predicted_s.is_finite() && observed_s.is_finite()) || observed_s <= 0.0 {
            return;
        }
        let mut speed = crate::lock(&self.speed);
        speed.last = Some((predicted_s, observed_s));
        if predicted_s < MIN_PREDICTION_S {
            return;
        }
        let ratio = (observed_s / predicted_s).clamp(0.05, 20.0);
        speed.ratio = if speed.observations == 0 {
            ratio
        } else {
            (speed.ratio.ln() * (1.0 - LEARNING_RATE) + ratio.ln() * LEARNING_RATE).exp()
        };
        speed.observations += 1;
    }
}

/// The pool's TTFT model, in seconds: `fixed + prefill × tokens + running × requests`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Coefficients {
    /// Time every first token takes (a scheduler step, sampling, the network).
    pub fixed_s: f64,
    /// Per prompt token prefilled ahead of and for the request.
    pub prefill_s_per_token: f64,
    /// Per request already running on the worker (decode steps share the batch).
    pub running_s_per_request: f64,
}

impl Coefficients {
    /// The pool's configured coefficients (no fixed part).
    pub fn configured(scoring: &Scoring) -> Coefficients {
        Coefficients {
            fixed_s: 0.0,
            prefill_s_per_token: f64::from(scoring.prefill_micros_per_token) / 1e6,
            running_s_per_request: f64::from(scoring.running_request_micros) / 1e6,
        }
    }

    /// The predicted time to first token behind `tokens` of prefill with `running` requests
    /// running.
    pub fn predict(&self, tokens: f64, running: f64) -> f64 {
        self.fixed_s + self.prefill_s_per_token * tokens + self.running_s_per_request * running
    }

    /// As the filter's state: features are scaled (thousands of tokens, tens of requests) so
    /// the three coefficients are of similar size.
    fn to_state(self) -> [f64; 3] {
        [
            self.fixed_s,
            self.prefill_s_per_token * TOKEN_UNIT,
            self.running_s_per_request * RUNNING_UNIT,
        ]
    }

    fn from_state(state: [f64; 3]) -> Coefficients {
        let [fixed, prefill, running] = state;
        Coefficients {
            fixed_s: fixed,
            prefill_s_per_token: prefill / TOKEN_UNIT,
            running_s_per_request: running / RUNNING_UNIT,
        }
    }
}

/// Units of the filter's features.
const TOKEN_UNIT: f64 = 1000.0;
const RUNNING_UNIT: f64 = 10.0;
/// Prior standard deviation of the fixed part (seconds); the two others' is their configured
/// value (a 2x error is one standard deviation away).
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
    /// Prompt tokens the worker prefilled before this request's first token: the queue ahead
    /// of it and its own uncached prompt.
    pub tokens: f64,
    /// Requests running on the worker when it was chosen.
    pub running: f64,
    /// Seconds to the first token, divided by the worker's relative speed (the pool's model
    /// describes its median worker).
    pub ttft_s: f64,
}

#[derive(Debug, Clone)]
struct FilterState {
    configured: Coefficients,
    mean: [f64; 3],
    covariance: [[f64; 3]; 3],
    prior_sd: [f64; 3],
    observations: u64,
    error: Option<f64>,
    bias: Option<f64>,
    spread: Option<f64>,
}

impl FilterState {
    fn new(configured: Coefficients) -> FilterState {
        let mean = configured.to_state();
        let prior_sd = [FIXED_PRIOR_S, mean[1].max(1e-3), mean[2].max(1e-3)];
        let mut covariance = [[0.0; 3]; 3];
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
            observation.tokens / TOKEN_UNIT,
            observation.running / RUNNING_UNIT,
        ];
        let y = observation.ttft_s;
        let dot = |a: &[f64; 3], b: &[f64; 3]| a.iter().zip(b).map(|(a, b)| a * b).sum::<f64>();
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
        // Within the plausible range of the configuration.
        let [_, configured_prefill, configured_running] = self.configured.to_state();
        let [fixed, prefill, running] = &mut self.mean;
        *fixed = fixed.clamp(0.0, 1.0);
        *prefill = prefill.clamp(
            configured_prefill / COEFFICIENT_RANGE,
            (configured_prefill * COEFFICIENT_RANGE).max(1e-3),
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
fn add_to_diagonal(matrix: &mut [[f64; 3]; 3], values: [f64; 3]) {
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
        let usable = [observation.tokens, observation.running, observation.ttft_s]
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

    #[test]
    fn starts_as_the_formula_and_skips_what_says_nothing_about_speed() {
        let calibration = TtftCalibration::default();
        calibration.observe(0.01, 0.06);
        calibration.observe(f64::NAN, 1.0);
        let speed = calibration.speed();
        assert_eq!((speed.ratio, speed.observations), (1.0, 0));
        assert_eq!(speed.relative_to(Some(2.0)), 1.0);
    }

    #[test]
    fn a_pool_keeps_its_latest_answers_for_the_other_replicas_and_learns_theirs() {
        let configured = Coefficients {
            fixed_s: 0.0,
            prefill_s_per_token: 1e-4,
            running_s_per_request: 1e-3,
        };
        let answer = |ttft_s| Observation {
            tokens: 1_000.0,
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
        // Each of two replicas sees three of a worker 1.5x slower than predicted: neither
        // knows it alone (five observations are needed), together they do.
        let (one, two) = (TtftCalibration::default(), TtftCalibration::default());
        for _ in 0..3 {
            one.observe(0.5, 0.75);
            two.observe(1.0, 1.5);
        }
        assert!(!one.speed().known());
        one.set_peers(vec![two.own()]);
        let speed = one.speed();
        assert!(speed.known());
        assert!((speed.ratio - 1.5).abs() < 1e-9, "{}", speed.ratio);
        assert_eq!(
            speed.last,
            Some((0.5, 0.75)),
            "this replica's own last request"
        );
        // What it tells the others is its own alone (no echo of theirs).
        assert_eq!(one.own().observations, 3);

        // Weighed by observations, each at most as many as an average remembers (ten).
        let ratio = |ratio, observations| Speed {
            ratio,
            observations,
            last: None,
        };
        let both = combined([ratio(2.0, 30), ratio(1.0, 10)]).unwrap();
        assert!((both.ratio - 2f64.sqrt()).abs() < 1e-9, "{}", both.ratio);
        assert_eq!(both.observations, 40);
        let skewed = combined([ratio(2.0, 5), ratio(1.0, 10)]).unwrap();
        assert!((skewed.ratio - 2f64.powf(1.0 / 3.0)).abs() < 1e-9);
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
            three.observe(1.0, 1.0);
        }
        one.set_peers(vec![two.own(), three.own()]);
        let expected = (1.5f64.ln() * 6.0 / 16.0).exp();
        assert!((one.speed().ratio - expected).abs() < 1e-9);
        one.set_peers(Vec::new());
        assert_eq!(one.speed(), one.own());
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
                let predicted = 0.1 + (seed >> 40) as f64 / (1u64 << 24) as f64;
                let noise = 0.9 + 0.2 * ((seed >> 20) & 0xff) as f64 / 255.0;
                let slow = if i == 2 { 1.5 } else { 1.0 };
                worker.observe(predicted, 2.0 * slow * predicted * noise);
            }
        }
        let median = median_ratio(workers.iter().map(TtftCalibration::speed));
        let relative: Vec<f64> = workers
            .iter()
            .map(|w| w.speed().relative_to(median))
            .collect();
        assert_eq!((relative[0], relative[1]), (1.0, 1.0));
        assert!((relative[2] - 1.5).abs() < 0.15, "{relative:?}");
    }

    /// Answers of a worker whose true model is `truth`, in a mix of queues, prompts and
    /// running batches, with ±10% noise.
    fn answers(truth: Coefficients, count: usize, seed: &mut u64) -> Vec<Observation> {
        let mut next = || {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (*seed >> 11) as f64 / (1u64 << 53) as f64
        };
        (0..count)
            .map(|_| {
                let tokens = 4000.0 * next() * next();
                let running = (20.0 * next()).floor();
                let noise = 0.9 + 0.2 * next();
                Observation {
                    tokens,
                    running,
                    ttft_s: truth.predict(tokens, running) * noise,
                }
            })
            .collect()
    }

    #[test]
    fn coefficients_2x_off_are_learned_from_a_minute_of_answers() {
        let scoring = Scoring {
            prefill_micros_per_token: 600,
            running_request_micros: 1000,
            ..Scoring::default()
        };
        let configured = Coefficients::configured(&scoring);
        let truth = Coefficients {
            fixed_s: 0.02,
            prefill_s_per_token: 300e-6,
            running_s_per_request: 500e-6,
        };
        let pool = PoolCalibration::default();
        assert_eq!(pool.fit(configured).learned, configured);
        assert_eq!(pool.fit(configured).error, None);
        // A minute at two answers a second.
        let mut seed = 7;
        let before: f64 = answers(truth, 20, &mut seed)
            .iter()
            .map(|o| {
                (configured.predict(o.tokens, o.running) / o.ttft_s)
                    .ln()
                    .abs()
            })
            .sum::<f64>()
            / 20.0;
        for observation in answers(truth, 120, &mut seed) {
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
        for mut observation in answers(configured, 10, &mut seed) {
            observation.ttft_s = configured.predict(observation.tokens, observation.running) / 5.0;
            scaled.observe(configured, &observation);
        }
        let fit = scaled.fit(configured);
        let (error, bias, spread) = (fit.error.unwrap(), fit.bias.unwrap(), fit.spread.unwrap());
        assert!(error > 0.8, "{fit:?}");
        assert!(spread < error / 2.0, "{fit:?}");
        // The filter has learned most of the scale; the bias is what its predictions still
        // miss, not the first answers' miss counted again.
        for tokens in [500.0, 2000.0, 8000.0] {
            let truth = configured.predict(tokens, 2.0) / 5.0;
            let scaled_prediction = fit.learned.predict(tokens, 2.0) * bias.exp();
            let off = scaled_prediction / truth;
            assert!(off > 0.8 && off < 1.25, "{tokens}: {off} {fit:?}");
        }
        // Right on average but ±30% from one answer to the next: no bias, all spread.
        let noisy = PoolCalibration::default();
        for (i, mut observation) in answers(configured, 40, &mut seed).into_iter().enumerate() {
            let noise = if i % 2 == 0 { 1.3 } else { 1.0 / 1.3 };
            observation.ttft_s =
                configured.predict(observation.tokens, observation.running) * noise;
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
        for (i, mut observation) in answers(configured, 200, &mut seed).into_iter().enumerate() {
            // Every tenth answer stalled for 30 s (a preemption, a slow client connection).
            if i % 10 == 0 {
                observation.ttft_s += 30.0;
            }
            pool.observe(configured, &observation);
        }
        pool.observe(
            configured,
            &Observation {
                tokens: f64::NAN,
                running: 1.0,
                ttft_s: 1.0,
            },
        );
        pool.observe(
            configured,
            &Observation {
                tokens: 10.0,
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
