//! Client connections, before and between requests: how many are open (in total and per client
//! address), how long a request head may take, and what a client hears when its head is refused.
//!
//! Pingora reads a request head before any [`pingora_proxy::ProxyHttp`] hook runs, with no
//! deadline for the whole head and an empty 400 for a malformed one. [`Guarded`] wraps the HTTP
//! application as the listener's [`ServerApp`]:
//!
//! - a connection over `--max-connections` (or `--max-connections-per-client` from one address)
//!   is answered 503 and closed at once;
//! - the first request head on a connection is read here, within `--header-timeout-s` and
//!   `--max-header-bytes`, and a malformed one (too many fields, conflicting `Content-Length`,
//!   a request line that is not HTTP) is answered in the client's API format (the path is read
//!   from the request line when it can be) with `Connection: close`; a good head is handed to
//!   Pingora unchanged, with whatever body bytes came with it;
//! - a kept-alive connection must start its next head within `--idle-timeout-s` and finish it
//!   `--header-timeout-s` later, or it is closed (nothing has been read as a request yet, so
//!   nothing in flight is lost). The gateway marks each head as read in
//!   `ProxyHttp::on_connection_reuse` through [`head_read`];
//! - HTTP/1.1 pipelining is on: requests sent back to back on one connection are answered in order.
//!
//! Bodies have their own deadline (`--body-timeout-s`) where the gateway reads them.

use std::any::Any;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::BytesMut;
use pingora_core::apps::{HttpServerApp, ServerApp};
use pingora_core::protocols::Stream;
use pingora_core::protocols::http::ServerSession;
use pingora_core::protocols::l4::stream::Stream as L4Stream;
use pingora_core::server::ShutdownWatch;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::api::{ApiError, ErrorKind, client_format_for_path};
use crate::metrics::Metrics;

/// The HTTP/2 connection preface a cleartext HTTP/2 client opens with.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Header fields Pingora parses at most; a head with more is refused here with 431.
const MAX_HEADER_FIELDS: usize = 256;
/// How long writing a refusal may take before the connection is dropped anyway.
const REFUSAL_WRITE_TIMEOUT: Duration = Duration::from_secs(2);

/// Connection limits and deadlines (flags of `switchyard-proxy`).
#[derive(Debug, Clone)]
pub struct ConnectionSettings {
    /// Longest time from a connection's opening (or the first byte of a kept-alive connection's
    /// next request) to the end of the request head.
    pub header_timeout: Duration,
    /// Longest wait for the next request on a kept-alive connection.
    pub idle_timeout: Duration,
    /// Largest request head, in bytes.
    pub max_header_bytes: usize,
    /// Open client connections at most, in total (0: no limit).
    pub max_connections: usize,
    /// Open client connections at most from one IP address (0: no limit).
    pub max_connections_per_client: usize,
    /// Answer HTTP/2 prior-knowledge (h2c) clients.
    pub h2c: bool,
}

impl Default for ConnectionSettings {
    fn default() -> Self {
        ConnectionSettings {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_header_bytes: 64 * 1024,
            max_connections: 10_000,
            max_connections_per_client: 1_000,
            h2c: true,
        }
    }
}

/// Open connections, in total and per client address.
#[derive(Debug, Default)]
struct OpenConnections {
    total: AtomicUsize,
    per_client: Mutex<HashMap<IpAddr, usize>>,
}

/// One open connection's place in [`OpenConnections`], given back when dropped.
struct Slot<'a> {
    open: &'a OpenConnections,
    client: Option<IpAddr>,
}

impl OpenConnections {
    fn admit<'a>(
        &'a self,
        client: Option<IpAddr>,
        settings: &ConnectionSettings,
    ) -> Result<Slot<'a>, &'static str> {
        let total = self.total.fetch_add(1, Ordering::AcqRel) + 1;
        let mut slot = Slot {
            open: self,
            client: None,
        };
        if settings.max_connections > 0 && total > settings.max_connections {
            return Err("total_limit");
        }
        let Some(ip) = client else {
            return Ok(slot);
        };
        let mut per_client = crate::lock(&self.per_client);
        let count = per_client.entry(ip).or_default();
        if settings.max_connections_per_client > 0 && *count >= settings.max_connections_per_client
        {
            return Err("client_limit");
        }
        *count += 1;
        slot.client = Some(ip);
        Ok(slot)
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.open.total.fetch_sub(1, Ordering::AcqRel);
        if let Some(ip) = self.client {
            let mut per_client = crate::lock(&self.open.per_client);
            if let Some(count) = per_client.get_mut(&ip) {
                *count -= 1;
                if *count == 0 {
                    per_client.remove(&ip);
                }
            }
        }
    }
}

/// The listener's application: `app` behind the limits and deadlines of [`ConnectionSettings`],
/// counting connections (open, refused) into `metrics`.
pub struct Guarded<A> {
    app: Arc<A>,
    settings: ConnectionSettings,
    open: OpenConnections,
    metrics: Arc<Metrics>,
}

impl<A> Guarded<A> {
    pub fn new(app: A, settings: ConnectionSettings, metrics: Arc<Metrics>) -> Guarded<A> {
        Guarded {
            app: Arc::new(app),
            settings,
            open: OpenConnections::default(),
            metrics,
        }
    }
}

#[async_trait]
impl<A> ServerApp for Guarded<A>
where
    A: HttpServerApp + Send + Sync + 'static,
{
    async fn process_new(
        self: &Arc<Self>,
        mut stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        let client = stream
            .get_socket_digest()
            .and_then(|digest| digest.peer_addr().and_then(|a| a.as_inet()).map(|a| a.ip()));
        let _slot = match self.open.admit(client, &self.settings) {
            Ok(slot) => slot,
            Err(reason) => {
                self.metrics.connection_refused(reason);
                let error = ApiError::new(
                    ErrorKind::Unavailable,
                    "too_many_connections",
                    "the gateway has too many open connections; retry shortly",
                );
                refuse(&mut stream, error, None, &[("retry-after", "1")]).await;
                return None;
            }
        };
        let _open = self.metrics.connection_opened();

        let h2c = self.settings.h2c && stream.get_ssl_digest().is_none();
        let head = match read_head(&mut stream, &self.settings, h2c).await {
            Ok(Head::Http1(head)) => head,
            Ok(Head::Http2(preface)) => {
                // Give the preface back and let Pingora speak HTTP/2 (cleartext connections
                // are Pingora's L4 streams, which can take bytes back).
                let mut l4 = match stream.into_any().downcast::<L4Stream>() {
                    Ok(l4) => l4,
                    Err(_) => return None,
                };
                l4.rewind(&preface);
                let stream: Stream = l4;
                return ServerApp::process_new(&self.app, stream, shutdown).await;
            }
            Err(HeadError::Closed) => return None,
            Err(HeadError::Silent) => {
                self.metrics.connection_refused("head_timeout");
                return None;
            }
            Err(HeadError::Refused {
                reason,
                error,
                path,
            }) => {
                self.metrics.connection_refused(reason);
                refuse(&mut stream, error, path.as_deref(), &[]).await;
                return None;
            }
        };
        let mut session = ServerSession::new_http1(stream);
        session.set_pipelined_prefix(head);
        session.set_pipelining_enabled(true);
        self.keepalive(&mut session, shutdown);
        let mut served = self.app.process_new_http(session, shutdown).await;
        while let Some((stream, settings)) = served.map(|reused| reused.consume()) {
            let mut session = ServerSession::new_http1(stream);
            if let Some(settings) = settings {
                settings.apply_to_session(&mut session);
            }
            self.keepalive(&mut session, shutdown);
            served = self.next_request(session, shutdown).await?;
        }
        None
    }

    async fn cleanup(&self) {
        ServerApp::cleanup(&*self.app).await;
    }
}

impl<A> Guarded<A>
where
    A: HttpServerApp + Send + Sync + 'static,
{
    fn keepalive(&self, session: &mut ServerSession, shutdown: &ShutdownWatch) {
        if *shutdown.borrow() {
            session.set_keepalive(None);
        } else {
            session.set_keepalive(Some(self.settings.idle_timeout.as_secs().max(1)));
        }
        session.set_keepalive_reuses_remaining(
            self.app
                .server_options()
                .and_then(|options| options.keepalive_request_limit),
        );
    }

    /// Serve the next request of a kept-alive connection, dropping the connection when its head
    /// is not read by the deadline. `None` when the deadline passed.
    async fn next_request(
        &self,
        mut session: ServerSession,
        shutdown: &ShutdownWatch,
    ) -> Option<Option<pingora_core::apps::ReusedHttpStream>> {
        let signal = Arc::new(HeadSignal::default());
        session.set_connection_user_context(Some(Box::new(signal.clone())));
        let deadline = Instant::now() + self.settings.idle_timeout + self.settings.header_timeout;
        let served = self.app.process_new_http(session, shutdown);
        tokio::pin!(served);
        tokio::select! {
            biased;
            served = &mut served => Some(served),
            () = signal.expired(deadline) => {
                self.metrics.connection_refused("head_timeout");
                None
            }
        }
    }
}

/// Set once the gateway has a request's head (see [`head_read`]).
#[derive(Debug, Default)]
struct HeadSignal {
    read: AtomicBool,
    notify: Notify,
}

impl HeadSignal {
    /// Resolves at `deadline` unless the head was read by then; never resolves after that.
    async fn expired(&self, deadline: Instant) {
        loop {
            if self.read.load(Ordering::Acquire) {
                std::future::pending::<()>().await;
            }
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => {
                    if !self.read.load(Ordering::Acquire) {
                        return;
                    }
                }
                () = self.notify.notified() => {}
            }
        }
    }
}

/// Called by the gateway with the connection context Pingora hands over at the start of a
/// request on a reused connection: the head has been read, so its deadline no longer applies.
pub fn head_read(context: &(dyn Any + Send + Sync)) {
    if let Some(signal) = context.downcast_ref::<Arc<HeadSignal>>() {
        signal.read.store(true, Ordering::Release);
        signal.notify.notify_one();
    }
}

/// Why a request head was not handed on.
#[derive(Debug)]
enum HeadError {
    /// The client went away: nothing to answer.
    Closed,
    /// Nothing arrived before the deadline: closed without an answer, counted as `head_timeout`.
    Silent,
    /// Answer `error` and close.
    Refused {
        /// Label of `switchyard_connections_refused_total`.
        reason: &'static str,
        error: ApiError,
        /// The request's path, when the request line could be read: it picks the error format.
        path: Option<String>,
    },
}

/// What a connection opened with.
#[derive(Debug)]
enum Head {
    /// An HTTP/1 request head, with whatever followed it in the same reads.
    Http1(BytesMut),
    /// The HTTP/2 connection preface (prior knowledge), when `h2c` is allowed.
    Http2(BytesMut),
}

/// Read one request head (and whatever follows it in the same reads) within the deadline and
/// size limit, and check what Pingora would refuse with an empty answer.
async fn read_head<S>(
    stream: &mut S,
    settings: &ConnectionSettings,
    h2c: bool,
) -> Result<Head, HeadError>
where
    S: tokio::io::AsyncRead + Unpin + ?Sized,
{
    let deadline = Instant::now() + settings.header_timeout;
    let mut buf = BytesMut::with_capacity(4096);
    loop {
        let seen = buf.len().min(H2_PREFACE.len());
        if h2c && !buf.is_empty() && buf.get(..seen) == H2_PREFACE.get(..seen) {
            if seen == H2_PREFACE.len() {
                return Ok(Head::Http2(buf));
            }
        } else {
            match check_head(&buf) {
                HeadCheck::Complete => return Ok(Head::Http1(buf)),
                HeadCheck::Partial => {}
                HeadCheck::Refused(reason, error) => {
                    return Err(HeadError::Refused {
                        reason,
                        error,
                        path: request_path(&buf),
                    });
                }
            }
        }
        if buf.len() > settings.max_header_bytes {
            return Err(HeadError::Refused {
                reason: "head_too_large",
                error: ApiError::new(
                    ErrorKind::HeaderTooLarge,
                    "request_header_too_large",
                    format!(
                        "the request head exceeds {} bytes",
                        settings.max_header_bytes
                    ),
                ),
                path: request_path(&buf),
            });
        }
        buf.reserve(8 * 1024);
        match tokio::time::timeout_at(deadline, stream.read_buf(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Err(HeadError::Closed),
            Ok(Ok(_)) => {}
            Err(_) if buf.is_empty() => return Err(HeadError::Silent),
            Err(_) => {
                return Err(HeadError::Refused {
                    reason: "head_timeout",
                    error: ApiError::new(
                        ErrorKind::RequestTimeout,
                        "request_timeout",
                        format!(
                            "the request head did not arrive within {} s",
                            settings.header_timeout.as_secs_f64()
                        ),
                    ),
                    path: request_path(&buf),
                });
            }
        }
    }
}

enum HeadCheck {
    Complete,
    Partial,
    Refused(&'static str, ApiError),
}

/// Whether `buf` starts with a complete, acceptable request head.
fn check_head(buf: &[u8]) -> HeadCheck {
    let malformed = |message: String| {
        HeadCheck::Refused(
            "malformed_head",
            ApiError::new(ErrorKind::InvalidRequest, "invalid_http_request", message),
        )
    };
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADER_FIELDS];
    let mut request = httparse::Request::new(&mut fields);
    match request.parse(buf) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return HeadCheck::Partial,
        Err(httparse::Error::TooManyHeaders) => {
            return HeadCheck::Refused(
                "head_too_large",
                ApiError::new(
                    ErrorKind::HeaderTooLarge,
                    "request_header_too_large",
                    format!("the request has more than {MAX_HEADER_FIELDS} header fields"),
                ),
            );
        }
        // Pingora escapes characters a strict parser refuses in the target; leave those to it
        // as long as the request line has the shape of one.
        Err(httparse::Error::Token | httparse::Error::Version) => {
            let Some(line_end) = buf.iter().position(|&b| b == b'\n') else {
                return HeadCheck::Partial;
            };
            let line = String::from_utf8_lossy(buf.get(..line_end).unwrap_or_default());
            let parts: Vec<&str> = line.trim_end().split(' ').collect();
            let looks_like_http = parts.len() >= 3
                && parts.first().is_some_and(|m| is_token(m))
                && parts
                    .last()
                    .is_some_and(|v| *v == "HTTP/1.1" || *v == "HTTP/1.0");
            if !looks_like_http {
                return malformed("the request line is not an HTTP/1.1 request line".into());
            }
            return if has_head_end(buf) {
                HeadCheck::Complete
            } else {
                HeadCheck::Partial
            };
        }
        Err(error) => return malformed(format!("malformed request head: {error}")),
    }
    // Framing Pingora refuses: it would answer an empty 400.
    let mut lengths = Vec::new();
    let mut transfer_encoding = Vec::new();
    for field in request.headers.iter() {
        if field.name.eq_ignore_ascii_case("content-length") {
            for value in field.value.split(|&b| b == b',') {
                let value = String::from_utf8_lossy(value);
                match value.trim().parse::<u64>() {
                    Ok(length) => lengths.push(length),
                    Err(_) => return malformed("invalid Content-Length header".into()),
                }
            }
        } else if field.name.eq_ignore_ascii_case("transfer-encoding") {
            transfer_encoding.push(String::from_utf8_lossy(field.value).to_ascii_lowercase());
        }
    }
    if !transfer_encoding.is_empty() {
        if request.version == Some(0) {
            return malformed("HTTP/1.0 requests cannot use Transfer-Encoding".into());
        }
        let last = transfer_encoding
            .last()
            .and_then(|v| v.rsplit(',').next())
            .map(str::trim);
        if last != Some("chunked") {
            return malformed("the last Transfer-Encoding must be chunked".into());
        }
    } else if lengths.windows(2).any(|pair| pair.first() != pair.get(1)) {
        return malformed("conflicting Content-Length headers".into());
    }
    HeadCheck::Complete
}

fn is_token(text: &str) -> bool {
    !text.is_empty()
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn has_head_end(buf: &[u8]) -> bool {
    buf.windows(4).any(|w| w == b"\r\n\r\n") || buf.windows(2).any(|w| w == b"\n\n")
}

/// The path of the request line in `buf`, when one can be read (it picks the error format).
fn request_path(buf: &[u8]) -> Option<String> {
    let line_end = buf
        .iter()
        .take(8 * 1024)
        .position(|&b| b == b'\n')
        .unwrap_or(buf.len().min(8 * 1024));
    let line = String::from_utf8_lossy(buf.get(..line_end)?);
    // The target counts once the space after it has arrived.
    let mut parts = line.split(' ');
    let target = parts.nth(1)?;
    parts.next()?;
    let path = target.split('?').next()?;
    path.starts_with('/').then(|| path.to_owned())
}

/// Write an error answer in the format of `path` and close.
async fn refuse(stream: &mut Stream, error: ApiError, path: Option<&str>, extra: &[(&str, &str)]) {
    let format = path.map_or(crate::api::ClientFormat::OpenAi, client_format_for_path);
    let body = error.body(format);
    let status = error.status();
    let reason = http::StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("");
    let mut answer = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    for (name, value) in extra {
        answer.push_str(&format!("{name}: {value}\r\n"));
    }
    answer.push_str("\r\n");
    let write = async {
        stream.write_all(answer.as_bytes()).await?;
        stream.write_all(&body).await?;
        stream.flush().await
    };
    if tokio::time::timeout(REFUSAL_WRITE_TIMEOUT, write)
        .await
        .is_ok()
    {
        pingora_core::protocols::Shutdown::shutdown(&mut **stream).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(buf: &[u8]) -> Option<(&'static str, u16)> {
        match check_head(buf) {
            HeadCheck::Refused(reason, error) => Some((reason, error.status())),
            _ => None,
        }
    }

    #[test]
    fn complete_and_partial_heads() {
        assert!(matches!(
            check_head(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"),
            HeadCheck::Complete
        ));
        assert!(matches!(
            check_head(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n"),
            HeadCheck::Partial
        ));
        // Identical duplicates are one length (RFC 9110 8.6).
        assert!(matches!(
            check_head(b"POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2, 2\r\n\r\n"),
            HeadCheck::Complete
        ));
        // A target Pingora escapes is left to it.
        assert!(matches!(
            check_head(b"GET /v1/models?q=a|b\"c HTTP/1.1\r\nHost: x\r\n\r\n"),
            HeadCheck::Complete
        ));
    }

    #[test]
    fn refused_heads() {
        assert_eq!(
            refused(b"POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n"),
            Some(("malformed_head", 400))
        );
        assert_eq!(
            refused(b"POST / HTTP/1.1\r\nContent-Length: two\r\n\r\n"),
            Some(("malformed_head", 400))
        );
        assert_eq!(
            refused(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n"),
            Some(("malformed_head", 400))
        );
        assert_eq!(
            refused(b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n"),
            Some(("malformed_head", 400))
        );
        assert_eq!(
            refused(b"garbage garbage\r\n"),
            Some(("malformed_head", 400))
        );
        let mut many = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..300 {
            many.extend_from_slice(format!("x-{i}: y\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        assert_eq!(refused(&many), Some(("head_too_large", 431)));
    }

    #[test]
    fn path_from_the_request_line() {
        assert_eq!(
            request_path(b"POST /v1/messages?beta=true HTTP/1.1\r\nx: y"),
            Some("/v1/messages".to_owned())
        );
        assert_eq!(request_path(b"POST /v1/mess"), None);
        assert_eq!(request_path(b"\x16\x03\x01garbage"), None);
    }

    #[tokio::test]
    async fn a_slow_head_times_out_and_a_large_one_is_refused() {
        let settings = ConnectionSettings {
            header_timeout: Duration::from_millis(200),
            max_header_bytes: 1024,
            ..ConnectionSettings::default()
        };
        // One byte, then silence: refused with 408 in the format of the path, once it is known.
        let (mut client, mut server) = tokio::io::duplex(64 * 1024);
        client
            .write_all(b"POST /v1/messages HTTP/1.1\r\nx-slow: ")
            .await
            .unwrap();
        match read_head(&mut server, &settings, true).await {
            Err(HeadError::Refused { error, path, .. }) => {
                assert_eq!(error.status(), 408);
                assert_eq!(path.as_deref(), Some("/v1/messages"));
            }
            other => panic!("expected 408, got {other:?}"),
        }
        // Silence from the start: closed without an answer.
        let (_client, mut server) = tokio::io::duplex(1024);
        assert!(matches!(
            read_head(&mut server, &settings, true).await,
            Err(HeadError::Silent)
        ));
        // Larger than the limit.
        let (mut client, mut server) = tokio::io::duplex(64 * 1024);
        let mut head = b"GET /v1/models HTTP/1.1\r\nx-big: ".to_vec();
        head.extend(std::iter::repeat_n(b'a', 4096));
        client.write_all(&head).await.unwrap();
        match read_head(&mut server, &settings, true).await {
            Err(HeadError::Refused { error, .. }) => assert_eq!(error.status(), 431),
            other => panic!("expected 431, got {other:?}"),
        }
        // A complete head comes back with the body bytes that followed it.
        let (mut client, mut server) = tokio::io::duplex(64 * 1024);
        client
            .write_all(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
            .await
            .unwrap();
        match read_head(&mut server, &settings, true).await {
            Ok(Head::Http1(head)) => assert!(head.ends_with(b"\r\n\r\n{}")),
            other => panic!("expected a head, got {other:?}"),
        }
        // The HTTP/2 preface, in two writes.
        let (mut client, mut server) = tokio::io::duplex(64 * 1024);
        client.write_all(&H2_PREFACE[..5]).await.unwrap();
        let reading = tokio::spawn(async move { read_head(&mut server, &settings, true).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        client.write_all(&H2_PREFACE[5..]).await.unwrap();
        assert!(matches!(reading.await.unwrap(), Ok(Head::Http2(_))));
    }

    #[test]
    fn connection_slots_per_client_and_in_total() {
        let settings = ConnectionSettings {
            max_connections: 3,
            max_connections_per_client: 2,
            ..ConnectionSettings::default()
        };
        let open = OpenConnections::default();
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let first = open.admit(Some(a), &settings).unwrap();
        let _second = open.admit(Some(a), &settings).unwrap();
        assert_eq!(open.admit(Some(a), &settings).err(), Some("client_limit"));
        let _third = open.admit(Some(b), &settings).unwrap();
        assert_eq!(open.admit(Some(b), &settings).err(), Some("total_limit"));
        drop(first);
        assert_eq!(open.total.load(Ordering::Relaxed), 2);
        let _again = open.admit(Some(a), &settings).unwrap();
        assert_eq!(crate::lock(&open.per_client).get(&a), Some(&2));
    }
}
