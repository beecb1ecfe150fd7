"""GRU encoder-decoder that decodes greedily: each step's input is the token the
previous step predicted, read back in Python, so the per-sample code reads a
value at every decoding step.

Per sample (source of ``S`` tokens, 3-15): one ``nd.array`` of the source ids,
one embedding lookup, the encoder cell's ``begin_state`` and ``S`` encoder
``GRUCell`` calls (rows ``emb[t:t+1]``); then up to MAX_STEPS decoder steps,
each an ``nd.array([prev])`` of the previous token (BOS first), one embedding
lookup, one decoder ``GRUCell`` call and one output ``Dense`` call giving the
step's logits ``(1, V)``; the argmax of the logits is read with
``.asscalar()`` to choose the next input, and the decoder stops once it
predicts EOS. The steps' logits are concatenated to ``(steps, V)``, ``steps``
(1..MAX_STEPS) differing between samples. The loss is the sum of the steps'
cross-entropies against the target (padded with EOS past its end). Under
jitbatch a plain loop over samples flushes at every step's read, so calls
of different samples do not meet; ``jitbatch.map`` lets the samples' reads
of one step share a flush.

Hand-batched reference: the encoder as packed sequences
(:func:`examples.zoo.gru_seq.run_packed`), each sample's last state put back in
sample order; then the decoder steps over the samples still decoding, per step
one embedding call, one cell call, one output call and ONE read of all their
argmaxes (``.asnumpy()``), the samples that predicted EOS dropped from the
states (``take``) for the next step. The steps' logits are gathered into
sample order at the end (one ``take``)."""
import numpy as np
from mxnet import gluon, nd
from mxnet.gluon import nn

from .common import cross_entropy, gather_sum, index_array, seeded
from .gru_seq import pack, run_packed

__all__ = ["GreedyDecoder", "DecodeSample", "build", "generate", "forward", "loss",
           "HandBatched", "MAX_STEPS", "BOS", "EOS"]

MAX_STEPS = 8
BOS = 0          # the decoder's first input
EOS = 1          # ends a target; the decoder stops after predicting it
FIRST_TOKEN = 2  # source tokens are FIRST_TOKEN..vocab-1


class GreedyDecoder(gluon.Block):
    def __init__(self, vocab, embed, hidden, **kwargs):
        super(GreedyDecoder, self).__init__(**kwargs)
        with self.name_scope():
            self.src_embed = nn.Embedding(vocab, embed)
            self.tgt_embed = nn.Embedding(vocab, embed)
            self.encoder = gluon.rnn.GRUCell(hidden, input_size=embed)
            self.decoder = gluon.rnn.GRUCell(hidden, input_size=embed)
            self.out = nn.Dense(vocab, in_units=hidden)

    def forward(self, src):  # pylint: disable=arguments-differ
        emb = self.src_embed(nd.array(src))                  # (S, E)
        state = self.encoder.begin_state(batch_size=1)
        for t in range(len(src)):
            _, state = self.encoder(emb[t:t + 1], state)
        prev, logits = BOS, []
        for _ in range(MAX_STEPS):
            h, state = self.decoder(self.tgt_embed(nd.array([prev])), state)
            step_logits = self.out(h)                        # (1, V)
            logits.append(step_logits)
            prev = int(step_logits.argmax(axis=1).asscalar())
            if prev == EOS:
                break
        return nd.concat(*logits, dim=0)                     # (steps, V)


class DecodeSample(object):
    """Source ids and target ids (lists; ``label``: the target, ending in EOS),
    and the target padded with EOS to MAX_STEPS as the (MAX_STEPS,) NDArray the
    per-sample loss slices to the steps the decoder ran."""
    __slots__ = ("src", "label", "target")

    def __init__(self, src, tgt):
        self.src = src
        self.label = tgt
        self.target = nd.array(padded_target(tgt, MAX_STEPS))


def padded_target(tgt, steps):
    """The first ``steps`` target ids, EOS past the target's end."""
    return (list(tgt) + [EOS] * max(0, steps - len(tgt)))[:steps]


def generate(rng, n, vocab=100, min_len=3, max_len=15):
    """``n`` pairs: a random source of ``min_len``..``max_len`` tokens
    (ids FIRST_TOKEN..vocab-1) and as target the source reversed, cut to
    MAX_STEPS - 1 tokens, then EOS."""
    out = []
    for _ in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        src = [int(t) for t in rng.integers(FIRST_TOKEN, vocab, length)]
        out.append(DecodeSample(src, src[::-1][:MAX_STEPS - 1] + [EOS]))
    return out


def build(seed=0, vocab=100, embed=64, hidden=96):
    return seeded(GreedyDecoder(vocab, embed, hidden), seed)


def forward(net, sample):
    return net(sample.src)


def loss(net, sample, out):  # pylint: disable=unused-argument
    return cross_entropy(out, sample.target[:out.shape[0]]).sum()


class HandBatched(object):
    """Packed encoder, decoder steps over the samples still decoding (module
    docstring). ``steps``: how many steps each sample of the last ``forward``
    ran, which ``loss`` needs to line the targets up with the outputs."""

    def __init__(self, net):
        self.net = net
        self.steps = None

    def forward(self, samples):
        net = self.net
        order, running, ids = pack([s.src for s in samples])
        _, last = run_packed(net.encoder, net.src_embed(nd.array(ids)), running)
        ctx = last.context
        state = [nd.take(last, index_array(np.argsort(order), ctx))]   # sample order
        active = np.arange(len(samples))       # the samples decoding: state row r is active[r]
        prev = np.full(len(samples), BOS)
        step_logits = []
        rows = [[] for _ in samples]           # each sample's rows of the steps' logits, in order
        at = 0                                 # row of this step's first logits in their concat
        for _ in range(MAX_STEPS):
            h, state = net.decoder(net.tgt_embed(nd.array(prev, ctx=ctx)), state)
            logits = net.out(h)                                         # (len(active), V)
            step_logits.append(logits)
            for r, i in enumerate(active):
                rows[i].append(at + r)
            at += len(active)
            chosen = logits.argmax(axis=1).asnumpy().astype(np.int64)   # the step's one read
            going = np.flatnonzero(chosen != EOS)
            if not len(going):
                break
            if len(going) < len(active):
                keep = index_array(going, ctx)
                state = [nd.take(s, keep) for s in state]
            active, prev = active[going], chosen[going]
        self.steps = [len(r) for r in rows]
        order_rows = index_array([row for r in rows for row in r], ctx)
        return nd.take(nd.concat(*step_logits, dim=0), order_rows)      # (sum of steps, V)

    def loss(self, samples, outs):
        ctx = outs.context
        labels = [t for s, n in zip(samples, self.steps) for t in padded_target(s.label, n)]
        per_step = cross_entropy(outs, nd.array(labels, ctx=ctx)).reshape((-1, 1))
        # each sample's steps summed: its rows of per_step, padded with a zero row
        zero_row = per_step.shape[0]
        index = np.full((len(samples), max(self.steps)), zero_row, dtype=np.int64)
        starts = np.cumsum([0] + self.steps)
        for b, n in enumerate(self.steps):
            index[b, :n] = np.arange(starts[b], starts[b + 1])
        table = nd.concat(per_step, nd.zeros((1, 1), ctx=ctx), dim=0)
        return gather_sum(table, index_array(index, ctx)).reshape((-1,))
