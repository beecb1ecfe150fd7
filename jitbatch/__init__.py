"""jitbatch: just-in-time dynamic batching for MXNet Gluon.

    import jitbatch                              # installs the hook
    net.hybridize(dynamic_batch=True)            # per-sample code, batched execution

Calls to flagged blocks (and NDArray operators on their results) are recorded
per sample into a lazy graph and run, when a value is needed, as merged
executions of same-signature calls. See README.rst.
"""
from . import _compiled
_compiled.choose()   # before any compiled module loads: stale builds run from source
from . import config, cost, execute  # noqa: E402
from ._compiled import compiled_modules  # noqa: E402
from .errors import (BatchingError, BudgetWarning, ContractWarning, ExecutionError,  # noqa: E402
                     FlagError, JitBatchError, StaleValueError)
from .graph import current_graph  # noqa: E402
from .pipeline import PIPELINES  # noqa: E402
from .schedule import POLICIES  # noqa: E402
from .stats import STATS  # noqa: E402

__version__ = "0.1.0"
__all__ = ["install", "uninstall", "flush", "stats", "reset_stats", "config", "POLICIES",
           "LazyArray", "JitBatchError", "FlagError", "BatchingError", "ExecutionError",
           "StaleValueError", "ContractWarning", "BudgetWarning", "is_lazy", "compiled_modules", "zero_pad"]
# jitbatch.map (a per-sample loop whose reads wait for each other) stays out of
# __all__: a star import would hide the builtin map


def flush():
    """Compute everything pending in this thread's graph (and ask MXNet for the
    autograd state again at the next record: see Known limits in docs/design.rst)."""
    execute.run_graph(current_graph(), reason="flush")
    if forget_mode is not None:
        forget_mode()


def stats():
    """Counters: nodes, launches, flushes, forced_flushes, analysis_seconds,
    execute_seconds, release_seconds, ... ``last_flush`` (policy chosen and why) and ``pipeline``
    (per recording thread, autograd mode and network: the chunk count pipelined flushes
    use and the measured microseconds per node of each count tried; see
    ``jitbatch.pipeline.Pipe``)."""
    s = STATS.snapshot()
    s["pipeline"] = PIPELINES.report()
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
    LazyArray = install = uninstall = zero_pad = forget_mode = map = None  # noqa: A001
else:
    from .gluon import LazyArray, install, uninstall  # noqa: E402
    from .gluon.flags import zero_pad  # noqa: E402
    from .gluon.modes import forget_mode  # noqa: E402
    from .gluon.interleave import map_samples as map  # noqa: E402,A001
    install()
