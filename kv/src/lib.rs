//! What the proxy and the simulator must agree on byte for byte.
//!
//! - [`events`]: vLLM's KV-event wire format (ZMQ frames carrying a msgpack `KVEventBatch`), both
//!   encodings vLLM has used (tagged maps since 0.24, positional arrays before), decode and encode.
//! - [`tokenize`]: a `tokenizer.json` plus a chat template, rendering requests exactly as a worker does.
//! - [`hash`]: chained hashes of full token blocks, the keys of the prefix index.
//! - [`index`]: the prefix index itself: which worker holds which prefix.

pub mod anthropic;
pub mod chat_template;
pub mod events;
pub mod hash;
pub mod index;
pub mod tokenize;
