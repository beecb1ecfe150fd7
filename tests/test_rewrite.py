"""The activation rewrite of dynamic_batch graphs (jitbatch/gluon/rewrite.py):
which operators it swaps, that it is off when asked and gone when the block is
hybridized without dynamic batching, and that outputs and gradients still equal
plain Gluon's under every policy."""
import json

import numpy as np
import pytest
from mxnet import nd, sym
from mxnet.gluon import HybridBlock, nn

import jitbatch
from jitbatch.gluon import rewrite
from harness import assert_same, run, run_configured

POLICIES = ["auto", "depth", "agenda", "sequential"]


class Acts(HybridBlock):
    """sigmoid, tanh, relu as MXNet's standalone operators, beside an
    Activation the user wrote and an operator the rewrite leaves alone."""

    def __init__(self, **kwargs):
        super(Acts, self).__init__(**kwargs)
        with self.name_scope():
            self.dense = nn.Dense(6, in_units=4)

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        y = self.dense(x)
        return F.sigmoid(y) * F.tanh(y) + F.relu(y) + F.Activation(y, act_type="softrelu") \
            + F.softsign(y)


def ops_of(block, merged=True):
    """(operator, act_type) of ``block``'s merged graph, or (``merged=False``)
    of its own traced graph."""
    out = rewrite.merged_graph(block) if merged else block._cached_graph[1]  # pylint: disable=protected-access
    return [(n["op"], n.get("attrs", {}).get("act_type"))
            for n in json.loads(out.tojson())["nodes"] if n["op"] != "null"]


def samples(rng, n=7):
    return [nd.array(rng.normal(size=(1, 4)) * 3) for _ in range(n)]


def apply(net, x):
    y = net(x)
    return y, nd.sum(y * y)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
def test_rewritten_graph_equals_plain(policy, train):
    net = Acts()
    net.initialize()
    xs = samples(np.random.default_rng(3))
    ref = run(net, apply, xs, train, flag=False)
    jitbatch.reset_stats()
    got = run(net, apply, xs, train, flag=True, policy=policy)
    assert_same(ref, got)
    assert jitbatch.stats()["fast_activations"] == 2


def test_which_operators_are_swapped():
    net = Acts()
    net.initialize()
    net.hybridize(dynamic_batch=True)
    jitbatch.reset_stats()
    x = nd.ones((1, 4))
    net(x).asnumpy()
    ops = ops_of(net)
    assert not {"sigmoid", "tanh"} & {o for o, _ in ops}, ops
    acts = sorted(a for o, a in ops if o == "Activation")
    assert acts == ["sigmoid", "softrelu", "tanh"], ops
    assert ("softsign", None) in ops and ("relu", None) in ops   # relu keeps NaN: left
    assert jitbatch.stats()["fast_activations"] == 2
    # traced once: later calls and flushes do not rewrite again
    net(x).asnumpy()
    assert jitbatch.stats()["fast_activations"] == 2
    # hybridized the ordinary way: MXNet's graph, untouched
    net.hybridize()
    net(x).asnumpy()
    assert ("sigmoid", None) in ops_of(net) and ("tanh", None) in ops_of(net)
    net.hybridize(active=False)


def test_the_block_keeps_its_graph_for_calls_no_launch_merges():
    """The kernel choices are the launches' graph; the block's own graph (what
    its eager calls run) keeps MXNet's operators."""
    net = Acts()
    net.initialize()
    net.hybridize(dynamic_batch=True)
    net(nd.ones((1, 4))).asnumpy()
    own = ops_of(net, merged=False)
    assert ("sigmoid", None) in own and ("tanh", None) in own, own
    assert ("Activation", "sigmoid") in ops_of(net)
    net.hybridize(active=False)


def _chain(net, x, steps=6):
    """Each call reads the previous one's output: nothing to merge."""
    for _ in range(steps):
        x = net(x)[:, :4]
    return x


def _bits(ref, got):
    for a, b in zip(ref[0], got[0]):
        assert np.array_equal(a, b)
    for k in ref[1]:
        assert np.array_equal(ref[1][k], got[1][k]), k


#: a sample of 16 rows: its values round apart somewhere where kernels differ
SAMPLE = nd.array(np.random.default_rng(5).normal(size=(16, 4)) * 3)


@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
def test_an_eager_call_is_plain_hybridize_bit_for_bit(train):
    """A call 'auto' runs eagerly after a flush that merged nothing runs the
    block's own graph: outputs and gradients of plain hybridize(), bit for
    bit, where the launches' Activation kernels round apart."""
    net = Acts()
    net.initialize()
    ref = run(net, apply, [SAMPLE], train, flag=False, hybridize_plain=True)
    net.hybridize(dynamic_batch=True)
    _chain(net, nd.ones((16, 4))).asnumpy()     # 'auto' runs the next calls eagerly
    jitbatch.reset_stats()
    got = run_configured(net, apply, [SAMPLE], train)
    _bits(ref, got)
    assert jitbatch.stats()["flushes"] == 0      # it ran unrecorded


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
def test_a_sample_launched_alone_or_merged_gets_the_same_bits(policy, train):
    """Every launch runs the merged graph, whatever its size: a sample's values
    do not depend on what it merged with (its flush alone, or among others)."""
    net = Acts()
    net.initialize()
    rng = np.random.default_rng(6)
    others = [nd.array(rng.normal(size=(16, 4)) * 3) for _ in range(5)]
    alone = run(net, apply, [SAMPLE], train, flag=True, policy=policy)
    merged = run(net, apply, others[:2] + [SAMPLE] + others[2:], train, flag=True,
                 policy=policy)
    for a, b in ((alone[0][0], merged[0][2]), (alone[0][1], merged[0][8])):
        assert np.array_equal(a, b)
    plain = run(net, apply, [SAMPLE], train, flag=False, hybridize_plain=True)
    assert not np.array_equal(plain[0][0], alone[0][0])   # the kernels do differ


def test_config_off_keeps_the_operators():
    net = Acts()
    net.initialize()
    jitbatch.config.fast_activations = False
    try:
        net.hybridize(dynamic_batch=True)
        jitbatch.reset_stats()
        net(nd.ones((1, 4))).asnumpy()
        assert ("sigmoid", None) in ops_of(net)
    finally:
        jitbatch.config.fast_activations = True
        net.hybridize(active=False)
    assert jitbatch.stats()["fast_activations"] == 0


def test_rewrite_keeps_names_inputs_and_scope_attributes():
    x = sym.var("x")
    with __import__("mxnet").AttrScope(__group__="g1"):
        y = sym.tanh(sym.sigmoid(x, name="s"), name="t")
    out, counts = rewrite.rewrite(y)
    assert counts["fast_activations"] == 2
    nodes = json.loads(out.tojson())["nodes"]
    byname = {n["name"]: n for n in nodes}
    assert byname["s"]["op"] == byname["t"]["op"] == "Activation"
    assert byname["s"]["attrs"] == {"__group__": "g1", "act_type": "sigmoid"}
    assert byname["t"]["inputs"][0][0] == nodes.index(byname["s"])
    assert out.list_arguments() == ["x"]
    v = nd.array([[-3.0, 0.0, 2.5]])
    np.testing.assert_allclose(out.eval(x=v)[0].asnumpy(), np.tanh(1 / (1 + np.exp(-v.asnumpy()))),
                               rtol=1e-6)
    plain = sym.softsign(x)
    same, none = rewrite.rewrite(plain)
    assert not any(none.values()) and same is plain


# -- fast splits ---------------------------------------------------------------------------
class Splits(HybridBlock):
    """Splits a user writes: along the last axis of a 2-D array (the naive gate
    split), along a middle axis with axes after it, one already squeezing (left
    alone), and Gluon's own GRU and LSTM cells (SliceChannel along axis 1)."""

    def __init__(self, **kwargs):
        super(Splits, self).__init__(**kwargs)
        with self.name_scope():
            self.dense = nn.Dense(12, in_units=4)
            self.gru = __import__("mxnet").gluon.rnn.GRUCell(4, input_size=4)
            self.lstm = __import__("mxnet").gluon.rnn.LSTMCell(4, input_size=4)

    def hybrid_forward(self, F, x, h):  # pylint: disable=arguments-differ
        a, b, c = F.split(self.dense(x), num_outputs=3, axis=1)             # (1, 4) each
        p, q = F.split(F.reshape(self.dense(x), (0, 4, 3)), num_outputs=2, axis=1)
        s = F.split(F.reshape(self.dense(x), (0, 3, 4)), num_outputs=3, axis=1,
                    squeeze_axis=True)                                       # left as is
        g, _ = self.gru(F.tanh(a) * b, [h])
        l, _ = self.lstm(c, [h, g])
        pq = F.expand_dims(F.sum(p * F.sigmoid(q), axis=(1, 2)), axis=1)   # (1, 1)
        return F.broadcast_add(l + s[0] * s[2], pq), g


def split_ops(block):
    """(squeeze_axis, whether its input is the rewrite's Reshape) per split of
    ``block``'s merged graph."""
    out = rewrite.merged_graph(block)
    nodes = json.loads(out.tojson())["nodes"]
    return [(n.get("attrs", {}).get("squeeze_axis"),
             nodes[n["inputs"][0][0]]["name"].endswith("_jbgroups"))
            for n in nodes if n["op"] == "SliceChannel"]


def split_apply(net, sample):
    y, g = net(*sample)
    return y, nd.sum(y * y) + nd.sum(g)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
def test_split_rewrite_equals_plain(policy, train):
    net = Splits()
    net.initialize()
    rng = np.random.default_rng(4)
    xs = [(nd.array(rng.normal(size=(1, 4))), nd.array(rng.normal(size=(1, 4))))
          for _ in range(6)]
    ref = run(net, split_apply, xs, train, flag=False)
    jitbatch.reset_stats()
    got = run(net, split_apply, xs, train, flag=True, policy=policy)
    assert_same(ref, got)
    # the two unsqueezed splits of the block, the GRU cell's two, the LSTM cell's one
    assert jitbatch.stats()["fast_splits"] == 5


def test_which_splits_are_rewritten_and_config_off():
    net = Splits()
    net.initialize()
    x = (nd.ones((1, 4)), nd.ones((1, 4)))
    net.hybridize(dynamic_batch=True)
    net(*x)[0].asnumpy()
    ops = split_ops(net)
    assert ops.count(("True", True)) == 5 and ops.count(("True", False)) == 1, ops
    net.hybridize()                  # the ordinary way: MXNet's graph, untouched
    net(*x)[0].asnumpy()
    assert not any(r for _, r in split_ops(net))
    jitbatch.config.fast_splits = False
    try:
        net.hybridize(dynamic_batch=True)
        jitbatch.reset_stats()
        net(*x)[0].asnumpy()
        assert jitbatch.stats()["fast_splits"] == 0
        assert not any(r for _, r in split_ops(net))
    finally:
        jitbatch.config.fast_splits = True
        net.hybridize(active=False)


@pytest.mark.parametrize("shape,axis,parts", [((5, 12), 1, 3), ((5, 6, 4), 1, 2),
                                              ((5, 3, 12), 2, 4), ((5, 12), 1, 12)])
def test_rewritten_split_is_the_same_copy_forward_and_backward(shape, axis, parts):
    x = sym.var("x")
    y = sym.Group([o * (i + 1) for i, o in
                   enumerate(sym.split(x, num_outputs=parts, axis=axis, name="cut"))])
    fast, counts = rewrite.rewrite(y)
    assert counts["fast_splits"] == 1
    assert fast.list_arguments() == ["x"] and fast.list_outputs() == y.list_outputs()
    v = nd.array(np.random.default_rng(0).normal(size=shape))
    got = []
    for s in (y, fast):
        g = nd.zeros(shape)
        ex = s.bind(__import__("mxnet").cpu(), {"x": v}, args_grad={"x": g})
        outs = ex.forward(is_train=True)
        ex.backward([nd.ones(o.shape) for o in outs])
        got.append(([o.asnumpy() for o in outs], g.asnumpy()))
    (o1, g1), (o2, g2) = got
    for a, b in zip(o1, o2):
        assert a.shape == b.shape and np.array_equal(a, b)
    assert np.array_equal(g1, g2)


@pytest.mark.parametrize("shape,slopes", [((5, 4), 1), ((5, 4), 4), ((3, 4, 6), 4),
                                          ((2, 3, 2, 2), 3)])
def test_rewritten_prelu_is_the_same_function_and_gradient(shape, slopes):
    """``exact_prelu``: the rewritten symbol gives the same outputs, bit for
    bit, and the input and slope gradients of the definition (an executor on
    the bare operator, where MXNet's own backward is right)."""
    import mxnet as mx
    x, gamma = sym.var("x"), sym.var("gamma")
    y = sym.LeakyReLU(x, gamma, act_type="prelu", name="act")
    fast, counts = rewrite.rewrite(y)
    assert counts["exact_prelu"] == 1
    assert "LeakyReLU" not in fast.tojson() and fast.list_outputs() == y.list_outputs()
    rng = np.random.default_rng(slopes)
    v = nd.array(rng.normal(size=shape))
    v[0] = 0                                        # x == 0 takes the slope's side
    a = nd.array(rng.uniform(0.1, 0.5, size=(slopes,)))
    head = nd.array(rng.normal(size=shape))
    got = []
    for s in (y, fast):
        gx, ga = nd.zeros(shape), nd.zeros((slopes,))
        ex = s.bind(mx.cpu(), {"x": v, "gamma": a}, args_grad={"x": gx, "gamma": ga})
        out = ex.forward(is_train=True)[0]
        ex.backward([head])
        got.append((out.asnumpy(), gx.asnumpy(), ga.asnumpy()))
    (o1, gx1, ga1), (o2, gx2, ga2) = got
    assert np.array_equal(o1, o2)
    np.testing.assert_allclose(gx2, gx1, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ga2, ga1, rtol=1e-5, atol=1e-6)
