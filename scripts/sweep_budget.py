"""Sweep jitbatch's analysis budget under policy 'auto' on Tree-LSTM training.

For each ``analysis_budget`` (a fraction of a flush's predicted unbatched
execution time that the scheduler's analysis may cost; ``none`` = unbounded)
the model runs ``net.hybridize(dynamic_batch=True, policy='auto',
analysis_budget=B)`` training steps (minibatch --batch-size pairs, forward +
backward + Adagrad, with the cell's child axis declared zero-paddable, as in
scripts/bench_tree_lstm.py's jit modes) on the full-size SICK-shaped set.
Budgets are timed in interleaved rounds in one process (median over rounds;
the ratio to the unbounded budget is taken within each round). Prints, per
budget: pairs/s, analysis seconds per step, the analysis fraction (analysis
seconds / step time), the budget in seconds per flush (the budget times the
flush's predicted unbatched execution time, from
``jitbatch.stats()['last_flush']``) with "ok" when every timed run's
measured analysis per flush stayed within it (else the largest measured /
allowed ratio of a timed run), and which policies 'auto' ran; the hand
level-by-level batched model is timed alongside as a reference. Saves a
plot of throughput and analysis fraction against the budget (log x axis; 0
and unbounded drawn at the ends) to --out.

--threads sets OMP_NUM_THREADS before mxnet is imported (see bench_tree_lstm.py).

    python scripts/sweep_budget.py                      # ~3 min on 2 busy cores
    python scripts/sweep_budget.py --budgets 0,0.03,none --rounds 1 --batches 2
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from bench_tree_lstm import imports, set_threads  # noqa: E402  (no mxnet import yet)

DEFAULT_BUDGETS = "0,0.001,0.003,0.01,0.03,0.1,1,none"
SHORT = {"sequential": "seq"}


def parse_budgets(text):
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        if item in ("none", "unbounded", "inf"):
            out.append(None)
            continue
        try:
            b = float(item)
        except ValueError:
            raise SystemExit("--budgets: %r is not a number or 'none'" % item)
        if not b >= 0:
            raise SystemExit("--budgets: %r must be >= 0" % item)
        out.append(b)
    if not out:
        raise SystemExit("--budgets: nothing to sweep")
    return out


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "sick_full"))
    ap.add_argument("--budgets", default=DEFAULT_BUDGETS,
                    help="comma-separated fractions; 'none' = unbounded (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=3, help="timed minibatches per budget per round")
    ap.add_argument("--batch-size", type=int, default=25)
    ap.add_argument("--settle", type=int, default=16,
                    help="untimed minibatches under the unbounded budget before the rounds, "
                         "so 'auto's online choices that every budget shares (the pipelined "
                         "chunk count: jitbatch.pipeline.Pipe) have settled; 0: none")
    ap.add_argument("--no-hand", action="store_true", help="skip the hand-batched reference")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "sweep_budget.png"))
    ap.add_argument("--json", metavar="PATH", help="also save the table as JSON")
    ap.add_argument("--replot", metavar="JSON", help="only redraw --out from a saved --json")
    return ap


def label(b):
    return "none" if b is None else "%g" % b


def plot(path, budgets, pps, frac, chose, hand_pps):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pos = sorted(b for b in budgets if b)
    lo = pos[0] / 10 if pos else 0.1
    hi = pos[-1] * 10 if pos else 10.0
    xs = [lo if b == 0 else hi if b is None else b for b in budgets]
    order = sorted(range(len(budgets)), key=lambda i: xs[i])
    xs = [xs[i] for i in order]
    labels = [label(budgets[i]) if budgets[i] is not None else "unbounded" for i in order]
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(7, 6))
    ax1.plot(xs, [pps[i] for i in order], "o-", label="jitbatch, policy='auto'")
    for x, i in zip(xs, order):
        ax1.annotate(chose[i], (x, pps[i]), textcoords="offset points", xytext=(0, 7),
                     ha="left", fontsize=7, rotation=35)
    if hand_pps is not None:
        ax1.axhline(hand_pps, ls="--", color="gray", label="hand level-by-level batched")
    ax1.set_ylabel("training pairs/s")
    ax1.set_ylim(0, 1.3 * max(list(pps) + [hand_pps or 0]))
    ax1.legend(loc="upper left", fontsize=8)
    ax1.grid(alpha=0.3)
    ax2.plot(xs, [100 * frac[i] for i in order], "s-", color="C1")
    ax2.set_ylabel("analysis / step time (%)")
    ax2.set_ylim(bottom=0)
    ax2.grid(alpha=0.3)
    ax2.set_xscale("log")
    ax2.set_xticks(xs)
    ax2.set_xticklabels(labels)
    ax2.minorticks_off()
    ax2.set_xlabel("analysis_budget (fraction of predicted unbatched execution time)")
    fig.suptitle("Tree-LSTM training: jitbatch analysis budget sweep")
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None, script=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    budgets = parse_budgets(args.budgets)
    for name in ("rounds", "batches", "batch_size", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit("--%s must be at least 1" % name.replace("_", "-"))
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        rows = saved["rows"]
        plot(args.out, [r["budget"] for r in rows], [r["pairs_per_s"] for r in rows],
             [r["analysis_fraction"] for r in rows], [r["chose"] for r in rows],
             saved.get("hand_pairs_per_s"))
        print("saved %s" % args.out)
        return saved
    set_threads(args.threads, argv, script)
    bench_core = imports()
    import jitbatch
    from mxnet import autograd, nd
    from tqdm import tqdm
    from examples.tree_lstm.hand_batched import HandBatched

    size, n = args.batch_size, args.batches
    pairs, vocab_size = bench_core.load_pairs(bench_core.ensure_full_data(args.data),
                                              size * (n + 1))
    if len(pairs) < size * (n + 1):
        raise SystemExit("%s has too few training pairs for these settings" % args.data)
    run = bench_core.Runner(vocab_size, seed=args.seed)
    hand = HandBatched(run.net, hybridize=False)

    def hand_step(batch):
        target = nd.concat(*[s[4] for s in batch], dim=0)
        with autograd.record():
            total = nd.sum(run.loss(hand(batch), target))
        total.backward()
        run.trainer.step(len(batch))
        return total.asscalar()

    def configure(b):
        if b == "hand":
            run.net.hybridize()
        else:
            # as bench_tree_lstm.py's jit modes: the cell's child axis zero-paddable
            jitbatch.zero_pad(run.net.encoder.cell, ch=1, cc=1)
            run.net.hybridize(dynamic_batch=True, policy="auto", analysis_budget=b)

    keys = list(range(len(budgets))) + ([] if args.no_hand else ["hand"])
    rates = {k: [] for k in keys}
    per_step = {k: [] for k in keys}
    frac = {k: [] for k in keys}
    policies = {k: {} for k in keys}
    recorded = dict.fromkeys(keys, 0)
    allowed = {k: [] for k in keys}     # per timed run: the last flush's budget in seconds
    per_flush = {k: [] for k in keys}   # and the measured analysis seconds per flush
    warm = pairs[n * size:(n + 1) * size]
    configure(None)
    for i in tqdm(range(args.settle), desc="settle", leave=False, file=sys.stderr):
        run.step(pairs[(i % (n + 1)) * size:(i % (n + 1) + 1) * size])
    bar = tqdm(total=args.rounds * len(keys), desc="sweep", leave=False, file=sys.stderr)
    for r in range(args.rounds):
        for k in keys:
            b = "hand" if k == "hand" else budgets[k]
            bar.set_postfix(round=r + 1, budget=label(b) if k != "hand" else "hand")
            configure(b)
            step = hand_step if k == "hand" else run.step
            step(warm)
            jitbatch.reset_stats()
            t0 = time.perf_counter()
            for i in range(n):
                step(pairs[i * size:(i + 1) * size])
            dt = time.perf_counter() - t0
            st = jitbatch.stats()
            pred = st["last_flush"].get("predicted") or {}
            if k != "hand" and b is not None and "sequential" in pred and st["flushes"]:
                # the budget in seconds: b x the flush's predicted unbatched execution
                allowed[k].append(b * pred["sequential"]["execute"])
                per_flush[k].append(st["analysis_seconds"] / st["flushes"])
            rates[k].append(n * size / dt)
            per_step[k].append(st["analysis_seconds"] / n)
            frac[k].append(st["analysis_seconds"] / dt)
            for pol, c in st["policies"].items():
                policies[k][pol] = policies[k].get(pol, 0) + c
            recorded[k] += st["nodes"]
            bar.update()
    bar.close()

    ref = budgets.index(None) if None in budgets else len(budgets) - 1
    rows = []
    print("jitbatch policy='auto', Tree-LSTM training, minibatch %d pairs, OMP_NUM_THREADS=%s, "
          "median of %d interleaved rounds x %d minibatches"
          % (size, os.environ.get("OMP_NUM_THREADS"), args.rounds, n))
    print("%-9s %9s %11s %12s %9s %15s  %s" % (
        "budget", "pairs/s", "vs " + label(budgets[ref]), "analysis/step", "analysis",
        "allowed/flush", "auto ran (flushes)"))
    for k in range(len(budgets)):
        pol = policies[k]
        # no flush at all: after a flush that merged nothing, 'auto' runs the
        # following calls eagerly for a while (passthrough), unrecorded
        main_pol = "/".join(SHORT.get(p, p) for p in sorted(pol, key=pol.get, reverse=True)) \
            if pol else "eager"
        row = {"budget": budgets[k], "pairs_per_s": statistics.median(rates[k]),
               "rates": rates[k],
               "vs_ref": statistics.median(a / b for a, b in zip(rates[k], rates[ref])),
               "analysis_s_per_step": statistics.median(per_step[k]),
               "analysis_fraction": statistics.median(frac[k]),
               "policies": pol, "chose": main_pol, "recorded_nodes": recorded[k],
               "allowed_s_per_flush": statistics.median(allowed[k]) if allowed[k] else None,
               "worst_of_budget": max([a / w for a, w in zip(per_flush[k], allowed[k]) if w]
                                      or [None])}
        row["within_budget"] = row["worst_of_budget"] is None or row["worst_of_budget"] <= 1
        rows.append(row)
        if budgets[k] == 0:
            within = "0 (sequential)"   # one launch per node, the graph not analysed
        elif row["allowed_s_per_flush"] is None:
            within = "-"
        else:
            within = "%.2f ms %s" % (1e3 * row["allowed_s_per_flush"],
                                     "ok" if row["within_budget"] else
                                     "%.1fx" % row["worst_of_budget"])
        print("%-9s %9.1f %10.2fx %11.2f ms %8.1f%% %15s  %s"
              % (label(budgets[k]), row["pairs_per_s"], row["vs_ref"],
                 1e3 * row["analysis_s_per_step"], 100 * row["analysis_fraction"], within,
                 ", ".join("%s %d" % kv for kv in sorted(pol.items()))
                 or "no flush: all calls ran eagerly (passthrough)"))
    hand_pps = None
    if not args.no_hand:
        hand_pps = statistics.median(rates["hand"])
        print("%-9s %9.1f %10.2fx" % ("hand", hand_pps, statistics.median(
            a / b for a, b in zip(rates["hand"], rates[ref]))))
    plot(args.out, budgets, [r["pairs_per_s"] for r in rows],
         [r["analysis_fraction"] for r in rows], [r["chose"] for r in rows], hand_pps)
    print("saved %s" % args.out)
    result = {"threads": os.environ.get("OMP_NUM_THREADS"), "batch_size": size,
              "rounds": args.rounds, "batches": n, "rows": rows, "hand_pairs_per_s": hand_pps}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print("saved %s" % args.json)
    return result


if __name__ == "__main__":
    main(script=__file__)
