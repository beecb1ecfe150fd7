"""jitbatch's build. The core's hot modules are compiled by Cython from their own
``.py`` sources when Cython and a C compiler are there (JITBATCH_PURE=1 skips
it); a failed compile leaves the pure-Python package, which behaves the same.
See jitbatch/_compiled.py."""
import importlib.util
import os

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
# jitbatch/_compiled.py needs only the standard library (importing the package
# itself would need MXNet): its module list, source paths and hash are used here
_spec = importlib.util.spec_from_file_location(
    "_jitbatch_compiled", os.path.join(HERE, "jitbatch", "_compiled.py"))
compiled = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compiled)


EXAMPLES = ["tqdm", "matplotlib"]


def source(name):
    return os.path.relpath(compiled.source_of(name), HERE)


def _record(path):
    """The build record beside the extension file ``path``."""
    return os.path.join(os.path.dirname(path), os.path.basename(path).split(".", 1)[0] + ".built")


def _built_from(path, source):
    """Whether extension file ``path`` exists and was compiled from ``source`` as it is now."""
    try:
        with open(_record(path)) as f:
            return os.path.exists(path) and f.read().strip() == compiled.digest(source)
    except OSError:
        return False


class BuildExt(build_ext):
    """build_ext that records, beside each built extension, the SHA-256 of the
    source it came from (jitbatch runs the source if they differ), and does
    not compile an extension again whose build beside its source (an
    editable install's) was made from today's source: a reinstall with nothing
    changed compiles nothing."""

    def build_extension(self, ext):
        path = self.get_ext_fullpath(ext.name)
        src = compiled.source_of(ext.name)
        beside = os.path.join(os.path.dirname(src), os.path.basename(path))
        if _built_from(beside, src):
            if os.path.abspath(beside) != os.path.abspath(path):
                self.mkpath(os.path.dirname(path))
                self.copy_file(beside, path)
                self.copy_file(_record(beside), _record(path))
            print("jitbatch: %s unchanged since it was compiled: not compiled again" % ext.name)
            return
        super().build_extension(ext)

    def run(self):
        super().run()
        for ext in self.extensions:
            path = self.get_ext_fullpath(ext.name)
            if os.path.exists(path):
                with open(_record(path), "w") as f:
                    f.write(compiled.digest(compiled.source_of(ext.name)) + "\n")


def extensions():
    if compiled.pure():
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        return []
    exts = [Extension(m, [source(m)], optional=True) for m in compiled.MODULES]
    exts = cythonize(exts, quiet=True, compiler_directives={"language_level": 3, "binding": True})
    for ext in exts:
        # cythonize returns new Extension objects without the flag: without it a
        # missing or failing C compiler would fail the whole install
        ext.optional = True
    return exts


setup(
    name="jitbatch",
    version="0.1.0",
    description="Just-in-time dynamic batching for Apache MXNet Gluon",
    long_description=open(os.path.join(HERE, "README.rst")).read(),
    # only the library: the examples, scripts and tests run from a checkout
    # (``python -m examples.tree_lstm.train`` from its root), never from site-packages
    packages=find_packages(include=["jitbatch", "jitbatch.*"]),
    # the compiled modules' type declarations: part of each build's source hash
    package_data={"jitbatch": ["*.pxd"], "jitbatch.gluon": ["*.pxd"]},
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExt},
    python_requires=">=3.8",
    # what the library itself imports; Cython is a build requirement (pyproject.toml)
    install_requires=[
        "mxnet==1.9.1",
        "numpy>=1.20,<1.24",      # mxnet 1.9.1 uses np.bool
        "greenlet>=2.0",          # jitbatch.map's samples: coroutines on the caller's thread
    ],
    extras_require={
        # the Tree-LSTM example and the benchmark scripts: progress bars and plots
        "examples": EXAMPLES,
        "test": ["pytest", "pytest-xdist", "hypothesis"] + EXAMPLES,
    },
)
