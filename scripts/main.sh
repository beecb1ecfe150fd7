#!/usr/bin/env bash
# Install jitbatch into ./.venv and train the Tree-LSTM on the bundled SICK-shaped data.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
OMP_NUM_THREADS=1 .venv/bin/python -m examples.tree_lstm.train "$@"
