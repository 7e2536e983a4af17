//! `switchyard-sim`: run N simulated vLLM workers, each with its own HTTP port, KV cache,
//! metrics and KV-event sockets. Prints one JSON line with every address once all are listening.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, ValueEnum};
use switchyard_kv::events::{HashEncoding, WireFormat};
use switchyard_kv::tokenize::PromptTokenizer;
use switchyard_loadtest::sim::{self, EngineConfig, LatencyModel, PublisherConfig, WorkerConfig};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum EventFormat {
    /// Events as maps keyed by "type" (vLLM >= 0.24).
    Tagged,
    /// Events as positional arrays (vLLM <= 0.22).
    Positional,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum HashFormat {
    /// 64-bit ints (vLLM's default).
    Int,
    /// Raw 32-byte digests (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
    Bytes,
}

#[derive(Parser, Debug)]
#[command(
    name = "switchyard-sim",
    version,
    about = "Simulated vLLM workers for routers and benchmarks"
)]
struct Args {
    /// Number of workers.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// HTTP port of the first worker; worker i listens on port + i (0: any free port).
    #[arg(long, default_value_t = 8001)]
    port: u16,
    /// KV-event PUB port of the first worker (+ i per worker; 0: any free port).
    #[arg(long, default_value_t = 5557)]
    kv_events_port: u16,
    /// KV-event replay (ROUTER) port of the first worker (+ i per worker; 0: any free port).
    #[arg(long, default_value_t = 5657)]
    kv_replay_port: u16,
    /// Do not publish KV events.
    #[arg(long)]
    no_kv_events: bool,
    #[arg(long, value_enum, default_value_t = EventFormat::Tagged)]
    kv_events_format: EventFormat,
    #[arg(long, value_enum, default_value_t = HashFormat::Int)]
    kv_hash_format: HashFormat,
    /// ZMQ topic of the events.
    #[arg(long, default_value = "")]
    kv_topic: String,
    /// Served model name.
    #[arg(long, default_value = "Qwen/Qwen3-27B")]
    model: String,
    /// tokenizer.json (default: the shipped conf/tokenizer/tokenizer.json).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Jinja chat template (default: the shipped conf/tokenizer/chat_template.jinja).
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// Wall seconds per simulated second (0.01: a hundred times faster than the modelled GPU).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// KV cache capacity per worker, in blocks.
    #[arg(long, default_value_t = EngineConfig::default().num_blocks)]
    num_blocks: usize,
    #[arg(long, default_value_t = EngineConfig::default().block_size)]
    block_size: usize,
    #[arg(long, default_value_t = EngineConfig::default().max_num_seqs)]
    max_num_seqs: usize,
    #[arg(long, default_value_t = EngineConfig::default().max_num_batched_tokens)]
    max_num_batched_tokens: usize,
    #[arg(long, default_value_t = 32_768)]
    max_model_len: usize,
    /// Tokens generated when a request sets no max_tokens.
    #[arg(long, default_value_t = 64)]
    default_max_tokens: usize,
    /// Seconds of prefill per uncached prompt token.
    #[arg(long, default_value_t = LatencyModel::default().prefill_s_per_token)]
    prefill_s_per_token: f64,
    /// Seconds per decode step before batch and context costs.
    #[arg(long, default_value_t = LatencyModel::default().decode_base_s)]
    decode_base_s: f64,
    /// Seed of the simulated vLLM block hashes (vLLM's own hashes depend on its seed too).
    #[arg(long, default_value_t = 0)]
    hash_seed: u64,
}

fn shipped(file: &str) -> PathBuf {
    let relative = PathBuf::from("conf/tokenizer").join(file);
    if relative.exists() {
        return relative;
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(relative)
}

fn port(base: u16, index: usize) -> u16 {
    if base == 0 {
        0
    } else {
        base.saturating_add(index as u16)
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    anyhow::ensure!(args.time_scale > 0.0, "--time-scale must be positive");
    anyhow::ensure!(
        args.block_size > 0 && args.num_blocks > 0,
        "--block-size and --num-blocks must be positive"
    );

    let tokenizer_path = args
        .tokenizer
        .clone()
        .unwrap_or_else(|| shipped("tokenizer.json"));
    let template_path = args
        .chat_template
        .clone()
        .unwrap_or_else(|| shipped("chat_template.jinja"));
    let tokenizer = Arc::new(
        PromptTokenizer::from_files(&tokenizer_path, &template_path)
            .context("loading the tokenizer")?,
    );
    let latency = LatencyModel {
        prefill_s_per_token: args.prefill_s_per_token,
        decode_base_s: args.decode_base_s,
        ..LatencyModel::default()
    };
    let mut workers = Vec::with_capacity(args.workers);
    let mut engines = Vec::with_capacity(args.workers);
    for index in 0..args.workers {
        let events = (!args.no_kv_events).then(|| PublisherConfig {
            endpoint: format!("tcp://{}:{}", args.host, port(args.kv_events_port, index)),
            replay_endpoint: Some(format!(
                "tcp://{}:{}",
                args.host,
                port(args.kv_replay_port, index)
            )),
            topic: args.kv_topic.clone(),
            buffer_steps: 10_000,
            format: match args.kv_events_format {
                EventFormat::Tagged => WireFormat::Tagged,
                EventFormat::Positional => WireFormat::Positional,
            },
            hashes: match args.kv_hash_format {
                HashFormat::Int => HashEncoding::Int,
                HashFormat::Bytes => HashEncoding::Bytes,
            },
        });
        let config = WorkerConfig {
            model: args.model.clone(),
            listen: SocketAddr::new(args.host, port(args.port, index)),
            engine: EngineConfig {
                num_blocks: args.num_blocks,
                block_size: args.block_size,
                max_num_seqs: args.max_num_seqs,
                max_num_batched_tokens: args.max_num_batched_tokens,
                latency,
                time_scale: args.time_scale,
                hash_seed: args.hash_seed,
            },
            events,
            max_model_len: args.max_model_len,
            default_max_tokens: args.default_max_tokens,
        };
        let (addresses, engine) = sim::start_worker(config, tokenizer.clone())
            .await
            .with_context(|| format!("starting worker {index}"))?;
        tracing::info!(worker = index, http = %addresses.http, kv_events = ?addresses.kv_events, "simulated vLLM worker listening");
        workers.push(addresses);
        engines.push(engine);
    }
    println!(
        "{}",
        serde_json::json!({"model": args.model, "workers": workers})
    );
    tokio::signal::ctrl_c()
        .await
        .context("waiting for ctrl-c")?;
    drop(engines);
    Ok(())
}
