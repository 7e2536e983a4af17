//! Runtime routing tables: the single place a [`Snapshot`] becomes something requests can use.
//!
//! A table is built off the request path whenever a snapshot arrives and is then only read.
//! Per-worker state that must outlive a snapshot (requests in flight from this proxy) lives in an
//! [`EndpointRegistry`] and is shared by every table that names the same worker address.

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rand::Rng;
use switchyard_kv::index::WorkerId;
use switchyard_kv::tokenize::{PromptTokenizer, TokenizeError};
use switchyard_snapshot::snapshot::LoadBalancing;
use switchyard_snapshot::{Model, ModelTarget, Pool, PoolId, Snapshot};

use crate::kv::{KvRegistry, PoolKv, WorkerLoad};

/// One worker as this proxy sees it.
#[derive(Debug)]
pub struct WorkerState {
    /// `host:port` as configured.
    pub address: String,
    /// Resolved when the table was built; `None` when the name did not resolve.
    pub socket: Option<SocketAddr>,
    in_flight: AtomicUsize,
    /// Uncached prompt tokens this proxy sent that have not produced a first token yet.
    pending_prefill_tokens: AtomicUsize,
    /// Queue as the worker's metrics report it.
    pub load: Arc<WorkerLoad>,
}

impl WorkerState {
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    pub fn pending_prefill_tokens(&self) -> usize {
        self.pending_prefill_tokens.load(Ordering::Relaxed)
    }
}

/// Counts prefill work sent to a worker until its first token (or the end of the request).
#[derive(Debug)]
pub struct PendingPrefill {
    worker: Arc<WorkerState>,
    tokens: usize,
}

impl PendingPrefill {
    pub fn start(worker: &Arc<WorkerState>, tokens: usize) -> PendingPrefill {
        worker
            .pending_prefill_tokens
            .fetch_add(tokens, Ordering::Relaxed);
        PendingPrefill {
            worker: worker.clone(),
            tokens,
        }
    }
}

impl Drop for PendingPrefill {
    fn drop(&mut self) {
        self.worker
            .pending_prefill_tokens
            .fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

/// Counts a request against a worker for as long as it lives.
#[derive(Debug)]
pub struct InFlight(Arc<WorkerState>);

impl InFlight {
    pub fn start(worker: &Arc<WorkerState>) -> InFlight {
        worker.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(worker.clone())
    }

    pub fn worker(&self) -> &Arc<WorkerState> {
        &self.0
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Worker state shared across snapshots, keyed by address.
#[derive(Debug, Default)]
pub struct EndpointRegistry {
    workers: Mutex<HashMap<String, Arc<WorkerState>>>,
}

impl EndpointRegistry {
    /// The state for `address`, created (and resolved) the first time it is seen.
    fn worker(&self, address: &str) -> Arc<WorkerState> {
        let mut workers = match self.workers.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        if let Some(existing) = workers.get(address)
            && existing.socket.is_some()
        {
            return existing.clone();
        }
        let socket = address.to_socket_addrs().ok().and_then(|mut a| a.next());
        if socket.is_none() {
            tracing::warn!(
                worker = address,
                "worker address does not resolve; it will not be chosen"
            );
        }
        let state = Arc::new(WorkerState {
            address: address.to_owned(),
            socket,
            in_flight: AtomicUsize::new(0),
            pending_prefill_tokens: AtomicUsize::new(0),
            load: Arc::default(),
        });
        workers.insert(address.to_owned(), state.clone());
        state
    }

    /// Forget workers no table uses any more.
    fn retain(&self, live: &[Arc<WorkerState>]) {
        let mut workers = match self.workers.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        workers.retain(|address, _| live.iter().any(|w| &w.address == address));
    }
}

/// A pool ready for routing.
#[derive(Debug)]
pub struct PoolRuntime {
    pub config: Pool,
    pub workers: Vec<Arc<WorkerState>>,
    /// Each worker's slot in the pool's prefix index (same order as `workers`).
    pub slots: Vec<WorkerId>,
    pub kv: Arc<PoolKv>,
    /// Set for cache-aware pools: renders and tokenizes prompts as the workers do.
    pub tokenizer: Option<Arc<PromptTokenizer>>,
    next_round_robin: AtomicUsize,
}

impl PoolRuntime {
    /// Choose a worker not in `exclude` (indexes into `workers`), by the pool's policy.
    pub fn pick(&self, exclude: &[usize]) -> Option<usize> {
        let eligible = |index: &usize| {
            !exclude.contains(index) && self.workers.get(*index).is_some_and(|w| w.socket.is_some())
        };
        let count = self.workers.len();
        if count == 0 {
            return None;
        }
        match self.config.load_balancing {
            LoadBalancing::Random => {
                let candidates: Vec<usize> = (0..count).filter(eligible).collect();
                let choice = rand::rng().random_range(0..candidates.len().max(1));
                candidates.get(choice).copied()
            }
            LoadBalancing::RoundRobin => {
                let start = self.next_round_robin.fetch_add(1, Ordering::Relaxed);
                (0..count)
                    .map(|offset| (start + offset) % count)
                    .find(eligible)
            }
            // Without a prompt to score (or as a fallback), cache-aware behaves as least-outstanding.
            LoadBalancing::LeastOutstanding | LoadBalancing::CacheAware => {
                let mut rng = rand::rng();
                let mut best: Option<(usize, usize)> = None;
                let mut ties = 0u32;
                for index in (0..count).filter(eligible) {
                    let load = self
                        .workers
                        .get(index)
                        .map_or(usize::MAX, |w| w.in_flight());
                    match best {
                        Some((_, best_load)) if load > best_load => {}
                        Some((_, best_load)) if load == best_load => {
                            // Reservoir sampling keeps ties uniformly spread.
                            ties += 1;
                            if rng.random_range(0..=ties) == 0 {
                                best = Some((index, load));
                            }
                        }
                        _ => {
                            best = Some((index, load));
                            ties = 0;
                        }
                    }
                }
                best.map(|(index, _)| index)
            }
        }
    }
}

/// Everything the request path reads, built from one snapshot.
#[derive(Debug)]
pub struct RoutingTable {
    pub snapshot: Arc<Snapshot>,
    /// Unix time the table was built (what `/v1/models` reports as `created`).
    pub created_at: u64,
    pools: HashMap<PoolId, Arc<PoolRuntime>>,
}

impl RoutingTable {
    /// Build the tables of a snapshot. Fails only when a pool's tokenizer cannot be loaded.
    pub fn build(
        snapshot: Arc<Snapshot>,
        registry: &EndpointRegistry,
        kv: &KvRegistry,
    ) -> Result<RoutingTable, TokenizeError> {
        let mut pools = HashMap::with_capacity(snapshot.pools.len());
        let mut live = Vec::new();
        for (id, pool) in &snapshot.pools {
            let workers: Vec<Arc<WorkerState>> = pool
                .endpoints
                .iter()
                .map(|endpoint| registry.worker(&endpoint.address))
                .collect();
            live.extend(workers.iter().cloned());
            let pool_kv = kv.pool(id, pool.block_size as usize);
            let slots = workers.iter().map(|w| pool_kv.slot(&w.address)).collect();
            let tokenizer = match pool.load_balancing {
                LoadBalancing::CacheAware => Some(kv.tokenizer(&pool.tokenizer)?),
                _ => None,
            };
            pools.insert(
                id.clone(),
                Arc::new(PoolRuntime {
                    config: pool.clone(),
                    workers,
                    slots,
                    kv: pool_kv,
                    tokenizer,
                    next_round_robin: AtomicUsize::new(0),
                }),
            );
        }
        registry.retain(&live);
        kv.retain(&snapshot.pools.keys().cloned().collect::<Vec<_>>());
        let created_at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Ok(RoutingTable {
            snapshot,
            created_at,
            pools,
        })
    }

    pub fn pools(&self) -> impl Iterator<Item = &Arc<PoolRuntime>> {
        self.pools.values()
    }

    pub fn model(&self, name: &str) -> Option<&Model> {
        self.snapshot.models.get(name)
    }

    pub fn pool(&self, id: &PoolId) -> Option<&Arc<PoolRuntime>> {
        self.pools.get(id)
    }

    /// Choose one of a model's targets by weight.
    pub fn pick_target<'m>(&self, model: &'m Model) -> Option<&'m ModelTarget> {
        let total: u64 = model.targets.iter().map(|t| u64::from(t.weight)).sum();
        if total == 0 {
            return None;
        }
        let mut ticket = rand::rng().random_range(0..total);
        for target in &model.targets {
            let weight = u64::from(target.weight);
            if ticket < weight {
                return Some(target);
            }
            ticket -= weight;
        }
        model.targets.last()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(load_balancing: &str, endpoints: &[&str]) -> RoutingTable {
        let yaml = format!(
            "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: p}}\n\
             spec: {{model: m, loadBalancing: {load_balancing}, endpoints: [{}]}}\n---\n\
             apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: m}}\n\
             spec: {{targets: [{{pool: p}}]}}\n",
            endpoints.join(", ")
        );
        let snapshot = switchyard_snapshot::load_str("test", &yaml).unwrap();
        RoutingTable::build(
            Arc::new(snapshot),
            &EndpointRegistry::default(),
            &KvRegistry::default(),
        )
        .unwrap()
    }

    fn pool(table: &RoutingTable) -> &Arc<PoolRuntime> {
        table.pool(&PoolId::new("default", "p")).unwrap()
    }

    #[test]
    fn round_robin_visits_every_worker_in_turn() {
        let table = table(
            "round-robin",
            &["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"],
        );
        let picks: Vec<usize> = (0..6).map(|_| pool(&table).pick(&[]).unwrap()).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        assert_eq!(pool(&table).pick(&[0, 1, 2]), None);
        assert_eq!(pool(&table).pick(&[0, 2]), Some(1));
    }

    #[test]
    fn least_outstanding_prefers_the_idle_worker() {
        let table = table("least-outstanding", &["127.0.0.1:1", "127.0.0.1:2"]);
        let pool = pool(&table);
        let _busy = InFlight::start(&pool.workers[0]);
        for _ in 0..20 {
            assert_eq!(pool.pick(&[]), Some(1));
        }
        assert_eq!(pool.pick(&[1]), Some(0));
    }

    #[test]
    fn random_spreads_and_respects_exclusions() {
        let table = table("random", &["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]);
        let mut seen = [0usize; 3];
        for _ in 0..300 {
            seen[pool(&table).pick(&[]).unwrap()] += 1;
        }
        assert!(seen.iter().all(|&n| n > 0), "{seen:?}");
        for _ in 0..50 {
            assert_eq!(pool(&table).pick(&[0, 2]), Some(1));
        }
    }

    #[test]
    fn in_flight_counts_survive_a_new_snapshot() {
        let registry = EndpointRegistry::default();
        let first = table("least-outstanding", &["127.0.0.1:1"]);
        let snapshot = first.snapshot.clone();
        let kv = KvRegistry::default();
        let a = RoutingTable::build(snapshot.clone(), &registry, &kv).unwrap();
        let guard = InFlight::start(&pool(&a).workers[0]);
        let b = RoutingTable::build(snapshot, &registry, &kv).unwrap();
        assert_eq!(pool(&b).workers[0].in_flight(), 1);
        drop(guard);
        assert_eq!(pool(&b).workers[0].in_flight(), 0);
    }
}
