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
Not followed: calls computed by an earlier flush (a read, a pipelined chunk),
which have let go of their inputs, and values made from a marked output by
a reshape or a concatenation (views and row composites of concrete rows)."""
from .. import execute
from ..errors import first_line
from ..graph import Composite, Node, current_graph, only_sinks, reached_from, sever
from .gradients import NO_GRADIENT
from .lazy import LazyArray, NotDifferentiableError, node_of

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
    trained = {}
    kept = []
    for n in nodes:
        t = trained.get(id(n.info))
        if t is None:
            t = trained[id(n.info)] = _trained_block(n.info.op)
        if t:
            kept.append(n)
    _MARKED[0] += sever(kept, reached)


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
