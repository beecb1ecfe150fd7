"""Per-sample models and sample generators shared by the differential tests."""
import numpy as np
import mxnet as mx
from mxnet import gluon, nd
from mxnet.gluon import HybridBlock, nn

from examples.tree_lstm.model import SimilarityTreeLSTM


class T(object):
    """A minimal tree (the example's reader builds the real ones)."""
    __slots__ = ("idx", "children")

    def __init__(self, idx, children=()):
        self.idx = idx
        self.children = list(children)

    def postorder(self):
        out, stack = [], [(self, False)]
        while stack:
            n, seen = stack.pop()
            if seen:
                out.append(n)
            else:
                stack.append((n, True))
                stack.extend((c, False) for c in reversed(n.children))
        return out


def random_tree(rng, n_tokens, max_children=4):
    nodes = [T(i) for i in range(n_tokens)]
    order = rng.permutation(n_tokens)
    for pos in range(1, n_tokens):
        while True:
            parent = nodes[order[rng.integers(0, pos)]]
            if len(parent.children) < max_children:
                break
        parent.children.append(nodes[order[pos]])
    return nodes[order[0]]


def full_binary(depth, start=0):
    if depth == 1:
        return T(start), start + 1
    left, nxt = full_binary(depth - 1, start)
    right, nxt = full_binary(depth - 1, nxt)
    return T(nxt, [left, right]), nxt + 1


# -- child-sum Tree-LSTM (the flagship model) -----------------------------------------
def childsum_model(vocab=50, embed=8, hidden=6):
    net = SimilarityTreeLSTM(vocab, embed, hidden, sim_hidden=5, num_classes=5)
    net.initialize(mx.init.Uniform(0.5))
    return net


def childsum_padded_model(vocab=50, embed=8, hidden=6):
    """The flagship model with the cell's child axis declared zero-paddable:
    nodes with different child counts share launches."""
    import jitbatch
    net = childsum_model(vocab, embed, hidden)
    jitbatch.zero_pad(net.encoder.cell, ch=1, cc=1)
    return net


def childsum_samples(rng, n, vocab=50):
    out = []
    for _ in range(n):
        la, lb = int(rng.integers(1, 9)), int(rng.integers(1, 9))
        out.append((nd.array(rng.integers(0, vocab, la)), random_tree(rng, la),
                    nd.array(rng.integers(0, vocab, lb)), random_tree(rng, lb),
                    nd.array(rng.dirichlet(np.ones(5))[None, :])))
    return out


def childsum_apply(net, s):
    logp = net(s[0], s[1], s[2], s[3])
    return logp, gluon.loss.KLDivLoss(from_logits=True)(logp, s[4])


# -- binary (N-ary) Tree-LSTM -----------------------------------------------------------
class BinaryCell(HybridBlock):
    def __init__(self, hidden, **kw):
        super(BinaryCell, self).__init__(**kw)
        with self.name_scope():
            self.x2h = nn.Dense(5 * hidden, flatten=False)          # deferred in_units
            self.l2h = nn.Dense(5 * hidden, in_units=hidden, use_bias=False)
            self.r2h = nn.Dense(5 * hidden, in_units=hidden, use_bias=False)
        self.hidden = hidden

    def hybrid_forward(self, F, x, hl, cl, hr, cr):
        g = self.x2h(x) + self.l2h(hl) + self.r2h(hr)
        i, fl, fr, o, u = F.split(g, num_outputs=5, axis=1)
        c = F.sigmoid(i) * F.tanh(u) + F.sigmoid(fl) * cl + F.sigmoid(fr) * cr
        return F.sigmoid(o) * F.tanh(c), c


class BinaryTreeNet(gluon.Block):
    def __init__(self, hidden=5, **kw):
        super(BinaryTreeNet, self).__init__(**kw)
        with self.name_scope():
            self.cell = BinaryCell(hidden)
            self.out = nn.Dense(1, in_units=hidden)
        self.hidden = hidden

    def forward(self, xs, tree):
        zero = nd.zeros((1, self.hidden))
        st = {}
        for n in tree.postorder():
            if n.children:
                (hl, cl), (hr, cr) = st[id(n.children[0])], st[id(n.children[1])]
            else:
                hl = cl = hr = cr = zero
            st[id(n)] = self.cell(xs[n.idx:n.idx + 1], hl, cl, hr, cr)
        return self.out(st[id(tree)][0])


def binary_model():
    net = BinaryTreeNet()
    net.initialize(mx.init.Uniform(0.5))
    return net


def binary_samples(rng, n, depth=None):
    out = []
    for _ in range(n):
        d = depth or int(rng.integers(1, 5))
        tree, size = full_binary(d)
        out.append((nd.array(rng.normal(size=(size, 4))), tree))
    return out


def binary_apply(net, s):
    y = net(s[0], s[1])
    return y, nd.sum(y * y)


# -- GRU over variable-length sequences ---------------------------------------------------
class SeqNet(gluon.Block):
    def __init__(self, hidden=6, **kw):
        super(SeqNet, self).__init__(**kw)
        with self.name_scope():
            self.gru = gluon.rnn.GRUCell(hidden, input_size=3)
            self.head = nn.Dense(2, in_units=hidden)
        self.hidden = hidden

    def forward(self, seq):
        h = [nd.zeros((1, self.hidden))]
        for t in range(seq.shape[0]):
            out, h = self.gru(seq[t:t + 1], h)
        return self.head(out)


def seq_model():
    net = SeqNet()
    net.initialize(mx.init.Uniform(0.5))
    return net


def seq_samples(rng, n):
    return [(nd.array(rng.normal(size=(int(rng.integers(1, 7)), 3))),) for _ in range(n)]


def seq_apply(net, s):
    y = net(s[0])
    return y, nd.sum(nd.tanh(y)) * 0.5


# -- a DAG mixing two block types and NDArray operators ----------------------------------
class Mixer(HybridBlock):
    def __init__(self, **kw):
        super(Mixer, self).__init__(**kw)
        with self.name_scope():
            self.a = nn.Dense(4, in_units=4)
            self.b = nn.Dense(4, in_units=4)

    def hybrid_forward(self, F, x, y):
        return F.tanh(self.a(x)) * F.sigmoid(self.b(y)), x - y


class DagNet(gluon.Block):
    def __init__(self, **kw):
        super(DagNet, self).__init__(**kw)
        with self.name_scope():
            self.enc = nn.Dense(4, in_units=3, activation="tanh")
            self.mix = Mixer()
            self.plain = nn.Dense(2, in_units=8)   # never flagged: forces its inputs
        self.plain_hybrid = False

    def forward(self, xs):
        hs = [self.enc(xs[i:i + 1]) for i in range(xs.shape[0])]
        acc = hs[0]
        for i, h in enumerate(hs[1:]):
            m, d = self.mix(acc, h * 0.5 + 1)
            acc = nd.relu(m) + nd.expand_dims(nd.sum(d, axis=1), axis=1) * 0.1 + h[0:1]
        feats = nd.concat(acc, nd.add_n(*hs) / len(hs), dim=1)
        return feats.reshape((1, 8)).sum(axis=0, keepdims=True) * 1.0


def dag_model():
    net = DagNet()
    net.initialize(mx.init.Uniform(0.5))
    return net


def dag_samples(rng, n):
    return [(nd.array(rng.normal(size=(int(rng.integers(1, 5)), 3))),) for _ in range(n)]


def dag_apply(net, s):
    y = net(s[0])
    return y, nd.sum(net.plain(y) ** 2)


MODELS = {
    "childsum": (childsum_model, childsum_samples, childsum_apply),
    "childsum_padded": (childsum_padded_model, childsum_samples, childsum_apply),
    "binary": (binary_model, binary_samples, binary_apply),
    "gru": (seq_model, seq_samples, seq_apply),
    "dag": (dag_model, dag_samples, dag_apply),
}


# -- an RNN over a per-sample sequence with contrib.foreach (issue 19) -------------------
class ScanRNN(HybridBlock):
    """An RNN over the rows of a per-sample ``(T, width)`` sequence with
    ``contrib.foreach``, its state starting at zero for each sample: the loop
    scans axis 0, across merged samples, so its calls must run one per sample."""

    def __init__(self, width, **kw):
        super(ScanRNN, self).__init__(**kw)
        self.width = width
        with self.name_scope():
            self.i2h = nn.Dense(width, in_units=width)
            self.h2h = nn.Dense(width, in_units=width, use_bias=False)

    def hybrid_forward(self, F, seq):
        def step(x, states):
            h = F.tanh(self.i2h(F.expand_dims(x, axis=0)) + self.h2h(states[0]))
            return h, [h]
        h0 = F.zeros_like(F.slice_axis(seq, axis=0, begin=0, end=1))
        outs, _ = F.contrib.foreach(step, seq, [h0])
        return F.reshape(outs, shape=(-1, self.width))
