//! The admit phase: who is calling, the whole body, parsed once, then the plan and the tenant's
//! rate limits. What comes out is an [`Exchange`] ready for its first attempt, or the error the
//! client gets, counted under its reason.
//!
//! Reading the body before choosing the upstream: Pingora replays a body consumed in
//! `request_filter` only from its retry buffer (64 KiB). The whole body is kept in the request
//! context and handed on from `request_body_filter`. That filter only runs when the retry
//! buffer holds something, so buffering is switched on just before the last 64 KiB of the body
//! is read: the buffer is then never truncated, the filter runs on every attempt (retries
//! included), and it swaps the buffer's tail for the full body. `upstream_request_filter` sets
//! Content-Length to the length of what is really sent.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use pingora_proxy::Session;
use switchyard_snapshot::snapshot::Tenant;

use crate::api::{ApiError, Endpoint, ErrorKind, client_text, response_id_of};
use crate::exchange::Exchange;
use crate::gateway::Gateway;
use crate::limits::{Admission, RateLimiter, Reservation};
use crate::multipart;
use crate::plan::{self, ClientRequest, INLINE_PLAN_BYTES, Plan, Previous, Rejection, Request};
use crate::request::{self, ParsedRequest};
use crate::responses::{Lookup, ResponseDirectory};
use crate::routing::{AuthFailure, Caller, RoutingTable};
use crate::wire;

/// Bytes Pingora's retry buffer holds (pingora-core `BODY_BUF_LIMIT`).
const RETRY_BUFFER_BYTES: usize = 64 * 1024;

/// The request's id: the client's `x-request-id` when it is a sane token, else a fresh one.
pub fn request_id(headers: &http::HeaderMap) -> String {
    let incoming = headers
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

/// Who is calling: the tenant of the request's API key (`Authorization: Bearer` or
/// `x-api-key`). Unknown or missing keys are 401 unless a default tenant is configured.
pub fn authenticate<'t>(
    table: &'t RoutingTable,
    headers: &http::HeaderMap,
) -> Result<Caller<'t>, ApiError> {
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

/// The live table, or the answer for a gateway that has none yet.
pub fn live_table(gateway: &Gateway) -> Result<Arc<RoutingTable>, ApiError> {
    gateway.store.current().ok_or_else(|| {
        ApiError::new(
            ErrorKind::Unavailable,
            "not_ready",
            "the gateway has no configuration loaded yet; retry shortly",
        )
    })
}

/// How the request asked to be explained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Explain {
    /// Forward it; no explanation.
    No,
    /// Forward it with the routing explanation in response headers.
    Headers,
    /// `/debug/route`: plan it, explain, forward nothing, spend none of the tenant's allowance.
    DryRun,
}

impl Gateway {
    /// Admit an inference request: authenticate, read and parse the body, plan, and take the
    /// tenant's rate limits (not for a dry run).
    pub(crate) async fn admit(
        &self,
        session: &mut Session,
        endpoint: Endpoint,
        explain: Explain,
    ) -> Result<Exchange, ApiError> {
        let table = live_table(self)?;
        let caller = authenticate(&table, &session.req_header().headers).inspect_err(|_| {
            self.metrics.rejected_early(None, "unauthenticated");
        })?;
        if endpoint == Endpoint::StoredResponse {
            let tenant = caller.tenant().cloned();
            return self
                .admit_stored_response(session, table.clone(), tenant.as_ref())
                .await;
        }
        let tenant = caller.tenant().map(|t| t.name.clone());
        let counted = |error: ApiError| {
            self.metrics.rejected_early(tenant.as_deref(), error.code);
            error
        };
        let body = self.read_body(session).await.map_err(counted)?;
        let explained = explain != Explain::No;
        let responses = &self.responses;
        let planned = if body.len() <= INLINE_PLAN_BYTES {
            let headers = &session.req_header().headers;
            let tenant = caller.tenant();
            parse_and_plan(
                &table, responses, endpoint, body, headers, tenant, explained,
            )
        } else {
            let (table, tenant) = (table.clone(), tenant.clone());
            let headers = session.req_header().headers.clone();
            let responses = responses.clone();
            tokio::task::spawn_blocking(move || {
                let tenant = tenant
                    .as_deref()
                    .and_then(|t| table.snapshot.tenants.get(t));
                parse_and_plan(
                    &table, &responses, endpoint, body, &headers, tenant, explained,
                )
            })
            .await
            .unwrap_or_else(|e| {
                Err(Refusal::Invalid(ApiError::new(
                    ErrorKind::Internal,
                    "internal_error",
                    format!("planning failed: {e}"),
                )))
            })
        };
        let (client, plan) = planned.map_err(|refusal| match refusal {
            Refusal::Invalid(error) => counted(error),
            Refusal::Rejected(model, rejection) => {
                if let Some(verdict) = &rejection.verdict {
                    self.metrics.policy_decision(&verdict.rule, verdict.outcome);
                }
                self.metrics
                    .rejected(&table, tenant.as_deref(), &model, rejection.reason);
                rejection.error
            }
        })?;
        self.metrics
            .policy_decision(&plan.verdict.rule, plan.verdict.outcome);
        // Rate limits, once the request is known to go somewhere: the prompt is counted up
        // front (estimated from the body's size), the completion when the answer's usage
        // arrives. A dry run explains without spending the tenant's allowance.
        let admission = match caller.tenant() {
            Some(tenant) if explain != Explain::DryRun => self.take_limits(
                &table,
                tenant,
                &client.parsed.model,
                reservation_for(&client),
            )?,
            _ => None,
        };
        // The request's accounting series, resolved once: its end only adds to counters.
        let series = self.metrics.request_series(
            tenant.as_deref(),
            &client.parsed.model,
            &plan.target.label,
        );
        Ok(
            Exchange::new(table, client, tenant, plan, explained, admission, series)
                .with_responses(self.responses.clone()),
        )
    }

    /// Admit a request naming a stored response (`GET`/`DELETE /v1/responses/{id}`, `POST
    /// .../cancel`): it goes to the worker that made the response, for the tenant that asked
    /// for it; counted as a request (no tokens).
    async fn admit_stored_response(
        &self,
        session: &mut Session,
        table: Arc<RoutingTable>,
        tenant: Option<&Tenant>,
    ) -> Result<Exchange, ApiError> {
        let tenant_name = tenant.map(|t| t.name.clone());
        let counted = |error: ApiError| {
            self.metrics
                .rejected_early(tenant_name.as_deref(), error.code);
            error
        };
        let request = session.req_header();
        let path = request.uri.path().to_owned();
        let path_and_query = request
            .uri
            .path_and_query()
            .map_or_else(|| path.clone(), |p| p.as_str().to_owned());
        let deletes = request.method == http::Method::DELETE;
        let stream = request.uri.query().is_some_and(|q| {
            q.split('&')
                .filter_map(|pair| pair.split_once('='))
                .any(|(name, value)| name == "stream" && truthy(value))
        });
        let id = response_id_of(&path).unwrap_or_default().to_owned();
        let holder = self
            .responses
            .find(&id, tenant_name.as_deref())
            .ok_or_else(|| {
                counted(ApiError {
                    kind: ErrorKind::NotFound,
                    code: "response_not_found",
                    param: Some("response_id"),
                    message: format!(
                        "response '{}' is not known to this gateway: it remembers which worker holds \
                         each response it forwarded (store enabled) for a limited time; the response \
                         may have expired, been made through another gateway replica, or not been stored",
                        client_text(&id)
                    ),
                    retry_after: None,
                })
            })?;
        // A cancel may carry a body; nothing in it is read.
        self.read_body(session).await.map_err(counted)?;
        let target =
            plan::stored_response_target(&table, &holder, &path_and_query).map_err(counted)?;
        let admission = match tenant {
            Some(tenant) => self.take_limits(
                &table,
                tenant,
                &holder.client_model,
                Reservation::for_request(0, Some(0)),
            )?,
            None => None,
        };
        let series = self.metrics.request_series(
            tenant_name.as_deref(),
            &holder.client_model,
            &target.label,
        );
        let client = ClientRequest {
            endpoint: Endpoint::StoredResponse,
            parsed: ParsedRequest::bodiless(holder.client_model.clone(), stream),
            body: Bytes::new(),
        };
        let plan = Plan::to(target);
        let mut exchange =
            Exchange::new(table, client, tenant_name, plan, false, admission, series)
                .with_responses(self.responses.clone());
        exchange.deletes_response = deletes.then_some(id);
        Ok(exchange)
    }

    /// Take `tenant`'s rate limits for a request of `model`; a refusal is counted under its
    /// limit and becomes the client's error.
    fn take_limits(
        &self,
        table: &RoutingTable,
        tenant: &Tenant,
        model: &str,
        reservation: Reservation,
    ) -> Result<Option<Admission>, ApiError> {
        admit_rate(&self.limiter, tenant, reservation).map_err(|rejection| {
            self.metrics
                .rejected(table, Some(&tenant.name), model, rejection.reason);
            rejection.error
        })
    }

    /// Read the whole request body within the size limit (see the module note on buffering).
    pub(crate) async fn read_body(&self, session: &mut Session) -> Result<Bytes, ApiError> {
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
}

/// Why a request was not planned.
enum Refusal {
    /// The body is not a valid request (or planning itself failed).
    Invalid(ApiError),
    /// The planner refused the request for `model`.
    Rejected(String, Box<Rejection>),
}

/// Parse the body once into its typed model, check it, and plan it: the CPU work of a request,
/// run off the event loop for large bodies.
fn parse_and_plan(
    table: &RoutingTable,
    responses: &ResponseDirectory,
    endpoint: Endpoint,
    body: Bytes,
    headers: &http::HeaderMap,
    tenant: Option<&Tenant>,
    explain: bool,
) -> Result<(ClientRequest, Plan), Refusal> {
    let (typed, parsed) = if endpoint.is_audio() {
        // A form, not JSON: the fields routing needs; nothing to classify or tokenize.
        let parsed = form_request(&body, headers).map_err(Refusal::Invalid)?;
        (wire::parse(b"{}").map_err(Refusal::Invalid)?, parsed)
    } else {
        let mut typed = wire::parse(&body).map_err(Refusal::Invalid)?;
        typed.is_responses = endpoint == Endpoint::Responses;
        let parsed = request::summarise(endpoint, &body, &typed).map_err(Refusal::Invalid)?;
        (typed, parsed)
    };
    let client = ClientRequest {
        endpoint,
        parsed,
        body: body.clone(),
    };
    let tenant_name = tenant.map(|t| t.name.as_str());
    // A response id the client chooses must not be one another caller's response has: the
    // worker would keep this answer in its place.
    if let Some(id) = &client.parsed.response_id
        && responses.lookup(id, tenant_name) == Lookup::Foreign
    {
        return Err(Refusal::Invalid(ApiError {
            kind: ErrorKind::InvalidRequest,
            code: "response_id_taken",
            param: Some("request_id"),
            message: "'request_id' names a response that is not yours; choose another id".into(),
            retry_after: None,
        }));
    }
    let holder = client
        .parsed
        .previous_response_id
        .as_deref()
        .map(|id| (id, responses.find(id, tenant_name)));
    let previous = match &holder {
        None => Previous::None,
        Some((_, Some(holder))) => Previous::Known(holder),
        // Unknown, expired, or another tenant's: answered alike.
        Some((id, None)) => Previous::Unknown(id),
    };
    let planned = plan::plan(
        table,
        &Request {
            client: &client,
            body: &typed,
            headers,
            tenant,
            explain,
            previous,
        },
    );
    match planned {
        Ok(plan) => Ok((client, plan)),
        Err(rejection) => Err(Refusal::Rejected(client.parsed.model, rejection)),
    }
}

/// What routing needs of a speech-to-text form: `model` (and where its value lies) and `stream`.
fn form_request(body: &[u8], headers: &http::HeaderMap) -> Result<ParsedRequest, ApiError> {
    let content_type = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let boundary = multipart::boundary(content_type).ok_or_else(|| {
        ApiError::invalid(
            "body",
            "this endpoint takes a multipart/form-data body (the audio file and its fields)",
        )
    })?;
    let fields = multipart::fields(body, boundary)?;
    // The gateway reads the first of a field, form parsers upstream the last: one each.
    for name in ["model", "stream", "file"] {
        if fields.iter().filter(|f| f.name == name).count() > 1 {
            return Err(ApiError::invalid(
                "body",
                format!("the form has more than one '{name}' field"),
            ));
        }
    }
    let model = fields
        .iter()
        .find(|f| f.name == "model" && f.filename.is_none())
        .ok_or_else(|| ApiError::invalid("model", "missing required field 'model'"))?;
    let name = multipart::text(body, &fields, "model")
        .map(str::trim)
        .filter(|m| !m.is_empty())
        .ok_or_else(|| ApiError::invalid("model", "'model' must be a non-empty string"))?;
    if !fields
        .iter()
        .any(|f| f.name == "file" && f.filename.is_some())
    {
        return Err(ApiError::invalid("file", "missing required file 'file'"));
    }
    let stream = multipart::text(body, &fields, "stream").is_some_and(truthy);
    Ok(ParsedRequest::form(
        name.to_owned(),
        model.value.clone(),
        stream,
    ))
}

/// A form or query value the way vLLM's request models read a boolean (pydantic: `true`, `1`,
/// `yes`, `on`, `t`, `y`, any case).
fn truthy(value: &str) -> bool {
    matches!(
        value.trim().to_ascii_lowercase().as_str(),
        "true" | "1" | "yes" | "on" | "t" | "y"
    )
}

/// Take the tenant's rate limits for `client`'s request (`None`: the tenant has none).
/// What a request reserves of its tenant's token allowance until its usage is known. Pooling
/// models read their input and write nothing; the tokenizer endpoints count as requests only.
fn reservation_for(client: &ClientRequest) -> Reservation {
    let endpoint = client.endpoint;
    if endpoint.is_inference() {
        Reservation::for_request(client.body.len(), client.parsed.max_tokens)
    } else if endpoint.is_pooling() {
        Reservation::for_request(client.body.len(), Some(0))
    } else {
        Reservation::for_request(0, Some(0))
    }
}

/// Take the tenant's rate limits for one request (`None`: the tenant has none).
pub(crate) fn admit_rate(
    limiter: &Arc<RateLimiter>,
    tenant: &Tenant,
    reservation: Reservation,
) -> Result<Option<Admission>, Box<Rejection>> {
    let limits = tenant.rate_limits;
    if limits.requests_per_minute.is_none()
        && limits.tokens_per_minute.is_none()
        && limits.concurrency.is_none()
    {
        return Ok(None);
    }
    match limiter.admit(&tenant.name, limits, reservation) {
        Ok(admitted) => Ok(Some(admitted)),
        Err(refusal) => Err(Rejection::new(
            ApiError {
                kind: ErrorKind::Status(429),
                code: "rate_limit_exceeded",
                param: None,
                message: refusal.message(&tenant.name),
                retry_after: Some(refusal.retry_after_secs()),
            },
            refusal.limit.label(),
        )),
    }
}
