//! The Pingora `ProxyHttp` implementation: read and check the request, choose a worker, forward,
//! translate when needed, and answer every failure in the client's own error format.
//!
//! Reading the body before choosing the upstream: Pingora replays a body consumed in
//! `request_filter` only from its retry buffer (64 KiB). We keep the whole body in the request
//! context and hand it on from `request_body_filter`. That filter only runs when the retry buffer
//! holds something, so buffering is switched on just before the last 64 KiB of the body is read:
//! the buffer is then never truncated, the filter runs on every attempt (retries included), and
//! it swaps the buffer's tail for the full body. `upstream_request_filter` sets Content-Length to
//! the length of what is really sent.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use opentelemetry::KeyValue;
use pingora_core::upstreams::peer::{HttpPeer, Peer};
use pingora_error::{Error, ErrorType, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::{FailToProxy, ProxyHttp, Session};
use serde_json::json;
use switchyard_snapshot::snapshot::AnthropicMessages;

use crate::accounting::{self, Finished, UsageTap};
use crate::api::{ApiError, ClientFormat, Endpoint, ErrorKind, client_format_for_path};
use crate::config::ConfigStore;
use crate::headers;
use crate::kv::Prediction;
use crate::limits::{self, Admission, RateLimiter};
use crate::metrics;
use crate::prompt::{self, PromptInfo};
use crate::request;
use crate::routing::{
    AuthFailure, Caller, Destination, InFlight, PendingPrefill, PoolRuntime, ProviderRuntime,
    RoutingTable, WorkerState,
};
use crate::scorer::{self, Decision, Outcome};
use crate::telemetry::{RequestSpan, Tracer};
use crate::translate::{self, StreamTranslator};
use crate::translate_openai::{self, MessagesStreamTranslator};
use switchyard_kv::index::Overlap;
use switchyard_kv::tokenize::PromptTokenizer;
use switchyard_policy::{
    ClassSet, Classifier, Context, NoTarget, Outcome as PolicyOutcome, PoolState, RequestFacts,
    RequestPrompt,
};
use switchyard_snapshot::snapshot::{LoadBalancing, ProviderFormat};
use switchyard_snapshot::{ModelTarget, PoolId};

/// Bytes Pingora's retry buffer holds (pingora-core `BODY_BUF_LIMIT`).
const RETRY_BUFFER_BYTES: usize = 64 * 1024;

/// Proxy-wide settings that do not come from the snapshot.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Largest request body accepted; larger ones get 413.
    pub max_body_bytes: usize,
    /// Longest silence allowed while waiting on a worker (a long prefill counts as silence).
    pub upstream_read_timeout: Duration,
    /// Longest time to receive a whole request body, from the end of its head.
    pub body_timeout: Duration,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            max_body_bytes: 32 * 1024 * 1024,
            upstream_read_timeout: Duration::from_secs(600),
            body_timeout: Duration::from_secs(60),
        }
    }
}

/// The gateway: one instance serves every request.
pub struct Gateway {
    store: Arc<ConfigStore>,
    settings: Settings,
    /// Per-tenant rate limits, kept across snapshots.
    limiter: Arc<RateLimiter>,
    /// Request spans, when OTLP export is configured.
    tracer: Option<Tracer>,
    /// This listener serves the operator's surface: `/metrics`, `/debug/route` and
    /// `x-switchyard-explain`. Off on the tenants' listener unless asked for.
    admin: bool,
}

impl Gateway {
    pub fn new(store: Arc<ConfigStore>, settings: Settings) -> Gateway {
        Gateway {
            store,
            settings,
            limiter: Arc::default(),
            tracer: None,
            admin: false,
        }
    }

    /// Serve (or not) the operator's surface on this gateway's listener.
    pub fn with_admin(mut self, admin: bool) -> Gateway {
        self.admin = admin;
        self
    }

    /// A gateway for the admin listener: the same configuration, rate limits and tracer, with
    /// the operator's surface on.
    pub fn admin_listener(&self) -> Gateway {
        Gateway {
            store: self.store.clone(),
            settings: self.settings.clone(),
            limiter: self.limiter.clone(),
            tracer: self.tracer.clone(),
            admin: true,
        }
    }

    /// Open a span per API request with `tracer`.
    pub fn with_tracer(mut self, tracer: Option<Tracer>) -> Gateway {
        self.tracer = tracer;
        self
    }
}

/// Where a request is going, decided in `request_filter`.
#[derive(Debug)]
pub struct Route {
    /// Kept so the snapshot the decision was made on outlives a reload mid-request.
    pub table: Arc<RoutingTable>,
    /// The pool serving the request, or `None` when it goes to a provider.
    pub pool: Option<Arc<PoolRuntime>>,
    pub provider: Option<Arc<ProviderRuntime>>,
    /// The authenticated tenant (`None`: authentication is off).
    pub tenant: Option<String>,
    /// `namespace/policy/rule` of the policy rule that decided, if any.
    pub rule: Option<String>,
    /// The policy trace, when the client asked for the explanation.
    pub policy_explain: Option<String>,
    /// Path sent upstream when it differs from the client's (translation, providers).
    pub upstream_path: Option<String>,
    pub requested_model: String,
    pub upstream_model: String,
    pub stream: bool,
    /// Whether (and which way) the request and its answer are translated.
    pub translate: Translation,
    /// Indexes of workers already tried.
    pub tried: Vec<usize>,
    /// Set when a pooled connection to this worker turned out closed: try it again on a fresh one.
    pub reconnect_to: Option<usize>,
    /// How many times that happened (bounded by the pool's `maxAttempts`).
    pub reconnects: u32,
    /// The worker of the current attempt, counted as in flight.
    pub current: Option<InFlight>,
    pub last_connect_error: Option<String>,
    /// The prompt as the pool's workers tokenize it (cache-aware pools).
    pub prompt: Option<Arc<PromptInfo>>,
    /// The scorer's decision for the current attempt (cache-aware pools).
    pub decision: Option<Decision>,
    /// Prefill work counted against the chosen worker until its first token.
    pub pending: Option<PendingPrefill>,
    /// The chosen worker will hold this prompt's blocks; counted until the request ends.
    pub prediction: Option<Prediction>,
    /// The client asked for the routing explanation (`x-switchyard-explain`).
    pub explain: bool,
    /// `pool ns/name` or `provider ns/name`: the accounting label.
    pub target_label: String,
    /// The tenant's rate-limit admission: holds its concurrency slot, settles its tokens.
    pub admission: Option<Admission>,
    /// Reads `usage` from the answer (and removes the usage chunk the proxy asked for).
    pub usage: UsageTap,
    /// When the first byte of the answer went to the client.
    pub first_byte: Option<Instant>,
    /// The worker of this streamed attempt, the formula's TTFT for it and when the request went
    /// out: its first token teaches the worker's calibration.
    pub expected_ttft: Option<(Arc<WorkerState>, f64, Instant)>,
    /// Targets still to try, in order, when this one cannot be reached or answers 5xx before
    /// its first byte.
    pub fallbacks: Vec<ModelTarget>,
    /// What the client sent, to prepare a fallback target.
    pub endpoint: Endpoint,
    pub parsed: request::ParsedRequest,
    pub client_body: Bytes,
    /// The `cache_salt` the pool's workers get (the tenant's isolation, the client's own).
    pub cache_salt: Option<String>,
    /// Set when the current attempt is abandoned for the next target: that error is retried.
    pub fallback_requested: bool,
}

impl Route {
    /// Move to the next fallback target that can be prepared. Returns the body to send there;
    /// `None` when no target is left.
    fn next_target(&mut self) -> Option<Bytes> {
        while !self.fallbacks.is_empty() {
            let target = self.fallbacks.remove(0);
            let prepared = match prepare_target(
                &self.table,
                &target,
                self.endpoint,
                &self.parsed,
                &self.client_body,
                self.cache_salt.as_deref(),
            ) {
                Ok(prepared) => prepared,
                Err(error) => {
                    tracing::debug!(target = %target.backend, reason = %error.shown_message(), "fallback target skipped");
                    continue;
                }
            };
            tracing::info!(from = %self.target_label, to = %prepared.target_label, "falling back to the next target");
            metrics::fallback(&self.target_label, &prepared.target_label);
            self.pool = prepared.pool;
            self.provider = prepared.provider;
            self.translate = prepared.translate;
            self.upstream_path = prepared.upstream_path;
            self.upstream_model = prepared.upstream_model;
            self.target_label = prepared.target_label;
            self.usage = UsageTap::new(self.stream, prepared.strip_usage);
            self.tried.clear();
            self.reconnect_to = None;
            self.reconnects = 0;
            self.current = None;
            self.pending = None;
            self.expected_ttft = None;
            self.prediction = None;
            // The prompt was tokenized for the first pool; a fallback pool routes by queue.
            self.prompt = None;
            self.decision = None;
            return Some(prepared.upstream_body);
        }
        None
    }
}

/// Translation between the client's API and the upstream's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Translation {
    None,
    /// Anthropic Messages client, OpenAI Chat Completions upstream.
    MessagesToChat,
    /// OpenAI Chat Completions client, Anthropic Messages upstream.
    ChatToMessages,
}

/// An incremental stream translation (either direction).
pub trait StreamTranslation: std::fmt::Debug + Send + Sync {
    /// Bytes from upstream in, bytes for the client out.
    fn feed(&mut self, chunk: &[u8]) -> Bytes;
    /// The end of the upstream body: whatever closes the client's stream.
    fn finish(&mut self) -> Bytes;
}

impl StreamTranslation for StreamTranslator {
    fn feed(&mut self, chunk: &[u8]) -> Bytes {
        StreamTranslator::feed(self, chunk)
    }
    fn finish(&mut self) -> Bytes {
        StreamTranslator::finish(self)
    }
}

impl StreamTranslation for MessagesStreamTranslator {
    fn feed(&mut self, chunk: &[u8]) -> Bytes {
        MessagesStreamTranslator::feed(self, chunk)
    }
    fn finish(&mut self) -> Bytes {
        MessagesStreamTranslator::finish(self)
    }
}

#[derive(Debug, Default)]
enum ResponseMode {
    #[default]
    PassThrough,
    /// Buffer the whole answer and translate it at the end (non-streaming, or an error status).
    TranslateWhole {
        buffer: BytesMut,
        status: u16,
        /// A successful answer, in the client's API.
        answer: fn(&[u8], &str) -> Bytes,
        /// An error body, in the client's error format.
        error: fn(u16, &[u8]) -> Bytes,
    },
    TranslateStream(Box<dyn StreamTranslation>),
}

/// Admin path prefix: `POST /debug/route/v1/chat/completions` explains without forwarding.
const DEBUG_ROUTE_PREFIX: &str = "/debug/route";
/// Request header asking for the routing explanation.
const EXPLAIN_HEADER: &str = "x-switchyard-explain";
/// Response header carrying it.
const EXPLAIN_RESPONSE_HEADER: &str = "x-switchyard-route";
/// Response header carrying the policy trace (rules looked at, prompt classes, target).
const POLICY_RESPONSE_HEADER: &str = "x-switchyard-policy";
/// Bodies larger than this are tokenized on the blocking pool, off the proxy's async threads.
const INLINE_TOKENIZE_BYTES: usize = 16 * 1024;

/// Tokenize the prompt for cache-aware routing. A failure only costs cache affinity: the request
/// is still routed, by queue alone.
async fn analyse_prompt(
    tokenizer: Arc<PromptTokenizer>,
    pool: Arc<PoolRuntime>,
    endpoint: Endpoint,
    body: Bytes,
    cache_salt: Option<String>,
) -> Option<Arc<PromptInfo>> {
    let inline = body.len() <= INLINE_TOKENIZE_BYTES;
    let work = move || {
        prompt::analyse(
            &tokenizer,
            &pool.kv.prompts,
            endpoint,
            &body,
            pool.kv.index.block_size(),
            cache_salt.as_deref(),
        )
    };
    let result = if inline {
        work()
    } else {
        tokio::task::spawn_blocking(work)
            .await
            .unwrap_or_else(|e| Err(format!("tokenizer task failed: {e}")))
    };
    match result {
        Ok(info) => Some(info),
        Err(error) => {
            tracing::debug!(%error, "prompt not tokenized for routing");
            None
        }
    }
}

/// Pick the worker of an attempt: the scorer for cache-aware pools, the pool's policy otherwise.
fn choose_worker(route: &mut Route, first_attempt: bool) -> Option<usize> {
    let pool = route.pool.clone()?;
    if pool.config.load_balancing != LoadBalancing::CacheAware {
        return pool.pick(&route.tried);
    }
    let kv = &pool.kv;
    let mut overlap = Overlap::default();
    let prompt_tokens = match &route.prompt {
        Some(prompt) => {
            kv.index
                .overlap_into(&prompt.hashes, kv.slot_count(), &mut overlap);
            kv.predictions.raise(&prompt.hashes, &mut overlap);
            prompt.tokens
        }
        None => 0,
    };
    let decision = scorer::decide(&pool, prompt_tokens, &overlap, &route.tried)?;
    if first_attempt {
        let prefill = decision
            .scores
            .iter()
            .find(|s| s.position == decision.chosen)
            .map_or(prompt_tokens, |s| s.uncached_tokens);
        kv.record_prefill_tokens(prefill);
        let counter = match decision.outcome {
            Outcome::CacheHit => &kv.decisions.cache_hit,
            Outcome::NoCache => &kv.decisions.no_cache,
            Outcome::Spread => &kv.decisions.spread,
        };
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    let chosen = decision.chosen;
    route.decision = Some(decision);
    Some(chosen)
}

/// What policies may ask about a request: its text (parsed only when a rule needs classes), its
/// headers, and the live state of pools.
struct PolicyContext<'a> {
    table: &'a RoutingTable,
    body: &'a [u8],
    headers: &'a http::HeaderMap,
    /// Classes computed before evaluation (large prompts, on the blocking pool).
    classes: Option<ClassSet>,
    /// Prompts tokenized for the pools whose predicted TTFT rules read.
    predictions: &'a [(PoolId, Option<Arc<PromptInfo>>)],
}

impl Context for PolicyContext<'_> {
    fn classes(&mut self, classifier: &Classifier) -> ClassSet {
        if let Some(classes) = self.classes {
            return classes;
        }
        let classes = RequestPrompt::parse(self.body)
            .map(|prompt| classifier.classify(&prompt))
            .unwrap_or_default();
        self.classes = Some(classes);
        classes
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    fn pool_state(&mut self, pool_id: &PoolId, with_prediction: bool) -> Option<PoolState> {
        let pool = self.table.pool(pool_id)?;
        let mut state = PoolState::default();
        let mut kv_usage = 0.0;
        for worker in &pool.workers {
            state.queue_depth += worker.load.waiting();
            state.running += worker.load.running();
            kv_usage += worker.load.kv_usage();
        }
        if !pool.workers.is_empty() {
            state.kv_usage_percent = (kv_usage * 100.0 / pool.workers.len() as f64).round() as u64;
        }
        if with_prediction {
            let prompt = self
                .predictions
                .iter()
                .find(|(id, _)| id == pool_id)
                .and_then(|(_, p)| p.as_ref());
            let mut overlap = Overlap::default();
            let tokens = match prompt {
                Some(prompt) => {
                    pool.kv
                        .index
                        .overlap_into(&prompt.hashes, pool.kv.slot_count(), &mut overlap);
                    pool.kv.predictions.raise(&prompt.hashes, &mut overlap);
                    prompt.tokens
                }
                None => 0,
            };
            state.predicted_ttft_ms = scorer::decide(pool, tokens, &overlap, &[]).and_then(|d| {
                d.scores
                    .iter()
                    .find(|s| s.position == d.chosen)
                    .map(|s| (s.predicted_ttft_s * 1000.0).round() as u64)
            });
        }
        Some(state)
    }
}

/// The peer of a provider attempt (one per request; a stale pooled connection may be retried).
fn provider_peer(route: &mut Route, provider: &ProviderRuntime) -> Option<HttpPeer> {
    let socket = provider.socket?;
    if route.reconnect_to.take().is_none() {
        route.tried.push(0);
    }
    let sni = if provider.tls {
        provider.host.clone()
    } else {
        String::new()
    };
    let mut peer = HttpPeer::new(socket, provider.tls, sni);
    peer.options.connection_timeout =
        Some(Duration::from_millis(provider.config.connect_timeout_ms));
    peer.options.read_timeout = Some(Duration::from_millis(provider.config.read_timeout_ms));
    peer.options.ca = provider.ca.clone();
    // Pingora's connection pool keys peers by address, SNI and verification flags, not by the
    // CA list: without a group of its own, a connection verified against one provider's CA
    // could be reused for another provider at the same address that trusts different roots.
    peer.group_key = provider.group_key;
    Some(peer)
}

/// A target made ready: where it goes, which way to translate, and the body to send.
struct Prepared {
    pool: Option<Arc<PoolRuntime>>,
    provider: Option<Arc<ProviderRuntime>>,
    translate: Translation,
    upstream_path: Option<String>,
    upstream_body: Bytes,
    strip_usage: bool,
    upstream_model: String,
    target_label: String,
}

/// Prepare `target` for a request (`body` as the client sent it). Used for the first target
/// and again for each fallback. `cache_salt` is what a vLLM pool's workers get
/// ([`prompt::worker_cache_salt`]); providers get the body as the client sent it.
fn prepare_target(
    table: &RoutingTable,
    target: &ModelTarget,
    endpoint: Endpoint,
    parsed: &request::ParsedRequest,
    body: &Bytes,
    cache_salt: Option<&str>,
) -> std::result::Result<Prepared, ApiError> {
    let destination = table.destination(target).ok_or_else(|| {
        ApiError::new(
            ErrorKind::Internal,
            "target_missing",
            format!("{} is not loaded", target.backend),
        )
    })?;
    let (pool, provider) = match destination {
        Destination::Pool(pool) => (Some(pool), None),
        Destination::Provider(provider) => (None, Some(provider)),
    };
    if let Some(provider) = &provider
        && let Some(reason) = &provider.unavailable
    {
        return Err(ApiError::new(
            ErrorKind::Unavailable,
            "provider_unavailable",
            format!(
                "model '{}' routes to provider {}, which cannot be used: {reason}",
                parsed.model, provider.config.id
            ),
        ));
    }
    if let Some(pool) = &pool
        && pool.workers.is_empty()
    {
        return Err(ApiError::new(
            ErrorKind::Unavailable,
            "no_workers",
            format!(
                "model '{}' has no workers available right now; retry shortly",
                parsed.model
            ),
        ));
    }
    let (translate, upstream_path) = match (&pool, &provider) {
        (Some(pool), _) => {
            let translate = endpoint == Endpoint::Messages
                && pool.config.anthropic_messages == AnthropicMessages::Translate;
            if translate {
                (
                    Translation::MessagesToChat,
                    Some("/v1/chat/completions".to_owned()),
                )
            } else {
                (Translation::None, None)
            }
        }
        (None, Some(provider)) => {
            let base = &provider.base_path;
            match (endpoint, provider.config.format) {
                (Endpoint::Messages, ProviderFormat::Anthropic) => {
                    (Translation::None, Some(format!("{base}/messages")))
                }
                (Endpoint::Messages, ProviderFormat::Openai) => (
                    Translation::MessagesToChat,
                    Some(format!("{base}/chat/completions")),
                ),
                (Endpoint::ChatCompletions, ProviderFormat::Openai) => {
                    (Translation::None, Some(format!("{base}/chat/completions")))
                }
                (Endpoint::ChatCompletions, ProviderFormat::Anthropic) => (
                    Translation::ChatToMessages,
                    Some(format!("{base}/messages")),
                ),
                (Endpoint::Completions, ProviderFormat::Openai) => {
                    (Translation::None, Some(format!("{base}/completions")))
                }
                _ => {
                    return Err(ApiError::new(
                        ErrorKind::NotImplemented,
                        "translation_unsupported",
                        format!(
                            "model '{}' is served by provider {}, which speaks the Anthropic Messages API: \
                                 use /v1/chat/completions or /v1/messages (legacy completions cannot be translated)",
                            parsed.model, provider.config.id
                        ),
                    ));
                }
            }
        }
        (None, None) => (Translation::None, None),
    };
    let worker_salt = cache_salt.filter(|_| pool.is_some());
    let mut upstream_body = match translate {
        Translation::MessagesToChat => {
            let translated = translate::messages_request_to_chat(body, &target.upstream_model)?;
            match worker_salt {
                Some(salt) => request::with_leading_cache_salt(translated, salt),
                None => translated,
            }
        }
        Translation::ChatToMessages => {
            translate_openai::chat_request_to_messages(body, &target.upstream_model)?
        }
        Translation::None => request::rewrite(body, parsed, &target.upstream_model, worker_salt),
    };
    // Streamed OpenAI answers carry usage only when asked: ask on the client's behalf, and
    // remove that chunk again before it reaches a client that did not ask.
    let openai_upstream = translate == Translation::None
        && matches!(endpoint, Endpoint::ChatCompletions | Endpoint::Completions)
        && provider
            .as_ref()
            .is_none_or(|p| p.config.format == ProviderFormat::Openai);
    let mut strip_usage = false;
    if parsed.stream && openai_upstream {
        let (body, injected) = request::with_stream_usage(upstream_body)?;
        upstream_body = body;
        strip_usage = injected;
    }
    if parsed.stream && translate == Translation::ChatToMessages {
        // The translated stream always ends with a usage chunk: keep it only on request.
        strip_usage = !request::asks_for_stream_usage(body);
    }
    Ok(Prepared {
        pool,
        provider,
        translate,
        upstream_path,
        upstream_body,
        strip_usage,
        upstream_model: target.upstream_model.clone(),
        target_label: target.backend.to_string(),
    })
}

/// Per-request state.
pub struct RequestCtx {
    request_id: String,
    started: Instant,
    format: ClientFormat,
    endpoint: Option<Endpoint>,
    /// The body sent upstream (model rewritten, or translated).
    body: Bytes,
    route: Option<Route>,
    /// An error decided by us, answered by `fail_to_proxy` in the client's format.
    failure: Option<ApiError>,
    response: ResponseMode,
    status: u16,
    /// The request's trace span (API requests, when tracing is on).
    span: Option<RequestSpan>,
}

fn request_id(session: &Session) -> String {
    let incoming = session
        .req_header()
        .headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()));
    match incoming {
        Some(id) => id.to_owned(),
        None => format!(
            "{:016x}{:016x}",
            rand::random::<u64>(),
            rand::random::<u64>()
        ),
    }
}

impl Gateway {
    /// Write a complete JSON response. When the request body was not read, the connection is
    /// closed afterwards so unread bytes are never taken for the next request.
    async fn respond_json(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        status: u16,
        body: Bytes,
        extra: &[(&'static str, String)],
    ) -> Result<()> {
        ctx.status = status;
        let mut header = ResponseHeader::build(status, Some(4 + extra.len()))?;
        header.insert_header("content-type", "application/json")?;
        header.insert_header("content-length", body.len().to_string())?;
        header.insert_header("x-request-id", ctx.request_id.as_str())?;
        for (name, value) in extra {
            header.insert_header(*name, value.as_str())?;
        }
        if !session.as_mut().is_body_done() {
            session.set_keepalive(None);
        }
        if session.as_ref().as_http1().is_some() && session.get_keepalive().is_none() {
            header.insert_header("connection", "close")?;
        }
        session
            .write_response_header(Box::new(header), false)
            .await?;
        session.write_response_body(Some(body), true).await?;
        Ok(())
    }

    async fn respond_error(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        error: ApiError,
    ) -> Result<bool> {
        tracing::info!(
            request_id = %ctx.request_id,
            status = error.status(),
            code = error.code,
            reason = %error.shown_message(),
            "request rejected"
        );
        let body = error.body(ctx.format);
        let mut extra: Vec<(&'static str, String)> = match error.kind {
            ErrorKind::MethodNotAllowed => ctx
                .endpoint
                .map(|e| vec![("allow", e.method().to_string())])
                .unwrap_or_default(),
            _ => Vec::new(),
        };
        if let Some(seconds) = error.retry_after {
            extra.push(("retry-after", seconds.to_string()));
        }
        self.respond_json(session, ctx, error.status(), body, &extra)
            .await?;
        ctx.failure = Some(error);
        Ok(true)
    }

    /// Read the whole request body within the size limit (see the module note on buffering).
    async fn read_body(&self, session: &mut Session) -> std::result::Result<Bytes, ApiError> {
        let limit = self.settings.max_body_bytes;
        let too_large = || {
            ApiError::new(
                ErrorKind::PayloadTooLarge,
                "request_too_large",
                format!("request body exceeds the limit of {limit} bytes; shorten the prompt"),
            )
        };
        let declared = match session
            .req_header()
            .headers
            .get(http::header::CONTENT_LENGTH)
        {
            Some(value) => Some(
                value
                    .to_str()
                    .ok()
                    .and_then(|v| v.trim().parse::<usize>().ok())
                    .ok_or_else(|| ApiError::invalid("body", "invalid Content-Length header"))?,
            ),
            None => None,
        };
        if declared.is_some_and(|length| length > limit) {
            return Err(too_large());
        }
        if declared.is_none() {
            session.as_mut().enable_retry_buffering();
        }
        let deadline = tokio::time::Instant::now() + self.settings.body_timeout;
        let mut body = BytesMut::with_capacity(declared.unwrap_or(0));
        loop {
            if declared
                .is_some_and(|length| length.saturating_sub(body.len()) <= RETRY_BUFFER_BYTES)
            {
                session.as_mut().enable_retry_buffering();
            }
            let read = tokio::time::timeout_at(deadline, session.read_request_body()).await;
            match read {
                Ok(Ok(Some(chunk))) => {
                    if body.len() + chunk.len() > limit {
                        return Err(too_large());
                    }
                    body.extend_from_slice(&chunk);
                }
                Ok(Ok(None)) => break,
                Err(_) => {
                    // Whatever is left of the body must not be read as the next request.
                    session.set_keepalive(None);
                    return Err(ApiError::new(
                        ErrorKind::RequestTimeout,
                        "request_timeout",
                        format!(
                            "the request body did not arrive within {} s",
                            self.settings.body_timeout.as_secs_f64()
                        ),
                    ));
                }
                Ok(Err(error)) => {
                    // A framing error (a bad chunk size, a short body): the connection's byte
                    // stream can no longer be trusted to start the next request.
                    session.set_keepalive(None);
                    return Err(ApiError::invalid(
                        "body",
                        format!(
                            "could not read the request body: {}",
                            error.etype().as_str()
                        ),
                    ));
                }
            }
        }
        if session.as_ref().retry_buffer_truncated() {
            return Err(ApiError::new(
                ErrorKind::LengthRequired,
                "length_required",
                format!(
                    "request bodies over {} KiB must be sent with a Content-Length header",
                    RETRY_BUFFER_BYTES / 1024
                ),
            ));
        }
        Ok(body.freeze())
    }

    /// Who is calling: the tenant of the request's API key (`Authorization: Bearer` or
    /// `x-api-key`). Unknown or missing keys are 401 unless a default tenant is configured.
    fn authenticate<'t>(
        &self,
        table: &'t RoutingTable,
        session: &Session,
    ) -> std::result::Result<Caller<'t>, ApiError> {
        let headers = &session.req_header().headers;
        let bearer = headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .map(str::trim);
        let api_key = headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::trim);
        table.authenticate(bearer.or(api_key)).map_err(|failure| {
            let message = match failure {
                AuthFailure::MissingKey => {
                    "missing API key: send it as 'Authorization: Bearer <key>' (OpenAI) or 'x-api-key: <key>' (Anthropic)"
                }
                AuthFailure::UnknownKey => "invalid API key",
            };
            ApiError::new(ErrorKind::Unauthorized, "invalid_api_key", message)
        })
    }

    /// Decide where an inference request goes and prepare the body sent there.
    async fn route(
        &self,
        session: &mut Session,
        endpoint: Endpoint,
    ) -> std::result::Result<(Route, Bytes), ApiError> {
        let table = self.store.current().ok_or_else(|| {
            ApiError::new(
                ErrorKind::Unavailable,
                "not_ready",
                "the gateway has no configuration loaded yet; retry shortly",
            )
        })?;
        let caller = self.authenticate(&table, session).inspect_err(|_| {
            accounting::rejected_early(None, "unauthenticated");
        })?;
        let tenant = caller.tenant().map(|t| t.name.clone());
        let body = self.read_body(session).await?;
        let parsed = request::parse(endpoint, &body)?;
        // The salt the workers get keys the prompt's block hashes too, as in vLLM.
        let cache_salt = prompt::worker_cache_salt(caller.tenant(), parsed.cache_salt.as_deref());
        let model = table.model(&parsed.model).ok_or_else(|| {
            accounting::rejected(&table, tenant.as_deref(), &parsed.model, "model_not_found");
            ApiError {
                kind: ErrorKind::NotFound,
                code: "model_not_found",
                param: Some("model"),
                message: format!(
                    "the model '{}' does not exist; GET /v1/models lists the models you can use",
                    crate::api::client_text(&parsed.model)
                ),
                retry_after: None,
            }
        })?;
        if let Some(tenant) = caller.tenant()
            && !tenant.allows_model(&model.name)
        {
            accounting::rejected(
                &table,
                Some(&tenant.name),
                &parsed.model,
                "model_not_allowed",
            );
            return Err(ApiError {
                kind: ErrorKind::Forbidden,
                code: "model_not_allowed",
                param: Some("model"),
                message: format!(
                    "your API key may not use the model '{}'; GET /v1/models lists the models you can use",
                    crate::api::client_text(&parsed.model)
                ),
                retry_after: None,
            });
        }
        let explain = (self.admin && session.req_header().headers.contains_key(EXPLAIN_HEADER))
            || session
                .req_header()
                .uri
                .path()
                .starts_with(DEBUG_ROUTE_PREFIX);

        // Policies. Predicted TTFT needs the prompt tokenized for the pool in question first.
        let mut predictions = Vec::new();
        for pool_id in table.evaluator.prediction_pools(&parsed.model) {
            if let Some(pool) = table.pool(&pool_id)
                && let Some(tokenizer) = &pool.tokenizer
            {
                let prompt = analyse_prompt(
                    tokenizer.clone(),
                    pool.clone(),
                    endpoint,
                    body.clone(),
                    cache_salt.clone(),
                )
                .await;
                predictions.push((pool_id, prompt));
            }
        }
        let facts = RequestFacts {
            tenant: caller.tenant().map(|t| t.name.as_str()),
            model: &parsed.model,
            stream: parsed.stream,
            max_tokens: parsed.max_tokens,
        };
        let mut trace = explain.then(Vec::new);
        // Large prompts are classified on the blocking pool, as they are tokenized.
        let classes = if table.evaluator.uses_classes() && body.len() > INLINE_TOKENIZE_BYTES {
            let table = table.clone();
            let body = body.clone();
            tokio::task::spawn_blocking(move || {
                RequestPrompt::parse(&body)
                    .map(|prompt| table.evaluator.classifier().classify(&prompt))
                    .unwrap_or_default()
            })
            .await
            .ok()
        } else {
            None
        };
        let mut context = PolicyContext {
            table: &table,
            body: &body,
            headers: &session.req_header().headers,
            classes,
            predictions: &predictions,
        };
        let decision = table
            .evaluator
            .evaluate(&facts, &mut context, trace.as_mut());
        let rule = decision.rule_name();
        let chosen = match switchyard_policy::targets(&table.snapshot, model, &decision) {
            Ok(chosen) => chosen,
            Err(NoTarget::Rejected { status, message }) => {
                metrics::policy_decision(rule.as_deref().unwrap_or(""), "reject");
                accounting::rejected(&table, tenant.as_deref(), &parsed.model, "policy");
                return Err(ApiError::new(
                    ErrorKind::Policy(status),
                    "rejected_by_policy",
                    message,
                ));
            }
            Err(NoTarget::NoLocalTarget { rule: local_rule }) => {
                metrics::policy_decision(&local_rule, "no_local_target");
                accounting::rejected(&table, tenant.as_deref(), &parsed.model, "no_local_target");
                return Err(ApiError::new(
                    ErrorKind::Unavailable,
                    "no_local_target",
                    format!(
                        "this request must stay on local hardware (policy rule {local_rule}) and model '{}' has no local pool to serve it",
                        parsed.model
                    ),
                ));
            }
        };
        metrics::policy_decision(
            rule.as_deref().unwrap_or(""),
            match decision.outcome {
                PolicyOutcome::Route(_) => "route",
                _ => "default",
            },
        );
        let classes = decision
            .classes
            .map(|set| table.evaluator.classifier().names(set).join(","));
        let target = table
            .choose(chosen.strategy, &chosen.targets)
            .ok_or_else(|| {
                ApiError::new(
                    ErrorKind::Unavailable,
                    "no_target",
                    format!("model '{}' has no usable target", model.name),
                )
            })?;
        let policy_explain = trace.map(|steps| {
            let mut text = steps
                .iter()
                .map(|step| format!("{}/{}: {}", step.policy, step.rule, step.result))
                .collect::<Vec<_>>()
                .join("; ");
            if let Some(classes) = &classes {
                text.push_str(&format!("; classes={classes}"));
            }
            text.push_str(&format!(
                "; target={} model={}",
                target.backend, target.upstream_model
            ));
            // A header value: names from configuration may hold characters a header cannot.
            text.chars()
                .map(|c| {
                    if c == ' ' || c.is_ascii_graphic() {
                        c
                    } else {
                        '?'
                    }
                })
                .collect::<String>()
        });
        // Rate limits, once the request is known to go somewhere: the prompt is counted up
        // front (estimated from the body's size), the completion when the answer's usage
        // arrives. `/debug/route` explains without spending the tenant's allowance.
        let mut admission = None;
        let debug = session
            .req_header()
            .uri
            .path()
            .starts_with(DEBUG_ROUTE_PREFIX);
        if let Some(tenant) = caller.tenant()
            && !debug
        {
            let limits = tenant.rate_limits;
            if limits.requests_per_minute.is_some()
                || limits.tokens_per_minute.is_some()
                || limits.concurrency.is_some()
            {
                let reservation = limits::Reservation::for_request(body.len(), parsed.max_tokens);
                match self.limiter.admit(&tenant.name, limits, reservation) {
                    Ok(admitted) => admission = Some(admitted),
                    Err(refusal) => {
                        accounting::rejected(
                            &table,
                            Some(&tenant.name),
                            &parsed.model,
                            refusal.limit.label(),
                        );
                        return Err(ApiError {
                            kind: ErrorKind::Policy(429),
                            code: "rate_limit_exceeded",
                            param: None,
                            message: refusal.message(&tenant.name),
                            retry_after: Some(refusal.retry_after_secs()),
                        });
                    }
                }
            }
        }
        let Prepared {
            pool,
            provider,
            translate,
            upstream_path,
            upstream_body,
            strip_usage,
            upstream_model,
            target_label,
        } = prepare_target(
            &table,
            target,
            endpoint,
            &parsed,
            &body,
            cache_salt.as_deref(),
        )?;
        // Later targets of the model, tried in order when this one cannot be reached or fails
        // before its first byte.
        let fallbacks: Vec<ModelTarget> = chosen
            .targets
            .iter()
            .filter(|t| !std::ptr::eq(**t, target) && table.usable(t))
            .map(|t| (*t).clone())
            .collect();
        let prompt = match &pool {
            Some(pool) => match &pool.tokenizer {
                Some(tokenizer) => {
                    let known = predictions
                        .iter()
                        .find(|(id, _)| *id == pool.config.id)
                        .and_then(|(_, prompt)| prompt.clone());
                    match known {
                        Some(prompt) => Some(prompt),
                        None => {
                            analyse_prompt(
                                tokenizer.clone(),
                                pool.clone(),
                                endpoint,
                                body.clone(),
                                cache_salt.clone(),
                            )
                            .await
                        }
                    }
                }
                None => None,
            },
            None => None,
        };
        let route = Route {
            upstream_model,
            requested_model: parsed.model.clone(),
            stream: parsed.stream,
            translate,
            upstream_path,
            pool,
            provider,
            tenant,
            rule,
            policy_explain,
            table,
            tried: Vec::new(),
            reconnect_to: None,
            reconnects: 0,
            current: None,
            last_connect_error: None,
            prompt,
            decision: None,
            pending: None,
            prediction: None,
            explain,
            target_label,
            admission,
            usage: UsageTap::new(parsed.stream, strip_usage),
            first_byte: None,
            expected_ttft: None,
            fallbacks,
            endpoint,
            parsed,
            client_body: body,
            cache_salt,
            fallback_requested: false,
        };
        Ok((route, upstream_body))
    }

    /// `POST /debug/route/v1/...`: how the request would be routed, without sending it.
    async fn debug_route(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        inner: &str,
    ) -> Result<bool> {
        let inner = format!("/{}", inner.trim_start_matches('/'));
        ctx.format = client_format_for_path(&inner);
        let endpoint = match Endpoint::from_path(&inner) {
            Some(
                endpoint @ (Endpoint::ChatCompletions | Endpoint::Completions | Endpoint::Messages),
            ) => endpoint,
            _ => {
                let error = ApiError::new(
                    ErrorKind::NotFound,
                    "unknown_url",
                    format!(
                        "{DEBUG_ROUTE_PREFIX}{inner}: explains POST /v1/chat/completions, /v1/completions or /v1/messages"
                    ),
                );
                return self.respond_error(session, ctx, error).await;
            }
        };
        ctx.endpoint = Some(endpoint);
        let (mut route, _) = match self.route(session, endpoint).await {
            Ok(routed) => routed,
            Err(error) => return self.respond_error(session, ctx, error).await,
        };
        let chosen = choose_worker(&mut route, false);
        let pool = route.pool.clone();
        let address = |position: usize| {
            pool.as_ref()
                .and_then(|p| p.workers.get(position))
                .map(|w| w.address.clone())
        };
        let scores: Vec<serde_json::Value> = route
            .decision
            .iter()
            .flat_map(|d| d.scores.iter())
            .map(|score| {
                json!({
                    "worker": address(score.position),
                    "matched_blocks": score.matched_blocks,
                    "cached_tokens": score.cached_tokens,
                    "uncached_tokens": score.uncached_tokens,
                    "queued_tokens": score.queued_tokens,
                    "running": score.running,
                    "in_flight": score.in_flight,
                    "healthy": score.healthy,
                    "predicted_ttft_ms": score.predicted_ttft_s * 1000.0,
                    "formula_ttft_ms": score.formula_ttft_s * 1000.0,
                    "learned_speed": {
                        "observed_over_predicted": score.speed.ratio,
                        "observations": score.speed.observations,
                        "relative_to_pool": score.relative_speed,
                    },
                })
            })
            .collect();
        let body = json!({
            "model": route.requested_model,
            "upstream_model": route.upstream_model,
            "tenant": route.tenant,
            "policy_rule": route.rule,
            "policy_trace": route.policy_explain,
            "pool": route.pool.as_ref().map(|p| p.config.id.0.clone()),
            "provider": route.provider.as_ref().map(|p| p.config.id.0.clone()),
            "load_balancing": route.pool.as_ref().map(|p| p.config.load_balancing),
            "prompt_tokens": route.prompt.as_ref().map(|p| p.tokens),
            "prompt_blocks": route.prompt.as_ref().map(|p| p.hashes.len()),
            "chosen": chosen.and_then(address),
            "outcome": route.decision.as_ref().map(|d| format!("{:?}", d.outcome)),
            "scores": scores,
        });
        self.respond_json(session, ctx, 200, Bytes::from(body.to_string()), &[])
            .await?;
        Ok(true)
    }

    async fn list_models(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        let Some(table) = self.store.current() else {
            let error = ApiError::new(
                ErrorKind::Unavailable,
                "not_ready",
                "no configuration loaded yet",
            );
            return self.respond_error(session, ctx, error).await;
        };
        let caller = match self.authenticate(&table, session) {
            Ok(caller) => caller,
            Err(error) => return self.respond_error(session, ctx, error).await,
        };
        let anthropic = session
            .req_header()
            .headers
            .contains_key("anthropic-version");
        let names: Vec<&String> = table.models_for(caller).collect();
        let body = if anthropic {
            let data: Vec<_> = names
                .iter()
                .map(|name| json!({"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z"}))
                .collect();
            json!({
                "data": data,
                "has_more": false,
                "first_id": names.first(),
                "last_id": names.last(),
            })
        } else {
            let created = table.created_at;
            let data: Vec<_> = names
                .iter()
                .map(|name| json!({"id": name, "object": "model", "created": created, "owned_by": "switchyard"}))
                .collect();
            json!({"object": "list", "data": data})
        };
        self.respond_json(session, ctx, 200, Bytes::from(body.to_string()), &[])
            .await?;
        Ok(true)
    }
}

#[async_trait]
impl ProxyHttp for Gateway {
    type CTX = RequestCtx;

    fn on_connection_reuse(
        &self,
        _session: &mut Session,
        _ctx: &mut RequestCtx,
        previous: Box<dyn std::any::Any + Send + Sync>,
    ) {
        crate::connection::head_read(previous.as_ref());
    }

    fn new_ctx(&self) -> RequestCtx {
        RequestCtx {
            request_id: String::new(),
            started: Instant::now(),
            format: ClientFormat::OpenAi,
            endpoint: None,
            body: Bytes::new(),
            route: None,
            failure: None,
            response: ResponseMode::PassThrough,
            status: 0,
            span: None,
        }
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        ctx.request_id = request_id(session);
        let path = session.req_header().uri.path().to_owned();
        ctx.format = client_format_for_path(&path);
        if let Some(inner) = path.strip_prefix(DEBUG_ROUTE_PREFIX)
            && self.admin
        {
            return self.debug_route(session, ctx, inner).await;
        }
        let endpoint = Endpoint::from_path(&path).filter(|e| self.admin || *e != Endpoint::Metrics);
        let Some(endpoint) = endpoint else {
            let error = ApiError::new(
                ErrorKind::NotFound,
                "unknown_url",
                format!(
                    "unknown path '{path}'; this gateway serves POST /v1/chat/completions, \
                     /v1/completions, /v1/messages and GET /v1/models"
                ),
            );
            return self.respond_error(session, ctx, error).await;
        };
        ctx.endpoint = Some(endpoint);
        if let Some(tracer) = &self.tracer
            && endpoint.is_api()
        {
            let request = session.req_header();
            let name = format!("{} {path}", request.method);
            ctx.span = Some(tracer.start(name, &request.headers));
        }
        let method = session.req_header().method.clone();
        if method != endpoint.method() {
            let error = ApiError::new(
                ErrorKind::MethodNotAllowed,
                "method_not_allowed",
                format!(
                    "{path} accepts {} requests, not {method}",
                    endpoint.method()
                ),
            );
            return self.respond_error(session, ctx, error).await;
        }
        match endpoint {
            Endpoint::Health => {
                self.respond_json(
                    session,
                    ctx,
                    200,
                    Bytes::from_static(br#"{"status":"ok"}"#),
                    &[],
                )
                .await?;
                return Ok(true);
            }
            Endpoint::Ready => {
                let (status, body) = match self.store.current() {
                    Some(table) => (
                        200,
                        json!({"status": "ready", "config_version": table.snapshot.version}),
                    ),
                    None => (
                        503,
                        json!({"status": "not ready", "reason": "no configuration loaded yet"}),
                    ),
                };
                self.respond_json(session, ctx, status, Bytes::from(body.to_string()), &[])
                    .await?;
                return Ok(true);
            }
            Endpoint::Models => return self.list_models(session, ctx).await,
            Endpoint::Metrics => {
                let body = Bytes::from(metrics::render(&self.store));
                ctx.status = 200;
                let mut header = ResponseHeader::build(200, Some(3))?;
                header.insert_header("content-type", "text/plain; version=0.0.4; charset=utf-8")?;
                header.insert_header("content-length", body.len().to_string())?;
                session
                    .write_response_header(Box::new(header), false)
                    .await?;
                session.write_response_body(Some(body), true).await?;
                return Ok(true);
            }
            Endpoint::ChatCompletions | Endpoint::Completions | Endpoint::Messages => {}
        }
        match self.route(session, endpoint).await {
            Ok((route, body)) => {
                ctx.route = Some(route);
                ctx.body = body;
                Ok(false)
            }
            Err(error) => self.respond_error(session, ctx, error).await,
        }
    }

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<Box<HttpPeer>> {
        let Some(route) = ctx.route.as_mut() else {
            return Err(Error::explain(
                ErrorType::InternalError,
                "upstream_peer without a route",
            ));
        };
        route.current = None;
        route.pending = None;
        route.prediction = None;
        if let Some(provider) = route.provider.clone() {
            return provider_peer(route, &provider)
                .map(Box::new)
                .ok_or_else(|| {
                    Error::explain(ErrorType::ConnectNoRoute, "provider address unresolved")
                });
        }
        let Some(pool) = route.pool.clone() else {
            return Err(Error::explain(
                ErrorType::InternalError,
                "route without a pool or provider",
            ));
        };
        let reconnect = route.reconnect_to.take();
        let first_attempt = route.tried.is_empty() && reconnect.is_none();
        let picked = reconnect
            .or_else(|| choose_worker(route, first_attempt))
            .and_then(|index| {
                let worker = pool.workers.get(index)?;
                Some((index, worker.clone(), worker.socket?))
            });
        let Some((index, worker, socket)) = picked else {
            let error = if route.tried.is_empty() {
                ApiError::new(
                    ErrorKind::Unavailable,
                    "no_workers",
                    format!(
                        "no worker of model '{}' can take the request; retry shortly",
                        route.requested_model
                    ),
                )
            } else {
                ApiError::new(
                    ErrorKind::BadGateway,
                    "upstream_unreachable",
                    format!(
                        "could not reach a worker for model '{}' after {} attempt(s)",
                        route.requested_model,
                        route.tried.len()
                    ),
                )
            };
            let status = error.status();
            ctx.failure = Some(error);
            return Err(Error::explain(
                ErrorType::HTTPStatus(status),
                "no worker to try",
            ));
        };
        if reconnect.is_none() {
            route.tried.push(index);
        }
        route.current = Some(InFlight::start(&worker));
        let uncached = match (&route.decision, &route.prompt) {
            (Some(decision), _) => decision
                .scores
                .iter()
                .find(|s| s.position == index)
                .map_or(0, |s| s.uncached_tokens),
            (None, Some(prompt)) => prompt.tokens,
            (None, None) => 0,
        };
        route.pending = Some(PendingPrefill::start(&worker, uncached));
        route.expected_ttft = route
            .decision
            .as_ref()
            .and_then(|d| d.scores.iter().find(|s| s.position == index))
            .filter(|_| route.stream)
            .map(|score| (worker.clone(), score.formula_ttft_s, Instant::now()));
        route.prediction = match (&route.prompt, pool.slots.get(index)) {
            (Some(prompt), Some(slot)) => Some(pool.kv.predictions.add(*slot, prompt.clone())),
            _ => None,
        };
        let mut peer = HttpPeer::new(socket, false, String::new());
        peer.options.connection_timeout =
            Some(Duration::from_millis(pool.config.connect_timeout_ms));
        peer.options.read_timeout = Some(self.settings.upstream_read_timeout);
        Ok(Box::new(peer))
    }

    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        if ctx.route.is_some() {
            // Replace Pingora's replay of the body's tail with the whole (rewritten) body.
            *body = Some(if end_of_stream {
                ctx.body.clone()
            } else {
                Bytes::new()
            });
        }
        Ok(())
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        upstream_request: &mut RequestHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        let Some(route) = &ctx.route else {
            return Ok(());
        };
        if let Some(provider) = &route.provider {
            headers::keep_for_provider(upstream_request, &provider.config.forward_headers);
        }
        if let Some(path) = &route.upstream_path {
            let uri = http::Uri::try_from(path.as_str())
                .map_err(|_| Error::explain(ErrorType::InternalError, "invalid upstream path"))?;
            upstream_request.set_uri(uri);
        }
        if route.translate == Translation::MessagesToChat {
            upstream_request.remove_header("anthropic-version");
            upstream_request.remove_header("anthropic-beta");
        }
        upstream_request.remove_header(&http::header::TRANSFER_ENCODING);
        upstream_request.insert_header(http::header::CONTENT_LENGTH, ctx.body.len().to_string())?;
        upstream_request.insert_header(http::header::CONTENT_TYPE, "application/json")?;
        // The client's gateway credentials are not the worker's business.
        upstream_request.remove_header(&http::header::AUTHORIZATION);
        upstream_request.remove_header("x-api-key");
        // Responses are inspected (translation, accounting): keep them uncompressed.
        upstream_request.remove_header(&http::header::ACCEPT_ENCODING);
        upstream_request.insert_header("x-request-id", ctx.request_id.as_str())?;
        if let Some(span) = &ctx.span {
            // The upstream's spans hang under this request's span, not the caller's.
            upstream_request.remove_header("traceparent");
            upstream_request.remove_header("tracestate");
            for (name, value) in span.propagation_headers() {
                upstream_request.insert_header(name, value)?;
            }
        }
        if let Some(provider) = &route.provider {
            upstream_request.insert_header(http::header::HOST, provider.authority.as_str())?;
            match provider.config.format {
                ProviderFormat::Openai => {
                    if let Some(key) = &provider.key {
                        upstream_request
                            .insert_header(http::header::AUTHORIZATION, format!("Bearer {key}"))?;
                    }
                }
                ProviderFormat::Anthropic => {
                    if let Some(key) = &provider.key {
                        upstream_request.insert_header("x-api-key", key.as_str())?;
                    }
                    if upstream_request.headers.get("anthropic-version").is_none() {
                        upstream_request.insert_header("anthropic-version", "2023-06-01")?;
                    }
                }
            }
        }
        Ok(())
    }

    async fn response_filter(
        &self,
        _session: &mut Session,
        upstream_response: &mut ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        let status = upstream_response.status.as_u16();
        // A 5xx before any byte reached the client: the next target, if there is one.
        if status >= 500
            && let Some(route) = ctx.route.as_mut()
            && let Some(body) = route.next_target()
        {
            tracing::warn!(request_id = %ctx.request_id, status, "upstream failed; trying the next target");
            route.fallback_requested = true;
            ctx.body = body;
            ctx.response = ResponseMode::PassThrough;
            return Err(Error::explain(
                ErrorType::HTTPStatus(status),
                "upstream error; trying the next target",
            ));
        }
        ctx.status = status;
        if ctx.route.as_ref().is_some_and(|r| r.provider.is_some()) {
            headers::keep_from_provider(upstream_response);
        }
        upstream_response.insert_header("x-request-id", ctx.request_id.as_str())?;
        let Some(route) = ctx.route.as_mut() else {
            return Ok(());
        };
        if route.explain
            && let Some(decision) = &route.decision
            && let Some(pool) = &route.pool
        {
            upstream_response.insert_header(EXPLAIN_RESPONSE_HEADER, decision.explain(pool))?;
        }
        if let Some(trace) = &route.policy_explain {
            upstream_response.insert_header(POLICY_RESPONSE_HEADER, trace.as_str())?;
        }
        if !route.stream {
            // A non-streamed answer arrives whole: its prefill is long over.
            route.pending = None;
        }
        let route = &*route;
        if route.translate != Translation::None {
            upstream_response.remove_header(&http::header::CONTENT_LENGTH);
            let streaming = route.stream && ctx.status < 400;
            ctx.response = if streaming {
                upstream_response.insert_header(http::header::CONTENT_TYPE, "text/event-stream")?;
                let client_model = &route.requested_model;
                ResponseMode::TranslateStream(match route.translate {
                    Translation::ChatToMessages => {
                        Box::new(MessagesStreamTranslator::new(client_model))
                    }
                    _ => Box::new(StreamTranslator::new(client_model)),
                })
            } else {
                upstream_response.insert_header(http::header::CONTENT_TYPE, "application/json")?;
                let (answer, error): (fn(&[u8], &str) -> Bytes, fn(u16, &[u8]) -> Bytes) =
                    match route.translate {
                        Translation::ChatToMessages => (
                            translate_openai::message_response_to_chat,
                            translate_openai::error_to_openai,
                        ),
                        _ => (
                            translate::chat_response_to_message,
                            translate::error_to_anthropic,
                        ),
                    };
                ResponseMode::TranslateWhole {
                    buffer: BytesMut::new(),
                    status: ctx.status,
                    answer,
                    error,
                }
            };
        }
        Ok(())
    }

    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<Option<Duration>> {
        let client_model = ctx
            .route
            .as_ref()
            .map_or("", |r| r.requested_model.as_str());
        match &mut ctx.response {
            ResponseMode::PassThrough => {}
            ResponseMode::TranslateStream(translator) => {
                let mut out = BytesMut::new();
                if let Some(chunk) = body.take() {
                    out.extend_from_slice(&translator.feed(&chunk));
                }
                if end_of_stream {
                    out.extend_from_slice(&translator.finish());
                }
                *body = (!out.is_empty()).then(|| out.freeze());
            }
            ResponseMode::TranslateWhole {
                buffer,
                status,
                answer,
                error,
            } => {
                if let Some(chunk) = body.take() {
                    buffer.extend_from_slice(&chunk);
                }
                if end_of_stream {
                    *body = Some(if *status >= 400 {
                        error(*status, buffer)
                    } else {
                        answer(buffer, client_model)
                    });
                }
            }
        }
        if let Some(route) = ctx.route.as_mut() {
            if let Some(chunk) = body.take() {
                if route.first_byte.is_none() && !chunk.is_empty() {
                    route.first_byte = Some(Instant::now());
                    // vLLM streams nothing before the first token: the prefill is done, and the
                    // worker's queue no longer holds it (decoding is counted by `current`).
                    route.pending = None;
                    if let Some((worker, formula, sent)) = route.expected_ttft.take()
                        && ctx.status < 400
                    {
                        worker.ttft.observe(formula, sent.elapsed().as_secs_f64());
                    }
                }
                *body = Some(route.usage.feed(chunk));
            }
            if end_of_stream {
                let rest = route.usage.finish();
                if !rest.is_empty() {
                    let mut out = BytesMut::from(body.take().unwrap_or_default().as_ref());
                    out.extend_from_slice(&rest);
                    *body = Some(out.freeze());
                }
            }
        }
        Ok(None)
    }

    /// Pingora's own "Fail to proxy" line is replaced by the request line `logging` writes,
    /// whose level says who failed (a client hanging up is not an error of the gateway).
    fn suppress_error_log(&self, _session: &Session, _ctx: &RequestCtx, _error: &Error) -> bool {
        true
    }

    /// Retries are logged where they are decided (`fail_to_connect`, `error_while_proxy`).
    fn suppress_proxy_warn_log(
        &self,
        _session: &Session,
        _ctx: &RequestCtx,
        _error: &Error,
        _context: pingora_proxy::ProxyWarnLogContext,
    ) -> bool {
        true
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        peer: &HttpPeer,
        ctx: &mut RequestCtx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        if let Some(route) = ctx.route.as_mut() {
            let attempts = route.tried.len();
            tracing::warn!(
                request_id = %ctx.request_id,
                worker = %peer.address(),
                attempt = attempts,
                error = e.etype().as_str(),
                "could not connect to worker"
            );
            route.last_connect_error = Some(e.etype().as_str().to_owned());
            let may_retry = route.pool.as_ref().is_some_and(|pool| {
                attempts < pool.config.max_attempts as usize && pool.pick(&route.tried).is_some()
            });
            if may_retry {
                e.set_retry(true);
            } else if let Some(body) = route.next_target() {
                ctx.body = body;
                e.set_retry(true);
            } else {
                e.set_retry(false);
            }
        }
        e
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        _session: &mut Session,
        e: Box<Error>,
        ctx: &mut RequestCtx,
        client_reused: bool,
    ) -> Box<Error> {
        let mut e = e.more_context(format!("worker {}", peer.address()));
        // A pooled connection the worker had already closed fails before the worker saw the
        // request: safe to send again, to the same worker on a fresh connection. Anything after
        // a response started is not retried.
        if let Some(route) = ctx.route.as_mut()
            && route.fallback_requested
        {
            route.fallback_requested = false;
            e.set_retry(true);
            return e;
        }
        let mut retry = false;
        if let Some(route) = ctx.route.as_mut()
            && client_reused
            && ctx.status == 0
            && route.reconnects
                < route
                    .pool
                    .as_ref()
                    .map_or(1, |pool| pool.config.max_attempts)
        {
            route.reconnects += 1;
            route.reconnect_to = route.tried.last().copied();
            retry = route.reconnect_to.is_some();
            tracing::debug!(
                request_id = %ctx.request_id,
                worker = %peer.address(),
                error = e.etype().as_str(),
                "pooled connection to the worker was closed; sending again on a new one"
            );
        }
        e.set_retry(retry);
        e
    }

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut RequestCtx,
    ) -> FailToProxy {
        if session.response_written().is_some() {
            // Headers already went out: all that is left is to end the connection.
            return FailToProxy {
                error_code: 0,
                can_reuse_downstream: false,
            };
        }
        let error = ctx.failure.clone().unwrap_or_else(|| {
            let worker_count = ctx.route.as_ref().map_or(0, |r| r.tried.len());
            match e.etype() {
                ErrorType::ConnectTimedout
                | ErrorType::ConnectRefused
                | ErrorType::ConnectError
                | ErrorType::ConnectNoRoute
                | ErrorType::TLSHandshakeFailure => ApiError::new(
                    ErrorKind::BadGateway,
                    "upstream_unreachable",
                    format!("could not connect to a worker ({worker_count} tried); retry shortly"),
                ),
                ErrorType::ReadTimedout | ErrorType::WriteTimedout => ApiError::new(
                    ErrorKind::GatewayTimeout,
                    "upstream_timeout",
                    "the worker did not answer in time",
                ),
                ErrorType::HTTPStatus(status) => ApiError::new(
                    if *status == 503 {
                        ErrorKind::Unavailable
                    } else {
                        ErrorKind::BadGateway
                    },
                    "upstream_error",
                    format!("upstream error {status}"),
                ),
                _ => match e.esource() {
                    pingora_error::ErrorSource::Downstream => {
                        ApiError::invalid("body", "the request could not be read")
                    }
                    pingora_error::ErrorSource::Internal | pingora_error::ErrorSource::Unset => {
                        ApiError::new(
                            ErrorKind::Internal,
                            "internal_error",
                            "internal gateway error",
                        )
                    }
                    pingora_error::ErrorSource::Upstream => ApiError::new(
                        ErrorKind::BadGateway,
                        "upstream_error",
                        "the worker closed the connection before answering",
                    ),
                },
            }
        });
        let status = error.status();
        let code = match self
            .respond_json(session, ctx, status, error.body(ctx.format), &[])
            .await
        {
            Ok(()) => status,
            Err(_) => 0,
        };
        ctx.failure = Some(error);
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    async fn logging(&self, _session: &mut Session, e: Option<&Error>, ctx: &mut RequestCtx) {
        if let Some(span) = ctx.span.take() {
            span.end(
                span_attributes(ctx),
                ctx.status,
                e.map(|e| e.etype().as_str()),
            );
        }
        let route = ctx.route.as_ref();
        let worker = route
            .and_then(|r| r.current.as_ref())
            .map(|f| f.worker().address.as_str())
            .unwrap_or("");
        let failure = e.map(|e| Failure::of(e, ctx.status));
        if failure == Some(Failure::Client) {
            metrics::client_disconnected();
        }
        // One line per request, at the level of whoever failed (see `logging.rs`).
        macro_rules! request_line {
            ($level:expr, $message:literal) => {
                tracing::event!(
                    $level,
                    request_id = %ctx.request_id,
                    endpoint = ctx.endpoint.map_or("unknown", Endpoint::label),
                    model = route.map_or("", |r| r.requested_model.as_str()),
                    upstream_model = route.map_or("", |r| r.upstream_model.as_str()),
                    tenant = route.and_then(|r| r.tenant.as_deref()).unwrap_or(""),
                    policy_rule = route.and_then(|r| r.rule.as_deref()).unwrap_or(""),
                    pool = %route
                        .and_then(|r| r.pool.as_ref())
                        .map_or(String::new(), |p| p.config.id.to_string()),
                    provider = %route
                        .and_then(|r| r.provider.as_ref())
                        .map_or(String::new(), |p| p.config.id.to_string()),
                    worker,
                    attempts = route.map_or(0, |r| r.tried.len()),
                    status = ctx.status,
                    error = e.map(|e| e.etype().as_str()),
                    error_source = e.map(|e| e.esource().as_str()),
                    last_connect_error = route.and_then(|r| r.last_connect_error.as_deref()),
                    duration_ms = ctx.started.elapsed().as_millis() as u64,
                    $message
                )
            };
        }
        match failure {
            None => request_line!(tracing::Level::INFO, "request"),
            Some(Failure::Client) => {
                request_line!(tracing::Level::INFO, "request ended by the client")
            }
            Some(Failure::Upstream) => {
                request_line!(tracing::Level::WARN, "request failed upstream")
            }
            Some(Failure::Gateway) => {
                request_line!(tracing::Level::ERROR, "request failed in the gateway")
            }
        }
        if let Some(route) = route
            && let (Some(decision), Some(pool)) = (&route.decision, &route.pool)
        {
            tracing::debug!(request_id = %ctx.request_id, route = %decision.explain(pool), "routing decision");
        }
        if let Some(route) = ctx.route.as_mut() {
            let usage = route.usage.usage;
            if let Some(admission) = route.admission.as_mut()
                && usage.reported
            {
                admission.settle(usage.prompt_tokens, usage.completion_tokens);
            }
            accounting::finished(&Finished {
                tenant: route.tenant.as_deref(),
                model: &route.requested_model,
                target: &route.target_label,
                status: ctx.status,
                usage,
                ttft: route.first_byte.map(|t| t.duration_since(ctx.started)),
                total: ctx.started.elapsed(),
            });
        }
        // Release the in-flight slot now rather than when Pingora drops the context.
        if let Some(route) = ctx.route.as_mut() {
            route.admission = None;
            route.current = None;
            route.pending = None;
            route.prediction = None;
        }
    }
}

/// The routing facts of a finished request for its span: no prompt text, no credentials.
fn span_attributes(ctx: &RequestCtx) -> Vec<KeyValue> {
    let mut attributes = vec![
        KeyValue::new("http.response.status_code", i64::from(ctx.status)),
        KeyValue::new("switchyard.request_id", ctx.request_id.clone()),
    ];
    let Some(route) = &ctx.route else {
        return attributes;
    };
    attributes.push(KeyValue::new(
        "gen_ai.request.model",
        route.requested_model.clone(),
    ));
    attributes.push(KeyValue::new(
        "switchyard.upstream_model",
        route.upstream_model.clone(),
    ));
    attributes.push(KeyValue::new(
        "switchyard.target",
        route.target_label.clone(),
    ));
    attributes.push(KeyValue::new(
        "switchyard.attempts",
        route.tried.len() as i64,
    ));
    attributes.push(KeyValue::new("switchyard.stream", route.stream));
    if let Some(tenant) = &route.tenant {
        attributes.push(KeyValue::new("switchyard.tenant", tenant.clone()));
    }
    if let Some(rule) = &route.rule {
        attributes.push(KeyValue::new("switchyard.policy.rule", rule.clone()));
    }
    if let Some(current) = &route.current {
        attributes.push(KeyValue::new(
            "switchyard.worker",
            current.worker().address.clone(),
        ));
    }
    if let Some(provider) = &route.provider {
        attributes.push(KeyValue::new(
            "switchyard.provider",
            provider.config.id.to_string(),
        ));
    }
    let chosen = route.tried.last().and_then(|index| {
        route
            .decision
            .as_ref()
            .and_then(|d| d.scores.iter().find(|s| s.position == *index))
    });
    if let Some(score) = chosen {
        attributes.push(KeyValue::new(
            "switchyard.prefix.matched_tokens",
            score.cached_tokens as i64,
        ));
        attributes.push(KeyValue::new(
            "switchyard.ttft.predicted_ms",
            score.predicted_ttft_s * 1000.0,
        ));
    }
    if let Some(prompt) = &route.prompt {
        attributes.push(KeyValue::new(
            "switchyard.prompt.tokens",
            prompt.tokens as i64,
        ));
    }
    if let Some(first) = route.first_byte {
        attributes.push(KeyValue::new(
            "switchyard.ttft.actual_ms",
            first.duration_since(ctx.started).as_secs_f64() * 1000.0,
        ));
    }
    let usage = route.usage.usage;
    if usage.reported {
        attributes.push(KeyValue::new(
            "gen_ai.usage.input_tokens",
            usage.prompt_tokens as i64,
        ));
        attributes.push(KeyValue::new(
            "gen_ai.usage.output_tokens",
            usage.completion_tokens as i64,
        ));
    }
    attributes
}

/// Who made a request fail, which decides the level of its log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// The client closed the connection or sent something unreadable.
    Client,
    /// A worker or provider failed (refused, timed out, broke the connection, answered 5xx).
    Upstream,
    /// The gateway itself.
    Gateway,
}

impl Failure {
    fn of(error: &Error, status: u16) -> Failure {
        match error.esource() {
            pingora_error::ErrorSource::Downstream => Failure::Client,
            pingora_error::ErrorSource::Upstream => Failure::Upstream,
            // Errors the gateway raises on purpose to answer a worker's status (fallbacks) carry
            // that status; anything else unexplained is ours.
            pingora_error::ErrorSource::Internal | pingora_error::ErrorSource::Unset => {
                if matches!(error.etype(), ErrorType::HTTPStatus(_))
                    || (502..=504).contains(&status)
                {
                    Failure::Upstream
                } else {
                    Failure::Gateway
                }
            }
        }
    }
}
