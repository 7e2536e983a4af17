#!/usr/bin/env bash
# The whole test suite, exactly as CI runs it: formatting, lints, unit and end-to-end tests.
# Needs Rust, cmake and Python 3 (for the SDK client tests; a venv is created in .venv).
set -euo pipefail
cd "$(dirname "$0")/.."

requirements=tests/python/requirements.txt
stamp=.venv/.requirements.sha256
want=$(sha256sum "$requirements" | cut -d' ' -f1)
if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "== creating .venv with the test clients"
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check -r "$requirements"
  echo "$want" > "$stamp"
fi

# vLLM's own KV-event and block-pool code, its chat-template helpers and two of its templates,
# straight from its wheel (no torch needed: see
# tests/python/vllm_kv.py and tests/python/vllm_block_pool.py).
vllm_version=0.34.0
vllm_src=.cache/vllm-$vllm_version
vllm_files=(
  vllm/distributed/kv_events.py
  vllm/config/kv_events.py
  vllm/v1/core/block_pool.py
  vllm/v1/core/kv_cache_utils.py
  vllm/utils/hashing.py
  vllm/utils/math_utils.py
  vllm/utils/gc_utils.py
  vllm/envs.py
  vllm/renderers/hf.py
  vllm/renderers/params.py
  vllm/renderers/chat_utils/chat_message.py
  vllm/transformers_utils/chat_templates/template_chatml.jinja
  vllm/transformers_utils/chat_templates/template_minicpmv45.jinja
)
vllm_missing=0
for file in "${vllm_files[@]}"; do
  [ -f "$vllm_src/$file" ] || vllm_missing=1
done
if [ "$vllm_missing" = 1 ]; then
  echo "== fetching vLLM $vllm_version's event and block-pool code"
  mkdir -p .cache/wheels
  .venv/bin/pip download --quiet --disable-pip-version-check --no-deps -d .cache/wheels "vllm==$vllm_version"
  .venv/bin/python - "$vllm_src" .cache/wheels/vllm-"$vllm_version"-*.whl "${vllm_files[@]}" <<'PY'
import sys, zipfile
target, wheel, names = sys.argv[1], sys.argv[2], sys.argv[3:]
with zipfile.ZipFile(wheel) as archive:
    for name in names:
        archive.extract(name, target)
PY
  rm -f .cache/wheels/vllm-"$vllm_version"-*.whl
fi

# Go-built tools (helm), cached in .cache/tools.
scripts/tools.sh

echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== cargo test"
cargo test --workspace --locked
echo "== loadtest/tables.py tests"
python3 -m unittest discover -s loadtest -p 'test_*.py'
# The index benchmark lives in its own workspace (dynamo-kv-router pins tokio): keep it compiling.
echo "== index benchmark compiles"
(cd loadtest/index-bench && cargo check --benches --locked --quiet)
