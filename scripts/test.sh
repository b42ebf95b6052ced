#!/usr/bin/env bash
# Sets up the environment (scripts/setup.sh's runtime, plus the test extra: torch, transformers, ...) and runs the
# whole test suite (8 fake CPU devices, see tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.meshserve-test
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
# The native kernels' aarch64 paths are cross-compiled and run under qemu-user by tests/pallas_kernels/test_native_selftest.py:
# Debian's cross compiler and qemu, installed where apt can (as root; elsewhere that test says what it lacks), in the
# background while the set-up runs (pip and the native build; apt's ~45 s on a new machine then cost no wall time).
apt_pid=
if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    pkgs="g++-aarch64-linux-gnu qemu-user"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -q $pkgs >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $pkgs >/dev/null 2>&1; } \
      || echo "note: could not install $pkgs; the aarch64 kernel test will skip"; } &
    apt_pid=$!
  fi
fi
if [ ! -x .venv/bin/python ]; then
  # A new .venv: the runtime and the test extra in one pip resolution (one editable build), not three.
  MESHSERVE_SETUP_EXTRAS=test bash scripts/setup.sh
  echo "$want" > "$stamp"
else
  bash scripts/setup.sh
fi
# torch goes in first, pinned to the CPU wheel, so nothing pulls a CUDA build. Re-installs when pyproject.toml changed.
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[test]"
  echo "$want" > "$stamp"
fi
[ -z "$apt_pid" ] || wait "$apt_pid"
# Two workers, a test file each at a time (module-scoped servers start once): tests that wait on processes and
# sockets leave a core idle, so two share the machine's cores without slowing each other much. The longest files go
# first (tests/durations.json, see tests/conftest.py), not the files with the most tests (xdist's default).
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder --durations=15 tests "$@"
