//! What the gateway answers itself: errors in the client's format, health and readiness, the
//! model list, `/metrics`, the `/debug/route` explanation, and the error for a failed proxy
//! attempt.

use std::sync::Arc;

use bytes::Bytes;
use pingora_error::{Error, ErrorSource, ErrorType, Result};
use pingora_http::ResponseHeader;
use pingora_proxy::Session;
use serde_json::json;
use switchyard_snapshot::snapshot::LoadBalancing;

use crate::admit::{self, Explain};
use crate::api::{ApiError, Endpoint, ErrorKind, client_format_for_path, model_id_of};
use crate::calibration::Coefficients;
use crate::cors;
use crate::exchange::Exchange;
use crate::gateway::{Gateway, RequestCtx};
use crate::metrics;
use crate::routing::{PoolRuntime, RoutingTable};

/// Admin path prefix: `POST /debug/route/v1/chat/completions` explains without forwarding.
pub const DEBUG_ROUTE_PREFIX: &str = "/debug/route";

impl Gateway {
    /// Write a complete response. When the request body was not read, the connection is closed
    /// afterwards so unread bytes are never taken for the next request.
    pub(crate) async fn respond(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        status: u16,
        content_type: &str,
        body: Bytes,
        extra: &[(&'static str, String)],
    ) -> Result<()> {
        ctx.status = status;
        let mut header = ResponseHeader::build(status, Some(4 + extra.len()))?;
        header.insert_header("content-type", content_type)?;
        header.insert_header("content-length", body.len().to_string())?;
        header.insert_header("x-request-id", ctx.request_id.as_str())?;
        for (name, value) in extra {
            header.insert_header(*name, value.as_str())?;
        }
        if let Some(allow) = &ctx.cors_allow {
            for (name, value) in cors::answer_headers(allow) {
                header.append_header(name, value)?;
            }
        }
        if !session.as_mut().is_body_done() {
            session.set_keepalive(None);
        }
        if session.as_ref().as_http1().is_some() && session.get_keepalive().is_none() {
            header.insert_header("connection", "close")?;
        }
        // HEAD: the GET answer's head (its length included), no body.
        let head_only = session.req_header().method == http::Method::HEAD;
        session
            .write_response_header(Box::new(header), head_only)
            .await?;
        if !head_only {
            session.write_response_body(Some(body), true).await?;
        }
        Ok(())
    }

    /// `OPTIONS` on an endpoint: the methods it takes, and for an allowed origin's preflight
    /// the CORS answer.
    pub(crate) async fn answer_options(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        endpoint: Endpoint,
    ) -> Result<bool> {
        let methods = endpoint.allowed_methods();
        let request = session.req_header();
        let mut extra = vec![("allow", methods.to_owned())];
        if ctx.cors_allow.is_some() && cors::is_preflight(&request.method, &request.headers) {
            extra.extend(cors::preflight_headers(methods, &request.headers));
        }
        self.respond(session, ctx, 204, "text/plain", Bytes::new(), &extra)
            .await?;
        Ok(true)
    }

    async fn respond_json(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        status: u16,
        body: serde_json::Value,
    ) -> Result<bool> {
        let body = Bytes::from(body.to_string());
        self.respond(session, ctx, status, "application/json", body, &[])
            .await?;
        Ok(true)
    }

    /// Answer `error` in the client's format. Always `Ok(true)`: the request is answered.
    pub(crate) async fn respond_error(
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
        let mut extra: Vec<(&'static str, String)> = Vec::new();
        if error.kind == ErrorKind::MethodNotAllowed
            && let Some(endpoint) = ctx.endpoint
        {
            extra.push(("allow", endpoint.allowed_methods().to_owned()));
        }
        if let Some(seconds) = error.retry_after {
            extra.push(("retry-after", seconds.to_string()));
        }
        self.respond(
            session,
            ctx,
            error.status(),
            "application/json",
            body,
            &extra,
        )
        .await?;
        Ok(true)
    }

    /// Answer the endpoints the gateway serves itself. `Ok(false)` for those it forwards.
    pub(crate) async fn answer_locally(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        endpoint: Endpoint,
    ) -> Result<bool> {
        match endpoint {
            Endpoint::Health => {
                self.respond_json(session, ctx, 200, json!({"status": "ok"}))
                    .await
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
                self.respond_json(session, ctx, status, body).await
            }
            Endpoint::Models => self.list_models(session, ctx).await,
            Endpoint::Model => self.get_model(session, ctx).await,
            Endpoint::CountTokens => self.count_tokens(session, ctx).await,
            Endpoint::Metrics => {
                let Ok(text) = self.metrics.encode() else {
                    let error = ApiError::new(
                        ErrorKind::Internal,
                        "internal_error",
                        "the metrics could not be encoded",
                    );
                    return self.respond_error(session, ctx, error).await;
                };
                let body = Bytes::from(text);
                self.respond(session, ctx, 200, metrics::CONTENT_TYPE, body, &[])
                    .await?;
                Ok(true)
            }
            Endpoint::ChatCompletions
            | Endpoint::Completions
            | Endpoint::Messages
            | Endpoint::Responses
            | Endpoint::StoredResponse
            | Endpoint::Transcriptions
            | Endpoint::AudioTranslations
            | Endpoint::Tokenize
            | Endpoint::Detokenize
            | Endpoint::Embeddings
            | Endpoint::Pooling
            | Endpoint::Score
            | Endpoint::Rerank => Ok(false),
        }
    }

    async fn list_models(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        let (table, names, anthropic) = match self.visible_models(session) {
            Ok(visible) => visible,
            Err(error) => return self.respond_error(session, ctx, error).await,
        };
        let names: Vec<&String> = names.iter().collect();
        let objects: Vec<_> = names
            .iter()
            .map(|name| model_object(name, table.created_at, anthropic))
            .collect();
        let body = if anthropic {
            json!({
                "data": objects,
                "has_more": false,
                "first_id": names.first(),
                "last_id": names.last(),
            })
        } else {
            json!({"object": "list", "data": objects})
        };
        self.respond_json(session, ctx, 200, body).await
    }

    /// `GET /v1/models/{id}`: one model the caller may use, or 404 in the caller's format.
    async fn get_model(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        let id = model_id_of(session.req_header().uri.path());
        let (table, names, anthropic) = match self.visible_models(session) {
            Ok(visible) => visible,
            Err(error) => return self.respond_error(session, ctx, error).await,
        };
        let id = id.unwrap_or_default();
        if names.contains(&id) {
            let body = model_object(&id, table.created_at, anthropic);
            self.respond_json(session, ctx, 200, body).await
        } else {
            self.respond_error(session, ctx, ApiError::model_not_found(&id))
                .await
        }
    }

    /// The live table, the names of the models the caller may use (sorted), and whether the
    /// caller speaks Anthropic's API (`anthropic-version`).
    fn visible_models(
        &self,
        session: &Session,
    ) -> std::result::Result<(Arc<RoutingTable>, Vec<String>, bool), ApiError> {
        let table = admit::live_table(self)?;
        let headers = &session.req_header().headers;
        let names = {
            let caller = admit::authenticate(&table, headers)?;
            table.models_for(caller).cloned().collect()
        };
        Ok((table, names, headers.contains_key("anthropic-version")))
    }

    /// `POST /debug/route/v1/...`: how the request would be routed, without sending it.
    pub(crate) async fn debug_route(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        inner: &str,
    ) -> Result<bool> {
        let inner = format!("/{}", inner.trim_start_matches('/'));
        ctx.format = client_format_for_path(&inner);
        let endpoint = match Endpoint::from_path(&inner) {
            Some(endpoint) if endpoint.is_inference() => endpoint,
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
        let mut exchange = match self.admit(session, endpoint, Explain::DryRun).await {
            Ok(exchange) => exchange,
            Err(error) => return self.respond_error(session, ctx, error).await,
        };
        let chosen = exchange.choose_worker(false);
        let body = explanation(&exchange, chosen);
        self.respond_json(session, ctx, 200, body).await
    }
}

/// A model as `/v1/models` lists it, in OpenAI's or Anthropic's shape.
fn model_object(name: &str, created: u64, anthropic: bool) -> serde_json::Value {
    if anthropic {
        json!({"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z"})
    } else {
        json!({"id": name, "object": "model", "created": created, "owned_by": "switchyard"})
    }
}

/// The `/debug/route` answer: the plan and, for a pool, every worker's numbers.
fn explanation(exchange: &Exchange, chosen: Option<usize>) -> serde_json::Value {
    let pool = exchange.pool();
    let address = |position: usize| {
        pool.and_then(|p| p.workers.get(position))
            .map(|w| w.address.clone())
    };
    let decision = exchange.attempt.decision.as_ref();
    let scores: Vec<serde_json::Value> = decision
        .iter()
        .flat_map(|d| d.scores.iter())
        .map(|score| {
            json!({
                "worker": address(score.position),
                "matched_blocks": score.matched_blocks,
                "cached_tokens": score.cached_tokens,
                "uncached_tokens": score.uncached_tokens,
                "replicated_tokens": score.replicated_tokens,
                "queued_tokens": score.queued_tokens,
                "running": score.running,
                "in_flight": score.in_flight,
                "healthy": score.healthy,
                "kv_blocks_needed": score.kv_blocks_needed,
                "kv_blocks_free": score.kv_blocks_free,
                "predicted_ttft_ms": score.predicted_ttft_s * 1000.0,
                "formula_ttft_ms": score.formula_ttft_s * 1000.0,
                "learned_speed": {
                    "observed_over_predicted": score.speed.ratio,
                    "observations": score.speed.observations,
                    "relative_to_pool": score.relative_speed,
                },
                "last_answer": score.speed.last.map(|(predicted, observed)| json!({
                    "predicted_ttft_ms": predicted * 1000.0,
                    "observed_ttft_ms": observed * 1000.0,
                })),
            })
        })
        .collect();
    let prompt = exchange.target().prompt.as_ref();
    json!({
        "model": exchange.client.parsed.model,
        "upstream_model": exchange.target().upstream_model,
        "tenant": exchange.tenant,
        "policy_rule": exchange.plan.rule,
        "policy_trace": exchange.plan.policy_explain,
        "pool": pool.map(|p| p.config.id.0.clone()),
        "provider": exchange.provider().map(|p| p.config.id.0.clone()),
        "load_balancing": pool.map(|p| p.config.load_balancing),
        "prompt_tokens": prompt.map(|p| p.tokens),
        "prompt_blocks": prompt.map(|p| p.hashes.len()),
        "chosen": chosen.and_then(address),
        "outcome": decision.map(|d| format!("{:?}", d.outcome)),
        "scores": scores,
        "ttft_model": pool
            .filter(|p| p.config.load_balancing == LoadBalancing::CacheAware)
            .map(ttft_model),
    })
}

/// The pool's TTFT model for `/debug/route`: configured and learned coefficients, and how far
/// off its predictions have been.
fn ttft_model(pool: &Arc<PoolRuntime>) -> serde_json::Value {
    let configured = Coefficients::configured(&pool.config.scoring);
    let fit = pool.kv.calibration.fit(configured);
    let coefficients = |c: Coefficients| {
        json!({
            "fixed_ms": c.fixed_s * 1000.0,
            "prefill_us_per_token": c.prefill_s_per_token * 1e6,
            // The context at which a token's attention takes as long as its weights.
            "attention_context_tokens": (c.attention_s_per_pair > 0.0)
                .then(|| (c.prefill_s_per_token / c.attention_s_per_pair).round()),
            "running_us_per_request": c.running_s_per_request * 1e6,
        })
    };
    json!({
        "learning": pool.config.scoring.learn_coefficients,
        "configured": coefficients(fit.configured),
        "learned": coefficients(fit.learned),
        "observations": fit.observations,
        "typical_error": fit.error,
        "shared_error": fit.bias,
        "error_spread": fit.spread,
    })
}

/// What a client is told when its stream's worker failed after the status went out: the
/// stream ends with this error ([`ApiError::stream_event`]) instead of breaking off.
pub fn stream_failure(error: &Error) -> ApiError {
    match error.etype() {
        ErrorType::ReadTimedout | ErrorType::WriteTimedout => ApiError::new(
            ErrorKind::GatewayTimeout,
            "upstream_timeout",
            "the worker stopped answering in the middle of the stream",
        ),
        _ => ApiError::new(
            ErrorKind::BadGateway,
            "upstream_error",
            "the worker's connection failed in the middle of the stream",
        ),
    }
}

/// The error a client gets when proxying failed with `error` and the gateway decided nothing
/// more specific. `tried`: how many workers were tried.
pub fn proxy_failure(error: &Error, tried: usize) -> ApiError {
    match error.etype() {
        ErrorType::ConnectTimedout
        | ErrorType::ConnectRefused
        | ErrorType::ConnectError
        | ErrorType::ConnectNoRoute
        | ErrorType::TLSHandshakeFailure => ApiError::new(
            ErrorKind::BadGateway,
            "upstream_unreachable",
            format!("could not connect to a worker ({tried} tried); retry shortly"),
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
        _ => match error.esource() {
            ErrorSource::Downstream => ApiError::invalid("body", "the request could not be read"),
            ErrorSource::Internal | ErrorSource::Unset => ApiError::new(
                ErrorKind::Internal,
                "internal_error",
                "internal gateway error",
            ),
            ErrorSource::Upstream => ApiError::new(
                ErrorKind::BadGateway,
                "upstream_error",
                "the worker closed the connection before answering",
            ),
        },
    }
}
