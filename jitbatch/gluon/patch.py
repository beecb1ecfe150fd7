"""The only place that patches MXNet: ``install`` / ``uninstall`` and the thin shims.

Every patch is recorded and reverted by ``uninstall()`` in reverse order. The
shims only decide whether a call is jitbatch's business and hand it to
``record``: ``Block.__call__`` and ``HybridBlock.forward`` (flagged block
calls), MXNet's operator entry point (operators on lazy arrays; a lazy
array's arithmetic goes to it directly, :mod:`.arith`),
``nd.stack`` (stacks of lazy rows), ``hybridize`` (the flags, tree-wide),
``_clear_cached_op`` (new signatures) and ``_get_graph`` (graph rewrites; a
block whose tracing asks the autograd mode is left unhybridized). The guards
on functions that change what pending calls read are in :mod:`.guards`; a patch
wrapped by another library since (``amp.init``) stays at ``uninstall``."""
import inspect
import threading
import warnings
from sys import _getframe
from functools import wraps

import numpy as np
from mxnet import autograd as _autograd
from mxnet.base import mx_real_t as _mx_real_t
from mxnet.context import Context, current_context

from mxnet.gluon.block import Block, HybridBlock, SymbolBlock
from mxnet.gluon.parameter import Parameter
from mxnet.gluon.trainer import Trainer
from mxnet.kvstore import KVStore
from mxnet.gluon.rnn.rnn_cell import RecurrentCell
from mxnet.gluon.rnn.rnn_layer import _RNNLayer
from mxnet.ndarray import NDArray, register
from mxnet import ndarray as _ndmod
from mxnet import random as _mxrandom
from mxnet.symbol import Symbol

from .. import execute
from ..errors import ContractWarning, FlagError
from ..graph import Composite, Graph, Node, current_graph
from ..stats import STATS
from . import _mxapi, arith, contract, guards, meta, outputs, params, rewrite, signatures
from .fills import fill_shim
from .executors import CACHED_OPS, unpinned
from ._mxapi import np_array_mode, recurrent_forward
from .flags import FLAG_KEYS, Unhybridized, misspelt_flag, parse_flags, renew_token
from .fused import stateless
from .interleave import in_sample
from .lazy import LazyArray, detach
from .modes import drops_mode, forget_mode
from .record import (FILLS, ROWS_OPS, record_block, record_const, record_copy, record_filled,
                     record_op, rows_composite, stack)
from .writes import MUTATING, before_write, find_mutating, setitem

_patches = []          # (owner, name, original, ours) in patch order
_MISSING = object()
_tls = threading.local()
_SCOPES = 0   # unflagged blocks running on lazy arguments, all threads (see _scoped_forward)


#: Python custom operators (``nd.Custom``): one handle, whatever the op_type
_CUSTOM = _mxapi.op_handle("Custom")


def installed():
    return bool(_patches)


# -- operators -------------------------------------------------------------------------
def _invoke(handle, ndargs, keys, vals, out, is_np_op, output_is_list):
    """MXNet's ``_imperative_invoke``: an operator with a lazy argument is
    recorded; one without runs as usual (one type check per argument)."""
    if out is not None:     # an in-place write: pending readers of the target run first
        for o in (out if isinstance(out, (list, tuple)) else (out,)):
            before_write(o)
    if handle in MUTATING:  # it writes its inputs (zero_grad's reset_arrays): the same
        for a in ndargs:
            before_write(a)
    elif handle == _CUSTOM:
        aux = _mxapi.aux_states(handle, keys, vals, len(ndargs))
        if aux:
            # a custom operator whose forward writes its auxiliary states (a
            # running mean): at once, in program order, after what reads them
            for a in ndargs[len(ndargs) - aux:]:
                before_write(a)
            return _mxapi.invoke(handle, ndargs, keys, vals, out, is_np_op, output_is_list)
    for a in ndargs:
        if type(a) is LazyArray:
            break
    else:
        if not ndargs and out is None and handle in FILLS and not is_np_op:
            # nd.zeros / nd.ones (an RNN's begin_state) while a graph is pending
            g: Graph = current_graph()
            if g.nodes and not g.executing:
                res = record_filled(g, handle, keys, vals)
                if res is not None:
                    return res
        if _SCOPES and ndargs and out is None and not is_np_op:
            # concrete arguments inside an unflagged block run on lazy ones (a
            # per-sample loss's label arithmetic): recorded too, so they merge
            g: Graph = current_graph()
            if g.scope and not g.executing:
                return record_op(g, handle, ndargs, keys, vals, output_is_list)
        return _mxapi.invoke(handle, ndargs, keys, vals, out, is_np_op, output_is_list)
    if out is not None or is_np_op:
        if out is not None:  # an in-place write: the target becomes a concrete array
            for o in (out if isinstance(out, (list, tuple)) else (out,)):
                if type(o) is LazyArray:
                    detach(o)
        return _mxapi.invoke(handle, ndargs, keys, vals, out, is_np_op, output_is_list)
    g = current_graph()
    if g.executing or (g.passthrough and not g.nodes and not _any_pending(ndargs)):
        # (in a window of eager calls, lazy arguments computed already are as
        # concrete as any: per-sample code goes on with a value it just read)
        return _mxapi.invoke(handle, ndargs, keys, vals, out, is_np_op, output_is_list)
    kind = ROWS_OPS.get(handle)
    if kind is not None and not output_is_list:
        res = rows_composite(kind, ndargs, keys, vals)
        if res is not None:
            return res
    return record_op(g, handle, ndargs, keys, vals, output_is_list)


def _verify_legacy(op_name, func_name, args, out):
    """MXNet's check that a legacy operator gets no ``mxnet.numpy`` arrays, which
    every generated operator runs first and which imports a module on every
    call (~0.6 us of a ~3 us operator record): arguments that are plain or
    lazy NDArrays pass at once; anything else gets MXNet's own check."""
    if out is None:
        for a in args:
            t = type(a)
            if t is not LazyArray and t is not NDArray:
                return _mxapi.verify_legacy(op_name, func_name, args, out)
        return None
    return _mxapi.verify_legacy(op_name, func_name, args, out)


def _index_array(idx, ax_len, ctx):
    """``NDArray._advanced_index_to_array`` (an index of MXNet's advanced
    indexing of a concrete array): a lazy index is computed first, as MXNet
    keeps only exact NDArrays as index arrays."""
    if type(idx) is LazyArray:
        idx = idx.value()
    return _mxapi.advanced_index_to_array(idx, ax_len, ctx)


def _array(source_array, ctx=None, dtype=None):
    """``nd.array``: while this thread's graph is pending, an array made from
    Python data (a list, a NumPy array) is recorded, and a flush makes all of
    them at once (per-sample code making one per sample, e.g. a leaf's word
    id, paid a synchronised copy each)."""
    if not isinstance(source_array, NDArray):
        g: Graph = current_graph()
        if g.nodes and not g.executing:
            try:
                values = np.array(source_array, dtype=_mx_real_t if dtype is None else dtype)
            except (TypeError, ValueError):
                values = None
            where = ctx or current_context()
            # pinned or shared memory is made at once: a pending value would be
            # on the CPU (what operators on them compute on, meta.compute_context)
            if values is not None and values.ndim and values.size and \
                    values.dtype.kind in "biuf" and where.device_type not in meta.HOST_MEMORY:
                return record_const(g, values, where)
    return _mxapi.nd_array(source_array, ctx=ctx, dtype=dtype)


def _copyto(self, other):
    """``NDArray.copyto`` (and ``as_in_context``, which calls it): a pending lazy
    array copied to another device is recorded, so that a loop moving each
    sample's output to one device does not run the graph at every sample."""
    if type(self) is LazyArray and isinstance(other, Context) and \
            other.device_type not in meta.HOST_MEMORY:   # pinned, shared: made at once
        g: Graph = current_graph()
        dst = meta.device(other)
        if g.nodes and not g.executing and dst is not self.context:
            return record_copy(g, self, dst)
    return _mxapi.copyto(self, other)


def _stack(*data, **kwargs):
    """``nd.stack``: a stack of lazy rows becomes a composite directly."""
    res = stack(data, kwargs)
    if res is not None:
        return res
    return _mxapi.nd_stack(*data, **kwargs)


# -- blocks ----------------------------------------------------------------------------
def _any_lazy(x, args):
    """Whether a block call's first argument or any other is a lazy array."""
    if type(x) is LazyArray:
        return True
    for a in args:
        if type(a) is LazyArray:
            return True
    return False


def _any_pending(args):
    """Whether any of ``args`` is a lazy array whose launch has not run yet (one
    that ran is as concrete as any array: MXNet reads its rows through its
    handle)."""
    for a in args:
        if type(a) is LazyArray:
            la = a
            if la._value is not None:
                continue
            node = la._node
            if type(node) is Node:
                n: Node = node
                if n.batch is None:
                    return True
            elif type(node) is Composite:
                c: Composite = node
                for p in c.nodes:
                    pn: Node = p
                    if pn.batch is None:
                        return True
    return False


def _forward(self, x, *args):
    """``HybridBlock.forward``: a flagged, active block's call is recorded."""
    if self._jb_cfg is None:
        if _any_lazy(x, args) and not any(isinstance(a, Symbol) for a in args):
            return _scoped_forward(self, x, args)
        return _mxapi.hybrid_forward(self, x, *args)
    if self._active:
        if isinstance(x, Symbol) or np_array_mode():
            # tracing; or NumPy semantics, which merged launches do not follow
            return _mxapi.hybrid_forward(self, x, *args)
        g: Graph = current_graph()
        if g.passthrough and not g.nodes and not _any_pending((x,) + args):
            g.passthrough -= 1     # 'auto' found nothing to merge: run eagerly
            with CACHED_OPS:       # other threads' calls and launches take turns
                return _mxapi.hybrid_forward(self, x, *args)
        if not g.executing:
            res = record_block(self, g, x, args, _getframe(0))  # pylint: disable=protected-access
            if res is not None:
                return res
    return _mxapi.hybrid_forward(self, x, *args)


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
        return _mxapi.hybrid_forward(self, x, *args)
    active = self._active
    g.scope += 1
    _SCOPES += 1
    try:
        if active:
            self._active = False
        return _mxapi.hybrid_forward(self, x, *args)
    finally:
        if active:
            self._active = True
        g.scope -= 1
        _SCOPES -= 1


_RECURRENT = {}   # class -> whether its RecurrentCell.forward goes on to _forward
# an imported graph's forward: its graph is traced already, its call a CachedOp's
_SYMBOL_FORWARD = SymbolBlock.forward


def _recurrent_is_hybrid(cls):
    """Whether ``RecurrentCell.forward`` of a ``cls`` instance hands the call to
    ``HybridBlock.forward`` (``_forward``) next: a hybrid Gluon RNN cell."""
    ok = _RECURRENT.get(cls)
    if ok is None:
        ok = _RECURRENT[cls] = getattr(super(RecurrentCell, cls), "forward", None) is _forward
    return ok


def _call(self, *args):
    """``Block.__call__``: a flagged block's outputs in the structure its
    ``hybrid_forward`` returned (``outputs``: namedtuples, Nones)."""
    if self._jb_cfg is None:
        return _mxapi.block_call(self, *args)
    res = _flagged_call(self, args)
    template = self._jb_outs     # (read after the call: its first call traces the block)
    return res if template is None else outputs.rebuild(template, res)


def _flagged_call(self, args):
    """``Block.__call__`` of a flagged block: if user code raises while
    recording, the nodes this call recorded are dropped (and their lazy arrays
    fail loudly when read), so the next minibatch starts clean (in a plain
    loop; inside ``jitbatch.map`` they stay)."""
    g: Graph = current_graph()
    mark = len(g.nodes)
    try:
        if args and not g.executing and not g.passthrough and not self._forward_hooks and \
                not self._forward_pre_hooks:
            # what Block.__call__ -> HybridBlock.forward would do here, minus two
            # Python frames: record the call (None: symbols, run it as usual). A
            # Gluon RNN cell (GRUCell, LSTMCell, ...) goes through
            # RecurrentCell.forward first, which counts the step
            fwd = type(self).forward
            rnn = fwd is not _forward and fwd is recurrent_forward and \
                len(args) == 2 and _recurrent_is_hybrid(type(self))
            if (fwd is _forward or rnn or fwd is _SYMBOL_FORWARD) and self._active and \
                    not np_array_mode():
                if fwd is _forward and len(args) == 2 and isinstance(self, _RNNLayer) and \
                        type(args[0]) is not Symbol:
                    wrapper = stateless(self, args)
                    if wrapper is not None:   # a fused layer in NTC: its states made inside
                        res = record_block(wrapper, g, args[0], (), _getframe(0))
                        return _mxapi.block_call(self, *args) if res is None else res
                res = record_block(self, g, args[0], args[1:], _getframe(0))  # pylint: disable=protected-access
                if res is not None:
                    if rnn:
                        self.__dict__["_counter"] = self._counter + 1
                    return res
        elif g.passthrough and args:
            args = unpinned(args)      # run at once: as a launch would (see unpinned)
        if self._jb_cfg is not None and np_array_mode():
            _traced_in_this_mode(self)
        return _mxapi.block_call(self, *args)
    except Unhybridized as e:
        if e.block is not self:
            raise
        return _mxapi.block_call(self, *args)     # now unhybridized: as per sample
    except BaseException as e:
        # a sample of jitbatch.map shares the graph with the other samples,
        # which record into it while this one waits at a read: the nodes past
        # the mark are not only this call's, so they stay (they ran right)
        if not g.executing and not in_sample() and g.discard_since(mark, e):
            STATS.add(failures=1)
        raise


def _make_hybridize(orig):
    known = set(inspect.signature(orig).parameters)

    def hybridize(self, active=True, *args, **kwargs):
        misspelt_flag(self, kwargs, known)
        ours = {k: kwargs.pop(k) for k in FLAG_KEYS if k in kwargs}
        outer = not getattr(_tls, "inside", False)
        cfg = parse_flags(self, ours) if outer else None
        if outer:
            if cfg is not None and not active:
                raise FlagError("hybridize(active=False, dynamic_batch=True) on %s: dynamic "
                                "batching runs hybridized blocks; pass active=True" % self.name)
            g = current_graph()
            if g.nodes:  # flags change: run what was recorded under the old ones
                execute.run_graph(g, reason="flags changed")
            # new flags: record again before judging; the streak of flushes
            # that found nothing to merge is kept, so if the next one finds
            # nothing again its window is as long as the streak has earned (a
            # flush that merges ends the streak)
            g.passthrough = 0
        if cfg is not None:
            # a flagged block's own CachedOp stays dynamic: MXNet 1.9.1's static
            # one, called again within one recording, gives wrong gradients
            # (docs/design.rst); inference launches get static memory from jitbatch
            kwargs.pop("static_alloc", None)
            kwargs.pop("static_shape", None)
            args = tuple(False if i in (2, 3) else a for i, a in enumerate(args))
        _tls.inside = True
        try:
            orig(self, active, *args, **kwargs)
        finally:
            if outer:
                _tls.inside = False
        if outer:
            def setcfg(b):
                if cfg is not None and isinstance(b, _mxapi.STATEFUL_CELLS):
                    # run unhybridized, as per sample: their own operators are
                    # recorded one by one (they merge), their cells flagged
                    b._jb_cfg = None
                    b._active = False
                    return
                b._jb_cfg = cfg
                if cfg is not None and not isinstance(b, HybridBlock):
                    params.watch_params(b)     # its forward may pass them to operators
                # hybridize(clear=False) on a block never cleared left it without
                # a token: its calls' keys would name it by id() alone
                if cfg is not None and isinstance(b, HybridBlock) and b._jb_token is None:
                    renew_token(b)
            self.apply(setcfg)
    hybridize.__doc__ = orig.__doc__
    hybridize.__wrapped__ = orig
    return hybridize


def _clear(self):
    _mxapi.clear_cached_op(self)
    self.__dict__.pop("_jb_fast", None)      # its merged graph (rewrite.rewrite_traced)
    self.__dict__.pop("_jb_fast_op", None)
    renew_token(self)  # new structure: old signatures no longer apply


# MXNet's tracing of a block uses the block's own name scope: two threads
# tracing one block at once (DataLoader workers, or threads whose first
# calls meet) fail in it, and jitbatch traces more often than MXNet
_TRACING = threading.RLock()


def _trace_asking_mode(block, args):
    """MXNet's tracing of ``block`` with ``autograd.is_training`` and
    ``is_recording`` watched (what a ``hybrid_forward`` branching on the mode
    calls, through the module): the name of the first one it asked, or None.
    Under ``_TRACING``."""
    asked = []

    def watched(name, fn):
        def ask():
            asked.append(name)
            return fn()
        return ask
    saved = [(name, getattr(_autograd, name)) for name in ("is_training", "is_recording")]
    for name, fn in saved:
        setattr(_autograd, name, watched(name, fn))
    try:
        _mxapi.get_graph(block, *args)
    finally:
        for name, fn in saved:
            setattr(_autograd, name, fn)
    return asked[0] if asked else None


def _traced_in_this_mode(block):
    """Drop a flagged block's traced graph if it was traced in the other mode
    of MXNet's NumPy interface (its outputs would be of the other array type;
    per sample each call traces nothing)."""
    if getattr(block, "_cached_graph", None) and \
            block.__dict__.get("_jb_np", False) != np_array_mode():
        _clear(block)


def _get_graph(self, *args):
    """MXNet's tracing, then, for a ``dynamic_batch`` block, the graph rewrites
    of :mod:`.rewrite` (once, when the graph is traced: launches run the
    rewritten graph, calls no launch merges the block's own); one thread at a
    time. A flagged block whose tracing asks the autograd mode, or whose
    graph makes sparse storage, is left unhybridized (``Unhybridized``)."""
    with _TRACING:
        if self._jb_cfg is not None:
            _traced_in_this_mode(self)
        fresh = not self._cached_graph  # pylint: disable=protected-access
        if fresh and self._jb_cfg is not None:
            self.__dict__["_jb_np"] = np_array_mode()
            box = []
            self.__dict__["_jb_outs"] = outputs.traced(
                self, lambda: box.append(_trace_asking_mode(self, args)))
            asked = box[0]
            traced = self._cached_graph[1]  # pylint: disable=protected-access
            why = ("its hybrid_forward asks autograd.%s(), so a traced graph would keep "
                   "the answer of its first call (plain hybridize() does)" % asked) if asked \
                else contract.makes_sparse(traced) or contract.writes_state(traced)
            if why:
                _mxapi.clear_cached_op(self)
                self.__dict__.pop("_jb_outs", None)    # unhybridized: as written
                self._jb_cfg = None
                self._active = False
                warnings.warn(
                    "block %s: %s; it runs unhybridized instead: exact in every mode, its "
                    "operators recorded one by one (they still merge). Fix, to batch it as "
                    "one block: %s." % (self.name, why, "pass the mode in as an input "
                                        "array, or compute both branches and pick with "
                                        "F.where" if asked else "make the sparse storage "
                                        "outside the block, from its dense output"
                                        if "sparse" in why else "keep the state outside the "
                                        "graph, as an input and an output of the block"),
                    ContractWarning, stacklevel=2)
                raise Unhybridized(self)
            res = self._cached_graph  # pylint: disable=protected-access
            guards.note_traced(self)
        else:
            res = _mxapi.get_graph(self, *args)
        if fresh and self._jb_cfg is not None:
            counts = rewrite.rewrite_traced(self, rewrite.float32_only(self, args))
            if any(counts.values()):
                STATS.add(**counts)
                res = self._cached_graph  # pylint: disable=protected-access
    return res


# -- install / uninstall --------------------------------------------------------------
def _set(owner, name, value):
    _patches.append((owner, name, owner.__dict__.get(name, _MISSING), value))
    setattr(owner, name, value)


def install():
    """Install the hooks (idempotent)."""
    if _patches:
        return
    _set(Block, "_jb_cfg", None)
    _set(Block, "_jb_outs", None)
    _set(Block, "__call__", _call)
    _set(HybridBlock, "_jb_token", None)
    _set(HybridBlock, "_jb_pad", None)
    _set(HybridBlock, "_jb_fast", None)
    _set(HybridBlock, "_jb_pad_names", None)
    _set(HybridBlock, "forward", _forward)
    _set(HybridBlock, "_clear_cached_op", _clear)
    _set(HybridBlock, "_get_graph", _get_graph)
    _set(Block, "hybridize", _make_hybridize(_mxapi.block_hybridize))
    _set(HybridBlock, "hybridize", _make_hybridize(_mxapi.hybrid_hybridize))
    _set(register, "_imperative_invoke", _invoke)
    _set(register, "_verify_all_legacy_ndarrays", _verify_legacy)
    _set(NDArray, "__setitem__", setitem)
    for name, method in arith.methods(_invoke).items():
        _set(LazyArray, name, method)
    _set(NDArray, "copyto", _copyto)
    _set(NDArray, "_advanced_index_to_array", staticmethod(_index_array))
    _set(Parameter, "initialize", guards.make_initialize(Parameter.initialize))
    _set(Parameter, "reset_ctx", guards.make_replacing(Parameter.reset_ctx))
    _set(Block, "register_child", guards.make_register_child(Block.register_child))
    _set(Parameter, "cast", params.noting(guards.make_replacing(Parameter.cast)))
    _set(Parameter, "_init_impl", params.noting(Parameter._init_impl))
    _set(HybridBlock, "export", guards.pending_first(HybridBlock.export, "export"))
    for name in ("row_sparse_data", "list_row_sparse_data"):
        _set(Parameter, name, guards.pending_first(getattr(Parameter, name), "write"))
    for name in ("step", "update"):
        _set(Trainer, name, guards.make_trainer_update(getattr(Trainer, name)))
    _set(_autograd, "grad", guards.make_grad(_autograd.grad))
    _set(_autograd, "get_symbol", guards.make_get_symbol(_autograd.get_symbol))
    _set(HybridBlock, "__getstate__", guards.getstate)
    _set(_mxrandom, "seed", guards.pending_first(_mxrandom.seed, "seed"))
    _set(NDArray, "attach_grad", guards.make_attach_grad(NDArray.attach_grad))
    # a backward writes the gradient buffers in place: calls pending since
    # before it read them as they were (a lazy head's backward runs them anyway)
    _set(NDArray, "backward", guards.make_backward(NDArray.backward, guards.ndarray_heads))
    _set(_autograd, "backward", guards.make_backward(_autograd.backward, guards.autograd_heads))
    for name, written in (("pull", guards.kv_out), ("row_sparse_pull", guards.kv_out),
                          ("pushpull", guards.kv_pushpull_out)):
        _set(KVStore, name, guards.make_kv_write(getattr(KVStore, name), written))
    find_mutating()
    # the autograd state is kept per thread between records (see modes): every
    # Python path that changes it goes through these module functions
    forget_mode()
    for owner, names in _mxapi.AUTOGRAD_SETTERS:
        for name in names:
            _set(owner, name, drops_mode(getattr(owner, name)))
    for name in ("_zeros", "_ones"):    # (unless wrapped already: amp.init)
        orig = getattr(_ndmod._internal, name)
        if _mxapi.generated(orig):
            _set(_ndmod._internal, name, fill_shim(orig, _mxapi.op_handle(name)))
    for name, orig, ours in (("stack", _mxapi.nd_stack, _stack),
                             ("waitall", _mxapi.waitall, guards.waitall),
                             ("array", _mxapi.nd_array, _array),
                             ("to_dlpack_for_write", _mxapi.to_dlpack_for_write,
                              guards.make_dlpack_for_write(_mxapi.to_dlpack_for_write))):
        shim = wraps(orig)(ours)
        for mod in (_ndmod, _ndmod.op, _ndmod.ndarray, _ndmod.utils):
            if getattr(mod, name, None) is orig:
                _set(mod, name, shim)


def uninstall():
    """Flush this thread's graph and restore MXNet exactly as it was."""
    if not _patches:
        return
    g = current_graph()
    if g.nodes:
        execute.run_graph(g, reason="uninstall")
    g.release()
    _mxapi.release_hosts()
    g.kept_before = []
    while _patches:
        owner, name, orig, ours = _patches.pop()
        if owner.__dict__.get(name, _MISSING) is not ours:
            # wrapped since by another library (amp.init wraps MXNet's operator
            # functions): putting back MXNet's would drop its wrapper, so ours
            # stays inside it (with nothing pending it hands every call on)
            continue
        if orig is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, orig)
    forget_mode()
    signatures.forget()
    meta.forget()
