"""What every zoo model shares: its registry entry, seeded construction, the
classification loss, and small helpers the hand-batched references use.

A zoo model is a module with

* ``build(seed=0, **sizes)``: the per-sample network (a ``gluon.Block``),
  initialized from ``seed``;
* ``generate(rng, n, **structure)``: ``n`` synthetic samples from a numpy
  ``Generator`` (seeded by the caller), each of its own structure;
* ``forward(net, sample)``: what the model predicts for ONE sample (logits,
  ``(1, C)`` or ``(steps, V)``);
* ``loss(net, sample, out)``: ONE sample's loss, shape ``(1,)``;
* ``HandBatched(net)``, where one can be written: ``.forward(samples)`` gives the
  outputs of all samples stacked in order (``(N, C)`` or ``(N * steps, V)``)
  and ``.loss(samples, outs)`` their per-sample losses ``(N,)``, computed with
  the same blocks (so the same parameters) as the per-sample code.

The per-sample code is written the way a user writes it, not tuned for
jitbatch; see each module's docstring for what it does per sample."""
import numpy as np
import mxnet as mx
from mxnet import gluon, nd

__all__ = ["Entry", "seeded", "cross_entropy", "labels_of", "index_array", "gather_sum",
           "BinaryTree", "random_binary_tree"]


class Entry(object):
    """One zoo model as the benchmark and the tests see it.

    ``train_size``/``infer_size``: the benchmark's minibatch sizes;
    ``options``: ``build`` keyword arguments that make this model of its module;
    ``tiny``/``tiny_data``: ``build``/``generate`` keyword arguments small enough
    for the tests; ``merges``: whether per-sample calls of different samples
    can share a launch at all (the counters test checks that they do);
    ``known_failure``: why jitbatch cannot run it today (None: it can);
    ``steered``: how much work a sample makes depends on the parameters (a
    greedy decoder runs until it predicts its end), so the benchmark's
    training steps leave them as they are: every mode then times the same work."""

    def __init__(self, name, module, summary, train_size=32, infer_size=128, options=None,
                 tiny=None, tiny_data=None, merges=True, known_failure=None, steered=False):
        self.name = name
        self.module = module
        self.summary = summary
        self.options = dict(options or {})
        self.known_failure = known_failure
        self.train_size = train_size
        self.infer_size = infer_size
        self.tiny = dict(tiny or {})
        self.tiny_data = dict(tiny_data or {})
        self.merges = merges
        self.steered = steered

    @property
    def hand(self):
        """The hand-batched reference class, or None where there is none."""
        return getattr(self.module, "HandBatched", None)

    def build(self, seed=0, tiny=False):
        kwargs = dict(self.options, **(self.tiny if tiny else {}))
        return self.module.build(seed, **kwargs)

    def generate(self, rng, n, tiny=False):
        return self.module.generate(rng, n, **(self.tiny_data if tiny else {}))

    def forward(self, net, sample):
        return self.module.forward(net, sample)

    def loss(self, net, sample, out):
        return self.module.loss(net, sample, out)

    def per_sample(self, net, samples, each=None, losses=True):
        """Every sample's output and loss (None where not ``losses``), one
        sample after the other, as a training loop over a minibatch writes it;
        ``each``: what runs the samples' calls instead of that loop, with the
        builtin ``map``'s arguments (``jitbatch.map``)."""
        module = self.module

        def one(s):
            out = module.forward(net, s)
            return out, (module.loss(net, s, out) if losses else None)
        pairs = [one(s) for s in samples] if each is None else each(one, samples)
        return [o for o, _ in pairs], [l for _, l in pairs]

    def __repr__(self):
        return "Entry(%r)" % self.name


def seeded(net, seed):
    """Initialize ``net``'s parameters from ``seed`` (the same values on every
    call with the same seed), and return it."""
    mx.random.seed(seed)
    net.initialize(mx.init.Xavier())
    return net


#: the classification loss of the zoo: softmax cross-entropy against a class id
cross_entropy = gluon.loss.SoftmaxCrossEntropyLoss()


def labels_of(samples, ctx=None):
    """Every sample's class id(s) as one float32 vector (hand-batched code reads
    the Python labels once per minibatch)."""
    flat = []
    for s in samples:
        if isinstance(s.label, (list, tuple)):
            flat.extend(s.label)
        else:
            flat.append(s.label)
    return nd.array(flat, ctx=ctx)


def index_array(values, ctx=None):
    """A Python list of row numbers as an int32 NDArray (one host-to-device copy)."""
    return nd.array(np.asarray(values, dtype=np.int32), ctx=ctx, dtype=np.int32)


def gather_sum(table, index):
    """``out[i] = sum_j table[index[i, j]]`` for an ``(n, k)`` index: a take and
    a product with a ones vector (MXNet's CPU ``sum(axis=1)`` is ~10x slower for
    these shapes). Rows meant to add nothing point at a zero row of ``table``."""
    n, k = index.shape
    rows = nd.take(table, index)                                   # (n, k, H)
    ones = nd.ones((n, 1, k), ctx=table.context, dtype=table.dtype)
    return nd.batch_dot(ones, rows).reshape((n, -1))


class BinaryTree(object):
    """A binary tree over a sentence: a leaf holds one word (``word``, its
    position ``pos``), an inner node two children. ``words`` (root only) is the
    sentence."""
    __slots__ = ("word", "pos", "left", "right", "words")

    def __init__(self, word=None, pos=None, left=None, right=None):
        self.word, self.pos, self.left, self.right = word, pos, left, right
        self.words = None

    @property
    def is_leaf(self):
        return self.left is None

    def postorder(self):
        """Nodes, children before their parent (iterative: trees may be deep)."""
        out, stack = [], [(self, False)]
        while stack:
            node, done = stack.pop()
            if done or node.is_leaf:
                out.append(node)
            else:
                stack.extend([(node, True), (node.right, False), (node.left, False)])
        return out


def random_binary_tree(rng, words):
    """A random bracketing of ``words`` (SST-style: every word a leaf, every
    inner node the join of two adjacent spans)."""
    def span(a, b):
        if b - a == 1:
            return BinaryTree(word=int(words[a]), pos=a)
        cut = int(rng.integers(a + 1, b))
        return BinaryTree(left=span(a, cut), right=span(cut, b))
    root = span(0, len(words))
    root.words = [int(w) for w in words]
    return root
