#!/usr/bin/env bash
# Install jitbatch with its test extras into ./.venv (created if absent) and run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip wheel setuptools
.venv/bin/python -m pip install -q cython wheel "numpy>=1.20,<1.24"   # gluonnlp's build needs them
.venv/bin/python -m pip install -q -e ".[test]"
OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q "$@"
