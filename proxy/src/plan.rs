//! The planner: where a request goes, decided from the routing table and the request alone.
//!
//! [`plan`] is a plain function of the live table, the request's head and its parsed body. It
//! resolves the model alias, checks the tenant's model list, runs the inference policies (with
//! the prompt's classes and pools' predicted TTFT when a rule reads them), chooses the target,
//! orders the fallbacks, and prepares the body each target gets (model rewritten, translated,
//! `cache_salt` set). It touches no connection and counts nothing: the caller records the
//! outcome ([`Plan::verdict`], [`Rejection::reason`]) and runs the plan's CPU work off the event
//! loop for large bodies. Rate limits are not the planner's business either: they hold state
//! per tenant and are taken by the gateway once a plan exists.

use std::sync::Arc;

use bytes::Bytes;
use switchyard_policy::{
    ClassSet, Classifier, Context, NoTarget, Outcome as PolicyOutcome, PoolState, RequestFacts,
};
use switchyard_snapshot::snapshot::{AnthropicMessages, Backend, ResponsesApi, Tenant};
use switchyard_snapshot::{ModelTarget, PoolId};

use crate::api::{ApiError, Endpoint, ErrorKind, client_text};
use crate::prompt::{self, PromptInfo};
use crate::request::ParsedRequest;
use crate::responses::Holder;
use crate::routing::{Destination, PoolRuntime, RoutingTable};
use crate::scorer;
use crate::wire::{self, RequestBody};

/// Bodies larger than this are planned (parsed, classified, tokenized, translated), and a
/// fallback target prepared, on the blocking pool, off the proxy's async threads.
pub const INLINE_PLAN_BYTES: usize = 16 * 1024;

/// An inference request as the client sent it: kept for the whole exchange, since every
/// fallback target is prepared from it again.
#[derive(Debug, Clone)]
pub struct ClientRequest {
    pub endpoint: Endpoint,
    pub parsed: ParsedRequest,
    pub body: Bytes,
}

/// What the planner reads of a request.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub client: &'a ClientRequest,
    /// The body's typed model, parsed once (classification and tokenization read it).
    pub body: &'a RequestBody<'a>,
    pub headers: &'a http::HeaderMap,
    /// The authenticated tenant (`None`: authentication is off).
    pub tenant: Option<&'a Tenant>,
    /// Keep the policy trace for the client (`x-switchyard-explain`, `/debug/route`).
    pub explain: bool,
    /// The stored response a Responses request continues, as the gateway knows it.
    pub previous: Previous<'a>,
}

/// What the gateway knows of a request's `previous_response_id`.
#[derive(Debug, Clone, Copy, Default)]
pub enum Previous<'a> {
    /// The request continues no stored response.
    #[default]
    None,
    /// It continues a response the gateway saw being made there.
    Known(&'a Holder),
    /// It names a response the gateway does not know (expired, another replica's, or a
    /// provider's own).
    Unknown(&'a str),
}

/// The policy outcome of a request, for the `switchyard_policy_decisions_total` counter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// `namespace/policy/rule`, or empty when no rule matched.
    pub rule: String,
    /// `route`, `default`, `reject` or `no_local_target`.
    pub outcome: &'static str,
}

/// Why a request is not planned: the error for the client and the label it is counted under.
#[derive(Debug, Clone, PartialEq)]
pub struct Rejection {
    pub error: ApiError,
    /// The `reason` label of `switchyard_requests_rejected_total`.
    pub reason: &'static str,
    /// Set when a policy rule made the decision.
    pub verdict: Option<Verdict>,
}

impl Rejection {
    pub fn new(error: ApiError, reason: &'static str) -> Box<Rejection> {
        Box::new(Rejection {
            error,
            reason,
            verdict: None,
        })
    }
}

/// Where a request goes.
#[derive(Debug, Clone)]
pub struct Plan {
    /// `namespace/policy/rule` of the policy rule that decided, if any.
    pub rule: Option<String>,
    pub verdict: Verdict,
    /// The policy trace, when the request asked for the explanation.
    pub policy_explain: Option<String>,
    /// The `cache_salt` a pool's workers get (the tenant's isolation, the client's own).
    pub cache_salt: Option<String>,
    pub target: Target,
    /// Later targets of the model, tried in order when this one cannot be reached or fails
    /// before its first byte.
    pub fallbacks: Vec<ModelTarget>,
}

impl Plan {
    /// A plan that is only `target`: no policy decided, no fallback.
    pub fn to(target: Target) -> Plan {
        Plan {
            rule: None,
            verdict: Verdict {
                rule: String::new(),
                outcome: "default",
            },
            policy_explain: None,
            cache_salt: None,
            target,
            fallbacks: Vec::new(),
        }
    }
}

/// Decide where `request` goes on `table`.
pub fn plan(table: &RoutingTable, request: &Request<'_>) -> Result<Plan, Box<Rejection>> {
    let client = request.client;
    let parsed = &client.parsed;
    // The salt the workers get keys the prompt's block hashes too, as in vLLM.
    let cache_salt = prompt::worker_cache_salt(request.tenant, parsed.cache_salt.as_deref());
    let model = table.model(&parsed.model).ok_or_else(|| {
        Rejection::new(ApiError::model_not_found(&parsed.model), "model_not_found")
    })?;
    if let Some(tenant) = request.tenant
        && !tenant.allows_model(&model.name)
    {
        return Err(Rejection::new(
            ApiError {
                kind: ErrorKind::Forbidden,
                code: "model_not_allowed",
                param: Some("model"),
                message: format!(
                    "your API key may not use the model '{}'; GET /v1/models lists the models you can use",
                    client_text(&parsed.model)
                ),
                retry_after: None,
            },
            "model_not_allowed",
        ));
    }

    // Policies. Predicted TTFT needs the prompt tokenized for the pool in question first.
    let predictions: Vec<(PoolId, Option<Arc<PromptInfo>>)> = table
        .evaluator
        .prediction_pools(&parsed.model)
        .into_iter()
        .filter(|_| client.endpoint.is_inference())
        .filter_map(|id| {
            let pool = table.pool(&id)?;
            pool.tokenizer.as_ref()?;
            let prompt = analyse_prompt(pool, client.endpoint, request.body, cache_salt.as_deref());
            Some((id, prompt))
        })
        .collect();
    let facts = RequestFacts {
        tenant: request.tenant.map(|t| t.name.as_str()),
        model: &parsed.model,
        stream: parsed.stream,
        max_tokens: parsed.max_tokens,
    };
    let mut trace = request.explain.then(Vec::new);
    let mut context = PolicyContext {
        table,
        body: request.body,
        headers: request.headers,
        classes: None,
        predictions: &predictions,
    };
    let decision = table
        .evaluator
        .evaluate(&facts, &mut context, trace.as_mut());
    let rule = decision.rule_name();
    let chosen = switchyard_policy::targets(&table.snapshot, model, &decision).map_err(|no| {
        match no {
            NoTarget::Rejected {
                status,
                message,
                retry_after_s,
            } => Box::new(Rejection {
                error: ApiError {
                    retry_after: retry_after_s.map(u64::from),
                    ..ApiError::new(ErrorKind::Status(status), "rejected_by_policy", message)
                },
                reason: "policy",
                verdict: Some(Verdict {
                    rule: rule.clone().unwrap_or_default(),
                    outcome: "reject",
                }),
            }),
            NoTarget::NoLocalTarget { rule: local_rule } => Box::new(Rejection {
                error: ApiError::new(
                    ErrorKind::Unavailable,
                    "no_local_target",
                    format!(
                        "this request must stay on local hardware (policy rule {local_rule}) and model '{}' has no local pool to serve it",
                        parsed.model
                    ),
                ),
                reason: "no_local_target",
                verdict: Some(Verdict {
                    rule: local_rule,
                    outcome: "no_local_target",
                }),
            }),
        }
    })?;
    let verdict = Verdict {
        rule: rule.clone().unwrap_or_default(),
        outcome: match decision.outcome {
            PolicyOutcome::Route(_) => "route",
            _ => "default",
        },
    };
    let target = table
        .choose(chosen.strategy, &chosen.targets)
        .ok_or_else(|| {
            Rejection::new(
                ApiError::new(
                    ErrorKind::Unavailable,
                    "no_target",
                    format!("model '{}' has no usable target", model.name),
                ),
                "no_target",
            )
        })?;
    // A stored response lives where it was made: the request goes there, and nowhere else.
    let previous_id = parsed.previous_response_id.as_deref().unwrap_or_default();
    let (target, pinned) = continuation(table, model, target, request.previous, previous_id)?;
    let policy_explain = trace.map(|steps| {
        let mut text = steps
            .iter()
            .map(|step| format!("{}/{}: {}", step.policy, step.rule, step.result))
            .collect::<Vec<_>>()
            .join("; ");
        if let Some(classes) = decision.classes {
            let names = table.evaluator.classifier().names(classes).join(",");
            text.push_str(&format!("; classes={names}"));
        }
        text.push_str(&format!(
            "; target={} model={}",
            target.backend, target.upstream_model
        ));
        header_safe(&text)
    });
    let salt = cache_salt.as_deref();
    let mut prepared =
        prepare_target(table, target, client, request.body, salt).map_err(|error| {
            // A request the target cannot take as written is the client's error, counted as such;
            // the rest means the target cannot serve now.
            let reason = match error.kind {
                ErrorKind::InvalidRequest | ErrorKind::NotImplemented => error.code,
                _ => "target_unavailable",
            };
            Box::new(Rejection {
                error,
                reason,
                verdict: Some(verdict.clone()),
            })
        })?;
    // The prompt as the chosen pool's workers tokenize it, for cache-aware worker choice (the
    // tokenizer endpoints generate nothing: they go by queue alone).
    let generates = client.endpoint.is_inference();
    // A continuation's prompt is the worker's stored conversation and this input: the gateway
    // cannot render it, and the worker is fixed anyway.
    let continues = !matches!(request.previous, Previous::None);
    if let Some(pool) = prepared
        .pool()
        .filter(|p| p.tokenizer.is_some() && generates && !continues)
    {
        let known = predictions.iter().find(|(id, _)| *id == pool.config.id);
        prepared.prompt = match known {
            Some((_, prompt)) => prompt.clone(),
            None => analyse_prompt(pool, client.endpoint, request.body, cache_salt.as_deref()),
        };
    }
    prepared.pinned = pinned;
    let fallbacks = match request.previous {
        Previous::None => chosen
            .targets
            .iter()
            .filter(|t| !std::ptr::eq(**t, target) && table.usable(t))
            .map(|t| (*t).clone())
            .collect(),
        _ => Vec::new(),
    };
    Ok(Plan {
        rule,
        verdict,
        policy_explain,
        cache_salt,
        target: prepared,
        fallbacks,
    })
}

/// The target of a request that continues a stored response, and the worker it must go to:
/// the one that made it. A response the gateway does not know (or another tenant's) is a 404,
/// unless the target translates (which refuses it with its own reason).
fn continuation<'m>(
    table: &RoutingTable,
    model: &'m switchyard_snapshot::Model,
    planned: &'m ModelTarget,
    previous: Previous<'_>,
    previous_id: &str,
) -> Result<(&'m ModelTarget, Option<String>), Box<Rejection>> {
    let not_found = |id: &str, why: String| {
        Rejection::new(
            ApiError {
                kind: ErrorKind::NotFound,
                code: "response_not_found",
                param: Some("previous_response_id"),
                message: format!("previous response '{}' {why}", client_text(id)),
                retry_after: None,
            },
            "response_not_found",
        )
    };
    match previous {
        Previous::None => Ok((planned, None)),
        Previous::Unknown(id) => match table.destination(planned) {
            // A target that translates refuses it with its own reason when the body is prepared.
            Some(Destination::Pool(pool))
                if pool.config.responses_api == ResponsesApi::Translate =>
            {
                Ok((planned, None))
            }
            Some(Destination::Provider(provider))
                if provider.config.responses_api == ResponsesApi::Translate =>
            {
                Ok((planned, None))
            }
            // On a pool only the worker that made a response has it; a provider is reached with
            // the gateway's own key, shared by every tenant, so only a response this tenant made
            // through the gateway may be continued there.
            _ => Err(not_found(
                id,
                "is not known to this gateway: it remembers which worker holds each response it \
                 forwarded (store enabled) for a limited time; the response may have expired, \
                 been made through another gateway replica, or not been stored"
                    .to_owned(),
            )),
        },
        Previous::Known(holder) => {
            let target = model
                .targets
                .iter()
                .find(|t| t.backend == holder.backend)
                .ok_or_else(|| {
                    Rejection::new(
                        ApiError::invalid(
                            "previous_response_id",
                            format!(
                                "the previous response was made by {}, which model '{}' no longer routes to",
                                holder.backend,
                                client_text(&model.name)
                            ),
                        ),
                        "response_elsewhere",
                    )
                })?;
            if let (Backend::Pool(id), Some(worker)) = (&holder.backend, &holder.worker) {
                let present = table
                    .pool(id)
                    .is_some_and(|pool| pool.workers.iter().any(|w| &w.address == worker));
                if !present {
                    return Err(not_found(
                        previous_id,
                        format!(
                            "was kept by a worker that has left pool {id}: the response is gone with it"
                        ),
                    ));
                }
            }
            Ok((target, holder.worker.clone()))
        }
    }
}

/// Prepare the next of `fallbacks` that can be prepared, removing what it skips. The body is
/// parsed again: a fallback is the one path that needs its typed model after planning.
pub fn next_fallback(
    table: &RoutingTable,
    fallbacks: &mut Vec<ModelTarget>,
    client: &ClientRequest,
    cache_salt: Option<&str>,
) -> Option<Target> {
    // A form (speech to text) has no typed model: its target needs only the model's place.
    let json: &[u8] = if client.endpoint.is_audio() {
        b"{}"
    } else {
        &client.body
    };
    let mut body = wire::parse(json).ok()?;
    body.is_responses = client.endpoint == Endpoint::Responses;
    while !fallbacks.is_empty() {
        let target = fallbacks.remove(0);
        match prepare_target(table, &target, client, &body, cache_salt) {
            Ok(prepared) => return Some(prepared),
            Err(error) => {
                tracing::debug!(target = %target.backend, reason = %error.shown_message(), "fallback target skipped");
            }
        }
    }
    None
}

/// Tokenize the prompt for a cache-aware pool. A failure only costs cache affinity: the request
/// is still routed, by queue alone. CPU work: large bodies are planned off the event loop.
pub fn analyse_prompt(
    pool: &PoolRuntime,
    endpoint: Endpoint,
    body: &RequestBody<'_>,
    cache_salt: Option<&str>,
) -> Option<Arc<PromptInfo>> {
    let tokenizer = pool.tokenizer.as_ref()?;
    // A pool that is sent Anthropic or Responses requests translated renders the chat the
    // gateway sends it.
    let translation = match endpoint {
        Endpoint::Messages if pool.config.anthropic_messages == AnthropicMessages::Translate => {
            Some(crate::translate_request::messages_to_chat(body, ""))
        }
        Endpoint::Responses if pool.config.responses_api == ResponsesApi::Translate => {
            Some(crate::translate_responses::responses_to_chat(body, ""))
        }
        _ => None,
    };
    let translated;
    let translated_body;
    let (endpoint, body) = match translation {
        Some(chat) => {
            translated = chat
                .inspect_err(|error| {
                    tracing::debug!(error = %error.shown_message(), "prompt not tokenized for routing: not translated");
                })
                .ok()?;
            translated_body = wire::parse(&translated).ok()?;
            (Endpoint::ChatCompletions, &translated_body)
        }
        None => (endpoint, body),
    };
    let kv = &pool.kv;
    let block_size = kv.index.block_size();
    let held = |hashes: &[switchyard_kv::hash::SequenceHash]| kv.holds_all(hashes, tokenizer);
    match prompt::analyse(
        tokenizer,
        &kv.prompts,
        endpoint,
        body,
        block_size,
        cache_salt,
        &held,
    ) {
        Ok(info) => Some(info),
        Err(error) => {
            tracing::debug!(%error, "prompt not tokenized for routing");
            None
        }
    }
}

/// A header value: names from configuration may hold characters a header cannot.
fn header_safe(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c == ' ' || c.is_ascii_graphic() {
                c
            } else {
                '?'
            }
        })
        .collect()
}

/// What policies may ask about a request: its text (parsed only when a rule needs classes), its
/// headers, and the live state of pools.
struct PolicyContext<'a> {
    table: &'a RoutingTable,
    body: &'a RequestBody<'a>,
    headers: &'a http::HeaderMap,
    classes: Option<ClassSet>,
    /// Prompts tokenized for the pools whose predicted TTFT rules read.
    predictions: &'a [(PoolId, Option<Arc<PromptInfo>>)],
}

impl Context for PolicyContext<'_> {
    fn classes(&mut self, classifier: &Classifier) -> ClassSet {
        if let Some(classes) = self.classes {
            return classes;
        }
        let classes = classifier.classify(self.body);
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
                .and_then(|(_, p)| p.as_deref());
            state.predicted_ttft_ms =
                scorer::decide_for_prompt(pool, prompt, 0, &[]).and_then(|d| {
                    d.chosen_score()
                        .map(|s| (s.predicted_ttft_s * 1000.0).round() as u64)
                });
        }
        Some(state)
    }
}

mod target;

use target::prepare_target;
pub use target::{Target, Translation, stored_response_target};

#[cfg(test)]
mod tests;
