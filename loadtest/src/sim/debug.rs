//! The simulator's debug surface for oracle routing: `POST /debug/predicted_ttft` takes the same
//! body as `/v1/chat/completions` and answers what TTFT this worker's engine predicts for it if
//! it arrived now ([`Prediction`]), without queueing anything.
//!
//! This is not a vLLM endpoint. It lets a benchmark router route on the engine's own state (its
//! exact queues, prefix cache and step costs) to show how far a router that can only observe a
//! worker from outside is from one that knows it.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::engine::Prediction;
use super::http::Worker;

/// What a chat request asks for that the prediction needs.
#[derive(Debug, PartialEq)]
struct Asked {
    prompt: Vec<u32>,
    cache_salt: Option<String>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
enum AskError {
    #[error("invalid JSON body: {0}")]
    Json(String),
    #[error("the model `{0}` is not served here")]
    Model(String),
    #[error("messages must be a non-empty list")]
    NoMessages,
    #[error("cannot tokenize the prompt: {0}")]
    Tokenize(String),
}

impl AskError {
    fn status(&self) -> StatusCode {
        match self {
            AskError::Model(_) => StatusCode::NOT_FOUND,
            _ => StatusCode::BAD_REQUEST,
        }
    }
}

/// Tokenize a chat body exactly as the chat route does (chat template, tokenizer, `cache_salt`).
fn ask(worker: &Worker, body: &[u8]) -> Result<Asked, AskError> {
    let request: Value = serde_json::from_slice(body).map_err(|e| AskError::Json(e.to_string()))?;
    let model = request
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if model != worker.model {
        return Err(AskError::Model(model.to_owned()));
    }
    let prompt = super::http::chat_prompt(worker, &request, body)
        .ok_or(AskError::NoMessages)?
        .map_err(|e| AskError::Tokenize(e.to_string()))?;
    let cache_salt = request
        .get("cache_salt")
        .and_then(Value::as_str)
        .filter(|salt| !salt.is_empty())
        .map(str::to_owned);
    Ok(Asked { prompt, cache_salt })
}

/// `POST /debug/predicted_ttft`: the engine's [`Prediction`] for this chat request, as JSON
/// (`predicted_ttft_s` in model seconds, `null` when it could not be admitted without new
/// arrivals).
pub async fn predicted_ttft(State(worker): State<Arc<Worker>>, body: Bytes) -> Response {
    let asked = match ask(&worker, &body) {
        Ok(asked) => asked,
        Err(error) => {
            let body =
                json!({"error": {"message": error.to_string(), "code": error.status().as_u16()}});
            return (error.status(), axum::Json(body)).into_response();
        }
    };
    match worker
        .engine
        .predict_ttft(asked.prompt, asked.cache_salt)
        .await
    {
        Some(prediction) => axum::Json::<Prediction>(prediction).into_response(),
        None => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::engine::{self, EngineConfig};
    use switchyard_kv::tokenize::PromptTokenizer;

    fn worker(tokenizer: &Arc<PromptTokenizer>) -> Arc<Worker> {
        let (output_vocab, token_text) = Worker::output_vocabulary(tokenizer);
        Arc::new(Worker {
            model: "m".into(),
            engine: engine::spawn(EngineConfig::default(), None),
            tokenizer: tokenizer.clone(),
            max_model_len: 32_768,
            default_max_tokens: 16,
            task: crate::sim::http::Task::Generate,
            output_vocab: Arc::new(output_vocab),
            token_text: Arc::new(token_text),
            responses: crate::sim::responses::ResponseStore::new(false),
        })
    }

    async fn predicted(worker: &Arc<Worker>, body: &Value) -> Value {
        let response = predicted_ttft(State(worker.clone()), Bytes::from(body.to_string())).await;
        assert_eq!(response.status(), StatusCode::OK);
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        serde_json::from_slice(&bytes).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn the_worker_holding_the_prefix_predicts_the_lower_ttft() {
        let tokenizer = Arc::new(PromptTokenizer::shipped().unwrap());
        let (warm, cold) = (worker(&tokenizer), worker(&tokenizer));
        let system = "You are a careful assistant for the billing team. ".repeat(60);
        let chat = |question: &str| {
            json!({"model": "m", "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question}]})
        };
        // Warm one worker's prefix cache with the system prompt.
        let first = ask(&warm, chat("What is an invoice?").to_string().as_bytes()).unwrap();
        let mut outputs = warm.engine.submit(first.prompt, vec![1]).unwrap();
        while outputs.recv().await.is_some() {}

        let body = chat("How do refunds work?");
        let (hit, miss) = (predicted(&warm, &body).await, predicted(&cold, &body).await);
        assert!(hit["cached_tokens"].as_u64().unwrap() >= 512, "{hit}");
        assert_eq!(miss["cached_tokens"], 0);
        let ttft = |v: &Value| v["predicted_ttft_s"].as_f64().unwrap();
        assert!(ttft(&hit) < ttft(&miss), "{hit} vs {miss}");

        // Nothing was queued by asking, and bad bodies say what is wrong.
        assert_eq!(hit["waiting"], 0);
        let response = predicted_ttft(
            State(cold.clone()),
            Bytes::from(json!({"model": "other", "messages": []}).to_string()),
        )
        .await;
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        assert_eq!(
            ask(&cold, br#"{"model": "m", "messages": []}"#),
            Err(AskError::NoMessages)
        );
    }
}
