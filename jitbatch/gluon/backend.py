"""Gather / launch / rows on MXNet: the executor side of the Gluon backend.

Layout: a launch over N nodes keeps each output *flat*: per-sample shape
``(b, *rest)`` becomes ``(N*b, *rest)`` (Gluon's batch axis 0), sample ``i``
owning rows ``i*b:(i+1)*b``. Inputs are gathered into that layout with as few
framework ops as possible: the source array itself, one slice, one ``take``, or
one ``concat`` (+ ``take``)."""
import ctypes
import threading

import numpy as np

try:
    import cython   # compiled: the local type annotations below are C declarations
except ImportError:  # pragma: no cover - Cython is an install requirement
    cython = None
from mxnet import autograd
from mxnet import ndarray as nd
from mxnet.base import NDArrayHandle, OpHandle, _LIB, c_array, c_str, check_call, mx_uint
from mxnet.ndarray import NDArray
from mxnet.ndarray import ndarray as _nd_impl
from mxnet.ndarray import register as _register

from .. import config as _config
from .. import execute
from ..schedule import bucket
from ..graph import Composite, Node
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


def extent(node, k):
    """(first row, rows, rows of the whole launch output) of one node's output k
    within its batch's flat output (``plan_gather`` inlines the same)."""
    n: Node = node
    g: Group = n.group
    if n.rows is None:
        info: SigInfo = n.info
        b = info.out_rows[k][0]
        return n.row * b, b, g.size * b
    return n.off, n.rows, g.rows


if not cython.compiled:
    # set by .array (import cycle); compiled, the name is the C layout of
    # LazyArray declared in _lazy.pxd, imported from .array when this loads
    LazyArray = None
else:
    jb_drop_finalizer(LazyArray)   # see _lazy.pxd


def new_lazy(node, k, shape, dtype, ctx, view=None):
    """``LazyArray(node, k, shape, dtype, ctx, view)``; compiled, made in C with
    every field set at once (no Python call per field)."""
    if cython.compiled:
        return jb_new_lazy(LazyArray, node, k, shape, dtype, ctx, view)
    return LazyArray(node, k, shape, dtype, ctx, view)


# The shape, dtype and device of a concrete input are asked per record (a new
# token array per sample) and again per flush. MXNet's properties spend ~7 us on
# them (ctypes buffers, a Context built per call, the shape's int64 check); these
# read the same C-API functions through a handle to the library that keeps the
# GIL (metadata reads: they never wait for kernels), so one set of buffers
# serves every thread. Anything but a plain NDArray goes through the properties.
_PYLIB = ctypes.PyDLL(_LIB._name)
_ndim = ctypes.c_int()
_dev_type = ctypes.c_int()
_dev_id = ctypes.c_int()
_dtype_code = ctypes.c_int()
if _nd_impl._int64_enabled():
    _pshape = ctypes.POINTER(ctypes.c_int64)()
    _GET_SHAPE = _PYLIB.MXNDArrayGetShapeEx64
else:
    _pshape = ctypes.POINTER(ctypes.c_int)()
    _GET_SHAPE = _PYLIB.MXNDArrayGetShapeEx
_GET_DTYPE = _PYLIB.MXNDArrayGetDType
_GET_CONTEXT = _PYLIB.MXNDArrayGetContext
_NDIM, _PSHAPE = ctypes.byref(_ndim), ctypes.byref(_pshape)
_DEV_TYPE, _DEV_ID, _DTYPE = ctypes.byref(_dev_type), ctypes.byref(_dev_id), ctypes.byref(_dtype_code)
_DTYPES = _nd_impl._DTYPE_MX_TO_NP


def _shape(handle):
    check_call(_GET_SHAPE(handle, _NDIM, _PSHAPE))
    n = _ndim.value
    return None if n == -1 else tuple(_pshape[:n])


def _address(fn):
    return ctypes.cast(fn, ctypes.c_void_p).value


def _direct_calls():
    """Compiled: hand the C-API functions' addresses to _mxapi.pxd's callers
    (direct C calls instead of ctypes); False where NDArray's layout is not
    the one they make (then the ctypes paths run)."""
    if not cython.compiled:
        return False
    ptr = ctypes.sizeof(ctypes.c_void_p)
    if NDArray.__basicsize__ != object.__basicsize__ + 2 * ptr or \
            NDArray.__mro__[1].__slots__ != ["handle", "writable"]:
        return False
    wide = _nd_impl._int64_enabled()
    fns = (_address(_LIB.MXImperativeInvokeEx), _address(_LIB.MXNDArraySlice),
           _address(_LIB.MXNDArrayReshape64),
           _address(_LIB.MXNDArrayGetShapeEx64) if wide else None,
           None if wide else _address(_LIB.MXNDArrayGetShapeEx),
           _address(_LIB.MXNDArrayGetDType), _address(_LIB.MXNDArrayGetContext))
    jb_mx_init(fns, NDArray, NDArrayHandle, check_call)
    return True


_DIRECT = _direct_calls()


def concrete_shape(arr):
    """``arr.shape`` of a concrete array (see above)."""
    if type(arr) is not NDArray:
        return arr.shape
    if cython.compiled:
        if _DIRECT:
            return jb_shape(arr)
    return _shape(arr.handle)


def concrete_meta(arr):
    """``(shape, dtype, (device type id, device id))`` of a concrete NDArray,
    or None for any other array type."""
    if type(arr) is not NDArray:
        return None
    if cython.compiled:
        if _DIRECT:
            shape, code, dev_type, dev_id = jb_meta(arr)
            return shape, _DTYPES[code], (dev_type, dev_id)
    h = arr.handle
    shape = _shape(h)
    check_call(_GET_DTYPE(h, _DTYPE))
    check_call(_GET_CONTEXT(h, _DEV_TYPE, _DEV_ID))
    return shape, _DTYPES[_dtype_code.value], (_dev_type.value, _dev_id.value)


def row_view(arr, key):
    """``x[i]`` / ``x[a:b]`` of lazy array ``arr`` along axis 0 as a free view
    (rows of its producer's output: no node), or None if not that case
    (``LazyArray.__getitem__`` then records an operator)."""
    a: LazyArray = arr
    shape = a._shape
    n = shape[0]
    if type(key) is not slice:
        i = int(key)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("index %d is out of bounds for axis 0 with size %d" % (key, n))
        squeeze = len(shape) > 1          # MXNet 1.x: a 1-D array indexed gives shape (1,)
        return _view(a, i, 1, squeeze, shape[1:] if squeeze else (1,))
    if key.step is None or key.step == 1:
        start, stop, _ = key.indices(n)
        if stop <= start:
            return None
        return _view(a, start, stop - start, False, (stop - start,) + shape[1:])
    return None


def _view(arr, r0, rc, squeeze, new_shape):
    a: LazyArray = arr
    view = a._view
    if view is not None:
        pr0, _, psq = view
        if psq:
            return None  # a view of a squeezed view is not a row range of the producer
        r0 = pr0 + r0
    node = a._node
    if node is DETACHED or type(node) is Composite:
        return None
    return new_lazy(node, a._k, new_shape, a._dtype, a._ctx, (r0, rc, squeeze))


def mode_scope(mode):
    """The autograd (recording, training) state a node was recorded under."""
    return autograd._RecordingStateScope(mode[0], mode[1])  # pylint: disable=protected-access


def _leaves(v, out):
    """Append the values a composite is made of (through nested composites)."""
    la: LazyArray = v
    c: Composite = la._node
    for part in c.parts:
        if type(part) is LazyArray:
            lp: LazyArray = part
            if type(lp._node) is Composite:
                _leaves(part, out)
                continue
        out.append(part)


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
    la: LazyArray
    for v in values:
        if type(v) is LazyArray:
            la = v
            if type(la._node) is Composite:
                _leaves(v, leaves)
                continue
        leaves.append(v)
    want = flat_shape(shape, len(values)) if shape[0] is not None else \
        _ragged_want(values, shape, sizes)
    return _plan_leaves(leaves, values, want, index, sizes)


def _plan_leaves(leaves, values, want, index, sizes):
    """``plan_gather`` once the values are split into their segments of rows
    (``leaves``: lazy arrays, concrete arrays, ``_View`` and ``_Pad`` runs)."""
    keys, starts, counts = [], [], []
    srcs = {}          # key -> (source, its rows), in first-use order
    rs = None          # the row shape every segment must share
    ones = whole = True
    la: LazyArray
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
            node = la._node
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
            arr = v if node is None else la._value
            key = id(arr)
            shp = sizes.get(key)
            if shp is None:
                shp = sizes[key] = concrete_shape(arr)
            full = count = shp[0]
            start = 0
            if key not in srcs:
                srcs[key] = (arr, full)
            r = shp[1:]
        else:
            n = node
            k = la._k
            grp = n.group
            info = n.info
            per, r = info.out_rows[k]
            if per is not None:
                count = per
                start = n.row * count
                full = grp.size * count
            else:
                start, count, full = n.off, n.rows, grp.rows
            view = la._view
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
    la: LazyArray
    for v in values:
        if type(v) is LazyArray:
            la = v
            ks.append(la._shape[axis])
        else:
            shp = sizes.get(id(v))
            if shp is None:
                shp = sizes[id(v)] = concrete_shape(v)
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
            if not _unit_leaves(v, unit, leaves, views):
                leaves = None
                break
            if k < kmax:
                leaves.append(_Pad(zeros, kmax - k, zshape))
    if leaves is not None:
        plan = _plan_leaves(leaves, values, want, index, sizes)
        if plan.kind != "each":
            return plan
    return Plan("each", None, 0, 0, want, list(values), pad=(axis, kmax))


def _unit_leaves(v, unit, out, views):
    """Append ``v``'s segments as rows of shape ``unit``; False if one is not."""
    if type(v) is LazyArray:
        la: LazyArray = v
        node = la._node
        if type(node) is Composite:
            parts = []
            _leaves(v, parts)
            for p in parts:
                if not _unit_leaves(p, unit, out, views):
                    return False
            return True
        if node is not DETACHED:
            n: Node = node
            info: SigInfo = n.info
            view = la._view
            if info.out_rows[la._k][1] != unit or (view is not None and view[2]):
                return False
            out.append(v)
            return True
        v = la._value
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
    view = _View(v, (size // per,) + unit)
    views[id(v)] = (v, view)
    out.append(view)
    return True


_ZEROS = {}


def _zeros(rows, unit, dtype, ctx):
    """A constant block of at least ``rows`` zero rows (cached per row shape,
    dtype and context; never written, so launches may read it concurrently)."""
    key = (unit, np.dtype(dtype).name, ctx)
    z = _ZEROS.get(key)
    if z is None or z.shape[0] < rows:
        z = _ZEROS[key] = nd.zeros((max(rows, 8),) + unit, ctx=ctx, dtype=dtype)
    return z


def _padded(part, shape, pad):
    """One sample's array zero-padded along ``pad[0]`` to size ``pad[1]``."""
    axis, kmax = pad
    if tuple(part.shape) != tuple(shape):
        part = _reshape(part, tuple(shape))
    k = shape[axis]
    if k == kmax:
        return part
    zshape = tuple(shape[:axis]) + (kmax - k,) + tuple(shape[axis + 1:])
    return nd.concat(part, nd.zeros(zshape, ctx=part.context, dtype=part.dtype), dim=axis)


def _ragged_want(values, shape, sizes):
    """The flat shape of ragged values: each brings its own leading length
    (``sizes``: id -> shape of the concrete arrays seen so far in this flush)."""
    rows = 0
    for v in values:
        if type(v) is LazyArray:
            rows += v._shape[0]
        else:
            shp = sizes.get(id(v))
            if shp is None:
                shp = sizes[id(v)] = concrete_shape(v)
            rows += shp[0]
    return (rows,) + tuple(shape[1:])


# The flush issues a few framework calls per launch; MXNet's generated Python
# wrappers (argument checks, np.prod of shapes in reshape, the indexing machinery
# for a slice) cost more than the calls themselves, so these go to the C API.
_invoke = _register._imperative_invoke   # MXNet's, captured before the hook patches it
_HANDLES = {}


def _handle(name):
    h = _HANDLES.get(name)
    if h is None:
        hdl = OpHandle()
        check_call(_LIB.NNGetOpHandle(c_str(name), ctypes.byref(hdl)))
        h = _HANDLES[name] = hdl.value
    return h


def _take(src, idx):
    if cython.compiled:
        if _DIRECT:
            return jb_take(_handle("take"), src, idx)
    return _invoke(_handle("take"), [src, idx], ["axis"], ["0"], None, False, False)


def _concat(srcs):
    if cython.compiled:
        if _DIRECT:
            return jb_concat(_handle("Concat"), srcs)
    return _invoke(_handle("Concat"), srcs, ["num_args", "dim"], [str(len(srcs)), "0"],
                   None, False, False)


def _rows(arr, start, stop):
    """Rows ``start:stop`` of ``arr``: a view (recorded for autograd when recording)."""
    if cython.compiled:
        if _DIRECT:
            return jb_rows(arr, start, stop)
    h = NDArrayHandle()
    check_call(_LIB.MXNDArraySlice(arr.handle, mx_uint(start), mx_uint(stop), ctypes.byref(h)))
    return NDArray(handle=h, writable=arr.writable)


def _reshape(arr, shape):
    """``arr.reshape(shape)`` for a shape of the same size (known here)."""
    if cython.compiled:
        if _DIRECT:
            return jb_reshape(arr, tuple(shape))
    h = NDArrayHandle()
    check_call(_LIB.MXNDArrayReshape64(arr.handle, len(shape), c_array(ctypes.c_int64, shape),
                                       False, ctypes.byref(h)))
    return NDArray(handle=h, writable=arr.writable)


def _src(s):
    t = type(s)
    if t is tuple:
        return s[0].outs[s[1]]
    if t is _View:
        return _reshape(s.arr, s.shape)
    return s


def run_gather(plan, index_nd):
    kind = plan.kind
    if kind == "id":
        out = _src(plan.srcs[0])
    elif kind == "slice":
        out = _rows(_src(plan.srcs[0]), plan.start, plan.stop)
    elif kind == "take":
        out = _take(_src(plan.srcs[0]), _rows(index_nd, plan.start, plan.stop))
    elif kind == "concat":
        out = _concat([_src(s) for s in plan.srcs])
    elif kind == "concat_take":
        out = _take(_concat([_src(s) for s in plan.srcs]),
                    _rows(index_nd, plan.start, plan.stop))
    elif kind == "take_concat":
        parts = []
        for s, (how, a, b) in zip(plan.srcs, plan.values):
            src = _src(s)
            parts.append(_rows(src, a, b) if how == "slice" else
                         _take(src, _rows(index_nd, a, b)))
        out = _concat(parts) if len(parts) > 1 else parts[0]
        if plan.stop > plan.start:
            out = _take(out, _rows(index_nd, plan.start, plan.stop))
    else:
        # mixed producers whose row shapes differ (e.g. a squeezed view beside a
        # plain array): bring each sample to its own array, then concatenate
        parts = [row_value(v) if type(v) is LazyArray else v for v in plan.values]
        if plan.pad is not None:
            parts = [_padded(p, v.shape, plan.pad) for p, v in zip(parts, plan.values)]
        elif len(parts[0].shape) != len(plan.want):   # squeezed views: one row each
            per = (plan.want[0] // len(parts),) + tuple(plan.want[1:])
            parts = [p.reshape(per) for p in parts]
        out = nd.concat(*parts, dim=0) if len(parts) > 1 else parts[0]
    have = plan.have if plan.have is not None else out.shape
    if have != plan.want:
        out = _reshape(out, plan.want)
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
        if not info.batchable:
            continue
        ex = info.op
        lst = index.setdefault(ex.ctx, [])
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
        in_meta = ex.in_meta
        plans = []
        for j, col in enumerate(cols):
            axis = None if pad is None else pad.get(j)
            plan = _twin_plan(cols, plans, j, in_meta, pad, axis)
            if plan is None:
                plan = plan_gather(col, in_meta[j][0], lst, sizes) if axis is None else \
                    plan_padded(col, in_meta[j][0], axis, lst, sizes)
            plans.append(plan)
        first.plan = plans
        gathers += sum(p.kind != "id" for p in plans)
        planned.append(first)
    arrays = {ctx: _index_array(lst, ctx) for ctx, lst in index.items() if lst}
    for first in planned:
        first.plan = (first.plan, arrays.get(first.info.op.ctx))
    STATS.add(gather_ops=gathers, filler_samples=fillers)


def _twin_plan(cols, plans, j, in_meta, pad, axis):
    """The plan of argument ``j`` taken from an earlier argument's, when ``j``
    reads the same rows of the same launches, only from another output (the
    children's cell states beside their hidden states): the same index rows,
    other sources. None when no earlier argument is such a twin."""
    meta = in_meta[j]
    for i in range(j):
        if in_meta[i] != meta or plans[i].kind == "each" or \
                (pad is not None and pad.get(i) != axis):
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
    la: LazyArray
    lb: LazyArray
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
        node = la._node
        if type(node) is Composite:
            other = lb._node
            if type(other) is not Composite:
                return False
            ca = node
            cb = other
            if len(ca.parts) != len(cb.parts) or not _twins(ca.parts, cb.parts, kmap):
                return False
            continue
        if node is not lb._node or la._view != lb._view:
            return False
        if node is DETACHED:
            if a is b:
                continue
            return False
        ka, kb = la._k, lb._k
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


def _index_array(lst, ctx):
    """The flush's index list as an int64 array on ``ctx``, without waiting.

    ``nd.array`` copies synchronously: its copy waits behind every kernel MXNet
    has queued (measured: 2.5 ms per flush of a training step, 40 ms behind a
    busy queue), so Python stopped where it should run ahead of the kernels.
    Instead the host array is wrapped without a copy (DLPack; the NDArray keeps
    it alive and read-only) and, for another device, copied by an ordinary
    asynchronous engine op."""
    host = nd.from_numpy(np.array(lst, dtype=np.int64), zero_copy=True)
    return host if ctx.device_type == "cpu" else host.copyto(ctx)


def gather_batch(batch):
    """The flat inputs of a planned batch."""
    plans, idx = batch[0].plan
    batch[0].plan = None
    return [run_gather(p, idx) for p in plans]


def finish(batch, outs):
    # the nodes' inputs are released later, when a read waits for the kernels
    # (Graph.retire), not here in front of the next launch
    n: Node = batch[0]
    g: Group = n.group
    g.outs = outs
    for n in batch:
        n.batch = outs


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
                out = _reshape(out, v._shape)
        return out
    out = src if (start == 0 and count == src.shape[0]) else _rows(src, start, start + count)
    if out.shape != v._shape:
        out = _reshape(out, v._shape)
    return out


class Backend(object):
    """The object ``jitbatch.execute.flush`` drives."""
    prepare = staticmethod(prepare)

    @staticmethod
    def launch(batch):
        batch[0].info.op.launch(batch)

    @staticmethod
    def stages(info, nodes):
        """The input-stage plan of a block signature, or None (gluon/stages.py)."""
        from . import hook, stages  # late: hook imports this module
        return stages.plan_for(info, nodes, hook.TABLE, hook._new_info)  # pylint: disable=protected-access

    @staticmethod
    def wait(batch):
        """Block until a launched batch's outputs are computed (MXNet runs
        kernels asynchronously; the cost model's calibrating flushes time
        launches with this)."""
        for o in batch[0].group.outs:
            o.wait_to_read()


BACKEND = Backend()


def flush_graph(graph, forced=False, reason="flush"):
    execute.flush(graph, BACKEND, graph.policy or "auto", graph.budget, forced, reason,
                  graph.granularity or "auto")


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
