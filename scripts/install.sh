#!/usr/bin/env bash
# Create ./.venv and install jitbatch into it, editable, with the `test` extra
# (pytest, hypothesis and the examples' tqdm and matplotlib): what both
# scripts/main.sh and scripts/test.sh need. It installs only when ./.venv is
# missing or what the install is made from changed since the last one; a stamp
# in .venv holds the hash of those inputs (delete .venv/.jitbatch-install-stamp
# to force a reinstall). PYTHON picks the interpreter that creates .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.jitbatch-install-stamp

say() { echo "install.sh: $*"; }

# sha256 over the named files' names and contents
hash_files() { LC_ALL=C sort | xargs -r sha256sum | sha256sum | cut -d' ' -f1; }
# what decides the requirements: the packaging files and this script
deps_hash() { printf '%s\n' setup.py pyproject.toml setup.cfg scripts/install.sh | hash_files; }
# what the installed package is built from: the above, and every source that
# the compiled modules are made from (jitbatch's .py, .pxd and .pyx files)
build_hash() {
    { printf '%s\n' setup.py pyproject.toml setup.cfg scripts/install.sh
      find jitbatch -type f \( -name '*.py' -o -name '*.pxd' -o -name '*.pyx' \); } | hash_files
}

# setuptools builds a flat-layout editable install with an import finder and warns
# that a folder named like the package in the working directory may shadow it:
# here that folder is the package's own source, which the finder points at
QUIET_EDITABLE="ignore:Editable installation"

# the compiled modules in the checkout (removed by a `git clean -X`, say)
built_files() { find jitbatch -type f \( -name '*.so' -o -name '*.pyd' \) | LC_ALL=C sort | hash_files; }

want_deps=$(deps_hash)
want_build=$(build_hash)
have_deps=""
have_build=""
have_built=""
if [ -x .venv/bin/python ] && [ -f "$STAMP" ]; then
    have_deps=$(sed -n 's/^deps //p' "$STAMP")
    have_build=$(sed -n 's/^build //p' "$STAMP")
    have_built=$(sed -n 's/^built //p' "$STAMP")
fi
if [ "$have_deps" = "$want_deps" ] && [ "$have_build" = "$want_build" ] \
        && [ "$have_built" = "$(built_files)" ]; then
    say "./.venv is up to date with this checkout (nothing to install)"
    exit 0
fi

t0=$SECONDS
if [ ! -x .venv/bin/python ]; then
    say "creating ./.venv with $("$PY" --version 2>&1) ($(command -v "$PY"))"
    "$PY" -m venv .venv
    say "upgrading pip in ./.venv"
    .venv/bin/python -m pip install -q --upgrade pip
fi
rm -f "$STAMP"   # a failed or interrupted install below leaves no stamp

if [ "$have_deps" != "$want_deps" ]; then
    say "installing jitbatch's requirements (MXNet 1.9.1, numpy<1.24) and the test and example" \
        "extras (pytest, hypothesis, tqdm, matplotlib) into ./.venv; the first time this" \
        "downloads about 150 MB"
    # JITBATCH_PURE=1: no compiling yet; the next step builds the compiled modules
    JITBATCH_PURE=1 PYTHONWARNINGS="$QUIET_EDITABLE" \
        .venv/bin/python -m pip install -q -e ".[test]"
fi
say "compiling jitbatch's core modules with Cython (those whose source changed; about a" \
    "minute on two cores for all of them)"
PYTHONWARNINGS="$QUIET_EDITABLE" .venv/bin/python -m pip install -q --no-deps -e .
.venv/bin/python -c "import jitbatch; m = jitbatch.compiled_modules(); print('install.sh: jitbatch installed, %d of %d modules compiled%s' % (len(m), len(jitbatch._compiled.MODULES), '' if m else ' (no Cython or C compiler: pure Python, slower)'))"

printf 'deps %s\nbuild %s\nbuilt %s\n' "$want_deps" "$want_build" "$(built_files)" > "$STAMP"
say "done in $((SECONDS - t0)) s; run the trainer and the tests directly with" \
    "'.venv/bin/python -m examples.tree_lstm.train' and '.venv/bin/python -m pytest'"
