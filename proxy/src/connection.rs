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

mod head;

pub use head::head_read;
use head::{Head, HeadError, HeadSignal, read_head, refuse};

#[cfg(test)]
mod tests;
