//! vLLM's KV-event wire format (checked against `vllm/distributed/kv_events.py`, vLLM 0.34).
//!
//! ZMQ multipart frames `[topic, seq (u64 big-endian), payload]`; the payload is a msgpack
//! `KVEventBatch` array `[ts, events, data_parallel_rank?]`. Each event is, since vLLM 0.24, a map
//! whose `"type"` key names the class (msgspec `tag=True`; optional fields left out when unset),
//! and, up to 0.22, a positional array with the tag first. Both decode here; unknown fields are
//! ignored and unknown event types are kept as [`KvEvent::Unknown`] so a newer vLLM cannot break
//! the consumer. Block hashes are ints (low 64 bits, vLLM's default) or raw hash bytes
//! (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).

use bytes::Bytes;
use rmpv::Value;

/// vLLM's hash of a block, as published. Byte hashes are folded to their low 64 bits, the value
/// vLLM itself publishes in int mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExternalBlockHash(pub u64);

impl ExternalBlockHash {
    /// The low 64 bits of a big-endian hash digest.
    pub fn from_digest(bytes: &[u8]) -> ExternalBlockHash {
        let mut low = [0u8; 8];
        let take = bytes.len().min(8);
        let (start, src) = (8 - take, bytes.len() - take);
        if let (Some(dst), Some(src)) = (low.get_mut(start..), bytes.get(src..)) {
            dst.copy_from_slice(src);
        }
        ExternalBlockHash(u64::from_be_bytes(low))
    }
}

/// How hashes are written by [`encode_batch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashEncoding {
    /// msgpack unsigned int (vLLM default).
    Int,
    /// 32 bytes: 24 zero bytes then the 64-bit hash big-endian, like a sha256 digest whose low
    /// 64 bits are the hash.
    Bytes,
}

/// Event encodings vLLM has used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireFormat {
    /// Maps keyed by `"type"` (vLLM ≥ 0.24).
    Tagged,
    /// Positional arrays with the tag first (vLLM ≤ 0.22).
    Positional,
}

#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    /// Seconds since the Unix epoch when the batch was made.
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<i64>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    AllBlocksCleared,
    /// An event type this build does not know; skipped by consumers.
    Unknown(String),
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    pub block_hashes: Vec<ExternalBlockHash>,
    pub parent_block_hash: Option<ExternalBlockHash>,
    /// Tokens of all stored blocks, concatenated (`block_size` per block).
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    /// Extra hash inputs per block (LoRA name, multimodal identifiers, cache salt), as published.
    pub extra_keys: Option<Value>,
    pub group_idx: Option<i64>,
    pub kv_cache_spec_kind: Option<String>,
    pub kv_cache_spec_sliding_window: Option<i64>,
}

impl BlockStored {
    /// The `cache_salt` of the request whose first block this event stores, if it had one.
    ///
    /// vLLM (`generate_block_hash_extra_keys`, published untagged by `to_event_extra_keys`) puts a
    /// salt only in the extra keys of the block that starts at token 0, after the LoRA name: so
    /// only an event without a parent can carry it, as a bare string in its first block's keys
    /// (multimodal keys are pairs, prompt-embedding digests bytes).
    pub fn cache_salt(&self) -> Option<&str> {
        if self.parent_block_hash.is_some() {
            return None;
        }
        let Some(Value::Array(blocks)) = &self.extra_keys else {
            return None;
        };
        let Some(Value::Array(keys)) = blocks.first() else {
            return None;
        };
        let mut strings = keys.iter().filter_map(Value::as_str);
        if self.lora_name.is_some() || self.lora_id.is_some() {
            strings.next();
        }
        strings.next()
    }
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    pub block_hashes: Vec<ExternalBlockHash>,
    pub medium: Option<String>,
    pub group_idx: Option<i64>,
}

/// Why a frame or payload could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("invalid msgpack: {0}")]
    Msgpack(#[source] rmpv::decode::Error),
    #[error("trailing bytes after the msgpack batch")]
    TrailingBytes,
    #[error("unexpected shape: {0}")]
    Shape(String),
    #[error("expected 3 frames [topic, seq, payload], got {0}")]
    FrameCount(usize),
    #[error("sequence frame must be 8 bytes, got {0}")]
    SeqLength(usize),
}

fn shape(what: impl Into<String>) -> DecodeError {
    DecodeError::Shape(what.into())
}

/// One published message.
#[derive(Debug, Clone, PartialEq)]
pub struct EventMessage {
    pub topic: Bytes,
    pub seq: u64,
    pub batch: KvEventBatch,
}

/// Decode the frames of one PUB message (or one replay reply without its empty delimiter).
pub fn decode_frames(frames: &[Bytes]) -> Result<EventMessage, DecodeError> {
    let [topic, seq, payload] = frames else {
        return Err(DecodeError::FrameCount(frames.len()));
    };
    Ok(EventMessage {
        topic: topic.clone(),
        seq: decode_seq(seq)?,
        batch: decode_batch(payload)?,
    })
}

/// A sequence frame: 8 bytes big-endian.
pub fn decode_seq(frame: &[u8]) -> Result<u64, DecodeError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| DecodeError::SeqLength(frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

/// The replay end marker vLLM sends after the last buffered batch (`(-1).to_bytes(8, signed)`).
pub const REPLAY_END_SEQ: u64 = u64::MAX;

/// Decode a msgpack `KVEventBatch`.
pub fn decode_batch(payload: &[u8]) -> Result<KvEventBatch, DecodeError> {
    let mut reader = payload;
    let value = rmpv::decode::read_value(&mut reader).map_err(DecodeError::Msgpack)?;
    if !reader.is_empty() {
        return Err(DecodeError::TrailingBytes);
    }
    let Value::Array(fields) = value else {
        return Err(shape("batch is not an array"));
    };
    let mut fields = fields.into_iter();
    let ts = match fields.next() {
        Some(Value::F64(ts)) => ts,
        Some(Value::F32(ts)) => f64::from(ts),
        Some(Value::Integer(ts)) => ts.as_f64().unwrap_or(0.0),
        _ => return Err(shape("batch[0] (ts) is not a number")),
    };
    let Some(Value::Array(raw_events)) = fields.next() else {
        return Err(shape("batch[1] (events) is not an array"));
    };
    let data_parallel_rank = match fields.next() {
        None | Some(Value::Nil) => None,
        Some(Value::Integer(rank)) => rank.as_i64(),
        Some(_) => return Err(shape("batch[2] (data_parallel_rank) is not an int")),
    };
    let events = raw_events
        .into_iter()
        .enumerate()
        .map(|(index, event)| {
            decode_event(event).map_err(|e| shape(format!("events[{index}]: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(KvEventBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

/// Field access for both encodings: by name (tagged) or by position after the tag (positional).
enum Fields {
    Named(Vec<(Value, Value)>),
    Positional(Vec<Value>),
}

impl Fields {
    fn get(&self, name: &str, position: usize) -> Option<&Value> {
        let value = match self {
            Fields::Named(pairs) => pairs
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v),
            Fields::Positional(values) => values.get(position),
        };
        value.filter(|v| !v.is_nil())
    }
}

fn decode_event(value: Value) -> Result<KvEvent, DecodeError> {
    let (tag, fields) = match value {
        Value::Map(pairs) => {
            let tag = pairs
                .iter()
                .find(|(k, _)| k.as_str() == Some("type"))
                .and_then(|(_, v)| v.as_str())
                .ok_or_else(|| shape("event map has no \"type\""))?
                .to_owned();
            (tag, Fields::Named(pairs))
        }
        Value::Array(mut values) => {
            if values.is_empty() {
                return Err(shape("empty event array"));
            }
            let tag = values.remove(0);
            let tag = tag
                .as_str()
                .ok_or_else(|| shape("event tag is not a string"))?
                .to_owned();
            (tag, Fields::Positional(values))
        }
        _ => return Err(shape("event is neither a map nor an array")),
    };
    Ok(match tag.as_str() {
        "BlockStored" => KvEvent::BlockStored(BlockStored {
            block_hashes: hashes(fields.get("block_hashes", 0), "block_hashes")?,
            parent_block_hash: fields.get("parent_block_hash", 1).map(hash).transpose()?,
            token_ids: tokens(fields.get("token_ids", 2))?,
            block_size: fields
                .get("block_size", 3)
                .and_then(Value::as_u64)
                .and_then(|b| u32::try_from(b).ok())
                .ok_or_else(|| shape("block_size missing or not an int"))?,
            lora_id: fields.get("lora_id", 4).and_then(Value::as_i64),
            medium: fields
                .get("medium", 5)
                .and_then(Value::as_str)
                .map(str::to_owned),
            lora_name: fields
                .get("lora_name", 6)
                .and_then(Value::as_str)
                .map(str::to_owned),
            extra_keys: fields.get("extra_keys", 7).cloned(),
            group_idx: fields.get("group_idx", 8).and_then(Value::as_i64),
            kv_cache_spec_kind: fields
                .get("kv_cache_spec_kind", 9)
                .and_then(Value::as_str)
                .map(str::to_owned),
            kv_cache_spec_sliding_window: fields
                .get("kv_cache_spec_sliding_window", 10)
                .and_then(Value::as_i64),
        }),
        "BlockRemoved" => KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: hashes(fields.get("block_hashes", 0), "block_hashes")?,
            medium: fields
                .get("medium", 1)
                .and_then(Value::as_str)
                .map(str::to_owned),
            group_idx: fields.get("group_idx", 2).and_then(Value::as_i64),
        }),
        "AllBlocksCleared" => KvEvent::AllBlocksCleared,
        _ => KvEvent::Unknown(tag),
    })
}

fn hash(value: &Value) -> Result<ExternalBlockHash, DecodeError> {
    match value {
        Value::Integer(int) => int
            .as_u64()
            .or_else(|| int.as_i64().map(|i| i as u64))
            .map(ExternalBlockHash)
            .ok_or_else(|| shape("block hash int out of range")),
        Value::Binary(bytes) => Ok(ExternalBlockHash::from_digest(bytes)),
        _ => Err(shape("block hash is neither an int nor bytes")),
    }
}

fn hashes(value: Option<&Value>, field: &str) -> Result<Vec<ExternalBlockHash>, DecodeError> {
    match value {
        Some(Value::Array(values)) => values.iter().map(hash).collect(),
        _ => Err(shape(format!("{field} missing or not an array"))),
    }
}

fn tokens(value: Option<&Value>) -> Result<Vec<u32>, DecodeError> {
    let Some(Value::Array(values)) = value else {
        return Err(shape("token_ids missing or not an array"));
    };
    values
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| shape("token id is not a u32"))
        })
        .collect()
}

fn encode_hash(hash: ExternalBlockHash, encoding: HashEncoding) -> Value {
    match encoding {
        HashEncoding::Int => Value::from(hash.0),
        HashEncoding::Bytes => {
            let mut digest = vec![0u8; 32];
            if let Some(low) = digest.get_mut(24..) {
                low.copy_from_slice(&hash.0.to_be_bytes());
            }
            Value::Binary(digest)
        }
    }
}

fn optional_str(value: &Option<String>) -> Value {
    value.as_deref().map_or(Value::Nil, Value::from)
}

fn optional_int(value: Option<i64>) -> Value {
    value.map_or(Value::Nil, Value::from)
}

/// Encode a batch byte for byte as vLLM's msgspec encoder does for the chosen format: the batch
/// and positional events as arrays, tagged events as maps. msgspec sizes a struct's map header by
/// the most fields the struct can have (tag included), not by how many it writes: vLLM 0.34's
/// `BlockStored` has 16, so it always gets a map16 header; the other events get a fixmap.
pub fn encode_batch(batch: &KvEventBatch, format: WireFormat, hashes: HashEncoding) -> Vec<u8> {
    let events: Vec<Value> = batch
        .events
        .iter()
        .filter_map(|e| encode_event(e, format, hashes))
        .collect();
    let mut out = Vec::with_capacity(64 + 16 * events.len());
    let fields = if batch.data_parallel_rank.is_some() {
        3u8
    } else {
        2
    };
    out.push(0x90 | fields);
    out.push(0xcb);
    out.extend_from_slice(&batch.ts.to_bits().to_be_bytes());
    write_array_header(&mut out, events.len());
    for event in &events {
        match event {
            Value::Map(pairs) => {
                let is_stored =
                    pairs.first().and_then(|(_, tag)| tag.as_str()) == Some("BlockStored");
                if is_stored {
                    out.push(0xde);
                    out.extend_from_slice(&(pairs.len() as u16).to_be_bytes());
                } else {
                    out.push(0x80 | (pairs.len() as u8 & 0x0f));
                }
                for (key, value) in pairs {
                    write(&mut out, key);
                    write(&mut out, value);
                }
            }
            other => write(&mut out, other),
        }
    }
    if let Some(rank) = batch.data_parallel_rank {
        write(&mut out, &Value::from(rank));
    }
    out
}

fn write_array_header(out: &mut Vec<u8>, len: usize) {
    if len < 16 {
        out.push(0x90 | len as u8);
    } else if let Ok(len) = u16::try_from(len) {
        out.push(0xdc);
        out.extend_from_slice(&len.to_be_bytes());
    } else {
        out.push(0xdd);
        out.extend_from_slice(&(len as u32).to_be_bytes());
    }
}

fn write(out: &mut Vec<u8>, value: &Value) {
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(out, value);
}

fn encode_event(event: &KvEvent, format: WireFormat, encoding: HashEncoding) -> Option<Value> {
    let hash_list = |list: &[ExternalBlockHash]| {
        Value::Array(list.iter().map(|h| encode_hash(*h, encoding)).collect())
    };
    // (name, value, always written): msgspec omits fields equal to their default (None) only for
    // fields that have one; the rest are always present, nil or not.
    let (tag, fields): (&str, Vec<(&str, Value, bool)>) = match event {
        KvEvent::BlockStored(stored) => (
            "BlockStored",
            vec![
                ("block_hashes", hash_list(&stored.block_hashes), true),
                (
                    "parent_block_hash",
                    stored
                        .parent_block_hash
                        .map_or(Value::Nil, |h| encode_hash(h, encoding)),
                    true,
                ),
                (
                    "token_ids",
                    Value::Array(stored.token_ids.iter().map(|t| Value::from(*t)).collect()),
                    true,
                ),
                ("block_size", Value::from(stored.block_size), true),
                ("lora_id", optional_int(stored.lora_id), true),
                ("medium", optional_str(&stored.medium), true),
                ("lora_name", optional_str(&stored.lora_name), true),
                (
                    "extra_keys",
                    stored.extra_keys.clone().unwrap_or(Value::Nil),
                    false,
                ),
                ("group_idx", optional_int(stored.group_idx), false),
                (
                    "kv_cache_spec_kind",
                    optional_str(&stored.kv_cache_spec_kind),
                    false,
                ),
                (
                    "kv_cache_spec_sliding_window",
                    optional_int(stored.kv_cache_spec_sliding_window),
                    false,
                ),
            ],
        ),
        KvEvent::BlockRemoved(removed) => (
            "BlockRemoved",
            vec![
                ("block_hashes", hash_list(&removed.block_hashes), true),
                ("medium", optional_str(&removed.medium), true),
                ("group_idx", optional_int(removed.group_idx), false),
            ],
        ),
        KvEvent::AllBlocksCleared => ("AllBlocksCleared", Vec::new()),
        KvEvent::Unknown(_) => return None,
    };
    Some(match format {
        WireFormat::Tagged => {
            let mut pairs = vec![(Value::from("type"), Value::from(tag))];
            pairs.extend(
                fields
                    .into_iter()
                    .filter(|(_, value, always)| *always || !value.is_nil())
                    .map(|(name, value, _)| (Value::from(name), value)),
            );
            Value::Map(pairs)
        }
        WireFormat::Positional => {
            // vLLM ≤ 0.22 had no fields after `medium` for BlockStored.
            let legacy_fields = match event {
                KvEvent::BlockStored(_) => 6,
                KvEvent::BlockRemoved(_) => 2,
                _ => 0,
            };
            let mut values = vec![Value::from(tag)];
            values.extend(
                fields
                    .into_iter()
                    .take(legacy_fields)
                    .map(|(_, value, _)| value),
            );
            Value::Array(values)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> KvEventBatch {
        KvEventBatch {
            ts: 1.5,
            events: vec![
                KvEvent::BlockStored(BlockStored {
                    block_hashes: vec![ExternalBlockHash(u64::MAX - 3), ExternalBlockHash(7)],
                    parent_block_hash: Some(ExternalBlockHash(42)),
                    token_ids: (0..32).collect(),
                    block_size: 16,
                    medium: Some("GPU".into()),
                    ..Default::default()
                }),
                KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![ExternalBlockHash(7)],
                    medium: Some("GPU".into()),
                    group_idx: None,
                }),
                KvEvent::AllBlocksCleared,
            ],
            data_parallel_rank: Some(0),
        }
    }

    #[test]
    fn round_trips_in_every_format_and_hash_encoding() {
        for format in [WireFormat::Tagged, WireFormat::Positional] {
            for hashes in [HashEncoding::Int, HashEncoding::Bytes] {
                let decoded = decode_batch(&encode_batch(&sample(), format, hashes)).unwrap();
                assert_eq!(decoded, sample(), "{format:?} {hashes:?}");
            }
        }
    }

    #[test]
    fn tagged_events_ignore_unknown_fields_and_keep_unknown_types() {
        let event = Value::Map(vec![
            (Value::from("type"), Value::from("BlockRemoved")),
            (
                Value::from("block_hashes"),
                Value::Array(vec![Value::from(9u64)]),
            ),
            (Value::from("medium"), Value::Nil),
            (Value::from("some_future_field"), Value::from("x")),
        ]);
        let future = Value::Map(vec![(Value::from("type"), Value::from("BlockPinned"))]);
        let batch = Value::Array(vec![Value::F64(0.0), Value::Array(vec![event, future])]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &batch).unwrap();
        let decoded = decode_batch(&bytes).unwrap();
        assert_eq!(
            decoded.events[0],
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![ExternalBlockHash(9)],
                medium: None,
                group_idx: None
            })
        );
        assert_eq!(decoded.events[1], KvEvent::Unknown("BlockPinned".into()));
        assert_eq!(decoded.data_parallel_rank, None);
    }

    #[test]
    fn malformed_payloads_are_errors_not_panics() {
        assert!(decode_batch(b"").is_err());
        assert!(decode_batch(&[0x91, 0xc0]).is_err());
        let mut trailing = encode_batch(&sample(), WireFormat::Tagged, HashEncoding::Int);
        trailing.push(0);
        assert!(matches!(
            decode_batch(&trailing),
            Err(DecodeError::TrailingBytes)
        ));
        assert!(decode_seq(&[1, 2, 3]).is_err());
        assert_eq!(decode_seq(&[0, 0, 0, 0, 0, 0, 1, 0]).unwrap(), 256);
    }
}
