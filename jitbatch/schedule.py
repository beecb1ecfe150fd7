"""Scheduling policies: pending nodes -> ordered batches of same-signature nodes.

Every policy returns a list of batches (lists of nodes) in an order where each
node's pending producers ran in an earlier batch. Nodes whose signature has no
batching rule always form batches of one."""

try:
    import cython   # compiled: the local type annotations below are C declarations
except ImportError:  # running from source without Cython installed
    from . import _nocython as cython

from .graph import Node

POLICIES = ("auto", "depth", "agenda", "sequential")


def _split_unbatchable(batch):
    if batch[0].info.batchable or len(batch) == 1:
        return [batch]
    return [[n] for n in batch]


def by_depth(nodes):
    """Group by (depth, signature), as TensorFlow Fold and the Gluon Fold helper do.
    Depth is the longest path from the graph's inputs, so a group's producers all
    sit at smaller depths."""
    groups = {}
    n: Node
    for n in nodes:
        key = (n.depth, n.info.id)
        g = groups.get(key)
        if g is None:
            groups[key] = [n]
        else:
            g.append(n)
    out = []
    for key in sorted(groups, key=lambda k: (k[0], groups[k][0].seq)):
        out.extend(_split_unbatchable(groups[key]))
    return out


def by_agenda(nodes):
    """DyNet's agenda, refined: among signatures with ready nodes, prefer those
    whose every pending node is ready (running them now merges all of them), then
    the lowest average as-late-as-possible level (critical path minus the height
    to the sinks: a node that can wait, like a head after a short tree, waits and
    merges with its peers from longer samples). All ready nodes of the chosen
    signature form one batch. Uses the producer counts and user lists kept at
    record time."""
    n: Node
    u: Node
    h: cython.Py_ssize_t
    top: cython.Py_ssize_t = 0
    for n in reversed(nodes):
        h = 1
        users = n.users
        if users:
            for u in users:
                if u.height >= h:
                    h = u.height + 1
        n.height = h
        if h > top:
            top = h
    ready = {}        # sig id -> ready nodes
    level_sum = {}    # sig id -> sum of their as-late-as-possible levels
    left = {}         # sig id -> nodes not yet run
    fresh = []        # nodes that became ready, not yet in ``ready``
    for n in nodes:
        sid = n.info.id
        left[sid] = left.get(sid, 0) + 1
        if n.wait == 0:
            fresh.append(n)
    _make_ready(fresh, ready, level_sum, top)
    out = []
    while ready:
        best = min(ready, key=lambda s: (len(ready[s]) < left[s],
                                         level_sum[s] / len(ready[s]), s))
        batch = ready.pop(best)
        del level_sum[best]
        left[best] -= len(batch)
        out.extend(_split_unbatchable(batch))
        for n in batch:
            users = n.users
            if users:
                for u in users:
                    u.wait -= 1       # consumed: a flush schedules each node once
                    if u.wait == 0:
                        fresh.append(u)
        _make_ready(fresh, ready, level_sum, top)
    if sum(len(b) for b in out) != len(nodes):
        raise AssertionError("agenda scheduling lost nodes (a cycle in the graph?)")
    return out


def _make_ready(fresh, ready, level_sum, top):
    """Move the nodes of ``fresh`` to their signatures' ready lists (the agenda's
    state: see by_agenda), emptying it."""
    n: Node
    for n in fresh:
        sid = n.info.id
        r = ready.get(sid)
        if r is None:
            ready[sid] = [n]
            level_sum[sid] = top - n.height
        else:
            r.append(n)
            level_sum[sid] += top - n.height
    del fresh[:]


def split_padded(batch, fixed, per_unit):
    """Split a batch of a zero-padded signature into launches by size, where that
    pays: each launch pads its nodes to its largest size ``k`` (``Node.pad``); a launch costs
    ``fixed`` plus ``per_unit`` per padded unit (``nodes x k``). The sizes are
    sorted and cut into consecutive runs by dynamic programming (exact: an
    optimal split never interleaves sizes). Returns the launches, smallest
    sizes first (the batch itself when merging everything is cheapest, or when
    ``fixed`` is None: no prices), and each launch's largest size."""
    by = {}
    for n in batch:
        k = n.pad
        g = by.get(k)
        if g is None:
            by[k] = [n]
        else:
            g.append(n)
    if len(by) == 1 or fixed is None:
        return [batch], [max(by)]
    ks = sorted(by)
    m = len(ks)
    counts = [len(by[k]) for k in ks]
    best = [0.0] * (m + 1)      # best[j]: cost of the first j sizes
    cut = [0] * (m + 1)
    for j in range(1, m + 1):
        n = 0
        bj = None
        for i in range(j - 1, -1, -1):      # last run: sizes i..j-1, padded to ks[j-1]
            n += counts[i]
            c = best[i] + fixed + per_unit * n * ks[j - 1]
            if bj is None or c < bj:
                bj, cut[j] = c, i
        best[j] = bj
    runs = []
    j = m
    while j:
        runs.append((cut[j], j))
        j = cut[j]
    if len(runs) == 1:
        return [batch], [ks[-1]]
    out = []
    for i, j in reversed(runs):
        part = []
        for k in ks[i:j]:
            part.extend(by[k])
        out.append(part)
    return out, [ks[j - 1] for _, j in reversed(runs)]


def bucket(n, steps):
    """The launch size ``n`` samples are rounded up to: ``n`` itself up to
    ``2 * steps``, above that the next of ``steps`` evenly spaced sizes per
    doubling (16: sizes 34, 36, ... 64, 68, ... 128, 136, ...), so at most
    ``1 / steps`` more samples. ``steps`` 0 or None: ``n``."""
    if not steps or n <= 2 * steps:
        return n
    q = 1 << (n.bit_length() - steps.bit_length())
    return -(-n // q) * q


def sequential(nodes):
    """One launch per node in record order: what per-sample execution does, with
    no analysis at all (the choice when nothing can be merged)."""
    return [[n] for n in nodes]


SCHEDULERS = {"depth": by_depth, "agenda": by_agenda, "sequential": sequential}
