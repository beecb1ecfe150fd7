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

from .. import execute
from ..graph import Composite
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


def extent(node, k):
    """(first row, rows, rows of the whole launch output) of one node's output k
    within its batch's flat output."""
    if node.rows is None:
        b = rows_of(node.info.out_meta[k][0])
        return node.row * b, b, node.group.size * b
    return node.off, node.rows, node.group.rows


LazyArray = None  # set by .array (import cycle)


def mode_scope(mode):
    """The autograd (recording, training) state a node was recorded under."""
    return autograd._RecordingStateScope(mode[0], mode[1])  # pylint: disable=protected-access


def _segments(v, sizes, out):
    """Append the segments of one value (a composite brings its parts' rows)."""
    if type(v) is LazyArray and type(v._node) is Composite:
        for part in v._node.parts:
            if type(part) is LazyArray and type(part._node) is Composite:
                _segments(part, sizes, out)
            else:
                out.append(_segment(part, sizes))
    else:
        out.append(_segment(v, sizes))


def _segment(v, sizes):
    """(source key, source, first row, row count, row shape, source rows) of one
    per-sample value. ``source`` is a Group (resolved to its output at launch)
    or a concrete array."""
    node = v._node if type(v) is LazyArray else None
    if node is None or node is DETACHED:
        arr = v._value if node is DETACHED else v
        shp = sizes.get(id(arr))
        if shp is None:
            shp = sizes[id(arr)] = arr.shape
        return id(arr), arr, 0, shp[0], shp[1:], shp[0]
    src_shape = node.info.out_meta[v._k][0]
    grp = node.group
    base, b, full = extent(node, v._k)
    view = v._view
    key = (id(grp), v._k)
    if view is None:
        return key, (grp, v._k), base, b, src_shape[1:], full
    return key, (grp, v._k), base + view[0], view[1], src_shape[1:], full


class Plan(object):
    """How one argument of one batch is gathered: ``kind`` is 'id' (the source
    as is), 'slice', 'take', 'concat', 'concat_take' or 'each' (per sample)."""
    __slots__ = ("kind", "srcs", "start", "stop", "want", "values")

    def __init__(self, kind, srcs, start, stop, want, values=None):
        self.kind = kind
        self.srcs = srcs
        self.start = start
        self.stop = stop
        self.want = want
        self.values = values


def plan_gather(values, shape, index, sizes):
    """Plan the gather of per-sample ``values`` (all of per-sample ``shape``) into
    the flat layout; index lists are appended to ``index`` (one copy per flush)."""
    n = len(values)
    segs = []
    for v in values:
        _segments(v, sizes, segs)
    if shape[0] is None:   # ragged: each sample brings its own leading length
        want = (sum(v._shape[0] if type(v) is LazyArray else sizes[id(v)][0]
                    for v in values),) + tuple(shape[1:])
    else:
        want = flat_shape(shape, n)
    rs = segs[0][4]
    if any(s[4] != rs for s in segs):
        return Plan("each", None, 0, 0, want, list(values))
    key0 = segs[0][0]
    if all(s[0] == key0 for s in segs):
        start = pos = segs[0][2]
        for s in segs:
            if s[2] != pos:
                break
            pos += s[3]
        else:
            kind = "id" if start == 0 and pos == segs[0][5] else "slice"
            return Plan(kind, [segs[0][1]], start, pos, want)
        a = len(index)
        for s in segs:
            if s[3] == 1:
                index.append(s[2])
            else:
                index.extend(range(s[2], s[2] + s[3]))
        return Plan("take", [segs[0][1]], a, len(index), want)
    srcs, offsets, off = [], {}, 0
    for s in segs:
        if s[0] not in offsets:
            offsets[s[0]] = off
            srcs.append(s[1])
            off += s[5]
    if len(srcs) == len(segs) and all(s[2] == 0 and s[3] == s[5] for s in segs):
        # each segment is a whole source, used once, in order
        return Plan("concat", srcs, 0, 0, want)
    a = len(index)
    for s in segs:
        base = offsets[s[0]] + s[2]
        if s[3] == 1:
            index.append(base)
        else:
            index.extend(range(base, base + s[3]))
    return Plan("concat_take", srcs, a, len(index), want)


def _src(s):
    if type(s) is tuple:
        return s[0].outs[s[1]]
    return s


def run_gather(plan, index_nd):
    kind = plan.kind
    if kind == "id":
        out = _src(plan.srcs[0])
    elif kind == "slice":
        out = nd.slice_axis(_src(plan.srcs[0]), axis=0, begin=plan.start, end=plan.stop)
    elif kind == "take":
        out = nd.take(_src(plan.srcs[0]), index_nd[plan.start:plan.stop], axis=0)
    elif kind == "concat":
        out = nd.concat(*[_src(s) for s in plan.srcs], dim=0)
    elif kind == "concat_take":
        big = nd.concat(*[_src(s) for s in plan.srcs], dim=0)
        out = nd.take(big, index_nd[plan.start:plan.stop], axis=0)
    else:
        # mixed producers whose row shapes differ (e.g. a squeezed view beside a
        # plain array): bring each sample to its own array, then concatenate
        parts = [row_value(v) if type(v) is LazyArray else v for v in plan.values]
        if len(parts[0].shape) != len(plan.want):   # squeezed views: one row each
            per = (plan.want[0] // len(parts),) + tuple(plan.want[1:])
            parts = [p.reshape(per) for p in parts]
        out = nd.concat(*parts, dim=0) if len(parts) > 1 else parts[0]
    if out.shape != plan.want:
        out = out.reshape(plan.want)
    return out


def prepare(batches):
    """Plan every batched launch's input gathers, with one host-to-device copy of
    all index lists per context."""
    index = {}      # context -> index list
    sizes = {}
    planned = []
    gathers = 0
    for batch in batches:
        first = batch[0]
        if not first.info.batchable:
            continue
        ex = first.info.op
        lst = index.setdefault(ex.ctx, [])
        first.plan = [plan_gather([node.inputs[j] for node in batch], meta[0], lst, sizes)
                      for j, meta in enumerate(ex.in_meta)]
        gathers += sum(p.kind != "id" for p in first.plan)
        planned.append(first)
    arrays = {ctx: nd.array(np.asarray(lst, dtype=np.int64), ctx=ctx, dtype="int64")
              for ctx, lst in index.items() if lst}
    for first in planned:
        first.plan = (first.plan, arrays.get(first.info.op.ctx))
    STATS.add(gather_ops=gathers)


def gather_batch(batch):
    """The flat inputs of a planned batch."""
    plans, idx = batch[0].plan
    batch[0].plan = None
    return [run_gather(p, idx) for p in plans]


def finish(batch, outs):
    batch[0].group.outs = outs
    for node in batch:
        node.batch = outs
        node.inputs = ()
        node.users = None


def row_value(v):
    """Concrete NDArray of one lazy value (its rows of the producer's launch)."""
    node = v._node
    if node is DETACHED:
        return v._value
    if v._value is not None:
        return v._value
    if type(node) is Composite:
        return v.value()
    src = node.batch[v._k]
    start, count, _ = extent(node, v._k)
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
    prepare = staticmethod(prepare)

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
