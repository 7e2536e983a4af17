//! Anthropic's `POST /v1/messages/count_tokens`, answered by the gateway: the request's
//! conversation rendered with the chat template of the pool that serves its model and counted
//! with that pool's tokenizer, as the workers will see it.
//!
//! Models served only by external providers are not counted here (501): the gateway does not
//! know their tokenizers. The conversation is rendered as vLLM's `/v1/messages` renders it
//! (tools, tool blocks and thinking included: see `switchyard_kv::anthropic`).

use std::sync::Arc;

use bytes::Bytes;
use pingora_error::Result;
use pingora_proxy::Session;
use serde_json::json;
use switchyard_snapshot::snapshot::{AnthropicMessages, Backend};

use crate::admit;
use crate::api::{ApiError, ErrorKind, client_text};
use crate::config::ConfigStore;
use crate::gateway::{Gateway, RequestCtx};
use crate::limits::Reservation;
use crate::routing::RoutingTable;
use crate::wire;

impl Gateway {
    pub(crate) async fn count_tokens(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<bool> {
        let counted = match self.count(session).await {
            Ok(tokens) => tokens,
            Err(error) => return self.respond_error(session, ctx, error).await,
        };
        let body = Bytes::from(json!({ "input_tokens": counted }).to_string());
        self.respond(session, ctx, 200, "application/json", body, &[])
            .await?;
        Ok(true)
    }

    async fn count(&self, session: &mut Session) -> std::result::Result<usize, ApiError> {
        let table = admit::live_table(self)?;
        let caller = admit::authenticate(&table, &session.req_header().headers)?;
        let tenant = caller.tenant().map(|t| t.name.clone());
        // A count is a request against the tenant's limits, not tokens spent.
        let _admission = match caller.tenant() {
            Some(tenant) => {
                admit::admit_rate(&self.limiter, tenant, Reservation::for_request(0, Some(0)))
                    .map_err(|rejection| rejection.error)?
            }
            None => None,
        };
        let body = self.read_body(session).await?;
        let store = self.store.clone();
        // Parsing, rendering and tokenizing are CPU work: off the event loop.
        tokio::task::spawn_blocking(move || {
            count_blocking(&store, &table, tenant.as_deref(), &body)
        })
        .await
        .unwrap_or_else(|e| {
            Err(ApiError::new(
                ErrorKind::Internal,
                "internal_error",
                format!("counting failed: {e}"),
            ))
        })
    }
}

/// The tokens of `body`'s conversation as the pool serving its model renders and tokenizes it.
fn count_blocking(
    store: &ConfigStore,
    table: &Arc<RoutingTable>,
    tenant: Option<&str>,
    body: &[u8],
) -> std::result::Result<usize, ApiError> {
    let request = wire::parse(body)?;
    let (model, _) = request.model_name()?;
    if request.messages.as_ref().is_none_or(Vec::is_empty) {
        return Err(ApiError::invalid(
            "messages",
            "'messages' must contain at least one message",
        ));
    }
    let allowed = tenant
        .and_then(|name| table.snapshot.tenants.get(name))
        .is_none_or(|tenant| tenant.allows_model(&model));
    let (spec, translated) = tokenizer_of(table, &model, allowed)?;
    let tokenizer = store.kv().tokenizer(&spec).map_err(|e| {
        ApiError::new(
            ErrorKind::Internal,
            "tokenizer_unavailable",
            format!(
                "the tokenizer of model '{}' cannot be loaded: {e}",
                client_text(&model)
            ),
        )
    })?;
    // What the pool's workers render: vLLM's own conversion, or the gateway's translation.
    let (messages, inputs) = if translated {
        let chat = crate::translate_request::messages_to_chat(&request, &model)?;
        let chat = wire::parse(&chat)?;
        (chat.chat_messages(), chat.template_inputs())
    } else {
        crate::prompt::anthropic_chat_of(&tokenizer, &request)
            .map_err(|e| ApiError::invalid("body", format!("malformed JSON: {e}")))?
    };
    let rendered = tokenizer
        .render_chat_with(&messages, &inputs)
        .map_err(|e| {
            ApiError::invalid(
                "messages",
                format!("the chat template refused the messages: {e}"),
            )
        })?;
    tokenizer
        .encode(&rendered)
        .map(|tokens| tokens.len())
        .map_err(|e| ApiError::new(ErrorKind::Internal, "tokenizer_failed", e.to_string()))
}

/// The tokenizer of the first pool among `model`'s targets, and whether that pool is sent
/// Anthropic requests translated to chat completions.
fn tokenizer_of(
    table: &Arc<RoutingTable>,
    model: &str,
    allowed: bool,
) -> std::result::Result<(Option<switchyard_snapshot::snapshot::Tokenizer>, bool), ApiError> {
    let not_found = || ApiError::model_not_found(model);
    let entry = table
        .model(model)
        .filter(|_| allowed)
        .ok_or_else(not_found)?;
    entry
        .targets
        .iter()
        .find_map(|target| match &target.backend {
            Backend::Pool(id) => table.pool(id).map(|pool| {
                (
                    pool.config.tokenizer.clone(),
                    pool.config.anthropic_messages == AnthropicMessages::Translate,
                )
            }),
            Backend::Provider(_) => None,
        })
        .ok_or_else(|| {
            ApiError::new(
                ErrorKind::NotImplemented,
                "count_tokens_unsupported",
                format!(
                    "model '{}' is served only by external providers, whose tokenizers the gateway does not know",
                    client_text(model)
                ),
            )
        })
}
