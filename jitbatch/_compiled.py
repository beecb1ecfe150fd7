"""Optional compiled modules: the core's hot paths, compiled by Cython from the
very same ``.py`` sources (no second implementation).

``setup.py`` compiles the modules listed in :data:`MODULES` when Cython and a C
compiler are there, and writes beside each extension a ``.built`` file holding
the SHA-256 of the source it was compiled from (mtimes would not do: a wheel
install or a checkout resets them). At import, :func:`choose`
checks every extension against its source: one built from an older source (the
``.py`` was edited after the build) is not used; the source runs instead, with
a warning naming the rebuild command. ``JITBATCH_PURE=1`` runs every module
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

#: compiled by setup.py (the graph, scheduling, flush and Gluon recording paths)
MODULES = ("jitbatch.graph", "jitbatch.schedule", "jitbatch.execute", "jitbatch.cost",
           "jitbatch.gluon.array", "jitbatch.gluon.backend", "jitbatch.gluon.hook")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pure():
    """True when ``JITBATCH_PURE`` asks for the Python sources only."""
    return os.environ.get("JITBATCH_PURE", "") not in ("", "0")


def source_of(name):
    return os.path.join(_ROOT, *name.split(".")) + ".py"


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


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
    """Decide, before any of them is imported, which modules run from source."""
    every = pure()
    sources, stale = {}, []
    for name in MODULES:
        ext = extension_of(name)
        if ext is None:
            continue
        py = source_of(name)
        if every:
            sources[name] = py
            continue
        try:
            with open(py[:-3] + ".built") as f:
                built = f.read().strip()
        except OSError:
            built = None
        if built != digest(py):
            sources[name] = py
            stale.append(os.path.relpath(py, _ROOT))
    if stale:
        warnings.warn(
            "jitbatch: %s changed since %s compiled (or %s no build record); running "
            "the Python source instead, which is slower. Fix: rebuild with `pip install "
            "-e .` (or `python setup.py build_ext --inplace`), or set JITBATCH_PURE=1 to "
            "run every module from source without this warning."
            % (", ".join(stale), "it was" if len(stale) == 1 else "they were",
               "has" if len(stale) == 1 else "have"), RuntimeWarning, stacklevel=3)
    if sources:
        sys.meta_path.insert(0, _Sources(sources))


def compiled_modules():
    """Names of jitbatch's modules running compiled in this process."""
    out = []
    for name in MODULES:
        m = sys.modules.get(name)
        f = getattr(m, "__file__", None) or ""
        if m is not None and not f.endswith(".py"):
            out.append(name)
    return out
