//! What `/metrics` reads when scraped from state kept elsewhere: prefix indexes, KV event
//! streams, routing decisions, worker queues, the configuration version.

use switchyard_snapshot::snapshot::LoadBalancing;

use super::*;
use crate::calibration::Coefficients;

/// Exports, when scraped, the state kept elsewhere: per pool its prefix index and routing
/// decisions, per worker its KV event stream and queues, and the configuration version.
pub(super) struct StateCollector {
    pub(super) store: Arc<ConfigStore>,
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
            "switchyard_kv_assumed_blocks",
            "Blocks workers without KV events are assumed to hold, from the prompts they prefilled.",
            per_pool(|p| p.predictions.history.blocks() as u64).map(gauge),
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

        family(
            encoder,
            "switchyard_pool_tokenizer_agrees",
            "Whether the pool's tokenizer gives a probe prompt the token ids a worker gives it (1), or other ids (0: routing cannot find such prompts in the workers' caches); absent until a worker answered.",
            pools.iter().flat_map(|pool| {
                crate::kv::ProbeKind::ALL.into_iter().filter_map(|kind| {
                    let agrees = pool.tokenizer_agreement.agrees(kind)?;
                    Some((
                        [("pool", pool.id.0.as_str()), ("prompt", kind.label())],
                        ConstGauge::new(u64::from(agrees)),
                    ))
                })
            }),
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
                    ("replicate", &decisions.replicate),
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
        // The ledger of each worker read once: its five gauges are one moment's.
        let ledgers: Vec<_> = workers().map(|(labels, w)| (labels, w.ledger())).collect();
        let ledger = || ledgers.iter().map(|(labels, ledger)| (*labels, ledger));
        family(
            encoder,
            "switchyard_worker_requests_in_flight",
            "Requests this proxy has in flight to the worker.",
            ledger().map(|(labels, l)| (labels, ConstGauge::new(l.in_flight))),
        )?;
        // The routing ledger: what this proxy counts against each worker right now.
        family(
            encoder,
            "switchyard_worker_prefills_pending",
            "Requests this proxy sent to the worker that have not produced a first token yet.",
            ledger().map(|(labels, l)| (labels, ConstGauge::new(l.prefills))),
        )?;
        family(
            encoder,
            "switchyard_worker_prefill_tokens_pending",
            "Uncached prompt tokens of those requests.",
            ledger().map(|(labels, l)| (labels, ConstGauge::new(l.prefill_tokens))),
        )?;
        family(
            encoder,
            "switchyard_worker_prefill_elapsed_seconds",
            "How long the worker has been on the oldest of those prefills (0 when none is pending).",
            ledger()
                .map(|(labels, l)| (labels, ConstGauge::new(l.prefill_elapsed_us as f64 / 1e6))),
        )?;
        family(
            encoder,
            "switchyard_worker_kv_blocks_reserved",
            "KV blocks this proxy's requests in flight to the worker are expected to hold.",
            ledger().map(|(labels, l)| (labels, ConstGauge::new(l.kv_blocks))),
        )?;
        family(
            encoder,
            "switchyard_pool_arrival_rate",
            "Requests per second this proxy routes into the pool, lately (other replicas' excluded).",
            table.pools().map(|pool| {
                (
                    [("pool", pool.config.id.0.as_str())],
                    ConstGauge::new(pool.kv.own_arrival_rate()),
                )
            }),
        )?;
        // Which replica this is: its datagrams to the other replicas carry the same id.
        family(
            encoder,
            "switchyard_instance_info",
            "This proxy process among gateway replicas (value 1).",
            std::iter::once((
                [("instance", crate::peers::instance_id())],
                ConstGauge::new(1u64),
            )),
        )?;
        // The pools' TTFT model: the coefficients in use and how far off its predictions are.
        let fits: Vec<(String, crate::calibration::Fit)> = table
            .pools()
            .filter(|pool| pool.config.load_balancing == LoadBalancing::CacheAware)
            .map(|pool| {
                let configured = Coefficients::configured(&pool.config.scoring);
                (
                    pool.config.id.0.clone(),
                    pool.kv.calibration.fit(configured),
                )
            })
            .collect();
        family(
            encoder,
            "switchyard_pool_ttft_model_seconds",
            "The pool's TTFT model as learned from its answers: fixed seconds, seconds per prefill token, seconds per (query, key) pair of the prefill's attention, seconds per running request.",
            fits.iter().flat_map(|(pool, fit)| {
                let learned = fit.learned;
                [
                    ("fixed", learned.fixed_s),
                    ("per_prefill_token", learned.prefill_s_per_token),
                    ("per_attention_pair", learned.attention_s_per_pair),
                    ("per_running_request", learned.running_s_per_request),
                ]
                .map(|(term, value)| {
                    (
                        [("pool", pool.as_str()), ("term", term)],
                        ConstGauge::new(value),
                    )
                })
            }),
        )?;
        family(
            encoder,
            "switchyard_pool_ttft_model_observations",
            "Streamed answers the pool's TTFT model learned from.",
            fits.iter().map(|(pool, fit)| {
                (
                    [("pool", pool.as_str())],
                    ConstCounter::new(fit.observations),
                )
            }),
        )?;
        family(
            encoder,
            "switchyard_pool_ttft_model_error",
            "Typical relative error of the pool's TTFT predictions: mean |ln(observed / predicted)|.",
            fits.iter().filter_map(|(pool, fit)| {
                Some(([("pool", pool.as_str())], ConstGauge::new(fit.error?)))
            }),
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
