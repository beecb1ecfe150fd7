"""Operators on per-sample sequences: ragged signatures on against off, in one process.

A per-sample attention-pooling classifier written as a user writes it: each
sample's tokens embedded ``(T, E)`` (``T`` its own, 3-40), projected, scored
against a query made from the sample's mean row (a ``(T, E)`` by ``(1, E)``
broadcast), a softmax over the sample's rows (axis 0), the weighted rows
summed (a pool over axis 0), then classified. Every operator between the
blocks has a per-sample length in its arguments: with ragged signatures
(``jitbatch.gluon.opkeys.ragged_lead``, the default) each runs in one launch
for every length, without them one launch per length present. The same
network, the switch flipped by turns, interleaved rounds; prints milliseconds
per minibatch and the ratio (off / on) for inference and training.

    OMP_NUM_THREADS=1 python scripts/bench_ragged.py
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon, nd  # noqa: E402

import jitbatch  # noqa: E402,F401  (installs the hook)
from jitbatch.gluon import opkeys  # noqa: E402


class AttentionPool(gluon.Block):
    """One sample's token ids -> (1, classes) logits."""

    def __init__(self, vocab=100, embed=64, classes=4, **kwargs):
        super(AttentionPool, self).__init__(**kwargs)
        self.scale = float(np.sqrt(embed))
        with self.name_scope():
            self.embed = gluon.nn.Embedding(vocab, embed)
            self.proj = gluon.nn.Dense(embed, in_units=embed, flatten=False, activation="tanh")
            self.query = gluon.nn.Dense(embed, in_units=embed)
            self.out = gluon.nn.Dense(classes, in_units=embed)

    def forward(self, ids):  # pylint: disable=arguments-differ
        h = self.proj(self.embed(ids))                              # (T, E)
        q = self.query(nd.mean(h, axis=0, keepdims=True))           # (1, E)
        scores = nd.sum(h * q, axis=1, keepdims=True) / self.scale  # (T, 1)
        weights = nd.softmax(scores, axis=0)
        return self.out(nd.sum(weights * h, axis=0, keepdims=True))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median taken)")
    ap.add_argument("--batches", type=int, default=4, help="timed minibatches per round")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    mx.random.seed(args.seed)
    net = AttentionPool()
    net.initialize(mx.init.Xavier())
    net.hybridize(dynamic_batch=True)
    trainer = gluon.Trainer(net.collect_params(), "adagrad", {"learning_rate": 0.01})
    loss = gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.default_rng(args.seed)

    def tokens():
        return nd.array(rng.integers(0, 100, int(rng.integers(3, 41))))
    infer_set = [tokens() for _ in range(128)]
    train_set = [(tokens(), nd.array([int(rng.integers(0, 4))])) for _ in range(32)]

    def infer():
        nd.concat(*[net(x) for x in infer_set], dim=0).wait_to_read()

    def train():
        with autograd.record():
            total = nd.add_n(*[loss(net(x), y) for x, y in train_set])
        total.backward()
        trainer.step(len(train_set))
        total.wait_to_read()

    ragged = opkeys.ragged_lead
    switch = {"ragged": ragged, "exact": lambda metas, loose: None}
    print("per-sample attention pooling, 3-40 tokens; ms per minibatch, median of %d "
          "interleaved rounds" % args.rounds)
    try:
        for name, step in (("inference, 128 samples", infer), ("training, 32 samples", train)):
            for mode in ("ragged", "exact", "ragged", "exact"):      # warm both up
                opkeys.ragged_lead = switch[mode]
                step()
            times = {m: [] for m in switch}
            for _ in range(args.rounds):
                for mode in switch:
                    opkeys.ragged_lead = switch[mode]
                    step()
                    t0 = time.perf_counter()
                    for _ in range(args.batches):
                        step()
                    times[mode].append((time.perf_counter() - t0) / args.batches * 1e3)
            on, off = (statistics.median(times[m]) for m in ("ragged", "exact"))
            print("%-24s ragged %6.1f ms  exact %6.1f ms  ragged is %.2fx faster"
                  % (name, on, off, off / on), flush=True)
    finally:
        opkeys.ragged_lead = ragged


if __name__ == "__main__":
    main()
