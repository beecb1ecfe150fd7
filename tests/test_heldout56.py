"""Held-out round 56: operators given a Gluon Parameter's ``data()`` as their
weight (FullyConnected weight/bias, Embedding weight, take's table on axis 0,
LayerNorm gamma/beta), merged across samples with the weight passed once.

Written as users write per-sample models, naively: a language model whose
output layer is tied to the embedding (``nd.FullyConnected(h,
embed.weight.data(), no_bias=True, ...)`` and ``nd.dot(..., transpose_b=True)``),
DyNet-style Blocks holding raw parameters (``self.params.get``) used by
operators inside a recursive tree and an RNN loop, one parameter used at
several positions (weight of one call, data or table of others), two
parameters of the same shape used by calls of the same operator (must not
share a launch: values and depth launch counts), Trainer steps between
minibatches (sgd and adam, parameters compared after), ``initialize(
force_reinit=True)`` and ``set_data`` between minibatches, ``grad_req='add'``,
parameters written in place while calls are pending, ``jitbatch.map``,
float64, samples of one row among longer ones, deferred initialization
(hybridize before initialize, shapes inferred at the first call), frozen
parameters; every policy, training and inference. Everything is compared with
plain per-sample Gluon on the same parameters and inputs.

Found, and fixed the same day (``rules.shared_rule``: a FullyConnected's data
must have rows, and every weight argument a call passes must be a parameter):

1. ``nd.FullyConnected(h, W.data(), ..., flatten=False)`` on a 1-D ``h`` of
   ``in_units`` values with ``num_hidden == in_units`` (a DyNet-style RNN over
   1-D state vectors, square ``W``): the shared rule takes it as row-wise
   (input and output lead lengths equal), concatenates the samples' vectors
   into one long vector and the merged launch failed (ExecutionError: "Shape
   inconsistent, Provided = [4,4], inferred shape=(4,12)"); plain Gluon runs.
2. Only one of the two weight arguments a parameter (``nd.FullyConnected(h,
   W.data(), b)`` with ``b`` made per call or computed, ``nd.LayerNorm(h,
   nd.ones(H), beta.data())``) where a sample's row count equals the other
   weight's length: the non-parameter weight is treated as a per-sample row
   argument, concatenated, and the merged launch failed (ExecutionError
   "Unexpected shape for bias [12" / "Shape inconsistent, Provided = [12],
   inferred shape=[4]"); plain Gluon runs.

Merging gaps (values correct), closed the same day by ``params.noting``
(a watched Parameter's arrays are noted whenever MXNet makes them):

3. A non-hybrid Block hybridized with dynamic_batch before ``initialize()``:
   its own parameters were never noted (watch_params ran at hybridize and
   found no arrays), so its operators on them ran one launch per call
   (TiedLM, six 2-token samples: FullyConnected 7, LayerNorm 6 launches
   instead of 2 and 1).
4. After ``initialize(force_reinit=True)`` the new parameter arrays were
   noted by nothing (the Block's signature/hybridize already happened): every
   call on a parameter ran per call (FullyConnected 12, LayerNorm 6).

No silently different number was found. (Not jitbatch's: MXNet 1.9.1's own
FullyConnected backward with its weight frozen, grad_req 'null', and its bias
trained writes garbage into the bias gradient, per sample too; the frozen
tests freeze other parameters.)
"""
import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

import jitbatch
from heldout import (both, flag, launches_by_name, nothing_pending,  # noqa: F401
                     params_of, rng_for, same_values)

POLICIES = ["depth", "agenda", "sequential", "auto"]
V, E, H = 9, 5, 6
LENGTHS = (3, 1, 4, 1, 3, 2, 4)


def _ids(key, lengths=LENGTHS):
    rng = rng_for("h56", key)
    return [nd.array(rng.integers(0, V, size=t)) for t in lengths]


def _rows(key, lengths=LENGTHS, width=E, dtype="float32"):
    rng = rng_for("h56rows", key)
    return [nd.array(rng.normal(size=(t, width)), dtype=dtype) for t in lengths]


def _made(cls, *args, seed=0, dtype=None, **kw):
    def make():
        mx.random.seed(seed)
        net = cls(*args, **kw)
        net.initialize(mx.init.Uniform(0.5))
        if dtype is not None:
            net.cast(dtype)
        return net
    return make


def _check(make, program, policy):
    want, got, st = both(make, program, policy)
    same_values(want, got, policy)
    return st


def _loop(net, policy, samples, train, apply, extra=()):
    """Outputs (and, training, every gradient) of ``apply(net, s)`` per sample."""
    flag(net, policy)
    params = net.collect_params()
    for p in params.values():
        if p.grad_req != "null":
            p.zero_grad()
    if train:
        with autograd.record():
            outs = [apply(net, s) for s in samples]
            loss = nd.add_n(*[nd.sum(o * o) for o in outs])
        loss.backward()
    else:
        outs = [apply(net, s) for s in samples]
    res = [o.asnumpy() for o in outs]
    if train:
        res += [p.grad().asnumpy().copy() for p in params.values() if p.grad_req != "null"]
    return res


# -- models ----------------------------------------------------------------------------

class TiedLM(gluon.Block):
    """Per sample token ids (T,): embedding, a raw projection and LayerNorm, an
    output layer tied to the embedding (FullyConnected or dot)."""

    def __init__(self, tie="fc", **kwargs):
        super().__init__(**kwargs)
        self.tie = tie
        with self.name_scope():
            self.embed = gluon.nn.Embedding(V, E)
            self.w = self.params.get("w", shape=(E, E))
            self.b = self.params.get("b", shape=(E,))
            self.gamma = self.params.get("gamma", shape=(E,), init=mx.init.Constant(1.2))
            self.beta = self.params.get("beta", shape=(E,))

    def forward(self, ids):  # pylint: disable=arguments-differ
        x = self.embed(ids)                                                    # (T, E)
        h = nd.tanh(nd.FullyConnected(x, self.w.data(), self.b.data(), num_hidden=E))
        h = nd.LayerNorm(h, self.gamma.data(), self.beta.data())
        if self.tie == "fc":
            return nd.FullyConnected(h, self.embed.weight.data(), no_bias=True, num_hidden=V)
        if self.tie == "dot":
            return nd.dot(h, self.embed.weight.data(), transpose_b=True)
        # both: the table at three positions (Embedding's weight, FC weight, take)
        back = nd.Embedding(nd.argmax(h, axis=1), self.embed.weight.data(), input_dim=V,
                            output_dim=E)
        h = h + back + nd.take(self.embed.weight.data(), nd.argmin(h, axis=1))
        return nd.FullyConnected(h, self.embed.weight.data(), no_bias=True, num_hidden=V)


def _lm(net, ids):
    return net(ids)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("tie", ["fc", "dot", "three"])
@pytest.mark.parametrize("policy", POLICIES)
def test_tied_language_model(policy, tie, train):
    samples = _ids("lm")
    _check(_made(TiedLM, tie, prefix="tied_"),
           lambda net, pol: _loop(net, pol, samples, train, _lm), policy)


class Tree(gluon.Block):
    """DyNet-style recursive net: leaves embedded (nn.Embedding), an internal node
    FullyConnected over the concatenated children with raw W, b, then LayerNorm;
    the root scored by take of a raw table and a FullyConnected tied to W."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.embed = gluon.nn.Embedding(V, H)
            self.W = self.params.get("W", shape=(H, 2 * H))
            self.b = self.params.get("b", shape=(H,))
            self.g = self.params.get("g", shape=(H,), init=mx.init.Constant(0.8))
            self.be = self.params.get("be", shape=(H,))
            self.table = self.params.get("table", shape=(V, H))

    def node(self, t):
        if isinstance(t, int):
            return self.embed(nd.array([t]))                                  # (1, H)
        kids = nd.concat(self.node(t[0]), self.node(t[1]), dim=1)              # (1, 2H)
        h = nd.tanh(nd.FullyConnected(kids, self.W.data(), self.b.data(), num_hidden=H))
        return nd.LayerNorm(h, self.g.data(), self.be.data())

    def forward(self, tree):  # pylint: disable=arguments-differ
        h = self.node(tree)
        h = h + nd.take(self.table.data(), nd.argmax(h, axis=1))
        # W (H, 2H) also as data: scores against its rows
        return nd.FullyConnected(nd.concat(h, h, dim=1), self.W.data(), no_bias=True,
                                 num_hidden=H) + nd.dot(h, self.table.data(), transpose_b=True)[:, :H]


def _trees(key, n=6):
    rng = rng_for("trees", key)

    def grow(depth):
        if depth == 0 or rng.random() < 0.3:
            return int(rng.integers(0, V))
        return (grow(depth - 1), grow(depth - 1))
    return [grow(int(rng.integers(0, 4))) for _ in range(n)]


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_recursive_tree(policy, train):
    trees = _trees("t")
    _check(_made(Tree, prefix="tree_"),
           lambda net, pol: _loop(net, pol, trees, train, lambda n, t: n(t)), policy)


class RNN(gluon.Block):
    """An Elman RNN over (1, H) states, raw Wx, Wh, b; LayerNorm each step;
    the last state through an output layer tied to the embedding."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.embed = gluon.nn.Embedding(V, E)
            self.wx = self.params.get("wx", shape=(H, E))
            self.wh = self.params.get("wh", shape=(H, H))
            self.b = self.params.get("b", shape=(H,))
            self.g = self.params.get("g", shape=(H,), init=mx.init.Constant(1.1))
            self.be = self.params.get("be", shape=(H,))
            self.out = self.params.get("out", shape=(E, H))

    def forward(self, ids):  # pylint: disable=arguments-differ
        x = self.embed(ids)
        h = nd.zeros((1, H), dtype=x.dtype)
        for t in range(ids.shape[0]):
            h = nd.tanh(nd.FullyConnected(x[t:t + 1], self.wx.data(), self.b.data(),
                                          num_hidden=H) +
                        nd.FullyConnected(h, self.wh.data(), no_bias=True, num_hidden=H))
            h = nd.LayerNorm(h, self.g.data(), self.be.data())
        e = nd.FullyConnected(h, self.out.data(), no_bias=True, num_hidden=E)
        return nd.FullyConnected(e, self.embed.weight.data(), no_bias=True, num_hidden=V)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_rnn_loop(policy, train):
    samples = _ids("rnn")
    _check(_made(RNN, prefix="rnn_"),
           lambda net, pol: _loop(net, pol, samples, train, lambda n, s: n(s)), policy)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", ["depth"])
def test_rnn_loop_float64(policy, train):
    samples = [nd.array(s.asnumpy(), dtype="float64") for s in _ids("rnn64")]
    _check(_made(RNN, prefix="rnn64_", dtype="float64"),
           lambda net, pol: _loop(net, pol, samples, train, lambda n, s: n(s)), policy)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", ["agenda"])
def test_tied_lm_float64(policy, train):
    samples = [nd.array(s.asnumpy(), dtype="float64") for s in _ids("lm64")]
    _check(_made(TiedLM, "three", prefix="tied64_", dtype="float64"),
           lambda net, pol: _loop(net, pol, samples, train, _lm), policy)


def test_rnn_launch_counts_depth():
    """Seven samples of lengths (3, 1, 4, 1, 3, 2, 4) (18 steps), every row a
    (1, .) call, under depth. The input projections FullyConnected(x[t], wx)
    depend on the embedding only (x[t:t+1] a view): one launch of all 18. The
    recurrent FullyConnected(h, wh) (h0 = nd.zeros made in the flagged forward)
    one launch per step t = 0..3 (7, 5, 4, 2 samples): 4. The output projection
    and the tied output layer come after a sample's last step: one launch each
    per distinct length (1, 2, 3, 4): 8. FullyConnected 1 + 4 + 8 = 13;
    LayerNorm one per step: 4. Had the two parameters (wx, wh) or the tied
    table shared launches, fewer; had nothing merged, 18 + 18 + 14 = 50."""
    net = _made(RNN, prefix="rnnc_")()
    net.hybridize(dynamic_batch=True, policy="depth")
    samples = _ids("rnn")
    seen = launches_by_name(lambda: [y.asnumpy() for y in [net(s) for s in samples]])
    net.hybridize(active=False)
    assert seen.get("LayerNorm") == 4, seen
    assert seen.get("FullyConnected") == 13, seen


# -- two parameters of one shape ---------------------------------------------------------

class Twins(gluon.Block):
    """Two raw parameters of the same shape used by calls of one operator on the
    same input (same depth): they must stay two launches, each with its weight."""

    def __init__(self, op="fc", **kwargs):
        super().__init__(**kwargs)
        self.op = op
        with self.name_scope():
            self.dense = gluon.nn.Dense(H, in_units=E)
            self.w1 = self.params.get("w1", shape=(H, H))
            self.w2 = self.params.get("w2", shape=(H, H), init=mx.init.Uniform(2.0))
            self.b1 = self.params.get("b1", shape=(H,))
            self.b2 = self.params.get("b2", shape=(H,), init=mx.init.Constant(0.7))
            self.t1 = self.params.get("t1", shape=(V, H))
            self.t2 = self.params.get("t2", shape=(V, H), init=mx.init.Uniform(3.0))

    def forward(self, x):  # pylint: disable=arguments-differ
        h = self.dense(x)                                                      # (T, H)
        if self.op == "fc":
            a = nd.FullyConnected(h, self.w1.data(), self.b1.data(), num_hidden=H)
            b = nd.FullyConnected(h, self.w2.data(), self.b2.data(), num_hidden=H)
        elif self.op == "fc_bias":    # same weight, different biases
            a = nd.FullyConnected(h, self.w1.data(), self.b1.data(), num_hidden=H)
            b = nd.FullyConnected(h, self.w1.data(), self.b2.data(), num_hidden=H)
        elif self.op == "ln":
            a = nd.LayerNorm(h, self.b1.data(), self.b2.data())
            b = nd.LayerNorm(h, self.b2.data(), self.b1.data())
        elif self.op == "embedding":
            ids = nd.argmax(h, axis=1)
            a = nd.Embedding(ids, self.t1.data(), input_dim=V, output_dim=H)
            b = nd.Embedding(ids, self.t2.data(), input_dim=V, output_dim=H)
        else:  # take
            ids = nd.argmin(h, axis=1)
            a = nd.take(self.t1.data(), ids)
            b = nd.take(self.t2.data(), ids)
        return nd.concat(a, b, dim=1)


TWIN_OPS = {"fc": "FullyConnected", "fc_bias": "FullyConnected", "ln": "LayerNorm",
            "embedding": "Embedding", "take": "take"}


@pytest.mark.parametrize("policy,train", [("depth", False), ("depth", True), ("agenda", True)])
@pytest.mark.parametrize("op", sorted(TWIN_OPS))
def test_two_parameters_of_one_shape(policy, op, train):
    xs = _rows("twins", lengths=(2, 2, 2, 1, 2))
    _check(_made(Twins, op, prefix="twins_"),
           lambda net, pol: _loop(net, pol, xs, train, lambda n, x: n(x)), policy)


@pytest.mark.parametrize("op", sorted(TWIN_OPS))
def test_two_parameters_two_launches(op):
    """Five samples of 2 rows: the Dense is one launch; the two calls of the op
    (same depth, same shapes, different parameter arrays) are exactly two
    launches (one would mean one weight used for both)."""
    net = _made(Twins, op, prefix="twinc_")()
    net.hybridize(dynamic_batch=True, policy="depth")
    xs = _rows("twinc", lengths=(2, 2, 2, 2, 2))
    seen = launches_by_name(lambda: [y.asnumpy() for y in [net(x) for x in xs]])
    net.hybridize(active=False)
    assert seen.get(TWIN_OPS[op]) == 2, seen
    assert seen.get(net.dense.name) == 1, seen


class TwoBlocks(gluon.Block):
    """Two instances of one Block class (same structure, separate parameters)
    called on the same samples: their calls must not share weights."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.a = TiedLM("three", prefix="a_")
            self.b = TiedLM("three", prefix="b_")

    def forward(self, ids):  # pylint: disable=arguments-differ
        return self.a(ids) - 2 * self.b(ids)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_two_instances_of_one_block(policy, train):
    samples = _ids("two", lengths=(2, 2, 3, 1))
    _check(_made(TwoBlocks, prefix="twob_"),
           lambda net, pol: _loop(net, pol, samples, train, _lm), policy)


# -- one parameter at several positions ---------------------------------------------------

class Reuse(gluon.Block):
    """A square raw W used as FullyConnected weight, as take's table, as data of
    a FullyConnected (scores against its rows) and in elementwise arithmetic;
    the same vector as LayerNorm's gamma and beta at once."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.dense = gluon.nn.Dense(H, in_units=E)
            self.W = self.params.get("W", shape=(H, H))
            self.g = self.params.get("g", shape=(H,), init=mx.init.Uniform(1.0))

    def forward(self, x):  # pylint: disable=arguments-differ
        h = self.dense(x)
        a = nd.FullyConnected(h, self.W.data(), self.g.data(), num_hidden=H)
        a = a + nd.take(self.W.data(), nd.argmax(a, axis=1))
        a = nd.LayerNorm(a, self.g.data(), self.g.data())
        a = a * nd.sum(self.W.data(), axis=0)
        return nd.FullyConnected(a, self.W.data(), no_bias=True, num_hidden=H, flatten=False) \
            + nd.dot(a, self.W.data())


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_one_parameter_at_several_positions(policy, train):
    xs = _rows("reuse", lengths=(3, 1, 3, 2, 1))
    _check(_made(Reuse, prefix="reuse_"),
           lambda net, pol: _loop(net, pol, xs, train, lambda n, x: n(x)), policy)


# -- 3-D inputs, flatten, LayerNorm axis, Embedding of 2-D ids -----------------------------

class Shapes(gluon.Block):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.dense = gluon.nn.Dense(3 * E, in_units=E)
            self.wf = self.params.get("wf", shape=(H, 3 * E))
            self.wn = self.params.get("wn", shape=(H, E))
            self.g = self.params.get("g", shape=(3,), init=mx.init.Constant(1.5))
            self.bb = self.params.get("bb", shape=(3,))
            self.tab = self.params.get("tab", shape=(V, 3))

    def forward(self, x):  # pylint: disable=arguments-differ
        h = self.dense(x).reshape((0, 3, E))                                   # (T, 3, E)
        a = nd.FullyConnected(h, self.wf.data(), no_bias=True, num_hidden=H)  # flatten
        b = nd.FullyConnected(h, self.wn.data(), no_bias=True, num_hidden=H,
                              flatten=False)                                   # (T, 3, H)
        c = nd.LayerNorm(b, self.g.data(), self.bb.data(), axis=1)            # over axis 1
        ids = nd.argmax(b, axis=2)                                             # (T, 3)
        d = nd.Embedding(ids, self.tab.data(), input_dim=V, output_dim=3)     # (T, 3, 3)
        e = nd.take(self.tab.data(), ids, mode="wrap")                        # (T, 3, 3)
        return 0.3 * nd.concat(a, c.reshape((0, -1)), (d * e).reshape((0, -1)), dim=1)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", ["depth", "auto"])
def test_three_dimensional_rows(policy, train):
    xs = _rows("shapes", lengths=(2, 1, 3, 2, 1, 3))
    _check(_made(Shapes, prefix="shapes_"),
           lambda net, pol: _loop(net, pol, xs, train, lambda n, x: n(x)), policy)


# -- training over minibatches ---------------------------------------------------------------

def _train(net, policy, minibatches, steps_between=None, optimizer="sgd", mapped=False,
           lr=0.02):
    """Trainer steps over ``minibatches`` of token-id samples; ``steps_between(
    net, k)`` runs before minibatch k. Losses, gradients and parameters after."""
    flag(net, policy)
    tr = gluon.Trainer(net.collect_params(), optimizer, {"learning_rate": lr})
    out = []
    for k, batch in enumerate(minibatches):
        if steps_between is not None:
            steps_between(net, k)
        with autograd.record():
            if mapped:
                outs = jitbatch.map(net, batch)
            else:
                outs = [net(s) for s in batch]
            loss = nd.add_n(*[nd.sum(o * o) for o in outs])
        loss.backward()
        out += [o.asnumpy() for o in outs]
        out += [p.grad().asnumpy().copy() for p in net.collect_params().values()
                if p.grad_req != "null"]
        tr.step(len(batch))
    return out + params_of(net)


def _minibatches(key, count=3):
    return [_ids((key, k), lengths=LENGTHS[k:k + 4] or (2,)) for k in range(count)]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("policy", ["depth", "auto"])
def test_trainer_steps_tied_lm(policy, optimizer):
    mbs = _minibatches("tr")
    _check(_made(TiedLM, "three", prefix="trlm_"),
           lambda net, pol: _train(net, pol, mbs, optimizer=optimizer), policy)


@pytest.mark.parametrize("policy", ["depth", "auto"])
def test_trainer_steps_rnn_mapped(policy):
    mbs = _minibatches("trm")
    _check(_made(RNN, prefix="trmap_"),
           lambda net, pol: _train(net, pol, mbs, mapped=True), policy)


@pytest.mark.parametrize("policy", ["depth", "sequential"])
def test_trainer_steps_tree(policy):
    batches = [_trees(("tr", k), n=4) for k in range(3)]
    _check(_made(Tree, prefix="trtree_"),
           lambda net, pol: _train(net, pol, batches, lr=0.05), policy)


def _reinit(net, k):
    if k == 1:
        mx.random.seed(7)
        net.initialize(mx.init.Uniform(0.3), force_reinit=True)


def _set_data(net, k):
    if k >= 1:
        for i, p in enumerate(net.collect_params().values()):
            p.set_data(p.data() * (0.5 + 0.1 * i) + 0.01 * k)


def _cast_back(net, k):
    """Parameters replaced by new arrays (cast to float64 and back)."""
    if k == 1:
        net.cast("float64")
        net.cast("float32")


@pytest.mark.parametrize("between", ["reinit", "set_data", "cast"])
@pytest.mark.parametrize("policy", ["depth", "auto"])
def test_parameters_replaced_between_minibatches(policy, between):
    fn = {"reinit": _reinit, "set_data": _set_data, "cast": _cast_back}[between]
    mbs = _minibatches(("between", between))
    _check(_made(TiedLM, "three", prefix="btw_"),
           lambda net, pol: _train(net, pol, mbs, steps_between=fn), policy)


@pytest.mark.parametrize("policy", ["agenda"])
def test_reinit_rnn_between_minibatches(policy):
    mbs = _minibatches("rnnre")
    _check(_made(RNN, prefix="rnnre_"),
           lambda net, pol: _train(net, pol, mbs, steps_between=_reinit), policy)


def _accumulate(net, policy, batches):
    """grad_req 'add': gradients of several backward passes summed, no zeroing."""
    for p in net.collect_params().values():
        p.grad_req = "add"
    net.collect_params().zero_grad()
    flag(net, policy)
    out = []
    for batch in batches:
        with autograd.record():
            outs = [net(s) for s in batch]
            loss = nd.add_n(*[nd.sum(o * o) for o in outs])
        loss.backward()
        out += [o.asnumpy() for o in outs]
        out += [p.grad().asnumpy().copy() for p in net.collect_params().values()]
    return out


@pytest.mark.parametrize("model", ["lm", "rnn"])
@pytest.mark.parametrize("policy", ["depth", "auto"])
def test_grad_req_add(policy, model):
    make = _made(TiedLM, "three", prefix="add_") if model == "lm" else \
        _made(RNN, prefix="addr_")
    mbs = _minibatches(("add", model))
    _check(make, lambda net, pol: _accumulate(net, pol, mbs), policy)


def _frozen(net, policy, batch):
    net.embed.weight.grad_req = "null"
    net.gamma.grad_req = "null"
    return _loop(net, policy, batch, True, _lm)


@pytest.mark.parametrize("policy", ["depth", "sequential"])
def test_frozen_tied_embedding(policy):
    samples = _ids("frozen")
    _check(_made(TiedLM, "three", prefix="frz_"),
           lambda net, pol: _frozen(net, pol, samples), policy)


@pytest.mark.parametrize("policy", ["depth", "auto"])
def test_frozen_trained(policy):
    def prog(net, pol):
        # (not w: MXNet 1.9.1's FullyConnected backward with its weight frozen and
        # its bias not writes garbage into the bias gradient, per sample too)
        net.embed.weight.grad_req = "null"
        net.beta.grad_req = "null"
        return _train(net, pol, _minibatches("frzt"))
    _check(_made(TiedLM, "fc", prefix="frzt_"), prog, policy)


# -- writes while calls are pending ------------------------------------------------------------

def _write_pending(net, policy, samples, how):
    """Inference calls pending, then a parameter written in place; the outputs
    read after must be those of the old values (plain Gluon computed them at
    the call), and calls after the write use the new values."""
    flag(net, policy)
    before = [net(s) for s in samples]
    w = net.embed.weight
    if how == "setitem":
        w.data()[:] = w.data() * 2 + 0.1
    elif how == "set_data":
        w.set_data(nd.ones(w.shape) * 0.3)
    elif how == "iadd":
        d = w.data()
        d += 1.0
    elif how == "out":
        nd.elemwise_mul(w.data(), w.data(), out=w.data())
    elif how == "gamma":
        net.gamma.data()[:] = 3.0
    after = [net(s) for s in samples]
    return [o.asnumpy() for o in before + after]


@pytest.mark.parametrize("how", ["setitem", "set_data", "iadd", "out", "gamma"])
@pytest.mark.parametrize("policy", ["depth", "auto"])
def test_write_while_pending(policy, how):
    samples = _ids("wp")
    _check(_made(TiedLM, "three", prefix="wp_"),
           lambda net, pol: _write_pending(net, pol, samples, how), policy)


def _step_pending(net, policy, batches):
    """A Trainer step while inference calls of the next batch are pending
    (their outputs read after the step)."""
    flag(net, policy)
    tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.5})
    out = []
    for batch in batches:
        with autograd.record():
            loss = nd.add_n(*[nd.sum(net(s) ** 2) for s in batch])
        loss.backward()
        pending = [net(s) for s in batch]       # not recorded, pending
        tr.step(len(batch))
        out += [o.asnumpy() for o in pending]
    return out + params_of(net)


@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_trainer_step_while_pending(policy):
    mbs = _minibatches("sp")
    _check(_made(TiedLM, "three", prefix="sp_"),
           lambda net, pol: _step_pending(net, pol, mbs), policy)


# -- jitbatch.map ---------------------------------------------------------------------------

@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", ["depth", "auto"])
def test_map_tied_lm(policy, train):
    samples = _ids("map")

    def prog(net, pol):
        flag(net, pol)
        net.collect_params().zero_grad()
        if train:
            with autograd.record():
                outs = jitbatch.map(net, samples) if pol else [net(s) for s in samples]
                loss = nd.add_n(*[nd.sum(o * o) for o in outs])
            loss.backward()
        else:
            outs = jitbatch.map(net, samples) if pol else [net(s) for s in samples]
        res = [o.asnumpy() for o in outs]
        if train:
            res += [p.grad().asnumpy().copy() for p in net.collect_params().values()]
        return res
    _check(_made(TiedLM, "three", prefix="map_"), prog, policy)


@pytest.mark.parametrize("policy", ["depth", "auto"])
def test_map_tree(policy):
    trees = _trees("maptree", n=5)

    def prog(net, pol):
        flag(net, pol)
        net.collect_params().zero_grad()
        with autograd.record():
            outs = jitbatch.map(net, trees) if pol else [net(t) for t in trees]
            loss = nd.add_n(*[nd.sum(o * o) for o in outs])
        loss.backward()
        return [o.asnumpy() for o in outs] + \
            [p.grad().asnumpy().copy() for p in net.collect_params().values()]
    _check(_made(Tree, prefix="maptree_"), prog, policy)


# -- deferred initialization ------------------------------------------------------------------

class Deferred(gluon.Block):
    """nn.Dense without in_units (its weight's shape known at its first call)
    whose weight is then used by the user's own FullyConnected and take."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.dense = gluon.nn.Dense(H)
            self.ln = gluon.nn.LayerNorm()
            self.w = self.params.get("w", shape=(H, H))

    def forward(self, x):  # pylint: disable=arguments-differ
        h = self.ln(self.dense(x))                                             # (T, H)
        a = nd.FullyConnected(h, self.w.data(), no_bias=True, num_hidden=H)
        a = nd.LayerNorm(a, self.ln.gamma.data(), self.ln.beta.data())
        # the Dense's weight (H, E) tied back: rows to E values
        return nd.FullyConnected(a, self.dense.weight.data().T, no_bias=True, num_hidden=E) \
            + nd.FullyConnected(a, self.w.data(), self.dense.bias.data(),
                                num_hidden=H, flatten=False).sum(axis=1, keepdims=True)


def _deferred(order):
    def make():
        mx.random.seed(3)
        net = Deferred(prefix="defer_")
        if order == "initialize_first":
            net.initialize(mx.init.Uniform(0.5))
        return net
    return make


def _deferred_prog(order, samples, train):
    def prog(net, pol):
        flag(net, pol)
        if order == "hybridize_first":
            net.initialize(mx.init.Uniform(0.5))
        return _loop_nozero(net, samples, train)
    return prog


def _loop_nozero(net, samples, train):
    if train:
        with autograd.record():
            outs = [net(s) for s in samples]
            loss = nd.add_n(*[nd.sum(o * o) for o in outs])
        loss.backward()
    else:
        outs = [net(s) for s in samples]
    res = [o.asnumpy() for o in outs]
    if train:
        res += [p.grad().asnumpy().copy() for p in net.collect_params().values()]
    return res


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("order", ["hybridize_first", "initialize_first"])
@pytest.mark.parametrize("policy", ["depth", "auto"])
def test_deferred_initialization(policy, order, train):
    xs = _rows("deferred", lengths=(2, 1, 3, 2))
    _check(_deferred(order), _deferred_prog(order, xs, train), policy)


def _tied_hybridize_first(net, pol, samples, train):
    flag(net, pol)
    mx.random.seed(0)
    net.initialize(mx.init.Uniform(0.5))
    return _loop_nozero(net, samples, train)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", ["depth", "auto"])
def test_block_hybridized_before_initialize(policy, train):
    samples = _ids("hbi")

    def make():
        return TiedLM("three", prefix="hbi_")
    _check(make, lambda net, pol: _tied_hybridize_first(net, pol, samples, train), policy)


# -- launch counts (depth) ---------------------------------------------------------------------

class Flat(gluon.Block):
    """One Dense, then raw FullyConnected, Embedding, take and LayerNorm, then
    a tied output layer; all samples of one length."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.dense = gluon.nn.Dense(H, in_units=E)
            self.w = self.params.get("w", shape=(H, H))
            self.tab = self.params.get("tab", shape=(V, H))
            self.g = self.params.get("g", shape=(H,))
            self.b = self.params.get("b", shape=(H,))

    def forward(self, x):  # pylint: disable=arguments-differ
        h = nd.FullyConnected(self.dense(x), self.w.data(), self.b.data(), num_hidden=H)
        h = h + nd.Embedding(nd.argmax(h, axis=1), self.tab.data(), input_dim=V, output_dim=H)
        h = h + nd.take(self.tab.data(), nd.argmin(h, axis=1))
        h = nd.LayerNorm(h, self.g.data(), self.b.data())
        return nd.FullyConnected(h, self.tab.data(), no_bias=True, num_hidden=V)


@pytest.mark.parametrize("rows", [1, 3])
def test_flat_launch_counts(rows):
    """Six samples of ``rows`` rows, one signature each: every operator on a
    parameter is one launch (six were the count before the shared rule), the
    FullyConnected two (the W one and the tied table one: two weights)."""
    net = _made(Flat, prefix="flat_")()
    xs = _rows(("flat", rows), lengths=(rows,) * 6)
    want = [net(x).asnumpy() for x in xs]
    net.hybridize(dynamic_batch=True, policy="depth")
    got = []
    seen = launches_by_name(lambda: got.extend(y.asnumpy() for y in [net(x) for x in xs]))
    net.hybridize(active=False)
    same_values(want, got, "flat")
    assert seen.get(net.dense.name) == 1, seen
    assert seen.get("FullyConnected") == 2, seen
    assert seen.get("Embedding") == 1, seen
    assert seen.get("take") == 1, seen
    assert seen.get("LayerNorm") == 1, seen


def test_flat_launch_counts_by_length():
    """Lengths 1, 3, 1, 3, 2: no ragged merging for calls on parameters, so each
    operator on a parameter runs once per length (3)."""
    net = _made(Flat, prefix="flatl_")()
    xs = _rows("flatl", lengths=(1, 3, 1, 3, 2))
    want = [net(x).asnumpy() for x in xs]
    net.hybridize(dynamic_batch=True, policy="depth")
    got = []
    seen = launches_by_name(lambda: got.extend(y.asnumpy() for y in [net(x) for x in xs]))
    net.hybridize(active=False)
    same_values(want, got, "flatl")
    assert seen.get("Embedding") == 3, seen
    assert seen.get("take") == 3, seen
    assert seen.get("LayerNorm") == 3, seen
    assert seen.get("FullyConnected") == 6, seen


def test_per_call_array_with_parameter_shape_not_merged_with_it():
    """A weight made per call with the values of the parameter (a copy) is not a
    parameter: its calls run one per call, and never join the parameter's
    launch (two signatures, values equal)."""
    net = _made(Flat, prefix="copyw_")()

    def fwd(x, copy):
        h = net.dense(x)
        w = net.w.data().copy() if copy else net.w.data()
        return nd.FullyConnected(h, w, no_bias=True, num_hidden=H)
    xs = _rows("copyw", lengths=(2,) * 4)
    want = [fwd(x, k % 2 == 0).asnumpy() for k, x in enumerate(xs)]
    net.hybridize(dynamic_batch=True, policy="depth")
    got = []
    seen = launches_by_name(lambda: got.extend(
        y.asnumpy() for y in [fwd(x, k % 2 == 0) for k, x in enumerate(xs)]))
    net.hybridize(active=False)
    same_values(want, got, "copy")
    assert seen.get("FullyConnected") == 3, seen     # two per call (copies) + one merged


# -- found discrepancies -------------------------------------------------------------------------

class VectorRNN(gluon.Block):
    """DyNet-style RNN over 1-D state vectors: FullyConnected(flatten=False) of a
    (H,) vector with a square raw Wh."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.embed = gluon.nn.Embedding(V, H)
            self.wx = self.params.get("wx", shape=(H, H))
            self.wh = self.params.get("wh", shape=(H, H))
            self.b = self.params.get("b", shape=(H,))

    def forward(self, ids):  # pylint: disable=arguments-differ
        x = self.embed(ids)
        h = nd.zeros((H,))
        for t in range(ids.shape[0]):
            h = nd.tanh(nd.FullyConnected(x[t], self.wx.data(), self.b.data(), num_hidden=H,
                                          flatten=False) +
                        nd.FullyConnected(h, self.wh.data(), no_bias=True, num_hidden=H,
                                          flatten=False))
        return h


@pytest.mark.parametrize("policy", ["depth", "auto"])
def test_vector_rnn_flatten_false(policy):
    samples = _ids("vec", lengths=(3, 2, 3))
    _check(_made(VectorRNN, prefix="vec_"),
           lambda net, pol: _loop(net, pol, samples, False, lambda n, s: n(s)), policy)


class HalfShared(gluon.Block):
    """One weight argument a parameter, the other made per call or computed."""

    def __init__(self, mode, **kwargs):
        super().__init__(**kwargs)
        self.mode = mode
        with self.name_scope():
            self.d = gluon.nn.Dense(H, in_units=E)
            self.w = self.params.get("w", shape=(H, H))
            self.g = self.params.get("g", shape=(H,), init=mx.init.Constant(1.3))

    def forward(self, x):  # pylint: disable=arguments-differ
        h = self.d(x)
        if self.mode == "fc_zero_bias":
            return nd.FullyConnected(h, self.w.data(), nd.zeros((H,)), num_hidden=H)
        if self.mode == "fc_computed_bias":
            return nd.FullyConnected(h, self.w.data(), nd.mean(h, axis=0), num_hidden=H)
        if self.mode == "fc_copied_weight":
            return nd.FullyConnected(h, self.w.data().copy(), self.g.data(), num_hidden=H)
        return nd.LayerNorm(h, nd.ones((H,)), self.g.data())


@pytest.mark.parametrize("mode", ["fc_zero_bias", "fc_computed_bias", "fc_copied_weight",
                                  "ln_ones_gamma"])
@pytest.mark.parametrize("policy", ["depth"])
def test_half_shared_other_row_count(policy, mode):
    """Rows per sample != H: the non-parameter weight cannot be read as rows
    (lead lengths differ), so these run one launch per call, as plain Gluon."""
    xs = _rows(("half", mode), lengths=(2, 2, 3, 1))
    _check(_made(HalfShared, mode, prefix="half_"),
           lambda net, pol: _loop(net, pol, xs, True, lambda n, x: n(x)), policy)


@pytest.mark.parametrize("mode", ["fc_zero_bias", "fc_computed_bias", "fc_copied_weight",
                                  "ln_ones_gamma"])
@pytest.mark.parametrize("policy", ["depth"])
def test_half_shared_rows_equal_weight_length(policy, mode):
    xs = _rows(("halfeq", mode), lengths=(H, H, H))
    _check(_made(HalfShared, mode, prefix="halfeq_"),
           lambda net, pol: _loop(net, pol, xs, False, lambda n, x: n(x)), policy)


def _lm_counts(order_or_change):
    """Launches by name of six 2-token samples through TiedLM('fc') set up by
    ``order_or_change`` under depth (hybridized once, never re-hybridized: that
    would note the parameters again); values checked against a plain twin."""
    samples = _ids("gap", lengths=(2,) * 6)
    plain = TiedLM("fc", prefix="gap_")
    initialized_lm(plain, 3 if order_or_change == "force_reinit" else 0)
    want = [plain(s).asnumpy() for s in samples]
    net = TiedLM("fc", prefix="gap_")
    if order_or_change != "hybridize_first":
        initialized_lm(net)
    net.hybridize(dynamic_batch=True, policy="depth")
    if order_or_change == "hybridize_first":
        initialized_lm(net)
    if order_or_change == "force_reinit":
        [y.asnumpy() for y in [net(s) for s in samples]]
        initialized_lm(net, 3, force_reinit=True)
    got = []
    seen = launches_by_name(lambda: got.extend(y.asnumpy() for y in [net(s) for s in samples]))
    net.hybridize(active=False)
    same_values(want, got, order_or_change)
    return seen


def initialized_lm(net, seed=0, force_reinit=False):
    mx.random.seed(seed)
    net.initialize(mx.init.Uniform(0.5), force_reinit=force_reinit)


def test_tied_lm_counts_initialized_first():
    """Six samples of 2 tokens, initialize then hybridize: the raw projection
    FullyConnected and the tied one are one launch each (2), LayerNorm one."""
    seen = _lm_counts("initialize_first")
    assert seen.get("FullyConnected") == 2 and seen.get("LayerNorm") == 1, seen


def test_tied_lm_counts_hybridized_first():
    seen = _lm_counts("hybridize_first")
    assert seen.get("FullyConnected") == 2 and seen.get("LayerNorm") == 1, seen


def test_tied_lm_counts_after_force_reinit():
    seen = _lm_counts("force_reinit")
    assert seen.get("FullyConnected") == 2 and seen.get("LayerNorm") == 1, seen
