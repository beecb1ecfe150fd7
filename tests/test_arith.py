"""A lazy array's ``+ - * /`` and unary ``-`` (jitbatch/gluon/arith.py): the
call MXNet's own arithmetic makes, handed to the operator entry point at once.
Differential (outputs and gradients against per-sample Gluon, every policy,
training and inference) and counters (the calls of every operand kind merge,
with the calls written as MXNet's operator functions, into one launch each)."""
import numpy as np
import pytest
from mxnet import nd
from mxnet.gluon import nn
from mxnet.ndarray import NDArray

import jitbatch
from jitbatch.gluon.lazy import LazyArray
from harness import assert_same, run

POLICIES = ["auto", "depth", "agenda", "sequential"]

#: (name, f(lazy a, lazy b, concrete c)): every operand kind of every operator
CASES = [
    ("lazy+lazy", lambda a, b, c: a + b),
    ("lazy+concrete", lambda a, b, c: a + c),
    ("concrete+lazy", lambda a, b, c: c + a),
    ("lazy+int", lambda a, b, c: a + 2),
    ("float+lazy", lambda a, b, c: 1.5 + a),
    ("lazy-lazy", lambda a, b, c: a - b),
    ("concrete-lazy", lambda a, b, c: c - a),
    ("lazy-float", lambda a, b, c: a - 0.25),
    ("int-lazy", lambda a, b, c: 3 - a),
    ("lazy*lazy", lambda a, b, c: a * b),
    ("concrete*lazy", lambda a, b, c: c * a),
    ("lazy*np.float32", lambda a, b, c: a * np.float32(0.5)),
    ("int*lazy", lambda a, b, c: 2 * a),
    ("lazy/lazy", lambda a, b, c: a / (b * b + 1)),
    ("concrete/lazy", lambda a, b, c: c / (a * a + 1)),
    ("lazy/int", lambda a, b, c: a / 4),
    ("float/lazy", lambda a, b, c: 1.0 / (a * a + 1)),
    ("-lazy", lambda a, b, c: -a),
    ("lazy+bool", lambda a, b, c: a + True),
    ("broadcast lazy*row", lambda a, b, c: a * b[:, :1]),
]


def _net():
    net = nn.Dense(3, in_units=4)
    net.initialize()
    return net


def _samples(seed, n=5):
    rng = np.random.default_rng(seed)
    return [(nd.array(rng.normal(size=(1, 4))), nd.array(rng.normal(size=(1, 4))),
             nd.array(rng.normal(size=(1, 3)))) for _ in range(n)]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("name, f", CASES, ids=[c[0] for c in CASES])
def test_arithmetic_on_lazy_arrays_is_plain_gluons(name, f, policy, train):
    net = _net()

    def apply(net, s):
        x, y, c = s
        out = f(net(x), net(y), c)
        return out, nd.sum(out * out)
    samples = _samples(len(name))
    ref = run(net, apply, samples, train, flag=False)
    got = run(net, apply, samples, train, flag=True, policy=policy)
    assert_same(ref, got)


@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
def test_operator_and_operator_function_calls_merge_into_one_launch(train):
    """``a + b`` and ``nd.broadcast_add(a, b)``, ``a * 2`` and
    ``nd._internal._mul_scalar(a, scalar=2.0)``: the same signature, so the
    samples writing either share one launch per operator (policy 'depth')."""
    net = _net()
    ops = [(lambda a, b: a + b, lambda a, b: nd.broadcast_add(a, b)),
           (lambda a, b: a * 2, lambda a, b: nd._internal._mul_scalar(a, scalar=2.0)),
           (lambda a, b: 1 - a, lambda a, b: nd._internal._rminus_scalar(a, scalar=1.0)),
           (lambda a, b: -a, lambda a, b: nd._internal._mul_scalar(a, scalar=-1.0))]

    def apply(net, s):
        x, y, _ = s
        a, b = net(x), net(y)
        k = int(x.asnumpy()[0, 0] > 0)        # concrete: which spelling this sample uses
        outs = [pair[k](a, b) for pair in ops]
        return outs[0], nd.add_n(*[nd.sum(o) for o in outs])
    samples = _samples(7, n=8)
    assert len({int(s[0].asnumpy()[0, 0] > 0) for s in samples}) == 2   # both spellings
    ref = run(net, apply, samples, train, flag=False)
    jitbatch.reset_stats()
    got = run(net, apply, samples, train, flag=True, policy="depth")
    assert_same(ref, got)
    st = jitbatch.stats()
    # per sample: 2 dense calls, 4 operators, 4 sums, add_n; launches: the dense
    # calls, broadcast_add, the two _mul_scalar (their scalar is the node's),
    # _rminus_scalar, the sums, add_n; training adds the total
    assert st["nodes"] == 8 * 11 + train and st["launches"] == 1 + 3 + 1 + 1 + train, st


def test_other_operands_take_mxnets_path():
    net = _net()
    net.hybridize(dynamic_batch=True)
    a = net(nd.ones((1, 4)))
    assert type(a) is LazyArray
    for bad in ("x", np.ones((1, 3)), None):
        with pytest.raises(TypeError, match="not supported"):
            a + bad
    with pytest.raises(ValueError):
        a * np.str_("abc")            # a NumPy scalar MXNet's float() refuses
    out = a + nd.ones((1, 3))
    assert type(out) is LazyArray
    np.testing.assert_allclose(out.asnumpy(), a.asnumpy() + 1, rtol=1e-6)
    net.hybridize(active=False)


def test_the_methods_are_lazy_arrays_own_and_concrete_arrays_keep_mxnets():
    assert LazyArray.__add__ is not NDArray.__add__
    assert "__add__" not in NDArray.__dict__ or NDArray.__dict__["__add__"].__module__ \
        .startswith("mxnet")
    c = nd.ones((1, 2))
    assert type(c + 1) is NDArray and type(2 * c - c / 2) is NDArray


def test_an_operator_function_another_library_wrapped_is_called(monkeypatch):
    """amp.init() wraps MXNet's operator functions (casts to the widest type):
    arithmetic on lazy arrays goes through such a wrapper, as MXNet's own
    arithmetic does."""
    from mxnet.ndarray import _internal, op
    calls = []

    def wrapping(f):
        def wrapped(*args, **kwargs):
            calls.append(f.__name__)
            return f(*args, **kwargs)
        return wrapped
    monkeypatch.setattr(op, "broadcast_sub", wrapping(op.broadcast_sub))
    monkeypatch.setattr(_internal, "_mul_scalar", wrapping(_internal._mul_scalar))
    net = _net()
    net.hybridize(dynamic_batch=True)
    a, b = net(nd.ones((1, 4))), net(nd.zeros((1, 4)))
    outs = [a - b, a * 3, -a, a + b]
    assert calls == ["broadcast_sub", "_mul_scalar", "_mul_scalar"]
    assert all(type(o) is LazyArray for o in outs)
    va, vb = a.asnumpy(), b.asnumpy()
    for o, want in zip(outs, [va - vb, va * 3, -va, va + vb]):
        np.testing.assert_allclose(o.asnumpy(), want, rtol=1e-6)
    net.hybridize(active=False)
