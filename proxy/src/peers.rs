//! Other gateway replicas' ledgers ("shared hints").
//!
//! Several proxy replicas in front of the same workers each know their own requests exactly and
//! at once, and everyone else's only through the workers' gauges, a scrape late and as bare
//! counts: a request another replica is prefilling shows as one "running" request, not as the
//! thousands of prompt tokens ahead of the next one. So each replica reads the others' ledgers
//! (the `switchyard_worker_*` gauges of their `/metrics`: pending prefills, their tokens and how
//! long the worker has been on the oldest, requests in flight, KV blocks reserved) every
//! `--peer-interval-ms` and counts them like its own, a peer interval late; the workers' gauges
//! then only add what no replica explains.
//! Their arrival rates (`switchyard_pool_arrival_rate`, each replica's own) are added to this
//! one's: the scorer's fleet charge ([`crate::scorer`]) is about every request that will arrive
//! behind a choice, not only those that come through this replica.
//!
//! Peers are `host:port` of the other replicas' operator listeners, each name resolved every
//! round to all its addresses (a Kubernetes headless Service names every replica), so a replica
//! may list itself: it recognises its own `switchyard_instance_info` and skips it. A peer that
//! does not answer counts for nothing until it does.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;

use crate::config::ConfigStore;
pub use crate::kv::PeerLedger;
use crate::kv::{label_value, sample};

/// This process's id among replicas (random, fixed for its life).
pub fn instance_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| format!("{:016x}", rand::random::<u64>()))
}

/// What one replica reports: its ledger per worker address, and its arrival rate per pool.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ReplicaLedger {
    pub workers: HashMap<String, PeerLedger>,
    /// Requests per second the replica routes into each pool (by pool id, `namespace/name`).
    pub arrival_rates: HashMap<String, f64>,
}

impl ReplicaLedger {
    fn add(&mut self, other: ReplicaLedger) {
        for (worker, ledger) in other.workers {
            self.workers.entry(worker).or_default().add(&ledger);
        }
        for (pool, rate) in other.arrival_rates {
            *self.arrival_rates.entry(pool).or_default() += rate;
        }
    }
}

/// One replica's ledger from its `/metrics`; `None` when it is this process. A worker in
/// several pools appears once per pool with the same figures (the ledger is per worker): the
/// largest is kept.
pub fn parse_ledger(text: &str) -> Option<ReplicaLedger> {
    let mut replica = ReplicaLedger::default();
    for line in text.lines() {
        let Some((name, value)) = sample(line) else {
            continue;
        };
        if name == "switchyard_instance_info" {
            if label_value(line, "instance") == Some(instance_id()) {
                return None;
            }
            continue;
        }
        if name == "switchyard_pool_arrival_rate" {
            if let Some(pool) = label_value(line, "pool")
                && value.is_finite()
                && value > 0.0
            {
                replica.arrival_rates.insert(pool.to_owned(), value);
            }
            continue;
        }
        if name == "switchyard_worker_prefill_elapsed_seconds" {
            if let Some(worker) = label_value(line, "worker")
                && value.is_finite()
            {
                let ledger = replica.workers.entry(worker.to_owned()).or_default();
                let micros = (value.max(0.0) * 1e6) as u64;
                ledger.prefill_elapsed_us = ledger.prefill_elapsed_us.max(micros);
            }
            continue;
        }
        let field: fn(&mut PeerLedger) -> &mut u64 = match name {
            "switchyard_worker_prefills_pending" => |l| &mut l.prefills,
            "switchyard_worker_prefill_tokens_pending" => |l| &mut l.prefill_tokens,
            "switchyard_worker_requests_in_flight" => |l| &mut l.in_flight,
            "switchyard_worker_kv_blocks_reserved" => |l| &mut l.kv_blocks,
            _ => continue,
        };
        let Some(worker) = label_value(line, "worker") else {
            continue;
        };
        let slot = field(replica.workers.entry(worker.to_owned()).or_default());
        *slot = (*slot).max(value.max(0.0) as u64);
    }
    Some(replica)
}

/// Reads the peers' ledgers into the live table's workers.
pub struct PeerService {
    pub store: Arc<ConfigStore>,
    /// `host:port` of the replicas' operator listeners (names resolve to every address).
    pub peers: Vec<String>,
    pub interval: Duration,
}

impl PeerService {
    /// One round: every peer's ledger, summed per worker and per pool.
    async fn read(&self, client: &reqwest::Client) -> ReplicaLedger {
        let mut addresses = Vec::new();
        for peer in &self.peers {
            match tokio::net::lookup_host(peer.as_str()).await {
                Ok(resolved) => addresses.extend(resolved),
                Err(error) => {
                    tracing::debug!(peer = peer.as_str(), %error, "peer does not resolve")
                }
            }
        }
        addresses.sort();
        addresses.dedup();
        let mut total = ReplicaLedger::default();
        for address in addresses {
            let text = match client.get(format!("http://{address}/metrics")).send().await {
                Ok(response) if response.status().is_success() => response.text().await.ok(),
                _ => None,
            };
            if let Some(replica) = text.as_deref().and_then(parse_ledger) {
                total.add(replica);
            }
        }
        total
    }

    fn apply(&self, peers: &ReplicaLedger) {
        let Some(table) = self.store.current() else {
            return;
        };
        for pool in table.pools() {
            let rate = peers.arrival_rates.get(&pool.config.id.0).copied();
            pool.kv.set_peer_arrival_rate(rate.unwrap_or(0.0));
            for worker in &pool.workers {
                let ledger = peers
                    .workers
                    .get(&worker.address)
                    .copied()
                    .unwrap_or_default();
                worker.load.set_peers(ledger);
            }
        }
    }
}

#[async_trait]
impl BackgroundService for PeerService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let client = reqwest::Client::builder()
            .timeout(self.interval.max(Duration::from_millis(250)) * 2)
            .build()
            .unwrap_or_default();
        let mut ticker = tokio::time::interval(self.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = shutdown.changed() => break,
            }
            let ledgers = self.read(&client).await;
            self.apply(&ledgers);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replicas_ledger_is_read_per_worker_and_this_one_is_skipped() {
        let text = "# HELP switchyard_instance_info x\nswitchyard_instance_info{instance=\"other\"} 1\n\
             switchyard_worker_prefills_pending{pool=\"default/a\",worker=\"10.0.0.1:8000\"} 2\n\
             switchyard_worker_prefill_tokens_pending{pool=\"default/a\",worker=\"10.0.0.1:8000\"} 3000\n\
             switchyard_worker_requests_in_flight{pool=\"default/a\",worker=\"10.0.0.1:8000\"} 5\n\
             switchyard_worker_requests_in_flight{pool=\"default/b\",worker=\"10.0.0.1:8000\"} 5\n\
             switchyard_worker_kv_blocks_reserved{pool=\"default/a\",worker=\"10.0.0.1:8000\"} 90\n\
             switchyard_worker_prefill_elapsed_seconds{pool=\"default/a\",worker=\"10.0.0.1:8000\"} 0.25\n\
             switchyard_worker_requests_in_flight{pool=\"default/a\",worker=\"10.0.0.2:8000\"} 1\n\
             switchyard_worker_requests_waiting{pool=\"default/a\",worker=\"10.0.0.2:8000\"} 7\n\
             switchyard_pool_arrival_rate{pool=\"default/a\"} 12.5\n\
             switchyard_pool_arrival_rate{pool=\"default/b\"} 0\n";
        let replica = parse_ledger(text).unwrap();
        assert_eq!(replica.arrival_rates.len(), 1);
        assert_eq!(replica.arrival_rates["default/a"], 12.5);
        let ledgers = &replica.workers;
        assert_eq!(
            ledgers["10.0.0.1:8000"],
            PeerLedger {
                prefills: 2,
                prefill_tokens: 3000,
                in_flight: 5,
                kv_blocks: 90,
                prefill_elapsed_us: 250_000,
            }
        );
        assert_eq!(
            ledgers["10.0.0.2:8000"],
            PeerLedger {
                in_flight: 1,
                ..Default::default()
            }
        );
        let own = text.replace("\"other\"", &format!("\"{}\"", instance_id()));
        assert_eq!(parse_ledger(&own), None);
    }

    #[test]
    fn replicas_ledgers_and_arrival_rates_add_up() {
        let replica = |name: &str, rate: f64, tokens: u64| {
            format!(
                "switchyard_instance_info{{instance=\"{name}\"}} 1\n\
                 switchyard_worker_prefill_tokens_pending{{pool=\"default/a\",worker=\"w\"}} {tokens}\n\
                 switchyard_pool_arrival_rate{{pool=\"default/a\"}} {rate}\n"
            )
        };
        let mut total = ReplicaLedger::default();
        total.add(parse_ledger(&replica("r1", 2.0, 100)).unwrap());
        total.add(parse_ledger(&replica("r2", 3.5, 50)).unwrap());
        assert_eq!(total.arrival_rates["default/a"], 5.5);
        assert_eq!(total.workers["w"].prefill_tokens, 150);
    }
}
