"""Hand-written level-by-level batching of the child-sum Tree-LSTM.

The reference point for jitbatch: what an engineer writes by hand to batch the
per-sample model of :mod:`examples.tree_lstm.model`, on THE SAME parameters
(``net.encoder.embed``, ``net.encoder.cell``, ``net.similarity``), so its
outputs equal the per-sample model's up to float rounding.

For a minibatch of pairs, :meth:`HandBatched.forward`

* plans in Python/numpy (no framework op): every node's height (leaves 0),
  the nodes of each height across all trees and both sentences, the child
  rows each node reads, padded to the level's largest child count;
* copies all index arrays to the context in ONE transfer;
* joins the token ids of all sentences (one ``concat``), orders them level by
  level (one ``take``) and embeds them in ONE ``Embedding`` call, so the inputs
  of a level are a contiguous slice (a view, no op);
* runs ONE cell call per level over all its nodes.  The states live in one
  growing buffer whose row 0 is a zero state; each level appends its ``h``
  and ``c`` rows with one ``concat``, and the next level gathers its children's
  ``h`` and ``c`` with one ``take`` of shape ``(2, n, K)``;
* finally gathers both sentences' root states (one ``take``) and makes ONE
  similarity call.

Padding is exact: in :class:`~examples.tree_lstm.model.ChildSumLSTMCell` a
child contributes ``h_k`` to the child sum and ``f_k * c_k`` to the cell
state, so a child with ``h = c = 0`` adds nothing to the outputs, and, as
``d(f_k * c_k)/d f_k = c_k = 0``, nothing to any parameter gradient either.
The leaf level runs the leaf block (the cell without children), as the
per-sample model does for each leaf.

The embedding is the net's own block, so the net's ``embed_update`` holds here
as well: frozen, no gradient; sparse, the one ``Embedding`` call over all the
minibatch's tokens gives one row-sparse gradient (the rows used); dense, a
dense one.

Works under ``autograd.record()`` (training) and outside it (inference).
"""
import numpy as np
from mxnet import nd

__all__ = ["HandBatched", "Plan", "plan"]


class Plan(object):
    """Where everything of one minibatch lives; pure Python/numpy.

    ``index``: one int32 vector holding, in order, the level-major token order
    (``perm``), each non-leaf level's ``(2, n, K)`` child rows (h rows, then c
    rows) and the ``(2, N)`` root rows (a roots, then b roots).  ``levels``:
    per level ``(x_begin, n, k, idx_begin)`` (``k == 0`` for the leaf level);
    ``roots_begin``: offset of the root rows in ``index``."""
    __slots__ = ("index", "levels", "roots_begin", "pairs", "nodes")

    def __init__(self, index, levels, roots_begin, pairs, nodes):
        self.index = index
        self.levels = levels
        self.roots_begin = roots_begin
        self.pairs = pairs
        self.nodes = nodes


def plan(trees, lengths):
    """Plan ``trees`` (all a-sentences then all b-sentences; ``lengths`` their
    token counts).  Returns a :class:`Plan`."""
    level = []      # per node entry: its height
    tok = []        # per node entry: row of its token in the joined token ids
    kids = []       # per node entry: entries of its children
    roots = []
    off = 0
    for tree, length in zip(trees, lengths):
        local = {}  # per sentence: the same tree object may occur twice in a batch
        e = -1
        for node in tree.postorder():
            children = node.children
            e = len(level)
            if children:
                ks = [local[id(c)] for c in children]
                level.append(1 + max([level[k] for k in ks]))
            else:
                ks = ()
                level.append(0)
            local[id(node)] = e
            tok.append(off + node.idx)
            kids.append(ks)
        roots.append(e)  # postorder ends at the root
        off += length
    by_level = [[] for _ in range(max(level) + 1)] if level else []
    for e, lv in enumerate(level):
        by_level[lv].append(e)

    hrow = [0] * len(level)  # buffer row of each entry's h (row 0: the zero state)
    crow = [0] * len(level)
    perm = []
    child_idx = []           # flat (2, n, K) blocks of the non-leaf levels
    levels = []
    n_idx = len(level)       # child blocks start after perm
    base = 1
    for lv, es in enumerate(by_level):
        n = len(es)
        x_begin = len(perm)
        perm.extend([tok[e] for e in es])
        if lv == 0:
            levels.append((x_begin, n, 0, 0))
        else:
            k = max([len(kids[e]) for e in es])
            hs, cs = [], []
            for e in es:
                ks = kids[e]
                pad = [0] * (k - len(ks))
                hs.extend([hrow[c] for c in ks])
                hs.extend(pad)
                cs.extend([crow[c] for c in ks])
                cs.extend(pad)
            levels.append((x_begin, n, k, n_idx + len(child_idx)))
            child_idx.extend(hs)
            child_idx.extend(cs)
        for j, e in enumerate(es):
            hrow[e] = base + j
            crow[e] = base + n + j
        base += 2 * n
    roots_begin = n_idx + len(child_idx)
    root_idx = [hrow[e] for e in roots]
    index = np.array(perm + child_idx + root_idx, dtype=np.int32)
    return Plan(index, levels, roots_begin, len(trees) // 2, len(level))


class HandBatched(object):
    """Level-by-level batched forward pass of a :class:`SimilarityTreeLSTM`'s blocks.

    ``HandBatched(net)(pairs)`` with ``pairs`` a list of
    ``(a_tokens, a_tree, b_tokens, b_tree)`` (token ids as 1-D NDArrays, trees
    with ``idx``/``children``/``postorder()``) returns the ``(N, num_classes)``
    log-probabilities, row ``i`` equal to ``net(*pairs[i])``.

    With ``hybridize=True`` the embedding, cell and similarity blocks are
    hybridized the ordinary way (this also clears a ``dynamic_batch`` flag
    jitbatch may have set on them); the blocks are shared with ``net``."""

    def __init__(self, net, hybridize=True):
        self.net = net
        self.embed = net.encoder.embed
        self.cell = net.encoder.cell
        self.leaf = net.encoder.leaf
        self.similarity = net.similarity
        self.hidden = net.encoder.hidden_size
        self._zeros = {}
        if hybridize:
            self.hybridize()

    def hybridize(self, active=True):
        for block in (self.embed, self.cell, self.leaf, self.similarity):
            block.hybridize(active)

    def _zero(self, ctx, dtype):
        """The buffer's zero row, (1, H) (cached per context and dtype)."""
        key = (ctx, np.dtype(dtype).name)
        z = self._zeros.get(key)
        if z is None:
            z = self._zeros[key] = nd.zeros((1, self.hidden), ctx=ctx, dtype=dtype)
        return z

    def forward(self, pairs):
        if not pairs:
            raise ValueError("HandBatched.forward: empty list of pairs")
        toks = [p[0] for p in pairs] + [p[2] for p in pairs]
        trees = [p[1] for p in pairs] + [p[3] for p in pairs]
        p = plan(trees, [t.shape[0] for t in toks])
        ctx = toks[0].context
        index = nd.array(p.index, ctx=ctx, dtype=np.int32)   # the one index transfer
        ids = nd.take(nd.concat(*toks, dim=0), index[:p.nodes])
        emb = self.embed(ids)                                 # (nodes, E), level-major
        buf = self._zero(ctx, emb.dtype)
        for x_begin, n, k, i in p.levels:
            x = emb[x_begin:x_begin + n]
            if k == 0:
                h, c = self.leaf(x)
            else:
                g = nd.take(buf, index[i:i + 2 * n * k].reshape((2, n, k)))  # (2, n, K, H)
                h, c = self.cell(x, g[0], g[1])
            buf = nd.concat(buf, h, c, dim=0)
        n = p.pairs
        r = nd.take(buf, index[p.roots_begin:p.roots_begin + 2 * n].reshape((2, n)))
        return self.similarity(r[0], r[1])

    __call__ = forward
