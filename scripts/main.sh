#!/usr/bin/env bash
# Install jitbatch into ./.venv if needed (scripts/install.sh), then train the
# Tree-LSTM on the bundled SICK-shaped data (data/sick_medium with its word
# vectors). Arguments go to the trainer; run it again without this script as
#   .venv/bin/python -m examples.tree_lstm.train [ARGS]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
echo "main.sh: training: .venv/bin/python -m examples.tree_lstm.train $*"
OMP_NUM_THREADS=1 .venv/bin/python -m examples.tree_lstm.train "$@"
