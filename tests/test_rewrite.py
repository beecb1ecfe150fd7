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
from harness import assert_same, run

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


def ops_of(block):
    inputs, out = block._cached_graph  # pylint: disable=protected-access
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
    out, count = rewrite.fast_activations(y)
    assert count == 2
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
    same, none = rewrite.fast_activations(plain)
    assert none == 0 and same is plain
