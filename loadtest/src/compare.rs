//! The router comparison: the same seeded workload against fresh simulated workers behind each
//! router in turn, measured from the client (TTFT, end-to-end latency, throughput, prompt and
//! output tokens from `usage`) and from the workers (prefix-cache hit rate, engine-side TTFT
//! histogram), then summarised across seeds.
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
use crate::peers::{self, PeerKind, WorkerAddress};
use crate::sim::GpuProfile;
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
    /// Two switchyard-proxy replicas in front of the same workers, each client's conversations
    /// sent to one of them (alternating): each replica sees only its own requests in flight.
    #[value(name = "switchyard-2")]
    #[serde(rename = "switchyard-2")]
    SwitchyardReplicas,
    /// vllm-router (PyPI) with its cache_aware policy, when installed.
    VllmRouter,
    /// vllm-router's power_of_two policy.
    #[value(name = "vllm-router-pow2")]
    #[serde(rename = "vllm-router-pow2")]
    VllmRouterPow2,
    /// vllm-router's kv_aware policy, fed by the workers' KV events.
    #[value(name = "vllm-router-kv")]
    #[serde(rename = "vllm-router-kv")]
    VllmRouterKv,
    /// Each request to the worker whose engine predicts the lowest TTFT for it (in process).
    Oracle,
    /// llm-d's default precise-prefix-cache profile, re-implemented (in process).
    #[value(name = "llm-d")]
    #[serde(rename = "llm-d")]
    Llmd,
    /// NVIDIA Dynamo's KV router cost, re-implemented (in process).
    Dynamo,
}

/// How a router under test runs.
enum Launch {
    /// `switchyard-proxy` with this pool `loadBalancing`, this many replicas.
    Switchyard(&'static str, usize),
    /// vllm-router with this `--policy`.
    VllmRouter(&'static str),
    /// In the benchmark process.
    Peer(PeerKind),
}

impl RouterKind {
    pub fn name(self) -> &'static str {
        match self {
            RouterKind::Random => "random",
            RouterKind::RoundRobin => "round-robin",
            RouterKind::LeastOutstanding => "least-outstanding",
            RouterKind::Switchyard => "switchyard",
            RouterKind::SwitchyardReplicas => "switchyard-2",
            RouterKind::VllmRouter => "vllm-router",
            RouterKind::VllmRouterPow2 => "vllm-router-pow2",
            RouterKind::VllmRouterKv => "vllm-router-kv",
            RouterKind::Oracle => "oracle",
            RouterKind::Llmd => "llm-d",
            RouterKind::Dynamo => "dynamo",
        }
    }

    /// Whether it routes by the workers' KV events (and cannot run without them).
    pub fn needs_kv_events(self) -> bool {
        matches!(
            self,
            RouterKind::VllmRouterKv | RouterKind::Llmd | RouterKind::Dynamo
        )
    }

    /// Whether it needs the `vllm-router` executable.
    pub fn is_vllm_router(self) -> bool {
        matches!(self.launch(), Launch::VllmRouter(_))
    }

    fn launch(self) -> Launch {
        match self {
            RouterKind::Random => Launch::Switchyard("random", 1),
            RouterKind::RoundRobin => Launch::Switchyard("round-robin", 1),
            RouterKind::LeastOutstanding => Launch::Switchyard("least-outstanding", 1),
            RouterKind::Switchyard => Launch::Switchyard("cache-aware", 1),
            RouterKind::SwitchyardReplicas => Launch::Switchyard("cache-aware", 2),
            RouterKind::VllmRouter => Launch::VllmRouter("cache_aware"),
            // power_of_two picks the less loaded of two random workers; the load it polls is
            // SGLang's `GET /get_load` (every 5 s), which neither vLLM nor the simulator serves
            // (404), so it runs on whatever load vllm-router tracks itself.
            RouterKind::VllmRouterPow2 => Launch::VllmRouter("power_of_two"),
            // kv_aware subscribes to the KV events (`--kv-event-source`) and tokenizes through
            // the workers' own `/tokenize`, which the simulator serves with its chat template.
            RouterKind::VllmRouterKv => Launch::VllmRouter("kv_aware"),
            RouterKind::Oracle => Launch::Peer(PeerKind::Oracle),
            RouterKind::Llmd => Launch::Peer(PeerKind::Llmd),
            RouterKind::Dynamo => Launch::Peer(PeerKind::Dynamo),
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
    /// Bursts of `size` conversations started together, the bursts a Poisson process at
    /// `rate / size` (the same mean rate as `Poisson { rate }`).
    Bursts { rate: f64, size: usize },
}

impl Arrival {
    /// This arrival with conversations grouped in bursts of `size` (Poisson only; a burst of 1
    /// is plain Poisson).
    pub fn in_bursts(self, size: usize) -> Arrival {
        match self {
            Arrival::Poisson { rate } if size > 1 => Arrival::Bursts { rate, size },
            other => other,
        }
    }

    /// Model seconds at which each of `n` conversations starts (open-loop arrivals only).
    fn start_times(self, n: usize, seed: u64) -> Vec<f64> {
        let (rate, size) = match self {
            Arrival::Poisson { rate } => (rate, 1),
            Arrival::Bursts { rate, size } => (rate, size.max(1)),
            Arrival::Concurrency { .. } => return Vec::new(),
        };
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
        let mut at = 0.0f64;
        (0..n)
            .map(|i| {
                if i % size == 0 {
                    // Exponential gaps between bursts, in model time.
                    at += -(1.0 - rng.random::<f64>()).ln() * size as f64 / rate.max(1e-9);
                }
                at
            })
            .collect()
    }

    /// The same arrival process at another mean rate (closed loop becomes Poisson).
    pub fn at_rate(self, rate: f64) -> Arrival {
        match self {
            Arrival::Bursts { size, .. } => Arrival::Bursts { rate, size },
            _ => Arrival::Poisson { rate },
        }
    }

    /// How it reads in a table title.
    pub fn describe(self) -> String {
        match self {
            Arrival::Poisson { rate } => format!("Poisson {rate} req/s"),
            Arrival::Bursts { rate, size } => {
                format!("bursts of {size} at Poisson {rate} req/s on average")
            }
            Arrival::Concurrency { clients } => format!("{clients} concurrent clients"),
        }
    }
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
    /// The card the simulated workers model.
    pub gpu: GpuProfile,
    /// KV blocks per worker (vLLM's null block included; `None`: the card's) and tokens per block.
    pub num_blocks: Option<usize>,
    pub block_size: usize,
    /// Step-time multiplier per worker (`switchyard-sim --worker-speed`; empty: all 1).
    pub worker_speed: Vec<f64>,
    /// Switchyard's pool learns each worker's relative speed (`scoring.learnWorkerSpeed`).
    pub learn_worker_speed: bool,
    /// Switchyard's pool learns its TTFT coefficients (`scoring.learnCoefficients`).
    pub learn_coefficients: bool,
    /// Switchyard's pool copies prefixes the traffic shares (`scoring.replicateSharedPrefixes`).
    pub replicate_shared_prefixes: bool,
    /// Switchyard's pool is configured with the default coefficients times this (a wrong model).
    pub scoring_error: f64,
    /// Switchyard's pool's `scoring.tieToleranceMicros` (`None`: the default).
    pub tie_tolerance_us: Option<u32>,
    /// `switchyard-2`: how often each replica repeats an unchanged ledger to the other
    /// (`--peer-interval-ms`; it also sends at every change; 0: the replicas share nothing).
    pub peer_interval_ms: u64,
    /// A `vllm-router` executable, when one was found.
    pub vllm_router: Option<PathBuf>,
    /// The share of conversations whose client asks for whole answers (`stream: false`),
    /// spread evenly among the others ([`asks_whole`]).
    pub whole_answers: f64,
    /// The workers publish KV events (`false`: vLLM without `--kv-events-config`; switchyard's
    /// pool then names none, and routers that need them cannot run).
    pub kv_events: bool,
    /// Where switchyard's proxies write their logs, request lines and routing decisions
    /// included (`RUST_LOG` for switchyard_proxy at debug), one file per workload, seed, router
    /// and replica (`None`: discarded).
    pub proxy_log: Option<PathBuf>,
}

impl RunConfig {
    /// How this run's conversations arrive: the configured arrival, in the workload's bursts
    /// where it has them (bursty). Until 2026-12-07 the bursts were applied only to the
    /// results' description, and bursty's conversations arrived one at a time.
    pub fn arrival(&self) -> Arrival {
        self.arrival.in_bursts(self.workload.burst(&self.size))
    }
}

/// Whether conversation `index` asks for whole answers when `share` of them do: every
/// conversation where the running count of `share` per conversation reaches a new integer.
pub fn asks_whole(index: usize, share: f64) -> bool {
    ((index + 1) as f64 * share).floor() > (index as f64 * share).floor()
}

/// One finished request.
#[derive(Debug, Clone, Copy)]
struct Sample {
    /// Client-side TTFT (none for a whole answer: its client sees no first token).
    ttft: Option<f64>,
    e2e: f64,
    /// `usage.prompt_tokens`: the prompt as the worker counted it, chat template included.
    prompt_tokens: Option<u64>,
    /// `usage.completion_tokens`.
    output_tokens: Option<u64>,
    /// What the request asked for.
    requested_tokens: usize,
}

/// What one router achieved on one workload (one seed) at one load.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RouterResult {
    pub router: String,
    pub seed: u64,
    pub requests: usize,
    pub errors: usize,
    /// Client-side TTFT: the first content chunk, router and HTTP included (model seconds).
    pub ttft_p50: f64,
    pub ttft_p90: f64,
    pub ttft_p99: f64,
    /// Mean client-side TTFT: unlike a percentile it does not jump when a few requests cross
    /// it (on a cold start, p90 can sit on the edge between the cold prompts' queues and the
    /// rest), so it tells routers apart where p90 cannot.
    pub ttft_mean: f64,
    /// Engine-side TTFT from the workers' `vllm:time_to_first_token_seconds` histograms, pooled.
    pub engine_ttft: EngineTtft,
    pub e2e_p50: f64,
    pub e2e_p90: f64,
    /// Completed requests per model second.
    pub throughput: f64,
    /// Prompt tokens served from the workers' prefix caches / prompt tokens looked up.
    pub cache_hit_rate: f64,
    /// Mean `usage.prompt_tokens` (chat template applied, as the workers tokenized it).
    pub prompt_tokens_mean: f64,
    /// Mean `usage.completion_tokens`.
    pub output_tokens_mean: f64,
    /// Requests whose `usage.completion_tokens` differed from the max_tokens they asked for
    /// (requests without usage are not counted).
    pub output_length_mismatches: usize,
    /// Every TTFT (model seconds), sorted, for CDF plots.
    pub ttfts: Vec<f64>,
}

/// Engine-side TTFT: what the workers measured from arrival to first token (model seconds), no
/// client, router or HTTP time in it.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct EngineTtft {
    /// Observations in the histograms.
    pub count: u64,
    /// sum / count.
    pub mean: f64,
    /// Linear interpolation inside the buckets, as Prometheus's `histogram_quantile` does.
    pub p50: f64,
    pub p90: f64,
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
    free_ports(1, &[])?.first().copied().context("no free port")
}

/// `n` distinct ports that were free a moment ago on 127.0.0.1, none of them in `avoid`: each
/// listener is held until all are bound (separate [`free_port`] calls can repeat a port).
pub fn free_ports(n: usize, avoid: &[u16]) -> anyhow::Result<Vec<u16>> {
    let mut held = Vec::new();
    let mut ports = Vec::new();
    while ports.len() < n {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        if !avoid.contains(&port) {
            ports.push(port);
        }
        held.push(listener);
    }
    Ok(ports)
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
            "--gpu",
            config.gpu.flag(),
            "--block-size",
            &config.block_size.to_string(),
        ])
        .args(
            config
                .num_blocks
                .map(|blocks| ["--num-blocks".to_owned(), blocks.to_string()])
                .into_iter()
                .flatten(),
        )
        .args(
            (!config.worker_speed.is_empty())
                .then(|| {
                    let speeds: Vec<String> =
                        config.worker_speed.iter().map(f64::to_string).collect();
                    ["--worker-speed".to_owned(), speeds.join(",")]
                })
                .into_iter()
                .flatten(),
        )
        .args((!config.kv_events).then_some("--no-kv-events"))
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

/// A running router under test (a child process or tasks in this one), stopped when dropped.
struct RouterUnderTest {
    _processes: Vec<Killed>,
    _in_process: Option<peers::Running>,
}

/// Start the router in front of `sim`; returns its base URLs (one per replica) and handle.
async fn start_router(
    config: &RunConfig,
    router: RouterKind,
    sim: &Sim,
    dir: &Path,
) -> anyhow::Result<(Vec<String>, RouterUnderTest)> {
    let port = free_port()?;
    let url = format!("http://127.0.0.1:{port}");
    let (child, ready) = match router.launch() {
        Launch::Switchyard(policy, replicas) => {
            let endpoints: Vec<String> = sim
                .workers
                .iter()
                .map(|(http, events, replay)| {
                    if events.is_empty() {
                        format!("\"{http}\"")
                    } else {
                        format!(
                            "{{address: \"{http}\", kvEvents: \"{events}\", kvReplay: \"{replay}\"}}"
                        )
                    }
                })
                .collect();
            let yaml = format!(
                "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: sim}}\nspec:\n  model: {model}\n  loadBalancing: {policy}\n  blockSize: {block_size}\n  scrapeIntervalMs: 100\n  scoring: {{learnWorkerSpeed: {learn}, learnCoefficients: {learn_coefficients}, replicateSharedPrefixes: {replicate}, prefillMicrosPerToken: {prefill}, runningRequestMicros: {running}{tie}}}\n  endpoints: [{endpoints}]\n---\n\
                 apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: bench}}\nspec:\n  modelName: \"{model}\"\n  targets: [{{pool: sim}}]\n",
                model = sim.model,
                block_size = config.block_size,
                learn = config.learn_worker_speed,
                learn_coefficients = config.learn_coefficients,
                replicate = config.replicate_shared_prefixes,
                prefill = (300.0 * config.scoring_error).round() as u32,
                running = (500.0 * config.scoring_error).round() as u32,
                tie = config
                    .tie_tolerance_us
                    .map(|us| format!(", tieToleranceMicros: {us}"))
                    .unwrap_or_default(),
                endpoints = endpoints.join(", ")
            );
            let path = dir.join(format!("{}.yaml", router.name()));
            std::fs::write(&path, yaml)?;
            // Replicas share the workers and send each other their ledgers (`--peers`, every
            // replica's operator listener, itself included as a headless Service would list it),
            // tagged under a shared key, as the Helm chart's pods do.
            let replicas = replicas.max(1);
            let key = dir.join("peers-key");
            std::fs::write(&key, format!("{:032x}", rand::random::<u128>()))?;
            // Replica 0 serves on `port`; the others' and every admin port are distinct from it.
            let more = free_ports(2 * replicas - 1, &[port])?;
            let (admin_ports, replica_ports) = more.split_at(replicas);
            let admins: Vec<String> = admin_ports
                .iter()
                .map(|p| format!("127.0.0.1:{p}"))
                .collect();
            let mut processes = Vec::new();
            let mut urls = Vec::new();
            for (replica, admin) in admins.iter().enumerate() {
                let port = match replica.checked_sub(1) {
                    None => port,
                    Some(other) => replica_ports.get(other).copied().unwrap_or(port),
                };
                let (admin, peers) = if replicas > 1 && config.peer_interval_ms > 0 {
                    (
                        admin.clone(),
                        vec![
                            "--peers".to_owned(),
                            admins.join(","),
                            "--peer-interval-ms".to_owned(),
                            config.peer_interval_ms.to_string(),
                            "--peers-key-file".to_owned(),
                            key.display().to_string(),
                        ],
                    )
                } else {
                    ("off".to_owned(), Vec::new())
                };
                let (log_level, log) = match &config.proxy_log {
                    Some(dir) => {
                        std::fs::create_dir_all(dir)?;
                        let name = format!(
                            "{}-seed{}-{}-{replica}.log",
                            config.workload.name(),
                            config.seed,
                            router.name()
                        );
                        let file = std::fs::File::create(dir.join(&name))
                            .with_context(|| format!("creating {}", dir.join(name).display()))?;
                        ("info,switchyard_proxy::observe=debug", Stdio::from(file))
                    }
                    None => ("warn", Stdio::null()),
                };
                let child = Command::new(config.bin_dir.join("switchyard-proxy"))
                    .arg("--config")
                    .arg(&path)
                    .args([
                        "--listen",
                        &format!("127.0.0.1:{port}"),
                        "--admin-listen",
                        &admin,
                        "--grace-period-s",
                        "0",
                    ])
                    .args(peers)
                    .env("RUST_LOG", log_level)
                    .stdout(Stdio::null())
                    .stderr(log)
                    .spawn()
                    .context("starting switchyard-proxy")?;
                processes.push(Killed(child));
                urls.push(format!("http://127.0.0.1:{port}"));
            }
            for url in &urls {
                wait_ready(&format!("{url}/ready"), Duration::from_secs(60)).await?;
            }
            return Ok((
                urls,
                RouterUnderTest {
                    _processes: processes,
                    _in_process: None,
                },
            ));
        }
        Launch::VllmRouter(policy) => {
            let executable = config
                .vllm_router
                .clone()
                .context("vllm-router is not installed")?;
            let urls: Vec<String> = sim
                .workers
                .iter()
                .map(|(http, _, _)| format!("http://{http}"))
                .collect();
            let mut extra = Vec::new();
            if policy == "kv_aware" {
                for (http, events, replay) in &sim.workers {
                    extra.push("--kv-event-source".to_owned());
                    extra.push(format!("http://{http}={events}"));
                    extra.push("--kv-event-replay-source".to_owned());
                    extra.push(format!("http://{http}={replay}"));
                }
                extra.extend([
                    "--kv-event-block-size".to_owned(),
                    config.block_size.to_string(),
                    "--kv-event-model".to_owned(),
                    sim.model.clone(),
                ]);
            }
            let child = spawn_vllm_router(&executable, &urls, policy, port, &extra)?;
            (child, format!("{url}/health"))
        }
        Launch::Peer(kind) => {
            let workers: Vec<WorkerAddress> = sim
                .workers
                .iter()
                .map(|(http, events, _)| WorkerAddress {
                    http: http.clone(),
                    kv_events: events.clone(),
                })
                .collect();
            let running = peers::start(kind, &workers, config.block_size, port, config.seed)
                .await
                .with_context(|| format!("starting {}", router.name()))?;
            wait_ready(&format!("{url}/health"), Duration::from_secs(60)).await?;
            return Ok((
                vec![url],
                RouterUnderTest {
                    _processes: Vec::new(),
                    _in_process: Some(running),
                },
            ));
        }
    };
    let child = Killed(child);
    wait_ready(&ready, Duration::from_secs(60)).await?;
    Ok((
        vec![url],
        RouterUnderTest {
            _processes: vec![child],
            _in_process: None,
        },
    ))
}

/// One answer as the client saw it.
struct Streamed {
    /// The first content chunk (none for a whole answer).
    ttft: Option<Duration>,
    e2e: Duration,
    text: String,
    /// `usage.prompt_tokens` and `usage.completion_tokens` of the final chunk.
    prompt_tokens: Option<u64>,
    output_tokens: Option<u64>,
}

/// Send one streamed chat request; TTFT is the first content chunk, the answer text is kept
/// for the next turn.
async fn stream_one(client: &reqwest::Client, url: &str, body: &Value) -> anyhow::Result<Streamed> {
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
    let (mut prompt_tokens, mut output_tokens) = (None, None);
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
                if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
                    prompt_tokens = usage.get("prompt_tokens").and_then(Value::as_u64);
                    output_tokens = usage.get("completion_tokens").and_then(Value::as_u64);
                }
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
    Ok(Streamed {
        ttft: Some(ttft),
        e2e: start.elapsed(),
        text,
        prompt_tokens,
        output_tokens,
    })
}

/// Send one chat request asking for the whole answer (the same request, `stream` false).
async fn whole_one(client: &reqwest::Client, url: &str, body: &Value) -> anyhow::Result<Streamed> {
    let mut body = body.clone();
    if let Some(fields) = body.as_object_mut() {
        fields.insert("stream".into(), Value::Bool(false));
        fields.remove("stream_options");
    }
    let start = Instant::now();
    let response = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&body)
        .send()
        .await?;
    if !response.status().is_success() {
        bail!("status {}", response.status());
    }
    let answer: Value = response.json().await?;
    let text = answer
        .pointer("/choices/0/message/content")
        .and_then(Value::as_str)
        .context("no content in the answer")?
        .to_owned();
    Ok(Streamed {
        ttft: None,
        e2e: start.elapsed(),
        text,
        prompt_tokens: answer
            .pointer("/usage/prompt_tokens")
            .and_then(Value::as_u64),
        output_tokens: answer
            .pointer("/usage/completion_tokens")
            .and_then(Value::as_u64),
    })
}

/// Run a conversation's turns in order, the user thinking before each later turn; one sample
/// per turn. `whole`: its client asks for whole answers.
async fn run_conversation(
    client: &reqwest::Client,
    url: &str,
    model: &str,
    conversation: &Conversation,
    (scale, whole): (f64, bool),
    progress: &Progress,
) -> (Vec<Sample>, usize) {
    let mut answers = Vec::new();
    let mut samples = Vec::new();
    let mut errors = 0;
    for (index, turn) in conversation.turns.iter().enumerate() {
        if turn.think_s > 0.0 {
            // Model seconds of think time, slept in wall time like everything else.
            tokio::time::sleep(Duration::from_secs_f64(turn.think_s * scale)).await;
        }
        let body = conversation.request(model, index, &answers);
        let answer = if whole {
            whole_one(client, url, &body).await
        } else {
            stream_one(client, url, &body).await
        };
        match answer {
            Ok(streamed) => {
                samples.push(Sample {
                    ttft: streamed.ttft.map(|ttft| ttft.as_secs_f64() / scale),
                    e2e: streamed.e2e.as_secs_f64() / scale,
                    prompt_tokens: streamed.prompt_tokens,
                    output_tokens: streamed.output_tokens,
                    requested_tokens: turn.output_tokens,
                });
                answers.push(streamed.text);
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

/// The histogram the workers expose for engine-side TTFT.
const TTFT_HISTOGRAM: &str = "vllm:time_to_first_token_seconds";

/// What the workers' `/metrics` say after a run, summed over workers and label sets.
#[derive(Debug, Clone, Default)]
pub struct Scraped {
    pub prefix_hits: f64,
    pub prefix_queries: f64,
    /// Cumulative TTFT bucket counts by upper bound (`le`, +Inf as infinity).
    pub ttft_buckets: Vec<(f64, f64)>,
    pub ttft_sum: f64,
    pub ttft_count: f64,
}

/// The value of label `name` in a sample line's `{...}` label set.
fn label<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let labels = line.split_once('{')?.1.rsplit_once('}')?.0;
    let start = labels.find(&format!("{name}=\""))? + name.len() + 2;
    let rest = labels.get(start..)?;
    rest.get(..rest.find('"')?)
}

impl Scraped {
    /// Add one Prometheus text exposition (one worker's `/metrics`).
    pub fn add(&mut self, text: &str) {
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some(value) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else {
                continue;
            };
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            match name.strip_prefix(TTFT_HISTOGRAM) {
                Some("_bucket") => {
                    let Some(bound) = label(line, "le").and_then(|le| match le {
                        "+Inf" => Some(f64::INFINITY),
                        le => le.parse::<f64>().ok(),
                    }) else {
                        continue;
                    };
                    // Workers share vLLM's bucket bounds; pool counts per bound.
                    match self.ttft_buckets.iter_mut().find(|(b, _)| *b == bound) {
                        Some((_, count)) => *count += value,
                        None => self.ttft_buckets.push((bound, value)),
                    }
                }
                Some("_sum") => self.ttft_sum += value,
                Some("_count") => self.ttft_count += value,
                _ => match name {
                    "vllm:prefix_cache_hits_total" => self.prefix_hits += value,
                    "vllm:prefix_cache_queries_total" => self.prefix_queries += value,
                    _ => {}
                },
            }
        }
        self.ttft_buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    }

    pub fn cache_hit_rate(&self) -> f64 {
        if self.prefix_queries > 0.0 {
            self.prefix_hits / self.prefix_queries
        } else {
            0.0
        }
    }

    /// Quantile `q` of the pooled histogram by linear interpolation inside its bucket (the first
    /// bucket starts at 0; a rank in the +Inf bucket reads as the highest finite bound).
    pub fn ttft_quantile(&self, q: f64) -> f64 {
        let total = self.ttft_count.max(
            self.ttft_buckets
                .iter()
                .map(|(_, count)| *count)
                .fold(0.0, f64::max),
        );
        if total <= 0.0 {
            return 0.0;
        }
        let rank = q.clamp(0.0, 1.0) * total;
        let (mut lower, mut below) = (0.0, 0.0);
        for (bound, cumulative) in &self.ttft_buckets {
            if *cumulative >= rank {
                if bound.is_infinite() {
                    return lower;
                }
                let inside = cumulative - below;
                if inside <= 0.0 {
                    return *bound;
                }
                return lower + (bound - lower) * (rank - below) / inside;
            }
            if bound.is_finite() {
                lower = *bound;
            }
            below = *cumulative;
        }
        lower
    }

    pub fn engine_ttft(&self) -> EngineTtft {
        EngineTtft {
            count: self.ttft_count as u64,
            mean: if self.ttft_count > 0.0 {
                self.ttft_sum / self.ttft_count
            } else {
                0.0
            },
            p50: self.ttft_quantile(0.5),
            p90: self.ttft_quantile(0.9),
        }
    }
}

async fn scrape(sim: &Sim) -> Scraped {
    let mut scraped = Scraped::default();
    for (http, _, _) in &sim.workers {
        let Ok(response) = reqwest::get(format!("http://{http}/metrics")).await else {
            continue;
        };
        if let Ok(text) = response.text().await {
            scraped.add(&text);
        }
    }
    scraped
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
    let (urls, _router) = start_router(config, router, &sim, &dir).await?;
    // Several replicas: each conversation talks to one, alternating.
    let url_of = |index: usize| {
        urls.get(index % urls.len().max(1))
            .cloned()
            .unwrap_or_default()
    };
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()?;
    let total: usize = conversations.iter().map(Conversation::requests).sum();
    let progress = Arc::new(Progress::new(&label, total));
    let scale = config.time_scale;
    let started = Instant::now();
    let mut tasks = Vec::new();
    let arrival = config.arrival();
    match arrival {
        Arrival::Concurrency { clients } => {
            let queue = Arc::new(Mutex::new(
                conversations
                    .iter()
                    .cloned()
                    .enumerate()
                    .collect::<VecDeque<_>>(),
            ));
            let share = config.whole_answers;
            for index in 0..clients.max(1) {
                let (queue, client, url, model, progress) = (
                    queue.clone(),
                    client.clone(),
                    url_of(index),
                    sim.model.clone(),
                    progress.clone(),
                );
                tasks.push(tokio::spawn(async move {
                    let (mut samples, mut errors) = (Vec::new(), 0);
                    loop {
                        let Some((number, conversation)) = queue.lock().await.pop_front() else {
                            break;
                        };
                        let (mut s, e) = run_conversation(
                            &client,
                            &url,
                            &model,
                            &conversation,
                            (scale, asks_whole(number, share)),
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
        Arrival::Poisson { .. } | Arrival::Bursts { .. } => {
            let starts = arrival.start_times(conversations.len(), config.seed);
            for (index, (conversation, at)) in conversations.iter().zip(starts).enumerate() {
                let conversation = conversation.clone();
                // Model time, slept in wall time.
                let start = started + Duration::from_secs_f64(at * scale);
                let (client, url, model, progress) = (
                    client.clone(),
                    url_of(index),
                    sim.model.clone(),
                    progress.clone(),
                );
                let whole = asks_whole(index, config.whole_answers);
                tasks.push(tokio::spawn(async move {
                    tokio::time::sleep_until(start.into()).await;
                    run_conversation(
                        &client,
                        &url,
                        &model,
                        &conversation,
                        (scale, whole),
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
    let mut ttfts: Vec<f64> = samples.iter().filter_map(|s| s.ttft).collect();
    let mut e2es: Vec<f64> = samples.iter().map(|s| s.e2e).collect();
    ttfts.sort_by(f64::total_cmp);
    e2es.sort_by(f64::total_cmp);
    let scraped = scrape(&sim).await;
    progress.finish();
    let mean = |values: &mut dyn Iterator<Item = u64>| {
        let (sum, n) = values.fold((0u64, 0u64), |(sum, n), v| (sum + v, n + 1));
        if n > 0 { sum as f64 / n as f64 } else { 0.0 }
    };
    let prompt_tokens_mean = mean(&mut samples.iter().filter_map(|s| s.prompt_tokens));
    let output_tokens_mean = mean(&mut samples.iter().filter_map(|s| s.output_tokens));
    let output_length_mismatches = samples
        .iter()
        .filter(|s| {
            s.output_tokens
                .is_some_and(|n| n != s.requested_tokens as u64)
        })
        .count();
    let engine_ttft = scraped.engine_ttft();
    println!(
        "{label}: {} requests, {errors} errors, TTFT p50 {:.3} s p90 {:.3} s (engine p50 {:.3} s), {:.0} s wall",
        samples.len(),
        quantile(&ttfts, 0.5),
        quantile(&ttfts, 0.9),
        engine_ttft.p50,
        started.elapsed().as_secs_f64()
    );
    if output_length_mismatches > 0 {
        println!(
            "{label}: {output_length_mismatches} answers did not have the requested length (usage.completion_tokens != max_tokens)"
        );
    }
    Ok(RouterResult {
        router: router.name().to_owned(),
        seed: config.seed,
        requests: samples.len(),
        errors,
        ttft_p50: quantile(&ttfts, 0.5),
        ttft_p90: quantile(&ttfts, 0.9),
        ttft_p99: quantile(&ttfts, 0.99),
        ttft_mean: ttfts.iter().sum::<f64>() / ttfts.len().max(1) as f64,
        engine_ttft,
        e2e_p50: quantile(&e2es, 0.5),
        e2e_p90: quantile(&e2es, 0.9),
        throughput: samples.len() as f64 / model_seconds.max(f64::MIN_POSITIVE),
        cache_hit_rate: scraped.cache_hit_rate(),
        prompt_tokens_mean,
        output_tokens_mean,
        output_length_mismatches,
        ttfts,
    })
}

/// The median of a statistic across seeds, and its range.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(values: impl IntoIterator<Item = f64>) -> Spread {
        let mut values: Vec<f64> = values.into_iter().collect();
        values.sort_by(f64::total_cmp);
        let n = values.len();
        let at = |i: usize| values.get(i).copied().unwrap_or(0.0);
        let median = match n {
            0 => 0.0,
            n if n % 2 == 1 => at(n / 2),
            n => (at(n / 2 - 1) + at(n / 2)) / 2.0,
        };
        Spread {
            median,
            min: at(0),
            max: at(n.saturating_sub(1)),
        }
    }
}

/// One router on one workload across seeds: medians and ranges of the per-seed results.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RouterSummary {
    pub router: String,
    pub seeds: Vec<u64>,
    /// Requests and errors over all seeds.
    pub requests: usize,
    pub errors: usize,
    pub ttft_p50: Spread,
    pub ttft_p90: Spread,
    pub ttft_p99: Spread,
    pub ttft_mean: Spread,
    /// TTFT p90 over every seed's requests together (NaN without any). Steadier than the
    /// median of the seeds' p90s where a seed's tail is a few requests caught in one or two
    /// overloads (bursty: the 20th slowest of 192); there the median jumps between runs of the
    /// same code.
    pub ttft_p90_pooled: f64,
    pub engine_ttft_mean: Spread,
    pub engine_ttft_p50: Spread,
    pub engine_ttft_p90: Spread,
    pub e2e_p50: Spread,
    pub throughput: Spread,
    pub cache_hit_rate: Spread,
    /// random's median TTFT / this router's median TTFT (higher is better; NaN without random).
    pub ttft_p50_vs_random: f64,
    pub ttft_p90_vs_random: f64,
}

/// Per-router summaries of per-seed results, routers in the order they first appear.
pub fn summarize(results: &[RouterResult]) -> Vec<RouterSummary> {
    let mut routers: Vec<&str> = Vec::new();
    for result in results {
        if !routers.contains(&result.router.as_str()) {
            routers.push(&result.router);
        }
    }
    let mut summaries: Vec<RouterSummary> = routers
        .iter()
        .map(|router| {
            let runs: Vec<&RouterResult> = results.iter().filter(|r| r.router == *router).collect();
            let spread = |f: fn(&RouterResult) -> f64| Spread::of(runs.iter().map(|r| f(r)));
            let mut pooled: Vec<f64> = runs.iter().flat_map(|r| r.ttfts.iter().copied()).collect();
            pooled.sort_by(f64::total_cmp);
            RouterSummary {
                router: (*router).to_owned(),
                seeds: runs.iter().map(|r| r.seed).collect(),
                requests: runs.iter().map(|r| r.requests).sum(),
                errors: runs.iter().map(|r| r.errors).sum(),
                ttft_p50: spread(|r| r.ttft_p50),
                ttft_p90: spread(|r| r.ttft_p90),
                ttft_p99: spread(|r| r.ttft_p99),
                ttft_mean: spread(|r| r.ttft_mean),
                ttft_p90_pooled: if pooled.is_empty() {
                    f64::NAN
                } else {
                    quantile(&pooled, 0.9)
                },
                engine_ttft_mean: spread(|r| r.engine_ttft.mean),
                engine_ttft_p50: spread(|r| r.engine_ttft.p50),
                engine_ttft_p90: spread(|r| r.engine_ttft.p90),
                e2e_p50: spread(|r| r.e2e_p50),
                throughput: spread(|r| r.throughput),
                cache_hit_rate: spread(|r| r.cache_hit_rate),
                ttft_p50_vs_random: f64::NAN,
                ttft_p90_vs_random: f64::NAN,
            }
        })
        .collect();
    let random = summaries
        .iter()
        .find(|s| s.router == RouterKind::Random.name())
        .map(|s| (s.ttft_p50.median, s.ttft_p90.median));
    for summary in &mut summaries {
        let ratio = |theirs: f64, ours: f64| if ours > 0.0 { theirs / ours } else { f64::NAN };
        if let Some((p50, p90)) = random {
            summary.ttft_p50_vs_random = ratio(p50, summary.ttft_p50.median);
            summary.ttft_p90_vs_random = ratio(p90, summary.ttft_p90.median);
        }
    }
    summaries
}

/// "median (min-max)", or just the median for one seed.
fn spread_cell(spread: &Spread, seeds: usize) -> String {
    if seeds > 1 {
        format!("{:.3} ({:.2}-{:.2})", spread.median, spread.min, spread.max)
    } else {
        format!("{:.3}", spread.median)
    }
}

/// Print one workload's table: client-side TTFT medians across seeds with their range, the
/// engine-side TTFT next to it, and ratios against random routing computed on the medians.
pub fn print_table(title: &str, summaries: &[RouterSummary]) {
    let seeds = summaries.iter().map(|s| s.seeds.len()).max().unwrap_or(1);
    let width = if seeds > 1 { 19 } else { 8 };
    println!("\n{title}");
    println!(
        "{:<18} {:>width$} {:>width$} {:>width$} {:>width$} | {:>8} {:>7} {:>7} | {:>8} {:>7} {:>8} {:>7} {:>7} {:>6}",
        "router",
        "TTFT p50",
        "p90",
        "p99",
        "mean",
        "eng mean",
        "p50",
        "p90",
        "e2e p50",
        "req/s",
        "hit rate",
        "p50 x",
        "p90 x",
        "errors"
    );
    for summary in summaries {
        println!(
            "{:<18} {:>width$} {:>width$} {:>width$} {:>width$} | {:>8.3} {:>7.3} {:>7.3} | {:>8.3} {:>7.2} {:>7.1}% {:>6.2}x {:>6.2}x {:>6}",
            summary.router,
            spread_cell(&summary.ttft_p50, seeds),
            spread_cell(&summary.ttft_p90, seeds),
            spread_cell(&summary.ttft_p99, seeds),
            spread_cell(&summary.ttft_mean, seeds),
            summary.engine_ttft_mean.median,
            summary.engine_ttft_p50.median,
            summary.engine_ttft_p90.median,
            summary.e2e_p50.median,
            summary.throughput.median,
            summary.cache_hit_rate.median * 100.0,
            summary.ttft_p50_vs_random,
            summary.ttft_p90_vs_random,
            summary.errors
        );
    }
    let across = if seeds > 1 {
        format!("medians over {seeds} seeds, (min-max) across seeds; ")
    } else {
        String::new()
    };
    println!(
        "({across}times in model seconds; TTFT = client side, first content chunk; eng = the workers' \
         own TTFT histogram, no router or HTTP in it; \"x\" = random's TTFT / this router's: higher is better)"
    );
}

/// One line for a workload: switchyard's median TTFT p50 and p90 divided by the best other
/// router's (below 1: switchyard is better; the oracle is not a router anyone can run, so it is
/// left out of "other" and given its own ratio). `None` without switchyard or another router.
pub fn headline(summaries: &[RouterSummary]) -> Option<String> {
    let ours = summaries.iter().find(|s| s.router == "switchyard")?;
    let others: Vec<&RouterSummary> = summaries
        .iter()
        .filter(|s| is_other_router(&s.router))
        .collect();
    let best = |metric: fn(&RouterSummary) -> f64| {
        others
            .iter()
            .map(|s| (metric(s), s.router.as_str()))
            .filter(|(v, _)| v.is_finite())
            .min_by(|a, b| a.0.total_cmp(&b.0))
    };
    let (p50, p50_router) = best(|s| s.ttft_p50.median)?;
    let (p90, p90_router) = best(|s| s.ttft_p90.median)?;
    let (mean, mean_router) = best(|s| s.ttft_mean.median)?;
    let mut line = format!(
        "switchyard / best other router: TTFT p50 {:.2}x ({p50_router}), p90 {:.2}x ({p90_router}), mean {:.2}x ({mean_router})",
        ours.ttft_p50.median / p50,
        ours.ttft_p90.median / p90,
        ours.ttft_mean.median / mean
    );
    if let Some(oracle) = summaries.iter().find(|s| s.router == "oracle") {
        line.push_str(&format!(
            "; / oracle: p50 {:.2}x, p90 {:.2}x, mean {:.2}x",
            ours.ttft_p50.median / oracle.ttft_p50.median,
            ours.ttft_p90.median / oracle.ttft_p90.median,
            ours.ttft_mean.median / oracle.ttft_mean.median
        ));
    }
    // Two replicas, each seeing only its own requests, against one proxy.
    let replicas = summaries.iter().find(|s| s.router == "switchyard-2");
    if let Some(replicas) = replicas {
        line.push_str(&format!(
            "; 2 replicas / 1: p50 {:.2}x, p90 {:.2}x, mean {:.2}x",
            replicas.ttft_p50.median / ours.ttft_p50.median,
            replicas.ttft_p90.median / ours.ttft_p90.median,
            replicas.ttft_mean.median / ours.ttft_mean.median
        ));
    }
    // The same p90 comparisons over every seed's requests pooled (where switchyard's clients
    // saw first tokens at all: whole answers show none).
    let pooled = best(|s| s.ttft_p90_pooled).filter(|_| ours.ttft_p90_pooled.is_finite());
    if let Some((pooled, pooled_router)) = pooled {
        let ratio = |theirs: f64| ours.ttft_p90_pooled / theirs;
        line.push_str(&format!(
            "; pooled p90: {:.2}x ({pooled_router})",
            ratio(pooled)
        ));
        if let Some(oracle) = summaries.iter().find(|s| s.router == "oracle") {
            line.push_str(&format!(", / oracle {:.2}x", ratio(oracle.ttft_p90_pooled)));
        }
        if let Some(replicas) = replicas {
            line.push_str(&format!(
                ", 2 replicas / 1 {:.2}x",
                replicas.ttft_p90_pooled / ours.ttft_p90_pooled
            ));
        }
    }
    Some(line)
}

/// Whether the router named `name` is one switchyard is measured against: not switchyard itself
/// (one proxy or several replicas) and not the oracle.
pub fn is_other_router(name: &str) -> bool {
    !name.starts_with(RouterKind::Switchyard.name()) && name != RouterKind::Oracle.name()
}

/// Start vllm-router on 127.0.0.1:`port` in front of `worker_urls` with `policy` and any
/// policy-specific `extra_args` (it waits for the workers' `/health` before it serves; poll its
/// own `/health`).
pub fn spawn_vllm_router(
    executable: &Path,
    worker_urls: &[String],
    policy: &str,
    port: u16,
    extra_args: &[String],
) -> anyhow::Result<Child> {
    let metrics_port = free_ports(1, &[port])?
        .first()
        .copied()
        .context("no free port for vllm-router's metrics")?;
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
        .args(extra_args)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_answer_conversations_are_the_share_asked_for_spread_evenly() {
        let whole = |share: f64| -> Vec<bool> { (0..8).map(|i| asks_whole(i, share)).collect() };
        assert_eq!(whole(0.0), [false; 8]);
        assert_eq!(whole(1.0), [true; 8]);
        assert_eq!(
            whole(0.5),
            [false, true, false, true, false, true, false, true]
        );
        assert_eq!(whole(0.25).iter().filter(|w| **w).count(), 2);
    }

    #[test]
    fn free_ports_are_distinct_and_avoid_the_ones_taken() {
        let taken = free_port().unwrap();
        let ports = free_ports(6, &[taken]).unwrap();
        assert_eq!(ports.len(), 6);
        assert!(!ports.contains(&taken));
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ports.len());
    }

    /// Two workers' histograms as the simulator writes them (cumulative buckets, vLLM's labels).
    fn worker(counts: &[(&str, u64)], sum: f64, count: u64) -> String {
        let labels = r#"model_name="m",engine="0""#;
        let mut text = String::from(
            "# HELP vllm:time_to_first_token_seconds x\n# TYPE vllm:time_to_first_token_seconds histogram\n",
        );
        for (le, n) in counts {
            text.push_str(&format!(
                "vllm:time_to_first_token_seconds_bucket{{{labels},le=\"{le}\"}} {n}\n"
            ));
        }
        text.push_str(&format!(
            "vllm:time_to_first_token_seconds_sum{{{labels}}} {sum}\nvllm:time_to_first_token_seconds_count{{{labels}}} {count}\n"
        ));
        text.push_str(&format!(
            "vllm:prefix_cache_queries_total{{{labels}}} 100\nvllm:prefix_cache_hits_total{{{labels}}} 25\n"
        ));
        text.push_str(&format!(
            "vllm:e2e_request_latency_seconds_bucket{{{labels},le=\"1.0\"}} 99\n"
        ));
        text
    }

    #[test]
    fn a_bursty_run_starts_its_conversations_in_the_workloads_bursts() {
        let size = WorkloadSize {
            requests: 16,
            groups: 2,
            prompt_tokens: 50,
            question_tokens: 5,
            system_prompt_tokens: 40,
            turn_tokens: 20,
            turns: 1,
            output_tokens: 8,
            output_sigma: 0.0,
            think_time_s: 0.0,
            zipf_prefixes: 4,
            zipf_exponent: 1.1,
            hot_suffix_tokens: 25,
            burst: 4,
            varied_output_sigma: 1.5,
        };
        let config = |workload: WorkloadKind| RunConfig {
            bin_dir: PathBuf::new(),
            workload,
            size,
            seed: 1,
            arrival: Arrival::Poisson { rate: 2.0 },
            time_scale: 0.2,
            workers: 3,
            gpu: GpuProfile::H100_80gb,
            num_blocks: None,
            block_size: 64,
            worker_speed: Vec::new(),
            learn_worker_speed: false,
            learn_coefficients: true,
            replicate_shared_prefixes: true,
            scoring_error: 1.0,
            tie_tolerance_us: None,
            peer_interval_ms: 20,
            vllm_router: None,
            whole_answers: 0.0,
            kv_events: true,
            proxy_log: None,
        };
        let bursty = config(WorkloadKind::Bursty).arrival();
        assert!(
            matches!(bursty, Arrival::Bursts { size: 4, .. }),
            "{bursty:?}"
        );
        let starts = bursty.start_times(16, 1);
        for burst in starts.chunks(4) {
            assert!(burst.iter().all(|at| *at == burst[0]), "{starts:?}");
        }
        // The capacity search's probes at other rates keep the bursts.
        let probed = RunConfig {
            arrival: config(WorkloadKind::Bursty).arrival.at_rate(5.0),
            ..config(WorkloadKind::Bursty)
        };
        assert!(matches!(
            probed.arrival(),
            Arrival::Bursts { size: 4, rate } if rate == 5.0
        ));
        // Other workloads arrive one conversation at a time.
        let plain = config(WorkloadKind::SharedPrefix).arrival();
        assert!(matches!(plain, Arrival::Poisson { .. }), "{plain:?}");
    }

    #[test]
    fn bursts_start_together_at_the_same_mean_rate() {
        let poisson = Arrival::Poisson { rate: 2.0 }.start_times(4000, 1);
        let bursts = Arrival::Poisson { rate: 2.0 }
            .in_bursts(8)
            .start_times(4000, 1);
        assert!(poisson.windows(2).all(|w| w[0] < w[1]));
        for burst in bursts.chunks(8) {
            assert!(burst.iter().all(|at| *at == burst[0]));
        }
        assert!(
            bursts
                .chunks(8)
                .collect::<Vec<_>>()
                .windows(2)
                .all(|w| w[0][0] < w[1][0])
        );
        // 4,000 conversations at 2 per second last about 2,000 seconds either way.
        for times in [&poisson, &bursts] {
            let last = times.last().copied().unwrap();
            assert!((1800.0..2200.0).contains(&last), "{last}");
        }
        assert!(matches!(
            Arrival::Poisson { rate: 2.0 }.in_bursts(1),
            Arrival::Poisson { .. }
        ));
        assert!(matches!(
            Arrival::Poisson { rate: 2.0 }.in_bursts(8).at_rate(3.0),
            Arrival::Bursts { rate: 3.0, size: 8 }
        ));
    }

    #[test]
    fn engine_ttft_pools_workers_and_interpolates_in_buckets() {
        let mut scraped = Scraped::default();
        // Worker 0: 4 requests at or under 0.1 s, 6 more by 0.5 s. Worker 1: 10 by 0.5 s.
        scraped.add(&worker(
            &[("0.1", 4), ("0.5", 10), ("1.0", 10), ("+Inf", 10)],
            2.0,
            10,
        ));
        scraped.add(&worker(
            &[("0.1", 0), ("0.5", 10), ("1.0", 10), ("+Inf", 10)],
            4.0,
            10,
        ));
        assert_eq!(scraped.ttft_count, 20.0);
        assert!((scraped.cache_hit_rate() - 0.25).abs() < 1e-9);
        let engine = scraped.engine_ttft();
        assert_eq!(engine.count, 20);
        assert!((engine.mean - 0.3).abs() < 1e-9);
        // Rank 10 of 20: 4 below 0.1, so 6 of the 16 inside (0.1, 0.5].
        assert!(
            (engine.p50 - (0.1 + 0.4 * 6.0 / 16.0)).abs() < 1e-9,
            "{engine:?}"
        );
        // Rank 18: 14 of the 16.
        assert!(
            (engine.p90 - (0.1 + 0.4 * 14.0 / 16.0)).abs() < 1e-9,
            "{engine:?}"
        );
    }

    #[test]
    fn engine_ttft_in_the_open_bucket_reads_as_the_highest_bound() {
        let mut scraped = Scraped::default();
        scraped.add(&worker(&[("1.0", 2), ("2.0", 2), ("+Inf", 4)], 9.0, 4));
        assert_eq!(scraped.ttft_quantile(0.9), 2.0);
        // Within the first bucket, interpolation starts at 0.
        assert!((scraped.ttft_quantile(0.25) - 0.5).abs() < 1e-9);
        assert_eq!(Scraped::default().engine_ttft().p50, 0.0);
    }

    #[test]
    fn the_headline_compares_with_the_best_other_router_and_the_oracle() {
        let summary_pooled = |router: &str, p50: f64, p90: f64, mean: f64, pooled: f64| {
            let spread = |v: f64| Spread {
                median: v,
                min: v,
                max: v,
            };
            RouterSummary {
                router: router.into(),
                seeds: vec![1],
                requests: 1,
                errors: 0,
                ttft_p50: spread(p50),
                ttft_p90: spread(p90),
                ttft_p99: spread(p90),
                ttft_mean: spread(mean),
                ttft_p90_pooled: pooled,
                engine_ttft_mean: spread(p50),
                engine_ttft_p50: spread(p50),
                engine_ttft_p90: spread(p90),
                e2e_p50: spread(p50),
                throughput: spread(1.0),
                cache_hit_rate: spread(0.0),
                ttft_p50_vs_random: f64::NAN,
                ttft_p90_vs_random: f64::NAN,
            }
        };
        let summary = |router: &str, p50: f64, p90: f64, mean: f64| {
            summary_pooled(router, p50, p90, mean, f64::NAN)
        };
        let all = [
            summary("round-robin", 0.5, 2.0, 1.5),
            summary("switchyard", 1.0, 1.0, 0.9),
            summary("vllm-router", 2.0, 0.8, 1.2),
            summary("oracle", 0.25, 0.5, 0.4),
        ];
        assert_eq!(
            headline(&all).unwrap(),
            "switchyard / best other router: TTFT p50 2.00x (round-robin), p90 1.25x (vllm-router), mean 0.75x (vllm-router); / oracle: p50 4.00x, p90 2.00x, mean 2.25x"
        );
        assert_eq!(headline(&all[1..2]), None);
        // A second replica of switchyard is not another router: it is compared with one proxy.
        let with_replicas = [
            summary("round-robin", 0.5, 2.0, 1.5),
            summary("switchyard", 1.0, 1.0, 0.9),
            summary("switchyard-2", 0.4, 1.2, 0.99),
        ];
        assert_eq!(
            headline(&with_replicas).unwrap(),
            "switchyard / best other router: TTFT p50 2.00x (round-robin), p90 0.50x (round-robin), mean 0.60x (round-robin); 2 replicas / 1: p50 0.40x, p90 1.20x, mean 1.10x"
        );
        // With every seed's requests pooled as well: the same comparisons of their p90s.
        let pooled = [
            summary_pooled("round-robin", 0.5, 2.0, 1.5, 2.5),
            summary_pooled("vllm-router", 0.5, 2.0, 1.5, 1.6),
            summary_pooled("switchyard", 1.0, 1.0, 0.9, 1.2),
            summary_pooled("switchyard-2", 0.4, 1.2, 0.99, 1.32),
            summary_pooled("oracle", 0.25, 0.5, 0.4, 0.8),
        ];
        assert_eq!(
            headline(&pooled).unwrap(),
            "switchyard / best other router: TTFT p50 2.00x (round-robin), p90 0.50x (round-robin), mean 0.60x (round-robin); / oracle: p50 4.00x, p90 2.00x, mean 2.25x; 2 replicas / 1: p50 0.40x, p90 1.20x, mean 1.10x; pooled p90: 0.75x (vllm-router), / oracle 1.50x, 2 replicas / 1 1.10x"
        );
    }

    #[test]
    fn summaries_take_medians_over_seeds_and_ratios_on_medians() {
        let run = |router: &str, seed: u64, p50: f64| RouterResult {
            router: router.into(),
            seed,
            requests: 10,
            ttft_p50: p50,
            ttft_p90: 2.0 * p50,
            ttfts: (1..=10).map(|i| p50 * f64::from(i) / 5.0).collect(),
            ..RouterResult::default()
        };
        let results = [
            run("random", 1, 1.0),
            run("switchyard", 1, 0.2),
            run("random", 2, 3.0),
            run("switchyard", 2, 0.5),
            run("random", 3, 2.0),
            run("switchyard", 3, 0.25),
        ];
        let summaries = summarize(&results);
        assert_eq!(summaries.len(), 2);
        let ours = &summaries[1];
        assert_eq!(ours.router, "switchyard");
        assert_eq!(ours.seeds, [1, 2, 3]);
        assert_eq!(ours.requests, 30);
        assert_eq!(
            (ours.ttft_p50.median, ours.ttft_p50.min, ours.ttft_p50.max),
            (0.25, 0.2, 0.5)
        );
        // The 27th of the 30 requests in order (seed 2's 7th of ten).
        assert!((ours.ttft_p90_pooled - 0.7).abs() < 1e-9);
        assert!(
            summarize(&[RouterResult::default()])[0]
                .ttft_p90_pooled
                .is_nan()
        );
        assert!((ours.ttft_p50_vs_random - 8.0).abs() < 1e-9);
        assert!((summaries[0].ttft_p90_vs_random - 1.0).abs() < 1e-9);
        assert_eq!(Spread::of([4.0, 1.0]).median, 2.5);
    }
}
