//! The upstream's answer on its way to the client: translated into the client's API when the
//! target speaks another, its usage read (and the usage chunk the gateway asked for removed),
//! and its first output timed.

use std::time::Instant;

use bytes::{Bytes, BytesMut};
use pingora_http::ResponseHeader;

use crate::accounting::UsageTap;
use crate::api::ClientFormat;
use crate::assemble::{self, Assembler};
use crate::plan::Translation;
use crate::translate::find_event_end;
use crate::translate::{self, StreamTranslator};
use crate::translate_openai::{self, MessagesStreamTranslator};
use crate::translate_responses::{self, ResponsesStreamTranslator};

/// An incremental stream translation (either direction).
pub trait StreamTranslation: std::fmt::Debug + Send + Sync {
    /// Bytes from upstream in, bytes for the client out.
    fn feed(&mut self, chunk: &[u8]) -> Bytes;
    /// The end of the upstream body: whatever closes the client's stream.
    fn finish(&mut self) -> Bytes;
}

impl StreamTranslation for StreamTranslator {
    fn feed(&mut self, chunk: &[u8]) -> Bytes {
        StreamTranslator::feed(self, chunk)
    }
    fn finish(&mut self) -> Bytes {
        StreamTranslator::finish(self)
    }
}

impl StreamTranslation for ResponsesStreamTranslator {
    fn feed(&mut self, chunk: &[u8]) -> Bytes {
        ResponsesStreamTranslator::feed(self, chunk)
    }
    fn finish(&mut self) -> Bytes {
        ResponsesStreamTranslator::finish(self)
    }
}

impl StreamTranslation for MessagesStreamTranslator {
    fn feed(&mut self, chunk: &[u8]) -> Bytes {
        MessagesStreamTranslator::feed(self, chunk)
    }
    fn finish(&mut self) -> Bytes {
        MessagesStreamTranslator::finish(self)
    }
}

/// Translates a whole successful answer: upstream body and the client's model name in; an
/// error when the body is no answer of the upstream's API.
type AnswerFn = fn(&[u8], &str) -> Result<Bytes, String>;
/// Translates a whole error body: status and upstream body in.
type ErrorFn = fn(u16, &[u8]) -> Bytes;

#[derive(Debug, Default)]
enum Mode {
    #[default]
    PassThrough,
    /// Buffer the whole answer and translate it into the client's API at the end.
    TranslateWhole {
        buffer: BytesMut,
        answer: AnswerFn,
    },
    /// Buffer an error body and write it in the client's error format at the end.
    Error {
        buffer: BytesMut,
        status: u16,
        error: ErrorFn,
    },
    TranslateStream(Box<dyn StreamTranslation>),
    /// A native answer, whole: its `model` (in its first bytes, where every API writes it)
    /// becomes the client's alias; the rest passes as it arrives.
    AliasHead {
        buffer: BytesMut,
        from: String,
        /// How far into the answer the model is looked for.
        within: usize,
        /// How far it has been looked for already (each chunk only adds to the search).
        searched: usize,
        done: bool,
    },
    /// A native stream: each event's `model` becomes the client's alias.
    AliasStream {
        pending: BytesMut,
        from: String,
    },
    /// A stream the client asked for whole: assembled, and sent at its end (in the client's
    /// API when `translate` is set).
    Assemble {
        assembler: Box<Assembler>,
        translate: Option<AnswerFn>,
    },
}

/// What translates a whole answer into the client's API (`translate` is not
/// [`Translation::None`]).
fn whole_translation(translate: Translation) -> AnswerFn {
    match translate {
        Translation::ChatToMessages => translate_openai::message_response_to_chat,
        Translation::ResponsesToChat => translate_responses::chat_response_to_responses,
        Translation::MessagesToChat | Translation::None => translate::chat_response_to_message,
    }
}

/// What writes an upstream's error body in the client's error format: an error the upstream
/// already wrote in it passes as it is (with the upstream's own details), anything else (the
/// other API's shape, plain text from a proxy before the worker, vLLM's validation errors on
/// its Anthropic endpoint) is rewritten, its message kept; a refusal of the gateway's
/// credentials always is ([`translate::upstream_error`]).
fn error_writer(format: ClientFormat) -> ErrorFn {
    match format {
        ClientFormat::OpenAi => |status, body| error_in(status, body, ClientFormat::OpenAi),
        ClientFormat::Anthropic => |status, body| error_in(status, body, ClientFormat::Anthropic),
    }
}

/// An upstream's error body as [`error_writer`] writes it for a client of `format`.
fn error_in(status: u16, body: &[u8], format: ClientFormat) -> Bytes {
    if !translate::refused_credentials(status) && is_error_of(body, format) {
        Bytes::copy_from_slice(body)
    } else {
        translate::upstream_error(status, body, format)
    }
}

/// Whether `body` is an error in `format`'s shape: OpenAI's `{"error": {"message": ...}}`,
/// Anthropic's `{"type": "error", "error": {"type": ..., "message": ...}}`.
fn is_error_of(body: &[u8], format: ClientFormat) -> bool {
    let Ok(body) = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(body)
    else {
        return false;
    };
    let error = body.get("error").and_then(serde_json::Value::as_object);
    let text = |field| {
        error
            .and_then(|e| e.get(field))
            .is_some_and(serde_json::Value::is_string)
    };
    let anthropic = body.get("type").and_then(serde_json::Value::as_str) == Some("error");
    match format {
        ClientFormat::OpenAi => !anthropic && text("message"),
        ClientFormat::Anthropic => anthropic && text("type") && text("message"),
    }
}

/// How answers name the model: as the client did (`client`, its alias), whatever the upstream
/// served it as (`upstream`), looked for in a whole answer's first `within` bytes (`None`: the
/// answer names none).
#[derive(Debug, Clone, Copy)]
pub struct Naming<'a> {
    pub client: &'a str,
    pub upstream: &'a str,
    pub within: Option<usize>,
}

/// How the client gets its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// Whole, as the upstream sends it.
    Whole,
    /// As a stream.
    Stream,
    /// Whole, assembled by the gateway from the upstream's stream ([`crate::assemble`]).
    Assembled(assemble::Kind),
}

/// The state of an answer.
#[derive(Debug)]
pub struct Answer {
    mode: Mode,
    /// Reads `usage` from the answer (and removes the usage chunk the proxy asked for).
    pub usage: UsageTap,
    /// When the answer's first output (its first token, or its error) went to the client; of an
    /// answer the gateway assembles, when the worker's first token reached the gateway.
    pub first_output: Option<Instant>,
    /// A native Responses API stream: it opens with events its server sends before the model
    /// has produced anything ([`assemble::OPENING_EVENTS`]), so its first output is the first
    /// other event.
    pub opens_with_events: bool,
    /// The stream names its events (`event:` lines): only they say where output starts.
    events_named: bool,
    /// The upstream streams events (`text/event-stream`, answered 2xx or 3xx): its first output
    /// is told by its lines ([`Answer::first_output_in`]), not by its first byte.
    events: bool,
    /// The start of a line not ended yet, held (until the first output) to be judged whole.
    partial_line: Vec<u8>,
    /// The first output was an error event: the worker computed nothing it could keep.
    pub first_was_error: bool,
    /// Why an answer the gateway assembles or translates has no whole (the stream failed, the
    /// body is no answer): the client's connection is ended, its status being sent already.
    pub failed: Option<String>,
    /// Line breaks at the end of what the client's stream got (2: it ends between two events,
    /// or nothing went yet): an error event can end it if its worker fails.
    breaks_at_end: u8,
    /// Events the client's stream got (the Responses API numbers its events from 0: the next
    /// one, an error that ends it, is this).
    pub events_sent: u64,
}

/// Events that end a stream in an error: vLLM's `error` (and Anthropic's), and the Responses
/// API's failed response.
const ERROR_EVENTS: [&str; 2] = ["error", "response.failed"];

/// Bytes of one line held to be judged whole before it counts as output anyway.
const MAX_PARTIAL_LINE: usize = 64 * 1024;

/// Whether a stream's `data:` payload is an error event ([`assemble::stream_error`]).
fn is_error_payload(payload: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(payload.trim_ascii())
        .is_ok_and(|event| assemble::stream_error(&event).is_some())
}

impl Answer {
    pub fn new(usage: UsageTap) -> Answer {
        Answer {
            mode: Mode::PassThrough,
            usage,
            first_output: None,
            opens_with_events: false,
            events_named: false,
            events: false,
            partial_line: Vec::new(),
            first_was_error: false,
            failed: None,
            breaks_at_end: 2,
            events_sent: 0,
        }
    }

    /// Whether `chunk` (non-empty, on its way to the client) brings the answer's first output,
    /// and whether that is an error (`Some(true)`). Any answer but an event stream: its first
    /// byte. An event stream: its first complete line that is not a comment or blank (a
    /// keep-alive is no output; a line split across reads is judged when it ends), and in a
    /// stream that opens with events only an event past them (or, in such a stream that names
    /// no events, its first data).
    fn first_output_in(&mut self, chunk: &[u8]) -> Option<bool> {
        if !self.events {
            return Some(false);
        }
        let joined;
        let text: &[u8] = if self.partial_line.is_empty() {
            chunk
        } else {
            let mut held = std::mem::take(&mut self.partial_line);
            held.extend_from_slice(chunk);
            joined = held;
            &joined
        };
        let complete = text
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |end| end + 1);
        let (lines, rest) = text.split_at(complete);
        let found = self.output_in_lines(lines);
        if found.is_none() {
            if rest.len() > MAX_PARTIAL_LINE {
                return Some(false);
            }
            self.partial_line = rest.to_vec();
        }
        found
    }

    /// [`Self::first_output_in`] for complete lines.
    fn output_in_lines(&mut self, lines: &[u8]) -> Option<bool> {
        for line in lines.split(|&b| b == b'\n') {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if line.is_empty() || line.starts_with(b":") {
                continue;
            }
            if let Some(name) = line.strip_prefix(b"event:") {
                let name = name.trim_ascii();
                if ERROR_EVENTS.iter().any(|event| event.as_bytes() == name) {
                    return Some(true);
                }
                if self.opens_with_events {
                    self.events_named = true;
                    if assemble::OPENING_EVENTS
                        .iter()
                        .any(|event| event.as_bytes() == name)
                    {
                        continue;
                    }
                }
                return Some(false);
            }
            if let Some(payload) = line.strip_prefix(b"data:") {
                if is_error_payload(payload) {
                    return Some(true);
                }
                // The data of an opening event.
                if self.opens_with_events && self.events_named {
                    continue;
                }
                return Some(false);
            }
        }
        None
    }
}

/// The framing of an answer whose body the gateway changed (`had_length`: the upstream sent the
/// `Content-Length` that [`Answer::head`] then removed), for a client speaking `client`.
///
/// Pingora picks HTTP/1.1 framing before the response filter runs and, finding neither a length
/// nor chunking after it, ends the body by closing the connection (while the head still says
/// `Connection: keep-alive`): every such answer would cost its client a new connection, and a
/// TLS handshake with it. So an HTTP/1.1 client gets the body chunked (the head then says
/// HTTP/1.1 whatever the upstream spoke, as Pingora does when it chunks). An HTTP/1.0 client
/// cannot take chunks and keeps the close; HTTP/2 frames bodies itself; a status without a body
/// needs no framing.
pub fn frame_rewritten(
    response: &mut ResponseHeader,
    had_length: bool,
    client: http::Version,
) -> pingora_error::Result<()> {
    let bodiless =
        response.status.is_informational() || matches!(response.status.as_u16(), 204 | 304);
    if !had_length
        || bodiless
        || client != http::Version::HTTP_11
        || response.headers.contains_key(http::header::CONTENT_LENGTH)
        || response
            .headers
            .contains_key(http::header::TRANSFER_ENCODING)
    {
        return Ok(());
    }
    response.set_version(http::Version::HTTP_11);
    response.insert_header(http::header::TRANSFER_ENCODING, "chunked")?;
    Ok(())
}

impl Answer {
    /// The upstream's response head (`status`), for a client of the other API when `translate`
    /// says so, delivered as `delivery` says, naming the model as `naming` says. An error
    /// status's body goes out in the client's error `format`.
    pub fn head(
        &mut self,
        response: &mut ResponseHeader,
        translate: Translation,
        delivery: Delivery,
        naming: Naming<'_>,
        format: ClientFormat,
    ) -> pingora_error::Result<()> {
        let Naming {
            client: client_model,
            upstream: upstream_model,
            within: model_within,
        } = naming;
        let status = response.status.as_u16();
        let stream = delivery == Delivery::Stream;
        // A worker that answered whole after all (not a stream: another server, or a body the
        // gateway could not rewrite) passes as a whole answer.
        let streamed = response
            .headers
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|value| value.as_bytes().starts_with(b"text/event-stream"));
        self.events = stream && status < 400 && streamed;
        if let Delivery::Assembled(kind) = delivery
            && status < 400
            && streamed
        {
            response.remove_header(&http::header::CONTENT_LENGTH);
            response.insert_header(http::header::CONTENT_TYPE, "application/json")?;
            self.mode = Mode::Assemble {
                assembler: Box::new(Assembler::new(kind)),
                translate: (translate != Translation::None).then(|| whole_translation(translate)),
            };
            return Ok(());
        }
        if status >= 400 {
            // An error, in whatever words the upstream used: in the client's. A refusal of the
            // gateway's credentials is the gateway's failure: a 502.
            if translate::refused_credentials(status) {
                response.set_status(502)?;
                response.set_reason_phrase(None)?;
            }
            // A head that says its body is empty ends the answer: no body comes to rewrite.
            if response
                .headers
                .get(http::header::CONTENT_LENGTH)
                .is_some_and(|length| length.as_bytes() == b"0")
            {
                return Ok(());
            }
            response.remove_header(&http::header::CONTENT_LENGTH);
            response.insert_header(http::header::CONTENT_TYPE, "application/json")?;
            self.mode = Mode::Error {
                buffer: BytesMut::new(),
                status,
                error: error_writer(format),
            };
            return Ok(());
        }
        if translate == Translation::None {
            if let Some(within) = model_within
                && client_model != upstream_model
            {
                response.remove_header(&http::header::CONTENT_LENGTH);
                let from = upstream_model.to_owned();
                self.mode = if stream && status < 400 {
                    Mode::AliasStream {
                        pending: BytesMut::new(),
                        from,
                    }
                } else {
                    Mode::AliasHead {
                        buffer: BytesMut::new(),
                        from,
                        within,
                        searched: 0,
                        done: false,
                    }
                };
            } else if self.usage.strips() {
                // Passed as it came but for the usage chunk the gateway asked for itself.
                response.remove_header(&http::header::CONTENT_LENGTH);
            }
            return Ok(());
        }
        response.remove_header(&http::header::CONTENT_LENGTH);
        self.mode = if stream {
            response.insert_header(http::header::CONTENT_TYPE, "text/event-stream")?;
            Mode::TranslateStream(match translate {
                Translation::ChatToMessages => {
                    Box::new(MessagesStreamTranslator::new(client_model))
                }
                Translation::ResponsesToChat => {
                    Box::new(ResponsesStreamTranslator::new(client_model))
                }
                _ => Box::new(StreamTranslator::new(client_model)),
            })
        } else {
            response.insert_header(http::header::CONTENT_TYPE, "application/json")?;
            Mode::TranslateWhole {
                buffer: BytesMut::new(),
                answer: whole_translation(translate),
            }
        };
        Ok(())
    }

    /// Whether the answer is being assembled from a stream (the worker did stream it).
    pub fn assembling(&self) -> bool {
        matches!(self.mode, Mode::Assemble { .. })
    }

    /// A piece of the upstream's body, made the client's. Returns `true` when it carries the
    /// answer's first output (of an assembled answer: the worker's first token).
    pub fn body(
        &mut self,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        client_model: &str,
    ) -> bool {
        let mut first = false;
        match &mut self.mode {
            Mode::PassThrough => {}
            Mode::Assemble {
                assembler,
                translate,
            } => {
                if let Some(chunk) = body.take() {
                    // The worker streams nothing before its first token.
                    if assembler.feed(&chunk) && self.first_output.is_none() {
                        self.first_output = Some(Instant::now());
                        first = true;
                    }
                }
                if end_of_stream {
                    let answer =
                        assembler
                            .answer(client_model)
                            .and_then(|answer| match translate {
                                Some(translate) => translate(&answer, client_model),
                                None => Ok(answer),
                            });
                    match answer {
                        Ok(answer) => *body = Some(answer),
                        Err(why) => self.failed = Some(why),
                    }
                }
            }
            Mode::TranslateStream(translator) => {
                let mut out = BytesMut::new();
                if let Some(chunk) = body.take() {
                    out.extend_from_slice(&translator.feed(&chunk));
                }
                if end_of_stream {
                    out.extend_from_slice(&translator.finish());
                }
                *body = (!out.is_empty()).then(|| out.freeze());
            }
            Mode::TranslateWhole { buffer, answer } => {
                if let Some(chunk) = body.take() {
                    buffer.extend_from_slice(&chunk);
                }
                if end_of_stream {
                    // Not an answer after a success status (a proxy's page, a cut body): no
                    // whole answer, as when an assembled stream fails.
                    match answer(buffer, client_model) {
                        Ok(answer) => *body = Some(answer),
                        Err(why) => self.failed = Some(why),
                    }
                }
            }
            Mode::Error {
                buffer,
                status,
                error,
            } => {
                if let Some(chunk) = body.take() {
                    buffer.extend_from_slice(&chunk);
                }
                if end_of_stream {
                    *body = Some(error(*status, buffer));
                }
            }
            Mode::AliasHead {
                buffer,
                from,
                within,
                searched,
                done,
            } => {
                if !*done {
                    if let Some(chunk) = body.take() {
                        buffer.extend_from_slice(&chunk);
                    }
                    // A match may straddle the last chunk's end: look again from a little before.
                    let start = searched.saturating_sub(from.len() + 64);
                    *searched = buffer.len();
                    match renamed_head_from(buffer, start, from, client_model) {
                        Some(renamed) => {
                            *done = true;
                            buffer.clear();
                            *body = Some(Bytes::from(renamed));
                        }
                        // Held until the model shows, within the answer's first bytes.
                        None if buffer.len() < *within && !end_of_stream => {}
                        None => {
                            *done = true;
                            *body = Some(std::mem::take(buffer).freeze());
                        }
                    }
                }
            }
            Mode::AliasStream { pending, from } => {
                if let Some(chunk) = body.take() {
                    pending.extend_from_slice(&chunk);
                }
                let mut out = BytesMut::new();
                while let Some((end, separator)) = find_event_end(pending) {
                    let event = pending.split_to(end + separator);
                    out.extend_from_slice(&renamed_event(&event, from, client_model));
                }
                if end_of_stream {
                    out.extend_from_slice(&std::mem::take(pending));
                }
                *body = (!out.is_empty()).then(|| out.freeze());
            }
        }
        if let Some(chunk) = body.take() {
            if self.first_output.is_none()
                && !chunk.is_empty()
                && let Some(error) = self.first_output_in(&chunk)
            {
                self.first_output = Some(Instant::now());
                self.first_was_error = error;
                first = true;
            }
            *body = Some(self.usage.feed(chunk));
        }
        if end_of_stream {
            let rest = self.usage.finish();
            if !rest.is_empty() {
                let mut out = BytesMut::from(body.take().unwrap_or_default().as_ref());
                out.extend_from_slice(&rest);
                *body = Some(out.freeze());
            }
        }
        if self.events
            && let Some(out) = body.as_ref()
        {
            self.note_sent(out);
        }
        first
    }

    /// Count what went to the client of an event stream: an event ends at a blank line (its
    /// separator may straddle two pieces; a `\r` before a `\n` is part of the line break).
    fn note_sent(&mut self, out: &[u8]) {
        for byte in out {
            match byte {
                b'\n' => {
                    if self.breaks_at_end == 1 {
                        self.events_sent += 1;
                    }
                    self.breaks_at_end = self.breaks_at_end.saturating_add(1).min(2);
                }
                b'\r' => {}
                _ => self.breaks_at_end = 0,
            }
        }
    }

    /// Whether the client gets a stream of events that can still take one more: an error, if
    /// its worker fails half-way ([`crate::api::ApiError::stream_event`]). Not when the last
    /// event went out in part (its end will not come).
    pub fn can_end_with_event(&self) -> bool {
        self.events && self.breaks_at_end >= 2
    }
}

/// How far into a whole answer its `model` is looked for before it passes as it came: the
/// first field or so in every API but the Responses API, whose answer echoes the request's
/// `instructions` (any length) before the model.
pub const ALIAS_HEAD_BYTES: usize = 4096;
pub const RESPONSE_ALIAS_BYTES: usize = 8 * 1024 * 1024;

/// `head` (the start of a JSON answer, or one stream payload) with its first
/// `"model": "<from>"` member renamed to `to`; `None` while there is none.
fn renamed_head(head: &[u8], from: &str, to: &str) -> Option<Vec<u8>> {
    renamed_head_from(head, 0, from, to)
}

/// [`renamed_head`], looking for the member from byte `start` on.
fn renamed_head_from(head: &[u8], start: usize, from: &str, to: &str) -> Option<Vec<u8>> {
    let quoted = |name: &str| serde_json::Value::String(name.to_owned()).to_string();
    let (from, to) = (quoted(from), quoted(to));
    let key: &[u8] = b"\"model\"";
    let mut at = start;
    while let Some(found) = find(head.get(at..)?, key) {
        let key_end = at + found + key.len();
        let rest = head.get(key_end..)?;
        let colon = rest.iter().position(|b| !b.is_ascii_whitespace())?;
        if rest.get(colon) == Some(&b':') {
            let after = rest.get(colon + 1..)?;
            let value = after.iter().position(|b| !b.is_ascii_whitespace())?;
            let start = key_end + colon + 1 + value;
            if head.get(start..)?.starts_with(from.as_bytes()) {
                let mut out = Vec::with_capacity(head.len() + to.len());
                out.extend_from_slice(head.get(..start)?);
                out.extend_from_slice(to.as_bytes());
                out.extend_from_slice(head.get(start + from.len()..)?);
                return Some(out);
            }
        }
        at = key_end;
    }
    None
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// One SSE event with the model of its `data:` payload renamed (other lines as they are).
fn renamed_event(event: &[u8], from: &str, to: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(event.len() + to.len());
    for line in event.split_inclusive(|b| *b == b'\n') {
        let renamed = line
            .strip_prefix(b"data:")
            .and_then(|data| renamed_head(data, from, to));
        match renamed {
            Some(data) => {
                out.extend_from_slice(b"data:");
                out.extend_from_slice(&data);
            }
            None => out.extend_from_slice(line),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn answer() -> Answer {
        Answer::new(UsageTap::new(false, false))
    }

    /// An answer (and the head the client gets) to a 200 whose worker streams events, for an
    /// OpenAI client of `translate` asking as `delivery` says.
    fn event_stream(
        translate: Translation,
        delivery: Delivery,
        naming: Naming<'_>,
    ) -> (Answer, ResponseHeader) {
        let mut answer = answer();
        let mut response = ResponseHeader::build(200, None).unwrap();
        response
            .insert_header("content-type", "text/event-stream")
            .unwrap();
        answer
            .head(
                &mut response,
                translate,
                delivery,
                naming,
                ClientFormat::OpenAi,
            )
            .unwrap();
        (answer, response)
    }

    /// An answer the client asked for whole from a worker's stream (`translate`: into the
    /// client's API), fed `pieces`: what the client got at each piece, and which piece was
    /// taken for the first token.
    fn assembled(
        translate: Translation,
        pieces: &[&str],
    ) -> (Vec<Option<Value>>, Option<usize>, Option<String>) {
        let naming = Naming {
            client: "alias",
            upstream: "org/served",
            within: Some(ALIAS_HEAD_BYTES),
        };
        let (mut answer, response) =
            event_stream(translate, Delivery::Assembled(assemble::Kind::Chat), naming);
        assert_eq!(response.headers["content-type"], "application/json");
        let (mut out, mut first) = (Vec::new(), None);
        for (index, piece) in pieces.iter().enumerate() {
            let mut body = Some(Bytes::from(piece.to_string()));
            if answer.body(&mut body, index + 1 == pieces.len(), "alias") {
                first.get_or_insert(index);
            }
            out.push(body.map(|b| serde_json::from_slice(&b).unwrap()));
        }
        (out, first, answer.failed)
    }

    #[test]
    fn a_whole_answer_from_a_stream_shows_its_first_token_and_goes_out_at_the_end() {
        // The first event is whole only with its second piece: that is the first token.
        let pieces = [
            r#"data: {"id":"c","created":1,"model":"org/served","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
            "\n\n",
            "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"finish_reason\":\"stop\"}]}\n\n",
            "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1,\"total_tokens\":6}}\n\ndata: [DONE]\n\n",
        ];
        let (out, first, failed) = assembled(Translation::None, &pieces);
        assert_eq!(first, Some(1));
        assert_eq!(failed, None);
        assert_eq!(out[..3], [None, None, None]);
        let whole = out[3].clone().unwrap();
        assert_eq!(whole["model"], "alias");
        assert_eq!(whole["choices"][0]["message"]["content"], "Hi");
        assert_eq!(whole["usage"]["total_tokens"], 6);
        // For an Anthropic client of a chat worker: the assembled answer, translated.
        let (out, _, _) = assembled(Translation::MessagesToChat, &pieces);
        let message = out[3].clone().unwrap();
        assert_eq!(message["type"], "message");
        assert_eq!(message["content"][0]["text"], "Hi");
        assert_eq!(message["usage"]["output_tokens"], 1);
        // Cut short: nothing goes out, and the exchange learns why.
        let (out, first, failed) = assembled(Translation::None, &pieces[..3]);
        assert_eq!((out, first), (vec![None, None, None], Some(1)));
        assert!(failed.unwrap().contains("ended before"));
        // An error event is no first token.
        let error = r#"data: {"error":{"message":"engine died","code":500}}"#;
        let (_, first, failed) = assembled(Translation::None, &[error, "\n\ndata: [DONE]\n\n"]);
        assert_eq!(first, None);
        assert!(failed.unwrap().contains("engine died"));

        // A worker that answered whole after all: its answer passes as it came.
        let mut answer = answer();
        let mut response = ResponseHeader::build(200, None).unwrap();
        response
            .insert_header("content-type", "application/json")
            .unwrap();
        answer
            .head(
                &mut response,
                Translation::None,
                Delivery::Assembled(assemble::Kind::Chat),
                Naming {
                    client: "m",
                    upstream: "m",
                    within: Some(ALIAS_HEAD_BYTES),
                },
                ClientFormat::OpenAi,
            )
            .unwrap();
        let whole = r#"{"id":"c","model":"m","choices":[]}"#;
        let mut body = Some(Bytes::from_static(whole.as_bytes()));
        assert!(!answer.assembling());
        answer.body(&mut body, true, "m");
        assert_eq!(body.as_deref(), Some(whole.as_bytes()));
        assert_eq!(answer.failed, None);
    }

    #[test]
    fn an_upstream_error_goes_out_in_the_clients_error_format() {
        let error_of = |status: u16, body: &'static str, format, stream| {
            let mut answer = answer();
            let mut response = ResponseHeader::build(status, None).unwrap();
            response.insert_header("content-length", "10").unwrap();
            let delivery = if stream {
                Delivery::Stream
            } else {
                Delivery::Whole
            };
            answer
                .head(
                    &mut response,
                    Translation::None,
                    delivery,
                    Naming {
                        client: "alias",
                        upstream: "m",
                        within: None,
                    },
                    format,
                )
                .unwrap();
            assert!(response.headers.get("content-length").is_none());
            let mut out = Some(Bytes::from_static(body.as_bytes()));
            answer.body(&mut out, true, "alias");
            serde_json::from_slice::<serde_json::Value>(&out.unwrap()).unwrap()
        };
        // vLLM's validation error (OpenAI's shape) to an Anthropic client: Anthropic's, the
        // worker's message kept.
        let vllm = r#"{"error":{"message":"Input should be a valid string","type":"Bad Request","param":null,"code":400}}"#;
        let error = error_of(400, vllm, ClientFormat::Anthropic, true);
        assert_eq!(error["type"], "error");
        assert_eq!(error["error"]["type"], "invalid_request_error");
        assert_eq!(error["error"]["message"], "Input should be a valid string");
        // The same to an OpenAI client passes as it is, the worker's details kept.
        assert_eq!(
            error_of(400, vllm, ClientFormat::OpenAi, false),
            serde_json::from_str::<serde_json::Value>(vllm).unwrap()
        );
        // An Anthropic error to an Anthropic client, as it is; to an OpenAI client (a provider
        // of the other API), OpenAI's.
        let anthropic = r#"{"type":"error","error":{"type":"overloaded_error","message":"busy"}}"#;
        assert_eq!(
            error_of(529, anthropic, ClientFormat::Anthropic, false)["error"]["type"],
            "overloaded_error"
        );
        let error = error_of(529, anthropic, ClientFormat::OpenAi, false);
        assert_eq!(error["error"]["type"], "server_error");
        assert_eq!(error["error"]["code"], "upstream_error");
        assert_eq!(error["error"]["message"], "busy");
        assert!(error.get("type").is_none(), "{error}");
        // Plain text from something before the worker, in either format.
        let text = "upstream connect error or disconnect/reset before headers";
        // FastAPI's own errors, before vLLM's handlers, say it in `detail`.
        let fastapi = r#"{"detail":[{"loc":["body","max_tokens"],"msg":"Input should be a valid integer","type":"int_parsing"}]}"#;
        for (status, body, format, kind, message) in [
            (
                503,
                text,
                ClientFormat::OpenAi,
                "server_error",
                "upstream answered with status 503",
            ),
            (
                429,
                text,
                ClientFormat::Anthropic,
                "rate_limit_error",
                "upstream answered with status 429",
            ),
            (
                404,
                r#"{"message":"no such model"}"#,
                ClientFormat::Anthropic,
                "not_found_error",
                "no such model",
            ),
            (
                422,
                fastapi,
                ClientFormat::Anthropic,
                "invalid_request_error",
                "body.max_tokens: Input should be a valid integer",
            ),
            (
                405,
                r#"{"detail":"Method Not Allowed"}"#,
                ClientFormat::OpenAi,
                "invalid_request_error",
                "Method Not Allowed",
            ),
        ] {
            let error = error_of(status, body, format, false);
            assert_eq!(error["error"]["type"], kind, "{status}");
            assert_eq!(error["error"]["message"], message, "{status}");
            if format == ClientFormat::OpenAi {
                assert_eq!(error["error"]["code"], "upstream_error", "{status}");
            }
        }
    }

    #[test]
    fn a_refusal_of_the_gateways_key_is_a_502_even_without_a_body() {
        for (length, body) in [("0", ""), ("33", r#"{"error":{"message":"bad key sk-1"}}"#)] {
            let mut answer = answer();
            let mut response = ResponseHeader::build(401, None).unwrap();
            response.set_reason_phrase(Some("Go Away")).unwrap();
            response.insert_header("content-length", length).unwrap();
            let naming = Naming {
                client: "m",
                upstream: "m",
                within: None,
            };
            answer
                .head(
                    &mut response,
                    Translation::None,
                    Delivery::Whole,
                    naming,
                    ClientFormat::OpenAi,
                )
                .unwrap();
            assert_eq!(response.status.as_u16(), 502);
            assert_eq!(response.get_reason_phrase(), Some("Bad Gateway"));
            let mut out = (!body.is_empty()).then(|| Bytes::from_static(body.as_bytes()));
            answer.body(&mut out, true, "m");
            if body.is_empty() {
                // The head ends the answer: its length stays, no body is made up.
                assert_eq!(response.headers.get("content-length").unwrap(), "0");
            } else {
                let error: serde_json::Value = serde_json::from_slice(&out.unwrap()).unwrap();
                let message = error["error"]["message"].as_str().unwrap();
                assert!(message.contains("gateway's credentials"), "{message}");
                assert!(!message.contains("sk-1"), "{message}");
            }
        }
    }

    #[test]
    fn a_whole_answer_to_translate_that_is_none_fails() {
        let mut answer = answer();
        let mut response = ResponseHeader::build(200, None).unwrap();
        answer
            .head(
                &mut response,
                Translation::MessagesToChat,
                Delivery::Whole,
                Naming {
                    client: "alias",
                    upstream: "m",
                    within: None,
                },
                ClientFormat::Anthropic,
            )
            .unwrap();
        let mut body = Some(Bytes::from_static(b"<html>502 Bad Gateway</html>"));
        answer.body(&mut body, true, "alias");
        assert!(body.is_none(), "no 200 with an error for a body");
        assert!(answer.failed.is_some());
    }

    #[test]
    fn a_stream_can_end_with_an_error_event_only_between_events() {
        let streamed = |delivery| {
            let naming = Naming {
                client: "m",
                upstream: "m",
                within: None,
            };
            event_stream(Translation::None, delivery, naming).0
        };
        let mut answer = streamed(Delivery::Stream);
        assert!(answer.can_end_with_event(), "nothing sent yet");
        for (piece, between, events) in [
            ("data: {\"choices\":[]}\n\n", true, 1),
            ("data: {\"cho", false, 1),
            ("ices\":[]}\n\n", true, 2),
            ("event: x\r\ndata: {}\r\n\r\n", true, 3),
            ("data: {}\n", false, 3),
            // The blank line that ends it comes apart.
            ("\n", true, 4),
            ("data: {}\r\n\r", false, 4),
            ("\n", true, 5),
            // Extra blank lines end no more events.
            ("\n\n", true, 5),
        ] {
            let mut body = Some(Bytes::from(piece));
            answer.body(&mut body, false, "m");
            assert_eq!(answer.can_end_with_event(), between, "{piece:?}");
            assert_eq!(answer.events_sent, events, "{piece:?}");
        }
        // An answer the client gets whole has no events to end.
        let mut whole = streamed(Delivery::Whole);
        let mut body = Some(Bytes::from_static(b"data: {}\n\n"));
        whole.body(&mut body, false, "m");
        assert!(!whole.can_end_with_event());
    }

    fn head(answer: &mut Answer, stream: bool) {
        let mut response = ResponseHeader::build(200, None).unwrap();
        response.insert_header("content-length", "10").unwrap();
        answer
            .head(
                &mut response,
                Translation::None,
                if stream {
                    Delivery::Stream
                } else {
                    Delivery::Whole
                },
                Naming {
                    client: "alias",
                    upstream: "org/served",
                    within: Some(ALIAS_HEAD_BYTES),
                },
                ClientFormat::OpenAi,
            )
            .unwrap();
        assert!(response.headers.get("content-length").is_none());
    }

    #[test]
    fn a_changed_body_loses_its_length_and_an_untouched_one_keeps_it() {
        let head = |usage, translate, delivery, client_model| {
            let mut response = ResponseHeader::build(200, None).unwrap();
            response.insert_header("content-length", "10").unwrap();
            response
                .insert_header("content-type", "application/json")
                .unwrap();
            Answer::new(usage)
                .head(
                    &mut response,
                    translate,
                    delivery,
                    Naming {
                        client: client_model,
                        upstream: "org/served",
                        within: Some(ALIAS_HEAD_BYTES),
                    },
                    ClientFormat::OpenAi,
                )
                .unwrap();
            response.headers.get("content-length").cloned()
        };
        let plain = || UsageTap::new(false, false);
        // Renamed, translated, the injected usage chunk removed: the length no longer holds.
        assert_eq!(
            head(plain(), Translation::None, Delivery::Whole, "alias"),
            None
        );
        assert_eq!(
            head(
                plain(),
                Translation::ChatToMessages,
                Delivery::Whole,
                "alias"
            ),
            None
        );
        let stripping = UsageTap::new(true, true);
        assert_eq!(
            head(stripping, Translation::None, Delivery::Stream, "org/served"),
            None
        );
        // Passed as it came: its length stands.
        assert!(head(plain(), Translation::None, Delivery::Whole, "org/served").is_some());
    }

    #[test]
    fn a_body_that_lost_its_length_goes_chunked_to_http11_clients_only() {
        use http::Version;
        let framed = |status: u16, upstream: Version, had_length, client| {
            let mut response = ResponseHeader::build(status, None).unwrap();
            response.set_version(upstream);
            frame_rewritten(&mut response, had_length, client).unwrap();
            let chunked = response.headers.get_all("transfer-encoding").iter().count();
            (chunked, response.version)
        };
        // An HTTP/1.1 client: chunked, under an HTTP/1.1 head even from an HTTP/1.0 upstream.
        assert_eq!(
            framed(200, Version::HTTP_11, true, Version::HTTP_11),
            (1, Version::HTTP_11)
        );
        assert_eq!(
            framed(400, Version::HTTP_10, true, Version::HTTP_11),
            (1, Version::HTTP_11)
        );
        // An HTTP/1.0 client cannot take chunks; HTTP/2 frames bodies itself.
        assert_eq!(framed(200, Version::HTTP_11, true, Version::HTTP_10).0, 0);
        assert_eq!(framed(200, Version::HTTP_11, true, Version::HTTP_2).0, 0);
        // No length was removed (Pingora framed it already), or there is no body.
        assert_eq!(framed(200, Version::HTTP_11, false, Version::HTTP_11).0, 0);
        assert_eq!(framed(204, Version::HTTP_11, true, Version::HTTP_11).0, 0);
        assert_eq!(framed(304, Version::HTTP_11, true, Version::HTTP_11).0, 0);
        // A stream chunked already stays chunked once.
        let mut response = ResponseHeader::build(200, None).unwrap();
        response
            .insert_header("transfer-encoding", "chunked")
            .unwrap();
        frame_rewritten(&mut response, true, Version::HTTP_11).unwrap();
        assert_eq!(
            response.headers.get_all("transfer-encoding").iter().count(),
            1
        );
    }

    #[test]
    fn a_native_stream_names_the_clients_alias_in_every_event_split_anywhere() {
        let events = concat!(
            "data: {\"id\":\"c1\",\"model\":\"org/served\",\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n",
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"model\":\"org/served\",\"content\":[]}}\n\n",
            "data: {\"model\":\"someone-else\",\"choices\":[]}\n\n",
            "data: [DONE]\n\n",
        );
        for cut in [1, 7, 40, 90, events.len() - 1] {
            let mut answer = answer();
            head(&mut answer, true);
            let mut out = Vec::new();
            for piece in [&events[..cut], &events[cut..]] {
                let mut body = Some(Bytes::copy_from_slice(piece.as_bytes()));
                answer.body(&mut body, false, "alias");
                out.extend_from_slice(&body.unwrap_or_default());
            }
            let mut rest = None;
            answer.body(&mut rest, true, "alias");
            out.extend_from_slice(&rest.unwrap_or_default());
            let text = String::from_utf8(out).unwrap();
            assert_eq!(
                text,
                events.replace("\"org/served\"", "\"alias\""),
                "cut at {cut}"
            );
        }
    }

    /// The pieces of a stream, in order, that carry its first output.
    fn first_outputs(opens_with_events: bool, pieces: &[&str]) -> Vec<usize> {
        first_output_of(opens_with_events, pieces).0
    }

    /// [`first_outputs`], and whether the first output was an error.
    fn first_output_of(opens_with_events: bool, pieces: &[&str]) -> (Vec<usize>, bool) {
        let mut answer = answer();
        answer.opens_with_events = opens_with_events;
        let mut response = ResponseHeader::build(200, None).unwrap();
        response
            .insert_header("content-type", "text/event-stream")
            .unwrap();
        answer
            .head(
                &mut response,
                Translation::None,
                Delivery::Stream,
                Naming {
                    client: "m",
                    upstream: "m",
                    within: Some(ALIAS_HEAD_BYTES),
                },
                ClientFormat::OpenAi,
            )
            .unwrap();
        let firsts = pieces
            .iter()
            .enumerate()
            .filter_map(|(i, piece)| {
                let mut body = Some(Bytes::copy_from_slice(piece.as_bytes()));
                answer.body(&mut body, false, "m").then_some(i)
            })
            .collect();
        (firsts, answer.first_was_error)
    }

    #[test]
    fn keep_alives_and_split_lines_are_no_output_until_a_line_ends() {
        // Comments and blank lines (keep-alives an intermediary sends while the worker
        // prefills) are no output; a data line is, once it ends.
        assert_eq!(
            first_outputs(
                false,
                &[
                    ": ping\n\n",
                    "\r\n",
                    ": pi",
                    "ng\n",
                    "data: {\"id\"",
                    ":1}\n\n"
                ]
            ),
            [5]
        );
        // A Responses stream whose opening event is split inside its name.
        let pieces = [
            "event: response.in_pro",
            "gress\ndata: {}\n\n",
            "event: response.output_text.delta\ndata: {}\n\n",
        ];
        assert_eq!(first_outputs(true, &pieces), [2]);
        // A whole answer (no event stream): its first byte.
        let mut answer = answer();
        let mut response = ResponseHeader::build(200, None).unwrap();
        answer
            .head(
                &mut response,
                Translation::None,
                Delivery::Whole,
                Naming {
                    client: "m",
                    upstream: "m",
                    within: None,
                },
                ClientFormat::OpenAi,
            )
            .unwrap();
        let mut body = Some(Bytes::from_static(b": not an event stream"));
        assert!(answer.body(&mut body, false, "m"));
    }

    #[test]
    fn an_error_event_before_any_token_is_an_erring_first_output() {
        // vLLM's error chunk in a 200 stream, and an older server's.
        for error in [
            "data: {\"error\": {\"message\": \"boom\", \"code\": 500}}\n\n",
            "data: {\"object\": \"error\", \"message\": \"boom\"}\n\n",
        ] {
            assert_eq!(first_output_of(false, &[error]), (vec![0], true), "{error}");
        }
        // The Responses API's.
        assert_eq!(
            first_output_of(
                true,
                &[
                    "event: response.created\ndata: {}\n\n",
                    "event: response.failed\ndata: {}\n\n"
                ]
            ),
            (vec![1], true)
        );
        // A token whose text mentions an error is output.
        assert_eq!(
            first_output_of(
                false,
                &["data: {\"choices\":[{\"delta\":{\"content\":\"error\"}}]}\n\n"]
            ),
            (vec![0], false)
        );
    }

    #[test]
    fn a_responses_stream_shows_output_after_its_opening_events() {
        // vLLM: created and in_progress as soon as the request is accepted, then the output.
        let pieces = [
            "event: response.created\ndata: {\"response\":{\"instructions\":\"event: response.output_text.delta\"},\"type\":\"response.created\"}\n\n",
            "event: response.in_progress\n",
            "data: {\"type\":\"response.in_progress\"}\n\n",
            "event: response.output_item.added\r\ndata: {}\r\n\r\n",
            "event: response.output_text.delta\ndata: {}\n\n",
        ];
        assert_eq!(first_outputs(true, &pieces), [3]);
        // Any other stream: its first piece.
        assert_eq!(first_outputs(false, &pieces), [0]);
        // A stream that names no events: its first piece too.
        assert_eq!(
            first_outputs(
                true,
                &["data: {\"type\":\"response.created\"}\n\n", "data: {}\n\n"]
            ),
            [0]
        );
        // An error before any output is the first output.
        assert_eq!(
            first_outputs(
                true,
                &[
                    "event: response.created\ndata: {}\n\n",
                    "event: error\ndata: {}\n\n"
                ]
            ),
            [1]
        );
    }

    #[test]
    fn a_whole_native_answer_names_the_clients_alias() {
        let mut answer = answer();
        head(&mut answer, false);
        // Held only until the model shows; then everything passes as it arrives.
        let mut body = Some(Bytes::from_static(br#"{"id":"x","model": "org/ser"#));
        answer.body(&mut body, false, "alias");
        assert!(body.is_none(), "held until the model is whole");
        let mut body = Some(Bytes::from_static(br#"ved","choices":["#));
        answer.body(&mut body, false, "alias");
        assert_eq!(
            &body.unwrap()[..],
            br#"{"id":"x","model": "alias","choices":["#
        );
        let mut body = Some(Bytes::from_static(b"]}"));
        answer.body(&mut body, true, "alias");
        assert_eq!(&body.unwrap()[..], b"]}");
        // Not JSON (or no model): as it came.
        let mut answer = Answer::new(UsageTap::new(false, false));
        head(&mut answer, false);
        let mut body = Some(Bytes::from_static(b"upstream says no"));
        answer.body(&mut body, true, "alias");
        assert_eq!(&body.unwrap()[..], b"upstream says no");
    }
}
