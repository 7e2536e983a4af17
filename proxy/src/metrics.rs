//! The proxy's own Prometheus metrics (`GET /metrics`): prefix index, KV event streams, worker
//! queues as scraped, and routing decisions.

use std::fmt::Write;
use std::sync::atomic::Ordering;

use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::config::ConfigStore;

/// Most distinct policy-rule label values kept; later ones count under `rule="other"`.
const MAX_RULE_LABELS: usize = 1_000;

/// Policy decisions by (rule, outcome). Rules come from configuration, so the label set is
/// bounded by what operators write (and capped in case of many renames over a long run).
static POLICY_DECISIONS: Mutex<BTreeMap<(String, &'static str), u64>> = Mutex::new(BTreeMap::new());

/// Fallbacks from one target to the next, by (from, to).
static FALLBACKS: Mutex<BTreeMap<(String, String), u64>> = Mutex::new(BTreeMap::new());

/// Requests whose client closed the connection before the answer was complete.
static CLIENT_DISCONNECTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Client connections open now.
static OPEN_CONNECTIONS: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

/// Connections closed or refused by the gateway before a request was read, by reason.
static CONNECTIONS_REFUSED: Mutex<BTreeMap<&'static str, u64>> = Mutex::new(BTreeMap::new());

pub fn connection_opened() {
    OPEN_CONNECTIONS.fetch_add(1, Ordering::Relaxed);
}

pub fn connection_closed() {
    OPEN_CONNECTIONS.fetch_sub(1, Ordering::Relaxed);
}

/// Count a connection the gateway refused or closed for `reason` (a fixed label).
pub fn connection_refused(reason: &'static str) {
    *crate::lock(&CONNECTIONS_REFUSED).entry(reason).or_default() += 1;
}

/// Count a request ended by its client (it hung up mid-answer or sent an unreadable request).
pub fn client_disconnected() {
    CLIENT_DISCONNECTS.fetch_add(1, Ordering::Relaxed);
}

/// Count a move from target `from` to target `to` (labels from configuration).
pub fn fallback(from: &str, to: &str) {
    let mut counts = crate::lock(&FALLBACKS);
    let key = (from.to_owned(), to.to_owned());
    if !counts.contains_key(&key) && counts.len() >= MAX_RULE_LABELS {
        return;
    }
    *counts.entry(key).or_default() += 1;
}

/// Count one policy decision. `rule` is `namespace/policy/rule`, or empty when no rule decided.
pub fn policy_decision(rule: &str, outcome: &'static str) {
    let mut counts = crate::lock(&POLICY_DECISIONS);
    let rule = if rule.is_empty() { "none" } else { rule };
    let key = (rule.to_owned(), outcome);
    if !counts.contains_key(&key) && counts.len() >= MAX_RULE_LABELS {
        *counts.entry(("other".to_owned(), outcome)).or_default() += 1;
        return;
    }
    *counts.entry(key).or_default() += 1;
}

/// Escape a Prometheus label value.
pub(crate) fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Render every metric in Prometheus text format 0.0.4.
pub fn render(store: &ConfigStore) -> String {
    let mut out = String::new();
    let mut pools = store.kv().pools();
    pools.sort_by(|a, b| a.id.cmp(&b.id));
    let mut family = |name: &str, kind: &str, help: &str, samples: Vec<(String, f64)>| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, value) in samples {
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }
    };
    let per_pool = |f: &dyn Fn(&crate::kv::PoolKv) -> f64| -> Vec<(String, f64)> {
        pools
            .iter()
            .map(|p| (format!("pool=\"{}\"", escape(&p.id.0)), f(p)))
            .collect()
    };
    family(
        "switchyard_kv_index_blocks",
        "gauge",
        "Blocks held across workers, as the prefix index knows them.",
        per_pool(&|p| p.index.stored_blocks() as f64),
    );
    family(
        "switchyard_kv_index_prefixes",
        "gauge",
        "Distinct block prefixes in the index.",
        per_pool(&|p| p.index.nodes() as f64),
    );
    family(
        "switchyard_kv_events_applied_total",
        "counter",
        "KV events applied to the index.",
        per_pool(&|p| p.index.stats.events_applied.load(Ordering::Relaxed) as f64),
    );
    family(
        "switchyard_kv_orphan_blocks_total",
        "counter",
        "Stored blocks whose parent was unknown (missed events), not indexed.",
        per_pool(&|p| p.index.stats.orphan_blocks.load(Ordering::Relaxed) as f64),
    );
    family(
        "switchyard_kv_malformed_events_total",
        "counter",
        "BlockStored events inconsistent with the pool's block size.",
        per_pool(&|p| p.index.stats.malformed_events.load(Ordering::Relaxed) as f64),
    );

    let mut per_worker =
        |name: &str, kind: &str, help: &str, value: &dyn Fn(&crate::kv::StreamStats) -> u64| {
            let mut samples = Vec::new();
            for pool in &pools {
                for (address, slot) in pool.workers() {
                    let stats = pool.stream_stats(slot);
                    samples.push((
                        format!(
                            "pool=\"{}\",worker=\"{}\"",
                            escape(&pool.id.0),
                            escape(&address)
                        ),
                        value(&stats) as f64,
                    ));
                }
            }
            family(name, kind, help, samples);
        };
    per_worker(
        "switchyard_kv_event_batches_total",
        "counter",
        "KV event batches received per worker.",
        &|s| s.batches.load(Ordering::Relaxed),
    );
    per_worker(
        "switchyard_kv_event_gaps_replayed_total",
        "counter",
        "Sequence gaps filled from the worker's replay socket.",
        &|s| s.gaps_replayed.load(Ordering::Relaxed),
    );
    per_worker(
        "switchyard_kv_event_gaps_cleared_total",
        "counter",
        "Sequence gaps that could not be filled: the worker's entries were dropped.",
        &|s| s.gaps_cleared.load(Ordering::Relaxed),
    );
    per_worker(
        "switchyard_kv_publisher_restarts_total",
        "counter",
        "Times a worker's event sequence started over.",
        &|s| s.publisher_restarts.load(Ordering::Relaxed),
    );
    per_worker(
        "switchyard_kv_decode_errors_total",
        "counter",
        "Event messages that could not be decoded.",
        &|s| s.decode_errors.load(Ordering::Relaxed),
    );

    let mut decisions = Vec::new();
    for pool in &pools {
        for (outcome, counter) in [
            ("cache_hit", &pool.decisions.cache_hit),
            ("no_cache", &pool.decisions.no_cache),
            ("spread", &pool.decisions.spread),
        ] {
            decisions.push((
                format!("pool=\"{}\",outcome=\"{outcome}\"", escape(&pool.id.0)),
                counter.load(Ordering::Relaxed) as f64,
            ));
        }
    }
    family(
        "switchyard_routing_decisions_total",
        "counter",
        "Cache-aware routing decisions by outcome.",
        decisions,
    );

    family(
        "switchyard_client_disconnects_total",
        "counter",
        "Requests ended by their client: it closed the connection before the answer was complete.",
        vec![(
            String::new(),
            CLIENT_DISCONNECTS.load(Ordering::Relaxed) as f64,
        )],
    );

    family(
        "switchyard_open_connections",
        "gauge",
        "Client connections open now.",
        vec![(
            String::new(),
            OPEN_CONNECTIONS.load(Ordering::Relaxed) as f64,
        )],
    );
    let refused: Vec<(String, f64)> = crate::lock(&CONNECTIONS_REFUSED)
        .iter()
        .map(|(reason, count)| (format!("reason=\"{reason}\""), *count as f64))
        .collect();
    family(
        "switchyard_connections_refused_total",
        "counter",
        "Connections refused or closed before a request was read: total_limit, client_limit, \
         head_timeout, head_too_large, malformed_head.",
        refused,
    );

    let policy: Vec<(String, f64)> = {
        let counts = crate::lock(&POLICY_DECISIONS);
        counts
            .iter()
            .map(|((rule, outcome), count)| {
                (
                    format!("rule=\"{}\",outcome=\"{outcome}\"", escape(rule)),
                    *count as f64,
                )
            })
            .collect()
    };
    let fallbacks: Vec<(String, f64)> = {
        let counts = crate::lock(&FALLBACKS);
        counts
            .iter()
            .map(|((from, to), count)| {
                (
                    format!("from=\"{}\",to=\"{}\"", escape(from), escape(to)),
                    *count as f64,
                )
            })
            .collect()
    };
    family(
        "switchyard_target_fallbacks_total",
        "counter",
        "Requests moved to the next target of their model (connect failure or 5xx before the first byte).",
        fallbacks,
    );
    family(
        "switchyard_policy_decisions_total",
        "counter",
        "Inference-policy decisions by rule (none: no rule decided) and outcome.",
        policy,
    );

    if let Some(table) = store.current() {
        let mut waiting = Vec::new();
        let mut running = Vec::new();
        let mut in_flight = Vec::new();
        for pool in table.pools() {
            for worker in &pool.workers {
                let labels = format!(
                    "pool=\"{}\",worker=\"{}\"",
                    escape(&pool.config.id.0),
                    escape(&worker.address)
                );
                waiting.push((labels.clone(), worker.load.waiting() as f64));
                running.push((labels.clone(), worker.load.running() as f64));
                in_flight.push((labels, worker.in_flight() as f64));
            }
        }
        family(
            "switchyard_worker_requests_waiting",
            "gauge",
            "Waiting requests the worker last reported.",
            waiting,
        );
        family(
            "switchyard_worker_requests_running",
            "gauge",
            "Running requests the worker last reported.",
            running,
        );
        family(
            "switchyard_worker_requests_in_flight",
            "gauge",
            "Requests this proxy has in flight to the worker.",
            in_flight,
        );
        family(
            "switchyard_config_version",
            "gauge",
            "Version of the live configuration snapshot.",
            vec![(String::new(), table.snapshot.version as f64)],
        );
    }
    crate::accounting::render(&mut out);
    out
}
