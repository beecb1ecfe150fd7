#!/usr/bin/env bash
# Build DyNet 2.1.2 natively (-march=native, as DyNet's own Release build does)
# into its own virtual env, for scripts/bench_dynet.py and
# `scripts/bench_tree_lstm.py --dynet VENV/bin/python`.
#
#   scripts/build_dynet.sh [VENV_DIR]          # default /tmp/dynet-venv
#
# Environment (all optional):
#   PYTHON=python3          interpreter the venv is made from (MXNet's side uses 3.11)
#   DYNET_BUILD_DIR=DIR     where the sources and Eigen go (default: VENV_DIR-build)
#   DYNET_EIGEN=cmeel|apt   Eigen 3.4.0 headers from the cmeel-eigen wheel on PyPI
#                           (default; needs no root) or Debian's libeigen3-dev (apt-get)
#   EIGEN3_INCLUDE_DIR=DIR  headers already on disk (overrides DYNET_EIGEN)
#   JOBS=N                  make's parallelism (default: nproc)
#
# Why not `pip install dynet`: DyNet 2.1.2 is on PyPI only as an sdist whose
# setup.py downloads an Eigen snapshot from GitHub, which is not reachable
# here; and the prebuilt `dyNET38` wheel is compiled for generic x86-64, so it
# would understate DyNet. 5-15 min on 2 cores (run it under `nice`).
#
# Idempotent: when VENV_DIR's python already imports DyNet 2.1.2 the build is
# skipped; the closing check (import dynet, a tiny autobatched training step)
# always runs.
set -euo pipefail

VENV=${1:-/tmp/dynet-venv}
VENV=$(realpath -m "$VENV")
PYTHON=${PYTHON:-python3}
BUILD=$(realpath -m "${DYNET_BUILD_DIR:-$VENV-build}")
JOBS=${JOBS:-$(nproc)}
DYNET_VERSION=2.1.2
EIGEN_VERSION=3.4.0
VPY="$VENV/bin/python"

say() { printf '[build_dynet] %s\n' "$*"; }
die() { printf '[build_dynet] ERROR: %s\n' "$*" >&2; exit 1; }
run() { say "+ $*"; "$@"; }

have_dynet() {
    # the distribution must be dyNET 2.1.2 (not the generic dyNET38 wheel) and import
    [ -x "$VPY" ] && "$VPY" - "$DYNET_VERSION" >/dev/null 2>&1 <<'EOF'
import sys
from importlib.metadata import version
assert version("dyNET") == sys.argv[1], version("dyNET")
import dynet_config
dynet_config.set(mem="32")
import dynet  # noqa: F401
EOF
}

check() {
    say "check: import dynet and one autobatched training step"
    "$VPY" - <<'EOF'
import os
from importlib.metadata import version
import dynet_config
dynet_config.set(mem="64", autobatch=1, random_seed=1)
import dynet as dy

pc = dy.ParameterCollection()
emb = pc.add_lookup_parameters((10, 3))
w = pc.add_parameters((4, 3))
trainer = dy.AdagradTrainer(pc, learning_rate=0.1)
losses = []
for step in range(2):
    dy.renew_cg()
    # five independent per-sample expressions: autobatching merges them
    total = dy.esum([dy.squared_norm(dy.tanh(w * dy.lookup(emb, i))) for i in range(5)])
    losses.append(total.value())
    total.backward()
    trainer.update()
assert losses[1] < losses[0], losses
import sys
lib = os.path.join(sys.prefix, "lib", "libdynet.so")   # setup.py's `make install` target
print("[build_dynet] OK: dyNET %s from %s, %s; loss %.4f -> %.4f"
      % (version("dyNET"), dy.__file__, lib if os.path.exists(lib) else "no " + lib,
         losses[0], losses[1]))
EOF
}

if have_dynet; then
    say "$VPY already imports DyNet $DYNET_VERSION: build skipped"
    check
    exit 0
fi

if [ -x "$VPY" ] && "$VPY" -m pip show -q dyNET38 >/dev/null 2>&1; then
    die "$VENV has the generic dyNET38 wheel: give a fresh VENV_DIR" \
        "(or pip uninstall dyNET38 there)"
fi

# --- tools --------------------------------------------------------------------
for tool in cmake make gcc g++; do
    command -v "$tool" >/dev/null \
        || die "'$tool' not found: install it (Debian: apt-get install cmake make g++)"
done
command -v "$PYTHON" >/dev/null \
    || die "PYTHON=$PYTHON not found: set PYTHON to a python3 interpreter"
say "venv $VENV, sources and Eigen in $BUILD, make -j$JOBS"
say "$("$PYTHON" --version), $(cmake --version | head -1), $(g++ --version | head -1)"

# --- venv and build requirements -------------------------------------------------
if [ ! -x "$VPY" ]; then
    run "$PYTHON" -m venv "$VENV"
fi
# Cython < 3: DyNet 2.1.2's _dynet.pyx predates Cython 3 (and its changed defaults)
run "$VPY" -m pip install --quiet "cython<3" numpy setuptools wheel
mkdir -p "$BUILD"
cd "$BUILD"

# --- Eigen headers -----------------------------------------------------------------
if [ -n "${EIGEN3_INCLUDE_DIR:-}" ]; then
    EIGEN=$EIGEN3_INCLUDE_DIR
    say "Eigen: EIGEN3_INCLUDE_DIR=$EIGEN (from the environment)"
elif [ "${DYNET_EIGEN:-cmeel}" = apt ]; then
    if [ ! -f /usr/include/eigen3/Eigen/Core ]; then
        [ "$(id -u)" = 0 ] \
            || die "DYNET_EIGEN=apt needs root for apt-get; use DYNET_EIGEN=cmeel"
        run apt-get update -qq
        run apt-get install -y -qq libeigen3-dev
    fi
    EIGEN=/usr/include/eigen3
elif [ "${DYNET_EIGEN:-cmeel}" = cmeel ]; then
    EIGEN=$BUILD/eigen/cmeel.prefix/include/eigen3
    if [ ! -f "$EIGEN/Eigen/Core" ]; then
        # only the headers are used: unpack the wheel, install nothing
        rm -rf eig eigen
        run "$VPY" -m pip download --quiet --no-deps "cmeel-eigen==$EIGEN_VERSION" -d eig
        wheel=$(ls eig/cmeel_eigen-*.whl 2>/dev/null | head -1)
        [ -n "$wheel" ] \
            || die "pip download cmeel-eigen==$EIGEN_VERSION gave no wheel in $BUILD/eig"
        run "$VPY" -m zipfile -e "$wheel" eigen
    fi
else
    die "DYNET_EIGEN=${DYNET_EIGEN}: expected cmeel or apt"
fi
[ -f "$EIGEN/Eigen/Core" ] \
    || die "no Eigen/Core under $EIGEN: set EIGEN3_INCLUDE_DIR to Eigen's include dir"
say "Eigen headers: $EIGEN ($(sed -n 's/^#define EIGEN_\(WORLD\|MAJOR\|MINOR\)_VERSION *//p' \
    "$EIGEN/Eigen/src/Core/util/Macros.h" | paste -sd.))"

# --- DyNet sources ------------------------------------------------------------------
SRC=$BUILD/dyNET-$DYNET_VERSION
if [ ! -f "$SRC/setup.py" ]; then
    if [ ! -f "dyNET-$DYNET_VERSION.tar.gz" ]; then
        # --no-build-isolation: pip prepares the sdist's metadata with the venv's
        # Cython/setuptools instead of building its build requirements from source
        run "$VPY" -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation \
            "dynet==$DYNET_VERSION" -d .
    fi
    run tar xzf "dyNET-$DYNET_VERSION.tar.gz"
fi

# setup.py chdirs into build/<py>-<arch>/python before the wheel is packed, and
# the packing then looks for LICENSE.txt relative to that directory ("No such
# file or directory: 'LICENSE.txt'"). Put a copy where it will look, named the
# way setup.py names that directory for this interpreter.
license_dirs() {
    "$VPY" -c 'import platform, sys
print("%s/build/py%d.%d-%s/python" % (sys.argv[1], sys.version_info[0], sys.version_info[1],
                                    platform.architecture()[0]))' "$SRC"
    # and any build directory an earlier run left
    find "$SRC/build" -mindepth 2 -maxdepth 2 -type d -name python 2>/dev/null || true
}
place_license() {
    local d
    for d in $(license_dirs | sort -u); do
        mkdir -p "$d"
        cp -f "$SRC/LICENSE.txt" "$d/"
    done
}

# --- build ------------------------------------------------------------------------------
install_dynet() {  # LOG
    # setup.py reads EIGEN3_INCLUDE_DIR and MAKE_FLAGS from the environment; it
    # runs cmake + make (libdynet.so into VENV/lib), then the Cython extension
    # (the full log to a file; make's progress lines and setup.py's steps shown)
    local rc
    (cd "$SRC" && EIGEN3_INCLUDE_DIR="$EIGEN" MAKE_FLAGS="-j$JOBS" \
        "$VPY" -m pip install -v --no-build-isolation --no-deps . ) 2>&1 \
        | tee "$1" \
        | grep --line-buffered -E '^ *\[ *[0-9]+%\]|INFO:root|Successfully|rror'
    rc=${PIPESTATUS[0]}
    return "$rc"
}

place_license
start=$(date +%s)
say "compiling DyNet $DYNET_VERSION (full log: $BUILD/pip-install.log)"
if ! install_dynet "$BUILD/pip-install.log"; then
    if grep -q "No such file or directory: 'LICENSE.txt'" "$BUILD/pip-install.log"; then
        # the build directory was named differently than predicted: the library
        # is built by now, so place the file everywhere it may be looked for and
        # repack (incremental: a few minutes)
        say "wheel packing did not find LICENSE.txt: copying it and retrying"
        place_license
        install_dynet "$BUILD/pip-install-retry.log" \
            || die "pip install failed again; see $BUILD/pip-install-retry.log"
    else
        die "pip install failed; see the end of $BUILD/pip-install.log"
    fi
fi
say "built in $(( ($(date +%s) - start) / 60 )) min $(( ($(date +%s) - start) % 60 )) s"

# where the headers were, for bench_dynet.py's record of the Eigen version
echo "$EIGEN" > "$VENV/eigen3-include"
have_dynet || die "the build finished but $VPY does not import DyNet $DYNET_VERSION"
check
