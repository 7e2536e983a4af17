//! `switchyard-bench`: Switchyard's benchmark harness.
//!
//! `switchyard-bench overhead` measures the latency and throughput the proxy adds in front of an
//! upstream that answers at once, against calling that upstream directly, in one run.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use serde_json::json;
use switchyard_loadtest::overhead::{self, LoadResult};

#[derive(Parser, Debug)]
#[command(name = "switchyard-bench", version, about = "Switchyard benchmarks")]
struct Args {
    #[command(subcommand)]
    command: Bench,
}

#[derive(Subcommand, Debug)]
enum Bench {
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

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn sibling(name: &str) -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join(name)))
        .unwrap_or_else(|| PathBuf::from(name))
}

async fn wait_ready(url: &str, timeout: Duration) -> anyhow::Result<()> {
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
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

fn row(name: &str, result: &LoadResult) {
    println!(
        "{name:<10} {:>9.0} {:>9.3} {:>9.3} {:>9.3} {:>8}",
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
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
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

    let direct_url = format!("http://{upstream}/v1/chat/completions");
    let proxy_url = format!("http://127.0.0.1:{port}/v1/chat/completions");
    let request = |model: &str| json!({"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1});
    let duration = Duration::from_secs_f64(seconds);
    // Warm both paths (connection pools, allocator) before measuring.
    overhead::closed_loop(
        &direct_url,
        &request(model),
        concurrency,
        Duration::from_millis(500),
    )
    .await;
    overhead::closed_loop(
        &proxy_url,
        &request("alias"),
        concurrency,
        Duration::from_millis(500),
    )
    .await;
    let (mut direct, mut proxied) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        eprintln!("round {}/{rounds}", round + 1);
        direct
            .push(overhead::closed_loop(&direct_url, &request(model), concurrency, duration).await);
        proxied.push(
            overhead::closed_loop(&proxy_url, &request("alias"), concurrency, duration).await,
        );
    }
    let direct = overhead::merge(&direct);
    let proxied = overhead::merge(&proxied);
    println!(
        "proxy overhead, {concurrency} concurrent clients, {rounds} x {seconds}s per target, loopback"
    );
    println!(
        "{:<10} {:>9} {:>9} {:>9} {:>9} {:>8}",
        "target", "req/s", "p50 ms", "p90 ms", "p99 ms", "errors"
    );
    row("direct", &direct);
    row("proxied", &proxied);
    println!(
        "added latency: p50 +{:.3} ms, p99 +{:.3} ms; throughput ratio proxied/direct {:.2}",
        proxied.p50_ms - direct.p50_ms,
        proxied.p99_ms - direct.p99_ms,
        proxied.requests_per_second() / direct.requests_per_second().max(f64::MIN_POSITIVE)
    );
    if let Some(path) = json_out {
        std::fs::write(
            &path,
            serde_json::to_vec_pretty(
                &json!({"concurrency": concurrency, "direct": direct, "proxied": proxied}),
            )?,
        )?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    match args.command {
        Bench::Overhead {
            concurrency,
            seconds,
            rounds,
            proxy_bin,
            json,
        } => overhead_bench(concurrency, seconds, rounds, proxy_bin, json).await,
    }
}
