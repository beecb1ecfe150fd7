"""``nd.tile`` of per-sample arrays merges: N calls are one ``tile``.

Users repeat a state or a gate along a new width (``h.tile((1, 2))``) or
repeat a sample's rows (``q.tile((T, 1))``). Until 2026-11-27 ``tile`` had no
batching rule: every call was a launch of its own. Its rule (``rules._tile``)
pads ``reps`` to the input's rank with leading 1s, as MXNet does, and adds 1
for the samples' axis; where ``reps`` has more entries than the input has
axes (new axes in front of the sample's rows) there is no rule. A tile that
keeps axis 0 (``reps[0] == 1`` or fewer reps than axes) also runs on the rows
of sequences of any length at once (``opkeys.rowwise``)."""
import numpy as np
import pytest
from mxnet import gluon, nd

from harness import assert_same, run
from heldout import initialized, launches_by_name, square_loss

POLICIES = ["depth", "agenda", "sequential", "auto"]
#: reps, and whether the calls share launches across lengths
REPS = [((1, 2), True), ((2,), True), ((3, 1), False), ((2, 3), False), ((1, 1), True),
        ((1, 2, 1), None)]


class Tiled(gluon.Block):
    """Per sample: rows ``(T, 3)`` through Dense, tiled by ``reps``, a single
    row tiled over the rows, and the whole reduced to ``(1, 2)``."""

    def __init__(self, reps, **kwargs):
        super().__init__(**kwargs)
        self.reps = reps
        with self.name_scope():
            self.rows = gluon.nn.Dense(3, in_units=3, flatten=False)
            self.out = gluon.nn.Dense(2, in_units=1)

    def forward(self, x):  # pylint: disable=arguments-differ
        h = nd.tanh(self.rows(x))                                # (T, 3)
        t = nd.tile(h, reps=self.reps)
        q = nd.mean(h, axis=0, keepdims=True).tile((x.shape[0], 1))   # (T, 3)
        s = nd.sum(t * t) + nd.sum(q * h)
        return self.out(s.reshape((1, 1)))


def _samples(seed, lengths=(3, 5, 3, 1, 4, 5, 3, 2, 4, 1)):
    rng = np.random.default_rng(seed)
    return [nd.array(rng.normal(size=(t, 3))) for t in lengths]


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("reps", [r for r, _ in REPS])
@pytest.mark.parametrize("policy", POLICIES)
def test_tiles_of_per_sample_arrays_equal_plain_gluon(policy, reps, train):
    samples = _samples(0)
    ref = run(initialized(Tiled(reps, prefix="tiled_")), square_loss, samples, train, flag=False)
    got = run(initialized(Tiled(reps, prefix="tiled_")), square_loss, samples, train, flag=True,
              policy=policy)
    assert_same(ref, got)


@pytest.mark.parametrize("reps, ragged", REPS)
def test_tile_launch_counts(reps, ragged):
    """Counters: ten samples of five lengths (two of one row). ``tile`` by
    ``reps`` runs in two launches where it keeps axis 0 (the one-row samples
    apart: a call of one row keeps its exact signature), in one launch per
    length where it repeats axis 0, and per call where ``reps`` has more
    entries than the rows have axes; the tile of each sample's mean row by
    its own length runs per length. Before the rule: one launch per call."""
    samples = _samples(1)
    net = initialized(Tiled(reps, prefix="tiled_"))
    net.hybridize(dynamic_batch=True, policy="depth")
    seen = launches_by_name(lambda: nd.concat(*[net(x) for x in samples], dim=0).asnumpy())
    lengths = len({x.shape[0] for x in samples})
    want = {True: 2, False: lengths, None: len(samples)}[ragged]
    assert seen.get("tile") == want + lengths, (reps, seen)
    net.hybridize(active=False)
