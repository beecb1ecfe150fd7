"""Held-out programs, round 26: sums of any number of inputs (``nd.add_n``,
``nd.ElementWiseSum``) merged across arities, and policy 'auto' over
programs that switch between training and inference, written the way users
write them.

* Graph networks and message passing (each node sums its neighbours'
  messages with one ``add_n`` of its degree, a read-out sums all the graph's
  nodes: arities 1 to several hundred in one flush), a child-sum Tree-LSTM
  summing its children's states and gated cells, a deep-sets model over sets
  of 1-12 elements, a DAG-LSTM on Gluon's ``LSTMCell`` summing its
  predecessors' hidden and cell states, convolution branches summed per
  image, bags of sets (some empty, under ``mx.util.np_shape``); trained with
  a Trainer, ``grad_req='add'`` over two minibatches,
  ``backward(retain_graph=True)`` twice, ``config.max_pending`` small.
* Sums mixing lazy outputs with concrete arrays (a constant, a zero state
  made before or while the graph pends, the same array twice, an input with
  ``attach_grad``), of views of a lazy output (``h[0:1]``, ``h[i]``), of
  per-sample shapes ``(H,)``, ``(1, H)``, ``(2, H)``, ``(1, S, H)``, of
  outputs of different blocks, with ``num_args=`` given by hand, ``out=`` a
  buffer, written in place after, Python's builtin ``sum``; sums in float16,
  float64 and integer types; NaN, inf and -0.0 (bit for bit where the inputs
  are computed exactly: a block doing ``x * 2.0``); ``F.add_n`` and
  ``F.ElementWiseSum`` inside a flagged HybridBlock; sums read mid-sample
  (``.asnumpy()`` per sample) and in ``jitbatch.map``; sums on two devices.
  Where plain Gluon raises (no inputs, shapes or dtypes that differ, a
  ``num_args`` that is not the count, an in-place sum inside
  ``autograd.record``), the flagged run must raise the same kind of error.
* 'auto' over interleaved training and inference steps, re-hybridized
  between them (policy, ``hybridize(active=False)``), minibatch sizes
  changing: the numbers are plain Gluon's; and, with a fresh cost model, no
  merging policy is left untried (a policy measured on fewer than three
  flushes runs again after cost.REPROBE_FEW flushes): asserted from
  ``jitbatch.stats()['last_flush']`` alone, never from times.

The oracle is plain per-sample Gluon (no hybridize) on the same parameters and
inputs: outputs, losses, gradients and parameters after the steps, under the
policies auto, depth, agenda and sequential. Launch counts are asserted under
'depth' and 'agenda' only.

Findings, kept as strict expected failures: a ``num_args`` that is not the
number of inputs, which MXNet refuses, is silently accepted once a sum of
that arity class has a signature (its key leaves ``num_args`` out); under
``mx.util.np_shape(True)`` a flagged block whose output has a zero-length
axis (a Dense over an empty set's elements) is refused with an error that
blames a value-dependent shape, where plain Gluon returns the empty array.
"""
import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import Block, HybridBlock, nn

import jitbatch
from jitbatch import cost
from oracle import cleanup
from heldout import initialized as init
from heldout import (both, flag, grads_of, merged, nothing_pending, params_of,  # noqa: F401
                     error_of, rng_for, same_values as same)

POLICIES = ["auto", "depth", "agenda", "sequential"]
POLICY = pytest.mark.parametrize("policy", POLICIES)
#: the policies whose launches are planned from the graph alone: launch
#: counts are asserted under these ('auto' may run a small flush sequentially)
MERGING = ["depth", "agenda"]
H = 4
L2 = gluon.loss.L2Loss()



class Double(HybridBlock):
    """An exact block: ``x * 2.0`` rounds nothing (short of overflow), so sums
    of its outputs are the same bits in any grouping of launches."""

    def hybrid_forward(self, F, x):
        return x * 2.0


def bits_equal(want, got, what):
    """The same values bit for bit (NaN payloads and signs of zero included)."""
    assert len(want) == len(got), what
    for i, (a, b) in enumerate(zip(want, got)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, (what, i, a.dtype, b.dtype,
                                                           a.shape, b.shape)
        assert a.tobytes() == b.tobytes(), "%s %d: plain %r, jitbatch %r" % (what, i, a, b)


# -- 1. message passing: each node sums its neighbours ---------------------------------------
class GraphNet(Block):
    """A message-passing network per graph: node features (n, F) embedded row
    by row, two rounds in which each node adds the sum of its neighbours'
    messages (one ``add_n`` of its degree) to its own state, then a read-out
    summing every node (one ``add_n`` of n inputs) into a Dense head."""

    def __init__(self, feats=3, **kw):
        super(GraphNet, self).__init__(**kw)
        with self.name_scope():
            self.embed = nn.Dense(H, in_units=feats, activation="tanh")
            self.msg = nn.Dense(H, in_units=H)
            self.upd = nn.Dense(H, in_units=2 * H, activation="tanh")
            self.head = nn.Dense(2, in_units=H)

    def forward(self, x, adj):  # pylint: disable=arguments-differ
        n = x.shape[0]
        h = [self.embed(x[i:i + 1]) for i in range(n)]
        for _ in range(2):
            m = [self.msg(v) for v in h]
            agg = [nd.add_n(*[m[j] for j in adj[i]]) if adj[i] else nd.zeros((1, H), dtype=x.dtype)
                   for i in range(n)]
            h = [self.upd(nd.concat(h[i], agg[i], dim=1)) for i in range(n)]
        return self.head(nd.add_n(*h))


def random_graphs(key, count, lo=1, hi=9, feats=3):
    """``count`` graphs of ``lo``..``hi`` nodes, each edge present with
    probability 0.4 (isolated nodes included), as (features, adjacency lists)."""
    rng = rng_for(*key)
    out = []
    for _ in range(count):
        n = int(rng.integers(lo, hi + 1))
        adj = [[] for _ in range(n)]
        for i in range(n):
            for j in range(i + 1, n):
                if rng.random() < 0.4:
                    adj[i].append(j)
                    adj[j].append(i)
        out.append((nd.array(rng.normal(size=(n, feats))), adj,
                    nd.array(rng.normal(size=(1, 2)))))
    return out


def train_steps(net, policy, batches, apply, opt="sgd", args=None, add=False):
    """A Trainer over ``batches``: per minibatch the per-sample losses
    (``apply(net, sample) -> (output, loss)``) recorded and backpropagated,
    outputs, losses and gradients read, a step; with ``add``
    (``grad_req='add'``) two minibatches per step and zero_grad after it."""
    flag(net, policy)
    if add:
        net.collect_params().setattr("grad_req", "add")
    tr = gluon.Trainer(net.collect_params(), opt, dict(args or {"learning_rate": 0.1}))
    out = []
    for k, batch in enumerate(batches):
        with autograd.record():
            pairs = [apply(net, s) for s in batch]
            loss = nd.add_n(*[l for _, l in pairs])
        loss.backward()
        out += [o.asnumpy() for o, _ in pairs] + [loss.asnumpy()] + grads_of(net)
        if not add or k % 2:
            tr.step(len(batch))
            if add:
                net.collect_params().zero_grad()
            out += params_of(net)
    return out


def trained_alike(make, policy, what, batches, apply, *optimizer, add=False, merging=True):
    """The same training steps (``train_steps``) on a plain and a flagged copy
    of ``make()``: the same values; under a merging policy, calls merged
    (``merging``)."""
    want, got, st = both(lambda: init(make()), lambda n, p: train_steps(
        n, p, batches, apply, *optimizer, add=add), policy)
    same(want, got, "%s under %s" % (what, policy))
    if merging and policy in MERGING:
        assert merged(st), st


def graph_apply(net, s):
    x, adj, t = s
    y = net(x, adj)
    return y, L2(y, t).sum()


@POLICY
def test_message_passing_graph_network_trains(policy):
    """Three SGD steps (momentum) of a graph network over graphs of 1-9 nodes:
    neighbour sums of degree 0-8 and read-outs of 1-9 nodes, all arities in
    each flush."""
    batches = [random_graphs(("gnn", k), 6) for k in range(3)]
    trained_alike(lambda: GraphNet(prefix="gnn_"), policy, "graph network", batches, graph_apply,
                  "sgd", {"learning_rate": 0.1, "momentum": 0.9})


@pytest.mark.parametrize("policy", ["auto", "depth", "agenda"])
def test_message_passing_accumulated_over_two_minibatches(policy):
    """``grad_req='add'``: two minibatches of graphs per Adam step."""
    batches = [random_graphs(("gnn-add", k), 4) for k in range(4)]
    trained_alike(lambda: GraphNet(prefix="gnna_"), policy, "accumulated graph network",
                  batches, graph_apply, "adam", {"learning_rate": 0.05}, add=True,
                  merging=False)


@pytest.mark.parametrize("policy", MERGING)
def test_neighbour_sums_of_every_degree_are_two_launches_per_round(policy):
    """Counters: one complete graph per node count 2..9 (inference): neighbour
    sums of degrees 1-8 and read-outs of 2-9 nodes. The embedding is one
    launch; per round the messages one, the neighbour sums two (degrees 1-4
    and 5-8), the concatenations one, the updates one; the read-outs two (2-4
    and 5-9 nodes), the head one: 14, not one launch per degree."""
    graphs = []
    for n in range(2, 10):       # a complete graph of n nodes: degree n - 1
        graphs.append((nd.array(rng_for("complete", n).normal(size=(n, 3))),
                       [[j for j in range(n) if j != i] for i in range(n)]))
    net = init(GraphNet(prefix="gnnc_"))
    want = [net(x, adj).asnumpy() for x, adj in graphs]
    net.hybridize(dynamic_batch=True, policy=policy)
    jitbatch.reset_stats()
    ys = [net(x, adj) for x, adj in graphs]
    got = [y.asnumpy() for y in ys]
    same(want, got, "complete graphs under %s" % policy)
    st = jitbatch.stats()
    assert st["flushes"] == 1, st
    assert st["launches"] == 1 + 2 * (1 + 2 + 1 + 1) + 2 + 1, st["launches"]


# -- 2. read-outs summing hundreds of nodes ---------------------------------------------------
READOUT_SIZES = [1, 2, 3, 4, 5, 6, 17, 64, 65, 300, 4, 1]


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@POLICY
def test_readouts_of_up_to_hundreds_of_nodes_bit_for_bit(policy, dtype):
    """A read-out ``nd.add_n(*node_states)`` per graph, graphs of 1 to 300
    nodes, the node states an exact block's outputs (cast to ``dtype``): the
    sums are plain Gluon's bit for bit, NaN, inf and -0.0 included."""
    rng = rng_for("readout", dtype)
    specials = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1.0, -1.5, 1e-3, 2.5e4])
    graphs = []
    for n in READOUT_SIZES:
        vals = rng.normal(size=(n, 1, H)) * 10.0 ** rng.integers(-3, 3, size=(n, 1, 1))
        mask = rng.random(size=vals.shape) < 0.15
        vals[mask] = rng.choice(specials, size=int(mask.sum()))
        graphs.append([nd.array(v, dtype=dtype) for v in vals])
    graphs.append([nd.array(np.full((1, H), -0.0), dtype=dtype)] * 3)   # -0.0 + -0.0 + -0.0
    graphs.append([nd.array(np.full((1, H), -0.0), dtype=dtype)] * 7)

    def program(net, policy):
        flag(net, policy)
        sums = [nd.add_n(*[net(v) for v in g]) for g in graphs]
        return [v.asnumpy() for v in sums]
    want, got, st = both(lambda: _double(dtype), program, policy)
    bits_equal(want, got, "read-outs (%s) under %s" % (dtype, policy))
    if policy in MERGING:
        # the doublings (one launch), the sums of 1-4 and of 5+ inputs (one each)
        assert st["launches"] == 3, st["launches"]


def _double(dtype):
    d = Double(prefix="double_")
    d.cast(dtype)
    return d


@POLICY
def test_readouts_of_a_learned_block_with_hundreds_of_nodes(policy):
    """The same read-outs of a Dense layer's outputs under autograd: the
    gradients reach every node of every graph (within the tolerance: merged
    Dense launches round otherwise)."""
    rng = rng_for("readout-dense")
    graphs = [nd.array(rng.normal(size=(n, 3))) for n in READOUT_SIZES]

    def program(net, policy):
        flag(net, policy)
        with autograd.record():
            outs = [nd.add_n(*[net(g[i:i + 1]) for i in range(g.shape[0])]) for g in graphs]
            loss = nd.add_n(*[nd.sum(nd.tanh(o)) for o in outs])
        loss.backward()
        return [o.asnumpy() for o in outs] + [loss.asnumpy()] + grads_of(net)
    want, got, st = both(lambda: init(nn.Dense(H, in_units=3, prefix="ro_")), program,
                         policy)
    same(want, got, "Dense read-outs under %s" % policy)
    if policy in MERGING:
        assert merged(st), st


# -- 3. trees and sets: child sums, sum pooling -----------------------------------------------
class ChildSumTreeLSTM(Block):
    """Tai et al.'s child-sum Tree-LSTM, per tree, recursively: ``h~`` is the
    ``add_n`` of the children's hidden states, the cell the ``add_n`` of
    ``i * u`` and every child's forget-gated cell (1 + children inputs);
    a leaf's ``h~`` is a zero state, one array made before the trees
    (``zero='shared'``) or ``nd.zeros`` per leaf (``zero='per-leaf'``)."""

    def __init__(self, zero, feats=3, **kw):
        super(ChildSumTreeLSTM, self).__init__(**kw)
        self.zero = zero
        self.shared_zero = nd.zeros((1, H))
        with self.name_scope():
            self.iou_x = nn.Dense(3 * H, in_units=feats)
            self.iou_h = nn.Dense(3 * H, in_units=H, use_bias=False)
            self.f_x = nn.Dense(H, in_units=feats)
            self.f_h = nn.Dense(H, in_units=H, use_bias=False)
            self.head = nn.Dense(2, in_units=H)

    def node(self, feats, tree):
        idx, kids = tree
        x = feats[idx:idx + 1]
        states = [self.node(feats, k) for k in kids]
        if states:
            h_sum = nd.add_n(*[h for h, _ in states])
        else:
            h_sum = self.shared_zero if self.zero == "shared" else nd.zeros((1, H))
        i, o, u = nd.split(self.iou_x(x) + self.iou_h(h_sum), num_outputs=3, axis=1)
        c = nd.sigmoid(i) * nd.tanh(u)
        if states:
            fx = self.f_x(x)
            c = nd.add_n(c, *[nd.sigmoid(fx + self.f_h(h)) * ck for h, ck in states])
        return nd.sigmoid(o) * nd.tanh(c), c

    def forward(self, feats, tree):  # pylint: disable=arguments-differ
        return self.head(self.node(feats, tree)[0])


def random_trees(key, count, most=10, kids=6):
    """``count`` trees of 1-``most`` nodes, up to ``kids`` children a node,
    as (node features, nested (index, children), target)."""
    rng = rng_for(*key)
    out = []
    for _ in range(count):
        n = int(rng.integers(1, most + 1))
        children = {0: []}
        for i in range(1, n):
            parents = [p for p in children if len(children[p]) < kids]
            p = parents[int(rng.integers(0, len(parents)))]
            children[p].append(i)
            children[i] = []

        def nest(i):
            return (i, [nest(c) for c in children[i]])
        out.append((nd.array(rng.normal(size=(n, 3))), nest(0),
                    nd.array(rng.normal(size=(1, 2)))))
    return out


def tree_apply(net, s):
    feats, tree, t = s
    y = net(feats, tree)
    return y, L2(y, t).sum()


@POLICY
@pytest.mark.parametrize("zero", ["shared", "per-leaf"])
def test_child_sum_tree_lstm_trains(policy, zero):
    """Three Adam steps over trees of 1-10 nodes with up to 6 children a node:
    child sums of 1-6 hidden states, cell sums of 2-7 inputs."""
    batches = [random_trees(("tree", k), 5) for k in range(3)]
    trained_alike(lambda: ChildSumTreeLSTM(zero, prefix="cst_"), policy,
                  "child-sum Tree-LSTM (%s zero)" % zero, batches, tree_apply, "adam",
                  {"learning_rate": 0.05})


@pytest.mark.parametrize("policy", ["auto", "agenda"])
def test_child_sum_tree_lstm_accumulated(policy):
    """``grad_req='add'``: two minibatches of trees per SGD step."""
    batches = [random_trees(("tree-add", k), 3) for k in range(4)]
    trained_alike(lambda: ChildSumTreeLSTM("shared", prefix="csa_"), policy,
                  "accumulated child-sum Tree-LSTM", batches, tree_apply, add=True,
                  merging=False)


class DagLSTM(Block):
    """A DAG-LSTM with Gluon's ``LSTMCell``: each node's state is the cell over
    its features and the sums (``add_n``) of its predecessors' hidden and
    cell states (a node may have several successors); the sinks' hidden
    states summed into the head. Sources start from the cell's begin state."""

    def __init__(self, **kw):
        super(DagLSTM, self).__init__(**kw)
        with self.name_scope():
            self.cell = gluon.rnn.LSTMCell(H, input_size=3)
            self.head = nn.Dense(2, in_units=H)

    def forward(self, feats, preds):  # pylint: disable=arguments-differ
        states = []
        for i, ps in enumerate(preds):
            if ps:
                st = [nd.add_n(*[states[j][0] for j in ps]),
                      nd.add_n(*[states[j][1] for j in ps])]
            else:
                st = self.cell.begin_state(batch_size=1)
            _, st = self.cell(feats[i:i + 1], st)
            states.append(st)
        used = {j for ps in preds for j in ps}
        return self.head(nd.add_n(*[states[i][0] for i in range(len(preds)) if i not in used]))


def random_dags(key, count, most=8):
    """DAGs of 1-``most`` nodes in topological order, each node's predecessors
    a random subset (up to 5) of the nodes before it."""
    rng = rng_for(*key)
    out = []
    for _ in range(count):
        n = int(rng.integers(1, most + 1))
        preds = [sorted(set(int(j) for j in rng.integers(0, i, size=int(rng.integers(0, 6)))))
                 if i else [] for i in range(n)]
        out.append((nd.array(rng.normal(size=(n, 3))), preds,
                    nd.array(rng.normal(size=(1, 2)))))
    return out


@POLICY
def test_dag_lstm_with_gluon_lstm_cell_trains(policy):
    """Two SGD steps: the sums of hidden and of cell states read the same
    nodes' two state outputs, in sums of 1-5 predecessors."""
    batches = [random_dags(("dag", k), 5) for k in range(2)]

    def apply(net, s):
        feats, preds, t = s
        y = net(feats, preds)
        return y, L2(y, t).sum()
    trained_alike(lambda: DagLSTM(prefix="dag_"), policy, "DAG-LSTM", batches, apply)


class DeepSets(Block):
    """Zaheer et al.'s deep sets per set: ``rho(sum of phi(element)))``, the
    elements the rows of the set's (n, F) array, the sum one ``add_n`` of n."""

    def __init__(self, **kw):
        super(DeepSets, self).__init__(**kw)
        with self.name_scope():
            self.phi = nn.Dense(H, in_units=3, activation="tanh")
            self.rho = nn.Dense(2, in_units=H)

    def forward(self, x):  # pylint: disable=arguments-differ
        return self.rho(nd.add_n(*[self.phi(x[i:i + 1]) for i in range(x.shape[0])]))


@pytest.mark.parametrize("policy", MERGING)
def test_deep_sets_of_any_size_are_four_launches(policy):
    """Counters: sets of 1-12 elements (inference): every element's ``phi`` is
    one launch, the sums two (1-4 and 5-12 elements), ``rho`` one."""
    rng = rng_for("sets-count")
    sets = [nd.array(rng.normal(size=(n, 3))) for n in range(1, 13)]
    net = init(DeepSets(prefix="dsc_"))
    want = [net(s).asnumpy() for s in sets]
    net.hybridize(dynamic_batch=True, policy=policy)
    jitbatch.reset_stats()
    ys = [net(s) for s in sets]
    got = [y.asnumpy() for y in ys]
    same(want, got, "deep sets under %s" % policy)
    assert jitbatch.stats()["launches"] == 4, jitbatch.stats()["launches"]


@POLICY
@pytest.mark.parametrize("grad_req", ["write", "add"])
def test_deep_sets_backward_twice_with_retain_graph(policy, grad_req):
    """``loss.backward(retain_graph=True)``, the gradients read, a second
    backward of the same loss (``'add'``: doubled), outputs read between."""
    rng = rng_for("sets")
    sets = [nd.array(rng.normal(size=(int(n), 3))) for n in rng.integers(1, 13, size=7)]

    def program(net, policy):
        flag(net, policy)
        net.collect_params().setattr("grad_req", grad_req)
        with autograd.record():
            ys = [net(s) for s in sets]
            loss = nd.add_n(*[nd.sum(y * y) for y in ys])
        loss.backward(retain_graph=True)
        out = grads_of(net)
        out += [y.asnumpy() for y in ys]
        loss.backward()
        return out + grads_of(net) + [loss.asnumpy()]
    want, got, st = both(lambda: init(DeepSets(prefix="ds_")), program, policy)
    same(want, got, "deep sets, retain_graph, grad_req %s, under %s" % (grad_req, policy))
    if policy in MERGING:
        assert merged(st), st


# -- 4. sums mixing lazy outputs, concrete arrays and views -----------------------------------
CONST = nd.array(rng_for("const").normal(size=(1, H)))
ZERO = nd.zeros((1, H))


def three_blocks():
    """Two Dense layers (one over a (1, S, H) sample, ``flatten=False``) and an
    exact doubling."""
    return [init(nn.Dense(H, in_units=H, flatten=False, prefix="a_"), 0),
            init(nn.Dense(H, in_units=H, flatten=False, prefix="b_"), 1),
            Double(prefix="dbl_")]


#: per-sample programs ``(a, b, dbl, x, k) -> a sum``: ``x`` the k-th sample's
#: (2, H) input; the arities vary with ``k``
MIXED = {
    "a-constant": lambda a, b, d, x, k: nd.add_n(a(x[0:1]), *[CONST] * (k % 3 + 1)),
    "a-zero-state-made-before": lambda a, b, d, x, k: nd.add_n(ZERO, *[a(x[0:1])] * (k % 4 + 1)),
    "a-zero-state-made-per-sample": lambda a, b, d, x, k: nd.add_n(
        a(x[0:1]), nd.zeros((1, H)), *[d(x[1:2])] * (k % 5)),
    "the-same-lazy-array-repeated": lambda a, b, d, x, k: _repeat(a(x[0:1]), k),
    "the-same-input-twice": lambda a, b, d, x, k: nd.add_n(x[0:1], a(x[0:1]), x[0:1],
                                                           *[x[1:2]] * (k % 4)),
    "rows-of-one-output": lambda a, b, d, x, k: nd.add_n(*[a(x)[j:j + 1] for j in range(2)] * (
        k % 3 + 1)),
    "rows-of-one-output-squeezed": lambda a, b, d, x, k: _squeezed(a(x), k),
    "(2,H)-samples": lambda a, b, d, x, k: nd.add_n(a(x), *[b(x)] * (k % 6), d(x)),
    "(1,S,H)-samples": lambda a, b, d, x, k: nd.add_n(*[a(x.expand_dims(0))] * (k % 3 + 1),
                                                     x.expand_dims(0), b(x.expand_dims(0))),
    "outputs-of-three-blocks": lambda a, b, d, x, k: nd.add_n(
        *[a(x[0:1]), b(x[1:2]), d(x[0:1]), b(x[0:1]), a(x[1:2]), d(x[1:2])][:k % 6 + 1]),
    "num_args-given": lambda a, b, d, x, k: nd.add_n(*_parts(a, b, x, k),
                                                     num_args=len(_parts(a, b, x, k))),
    "ElementWiseSum": lambda a, b, d, x, k: nd.ElementWiseSum(*_parts(a, b, x, k)),
    "builtin-sum": lambda a, b, d, x, k: sum(_parts(a, b, x, k)),
    "sums-of-sums": lambda a, b, d, x, k: nd.add_n(nd.add_n(*_parts(a, b, x, k)),
                                                   nd.add_n(*_parts(b, a, x, k + 1)), CONST),
    "concats-of-outputs": lambda a, b, d, x, k: nd.add_n(
        nd.concat(a(x[0:1]), b(x[1:2]), dim=0), *[a(x)] * (k % 5), nd.concat(
            d(x[1:2]), x[0:1], dim=0)),
    "stacks-of-rows": lambda a, b, d, x, k: nd.add_n(
        nd.stack(a(x[0:1]), b(x[1:2]), axis=1), *[a(x.expand_dims(0))] * (k % 6)),
    "reshaped-outputs": lambda a, b, d, x, k: nd.add_n(
        *[a(x).reshape((1, 2 * H)), b(x).reshape((1, -1)), x.reshape((1, 2 * H))][:k % 3 + 1]),
    "outputs-of-one-split-permuted": lambda a, b, d, x, k: _halves(a(x[0:1]), k),
    "detached-and-stopped": lambda a, b, d, x, k: nd.add_n(
        a(x[0:1]).detach(), *[nd.BlockGrad(b(x[1:2]))] * (k % 3), b(x[0:1]),
        *[nd.stop_gradient(a(x[1:2]))] * (k % 5)),
    "beside-a-paused-target": lambda a, b, d, x, k: _paused(a, b, x, k),
    "a-parameter-beside": lambda a, b, d, x, k: nd.add_n(
        a(x[0:1]), a.bias.data().reshape((1, H)), *[b(x[1:2])] * (k % 5)),
}


def _repeat(h, k):
    return nd.add_n(*[h] * (k % 7 + 1))


def _squeezed(h, k):
    """``h[0]``, ``h[1]``: (H,) views of a (2, H) output, and an (H,) constant."""
    return nd.add_n(*[h[0], h[1], CONST[0]][:k % 3 + 1] * (1 + k % 2))


def _paused(a, b, x, k):
    """An online value beside target values computed under ``autograd.pause()``
    (no gradient reaches ``b``)."""
    with autograd.pause():
        targets = [b(x[j % 2:j % 2 + 1]) for j in range(k % 6)]
    return nd.add_n(a(x[0:1]), *targets)


def _halves(h, k):
    """The two halves of a (1, H) output (one split node, two outputs), summed
    in an order and number that vary per sample."""
    p, q = nd.split(h, num_outputs=2, axis=1)
    return nd.add_n(*[[p, q], [q, p], [q, q, p], [p], [q], [p, p, q, q, p]][k % 6])


def _parts(a, b, x, k):
    return [a(x[0:1]), b(x[1:2]), a(x[1:2])][:k % 3 + 1] * (1 + k % 3)


def mixed_program(case, xs):
    def program(nets, policy):
        a, b, d = nets
        for n in nets:
            flag(n, policy)
        ins = [x.copy() for x in xs]
        for x in ins:
            x.attach_grad()
        with autograd.record():
            outs = [MIXED[case](a, b, d, x, k) for k, x in enumerate(ins)]
            loss = nd.add_n(*[nd.sum(nd.tanh(o)) for o in outs])
        loss.backward()
        return [o.asnumpy() for o in outs] + [loss.asnumpy()] + grads_of(a, b) + \
            [x.grad.asnumpy() for x in ins]
    return program


@POLICY
@pytest.mark.parametrize("case", sorted(MIXED))
def test_sums_mixing_lazy_outputs_concrete_arrays_and_views(policy, case):
    """Outputs, the loss, the parameters' and the inputs' gradients (each
    sample's input ``attach_grad``-ed, passed to the sums directly too)."""
    rng = rng_for("mixed", case)
    xs = [nd.array(rng.normal(size=(2, H))) for _ in range(9)]
    want, got, st = both(three_blocks, mixed_program(case, xs), policy)
    same(want, got, "%s under %s" % (case, policy))
    if policy in MERGING:
        assert merged(st), st


@POLICY
def test_exact_sums_of_lazy_and_concrete_arrays_bit_for_bit(policy):
    """Doubled inputs beside concrete arrays holding NaN, +-inf, -0.0 and
    subnormals, arities 1-8: every sum is plain Gluon's bit for bit."""
    rng = rng_for("exact-mixed")
    specials = np.array([-0.0, 0.0, np.nan, np.inf, -np.inf, 1e-40, -1e-40, 3e38, -3e38])
    consts = [nd.array(rng.choice(specials, size=(1, H))) for _ in range(4)]
    xs = [nd.array(np.where(rng.random((1, H)) < 0.3, rng.choice(specials, size=(1, H)),
                            rng.normal(size=(1, H)))) for _ in range(12)]
    negzero = nd.array(np.full((1, H), -0.0))

    def program(net, policy):
        flag(net, policy)
        outs = []
        for k, x in enumerate(xs):
            parts = [net(x)] + consts[:k % 4] + [net(xs[k - 1])] * (k % 5)
            outs.append(nd.add_n(*parts))
        outs.append(nd.add_n(negzero, net(negzero)))              # -0.0 + -0.0
        outs.append(nd.add_n(*[net(negzero)] * 6))
        return [o.asnumpy() for o in outs]
    want, got, st = both(lambda: Double(prefix="xd_"), program, policy)
    bits_equal(want, got, "exact mixed sums under %s" % policy)
    if policy in MERGING:
        assert st["launches"] == 3, st["launches"]    # doublings, sums of 1-4, sums of 5+


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint8"])
@pytest.mark.parametrize("policy", ["auto", "depth"])
def test_integer_sums_of_any_arity(policy, dtype):
    """Counts summed per node (integer arrays): the -0.0 padding is 0 there."""
    rng = rng_for("ints", dtype)
    samples = [[nd.array(rng.integers(0, 30, size=(1, H)), dtype=dtype)
                for _ in range(a)] for a in (1, 2, 3, 4, 5, 8, 2, 1, 6)]

    def program(net, policy):
        flag(net, policy)
        sums = [nd.add_n(*[net(v) for v in s]) for s in samples]
        return [v.asnumpy() for v in sums]
    want, got, _ = both(lambda: Double(prefix="id_"), program, policy)
    bits_equal(want, got, "%s sums under %s" % (dtype, policy))


@POLICY
def test_a_sum_into_a_buffer_then_written_in_place(policy):
    """``nd.add_n(..., out=buf)`` into a per-sample buffer, then ``s += x`` and
    ``s[:] = s * 2`` on a sum of one input, read at the end."""
    rng = rng_for("out-buffer")
    xs = [nd.array(rng.normal(size=(1, H))) for _ in range(6)]

    def program(net, policy):
        flag(net, policy)
        outs = []
        for k, x in enumerate(xs):
            buf = nd.zeros((1, H))
            nd.add_n(*[net(x)] * (k % 6 + 1), out=buf)
            s = nd.add_n(net(x))
            s += x
            s[:] = s * 2
            outs += [buf, s]
        return [o.asnumpy() for o in outs]
    want, got, _ = both(lambda: init(nn.Dense(H, in_units=H, prefix="ob_")), program, policy)
    same(want, got, "sums into buffers under %s" % policy)


@POLICY
def test_a_running_state_written_while_sums_read_it_pend(policy):
    """An accumulator made before the loop, passed to each sample's sum and
    then updated in place (``acc += ...``) while those sums pend: every sum
    reads the value it had when called."""
    rng = rng_for("running")
    xs = [nd.array(rng.normal(size=(1, H))) for _ in range(6)]

    def program(net, policy):
        flag(net, policy)
        acc = nd.zeros((1, H))
        outs = []
        for k, x in enumerate(xs):
            outs.append(nd.add_n(acc, *[net(x)] * (k % 3 + 1), acc))
            acc += x
        return [o.asnumpy() for o in outs] + [acc.asnumpy()]
    want, got, _ = both(lambda: init(nn.Dense(H, in_units=H, prefix="rs_")), program, policy)
    same(want, got, "a running state under %s" % policy)


def written_after(net, policy, xs):
    """Per sample: sums of a (2, H) output and of its rows, then the output
    written in place (``h[:] = 0``, ``h += s``, ``h[0:1] = t``) while the sums
    pend; and sums of a list of outputs, one of them then incremented and
    another rescaled in place, summed again."""
    flag(net, policy)
    outs = []
    for k, x in enumerate(xs):
        h = net(x)
        s = nd.add_n(*[h] * (k % 6 + 1))
        t = nd.add_n(h[0:1], h[1:2], *[h[1:2]] * (k % 4))
        if k % 3 == 0:
            h[:] = 0
        elif k % 3 == 1:
            h += s
        else:
            h[0:1] = t
        hs = [net(x[j % 2:j % 2 + 1]) for j in range(k % 6 + 1)]
        u = nd.add_n(*hs)
        hs[0] += 1
        hs[-1][:] = hs[-1] * 3
        outs += [s, t, h, u, nd.add_n(*hs)] + hs
    return [o.asnumpy() for o in outs]


@POLICY
def test_sums_pending_while_their_inputs_are_written(policy):
    """Every sum reads its inputs as they were when it was called."""
    rng = rng_for("written-after")
    xs = [nd.array(rng.normal(size=(2, H))) for _ in range(7)]
    want, got, _ = both(lambda: init(nn.Dense(H, in_units=H, prefix="wa_")),
                        lambda n, p: written_after(n, p, xs), policy)
    same(want, got, "sums before writes under %s" % policy)


@POLICY
def test_input_gradients_accumulated_through_sums(policy):
    """Inputs ``attach_grad(grad_req='add')`` passed to the sums 0-5 times
    beside the block's output; two recorded passes, each backpropagated:
    the inputs' and the weights' gradients."""
    rng = rng_for("input-grads")
    xs = [nd.array(rng.normal(size=(1, H))) for _ in range(7)]

    def program(net, policy):
        flag(net, policy)
        net.collect_params().setattr("grad_req", "add")
        ins = [x.copy() for x in xs]
        for x in ins:
            x.attach_grad(grad_req="add")
        for _ in range(2):
            with autograd.record():
                outs = [nd.add_n(net(x), *[x] * (k % 6)) for k, x in enumerate(ins)]
                loss = nd.add_n(*[(o * o).sum() for o in outs])
            loss.backward()
        return [x.grad.asnumpy() for x in ins] + grads_of(net)
    want, got, _ = both(lambda: init(nn.Dense(H, in_units=H, prefix="ig_")), program, policy)
    same(want, got, "accumulated input gradients under %s" % policy)


# -- 5. sums read mid-sample, in jitbatch.map, traced, on two devices ---------------------------
def refine(net, x):
    """Per sample: sums of a growing number of the block's outputs until the
    state's norm (read: ``.asscalar()``) falls under 1 or 5 rounds passed;
    the state read with ``.asnumpy()`` after each round."""
    s = nd.add_n(net(x), x)
    seen = [s.asnumpy()]
    k = 0
    while s.norm().asscalar() > 1.0 and k < 5:
        k += 1
        s = nd.add_n(*[net(s)] * k, s * 0.25) * 0.5
        seen.append(s.asnumpy())
    return seen + [np.float32(k)]


def refine_samples():
    rng = rng_for("refine")
    return [nd.array(rng.normal(size=(1, H)) * rng.uniform(0.5, 3.0)) for _ in range(7)]


@POLICY
@pytest.mark.parametrize("how", ["loop", "jitbatch.map"])
def test_sums_read_mid_sample(policy, how):
    """The state read every round (a flush per read in the plain loop; the
    samples' reads served together in ``jitbatch.map``), the number of
    rounds depending on the values read."""
    xs = refine_samples()

    def program(net, policy):
        flag(net, policy)
        if how == "loop" or policy is None:
            res = [refine(net, x) for x in xs]
        else:
            res = jitbatch.map(lambda x: refine(net, x), xs)
        return [a for r in res for a in r]
    want, got, st = both(lambda: init(nn.Dense(H, in_units=H, activation="tanh",
                                               prefix="rf_")), program, policy)
    same(want, got, "sums read mid-sample (%s) under %s" % (how, policy))
    if how == "jitbatch.map" and policy in MERGING:
        assert merged(st), st


@POLICY
def test_graphs_trained_through_jitbatch_map(policy):
    """The graph network per sample in ``jitbatch.map`` under autograd, each
    sample reading its own loss (``.asscalar()``) before the summed backward."""
    graphs = random_graphs(("gnn-map",), 6)

    def program(net, policy):
        flag(net, policy)

        def one(s):
            y, l = graph_apply(net, s)
            return y, l, np.float32(l.asscalar())
        with autograd.record():
            res = jitbatch.map(one, graphs)
            loss = nd.add_n(*[l for _, l, _ in res])
        loss.backward()
        return [y.asnumpy() for y, _, _ in res] + [r[2] for r in res] + grads_of(net)
    want, got, _ = both(lambda: init(GraphNet(prefix="gm_")), program, policy)
    same(want, got, "graph network in jitbatch.map under %s" % policy)


class Residual(HybridBlock):
    """A block summing inside its graph: ``F.add_n`` of two Dense branches and
    its input, then ``F.ElementWiseSum`` of that and a third branch."""

    def __init__(self, **kw):
        super(Residual, self).__init__(**kw)
        with self.name_scope():
            self.p = nn.Dense(H, in_units=H, activation="tanh")
            self.q = nn.Dense(H, in_units=H)
            self.r = nn.Dense(H, in_units=H, activation="relu")

    def hybrid_forward(self, F, x):
        y = F.add_n(self.p(x), self.q(x), x)
        return F.ElementWiseSum(y, self.r(y), y)


@POLICY
def test_a_flagged_block_summing_in_its_graph(policy):
    """Residual blocks (traced ``F.add_n`` and ``F.ElementWiseSum``) stacked
    per sample a different number of times, the stack's outputs summed with
    ``nd.add_n`` outside: two Adam steps."""
    rng = rng_for("residual")
    batches = [[(nd.array(rng.normal(size=(1, H))), int(rng.integers(1, 4)),
                 nd.array(rng.normal(size=(1, H)))) for _ in range(5)] for _ in range(2)]

    def apply(net, s):
        x, depth, t = s
        hs = [x]
        for _ in range(depth):
            hs.append(net(hs[-1]))
        y = nd.add_n(*hs[1:])
        return y, L2(y, t).sum()
    trained_alike(lambda: Residual(prefix="res_"), policy, "residual sums", batches, apply,
                  "adam", {"learning_rate": 0.05})


class Branches(Block):
    """An Inception/DenseNet-like cell per image: a number of convolution
    branches that varies per sample, their (1, C, H, W) outputs summed with
    ``add_n`` (MXNet may sum them with MKL-DNN per sample), then pooled."""

    def __init__(self, **kw):
        super(Branches, self).__init__(**kw)
        with self.name_scope():
            self.a = nn.Conv2D(6, 3, padding=1, in_channels=2)
            self.b = nn.Conv2D(6, 1, in_channels=2)
            self.head = nn.Dense(2, in_units=6)

    def forward(self, x, k):  # pylint: disable=arguments-differ
        s = nd.add_n(*([self.a(x), self.b(x)] * 3)[:k % 6 + 1])
        return self.head(nd.mean(nd.relu(s), axis=(2, 3)))


@POLICY
def test_sums_of_convolution_branches(policy):
    """Two SGD steps over images whose cells sum 1-6 branch outputs."""
    rng = rng_for("branches")
    batches = [[(nd.array(rng.normal(size=(1, 2, 5, 5))), k + 3 * j,
                 nd.array(rng.normal(size=(1, 2)))) for k in range(6)] for j in range(2)]

    def apply(net, s):
        x, k, t = s
        y = net(x, k)
        return y, L2(y, t).sum()
    trained_alike(lambda: Branches(prefix="br_"), policy, "convolution branches", batches,
                  apply)


class Readout(HybridBlock):
    """A read-out written with a variable number of arguments:
    ``hybrid_forward(F, *nodes)`` summing them with ``F.add_n``."""

    def __init__(self, **kw):
        super(Readout, self).__init__(**kw)
        with self.name_scope():
            self.d = nn.Dense(2, in_units=H)

    def hybrid_forward(self, F, *nodes):
        return self.d(F.add_n(*nodes))


@pytest.mark.parametrize("policy", ["depth", "sequential", "auto"])
def test_a_hybrid_block_summing_a_varying_number_of_arguments(policy):
    """Plain Gluon runs it unhybridized; hybridized, Gluon refuses a second
    argument count (ValueError). Flagged: a clear error (what to do instead),
    or plain Gluon's numbers."""
    rng = rng_for("varargs")
    sets = [[nd.array(rng.normal(size=(1, H))) for _ in range(n)] for n in (1, 3, 2, 3)]
    plain = init(Readout(prefix="ro2_"))
    want = [plain(*s).asnumpy() for s in sets]
    net = init(Readout(prefix="ro2_"))
    net.hybridize(dynamic_batch=True, policy=policy)
    try:
        got = [y.asnumpy() for y in [net(*s) for s in sets]]
    except jitbatch.JitBatchError as e:
        assert "Fix" in str(e) and net.name in str(e), str(e)
        return
    same(want, got, "a varying number of arguments under %s" % policy)


@POLICY
def test_sums_on_two_devices(policy):
    """Samples alternately on cpu(0) and cpu(1) (the block's parameters on
    both), sums of 1-7 inputs on each device, trained once."""
    ctxs = [mx.cpu(0), mx.cpu(1)]
    rng = rng_for("two-devices")
    xs = [nd.array(rng.normal(size=(1, H)), ctx=ctxs[k % 2]) for k in range(10)]

    def program(net, policy):
        flag(net, policy)
        with autograd.record():
            outs = [nd.add_n(*[net(x)] * (k % 7 + 1), x) for k, x in enumerate(xs)]
            losses = [nd.sum(o * o) for o in outs]
        autograd.backward(losses)
        return [o.asnumpy() for o in outs] + [g.asnumpy() for p in
                                              net.collect_params().values()
                                              for g in p.list_grad()]
    want, got, st = both(lambda: init(nn.Dense(H, in_units=H, prefix="td_"), ctx=ctxs),
                         program, policy)
    same(want, got, "sums on two devices under %s" % policy)
    if policy in MERGING:
        assert merged(st), st


# -- 6. sums plain Gluon refuses ----------------------------------------------------------------
REFUSED = {
    "no-inputs": lambda h, x: nd.add_n(),
    "shapes-differ": lambda h, x: nd.add_n(h, nd.concat(h, h, dim=0)),
    "dtypes-differ": lambda h, x: nd.add_n(h, h.astype("float64")),
    "num_args-too-small": lambda h, x: nd.add_n(h, h, x, num_args=2),
    "num_args-too-large-of-six": lambda h, x: nd.add_n(*[h] * 6, num_args=7),
}


@pytest.mark.parametrize("policy", ["depth", "sequential", "auto"])
@pytest.mark.parametrize("case", ["no-inputs", "shapes-differ", "dtypes-differ"])
def test_a_sum_plain_gluon_refuses_is_refused(policy, case):
    """Among good samples' sums (which merge), one MXNet refuses: the flagged
    run raises MXNet's error too (at the call or at the read)."""
    xs = [nd.array(rng_for("refused", k).normal(size=(1, H))) for k in range(4)]

    def program(net, flagged):
        if flagged:
            net.hybridize(dynamic_batch=True, policy=policy)
        outs = []
        for k, x in enumerate(xs):
            h = net(x)
            outs.append(nd.add_n(*[h] * (k + 1)) if k != 2 else REFUSED[case](h, x))
        return [o.asnumpy() for o in outs]
    plain = error_of(lambda: program(init(nn.Dense(H, in_units=H, prefix="rf2_")), False))
    assert isinstance(plain, mx.base.MXNetError), plain
    net = init(nn.Dense(H, in_units=H, prefix="rf2_"))
    try:
        got = error_of(lambda: program(net, True))
    finally:
        cleanup()
        net.hybridize(active=False)
    assert isinstance(got, (mx.base.MXNetError, jitbatch.JitBatchError)), got


def _sum_into_own_input(net, xs):
    for x in xs:
        h = net(x)
        nd.add_n(h, x, out=h)
    return [h]


def _sum_into_a_buffer(net, xs):
    buf = nd.zeros((1, H))
    ys = []
    for x in xs:
        nd.add_n(net(x), x, out=buf)
        ys.append(buf * 1)
    return ys


def _sum_then_increment(net, xs):
    ys = []
    for x in xs:
        s = nd.add_n(net(x), x)
        s += 1
        ys.append(s)
    return ys


IN_PLACE = {"out=its-own-input": _sum_into_own_input, "out=a-buffer": _sum_into_a_buffer,
            "+=-on-the-sum": _sum_then_increment}


@pytest.mark.parametrize("policy", ["depth", "sequential", "auto"])
@pytest.mark.parametrize("case", sorted(IN_PLACE))
def test_in_place_sums_inside_autograd_record_are_refused(policy, case):
    """``nd.add_n(..., out=...)`` or ``s += 1`` on a recorded sum inside
    ``autograd.record``: MXNet refuses the write per sample ("Assigning to
    NDArrays that are already in a computational graph"), so must the
    flagged run (MXNet's error, or jitbatch's in MXNet's words)."""
    xs = [nd.array(rng_for("in-place", k).normal(size=(1, H))) for k in range(4)]

    def program(net):
        with autograd.record():
            ys = IN_PLACE[case](net, xs)
        return [y.asnumpy() for y in ys]
    plain = error_of(lambda: program(init(nn.Dense(H, in_units=H, prefix="ip_"))))
    assert isinstance(plain, mx.base.MXNetError), plain
    net = init(nn.Dense(H, in_units=H, prefix="ip_"))
    net.hybridize(dynamic_batch=True, policy=policy)
    try:
        got = error_of(lambda: program(net))
    finally:
        cleanup()
        net.hybridize(active=False)
    assert isinstance(got, mx.base.MXNetError) and "computational graph" in str(got), got


@pytest.mark.parametrize("policy", ["depth", "auto"])
def test_a_refused_sum_in_one_sample_of_jitbatch_map(policy):
    """In ``jitbatch.map``, sample 3 sums a (1, H) and a (2, H) array after a
    read: MXNet's error, as plain per-sample Gluon raises it, naming the item;
    the next map over good samples runs."""
    xs = [nd.array(rng_for("map-refused", k).normal(size=(1, H))) for k in range(5)]

    def program(net):
        def one(kx):
            k, x = kx
            h = net(x)
            s = nd.add_n(*[h] * (k + 1))
            s.norm().asscalar()
            if k == 3:
                s = nd.add_n(s, nd.concat(h, h, dim=0))
            return s.asnumpy()
        return jitbatch.map(one, list(enumerate(xs)))
    plain = error_of(lambda: program(init(nn.Dense(H, in_units=H, prefix="mr_"))))
    assert isinstance(plain, mx.base.MXNetError), plain
    net = init(nn.Dense(H, in_units=H, prefix="mr_"))
    net.hybridize(dynamic_batch=True, policy=policy)
    try:
        got = error_of(lambda: program(net))
        assert isinstance(got, mx.base.MXNetError), got
        assert "item 3" in " ".join(getattr(got, "__notes__", [])), got
        again = jitbatch.map(lambda x: nd.add_n(net(x), x).asnumpy(), xs)
        want = [nd.add_n(nd.dot(x, net.weight.data().T) + net.bias.data(), x).asnumpy()
                for x in xs]
        same(want, again, "a map after the refused one")
    finally:
        cleanup()
        net.hybridize(active=False)


class NdInside(HybridBlock):
    """``mx.nd.add_n`` written in hybrid_forward instead of ``F.add_n``: runs
    unhybridized, but no hybridized graph can be traced from it."""

    def __init__(self, **kw):
        super(NdInside, self).__init__(**kw)
        with self.name_scope():
            self.d = nn.Dense(H, in_units=H)

    def hybrid_forward(self, F, x):
        return mx.nd.add_n(self.d(x), x, x)


@pytest.mark.parametrize("policy", ["depth", "auto"])
def test_nd_add_n_inside_hybrid_forward(policy):
    """Plain per-sample Gluon runs it; plain ``hybridize()`` fails at the
    trace (AssertionError). Flagged: a BatchingError naming the block (as the
    suite accepts for a block that cannot be traced), or plain Gluon's numbers."""
    xs = [nd.array(rng_for("nd-inside", k).normal(size=(1, H))) for k in range(3)]
    want = [y.asnumpy() for y in [init(NdInside(prefix="ni_"))(x) for x in xs]]
    net = init(NdInside(prefix="ni_"))
    net.hybridize(dynamic_batch=True, policy=policy)
    try:
        got = [y.asnumpy() for y in [net(x) for x in xs]]
    except jitbatch.BatchingError as e:
        assert net.name in str(e) and ("Fix" in str(e) or "could not be traced" in str(e)), e
        return
    finally:
        cleanup()
        net.hybridize(active=False)
    same(want, got, "nd.add_n in hybrid_forward under %s" % policy)


@pytest.mark.parametrize("policy", ["depth", "sequential"])
@pytest.mark.parametrize("case", ["num_args-too-small", "num_args-too-large-of-six"])
def test_a_sum_with_a_wrong_num_args_is_refused(policy, case):
    """A user's ``num_args`` that is not the number of inputs (a sum built for a
    fixed fan-in, called with another): MXNet refuses it per sample. Until
    2026-11-26 (the day sums of any arity began to merge) a flagged run summed
    the inputs given once a sum of that arity class existed: the count left
    the signature key and the launch passed its own. A count that is not the
    inputs' now keeps its own signature, whose trial run raises MXNet's error."""
    xs = [nd.array(rng_for("num_args", k).normal(size=(1, H))) for k in range(8)]

    def program(net, flagged):
        if flagged:
            net.hybridize(dynamic_batch=True, policy=policy)
        outs = []
        for k, x in enumerate(xs):
            h = net(x)
            outs.append(nd.add_n(*[h] * (k + 1), num_args=k + 1) if k != 6 else
                        REFUSED[case](h, x))
        return [o.asnumpy() for o in outs]
    plain = error_of(lambda: program(init(nn.Dense(H, in_units=H, prefix="na_")), False))
    assert isinstance(plain, mx.base.MXNetError) and "num_inputs" in str(plain), plain
    net = init(nn.Dense(H, in_units=H, prefix="na_"))
    try:
        got = error_of(lambda: program(net, True))
    finally:
        cleanup()
        net.hybridize(active=False)
    assert isinstance(got, (mx.base.MXNetError, jitbatch.JitBatchError)), \
        "plain Gluon raised %s; the flagged run raised %r" % (type(plain).__name__, got)


# -- 6b. empty sets (NumPy shape semantics) ---------------------------------------------------
class BagOfSets(Block):
    """Per sample a bag of sets, each set one (1, K, F) array (K may be 0: an
    empty set, which MXNet's NumPy shape semantics allow): each set encoded
    and pooled, the pooled sets summed with one ``add_n``, then ``rho``.
    ``pool_inside``: the pooling is part of the flagged block (its output is
    (1, H)); else ``phi`` is a Dense over the set's elements (its output is
    (1, K, H), empty for an empty set) and the sum over K follows it."""

    def __init__(self, pool_inside, **kw):
        super(BagOfSets, self).__init__(**kw)
        self.pool_inside = pool_inside
        with self.name_scope():
            self.phi = nn.Dense(H, in_units=3, flatten=False, activation="tanh")
            self.pool = PoolPhi()
            self.rho = nn.Dense(2, in_units=H)

    def forward(self, sets):  # pylint: disable=arguments-differ
        if self.pool_inside:
            pooled = [self.pool(s) for s in sets]
        else:
            pooled = [nd.sum(self.phi(s), axis=1) for s in sets]
        return self.rho(nd.add_n(*pooled))


class PoolPhi(HybridBlock):
    """``sum over K of tanh(x W + b)``: (1, K, F) -> (1, H)."""

    def __init__(self, **kw):
        super(PoolPhi, self).__init__(**kw)
        with self.name_scope():
            self.d = nn.Dense(H, in_units=3, flatten=False, activation="tanh")

    def hybrid_forward(self, F, x):
        return F.sum(self.d(x), axis=1)


def bags(key):
    rng = rng_for(*key)
    return [[nd.array(rng.normal(size=(1, int(k), 3))) for k in rng.integers(0, 4, size=n)]
            for n in (1, 3, 2, 4, 2, 1)]


def bag_program(samples):
    def program(net, policy):
        flag(net, policy)
        ys = [net(s) for s in samples]
        return [y.asnumpy() for y in ys]
    return program


@pytest.mark.parametrize("policy", ["depth", "auto"])
def test_bags_of_sets_some_empty_pooled_inside_the_block(policy):
    """Under ``mx.util.np_shape(True)``: empty sets pooled inside the flagged
    block (its output (1, H) for every K), the pooled sets summed."""
    with mx.util.np_shape(True):
        samples = bags(("bags-inside",))
        assert any(s.shape[1] == 0 for b in samples for s in b)
        want, got, _ = both(lambda: init(BagOfSets(True, prefix="bi_")),
                            bag_program(samples), policy)
    same(want, got, "bags of sets pooled inside under %s" % policy)


@pytest.mark.parametrize("policy", ["depth", "sequential"])
def test_bags_of_sets_some_empty_encoded_element_by_element(policy):
    """Under ``mx.util.np_shape(True)``: ``phi`` (a flagged Dense) over each
    set's elements, empty sets included, pooled after it, pooled sets summed:
    plain Gluon's numbers. Until 2026-11-26 refused with a BatchingError
    blaming a value-dependent shape: the signature's check read the 0 of an
    empty set's ``(1, 0, H)`` output as MXNet's legacy "unknown", where under
    NumPy shape semantics unknown is -1 and 0 a size (``contract.unknown_shape``)."""
    with mx.util.np_shape(True):
        samples = bags(("bags-elements",))
        assert any(s.shape[1] == 0 for b in samples for s in b)
        want, got, _ = both(lambda: init(BagOfSets(False, prefix="be_")),
                            bag_program(samples), policy)
    same(want, got, "bags of sets encoded per element under %s" % policy)


# -- 7. ragged samples and flushes mid-recording ----------------------------------------------
@POLICY
def test_sums_over_sequences_of_different_lengths(policy):
    """A bidirectional-style encoder per sequence of 1-4 steps: the forward
    and backward projections and the input summed (``(T, H)`` per sample, T
    varying), arities 2-6."""
    rng = rng_for("ragged")
    seqs = [nd.array(rng.normal(size=(int(rng.integers(1, 5)), H))) for _ in range(8)]

    def program(nets, policy):
        a, b, d = nets
        for n in nets:
            flag(n, policy)
        with autograd.record():
            outs = [nd.add_n(a(s), b(s[::-1]), *[d(s)] * (k % 4), s) for k, s in enumerate(seqs)]
            loss = nd.add_n(*[nd.sum(nd.tanh(o)) for o in outs])
        loss.backward()
        return [o.asnumpy() for o in outs] + [loss.asnumpy()] + grads_of(a, b)
    want, got, st = both(three_blocks, program, policy)
    same(want, got, "ragged sums under %s" % policy)


@pytest.fixture
def config(monkeypatch):
    """jitbatch.config, restored after the test."""
    for name in ("max_pending", "row_buckets"):
        monkeypatch.setattr(jitbatch.config, name, getattr(jitbatch.config, name))
    return jitbatch.config


@pytest.mark.parametrize("policy", ["auto", "depth", "agenda"])
@pytest.mark.parametrize("max_pending", [1, 7, 50])
def test_graph_network_with_flushes_mid_recording(policy, max_pending, config):
    """``config.max_pending`` small: the graph runs itself while a minibatch is
    recorded, so sums read inputs computed by earlier flushes beside pending
    ones; two training steps."""
    config.max_pending = max_pending
    batches = [random_graphs(("gnn-mp", k), 4) for k in range(2)]
    trained_alike(lambda: GraphNet(prefix="gmp_"), policy, "max_pending %d" % max_pending,
                  batches, graph_apply, merging=False)


# -- 8. 'auto' between training and inference -----------------------------------------------------
def evaluate(net, graphs):
    """Predictions per graph, recorded, then read together."""
    with autograd.predict_mode():
        ys = [net(x, adj) for x, adj, _ in graphs]
    return [y.asnumpy() for y in ys]


def train_and_evaluate(net, policy, rounds, eval_policies):
    """Per round: a training step (SGD, momentum) over a minibatch whose size
    changes, flagged with ``policy``; then the held-out graphs evaluated with
    the block re-hybridized as ``eval_policies`` says (a policy; 'plain' is
    ``hybridize(active=False)``; None keeps the training flags); then one more
    prediction recorded and left pending, the block flagged for training
    again, and that prediction read only after the next round's step (it
    must be the weights of its call)."""
    tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05, "momentum": 0.9})
    held = random_graphs(("held-out",), 5)
    out = []
    pending = None
    for k, (batch, ev) in enumerate(zip(rounds, eval_policies)):
        flag(net, policy)
        with autograd.record():
            pairs = [graph_apply(net, s) for s in batch]
        autograd.backward([l for _, l in pairs])
        out += [l.asnumpy() for _, l in pairs]
        tr.step(len(batch))
        if pending is not None:
            out.append(pending.asnumpy())
        if policy is not None and ev is not None:
            if ev == "plain":
                net.hybridize(active=False)
            else:
                net.hybridize(dynamic_batch=True, policy=ev)
        out += evaluate(net, held)
        with autograd.predict_mode():
            pending = net(*held[k % len(held)][:2])
        flag(net, policy)
    return out + [pending.asnumpy()] + params_of(net)


SIZES = [3, 1, 6, 2, 5, 4]


@POLICY
def test_training_and_inference_interleaved_and_rehybridized(policy):
    """Six rounds, minibatches of 3, 1, 6, 2, 5 and 4 graphs, evaluation
    re-hybridized with 'auto', 'depth', unflagged, 'agenda', kept, 'sequential'."""
    rounds = [random_graphs(("interleave", k), n) for k, n in enumerate(SIZES)]
    evs = ["auto", "depth", "plain", "agenda", None, "sequential"]
    want, got, _ = both(lambda: init(GraphNet(prefix="ti_")),
                        lambda n, p: train_and_evaluate(n, p, rounds, evs), policy)
    same(want, got, "training and inference interleaved under %s" % policy)


@pytest.fixture
def fresh_model(monkeypatch):
    """A cost model that has seen no flush (the process's has seen other tests')."""
    monkeypatch.setattr(cost, "MODEL", cost.Model())
    return cost.MODEL


def test_auto_tries_each_merging_policy_again_after_a_training_flush(fresh_model):
    """A training step (its flush under autograd pays first traces and stage
    plans), then 16 inference minibatches of 2-5 graphs (one flush each,
    every one with calls that merge). Whatever the times: by the 2nd choice
    both merging policies have run, and one measured on fewer than three
    flushes runs again once cost.REPROBE_FEW flushes went by without it (a
    flush later where both are due), unless its predicted execution alone is
    the chosen policy's whole predicted cost (running it would measure only
    its analysis, which cannot make it the cheapest): while one has run fewer
    than three times, no REPROBE_FEW + 2 inference flushes in a row go without
    it where it could have been the cheapest in one of them. Every result
    is plain Gluon's."""
    train = random_graphs(("auto-train",), 6)
    infer = [random_graphs(("auto-infer", k), 2 + k % 4) for k in range(16)]
    plain = init(GraphNet(prefix="at_"))
    net = init(GraphNet(prefix="at_"))
    net.hybridize(dynamic_batch=True, policy="auto")
    jitbatch.reset_stats()
    for n in (plain, net):
        tr = gluon.Trainer(n.collect_params(), "sgd", {"learning_rate": 0.1})
        with autograd.record():
            loss = nd.add_n(*[graph_apply(n, s)[1] for s in train])
        loss.backward()
        tr.step(len(train))
    same(params_of(plain), params_of(net), "parameters after the training step")
    chosen, counts = [], []     # per inference flush: its policy, and the runs before it
    within = []                 # per inference flush: the merging policies that could win
    for batch in infer:
        want = [plain(x, adj).asnumpy() for x, adj, _ in batch]
        before = jitbatch.stats()
        ys = [net(x, adj) for x, adj, _ in batch]
        jitbatch.flush()
        st = jitbatch.stats()
        assert st["flushes"] == before["flushes"] + 1, st
        chosen.append(st["last_flush"]["policy"])
        pred = st["last_flush"]["predicted"]
        best = sum(pred[chosen[-1]].values()) if chosen[-1] in pred else None
        within.append({p for p in MERGING if best is None or pred[p]["execute"] < best})
        counts.append(before["policies"])
        same(want, [y.asnumpy() for y in ys], "inference flush %d" % len(chosen))
    st = jitbatch.stats()
    trail = "chosen %s; all flushes %s" % (chosen, st["policies"])
    assert set(st["policies"]) <= set(POLICIES) - {"auto"}, trail
    window = cost.REPROBE_FEW + 2
    for p in MERGING:
        # the 2nd choice runs a policy never run, if it could be the cheapest
        assert st["policies"].get(p, 0) >= 1 or p not in within[1], (p, trail)
        for i in range(len(chosen) - window + 1):
            if counts[i + window - 1].get(p, 0) < 3 and \
                    all(p in w for w in within[i:i + window]):
                assert p in chosen[i:i + window], (p, i, trail)


@POLICY
def test_float64_models_summing_their_nodes(policy):
    """The graph network and deep sets cast to float64 (``net.cast``, inputs
    and targets of that type), one training step."""
    graphs = [(x.astype("float64"), adj, t.astype("float64"))
              for x, adj, t in random_graphs(("cast64",), 6)]
    rng = rng_for("cast64-sets")
    sets = [nd.array(rng.normal(size=(int(n), 3)), dtype="float64")
            for n in rng.integers(1, 9, size=5)]

    def make():
        nets = [init(GraphNet(prefix="cg_")), init(DeepSets(prefix="cd_"))]
        for n in nets:
            n.cast("float64")
        return nets

    def program(nets, policy):
        g, d = nets
        flag(g, policy)
        flag(d, policy)
        with autograd.record():
            ys = [g(x, adj) for x, adj, _ in graphs] + [d(s) for s in sets]
            loss = nd.add_n(*[nd.sum(y * y) for y in ys])
        loss.backward()
        return [y.asnumpy() for y in ys] + grads_of(g, d)
    want, got, st = both(make, program, policy)
    assert {w.dtype for w in want} == {o.dtype for o in got} == {np.dtype("float64")}
    same(want, got, "float64 under %s" % policy)
    if policy in MERGING:
        assert merged(st), st


class HalfSets(HybridBlock):
    """Deep sets of elementwise layers (MXNet 1.9.1 has no float16 Dense on
    CPU): ``phi(e) = tanh(e * w + b)`` per element, the sum, ``rho(s) = s * v``."""

    def __init__(self, **kw):
        super(HalfSets, self).__init__(**kw)
        with self.name_scope():
            self.w = self.params.get("w", shape=(1, 3))
            self.b = self.params.get("b", shape=(1, 3))

    def hybrid_forward(self, F, e, w, b):
        return F.tanh(F.broadcast_add(F.broadcast_mul(e, w), b))


@POLICY
def test_float16_sets_summed(policy):
    """Sets of 1-9 float16 elements through a float16 elementwise block, summed
    with ``add_n`` and scaled; a backward in float16: outputs and gradients
    within float16's rounding (a few units in the last place: the merged
    backward sums a parameter's gradient rows in another order than per-sample
    launches accumulating into it, both as far from the float64 gradient)."""
    rng = rng_for("half-sets")
    sets = [nd.array(rng.normal(size=(int(n), 3)), dtype="float16")
            for n in rng.integers(1, 10, size=8)]

    def make():
        net = init(HalfSets(prefix="hs_"))
        net.cast("float16")
        return net

    def program(net, policy):
        flag(net, policy)
        with autograd.record():
            ys = [nd.add_n(*[net(s[i:i + 1]) for i in range(s.shape[0])]) * 0.5 for s in sets]
            loss = nd.add_n(*[nd.sum(y * y) for y in ys])
        loss.backward()
        return [y.asnumpy() for y in ys] + [loss.asnumpy()] + grads_of(net)
    want, got, st = both(make, program, policy)
    for i, (w, o) in enumerate(zip(want, got)):
        assert w.dtype == o.dtype == np.float16, (i, w.dtype, o.dtype)
        np.testing.assert_allclose(o.astype(np.float32), w.astype(np.float32), rtol=5e-3,
                                   atol=5e-3, err_msg="float16 result %d" % i)
    if policy in MERGING:
        assert merged(st), st


class SeqModel(Block):
    """README's per-sample GRU over a sequence, its per-step outputs summed
    with one ``add_n`` of the sequence's length into a Dense head."""

    def __init__(self, **kw):
        super(SeqModel, self).__init__(**kw)
        with self.name_scope():
            self.cell = gluon.rnn.GRUCell(H, input_size=3)
            self.out = nn.Dense(1, in_units=H)

    def forward(self, seq):  # pylint: disable=arguments-differ
        h = [nd.zeros((1, H))]
        ys = []
        for t in range(seq.shape[0]):
            y, h = self.cell(seq[t:t + 1], h)
            ys.append(y)
        return self.out(nd.add_n(*ys))


def test_auto_records_again_after_minibatches_that_merge_nothing(fresh_model):
    """Serving one request at a time (a chain of GRU steps: nothing can merge,
    so 'auto' runs the next calls eagerly, a window that grows while
    flushes find nothing), then minibatches of 8 sequences: the window is
    bounded, so within a few minibatches every call is recorded again and
    the flush sees all of them (its node count, not a time). Every output is plain
    Gluon's."""
    rng = rng_for("serve")
    singles = [[nd.array(rng.normal(size=(6, 3)))] for _ in range(12)]
    batches = [[nd.array(rng.normal(size=(int(rng.integers(2, 6)), 3))) for _ in range(8)]
               for _ in range(8)]
    plain = init(SeqModel(prefix="sq_"))
    net = init(SeqModel(prefix="sq_"))
    net.hybridize(dynamic_batch=True, policy="auto")
    seen = []
    for k, batch in enumerate(singles + batches):
        want = [plain(s).asnumpy() for s in batch]
        jitbatch.reset_stats()
        ys = [net(s) for s in batch]
        got = [y.asnumpy() for y in ys]
        same(want, got, "minibatch %d" % k)
        st = jitbatch.stats()
        seen.append(st["last_flush"].get("nodes", 0) if st["flushes"] else 0)
    for batch, nodes in zip(batches[-2:], seen[-2:]):
        # every GRU step, every sum and every head of the minibatch recorded
        steps = sum(s.shape[0] for s in batch)
        assert nodes >= steps + 2 * len(batch), (seen, steps)
