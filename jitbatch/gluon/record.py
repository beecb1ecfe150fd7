"""Recording: a flagged block's call, or an operator on lazy arrays, becomes a node.

A block call is recorded in four phases: its arguments are flattened and
checked (``_arguments``), its exact call key is looked up (``signatures``:
a call seen before skips everything else; a new one is traced once), the
thread's graph takes the node, and the call returns one lazy array per output.
An operator on lazy arguments is recorded the same way with an operator
signature. Stacks of per-sample rows and concatenations along axis 0 become
*composites*: no node, consumers gather the parts' rows directly.

The hot path skips what it provably does not need: signatures are found
once per exact call, the autograd mode is kept per graph (``modes``), call
sites are (code, offset) pairs (``sites``)."""
try:
    import cython   # compiled: the local type annotations below are C declarations
except ImportError:  # running from source without Cython installed
    from .. import _nocython as cython

import numpy as np
from mxnet.context import Context
from mxnet.gluon.block import _flatten, _regroup
from mxnet.ndarray import NDArray
from mxnet.ndarray.sparse import BaseSparseNDArray
from mxnet.symbol import Symbol

from .. import config as _config
from .. import cost, execute, pipeline
from ..errors import BatchingError
from ..graph import Composite, Graph, Node, current_graph
from ..signature import SigInfo
from . import _mxapi
from .backend import BACKEND
from .lazy import DETACHED, LazyArray, new_lazy, node_of, track
from .meta import device, meta
from .modes import mode
from .params import is_param
from .signatures import (EXACT, EXACT_ARGS, VALUE_SHAPED, block_signature, const_signature,
                         copy_signature, exact_key, op_signature, pad_size)
from .rules import SHARED_WEIGHTS
from .sites import site, site_of

_FLAT_IN = {n: [0] * n for n in range(1, 16)}   # formats of n plain array arguments
_FLAT = {n: [0] * n for n in range(1, 16)}      # ... of n plain outputs
_FLAT[1] = 0


def limit(policy, mode_, net=None):
    """Pending nodes at which a new graph runs itself: ``max_pending``, or under
    'auto' the cost model's chunk size for pipelined flushes (where the kernels
    leave a core to Python)."""
    n = _config.max_pending
    if policy == "auto" and _config.pipeline and pipeline.FREE_CORE:
        chunk = pipeline.PIPELINES.limit(mode_, cost.MODEL.launch_price(), net=net)
        if chunk is not None and chunk < n:
            n = chunk
    return n


def maybe_autoflush(g):
    """Run the pending graph if it reached its size limit (a pipelined chunk, or
    the ``max_pending`` bound)."""
    gr: Graph = g
    if len(gr.nodes) >= gr.limit:
        execute.run_graph(gr, reason="limit" if gr.limit >= _config.max_pending
                          else "pipeline")


def _begin(g, cfg, mode_):
    """The first record of a graph: it takes the flags of the call's block and
    its size limit, and the backend that runs it."""
    gr: Graph = g
    if cfg is not None:
        gr.policy, gr.budget, gr.granularity = cfg.policy, cfg.budget, cfg.granularity
    gr.backend = BACKEND
    gr.net = None if cfg is None else cfg.serial
    # the samples of a jitbatch.map park at their reads: a pipelined chunk cut
    # while they record would run apart what their read flush merges
    gr.unpiped = gr.sharing is not None
    gr.limit = _config.max_pending if gr.unpiped else limit(gr.policy or "auto", mode_, gr.net)


def _note_reads(g, args):
    """The concrete arrays among a record's arguments (see ``writes.before_write``)."""
    gr: Graph = g
    reads = gr.reads
    for a in args:
        if type(a) is not LazyArray:
            reads[id(a)] = a


def note_sample(run, block, args):
    """In a sample of ``jitbatch.map`` (``run``: its ``interleave._Run``): the
    flagged ``block`` it calls (None: an operator) and its concrete arguments
    (among them ``attach_grad``-ed inputs), for what a step and a backward in
    a sample must know of the other samples."""
    task = run.current
    if task is None:
        return
    if block is not None:
        entry = run.blocks.get(id(block))
        if entry is None or entry[0] is not block:
            entry = run.blocks[id(block)] = (block, set())
        entry[1].add(task.index)
    for a in args:
        if type(a) is NDArray:      # (whether it has a gradient buffer: asked when needed)
            run.seen.append((a, task))


# -- blocks ---------------------------------------------------------------------------
def record_block(block, g, x, args, frame):
    """Record ``block(x, *args)`` in the thread's graph ``g`` (``frame``: the
    caller's, for the call site); its outputs as lazy arrays, or None where
    the call holds symbols (MXNet is tracing: run it as usual)."""
    allargs = (x,) + args
    flat, fmt, fkey = _arguments(block, allargs)
    if flat is None:
        return None
    mode_ = mode(g)
    key, ctx = exact_key(block, fkey, mode_, flat)
    si: SigInfo = EXACT.get(key)     # this exact call seen before: its signature
    if si is None or not si.live:    # (one TABLE evicted: found again)
        si = block_signature(block, allargs, flat, fmt, fkey, mode_, key)
    if not si.batchable and _config.strict:
        why = getattr(si.op, "why", None)   # strict set after the signature was made
        if why is not None:
            raise BatchingError(why)
    gr: Graph = g
    if not gr.nodes:
        _begin(g, block._jb_cfg, mode_)
    _note_reads(g, flat)
    if gr.sharing is not None:      # a sample of jitbatch.map: what it calls and reads
        note_sample(gr.sharing, block, flat)
    gr.reads[id(block)] = block     # a pending call keeps its block alive
    out_meta = si.out_meta
    site_ = site_of(frame)
    if out_meta and out_meta[0][0][0] is None:       # ragged: outputs keep the lead
        lead = key[EXACT_ARGS][0]
        node = gr.add(si, tuple(flat), site_, mode_, lead)
        outs = [new_lazy(node, k, (lead,) + m[0][1:], m[1], ctx, None)
                for k, m in enumerate(out_meta)]
    else:
        node = gr.add(si, tuple(flat), site_, mode_)
        if si.pad_axes is not None:
            node.pad = pad_size(key, si.pad_axes)
        outs = [new_lazy(node, k, m[0], m[1], ctx, None) for k, m in enumerate(out_meta)]
    maybe_autoflush(g)
    ofmt = block._out_format  # pylint: disable=protected-access
    if ofmt == _FLAT.get(len(outs)):
        return outs if len(outs) > 1 else outs[0]
    return _outputs(outs, ofmt)


def _arguments(block, allargs):
    """``(flat arrays, format, format key)`` of a block call's arguments, or
    ``(None, None, None)`` where they hold symbols; BatchingError naming the
    argument that is not an array."""
    for a in allargs:
        t = type(a)
        if t is not LazyArray and t is not NDArray:
            break
    else:        # the common case: plain arrays
        n = len(allargs)
        return allargs, (_FLAT_IN[n] if n < 16 else [0] * n), n
    res = _one_level(allargs)
    if res is not None:
        return res
    for i, a in enumerate(allargs):
        if not isinstance(a, (NDArray, Symbol, list, tuple)) and a is not None:
            raise BatchingError(
                "block %s: argument %d has type %s; a flagged block takes NDArrays "
                "(or nested lists of them). Fix: %s."
                % (block.name, i, type(a).__name__,
                   "pass the dict's arrays as separate arguments or as a list, in a fixed "
                   "order (e.g. [d[k] for k in sorted(d)])" if isinstance(a, dict) else
                   "convert it with mx.nd.array(...)"))
    try:
        flat, fmt = _flatten(allargs, "input")
    except ValueError as e:
        raise BatchingError("block %s: %s; a flagged block takes NDArrays (or nested "
                            "lists of them). Fix: convert it with mx.nd.array(...)."
                            % (block.name, e)) from e
    for a in flat:
        # symbols (MXNet is tracing), or a sparse sample: run as usual, per
        # sample (jitbatch merges dense rows only)
        if isinstance(a, (Symbol, BaseSparseNDArray)):
            return None, None, None
    flat = [a for a in flat if a is not None]
    for a in flat:
        if not isinstance(a, NDArray):
            raise BatchingError("block %s: argument of type %s; expected NDArray"
                                % (block.name, type(a).__name__))
    return flat, fmt, str(fmt)


_ONE_LEVEL = {}  # per argument -1 (an array) or n (a list of n): (format, format key)


def _one_level(allargs):
    """``(flat, format, format key)`` of arguments that are arrays or lists of
    arrays (an RNN cell's ``(x, [h, c])``), as MXNet's recursive ``_flatten``
    gives them, with the format made once per structure; None for any other."""
    flat = []
    struct = []
    for a in allargs:
        t = type(a)
        if t is LazyArray or t is NDArray:
            flat.append(a)
            struct.append(-1)
        elif t is list or t is tuple:
            for b in a:
                t = type(b)
                if t is not LazyArray and t is not NDArray:
                    return None
            flat.extend(a)
            struct.append(len(a))
        else:
            return None
    key = tuple(struct)
    made = _ONE_LEVEL.get(key)
    if made is None:
        fmt = [0 if k == -1 else [0] * k for k in struct]
        made = _ONE_LEVEL[key] = (fmt, str(fmt))
    return flat, made[0], made[1]


def _outputs(outs, ofmt):
    """A block's outputs in its output format: arrays and lists of arrays
    directly (``(out, [h, c])``), anything deeper through MXNet's ``_regroup``."""
    if type(ofmt) is not list:
        return _regroup(outs, ofmt)
    ret = []
    i = 0
    for f in ofmt:
        if type(f) is int and f == 0:
            ret.append(outs[i])
            i += 1
        elif type(f) is list:
            for g in f:
                if type(g) is not int or g != 0:
                    return _regroup(outs, ofmt)
            ret.append(outs[i:i + len(f)])
            i += len(f)
        else:
            return _regroup(outs, ofmt)
    return ret


# -- operators ------------------------------------------------------------------------
def record_op(g, handle, ndargs, keys, vals, output_is_list):
    """Record operator ``handle`` on ``ndargs`` (at least one lazy, or inside an
    unflagged block run on lazy arrays) in the thread's graph ``g``; run at
    once (on computed arguments) where its output shapes depend on values,
    it makes or reads sparse storage (jitbatch merges dense rows only)."""
    if handle in VALUE_SHAPED or handle in _SPARSE_OPS or _any_sparse(ndargs):
        return _mxapi.invoke(handle, ndargs, keys, vals, None, False, output_is_list)
    mc = [meta(a) for a in ndargs]
    for m in mc:
        if m[0] and 0 in m[0]:
            # an empty argument (NumPy shape semantics): on computed values, now;
            # a trial run on an unallocated empty array fails in oneDNN kernels
            return _mxapi.invoke(handle, ndargs, keys, vals, None, False, output_is_list)
    mode_ = mode(g)
    info = op_signature(handle, keys, vals, mc, mode_, output_is_list,
                        _shared(handle, ndargs) if handle in _SHARING else ())
    if info is None:     # its output shapes depend on values: it runs now
        return _mxapi.invoke(handle, ndargs, keys, vals, None, False, output_is_list)
    gr: Graph = g
    if not gr.nodes:
        _begin(g, None, mode_)
    _note_reads(g, ndargs)
    if gr.sharing is not None:
        note_sample(gr.sharing, None, ndargs)
    ctx = mc[0][2]
    si: SigInfo = info
    out_meta = si.out_meta
    if out_meta and out_meta[0][0] and out_meta[0][0][0] is None:   # ragged (opkeys): outputs keep the lead
        lead = max([m[0][0] for m in mc])      # (beside single rows: opkeys.ragged_lead)
        node = gr.add(info, tuple(ndargs), site(), mode_, lead)
        outs = [new_lazy(node, k, (lead,) + m[0][1:], m[1], ctx, None)
                for k, m in enumerate(out_meta)]
    else:
        node = gr.add(info, tuple(ndargs), site(), mode_)
        outs = [new_lazy(node, k, m[0], m[1], ctx, None) for k, m in enumerate(out_meta)]
    if si.op.lift is not None:    # its scalar is the node's, not the signature's
        node.lifted = vals[0]
    maybe_autoflush(g)
    if len(outs) == 1 and not output_is_list:
        return outs[0]
    return outs


#: operator handle -> the positions of its weights (rules.SHARED_WEIGHTS)
_SHARING = {_mxapi.op_handle(k): v for k, v in SHARED_WEIGHTS.items()}


def _shared(handle, ndargs):
    """``(position, id)`` of the parameter arrays a call passes as its
    operator's weights (``nd.FullyConnected(h, w.data(), b.data(), ...)``)."""
    return tuple([(k, id(ndargs[k])) for k in _SHARING[handle] if k < len(ndargs) and
                  type(ndargs[k]) is not LazyArray and is_param(ndargs[k])])


def record_copy(g, x, dst):
    """``x.copyto(dst)`` / ``x.as_in_context(dst)`` of lazy ``x`` to another
    device (``dst``: its Device) in the thread's graph ``g``: the copies of a
    flush's samples run as one (``executors.CopyExec``)."""
    m = meta(x)
    mode_ = mode(g)
    info = copy_signature(m, dst, mode_)
    gr: Graph = g
    if not gr.nodes:
        _begin(g, None, mode_)
    node = gr.add(info, (x,), site(), mode_)
    out = new_lazy(node, 0, m[0], m[1], dst, None)
    maybe_autoflush(g)
    return out


def _any_sparse(ndargs):
    for a in ndargs:
        t = type(a)
        if t is not LazyArray and t is not NDArray and isinstance(a, BaseSparseNDArray):
            return True
    return False


#: operators that make sparse storage from dense arrays (their output is not
#: rows a launch can hand out)
_SPARSE_OPS = {_mxapi.op_handle("cast_storage")}


# -- arrays made from Python data ----------------------------------------------------
def record_const(g, values, ctx):
    """``nd.array(values)`` (a NumPy copy, at least one axis, not empty) while
    the thread's graph ``g`` is pending: a node, so that a flush makes all
    such arrays with one array creation (``executors.ConstExec``)."""
    gr: Graph = g
    dev = device(ctx)
    info = const_signature(values.shape[1:], values.dtype.type, dev)
    mode_ = mode(g)
    node: Node = gr.add(info, (values,), site(), mode_, values.shape[0])
    # depth 0: its users sit where users of concrete arrays sit (depth 1), so a
    # sample whose array was made eagerly (nothing pending yet) stays aligned
    # with the samples after it under the depth policy
    node.depth = 0
    out = new_lazy(node, 0, values.shape, values.dtype.type, dev, None)
    maybe_autoflush(g)
    return out


#: operator handle -> the fill of the arrays it creates from nothing (nd.zeros, nd.ones)
FILLS = {}
_FILLED = {}    # (handle, keys, vals) -> (row values, context) of a creation seen before


def _fills():
    FILLS[_mxapi.op_handle("_zeros")] = 0
    FILLS[_mxapi.op_handle("_ones")] = 1


_fills()


def record_filled(g, handle, keys, vals):
    """``nd.zeros`` / ``nd.ones`` (``handle`` in ``FILLS``; also how Gluon's
    ``begin_state`` makes an RNN's initial state) while the thread's graph
    ``g`` is pending: recorded as ``nd.array`` of its values is
    (``record_const``), so a flush makes all of them with one array creation
    instead of one operator call each. None where the call is not a plain
    creation (the caller runs it)."""
    try:
        key = (handle, tuple(keys), tuple(vals))
        made = _FILLED.get(key)
    except TypeError:     # an unhashable argument: not a plain creation
        return None
    if made is None:
        made = _filled_values(FILLS[handle], keys, vals)
        if len(_FILLED) < 4096:
            _FILLED[key] = made
    if made is False:
        return None
    return record_const(g, made[0], made[1])


def _filled_values(fill, keys, vals):
    """(values, context) of a creation's keyword arguments, or False where they
    are not a plain shape, device and numeric dtype."""
    args = dict(zip(keys, vals))
    shape, ctx, dtype = args.get("shape"), args.get("ctx"), args.get("dtype")
    if isinstance(shape, int):
        shape = (shape,)
    if not isinstance(ctx, Context) or not isinstance(shape, tuple) or not shape or \
            not all(isinstance(d, int) and d > 0 for d in shape):
        return False
    try:
        values = np.full(shape, fill, dtype=np.float32 if dtype is None else dtype)
    except (TypeError, ValueError):
        return False
    if values.dtype.kind not in "biuf":
        return False
    values.setflags(write=False)   # shared by every call with these arguments
    return values, ctx


# -- composites: stacks of rows, concatenations along axis 0 --------------------------
ROWS_OPS = {}   # op handle -> 'stack' | 'concat': operators that can be composites


def _rows_ops():
    ROWS_OPS[_mxapi.op_handle("stack")] = "stack"
    ROWS_OPS[_mxapi.op_handle("concat")] = "concat"
    ROWS_OPS[_mxapi.op_handle("Concat")] = "concat"


_rows_ops()


def rows_composite(kind, ndargs, keys, vals):
    """A stack along axis 1 of per-sample (1, ...) arrays, or a concat along
    axis 0, is only its inputs' rows side by side: a Composite, no node. Its
    consumers gather those rows directly (one take instead of a launch).
    None where the call is not such a case."""
    at = None
    for k, v in zip(keys, vals):
        if k == "axis" or k == "dim":
            at = v
    mc = [meta(a) for a in ndargs]
    s0, d0, c0 = mc[0]
    if not s0:
        return None
    for m in mc:
        if (m[1] is not d0 and m[1] != d0) or (m[2] is not c0 and m[2] != c0):
            return None
    if kind == "stack":
        axis = int(at) if at is not None else 0
        if axis < 0:
            axis += len(s0) + 1
        if axis != 1 or s0[0] != 1:
            return None
        for m in mc:
            if m[0] != s0:
                return None
        shape = (1, len(ndargs)) + s0[1:]
    else:
        dim = int(at) if at is not None else 1
        if dim < 0:
            dim += len(s0)
        rest = s0[1:]
        if dim != 0 or any(m[0][1:] != rest for m in mc):
            return None
        shape = (sum(m[0][0] for m in mc),) + rest
    return _composite(current_graph(), tuple(ndargs), shape, d0, c0)


def _composite(g, parts, shape, dtype, ctx):
    """A lazy array of ``shape`` made of ``parts``' rows side by side, tracked
    for writes to what it reads (``writes``); None where it is made outside
    autograd of rows recorded under it (the caller records the operator)."""
    mode_ = mode(g)
    if not mode_[0]:
        parts = unrecorded_parts(parts)
        if parts is None:
            return None
    out = new_lazy(Composite(parts, mode_), 0, shape, dtype, ctx, None)
    track(g, out)
    return out


def unrecorded_parts(parts):
    """The parts of a composite made while autograd is not recording: per
    sample its concat/stack is an array outside autograd's graph, so no
    gradient may reach a part through it. None where a part is a lazy array
    recorded under autograd (the caller records the operator instead, which
    runs outside autograd); concrete parts and computed lazy ones are taken
    as MXNet's detach of their values (the same memory)."""
    out = None
    i = 0
    for p in parts:
        if type(p) is LazyArray:
            node = node_of(p)
            if node is not DETACHED:
                if type(node) is Node:
                    n: Node = node
                    if n.mode[0]:
                        return None
                elif type(node) is Composite:
                    c: Composite = node
                    if c.mode[0]:
                        return None
                i += 1
                continue
            v = p.value()
        else:
            v = p
        if out is None:
            out = list(parts)
        out[i] = _detached(v)
        i += 1
    return parts if out is None else tuple(out)


_DETACHED = {}   # id(array) -> (array, its detach): one per array, so gathers share it


def _detached(v):
    """MXNet's detach of concrete ``v``, the same object for the same array
    (composites of a shared part, a zero state, gather it as one source)."""
    hit = _DETACHED.get(id(v))
    if hit is not None and hit[0] is v:
        return hit[1]
    if len(_DETACHED) >= 4096:
        _DETACHED.clear()
    d = NDArray.detach(v)
    _DETACHED[id(v)] = (v, d)
    return d


def stack(data, kwargs):
    """``nd.stack(*data, **kwargs)`` of lazy arrays as a composite, checked
    inline for the common case (lazy (1, ...) rows alike in shape, dtype and
    device, stacked along axis 1: MXNet's generated wrapper and the operator
    hook cost more than the rest), else through ``rows_composite``; None where
    it is not a composite (the caller runs MXNet's stack)."""
    if data and len(kwargs) == 1 and kwargs.get("axis") == 1:
        a = data[0]
        if type(a) is LazyArray:
            la = a
            s0, d0, c0 = la._shape, la._dtype, la._ctx
            if s0 and s0[0] == 1:
                for b in data:
                    if type(b) is not LazyArray:
                        break
                    la = b
                    if (la._shape is not s0 and la._shape != s0) or la._dtype is not d0 \
                            or la._ctx is not c0:
                        break
                else:
                    g: Graph = current_graph()
                    if not g.executing:
                        return _composite(g, tuple(data), (1, len(data)) + s0[1:], d0, c0)
    if data and (not kwargs or kwargs.keys() <= {"axis"}):
        for a in data:
            if type(a) is LazyArray:
                if current_graph().executing or \
                        not all(type(b) is LazyArray or type(b) is NDArray for b in data):
                    break
                axis = kwargs.get("axis", 0)
                return rows_composite("stack", data, ("axis",), (str(axis),))
    return None
