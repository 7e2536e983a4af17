//! The prefix index: which worker holds which prefix of which prompt, fed by vLLM KV events.
//!
//! Design note. Conceptually a radix tree over blocks: a node is a full block of tokens, its
//! path from the root is the prefix that precedes it. Because a [`SequenceHash`] chains a block
//! with everything before it, the hash *is* the node's path, so nodes are stored flat in a hash
//! map keyed by it: inserting a child needs only its parent's hash, and a lookup is one probe per
//! request block instead of a pointer walk from the root. Each node records the set of workers
//! that hold it.
//!
//! - Invariant: a worker is in a node's set iff that worker's last BlockStored for the node was
//!   not followed by a BlockRemoved / AllBlocksCleared for it (or the worker's removal).
//! - vLLM names blocks by its own seeded hash; per worker we keep vLLM hash → our hash, so a
//!   BlockRemoved can be applied, and a stored block's parent can be found.
//! - Concurrency: the node map is split into shards, each behind its own RwLock. A writer holds
//!   one shard lock for one node update, never for a whole batch, so a lookup on the request path
//!   waits at most for a single insert. Each worker's vLLM-hash map is touched only by that
//!   worker's event task.
//! - Lookups never allocate when given a reusable [`Overlap`] buffer.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, RwLock, RwLockReadGuard};

use crate::events::{BlockStored, ExternalBlockHash, KvEvent, KvEventBatch};
use crate::hash::{SequenceHash, block_hash, first_block_salt};

/// A worker's slot in the index (dense, small).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(pub u16);

const SHARDS: usize = 64;

/// The keys are already uniform 64-bit hashes: use them as they are.
#[derive(Default, Clone, Copy)]
struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*byte);
        }
    }
    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

#[derive(Default, Clone, Copy)]
struct BuildIdentity;

impl BuildHasher for BuildIdentity {
    type Hasher = IdentityHasher;
    fn build_hasher(&self) -> IdentityHasher {
        IdentityHasher(0)
    }
}

/// A set of workers: 64 inline, more spill to the heap.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct WorkerSet {
    low: u64,
    high: Option<Box<[u64]>>,
}

impl WorkerSet {
    fn insert(&mut self, worker: WorkerId) {
        let index = usize::from(worker.0);
        if index < 64 {
            self.low |= 1 << index;
            return;
        }
        let word = index / 64 - 1;
        let high = self
            .high
            .get_or_insert_with(|| vec![0u64; word + 1].into_boxed_slice());
        if high.len() <= word {
            let mut grown = vec![0u64; word + 1];
            for (to, from) in grown.iter_mut().zip(high.iter()) {
                *to = *from;
            }
            *high = grown.into_boxed_slice();
        }
        if let Some(bits) = high.get_mut(word) {
            *bits |= 1 << (index % 64);
        }
    }

    fn remove(&mut self, worker: WorkerId) {
        let index = usize::from(worker.0);
        if index < 64 {
            self.low &= !(1 << index);
        } else if let Some(bits) = self.high.as_mut().and_then(|h| h.get_mut(index / 64 - 1)) {
            *bits &= !(1 << (index % 64));
        }
    }

    fn contains(&self, worker: WorkerId) -> bool {
        let index = usize::from(worker.0);
        if index < 64 {
            self.low & (1 << index) != 0
        } else {
            self.high
                .as_ref()
                .and_then(|h| h.get(index / 64 - 1))
                .is_some_and(|bits| bits & (1 << (index % 64)) != 0)
        }
    }

    fn is_empty(&self) -> bool {
        self.low == 0 && self.high.as_ref().is_none_or(|h| h.iter().all(|w| *w == 0))
    }

    /// Word `i` of the set (0 = workers 0..64).
    fn word(&self, i: usize) -> u64 {
        if i == 0 {
            self.low
        } else {
            self.high
                .as_ref()
                .and_then(|h| h.get(i - 1))
                .copied()
                .unwrap_or(0)
        }
    }
}

type Shard = RwLock<HashMap<SequenceHash, WorkerSet, BuildIdentity>>;

/// The top bits pick the shard; the map uses the whole hash.
fn shard_of(hash: SequenceHash) -> usize {
    (hash.0 >> 58) as usize % SHARDS
}

/// The shards one lookup has read: each read-locked at most once per lookup and held until it
/// returns, so a writer waits for one lookup at most, a lookup for one node update at most.
struct ShardReads<'a> {
    shards: &'a [Shard],
    guards: [Option<RwLockReadGuard<'a, HashMap<SequenceHash, WorkerSet, BuildIdentity>>>; SHARDS],
}

impl<'a> ShardReads<'a> {
    fn new(shards: &'a [Shard]) -> Self {
        ShardReads {
            shards,
            guards: std::array::from_fn(|_| None),
        }
    }

    /// Which workers hold `hash`, from its shard (locked now if this lookup had not yet).
    fn holders(&mut self, hash: SequenceHash) -> Option<&WorkerSet> {
        let index = shard_of(hash);
        let slot = self.guards.get_mut(index)?;
        if slot.is_none() {
            let lock = self.shards.get(index)?;
            *slot = Some(match lock.read() {
                Ok(guard) => guard,
                Err(poisoned) => poisoned.into_inner(),
            });
        }
        slot.as_ref()?.get(&hash)
    }
}

/// Per worker: vLLM's hash of each block it holds → our hash of it.
#[derive(Debug, Default)]
struct WorkerBlocks {
    by_external: HashMap<ExternalBlockHash, CachedCopies, BuildIdentity>,
}

/// Our hash of a vLLM block, and how many copies of it the worker holds: vLLM does not
/// de-duplicate identical blocks computed by two requests (`BlockHashToBlockMap`), so it stores
/// a hash once per copy and removes it once per copy; the worker holds the block until the last
/// copy is removed.
#[derive(Debug, Clone, Copy)]
struct CachedCopies {
    ours: SequenceHash,
    copies: u32,
}

/// Counters the proxy exports.
#[derive(Debug, Default)]
pub struct IndexStats {
    pub events_applied: AtomicU64,
    pub blocks_stored: AtomicU64,
    pub blocks_removed: AtomicU64,
    /// Stored blocks whose parent was unknown (events were missed): not indexed.
    pub orphan_blocks: AtomicU64,
    /// BlockStored events whose token count did not match `block_size` × blocks.
    pub malformed_events: AtomicU64,
}

/// Matched prefix depth (in blocks) per worker slot, reused across lookups.
#[derive(Debug, Clone, Default)]
pub struct Overlap {
    depths: Vec<u32>,
}

impl Overlap {
    /// Leading request blocks `worker` holds.
    pub fn depth(&self, worker: WorkerId) -> u32 {
        self.depths.get(usize::from(worker.0)).copied().unwrap_or(0)
    }

    /// The deepest match of any worker.
    pub fn deepest(&self) -> u32 {
        self.depths.iter().copied().max().unwrap_or(0)
    }

    /// Raise a worker's depth to at least `depth` (knowledge from outside the index).
    pub fn raise(&mut self, worker: WorkerId, depth: u32) {
        let index = usize::from(worker.0);
        if self.depths.len() <= index {
            self.depths.resize(index + 1, 0);
        }
        if let Some(slot) = self.depths.get_mut(index) {
            *slot = (*slot).max(depth);
        }
    }
}

/// The index of one pool (one block size, one tokenizer).
pub struct PrefixIndex {
    block_size: usize,
    shards: Box<[Shard]>,
    workers: Mutex<HashMap<WorkerId, WorkerBlocks>>,
    /// Total (node, worker) memberships, i.e. stored blocks across workers.
    stored_blocks: AtomicU64,
    pub stats: IndexStats,
}

impl std::fmt::Debug for PrefixIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixIndex")
            .field("block_size", &self.block_size)
            .field("stored_blocks", &self.stored_blocks())
            .finish_non_exhaustive()
    }
}

impl PrefixIndex {
    pub fn new(block_size: usize) -> PrefixIndex {
        PrefixIndex {
            block_size: block_size.max(1),
            shards: (0..SHARDS)
                .map(|_| RwLock::new(HashMap::with_hasher(BuildIdentity)))
                .collect(),
            workers: Mutex::new(HashMap::new()),
            stored_blocks: AtomicU64::new(0),
            stats: IndexStats::default(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// (worker, block) memberships held.
    pub fn stored_blocks(&self) -> u64 {
        self.stored_blocks.load(Ordering::Relaxed)
    }

    /// Distinct prefixes (nodes) held by any worker.
    pub fn nodes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.read().map_or(0, |m| m.len()))
            .sum()
    }

    fn shard(&self, hash: SequenceHash) -> &Shard {
        // `shards` has exactly SHARDS entries (built in `new`), so the index is always in range.
        #[allow(clippy::indexing_slicing)]
        &self.shards[shard_of(hash)]
    }

    fn add(&self, hash: SequenceHash, worker: WorkerId) {
        let mut shard = match self.shard(hash).write() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        let set = shard.entry(hash).or_default();
        if !set.contains(worker) {
            set.insert(worker);
            self.stored_blocks.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn drop_worker_from(&self, hash: SequenceHash, worker: WorkerId) {
        let mut shard = match self.shard(hash).write() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        if let Entry::Occupied(mut entry) = shard.entry(hash) {
            if entry.get().contains(worker) {
                entry.get_mut().remove(worker);
                self.stored_blocks.fetch_sub(1, Ordering::Relaxed);
            }
            if entry.get().is_empty() {
                entry.remove();
            }
        }
    }

    fn with_worker<R>(&self, worker: WorkerId, f: impl FnOnce(&mut WorkerBlocks) -> R) -> R {
        let mut workers = match self.workers.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        f(workers.entry(worker).or_default())
    }

    /// Apply one batch of a worker's events.
    pub fn apply_batch(&self, worker: WorkerId, batch: &KvEventBatch) {
        for event in &batch.events {
            self.apply(worker, event);
        }
    }

    /// Apply one event of a worker.
    pub fn apply(&self, worker: WorkerId, event: &KvEvent) {
        match event {
            KvEvent::BlockStored(stored) => self.store(worker, stored),
            KvEvent::BlockRemoved(removed) => {
                for external in &removed.block_hashes {
                    let ours = self.with_worker(worker, |w| {
                        let Entry::Occupied(mut entry) = w.by_external.entry(*external) else {
                            return None;
                        };
                        entry.get_mut().copies -= 1;
                        if entry.get().copies == 0 {
                            Some(entry.remove().ours)
                        } else {
                            None
                        }
                    });
                    if let Some(ours) = ours {
                        self.drop_worker_from(ours, worker);
                        self.stats.blocks_removed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            KvEvent::AllBlocksCleared => self.clear_worker(worker),
            KvEvent::Unknown(_) => return,
        }
        self.stats.events_applied.fetch_add(1, Ordering::Relaxed);
    }

    fn store(&self, worker: WorkerId, stored: &BlockStored) {
        let block_size = stored.block_size as usize;
        if block_size != self.block_size
            || stored.token_ids.len() != block_size * stored.block_hashes.len()
        {
            self.stats.malformed_events.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let mut parent = match stored.parent_block_hash {
            None => None,
            Some(external) => {
                match self.with_worker(worker, |w| w.by_external.get(&external).map(|c| c.ours)) {
                    Some(ours) => Some(ours),
                    None => {
                        self.stats
                            .orphan_blocks
                            .fetch_add(stored.block_hashes.len() as u64, Ordering::Relaxed);
                        return;
                    }
                }
            }
        };
        // Blocks under a LoRA adapter are different KV: salt their hashes with its name (or id).
        let lora_id = stored.lora_id.map(|id| id.to_string());
        let salt = stored
            .lora_name
            .as_deref()
            .or(lora_id.as_deref())
            .unwrap_or_default()
            .as_bytes();
        // A request's cache salt keys its first block (and through the chain, every later one).
        let first_salt = stored
            .cache_salt()
            .map(|cache_salt| first_block_salt(salt, cache_salt));
        let ours: Vec<SequenceHash> = stored
            .token_ids
            .chunks_exact(block_size)
            .enumerate()
            .map(|(i, tokens)| {
                let salt = match &first_salt {
                    Some(first) if i == 0 => first.as_slice(),
                    _ => salt,
                };
                let hash = block_hash(parent, salt, tokens);
                parent = Some(hash);
                hash
            })
            .collect();
        // One lock of the worker map per event, then one shard lock per block.
        let replaced: Vec<SequenceHash> = self.with_worker(worker, |w| {
            stored
                .block_hashes
                .iter()
                .zip(&ours)
                .filter_map(|(external, hash)| match w.by_external.entry(*external) {
                    Entry::Vacant(entry) => {
                        entry.insert(CachedCopies {
                            ours: *hash,
                            copies: 1,
                        });
                        None
                    }
                    // Another copy of the same block.
                    Entry::Occupied(mut entry) if entry.get().ours == *hash => {
                        entry.get_mut().copies += 1;
                        None
                    }
                    // The same vLLM hash for other content (a restarted worker, a hash
                    // collision): the new content replaces the old.
                    Entry::Occupied(mut entry) => Some(
                        std::mem::replace(
                            entry.get_mut(),
                            CachedCopies {
                                ours: *hash,
                                copies: 1,
                            },
                        )
                        .ours,
                    ),
                })
                .collect()
        });
        for previous in replaced {
            self.drop_worker_from(previous, worker);
        }
        for hash in &ours {
            self.add(*hash, worker);
        }
        self.stats
            .blocks_stored
            .fetch_add(ours.len() as u64, Ordering::Relaxed);
    }

    /// Forget everything a worker holds (AllBlocksCleared, an unfillable gap, or the worker left).
    pub fn clear_worker(&self, worker: WorkerId) {
        let blocks = self.with_worker(worker, |w| std::mem::take(&mut w.by_external));
        for CachedCopies { ours, .. } in blocks.into_values() {
            self.drop_worker_from(ours, worker);
        }
    }

    /// Remove a worker for good.
    pub fn remove_worker(&self, worker: WorkerId) {
        self.clear_worker(worker);
        let mut workers = match self.workers.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        workers.remove(&worker);
    }

    /// Blocks a worker holds.
    pub fn worker_blocks(&self, worker: WorkerId) -> usize {
        self.with_worker(worker, |w| w.by_external.len())
    }

    /// For each worker slot below `worker_slots`, how many leading blocks of `request` it holds.
    pub fn overlap_into(&self, request: &[SequenceHash], worker_slots: usize, out: &mut Overlap) {
        out.depths.clear();
        out.depths.resize(worker_slots, 0);
        let words = worker_slots.div_ceil(64);
        // `active` holds the workers that matched every block so far (up to 4 words inline).
        let mut active_inline = [u64::MAX; 4];
        let mut active_heap;
        let active: &mut [u64] = match active_inline.get_mut(..words) {
            Some(inline) => inline,
            None => {
                active_heap = vec![u64::MAX; words];
                &mut active_heap
            }
        };
        let mut reads = ShardReads::new(&self.shards);
        for (depth, hash) in request.iter().enumerate() {
            let set = reads.holders(*hash);
            let mut any = false;
            for (i, word) in active.iter_mut().enumerate() {
                let here = set.map_or(0, |s| s.word(i));
                let dropped = *word & !here;
                if dropped != 0 {
                    let mut bits = dropped;
                    while bits != 0 {
                        let bit = bits.trailing_zeros() as usize;
                        if let Some(slot) = out.depths.get_mut(i * 64 + bit) {
                            *slot = depth as u32;
                        }
                        bits &= bits - 1;
                    }
                }
                *word &= here;
                any |= *word != 0;
            }
            if !any {
                return;
            }
        }
        // Workers that matched the whole request.
        for (i, word) in active.iter().enumerate() {
            let mut bits = *word;
            while bits != 0 {
                let bit = bits.trailing_zeros() as usize;
                if let Some(slot) = out.depths.get_mut(i * 64 + bit) {
                    *slot = request.len() as u32;
                }
                bits &= bits - 1;
            }
        }
    }

    /// How many leading blocks of `request` `worker` holds: one worker's walk, which stops at
    /// the first block it lacks (where [`PrefixIndex::overlap_into`] goes on while any worker
    /// matches). Hashes are chained, so `request` may start anywhere in a prompt.
    pub fn held_depth(&self, worker: WorkerId, request: &[SequenceHash]) -> usize {
        let mut reads = ShardReads::new(&self.shards);
        request
            .iter()
            .position(|hash| !reads.holders(*hash).is_some_and(|set| set.contains(worker)))
            .unwrap_or(request.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::BlockRemoved;
    use crate::hash::sequence_hashes;
    use rmpv::Value;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvEvent {
        KvEvent::BlockStored(BlockStored {
            block_hashes: hashes.iter().map(|h| ExternalBlockHash(*h)).collect(),
            parent_block_hash: parent.map(ExternalBlockHash),
            token_ids: tokens.to_vec(),
            block_size: 4,
            ..Default::default()
        })
    }

    fn overlap(index: &PrefixIndex, tokens: &[u32], workers: usize) -> Vec<u32> {
        let mut out = Overlap::default();
        index.overlap_into(&sequence_hashes(tokens, 4), workers, &mut out);
        (0..workers)
            .map(|w| out.depth(WorkerId(w as u16)))
            .collect()
    }

    #[test]
    fn held_depth_is_one_workers_match_from_any_block_on() {
        let index = PrefixIndex::new(4);
        let tokens: Vec<u32> = (0..16).collect();
        let hashes = sequence_hashes(&tokens, 4);
        index.apply(WorkerId(0), &stored(&[1, 2, 3, 4], None, &tokens));
        index.apply(WorkerId(1), &stored(&[5, 6], None, &tokens[..8]));
        assert_eq!(index.held_depth(WorkerId(0), &hashes), 4);
        assert_eq!(index.held_depth(WorkerId(1), &hashes), 2);
        assert_eq!(index.held_depth(WorkerId(2), &hashes), 0);
        // From the third block on: worker 1 lacks it, worker 0 holds the rest.
        assert_eq!(index.held_depth(WorkerId(1), &hashes[2..]), 0);
        assert_eq!(index.held_depth(WorkerId(0), &hashes[2..]), 2);
        assert_eq!(overlap(&index, &tokens, 3), vec![4, 2, 0]);
    }

    #[test]
    fn a_block_cached_twice_stays_until_its_last_copy_is_removed() {
        // vLLM stores identical blocks computed by two requests twice, under one hash, and
        // removes each copy on its own.
        let index = PrefixIndex::new(4);
        let tokens: Vec<u32> = (0..8).collect();
        let removed = |hash: u64| {
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![ExternalBlockHash(hash)],
                ..Default::default()
            })
        };
        index.apply(WorkerId(0), &stored(&[100, 101], None, &tokens));
        index.apply(WorkerId(0), &stored(&[101], Some(100), &tokens[4..]));
        assert_eq!(index.stored_blocks(), 2);
        index.apply(WorkerId(0), &removed(101));
        assert_eq!(
            overlap(&index, &tokens, 1),
            vec![2],
            "one copy is still cached"
        );
        index.apply(WorkerId(0), &removed(101));
        assert_eq!(overlap(&index, &tokens, 1), vec![1]);
        index.apply(WorkerId(0), &removed(101));
        index.apply(WorkerId(0), &removed(100));
        assert_eq!(overlap(&index, &tokens, 1), vec![0]);
        assert_eq!(index.stored_blocks(), 0);
    }

    #[test]
    fn stored_blocks_match_request_prefixes_per_worker() {
        let index = PrefixIndex::new(4);
        let tokens: Vec<u32> = (0..16).collect();
        // Worker 0 has all four blocks, in two events chained by vLLM's parent hash.
        index.apply(WorkerId(0), &stored(&[100, 101], None, &tokens[..8]));
        index.apply(WorkerId(0), &stored(&[102, 103], Some(101), &tokens[8..]));
        // Worker 2 has the first block only; worker 1 nothing.
        index.apply(WorkerId(2), &stored(&[900], None, &tokens[..4]));
        assert_eq!(overlap(&index, &tokens, 3), vec![4, 0, 1]);
        // A request that diverges in block 3 matches two blocks at most.
        let mut other = tokens.clone();
        other[9] = 999;
        assert_eq!(overlap(&index, &other, 3), vec![2, 0, 1]);
        // A trailing partial block is never matched.
        assert_eq!(overlap(&index, &tokens[..6], 3), vec![1, 0, 1]);
        assert_eq!(index.stored_blocks(), 5);
        assert_eq!(index.nodes(), 4);
    }

    #[test]
    fn removals_clears_and_unknown_parents() {
        let index = PrefixIndex::new(4);
        let tokens: Vec<u32> = (0..12).collect();
        index.apply(WorkerId(1), &stored(&[1, 2, 3], None, &tokens));
        index.apply(
            WorkerId(1),
            &KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![ExternalBlockHash(2)],
                ..Default::default()
            }),
        );
        assert_eq!(overlap(&index, &tokens, 2), vec![0, 1]);
        // Removing a block vLLM never told us about is harmless.
        index.apply(
            WorkerId(1),
            &KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![ExternalBlockHash(77)],
                ..Default::default()
            }),
        );
        index.apply(WorkerId(1), &KvEvent::AllBlocksCleared);
        assert_eq!(overlap(&index, &tokens, 2), vec![0, 0]);
        assert_eq!(index.stored_blocks(), 0);
        assert_eq!(index.nodes(), 0);
        // A block whose parent we never saw cannot be placed: counted, not indexed.
        index.apply(WorkerId(1), &stored(&[50], Some(49), &tokens[4..8]));
        assert_eq!(index.stats.orphan_blocks.load(Ordering::Relaxed), 1);
        assert_eq!(index.nodes(), 0);
        // Wrong block size: malformed.
        index.apply(WorkerId(1), &stored(&[60], None, &tokens[..3]));
        assert_eq!(index.stats.malformed_events.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn salted_blocks_match_only_requests_with_the_same_salt() {
        use crate::hash::sequence_hashes_keyed;
        let index = PrefixIndex::new(4);
        let tokens: Vec<u32> = (0..8).collect();
        let KvEvent::BlockStored(mut salted) = stored(&[5, 6], None, &tokens) else {
            unreachable!()
        };
        // As vLLM publishes it: the salt in the first block's keys only.
        salted.extra_keys = Some(Value::Array(vec![
            Value::Array(vec![Value::from("tenant-a")]),
            Value::Nil,
        ]));
        assert_eq!(salted.cache_salt(), Some("tenant-a"));
        index.apply(WorkerId(0), &KvEvent::BlockStored(salted));
        let depth = |hashes: &[SequenceHash]| {
            let mut out = Overlap::default();
            index.overlap_into(hashes, 1, &mut out);
            out.depth(WorkerId(0))
        };
        assert_eq!(
            depth(&sequence_hashes_keyed(&tokens, 4, &[], Some("tenant-a"))),
            2
        );
        assert_eq!(
            depth(&sequence_hashes_keyed(&tokens, 4, &[], Some("tenant-b"))),
            0
        );
        assert_eq!(depth(&sequence_hashes(&tokens, 4)), 0);
        // A continuation (with a parent) carries no salt of its own: the parent's chain has it.
        let KvEvent::BlockStored(mut next) = stored(&[7], Some(6), &[8, 9, 10, 11]) else {
            unreachable!()
        };
        next.extra_keys = Some(Value::Array(vec![Value::Nil]));
        assert_eq!(next.cache_salt(), None);
        index.apply(WorkerId(0), &KvEvent::BlockStored(next));
        let longer: Vec<u32> = (0..12).collect();
        assert_eq!(
            depth(&sequence_hashes_keyed(&longer, 4, &[], Some("tenant-a"))),
            3
        );
    }

    #[test]
    fn lora_blocks_never_match_base_model_requests() {
        let index = PrefixIndex::new(4);
        let tokens: Vec<u32> = (0..8).collect();
        let KvEvent::BlockStored(mut lora) = stored(&[5, 6], None, &tokens) else {
            unreachable!()
        };
        lora.lora_name = Some("adapter".into());
        lora.lora_id = Some(3);
        index.apply(WorkerId(0), &KvEvent::BlockStored(lora));
        assert_eq!(overlap(&index, &tokens, 1), vec![0]);
    }

    #[test]
    fn removing_a_worker_leaves_the_others() {
        let index = PrefixIndex::new(4);
        let tokens: Vec<u32> = (0..8).collect();
        for worker in 0..3 {
            index.apply(
                WorkerId(worker),
                &stored(
                    &[10 + u64::from(worker), 20 + u64::from(worker)],
                    None,
                    &tokens,
                ),
            );
        }
        index.remove_worker(WorkerId(1));
        assert_eq!(overlap(&index, &tokens, 3), vec![2, 0, 2]);
        assert_eq!(index.stored_blocks(), 4);
    }

    #[test]
    fn more_than_sixty_four_workers() {
        let index = PrefixIndex::new(4);
        let tokens: Vec<u32> = (0..8).collect();
        for worker in [0u16, 63, 64, 200, 255] {
            index.apply(
                WorkerId(worker),
                &stored(
                    &[u64::from(worker) * 2, u64::from(worker) * 2 + 1],
                    None,
                    &tokens,
                ),
            );
        }
        index.apply(
            WorkerId(200),
            &KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![ExternalBlockHash(401)],
                ..Default::default()
            }),
        );
        let depths = overlap(&index, &tokens, 256);
        for (worker, depth) in depths.iter().enumerate() {
            let expected = match worker {
                0 | 63 | 64 | 255 => 2,
                200 => 1,
                _ => 0,
            };
            assert_eq!(*depth, expected, "worker {worker}");
        }
    }
}
