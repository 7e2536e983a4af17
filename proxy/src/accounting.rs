//! Per-tenant accounting: requests, tokens (from the `usage` upstreams report, streams
//! included), time to first token and end-to-end latency, and rejections by reason, exported
//! on `/metrics`.
//!
//! Label values come from configuration only (tenant and model names, pool and provider ids),
//! never from what a client sends: an unknown model counts as `unknown`, a caller without a
//! tenant as `anonymous`. The number of series is capped besides, for configurations that
//! change names often over a long run.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use serde_json::Value;

use crate::metrics::escape;
use crate::routing::RoutingTable;
use crate::translate::find_event_end;

/// Most label combinations kept per family; later ones count under `tenant="other"`.
const MAX_SERIES: usize = 10_000;

/// Upper bounds (seconds) of the latency histograms.
pub const LATENCY_BUCKETS: [f64; 14] = [
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
];

/// Token counts an upstream reported for one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
    /// Whether any usage was seen at all.
    pub reported: bool,
}

impl Usage {
    /// Read OpenAI (`prompt_tokens`, `completion_tokens`, `prompt_tokens_details.cached_tokens`)
    /// or Anthropic (`input_tokens`, `output_tokens`, `cache_read_input_tokens`) usage; fields
    /// present overwrite earlier values (Anthropic streams report input first, output last).
    fn merge(&mut self, usage: &Value) {
        let field = |name: &str| usage.get(name).and_then(Value::as_u64);
        if let Some(prompt) = field("prompt_tokens") {
            self.prompt_tokens = prompt;
            self.reported = true;
        }
        if let Some(completion) = field("completion_tokens") {
            self.completion_tokens = completion;
            self.reported = true;
        }
        if let Some(cached) = usage
            .get("prompt_tokens_details")
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Value::as_u64)
        {
            self.cached_tokens = cached;
        }
        if let Some(input) = field("input_tokens") {
            // Anthropic counts cached input apart from `input_tokens`.
            let cached = field("cache_read_input_tokens").unwrap_or(0);
            let created = field("cache_creation_input_tokens").unwrap_or(0);
            self.prompt_tokens = input + cached + created;
            self.cached_tokens = cached;
            self.reported = true;
        }
        if let Some(output) = field("output_tokens") {
            self.completion_tokens = output;
            self.reported = true;
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
}

impl UsageTap {
    pub fn new(stream: bool, strip_injected_usage: bool) -> UsageTap {
        UsageTap {
            stream,
            strip_injected_usage,
            ..UsageTap::default()
        }
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
                && let Ok(body) = serde_json::from_slice::<Value>(&self.pending)
                && let Some(usage) = body.get("usage")
            {
                self.usage.merge(usage);
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
        if !text.contains("\"usage\"") {
            return false;
        }
        for line in text.lines() {
            let Some(data) = line.strip_prefix("data:") else {
                continue;
            };
            let Ok(value) = serde_json::from_str::<Value>(data.trim()) else {
                continue;
            };
            // Anthropic: message_start carries `message.usage`, message_delta `usage`.
            let usage = value
                .get("usage")
                .filter(|u| u.is_object())
                .or_else(|| value.get("message").and_then(|m| m.get("usage")));
            if let Some(usage) = usage.filter(|u| u.is_object()) {
                self.usage.merge(usage);
                let usage_only = value
                    .get("choices")
                    .and_then(Value::as_array)
                    .is_some_and(Vec::is_empty);
                return self.strip_injected_usage && usage_only;
            }
        }
        false
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct RequestKey {
    tenant: String,
    model: String,
    target: String,
    outcome: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct LatencyKey {
    tenant: String,
    model: String,
}

#[derive(Debug, Clone, Default)]
struct Counts {
    requests: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
    completion_tokens: u64,
}

#[derive(Debug, Clone, Default)]
pub struct Histogram {
    pub buckets: [u64; LATENCY_BUCKETS.len()],
    pub count: u64,
    pub sum: f64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        for (bucket, bound) in self.buckets.iter_mut().zip(LATENCY_BUCKETS) {
            if seconds <= bound {
                *bucket += 1;
            }
        }
        self.count += 1;
        self.sum += seconds;
    }
}

#[derive(Debug, Default)]
struct Ledger {
    requests: HashMap<RequestKey, Counts>,
    ttft: HashMap<LatencyKey, Histogram>,
    e2e: HashMap<LatencyKey, Histogram>,
    rejections: HashMap<(String, String, &'static str), u64>,
}

static LEDGER: LazyLock<Mutex<Ledger>> = LazyLock::new(Mutex::default);

fn ledger() -> std::sync::MutexGuard<'static, Ledger> {
    crate::lock(&LEDGER)
}

/// Bound a map's size: new keys past the cap are folded into `fold(key)`.
fn bounded<K: std::hash::Hash + Eq, V: Default>(
    map: &mut HashMap<K, V>,
    key: K,
    fold: impl FnOnce(K) -> K,
) -> &mut V {
    let key = if map.len() >= MAX_SERIES && !map.contains_key(&key) {
        fold(key)
    } else {
        key
    };
    map.entry(key).or_default()
}

/// The model label: a configured client-facing name, else `unknown`.
pub fn model_label(table: Option<&RoutingTable>, model: &str) -> String {
    match table {
        Some(table) if table.snapshot.models.contains_key(model) => model.to_owned(),
        _ => "unknown".to_owned(),
    }
}

fn tenant_label(tenant: Option<&str>) -> String {
    tenant.unwrap_or("anonymous").to_owned()
}

/// Count a request refused before it reached an upstream.
pub fn rejected(table: &RoutingTable, tenant: Option<&str>, model: &str, reason: &'static str) {
    count_rejection(tenant, model_label(Some(table), model), reason);
}

/// Count a rejection with no usable model name (authentication, unreadable bodies).
pub fn rejected_early(tenant: Option<&str>, reason: &'static str) {
    count_rejection(tenant, "unknown".to_owned(), reason);
}

fn count_rejection(tenant: Option<&str>, model: String, reason: &'static str) {
    let key = (tenant_label(tenant), model, reason);
    *bounded(&mut ledger().rejections, key, |(_, model, reason)| {
        ("other".to_owned(), model, reason)
    }) += 1;
}

/// One request that was routed to a target, when it ends.
#[derive(Debug, Clone)]
pub struct Finished<'a> {
    pub tenant: Option<&'a str>,
    /// Client-facing model (already a configured name).
    pub model: &'a str,
    /// `pool ns/name` or `provider ns/name`.
    pub target: &'a str,
    pub status: u16,
    pub usage: Usage,
    pub ttft: Option<Duration>,
    pub total: Duration,
}

fn outcome(status: u16) -> &'static str {
    match status {
        200..=299 => "success",
        400..=499 => "client_error",
        500..=599 => "upstream_error",
        _ => "aborted",
    }
}

pub fn finished(request: &Finished<'_>) {
    let tenant = tenant_label(request.tenant);
    let mut ledger = ledger();
    let counts = bounded(
        &mut ledger.requests,
        RequestKey {
            tenant: tenant.clone(),
            model: request.model.to_owned(),
            target: request.target.to_owned(),
            outcome: outcome(request.status),
        },
        |key| RequestKey {
            tenant: "other".to_owned(),
            ..key
        },
    );
    counts.requests += 1;
    counts.prompt_tokens += request.usage.prompt_tokens;
    counts.cached_tokens += request.usage.cached_tokens;
    counts.completion_tokens += request.usage.completion_tokens;
    let key = LatencyKey {
        tenant,
        model: request.model.to_owned(),
    };
    let fold = |key: LatencyKey| LatencyKey {
        tenant: "other".to_owned(),
        ..key
    };
    if let Some(ttft) = request.ttft
        && (200..300).contains(&request.status)
    {
        bounded(&mut ledger.ttft, key.clone(), fold).observe(ttft.as_secs_f64());
    }
    bounded(&mut ledger.e2e, key, fold).observe(request.total.as_secs_f64());
}

/// Append the accounting families in Prometheus text format.
pub fn render(out: &mut String) {
    use std::fmt::Write;
    let ledger = ledger();
    let mut requests: Vec<(&RequestKey, &Counts)> = ledger.requests.iter().collect();
    requests.sort_by(|a, b| {
        (&a.0.tenant, &a.0.model, &a.0.target, a.0.outcome).cmp(&(
            &b.0.tenant,
            &b.0.model,
            &b.0.target,
            b.0.outcome,
        ))
    });
    let labels = |key: &RequestKey| {
        format!(
            "tenant=\"{}\",model=\"{}\",target=\"{}\",outcome=\"{}\"",
            escape(&key.tenant),
            escape(&key.model),
            escape(&key.target),
            key.outcome
        )
    };
    type Family = (&'static str, &'static str, fn(&Counts) -> u64);
    let families: [Family; 4] = [
        (
            "switchyard_tenant_requests_total",
            "Requests routed to a target, by tenant, model, target and outcome.",
            |c| c.requests,
        ),
        (
            "switchyard_tenant_prompt_tokens_total",
            "Prompt tokens as the upstreams reported them.",
            |c| c.prompt_tokens,
        ),
        (
            "switchyard_tenant_cached_prompt_tokens_total",
            "Prompt tokens served from the upstream's prefix cache, as reported.",
            |c| c.cached_tokens,
        ),
        (
            "switchyard_tenant_completion_tokens_total",
            "Completion tokens as the upstreams reported them.",
            |c| c.completion_tokens,
        ),
    ];
    for (name, help, value) in families {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for (key, counts) in &requests {
            let _ = writeln!(out, "{name}{{{}}} {}", labels(key), value(counts));
        }
    }
    for (name, help, histograms) in [
        (
            "switchyard_tenant_ttft_seconds",
            "Time to the first byte of successful answers.",
            &ledger.ttft,
        ),
        (
            "switchyard_tenant_request_duration_seconds",
            "Time from the request to the end of its answer.",
            &ledger.e2e,
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut sorted: Vec<(&LatencyKey, &Histogram)> = histograms.iter().collect();
        sorted.sort_by(|a, b| (&a.0.tenant, &a.0.model).cmp(&(&b.0.tenant, &b.0.model)));
        for (key, histogram) in sorted {
            let labels = format!(
                "tenant=\"{}\",model=\"{}\"",
                escape(&key.tenant),
                escape(&key.model)
            );
            for (bound, count) in LATENCY_BUCKETS.iter().zip(histogram.buckets) {
                let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {count}");
            }
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels},le=\"+Inf\"}} {}",
                histogram.count
            );
            let _ = writeln!(out, "{name}_sum{{{labels}}} {}", histogram.sum);
            let _ = writeln!(out, "{name}_count{{{labels}}} {}", histogram.count);
        }
    }
    let name = "switchyard_tenant_rejections_total";
    let _ = writeln!(
        out,
        "# HELP {name} Requests refused before reaching a target, by reason.\n# TYPE {name} counter"
    );
    let mut rejections: Vec<(&(String, String, &'static str), &u64)> =
        ledger.rejections.iter().collect();
    rejections.sort();
    for ((tenant, model, reason), count) in rejections {
        let _ = writeln!(
            out,
            "{name}{{tenant=\"{}\",model=\"{}\",reason=\"{reason}\"}} {count}",
            escape(tenant),
            escape(model)
        );
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
                reported: true
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
                reported: true
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
