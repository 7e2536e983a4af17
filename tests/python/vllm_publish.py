"""Publish known KV-event batches with vLLM's own ZmqEventPublisher.

Usage: vllm_publish.py PUB_ENDPOINT REPLAY_ENDPOINT. vLLM connects its PUB socket to
PUB_ENDPOINT (the test binds a SUB there) and binds REPLAY_ENDPOINT. Publishes known_batches
(seq 0..5), then one heartbeat batch every 20 ms until stdin closes, then shuts down.
"""

import sys
import threading
import time

import known_batches
import vllm_kv

kv = vllm_kv.load()

BATCHES = known_batches.batches(kv)


def main(endpoint: str, replay: str) -> None:
    publisher = kv.ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint, replay_endpoint=replay, topic="kv")
    for events in BATCHES:
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=events))
    stop = threading.Event()

    def wait_for_stdin() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_stdin, daemon=True).start()
    print("published", flush=True)
    while not stop.is_set():
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=[kv.AllBlocksCleared()]))
        time.sleep(0.02)
    publisher.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
