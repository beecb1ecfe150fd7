#!/usr/bin/env bash
# Create ./.venv (if absent) and install jitbatch into it. gluonnlp 0.10.0 builds
# from source and needs cython, wheel and numpy<1.24 present before it builds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip wheel setuptools
.venv/bin/python -m pip install -q cython wheel "numpy>=1.20,<1.24"
.venv/bin/python -m pip install -q -e ".[test]"
