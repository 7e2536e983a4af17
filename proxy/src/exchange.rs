//! The attempt phase: a planned request on its way upstream.
//!
//! An [`Exchange`] holds what the planner decided and the state of the current target's
//! attempts: the workers tried, the one in flight (counted against it until the request ends),
//! its pending prefill and predicted cache blocks, and the scorer's numbers. Moving to a
//! fallback target replaces the [`Target`] and starts a fresh [`Attempt`]; nothing is reset by
//! hand. Pingora's hooks ask it for the next peer, whether a failure may be retried, and what
//! the upstream request's head must say.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_http::{RequestHeader, ResponseHeader};
use switchyard_snapshot::snapshot::{Backend, LoadBalancing, ProviderFormat};

use crate::accounting::{Usage, UsageTap};
use crate::answer::{self, Answer, Delivery};
use crate::api::{ApiError, ClientFormat, Endpoint, ErrorKind};
use crate::background;
use crate::calibration::{Coefficients, Observation, PrefillWork, SpeedAnswer};
use crate::headers;
use crate::kv::Prediction;
use crate::limits::Admission;
use crate::metrics::{Metrics, RequestSeries};
use crate::plan::{self, ClientRequest, Plan, Target, Translation};
use crate::prompt::{self, Unfinished};
use crate::responses::{Holder, ResponseDirectory};
use crate::routing::{
    Destination, InFlight, KvReservation, PendingPrefill, PoolRuntime, Prefill, ProviderRuntime,
    RoutingTable, WorkerState,
};
use crate::scorer::{self, Decision, Outcome, WorkerScore};
use crate::telemetry::RequestSpan;
use crate::translate::refused_credentials;

/// Response header carrying the routing explanation.
const EXPLAIN_RESPONSE_HEADER: &str = "x-switchyard-route";
/// Response header carrying the policy trace (rules looked at, prompt classes, target).
const POLICY_RESPONSE_HEADER: &str = "x-switchyard-policy";
/// Response header naming the model that served the answer (answers name the client's alias).
const SERVED_MODEL_HEADER: &str = "x-switchyard-served-model";

/// The attempts on one target.
#[derive(Debug, Default)]
pub struct Attempt {
    /// Indexes of workers already tried (a provider counts as index 0).
    pub tried: Vec<usize>,
    /// Set when a pooled connection to this worker turned out closed: try it again on a fresh one.
    pub reconnect_to: Option<usize>,
    /// How many times that happened (bounded by the pool's `maxAttempts`).
    pub reconnects: u32,
    /// The worker of the current attempt, counted as in flight.
    pub current: Option<InFlight>,
    /// The scorer's decision for the current attempt (cache-aware pools).
    pub decision: Option<Decision>,
    /// Prefill work counted against the chosen worker until its first token (of a whole
    /// answer: until the first token the scorer predicted).
    pub pending: Option<Prefill>,
    /// KV blocks counted against the chosen worker until the request ends.
    pub kv: Option<KvReservation>,
    /// The chosen worker will hold this prompt's blocks; counted until the request ends.
    pub prediction: Option<Prediction>,
    /// What the scorer predicted for this streamed attempt: its first token and its usage
    /// teach the worker's speed and the pool's coefficients.
    pub ttft: Option<TtftProbe>,
    /// The prompt was routed by its head: the whole is tokenized once the worker has
    /// prefilled it (see [`finish_prompt`]).
    pub unfinished: Option<Arc<Unfinished>>,
    /// When this attempt's worker (or provider) was chosen: the request log's `routed_us`, the
    /// gateway's own time before the upstream sees the request.
    pub routed: Option<Instant>,
}

/// A streamed attempt's prediction, waiting for what happens.
#[derive(Debug)]
pub struct TtftProbe {
    worker: Arc<WorkerState>,
    pool: Arc<PoolRuntime>,
    /// The scorer's numbers for the chosen worker.
    score: WorkerScore,
    sent: Instant,
    /// Seconds from sending the request to its first token, once seen.
    observed_s: Option<f64>,
}

impl TtftProbe {
    /// The first token came: the time is kept for when the usage tells what was prefilled.
    fn first_token(&mut self) {
        self.observed_s = Some(self.sent.elapsed().as_secs_f64());
    }

    /// The request is over: the pool's coefficients and the worker's speed learn from what the
    /// worker prefilled (its own count of the uncached prompt when it reports cached tokens,
    /// else the prefix index's: a prompt the index took for cold but the worker held would
    /// otherwise teach that the worker is fast) and how long it took.
    fn finish(self, usage: &Usage) {
        let Some(observed) = self.observed_s else {
            return;
        };
        let (cached, uncached) =
            if usage.reported && usage.cached_reported && usage.prompt_tokens > 0 {
                let prompt = usize::try_from(usage.prompt_tokens).unwrap_or(usize::MAX);
                let cached = usize::try_from(usage.cached_tokens).unwrap_or(usize::MAX);
                (cached.min(prompt), prompt - cached.min(prompt))
            } else {
                (self.score.cached_tokens, self.score.uncached_tokens)
            };
        let own_prefill = PrefillWork::after(cached, uncached);
        let configured = Coefficients::configured(&self.pool.config.scoring);
        let observation = Observation {
            prefill: self.score.queued().plus(own_prefill),
            running: self.score.running as f64,
            ttft_s: observed / self.score.relative_speed.max(f64::EPSILON),
        };
        tracing::debug!(
            worker = %self.worker.address,
            queued_tokens = self.score.queued_tokens,
            uncached_predicted = self.score.uncached_tokens,
            uncached,
            running = self.score.running,
            predicted_s = self.score.predicted_ttft_s,
            observed_s = observed,
            "time to first token observed"
        );
        self.pool.kv.calibration.observe(configured, &observation);
        let (model, _, _) = crate::scorer::model(&self.pool);
        self.worker.ttft.observe(
            SpeedAnswer {
                predicted_s: self.score.formula_ttft_s,
                queued_tokens: self.score.queued_tokens,
                own_prefill,
                running: self.score.running,
                observed_s: observed,
            },
            &model,
        );
    }
}

impl Attempt {
    /// Release what the attempt counts against its worker.
    fn release(&mut self) {
        // The prediction first: the guards after it announce the change to the other replicas.
        self.prediction = None;
        self.unfinished = None;
        self.current = None;
        self.pending = None;
        self.kv = None;
    }

    /// The worker is past the prompt's prefill: its queue no longer holds it, and its KV
    /// events (not this replica's prediction) tell the other replicas where its blocks are.
    /// `computed`: it answered with output, not an error (which computed nothing).
    fn prefilled(&mut self, computed: bool) {
        if let Some(prediction) = &self.prediction {
            prediction.prefilled(computed);
        }
        self.pending = None;
    }
}

/// Whether an error while proxying leaves the request safe to send again: the upstream cannot
/// have read all of it. Pingora marks a pooled connection it had already closed when the
/// answer's head was read (`ReusedOnly`: the connection was `reused`) and an HTTP/2 stream it
/// refused (`Decided(true)`); a pooled connection that broke while the request was written
/// never delivered it whole either (vLLM reads the whole body before it starts). Anything else
/// may have reached the upstream (a read timeout while it works, the client gone while it
/// waits, a broken answer): sent again it would be computed, and billed by a provider, twice.
pub fn resendable(error: &pingora_error::Error, reused: bool) -> bool {
    use pingora_error::{ErrorSource, ErrorType, RetryType};
    match error.retry {
        RetryType::ReusedOnly => reused,
        RetryType::Decided(true) => true,
        RetryType::Decided(false) => {
            reused
                && error.etype == ErrorType::WriteError
                && error.esource != ErrorSource::Downstream
        }
    }
}

/// A planned request, from its first attempt to its last byte.
#[derive(Debug)]
pub struct Exchange {
    /// Kept so the snapshot the plan was made on outlives a reload mid-request.
    pub table: Arc<RoutingTable>,
    pub client: ClientRequest,
    /// The authenticated tenant (`None`: authentication is off).
    pub tenant: Option<String>,
    pub plan: Plan,
    /// The client asked for the routing explanation (`x-switchyard-explain`).
    pub explain: bool,
    /// The tenant's rate-limit admission: holds its concurrency slot, settles its tokens.
    pub admission: Option<Admission>,
    pub attempt: Attempt,
    pub answer: Answer,
    pub last_connect_error: Option<String>,
    /// An error decided by the gateway during the attempt phase (no worker left).
    pub failure: Option<ApiError>,
    /// Set when the current attempt is abandoned for the next target: that error is retried.
    pub fallback_requested: bool,
    /// The current target was given up: the next one is prepared before the next attempt.
    pending_fallback: bool,
    /// The accounting series of (tenant, model, current target) the request ends in.
    pub series: Arc<RequestSeries>,
    /// Where the worker of each stored response is noted (Responses API answers).
    responses: Option<Arc<ResponseDirectory>>,
    /// A `DELETE /v1/responses/{id}`: the id to forget once its worker deleted it.
    pub deletes_response: Option<String>,
}

impl Exchange {
    pub fn new(
        table: Arc<RoutingTable>,
        client: ClientRequest,
        tenant: Option<String>,
        plan: Plan,
        explain: bool,
        admission: Option<Admission>,
        series: Arc<RequestSeries>,
    ) -> Exchange {
        let answer = Answer::new(UsageTap::new(client.parsed.stream, plan.target.strip_usage));
        Exchange {
            table,
            client,
            tenant,
            plan,
            explain,
            admission,
            attempt: Attempt::default(),
            answer,
            last_connect_error: None,
            failure: None,
            fallback_requested: false,
            pending_fallback: false,
            series,
            responses: None,
            deletes_response: None,
        }
    }

    /// Note the worker of the stored responses this exchange produces in `directory`.
    pub fn with_responses(mut self, directory: Arc<ResponseDirectory>) -> Exchange {
        self.responses = Some(directory);
        self
    }

    pub fn target(&self) -> &Target {
        &self.plan.target
    }

    pub fn pool(&self) -> Option<&Arc<PoolRuntime>> {
        self.plan.target.pool()
    }

    pub fn provider(&self) -> Option<&Arc<ProviderRuntime>> {
        self.plan.target.provider()
    }

    pub fn stream(&self) -> bool {
        self.client.parsed.stream
    }

    /// The upstream streams its answer: the client asked for a stream, or for a whole answer
    /// the gateway assembles (either way its first token shows).
    pub fn upstream_streams(&self) -> bool {
        self.stream() || self.plan.target.assemble.is_some()
    }

    /// The body the current target gets.
    pub fn upstream_body(&self) -> &Bytes {
        &self.plan.target.body
    }

    /// Give the current target up for the next one (`false`: none is left). The next target is
    /// prepared by [`Exchange::advance`] before the next attempt, off the event loop for large
    /// bodies: preparing parses the body again and may translate it.
    fn fall_back(&mut self) -> bool {
        if self.plan.fallbacks.is_empty() {
            return false;
        }
        self.pending_fallback = true;
        true
    }

    /// Prepare the target given up for (see [`Exchange::fall_back`]), counted in `metrics`.
    /// `false` when none of the remaining targets could be prepared.
    pub async fn advance(&mut self, metrics: &Metrics) -> bool {
        if !std::mem::take(&mut self.pending_fallback) {
            return true;
        }
        let mut fallbacks = std::mem::take(&mut self.plan.fallbacks);
        let (table, salt) = (self.table.clone(), self.plan.cache_salt.clone());
        let prepared = if self.client.body.len() <= plan::INLINE_PLAN_BYTES {
            plan::next_fallback(&table, &mut fallbacks, &self.client, salt.as_deref())
                .map(|target| (target, fallbacks))
        } else {
            let client = self.client.clone();
            tokio::task::spawn_blocking(move || {
                plan::next_fallback(&table, &mut fallbacks, &client, salt.as_deref())
                    .map(|target| (target, fallbacks))
            })
            .await
            .ok()
            .flatten()
        };
        let Some((target, fallbacks)) = prepared else {
            return false;
        };
        self.plan.fallbacks = fallbacks;
        tracing::info!(from = %self.plan.target.label, to = %target.label, "falling back to the next target");
        metrics.fallback(&self.plan.target.label, &target.label);
        self.series = metrics.request_series(
            self.tenant.as_deref(),
            &self.client.parsed.model,
            &target.label,
        );
        self.answer = Answer::new(UsageTap::new(self.stream(), target.strip_usage));
        self.plan.target = target;
        self.attempt = Attempt::default();
        true
    }

    /// Pick the worker of an attempt: the scorer for cache-aware pools, the pool's policy
    /// otherwise. `first_attempt` records the decision in the pool's statistics.
    pub fn choose_worker(&mut self, first_attempt: bool) -> Option<usize> {
        let pool = self.pool()?.clone();
        if let Some(worker) = &self.plan.target.pinned {
            // The one worker that holds the stored response.
            return pool
                .workers
                .iter()
                .position(|w| &w.address == worker)
                .filter(|index| !self.attempt.tried.contains(index));
        }
        if pool.config.load_balancing != LoadBalancing::CacheAware {
            return pool.pick(&self.attempt.tried);
        }
        let prompt = self.plan.target.prompt.as_deref();
        let output = self.client.parsed.max_tokens.unwrap_or(0);
        let output = usize::try_from(output).unwrap_or(usize::MAX);
        let decision = scorer::decide_for_prompt(&pool, prompt, output, &self.attempt.tried)?;
        if first_attempt {
            let kv = &pool.kv;
            let prefill = decision
                .chosen_score()
                .map_or(PrefillWork::after(0, decision.prompt_tokens), |s| {
                    s.own_prefill()
                });
            // A prompt not tokenized has no known size: it says nothing of the average.
            if let Some(prompt) = prompt {
                kv.record_prefill(prefill);
                // How long after its history was freed the prompt came back for it (where
                // the most of it was freed), before this request holds it again.
                let reused = pool
                    .workers
                    .iter()
                    .filter_map(|w| w.freed_prefix(&prompt.hashes))
                    .max_by_key(|(depth, ago)| (*depth, std::cmp::Reverse(*ago)));
                if let Some((_, ago)) = reused {
                    kv.record_reuse(ago);
                }
                // A copy's prefill is not demand for the prefix: counting it would make each
                // copy invite the next.
                let copied = decision.chosen_score().map_or(0, |s| s.replicated_tokens);
                kv.popularity.record(
                    &prompt.hashes,
                    (prefill.tokens as usize).saturating_sub(copied),
                );
            }
            kv.record_arrival();
            let counter = match decision.outcome {
                Outcome::CacheHit => &kv.decisions.cache_hit,
                Outcome::NoCache => &kv.decisions.no_cache,
                Outcome::Spread => &kv.decisions.spread,
                Outcome::Replicate => &kv.decisions.replicate,
            };
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let chosen = decision.chosen;
        self.attempt.decision = Some(decision);
        Some(chosen)
    }

    /// The peer of the next attempt, counted against its worker until the request ends.
    pub fn next_peer(&mut self, read_timeout: Duration) -> Result<HttpPeer, ApiError> {
        self.attempt.release();
        if let Some(provider) = self.provider().cloned() {
            return self.provider_peer(&provider).ok_or_else(|| {
                ApiError::new(
                    ErrorKind::BadGateway,
                    "upstream_unreachable",
                    format!(
                        "the address of provider {} is not resolved",
                        provider.config.id
                    ),
                )
            });
        }
        let Some(pool) = self.pool().cloned() else {
            return Err(ApiError::new(
                ErrorKind::Internal,
                "internal_error",
                "internal gateway error",
            ));
        };
        // Choosing and counting the request against its worker are one step for the pool's
        // requests on every thread (released when the attempt's guards are in place).
        let _choosing = crate::lock(&pool.kv.choosing);
        let reconnect = self.attempt.reconnect_to.take();
        let first_attempt = self.attempt.tried.is_empty() && reconnect.is_none();
        let picked = reconnect
            .or_else(|| self.choose_worker(first_attempt))
            .and_then(|index| {
                let worker = pool.workers.get(index)?;
                Some((index, worker.clone(), worker.socket?))
            });
        let Some((index, worker, socket)) = picked else {
            let model = &self.client.parsed.model;
            return Err(if self.attempt.tried.is_empty() {
                ApiError::new(
                    ErrorKind::Unavailable,
                    "no_workers",
                    format!("no worker of model '{model}' can take the request; retry shortly"),
                )
            } else {
                ApiError::new(
                    ErrorKind::BadGateway,
                    "upstream_unreachable",
                    format!(
                        "could not reach a worker for model '{model}' after {} attempt(s)",
                        self.attempt.tried.len()
                    ),
                )
            });
        };
        let stream = self.upstream_streams();
        let prompt = self.plan.target.prompt.clone();
        let attempt = &mut self.attempt;
        if reconnect.is_none() {
            attempt.tried.push(index);
        }
        attempt.current = Some(InFlight::start(&worker));
        let score = attempt.decision.as_ref().and_then(|d| d.score(index));
        let prefill = match (score, &prompt) {
            (Some(score), _) => score.own_prefill(),
            (None, Some(prompt)) if attempt.decision.is_none() => {
                PrefillWork::after(0, prompt.tokens)
            }
            _ => PrefillWork::default(),
        };
        attempt.ttft = score.filter(|_| stream).map(|score| TtftProbe {
            worker: worker.clone(),
            pool: pool.clone(),
            score: score.clone(),
            sent: Instant::now(),
            observed_s: None,
        });
        let pending = PendingPrefill::start(&worker, prefill);
        // A whole answer shows no first token (its head comes with its last): its prefill
        // counts until the one predicted.
        // (At most the read timeout: the head comes by then or the attempt ends, and the timer
        // would outlive its request.)
        let predicted = score
            .filter(|_| !stream)
            .and_then(|score| Duration::try_from_secs_f64(score.predicted_ttft_s).ok())
            .map(|after| after.min(read_timeout));
        attempt.pending = Some(match predicted {
            Some(after) => Prefill::unseen(pending, after),
            None => Prefill::Seen(pending),
        });
        // The decision scored the prompt's hashes: the worker holds them from now on.
        let hashes = prompt.as_ref().map_or(&[][..], |p| p.hashes.as_slice());
        attempt.kv = attempt
            .decision
            .as_ref()
            .filter(|_| score.is_some())
            .map(|d| KvReservation::start(&worker, hashes, d.unhashed_kv_blocks));
        attempt.prediction = match (prompt, pool.slots.get(index)) {
            (Some(prompt), Some(slot)) => {
                let unfinished = prompt
                    .unfinished
                    .clone()
                    .filter(|_| attempt.tried.len() == 1);
                let known = score.map_or(0, |score| score.matched_blocks as usize);
                let prediction = pool.kv.predictions.add(*slot, prompt, known);
                // Without KV events nothing else will say what the worker holds afterwards.
                if let Some(capacity) = pool.history_capacity(index) {
                    prediction.remember(capacity);
                }
                // The other replicas know the prompt only as far as this one tells them: while
                // it is prefilled, the whole of it. (If the background queue refuses it now,
                // the first token tries again.)
                if let Some(unfinished) = &unfinished
                    && crate::peers::sharing()
                {
                    finish_prompt(&pool, &prediction, unfinished.clone(), Duration::ZERO);
                }
                attempt.unfinished = unfinished;
                Some(prediction)
            }
            _ => None,
        };
        // The decision is complete (prefill, KV blocks, prediction): the peers may see it.
        crate::worker::ledger_changed();
        let mut peer = HttpPeer::new(socket, false, String::new());
        peer.options.connection_timeout =
            Some(Duration::from_millis(pool.config.connect_timeout_ms));
        peer.options.read_timeout = Some(read_timeout);
        Ok(peer)
    }

    /// The peer of a provider attempt (one per request; a stale pooled connection may be retried).
    fn provider_peer(&mut self, provider: &ProviderRuntime) -> Option<HttpPeer> {
        let socket = provider.socket?;
        if self.attempt.reconnect_to.take().is_none() {
            self.attempt.tried.push(0);
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
        // Pingora's connection pool keys peers by address, SNI and verification flags, not by
        // the CA list: without a group of its own, a connection verified against one provider's
        // CA could be reused for another provider at the same address that trusts other roots.
        peer.group_key = provider.group_key;
        Some(peer)
    }

    /// A connection to the current attempt's peer failed: whether to try again (another worker
    /// of the pool, or the next target).
    pub fn retry_after_connect_failure(&mut self, error: &str) -> bool {
        self.last_connect_error = Some(error.to_owned());
        let attempts = self.attempt.tried.len();
        let another_worker = self.plan.target.pinned.is_none()
            && self.pool().is_some_and(|pool| {
                attempts < pool.config.max_attempts as usize
                    && pool.pick(&self.attempt.tried).is_some()
            });
        another_worker || self.fall_back()
    }

    /// The connection broke after it was made. A pooled connection the worker had already
    /// closed fails before the worker saw the request (`resendable`, see [`resendable`]): safe
    /// to send again, to the same worker on a fresh one. Anything else, and anything after a
    /// response started (`answered`), is not retried, except the 5xx the gateway itself
    /// abandoned for the next target.
    pub fn retry_after_broken_connection(&mut self, resendable: bool, answered: bool) -> bool {
        if self.fallback_requested {
            self.fallback_requested = false;
            return true;
        }
        let limit = self.pool().map_or(1, |pool| pool.config.max_attempts);
        if !resendable || answered || self.attempt.reconnects >= limit {
            return false;
        }
        self.attempt.reconnects += 1;
        self.attempt.reconnect_to = self.attempt.tried.last().copied();
        self.attempt.reconnect_to.is_some()
    }

    /// The event that ends the client's stream with `error` when its worker failed after the
    /// status went out; `None` when the client gets no stream, or the last event went out in
    /// part (the connection is then cut).
    pub fn stream_failure_event(&self, error: &ApiError) -> Option<bytes::Bytes> {
        self.answer
            .can_end_with_event()
            .then(|| error.stream_event(self.client.endpoint, self.answer.events_sent))
    }

    /// The upstream answered `status` before any byte reached the client: a 5xx, or a refusal
    /// of the gateway's credentials, moves to the next target when there is one (`true`:
    /// abandon this answer).
    pub fn fall_back_on_status(&mut self, status: u16) -> bool {
        if (status < 500 && !refused_credentials(status)) || !self.fall_back() {
            return false;
        }
        self.fallback_requested = true;
        true
    }

    /// The head of the request sent upstream.
    pub fn upstream_request(
        &self,
        request: &mut RequestHeader,
        request_id: &str,
        span: Option<&RequestSpan>,
    ) -> pingora_error::Result<()> {
        let target = self.target();
        if let Some(provider) = self.provider() {
            headers::keep_for_provider(request, &provider.config.forward_headers);
        }
        if let Some(path) = &target.upstream_path {
            let uri = http::Uri::try_from(path.as_str()).map_err(|_| {
                pingora_error::Error::explain(
                    pingora_error::ErrorType::InternalError,
                    "invalid upstream path",
                )
            })?;
            request.set_uri(uri);
        }
        if target.translate == Translation::MessagesToChat {
            request.remove_header("anthropic-version");
            request.remove_header("anthropic-beta");
        }
        request.remove_header(&http::header::TRANSFER_ENCODING);
        // The gateway sends the whole body at once: a worker asked to confirm it first
        // (`Expect: 100-continue`) would answer with an interim head before the answer's.
        request.remove_header(&http::header::EXPECT);
        request.insert_header(http::header::CONTENT_LENGTH, target.body.len().to_string())?;
        if !self.client.endpoint.is_audio() {
            // A form keeps the client's type (its boundary); everything else is JSON.
            request.insert_header(http::header::CONTENT_TYPE, "application/json")?;
        }
        // The client's gateway credentials are not the worker's business.
        request.remove_header(&http::header::AUTHORIZATION);
        request.remove_header("x-api-key");
        // Responses are inspected (translation, accounting): keep them uncompressed.
        request.remove_header(&http::header::ACCEPT_ENCODING);
        request.insert_header("x-request-id", request_id)?;
        if let Some(span) = span {
            // The upstream's spans hang under this request's span, not the caller's.
            request.remove_header("traceparent");
            request.remove_header("tracestate");
            for (name, value) in span.propagation_headers() {
                request.insert_header(name, value)?;
            }
        }
        if let Some(provider) = self.provider() {
            request.insert_header(http::header::HOST, provider.authority.as_str())?;
            match (provider.config.format, &provider.key) {
                (ProviderFormat::Openai, Some(key)) => {
                    request.insert_header(http::header::AUTHORIZATION, format!("Bearer {key}"))?;
                }
                (ProviderFormat::Anthropic, key) => {
                    if let Some(key) = key {
                        request.insert_header("x-api-key", key.as_str())?;
                    }
                    if request.headers.get("anthropic-version").is_none() {
                        request.insert_header("anthropic-version", "2023-06-01")?;
                    }
                }
                (ProviderFormat::Openai, None) => {}
            }
        }
        Ok(())
    }

    /// The upstream's response head (a status below 500, or the last target's), made the
    /// client's.
    pub fn answer_head(
        &mut self,
        response: &mut ResponseHeader,
        request_id: &str,
        format: ClientFormat,
    ) -> pingora_error::Result<()> {
        let status = response.status.as_u16();
        if refused_credentials(status) {
            // The client is told 502 ([`Answer::head`]); the operator must hear of it.
            tracing::warn!(
                request_id,
                status,
                target = %self.plan.target.label,
                "the upstream refused the gateway's credentials"
            );
        }
        if self.provider().is_some() {
            headers::keep_from_provider(response);
        }
        response.insert_header("x-request-id", request_id)?;
        if self.explain
            && let Some(decision) = &self.attempt.decision
            && let Some(pool) = self.pool()
        {
            response.insert_header(EXPLAIN_RESPONSE_HEADER, decision.explain(pool))?;
        }
        if let Some(trace) = &self.plan.policy_explain {
            response.insert_header(POLICY_RESPONSE_HEADER, trace.as_str())?;
        }
        if !self.upstream_streams() {
            // A non-streamed answer arrives whole: its prefill is long over.
            self.attempt.prefilled(response.status.as_u16() < 400);
        }
        let target = &self.plan.target;
        // The client's alias names the model in answers; the header says what served it.
        response.insert_header(SERVED_MODEL_HEADER, target.upstream_model.as_str())?;
        let stream = self.client.parsed.stream;
        // vLLM's tokenizer routes answer without naming a model.
        let model_within = match self.client.endpoint {
            Endpoint::Tokenize | Endpoint::Detokenize => None,
            Endpoint::Responses | Endpoint::StoredResponse => Some(answer::RESPONSE_ALIAS_BYTES),
            _ => Some(answer::ALIAS_HEAD_BYTES),
        };
        // vLLM's Responses stream opens with `response.created` and `response.in_progress`
        // before its engine yields anything: its first token is the first event after them.
        self.answer.opens_with_events = stream
            && self.client.endpoint == Endpoint::Responses
            && target.translate == Translation::None;
        let delivery = match (stream, target.assemble) {
            (true, _) => Delivery::Stream,
            (false, Some(kind)) => Delivery::Assembled(kind),
            (false, None) => Delivery::Whole,
        };
        self.answer.head(
            response,
            target.translate,
            delivery,
            answer::Naming {
                client: &self.client.parsed.model,
                upstream: &target.upstream_model,
                within: model_within,
            },
            format,
        )?;
        if matches!(delivery, Delivery::Assembled(_))
            && response.status.as_u16() < 400
            && !self.answer.assembling()
        {
            // Asked for a stream, the worker answered whole after all: as for any whole
            // answer, its prefill is over, and its time to the first byte is no first token.
            self.attempt.prefilled(true);
            self.attempt.ttft = None;
        }
        Ok(())
    }

    /// A piece of the upstream's body (`status`: the answer's), made the client's. An error
    /// when the answer cannot reach the client whole: a stream the gateway assembles failed, or
    /// a whole answer to translate is none (its status is sent already: the client's
    /// connection is to be ended).
    pub fn answer_body(
        &mut self,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        status: u16,
    ) -> Result<(), String> {
        let first = self
            .answer
            .body(body, end_of_stream, &self.client.parsed.model);
        if let Some(why) = self.answer.failed.take() {
            return Err(why);
        }
        if let Some(id) = self.answer.usage.response_id.take()
            && status < 300
        {
            self.note_response(&id);
        }
        if end_of_stream
            && status < 300
            && let (Some(id), Some(directory)) = (&self.deletes_response, &self.responses)
        {
            directory.forget(id);
        }
        if !first {
            return Ok(());
        }
        // The first token (vLLM streams nothing before it but a Responses stream's opening
        // events, which `answer` passes over): the prefill is done, and the worker's queue no
        // longer holds it (decoding is counted by `current`). An error event in its place
        // (a stream that failed before its first token) computed nothing to keep, and its time
        // is no time to a first token.
        let computed = status < 400 && !self.answer.first_was_error;
        self.attempt.prefilled(computed);
        if let (Some(unfinished), Some(prediction), Some(pool)) = (
            self.attempt.unfinished.take(),
            self.attempt.prediction.as_ref(),
            self.plan.target.pool(),
        ) {
            finish_prompt(pool, prediction, unfinished, WHOLE_AFTER_FIRST_TOKEN);
        }
        match self.attempt.ttft.as_mut() {
            Some(probe) if computed => probe.first_token(),
            _ => self.attempt.ttft = None,
        }
        Ok(())
    }

    /// Note who holds the stored response `id` this answer made: the worker (or provider) it
    /// came from, for the tenant that asked. Answers the gateway translated are kept nowhere.
    fn note_response(&self, id: &str) {
        let Some(directory) = &self.responses else {
            return;
        };
        let target = &self.plan.target;
        if self.client.endpoint != Endpoint::Responses
            || !self.client.parsed.store
            || target.translate != Translation::None
        {
            return;
        }
        let (backend, worker) = match &target.destination {
            Destination::Pool(pool) => {
                let worker = self
                    .attempt
                    .tried
                    .last()
                    .and_then(|index| pool.workers.get(*index))
                    .map(|w| w.address.clone());
                (Backend::Pool(pool.config.id.clone()), worker)
            }
            Destination::Provider(provider) => {
                (Backend::Provider(provider.config.id.clone()), None)
            }
        };
        directory.record(
            id,
            Holder {
                backend,
                worker,
                tenant: self.tenant.clone(),
                client_model: self.client.parsed.model.clone(),
                upstream_model: target.upstream_model.clone(),
            },
        );
    }

    /// The request is over: release the worker and the tenant's slot now rather than when
    /// Pingora drops the context, settling the tenant's tokens with what the answer reported.
    pub fn finish(&mut self) {
        let usage = self.answer.usage.usage;
        if let Some(admission) = self.admission.as_mut()
            && usage.reported
        {
            admission.settle(usage.prompt_tokens, usage.completion_tokens);
        }
        self.admission = None;
        if let Some(probe) = self.attempt.ttft.take() {
            probe.finish(&usage);
        }
        self.attempt.release();
    }
}

/// How long after a prompt's first token its whole is tokenized (see [`finish_prompt`]).
const WHOLE_AFTER_FIRST_TOKEN: Duration = Duration::from_millis(5);

/// Tokenize the whole of a prompt routed by its head, once its worker has prefilled it, on the
/// low-priority background threads: its pieces are then in the segment cache for what follows
/// it (the next turn of a conversation), and its prediction holds all of its blocks. A request
/// that shares the prompt while it is still being prefilled does not wait for this: it has the
/// prompt tokenized whole itself, when it needs it ([`crate::kv::PoolKv::holds_all`]). Neither
/// the request's own path nor its prefill's window pays for work that, for a prompt nobody
/// shares, is never used.
/// Bounded: when the background queue is full, a prompt keeps its head's prediction.
///
/// It starts `after` a delay, [`WHOLE_AFTER_FIRST_TOKEN`] after the first token, once that
/// token is on its way to the client: started at once, it delayed the token at the client by
/// about 2 ms on this project's two-core machine (measured: a shared 1,000-token system prompt
/// and a unique question, sequential requests, p50 79.6 ms against 77.6 ms with no whole
/// tokenized and 77.1 ms through round-robin), niceness 19 notwithstanding. A replica with
/// peers starts at once when the prompt is routed: the others learn of its blocks from it alone
/// until the worker's KV events store them, and a prefix they know only by its head they
/// would copy to another worker.
fn finish_prompt(
    pool: &Arc<PoolRuntime>,
    prediction: &Prediction,
    unfinished: Arc<Unfinished>,
    after: Duration,
) {
    let (Some(tokenizer), Some(background)) = (pool.tokenizer.clone(), background::prompts())
    else {
        return;
    };
    let kv = pool.kv.clone();
    let (predictions, id) = prediction.handle();
    let whole = move || {
        if predictions.is_head(id) {
            if let Some(whole) = prompt::finish(&tokenizer, &kv.prompts, &unfinished) {
                predictions.finish(id, whole);
                crate::worker::ledger_changed();
            }
        } else if let Some((worker, capacity)) = predictions.take_ended_head(id)
            && let Some(whole) = prompt::finish(&tokenizer, &kv.prompts, &unfinished)
        {
            // Over before this ran (a whole answer ends at its first token), at a worker
            // without KV events: what it holds now is the whole prompt, not its head.
            predictions.freed(worker, &whole.hashes, capacity);
            crate::worker::ledger_changed();
        }
        // Otherwise the prompt was finished already, or nobody needs the whole.
    };
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(async move {
                tokio::time::sleep(after).await;
                background.try_run(whole);
            });
        }
        Err(_) => {
            background.try_run(whole);
        }
    }
}

#[cfg(test)]
mod tests;
