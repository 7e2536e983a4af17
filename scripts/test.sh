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

echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== cargo test"
cargo test --workspace --locked
