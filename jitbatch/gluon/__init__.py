"""The MXNet Gluon backend of jitbatch: the only package that imports MXNet."""
from .array import LazyArray
from .hook import TABLE, install, installed, uninstall

__all__ = ["LazyArray", "TABLE", "install", "installed", "uninstall"]
