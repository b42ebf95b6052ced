#!/usr/bin/env bash
# The acceptance run on a device machine with no network, over the image's Python and JAX (see BUILD.md): installs
# the bundle of scripts/device_bundle.sh (no index), meshserve itself without dependencies, then runs
# `python -m serving.bench accelerator` in one process inside 8 minutes. Everything goes under $OUT (default
# /tmp/meshserve-accept): install.log, accelerator.log, accelerator.json (every figure, rewritten as each arrives)
# and accelerator_summary.txt; the summary is printed last. Exit status: the acceptance run's (124: cut at 8 min).
#
#   scripts/device_accept.sh [extra flags for serving.bench accelerator, e.g. --stages=attention,greedy_parity]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/meshserve-accept}
BUNDLE=${MESHSERVE_BUNDLE:-.device_bundle}
PY=${PYTHON:-python3}
LIMIT_S=${MESHSERVE_ACCEPT_LIMIT_S:-480}  # the whole acceptance command, after the installs
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# Compilation cache and models stay on the machine's disk, not under $OUT (which comes back).
export MESHSERVE_COMPILATION_CACHE=${MESHSERVE_COMPILATION_CACHE:-/tmp/meshserve-xla-cache}
{
  echo "== $(date -u +%FT%TZ) $($PY --version 2>&1) at $(command -v "$PY")"
  # 1. the bundle: resolved against the image first; if the image's versions do not satisfy the wheels' own
  # requirements (or a wheel is missing), each wheel goes in alone (--no-deps) and pip check says what differs.
  if compgen -G "$BUNDLE/*.whl" > /dev/null; then
    names=$(ls "$BUNDLE"/*.whl | xargs -n1 basename | cut -d- -f1 | sort -u)
    if ! $PY -m pip install --no-index --find-links "$BUNDLE" --no-cache-dir --disable-pip-version-check $names; then
      echo "bundle: resolution against the image failed; installing each wheel with --no-deps"
      $PY -m pip install --no-index --no-deps --no-cache-dir --disable-pip-version-check "$BUNDLE"/*.whl
    fi
  else
    echo "bundle: no wheels in $BUNDLE (run scripts/device_bundle.sh here and carry it): the acceptance run needs" \
         "none of them; the structured stage will SKIP"
  fi
  # 2. meshserve over the image's jax (its pins do not apply there); the repository root on PYTHONPATH if that fails
  $PY -m pip install --no-index --no-deps --no-build-isolation --no-cache-dir --disable-pip-version-check -e . \
    || echo "meshserve: editable install failed; running from the repository root (PYTHONPATH)"
  $PY -m pip check || true
  $PY -m pip list --disable-pip-version-check 2>/dev/null \
    | grep -iE '^(jax|flax|orbax|optax|numpy|ml.dtypes|triton|torch|transformers|grpcio|protobuf|llguidance|fastapi)'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
} > "$OUT/install.log" 2>&1
tail -n 25 "$OUT/install.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# 3. the acceptance run: its own budget (420 s) ends it in time; the timeout is the backstop
timeout --kill-after=10 "$LIMIT_S" $PY -m serving.bench accelerator --out="$OUT" "$@" 2>&1 | tee "$OUT/accelerator.log"
status=${PIPESTATUS[0]}
echo "== summary ($OUT/accelerator_summary.txt; figures in $OUT/accelerator.json)"
cat "$OUT/accelerator_summary.txt" 2>/dev/null || echo "no summary written (exit status $status)"
exit "$status"
