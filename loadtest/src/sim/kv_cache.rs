//! A paged KV cache with prefix reuse, modelled on vLLM's block pool.
//!
//! Fixed capacity in blocks. A block whose tokens are all computed gets a hash (chained over its
//! parent, as vLLM hashes) and becomes reusable by any later request with the same prefix.
//! Blocks are reference counted; when the count drops to zero a block goes to the free queue but
//! keeps its contents and hash until it is reallocated, oldest first (LRU). Reallocating a hashed
//! block evicts it from the prefix cache, which vLLM reports as `BlockRemoved`.

use std::collections::{BTreeMap, HashMap};

use sha2::{Digest, Sha256};
use switchyard_kv::events::ExternalBlockHash;

pub type BlockId = usize;

#[derive(Debug, Clone, Default)]
struct Block {
    ref_count: u32,
    hash: Option<ExternalBlockHash>,
    /// Key in the free queue while `ref_count == 0`.
    free_key: Option<i64>,
}

/// The cache of one worker.
#[derive(Debug)]
pub struct KvCache {
    block_size: usize,
    blocks: Vec<Block>,
    by_hash: HashMap<ExternalBlockHash, BlockId>,
    /// Free blocks in eviction order: the smallest key goes first.
    free: BTreeMap<i64, BlockId>,
    next_back: i64,
    next_front: i64,
    hash_seed: u64,
}

/// What allocating did to the prefix cache.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allocation {
    pub blocks: Vec<BlockId>,
    /// Hashes evicted to make room (vLLM's `BlockRemoved`).
    pub evicted: Vec<ExternalBlockHash>,
}

impl KvCache {
    pub fn new(num_blocks: usize, block_size: usize, hash_seed: u64) -> KvCache {
        let mut cache = KvCache {
            block_size,
            blocks: vec![Block::default(); num_blocks],
            by_hash: HashMap::new(),
            free: BTreeMap::new(),
            next_back: 0,
            next_front: -1,
            hash_seed,
        };
        for id in 0..num_blocks {
            cache.push_back(id);
        }
        cache
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn num_cached(&self) -> usize {
        self.by_hash.len()
    }

    /// vLLM's `kv_cache_usage_perc`: share of blocks held by running requests (0–1).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - self.free.len() as f64 / self.blocks.len() as f64
    }

    /// The hash vLLM would give a full block after `parent` (sha256 over the parent hash, the
    /// seed and the tokens; published as its low 64 bits, like vLLM's int hashes).
    pub fn block_hash(
        &self,
        parent: Option<ExternalBlockHash>,
        tokens: &[u32],
    ) -> ExternalBlockHash {
        let mut hasher = Sha256::new();
        hasher.update(self.hash_seed.to_be_bytes());
        match parent {
            Some(parent) => hasher.update(parent.0.to_be_bytes()),
            None => hasher.update(b"NONE_HASH"),
        }
        for token in tokens {
            hasher.update(token.to_le_bytes());
        }
        ExternalBlockHash::from_digest(&hasher.finalize())
    }

    /// Chained hashes of every full block of `tokens`.
    pub fn hashes_of(&self, tokens: &[u32]) -> Vec<ExternalBlockHash> {
        let mut parent = None;
        tokens
            .chunks_exact(self.block_size)
            .map(|block| {
                let hash = self.block_hash(parent, block);
                parent = Some(hash);
                hash
            })
            .collect()
    }

    /// How many leading blocks of `hashes` are cached.
    pub fn cached_prefix(&self, hashes: &[ExternalBlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.by_hash.contains_key(h))
            .count()
    }

    /// Take a reference on the cached blocks of a prefix (they leave the free queue).
    pub fn acquire_cached(&mut self, hashes: &[ExternalBlockHash]) -> Vec<BlockId> {
        let mut taken = Vec::with_capacity(hashes.len());
        for hash in hashes {
            let Some(&id) = self.by_hash.get(hash) else {
                break;
            };
            self.take_ref(id);
            taken.push(id);
        }
        taken
    }

    /// Allocate `count` fresh blocks, evicting the least recently used cached ones if needed.
    /// Returns `None` (allocating nothing) when fewer than `count` blocks are free.
    pub fn allocate(&mut self, count: usize) -> Option<Allocation> {
        if self.free.len() < count {
            return None;
        }
        let mut allocation = Allocation::default();
        for _ in 0..count {
            let (_, id) = self.free.pop_first()?;
            let block = self.blocks.get_mut(id)?;
            block.free_key = None;
            block.ref_count = 1;
            if let Some(hash) = block.hash.take() {
                self.by_hash.remove(&hash);
                allocation.evicted.push(hash);
            }
            allocation.blocks.push(id);
        }
        Some(allocation)
    }

    /// Record that `id` now holds the full block `hash`. Returns false when another block already
    /// caches that content (then this one stays anonymous, as a duplicate).
    pub fn register(&mut self, id: BlockId, hash: ExternalBlockHash) -> bool {
        if self.by_hash.contains_key(&hash) {
            return false;
        }
        if let Some(block) = self.blocks.get_mut(id) {
            block.hash = Some(hash);
            self.by_hash.insert(hash, id);
            true
        } else {
            false
        }
    }

    /// Drop a request's references. Blocks are freed tail first so a prefix outlives its suffix;
    /// anonymous blocks go to the front of the queue, cached ones to the back.
    pub fn release(&mut self, blocks: &[BlockId]) {
        for &id in blocks.iter().rev() {
            let Some(block) = self.blocks.get_mut(id) else {
                continue;
            };
            block.ref_count = block.ref_count.saturating_sub(1);
            if block.ref_count == 0 {
                if block.hash.is_some() {
                    self.push_back(id);
                } else {
                    self.push_front(id);
                }
            }
        }
    }

    /// Forget every cached prefix (vLLM's `reset_prefix_cache`); refused while blocks are in use.
    pub fn reset(&mut self) -> bool {
        if self.blocks.iter().any(|b| b.ref_count > 0) {
            return false;
        }
        for block in &mut self.blocks {
            block.hash = None;
        }
        self.by_hash.clear();
        true
    }

    fn take_ref(&mut self, id: BlockId) {
        if let Some(block) = self.blocks.get_mut(id) {
            if let Some(key) = block.free_key.take() {
                self.free.remove(&key);
            }
            block.ref_count += 1;
        }
    }

    fn push_back(&mut self, id: BlockId) {
        let key = self.next_back;
        self.next_back += 1;
        self.enqueue(id, key);
    }

    fn push_front(&mut self, id: BlockId) {
        let key = self.next_front;
        self.next_front -= 1;
        self.enqueue(id, key);
    }

    fn enqueue(&mut self, id: BlockId, key: i64) {
        if let Some(block) = self.blocks.get_mut(id) {
            block.free_key = Some(key);
            self.free.insert(key, id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(cache: &mut KvCache, tokens: &[u32]) -> Vec<BlockId> {
        let hashes = cache.hashes_of(tokens);
        let allocation = cache.allocate(hashes.len()).unwrap();
        for (id, hash) in allocation.blocks.iter().zip(&hashes) {
            assert!(cache.register(*id, *hash));
        }
        allocation.blocks
    }

    #[test]
    fn prefixes_are_reused_after_release_and_evicted_lru() {
        let mut cache = KvCache::new(4, 4, 0);
        let a: Vec<u32> = (0..8).collect();
        let blocks = fill(&mut cache, &a);
        cache.release(&blocks);
        assert_eq!(cache.num_free(), 4);
        assert_eq!(cache.cached_prefix(&cache.hashes_of(&a)), 2);

        // Two fresh blocks come from never-used ones first; the cached prefix survives.
        let b: Vec<u32> = (100..108).collect();
        let b_blocks = fill(&mut cache, &b);
        assert_eq!(cache.cached_prefix(&cache.hashes_of(&a)), 2);
        cache.release(&b_blocks);

        // Now allocation must evict: a's blocks were released first, its tail block before its head.
        let allocation = cache.allocate(2).unwrap();
        let mut a_tail_first = cache.hashes_of(&a);
        a_tail_first.reverse();
        assert_eq!(allocation.evicted, a_tail_first);
        assert_eq!(cache.cached_prefix(&cache.hashes_of(&a)), 0);
        assert_eq!(cache.cached_prefix(&cache.hashes_of(&b)), 2);
    }

    #[test]
    fn referenced_blocks_are_never_evicted_and_reset_waits_for_them() {
        let mut cache = KvCache::new(2, 4, 0);
        let a: Vec<u32> = (0..8).collect();
        let blocks = fill(&mut cache, &a);
        assert!(cache.allocate(1).is_none());
        assert!(!cache.reset());
        assert_eq!(cache.usage(), 1.0);
        let shared = cache.acquire_cached(&cache.hashes_of(&a));
        assert_eq!(shared, blocks);
        cache.release(&blocks);
        cache.release(&shared);
        assert_eq!(cache.usage(), 0.0);
        assert!(cache.reset());
        assert_eq!(cache.num_cached(), 0);
    }

    #[test]
    fn hashes_chain_over_the_parent() {
        let cache = KvCache::new(1, 2, 7);
        let h = cache.hashes_of(&[1, 2, 1, 2]);
        assert_ne!(h[0], h[1], "same tokens after a different prefix");
        assert_ne!(
            KvCache::new(1, 2, 8).hashes_of(&[1, 2])[0],
            h[0],
            "the seed matters"
        );
    }
}
