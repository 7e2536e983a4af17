//! The first request head of a connection, read by the gateway: deadlines, size and field
//! limits, the checks Pingora does not make, and the API-shaped refusal.

use super::*;

/// Set once the gateway has a request's head (see [`head_read`]).
#[derive(Debug, Default)]
pub(super) struct HeadSignal {
    read: AtomicBool,
    notify: Notify,
}

impl HeadSignal {
    /// Resolves at `deadline` unless the head was read by then; never resolves after that.
    pub(super) async fn expired(&self, deadline: Instant) {
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
pub(super) enum HeadError {
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
pub(super) enum Head {
    /// An HTTP/1 request head, with whatever followed it in the same reads.
    Http1(BytesMut),
    /// The HTTP/2 connection preface (prior knowledge), when `h2c` is allowed.
    Http2(BytesMut),
}

/// Read one request head (and whatever follows it in the same reads) within the deadline and
/// size limit, and check what Pingora would refuse with an empty answer.
pub(super) async fn read_head<S>(
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

pub(super) enum HeadCheck {
    Complete,
    Partial,
    Refused(&'static str, ApiError),
}

/// Whether `buf` starts with a complete, acceptable request head.
pub(super) fn check_head(buf: &[u8]) -> HeadCheck {
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

pub(super) fn is_token(text: &str) -> bool {
    !text.is_empty()
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

pub(super) fn has_head_end(buf: &[u8]) -> bool {
    buf.windows(4).any(|w| w == b"\r\n\r\n") || buf.windows(2).any(|w| w == b"\n\n")
}

/// The path of the request line in `buf`, when one can be read (it picks the error format).
pub(super) fn request_path(buf: &[u8]) -> Option<String> {
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
pub(super) async fn refuse(
    stream: &mut Stream,
    error: ApiError,
    path: Option<&str>,
    extra: &[(&str, &str)],
) {
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
