"""The GRU classifier of :mod:`examples.zoo.gru_seq` written with the fused
layer ``gluon.rnn.GRU`` (layout TNC: time, batch, features) instead of a
``GRUCell`` loop.

Per sample (``T`` tokens, 3-40): one ``nd.array`` of the ids, one embedding
lookup, the ``(T, 1, E)`` sequence through the layer in ONE call, its last
step's output classified.

Under ``hybridize(dynamic_batch=True)`` this fails today: jitbatch batches a
block along axis 0, which is the time axis here, and the layer's state input
``(layers, 1, H)`` does not scale with it (``BatchingError: ... output shapes
cannot be inferred``; issue 23, item 3).

Hand-batched reference: bucketed by length, one layer call per distinct
length on the ``(T, n, E)`` batch of that bucket's sequences, the last steps
put back in sample order (one ``take``)."""
import numpy as np
from mxnet import gluon, nd
from mxnet.gluon import nn

from .common import cross_entropy, index_array, labels_of, seeded
from .gru_seq import CLASSES, generate

__all__ = ["FusedGRUClassifier", "build", "generate", "forward", "loss", "HandBatched"]


class FusedGRUClassifier(gluon.Block):
    def __init__(self, vocab, embed, hidden, **kwargs):
        super(FusedGRUClassifier, self).__init__(**kwargs)
        with self.name_scope():
            self.embed = nn.Embedding(vocab, embed)
            self.rnn = gluon.rnn.GRU(hidden, layout="TNC", input_size=embed)
            self.out = nn.Dense(CLASSES, in_units=hidden)

    def forward(self, ids):  # pylint: disable=arguments-differ
        seq = self.embed(nd.array(ids)).expand_dims(axis=1)   # (T, 1, E)
        steps = self.rnn(seq)                                 # (T, 1, H)
        return self.out(steps[len(ids) - 1])


def build(seed=0, vocab=100, embed=64, hidden=96):
    return seeded(FusedGRUClassifier(vocab, embed, hidden), seed)


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
        # ids of every bucket, time-major within it, in one array
        ids = [samples[i].ids[t] for n in lengths for t in range(n) for i in buckets[n]]
        emb = net.embed(nd.array(ids))
        lasts, order, at = [], [], 0
        for n in lengths:
            members = buckets[n]
            seq = emb[at:at + n * len(members)].reshape((n, len(members), -1))
            at += n * len(members)
            lasts.append(net.rnn(seq)[n - 1])                  # (members, H)
            order.extend(members)
        last = nd.take(nd.concat(*lasts, dim=0), index_array(np.argsort(order)))
        return net.out(last)

    def loss(self, samples, outs):
        return cross_entropy(outs, labels_of(samples, outs.context))
