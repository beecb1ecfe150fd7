"""Tree-LSTM throughput: per-sample Gluon, hand level-by-level batching, jitbatch.

One process, one run, on the full-size SICK-shaped set (data/sick_full; made by
scripts/make_sick_like.py --full when missing). Two workloads:

* training: minibatches of --train-size pairs (25), forward + one backward of
  the summed KL loss + Adagrad update (lr 0.02, wd 1e-4);
* the word embedding (2,810 x 300: 75% of the parameters) is trained as
  --embed-update says, in every mode and on the DyNet side alike; every table
  names the choice:
    frozen  not trained (the default: Tai et al. keep the word vectors fixed
            for relatedness); MXNet: grad_req 'null'; DyNet: lookups with
            update=False
    sparse  only the rows a minibatch used are updated; MXNet:
            Embedding(sparse_grad=True), a row-sparse gradient updated lazily by
            Adagrad (wd 0 on that parameter, as row-sparse updates need); DyNet:
            its default for lookup parameters
    dense   every row every step: a dense gradient and a full Adagrad update
            of the whole matrix; DyNet: trainer.set_sparse_updates(False)
* inference: minibatches of --infer-size pairs (256), forward only, every
  prediction (expected score) read back to numpy.

Modes (each on its own copy of ONE model, built from the same seed: the same
initial parameters; each copy configured once, hybridized or flagged, and
trained by its own trainer, so switching modes rebuilds no mode's caches):
  plain       per-sample Gluon, not hybridized
  hybrid      per-sample Gluon, hybridized blocks
  fold        Fold-style batching (examples/tree_lstm/fold_batched.py): the technique of
              TensorFlow Fold and the Gluon Fold helper (szha/mxnet-fold), which is not
              installable here: per depth and signature one call on concatenated
              inputs, outputs split into one array per operation
  hand        hand-written level-by-level batching (examples/tree_lstm/hand_batched.py)
  hand:act    the same hand-written code with its blocks' graphs given jitbatch's
              activation rewrite (jitbatch.gluon.rewrite: sigmoid/tanh/relu run as
              MXNet's Activation operator): what of jitbatch's lead is kernel choice
  jit:POLICY  jitbatch, net.hybridize(dynamic_batch=True, policy=POLICY), POLICY in
              depth, agenda, auto, with the cell's child axis declared zero-paddable
              (jitbatch.zero_pad(cell, ch=1, cc=1)): nodes with different child
              counts may share a launch
  jit:auto:nopad  the same without the declaration (launches split by child
              count); also jit:depth:nopad, jit:agenda:nopad
  jit:POLICY:block, jit:POLICY:split (also after :nopad)  granularity fixed
              instead of 'auto': one node per cell call, or the cell's input
              projections run as one launch across all depths
  ...:nopipe  pipelined flushes off (jitbatch.config.pipeline = False)
  ...:noact   (last) MXNet's own activation operators kept
              (jitbatch.config.fast_activations = False)
  dynet       DyNet 2.1's automatic batching on the same model written per sample
              (scripts/bench_dynet.py), with --dynet PYTHON: an interpreter that can
              import dynet (its own virtual env: scripts/build_dynet.sh builds it). Each
              round runs it in a child process of that interpreter between the other
              modes, so its ratios are taken in the same rounds. Its parameters are
              its own (DyNet's initialisation): it is left out of the equal-loss check.

With more than one thread, MXNet's OpenMP threads spin between kernels by
default and take the cores Python needs: jitbatch's Python work (recording,
analysis) then waits for a core. ``OMP_WAIT_POLICY=PASSIVE`` in the environment
(read when MXNet loads) makes them sleep instead; the header prints it.

Before the rounds, each jitbatch mode runs --settle untimed minibatches of each
workload: 'auto' picks its pipelined chunk count by measuring cycles with each
count (jitbatch.pipeline.Pipe), which takes ~10-20 graphs; the tables are its
settled speed (--settle 0 times the search too).

With --fresh, each round times minibatches that no earlier round timed (an
epoch's way: minibatches whose launch shapes are new to MXNet, whose oneDNN
kernels are prepared per shape), until the training split runs out (then it
wraps around); without it, every round times the same minibatches, whose
shapes are all prepared after the first round. Within a round every mode
times the same minibatches.

Before timing, every mode must give the same loss on the first training
minibatch and the same predictions on it (rtol 1e-4), and the same gradients
(each parameter within 1e-4 of its largest reference entry, and of the same
storage type: with --embed-update sparse the embedding's is row-sparse in
every mode; frozen, it has none); the script aborts otherwise. Then the modes
are timed in interleaved rounds (a warm-up minibatch, then the timed ones,
per mode and round); ratios (vs plain, vs hand, vs dynet: each mode's
pairs/s over that mode's) are taken within each round and the median over
rounds is printed, so a noisy machine moves all modes alike. Per-sample modes (--slow-modes) are slow and get only
--slow-batches minibatches per round, after a warm-up of 8 pairs (per-sample
code has nothing that a bigger warm-up would warm).

For the jitbatch modes the table also gives the analysis fraction: jitbatch's
analysis seconds (scheduling) divided by the wall time of the timed steps; and
what policy 'auto' chose (jitbatch.stats()['last_flush'] and per-policy flush
counts). The execute column is the same fraction for the seconds jitbatch spends
in its flushes issuing the merged launches (gathers, block calls; MXNet runs
operators asynchronously, so this is issue time plus any waits), and the
release column for freeing executed graphs' inputs (jitbatch.stats()
'release_seconds'). The rest of a step is recording the per-sample calls,
MXNet's backward and the update.

Every mode gets the main-thread busy fraction: the CPU time of the thread
running the steps (time.thread_time: its Python, and MXNet calls made from it)
divided by their wall time. MXNet's kernels run on its own worker threads, so
near 100% means the step waits on Python (the kernels keep up), and well below
means it waits on the kernels. The kernels column is the CPU time of every
other thread of the process (MXNet's engine workers and OpenMP threads: the
kernels, and their scheduling) over the same wall time: with one thread, near
100% means the kernels never wait, so everything else jitbatch and the model's
Python do costs the step at most 100% minus that.

Threads: OpenMP (hence MXNet) reads OMP_NUM_THREADS only once, when the MXNet
library is loaded by ``import mxnet``; setting it afterwards has no effect.
So --threads is applied before anything imports mxnet: the variable is set in
this process when mxnet is not loaded yet, and otherwise the script re-executes
itself with the variable set.

    python scripts/bench_tree_lstm.py                       # defaults, ~5 min on 2 busy cores
    python scripts/bench_tree_lstm.py --rounds 1 --train-batches 1 --infer-batches 1
    python scripts/bench_tree_lstm.py --modes hand,jit:auto --json runs/bench.json
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ALL_MODES = ("plain", "hybrid", "fold", "hand", "hand:act", "jit:depth", "jit:agenda", "jit:auto:nopad",
             "jit:auto:split", "jit:auto:nopipe", "jit:auto")
_REEXEC_GUARD = "JITBATCH_BENCH_REEXEC"
SLOW_WARM = 8   # pairs in the warm-up minibatch of a slow (per-sample) mode
# examples.tree_lstm.model.EMBED_UPDATES, repeated here: that module imports
# mxnet, which must not be loaded before --threads is applied
EMBED_UPDATES = ("frozen", "sparse", "dense")
EMBED_WORDS = {"frozen": "embedding frozen",
               "sparse": "embedding rows used updated (sparse)",
               "dense": "embedding updated densely (every row)"}


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "sick_full"))
    ap.add_argument("--modes", default=",".join(ALL_MODES),
                    help="comma-separated, from: %s" % ", ".join(ALL_MODES))
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median taken)")
    ap.add_argument("--train-batches", type=int, default=5,
                    help="timed training minibatches per mode per round")
    ap.add_argument("--infer-batches", type=int, default=2,
                    help="timed inference minibatches per mode per round")
    ap.add_argument("--settle", type=int, default=16,
                    help="untimed minibatches per workload each jitbatch mode runs before "
                         "the rounds, so the cost model's online choices (pipelined chunk "
                         "count: jitbatch.pipeline.Pipe) have settled; 0: none")
    ap.add_argument("--slow-batches", type=int, default=1,
                    help="timed minibatches per round (both workloads) for --slow-modes")
    ap.add_argument("--slow-modes", default="plain,hybrid",
                    help="modes timed on --slow-batches minibatches only")
    ap.add_argument("--train-size", type=int, default=25, help="pairs per training minibatch")
    ap.add_argument("--infer-size", type=int, default=256, help="pairs per inference minibatch")
    ap.add_argument("--workloads", default="train,infer")
    ap.add_argument("--threads", type=int, default=1,
                    help="OMP_NUM_THREADS for MXNet (set before mxnet is imported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fresh", action="store_true",
                    help="each round times minibatches no earlier round timed (as in an "
                         "epoch: launch shapes the framework has not prepared kernels "
                         "for), wrapping around when the training split runs out; "
                         "default: every round times the same minibatches")
    ap.add_argument("--json", metavar="PATH", help="save the results table as JSON")
    ap.add_argument("--embed-update", choices=EMBED_UPDATES, default="frozen",
                    help="how the word embedding is trained, in every mode and on the "
                         "DyNet side: frozen (not trained; Tai et al.'s choice, the "
                         "default), sparse (the rows a minibatch used) or dense (every "
                         "row every step); default: %(default)s")
    ap.add_argument("--dynet", metavar="PYTHON",
                    help="interpreter with DyNet installed: adds mode 'dynet' (autobatching)")
    return ap


def parse_args(argv):
    args = build_parser().parse_args(argv)
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    known = set(ALL_MODES)
    for p in ("depth", "agenda", "auto"):
        for pad in ("", ":nopad"):
            for g in ("", ":block", ":split"):
                for pipe in ("", ":nopipe"):
                    for act in ("", ":noact"):
                        known.add("jit:%s%s%s%s%s" % (p, pad, g, pipe, act))
    if args.dynet:
        known.add("dynet")
        if "dynet" not in args.mode_list:
            args.mode_list.append("dynet")
    bad = [m for m in args.mode_list if m not in known]
    if bad or not args.mode_list:
        raise SystemExit("--modes: unknown mode(s) %s; choose from %s (or jit:POLICY[:nopad]"
                         "[:block|:split][:nopipe])" % (", ".join(bad) or "(none)",
                                                        ", ".join(ALL_MODES)))
    args.slow = set(m.strip() for m in args.slow_modes.split(",") if m.strip())
    args.workload_list = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not args.workload_list or set(args.workload_list) - {"train", "infer"}:
        raise SystemExit("--workloads: expected train, infer or both")
    if args.settle < 0:
        raise SystemExit("--settle must be 0 or more")
    for name in ("rounds", "train_batches", "infer_batches", "slow_batches", "train_size",
                 "infer_size", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit("--%s must be at least 1" % name.replace("_", "-"))
    return args


def set_threads(threads, argv, script=None):
    """Make MXNet run with OMP_NUM_THREADS=threads. Must happen before ``import mxnet``:
    set the variable when mxnet is not loaded yet, else re-execute ``script``."""
    want = str(threads)
    if os.environ.get("OMP_NUM_THREADS") == want:
        return
    os.environ["OMP_NUM_THREADS"] = want
    if "mxnet" not in sys.modules:
        return
    if script is None or os.environ.get(_REEXEC_GUARD):
        raise SystemExit("mxnet was imported before --threads %s could be applied; set "
                         "OMP_NUM_THREADS=%s in the environment instead" % (want, want))
    os.environ[_REEXEC_GUARD] = "1"
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, os.path.abspath(script)] + list(argv))


def imports():
    """The framework imports, after set_threads."""
    sys.path.insert(0, HERE)
    sys.path.insert(0, ROOT)
    import bench_core  # noqa: F401  (sets OMP_NUM_THREADS only if still unset)
    return bench_core


class Modes(object):
    """Every mode on its own copy of the bench_core model, built from the same
    seed (the same initial parameters; the embedding's treatment, grad_req,
    sparse_grad and wd_mult, the same in all), with its own trainer, and
    configured once (hybridized, flagged, zero_pad declared), as a user's
    process configures its model: switching modes re-hybridizes nothing, so
    no mode rebuilds its caches (MXNet's CachedOps, jitbatch's signatures and
    per-shape launch state) every round. The hand-written and Fold-style modes
    run on a hybridized copy's blocks."""

    def __init__(self, bench_core, vocab_size, seed, names, embed_update="frozen"):
        import jitbatch
        from mxnet import autograd, nd
        from examples.tree_lstm.fold_batched import FoldBatched
        from examples.tree_lstm.hand_batched import HandBatched
        from examples.tree_lstm.model import expected_score
        self.nd, self.autograd, self.expected_score = nd, autograd, expected_score
        self.jitbatch = jitbatch
        self.runs, self.batched = {}, {}
        for name in names:
            if name == "dynet":
                continue
            run = self.runs[name] = bench_core.Runner(vocab_size, seed=seed,
                                                      embed_update=embed_update)
            self._config(name)      # read when a dynamic_batch block is traced
            if name in ("hand", "hand:act", "fold"):
                run.mode("hybrid")
                if name == "fold":
                    self.batched[name] = FoldBatched(run.net)
                    continue
                hand = self.batched[name] = HandBatched(run.net, hybridize=False)
                if name == "hand:act":
                    for block in (hand.embed, hand.cell, hand.leaf, hand.similarity):
                        block._get_graph = self._rewriting(block)  # pylint: disable=protected-access
            else:
                run.mode(name)
        self.current = self.run = self.net = None

    def _config(self, name):
        """jitbatch's process-wide settings a mode asks for (bench_core.Runner.mode)."""
        parts = name.split(":")
        self.jitbatch.config.pipeline = "nopipe" not in parts[2:]
        self.jitbatch.config.fast_activations = "noact" not in parts[2:]

    def mode(self, name):
        self.current = name
        self.run = self.runs[name]
        self.net = self.run.net
        self._config(name)

    @staticmethod
    def _rewriting(block):
        """``block._get_graph`` that applies jitbatch's activation rewrite to its
        ordinary hybridized graph, as jitbatch does to a dynamic_batch block's."""
        from jitbatch.gluon.rewrite import rewrite_traced
        traced = type(block)._get_graph

        def get_graph(*args):
            fresh = not block._cached_graph  # pylint: disable=protected-access
            traced(block, *args)
            if fresh:
                rewrite_traced(block)
            return block._cached_graph  # pylint: disable=protected-access
        return get_graph

    def train_step(self, batch, update=True):
        if self.current not in self.batched:
            return self.run.step(batch, update=update)
        nd = self.nd
        target = nd.concat(*[s[4] for s in batch], dim=0)
        with self.autograd.record():
            total = nd.sum(self.run.loss(self.batched[self.current](batch), target))
        total.backward()
        if update:
            self.run.trainer.step(len(batch))
        return total.asscalar()

    def infer_step(self, batch):
        nd = self.nd
        if self.current in self.batched:
            logp = self.batched[self.current](batch)
        else:
            logp = nd.concat(*[self.net(*s[:4]) for s in batch], dim=0)
        return self.expected_score(logp).asnumpy()


def run_dynet(args, workload, batches):
    """pairs/s of DyNet's autobatching on ``batches`` timed minibatches of
    ``workload``, measured in a child process of the --dynet interpreter."""
    import subprocess
    import tempfile
    size = args.train_size if workload == "train" else args.infer_size
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        cmd = [args.dynet, os.path.join(HERE, "bench_dynet.py"), "--child", "1",
               "--child-out", out, "--data", args.data, "--pairs", str(size * (batches + 1)),
               "--workloads", workload, "--%s-size" % workload, str(size),
               "--%s-batches" % workload, str(batches),
               "--embed-update", args.embed_update]
        env = dict(os.environ, MKL_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        if proc.returncode != 0:
            raise SystemExit("--dynet %s: the DyNet child failed (rc %d):\n%s"
                             % (args.dynet, proc.returncode, proc.stdout[-2000:]))
        with open(out) as f:
            return json.load(f)[workload]["pairs_per_s"]
    finally:
        os.unlink(out)


def gradients(net):
    """{parameter name without the model's prefix: (storage type, dense numpy
    gradient)} of the trained parameters (a frozen one has no gradient and is
    left out)."""
    return {name[len(net.prefix):]: (p.grad().stype, p.grad().tostype("default").asnumpy())
            for name, p in net.collect_params().items() if p.grad_req != "null"}


def grad_gap(grads, ref):
    """Worst disagreement of two gradients(): per parameter, the largest entry
    difference over the reference's largest entry (inf if the storage types or
    the set of trained parameters differ), and that parameter's name."""
    import numpy as np
    if set(grads) != set(ref):
        return float("inf"), "trained parameters %s vs %s" % (sorted(grads), sorted(ref))
    worst, where = 0.0, None
    for name, (stype, g) in grads.items():
        rstype, r = ref[name]
        gap = (float("inf") if stype != rstype
               else float(np.abs(g - r).max()) / max(float(np.abs(r).max()), 1e-12))
        if gap > worst:
            worst, where = gap, "%s (%s gradient, reference's %s)" % (name, stype, rstype)
    return worst, where


def check_same(modes, names, batch):
    """Loss (training, no update), gradients and predictions of the first
    minibatch in every mode. Returns the losses and the embedding gradient's
    storage type (None when frozen)."""
    import numpy as np
    loss, pred, grads = {}, {}, {}
    for m in names:
        modes.mode(m)
        loss[m] = modes.train_step(batch, update=False)
        grads[m] = gradients(modes.net)
        pred[m] = modes.infer_step(batch)
    ref = names[0]
    gaps = {m: grad_gap(grads[m], grads[ref]) for m in names}
    bad = [m for m in names if not np.isclose(loss[m], loss[ref], rtol=1e-4)]
    bad += [m for m in names if m not in bad
            and not np.allclose(pred[m], pred[ref], rtol=1e-4, atol=1e-5)]
    # float sums in another order: gradients agree to ~2e-6 of their scale
    bad += [m for m in names if m not in bad and not gaps[m][0] <= 1e-4]
    if bad:
        lines = ["  %-11s loss %.7f  max |pred - %s pred| %.3g  gradient gap %.3g%s"
                 % (m, loss[m], ref, float(np.abs(pred[m] - pred[ref]).max()), gaps[m][0],
                    " in %s" % gaps[m][1] if gaps[m][1] else "") for m in names]
        raise SystemExit("ABORT: the modes do not compute the same model on the first "
                         "minibatch (%s differ from %s; embedding %s):\n%s"
                         % (", ".join(bad), ref, modes.net.embed_update, "\n".join(lines)))
    emb = modes.net.encoder.embed.weight.name[len(modes.net.prefix):]
    return loss, grads[ref][emb][0] if emb in grads[ref] else None


def _secs(x):
    if not x:
        return "(not measured yet)"
    return "%.0f us" % (x * 1e6) if x >= 1e-5 else "%.2f us" % (x * 1e6)


def median(xs):
    return statistics.median(xs) if xs else None


def ratio_medians(rates, mode, base):
    if base not in rates or mode not in rates:
        return None
    return median([a / b for a, b in zip(rates[mode], rates[base])])


def times(x):
    return "-" if x is None else "%.2fx" % x


def percent(x):
    return "-" if x is None else "%.1f%%" % (100 * x)


def main(argv=None, script=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    set_threads(args.threads, argv, script)
    bench_core = imports()
    import jitbatch
    from tqdm import tqdm

    names = args.mode_list
    sizes = {"train": args.train_size, "infer": args.infer_size}
    counts = {"train": args.train_batches, "infer": args.infer_batches}
    slow = args.slow_batches if args.slow & set(names) else 0
    most = {w: max(counts[w], slow) for w in args.workload_list}   # timed batches; then warm-up
    need = max([sizes[w] * (most[w] + 1) for w in args.workload_list] + [args.train_size])
    t_load = time.perf_counter()
    # --fresh: the whole training split
    pairs, vocab_size = bench_core.load_pairs(bench_core.ensure_full_data(args.data),
                                              None if args.fresh else need)
    if len(pairs) < need:
        raise SystemExit("%s has %d training pairs; these settings need %d"
                         % (args.data, len(pairs), need))
    print("loaded %d pairs (vocabulary %d) in %.1f s; OMP_NUM_THREADS=%s, "
          "OMP_WAIT_POLICY=%s" % (len(pairs), vocab_size, time.perf_counter() - t_load,
                                  os.environ.get("OMP_NUM_THREADS"),
                                  os.environ.get("OMP_WAIT_POLICY", "(unset)")), flush=True)

    modes = Modes(bench_core, vocab_size, args.seed, names, embed_update=args.embed_update)
    same = [m for m in names if m != "dynet"]
    first, emb_stype = check_same(modes, same, pairs[:args.train_size])
    print("first training minibatch: loss %.6f in every mode (%s); predictions and "
          "gradients equal (%s: %s)"
          % (first[same[0]], ", ".join(same), EMBED_WORDS[args.embed_update],
             "no gradient" if emb_stype is None else "%s gradient" % emb_stype), flush=True)

    step = {"train": modes.train_step, "infer": modes.infer_step}
    settle = [m for m in names if m.startswith("jit:")] if args.settle else []
    for m in tqdm(settle, desc="settle", leave=False, file=sys.stderr):
        modes.mode(m)
        for w in args.workload_list:
            size = sizes[w]
            for i in range(args.settle):
                j = i % max(most[w], 1)
                step[w](pairs[j * size:(j + 1) * size])
    # minibatches a round may time (--fresh: all but the last, the warm-up one)
    avail = {w: len(pairs) // sizes[w] - 1 if args.fresh else most[w]
             for w in args.workload_list}
    for w in args.workload_list:
        if avail[w] < most[w]:
            raise SystemExit("%s has %d training pairs; --fresh needs at least %d"
                             % (args.data, len(pairs), sizes[w] * (most[w] + 1)))
    rates = {w: {m: [] for m in names} for w in args.workload_list}
    analysis = {w: {m: [] for m in names if m.startswith("jit:")} for w in args.workload_list}
    execute = {w: {m: [] for m in names if m.startswith("jit:")} for w in args.workload_list}
    release = {w: {m: [] for m in names if m.startswith("jit:")} for w in args.workload_list}
    busy = {w: {m: [] for m in names if m != "dynet"} for w in args.workload_list}
    kernels = {w: {m: [] for m in names if m != "dynet"} for w in args.workload_list}
    chosen = {w: {} for w in args.workload_list}
    total = args.rounds * len(args.workload_list) * len(names)
    bar = tqdm(total=total, desc="bench", leave=False, file=sys.stderr)
    for r in range(args.rounds):
        for w in args.workload_list:
            size = sizes[w]
            for m in names:
                bar.set_postfix(round=r + 1, workload=w, mode=m)
                n = args.slow_batches if m in args.slow else counts[w]
                if m == "dynet":
                    rates[w][m].append(run_dynet(args, w, n))
                    bar.update()
                    continue
                warm = pairs[avail[w] * size:(avail[w] + 1) * size]
                if m in args.slow:   # per-sample: a few pairs build every cache it has
                    warm = warm[:SLOW_WARM]
                modes.mode(m)
                step[w](warm)                                # warm caches for this mode
                start = r * counts[w] if args.fresh else 0   # this round's minibatches
                jitbatch.reset_stats()
                c0 = time.thread_time()
                p0 = time.process_time()
                t0 = time.perf_counter()
                for i in range(n):
                    j = (start + i) % avail[w]
                    step[w](pairs[j * size:(j + 1) * size])
                dt = time.perf_counter() - t0
                main_cpu = time.thread_time() - c0
                busy[w][m].append(main_cpu / dt)
                kernels[w][m].append((time.process_time() - p0 - main_cpu) / dt)
                rates[w][m].append(n * size / dt)
                if m.startswith("jit:"):
                    st = jitbatch.stats()
                    analysis[w][m].append(st["analysis_seconds"] / dt)
                    execute[w][m].append(st["execute_seconds"] / dt)
                    release[w][m].append(st["release_seconds"] / dt)
                    if m == "jit:auto":
                        lf = st["last_flush"]
                        seen = chosen[w].get("flush_policies", {})
                        for pol, k in st["policies"].items():
                            seen[pol] = seen.get(pol, 0) + k
                        chosen[w] = {"policy": lf.get("policy"), "why": lf.get("why"),
                                     "flush_policies": seen, "padding": lf.get("padding"),
                                     "nodes": lf.get("nodes"), "launches": lf.get("launches"),
                                     "chunk_size": lf.get("chunk_size"),
                                     "granularity": lf.get("granularity"),
                                     "pipeline": st["pipeline"]}
                bar.update()
    bar.close()

    result = {"threads": os.environ.get("OMP_NUM_THREADS"),
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "rounds": args.rounds,
              "first_loss": first[same[0]], "embed_update": args.embed_update,
              "embedding_grad_stype": emb_stype, "args": {k: v for k, v in vars(args).items()
                                                     if k not in ("slow",)},
              "workloads": {}}
    for w in args.workload_list:
        table = {}
        for m in names:
            table[m] = {"pairs_per_s": median(rates[w][m]), "rates": rates[w][m],
                        "vs_plain": ratio_medians(rates[w], m, "plain"),
                        "vs_hand": ratio_medians(rates[w], m, "hand"),
                        "vs_dynet": ratio_medians(rates[w], m, "dynet"),
                        "analysis_fraction": median(analysis[w].get(m, [])),
                        "execute_fraction": median(execute[w].get(m, [])),
                        "release_fraction": median(release[w].get(m, [])),
                        "main_thread_busy": median(busy[w].get(m, [])),
                        "other_threads_busy": median(kernels[w].get(m, [])),
                        "timed_batches": args.slow_batches if m in args.slow else counts[w]}
        result["workloads"][w] = {"minibatch": sizes[w], "modes": table, "auto": chosen[w]}
        title = ("training (forward + backward + Adagrad)" if w == "train"
                 else "inference (forward, predictions read)")
        print()
        print("%s, %s, minibatch %d pairs, OMP_NUM_THREADS=%s, median of %d interleaved "
              "rounds%s"
              % (title, EMBED_WORDS[args.embed_update], sizes[w], result["threads"], args.rounds,
                 ", fresh minibatches each round (%d available)" % avail[w]
                 if args.fresh else ""))
        print("%-15s %9s %9s %9s %9s %9s %9s %9s %9s %9s %8s" % (
            "mode", "pairs/s", "vs plain", "vs hand", "vs dynet", "analysis", "execute",
            "release", "main busy", "kernels", "batches"))
        for m in names:
            row = table[m]
            print("%-15s %9.1f %9s %9s %9s %9s %9s %9s %9s %9s %8d" % (
                m, row["pairs_per_s"], times(row["vs_plain"]), times(row["vs_hand"]),
                times(row["vs_dynet"]), percent(row["analysis_fraction"]), percent(row["execute_fraction"]),
                percent(row["release_fraction"]), percent(row["main_thread_busy"]),
                percent(row["other_threads_busy"]), row["timed_batches"]))
        if "jit:auto" in names and not chosen[w].get("flush_policies"):
            print("jit:auto: no timed flush: its calls ran eagerly (passthrough after a "
                  "flush that merged nothing)")
        elif chosen[w]:
            c = chosen[w]
            print("jit:auto chose %s (%s); last flush %s nodes in %s launches (%s); timed "
                  "flushes by policy, all rounds: %s"
                  % (c["policy"], c["why"], c["nodes"], c["launches"],
                     "graph cut into chunks of %d nodes" % c["chunk_size"]
                     if c.get("chunk_size") else "graph not cut into chunks",
                     c["flush_policies"]))
            for name, p in sorted((c.get("padding") or {}).items()):
                print("  zero-padded %s: %d nodes, %d ready sets -> %d launches, %.2fx the "
                      "rows after padding (split priced at %s fixed, %s per padded row)"
                      % (name.rsplit("_", 1)[-1], p["rows"], p["batches"], p["launches"],
                         p["units"] / max(p["rows"], 1), _secs(p["fixed_s"]),
                         _secs(p["per_unit_s"])))
            for p in c.get("pipeline") or ():
                if p["recording"] == (w == "train"):
                    print("  pipelined chunks (%s): %d per graph of ~%d nodes; measured us "
                          "per node by chunk count: %s; kernels busy: %s"
                          % ("recording" if p["recording"] else "not recording", p["chunks"],
                             p["graph_nodes"], p["us_per_node"] or "(none yet)",
                             {c: "%.0f%%" % (100 * b) for c, b in p["kernels_busy"].items()}
                             or "(none yet)"))
            for name, g in sorted((c.get("granularity") or {}).items()):
                print("  granularity of %s: %s (%s)" % (name.rsplit("_", 1)[-1],
                                                         g["granularity"], g["why"]))
    if args.json:
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print("\nsaved %s" % args.json)
    return result


if __name__ == "__main__":
    main(script=__file__)
