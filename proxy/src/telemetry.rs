//! OpenTelemetry traces: one server span per request, exported over OTLP.
//!
//! Configured by the standard environment variables, so it drops into an existing
//! observability stack: `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`)
//! turns tracing on; `OTEL_EXPORTER_OTLP_PROTOCOL` picks `grpc` (default) or `http/protobuf`;
//! `OTEL_SERVICE_NAME` (default `switchyard-proxy`), `OTEL_TRACES_SAMPLER` /
//! `OTEL_TRACES_SAMPLER_ARG` and `OTEL_BSP_*` (batching) are read by the SDK. Without an
//! endpoint nothing is set up and requests pay nothing.
//!
//! The span carries the routing facts (tenant, model, target, policy rule, worker, matched prefix
//! tokens, predicted and actual TTFT, status) and never prompt text or credentials. An incoming
//! W3C `traceparent` makes the span its child; the span's own context goes to the upstream in
//! `traceparent`, replacing the client's, so the worker's spans hang under the gateway's.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{
    SpanKind, Status, TraceContextExt as _, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider, SpanData, SpanExporter};

const DEFAULT_SERVICE_NAME: &str = "switchyard-proxy";

/// The tracer and what keeps its exporter running; `None` in [`Telemetry::from_env`] when no
/// endpoint is configured.
pub struct Telemetry {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    /// The gRPC exporter's connections live on this runtime (Pingora's runtimes come later and
    /// belong to its services).
    _runtime: tokio::runtime::Runtime,
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

impl Telemetry {
    /// Set up OTLP export from the environment; `Ok(None)` when no endpoint is configured.
    pub fn from_env() -> anyhow::Result<Option<Telemetry>> {
        let endpoint = env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            .or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT"));
        let Some(endpoint) = endpoint else {
            return Ok(None);
        };
        let protocol = env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            .or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"))
            .unwrap_or_else(|| "grpc".to_owned());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("otlp-export")
            .enable_all()
            .build()?;
        let exporter = runtime.block_on(async {
            match protocol.as_str() {
                "grpc" => opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .build()
                    .map_err(anyhow::Error::from),
                "http/protobuf" => opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_protocol(Protocol::HttpBinary)
                    .build()
                    .map_err(anyhow::Error::from),
                other => Err(anyhow::anyhow!(
                    "OTEL_EXPORTER_OTLP_PROTOCOL '{other}' is not supported; use grpc or http/protobuf"
                )),
            }
        })?;
        let mut resource = Resource::builder();
        if env("OTEL_SERVICE_NAME").is_none() {
            resource = resource.with_service_name(DEFAULT_SERVICE_NAME);
        }
        let resource = resource
            .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
            .build();
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(Reporting {
                inner: exporter,
                failing: AtomicBool::new(false),
            })
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("switchyard-proxy");
        tracing::info!(%endpoint, %protocol, "exporting traces over OTLP");
        Ok(Some(Telemetry {
            provider,
            tracer,
            _runtime: runtime,
        }))
    }

    pub fn tracer(&self) -> Tracer {
        Tracer {
            tracer: self.tracer.clone(),
        }
    }

    /// A background service that exports the spans still batched when the server shuts down.
    pub fn flusher(&self) -> Flusher {
        Flusher {
            provider: self.provider.clone(),
        }
    }
}

/// See [`Telemetry::flusher`].
pub struct Flusher {
    provider: SdkTracerProvider,
}

#[async_trait::async_trait]
impl pingora_core::services::background::BackgroundService for Flusher {
    async fn start(&self, mut shutdown: pingora_core::server::ShutdownWatch) {
        let _ = shutdown.changed().await;
        let provider = self.provider.clone();
        let _ = tokio::task::spawn_blocking(move || provider.force_flush()).await;
    }
}

/// Logs when exports start failing and when they work again (once each), so a collector that is
/// down shows in the logs without a line per batch. Spans that cannot be exported are dropped;
/// requests never wait for them.
#[derive(Debug)]
struct Reporting<E> {
    inner: E,
    failing: AtomicBool,
}

impl<E: SpanExporter> SpanExporter for Reporting<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len();
        let result = self.inner.export(batch).await;
        match &result {
            Ok(()) => {
                if self.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!("trace export works again");
                }
            }
            Err(error) => {
                if !self.failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(%error, spans, "cannot export traces; dropping them until the collector answers");
                }
            }
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: std::time::Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        let _ = self.provider.shutdown();
    }
}

/// What the gateway holds to open request spans.
#[derive(Clone)]
pub struct Tracer {
    tracer: SdkTracer,
}

struct Headers<'a>(&'a http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

struct Collect(HashMap<String, String>);

impl Injector for Collect {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key.to_owned(), value);
    }
}

impl Tracer {
    /// Open the server span of a request, as a child of the caller's `traceparent` if any.
    pub fn start(&self, name: String, headers: &http::HeaderMap) -> RequestSpan {
        let parent = TraceContextPropagator::new().extract(&Headers(headers));
        let span = self
            .tracer
            .span_builder(name)
            .with_kind(SpanKind::Server)
            .with_start_time(SystemTime::now())
            .start_with_context(&self.tracer, &parent);
        RequestSpan {
            context: parent.with_span(span),
        }
    }
}

/// A request's open span; ended by [`RequestSpan::end`] (or when dropped).
pub struct RequestSpan {
    context: Context,
}

impl RequestSpan {
    /// The headers that carry this span's context upstream (`traceparent`, `tracestate`).
    pub fn propagation_headers(&self) -> HashMap<String, String> {
        let mut headers = Collect(HashMap::new());
        TraceContextPropagator::new().inject_context(&self.context, &mut headers);
        headers.0
    }

    /// Attach the request's facts and end the span; a 5xx marks it as an error.
    pub fn end(self, attributes: Vec<KeyValue>, status: u16, error: Option<&str>) {
        let span = self.context.span();
        span.set_attributes(attributes);
        if status >= 500 || (status == 0 && error.is_some()) {
            span.set_status(Status::error(error.unwrap_or("server error").to_owned()));
        }
        span.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry_sdk::trace::InMemorySpanExporterBuilder;

    #[test]
    fn a_caller_trace_becomes_the_parent_and_goes_upstream_as_ours() {
        let exporter = InMemorySpanExporterBuilder::new().build();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let tracer = Tracer {
            tracer: provider.tracer("test"),
        };
        let mut headers = http::HeaderMap::new();
        headers.insert(
            "traceparent",
            http::HeaderValue::from_static(
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            ),
        );
        let span = tracer.start("POST /v1/chat/completions".to_owned(), &headers);
        let upstream = span.propagation_headers();
        let traceparent = upstream.get("traceparent").expect("traceparent");
        assert!(traceparent.starts_with("00-0af7651916cd43dd8448eb211c80319c-"));
        assert!(
            !traceparent.contains("b7ad6b7169203331"),
            "our span, not the caller's"
        );
        span.end(vec![KeyValue::new("switchyard.tenant", "t")], 503, None);
        let spans = exporter.get_finished_spans().expect("spans");
        assert_eq!(spans.len(), 1);
        let span = &spans[0];
        assert_eq!(span.parent_span_id.to_string(), "b7ad6b7169203331");
        assert_eq!(span.span_kind, SpanKind::Server);
        assert!(matches!(span.status, Status::Error { .. }));
        assert!(
            span.attributes
                .iter()
                .any(|kv| kv.key.as_str() == "switchyard.tenant")
        );
    }
}
