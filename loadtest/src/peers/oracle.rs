//! The oracle: asks every simulated worker's engine what TTFT this request would get there if
//! it arrived now (`POST /debug/predicted_ttft`, see `sim::debug`) and sends it to the lowest.
//!
//! Each answer is the engine's own state run forward: its exact queues, the tokens each request
//! still has to prefill, this prompt's real prefix-cache hit, its scheduler budget and its step
//! cost model. What the oracle still does not know: requests that arrive after it decides
//! (greedy per request, no look-ahead: it never keeps a worker free for a later prompt or
//! weighs where a prefix should be cached for the requests after this one), and the few
//! milliseconds between its question and the worker queueing the request. Decisions are made
//! one at a time and each is held until the chosen worker has queued the request (its response
//! headers), so concurrent arrivals do not all see the same idle worker. It is an upper
//! reference for per-request, state-based routing, not a global optimum.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use rand::Rng;
use rand::rngs::StdRng;
use serde_json::Value;

use super::proxy::{Choice, ChooseError, Policy, Request};

/// The worker with the lowest predicted TTFT (`None`: it cannot say or cannot admit it), ties
/// broken uniformly at random; `None` when no worker has a prediction.
pub fn argmin_ttft(predictions: &[Option<f64>], rng: &mut impl Rng) -> Option<usize> {
    let best = predictions
        .iter()
        .flatten()
        .copied()
        .fold(f64::INFINITY, f64::min);
    if !best.is_finite() {
        return None;
    }
    let tied: Vec<usize> = predictions
        .iter()
        .enumerate()
        .filter(|(_, ttft)| **ttft == Some(best))
        .map(|(i, _)| i)
        .collect();
    tied.get(rng.random_range(0..tied.len())).copied()
}

pub struct Oracle {
    /// Worker base URLs, in the proxy's order.
    pub workers: Vec<String>,
    pub client: reqwest::Client,
    /// One decision at a time (see the module note).
    pub deciding: Arc<tokio::sync::Mutex<()>>,
    pub rng: Mutex<StdRng>,
}

impl Oracle {
    async fn predict(&self, base: &str, body: &axum::body::Bytes) -> Option<f64> {
        let response = self
            .client
            .post(format!("{base}/debug/predicted_ttft"))
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .ok()?;
        let answer: Value = response.json().await.ok()?;
        answer.get("predicted_ttft_s").and_then(Value::as_f64)
    }
}

#[async_trait]
impl Policy for Oracle {
    async fn choose(&self, request: &Request) -> Result<Choice, ChooseError> {
        let deciding = self.deciding.clone().lock_owned().await;
        let predictions = futures_util::future::join_all(
            self.workers
                .iter()
                .map(|base| self.predict(base, &request.body)),
        )
        .await;
        let worker = {
            let mut rng = self
                .rng
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            argmin_ttft(&predictions, &mut *rng)
        }
        .ok_or(ChooseError::NoWorker)?;
        Ok(Choice {
            worker,
            lease: None,
            hold_until_queued: Some(deciding),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn the_lowest_prediction_wins_and_unknowns_never_do() {
        let mut rng = StdRng::seed_from_u64(5);
        assert_eq!(
            argmin_ttft(&[Some(0.9), None, Some(0.3)], &mut rng),
            Some(2)
        );
        assert_eq!(argmin_ttft(&[None, None], &mut rng), None);
        let mut seen = [0usize; 3];
        for _ in 0..200 {
            seen[argmin_ttft(&[Some(0.5), Some(0.5), Some(0.7)], &mut rng).unwrap()] += 1;
        }
        assert!(seen[0] > 50 && seen[1] > 50 && seen[2] == 0, "{seen:?}");
    }
}
