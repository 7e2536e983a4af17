//! Measuring what the proxy adds: the same closed-loop load straight to a fast upstream and
//! through `switchyard-proxy`, interleaved in rounds so both see the same machine.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use serde_json::json;

/// Latency percentiles and throughput of one run.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct LoadResult {
    pub requests: usize,
    pub errors: usize,
    pub seconds: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
}

impl LoadResult {
    pub fn requests_per_second(&self) -> f64 {
        if self.seconds > 0.0 {
            self.requests as f64 / self.seconds
        } else {
            0.0
        }
    }
}

/// The `q`-quantile (0–1) of sorted values, nearest rank.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted.get(rank - 1).copied().unwrap_or(0.0)
}

/// A worker that answers a chat completion at once: the fastest upstream there can be.
pub async fn start_fast_upstream(model: &str) -> std::io::Result<SocketAddr> {
    let body = json!({
        "id": "chatcmpl-fast", "object": "chat.completion", "created": 0, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    })
    .to_string();
    let app = Router::new()
        .route("/health", axum::routing::get(|| async { "ok" }))
        .route(
            "/v1/chat/completions",
            // Reads the request body before answering, as vLLM does.
            post(move |_request: axum::body::Bytes| {
                let body = body.clone();
                async move { ([("content-type", "application/json")], body) }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(addr)
}

/// Closed-loop load: `concurrency` clients, each sending the next request when the last returns.
pub async fn closed_loop(
    url: &str,
    body: &serde_json::Value,
    concurrency: usize,
    duration: Duration,
) -> LoadResult {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()
        .unwrap_or_default();
    let start = Instant::now();
    let deadline = start + duration;
    let mut tasks = Vec::with_capacity(concurrency);
    for _ in 0..concurrency {
        let client = client.clone();
        let url = url.to_owned();
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut errors = 0;
            while Instant::now() < deadline {
                let sent = Instant::now();
                let ok = match client.post(&url).json(&body).send().await {
                    Ok(response) => {
                        response.status().is_success() && response.bytes().await.is_ok()
                    }
                    Err(_) => false,
                };
                if ok {
                    latencies.push(sent.elapsed().as_secs_f64() * 1000.0);
                } else {
                    errors += 1;
                }
            }
            (latencies, errors)
        }));
    }
    let mut latencies = Vec::new();
    let mut errors = 0;
    for task in tasks {
        if let Ok((mut l, e)) = task.await {
            latencies.append(&mut l);
            errors += e;
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    latencies.sort_by(f64::total_cmp);
    LoadResult {
        requests: latencies.len(),
        errors,
        seconds,
        p50_ms: quantile(&latencies, 0.50),
        p90_ms: quantile(&latencies, 0.90),
        p99_ms: quantile(&latencies, 0.99),
    }
}

/// Merge rounds of the same target (latency percentiles averaged, counts summed).
pub fn merge(rounds: &[LoadResult]) -> LoadResult {
    let n = rounds.len().max(1) as f64;
    LoadResult {
        requests: rounds.iter().map(|r| r.requests).sum(),
        errors: rounds.iter().map(|r| r.errors).sum(),
        seconds: rounds.iter().map(|r| r.seconds).sum(),
        p50_ms: rounds.iter().map(|r| r.p50_ms).sum::<f64>() / n,
        p90_ms: rounds.iter().map(|r| r.p90_ms).sum::<f64>() / n,
        p99_ms: rounds.iter().map(|r| r.p99_ms).sum::<f64>() / n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&values, 0.5), 50.0);
        assert_eq!(quantile(&values, 0.99), 99.0);
        assert_eq!(quantile(&values, 1.0), 100.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }
}
