//! A vLLM simulator: what a router sees of a vLLM server (HTTP API, metrics, KV events), driven
//! by a paged KV cache and a continuous-batching scheduler with a latency model instead of a GPU.
//!
//! Use [`start_worker`] to run one worker on the current tokio runtime; the `switchyard-sim`
//! binary starts several.

pub mod audio;
pub mod debug;
pub mod engine;
pub mod gpu;
pub mod http;
pub mod kv_cache;
pub mod metrics;
pub mod publisher;
pub mod responses;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::serve::ListenerExt;
use switchyard_kv::tokenize::PromptTokenizer;
use tokio::sync::mpsc;

pub use engine::{EngineConfig, EngineHandle, LatencyModel, Output, Prediction, StepShape};
pub use gpu::{DEFAULT_BLOCK_SIZE, GpuProfile};
pub use publisher::PublisherConfig;

/// Everything one simulated worker needs.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub model: String,
    /// HTTP address; port 0 picks a free one.
    pub listen: SocketAddr,
    pub engine: EngineConfig,
    /// KV events; none disables publishing.
    pub events: Option<PublisherConfig>,
    pub max_model_len: usize,
    pub default_max_tokens: usize,
    /// What the model does: generate, or embed (vLLM's pooling runner).
    pub task: http::Task,
    /// Keep responses for `previous_response_id` (vLLM's `VLLM_ENABLE_RESPONSES_API_STORE`).
    pub responses_store: bool,
}

/// Where a started worker can be reached.
#[derive(Debug, Clone, serde::Serialize)]
pub struct WorkerAddresses {
    pub http: String,
    pub kv_events: Option<String>,
    pub kv_replay: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Publisher(#[from] publisher::PublisherError),
}

/// Start a worker (engine, event publisher, HTTP server) on the current runtime.
pub async fn start_worker(
    config: WorkerConfig,
    tokenizer: Arc<PromptTokenizer>,
) -> Result<(WorkerAddresses, EngineHandle), StartError> {
    let (kv_events, kv_replay, events_tx) = match config.events {
        Some(publisher_config) => {
            let (tx, rx) = mpsc::unbounded_channel();
            let bound = publisher::start(publisher_config, rx).await?;
            (Some(bound.endpoint), bound.replay_endpoint, Some(tx))
        }
        None => (None, None, None),
    };
    let engine = engine::spawn(config.engine, events_tx);
    let (output_vocab, token_text) = http::Worker::output_vocabulary(&tokenizer);
    let worker = Arc::new(http::Worker {
        model: config.model,
        engine: engine.clone(),
        tokenizer,
        max_model_len: config.max_model_len,
        default_max_tokens: config.default_max_tokens,
        task: config.task,
        output_vocab: Arc::new(output_vocab),
        token_text: Arc::new(token_text),
        responses: responses::ResponseStore::new(config.responses_store),
    });
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| StartError::Listen {
            addr: config.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| StartError::Listen {
        addr: config.listen,
        source,
    })?;
    tokio::spawn(async move {
        if let Err(error) = axum::serve(nodelay(listener), http::router(worker)).await {
            tracing::error!(%error, "simulated worker HTTP server stopped");
        }
    });
    Ok((
        WorkerAddresses {
            http: addr.to_string(),
            kv_events,
            kv_replay,
        },
        engine,
    ))
}

/// `listener` with TCP_NODELAY set on every connection it accepts, as vLLM's server (uvicorn on
/// asyncio) sets it: without it a stream's first token waits behind the response head for the
/// client's delayed ACK (~40 ms on a reused connection), which vLLM never does.
pub(crate) fn nodelay(
    listener: tokio::net::TcpListener,
) -> impl axum::serve::Listener<Io = tokio::net::TcpStream, Addr = SocketAddr> {
    listener.tap_io(|stream| {
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, "TCP_NODELAY not set on an accepted connection");
        }
    })
}
