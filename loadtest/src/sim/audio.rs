//! vLLM's speech-to-text routes (`vllm/entrypoints/speech_to_text/`): `POST
//! /v1/audio/transcriptions` and `/v1/audio/translations`, multipart forms with the audio
//! `file`, `model`, `response_format`, `stream`. The simulated model "hears" the file as
//! encoder tokens (50 per second of 16 kHz 16-bit mono audio, as Whisper's encoder frames it)
//! and queues them as a prefill like any request; the text is generated as for chat.
//! Answers: `{"text", "usage": {"type": "duration", "seconds"}}`, `text` as plain text, or a
//! stream of `transcription.chunk` events (`stream=true`).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Multipart, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use sha2::{Digest, Sha256};

use super::engine::Output;
use super::http::{Task, Worker, bad_request, collect, error, route_not_served, text_of, unix_now};

/// Bytes of one second of 16 kHz, 16-bit mono PCM.
const BYTES_PER_SECOND: usize = 32_000;
/// Encoder frames per second of audio (Whisper: 1500 per 30 s).
const TOKENS_PER_SECOND: usize = 50;

pub async fn transcriptions(State(worker): State<Arc<Worker>>, form: Multipart) -> Response {
    serve(worker, form).await
}

pub async fn translations(State(worker): State<Arc<Worker>>, form: Multipart) -> Response {
    serve(worker, form).await
}

async fn serve(worker: Arc<Worker>, mut form: Multipart) -> Response {
    if worker.task != Task::Generate {
        return route_not_served();
    }
    let mut audio: Option<Bytes> = None;
    let (mut model, mut format, mut stream, mut max_tokens) =
        (None, "json".to_owned(), false, None);
    loop {
        let field = match form.next_field().await {
            Ok(Some(field)) => field,
            Ok(None) => break,
            Err(e) => return bad_request(format!("invalid form: {e}")).into_response(),
        };
        let name = field.name().unwrap_or_default().to_owned();
        let value = match field.bytes().await {
            Ok(value) => value,
            Err(e) => return bad_request(format!("invalid form: {e}")).into_response(),
        };
        let text = || String::from_utf8_lossy(&value).trim().to_owned();
        match name.as_str() {
            "file" => audio = Some(value.clone()),
            "model" => model = Some(text()),
            "response_format" => format = text(),
            "stream" => stream = text() == "true",
            "max_completion_tokens" => max_tokens = text().parse::<usize>().ok(),
            _ => {}
        }
    }
    let Some(audio) = audio else {
        return error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "BadRequestError",
            "Field required: file",
            Some("file"),
        )
        .into_response();
    };
    if model.as_deref() != Some(worker.model.as_str()) {
        return error(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            format!("The model `{}` does not exist.", model.unwrap_or_default()),
            Some("model"),
        )
        .into_response();
    }
    let seconds = audio.len().div_ceil(BYTES_PER_SECOND).max(1);
    // Encoder input: the audio's own tokens (no two files share a prefix).
    let digest = Sha256::digest(&audio);
    let seed = digest
        .iter()
        .take(4)
        .fold(0u32, |acc, byte| (acc << 8) | u32::from(*byte));
    let prompt: Vec<u32> = (0..seconds * TOKENS_PER_SECOND)
        .map(|i| seed.wrapping_add(i as u32) % 100_000)
        .collect();
    let vocab = &worker.output_vocab;
    let count = max_tokens.unwrap_or(worker.default_max_tokens).max(1);
    let output = (0..count)
        .filter_map(|i| vocab.get(i % vocab.len().max(1)).copied())
        .collect();
    let outputs = match worker.engine.submit(prompt, output) {
        Ok(outputs) => outputs,
        Err(e) => return bad_request(e.to_string()).into_response(),
    };
    if stream {
        let (id, model, created) = (
            format!("trsc-{:032x}", rand::random::<u128>()),
            worker.model.clone(),
            unix_now(),
        );
        let events = futures_util::stream::unfold(
            (worker, outputs, false),
            move |(worker, mut outputs, done)| {
                let (id, model) = (id.clone(), model.clone());
                async move {
                    if done {
                        return None;
                    }
                    let chunk = |delta: serde_json::Value, finish: Option<&str>| {
                        format!(
                            "data: {}\n\n",
                            json!({"id": id, "object": "transcription.chunk", "created": created, "model": model,
                        "choices": [{"delta": delta, "finish_reason": finish, "stop_reason": null}]})
                        )
                    };
                    let (text, done) = match outputs.recv().await.unwrap_or(Output::Finished) {
                        Output::Started { .. } => (String::new(), false),
                        Output::Token(token) => {
                            let piece = worker.token_text.get(&token).cloned().unwrap_or_default();
                            (chunk(json!({"content": piece}), None), false)
                        }
                        Output::Finished => (
                            format!("{}data: [DONE]\n\n", chunk(json!({}), Some("length"))),
                            true,
                        ),
                    };
                    Some((
                        Ok::<_, Infallible>(Bytes::from(text)),
                        (worker, outputs, done),
                    ))
                }
            },
        );
        return Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .body(Body::from_stream(events))
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    }
    let collected = collect(outputs).await;
    let text = text_of(&worker, &collected.tokens);
    match format.as_str() {
        "text" => text.into_response(),
        "json" => {
            axum::Json(json!({"text": text, "usage": {"type": "duration", "seconds": seconds}}))
                .into_response()
        }
        other => bad_request(format!("response_format '{other}' is not simulated")).into_response(),
    }
}
