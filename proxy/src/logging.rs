//! Log set-up: `tracing` to stderr (text or JSON), with Pingora's own `log` lines brought in at
//! the level an operator would give them.
//!
//! Pingora writes through the `log` crate and calls some things errors that are not the
//! gateway's: a client that hangs up mid-stream ("Fail to proxy: Downstream ConnectionClosed"),
//! two requests racing for one pooled keep-alive connection ("failed to acquire reusable
//! stream"). The proxy's own hooks already suppress Pingora's per-request error line and log each
//! request once, at a level chosen from who failed (see `Gateway::logging`); the bridge here
//! lowers the remaining lines Pingora emits on its own, so that warn and above mean something
//! for the gateway or its upstreams.
//!
//! Pingora's debug and trace lines dump header maps and body chunks: credentials (the provider
//! key the gateway adds, cookies) and bodies are redacted from every Pingora line, and the HTTP
//! and TLS libraries below log at info at most, so `RUST_LOG=debug` never writes a key, a cookie,
//! a prompt or a completion.
//!
//! Levels, as the README documents them:
//! - error: the gateway itself failed (an internal error answering a request, a broken config
//!   that cannot be served at start).
//! - warn: an upstream failed (a worker refused or timed out, a provider answered 5xx), a
//!   config edit was refused, a KV event stream lost events.
//! - info: one line per request, start-up, config swaps, clients that hung up.
//! - debug: routing decisions, retries on stale pooled connections, client-side protocol noise.

use std::borrow::Cow;
use std::sync::LazyLock;

use log::{Level, Log, Metadata, Record};
use regex::Regex;
use tracing_log::LogTracer;

/// Libraries whose own debug and trace lines can carry headers or bodies: they log at info at
/// most, whatever `RUST_LOG` says (Pingora's lines are redacted instead, see [`redact`]).
const QUIET_LIBRARIES: &[&str] = &["h2", "hyper", "hyper_util", "reqwest", "rustls", "tonic"];

/// Header values that are credentials, in the `Debug` dumps of header maps Pingora logs.
static CREDENTIAL_HEADERS: LazyLock<Option<Regex>> = LazyLock::new(|| {
    Regex::new(
        r#"(?i)"(authorization|proxy-authorization|x-api-key|api-key|cookie|set-cookie)": "(?:[^"\\]|\\.)*""#,
    )
    .ok()
});

/// Byte strings (`b"..."`): bodies of requests and answers, prompts and completions included.
static BYTE_STRINGS: LazyLock<Option<Regex>> =
    LazyLock::new(|| Regex::new(r#"b"(?:[^"\\]|\\.)*""#).ok());

/// A Pingora log message with credentials and bodies taken out: at debug and trace it dumps
/// whole header maps (the provider key the gateway added, cookies) and body chunks.
pub fn redact(message: &str) -> Cow<'_, str> {
    let mut message = Cow::Borrowed(message);
    if let Some(headers) = CREDENTIAL_HEADERS.as_ref()
        && headers.is_match(&message)
    {
        message = Cow::Owned(
            headers
                .replace_all(&message, "\"$1\": \"<redacted>\"")
                .into_owned(),
        );
    }
    if let Some(bytes) = BYTE_STRINGS.as_ref()
        && bytes.is_match(&message)
    {
        message = Cow::Owned(bytes.replace_all(&message, "b\"<redacted>\"").into_owned());
    }
    message
}

/// Pingora messages (by prefix) that are not failures of the gateway, with the level they get.
/// The first match wins; messages not listed keep Pingora's own level.
const PINGORA_LEVELS: &[(&str, Level)] = &[
    // Two requests raced for one pooled upstream connection; the loser opens a new one.
    ("failed to acquire reusable stream", Level::Debug),
    // The client went away before its error answer could be written.
    ("failed to send error response to downstream", Level::Debug),
    // The client closed its connection while the answer was being streamed to it.
    ("Error finish sending body to downstream", Level::Debug),
    ("send error, draining read buf", Level::Debug),
    ("Peer sent more data than expected", Level::Debug),
];

/// The level a `log` record from Pingora is shown at.
pub fn pingora_level(target: &str, message: &str, level: Level) -> Level {
    if !target.starts_with("pingora") {
        return level;
    }
    if let Some((_, lowered)) = PINGORA_LEVELS
        .iter()
        .find(|(prefix, _)| message.starts_with(prefix))
    {
        return (*lowered).max(level);
    }
    // "Fail to proxy: <error>, ..." names where the error came from; one caused by the client
    // (it closed the connection, sent a broken request) is the client's business.
    if message.starts_with("Fail to proxy:") && message.contains(" Downstream ") {
        return Level::Info.max(level);
    }
    level
}

/// Forwards `log` records to `tracing`, at the level [`pingora_level`] gives them.
struct PingoraBridge {
    tracer: LogTracer,
}

impl Log for PingoraBridge {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        // Levels are only ever lowered, so a record disabled at its own level stays disabled.
        self.tracer.enabled(metadata)
    }

    fn log(&self, record: &Record<'_>) {
        let raw = record.args().to_string();
        let message = if record.target().starts_with("pingora") {
            redact(&raw)
        } else {
            Cow::Borrowed(raw.as_str())
        };
        let level = pingora_level(record.target(), &message, record.level());
        if level == record.level() && message == raw {
            self.tracer.log(record);
            return;
        }
        self.tracer.log(
            &Record::builder()
                .args(format_args!("{message}"))
                .level(level)
                .target(record.target())
                .module_path(record.module_path())
                .file(record.file())
                .line(record.line())
                .build(),
        );
    }

    fn flush(&self) {
        self.tracer.flush();
    }
}

/// Install the global subscriber (filter from `RUST_LOG`, else info with Pingora at warn) and
/// the bridge for `log` records.
pub fn init(json: bool) {
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,pingora_core=warn,pingora_proxy=warn")
    });
    for library in QUIET_LIBRARIES {
        if let Ok(directive) = format!("{library}=info").parse() {
            filter = filter.add_directive(directive);
        }
    }
    let max_level = filter
        .max_level_hint()
        .map(|level| tracing_log::AsLog::as_log(&level))
        .unwrap_or(log::LevelFilter::Trace);
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let installed = if json {
        tracing::subscriber::set_global_default(builder.json().finish())
    } else {
        tracing::subscriber::set_global_default(builder.finish())
    };
    if installed.is_err() {
        return;
    }
    let bridge = PingoraBridge {
        tracer: LogTracer::new(),
    };
    if log::set_boxed_logger(Box::new(bridge)).is_ok() {
        log::set_max_level(max_level);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pingora_noise_is_lowered() {
        assert_eq!(
            pingora_level(
                "pingora_core::connectors",
                "failed to acquire reusable stream",
                Level::Error
            ),
            Level::Debug
        );
        assert_eq!(
            pingora_level(
                "pingora_proxy",
                "Fail to proxy: Downstream ConnectionClosed context: while reading, status: 0",
                Level::Error
            ),
            Level::Info
        );
        assert_eq!(
            pingora_level(
                "pingora_proxy::proxy_h1",
                "Error finish sending body to downstream: Downstream WriteError",
                Level::Error
            ),
            Level::Debug
        );
    }

    #[test]
    fn real_failures_keep_their_level() {
        assert_eq!(
            pingora_level(
                "pingora_proxy",
                "Fail to proxy: Upstream ConnectRefused context: worker 10.0.0.7:8000",
                Level::Error
            ),
            Level::Error
        );
        // Only Pingora's lines are touched.
        assert_eq!(
            pingora_level(
                "switchyard_proxy",
                "failed to acquire reusable stream",
                Level::Error
            ),
            Level::Error
        );
        // Never raised.
        assert_eq!(
            pingora_level(
                "pingora_core::connectors",
                "failed to acquire reusable stream",
                Level::Trace
            ),
            Level::Trace
        );
    }

    #[test]
    fn credentials_and_bodies_are_redacted_from_pingoras_dumps() {
        let dump = r#"Sending header to upstream RequestHeader { headers: {"accept": "*/*", "authorization": "Bearer sk-provider-SECRET", "x-api-key": "sk-ant", "Cookie": "a=\"b\"", "x-request-id": "r1"} }"#;
        let redacted = redact(dump);
        for secret in ["sk-provider-SECRET", "sk-ant", "a=\\\"b"] {
            assert!(!redacted.contains(secret), "{secret} in {redacted}");
        }
        assert!(
            redacted.contains(r#""authorization": "<redacted>""#),
            "{redacted}"
        );
        assert!(redacted.contains(r#""x-request-id": "r1""#), "{redacted}");
        let body = r#"upstream event: Some(Body(Some(b"{\"content\": \"COMPLETION\"}"), false))"#;
        let redacted = redact(body);
        assert!(!redacted.contains("COMPLETION"), "{redacted}");
        assert!(redacted.contains(r#"b"<redacted>""#), "{redacted}");
        // Nothing to hide: no copy.
        assert!(matches!(
            redact("failed to acquire reusable stream"),
            Cow::Borrowed(_)
        ));
    }
}
