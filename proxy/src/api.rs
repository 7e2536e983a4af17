//! The client-facing API surface: which endpoint a request is for, and errors in the client's format.

use bytes::Bytes;
use serde_json::json;
use switchyard_snapshot::snapshot::PoolTask;

/// The client protocol, which decides how errors are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientFormat {
    OpenAi,
    Anthropic,
}

/// The endpoints the proxy serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    ChatCompletions,
    Completions,
    Messages,
    /// OpenAI's Responses API, `POST /v1/responses`: generates, routed like chat.
    Responses,
    /// A response a worker keeps: `GET` and `DELETE /v1/responses/{id}`, `POST
    /// /v1/responses/{id}/cancel`, forwarded to the worker that answered it.
    StoredResponse,
    /// Speech to text (vLLM's Whisper-style models): `POST /v1/audio/transcriptions` and
    /// `/v1/audio/translations`, multipart forms, forwarded with the model rewritten.
    Transcriptions,
    AudioTranslations,
    /// Anthropic's `POST /v1/messages/count_tokens`, answered by the gateway.
    CountTokens,
    /// vLLM's `POST /tokenize` and `/detokenize`, forwarded to a worker of the model's pool.
    Tokenize,
    Detokenize,
    /// Pooling models (vLLM): `POST /v1/embeddings`, `/pooling`, `/v1/score` (and `/score`),
    /// `/v1/rerank` (and `/rerank`, `/v2/rerank`), forwarded to pools of the right task.
    Embeddings,
    Pooling,
    Score,
    Rerank,
    Models,
    /// `GET /v1/models/{id}` (the id may hold slashes, raw or percent-encoded).
    Model,
    Health,
    Ready,
    Metrics,
}

impl Endpoint {
    /// Map a path (without query) to an endpoint.
    pub fn from_path(path: &str) -> Option<Endpoint> {
        // Tolerate one trailing slash, as OpenAI's own API does.
        let path = path
            .strip_suffix('/')
            .filter(|p| !p.is_empty())
            .unwrap_or(path);
        Some(match path {
            "/v1/chat/completions" => Endpoint::ChatCompletions,
            "/v1/completions" => Endpoint::Completions,
            "/v1/messages" => Endpoint::Messages,
            "/v1/responses" => Endpoint::Responses,
            "/v1/audio/transcriptions" => Endpoint::Transcriptions,
            "/v1/audio/translations" => Endpoint::AudioTranslations,
            "/v1/messages/count_tokens" => Endpoint::CountTokens,
            "/tokenize" => Endpoint::Tokenize,
            "/detokenize" => Endpoint::Detokenize,
            "/v1/embeddings" => Endpoint::Embeddings,
            "/pooling" => Endpoint::Pooling,
            "/v1/score" | "/score" => Endpoint::Score,
            "/v1/rerank" | "/rerank" | "/v2/rerank" => Endpoint::Rerank,
            "/v1/models" => Endpoint::Models,
            "/health" => Endpoint::Health,
            "/ready" => Endpoint::Ready,
            "/metrics" => Endpoint::Metrics,
            _ if path.len() > MODEL_PREFIX.len() && path.starts_with(MODEL_PREFIX) => {
                Endpoint::Model
            }
            _ if response_id_of(path).is_some() => Endpoint::StoredResponse,
            _ => return None,
        })
    }

    pub fn method(self) -> http::Method {
        match self {
            Endpoint::Models
            | Endpoint::Model
            | Endpoint::Health
            | Endpoint::Ready
            | Endpoint::Metrics => http::Method::GET,
            _ => http::Method::POST,
        }
    }

    /// The methods the endpoint takes, for `Allow` (`HEAD` and `OPTIONS` wherever `GET` is).
    pub fn allowed_methods(self) -> &'static str {
        if self == Endpoint::StoredResponse {
            return "GET, DELETE, POST, OPTIONS";
        }
        if self.method() == http::Method::GET {
            "GET, HEAD, OPTIONS"
        } else {
            "POST, OPTIONS"
        }
    }

    /// Whether `method` is served on this endpoint (`HEAD` wherever `GET` is; `OPTIONS` is
    /// answered apart).
    pub fn takes(self, method: &http::Method) -> bool {
        if self == Endpoint::StoredResponse {
            // The worker holding the response answers for the methods it serves.
            return matches!(
                *method,
                http::Method::GET | http::Method::DELETE | http::Method::POST
            );
        }
        *method == self.method()
            || (*method == http::Method::HEAD && self.method() == http::Method::GET)
    }

    /// The path sent upstream.
    pub fn upstream_path(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Messages => "/v1/messages",
            Endpoint::Responses => "/v1/responses",
            Endpoint::StoredResponse => RESPONSE_PREFIX,
            Endpoint::Transcriptions => "/v1/audio/transcriptions",
            Endpoint::AudioTranslations => "/v1/audio/translations",
            Endpoint::CountTokens => "/v1/messages/count_tokens",
            Endpoint::Tokenize => "/tokenize",
            Endpoint::Detokenize => "/detokenize",
            Endpoint::Embeddings => "/v1/embeddings",
            Endpoint::Pooling => "/pooling",
            Endpoint::Score => "/v1/score",
            Endpoint::Rerank => "/v1/rerank",
            Endpoint::Models => "/v1/models",
            Endpoint::Model => MODEL_PREFIX,
            Endpoint::Health => "/health",
            Endpoint::Ready => "/ready",
            Endpoint::Metrics => "/metrics",
        }
    }

    /// Inference requests: the ones that generate, which the gateway routes by prompt.
    pub fn is_inference(self) -> bool {
        matches!(
            self,
            Endpoint::ChatCompletions
                | Endpoint::Completions
                | Endpoint::Messages
                | Endpoint::Responses
        )
    }

    /// Speech to text: a multipart form with an audio file, not JSON.
    pub fn is_audio(self) -> bool {
        matches!(self, Endpoint::Transcriptions | Endpoint::AudioTranslations)
    }

    /// Requests for pooling models (embeddings, scores).
    pub fn is_pooling(self) -> bool {
        matches!(
            self,
            Endpoint::Embeddings | Endpoint::Pooling | Endpoint::Score | Endpoint::Rerank
        )
    }

    /// Whether a pool of `task` serves this endpoint (as vLLM's runners do).
    pub fn served_by(self, task: PoolTask) -> bool {
        match self {
            Endpoint::ChatCompletions
            | Endpoint::Completions
            | Endpoint::Messages
            | Endpoint::Responses
            | Endpoint::StoredResponse
            | Endpoint::Transcriptions
            | Endpoint::AudioTranslations => task == PoolTask::Generate,
            Endpoint::Embeddings => task == PoolTask::Embed,
            Endpoint::Pooling | Endpoint::Score | Endpoint::Rerank => task != PoolTask::Generate,
            _ => true,
        }
    }

    /// The client API (everything but probes and metrics).
    pub fn is_api(self) -> bool {
        !matches!(self, Endpoint::Health | Endpoint::Ready | Endpoint::Metrics)
    }

    pub fn label(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Completions => "completions",
            Endpoint::Messages => "messages",
            Endpoint::Responses => "responses",
            Endpoint::StoredResponse => "stored_response",
            Endpoint::Transcriptions => "transcriptions",
            Endpoint::AudioTranslations => "audio_translations",
            Endpoint::CountTokens => "count_tokens",
            Endpoint::Tokenize => "tokenize",
            Endpoint::Detokenize => "detokenize",
            Endpoint::Embeddings => "embeddings",
            Endpoint::Pooling => "pooling",
            Endpoint::Score => "score",
            Endpoint::Rerank => "rerank",
            Endpoint::Models => "models",
            Endpoint::Model => "model",
            Endpoint::Health => "health",
            Endpoint::Ready => "ready",
            Endpoint::Metrics => "metrics",
        }
    }
}

/// Path prefix of a stored response's routes.
const RESPONSE_PREFIX: &str = "/v1/responses/";

/// The response id of `/v1/responses/{id}` and `/v1/responses/{id}/cancel` (`None`: not such
/// a path). Ids are the worker's (`resp_` and hex, or the client's own `request_id`): any
/// printable text without `/`.
pub fn response_id_of(path: &str) -> Option<&str> {
    let rest = path.strip_prefix(RESPONSE_PREFIX)?;
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    let id = rest.strip_suffix("/cancel").unwrap_or(rest);
    (!id.is_empty() && !id.contains('/') && id.bytes().all(|b| b.is_ascii_graphic())).then_some(id)
}

/// Path prefix of `GET /v1/models/{id}`.
const MODEL_PREFIX: &str = "/v1/models/";

/// The model id of a `GET /v1/models/{id}` path, percent-decoded (`None`: not such a path, or
/// not UTF-8 once decoded).
pub fn model_id_of(path: &str) -> Option<String> {
    let raw = path.strip_prefix(MODEL_PREFIX)?;
    // One trailing slash is tolerated, as for every path.
    let raw = raw.strip_suffix('/').unwrap_or(raw).as_bytes();
    let mut out = Vec::with_capacity(raw.len());
    let mut at = 0;
    while let Some(&byte) = raw.get(at) {
        let hex = raw
            .get(at + 1..at + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (byte, hex) {
            (b'%', Some(decoded)) => {
                out.push(decoded);
                at += 3;
            }
            _ => {
                out.push(byte);
                at += 1;
            }
        }
    }
    String::from_utf8(out).ok().filter(|id| !id.is_empty())
}

/// The client format of a path, known or not: `/v1/messages` (and paths under it) speak
/// Anthropic, everything else OpenAI.
pub fn client_format_for_path(path: &str) -> ClientFormat {
    let path = path.trim_end_matches('/');
    if path == "/v1/messages" || path.starts_with("/v1/messages/") {
        ClientFormat::Anthropic
    } else {
        ClientFormat::OpenAi
    }
}

/// The client format of a request: its path's, or Anthropic's for the shared paths
/// (`/v1/models`) when the client sends `anthropic-version`, as Anthropic's SDKs do.
pub fn client_format(path: &str, headers: &http::HeaderMap) -> ClientFormat {
    match client_format_for_path(path) {
        ClientFormat::OpenAi
            if path.starts_with("/v1/models") && headers.contains_key("anthropic-version") =>
        {
            ClientFormat::Anthropic
        }
        format => format,
    }
}

/// What went wrong, which fixes the status and the error type names in both formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidRequest,
    NotFound,
    MethodNotAllowed,
    /// The request (head or body) did not arrive in time.
    RequestTimeout,
    LengthRequired,
    PayloadTooLarge,
    /// The request head is too large or has too many header fields.
    HeaderTooLarge,
    BadGateway,
    Unavailable,
    GatewayTimeout,
    Internal,
    /// No or an unknown API key.
    Unauthorized,
    /// The tenant may not do this.
    Forbidden,
    NotImplemented,
    /// A status named elsewhere (a policy's `reject` action, a rate limit, an upstream's
    /// error): the error types follow from it.
    Status(u16),
}

impl ErrorKind {
    pub fn status(self) -> u16 {
        match self {
            ErrorKind::InvalidRequest => 400,
            ErrorKind::NotFound => 404,
            ErrorKind::MethodNotAllowed => 405,
            ErrorKind::RequestTimeout => 408,
            ErrorKind::LengthRequired => 411,
            ErrorKind::PayloadTooLarge => 413,
            ErrorKind::HeaderTooLarge => 431,
            ErrorKind::Internal => 500,
            ErrorKind::BadGateway => 502,
            ErrorKind::Unavailable => 503,
            ErrorKind::GatewayTimeout => 504,
            ErrorKind::Unauthorized => 401,
            ErrorKind::Forbidden => 403,
            ErrorKind::NotImplemented => 501,
            ErrorKind::Status(status) => status,
        }
    }

    fn openai_type(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest
            | ErrorKind::NotFound
            | ErrorKind::MethodNotAllowed
            | ErrorKind::RequestTimeout
            | ErrorKind::LengthRequired
            | ErrorKind::PayloadTooLarge
            | ErrorKind::HeaderTooLarge => "invalid_request_error",
            ErrorKind::BadGateway
            | ErrorKind::Unavailable
            | ErrorKind::GatewayTimeout
            | ErrorKind::Internal
            | ErrorKind::NotImplemented => "server_error",
            ErrorKind::Unauthorized => "authentication_error",
            ErrorKind::Forbidden => "permission_error",
            ErrorKind::Status(429) => "rate_limit_error",
            ErrorKind::Status(401) => "authentication_error",
            ErrorKind::Status(403) => "permission_error",
            ErrorKind::Status(status) if status < 500 => "invalid_request_error",
            ErrorKind::Status(_) => "server_error",
        }
    }

    fn anthropic_type(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest
            | ErrorKind::MethodNotAllowed
            | ErrorKind::RequestTimeout
            | ErrorKind::LengthRequired
            | ErrorKind::HeaderTooLarge => "invalid_request_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::PayloadTooLarge => "request_too_large",
            ErrorKind::Unavailable => "overloaded_error",
            ErrorKind::BadGateway
            | ErrorKind::GatewayTimeout
            | ErrorKind::Internal
            | ErrorKind::NotImplemented => "api_error",
            ErrorKind::Unauthorized => "authentication_error",
            ErrorKind::Forbidden => "permission_error",
            ErrorKind::Status(status) => match status {
                401 => "authentication_error",
                403 => "permission_error",
                404 => "not_found_error",
                413 => "request_too_large",
                429 => "rate_limit_error",
                503 | 529 => "overloaded_error",
                400..=499 => "invalid_request_error",
                _ => "api_error",
            },
        }
    }
}

/// An error the proxy itself answers with. The message names what to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub kind: ErrorKind,
    /// Machine-readable code in OpenAI's `error.code` (e.g. `model_not_found`).
    pub code: &'static str,
    /// The request field at fault, for OpenAI's `error.param`.
    pub param: Option<&'static str>,
    pub message: String,
    /// Seconds for a `Retry-After` header (rate limits).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(kind: ErrorKind, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            kind,
            code,
            param: None,
            message: message.into(),
            retry_after: None,
        }
    }

    /// 404 for a model the caller cannot use (unknown, or not in the tenant's list).
    pub fn model_not_found(model: &str) -> ApiError {
        ApiError {
            kind: ErrorKind::NotFound,
            code: "model_not_found",
            param: Some("model"),
            message: format!(
                "the model '{}' does not exist; GET /v1/models lists the models you can use",
                client_text(model)
            ),
            retry_after: None,
        }
    }

    pub fn invalid(param: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            kind: ErrorKind::InvalidRequest,
            code: "invalid_request",
            param: Some(param),
            message: message.into(),
            retry_after: None,
        }
    }

    pub fn status(&self) -> u16 {
        self.kind.status()
    }

    /// The message as it is sent and logged: escaped and bounded, whatever it quotes.
    pub fn shown_message(&self) -> String {
        bounded(&self.message, MESSAGE_CHARS)
    }

    /// The JSON body in the client's format.
    pub fn body(&self, format: ClientFormat) -> Bytes {
        let message = self.shown_message();
        let value = match format {
            ClientFormat::OpenAi => json!({
                "error": {
                    "message": message,
                    "type": self.kind.openai_type(),
                    "param": self.param,
                    "code": self.code,
                }
            }),
            ClientFormat::Anthropic => json!({
                "type": "error",
                "error": {
                    "type": self.kind.anthropic_type(),
                    "message": message,
                }
            }),
        };
        Bytes::from(value.to_string())
    }
}

impl ApiError {
    /// The error as the last event of a stream the client's `endpoint` answers with, once its
    /// status went out (a worker that failed half-way): Anthropic's `error` event on
    /// `/v1/messages`, the Responses API's `error` event on `/v1/responses` (numbered
    /// `sequence`, the events before it being numbered from 0), and elsewhere the error chunk
    /// and `[DONE]` with which vLLM ends a stream that failed. The official SDKs raise the
    /// first two as an API error (not as a broken connection) and yield the Responses API's
    /// as its typed error event.
    pub fn stream_event(&self, endpoint: Endpoint, sequence: u64) -> Bytes {
        let (opening, data, closing): (&[u8], Bytes, &[u8]) = match endpoint {
            Endpoint::Messages => (
                b"event: error\ndata: ",
                self.body(ClientFormat::Anthropic),
                b"\n\n",
            ),
            Endpoint::Responses => (
                b"event: error\ndata: ",
                Bytes::from(
                    json!({
                        "type": "error",
                        "code": self.code,
                        "message": self.shown_message(),
                        "param": self.param,
                        "sequence_number": sequence,
                    })
                    .to_string(),
                ),
                b"\n\n",
            ),
            _ => (
                b"data: ",
                self.body(ClientFormat::OpenAi),
                b"\n\ndata: [DONE]\n\n",
            ),
        };
        [opening, &data, closing].concat().into()
    }
}

/// Longest client-supplied text echoed in an error message or a log line, in characters.
const CLIENT_TEXT_CHARS: usize = 128;
/// Longest error message sent or logged, in characters (parser messages can quote a whole value).
const MESSAGE_CHARS: usize = 1_024;

/// A client-supplied string (a model name, a field value) as it may appear in an error message
/// or a log line: control and invisible characters escaped so it cannot forge lines, and cut to
/// [`CLIENT_TEXT_CHARS`] characters with the full length said.
pub fn client_text(text: &str) -> String {
    bounded(text, CLIENT_TEXT_CHARS)
}

/// `text` with control and invisible characters escaped, cut to `max_chars` characters.
fn bounded(text: &str, max_chars: usize) -> String {
    let mut out = String::new();
    let mut chars = text.chars();
    for c in chars.by_ref().take(max_chars) {
        if c.is_control()
            || matches!(
                c,
                '\u{200b}'..='\u{200f}' | '\u{2028}' | '\u{2029}' | '\u{feff}'
            )
        {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    if chars.next().is_some() {
        out.push_str(&format!("… ({} bytes)", text.len()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_stream_ends_with_an_error_event_in_the_clients_api() {
        let error = ApiError::new(ErrorKind::GatewayTimeout, "upstream_timeout", "stopped");
        let data = |event: &str, prefix: &str| -> serde_json::Value {
            let line = event.lines().find(|l| l.starts_with("data: {")).unwrap();
            assert!(event.starts_with(prefix), "{event}");
            assert!(event.ends_with("\n\n"), "{event}");
            serde_json::from_str(line.trim_start_matches("data: ")).unwrap()
        };
        let chat = error.stream_event(Endpoint::ChatCompletions, 0);
        let chat = std::str::from_utf8(&chat).unwrap();
        assert!(chat.ends_with("\n\ndata: [DONE]\n\n"), "{chat}");
        let chat = data(chat, "data: ");
        assert_eq!(chat["error"]["code"], "upstream_timeout");
        assert_eq!(chat["error"]["type"], "server_error");
        assert_eq!(chat["error"]["message"], "stopped");
        let messages = error.stream_event(Endpoint::Messages, 0);
        let messages = data(std::str::from_utf8(&messages).unwrap(), "event: error\n");
        assert_eq!(messages["type"], "error");
        assert_eq!(messages["error"]["type"], "api_error");
        assert_eq!(messages["error"]["message"], "stopped");
        let responses = error.stream_event(Endpoint::Responses, 7);
        let responses = data(std::str::from_utf8(&responses).unwrap(), "event: error\n");
        assert_eq!(responses["type"], "error");
        assert_eq!(responses["code"], "upstream_timeout");
        assert_eq!(responses["message"], "stopped");
        assert_eq!(responses["sequence_number"], 7);
    }

    #[test]
    fn model_paths_and_formats() {
        assert_eq!(
            Endpoint::from_path("/v1/models/org/beta"),
            Some(Endpoint::Model)
        );
        assert_eq!(Endpoint::from_path("/v1/models/"), Some(Endpoint::Models));
        assert_eq!(
            model_id_of("/v1/models/org/beta").as_deref(),
            Some("org/beta")
        );
        assert_eq!(
            model_id_of("/v1/models/org%2Fbeta").as_deref(),
            Some("org/beta")
        );
        assert_eq!(model_id_of("/v1/models/a%2").as_deref(), Some("a%2"));
        assert_eq!(model_id_of("/v1/models/beta/").as_deref(), Some("beta"));
        assert_eq!(model_id_of("/v1/models/%FF"), None);
        let mut headers = http::HeaderMap::new();
        assert_eq!(
            client_format("/v1/models/x", &headers),
            ClientFormat::OpenAi
        );
        assert_eq!(
            client_format("/v1/messages/count_tokens", &headers),
            ClientFormat::Anthropic
        );
        headers.insert("anthropic-version", "2023-06-01".parse().unwrap());
        assert_eq!(
            client_format("/v1/models/x", &headers),
            ClientFormat::Anthropic
        );
        assert_eq!(
            client_format("/v1/chat/completions", &headers),
            ClientFormat::OpenAi
        );
    }

    #[test]
    fn openai_error_shape() {
        let error = ApiError::new(ErrorKind::NotFound, "model_not_found", "no such model");
        let body: serde_json::Value =
            serde_json::from_slice(&error.body(ClientFormat::OpenAi)).unwrap();
        assert_eq!(body["error"]["message"], "no such model");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["code"], "model_not_found");
        assert_eq!(error.status(), 404);
    }

    #[test]
    fn anthropic_error_shape() {
        let error = ApiError::new(ErrorKind::PayloadTooLarge, "body_too_large", "too big");
        let body: serde_json::Value =
            serde_json::from_slice(&error.body(ClientFormat::Anthropic)).unwrap();
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], "request_too_large");
        assert_eq!(body["error"]["message"], "too big");
        assert_eq!(error.status(), 413);
    }

    #[test]
    fn paths_map_to_endpoints_and_formats() {
        assert_eq!(
            Endpoint::from_path("/v1/chat/completions/"),
            Some(Endpoint::ChatCompletions)
        );
        assert_eq!(
            Endpoint::from_path("/v1/messages"),
            Some(Endpoint::Messages)
        );
        assert_eq!(Endpoint::from_path("/v2/x"), None);
        assert_eq!(
            client_format_for_path("/v1/messages"),
            ClientFormat::Anthropic
        );
        assert_eq!(
            client_format_for_path("/v1/completions"),
            ClientFormat::OpenAi
        );
    }

    #[test]
    fn client_text_is_escaped_and_bounded() {
        assert_eq!(client_text("default"), "default");
        assert_eq!(
            client_text("m\nINFO forged line\r"),
            "m\\u{a}INFO forged line\\u{d}"
        );
        let long = "x".repeat(1_000_000);
        let shown = client_text(&long);
        assert!(shown.len() < 200, "{}", shown.len());
        assert!(shown.ends_with("… (1000000 bytes)"), "{shown}");
        let quoted = ApiError::invalid("body", format!("bad value {long}"));
        assert!(quoted.shown_message().len() < 1_100);
        let body: serde_json::Value =
            serde_json::from_slice(&quoted.body(ClientFormat::Anthropic)).unwrap();
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .ends_with("bytes)")
        );
        // Cut on a character boundary.
        assert_eq!(
            client_text(&"é".repeat(200))
                .chars()
                .filter(|c| *c == 'é')
                .count(),
            128
        );
    }
}
