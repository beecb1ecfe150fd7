"""Optional compiled modules: the core's hot paths, compiled by Cython from the
very same ``.py`` sources (no second implementation); a ``.pxd`` beside a source gives
its classes C layouts and some locals C types (Cython's augmenting ``.pxd``
files and local annotations: declarations only, the code is the ``.py``).

``setup.py`` compiles the modules listed in :data:`MODULES` when Cython and a C
compiler are there, and writes beside each extension a ``.built`` file holding
the SHA-256 of the source it was compiled from (mtimes would not do: a wheel
install or a checkout resets them). At import, :func:`choose`
checks every extension against its source: if one was built from an older
source (the ``.py`` or ``.pxd`` was edited after the build), no extension is
used (they share C layouts); the sources run instead, with a warning naming
the stale ones and the rebuild command. ``JITBATCH_PURE=1`` runs every module
from source (profilers see inside; a baseline for comparisons). Behaviour is
the same either way: the test suite runs against both (tests/test_compiled.py).
"""
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings

#: compiled by setup.py: the records and loops run per node (graph, scheduling,
#: recording, gather planning) and the direct MXNet calls; the per-flush code
#: (cost, execute, pipeline) gains nothing measurable compiled and stays Python
MODULES = ("jitbatch.graph", "jitbatch.signature", "jitbatch.schedule",
           "jitbatch.gluon._mxapi", "jitbatch.gluon.lazy", "jitbatch.gluon.meta",
           "jitbatch.gluon.gather", "jitbatch.gluon.signatures", "jitbatch.gluon.modes",
           "jitbatch.gluon.sites", "jitbatch.gluon.writes", "jitbatch.gluon.record",
           "jitbatch.gluon.patch", "jitbatch.gluon.opkeys")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pure():
    """True when ``JITBATCH_PURE`` asks for the Python sources only."""
    return os.environ.get("JITBATCH_PURE", "") not in ("", "0")


def source_of(name):
    return os.path.join(_ROOT, *name.split(".")) + ".py"


def digest(path):
    """SHA-256 of a module's source ``path`` and of every ``.pxd`` of the package:
    a compiled module reads the C layouts the ``.pxd`` files declare, its own
    and those it cimports, so its build is stale when any of them changed."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read())
    for rel in _declarations():
        with open(os.path.join(_ROOT, rel), "rb") as f:
            h.update(rel.encode() + b"\0" + f.read())
    return h.hexdigest()


def _declarations():
    """The package's ``.pxd`` files, as paths relative to the package's parent
    (the same wherever it is installed), in a fixed order."""
    pkg = os.path.join(_ROOT, "jitbatch")
    found = []
    for folder, _, files in os.walk(pkg):
        for name in files:
            if name.endswith(".pxd"):
                found.append(os.path.relpath(os.path.join(folder, name), _ROOT))
    return sorted(p.replace(os.sep, "/") for p in found)


def extension_of(name):
    """The compiled file of module ``name`` next to its source, or None."""
    base = source_of(name)[:-3]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if os.path.exists(base + suffix):
            return base + suffix
    return None


class _Sources(importlib.abc.MetaPathFinder):
    """Finds the listed modules as their ``.py`` sources (ahead of the extensions)."""

    def __init__(self, paths):
        self.paths = paths

    def find_spec(self, fullname, path=None, target=None):  # pylint: disable=unused-argument
        py = self.paths.get(fullname)
        return None if py is None else importlib.util.spec_from_file_location(fullname, py)


def choose():
    """Decide, before any of them is imported, which modules run from source:
    all of them when ``JITBATCH_PURE`` is set or when any build is stale (the
    compiled modules share their classes' C layouts, so a module's build is
    only valid beside the builds it was compiled with)."""
    built, stale = {}, []
    for name in MODULES:
        ext = extension_of(name)
        if ext is None:
            continue
        py = source_of(name)
        built[name] = py
        if pure():
            continue
        try:
            with open(py[:-3] + ".built") as f:
                record = f.read().strip()
        except OSError:
            record = None
        if record != digest(py):
            stale.append(os.path.relpath(py, _ROOT))
    if stale:
        warnings.warn(
            "jitbatch: %s changed since %s compiled (or %s no build record); running "
            "every module from its Python source instead, which is slower. Fix: "
            "rebuild with `pip install -e .` (or `python setup.py build_ext "
            "--inplace`), or set JITBATCH_PURE=1 to run from source without this "
            "warning."
            % (", ".join(stale), "it was" if len(stale) == 1 else "they were",
               "has" if len(stale) == 1 else "have"), RuntimeWarning, stacklevel=3)
    if built and (stale or pure()):
        sys.meta_path.insert(0, _Sources(built))


def compiled_modules():
    """Names of jitbatch's modules running compiled in this process."""
    out = []
    for name in MODULES:
        m = sys.modules.get(name)
        f = getattr(m, "__file__", None) or ""
        if m is not None and not f.endswith(".py"):
            out.append(name)
    return out
