//! Chained block hashes over token content.
//!
//! The router cannot reuse vLLM's own block hashes (they depend on vLLM's hash seed and algorithm),
//! so it hashes token content itself. Each block's tokens are hashed on their own (XXH3-64 over
//! their in-memory u32 bytes, in place; an optional salt such as a LoRA adapter's name goes into
//! the seed: other weights, other KV), and a block's [`SequenceHash`] mixes its parent's sequence
//! hash with that local hash (a splitmix64 finaliser), so equal sequence hashes mean equal
//! prefixes. The expensive hashes of a prompt's blocks are independent of each other, which lets
//! the CPU overlap them; only the cheap mix is serial. This runs for every block of every routed
//! prompt.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Seed of the token hashes of unsalted blocks.
pub const HASH_SEED: u64 = 1337;

/// Hash of a block and everything before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SequenceHash(pub u64);

fn token_seed(salt: &[u8]) -> u64 {
    if salt.is_empty() {
        HASH_SEED
    } else {
        HASH_SEED ^ xxh3_64(salt)
    }
}

fn local(tokens: &[u32], seed: u64) -> u64 {
    xxh3_64_with_seed(bytemuck::cast_slice(tokens), seed)
}

/// Chain a block's local hash onto its parent. The local hash is already uniform (XXH3), so a
/// cheap invertible mix of the parent is enough to make the result depend on the whole prefix;
/// its latency is what a prompt's serial chain costs per block.
fn mix(parent: Option<SequenceHash>, local: u64) -> SequenceHash {
    SequenceHash(match parent {
        None => local,
        Some(parent) => parent.0.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29) ^ local,
    })
}

/// Hash one block after `parent` (an empty `salt` means none).
pub fn block_hash(parent: Option<SequenceHash>, salt: &[u8], tokens: &[u32]) -> SequenceHash {
    mix(parent, local(tokens, token_seed(salt)))
}

/// Sequence hashes of every full block of `tokens`; a trailing partial block is not hashed.
pub fn sequence_hashes(tokens: &[u32], block_size: usize) -> Vec<SequenceHash> {
    sequence_hashes_keyed(tokens, block_size, &[], None)
}

/// The salt of a sequence's first block under vLLM's per-request `cache_salt`: vLLM adds the salt
/// to the extra keys of the block that starts at token 0 only, and the chain carries it to every
/// later block, so requests with different salts share no block.
pub fn first_block_salt(salt: &[u8], cache_salt: &str) -> Vec<u8> {
    let mut first = salt.to_vec();
    first.extend_from_slice(b"\xffcache_salt\xff");
    first.extend_from_slice(cache_salt.as_bytes());
    first
}

/// [`sequence_hashes`] with `salt` mixed into every block (a LoRA adapter's name) and, for a
/// request that carries a `cache_salt`, that salt keying the first block (see [`first_block_salt`]).
pub fn sequence_hashes_keyed(
    tokens: &[u32],
    block_size: usize,
    salt: &[u8],
    cache_salt: Option<&str>,
) -> Vec<SequenceHash> {
    let block_size = block_size.max(1);
    let seed = token_seed(salt);
    let first_seed = cache_salt.map(|cache_salt| token_seed(&first_block_salt(salt, cache_salt)));
    let mut hashes: Vec<SequenceHash> = tokens
        .chunks_exact(block_size)
        .enumerate()
        .map(|(i, block)| {
            let seed = match first_seed {
                Some(first) if i == 0 => first,
                _ => seed,
            };
            SequenceHash(local(block, seed))
        })
        .collect();
    let mut parent = None;
    for hash in &mut hashes {
        *hash = mix(parent, hash.0);
        parent = Some(*hash);
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

    #[test]
    fn a_cache_salt_changes_every_block_and_only_through_the_first() {
        let tokens: Vec<u32> = (0..48).collect();
        let plain = sequence_hashes(&tokens, 16);
        let a = sequence_hashes_keyed(&tokens, 16, &[], Some("a"));
        let b = sequence_hashes_keyed(&tokens, 16, &[], Some("b"));
        assert_eq!(sequence_hashes_keyed(&tokens, 16, &[], None), plain);
        for i in 0..3 {
            assert_ne!(a[i], plain[i]);
            assert_ne!(a[i], b[i]);
        }
        // The second block is the unsalted block hash chained onto the salted first.
        let first = block_hash(None, &first_block_salt(&[], "a"), &tokens[..16]);
        assert_eq!(a[0], first);
        assert_eq!(a[1], block_hash(Some(first), &[], &tokens[16..32]));
    }
}
