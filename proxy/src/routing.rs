//! Runtime routing tables: the single place a [`Snapshot`] becomes something requests can use.
//!
//! A table is built off the request path whenever a snapshot arrives and is then only read.
//! Per-worker state that must outlive a snapshot (requests in flight from this proxy) lives in an
//! [`EndpointRegistry`] and is shared by every table that names the same worker address.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rand::Rng;
use sha2::{Digest, Sha256};
use switchyard_kv::index::WorkerId;
use switchyard_kv::tokenize::{PromptTokenizer, TokenizeError};
use switchyard_policy::Evaluator;
use switchyard_policy::classify::ClassifierError;
use switchyard_snapshot::snapshot::{Backend, LoadBalancing, ProviderId, TargetStrategy, Tenant};
use switchyard_snapshot::{ModelTarget, Pool, PoolId, Snapshot};

use crate::kv::{KvRegistry, PoolKv};
pub use crate::provider::ProviderRuntime;
pub use crate::worker::{
    EndpointRegistry, InFlight, KvReservation, PendingPrefill, Prefill, WorkerState,
};

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
    /// For the worker at `index` when it publishes no KV events (its endpoint names no
    /// `kvEvents`), the cache size its [`crate::history::RoutedHistory`] is kept to: its usable
    /// blocks as its metrics report them, else
    /// [`crate::history::UNREPORTED_CAPACITY_BLOCKS`]. `None` for a worker whose events say what
    /// it holds.
    pub fn history_capacity(&self, index: usize) -> Option<usize> {
        let endpoint = self.config.endpoints.get(index)?;
        let worker = self.workers.get(index)?;
        endpoint
            .kv_events
            .is_none()
            .then(|| match worker.load.capacity_blocks() {
                0 => crate::history::UNREPORTED_CAPACITY_BLOCKS,
                blocks => usize::try_from(blocks).unwrap_or(usize::MAX),
            })
    }

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

/// Why a snapshot could not become a routing table (the current one stays).
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(transparent)]
    Tokenizer(#[from] TokenizeError),
    #[error("policies: {0}")]
    Policies(#[from] ClassifierError),
    #[error("ExternalProvider {provider}: {message}")]
    Provider {
        provider: ProviderId,
        message: String,
    },
}

/// Compare two digests without an early exit, so timing does not reveal how much matched.
fn digests_equal(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let difference = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(difference) == 0
}

fn parse_digest(hex: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    let bytes = hex.as_bytes();
    if bytes.len() != 64 {
        return None;
    }
    for (slot, pair) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        let text = std::str::from_utf8(pair).ok()?;
        *slot = u8::from_str_radix(text, 16).ok()?;
    }
    Some(out)
}

/// Who a request authenticated as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caller<'t> {
    /// Authentication is off (no Tenant documents).
    Open,
    Tenant(&'t Tenant),
}

impl<'t> Caller<'t> {
    pub fn tenant(self) -> Option<&'t Tenant> {
        match self {
            Caller::Open => None,
            Caller::Tenant(tenant) => Some(tenant),
        }
    }
}

/// Why a request was not authenticated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    MissingKey,
    UnknownKey,
}

/// Where one request goes.
#[derive(Debug, Clone)]
pub enum Destination {
    Pool(Arc<PoolRuntime>),
    Provider(Arc<ProviderRuntime>),
}

/// Everything the request path reads, built from one snapshot.
#[derive(Debug)]
pub struct RoutingTable {
    pub snapshot: Arc<Snapshot>,
    /// Unix time the table was built (what `/v1/models` reports as `created`).
    pub created_at: u64,
    pools: HashMap<PoolId, Arc<PoolRuntime>>,
    providers: HashMap<ProviderId, Arc<ProviderRuntime>>,
    pub evaluator: Evaluator,
    /// SHA-256 of every API key, with its tenant's name.
    keys: Vec<([u8; 32], String)>,
}

impl RoutingTable {
    /// Build the tables of a snapshot. Fails only when a pool's tokenizer cannot be loaded.
    pub fn build(
        snapshot: Arc<Snapshot>,
        registry: &EndpointRegistry,
        kv: &KvRegistry,
    ) -> Result<RoutingTable, BuildError> {
        let evaluator = Evaluator::new(&snapshot)?;
        let mut providers = HashMap::with_capacity(snapshot.providers.len());
        for (id, provider) in &snapshot.providers {
            providers.insert(
                id.clone(),
                Arc::new(ProviderRuntime::build(provider).map_err(|message| {
                    BuildError::Provider {
                        provider: id.clone(),
                        message,
                    }
                })?),
            );
        }
        let mut keys = Vec::new();
        for tenant in snapshot.tenants.values() {
            for hex in &tenant.key_sha256 {
                if let Some(digest) = parse_digest(hex) {
                    keys.push((digest, tenant.name.clone()));
                }
            }
        }
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
        // Only once the whole table is built: a table refused part-way leaves the pools'
        // tokenized prompts alone (its new tokenizers and KV states are kept by the registry).
        for pool in pools.values() {
            if let Some(tokenizer) = &pool.tokenizer {
                pool.kv.use_tokenizer(tokenizer);
            }
        }
        let created_at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Ok(RoutingTable {
            snapshot,
            created_at,
            pools,
            providers,
            evaluator,
            keys,
        })
    }

    /// Map an API key (or its absence) to a tenant. With no Tenant documents every request is
    /// let through as [`Caller::Open`].
    pub fn authenticate(&self, key: Option<&str>) -> Result<Caller<'_>, AuthFailure> {
        if self.snapshot.tenants.is_empty() {
            return Ok(Caller::Open);
        }
        let Some(key) = key.filter(|k| !k.is_empty()) else {
            return self
                .snapshot
                .tenants
                .values()
                .find(|t| t.default)
                .map(Caller::Tenant)
                .ok_or(AuthFailure::MissingKey);
        };
        let digest: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        // Every stored digest is compared, match or not.
        let mut found: Option<&str> = None;
        for (stored, tenant) in &self.keys {
            if digests_equal(stored, &digest) {
                found = Some(tenant);
            }
        }
        found
            .and_then(|name| self.snapshot.tenants.get(name))
            .map(Caller::Tenant)
            .ok_or(AuthFailure::UnknownKey)
    }

    /// Client-facing models the caller may use, sorted.
    pub fn models_for<'a>(&'a self, caller: Caller<'_>) -> impl Iterator<Item = &'a String> {
        self.snapshot
            .models
            .keys()
            .filter(move |name| caller.tenant().is_none_or(|t| t.allows_model(name)))
    }

    pub fn provider(&self, id: &ProviderId) -> Option<&Arc<ProviderRuntime>> {
        self.providers.get(id)
    }

    /// Whether a target can take a request now (its pool has workers; its provider is loaded).
    pub fn usable(&self, target: &ModelTarget) -> bool {
        match &target.backend {
            Backend::Pool(id) => self.pools.get(id).is_some_and(|p| !p.workers.is_empty()),
            Backend::Provider(id) => self
                .providers
                .get(id)
                .is_some_and(|p| p.unavailable.is_none()),
        }
    }

    /// Where a target's requests go.
    pub fn destination(&self, target: &ModelTarget) -> Option<Destination> {
        match &target.backend {
            Backend::Pool(id) => self.pools.get(id).cloned().map(Destination::Pool),
            Backend::Provider(id) => self.providers.get(id).cloned().map(Destination::Provider),
        }
    }

    /// Choose among `targets` by `strategy`: by weight, or the first usable one in order.
    pub fn choose<'m>(
        &self,
        strategy: TargetStrategy,
        targets: &[&'m ModelTarget],
    ) -> Option<&'m ModelTarget> {
        match strategy {
            TargetStrategy::Ordered => targets
                .iter()
                .find(|t| self.usable(t))
                .or(targets.first())
                .copied(),
            TargetStrategy::Weighted => {
                let usable: Vec<&'m ModelTarget> =
                    targets.iter().copied().filter(|t| self.usable(t)).collect();
                let candidates = if usable.is_empty() {
                    targets
                } else {
                    &usable[..]
                };
                pick_weighted(candidates)
            }
        }
    }

    pub fn pools(&self) -> impl Iterator<Item = &Arc<PoolRuntime>> {
        self.pools.values()
    }

    pub fn model(&self, name: &str) -> Option<&switchyard_snapshot::Model> {
        self.snapshot.models.get(name)
    }

    pub fn pool(&self, id: &PoolId) -> Option<&Arc<PoolRuntime>> {
        self.pools.get(id)
    }
}

/// One of `targets`, with probability proportional to its weight.
fn pick_weighted<'m>(targets: &[&'m ModelTarget]) -> Option<&'m ModelTarget> {
    let total: u64 = targets.iter().map(|t| u64::from(t.weight)).sum();
    if total == 0 {
        return None;
    }
    let mut ticket = rand::rng().random_range(0..total);
    for target in targets {
        let weight = u64::from(target.weight);
        if ticket < weight {
            return Some(target);
        }
        ticket -= weight;
    }
    targets.last().copied()
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
