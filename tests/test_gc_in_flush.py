"""No finalizer runs inside a flush, not even in its first allocations.

A program's objects that hold lazy arrays (a tree's nodes, with parent links:
cyclic garbage) may log their values from ``__del__``, which the cyclic GC
runs at whatever allocation starts a collection. Inside a flush such a
finalizer would read a node the flush has taken and not yet computed
(``StaleValueError``, swallowed by Python: a value silently missing). The
GC is paused for the flush (``gcdefer.pause``); until 2026-11-27 the pause
came after ``Graph.take()``, whose own allocations could start a collection
(found by ``test_heldout30``'s GC-timing test failing on a fresh clone's run).
Here every allocation starts one (threshold 1) and the finalizers' garbage
is waiting when the read flushes."""
import gc

import numpy as np
import pytest
import mxnet as mx
from mxnet import gluon, nd

LOG = {}


class Held(object):
    """Holds a lazy array; a cycle through itself (freed by the cyclic GC)."""

    def __init__(self, key, value):
        self.key, self.value, self.me = key, value, self

    def __del__(self):
        LOG[self.key] = self.value.asnumpy().copy()


@pytest.mark.parametrize("policy", ["depth", "agenda", "sequential", "auto"])
def test_finalizers_waiting_when_a_read_flushes_read_computed_values(policy):
    mx.random.seed(0)
    net = gluon.nn.Dense(3, in_units=4)
    net.initialize()
    rng = np.random.default_rng(0)
    xs = [nd.array(rng.normal(size=(1, 4))) for _ in range(6)]
    want = [net(x).asnumpy() for x in xs]
    net.hybridize(dynamic_batch=True, policy=policy)
    LOG.clear()
    old = gc.get_threshold()
    gc.collect()
    gc.disable()
    try:
        outs = [net(x) for x in xs]
        for i, o in enumerate(outs[1:]):
            Held(i, o)                  # cyclic garbage from here on
        gc.enable()
        gc.set_threshold(1, 1, 1)
        first = outs[0].asnumpy()       # the read's flush allocates at once
    finally:
        gc.set_threshold(*old)
        gc.enable()
        gc.collect()
        net.hybridize(active=False)
    np.testing.assert_allclose(first, want[0], rtol=1e-6)
    assert sorted(LOG) == list(range(5)), sorted(LOG)
    for i in range(5):
        np.testing.assert_allclose(LOG[i], want[i + 1], rtol=1e-6)
