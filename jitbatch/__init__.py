"""jitbatch: just-in-time dynamic batching for MXNet Gluon.

    import jitbatch                              # installs the hook
    net.hybridize(dynamic_batch=True)            # per-sample code, batched execution

Calls to flagged blocks (and NDArray operators on their results) are recorded
per sample into a lazy graph and run, when a value is needed, as merged
executions of same-signature calls. See README.rst.
"""
from . import _compiled
_compiled.choose()   # before any compiled module loads: stale builds run from source
from . import config, cost  # noqa: E402
from ._compiled import compiled_modules  # noqa: E402
from .errors import (BatchingError, ExecutionError, FlagError, JitBatchError,
                     StaleValueError)
from .graph import current_graph
from .schedule import POLICIES
from .stats import STATS

__version__ = "0.1.0"
__all__ = ["install", "uninstall", "flush", "stats", "reset_stats", "config", "POLICIES",
           "LazyArray", "JitBatchError", "FlagError", "BatchingError", "ExecutionError",
           "StaleValueError", "is_lazy", "compiled_modules", "zero_pad"]


def install():
    """Install the MXNet hooks (done by ``import jitbatch``; idempotent)."""
    from .gluon import hook
    hook.install()


def uninstall():
    """Flush this thread's pending graph and restore MXNet's own methods."""
    from .gluon import hook
    hook.uninstall()


def zero_pad(block, **axes):
    """Declare inputs of ``block`` zero-paddable along an axis, e.g.
    ``jitbatch.zero_pad(cell, ch=1, cc=1)``: calls that differ only in those
    sizes then merge into one launch. See ``jitbatch.gluon.hook.zero_pad``."""
    from .gluon import hook
    return hook.zero_pad(block, **axes)


def flush():
    """Compute everything pending in this thread's graph (and ask MXNet for the
    autograd state again at the next record: see Known limits in docs/design.rst)."""
    from .gluon import backend, hook
    backend.flush_graph(current_graph(), reason="flush")
    hook.forget_mode()


def stats():
    """Counters: nodes, launches, flushes, forced_flushes, analysis_seconds,
    execute_seconds, release_seconds, ... ``last_flush`` (policy chosen and why) and ``pipeline``
    (per recording thread and autograd mode: the chunk count pipelined flushes
    use and the measured microseconds per node of each count tried; see
    ``jitbatch.cost.Pipe``)."""
    s = STATS.snapshot()
    s["pipeline"] = cost.MODEL.pipeline_report()
    s["pending"] = len(current_graph().nodes)
    s["nodes"] = s["batched_nodes"] + s["pending"]
    return s


def reset_stats():
    STATS.reset()


def is_lazy(x):
    """True if ``x`` is a lazy array whose value has not been computed yet."""
    return isinstance(x, LazyArray) and x._value is None


try:  # the framework layer after the core; the core alone works without MXNet
    import mxnet  # noqa: F401  (is the framework there?)
except ImportError:  # pragma: no cover - exercised by tests/test_core_pure.py
    LazyArray = None
else:
    from .gluon import LazyArray  # noqa: E402
    install()
