"""The only place that patches MXNet: the hybridize flag, block-call and operator
interception. Every patch is recorded and reverted by ``uninstall()``."""
import ctypes
import dis
import os
import sys
from functools import wraps as _wraps
import threading

import numpy as np

try:
    import cython   # compiled: the local type annotations below are C declarations
except ImportError:  # pragma: no cover - Cython is an install requirement
    cython = None

from mxnet import autograd
from mxnet.contrib import autograd as _contrib_autograd
from mxnet import ndarray as _ndmod
from mxnet.base import _LIB
from mxnet.context import Context
from mxnet.gluon.block import Block, HybridBlock, _flatten, _regroup
from mxnet.ndarray import NDArray
from mxnet.util import _NumpyArrayScope
from mxnet.ndarray import register as _register
from mxnet.symbol import Symbol

from .. import config as _config
from .. import cost
from ..errors import BatchingError, FlagError
from ..graph import Composite, Graph, current_graph
from ..schedule import POLICIES
from ..signature import SignatureTable
from ..stats import STATS
from . import backend, rewrite
from .backend import new_lazy
if not cython.compiled:
    # compiled, the name is LazyArray's C layout (_lazy.pxd, imported from .array)
    from .array import LazyArray
from .ops import OpExec, infer_outputs, make_rule, op_name

TABLE = SignatureTable()
_patches = []          # (owner, name, original) in patch order
_tls = threading.local()
_orig_invoke = _register._imperative_invoke
_orig_forward = HybridBlock.forward
_orig_block_hybridize = Block.hybridize
_orig_hybrid_hybridize = HybridBlock.hybridize
_orig_clear = HybridBlock._clear_cached_op  # pylint: disable=protected-access
_orig_get_graph = HybridBlock._get_graph  # pylint: disable=protected-access
_orig_call = Block.__call__
_SKIP = ("/mxnet/", "/jitbatch/gluon/", "/jitbatch/graph", "/contextlib")


class BatchConfig(object):
    """The dynamic-batching flags of one block (set tree-wide by ``hybridize``)."""
    __slots__ = ("policy", "budget", "granularity")

    def __init__(self, policy, budget, granularity="auto"):
        self.policy = policy
        self.budget = budget
        self.granularity = granularity

    def __repr__(self):
        return "BatchConfig(policy=%r, analysis_budget=%r, granularity=%r)" % (
            self.policy, self.budget, self.granularity)


def installed():
    return bool(_patches)


_NP_STATE = _NumpyArrayScope._current   # MXNet's numpy-semantics scope, per thread


def _np_array():
    """``mxnet.util.is_np_array()`` (read on every block call) without its Python frame."""
    cur = getattr(_NP_STATE, "value", None)
    return cur is not None and cur._is_np_array


_IS_REC = _LIB.MXAutogradIsRecording
_IS_TRAIN = _LIB.MXAutogradIsTraining
_MODE_GEN = 0   # bumped by every autograd-state setter: kept states older are stale


def _mode(g):
    """``(autograd.is_recording(), autograd.is_training())`` of this thread (whose
    graph is ``g``), asked of MXNet once and then kept on the graph until one of
    MXNet's setters runs (``install`` wraps them so that they bump
    ``_MODE_GEN``: every thread asks again, the one that changed among them);
    read on every record."""
    gr: Graph = g
    if gr.autograd_gen == _MODE_GEN:
        return gr.autograd
    r, t = ctypes.c_bool(), ctypes.c_bool()
    if _IS_REC(ctypes.byref(r)) or _IS_TRAIN(ctypes.byref(t)):
        return (autograd.is_recording(), autograd.is_training())  # MXNet's error
    m = gr.autograd = (r.value, t.value)
    gr.autograd_gen = _MODE_GEN
    return m


def forget_mode():
    """Drop the kept autograd states (read again at the next record)."""
    global _MODE_GEN
    _MODE_GEN += 1


def _drops_mode(setter):
    """Wrap an MXNet autograd-state setter so the states are asked again after it."""
    @_wraps(setter)
    def wrapper(*args, **kwargs):
        try:
            return setter(*args, **kwargs)
        finally:
            forget_mode()
    return wrapper


_skip_file = {}


def _skip(f):
    """True for a frame of MXNet or jitbatch (no user call site)."""
    fn = f.f_code.co_filename
    r = _skip_file.get(fn)
    if r is None:
        if fn == "<string>":   # MXNet's generated operator wrappers are exec'd code
            return f.f_globals.get("__name__", "").startswith("mxnet")
        r = False
        for part in _SKIP:
            if part in fn:
                r = True
        _skip_file[fn] = r
    return r


def _site():
    """The user call site of the running record (see ``_site_of``)."""
    return _site_of(sys._getframe(0))  # pylint: disable=protected-access


def _site_of(f):
    """``file:line in function`` at frame ``f`` or the first frame above it outside
    MXNet and jitbatch, kept as (code, line) and formatted only when an error needs
    it; with ``config.debug``, the whole user stack as text. (Frames of jitbatch's
    own functions are skipped, so this holds whether or not they are compiled.)"""
    if _config.debug:
        import traceback
        frames = []
        while f is not None:
            if not _skip(f):
                frames.append((f, f.f_lineno))
            f = f.f_back
        return "".join(traceback.format_list(traceback.StackSummary.extract(reversed(frames))))
    while f is not None and _skip(f):
        f = f.f_back
    if f is None:
        return "?"
    return Site(f.f_code, f.f_lasti)


class Site(object):
    """A call site: the code object and the offset of the call instruction in
    it, turned into a line number only when asked (``frame.f_lineno`` scans the
    code's line table on every record: ~0.2 us of a ~5 us record)."""
    __slots__ = ("code", "lasti")

    def __init__(self, code, lasti):
        self.code = code
        self.lasti = lasti

    @property
    def line(self):
        last = None
        for start, line in dis.findlinestarts(self.code):
            if start > self.lasti:
                break
            last = line
        return last if last is not None else self.code.co_firstlineno

    def __str__(self):
        return "%s:%d in %s" % (self.code.co_filename, self.line, self.code.co_name)

    __repr__ = __str__


_concrete_meta = {}   # id -> (array, meta): the same concrete array (a zero state,
                      # a constant) is passed to many calls; its meta is asked once


class _Device(Context):
    """The one Context object of a device that every meta and lazy array shares:
    signature keys compare it by identity (``Context.__eq__`` is Python code) and
    hash it from a stored value (``Context.__hash__`` builds a tuple per call).
    Equal to, and hashed like, any Context of the same device."""

    def __init__(self, ctx):
        super(_Device, self).__init__(ctx)
        self._hash = hash(ctx)
        self._jb_id = len(_CONTEXTS)   # its number: exact call keys hold this (an int
                                       # hashes in C; this class's __hash__ is Python)

    def __hash__(self):
        return self._hash


_CONTEXTS = {}   # Context of a device -> its _Device
_DEVICES = {}    # (device type id, device id) -> its _Device


def _device(ctx):
    """The one _Device of ``ctx``'s device."""
    c = _CONTEXTS.get(ctx)
    if c is None:
        c = _CONTEXTS[ctx] = _Device(ctx)
    return c


_LAST_CONCRETE = [None, None]   # the concrete array _meta saw last, and its meta


def _meta(a):
    if type(a) is LazyArray:
        la: LazyArray = a
        return la._shape, la._dtype, la._ctx
    last = _LAST_CONCRETE
    if a is last[0]:    # the same constant (a zero state) in call after call
        return last[1]
    hit = _concrete_meta.get(id(a))
    if hit is not None and hit[0] is a:
        last[0], last[1] = a, hit[1]
        return hit[1]
    fast = backend.concrete_meta(a)
    if fast is not None:
        shape, dtype, dev = fast
        c = _DEVICES.get(dev)
        if c is None:
            c = _DEVICES[dev] = _device(a.context)
        m = (shape, dtype, c)
    else:
        m = (a.shape, a.dtype, _device(a.context))
    if len(_concrete_meta) >= 512:
        _concrete_meta.clear()
    _concrete_meta[id(a)] = (a, m)
    return m


def _check_ctx(metas_ctx, what):
    ctx = metas_ctx[0][2]
    for i, m in enumerate(metas_ctx):
        if m[2] != ctx:
            raise BatchingError(
                "%s: argument %d is on %s but argument 0 is on %s; one call must have all "
                "its arrays on one context. Fix: move it with .as_in_context(%s)."
                % (what, i, m[2], ctx, ctx))
    return ctx


def kernels_leave_a_core():
    """Whether MXNet's kernels leave a core to Python: pipelined flushes run a
    chunk's kernels while Python records the next, which needs one. MXNet's
    OpenMP reads ``OMP_NUM_THREADS`` once, when it loads; unset, its kernels
    use every core. Measured with two threads on two cores (runs of
    scripts/bench_tree_lstm.py --threads 2, 2026-11-23): pipelined inference
    0.41x / 0.58x of the hand-written code (default / passive OpenMP waiting)
    against 0.53x / 0.66x without."""
    try:
        threads = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return False
    return (os.cpu_count() or 1) > threads


_FREE_CORE = True   # kernels_leave_a_core(), taken at install


def _limit(policy, mode):
    """Pending nodes at which a new graph runs itself: ``max_pending``, or under
    'auto' the cost model's chunk size for pipelined flushes (where the kernels
    leave a core to Python)."""
    limit = _config.max_pending
    if policy == "auto" and _config.pipeline and _FREE_CORE:
        chunk = cost.MODEL.pipeline_limit(mode)
        if chunk is not None and chunk < limit:
            limit = chunk
    return limit


def _maybe_autoflush(g):
    """Run the pending graph if it reached its size limit (a pipelined chunk, or
    the ``max_pending`` bound)."""
    gr: Graph = g
    if len(gr.nodes) >= gr.limit:
        backend.flush_graph(gr, reason="limit" if gr.limit >= _config.max_pending
                            else "pipeline")


# ---------------------------------------------------------------------------------------
# operators
def _invoke(handle, ndargs, keys, vals, out, is_np_op, output_is_list):
    for a in ndargs:
        if type(a) is LazyArray:
            break
    else:
        if _SCOPES and ndargs and out is None and not is_np_op:
            # concrete arguments inside an unflagged block run on lazy ones (a
            # per-sample loss's label arithmetic): recorded too, so they merge
            g: Graph = current_graph()
            if g.scope and not g.executing:
                return _record_op(g, handle, ndargs, keys, vals, output_is_list)
        return _orig_invoke(handle, ndargs, keys, vals, out, is_np_op, output_is_list)
    if out is not None or is_np_op:
        if out is not None:  # an in-place write: the target becomes a concrete array
            for o in (out if isinstance(out, (list, tuple)) else (out,)):
                if type(o) is LazyArray:
                    o.value()
                    o._node = backend.DETACHED
        return _orig_invoke(handle, ndargs, keys, vals, out, is_np_op, output_is_list)
    g = current_graph()
    if g.executing:
        return _orig_invoke(handle, ndargs, keys, vals, out, is_np_op, output_is_list)
    kind = _ROWS_OPS.get(handle)
    if kind is not None and not output_is_list:
        res = _rows_composite(kind, handle, ndargs, keys, vals)
        if res is not None:
            return res
    return _record_op(g, handle, ndargs, keys, vals, output_is_list)


_ROWS_OPS = {}   # handle -> 'stack' | 'concat': operators that can be virtual


def _init_rows_ops():
    op_name(0)  # builds the handle -> name table
    from .ops import _OP_NAMES
    for h, name in _OP_NAMES.items():
        if name == "stack":
            _ROWS_OPS[h] = "stack"
        elif name in ("concat", "Concat"):
            _ROWS_OPS[h] = "concat"


def _rows_composite(kind, handle, ndargs, keys, vals):
    """A stack along axis 1 of per-sample (1, ...) arrays, or a concat along
    axis 0, is only its inputs' rows side by side: a Composite, no node. Its
    consumers gather those rows directly (one take instead of a launch)."""
    at = None
    for k, v in zip(keys, vals):
        if k == "axis" or k == "dim":
            at = v
    mc = [_meta(a) for a in ndargs]
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
    return new_lazy(Composite(tuple(ndargs), (handle, keys, vals), _mode(current_graph())), 0,
                 shape, d0, c0, None)


_STACK = {}   # 'handle', 'orig': MXNet's generated nd.stack and its operator
_STACK_KEYS = ("axis", "num_args")
_STACK_BUILD = {}   # n -> how a composite of n rows stacked along axis 1 is built


def _stack_build(n):
    b = _STACK_BUILD.get(n)
    if b is None:
        b = _STACK_BUILD[n] = (_STACK["handle"], _STACK_KEYS, ("1", str(n)))
    return b


def _stack(*data, **kwargs):
    """``nd.stack`` that, when given lazy rows, makes their composite directly
    (MXNet's generated wrapper and the operator hook cost more than the rest)."""
    if data and len(kwargs) == 1 and kwargs.get("axis") == 1:
        # the common case, checked inline: lazy (1, ...) rows alike in shape, dtype
        # and (canonical) context, stacked along axis 1
        a = data[0]
        if type(a) is LazyArray:
            la: LazyArray = a
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
                        n = len(data)
                        return new_lazy(Composite(data, _stack_build(n), _mode(g)), 0,
                                     (1, n) + s0[1:], d0, c0, None)
    if data and (not kwargs or kwargs.keys() <= {"axis"}):
        for a in data:
            if type(a) is LazyArray:
                if current_graph().executing or \
                        not all(type(b) is LazyArray or type(b) is NDArray for b in data):
                    break
                axis = kwargs.get("axis", 0)
                res = _rows_composite("stack", _STACK["handle"], data,
                                      _STACK_KEYS, (str(axis), str(len(data))))
                if res is not None:
                    return res
                break
    return _STACK["orig"](*data, **kwargs)


def build_composite(comp):
    """The value of a composite read on its own: its operator on its parts."""
    handle, keys, vals = comp.build
    args = [backend.row_value(a) if type(a) is LazyArray else a for a in comp.parts]
    return _orig_invoke(handle, args, list(keys), list(vals), None, False, False)


def _record_op(g, handle, ndargs, keys, vals, output_is_list):
    mc = [_meta(a) for a in ndargs]
    mode = _mode(g)
    vkey = tuple(vals)
    try:
        hash(vkey)
    except TypeError:
        vkey = tuple(str(v) for v in vals)
    ctx = mc[0][2]
    # every argument's context is in the key (as for blocks), so a call mixing
    # contexts never reuses a signature whose first call passed the check
    key = ("op", handle, tuple(keys), vkey, tuple(mc), mode, output_is_list)
    info = TABLE.get(key)
    if info is None:
        metas = tuple((m[0], m[1]) for m in mc)
        name = op_name(handle)
        ctx = _check_ctx(mc, "operator %s" % name)
        out_meta = infer_outputs(_orig_invoke, handle, metas, list(keys), list(vals), ctx)
        rule = make_rule(name, list(keys), [str(v) for v in vals], [m[0] for m in metas],
                         [m[0] for m in out_meta])
        ex = OpExec(handle, name, rule, keys, [str(v) for v in vals], metas, out_meta,
                    ctx, mode, _orig_invoke)
        info = TABLE.add(key, lambda sid: _new_info(sid, key, ex, out_meta, rule is not None, name))
    if not g.nodes:
        g.limit = _limit(g.policy or "auto", mode)
    node = g.add(info, tuple(ndargs), _site(), mode)
    outs = [new_lazy(node, k, m[0], m[1], ctx, None) for k, m in enumerate(info.out_meta)]
    _maybe_autoflush(g)
    if len(outs) == 1 and not output_is_list:
        return outs[0]
    return outs


def _new_info(sid, key, ex, out_meta, batchable, name):
    from ..signature import SigInfo
    STATS.add(signatures=1)
    info = SigInfo(sid, key, ex, out_meta, batchable, name)
    if key[0] in _BLOCK_KEYS:
        # a block's signatures are renewed when it is hybridized again; its launch
        # measurements carry over (keyed without the renewal token)
        stable = key[:2] + key[3:]
        old = _MEASURED.get(stable)
        if old is not None:
            info.inherit(old)
        elif len(_MEASURED) >= TABLE.limit:
            _MEASURED.clear()
        _MEASURED[stable] = info
    return info


_BLOCK_KEYS = ("blk", "pad", "rag", "stg-in", "stg-main")
_MEASURED = {}   # block signature key without its token -> its latest SigInfo


# ---------------------------------------------------------------------------------------
# blocks
class BlockExec(object):
    """Runs the nodes of one block signature as one call of the block's CachedOp."""
    __slots__ = ("block", "fmt", "in_meta", "out_meta", "ctx", "mode", "checked", "pad",
                 "stages")
    rounds = True   # launch sizes rounded up (config.row_buckets, backend.prepare)

    def __init__(self, block, fmt, in_meta, out_meta, ctx, mode, pad=None):
        self.block = block
        self.fmt = fmt
        self.in_meta = in_meta
        self.out_meta = out_meta
        self.ctx = ctx
        self.mode = mode
        self.checked = False
        self.pad = pad      # {argument: axis} zero-padded to the batch's largest size
        self.stages = None  # its input-stage plan: None until looked for, False: none

    def launch(self, batch):
        n = batch[0].group.size     # with filler samples (config.row_buckets)
        with self.ctx, backend.mode_scope(self.mode):
            it = iter(backend.gather_batch(batch))
            flat = [None if f == -1 else next(it) for f in _leaves(self.fmt)]
            args = _regroup(flat, self.fmt)
            out = self.block._call_cached_op(*args)  # pylint: disable=protected-access
            outs, _ = _flatten(out, "output")
        if not self.checked:
            for o, m in zip(outs, self.out_meta):
                want = backend.flat_shape(m[0], n) if m[0][0] is not None else \
                    (batch[0].group.rows,) + tuple(m[0][1:])
                if o.shape != want:
                    raise BatchingError(
                        "block %s gave an output of shape %s for %d merged samples of "
                        "per-sample output shape %s" % (self.block.name, o.shape, n, m[0]))
            self.checked = True
        backend.finish(batch, outs)


def _leaves(fmt):
    if isinstance(fmt, int):
        if fmt > 0:
            raise BatchingError("symbol inputs are not supported")
        return [fmt]
    res = []
    for f in fmt:
        res.extend(_leaves(f))
    return res


def _block_info(block, args, flat, fmt, mc, mode, key, rkey, pad=None):
    ctx = _check_ctx(mc, "block %s" % block.name)
    try:
        inputs, out = block._get_graph(*args)  # pylint: disable=protected-access
    except Exception as e:
        raise BatchingError("block %s could not be traced for dynamic batching: %s: %s"
                            % (block.name, type(e).__name__, e)) from e
    if block._in_format != fmt:  # pylint: disable=protected-access
        raise BatchingError(
            "block %s was first called with argument structure %s and now with %s; a "
            "hybridized block keeps one structure. Fix: pass a varying number of arrays "
            "as one stacked array (e.g. nd.stack(*children, axis=1))."
            % (block.name, block._in_format, fmt))  # pylint: disable=protected-access
    names = [s.name for s in inputs]
    shapes = [m[0] for m in mc]
    dtypes = [m[1] for m in mc]
    for i, s in enumerate(shapes):
        if len(s) == 0:
            raise BatchingError("block %s: argument %d has shape (); batching concatenates "
                                "along axis 0. Fix: give it a leading axis." % (block.name, i))
    kinds = sorted(set(np.dtype(d).name for d in dtypes))
    if len(kinds) > 1:
        first = np.dtype(dtypes[0]).name
        odd = next(i for i, d in enumerate(dtypes) if np.dtype(d).name != first)
        raise BatchingError(
            "block %s: argument %d is %s but argument 0 is %s; a call's arrays must share "
            "one dtype. Fix: cast it with .astype('%s')."
            % (block.name, odd, np.dtype(dtypes[odd]).name, first, first))
    try:
        _, o1, _ = out.infer_shape_partial(**dict(zip(names, shapes)))
        _, o2, _ = out.infer_shape_partial(
            **{nm: (2 * s[0],) + tuple(s[1:]) for nm, s in zip(names, shapes)})
        _, ot, _ = out.infer_type(**dict(zip(names, dtypes)))
    except Exception as e:
        raise BatchingError("block %s: output shapes cannot be inferred from inputs %s: %s"
                            % (block.name, shapes, e)) from e
    for k, (a, b) in enumerate(zip(o1, o2)):
        if not a or 0 in a or not b:
            raise BatchingError("block %s: the shape of output %d cannot be inferred from "
                                "input shapes %s" % (block.name, k, shapes))
        if b[0] != 2 * a[0] or tuple(b[1:]) != tuple(a[1:]):
            raise BatchingError(
                "block %s cannot be batched along axis 0: for inputs %s its output %d has "
                "shape %s, but for twice the rows it has %s (expected %s). Dynamic "
                "batching concatenates samples along axis 0, so every output row must "
                "depend only on its own sample. Fix: keep a per-sample leading axis (e.g. "
                "shape (1, K, H) instead of (K, H)) or hybridize this block without "
                "dynamic_batch." % (block.name, shapes, k, a, b,
                                    (2 * a[0],) + tuple(a[1:])))
    out_meta = tuple((tuple(a), np.dtype(t).type) for a, t in zip(o1, ot))
    in_meta = tuple(zip(shapes, dtypes))
    if pad is not None:
        _check_pad_outputs(block, out, names, shapes, o1, pad)
        in_meta = tuple((s[:pad[i]] + (None,) + s[pad[i] + 1:] if i in pad else s, d)
                        for i, (s, d) in enumerate(in_meta))
    elif rkey is not None and _rowwise_any_length(out, names, shapes, o1):
        # ragged: samples of any leading length merge; sizes live on the nodes
        out_meta = tuple(((None,) + tuple(a[1:]), t) for a, t in out_meta)
        ex = BlockExec(block, fmt, tuple(((None,) + tuple(s[1:]), d)
                                         for s, d in zip(shapes, dtypes)), out_meta, ctx, mode)
        return TABLE.add(rkey, lambda sid: _new_info(sid, rkey, ex, out_meta, True, block.name))
    if rkey is not None:
        TABLE.add(rkey, lambda sid: _NOT_RAGGED)
    ex = BlockExec(block, fmt, in_meta, out_meta, ctx, mode, pad and dict(pad))
    info = TABLE.add(key, lambda sid: _new_info(sid, key, ex, out_meta, True, block.name))
    if pad is not None:
        info.pad_axes = tuple(sorted(pad.items()))
    return info


_NOT_RAGGED = object()


def _check_pad_outputs(block, out, names, shapes, o1, pad):
    """Outputs of a zero-padded block must not change shape with the padded size."""
    grown = [tuple(s[:pad[i]]) + (s[pad[i]] + 1,) + tuple(s[pad[i] + 1:]) if i in pad else s
             for i, s in enumerate(shapes)]
    try:
        _, o3, _ = out.infer_shape_partial(**dict(zip(names, grown)))
    except Exception as e:
        raise BatchingError("block %s: zero_pad(%s) declared, but the block cannot take "
                            "inputs of shapes %s (one more along the padded axes): %s"
                            % (block.name, _pad_names(block), grown, e)) from e
    for k, (a, b) in enumerate(zip(o1, o3)):
        if tuple(a) != tuple(b):
            raise BatchingError(
                "block %s: zero_pad(%s) declared, but its output %d has shape %s for inputs "
                "%s and %s when the padded axes grow by one (%s); padding must not change "
                "the outputs' shapes. Fix: reduce over the padded axis inside the block "
                "(e.g. a sum over children), or drop the declaration with "
                "jitbatch.zero_pad(block)." % (block.name, _pad_names(block), k, tuple(a),
                                               shapes, tuple(b), grown))


def _padsize(key, pads):
    """A call's size along its padded axes (the largest, if several), from the
    input shapes in its exact key (see _record_block)."""
    k = 0
    for i, axis in pads:
        s = key[_KEY_ARGS + 2 * i][axis]
        if s > k:
            k = s
    return k


def _pad_names(block):
    return ", ".join("%s=%d" % kv for kv in sorted((block._jb_pad_names or {}).items()))


def zero_pad(block, **axes):
    """Declare that zero entries along an axis of some of ``block``'s inputs add
    nothing to its outputs or to any gradient (e.g. absent children in a
    child-sum cell), so calls whose inputs differ only in that axis's size may
    run as one launch, each zero-padded to the largest size in it.

    ``axes`` maps an input's name in ``hybrid_forward`` to the axis (>= 1; axis
    0 is the batch axis). ``jitbatch.zero_pad(block)`` removes the declaration.
    jitbatch cannot check the claim; a wrong one gives wrong results (test the
    block batched against plain Gluon, as tests/test_differential.py does)."""
    import inspect
    if not isinstance(block, HybridBlock):
        raise FlagError("zero_pad(%r): expected a HybridBlock instance, got %s"
                        % (block, type(block).__name__))
    params = list(inspect.signature(block.hybrid_forward).parameters.values())
    data = []
    for p in params[1:]:          # params[0] is F
        if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD or p.name in block._reg_params:
            break
        data.append(p.name)
    pos = {}
    for name, axis in sorted(axes.items()):
        if name not in data:
            raise FlagError("zero_pad(%s, %s=...): %s.hybrid_forward has no input named %r; "
                            "its inputs are %s" % (block.name, name, type(block).__name__,
                                                   name, ", ".join(data) or "(none)"))
        if isinstance(axis, bool) or not isinstance(axis, int) or axis < 1:
            raise FlagError("zero_pad(%s, %s=%r): expected an axis >= 1 (axis 0 is the "
                            "batch axis, along which samples of any length merge already)"
                            % (block.name, name, axis))
        pos[data.index(name)] = axis
    block._jb_pad = pos or None
    block._jb_pad_names = dict(axes) or None
    block._jb_token = object()    # signatures recorded under the old declaration
    return block


def _rowwise_any_length(out, names, shapes, o1):
    """True if every output keeps the inputs' shared leading length L, checked by
    shape inference at L and at a length no multiple of it."""
    length = shapes[0][0]
    if any(a[0] != length for a in o1):
        return False
    other = 2 * length + 1
    try:
        _, o3, _ = out.infer_shape_partial(
            **{nm: (other,) + tuple(s[1:]) for nm, s in zip(names, shapes)})
    except Exception:  # pylint: disable=broad-except
        return False
    return all(b and b[0] == other and tuple(b[1:]) == tuple(a[1:]) for a, b in zip(o1, o3))


def _record_block(self, g, x, args, frame):
    allargs = (x,) + args
    for a in allargs:
        t = type(a)
        if t is not LazyArray and t is not NDArray:
            break
    else:
        t = None
    if t is None:
        flat = allargs
        fmt = _FLAT_IN[len(allargs)] if len(allargs) < 16 else [0] * len(allargs)
    else:
        for i, a in enumerate(allargs):
            if not isinstance(a, (NDArray, Symbol, list, tuple)) and a is not None:
                raise BatchingError(
                    "block %s: argument %d has type %s; a flagged block takes NDArrays "
                    "(or nested lists of them). Fix: convert it with mx.nd.array(...)."
                    % (self.name, i, type(a).__name__))
        try:
            flat, fmt = _flatten(allargs, "input")
        except ValueError as e:
            raise BatchingError("block %s: %s; a flagged block takes NDArrays (or nested "
                                "lists of them). Fix: convert it with mx.nd.array(...)."
                                % (self.name, e)) from e
        for a in flat:
            if isinstance(a, Symbol):
                return None
        flat = [a for a in flat if a is not None]
        for a in flat:
            if not isinstance(a, NDArray):
                raise BatchingError("block %s: argument of type %s; expected NDArray"
                                    % (self.name, type(a).__name__))
    mode = _mode(g)
    fkey = len(flat) if t is None else str(fmt)
    # The exact call's key (see _KEY_ARGS): the block, its structure and the
    # autograd mode, the context, then each argument's shape and dtype. Every
    # context is its device's one _Device, so a call on one device (the usual
    # case) puts in its number once; a call mixing devices puts in all (and
    # fails in _block_info: it is never stored).
    key = [self, self._jb_token, fkey, mode, None]
    ctx = mixed = None
    la: LazyArray
    for a in flat:
        if type(a) is LazyArray:
            la = a
            key.append(la._shape)
            key.append(la._dtype)
            c = la._ctx
        else:
            m = _meta(a)
            key.append(m[0])
            key.append(m[1])
            c = m[2]
        if c is not ctx:
            if ctx is None:
                ctx = c
            elif mixed is None:
                mixed = [ctx]
        if mixed is not None:
            mixed.append(c)
    key[4] = ctx._jb_id if mixed is None else tuple(mixed)
    key = tuple(key)
    shape0 = key[_KEY_ARGS]
    lead = shape0[0] if shape0 else None
    info = _EXACT.get(key)     # this exact call seen before: its signature, ragged or not
    if info is None:
        mc = [_meta(a) for a in flat]
        info = _resolve_block(self, allargs, flat, fmt, mc, mode, fkey, lead, key)
    if not g.nodes:
        cfg = self._jb_cfg
        g.policy, g.budget, g.granularity = cfg.policy, cfg.budget, cfg.granularity
        g.limit = _limit(cfg.policy, mode)
    site = _site_of(frame)
    si: SigInfo = info
    out_meta = si.out_meta
    if out_meta and out_meta[0][0][0] is None:
        node = g.add(info, tuple(flat), site, mode, lead)
        outs = [new_lazy(node, k, (lead,) + m[0][1:], m[1], ctx, None)
                for k, m in enumerate(out_meta)]
    else:
        node = g.add(info, tuple(flat), site, mode)
        if si.pad_axes is not None:
            node.pad = _padsize(key, si.pad_axes)
        outs = [new_lazy(node, k, m[0], m[1], ctx, None) for k, m in enumerate(out_meta)]
    _maybe_autoflush(g)
    fmt = self._out_format  # pylint: disable=protected-access
    if fmt == _FLAT.get(len(outs)):
        return outs if len(outs) > 1 else outs[0]
    return _regroup(outs, fmt)


_EXACT = {}   # exact call key -> SigInfo (bounded; skips the ragged key's rebuild)
_KEY_ARGS = 5   # where the arguments' (shape, dtype) pairs start in an exact call's key


def _resolve_block(self, allargs, flat, fmt, mc, mode, fkey, lead, key):
    pad = self._jb_pad
    skey = key      # the signature's key; ``key`` (the exact call) indexes _EXACT
    rkey = None
    info = None
    if pad is not None:
        skey = _padded_key(self, pad, fmt, mc, mode, fkey)
    elif lead is not None and all(m[0] and m[0][0] == lead for m in mc):
        rkey = ("rag", id(self), self._jb_token, fkey,
                tuple([(m[0][1:], m[1]) for m in mc]), mc[0][2], mode)
        info = TABLE.get(rkey)
        if info is _NOT_RAGGED:
            info = rkey = None
    if info is None:
        info = TABLE.get(skey)
        if info is None:
            info = _block_info(self, allargs, flat, fmt, mc, mode, skey, rkey, pad)
    if len(_EXACT) >= TABLE.limit:
        _EXACT.clear()
    _EXACT[key] = info
    return info


def _padded_key(self, pad, fmt, mc, mode, fkey):
    """The signature key of a call to a block with zero-padded inputs: their
    sizes along the padded axes are left out of it."""
    if type(fkey) is not int:
        raise BatchingError(
            "block %s: zero_pad(%s) needs the block's inputs passed as separate arrays, "
            "but it was called with nested lists (%s). Fix: stack each list into one "
            "array (e.g. nd.stack(*children, axis=1))." % (self.name, _pad_names(self), fmt))
    pmc = list(mc)
    for i, axis in pad.items():
        if i >= len(mc):
            raise BatchingError("block %s: zero_pad(%s) names input %d, but the call passed "
                                "%d arrays" % (self.name, _pad_names(self), i, len(mc)))
        shape = mc[i][0]
        if len(shape) <= axis:
            raise BatchingError(
                "block %s: zero_pad(%s) pads input %d along axis %d, but it has shape %s "
                "(%d axes). Fix: pass it with the padded axis (e.g. shape (1, K, H)) or "
                "change the declared axis." % (self.name, _pad_names(self), i, axis,
                                                shape, len(shape)))
        pmc[i] = (shape[:axis] + (None,) + shape[axis + 1:], mc[i][1], mc[i][2])
    return ("pad", id(self), self._jb_token, fkey, tuple(pmc), mode)


_SCOPES = 0   # unflagged blocks running on lazy arguments, all threads (see _forward)


def _any_lazy(x, args):
    """Whether a block call's first argument or any other is a lazy array."""
    if type(x) is LazyArray:
        return True
    for a in args:
        if type(a) is LazyArray:
            return True
    return False


def _forward(self, x, *args):
    if self._jb_cfg is None:
        if _any_lazy(x, args) and not any(isinstance(a, Symbol) for a in args):
            return _scoped_forward(self, x, args)
        return _orig_forward(self, x, *args)
    if self._active:
        if isinstance(x, Symbol):
            return _orig_forward(self, x, *args)
        g: Graph = current_graph()
        if g.passthrough and not g.nodes and not _any_lazy(x, args):
            g.passthrough -= 1     # 'auto' found nothing to merge: run eagerly
            return _orig_forward(self, x, *args)
        if not g.executing:
            res = _record_block(self, g, x, args, sys._getframe(0))  # pylint: disable=protected-access
            if res is not None:
                return res
    return _orig_forward(self, x, *args)


def _scoped_forward(self, x, args):
    """An unflagged block called on lazy arrays (a loss on a sample's output)
    runs operator by operator, so that its operators are recorded and merge
    across samples: its operators on concrete arguments only (the label's
    ``log(label + 1e-12)`` of ``KLDivLoss``) are recorded as well while it runs.
    A hybridized one (``loss.hybridize()``) runs so too: its cached graph would
    read, and so compute, its lazy arguments in every sample's call."""
    global _SCOPES
    g: Graph = current_graph()
    if g.executing:
        return _orig_forward(self, x, *args)
    active = self._active
    g.scope += 1
    _SCOPES += 1
    try:
        if active:
            self._active = False
        return _orig_forward(self, x, *args)
    finally:
        if active:
            self._active = True
        g.scope -= 1
        _SCOPES -= 1


def _call(self, *args):
    """A flagged block's call: if user code raises while recording, the nodes
    this call recorded are dropped (and their lazy arrays fail loudly when read),
    so the next minibatch starts clean."""
    if self._jb_cfg is None:
        return _orig_call(self, *args)
    g: Graph = current_graph()
    mark = len(g.nodes)
    try:
        if args and type(self).forward is _forward and self._active and \
                not g.executing and not g.passthrough and not self._forward_hooks and \
                not self._forward_pre_hooks and not _np_array():
            # what Block.__call__ -> HybridBlock.forward would do here, minus two
            # Python frames: record the call (None: symbols, run it as usual)
            res = _record_block(self, g, args[0], args[1:], sys._getframe(0))  # pylint: disable=protected-access
            if res is not None:
                return res
        return _orig_call(self, *args)
    except BaseException as e:
        if not g.executing and g.discard_since(mark, e):
            STATS.add(failures=1)
        raise


_FLAT_IN = {n: [0] * n for n in range(1, 16)}
_FLAT = {n: [0] * n for n in range(1, 16)}
_FLAT[1] = 0
_FLAG_KEYS = ("dynamic_batch", "policy", "analysis_budget", "granularity")
GRANULARITIES = ("auto", "block", "split")


def _parse_flags(block, kwargs):
    db = kwargs.pop("dynamic_batch", False)
    policy = kwargs.pop("policy", "auto")
    budget = kwargs.pop("analysis_budget", None)
    gran = kwargs.pop("granularity", "auto")
    if not isinstance(db, bool):
        raise FlagError("hybridize(dynamic_batch=%r) on %s: expected True or False"
                        % (db, block.name))
    if policy not in POLICIES:
        raise FlagError("hybridize(policy=%r) on %s: unknown policy; expected one of %s"
                        % (policy, block.name, ", ".join(repr(p) for p in POLICIES)))
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= 0:
            raise FlagError("hybridize(analysis_budget=%r) on %s: expected a number >= 0 "
                            "(a fraction of the flush's predicted execution time) or None"
                            % (budget, block.name))
    if gran not in GRANULARITIES:
        raise FlagError("hybridize(granularity=%r) on %s: expected one of %s ('block': a "
                        "call is one node; 'split': a recursive block's input stage runs "
                        "as one launch across depths; 'auto': the cost model decides)"
                        % (gran, block.name, ", ".join(repr(g) for g in GRANULARITIES)))
    return BatchConfig(policy, None if budget is None else float(budget), gran) if db else None


def _make_hybridize(orig):
    def hybridize(self, active=True, *args, **kwargs):
        ours = {k: kwargs.pop(k) for k in _FLAG_KEYS if k in kwargs}
        outer = not getattr(_tls, "inside", False)
        cfg = _parse_flags(self, ours) if outer else None
        if outer:
            if cfg is not None and not active:
                raise FlagError("hybridize(active=False, dynamic_batch=True) on %s: dynamic "
                                "batching runs hybridized blocks; pass active=True" % self.name)
            g = current_graph()
            if g.nodes:  # flags change: run what was recorded under the old ones
                backend.flush_graph(g, reason="flags changed")
            # new flags: record again before judging; the streak of flushes
            # that found nothing to merge is kept, so if the next one finds
            # nothing again its window is as long as the streak has earned (a
            # flush that merges ends the streak)
            g.passthrough = 0
        _tls.inside = True
        try:
            orig(self, active, *args, **kwargs)
        finally:
            if outer:
                _tls.inside = False
        if outer:
            def setcfg(b):
                b._jb_cfg = cfg
            self.apply(setcfg)
    hybridize.__doc__ = orig.__doc__
    hybridize.__wrapped__ = orig
    return hybridize


def _clear(self):
    _orig_clear(self)
    self._jb_token = object()  # new structure: old signatures no longer apply


def _get_graph(self, *args):
    """MXNet's tracing, then, for a ``dynamic_batch`` block, the graph rewrites
    of :mod:`.rewrite` (once, when the graph is traced; every later use of the
    block's graph, merged or per sample, runs the rewritten one)."""
    fresh = not self._cached_graph  # pylint: disable=protected-access
    res = _orig_get_graph(self, *args)
    if fresh and self._jb_cfg is not None and _config.fast_activations:
        count = rewrite.rewrite_traced(self)
        if count:
            STATS.add(fast_activations=count)
            res = self._cached_graph  # pylint: disable=protected-access
    return res


# ---------------------------------------------------------------------------------------
def _set(owner, name, value):
    _patches.append((owner, name, owner.__dict__.get(name, _MISSING)))
    setattr(owner, name, value)


_MISSING = object()


def install():
    """Install the hooks (idempotent)."""
    if _patches:
        return
    global _FREE_CORE
    _FREE_CORE = kernels_leave_a_core()
    _set(Block, "_jb_cfg", None)
    _set(Block, "__call__", _call)
    _set(HybridBlock, "_jb_token", None)
    _set(HybridBlock, "_jb_pad", None)
    _set(HybridBlock, "_jb_pad_names", None)
    _set(HybridBlock, "forward", _forward)
    _set(HybridBlock, "_clear_cached_op", _clear)
    _set(HybridBlock, "_get_graph", _get_graph)
    _set(Block, "hybridize", _make_hybridize(_orig_block_hybridize))
    _set(HybridBlock, "hybridize", _make_hybridize(_orig_hybrid_hybridize))
    _set(_register, "_imperative_invoke", _invoke)
    # the autograd state is kept per thread between records: every Python path
    # that changes it (record/pause/train_mode/predict_mode scopes, the setters,
    # the deprecated contrib API) goes through these module functions
    forget_mode()
    for owner, names in ((autograd, ("set_recording", "set_training")),
                         (_contrib_autograd, ("set_is_training",))):
        for name in names:
            _set(owner, name, _drops_mode(getattr(owner, name)))
    if not _ROWS_OPS:
        _init_rows_ops()
    _STACK["orig"] = _ndmod.stack
    _STACK["handle"] = next(h for h, k in _ROWS_OPS.items() if k == "stack")
    stack = _wraps(_STACK["orig"])(_stack)
    for mod in (_ndmod, _ndmod.op):
        if getattr(mod, "stack", None) is _STACK["orig"]:
            _set(mod, "stack", stack)


def uninstall():
    """Flush this thread's graph and restore MXNet exactly as it was."""
    if not _patches:
        return
    g = current_graph()
    if g.nodes:
        backend.flush_graph(g, reason="uninstall")
    g.release()
    g.kept_before = []
    while _patches:
        owner, name, orig = _patches.pop()
        if orig is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, orig)
    forget_mode()
    TABLE.clear()   # block instances keep inert _jb_cfg/_jb_token attributes
    _EXACT.clear()
    _MEASURED.clear()
    _concrete_meta.clear()
    _LAST_CONCRETE[0] = _LAST_CONCRETE[1] = None
