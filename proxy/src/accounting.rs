//! What an answer says it cost: the token `usage` upstreams report (whole answers and streams,
//! OpenAI or Anthropic), read on the way to the client by a [`UsageTap`]. The per-tenant
//! families it feeds live in [`crate::metrics`].

use bytes::{Bytes, BytesMut};

use crate::translate::find_event_end;
use crate::wire::answer::{self, AnswerUsage, StreamData, UsageFields};

/// Token counts an upstream reported for one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
    /// Whether any usage was seen at all.
    pub reported: bool,
    /// Whether `cached_tokens` was reported (vLLM gives it with `--enable-prompt-tokens-details`).
    pub cached_reported: bool,
}

impl Usage {
    /// Take OpenAI (`prompt_tokens`, `completion_tokens`, `prompt_tokens_details.cached_tokens`)
    /// or Anthropic (`input_tokens`, `output_tokens`, `cache_read_input_tokens`) usage; fields
    /// present overwrite earlier values (Anthropic streams report input first, output last).
    fn merge(&mut self, usage: &UsageFields) {
        if let Some(prompt) = usage.prompt_tokens {
            self.prompt_tokens = prompt;
            self.reported = true;
        }
        if let Some(completion) = usage.completion_tokens {
            self.completion_tokens = completion;
            self.reported = true;
        }
        if let Some(cached) = usage.cached_tokens() {
            self.cached_tokens = cached;
            self.cached_reported = true;
        }
        if let Some(input) = usage.input_tokens {
            // Anthropic counts cached input apart from `input_tokens`.
            let cached = usage.cache_read_input_tokens.unwrap_or(0);
            let created = usage.cache_creation_input_tokens.unwrap_or(0);
            self.prompt_tokens = input + cached + created;
            self.cached_tokens = cached;
            self.cached_reported |= usage.cache_read_input_tokens.is_some();
            self.reported = true;
        }
        if let Some(output) = usage.output_tokens {
            self.completion_tokens = output;
            self.reported = true;
        }
        // Responses API: `input_tokens` includes the cached ones, given apart in details.
        if let Some(cached) = usage
            .input_tokens_details
            .as_ref()
            .and_then(|d| d.cached_tokens)
        {
            self.cached_tokens = cached;
            self.cached_reported = true;
        }
    }
}

/// Largest non-streamed answer read for its usage (larger ones pass through uncounted).
const MAX_WHOLE_BODY: usize = 8 * 1024 * 1024;

/// Watches the bytes going to the client for `usage`, and removes the usage-only chunk the
/// proxy asked for on the client's behalf (`stream_options.include_usage` it did not set).
#[derive(Debug, Default)]
pub struct UsageTap {
    stream: bool,
    strip_injected_usage: bool,
    /// Stream: bytes of an event not yet complete. Whole answer: the body so far.
    pending: BytesMut,
    overflowed: bool,
    pub usage: Usage,
    /// A Responses API answer's id (`response.created`, or a whole response), until taken.
    pub response_id: Option<String>,
}

impl UsageTap {
    pub fn new(stream: bool, strip_injected_usage: bool) -> UsageTap {
        UsageTap {
            stream,
            strip_injected_usage,
            ..UsageTap::default()
        }
    }

    /// Whether the bytes the client gets may be fewer than the upstream sent (a stream's
    /// injected usage chunk removed).
    pub fn strips(&self) -> bool {
        self.stream && self.strip_injected_usage
    }

    /// Take a chunk on its way to the client; returns what to send instead.
    pub fn feed(&mut self, chunk: Bytes) -> Bytes {
        if !self.stream {
            if !self.overflowed {
                if self.pending.len() + chunk.len() > MAX_WHOLE_BODY {
                    self.overflowed = true;
                    self.pending = BytesMut::new();
                } else {
                    self.pending.extend_from_slice(&chunk);
                }
            }
            return chunk;
        }
        self.pending.extend_from_slice(&chunk);
        if !self.strip_injected_usage {
            // Nothing is removed: forward at once, read complete events on the side.
            while let Some(event) = self.next_event() {
                self.read_event(&event);
            }
            if self.pending.len() > MAX_WHOLE_BODY {
                // Not an event stream after all: stop looking rather than grow.
                self.pending = BytesMut::new();
            }
            return chunk;
        }
        let mut out = BytesMut::with_capacity(chunk.len());
        while let Some(event) = self.next_event() {
            if !self.read_event(&event) {
                out.extend_from_slice(&event);
            }
        }
        out.freeze()
    }

    /// The end of the answer: whatever is still held back, and the usage of a whole answer.
    pub fn finish(&mut self) -> Bytes {
        if !self.stream {
            if !self.overflowed
                && let Some(answer) = answer::parse::<AnswerUsage>(&self.pending)
            {
                if let Some(usage) = &answer.usage {
                    self.usage.merge(usage);
                }
                if answer.object.as_deref() == Some("response") {
                    self.response_id = answer.id;
                }
            }
            self.pending = BytesMut::new();
            return Bytes::new();
        }
        let rest = std::mem::take(&mut self.pending).freeze();
        if self.strip_injected_usage {
            rest
        } else {
            Bytes::new()
        }
    }

    /// Split one complete SSE event (terminator included, `\n\n` or `\r\n\r\n`) off `pending`.
    fn next_event(&mut self) -> Option<BytesMut> {
        let (end, separator) = find_event_end(&self.pending)?;
        Some(self.pending.split_to(end + separator))
    }

    /// Read an event's usage. Returns true when the event is the injected usage-only chunk
    /// that must not reach the client.
    fn read_event(&mut self, event: &[u8]) -> bool {
        let Ok(text) = std::str::from_utf8(event) else {
            return false;
        };
        let created = text.contains("\"response.created\"");
        if !text.contains("\"usage\"") && !created {
            return false;
        }
        for line in text.lines() {
            let Some(data) = line.strip_prefix("data:") else {
                continue;
            };
            let Some(payload) = answer::parse::<StreamData<'_>>(data.trim().as_bytes()) else {
                continue;
            };
            if created
                && payload.kind.as_deref() == Some("response.created")
                && let Some(id) = payload.response.as_ref().and_then(|r| r.id.as_deref())
            {
                self.response_id = Some(id.to_owned());
            }
            // Anthropic: message_start carries `message.usage`, message_delta `usage`.
            if let Some(usage) = payload.reported_usage() {
                self.usage.merge(usage);
                let usage_only = payload.choices.as_ref().is_some_and(Vec::is_empty);
                return self.strip_injected_usage && usage_only;
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_stream_usage_is_read_and_the_injected_chunk_removed() {
        let mut tap = UsageTap::new(true, true);
        let events = [
            "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":11,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\n",
            "data: [DONE]\n\n",
        ];
        let all = events.concat();
        // Split at awkward places: inside events and inside the terminator.
        let mut out = BytesMut::new();
        for piece in [
            &all[..10],
            &all[10..60],
            &all[60..all.len() - 1],
            &all[all.len() - 1..],
        ] {
            out.extend_from_slice(&tap.feed(Bytes::copy_from_slice(piece.as_bytes())));
        }
        out.extend_from_slice(&tap.finish());
        let expected = [events[0], events[1], events[3]].concat();
        assert_eq!(String::from_utf8_lossy(&out), expected);
        assert_eq!(
            tap.usage,
            Usage {
                prompt_tokens: 11,
                cached_tokens: 8,
                completion_tokens: 2,
                reported: true,
                cached_reported: true,
            }
        );
    }

    #[test]
    fn crlf_events_are_read_and_stripped_too() {
        let mut tap = UsageTap::new(true, true);
        let text = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\r\n\r\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\r\n\r\ndata: [DONE]\r\n\r\n";
        let out = tap.feed(Bytes::from(text));
        assert_eq!(
            out,
            Bytes::from(
                "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\r\n\r\ndata: [DONE]\r\n\r\n"
            )
        );
        assert!(tap.usage.reported);
    }

    #[test]
    fn usage_the_client_asked_for_passes_through_untouched() {
        let mut tap = UsageTap::new(true, false);
        let chunk = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4}}\n\ndata: [DONE]\n\n";
        let out = tap.feed(Bytes::from(chunk));
        assert_eq!(out, Bytes::from(chunk));
        assert_eq!(tap.finish(), Bytes::new());
        assert_eq!(
            (tap.usage.prompt_tokens, tap.usage.completion_tokens),
            (3, 4)
        );
    }

    #[test]
    fn responses_api_usage_and_ids_are_read() {
        let mut tap = UsageTap::new(true, false);
        let created = "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_7\",\"model\":\"m\",\"usage\":null}}\n\n";
        let done = "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_7\",\"usage\":{\"input_tokens\":30,\"input_tokens_details\":{\"cached_tokens\":16},\"output_tokens\":5,\"total_tokens\":35}}}\n\n";
        let all = format!("{created}{done}");
        // Split inside the first event: the id is known once it is whole.
        tap.feed(Bytes::copy_from_slice(&all.as_bytes()[..40]));
        assert_eq!(tap.response_id, None);
        tap.feed(Bytes::copy_from_slice(&all.as_bytes()[40..]));
        assert_eq!(tap.response_id.as_deref(), Some("resp_7"));
        assert_eq!(
            tap.usage,
            Usage {
                prompt_tokens: 30,
                cached_tokens: 16,
                completion_tokens: 5,
                reported: true,
                cached_reported: true,
            }
        );
        let mut whole = UsageTap::new(false, false);
        whole.feed(Bytes::from(
            r#"{"id":"resp_9","object":"response","usage":{"input_tokens":4,"output_tokens":2}}"#,
        ));
        whole.finish();
        assert_eq!(whole.response_id.as_deref(), Some("resp_9"));
        assert_eq!(
            (whole.usage.prompt_tokens, whole.usage.completion_tokens),
            (4, 2)
        );
        // Another API's answer has no response id.
        let mut chat = UsageTap::new(false, false);
        chat.feed(Bytes::from(
            r#"{"id":"chatcmpl-1","object":"chat.completion"}"#,
        ));
        chat.finish();
        assert_eq!(chat.response_id, None);
    }

    #[test]
    fn anthropic_streams_and_whole_answers() {
        let mut tap = UsageTap::new(true, false);
        tap.feed(Bytes::from("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":5,\"cache_read_input_tokens\":20,\"output_tokens\":1}}}\n\n"));
        tap.feed(Bytes::from("event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":9}}\n\n"));
        assert_eq!(
            tap.usage,
            Usage {
                prompt_tokens: 25,
                cached_tokens: 20,
                completion_tokens: 9,
                reported: true,
                cached_reported: true,
            }
        );
        let mut whole = UsageTap::new(false, false);
        let body = "{\"id\":\"x\",\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3}}";
        assert_eq!(whole.feed(Bytes::from(&body[..5])), Bytes::from(&body[..5]));
        whole.feed(Bytes::from(&body[5..]));
        whole.finish();
        assert_eq!(
            (whole.usage.prompt_tokens, whole.usage.completion_tokens),
            (7, 3)
        );
    }
}
