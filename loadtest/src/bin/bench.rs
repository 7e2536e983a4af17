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
use switchyard_loadtest::compare::{
    self, Arrival, Killed, RouterKind, RouterResult, RunConfig, free_port, wait_ready,
};
use switchyard_loadtest::overhead::{self, LoadResult};
use switchyard_loadtest::workload::{self, WorkloadKind, WorkloadSize};

#[derive(Parser, Debug)]
#[command(name = "switchyard-bench", version, about = "Switchyard benchmarks")]
struct Args {
    #[command(subcommand)]
    command: Bench,
}

#[derive(Subcommand, Debug)]
enum Bench {
    /// Routers side by side on the same workloads against fresh simulated vLLM workers.
    Compare(CompareArgs),
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
    #[arg(long, value_enum, num_args = 1.., default_values_t = [WorkloadKind::SharedPrefix, WorkloadKind::MultiTurn, WorkloadKind::NoShared])]
    workloads: Vec<WorkloadKind>,
    #[arg(long, value_enum, num_args = 1.., default_values_t = [RouterKind::Random, RouterKind::RoundRobin, RouterKind::LeastOutstanding, RouterKind::Switchyard, RouterKind::VllmRouter])]
    routers: Vec<RouterKind>,
    /// Requests per workload.
    #[arg(long, default_value_t = 128)]
    requests: usize,
    /// shared-prefix: distinct system prompts.
    #[arg(long, default_value_t = 16)]
    groups: usize,
    /// Words per shared system prompt (shared-prefix) or per prompt (no-shared).
    #[arg(long, default_value_t = 1500)]
    prompt_words: usize,
    #[arg(long, default_value_t = 20)]
    question_words: usize,
    /// multi-turn: turns per conversation.
    #[arg(long, default_value_t = 6)]
    turns: usize,
    #[arg(long, default_value_t = 32)]
    output_tokens: usize,
    /// Poisson arrivals at this many requests per model second (default: closed loop).
    #[arg(long)]
    rate: Option<f64>,
    /// Closed-loop clients when no --rate is given.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Capacity sweep: Poisson rates to try (comma separated, per model second).
    #[arg(long, value_delimiter = ',')]
    sweep_rates: Vec<f64>,
    /// The TTFT target of the capacity sweep: p90 at or below this many model seconds.
    #[arg(long, default_value_t = 2.0)]
    slo_p90_s: f64,
    /// Wall seconds per model second. Wall-clock overheads (client, proxy, tokenizers) are divided
    /// by it too: on a small machine keep it at 0.2 or above or they distort the model's times.
    #[arg(long, default_value_t = 0.2)]
    time_scale: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// KV blocks per simulated worker (the default makes 16 shared prompts overflow one worker
    /// but fit across three, where routing decides the hit rate).
    #[arg(long, default_value_t = 1500)]
    num_blocks: usize,
    /// Results as JSON.
    #[arg(long, default_value = "bench-results/compare.json")]
    json: PathBuf,
    /// CI mode: a small shared-prefix run of random vs switchyard, well under a minute; fails
    /// unless switchyard's prefix-cache hit rate is at least 1.5x random's.
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
            .args(["--listen", &format!("127.0.0.1:{port}")])
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
    if args.quick {
        args.workloads = vec![WorkloadKind::SharedPrefix];
        args.routers = vec![RouterKind::Random, RouterKind::Switchyard];
        (
            args.requests,
            args.groups,
            args.prompt_words,
            args.question_words,
        ) = (48, 6, 500, 8);
        (
            args.output_tokens,
            args.concurrency,
            args.num_blocks,
            args.time_scale,
        ) = (8, 6, 160, 0.1);
        args.sweep_rates.clear();
    }
    let bin_dir = std::env::current_exe()?
        .parent()
        .map(PathBuf::from)
        .context("binary directory")?;
    let root = project_root();
    let vllm_router = compare::find_vllm_router(&root);
    if args.routers.contains(&RouterKind::VllmRouter) && vllm_router.is_none() {
        println!(
            "vllm-router: skipped (not installed; `pip install vllm-router` into .venv or PATH to include it)"
        );
        args.routers.retain(|r| *r != RouterKind::VllmRouter);
    }
    let size = WorkloadSize {
        requests: args.requests,
        groups: args.groups,
        prompt_words: args.prompt_words,
        question_words: args.question_words,
        turns: args.turns,
        output_tokens: args.output_tokens,
    };
    let arrival = match args.rate {
        Some(rate) => Arrival::Poisson { rate },
        None => Arrival::Concurrency {
            clients: args.concurrency,
        },
    };
    let mut report = serde_json::Map::new();
    let mut quick_failure = None;
    for kind in &args.workloads {
        let conversations = workload::generate(*kind, size, args.seed);
        let config = RunConfig {
            bin_dir: bin_dir.clone(),
            workload: *kind,
            size,
            seed: args.seed,
            arrival,
            time_scale: args.time_scale,
            workers: args.workers,
            num_blocks: args.num_blocks,
            vllm_router: vllm_router.clone(),
        };
        let mut results: Vec<RouterResult> = Vec::new();
        for (index, router) in args.routers.iter().enumerate() {
            let label = format!(
                "{} [{}/{}] {}",
                kind.name(),
                index + 1,
                args.routers.len(),
                router.name()
            );
            results.push(compare::run(&config, *router, &conversations, label).await?);
        }
        let arrival_text = match arrival {
            Arrival::Poisson { rate } => format!("Poisson {rate} req/s"),
            Arrival::Concurrency { clients } => format!("{clients} concurrent clients"),
        };
        compare::print_table(
            &format!(
                "{} ({} requests, {arrival_text}, {} workers, seed {})",
                kind.name(),
                args.requests,
                args.workers,
                args.seed
            ),
            &results,
        );
        let mut capacity = serde_json::Map::new();
        if !args.sweep_rates.is_empty() {
            println!(
                "capacity ({}): highest rate with TTFT p90 <= {} s",
                kind.name(),
                args.slo_p90_s
            );
            let mut random_capacity = None;
            for router in &args.routers {
                let mut best = 0.0f64;
                let mut points = Vec::new();
                for rate in &args.sweep_rates {
                    let swept = RunConfig {
                        arrival: Arrival::Poisson { rate: *rate },
                        ..config.clone()
                    };
                    let label = format!("{} sweep {} @ {rate}/s", kind.name(), router.name());
                    let result = compare::run(&swept, *router, &conversations, label).await?;
                    if result.ttft_p90 <= args.slo_p90_s && result.errors == 0 {
                        best = best.max(*rate);
                    }
                    points.push(serde_json::json!({"rate": rate, "ttft_p90": result.ttft_p90, "ttft_p50": result.ttft_p50}));
                }
                if *router == RouterKind::Random {
                    random_capacity = Some(best);
                }
                let ratio = random_capacity
                    .filter(|r| *r > 0.0)
                    .map_or(f64::NAN, |r| best / r);
                println!(
                    "  {:<18} {best:>6.2} req/s  ({ratio:.2}x random)",
                    router.name()
                );
                capacity.insert(
                    router.name().to_owned(),
                    serde_json::json!({"capacity": best, "points": points}),
                );
            }
        }
        if args.quick {
            let rate = |name: &str| {
                results
                    .iter()
                    .find(|r| r.router == name)
                    .map_or(0.0, |r| r.cache_hit_rate)
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
        report.insert(
            kind.name().to_owned(),
            serde_json::json!({"size": size, "arrival": arrival, "results": results, "capacity": capacity}),
        );
    }
    if let Some(parent) = args.json.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(
        &args.json,
        serde_json::to_vec_pretty(&serde_json::Value::Object(report))?,
    )?;
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
        Bench::Compare(compare_args) => compare_bench(compare_args).await,
        Bench::Overhead {
            concurrency,
            seconds,
            rounds,
            proxy_bin,
            json,
        } => overhead_bench(concurrency, seconds, rounds, proxy_bin, json).await,
    }
}
