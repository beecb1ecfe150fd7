"""Recorded calls that a flush ran before their backward, kept for it.

A read of a recorded value (the loss printed before the backward) runs every
pending call in one flush, and a pipelined chunk runs part of them, merged
before any backward could keep tasks apart. Such a flush keeps its nodes'
inputs (``execute.keeps_inputs``), and a lazy array a read computes notes its
node here, so that a later backward from it can still be walked per sample
(``history.keep_unreached``). A backward that frees its graph ends both
(``history.put_back``).

An in-place write between such a flush and the backward (``x[:] = 0`` on a
sample's input) would differ silently: per sample, MXNet's backward reads the
array's new values; merged, the launch read rows gathered from it at the
flush, and its backward reads those. ``note_write`` notes the kept calls that
read the written memory merged with other samples' rows, and a backward that
reaches one is refused (``history.refuse_written``)."""
import weakref

from mxnet.ndarray import NDArray

from ..graph import Graph, Node, Ref
from . import _mxapi

#: lazy arrays read while their recorded node kept its inputs: id -> (weak
#: reference, node); a backward that frees its graph drops its thread's, and
#: notes whose array is gone or whose node let go of its inputs (a release
#: past ``Graph.retire``'s bounds) go when there are more than PURGE
READ_HEADS = {}
PURGE = 256


def note_read(la, node):
    """Lazy array ``la``, just computed, came from recorded ``node``."""
    if len(READ_HEADS) >= PURGE:
        for k, (ref, n) in list(READ_HEADS.items()):
            if ref() is None or not n.inputs:
                READ_HEADS.pop(k, None)
        if len(READ_HEADS) >= 16 * PURGE:
            READ_HEADS.clear()
    READ_HEADS[id(la)] = (weakref.ref(la), node)


def read_node(la):
    """The node a read lazy array came from (``note_read``), or None."""
    e = READ_HEADS.get(id(la))
    return e[1] if e is not None and e[0]() is la else None


def kept_for_backward(nodes):
    """Whether a retired flush of ``nodes`` kept its recorded nodes' inputs."""
    return bool(nodes) and bool(nodes[-1].mode[0]) and bool(nodes[-1].inputs)


def keeps_recorded(g):
    """Whether graph ``g``'s latest flush kept its recorded nodes' inputs: a
    read then frees nothing."""
    gr: Graph = g
    return gr.sharing is None and bool(gr.retired) and kept_for_backward(gr.retired[-1])


#: kept recorded calls, merged with other samples' rows, whose concrete input
#: was written in place after their flush: id -> (node, the input's shape)
WRITTEN = {}
_SPANS = {}     # id of a graph -> (its kept flushes' ids, [(start, end, node, shape)])


def note_write(g, target):
    """An in-place write to concrete ``target`` in the thread of graph ``g``:
    the kept recorded calls whose launch read its memory merged with other
    samples' rows go in ``WRITTEN`` (module docstring)."""
    gr: Graph = g
    lists = [lst for lst in gr.retired if kept_for_backward(lst)]
    if not lists:
        return
    mine = _mxapi.memory_span(target)
    if mine is None or mine[0] == mine[1]:
        return
    token = tuple(map(id, lists))
    got = _SPANS.get(id(g))
    if got is None or got[0] != token:
        got = _SPANS[id(g)] = (token, _merged_reads(lists))
    written_in(g)       # (the released calls dropped)
    lo, hi = mine
    for start, end, n, shape in got[1]:
        if start < hi and lo < end:
            WRITTEN[id(n)] = (n, shape)


def _merged_reads(lists):
    """The memory spans of the concrete inputs of the calls in ``lists`` that
    ran in a launch of two or more rows (one of a single row reads the array
    itself, as MXNet's backward does)."""
    out = []
    n: Node
    rows = {}       # id of a launch -> its calls (its size counts filler rows too)
    for lst in lists:
        for n in lst:
            if n.group is not None:
                rows[id(n.group)] = rows.get(id(n.group), 0) + 1
    for lst in lists:
        for n in lst:
            if rows.get(id(n.group), 0) < 2:
                continue
            for x in n.inputs:
                if isinstance(x, NDArray) and not isinstance(x, Ref):
                    span = _mxapi.memory_span(x)
                    if span is not None and span[0] != span[1]:
                        out.append((span[0], span[1], n, tuple(x.shape)))
    return out


def written_in(g, drop=False):
    """``WRITTEN``'s entries of graph ``g`` (``{id: (node, shape)}``), the
    released calls' dropped first (no backward reaches them); ``drop``: g's
    go too (a backward freed its kept calls)."""
    mine = {}
    for k, (n, shape) in list(WRITTEN.items()):
        if not n.inputs or (drop and n.graph is g):
            WRITTEN.pop(k, None)
        elif n.graph is g:
            mine[k] = (n, shape)
    return mine


def forget_writes(g):
    """Graph ``g``'s kept calls are released (a backward freed them)."""
    _SPANS.pop(id(g), None)
    written_in(g, drop=True)
