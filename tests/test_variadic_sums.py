"""Sums of any number of inputs (``nd.add_n``) merge across arities.

A message-passing network sums each node's neighbours' messages with one
``add_n`` of as many inputs as the node has neighbours; the read-out sums a
graph's nodes. Until 2026-11-26 every arity was a signature of its own, so one
depth group of such sums ran one launch per arity present (the zoo's graph
network: 64 launches per training step, 40 after). Calls of different arity
now share a launch, the shorter ones padded with -0.0 (the IEEE additive
identity: x + -0.0 is x for every x, -0.0 and NaN included; +0.0 would turn a
sum of -0.0 into +0.0). MXNet 1.9.1 sums 3 or 4 inputs right to left and 5 or
more left to right, so sums of up to 4 inputs and of 5 or more are apart (two
signatures); within each the merged sums are the per-sample ones bit for bit."""
import numpy as np
import pytest
from mxnet import autograd, gluon, nd

import jitbatch
from jitbatch.stats import STATS

from harness import assert_same, run
from heldout import initialized

POLICIES = ["depth", "agenda", "sequential", "auto"]


class Double(gluon.HybridBlock):
    """An exact block: its (lazy) outputs sum to the same bits in any order of launches."""

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return x * 2.0


class Sums(gluon.Block):
    """Per sample: its rows, each through a Dense block and (exactly) doubled,
    summed with one add_n each, as a user writes a sum over neighbours."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.dense = gluon.nn.Dense(4, in_units=3)
            self.double = Double()

    def forward(self, xs):  # pylint: disable=arguments-differ
        exact = nd.add_n(*[self.double(x) for x in xs])
        learned = nd.add_n(*[self.dense(x) for x in xs])
        return nd.concat(exact, learned, dim=1)


def _samples(seed, n=14):
    rng = np.random.default_rng(seed)
    out = [[nd.array(rng.normal(size=(1, 3))) for _ in range(int(rng.integers(1, 7)))]
           for _ in range(n)]
    out.append([nd.array(np.full((1, 3), -0.0, dtype=np.float32))])   # sums to -0.0
    out.append([nd.array(np.array([[np.nan, np.inf, -np.inf]], dtype=np.float32)),
                nd.array(np.ones((1, 3), dtype=np.float32))])
    return out


def _net():
    return initialized(Sums(prefix="sums_"))


def _apply(net, xs):
    out = net(xs)
    return out, nd.nansum(out[:, 4:]) + 0.0 * nd.nansum(out[:, :4])


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_sums_of_any_arity_equal_plain_gluon(policy, train):
    samples = _samples(0)
    ref = run(_net(), _apply, samples, train, flag=False)
    got = run(_net(), _apply, samples, train, flag=True, policy=policy)
    outs_ref, outs_got = ref[0], got[0]
    for a, b in zip(outs_ref[:len(samples)], outs_got[:len(samples)]):
        # the exact half: the same sums bit for bit, signs of zero and NaN included
        np.testing.assert_array_equal(a[:, :3], b[:, :3])
        assert (np.signbit(a[:, :3]) == np.signbit(b[:, :3])).all()
    clean = lambda r: ([np.nan_to_num(o) for o in r[0]], r[1])  # noqa: E731
    assert_same(clean(ref), clean(got))


@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_one_launch_per_depth_whatever_the_arities(policy):
    """Counters: the samples' sums, of six arities, are two launches per sum
    (arities 1-4 and 5-6), not one per arity."""
    net = _net()
    net.hybridize(dynamic_batch=True, policy=policy)
    samples = _samples(1)
    arities = {len(s) for s in samples}
    assert arities == {1, 2, 3, 4, 5, 6}
    STATS.reset()
    outs = [net(s) for s in samples]
    nd.concat(*outs, dim=0).asnumpy()
    st = jitbatch.stats()
    # the doublings (1 launch), the Dense calls (1), two sums (2 each), the concats (1)
    assert st["launches"] == 7, st["launches"]


def test_a_sum_with_num_args_given_merges_too():
    """``nd.add_n(*xs, num_args=k)`` (MXNet's attribute, given by hand): the
    merged launch passes its own count."""
    net = _net()
    net.hybridize(dynamic_batch=True, policy="depth")
    samples = _samples(2)
    want = [nd.add_n(*[x * 2.0 for x in s]).asnumpy() for s in samples]
    STATS.reset()
    got = [nd.add_n(*[net.double(x) for x in s], num_args=len(s)) for s in samples]
    got = [g.asnumpy() for g in got]
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)
    assert jitbatch.stats()["launches"] == 3     # the doublings, the sums (1-4, 5-6 inputs)


def test_sums_of_different_shapes_stay_apart():
    """Only sums of one input shape share a signature: (1, 3) and (2, 3) inputs
    are two launches, each right."""
    net = _net()
    net.hybridize(dynamic_batch=True, policy="depth")
    rng = np.random.default_rng(3)
    xs = [nd.array(rng.normal(size=(r, 3))) for r in (1, 2, 1, 2, 1)]
    STATS.reset()
    lazy = [net.dense(x) for x in xs]
    sums = [nd.add_n(*lazy[:k + 1:2]) if k % 2 == 0 else nd.add_n(lazy[k], lazy[k])
            for k in range(len(xs))]
    got = [s.asnumpy() for s in sums]
    net.hybridize(active=False)
    plain = [net.dense(x) for x in xs]
    want = [nd.add_n(*plain[:k + 1:2]) if k % 2 == 0 else nd.add_n(plain[k], plain[k])
            for k in range(len(xs))]
    for a, b in zip(want, got):
        np.testing.assert_allclose(b, a.asnumpy(), rtol=1e-5, atol=1e-6)
    # the Dense calls (1: rows of both shapes in one ragged launch), sums x2 shapes
    assert jitbatch.stats()["launches"] == 3
