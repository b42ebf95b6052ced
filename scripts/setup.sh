#!/usr/bin/env bash
# Creates .venv and installs meshserve with its test extras. Idempotent: re-installs only when pyproject.toml
# changed. torch goes in first, pinned to the CPU wheel, so nothing pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.meshserve-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[test]"
  echo "$want" > "$stamp"
fi
# Native CPU kernels (pallas_kernels/native/): compiled once into ~/.cache/meshserve/native; a machine
# without a C++ compiler or AVX-512 BF16 is told so and uses XLA's kernels.
.venv/bin/python -m pallas_kernels.native
