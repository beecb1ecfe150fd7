"""Held-out programs, round 33: convolutional and recurrent models over
per-sample inputs of varying size, and scale and numeric extremes, each
checked against plain per-sample Gluon.

* ``Conv1D`` over token sequences of varying length ``(1, C, L)`` with
  ``MaxPool1D`` and global pooling; ``Conv2D`` over images of varying
  ``H, W`` with strides, padding, dilation, ``AvgPool2D``,
  ``GlobalAvgPool2D``; ``Conv2DTranspose``; trained with a Trainer.
* Normalization: ``BatchNorm`` in inference, ``BatchNorm(use_global_stats=True)``
  trained, ``LayerNorm``, ``InstanceNorm``, ``GroupNorm``.
* Recurrent cells stepped per sample: ``BidirectionalCell`` unrolled with
  ``valid_length``, ``ResidualCell``, ``SequentialRNNCell`` of LSTM cells,
  ``unroll(..., merge_outputs=True/False, layout='NTC')`` of varying ``T``.
* Scale: a chain 1500 calls deep, a node of 1000 children summed with
  ``nd.add_n``, a 4096-sample inference minibatch.
* Numeric extremes: NaN and inf samples (their rows only: the other
  samples' outputs and input gradients stay plain Gluon's), a float16 model.

* Also: a text CNN (``Embedding``, transpose, ``Conv1D``, max over time) over
  token ids of varying length; a conv model over images of two sizes run side
  by side with ``jitbatch.map``; an inf and a NaN sample first in a merged
  inference launch (filler rows copy the first sample).

The oracle is plain per-sample Gluon (no hybridize) on the same parameters and
inputs, under the policies auto, depth, agenda and sequential. Not run (plain
Gluon / MXNet 1.9.1 itself fails or is wrong): ``rnn.LSTMPCell`` (not in
Gluon 1.9.1's ``rnn``); the backward of several batch-1 ``Conv2DTranspose``
calls in one graph (oneDNN "could not execute a primitive", plain Gluon too:
the deconvolution test is inference only); ``MaxPool2D`` recorded under
``autograd.record(train_mode=False)`` then ``backward()`` (oneDNN pooling
forward_scoring has no workspace: plain Gluon's input gradients differ from
run to run); a CPU float16 ``Dense`` (MXNet: "float16 fully connected layer
is currently only supported by CuDNN"; the float16 model uses elementwise
operators).

Findings: none. Every program gives plain per-sample Gluon's outputs,
gradients and parameters under every policy; same-size images, the 1000
children and the 4096 samples merge under 'depth' and 'agenda'.
"""
import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import nn, rnn

import jitbatch
from heldout import (both, flag, grads_of, merged, nothing_pending,  # noqa: F401
                     params_of, rng_for, same_values as same)

POLICIES = ["auto", "depth", "agenda", "sequential"]
POLICY = pytest.mark.parametrize("policy", POLICIES)
MERGING = ["depth", "agenda"]


def seq_of(*blocks, prefix=None):
    net = nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(*blocks)
    return net


def fresh(build):
    def make():
        mx.random.seed(0)
        net = build()
        net.initialize(mx.init.Uniform(0.5))
        return net
    return make


def train(net, policy, sample, xs, steps=2, lr=0.1):
    """``steps`` SGD steps of ``net`` flagged with ``policy``; ``sample(x)``
    returns (loss, [arrays]). Returns losses, arrays, gradients, parameters."""
    flag(net, policy)
    tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": lr})
    out = []
    for _ in range(steps):
        with autograd.record():
            res = [sample(x) for x in xs]
            loss = nd.add_n(*[r[0] for r in res])
        loss.backward()
        out += [a.asnumpy() for r in res for a in [r[0]] + list(r[1])] + grads_of(net)
        tr.step(len(xs))
    return out + params_of(net)


def sq(net):
    def sample(x):
        y = net(x)
        return nd.sum(y * y), [y]
    return sample


# -- 1. convolutions over inputs of varying size ----------------------------------------
@POLICY
def test_conv1d_over_token_sequences_of_varying_length(policy):
    rng = rng_for("conv1d")
    lens = [5, 6, 7, 5, 6, 9]
    xs = [nd.array(rng.normal(size=(1, 2, n))) for n in lens]

    def build():
        return seq_of(nn.Conv1D(4, 3, padding=1, in_channels=2, activation="relu"),
                      nn.MaxPool1D(2, ceil_mode=True),
                      nn.Conv1D(3, 2, dilation=2, in_channels=4),
                      nn.GlobalMaxPool1D(), nn.Flatten(), nn.Dense(2, in_units=3))

    want, got, _ = both(fresh(build), lambda n, p: train(n, p, sq(n), xs), policy)
    same(want, got, "conv1d")


@POLICY
def test_conv2d_over_images_of_varying_size(policy):
    rng = rng_for("conv2d")
    sizes = [(6, 7), (5, 5), (6, 7), (8, 6), (5, 5)]
    xs = [nd.array(rng.normal(size=(1, 2, h, w))) for h, w in sizes]

    def build():
        return seq_of(nn.Conv2D(3, 3, strides=2, padding=1, in_channels=2, activation="tanh"),
                      nn.Conv2D(4, (2, 3), padding=(1, 2), dilation=(1, 2), in_channels=3),
                      nn.AvgPool2D(2, strides=1, padding=1, count_include_pad=False),
                      nn.MaxPool2D(2), nn.GlobalAvgPool2D(), nn.Flatten(),
                      nn.Dense(3, in_units=4))

    want, got, _ = both(fresh(build), lambda n, p: train(n, p, sq(n), xs), policy)
    same(want, got, "conv2d")


@POLICY
def test_conv2d_transpose_upsampling_of_varying_size(policy):
    """Inference only: plain Gluon's backward of several batch-1
    ``Conv2DTranspose`` calls in one graph fails in MXNet 1.9.1 (oneDNN "could
    not execute a primitive"), with or without jitbatch."""
    rng = rng_for("deconv")
    sizes = [(2, 3), (3, 3), (2, 3), (4, 2)]
    xs = [nd.array(rng.normal(size=(1, 3, h, w))) for h, w in sizes]

    def build():
        return seq_of(nn.Conv2DTranspose(2, 3, strides=2, padding=1, output_padding=1,
                                         in_channels=3, activation="relu"),
                      nn.Conv2D(2, 1, in_channels=2))

    def program(net, p):
        flag(net, p)
        return [y.asnumpy() for y in [net(x) for x in xs]]

    want, got, _ = both(fresh(build), program, policy)
    same(want, got, "deconv")


@pytest.mark.parametrize("policy", MERGING)
def test_images_of_the_same_size_merge(policy):
    rng = rng_for("samesize")
    xs = [nd.array(rng.normal(size=(1, 2, 5, 5))) for _ in range(4)]

    def build():
        return seq_of(nn.Conv2D(3, 3, in_channels=2), nn.GlobalAvgPool2D())

    def program(net, p):
        flag(net, p)
        return [y.asnumpy() for y in [net(x) for x in xs]]

    want, got, st = both(fresh(build), program, policy)
    same(want, got, "same size")
    assert st["launches"] == 1, st


# -- 2. normalization -------------------------------------------------------------------
def with_running_stats(make, key):
    def made():
        net = make()
        rng = rng_for(key)
        for name, p in net.collect_params().items():
            if name.endswith("running_mean"):
                p.set_data(nd.array(rng.normal(size=p.shape)))
            elif name.endswith("running_var"):
                p.set_data(nd.array(rng.uniform(0.5, 2.0, size=p.shape)))
        return net
    return made


@POLICY
def test_batchnorm_in_inference_over_images(policy):
    rng = rng_for("bninfer")
    xs = [nd.array(rng.normal(size=(1, 3, h, 4))) for h in (3, 4, 3, 5)]

    def build():
        return seq_of(nn.Conv2D(3, 3, padding=1, in_channels=3), nn.BatchNorm(in_channels=3),
                      nn.Activation("relu"), nn.GlobalAvgPool2D())

    def program(net, p):
        flag(net, p)
        return [y.asnumpy() for y in [net(x) for x in xs]] + params_of(net)

    want, got, _ = both(with_running_stats(fresh(build), "bninfer"), program, policy)
    same(want, got, "bn inference")


@POLICY
def test_batchnorm_with_global_stats_trained(policy):
    rng = rng_for("bnglobal")
    xs = [nd.array(rng.normal(size=(1, 2, h, 3))) for h in (3, 2, 3, 4)]

    def build():
        return seq_of(nn.Conv2D(3, 2, in_channels=2),
                      nn.BatchNorm(in_channels=3, use_global_stats=True),
                      nn.GlobalMaxPool2D(), nn.Flatten(), nn.Dense(2))

    def program(net, p):
        return train(net, p, sq(net), xs)

    want, got, _ = both(with_running_stats(fresh(build), "bnglobal"), program, policy)
    same(want, got, "bn global stats")


@POLICY
def test_layer_instance_and_group_norm_trained(policy):
    rng = rng_for("norms")
    xs = [nd.array(rng.normal(size=(1, 4, h, 3))) for h in (3, 2, 3, 5)]

    def build():
        return seq_of(nn.Conv2D(4, 1, in_channels=4), nn.InstanceNorm(in_channels=4),
                      nn.GroupNorm(num_groups=2), nn.LayerNorm(axis=1, in_channels=4),
                      nn.GlobalAvgPool2D(), nn.Flatten(), nn.Dense(2, in_units=4))

    want, got, _ = both(fresh(build), lambda n, p: train(n, p, sq(n), xs), policy)
    same(want, got, "norms")


# -- 3. recurrent cells -----------------------------------------------------------------
def run_cell(cell, policy, xs, per_sample, steps=2):
    flag(cell, policy)
    tr = gluon.Trainer(cell.collect_params(), "sgd", {"learning_rate": 0.1})
    out = []
    for _ in range(steps):
        with autograd.record():
            res = [per_sample(x) for x in xs]
            loss = nd.add_n(*[r[0] for r in res])
        loss.backward()
        out += [a.asnumpy() for r in res for a in [r[0]] + list(r[1])] + grads_of(cell)
        tr.step(len(xs))
    return out + params_of(cell)


@POLICY
def test_bidirectional_lstm_unrolled_with_valid_length(policy):
    rng = rng_for("bidir")
    lens = [(4, 2), (3, 3), (4, 4), (2, 1), (3, 2)]
    xs = [(nd.array(rng.normal(size=(1, t, 2))), nd.array([v])) for t, v in lens]

    def build():
        c = rnn.BidirectionalCell(rnn.LSTMCell(3, input_size=2, prefix="l_"),
                                  rnn.LSTMCell(3, input_size=2, prefix="r_"))
        return c

    def program(cell, p):
        def sample(xv):
            x, v = xv
            cell.reset()
            outs, states = cell.unroll(x.shape[1], x, layout="NTC", merge_outputs=True,
                                       valid_length=v)
            return nd.sum(outs * outs) + nd.sum(states[0] ** 2), [outs] + list(states)
        return run_cell(cell, p, xs, sample)

    want, got, _ = both(fresh(build), program, policy)
    same(want, got, "bidirectional")


@POLICY
@pytest.mark.parametrize("merge_outputs", [True, False])
def test_stacked_lstm_with_a_residual_gru_unrolled_ntc(policy, merge_outputs):
    rng = rng_for("stacked", merge_outputs)
    xs = [nd.array(rng.normal(size=(1, t, 3))) for t in (3, 1, 4, 3, 2)]

    def build():
        c = rnn.SequentialRNNCell(prefix="st_")
        with c.name_scope():
            c.add(rnn.LSTMCell(3, input_size=3))
            c.add(rnn.ResidualCell(rnn.GRUCell(3, input_size=3)))
            c.add(rnn.LSTMCell(2, input_size=3))
        return c

    def program(cell, p):
        def sample(x):
            cell.reset()
            outs, states = cell.unroll(x.shape[1], x, layout="NTC",
                                       merge_outputs=merge_outputs)
            outs = outs if merge_outputs else nd.concat(*outs, dim=1)
            return nd.sum(outs * outs), [outs] + list(states)
        return run_cell(cell, p, xs, sample)

    want, got, _ = both(fresh(build), program, policy)
    same(want, got, "stacked")


@POLICY
def test_a_cell_stepped_by_hand_with_begin_state(policy):
    rng = rng_for("byhand")
    xs = [nd.array(rng.normal(size=(t, 1, 2))) for t in (2, 4, 1, 3)]

    def build():
        return rnn.LSTMCell(3, input_size=2, prefix="hand_")

    def program(cell, p):
        def sample(x):
            states = cell.begin_state(batch_size=1)
            hs = []
            for t in range(x.shape[0]):
                h, states = cell(x[t], states)
                hs.append(h)
            return nd.sum(nd.stack(*hs) ** 2), hs[-1:] + states
        return run_cell(cell, p, xs, sample)

    want, got, _ = both(fresh(build), program, policy)
    same(want, got, "by hand")


# -- 4. scale ---------------------------------------------------------------------------
@POLICY
def test_a_chain_1500_calls_deep(policy):
    rng = rng_for("deep")
    xs = [nd.array(rng.normal(size=(1, 4))) for _ in range(2)]

    def build():
        return nn.Dense(4, in_units=4, activation="tanh")

    def program(net, p):
        def sample(x):
            h = x
            for _ in range(1500):
                h = net(h) + x
            return nd.sum(h * h), [h]
        return train(net, p, sample, xs, steps=1, lr=0.001)

    want, got, _ = both(fresh(build), program, policy)
    same(want, got, "deep chain")


@POLICY
def test_a_node_with_1000_children_summed_with_add_n(policy):
    rng = rng_for("wide")
    xs = [nd.array(rng.normal(size=(1000, 3))) for _ in range(2)]

    def build():
        return nn.Dense(2, in_units=3, activation="sigmoid")

    def program(net, p):
        def sample(x):
            kids = [net(x[i:i + 1]) for i in range(x.shape[0])]
            s = nd.add_n(*kids)
            return nd.sum(s * s), [s]
        return train(net, p, sample, xs, steps=1, lr=0.001)

    want, got, _ = both(fresh(build), program, policy)
    same(want, got, "wide")


@POLICY
def test_a_4096_sample_inference_minibatch(policy):
    rng = rng_for("big")
    data = rng.normal(size=(4096, 4))
    xs = [nd.array(data[i:i + 1]) for i in range(4096)]

    def build():
        return seq_of(nn.Dense(8, in_units=4, activation="relu"), nn.Dense(2, in_units=8))

    def program(net, p):
        flag(net, p)
        ys = [net(x) for x in xs]
        return [np.concatenate([y.asnumpy() for y in ys])]

    want, got, st = both(fresh(build), program, policy)
    same(want, got, "4096")
    if policy in MERGING:
        assert merged(st), st


# -- 5. numeric extremes ----------------------------------------------------------------
@POLICY
def test_nan_and_inf_samples_stay_in_their_own_rows(policy):
    rng = rng_for("nan")
    xs = [rng.normal(size=(1, 2, 4, 4)) for _ in range(5)]
    xs[1][0, 0, 1, 2] = np.nan
    xs[3][0, 1, 0, 0] = np.inf
    xs[4][0, 0, 3, 3] = -np.inf
    xs = [nd.array(x) for x in xs]

    def build():
        return seq_of(nn.Conv2D(3, 3, padding=1, in_channels=2),
                      nn.BatchNorm(in_channels=3, use_global_stats=True), nn.MaxPool2D(2),
                      nn.Flatten(), nn.Dense(3, in_units=12),
                      nn.LayerNorm(in_channels=3))

    def program(net, p):
        flag(net, p)
        ins = [x.copy() for x in xs]
        for x in ins:
            x.attach_grad()
        with autograd.record():
            ys = [net(x) for x in ins]
            ls = [nd.sum(nd.softmax(y) * nd.arange(3).reshape((1, 3))) for y in ys]
            loss = nd.add_n(*ls)
        loss.backward()
        return [y.asnumpy() for y in ys] + [x.grad.asnumpy() for x in ins]

    want, got, _ = both(with_running_stats(fresh(build), "nan"), program, policy)
    for i in (0, 2):  # the finite samples are finite in plain Gluon
        assert np.isfinite(want[i]).all() and np.isfinite(want[5 + i]).all()
    same(want, got, "nan")


class HalfDense(nn.HybridBlock):
    """A dense layer of elementwise operators (MXNet 1.9.1's CPU
    ``FullyConnected`` refuses float16)."""

    def __init__(self, units, in_units, **kw):
        super().__init__(**kw)
        with self.name_scope():
            self.weight = self.params.get("weight", shape=(in_units, units))
            self.bias = self.params.get("bias", shape=(units,))

    def hybrid_forward(self, F, x, weight, bias):
        y = F.sum(F.broadcast_mul(F.expand_dims(x, axis=2), F.expand_dims(weight, axis=0)),
                  axis=1)
        return F.broadcast_add(y, F.expand_dims(bias, axis=0))


@POLICY
def test_a_float16_model_trained(policy):
    """Inputs scaled by 30: large float16 sums per sample (finite in plain
    Gluon, asserted), merged ones must stay as plain Gluon's."""
    rng = rng_for("half")
    xs = [nd.array(rng.normal(size=(int(rng.integers(1, 4)), 4)) * 30, dtype="float16")
          for _ in range(6)]

    def make():
        mx.random.seed(0)
        net = seq_of(HalfDense(8, 4, prefix="h1_"), nn.Activation("relu"),
                     HalfDense(3, 8, prefix="h2_"))
        net.initialize(mx.init.Uniform(0.5))
        net.cast("float16")
        return net

    def program(net, p):
        def sample(x):
            y = net(x)
            return nd.sum(y * y), [y.astype("float32")]
        out = train(net, p, sample, xs, lr=1e-6)
        return [a.astype(np.float32) for a in out]

    want, got, _ = both(make, program, policy)
    assert len(want) == len(got)
    assert all(np.isfinite(a).all() for a in want)
    for i, (a, b) in enumerate(zip(want, got)):
        assert a.shape == b.shape, i
        np.testing.assert_allclose(b, a, rtol=2e-3, atol=2e-3, err_msg="half %d" % i)


# -- 6. what a demanding user tries next ------------------------------------------------
class TextCNN(nn.HybridBlock):
    """Embedding, then Conv1D over the words (channels first), max over time."""

    def __init__(self, **kw):
        super().__init__(**kw)
        with self.name_scope():
            self.emb = nn.Embedding(11, 4)
            self.conv = nn.Conv1D(5, 2, padding=1, in_channels=4, activation="relu")
            self.out = nn.Dense(2, in_units=5)

    def hybrid_forward(self, F, ids):
        h = F.transpose(self.emb(ids), axes=(0, 2, 1))
        return self.out(F.max(self.conv(h), axis=2))


@POLICY
def test_text_cnn_over_token_ids_of_varying_length(policy):
    rng = rng_for("textcnn")
    ids = [nd.array(rng.integers(0, 11, size=(1, int(rng.integers(1, 6))))) for _ in range(7)]

    def make():
        return fresh(lambda: TextCNN(prefix="tc_"))()

    want, got, _ = both(make, lambda n, p: train(n, p, sq(n), ids), policy)
    same(want, got, "text cnn")


@POLICY
def test_a_conv_model_over_images_run_side_by_side_with_map(policy):
    rng = rng_for("mapconv")
    sizes = [(5, 5), (6, 4), (5, 5), (6, 4), (5, 5), (4, 4)]
    xs = [nd.array(rng.normal(size=(1, 2, h, w))) for h, w in sizes]

    def build():
        return seq_of(nn.Conv2D(3, 3, padding=1, in_channels=2, activation="relu"),
                      nn.MaxPool2D(2), nn.Conv2D(2, 1, in_channels=3),
                      nn.GlobalAvgPool2D(), nn.Flatten())

    def program(net, p):
        flag(net, p)
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
        out = []
        run = jitbatch.map if p is not None else lambda f, it: [f(i) for i in it]
        for _ in range(2):
            with autograd.record():
                ys = run(lambda x: nd.sum(net(x) ** 2), xs)
                loss = nd.add_n(*ys)
            loss.backward()
            out += [y.asnumpy() for y in ys] + grads_of(net)
            tr.step(len(xs))
        return out + params_of(net)

    want, got, _ = both(fresh(build), program, policy)
    same(want, got, "map conv")


@pytest.mark.parametrize("policy", MERGING)
def test_an_inf_first_sample_in_an_inference_launch_leaves_the_others_alone(policy):
    """Filler rows of a launch copy its first sample (``config.row_buckets``):
    an inf/NaN first sample must not reach the other samples' rows."""
    rng = rng_for("inffirst")
    data = rng.normal(size=(5, 1, 4))
    data[0, 0, 1] = np.inf
    data[1, 0, 2] = np.nan
    xs = [nd.array(d) for d in data]

    def build():
        return seq_of(nn.Dense(3, in_units=4, activation="tanh"), nn.LayerNorm(in_channels=3),
                      nn.Dense(2, in_units=3))

    def program(net, p):
        flag(net, p)
        ys = [nd.softmax(net(x)) for x in xs]
        return [y.asnumpy() for y in ys]

    want, got, st = both(fresh(build), program, policy)
    assert all(np.isfinite(w).all() for w in want[2:])
    same(want, got, "inf first")
    assert merged(st), st
