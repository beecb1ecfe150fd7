"""Gathers: how each batch's inputs are collected into the flat layout, and doing it.

After scheduling, every batch's input gathers are planned at once
(``prepare``): per argument, the source itself, a row range (a view), one
``take``, one ``concat``, ``concat`` + ``take``, ``take`` + ``concat`` or, for
mixed row shapes, per sample. All index lists of a flush go to the device in
ONE copy. ``gather_batch`` runs a batch's plans right before its launch. The
planning loop visits every row of every gathered input, so it is written as
one flat loop."""
import numpy as np

try:
    import cython   # compiled: the local type annotations below are C declarations
except ImportError:  # running from source without Cython installed
    from .. import _nocython as cython

from mxnet import autograd
from mxnet import ndarray as nd

from .. import config as _config
from ..graph import Composite, Group, Node
from ..schedule import bucket
from ..signature import SigInfo
from ..stats import STATS
from . import _mxapi
from .layout import flat_shape
from .lazy import (DETACHED, LazyArray, k_of, node_of, parts_of, row_value, shape_of,
                   value_of, view_of)


class Plan(object):
    """How one argument of one batch is gathered: ``kind`` is 'id' (the source
    as is), 'slice', 'take', 'concat', 'concat_take', 'take_concat' (``values``:
    per source its slice or take) or 'each' (per sample)."""
    __slots__ = ("kind", "srcs", "start", "stop", "want", "values", "have", "pad")

    def __init__(self, kind, srcs, start, stop, want, values=None, have=None, pad=None):
        self.kind = kind
        self.srcs = srcs
        self.start = start
        self.stop = stop
        self.want = want
        self.values = values
        self.have = have      # the gathered shape, when known without asking MXNet
        self.pad = pad        # 'each' of a zero-padded argument: (axis, its size)


class _Pad(object):
    """A run of zero rows in a zero-padded argument: the first ``count`` rows of
    ``zeros`` (a constant of shape ``shape``)."""
    __slots__ = ("zeros", "count", "shape")

    def __init__(self, zeros, count, shape):
        self.zeros = zeros
        self.count = count
        self.shape = shape


class _View(object):
    """A concrete array read as rows of another shape: reshaped when the gather
    runs (in the launch's autograd scope, so gradients reach the array)."""
    __slots__ = ("arr", "shape")

    def __init__(self, arr, shape):
        self.arr = arr
        self.shape = shape


def plan_gather(values, shape, index, sizes):
    """Plan the gather of per-sample ``values`` (all of per-sample ``shape``) into
    the flat layout; index lists are appended to ``index`` (one copy per flush).

    Every value (a composite: each of its parts) is a segment of rows of one
    source: a launch's output (key: its group for output 0, else ``(group, k)``)
    or a concrete array (key ``id``). This runs once per row of every launch's
    inputs, so it is written as one flat loop."""
    leaves = []
    for v in values:
        if type(v) is LazyArray:
            la = v
            if type(node_of(la)) is Composite:
                parts_of(v, leaves)
                continue
        leaves.append(v)
    want = flat_shape(shape, len(values)) if shape[0] is not None else \
        _ragged_want(values, shape, sizes)
    return _plan_segments(leaves, values, want, index, sizes)


def _plan_segments(leaves, values, want, index, sizes):
    """``plan_gather`` once the values are split into their segments of rows
    (``leaves``: lazy arrays, concrete arrays, ``_View`` and ``_Pad`` runs)."""
    keys, starts, counts = [], [], []
    srcs = {}          # key -> (source, its rows), in first-use order
    rs = None          # the row shape every segment must share
    ones = whole = True
    n: Node
    grp: Group
    info: SigInfo
    start: cython.Py_ssize_t
    count: cython.Py_ssize_t
    full: cython.Py_ssize_t
    for v in leaves:
        t = type(v)
        if t is LazyArray:
            la = v
            node = node_of(la)
        else:
            node = None
        if t is _Pad or t is _View:
            z = v.zeros if t is _Pad else v
            key = id(z)
            start = 0
            full = v.shape[0]
            count = v.count if t is _Pad else full
            if key not in srcs:
                srcs[key] = (z, full)
            r = v.shape[1:]
        elif node is None or node is DETACHED:
            arr = v if node is None else value_of(la)
            key = id(arr)
            shp = sizes.get(key)
            if shp is None:
                shp = sizes[key] = _mxapi.concrete_shape(arr)
            full = count = shp[0]
            start = 0
            if key not in srcs:
                srcs[key] = (arr, full)
            r = shp[1:]
        else:
            n = node
            k = k_of(la)
            grp = n.group
            info = n.info
            per, r = info.out_rows[k]
            if per is not None:
                count = per
                start = n.row * count
                full = grp.size * count
            else:
                start, count, full = n.off, n.rows, grp.rows
            view = view_of(la)
            if view is not None:
                start += view[0]
                count = view[1]
            key = grp if k == 0 else (grp, k)
            if key not in srcs:
                srcs[key] = ((grp, k), full)
        if r is not rs and r != rs:
            if rs is not None:
                return Plan("each", None, 0, 0, want, list(values))
            rs = r
        if count != 1:
            ones = False
        if start or count != full:
            whole = False
        keys.append(key)
        starts.append(start)
        counts.append(count)
    if len(srcs) == 1:
        src = next(iter(srcs.values()))[0]
        pos = starts[0]
        for s, c in zip(starts, counts):
            if s != pos:
                break
            pos += c
        else:
            kind = "id" if starts[0] == 0 and pos == srcs[keys[0]][1] else "slice"
            return Plan(kind, [src], starts[0], pos, want, have=(pos - starts[0],) + rs)
        a = len(index)
        if ones:
            index.extend(starts)
        else:
            for s, c in zip(starts, counts):
                index.extend(range(s, s + c))
        return Plan("take", [src], a, len(index), want, have=(len(index) - a,) + rs)
    total = 0
    for _, full in srcs.values():
        total += full
    if whole and len(srcs) == len(keys):
        # each segment is a whole source, used once, in order
        return Plan("concat", [x[0] for x in srcs.values()], 0, 0, want, have=(total,) + rs)
    taken = len(keys) if ones else sum(counts)
    if total > _SPARSE * taken:
        return _plan_take_concat(srcs, keys, starts, counts, ones, want, rs, index)
    offsets, off = {}, 0
    for key, (_, full) in srcs.items():
        offsets[key] = off
        off += full
    a = len(index)
    if ones:
        index.extend([offsets[key] + s for key, s in zip(keys, starts)])
    else:
        for key, s, c in zip(keys, starts, counts):
            base = offsets[key] + s
            index.extend(range(base, base + c))
    return Plan("concat_take", [x[0] for x in srcs.values()], a, len(index), want,
                have=(len(index) - a,) + rs)


_SPARSE = 3   # sources over this many times the rows read are taken from first


def _plan_take_concat(srcs, keys, starts, counts, ones, want, rs, index):
    """Gather from sources much larger than the rows read (e.g. the leaf launch of
    a whole minibatch, read by every later level): take each source's rows first
    (a view where they are one range), concatenate those, and permute into
    sample order only if the sources interleave. Copies at most 3x the rows read
    where ``concat`` + ``take`` copies every source whole."""
    per = {}        # key -> its rows, in first-use order (the order of srcs)
    where = []      # per segment: (key, its position among that source's rows)
    for key, s, c in zip(keys, starts, counts):
        rows = per.get(key)
        if rows is None:
            rows = per[key] = []
        where.append((key, len(rows)))
        if c == 1:
            rows.append(s)
        else:
            rows.extend(range(s, s + c))
    base, off, parts = {}, 0, []
    for key, rows in per.items():
        base[key] = off
        off += len(rows)
        first = rows[0]
        if rows[-1] - first == len(rows) - 1 and rows == list(range(first, first + len(rows))):
            parts.append(("slice", first, first + len(rows)))
        else:
            a = len(index)
            index.extend(rows)
            parts.append(("take", a, len(index)))
    if ones:
        perm = [base[key] + o for key, o in where]
    else:
        perm = []
        for (key, o), c in zip(where, counts):
            b = base[key] + o
            perm.extend(range(b, b + c))
    a = b = len(index)
    if perm != list(range(len(perm))):
        index.extend(perm)
        b = len(index)
    return Plan("take_concat", [srcs[key][0] for key in per], a, b, want, parts,
                have=(len(perm),) + rs)


def plan_padded(values, shape, axis, index, sizes):
    """Plan the gather of an argument declared zero-paddable along ``axis``
    (``jitbatch.zero_pad``): every sample is padded with zeros to the largest
    size along ``axis`` in the batch. When the axes before ``axis`` have size 1,
    a sample is its rows of shape ``shape[axis + 1:]`` followed by zero rows, and
    the gather is planned like any other (the zero rows come from one constant);
    otherwise each sample is padded on its own."""
    ks = []
    for v in values:
        if type(v) is LazyArray:
            la = v
            ks.append(shape_of(la)[axis])
        else:
            shp = sizes.get(id(v))
            if shp is None:
                shp = sizes[id(v)] = _mxapi.concrete_shape(v)
            ks.append(shp[axis])
    kmax = max(ks)
    full = tuple(shape[:axis]) + (kmax,) + tuple(shape[axis + 1:])
    if min(ks) == kmax:
        return plan_gather(values, full, index, sizes)
    want = flat_shape(full, len(values))
    unit = tuple(shape[axis + 1:])
    leaves = []
    ones = True
    for d in shape[:axis]:
        if d != 1:
            ones = False
    if ones:
        first = values[0]
        dtype, ctx = first.dtype, first.context
        zeros = _zeros(kmax, unit, dtype, ctx)
        zshape = tuple(zeros.shape)
        views = sizes.setdefault("views", {})
        for v, k in zip(values, ks):
            if not _unit_segments(v, unit, leaves, views):
                leaves = None
                break
            if k < kmax:
                leaves.append(_Pad(zeros, kmax - k, zshape))
    if leaves is not None:
        plan = _plan_segments(leaves, values, want, index, sizes)
        if plan.kind != "each":
            return plan
    return Plan("each", None, 0, 0, want, list(values), pad=(axis, kmax))


def _unit_segments(v, unit, out, views):
    """Append ``v``'s segments as rows of shape ``unit``; False if one is not."""
    if type(v) is LazyArray:
        la = v
        node = node_of(la)
        if type(node) is Composite:
            parts = []
            parts_of(v, parts)
            for p in parts:
                if not _unit_segments(p, unit, out, views):
                    return False
            return True
        if node is not DETACHED:
            n: Node = node
            info: SigInfo = n.info
            view = view_of(la)
            if info.out_rows[k_of(la)][1] != unit or (view is not None and view[2]):
                return False
            out.append(v)
            return True
        v = value_of(la)
    hit = views.get(id(v))      # one source per array, however many samples read it
    if hit is not None and hit[0] is v:
        out.append(hit[1])
        return True
    shp = v.shape
    if tuple(shp[1:]) == unit:
        views[id(v)] = (v, v)
        out.append(v)
        return True
    size = 1
    for d in shp:
        size *= d
    per = 1
    for d in unit:
        per *= d
    if per == 0 or size % per:
        return False
    if size == 0:       # an empty sample (np_shape): no rows of its own, only padding
        return True
    view = _View(v, (size // per,) + unit)
    views[id(v)] = (v, view)
    out.append(view)
    return True


_ZEROS = {}


def _zeros(rows, unit, dtype, ctx, value=0.0):
    """A constant block of at least ``rows`` zero rows (cached per row shape,
    dtype, context and ``value``, 0.0 or -0.0; never written, so launches may
    read it concurrently)."""
    negative = value == 0.0 and np.signbit(value)
    key = (unit, np.dtype(dtype).name, ctx, bool(negative))
    z = _ZEROS.get(key)
    if z is None or z.shape[0] < rows:
        shape = (max(rows, 8),) + unit
        z = _mxapi.zeros(shape, ctx, dtype)
        if negative:
            with autograd.pause():      # a constant, whatever the flush's recording state
                z = _mxapi.invoke(_mxapi.op_handle("negative"), [z], [], [], None, False,
                                  False)
        _ZEROS[key] = z
    return z


def _padded(part, shape, pad):
    """One sample's array zero-padded along ``pad[0]`` to size ``pad[1]``."""
    axis, kmax = pad
    if tuple(part.shape) != tuple(shape):
        part = _mxapi.reshape(part, tuple(shape))
    k = shape[axis]
    if k == kmax:
        return part
    zshape = tuple(shape[:axis]) + (kmax - k,) + tuple(shape[axis + 1:])
    return nd.concat(part, _mxapi.zeros(zshape, part.context, part.dtype), dim=axis)


def _ragged_want(values, shape, sizes):
    """The flat shape of ragged values: each brings its own leading length
    (``sizes``: id -> shape of the concrete arrays seen so far in this flush)."""
    rows = 0
    for v in values:
        if type(v) is LazyArray:
            rows += shape_of(v)[0]
        else:
            shp = sizes.get(id(v))
            if shp is None:
                shp = sizes[id(v)] = _mxapi.concrete_shape(v)
            rows += shp[0]
    return (rows,) + tuple(shape[1:])


def _src(s):
    t = type(s)
    if t is tuple:
        return s[0].outs[s[1]]
    if t is _View:
        return _mxapi.reshape(s.arr, s.shape)
    return s


def run_gather(plan, index_nd):
    """One argument's flat input, by its plan (``index_nd``: the flush's index array)."""
    kind = plan.kind
    if kind == "id":
        out = _src(plan.srcs[0])
    elif kind == "slice":
        out = _mxapi.rows(_src(plan.srcs[0]), plan.start, plan.stop)
    elif kind == "take":
        out = _mxapi.take(_src(plan.srcs[0]), _mxapi.rows(index_nd, plan.start, plan.stop))
    elif kind == "concat":
        out = _mxapi.concat([_src(s) for s in plan.srcs])
    elif kind == "concat_take":
        out = _mxapi.take(_mxapi.concat([_src(s) for s in plan.srcs]),
                          _mxapi.rows(index_nd, plan.start, plan.stop))
    elif kind == "take_concat":
        parts = []
        for s, (how, a, b) in zip(plan.srcs, plan.values):
            src = _src(s)
            parts.append(_mxapi.rows(src, a, b) if how == "slice" else
                         _mxapi.take(src, _mxapi.rows(index_nd, a, b)))
        out = _mxapi.concat(parts) if len(parts) > 1 else parts[0]
        if plan.stop > plan.start:
            out = _mxapi.take(out, _mxapi.rows(index_nd, plan.start, plan.stop))
    else:
        # mixed producers whose row shapes differ (e.g. a squeezed view beside a
        # plain array): bring each sample to its own array, then concatenate
        parts = [row_value(v) if type(v) is LazyArray else
                 _mxapi.rows(v.zeros, 0, v.count) if type(v) is _Pad else v for v in plan.values]
        if plan.pad is not None:
            parts = [_padded(p, v.shape, plan.pad) for p, v in zip(parts, plan.values)]
        elif len(parts[0].shape) != len(plan.want):   # squeezed views: one row each
            per = (plan.want[0] // len(parts),) + tuple(plan.want[1:])
            parts = [p.reshape(per) for p in parts]
        out = nd.concat(*parts, dim=0) if len(parts) > 1 else parts[0]
    have = plan.have if plan.have is not None else out.shape
    if have != plan.want:
        out = _mxapi.reshape(out, plan.want)
    return out


def prepare(batches):
    """Plan every batched launch's input gathers, with one host-to-device copy of
    all index lists per context."""
    index = {}      # context -> index list
    sizes = {}
    planned = []
    gathers = fillers = 0
    steps = _config.row_buckets
    first: Node
    n: Node
    info: SigInfo
    g: Group
    for batch in batches:
        first = batch[0]
        info = first.info
        ex = info.op
        if not info.batchable or not ex.gathers:
            continue
        lst = index.setdefault(ex.ctx, [])
        in_meta = ex.in_meta
        if ex.variadic:
            # a sum over calls of different arity: the shorter ones' missing
            # inputs read -0.0 rows (x + -0.0 is x); every input of the first's meta
            cols = _padded_columns(batch, in_meta[0])
            in_meta = (in_meta[0],) * len(cols)
        else:
            cols = list(zip(*[n.inputs for n in batch]))   # per argument: its values
        if steps and ex.rounds:
            # a block launch runs a size already seen (see config.row_buckets):
            # filler samples, copies of the first, whose outputs nobody reads;
            # ragged launches only where every sample has the same rows
            m = len(batch)
            g = first.group
            r = first.rows
            if r is None or g.rows == m * r:
                extra = bucket(m, steps) - m
                if extra:
                    cols = [c + (c[0],) * extra for c in cols]
                    g.size = m + extra
                    if r is not None:
                        g.rows = g.size * r
                    fillers += extra
        pad = ex.pad
        plans = []
        heads = {}      # (meta, what its first value reads) -> the arguments so far
        for j, col in enumerate(cols):
            if j in ex.shared:      # one weight array every node passes: as it is
                plans.append(Plan("id", (col[0],), 0, 0, in_meta[j][0], None, in_meta[j][0]))
                continue
            axis = None if pad is None else pad.get(j)
            plan = _twin_plan(cols, plans, j, in_meta, pad, axis, heads)
            if plan is None:
                plan = plan_gather(col, in_meta[j][0], lst, sizes) if axis is None else \
                    plan_padded(col, in_meta[j][0], axis, lst, sizes)
            plans.append(plan)
        first.plan = plans
        gathers += sum(p.kind != "id" for p in plans)
        planned.append(first)
    arrays = {ctx: _mxapi.host_array(np.array(lst, dtype=np.int64), ctx, np.int64)
              for ctx, lst in index.items() if lst}
    for first in planned:
        first.plan = (first.plan, arrays.get(first.info.op.ctx))
    STATS.add(gather_ops=gathers, filler_samples=fillers)


def _padded_columns(batch, meta):
    """Per argument position, every node's input there, up to the batch's
    largest arity; a node with fewer inputs reads a run of -0.0 rows (one
    cached constant) of its inputs' per-sample shape ``meta[0]``."""
    k = 0
    for n in batch:
        if len(n.inputs) > k:
            k = len(n.inputs)
    shape = meta[0]
    first = batch[0]
    ctx = first.info.op.ctx
    z = _zeros(shape[0], tuple(shape[1:]), meta[1], ctx, -0.0)
    fill = _Pad(z, shape[0], tuple(z.shape))
    return [tuple([n.inputs[j] if j < len(n.inputs) else fill for n in batch])
            for j in range(k)]


def _twin_plan(cols, plans, j, in_meta, pad, axis, heads):
    """The plan of argument ``j`` taken from an earlier argument's, when ``j``
    reads the same rows of the same launches, only from another output (the
    children's cell states beside their hidden states): the same index rows,
    other sources. None when no earlier argument is such a twin. Only the
    earlier arguments whose first value reads what ``j``'s does are compared
    (``heads``, filled in): a node of thousands of distinct arguments (an
    ``add_n`` of its children) compared each with all before it."""
    meta = in_meta[j]
    first = cols[j][0]
    if type(first) is LazyArray and type(node_of(first)) is Composite:
        c: Composite = node_of(first)
        first = c.parts[0]
    head = (meta, id(node_of(first)) if type(first) is LazyArray else id(first))
    earlier = heads.get(head)
    if earlier is None:
        heads[head] = [j]
        return None
    earlier.append(j)
    for i in earlier[:-1]:
        if plans[i].kind == "each" or (pad is not None and pad.get(i) != axis):
            continue
        kmap = {}
        if _twins(cols[i], cols[j], kmap):
            p = plans[i]
            srcs = [(s[0], kmap[s[1]]) if type(s) is tuple else s for s in p.srcs]
            return Plan(p.kind, srcs, p.start, p.stop, p.want, p.values, p.have, p.pad)
    return None


def _twins(a_values, b_values, kmap):
    """True if, value by value, ``b_values`` read the rows ``a_values`` read,
    either the very same values or the same nodes' rows of another output ``k``
    of the same row layout, one output of ``b`` per output of ``a`` (``kmap``,
    filled in)."""
    ca: Composite
    cb: Composite
    n: Node
    info: SigInfo
    for a, b in zip(a_values, b_values):
        if type(a) is not LazyArray or type(b) is not LazyArray:
            if a is b:      # one concrete array (a zero state, a constant)
                continue
            return False
        la = a
        lb = b
        node = node_of(la)
        if type(node) is Composite:
            other = node_of(lb)
            if type(other) is not Composite:
                return False
            ca = node
            cb = other
            if len(ca.parts) != len(cb.parts) or not _twins(ca.parts, cb.parts, kmap):
                return False
            continue
        if node is not node_of(lb) or view_of(la) != view_of(lb):
            return False
        if node is DETACHED:
            if a is b:
                continue
            return False
        ka, kb = k_of(la), k_of(lb)
        k = kmap.get(ka)
        if k is None:
            n = node
            info = n.info
            rows = info.out_rows
            if rows[ka] != rows[kb]:
                return False
            kmap[ka] = kb
        elif k != kb:
            return False
    return True


def gather_batch(batch):
    """The flat inputs of a planned batch."""
    plans, idx = batch[0].plan
    batch[0].plan = None
    return [run_gather(p, idx) for p in plans]
