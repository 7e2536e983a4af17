//! The reverse proxy the re-implemented peers run in: it accepts an OpenAI chat request, asks a
//! [`Policy`] for a worker, forwards the body unchanged and streams the answer back unchanged
//! (status, content type and every body chunk as the worker sent it).
//!
//! A policy that keeps its own ledger of what it sent (Dynamo) gets a [`Lease`]: told when the
//! answer's first body chunk passes (a vLLM server sends nothing before the first token) and
//! dropped when the answer ends or the client goes away.

use std::sync::Arc;

use async_trait::async_trait;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::sync::OwnedMutexGuard;

/// One client request, parsed once.
pub struct Request {
    /// The body exactly as the client sent it (forwarded as is).
    pub body: Bytes,
    pub json: Arc<Value>,
}

/// What a policy decided.
pub struct Choice {
    /// Index into the proxy's worker list.
    pub worker: usize,
    /// The policy's record of this request, kept until the answer ends.
    pub lease: Option<Box<dyn Lease>>,
    /// Held until the chosen worker answered with headers, i.e. until it has queued the request
    /// (the simulator, like vLLM, queues a streamed request before it sends headers): the next
    /// decision of a policy that serializes on this guard sees the request in the worker's state.
    pub hold_until_queued: Option<OwnedMutexGuard<()>>,
}

/// A policy's record of one forwarded request; dropping it means the request ended.
pub trait Lease: Send {
    /// The answer's first body chunk passed: the prompt is prefilled.
    fn first_token(&mut self);
}

/// Why a request could not be routed.
#[derive(Debug, thiserror::Error)]
pub enum ChooseError {
    #[error("no worker can take the request")]
    NoWorker,
    #[error("cannot tokenize the prompt: {0}")]
    Tokenize(String),
}

/// Chooses a worker for each request.
#[async_trait]
pub trait Policy: Send + Sync + 'static {
    async fn choose(&self, request: &Request) -> Result<Choice, ChooseError>;
}

struct Proxy {
    /// Worker base URLs (`http://host:port`).
    workers: Vec<String>,
    policy: Arc<dyn Policy>,
    client: reqwest::Client,
}

/// The proxy's routes: `POST /v1/chat/completions` and `GET /health`.
pub fn router(workers: Vec<String>, policy: Arc<dyn Policy>) -> Router {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()
        .unwrap_or_default();
    let proxy = Arc::new(Proxy {
        workers,
        policy,
        client,
    });
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/health", get(|| async { StatusCode::OK }))
        .layer(DefaultBodyLimit::disable())
        .with_state(proxy)
}

fn failure(status: StatusCode, message: String) -> Response {
    let body = json!({"error": {"message": message, "code": status.as_u16()}});
    (status, axum::Json(body)).into_response()
}

async fn chat(State(proxy): State<Arc<Proxy>>, body: Bytes) -> Response {
    let json: Value = match serde_json::from_slice(&body) {
        Ok(json) => json,
        Err(error) => {
            return failure(
                StatusCode::BAD_REQUEST,
                format!("invalid JSON body: {error}"),
            );
        }
    };
    let request = Request {
        body,
        json: Arc::new(json),
    };
    let choice = match proxy.policy.choose(&request).await {
        Ok(choice) => choice,
        Err(error @ ChooseError::Tokenize(_)) => {
            return failure(StatusCode::BAD_REQUEST, error.to_string());
        }
        Err(error) => return failure(StatusCode::SERVICE_UNAVAILABLE, error.to_string()),
    };
    let Some(base) = proxy.workers.get(choice.worker) else {
        return failure(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!(
                "the policy chose worker {} of {}",
                choice.worker,
                proxy.workers.len()
            ),
        );
    };
    let sent = proxy
        .client
        .post(format!("{base}/v1/chat/completions"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(request.body)
        .send()
        .await;
    drop(choice.hold_until_queued);
    let upstream = match sent {
        Ok(upstream) => upstream,
        Err(error) => return failure(StatusCode::BAD_GATEWAY, format!("{base}: {error}")),
    };
    let status = upstream.status();
    let content_type = upstream.headers().get(header::CONTENT_TYPE).cloned();
    let mut lease = choice.lease;
    let mut before_first_chunk = true;
    // The lease lives in the stream: dropped when the answer ends or the client goes away.
    let chunks = upstream.bytes_stream().map(move |chunk| {
        if before_first_chunk && chunk.as_ref().is_ok_and(|bytes| !bytes.is_empty()) {
            before_first_chunk = false;
            if let Some(lease) = lease.as_mut() {
                lease.first_token();
            }
        }
        chunk
    });
    let mut response = Response::new(Body::from_stream(chunks));
    *response.status_mut() = status;
    if let Some(content_type) = content_type {
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, content_type);
    }
    response
}
