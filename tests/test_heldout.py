"""Held-out per-sample models: written naively, as a user writes plain Gluon for
ONE sample, without looking at what jitbatch batches well. Each is run plain
(per sample, unhybridized) and with ``hybridize(dynamic_batch=True)`` on the
same parameters and inputs: outputs and gradients must agree (the oracle is
``tests/harness.py``). Where merging cannot be exact (BatchNorm in training
mode, a random mask) the documented behaviour is asserted instead
(docs/errors.rst): one launch per call with a ``ContractWarning``, or per-sample
random draws that the backward pass uses consistently."""
import itertools
import re
import warnings

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import HybridBlock, nn

import jitbatch
from harness import assert_same, check_model, prepare, run
from heldout import (contract_warnings, initialized, nothing_pending, rng_for,  # noqa: F401
                     row_sequences, run_in_subprocess, square_loss)
from oracle import restore, snapshot

POLICIES = ["auto", "depth", "agenda"]
GRANULARITIES = ["auto", "block", "split"]
TRAIN = pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])


# -- 1. a 1-D CNN text classifier over variable-length token ids ------------------------
class ConvEncoder(HybridBlock):
    """Conv1D over (1, C, T) and max over time: its input differs per sample
    along a non-leading axis (T), its output does not."""

    def __init__(self, channels, width, in_channels, **kw):
        super(ConvEncoder, self).__init__(**kw)
        with self.name_scope():
            self.conv = nn.Conv1D(channels, width, in_channels=in_channels, padding=width // 2,
                                  activation="relu")

    def hybrid_forward(self, F, x):
        return F.max(self.conv(x), axis=2)


class TextCNN(gluon.Block):
    """Embedding of (1, T) token ids, transposed to (1, embed, T) by an NDArray
    operator, bigram and trigram encoders, a Dense head."""

    def __init__(self, vocab=20, embed=4, channels=5, classes=3, **kw):
        super(TextCNN, self).__init__(**kw)
        with self.name_scope():
            self.embed = nn.Embedding(vocab, embed)
            self.bigram = ConvEncoder(channels, 2, embed)
            self.trigram = ConvEncoder(channels, 3, embed)
            self.out = nn.Dense(classes, in_units=2 * channels)

    def forward(self, ids):                       # ids: (1, T) for ONE sentence
        e = self.embed(ids).transpose((0, 2, 1))  # (1, embed, T)
        feats = nd.concat(self.bigram(e), self.trigram(e), dim=1)
        return self.out(feats)


def textcnn_make():
    return initialized(TextCNN())


def textcnn_samples(rng, n, vocab=20):
    return [(nd.array(rng.integers(0, vocab, (1, int(rng.integers(2, 5))))),
             int(rng.integers(0, 3))) for _ in range(n)]


def textcnn_apply(net, sample):
    ids, label = sample
    logits = net(ids)
    return logits, gluon.loss.SoftmaxCrossEntropyLoss()(logits, nd.array([label]))


@pytest.mark.parametrize("policy", POLICIES)
@TRAIN
def test_text_cnn_over_variable_length_sentences(train, policy):
    st = check_model(textcnn_make, textcnn_samples, textcnn_apply,
                     rng_for("textcnn", train, policy), 8, train, policy)
    # 8 sentences of 3 lengths: the convolutions of equal lengths share launches
    if policy != "auto":
        assert st["launches"] < st["nodes"], st


# -- 2. LayerNorm and Dropout in a recurrent MLP ------------------------------------------
class NormDropMLP(HybridBlock):
    """Dense, LayerNorm, Dropout, Dense: the usual transformer-style sublayer."""

    def __init__(self, hidden, rate, **kw):
        super(NormDropMLP, self).__init__(**kw)
        with self.name_scope():
            self.inp = nn.Dense(hidden, in_units=2 * hidden, flatten=False)
            self.norm = nn.LayerNorm(in_channels=hidden)
            self.drop = nn.Dropout(rate)
            self.outp = nn.Dense(hidden, in_units=hidden, activation="tanh")

    def hybrid_forward(self, F, x, h):
        return self.outp(self.drop(self.norm(self.inp(F.concat(x, h, dim=1)))))


class NormDropRNN(gluon.Block):
    """The sublayer applied step by step over a per-sample sequence of rows."""

    def __init__(self, hidden=6, rate=0.0, **kw):
        super(NormDropRNN, self).__init__(**kw)
        self.hidden = hidden
        with self.name_scope():
            self.step = NormDropMLP(hidden, rate)
            self.head = nn.Dense(2, in_units=hidden)

    def forward(self, seq):
        h = nd.zeros((1, self.hidden))
        for t in range(seq.shape[0]):
            h = self.step(seq[t:t + 1], h)
        return self.head(h)


def normdrop_samples(rng, n):
    return row_sequences(rng, n, 6)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("policy", POLICIES)
@TRAIN
def test_layernorm_dropout_rnn(train, policy, granularity, recwarn):
    """Inference: Dropout(0.5) is the identity; training: a rate of 0 keeps the
    Dropout operator in the training graph with nothing random in it."""
    rate = 0.0 if train else 0.5
    st = check_model(lambda: initialized(NormDropRNN(rate=rate)), normdrop_samples,
                     square_loss, rng_for("normdrop", train, policy, granularity), 7,
                     train, policy, granularity)
    assert not contract_warnings(recwarn.list)
    if policy != "auto":
        assert st["launches"] < st["nodes"], st


class DropoutProbe(HybridBlock):
    """Dense then Dropout(0.5): the mask can be read off the output."""

    def __init__(self, width, **kw):
        super(DropoutProbe, self).__init__(**kw)
        self.width = width
        with self.name_scope():
            self.dense = nn.Dense(width, in_units=3, weight_initializer=mx.init.One(),
                                  bias_initializer=mx.init.One())
            self.drop = nn.Dropout(0.5)

    def hybrid_forward(self, F, x):
        return self.drop(self.dense(x))


def _dropout_run(net, xs, flag, policy, outside):
    """Training-mode outputs, masks and weight gradient of ``sum(y * coef)``;
    ``outside``: the dropout applied with ``nd.Dropout`` on the block's output in the
    per-sample code instead of inside the block."""
    if flag:
        net.hybridize(dynamic_batch=True, policy=policy)
    else:
        net.hybridize(active=False)
    net.dense.weight.zero_grad()
    net.dense.bias.zero_grad()
    coef = nd.array(np.arange(1, net.width + 1)[None, :])
    try:
        with autograd.record():
            ys = [nd.Dropout(net.dense(x), p=0.5) if outside else net(x) for x in xs]
            loss = nd.add_n(*[nd.sum(y * coef) for y in ys])
        loss.backward()
        return ([y.asnumpy() for y in ys], net.dense.weight.grad().asnumpy().copy(),
                net.dense.bias.grad().asnumpy().copy())
    finally:
        net.hybridize(active=False)


@pytest.mark.parametrize("outside", [False, True], ids=["in_block", "nd_Dropout"])
@pytest.mark.parametrize("policy", POLICIES)
def test_dropout_in_training_draws_a_mask_per_sample_and_backward_uses_it(policy, outside):
    """docs/errors.rst: plain Dropout (a mask per element) merges, each sample
    drawing its own mask. Its numbers cannot equal plain Gluon's draws, so the
    oracle is the definition: every sample's output is 0 or 2x its input, masks
    of different samples are independent, and the gradient is the one of the
    masks the forward pass used."""
    width = 32
    net = initialized(DropoutProbe(width))
    xs = [nd.array(np.full((1, 3), 0.1 * (i + 1))) for i in range(8)]
    pre = [(x.asnumpy().sum() + 1.0) * np.ones((1, width)) for x in xs]   # dense: ones
    plain, _, _ = _dropout_run(net, xs, False, policy, outside)
    jitbatch.reset_stats()
    ys, wgrad, bgrad = _dropout_run(net, xs, True, policy, outside)
    if policy != "auto":
        assert jitbatch.stats()["launches"] < jitbatch.stats()["nodes"], jitbatch.stats()
    masks = []
    for y, p in zip(ys, pre):
        kept = y != 0
        np.testing.assert_allclose(y[kept], 2 * p[kept], rtol=1e-6)
        masks.append(kept)
    agree = np.mean([(a == b).mean() for i, a in enumerate(masks) for b in masks[i + 1:]])
    plain_agree = np.mean([(a != 0) == (b != 0) for i, a in enumerate(plain)
                           for b in plain[i + 1:]])
    assert abs(agree - 0.5) < 0.15, ("merged samples share their dropout mask: pairwise "
                                     "agreement %.3f (plain Gluon %.3f)" % (agree, plain_agree))
    coef = np.arange(1, width + 1)[None, :]
    grad_y = [2 * m * coef for m in masks]                       # d loss / d dense output
    want_b = np.sum(grad_y, axis=0).reshape(-1)
    want_w = np.sum([g.T @ x.asnumpy() for g, x in zip(grad_y, xs)], axis=0)
    np.testing.assert_allclose(bgrad, want_b, rtol=1e-5, err_msg="bias gradient vs masks")
    np.testing.assert_allclose(wgrad, want_w, rtol=1e-5, err_msg="weight gradient vs masks")


# -- 3. BatchNorm after a convolution -----------------------------------------------------
class ConvBN(HybridBlock):
    """Conv1D, BatchNorm over channels, relu, max over time."""

    def __init__(self, channels=4, global_stats=False, **kw):
        super(ConvBN, self).__init__(**kw)
        with self.name_scope():
            self.conv = nn.Conv1D(channels, 3, in_channels=3, padding=1)
            self.bn = nn.BatchNorm(in_channels=channels, use_global_stats=global_stats)

    def hybrid_forward(self, F, x):
        return F.max(F.relu(self.bn(self.conv(x))), axis=2)


class BNClassifier(gluon.Block):
    """The ConvBN encoder and a Dense head, per (1, 3, T) sample."""

    def __init__(self, global_stats=False, **kw):
        super(BNClassifier, self).__init__(**kw)
        with self.name_scope():
            self.enc = ConvBN(global_stats=global_stats)
            self.out = nn.Dense(2, in_units=4)

    def forward(self, x):               # x: (1, 3, T), one sample
        return self.out(self.enc(x))


def bn_make(global_stats=False):
    net = initialized(BNClassifier(global_stats))
    rng = np.random.default_rng(5)
    # running statistics away from (0, 1), so that inference really uses them
    net.enc.bn.running_mean.set_data(nd.array(rng.normal(size=4)))
    net.enc.bn.running_var.set_data(nd.array(rng.uniform(0.5, 2.0, size=4)))
    return net


def bn_samples(rng, n):
    return [nd.array(rng.normal(size=(1, 3, int(rng.integers(4, 6))))) for _ in range(n)]


@pytest.mark.parametrize("policy", POLICIES)
def test_batchnorm_inference_merges(policy, recwarn):
    st = check_model(bn_make, bn_samples, square_loss, rng_for("bn-infer", policy), 8, False,
                     policy)
    assert not contract_warnings(recwarn.list)
    if policy != "auto":
        assert st["launches"] < st["nodes"], st


def _bn_training(net, snap, samples, flag, policy):
    restore(net, snap)              # the same parameters and running statistics
    jitbatch.reset_stats()
    outs, grads = run(net, square_loss, samples, True, flag, policy)
    stats = [net.enc.bn.running_mean.data().asnumpy(), net.enc.bn.running_var.data().asnumpy()]
    return (outs, grads), stats, jitbatch.stats()


def _running_after(start, positions, order, momentum=0.9):
    """BatchNorm's running mean and variance after one update per sample, in
    ``order`` (``positions``: each sample's (channels, T) BatchNorm input)."""
    mean, var = start[0].copy(), start[1].copy()
    for i in order:
        mean = momentum * mean + (1 - momentum) * positions[i].mean(axis=1)
        var = momentum * var + (1 - momentum) * positions[i].var(axis=1)
    return mean, var


def _close(arrays, others):
    return all(np.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(arrays, others))


@pytest.mark.parametrize("policy", POLICIES)
def test_batchnorm_training_runs_per_sample_with_a_warning(policy):
    """BatchNorm in training mode normalises over ONE sample's positions: merged
    it would mix samples. Documented: the block's calls run one per sample,
    exact, with a ContractWarning naming the block and BatchNorm."""
    net = bn_make()
    snap = snapshot(net)
    samples = bn_samples(rng_for("bn-train", policy), 6)
    ref, ref_stats, _ = _bn_training(net, snap, samples, False, policy)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got, got_stats, st = _bn_training(net, snap, samples, True, policy)
    assert_same(ref, got)
    # the running statistics: documented, the same per-sample updates as plain
    # Gluon's, possibly in another order (MXNet applies them during backward in
    # the order its graph gives; under 'agenda' that order differs here)
    restore(net, snap)
    start = (net.enc.bn.running_mean.data().asnumpy(), net.enc.bn.running_var.data().asnumpy())
    positions = [net.enc.conv(x).asnumpy()[0] for x in samples]     # (channels, T) each
    orders = list(itertools.permutations(range(len(samples))))
    assert any(_close(_running_after(start, positions, o), ref_stats) for o in orders), \
        "test bug: momentum 0.9 and the biased variance assumed"
    assert any(_close(_running_after(start, positions, o), got_stats) for o in orders), (
        "running statistics after the step are not plain Gluon's updates in any order: "
        "%s vs plain %s" % (got_stats, ref_stats))
    msgs = contract_warnings(record)
    assert any(re.search(r"convbn\d+.*BatchNorm.*one per sample.*Fix", m, re.S) for m in msgs), \
        msgs
    assert st["launches"] >= len(samples), st      # the encoder's calls run alone


def run_recorded_in_predict_mode(net, apply, samples, flag, policy, backward_train_mode):
    """Outputs and gradients of the samples recorded under
    ``autograd.record(train_mode=False)`` (frozen BatchNorm, Dropout off: how one
    fine-tunes or takes input gradients), then ``backward(train_mode=...)``."""
    params = prepare(net, flag, policy)
    try:
        with autograd.record(train_mode=False):
            res = [apply(net, s) for s in samples]
            loss = nd.add_n(*[r[1] for r in res])
        loss.backward(train_mode=backward_train_mode)
        return ([r[0].asnumpy() for r in res],
                {k: p.grad().asnumpy().copy() for k, p in params.items()
                 if p.grad_req != "null"})
    finally:
        net.hybridize(active=False)


@pytest.mark.parametrize("backward_train_mode", [True, False],
                         ids=["backward()", "backward(train_mode=False)"])
@pytest.mark.parametrize("global_stats", [False, True], ids=["batch-stats", "use_global_stats"])
@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_batchnorm_recorded_in_predict_mode(policy, global_stats, backward_train_mode, recwarn):
    """Frozen BatchNorm (running statistics) while recording gradients. Its
    backward in training mode (backward()'s default, whatever the recording's
    mode) normalises over the batch: merged, that mixed the samples' gradients
    silently. So unless use_global_stats its calls run per sample, with a
    ContractWarning saying so; with it they merge. Outputs and gradients must
    be plain Gluon's either way."""
    net = bn_make(global_stats)
    samples = bn_samples(rng_for("bn-predict", policy), 6)
    ref = run_recorded_in_predict_mode(net, square_loss, samples, False, policy,
                                       backward_train_mode)
    jitbatch.reset_stats()
    got = run_recorded_in_predict_mode(net, square_loss, samples, True, policy,
                                       backward_train_mode)
    st = jitbatch.stats()
    warned = contract_warnings(recwarn.list)
    if global_stats:
        assert not warned
        assert st["launches"] < st["nodes"], st
    else:
        assert warned and "BatchNorm" in warned[0] and "use_global_stats=True" in warned[0]
    assert_same(ref, got)


@pytest.mark.parametrize("backward_train_mode", [True, False])
@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_layernorm_dropout_recorded_in_predict_mode(policy, backward_train_mode):
    """Dropout(0.5) is the identity under record(train_mode=False), whatever
    mode the backward pass runs in."""
    net = initialized(NormDropRNN(rate=0.5))
    samples = normdrop_samples(rng_for("normdrop-predict", policy), 7)
    ref = run_recorded_in_predict_mode(net, square_loss, samples, False, policy,
                                       backward_train_mode)
    got = run_recorded_in_predict_mode(net, square_loss, samples, True, policy,
                                       backward_train_mode)
    assert_same(ref, got)


# -- 4. a recursive model with plain nd operators between blocks ---------------------------
class Cell(HybridBlock):
    """A plain tanh cell over [input, state]."""

    def __init__(self, hidden, **kw):
        super(Cell, self).__init__(**kw)
        with self.name_scope():
            self.x2h = nn.Dense(hidden, in_units=hidden)
            self.h2h = nn.Dense(hidden, in_units=hidden, use_bias=False)

    def hybrid_forward(self, F, x, h):
        return F.tanh(self.x2h(x) + self.h2h(h))


class AttentiveTree(gluon.Block):
    """A binary tree read bottom-up; at each inner node the children's states are
    combined with NDArray operators in the per-sample code (attention over the
    leaves seen so far, a leaky relu by hand (``gate``: with ``nd.where`` on a
    comparison, or ``nd.maximum``), clip, bilinear mixing with batch_dot)."""

    def __init__(self, hidden=4, gate="where", **kw):
        super(AttentiveTree, self).__init__(**kw)
        self.hidden = hidden
        self.gate = gate
        with self.name_scope():
            self.leaf = nn.Dense(hidden, in_units=3, activation="tanh")
            self.cell = Cell(hidden)
            self.mix = self.params.get("mix", shape=(hidden, hidden))
            self.bilinear = self.params.get("bilinear", shape=(1, 2, 2))
            self.out = nn.Dense(1, in_units=hidden + 2)

    def node(self, tree, xs, leaves):
        if not isinstance(tree, tuple):
            h = self.leaf(xs[tree:tree + 1])
            leaves.append(h)
            return h
        left = self.node(tree[0], xs, leaves)
        right = self.node(tree[1], xs, leaves)
        memory = nd.concat(*leaves, dim=0)                      # (L, H)
        scores = nd.dot(memory, left.T)                         # (L, 1)
        weights = nd.softmax(scores, axis=0)
        context = nd.sum(nd.broadcast_mul(weights, memory), axis=0, keepdims=True)
        if self.gate == "where":
            gate = nd.where(right > 0, right, 0.1 * right)
        else:
            gate = nd.maximum(right, 0.1 * right)
        x = nd.clip(nd.dot(context, self.mix.data()) + gate, -2.0, 2.0)
        return self.cell(x, left)

    def forward(self, xs, tree):
        leaves = []
        root = self.node(tree, xs, leaves)
        quad = nd.batch_dot(self.bilinear.data(), root.reshape((1, 2, 2)))   # (1, 2, 2)
        corner = quad.transpose((0, 2, 1))[:, :, 1]                          # (1, 2)
        spread = nd.expand_dims(nd.mean(root[:, 1:3], axis=1), axis=1)       # (1, 1)
        feats = nd.concat(nd.relu(root) - spread, corner, dim=1)
        return self.out(feats) + nd.sum(root, axis=1, keepdims=True) * 0.25


def random_tree(rng, leaves):
    """A random binary tree over leaf indices 0..leaves-1 (nested tuples)."""
    nodes = list(range(leaves))
    while len(nodes) > 1:
        i = int(rng.integers(0, len(nodes) - 1))
        nodes[i:i + 2] = [(nodes[i], nodes[i + 1])]
    return nodes[0]


def tree_samples(rng, n):
    out = []
    for _ in range(n):
        k = int(rng.integers(1, 6))
        out.append((nd.array(rng.normal(size=(k, 3))), random_tree(rng, k)))
    return out


def tree_apply(net, sample):
    y = net(*sample)
    return y, nd.sum(y * y)


def tree_cases():
    """Every policy, granularity, mode and gate."""
    for train in (True, False):
        for policy in POLICIES:
            for granularity in GRANULARITIES:
                for gate in ("maximum", "where"):
                    yield pytest.param(train, policy, granularity, gate, id="-".join(
                        ["train" if train else "infer", policy, granularity, gate]))


@pytest.mark.parametrize("train, policy, granularity, gate", list(tree_cases()))
def test_tree_with_nd_operators_between_blocks(train, policy, granularity, gate):
    st = check_model(lambda: initialized(AttentiveTree(gate=gate)), tree_samples, tree_apply,
                     rng_for("tree", train, policy, granularity), 7, train, policy, granularity)
    if policy != "auto":
        assert st["launches"] < st["nodes"], st


TWO_EXPERTS = r"""
import numpy as np
from mxnet import gluon, nd
from mxnet.gluon import nn
import jitbatch
from harness import check_model


class Stop(gluon.HybridBlock):
    # a block whose output passes no gradient back
    def hybrid_forward(self, F, x):
        return F.BlockGrad(x * 2)


class TwoExperts(gluon.Block):
    # samples alternate between two experts (one launch each); the per-sample
    # code then applies an operator without a gradient to the expert's output
    def __init__(self):
        super(TwoExperts, self).__init__()
        with self.name_scope():
            self.a = nn.Dense(4, in_units=3)
            self.b = nn.Dense(4, in_units=3)
            self.stop = Stop()
            self.head = nn.Dense(1, in_units=8)

    def forward(self, sample):
        i, x = sample
        h = self.a(x) if i %% 2 else self.b(x)
        g = %(op)s
        return self.head(nd.concat(h, g, dim=1))


def make():
    net = TwoExperts()
    net.initialize()
    return net


def samples(rng, n):
    return [(i, nd.array(rng.normal(size=(1, 3)))) for i in range(n)]


def apply(net, sample):
    y = net(sample)
    return y, nd.sum(y * y)


check_model(make, samples, apply, np.random.default_rng(0), 4, True, %(policy)r)
print("same as plain Gluon")
"""


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("op", ["nd.BlockGrad(h)", "nd.where(h > 0, h, 0.1 * h)",
                                "self.stop(h)"], ids=["BlockGrad", "where", "block"])
def test_zero_gradient_operator_over_rows_of_two_launches(op, policy):
    """An operator or block that passes no gradient, on rows gathered from two
    launches: MXNet 1.9.1 crashed in backward() (a segmentation fault in
    Imperative::Backward) where such a launch was recorded, so jitbatch runs it
    unrecorded (jitbatch/gluon/gradients.py). Run in a subprocess: the failure
    is a crash of the interpreter."""
    status, out, err = run_in_subprocess(TWO_EXPERTS % {"op": op, "policy": policy})
    assert status == 0, ("exit status %d (a negative status is a signal): %s"
                         % (status, err[-1500:]))
    assert "same as plain Gluon" in out


# -- 5. several outputs, extra positional inputs, a float constant, shared parameters -------
class GatedPair(HybridBlock):
    """Three positional inputs, three outputs (a tuple), a Python float constant
    (``self.scale``) multiplied in."""

    def __init__(self, hidden, scale, **kw):
        super(GatedPair, self).__init__(**kw)
        self.scale = scale
        with self.name_scope():
            self.gate = nn.Dense(hidden, in_units=hidden)

    def hybrid_forward(self, F, x, h, c):
        g = F.sigmoid(self.gate(x + h))
        c_new = g * c + (1 - g) * F.tanh(x) * self.scale
        return F.tanh(c_new) * g, c_new, F.sum(g, axis=1, keepdims=True)


class SharedEncoderDecoder(gluon.Block):
    """An encoder and a decoder Dense sharing one set of parameters
    (``params=encoder.params``), a multi-output gate, and a block output scaled by
    a Python float in the per-sample code."""

    def __init__(self, hidden=5, **kw):
        super(SharedEncoderDecoder, self).__init__(**kw)
        self.hidden = hidden
        with self.name_scope():
            self.encoder = nn.Dense(hidden, in_units=hidden, activation="tanh")
            self.decoder = nn.Dense(hidden, in_units=hidden, activation="sigmoid",
                                    params=self.encoder.params)
            self.pair = GatedPair(hidden, scale=0.75)
            self.out = nn.Dense(1, in_units=hidden)

    def forward(self, seq):
        h = self.encoder(seq[0:1])
        c = nd.ones((1, self.hidden)) * 0.5
        gates = []
        for t in range(1, seq.shape[0]):
            h, c, g = self.pair(self.encoder(seq[t:t + 1]), h, c)
            gates.append(g)
        y = self.out(self.decoder(h) * 1.5 + c)
        if gates:
            y = y + nd.add_n(*gates) * (0.1 / len(gates))
        return y


def shared_samples(rng, n):
    return row_sequences(rng, n, 5)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("policy", POLICIES)
@TRAIN
def test_shared_parameters_and_a_multi_output_block(train, policy, granularity):
    net = initialized(SharedEncoderDecoder())
    assert net.decoder.weight is net.encoder.weight
    st = check_model(lambda: net, shared_samples, square_loss,
                     rng_for("shared", train, policy, granularity), 7, train, policy,
                     granularity)
    if policy != "auto":
        assert st["launches"] < st["nodes"], st


class Scaled(HybridBlock):
    """A Dense output times a scale passed as a second positional argument."""

    def __init__(self, **kw):
        super(Scaled, self).__init__(**kw)
        with self.name_scope():
            self.dense = nn.Dense(3, in_units=3)

    def hybrid_forward(self, F, x, scale):
        return self.dense(x) * scale


def test_a_python_float_argument_is_a_clear_error():
    """docs/errors.rst: a non-NDArray argument to a flagged block is a
    BatchingError naming the block and the fix (plain Gluon accepts it)."""
    net = initialized(Scaled())
    x = nd.ones((1, 3))
    plain = net(x, 0.5).asnumpy()
    net.hybridize(dynamic_batch=True)
    try:
        with pytest.raises(jitbatch.BatchingError, match=r"scaled\d+.*argument 1.*float.*Fix"):
            net(x, 0.5)
        got = net(x, nd.full((1, 3), 0.5))       # the fix the message gives
        np.testing.assert_allclose(got.asnumpy(), plain, rtol=1e-6)
    finally:
        net.hybridize(active=False)


# -- 6. concrete per-sample arrays mixed with lazy ones -----------------------------------
class FeatureTagger(gluon.Block):
    """Per sample: hand-made features (``nd.array`` of Python numbers), an
    embedding lookup of the token ids, fresh ``nd.zeros``/``nd.ones`` states, and
    arithmetic between concrete and lazy arrays."""

    def __init__(self, vocab=12, embed=4, hidden=6, **kw):
        super(FeatureTagger, self).__init__(**kw)
        self.hidden = hidden
        with self.name_scope():
            self.embed = nn.Embedding(vocab, embed)
            self.cell = gluon.rnn.LSTMCell(hidden, input_size=embed + 2)
            self.out = nn.Dense(3, in_units=hidden)

    def forward(self, ids, lengths):
        emb = self.embed(nd.array(ids))                       # (T, embed)
        state = [nd.zeros((1, self.hidden)), nd.ones((1, self.hidden)) * 0.1]
        outs = []
        for t, n_chars in enumerate(lengths):
            feats = nd.array([[n_chars / 10.0, float(t == 0)]])   # concrete, per token
            x = nd.concat(emb[t:t + 1], feats, dim=1)
            y, state = self.cell(x, state)
            outs.append(self.out(y + feats[:, 0:1]))
        return nd.concat(*outs, dim=0)                        # (T, 3)


def tagger_samples(rng, n, vocab=12):
    out = []
    for _ in range(n):
        t = int(rng.integers(1, 5))
        out.append(([int(i) for i in rng.integers(0, vocab, t)],
                    [int(k) for k in rng.integers(1, 9, t)],
                    [int(c) for c in rng.integers(0, 3, t)]))
    return out


def tagger_apply(net, sample):
    ids, lengths, tags = sample
    scores = net(ids, lengths)
    loss = gluon.loss.SoftmaxCrossEntropyLoss()(scores, nd.array(tags))
    return scores, nd.sum(loss)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("policy", POLICIES)
@TRAIN
def test_concrete_features_mixed_with_lazy_arrays(train, policy, granularity):
    st = check_model(lambda: initialized(FeatureTagger()), tagger_samples, tagger_apply,
                     rng_for("tagger", train, policy, granularity), 7, train, policy,
                     granularity)
    if policy != "auto":
        assert st["launches"] < st["nodes"], st


@pytest.mark.parametrize("policy", POLICIES)
@TRAIN
def test_concrete_features_mixed_with_lazy_arrays_under_map(train, policy):
    """The same samples side by side (``jitbatch.map``): each creates its
    ``nd.array``/``nd.zeros`` in a thread of its own."""
    net = initialized(FeatureTagger())
    samples = tagger_samples(rng_for("tagger-map", train, policy), 7)
    ref = run(net, tagger_apply, samples, train, flag=False)
    got = run(net, tagger_apply, samples, train, flag=True, policy=policy, mapped=True)
    assert_same(ref, got)


# -- 7. reading a value mid-sample to branch on it --------------------------------------
class Pondering(gluon.Block):
    """Adaptive computation, written naively: repeat a cell while a halting score,
    read with ``asscalar()``, stays below a threshold (at most 4 steps); the branch
    also picks one of two heads by a comparison read with ``bool``."""

    def __init__(self, hidden=4, **kw):
        super(Pondering, self).__init__(**kw)
        with self.name_scope():
            self.cell = Cell(hidden)
            self.halt = nn.Dense(1, in_units=hidden)
            self.heads = nn.HybridSequential()
            for _ in range(2):
                self.heads.add(nn.Dense(2, in_units=hidden))

    def forward(self, x):
        h = nd.zeros_like(x)
        total = 0.0
        steps = 0
        while steps < 4:
            h = self.cell(x, h)
            p = nd.sigmoid(self.halt(h))
            steps += 1
            total += p.asscalar()
            if total > 0.9:
                break
        head = self.heads[1] if bool(nd.sum(h) > 0) else self.heads[0]
        return head(h) * (1.0 / steps)


def ponder_samples(rng, n):
    return [nd.array(rng.normal(size=(1, 4)) * 2) for _ in range(n)]


@pytest.mark.parametrize("mapped", [False, True], ids=["loop", "map"])
@pytest.mark.parametrize("policy", POLICIES)
@TRAIN
def test_reading_a_value_mid_sample(train, policy, mapped):
    net = initialized(Pondering())
    samples = ponder_samples(rng_for("ponder", train, policy), 10)
    ref = run(net, square_loss, samples, train, flag=False)
    jitbatch.reset_stats()
    got = run(net, square_loss, samples, train, flag=True, policy=policy, mapped=mapped)
    assert_same(ref, got)
    st = jitbatch.stats()
    if mapped and policy != "auto":
        # the samples wait for each other at their reads: one flush per read
        # point, not per sample, and the waiting calls merge
        assert st["flushes"] < len(samples), st
        assert st["launches"] < st["nodes"], st


# -- 8. small blocks that use axis 0 or a constant row in per-sample ways ----------------
class ReverseThenProject(HybridBlock):
    """The backward half of a bidirectional encoder, written for ONE sequence in
    MXNet's TNC layout ((T, 1, C): batch of one): ``F.SequenceReverse`` reverses
    the time axis, which is axis 0."""

    def __init__(self, **kw):
        super(ReverseThenProject, self).__init__(**kw)
        with self.name_scope():
            self.proj = nn.Dense(2, in_units=3, flatten=False)

    def hybrid_forward(self, F, x):
        return self.proj(F.SequenceReverse(x))


@pytest.mark.parametrize("policy", POLICIES)
def test_sequence_reverse_over_one_sequence_in_tnc_layout(policy):
    def samples(rng, n):
        return [nd.array(rng.normal(size=(int(rng.integers(2, 4)), 1, 3))) for _ in range(n)]

    def apply(net, x):
        y = net(x)
        return y, nd.sum(y * nd.arange(y.size).reshape(y.shape))
    # it reverses axis 0, along which samples merge: one call per sample, said once
    with pytest.warns(jitbatch.ContractWarning, match="SequenceReverse"):
        check_model(lambda: initialized(ReverseThenProject()), samples, apply,
                    rng_for("reverse", policy), 6, True, policy)


class KeysByTransposeB(HybridBlock):
    """Scores of a query against K learned keys: ``dot(keys, x, transpose_b=True)``."""

    def __init__(self, transpose_b, **kw):
        super(KeysByTransposeB, self).__init__(**kw)
        self.transpose_b = transpose_b
        with self.name_scope():
            self.keys = self.params.get("keys", shape=(5, 3))

    def hybrid_forward(self, F, x, keys):
        if self.transpose_b:
            return F.transpose(F.dot(keys, x, transpose_b=True))
        return F.transpose(F.dot(keys, F.transpose(x)))


def _keys_samples(rng, n):
    return [nd.array(rng.normal(size=(1, 3))) for _ in range(n)]


@pytest.mark.parametrize("transpose_b", [False, True])
@TRAIN
def test_scores_against_learned_keys(train, transpose_b):
    check_model(lambda: initialized(KeysByTransposeB(transpose_b)), _keys_samples, square_loss,
                rng_for("keys", train, transpose_b), 6, train, "depth")


def test_dot_with_transpose_b_of_the_sample_merges(recwarn):
    net = initialized(KeysByTransposeB(True))
    net.hybridize(dynamic_batch=True, policy="depth")
    try:
        jitbatch.reset_stats()
        ys = [net(x) for x in _keys_samples(rng_for("keys-merge"), 6)]
        ys[-1].asnumpy()
        assert not contract_warnings(recwarn.list)
        assert jitbatch.stats()["launches"] == 1, jitbatch.stats()
    finally:
        net.hybridize(active=False)


class ZeroStateInside(HybridBlock):
    """Two RNN steps from a zero state created inside the block (``F.zeros((1, H))``)."""

    def __init__(self, **kw):
        super(ZeroStateInside, self).__init__(**kw)
        with self.name_scope():
            self.i2h = nn.Dense(4, in_units=3)
            self.h2h = nn.Dense(4, in_units=4)

    def hybrid_forward(self, F, x):
        h = F.zeros((1, 4))
        h = F.tanh(self.i2h(x) + self.h2h(h))
        return F.tanh(self.i2h(x) + self.h2h(h))


class Prototypes(HybridBlock):
    """Negative squared distances of a query to K=3 learned prototypes, by broadcasting
    the (1, H) query against the (K, H) prototypes."""

    def __init__(self, **kw):
        super(Prototypes, self).__init__(**kw)
        with self.name_scope():
            self.enc = nn.Dense(4, in_units=3)
            self.protos = self.params.get("protos", shape=(3, 4))

    def hybrid_forward(self, F, x, protos):
        d = F.sum(F.square(F.broadcast_sub(self.enc(x), protos)), axis=1)
        return F.expand_dims(-d, axis=0)


class LearnedSuffix(HybridBlock):
    """The encoded input with a learned (1, 2) vector concatenated after it."""

    def __init__(self, **kw):
        super(LearnedSuffix, self).__init__(**kw)
        with self.name_scope():
            self.enc = nn.Dense(4, in_units=3)
            self.extra = self.params.get("extra", shape=(1, 2))

    def hybrid_forward(self, F, x, extra):
        return F.concat(self.enc(x), extra, dim=1)


@pytest.mark.parametrize("block", [ZeroStateInside, Prototypes, LearnedSuffix],
                         ids=["zeros_state", "prototypes", "learned_suffix"])
def test_constant_rows_inside_a_block_run_per_sample_with_a_warning(block, recwarn):
    """Shapes MXNet infers at one sample's rows but not at twice them: the
    calls run one per sample (plain Gluon's numbers) with a ContractWarning
    naming the block and the operator (it was a BatchingError without a fix)."""
    net = initialized(block())
    xs = _keys_samples(rng_for("const-rows", block.__name__), 4)
    plain = [net(x).asnumpy() for x in xs]
    net.hybridize(dynamic_batch=True, policy="depth")
    try:
        jitbatch.reset_stats()
        got = [y.asnumpy() for y in [net(x) for x in xs]]
        assert jitbatch.stats()["launches"] == len(xs)
    finally:
        net.hybridize(active=False)
    for a, b in zip(plain, got):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    warned = contract_warnings(recwarn.list)
    assert warned and net.name in warned[0] and "twice the rows" in warned[0], warned


class WeightNoise(HybridBlock):
    """A Dense layer with Gaussian weight noise (Graves' regulariser), drawn anew at
    every call: ``F.random.normal_like(weight)``, a draw of a sample-independent
    shape."""

    def __init__(self, width, **kw):
        super(WeightNoise, self).__init__(**kw)
        self.width = width
        with self.name_scope():
            self.weight = self.params.get("weight", shape=(width, 2), init=mx.init.Zero())

    def hybrid_forward(self, F, x, weight):
        noisy = weight + 0.5 * F.random.normal_like(weight)
        return F.FullyConnected(x, noisy, no_bias=True, num_hidden=self.width)


@pytest.mark.parametrize("policy", POLICIES)
def test_weight_noise_is_drawn_per_sample(policy):
    """docs/errors.rst: a random draw of fixed shape inside a flagged block is
    unmergeable; every call draws its own, with a ContractWarning. The oracle:
    plain Gluon's draws are independent per sample, so jitbatch's must be too
    (merged, every sample shared one draw)."""
    net = initialized(WeightNoise(32))
    xs = [nd.ones((1, 2)) for _ in range(6)]

    def draws(flag):
        mx.random.seed(3)
        if flag:
            net.hybridize(dynamic_batch=True, policy=policy)
        try:
            with autograd.record():
                ys = [net(x) for x in xs]
            return [y.asnumpy() for y in ys]
        finally:
            net.hybridize(active=False)

    def agreement(ys):
        return np.mean([(a == b).mean() for i, a in enumerate(ys) for b in ys[i + 1:]])
    plain = draws(False)
    assert agreement(plain) < 0.05, "test bug: plain Gluon's draws agree"
    with pytest.warns(jitbatch.ContractWarning, match="normal_like"):
        got = draws(True)
    assert agreement(got) < 0.05, ("merged samples share their weight noise: pairwise "
                                   "agreement %.2f (plain Gluon %.2f)"
                                   % (agreement(got), agreement(plain)))
