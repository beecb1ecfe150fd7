"""Data-parallel Tree-LSTM training over MXNet's parameter-server kvstore.

Every worker runs ``train.py`` with ``--kvstore dist_sync`` and the same
arguments (same seed, so the same shuffled order), records the forward passes
of ITS share of every minibatch with dynamic batching, and the kvstore sums the
gradients across workers; each worker then applies the same optimizer step to
the same summed gradient, so all hold the same parameters, and the run follows
the single-process run with the same global minibatch up to float rounding.

* Sharding: a global minibatch of ``b`` pairs (``--batch-size``, or fewer in
  the last one of an epoch) is cut into ``N`` contiguous parts whose sizes
  differ by at most one, the larger ones first: rank ``r`` of ``N`` gets
  ``b // N + (1 if r < b % N else 0)`` pairs.  A worker whose part is empty (a
  last minibatch smaller than ``N``) pushes zero gradients, since every
  ``dist_sync`` round needs every worker.  ``--batch-size`` must be >= N.
* Normalisation: ``trainer.step(b)`` with the GLOBAL size on every worker: the
  summed gradient is that of the whole minibatch, scaled by ``1/b`` as in one
  process.
* Updates run on the workers (``update_on_kvstore=False``): the kvstore only
  sums gradients.  With server-side updates MXNet fixes the ``1/b`` scaling at
  the first step and refuses a different ``b`` later (the last minibatch), and
  the update would run in another process than the single-process reference.
* Start: Gluon initialises the kvstore at the first ``step()``, after each
  worker ran its first forward and backward on its OWN initial values; here it
  is initialised when the trainer is made, so rank 0's values reach every
  worker before any computation, and the workers check that they agree (on
  the configuration and training data too) before training.
* Losses: each step's loss sum is summed across workers (one scalar through
  the kvstore), so every worker logs the global loss the single process would.
* Only rank 0 evaluates, prints and writes ``--out``; the others write their
  output to ``<--dist-dir>/worker<rank>.log``.  At the end every worker saves
  its parameters to ``<--dist-dir>/worker<rank>.params`` (before rank 0 goes
  back to its best-dev epoch) and they check that all agree;
  ``python -m examples.tree_lstm.dist check DIR N`` compares the files.

Start the workers with ``scripts/dist_train.sh`` or
``python -m examples.tree_lstm.launch``.
"""
import argparse
import gc
import hashlib
import json
import os
import sys
import traceback
import weakref

import numpy as np

KVSTORES = ("local", "device", "dist_sync", "dist_device_sync")
# keys of our own two scalars-per-step next to the Trainer's keys 0 .. #params-1
_LOSS_KEY = 1 << 20
_AGREE_KEY = _LOSS_KEY + 1
_DIGEST_BYTES = 8
_RANK = "unknown"  # this process's worker rank, once known (for failure messages)


def add_arguments(parser):
    g = parser.add_argument_group("distributed (see examples/tree_lstm/dist.py)")
    g.add_argument("--kvstore", default="local", choices=KVSTORES,
                   help="'local' (default): one process; 'dist_sync': one worker of a "
                        "data-parallel job started by scripts/dist_train.sh or "
                        "python -m examples.tree_lstm.launch")
    g.add_argument("--dist-dir", default=None, metavar="DIR",
                   help="where each worker saves its final parameters (worker<rank>.params) "
                        "and, with dist_sync, ranks >= 1 their output (default with dist_sync: "
                        "<--out>/dist; without: nothing saved)")


def connect(args, parser):
    """The training's place in the job: :class:`Local` or a :class:`Worker`
    (rank >= 1 get their output redirected, see the module docstring)."""
    if not args.kvstore.startswith("dist"):
        return Local(args.kvstore, args.dist_dir)
    if os.environ.get("DMLC_ROLE") != "worker":
        parser.error("argument --kvstore: %s runs as one worker of a job whose launcher sets "
                     "DMLC_ROLE=worker and the other DMLC_* variables (DMLC_ROLE is %r here); "
                     "start it with: bash scripts/dist_train.sh N [training arguments]"
                     % (args.kvstore, os.environ.get("DMLC_ROLE")))
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    # fingerprint the configuration as given, before rank >= 1 rewrite their outputs
    config = json.dumps({k: v for k, v in sorted(vars(args).items()) if k != "ctx_obj"},
                        sort_keys=True, default=str).encode()
    worker = Worker(mx.kv.create(args.kvstore), args.dist_dir or os.path.join(args.out, "dist"),
                    config)
    if args.batch_size < worker.num_workers:
        parser.error("argument --batch-size: %d pairs cannot be shared by %d workers (each "
                     "needs at least one pair per minibatch); use --batch-size >= %d or fewer "
                     "workers" % (args.batch_size, worker.num_workers, worker.num_workers))
    if worker.rank != 0:
        # one voice: rank 0 prints and writes --out; the others keep a log
        sys.stdout = open(os.path.join(worker.dist_dir, "worker%d.log" % worker.rank), "w",
                          buffering=1)
        args.quiet, args.no_plot, args.save = True, True, None
        args.out = os.path.join(worker.dist_dir, "worker%d" % worker.rank)
    return worker


def run_main(main):
    """Run ``main()``; in a dist worker a failure ends the process AT ONCE.

    A dist worker that exits normally, or merely drops its kvstore (as leaving
    the failed frame does), first waits at the kvstore's exit barrier for every
    other worker, which keep training or wait for this one's next push: an
    error would leave the whole job hanging instead of failing."""
    if os.environ.get("DMLC_ROLE") != "worker":
        return main()
    try:
        return main()
    except SystemExit as exc:
        if exc.code in (None, 0):
            raise
        if not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
        _exit_now(exc.code if isinstance(exc.code, int) else 1)
    except BaseException:  # pylint: disable=broad-except
        traceback.print_exc()
        _exit_now(1)


def _exit_now(code):
    # still inside the except block: the failed frames, and the kvstore they
    # hold, are alive, so its destructor cannot start waiting
    print("dist: worker (pid %d, rank %s) failed (status %d); exiting at once, without the "
          "kvstore's exit barrier" % (os.getpid(), _RANK, code), file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)  # pylint: disable=protected-access


def shard_bounds(size, rank, num_workers):
    """``(start, stop)`` of rank's part of a minibatch of ``size`` pairs."""
    q, r = divmod(size, num_workers)
    start = rank * q + min(rank, r)
    return start, start + q + (1 if rank < r else 0)


def _params_bytes(params):
    return b"".join(name.encode() + params[name].data().asnumpy().tobytes()
                    for name in sorted(params.keys()))


class Local(object):
    """One process: the trainer exactly as before; with ``--dist-dir`` it also
    saves its final parameters there as ``worker0.params`` (a job of one
    worker, for comparisons with a distributed run)."""
    rank, num_workers = 0, 1

    def __init__(self, kvstore="local", dist_dir=None):
        self.kvstore, self.dist_dir = kvstore, dist_dir

    def trainer(self, params, optimizer, optimizer_params, agree_on=None):  # pylint: disable=unused-argument
        from mxnet import gluon  # pylint: disable=import-outside-toplevel
        return gluon.Trainer(params, optimizer, optimizer_params, kvstore=self.kvstore)

    def shard(self, indices):
        return indices

    def step(self, trainer, loss, global_size):
        """backward, update, and the minibatch's loss sum."""
        loss.backward()
        trainer.step(global_size)
        return float(loss.asscalar())

    def evaluation_sets(self, *sets):
        return sets

    def finish(self, net):
        if self.dist_dir is not None:
            os.makedirs(self.dist_dir, exist_ok=True)
            net.save_parameters(os.path.join(self.dist_dir, "worker0.params"))

    def describe(self):
        return ""


class Worker(Local):
    """One worker of a ``dist_sync`` job (see the module docstring)."""

    def __init__(self, kv, dist_dir, config):  # pylint: disable=super-init-not-called
        from mxnet import nd  # pylint: disable=import-outside-toplevel
        global _RANK  # pylint: disable=global-statement
        self.kv = self.kvstore = kv
        self.type = kv.type
        self.rank, self.num_workers = kv.rank, kv.num_workers
        _RANK = self.rank
        # our two collectives' keys (every worker inits them here, in the same order)
        kv.init(_LOSS_KEY, nd.zeros((1,)))
        kv.init(_AGREE_KEY, nd.zeros((2 * _DIGEST_BYTES,)))
        self.dist_dir = dist_dir
        self._config = config
        self._params = self._trainer = None
        os.makedirs(dist_dir, exist_ok=True)

    def describe(self):
        return ", data-parallel: %s, %d workers" % (self.type, self.num_workers)

    # -- collective helpers: every worker must call them at the same point ------
    def allsum(self, key, values):
        from mxnet import nd  # pylint: disable=import-outside-toplevel
        arr = nd.array(np.asarray(values, dtype=np.float32))
        self.kv.pushpull(key, arr, out=arr)
        return arr.asnumpy()

    def agree(self, data):
        """(all workers hold the same ``data``, this worker's fingerprint): a
        digest's bytes and their squares summed over workers; N * sum(x^2) ==
        sum(x)^2 exactly when every worker's x is the same (Cauchy-Schwarz),
        exact in float32 for up to 256 workers."""
        digest = hashlib.sha1(data).digest()[:_DIGEST_BYTES]
        x = np.frombuffer(digest, np.uint8).astype(np.int64)
        total = self.allsum(_AGREE_KEY, np.concatenate([x, x * x])).astype(np.int64)
        s, q = total[:_DIGEST_BYTES], total[_DIGEST_BYTES:]
        return bool(np.all(self.num_workers * q == s * s)), digest.hex()

    def require_agreement(self, what, data, fix):
        same, digest = self.agree(data)
        if not same:
            raise RuntimeError("dist: the %d workers do not agree on the %s (rank %d's "
                               "fingerprint is %s; compare the workers' messages): %s"
                               % (self.num_workers, what, self.rank, digest, fix))
        return digest

    # -- the training hooks ------------------------------------------------------
    def trainer(self, params, optimizer, optimizer_params, agree_on=None):
        from mxnet import gluon  # pylint: disable=import-outside-toplevel
        sparse = [p.name for p in params.values()
                  if p.grad_req != "null" and getattr(p, "_grad_stype", "default") != "default"]
        if sparse:
            raise RuntimeError(
                "dist: parameters %s have row-sparse gradients; MXNet's dist kvstore updates "
                "those only on the servers, with the 1/batch scaling fixed at the first step, "
                "which a smaller last minibatch breaks: train with a dense or frozen "
                "embedding (model embed_update='dense' or 'frozen')" % ", ".join(sparse))
        trainer = gluon.Trainer(params, optimizer, optimizer_params, kvstore=self.kv,
                                update_on_kvstore=False)
        try:
            # Gluon would do this in the first step(), after the first backward ran on
            # each worker's own initial values; init is where rank 0's values win
            trainer._init_kvstore()  # pylint: disable=protected-access
            trainer._init_params()  # pylint: disable=protected-access
            pending = list(trainer._params_to_init)  # pylint: disable=protected-access
        except AttributeError as err:
            raise RuntimeError("dist: this MXNet's gluon.Trainer has no %s (written for MXNet "
                               "1.9's private _init_kvstore/_init_params/_params_to_init)"
                               % err) from err
        if pending:
            raise RuntimeError("dist: parameters %s still have unknown shapes, so rank 0 "
                               "cannot broadcast them before training; give their blocks "
                               "explicit input sizes" % ", ".join(p.name for p in pending))
        self._params = {name: p for name, p in params.items() if p.grad_req != "null"}
        self._trainer = trainer
        data = b""
        if agree_on is not None:
            data = b"".join(ex.a.asnumpy().tobytes() + ex.b.asnumpy().tobytes()
                            + np.float64(ex.score).tobytes() for ex in agree_on)
        self.require_agreement("arguments and training pairs", self._config + data,
                               "start every worker with the same command and data")
        digest = self.require_agreement("initial parameters", _params_bytes(params),
                                        "the kvstore's init did not broadcast rank 0's values")
        print("dist: rank %d of %d, initial parameters identical on all workers (%s)"
              % (self.rank, self.num_workers, digest), flush=True)
        return trainer

    def shard(self, indices):
        start, stop = shard_bounds(len(indices), self.rank, self.num_workers)
        return indices[start:stop]

    def step(self, trainer, loss, global_size):
        if loss is None:
            # nothing to record on this worker this step, but the dist_sync round
            # needs its push: zero gradients, marked fresh so step() accepts them
            for p in self._params.values():
                for grad in p.list_grad():
                    grad[:] = 0
                for data in p.list_data():
                    data._fresh_grad = True  # pylint: disable=protected-access
        else:
            loss.backward()
        trainer.step(global_size)
        local = 0.0 if loss is None else float(loss.asscalar())
        return float(self.allsum(_LOSS_KEY, [local])[0])

    def evaluation_sets(self, *sets):
        return sets if self.rank == 0 else tuple([] for _ in sets)

    def finish(self, net):
        path = os.path.join(self.dist_dir, "worker%d.params" % self.rank)
        net.save_parameters(path)
        digest = self.require_agreement("parameters after training",
                                        _params_bytes(net.collect_params()),
                                        "a bug: the workers applied different updates")
        print("dist: rank %d of %d, parameters after training identical on all workers (%s), "
              "saved to %s" % (self.rank, self.num_workers, digest, path), flush=True)
        self.close()

    def close(self):
        """Leave the job now: free the kvstore, whose destructor waits for every
        worker at the exit barrier and (rank 0) stops the servers.

        Left to garbage collection it may outlive MXNet's engine: the network's
        parameters hold the trainer, which holds the kvstore, and jitbatch's
        signature table holds dynamic-batch blocks (and so the network) for the
        life of the process; the destructor then runs after MXNet's atexit
        shutdown and aborts the process ("terminate called without an active
        exception").  After close() the trainer has no kvstore: a further
        step() would update this worker alone."""
        if self.kv is None:
            return
        alive = weakref.ref(self.kv)
        trainer = self._trainer
        if trainer is not None:
            trainer._kvstore = None  # pylint: disable=protected-access
            trainer._kvstore_params["kvstore"] = None  # pylint: disable=protected-access
        self.kv = self.kvstore = self._trainer = None
        if alive() is not None:
            gc.collect()
        if alive() is not None:
            raise RuntimeError("dist: the kvstore is still referenced after training (by %s), "
                               "so it would be destroyed after MXNet shut down and abort the "
                               "process; drop those references"
                               % ", ".join(type(r).__name__ for r in gc.get_referrers(alive())))


# ---------------------------------------------------------------------------
# python -m examples.tree_lstm.dist check DIR N
# ---------------------------------------------------------------------------

def compare_saved(dist_dir, num_workers):
    """Compare ``worker<r>.params`` of ranks 0..N-1 with rank 0's; (ok, message)."""
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    loaded = []
    for r in range(num_workers):
        path = os.path.join(dist_dir, "worker%d.params" % r)
        if not os.path.isfile(path):
            return False, ("rank %d saved no parameters: %s is missing (did that worker "
                           "finish training?)" % (r, path))
        loaded.append(mx.nd.load(path))
    ref = loaded[0]
    values = sum(int(np.prod(a.shape)) for a in ref.values())
    for r, got in enumerate(loaded[1:], 1):
        if sorted(got) != sorted(ref):
            return False, ("rank %d saved other parameters than rank 0: %s vs %s"
                           % (r, sorted(got), sorted(ref)))
        worst = max(((float(np.max(np.abs(got[k].asnumpy() - ref[k].asnumpy())))
                      if got[k].shape == ref[k].shape else float("inf")), k) for k in ref)
        if worst[0] != 0:
            return False, ("rank %d's parameters differ from rank 0's: largest |difference| "
                           "%.3g in %s" % (r, worst[0], worst[1]))
    return True, ("parameters identical on all %d workers: %d arrays, %d values (%s)"
                  % (num_workers, len(ref), values, dist_dir))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m examples.tree_lstm.dist")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="check that the workers saved identical parameters")
    c.add_argument("dir")
    c.add_argument("num_workers", type=int)
    args = p.parse_args(argv)
    ok, message = compare_saved(args.dir, args.num_workers)
    print(("dist check: " if ok else "dist check FAILED: ") + message, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
