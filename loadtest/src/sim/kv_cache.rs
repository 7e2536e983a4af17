//! A paged KV cache with prefix reuse that follows vLLM v1's block pool
//! (`vllm/v1/core/block_pool.py` and `FreeKVCacheBlockQueue` in `kv_cache_utils.py`, 0.34).
//!
//! - Block 0 is vLLM's null block: taken out at start, never allocated, not counted as free
//!   (`BlockPool.__init__`), so usage is `1 - free / (num_blocks - 1)` (`get_usage`).
//! - Free blocks form one queue; allocation pops from its front (`get_new_blocks` →
//!   `popleft_n`). Freeing (`free_blocks`) takes blocks in eviction order: those without a hash
//!   go to the front (reused first), cached ones to the back (LRU), in the order given; callers
//!   pass a request's blocks tail first, as `SingleTypeKVCacheManager.free` does.
//! - A block whose tokens are all scheduled gets its chained hash and enters the prefix cache
//!   (`cache_full_blocks`), with one `BlockStored` per call. Identical blocks computed by two
//!   requests are **not** de-duplicated: both stay cached under the same hash, each copy got its
//!   own `BlockStored`, and each copy's eviction emits its own `BlockRemoved`
//!   (`BlockHashToBlockMap`, `_remove_cached_block_hashes`). A lookup returns the first copy
//!   inserted that is still cached (`get_one_block`).
//! - A hit takes a reference (`touch`), pulling a free block out of the queue; reallocating a
//!   cached free block evicts it (`_maybe_evict_cached_block`, one `BlockRemoved` per hash).
//!
//! Events queue here and are taken once per engine step (`take_events`).

use std::collections::HashMap;

use sha2::{Digest, Sha256};
use switchyard_kv::events::{BlockRemoved, BlockStored, ExternalBlockHash, KvEvent};

pub type BlockId = usize;

/// The null block's id (vLLM's `BlockPool.null_block`).
const NULL_BLOCK: BlockId = 0;

#[derive(Debug, Clone, Default)]
struct Block {
    ref_count: u32,
    hash: Option<ExternalBlockHash>,
    /// Links of the free queue while the block is in it.
    prev: Option<BlockId>,
    next: Option<BlockId>,
    free: bool,
}

/// The block pool of one worker. Cloned only for the oracle's dry run of the scheduler.
#[derive(Debug, Clone)]
pub struct KvCache {
    block_size: usize,
    blocks: Vec<Block>,
    /// Every cached copy of a hash, in insertion order; the first is what a lookup returns.
    cached: HashMap<ExternalBlockHash, Vec<BlockId>>,
    head: Option<BlockId>,
    tail: Option<BlockId>,
    num_free: usize,
    events: Vec<KvEvent>,
    hash_seed: u64,
}

impl KvCache {
    /// A pool of `num_blocks` blocks, one of which is the null block.
    pub fn new(num_blocks: usize, block_size: usize, hash_seed: u64) -> KvCache {
        let mut cache = KvCache {
            block_size,
            blocks: vec![Block::default(); num_blocks],
            cached: HashMap::new(),
            head: None,
            tail: None,
            num_free: 0,
            events: Vec::new(),
            hash_seed,
        };
        for id in 0..num_blocks {
            cache.push_back(id);
        }
        // The null block leaves the queue for good.
        if num_blocks > 0 {
            cache.unlink(NULL_BLOCK);
        }
        cache
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks a request can ever hold (all but the null block).
    pub fn capacity(&self) -> usize {
        self.blocks.len().saturating_sub(1)
    }

    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Distinct hashes cached.
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// vLLM's `kv_cache_usage_perc` (`BlockPool.get_usage`): share of usable blocks not free.
    pub fn usage(&self) -> f64 {
        let usable = self.capacity();
        if usable == 0 {
            return 0.0;
        }
        1.0 - self.num_free as f64 / usable as f64
    }

    /// The hash of a full block after `parent`: sha256 over the seed, the parent hash (or a
    /// fixed "none" marker for the first block) and the tokens, published as its low 64 bits
    /// like vLLM's int hashes. Chained like vLLM's `hash_block_tokens`; the bytes hashed differ
    /// (vLLM pickles a tuple), which no consumer can see: hashes are opaque to routers.
    pub fn block_hash(
        &self,
        parent: Option<ExternalBlockHash>,
        tokens: &[u32],
    ) -> ExternalBlockHash {
        self.block_hash_salted(parent, tokens, None)
    }

    /// [`KvCache::block_hash`] of a request with a `cache_salt`: like vLLM
    /// (`generate_block_hash_extra_keys`), the salt is an extra key of the first block only; the
    /// chain carries it to the rest.
    pub fn block_hash_salted(
        &self,
        parent: Option<ExternalBlockHash>,
        tokens: &[u32],
        cache_salt: Option<&str>,
    ) -> ExternalBlockHash {
        let mut hasher = Sha256::new();
        hasher.update(self.hash_seed.to_be_bytes());
        match parent {
            Some(parent) => hasher.update(parent.0.to_be_bytes()),
            None => {
                hasher.update(b"NONE_HASH");
                if let Some(salt) = cache_salt {
                    hasher.update(b"\0cache_salt\0");
                    hasher.update(salt.as_bytes());
                }
            }
        }
        for token in tokens {
            hasher.update(token.to_le_bytes());
        }
        ExternalBlockHash::from_digest(&hasher.finalize())
    }

    /// Chained hashes of every full block of `tokens`.
    pub fn hashes_of(&self, tokens: &[u32]) -> Vec<ExternalBlockHash> {
        self.hashes_of_salted(tokens, None)
    }

    /// [`KvCache::hashes_of`] for a request with a `cache_salt`.
    pub fn hashes_of_salted(
        &self,
        tokens: &[u32],
        cache_salt: Option<&str>,
    ) -> Vec<ExternalBlockHash> {
        let mut parent = None;
        tokens
            .chunks_exact(self.block_size)
            .map(|block| {
                let hash = self.block_hash_salted(parent, block, cache_salt);
                parent = Some(hash);
                hash
            })
            .collect()
    }

    /// The block a lookup of `hash` finds (the first cached copy), if any (`get_cached_block`).
    pub fn get_cached_block(&self, hash: ExternalBlockHash) -> Option<BlockId> {
        self.cached.get(&hash).and_then(|ids| ids.first().copied())
    }

    /// The cached blocks of the longest cached prefix of `hashes` (`find_longest_cache_hit`).
    pub fn longest_cache_hit(&self, hashes: &[ExternalBlockHash]) -> Vec<BlockId> {
        hashes
            .iter()
            .map_while(|hash| self.get_cached_block(*hash))
            .collect()
    }

    /// Whether `id` sits in the free queue (a cache hit on it takes a free block).
    pub fn is_free(&self, id: BlockId) -> bool {
        self.blocks.get(id).is_some_and(|b| b.free)
    }

    /// Take `count` blocks from the front of the free queue, evicting the cached ones from the
    /// prefix cache (`get_new_blocks`). `None`, and nothing taken, when fewer are free.
    pub fn get_new_blocks(&mut self, count: usize) -> Option<Vec<BlockId>> {
        if count > self.num_free {
            return None;
        }
        let mut taken = Vec::with_capacity(count);
        for _ in 0..count {
            let id = self.head?;
            self.unlink(id);
            self.evict(id);
            if let Some(block) = self.blocks.get_mut(id) {
                block.ref_count = 1;
            }
            taken.push(id);
        }
        Some(taken)
    }

    /// A cache hit: one more reference on each block, pulling free ones out of the queue.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &id in blocks {
            if id == NULL_BLOCK {
                continue;
            }
            if self.is_free(id) {
                self.unlink(id);
            }
            if let Some(block) = self.blocks.get_mut(id) {
                block.ref_count += 1;
            }
        }
    }

    /// Drop one reference on each block, given in eviction order (first evicted first).
    pub fn free_blocks(&mut self, ordered: impl IntoIterator<Item = BlockId>) {
        let (mut evict_first, mut evict_last) = (Vec::new(), Vec::new());
        for id in ordered {
            if id == NULL_BLOCK {
                continue;
            }
            let Some(block) = self.blocks.get_mut(id) else {
                continue;
            };
            block.ref_count = block.ref_count.saturating_sub(1);
            if block.ref_count == 0 {
                if block.hash.is_none() {
                    evict_first.push(id);
                } else {
                    evict_last.push(id);
                }
            }
        }
        // `prepend_n`: the list keeps its order at the front of the queue.
        for &id in evict_first.iter().rev() {
            self.push_front(id);
        }
        for id in evict_last {
            self.push_back(id);
        }
    }

    /// Cache `blocks[num_cached..num_full]` of a request whose chained block hashes are
    /// `hashes` and whose tokens are `tokens`, and queue one `BlockStored` for them
    /// (`cache_full_blocks`). No check for an identical block cached already. A request with a
    /// `cache_salt` has it listed in the first block's extra keys of the event that starts at
    /// token 0, as vLLM publishes them (`to_event_extra_keys`: one entry per block, the bare salt,
    /// `None` for unsalted blocks).
    pub fn cache_full_blocks(
        &mut self,
        blocks: &[BlockId],
        hashes: &[ExternalBlockHash],
        tokens: &[u32],
        num_cached: usize,
        num_full: usize,
        cache_salt: Option<&str>,
    ) {
        if num_cached >= num_full {
            return;
        }
        let mut stored = Vec::with_capacity(num_full - num_cached);
        for index in num_cached..num_full {
            let (Some(&id), Some(&hash)) = (blocks.get(index), hashes.get(index)) else {
                break;
            };
            if let Some(block) = self.blocks.get_mut(id) {
                block.hash = Some(hash);
            }
            let copies = self.cached.entry(hash).or_default();
            if !copies.contains(&id) {
                copies.push(id);
            }
            stored.push(hash);
        }
        let parent_block_hash = num_cached
            .checked_sub(1)
            .and_then(|parent| hashes.get(parent))
            .copied();
        let size = self.block_size;
        let token_ids = tokens
            .get(num_cached * size..(num_cached + stored.len()) * size)
            .unwrap_or(&[])
            .to_vec();
        // vLLM's `to_event_extra_keys`: one entry per block, None where a block has no extra
        // key; the salt only on the block that starts at token 0.
        let mut keys = vec![rmpv::Value::Nil; stored.len()];
        if let (Some(salt), 0, Some(first)) = (cache_salt, num_cached, keys.first_mut()) {
            *first = rmpv::Value::Array(vec![rmpv::Value::from(salt)]);
        }
        let extra_keys = Some(rmpv::Value::Array(keys));
        self.events.push(KvEvent::BlockStored(BlockStored {
            block_hashes: stored,
            parent_block_hash,
            token_ids,
            block_size: size as u32,
            medium: Some("GPU".into()),
            extra_keys,
            group_idx: Some(0),
            ..Default::default()
        }));
    }

    /// Forget every cached prefix (`reset_prefix_cache`); refused while any block is in use.
    pub fn reset(&mut self) -> bool {
        if self.num_free != self.capacity() {
            return false;
        }
        self.cached.clear();
        for block in &mut self.blocks {
            block.hash = None;
        }
        self.events.push(KvEvent::AllBlocksCleared);
        true
    }

    /// The events queued since the last call (`take_events`).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// The free queue, first to be reused first.
    pub fn free_queue(&self) -> Vec<BlockId> {
        let mut order = Vec::with_capacity(self.num_free);
        let mut at = self.head;
        while let Some(id) = at {
            order.push(id);
            at = self.blocks.get(id).and_then(|b| b.next);
        }
        order
    }

    /// Drop `id`'s hash from the prefix cache, with a `BlockRemoved` for this copy.
    fn evict(&mut self, id: BlockId) {
        let Some(hash) = self.blocks.get_mut(id).and_then(|b| b.hash.take()) else {
            return;
        };
        if let Some(copies) = self.cached.get_mut(&hash) {
            copies.retain(|&copy| copy != id);
            if copies.is_empty() {
                self.cached.remove(&hash);
            }
        }
        self.events.push(KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![hash],
            medium: Some("GPU".into()),
            group_idx: Some(0),
        }));
    }

    fn unlink(&mut self, id: BlockId) {
        let Some(block) = self.blocks.get_mut(id) else {
            return;
        };
        if !block.free {
            return;
        }
        let (prev, next) = (block.prev.take(), block.next.take());
        block.free = false;
        match prev {
            Some(prev) => {
                if let Some(p) = self.blocks.get_mut(prev) {
                    p.next = next;
                }
            }
            None => self.head = next,
        }
        match next {
            Some(next) => {
                if let Some(n) = self.blocks.get_mut(next) {
                    n.prev = prev;
                }
            }
            None => self.tail = prev,
        }
        self.num_free -= 1;
    }

    fn push_back(&mut self, id: BlockId) {
        let tail = self.tail;
        let Some(block) = self.blocks.get_mut(id) else {
            return;
        };
        if block.free {
            return;
        }
        block.free = true;
        block.prev = tail;
        block.next = None;
        match tail {
            Some(tail) => {
                if let Some(t) = self.blocks.get_mut(tail) {
                    t.next = Some(id);
                }
            }
            None => self.head = Some(id),
        }
        self.tail = Some(id);
        self.num_free += 1;
    }

    fn push_front(&mut self, id: BlockId) {
        let head = self.head;
        let Some(block) = self.blocks.get_mut(id) else {
            return;
        };
        if block.free {
            return;
        }
        block.free = true;
        block.next = head;
        block.prev = None;
        match head {
            Some(head) => {
                if let Some(h) = self.blocks.get_mut(head) {
                    h.prev = Some(id);
                }
            }
            None => self.tail = Some(id),
        }
        self.head = Some(id);
        self.num_free += 1;
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn a_cache_salt_separates_caches_and_is_published_on_the_first_block() {
        let mut cache = KvCache::new(16, 2, 8);
        let tokens = [1, 2, 3, 4, 5, 6];
        let a = cache.hashes_of_salted(&tokens, Some("a"));
        let blocks = cache.get_new_blocks(a.len()).unwrap();
        cache.cache_full_blocks(&blocks, &a, &tokens, 0, 2, Some("a"));
        cache.cache_full_blocks(&blocks, &a, &tokens, 2, 3, Some("a"));
        assert_eq!(cache.longest_cache_hit(&a).len(), 3);
        assert!(
            cache
                .longest_cache_hit(&cache.hashes_of_salted(&tokens, Some("b")))
                .is_empty()
        );
        assert!(
            cache
                .longest_cache_hit(&cache.hashes_of(&tokens))
                .is_empty()
        );
        let events = cache.take_events();
        let keys: Vec<Option<&str>> = events
            .iter()
            .map(|event| match event {
                KvEvent::BlockStored(stored) => stored.cache_salt(),
                _ => None,
            })
            .collect();
        // The salt rides on the event that starts at token 0; its continuation has a parent.
        assert_eq!(keys, [Some("a"), None]);
        let KvEvent::BlockStored(first) = &events[0] else {
            panic!("{events:?}")
        };
        assert_eq!(
            first.extra_keys,
            Some(rmpv::Value::Array(vec![
                rmpv::Value::Array(vec![rmpv::Value::from("a")]),
                rmpv::Value::Nil,
            ]))
        );
    }

    /// Allocate and cache every full block of `tokens`, as one prefill would.
    fn fill(cache: &mut KvCache, tokens: &[u32]) -> Vec<BlockId> {
        let hashes = cache.hashes_of(tokens);
        let blocks = cache.get_new_blocks(hashes.len()).unwrap();
        cache.cache_full_blocks(&blocks, &hashes, tokens, 0, hashes.len(), None);
        blocks
    }

    /// The hashes of every `BlockRemoved` in `events`, in order.
    pub(crate) fn removed(events: &[KvEvent]) -> Vec<ExternalBlockHash> {
        events
            .iter()
            .filter_map(|e| match e {
                KvEvent::BlockRemoved(r) => Some(r.block_hashes.clone()),
                _ => None,
            })
            .flatten()
            .collect()
    }

    #[test]
    fn the_null_block_is_never_handed_out() {
        let mut cache = KvCache::new(5, 4, 0);
        assert_eq!(cache.capacity(), 4);
        assert_eq!(cache.num_free(), 4);
        assert_eq!(cache.get_new_blocks(4).unwrap(), vec![1, 2, 3, 4]);
        assert!(cache.get_new_blocks(1).is_none());
        assert_eq!(cache.usage(), 1.0);
    }

    #[test]
    fn prefixes_are_reused_after_release_and_evicted_lru_tail_first() {
        let mut cache = KvCache::new(5, 4, 0);
        let a: Vec<u32> = (0..8).collect();
        let blocks = fill(&mut cache, &a);
        cache.free_blocks(blocks.iter().rev().copied());
        assert_eq!(cache.num_free(), 4);
        assert_eq!(cache.longest_cache_hit(&cache.hashes_of(&a)).len(), 2);
        // Never-used blocks first, then a's tail, then a's head.
        assert_eq!(cache.free_queue(), vec![3, 4, 2, 1]);

        let b: Vec<u32> = (100..108).collect();
        let b_blocks = fill(&mut cache, &b);
        assert_eq!(b_blocks, vec![3, 4]);
        assert_eq!(cache.longest_cache_hit(&cache.hashes_of(&a)).len(), 2);
        cache.free_blocks(b_blocks.iter().rev().copied());
        cache.take_events();

        // Now allocation must evict: a's tail block goes before its head.
        cache.get_new_blocks(2).unwrap();
        let mut a_tail_first = cache.hashes_of(&a);
        a_tail_first.reverse();
        assert_eq!(removed(&cache.take_events()), a_tail_first);
        assert!(cache.longest_cache_hit(&cache.hashes_of(&a)).is_empty());
        assert_eq!(cache.longest_cache_hit(&cache.hashes_of(&b)).len(), 2);
    }

    #[test]
    fn unhashed_blocks_are_reused_first_in_the_order_freed() {
        let mut cache = KvCache::new(6, 4, 0);
        let blocks = cache.get_new_blocks(5).unwrap();
        // Blocks 1 and 2 cached, 3, 4 and 5 partial (no hash); freed tail first.
        let tokens: Vec<u32> = (0..8).collect();
        cache.cache_full_blocks(&blocks, &cache.hashes_of(&tokens), &tokens, 0, 2, None);
        cache.free_blocks(blocks.iter().rev().copied());
        assert_eq!(cache.free_queue(), vec![5, 4, 3, 2, 1]);
    }

    #[test]
    fn identical_blocks_are_cached_twice_and_each_copy_is_removed_on_its_own() {
        let mut cache = KvCache::new(7, 4, 0);
        let tokens: Vec<u32> = (0..8).collect();
        let hashes = cache.hashes_of(&tokens);
        let a = fill(&mut cache, &tokens);
        let b = fill(&mut cache, &tokens);
        let stored: Vec<_> = cache
            .take_events()
            .into_iter()
            .filter_map(|e| match e {
                KvEvent::BlockStored(s) => Some(s.block_hashes),
                _ => None,
            })
            .collect();
        assert_eq!(stored, vec![hashes.clone(), hashes.clone()]);
        assert_eq!(cache.num_cached(), 2);
        assert_eq!(cache.get_cached_block(hashes[0]), a.first().copied());

        cache.free_blocks(a.iter().rev().copied());
        cache.free_blocks(b.iter().rev().copied());
        // Free queue: the never-used blocks, then a's copies, then b's (all tail first).
        assert_eq!(cache.free_queue(), vec![5, 6, 2, 1, 4, 3]);
        // Evicting a's copies leaves b's cached, yet each eviction is reported.
        cache.get_new_blocks(4).unwrap();
        assert_eq!(removed(&cache.take_events()), vec![hashes[1], hashes[0]]);
        assert_eq!(cache.get_cached_block(hashes[0]), b.first().copied());
        assert_eq!(cache.longest_cache_hit(&hashes).len(), 2);
        cache.get_new_blocks(2).unwrap();
        assert_eq!(removed(&cache.take_events()), vec![hashes[1], hashes[0]]);
        assert!(cache.longest_cache_hit(&hashes).is_empty());
    }

    #[test]
    fn a_hit_takes_its_block_out_of_the_free_queue() {
        let mut cache = KvCache::new(4, 4, 0);
        let tokens: Vec<u32> = (0..8).collect();
        let blocks = fill(&mut cache, &tokens);
        cache.free_blocks(blocks.iter().rev().copied());
        let hit = cache.longest_cache_hit(&cache.hashes_of(&tokens));
        cache.touch(&hit);
        assert_eq!(cache.num_free(), 1);
        assert!(cache.get_new_blocks(2).is_none());
        assert!(!cache.reset());
        cache.free_blocks(hit.iter().rev().copied());
        assert!(cache.reset());
        assert_eq!(cache.num_cached(), 0);
        assert_eq!(cache.take_events().last(), Some(&KvEvent::AllBlocksCleared));
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
