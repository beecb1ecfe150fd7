"""``nd.zeros`` / ``nd.ones`` while a graph is pending (jitbatch/gluon/fills.py):
MXNet's generated ``_internal._zeros`` / ``_ones`` hand the creation to the
recorder directly. Differential (the array per-sample MXNet makes: values,
shape, dtype, device) and counters (creations of a flush merge into one
launch); what is not a plain creation takes MXNet's path, errors included."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon, nd
from mxnet.gluon import nn
from mxnet.ndarray import NDArray, _internal

import jitbatch
from jitbatch.gluon.lazy import LazyArray

#: (name, creation): every form the shim sees (shape int or tuple, each dtype
#: spelling, device given or not, Gluon's begin_state path through it)
CASES = [
    ("zeros tuple", lambda: nd.zeros((1, 3))),
    ("zeros int", lambda: nd.zeros(4)),
    ("ones float16", lambda: nd.ones((2, 2), dtype="float16")),
    ("zeros int32 type", lambda: nd.zeros((1, 4), dtype=np.int32)),
    ("ones float64 dtype", lambda: nd.ones((1, 2), dtype=np.dtype("float64"))),
    ("ones uint8", lambda: nd.ones((3,), dtype="uint8")),
    ("zeros on a device", lambda: nd.zeros((1, 5), ctx=mx.cpu())),
    ("zeros keywords", lambda: mx.nd.zeros(shape=(2, 3), ctx=mx.cpu(0), dtype="float32")),
    ("internal zeros", lambda: _internal._zeros(shape=(1, 2), ctx=mx.cpu(), dtype="float32")),
    ("internal ones no dtype", lambda: _internal._ones(shape=(2, 1), ctx=mx.cpu())),
    ("zeros with a layout", lambda: nd.zeros(shape=(1, 6), __layout__="NC")),
]


def _pending():
    """A flagged block's call left pending (so creations are recorded)."""
    net = nn.Dense(2, in_units=2)
    net.initialize()
    net.hybridize(dynamic_batch=True)
    return net, net(nd.ones((1, 2)))


@pytest.mark.parametrize("name, make", CASES, ids=[c[0] for c in CASES])
def test_a_pending_creation_is_mxnets_array(name, make):
    want = make()           # nothing pending: MXNet's own call
    assert type(want) is NDArray
    net, y = _pending()
    got = make()
    assert type(got) is LazyArray, name
    assert got.shape == want.shape and got.dtype == want.dtype and got.context == want.context
    np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())
    y.asnumpy()
    net.hybridize(active=False)


def test_pending_creations_merge_into_one_launch():
    # zeros and ones of one row shape and dtype are one signature: every
    # sample's creation is made by one launch beside the block's
    net, _ = _pending()
    jitbatch.flush()
    xs = [nd.ones((1, 2)) * i for i in range(5)]      # nothing pending: concrete
    jitbatch.reset_stats()
    ys = [net(x) for x in xs]
    made = [nd.zeros((1, 3)) if i % 2 else nd.ones((1, 3)) for i in range(5)]
    assert all(type(m) is LazyArray for m in made)
    jitbatch.flush()
    assert jitbatch.stats()["launches"] == 2, jitbatch.stats()
    for i, m in enumerate(made):
        np.testing.assert_array_equal(m.asnumpy(), np.full((1, 3), 0.0 if i % 2 else 1.0))
    assert ys[4].shape == (1, 2)
    net.hybridize(active=False)


@pytest.mark.parametrize("cell", [gluon.rnn.GRUCell, gluon.rnn.LSTMCell, gluon.rnn.RNNCell])
@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
def test_begin_state_while_pending_is_recorded_and_counts_like_mxnet(cell, train):
    # Gluon's begin_state calls nd.zeros through its own default argument: the
    # shim on _internal reaches it; the cell counts its states as MXNet does
    c = cell(4, input_size=3)
    c.initialize()
    plain = c.begin_state(batch_size=1)
    counter = c._init_counter  # pylint: disable=protected-access
    c.hybridize(dynamic_batch=True)
    x = nd.array(np.arange(3).reshape(1, 3))
    with autograd.record(train_mode=train):
        out, _ = c(x, plain)                  # pending
        states = c.begin_state(batch_size=1)
        out2, _ = c(x, states)
    assert all(type(s) is LazyArray for s in states)
    assert c._init_counter == counter + len(plain)  # pylint: disable=protected-access
    for s, p in zip(states, plain):
        assert s.shape == p.shape and s.dtype == p.dtype
        np.testing.assert_array_equal(s.asnumpy(), p.asnumpy())
    np.testing.assert_allclose(out2.asnumpy(), out.asnumpy(), rtol=1e-6)
    c.hybridize(active=False)


def test_a_bad_dtype_gets_mxnets_error_and_the_graph_goes_on():
    try:
        nd.zeros((1, 2), dtype="no such type")
    except Exception as e:  # pylint: disable=broad-except
        want = type(e)
    else:
        raise AssertionError("MXNet accepted a bad dtype")
    net, y = _pending()
    with pytest.raises(want):
        nd.zeros((1, 2), dtype="no such type")
    z = nd.zeros((1, 2))
    np.testing.assert_array_equal(z.asnumpy(), np.zeros((1, 2)))
    assert y.shape == (1, 2) and np.isfinite(y.asnumpy()).all()
    net.hybridize(active=False)


def test_an_output_array_takes_mxnets_path():
    net, y = _pending()
    target = nd.ones((1, 3))
    res = _internal._zeros(shape=(1, 3), ctx=mx.cpu(), out=target)
    assert res is target
    np.testing.assert_array_equal(target.asnumpy(), np.zeros((1, 3)))
    y.asnumpy()
    net.hybridize(active=False)


def test_uninstall_restores_mxnets_functions_and_a_wrapper_installed_before_stays():
    # amp.init() wraps MXNet's operator functions: one wrapped before jitbatch
    # installs is kept (and called), never replaced by the shim
    gen_zeros = _internal._zeros.__wrapped__
    jitbatch.uninstall()
    try:
        assert _internal._zeros is gen_zeros
        assert _internal._zeros.__code__.co_filename == "<string>"
        calls = []

        def wrapped(*args, **kwargs):
            calls.append(1)
            return gen_zeros(*args, **kwargs)
        _internal._zeros = wrapped
        jitbatch.install()
        assert _internal._zeros is wrapped
        net, y = _pending()
        del calls[:]                     # (initialize made the bias with it)
        z = nd.zeros((1, 2))
        assert calls == [1] and type(z) is LazyArray     # recorded behind the wrapper
        np.testing.assert_array_equal(z.asnumpy(), np.zeros((1, 2)))
        y.asnumpy()
        net.hybridize(active=False)
        jitbatch.uninstall()
        assert _internal._zeros is wrapped
    finally:
        _internal._zeros = gen_zeros
        jitbatch.install()
    assert _internal._zeros is not gen_zeros and _internal._zeros.__wrapped__ is gen_zeros


def _generated_calls(make):
    """The names of MXNet's generated operator functions ``make()`` calls."""
    import sys
    seen = []

    def prof(frame, event, arg):  # pylint: disable=unused-argument
        if event == "call" and frame.f_code.co_filename == "<string>":
            seen.append(frame.f_code.co_name)
    sys.setprofile(prof)
    try:
        make()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("name, make", CASES, ids=[c[0] for c in CASES])
def test_a_pending_creation_skips_mxnets_generated_function(name, make):
    # the point of the shim: with nothing pending MXNet's _zeros/_ones runs,
    # with a graph pending the creation is recorded without it
    assert set(_generated_calls(make)) & {"_zeros", "_ones"}, name
    net, y = _pending()
    assert not _generated_calls(make), name
    y.asnumpy()
    net.hybridize(active=False)


POLICIES = ["auto", "depth", "agenda", "sequential"]


class _Seq(gluon.Block):
    """A GRU cell over a sequence, its first state from ``begin_state`` and a
    bias of ``nd.ones`` and ``nd.zeros`` made per sample (as a user writes it)."""

    def __init__(self, **kw):
        super(_Seq, self).__init__(**kw)
        with self.name_scope():
            self.cell = gluon.rnn.GRUCell(4, input_size=3)
            self.out = nn.Dense(2, in_units=4)

    def forward(self, xs):  # pylint: disable=arguments-differ
        state = self.cell.begin_state(batch_size=1)
        for t in range(xs.shape[0]):
            h, state = self.cell(xs[t:t + 1], state)
        bias = nd.ones((1, 4)) * 0.5 + nd.zeros((1, 4), dtype="float32")
        return self.out(h + bias)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
def test_creations_in_per_sample_code_are_plain_gluons(policy, train):
    # differential: outputs and gradients against per-sample Gluon, every
    # policy; the creations of all samples merge (one launch per row shape)
    from harness import assert_same, run
    net = _Seq()
    net.initialize(mx.init.Uniform(0.5))
    rng = np.random.default_rng(5)
    samples = [nd.array(rng.normal(size=(int(rng.integers(1, 6)), 3))) for _ in range(6)]

    def apply(net, xs):
        out = net(xs)
        return out, nd.sum(out * out)
    ref = run(net, apply, samples, train, flag=False)
    got = run(net, apply, samples, train, flag=True, policy=policy)
    assert_same(ref, got)
