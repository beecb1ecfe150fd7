"""Held-out: the shape and sequence operators that merge since 2026-11-27
(``rules._reshape_like``, ``_slice_like``, ``_diag``, ``_batch_major_sequence``,
``leading("batch_dot Pad pad")``) and the operator ``Reshape`` whose target
counts a sequence's rows (``opkeys.reshape_rows``: ``nd.reshape(h, shape=(T,
a, b))`` / ``(-1, a, b)`` read as ``(0, a, b)``).

Naive per-sample programs, written as users write them, run plain
(unhybridized Gluon) and flagged (``dynamic_batch=True``) from the same
initial parameters and inputs; outputs and, in training, every parameter
gradient are compared (``harness.run`` / ``assert_same``), in every policy,
through plain loops and ``jitbatch.map``, float32 and float64:

* a CNN over images of several sizes padded by hand (``Pad`` constant, edge,
  reflect before unpadded ``Conv2D``), with 1, 2 or 3 views per sample;
* multi-head self-attention splitting ``(T, 8)`` into heads with
  ``nd.reshape(q, shape=(T, heads, -1))``, ``(-1, heads, d)`` or every axis
  written out, ``transpose`` / ``batch_dot`` / ``softmax``, joined again with
  ``nd.reshape(c, shape=(T, -1))``; sequences of 1 row among longer ones;
* documents of ``B`` sentences through a ``GRUCell``, the batch-major outputs
  masked with ``SequenceMask(axis=1)`` and read with ``SequenceLast(axis=1)``
  (B of 1 among 2 and 3, float or int32 lengths, a mask value);
* a decoder aligned with a shorter target (``slice_like`` with ``axes=(0,)``,
  ``(0, -1)`` or every axis; ``reshape_like`` with begin/end ranges that
  include the per-sample axis 0);
* the diagonal of a per-sample Gram matrix in a loss (``k`` 0, 1, -1; a stack
  of two along ``axis1``/``axis2``, negative and swapped axes);
* ragged leading axes: ``T`` frames per sample padded (``Pad`` of
  ``(T, 1, 4, 4)``), ``T`` words of characters read at their last character,
  ``T`` query rows masked past their keys;
* a sample that reads a value mid-way (``asscalar``) and pads / cuts by it;
* 44 single operator forms, each in all four policies (``FORMS``): the
  attribute shifts (begin/end None, negative, over axis 0; axes negative or
  over axis 0 of arrays of other leading sizes; Pad of leading size 2, 5-D;
  sequence operators on 2-D and 3-D data, lazy and int32 lengths, without
  lengths; diag of rectangular matrices and 3-D arrays) and the forms kept per
  call by design (axis 0 sequences, diag of a vector);
* three SGD steps of three of these blocks together; pipelined flushes (auto,
  chunks of 7 nodes);
* launch counts (depth policy, inference) where the expected count follows
  from the signatures, each explained in its docstring;
* refusals: begins/axes one past a sample's first axis raise MXNet's
  per-sample error, never a merged result.

No batched number differed from plain Gluon. Plain MXNet 1.9.1 itself crashes
(heap corruption) in ``backward()`` of ``SequenceLast`` without
``use_sequence_length``, and where a recorded output reaches the loss only
through ``reshape_like``'s / ``slice_like``'s second argument; the programs
here avoid both (``Prog`` adds every block's output to the loss).

Found, and fixed the same day:

* ``test_reshape_into_fewer_values_names_the_written_target``: the refusal of
  ``nd.reshape(h, shape=(3, 2, 2))`` on a ``(3, 8)`` lazy array (documented:
  the operator into fewer values) said "Cannot reshape array of size 24 into
  shape (0, 2, 2)": ``opkeys.reshape_rows`` rewrote the written target before
  the size check, so the message named a target the program never wrote. A
  target of another size is now left as written.
"""
import math

import numpy as np
import pytest
from mxnet import gluon, nd
from mxnet.gluon import nn, rnn

import jitbatch
from jitbatch import pipeline
from harness import assert_same, run
from heldout import (both, initialized, launches_by_name, nothing_pending,  # noqa: F401
                     run_in_subprocess, same_values, train_minibatches)

POLICIES = ["depth", "agenda", "sequential", "auto"]


def _loss(out):
    return out, nd.sum(out * out)


def _apply(net, s):
    """One sample's output and a loss reaching every entry of it."""
    return _loss(net(*s) if isinstance(s, tuple) else net(s))


def _check(make, samples, policy, train, mapped=False, dtype="float32"):
    """Plain per-sample Gluon against the flagged network (same initial
    values, same samples): outputs and, in training, every gradient."""
    ref = run(_made(make, dtype), _apply, samples, train, flag=False)
    got = run(_made(make, dtype), _apply, samples, train, flag=True, policy=policy,
              mapped=mapped)
    if dtype == "float64":
        assert all(o.dtype == np.float64 for o in got[0])
    assert_same(ref, got)


def _made(make, dtype):
    net = make()
    if dtype != "float32":
        net.cast(dtype)
    return net


def _rows(seed, lengths, width=3, dtype="float32"):
    rng = np.random.default_rng(seed)
    return [nd.array(rng.normal(size=(t, width)), dtype=dtype) for t in lengths]


def _count(net, samples, name, policy="depth"):
    """Launches of operator ``name`` while ``net`` runs ``samples`` (inference;
    the outputs, of one row each, concatenated: no operator of the kinds
    counted runs outside the network)."""
    net.hybridize(dynamic_batch=True, policy=policy)
    try:
        seen = launches_by_name(lambda: nd.concat(
            *[net(*s) if isinstance(s, tuple) else net(s) for s in samples],
            dim=0).asnumpy())
    finally:
        net.hybridize(active=False)
    return seen.get(name, 0), seen


# -- a per-sample CNN over images of several sizes, padded by hand -------------------------
class PadCNN(gluon.Block):
    """Per sample: ``(k, 2, H, W)`` images (``k`` views), padded with ``nd.Pad``
    before each unpadded convolution, pooled and scored. (The first Pad reads
    the concrete input and runs at once; the second reads conv1's lazy output
    and merges.)"""

    def __init__(self, mode="constant", **kwargs):
        super().__init__(**kwargs)
        self.mode = mode
        with self.name_scope():
            self.conv1 = nn.Conv2D(4, 3, in_channels=2)
            self.conv2 = nn.Conv2D(3, 3, in_channels=4)
            self.out = nn.Dense(2, in_units=3)

    def forward(self, img):  # pylint: disable=arguments-differ
        h = nd.Pad(img, mode=self.mode, pad_width=(0, 0, 0, 0, 1, 1, 1, 1),
                   constant_value=0.3)
        h = nd.tanh(self.conv1(h))
        h = nd.Pad(h, mode=self.mode, pad_width=(0, 0, 0, 0, 2, 0, 1, 1))
        h = self.conv2(h)
        pooled = nd.mean(h, axis=(2, 3))                    # (k, 3)
        return self.out(nd.mean(pooled, axis=0, keepdims=True))


SIZES = [(5, 6), (4, 4), (5, 6), (6, 5), (4, 4), (5, 6)]


def _images(seed, sizes=SIZES, views=None, dtype="float32"):
    rng = np.random.default_rng(seed)
    views = views or [1] * len(sizes)
    return [nd.array(rng.normal(size=(k, 2, h, w)), dtype=dtype)
            for k, (h, w) in zip(views, sizes)]


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_pad_cnn_images_of_several_sizes(policy, train):
    for mode in ("constant", "edge", "reflect"):
        _check(lambda: initialized(PadCNN(mode, prefix="cnn_")), _images(0), policy, train)


@pytest.mark.parametrize("policy", POLICIES)
def test_pad_cnn_two_or_three_views_per_sample(policy):
    """Leading sizes 2 and 3 (and 1) of one image size, training: Pad's flat
    layout of the samples' views (ragged where two or more)."""
    sizes = [(4, 5)] * 7
    views = [2, 3, 2, 1, 3, 2, 1]
    _check(lambda: initialized(PadCNN("edge", prefix="cnn_")), _images(1, sizes, views),
           policy, True)


def test_pad_cnn_float64_mapped():
    for mode in ("constant", "reflect"):
        _check(lambda: initialized(PadCNN(mode, prefix="cnn_")),
               _images(2, views=[2, 1, 2, 2, 1, 2], dtype="float64"), "agenda", True,
               mapped=True, dtype="float64")


def test_pad_launches_one_per_image_shape():
    """Depth policy, inference: six images of three sizes. The first ``Pad``
    reads the concrete input image: it runs at once, never lazily (no
    launch). The second reads conv1's lazy output, every sample's at the same
    depth (after conv1 and tanh): one launch per distinct input shape, 3 (6
    without the rule, one per call)."""
    net = initialized(PadCNN("reflect", prefix="cnn_"))
    got, seen = _count(net, [(x,) for x in _images(3)], "Pad")
    assert got == 3, seen


# -- multi-head self-attention over sequences of several lengths ---------------------------
class SelfAttention(gluon.Block):
    """Per sample: ``(T, 3)`` tokens; queries, keys and values ``(T, 8)``
    split into heads with ``nd.reshape(q, shape=(T, heads, -1))`` (or
    ``(-1, heads, d)``), attention per head by ``batch_dot``, the heads joined
    again with ``nd.reshape(c, shape=(T, -1))``."""

    def __init__(self, heads=2, form="rows", **kwargs):
        super().__init__(**kwargs)
        self.heads, self.form = heads, form
        with self.name_scope():
            self.q = nn.Dense(8, in_units=3, flatten=False)
            self.k = nn.Dense(8, in_units=3, flatten=False)
            self.v = nn.Dense(8, in_units=3, flatten=False)
            self.o = nn.Dense(8, in_units=8, flatten=False)
            self.out = nn.Dense(2, in_units=8)

    def split(self, h, t):
        if self.form == "rows":
            h = nd.reshape(h, shape=(t, self.heads, -1))
        elif self.form == "minus":
            h = nd.reshape(h, shape=(-1, self.heads, 8 // self.heads))
        else:                                   # every axis written out
            h = nd.reshape(h, shape=(t, self.heads, 8 // self.heads))
        return nd.transpose(h, axes=(1, 0, 2))                  # (heads, T, d)

    def forward(self, x):  # pylint: disable=arguments-differ
        t = x.shape[0]
        q, k, v = self.split(self.q(x), t), self.split(self.k(x), t), self.split(self.v(x), t)
        scores = nd.batch_dot(q, k, transpose_b=True) / math.sqrt(8 // self.heads)
        ctx = nd.batch_dot(nd.softmax(scores, axis=-1), v)     # (heads, T, d)
        ctx = nd.transpose(ctx, axes=(1, 0, 2))                  # (T, heads, d)
        joined = nd.reshape(ctx, shape=(t, -1)) if self.form != "minus" else \
            nd.reshape(ctx, shape=(-1, 8))
        y = self.o(joined)
        return self.out(nd.mean(nd.relu(y), axis=0, keepdims=True))


LENGTHS = (3, 5, 3, 1, 4, 2, 5, 1)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_self_attention_heads(policy, train):
    for form in ("rows", "minus", "written"):
        _check(lambda: initialized(SelfAttention(2, form, prefix="att_")), _rows(10, LENGTHS),
               policy, train)


def test_self_attention_four_heads_float64_mapped():
    for policy in ("depth", "auto"):
        _check(lambda: initialized(SelfAttention(4, "rows", prefix="att_")),
               _rows(11, (2, 6, 1, 3, 6, 2), dtype="float64"), policy, True, mapped=True,
               dtype="float64")


def test_self_attention_reshape_launches():
    """Depth policy, inference, eight sequences of lengths 3, 5, 3, 1, 4, 2, 5, 1.
    Splitting into heads: q, k and v's reshapes of the samples of two rows or
    more read ``(0, 2, 4)`` (one ragged launch, all at one depth), the two
    one-row samples' ``(1, 2, -1)`` one more; joining the heads (``(T, -1)``
    -> ``(0, 8)``): one launch for the samples of two rows or more, one for
    the one-row samples. 4 in all in each form of the target (before the
    change: one per length, 5 + 5 = 10)."""
    for form in ("rows", "minus", "written"):
        net = initialized(SelfAttention(2, form, prefix="att_"))
        got, seen = _count(net, [(x,) for x in _rows(12, LENGTHS)], "Reshape")
        assert got == 4, (form, seen)


# -- batch-major GRU outputs, masked by length along axis 1 --------------------------------
class DocGRU(gluon.Block):
    """Per sample: a document of ``B`` sentences padded to ``T`` tokens,
    ``(B, T, 3)``, and their lengths ``(B,)``. A GRUCell runs over the tokens
    of all ``B`` sentences at once; the outputs stacked batch-major
    ``(B, T, 6)`` are masked with ``SequenceMask(axis=1)`` (mean over the real
    tokens) and read at each sentence's last real token with
    ``SequenceLast(axis=1)``."""

    def __init__(self, value=0.0, **kwargs):
        super().__init__(**kwargs)
        self.value = value
        with self.name_scope():
            self.cell = rnn.GRUCell(6, input_size=3)
            self.out = nn.Dense(2, in_units=6)

    def forward(self, doc, lengths):  # pylint: disable=arguments-differ
        b, t = doc.shape[0], doc.shape[1]
        state = [nd.zeros((b, 6), dtype=doc.dtype)]
        outs = []
        for i in range(t):
            o, state = self.cell(doc[:, i, :], state)
            outs.append(o)
        seq = nd.stack(*outs, axis=1)                                    # (B, T, 6)
        masked = nd.SequenceMask(seq, lengths, use_sequence_length=True, axis=1,
                                 value=self.value)
        pooled = nd.sum(masked, axis=1) / lengths.reshape((-1, 1))      # (B, 6)
        last = nd.SequenceLast(seq, lengths, use_sequence_length=True, axis=1)
        return self.out(nd.mean(nd.tanh(pooled) * last, axis=0, keepdims=True))


#: (sentences, tokens) per document: B of 1 among 2 and 3, several T
DOCS = [(2, 4), (3, 4), (1, 4), (2, 3), (1, 3), (3, 4), (1, 4), (2, 2)]


def _docs(seed, shapes=DOCS, dtype="float32", len_dtype="float32"):
    rng = np.random.default_rng(seed)
    out = []
    for b, t in shapes:
        lengths = rng.integers(1, t + 1, size=b)
        lengths[rng.integers(0, b)] = t             # one sentence of full length
        out.append((nd.array(rng.normal(size=(b, t, 3)), dtype=dtype),
                    nd.array(lengths, dtype=len_dtype)))
    return out


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_gru_documents_masked_along_axis_1(policy, train):
    _check(lambda: initialized(DocGRU(prefix="doc_")), _docs(20), policy, train)


def test_gru_documents_mapped_float64_masked_with_a_value():
    for policy in ("depth", "agenda"):
        _check(lambda: initialized(DocGRU(value=-1.5, prefix="doc_")),
               _docs(21, dtype="float64", len_dtype="float64"), policy, True, mapped=True,
               dtype="float64")


def test_gru_documents_sequence_launches():
    """Depth policy, inference, the eight documents of ``DOCS``. The samples
    of two sentences or more share a ragged signature per token count T
    (4 and 3 and 2: three launches), the one-sentence samples an exact one
    per T (4 and 3: two launches): 5 launches of ``SequenceMask`` and 5 of
    ``SequenceLast`` (8 each without the rule). A document's every call sits
    at the depth its T gives it, so one T's calls are at one depth."""
    net = initialized(DocGRU(prefix="doc_"))
    samples = _docs(22)
    mask, seen = _count(net, samples, "SequenceMask")
    last, _ = _count(net, samples, "SequenceLast")
    assert (mask, last) == (5, 5), seen


# -- a decoder's output aligned with its target ---------------------------------------------
class AlignedDecoder(gluon.Block):
    """Per sample: encoder rows ``(T, 3)`` and a target ``(S, 4)`` of fewer
    rows; the decoder writes ``T + 1`` steps of 6 values. ``slice_like``
    cuts them to the target (``axes=(0,)``, ``(0, -1)`` or every axis),
    ``reshape_like`` views a flat copy as the target (``(1, S*4)`` -> ``(S, 4)``,
    and with begin/end ranges that include the target's axis 0)."""

    def __init__(self, axes="rows", **kwargs):
        super().__init__(**kwargs)
        self.axes = axes
        with self.name_scope():
            self.enc = nn.Dense(6, in_units=3, flatten=False)
            self.dec = nn.Dense(6, in_units=6, flatten=False)

    def forward(self, x, target):  # pylint: disable=arguments-differ
        h = nd.tanh(self.enc(x))                                         # (T, 6)
        steps = self.dec(nd.concat(h, nd.mean(h, axis=0, keepdims=True), dim=0))  # (T+1, 6)
        if self.axes == "rows":
            cut = nd.slice_like(steps, target, axes=(0,))[:, :4]         # (S, 4)
        elif self.axes == "both":
            cut = nd.slice_like(steps, target, axes=(0, -1))             # (S, 4)
        else:
            cut = nd.slice_like(steps, target)                           # (S, 4)
        flat = nd.reshape(cut, shape=(1, -1))                            # (1, S*4)
        back = nd.reshape_like(flat, target)                             # (S, 4)
        pairs = nd.reshape_like(cut, nd.zeros((target.shape[0], 2, 2)),
                                lhs_begin=0, lhs_end=None, rhs_begin=0)  # (S, 2, 2)
        err = back - target + nd.reshape_like(pairs, target, lhs_begin=1, lhs_end=3,
                                              rhs_begin=-1)
        return nd.sum(err * err, axis=0, keepdims=True)


def _pairs(seed, lengths, dtype="float32"):
    rng = np.random.default_rng(seed)
    return [(nd.array(rng.normal(size=(t, 3)), dtype=dtype),
             nd.array(rng.normal(size=(s, 4)), dtype=dtype)) for t, s in lengths]


PAIRS = [(4, 3), (5, 2), (4, 3), (2, 1), (3, 3), (1, 1), (5, 5), (4, 2)]


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_decoder_aligned_with_its_target(policy, train):
    for axes in ("rows", "both", "all"):
        _check(lambda: initialized(AlignedDecoder(axes, prefix="dec_")), _pairs(30, PAIRS),
               policy, train)


def test_decoder_aligned_mapped_float64():
    for axes in ("rows", "all"):
        _check(lambda: initialized(AlignedDecoder(axes, prefix="dec_")),
               _pairs(31, PAIRS, dtype="float64"), "auto", True, mapped=True,
               dtype="float64")


def test_decoder_alignment_launches():
    """Depth policy, inference, ``PAIRS`` (decoder steps T+1 against target
    rows S): the ``slice_like`` calls merge per pair of input shapes
    ((T+1, 6), (S, 4)): 7 distinct pairs of 8 samples -> 7 launches (the two
    (4, 3) samples share one). The three ``reshape_like`` calls per sample
    have per-sample shapes given by S alone (S of 3, 2, 1, 5: four values),
    each at its own depth and of its own inputs: 3 * 4 = 12 launches (24
    without the rule)."""
    net = initialized(AlignedDecoder("rows", prefix="dec_"))
    samples = _pairs(32, PAIRS)
    cut, seen = _count(net, samples, "slice_like")
    like, _ = _count(net, samples, "reshape_like")
    assert (cut, like) == (7, 12), seen


# -- the diagonal of a per-sample Gram matrix in a loss ------------------------------------
class GramLoss(gluon.Block):
    """Per sample: rows ``(T, 3)`` embedded ``(T, 5)``; their Gram matrix
    ``h h^T`` ``(T, T)``; a loss of its diagonal (the squared norms), its
    first off-diagonals (``k=1``, ``k=-1``: neighbours' similarity, where T >= 2)
    and the diagonals of a stack of two Gram matrices ``(2, T, T)`` taken
    along ``axis1``/``axis2``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.emb = nn.Dense(5, in_units=3, flatten=False)
            self.proj = nn.Dense(5, in_units=3, flatten=False)

    def forward(self, x):  # pylint: disable=arguments-differ
        t = x.shape[0]
        h, g = self.emb(x), nd.tanh(self.proj(x))
        gram = nd.dot(h, h, transpose_b=True)                        # (T, T)
        norms = nd.diag(gram)                                        # (T,)
        loss = nd.sum(gram) - nd.sum(norms) + nd.sum(nd.sqrt(norms + 1.0))
        both = nd.stack(gram, nd.dot(g, h, transpose_b=True), axis=0)   # (2, T, T)
        loss = loss + nd.sum(nd.diag(both, axis1=1, axis2=2) ** 2)
        if t >= 2:
            loss = loss + nd.sum(nd.diag(gram, k=1) * nd.diag(gram, k=-1))
            loss = loss + nd.sum(nd.diag(both, k=-1, axis1=-1, axis2=-2))
            loss = loss + nd.sum(nd.diag(both, k=1, axis1=2, axis2=0), axis=1).sum()
        return loss.reshape((1, 1))


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_gram_diagonal_loss(policy, train):
    _check(lambda: initialized(GramLoss(prefix="gram_")), _rows(40, LENGTHS), policy, train)


def test_gram_diagonal_loss_mapped_float64():
    for policy in ("depth", "sequential"):
        _check(lambda: initialized(GramLoss(prefix="gram_")),
               _rows(41, (2, 4, 1, 4, 3, 2), dtype="float64"), policy, True, mapped=True,
               dtype="float64")


def test_gram_diagonal_launches():
    """Depth policy, inference, six sequences of lengths 3, 3, 3, 2, 2, 3
    (every sample's program the same): each of the six ``diag`` calls per
    sample merges per T (2 and 3): 6 * 2 = 12 launches (36 without the rule;
    a sample's six calls are each of their own attributes or input shape)."""
    net = initialized(GramLoss(prefix="gram_"))
    got, seen = _count(net, [(x,) for x in _rows(42, (3, 3, 3, 2, 2, 3))], "diag")
    assert got == 12, seen


# -- the attribute shifts, one operator form at a time --------------------------------------
class Prog(gluon.Block):
    """Per sample ``(T, 3)`` rows: ``h`` and ``g`` ``(T, 8)`` from two Dense
    blocks, ``q`` ``(1, 8)`` from a third on the rows' mean; ``program(self,
    h, g, q, t)`` applies the operator form under test, its result scaled by
    ``q`` so that every block reaches the loss (plain MXNet 1.9.1 crashes in
    ``backward()`` where a recorded output reaches it only through an
    argument without gradient, such as ``reshape_like``'s second)."""

    def __init__(self, program, **kwargs):
        super().__init__(**kwargs)
        self.program = program
        with self.name_scope():
            self.d = nn.Dense(8, in_units=3, flatten=False)
            self.e = nn.Dense(8, in_units=3, flatten=False)
            self.row = nn.Dense(8, in_units=3)

    def forward(self, x):  # pylint: disable=arguments-differ
        t = x.shape[0]
        h, g = self.d(x), nd.tanh(self.e(x))
        q = self.row(nd.mean(x, axis=0, keepdims=True))
        out = self.program(h, g, q, t)
        return nd.sum(out).reshape((1, 1)) * q + nd.sum(g * g) + out.reshape((1, -1))[:, :1]


def _stack2(h, g):
    return nd.stack(h, g, axis=0)                                        # (2, T, 8)


def _lengths(t, dtype="float32"):
    return nd.array([t, max(1, t - 1)], dtype=dtype)


FORMS = {
    # reshape_like: every axis; ranges over axis 0 of the per-sample arrays
    "reshape_like": (lambda h, g, q, t: nd.reshape_like(h, nd.reshape(g, shape=(t, 2, 4))), 1),
    "reshape_like_rows_and_more": (lambda h, g, q, t: nd.reshape_like(
        h, nd.zeros((t, 4, 2)), lhs_begin=0, lhs_end=2, rhs_begin=0, rhs_end=3), 1),
    "reshape_like_axis0_only": (lambda h, g, q, t: nd.reshape_like(
        nd.reshape(q, shape=(2, 4)), nd.zeros((1, 2, 3)), lhs_begin=None, lhs_end=1,
        rhs_begin=0, rhs_end=2), 1),
    "reshape_like_row_to_grid": (lambda h, g, q, t: nd.reshape_like(q, nd.zeros((2, 4))), 1),
    "reshape_like_negative_begin": (lambda h, g, q, t: nd.reshape_like(
        h, nd.reshape(g, shape=(t, 2, 4)), lhs_begin=-1, lhs_end=None, rhs_begin=1), 1),
    "reshape_like_negative_both": (lambda h, g, q, t: nd.reshape_like(
        nd.reshape(h, shape=(t, 2, 4)), g, lhs_begin=-2, lhs_end=None, rhs_begin=-1,
        rhs_end=None), 1),
    "reshape_like_negative_end": (lambda h, g, q, t: nd.reshape_like(
        nd.reshape(h, shape=(t, 2, 4, 1)), nd.zeros((5, 8)), lhs_begin=1, lhs_end=-1,
        rhs_begin=-1), 1),
    "reshape_like_end_only": (lambda h, g, q, t: nd.reshape_like(
        nd.reshape(h, shape=(1, t, 8)), nd.zeros((t, 1)), lhs_end=2, rhs_end=-1), 1),
    # slice_like: every axis, axis 0 of arrays of other leading sizes, negative axes
    "slice_like_all_axes": (lambda h, g, q, t: nd.slice_like(h, g[:, :5]), 1),
    "slice_like_axis0": (lambda h, g, q, t: nd.slice_like(
        h, nd.zeros((max(1, t - 1), 4)), axes=(0,)), 1),
    "slice_like_axis0_lazy_target": (lambda h, g, q, t: nd.slice_like(
        nd.concat(h, g, dim=0), h, axes=(0,)), 1),
    "slice_like_last_axis": (lambda h, g, q, t: nd.slice_like(h, g[:1, :3], axes=(-1,)), 1),
    "slice_like_axes_0_2": (lambda h, g, q, t: nd.slice_like(
        nd.reshape(h, shape=(t, 2, 4)), nd.zeros((1, 1, 3)), axes=(0, 2)), 1),
    "slice_like_axes_negative": (lambda h, g, q, t: nd.slice_like(
        nd.reshape(h, shape=(t, 2, 4)), nd.zeros((1, 1, 3)), axes=(-3, -1)), 1),
    # Pad: 4-D and 5-D, leading sizes 1 and 2
    "pad_constant": (lambda h, g, q, t: nd.Pad(
        h.reshape((1, 1, t, 8)), mode="constant", constant_value=-0.7,
        pad_width=(0, 0, 0, 0, 2, 1, 0, 3)), 1),
    "pad_edge_two_images": (lambda h, g, q, t: nd.Pad(
        _stack2(h, g).expand_dims(1), mode="edge", pad_width=(0, 0, 0, 0, 1, 2, 3, 0)), 1),
    "pad_reflect_two_images": (lambda h, g, q, t: nd.pad(
        _stack2(h, g).expand_dims(1), mode="reflect", pad_width=(0, 0, 0, 0, 1, 1, 2, 2)), 2),
    "pad_5d_constant": (lambda h, g, q, t: nd.Pad(
        _stack2(h, g).reshape((2, 1, t, 2, 4)), mode="constant", constant_value=0.5,
        pad_width=(0, 0, 0, 0, 1, 0, 0, 1, 2, 0)), 1),
    "pad_5d_edge": (lambda h, g, q, t: nd.Pad(
        h.reshape((1, t, 2, 2, 2)), mode="edge", pad_width=(0, 0, 0, 0, 1, 1, 0, 1, 1, 0)), 1),
    "pad_5d_reflect": (lambda h, g, q, t: nd.Pad(
        _stack2(h, g).reshape((2, 1, t, 2, 4)), mode="reflect",
        pad_width=(0, 0, 0, 0, 1, 1, 1, 0, 0, 2)), 2),
    # SequenceMask / SequenceLast along axis 1 (batch-major)
    "sequence_mask_axis1": (lambda h, g, q, t: nd.SequenceMask(
        _stack2(h, g), _lengths(t), use_sequence_length=True, axis=1, value=0.25), 1),
    "sequence_mask_axis1_int_lengths": (lambda h, g, q, t: nd.SequenceMask(
        _stack2(h, g), _lengths(t, "int32"), use_sequence_length=True, axis=1), 1),
    "sequence_mask_axis1_no_lengths": (lambda h, g, q, t: nd.SequenceMask(
        _stack2(h, g), axis=1, value=3.0), 1),
    "sequence_mask_axis1_2d": (lambda h, g, q, t: nd.SequenceMask(
        h, nd.array(np.arange(t) % 8 + 1), use_sequence_length=True, axis=1, value=-1.0), 1),
    "sequence_last_axis1": (lambda h, g, q, t: nd.SequenceLast(
        _stack2(h, g), _lengths(t), use_sequence_length=True, axis=1), 1),
    "sequence_last_axis1_2d": (lambda h, g, q, t: nd.SequenceLast(
        g, nd.array(np.arange(t) % 8 + 1), use_sequence_length=True, axis=1), 1),
    "sequence_last_axis1_lazy_lengths": (lambda h, g, q, t: nd.SequenceLast(
        _stack2(h, g), nd.ceil(nd.sigmoid(nd.sum(q).detach()) * 0 + _lengths(t)),
        use_sequence_length=True, axis=1), 1),
    "sequence_mask_axis0": (lambda h, g, q, t: nd.SequenceMask(
        _stack2(h, g).transpose((1, 0, 2)), _lengths(t), use_sequence_length=True), 1),
    # diag: of a matrix, along two axes of a 3-D array, k positive and negative
    "diag_gram": (lambda h, g, q, t: nd.diag(nd.dot(h, g, transpose_b=True)), 1),
    "diag_rectangular_k": (lambda h, g, q, t: nd.diag(h, k=2) + nd.diag(g, k=3)[:1], 1),
    "diag_k_negative": (lambda h, g, q, t: nd.diag(nd.dot(h, g, transpose_b=True), k=-1), 2),
    "diag_axes_12": (lambda h, g, q, t: nd.diag(_stack2(h, g), k=1, axis1=1, axis2=2), 1),
    "diag_axes_swapped": (lambda h, g, q, t: nd.diag(_stack2(h, g), k=-1, axis1=2, axis2=0), 1),
    "diag_axes_negative": (lambda h, g, q, t: nd.diag(
        nd.reshape(h, shape=(t, 2, 4)), k=1, axis1=-1, axis2=-2), 1),
    "diag_of_vector": (lambda h, g, q, t: nd.diag(q[0]), 1),
    # the operator Reshape whose target counts the rows
    "reshape_rows": (lambda h, g, q, t: nd.reshape(h, shape=(t, 2, -1)), 1),
    "reshape_minus_rows": (lambda h, g, q, t: nd.reshape(h, shape=(-1, 4, 2)), 1),
    "reshape_rows_written": (lambda h, g, q, t: nd.Reshape(h, shape=(t, 2, 2, 2)), 1),
    "reshape_rows_list": (lambda h, g, q, t: nd.reshape(h, shape=[t, 4, 2]), 1),
    "reshape_rows_joined": (lambda h, g, q, t: nd.reshape(
        nd.reshape(h, shape=(t, 2, 4)), shape=(t, -1)), 1),
    "reshape_rows_minus_joined": (lambda h, g, q, t: nd.reshape(
        nd.reshape(g, shape=(t, 2, 4)), shape=(-1, 8)), 1),
    "reshape_rows_middle_minus": (lambda h, g, q, t: nd.reshape(h, shape=(t, -1, 2)), 1),
    "reshape_rows_reverse": (lambda h, g, q, t: nd.reshape(h, shape=(t, 2, -1),
                                                           reverse=True), 1),
    "reshape_not_rows": (lambda h, g, q, t: nd.reshape(h, shape=(-1, 16)) if t % 2 == 0 else
                         nd.reshape(h, shape=(-1, 8)), 1),
}

FORM_LENGTHS = (3, 5, 3, 1, 4, 2, 5, 2)


def _form_samples(seed, min_len, dtype="float32"):
    lengths = [t for t in FORM_LENGTHS if t >= min_len]
    return _rows(seed, lengths, dtype=dtype)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_operator_form(form):
    """Every form in every policy: depth and sequential in training, agenda
    and auto in inference, and auto in training through ``jitbatch.map``."""
    fn, min_len = FORMS[form]
    samples = _form_samples(50, min_len)
    for policy, train, mapped in (("depth", True, False), ("sequential", True, False),
                                  ("agenda", False, False), ("auto", False, False),
                                  ("auto", True, True)):
        _check(lambda: initialized(Prog(fn, prefix="prog_")), samples, policy, train,
               mapped=mapped)


# -- samples that read values while they run (jitbatch.map's interleaving) -----------------
class GreedyReader(gluon.Block):
    """Per sample: rows ``(T, 3)``. Self-attention heads split with
    ``nd.reshape(h, shape=(T, 2, -1))``; the sample then READS a value (the
    argmax of its last masked step, ``SequenceLast(axis=1)``) and decides from
    it how many extra rows to pad (``Pad`` edge, 1 or 2 rows) and where to cut
    (``slice_like``) before its Gram diagonal: data-dependent control flow,
    so under ``jitbatch.map`` every sample parks at its read."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.h = nn.Dense(8, in_units=3, flatten=False)
            self.out = nn.Dense(2, in_units=8)

    def forward(self, x):  # pylint: disable=arguments-differ
        t = x.shape[0]
        h = self.h(x)                                                    # (T, 8)
        heads = nd.transpose(nd.reshape(h, shape=(t, 2, -1)), axes=(1, 0, 2))   # (2, T, 4)
        lengths = nd.array([t, max(1, t - 1)], dtype=h.dtype)
        last = nd.SequenceLast(heads, lengths, use_sequence_length=True, axis=1)  # (2, 4)
        masked = nd.SequenceMask(heads, lengths, use_sequence_length=True, axis=1)
        step = int(nd.argmax(nd.sum(last, axis=0), axis=0).asscalar())  # a read
        extra = 1 + step % 2
        img = nd.Pad(masked.expand_dims(0), mode="edge",
                     pad_width=(0, 0, 0, 0, 0, extra, 0, 0))            # (1, 2, T+extra, 4)
        rows = nd.reshape_like(img[0, 0], nd.zeros((t + extra, 2, 2)))   # (T+extra, 2, 2)
        cut = nd.slice_like(rows, nd.zeros((max(1, t - step % 3), 1, 2)), axes=(0, 2))
        gram = nd.dot(cut.reshape((0, -1)), cut.reshape((0, -1)), transpose_b=True)
        score = nd.sum(nd.diag(gram)) + nd.sum(last)
        return self.out(nd.mean(h, axis=0, keepdims=True)) * score


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_samples_reading_values(policy, train):
    for mapped in (True, False):
        _check(lambda: initialized(GreedyReader(prefix="greedy_")), _rows(60, LENGTHS), policy,
               train, mapped=mapped)


def test_samples_reading_values_float64():
    _check(lambda: initialized(GreedyReader(prefix="greedy_")),
           _rows(61, LENGTHS, dtype="float64"), "auto", True, mapped=True, dtype="float64")


# -- ragged leading axes: frames, words, query rows ----------------------------------------
class FrameCNN(gluon.Block):
    """Per sample: ``T`` frames (T differs, one frame among them), each a
    ``4x4`` single-channel image made by a Dense block from its row and
    reshaped ``(T, 1, 4, 4)``; padded (reflect), convolved, padded again
    (edge): ``Pad``'s leading axis is the sample's frames."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.enc = nn.Dense(16, in_units=3, flatten=False)
            self.conv = nn.Conv2D(2, 3, in_channels=1)
            self.out = nn.Dense(2, in_units=2)

    def forward(self, x):  # pylint: disable=arguments-differ
        t = x.shape[0]
        frames = nd.reshape(self.enc(x), shape=(t, 1, 4, 4))
        frames = nd.Pad(frames, mode="reflect", pad_width=(0, 0, 0, 0, 1, 1, 1, 1))
        c = nd.Pad(self.conv(frames), mode="edge", pad_width=(0, 0, 0, 0, 0, 1, 1, 0))
        return self.out(nd.mean(c, axis=(0, 2, 3)).reshape((1, 2)))


class CharWords(gluon.Block):
    """Per sample: a sentence of ``T`` words, each of up to 6 characters
    (padded), ``(T, 6, 3)``, and the words' lengths ``(T,)``: the last real
    character's state (``SequenceLast(axis=1)``) and the masked mean
    (``SequenceMask(axis=1)``) per word, then max-pooled over the words."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.emb = nn.Dense(5, in_units=3, flatten=False)
            self.out = nn.Dense(2, in_units=5)

    def forward(self, chars, lengths):  # pylint: disable=arguments-differ
        e = nd.tanh(self.emb(chars))                                     # (T, 6, 5)
        last = nd.SequenceLast(e, lengths, use_sequence_length=True, axis=1)
        masked = nd.SequenceMask(e, lengths, use_sequence_length=True, axis=1)
        pooled = nd.sum(masked, axis=1) / lengths.reshape((-1, 1))
        return self.out(nd.max(last * pooled, axis=0, keepdims=True))


class PaddedKeys(gluon.Block):
    """Per sample: ``T`` query rows against keys padded to 6 slots; the
    logits ``(T, 6)`` masked past the ``T`` real keys with
    ``SequenceMask(axis=1, value=-1e4)`` (lengths ``(T,)``, int32 or float),
    softmax, and each row's logit at its last real key (``SequenceLast``)."""

    def __init__(self, len_dtype="float32", **kwargs):
        super().__init__(**kwargs)
        self.len_dtype = len_dtype
        with self.name_scope():
            self.q = nn.Dense(8, in_units=3, flatten=False)
            self.k = nn.Dense(8, in_units=3, flatten=False)

    def forward(self, x):  # pylint: disable=arguments-differ
        t = x.shape[0]
        keys = self.k(x)
        if t < 6:
            keys = nd.concat(keys, nd.zeros((6 - t, 8), dtype=x.dtype), dim=0)    # (6, 8)
        logits = nd.dot(self.q(x), keys, transpose_b=True)                      # (T, 6)
        lengths = nd.full((t,), t, dtype=self.len_dtype)
        att = nd.softmax(nd.SequenceMask(logits, lengths, use_sequence_length=True, axis=1,
                                         value=-1e4), axis=-1)
        last = nd.SequenceLast(logits.expand_dims(2), lengths, use_sequence_length=True,
                               axis=1)                                           # (T, 1)
        return nd.sum(nd.dot(att, keys) * last, axis=0, keepdims=True)


FRAMES = (3, 1, 4, 2, 3, 1, 5)


def _words(seed, counts=FRAMES, dtype="float32"):
    rng = np.random.default_rng(seed)
    return [(nd.array(rng.normal(size=(t, 6, 3)), dtype=dtype),
             nd.array(rng.integers(1, 7, size=t), dtype=dtype)) for t in counts]


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_frames_padded_along_their_own_leading_axis(policy, train):
    _check(lambda: initialized(FrameCNN(prefix="frames_")), _rows(70, FRAMES), policy, train)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_words_of_characters_read_at_their_last_character(policy, train):
    _check(lambda: initialized(CharWords(prefix="chars_")), _words(71), policy, train)


@pytest.mark.parametrize("len_dtype", ["float32", "int32"])
@pytest.mark.parametrize("policy", POLICIES)
def test_query_rows_masked_past_their_keys(policy, len_dtype):
    _check(lambda: initialized(PaddedKeys(len_dtype, prefix="keys_")),
           _rows(72, (3, 5, 3, 1, 4, 2, 6, 1)), policy, True)


def test_ragged_leading_axes_mapped_float64():
    _check(lambda: initialized(FrameCNN(prefix="frames_")),
           _rows(73, FRAMES, dtype="float64"), "agenda", True, mapped=True, dtype="float64")
    _check(lambda: initialized(CharWords(prefix="chars_")), _words(74, dtype="float64"),
           "depth", True, mapped=True, dtype="float64")


def test_ragged_leading_axes_launches():
    """Depth policy, inference. Frames (counts 3, 1, 4, 2, 3, 1, 5): each
    ``Pad`` runs one ragged launch for the five samples of two frames or
    more (their frames one after the other) and one for the two one-frame
    samples: 2 + 2 = 4 (14 without the rule). Words (the same counts):
    ``SequenceLast`` and ``SequenceMask`` 2 launches each (7 each without the
    rule). Query rows (3, 5, 3, 1, 4, 2, 6, 1; logits ``(T, 6)`` whatever T):
    ``SequenceMask`` 2 launches (8 without the rule)."""
    pads, seen = _count(initialized(FrameCNN(prefix="frames_")), _rows(75, FRAMES), "Pad")
    assert pads == 4, seen
    words = _words(76)
    net = initialized(CharWords(prefix="chars_"))
    assert _count(net, words, "SequenceLast")[0] == 2
    assert _count(net, words, "SequenceMask")[0] == 2
    net = initialized(PaddedKeys(prefix="keys_"))
    mask, seen = _count(net, _rows(77, (3, 5, 3, 1, 4, 2, 6, 1)), "SequenceMask")
    assert mask == 2, seen


def test_forms_without_a_batched_equivalent_stay_per_call():
    """By design: ``SequenceMask`` along axis 0 (time-major) and ``diag`` of a
    vector run one launch per call, here eight calls of one signature each
    (all samples of 3 rows): 8 launches each."""
    samples = _rows(78, (3,) * 8)
    for form in ("sequence_mask_axis0", "diag_of_vector"):
        net = initialized(Prog(FORMS[form][0], prefix="prog_"))
        got, seen = _count(net, samples, "SequenceMask" if "sequence" in form else "diag")
        assert got == 8, (form, seen)


def test_forms_merge_in_one_launch_per_signature():
    """Depth policy, inference, eight samples of 3 rows (one signature per
    form): every merging form runs ONE launch of its operator, where it ran
    eight before the rules."""
    samples = _rows(79, (3,) * 8)
    for form, name in (("reshape_like_rows_and_more", "reshape_like"),
                       ("reshape_like_end_only", "reshape_like"),
                       ("slice_like_axes_negative", "slice_like"),
                       ("pad_5d_reflect", "Pad"), ("pad_edge_two_images", "Pad"),
                       ("sequence_mask_axis1", "SequenceMask"),
                       ("sequence_last_axis1", "SequenceLast"),
                       ("diag_axes_swapped", "diag"), ("diag_gram", "diag")):
        net = initialized(Prog(FORMS[form][0], prefix="prog_"))
        got, seen = _count(net, samples, name)
        assert got == 1, (form, seen)


# -- a training loop: several blocks, optimizer steps --------------------------------------
def _three_nets():
    return [initialized(SelfAttention(2, "rows", prefix="att_"), seed=1),
            initialized(DocGRU(value=0.5, prefix="doc_"), seed=2),
            initialized(FrameCNN(prefix="frames_"), seed=3)]


def _multitask(mapped):
    tokens, docs, frames = _rows(80, LENGTHS), _docs(81), _rows(82, (2, 1, 3, 2, 4, 1, 2, 3))

    def program(nets, policy):
        att, doc, cnn = nets

        def minibatch(k):
            y = att(tokens[k]) + doc(*docs[k]) * cnn(frames[k])
            return nd.sum(y * y), [y]
        # (SGD: the keys' bias gets no gradient but rounding noise - a
        # softmax ignores what it adds to every logit of a row - which Adam
        # would scale up to steps of its learning rate, in plain Gluon too)
        return train_minibatches(nets, policy, minibatch, len(tokens), steps=3,
                                 optimizer="sgd", lr=0.2, mapped=mapped)
    return program


@pytest.mark.parametrize("policy", POLICIES)
def test_sgd_steps_of_three_blocks(policy):
    """Three SGD steps of an attention block, a batch-major GRU and a frame
    CNN on one summed loss: every loss, output and gradient of each step and
    the parameters after (plain Gluon's numbers)."""
    want, got, _ = both(_three_nets, _multitask(False), policy)
    same_values(want, got, policy)


def test_sgd_steps_of_three_blocks_mapped():
    want, got, st = both(_three_nets, _multitask(True), "depth")
    same_values(want, got, "mapped")
    assert st["launches"] < st["nodes"], st


# -- refusals and errors -------------------------------------------------------------------
_OUT_OF_RANGE = """
import numpy as np, mxnet as mx
from mxnet import nd, gluon
import jitbatch
net = gluon.nn.Dense(8, in_units=3, flatten=False)
net.initialize()
net.hybridize(dynamic_batch=True, policy="depth")
for call in (lambda h: nd.reshape_like(h, nd.zeros((2, 2, 4)), lhs_begin=-3),
             lambda h: nd.reshape_like(h, nd.zeros((2, 2, 4)), rhs_begin=-4, rhs_end=-2),
             lambda h: nd.slice_like(h, nd.zeros((1, 1, 4)), axes=(-3,)),
             lambda h: nd.diag(h, axis1=0, axis2=-3)):
    hs = [net(nd.ones((2, 3))) for _ in range(3)]
    try:
        out = [call(h) for h in hs]
        print("no error", [o.asnumpy().shape for o in out])
    except mx.base.MXNetError as e:
        print("refused")
    jitbatch.flush()
print("alive", [net(nd.ones((2, 3))).asnumpy().shape for _ in range(2)])
"""


def test_axes_out_of_range_raise_as_per_sample():
    """A begin or axis one past the sample's first axis (-3 of a 2-D array)
    names the merged batch axis once shifted: MXNet's per-sample error is
    raised (as plain Gluon raises it), never a merged result; the next calls
    run. (A subprocess: an MXNet error kept for a later read would end in
    another test.)"""
    rc, out, err = run_in_subprocess(_OUT_OF_RANGE)
    assert rc == 0, err[-2000:]
    assert out.count("refused") == 4 and "no error" not in out, out
    assert "alive [(2, 8), (2, 8)]" in out, out


_FEWER_VALUES = """
import mxnet as mx
from mxnet import nd, gluon
import jitbatch
net = gluon.nn.Dense(8, in_units=3, flatten=False)
net.initialize()
net.hybridize(dynamic_batch=True, policy="depth")
h = net(nd.ones((3, 3)))
try:
    nd.reshape(h, shape=(3, 2, 2)).asnumpy()
    print("no error")
except ValueError as e:
    print("refused:", e)
"""


def test_reshape_into_fewer_values_names_the_written_target():
    """The refusal (docs/errors.rst: the ``nd.reshape`` operator into fewer
    values) names the target as written. Plain Gluon is not run: MXNet's
    Reshape operator corrupts the heap there."""
    rc, out, err = run_in_subprocess(_FEWER_VALUES)
    assert rc == 0, err[-2000:]
    assert "refused:" in out, out
    assert "(3, 2, 2)" in out, out


# -- pipelined flushes (auto): the graph cut into chunks while recording goes on ---------
@pytest.fixture
def chunks(monkeypatch):
    """Pipelining on (as outside the test suite), chunks of 7 nodes."""
    monkeypatch.setattr(jitbatch.config, "pipeline", True)
    monkeypatch.setattr(pipeline, "FREE_CORE", True)
    monkeypatch.setattr(pipeline.Pipelines, "limit",
                        lambda self, mode, price=None, net=None: 7)


CHUNKED = {
    "attention": (lambda: initialized(SelfAttention(2, "rows", prefix="att_")),
                  lambda: _rows(90, LENGTHS)),
    "documents": (lambda: initialized(DocGRU(prefix="doc_")), lambda: _docs(91)),
    "frames": (lambda: initialized(FrameCNN(prefix="frames_")), lambda: _rows(92, FRAMES)),
    "decoder": (lambda: initialized(AlignedDecoder("both", prefix="dec_")),
                lambda: _pairs(93, PAIRS)),
    "keys": (lambda: initialized(PaddedKeys(prefix="keys_")), lambda: _rows(94, LENGTHS)),
}


@pytest.mark.parametrize("model", sorted(CHUNKED))
def test_pipelined_chunks(chunks, model):  # pylint: disable=redefined-outer-name,unused-argument
    make, samples = CHUNKED[model]
    samples = samples()
    for train in (False, True):
        ref = run(make(), _apply, samples, train, flag=False)
        jitbatch.reset_stats()
        got = run(make(), _apply, samples, train, flag=True, policy="auto")
        assert jitbatch.stats()["pipelined_flushes"] >= 1
        assert_same(ref, got)
