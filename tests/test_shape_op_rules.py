"""Shape and sequence operators users call between blocks merge:
``reshape_like``, ``slice_like``, ``Pad``, ``SequenceMask`` and
``SequenceLast`` along axis 1, ``diag`` of a matrix, and ``nd.reshape`` with a
target that counts a sequence's rows.

Until 2026-11-27 the first five had no batching rule (one launch per call),
and ``nd.reshape(h, shape=(T, 2, -1))`` on a ``(T, 8)`` sequence, called as
an operator, ran one launch per length ``T`` (its target holds ``T``; the
lazy array's own ``.reshape`` already copied axis 0). Each is checked here
against plain Gluon, outputs and gradients, in every policy, training and
inference, and by counters. Along axis 0 (time-major, their default)
``SequenceMask`` / ``SequenceLast`` merge where a sample holds one sequence
``(T, 1, ...)``; the forms without a batched equivalent keep one launch per
call: time-major with several sequences per sample (merging would lengthen
the sequences) and ``diag`` of a vector."""
import numpy as np
import pytest
from mxnet import gluon, nd

from harness import assert_same, run
from heldout import initialized, launches_by_name, square_loss

POLICIES = ["depth", "agenda", "sequential", "auto"]
LENGTHS = (3, 5, 3, 1, 4, 5, 3, 2)


class ShapeOps(gluon.Block):
    """Per sample: rows ``(T, 8)`` and a single row ``(1, 8)`` from Dense
    blocks, the shape operators under test between them, reduced to ``(1, 2)``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.rows = gluon.nn.Dense(8, in_units=3, flatten=False)
            self.row = gluon.nn.Dense(8, in_units=3)
            self.out = gluon.nn.Dense(2, in_units=4)

    def forward(self, x):  # pylint: disable=arguments-differ
        t = x.shape[0]
        h = self.rows(x)                                              # (T, 8)
        q = self.row(nd.mean(x, axis=0, keepdims=True))               # (1, 8)
        grid = nd.reshape_like(q, nd.zeros((2, 4)))                   # (2, 4)
        sq = nd.reshape_like(q, grid, lhs_begin=1, rhs_begin=0)       # (1, 2, 4)
        sq = sq + nd.reshape_like(grid, q.reshape((1, 1, 8)), lhs_begin=-2, lhs_end=None,
                                  rhs_begin=1, rhs_end=None).reshape((1, 2, 4))
        cut = nd.slice_like(grid, nd.zeros((2, 3))) + nd.slice_like(
            grid, nd.zeros((1, 3)), axes=(-1,))                       # (2, 3)
        img = nd.Pad(sq.expand_dims(0), mode="constant", constant_value=0.5,
                     pad_width=(0, 0, 0, 0, 1, 1, 0, 2)) + \
            nd.Pad(sq.expand_dims(0), mode="edge", pad_width=(0, 0, 0, 0, 1, 1, 0, 2)) + \
            nd.Pad(sq.expand_dims(0), mode="reflect", pad_width=(0, 0, 0, 0, 1, 1, 2, 0))
        seq = h.expand_dims(0)                                        # (1, T, 8)
        length = nd.array([max(1, t - 1)])
        masked = nd.SequenceMask(seq, length, use_sequence_length=True, axis=1, value=-2.0)
        last = nd.SequenceLast(seq, length, use_sequence_length=True, axis=1)   # (1, 8)
        heads = nd.reshape(h, shape=(t, 2, -1)) + nd.reshape(h, shape=(-1, 2, 4))
        d = nd.diag(grid[:, :2]) + nd.diag(sq[0], k=1)                # (2,) + (2,)
        total = nd.sum(masked, axis=1) + last + nd.sum(heads, axis=0).reshape((1, 8)) + \
            nd.sum(img).reshape((1, 1)) + nd.sum(cut) + nd.sum(d)
        return self.out(total[:, :4] * total[:, 4:])


def _samples(seed, lengths=LENGTHS):
    rng = np.random.default_rng(seed)
    return [nd.array(rng.normal(size=(t, 3))) for t in lengths]


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_shape_operators_equal_plain_gluon(policy, train):
    samples = _samples(0)
    ref = run(initialized(ShapeOps(prefix="shapes_")), square_loss, samples, train, flag=False)
    got = run(initialized(ShapeOps(prefix="shapes_")), square_loss, samples, train, flag=True,
              policy=policy)
    assert_same(ref, got)


def test_one_launch_per_signature():
    """Counters: eight samples of five lengths (one of one row). The operators
    on the single rows run in one launch per signature; ``SequenceMask`` /
    ``SequenceLast`` on ``(1, T, 8)`` in one per length (``T`` is in the shape).
    The rows' ``Reshape`` to ``(T, 2, -1)`` and to ``(-1, 2, 4)``: until
    2026-11-27 one launch per length and target (11 in all with the sum's
    reshape to ``(1, 8)``), now 4: both targets read ``(0, 2, 4)`` on samples
    of two rows or more (one launch), the one-row sample's two as written, and
    the sum's."""
    net = initialized(ShapeOps(prefix="shapes_"))
    net.hybridize(dynamic_batch=True, policy="depth")
    samples = _samples(1)
    seen = launches_by_name(lambda: nd.concat(*[net(x) for x in samples], dim=0).asnumpy())
    assert seen.get("reshape_like") == 3, seen
    assert seen.get("slice_like") == 2, seen
    assert seen.get("Pad") == 3, seen
    assert seen.get("SequenceMask") == len(set(LENGTHS)), seen
    assert seen.get("SequenceLast") == len(set(LENGTHS)), seen
    assert seen.get("diag") == 2, seen
    assert _reshape_launches(samples) == 4, seen
    net.hybridize(active=False)


def _reshape_launches(samples):
    """Launches of the rows' ``Reshape`` to ``(T, 2, 4)`` alone: a net whose
    forward is just that, on the same samples."""

    class Heads(gluon.Block):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            with self.name_scope():
                self.rows = gluon.nn.Dense(8, in_units=3, flatten=False)

        def forward(self, x):  # pylint: disable=arguments-differ
            h = self.rows(x)
            return nd.sum(nd.reshape(h, shape=(x.shape[0], 2, -1)) +
                          nd.reshape(h, shape=(-1, 2, 4)), axis=0).reshape((1, 8))

    heads = initialized(Heads(prefix="heads_"))
    heads.hybridize(dynamic_batch=True, policy="depth")
    seen = launches_by_name(lambda: nd.concat(*[heads(x) for x in samples], dim=0).asnumpy())
    heads.hybridize(active=False)
    return seen.get("Reshape")


class AlongTime(gluon.Block):
    """``SequenceMask`` / ``SequenceLast`` along axis 0 (time-major, the
    default): of a sample's one sequence ``(T, 1, 4)`` (merged, viewed as
    ``(N, T, 4)`` along axis 1) and of two sequences ``(T, 2, 4)`` and
    ``diag`` of a vector (no batched form: one launch per call)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.rows = gluon.nn.Dense(4, in_units=3, flatten=False)

    def forward(self, x):  # pylint: disable=arguments-differ
        seq = self.rows(x).expand_dims(1)                             # (T, 1, 4)
        length = nd.array([2])
        masked = nd.SequenceMask(seq, length, use_sequence_length=True, value=1.0)
        last = nd.SequenceLast(seq, length, use_sequence_length=True)           # (1, 4)
        two = nd.concat(seq, seq * 2, dim=1)                          # (T, 2, 4)
        both = nd.SequenceMask(two, nd.array([1, 2]), use_sequence_length=True)
        return nd.sum(masked, axis=0) * last + nd.sum(nd.diag(last[0]), axis=0, keepdims=True) \
            + nd.sum(both, axis=(0, 1)).reshape((1, 4))


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_time_major_sequences_equal_plain_gluon(policy, train):
    samples = _samples(2, lengths=(3, 3, 2, 3, 4, 3))
    ref = run(initialized(AlongTime(prefix="time_")), square_loss, samples, train, flag=False)
    got = run(initialized(AlongTime(prefix="time_")), square_loss, samples, train, flag=True,
              policy=policy)
    assert_same(ref, got)


def test_time_major_launches():
    """Six samples of 3 rows: the one-sequence ``SequenceMask`` and
    ``SequenceLast`` merge (one launch each; until 2026-11-27 one per call),
    the two-sequence ``SequenceMask`` and ``diag`` of a vector stay per call
    (6 each)."""
    net = initialized(AlongTime(prefix="time_"))
    net.hybridize(dynamic_batch=True, policy="depth")
    samples = _samples(3, lengths=(3,) * 6)
    seen = launches_by_name(lambda: nd.concat(*[net(x) for x in samples], dim=0).asnumpy())
    assert seen.get("SequenceMask") == 1 + 6 and seen.get("SequenceLast") == 1, seen
    assert seen.get("diag") == 6, seen
    net.hybridize(active=False)
