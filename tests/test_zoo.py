"""The model zoo (examples/zoo): each model's hand-batched reference and jitbatch
both compute what its per-sample plain Gluon code computes, the summed loss of
a minibatch and the gradient of every parameter, on the same parameters.

Tiny sizes (examples.zoo.MODELS[...].tiny): these check the math, not speed."""
import zlib

import numpy as np
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


def run_per_sample(entry, net, samples, train=True):
    """(per-sample outputs, summed loss, gradients) of the per-sample code under
    ``net``'s current hybridize flags; gradients only when ``train``."""
    zero_grads(net)
    if not train:
        outs, losses = entry.per_sample(net, samples)
        return [o.asnumpy() for o in outs], nd.add_n(*losses).asscalar(), {}
    with autograd.record():
        outs, losses = entry.per_sample(net, samples)
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


@pytest.mark.xfail(strict=True, raises=jitbatch.BatchingError,
                   reason="issue 23 item 3: gluon.rnn.GRU (TNC) under dynamic_batch=True raises "
                          "BatchingError: block ..._gru0: output shapes cannot be inferred from "
                          "inputs [(T, 1, E), (1, 1, H)]: ... Shape inconsistent, Provided = "
                          "[2,1,H], inferred shape=(1,1,H)")
def test_fused_gru_layer_under_jitbatch():
    c = Case("fused_gru")
    c.net.hybridize(dynamic_batch=True)
    try:
        outs, loss, grads = run_per_sample(c.entry, c.net, c.samples)
    finally:
        c.net.hybridize(active=False)
    assert_close(loss, c.loss, "summed loss")
    for i, (got, want) in enumerate(zip(outs, c.outs)):
        assert_close(got, want, "output of sample %d" % i)
    assert_grads_close(grads, c.grads)
