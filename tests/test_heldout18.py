"""Held-out programs, round 18: devices and contexts, written naively, the way
Gluon users write them. There is no GPU here: ``mx.cpu(0)``, ``mx.cpu(1)``,
``mx.cpu(2)`` and ``mx.cpu_pinned(0)`` are distinct devices to MXNet.

* A model initialised on ``cpu(1)`` (not the default context) fed samples on
  ``cpu(1)``; samples on ``cpu(0)`` fed to it (plain Gluon refuses them at the
  call, naming the parameter and the context).
* Data parallelism the Gluon way: parameters on ``[cpu(0), cpu(1)]``,
  ``gluon.utils.split_and_load`` of the minibatch, per-sample forward on each
  context in one ``autograd.record``, ``backward`` of the per-context sums,
  ``Trainer.step`` (kvstore ``'local'``/``'device'``, ``update_on_kvstore``
  True/False, ``allreduce_grads`` + ``clip_global_norm`` + ``update``) over
  several steps.
* Lazy outputs moved between contexts: ``as_in_context``, ``copyto(ctx)``,
  ``copyto(array on another context)``, ``nd.array(y, ctx=)``; arrays made
  per sample with ``nd.array/zeros/ones(..., ctx=)`` and inside ``with
  mx.cpu(1):``; ``.context`` of a lazy output; reading one context's output
  while another context's calls pend.
* Samples of one minibatch on several contexts calling the same flagged block:
  never one launch (exact launch counts), a recursive cell per sample on two
  contexts under granularity 'block' and 'split', ``jitbatch.map`` with reads.
* Parameters moved: ``reset_ctx`` between minibatches and while predictions
  pend, ``load_parameters(f, ctx=[...])``, ``Parameter.data(ctx)`` /
  ``list_data`` / ``list_grad`` / ``grad(ctx)`` / ``zero_grad`` after a
  flagged backward, ``grad_req='add'`` over two contexts.
* Pinned memory: ``DataLoader(pin_memory=True)`` samples, ``nd.array(...,
  ctx=mx.cpu_pinned(0))`` samples.
* Mixed contexts in one operator (``nd.add_n`` of every sample's loss, a begin
  state made on the default context): plain MXNet on the CPU runs them;
  jitbatch refuses them with its documented error, and the fix it names gives
  plain Gluon's numbers.

The oracle is plain per-sample Gluon (no hybridize) on the same parameters
and inputs: outputs, parameter gradients per context, input gradients,
parameters after the trainer steps and the contexts of the results, under the
policies auto, depth, agenda and sequential. The round found six problems,
fixed on 2026-11-26 (each test's docstring says what it was; docs/errors.rst
lists them): the default context leaked (jitbatch's one ``Device`` object per
device was entered twice, nested, and MXNet's ``Context`` keeps the default
it replaced on the object); granularity 'split' merged input stages of calls
on different contexts; a launch of one call on a pinned sample failed (the
CachedOp refuses it) and outputs of pinned samples reported
``cpu_pinned(0)``; ``reset_ctx`` while predictions pended made them fail;
a sample on a context the parameters are not on failed at the read, not at
the call; and a missed merge, numbers right (``net(x).as_in_context(ctx)``
per sample ran the pending graph at every sample).

The leak made results depend on which test first records an operator
signature: the fixture below resets the default context around every test,
and the leak's own test uses shapes no other test uses.
"""
import warnings

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.context import Context, current_context
from mxnet.gluon import HybridBlock, nn, rnn

import jitbatch
from oracle import cleanup
from heldout import (as_result, merged, nothing_pending, rng_for, same_arrays,  # noqa: F401
                     same_values as same)

POLICIES = ["auto", "depth", "agenda", "sequential"]
MERGING = ["auto", "depth", "agenda"]
POLICY = pytest.mark.parametrize("policy", POLICIES)
C0, C1, C2 = mx.cpu(0), mx.cpu(1), mx.cpu(2)
PINNED = mx.cpu_pinned(0)


@pytest.fixture(autouse=True)
def default_context_restored():
    """Every test starts and ends with cpu(0) as the default context (a leaked
    default context, one of this round's findings, must not reach the next)."""
    Context._default_ctx.value = Context("cpu", 0)  # pylint: disable=protected-access
    yield
    Context._default_ctx.value = Context("cpu", 0)  # pylint: disable=protected-access


def flag(net, policy, **kw):
    if policy is None:
        net.hybridize(active=False)
    else:
        net.hybridize(dynamic_batch=True, policy=policy, **kw)


def both(make, program, policy):
    """``program(net, policy) -> list of arrays (or strings)`` on a fresh plain
    network and on a fresh flagged one (same initial values); returns (plain,
    flagged, stats of the flagged run)."""
    want = [as_result(a) for a in program(make(), None)]
    Context._default_ctx.value = Context("cpu", 0)  # pylint: disable=protected-access
    net = make()
    jitbatch.reset_stats()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", jitbatch.ContractWarning)
            got = [as_result(a) for a in program(net, policy)]
        jitbatch.flush()
    finally:
        cleanup()
        net.hybridize(active=False)
    return want, got, jitbatch.stats()


def grads_per_ctx(net):
    return [g.asnumpy().copy() for p in net.collect_params().values() if p.grad_req != "null"
            for g in p.list_grad()]


def params_per_ctx(net):
    return [d.asnumpy().copy() for p in net.collect_params().values() for d in p.list_data()]


class MLP(HybridBlock):
    """Dense, tanh, Dense."""

    def __init__(self, n_in=3, hidden=6, n_out=2, **kw):
        super(MLP, self).__init__(**kw)
        with self.name_scope():
            self.a = nn.Dense(hidden, in_units=n_in, activation="tanh")
            self.b = nn.Dense(n_out, in_units=hidden)

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return self.b(self.a(x))


def mlp_on(ctx, **kw):
    def make():
        mx.random.seed(0)
        net = MLP(prefix="m_", **kw)
        net.initialize(mx.init.Uniform(0.5), ctx=ctx)
        return net
    return make


def rows(key, n, width=3):
    rng = rng_for(*key)
    return [rng.normal(size=(1, width)).astype("float32") for _ in range(n)]


L2 = gluon.loss.L2Loss()


# -- 1. a model on a context that is not the default ---------------------------------------
X1 = [rows(("cpu1", it), 4) for it in range(2)]
Y1 = [rows(("cpu1-y", it), 4, 2) for it in range(2)]


def on_cpu1(net, policy):
    flag(net, policy)
    tr = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.05})
    out = []
    for xs, ys in zip(X1, Y1):
        xs = [nd.array(x, ctx=C1) for x in xs]
        for x in xs:
            x.attach_grad()
        with autograd.record():
            outs = [net(x) for x in xs]
            out += [str(o.context) for o in outs]
            losses = [L2(o, nd.array(y, ctx=C1)) for o, y in zip(outs, ys)]
        autograd.backward(losses)
        out += [str(l.context) for l in losses]
        out += [o.asnumpy() for o in outs] + [x.grad.asnumpy() for x in xs]
        out += [p.grad(C1).asnumpy().copy() for p in net.collect_params().values()]
        tr.step(len(xs))
    return out + params_per_ctx(net) + [str(d.context) for p in net.collect_params().values()
                                        for d in p.list_data()]


@POLICY
def test_a_model_initialised_on_cpu1_trained_on_cpu1_samples(policy):
    want, got, st = both(mlp_on(C1), on_cpu1, policy)
    same(want, got, "model on cpu(1) under %s" % policy)
    assert st["nodes"] and (policy == "sequential" or merged(st)), st


XW = rows(("wrong-ctx",), 4)


def test_a_sample_on_a_context_the_parameters_are_not_on_is_refused_at_the_call():
    """Until 2026-11-26 the call was recorded and failed at the read, an
    ExecutionError with no fix that discarded the samples recorded before
    it: plain Gluon's RuntimeError is raised at the call now."""
    plain = mlp_on(C1)()
    with pytest.raises(RuntimeError, match=r"not initialized on context cpu\(0\)"):
        plain(nd.array(XW[0], ctx=C0))
    net = mlp_on(C1)()
    net.hybridize(dynamic_batch=True, policy="agenda")
    good = [net(nd.array(x, ctx=C1)) for x in XW[:2]]
    with pytest.raises(RuntimeError, match=r"m_dense0_weight.*cpu\(0\)|cpu\(0\).*m_dense0_weight"):
        net(nd.array(XW[2], ctx=C0))
    want = [plain(nd.array(x, ctx=C1)).asnumpy() for x in XW[:2]]
    same_arrays(want, [g.asnumpy() for g in good], "the samples recorded before it")


def test_a_sample_on_the_wrong_context_names_both_contexts_and_the_next_minibatch_runs():
    net = mlp_on(C1)()
    plain = mlp_on(C1)()
    net.hybridize(dynamic_batch=True, policy="agenda")
    with pytest.raises(RuntimeError) as err:
        ys = [net(nd.array(x, ctx=C0)) for x in XW]
        [y.asnumpy() for y in ys]
    msg = str(err.value)
    assert "cpu(0)" in msg and "cpu(1)" in msg and "m_dense0_weight" in msg, msg
    cleanup()
    got = [net(nd.array(x, ctx=C1)) for x in XW]
    same_arrays([plain(nd.array(x, ctx=C1)).asnumpy() for x in XW],
                [g.asnumpy() for g in got], "the next minibatch, on cpu(1)")


# -- 2. data parallelism ---------------------------------------------------------------------
DP_CTX = [C0, C1]
_dp = rng_for("data-parallel")
DP = [(_dp.normal(size=(5, 1, 3)).astype("float32"), _dp.normal(size=(5, 1, 2)).astype("float32"))
      for _ in range(3)]
DP_MODES = {"local": ("local", True), "local_worker_update": ("local", False),
            "device": ("device", True), "device_worker_update": ("device", False),
            "allreduce_clip_update": ("device", False)}


def data_parallel(net, policy, mode):
    kvstore, on_kv = DP_MODES[mode]
    flag(net, policy)
    tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                       kvstore=kvstore, update_on_kvstore=on_kv)
    out = []
    for X, Y in DP:
        xs = gluon.utils.split_and_load(X, DP_CTX, even_split=False)
        ys = gluon.utils.split_and_load(Y, DP_CTX, even_split=False)
        with autograd.record():
            losses = [[L2(net(x), y) for x, y in zip(xb, yb)] for xb, yb in zip(xs, ys)]
            totals = [nd.add_n(*ls) for ls in losses]
        autograd.backward(totals)
        out += grads_per_ctx(net)
        if mode == "allreduce_clip_update":
            tr.allreduce_grads()
            for c in DP_CTX:
                gluon.utils.clip_global_norm(
                    [p.grad(c) for p in net.collect_params().values()], 0.5)
            tr.update(len(X))
        else:
            tr.step(len(X))
        out += [l.asnumpy() for ls in losses for l in ls] + [str(t.context) for t in totals]
    return out + params_per_ctx(net)


@POLICY
@pytest.mark.parametrize("mode", sorted(DP_MODES))
def test_data_parallel_training_over_two_contexts(policy, mode):
    want, got, st = both(mlp_on(DP_CTX), lambda n, p: data_parallel(n, p, mode), policy)
    same(want, got, "data parallel (%s) under %s" % (mode, policy))
    assert st["nodes"] and (policy == "sequential" or merged(st)), st


# -- 3. lazy outputs moved between contexts --------------------------------------------------
XM = rows(("moved",), 5)


def moved(net, policy):
    flag(net, policy)
    xs = [nd.array(x, ctx=C1) for x in XM]
    for x in xs:
        x.attach_grad()
    bufs = [nd.zeros((1, 2), ctx=C2), nd.zeros((1, 2), ctx=C0)]
    with autograd.record():
        ys = [net(x) for x in xs]
        ms = [ys[0].as_in_context(C2), ys[1].copyto(C0), ys[2].copyto(bufs[0]),
              ys[3].as_in_context(C1), nd.array(ys[4], ctx=C0)]
        ys[4].copyto(bufs[1])
        ctxs = [str(m.context) for m in ms]
        losses = [(m * m).sum() * (i + 1) for i, m in enumerate(ms)]
    early = bufs[0].asnumpy()           # read a copy's target before anything else
    autograd.backward(losses)
    return [early, bufs[1].asnumpy()] + ctxs + [str(l.context) for l in losses] + \
        [m.asnumpy() for m in ms] + [x.grad.asnumpy() for x in xs] + grads_per_ctx(net)


@POLICY
def test_lazy_outputs_moved_to_other_contexts(policy):
    want, got, st = both(mlp_on([C1]), moved, policy)
    same(want, got, "moved outputs under %s" % policy)
    assert policy == "sequential" or merged(st), st


@pytest.mark.parametrize("policy", MERGING)
@pytest.mark.parametrize("how", ["as_in_context", "copyto"])
def test_moving_each_samples_output_to_one_context_keeps_the_samples_merged(policy, how):
    """Until 2026-11-26 a missed merge (numbers right): the copy to another
    device ran the pending graph at every sample. A pending lazy array copied
    to another device is recorded now: one copy per launch, gradients through
    it to the parameters on the sample's device."""
    def program(net, pol):
        flag(net, pol)
        with autograd.record():
            outs = [getattr(net(nd.array(x, ctx=C1)), how)(C0) for x in XM]
            ctxs = [str(o.context) for o in outs]
            loss = nd.add_n(*[(o * o).sum() for o in outs])
        loss.backward()
        return [o.asnumpy() for o in outs] + grads_per_ctx(net) + [np.array(ctxs)]
    want, got, st = both(mlp_on([C0, C1]), program, policy)
    assert str(got[-1]) == str(want[-1])
    same(want[:-1], got[:-1], "outputs moved per sample")
    assert st["flushes"] == 1, st
    if policy in ("depth", "agenda"):
        # per sample an nd.array, the network, the copy, the square and the sum
        # (25 nodes); each kind one launch, with the loss's add_n: 6
        assert (st["nodes"], st["launches"]) == (5 * len(XM), 6), st


# -- 4. arrays made on a context inside per-sample code --------------------------------------
class WithState(gluon.Block):
    """Per sample: a Dense, then a state made in the per-sample code."""

    def __init__(self, how, **kw):
        super(WithState, self).__init__(**kw)
        self.how = how
        with self.name_scope():
            self.d = nn.Dense(4, in_units=3)
            self.e = nn.Dense(4, in_units=4)

    def forward(self, x):  # pylint: disable=arguments-differ
        h = self.d(x)
        if self.how == "ctx_keyword":
            s = nd.array([[0.5, -1.0, 2.0, 0.25]], ctx=x.context) + nd.zeros((1, 4), ctx=x.context)
            s = s * nd.ones(h.shape, ctx=h.context)
        else:
            with mx.cpu(1):
                s = nd.array([[0.5, -1.0, 2.0, 0.25]]) + nd.ones((1, 4)) - nd.zeros((1, 4))
        return self.e(h * s)


XS = rows(("state",), 5)


def with_state(net, policy):
    flag(net, policy)
    xs = [nd.array(x, ctx=C1) for x in XS]
    with autograd.record():
        outs = [net(x) for x in xs]
        loss = nd.add_n(*[(o * o).sum() for o in outs])
    loss.backward()
    return [str(o.context) for o in outs] + [o.asnumpy() for o in outs] + grads_per_ctx(net)


@POLICY
@pytest.mark.parametrize("how", ["ctx_keyword", "with_block"])
def test_arrays_made_on_the_samples_context_inside_per_sample_code(policy, how):
    def make():
        mx.random.seed(0)
        net = WithState(how, prefix="w_")
        net.initialize(mx.init.Uniform(0.5), ctx=C1)
        return net
    want, got, st = both(make, with_state, policy)
    same(want, got, "arrays made per sample (%s) under %s" % (how, policy))
    assert policy == "sequential" or merged(st), st


# -- 5. contexts known at once; reading one context while another pends ----------------------
def test_the_context_of_a_lazy_output_is_known_without_running_the_graph():
    make = mlp_on([C0, C1, C2])
    plain, net = make(), make()
    net.hybridize(dynamic_batch=True, policy="agenda")
    xs = [nd.array(x, ctx=c) for x, c in zip(rows(("ctx",), 3), (C0, C1, C2))]
    nd.waitall()
    jitbatch.reset_stats()

    def derived(y):
        return [y, y.ctx, y + 1, y[0:1], y[0], y.reshape((2, 1)), nd.concat(y, y, dim=0),
                nd.stack(y, y, axis=1), y.detach(), y.astype("float64")]
    got = [derived(net(x)) for x in xs]
    got = [str(a.context) if isinstance(a, mx.nd.NDArray) else str(a) for ys in got for a in ys]
    assert jitbatch.stats()["flushes"] == 0, jitbatch.stats()
    want = [derived(plain(x)) for x in xs]
    want = [str(a.context) if isinstance(a, mx.nd.NDArray) else str(a) for ys in want for a in ys]
    assert got == want


XR = [rows(("read", c), 3) for c in range(2)]


def read_one_context(net, policy):
    flag(net, policy)
    y0 = [net(nd.array(x, ctx=C0)) for x in XR[0]]
    y1 = [net(nd.array(x, ctx=C1)) for x in XR[1]]
    first = y1[1].asnumpy()          # cpu(1)'s output while cpu(0)'s calls pend
    z0 = [net(y[:, :1].broadcast_to((1, 3)) + 1) for y in y0]   # more work on cpu(0)
    zero = z0[2].asnumpy()
    return [first, zero] + [y.asnumpy() for y in y0 + y1 + z0] + [str(z.context) for z in z0]


@POLICY
def test_reading_one_contexts_output_while_another_contexts_calls_pend(policy):
    want, got, st = both(mlp_on([C0, C1]), read_one_context, policy)
    same(want, got, "read while another context pends under %s" % policy)
    assert st["nodes"] and (policy == "sequential" or merged(st)), st


# -- 6. one block, samples on several contexts: never one launch -----------------------------
@POLICY
@pytest.mark.parametrize("ctxs", [(C0, C1), (C1, C2, C0)], ids=["two", "three"])
def test_calls_on_different_contexts_never_share_a_launch(policy, ctxs):
    per = 3
    data = rows(("launches", len(ctxs)), per * len(ctxs))

    def program(net, pol):
        flag(net, pol)
        xs = [nd.array(x, ctx=ctxs[i % len(ctxs)]) for i, x in enumerate(data)]
        nd.waitall()
        jitbatch.reset_stats()
        ys = [net(x) for x in xs]       # the contexts interleaved, sample by sample
        jitbatch.flush()
        st = jitbatch.stats()
        return [y.asnumpy() for y in ys] + [str(y.context) for y in ys], st

    make = mlp_on(list(ctxs))
    want, _ = program(make(), None)
    net = make()
    try:
        got, st = program(net, policy)
    finally:
        cleanup()
        net.hybridize(active=False)
    same(want, got, "samples on %d contexts" % len(ctxs))
    assert st["nodes"] == per * len(ctxs), st
    assert st["launches"] == (per * len(ctxs) if policy == "sequential" else len(ctxs)), st


def train_on_contexts(net, policy):
    flag(net, policy)
    out = []
    for it in range(2):
        xs = [nd.array(x, ctx=(C0, C1, C2)[i % 3])
              for i, x in enumerate(rows(("train-ctx", it), 6))]
        with autograd.record():
            ys = [net(x) for x in xs]
            totals = [nd.add_n(*[(y * y).sum() for y in ys[c::3]]) for c in range(3)]
        autograd.backward(totals)
        out += [y.asnumpy() for y in ys] + grads_per_ctx(net)
    return out


@POLICY
def test_training_one_block_on_three_contexts_at_once(policy):
    want, got, st = both(mlp_on([C0, C1, C2]), train_on_contexts, policy)
    same(want, got, "three contexts under %s" % policy)
    assert policy == "sequential" or merged(st), st


class GRUHead(gluon.Block):
    """A GRU cell stepped over one sample's rows, then a Dense: the cell reads
    its own earlier outputs (granularity 'split' cuts it into stages)."""

    def __init__(self, **kw):
        super(GRUHead, self).__init__(**kw)
        with self.name_scope():
            self.cell = rnn.GRUCell(5, input_size=3)
            self.out = nn.Dense(1, in_units=5)

    def forward(self, seq):  # pylint: disable=arguments-differ
        h = [nd.zeros((1, 5), ctx=seq.context)]
        for t in range(seq.shape[0]):
            y, h = self.cell(seq[t:t + 1], h)
        return self.out(y)


_sq = rng_for("gru-ctx")
SEQS = [_sq.normal(size=(int(_sq.integers(2, 5)), 3)).astype("float32") for _ in range(6)]


def gru_on_two(net, policy, granularity):
    if policy is not None:
        net.hybridize(dynamic_batch=True, policy=policy, granularity=granularity)
    else:
        net.hybridize(active=False)
    with autograd.record():
        outs = [net(nd.array(s, ctx=DP_CTX[i % 2])) for i, s in enumerate(SEQS)]
        totals = [nd.add_n(*[(o * o).sum() for o in outs[c::2]]) for c in range(2)]
    autograd.backward(totals)
    return [o.asnumpy() for o in outs] + grads_per_ctx(net)


@pytest.mark.parametrize("granularity,policy", [
    (g, p)
    for g in ("block", "split", "auto") for p in POLICIES])
def test_a_recursive_cell_per_sample_on_two_contexts(granularity, policy):
    """Until 2026-11-26 granularity 'split' merged the input stages of calls
    on two contexts (an ExecutionError): the stage's key holds the device."""
    def make():
        mx.random.seed(0)
        net = GRUHead(prefix="s_")
        net.initialize(mx.init.Uniform(0.5), ctx=DP_CTX)
        return net
    want, got, st = both(make, lambda n, p: gru_on_two(n, p, granularity), policy)
    same(want, got, "GRU on two contexts, granularity %s, %s" % (granularity, policy))
    assert policy == "sequential" or merged(st), st


XMAP = rows(("map",), 6)


def routed(net, s):
    i, x = s
    with mx.Context("cpu", i % 2):
        h = net(nd.array(x))
        h = net(h) if h.sum().asscalar() > 0 else net(h * 2)   # a read per sample
    return h, (h * h).sum()


def mapped_on_two(net, policy, mapped):
    flag(net, policy)
    with autograd.record():
        if mapped:
            res = jitbatch.map(lambda s: routed(net, s), list(enumerate(XMAP)))
        else:
            res = [routed(net, s) for s in enumerate(XMAP)]
        totals = [nd.add_n(*[r[1] for r in res[c::2]]) for c in range(2)]
    autograd.backward(totals)
    return [str(r[0].context) for r in res] + [r[0].asnumpy() for r in res] + grads_per_ctx(net)


@POLICY
def test_jitbatch_map_with_a_context_per_sample_and_a_read(policy):
    want, got, st = both(mlp_on(DP_CTX, n_out=3), lambda n, p: mapped_on_two(n, p, True),
                         policy)
    same(want, got, "jitbatch.map on two contexts under %s" % policy)
    assert policy == "sequential" or merged(st), st
    want2, _, _ = both(mlp_on(DP_CTX, n_out=3), lambda n, p: mapped_on_two(n, p, False), None)
    same(want2, got, "jitbatch.map against the plain loop")


# -- 7. parameters moved between contexts ---------------------------------------------------
XP = [rows(("reset", it), 4) for it in range(4)]
RESETS = [[C0], [C1, C2], [C2], [C0, C1]]


def reset_between(net, policy):
    """Each minibatch on the parameters' contexts (samples round robin), a
    Trainer made for each placement, reset_ctx after each step."""
    flag(net, policy)
    out = []
    for it, xs in enumerate(XP):
        ctxs = RESETS[it]
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.2},
                           update_on_kvstore=False)
        with autograd.record():
            ys = [net(nd.array(x, ctx=ctxs[i % len(ctxs)])) for i, x in enumerate(xs)]
            totals = [nd.add_n(*[(y * y).sum() for y in ys[c::len(ctxs)]])
                      for c in range(len(ctxs))]
        autograd.backward(totals)
        out += [y.asnumpy() for y in ys] + grads_per_ctx(net)
        tr.step(len(xs))
        out += params_per_ctx(net)
        net.collect_params().reset_ctx(RESETS[(it + 1) % len(RESETS)])
        out += [str(c) for p in net.collect_params().values() for c in p.list_ctx()]
    return out


@POLICY
def test_reset_ctx_between_minibatches(policy):
    want, got, st = both(mlp_on([C0]), reset_between, policy)
    same(want, got, "reset_ctx between minibatches under %s" % policy)
    assert policy == "sequential" or merged(st), st


def test_reset_ctx_while_predictions_pend():
    """Until 2026-11-26 the pending predictions ran after the move and failed
    (ExecutionError): Parameter.reset_ctx and cast run pending calls first."""
    def program(net, policy):
        flag(net, policy)
        ys = [net(nd.array(x, ctx=C0)) for x in XP[0]]
        net.collect_params().reset_ctx(C1)
        zs = [net(nd.array(x, ctx=C1)) for x in XP[1]]
        return [y.asnumpy() for y in ys + zs]
    want, got, _ = both(mlp_on([C0]), program, "agenda")
    same(want, got, "predictions made before reset_ctx")


def loaded(net, policy, path):
    """Parameters saved from ``net`` (trained a step on cpu(0)), loaded into
    a new network on [cpu(1), cpu(2)]; per-sample training there with
    grad_req='add' over two minibatches, zero_grad, one more; the views of
    every parameter per context after each."""
    flag(net, policy)
    tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.3})
    with autograd.record():
        loss = nd.add_n(*[(net(nd.array(x)) ** 2).sum() for x in XP[0]])
    loss.backward()
    tr.step(4)
    net.save_parameters(path)
    new = MLP(prefix="m_")
    new.load_parameters(path, ctx=[C1, C2])
    flag(new, policy)
    new.collect_params().setattr("grad_req", "add")
    out = [loss.asnumpy()]
    for it in (1, 2, 3):
        if it == 3:
            new.collect_params().zero_grad()
            out += grads_per_ctx(new)
        with autograd.record():
            ys = [new(nd.array(x, ctx=(C1, C2)[i % 2])) for i, x in enumerate(XP[it])]
            totals = [nd.add_n(*[(y * y).sum() for y in ys[c::2]]) for c in range(2)]
        autograd.backward(totals)
        out += [y.asnumpy() for y in ys] + grads_per_ctx(new)
        for p in new.collect_params().values():
            out += [p.data(C2).asnumpy(), p.grad(C1).asnumpy(), str(p.data(C1).context),
                    str(p.grad(C2).context)]
    new.hybridize(active=False)
    return out + params_per_ctx(new)


@POLICY
def test_load_parameters_onto_two_contexts_and_per_context_views(policy, tmp_path):
    path = str(tmp_path / "m.params")
    want, got, st = both(mlp_on([C0]), lambda n, p: loaded(n, p, path), policy)
    same(want, got, "loaded onto cpu(1), cpu(2) under %s" % policy)
    assert policy == "sequential" or merged(st), st


# -- 8. pinned memory -------------------------------------------------------------------------
_pn = rng_for("pinned")
PX = _pn.normal(size=(4, 3)).astype("float32")
PY = _pn.normal(size=(4, 2)).astype("float32")


def pinned_samples(net, policy):
    """Samples pinned before anything is recorded; a loss of operators."""
    flag(net, policy)
    xs = [nd.array(x[None], ctx=PINNED) for x in PX]
    nd.waitall()
    with autograd.record():
        outs = [net(x) for x in xs]
        loss = nd.add_n(*[(o * o).sum() for o in outs])
    loss.backward()
    return [o.asnumpy() for o in outs] + [loss.asnumpy()] + grads_per_ctx(net)


def pinned_loader(net, policy):
    """``DataLoader(pin_memory=True)``, one sample per batch, as users iterate it."""
    flag(net, policy)
    loader = gluon.data.DataLoader(gluon.data.ArrayDataset(PX, PY), batch_size=1,
                                   pin_memory=True)
    with autograd.record():
        outs, losses = [], []
        for x, y in loader:
            outs.append(net(x))
            losses.append(((outs[-1] - y) ** 2).sum())
        loss = nd.add_n(*losses)
    loss.backward()
    return [o.asnumpy() for o in outs] + [l.asnumpy() for l in losses] + grads_per_ctx(net)


@pytest.mark.parametrize("policy", MERGING + ["sequential"])
def test_pinned_samples(policy):
    want, got, st = both(mlp_on([C0]), pinned_samples, policy)
    same(want, got, "pinned samples under %s" % policy)
    assert policy == "sequential" or merged(st), st


@POLICY
def test_pinned_samples_from_a_data_loader(policy):
    want, got, _ = both(mlp_on([C0]), pinned_loader, policy)
    same(want, got, "DataLoader(pin_memory=True) samples under %s" % policy)


def test_one_pinned_sample():
    """Until 2026-11-26 a launch of one call on a pinned sample (every launch
    under 'sequential', and with a DataLoader's pin_memory) failed: MXNet's
    CachedOp refuses a pinned input beside CPU parameters (plain hybridize()
    too); launches and eager calls copy pinned inputs to the CPU now."""
    def program(net, policy):
        flag(net, policy)
        with autograd.record():
            y = net(nd.array(PX[:1], ctx=PINNED))
            loss = (y * y).sum()
        loss.backward()
        return [y.asnumpy()] + grads_per_ctx(net)
    want, got, _ = both(mlp_on([C0]), program, "agenda")
    same(want, got, "one pinned sample")


@pytest.mark.parametrize("policy", MERGING)
def test_outputs_of_pinned_samples_are_on_cpu0(policy):
    """Until 2026-11-26 the outputs reported cpu_pinned(0) and a loss against
    a label on cpu(0) was refused; now, as MXNet's operators, cpu(0)."""
    def program(net, pol):
        flag(net, pol)
        with autograd.record():
            outs, losses = [], []
            for x, y in zip(PX, PY):
                outs.append(net(nd.array(x[None], ctx=PINNED)))
                losses.append(((outs[-1] - nd.array(y[None])) ** 2).sum())
            loss = nd.add_n(*losses)
        loss.backward()
        return [str(o.context) for o in outs] + [o.asnumpy() for o in outs] + \
            [l.asnumpy() for l in losses] + grads_per_ctx(net)
    want, got, _ = both(mlp_on([C0]), program, policy)
    same(want, got, "pinned samples, label on cpu(0)")


# -- 9. the default context after per-sample code --------------------------------------------
Y7 = rows(("leak-y",), 4, 7)


def loss_on_cpu1(net, policy):
    """A Gluon loss on outputs on cpu(1); outputs of 7 values, a shape no other
    test uses, so that the loss's operators are new signatures here (their
    first call's trial run is one of the nested `with`s)."""
    flag(net, policy)
    with autograd.record():
        losses = [L2(net(nd.array(x, ctx=C1)), nd.array(y, ctx=C1))
                  for x, y in zip(X1[0], Y7)]
    autograd.backward(losses)
    after = nd.zeros((1, 2))          # a user's next array, on the default context
    return [str(current_context()), str(after.context)] + [l.asnumpy() for l in losses]


def with_output_context(net, policy):
    flag(net, policy)
    y = net(nd.array(X1[0][0], ctx=C1))
    with y.context:                     # "make the next arrays where y lives"
        z = net(nd.array(X1[0][1]))
        first = z.asnumpy()
    after = nd.zeros((1, 2))
    return [str(current_context()), str(after.context), first, y.asnumpy()]


@pytest.mark.parametrize("program", [
    pytest.param(loss_on_cpu1, id="gluon_loss_on_cpu1_outputs"),
    pytest.param(with_output_context, id="with_y_context_around_a_read")])
def test_the_default_context_after_per_sample_code_on_cpu1(program):
    """Until 2026-11-26 the default context leaked (cpu(1) after the
    program; on a GPU the next arrays would land on another device): MXNet's
    Context keeps the default it replaced on the object, and jitbatch's one
    Device object per device was entered twice, nested (a block's forward and
    a launch). A Device keeps one stack per thread now."""
    want, got, _ = both(mlp_on([C0, C1], n_out=7), program, "agenda")
    same(want, got, "default context afterwards")


# -- 10. one operator on several contexts (plain MXNet runs it on the CPU) -------------------
def losses_on_two(net, policy, fixed):
    flag(net, policy)
    xs = [nd.array(x, ctx=DP_CTX[i % 2]) for i, x in enumerate(XM)]
    with autograd.record():
        losses = [(net(x) ** 2).sum() for x in xs]
        if fixed:
            losses = [l.as_in_context(C0) for l in losses]
        loss = nd.add_n(*losses)
    loss.backward()
    return [loss.asnumpy()] + grads_per_ctx(net)


def state_on_default(net, policy, fixed):
    flag(net, policy)
    outs = []
    with autograd.record():
        for s in SEQS[:4]:
            seq = nd.array(s, ctx=C1)
            h = [nd.zeros((1, 5))]              # naive: on the default context
            if fixed:
                h = [h[0].as_in_context(C1)]
            for t in range(seq.shape[0]):
                y, h = net(seq[t:t + 1], h)
            outs.append(y)
        loss = nd.add_n(*[(o * o).sum() for o in outs])
    loss.backward()
    return [o.asnumpy() for o in outs] + grads_per_ctx(net)


def _gru_cell():
    mx.random.seed(0)
    cell = rnn.GRUCell(5, input_size=3, prefix="g_")
    cell.initialize(mx.init.Uniform(0.5), ctx=[C0, C1])
    return cell


MIXED = {"add_n_of_losses_on_two_contexts": (mlp_on(DP_CTX), losses_on_two, "add_n"),
         "begin_state_on_the_default_context": (_gru_cell, state_on_default, "block g")}


@pytest.mark.parametrize("policy", ["agenda", "sequential"])
@pytest.mark.parametrize("name", sorted(MIXED))
def test_one_call_on_two_contexts_is_refused_with_the_fix_that_works(name, policy):
    make, program, culprit = MIXED[name]
    plain = program(make(), None, False)           # plain MXNet on the CPU runs it
    net = make()
    try:
        with pytest.raises(jitbatch.BatchingError) as err:
            program(net, policy, False)
    finally:
        cleanup()
        net.hybridize(active=False)
    msg = str(err.value)
    assert culprit in msg and "cpu(0)" in msg and "cpu(1)" in msg and "as_in_context" in msg, msg
    want, got, _ = both(make, lambda n, p: program(n, p, True), policy)
    same(want, got, "%s with the fix" % name)
    same(plain, got, "%s: the fix gives plain Gluon's numbers" % name)
