"""Executors: what runs one batch of a signature's nodes (``SigInfo.op``).

``BlockExec`` runs a block signature's batch as ONE call of the block's
CachedOp on gathered inputs; ``OpExec`` an operator signature's by its
batching rule (``rules``), or node by node where it has none. Both offer
what ``gather.prepare`` and ``backend`` read: ``ctx``, ``in_meta`` (per
argument its per-sample ``(shape, dtype)``), ``out_meta``, ``pad`` (zero-padded
arguments: ``{argument: axis}`` or None), ``rounds`` (launch sizes may be
rounded up: ``config.row_buckets``), ``stages`` (the input-stage plan:
None until looked for, False where there is none) and ``launch(batch)``."""
import threading
import weakref

import numpy as np
from mxnet import autograd
from mxnet.base import MXNetError
from mxnet.context import Context
from mxnet import ndarray as nd
from mxnet.gluon.block import _flatten, _regroup

from ..errors import BatchingError
from . import _mxapi, gather, opkeys, rules
from .axis_rules import RANDOM
from .layout import finish, flat_shape
from .lazy import LazyArray, row_value
from .meta import HOST_MEMORY, compute_context
from .params import watch_params
from .rewrite import graph_op, merged_graph, merged_op


#: MXNet's CachedOp is not safe to build or call from two threads at once (a
#: second thread's call can find its graph's shapes half set: "Graph attr
#: dependency shape is required by pass MXPlanMemory"); threads that flush
#: their own graphs at once (DataLoader workers), and eager calls (patch),
#: take turns at it
CACHED_OPS = threading.RLock()


class BlockExec(object):
    """Runs the nodes of one block signature as one call of the block's CachedOp.
    The block is held weakly where ``weak``: signatures outlive their blocks in
    bounded tables, which must not keep users' models alive (the graph holds
    the blocks of its pending calls: ``record``)."""
    __slots__ = ("_block", "fmt", "in_meta", "out_meta", "ctx", "mode", "checked", "pad",
                 "stages", "merges", "why", "_static", "_static_of", "cut", "unused")
    rounds = True   # launch sizes rounded up (config.row_buckets, gather.prepare)
    gathers = True  # its inputs are gathered (gather.prepare)
    variadic = False  # its calls have the signature's inputs (OpExec: a sum's may not)
    shared = ()     # no weight passed as is (OpExec: rules.shared_rule)

    def __init__(self, block, fmt, in_meta, out_meta, ctx, mode, pad=None, merges=True,
                 weak=True):
        self._block = weakref.ref(block, self._dropped) if weak else (lambda: block)
        self.merges = merges  # False: its graph mixes samples (contract), one call each
        self.why = None       # where it does not merge: the ContractWarning's text
        self.fmt, self.in_meta, self.out_meta, self.ctx, self.mode = \
            fmt, in_meta, out_meta, ctx, mode
        self.checked = False
        self.pad = pad      # {argument: axis} zero-padded to the batch's largest size
        self.stages = None  # its input-stage plan: None until looked for, False: none
        self._static = None     # its StaticOps: launch shapes -> CachedOps with static memory
        self._static_of = None  # the block's own CachedOp those were made beside
        # inputs: detached where recorded (gradients.reached_variables: the
        # signature's SigInfo.stops), not read by its graph
        self.cut, self.unused = (), ()

    @property
    def block(self):
        """The block (None once it was freed)."""
        return self._block()

    def _dropped(self, _):
        # the block is freed: its static CachedOps and their buffers go with it
        # (the signature may stay in the table for thousands more)
        self._static = self._static_of = None

    def launch(self, batch):
        if not self.merges:
            self._each(batch)
            return
        n = batch[0].group.size     # with filler samples (config.row_buckets)
        block = self.block
        with self.ctx, _mxapi.mode_scope(self.mode):
            ins = unpinned(gather.gather_batch(batch))
            if self.mode[0]:
                ins = detached(ins, self.cut)
            # launches run the merged graph, where the block's own differs
            # (rewrite.rewrite_traced; with an op hook, MXNet's call of its own)
            fast = block._jb_fast is not None  # pylint: disable=protected-access
            with CACHED_OPS:
                if fast and block._cached_op is None and not block._callback:  # pylint: disable=protected-access
                    block._build_cache()  # pylint: disable=protected-access
                if block._cached_op is None or block._callback:  # pylint: disable=protected-access
                    op = None
                elif self.mode[0]:
                    # not while recording: MXNet's static CachedOp, called again in
                    # one recording, can differentiate wrongly (docs/design.rst)
                    op = merged_op(block) if fast else None
                else:
                    op = self._static_op(block, ins)
                    if op is None and fast:
                        op = merged_op(block)
                if op is None:
                    it = iter(ins)
                    flat = [None if f == -1 else next(it) for f in _format_leaves(self.fmt)]
                    out = block._call_cached_op(*_regroup(flat, self.fmt))  # pylint: disable=protected-access
                    outs, _ = _flatten(out, "output")
                else:
                    out = op(*[ins[i] if is_arg else i.data()     # i: an index or a Parameter
                                for is_arg, i in block._cached_op_args])  # pylint: disable=protected-access
                    outs = out if isinstance(out, list) else [out]
        if not self.checked:
            watch_params(self.block)     # initialized by now, if deferred before
            for o, m in zip(outs, self.out_meta):
                want = flat_shape(m[0], n) if m[0][0] is not None else \
                    (batch[0].group.rows,) + tuple(m[0][1:])
                if o.shape != want:
                    raise BatchingError(
                        "block %s gave an output of shape %s for %d merged samples of "
                        "per-sample output shape %s" % (self.block.name, o.shape, n, m[0]))
            self.checked = True
        finish(batch, outs)

    def _static_op(self, block, ins):
        """A CachedOp of ``block``'s merged graph (``rewrite.merged_graph``)
        with MXNet's static memory and shapes
        for inference launches with these input shapes: MXNet's dynamic
        CachedOp allocates every intermediate array on every call (and frees
        it, one engine operation each) and plans shapes and memory each time;
        a static one keeps its buffers and reuses them (the engine orders the
        launches that share them) and returns outputs of their own. Not for
        recording launches: called again within one recording, MXNet 1.9.1's
        static CachedOp gave wrong gradients (docs/design.rst, Known limits).
        None where the shape has none (yet): the dynamic CachedOp runs it
        (``StaticOps`` says which shapes get one). Made beside the block's own
        CachedOp and dropped with it."""
        base = block._cached_op  # pylint: disable=protected-access
        cache = self._static
        if self._static_of is not base:
            cache = self._static = StaticOps()
            self._static_of = base
        entry = cache.use(tuple([_mxapi.concrete_shape(x) for x in ins]))
        if entry is None:
            return None
        if entry[0] is not None:
            return entry[0]
        op = entry[0] = graph_op(block, merged_graph(block), static=True)
        return op

    def _each(self, batch):
        """One call of the block's CachedOp per node, on the node's own inputs."""
        leaves = _format_leaves(self.fmt)
        with self.ctx, _mxapi.mode_scope(self.mode):
            for node in batch:
                ins = unpinned([row_value(x) if type(x) is LazyArray else x
                                for x in node.inputs])
                if self.mode[0]:
                    ins = detached(ins, self.cut)
                it = iter(ins)
                args = _regroup([None if f == -1 else next(it) for f in leaves], self.fmt)
                with CACHED_OPS:
                    res = self.block._call_cached_op(*args)  # pylint: disable=protected-access
                outs, _ = _flatten(res, "output")
                finish([node], outs)


def detached(args, cut):
    """``args`` with those at the positions in ``cut`` detached: MXNet 1.9.1
    sends them zeros (``broadcast_like``'s shape source) and crashes on
    gathered or sliced rows (``gradients.reached_variables``)."""
    return [x.detach() if k in cut else x for k, x in enumerate(args)] if cut else args


_HOST_MEMORY = frozenset(Context.devstr2type[t] for t in HOST_MEMORY)


def unpinned(arrays):
    """``arrays``, those in pinned or shared memory copied to the CPU: a
    CachedOp refuses inputs on another device than its parameters' (plain
    hybridize() too), where per-sample operators read such memory as the
    CPU's (one check per input of a launch)."""
    for a in arrays:
        m = _mxapi.concrete_meta(a)
        if m is not None and m[2][0] in _HOST_MEMORY:
            return [x.as_in_context(compute_context(x.context)) if isinstance(x, nd.NDArray)
                    else x for x in arrays]
    return arrays


class StaticOps(object):
    """Which launch shapes of one block signature run a static CachedOp
    (``BlockExec._static_op``). Each holds its intermediate buffers, so at
    most ``STATIC_SHAPES`` do; a shape gets one on its ``STATIC_AFTER + 1``-th
    launch (one seen once may not recur: making one and its first call cost
    about four calls of the dynamic one). Where all are taken, the shape
    replaces the least used one only if it was launched twice as often: launch
    sizes cycle (a sequence model's steps run every size up to the minibatch),
    and where more sizes cycle than fit, replacing the least recently used
    would remake one on nearly every launch. Use counts are halved every
    ``AGE_EVERY`` launches, so shapes a workload stopped using give way."""
    __slots__ = ("ops", "seen", "launches")

    def __init__(self):
        self.ops = {}       # input shapes -> [CachedOp, launches (aged)]
        self.seen = {}      # input shapes without one -> launches (aged)
        self.launches = 0   # launches since the last ageing

    def use(self, key):
        """A launch of shapes ``key``: its entry ``[CachedOp, launches]``, or
        None where the shape runs the dynamic CachedOp; an entry whose op is
        None was admitted now, for the caller to fill."""
        self.launches += 1
        entry = self.ops.get(key)
        if entry is not None:
            entry[1] += 1
            return entry
        return self._admit(key)

    def _admit(self, key):
        """The new entry of launch shapes ``key`` (without one), or None."""
        if self.launches >= AGE_EVERY or len(self.seen) >= 4 * STATIC_SHAPES:
            self._age()
        n = self.seen.get(key, 0) + 1
        self.seen[key] = n
        if n <= STATIC_AFTER:
            return None
        ops = self.ops
        if len(ops) >= STATIC_SHAPES:
            least = min(ops, key=lambda k: ops[k][1])
            if 2 * ops[least][1] >= n:    # a clear lead: ties would swap back and forth
                return None
            del ops[least]
        del self.seen[key]
        entry = ops[key] = [None, n]
        return entry

    def _age(self):
        self.launches = 0
        for entry in self.ops.values():
            entry[1] //= 2
        self.seen = {k: n // 2 for k, n in self.seen.items() if n > 1}


#: launch shapes per block signature that keep a static CachedOp (each holds its
#: intermediate buffers; launch sizes are rounded, config.row_buckets, so few recur)
STATIC_SHAPES = 64
#: launches of a shape that run the dynamic CachedOp before a static one is made
STATIC_AFTER = 2
#: launches after which StaticOps halves its counts (at the next shape without one)
AGE_EVERY = 1024


def _format_leaves(fmt):
    """The leaves of a block's argument format (-1: an argument passed as None)."""
    if isinstance(fmt, int):
        if fmt > 0:
            raise BatchingError("symbol inputs are not supported")
        return [fmt]
    res = []
    for f in fmt:
        res.extend(_format_leaves(f))
    return res


class OpExec(object):
    """Runs the nodes of one operator signature by its batching rule ``rule``
    (``rules.rule_for``; None: one call per node)."""
    __slots__ = ("handle", "name", "kind", "keys", "vals", "bkeys", "bvals", "pads",
                 "in_meta", "out_meta", "ctx", "mode", "checked", "variadic", "lift", "cut", "shared")
    pad = None      # no zero-padded arguments (see jitbatch.zero_pad)
    stages = False  # no input stage (see stages.py)
    rounds = False  # launch sizes exact (config.row_buckets: block launches only)
    gathers = True

    def __init__(self, handle, name, rule, keys, vals, in_meta, out_meta, ctx, mode,
                 variadic=False, lift=None):
        self.handle = handle
        self.name = name
        self.kind = rule[0] if rule else None
        self.keys, self.vals = list(keys), list(vals)
        self.bkeys, self.bvals = (list(rule[1]), list(rule[2])) if rule else (None, None)
        self.pads = rule[3] if rule else None
        self.in_meta = in_meta
        self.out_meta = out_meta
        self.ctx = ctx
        self.mode = mode
        self.checked = False
        # a sum of any number of inputs (opkeys.left_out): its calls
        # differ in arity, the batch's shorter ones padded (gather.prepare)
        self.variadic = variadic
        # a scalar operator whose nodes hold their own scalars (Node.lifted):
        # (the broadcasting operator's handle, scalar first), see opkeys._LIFTS
        self.lift = lift
        self.cut = ()       # inputs it passes no gradient to, detached where recorded
        self.shared = ()    # weight inputs every node passes (rules.shared_rule): as they are

    def _lifted(self, batch, x, n):
        """The launch of a scalar operator whose nodes differ in their scalars:
        its broadcasting twin on the samples' flat data as ``(n, size)`` rows
        and the column of their scalars (one host array: one copy)."""
        if n == 1:
            return _mxapi.run_op(self.handle, [x], self.keys, [batch[0].lifted])
        shape, dtype = self.in_meta[0]
        ragged = shape[0] is None      # (opkeys.ragged_lead): each row gets its node's scalar
        size = 1
        for d in (shape[1:] if ragged else shape):
            size *= d
        col = np.array([node.lifted for node in batch], dtype=np.float64)
        if ragged:
            col = np.repeat(col, [node.rows for node in batch])
        m = len(col)
        if np.dtype(dtype).itemsize < 4:
            # MXNet makes a half-precision scalar through float32 (half_t(float)):
            # rounded straight from the double, a number near a half-precision
            # midpoint came out one unit apart
            col = col.astype(np.float32)
        col = col.astype(dtype).reshape((m, 1))
        col = _mxapi.host_array(col, self.ctx, dtype)
        rows = _mxapi.reshape(x, (m, size))
        handle, first = self.lift
        out = _mxapi.run_op(handle, [col, rows] if first else [rows, col], [], [])[0]
        return [_mxapi.reshape(out, (m,) + tuple(self.out_meta[0][0][1:]) if ragged else
                               flat_shape(self.out_meta[0][0], n))]

    def _vals(self, count):
        """The call's attribute values for ``count`` inputs (a variadic sum's)."""
        return [str(count) if k == "num_args" else v for k, v in zip(self.keys, self.vals)]

    def launch(self, batch):
        n = len(batch)
        with self.ctx, _mxapi.mode_scope(self.mode):
            if self.lift is not None:
                outs = self._lifted(batch, gather.gather_batch(batch)[0], n)
            elif self.kind is None:
                for node in batch:
                    args = [row_value(x) if type(x) is LazyArray else x for x in node.inputs]
                    if self.mode[0]:
                        args = detached(args, self.cut)
                    outs = _mxapi.run_op(self.handle, args, self.keys,
                                         self._vals(len(args)) if self.variadic else self.vals)
                    node.row = 0
                    node.group.size = 1
                    finish([node], outs)
                return
            else:
                ins = gather.gather_batch(batch)
                outs = self._batched(detached(ins, self.cut) if self.mode[0] else ins, n)
            if not self.checked and n > 1:
                for o, m in zip(outs, self.out_meta):
                    if o.shape != (flat_shape(m[0], n) if m[0][0] is not None else
                                   (batch[0].group.rows,) + tuple(m[0][1:])):
                        raise AssertionError(
                            "jitbatch bug: batching rule %s of %s gave shape %s for %d samples "
                            "of per-sample shape %s" % (self.kind, self.name, o.shape, n, m[0]))
                self.checked = True
        finish(batch, outs)

    def _batched(self, ins, n):
        """The launch by the operator's batching rule on the gathered inputs."""
        if n == 1 or self.kind == "elemwise":
            # one sample's flat layout is its own shape: the call as recorded
            return _mxapi.run_op(self.handle, ins, self.keys,
                                 self._vals(len(ins)) if self.variadic else self.vals)
        if self.kind == "reshape":
            return [nd.reshape(ins[0], shape=flat_shape(self.out_meta[0][0], n))]
        ins = [x.reshape((n,) + pad) for x, pad in zip(ins, self.pads)]
        handle = self.handle if self.kind != "batch_dot" else _mxapi.op_handle("batch_dot")
        outs = _mxapi.run_op(handle, ins, self.bkeys, self.bvals)
        return [o.reshape(flat_shape(m[0], n)) for o, m in zip(outs, self.out_meta)]


def ragged_exec(ex, lead, out_meta):
    """For operator executor ``ex``, whose call's arguments share leading length
    ``lead``, the executor of its ragged signature (``opkeys.ragged_lead``)
    and that signature's output metas: where it maps rows to rows, ``ex``'s
    operator on the samples' rows as recorded; where it reduces each sample's
    rows, a ``SegmentExec``. None where neither holds."""
    ones = opkeys.single_rows(ex.in_meta, lead)
    if ones and not rules.broadcasts(ex.name):
        return None     # only a broadcast pairs a sample's single rows with its rows
    if opkeys.rowwise(ex, lead, out_meta):
        out_meta = opkeys.unled(out_meta, lead)
        made = (RowRepeatExec if ones else OpExec)(
            ex.handle, ex.name, ("elemwise", ex.keys, ex.vals, None), ex.keys, ex.vals,
            opkeys.unled(ex.in_meta, lead), out_meta, ex.ctx, ex.mode, False, ex.lift)
    else:
        fill = opkeys.segment_fill(ex)
        if fill is None:
            return None
        if ex.name in opkeys.SEGMENT_NORMS:     # outputs: the samples' rows again
            out_meta = opkeys.unled(out_meta, lead)
        made = SegmentExec(ex, fill, lead, out_meta)
    made.cut = ex.cut
    return made, out_meta


class RowRepeatExec(OpExec):
    """A broadcasting operator between each sample's rows and single rows of
    the same sample (``h * q``: ``h`` ``(T, E)``, ``q`` ``(1, E)``), on
    samples of any ``T``: the single rows gathered one per sample are taken
    once per row of their sample, then the operator runs on the samples' rows
    as recorded (a broadcast over a sample's rows is that row repeated)."""
    __slots__ = ()

    def launch(self, batch):
        n = len(batch)
        with self.ctx, _mxapi.mode_scope(self.mode):
            ins = gather.gather_batch(batch)
            if n > 1:
                at = _mxapi.host_array(np.repeat(np.arange(n), [node.rows for node in batch]),
                                       self.ctx, np.int64)
                ins = [_mxapi.take(x, at) if m[0][0] is not None else x
                       for x, m in zip(ins, self.in_meta)]
            outs = _mxapi.run_op(self.handle, ins, self.keys, self.vals)
        finish(batch, outs)


_MEAN_BY = {}   # "sum", "broadcast_div": the handles a mean's segment launch runs


class SegmentExec(OpExec):
    """Runs a reduction over axis 0 of each sample's own rows (``mean(axis=0)``
    of a ``(T, E)`` sequence): the samples' rows gathered one after the other
    are laid out as ``(N, longest, ...)``, the shorter ones padded at the
    front with a value that leaves the reduction's running state as it starts
    (``opkeys.SEGMENT_FILLS``: 0 for sums, 1 for products, -inf / +inf for max /
    min), so that each sample's result is its own as per sample (MXNet
    reduces an axis in order); a mean is a sum divided by the sample's own
    count, as MXNet's mean is. A softmax over axis 0 (``opkeys.SEGMENT_NORMS``)
    is padded with -inf (its exp adds 0 to the sum; the maximum is the
    rows'), and its outputs' real rows are taken back, ragged."""
    __slots__ = ("fill", "pad_row", "per_row")

    def __init__(self, ex, fill, lead, out_meta):
        OpExec.__init__(self, ex.handle, ex.name, ("stacked", ex.bkeys, ex.bvals, ex.pads),
                        ex.keys, ex.vals, opkeys.unled(ex.in_meta, lead), out_meta, ex.ctx,
                        ex.mode)
        self.fill = fill
        self.pad_row = None
        # entries a row adds to a reduced output entry (the other reduced axes' sizes)
        self.per_row = opkeys.reduced_per_row(ex) if ex.name == "mean" else 1

    def launch(self, batch):
        n = len(batch)
        lengths = [node.inputs[0].shape[0] for node in batch]
        longest = max(lengths)
        idx = np.zeros((n, longest), dtype=np.int64)     # 0: the pad row
        at = 1
        for i, t in enumerate(lengths):
            idx[i, longest - t:] = np.arange(at, at + t)
            at += t
        shape, dtype = self.in_meta[0]
        if self.pad_row is None:
            with autograd.pause():      # a constant, whatever the flush's recording state
                self.pad_row = _mxapi.host_array(
                    np.full((1,) + tuple(shape[1:]), self.fill, dtype=dtype), self.ctx, dtype)
        if not _MEAN_BY:
            _MEAN_BY.update(sum=_mxapi.op_handle("sum"), div=_mxapi.op_handle("broadcast_div"))
        with self.ctx, _mxapi.mode_scope(self.mode):
            rows = gather.gather_batch(batch)[0]
            # the pad row through a view of its own: recorded, the view gets the
            # autograd entry, so a backward that frees this launch's graph does
            # not clear the one another recording (a thread's) holds
            padded = _mxapi.take(_mxapi.concat([_mxapi.rows(self.pad_row, 0, 1), rows]),
                                 _mxapi.host_array(idx, self.ctx, np.int64))
            mean = self.name == "mean"
            out = _mxapi.run_op(_MEAN_BY["sum"] if mean else self.handle, [padded], self.bkeys,
                                self.bvals)[0]
            if mean:
                # each sample's count of reduced entries: its rows times the
                # sizes of the other reduced axes (a mean over axes (0, 1))
                col = np.array(lengths, dtype=np.int64) * self.per_row
                col = col.astype(dtype).reshape((n,) + (1,) * (len(out.shape) - 1))
                out = _mxapi.run_op(_MEAN_BY["div"], [out, _mxapi.host_array(col, self.ctx, dtype)],
                                    [], [])[0]
            if self.out_meta[0][0][0] is None:      # a normalisation: rows again
                real = (np.arange(n)[:, None] * longest +
                        np.arange(longest)[None, :])[idx > 0]
                out = _mxapi.take(_mxapi.reshape(out, (n * longest,) + tuple(out.shape[2:])),
                                  _mxapi.host_array(real, self.ctx, np.int64))
            else:
                out = _mxapi.reshape(out, flat_shape(self.out_meta[0][0], n))
        finish(batch, [out])


class CopyExec(OpExec):
    """Runs the nodes of one ``copyto`` / ``as_in_context`` signature (a lazy
    array moved to another device): their rows gathered on the source device,
    ONE copy to the target, each node's rows of it (a copy is elementwise)."""
    __slots__ = ("dst",)

    def __init__(self, meta, src, dst, mode):
        OpExec.__init__(self, None, "copyto", ("elemwise", (), (), None), (), (), (meta,),
                        (meta,), src, mode)
        self.dst = dst

    def launch(self, batch):
        with self.ctx, _mxapi.mode_scope(self.mode):
            out = _mxapi.copyto(gather.gather_batch(batch)[0], self.dst)
        finish(batch, [out])


class ConstExec(object):
    """Makes the arrays a flush's per-sample code created from Python data
    (``nd.array`` while a graph was pending, ``record.record_const``): each
    node holds its values (a NumPy copy); ONE array of all of them is created
    per launch, and each node's array is its rows of it (one host-to-device
    copy, asynchronous, instead of a synchronised copy per call)."""
    __slots__ = ("ctx", "dtype", "in_meta", "out_meta")
    pad = None
    stages = False
    rounds = False
    gathers = False   # nothing to gather: the values are the nodes' own
    source = True     # made from data: no gradient behind it (graph._stops_lazy)

    def __init__(self, ctx, dtype, out_meta):
        self.ctx = ctx
        self.dtype = dtype
        self.in_meta = ()
        self.out_meta = out_meta

    def launch(self, batch):
        values = [node.inputs[0] for node in batch]
        data = values[0] if len(values) == 1 else np.concatenate(values, axis=0)
        finish(batch, [_mxapi.host_array(data, self.ctx, self.dtype)])


#: the random operators' handles (one per operator, whichever alias it is called by)
_RANDOM_HANDLES = frozenset(_mxapi.op_handle(name) for name in RANDOM)


def infer_outputs(handle, metas, keys, vals, ctx, known, second=False):
    """Per-sample output (shape, dtype) list of an operator, found by running it
    once on ``_mxapi.trial`` arrays (zeros; ``second``: ones). A kernel's error (an index out of
    range, arrays whose shapes MXNet's inference let through) raises here, at
    the call: left to the engine, it would stay in an array no one reads and
    reach a later read. ``known``: the shapes MXNet's symbolic inference gives
    (None: none), which a random operator takes where there are some: a trial
    run would take numbers from the generator a seeded program draws from; so
    does a linear-algebra operator where its kernel refuses the trial's zeros."""
    if handle in _RANDOM_HANDLES and known is not None:
        return known
    with ctx, autograd.pause(train_mode=False):
        divides = _mxapi.op_name(handle) in _mxapi.INT_DIVISIONS
        args = [_mxapi.trial(s, ctx, d, second, divides) for s, d in metas]
        out = _mxapi.run_op(handle, args, keys, vals)
        try:
            for o in out:
                o.wait_to_read()
        except MXNetError:
            try:    # MXNet keeps the error for every later wait too: drain it
                _mxapi.waitall()
            except MXNetError:
                pass
            # a linear-algebra kernel refuses zeros (a singular matrix) that
            # the sample's values are not: its shapes from symbolic inference
            if _mxapi.op_name(handle).lstrip("_").startswith("linalg_") and known is not None:
                return known
            raise
    return tuple((o.shape, o.dtype) for o in out)


def op_outputs(handle, name, metas, keys, vals, ctx):
    """``(per-sample output (shape, dtype) list, False)`` of a call of operator
    ``handle`` (registered as ``name``) on arguments of ``metas``; ``(None,
    True)`` where the shapes depend on the arguments' values (a second trial
    run, on ones, gave others than the zeros' run), ``(None, False)`` for a
    custom operator whose own ``infer_shape`` does not give them."""
    known = _mxapi.infer_by_symbol(handle, metas, keys, vals)
    if name == "Custom":
        # a trial run would run the user's Python forward on zeros (a check of
        # its input fails, a side effect sees a call that never was)
        return known, False
    out = infer_outputs(handle, metas, keys, vals, ctx, known)
    # the run on ones only where MXNet's symbolic inference does not give the
    # zeros' shapes: on ones, scatter_nd (which checks no index) wrote past a
    # one-row target and the allocator aborted the process
    if known is None or [s for s, _ in known] != [m[0] for m in out]:
        try:
            ones = infer_outputs(handle, metas, keys, vals, ctx, known, second=True)
        except Exception:  # pylint: disable=broad-except
            ones = out      # (an index of 1 out of range: the zeros' run stands)
        if ones != out:
            return None, True
    return out, False
