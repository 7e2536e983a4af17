"""Replay every batch a (simulated) vLLM worker buffered and decode it with vLLM's own classes.

Usage: sim_events_replay.py REPLAY_ENDPOINT. Prints one JSON line per batch:
{"seq": n, "topic": "...", "batch": <msgspec.to_builtins of the KVEventBatch>} and exits.
"""

import json
import sys

import msgspec
import zmq

import vllm_kv


def main(endpoint: str) -> None:
    kv = vllm_kv.load()
    decoder = msgspec.msgpack.Decoder(type=kv.KVEventBatch)
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.RCVTIMEO, 10_000)
    socket.connect(endpoint)
    socket.send_multipart([b"", (0).to_bytes(8, "big")])
    while True:
        _, topic, seq, payload = socket.recv_multipart()
        if seq == kv.ZmqEventPublisher.END_SEQ:
            break
        batch = decoder.decode(payload)  # raises on anything vLLM's schema rejects
        print(json.dumps({
            "seq": int.from_bytes(seq, "big"),
            "topic": topic.decode(),
            "batch": msgspec.to_builtins(batch, enc_hook=lambda b: b.hex()),
            "event_types": [type(e).__name__ for e in batch.events],
        }), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
