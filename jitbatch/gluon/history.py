"""Backwards that reach only some of the pending calls.

Per sample, a backward reaches only the calls its loss was computed from;
another loss's calls keep their recorded graphs and gradient buffers. Merged
into one launch with calls the backward reaches, their rows would take its
gradient (0): a second per-task backward would write zeros into the first
task's head gradients (``grad_req='write'``), and would find their records
freed. So the pending calls a backward's heads reach run as a flush of their
own, the others in a flush after it (``run_apart``): no launch mixes them.

Under ``jitbatch.map`` the flush serves every sample, and samples share
launches: an output left out of one sample's loss keeps its rows in a launch
that loss's ``backward()`` (``retain_graph=False``) freed, and MXNet would
take it as a constant, its share of the gradient silently lost. So a
backward without ``retain_graph`` notes which pending calls its heads reach
(``watch``, before the flush that runs them), and after it marks the others
of the launches it reached (``graph.sever``) where the launch is a block's
with a trained parameter (one over constants only, a frozen block's, has no
record per sample either). A later backward that reaches a marked output
through a call passing it gradient is refused (``refuse``); through
``detach``, ``BlockGrad``, ``argmax`` or a comparison it is a constant anyway.
Not followed by ``watch``: calls computed by an earlier flush (a read, a
pipelined chunk), and values made from a marked output by a reshape or a
concatenation (views and row composites of concrete rows).

Calls a read, a pipelined chunk or an earlier backward's flush ran (the loss
printed before per-task backwards) merged before this backward could split
them: a flush of recorded calls keeps its nodes' inputs
(``execute.keeps_inputs``; ``kept``), and a backward from lazy heads first
finds what of those launches it reaches without reaching it per sample
(``keep_unreached``): the gradient buffers only such calls write (their
blocks' parameters, their attached inputs) are copied before and put back
after it (``put_back``). Where the walk meets what it cannot follow (a node
that let go of its inputs, an input computed outside jitbatch under
autograd, whose history may reach a parameter) nothing is kept: as before.
A backward that reaches a kept call whose input was written in place since
its flush is refused (``refuse_written``; ``kept.note_write``)."""
import json

from mxnet import autograd
from mxnet.base import MXNetError
from mxnet.ndarray import NDArray

from .. import execute
from ..errors import first_line
from ..graph import (STOPS_RECORDED, STOPS_SEEN, Composite, Node, Ref, current_graph,
                     only_sinks, reached_from, sever)
from .gradients import NO_GRADIENT
from .kept import (READ_HEADS, WRITTEN, forget_writes, kept_for_backward, keeps_recorded,
                   read_node, written_in)
from .lazy import DETACHED, LazyArray, NotDifferentiableError, node_of

_MARKED = [0]   # outputs marked so far: until one is, a backward reaching all is not followed


def watch(heads):
    """Before a backward from ``heads`` that frees what it reaches: refuse it
    where it reaches a marked output; ``(the pending nodes, the ids of those
    the heads reach)``, or None where it reaches them all (or no head is
    pending)."""
    g = current_graph()
    pending = g.nodes
    if not pending:
        return None
    starts = _pending_heads(heads)
    if not starts:
        return None
    marked = _MARKED[0] > 0
    if not marked and only_sinks(pending, {id(n) for n in starts}):
        return None
    reached, reads = reached_from(starts, marked)
    for reader, node in reads:
        # (through a call that passes no gradient, or one not recorded, it is a
        # constant per sample too)
        mode = getattr(reader.info.op, "mode", None) or reader.mode
        if mode[0] and reader.info.name not in NO_GRADIENT:
            refuse(node)
    if len(reached) == len(pending):
        return None
    return list(pending), reached


def run_apart(heads, watched, looked):
    """Before a backward from ``heads``: the pending calls it reaches run apart
    from the others (``watched``: what :func:`watch` found, where it
    ``looked``; None there: the heads reach every pending call, or none is).
    Merged with them, the others' rows would take this backward's gradient,
    0, into what per sample it never reaches: a loss's backward would write
    zeros into the gradients of another loss's head (``grad_req='write'``)
    that a backward before it wrote. Not under ``jitbatch.map``, whose flush
    serves every sample."""
    g = current_graph()
    if not g.nodes or g.executing or g.sharing is not None:
        return
    if watched is not None:
        reached = watched[1]
    elif looked:
        return
    else:
        starts = _pending_heads(heads)
        if not starts or only_sinks(g.nodes, {id(n) for n in starts}):
            return
        reached = reached_from(starts, False)[0]
    if len(reached) < len(g.nodes):
        execute.run_graph(g, forced=True, reason="backward", first=reached)


def _pending_heads(heads):
    """The pending nodes that ``heads`` are outputs of (or, for a head made of
    other rows, ``nd.concat`` of per-sample losses, the nodes behind it)."""
    starts = []
    for h in heads:
        if type(h) is LazyArray:
            n = node_of(h)
            if type(n) is Node:
                if n.batch is None:
                    starts.append(n)
            elif type(n) is Composite:
                starts.extend(p for p in n.nodes if p.batch is None)
    return starts


def after(watched):
    """After the backward ``watch`` saw coming: mark what it left out."""
    if watched is None:
        return
    nodes, reached = watched
    _MARKED[0] += sever(_of_trained_blocks(nodes), reached)


def _of_trained_blocks(nodes):
    """Those of ``nodes`` that launch a block recorded with a trained parameter."""
    trained = {}
    out = []
    for n in nodes:
        t = trained.get(id(n.info))
        if t is None:
            t = trained[id(n.info)] = _trained_block(n.info.op)
        if t:
            out.append(n)
    return out


def _trained_block(ex):
    """Whether executor ``ex`` launches a block recorded with a trained parameter."""
    block = getattr(ex, "block", None)
    mode = getattr(ex, "mode", None)
    return block is not None and bool(mode) and bool(mode[0]) and \
        any(p.grad_req != "null" for p in block.collect_params().values())


_FIX = ("Fix: pass retain_graph=True to that backward, or call the block again in this "
        "recording; .detach() it if a constant is meant.")


def refuse(node):
    """A backward reaching an output of ``node``, which an earlier one freed."""
    raise NotDifferentiableError(
        "this backward reaches an output of %s (recorded at %s), but an earlier "
        "backward() left it out of its loss: per sample its recorded graph would carry a "
        "gradient here, while merged it shared a launch with samples that backward reached, "
        "which freed the launch's record (retain_graph=False), so its gradient would be "
        "lost. %s" % (node.info.name, node.site or "?", _FIX))


def freed(error):
    """MXNet's backward met a call whose record an earlier backward freed, by
    a value computed from a marked output (``tanh``, ``reshape`` of it) that
    ``watch`` does not follow: said in jitbatch's terms."""
    raise NotDifferentiableError(
        "this backward reaches a value computed from an output, but an earlier backward() "
        "left it out of its loss: merged, that output shared a launch with samples that "
        "backward reached, which freed the launch's record (retain_graph=False); MXNet: %s. "
        "%s" % (first_line(error), _FIX)) from error


# -- launches run before the backward, reached only through other samples' rows ----------
class _Unknown(Exception):
    """The walk met what it cannot follow."""


def _producer(x):
    """The Node or Composite behind lazy input ``x`` (one a read computed: its
    noted node); _Unknown where it is gone."""
    q = x._node
    if q is DETACHED:
        q = read_node(x)
        if q is None:
            raise _Unknown()
    return q


def _walk_inputs(n, found):
    """``found(p)`` for each node ``n`` reads; its concrete inputs returned."""
    if n.batch is not None and not n.inputs:
        raise _Unknown()          # let go of its inputs: not followed
    concrete = []
    for x in n.inputs:
        if isinstance(x, Ref):
            q = _producer(x)
            if type(q) is Node:
                found(q)
            elif type(q) is Composite:
                for p in q.nodes:
                    found(p)
            else:
                raise _Unknown()
        elif isinstance(x, NDArray):
            concrete.append(x)
    return concrete


def _trained_params(n, cache):
    """The parameters with a gradient of the block node ``n`` launches."""
    got = cache.get(id(n.info))
    if got is None:
        block = getattr(n.info.op, "block", None)
        got = cache[id(n.info)] = [] if block is None else \
            [p for p in block.collect_params().values() if p.grad_req != "null"]
    return got


def _recorded(x):
    """Whether autograd recorded an operator that computed concrete ``x``."""
    try:
        sym = autograd.get_symbol(x)
    except MXNetError:
        return False
    return any(node["op"] != "null" for node in json.loads(sym.tojson())["nodes"])


def keep_unreached(heads):
    """Before a backward from ``heads``: ``(copies, unreached)``, the calls of
    launches that ran before it (a read, a chunk, an earlier backward's
    flush) that it passes through without reaching them per sample, and
    copies ``[(buffer, copy)]`` of the gradient buffers only those calls
    would write (module docstring); None where there are none or the walk
    cannot tell."""
    g = current_graph()
    if g.sharing is not None or not any(map(kept_for_backward, g.retired)):
        return None       # no flush kept recorded calls with their inputs
    try:
        return _keep_unreached(g, heads)
    except _Unknown:
        return None


def _head_nodes(heads):
    """The nodes behind lazy ``heads`` (a composite's parts); _Unknown where a
    head was computed outside jitbatch."""
    starts = []
    for h in heads:
        if type(h) is not LazyArray:
            raise _Unknown()
        q = _producer(h)
        if type(q) is Node:
            starts.append(q)
        elif type(q) is Composite:
            starts.extend(q.nodes)
        else:
            raise _Unknown()
    return starts


def _per_sample(starts, visit):
    """Per sample, every call ``starts`` read, directly or through others:
    ``visit(n)`` once each, before its inputs are followed; their concrete
    inputs returned."""
    seen = set()
    concrete = []
    todo = list(starts)
    while todo:
        n = todo.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        visit(n)
        concrete += _walk_inputs(n, todo.append)
    return concrete


def _keep_unreached(g, heads):
    starts = _head_nodes(heads)
    kept = [n for lst in g.retired for n in lst]
    head_ids = {id(n) for n in starts}
    if only_sinks(kept, head_ids) and only_sinks(g.nodes, head_ids):
        return None       # every call feeds a head: the backward reaches them all
    reached = {}
    concrete = _per_sample(starts, lambda n: reached.__setitem__(id(n), n))
    # merged: every launch of those calls, and every launch any of its rows reads
    members = {}
    for lst in g.retired:
        for n in lst:
            if n.group is not None:
                members.setdefault(id(n.group), []).append(n)
    launches = set()
    todo = [n.group for n in reached.values() if n.batch is not None and n.group is not None]
    unreached = []
    their_inputs = []     # the unreached calls' concrete inputs
    while todo:
        grp = todo.pop()
        if id(grp) in launches:
            continue
        launches.add(id(grp))
        rows = members.get(id(grp))
        if rows is None:
            raise _Unknown()      # a launch of a flush that let go of its inputs
        for n in rows:
            inputs = _walk_inputs(n, lambda p: todo.append(p.group) if p.batch is not None and
                                  p.group is not None else None)
            if id(n) not in reached:
                unreached.append(n)
                their_inputs += inputs
    if not unreached:
        return None
    return _buffers(reached, unreached, concrete, their_inputs), unreached


def _buffers(reached, unreached, concrete, their_inputs):
    """Copies of the gradient buffers only the ``unreached`` calls write (see
    ``keep_unreached``); ``concrete``, ``their_inputs``: the reached and the
    unreached calls' concrete inputs."""
    cache = {}
    written = {}
    for n in reached.values():
        for p in _trained_params(n, cache):
            written[id(p)] = p
    params = {}
    for n in unreached:
        for p in _trained_params(n, cache):
            if id(p) not in written:
                params[id(p)] = p
    inputs = {id(x): x for x in their_inputs if x.grad is not None}
    if not params and not inputs:
        return []
    # what the reached calls read concretely: a parameter's array is that
    # parameter reached; an array autograd computed may reach any (not followed)
    data = {}
    for p in params.values():
        for d in p.list_data():
            data[d.handle.value] = id(p)
    for x in concrete:
        inputs.pop(id(x), None)
        if x.handle.value in data:
            params.pop(data[x.handle.value], None)
        elif _recorded(x):
            return []
    bufs = [b for p in params.values() for b in p.list_grad()] + [x.grad for x in inputs.values()]
    return [(b, b.copy()) for b in bufs]


def stopped_params(heads):
    """Before a backward from lazy ``heads``, where a call since the pending
    nodes began stops a lazy input's gradient (``Graph.stops``,
    ``SigInfo.stops``) and the heads reach such a call per sample through
    recorded calls: the trained parameters the block calls among those read,
    their gradients marked not fresh; else None. Per sample MXNet's backward
    writes each of them, zeros where only a stop (``BlockGrad``, ``argmax``,
    a shape source) leads there; merged, such a stop runs unrecorded or
    detached and the backward never reaches the block's launch: its gradient
    would keep the last step's values (``zero_stopped``). What the walk
    cannot follow (a call that let go of its inputs, a value written in
    place) it leaves out: as before."""
    g = current_graph()
    if not g.stops or g.sharing is not None:
        return None
    try:
        todo = _head_nodes(heads)
    except _Unknown:
        return None
    infos = {}
    seen = set()
    while todo:
        n = todo.pop()
        if id(n) in seen or not n.mode[0]:
            continue        # (outside autograd per sample: nothing behind it is reached)
        seen.add(id(n))
        infos[id(n.info)] = n.info
        if n.batch is not None and not n.inputs:
            continue        # let go of its inputs: a constant now, as per sample
        skip = getattr(n.info.op, "unused", ())
        for k, x in enumerate(n.inputs):
            if k not in skip and isinstance(x, Ref):
                q = x._node if x._node is not DETACHED else read_node(x)
                if type(q) is Node:
                    todo.append(q)
                elif type(q) is Composite:
                    todo.extend(q.nodes)
    if all(info.stops is None for info in infos.values()):
        return None
    params = {}
    for info in infos.values():
        for p in _graph_params(getattr(info.op, "block", None)):
            params[id(p)] = p
    params = list(params.values())
    for p in params:
        for a in p.list_data():     # (MXNet keeps the flag on the data)
            a._fresh_grad = False
    return params


def _graph_params(block):
    """The trained parameters ``block``'s traced graph reads (not those of a
    child it does not call)."""
    graph = getattr(block, "_cached_graph", None)
    if not graph:
        return ()
    used = set(graph[1].list_inputs())
    return [p for p in block.collect_params().values()
            if p.grad_req != "null" and p.name in used]


def zero_stopped(params):
    """After the backward ``stopped_params`` prepared: the gradients it did
    not write are written as plain Gluon's backward writes them (zeros, or
    nothing added) and marked fresh."""
    graph = current_graph()
    if graph.stops == STOPS_RECORDED:
        graph.stops = STOPS_SEEN
    for p in params or ():
        for a, g in zip(p.list_data(), p.list_grad()):
            if not a._fresh_grad:
                if p.grad_req == "write":
                    g[:] = 0
                a._fresh_grad = True


def refuse_written(heads):
    """Before a backward from ``heads``: refused where it reaches, per sample, a
    kept call whose concrete input was written in place after its merged
    launch ran (``kept.WRITTEN``)."""
    if not WRITTEN:
        return
    mine = written_in(current_graph())
    if not mine:
        return

    def visit(n):
        if id(n) in mine:
            _refuse_write(*mine[id(n)])
    try:
        _per_sample(_head_nodes(heads), visit)
    except _Unknown:
        # a head computed outside jitbatch: not followed, as keep_unreached. (A
        # released call has no kept call behind it: release frees every kept flush)
        return


def _refuse_write(node, shape):
    raise NotDifferentiableError(
        "an array of shape %s that %s (recorded at %s) read was written in place after the "
        "call ran merged with other samples' rows, and before this backward: per sample "
        "MXNet's backward would read the array's new values, the merged launch's backward "
        "reads the rows it gathered at the flush, so the gradients would differ. Fix: write "
        "the new values to a new array (x = nd.zeros_like(x), or x.copy()) instead of into "
        "the one the call read, or run the backward before the write."
        % (shape, node.info.name, node.site or "?"))


def put_back(kept, frees):
    """After the backward ``keep_unreached`` saw coming: the kept buffers get
    their values back. A backward that ``frees`` its graph (no
    ``retain_graph``) freed the records of the launches it reached: their
    unreached calls of trained blocks are marked as ``after`` marks pending
    ones (a later backward through them is refused, not silently a
    constant). It ends what this thread's flushes kept for one too: its read
    heads' notes go, and the kept nodes let go of their inputs (their
    launches' outputs, which a kept node holds alive)."""
    if kept:
        copies, unreached = kept
        with autograd.pause():
            for buf, copy in copies:
                copy.copyto(buf)
        if frees:
            for n in _of_trained_blocks(unreached):
                if not n.severed:
                    n.severed = True
                    _MARKED[0] += 1
    if frees:
        g = current_graph()
        for k, (_, node) in list(READ_HEADS.items()):     # this thread's only
            if node.graph is g:
                READ_HEADS.pop(k, None)
        if g.retired and not g.executing and keeps_recorded(g):
            g.release()
        forget_writes(g)
