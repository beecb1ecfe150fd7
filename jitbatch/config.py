"""Process-wide settings (plain module attributes; read on the hot path)."""

#: the pending graph flushes itself when it holds this many nodes (bounded memory)
max_pending = 200000

#: under policy 'auto', flush a large pending graph in chunks while recording
#: goes on (one chunk's kernels run while the next is recorded), in the number
#: of chunks measured fastest (``cost.Pipe``), where MXNet's kernels leave a
#: core free (``OMP_NUM_THREADS`` below the core count); False: a graph runs
#: only when read (or at ``max_pending``)
pipeline = True

#: store a full stack per recorded node (slow) instead of one ``file:line`` call site
debug = False

#: while a graph is pending, raise the thresholds of Python's older GC
#: generations (generation 0 still collects young garbage), restored at the
#: flush: everything a graph allocates stays alive until its flush, so older
#: collections during recording rescan the growing graph and free nothing
#: (measured: a third of recording a 256-pair Tree-LSTM inference batch; see
#: ``jitbatch.gcdefer``). False leaves the GC alone.
defer_gc = True

#: run the merged graphs' elementwise ``sigmoid``/``tanh``/``relu`` operators as
#: MXNet's ``Activation`` operator (oneDNN on CPU, cuDNN on GPU): the same
#: functions up to float rounding, several times faster on CPU
#: (``jitbatch.gluon.rewrite``). Read when a ``dynamic_batch`` block is traced.
fast_activations = True

#: run the merged graphs' ``split``/``SliceChannel`` operators along an axis
#: >= 1 (the gates of ``GRUCell``/``LSTMCell``, ``F.split(x, 3, axis=1)``) on
#: a view of their input with that axis cut in two, which MXNet's CPU kernel
#: copies in contiguous runs instead of element by element: the same outputs,
#: bit for bit (``jitbatch.gluon.rewrite``). Read when a ``dynamic_batch``
#: block is traced.
fast_splits = True

#: a merged launch of a block over more than ``2 * row_buckets`` samples runs
#: on a sample count rounded up to one of ``row_buckets`` sizes per doubling
#: (a power of two, others act as the power of two below them; 16: at most
#: 1/16 more rows), the extra samples copies of
#: the launch's first whose outputs are never read (they add nothing to any
#: gradient). oneDNN (and cuDNN's autotuning) prepare kernels per input shape
#: (measured on this CPU: ~0.15 ms per new shape of an ``Activation``, ~0.4 ms
#: of a ``FullyConnected``); without rounding nearly every launch of fresh
#: data has a shape never seen before. 0: exact sizes. Ragged launches (their
#: rows vary per sample) keep theirs.
row_buckets = 16

#: a flagged block whose graph cannot be merged exactly (an operator that mixes
#: the rows of different samples, draws one random value per launch, or has no
#: rule: jitbatch.gluon.contract) runs its calls one per sample and warns once
#: (``jitbatch.ContractWarning``); True raises ``BatchingError`` there instead
strict = False

#: ``jitbatch.map`` runs at most this many samples at once (each a greenlet,
#: holding its frames while it waits at a read; the name is from when each
#: ran in a thread): the samples past it start as earlier ones end, so a
#: minibatch larger than it flushes each read point once per this many samples
map_threads = 256


# -- checked at assignment -------------------------------------------------------------
# Reads stay plain module attribute reads (the hot path); an assignment of a
# bad value or an unknown name is a FlagError at the line that made it.
import numbers as _numbers
import sys as _sys
import types as _types

from .errors import FlagError as _FlagError


def _flag(v):
    return isinstance(v, bool)


def _count(least):
    return lambda v: isinstance(v, _numbers.Integral) and not isinstance(v, bool) and v >= least


#: setting -> (check, what it expects, its default)
_EXPECTED = {
    "max_pending": (_count(1), "an int >= 1 (pending nodes at which a graph runs itself)",
                    200000),
    "pipeline": (_flag, "True or False", True),
    "debug": (_flag, "True or False", False),
    "defer_gc": (_flag, "True or False", True),
    "fast_activations": (_flag, "True or False", True),
    "fast_splits": (_flag, "True or False", True),
    "row_buckets": (_count(0), "an int >= 0 (launch sizes per doubling; 0: exact sizes)", 16),
    "strict": (_flag, "True or False", False),
    "map_threads": (_count(1), "an int >= 1 (the most samples of a jitbatch.map running "
                               "at once)", 256),
}


class _Settings(_types.ModuleType):
    """This module's type: assignments to its settings are checked."""

    def __setattr__(self, name, value):
        if not name.startswith("_"):
            known = _EXPECTED.get(name)
            if known is None:
                raise _FlagError(
                    "jitbatch.config.%s: no such setting. Fix: use one of %s."
                    % (name, ", ".join(sorted(_EXPECTED))))
            if not known[0](value):
                raise _FlagError(
                    "jitbatch.config.%s = %r: expected %s. Fix: set it to such a value, e.g. "
                    "%r (the default)." % (name, value, known[1], known[2]))
            if isinstance(value, _numbers.Integral) and not isinstance(value, bool):
                value = int(value)
        super(_Settings, self).__setattr__(name, value)


_sys.modules[__name__].__class__ = _Settings
