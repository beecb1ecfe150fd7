"""Held-out models, round 13: REAL third-party Gluon blocks nobody tuned
jitbatch for, those of gluonnlp 0.10.0, used the way a per-sample NLP program
uses them: its attention cells over per-sample keys of varying length, the
highway layer, the character CNN encoder (TNC layout), the LSTM cell with a
projection and clipping, the Transformer encoder (positional embedding, valid
length mask), ELMo's character encoder, the masked softmax cross-entropy and
label smoothing, and the beam search sampler's step update.

gluonnlp itself is not a dependency of this suite: it was built apart
(``pip install --target``) and run against jitbatch by scripts kept outside
the repository; every block here MIRRORS one gluonnlp block's math in plain
Gluon (written anew, not copied; each docstring names the block it mirrors).
The oracle is plain per-sample Gluon (no hybridize) on the same parameters
and inputs (``harness.run``): outputs, the summed loss and every parameter
gradient, in training and in inference, under policies auto, depth, agenda and
sequential. Where calls can merge the counters must show it (exact launch
counts where the schedule is fixed by the program). The round's three
findings (two crashes, an unclear error) are fixed; their tests are at the
end, each docstring says what happened before.
"""
import math
import textwrap
import warnings

import numpy as np
import pytest
import mxnet as mx
from mxnet import gluon, nd
from mxnet.gluon import HybridBlock, nn

import jitbatch
from harness import assert_same, run, run_configured
from heldout import (contract_warnings, merged, nothing_pending,  # noqa: F401
                     rng_for, run_in_subprocess)

H = 8
POLICIES = ["auto", "depth", "agenda", "sequential"]
TRAIN = pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
POLICY = pytest.mark.parametrize("policy", POLICIES)
NEG = -1e18     # gluonnlp's fill for masked attention scores


def seeded_net(cls, *args, **kw):
    mx.random.seed(0)
    net = cls(*args, **kw)
    net.initialize(mx.init.Uniform(0.5))
    return net


def differential(net, samples, apply, train, policy, mapped=False):
    """Plain per-sample Gluon, then the same network flagged with ``policy``:
    asserts outputs, losses and gradients agree; returns (stats, the
    ContractWarning messages)."""
    ref = run(net, apply, samples, train, flag=False, mapped=mapped)
    jitbatch.reset_stats()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        got = run(net, apply, samples, train, flag=True, policy=policy, mapped=mapped)
    assert_same(ref, got)
    return jitbatch.stats(), contract_warnings(rec)


def squares(net, sample):
    y = net(*sample)
    return y, nd.sum(y * y)


def keys_of(rng, lengths):
    """One (query (1, 1, H), keys (1, S, H)) pair per length."""
    return [(nd.array(rng.normal(size=(1, 1, H))), nd.array(rng.normal(size=(1, s, H))))
            for s in lengths]


# -- 1. attention cells over per-sample keys ------------------------------------------------
class AdditiveAttention(HybridBlock):
    """Mirrors gluonnlp.model.MLPAttentionCell (Bahdanau): score
    ``v . tanh(Wq q + Wk k)``, with ``normalized=True`` the weight-normalised
    score vector ``g v / |v|`` (its ``_NormalizedScoreProj``); masked scores
    filled with -1e18, the softmax times the mask, read by ``batch_dot``.
    Returns the context and the weights."""

    def __init__(self, units, normalized=False, **kw):
        super(AdditiveAttention, self).__init__(**kw)
        self.units, self.normalized = units, normalized
        with self.name_scope():
            self.q_mid = nn.Dense(units, in_units=H, flatten=False)
            self.k_mid = nn.Dense(units, in_units=H, flatten=False, use_bias=False)
            if normalized:
                self.g = self.params.get("g", shape=(1,),
                                         init=mx.init.Constant(1.0 / math.sqrt(units)))
                self.v = self.params.get("v", shape=(1, units))
            else:
                self.score = nn.Dense(1, in_units=units, flatten=False, use_bias=False)

    def hybrid_forward(self, F, query, key, value, mask, g=None, v=None):
        mid = F.tanh(F.broadcast_add(F.expand_dims(self.q_mid(query), axis=2),
                                     F.expand_dims(self.k_mid(key), axis=1)))
        if self.normalized:
            w = F.broadcast_mul(g, F.broadcast_div(v, F.sqrt(F.dot(v, v, transpose_b=True))))
            score = F.FullyConnected(mid, w, None, no_bias=True, num_hidden=1, flatten=False)
        else:
            score = self.score(mid)
        score = score.reshape(shape=(0, 0, 0))
        score = F.where(mask, score, NEG * F.ones_like(score))
        weights = F.softmax(score, axis=-1) * mask
        return F.batch_dot(weights, value), weights


class MultiHeadDot(HybridBlock):
    """Mirrors gluonnlp.model.MultiHeadAttentionCell over a scaled
    DotProductAttentionCell: per-head projections split by reshape/transpose
    into (B * heads, L, d), ``contrib.div_sqrt_dim`` on the queries, the mask
    repeated per head with ``broadcast_axis``, contexts merged back."""

    def __init__(self, heads=2, **kw):
        super(MultiHeadDot, self).__init__(**kw)
        self.heads = heads
        with self.name_scope():
            self.pq = nn.Dense(H, in_units=H, flatten=False, use_bias=False)
            self.pk = nn.Dense(H, in_units=H, flatten=False, use_bias=False)
            self.pv = nn.Dense(H, in_units=H, flatten=False, use_bias=False)

    def _heads(self, F, x):
        x = F.transpose(x.reshape(shape=(0, 0, self.heads, -1)), axes=(0, 2, 1, 3))
        return x.reshape(shape=(-1, 0, 0), reverse=True)

    def hybrid_forward(self, F, query, key, value, mask):
        q = F.contrib.div_sqrt_dim(self._heads(F, self.pq(query)))
        k = self._heads(F, self.pk(key))
        m = F.broadcast_axis(F.expand_dims(mask, axis=1), axis=1, size=self.heads)
        m = m.reshape(shape=(-1, 0, 0), reverse=True)
        score = F.batch_dot(q, k, transpose_b=True)
        score = F.where(m, score, NEG * F.ones_like(score))
        weights = F.softmax(score, axis=-1) * m
        ctx = F.batch_dot(weights, self._heads(F, self.pv(value)))
        ctx = F.transpose(ctx.reshape(shape=(-1, self.heads, 0, 0), reverse=True),
                          axes=(0, 2, 1, 3)).reshape(shape=(0, 0, -1))
        return ctx, weights.reshape(shape=(-1, self.heads, 0, 0), reverse=True)


class Attend(gluon.Block):
    """The per-sample program: one query against the sample's own keys, all
    of them valid (a mask of ones, as a user builds it per sample)."""

    def __init__(self, make_cell, **kw):
        super(Attend, self).__init__(**kw)
        with self.name_scope():
            self.cell = make_cell()

    def forward(self, query, key):
        ctx, _ = self.cell(query, key, key, nd.ones((1, 1, key.shape[1])))
        return ctx


CELLS = {"mlp": lambda: AdditiveAttention(H), "mlp_normalized": lambda: AdditiveAttention(H, True),
         "multi_head": lambda: MultiHeadDot()}


@pytest.mark.parametrize("cell", sorted(CELLS))
@POLICY
@TRAIN
def test_attention_cells_over_per_sample_keys(cell, train, policy):
    """gluonnlp's MLPAttentionCell (plain and normalized) and
    MultiHeadAttentionCell(DotProductAttentionCell): six samples, keys of
    three lengths: one cell launch per length, the ``c * c``, ``sum`` and
    ``ones`` each one launch (and the ``add_n`` in training)."""
    samples = keys_of(rng_for("attention", cell, train, policy), [3, 5, 3, 4, 5, 3])
    st, warned = differential(seeded_net(Attend, CELLS[cell]), samples, squares, train, policy)
    assert not warned
    assert st["nodes"] == (24 if train else 23), st
    if policy in ("depth", "agenda"):
        assert st["launches"] == (9 if train else 8), st
    elif policy == "auto":
        assert merged(st), st


# -- 2. highway layer, LSTM cell with projection and clipping ---------------------------------
class Highway(HybridBlock):
    """Mirrors gluonnlp.model.Highway: per layer one Dense to 2H, split into
    the transform and the gate; ``(1 - t) * x + t * relu(A x)``; the gate's
    bias starts at -2 as gluonnlp's HighwayBias does."""

    def __init__(self, size, layers=2, **kw):
        super(Highway, self).__init__(**kw)
        with self.name_scope():
            self.layers = nn.HybridSequential()
            for _ in range(layers):
                self.layers.add(nn.Dense(2 * size, in_units=size, flatten=False,
                                         bias_initializer=mx.init.Constant(-2.0)))

    def hybrid_forward(self, F, x):
        for layer in self.layers:
            transform, gate = F.split(layer(x), num_outputs=2, axis=-1)
            gate = F.sigmoid(gate)
            x = (1 - gate) * x + gate * F.relu(transform)
        return x


class HighwayNet(gluon.Block):
    def __init__(self, **kw):
        super(HighwayNet, self).__init__(**kw)
        with self.name_scope():
            self.hw = Highway(H)

    def forward(self, x):
        return self.hw(x)


@POLICY
@TRAIN
def test_highway_over_word_vectors(train, policy):
    """gluonnlp.model.Highway over one (1, H) vector per sample: all six
    calls merge (4 launches in training: highway, ``*``, ``sum``, ``add_n``)."""
    rng = rng_for("highway", train, policy)
    samples = [(nd.array(rng.normal(size=(1, H))),) for _ in range(6)]
    st, warned = differential(seeded_net(HighwayNet), samples, squares, train, policy)
    assert not warned
    assert st["nodes"] == (19 if train else 18), st
    if policy != "sequential":
        assert st["launches"] == (4 if train else 3), st


class ClippedLSTMP(HybridBlock):
    """Mirrors gluonnlp.model.LSTMPCellWithClip: an LSTM step written with
    ``FullyConnected``, ``SliceChannel``, ``Activation`` and the internal
    ``_plus``/``_mul`` operators, the cell clipped, the hidden state projected
    (no bias) and clipped; states ``[r, c]``."""

    def __init__(self, hidden, proj, inputs, cell_clip=1.0, proj_clip=0.5, **kw):
        super(ClippedLSTMP, self).__init__(**kw)
        self.hidden, self.proj = hidden, proj
        self.cell_clip, self.proj_clip = cell_clip, proj_clip
        with self.name_scope():
            self.i2h_weight = self.params.get("i2h_weight", shape=(4 * hidden, inputs))
            self.h2h_weight = self.params.get("h2h_weight", shape=(4 * hidden, proj))
            self.h2r_weight = self.params.get("h2r_weight", shape=(proj, hidden))
            self.i2h_bias = self.params.get("i2h_bias", shape=(4 * hidden,))
            self.h2h_bias = self.params.get("h2h_bias", shape=(4 * hidden,))

    def hybrid_forward(self, F, x, r, c, i2h_weight, h2h_weight, h2r_weight, i2h_bias,
                       h2h_bias):
        gates = F.FullyConnected(x, i2h_weight, i2h_bias, num_hidden=4 * self.hidden) + \
            F.FullyConnected(r, h2h_weight, h2h_bias, num_hidden=4 * self.hidden)
        i, f, g, o = F.SliceChannel(gates, num_outputs=4)
        c = F._internal._plus(F.Activation(f, act_type="sigmoid") * c,
                              F.Activation(i, act_type="sigmoid") * F.Activation(g, act_type="tanh"))
        c = c.clip(-self.cell_clip, self.cell_clip)
        h = F._internal._mul(F.Activation(o, act_type="sigmoid"), F.Activation(c, act_type="tanh"))
        r = F.FullyConnected(h, h2r_weight, None, no_bias=True, num_hidden=self.proj)
        return r.clip(-self.proj_clip, self.proj_clip), c


class LSTMPNet(gluon.Block):
    def __init__(self, **kw):
        super(LSTMPNet, self).__init__(**kw)
        with self.name_scope():
            self.cell = ClippedLSTMP(H, 4, 3)

    def forward(self, seq):
        r, c = nd.zeros((1, 4)), nd.zeros((1, H))
        for t in range(seq.shape[0]):
            r, c = self.cell(seq[t:t + 1], r, c)
        return r


@POLICY
@TRAIN
def test_lstm_cell_with_projection_and_clipping_over_sequences(train, policy):
    """gluonnlp.model.LSTMPCellWithClip looped over 1-4 steps per sample."""
    rng = rng_for("lstmp", train, policy)
    samples = [(nd.array(rng.normal(size=(int(n), 3))),) for n in [2, 4, 1, 3, 4, 2]]
    st, warned = differential(seeded_net(LSTMPNet), samples, squares, train, policy)
    assert not warned
    if policy == "agenda":      # one launch per step index (4), the zeros, then the loss
        assert st["launches"] == (9 if train else 8), st
    elif policy != "sequential":
        assert merged(st), st


# -- 3. Transformer encoder over one sequence per sample ----------------------------------------
def position_table(length, dim):
    """Sinusoidal positions (gluonnlp's ``_position_encoding_init``, rewritten)."""
    pos = np.arange(length)[:, None] / np.power(10000, 2.0 * np.arange(dim // 2) / dim)[None]
    return np.concatenate([np.sin(pos), np.cos(pos)], axis=1).astype("float32")


class EncoderLayer(HybridBlock):
    """Mirrors gluonnlp.model.transformer.TransformerEncoderCell: multi-head
    self-attention, output projection, residual, LayerNorm, then the
    PositionwiseFFN (Dense-relu-Dense, residual, LayerNorm)."""

    def __init__(self, **kw):
        super(EncoderLayer, self).__init__(**kw)
        with self.name_scope():
            self.attention = MultiHeadDot()
            self.proj = nn.Dense(H, in_units=H, flatten=False, use_bias=False)
            self.norm = nn.LayerNorm(in_channels=H)
            self.ffn_1 = nn.Dense(2 * H, in_units=H, flatten=False, activation="relu")
            self.ffn_2 = nn.Dense(H, in_units=2 * H, flatten=False)
            self.ffn_norm = nn.LayerNorm(in_channels=H)

    def hybrid_forward(self, F, x, mask):
        ctx, _ = self.attention(x, x, x, mask)
        x = self.norm(self.proj(ctx) + x)
        return self.ffn_norm(self.ffn_2(self.ffn_1(x)) + x)


class Encoder(HybridBlock):
    """Mirrors gluonnlp.model.transformer.TransformerEncoder called with a
    valid length: positions from ``contrib.arange_like`` looked up in a
    constant table by ``Embedding`` and broadcast over the sample, the (B, L,
    L) mask from ``broadcast_lesser`` of the positions and the valid length,
    the output masked by ``SequenceMask`` along axis 1."""

    def __init__(self, max_length=10, **kw):
        super(Encoder, self).__init__(**kw)
        self.max_length = max_length
        with self.name_scope():
            self.position_weight = self.params.get_constant(
                "const", position_table(max_length, H))
            self.norm = nn.LayerNorm(in_channels=H)
            self.layer = EncoderLayer()

    def hybrid_forward(self, F, x, valid_length, position_weight):
        steps = F.contrib.arange_like(x, axis=1)
        ones = F.ones_like(steps)
        mask = F.broadcast_lesser(F.reshape(steps, shape=(1, -1)),
                                  F.reshape(valid_length, shape=(-1, 1)))
        mask = F.broadcast_mul(F.expand_dims(mask, axis=1),
                               F.broadcast_mul(ones, F.reshape(ones, shape=(-1, 1))))
        x = x * math.sqrt(H)
        x = F.broadcast_add(x, F.expand_dims(F.Embedding(steps, position_weight,
                                                         self.max_length, H), axis=0))
        out = self.layer(self.norm(x), mask)
        return F.SequenceMask(out, sequence_length=valid_length, use_sequence_length=True,
                              axis=1)


class EncoderNet(gluon.Block):
    def __init__(self, **kw):
        super(EncoderNet, self).__init__(**kw)
        with self.name_scope():
            self.enc = Encoder()

    def forward(self, x, valid):
        return self.enc(x, valid)


@POLICY
@TRAIN
def test_transformer_encoder_with_valid_length_over_one_sequence_per_sample(train, policy):
    """gluonnlp's TransformerEncoder over one (1, L, H) sequence per sample,
    the last position of some samples invalid (valid_length L - 1): samples
    of one length merge (three lengths: three encoder launches)."""
    rng = rng_for("transformer", train, policy)
    samples = [(nd.array(rng.normal(size=(1, n, H))), nd.array([n - (i % 2)]))
               for i, n in enumerate([3, 5, 3, 4, 5, 3])]
    st, warned = differential(seeded_net(EncoderNet), samples, squares, train, policy)
    assert not warned
    if policy in ("depth", "agenda"):
        assert st["launches"] == (10 if train else 9), st
    elif policy == "auto":
        assert merged(st), st


# -- 4. character encoders ---------------------------------------------------------------------
class CharCNN(HybridBlock):
    """Mirrors gluonnlp.model.ConvolutionalEncoder: TNC input (chars, words,
    E) transposed to NCW, one Conv1D per n-gram width, max over time, tanh,
    concatenated (HybridConcurrent), a highway layer, an output Dense."""

    def __init__(self, embed=4, filters=((1, 3), (2, 4)), out=5, **kw):
        super(CharCNN, self).__init__(**kw)
        with self.name_scope():
            self.convs = gluon.contrib.nn.HybridConcurrent(axis=-1)
            for width, num in filters:
                seq = nn.HybridSequential()
                seq.add(nn.Conv1D(num, width, in_channels=embed))
                seq.add(nn.HybridLambda(lambda F, x: F.max(x, axis=2)))
                seq.add(nn.Activation("tanh"))
                self.convs.add(seq)
            width = sum(num for _, num in filters)
            self.highway = Highway(width, layers=1)
            self.out = nn.Dense(out, in_units=width)

    def hybrid_forward(self, F, chars_tnc):
        return self.out(self.highway(self.convs(F.transpose(chars_tnc, axes=(1, 2, 0)))))


class WordEncoderTNC(gluon.Block):
    """A user's per-word program: the word's characters embedded, given the
    encoder in its documented TNC layout ``(chars, 1, E)``."""

    def __init__(self, **kw):
        super(WordEncoderTNC, self).__init__(**kw)
        with self.name_scope():
            self.embed = nn.Embedding(20, 4)
            self.enc = CharCNN()

    def forward(self, chars):
        return self.enc(self.embed(chars).expand_dims(1))


def words(rng, lengths):
    return [(nd.array(rng.integers(0, 20, size=(n,))),) for n in lengths]


def test_tnc_char_cnn_is_refused_by_name_and_runs_right_unflagged():
    """gluonnlp.model.ConvolutionalEncoder is TNC only: per word the sample
    sits along axis 1, so merging along axis 0 would make one longer word.
    jitbatch refuses it at the first call with a BatchingError naming the
    block and both shapes (its first fix, "a per-sample leading axis (1, K,
    H)", does not apply to a TNC block; its second does): with that block
    unflagged (``hybridize(active=False)``) the rest merges and the numbers
    are plain Gluon's."""
    samples = words(rng_for("charcnn"), [3, 5, 3, 4])
    net = seeded_net(WordEncoderTNC)
    net.hybridize(dynamic_batch=True, policy="agenda")
    with pytest.raises(jitbatch.BatchingError) as err:
        squares(net, samples[0])
    msg = str(err.value)
    assert net.enc.name in msg and "(1, 5)" in msg and "(2, 5)" in msg, msg
    assert "without dynamic_batch" in msg, msg
    net.hybridize(active=False)

    ref = run(net, squares, samples, True, flag=False)
    net.hybridize(dynamic_batch=True, policy="agenda")
    net.enc.hybridize(active=False)
    jitbatch.reset_stats()
    got = run_configured(net, squares, samples, True)
    assert_same(ref, got)
    assert merged(jitbatch.stats())


class ElmoCharEncoder(HybridBlock):
    """Mirrors gluonnlp.model.elmo.ELMoCharacterEncoder: (B, T, C) char ids
    reshaped to (B*T, C), embedded, transposed to TNC for the char CNN (above),
    and reshaped back to (B, T, out) with ``reshape_like`` of a broadcast
    slice of the input."""

    def __init__(self, chars=6, vocab=12, out=5, **kw):
        super(ElmoCharEncoder, self).__init__(**kw)
        self.chars, self.out = chars, out
        with self.name_scope():
            self.embed = nn.Embedding(vocab, 4)
            self.cnn = CharCNN(out=out)

    def hybrid_forward(self, F, x):
        e = F.transpose(self.embed(x.reshape((-1, self.chars))), axes=(1, 0, 2))
        ref = x.slice_axis(axis=-1, begin=0, end=1).broadcast_axes(axis=(2,), size=(self.out,))
        return self.cnn(e).reshape_like(ref)


class ElmoNet(gluon.Block):
    def __init__(self, **kw):
        super(ElmoNet, self).__init__(**kw)
        with self.name_scope():
            self.enc = ElmoCharEncoder()

    def forward(self, x):
        return self.enc(x)


@POLICY
@TRAIN
def test_elmo_character_encoder_over_sentences(train, policy):
    """ELMo's character encoder over one (1, T, 6) sentence per sample: its
    internal TNC transpose is inside the block, so sentences of one length
    merge (three lengths: three launches)."""
    rng = rng_for("elmo", train, policy)
    samples = [(nd.array(rng.integers(0, 12, size=(1, n, 6))),) for n in [3, 5, 3, 4, 5, 3]]
    st, warned = differential(seeded_net(ElmoNet), samples, squares, train, policy)
    assert not warned
    if policy != "sequential":
        assert st["launches"] == (10 if train else 9), st


# -- 5. losses ---------------------------------------------------------------------------------
class MaskedSoftmaxCE(gluon.loss.SoftmaxCELoss):
    """Mirrors gluonnlp.loss.MaskedSoftmaxCELoss: the sample weight is ones
    shaped like the label, zeroed past the valid length by ``SequenceMask``
    along axis 1, then Gluon's softmax cross-entropy with that weight."""

    def __init__(self, sparse_label=True, **kw):
        super(MaskedSoftmaxCE, self).__init__(axis=-1, sparse_label=sparse_label, batch_axis=0,
                                              **kw)

    def hybrid_forward(self, F, pred, label, valid_length):  # pylint: disable=arguments-differ
        if self._sparse_label:
            weight = F.cast(F.expand_dims(F.ones_like(label), axis=-1), dtype="float32")
        else:
            weight = F.ones_like(label)
        weight = F.SequenceMask(weight, sequence_length=valid_length, use_sequence_length=True,
                                axis=1)
        return super(MaskedSoftmaxCE, self).hybrid_forward(F, pred, label, weight)


class LabelSmoothing(HybridBlock):
    """Mirrors gluonnlp.loss.LabelSmoothing with ``units`` given: one-hot
    labels mixed with the uniform distribution."""

    def __init__(self, units, epsilon=0.1, **kw):
        super(LabelSmoothing, self).__init__(**kw)
        self.units, self.epsilon = units, epsilon

    def hybrid_forward(self, F, label):
        return (1 - self.epsilon) * F.one_hot(label, depth=self.units) + self.epsilon / self.units


V = 5


class Tagger(gluon.Block):
    def __init__(self, **kw):
        super(Tagger, self).__init__(**kw)
        with self.name_scope():
            self.out = nn.Dense(V, in_units=3, flatten=False)

    def forward(self, x):
        return self.out(x)


SPARSE_CE, DENSE_CE, SMOOTH = MaskedSoftmaxCE(), MaskedSoftmaxCE(sparse_label=False), \
    LabelSmoothing(V)


def masked_ce(net, sample):
    x, label, valid = sample
    pred = net(x)
    return pred, nd.sum(SPARSE_CE(pred, label, valid))


def smoothed_masked_ce(net, sample):
    x, label, valid = sample
    pred = net(x)
    return pred, nd.sum(DENSE_CE(pred, SMOOTH(label), valid))


@pytest.mark.parametrize("loss", [masked_ce, smoothed_masked_ce], ids=["sparse", "smoothed"])
@POLICY
@TRAIN
def test_masked_softmax_ce_and_label_smoothing_per_sequence(loss, train, policy):
    """gluonnlp's MaskedSoftmaxCELoss (sparse, and dense on LabelSmoothing's
    labels) per (1, T, V) prediction with a per-sample valid length: the
    losses are unflagged blocks whose operators record and merge."""
    rng = rng_for("loss", loss.__name__, train, policy)
    samples = [(nd.array(rng.normal(size=(1, n, 3))), nd.array(rng.integers(0, V, size=(1, n))),
                nd.array([max(1, n - 1)])) for n in [3, 5, 3, 4, 5, 3]]
    st, warned = differential(seeded_net(Tagger), samples, loss, train, policy)
    assert not warned
    if policy != "sequential":
        assert merged(st), st


# -- 6. beam search, the step update run per sample under jitbatch.map --------------------------
class StepDecoder(HybridBlock):
    """The per-sample one-step decoder a user hands gluonnlp's
    BeamSearchSampler: (beam,) word ids (float) and (beam, H) states to
    log-probabilities over V words and the new state."""

    def __init__(self, vocab=7, **kw):
        super(StepDecoder, self).__init__(**kw)
        with self.name_scope():
            self.embed = nn.Embedding(vocab, H)
            self.cell = gluon.rnn.GRUCell(H, input_size=H)
            self.out = nn.Dense(vocab, in_units=H)

    def hybrid_forward(self, F, word, h):
        y, (h,) = self.cell(self.embed(word), [h])
        return F.log_softmax(self.out(y)), h


class BeamStep(HybridBlock):
    """Mirrors gluonnlp's _BeamSearchStepUpdate (with BeamSearchScorer's
    length penalty, alpha 1, K 5), the integer division of the flat indices
    by the vocabulary size done in float32 (in int32 it once crashed: see
    test_integer_division_of_a_lazy_array_by_an_integer_array): candidate
    scores of alive beams, finished beams kept as a candidate, ``topk``
    over beam x vocabulary, the beam and word of each pick, the samples,
    states and alive mask taken from the chosen beams. Not flagged: it runs
    on the decoder's lazy outputs operator by operator, as in gluonnlp, where
    the sampler hybridizes it plainly."""

    def __init__(self, beam, eos=1, **kw):
        super(BeamStep, self).__init__(**kw)
        self.beam, self.eos = beam, eos

    def hybrid_forward(self, F, samples, log_probs, scores, step, alive, h, vocab):
        beam = self.beam
        prev_lp = ((5.0 + step - 1) / 6.0) * (step != 1) + (step == 1)
        lp = (5.0 + step) / 6.0
        cand = F.broadcast_div(F.broadcast_add(log_probs.reshape((-4, -1, beam, 0)),
                                               F.expand_dims(F.broadcast_mul(scores, prev_lp),
                                                             axis=-1)), lp)
        a = F.expand_dims(alive, axis=2)
        cand = F.broadcast_mul(a, cand) + F.broadcast_mul(1 - a, F.ones_like(cand) * NEG)
        finished = F.where(alive, F.ones_like(scores) * NEG, scores)
        cand = F.concat(cand.reshape((0, -1)), finished, dim=1)
        new_scores, idx = F.topk(cand, axis=1, k=beam, ret_typ="both")
        use_prev = F.broadcast_greater_equal(idx, beam * vocab)
        word = F.broadcast_mod(idx, vocab)
        beam_ids = F.where(use_prev, F.broadcast_minus(idx, beam * vocab),
                           F.floor(F.broadcast_div(idx, vocab)))
        word = F.where(use_prev, -F.ones_like(idx), word)
        samples = F.concat(F.take(samples.reshape((-3, 0)), beam_ids.reshape((-1,))),
                           word.reshape((-1, 1)), dim=1).reshape((-4, -1, beam, 0))
        h = F.take(h, beam_ids.reshape((-1,)))
        alive = F.take(alive.reshape((-1,)), beam_ids.reshape((-1,))).reshape((-1, beam)) * \
            (word != self.eos)
        return samples, new_scores, word, alive, h


class Seq2Seq(gluon.Block):
    def __init__(self, **kw):
        super(Seq2Seq, self).__init__(**kw)
        with self.name_scope():
            self.enc = gluon.rnn.GRUCell(H, input_size=3)
            self.dec = StepDecoder()

    def forward(self, src):
        h = [nd.zeros((1, H))]
        for t in range(src.shape[0]):
            _, h = self.enc(src[t:t + 1], h)
        return h[0]


def beam_search(net, src, beam=2, steps=4):
    """gluonnlp's BeamSearchSampler loop for one sample: expand to the beam,
    one decoder call and one step update per step, stop when no beam lives
    (a read per step)."""
    step_fn = BeamStep(beam)
    h = net(src)
    h = h.expand_dims(1).broadcast_axes(axis=1, size=beam).reshape((beam, H))
    word = nd.array([2] * beam)
    scores = nd.array([[0.0] + [NEG] * (beam - 1)])
    alive = nd.ones((1, beam))
    samples = word.reshape((1, beam, 1))
    for i in range(steps):
        log_probs, h = net.dec(word, h)
        samples, scores, chosen, alive, h = step_fn(samples, log_probs, scores, nd.array([i + 1]),
                                                    alive, h, nd.array([7]))
        word = nd.relu(chosen).reshape((-1,))
        if nd.sum(alive).asscalar() == 0:
            break
    return samples.asnumpy(), scores.asnumpy()


@POLICY
def test_beam_search_per_sample_under_map(policy):
    """The sampler's loop per source sentence, its step update unflagged,
    under ``jitbatch.map`` (a read per step): samples and scores equal plain
    Gluon's, and the decoder calls of the samples merge."""
    rng = rng_for("beam", policy)
    srcs = [nd.array(rng.normal(size=(n, 3))) for n in [2, 4, 1, 3]]
    net = seeded_net(Seq2Seq)
    net.hybridize(active=False)
    want = [beam_search(net, s) for s in srcs]
    net.hybridize(dynamic_batch=True, policy=policy)
    jitbatch.reset_stats()
    try:
        got = jitbatch.map(lambda s: beam_search(net, s), srcs)
    finally:
        net.hybridize(active=False)
    for (ws, wsc), (gs, gsc) in zip(want, got):
        np.testing.assert_array_equal(gs, ws)
        np.testing.assert_allclose(gsc, wsc, rtol=1e-4, atol=1e-5)
    if policy != "sequential":
        assert merged(jitbatch.stats()), jitbatch.stats()


# -- findings ------------------------------------------------------------------------------------
def test_integer_division_of_a_lazy_array_by_an_integer_array():
    """Mirrors gluonnlp.model.BeamSearchSampler's _BeamSearchStepUpdate
    (``beam_ids = floor(broadcast_div(indices, vocab_size))`` on int32).
    Until 2026-11-27 the process died of SIGFPE: the operator was run once on
    zeros to learn its output shape, and 0 / 0 in int32 traps; integer
    divisors of that trial are now 1 (``_mxapi.trial``)."""
    code = textwrap.dedent("""
        import numpy as np
        import mxnet as mx
        from mxnet import gluon, nd
        import jitbatch
        net = gluon.nn.Dense(4, in_units=3)
        net.initialize(mx.init.Uniform(0.5))
        x = nd.array(np.arange(9).reshape(3, 3) / 9.0)
        out = []
        for flag in (False, True):
            if flag:
                net.hybridize(dynamic_batch=True)
            ids = nd.cast(nd.argmax(net(x), axis=1), dtype="int32")   # (3,) int32
            out.append((ids / nd.array([2, 2, 2], dtype="int32")).asnumpy().tolist())
        print(out[0] == out[1], out)
        """)
    rc, out, err = run_in_subprocess(code)
    assert rc == 0, "exit status %d: %s" % (rc, err[-2000:])
    assert out.startswith("True"), out


class Pick(HybridBlock):
    """Not flagged: picks rows of a flagged block's output by an NDArray index
    (gluonnlp's SequenceSampler step: ``log_probs[arange(n), chosen_ids]``).
    Until 2026-11-27 MXNet's own indexing got the recorded (lazy) index arrays,
    took them for numpy arrays and gather_nd asserted; a lazy array indexed by
    an NDArray is now a recorded gather_nd, and a lazy index of a concrete
    array is computed first."""

    def hybrid_forward(self, F, y, rows):
        return y[rows]


def test_ndarray_indexing_of_a_lazy_output_inside_an_unflagged_hybrid_block():
    """Mirrors gluonnlp.model.SequenceSampler's _SamplingStepUpdate
    (``log_probs[mx.nd.arange(n), chosen_word_ids]``)."""
    net = seeded_net(nn.Dense, 4, in_units=3)
    x = nd.array(np.arange(9).reshape(3, 3) / 9.0)
    rows = nd.array([2, 0], dtype="int32")
    pick = Pick()                                   # not hybridized, as in gluonnlp
    want = pick(net(x), rows).asnumpy()
    net.hybridize(dynamic_batch=True, policy="agenda")
    try:
        got = pick(net(x), rows).asnumpy()
    finally:
        net.hybridize(active=False)
    np.testing.assert_allclose(got, want, rtol=1e-6)


class MaskedOut(HybridBlock):
    """Mirrors the end of gluonnlp.model.elmo.ELMoBiLM.hybrid_forward with a
    mask: ``output * mask.expand_dims(axis=-1)``, which only NDArray's
    ``*`` broadcasts (a traced graph's ``*`` is elementwise)."""

    def __init__(self, **kw):
        super(MaskedOut, self).__init__(**kw)
        with self.name_scope():
            self.out = nn.Dense(4, in_units=3, flatten=False)

    def hybrid_forward(self, F, x, mask):
        return self.out(x) * mask.expand_dims(axis=-1)


def test_a_block_relying_on_imperative_broadcasting_gets_an_error_that_says_so():
    """Until 2026-11-27 the error blamed the inputs ('plain Gluon refuses these
    inputs too'); it now names the operator, NDArray's broadcasting and the
    fix; the fix given works and the next call is right."""
    net = seeded_net(MaskedOut)
    x, mask = nd.ones((1, 3, 3)), nd.ones((1, 3))
    assert net(x, mask).shape == (1, 3, 4)          # plain per-sample Gluon accepts it
    net.hybridize(dynamic_batch=True)
    try:
        with pytest.raises(jitbatch.BatchingError) as err:
            net(x, mask)
    finally:
        net.hybridize(active=False)
    msg = str(err.value)
    assert net.name in msg, msg
    assert "plain Gluon refuses these inputs too" not in msg, msg
    assert "broadcast_mul" in msg and "active=False" in msg and "_mul" in msg, msg
    want = net(x, mask).asnumpy()
    outer = Outer(net)
    outer.hybridize(dynamic_batch=True)
    net.hybridize(active=False)        # the fix: this block unhybridized
    try:
        got = [outer(x, mask) for _ in range(3)]
        for g in got:
            np.testing.assert_allclose(g.asnumpy(), want, rtol=1e-6)
    finally:
        outer.hybridize(active=False)


class Outer(gluon.Block):
    """A user's model around a block that must run unhybridized."""

    def __init__(self, inner, **kw):
        super(Outer, self).__init__(**kw)
        self.inner = inner

    def forward(self, x, mask):
        return self.inner(x, mask)
