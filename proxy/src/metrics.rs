//! The proxy's own metrics (`GET /metrics`) as owned state: one [`Metrics`], made with the
//! [`Gateway`](crate::gateway::Gateway) and shared (`Arc`) with its admin listener and the
//! connection layer, registered once in a `prometheus-client` registry and encoded in the
//! OpenMetrics text format ([`CONTENT_TYPE`]).
//!
//! Two kinds of families:
//! - counted here as things happen: connections, policy decisions, fallbacks, client
//!   disconnects, and per-tenant accounting (requests, tokens, latency, rejections);
//! - read when scraped, by `StateCollector`: state that lives elsewhere (prefix-index sizes,
//!   KV event streams, routing decisions, worker queues, the configuration version) is read from
//!   the [`ConfigStore`] at that moment instead of being copied into gauges as it changes.
//!
//! Label values come from configuration only (tenant and model names, pool and provider ids,
//! rule names), never from what a client sends: an unknown model counts as `unknown`, a caller
//! without a tenant as `anonymous`. Series are capped besides, for configurations that change
//! names often over a long run: past [`MAX_SERIES`] new tenants count as `tenant="other"`, past
//! [`MAX_RULE_LABELS`] new rules as `rule="other"`.
//!
//! A request's accounting series ([`RequestSeries`]) is resolved once, when the request is
//! planned (and again when it falls back to another target): its end then adds to that
//! series' counters and histograms without building a label or taking a process-wide lock.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, RandomState};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, text};
use prometheus_client::metrics::TypedMetric;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::accounting::Usage;
use crate::config::ConfigStore;
use crate::kv::{PoolKv, StreamStats};
use crate::routing::RoutingTable;

/// The `Content-Type` of `GET /metrics`: OpenMetrics text 1.0.0, which Prometheus scrapes.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Most (tenant, model, target) request series, and most rejection series, kept; later tenants
/// count under `tenant="other"`.
pub const MAX_SERIES: usize = 10_000;

/// Most distinct policy-rule (and fallback) label sets kept; later rules count under
/// `rule="other"`, later fallback pairs are not counted.
pub const MAX_RULE_LABELS: usize = 1_000;

/// Upper bounds (seconds) of the latency histograms.
pub const LATENCY_BUCKETS: [f64; 14] = [
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
];

/// The tenant label of a caller without a tenant.
const ANONYMOUS: &str = "anonymous";
/// The model label of a model the configuration does not define.
const UNKNOWN: &str = "unknown";
/// The label value series past a cap are folded into.
const OTHER: &str = "other";

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RuleLabels {
    rule: String,
    outcome: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct FallbackLabels {
    from: String,
    to: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RefusalLabels {
    reason: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RequestLabels {
    tenant: String,
    model: String,
    target: String,
    outcome: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct LatencyLabels {
    tenant: String,
    model: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RejectionLabels {
    tenant: String,
    model: String,
    reason: &'static str,
}

type LatencyFamily = Family<LatencyLabels, Histogram, fn() -> Histogram>;

/// A counter family with a bound on its series: past `max`, a new label set counts under
/// what `fold` makes of it, or not at all when it makes nothing.
#[derive(Debug)]
struct CappedFamily<L> {
    family: Family<L, Counter>,
    /// Label sets created so far (two threads creating the same one at once may count it
    /// twice: the cap then holds a little early, never late).
    created: AtomicUsize,
    max: usize,
}

impl<L: Clone + Hash + Eq> CappedFamily<L> {
    fn new(max: usize) -> CappedFamily<L> {
        CappedFamily {
            family: Family::default(),
            created: AtomicUsize::new(0),
            max,
        }
    }

    fn inc(&self, labels: L, fold: impl FnOnce(L) -> Option<L>) {
        if let Some(counter) = self.family.get(&labels) {
            counter.inc();
            return;
        }
        let labels = if self.created.fetch_add(1, Ordering::Relaxed) < self.max {
            labels
        } else {
            self.created.fetch_sub(1, Ordering::Relaxed);
            match fold(labels) {
                Some(folded) => folded,
                None => return,
            }
        };
        self.family.get_or_create(&labels).inc();
    }
}

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

/// The families a [`RequestSeries`] adds to.
#[derive(Debug)]
struct TenantFamilies {
    requests: Family<RequestLabels, Counter>,
    prompt_tokens: Family<RequestLabels, Counter>,
    cached_prompt_tokens: Family<RequestLabels, Counter>,
    completion_tokens: Family<RequestLabels, Counter>,
    ttft: LatencyFamily,
    duration: LatencyFamily,
}

/// Every metric of the proxy, and the registry `/metrics` encodes.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    policy_decisions: CappedFamily<RuleLabels>,
    fallbacks: CappedFamily<FallbackLabels>,
    client_disconnects: Counter,
    open_connections: Gauge,
    connections_refused: Family<RefusalLabels, Counter>,
    tenants: Arc<TenantFamilies>,
    rejections: CappedFamily<RejectionLabels>,
    series: RwLock<SeriesCache>,
    /// Hashes (tenant, model, target) for [`SeriesCache`].
    series_hasher: RandomState,
}

impl Metrics {
    /// Register every family; the state of `store` is read when scraped.
    pub fn new(store: Arc<ConfigStore>) -> Metrics {
        let mut registry = Registry::default();
        let policy_decisions = CappedFamily::new(MAX_RULE_LABELS);
        registry.register(
            "switchyard_policy_decisions",
            "Inference-policy decisions by rule (none: no rule decided) and outcome",
            policy_decisions.family.clone(),
        );
        let fallbacks = CappedFamily::new(MAX_RULE_LABELS);
        registry.register(
            "switchyard_target_fallbacks",
            "Requests moved to the next target of their model (connect failure or 5xx before \
             the first byte)",
            fallbacks.family.clone(),
        );
        let client_disconnects = Counter::default();
        registry.register(
            "switchyard_client_disconnects",
            "Requests ended by their client: it closed the connection before the answer was \
             complete",
            client_disconnects.clone(),
        );
        let open_connections = Gauge::default();
        registry.register(
            "switchyard_open_connections",
            "Client connections open now",
            open_connections.clone(),
        );
        let connections_refused = Family::default();
        registry.register(
            "switchyard_connections_refused",
            "Connections refused or closed before a request was read: total_limit, \
             client_limit, head_timeout, head_too_large, malformed_head",
            connections_refused.clone(),
        );
        let tenants = TenantFamilies {
            requests: Family::default(),
            prompt_tokens: Family::default(),
            cached_prompt_tokens: Family::default(),
            completion_tokens: Family::default(),
            ttft: Family::new_with_constructor(latency_histogram),
            duration: Family::new_with_constructor(latency_histogram),
        };
        registry.register(
            "switchyard_tenant_requests",
            "Requests routed to a target, by tenant, model, target and outcome",
            tenants.requests.clone(),
        );
        registry.register(
            "switchyard_tenant_prompt_tokens",
            "Prompt tokens as the upstreams reported them",
            tenants.prompt_tokens.clone(),
        );
        registry.register(
            "switchyard_tenant_cached_prompt_tokens",
            "Prompt tokens served from the upstream's prefix cache, as reported",
            tenants.cached_prompt_tokens.clone(),
        );
        registry.register(
            "switchyard_tenant_completion_tokens",
            "Completion tokens as the upstreams reported them",
            tenants.completion_tokens.clone(),
        );
        registry.register_with_unit(
            "switchyard_tenant_ttft",
            "Time to the first byte of successful answers",
            Unit::Seconds,
            tenants.ttft.clone(),
        );
        registry.register_with_unit(
            "switchyard_tenant_request_duration",
            "Time from the request to the end of its answer",
            Unit::Seconds,
            tenants.duration.clone(),
        );
        let rejections = CappedFamily::new(MAX_SERIES);
        registry.register(
            "switchyard_tenant_rejections",
            "Requests refused before reaching a target, by reason",
            rejections.family.clone(),
        );
        registry.register_collector(Box::new(StateCollector { store }));
        Metrics {
            registry,
            policy_decisions,
            fallbacks,
            client_disconnects,
            open_connections,
            connections_refused,
            tenants: Arc::new(tenants),
            rejections,
            series: RwLock::default(),
            series_hasher: RandomState::new(),
        }
    }

    /// Every family in the OpenMetrics text format (`# EOF` included).
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        text::encode(&mut out, &self.registry)?;
        Ok(out)
    }

    /// Count a client connection as open until the returned guard drops.
    pub fn connection_opened(&self) -> OpenConnection<'_> {
        self.open_connections.inc();
        OpenConnection {
            gauge: &self.open_connections,
        }
    }

    /// Count a connection the gateway refused or closed for `reason` (a fixed label).
    pub fn connection_refused(&self, reason: &'static str) {
        self.connections_refused
            .get_or_create(&RefusalLabels { reason })
            .inc();
    }

    /// Count a request ended by its client (it hung up mid-answer or sent an unreadable request).
    pub fn client_disconnected(&self) {
        self.client_disconnects.inc();
    }

    /// Count a move from target `from` to target `to` (labels from configuration).
    pub fn fallback(&self, from: &str, to: &str) {
        let labels = FallbackLabels {
            from: from.to_owned(),
            to: to.to_owned(),
        };
        self.fallbacks.inc(labels, |_| None);
    }

    /// Count one policy decision. `rule` is `namespace/policy/rule`, or empty when no rule decided.
    pub fn policy_decision(&self, rule: &str, outcome: &'static str) {
        let rule = if rule.is_empty() { "none" } else { rule };
        let labels = RuleLabels {
            rule: rule.to_owned(),
            outcome,
        };
        self.policy_decisions.inc(labels, |labels| {
            Some(RuleLabels {
                rule: OTHER.to_owned(),
                ..labels
            })
        });
    }

    /// Count a request refused before it reached an upstream.
    pub fn rejected(
        &self,
        table: &RoutingTable,
        tenant: Option<&str>,
        model: &str,
        reason: &'static str,
    ) {
        let model = if table.snapshot.models.contains_key(model) {
            model
        } else {
            UNKNOWN
        };
        self.count_rejection(tenant, model, reason);
    }

    /// Count a rejection with no usable model name (authentication, unreadable bodies).
    pub fn rejected_early(&self, tenant: Option<&str>, reason: &'static str) {
        self.count_rejection(tenant, UNKNOWN, reason);
    }

    fn count_rejection(&self, tenant: Option<&str>, model: &str, reason: &'static str) {
        let labels = RejectionLabels {
            tenant: tenant.unwrap_or(ANONYMOUS).to_owned(),
            model: model.to_owned(),
            reason,
        };
        self.rejections.inc(labels, |labels| {
            Some(RejectionLabels {
                tenant: OTHER.to_owned(),
                ..labels
            })
        });
    }

    /// The accounting series of a request of `tenant` (`None`: no tenant) for the configured
    /// model `model`, sent to `target` (`pool ns/name` or `provider ns/name`). Once the cap is
    /// reached, a new tenant's series is the `tenant="other"` one.
    pub fn request_series(
        &self,
        tenant: Option<&str>,
        model: &str,
        target: &str,
    ) -> Arc<RequestSeries> {
        let tenant = tenant.unwrap_or(ANONYMOUS);
        let hasher = &self.series_hasher;
        let find = |cache: &SeriesCache, tenant: &str| {
            let hash = hasher.hash_one((tenant, model, target));
            cache.find(hash, tenant, model, target).cloned()
        };
        {
            let cache = read(&self.series);
            if let Some(found) = find(&cache, tenant) {
                return found;
            }
            if cache.len >= MAX_SERIES
                && let Some(found) = find(&cache, OTHER)
            {
                return found;
            }
        }
        let mut cache = write(&self.series);
        if let Some(found) = find(&cache, tenant) {
            return found;
        }
        let tenant = if cache.len >= MAX_SERIES {
            OTHER
        } else {
            tenant
        };
        if let Some(found) = find(&cache, tenant) {
            return found;
        }
        let series = Arc::new(RequestSeries::new(
            self.tenants.clone(),
            tenant,
            model,
            target,
        ));
        let hash = hasher.hash_one((tenant, model, target));
        cache.by_hash.entry(hash).or_default().push(series.clone());
        cache.len += 1;
        series
    }
}

/// Read a lock, taking the data even if a thread panicked while holding it (see [`crate::lock`]).
fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}

/// The request series seen so far, by the hash of their labels, so a lookup needs no owned key.
#[derive(Debug, Default)]
struct SeriesCache {
    by_hash: HashMap<u64, Vec<Arc<RequestSeries>>>,
    len: usize,
}

impl SeriesCache {
    fn find(
        &self,
        hash: u64,
        tenant: &str,
        model: &str,
        target: &str,
    ) -> Option<&Arc<RequestSeries>> {
        self.by_hash.get(&hash)?.iter().find(|series| {
            series.tenant == tenant && series.model == model && series.target == target
        })
    }
}

/// Counts a client connection in `switchyard_open_connections` while it lives.
#[derive(Debug)]
pub struct OpenConnection<'a> {
    gauge: &'a Gauge,
}

impl Drop for OpenConnection<'_> {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// How a request that reached a target ended.
#[derive(Debug, Clone, Copy)]
pub struct Finished {
    /// The status sent to the client (0: none).
    pub status: u16,
    pub usage: Usage,
    /// Time to the first byte sent to the client.
    pub ttft: Option<Duration>,
    pub total: Duration,
}

/// The accounting series of one (tenant, model, target): what a request adds to when it ends.
/// The series of each outcome, and the latency histograms, are created with the first request
/// that needs them, so only what happened shows on `/metrics`.
#[derive(Debug)]
pub struct RequestSeries {
    tenant: String,
    model: String,
    target: String,
    families: Arc<TenantFamilies>,
    success: OnceLock<OutcomeCounters>,
    client_error: OnceLock<OutcomeCounters>,
    upstream_error: OnceLock<OutcomeCounters>,
    aborted: OnceLock<OutcomeCounters>,
    ttft: OnceLock<Histogram>,
    duration: OnceLock<Histogram>,
}

/// The counters of one (tenant, model, target, outcome).
#[derive(Debug)]
struct OutcomeCounters {
    requests: Counter,
    prompt_tokens: Counter,
    cached_prompt_tokens: Counter,
    completion_tokens: Counter,
}

impl RequestSeries {
    fn new(families: Arc<TenantFamilies>, tenant: &str, model: &str, target: &str) -> Self {
        RequestSeries {
            tenant: tenant.to_owned(),
            model: model.to_owned(),
            target: target.to_owned(),
            families,
            success: OnceLock::new(),
            client_error: OnceLock::new(),
            upstream_error: OnceLock::new(),
            aborted: OnceLock::new(),
            ttft: OnceLock::new(),
            duration: OnceLock::new(),
        }
    }

    /// Count a request that ended.
    pub fn finished(&self, request: &Finished) {
        let counters = self.outcome(request.status);
        counters.requests.inc();
        counters.prompt_tokens.inc_by(request.usage.prompt_tokens);
        counters
            .cached_prompt_tokens
            .inc_by(request.usage.cached_tokens);
        counters
            .completion_tokens
            .inc_by(request.usage.completion_tokens);
        if let Some(ttft) = request.ttft
            && (200..300).contains(&request.status)
        {
            self.latency(&self.ttft, &self.families.ttft)
                .observe(ttft.as_secs_f64());
        }
        self.latency(&self.duration, &self.families.duration)
            .observe(request.total.as_secs_f64());
    }

    fn outcome(&self, status: u16) -> &OutcomeCounters {
        let (cell, outcome) = match status {
            200..=299 => (&self.success, "success"),
            400..=499 => (&self.client_error, "client_error"),
            500..=599 => (&self.upstream_error, "upstream_error"),
            _ => (&self.aborted, "aborted"),
        };
        cell.get_or_init(|| {
            let labels = RequestLabels {
                tenant: self.tenant.clone(),
                model: self.model.clone(),
                target: self.target.clone(),
                outcome,
            };
            let families = &self.families;
            OutcomeCounters {
                requests: families.requests.get_or_create_owned(&labels),
                prompt_tokens: families.prompt_tokens.get_or_create_owned(&labels),
                cached_prompt_tokens: families.cached_prompt_tokens.get_or_create_owned(&labels),
                completion_tokens: families.completion_tokens.get_or_create_owned(&labels),
            }
        })
    }

    fn latency<'a>(&self, cell: &'a OnceLock<Histogram>, family: &LatencyFamily) -> &'a Histogram {
        cell.get_or_init(|| {
            family.get_or_create_owned(&LatencyLabels {
                tenant: self.tenant.clone(),
                model: self.model.clone(),
            })
        })
    }
}

/// Exports, when scraped, the state kept elsewhere: per pool its prefix index and routing
/// decisions, per worker its KV event stream and queues, and the configuration version.
struct StateCollector {
    store: Arc<ConfigStore>,
}

impl std::fmt::Debug for StateCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateCollector").finish_non_exhaustive()
    }
}

/// Write one family of `samples` (nothing when there are none, as the registry does).
fn family<L: EncodeLabelSet, M: EncodeMetric + TypedMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, M)>,
) -> std::fmt::Result {
    let mut samples = samples.into_iter().peekable();
    if samples.peek().is_none() {
        return Ok(());
    }
    let mut metric = encoder.encode_descriptor(name, help, None, M::TYPE)?;
    for (labels, value) in samples {
        value.encode(metric.encode_family(&labels)?)?;
    }
    Ok(())
}

impl Collector for StateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let encoder = &mut encoder;
        let mut pools = self.store.kv().pools();
        pools.sort_by(|a, b| a.id.cmp(&b.id));
        let per_pool = |value: fn(&PoolKv) -> u64| {
            pools
                .iter()
                .map(move |pool| ([("pool", pool.id.0.as_str())], value(pool)))
        };
        let gauge = |(labels, value)| (labels, ConstGauge::new(value));
        let counter = |(labels, value)| (labels, ConstCounter::new(value));
        family(
            encoder,
            "switchyard_kv_index_blocks",
            "Blocks held across workers, as the prefix index knows them.",
            per_pool(|p| p.index.stored_blocks()).map(gauge),
        )?;
        family(
            encoder,
            "switchyard_kv_index_prefixes",
            "Distinct block prefixes in the index.",
            per_pool(|p| p.index.nodes() as u64).map(gauge),
        )?;
        family(
            encoder,
            "switchyard_kv_events_applied",
            "KV events applied to the index.",
            per_pool(|p| relaxed(&p.index.stats.events_applied)).map(counter),
        )?;
        family(
            encoder,
            "switchyard_kv_orphan_blocks",
            "Stored blocks whose parent was unknown (missed events), not indexed.",
            per_pool(|p| relaxed(&p.index.stats.orphan_blocks)).map(counter),
        )?;
        family(
            encoder,
            "switchyard_kv_malformed_events",
            "BlockStored events inconsistent with the pool's block size.",
            per_pool(|p| relaxed(&p.index.stats.malformed_events)).map(counter),
        )?;

        let streams: Vec<(&PoolKv, String, Arc<StreamStats>)> = pools
            .iter()
            .flat_map(|pool| {
                pool.workers()
                    .into_iter()
                    .map(|(address, slot)| (&**pool, address, pool.stream_stats(slot)))
            })
            .collect();
        let per_worker = |value: fn(&StreamStats) -> u64| {
            streams.iter().map(move |(pool, address, stats)| {
                (
                    [("pool", pool.id.0.as_str()), ("worker", address.as_str())],
                    ConstCounter::new(value(stats)),
                )
            })
        };
        family(
            encoder,
            "switchyard_kv_event_batches",
            "KV event batches received per worker.",
            per_worker(|s| relaxed(&s.batches)),
        )?;
        family(
            encoder,
            "switchyard_kv_event_gaps_replayed",
            "Sequence gaps filled from the worker's replay socket.",
            per_worker(|s| relaxed(&s.gaps_replayed)),
        )?;
        family(
            encoder,
            "switchyard_kv_event_gaps_cleared",
            "Sequence gaps that could not be filled: the worker's entries were dropped.",
            per_worker(|s| relaxed(&s.gaps_cleared)),
        )?;
        family(
            encoder,
            "switchyard_kv_publisher_restarts",
            "Times a worker's event sequence started over.",
            per_worker(|s| relaxed(&s.publisher_restarts)),
        )?;
        family(
            encoder,
            "switchyard_kv_decode_errors",
            "Event messages that could not be decoded.",
            per_worker(|s| relaxed(&s.decode_errors)),
        )?;

        family(
            encoder,
            "switchyard_routing_decisions",
            "Cache-aware routing decisions by outcome.",
            pools.iter().flat_map(|pool| {
                let decisions = &pool.decisions;
                [
                    ("cache_hit", &decisions.cache_hit),
                    ("no_cache", &decisions.no_cache),
                    ("spread", &decisions.spread),
                ]
                .map(|(outcome, count)| {
                    (
                        [("pool", pool.id.0.as_str()), ("outcome", outcome)],
                        ConstCounter::new(relaxed(count)),
                    )
                })
            }),
        )?;

        let Some(table) = self.store.current() else {
            return Ok(());
        };
        let workers = || {
            table.pools().flat_map(|pool| {
                pool.workers.iter().map(move |worker| {
                    let labels = [
                        ("pool", pool.config.id.0.as_str()),
                        ("worker", worker.address.as_str()),
                    ];
                    (labels, worker)
                })
            })
        };
        family(
            encoder,
            "switchyard_worker_requests_waiting",
            "Waiting requests the worker last reported.",
            workers().map(|(labels, w)| (labels, ConstGauge::new(w.load.waiting()))),
        )?;
        family(
            encoder,
            "switchyard_worker_requests_running",
            "Running requests the worker last reported.",
            workers().map(|(labels, w)| (labels, ConstGauge::new(w.load.running()))),
        )?;
        family(
            encoder,
            "switchyard_worker_requests_in_flight",
            "Requests this proxy has in flight to the worker.",
            workers().map(|(labels, w)| (labels, ConstGauge::new(w.in_flight() as u64))),
        )?;
        let version = ConstGauge::new(table.snapshot.version);
        version.encode(encoder.encode_descriptor(
            "switchyard_config_version",
            "Version of the live configuration snapshot.",
            None,
            ConstGauge::<u64>::TYPE,
        )?)
    }
}

fn relaxed(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics() -> Metrics {
        Metrics::new(Arc::new(ConfigStore::default()))
    }

    fn text(metrics: &Metrics) -> String {
        metrics.encode().unwrap()
    }

    fn has(text: &str, line: &str) -> bool {
        text.lines().any(|l| l == line)
    }

    #[test]
    fn counters_with_labels_are_openmetrics_text() {
        let metrics = metrics();
        metrics.policy_decision("default/gateway/batch", "reject");
        metrics.policy_decision("default/gateway/batch", "reject");
        metrics.policy_decision("", "default");
        metrics.fallback("pool default/a", "provider default/\"cloud\"");
        metrics.connection_refused("head_timeout");
        metrics.client_disconnected();
        let open = metrics.connection_opened();
        let text = text(&metrics);
        for line in [
            "# HELP switchyard_policy_decisions Inference-policy decisions by rule (none: no rule decided) and outcome.",
            "# TYPE switchyard_policy_decisions counter",
            "switchyard_policy_decisions_total{rule=\"default/gateway/batch\",outcome=\"reject\"} 2",
            "switchyard_policy_decisions_total{rule=\"none\",outcome=\"default\"} 1",
            "switchyard_target_fallbacks_total{from=\"pool default/a\",to=\"provider default/\\\"cloud\\\"\"} 1",
            "switchyard_connections_refused_total{reason=\"head_timeout\"} 1",
            "switchyard_client_disconnects_total 1",
            "# TYPE switchyard_open_connections gauge",
            "switchyard_open_connections 1",
        ] {
            assert!(has(&text, line), "missing {line}\n{text}");
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
        // Families with no series yet are left out, as the registry does.
        assert!(!text.contains("switchyard_tenant_rejections"), "{text}");
        drop(open);
        assert!(has(
            &metrics.encode().unwrap(),
            "switchyard_open_connections 0"
        ));
    }

    #[test]
    fn a_request_series_counts_by_outcome_and_observes_latency() {
        let metrics = metrics();
        let series = metrics.request_series(Some("team-a"), "chat", "pool default/p");
        assert!(Arc::ptr_eq(
            &series,
            &metrics.request_series(Some("team-a"), "chat", "pool default/p")
        ));
        series.finished(&Finished {
            status: 200,
            usage: Usage {
                prompt_tokens: 7,
                cached_tokens: 4,
                completion_tokens: 3,
                reported: true,
            },
            ttft: Some(Duration::from_millis(300)),
            total: Duration::from_millis(1200),
        });
        series.finished(&Finished {
            status: 502,
            usage: Usage::default(),
            ttft: Some(Duration::from_millis(20)),
            total: Duration::from_millis(40),
        });
        metrics
            .request_series(None, "chat", "provider default/cloud")
            .finished(&Finished {
                status: 0,
                usage: Usage::default(),
                ttft: None,
                total: Duration::from_millis(10),
            });
        let text = text(&metrics);
        let labels = "tenant=\"team-a\",model=\"chat\",target=\"pool default/p\"";
        for line in [
            format!("switchyard_tenant_requests_total{{{labels},outcome=\"success\"}} 1"),
            format!("switchyard_tenant_requests_total{{{labels},outcome=\"upstream_error\"}} 1"),
            format!("switchyard_tenant_prompt_tokens_total{{{labels},outcome=\"success\"}} 7"),
            format!(
                "switchyard_tenant_cached_prompt_tokens_total{{{labels},outcome=\"success\"}} 4"
            ),
            format!("switchyard_tenant_completion_tokens_total{{{labels},outcome=\"success\"}} 3"),
            "switchyard_tenant_requests_total{tenant=\"anonymous\",model=\"chat\",target=\"provider default/cloud\",outcome=\"aborted\"} 1".to_owned(),
            "# TYPE switchyard_tenant_ttft_seconds histogram".to_owned(),
            "# UNIT switchyard_tenant_ttft_seconds seconds".to_owned(),
            // Only the successful answer's first byte is a time to first token.
            "switchyard_tenant_ttft_seconds_count{tenant=\"team-a\",model=\"chat\"} 1".to_owned(),
            "switchyard_tenant_ttft_seconds_sum{tenant=\"team-a\",model=\"chat\"} 0.3".to_owned(),
            "switchyard_tenant_ttft_seconds_bucket{le=\"0.25\",tenant=\"team-a\",model=\"chat\"} 0".to_owned(),
            "switchyard_tenant_ttft_seconds_bucket{le=\"0.5\",tenant=\"team-a\",model=\"chat\"} 1".to_owned(),
            "switchyard_tenant_ttft_seconds_bucket{le=\"+Inf\",tenant=\"team-a\",model=\"chat\"} 1".to_owned(),
            "switchyard_tenant_request_duration_seconds_count{tenant=\"team-a\",model=\"chat\"} 2".to_owned(),
            "switchyard_tenant_request_duration_seconds_bucket{le=\"0.05\",tenant=\"team-a\",model=\"chat\"} 1".to_owned(),
            "switchyard_tenant_request_duration_seconds_bucket{le=\"1.0\",tenant=\"team-a\",model=\"chat\"} 1".to_owned(),
            "switchyard_tenant_request_duration_seconds_bucket{le=\"2.5\",tenant=\"team-a\",model=\"chat\"} 2".to_owned(),
        ] {
            assert!(has(&text, &line), "missing {line}\n{text}");
        }
        // Outcomes that did not happen have no series.
        assert!(!text.contains("outcome=\"client_error\""), "{text}");
    }

    #[test]
    fn rejections_take_model_labels_from_configuration_only() {
        let store = Arc::new(ConfigStore::default());
        let yaml = "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {name: p}\n\
                    spec: {model: m, endpoints: [\"127.0.0.1:1\"]}\n---\n\
                    apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {name: chat}\n\
                    spec: {targets: [{pool: p}]}\n";
        store
            .apply(switchyard_snapshot::load_str("test", yaml).unwrap())
            .unwrap();
        let table = store.current().unwrap();
        let metrics = Metrics::new(store);
        metrics.rejected(&table, Some("team-a"), "chat", "model_not_allowed");
        metrics.rejected(&table, Some("team-a"), "made-up", "model_not_found");
        metrics.rejected_early(None, "unauthenticated");
        let text = text(&metrics);
        for line in [
            "switchyard_tenant_rejections_total{tenant=\"team-a\",model=\"chat\",reason=\"model_not_allowed\"} 1",
            "switchyard_tenant_rejections_total{tenant=\"team-a\",model=\"unknown\",reason=\"model_not_found\"} 1",
            "switchyard_tenant_rejections_total{tenant=\"anonymous\",model=\"unknown\",reason=\"unauthenticated\"} 1",
        ] {
            assert!(has(&text, line), "missing {line}\n{text}");
        }
    }

    #[test]
    fn the_collector_reads_the_live_table_when_scraped() {
        let store = Arc::new(ConfigStore::default());
        let metrics = Metrics::new(store.clone());
        // No table yet: no pools, no worker or version families.
        let empty = text(&metrics);
        assert!(!empty.contains("switchyard_config_version"), "{empty}");
        assert!(!empty.contains("switchyard_kv_index_blocks"), "{empty}");

        let yaml = "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {name: p}\n\
                    spec: {model: m, blockSize: 4, endpoints: [\"127.0.0.1:1\", \"127.0.0.1:2\"]}\n";
        store
            .apply(switchyard_snapshot::load_str("test", yaml).unwrap())
            .unwrap();
        let table = store.current().unwrap();
        let pool = table.pools().next().unwrap();
        pool.kv.decisions.cache_hit.fetch_add(3, Ordering::Relaxed);
        pool.kv
            .stream_stats(pool.slots[1])
            .gaps_replayed
            .fetch_add(2, Ordering::Relaxed);
        let text = text(&metrics);
        for line in [
            "# TYPE switchyard_kv_index_blocks gauge",
            "switchyard_kv_index_blocks{pool=\"default/p\"} 0",
            "switchyard_kv_index_prefixes{pool=\"default/p\"} 0",
            "# TYPE switchyard_kv_events_applied counter",
            "switchyard_kv_events_applied_total{pool=\"default/p\"} 0",
            "switchyard_kv_orphan_blocks_total{pool=\"default/p\"} 0",
            "switchyard_kv_malformed_events_total{pool=\"default/p\"} 0",
            "switchyard_kv_event_batches_total{pool=\"default/p\",worker=\"127.0.0.1:1\"} 0",
            "switchyard_kv_event_gaps_replayed_total{pool=\"default/p\",worker=\"127.0.0.1:2\"} 2",
            "switchyard_kv_event_gaps_cleared_total{pool=\"default/p\",worker=\"127.0.0.1:2\"} 0",
            "switchyard_kv_publisher_restarts_total{pool=\"default/p\",worker=\"127.0.0.1:1\"} 0",
            "switchyard_kv_decode_errors_total{pool=\"default/p\",worker=\"127.0.0.1:1\"} 0",
            "switchyard_routing_decisions_total{pool=\"default/p\",outcome=\"cache_hit\"} 3",
            "switchyard_routing_decisions_total{pool=\"default/p\",outcome=\"spread\"} 0",
            "switchyard_worker_requests_waiting{pool=\"default/p\",worker=\"127.0.0.1:1\"} 0",
            "switchyard_worker_requests_running{pool=\"default/p\",worker=\"127.0.0.1:2\"} 0",
            "switchyard_worker_requests_in_flight{pool=\"default/p\",worker=\"127.0.0.1:2\"} 0",
            "# HELP switchyard_config_version Version of the live configuration snapshot.",
            "switchyard_config_version 1",
        ] {
            assert!(has(&text, line), "missing {line}\n{text}");
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn series_past_the_cap_fold_into_tenant_other() {
        let metrics = metrics();
        for tenant in 0..MAX_SERIES {
            let tenant = format!("t{tenant}");
            metrics.request_series(Some(&tenant), "chat", "pool default/p");
            metrics.rejected_early(Some(&tenant), "unauthenticated");
        }
        // Known series keep their labels; a new tenant counts as `other`.
        let known = metrics.request_series(Some("t7"), "chat", "pool default/p");
        assert_eq!(known.tenant, "t7");
        let late = metrics.request_series(Some("late"), "chat", "pool default/p");
        assert_eq!(late.tenant, OTHER);
        assert!(Arc::ptr_eq(
            &late,
            &metrics.request_series(Some("later"), "chat", "pool default/p")
        ));
        late.finished(&Finished {
            status: 200,
            usage: Usage::default(),
            ttft: None,
            total: Duration::from_millis(5),
        });
        metrics.rejected_early(Some("late"), "unauthenticated");
        metrics.rejected_early(Some("later"), "unauthenticated");
        metrics.rejected_early(Some("t7"), "unauthenticated");
        let text = text(&metrics);
        for line in [
            "switchyard_tenant_requests_total{tenant=\"other\",model=\"chat\",target=\"pool default/p\",outcome=\"success\"} 1",
            "switchyard_tenant_rejections_total{tenant=\"other\",model=\"unknown\",reason=\"unauthenticated\"} 2",
            "switchyard_tenant_rejections_total{tenant=\"t7\",model=\"unknown\",reason=\"unauthenticated\"} 2",
        ] {
            assert!(has(&text, line), "missing {line}\n{text}");
        }
        assert!(!text.contains("tenant=\"late"), "{text}");

        for rule in 0..MAX_RULE_LABELS {
            metrics.policy_decision(&format!("default/p/r{rule}"), "route");
        }
        metrics.policy_decision("default/p/late", "route");
        let text = metrics.encode().unwrap();
        assert!(has(
            &text,
            "switchyard_policy_decisions_total{rule=\"other\",outcome=\"route\"} 1"
        ));
    }
}
