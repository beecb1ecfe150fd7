"""The MXNet Gluon backend of jitbatch: the only package that imports MXNet.

Its modules form a one-way stack (each imports only those listed before it):
``_mxapi`` (raw MXNet), ``layout``, ``lazy``, ``meta``, ``rules``, ``gather``,
``executors``, ``flags``, ``signatures``, ``stages``, ``backend``, ``modes``,
``sites``, ``record``, ``rewrite``, ``patch``. See docs/design.rst."""
from .lazy import LazyArray
from .patch import install, installed, uninstall

__all__ = ["LazyArray", "install", "installed", "uninstall"]
