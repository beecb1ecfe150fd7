"""Outputs left out of a backward that freed their merged launch's record.

Per sample, an output recorded under autograd but left out of a loss keeps
its recorded graph (no backward reached it), and a later recording that uses
it (a cache of word states, an unlabelled sentence's) differentiates through
it. Merged, its rows share a launch with the samples that loss reached, and
that ``backward()`` (``retain_graph=False``) freed the launch's record: MXNet
would take the output as a constant, its share of the gradient silently
lost. So a backward without ``retain_graph`` notes which pending nodes its
heads reach (``watch``, before the flush that runs them), and after it marks
the others of the launches it reached (``graph.sever``); a later recorded
call given one of their outputs is refused (``refuse``). Nodes computed by
an earlier flush (a read, a pipelined chunk) have let go of their inputs and
are not followed."""
from ..graph import Node, current_graph, only_sinks, reached_from, sever
from .lazy import LazyArray, NotDifferentiableError, node_of


def watch(heads):
    """Before a backward from ``heads`` that frees what it reaches: ``(the
    pending nodes, the ids of those the heads reach)``, or None where it
    reaches them all (or no head is pending)."""
    g = current_graph()
    pending = g.nodes
    if not pending:
        return None
    starts = []
    for h in heads:
        if type(h) is LazyArray:
            n = node_of(h)
            if type(n) is Node and n.batch is None:
                starts.append(n)
    if not starts:
        return None
    if only_sinks(pending, {id(n) for n in starts}):
        return None
    return list(pending), reached_from(starts)


def after(watched):
    """After the backward ``watch`` saw coming: mark what it left out, of the
    launches autograd recorded (one that passes no gradient runs unrecorded:
    ``gradients.launch_mode``; its outputs are constants per sample too)."""
    if watched is not None:
        nodes, reached = watched
        sever([n for n in nodes if (getattr(n.info.op, "mode", None) or (False,))[0]],
              reached)


def refuse(node):
    """A recorded call given an output of ``node``, severed by a backward."""
    raise NotDifferentiableError(
        "an output of %s (recorded at %s) is used in this recording, but an earlier "
        "backward() left it out of its loss: per sample its recorded graph would carry a "
        "gradient here, while merged it shared a launch with samples that backward reached, "
        "which freed the launch's record (retain_graph=False), so its gradient would be "
        "lost. Fix: pass retain_graph=True to that backward, or call the block again in "
        "this recording; .detach() it if a constant is meant."
        % (node.info.name, node.site or "?"))
