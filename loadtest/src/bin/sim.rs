//! `switchyard-sim`: run N simulated vLLM workers, each with its own HTTP port, KV cache,
//! metrics and KV-event sockets. Prints one JSON line with every address once all are listening.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, ValueEnum};
use switchyard_kv::events::{HashEncoding, WireFormat};
use switchyard_kv::tokenize::PromptTokenizer;
use switchyard_loadtest::sim::http::Task;
use switchyard_loadtest::sim::{self, EngineConfig, GpuProfile, PublisherConfig, WorkerConfig};

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
    /// What the model does: `generate` (chat, completions, messages), or vLLM's pooling runner:
    /// `embed` (`/v1/embeddings`, `/pooling`, scores by similarity) or `score` (a cross-encoder:
    /// `/v1/score`, `/v1/rerank`, `/pooling`).
    #[arg(long, value_enum, default_value_t = Task::Generate)]
    task: Task,
    /// Keep Responses API answers in memory for `previous_response_id` and
    /// `GET /v1/responses/{id}`, as vLLM does with `VLLM_ENABLE_RESPONSES_API_STORE=1`.
    #[arg(long, env = "VLLM_ENABLE_RESPONSES_API_STORE", value_parser = clap::builder::BoolishValueParser::new(), default_value_t = false)]
    enable_responses_store: bool,
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
    /// The card each worker models: scheduler budgets, KV blocks and step costs as vLLM 0.34
    /// would have them there (the flags below override single figures).
    #[arg(long, value_enum, default_value_t = GpuProfile::L40s48gb)]
    gpu: GpuProfile,
    /// KV cache capacity per worker, in blocks (vLLM's null block included; default: the card's).
    #[arg(long)]
    num_blocks: Option<usize>,
    /// Tokens per KV block (default: vLLM's 64). Without --num-blocks, the card's KV memory is
    /// cut into blocks of this size, as vLLM sizes its pool.
    #[arg(long)]
    block_size: Option<usize>,
    /// Default: the card's (256 on an L40S, 1,024 on H100/H200).
    #[arg(long)]
    max_num_seqs: Option<usize>,
    /// Default: the card's (2,048 on an L40S, 8,192 on H100/H200).
    #[arg(long)]
    max_num_batched_tokens: Option<usize>,
    #[arg(long, default_value_t = 32_768)]
    max_model_len: usize,
    /// Tokens generated when a request sets no max_tokens.
    #[arg(long, default_value_t = 64)]
    default_max_tokens: usize,
    /// Seconds of weight GEMMs per batched token (default: the card's).
    #[arg(long)]
    prefill_s_per_token: Option<f64>,
    /// Seconds to read the weights once, the floor of every step (default: the card's).
    #[arg(long)]
    decode_base_s: Option<f64>,
    /// Step-time multiplier per worker, comma-separated (1.5: that worker is 1.5x slower); the
    /// last value repeats for the remaining workers. A heterogeneous fleet: `--worker-speed 1,1,1.5`.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    worker_speed: Vec<f64>,
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
    // The card's KV memory in blocks of the size asked for, unless --num-blocks says how many.
    let mut engine = args
        .gpu
        .engine_config_with_block_size(args.block_size.unwrap_or(sim::DEFAULT_BLOCK_SIZE));
    engine.time_scale = args.time_scale;
    engine.hash_seed = args.hash_seed;
    if let Some(num_blocks) = args.num_blocks {
        engine.num_blocks = num_blocks;
    }
    if let Some(max_num_seqs) = args.max_num_seqs {
        engine.max_num_seqs = max_num_seqs;
    }
    if let Some(max_num_batched_tokens) = args.max_num_batched_tokens {
        engine.max_num_batched_tokens = max_num_batched_tokens;
    }
    if let Some(prefill_s_per_token) = args.prefill_s_per_token {
        engine.latency.prefill_s_per_token = prefill_s_per_token;
    }
    if let Some(decode_base_s) = args.decode_base_s {
        engine.latency.decode_base_s = decode_base_s;
    }
    anyhow::ensure!(
        engine.block_size > 0 && engine.num_blocks > 1,
        "--block-size must be positive and --num-blocks above 1 (one is vLLM's null block)"
    );
    anyhow::ensure!(
        engine.max_num_seqs > 0 && engine.max_num_batched_tokens > 0,
        "--max-num-seqs and --max-num-batched-tokens must be positive"
    );
    anyhow::ensure!(
        args.worker_speed.iter().all(|s| *s > 0.0),
        "--worker-speed values must be positive"
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
                step_time_multiplier: args
                    .worker_speed
                    .get(index)
                    .or(args.worker_speed.last())
                    .copied()
                    .unwrap_or(1.0),
                ..engine.clone()
            },
            events,
            max_model_len: args.max_model_len,
            default_max_tokens: args.default_max_tokens,
            task: args.task,
            responses_store: args.enable_responses_store,
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
