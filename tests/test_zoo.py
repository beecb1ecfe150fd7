"""The model zoo (examples/zoo): each model's hand-batched reference and jitbatch
both compute what its per-sample plain Gluon code computes, the summed loss of
a minibatch and the gradient of every parameter, on the same parameters.

Tiny sizes (examples.zoo.MODELS[...].tiny): these check the math, not speed."""
import zlib

import numpy as np
import mxnet as mx
import pytest
from mxnet import autograd, nd

import jitbatch
from examples.zoo import MODELS

SAMPLES = 6
POLICIES = ["sequential", "depth", "agenda", "auto"]
GRANULARITIES = ["block", "split", "auto"]
RUNNABLE = sorted(n for n, e in MODELS.items() if not e.known_failure)
RTOL = 1e-5


def zero_grads(net):
    for p in net.collect_params().values():
        if p.grad_req != "null":
            p.zero_grad()


def grads_of(net):
    return {k: p.grad().asnumpy().copy() for k, p in net.collect_params().items()
            if p.grad_req != "null"}


def run_per_sample(entry, net, samples, train=True, each=None):
    """(per-sample outputs, summed loss, gradients) of the per-sample code under
    ``net``'s current hybridize flags; gradients only when ``train``; ``each``:
    what runs the samples' calls instead of a loop (``jitbatch.map``)."""
    zero_grads(net)
    if not train:
        outs, losses = entry.per_sample(net, samples, each)
        return [o.asnumpy() for o in outs], nd.add_n(*losses).asscalar(), {}
    with autograd.record():
        outs, losses = entry.per_sample(net, samples, each)
        total = nd.add_n(*losses)
    total.backward()
    return [o.asnumpy() for o in outs], total.asscalar(), grads_of(net)


def run_hand(entry, net, samples):
    net.hybridize()
    zero_grads(net)
    hand = entry.hand(net)
    with autograd.record():
        outs = hand.forward(samples)
        total = nd.sum(hand.loss(samples, outs))
    total.backward()
    net.hybridize(active=False)
    return outs.asnumpy(), total.asscalar(), grads_of(net)


def assert_close(got, want, what):
    """Equal to RTOL relative to the array's largest magnitude (gradient entries
    near zero are compared on the array's scale)."""
    got, want = np.asarray(got), np.asarray(want)
    scale = float(np.abs(want).max()) if want.size else 0.0
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * max(scale, 1e-6), err_msg=what)


def assert_grads_close(got, want):
    assert set(got) == set(want)
    for k in want:
        assert_close(got[k], want[k], "gradient of " + k)


class Case(object):
    """One model's network, samples and plain per-sample reference (training),
    built once per test session."""

    def __init__(self, name):
        self.entry = MODELS[name]
        self.net = self.entry.build(seed=1, tiny=True)
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        self.samples = self.entry.generate(rng, SAMPLES, tiny=True)
        self.net.hybridize(active=False)
        self.outs, self.loss, self.grads = run_per_sample(self.entry, self.net, self.samples)


_CASES = {}


def case(name):
    if name not in _CASES:
        _CASES[name] = Case(name)
    return _CASES[name]


@pytest.mark.parametrize("model", sorted(n for n, e in MODELS.items() if e.hand))
def test_hand_batched_equals_per_sample(model):
    c = case(model) if model in RUNNABLE else Case(model)
    outs, loss, grads = run_hand(c.entry, c.net, c.samples)
    assert_close(loss, c.loss, "summed loss")
    assert_close(outs, np.concatenate(c.outs, axis=0), "outputs")
    assert_grads_close(grads, c.grads)
    assert any(np.abs(g).max() > 0 for g in grads.values())


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model", RUNNABLE)
def test_jitbatch_equals_per_sample(model, policy, granularity):
    c = case(model)
    c.net.hybridize(dynamic_batch=True, policy=policy, granularity=granularity)
    jitbatch.reset_stats()
    try:
        outs, loss, grads = run_per_sample(c.entry, c.net, c.samples)
    finally:
        c.net.hybridize(active=False)
    st = jitbatch.stats()
    assert_close(loss, c.loss, "summed loss")
    for i, (got, want) in enumerate(zip(outs, c.outs)):
        assert_close(got, want, "output of sample %d" % i)
    assert_grads_close(grads, c.grads)
    assert st["nodes"] > 0
    if policy == "sequential":
        assert st["launches"] == st["nodes"], st
    elif policy in ("depth", "agenda") and c.entry.merges:
        # calls of different samples shared launches
        assert st["launches"] < st["nodes"], st


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model", RUNNABLE)
def test_jitbatch_inference_equals_per_sample(model, policy):
    c = case(model)
    c.net.hybridize(active=False)
    want, want_loss, _ = run_per_sample(c.entry, c.net, c.samples, train=False)
    c.net.hybridize(dynamic_batch=True, policy=policy)
    try:
        got, got_loss, _ = run_per_sample(c.entry, c.net, c.samples, train=False)
    finally:
        c.net.hybridize(active=False)
    assert_close(got_loss, want_loss, "summed loss")
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, "output of sample %d" % i)


class _Layer(mx.gluon.Block):
    """A fused GRU layer called directly per sample: ``(T, 1, C)`` in TNC or
    ``(1, T, C)`` in NTC, with Gluon's zero states or given ``(1, 1, H)`` ones."""

    def __init__(self, layout, states, **kw):
        super(_Layer, self).__init__(**kw)
        self.layout, self.states = layout, states
        with self.name_scope():
            self.rnn = mx.gluon.rnn.GRU(5, layout=layout, input_size=3)

    def forward(self, x):  # pylint: disable=arguments-differ
        x = x if self.layout == "NTC" else x.swapaxes(0, 1)
        if self.states:
            y, _ = self.rnn(x, self.rnn.begin_state(batch_size=1))
        else:
            y = self.rnn(x)
        return y if self.layout == "NTC" else y.swapaxes(0, 1)


def _layer_program(net, xs, flag, policy="depth"):
    net.hybridize(dynamic_batch=True, policy=policy) if flag else net.hybridize(active=False)
    net.collect_params().zero_grad()
    try:
        with mx.autograd.record():
            ys = [net(x) for x in xs]
            loss = mx.nd.add_n(*[(y * y * (k + 1)).sum() for k, y in enumerate(ys)])
        loss.backward()
        return [y.asnumpy() for y in ys], {k: p.grad().asnumpy().copy()
                                           for k, p in net.collect_params().items()}
    finally:
        jitbatch.flush()
        net.hybridize(active=False)


@pytest.mark.parametrize("policy", ["depth", "agenda", "auto"])
@pytest.mark.parametrize("rows", [1, 2])
def test_fused_gru_layer_in_tnc_layout_merges_samples_of_one_length(rows, policy):
    # issue 23 item 3: the layer's batch axis is 1 in TNC; samples of lengths
    # 4, 4, 2, 4, 2 merge by length (``rows`` sequences per sample: (T, rows, C))
    net = _Layer("TNC", False)
    net.initialize(mx.init.Uniform(0.5))
    xs = [mx.nd.array(np.random.default_rng(i).normal(size=(rows, T, 3)))
          for i, T in enumerate([4, 4, 2, 4, 2])]
    want = _layer_program(net, xs, False)
    jitbatch.reset_stats()
    got = _layer_program(net, xs, True, policy)
    st = jitbatch.stats()
    for a, b in zip(want[0], got[0]):
        assert_close(b, a, "output")
    assert_grads_close(got[1], want[1])
    if policy != "auto":
        assert st["launches"] < st["nodes"], st


@pytest.mark.parametrize("layout", ["TNC", "NTC"])
def test_fused_gru_layer_given_states_gets_an_error_naming_the_layer_and_the_fix(layout):
    # the states Gluon's begin_state makes have their batch axis at 1
    net = _Layer(layout, True)
    net.initialize(mx.init.Uniform(0.5))
    xs = [mx.nd.array(np.random.default_rng(i).normal(size=(1, 4, 3))) for i in range(3)]
    _layer_program(net, xs, False)                              # plain Gluon runs it
    with pytest.raises(jitbatch.BatchingError,
                       match=r"gru\d+.*fused RNN layer.*batch axis is 1.*Fix: call the layer "
                             r"itself per sample with no explicit states"):
        _layer_program(net, xs, True)
    net.states = False                              # the fix; the next batch runs right
    assert_grads_close(_layer_program(net, xs, True)[1], _layer_program(net, xs, False)[1])


class _NTC(mx.gluon.HybridBlock):
    """The fix the error names: layout NTC, one sample (1, T, C), no states."""

    def __init__(self, **kw):
        super(_NTC, self).__init__(**kw)
        with self.name_scope():
            self.rnn = mx.gluon.rnn.GRU(5, layout="NTC", input_size=3)

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return F.slice_axis(self.rnn(x), axis=1, begin=-1, end=None)


@pytest.mark.parametrize("policy", ["depth", "agenda", "auto"])
def test_fused_gru_layer_in_ntc_layout_merges_and_equals_plain(policy):
    net = _NTC()
    net.initialize(mx.init.Uniform(0.5))
    xs = [mx.nd.array(np.random.default_rng(i).normal(size=(1, 4, 3))) for i in range(5)]

    def go(flag):
        net.hybridize(dynamic_batch=True, policy=policy) if flag else net.hybridize(active=False)
        net.collect_params().zero_grad()
        with mx.autograd.record():
            ys = [net(x) for x in xs]
            loss = mx.nd.add_n(*[(y * y).sum() for y in ys])
        loss.backward()
        return [y.asnumpy() for y in ys], {k: p.grad().asnumpy().copy()
                                           for k, p in net.collect_params().items()}
    want = go(False)
    jitbatch.reset_stats()
    got = go(True)
    for a, b in zip(want[0], got[0]):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    for k in want[1]:
        np.testing.assert_allclose(got[1][k], want[1][k], rtol=1e-4, atol=1e-5, err_msg=k)
    if policy != "auto":
        assert jitbatch.stats()["launches"] < jitbatch.stats()["nodes"]
