#!/usr/bin/env bash
# Install jitbatch with its test extras into ./.venv and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q "$@"
