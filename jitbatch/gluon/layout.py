"""The flat batched layout: where a sample's rows sit in a merged launch's outputs.

A launch over N nodes keeps each output *flat*: per-sample shape ``(b, *rest)``
becomes ``(N*b, *rest)`` (Gluon's batch axis 0), sample ``i`` owning rows
``i*b:(i+1)*b``; a ragged node (its own leading length) owns ``off:off+rows``."""
from ..graph import Group, Node
from ..signature import SigInfo


def flat_shape(shape, n):
    """Flat batched shape of ``n`` samples of per-sample ``shape``."""
    if not shape:
        return (n,)
    return (n * shape[0],) + tuple(shape[1:])


def extent(node, k):
    """(first row, rows, rows of the whole launch output) of ``node``'s output
    ``k`` within its batch's flat output (``gather`` inlines the same)."""
    n: Node = node
    g: Group = n.group
    if n.rows is None:
        info: SigInfo = n.info
        b = info.out_rows[k][0]
        return n.row * b, b, g.size * b
    return n.off, n.rows, g.rows


def finish(batch, outs):
    """A batch ran: its flat outputs ``outs`` become every node's (each reads
    its rows through ``extent``). The nodes' inputs are released later, where
    the thread waits for kernels anyway (``Graph.retire``)."""
    n: Node = batch[0]
    g: Group = n.group
    g.outs = outs
    for n in batch:
        n.batch = outs
