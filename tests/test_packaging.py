"""What ``pip install .`` installs: the library and its own requirements only.

setup.py is run with ``setuptools.setup`` replaced by a recorder, so this needs
no network and no build; scripts/check_package.py builds the real wheel and
installs it into a fresh environment (README.rst, Set-up)."""
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RECORD = r"""
import json, sys, setuptools
seen = {}
setuptools.setup = lambda **kw: seen.update(kw)
sys.argv = ["setup.py"]
exec(compile(open("setup.py").read(), "setup.py", "exec"),
     {"__name__": "__main__", "__file__": __import__("os").path.abspath("setup.py")})
print(json.dumps({k: seen[k] for k in ("packages", "install_requires", "extras_require",
                                       "package_data")}))
"""


def declared(code=RECORD, pure="1"):
    env = dict(os.environ, JITBATCH_PURE=pure)   # by default no Cython run, only declarations
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def names(requirements):
    return sorted(re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0].lower() for r in requirements)


def test_the_library_requires_only_what_it_imports():
    got = declared()
    assert names(got["install_requires"]) == ["greenlet", "mxnet", "numpy"]
    assert "mxnet==1.9.1" in got["install_requires"]
    for heavy in ("gluonnlp", "scipy", "matplotlib", "cython", "tqdm"):
        assert heavy not in names(got["install_requires"])
    examples = names(got["extras_require"]["examples"])
    assert examples == ["matplotlib", "tqdm"]
    assert set(examples) | {"pytest", "pytest-xdist", "hypothesis"} == \
        set(names(got["extras_require"]["test"]))


def test_only_jitbatch_is_installed_as_a_package():
    got = declared()
    assert got["packages"] and all(p == "jitbatch" or p.startswith("jitbatch.")
                                   for p in got["packages"])
    # every package directory of the library is listed (nothing silently left out)
    on_disk = sorted(os.path.relpath(d, ROOT).replace(os.sep, ".")
                     for d, _, files in os.walk(os.path.join(ROOT, "jitbatch"))
                     if "__init__.py" in files)
    assert sorted(got["packages"]) == on_disk


def test_cython_is_a_build_requirement_only():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    requires = re.search(r"^requires\s*=\s*\[(.*?)\]", text, re.M | re.S).group(1)
    assert "Cython" in requires
    assert "cython" not in names(declared()["install_requires"])


# Cython's cythonize returns new Extension objects and does not copy ``optional``
# (Cython 3.x); this stand-in does the same, without needing Cython installed
FAKE_CYTHON = r"""
import sys, types
from setuptools import Extension
build = types.ModuleType("Cython.Build")
build.cythonize = lambda exts, **kw: [Extension(e.name, [s[:-3] + ".c" for s in e.sources])
                                      for e in exts]
sys.modules["Cython"] = types.ModuleType("Cython")
sys.modules["Cython.Build"] = build
"""


def test_compiled_modules_are_optional_after_cythonize():
    code = FAKE_CYTHON + RECORD.replace(
        'print(json.dumps({k: seen[k] for k in ("packages",',
        'print(json.dumps({"optional": [e.optional for e in seen["ext_modules"]]}))\n'
        'print(json.dumps({k: seen[k] for k in ("packages",')
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                       env=dict(os.environ, JITBATCH_PURE=""), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    optional = json.loads(r.stdout.strip().splitlines()[-2])["optional"]
    # a failed compile (no C compiler) then leaves the pure-Python package installed
    assert optional and all(optional)
