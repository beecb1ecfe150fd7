"""Operators users call between blocks merge: ``LeakyReLU`` (leaky, elu, selu,
gelu), ``broadcast_to`` / ``broadcast_axis`` / ``broadcast_like``,
``repeat``, ``swapaxes``, ``L2Normalization``, ``moments``, ``linalg_gemm2``.

Until 2026-11-27 none of them had a batching rule: every call on a lazy array
was a launch of its own (N launches for N samples). Each rule (``rules.py``)
is checked here against plain Gluon, outputs and gradients, in every policy,
training and inference, and by counters: one launch per signature. The kinds
the rules leave out keep one launch per call: ``prelu`` (a slope per
channel) and ``rrelu`` (random slopes), ``repeat`` without an axis."""
import numpy as np
import pytest
from mxnet import autograd, gluon, nd

from harness import assert_same, run
from heldout import initialized, launches_by_name, square_loss

POLICIES = ["depth", "agenda", "sequential", "auto"]
LENGTHS = (3, 5, 3, 1, 4, 5, 3, 2)


class Between(gluon.Block):
    """Per sample: rows ``(T, 4)`` and a single row ``(1, 4)`` from Dense
    blocks, the operators under test between them, reduced to ``(1, 2)``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.rows = gluon.nn.Dense(4, in_units=3, flatten=False)
            self.row = gluon.nn.Dense(4, in_units=3)
            self.out = gluon.nn.Dense(2, in_units=4)

    def forward(self, x):  # pylint: disable=arguments-differ
        h = self.rows(x)                                              # (T, 4)
        q = self.row(nd.mean(x, axis=0, keepdims=True))               # (1, 4)
        a = nd.LeakyReLU(h, slope=0.2) + nd.LeakyReLU(h, act_type="elu", slope=0.7) + \
            nd.LeakyReLU(h, act_type="selu") + nd.LeakyReLU(h, act_type="gelu")
        b = nd.broadcast_to(q, shape=(3, 4)) * nd.broadcast_axis(q, axis=0, size=3)   # (3, 4)
        c = nd.broadcast_like(nd.sum(h, axis=1, keepdims=True), h) * \
            nd.broadcast_like(q, b, lhs_axes=(0,), rhs_axes=(0,))[:1]                 # (T, 4)
        r = nd.repeat(q, repeats=2, axis=1) + nd.repeat(q, repeats=2, axis=0).reshape((1, 8))
        s = nd.swapaxes(h.expand_dims(2), 1, 2)                                       # (T, 1, 4)
        n = nd.L2Normalization(a) + nd.L2Normalization(s, mode="channel").reshape((-1, 4))
        mean, var = nd.moments(c, axes=(1,), keepdims=True)                           # (T, 1)
        g = nd.linalg_gemm2(b, h, transpose_b=True, alpha=0.5)                        # (3, T)
        total = nd.sum(n * mean + var, axis=0, keepdims=True) + nd.sum(r, axis=1, keepdims=True) \
            + nd.sum(g) + nd.mean(b, axis=0, keepdims=True) + \
            nd.sum(nd.repeat(h, repeats=2, axis=1) * nd.tile(h, (1, 2)), axis=0, keepdims=True)[:, 2:6]
        return self.out(total)


def _samples(seed, lengths=LENGTHS):
    rng = np.random.default_rng(seed)
    return [nd.array(rng.normal(size=(t, 3))) for t in lengths]


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_operators_between_blocks_equal_plain_gluon(policy, train):
    samples = _samples(0)
    ref = run(initialized(Between(prefix="between_")), square_loss, samples, train, flag=False)
    got = run(initialized(Between(prefix="between_")), square_loss, samples, train, flag=True,
              policy=policy)
    assert_same(ref, got)


def test_one_launch_per_signature():
    """Counters: eight samples of five lengths. The operators on the single
    rows (and everything of one signature) run in one launch; those on the
    rows ``(T, 4)`` in one launch per length (their shapes hold ``T``), except
    the row-wise ``LeakyReLU``, ``L2Normalization``, and ``moments`` and
    ``repeat`` along axis 1, which run on all the
    samples' rows at once (two launches: the one-row sample apart)."""
    net = initialized(Between(prefix="between_"))
    net.hybridize(dynamic_batch=True, policy="depth")
    samples = _samples(1)
    seen = launches_by_name(lambda: nd.concat(*[net(x) for x in samples], dim=0).asnumpy())
    lengths = len(set(LENGTHS))
    assert seen.get("LeakyReLU") == 4 * 2, seen
    assert seen.get("broadcast_to") == 1 and seen.get("broadcast_axis") == 1, seen
    # repeat along axis 1: the single rows' launch (the one-row sample's rows
    # share its signature) and the rows'; along axis 0: one
    assert seen.get("repeat") == 3, seen
    assert seen.get("broadcast_like") == 1 + lengths, seen
    assert seen.get("SwapAxis") == lengths, seen
    assert seen.get("L2Normalization") == 2 * 2, seen
    assert seen.get("moments") == 2 and seen.get("_linalg_gemm2") == lengths, seen
    net.hybridize(active=False)


class Leftout(gluon.Block):
    """The kinds without a rule: a ``prelu`` slope per channel, ``repeat``
    with no axis (it flattens)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.row = gluon.nn.Dense(4, in_units=3)
            self.gamma = self.params.get("gamma", shape=(4,), init="ones")

    def forward(self, x):  # pylint: disable=arguments-differ
        q = self.row(x)                                               # (1, 4)
        p = nd.LeakyReLU(q, gamma=self.gamma.data() * 0.25, act_type="prelu")
        return nd.sum(p) + nd.sum(nd.repeat(q, repeats=2))


@pytest.mark.parametrize("train", [False, True])
def test_kinds_without_a_rule_run_per_call(train):
    samples = _samples(2, lengths=(1,) * 6)
    ref = run(initialized(Leftout(prefix="left_")), square_loss, samples, train, flag=False)
    got = run(initialized(Leftout(prefix="left_")), square_loss, samples, train, flag=True,
              policy="depth")
    assert_same(ref, got)
    net = initialized(Leftout(prefix="left_"))
    net.hybridize(dynamic_batch=True, policy="depth")
    seen = launches_by_name(lambda: nd.concat(*[net(x) for x in samples], dim=0).asnumpy())
    assert seen.get("LeakyReLU") == 6 and seen.get("repeat") == 6, seen
    net.hybridize(active=False)
