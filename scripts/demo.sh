#!/usr/bin/env bash
# The main job on a new machine: three simulated vLLM workers (127.0.0.1:8001-8003, KV events on
# 5557-5559) and switchyard-proxy on 127.0.0.1:8080 with the embedded default config.
# Ctrl-C stops both. SIM_TIME_SCALE=0.1 makes the simulated GPUs ten times faster.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release --bins

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM

target/release/switchyard-sim --workers 3 --port 8001 --kv-events-port 5557 --kv-replay-port 5657 \
  --time-scale "${SIM_TIME_SCALE:-1}" > /dev/null &
pids+=($!)
for port in 8001 8002 8003; do
  for _ in $(seq 1 100); do
    curl -fs "http://127.0.0.1:$port/health" > /dev/null 2>&1 && break
    sleep 0.1
  done
done

target/release/switchyard-proxy --listen 127.0.0.1:8080 &
pids+=($!)
echo "switchyard-proxy on http://127.0.0.1:8080 (models: curl -s localhost:8080/v1/models)," \
  "admin on http://127.0.0.1:9090 (curl -s localhost:9090/metrics); Ctrl-C to stop"
wait "${pids[1]}"
