"""Overhead where batching cannot pay: a single sample, and a single chain.

Per-sample hybridized Gluon vs jitbatch (policy 'auto') on (1) one Tree-LSTM
pair at a time, read before the next (inference and training), and (2) a GRU
over one long sequence (a chain: nothing can merge). Interleaved rounds in one
process; prints the ratio jitbatch / hybridized (1.00 = no overhead).

    OMP_NUM_THREADS=1 python scripts/bench_overhead.py
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import numpy as np  # noqa: E402
from mxnet import gluon, nd  # noqa: E402

import jitbatch  # noqa: E402
from bench_core import Runner, ensure_full_data, load_pairs  # noqa: E402


class Chain(gluon.Block):
    def __init__(self, hidden=150, **kw):
        super(Chain, self).__init__(**kw)
        with self.name_scope():
            self.cell = gluon.rnn.GRUCell(hidden, input_size=hidden)
        self.hidden = hidden

    def forward(self, xs):
        h = [nd.zeros((1, self.hidden))]
        for t in range(xs.shape[0]):
            out, h = self.cell(xs[t:t + 1], h)
        return out


def timed(fn, reps):
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=200, help="chain length")
    args = ap.parse_args(argv)
    pairs, vocab = load_pairs(ensure_full_data(os.path.join(ROOT, "data", "sick_full")), args.pairs)
    run = Runner(vocab)
    chain = Chain()
    chain.initialize()
    xs = nd.array(np.random.default_rng(0).normal(size=(args.steps, 150)))

    def pair_infer():
        for s in pairs:
            run.net(*s[:4]).asnumpy()

    def pair_train():
        for s in pairs:
            run.step([s])

    def chain_infer():
        chain(xs).asnumpy()

    # timed runs per round: on the chain 'auto' runs calls eagerly for a while
    # (cost.Model.passthrough_after: 4 chains' worth) and then records one again
    # to re-check; 10 runs hold two such re-recorded chains, the steady state
    cases = [("one pair at a time, inference", run.net, pair_infer, 2),
             ("one pair at a time, training", run.net, pair_train, 2),
             ("one chain of %d GRU steps" % args.steps, chain, chain_infer, 10)]
    print("jitbatch 'auto' vs per-sample hybridized; median of %d interleaved rounds"
          % args.rounds)
    for name, net, fn, reps in cases:
        ratios = []
        for _ in range(args.rounds):
            net.hybridize()
            fn()
            hyb = timed(fn, reps)
            net.hybridize(dynamic_batch=True)
            fn()
            jit = timed(fn, reps)
            ratios.append(jit / hyb)
        print("%-40s time ratio %.3f  (%s)" % (name, statistics.median(ratios),
                                              jitbatch.stats()["last_flush"].get("why", "")))


if __name__ == "__main__":
    main()
