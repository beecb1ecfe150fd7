"""Scheduling policies: pending nodes -> ordered batches of same-signature nodes.

Every policy returns a list of batches (lists of nodes) in an order where each
node's pending producers ran in an earlier batch. Nodes whose signature has no
batching rule always form batches of one."""
from .graph import Ref

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


def _producers(n):
    """Pending producers of ``n`` (its inputs' nodes that are not done yet)."""
    res = []
    for x in n.inputs:
        if isinstance(x, Ref):
            p = x._node
            if p.batch is None:
                res.append(p)
    return res


def by_agenda(nodes):
    """DyNet's agenda, refined: among signatures with ready nodes, prefer those
    whose every pending node is ready (running them now merges all of them; running
    one early splits it), then the lowest average depth; all its ready nodes form
    one batch."""
    index = {id(n): i for i, n in enumerate(nodes)}
    waiting = [0] * len(nodes)
    users = [[] for _ in nodes]
    for i, n in enumerate(nodes):
        for p in _producers(n):
            j = index.get(id(p))
            if j is not None:
                waiting[i] += 1
                users[j].append(i)
    # priority: the as-late-as-possible level (critical path minus the height to
    # the sinks): nodes that can wait (a head after a short tree) do, so they merge
    # with their peers from longer samples
    height = [1] * len(nodes)
    for i in range(len(nodes) - 1, -1, -1):
        for u in users[i]:
            if height[u] + 1 > height[i]:
                height[i] = height[u] + 1
    top = max(height) if height else 0
    level = [top - h for h in height]
    ready = {}        # sig id -> list of node indices
    depth_sum = {}    # sig id -> sum of levels of ready nodes
    left = {}         # sig id -> nodes not yet run
    for n in nodes:
        left[n.info.id] = left.get(n.info.id, 0) + 1
    for i, n in enumerate(nodes):
        if waiting[i] == 0:
            sid = n.info.id
            ready.setdefault(sid, []).append(i)
            depth_sum[sid] = depth_sum.get(sid, 0) + level[i]
    out = []
    while ready:
        best = min(ready, key=lambda s: (len(ready[s]) < left[s],
                                         depth_sum[s] / len(ready[s]), s))
        idxs = ready.pop(best)
        del depth_sum[best]
        left[best] -= len(idxs)
        batch = [nodes[i] for i in idxs]
        out.extend(_split_unbatchable(batch))
        for i in idxs:
            for u in users[i]:
                waiting[u] -= 1
                if waiting[u] == 0:
                    sid = nodes[u].info.id
                    ready.setdefault(sid, []).append(u)
                    depth_sum[sid] = depth_sum.get(sid, 0) + level[u]
    if sum(len(b) for b in out) != len(nodes):
        raise AssertionError("agenda scheduling lost nodes (a cycle in the graph?)")
    return out


def sequential(nodes):
    """One launch per node in record order: what per-sample execution does, with
    no analysis at all (the choice when nothing can be merged)."""
    return [[n] for n in nodes]


SCHEDULERS = {"depth": by_depth, "agenda": by_agenda, "sequential": sequential}
