"""Train the child-sum Tree-LSTM on SICK-style semantic relatedness
(Tai, Socher & Manning, 2015), per-sample model code with dynamic batching.

    python -m examples.tree_lstm.train                     # bundled data, dynamic batching
    python -m examples.tree_lstm.train --no-dynamic-batch  # plain per-sample Gluon
    python examples/tree_lstm/train.py --data data/sick_full --word-embed glove.840B.300d.txt

Each minibatch records the forward pass of all its pairs under one
``autograd.record()``, sums the per-pair KL losses and calls ``backward`` once;
with ``--dynamic-batch`` (the default) jitbatch merges the pairs' tree-node
computations into batched launches.  The predicted relatedness is the expected
value of the class distribution; dev Pearson r is measured before training
("epoch 0") and after each epoch, and the test split is scored with the
parameters of the best dev epoch.  Writes ``metrics.json`` and
``learning_curve.png`` to ``--out``.
"""
import argparse
import json
import math
import os
import re
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import mxnet as mx  # noqa: E402
from mxnet import autograd, nd  # noqa: E402

import jitbatch  # noqa: E402  (installs the hybridize(dynamic_batch=...) hook)
from examples.tree_lstm import data as D  # noqa: E402
from examples.tree_lstm import dist  # noqa: E402
from examples.tree_lstm.model import (EMBED_UPDATES, SimilarityTreeLSTM,  # noqa: E402
                                      expected_score, kl_loss)

NUM_CLASSES = 5
EVAL_CHUNK = 256
_CTX_RE = re.compile(r"^\s*(cpu|gpu)\s*(?:(?:\(\s*(\d+)\s*\))|(?::\s*(\d+)))?\s*$", re.I)


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------

#: the data and vectors of the default job (scripts/make_sick_like.py, see README.rst)
DEFAULT_DATA = "data/sick_medium"
#: what --embed-size means without vectors to take it from (Tai et al.'s GloVe size)
DEFAULT_EMBED_SIZE = 300


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help; an option whose default is None or
    off says in its help what happens without it instead."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m examples.tree_lstm.train", formatter_class=_Formatter,
        description="Child-sum Tree-LSTM semantic relatedness training (Tai et al. 2015) "
                    "with jitbatch dynamic batching.",
        epilog="Spellings of the MXNet tree_lstm example and of treelstm.pytorch are accepted "
               "as aliases (--word_embed, --glove, --batch_size, --batchsize, --use-gpu, "
               "--cuda, --freeze_embed, --sparse, --input_dim, --mem_dim, --hidden_dim, "
               "--optim, ...). Note treelstm.pytorch's meanings: --mem_dim is the Tree-LSTM "
               "state size (--hidden-size here), --hidden_dim the similarity layer's size "
               "(--sim-hidden here).")
    sup = argparse.SUPPRESS
    g = p.add_argument_group("data")
    g.add_argument("--data", default=DEFAULT_DATA, metavar="DIR",
                   help="SICK-layout directory with train/dev/test")
    g.add_argument("--word-embed", "--word_embed", "--glove", default="auto", metavar="PATH",
                   help="GloVe-format text vectors to initialise the embedding: a file, a "
                        "directory holding one glove*.txt or vectors*.txt file, 'auto' (such a "
                        "file in --data if there is one, else random vectors) or 'none'. The "
                        "vectors kept for the vocabulary are cached in DIR/%s"
                        % D.VECTOR_CACHE_DIR)
    g.add_argument("--max-pairs", "--max_pairs", type=int, default=None, metavar="N",
                   help="keep only the first N pairs of each split (quick runs; default: all)")
    m = p.add_argument_group("model")
    m.add_argument("--embed-size", "--embed_size", "--input_dim", type=int, default=None,
                   metavar="N",
                   help="word vector size (default: the vectors' dimension, else %d)"
                        % DEFAULT_EMBED_SIZE)
    m.add_argument("--hidden-size", "--hidden_size", "--mem_dim", type=int, default=150,
                   metavar="N", help="Tree-LSTM state size")
    m.add_argument("--sim-hidden", "--sim_hidden", "--hidden_dim", type=int, default=50,
                   metavar="N", help="size of the similarity layer over the two sentence vectors")
    m.add_argument("--embed-update", "--embed_update", default="frozen", choices=EMBED_UPDATES,
                   help="how the word embedding is trained: 'frozen' keeps the vectors fixed "
                        "(Tai et al. for relatedness), 'sparse' updates the rows a minibatch "
                        "used (without weight decay), 'dense' every row every step")
    m.add_argument("--freeze-embed", "--freeze_embed", dest="embed_update", action="store_const",
                   const="frozen", default=sup, help="same as --embed-update frozen")
    m.add_argument("--sparse-embed", "--sparse_embed", "--sparse", dest="embed_update",
                   action="store_const", const="sparse", default=sup,
                   help="same as --embed-update sparse")
    m.add_argument("--dense-embed", "--dense_embed", dest="embed_update", action="store_const",
                   const="dense", default=sup, help="same as --embed-update dense")
    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=int, default=6, help="training epochs; 0 only evaluates")
    t.add_argument("--batch-size", "--batch_size", "--batchsize", type=int, default=25,
                   metavar="N", help="pairs per update")
    t.add_argument("--lr", type=float, default=0.02, help="learning rate")
    t.add_argument("--wd", type=float, default=1e-4, help="weight decay")
    t.add_argument("--optimizer", "--optim", default="adagrad", help="MXNet optimizer name")
    t.add_argument("--seed", type=int, default=0, help="random seed")
    t.add_argument("--ctx", default="cpu", help="cpu, cpu(N), gpu or gpu(N)")
    t.add_argument("--use-gpu", "--use_gpu", "--cuda", dest="ctx", action="store_const",
                   const="gpu", default=sup, help="same as --ctx gpu")
    t.add_argument("--no-cuda", dest="ctx", action="store_const", const="cpu", default=sup,
                   help="same as --ctx cpu")
    e = p.add_argument_group("execution")
    e.add_argument("--dynamic-batch", action=argparse.BooleanOptionalAction, default=True,
                   help="merge per-pair computations with jitbatch; --no-dynamic-batch runs "
                        "plain per-sample Gluon")
    e.add_argument("--hybridize", action="store_true",
                   help="with --no-dynamic-batch: run per-sample hybridized blocks (dynamic "
                        "batching always runs the blocks' hybridized graphs)")
    e.add_argument("--policy", default="auto", choices=list(jitbatch.POLICIES),
                   help="jitbatch scheduling policy")
    e.add_argument("--analysis-budget", "--analysis_budget", type=float, default=None,
                   metavar="FRACTION",
                   help="jitbatch analysis budget for policy 'auto' (default: unbounded)")
    e.add_argument("--granularity", default="auto", choices=["auto", "block", "split"],
                   help="jitbatch granularity: 'split' runs the cell's input projections "
                        "as one launch across all tree levels, 'block' inside each "
                        "level's launch, 'auto' lets the cost model choose")
    e.add_argument("--zero-pad", action=argparse.BooleanOptionalAction, default=True,
                   help="declare the cell's child axis zero-paddable (exact for the "
                        "child-sum cell), so nodes with different child counts share "
                        "launches")
    o = p.add_argument_group("input/output")
    o.add_argument("--save", default=None, metavar="PATH",
                   help="save the best-dev parameters here (net.save_parameters; default: not saved)")
    o.add_argument("--load", default=None, metavar="PATH",
                   help="load parameters before training (with --epochs 0: just evaluate; default: "
                        "a fresh initialisation)")
    o.add_argument("--out", default="runs/tree_lstm", metavar="DIR",
                   help="where metrics.json and learning_curve.png go")
    o.add_argument("--no-plot", action="store_true", help="do not write learning_curve.png")
    o.add_argument("--quiet", action="store_true", help="no progress bars")
    dist.add_arguments(p)
    return p


def parse_ctx(text):
    """``'cpu'``, ``'cpu(0)'``, ``'gpu'``, ``'gpu(1)'``, ``'gpu:1'`` -> mx.Context; ValueError otherwise."""
    m = _CTX_RE.match(text or "")
    if not m:
        raise ValueError("expected cpu, cpu(N), gpu or gpu(N)")
    kind = m.group(1).lower()
    idx = int(m.group(2) or m.group(3) or 0)
    if kind == "gpu":
        try:
            n = mx.context.num_gpus()
        except Exception:  # pylint: disable=broad-except
            n = 0
        if idx >= n:
            raise ValueError("MXNet sees %d GPU(s) in this build/machine" % n)
        return mx.gpu(idx)
    return mx.cpu(idx)


def resolve_word_embed(value, data_dir):
    """The vectors file that ``--word-embed value`` names, or None for random
    vectors; ValueError says why a value names no usable file."""
    if value == "none":
        return None
    if value == "auto":
        found = D.find_vector_files(data_dir)
        if len(found) > 1:
            raise ValueError("'auto' found several vector files in %s (%s): name one"
                             % (data_dir, ", ".join(os.path.basename(f) for f in found)))
        return found[0] if found else None
    if os.path.isdir(value):
        found = D.find_vector_files(value)
        if len(found) != 1:
            raise ValueError("directory %r holds %s glove*.txt / vectors*.txt files%s: name the "
                             "file" % (value, len(found) or "no",
                                       " (%s)" % ", ".join(map(os.path.basename, found))
                                       if found else ""))
        return found[0]
    if not os.path.isfile(value):
        raise ValueError("file %r does not exist" % value)
    return value


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.ctx_obj = parse_ctx(args.ctx)
    except ValueError as err:
        parser.error("argument --ctx/--use-gpu: invalid context %r: %s" % (args.ctx, err))
    if not os.path.isdir(args.data):
        parser.error("argument --data: directory %r does not exist" % args.data)
    try:
        args.word_embed_file = resolve_word_embed(args.word_embed, args.data)
    except ValueError as err:
        parser.error("argument --word-embed: %s" % err)
    if args.embed_size is None:
        args.embed_size = DEFAULT_EMBED_SIZE
        if args.word_embed_file is not None:
            args.embed_size = D.vector_file_dim(args.word_embed_file) or DEFAULT_EMBED_SIZE
    if args.load is not None and not os.path.isfile(args.load):
        parser.error("argument --load: file %r does not exist" % args.load)
    for flag, value, low in (("--epochs", args.epochs, 0), ("--batch-size", args.batch_size, 1),
                             ("--embed-size", args.embed_size, 1),
                             ("--hidden-size", args.hidden_size, 1),
                             ("--sim-hidden", args.sim_hidden, 1)):
        if value < low:
            parser.error("argument %s: must be >= %d, got %d" % (flag, low, value))
    if args.max_pairs is not None and args.max_pairs < 1:
        parser.error("argument --max-pairs: must be >= 1, got %d" % args.max_pairs)
    if not 0 < args.lr < float("inf"):
        parser.error("argument --lr: must be a finite number > 0, got %r" % args.lr)
    if not 0 <= args.wd < float("inf"):
        parser.error("argument --wd: must be a finite number >= 0, got %r" % args.wd)
    if not 0 <= args.seed < 2 ** 32:
        parser.error("argument --seed: must be in [0, 2**32), got %d" % args.seed)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error("argument --out: %r exists and is not a directory" % args.out)
    if args.save is not None and os.path.isdir(args.save):
        parser.error("argument --save: %r is a directory; give a file path, e.g. %s"
                     % (args.save, os.path.join(args.save, "tree_lstm.params")))
    if args.analysis_budget is not None and not args.analysis_budget >= 0:
        parser.error("argument --analysis-budget: must be >= 0, got %r" % args.analysis_budget)
    try:
        mx.optimizer.create(args.optimizer)
    except Exception:  # pylint: disable=broad-except
        parser.error("argument --optimizer: unknown MXNet optimizer %r" % args.optimizer)
    return parser, args


# ---------------------------------------------------------------------------
# data on the device
# ---------------------------------------------------------------------------

class Example(object):
    """A pair with its arrays already on the training context."""
    __slots__ = ("a", "a_tree", "b", "b_tree", "score", "target")

    def __init__(self, pair, ctx):
        self.a = nd.array(pair.a_ids, ctx=ctx, dtype="float32")
        self.b = nd.array(pair.b_ids, ctx=ctx, dtype="float32")
        self.a_tree, self.b_tree = pair.a_tree, pair.b_tree
        self.score = float(pair.score)
        self.target = nd.array(D.target_distribution(pair.score, NUM_CLASSES).reshape(1, -1),
                               ctx=ctx, dtype="float32")


def to_examples(pairs, ctx):
    return [Example(p, ctx) for p in pairs]


# ---------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------

def _ranks(x):
    """1-based ranks of ``x``, tied values sharing the mean of their ranks."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(1, len(x) + 1)
    values, inverse = np.unique(x, return_inverse=True)
    if len(values) < len(x):   # average the ranks within each group of equal values
        sums = np.bincount(inverse, weights=ranks)
        ranks = (sums / np.bincount(inverse))[inverse]
    return ranks


def pearson(x, y):
    """Pearson's r of two equally long sequences (NaN when either is constant
    or shorter than 2)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    x, y = x - x.mean(), y - y.mean()
    return float(np.dot(x, y) / math.sqrt(np.dot(x, x) * np.dot(y, y)))


def correlations(pred, gold):
    """Pearson r, Spearman rho (Pearson's r of the ranks, ties averaged) and MSE
    (NaN correlations for constant input)."""
    pred = np.asarray(pred, dtype=np.float64)
    gold = np.asarray(gold, dtype=np.float64)
    mse = float(np.mean((pred - gold) ** 2)) if len(pred) else float("nan")
    # ranks would place a NaN (a diverged model) last and give a finite rho
    finite = bool(np.isfinite(pred).all() and np.isfinite(gold).all())
    return {"pearson": pearson(pred, gold),
            "spearman": pearson(_ranks(pred), _ranks(gold)) if finite else float("nan"),
            "mse": mse}


def overlap_baseline(pairs):
    """Pearson r of the word-overlap (Jaccard) of each pair with its score."""
    return pearson([D.word_overlap(p) for p in pairs], [p.score for p in pairs])


def predict(net, examples, chunk=EVAL_CHUNK, bar=None):
    """Predicted scores; the forward passes of a chunk are all issued before any
    value is read, so dynamic batching merges them."""
    out = []
    for i in range(0, len(examples), chunk):
        part = examples[i:i + chunk]
        scores = [expected_score(net(ex.a, ex.a_tree, ex.b, ex.b_tree), NUM_CLASSES)
                  for ex in part]
        out.append(nd.concat(*scores, dim=0).asnumpy())
        if bar is not None:
            bar.update(len(part))
    return np.concatenate(out) if out else np.zeros((0,), np.float32)


def evaluate(net, examples, desc, quiet):
    t0 = time.perf_counter()
    with _bar(len(examples), desc, quiet) as bar:
        pred = predict(net, examples, bar=bar)
    seconds = time.perf_counter() - t0
    res = correlations(pred, [ex.score for ex in examples])
    res["pairs"] = len(examples)
    res["seconds"] = seconds
    return res


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

class _NoBar(object):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1):
        pass

    def set_postfix(self, *a, **k):
        pass


def _bar(total, desc, quiet):
    if quiet:
        return _NoBar()
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel
    return tqdm(total=total, desc=desc, unit="pair", leave=False, dynamic_ncols=True)


def _jsonable(x):
    """Recursively make ``x`` JSON-serialisable (NaN/inf -> None, numpy -> Python)."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, np.bool_)):
        return None if x is None else bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return x if math.isfinite(x) else None
    if isinstance(x, str):
        return x
    return str(x)


def _snapshot(net):
    return {name: p.data().copy() for name, p in net.collect_params().items()}


def _restore(net, snap):
    for name, p in net.collect_params().items():
        p.set_data(snap[name])


def _fmt(x, spec=".4f"):
    return format(x, spec) if x is not None and math.isfinite(x) else "nan"


def dev_axis_limits(epochs, extra=(), min_span=0.05):
    """y-limits of the plot's dev-r axis and whether epoch 0's point lies outside.

    The limits cover the trained epochs' r (epoch >= 1) and the values in
    ``extra`` (the baseline) with a margin; epoch 0's r (an untrained model's r
    is far below) is inside only when it would not more than double the span,
    so a bad start does not flatten the curve that matters."""
    r = [(e["epoch"], e["dev"]["pearson"]) for e in epochs]
    r = [(k, v) for k, v in r if v is not None and math.isfinite(v)]
    trained = [v for k, v in r if k >= 1] + [v for v in extra if v is not None and math.isfinite(v)]
    start = [v for k, v in r if k == 0]
    if not trained:
        trained = start
    if not trained:
        return (-1.0, 1.0), False
    lo, hi = min(trained), max(trained)
    clipped = False
    if start:
        span = max(hi - lo, min_span)
        if lo - start[0] <= span and start[0] - hi <= span:
            lo, hi = min(lo, start[0]), max(hi, start[0])
        else:
            clipped = True
    span = max(hi - lo, min_span)
    pad = 0.12 * span
    return (lo - pad - (span - (hi - lo)) / 2, hi + pad + (span - (hi - lo)) / 2), clipped


def plot_curve(path, epochs, title, best_epoch=None, test=None, baselines=None,
               start_label="untrained"):
    """Write the learning curve: train loss (left axis) and dev Pearson r (right
    axis) per epoch, the best dev epoch marked, the dev word-overlap baseline as
    a line, the test r in the title.  Returns what was drawn (for tests):
    ``{"legend": [labels], "dev_ylim": (lo, hi), "start_clipped": bool, "title": str}``."""
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    baselines = baselines or {}
    fig, ax1 = plt.subplots(figsize=(7, 5.2))
    tr = [(e["epoch"], e["train_loss"]) for e in epochs if e.get("train_loss") is not None]
    if tr:
        ax1.plot([a for a, _ in tr], [b for _, b in tr], "o-", color="tab:blue",
                 label="train loss (KL)")
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("train KL loss", color="tab:blue")
    ax2 = ax1.twinx()
    ylim, clipped = dev_axis_limits(epochs, extra=[baselines.get("dev")])
    dv = [(e["epoch"], e["dev"]["pearson"]) for e in epochs
          if e["dev"]["pearson"] is not None and math.isfinite(e["dev"]["pearson"])]
    shown = [(k, v) for k, v in dv if not (clipped and k == 0)]
    ax2.plot([k for k, _ in shown], [v for _, v in shown], "s-", color="tab:red",
             label="dev Pearson r")
    if clipped:
        r0 = dict(dv)[0]
        ax2.plot([0], [ylim[0]], "v", color="tab:red", markersize=9, clip_on=False,
                 label="epoch 0 (%s): dev r %.3f, below the axis" % (start_label, r0))
    if baselines.get("dev") is not None and math.isfinite(baselines["dev"]):
        ax2.axhline(baselines["dev"], color="0.4", linestyle="--", linewidth=1,
                    label="word-overlap baseline (dev): r %.3f" % baselines["dev"])
    best = dict(dv).get(best_epoch)
    if best is not None:
        ax2.plot([best_epoch], [best], "*", color="gold", markeredgecolor="black",
                 markersize=16, zorder=5,
                 label="best dev epoch %d: r %.3f" % (best_epoch, best))
    ax2.set_ylim(*ylim)
    ax2.set_ylabel("dev Pearson r", color="tab:red")
    full_title = title
    if test is not None and test.get("pearson") is not None and math.isfinite(test["pearson"]):
        full_title += "\ntest r %.3f with epoch %s's parameters" % (
            test["pearson"], best_epoch if best_epoch is not None else "?")
        if baselines.get("test") is not None and math.isfinite(baselines["test"]):
            full_title += " (word-overlap baseline %.3f)" % baselines["test"]
    ax1.set_title(full_title, fontsize=10)
    ax1.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    handles, labels = [], []
    for ax in (ax1, ax2):
        h, lab = ax.get_legend_handles_labels()
        handles += h
        labels += lab
    # below the axes: inside, it would cover the curves
    ax2.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2,
               fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return {"legend": labels, "dev_ylim": tuple(ylim), "start_clipped": clipped,
            "title": full_title}


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------

#: what --hybridize means when dynamic batching is on (printed, not ignored)
HYBRIDIZE_NOTE = ("--hybridize changes nothing with dynamic batching: jitbatch already runs "
                  "every merged launch as the block's hybridized graph (CachedOp); it selects "
                  "per-sample hybridized execution only with --no-dynamic-batch")


def setup_execution(net, args):
    """Set up how ``net`` runs; returns ``(description, notes)``."""
    notes = []
    if args.dynamic_batch:
        if args.zero_pad:
            # absent children (h = c = 0) add nothing to a child-sum cell's outputs
            # or gradients: calls with different child counts may merge, padded
            jitbatch.zero_pad(net.encoder.cell, ch=1, cc=1)
        net.hybridize(dynamic_batch=True, policy=args.policy,
                      analysis_budget=args.analysis_budget, granularity=args.granularity)
        if args.hybridize:
            notes.append(HYBRIDIZE_NOTE)
        return "dynamic batching (policy %s%s%s)" % (
            args.policy, ", child axis zero-padded" if args.zero_pad else "",
            "" if args.granularity == "auto" else ", granularity " + args.granularity), notes
    if args.hybridize:
        net.hybridize()
        return "per-sample hybridized", notes
    net.hybridize(active=False)
    return "per-sample imperative", notes


def main(argv=None):
    parser, args = parse_args(argv)
    cluster = dist.connect(args, parser)  # one process, or one worker of a dist_sync job
    ctx = args.ctx_obj
    log = lambda *a: print(*a, flush=True)  # noqa: E731  (--quiet only hides the bars)

    mx.random.seed(args.seed)
    np.random.seed(args.seed)
    rng = np.random.RandomState(args.seed)
    jitbatch.reset_stats()

    t_start = time.perf_counter()
    try:
        splits, vocab = D.load_dataset(args.data)
    except (OSError, ValueError) as err:
        parser.error("argument --data: cannot read %r: %s" % (args.data, err))
    if args.max_pairs is not None:
        splits = {k: v[:args.max_pairs] for k, v in splits.items()}
    for name in ("train", "dev", "test"):
        if not splits.get(name):
            parser.error("argument --data: split %r of %r is empty" % (name, args.data))

    net = SimilarityTreeLSTM(len(vocab), embed_size=args.embed_size, hidden_size=args.hidden_size,
                             sim_hidden=args.sim_hidden, num_classes=NUM_CLASSES,
                             embed_update=args.embed_update)
    net.initialize(mx.init.Xavier(), ctx=ctx)
    n_found = None
    if args.word_embed_file is not None:
        try:
            matrix, missing = D.load_word_vectors(
                args.word_embed_file, vocab, args.embed_size, seed=args.seed,
                return_missing=True, cache_dir=args.data, progress=not args.quiet, log=log)
        except (OSError, ValueError) as err:
            parser.error("argument --word-embed: cannot use %r: %s (--word-embed none starts "
                         "from random vectors)" % (args.word_embed_file, err))
        net.encoder.embed.weight.set_data(nd.array(matrix, ctx=ctx))
        n_found = len(vocab) - len(missing)
    if args.load is not None:
        try:
            net.load_parameters(args.load, ctx=ctx)
        except Exception as err:  # pylint: disable=broad-except
            parser.error("argument --load: cannot load %r into this model (vocabulary %d, "
                         "embed %d, hidden %d, sim %d): %s"
                         % (args.load, len(vocab), args.embed_size, args.hidden_size,
                            args.sim_hidden, err))
    mode, notes = setup_execution(net, args)
    mode += cluster.describe()
    if args.embed_update == "frozen" and args.word_embed_file is None and args.load is None:
        notes.append("the embedding is frozen at random vectors (no --word-embed file): "
                     "pass vectors, or --embed-update dense to train it")
    elif n_found == 0 and args.load is None:
        notes.append("%s holds a vector for none of the %d words: the embedding starts from "
                     "random vectors%s (is it the right file?)"
                     % (args.word_embed_file, len(vocab),
                        ", and stays frozen at them" if args.embed_update == "frozen" else ""))
    for note in notes:
        log("note: " + note)

    train = to_examples(splits["train"], ctx)
    dev = to_examples(splits["dev"], ctx)
    test = to_examples(splits["test"], ctx)
    baselines = {name: overlap_baseline(splits[name]) for name in ("dev", "test")}
    load_seconds = time.perf_counter() - t_start
    log("data %s: %d/%d/%d pairs, vocabulary %d%s; embedding %d-d, %s; %s on %s"
        % (args.data, len(train), len(dev), len(test), len(vocab),
           "" if n_found is None else ", %d words with vectors" % n_found, args.embed_size,
           args.embed_update, mode, ctx))
    log("word-overlap baseline (Jaccard overlap of the two sentences' words): dev r %s, "
        "test r %s" % (_fmt(baselines["dev"]), _fmt(baselines["test"])))

    dev, test = cluster.evaluation_sets(dev, test)  # with dist_sync: rank 0 evaluates
    loss_fn = kl_loss()
    trainer = cluster.trainer(net.collect_params(), args.optimizer,
                              {"learning_rate": args.lr, "wd": args.wd}, agree_on=train)

    # epoch 0: the parameters training starts from
    start_label = "loaded %s" % args.load if args.load is not None else "untrained"
    eval_pairs, eval_seconds = 0, 0.0
    dev0 = evaluate(net, dev, "dev (epoch 0)", args.quiet)
    eval_pairs += dev0["pairs"]
    eval_seconds += dev0["seconds"]
    epochs = [{"epoch": 0, "train_loss": None, "dev": dev0}]
    log("epoch 0 (%s): dev r %s  rho %s  mse %s"
        % (start_label, _fmt(dev0["pearson"]), _fmt(dev0["spearman"]), _fmt(dev0["mse"])))
    best_epoch, best_r = 0, dev0["pearson"]
    best = _snapshot(net)

    step_losses = []
    train_pairs, train_seconds = 0, 0.0
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(train))
        total, count = 0.0, 0
        t0 = time.perf_counter()
        with _bar(len(train), "epoch %d/%d" % (epoch, args.epochs), args.quiet) as bar:
            for s in range(0, len(order), args.batch_size):
                size = len(order[s:s + args.batch_size])  # all workers' pairs
                batch = [train[i] for i in cluster.shard(order[s:s + args.batch_size])]
                with autograd.record():
                    losses = [loss_fn(net(ex.a, ex.a_tree, ex.b, ex.b_tree), ex.target)
                              for ex in batch]
                    loss = nd.add_n(*losses) if losses else None
                value = cluster.step(trainer, loss, size)  # backward, update: the loss sum
                step_losses.append(value / size)
                total += value
                count += size
                bar.update(size)
                bar.set_postfix(loss="%.4f" % (total / count),
                                pairs_s="%.1f" % (count / (time.perf_counter() - t0)))
        seconds = time.perf_counter() - t0
        train_pairs += count
        train_seconds += seconds
        dv = evaluate(net, dev, "dev (epoch %d)" % epoch, args.quiet)
        eval_pairs += dv["pairs"]
        eval_seconds += dv["seconds"]
        epochs.append({"epoch": epoch, "train_loss": total / count, "dev": dv,
                       "train_seconds": seconds, "train_pairs_per_s": count / seconds})
        better = math.isfinite(dv["pearson"]) and not (math.isfinite(best_r) and dv["pearson"] <= best_r)
        if better:
            best_epoch, best_r = epoch, dv["pearson"]
            best = _snapshot(net)
        log("epoch %d: train loss %.4f  dev r %s  rho %s  mse %s  (%.1f pairs/s)%s"
            % (epoch, total / count, _fmt(dv["pearson"]), _fmt(dv["spearman"]), _fmt(dv["mse"]),
               count / seconds, "  *best" if better else ""))

    cluster.finish(net)  # with dist_sync: save and compare the workers' parameters
    _restore(net, best)
    if args.save is not None:
        d = os.path.dirname(os.path.abspath(args.save))
        os.makedirs(d, exist_ok=True)
        net.save_parameters(args.save)
    te = evaluate(net, test, "test", args.quiet)
    eval_pairs += te["pairs"]
    eval_seconds += te["seconds"]

    train_pps = train_pairs / train_seconds if train_seconds > 0 else None
    eval_pps = eval_pairs / eval_seconds if eval_seconds > 0 else None
    args_dict = {k: v for k, v in vars(args).items() if k != "ctx_obj"}
    metrics = {
        "args": args_dict,
        "context": str(ctx),
        "execution": mode,
        "notes": notes,
        "start": start_label,
        "vocab_size": len(vocab),
        "words_with_vectors": n_found,
        "pairs": {"train": len(train), "dev": len(dev), "test": len(test)},
        "epochs": epochs,
        "train_loss": [e["train_loss"] for e in epochs[1:]],
        "dev_pearson": [e["dev"]["pearson"] for e in epochs],
        "step_losses": step_losses,
        "best_epoch": best_epoch,
        "dev": epochs[best_epoch]["dev"],
        "test": te,
        "baseline_word_overlap": baselines,
        "throughput": {"train_pairs_per_s": train_pps, "eval_pairs_per_s": eval_pps,
                       "train_seconds": train_seconds, "eval_seconds": eval_seconds},
        "load_seconds": load_seconds,
        "wall_seconds": time.perf_counter() - t_start,
        "jitbatch": jitbatch.stats(),
    }
    metrics = _jsonable(metrics)

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1, allow_nan=False)
    if not args.no_plot:
        plot_curve(os.path.join(args.out, "learning_curve.png"), epochs,
                   "Tree-LSTM relatedness (%s)" % os.path.basename(os.path.normpath(args.data)),
                   best_epoch=best_epoch, test=te, baselines=baselines,
                   start_label=start_label)

    def _f(x, spec=".4f"):
        return "n/a" if x is None else _fmt(x, spec)
    if args.epochs == 0:
        origin = "%s, not trained further" % start_label
    else:
        origin = "epoch %d; %s %s" % (best_epoch, start_label, _f(epochs[0]["dev"]["pearson"]))
    print("dev r %s (%s) | test r %s rho %s mse %s | word-overlap baseline test r %s | "
          "train %s pairs/s, eval %s pairs/s | %s | %.1fs"
          % (_f(metrics["dev"]["pearson"]), origin, _f(te["pearson"]), _f(te["spearman"]),
             _f(te["mse"]), _f(baselines["test"]), _f(train_pps, ".1f"), _f(eval_pps, ".1f"),
             mode, metrics["wall_seconds"]), flush=True)
    return metrics


if __name__ == "__main__":
    dist.run_main(main)
