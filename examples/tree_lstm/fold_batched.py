"""Fold-style batching of the child-sum Tree-LSTM: the prior-art baseline.

TensorFlow Fold (Looks et al. 2017) and the Gluon "Fold" helper
(szha/mxnet-fold) batch a per-sample computation in the same way: the model
records each operation of each sample on a *fold* instead of running it,
getting a virtual value back; then the fold runs the recorded operations
depth by depth (depth: 1 + the deepest recorded input), one call per group of
operations with the same depth and signature, the inputs of a group
*concatenated* along axis 0 and its outputs *split* back into one array per
recorded operation. The Gluon helper is not installable on the machines this
project is built on, so this module implements that technique itself, for
the benchmark (``scripts/bench_tree_lstm.py``, mode ``fold``): the model
below is the per-sample model rewritten against the fold, on THE SAME blocks
and parameters as :class:`~examples.tree_lstm.model.SimilarityTreeLSTM`.

What separates it from jitbatch and the hand-written code is how values move
between groups: every output row becomes an array of its own (one ``split``
per group output) and every group input is a ``concat`` of per-operation
arrays, and a variable number of children is one more recorded operation
(``stack``) whose signature includes the count, so nodes with different
child counts never share a call.

Works under ``autograd.record()`` (training) and outside it (inference).
"""
from mxnet import nd

__all__ = ["Fold", "FoldBatched"]


class Ref(object):
    """Output ``k`` of a recorded operation (a virtual value)."""
    __slots__ = ("op", "k")

    def __init__(self, op, k):
        self.op = op
        self.k = k


class _Op(object):
    __slots__ = ("fn", "args", "depth", "sig", "vals")

    def __init__(self, fn, args, depth, sig):
        self.fn = fn
        self.args = args
        self.depth = depth
        self.sig = sig
        self.vals = None        # its outputs, one array each, once run


def _describe(a):
    """What must be equal for two arguments to be concatenated."""
    if type(a) is Ref:
        return (a.op.sig, a.k)
    if isinstance(a, int):
        return int
    return tuple(a.shape)


class Fold(object):
    """Records operations per sample; :meth:`run` executes them depth by depth.

    ``add(fn, *args)`` records ``fn(*args)`` for one sample and returns a
    :class:`Ref` to its output 0 (``out(ref, k)`` names output ``k``). An
    argument is a Ref, a per-sample NDArray with a leading axis of 1, or a
    Python int (a group's ints become one array on ``ctx``, e.g. token ids).
    ``fn`` must treat axis 0 as the batch axis (a Gluon block does)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.groups = {}        # (depth, signature) -> recorded ops

    def add(self, fn, *args):
        depth = 0
        for a in args:
            if type(a) is Ref and a.op.depth > depth:
                depth = a.op.depth
        sig = (id(fn), tuple([_describe(a) for a in args]))
        op = _Op(fn, args, depth + 1, sig)
        key = (op.depth, sig)
        group = self.groups.get(key)
        if group is None:
            self.groups[key] = [op]
        else:
            group.append(op)
        return Ref(op, 0)

    @staticmethod
    def out(ref, k):
        return Ref(ref.op, k)

    def run(self, refs):
        """Execute every recorded operation; returns the arrays of ``refs``."""
        for key in sorted(self.groups, key=lambda g: g[0]):
            ops = self.groups[key]
            n = len(ops)
            batched = []
            for j in range(len(ops[0].args)):
                col = [op.args[j] for op in ops]
                a = col[0]
                if isinstance(a, int):
                    batched.append(nd.array(col, ctx=self.ctx))
                else:
                    parts = [x.op.vals[x.k] for x in col] if type(a) is Ref else col
                    batched.append(nd.concat(*parts, dim=0) if n > 1 else parts[0])
            outs = ops[0].fn(*batched)
            if not isinstance(outs, (list, tuple)):
                outs = (outs,)
            rows = [nd.split(o, num_outputs=n, axis=0) if n > 1 else [o] for o in outs]
            for i, op in enumerate(ops):
                op.vals = [r[i] for r in rows]
        self.groups = {}
        return [r.op.vals[r.k] for r in refs]


def _stack_children(*states):
    return nd.stack(*states, axis=1)


class FoldBatched(object):
    """``FoldBatched(net)(pairs)``: the ``(N, num_classes)`` log-probabilities of
    a :class:`SimilarityTreeLSTM` over ``pairs`` of ``(a_tokens, a_tree,
    b_tokens, b_tree, ...)`` (further items are ignored), row ``i`` equal to ``net(*pairs[i])``, computed
    Fold-style. Uses the net's blocks as they are (hybridized or not)."""

    def __init__(self, net):
        self.embed = net.encoder.embed
        self.cell = net.encoder.cell
        self.leaf = net.encoder.leaf
        self.similarity = net.similarity

    def _encode(self, fold, tokens, tree):
        ids = tokens.asnumpy().astype(int).tolist()
        states = {}
        for node in tree.postorder():
            x = fold.add(self.embed, ids[node.idx])
            if node.children:
                kids = [states.pop(id(k)) for k in node.children]
                ch = fold.add(_stack_children, *[h for h, _ in kids])
                cc = fold.add(_stack_children, *[c for _, c in kids])
                h = fold.add(self.cell, x, ch, cc)
            else:
                h = fold.add(self.leaf, x)
            states[id(node)] = (h, fold.out(h, 1))
        return states[id(tree)][0]

    def forward(self, pairs):
        if not pairs:
            raise ValueError("FoldBatched.forward: empty list of pairs")
        ctx = pairs[0][0].context
        fold = Fold(ctx)
        roots = [fold.add(self.similarity, self._encode(fold, p[0], p[1]),
                          self._encode(fold, p[2], p[3])) for p in pairs]
        return nd.concat(*fold.run(roots), dim=0)

    __call__ = forward
