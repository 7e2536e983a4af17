//! The router comparison: the same seeded workload against fresh simulated workers behind each
//! router in turn, measured from the client (TTFT, end-to-end latency, throughput) and from the
//! workers (prefix-cache hit rate).
//!
//! Times are reported in model seconds (wall time divided by the simulator's `--time-scale`), so
//! they read like the GPU the simulator models, whatever the speed-up.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures_util::StreamExt;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;
use tokio::sync::Mutex;

use crate::overhead::quantile;
use crate::workload::{Conversation, WorkloadKind, WorkloadSize};

/// A router under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RouterKind {
    /// Uniform random: what a Kubernetes Service does.
    Random,
    RoundRobin,
    LeastOutstanding,
    /// Switchyard's cache- and queue-aware scorer.
    Switchyard,
    /// vllm-router (PyPI) with its cache_aware policy, when installed.
    VllmRouter,
}

impl RouterKind {
    pub fn name(self) -> &'static str {
        match self {
            RouterKind::Random => "random",
            RouterKind::RoundRobin => "round-robin",
            RouterKind::LeastOutstanding => "least-outstanding",
            RouterKind::Switchyard => "switchyard",
            RouterKind::VllmRouter => "vllm-router",
        }
    }

    fn policy(self) -> Option<&'static str> {
        match self {
            RouterKind::Random => Some("random"),
            RouterKind::RoundRobin => Some("round-robin"),
            RouterKind::LeastOutstanding => Some("least-outstanding"),
            RouterKind::Switchyard => Some("cache-aware"),
            RouterKind::VllmRouter => None,
        }
    }
}

/// How requests arrive.
#[derive(Debug, Clone, Copy, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Arrival {
    /// Conversations start as a Poisson process at this rate (per model second).
    Poisson { rate: f64 },
    /// This many clients, each starting the next conversation when its last one ends.
    Concurrency { clients: usize },
}

/// Everything one run needs.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub bin_dir: PathBuf,
    pub workload: WorkloadKind,
    pub size: WorkloadSize,
    pub seed: u64,
    pub arrival: Arrival,
    pub time_scale: f64,
    pub workers: usize,
    pub num_blocks: usize,
    /// A `vllm-router` executable, when one was found.
    pub vllm_router: Option<PathBuf>,
}

/// One finished request.
#[derive(Debug, Clone, Copy)]
struct Sample {
    ttft: f64,
    e2e: f64,
}

/// What one router achieved on one workload at one load.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RouterResult {
    pub router: String,
    pub requests: usize,
    pub errors: usize,
    pub ttft_p50: f64,
    pub ttft_p90: f64,
    pub ttft_p99: f64,
    pub e2e_p50: f64,
    pub e2e_p90: f64,
    /// Completed requests per model second.
    pub throughput: f64,
    /// Prompt tokens served from the workers' prefix caches / prompt tokens looked up.
    pub cache_hit_rate: f64,
    /// Every TTFT (model seconds), sorted, for CDF plots.
    pub ttfts: Vec<f64>,
}

/// A child process killed (and reaped) when dropped.
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Poll `url` until it answers 2xx, or fail after `timeout`.
pub async fn wait_ready(url: &str, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(response) = reqwest::get(url).await
            && response.status().is_success()
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{url} not ready after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Simulated workers as `switchyard-sim` reports them.
struct Sim {
    _child: Killed,
    model: String,
    workers: Vec<(String, String, String)>,
}

fn start_sim(config: &RunConfig) -> anyhow::Result<Sim> {
    let mut child = Command::new(config.bin_dir.join("switchyard-sim"))
        .args([
            "--workers",
            &config.workers.to_string(),
            "--port",
            "0",
            "--kv-events-port",
            "0",
            "--kv-replay-port",
            "0",
        ])
        .args([
            "--time-scale",
            &config.time_scale.to_string(),
            "--num-blocks",
            &config.num_blocks.to_string(),
        ])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting switchyard-sim")?;
    let stdout = child.stdout.take().context("sim stdout")?;
    let child = Killed(child);
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)?;
    let value: Value = serde_json::from_str(&line).context("reading the simulator's addresses")?;
    let text = |v: &Value, key: &str| {
        v.get(key)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    let workers = value
        .get("workers")
        .and_then(Value::as_array)
        .context("workers")?
        .iter()
        .map(|w| (text(w, "http"), text(w, "kv_events"), text(w, "kv_replay")))
        .collect();
    Ok(Sim {
        _child: child,
        model: text(&value, "model"),
        workers,
    })
}

/// Start the router in front of `sim`; returns its base URL and process.
async fn start_router(
    config: &RunConfig,
    router: RouterKind,
    sim: &Sim,
    dir: &Path,
) -> anyhow::Result<(String, Killed)> {
    let port = free_port()?;
    let url = format!("http://127.0.0.1:{port}");
    let child = match router.policy() {
        Some(policy) => {
            let endpoints: Vec<String> = sim
                .workers
                .iter()
                .map(|(http, events, replay)| {
                    format!(
                        "{{address: \"{http}\", kvEvents: \"{events}\", kvReplay: \"{replay}\"}}"
                    )
                })
                .collect();
            let yaml = format!(
                "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: sim}}\nspec:\n  model: {model}\n  loadBalancing: {policy}\n  scrapeIntervalMs: 100\n  endpoints: [{endpoints}]\n---\n\
                 apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: bench}}\nspec:\n  modelName: \"{model}\"\n  targets: [{{pool: sim}}]\n",
                model = sim.model,
                endpoints = endpoints.join(", ")
            );
            let path = dir.join(format!("{}.yaml", router.name()));
            std::fs::write(&path, yaml)?;
            Command::new(config.bin_dir.join("switchyard-proxy"))
                .arg("--config")
                .arg(&path)
                .args([
                    "--listen",
                    &format!("127.0.0.1:{port}"),
                    "--grace-period-s",
                    "0",
                ])
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("starting switchyard-proxy")?
        }
        None => {
            let executable = config
                .vllm_router
                .clone()
                .context("vllm-router is not installed")?;
            let urls: Vec<String> = sim
                .workers
                .iter()
                .map(|(http, _, _)| format!("http://{http}"))
                .collect();
            spawn_vllm_router(&executable, &urls, "cache_aware", port)?
        }
    };
    let child = Killed(child);
    let ready = if router.policy().is_some() {
        format!("{url}/ready")
    } else {
        format!("{url}/health")
    };
    wait_ready(&ready, Duration::from_secs(60)).await?;
    Ok((url, child))
}

/// Send one streamed chat request; TTFT is the first content chunk, the answer text is kept
/// for the next turn.
async fn stream_one(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
) -> anyhow::Result<(Duration, Duration, String)> {
    let start = Instant::now();
    let response = client
        .post(format!("{url}/v1/chat/completions"))
        .json(body)
        .send()
        .await?;
    if !response.status().is_success() {
        bail!("status {}", response.status());
    }
    let mut stream = response.bytes_stream();
    let (mut ttft, mut text, mut pending) = (None, String::new(), String::new());
    while let Some(chunk) = stream.next().await {
        pending.push_str(&String::from_utf8_lossy(&chunk?));
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            for data in event.lines().filter_map(|l| l.strip_prefix("data: ")) {
                if data == "[DONE]" {
                    continue;
                }
                let Ok(chunk) = serde_json::from_str::<Value>(data) else {
                    continue;
                };
                if let Some(content) = chunk
                    .pointer("/choices/0/delta/content")
                    .and_then(Value::as_str)
                    .filter(|c| !c.is_empty())
                {
                    ttft.get_or_insert_with(|| start.elapsed());
                    text.push_str(content);
                }
            }
        }
    }
    let ttft = ttft.context("no content in the stream")?;
    Ok((ttft, start.elapsed(), text))
}

/// Run a conversation's turns in order; one sample per turn.
async fn run_conversation(
    client: &reqwest::Client,
    url: &str,
    model: &str,
    conversation: &Conversation,
    output_tokens: usize,
    scale: f64,
    progress: &Progress,
) -> (Vec<Sample>, usize) {
    let mut answers = Vec::new();
    let mut samples = Vec::new();
    let mut errors = 0;
    for turn in 0..conversation.turns.len() {
        let body = conversation.request(model, turn, &answers, output_tokens);
        match stream_one(client, url, &body).await {
            Ok((ttft, e2e, text)) => {
                samples.push(Sample {
                    ttft: ttft.as_secs_f64() / scale,
                    e2e: e2e.as_secs_f64() / scale,
                });
                answers.push(text);
            }
            Err(_) => {
                errors += 1;
                answers.push(String::new());
            }
        }
        progress.tick();
    }
    (samples, errors)
}

/// A progress bar on stderr, drawn only when stderr is a terminal (indicatif hides it otherwise,
/// so a CI log or `2> file` gets no bar frames); each finished run prints one plain line instead.
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    fn new(label: &str, total: usize) -> Progress {
        let bar = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template("{prefix:<44} [{bar:30}] {pos}/{len}") {
            bar.set_style(style.progress_chars("#>-"));
        }
        bar.set_prefix(label.to_owned());
        Progress { bar }
    }

    fn tick(&self) {
        self.bar.inc(1);
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

async fn cache_hit_rate(sim: &Sim) -> f64 {
    let (mut hits, mut queries) = (0.0, 0.0);
    for (http, _, _) in &sim.workers {
        let Ok(response) = reqwest::get(format!("http://{http}/metrics")).await else {
            continue;
        };
        let Ok(text) = response.text().await else {
            continue;
        };
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let value = line
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0);
            if line.starts_with("vllm:prefix_cache_hits_total") {
                hits += value;
            } else if line.starts_with("vllm:prefix_cache_queries_total") {
                queries += value;
            }
        }
    }
    if queries > 0.0 { hits / queries } else { 0.0 }
}

/// Run the workload through one router against a fresh simulator.
pub async fn run(
    config: &RunConfig,
    router: RouterKind,
    conversations: &[Conversation],
    label: String,
) -> anyhow::Result<RouterResult> {
    let dir = std::env::temp_dir().join(format!("switchyard-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let sim = start_sim(config)?;
    let (url, _router) = start_router(config, router, &sim, &dir).await?;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()?;
    let total: usize = conversations.iter().map(|c| c.turns.len()).sum();
    let progress = Arc::new(Progress::new(&label, total));
    let scale = config.time_scale;
    let output_tokens = config.size.output_tokens;
    let started = Instant::now();
    let mut tasks = Vec::new();
    match config.arrival {
        Arrival::Concurrency { clients } => {
            let queue = Arc::new(Mutex::new(
                conversations.iter().cloned().collect::<VecDeque<_>>(),
            ));
            for _ in 0..clients.max(1) {
                let (queue, client, url, model, progress) = (
                    queue.clone(),
                    client.clone(),
                    url.clone(),
                    sim.model.clone(),
                    progress.clone(),
                );
                tasks.push(tokio::spawn(async move {
                    let (mut samples, mut errors) = (Vec::new(), 0);
                    loop {
                        let Some(conversation) = queue.lock().await.pop_front() else {
                            break;
                        };
                        let (mut s, e) = run_conversation(
                            &client,
                            &url,
                            &model,
                            &conversation,
                            output_tokens,
                            scale,
                            &progress,
                        )
                        .await;
                        samples.append(&mut s);
                        errors += e;
                    }
                    (samples, errors)
                }));
            }
        }
        Arrival::Poisson { rate } => {
            let mut rng = StdRng::seed_from_u64(config.seed ^ 0x5eed);
            let mut at = 0.0f64;
            for conversation in conversations {
                let conversation = conversation.clone();
                // Exponential gaps in model time, slept in wall time.
                at += -(1.0 - rng.random::<f64>()).ln() / rate.max(1e-9);
                let start = started + Duration::from_secs_f64(at * scale);
                let (client, url, model, progress) = (
                    client.clone(),
                    url.clone(),
                    sim.model.clone(),
                    progress.clone(),
                );
                tasks.push(tokio::spawn(async move {
                    tokio::time::sleep_until(start.into()).await;
                    run_conversation(
                        &client,
                        &url,
                        &model,
                        &conversation,
                        output_tokens,
                        scale,
                        &progress,
                    )
                    .await
                }));
            }
        }
    }
    let (mut samples, mut errors) = (Vec::new(), 0);
    for task in tasks {
        let (mut s, e) = task.await?;
        samples.append(&mut s);
        errors += e;
    }
    let model_seconds = started.elapsed().as_secs_f64() / scale;
    let mut ttfts: Vec<f64> = samples.iter().map(|s| s.ttft).collect();
    let mut e2es: Vec<f64> = samples.iter().map(|s| s.e2e).collect();
    ttfts.sort_by(f64::total_cmp);
    e2es.sort_by(f64::total_cmp);
    let cache_hit_rate = cache_hit_rate(&sim).await;
    progress.finish();
    println!(
        "{label}: {} requests, {errors} errors, TTFT p50 {:.3} s p90 {:.3} s, {:.0} s wall",
        samples.len(),
        quantile(&ttfts, 0.5),
        quantile(&ttfts, 0.9),
        started.elapsed().as_secs_f64()
    );
    Ok(RouterResult {
        router: router.name().to_owned(),
        requests: samples.len(),
        errors,
        ttft_p50: quantile(&ttfts, 0.5),
        ttft_p90: quantile(&ttfts, 0.9),
        ttft_p99: quantile(&ttfts, 0.99),
        e2e_p50: quantile(&e2es, 0.5),
        e2e_p90: quantile(&e2es, 0.9),
        throughput: samples.len() as f64 / model_seconds.max(f64::MIN_POSITIVE),
        cache_hit_rate,
        ttfts,
    })
}

/// Print one workload's table with ratios against random routing.
pub fn print_table(title: &str, results: &[RouterResult]) {
    println!("\n{title}");
    println!(
        "{:<18} {:>8} {:>8} {:>8} {:>8} {:>9} {:>8} {:>9} {:>9} {:>9}",
        "router",
        "TTFT p50",
        "p90",
        "p99",
        "e2e p50",
        "req/s",
        "hit rate",
        "p50 x",
        "p90 x",
        "errors"
    );
    let random = results
        .iter()
        .find(|r| r.router == RouterKind::Random.name());
    for result in results {
        let ratio = |ours: f64, theirs: Option<f64>| {
            theirs.filter(|_| ours > 0.0).map_or(f64::NAN, |t| t / ours)
        };
        println!(
            "{:<18} {:>7.3}s {:>7.3}s {:>7.3}s {:>7.3}s {:>9.2} {:>7.1}% {:>8.2}x {:>8.2}x {:>9}",
            result.router,
            result.ttft_p50,
            result.ttft_p90,
            result.ttft_p99,
            result.e2e_p50,
            result.throughput,
            result.cache_hit_rate * 100.0,
            ratio(result.ttft_p50, random.map(|r| r.ttft_p50)),
            ratio(result.ttft_p90, random.map(|r| r.ttft_p90)),
            result.errors
        );
    }
    println!("(times in model seconds; \"x\" = random's TTFT / this router's: higher is better)");
}

/// Start vllm-router on 127.0.0.1:`port` in front of `worker_urls` with `policy` (it waits for
/// the workers' `/health` before it serves; poll its own `/health`).
pub fn spawn_vllm_router(
    executable: &Path,
    worker_urls: &[String],
    policy: &str,
    port: u16,
) -> anyhow::Result<Child> {
    let metrics_port = free_port()?;
    Command::new(executable)
        .arg("--worker-urls")
        .args(worker_urls)
        .args([
            "--policy",
            policy,
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
        ])
        .args([
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            &metrics_port.to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting vllm-router")
}

/// Look for `vllm-router` on PATH and in the project's .venv.
pub fn find_vllm_router(root: &Path) -> Option<PathBuf> {
    let venv = root.join(".venv/bin/vllm-router");
    if venv.exists() {
        return Some(venv);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("vllm-router"))
            .find(|candidate| candidate.exists())
    })
}
