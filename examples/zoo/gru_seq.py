"""GRU over variable-length sequences, classified from the last state.

Per sample (``T`` tokens, 3-40): one ``nd.array`` of the token ids, one
embedding lookup, the cell's ``begin_state`` (an ``nd.zeros``), ``T`` calls of
a ``gluon.rnn.GRUCell`` in a Python loop, one output call.

Hand-batched reference: packed sequences (as PyTorch's
``pack_padded_sequence``): the minibatch sorted by length, longest first, so the
sequences still running at step ``t`` are a prefix of it; step ``t`` runs the
cell once on that prefix, and each sequence's last state is kept from the step
it ends at. One embedding lookup for all tokens, laid out step-major so each
step's inputs are a row range."""
import numpy as np
from mxnet import gluon, nd
from mxnet.gluon import nn

from .common import cross_entropy, index_array, labels_of, seeded

__all__ = ["GRUClassifier", "SeqSample", "build", "generate", "forward", "loss",
           "HandBatched", "CLASSES"]

CLASSES = 4


class GRUClassifier(gluon.Block):
    def __init__(self, vocab, embed, hidden, **kwargs):
        super(GRUClassifier, self).__init__(**kwargs)
        with self.name_scope():
            self.embed = nn.Embedding(vocab, embed)
            self.cell = gluon.rnn.GRUCell(hidden, input_size=embed)
            self.out = nn.Dense(CLASSES, in_units=hidden)

    def forward(self, ids):  # pylint: disable=arguments-differ
        emb = self.embed(nd.array(ids))                 # (T, E)
        state = self.cell.begin_state(batch_size=1)
        for t in range(len(ids)):
            out, state = self.cell(emb[t:t + 1], state)
        return self.out(out)


class SeqSample(object):
    """Token ids (a Python list) and the class, as an int and as a (1,) NDArray."""
    __slots__ = ("ids", "label", "target")

    def __init__(self, ids, label):
        self.ids = ids
        self.label = label
        self.target = nd.array([label])


def generate(rng, n, vocab=100, min_len=3, max_len=40):
    """``n`` sequences of ``min_len``..``max_len`` tokens; the class is the
    most frequent token's residue mod CLASSES (ties: the smallest token)."""
    out = []
    for _ in range(n):
        ids = [int(t) for t in rng.integers(0, vocab, int(rng.integers(min_len, max_len + 1)))]
        out.append(SeqSample(ids, int(np.bincount(ids).argmax()) % CLASSES))
    return out


def build(seed=0, vocab=100, embed=64, hidden=96):
    return seeded(GRUClassifier(vocab, embed, hidden), seed)


def forward(net, sample):
    return net(sample.ids)


def loss(net, sample, out):  # pylint: disable=unused-argument
    return cross_entropy(out, sample.target)


def pack(seqs):
    """Packed layout of token-id lists: ``order`` (longest first), per step the
    number of sequences still running, and the ids step-major."""
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    lengths = [len(seqs[i]) for i in order]
    running = [sum(1 for n in lengths if n > t) for t in range(lengths[0])]
    ids = [seqs[order[b]][t] for t, n in enumerate(running) for b in range(n)]
    return order, running, ids


def run_packed(cell, emb, running):
    """The cell over packed inputs ``emb`` (rows step-major); returns every step's
    states (each (running[t], H)) and the last state of each sequence, in packed
    order, as one (B, H) array."""
    state = cell.begin_state(batch_size=running[0], ctx=emb.context)
    at, steps, finals = 0, [], []
    for t, n in enumerate(running):
        out, state = cell(emb[at:at + n], [s[:n] for s in state])
        at += n
        steps.append(out)
        nxt = running[t + 1] if t + 1 < len(running) else 0
        if nxt < n:                               # sequences nxt..n-1 end at step t
            finals.append(out[nxt:n])
    # finals run from the shortest sequences to the longest: reverse to packed order
    return steps, nd.concat(*reversed(finals), dim=0)


class HandBatched(object):
    """Packed-sequence batching of the same blocks (see the module docstring)."""

    def __init__(self, net):
        self.net = net

    def forward(self, samples):
        net = self.net
        order, running, ids = pack([s.ids for s in samples])
        emb = net.embed(nd.array(ids))
        _, last = run_packed(net.cell, emb, running)
        unsort = np.argsort(order)
        return net.out(nd.take(last, index_array(unsort)))

    def loss(self, samples, outs):
        return cross_entropy(outs, labels_of(samples, outs.context))
