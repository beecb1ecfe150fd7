"""Guards on MXNet's functions that change what pending calls read, or look
at what they recorded: this thread's pending calls run first (a parameter
re-initialised, moved or cast, a child block added or replaced, an export,
a seed, ``waitall``, a backward or ``autograd.grad`` of a concrete loss, a
block's deferred parameters made at its first trace (``finish_deferred``),
``attach_grad`` of an array they read, a kvstore pull into arrays they
read), or the call is said in jitbatch's terms (a gradient of
a gradient through launches, ``get_symbol`` of a merged output); pickling a
flagged block leaves out MXNet's CachedOp. Installed by :mod:`.patch`."""
import weakref
from functools import wraps

from mxnet.base import MXNetError

from .. import execute, gcdefer
from ..errors import BatchingError, first_line
from ..graph import Graph, Node, current_graph
from . import _mxapi, history
from .executors import BlockExec
from .interleave import check_step, in_sample, keeping_others, note_attached
from .lazy import LazyArray, NotDifferentiableError, node_of
from .writes import before_write, note_exported, refuse_if_read_elsewhere, run_parked


def run_pending(reason):
    """Run this thread's pending graph, if any (and not running already)."""
    g: Graph = current_graph()
    if g.nodes and not g.executing:
        execute.run_graph(g, reason=reason)


def pending_first(orig, reason):
    """``orig`` with this thread's pending calls run first (``reason``, for the
    stats), where per sample they ran before it: ``HybridBlock.export`` (MXNet
    saves the parameters its CachedOp was built with, which a block whose calls
    pend has not built yet), ``mx.random.seed`` (the pending draws are made
    from the generator's state before the seed, as per sample each at its
    call: a seed before each sample gives each the same Dropout mask),
    ``Parameter.row_sparse_data`` / ``list_row_sparse_data`` (the kvstore pulls
    the rows into the parameter's one array through its C API, which no write
    hook sees: the pending calls read the rows pulled for them)."""
    @wraps(orig)
    def first(*args, **kwargs):
        run_pending(reason)
        return orig(*args, **kwargs)
    return first


def finish_deferred(block, args, out):
    """Initialize the block's parameters that wait for their shapes (Gluon's
    deferred initialization: no ``in_units``) at its first call, as plain Gluon
    does, in the order its graph reads them: left to the first launch, their
    initializers drew from the random stream at the flush, and a
    ``load_parameters`` or ``initialize(force_reinit=True)`` between the two
    was overwritten by the launch."""
    waiting = [p for p in block.collect_params().values()
               if p._deferred_init]  # pylint: disable=protected-access
    if not waiting:
        return
    g = current_graph()
    if g.nodes and not g.executing:
        # the initializers' writes would run the pending calls first anyway;
        # under jitbatch.map a park inside the initialization let the next
        # sample trace this block with its parameters half made
        if g.sharing is not None:
            g.sharing.run_here("write")
        else:
            execute.run_graph(g, reason="write")
    block._deferred_infer_shape(*args)  # pylint: disable=protected-access
    order = {name: i for i, name in enumerate(out.list_inputs())}
    waiting.sort(key=lambda p: order.get(p.name, len(order)))

    for p in waiting:
        if p._deferred_init:  # pylint: disable=protected-access
            p._finish_deferred_init()  # pylint: disable=protected-access


def make_initialize(orig):
    """``Parameter.initialize``: with ``force_reinit`` MXNet drops the arrays
    before the initializer writes new ones, so this thread's pending calls,
    which may read them, run first (as a write to them runs them)."""
    @wraps(orig)
    def initialize(self, *args, **kwargs):
        force = kwargs.get("force_reinit", args[3] if len(args) > 3 else False)
        if force and self._data is not None:  # pylint: disable=protected-access
            before_write(self._data[0])       # pylint: disable=protected-access
            run_pending("write")
        return orig(self, *args, **kwargs)
    return initialize


def make_backward(orig, heads_of):
    """``NDArray.backward`` / ``autograd.backward`` of concrete heads: the
    backward writes gradient buffers in place, so this thread's pending calls,
    which per sample ran before it, run first (a sample of ``jitbatch.map``
    parks as at a read, so the flush serves every parked sample). A lazy
    head's backward runs them anyway, through its read (``heads_of``: the
    heads of a call's arguments)."""
    @wraps(orig)
    def backward(*args, **kwargs):
        heads = heads_of(args, kwargs)
        retain = kwargs.get("retain_graph", args[2] if len(args) > 2 else False)
        history.refuse_written(heads)
        watched = None if retain else history.watch(heads)
        kept = history.keep_unreached(heads)
        stopped = history.stopped_params(heads)
        history.run_apart(heads, watched, not retain)
        before_backward(heads)
        res = None
        try:
            res = keeping_others(heads, lambda: _pushing(orig, args, kwargs))
        except MXNetError as e:
            if stopped and len(heads) == 1 and "not in a computational graph" in str(e):
                # per sample only stops lead from the head to recorded calls:
                # MXNet's backward writes zeros, as zero_stopped does
                pass
            elif "any container is empty" not in str(e) or "AGInfo" not in str(e):
                raise
            else:
                history.freed(e)
        finally:
            history.put_back(kept, not retain)
        history.zero_stopped(stopped)
        history.after(watched)
        return res
    return backward


def _pushing(orig, args, kwargs):
    """MXNet's backward, under ``_mxapi.PUSHING`` (it writes gradient buffers
    other threads' backwards write too)."""
    with _mxapi.PUSHING:
        return orig(*args, **kwargs)


def before_backward(heads):
    """A backward from ``heads`` is about to write gradient buffers (and
    BatchNorm's running statistics, which MXNet 1.9.1 updates in the backward
    pass): if a head is concrete, this thread's pending calls run first."""
    for h in heads:
        if type(h) is not LazyArray:
            g: Graph = current_graph()
            if g.nodes and not g.executing:
                run_parked(g, "backward")
            return


def ndarray_heads(args, kwargs):  # pylint: disable=unused-argument
    """The head of ``NDArray.backward(self, ...)``."""
    return args[:1]


def autograd_heads(args, kwargs):
    """The heads of ``autograd.backward(heads, ...)``."""
    heads = args[0] if args else kwargs.get("heads")
    return heads if isinstance(heads, (list, tuple)) else [heads]


def make_kv_write(orig, written):
    """A ``KVStore`` method that writes arrays through MXNet's C API
    (``pull``, ``pushpull``, ``row_sparse_pull``; ``Trainer.allreduce_grads``
    goes through them): the pending calls that read those arrays run first.
    ``written(args, kwargs)``: the arrays it writes (nested lists)."""
    @wraps(orig)
    def kv_write(*args, **kwargs):
        for a in _flat_arrays(written(args, kwargs)):
            before_write(a)
        return orig(*args, **kwargs)
    return kv_write


def _flat_arrays(x):
    if isinstance(x, (list, tuple)):
        for v in x:
            yield from _flat_arrays(v)
    elif x is not None:
        yield x


def kv_out(args, kwargs):
    """``pull(self, key, out=None, ...)`` / ``row_sparse_pull``: ``out``."""
    return kwargs.get("out", args[2] if len(args) > 2 else None)


def kv_pushpull_out(args, kwargs):
    """``pushpull(self, key, value, out=None, ...)``: ``out``, else ``value``
    (written in place)."""
    out = kwargs.get("out", args[3] if len(args) > 3 else None)
    if out is None:
        out = kwargs.get("value", args[2] if len(args) > 2 else None)
    return out


def make_attach_grad(orig):
    """``NDArray.attach_grad``: the pending calls that read the array run first.
    Per sample they ran while it had no gradient buffer (or its old one), so
    autograd wired them to that; run later, they were wired to the new buffer
    (a gradient counted through calls recorded before the array asked for one).
    In a sample of ``jitbatch.map`` the array is noted as that sample's
    (``interleave.note_attached``: a backward in another sample keeps its gradient)."""
    @wraps(orig)
    def attach_grad(self, *args, **kwargs):
        g: Graph = current_graph()
        # (the calls' own arguments only: telling views apart would wait for
        # the array's producer, in a loop that attaches a gradient per sample)
        if g.nodes and g.reads.get(id(self)) is self:
            before_write(self, values=False)
        res = orig(self, *args, **kwargs)
        note_attached(self)
        return res
    return attach_grad


def make_dlpack_for_write(orig):
    """``nd.to_dlpack_for_write``: MXNet waits there for every operation that
    reads the array, and the memory is then the caller's to write, through
    another library no hook sees; per sample the calls made before had read
    it, so the pending calls that read it run first."""
    @wraps(orig)
    def to_dlpack_for_write(data):
        before_write(data)
        res = orig(data)
        note_exported(data)
        return res
    return to_dlpack_for_write


def make_replacing(orig):
    """``Parameter.reset_ctx`` / ``cast``: MXNet replaces the parameter's
    arrays, which recorded calls read at their launch, so this thread's
    pending calls run first (per sample they ran at their call)."""
    @wraps(orig)
    def replacing(self, *args, **kwargs):
        if self._data is not None:   # pylint: disable=protected-access
            run_pending("write")
        return orig(self, *args, **kwargs)
    return replacing


#: block -> the flagged blocks whose traced graphs hold its code (its ancestors)
_TRACED_IN = weakref.WeakKeyDictionary()


def note_traced(block):
    """``block`` (flagged) was traced: its graph holds every descendant's code."""
    def note(d):
        if d is not block:
            _TRACED_IN.setdefault(d, weakref.WeakSet()).add(block)
    block.apply(note)


def make_register_child(orig):
    """``Block.register_child`` (a child added, replaced by assignment, or a
    layer added to a Sequential) of a flagged block: this thread's pending
    calls run first, with the structure they were called with (a launch
    traces the block as it is then); then the flagged ancestors whose traced
    graphs hold the block trace again at their next call, as per sample they
    run the new structure (MXNet clears the block's own graph only)."""
    @wraps(orig)
    def register_child(self, block, name=None):
        if self._jb_cfg is not None:
            run_pending("structure")
        res = orig(self, block, name)
        for up in list(_TRACED_IN.get(self, ())):
            up._clear_cached_op()  # pylint: disable=protected-access
        return res
    return register_child


def make_trainer_update(orig):
    """``Trainer.step`` / ``update``: refused, before any parameter is written,
    while calls of another thread that read them pend (refused at the first
    write, the optimizer had cleared the gradients' fresh flags and advanced
    its update counts: the step done again after the fix was not plain
    Gluon's); this thread's pending calls run first (per sample they ran
    before the step; updated on the kvstore, the parameters are written
    through its C API, which no write hook sees)."""
    @wraps(orig)
    def update(self, *args, **kwargs):
        check_step(self._params)  # pylint: disable=protected-access
        mine = current_graph()
        if any(g is not mine and g.nodes for g in gcdefer.pending()):
            for p in self._params:  # pylint: disable=protected-access
                for a in p._data or ():  # pylint: disable=protected-access
                    refuse_if_read_elsewhere(a, mine)
        run_pending("write")
        with _mxapi.PUSHING:
            return orig(self, *args, **kwargs)
    return update


def _run_unmerged(g):
    """Run graph ``g``'s pending calls one launch each, where a gradient of a
    gradient (``create_graph``) will reach them: a merged launch gathers its
    rows by ``take`` / ``Concat``, whose gradients MXNet 1.9.1 cannot
    differentiate. (In ``jitbatch.map`` the sample parks, and the flush that
    serves the parked samples runs unmerged.)"""
    gr: Graph = g
    if not gr.nodes or gr.executing:
        return
    forced = gr.policy != "sequential"
    if forced:
        kept, gr.policy = gr.policy, "sequential"
    try:
        run_parked(g, "grad")
    finally:
        if forced and gr.policy == "sequential":
            gr.policy = kept


def _blocks_behind(heads):
    """The names of the flagged blocks whose pending calls the lazy ``heads``
    were computed from (the heads' own nodes are often a loss's operators)."""
    names, seen = set(), set()
    todo = [node_of(h) for h in heads if type(h) is LazyArray]
    while todo:
        n = todo.pop()
        if type(n) is not Node or id(n) in seen:
            continue
        seen.add(id(n))
        if type(n.info.op) is BlockExec:
            names.add(n.info.name)
        todo.extend(node_of(x) for x in n.inputs if type(x) is LazyArray)
    return sorted(names)


def make_get_symbol(orig):
    """``autograd.get_symbol``: refused, with the fix, for a lazy array: what
    autograd recorded for it is the merged launch of every sample sharing it
    (their inputs its arguments), not this sample's program."""
    @wraps(orig)
    def get_symbol(x):
        if type(x) is LazyArray:
            raise BatchingError(
                "autograd.get_symbol(x): x is an output of dynamic batching, and what autograd "
                "recorded for it is the merged launch of every sample that shared it (their "
                "inputs are its arguments), not this sample's program. Fix: for one sample's "
                "symbol, call the network with hybridize(dynamic_batch=False) (or unhybridized) "
                "for that sample; to save the model, net.export(path).")
        return orig(x)
    return get_symbol


def getstate(self):
    """``pickle`` / ``copy.deepcopy`` of a flagged block: without MXNet's
    CachedOp, a C handle that cannot be copied (plain hybridize() fails
    there); the copy builds its own at its first call."""
    state = self.__dict__.copy()
    if self._jb_cfg is not None and state.get("_cached_op") is not None:
        state["_cached_op"] = None
    state.pop("_jb_fast_op", None)      # a CachedOp too (rewrite.merged_op)
    return state


def make_grad(orig):
    """``autograd.grad``: MXNet's refusal of ``create_graph=True`` through a
    CachedOp (every flagged block's launch is one) said in jitbatch's terms,
    with the blocks and the fix; an ``MXNetError`` still."""
    @wraps(orig)
    def grad(heads, variables, head_grads=None, retain_graph=None, create_graph=False,
             train_mode=True):
        if not retain_graph and not create_graph and in_sample():
            # a sample of jitbatch.map: its launches are shared with the other
            # samples, whose gradients come next
            retain_graph = True
        names = ()
        listed = heads if isinstance(heads, (list, tuple)) else [heads]
        history.refuse_written(listed)
        if create_graph:      # the heads' blocks, while their nodes are pending
            names = _blocks_behind(listed)
            _run_unmerged(current_graph())
        else:
            history.run_apart(listed, None, False)
        before_backward(listed)
        try:
            with _mxapi.PUSHING:
                return orig(heads, variables, head_grads, retain_graph, create_graph,
                            train_mode)
        except MXNetError as e:
            if create_graph and "is non-differentiable" in str(e):
                raise NotDifferentiableError(
                    "autograd.grad(..., create_graph=True) reached a launch that merged "
                    "calls: its rows were gathered by take / Concat, whose gradients MXNet "
                    "1.9.1 cannot differentiate (%s). The calls pending at this "
                    "autograd.grad run one launch each; these ran merged before it (a read "
                    "or a flush ran them). Fix: call autograd.grad before reading values "
                    "on the penalty's path, or flag these blocks with policy='sequential'."
                    % first_line(e)) from e
            if not create_graph and "not in a computational graph" in str(e):
                raise NotDifferentiableError(
                    "autograd.grad of heads whose launches an earlier autograd.grad or "
                    "backward() freed: samples merged into one launch share it, and without "
                    "retain_graph the first call frees it for all of them (%s). Fix: "
                    "retain_graph=True on every call but the last, or one call of the summed "
                    "heads." % first_line(e)) from e
            if not create_graph or "higher order gradients" not in str(e):
                raise
            raise NotDifferentiableError(
                "autograd.grad(..., create_graph=True) reached the launches of flagged "
                "block(s) %s: they run as hybridized graphs (CachedOps), which MXNet 1.9.1 "
                "differentiates once only (plain hybridize() refuses alike). Fix: for a "
                "gradient of a gradient (a gradient penalty), call these blocks with "
                "hybridize(active=False)." % (", ".join(names) or "on its path")) from e
        finally:
            if not retain_graph and not create_graph:     # MXNet's default: frees the graph
                history.put_back(None, True)
    return grad


def waitall():
    """``nd.waitall``: what is pending in this thread's graph runs first, so a
    timing around it includes the work."""
    run_pending("waitall")
    return _mxapi.waitall()
