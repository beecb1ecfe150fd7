"""Training pairs/s of the Tree-LSTM in one process and as dist_sync jobs of N
workers (scripts/dist_train.sh), in interleaved rounds; prints one table.

    OMP_NUM_THREADS=1 python scripts/bench_dist.py --workers 1,2 --rounds 3 -- --epochs 3

Modes: ``1 process`` (the trainer as is, no kvstore) and ``N worker(s)``
(scheduler + 1 server + N workers on loopback, global minibatch unchanged).
The rate is the trainer's own: pairs of the whole job over rank 0's time in its
epoch loops (waiting for the other workers included; evaluation, start-up and
shut-down not), median over rounds; "vs 1 proc" the median of each round's
ratio to that round's one-process rate (absolute rates move with the machine's
load, ratios less); "job s" is the whole command's wall time,
start-up and evaluation included; "last loss" the last epoch's training loss
of the last round (the same in every mode, up to float rounding). Arguments
after ``--`` go to the trainer.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_mode(workers, train_args, out):
    env = dict(os.environ, PYTHON=sys.executable, DIST_DIR=os.path.join(out, "dist"),
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")]
                                                    if p]))
    env.setdefault("OMP_NUM_THREADS", "1")
    args = list(train_args) + ["--quiet", "--no-plot", "--out", out]
    if workers == 0:
        cmd = [sys.executable, "-m", "examples.tree_lstm.train"] + args
    else:
        cmd = ["bash", os.path.join(ROOT, "scripts", "dist_train.sh"), str(workers)] + args
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit("bench_dist: %s failed (status %d):\n%s\n%s"
                         % (" ".join(cmd), proc.returncode, proc.stdout, proc.stderr))
    with open(os.path.join(out, "metrics.json")) as f:
        metrics = json.load(f)
    return metrics["throughput"]["train_pairs_per_s"], wall, metrics["train_loss"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    a = p.parse_args()
    train_args = a.train_args[1:] if a.train_args[:1] == ["--"] else a.train_args
    modes = [0] + [int(w) for w in a.workers.split(",")]
    rates = {m: [] for m in modes}
    walls = {m: [] for m in modes}
    losses = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for m in modes:
                rate, wall, loss = run_mode(m, train_args, os.path.join(tmp, "%d_%d" % (m, r)))
                rates[m].append(rate)
                walls[m].append(wall)
                losses[m] = loss
                print("round %d, %s: %.1f pairs/s, job %.1f s, train loss %s"
                      % (r + 1, name(m), rate, wall, " ".join("%.4f" % x for x in loss)),
                      file=sys.stderr, flush=True)
    print("trainer arguments: %s; OMP_NUM_THREADS=%s; %d rounds, medians"
          % (" ".join(train_args) or "(defaults)", os.environ.get("OMP_NUM_THREADS", "1"),
             a.rounds))
    print("%-12s %14s %12s %10s %12s %10s %12s" % ("mode", "train pairs/s", "range",
                                                   "vs 1 proc", "range", "job s", "last loss"))
    for m in modes:
        ratios = [x / b for x, b in zip(rates[m], rates[0])]  # within a round: same load
        print("%-12s %14.1f %5.0f-%-6.0f %9.2fx %5.2f-%-6.2f %10.1f %12.6f"
              % (name(m), statistics.median(rates[m]), min(rates[m]), max(rates[m]),
                 statistics.median(ratios), min(ratios), max(ratios),
                 statistics.median(walls[m]), losses[m][-1]))


def name(m):
    return "1 process" if m == 0 else "%d worker%s" % (m, "" if m == 1 else "s")


if __name__ == "__main__":
    main()
