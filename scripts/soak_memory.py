"""Long run: resident memory and cache sizes over thousands of Tree-LSTM
minibatches under dynamic batching (training, then inference).

    OMP_NUM_THREADS=1 python scripts/soak_memory.py --train-batches 2000 --infer-batches 300

Prints RSS at checkpoints and fails (exit 1) if it grew by more than --max-growth
MB between the end of warm-up and the end of each phase. Uses small model sizes
by default so thousands of minibatches take minutes; the graph, the signature
table and the caches behave the same at any size.
"""
import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon, nd  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jitbatch  # noqa: E402
from bench_core import ensure_full_data, load_pairs  # noqa: E402
from examples.tree_lstm.model import SimilarityTreeLSTM  # noqa: E402


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train-batches", type=int, default=2000)
    ap.add_argument("--infer-batches", type=int, default=300)
    ap.add_argument("--pairs", type=int, default=1000, help="distinct pairs cycled through")
    ap.add_argument("--embed-size", type=int, default=50)
    ap.add_argument("--hidden-size", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--max-growth", type=float, default=30.0, help="MB")
    args = ap.parse_args(argv)
    pairs, vocab = load_pairs(ensure_full_data(os.path.join(ROOT, "data", "sick_full")), args.pairs)
    mx.random.seed(0)
    net = SimilarityTreeLSTM(vocab, args.embed_size, args.hidden_size, sim_hidden=20)
    net.initialize(mx.init.Xavier())
    net.hybridize(dynamic_batch=True)
    loss_fn = gluon.loss.KLDivLoss(from_logits=True)
    trainer = gluon.Trainer(net.collect_params(), "adagrad", {"learning_rate": 0.02})
    failures = []
    for phase, n, size in (("training", args.train_batches, 25),
                           ("inference", args.infer_batches, 256)):
        marks = []
        for i in tqdm(range(n), desc=phase, mininterval=2):
            start = (i * size) % (len(pairs) - size)
            batch = pairs[start:start + size]
            if phase == "training":
                with autograd.record():
                    total = nd.add_n(*[loss_fn(net(*s[:4]), s[4]) for s in batch])
                total.backward()
                trainer.step(size)
                total.asscalar()
            else:
                nd.concat(*[net(*s[:4]) for s in batch], dim=0).asnumpy()
            warm = min(args.warmup, n)
            if i + 1 == warm or (i + 1 > warm and (i + 1) % max(n // 5, 1) == 0) or i + 1 == n:
                marks.append((i + 1, rss_mb()))
        print("%s: RSS MB at minibatch %s; signatures cached %d"
              % (phase, ", ".join("%d: %.1f" % m for m in marks), len(jitbatch.gluon.signatures.TABLE)))
        growth = marks[-1][1] - marks[0][1]
        if growth > args.max_growth:
            failures.append("%s grew %.1f MB after warm-up" % (phase, growth))
    st = jitbatch.stats()
    print("nodes %d, launches %d, flushes %d, failures %d" % (st["nodes"], st["launches"],
                                                              st["flushes"], st["failures"]))
    if failures:
        print("FAIL: " + "; ".join(failures))
        return 1
    print("resident memory flat (within %.0f MB after warm-up)" % args.max_growth)
    return 0


if __name__ == "__main__":
    sys.exit(main())
