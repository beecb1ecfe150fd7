"""Gluon behaviour under dynamic batching: exact launch counts, autograd modes,
Gluon features, lazy-array semantics, errors and failure isolation."""
import re

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import HybridBlock, nn
from mxnet.ndarray import register

import jitbatch
from harness import SCALE_TOL, assert_same, run
from models import BinaryTreeNet, binary_samples


def _binary(depth, n, policy):
    net = BinaryTreeNet()
    net.initialize(mx.init.Uniform(0.5))
    samples = binary_samples(np.random.default_rng(0), n, depth=depth)
    net.hybridize(dynamic_batch=True, policy=policy)
    jitbatch.reset_stats()
    outs = [net(*s) for s in samples]
    jitbatch.flush()
    return outs, jitbatch.stats()


@pytest.mark.parametrize("policy", ["depth", "agenda"])
@pytest.mark.parametrize("depth", [1, 3, 5])
def test_identical_trees_take_one_launch_per_level(policy, depth):
    # one cell launch per tree level plus one for the heads, whatever the count,
    # and one creation of the samples' zero states: each sample makes its own
    # (nd.zeros), recorded from the second sample on (the first runs eagerly,
    # nothing is pending yet), made by one launch at depth 0
    _, st = _binary(depth, 7, policy)
    assert st["nodes"] == 7 * (2 ** depth - 1) + 7 + 6
    assert st["launches"] == depth + 2


def test_later_gathers_are_planned_after_the_first_launches(monkeypatch):
    # the first two launches are planned and issued before the rest is planned,
    # so their kernels run meanwhile; the planning still counts as analysis
    from jitbatch.gluon.backend import GluonBackend
    events = []
    prep, launch = GluonBackend.prepare, GluonBackend.launch
    monkeypatch.setattr(GluonBackend, "prepare",
                        lambda self, batches: events.append(("plan", len(batches))) or
                        prep(self, batches))
    monkeypatch.setattr(GluonBackend, "launch",
                        lambda self, batch: events.append(("launch",)) or launch(self, batch))
    outs, st = _binary(5, 3, "depth")        # zero states, 5 levels, heads
    assert events == [("plan", 2), ("launch",), ("launch",), ("plan", 5)] + [("launch",)] * 5
    assert st["launches"] == 7 and st["analysis_seconds"] > 0
    events.clear()
    _binary(2, 3, "depth")                   # 4 launches: too few to split
    assert events == [("plan", 4)] + [("launch",)] * 4


def test_sequential_takes_one_launch_per_node():
    _, st = _binary(3, 4, "sequential")      # 8 nodes per sample, 3 zero states
    assert st["launches"] == st["nodes"] == 4 * 8 + 3


def test_lazy_arrays_look_like_ndarrays():
    net = nn.Dense(3, in_units=2)
    net.initialize()
    net.hybridize(dynamic_batch=True)
    jitbatch.reset_stats()
    y = net(nd.ones((1, 2)))
    assert isinstance(y, nd.NDArray) and jitbatch.is_lazy(y)
    assert y.shape == (1, 3) and y.dtype == np.float32 and y.context == mx.cpu()
    z = nd.relu(y * 2 + 1)[0]          # operators and indexing stay lazy
    w = gluon.loss.L2Loss()(z.reshape((1, 3)), nd.zeros((1, 3)))
    assert jitbatch.is_lazy(w) and jitbatch.stats()["flushes"] == 0
    assert "pending" in repr(w)
    val = w.asscalar()                 # a read forces the graph
    st = jitbatch.stats()
    assert st["flushes"] == 1 and st["forced_flushes"] == 1 and not jitbatch.is_lazy(w)
    net.hybridize(active=False)
    ref = gluon.loss.L2Loss()(nd.relu(net(nd.ones((1, 2))) * 2 + 1), nd.zeros((1, 3)))
    assert np.allclose(val, ref.asscalar(), rtol=1e-5)


def test_bool_and_inplace_write_force():
    net = nn.Dense(1, in_units=1, weight_initializer=mx.init.One(), bias_initializer="zeros")
    net.initialize()
    net.hybridize(dynamic_batch=True)
    y = net(nd.ones((1, 1)))
    assert bool(y)
    y2 = net(nd.ones((1, 1)) * 2)
    y2 += 1                                  # in-place on a lazy array
    y2[:] = y2 * 10
    assert y2.asscalar() == 30.0


class Drop(HybridBlock):
    def hybrid_forward(self, F, x):
        return F.Dropout(x, p=0.5)


def test_autograd_mode_is_the_one_recorded_under():
    net = Drop()
    net.hybridize(dynamic_batch=True)
    x = nd.ones((1, 200))
    x.attach_grad()
    with autograd.record(train_mode=False):
        y = net(x)                            # predict mode: identity
        s = nd.sum(y)
    s.backward()                              # the flush happens here, outside record
    assert np.all(y.asnumpy() == 1) and np.all(x.grad.asnumpy() == 1)
    with autograd.record(train_mode=True):
        y = net(x)
        s = nd.sum(y)
    s.backward()
    v = y.asnumpy()
    assert (v == 0).any() and (v == 2).any()  # dropout applied in training mode
    assert np.allclose(x.grad.asnumpy(), v)
    with autograd.predict_mode():
        assert np.all(net(x).asnumpy() == 1)


def test_each_node_keeps_the_autograd_state_of_its_own_call():
    # jitbatch keeps the autograd state between records and drops it when
    # MXNet's setters run: every way of changing it must show in the next node
    from mxnet.contrib import autograd as contrib_autograd
    net = nn.Dense(2, in_units=2)
    net.initialize()
    net.hybridize(dynamic_batch=True)
    x = nd.ones((1, 2))
    seen = []

    def call():
        net(x)
        seen.append((jitbatch.current_graph().nodes[-1].mode,
                     (autograd.is_recording(), autograd.is_training())))
    call()
    with autograd.record():
        call()
        with autograd.pause():
            call()
            with autograd.train_mode():
                call()
        call()
        with autograd.predict_mode():
            call()
    with autograd.record(train_mode=False):
        call()
    prev = autograd.set_training(True)
    call()
    autograd.set_training(prev)
    prev = autograd.set_recording(True)
    call()
    autograd.set_recording(prev)
    call()
    prev = contrib_autograd.set_is_training(True)   # sets both, through the C API
    call()
    contrib_autograd.set_is_training(prev)
    call()
    jitbatch.flush()
    assert [m for m, _ in seen] == [want for _, want in seen]
    assert len({want for _, want in seen}) == 4     # every state was exercised


def test_flush_drops_the_kept_autograd_state():
    # a state change that bypasses MXNet's Python setters (here the C API) is seen
    # after jitbatch.flush(), as docs/design.rst says
    import ctypes
    from mxnet.base import _LIB
    net = nn.Dense(2, in_units=2)
    net.initialize()
    net.hybridize(dynamic_batch=True)
    net(nd.ones((1, 2)))                          # keeps (False, False)
    prev = ctypes.c_int()
    _LIB.MXAutogradSetIsTraining(ctypes.c_int(1), ctypes.byref(prev))
    try:
        jitbatch.flush()
        net(nd.ones((1, 2)))
        assert jitbatch.current_graph().nodes[-1].mode == (False, True)
    finally:
        _LIB.MXAutogradSetIsTraining(prev, ctypes.byref(ctypes.c_int()))
        jitbatch.flush()
    assert not autograd.is_training()


def test_lazy_arrays_context_is_an_equal_context():
    net = nn.Dense(2, in_units=2)
    net.initialize()
    net.hybridize(dynamic_batch=True)
    y = net(nd.ones((1, 2)))
    c = y.context
    assert isinstance(c, mx.Context) and c == mx.cpu() and mx.cpu() == c and c != mx.cpu(1)
    assert {mx.cpu(): "cpu"}[c] == "cpu" and {c: "lazy"}[mx.cpu(0)] == "lazy"
    assert (nd.zeros((1,), ctx=c) + y[:, :1]).context == mx.cpu()


def test_nodes_recorded_outside_record_have_no_history():
    def go(flag):
        net = nn.Dense(2, in_units=2, weight_initializer=mx.init.Constant(0.5))
        net.initialize()
        net.hybridize(dynamic_batch=True) if flag else net.hybridize(active=False)
        x = nd.array([[1.0, 2.0]])
        x.attach_grad()
        y = net(x)                             # not recorded
        with autograd.record():
            z = nd.sum(y * x)
        z.backward()
        return x.grad.asnumpy(), net.weight.grad().asnumpy()
    (g1, w1), (g2, w2) = go(False), go(True)
    assert np.allclose(g1, g2) and np.allclose(w1, w2) and not w2.any()


class Shared(gluon.Block):
    def __init__(self, **kw):
        super(Shared, self).__init__(**kw)
        with self.name_scope():
            self.a = nn.Dense(3, in_units=3)
            self.b = nn.Dense(3, in_units=3, params=self.a.params)   # shared weights
            self.c = nn.Dense(1)                                     # deferred in_units

    def forward(self, x):
        return self.c(nd.tanh(self.a(x)) + self.b(x * x))


@pytest.mark.parametrize("policy", ["depth", "agenda", "auto"])
def test_shared_params_deferred_init_trainer(policy):
    rng = np.random.default_rng(3)
    samples = [nd.array(rng.normal(size=(1, 3))) for _ in range(5)]

    def train(flag):
        mx.random.seed(1)
        net = Shared()
        net.initialize(mx.init.Uniform(0.5))
        if flag:
            net.hybridize(dynamic_batch=True, policy=policy)
        tr = gluon.Trainer(net.collect_params(), "adagrad", {"learning_rate": 0.1})
        losses = []
        for _ in range(3):
            with autograd.record():
                loss = nd.add_n(*[gluon.loss.L2Loss()(net(x), nd.ones((1, 1))) for x in samples])
            loss.backward()
            tr.step(len(samples))
            losses.append(loss.asscalar())
        return losses, {k[len(net.prefix):]: p.data().asnumpy() for k, p in net.collect_params().items()}
    (l1, p1), (l2, p2) = train(False), train(True)
    assert np.allclose(l1, l2, rtol=1e-5)
    for k in p1:
        assert np.allclose(p1[k], p2[k], rtol=1e-5, atol=1e-6), k


def test_blocks_without_the_flag_mix_with_flagged_ones():
    from models import dag_model, dag_samples, dag_apply
    net = dag_model()
    samples = dag_samples(np.random.default_rng(5), 4)
    ref = run(net, dag_apply, samples, True, flag=False)
    net.enc.hybridize(dynamic_batch=True)      # only one child flagged
    net.plain.hybridize()                      # hybridized without the flag: forces
    got = run(net, dag_apply, samples, True, flag=False)
    assert_same(ref, got)


# -- flags and errors -----------------------------------------------------------------------
def test_bad_flags_are_rejected_at_hybridize():
    net = nn.Dense(2)
    with pytest.raises(jitbatch.FlagError, match=r"dynamic_batch='yes'.*expected True or False"):
        net.hybridize(dynamic_batch="yes")
    with pytest.raises(jitbatch.FlagError, match=r"policy='fast'.*'auto', 'depth', 'agenda'"):
        net.hybridize(dynamic_batch=True, policy="fast")
    with pytest.raises(jitbatch.FlagError, match=r"analysis_budget=-1.*number >= 0"):
        net.hybridize(dynamic_batch=True, analysis_budget=-1)
    with pytest.raises(jitbatch.FlagError, match="active=False"):
        net.hybridize(False, dynamic_batch=True)


@pytest.mark.parametrize("budget, launches", [(0, 6), (0.0, 6), (None, 1)])
def test_a_zero_analysis_budget_runs_one_launch_per_node_unanalysed(budget, launches):
    """``analysis_budget=0``: 'auto' runs each call as its own launch without
    looking at the graph (no depth groups, no predictions); the results are
    those of plain Gluon, and a flush the budget kept sequential does not send
    the next calls past recording."""
    net = nn.Dense(3, in_units=2)
    net.initialize()
    xs = [nd.array([[i, 1.0 - i]]) for i in range(6)]
    net.hybridize(active=False)
    want = [net(x).asnumpy() for x in xs]
    net.hybridize(dynamic_batch=True, analysis_budget=budget)
    jitbatch.reset_stats()
    ys = [net(x) for x in xs]
    jitbatch.flush()
    st = jitbatch.stats()
    lf = st["last_flush"]
    assert (st["nodes"], st["launches"]) == (6, launches), st
    if launches == 6:
        assert lf["policy"] == "sequential" and "budget 0" in lf["why"], lf
        assert lf["predicted"] == {}, lf
    from jitbatch.graph import current_graph
    assert current_graph().passthrough == 0
    for y, w in zip(ys, want):
        np.testing.assert_allclose(y.asnumpy(), w, rtol=1e-5, atol=1e-6)


def test_flag_reaches_all_descendants_and_turns_off():
    net = Shared()
    net.hybridize(dynamic_batch=True, policy="depth")
    assert all(b._jb_cfg is not None and b._jb_cfg.policy == "depth"
               for b in (net.a, net.b, net.c))
    net.hybridize()
    assert all(b._jb_cfg is None for b in (net.a, net.b, net.c))


class Two(HybridBlock):
    """Adds its two arguments."""

    def hybrid_forward(self, F, a, b):
        return a + b


class SumRows(HybridBlock):
    def hybrid_forward(self, F, x):
        return F.sum(x, axis=0, keepdims=True)


def test_unbatchable_shape_is_named():
    net = SumRows()
    net.hybridize(dynamic_batch=True)
    with pytest.raises(jitbatch.BatchingError,
                       match=r"sumrows\d+ cannot be batched along axis 0.*\(3, 2\).*expected \(2, 2\)"):
        net(nd.ones((3, 2)))


def test_mixed_contexts_in_one_call():
    two = Two()
    two.hybridize(dynamic_batch=True)
    with pytest.raises(jitbatch.BatchingError, match=r"argument 1 is on cpu\(1\).*as_in_context"):
        two(nd.ones((1, 2)), nd.ones((1, 2), ctx=mx.cpu(1)))


def test_mixed_dtypes_in_one_call():
    two = Two()
    two.hybridize(dynamic_batch=True)
    with pytest.raises(jitbatch.BatchingError, match=r"two\d+: argument 1 is float16 but argument 0 is float32.*astype\(.float32.\)"):
        two(nd.ones((1, 2)), nd.ones((1, 2), dtype="float16"))


def test_argument_structure_change_is_explained():
    class Cat(HybridBlock):
        def hybrid_forward(self, F, *xs):
            return F.concat(*xs, dim=1)
    cat = Cat()
    cat.hybridize(dynamic_batch=True)
    cat(nd.ones((1, 2)), nd.ones((1, 2)))
    with pytest.raises(jitbatch.BatchingError, match=r"argument structure.*nd.stack"):
        cat(nd.ones((1, 2)), nd.ones((1, 2)), nd.ones((1, 2)))
    jitbatch.flush()


def test_failure_in_merged_execution_names_site_and_recovers(monkeypatch):
    net = nn.Dense(2, in_units=2)
    net.initialize()
    before = net.weight.data().asnumpy().copy()
    net.hybridize(dynamic_batch=True)
    good = net(nd.ones((1, 2)))
    jitbatch.flush()

    def boom(*a):
        raise RuntimeError("kernel exploded")
    net._call_cached_op = boom
    # launches that do not record run a static CachedOp of the block's graph
    monkeypatch.setattr(jitbatch.gluon._mxapi.CachedOp, "__call__", boom)
    xs = [nd.ones((1, 2)) * i for i in range(3)]
    ys = [net(x) for x in xs]   # this line is the call site
    with pytest.raises(jitbatch.ExecutionError,
                       match=r"(?s)3 call\(s\) to dense\d+ failed: RuntimeError: kernel exploded.*"
                             r"test_gluon.py:\d+ in <listcomp>|test_gluon.py:\d+ in test_failure"):
        ys[0].asnumpy()
    with pytest.raises(jitbatch.StaleValueError, match=r"graph that failed \(while recording or executing\): RuntimeError: kernel exploded"):
        ys[1].asnumpy()
    del net._call_cached_op
    monkeypatch.undo()
    assert jitbatch.current_graph().nodes == []
    assert np.array_equal(net.weight.data().asnumpy(), before)
    again = net(nd.ones((1, 2)))
    assert np.allclose(again.asnumpy(), good.asnumpy())


class _Reads(gluon.Block):
    """12 rows from each of two launches; a few heads read a handful of them."""

    def __init__(self, reads, **kw):
        super().__init__(**kw)
        self.reads = reads
        with self.name_scope():
            self.f = nn.Dense(3, in_units=2)
            self.g = nn.Dense(3, in_units=2, activation="tanh")
            self.h = nn.Dense(1, in_units=3)

    def forward(self, x):
        fs = [self.f(x[i:i + 1]) for i in range(12)]
        gs = [self.g(x[i:i + 1]) for i in range(12)]
        src = {"f": fs, "g": gs}
        self.rows = fs + gs    # in the loss too: a backward reaching only the heads' rows
        # would run them apart (history.run_apart), in a launch of their own
        return [self.h(nd.concat(*[src[k][i] for k, i in rows], dim=0)) for rows in self.reads]


@pytest.mark.parametrize("reads, parts", [
    ([[("f", 0), ("g", 5)], [("f", 7), ("g", 2)]], ["take", "take", "perm"]),   # interleaved
    ([[("f", 3), ("f", 4)], [("g", 9), ("g", 1)]], ["slice", "take"]),          # in order
])
@pytest.mark.parametrize("policy", ["depth", "agenda", "auto"])
def test_sparse_reads_of_large_launches_take_before_concatenating(monkeypatch, reads, parts,
                                                                  policy):
    # the heads read 4 of 24 rows: each launch's rows are taken (or viewed) first,
    # not both launches concatenated whole; same outputs and gradients as plain Gluon
    from jitbatch.gluon import gather
    kinds = []
    orig = gather.run_gather

    def spy(plan, idx):
        if plan.kind == "take_concat":
            kinds.append([how for how, _, _ in plan.values] +
                         (["perm"] if plan.stop > plan.start else []))
        return orig(plan, idx)
    monkeypatch.setattr(gather, "run_gather", spy)
    net = _Reads(reads)
    net.initialize(mx.init.Uniform(0.5))
    x = nd.array(np.random.default_rng(3).normal(size=(12, 2)))

    def go(flag):
        net.hybridize(dynamic_batch=True, policy=policy) if flag else net.hybridize(active=False)
        for p in net.collect_params().values():
            p.zero_grad()
        with autograd.record():
            ys = net(x)
            total = nd.add_n(*[nd.sum(y * y) for y in ys] + [nd.sum(r) for r in net.rows])
        total.backward()
        return [y.asnumpy() for y in ys], {k: p.grad().asnumpy().copy()
                                           for k, p in net.collect_params().items()}
    assert_same(go(False), go(True))
    assert kinds == [parts]


def test_auto_times_launches_only_on_calibrating_flushes(monkeypatch):
    # the cost model's launch times come only from flushes that wait for each
    # launch's kernels: the 2nd and 3rd 'auto' flush, then every 64th
    from jitbatch import cost
    model = cost.Model()
    monkeypatch.setattr(cost, "MODEL", model)
    waited = []
    from jitbatch.gluon.backend import GluonBackend
    orig_wait = GluonBackend.wait
    monkeypatch.setattr(GluonBackend, "wait",
                        lambda self, batch: waited.append(len(batch)) or orig_wait(self, batch))
    net, late = nn.Dense(2, in_units=2), nn.Dense(2, in_units=2)
    for b in (net, late):
        b.initialize()
        b.hybridize(dynamic_batch=True)          # policy 'auto'
    seen = []
    xs = [nd.ones((1, 2)) * i for i in range(3)]
    for k in range(1, 71):
        ys = [net(x) for x in xs]
        if k >= 67:                              # a new block from the 67th flush on
            ys += [late(x) for x in xs[:2]]
        jitbatch.flush()
        seen.append(jitbatch.stats()["last_flush"]["calibrated"])
        assert ys[0].shape == (1, 2)
    assert [k + 1 for k, c in enumerate(seen) if c] == [2, 3, 64]
    assert waited == [3, 3, 3]

    def sig(block):
        return next(i for i in jitbatch.gluon.signatures.TABLE._table.values()
                    if getattr(getattr(i, "op", None), "block", None) is block)
    assert sig(net).launches == 3 and sig(net).launch_rows == 9 and sig(net).launch_cost > 0
    assert sig(late).launches == 0
    # not timed yet: predicted by the mean per timed launch
    assert model.launch_cost(sig(late), 2) == model.launch > 0


def test_call_sites_are_the_user_lines_for_blocks_and_operators(monkeypatch):
    import inspect
    net = nn.Dense(2, in_units=2)
    net.initialize()
    net.hybridize(dynamic_batch=True)
    here = inspect.currentframe().f_lineno
    y = net(nd.ones((1, 2)))       # here + 1
    z = nd.exp(y)                  # here + 2: through MXNet's generated wrapper
    w = y * 2                      # here + 3: through NDArray.__mul__
    nodes = jitbatch.current_graph().nodes[-3:]
    assert [(n.site.code.co_filename, n.site.line) for n in nodes] == \
        [(__file__, here + k) for k in (1, 2, 3)]
    monkeypatch.setattr(jitbatch.config, "debug", True)
    v = nd.exp(z)                  # here + 8: a whole user stack, no MXNet/jitbatch frame
    stack = jitbatch.current_graph().nodes[-1].site
    assert stack.rstrip().endswith("v = nd.exp(z)                  # here + 8: a whole user stack, no MXNet/jitbatch frame")
    assert "line %d, in test_call_sites" % (here + 8) in stack
    # from the test down (above it: pytest's frames, or pytest-xdist's "<string>" ones)
    mine = stack[stack.index("in test_call_sites"):]
    assert "/mxnet/" not in mine and "jitbatch/gluon" not in mine and "<string>" not in mine
    jitbatch.flush()
    assert np.allclose(v.asnumpy(), np.exp(np.exp(y.asnumpy()))) and w.shape == (1, 2)


def test_uninstall_restores_mxnet_and_install_is_idempotent():
    from mxnet.gluon.block import HybridBlock as HB
    patched = HB.forward
    patched_stack = nd.stack
    patched_setter = autograd.set_recording
    jitbatch.install()
    assert HB.forward is patched and nd.stack is patched_stack and mx.nd.op.stack is patched_stack
    net = nn.Dense(2, in_units=2)
    net.initialize()
    net.hybridize(dynamic_batch=True)
    y = net(nd.ones((1, 2)))
    jitbatch.uninstall()
    try:
        assert HB.forward is not patched and not jitbatch.gluon.installed()
        assert nd.stack is not patched_stack and mx.nd.op.stack is nd.stack
        assert autograd.set_recording is patched_setter.__wrapped__
        assert register._verify_all_legacy_ndarrays is jitbatch.gluon._mxapi.verify_legacy
        assert "stack" in (nd.stack.__doc__ or "")
        assert y.shape == (1, 2) and y.asnumpy().shape == (1, 2)   # flushed on uninstall
        assert not isinstance(net(nd.ones((1, 2))), jitbatch.LazyArray)
    finally:
        jitbatch.install()


def test_legacy_operators_still_refuse_numpy_arrays_as_mxnet_does():
    # the generated operators' argument check runs without its per-call import;
    # what it refuses it still refuses, with MXNet's message, lazy or not
    from mxnet import np as mnp
    assert register._verify_all_legacy_ndarrays is not jitbatch.gluon._mxapi.verify_legacy
    x = mnp.ones((1, 2))
    with pytest.raises(TypeError, match="legacy operator which can only accept legacy"):
        nd.relu(x)
    with pytest.raises(TypeError, match="can only write to legacy ndarrays"):
        nd.relu(nd.ones((1, 2)), out=x)
    net = nn.Dense(2, in_units=2)
    net.initialize()
    net.hybridize(dynamic_batch=True)
    y = net(nd.ones((1, 2)))
    with pytest.raises(TypeError, match="legacy operator which can only accept legacy"):
        nd.add_n(y, x)
    assert nd.add_n(y, y).asnumpy().shape == (1, 2)
    net.hybridize(active=False)


def test_non_ndarray_argument_is_named():
    two = Two()
    two.hybridize(dynamic_batch=True)
    with pytest.raises(jitbatch.BatchingError, match=r"block two\d+: .*numpy.ndarray.*mx.nd.array"):
        two(nd.ones((1, 2)), [np.ones((1, 2))])


def test_changing_flags_mid_graph_runs_pending_work_first():
    net = nn.Dense(2, in_units=2)
    net.initialize()
    net.hybridize(dynamic_batch=True, policy="depth")
    jitbatch.reset_stats()
    y = net(nd.ones((1, 2)))
    assert jitbatch.is_lazy(y)
    net.hybridize(dynamic_batch=True, policy="agenda")    # flags change: flush first
    st = jitbatch.stats()
    assert st["flushes"] == 1 and st["last_flush"]["policy"] == "depth"
    assert st["last_flush"]["reason"] == "flags changed" and y.asnumpy().shape == (1, 2)


def test_inplace_writes_behave_as_in_plain_mxnet():
    def go(flag, record):
        net = nn.Dense(2, in_units=2, weight_initializer=mx.init.One(), bias_initializer="zeros")
        net.initialize()
        net.hybridize(dynamic_batch=True) if flag else net.hybridize(active=False)
        with autograd.record(train_mode=True) if record else autograd.pause():
            y = net(nd.ones((1, 2)))
            other = net(nd.ones((1, 2)))     # shares y's batch when batched
            y[:] = 5
            z = net(y)
        return z.asnumpy(), other.asnumpy()
    for a, b in zip(go(True, False), go(False, False)):
        assert np.array_equal(a, b)
    for flag in (False, True):        # MXNet refuses writes inside record, batched or not
        with pytest.raises(mx.base.MXNetError, match="inplace operations"):
            go(flag, True)


def test_row_stacks_and_axis0_concats_are_virtual():
    net = nn.Dense(3, in_units=2)
    net.initialize()
    xs = [nd.array([[i, 1.0 - i]]) for i in range(4)]
    net.hybridize(active=False)
    want_stack = nd.stack(*[net(x) for x in xs], axis=1).asnumpy()
    want_cat = nd.concat(*[net(x) for x in xs], dim=0).asnumpy()
    net.hybridize(dynamic_batch=True)
    jitbatch.reset_stats()
    ys = [net(x) for x in xs]
    st = nd.stack(*ys, axis=1)
    cat = nd.concat(*ys, dim=0)
    assert st.shape == (1, 4, 3) and cat.shape == (4, 3)
    assert jitbatch.stats()["pending"] == 4          # no node for either
    assert np.allclose(st.asnumpy(), want_stack) and np.allclose(cat.asnumpy(), want_cat)
    assert jitbatch.stats()["launches"] == 1         # only the Dense launch
    # consumed by a block: its gather takes the rows directly, gradients flow
    head = nn.Dense(1, in_units=12, flatten=True)
    head.initialize()
    x0 = xs[0]
    x0.attach_grad()

    def head_of_stack(flag):
        for b in (net, head):
            b.hybridize(dynamic_batch=True) if flag else b.hybridize(active=False)
        with autograd.record():
            out = head(nd.stack(*[net(x) for x in xs], axis=1))
        out.backward()
        return out.asnumpy(), x0.grad.asnumpy().copy()
    (o1, g1), (o2, g2) = head_of_stack(False), head_of_stack(True)
    assert np.allclose(o2, o1) and np.allclose(g2, g1)


def test_mixed_contexts_in_an_operator_call_are_caught_every_time():
    net = nn.Dense(2, in_units=2)
    net.initialize()
    net.hybridize(dynamic_batch=True)
    y = net(nd.ones((1, 2)))
    y + nd.ones((1, 2))                         # the signature is seen first on one context
    with pytest.raises(jitbatch.BatchingError, match=r"operator broadcast_\w+: argument 1 is on cpu\(1\)"):
        y + nd.ones((1, 2), ctx=mx.cpu(1))
    jitbatch.flush()


def test_forward_hooks_of_a_flagged_block_still_run():
    # recording skips Block.__call__ only when no hook is registered
    net = nn.Dense(2, in_units=2)
    net.initialize()
    net.hybridize(dynamic_batch=True)
    seen = []
    pre = net.register_forward_pre_hook(lambda blk, args: seen.append(("pre", args[0].shape)))
    post = net.register_forward_hook(lambda blk, args, out: seen.append(("post", out.shape)))
    ys = [net(nd.ones((1, 2)) * i) for i in range(3)]
    assert seen == [("pre", (1, 2)), ("post", (1, 2))] * 3
    assert all(isinstance(y, jitbatch.LazyArray) for y in ys)
    pre.detach()
    post.detach()
    net(nd.ones((1, 2)))
    assert len(seen) == 6
    net.hybridize()
    assert np.allclose(ys[2].asnumpy(), net(nd.ones((1, 2)) * 2).asnumpy())


def test_stack_of_lazy_rows_is_virtual_and_other_stacks_are_not():
    net = nn.Dense(2, in_units=2)
    net.initialize()
    net.hybridize(dynamic_batch=True)
    x1, x2 = nd.ones((1, 2)), nd.ones((1, 2)) * 2
    a, b = net(x1), net(x2)
    jitbatch.reset_stats()
    s1 = nd.stack(a, b, axis=1)                  # (1, 2, 2): rows side by side, no node
    s0 = nd.stack(a, b)                          # axis 0: a real (recorded) operator
    assert s1.shape == (1, 2, 2) and s0.shape == (2, 1, 2)
    assert jitbatch.current_graph().nodes[-1].info.name == "stack"
    assert len(jitbatch.current_graph().nodes) == 3
    with pytest.raises(Exception):
        nd.stack(a, np.ones((1, 2)), axis=1)     # MXNet's own error for a non-NDArray
    net.hybridize()
    want = nd.stack(net(nd.ones((1, 2))), net(nd.ones((1, 2)) * 2), axis=1).asnumpy()
    assert np.allclose(s1.asnumpy(), want)
    assert np.allclose(s0.asnumpy(), want.transpose(1, 0, 2))


@pytest.mark.parametrize("policy", ["depth", "agenda", "auto"])
def test_twin_arguments_reuse_the_planned_index_rows(monkeypatch, policy):
    # the binary cell reads each child's h and c: the same rows of the same
    # launches, another output. The c argument's gather reuses the h argument's
    # planned index rows (planned once, half the index), and the results are
    # plain Gluon's, outputs and gradients
    from jitbatch.gluon import gather
    from jitbatch.gluon.executors import BlockExec
    from models import binary_apply
    samples = binary_samples(np.random.default_rng(5), 5, depth=3)
    net = BinaryTreeNet()
    net.initialize(mx.init.Uniform(0.5))
    ref = run(net, binary_apply, samples, True, flag=False)

    def batched(twins):
        index, plans = [], []
        make_index, gather_batch = gather._mxapi.host_array, gather.gather_batch
        monkeypatch.setattr(gather._mxapi, "host_array",     # the flush's index rows
                            lambda data, ctx, dtype: index.append(len(data))
                            or make_index(data, ctx, dtype))
        monkeypatch.setattr(gather, "gather_batch",      # the block launches' plans
                            lambda batch: (plans.append(batch[0].plan[0])
                                           if isinstance(batch[0].info.op, BlockExec) else None)
                            or gather_batch(batch))
        if not twins:
            monkeypatch.setattr(gather, "_twin_plan", lambda *a: None)
        got = run(net, binary_apply, samples, True, flag=True, policy=policy)
        monkeypatch.undo()
        assert_same(ref, got)
        return sum(index), [p for p in plans if len(p) == 5]   # the cell's launches
    with_twins, cells = batched(True)
    without, _ = batched(False)
    assert with_twins < without
    read = 0
    for p in cells:
        for h, c in ((p[1], p[2]), (p[3], p[4])):   # (hl, cl), (hr, cr)
            assert (c.kind, c.start, c.stop, c.values) == (h.kind, h.start, h.stop, h.values)
            if c.srcs == h.srcs:
                continue      # leaves: h and c are both their sample's zero state
            assert c.srcs == [(s[0], 1) if type(s) is tuple else s for s in h.srcs]
            read += type(h.srcs[0]) is tuple
    assert read == 4      # levels 2 and 3 read cell outputs, each (hl, cl) and (hr, cr)


def test_flushed_graphs_are_freed_when_a_read_waits():
    # a flush keeps its nodes and their inputs; a read (which then waits for the
    # kernels) frees the inputs, and the previous read's nodes once their
    # outputs are dropped; without reads, at most RETIRED_FLUSHES flushes are kept
    import gc
    import sys
    from jitbatch import graph as jgraph
    net = BinaryTreeNet()
    net.initialize(mx.init.Uniform(0.5))
    net.hybridize(dynamic_batch=True, policy="agenda")
    g = jitbatch.current_graph()
    rng = np.random.default_rng(1)
    was = gc.isenabled()
    gc.disable()                     # freed by reference counts alone
    try:
        outs = [net(*s) for s in binary_samples(rng, 3, depth=2)]
        node = outs[0]._node
        jitbatch.reset_stats()
        jitbatch.flush()             # not a read: kept whole
        assert node.inputs != () and g.retired
        assert jitbatch.stats()["release_seconds"] == 0.0
        outs[0].asnumpy()            # a read: inputs released, the nodes held
        assert node.inputs == () and not g.retired
        assert jitbatch.stats()["release_seconds"] > 0.0   # the time it took is reported
        del outs
        assert any(n is node for lst in g.kept_before for n in lst)
        more = [net(*s) for s in binary_samples(rng, 3, depth=2)]
        read = more[1]._node
        more[1].asnumpy()            # a forced read: the last read's nodes go
        assert not any(n is node for lst in g.kept_before + g.kept for n in lst)
        assert sys.getrefcount(node) == 2   # only ours (and the call's) are left
        assert read.inputs == ()
        assert more[1]._node is not read      # a value read no longer holds its node
        for _ in range(jgraph.RETIRED_FLUSHES + 3):
            net(*binary_samples(rng, 1, depth=2)[0])
            jitbatch.flush()
            assert len(g.retired) <= jgraph.RETIRED_FLUSHES
    finally:
        if was:
            gc.enable()


@pytest.mark.parametrize("dtype", ["float32", "float16", "int64", "uint8"])
@pytest.mark.parametrize("shape", [(3, 4), (7,), (1, 1, 5), (2, 1, 3, 2)])
def test_concrete_metadata_read_through_the_c_api_matches_mxnet(dtype, shape):
    # the record and flush read a concrete input's shape, dtype and device
    # without MXNet's properties; they must agree with them
    from jitbatch.gluon import _mxapi, meta
    a = nd.zeros(shape, dtype=dtype)
    shp, dt, dev = _mxapi.concrete_meta(a)
    assert shp == a.shape and _mxapi.concrete_shape(a) == a.shape
    assert dt is a.dtype
    assert dev == (a.context.device_typeid, a.context.device_id)
    m = meta.meta(a)
    assert m[:2] == (a.shape, a.dtype) and m[2] == a.context and hash(m[2]) == hash(a.context)
    # another array type (the numpy front end) is read through its properties
    b = mx.np.zeros(shape, dtype=dtype)
    assert _mxapi.concrete_meta(b) is None and _mxapi.concrete_shape(b) == b.shape


def test_unmergeable_chain_runs_eagerly_in_growing_windows():
    # a chain (each call reads the last): 'auto' finds nothing to merge, runs
    # the next calls unrecorded, records again to re-check, and each such
    # re-check in a row doubles the window; work that merges ends the streak
    from jitbatch.graph import current_graph
    net = nn.Dense(4, in_units=4)
    net.initialize()
    net.hybridize(dynamic_batch=True)
    x = nd.ones((1, 4))

    def chain(steps):
        h = x
        for _ in range(steps):
            h = net(h)
        return h.asnumpy()

    want = chain(20)                # recorded: 20 nodes in 20 launches
    g = current_graph()
    assert g.passthrough == 80 and g.quiet == 1
    recorded = []
    for i in range(40):
        before = jitbatch.stats()["nodes"]
        assert np.allclose(chain(20), want, rtol=1e-5)
        if jitbatch.stats()["nodes"] > before:
            recorded.append((i, g.passthrough))
    # 4 chains eagerly, one recorded, 8 eagerly, one recorded, 16 ...
    assert recorded == [(4, 160), (13, 320), (30, 640)] and g.quiet == 4
    g.passthrough = 0
    # sixteen independent calls: they merge (fifteen launches saved outweigh
    # the analysis of 16 nodes on any machine; three were a close call) ...
    ys = [net(x) for _ in range(16)]
    jitbatch.flush()
    assert jitbatch.stats()["last_flush"]["launches"] == 1
    assert g.quiet == 0 and g.passthrough == 0      # ... and the streak ends
    assert all(np.allclose(y.asnumpy(), ys[0].asnumpy()) for y in ys)
    chain(20)
    assert g.passthrough == 80 and g.quiet == 1
    chain(20)
    chain(20)
    chain(20)
    chain(20)
    chain(20)                       # recorded again: nothing to merge, the streak grows
    assert g.passthrough == 160 and g.quiet == 2
    # new flags: the next calls are recorded (the window ends), the streak is
    # kept: a chain again earns the streak's window ...
    net.hybridize(dynamic_batch=True)
    assert g.passthrough == 0 and g.quiet == 2
    before = jitbatch.stats()["nodes"]
    chain(20)
    assert jitbatch.stats()["nodes"] == before + 20
    assert g.passthrough == 320 and g.quiet == 3
    # ... and a flush that merges after new flags ends it
    net.hybridize(dynamic_batch=True)
    ys = [net(x) for _ in range(16)]
    jitbatch.flush()
    assert g.quiet == 0 and g.passthrough == 0
    # a read right after one recorded call tells nothing: the streak stays (it
    # reset before, so per-sample code reading a value per sample, the zoo's
    # moe, re-checked every 64 calls and ran at 0.92x per-sample hybridized)
    chain(20)
    assert g.passthrough == 80 and g.quiet == 1
    g.passthrough = 0
    net(x).asnumpy()                # one node recorded, then read
    assert g.passthrough == 0 and g.quiet == 1
    chain(20)                       # recorded: nothing to merge, the streak grows
    assert g.passthrough == 160 and g.quiet == 2


def test_a_read_after_every_call_runs_eagerly_in_the_smallest_windows():
    # per-sample code that reads each call's output at once (an evaluation
    # loop, one block per sample): every flush holds one node and merges
    # nothing; after four such flushes in a row the calls run eagerly (64 of
    # them: a window that never grows), then are recorded to check again; a
    # minibatch that merges after such a loop is recorded within 64 calls
    from jitbatch import execute
    from jitbatch.graph import current_graph
    net = nn.Dense(3, in_units=2)
    net.initialize()
    net.hybridize(dynamic_batch=True)
    xs = [nd.array([[i, 1.0 - i]]) for i in range(8)]
    want = [net(x).asnumpy() for x in xs]       # (the first flushes: one node each)
    g = current_graph()
    g.passthrough = g.singles = 0
    quiet = g.quiet
    jitbatch.reset_stats()
    recorded = []
    for i in range(200):
        before = jitbatch.stats()["nodes"]
        y = net(xs[i % 8])
        assert np.allclose(y.asnumpy(), want[i % 8], rtol=1e-5)
        if jitbatch.stats()["nodes"] > before:
            recorded.append(i)
    assert execute.SINGLE_READS == 4
    # four recorded, 64 eager, four recorded, 64 eager, ...
    assert recorded == [0, 1, 2, 3, 68, 69, 70, 71, 136, 137, 138, 139], recorded
    assert g.quiet == quiet and jitbatch.stats()["flushes"] == 12
    # a minibatch after the loop: at most the window's rest runs eagerly
    g.passthrough = 64
    ys = [net(x) for x in xs * 20]        # 160 independent calls
    jitbatch.flush()
    st = jitbatch.stats()
    assert st["nodes"] - 12 == 160 - 64 and st["last_flush"]["launches"] < 10, st
    for i, y in enumerate(ys):
        assert np.allclose(y.asnumpy(), want[i % 8], rtol=1e-5)


def test_values_read_mid_sample_do_not_keep_the_rest_of_it_recorded():
    # per-sample code that reads a value in the middle of each sample (top-1
    # routing: the gate's argmax read with asscalar) and goes on with arrays
    # that read computed: in a window of eager calls those are concrete, so
    # the rest of the sample runs eagerly too (it was recorded, left pending
    # into the next sample, and kept every window from starting: the zoo's moe
    # ran at 0.92x per-sample hybridized); values are plain Gluon's
    gate = nn.Dense(3, in_units=4)
    experts = [nn.Dense(2, in_units=4) for _ in range(3)]
    for b in [gate] + experts:
        b.initialize(mx.init.Uniform(0.5))
    rng = np.random.default_rng(3)
    xs = [nd.array(rng.normal(size=(1, 4))) for _ in range(40)]

    def sample(x):
        logits = gate(x)
        k = int(logits.argmax(axis=1).asscalar())
        return experts[k](x) * nd.softmax(logits)[:, k:k + 1]
    for b in [gate] + experts:
        b.hybridize(active=False)
    want = [sample(x).asnumpy() for x in xs]
    for b in [gate] + experts:
        b.hybridize(dynamic_batch=True)
    jitbatch.reset_stats()
    outs = [sample(x) for x in xs]          # read at the end, as a minibatch's are
    got = [o.asnumpy() for o in outs]
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    # the first samples are recorded and re-checked, then windows of eager
    # calls take over: far fewer nodes than the 40 samples' 5 calls each
    assert jitbatch.stats()["nodes"] < 40, jitbatch.stats()["nodes"]
    for b in [gate] + experts:
        b.hybridize(active=False)


def _scaled_close(got, want):
    """Within 1e-5 of each entry or SCALE_TOL of the array's largest: merged
    launches sum in another order, and an entry 1e-3 of the largest moved by
    2.5e-5 of itself (seen under another test order)."""
    return np.allclose(got, want, rtol=1e-5, atol=SCALE_TOL * float(np.abs(want).max()))


def _loss_minibatch(loss, labels, policy, head=lambda y: y):
    """Six samples through a Dense layer and ``loss`` (per sample, labels
    concrete), plain and then batched under ``policy``: (plain total and weight
    gradient), (batched total, gradient, stats), the labels."""
    net = nn.Dense(5, in_units=3)
    net.initialize()
    rng = np.random.default_rng(3)
    xs = [nd.array(rng.normal(size=(1, 3))) for _ in range(6)]
    ys = [labels(nd.array(rng.normal(size=(1, 5)))) for _ in range(6)]

    def step(flag):
        if flag:
            net.hybridize(dynamic_batch=True, policy=policy)
        else:
            net.hybridize(active=False)
        net.weight.zero_grad()
        jitbatch.reset_stats()
        with autograd.record():
            total = nd.add_n(*[loss(head(net(x)), y) for x, y in zip(xs, ys)])
        total.backward()
        return total.asnumpy(), net.weight.grad().asnumpy().copy(), jitbatch.stats()

    return step(False)[:2], step(True), ys


@pytest.mark.parametrize("policy", ["depth", "agenda", "sequential", "auto"])
def test_a_per_sample_loss_merges_its_label_arithmetic(policy):
    # KLDivLoss computes label * (log(label + 1e-12) - pred): with pred lazy and
    # the label concrete, the label's two operators are recorded too (inside an
    # unflagged block run on lazy arguments) and merge like the rest; outputs
    # and gradients stay those of plain Gluon
    (want, want_grad), (got, grad, st), ys = _loss_minibatch(
        gluon.loss.KLDivLoss(from_logits=True), nd.softmax, policy, head=nd.log_softmax)
    assert np.allclose(got, want, rtol=1e-5) and _scaled_close(grad, want_grad)
    # per sample: dense, log_softmax, label + 1e-12, log, minus, mul, mean; then add_n
    assert st["nodes"] == 6 * 7 + 1
    assert st["launches"] == (st["nodes"] if policy == "sequential" else 8)
    # outside such a block, concrete arithmetic stays eager
    assert type(ys[0] + 1e-12) is nd.NDArray and type(nd.log(ys[0])) is nd.NDArray


def test_a_failing_loss_leaves_concrete_operators_eager_again():
    # an exception inside an unflagged block run on lazy arrays ends its scope:
    # concrete arithmetic afterwards runs at once, and the next batch is right
    from jitbatch.graph import current_graph

    class Broken(gluon.HybridBlock):
        def hybrid_forward(self, F, pred, label):
            F.log(label + 1.0)
            raise RuntimeError("broken loss")

    net = nn.Dense(2, in_units=2)
    net.initialize()
    net.hybridize(dynamic_batch=True)
    x, y = nd.ones((1, 2)), nd.ones((1, 2))
    with pytest.raises(RuntimeError, match="broken loss"):
        Broken()(net(x), y)
    assert current_graph().scope == 0
    assert type(y + 1.0) is nd.NDArray
    loss = gluon.loss.L2Loss()
    got = loss(net(x), y)
    assert type(got) is jitbatch.LazyArray
    net.hybridize(active=False)
    assert np.allclose(got.asnumpy(), loss(net(x), y).asnumpy(), rtol=1e-6)


@pytest.mark.parametrize("policy", ["depth", "agenda", "sequential", "auto"])
def test_a_hybridized_loss_on_lazy_outputs_merges_instead_of_flushing(policy):
    # loss.hybridize() is common; its cached graph would read (so compute) the
    # lazy prediction in every sample's call, one flush per sample. It runs
    # operator by operator instead: one flush, each operator merged
    loss = gluon.loss.L2Loss()
    loss.hybridize()
    (want, want_grad), (got, grad, st), _ = _loss_minibatch(loss, lambda y: y, policy)
    assert np.allclose(got, want, rtol=1e-5) and _scaled_close(grad, want_grad)
    per_sample = (st["nodes"] - 1) // 6       # the dense call and the loss's operators
    assert st["nodes"] == 6 * per_sample + 1 and per_sample >= 4
    assert st["flushes"] == 1
    assert st["launches"] == (st["nodes"] if policy == "sequential" else per_sample + 1)
    assert loss._active                        # still hybridized afterwards
    assert type(loss(nd.ones((1, 5)), nd.ones((1, 5)))) is nd.NDArray   # concrete: its graph


@pytest.mark.parametrize("policy", ["depth", "agenda", "auto"])
def test_arrays_made_from_python_data_while_pending_merge_into_one_creation(policy):
    # per-sample code making a small array per sample (a leaf's word id): while
    # a graph is pending, nd.array is recorded, and the flush makes them all
    # with one array creation; values and gradients are plain Gluon's
    emb = nn.Embedding(10, 3)
    emb.initialize(mx.init.Uniform(0.5))
    ids = [3, 1, 4, 1, 5, 9, 2]

    def go(flag):
        emb.hybridize(dynamic_batch=True, policy=policy) if flag else emb.hybridize(active=False)
        emb.collect_params().zero_grad()
        with autograd.record():
            ys = [emb(nd.array([i])) for i in ids]
            loss = nd.add_n(*[(y * y).sum() * (k + 1) for k, y in enumerate(ys)])
        loss.backward()
        return [y.asnumpy() for y in ys], {"w": emb.weight.grad().asnumpy().copy()}
    ref = go(False)
    jitbatch.reset_stats()
    got = go(True)
    assert_same(ref, got)
    assert jitbatch.stats()["nodes"] >= 2 * len(ids) - 1     # the first nd.array ran eagerly
    emb.hybridize(dynamic_batch=True, policy=policy)
    jitbatch.reset_stats()
    first = emb(nd.array([0]))                  # starts the graph
    xs = [nd.array([i]) for i in ids]           # recorded: the graph is pending
    assert all(jitbatch.is_lazy(x) for x in xs) and xs[0].dtype == np.float32
    ys = [emb(x) for x in xs]
    ys[-1].asnumpy()
    st = jitbatch.stats()
    if policy != "auto":   # one creation; the embedding in one launch (the first
        # call's id was concrete, the others' recorded creations sit at depth 0)
        assert st["launches"] == 2, st
    np.testing.assert_allclose(xs[2].asnumpy(), [4.0])
    emb.hybridize(active=False)
    np.testing.assert_allclose(ys[2].asnumpy(), emb(nd.array([4])).asnumpy(), rtol=1e-6)
    assert first.shape == (1, 3)


def test_arrays_made_while_pending_follow_the_context_scope_without_warnings():
    # a recorded nd.array lands on the device of the enclosing context scope,
    # as MXNet's own does, and asks MXNet for it without its deprecated property
    # (whose warning every such array raised: shown by pytest and `-W default`)
    import warnings
    dense = nn.Dense(2, in_units=3)
    dense.initialize()
    dense.hybridize(dynamic_batch=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = dense(nd.ones((1, 3)))     # starts the graph
        with mx.Context("cpu", 1):
            x = nd.array([[1.0, 2.0, 3.0]])
        z = nd.array([[4.0, 5.0, 6.0]])
        assert jitbatch.is_lazy(x) and jitbatch.is_lazy(z)
        assert x.context == mx.cpu(1) and z.context == mx.cpu(0)
        np.testing.assert_allclose(x.asnumpy(), [[1, 2, 3]])
        np.testing.assert_allclose(z.asnumpy(), [[4, 5, 6]])
        y.asnumpy()
    assert not [w for w in caught if issubclass(w.category, DeprecationWarning)], \
        [str(w.message) for w in caught]
    dense.hybridize(active=False)


@pytest.mark.parametrize("policy", ["depth", "agenda", "sequential", "auto"])
def test_zeros_and_begin_states_made_while_pending_merge_into_one_creation(policy):
    # a GRU over per-sample sequences, each starting from its cell's
    # begin_state (nd.zeros) and adding an nd.ones bias: while a graph is
    # pending those creations are recorded and made by one array creation per
    # flush; outputs and gradients are plain Gluon's
    cell = gluon.rnn.GRUCell(4, input_size=3)
    cell.initialize(mx.init.Uniform(0.5))
    rng = np.random.default_rng(1)
    seqs = [nd.array(rng.normal(size=(t, 3))) for t in (2, 3, 1, 2)]

    def go(flag):
        cell.hybridize(dynamic_batch=True, policy=policy) if flag else \
            cell.hybridize(active=False)
        cell.collect_params().zero_grad()
        with autograd.record():
            outs = []
            for seq in seqs:
                state = cell.begin_state(batch_size=1)
                for t in range(seq.shape[0]):
                    out, state = cell(seq[t:t + 1], state)
                outs.append(out + nd.ones((1, 4), dtype="float32") * 0.5)
            loss = nd.add_n(*[(o * o).sum() * (k + 1) for k, o in enumerate(outs)])
        loss.backward()
        return [o.asnumpy() for o in outs], {k: p.grad().asnumpy().copy()
                                             for k, p in cell.collect_params().items()}
    ref = go(False)
    jitbatch.reset_stats()
    got = go(True)
    assert_same(ref, got)
    # exact counts: the first sample's begin_state ran eagerly (nothing pending
    # yet); the other three and all four nd.ones were recorded
    cell.hybridize(dynamic_batch=True, policy=policy)
    jitbatch.reset_stats()
    first = cell(seqs[0][0:1], cell.begin_state(batch_size=1))[0]   # starts the graph
    zs = [cell.begin_state(batch_size=1)[0] for _ in range(3)] + [nd.ones((2, 4))]
    assert all(jitbatch.is_lazy(z) for z in zs)
    assert zs[0].shape == (1, 4) and zs[0].dtype == np.float32
    ys = [cell(seqs[1][0:1], [z])[0] for z in zs[:3]]
    total = nd.add_n(*ys) + zs[3][0:1]
    np.testing.assert_allclose(total.asnumpy(), 3 * ys[0].asnumpy() + 1, rtol=1e-5)
    st = jitbatch.stats()
    # one read, one flush: a new operator signature's shape inference (on zeros
    # jitbatch makes itself) must not run the pending graph
    assert st["nodes"] == 1 + 4 + 3 + 2 and st["flushes"] == 1, st
    if policy in ("depth", "agenda"):
        # one creation for the four arrays (zeros and ones alike: one signature
        # per row shape and dtype), the four cell calls merged (the creations sit
        # at depth 0, so the calls on them align with the first), add_n, the +
        assert st["launches"] == 4, st
    assert first.shape == (1, 4)
    np.testing.assert_allclose(zs[1].asnumpy(), np.zeros((1, 4)))
    np.testing.assert_allclose(zs[3].asnumpy(), np.ones((2, 4)))


def test_rnn_cell_calls_are_recorded_and_count_their_steps_like_gluon():
    # Gluon's RNN cells run RecurrentCell.forward (which counts the step) before
    # HybridBlock.forward; their calls are recorded straight from Block.__call__
    # with the same count, and a cell with a forward hook takes MXNet's own path
    # so the hook still runs; the outputs regroup as (out, [h]) and (out, [h, c])
    for cell in (gluon.rnn.GRUCell(3, input_size=2), gluon.rnn.LSTMCell(3, input_size=2)):
        cell.initialize(mx.init.Uniform(0.5))
        x = nd.array([[0.5, -1.0]])
        state = cell.begin_state(batch_size=1)
        cell.hybridize(active=False)
        want_out, want_state = cell(x, state)
        cell.hybridize(dynamic_batch=True)
        before = cell._counter
        out, new_state = cell(x, state)
        assert cell._counter == before + 1
        assert jitbatch.is_lazy(out) and type(new_state) is list
        assert len(new_state) == len(want_state)
        for a, b in zip([out] + new_state, [want_out] + want_state):
            np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-6)
        seen = []
        cell.register_forward_hook(lambda block, args, res: seen.append(len(args)))
        out, _ = cell(x, state)
        assert seen == [2] and cell._counter == before + 2 and jitbatch.is_lazy(out)
        jitbatch.flush()


class _SimilaritySteps(object):
    """The Tree-LSTM's similarity head on ``n`` fixed pairs, its starting
    parameters kept, to run a sequence of steps plain and batched from them."""

    def __init__(self, seed, n):
        from examples.tree_lstm.model import Similarity
        mx.random.seed(seed)
        self.net = Similarity(6, 5, 8)
        self.net.initialize(mx.init.Xavier())
        rng = np.random.default_rng(seed)
        self.xs = [(nd.array(rng.normal(size=(1, 8))), nd.array(rng.normal(size=(1, 8))))
                   for _ in range(n)]
        self.target = nd.array(rng.dirichlet(np.ones(5), size=1))
        self.start = {k: p.data().copy() for k, p in self.net.collect_params().items()}
        self.loss_fn = gluon.loss.KLDivLoss(from_logits=True)

    def begin(self, flag, policy, optimizer, lr):
        """The starting parameters, the mode, and a fresh trainer."""
        for k, p in self.net.collect_params().items():
            p.set_data(self.start[k])
        if flag:
            self.net.hybridize(dynamic_batch=True, policy=policy)
        else:
            self.net.hybridize(active=False)
        return gluon.Trainer(self.net.collect_params(), optimizer, {"learning_rate": lr})

    def train(self, trainer, n):
        """One training step on the first ``n`` pairs."""
        with autograd.record():
            total = nd.add_n(*[self.loss_fn(self.net(a, b), self.target)
                               for a, b in self.xs[:n]])
        total.backward()
        grads = {k: p.grad().asnumpy().copy() for k, p in self.net.collect_params().items()}
        trainer.step(n)
        return grads

    def predict(self, n):
        return nd.concat(*[self.net(a, b) for a, b in self.xs[:n]], dim=0).asnumpy()


@pytest.mark.parametrize("policy", ["auto", "depth", "agenda", "sequential"])
def test_training_minibatches_of_changing_sizes_equal_plain_gluon(policy):
    # minibatches of 5, 5, 5, 1, 5, 1 samples (an epoch's short last one): every
    # step's gradients equal plain Gluon's, whatever launches the steps before
    # ran (a reused launch state once gave the 1-sample steps wrong gradients)
    case = _SimilaritySteps(0, 5)

    def train(flag):
        trainer = case.begin(flag, policy, "adagrad", 0.1)
        return [case.train(trainer, n) for n in (5, 5, 5, 1, 5, 1)]
    want, got = train(False), train(True)
    for step, (w, g) in enumerate(zip(want, got)):
        for k in w:
            np.testing.assert_allclose(g[k], w[k], rtol=1e-4, atol=1e-6,
                                       err_msg="step %d, %s" % (step, k))
    case.net.hybridize(active=False)


class _Chain(gluon.Block):
    """A GRU cell over each sample's sequence, the last state scored: with
    sequences of one length, every step of every sample launches one shape."""

    def __init__(self, **kw):
        super().__init__(**kw)
        with self.name_scope():
            self.cell = gluon.rnn.GRUCell(6, input_size=3)
            self.out = nn.Dense(1, in_units=6)

    def forward(self, seq):
        h = [nd.zeros((1, 6))]
        for t in range(seq.shape[0]):
            y, h = self.cell(seq[t:t + 1], h)
        return self.out(y)


def _recording_static_ops():
    """The static CachedOps the recording launches of this process made so far."""
    from mxnet.ndarray import CachedOp
    ops = 0
    for info in jitbatch.gluon.signatures.TABLE._table.values():
        ex = getattr(info, "op", None)
        if getattr(ex, "mode", (False,))[0] and getattr(ex, "_static", None):
            ops += sum(isinstance(op, CachedOp) for op, _ in ex._static.ops.values())
    return ops


@pytest.mark.parametrize("policy", ["depth", "agenda", "auto", "sequential"])
def test_recording_launches_of_recurring_shapes_equal_plain_gluon(policy):
    # within one backward the same shape launches once per time step, two
    # recorded minibatches are kept before one backward, one graph is run
    # backward twice (retain_graph), and minibatch sizes change: every step's
    # gradients equal plain Gluon's
    mx.random.seed(4)
    net = _Chain()
    net.initialize(mx.init.Xavier())
    start = {k: p.data().copy() for k, p in net.collect_params().items()}
    rng = np.random.default_rng(4)
    seqs = [nd.array(rng.normal(size=(4, 3))) for _ in range(6)]

    def loss(n, first=0):
        return nd.add_n(*[nd.sum(net(x) ** 2) for x in seqs[first:first + n]])

    def grads():
        return {k: p.grad().asnumpy().copy() for k, p in net.collect_params().items()}

    def steps(flag):
        for k, p in net.collect_params().items():
            p.set_data(start[k])
        if flag:
            net.hybridize(dynamic_batch=True, policy=policy)
        else:
            net.hybridize(active=False)
        trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
        got = []
        for n in (6, 6, 6, 2, 6, 2):
            with autograd.record():
                total = loss(n)
            total.backward()
            got.append(grads())
            trainer.step(n)
        with autograd.record():         # two minibatches recorded, one backward
            a = loss(3)
            b = loss(3, first=3)
        autograd.backward([a, b])
        got.append(grads())
        with autograd.record():
            total = loss(6)
        total.backward(retain_graph=True)
        got.append(grads())
        total.backward()
        got.append(grads())
        return got

    want, got = steps(False), steps(True)
    for step, (w, g) in enumerate(zip(want, got)):
        for k in w:
            np.testing.assert_allclose(g[k], w[k], rtol=1e-4, atol=1e-6,
                                       err_msg="step %d, %s" % (step, k))
    # recording launches run the dynamic CachedOp: MXNet's static one, called
    # again in one recording, gave wrong gradients (docs/design.rst)
    assert _recording_static_ops() == 0
    net.hybridize(active=False)


def test_static_cachedops_stay_with_the_launch_shapes_used_most(monkeypatch):
    # a launch shape gets a static CachedOp on its third launch; where more
    # shapes cycle than may keep one (a sequence model's steps run every size),
    # those that have one keep it instead of one being remade per launch; once
    # a workload moves to other shapes, ageing hands them over
    from jitbatch.gluon import executors
    monkeypatch.setattr(executors, "STATIC_SHAPES", 4)
    monkeypatch.setattr(executors, "AGE_EVERY", 64)
    cache = executors.StaticOps()
    made = []

    def launch(key):            # as BlockExec._static_op uses it
        entry = cache.use(key)
        if entry is None:
            return False
        if entry[0] is None:
            entry[0] = object()
            made.append(key)
        return True

    assert [launch("a") for _ in range(4)] == [False, False, True, True]
    for _ in range(200):
        for key in "abcdef":
            launch(key)
        assert len(cache.ops) <= 4
    assert len(made) <= 6        # clearing or least-recently-used: one per miss
    before = len(made)
    for _ in range(200):
        for key in "wxyz":
            launch(key)
    assert sorted(cache.ops) == list("wxyz") and len(made) == before + 4
    assert len(cache.seen) <= 4 * executors.STATIC_SHAPES


@pytest.mark.parametrize("policy", ["depth", "agenda", "auto", "sequential"])
def test_inference_between_training_steps_equals_plain_gluon(policy):
    # inference launches run a static CachedOp per launch shape that recurs
    # (its memory planned once, its intermediate buffers reused): minibatches
    # of changing and repeated sizes, between training steps that update the
    # parameters in place and one that replaces them, give plain Gluon's
    # predictions
    case = _SimilaritySteps(2, 6)

    def run(flag):
        trainer = case.begin(flag, policy, "sgd", 0.5)
        preds = []
        for step, n in enumerate((6, 3, 6, 6, 1, 3, 6, 6, 3)):
            preds.append(case.predict(n))
            if step == 4:       # new parameter arrays: a static op planned for the
                for p in case.net.collect_params().values():   # old ones plans again
                    p.initialize(mx.init.Constant(0.01), force_reinit=True)
            case.train(trainer, n)
        return preds
    want, got = run(False), run(True)
    for step, (w, g) in enumerate(zip(want, got)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6, err_msg="step %d" % step)
    case.net.hybridize(active=False)


@pytest.mark.parametrize("policy", ["depth", "agenda", "auto", "sequential"])
def test_losses_pick_where_and_topk_between_blocks_merge(policy):
    # a per-sample classification loss (Gluon's SoftmaxCrossEntropyLoss picks
    # each sample's label column), a where and a topk on per-sample outputs:
    # each ONE launch for all samples (pick had no rule: one launch per sample,
    # 32 of a zoo model's 80 per training step); plain Gluon's values and
    # gradients
    net = nn.Dense(6, in_units=3)
    net.initialize(mx.init.Uniform(0.5))
    rng = np.random.default_rng(7)
    xs = [nd.array(rng.normal(size=(1, 3))) for _ in range(5)]
    labels = [nd.array([k % 6]) for k in range(5)]
    ce = gluon.loss.SoftmaxCrossEntropyLoss()

    def go(flag):
        net.hybridize(dynamic_batch=True, policy=policy) if flag else \
            net.hybridize(active=False)
        net.collect_params().zero_grad()
        with autograd.record():
            ys = [net(x) for x in xs]
            losses = [ce(y, t) for y, t in zip(ys, labels)]
            ws = [nd.where(y > 0, y, y * 0.1) for y in ys]
            tops = [nd.topk(y, k=2, ret_typ="value") for y in ys]
            total = nd.add_n(*[l.sum() + w.sum() + (t * t).sum()
                               for l, w, t in zip(losses, ws, tops)])
        total.backward()
        return ([l.asnumpy() for l in losses] + [w.asnumpy() for w in ws] +
                [t.asnumpy() for t in tops], {"w": net.weight.grad().asnumpy().copy(),
                                              "b": net.bias.grad().asnumpy().copy()})
    ref = go(False)
    jitbatch.reset_stats()
    got = go(True)
    assert_same(ref, got)
    st = jitbatch.stats()
    if policy in ("depth", "agenda"):
        # one launch per operator signature: the dense block; the loss's
        # log_softmax, pick, negation and mean; the comparison, the scaling and
        # where; topk; the square; three sums of three shapes, the two + (at two
        # depths) and the final add_n. Per sample: 76
        assert st["nodes"] == 76 and st["launches"] == 16, st
    net.hybridize(active=False)


@pytest.mark.parametrize("policy", ["depth", "agenda", "auto", "sequential"])
def test_batch_dot_and_one_hot_between_blocks_merge(policy):
    # operators users reach for between blocks: batch_dot of two per-sample
    # (1, S, H) values and one_hot of per-sample ids each run as ONE launch for
    # all samples (they had no rule: one launch per call); outputs and
    # gradients are plain Gluon's
    net = nn.Dense(8, in_units=3, flatten=False)
    net.initialize(mx.init.Uniform(0.5))
    rng = np.random.default_rng(4)
    xs = [nd.array(rng.normal(size=(1, 4, 3))) for _ in range(5)]

    def go(flag):
        net.hybridize(dynamic_batch=True, policy=policy) if flag else \
            net.hybridize(active=False)
        net.collect_params().zero_grad()
        with autograd.record():
            ys = [net(x) for x in xs]                                  # (1, 4, 8)
            zs = [nd.batch_dot(y[:, :, :4], y[:, :, 4:], transpose_b=True) for y in ys]
            loss = nd.add_n(*[(z * z).sum() for z in zs])
        loss.backward()
        return [z.asnumpy() for z in zs], {"w": net.weight.grad().asnumpy().copy()}
    ref = go(False)
    got = go(True)
    assert_same(ref, got)
    net.hybridize(dynamic_batch=True, policy=policy)
    first = net(xs[0])                       # something pending: the ids are recorded
    jitbatch.reset_stats()
    ys = [net(x) for x in xs]
    zs = [nd.batch_dot(y, y, transpose_b=True) for y in ys]          # (1, 4, 4)
    hots = [nd.one_hot(nd.array([i % 3, 2]), 3) for i in range(5)]    # (2, 3)
    got_z = [z.asnumpy() for z in zs]
    got_h = [h.asnumpy() for h in hots]
    st = jitbatch.stats()
    if policy in ("depth", "agenda"):
        # the dense block (with the first call), batch_dot, the ids, one_hot
        assert st["launches"] == 4, st
    net.hybridize(active=False)
    for x, z in zip(xs, got_z):
        y = net(x)
        np.testing.assert_allclose(z, nd.batch_dot(y, y, transpose_b=True).asnumpy(),
                                   rtol=1e-5, atol=1e-6)
    for i, h in enumerate(got_h):
        np.testing.assert_array_equal(h, np.eye(3)[[i % 3, 2]])
    assert first.shape == (1, 4, 8)


def test_a_budget_that_keeps_auto_from_batching_is_reported_once_with_the_budget_that_would(
        monkeypatch, recwarn):
    from jitbatch import cost, execute
    monkeypatch.setattr(cost, "MODEL", cost.Model())
    monkeypatch.setattr(execute, "_BUDGETS_REPORTED", set())
    net = nn.Dense(3, in_units=3)
    net.initialize()
    net.hybridize(dynamic_batch=True, analysis_budget=1e-9)
    xs = [nd.ones((1, 3)) * i for i in range(48)]
    for _ in range(6):
        ys = [net(x) for x in xs]
        ys[-1].asnumpy()
    st = jitbatch.stats()
    assert st["last_flush"]["policy"] == "sequential", st["last_flush"]
    found = [w for w in recwarn.list if issubclass(w.category, jitbatch.BudgetWarning)]
    assert len(found) == 1, [str(w.message) for w in found]
    msg = str(found[0].message)
    m = re.search(r"analysis_budget=1e-09 keeps policy 'auto' from batching: (looking at the "
                  r"graph|merging policies' analysis) measured \S+ of the predicted unbatched "
                  r"time .* Fix: hybridize with analysis_budget >= (\S+) \(or None", msg, re.S)
    assert m, msg
    # (measured times are noisy: a margin over the named budget)
    net.hybridize(dynamic_batch=True, analysis_budget=float(m.group(2).rstrip(".")) * 10)
    jitbatch.reset_stats()
    for _ in range(3):
        ys = [net(x) for x in xs]
        ys[-1].asnumpy()
    assert jitbatch.stats()["launches"] < 3 * len(xs), jitbatch.stats()


@pytest.mark.parametrize("policy", ["depth", "agenda", "auto", "sequential"])
def test_operators_called_by_an_alias_find_their_batching_rule(policy):
    """Until 2026-11-26 an operator's name was whichever of its aliases MXNet
    listed last: ``nd.Activation`` was '_npx_activation', ``nd.maximum`` with a
    number '_npi_maximum_scalar', ``nd.Dropout`` '_npx_dropout', and the rule
    table (keyed by registered names) had no entry for them, so their calls
    between blocks ran one launch per sample. The name is now the registered
    one whichever alias the program calls (``_mxapi.op_name``); each of
    these is one launch for all samples, with plain Gluon's values and
    gradients."""
    from jitbatch.gluon import _mxapi
    assert _mxapi.op_name(_mxapi.op_handle("_npx_activation")) == "Activation"
    assert _mxapi.op_name(_mxapi.op_handle("Activation")) == "Activation"
    net = nn.Dense(4, in_units=3)
    net.initialize(mx.init.Uniform(0.5))
    rng = np.random.default_rng(3)
    xs = [nd.array(rng.normal(size=(1, 3))) for _ in range(6)]

    def go(flag):
        net.hybridize(dynamic_batch=True, policy=policy) if flag else \
            net.hybridize(active=False)
        net.collect_params().zero_grad()
        with autograd.record():
            ys = [nd.Activation(net(x), act_type="softrelu") for x in xs]
            zs = [nd._internal._hypot_scalar(nd.minimum(y, 0.5), scalar=0.25) for y in ys]
            total = nd.add_n(*[z.sum() for z in zs])
        total.backward()
        return [z.asnumpy() for z in zs], {"w": net.weight.grad().asnumpy().copy()}
    ref = go(False)
    jitbatch.reset_stats()
    got = go(True)
    assert_same(ref, got)
    if policy in ("depth", "agenda"):
        # the Dense block, Activation, minimum, hypot, the sums, the add_n
        assert jitbatch.stats()["launches"] == 6, jitbatch.stats()["launches"]
    net.hybridize(active=False)
