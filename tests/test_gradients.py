"""Launches that pass no gradient run unrecorded (jitbatch/gluon/gradients.py).

Oracle: MXNet's own autograd. Every operator (or operator input) the module
lists as passing no gradient gets an all-zero gradient from MXNet: a wrong
entry would drop a real gradient silently. The crash the module avoids is
tested end to end in tests/test_heldout.py (test_zero_gradient_operator_...)."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, nd
from mxnet.gluon import HybridBlock, nn

import jitbatch
from jitbatch.gluon import gradients, signatures


def _call(name):
    """``name`` on arrays (a, b) of shape (2, 3), or None if it takes other inputs."""
    internal = getattr(nd._internal, name, None)  # pylint: disable=protected-access
    if name.endswith("_scalar"):
        return lambda a, b: internal(a, scalar=0.25)
    if name in ("argmax", "argmin"):
        return lambda a, b: getattr(nd, name)(a, axis=1)
    if name in ("argsort", "sign", "round", "rint", "ceil", "floor", "trunc",
                "fix", "zeros_like", "ones_like", "logical_not", "shape_array", "size_array",
                "BlockGrad", "stop_gradient"):
        return lambda a, b: getattr(nd, name)(a)
    if name == "one_hot":
        return lambda a, b: nd.one_hot(nd.abs(a).floor(), depth=4)
    if name.startswith("broadcast_"):
        return lambda a, b: getattr(nd, name)(a, b)
    if name.startswith("_random_"):
        return lambda a, b: getattr(nd.random, name[len("_random_"):])(nd.abs(a) + 0.5)
    if internal is not None:
        return lambda a, b: internal(a, b)
    return None


def _zero_gradients(f, *arrays, without=()):
    """MXNet's gradients of a weighted sum of ``f(*arrays)`` for every array
    (None for the positions in ``without``, which get no gradient buffer)."""
    for k, a in enumerate(arrays):
        if k not in without:
            a.attach_grad()
    with autograd.record():
        out = f(*arrays)
        loss = (out.astype("float32") * nd.arange(out.size).reshape(out.shape)).sum()
    loss.backward()
    return [None if k in without else a.grad.asnumpy() for k, a in enumerate(arrays)]


@pytest.mark.parametrize("name", sorted(gradients.NO_GRADIENT))
def test_every_operator_listed_gets_no_gradient_from_mxnet(name):
    f = _call(name)
    assert f is not None, "no call written for %s" % name
    rng = np.random.default_rng(0)
    a = nd.array(rng.normal(size=(2, 3)) * 3)
    b = nd.array(rng.normal(size=(2, 3)) * 3)
    for g in _zero_gradients(f, a, b):
        assert not g.any(), (name, g)


INPUT_CALLS = {
    "Embedding": (lambda i, w: nd.Embedding(i, w, input_dim=4, output_dim=3), "ids", "table"),
    "take": (lambda w, i: nd.take(w, i), "table", "ids"),
    "pick": (lambda a, i: nd.pick(a, i, axis=1), "rows", "picks"),
    "where": (lambda c, a: nd.where(c, a, a * 3), "rows", "rows"),
    "gather_nd": (lambda a, i: nd.gather_nd(a, i), "rows", "index2"),
    "SequenceMask": (lambda a, n: nd.SequenceMask(a, n, use_sequence_length=True, value=0.5),
                     "seq", "lengths"),
    "SequenceLast": (lambda a, n: nd.SequenceLast(a, n, use_sequence_length=True),
                     "seq", "lengths"),
    "SequenceReverse": (lambda a, n: nd.SequenceReverse(a, n, use_sequence_length=True),
                        "seq", "lengths"),
    "_contrib_arange_like": (lambda a, b: nd.contrib.arange_like(a) * b, "rows", "rows"),
    "broadcast_like": (lambda a, b: nd.broadcast_like(a, b), "row", "rows"),
    "reshape_like": (lambda a, b: nd.reshape_like(a, b), "rows", "flat"),
    "slice_like": (lambda a, b: nd.slice_like(a, b), "rows", "row"),
}
_ARRAYS = {"ids": [[1, 3], [0, 2]], "table": np.arange(12).reshape(4, 3) / 7.0,
           "rows": [[1.5, -2.0, 0.5], [0.0, 3.0, -1.0]], "index2": [[0, 1], [2, 0]],
           "picks": [1, 2], "row": [[0.5, -1.0, 2.0]], "flat": np.arange(6.0) / 3,
           "seq": np.arange(12).reshape(3, 2, 2) / 5.0, "lengths": [2, 3]}


def test_the_inputs_listed_per_operator_cover_every_operator_with_a_call():
    assert set(INPUT_CALLS) == set(gradients.NO_GRADIENT_INPUTS)


@pytest.mark.parametrize("name", sorted(INPUT_CALLS))
def test_every_operator_input_listed_gets_no_gradient_from_mxnet(name):
    f, first, second = INPUT_CALLS[name]
    arrays = [nd.array(_ARRAYS[first]), nd.array(_ARRAYS[second])]
    if name == "Embedding":
        # MXNet refuses to compute a gradient for the ids at all
        with pytest.raises(mx.base.MXNetError, match="doesn't support calculate data gradient"):
            _zero_gradients(f, *arrays)
        arrays = [nd.array(_ARRAYS[first]), nd.array(_ARRAYS[second])]
        grads = _zero_gradients(f, *arrays, without=(0,))
        assert grads[1].any()
        return
    grads = _zero_gradients(f, *arrays)
    for k, g in enumerate(grads):
        if k in gradients.NO_GRADIENT_INPUTS[name]:
            assert not g.any(), (name, k, g)
        else:
            assert g.any(), (name, k, "an input that passes gradient got none: the call "
                             "does not test what it should")


@pytest.mark.parametrize("ret_typ", ["indices", "mask", "value", "both"])
def test_topk_passes_gradient_exactly_where_the_list_says(ret_typ):
    a = nd.array(_ARRAYS["rows"])
    f = (lambda x, y: nd.topk(x, k=2, ret_typ=ret_typ)) if ret_typ != "both" else \
        (lambda x, y: nd.topk(x, k=2, ret_typ="both")[0])
    g = _zero_gradients(f, a, nd.array(_ARRAYS["rows"]))[0]
    assert g.any() == gradients.passes("topk", 0, {"ret_typ": ret_typ}), g


class _Stop(HybridBlock):
    def hybrid_forward(self, F, x):
        return F.BlockGrad(F.tanh(x) * 2)


class _Lookup(HybridBlock):
    """Only its parameter gets a gradient (the ids pass none)."""

    def __init__(self, **kw):
        super(_Lookup, self).__init__(**kw)
        with self.name_scope():
            self.table = nn.Embedding(5, 3)

    def hybrid_forward(self, F, ids):
        return self.table(ids) * 2


@pytest.mark.parametrize("train", [True, False], ids=["recording", "not recording"])
def test_a_block_passing_no_gradient_launches_unrecorded_and_one_with_parameters_recorded(train):
    stop, lookup = _Stop(), _Lookup()
    for net in (stop, lookup):
        net.initialize(mx.init.Normal(1.0))
        net.hybridize(dynamic_batch=True, policy="depth")
    xs = [nd.array(np.random.default_rng(i).normal(size=(1, 3))) for i in range(3)]
    ids = [nd.array([[i % 5, (i + 2) % 5]]) for i in range(3)]
    with autograd.record(train_mode=train):
        outs = [stop(x) + lookup(i).sum() for x, i in zip(xs, ids)]
        loss = nd.add_n(*outs).sum()
    loss.backward()
    infos = {i.name: i for i in signatures.TABLE._table.values()  # pylint: disable=protected-access
             if getattr(i, "name", None) in (stop.name, lookup.name)}
    assert infos[stop.name].op.mode == (False, train)
    assert infos[lookup.name].op.mode == (True, train)
    got = lookup.table.weight.grad().asnumpy().copy()
    lookup.hybridize(active=False)
    stop.hybridize(active=False)
    with autograd.record(train_mode=train):
        loss = nd.add_n(*[stop(x) + lookup(i).sum() for x, i in zip(xs, ids)]).sum()
    loss.backward()
    np.testing.assert_allclose(got, lookup.table.weight.grad().asnumpy(), rtol=1e-6)
    assert got.any()
    jitbatch.flush()
