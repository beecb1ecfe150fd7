#!/usr/bin/env python3
"""Check what ``pip install .`` gives a user: build the wheel and read its
metadata and contents, then install the checkout into a fresh virtual
environment and list what came with it.

    python3 scripts/check_package.py            # wheel + fresh install (a few minutes)
    python3 scripts/check_package.py --wheel-only

Passes when the wheel holds only the ``jitbatch`` package (no top-level
``examples``), its unconditional requirements are MXNet and numpy, and the
fresh environment has no gluonnlp, scipy, matplotlib, tqdm or Cython. Needs
only the standard library and PyPI. JITBATCH_PURE=1 is set for the builds, so
the check does not spend a minute compiling (what is installed is the same,
less the compiled modules). Exit status 0 on success, 1 with the reasons."""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import venv
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED = {"greenlet", "mxnet", "numpy"}
UNWANTED = {"gluonnlp", "scipy", "matplotlib", "tqdm", "cython"}


def say(msg):
    print("check_package: " + msg, flush=True)


def run(cmd, **kw):
    env = dict(os.environ, JITBATCH_PURE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    # a check of the checkout as a user gets it: no PYTHONPATH from the caller
    env.pop("PYTHONPATH", None)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, **kw)
    if r.returncode:
        sys.exit("check_package: %s failed (exit %d):\n%s%s"
                 % (" ".join(cmd), r.returncode, r.stdout[-3000:], r.stderr[-3000:]))
    return r.stdout


def requirement_name(spec):
    return re.split(r"[<>=!~ ;\[(]", spec.strip(), maxsplit=1)[0].lower().replace("_", "-")


def check_wheel(tmp):
    """Problems found in the wheel built from the checkout (empty when fine)."""
    say("building the wheel (pip wheel --no-deps .)")
    out = os.path.join(tmp, "wheel")
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, ROOT])
    (name,) = [n for n in os.listdir(out) if n.endswith(".whl")]
    problems = []
    with zipfile.ZipFile(os.path.join(out, name)) as whl:
        files = whl.namelist()
        top = sorted({f.split("/", 1)[0] for f in files})
        meta = whl.read(next(f for f in files if f.endswith(".dist-info/METADATA"))).decode()
    say("wheel %s: top-level entries %s" % (name, ", ".join(top)))
    packages = [t for t in top if not t.endswith(".dist-info")]
    if packages != ["jitbatch"]:
        problems.append("the wheel installs %s, expected only jitbatch" % packages)
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines()
                if line.startswith("Requires-Dist:")]
    always = sorted(r for r in requires if "extra ==" not in r)
    say("unconditional requirements: %s" % "; ".join(always))
    say("extras: %s" % "; ".join(r for r in requires if "extra ==" in r))
    if {requirement_name(r) for r in always} != REQUIRED:
        problems.append("unconditional requirements %s, expected only %s"
                        % (always, sorted(REQUIRED)))
    return problems, os.path.join(out, name)


def check_fresh_install(tmp):
    """Problems found after ``pip install .`` into a new virtual environment."""
    env_dir = os.path.join(tmp, "venv")
    say("creating a fresh virtual environment in %s" % env_dir)
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = os.path.join(env_dir, "bin", "python")
    say("pip install . (MXNet is a large download unless pip has it cached)")
    t0 = time.perf_counter()
    run([py, "-m", "pip", "install", "-q", ROOT])
    say("installed in %.0f s" % (time.perf_counter() - t0))
    listed = json.loads(run([py, "-m", "pip", "list", "--format", "json"]))
    have = {requirement_name(d["name"]) for d in listed}
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(env_dir)
               for f in files if not os.path.islink(os.path.join(d, f)))
    say("installed distributions (%.0f MB in all): %s" % (size / 2 ** 20, ", ".join(sorted(have))))
    problems = ["%s was installed" % n for n in sorted(have & UNWANTED)]
    site = run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    if os.path.exists(os.path.join(site, "examples")):
        problems.append("a top-level 'examples' package is in %s" % site)
    # away from the checkout, so only what was installed can be imported
    probe = ("import importlib.util, jitbatch; "
             "print(jitbatch.__file__, importlib.util.find_spec('examples') is None)")
    got = run([py, "-c", probe], cwd=tmp).split()
    say("import jitbatch from outside the checkout: %s; 'examples' importable: %s"
        % (got[0], got[1] == "False"))
    if got[1] != "True":
        problems.append("'import examples' works in the fresh environment")
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel-only", action="store_true",
                        help="only build and read the wheel (no fresh environment)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="jitbatch-check-") as tmp:
        problems, _ = check_wheel(tmp)
        if not args.wheel_only:
            problems += check_fresh_install(tmp)
    if problems:
        for p in problems:
            print("check_package: FAILED: " + p, file=sys.stderr)
        return 1
    say("OK: only jitbatch, requiring only %s" % " and ".join(sorted(REQUIRED)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
