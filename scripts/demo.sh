#!/usr/bin/env bash
# Sets up the environment and runs the demo (see README.md). Extra arguments go to `python -m serving.demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m serving.demo "$@"
