"""Speed of dynamic batching vs per-sample Gluon on the child-sum Tree-LSTM.

Training steps (minibatch of --batch-size pairs: forward, one backward, Adagrad
update) on SICK-shaped trees, one thread. The configurations are measured in
interleaved rounds inside ONE process, and ratios are taken per round, so a
noisy machine moves them all alike. Prints pairs/s and the speedup over
per-sample hybridized Gluon.

    OMP_NUM_THREADS=1 python scripts/bench_core.py
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
from tqdm import tqdm  # noqa: E402

import jitbatch  # noqa: E402
from examples.tree_lstm import data as D  # noqa: E402
from examples.tree_lstm.model import SimilarityTreeLSTM  # noqa: E402


def ensure_full_data(path):
    if not os.path.isdir(os.path.join(path, "train")):
        sys.path.insert(0, os.path.join(ROOT, "scripts"))
        import make_sick_like
        make_sick_like.main(["--full", "--out", path, "--quiet"])
    return path


def load_pairs(path, n):
    splits, vocab = D.load_dataset(path, splits=("train",))
    pairs = splits["train"][:n]
    enc = []
    for p in pairs:
        a, b = D.encode(p, vocab)
        enc.append((nd.array(a), p.a_tree, nd.array(b), p.b_tree,
                    nd.array(D.target_distribution(p.score)[None, :])))
    return enc, len(vocab)


class Runner(object):
    """One model, switched between execution modes; the same parameters for all."""

    def __init__(self, vocab_size, seed=0, embed_update="dense"):
        mx.random.seed(seed)
        # embed_update: how the embedding is trained (see model.EMBED_UPDATES);
        # the model sets the embedding's grad_req / sparse_grad / wd_mult itself
        self.net = SimilarityTreeLSTM(vocab_size, embed_update=embed_update)
        self.net.initialize(mx.init.Xavier())
        self.loss = gluon.loss.KLDivLoss(from_logits=True)
        self.trainer = gluon.Trainer(self.net.collect_params(), "adagrad",
                                     {"learning_rate": 0.02, "wd": 1e-4})

    def mode(self, name):
        if name == "plain":
            self.net.hybridize(active=False)
        elif name == "hybrid":
            self.net.hybridize()
        else:
            # 'jit:POLICY' declares the cell's child axis zero-paddable (exact for
            # the child-sum cell: see examples/tree_lstm/model.py); 'jit:POLICY:nopad'
            # does not, so calls with different child counts never merge;
            # ':block' / ':split' fix the granularity (default: 'auto'); ':nopipe'
            # turns pipelined flushes off (jitbatch.config.pipeline); ':noact' keeps
            # MXNet's own activation operators (jitbatch.config.fast_activations)
            parts = name.split(":")
            jitbatch.config.pipeline = "nopipe" not in parts[2:]
            jitbatch.config.fast_activations = "noact" not in parts[2:]
            if "nopad" in parts[2:]:
                jitbatch.zero_pad(self.net.encoder.cell)
            else:
                jitbatch.zero_pad(self.net.encoder.cell, ch=1, cc=1)
            gran = "split" if "split" in parts[2:] else ("block" if "block" in parts[2:]
                                                         else "auto")
            self.net.hybridize(dynamic_batch=True, policy=parts[1], granularity=gran)

    def step(self, batch, update=True):
        with autograd.record():
            losses = [self.loss(self.net(*s[:4]), s[4]) for s in batch]
            total = nd.add_n(*losses)
        total.backward()
        if update:
            self.trainer.step(len(batch))
        return total.asscalar()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "sick_full"))
    ap.add_argument("--batch-size", type=int, default=25)
    ap.add_argument("--batches", type=int, default=4, help="minibatches per config per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="plain,hybrid,jit:auto,jit:depth,jit:agenda")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    need = args.batch_size * args.batches
    pairs, vocab = load_pairs(ensure_full_data(args.data), need * 2)
    run = Runner(vocab)
    # same first-minibatch loss everywhere (no update): the batched run is the same model
    first = {}
    for m in modes:
        run.mode(m)
        first[m] = run.step(pairs[:args.batch_size], update=False)
    ref = first[modes[0]]
    for m in modes:
        if not np.isclose(first[m], ref, rtol=1e-4):
            raise SystemExit("loss mismatch on the first minibatch: %s %r vs %s %r"
                             % (m, first[m], modes[0], ref))
    rates = {m: [] for m in modes}
    bar = tqdm(total=args.rounds * len(modes), desc="bench", leave=False)
    for r in range(args.rounds):
        for m in modes:
            run.mode(m)
            run.step(pairs[need:need + args.batch_size])     # warm caches for this mode
            jitbatch.reset_stats()
            t = time.perf_counter()
            for i in range(args.batches):
                run.step(pairs[i * args.batch_size:(i + 1) * args.batch_size])
            rates[m].append(need / (time.perf_counter() - t))
            bar.update()
    bar.close()
    base = "hybrid" if "hybrid" in modes else modes[0]
    print("child-sum Tree-LSTM training, minibatch %d pairs, OMP_NUM_THREADS=%s, %d rounds"
          % (args.batch_size, os.environ.get("OMP_NUM_THREADS"), args.rounds))
    print("first-minibatch loss %.6f, equal in every mode" % ref)
    print("%-12s %10s %12s" % ("mode", "pairs/s", "vs " + base))
    for m in modes:
        ratio = statistics.median(a / b for a, b in zip(rates[m], rates[base]))
        print("%-12s %10.1f %11.2fx" % (m, statistics.median(rates[m]), ratio))
    return rates


if __name__ == "__main__":
    main()
