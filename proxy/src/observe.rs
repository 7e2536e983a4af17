//! The observe phase, once per request when it ends: its span, one log line at the level of
//! whoever failed, and its accounting. No prompt text and no credentials leave here.

use opentelemetry::KeyValue;
use pingora_error::{Error, ErrorSource, ErrorType};

use crate::api::Endpoint;
use crate::gateway::{Phase, RequestCtx};
use crate::metrics::{Finished, Metrics};

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
            ErrorSource::Downstream => Failure::Client,
            ErrorSource::Upstream => Failure::Upstream,
            // Errors the gateway raises on purpose to answer a worker's status (fallbacks) carry
            // that status; anything else unexplained is ours.
            ErrorSource::Internal | ErrorSource::Unset => {
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

/// Close the request's span, write its log line and account for it in `metrics`.
pub fn finished(metrics: &Metrics, error: Option<&Error>, ctx: &mut RequestCtx) {
    if let Some(span) = ctx.span.take() {
        span.end(
            span_attributes(ctx),
            ctx.status,
            error.map(|e| e.etype().as_str()),
        );
    }
    let failure = error.map(|e| Failure::of(e, ctx.status));
    if failure == Some(Failure::Client) {
        metrics.client_disconnected();
    }
    log_line(error, failure, ctx);
    let Phase::Forwarding(exchange) = &mut ctx.phase else {
        return;
    };
    if let (Some(decision), Some(pool)) = (&exchange.attempt.decision, exchange.pool()) {
        tracing::debug!(request_id = %ctx.request_id, route = %decision.explain(pool), "routing decision");
    }
    exchange.series.finished(&Finished {
        // An answer the worker failed after its status went out (a stream cut, a whole answer
        // that could not be assembled) is the worker's error, not a success.
        status: match (failure, ctx.status) {
            (Some(Failure::Upstream), 200..=299) => 502,
            (_, status) => status,
        },
        usage: exchange.answer.usage.usage,
        ttft: exchange
            .answer
            .first_output
            .map(|t| t.duration_since(ctx.started)),
        total: ctx.started.elapsed(),
    });
    exchange.finish();
}

/// One line per request, at the level of whoever failed (see `logging.rs`).
fn log_line(error: Option<&Error>, failure: Option<Failure>, ctx: &RequestCtx) {
    let exchange = match &ctx.phase {
        Phase::Forwarding(exchange) => Some(&**exchange),
        _ => None,
    };
    let worker = exchange
        .and_then(|x| x.attempt.current.as_ref())
        .map_or("", |f| f.worker().address.as_str());
    macro_rules! request_line {
        ($level:expr, $message:literal) => {
            tracing::event!(
                $level,
                request_id = %ctx.request_id,
                endpoint = ctx.endpoint.map_or("unknown", Endpoint::label),
                model = exchange.map_or("", |x| x.client.parsed.model.as_str()),
                upstream_model = exchange.map_or("", |x| x.target().upstream_model.as_str()),
                tenant = exchange.and_then(|x| x.tenant.as_deref()).unwrap_or(""),
                policy_rule = exchange.and_then(|x| x.plan.rule.as_deref()).unwrap_or(""),
                pool = %exchange
                    .and_then(|x| x.pool())
                    .map_or(String::new(), |p| p.config.id.to_string()),
                provider = %exchange
                    .and_then(|x| x.provider())
                    .map_or(String::new(), |p| p.config.id.to_string()),
                worker,
                attempts = exchange.map_or(0, |x| x.attempt.tried.len()),
                status = ctx.status,
                error = error.map(|e| e.etype().as_str()),
                error_source = error.map(|e| e.esource().as_str()),
                last_connect_error = exchange.and_then(|x| x.last_connect_error.as_deref()),
                ttft_ms = exchange
                    .and_then(|x| x.answer.first_output)
                    .map(|t| t.duration_since(ctx.started).as_millis() as u64),
                duration_ms = ctx.started.elapsed().as_millis() as u64,
                routed_us = exchange
                    .and_then(|x| x.attempt.routed)
                    .map(|t| t.duration_since(ctx.started).as_micros() as u64),
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
}

/// The routing facts of a finished request for its span: no prompt text, no credentials.
fn span_attributes(ctx: &RequestCtx) -> Vec<KeyValue> {
    let mut attributes = vec![
        KeyValue::new("http.response.status_code", i64::from(ctx.status)),
        KeyValue::new("switchyard.request_id", ctx.request_id.clone()),
    ];
    let Phase::Forwarding(exchange) = &ctx.phase else {
        return attributes;
    };
    let target = exchange.target();
    let attempt = &exchange.attempt;
    attributes.extend([
        KeyValue::new("gen_ai.request.model", exchange.client.parsed.model.clone()),
        KeyValue::new("switchyard.upstream_model", target.upstream_model.clone()),
        KeyValue::new("switchyard.target", target.label.clone()),
        KeyValue::new("switchyard.attempts", attempt.tried.len() as i64),
        KeyValue::new("switchyard.stream", exchange.stream()),
    ]);
    if let Some(tenant) = &exchange.tenant {
        attributes.push(KeyValue::new("switchyard.tenant", tenant.clone()));
    }
    if let Some(rule) = &exchange.plan.rule {
        attributes.push(KeyValue::new("switchyard.policy.rule", rule.clone()));
    }
    if let Some(current) = &attempt.current {
        attributes.push(KeyValue::new(
            "switchyard.worker",
            current.worker().address.clone(),
        ));
    }
    if let Some(provider) = exchange.provider() {
        attributes.push(KeyValue::new(
            "switchyard.provider",
            provider.config.id.to_string(),
        ));
    }
    let chosen = attempt
        .tried
        .last()
        .and_then(|index| attempt.decision.as_ref()?.score(*index));
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
    if let Some(prompt) = &target.prompt {
        attributes.push(KeyValue::new(
            "switchyard.prompt.tokens",
            prompt.tokens as i64,
        ));
    }
    if let Some(first) = exchange.answer.first_output {
        attributes.push(KeyValue::new(
            "switchyard.ttft.actual_ms",
            first.duration_since(ctx.started).as_secs_f64() * 1000.0,
        ));
    }
    let usage = exchange.answer.usage.usage;
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
