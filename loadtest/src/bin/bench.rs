//! `switchyard-bench`: Switchyard's benchmark harness.
//!
//! `switchyard-bench overhead` measures the latency and throughput the proxy adds in front of an
//! upstream that answers at once, against calling that upstream directly, in one run.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use serde_json::json;
use switchyard_kv::tokenize::PromptTokenizer;
use switchyard_loadtest::compare::{
    self, Arrival, Killed, RouterKind, RouterResult, RunConfig, Spread, free_port, wait_ready,
};
use switchyard_loadtest::overhead::{self, LoadResult};
use switchyard_loadtest::sim::GpuProfile;
use switchyard_loadtest::workload::{self, Conversation, WorkloadKind, WorkloadSize};

/// `--quick` sizes: six 1,000-token system prompts overflow one worker of 40 usable 64-token
/// blocks (2,560 tokens) but fit across three, so routing decides the hit rate.
const QUICK_PROMPT_TOKENS: usize = 1000;
const QUICK_QUESTION_TOKENS: usize = 16;
const QUICK_NUM_BLOCKS: usize = 41;

#[derive(Parser, Debug)]
#[command(name = "switchyard-bench", version, about = "Switchyard benchmarks")]
struct Args {
    #[command(subcommand)]
    command: Bench,
}

#[derive(Subcommand, Debug)]
enum Bench {
    /// Routers side by side on the same workloads against fresh simulated vLLM workers.
    Compare(Box<CompareArgs>),
    /// Proxy overhead: direct vs through switchyard-proxy, same load, interleaved rounds.
    Overhead {
        /// Concurrent closed-loop clients.
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
        /// Seconds per round per target.
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        /// Rounds (each runs direct, then proxied).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// The switchyard-proxy binary (default: next to this one).
        #[arg(long)]
        proxy_bin: Option<PathBuf>,
        /// Write the results as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

#[derive(clap::Args, Debug)]
struct CompareArgs {
    /// Workloads to run (default: the three published ones; see --all-workloads).
    #[arg(long, value_enum, num_args = 1.., default_values_t = [WorkloadKind::SharedPrefix, WorkloadKind::MultiTurn, WorkloadKind::NoShared])]
    workloads: Vec<WorkloadKind>,
    /// Every workload: the published three, then zipf-prefix, hot-prefix, bursty, varied-output,
    /// heterogeneous and mixed (about 3x as long).
    #[arg(long, conflicts_with = "workloads")]
    all_workloads: bool,
    #[arg(long, value_enum, num_args = 1.., default_values_t = [RouterKind::Random, RouterKind::RoundRobin, RouterKind::LeastOutstanding, RouterKind::Switchyard, RouterKind::VllmRouter, RouterKind::VllmRouterPow2, RouterKind::VllmRouterKv, RouterKind::Llmd, RouterKind::Dynamo, RouterKind::Oracle])]
    routers: Vec<RouterKind>,
    /// Requests per workload (per seed).
    #[arg(long, default_value_t = 128)]
    requests: usize,
    /// shared-prefix: distinct system prompts.
    #[arg(long, default_value_t = 16)]
    groups: usize,
    /// Tokens per shared system prompt (shared-prefix) or per prompt (no-shared). All text sizes
    /// are content tokens of the shipped tokenizer (conf/tokenizer), before the chat template.
    #[arg(long, default_value_t = 2000)]
    prompt_tokens: usize,
    /// shared-prefix: tokens of each request's unique question.
    #[arg(long, default_value_t = 30)]
    question_tokens: usize,
    /// multi-turn: tokens of the system prompt every conversation opens with.
    #[arg(long, default_value_t = 1000)]
    system_prompt_tokens: usize,
    /// multi-turn: tokens of each user turn.
    #[arg(long, default_value_t = 150)]
    turn_tokens: usize,
    /// multi-turn: turns per conversation.
    #[arg(long, default_value_t = 6)]
    turns: usize,
    /// multi-turn: mean think time between an answer and the next turn, model seconds
    /// (exponential).
    #[arg(long, default_value_t = 2.0)]
    think_time_s: f64,
    /// Mean output tokens per request: lengths are lognormal around it, clamped to [1, 8 x mean],
    /// and each request asks for exactly its length (max_tokens = min_tokens, ignore_eos).
    #[arg(long, default_value_t = 32)]
    output_tokens: usize,
    /// Sigma of the normal under the lognormal output length (0: every request gets the mean).
    #[arg(long, default_value_t = 0.5)]
    output_sigma: f64,
    /// zipf-prefix: distinct system prompts of --prompt-tokens each (48 x 2,000 tokens is more
    /// than one L40S worker's cache holds, less than three hold).
    #[arg(long, default_value_t = 48)]
    zipf_prefixes: usize,
    /// zipf-prefix: popularity exponent s (the k-th most popular prompt is drawn ∝ 1/k^s).
    #[arg(long, default_value_t = 1.1)]
    zipf_exponent: f64,
    /// hot-prefix: tokens of each request's unique part after the one shared system prompt
    /// (1,000: at 2 requests per second one L40S worker would spend most of its time on them).
    #[arg(long, default_value_t = 1000)]
    hot_suffix_tokens: usize,
    /// bursty: conversations per burst (bursts arrive at --rate / burst).
    #[arg(long, default_value_t = 8)]
    burst: usize,
    /// varied-output: sigma of the lognormal output lengths (heavy-tailed; clamped to 8x mean).
    #[arg(long, default_value_t = 1.5)]
    varied_output_sigma: f64,
    /// Poisson arrivals at this many requests per model second (default: closed loop).
    #[arg(long)]
    rate: Option<f64>,
    /// Closed-loop clients when no --rate is given.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Capacity search: the lowest and highest Poisson rate to consider (per model second,
    /// `LO,HI`). Each router's capacity, the highest rate whose median TTFT p90 over the seeds
    /// meets --slo-p90-s without errors, is found by bisection between them.
    #[arg(long, value_delimiter = ',')]
    capacity: Vec<f64>,
    /// Bisection steps after probing both ends (the result is within (HI - LO) / 2^steps).
    #[arg(long, default_value_t = 4)]
    capacity_steps: usize,
    /// The TTFT target of the capacity search: p90 at or below this many model seconds.
    #[arg(long, default_value_t = 2.0)]
    slo_p90_s: f64,
    /// Wall seconds per model second. Wall-clock overheads (client, proxy, tokenizers) are divided
    /// by it too: on a small machine keep it at 0.2 or above or they distort the model's times.
    #[arg(long, default_value_t = 0.2)]
    time_scale: f64,
    /// Seeds: every comparison runs once per seed, and the table shows medians across them.
    #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = [1, 2, 3])]
    seeds: Vec<u64>,
    /// One seed only (shorthand for --seeds N).
    #[arg(long, conflicts_with = "seeds")]
    seed: Option<u64>,
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// The card each simulated worker models (vLLM's budgets, KV blocks and step costs there).
    #[arg(long, value_enum, default_value_t = GpuProfile::L40s48gb)]
    gpu: GpuProfile,
    /// KV blocks per simulated worker, vLLM's null block included (default: what vLLM would
    /// have on the card: 904 on an L40S, ~58k tokens).
    #[arg(long)]
    num_blocks: Option<usize>,
    /// Tokens per KV block, given to the simulator and to the pool (`blockSize`) so their block
    /// hashes agree (64 is vLLM's default and the pool's).
    #[arg(long, default_value_t = 64)]
    block_size: usize,
    /// A heterogeneous fleet: step-time multiplier per simulated worker, the last repeating
    /// (`1,1,1.5`: the third worker is 1.5x slower).
    #[arg(long, value_delimiter = ',')]
    worker_speed: Vec<f64>,
    /// Switchyard's pool predicts every worker at the pool's speed instead of learning each
    /// one's (`scoring.learnWorkerSpeed: false`).
    #[arg(long)]
    no_learn_worker_speed: bool,
    /// Switchyard's pool keeps its configured coefficients instead of learning them from its
    /// answers (`scoring.learnCoefficients: false`).
    #[arg(long)]
    no_learn_coefficients: bool,
    /// Switchyard's pool charges every copy of a prefix in full, shared by the traffic or not
    /// (`scoring.replicateSharedPrefixes: false`).
    #[arg(long)]
    no_replicate_shared_prefixes: bool,
    /// Configure switchyard's pool with the default TTFT coefficients times this factor (2: a
    /// model 2x off), to measure what learning them is worth.
    #[arg(long, default_value_t = 1.0)]
    scoring_error: f64,
    /// Switchyard's pool's `scoring.tieToleranceMicros` (default: the pool's default, 5,000).
    #[arg(long)]
    tie_tolerance_us: Option<u32>,
    /// switchyard-2: how often each replica repeats an unchanged routing ledger to the other,
    /// in wall milliseconds (the proxy's `--peer-interval-ms`; changes go out at once).
    /// Default: the proxy's 100 ms of model time, i.e. 100 x --time-scale (20 ms at 0.2), so a
    /// replica silent for ten of them is forgotten as late as in a real deployment. 0: the
    /// replicas share no ledgers at all.
    #[arg(long)]
    peer_interval_ms: Option<u64>,
    /// The share of conversations (0 up to 1, spread evenly) whose client asks for whole answers
    /// (`stream: false`): their requests count in the engine's TTFT and in e2e, not in the
    /// client-side TTFT columns (a whole answer shows its client no first token).
    #[arg(long, default_value_t = 0.0)]
    whole_answers: f64,
    /// The simulated workers publish no KV events, as vLLM without `--kv-events-config`:
    /// switchyard's pool names none (it is left with what it routed), and the routers that
    /// need them (vllm-router-kv, llm-d, dynamo) are refused.
    #[arg(long)]
    no_kv_events: bool,
    /// Write switchyard's proxy logs here (one file per workload, seed, router and replica):
    /// each request's line (worker, status, TTFT, duration) and its routing decision with every
    /// worker's numbers. For finding why a request was slow; off by default.
    #[arg(long)]
    proxy_log: Option<PathBuf>,
    /// Results as JSON.
    #[arg(long, default_value = "bench-results/compare.json")]
    json: PathBuf,
    /// CI mode: a small shared-prefix run of random vs switchyard on one seed, well under a
    /// minute; fails unless switchyard's prefix-cache hit rate is at least 1.5x random's.
    #[arg(long)]
    quick: bool,
}

fn sibling(name: &str) -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join(name)))
        .unwrap_or_else(|| PathBuf::from(name))
}

/// The checkout this binary was built in (`<root>/target/<profile>/switchyard-bench`).
/// The checkout the binary belongs to: an ancestor of the executable holding
/// `loadtest/plot.py` (target/<profile>/switchyard-bench), else the source tree it was built
/// from (a CARGO_TARGET_DIR outside the checkout), else the working directory.
fn project_root() -> PathBuf {
    let is_root = |dir: &std::path::Path| dir.join("loadtest/plot.py").is_file();
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.ancestors().find(|dir| is_root(dir)).map(PathBuf::from))
        .or_else(|| {
            let built_from = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
            built_from
                .parent()
                .filter(|dir| is_root(dir))
                .map(PathBuf::from)
        })
        .unwrap_or_else(|| PathBuf::from("."))
}

fn row(name: &str, result: &LoadResult) {
    println!(
        "{name:<12} {:>9.0} {:>9.3} {:>9.3} {:>9.3} {:>8}",
        result.requests_per_second(),
        result.p50_ms,
        result.p90_ms,
        result.p99_ms,
        result.errors
    );
}

async fn overhead_bench(
    concurrency: usize,
    seconds: f64,
    rounds: usize,
    proxy_bin: Option<PathBuf>,
    json_out: Option<PathBuf>,
) -> anyhow::Result<()> {
    let model = "bench-model";
    let upstream = overhead::start_fast_upstream(model).await?;
    let dir = std::env::temp_dir().join(format!("switchyard-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let config = dir.join("overhead.yaml");
    std::fs::write(
        &config,
        format!(
            "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: fast}}\nspec: {{model: {model}, endpoints: [\"{upstream}\"]}}\n---\n\
             apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: alias}}\nspec: {{modelName: alias, targets: [{{pool: fast}}]}}\n"
        ),
    )?;
    let port = free_port()?;
    let proxy_bin = proxy_bin.unwrap_or_else(|| sibling("switchyard-proxy"));
    let _proxy = Killed(
        Command::new(&proxy_bin)
            .arg("--config")
            .arg(&config)
            .args([
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--admin-listen",
                "off",
            ])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", proxy_bin.display()))?,
    );
    wait_ready(
        &format!("http://127.0.0.1:{port}/ready"),
        Duration::from_secs(30),
    )
    .await?;

    // vllm-router in front of the same upstream, when installed (round_robin: its cheapest policy).
    let root = project_root();
    let mut peer = None;
    if let Some(executable) = compare::find_vllm_router(&root) {
        let peer_port = free_port()?;
        let child = Killed(compare::spawn_vllm_router(
            &executable,
            &[format!("http://{upstream}")],
            "round_robin",
            peer_port,
            &[],
        )?);
        wait_ready(
            &format!("http://127.0.0.1:{peer_port}/health"),
            Duration::from_secs(60),
        )
        .await?;
        peer = Some((
            child,
            format!("http://127.0.0.1:{peer_port}/v1/chat/completions"),
        ));
    } else {
        println!(
            "vllm-router: skipped (not installed; `pip install vllm-router` into .venv or PATH to include it)"
        );
    }

    let direct_url = format!("http://{upstream}/v1/chat/completions");
    let proxy_url = format!("http://127.0.0.1:{port}/v1/chat/completions");
    let request = |model: &str| json!({"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1});
    let duration = Duration::from_secs_f64(seconds);
    let mut targets: Vec<(&str, String, serde_json::Value)> = vec![
        ("direct", direct_url, request(model)),
        ("switchyard", proxy_url, request("alias")),
    ];
    if let Some((_, url)) = &peer {
        targets.push(("vllm-router", url.clone(), request(model)));
    }
    // Warm every path (connection pools, allocator) before measuring.
    for (_, url, body) in &targets {
        overhead::closed_loop(url, body, concurrency, Duration::from_millis(500)).await;
    }
    let mut rounds_by_target: Vec<Vec<LoadResult>> = vec![Vec::new(); targets.len()];
    for round in 0..rounds {
        eprintln!("round {}/{rounds}", round + 1);
        for ((_, url, body), results) in targets.iter().zip(rounds_by_target.iter_mut()) {
            results.push(overhead::closed_loop(url, body, concurrency, duration).await);
        }
    }
    let merged: Vec<LoadResult> = rounds_by_target
        .iter()
        .map(|r| overhead::merge(r))
        .collect();
    println!(
        "router overhead, {concurrency} concurrent clients, {rounds} x {seconds}s per target, loopback"
    );
    println!(
        "{:<12} {:>9} {:>9} {:>9} {:>9} {:>8}",
        "target", "req/s", "p50 ms", "p90 ms", "p99 ms", "errors"
    );
    for ((name, _, _), result) in targets.iter().zip(&merged) {
        row(name, result);
    }
    let direct = merged.first().cloned().unwrap_or_default();
    for ((name, _, _), result) in targets.iter().zip(&merged).skip(1) {
        println!(
            "{name}: added latency p50 +{:.3} ms, p99 +{:.3} ms; throughput {:.2}x direct",
            result.p50_ms - direct.p50_ms,
            result.p99_ms - direct.p99_ms,
            result.requests_per_second() / direct.requests_per_second().max(f64::MIN_POSITIVE)
        );
    }
    if let Some(path) = json_out {
        let report: serde_json::Map<String, serde_json::Value> = targets
            .iter()
            .zip(&merged)
            .map(|((name, _, _), result)| ((*name).to_owned(), json!(result)))
            .collect();
        std::fs::write(
            &path,
            serde_json::to_vec_pretty(&json!({"concurrency": concurrency, "targets": report}))?,
        )?;
    }
    drop(peer);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// One router's capacity search on one workload.
struct Search<'a> {
    runs: &'a [(RunConfig, Vec<Conversation>)],
    router: RouterKind,
    kind: WorkloadKind,
    slo_p90_s: f64,
}

impl Search<'_> {
    /// Run every seed at `rate`: whether the median p90 meets the target without errors, and
    /// the point for the report.
    async fn probe(&self, rate: f64) -> anyhow::Result<(bool, serde_json::Value)> {
        let mut per_seed = Vec::new();
        for (config, conversations) in self.runs {
            let probed = RunConfig {
                arrival: config.arrival.at_rate(rate),
                ..config.clone()
            };
            let label = format!(
                "{} capacity {} @ {rate:.3}/s seed {}",
                self.kind.name(),
                self.router.name(),
                config.seed
            );
            per_seed.push(compare::run(&probed, self.router, conversations, label).await?);
        }
        let p90 = Spread::of(per_seed.iter().map(|r| r.ttft_p90));
        let p50 = Spread::of(per_seed.iter().map(|r| r.ttft_p50));
        let errors: usize = per_seed.iter().map(|r| r.errors).sum();
        let seeds: Vec<serde_json::Value> = per_seed
            .iter()
            .map(|r| json!({"seed": r.seed, "ttft_p50": r.ttft_p50, "ttft_p90": r.ttft_p90, "errors": r.errors}))
            .collect();
        let meets = p90.median <= self.slo_p90_s && errors == 0;
        Ok((
            meets,
            json!({"rate": rate, "ttft_p90": p90.median, "ttft_p50": p50.median, "ttft_p90_spread": p90, "errors": errors, "meets": meets, "seeds": seeds}),
        ))
    }

    /// The highest rate in `[low, high]` that meets the target, to within
    /// `(high - low) / 2^steps`: `high` when even it meets, 0 when `low` does not. Returns the
    /// points probed, sorted by rate.
    async fn bisect(
        &self,
        low: f64,
        high: f64,
        steps: usize,
    ) -> anyhow::Result<(f64, Vec<serde_json::Value>)> {
        let mut points = Vec::new();
        let (meets_high, point) = self.probe(high).await?;
        points.push(point);
        let best = if meets_high {
            high
        } else {
            let (meets_low, point) = self.probe(low).await?;
            points.push(point);
            if !meets_low {
                0.0
            } else {
                let (mut good, mut bad) = (low, high);
                for _ in 0..steps {
                    let middle = (good + bad) / 2.0;
                    let (meets, point) = self.probe(middle).await?;
                    points.push(point);
                    if meets {
                        good = middle;
                    } else {
                        bad = middle;
                    }
                }
                good
            }
        };
        points.sort_by(|a, b| {
            let rate = |p: &serde_json::Value| p["rate"].as_f64().unwrap_or(0.0);
            rate(a).total_cmp(&rate(b))
        });
        Ok((best, points))
    }
}

/// PNG plots next to the JSON, drawn by loadtest/plot.py with matplotlib (the project's .venv
/// has it; otherwise `python3`). Missing Python or matplotlib only skips the plots.
fn plot(root: &std::path::Path, json: &std::path::Path) {
    let venv = root.join(".venv/bin/python");
    let python = if venv.exists() {
        venv
    } else {
        PathBuf::from("python3")
    };
    let out_dir = json
        .parent()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    match Command::new(&python)
        .arg(root.join("loadtest/plot.py"))
        .arg(json)
        .arg(&out_dir)
        .output()
    {
        Ok(output) if output.status.success() => {
            for line in String::from_utf8_lossy(&output.stdout).lines() {
                println!("plot written to {line}");
            }
        }
        Ok(output) => println!(
            "plots skipped: {}",
            String::from_utf8_lossy(&output.stderr)
                .lines()
                .last()
                .unwrap_or("plot.py failed")
        ),
        Err(error) => println!("plots skipped: cannot run {}: {error}", python.display()),
    }
}

async fn compare_bench(mut args: CompareArgs) -> anyhow::Result<()> {
    if let Some(seed) = args.seed {
        args.seeds = vec![seed];
    }
    if args.seeds.is_empty() {
        args.seeds = vec![1];
    }
    if !(0.0..1.0).contains(&args.whole_answers) {
        bail!(
            "--whole-answers is a share from 0 up to (not including) 1: the client TTFT columns need some conversations that stream"
        );
    }
    if !args.capacity.is_empty()
        && !matches!(args.capacity[..], [low, high] if 0.0 < low && low < high)
    {
        bail!("--capacity takes two rates LO,HI with 0 < LO < HI");
    }
    if !(args.scoring_error.is_finite() && args.scoring_error > 0.0) {
        bail!("--scoring-error takes a positive factor");
    }
    if args.all_workloads {
        args.workloads = WorkloadKind::ALL.to_vec();
    }
    if args.no_kv_events
        && let Some(router) = args.routers.iter().find(|r| r.needs_kv_events())
    {
        bail!(
            "{} routes by the workers' KV events, which --no-kv-events turns off: leave it out",
            router.name()
        );
    }
    if args.quick {
        args.workloads = vec![WorkloadKind::SharedPrefix];
        args.routers = vec![RouterKind::Random, RouterKind::Switchyard];
        args.seeds.truncate(1);
        (
            args.requests,
            args.groups,
            args.prompt_tokens,
            args.question_tokens,
        ) = (48, 6, QUICK_PROMPT_TOKENS, QUICK_QUESTION_TOKENS);
        (
            args.output_tokens,
            args.concurrency,
            args.num_blocks,
            args.time_scale,
        ) = (8, 6, Some(QUICK_NUM_BLOCKS), 0.1);
        args.block_size = 64;
        args.capacity.clear();
    }
    let bin_dir = std::env::current_exe()?
        .parent()
        .map(PathBuf::from)
        .context("binary directory")?;
    let root = project_root();
    let vllm_router = compare::find_vllm_router(&root);
    if vllm_router.is_none() {
        for router in args.routers.iter().filter(|r| r.is_vllm_router()) {
            println!(
                "{}: skipped (vllm-router is not installed; `pip install vllm-router` into .venv or PATH to include it)",
                router.name()
            );
        }
        args.routers.retain(|r| !r.is_vllm_router());
    }
    // The tokenizer the simulator and the proxy use, so workload sizes are their token counts.
    let tokenizer = PromptTokenizer::shipped().context("loading the shipped tokenizer")?;
    let size = WorkloadSize {
        requests: args.requests,
        groups: args.groups,
        prompt_tokens: args.prompt_tokens,
        question_tokens: args.question_tokens,
        system_prompt_tokens: args.system_prompt_tokens,
        turn_tokens: args.turn_tokens,
        turns: args.turns,
        output_tokens: args.output_tokens,
        output_sigma: args.output_sigma,
        think_time_s: args.think_time_s,
        zipf_prefixes: args.zipf_prefixes,
        zipf_exponent: args.zipf_exponent,
        hot_suffix_tokens: args.hot_suffix_tokens,
        burst: args.burst,
        varied_output_sigma: args.varied_output_sigma,
    };
    let arrival = match args.rate {
        Some(rate) => Arrival::Poisson { rate },
        None => Arrival::Concurrency {
            clients: args.concurrency,
        },
    };
    let seeds_text = args
        .seeds
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let mut report = serde_json::Map::new();
    let mut quick_failure = None;
    for kind in &args.workloads {
        let mut runs: Vec<(RunConfig, Vec<Conversation>)> = Vec::new();
        for seed in &args.seeds {
            let conversations = workload::generate(*kind, size, *seed, &tokenizer)?;
            let config = RunConfig {
                bin_dir: bin_dir.clone(),
                workload: *kind,
                size,
                seed: *seed,
                arrival,
                time_scale: args.time_scale,
                workers: args.workers,
                gpu: args.gpu,
                num_blocks: args.num_blocks,
                block_size: args.block_size,
                worker_speed: kind
                    .worker_speeds(args.workers)
                    .unwrap_or_else(|| args.worker_speed.clone()),
                learn_worker_speed: !args.no_learn_worker_speed,
                learn_coefficients: !args.no_learn_coefficients,
                replicate_shared_prefixes: !args.no_replicate_shared_prefixes,
                scoring_error: args.scoring_error,
                tie_tolerance_us: args.tie_tolerance_us,
                peer_interval_ms: args
                    .peer_interval_ms
                    .unwrap_or(((100.0 * args.time_scale).round() as u64).max(1)),
                vllm_router: vllm_router.clone(),
                whole_answers: args.whole_answers,
                kv_events: !args.no_kv_events,
                proxy_log: args.proxy_log.clone(),
            };
            runs.push((config, conversations));
        }
        let mut results: Vec<RouterResult> = Vec::new();
        for (config, conversations) in &runs {
            for (index, router) in args.routers.iter().enumerate() {
                let label = format!(
                    "{} seed {} [{}/{}] {}",
                    kind.name(),
                    config.seed,
                    index + 1,
                    args.routers.len(),
                    router.name()
                );
                results.push(compare::run(config, *router, conversations, label).await?);
            }
        }
        let summaries = compare::summarize(&results);
        // The arrival the runs had (the workload's bursts included), not a second derivation.
        let arrival = runs.first().map_or(arrival, |(config, _)| config.arrival());
        let arrival_text = arrival.describe();
        // Every router sees the same prompts; pooled over all runs, weighted by requests.
        let weighted = |f: fn(&RouterResult) -> f64| {
            let requests: usize = results.iter().map(|r| r.requests).sum();
            let total: f64 = results.iter().map(|r| f(r) * r.requests as f64).sum();
            total / requests.max(1) as f64
        };
        let prompt_tokens_mean = weighted(|r| r.prompt_tokens_mean);
        let output_tokens_mean = weighted(|r| r.output_tokens_mean);
        compare::print_table(
            &format!(
                "{} ({} requests{}, {arrival_text}, {} workers{}{}, seeds {seeds_text}; prompts {prompt_tokens_mean:.0} tokens on average with the chat template (usage.prompt_tokens), outputs {output_tokens_mean:.1})",
                kind.name(),
                args.requests,
                if args.whole_answers > 0.0 {
                    format!(
                        ", {:.0}% of conversations asking for whole answers (client TTFT: the streamed ones only)",
                        args.whole_answers * 100.0
                    )
                } else {
                    String::new()
                },
                args.workers,
                match runs.first() {
                    Some((config, _)) if !config.worker_speed.is_empty() => {
                        let speeds: Vec<String> =
                            config.worker_speed.iter().map(f64::to_string).collect();
                        format!(" (step time x{})", speeds.join(","))
                    }
                    _ => String::new(),
                },
                if args.no_kv_events {
                    " publishing no KV events"
                } else {
                    ""
                },
            ),
            &summaries,
        );
        if let Some(line) = compare::headline(&summaries) {
            println!("{}: {line}", kind.name());
        }
        let mut capacity = serde_json::Map::new();
        if let [low, high] = args.capacity[..] {
            println!(
                "capacity ({}): highest rate with median TTFT p90 over seeds <= {} s, by bisection in [{low}, {high}]",
                kind.name(),
                args.slo_p90_s
            );
            for router in &args.routers {
                let search = Search {
                    runs: &runs,
                    router: *router,
                    kind: *kind,
                    slo_p90_s: args.slo_p90_s,
                };
                let (best, points) = search.bisect(low, high, args.capacity_steps).await?;
                let bound = if best >= high {
                    " (at least: the highest rate tried)"
                } else if best <= 0.0 {
                    " (below the lowest rate tried)"
                } else {
                    ""
                };
                println!("  {:<18} {best:>6.2} req/s{bound}", router.name());
                capacity.insert(
                    router.name().to_owned(),
                    json!({"capacity": best, "points": points}),
                );
            }
            // Switchyard's capacity over the best other router's (above 1: switchyard serves more).
            let of = |name: &str| capacity.get(name).and_then(|c| c["capacity"].as_f64());
            let best_other = capacity
                .iter()
                .filter(|(name, _)| compare::is_other_router(name))
                .filter_map(|(name, c)| Some((c["capacity"].as_f64()?, name.clone())))
                .max_by(|a, b| a.0.total_cmp(&b.0));
            if let (Some(ours), Some((theirs, name))) = (of("switchyard"), best_other)
                && theirs > 0.0
            {
                println!(
                    "{}: switchyard capacity / best other router's: {:.2}x ({name})",
                    kind.name(),
                    ours / theirs
                );
            }
        }
        if args.quick {
            let rate = |name: &str| {
                summaries
                    .iter()
                    .find(|r| r.router == name)
                    .map_or(0.0, |r| r.cache_hit_rate.median)
            };
            let (random, ours) = (rate("random"), rate("switchyard"));
            if ours < random * 1.5 {
                quick_failure = Some(format!(
                    "switchyard hit rate {ours:.2} is not 1.5x random's {random:.2}"
                ));
            } else {
                println!("quick check passed: switchyard hit rate {ours:.2} vs random {random:.2}");
            }
        }
        // `results` keeps every (seed, router) run; `summary` is what the table printed.
        report.insert(
            kind.name().to_owned(),
            json!({
                "size": size,
                "arrival": arrival,
                "whole_answers": args.whole_answers,
                "kv_events": !args.no_kv_events,
                "seeds": args.seeds,
                "prompt_tokens_mean": prompt_tokens_mean,
                "output_tokens_mean": output_tokens_mean,
                "results": results,
                "summary": summaries,
                "capacity": capacity,
            }),
        );
        // After every workload, so that a long run stopped part way keeps what it measured.
        if let Some(parent) = args.json.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(
            &args.json,
            serde_json::to_vec_pretty(&serde_json::Value::Object(report.clone()))?,
        )?;
    }
    println!("\nresults written to {}", args.json.display());
    plot(&root, &args.json);
    if let Some(failure) = quick_failure {
        bail!(failure);
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    match args.command {
        Bench::Compare(compare_args) => compare_bench(*compare_args).await,
        Bench::Overhead {
            concurrency,
            seconds,
            rounds,
            proxy_bin,
            json,
        } => overhead_bench(concurrency, seconds, rounds, proxy_bin, json).await,
    }
}
