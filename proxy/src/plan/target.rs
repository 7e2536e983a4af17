//! A target made ready for a request: where it goes, which way the request and its answer are
//! translated, and the body it gets.

use std::sync::Arc;

use bytes::Bytes;
use switchyard_snapshot::ModelTarget;
use switchyard_snapshot::snapshot::{AnthropicMessages, PoolTask, ProviderFormat, ResponsesApi};

use super::ClientRequest;
use crate::api::{ApiError, Endpoint, ErrorKind};
use crate::assemble;
use crate::multipart;
use crate::prompt::PromptInfo;
use crate::request;
use crate::responses::Holder;
use crate::routing::{Destination, PoolRuntime, ProviderRuntime, RoutingTable};
use crate::translate_request;
use crate::translate_responses;
use crate::wire::RequestBody;

/// Translation between the client's API and the upstream's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Translation {
    None,
    /// Anthropic Messages client, OpenAI Chat Completions upstream.
    MessagesToChat,
    /// OpenAI Chat Completions client, Anthropic Messages upstream.
    ChatToMessages,
    /// OpenAI Responses client, Chat Completions upstream.
    ResponsesToChat,
}

/// A target made ready: where it goes, which way to translate, and the body to send.
#[derive(Debug, Clone)]
pub struct Target {
    /// `pool ns/name` or `provider ns/name`: the accounting label.
    pub label: String,
    pub destination: Destination,
    pub translate: Translation,
    /// Path sent upstream when it differs from the client's (translation, providers).
    pub upstream_path: Option<String>,
    pub upstream_model: String,
    /// The body sent there.
    pub body: Bytes,
    /// Remove the usage chunk the gateway asked for on the client's behalf.
    pub strip_usage: bool,
    /// The client asked for a whole answer; the worker is asked for a stream of this kind,
    /// which the gateway assembles ([`crate::assemble`]): so that it sees the first token.
    pub assemble: Option<assemble::Kind>,
    /// The prompt as the pool's workers tokenize it, when the planner already tokenized it
    /// (a policy read the pool's predicted TTFT).
    pub prompt: Option<Arc<PromptInfo>>,
    /// The one worker (by address) that may take the request: it holds the stored response
    /// the request continues or names.
    pub pinned: Option<String>,
}

impl Target {
    pub fn pool(&self) -> Option<&Arc<PoolRuntime>> {
        match &self.destination {
            Destination::Pool(pool) => Some(pool),
            Destination::Provider(_) => None,
        }
    }

    pub fn provider(&self) -> Option<&Arc<ProviderRuntime>> {
        match &self.destination {
            Destination::Pool(_) => None,
            Destination::Provider(provider) => Some(provider),
        }
    }
}

/// Prepare `target` for `request`. Used for the first target and again for each fallback.
/// `cache_salt` is what a vLLM pool's workers get ([`crate::prompt::worker_cache_salt`]); providers
/// get the body as the client sent it.
pub(super) fn prepare_target(
    table: &RoutingTable,
    target: &ModelTarget,
    client: &ClientRequest,
    typed: &RequestBody<'_>,
    cache_salt: Option<&str>,
) -> Result<Target, ApiError> {
    let (parsed, body, endpoint) = (&client.parsed, &client.body, client.endpoint);
    let destination = table.destination(target).ok_or_else(|| {
        ApiError::new(
            ErrorKind::Internal,
            "target_missing",
            format!("{} is not loaded", target.backend),
        )
    })?;
    let (translate, upstream_path) = match &destination {
        Destination::Provider(provider) => {
            if let Some(reason) = &provider.unavailable {
                return Err(ApiError::new(
                    ErrorKind::Unavailable,
                    "provider_unavailable",
                    format!(
                        "model '{}' routes to provider {}, which cannot be used: {reason}",
                        parsed.model, provider.config.id
                    ),
                ));
            }
            provider_translation(provider, endpoint).ok_or_else(|| {
                let message = if matches!(
                    endpoint,
                    Endpoint::ChatCompletions | Endpoint::Completions | Endpoint::Messages
                ) {
                    format!(
                        "model '{}' is served by provider {}, which speaks the Anthropic Messages API: \
                         use /v1/chat/completions or /v1/messages (legacy completions cannot be translated)",
                        parsed.model, provider.config.id
                    )
                } else {
                    format!(
                        "model '{}' is served by provider {}, which does not serve {}",
                        parsed.model,
                        provider.config.id,
                        endpoint.upstream_path()
                    )
                };
                ApiError::new(ErrorKind::NotImplemented, "translation_unsupported", message)
            })?
        }
        Destination::Pool(pool) => {
            if pool.workers.is_empty() {
                return Err(ApiError::new(
                    ErrorKind::Unavailable,
                    "no_workers",
                    format!(
                        "model '{}' has no workers available right now; retry shortly",
                        parsed.model
                    ),
                ));
            }
            if !endpoint.served_by(pool.config.task) {
                return Err(ApiError::new(
                    ErrorKind::InvalidRequest,
                    "model_task_mismatch",
                    format!(
                        "model '{}' is a {} model and does not serve {}",
                        parsed.model,
                        match pool.config.task {
                            PoolTask::Generate => "generative",
                            PoolTask::Embed => "embedding",
                            PoolTask::Score => "scoring",
                        },
                        endpoint.upstream_path()
                    ),
                ));
            }
            match endpoint {
                Endpoint::Messages
                    if pool.config.anthropic_messages == AnthropicMessages::Translate =>
                {
                    (
                        Translation::MessagesToChat,
                        Some("/v1/chat/completions".to_owned()),
                    )
                }
                Endpoint::Responses if pool.config.responses_api == ResponsesApi::Translate => (
                    Translation::ResponsesToChat,
                    Some("/v1/chat/completions".to_owned()),
                ),
                _ => (Translation::None, None),
            }
        }
    };
    let provider = match &destination {
        Destination::Provider(provider) => Some(provider),
        Destination::Pool(_) => None,
    };
    let worker_salt = cache_salt.filter(|_| provider.is_none());
    // Streamed OpenAI answers carry usage only when asked: ask on the client's behalf, and
    // remove that chunk again before it reaches a client that did not ask.
    let openai_upstream = translate == Translation::None
        && matches!(endpoint, Endpoint::ChatCompletions | Endpoint::Completions)
        && provider.is_none_or(|p| p.config.format == ProviderFormat::Openai);
    let ask_usage = parsed.stream && openai_upstream;
    // A whole answer from a worker is asked for as a stream and assembled here: the gateway
    // then sees its first token, when the worker's prefill is done (the ledger releases it,
    // the TTFT model observes it), not only its last.
    let assemble = match translate {
        _ if parsed.stream || provider.is_some() || !typed.assemblable() => None,
        Translation::None => match endpoint {
            Endpoint::ChatCompletions => Some(assemble::Kind::Chat),
            Endpoint::Completions => Some(assemble::Kind::Completion),
            Endpoint::Messages => Some(assemble::Kind::Message),
            // A response made in the background is answered at once, not at its end.
            Endpoint::Responses => typed
                .responses_fields()
                .is_ok_and(|fields| !fields.background)
                .then_some(assemble::Kind::Response),
            _ => None,
        },
        Translation::MessagesToChat | Translation::ResponsesToChat => Some(assemble::Kind::Chat),
        Translation::ChatToMessages => None,
    };
    let streaming = match (ask_usage, assemble) {
        (true, _) => request::Streaming::AskUsage,
        // Only OpenAI's streams carry usage only when asked.
        (false, Some(kind)) => request::Streaming::Stream {
            usage: matches!(kind, assemble::Kind::Chat | assemble::Kind::Completion),
        },
        (false, None) => request::Streaming::AsSent,
    };
    let mut strip_usage = false;
    let upstream_body = match translate {
        Translation::MessagesToChat => {
            let mut translated =
                translate_request::messages_to_chat(typed, &target.upstream_model)?;
            if assemble.is_some() {
                translated = request::with_leading_stream_usage(translated);
            }
            match worker_salt {
                Some(salt) => request::with_leading_cache_salt(translated, salt),
                None => translated,
            }
        }
        Translation::ChatToMessages => {
            translate_request::chat_to_messages(typed, &target.upstream_model)?
        }
        Translation::ResponsesToChat => {
            let mut translated =
                translate_responses::responses_to_chat(typed, &target.upstream_model)?;
            if assemble.is_some() {
                translated = request::with_leading_stream_usage(translated);
            }
            match worker_salt {
                Some(salt) => request::with_leading_cache_salt(translated, salt),
                None => translated,
            }
        }
        Translation::None if endpoint.is_audio() => {
            multipart::replaced(body, parsed.model_span(), &target.upstream_model)
        }
        Translation::None => {
            let (rewritten, asked) =
                request::rewrite(body, parsed, &target.upstream_model, worker_salt, streaming)?;
            // An assembled answer always carries its usage, as a whole answer does.
            strip_usage = asked && assemble.is_none();
            rewritten
        }
    };
    if parsed.stream && translate == Translation::ChatToMessages {
        // The translated stream always ends with a usage chunk: keep it only on request.
        strip_usage = !parsed.asks_stream_usage;
    }
    Ok(Target {
        label: target.backend.to_string(),
        destination,
        translate,
        upstream_path,
        upstream_model: target.upstream_model.clone(),
        body: upstream_body,
        strip_usage,
        assemble,
        prompt: None,
        pinned: None,
    })
}

/// The translation and upstream path for `endpoint` on a provider; `None` when the provider's
/// API cannot serve it.
fn provider_translation(
    provider: &ProviderRuntime,
    endpoint: Endpoint,
) -> Option<(Translation, Option<String>)> {
    let base = &provider.base_path;
    let (translate, path) = match (endpoint, provider.config.format) {
        (Endpoint::Messages, ProviderFormat::Anthropic) => (Translation::None, "messages"),
        (Endpoint::Messages, ProviderFormat::Openai) => {
            (Translation::MessagesToChat, "chat/completions")
        }
        (Endpoint::ChatCompletions, ProviderFormat::Openai) => {
            (Translation::None, "chat/completions")
        }
        (Endpoint::ChatCompletions, ProviderFormat::Anthropic) => {
            (Translation::ChatToMessages, "messages")
        }
        (Endpoint::Completions, ProviderFormat::Openai) => (Translation::None, "completions"),
        (Endpoint::Responses, ProviderFormat::Openai) => match provider.config.responses_api {
            ResponsesApi::Native => (Translation::None, "responses"),
            ResponsesApi::Translate => (Translation::ResponsesToChat, "chat/completions"),
        },
        (Endpoint::Embeddings, ProviderFormat::Openai) => (Translation::None, "embeddings"),
        (Endpoint::Transcriptions, ProviderFormat::Openai) => {
            (Translation::None, "audio/transcriptions")
        }
        (Endpoint::AudioTranslations, ProviderFormat::Openai) => {
            (Translation::None, "audio/translations")
        }
        _ => return None,
    };
    Some((translate, Some(format!("{base}/{path}"))))
}

/// The target of a request naming a stored response (`GET`/`DELETE /v1/responses/{id}`, `POST
/// .../cancel`): the pool's worker (or the provider) that made it, asked on `path` (the
/// client's path and query, from `/v1/responses/`).
pub fn stored_response_target(
    table: &RoutingTable,
    holder: &Holder,
    path: &str,
) -> Result<Target, ApiError> {
    let gone = |why: String| ApiError {
        kind: ErrorKind::NotFound,
        code: "response_not_found",
        param: Some("response_id"),
        message: why,
        retry_after: None,
    };
    let target = ModelTarget {
        backend: holder.backend.clone(),
        upstream_model: holder.upstream_model.clone(),
        weight: 1,
    };
    let destination = table.destination(&target).ok_or_else(|| {
        gone(format!(
            "the response was made by {}, which is no longer configured",
            holder.backend
        ))
    })?;
    let upstream_path = match &destination {
        Destination::Pool(pool) => {
            if let Some(worker) = &holder.worker
                && !pool.workers.iter().any(|w| &w.address == worker)
            {
                return Err(gone(format!(
                    "the response was kept by a worker that has left pool {}: it is gone with it",
                    pool.config.id
                )));
            }
            path.to_owned()
        }
        Destination::Provider(provider) => {
            let rest = path.strip_prefix("/v1").unwrap_or(path);
            format!("{}{rest}", provider.base_path)
        }
    };
    Ok(Target {
        label: holder.backend.to_string(),
        destination,
        translate: Translation::None,
        upstream_path: Some(upstream_path),
        upstream_model: holder.upstream_model.clone(),
        body: Bytes::new(),
        strip_usage: false,
        assemble: None,
        prompt: None,
        pinned: holder.worker.clone(),
    })
}
