"""The MXNet Gluon backend of jitbatch: the only package that imports MXNet.

Its modules form a one-way stack (each imports only those listed before it):
``_mxapi`` (raw MXNet), ``layout``, ``modes``, ``interleave``, ``kept``,
``lazy``, ``meta``, ``rules``, ``axis_rules``, ``contract``, ``gradients``,
``history``, ``gather``,
``executors``, ``writes``, ``flags``, ``signatures``, ``stages``, ``backend``,
``sites``, ``fused``, ``record``, ``rewrite``, ``guards``, ``patch``. See
docs/design.rst."""
from .lazy import LazyArray
from .patch import install, installed, uninstall

__all__ = ["LazyArray", "install", "installed", "uninstall"]
