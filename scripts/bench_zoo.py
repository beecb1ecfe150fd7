"""Model zoo throughput: per-sample Gluon, jitbatch and hand-batched code, per model.

For each zoo model (examples/zoo; --models picks), in ONE process, each mode
on its own copy of the network (built from the same seed: the same initial
parameters; each configured once, as a user's process configures its model,
and trained by its own trainer), two workloads:

* training: a minibatch (32 samples; 25 for the tree models; --train-size
  overrides), forward + one backward of the summed per-sample loss +
  gluon.Trainer Adagrad step (lr 0.02, wd 1e-4); no step for a model whose
  work follows its parameters (``greedy_decode``: the decoder runs until it
  predicts its end), since each mode trains its own copy for a different
  number of steps and would time different work;
* inference: a minibatch of --infer-size samples (128), forward only, every
  sample's output (logits) read back to numpy.

Modes:
  plain    per-sample code, not hybridized
  hybrid   per-sample code, hybridized (net.hybridize())
  jit      per-sample code under jitbatch: net.hybridize(dynamic_batch=True),
           policy and granularity 'auto'
  map      the same, with the loop over a minibatch's samples written
           jitbatch.map(fn, samples): a read inside a sample (moe's routing)
           waits for the other samples, so one flush serves them all
  hand     the model's hand-batched reference (level-batched trees and
           programs, packed / padded sequences, experts grouped), its blocks
           hybridized; skipped where the model has none

Before timing, every mode must give the same summed loss on the first training
minibatch (no update) and the same outputs on it (rtol 1e-4); the script
prints them and aborts otherwise. A mode that raises (fused RNN layers under
jitbatch today) is reported and left out for that model. Each jit mode then
runs --settle untimed minibatches per workload ('auto' measures its pipelined
chunk count as it runs: jitbatch.pipeline.Pipe). Modes are timed in interleaved
rounds (a warm-up minibatch, then the timed ones, per mode and round); ratios
are taken within each round and the median over rounds is printed. Per-sample
modes (--slow-modes) time --slow-batches minibatches per round, after the same
warm-up minibatch as every mode. Ratios to a per-sample mode ("vs hybrid") compare every
mode's rate on the first timed minibatch of each round, which all modes time
(per-sample costs differ between minibatches); ratios to the hand-batched
code compare all timed minibatches.

Columns: samples/s (median over rounds), main busy (CPU time of the thread
running the steps, with jitbatch.map's pool threads in mode 'map', over their
wall time: near 100% means the step waits on Python, MXNet's kernels run on
other threads). Per model, the jit mode's
jitbatch counters per timed step: recorded nodes, launches, flushes (forced:
by a value read), and the policies 'auto' chose.

    OMP_NUM_THREADS=1 python scripts/bench_zoo.py --rounds 3
    OMP_NUM_THREADS=1 python scripts/bench_zoo.py --models gru_seq,attention --json runs/zoo.json
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from bench_tree_lstm import median, percent, ratio_medians, set_threads, times  # noqa: E402

ALL_MODES = ("plain", "hybrid", "jit", "map", "hand")
JIT_MODES = ("jit", "map")   # the modes that run under jitbatch
WORKLOADS = ("train", "infer")


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--models", default=None,
                    help="comma-separated zoo models (default: all; see examples/zoo)")
    ap.add_argument("--modes", default=",".join(ALL_MODES),
                    help="comma-separated, from: %s" % ", ".join(ALL_MODES))
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median taken)")
    ap.add_argument("--train-batches", type=int, default=4,
                    help="timed training minibatches per mode per round")
    ap.add_argument("--infer-batches", type=int, default=2,
                    help="timed inference minibatches per mode per round")
    ap.add_argument("--slow-batches", type=int, default=1,
                    help="timed minibatches per round (both workloads) for --slow-modes")
    ap.add_argument("--slow-modes", default="plain,hybrid")
    ap.add_argument("--settle", type=int, default=16,
                    help="untimed minibatches per workload each jit mode runs before the "
                         "rounds, so 'auto''s online choices have settled; 0: none")
    ap.add_argument("--train-size", type=int, default=None,
                    help="samples per training minibatch (default: the model's, 32 or 25)")
    ap.add_argument("--infer-size", type=int, default=128)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--threads", type=int, default=1,
                    help="OMP_NUM_THREADS for MXNet (set before mxnet is imported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="save the results as JSON")
    return ap


def parse_args(argv):
    args = build_parser().parse_args(argv)
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.mode_list if m not in ALL_MODES]
    if bad or not args.mode_list:
        raise SystemExit("--modes: unknown mode(s) %s; choose from %s"
                         % (", ".join(bad) or "(none)", ", ".join(ALL_MODES)))
    args.slow = set(m.strip() for m in args.slow_modes.split(",") if m.strip())
    args.workload_list = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not args.workload_list or set(args.workload_list) - set(WORKLOADS):
        raise SystemExit("--workloads: expected train, infer or both")
    for name in ("rounds", "train_batches", "infer_batches", "slow_batches", "infer_size",
                 "threads"):
        if getattr(args, name) < 1:
            raise SystemExit("--%s must be at least 1" % name.replace("_", "-"))
    if args.settle < 0 or (args.train_size is not None and args.train_size < 1):
        raise SystemExit("--settle must be 0 or more, --train-size at least 1")
    return args


class Runner(object):
    """One zoo model in every mode: each mode keeps its own copy of the network,
    built from the same seed (the same initial parameters), with its own
    trainer, configured once (hybridized, flagged) as a user's process
    configures its model; the hand-batched reference runs on the hand mode's
    copy. Switching modes re-hybridizes nothing: a mode's caches (MXNet's
    CachedOps, jitbatch's signatures and per-shape launch state) persist
    between its rounds, as they do between a training loop's steps."""

    def __init__(self, entry, seed, modes):
        from mxnet import autograd, gluon, nd
        self.nd, self.autograd = nd, autograd
        self.entry = entry
        self.nets, self.trainers = {}, {}
        for m in modes:
            net = self.nets[m] = entry.build(seed)
            if m == "plain":
                net.hybridize(active=False)
            elif m in ("hybrid", "hand"):
                net.hybridize()
            else:
                net.hybridize(dynamic_batch=True)
            self.trainers[m] = gluon.Trainer(net.collect_params(), "adagrad",
                                             {"learning_rate": 0.02, "wd": 1e-4})
        self.hand = entry.hand(self.nets["hand"]) if entry.hand and "hand" in modes else None
        self.current = self.net = self.trainer = None
        self.each = None   # what runs a minibatch's per-sample calls (jitbatch.map in 'map')

    def per_sample(self, samples, losses=True):
        """Every sample's output (and loss): a loop, or jitbatch.map in mode 'map'."""
        return self.entry.per_sample(self.net, samples, self.each, losses)

    def mode(self, name):
        self.current = name
        if name == "map":
            import jitbatch
            self.each = jitbatch.map
        else:
            self.each = None
        self.net, self.trainer = self.nets[name], self.trainers[name]

    def train_step(self, batch, update=True):
        nd, autograd = self.nd, self.autograd
        with autograd.record():
            if self.current == "hand":
                total = nd.sum(self.hand.loss(batch, self.hand.forward(batch)))
            else:
                _, losses = self.per_sample(batch)
                total = nd.add_n(*losses)
        total.backward()
        if update and not self.entry.steered:
            # a minibatch may leave an expert or a module unused: its gradient is stale
            self.trainer.step(len(batch), ignore_stale_grad=True)
        return total.asscalar()

    def infer_step(self, batch):
        if self.current == "hand":
            return self.hand.forward(batch).asnumpy()
        outs, _ = self.per_sample(batch, losses=False)
        return self.nd.concat(*outs, dim=0).asnumpy()


def check_same(run, names, batch):
    """Summed loss (no update) and outputs of the first minibatch in every mode:
    returns (losses, errors); aborts where two modes disagree."""
    import numpy as np
    loss, out, errors = {}, {}, {}
    for m in names:
        run.mode(m)
        try:
            loss[m] = run.train_step(batch, update=False)
            out[m] = run.infer_step(batch)
        except Exception as exc:  # pylint: disable=broad-except
            errors[m] = "%s: %s" % (type(exc).__name__, str(exc).split("\n")[0][:300])
    ok = [m for m in names if m in loss]
    ref = ok[0]
    bad = [m for m in ok if not np.isclose(loss[m], loss[ref], rtol=1e-4)
           or not np.allclose(out[m], out[ref], rtol=1e-4, atol=1e-5)]
    lines = ["  %-7s loss %.6f  max |out - %s out| %.3g"
             % (m, loss[m], ref, float(np.abs(out[m] - out[ref]).max())) for m in ok]
    if bad:
        raise SystemExit("ABORT: %s: the modes do not compute the same model on the first "
                         "minibatch (%s differ from %s):\n%s"
                         % (run.entry.name, ", ".join(bad), ref, "\n".join(lines)))
    return loss, errors


def bench_model(args, entry, tqdm, jitbatch):
    """Check, settle and time one model; print its table; return its results."""
    import numpy as np
    sizes = {"train": args.train_size or entry.train_size, "infer": args.infer_size}
    counts = {"train": args.train_batches, "infer": args.infer_batches}
    names = [m for m in args.mode_list if m != "hand" or entry.hand]
    rng = np.random.default_rng(args.seed)
    # per workload: the timed minibatches, then the warm-up one
    data = {w: [entry.generate(rng, sizes[w]) for _ in range(counts[w] + 1)]
            for w in args.workload_list}
    run = Runner(entry, args.seed, names)
    first = data["train"][0] if "train" in data else data["infer"][0][:sizes["train"]]
    loss, errors = check_same(run, names, first)
    names = [m for m in names if m not in errors]
    print("\n== %s: %s" % (entry.name, entry.summary))
    print("first training minibatch (%d samples): summed loss %s, outputs equal"
          % (len(first), ", ".join("%s %.6f" % (m, loss[m]) for m in names)))
    for m, err in sorted(errors.items()):
        print("  mode %s FAILED and is left out: %s" % (m, err))
    step = {"train": run.train_step, "infer": run.infer_step}
    for m in (m for m in JIT_MODES if m in names and args.settle):
        run.mode(m)
        for w in args.workload_list:
            for i in range(args.settle):
                # no update: the modes' parameters stay alike (the slow modes run
                # fewer steps in the rounds; a steered model's work follows them)
                if w == "train":
                    run.train_step(data[w][i % counts[w]], update=False)
                else:
                    step[w](data[w][i % counts[w]])

    rates = {w: {m: [] for m in names} for w in args.workload_list}
    # each mode's rate on the first timed minibatch alone: the per-sample modes
    # time only that one (--slow-batches 1), and per-sample costs differ
    # between minibatches (a longer sequence is a longer loop), so ratios to
    # them compare that minibatch in every mode
    first_rates = {w: {m: [] for m in names} for w in args.workload_list}
    busy = {w: {m: [] for m in names} for w in args.workload_list}
    counters = {w: {m: {} for m in JIT_MODES} for w in args.workload_list}
    bar = tqdm(total=args.rounds * len(args.workload_list) * len(names), desc=entry.name,
               leave=False, file=sys.stderr)
    for r in range(args.rounds):
        for w in args.workload_list:
            for m in names:
                bar.set_postfix(round=r + 1, workload=w, mode=m)
                slow = m in args.slow
                n = args.slow_batches if slow else counts[w]
                # every mode warms up on a whole minibatch: a per-sample mode warmed
                # on a few samples timed its next training minibatch 15% faster
                # (greedy_decode, hybrid: its main thread waited less for kernels)
                warm = data[w][-1]
                run.mode(m)
                step[w](warm)
                jitbatch.reset_stats()
                c0, t0 = python_cpu(), time.perf_counter()
                for i in range(n):
                    step[w](data[w][i])     # ends with a read: the step is done
                    if i == 0:
                        first_rates[w][m].append(sizes[w] / (time.perf_counter() - t0))
                dt = time.perf_counter() - t0
                c1 = python_cpu()
                busy[w][m].append(sum(c1[t] - c0.get(t, 0.0) for t in c1) / dt)
                rates[w][m].append(n * sizes[w] / dt)
                if m in JIT_MODES:
                    add_counters(counters[w][m], jitbatch.stats(), n)
                bar.update()
    bar.close()
    result = {"summary": entry.summary, "first_loss": loss, "errors": errors,
              "workloads": {}}
    for w in args.workload_list:
        table = {m: {"samples_per_s": median(rates[w][m]), "rates": rates[w][m],
                     "main_thread_busy": median(busy[w][m]),
                     "timed_batches": args.slow_batches if m in args.slow else counts[w]}
                 for m in names}
        ratios = {"hand_vs_hybrid": ratio_medians(first_rates[w], "hand", "hybrid")}
        for m in JIT_MODES:
            ratios[m + "_vs_hand"] = ratio_medians(rates[w], m, "hand")
            ratios[m + "_vs_hybrid"] = ratio_medians(first_rates[w], m, "hybrid")
        result["workloads"][w] = {"minibatch": sizes[w], "modes": table, "ratios": ratios}
        for m in JIT_MODES:
            result["workloads"][w][m + "_per_step"] = per_step(counters[w][m])
    print_model(result, names)
    return result


def python_cpu():
    """CPU seconds of the threads that run Python steps, by thread: this one and
    jitbatch.map's pool threads (the samples of mode 'map' run there)."""
    import threading
    out = {threading.get_ident(): time.thread_time()}
    for t in threading.enumerate():
        if t.name == "jitbatch-map" and t.ident is not None:
            try:
                out[t.ident] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (OSError, ProcessLookupError):   # the thread ended meanwhile
                pass
    return out


def add_counters(acc, st, steps):
    """Sums of one timed run's jitbatch counters (over ``steps`` steps)."""
    for k in ("nodes", "launches", "flushes", "forced_flushes", "pipelined_flushes",
              "filler_samples", "analysis_seconds", "execute_seconds"):
        acc[k] = acc.get(k, 0) + st[k]
    acc["steps"] = acc.get("steps", 0) + steps
    pol = acc.setdefault("policies", {})
    for k, v in st["policies"].items():
        pol[k] = pol.get(k, 0) + v
    acc["last_policy"] = (st["last_flush"] or {}).get("policy")
    acc["last_why"] = (st["last_flush"] or {}).get("why")


def per_step(acc):
    if not acc:
        return None
    out = {k: v / acc["steps"] for k, v in acc.items()
           if k not in ("steps", "policies", "last_policy", "last_why")}
    out.update(steps=acc["steps"], policies=acc["policies"], last_policy=acc["last_policy"],
               last_why=acc["last_why"])
    return out


def main_rest(wl, m, s):
    """Seconds per step of mode ``m``'s main thread outside jitbatch's analysis
    and execute (``s``: its counters per step), from its rate and busy share."""
    mode = wl["modes"][m]
    if not mode["samples_per_s"] or mode["main_thread_busy"] is None or not s["nodes"]:
        return None
    busy = mode["main_thread_busy"] * wl["minibatch"] / mode["samples_per_s"]
    return max(busy - s["analysis_seconds"] - s["execute_seconds"], 0.0)


def print_model(result, names):
    ws = list(result["workloads"])
    sys.stderr.flush()
    print("%-8s" % "mode" + "".join("%14s %9s" % (w + " smp/s", "busy") for w in ws))
    for m in names:
        print("%-8s" % m + "".join(
            "%14.1f %9s" % (result["workloads"][w]["modes"][m]["samples_per_s"],
                            percent(result["workloads"][w]["modes"][m]["main_thread_busy"]))
            for w in ws))
    for w in ws:
        r = result["workloads"][w]["ratios"]
        for m in (m for m in JIT_MODES if m in names):
            print("%-5s %s/hand %s  %s/hybrid %s  (hand/hybrid %s)"
                  % (w, m, times(r[m + "_vs_hand"]), m, times(r[m + "_vs_hybrid"]),
                     times(r["hand_vs_hybrid"])))
            s = result["workloads"][w][m + "_per_step"]
            if s and not s["nodes"]:
                print("      %s recorded nothing in the timed steps: its calls ran eagerly "
                      "(after flushes that merged nothing, 'auto' stops recording for a "
                      "while)" % m)
            elif s:
                print("      %s per step: %.0f nodes, %.1f launches, %.2f flushes (%.2f "
                      "forced, %.2f pipelined); analysis %.1f ms, execute %.1f ms; flushes "
                      "by policy %s, last %s (%s)"
                      % (m, s["nodes"], s["launches"], s["flushes"], s["forced_flushes"],
                         s["pipelined_flushes"], 1e3 * s["analysis_seconds"],
                         1e3 * s["execute_seconds"], s["policies"], s["last_policy"],
                         s["last_why"]))
                rest = main_rest(result["workloads"][w], m, s)
                if rest is not None:
                    print("      %s main thread besides analysis and execute: %.1f ms per "
                          "step, %.2f us per node (the per-sample Python and its recording%s)"
                          % (m, 1e3 * rest, 1e6 * rest / s["nodes"],
                             ", the backward and the update" if w == "train" else ""))


def print_summary(results, workloads, modes):
    print("\nsummary: median of per-round ratios")
    head = "".join("%15s %15s" % (w + " vs hand", w + " vs hybrid") for w in workloads)
    for m in modes:
        print("%-14s%s" % (m, head))
        for name, res in results.items():
            print("%-14s" % name + "".join(
                "%15s %15s" % (times(res["workloads"][w]["ratios"][m + "_vs_hand"]),
                               times(res["workloads"][w]["ratios"][m + "_vs_hybrid"]))
                for w in workloads))


def main(argv=None, script=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    set_threads(args.threads, argv, script)
    import jitbatch
    from tqdm import tqdm
    from examples.zoo import MODELS
    models = [m.strip() for m in args.models.split(",")] if args.models else list(MODELS)
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit("--models: unknown %s; choose from %s"
                         % (", ".join(unknown), ", ".join(MODELS)))
    print("zoo benchmark: models %s; modes %s; %d rounds; OMP_NUM_THREADS=%s; jitbatch %s"
          % (", ".join(models), ", ".join(args.mode_list), args.rounds,
             os.environ.get("OMP_NUM_THREADS"),
             "compiled" if jitbatch.compiled_modules() else "from source"), flush=True)
    results = {}
    for name in models:
        results[name] = bench_model(args, MODELS[name], tqdm, jitbatch)
    jit_modes = [m for m in JIT_MODES if m in args.mode_list]
    if jit_modes:
        print_summary(results, args.workload_list, jit_modes)
    if args.json:
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"threads": os.environ.get("OMP_NUM_THREADS"), "rounds": args.rounds,
                       "args": {k: v for k, v in vars(args).items() if k != "slow"},
                       "models": results}, f, indent=1, default=str)
        print("\nsaved %s" % args.json)
    return results


if __name__ == "__main__":
    main(script=__file__)
