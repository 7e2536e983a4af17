//! Counters of one simulated worker, exposed at `/metrics` under vLLM's own metric names
//! (`vllm/v1/metrics/loggers.py`, labels `model_name` and `engine`).

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

/// vLLM's TTFT buckets (`TIME_TO_FIRST_TOKEN_BUCKETS`).
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's request latency buckets (`REQUEST_LATENCY_BUCKETS`).
pub const LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, value: f64) {
        for (bound, count) in self.bounds.iter().zip(self.counts.iter_mut()) {
            if value <= *bound {
                *count += 1;
            }
        }
        self.sum += value;
        self.count += 1;
    }
}

#[derive(Debug)]
struct Histograms {
    ttft: Histogram,
    e2e: Histogram,
}

impl Default for Histograms {
    fn default() -> Histograms {
        Histograms {
            ttft: Histogram::new(TTFT_BUCKETS),
            e2e: Histogram::new(LATENCY_BUCKETS),
        }
    }
}

/// Live counters of one engine.
#[derive(Debug, Default)]
pub struct EngineStats {
    running: AtomicU64,
    waiting: AtomicU64,
    kv_usage_bits: AtomicU64,
    prefix_queries: AtomicU64,
    prefix_hits: AtomicU64,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    success: AtomicU64,
    preemptions: AtomicU64,
    histograms: Mutex<Histograms>,
    /// `block_size` and `num_gpu_blocks` of the cache config, for `vllm:cache_config_info`.
    cache_config: OnceLock<(usize, usize)>,
}

impl EngineStats {
    /// What `vllm:cache_config_info` reports: tokens per block and the KV blocks vLLM allocated
    /// (`CacheConfig.num_gpu_blocks`, the null block included); set once, when the engine starts.
    pub fn set_cache_config(&self, block_size: usize, num_gpu_blocks: usize) {
        let _ = self.cache_config.set((block_size, num_gpu_blocks));
    }

    pub fn set_gauges(&self, running: usize, waiting: usize, kv_usage: f64) {
        self.running.store(running as u64, Ordering::Relaxed);
        self.waiting.store(waiting as u64, Ordering::Relaxed);
        self.kv_usage_bits
            .store(kv_usage.to_bits(), Ordering::Relaxed);
    }

    pub fn record_prefix_lookup(&self, queried_tokens: usize, hit_tokens: usize) {
        self.prefix_queries
            .fetch_add(queried_tokens as u64, Ordering::Relaxed);
        self.prefix_hits
            .fetch_add(hit_tokens as u64, Ordering::Relaxed);
    }

    pub fn record_preemption(&self) {
        self.preemptions.fetch_add(1, Ordering::Relaxed);
    }

    pub fn record_finished(
        &self,
        prompt_tokens: usize,
        generated: usize,
        ttft: Option<f64>,
        e2e: f64,
    ) {
        self.prompt_tokens
            .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        self.generation_tokens
            .fetch_add(generated as u64, Ordering::Relaxed);
        self.success.fetch_add(1, Ordering::Relaxed);
        let mut histograms = match self.histograms.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        if let Some(ttft) = ttft {
            histograms.ttft.observe(ttft);
        }
        histograms.e2e.observe(e2e);
    }

    pub fn running(&self) -> u64 {
        self.running.load(Ordering::Relaxed)
    }

    pub fn waiting(&self) -> u64 {
        self.waiting.load(Ordering::Relaxed)
    }

    pub fn kv_usage(&self) -> f64 {
        f64::from_bits(self.kv_usage_bits.load(Ordering::Relaxed))
    }

    pub fn prefix_queries(&self) -> u64 {
        self.prefix_queries.load(Ordering::Relaxed)
    }

    pub fn prefix_hits(&self) -> u64 {
        self.prefix_hits.load(Ordering::Relaxed)
    }

    /// Prometheus text exposition (format 0.0.4).
    pub fn render(&self, model_name: &str) -> String {
        let labels = format!("model_name=\"{}\",engine=\"0\"", escape(model_name));
        let mut out = String::new();
        let mut gauge = |name: &str, help: &str, value: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {value}"
            );
        };
        gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            self.running() as f64,
        );
        gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            self.waiting() as f64,
        );
        gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            self.kv_usage(),
        );
        if let Some((block_size, num_gpu_blocks)) = self.cache_config.get() {
            // vLLM's info gauge: every CacheConfig field as a label (the ones a router reads
            // here), value 1 (`PrometheusStatLogger.log_metrics_info`).
            let _ = writeln!(
                out,
                "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size=\"{block_size}\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"{num_gpu_blocks}\"}} 1.0"
            );
        }
        let mut counter = |name: &str, help: &str, value: u64| {
            let _ = writeln!(
                out,
                "# HELP {name}_total {help}\n# TYPE {name}_total counter\n{name}_total{{{labels}}} {value}"
            );
        };
        counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            self.prefix_queries(),
        );
        counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            self.prefix_hits(),
        );
        counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            self.prompt_tokens.load(Ordering::Relaxed),
        );
        counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            self.generation_tokens.load(Ordering::Relaxed),
        );
        counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            self.preemptions.load(Ordering::Relaxed),
        );
        let _ = writeln!(
            out,
            "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter\nvllm:request_success_total{{{labels},finished_reason=\"length\"}} {}",
            self.success.load(Ordering::Relaxed)
        );
        let histograms = match self.histograms.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        write_histogram(
            &mut out,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &labels,
            &histograms.ttft,
        );
        write_histogram(
            &mut out,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &labels,
            &histograms.e2e,
        );
        out
    }
}

fn write_histogram(out: &mut String, name: &str, help: &str, labels: &str, histogram: &Histogram) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    for (bound, count) in histogram.bounds.iter().zip(&histogram.counts) {
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound:?}\"}} {count}");
    }
    let _ = writeln!(
        out,
        "{name}_bucket{{{labels},le=\"+Inf\"}} {}",
        histogram.count
    );
    let _ = writeln!(out, "{name}_sum{{{labels}}} {}", histogram.sum);
    let _ = writeln!(out, "{name}_count{{{labels}}} {}", histogram.count);
}

fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
