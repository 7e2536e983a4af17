//! How fast each worker really is, relative to the rest of its pool: learned online.
//!
//! The scorer's formula ([`crate::scorer`]) has one set of coefficients per pool, from
//! configuration; a real fleet is heterogeneous (another GPU, a thermally throttled card, a worker
//! sharing its node). Each worker therefore keeps the ratio of its observed time to first token
//! (from sending a streamed request to its first body chunk) over the formula's prediction at
//! that moment, as an exponential average in log space over its recent requests.
//!
//! What the scorer uses is that ratio *relative to the pool's median worker*: only relative speed
//! changes which worker is best. An error every worker shares (coefficients 2x off, a busy
//! period the formula underestimates everywhere) cancels out instead of pushing every prediction
//! around, and a worker that is avoided for a while keeps its last relative speed rather than
//! drifting. Observations whose prediction is short (under 300 ms: a mostly cached prompt on an
//! idle worker) say more about fixed per-step costs than about speed and are skipped.
//!
//! Used only by pools with `scoring.learnWorkerSpeed` (off by default): on equal workers the
//! learned ratios still differ with each worker's traffic mix, which cost the shared-prefix tail.

use std::sync::Mutex;

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
}

impl Default for Speed {
    /// Nothing learned: as the formula says.
    fn default() -> Self {
        Speed {
            ratio: 1.0,
            observations: 0,
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

/// One worker's calibration.
#[derive(Debug, Default)]
pub struct TtftCalibration {
    speed: Mutex<Speed>,
}

impl TtftCalibration {
    pub fn speed(&self) -> Speed {
        *crate::lock(&self.speed)
    }

    /// Learn from one streamed request: the formula said `predicted_s`, the first token came
    /// after `observed_s`.
    pub fn observe(&self, predicted_s: f64, observed_s: f64) {
        if !(predicted_s.is_finite() && observed_s.is_finite())
            || predicted_s < MIN_PREDICTION_S
            || observed_s <= 0.0
        {
            return;
        }
        let ratio = (observed_s / predicted_s).clamp(0.05, 20.0);
        let mut speed = crate::lock(&self.speed);
        speed.ratio = if speed.observations == 0 {
            ratio
        } else {
            (speed.ratio.ln() * (1.0 - LEARNING_RATE) + ratio.ln() * LEARNING_RATE).exp()
        };
        speed.observations += 1;
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
}
