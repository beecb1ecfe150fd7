"""Helpers of the held-out model tests (tests/test_heldout*.py): seeded
generators and initial values, the warnings and counters (launches) they
assert on, and
a fresh interpreter for programs that crash MXNet or leave it an error."""
import os
import subprocess
import sys
import tempfile
import warnings
import zlib

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

import jitbatch
import jitbatch.execute as execute
from jitbatch.stats import STATS
from oracle import cleanup

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def nothing_pending():
    """Every held-out test starts and ends with no graph pending (imported by
    each test module, where it applies to every test)."""
    cleanup()
    yield
    cleanup()


def rng_for(*key):
    """A generator seeded by ``key`` (the same draws in every run)."""
    return np.random.default_rng(zlib.crc32("/".join(map(str, key)).encode()))


def initialized(net, seed=0, ctx=None):
    """``net`` initialized uniformly in [-0.5, 0.5] from ``seed`` (on ``ctx``)."""
    mx.random.seed(seed)
    net.initialize(mx.init.Uniform(0.5), ctx=ctx)
    return net


def seeded(cls, *args, **kw):
    """A maker of ``cls(*args, **kw)`` with the same initial values every call."""
    def make():
        mx.random.seed(0)
        net = cls(*args, **kw)
        net.initialize(mx.init.Uniform(0.5))
        return net
    return make


def plain_and_flagged(make, program, flags, **kw):
    """``program(net, flags, **kw) -> list of numpy arrays`` run on a fresh
    network plain (``flags`` None), then on another fresh network (the same
    initial values) with ``flags`` (what they mean is the program's: a policy,
    hybridize's keywords); returns both results and the flagged run's stats."""
    want = program(make(), None, **kw)
    net = make()
    jitbatch.reset_stats()
    try:
        got = program(net, flags, **kw)
    finally:
        cleanup()
        net.hybridize(active=False)
    return want, got, jitbatch.stats()


def flag(net, policy):
    """``net`` flagged with ``policy``, or (None) run plain, unhybridized."""
    if policy is None:
        net.hybridize(active=False)
    else:
        net.hybridize(dynamic_batch=True, policy=policy)


def both(make, program, policy="auto"):
    """``program(nets, policy) -> list of arrays (or strings)`` on fresh plain networks and
    on fresh flagged ones (same initial values; ``make()`` returns one block
    or a list); returns (plain, flagged, stats). ContractWarnings of the
    flagged run are not the program's business here (tests that check them
    catch them themselves)."""
    want = [as_result(a) for a in program(make(), None)]
    nets = make()
    jitbatch.reset_stats()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", jitbatch.ContractWarning)
            got = [as_result(a) for a in program(nets, policy)]
        jitbatch.flush()
    finally:
        cleanup()
        for net in (nets if isinstance(nets, (list, tuple)) else [nets]):
            net.hybridize(active=False)
    return want, got, jitbatch.stats()


def params_of(*nets):
    """Copies of the nets' parameter values, in their parameters' order."""
    return [p.data().asnumpy().copy() for net in nets for p in net.collect_params().values()]


def values_of(net):
    """Copies of ``net``'s parameter values, in its parameters' order."""
    return [p.data().asnumpy().copy() for p in net.collect_params().values()]


def grads_of(*nets):
    """Copies of the nets' gradients (parameters with one), in order."""
    return [p.grad().asnumpy().copy() for net in nets for p in net.collect_params().values()
            if p.grad_req != "null"]


def square_loss(net, x):
    """``(net(x), the sum of its squares)``: a sample's output and a loss that
    reaches every entry (check_model's ``apply``)."""
    y = net(x)
    return y, nd.sum(y * y)


def row_sequences(rng, n, width):
    """``n`` samples of 1-4 rows of ``width`` values."""
    return [nd.array(rng.normal(size=(int(rng.integers(1, 5)), width))) for _ in range(n)]


def contract_warnings(record):
    return [str(w.message) for w in record if issubclass(w.category, jitbatch.ContractWarning)]


def launches_of(fn):
    """``[(signature name, calls), ...]``, one per launch, of the flushes
    while ``fn()`` runs (``fn`` flushes); the counters reset before."""
    seen = []
    orig = execute._launch

    def counting(f, backend, split):
        seen.extend((batch[0].info.name, len(batch)) for batch in f.batches)
        return orig(f, backend, split)
    execute._launch = counting
    try:
        STATS.reset()
        fn()
    finally:
        execute._launch = orig
    return seen


def launches_by_name(fn):
    """Launches per signature name while ``fn()`` runs (``launches_of``)."""
    by = {}
    for name, _ in launches_of(fn):
        by[name] = by.get(name, 0) + 1
    return by


def merged(st):
    """Some launch ran more than one node."""
    return st["launches"] < st["nodes"]


def as_result(a):
    """A program's result as compared: a string as it is (a context, a storage
    type), anything else as a NumPy array."""
    return a if isinstance(a, str) else np.asarray(a)


def same_values(want, got, what):
    """Equal lists of arrays (same shapes, values within the suite's
    tolerance) and strings."""
    assert len(want) == len(got), what
    for i, (a, b) in enumerate(zip(want, got)):
        if isinstance(a, str) or isinstance(b, str):
            assert a == b, "%s %d: plain Gluon %r, jitbatch %r" % (what, i, a, b)
        else:
            assert a.shape == b.shape, "%s %d: plain Gluon shape %s, jitbatch %s" % (
                what, i, a.shape, b.shape)
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5, err_msg="%s %d" % (what, i))


def same_arrays(want, got, what):
    assert len(want) == len(got), what
    for i, (a, b) in enumerate(zip(want, got)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5, err_msg="%s %d" % (what, i))


def check_against_plain(make, program, policy, merges=True):
    """``program`` under ``policy`` gives plain Gluon's numbers (``both``), and
    where ``merges``, under the policies that plan launches from the graph
    alone (depth, agenda), some launch ran several calls; the flagged run's
    stats."""
    want, got, st = both(make, program, policy)
    same_values(want, got, policy)
    if merges and policy in ("depth", "agenda"):
        assert merged(st), st
    return st


def error_of(fn):
    """The exception ``fn()`` raises (None if it returns)."""
    try:
        fn()
    except Exception as e:  # pylint: disable=broad-except
        return e
    return None


def run_in_subprocess(code, fresh=False):
    """Run ``code`` in a process of its own (for crashes of the process and
    errors MXNet keeps for its next read), as ``python -c`` runs it; returns
    (exit status, stdout, stderr). The process is forked from a server that
    has imported MXNet and nothing else (importing it is most of an
    interpreter's start); ``fresh``: a new interpreter instead."""
    head = "import sys\nsys.path[:0] = [%r, %r]\n" % (TESTS, os.path.dirname(TESTS))
    if fresh:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        res = subprocess.run([sys.executable, "-c", head + code], capture_output=True,
                             text=True, timeout=120, env=env)
        return res.returncode, res.stdout, res.stderr
    global _FORKS
    if _FORKS is None:
        import multiprocessing
        os.environ["OMP_NUM_THREADS"] = "1"     # (the server's environment is this one's)
        _FORKS = multiprocessing.get_context("forkserver")
        _FORKS.set_forkserver_preload(["mxnet"])
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        child = _FORKS.Process(target=_as_python_c,
                               args=(head + code, out, err, dict(os.environ, OMP_NUM_THREADS="1")))
        child.start()
        child.join(120)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired("python -c", 120)
        with open(out) as f, open(err) as g:
            return child.exitcode, f.read(), g.read()


_FORKS = None   # the forkserver context of run_in_subprocess


def _as_python_c(code, out, err, env):
    """In the forked process: run ``code`` as ``python -c`` does (``__main__``,
    a traceback and status 1 on an error, ``SystemExit``'s status, threads
    joined and ``atexit`` handlers run at the end), in the caller's
    environment ``env``, its output in files."""
    import atexit
    import multiprocessing
    import threading
    import traceback
    multiprocessing.set_start_method(None, force=True)   # the platform's default again
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    sys.argv = ["-c"]
    status = 0
    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})  # pylint: disable=exec-used
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:  # pylint: disable=broad-except
        traceback.print_exc()
        status = 1
    threading._shutdown()  # pylint: disable=protected-access
    atexit._run_exitfuncs()  # pylint: disable=protected-access
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


_DENSE_BEHIND_A_STOP = """
import numpy as np, mxnet as mx
from mxnet import autograd, nd
from mxnet.gluon import nn
import jitbatch
a, d = nn.Dense(4, in_units=4), nn.Dense(4, in_units=4)
for b in (a, d):
    b.initialize(mx.init.Uniform(0.5))
xs = [nd.array(np.random.default_rng(i).normal(size=(2, 4))) for i in range(3)]
def stop(v, flag):
    return (%s) if flag else v.detach()
def go(flag):
    for b in (a, d):
        b.hybridize(dynamic_batch=True, policy="agenda") if flag else b.hybridize(active=False)
        for p in b.collect_params().values():
            p.zero_grad()
    with autograd.record():
        ys = [nd.concat(d(x[0:1]), stop(a(x[0:1]) + x[1:2], flag) * x[1:2], dim=1) for x in xs]
        loss = nd.add_n(*[nd.sum(y * y) for y in ys])
    loss.backward()
    return [y.asnumpy() for y in ys] + [p.grad().asnumpy().copy()
                                        for b in (a, d) for p in b.collect_params().values()]
for i, (w, g) in enumerate(zip(go(False), go(True))):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=str(i))
print("same")
"""


def dense_behind_a_stop(flagged_stop):
    """A program (for ``run_in_subprocess``) in which a recorded Dense reaches
    the loss only through a stop-gradient beside another Dense's output; per
    sample the stop is ``.detach()``, flagged it is ``flagged_stop`` (an
    expression of ``v``); it prints "same" where the two runs agree (outputs
    and gradients)."""
    return _DENSE_BEHIND_A_STOP % flagged_stop


def ragged(key, count=5, width=3, hi=3):
    """``count`` seeded samples of 1 to ``hi`` rows of ``width`` values."""
    rng = rng_for(key)
    return [nd.array(rng.normal(size=(int(rng.integers(1, hi + 1)), width)))
            for _ in range(count)]


def flag_all(blocks, policy):
    """Every block of ``blocks`` (a list or tuple, or one block) flagged with
    ``policy`` (None: plain)."""
    for b in (blocks if isinstance(blocks, (list, tuple)) else [blocks]):
        flag(b, policy)


def params_dict(*blocks):
    """One ParameterDict of the parameters of ``blocks`` (one Trainer for all)."""
    ps = mx.gluon.ParameterDict()
    for b in blocks:
        ps.update(b.collect_params())
    return ps


class Centre(mx.operator.CustomOp):
    """A custom operator: ``x`` less its mean over axis 0 (it mixes the rows of
    its input, so its calls must not merge). Each test module registers it
    under an op_type of its own."""

    def forward(self, is_train, req, in_data, out_data, aux):
        x = in_data[0]
        self.assign(out_data[0], req[0], nd.broadcast_sub(x, nd.mean(x, axis=0, keepdims=True)))

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        g = out_grad[0]
        self.assign(in_grad[0], req[0], nd.broadcast_sub(g, nd.mean(g, axis=0, keepdims=True)))


def train_minibatches(nets, policy, minibatch, count, steps=2, lr=0.1, optimizer="sgd",
                      mapped=False):
    """``steps`` Trainer steps of ``nets`` (flagged with ``policy``; None:
    plain) on the summed losses ``minibatch(k)`` of samples ``0..count-1`` (a
    loop, or ``jitbatch.map``), each ``(loss, [arrays to compare])``; returns
    the losses and arrays, the gradients of every step and the parameters
    after."""
    flag_all(nets, policy)
    tr = gluon.Trainer(params_dict(*nets), optimizer, {"learning_rate": lr})
    out = []
    for _ in range(steps):
        with autograd.record():
            res = jitbatch.map(minibatch, range(count)) if mapped else \
                [minibatch(k) for k in range(count)]
            loss = nd.add_n(*[r[0] for r in res])
        loss.backward()
        out += [a.asnumpy() for r in res for a in [r[0]] + list(r[1])] + grads_of(*nets)
        tr.step(count)
    return out + params_of(*nets)
