"""In-place writes while calls are pending: what reads the written memory runs first.

Per sample, a call computes with the values it was called with. A write to
an array that a pending call reads (a concrete argument, a parameter of a
recorded block, a lazy array) runs the thread's pending graph first
(:func:`before_write`, from the operator and ``__setitem__`` shims); a write
to a parameter that another thread's pending calls read is refused. A
composite (``nd.concat`` along axis 0, ``nd.stack`` along axis 1) reads its
parts when it is computed, and a reshape, detach or multi-axis index of a
pending lazy array is a recorded operator (a copy, so that it merges) where
MXNet's is a view: the thread's graph keeps weak references to them
(``Graph.aliased``, ``lazy.track``), and those that read the written memory
are computed first, as MXNet computed them when they were made
(:func:`before_aliased_write`)."""
import threading
from collections import deque

try:
    import cython   # compiled: the local type annotations below are C declarations
except ImportError:  # running from source without Cython installed
    from .. import _nocython as cython  # noqa: F401

from mxnet.gluon.block import Block
from mxnet.ndarray import NDArray

from .. import execute, gcdefer
from ..errors import BatchingError, StaleValueError
from ..graph import Composite, Graph, Node, current_graph
from . import _mxapi
from .params import is_param
from .kept import note_write
from .lazy import LazyArray, k_of, node_of, value_of


def before_aliased_write(target):
    """An in-place write to ``target`` (concrete or lazy) is about to run: the
    tracked lazy arrays that read its memory when computed (a composite
    holding it, a view of it, through views: same object or overlapping
    memory) are computed first, as MXNet computed them when they were made."""
    g: Graph = current_graph()
    if not g.aliased or g.executing:
        return
    mem = target.value() if type(target) is LazyArray else target
    span = _mxapi.memory_span(mem) if isinstance(mem, NDArray) else None
    if span is not None and span[0] == span[1]:
        span = None
    spans = {}
    keep = []
    hits = []
    for r in g.aliased:
        la = r()
        if la is None or value_of(la) is not None:
            continue
        node = node_of(la)
        hit = False
        if type(node) is Composite:
            for p in node.parts:
                if _reads(p, target, span, spans):
                    hit = True
                    break
        elif la._base is not None:
            hit = _reads(la._base[0], target, span, spans)
        if hit:
            hits.append(la)
        else:
            keep.append(r)
    g.aliased = keep
    for la in hits:
        try:
            la.value()
        except StaleValueError:
            pass    # made of rows of a failed graph: it fails when read, as before


def _reads(p, target, span, spans):
    """Whether computing a value that reads ``p`` reads ``target``'s memory."""
    while True:
        if p is target:
            return True
        if type(p) is LazyArray:
            m = value_of(p)
            if m is None:
                base = p._base
                if base is not None:     # a view: it will read its source
                    p = base[0]
                    continue
                node = node_of(p)
                if type(node) is not Node or node.batch is None:
                    return False         # pending: no memory yet, or a composite (tracked)
                m = node.batch[k_of(p)]  # a launch's output: its rows are read
        else:
            m = p
        if span is None:
            return False
        key = id(m)
        mine = spans.get(key)
        if mine is None:
            mine = spans[key] = (_mxapi.memory_span(m) or (0, 0), m)
        lo, hi = mine[0]
        return lo < span[1] and span[0] < hi


#: (array, memory span) of the arrays most recently handed out by
#: ``nd.to_dlpack_for_write``, kept alive so that their memory cannot go to
#: another array meanwhile (and their spans stay theirs)
_EXPORTED = deque(maxlen=16)


def note_exported(arr):
    """``arr``'s memory was handed out for writing (DLPack): an array made from
    it (``nd.from_dlpack``) has an engine variable of its own."""
    if any(a is arr for a, _ in _EXPORTED):
        return
    span = _mxapi.memory_span(arr)
    if span is not None and span[0] < span[1]:
        _EXPORTED.append((arr, span))


def _in_exported(target):
    """Whether ``target`` (concrete) shares memory handed out by DLPack."""
    if type(target) is LazyArray or not isinstance(target, NDArray):
        return False
    mine = _mxapi.memory_span(target)
    if mine is None:
        return False
    for _, (lo, hi) in _EXPORTED:
        if lo < mine[1] and mine[0] < hi:
            return True
    return False


def before_write(target, values=True):
    """An in-place write to ``target`` is about to run: if a pending call of this
    thread reads it (a concrete argument, a parameter of a recorded block, a
    lazy array), the pending graph runs first, so it computes with the value
    it was called with, as per-sample code does (inside ``autograd.record``
    MXNet then refuses the write, as it refuses it per sample); a write of
    ``values`` is noted for the backward of kept calls (``kept.note_write``;
    not ``attach_grad``, which changes none). Composites and
    views that read its memory when computed are computed first
    (:func:`before_aliased_write`)."""
    g: Graph = current_graph()
    param = is_param(target)
    if param:
        refuse_if_read_elsewhere(target, g)
    if g.nodes and not g.executing:
        _run_readers(g, target, param)
    if values and g.retired and type(target) is not LazyArray:
        note_write(g, target)       # kept recorded calls that read it: see kept.py
    if g.aliased:
        before_aliased_write(target)
    if _EXPORTED and type(threading.current_thread()).__name__ != "_DummyThread" and \
            _in_exported(target):
        # the engine orders this write after the operators that read the memory
        # through this array's variable only: calls run at their call ('auto'
        # found nothing to merge) may read it through the other's. Not in a
        # thread MXNet started (an autograd.Function's backward runs in one,
        # inside an engine operation that waitall would wait for)
        _mxapi.waitall()


def run_parked(g, reason, still=None):
    """Run the pending graph ``g`` before a change to what its calls read. A
    sample of ``jitbatch.map`` parks here first, as at a read: the flush that
    serves the parked samples may run every call pending now, and the graph
    runs after only if calls are left (and ``still()``, where given, says they
    still read what changes)."""
    gr: Graph = g
    if gr.sharing is not None:
        gr.sharing.wait(gr.nodes[-1])
        if not gr.nodes or (still is not None and not still()):
            return
    execute.run_graph(g, reason=reason)


def _run_readers(g, target, param):
    """``before_write``'s pending calls that read ``target``: they run first."""
    direct = param or type(target) is LazyArray or id(target) in g.reads
    shared = () if direct else _overlapping_reads(g, target)
    if direct or shared:
        read = _read_while_recording(target)
        run_parked(g, "write", lambda: param or id(target) in g.reads or
                   bool(_overlapping_reads(g, target)))
        # an array over the same memory made outside MXNet's views (DLPack,
        # nd.from_numpy) has an engine variable of its own: the engine would not
        # order this write after the launches that read the memory
        for a in shared:
            _mxapi.wait_to_write(a)
        if read and _mxapi.autograd_state()[0]:
            raise BatchingError(
                "Inplace operations (+=, -=, x[:]=, etc) are not supported when recording "
                "with autograd: a call recorded under autograd.record reads this lazy "
                "array, so per sample MXNet refuses the write (the call gave the array "
                "autograd information); merged, the call read rows gathered from it, and "
                "jitbatch refuses the write alike. Fix: write a new array (c = c + x) "
                "instead of changing this one in place.")


def _overlapping_reads(g, target):
    """The arrays pending calls read whose memory overlaps ``target``'s: a view
    of it (``states[i:i+1]`` handed to a call, then ``states[1:2] = 0``), an
    array it views (``w[0][:] = v``), parameters of pending blocks included.
    The reads' spans are made at the first write of a graph, then extended."""
    if type(target) is LazyArray:
        return ()
    mine = _mxapi.memory_span(target)
    if mine is None or mine[0] == mine[1]:
        return ()
    gr: Graph = g
    spans = gr.spans
    if spans is None:
        spans = gr.spans = [0, []]
    reads = gr.reads
    if spans[0] < len(reads):
        found = spans[1]
        for v in list(reads.values())[spans[0]:]:
            for a in (_param_arrays(v) if isinstance(v, Block) else (v,)):
                if type(a) is not LazyArray and isinstance(a, NDArray):
                    span = _mxapi.memory_span(a)
                    if span is not None:
                        found.append((span[0], span[1], a))
        spans[0] = len(reads)
    lo, hi = mine
    return [a for start, end, a in spans[1] if start < hi and lo < end]


def _param_arrays(block):
    """The arrays of ``block``'s parameters (every device's; none where one is
    not initialized yet)."""
    return [a for p in block.collect_params().values() for a in (p._data or ())]  # pylint: disable=protected-access


def refuse_if_read_elsewhere(target, mine):
    """A write to parameter array ``target``: refused while calls of another
    thread that read it are pending (this thread cannot run that thread's
    graph, and they would compute with the new value)."""
    for other in gcdefer.pending():
        og: Graph = other
        if og is mine or not og.nodes or og.executing:
            continue
        for block in og.reads.values():
            if isinstance(block, Block) and any(a is target for a in _param_arrays(block)):
                raise BatchingError(
                    "a parameter of block %s is written in thread %d while calls that read "
                    "it are pending in thread %d: they would compute with the new value, as "
                    "per sample they computed when called. Fix: read their outputs (or call "
                    "jitbatch.flush()) in thread %d before another thread writes the "
                    "parameters." % (block.name, threading.get_ident(), og.thread, og.thread))


def _read_while_recording(target):
    """Whether lazy ``target`` is read by a pending call recorded under
    ``autograd.record`` (per sample, that call would have given it autograd
    information, and MXNet would refuse an in-place write to it)."""
    if type(target) is not LazyArray:
        return False
    node = target._node
    if type(node) is not Node:
        return False
    n: Node = node
    if n.batch is not None or not n.users:
        return False
    for u in n.users:
        if u.mode[0]:
            return True
    return False


#: handles of operators that write their inputs in place, without ``out=``
#: (``reset_arrays``, which ``ParameterDict.zero_grad`` uses, and the
#: optimizers' update operators, which write their states): filled at install
def setitem(self, key, value):
    """``NDArray.__setitem__``: pending readers of the array run first; a lazy
    value is written as its computed array (MXNet takes only an exact NDArray
    as an array, anything else as Python data)."""
    before_write(self)
    if type(value) is LazyArray:
        value = value.value()
    return _mxapi.nd_setitem(self, key, value)


MUTATING = set()


def find_mutating():
    """Fill :data:`MUTATING` from MXNet's operator table."""
    MUTATING.update(h for name, h in _mxapi.op_handles().items()
                    if name == "reset_arrays" or name.endswith("_update")
                    or "_update_phase" in name)
