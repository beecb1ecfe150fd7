"""Binary Tree-LSTM over SST-style trees: the cells, the data and the
hand-batched reference shared by the two per-sample styles
(:mod:`examples.zoo.tree_leaf`, :mod:`examples.zoo.tree_sentence`).

Every word is a leaf; an inner node joins two adjacent spans. A leaf runs the
leaf cell on its word vector, an inner node the binary composition cell on its
children's states (Tai et al. 2015, N-ary Tree-LSTM with N = 2, words at the
leaves only); the root's ``h`` is classified into 5 classes."""
import numpy as np
from mxnet import gluon, nd
from mxnet.gluon import HybridBlock, nn

from .common import cross_entropy, index_array, labels_of, random_binary_tree, seeded

__all__ = ["LeafCell", "BinaryCell", "BinaryTreeLSTM", "TreeSample", "generate", "build",
           "loss", "HandBatched", "CLASSES"]

CLASSES = 5


class LeafCell(HybridBlock):
    """A leaf's state from its word vector ``x`` (B, E): no children, so no forget gate."""

    def __init__(self, hidden, embed, **kwargs):
        super(LeafCell, self).__init__(**kwargs)
        with self.name_scope():
            self.iou = nn.Dense(3 * hidden, in_units=embed)

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        i, o, u = F.split(self.iou(x), num_outputs=3, axis=1)
        c = F.sigmoid(i) * F.tanh(u)
        return F.sigmoid(o) * F.tanh(c), c


class BinaryCell(HybridBlock):
    """An inner node's state from its left and right children's ``h`` and ``c``
    (each (B, H)), with one forget gate per child."""

    def __init__(self, hidden, **kwargs):
        super(BinaryCell, self).__init__(**kwargs)
        with self.name_scope():
            self.left = nn.Dense(5 * hidden, in_units=hidden)
            self.right = nn.Dense(5 * hidden, in_units=hidden, use_bias=False)

    def hybrid_forward(self, F, hl, cl, hr, cr):  # pylint: disable=arguments-differ
        i, fl, fr, o, u = F.split(self.left(hl) + self.right(hr), num_outputs=5, axis=1)
        c = F.sigmoid(i) * F.tanh(u) + F.sigmoid(fl) * cl + F.sigmoid(fr) * cr
        return F.sigmoid(o) * F.tanh(c), c


class BinaryTreeLSTM(gluon.Block):
    """The blocks of both styles; a style's ``forward(tree)`` runs them over ONE tree
    and returns its (1, CLASSES) logits."""

    def __init__(self, vocab, embed, hidden, **kwargs):
        super(BinaryTreeLSTM, self).__init__(**kwargs)
        with self.name_scope():
            self.embed = nn.Embedding(vocab, embed)
            self.leaf = LeafCell(hidden, embed)
            self.compose = BinaryCell(hidden)
            self.out = nn.Dense(CLASSES, in_units=hidden)


class TreeSample(object):
    """One sentence: its tree (words at the leaves) and its class, as a Python
    int and as the (1,) NDArray the per-sample loss reads."""
    __slots__ = ("tree", "label", "target")

    def __init__(self, tree, label):
        self.tree = tree
        self.label = label
        self.target = nd.array([label])


def _word_scores(vocab):
    """A fixed sentiment score per word: the classes are a function of the words."""
    return np.random.default_rng(7).normal(size=vocab)


def generate(rng, n, vocab=100, min_len=2, max_len=24):
    """``n`` sentences of ``min_len``..``max_len`` words, randomly bracketed; the
    class is the bucket of the sentence's mean word score."""
    scores = _word_scores(vocab)
    out = []
    for _ in range(n):
        words = rng.integers(0, vocab, int(rng.integers(min_len, max_len + 1)))
        mean = float(scores[words].mean())
        label = int(np.digitize(mean, [-0.5, -0.15, 0.15, 0.5]))
        out.append(TreeSample(random_binary_tree(rng, words), label))
    return out


def build(cls, seed=0, vocab=100, embed=64, hidden=96):
    """A style's network (``cls``, a :class:`BinaryTreeLSTM`), initialized from ``seed``."""
    return seeded(cls(vocab, embed, hidden), seed)


def loss(net, sample, out):  # pylint: disable=unused-argument
    return cross_entropy(out, sample.target)


class HandBatched(object):
    """Level-by-level batching of the same blocks: all leaves of a minibatch in
    one embedding lookup and one leaf-cell call, then one composition call per
    height (nodes of equal height, across all trees, read their children's
    states from one growing buffer with one ``take``), the roots classified in
    one call. Index arrays go to the device in one copy."""

    def __init__(self, net):
        self.net = net

    @staticmethod
    def plan(trees):
        """Leaf words in buffer order, per height the children's buffer rows
        ((4, n): hl, cl, hr, cr), and the roots' buffer rows."""
        height, kids, leaves = {}, {}, []
        for tree in trees:
            for node in tree.postorder():
                if node.is_leaf:
                    height[id(node)] = 0
                    leaves.append(node)
                else:
                    height[id(node)] = 1 + max(height[id(node.left)], height[id(node.right)])
                    kids[id(node)] = node
        levels = [[] for _ in range(max(height.values()) + 1)]
        for node in kids.values():
            levels[height[id(node)]].append(node)
        # the buffer holds, per level, its h rows then its c rows
        h_row, c_row = {}, {}
        n0 = len(leaves)
        for j, node in enumerate(leaves):
            h_row[id(node)], c_row[id(node)] = j, n0 + j
        base, child_rows = 2 * n0, []
        for nodes in levels[1:]:
            n = len(nodes)
            child_rows.append([h_row[id(x.left)] for x in nodes] +
                              [c_row[id(x.left)] for x in nodes] +
                              [h_row[id(x.right)] for x in nodes] +
                              [c_row[id(x.right)] for x in nodes])
            for j, node in enumerate(nodes):
                h_row[id(node)], c_row[id(node)] = base + j, base + n + j
            base += 2 * n
        roots = [h_row[id(t)] for t in trees]
        return [x.word for x in leaves], child_rows, roots

    def forward(self, samples):
        net = self.net
        words, child_rows, roots = self.plan([s.tree for s in samples])
        flat = [r for rows in child_rows for r in rows] + roots
        index = index_array(flat)
        h, c = net.leaf(net.embed(nd.array(words)))
        buf = nd.concat(h, c, dim=0)
        at = 0
        for rows in child_rows:
            n = len(rows) // 4
            g = nd.take(buf, index[at:at + 4 * n].reshape((4, n)))     # (4, n, H)
            at += 4 * n
            h, c = net.compose(g[0], g[1], g[2], g[3])
            buf = nd.concat(buf, h, c, dim=0)
        return net.out(nd.take(buf, index[at:at + len(roots)]))

    def loss(self, samples, outs):
        return cross_entropy(outs, labels_of(samples, outs.context))
