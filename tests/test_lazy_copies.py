"""``astype``, ``copy``, ``detach`` and indexing with an NDArray on lazy arrays:
recorded as operators (they merge), with MXNet's semantics kept: a copy is
its own memory, ``detach`` outside autograd is a view of the same rows (an
in-place write shows through both), inside autograd it passes no gradient;
advanced indexing wraps negative indices and refuses out-of-range ones.

The oracle is plain per-sample Gluon on the same parameters and inputs
(outputs and gradients); counters check that nothing forces a flush."""
import numpy as np
import pytest
from mxnet import autograd, gluon, nd
from mxnet.gluon import nn

import jitbatch
from harness import assert_same, run
from heldout import (dense_behind_a_stop, initialized, nothing_pending, rng_for,  # noqa: F401
                     run_in_subprocess)

POLICIES = ["auto", "depth", "agenda", "sequential"]
TRAIN = pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])


class Use(gluon.Block):
    """A Dense, ``use(self, h)`` on its lazy output, then a second Dense."""

    def __init__(self, use, **kw):
        super(Use, self).__init__(**kw)
        self.use = use
        with self.name_scope():
            self.enc = nn.Dense(3, in_units=3)
            self.head = nn.Dense(2, in_units=3)

    def forward(self, x):
        return self.use(self, self.enc(x))


def astype_round_trip(n, h):
    return n.head(h.astype("float64").astype("float32", copy=False) * 2)


def astype_same_dtype_no_copy(n, h):
    same = h.astype("float32", copy=False)
    assert same is h
    return n.head(same)


def astype_to_int_and_back(n, h):
    return n.head((h * 3).astype("int32").astype("float32") + h)


def copy_then_use_both(n, h):
    return n.head(h.copy() * 2 + h)


def detach_half(n, h):
    return n.head(h.detach() + h)


def index_with_an_ndarray(n, h):
    return n.head(h[nd.array([h.shape[0] - 1] + [0] * (h.shape[0] - 1))])


def index_with_a_negative_float_ndarray(n, h):
    # (inference only: MXNet 1.9.1's gradient of gather_nd writes a negative
    # index's row out of bounds, in plain Gluon too: heap corruption)
    if autograd.is_recording():
        return n.head(h)
    return n.head(h[nd.array([-1.0] * h.shape[0])] + h)


def index_with_a_2d_ndarray(n, h):
    rows = h[nd.array([[0] * h.shape[0], [h.shape[0] - 1] * h.shape[0]])]   # (2, R, 3)
    return n.head(rows[0] * rows[1])


def index_with_a_lazy_index(n, h):
    # the index computed by the sample's own graph: the row of its largest entry
    first = nd.argmax(nd.sum(h, axis=1), axis=0)
    return n.head(h[nd.stack(*[first] * h.shape[0]).reshape((-1,))])


USES = [astype_round_trip, astype_same_dtype_no_copy, astype_to_int_and_back,
        copy_then_use_both, detach_half, index_with_an_ndarray,
        index_with_a_negative_float_ndarray, index_with_a_2d_ndarray, index_with_a_lazy_index]


def ragged(rng, n):
    return [nd.array(rng.normal(size=(int(rng.integers(1, 4)), 3))) for _ in range(n)]


def apply(net, x):
    y = net(x)
    return y, nd.sum(y * y)


@pytest.mark.parametrize("mapped", [False, True], ids=["loop", "map"])
@pytest.mark.parametrize("policy", POLICIES)
@TRAIN
@pytest.mark.parametrize("use", USES, ids=lambda f: f.__name__)
def test_same_values_and_gradients_as_plain_gluon(use, train, policy, mapped):
    net = initialized(Use(use))
    samples = ragged(rng_for("copies", use.__name__, train, policy), 6)
    ref = run(net, apply, samples, train, flag=False)
    got = run(net, apply, samples, train, flag=True, policy=policy, mapped=mapped)
    assert_same(ref, got)


@pytest.mark.parametrize("use", [u for u in USES if u is not index_with_a_lazy_index],
                         ids=lambda f: f.__name__)
def test_one_flush_for_the_minibatch(use):
    """None of them runs the pending graph: the loop's samples flush once, at
    the first read, and the Dense calls merge (before 2026-11-27 each sample's
    astype / copy / detach / index ran its graph: a flush per sample)."""
    net = initialized(Use(use))
    samples = ragged(rng_for("copies-flush", use.__name__), 6)
    net.hybridize(dynamic_batch=True, policy="depth")
    jitbatch.reset_stats()
    try:
        [y.asnumpy() for y in [net(x) for x in samples]]
    finally:
        net.hybridize(active=False)
    st = jitbatch.stats()
    assert st["flushes"] == 1 and st["launches"] < st["nodes"], st


def _flagged_dense():
    net = initialized(nn.Dense(3, in_units=3))
    net.hybridize(dynamic_batch=True)
    return net


def test_a_copy_is_its_own_memory():
    net = _flagged_dense()
    x = nd.array(np.arange(6).reshape(2, 3))
    h = net(x)
    c = h.copy()
    c[:] = 7
    np.testing.assert_allclose(h.asnumpy(), net(x).asnumpy())
    assert (c.asnumpy() == 7).all()


def test_a_write_through_a_detached_array_shows_in_the_original():
    """MXNet's ``detach`` shares memory: outside autograd the lazy one is a view
    of the same rows, so the write shows through both as in plain Gluon."""
    net = initialized(nn.Dense(3, in_units=3))
    x = nd.array(np.arange(6).reshape(2, 3))
    want_h = net(x)
    want_d = want_h.detach()
    want_d[0:1] = 5
    net.hybridize(dynamic_batch=True)
    try:
        h = net(x)
        d = h.detach()
        d[0:1] = 5
        np.testing.assert_allclose(h.asnumpy(), want_h.asnumpy())
        np.testing.assert_allclose(d.asnumpy(), want_d.asnumpy())
    finally:
        net.hybridize(active=False)


def test_detach_inside_autograd_passes_no_gradient():
    net = initialized(nn.Dense(3, in_units=3))
    x = nd.array(np.arange(6).reshape(2, 3))
    grads = []
    for flag in (False, True):
        if flag:
            net.hybridize(dynamic_batch=True)
        net.weight.zero_grad()
        with autograd.record():
            h = net(x)
            loss = nd.sum(h * h.detach())
        loss.backward()
        grads.append(net.weight.grad().asnumpy().copy())
        net.hybridize(active=False)
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-5)


def test_out_of_range_index_raises_as_in_plain_gluon_then_the_next_batch_is_right():
    net = _flagged_dense()
    x = nd.array(np.arange(6).reshape(2, 3))
    h = net(x)
    with pytest.raises(Exception, match="out of bounds"):
        h[nd.array([5])].asnumpy()
    want = nn.Dense(3, in_units=3)
    want.initialize()
    for p, q in zip(want.collect_params().values(), net.collect_params().values()):
        p.set_data(q.data())
    np.testing.assert_allclose(net(x)[nd.array([1, -2])].asnumpy(),
                               want(x)[nd.array([1, -2])].asnumpy(), rtol=1e-6)
    net.hybridize(active=False)


def test_indexing_a_concrete_array_with_a_lazy_index():
    """MXNet's own advanced indexing of a concrete array keeps only exact
    NDArrays as indices: a lazy index is computed first."""
    net = _flagged_dense()
    table = nd.array(np.arange(12).reshape(4, 3))
    ids = nd.argmax(net(nd.array(np.arange(6).reshape(2, 3))), axis=1)
    got = table[ids].asnumpy()
    net.hybridize(active=False)
    want = table[nd.argmax(net(nd.array(np.arange(6).reshape(2, 3))), axis=1)].asnumpy()
    np.testing.assert_allclose(got, want)


def test_detach_beside_a_dense_in_backward():
    """``.detach()`` under autograd is a recorded BlockGrad: where a Dense
    reaches the loss only through it, MXNet 1.9.1 segfaults in backward() on
    a BlockGrad of gathered rows (tests/test_heldout12.py,
    test_a_dense_reaching_the_loss_only_through_blockgrad); jitbatch runs such
    launches outside autograd, so the program gives plain Gluon's numbers."""
    rc, out, err = run_in_subprocess(dense_behind_a_stop("v.detach()"))
    assert rc == 0 and "same" in out, (rc, out, err[-2000:])
