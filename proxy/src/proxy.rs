//! The Pingora `ProxyHttp` implementation: thin hooks around the request's phases.
//!
//! admit ([`crate::admit`]: request id, authentication, body) → plan ([`crate::plan`], a pure
//! function of the routing table and the request) → attempt ([`crate::exchange`]: worker
//! choice, retries, fallbacks; [`crate::answer`]: the answer made the client's) → respond
//! ([`crate::respond`]: what the gateway answers itself, every error in the client's format)
//! → observe ([`crate::observe`]: span, log line, accounting, once).

use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use pingora_core::upstreams::peer::{HttpPeer, Peer};
use pingora_error::{Error, ErrorSource, ErrorType, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::{FailToProxy, ProxyHttp, Session};

use crate::admit::{self, Explain};
use crate::answer;
use crate::api::{ApiError, Endpoint, ErrorKind, client_format, client_text};
use crate::cors;
use crate::gateway::{Gateway, Phase, RequestCtx};
use crate::observe;
use crate::respond::{self, DEBUG_ROUTE_PREFIX};

/// How much of a worker's error message a log line keeps.
const MAX_LOGGED_REASON_CHARS: usize = 256;

/// Request header asking for the routing explanation.
const EXPLAIN_HEADER: &str = "x-switchyard-explain";

fn internal(message: &'static str) -> Box<Error> {
    Error::explain(ErrorType::InternalError, message)
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
            format: crate::api::ClientFormat::OpenAi,
            endpoint: None,
            phase: Phase::Admitting,
            status: 0,
            span: None,
            cors_allow: None,
        }
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        let request = session.req_header();
        ctx.request_id = admit::request_id(&request.headers);
        let path = request.uri.path().to_owned();
        ctx.format = client_format(&path, &request.headers);
        // Browsers never get the operator's surface.
        ctx.cors_allow = (!self.admin)
            .then(|| self.settings.cors.allow(&request.headers))
            .flatten();
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
                     /v1/completions, /v1/messages, /v1/messages/count_tokens, /v1/responses, \
                     /v1/embeddings, /pooling, /v1/score, /v1/rerank, /tokenize, /detokenize, \
                     GET /v1/models, /v1/models/{{id}}, and GET/DELETE /v1/responses/{{id}}"
                ),
            );
            return self.respond_error(session, ctx, error).await;
        };
        ctx.endpoint = Some(endpoint);
        if let Some(tracer) = &self.tracer
            && endpoint.is_api()
        {
            let name = format!("{} {path}", request.method);
            ctx.span = Some(tracer.start(name, &request.headers));
        }
        let method = &request.method;
        if *method == http::Method::OPTIONS {
            return self.answer_options(session, ctx, endpoint).await;
        }
        if !endpoint.takes(method) {
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
        let explain = if self.admin && request.headers.contains_key(EXPLAIN_HEADER) {
            Explain::Headers
        } else {
            Explain::No
        };
        if self.answer_locally(session, ctx, endpoint).await? {
            return Ok(true);
        }
        match self.admit(session, endpoint, explain).await {
            Ok(exchange) => {
                ctx.phase = Phase::Forwarding(Box::new(exchange));
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
        let exchange = ctx
            .exchange()
            .ok_or_else(|| internal("upstream_peer before a plan"))?;
        if !exchange.advance(&self.metrics).await {
            let error = ApiError::new(
                ErrorKind::BadGateway,
                "upstream_unreachable",
                format!(
                    "model '{}' has no other target that can take the request",
                    client_text(&exchange.client.parsed.model)
                ),
            );
            let status = error.status();
            exchange.failure = Some(error);
            return Err(Error::explain(
                ErrorType::HTTPStatus(status),
                "no target left",
            ));
        }
        match exchange.next_peer(self.settings.upstream_read_timeout) {
            Ok(peer) => {
                exchange.attempt.routed = Some(Instant::now());
                Ok(Box::new(peer))
            }
            Err(error) => {
                let status = error.status();
                exchange.failure = Some(error);
                Err(Error::explain(
                    ErrorType::HTTPStatus(status),
                    "no worker to try",
                ))
            }
        }
    }

    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        if let Some(exchange) = ctx.exchange() {
            // Replace Pingora's replay of the body's tail with the whole (rewritten) body.
            *body = Some(if end_of_stream {
                exchange.upstream_body().clone()
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
        match &ctx.phase {
            Phase::Forwarding(exchange) => {
                exchange.upstream_request(upstream_request, &ctx.request_id, ctx.span.as_ref())
            }
            Phase::Admitting => Ok(()),
        }
    }

    async fn response_filter(
        &self,
        session: &mut Session,
        upstream_response: &mut ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        let status = upstream_response.status.as_u16();
        if upstream_response.status.is_informational() {
            // An interim head (`103 Early Hints`; `100 Continue` is not asked for): the answer,
            // its status and its first token are still to come.
            return Ok(());
        }
        let request_id = ctx.request_id.clone();
        // A 5xx (or a refusal of the gateway's credentials) before any byte reached the client:
        // the next target, if there is one.
        if ctx
            .exchange()
            .is_some_and(|x| x.fall_back_on_status(status))
        {
            tracing::warn!(request_id = %request_id, status, "upstream failed; trying the next target");
            return Err(Error::explain(
                ErrorType::HTTPStatus(status),
                "upstream error; trying the next target",
            ));
        }
        ctx.status = status;
        cors::rewrite_upstream(upstream_response, ctx.cors_allow.as_deref())?;
        let had_length = upstream_response
            .headers
            .contains_key(http::header::CONTENT_LENGTH);
        let format = ctx.format;
        if let Some(exchange) = ctx.exchange() {
            exchange.answer_head(upstream_response, &request_id, format)?;
        }
        // As the client gets it (a refusal of the gateway's credentials becomes a 502).
        ctx.status = upstream_response.status.as_u16();
        answer::frame_rewritten(upstream_response, had_length, session.req_header().version)
    }

    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<Option<Duration>> {
        let status = ctx.status;
        if let Some(exchange) = ctx.exchange()
            && let Err(why) = exchange.answer_body(body, end_of_stream, status)
        {
            // The worker's fault, though its connection ended cleanly. The reason is the
            // stream's state or the worker's error message, which may quote the request (a
            // schema, a pattern): bounded, like every client string in the logs.
            let reason: String = why.chars().take(MAX_LOGGED_REASON_CHARS).collect();
            tracing::warn!(request_id = %ctx.request_id, %reason, "no whole answer from the upstream: the client's connection is cut");
            return Err(Error::explain(ErrorType::ReadError, reason).into_up());
        }
        Ok(None)
    }

    /// Pingora's own "Fail to proxy" line is replaced by the request line `observe` writes,
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
        let request_id = ctx.request_id.clone();
        if let Some(exchange) = ctx.exchange() {
            tracing::warn!(
                request_id = %request_id,
                worker = %peer.address(),
                attempt = exchange.attempt.tried.len(),
                error = e.etype().as_str(),
                "could not connect to worker"
            );
            e.set_retry(exchange.retry_after_connect_failure(e.etype().as_str()));
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
        let answered = ctx.status != 0;
        let request_id = ctx.request_id.clone();
        let Some(exchange) = ctx.exchange() else {
            return e;
        };
        let reconnect = !exchange.fallback_requested;
        let resend = crate::exchange::resendable(&e, client_reused);
        let retry = exchange.retry_after_broken_connection(resend, answered);
        if retry && reconnect {
            tracing::debug!(
                request_id = %request_id,
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
            // Headers already went out: a stream ends with an error event in the client's API
            // (unless the client is gone, or an event went out in part); then the connection
            // ends.
            let event = match &ctx.phase {
                Phase::Forwarding(exchange) if *e.esource() != ErrorSource::Downstream => {
                    exchange.stream_failure_event(&respond::stream_failure(e))
                }
                _ => None,
            };
            if let Some(event) = event {
                // A client that is gone by now cannot be told.
                let _ = session.write_response_body(Some(event), true).await;
            }
            return FailToProxy {
                error_code: 0,
                can_reuse_downstream: false,
            };
        }
        let error = match &mut ctx.phase {
            Phase::Forwarding(exchange) => exchange
                .failure
                .take()
                .unwrap_or_else(|| respond::proxy_failure(e, exchange.attempt.tried.len())),
            Phase::Admitting => respond::proxy_failure(e, 0),
        };
        let status = error.status();
        let body = error.body(ctx.format);
        let code = match self
            .respond(session, ctx, status, "application/json", body, &[])
            .await
        {
            Ok(()) => status,
            Err(_) => 0,
        };
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    async fn logging(&self, _session: &mut Session, e: Option<&Error>, ctx: &mut RequestCtx) {
        observe::finished(&self.metrics, e, ctx);
    }
}
