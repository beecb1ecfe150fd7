"""A small program run by every process of a dist_sync job in tests/test_dist.py.

    python tests/dist_job.py broadcast OUT   # workers start from different values
    python tests/dist_job.py die OUT         # rank 1 raises after a few steps

``broadcast``: each worker initialises a Dense layer with its own seed (so the
workers DISAGREE before the kvstore is set up), writes those values, lets
``dist.Worker.trainer`` broadcast rank 0's, writes them again, takes two steps
on per-rank data (rank 1 with an empty shard in the second), and saves its
final parameters through ``Worker.finish``.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mxnet as mx  # noqa: E402  (servers and the scheduler run inside this import)
from mxnet import autograd, gluon, nd  # noqa: E402

from examples.tree_lstm import dist  # noqa: E402


def values(net):
    return {k: p.data().asnumpy().tolist() for k, p in sorted(net.collect_params().items())}


def broadcast(out):
    worker = dist.Worker(mx.kv.create("dist_sync"), out, b"same configuration")
    mx.random.seed(100 + worker.rank)
    net = gluon.nn.Dense(3, in_units=4, prefix="dense_")
    net.initialize(mx.init.Uniform(1.0))
    before = values(net)
    agreed_before, _ = worker.agree(dist._params_bytes(net.collect_params()))  # pylint: disable=protected-access
    trainer = worker.trainer(net.collect_params(), "adagrad", {"learning_rate": 0.1})
    after = values(net)
    for step in range(2):
        if step == 1 and worker.rank == 1:
            loss = None  # an empty shard: zero gradients, still in the round
        else:
            with autograd.record():
                loss = net(nd.ones((2, 4)) * (worker.rank + step + 1)).sum()
        worker.step(trainer, loss, 3)
    worker.finish(net)
    with open(os.path.join(out, "rank%d.json" % worker.rank), "w") as f:
        json.dump({"before": before, "agreed_before": agreed_before, "after": after,
                   "final": values(net)}, f)


def die(out):
    def main():
        kv = mx.kv.create("dist_sync")
        a = nd.ones((2,))
        kv.init(0, a)
        for i in range(3):
            if kv.rank == 1 and i == 2:
                raise ValueError("rank 1 fails on purpose in round %d" % i)
            kv.pushpull(0, a, out=a)
            a.wait_to_read()
        with open(os.path.join(out, "rank%d.done" % kv.rank), "w") as f:
            f.write("finished")  # must not happen: rank 0 waits for rank 1's push forever
    dist.run_main(main)


if __name__ == "__main__":
    mode, out = sys.argv[1:3]
    if mode == "broadcast":  # a failed check ends the job at once, not at its time limit
        dist.run_main(lambda: broadcast(out))
    else:
        die(out)
