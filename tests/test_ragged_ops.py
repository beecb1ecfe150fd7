"""Row-wise operators on per-sample sequences merge whatever each sample's length.

A user embeds a sample's tokens, ``(T, E)`` with its own ``T``, and applies
operators to the rows: ``nd.tanh(emb)``, ``emb * gate``, ``emb.expand_dims(1)``
(a fused RNN layer's ``(T, 1, E)``). Until 2026-11-27 each such call's
signature held ``T``: calls merged only between samples of one length (the
zoo's ``fused_gru``: one ``expand_dims`` launch per distinct length, 37 per
minibatch). An operator whose arguments all share their leading length, and
whose rule maps rows to rows whatever their number (``opkeys.rowwise``), now
has a *ragged* signature: its launch runs it on every sample's rows at once.
Operators that mix a sample's rows (``softmax`` over axis 0, ``sum`` over
axis 0, a transpose, an ``expand_dims`` at axis 0, a ``Reshape`` whose target
counts the rows) keep their exact signatures, one launch per length."""
import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

import jitbatch
from jitbatch.stats import STATS

from harness import assert_same, run
from heldout import initialized, launches_by_name

POLICIES = ["depth", "agenda", "sequential", "auto"]
LENGTHS = [3, 7, 4, 3, 9, 2, 5, 7, 1, 6]


class Rows(gluon.Block):
    """Per sample: token embeddings ``(T, E)``, a chain of row-wise operators
    on them, then the sample's mean row through a Dense head."""

    def __init__(self, mixing=None, **kwargs):
        super().__init__(**kwargs)
        self.mixing = mixing
        with self.name_scope():
            self.embed = gluon.nn.Embedding(30, 6)
            self.gate = gluon.nn.Dense(6, in_units=6, flatten=False)
            self.head = gluon.nn.Dense(3, in_units=6)

    def forward(self, ids):  # pylint: disable=arguments-differ
        emb = self.embed(ids)                                  # (T, 6)
        g = nd.sigmoid(self.gate(emb))                         # (T, 6)
        h = nd.tanh(emb) * g + nd.relu(emb - 0.1)              # elementwise, same shapes
        h = nd.clip(h, -0.9, 0.9)
        e = h.expand_dims(axis=1)                              # (T, 1, 6)
        e = nd.batch_dot(e, e, transpose_b=True)               # (T, 1, 1)
        h = h * e.flatten()                                    # (T, 6) * (T, 1): broadcast
        h = nd.where(h > 0, h, h * 0.5) + nd.one_hot(ids, 6)   # where, one_hot of (T,)
        h = h / ids.shape[0]                                   # each sample its own scalar
        if self.mixing == "softmax0":
            h = nd.softmax(h, axis=0)                          # mixes the sample's rows
        elif self.mixing == "transpose":
            h = h.T.T
        elif self.mixing == "expand0":
            h = h.expand_dims(axis=0)[0]
        elif self.mixing == "reshape":
            h = h.reshape((-1, 3)).reshape((-1, 6))            # targets count the rows
        elif self.mixing == "along_rows":
            # row by row, along other axes than 0
            h = nd.log_softmax(h, axis=-1) + nd.softmax(h, axis=1)
            h = h + nd.sum(h, axis=1, keepdims=True) * nd.max(h, axis=-1, keepdims=True)
            e = nd.transpose(h.expand_dims(axis=2), axes=(0, 2, 1))      # (T, 1, 6)
            h = nd.concat(e[:, :, 0:3], nd.flip(e, axis=2)[:, :, 3:], dim=2).flatten()
            h = nd.slice_axis(h, axis=1, begin=0, end=6) * nd.sort(h, axis=1)
        elif self.mixing == "indexing":
            # NumPy-style basic indexing of columns, as users split gates
            h = nd.concat(h[:, 3:], h[:, :3], dim=1) + h[:, -1:] * h[:, 0].expand_dims(1)
            e = h.expand_dims(axis=1)                                     # (T, 1, 6)
            h = h + e[:, 0, ::2].tile((1, 2)) - e[:, :, 1:3].flatten().tile((1, 3))
        elif self.mixing == "reshape_rows":
            # reshapes keeping each row's own values: the rows kept (code 0 or
            # a count that resolves to T), the other axes re-viewed
            a = h.reshape((0, 2, 3)) + h.reshape((-1, 2, 3)) * nd.reshape(h, shape=(0, 2, -1))
            h = a.reshape((-1, 6)) + nd.reshape(a, shape=(0, -3)) + a.reshape(0, -1)
        elif self.mixing == "stack_rows":
            # stacks of a sample's sequences along a new axis other than 0
            h = nd.stack(h, h * 0.5, axis=1).sum(axis=1) + nd.stack(h, -h, h, axis=-1).max(axis=2)
        elif self.mixing == "single_rows":
            # the sample's own single rows against its rows: a query, a gate
            q = nd.tanh(self.head(nd.mean(h, axis=0, keepdims=True)))        # (1, 3)
            q = nd.concat(q, q, dim=1)                                       # (1, 6)
            h = nd.broadcast_mul(h, q) + nd.broadcast_maximum(q * 0.5, h) - q
            s = nd.sum(h * q, axis=1, keepdims=True)                         # (T, 1)
            h = h * nd.softmax(s, axis=0)
        elif self.mixing == "pools":
            # each sample's rows reduced (segment reductions): sum, max, min, prod
            p = nd.sum(h, axis=0, keepdims=True) + nd.max(h, axis=0, keepdims=True) - \
                nd.min(h, axis=(0,), keepdims=True) + nd.prod(1.0 + 0.1 * h, axis=0)
            return self.head(p + nd.mean(h, axis=0))
        return self.head(nd.mean(h, axis=0, keepdims=True))


def _samples(seed, lengths=LENGTHS):
    rng = np.random.default_rng(seed)
    return [nd.array(rng.integers(0, 30, size=(t,))) for t in lengths]


def _apply(net, ids):
    out = net(ids)
    return out, nd.sum(out * out)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("mixing", [None, "softmax0", "transpose", "expand0", "reshape",
                                    "along_rows", "pools", "single_rows", "indexing",
                                    "reshape_rows", "stack_rows"])
@pytest.mark.parametrize("policy", POLICIES)
def test_row_operators_on_sequences_of_any_length_equal_plain_gluon(policy, mixing, train):
    samples = _samples(0)
    ref = run(initialized(Rows(mixing, prefix="rows_")), _apply, samples, train, flag=False)
    got = run(initialized(Rows(mixing, prefix="rows_")), _apply, samples, train, flag=True,
              policy=policy)
    assert_same(ref, got)


def _launches_by_name(net, samples):
    """Launches per signature name of one flush of ``samples``' calls."""
    return launches_by_name(lambda: nd.concat(*[net(ids) for ids in samples], dim=0).asnumpy())


@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_one_launch_per_row_operator_whatever_the_lengths(policy):
    """Counters: ten samples of nine lengths (one of them a single row). Each
    row-wise operator runs in two launches: one ragged launch for the nine
    samples of two rows or more, one for the single-row sample (a call of one
    row keeps its exact signature); under the old signatures each ran in one
    launch per distinct length (9)."""
    net = initialized(Rows(prefix="rows_"))
    net.hybridize(dynamic_batch=True, policy=policy)
    seen = _launches_by_name(net, _samples(1))
    for name in ("sigmoid", "tanh", "relu", "clip", "expand_dims", "batch_dot", "Flatten",
                 "_greater_scalar", "where"):
        assert seen.get(name) == 2, (name, seen)
    # two signatures each: broadcast_mul of equal shapes and of (T, 6) by (T, 1),
    # broadcast_add of the two sums; the lifted scalars of emb - 0.1 and h * 0.5
    # (one_hot of the concrete ids runs at its call, on no lazy argument)
    assert seen.get("broadcast_mul") == 4 and seen.get("broadcast_add") == 4, seen
    assert seen.get("_minus_scalar") == 2 and seen.get("_mul_scalar") == 2, seen
    assert seen.get("_div_scalar") == 2, seen
    net.hybridize(active=False)


@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_operators_along_other_axes_and_pools_merge_whatever_the_lengths(policy):
    """Counters: operators acting along axes other than 0 (softmax, sums and
    maxima per row, a transpose keeping axis 0, slices of columns, concat,
    flip, sort) and reductions of each sample's rows over axis 0 (sum, max,
    min, prod, mean) run in two launches each (the single-row sample apart),
    not one per length."""
    for mixing, names in (("along_rows", ("log_softmax", "softmax", "transpose", "reverse",
                                          "Concat", "sort", "slice_axis")),
                          ("pools", ("max", "min", "prod", "mean"))):
        net = initialized(Rows(mixing, prefix="rows_"))
        net.hybridize(dynamic_batch=True, policy=policy)
        seen = _launches_by_name(net, _samples(1))
        for name in names:
            assert seen.get(name) == 2, (mixing, name, seen)
        # sum: per row (along_rows) or the pool's, with the final mean's own
        assert seen.get("sum") == 2, (mixing, seen)
        net.hybridize(active=False)


@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_basic_indexing_of_columns_merges_whatever_the_lengths(policy):
    """Counters: ``h[:, 3:]``, ``h[:, 0]``, ``e[:, 0, ::2]`` on each sample's
    rows name the whole of axis 0 without its length (and drop an indexed
    axis by a squeeze, not a reshape to the kept lengths), so each runs in two
    launches (the single-row sample apart); one per length before (9)."""
    net = initialized(Rows("indexing", prefix="rows_"))
    net.hybridize(dynamic_batch=True, policy=policy)
    seen = _launches_by_name(net, _samples(1))
    # six slices, two of them followed by a squeeze (h[:, 0], e[:, 0, ::2])
    assert seen.get("slice") == 12 and seen.get("squeeze") == 4, seen
    assert seen.get("tile") == 4, seen
    net.hybridize(active=False)


@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_reshapes_keeping_the_rows_merge_whatever_the_lengths(policy):
    """Counters: a ``Reshape`` whose target copies axis 0 (code 0; a lazy
    array's ``reshape`` writes a target that resolves to the rows that way)
    runs in two launches per target (the single-row sample apart), one per
    length before (9). A target counting other rows (``(-1, 3)`` of ``(T,
    6)``) keeps one launch per length."""
    net = initialized(Rows("reshape_rows", prefix="rows_"))
    net.hybridize(dynamic_batch=True, policy=policy)
    seen = _launches_by_name(net, _samples(1))
    # targets (0, 2, 3) (written so and resolved from (-1, 2, 3)), (0, 2, -1),
    # (0, 6) (from (-1, 6) and (0, -1)), (0, -3); the one-row sample's six
    # (its targets as written, codes resolved: one row keeps exact signatures)
    assert seen.get("Reshape") == 4 + 6, seen
    net = initialized(Rows("reshape", prefix="rows_"))
    net.hybridize(dynamic_batch=True, policy=policy)
    seen = _launches_by_name(net, _samples(1))
    assert seen.get("Reshape") == 2 * len(set(LENGTHS)), seen
    net.hybridize(active=False)


@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_stacks_along_other_axes_merge_whatever_the_lengths(policy):
    """Counters: ``nd.stack`` of a sample's sequences along axis 1 or -1 (its
    axis counted in the output's rank) runs in one launch per stack for every
    length, one per length before; the one-row sample's stack along axis 1
    is a composite of its rows (no launch), its stack along -1 a launch of
    its own."""
    net = initialized(Rows("stack_rows", prefix="rows_"))
    net.hybridize(dynamic_batch=True, policy=policy)
    seen = _launches_by_name(net, _samples(1))
    assert seen.get("stack") == 2 + 1, seen
    net.hybridize(active=False)


@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_single_rows_against_a_samples_rows_merge_whatever_the_lengths(policy):
    """Counters: a broadcast between each sample's rows ``(T, 6)`` and a
    single row of the same sample ``(1, 6)`` (a query, a gate) runs in two
    launches (the single-row sample apart), its single rows repeated per row
    of their sample; one launch per length before."""
    net = initialized(Rows("single_rows", prefix="rows_"))
    net.hybridize(dynamic_batch=True, policy=policy)
    seen = _launches_by_name(net, _samples(1))
    # (each used once per sample, at one depth)
    assert seen.get("broadcast_maximum") == 2 and seen.get("broadcast_sub") == 2, seen
    net.hybridize(active=False)


@pytest.mark.parametrize("mixing", ["transpose", "expand0"])
def test_operators_mixing_a_samples_rows_keep_one_launch_per_length(mixing):
    """Counters: the mixing operator runs once per distinct length (9), as before."""
    net = initialized(Rows(mixing, prefix="rows_"))
    net.hybridize(dynamic_batch=True, policy="depth")
    seen = _launches_by_name(net, _samples(1))
    name = {"transpose": "transpose", "expand0": "expand_dims"}[mixing]
    lengths = len(set(LENGTHS))
    # h.T.T: two transposes; expand_dims at axis 0 beside the row-wise one at axis 1
    want = {"transpose": 2 * lengths, "expand0": lengths + 2}[mixing]
    assert seen.get(name) == want, (name, want, seen)


@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_softmax_over_each_samples_rows_merges_whatever_the_lengths(policy):
    """Counters: a softmax over axis 0 of each sample's rows (attention weights
    over its tokens) runs as a segment launch: two launches (the single-row
    sample apart), one per length before (9)."""
    net = initialized(Rows("softmax0", prefix="rows_"))
    net.hybridize(dynamic_batch=True, policy=policy)
    seen = _launches_by_name(net, _samples(1))
    assert seen.get("softmax") == 2, seen
    net.hybridize(active=False)


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_softmax_over_each_samples_rows_bit_for_bit(op):
    """The rows padded at the front with -inf: the maximum is the rows', the
    pads add exp(-inf) = 0 to the sum first; each sample's outputs equal its
    per-sample ones bit for bit, inf, NaN and -0.0 in the rows included, and
    with a temperature."""
    rng = np.random.default_rng(4)
    xs = []
    for i, t in enumerate(LENGTHS[:-1] + [2, 11, 4]):
        a = (rng.normal(size=(t, 3)) * 3).astype(np.float32)
        if i % 3 == 0:
            a[-1, :3] = [np.inf, -np.inf, np.nan]
        if i % 4 == 1:
            a[0, :] = -0.0
        if i % 5 == 2:
            a[:, 1] = -np.inf
        xs.append(a)

    class Ident(gluon.HybridBlock):
        def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
            return F.identity(x)
    flagged = Ident()
    flagged.hybridize(dynamic_batch=True, policy="depth")
    fn = getattr(nd, op)
    for kw in ({"axis": 0}, {"axis": -2, "temperature": 2.5}):
        want = [fn(nd.array(a), **kw).asnumpy() for a in xs]
        STATS.reset()
        got = [fn(flagged(nd.array(a)), **kw) for a in xs]
        got = [g.asnumpy() for g in got]
        assert jitbatch.stats()["launches"] == 4, jitbatch.stats()["launches"]
        for i, (a, b) in enumerate(zip(want, got)):
            np.testing.assert_array_equal(b, a, err_msg="sample %d %s" % (i, kw))
            assert (np.signbit(a) == np.signbit(b)).all(), i


def test_ragged_launch_outputs_are_the_per_sample_rows_bit_for_bit():
    """Elementwise operators on the merged rows: each sample's rows of the
    launch are its per-sample result exactly (NaN, inf and -0.0 included)."""
    rng = np.random.default_rng(2)
    xs = []
    for t in LENGTHS:
        a = rng.normal(size=(t, 4)).astype(np.float32) * 5
        if t > 2:
            a[1, :3] = [np.nan, np.inf, -0.0]
        xs.append(a)

    class Ident(gluon.HybridBlock):
        def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
            return F.identity(x)
    flagged = Ident()
    flagged.hybridize(dynamic_batch=True, policy="depth")

    def ops(y):
        return nd.sqrt(nd.abs(y)) * nd.sign(y) + nd.exp(nd.clip(y, -3, 3)) - y * y
    want = [ops(nd.array(a)).asnumpy() for a in xs]
    got = [ops(flagged(nd.array(a))) for a in xs]
    got = [g.asnumpy() for g in got]
    for i, (a, b) in enumerate(zip(want, got)):
        np.testing.assert_array_equal(b, a, err_msg="sample %d" % i)
        assert (np.signbit(a) == np.signbit(b)).all(), i
    assert jitbatch.stats()["launches"] >= 1


@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "min", "prod", "nansum", "nanprod"])
def test_pools_of_each_samples_rows_are_the_per_sample_values_bit_for_bit(reduce):
    """A reduction over axis 0 of each sample's rows, merged: the rows laid
    out padded at the front, where a pad leaves the running state as it
    starts. Exact with inf, NaN and -0.0 in the rows; padded after them,
    ``nansum`` was not (its compensated sum turns inf - inf into NaN; checked
    2026-11-27 by moving the pads)."""
    rng = np.random.default_rng(3)
    xs = []
    for i, t in enumerate(LENGTHS[:-1] + [2, 11, 4]):
        a = (rng.normal(size=(t, 5)) * 3).astype(np.float32)
        if i % 3 == 0:
            a[-1, :4] = [np.inf, -np.inf, np.nan, -0.0]
        if i % 4 == 1:
            a[:, 4] = -0.0
        xs.append(a)

    class Ident(gluon.HybridBlock):
        def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
            return F.identity(x)
    flagged = Ident()
    flagged.hybridize(dynamic_batch=True, policy="depth")
    fn = getattr(nd, reduce)
    want = [fn(nd.array(a), axis=0, keepdims=True).asnumpy() for a in xs]
    STATS.reset()
    got = [fn(flagged(nd.array(a)), axis=0, keepdims=True) for a in xs]
    got = [g.asnumpy() for g in got]
    # the identity and the pool, each once for the samples of two rows or more
    # and once for the single-row sample
    assert jitbatch.stats()["launches"] == 4, jitbatch.stats()["launches"]
    for i, (a, b) in enumerate(zip(want, got)):
        np.testing.assert_array_equal(b, a, err_msg="sample %d" % i)
        assert (np.signbit(a) == np.signbit(b)).all(), i


@pytest.mark.parametrize("op", ["max", "mean", "softmax"])
@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_two_recordings_alive_then_two_backwards(policy, op):
    """Two minibatches recorded (their losses read) before either backward,
    each with a pool or softmax over each sample's rows. Until fixed the same
    day the second backward raised (``NotDifferentiableError``: MXNet found an
    autograd entry cleared): both launches read the segment's cached pad row,
    recording gave that one array an autograd entry, and the first backward,
    freeing its graph, cleared it. Each launch now reads the pad row through a
    view of its own. Found by ``test_heldout52`` (two threads at once)."""
    def make():
        mx.random.seed(0)
        d = gluon.nn.Dense(6, in_units=3, flatten=False)
        d.initialize(mx.init.Uniform(0.5))
        return d

    def pool(h):
        if op == "softmax":
            return nd.sum(nd.softmax(h, axis=0) * h)
        return nd.sum(getattr(nd, op)(h, axis=0))

    def program(d, flagged):
        if flagged:
            d.hybridize(dynamic_batch=True, policy=policy)
        rng = np.random.default_rng(5)
        batches = [[nd.array(rng.normal(size=(t, 3))) for t in ts]
                   for ts in ((3, 4, 2), (5, 2, 3))]
        losses = []
        for batch in batches:
            with autograd.record():
                losses.append(nd.add_n(*[pool(d(x)) for x in batch]))
            losses[-1].asnumpy()
        out = []
        for loss in losses:
            loss.backward()
            out.append(d.weight.grad().asnumpy().copy())
        d.hybridize(active=False)
        return out
    want = program(make(), False)
    got = program(make(), True)
    for a, b in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
