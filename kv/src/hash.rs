//! Chained block hashes over token content.
//!
//! The router cannot reuse vLLM's own block hashes (they depend on vLLM's hash seed and algorithm),
//! so it hashes token content itself: a block's [`LocalBlockHash`] covers its tokens, and its
//! [`SequenceHash`] chains the parent's sequence hash with it, so equal sequence hashes mean equal
//! prefixes. XXH3-64 with seed 1337 over little-endian u32 tokens, as Dynamo's kv-router does, so
//! both indexes can be fed the same keys in benchmarks.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of every hash in this module.
pub const HASH_SEED: u64 = 1337;

/// Hash of one block's tokens, independent of what came before.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LocalBlockHash(pub u64);

/// Hash of a block and everything before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SequenceHash(pub u64);

/// Hash one block's tokens.
pub fn local_block_hash(tokens: &[u32]) -> LocalBlockHash {
    local_block_hash_salted(tokens, &[])
}

/// Hash one block's tokens with extra key bytes (a LoRA adapter's name): the same tokens under a
/// different adapter are different KV, so they must not share a hash. Empty salt = no salt.
pub fn local_block_hash_salted(tokens: &[u32], salt: &[u8]) -> LocalBlockHash {
    let mut bytes = Vec::with_capacity(salt.len() + tokens.len() * 4);
    bytes.extend_from_slice(salt);
    for token in tokens {
        bytes.extend_from_slice(&token.to_le_bytes());
    }
    LocalBlockHash(xxh3_64_with_seed(&bytes, HASH_SEED))
}

/// Chain a block onto its parent (`None` for the first block).
pub fn chain(parent: Option<SequenceHash>, block: LocalBlockHash) -> SequenceHash {
    match parent {
        None => SequenceHash(block.0),
        Some(parent) => {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&parent.0.to_le_bytes());
            bytes[8..].copy_from_slice(&block.0.to_le_bytes());
            SequenceHash(xxh3_64_with_seed(&bytes, HASH_SEED))
        }
    }
}

/// Sequence hashes of every full block of `tokens`; a trailing partial block is not hashed.
pub fn sequence_hashes(tokens: &[u32], block_size: usize) -> Vec<SequenceHash> {
    let mut hashes = Vec::with_capacity(tokens.len() / block_size.max(1));
    let mut parent = None;
    for block in tokens.chunks_exact(block_size.max(1)) {
        let hash = chain(parent, local_block_hash(block));
        hashes.push(hash);
        parent = Some(hash);
    }
    hashes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_prefixes_share_hashes_and_partial_blocks_are_ignored() {
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[20] = 999;
        let ha = sequence_hashes(&a, 16);
        let hb = sequence_hashes(&b, 16);
        assert_eq!(ha.len(), 2);
        assert_eq!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1]);
        // Same block content after a different prefix hashes differently.
        let shifted: Vec<u32> = (16..32).chain(16..32).collect();
        assert_ne!(sequence_hashes(&shifted, 16)[1], ha[1]);
    }
}
