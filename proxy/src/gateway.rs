//! The gateway and the state of one request through its phases (see [`crate::proxy`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::api::{ClientFormat, Endpoint};
use crate::config::ConfigStore;
use crate::cors::Cors;
use crate::exchange::Exchange;
use crate::limits::RateLimiter;
use crate::metrics::Metrics;
use crate::responses::ResponseDirectory;
use crate::telemetry::{RequestSpan, Tracer};

/// Proxy-wide settings that do not come from the snapshot.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Largest request body accepted; larger ones get 413.
    pub max_body_bytes: usize,
    /// Longest silence allowed while waiting on a worker (a long prefill counts as silence).
    pub upstream_read_timeout: Duration,
    /// Longest time to receive a whole request body, from the end of its head.
    pub body_timeout: Duration,
    /// Origins browser clients may call from (none by default).
    pub cors: Cors,
    /// Response ids whose worker the gateway remembers at most, and for how long.
    pub response_ids_max: usize,
    pub response_ids_ttl: Duration,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            max_body_bytes: 32 * 1024 * 1024,
            upstream_read_timeout: Duration::from_secs(600),
            body_timeout: Duration::from_secs(60),
            cors: Cors::default(),
            response_ids_max: 100_000,
            response_ids_ttl: Duration::from_secs(24 * 3600),
        }
    }
}

/// The gateway: one instance serves every request.
pub struct Gateway {
    pub(crate) store: Arc<ConfigStore>,
    pub(crate) settings: Settings,
    /// Per-tenant rate limits, kept across snapshots.
    pub(crate) limiter: Arc<RateLimiter>,
    /// Which worker holds which stored response (Responses API).
    pub(crate) responses: Arc<ResponseDirectory>,
    /// Request spans, when OTLP export is configured.
    pub(crate) tracer: Option<Tracer>,
    /// The proxy's metrics, shared by both listeners and the connection layer.
    pub(crate) metrics: Arc<Metrics>,
    /// This listener serves the operator's surface: `/metrics`, `/debug/route` and
    /// `x-switchyard-explain`. Off on the tenants' listener unless asked for.
    pub(crate) admin: bool,
}

impl Gateway {
    /// A gateway over `store`, with metrics of its own (see [`Gateway::metrics`]).
    pub fn new(store: Arc<ConfigStore>, settings: Settings) -> Gateway {
        Gateway {
            metrics: Arc::new(Metrics::new(store.clone())),
            store,
            responses: Arc::new(ResponseDirectory::new(
                settings.response_ids_max,
                settings.response_ids_ttl,
            )),
            settings,
            limiter: Arc::default(),
            tracer: None,
            admin: false,
        }
    }

    /// The metrics this gateway counts into and serves: hand them to the connection layer
    /// ([`crate::connection::Guarded`]) so that one `/metrics` shows both.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Serve (or not) the operator's surface on this gateway's listener.
    pub fn with_admin(mut self, admin: bool) -> Gateway {
        self.admin = admin;
        self
    }

    /// A gateway for the admin listener: the same configuration, rate limits, tracer and
    /// metrics, with the operator's surface on.
    pub fn admin_listener(&self) -> Gateway {
        Gateway {
            store: self.store.clone(),
            settings: self.settings.clone(),
            limiter: self.limiter.clone(),
            responses: self.responses.clone(),
            tracer: self.tracer.clone(),
            metrics: self.metrics.clone(),
            admin: true,
        }
    }

    /// Open a span per API request with `tracer`.
    pub fn with_tracer(mut self, tracer: Option<Tracer>) -> Gateway {
        self.tracer = tracer;
        self
    }
}

/// Where a request stands.
#[derive(Debug, Default)]
pub enum Phase {
    /// Being read and checked; nothing forwarded.
    #[default]
    Admitting,
    /// Planned and on its way to a target.
    Forwarding(Box<Exchange>),
}

/// Per-request state.
pub struct RequestCtx {
    pub(crate) request_id: String,
    pub(crate) started: Instant,
    pub(crate) format: ClientFormat,
    pub(crate) endpoint: Option<Endpoint>,
    pub(crate) phase: Phase,
    /// The status sent to the client (0: none yet).
    pub(crate) status: u16,
    /// The request's trace span (API requests, when tracing is on).
    pub(crate) span: Option<RequestSpan>,
    /// `Access-Control-Allow-Origin` for the request's origin, when CORS allows it.
    pub(crate) cors_allow: Option<String>,
}

impl RequestCtx {
    pub(crate) fn exchange(&mut self) -> Option<&mut Exchange> {
        match &mut self.phase {
            Phase::Forwarding(exchange) => Some(exchange),
            Phase::Admitting => None,
        }
    }
}
