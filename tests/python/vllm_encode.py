"""Print vLLM's msgpack encoding of the known batches (ts = index + 0.5, data_parallel_rank 0),
one JSON line each: {"index": i, "hex": "..."}."""

import json

import msgspec

import known_batches
import vllm_kv

kv = vllm_kv.load()
encoder = msgspec.msgpack.Encoder()
for index, events in enumerate(known_batches.batches(kv)):
    batch = kv.KVEventBatch(ts=index + 0.5, events=events, data_parallel_rank=0)
    print(json.dumps({"index": index, "hex": encoder.encode(batch).hex()}))
