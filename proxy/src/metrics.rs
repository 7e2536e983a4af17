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
use crate::peers::PeerCounts;
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
    peer_datagrams: PeerCounts,
    peer_pieces: PeerCounts,
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
        let peer_datagrams = PeerCounts::default();
        registry.register(
            "switchyard_peer_datagrams",
            "Ledger datagrams received from other gateway replicas (--peers), by outcome: \
             heard, unknown_host (not a host the peers resolve to), unauthenticated (not tagged \
             under this replica's --peers-key-file key), stale (sent over 30 s ago: a replay, or \
             the hosts' clocks apart), malformed",
            peer_datagrams.family(),
        );
        let peer_pieces = PeerCounts::default();
        registry.register(
            "switchyard_peer_prompt_pieces",
            "Prompt pieces (token ids of prompt text, --peer-prompt-pieces) exchanged with other \
             gateway replicas, by outcome: sent (by this replica), adopted (heard and new to a \
             tokenizer here: that text is looked up, not tokenized), known (heard, held \
             already or refused), unused (heard for a tokenizer no pool here has)",
            peer_pieces.family(),
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
            peer_datagrams,
            peer_pieces,
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

    /// The family the peer service counts the other replicas' datagrams in.
    pub fn peer_datagrams(&self) -> PeerCounts {
        self.peer_datagrams.clone()
    }

    /// The family the peer service counts the prompt pieces sent and heard in.
    pub fn peer_pieces(&self) -> PeerCounts {
        self.peer_pieces.clone()
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

mod series;
mod state;

use series::SeriesCache;
pub use series::{Finished, RequestSeries};
use state::StateCollector;

#[cfg(test)]
mod tests;
