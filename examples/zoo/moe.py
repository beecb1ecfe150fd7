"""Mixture of EXPERTS experts, one expert per sample (top-1 routing).

Per sample (a bag of 3-20 token ids): one ``nd.array`` of the ids, one
embedding lookup, their mean, the gate (a Dense block) and its softmax; the
expert is chosen in Python, and its output is scaled by its gate
probability (so the gate is trained, as in top-1 mixtures of experts); a
Dense head gives CLASSES logits. Two ways to choose, two zoo entries:

* ``routing='gate'`` (zoo model ``moe``): the argmax of the gate, read with
  ``.asscalar()``, as users write it. The read needs the value now: under
  jitbatch it forces a flush of everything pending, per sample, so samples'
  calls can only merge within what is pending at each read (the previous
  sample's expert and loss with this sample's gate);
* ``routing='domain'`` (zoo model ``moe_domain``): the sample's own domain
  id (data, known in Python), so nothing is read and every sample's calls stay
  pending until the loss is read.

Hand-batched reference: the gate for the whole minibatch in one call, the
chosen experts read back in one copy, then per expert one call on its samples'
rows (``take``), the rows put back in sample order (one ``take``), scaled by
their gate probabilities (``pick``), one head call."""
import numpy as np
from mxnet import gluon, nd
from mxnet.gluon import nn

from .common import cross_entropy, index_array, labels_of, seeded

__all__ = ["MixtureOfExperts", "BagSample", "build", "generate", "forward", "loss",
           "HandBatched", "EXPERTS", "CLASSES", "ROUTINGS"]

EXPERTS = 8
CLASSES = 4
ROUTINGS = ("gate", "domain")


class MixtureOfExperts(gluon.Block):
    def __init__(self, vocab, embed, hidden, routing="gate", **kwargs):
        super(MixtureOfExperts, self).__init__(**kwargs)
        if routing not in ROUTINGS:
            raise ValueError("routing=%r: expected one of %s" % (routing, ROUTINGS))
        self.routing = routing
        with self.name_scope():
            self.embed = nn.Embedding(vocab, embed)
            self.gate = nn.Dense(EXPERTS, in_units=embed)
            self.experts = nn.HybridSequential()    # a container: indexed, never called
            for _ in range(EXPERTS):
                expert = nn.HybridSequential()
                expert.add(nn.Dense(hidden, in_units=embed, activation="relu"),
                           nn.Dense(hidden, in_units=hidden, activation="relu"))
                self.experts.add(expert)
            self.head = nn.Dense(CLASSES, in_units=hidden)

    def forward(self, ids, domain):  # pylint: disable=arguments-differ
        x = self.embed(nd.array(ids)).mean(axis=0, keepdims=True)    # (1, E)
        logits = self.gate(x)
        if self.routing == "gate":
            k = int(logits.argmax(axis=1).asscalar())
        else:
            k = domain
        p = nd.softmax(logits)
        return self.head(self.experts[k](x) * p[:, k:k + 1])


class BagSample(object):
    """Token ids (a Python list), the domain id, and the class, as an int and as
    a (1,) NDArray."""
    __slots__ = ("ids", "domain", "label", "target")

    def __init__(self, ids, domain, label):
        self.ids = ids
        self.domain = domain
        self.label = label
        self.target = nd.array([label])


def generate(rng, n, vocab=100, min_len=3, max_len=20):
    """``n`` bags of ``min_len``..``max_len`` tokens, each with a random domain
    (0..EXPERTS-1); the class is the sum of the ids plus the domain, mod CLASSES."""
    out = []
    for _ in range(n):
        ids = [int(t) for t in rng.integers(0, vocab, int(rng.integers(min_len, max_len + 1)))]
        domain = int(rng.integers(0, EXPERTS))
        out.append(BagSample(ids, domain, (sum(ids) + domain) % CLASSES))
    return out


def build(seed=0, vocab=100, embed=64, hidden=96, routing="gate"):
    return seeded(MixtureOfExperts(vocab, embed, hidden, routing), seed)


def forward(net, sample):
    return net(sample.ids, sample.domain)


def loss(net, sample, out):  # pylint: disable=unused-argument
    return cross_entropy(out, sample.target)


class HandBatched(object):
    """Experts grouped by their samples (module docstring)."""

    def __init__(self, net):
        self.net = net

    def forward(self, samples):
        net = self.net
        lengths = [len(s.ids) for s in samples]
        emb = net.embed(nd.array([t for s in samples for t in s.ids]))     # (T, E)
        ctx = emb.context
        # each bag's mean: its rows summed (padded with a zero row) over its length
        rows = np.full((len(samples), max(lengths)), emb.shape[0], dtype=np.int64)
        starts = np.cumsum([0] + lengths)
        for b, n in enumerate(lengths):
            rows[b, :n] = np.arange(starts[b], starts[b + 1])
        table = nd.concat(emb, nd.zeros((1, emb.shape[1]), ctx=ctx), dim=0)
        bag = nd.take(table, index_array(rows, ctx))                       # (B, L, E)
        ones = nd.ones((len(samples), 1, rows.shape[1]), ctx=ctx)
        x = nd.batch_dot(ones, bag).reshape((len(samples), -1)) / \
            nd.array(lengths, ctx=ctx).reshape((-1, 1))
        logits = net.gate(x)
        if net.routing == "gate":
            chosen = logits.argmax(axis=1).asnumpy().astype(np.int64)       # the one read
        else:
            chosen = np.array([s.domain for s in samples], dtype=np.int64)
        p = nd.softmax(logits)
        parts, order = [], []
        for k in range(EXPERTS):
            members = np.flatnonzero(chosen == k)
            if len(members):
                parts.append(net.experts[k](nd.take(x, index_array(members, ctx))))
                order.extend(members)
        y = nd.take(nd.concat(*parts, dim=0), index_array(np.argsort(order), ctx))
        scale = nd.pick(p, nd.array(chosen, ctx=ctx), axis=1, keepdims=True)
        return net.head(y * scale)

    def loss(self, samples, outs):
        return cross_entropy(outs, labels_of(samples, outs.context))
