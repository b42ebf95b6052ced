#!/usr/bin/env bash
# Sets up the environment and runs the whole test suite (8 fake CPU devices, see tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
