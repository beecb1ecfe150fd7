#!/usr/bin/env bash
# Data-parallel Tree-LSTM training on this machine: a scheduler, one server and
# N workers of examples/tree_lstm/train.py over MXNet's dist_sync kvstore
# (loopback), each worker dynamic-batching its share of every minibatch. Rank 0
# prints the usual output; at the end the workers' parameters are compared.
#
#   bash scripts/dist_train.sh N [training arguments]
#
# Environment: PYTHON (default .venv/bin/python), DIST_DIR (default runs/dist:
# the workers' final parameters and the logs of ranks >= 1), DIST_TIMEOUT
# (seconds, default 1800: the whole job fails after it), OMP_NUM_THREADS
# (default 1). The script appends --kvstore dist_sync --dist-dir "$DIST_DIR" to
# the training arguments. Exit status 0 only when every process succeeded and
# all workers hold identical parameters.
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "dist_train.sh: $*" >&2; exit 2; }
[ $# -ge 1 ] || die "usage: bash scripts/dist_train.sh N [training arguments] (N: number of workers)"
N=$1
shift
[[ $N =~ ^[1-9][0-9]*$ ]] || die "N must be a number of workers >= 1, got '$N'; usage: bash scripts/dist_train.sh N [training arguments]"
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || die "no Python interpreter at '$PY': run bash scripts/install.sh, or set PYTHON=/path/to/venv/bin/python"
DIST_DIR=${DIST_DIR:-runs/dist}
TIMEOUT=${DIST_TIMEOUT:-1800}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout's jitbatch and examples

for a in "$@"; do  # help needs no job (workers that never join it would leave it waiting)
  case $a in -h|--help) exec "$PY" -m examples.tree_lstm.train --help ;; esac
done

mkdir -p "$DIST_DIR"
rm -f "$DIST_DIR"/worker*.params "$DIST_DIR"/worker*.log  # no stale files in the check

# The launcher runs in the background so that the traps fire at once; it stops
# every process of the job when it ends, fails, or gets SIGTERM from cleanup.
launcher=
cleanup() {
  if [ -n "$launcher" ] && kill -0 "$launcher" 2>/dev/null; then
    kill -TERM "$launcher" 2>/dev/null || true
    wait "$launcher" 2>/dev/null || true
  fi
}
trap cleanup EXIT
trap 'echo "dist_train.sh: interrupted, stopping the job" >&2; exit 130' INT
trap 'echo "dist_train.sh: terminated, stopping the job" >&2; exit 143' TERM

"$PY" -m examples.tree_lstm.launch -n "$N" -s 1 --timeout "$TIMEOUT" -- \
  "$PY" -m examples.tree_lstm.train "$@" --kvstore dist_sync --dist-dir "$DIST_DIR" &
launcher=$!
status=0
wait "$launcher" || status=$?
launcher=
if [ "$status" -ne 0 ]; then
  echo "dist_train.sh: FAILED: the distributed job did not complete (see the launch: lines" \
       "above; output of ranks >= 1 is in $DIST_DIR/worker*.log)" >&2
  exit 1
fi
"$PY" -m examples.tree_lstm.dist check "$DIST_DIR" "$N"
