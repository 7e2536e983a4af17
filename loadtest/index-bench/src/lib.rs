//! Shared data and drivers for the index benchmark: Switchyard's `PrefixIndex` and
//! dynamo-kv-router's indexers fed the same generated KV events and the same lookups.
//!
//! Data (seeded): `workers` workers share 16 system prompts of 128 blocks; each worker stores one
//! of them, then unique continuations (64 blocks each, parented on the prompt's last block) until
//! the pool holds `total_blocks` blocks. Lookups are prompts of 1k/8k/32k tokens that start with
//! a stored continuation and then diverge. Block size 16.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use dynamo_kv_router::protocols::{
    BlockHashOptions, ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent, compute_block_hash_for_seq,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use switchyard_kv::events::{BlockStored, ExternalBlockHash, KvEvent};
use switchyard_kv::hash::sequence_hashes;
use switchyard_kv::index::{Overlap, PrefixIndex, WorkerId};

pub const BLOCK_SIZE: usize = 16;
const PROMPT_BLOCKS: usize = 128;
const TAIL_BLOCKS: usize = 64;
const PROMPTS: usize = 16;

/// Counts live heap bytes, for memory per stored block.
pub struct CountingAllocator;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE_BYTES.fetch_add(new_size, Ordering::Relaxed);
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

pub fn live_bytes() -> usize {
    LIVE_BYTES.load(Ordering::Relaxed)
}

/// One stored batch: a worker, vLLM-style hashes, the parent's hash, and the tokens.
pub struct StoreEvent {
    pub worker: u16,
    pub external: Vec<u64>,
    pub parent: Option<u64>,
    pub tokens: Vec<u32>,
}

pub struct Dataset {
    pub workers: usize,
    pub events: Vec<StoreEvent>,
    pub stored_blocks: usize,
    /// Token sequences of stored continuations (prompt + tail), for building lookups.
    pub stored_sequences: Vec<Vec<u32>>,
}

fn random_tokens(rng: &mut ChaCha8Rng, blocks: usize) -> Vec<u32> {
    (0..blocks * BLOCK_SIZE)
        .map(|_| rng.random_range(0..150_000))
        .collect()
}

impl Dataset {
    pub fn generate(workers: usize, total_blocks: usize, seed: u64) -> Dataset {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let prompts: Vec<Vec<u32>> = (0..PROMPTS)
            .map(|_| random_tokens(&mut rng, PROMPT_BLOCKS))
            .collect();
        let mut events = Vec::new();
        let mut stored_sequences = Vec::new();
        // vLLM's hashes are a function of content (deterministic seed since vLLM 0.29), so every
        // worker that stores the same prompt publishes the same hashes for it.
        let external_of = |parent: u64, block: &[u32]| -> u64 {
            let mut bytes = parent.to_le_bytes().to_vec();
            bytes.extend(block.iter().flat_map(|t| t.to_le_bytes()));
            xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, 99)
        };
        let chain_external = |parent: u64, tokens: &[u32]| -> Vec<u64> {
            let mut parent = parent;
            tokens
                .chunks_exact(BLOCK_SIZE)
                .map(|block| {
                    parent = external_of(parent, block);
                    parent
                })
                .collect()
        };
        let per_worker = total_blocks / workers;
        let mut stored_blocks = 0;
        for worker in 0..workers {
            let prompt = &prompts[worker % PROMPTS];
            let prompt_hashes = chain_external(0, prompt);
            let last_prompt_hash = prompt_hashes[PROMPT_BLOCKS - 1];
            events.push(StoreEvent {
                worker: worker as u16,
                external: prompt_hashes,
                parent: None,
                tokens: prompt.clone(),
            });
            let mut blocks = PROMPT_BLOCKS;
            while blocks + TAIL_BLOCKS <= per_worker {
                let tail = random_tokens(&mut rng, TAIL_BLOCKS);
                let external = chain_external(last_prompt_hash, &tail);
                if stored_sequences.len() < 256 {
                    let mut sequence = prompt.clone();
                    sequence.extend_from_slice(&tail);
                    stored_sequences.push(sequence);
                }
                events.push(StoreEvent {
                    worker: worker as u16,
                    external,
                    parent: Some(last_prompt_hash),
                    tokens: tail,
                });
                blocks += TAIL_BLOCKS;
            }
            stored_blocks += blocks;
        }
        Dataset {
            workers,
            events,
            stored_blocks,
            stored_sequences,
        }
    }

    /// `count` lookup prompts of `tokens` tokens: a stored sequence's first 3/4, then new tokens.
    pub fn lookups(&self, tokens: usize, count: usize, seed: u64) -> Vec<Vec<u32>> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..count)
            .map(|i| {
                let stored = &self.stored_sequences[i % self.stored_sequences.len()];
                let keep = (stored.len() * 3 / 4).min(tokens);
                let mut prompt = stored[..keep].to_vec();
                while prompt.len() < tokens {
                    prompt.push(rng.random_range(0..150_000));
                }
                prompt
            })
            .collect()
    }
}

/// Switchyard's index fed the dataset.
pub fn build_switchyard(data: &Dataset) -> PrefixIndex {
    let index = PrefixIndex::new(BLOCK_SIZE);
    for event in &data.events {
        index.apply(
            WorkerId(event.worker),
            &KvEvent::BlockStored(BlockStored {
                block_hashes: event
                    .external
                    .iter()
                    .map(|h| ExternalBlockHash(*h))
                    .collect(),
                parent_block_hash: event.parent.map(ExternalBlockHash),
                token_ids: event.tokens.clone(),
                block_size: BLOCK_SIZE as u32,
                ..Default::default()
            }),
        );
    }
    index
}

/// Request path on Switchyard's index: hash the prompt, then look it up.
pub fn lookup_switchyard(
    index: &PrefixIndex,
    workers: usize,
    prompt: &[u32],
    out: &mut Overlap,
) -> u32 {
    let hashes = sequence_hashes(prompt, BLOCK_SIZE);
    index.overlap_into(&hashes, workers, out);
    (0..workers)
        .map(|w| out.depth(WorkerId(w as u16)))
        .max()
        .unwrap_or(0)
}

/// A dataset event as dynamo's router builds it from vLLM's: local hashes from the tokens.
pub fn dynamo_event(event: &StoreEvent, id: u64) -> RouterEvent {
    let local = compute_block_hash_for_seq(
        &event.tokens,
        BLOCK_SIZE as u32,
        BlockHashOptions::default(),
    );
    let blocks = event
        .external
        .iter()
        .zip(local)
        .map(|(external, tokens_hash)| KvCacheStoredBlockData {
            block_hash: ExternalSequenceBlockHash(*external),
            tokens_hash,
            mm_extra_info: None,
        })
        .collect();
    RouterEvent::new(
        u64::from(event.worker),
        KvCacheEvent {
            event_id: id,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: event.parent.map(ExternalSequenceBlockHash),
                start_position: None,
                blocks,
            }),
            dp_rank: 0,
        },
    )
}

/// Local block hashes of a prompt, as dynamo's router computes them per request.
pub fn dynamo_request(prompt: &[u32]) -> Vec<LocalBlockHash> {
    compute_block_hash_for_seq(prompt, BLOCK_SIZE as u32, BlockHashOptions::default())
}
