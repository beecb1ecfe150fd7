"""DyNet reference point for the Tree-LSTM benchmark: autobatching on and off.

Measures DyNet 2.1's automatic batching (Neubig et al. 2017) on the child-sum
Tree-LSTM relatedness model of Tai, Socher & Manning (2015), on the same data
and workloads as scripts/bench_tree_lstm.py:

* training: minibatches of --train-size pairs (25): one graph holding the
  per-pair losses, their mean, forward, backward, Adagrad update (lr 0.02);
* inference: minibatches of --infer-size pairs (256): forward only, the
  expected score of every pair read back to numpy.

The model is written per sample, node by node, with DyNet's ordinary
expression API; batching is left entirely to DyNet (``autobatch=1``) or not
done at all (``autobatch=0``).  DyNet reads its configuration once, when
``dynet`` is first imported, so every (round, autobatch) setting runs in its
own child process (this same script with ``--child``).  Settings are
interleaved over --rounds rounds and the median pairs/s is reported.

This script must be run with the interpreter of the separate DyNet virtual
env; it imports neither mxnet nor jitbatch (the small SICK reader is
re-implemented below, following examples/tree_lstm/data.py).

Model (sizes as in the paper and in examples/tree_lstm/model.py)
----------------------------------------------------------------
embedding 300, hidden 150.  For a node with input x and children k:
  [i; o; u] = W_iou x + U_iou sum_k h_k + b_iou   (i, o sigmoid; u tanh)
  f_k = sigmoid(W_f x + U_f h_k + b_f)             (one forget gate per child)
  c = i * u + sum_k f_k * c_k ;  h = o * tanh(c)
A leaf simply has no children (no zero child state is fed in).
Similarity: h_s = sigmoid(W_h [l * r; |l - r|] + b_h) (50 units), then
log_softmax(W_p h_s + b_p) over the 5 score classes; loss = KL(p || q) with
the sparse target p of the score (floor/ceil mass, Tai et al. section 5.2).
Differences from the Gluon benchmark: DyNet's Glorot init (biases zero), no
weight decay, the loss is the mean over pairs of the full KL (summed over the
classes, not averaged) -- none of which changes the work done per step.

The word embedding is trained as --embed-update says, as the Gluon benchmark's
option of that name does (scripts/bench_tree_lstm.py passes its choice on):
frozen (lookups with ``update=False``: no gradient, no update; the default, as
in Tai et al. for relatedness), sparse (DyNet's default for lookup parameters:
only the rows a minibatch used are updated) or dense (every row every step:
``trainer.set_sparse_updates(False)``).

Building the DyNet env
----------------------
``scripts/build_dynet.sh [VENV_DIR]`` (default /tmp/dynet-venv; 5-15 min on 2
cores, run it under ``nice``) makes the venv and builds DyNet 2.1.2 natively
(DyNet's Release flags include -march=native) from its PyPI sdist, with Eigen
3.4.0 headers from the ``cmeel-eigen`` wheel (or Debian's libeigen3-dev:
DYNET_EIGEN=apt), Cython < 3, and the system's cmake, make and g++; it works
around the sdist's failure to pack its wheel (LICENSE.txt looked for in the
build directory), skips the build when the venv already imports DyNet, and
ends by running a tiny autobatched training step.  The prebuilt ``dyNET38``
wheel is compiled for generic x86-64 and would understate DyNet: not used.

Running
-------
    /tmp/dynet-venv/bin/python scripts/bench_dynet.py            # ~20 s (5 rounds)
    /tmp/dynet-venv/bin/python scripts/bench_dynet.py --rounds 1 --modes 1
    /tmp/dynet-venv/bin/python scripts/bench_dynet.py --embed-update sparse
    /tmp/dynet-venv/bin/python scripts/bench_dynet.py --json runs/bench_dynet.json

Writes runs/bench_dynet.json by default (pairs/s per workload and autobatch
setting, per-round rates, DyNet and Eigen versions).
"""
import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# where scripts/build_dynet.sh noted the Eigen headers it built this venv's DyNet with
EIGEN_NOTE = os.path.join(sys.prefix, "eigen3-include")
EMBED_UPDATES = ("frozen", "sparse", "dense")
NUM_CLASSES = 5
UNK, PAD = "<unk>", "<pad>"


# ---------------------------------------------------------------------------
# Data (SICK layout: a.toks b.toks a.parents b.parents sim.txt per split)
# ---------------------------------------------------------------------------

def _lines(path):
    with open(path, encoding="utf-8") as fh:
        out = fh.read().split("\n")
    if out and out[-1] == "":
        out.pop()
    return [s.rstrip("\r") for s in out]


def children_lists(parents):
    """(root, children) of a 0-based tree from 1-based parent indices (0 = root).

    Children of each node are kept in token order.
    """
    kids = [[] for _ in parents]
    root = None
    for tok, par in enumerate(parents):
        if par == 0:
            if root is not None:
                raise ValueError("two roots in %r" % (parents,))
            root = tok
        else:
            kids[par - 1].append(tok)
    if root is None:
        raise ValueError("no root in %r" % (parents,))
    return root, kids


def postorder(root, kids):
    """Node ids with every child before its parent (iterative)."""
    order, stack = [], [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in reversed(kids[node]))
    if len(order) != len(kids):
        raise ValueError("tree does not reach every token (cycle?)")
    return order


def target_p(score):
    """Sparse distribution over classes 1..5 whose mean is ``score``."""
    p = [0.0] * NUM_CLASSES
    lo = int(math.floor(score))
    if lo >= NUM_CLASSES:
        p[NUM_CLASSES - 1] = 1.0
    else:
        p[lo] = score - lo
        p[lo - 1] = 1.0 - (score - lo)
    return p


def load(data_dir, n):
    """First ``n`` train pairs, encoded with a vocabulary like the Gluon example's.

    Vocabulary: every token of the whole train split plus vocab.txt /
    vocab-cased.txt if present, with <unk> = 0 and <pad> = 1 (the order of the
    other ids differs from the example's Vocab, which only permutes embedding rows).
    """
    split = os.path.join(data_dir, "train")
    cols = {name: _lines(os.path.join(split, name))
            for name in ("a.toks", "b.toks", "a.parents", "b.parents", "sim.txt")}
    words = set()
    for side in ("a.toks", "b.toks"):
        for line in cols[side]:
            words.update(line.split())
    for name in ("vocab-cased.txt", "vocab.txt"):
        path = os.path.join(data_dir, name)
        if os.path.isfile(path):
            words.update(w.strip() for w in _lines(path) if w.strip())
            break
    words.discard(UNK)
    words.discard(PAD)
    itos = [UNK, PAD] + sorted(words)
    stoi = {w: i for i, w in enumerate(itos)}

    pairs = []
    for k in range(min(n, len(cols["sim.txt"]))):
        sides = []
        for s in ("a", "b"):
            toks = cols[s + ".toks"][k].split()
            parents = [int(v) for v in cols[s + ".parents"][k].split()]
            if len(toks) != len(parents):
                raise ValueError("line %d of %s: %d tokens, %d parents"
                                 % (k + 1, s, len(toks), len(parents)))
            root, kids = children_lists(parents)
            ids = [stoi.get(t, 0) for t in toks]
            sides.append((ids, kids, postorder(root, kids), root))
        score = float(cols["sim.txt"][k])
        pairs.append((sides[0], sides[1], score, target_p(score)))
    if len(pairs) < n:
        raise ValueError("only %d pairs in %s, %d wanted" % (len(pairs), split, n))
    return pairs, len(itos)


# ---------------------------------------------------------------------------
# Model (built per sample; DyNet decides what to batch)
# ---------------------------------------------------------------------------

class TreeLSTMSim(object):
    def __init__(self, dy, vocab_size, embed=300, hidden=150, sim_hidden=50,
                 train_embed=True):
        self.dy = dy
        self.hidden = hidden
        # False: lookups of the embedding are constants (no gradient, no update)
        self.train_embed = train_embed
        pc = self.pc = dy.ParameterCollection()
        zero = dy.ConstInitializer(0.0)
        self.emb = pc.add_lookup_parameters((vocab_size, embed))
        self.w_iou = pc.add_parameters((3 * hidden, embed))
        self.u_iou = pc.add_parameters((3 * hidden, hidden))
        self.b_iou = pc.add_parameters(3 * hidden, init=zero)
        self.w_f = pc.add_parameters((hidden, embed))
        self.u_f = pc.add_parameters((hidden, hidden))
        self.b_f = pc.add_parameters(hidden, init=zero)
        self.w_h = pc.add_parameters((sim_hidden, 2 * hidden))
        self.b_h = pc.add_parameters(sim_hidden, init=zero)
        self.w_p = pc.add_parameters((NUM_CLASSES, sim_hidden))
        self.b_p = pc.add_parameters(NUM_CLASSES, init=zero)

    def encode(self, side):
        """Root hidden state of one sentence tree."""
        dy, H = self.dy, self.hidden
        ids, kids, order, root = side
        h, c = {}, {}
        for node in order:
            x = dy.lookup(self.emb, ids[node], update=self.train_embed)
            ch = kids[node]
            if ch:
                hs = [h[k] for k in ch]
                hsum = hs[0] if len(hs) == 1 else dy.esum(hs)
                iou = dy.affine_transform([self.b_iou, self.w_iou, x, self.u_iou, hsum])
            else:
                iou = dy.affine_transform([self.b_iou, self.w_iou, x])
            i = dy.logistic(dy.pick_range(iou, 0, H))
            o = dy.logistic(dy.pick_range(iou, H, 2 * H))
            u = dy.tanh(dy.pick_range(iou, 2 * H, 3 * H))
            cell = dy.cmult(i, u)
            if ch:
                fx = dy.affine_transform([self.b_f, self.w_f, x])
                terms = [cell]
                for k in ch:
                    f = dy.logistic(fx + self.u_f * h[k])
                    terms.append(dy.cmult(f, c[k]))
                cell = dy.esum(terms)
            c[node] = cell
            h[node] = dy.cmult(o, dy.tanh(cell))
        return h[root]

    def log_probs(self, pair):
        dy = self.dy
        left, right = self.encode(pair[0]), self.encode(pair[1])
        feats = dy.concatenate([dy.cmult(left, right), dy.abs(left - right)])
        hs = dy.logistic(dy.affine_transform([self.b_h, self.w_h, feats]))
        return dy.log_softmax(dy.affine_transform([self.b_p, self.w_p, hs]))

    def kl_loss(self, pair):
        """Cross-entropy part of KL(p || q); the entropy of p is a constant."""
        p = pair[3]
        return -self.dy.dot_product(self.dy.inputVector(p), self.log_probs(pair))


def entropy(p):
    return -sum(v * math.log(v) for v in p if v > 0)


# ---------------------------------------------------------------------------
# One setting, in a child process
# ---------------------------------------------------------------------------

def run_child(args):
    import dynet_config
    dynet_config.set(mem=str(args.mem), random_seed=args.seed + 1,
                     autobatch=int(args.child))
    import dynet as dy

    pairs, vocab_size = load(args.data, args.pairs)
    model = TreeLSTMSim(dy, vocab_size, train_embed=args.embed_update != "frozen")
    trainer = dy.AdagradTrainer(model.pc, learning_rate=0.02)
    if args.embed_update == "dense":
        # every row of the lookup table updated every step, not only those used
        trainer.set_sparse_updates(False)
    ks = [float(k) for k in range(1, NUM_CLASSES + 1)]

    def train_step(batch):
        t0 = time.perf_counter()
        dy.renew_cg()
        losses = [model.kl_loss(p) for p in batch]
        total = dy.esum(losses) * (1.0 / len(batch))
        t1 = time.perf_counter()
        value = total.value()
        t2 = time.perf_counter()
        total.backward()
        trainer.update()
        t3 = time.perf_counter()
        kl = value + sum(entropy(p[3]) for p in batch) / len(batch)
        return kl, (t1 - t0, t2 - t1, t3 - t2)

    def infer_step(batch):
        t0 = time.perf_counter()
        dy.renew_cg()
        kvec = dy.inputVector(ks)
        scores = [dy.dot_product(dy.exp(model.log_probs(p)), kvec) for p in batch]
        allv = dy.concatenate(scores)
        t1 = time.perf_counter()
        values = allv.npvalue().reshape(-1)
        t2 = time.perf_counter()
        return values, (t1 - t0, t2 - t1, 0.0)

    def timed(step, size, count):
        """Warm-up on the first minibatch, then ``count`` timed ones; returns
        (first result, pairs/s, seconds, per-phase seconds summed)."""
        first, _ = step(pairs[:size])
        splits = [0.0, 0.0, 0.0]
        t0 = time.perf_counter()
        for b in range(1, count + 1):
            _, parts = step(pairs[b * size:(b + 1) * size])
            splits = [a + p for a, p in zip(splits, parts)]
        dt = time.perf_counter() - t0
        return first, count * size / dt, dt, splits

    out = {"autobatch": int(args.child), "embed_update": args.embed_update}
    if "train" in args.workloads:
        first_kl, rate, dt, splits = timed(train_step, args.train_size, args.train_batches)
        out["train"] = {"pairs_per_s": rate, "seconds": dt, "first_loss": first_kl,
                        "split_s": dict(zip(("build", "forward", "backward_update"), splits))}
    if "infer" in args.workloads:
        first_pred, rate, dt, splits = timed(infer_step, args.infer_size, args.infer_batches)
        out["infer"] = {"pairs_per_s": rate, "seconds": dt,
                        "first_preds": [float(v) for v in first_pred[:8]],
                        "split_s": dict(zip(("build", "forward"), splits[:2]))}
    with open(args.child_out, "w") as fh:
        json.dump(out, fh)


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------

def default_eigen_include():
    try:
        with open(EIGEN_NOTE) as fh:
            return fh.read().strip()
    except OSError:
        return None


def eigen_version(include_dir):
    path = os.path.join(include_dir or "", "Eigen", "src", "Core", "util", "Macros.h")
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError:
        return "unknown"
    nums = [re.search(r"#define EIGEN_%s_VERSION\s+(\d+)" % k, text) for k in
            ("WORLD", "MAJOR", "MINOR")]
    if not all(nums):
        return "unknown"
    return ".".join(m.group(1) for m in nums)


def dynet_version():
    try:
        from importlib.metadata import version
        return version("dyNET")
    except Exception:  # pylint: disable=broad-except
        return "unknown"


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "sick_full"))
    ap.add_argument("--pairs", type=int, default=768, help="first N train pairs used")
    ap.add_argument("--modes", default="1,0", help="autobatch settings to run, e.g. 1,0")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median taken)")
    ap.add_argument("--train-size", type=int, default=25)
    ap.add_argument("--train-batches", type=int, default=6, help="timed, after 1 warm-up")
    ap.add_argument("--infer-size", type=int, default=256)
    ap.add_argument("--infer-batches", type=int, default=2, help="timed, after 1 warm-up")
    ap.add_argument("--workloads", default="train,infer")
    ap.add_argument("--mem", default="1024", help="DyNet memory pool (MB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--embed-update", choices=EMBED_UPDATES, default="frozen",
                    help="how the word embedding is trained: frozen (lookups not "
                         "updated), sparse (the rows used; DyNet's default) or dense "
                         "(every row every step); default: %(default)s")
    ap.add_argument("--eigen-include",
                    default=os.environ.get("EIGEN3_INCLUDE_DIR") or default_eigen_include(),
                    help="Eigen headers DyNet was built with (only to record the version; "
                         "default: what scripts/build_dynet.sh noted in %s)" % EIGEN_NOTE)
    ap.add_argument("--json", default=os.path.join(ROOT, "runs", "bench_dynet.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    need = max((1 + args.train_batches) * args.train_size if "train" in args.workloads else 0,
               (1 + args.infer_batches) * args.infer_size if "infer" in args.workloads else 0)
    args.pairs = max(args.pairs, need)
    if args.child is not None:
        run_child(args)
        return 0

    modes = [int(m) for m in args.modes.split(",") if m.strip()]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1")
    results = {m: [] for m in modes}
    fd, tmp = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        for rnd in range(args.rounds):
            for m in modes:
                cmd = [sys.executable, os.path.abspath(__file__), "--child", str(m),
                       "--child-out", tmp, "--data", args.data, "--pairs", str(args.pairs),
                       "--train-size", str(args.train_size),
                       "--train-batches", str(args.train_batches),
                       "--infer-size", str(args.infer_size),
                       "--infer-batches", str(args.infer_batches),
                       "--workloads", ",".join(args.workloads),
                       "--mem", str(args.mem), "--seed", str(args.seed),
                       "--embed-update", args.embed_update]
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
                if proc.returncode != 0:
                    sys.stdout.write(proc.stdout)
                    raise SystemExit("child autobatch=%d failed (rc %d)" % (m, proc.returncode))
                with open(tmp) as fh:
                    res = json.load(fh)
                results[m].append(res)
                print("round %d autobatch=%d: %s (%.1f s)" % (
                    rnd + 1, m, ", ".join("%s %.1f pairs/s" % (w, res[w]["pairs_per_s"])
                                          for w in args.workloads), time.perf_counter() - t0))
                sys.stdout.flush()
    finally:
        os.unlink(tmp)

    summary = {"dynet_version": dynet_version(),
               "eigen_version": eigen_version(args.eigen_include),
               "eigen_include": args.eigen_include,
               "python": platform.python_version(),
               "threads": 1, "embed_update": args.embed_update,
               "data": args.data, "pairs_loaded": args.pairs, "rounds": args.rounds,
               "workloads": {}}
    for w in args.workloads:
        size = args.train_size if w == "train" else args.infer_size
        nb = args.train_batches if w == "train" else args.infer_batches
        entry = {"minibatch": size, "timed_batches": nb, "modes": {}}
        for m in modes:
            rates = [r[w]["pairs_per_s"] for r in results[m]]
            split = {k: statistics.median(r[w]["split_s"][k] for r in results[m])
                     for k in results[m][0][w]["split_s"]}
            extra = ({"first_loss": [r[w]["first_loss"] for r in results[m]]} if w == "train"
                     else {"first_preds": results[m][0][w]["first_preds"]})
            entry["modes"]["autobatch=%d" % m] = dict(
                pairs_per_s=statistics.median(rates), rates=rates,
                median_split_s=split, **extra)
        summary["workloads"][w] = entry

    # Same seed, same data: autobatching must not change the numbers.
    if "train" in args.workloads and len(modes) > 1:
        firsts = [results[m][0]["train"]["first_loss"] for m in modes]
        summary["first_loss_max_rel_diff"] = (max(firsts) - min(firsts)) / abs(firsts[0])

    print()
    print("DyNet %s (Eigen %s), 1 thread, %d round(s), median pairs/s; embedding %s"
          % (summary["dynet_version"], summary["eigen_version"], args.rounds,
             {"frozen": "frozen", "sparse": "rows used updated (sparse)",
              "dense": "updated densely (every row)"}[args.embed_update]))
    head = "%-22s" % "workload" + "".join("%16s" % ("autobatch=%d" % m) for m in modes)
    if 1 in modes and 0 in modes:
        head += "%12s" % "on/off"
    print(head)
    for w in args.workloads:
        e = summary["workloads"][w]
        label = "%s (mb %d)" % ("train" if w == "train" else "infer", e["minibatch"])
        row = "%-22s" % label + "".join(
            "%16.1f" % e["modes"]["autobatch=%d" % m]["pairs_per_s"] for m in modes)
        if 1 in modes and 0 in modes:
            row += "%11.2fx" % (e["modes"]["autobatch=1"]["pairs_per_s"]
                                / e["modes"]["autobatch=0"]["pairs_per_s"])
        print(row)
    if "first_loss_max_rel_diff" in summary:
        print("first-minibatch loss, autobatch on vs off: rel. diff %.2e"
              % summary["first_loss_max_rel_diff"])

    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=1)
        print("wrote %s" % args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
