#!/usr/bin/env bash
# Install jitbatch into ./.venv if needed (scripts/install.sh), then run the test
# suite, one pytest-xdist worker per core (each test file in one worker, in its
# order); arguments go to pytest. Run it again without this script as
#   .venv/bin/python -m pytest [ARGS]            (-n auto --dist loadfile: in workers)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/python -c "import jitbatch; m = jitbatch.compiled_modules(); print('jitbatch: %d of %d modules compiled%s' % (len(m), len(jitbatch._compiled.MODULES), '' if m else ' (pure Python)'))"
OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n auto --dist loadfile "$@"
