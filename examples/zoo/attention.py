"""Attention encoder-decoder (Luong-style dot-product attention), trained with
teacher forcing on a per-step token loss.

Per sample (source of ``S`` tokens, 3-20; target of STEPS tokens): an
``nd.array`` of the source ids and one of the decoder's input ids, two
embedding lookups, ``S`` encoder ``GRUCell`` calls, the encoder states stacked
into attention keys ``(1, S, H)``, then per decoder step one ``GRUCell`` call,
one attention call over the keys, a ``concat`` of the decoder state and the
context, and the output block; the steps' logits are concatenated to
``(STEPS, V)``. The loss is the sum of the steps' cross-entropies.

Hand-batched reference: the encoder as packed sequences
(:func:`examples.zoo.gru_seq.run_packed`), its states gathered into keys
padded to the longest source ``(B, S_max, H)`` with zero rows, the attention
scores of padded positions masked to -1e30 before the softmax (their weights
are exactly 0, so the padding changes no value and no gradient), and the
decoder's STEPS steps run once each over the whole minibatch."""
import numpy as np
from mxnet import gluon, nd

import jitbatch
from mxnet.gluon import HybridBlock, nn

from .common import cross_entropy, index_array, labels_of, seeded
from .gru_seq import pack, run_packed

__all__ = ["DotAttention", "KeyMaskAttention", "Seq2Seq", "PairSample", "build", "generate", "forward", "loss",
           "HandBatched", "STEPS", "BOS"]

STEPS = 5
BOS = 0          # the decoder's first input; targets use ids 1..vocab-1


class DotAttention(HybridBlock):
    """Context of ``query`` (B, H) over ``keys`` (B, S, H): softmax of the dot
    products, then the weighted sum of the keys."""

    def hybrid_forward(self, F, query, keys):  # pylint: disable=arguments-differ
        scores = F.batch_dot(keys, F.expand_dims(query, axis=2))       # (B, S, 1)
        weights = F.softmax(scores, axis=1)
        return F.reshape(F.batch_dot(weights, keys, transpose_a=True), shape=(0, -1))


class MaskedDotAttention(HybridBlock):
    """The same over keys padded to a common S, ``bias`` (B, S) 0 where a key is
    real and -1e30 where it is padding (hand-batched code only)."""

    def hybrid_forward(self, F, query, keys, bias):  # pylint: disable=arguments-differ
        scores = F.reshape(F.batch_dot(keys, F.expand_dims(query, axis=2)), shape=(0, -1))
        weights = F.softmax(scores + bias, axis=1)
        return F.reshape(F.batch_dot(F.expand_dims(weights, axis=1), keys), shape=(0, -1))


class KeyMaskAttention(HybridBlock):
    """:class:`DotAttention` written to batch well (README: per-sample code that
    batches well): ``length`` (B, 1) is the number of real keys, and a key at a
    position >= length has its score pushed to -1e30 (its weight is exactly
    0). Per sample every key is real (``length`` = S: the scores are
    unchanged), so it computes what DotAttention does; with ``keys`` declared
    zero-paddable along axis 1 (``jitbatch.zero_pad``), calls over sources of
    different lengths share launches, padded keys weighing nothing."""

    def hybrid_forward(self, F, query, keys, length):  # pylint: disable=arguments-differ
        scores = F.reshape(F.batch_dot(keys, F.expand_dims(query, axis=2)), shape=(0, -1))
        positions = F.expand_dims(F.contrib.arange_like(scores, axis=1), axis=0)   # (1, S)
        real = F.broadcast_lesser(positions, length)                              # (B, S)
        weights = F.softmax(scores + (real - 1) * 1e30, axis=1)
        return F.reshape(F.batch_dot(F.expand_dims(weights, axis=1), keys), shape=(0, -1))


class Seq2Seq(gluon.Block):
    def __init__(self, vocab, embed, hidden, masked=False, **kwargs):
        super(Seq2Seq, self).__init__(**kwargs)
        self.masked = masked
        with self.name_scope():
            self.src_embed = nn.Embedding(vocab, embed)
            self.tgt_embed = nn.Embedding(vocab, embed)
            self.encoder = gluon.rnn.GRUCell(hidden, input_size=embed)
            self.decoder = gluon.rnn.GRUCell(hidden, input_size=embed)
            self.attention = KeyMaskAttention() if masked else DotAttention()
            self.out = nn.HybridSequential()
            self.out.add(nn.Dense(hidden, in_units=2 * hidden, activation="tanh"),
                         nn.Dense(vocab, in_units=hidden))

    def forward(self, src, tgt_in):  # pylint: disable=arguments-differ
        emb = self.src_embed(nd.array(src))                  # (S, E)
        state = self.encoder.begin_state(batch_size=1)
        enc = []
        for t in range(len(src)):
            h, state = self.encoder(emb[t:t + 1], state)
            enc.append(h)
        keys = nd.stack(*enc, axis=1)                        # (1, S, H)
        extra = (nd.array([[len(src)]]),) if self.masked else ()   # every key real
        dec_in = self.tgt_embed(nd.array(tgt_in))            # (STEPS, E)
        logits = []
        for t in range(len(tgt_in)):
            h, state = self.decoder(dec_in[t:t + 1], state)
            ctx = self.attention(h, keys, *extra)
            logits.append(self.out(nd.concat(h, ctx, dim=1)))
        return nd.concat(*logits, dim=0)                     # (STEPS, V)


class PairSample(object):
    """Source ids, target ids (lists; ``label``: the target, what the loss
    predicts), and the target as the (STEPS,) NDArray the per-sample loss reads."""
    __slots__ = ("src", "label", "target")

    def __init__(self, src, tgt):
        self.src = src
        self.label = tgt
        self.target = nd.array(tgt)

    @property
    def tgt_in(self):
        return [BOS] + self.label[:-1]


def generate(rng, n, vocab=100, min_len=3, max_len=20):
    """``n`` pairs: a random source of ``min_len``..``max_len`` tokens and as
    target its first STEPS tokens reversed (padded with the last token), so
    the task is learnable and needs the attention."""
    out = []
    for _ in range(n):
        src = [int(t) for t in rng.integers(1, vocab, int(rng.integers(min_len, max_len + 1)))]
        head = src[:STEPS][::-1]
        out.append(PairSample(src, head + [head[-1]] * (STEPS - len(head))))
    return out


def build(seed=0, vocab=100, embed=64, hidden=96, masked=False):
    """``masked``: the attention as :class:`KeyMaskAttention`, its keys declared
    zero-paddable along the source axis."""
    net = seeded(Seq2Seq(vocab, embed, hidden, masked=masked), seed)
    if masked:
        jitbatch.zero_pad(net.attention, keys=1)
    return net


def forward(net, sample):
    return net(sample.src, sample.tgt_in)


def loss(net, sample, out):  # pylint: disable=unused-argument
    return cross_entropy(out, sample.target).sum()


class HandBatched(object):
    """Packed encoder, padded masked attention, batched decoder (module docstring)."""

    def __init__(self, net):
        self.net = net
        self.attention = MaskedDotAttention()
        self.attention.hybridize()

    def forward(self, samples):
        net = self.net
        order, running, ids = pack([s.src for s in samples])
        steps, _ = run_packed(net.encoder, net.src_embed(nd.array(ids)), running)
        # key rows: packed step t, sequence b is row offset[t] + b of the steps'
        # concat; padding reads the zero row appended after them
        offset = np.cumsum([0] + running)
        zero_row = offset[-1]
        b_count, s_max = len(samples), len(running)
        rows = np.full((b_count, s_max), zero_row, dtype=np.int64)
        bias = np.full((b_count, s_max), -1e30, dtype=np.float32)
        for b, i in enumerate(order):
            n = len(samples[i].src)
            rows[i, :n] = offset[:n] + b
            bias[i, :n] = 0.0
        ctx = steps[0].context
        table = nd.concat(*(steps + [nd.zeros((1, steps[0].shape[1]), ctx=ctx)]), dim=0)
        keys = nd.take(table, index_array(rows, ctx))                   # (B, S_max, H)
        bias = nd.array(bias, ctx=ctx)
        # each sequence's last encoder state starts its decoder
        packed_pos = np.argsort(order)
        last = nd.take(table, index_array([offset[len(s.src) - 1] + packed_pos[i]
                                           for i, s in enumerate(samples)], ctx))
        dec_in = net.tgt_embed(nd.array([t for step in range(STEPS)
                                         for t in [s.tgt_in[step] for s in samples]], ctx=ctx))
        state, logits = [last], []
        for t in range(STEPS):
            h, state = net.decoder(dec_in[t * b_count:(t + 1) * b_count], state)
            logits.append(net.out(nd.concat(h, self.attention(h, keys, bias), dim=1)))
        # (STEPS, B, V) -> sample-major (B * STEPS, V), the per-sample outputs' order
        return nd.stack(*logits, axis=1).reshape((b_count * STEPS, -1))

    def loss(self, samples, outs):
        per_step = cross_entropy(outs, labels_of(samples, outs.context))
        return per_step.reshape((len(samples), STEPS)).sum(axis=1)
