//! Anthropic's `POST /v1/messages/count_tokens`, answered by the gateway: the request's
//! conversation rendered with the chat template of the pool that serves its model and counted
//! with that pool's tokenizer, as the workers will see it.
//!
//! Models served only by external providers are not counted here (501): the gateway does not
//! know their tokenizers.

use std::sync::Arc;

use bytes::Bytes;
use pingora_error::Result;
use pingora_proxy::Session;
use serde_json::json;
use switchyard_snapshot::snapshot::Backend;

use crate::admit;
use crate::api::{ApiError, ErrorKind, client_text};
use crate::gateway::{Gateway, RequestCtx};
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
        let tenant = admit::authenticate(&table, &session.req_header().headers)?
            .tenant()
            .map(|t| t.name.clone());
        let body = self.read_body(session).await?;
        let (model, messages) = {
            let request = wire::parse(&body)?;
            let (model, _) = request.model_name()?;
            if request.messages.as_ref().is_none_or(Vec::is_empty) {
                return Err(ApiError::invalid(
                    "messages",
                    "'messages' must contain at least one message",
                ));
            }
            (model, request.chat_messages(true))
        };
        let allowed = tenant
            .as_deref()
            .and_then(|name| table.snapshot.tenants.get(name))
            .is_none_or(|tenant| tenant.allows_model(&model));
        let spec = tokenizer_of(&table, &model, allowed)?;
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || {
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
            let rendered = tokenizer.render_chat(&messages).map_err(|e| {
                ApiError::invalid(
                    "messages",
                    format!("the chat template refused the messages: {e}"),
                )
            })?;
            tokenizer
                .encode(&rendered)
                .map(|tokens| tokens.len())
                .map_err(|e| ApiError::new(ErrorKind::Internal, "tokenizer_failed", e.to_string()))
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

/// The tokenizer of the first pool among `model`'s targets.
fn tokenizer_of(
    table: &Arc<RoutingTable>,
    model: &str,
    allowed: bool,
) -> std::result::Result<Option<switchyard_snapshot::snapshot::Tokenizer>, ApiError> {
    let not_found = || ApiError {
        kind: ErrorKind::NotFound,
        code: "model_not_found",
        param: Some("model"),
        message: format!(
            "the model '{}' does not exist; GET /v1/models lists the models you can use",
            client_text(model)
        ),
        retry_after: None,
    };
    let entry = table
        .model(model)
        .filter(|_| allowed)
        .ok_or_else(not_found)?;
    entry
        .targets
        .iter()
        .find_map(|target| match &target.backend {
            Backend::Pool(id) => table.pool(id).map(|pool| pool.config.tokenizer.clone()),
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
