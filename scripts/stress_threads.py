"""Stress several threads pushing through one model, and report a hang.

MXNet's engine can deadlock when two threads push operations that share two
arrays at once (docs/design.rst, Known limits: Threads). A hang is rare per
run, so this repeats a run until one hangs or the time is up:

  --what map    test_heldout22's three threads each running jitbatch.map over
                per-sample backwards through one model (what hung in CI)
  --what plain  plain Gluon, no jitbatch: three threads, per-sample backwards
                through one hybridized model

    OMP_NUM_THREADS=1 python scripts/stress_threads.py --what map --seconds 90

Each thread costs MXNet about 5 MB that it keeps until the process ends, so a
long run grows by that much per thread it starts (--what map starts three per
run)."""
import argparse
import os
import sys
import threading
import time

from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))


def run_map(stall):
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    import test_heldout22 as t  # pylint: disable=import-outside-toplevel
    t.JOIN = stall
    cases = [(fn, policy) for fn in (t.routed, t.saliency) for policy in ("auto", "agenda")]
    k = [0]

    def once():
        fn, policy = cases[k[0] % len(cases)]
        k[0] += 1
        try:
            t.test_map_inside_several_threads_at_once(fn, policy)
        except AssertionError as e:
            if "hangs" not in str(e):
                raise
            return "%s under %s" % (fn.__name__, policy)
        return None
    return once


def run_plain(stall):
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    from mxnet import autograd, nd  # pylint: disable=import-outside-toplevel
    from mxnet.gluon import nn  # pylint: disable=import-outside-toplevel
    net = nn.HybridSequential()
    net.add(nn.Dense(16, in_units=8, activation="tanh"), nn.Dense(4, in_units=16))
    net.initialize()
    net.hybridize()
    done = [0, 0, 0]

    def worker(k):
        x0 = mx.nd.random.uniform(shape=(1, 8)).asnumpy()
        i = 0
        while True:
            x = nd.array(x0 + i)
            x.attach_grad()
            with autograd.record():
                y = net(x)
                s = nd.sum(y * y)
            s.backward()
            x.grad.asnumpy()
            done[k] += 1
            i += 1
    for k in range(3):
        threading.Thread(target=worker, args=(k,), daemon=True).start()

    def once():
        before = sum(done)
        time.sleep(stall)
        return None if sum(done) > before else "no sample done in %g s" % stall
    return once


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=["map", "plain"], default="map")
    ap.add_argument("--seconds", type=float, default=90.0, help="stop after this long")
    ap.add_argument("--stall", type=float, default=20.0,
                    help="seconds without progress that count as a hang")
    args = ap.parse_args()
    once = (run_map if args.what == "map" else run_plain)(args.stall)
    end = time.time() + args.seconds
    runs = 0
    with tqdm(desc=args.what, unit="run") as bar:
        while time.time() < end:
            hung = once()
            if hung:
                print("HANG after %d runs: %s" % (runs, hung), flush=True)
                os._exit(3)     # the hung threads cannot be joined
            runs += 1
            bar.update()
    print("no hang in %d runs (%.0f s)" % (runs, args.seconds))


if __name__ == "__main__":
    main()
