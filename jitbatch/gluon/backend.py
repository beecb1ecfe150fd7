"""Gather / launch / rows on MXNet: the executor side of the Gluon backend.

Layout: a launch over N nodes keeps each output *flat*: per-sample shape
``(b, *rest)`` becomes ``(N*b, *rest)`` (Gluon's batch axis 0), sample ``i``
owning rows ``i*b:(i+1)*b``. Inputs are gathered into that layout with as few
framework ops as possible: the source array itself, one slice, one ``take``, or
one ``concat`` (+ ``take``)."""
import threading

import numpy as np
from mxnet import autograd
from mxnet import ndarray as nd
from mxnet.ndarray import NDArray

from .. import execute
from ..errors import StaleValueError
from ..stats import STATS


class _Detached(object):
    """Stands in as the producer of a lazy array that became concrete (in-place
    write): it is never pending and never part of a batch."""
    batch = ()
    error = None
    depth = 0
    row = -1


DETACHED = _Detached()

_state = threading.local()


def flat_shape(shape, n):
    """Flat batched shape of ``n`` samples of per-sample ``shape``."""
    if not shape:
        return (n,)
    return (n * shape[0],) + tuple(shape[1:])


def rows_of(shape):
    return shape[0] if shape else 1


LazyArray = None  # set by .array (import cycle)


def mode_scope(mode):
    """The autograd (recording, training) state a node was recorded under."""
    return autograd._RecordingStateScope(mode[0], mode[1])  # pylint: disable=protected-access


def _segment(v):
    """(source array, first row, row count, row shape) of one per-sample value."""
    node = v._node if type(v) is LazyArray else None
    if node is None or node is DETACHED:
        if node is DETACHED:
            v = v._value
        shp = v.shape
        return v, 0, shp[0], shp[1:]
    src_shape = node.info.out_meta[v._k][0]
    b = rows_of(src_shape)
    base = node.row * b
    src = node.batch[v._k]
    view = v._view
    if view is None:
        return src, base, b, src_shape[1:]
    return src, base + view[0], view[1], src_shape[1:]


def gather(values, shape, ctx):
    """Gather per-sample ``values`` (all of per-sample ``shape``) into the flat layout."""
    n = len(values)
    segs = [_segment(v) for v in values]
    rs = segs[0][3]
    if any(s[3] != rs for s in segs):
        # mixed producers whose row shapes differ (e.g. a squeezed view beside a
        # plain array): bring each sample to its own array, then concatenate
        parts = [row_value(v) if type(v) is LazyArray else v for v in values]
        parts = [p.reshape(flat_shape(shape, 1)) for p in parts]
        STATS.add(gather_ops=1 + len(parts))
        out = nd.concat(*parts, dim=0) if len(parts) > 1 else parts[0]
        return out
    src0 = segs[0][0]
    out = None
    if all(s[0] is src0 for s in segs):
        start = segs[0][1]
        pos = start
        contiguous = True
        for s in segs:
            if s[1] != pos:
                contiguous = False
                break
            pos += s[2]
        if contiguous:
            if start == 0 and pos == src0.shape[0]:
                out = src0
            else:
                out = nd.slice_axis(src0, axis=0, begin=start, end=pos)
                STATS.add(gather_ops=1)
        else:
            out = nd.take(src0, _index(segs, {id(src0): 0}, ctx), axis=0)
            STATS.add(gather_ops=2)
    else:
        srcs, offsets, off = [], {}, 0
        for s in segs:
            if id(s[0]) not in offsets:
                offsets[id(s[0])] = off
                srcs.append(s[0])
                off += s[0].shape[0]
        whole = len(srcs) == n and all(s[1] == 0 and s[2] == s[0].shape[0] for s in segs)
        big = nd.concat(*srcs, dim=0)
        if whole:
            out = big
            STATS.add(gather_ops=1)
        else:
            out = nd.take(big, _index(segs, offsets, ctx), axis=0)
            STATS.add(gather_ops=3)
    want = flat_shape(shape, n)
    if out.shape != want:
        out = out.reshape(want)
    return out


def _index(segs, offsets, ctx):
    idx = []
    for s in segs:
        base = offsets[id(s[0])] + s[1]
        if s[2] == 1:
            idx.append(base)
        else:
            idx.extend(range(base, base + s[2]))
    return nd.array(np.asarray(idx, dtype=np.int64), ctx=ctx, dtype="int64")


def row_value(v):
    """Concrete NDArray of one lazy value (its rows of the producer's launch)."""
    node = v._node
    if node is DETACHED:
        return v._value
    if v._value is not None:
        return v._value
    src = node.batch[v._k]
    src_shape = node.info.out_meta[v._k][0]
    b = rows_of(src_shape)
    start = node.row * b
    count = b
    if v._view is not None:
        start += v._view[0]
        count = v._view[1]
    if node.mode[0]:
        with mode_scope(node.mode):
            if start == 0 and count == src.shape[0]:
                out = src
            else:
                out = nd.slice_axis(src, axis=0, begin=start, end=start + count)
            if out.shape != v._shape:
                out = out.reshape(v._shape)
        return out
    out = src if (start == 0 and count == src.shape[0]) else src[start:start + count]
    if out.shape != v._shape:
        out = out.reshape(v._shape)
    return out


class Backend(object):
    """The object ``jitbatch.execute.flush`` drives."""

    @staticmethod
    def launch(batch):
        batch[0].info.op.launch(batch)


BACKEND = Backend()


def flush_graph(graph, forced=False, reason="flush"):
    execute.flush(graph, BACKEND, graph.policy or "auto", graph.budget, forced, reason)


def force(node):
    """Make ``node`` computed: flush its graph (in its own thread)."""
    from . import hook  # late: hook imports this module
    if not hook.installed():
        raise StaleValueError(
            "this lazy array (%s, recorded at %s) was still pending when "
            "jitbatch.uninstall() ran; nothing can compute it now. Fix: call "
            "jitbatch.flush() (or read the values) before uninstalling." % (node.info.name, node.site))
    node.graph.check_thread()
    flush_graph(node.graph, forced=True, reason="read")
    if node.batch is None:
        if node.error is not None:
            raise StaleValueError("the graph of this lazy array failed: %s" % node.error) from node.error
        raise StaleValueError("this lazy array was not computed by its graph's flush "
                              "(it was recorded while that graph was executing)")


def is_ndarray(x):
    return isinstance(x, NDArray)
