//! The upstream's answer on its way to the client: translated into the client's API when the
//! target speaks another, its usage read (and the usage chunk the gateway asked for removed),
//! and its first byte timed.

use std::time::Instant;

use bytes::{Bytes, BytesMut};
use pingora_http::ResponseHeader;

use crate::accounting::UsageTap;
use crate::plan::Translation;
use crate::translate::{self, StreamTranslator};
use crate::translate_openai::{self, MessagesStreamTranslator};

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

impl StreamTranslation for MessagesStreamTranslator {
    fn feed(&mut self, chunk: &[u8]) -> Bytes {
        MessagesStreamTranslator::feed(self, chunk)
    }
    fn finish(&mut self) -> Bytes {
        MessagesStreamTranslator::finish(self)
    }
}

/// Translates a whole successful answer: upstream body and the client's model name in.
type AnswerFn = fn(&[u8], &str) -> Bytes;
/// Translates a whole error body: status and upstream body in.
type ErrorFn = fn(u16, &[u8]) -> Bytes;

#[derive(Debug, Default)]
enum Mode {
    #[default]
    PassThrough,
    /// Buffer the whole answer and translate it at the end (non-streaming, or an error status).
    TranslateWhole {
        buffer: BytesMut,
        status: u16,
        /// A successful answer, in the client's API.
        answer: AnswerFn,
        /// An error body, in the client's error format.
        error: ErrorFn,
    },
    TranslateStream(Box<dyn StreamTranslation>),
}

/// The state of an answer.
#[derive(Debug)]
pub struct Answer {
    mode: Mode,
    /// Reads `usage` from the answer (and removes the usage chunk the proxy asked for).
    pub usage: UsageTap,
    /// When the first byte of the answer went to the client.
    pub first_byte: Option<Instant>,
}

impl Answer {
    pub fn new(usage: UsageTap) -> Answer {
        Answer {
            mode: Mode::PassThrough,
            usage,
            first_byte: None,
        }
    }
}

impl Answer {
    /// The upstream's response head (`status`), for a client of the other API when `translate`
    /// says so.
    pub fn head(
        &mut self,
        response: &mut ResponseHeader,
        translate: Translation,
        stream: bool,
        client_model: &str,
    ) -> pingora_error::Result<()> {
        let status = response.status.as_u16();
        if translate == Translation::None {
            return Ok(());
        }
        response.remove_header(&http::header::CONTENT_LENGTH);
        self.mode = if stream && status < 400 {
            response.insert_header(http::header::CONTENT_TYPE, "text/event-stream")?;
            Mode::TranslateStream(match translate {
                Translation::ChatToMessages => {
                    Box::new(MessagesStreamTranslator::new(client_model))
                }
                _ => Box::new(StreamTranslator::new(client_model)),
            })
        } else {
            response.insert_header(http::header::CONTENT_TYPE, "application/json")?;
            let (answer, error): (AnswerFn, ErrorFn) = match translate {
                Translation::ChatToMessages => (
                    translate_openai::message_response_to_chat,
                    translate_openai::error_to_openai,
                ),
                _ => (
                    translate::chat_response_to_message,
                    translate::error_to_anthropic,
                ),
            };
            Mode::TranslateWhole {
                buffer: BytesMut::new(),
                status,
                answer,
                error,
            }
        };
        Ok(())
    }

    /// A piece of the upstream's body, made the client's. Returns `true` when it carries the
    /// answer's first byte.
    pub fn body(
        &mut self,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        client_model: &str,
    ) -> bool {
        match &mut self.mode {
            Mode::PassThrough => {}
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
            Mode::TranslateWhole {
                buffer,
                status,
                answer,
                error,
            } => {
                if let Some(chunk) = body.take() {
                    buffer.extend_from_slice(&chunk);
                }
                if end_of_stream {
                    *body = Some(if *status >= 400 {
                        error(*status, buffer)
                    } else {
                        answer(buffer, client_model)
                    });
                }
            }
        }
        let mut first = false;
        if let Some(chunk) = body.take() {
            if self.first_byte.is_none() && !chunk.is_empty() {
                self.first_byte = Some(Instant::now());
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
        first
    }
}
