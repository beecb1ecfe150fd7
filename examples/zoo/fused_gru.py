"""The GRU classifier of :mod:`examples.zoo.gru_seq` written with the fused
layer ``gluon.rnn.GRU`` instead of a ``GRUCell`` loop.

Per sample (``T`` tokens, 3-40): one ``nd.array`` of the ids, one embedding
lookup, the sequence through the layer in ONE call (no states given), its last
step's output classified. ``layout``: 'TNC' (Gluon's default; the sample is
``(T, 1, E)``) or 'NTC' (``(1, T, E)``).

Under ``hybridize(dynamic_batch=True)`` the calls of samples of one length
merge in either layout (jitbatch makes the zero begin states inside the
launch, and in TNC lays the merged samples along the layer's batch axis 1).

Hand-batched reference: bucketed by length, one layer call per distinct
length on the batch of that bucket's sequences, the last steps put back in
sample order (one ``take``)."""
import numpy as np
from mxnet import gluon, nd
from mxnet.gluon import nn

from .common import cross_entropy, index_array, labels_of, seeded
from .gru_seq import CLASSES, generate

__all__ = ["FusedGRUClassifier", "build", "generate", "forward", "loss", "HandBatched"]


class FusedGRUClassifier(gluon.Block):
    def __init__(self, vocab, embed, hidden, layout="TNC", **kwargs):
        super(FusedGRUClassifier, self).__init__(**kwargs)
        self.layout = layout
        with self.name_scope():
            self.embed = nn.Embedding(vocab, embed)
            self.rnn = gluon.rnn.GRU(hidden, layout=layout, input_size=embed)
            self.out = nn.Dense(CLASSES, in_units=hidden)

    def forward(self, ids):  # pylint: disable=arguments-differ
        if self.layout == "NTC":
            seq = self.embed(nd.array(ids)).expand_dims(axis=0)   # (1, T, E)
            return self.out(self.rnn(seq)[:, len(ids) - 1])       # of (1, T, H)
        seq = self.embed(nd.array(ids)).expand_dims(axis=1)       # (T, 1, E)
        steps = self.rnn(seq)                                     # (T, 1, H)
        return self.out(steps[len(ids) - 1])


def build(seed=0, vocab=100, embed=64, hidden=96, layout="TNC"):
    return seeded(FusedGRUClassifier(vocab, embed, hidden, layout), seed)


def forward(net, sample):
    return net(sample.ids)


def loss(net, sample, out):  # pylint: disable=unused-argument
    return cross_entropy(out, sample.target)


class HandBatched(object):
    """One fused-layer call per distinct sequence length (module docstring)."""

    def __init__(self, net):
        self.net = net

    def forward(self, samples):
        net = self.net
        buckets = {}
        for i, s in enumerate(samples):
            buckets.setdefault(len(s.ids), []).append(i)
        lengths = sorted(buckets)
        ntc = net.layout == "NTC"
        # ids of every bucket in one array: time-major within a bucket (TNC),
        # sample-major (NTC)
        ids = [samples[i].ids[t] for n in lengths
               for i, t in ([(i, t) for i in buckets[n] for t in range(n)] if ntc else
                            [(i, t) for t in range(n) for i in buckets[n]])]
        emb = net.embed(nd.array(ids))
        lasts, order, at = [], [], 0
        for n in lengths:
            members = buckets[n]
            rows = emb[at:at + n * len(members)]
            at += n * len(members)
            if ntc:
                seq = rows.reshape((len(members), n, -1))
                lasts.append(net.rnn(seq)[:, n - 1])           # (members, H)
            else:
                seq = rows.reshape((n, len(members), -1))
                lasts.append(net.rnn(seq)[n - 1])              # (members, H)
            order.extend(members)
        last = nd.take(nd.concat(*lasts, dim=0), index_array(np.argsort(order)))
        return net.out(last)

    def loss(self, samples, outs):
        return cross_entropy(outs, labels_of(samples, outs.context))
