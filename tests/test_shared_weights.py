"""Operators given a parameter's ``data()`` as their weight merge, the weight
passed once.

A user's own ``gluon.Block`` often calls operators on its parameters
directly: ``nd.FullyConnected(h, self.w.data(), self.b.data(), ...)``, an
output layer tied to the embedding (``nd.FullyConnected(h,
self.embed.weight.data(), no_bias=True, ...)``), ``nd.Embedding(ids,
w.data(), ...)``, ``nd.take(w.data(), ids)``, ``nd.LayerNorm(h, g.data(),
b.data())``. Until 2026-11-27 each such call was a launch of its own. Now a
call whose weight arguments are parameter arrays has a signature keyed by
those arrays (``record._shared``); merged, the weights are passed once as
they are (``rules.shared_rule``, ``gather.prepare``) and the other
arguments' rows are the samples'. Checked against plain Gluon (outputs and
gradients, every policy, training and inference) and by counters; a weight
that is not a parameter (an array made per call) keeps one launch per call."""
import numpy as np
import pytest
import mxnet as mx
from mxnet import gluon, nd

from harness import assert_same, run
from heldout import launches_by_name, square_loss

POLICIES = ["depth", "agenda", "sequential", "auto"]
V, E, H = 11, 6, 5


class Functional(gluon.Block):
    """Per sample: token ids ``(T,)``; its own parameters used through operators."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.embed = gluon.nn.Embedding(V, E)
            self.w = self.params.get("w", shape=(H, E))
            self.b = self.params.get("b", shape=(H,))
            self.table = self.params.get("table", shape=(V, H))
            self.gamma = self.params.get("gamma", shape=(H,), init=mx.init.Constant(1.5))
            self.beta = self.params.get("beta", shape=(H,))
            self.proj = self.params.get("proj", shape=(E, H))

    def forward(self, ids):  # pylint: disable=arguments-differ
        x = self.embed(ids)                                                          # (T, E)
        x = x + nd.Embedding(nd.argmax(x, axis=1), self.embed.weight.data(), input_dim=V,
                             output_dim=E)
        h = nd.FullyConnected(x, self.w.data(), self.b.data(), num_hidden=H)       # (T, H)
        h = nd.tanh(h) + nd.take(self.table.data(), nd.argmin(x, axis=1))           # (T, H)
        h = nd.LayerNorm(h, self.gamma.data(), self.beta.data())
        pooled = nd.mean(h, axis=0, keepdims=True)                                   # (1, H)
        back = nd.FullyConnected(pooled, self.proj.data(), no_bias=True, num_hidden=E)  # (1, E)
        # the output layer tied to the embedding
        return nd.FullyConnected(back, self.embed.weight.data(), no_bias=True, num_hidden=V)


def _net(seed=0):
    mx.random.seed(seed)
    net = Functional(prefix="functional_")
    net.initialize(mx.init.Uniform(0.5))
    return net


def _samples(seed, lengths=(3, 1, 4, 3, 2, 4, 3)):
    rng = np.random.default_rng(seed)
    return [nd.array(rng.integers(0, V, size=t)) for t in lengths]


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_operators_on_parameters_equal_plain_gluon(policy, train):
    samples = _samples(0)
    ref = run(_net(), square_loss, samples, train, flag=False)
    got = run(_net(), square_loss, samples, train, flag=True, policy=policy)
    assert_same(ref, got)


def test_one_launch_per_signature():
    """Seven samples of four lengths: each operator on the per-token rows runs
    once per length (its shapes hold ``T``), those on the pooled row once;
    until 2026-11-27 every call was a launch (7 per operator, 21 of
    ``FullyConnected``)."""
    net = _net()
    net.hybridize(dynamic_batch=True, policy="depth")
    samples = _samples(1)
    lengths = len({s.shape[0] for s in samples})
    seen = launches_by_name(lambda: nd.concat(*[net(x) for x in samples], dim=0).asnumpy())
    assert seen.get("Embedding") == lengths, seen
    assert seen.get("take") == lengths, seen
    assert seen.get("LayerNorm") == lengths, seen
    assert seen.get("FullyConnected") == lengths + 2, seen
    net.hybridize(active=False)


class MadePerCall(gluon.Block):
    """A weight made per call (``nd.array`` of a NumPy matrix): no parameter,
    one launch per call, as before."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.dense = gluon.nn.Dense(E, in_units=E)
        self.weight = np.random.default_rng(3).normal(size=(H, E))

    def forward(self, x):  # pylint: disable=arguments-differ
        return nd.FullyConnected(self.dense(x), nd.array(self.weight), no_bias=True,
                                 num_hidden=H)


def test_a_weight_made_per_call_runs_per_call():
    mx.random.seed(0)
    net = MadePerCall(prefix="percall_")
    net.initialize()
    rng = np.random.default_rng(4)
    xs = [nd.array(rng.normal(size=(1, E))) for _ in range(5)]
    want = [net(x).asnumpy() for x in xs]
    net.hybridize(dynamic_batch=True, policy="depth")
    got = []
    seen = launches_by_name(lambda: got.extend(o.asnumpy() for o in [net(x) for x in xs]))
    net.hybridize(active=False)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert seen.get("FullyConnected") == 5 and seen.get("Dense") is None, seen


class TiedDot(gluon.Block):
    """An output layer tied to the embedding through ``nd.dot`` (the rows of
    each sample's states against the table, ``transpose_b``)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.embed = gluon.nn.Embedding(V, E)
            self.cell = gluon.nn.Dense(E, in_units=E, flatten=False, activation="tanh")

    def forward(self, ids):  # pylint: disable=arguments-differ
        h = self.cell(self.embed(ids))                                              # (T, E)
        return nd.dot(h, self.embed.weight.data(), transpose_b=True)               # (T, V)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_dot_with_the_embedding_equals_plain_gluon(policy, train):
    samples = _samples(5)
    mx.random.seed(0)
    ref_net = TiedDot(prefix="tied_")
    ref_net.initialize(mx.init.Uniform(0.5))
    mx.random.seed(0)
    net = TiedDot(prefix="tied_")
    net.initialize(mx.init.Uniform(0.5))
    ref = run(ref_net, square_loss, samples, train, flag=False)
    got = run(net, square_loss, samples, train, flag=True, policy=policy)
    assert_same(ref, got)


def test_a_dot_with_the_embedding_passes_the_table_once(monkeypatch):
    """Seven samples of four lengths: one ``dot`` launch per length, each
    given the (V, E) table as it is; until 2026-11-27 the same launches ran
    as ``batch_dot`` over one copy of the table per sample (a (n, V, E)
    input)."""
    from jitbatch.gluon import _mxapi, executors
    shapes = []
    orig = _mxapi.run_op

    def spy(handle, ins, keys, vals):
        shapes.append([tuple(x.shape) for x in ins])
        return orig(handle, ins, keys, vals)
    monkeypatch.setattr(executors._mxapi, "run_op", spy)   # pylint: disable=protected-access
    mx.random.seed(0)
    net = TiedDot(prefix="tied_")
    net.initialize(mx.init.Uniform(0.5))
    net.hybridize(dynamic_batch=True, policy="depth")
    samples = _samples(6)
    lengths = len({s.shape[0] for s in samples})
    seen = launches_by_name(lambda: nd.concat(*[net(x) for x in samples], dim=0).asnumpy())
    net.hybridize(active=False)
    assert seen.get("dot") == lengths, seen
    tables = [s for s in shapes if any(len(t) == 3 and t[1:] == (V, E) for t in s)]
    assert not tables, tables
    # the merged launches: several samples' rows against the one table
    assert any(len(s) == 2 and s[1] == (V, E) and s[0][0] > max(
        x.shape[0] for x in samples) for s in shapes), shapes
