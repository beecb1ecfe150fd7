"""In-place writes against values that read other arrays' memory when computed.

A composite (``nd.concat`` along axis 0, ``nd.stack`` along axis 1) reads its
parts when it is computed, and a reshape, detach or multi-axis index of a
pending lazy array is a recorded operator (a copy, so that it merges) where
MXNet's is a view: the thread's graph keeps weak references to them
(``Graph.aliased``, ``lazy.track``). Before an in-place write, those that read
the written memory are computed, as MXNet computed them when they were made
(``record.before_write`` calls :func:`before_aliased_write`)."""
from mxnet.ndarray import NDArray

from ..errors import StaleValueError
from ..graph import Composite, Graph, Node, current_graph
from . import _mxapi
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
