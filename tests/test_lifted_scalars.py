"""Scalar operators whose scalar differs per sample merge (``x / len(children)``).

A user averages a node's children with ``nd.add_n(*hs) / len(hs)``, scales by
a per-sample weight, shifts by a per-sample offset. Each is a scalar operator
(``_div_scalar`` with ``scalar=n``); until 2026-11-26 the scalar was part of
its signature, so such calls merged only between samples with the same
number (the zoo's graph network: one read-out launch per graph size, 16 per
minibatch). The scalar is now the node's own (``Node.lifted``), and a launch
applies the operator's broadcasting twin to the samples' rows and a column of
their scalars. MXNet casts a scalar to the array's dtype before computing, so
the merged values are the per-sample ones bit for bit (checked below with
scalars float32 cannot hold, 0.1 and 1/3, and with -0.0, inf and NaN), but
for doubles MXNet's text parser reads one ulp off (docs/errors.rst, Known
differences; test_heldout27.py)."""
import numpy as np
import pytest
from mxnet import autograd, gluon, nd

import jitbatch
from jitbatch.stats import STATS

from harness import assert_same, run
from heldout import initialized

POLICIES = ["depth", "agenda", "sequential", "auto"]
SCALARS = [1.0, 2.0, 3.0, 7.0, 0.5, 0.1, 1.0 / 3.0, -2.5, 100.0, -0.0]


class Double(gluon.HybridBlock):
    """An exact block: its merged outputs are the per-sample ones bit for bit."""

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return x * 2.0


def chain(h, i):
    """Every lifted operator once, each with a scalar of sample ``i``'s own."""
    s = SCALARS[i % len(SCALARS)]
    t = SCALARS[(3 * i + 1) % len(SCALARS)]
    y = h / (i + 1) + s          # _div_scalar, _plus_scalar
    y = (y - t) * s              # _minus_scalar, _mul_scalar
    y = (t - y) / (1.0 + i / 7)  # _rminus_scalar, _div_scalar
    y = nd.maximum(y, s)         # _maximum_scalar
    y = nd.minimum(y, 50.0 + i)  # _minimum_scalar
    y = (i + 2.0) / (nd.abs(y) + 1.0)    # _rdiv_scalar (and _plus_scalar)
    return y ** (1 + i % 3) + 2.0 ** (y * 0.25)   # _power_scalar, _rpower_scalar


class Children(gluon.Block):
    """A node's children averaged, then scaled, shifted and squashed by the
    sample's own numbers, the way a user writes it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.cell = gluon.nn.Dense(4, in_units=3, activation="tanh")

    def forward(self, xs, i):  # pylint: disable=arguments-differ
        hs = [self.cell(x) for x in xs]
        return chain(nd.add_n(*hs) / len(hs), i)


def _samples(seed, n=16):
    rng = np.random.default_rng(seed)
    return [([nd.array(rng.normal(size=(1, 3))) for _ in range(int(rng.integers(1, 6)))], i)
            for i in range(n)]


def _net():
    return initialized(Children(prefix="children_"))


def _apply(net, sample):
    out = net(*sample)
    return out, out.sum()


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_per_sample_scalars_equal_plain_gluon(policy, train):
    samples = _samples(0)
    ref = run(_net(), _apply, samples, train, flag=False)
    got = run(_net(), _apply, samples, train, flag=True, policy=policy)
    assert_same(ref, got)


@pytest.mark.parametrize("policy", POLICIES)
def test_merged_scalar_operators_are_exact(policy):
    """Bit for bit, signs of zero, infinities and NaN included, on the outputs
    of an exact block."""
    rng = np.random.default_rng(1)
    rows = rng.normal(size=(12, 5)).astype(np.float32) * 10
    rows[3] = -0.0
    rows[4, :3] = [np.inf, -np.inf, np.nan]
    xs = [nd.array(r[None]) for r in rows]
    plain = Double()
    want = [chain(plain(x), i).asnumpy() for i, x in enumerate(xs)]
    flagged = Double()
    flagged.hybridize(dynamic_batch=True, policy=policy)
    got = [chain(flagged(x), i) for i, x in enumerate(xs)]
    got = [g.asnumpy() for g in got]
    for i, (a, b) in enumerate(zip(want, got)):
        np.testing.assert_array_equal(b, a, err_msg="sample %d" % i)
        assert (np.signbit(a) == np.signbit(b)).all(), i


@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_one_launch_per_operator_whatever_the_scalars(policy):
    """Counters: 12 samples, each its own scalars: one launch per operator of
    the chain (the doubling, 13 scalar operators, ``abs``, the final add), as
    if every sample had the same numbers."""
    xs = [nd.array(np.full((1, 5), i + 1.0, dtype=np.float32)) for i in range(12)]
    flagged = Double()
    flagged.hybridize(dynamic_batch=True, policy=policy)
    STATS.reset()
    got = [chain(flagged(x), i) for i, x in enumerate(xs)]
    nd.concat(*got, dim=0).asnumpy()
    assert jitbatch.stats()["launches"] == 16, jitbatch.stats()["launches"]


def test_integer_arrays_keep_their_scalar_in_the_signature():
    """Only floating-point arrays are lifted: an int32 array's ``x * 2`` and
    ``x * 3`` stay two signatures (MXNet's integer kernels are not checked
    here), and both are right."""
    class Cast(gluon.HybridBlock):
        def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
            return F.cast(x, "int32")
    flagged = Cast()
    flagged.hybridize(dynamic_batch=True, policy="depth")
    xs = [nd.array([[1.0, 2.0, 3.0]]) for _ in range(4)]
    STATS.reset()
    got = [(flagged(x) * (2 + i % 2)).asnumpy() for i, x in enumerate(xs)]
    for i, g in enumerate(got):
        np.testing.assert_array_equal(g, np.array([[1, 2, 3]]) * (2 + i % 2))
