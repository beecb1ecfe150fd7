"""Held-out programs, round 4: operators inside flagged blocks that may mix
the rows of a merged batch. jitbatch merges samples along axis 0 and proves,
per signature, that no operator of a block couples rows of different samples
(jitbatch/gluon/contract.py, axis_rules.py); these programs attack that proof
with the operators a user writes for ONE sample: reductions, softmax, sort
and normalisations along every axis (negative, ``exclude``, ``keepdims``),
reshapes with special codes, transposes, slices, tiles, stacks and
concatenations that touch axis 0, gathers, sequence operators with lengths,
pooling and convolutions in NWC layouts, and samples of one row, of several
rows and of mixed leading sizes in one minibatch (ragged signatures).

The oracle is plain per-sample Gluon on the same parameters and inputs
(``harness.run``: the block run unflagged, then flagged): outputs, parameter
gradients (one backward of the summed per-sample losses) and, where asked,
input gradients must agree. An operator that keeps samples apart must also
merge (no ``ContractWarning``, fewer launches than calls); one that mixes
them must run per sample with a ``ContractWarning`` naming the operator and
a fix, or raise the documented ``BatchingError`` with a fix, after which the
next minibatch gives plain Gluon's numbers. Known failures are strict xfails
whose reason gives the class (silent wrong number, crash, unclear error,
missed merge).
"""
import warnings

import numpy as np
import pytest
from mxnet import autograd, nd
from mxnet.gluon import HybridBlock, nn

import jitbatch
from harness import assert_same, run
from oracle import cleanup
from heldout import (contract_warnings, initialized, merged, nothing_pending,  # noqa: F401
                     rng_for, square_loss)

H = 4
POLICIES = ["auto", "depth", "agenda"]

# leading sizes of a minibatch's samples: one row each, several rows each, mixed
# (ragged signatures merge samples of different leading sizes)
LAYOUTS = {"one-row": [1, 1, 1], "three-rows": [3, 3, 3], "mixed": [3, 1, 2, 3, 1]}


class OpBlock(HybridBlock):
    """A projection, then the user's per-sample operator ``fn(F, y)``."""

    def __init__(self, fn, units=H, **kw):
        super(OpBlock, self).__init__(**kw)
        self.fn = fn
        with self.name_scope():
            self.d = nn.Dense(units, in_units=H, flatten=False)

    def hybrid_forward(self, F, x):
        return self.fn(F, self.d(x))


def _ids(F, y):
    """Small non-negative integer ids computed from ``y`` (no gradient)."""
    return F.floor(F.clip(F.abs(F.BlockGrad(y)) * 2, 0, 2.9))


# name -> (per-sample operator on y of shape (rows, H), expected: "merge" (keeps
# samples apart: must merge) or "mix" (couples rows: must run per sample, warned))
OPS = {
    # reductions over the feature axis, every spelling of it
    "sum-axis1-keepdims": (lambda F, y: F.broadcast_mul(y, F.sum(y, axis=1, keepdims=True)),
                           "merge"),
    "mean-axis-1": (lambda F, y: F.broadcast_sub(y, F.expand_dims(F.mean(y, axis=-1), 1)),
                    "merge"),
    "max-exclude-axis0": (lambda F, y: F.broadcast_sub(
        y, F.max(y, axis=0, exclude=True, keepdims=True)), "merge"),
    "norm-axis-1": (lambda F, y: F.broadcast_div(y, F.norm(y, axis=-1, keepdims=True) + 1),
                    "merge"),
    "prod-axis1": (lambda F, y: F.broadcast_add(y, F.prod(F.tanh(y), axis=1, keepdims=True)),
                   "merge"),
    "nansum-axis1": (lambda F, y: F.broadcast_mul(y, F.nansum(y, axis=(1,), keepdims=True)),
                     "merge"),
    "argmax-axis1": (lambda F, y: F.broadcast_mul(y, F.expand_dims(F.argmax(y, axis=1), 1)),
                     "merge"),
    "min-axis-2-of-3d": (lambda F, y: F.min(F.broadcast_mul(F.expand_dims(y, 2),
                                                            F.expand_dims(y, 1)), axis=-2),
                         "merge"),
    # ... and over the sample axis
    "mean-axis0": (lambda F, y: F.broadcast_sub(y, F.mean(y, axis=0, keepdims=True)), "mix"),
    "sum-exclude-axis1": (lambda F, y: F.broadcast_mul(
        y, F.sum(y, axis=1, exclude=True, keepdims=True)), "mix"),
    "max-axis-2": (lambda F, y: F.broadcast_sub(y, F.max(y, axis=-2, keepdims=True)), "mix"),
    "argmin-axis0": (lambda F, y: F.broadcast_add(y, F.argmin(y, axis=0, keepdims=True)),
                     "mix"),
    "norm-all": (lambda F, y: F.broadcast_div(y, F.norm(y) + 1), "mix"),
    # softmax family
    "softmax": (lambda F, y: F.softmax(y), "merge"),
    "log-softmax-axis1": (lambda F, y: F.log_softmax(y, axis=1), "merge"),
    "softmin-axis-2": (lambda F, y: F.softmin(y, axis=-2), "mix"),
    "softmax-axis0": (lambda F, y: F.softmax(y, axis=0), "mix"),
    "softmax-with-length": (lambda F, y: F.softmax(
        y, F.ones_like(F.sum(y, axis=1)).astype("int32") * 3, use_length=True, axis=1),
        "merge"),
    "softmax-activation": (lambda F, y: F.SoftmaxActivation(y), "merge"),
    # normalisations
    "l2norm-instance": (lambda F, y: F.L2Normalization(y), "merge"),
    "l2norm-channel": (lambda F, y: F.L2Normalization(F.expand_dims(y, 2), mode="channel"),
                       "merge"),
    "l2norm-spatial": (lambda F, y: F.L2Normalization(F.reshape(y, (0, 2, 2)),
                                                       mode="spatial"), "merge"),
    "instance-norm": (lambda F, y: F.InstanceNorm(F.reshape(y, (0, 2, 2)), F.ones((2,)),
                                                  F.zeros((2,))), "merge"),
    "group-norm": (lambda F, y: F.GroupNorm(F.reshape(y, (0, 2, 2)), F.ones((1,)),
                                            F.zeros((1,)), num_groups=1), "merge"),
    "layer-norm-axis0-swapped": (lambda F, y: F.swapaxes(F.LayerNorm(
        F.swapaxes(y, 0, 1), F.ones((H,)), F.zeros((H,)), axis=0), 0, 1), "merge"),
    # sort family
    "topk-axis1-both": (lambda F, y: F.topk(y, axis=1, k=2, ret_typ="both")[0], "merge"),
    "sort-axis-1": (lambda F, y: F.sort(y, axis=-1, is_ascend=False), "merge"),
    "sort-axis0": (lambda F, y: F.sort(y, axis=0), "mix"),
    "topk-axis0-value": (lambda F, y: F.tile(F.topk(y, axis=0, k=1, ret_typ="value"),
                                             reps=(1, 1)), "error"),
    "argsort-axis1": (lambda F, y: F.broadcast_mul(y, F.argsort(y, axis=1)), "merge"),
    "pick-axis1": (lambda F, y: F.pick(y, F.argmax(y, axis=1), axis=1, keepdims=True),
                   "merge"),
    "pick-axis-1-ids": (lambda F, y: F.pick(y, _ids(F, F.sum(y, axis=1))), "merge"),
    # shape operators
    "reshape-split-rows": (lambda F, y: F.reshape(y, (-1, 2)), "merge"),
    "reshape-code-4": (lambda F, y: F.reshape(y, (0, -4, 2, -1)), "merge"),
    "reshape-code-3": (lambda F, y: F.reshape(F.expand_dims(y, 2), (-3, 0)), "merge"),
    "reshape-reverse": (lambda F, y: F.reshape(y, (-1, 2), reverse=True), "merge"),
    "reshape-swapped": (lambda F, y: F.reshape(F.transpose(y), (-1, 2)), "mix"),
    "reshape-like": (lambda F, y: F.reshape_like(F.reshape(y, (-1,)), y), "merge"),
    "flatten-3d": (lambda F, y: F.Flatten(F.expand_dims(y, 1)), "merge"),
    "transpose-twice": (lambda F, y: F.transpose(F.tanh(F.transpose(y))), "merge"),
    "swapaxes-softmax": (lambda F, y: F.swapaxes(F.softmax(F.swapaxes(y, 0, 1), axis=0), 0, 1),
                         "merge"),
    "swapaxes-sum": (lambda F, y: F.broadcast_mul(
        y, F.swapaxes(F.sum(F.swapaxes(y, 0, 1), axis=0, keepdims=True), 0, 1)), "merge"),
    "expand-squeeze": (lambda F, y: F.squeeze(F.expand_dims(y, 1), axis=1), "merge"),
    "tile-axis1": (lambda F, y: F.tile(y, reps=(1, 2)), "merge"),
    "tile-axis0": (lambda F, y: F.tile(y, reps=(2, 1)), "mix"),
    "tile-new-axis": (lambda F, y: F.tile(y, reps=(2, 1, 1)), "error"),
    "repeat-axis0": (lambda F, y: F.repeat(y, repeats=2, axis=0), "merge"),
    "repeat-flat": (lambda F, y: F.reshape(F.repeat(y, repeats=2), (-1, H)), "mix"),
    "flip-axis1": (lambda F, y: F.flip(y, axis=1), "merge"),
    "flip-axis0": (lambda F, y: F.flip(y, axis=0), "mix"),
    "reverse-axis0": (lambda F, y: F.reverse(y, axis=0), "mix"),
    "slice-axis1": (lambda F, y: F.slice_axis(y, axis=1, begin=1, end=None), "merge"),
    "slice-step-axis1": (lambda F, y: F.slice(y, begin=(None, None), end=(None, None),
                                              step=(1, -1)), "merge"),
    "last-row-broadcast": (lambda F, y: F.broadcast_add(
        y, F.slice_axis(y, axis=0, begin=-1, end=None)), "mix"),
    "split-axis1": (lambda F, y: F.split(y, num_outputs=2, axis=1)[1], "merge"),
    "split-new-axis0": (lambda F, y: F.split(F.stack(y, F.tanh(y), axis=0), num_outputs=2,
                                             axis=0, squeeze_axis=True)[1], "merge"),
    "concat-dim1": (lambda F, y: F.concat(y, F.relu(y), dim=1), "merge"),
    "concat-dim0-rotated": (lambda F, y: F.concat(y, y, dim=0), "mix"),
    "stack-axis1": (lambda F, y: F.stack(y, -y, axis=1), "merge"),
    "stack-axis-1": (lambda F, y: F.stack(y, F.exp(y), axis=-1), "merge"),
    "broadcast-axis1": (lambda F, y: F.broadcast_axis(F.sum(y, axis=1, keepdims=True),
                                                      axis=1, size=3), "merge"),
    "broadcast-to-zero-code": (lambda F, y: F.broadcast_to(F.max(y, axis=1, keepdims=True),
                                                           shape=(0, 3)), "merge"),
    "broadcast-like-axes": (lambda F, y: F.broadcast_like(
        F.sum(y, axis=1, keepdims=True), F.ones((1, 3)), lhs_axes=(1,), rhs_axes=(1,)),
        "merge"),
    "depth-to-space": (lambda F, y: F.reshape(F.depth_to_space(F.reshape(y, (0, 4, 1, 1)), 2),
                                              (0, -1)), "merge"),
    "space-to-depth": (lambda F, y: F.reshape(F.space_to_depth(F.reshape(y, (0, 1, 2, 2)), 2),
                                              (0, -1)), "merge"),
    # products
    "batch-dot-tb": (lambda F, y: F.batch_dot(F.expand_dims(y, 1), F.expand_dims(y, 1),
                                              transpose_b=True), "merge"),
    "batch-dot-ta": (lambda F, y: F.batch_dot(F.expand_dims(y, 1), F.expand_dims(y, 1),
                                              transpose_a=True), "merge"),
    "dot-transposed-samples": (lambda F, y: F.dot(F.transpose(y), F.ones((H, 2)),
                                                  transpose_a=True), "merge"),
    "gemm2-rows": (lambda F, y: F.linalg.gemm2(y, F.ones((H, 2))), "mix"),
    # gathers and indices
    "one-hot": (lambda F, y: F.broadcast_mul(F.one_hot(_ids(F, F.sum(y, axis=1)), H), y),
                "merge"),
    "take-constant-rows": (lambda F, y: F.broadcast_add(
        y, F.take(F.ones((3, H)), _ids(F, F.sum(y, axis=1)))), "merge"),
    "take-axis1": (lambda F, y: F.take(y, F.zeros((2,)), axis=1), "merge"),
    "take-rows": (lambda F, y: F.take(y, F.zeros_like(F.sum(y, axis=1)), axis=0), "mix"),
    "where-broadcast": (lambda F, y: F.where(y > 0, y, F.broadcast_like(
        F.min(y, axis=1, keepdims=True), y)), "merge"),
    "gather-nd": (lambda F, y: F.broadcast_add(y, F.gather_nd(y, F.zeros((2, 1)))
                                               .sum()), "mix"),
    "index-copy-row0": (lambda F, y: F.contrib.index_copy(y, F.zeros((1,), dtype="int64"),
                                                          F.ones((1, H))), "mix"),
    "arange-like-axis1": (lambda F, y: F.broadcast_add(y, F.contrib.arange_like(y, axis=1)),
                          "merge"),
    "arange-like-axis0": (lambda F, y: F.broadcast_add(
        y, F.reshape(F.contrib.arange_like(y, axis=0), (-1, 1))), "mix"),
    "shape-array": (lambda F, y: F.broadcast_mul(y, F.shape_array(y).astype("float32")
                                                 .sum()), "mix"),
    # sequence operators over a per-sample batch axis 0 (NTC)
    "sequence-mask-ntc": (lambda F, y: F.reshape(F.SequenceMask(
        F.reshape(y, (0, 2, 2)), F.ones_like(F.sum(y, axis=1)), use_sequence_length=True,
        axis=1), (0, -1)), "merge"),
    "sequence-last-ntc": (lambda F, y: F.SequenceLast(
        F.reshape(y, (0, 2, 2)), F.ones_like(F.sum(y, axis=1)) * 2, use_sequence_length=True,
        axis=1), "merge"),
    "sequence-reverse-tnc": (lambda F, y: F.swapaxes(F.SequenceReverse(
        F.swapaxes(F.reshape(y, (0, 2, 2)), 0, 1), F.ones_like(F.sum(y, axis=1)) * 2,
        use_sequence_length=True), 0, 1), "merge"),
    # pooling, convolution, resizing
    "global-pool-nwc": (lambda F, y: F.Pooling(F.reshape(y, (0, 2, 2)), kernel=(1,),
                                               global_pool=True, layout="NWC",
                                               pool_type="avg"), "merge"),
    "pool-ncw": (lambda F, y: F.Pooling(F.expand_dims(y, 1), kernel=(2,), stride=(2,),
                                        pool_type="max"), "merge"),
    "upsampling": (lambda F, y: F.UpSampling(F.reshape(y, (0, 1, 2, 2)), scale=2,
                                             sample_type="nearest"), "merge"),
    "bilinear-resize": (lambda F, y: F.contrib.BilinearResize2D(F.reshape(y, (0, 1, 2, 2)),
                                                                height=3, width=3), "merge"),
    "lrn": (lambda F, y: F.LRN(F.reshape(y, (0, 4, 1, 1)), nsize=3), "merge"),
    # elementwise and _like sources
    "ones-like": (lambda F, y: y * 2 + F.ones_like(y) - F.zeros_like(y), "merge"),
    "clip-where-hard": (lambda F, y: F.where(F.abs(y) > 0.1, F.clip(y, -0.5, 0.5),
                                             F.hard_sigmoid(y)), "merge"),
    "div-sqrt-dim": (lambda F, y: F.contrib.div_sqrt_dim(y), "merge"),
}


def _samples(rng, sizes, width=H):
    return [nd.array(rng.normal(size=(n, width))) for n in sizes]


def _make(fn, seed=0):
    return initialized(OpBlock(fn), seed)


def _outcome(net, samples, train, policy, flag):
    """``harness.run``, or the jitbatch error it raised (pending work dropped)."""
    try:
        return run(net, square_loss, samples, train, flag=flag, policy=policy), None
    except jitbatch.JitBatchError as e:
        cleanup()
        net.hybridize(active=False)
        return None, e


def _block_merges(net, samples):
    """The flagged block's calls alone (no loss ops), flushed: the stats."""
    net.hybridize(dynamic_batch=True)
    try:
        jitbatch.reset_stats()
        outs = [net(x) for x in samples]
        jitbatch.flush()
        del outs
        return jitbatch.stats()
    finally:
        net.hybridize(active=False)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(OPS))
def test_operator_sweep(name, layout):
    """Every operator in every layout: training (under a policy that varies with
    the case) and inference give plain Gluon's outputs and gradients; what keeps
    samples apart merges; what mixes them warns (naming the operator, with a
    fix) and runs per sample; the BatchingError of an output that does not scale
    along axis 0 names a fix and leaves the next minibatch right."""
    fn, expected = OPS[name]
    rng = rng_for("sweep", name, layout)
    samples = _samples(rng, LAYOUTS[layout])
    policy = POLICIES[sum(map(ord, name + layout)) % len(POLICIES)]
    net = _make(fn)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for train in (True, False):
            want = run(net, square_loss, samples, train, flag=False)
            got, err = _outcome(net, samples, train, policy, flag=True)
            if err is not None or expected == "error":
                assert expected == "error", err
                assert isinstance(err, jitbatch.BatchingError), "no BatchingError"
                assert "Fix" in str(err) and net.name in str(err), str(err)
                assert "cannot be batched along axis 0" in str(err), str(err)
                # the next minibatch (another flagged block): plain Gluon's numbers
                other = _make(OPS["softmax"][0])
                assert_same(run(other, square_loss, samples, train, flag=False),
                            run(other, square_loss, samples, train, flag=True, policy=policy))
                return
            assert_same(want, got)
    warned = contract_warnings(record)
    if expected == "merge":
        assert not warned, warned
        st = _block_merges(net, samples)
        assert merged(st), st
    else:
        assert warned, "no ContractWarning for an operator that mixes rows"
        assert net.name in warned[0] and "Fix" in warned[0], warned[0]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["softmax-axis0", "swapaxes-sum", "reshape-code-4",
                                  "sequence-last-ntc", "mean-axis0", "take-constant-rows"])
def test_sweep_under_map_and_every_policy(name, policy):
    """A few operators of the sweep under ``jitbatch.map`` (a read of each
    sample's loss parks its thread) and under every policy, training."""
    fn, _ = OPS[name]
    samples = _samples(rng_for("map", name), [2, 1, 3, 1])
    net = _make(fn)

    def apply(net, x):
        y, loss = square_loss(net, x)
        loss.asscalar()
        return y, loss
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jitbatch.ContractWarning)
        want = run(net, apply, samples, True, flag=False)
        got = run(net, apply, samples, True, flag=True, policy=policy, mapped=True)
    assert_same(want, got)


# -- input gradients ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["swapaxes-sum", "repeat-axis0", "reshape-split-rows",
                                  "sequence-reverse-tnc", "softmax-axis0", "batch-dot-ta"])
def test_input_gradients(name):
    """Gradients with respect to each sample's input (``attach_grad``) agree,
    for operators that merge and for one that runs per sample."""
    fn, _ = OPS[name]
    sizes = [1, 3, 2]

    def grads(flag):
        net = _make(fn)
        xs = _samples(rng_for("input-grads", name), sizes)
        for x in xs:
            x.attach_grad()
        if flag:
            net.hybridize(dynamic_batch=True, policy="depth")
        with autograd.record():
            loss = nd.add_n(*[square_loss(net, x)[1] for x in xs])
        loss.backward()
        net.hybridize(active=False)
        return [x.grad.asnumpy() for x in xs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jitbatch.ContractWarning)
        want, got = grads(False), grads(True)
    for a, b in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


# -- Gluon layers over the sample's rows ----------------------------------------------------
class Layered(HybridBlock):
    """A layer a user puts after a projection, on per-sample data (rows, H)."""

    def __init__(self, kind, **kw):
        super(Layered, self).__init__(**kw)
        self.kind = kind
        with self.name_scope():
            self.d = nn.Dense(H, in_units=H, flatten=False)
            if kind == "conv1d":
                self.layer = nn.Conv1D(3, 2, padding=1, in_channels=2)
            elif kind == "global-max-pool-nwc":
                self.layer = nn.GlobalMaxPool1D(layout="NWC")
            elif kind == "instance-norm":
                self.layer = nn.InstanceNorm(in_channels=2)
            elif kind == "group-norm":
                self.layer = nn.GroupNorm(num_groups=2)
            elif kind == "layer-norm-axis1":
                self.layer = nn.LayerNorm(axis=1, in_channels=2)
            elif kind == "layer-norm-over-rows":
                self.layer = nn.LayerNorm(axis=0, in_channels=1)
            elif kind == "embedding":
                self.layer = nn.Embedding(3, H)

    def hybrid_forward(self, F, x):
        y = self.d(x)
        if self.kind == "embedding":
            return F.broadcast_mul(self.layer(_ids(F, F.sum(y, axis=1))), y)
        if self.kind == "layer-norm-over-rows":
            return self.layer(y)                               # over the sample's one row
        y = F.reshape(y, (0, 2, 2))                            # (rows, 2, 2)
        return F.reshape(self.layer(y), (0, -1))


LAYERS = ["conv1d", "global-max-pool-nwc", "instance-norm", "group-norm",
          "layer-norm-axis1", "layer-norm-over-rows", "embedding"]


@pytest.mark.parametrize("kind", LAYERS)
def test_gluon_layers_on_rows(kind):
    """Gluon layers on per-sample rows, mixed leading sizes, training under
    'agenda' and inference under 'auto'. All but LayerNorm(axis=0) keep
    samples apart and merge; LayerNorm over the rows of one-row samples warns
    and runs per sample."""
    sizes = [1, 1, 1] if kind == "layer-norm-over-rows" else [2, 1, 3, 1]
    samples = _samples(rng_for("layers", kind), sizes)
    net = initialized(Layered(kind))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for train, policy in ((True, "agenda"), (False, "auto")):
            want = run(net, square_loss, samples, train, flag=False)
            got = run(net, square_loss, samples, train, flag=True, policy=policy)
            assert_same(want, got)
    warned = contract_warnings(record)
    if kind == "layer-norm-over-rows":
        assert warned and "LayerNorm" in warned[0] and "Fix" in warned[0]
    else:
        assert not warned, warned
        assert merged(_block_merges(net, samples))


class Attend(HybridBlock):
    """Two per-sample inputs of different leading sizes: a memory (T, H) and a
    query (1, H); attention over the memory's rows (a softmax over axis 0)."""

    def __init__(self, **kw):
        super(Attend, self).__init__(**kw)
        with self.name_scope():
            self.k = nn.Dense(H, in_units=H, flatten=False)

    def hybrid_forward(self, F, memory, query):
        keys = self.k(memory)                                      # (T, H)
        scores = F.dot(keys, query, transpose_b=True)              # (T, 1)
        weights = F.softmax(scores, axis=0)
        return F.sum(F.broadcast_mul(weights, memory), axis=0, keepdims=True) + query


def test_attention_over_memory_rows_with_a_separate_query():
    """Memory (T, H) and query (1, H) in one call (leads differ, and are equal
    for T=1): a softmax over the memory's rows couples them. Plain Gluon's
    outputs and gradients; the BatchingError of an output that does not scale
    with the memory's rows, if raised, names a fix."""
    rng = rng_for("attend")
    pairs = [(nd.array(rng.normal(size=(t, H))), nd.array(rng.normal(size=(1, H))))
             for t in (3, 1, 2, 1, 3)]
    net = initialized(Attend())

    def apply(net, pair):
        y = net(*pair)
        return y, nd.sum(y * y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jitbatch.ContractWarning)
        for train in (True, False):
            want = run(net, apply, pairs, train, flag=False)
            try:
                got = run(net, apply, pairs, train, flag=True, policy="agenda")
            except jitbatch.BatchingError as e:
                cleanup()
                net.hybridize(active=False)
                assert "Fix" in str(e) and net.name in str(e), str(e)
                continue
            assert_same(want, got)


# -- bugs found by this round (fixed 2026-11-26) ---------------------------------------------
@pytest.mark.parametrize("normalization", ["batch", "valid"])
def test_make_loss_with_normalization(normalization):
    """``F.MakeLoss(y, normalization='batch')`` scales the gradient by 1/rows
    of ITS input: per sample the sample's rows; merged, every sample's."""
    fn = (lambda F, y: F.MakeLoss(y, normalization=normalization))
    samples = _samples(rng_for("makeloss", normalization), [1, 2, 1])
    net = _make(fn)
    want = run(net, square_loss, samples, True, flag=False)
    # MXNet's own hybridize gives per-sample Gluon's numbers
    assert_same(want, run(net, square_loss, samples, True, flag=False, hybridize_plain=True))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = run(net, square_loss, samples, True, flag=True, policy="depth")
    if not contract_warnings(record):
        assert_same(want, got)


@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
def test_make_loss_without_normalization(train):
    """``MakeLoss(grad_scale=2)`` (no normalisation) gives plain Gluon's numbers;
    in inference (the identity) it merges; recorded by autograd it runs one
    call per sample with a ContractWarning that says why (its backward passes
    ones whatever the head gradient: tests/test_heldout14.py)."""
    net = _make(lambda F, y: F.MakeLoss(y, grad_scale=2.0))
    samples = _samples(rng_for("makeloss-null"), [1, 2, 1])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert_same(run(net, square_loss, samples, train, flag=False),
                    run(net, square_loss, samples, train, flag=True, policy="auto"))
    said = contract_warnings(record)
    if train:
        assert any("head gradient" in w for w in said), said
    else:
        assert not said, said


class Squeezed(HybridBlock):
    """Per sample: ``(rows, 1, H)`` projected and squeezed (``F.squeeze``
    without an axis), as a user writes for a stack of 1-wide features."""

    def __init__(self, **kw):
        super(Squeezed, self).__init__(**kw)
        with self.name_scope():
            self.d = nn.Dense(H, in_units=H, flatten=False)

    def hybrid_forward(self, F, x):
        return F.squeeze(self.d(x))


def _softmax_scores(net, x):
    """A user's per-sample scores: softmax over the squeezed block's first axis."""
    y = net(x)
    p = nd.softmax(y, axis=0)
    return p, nd.sum(p * nd.arange(p.size).reshape(p.shape))


@pytest.mark.parametrize("apply", [square_loss, _softmax_scores], ids=["shape", "softmax"])
def test_squeeze_without_axis_over_a_one_row_sample_after_longer_ones(apply):
    """``F.squeeze(y)`` of per-sample ``(rows, 1, H)``: plain Gluon gives
    ``(rows, H)``, and ``(H,)`` for a sample of one row. The first call (3
    rows) makes the block's signature ragged; until 2026-11-26 the 1-row
    sample merged with it and got ``(1, H)`` (a softmax over its first axis
    after it was then all ones). A ragged signature is now checked at one row
    too: the 1-row call gets its own signature, refused as in the control
    below, and the next minibatch of longer samples is right."""
    rng = rng_for("squeeze")
    samples = [nd.array(rng.normal(size=(n, 1, H))) for n in (3, 1, 2)]
    longer = [s for s in samples if s.shape[0] > 1]
    for train in (False, True):
        net = initialized(Squeezed())
        with pytest.raises(jitbatch.BatchingError,
                           match=r"(?s)squeezed\d+ cannot be batched along axis 0.*Fix"):
            run(net, apply, samples, train, flag=True, policy="depth")
        cleanup()
        want = run(net, apply, longer, train, flag=False)
        got = run(net, apply, longer, train, flag=True, policy="depth")
        assert_same(want, got)


def test_squeeze_without_axis_over_a_one_row_sample_first():
    """The control: the 1-row sample FIRST. Its signature squeezes axis 0 and is
    refused with the documented BatchingError (output does not scale along axis
    0, with a fix); the next minibatch of longer samples gives plain Gluon's
    numbers."""
    rng = rng_for("squeeze-first")
    net = initialized(Squeezed())
    net.hybridize(dynamic_batch=True)
    with pytest.raises(jitbatch.BatchingError, match=r"(?s)cannot be batched along axis 0.*Fix"):
        [net(nd.array(rng.normal(size=(n, 1, H)))) for n in (1, 3)]
    cleanup()
    net.hybridize(active=False)
    samples = [nd.array(rng.normal(size=(n, 1, H))) for n in (3, 2, 3)]
    assert_same(run(net, square_loss, samples, True, flag=False),
                run(net, square_loss, samples, True, flag=True))


# -- random chains of operators that keep samples apart ------------------------------------
CHAIN = ["sum-axis1-keepdims", "softmax", "l2norm-instance", "transpose-twice",
         "swapaxes-softmax", "reshape-split-rows", "tile-axis1", "repeat-axis0", "flip-axis1",
         "stack-axis1", "concat-dim1", "pick-axis1", "topk-axis1-both", "where-broadcast",
         "norm-axis-1", "mean-axis0", "sort-axis0", "max-exclude-axis0"]


class Chain(HybridBlock):
    """Dense layers between the operators ``names`` (each back to width H)."""

    def __init__(self, names, **kw):
        super(Chain, self).__init__(**kw)
        self.names = names
        with self.name_scope():
            self.ds = [nn.Dense(H, flatten=False, prefix="d%d_" % i) for i in range(len(names))]
            for d in self.ds:
                self.register_child(d)

    def hybrid_forward(self, F, x):
        y = x
        for name, d in zip(self.names, self.ds):
            y = OPS[name][0](F, d(y))
            # back to (rows', H): flatten what an operator added, then a projection
            y = F.reshape(y, (0, -1))
        return y


def test_random_chains_of_operators():
    """Chains of 1-3 operators drawn from the sweep (with projections between),
    mixed leading sizes, training: plain Gluon's numbers; a chain of operators
    that all keep samples apart also merges."""
    hyp = pytest.importorskip("hypothesis")
    st = hyp.strategies

    @hyp.settings(max_examples=12, deadline=None, derandomize=True)
    @hyp.given(names=st.lists(st.sampled_from(CHAIN), min_size=1, max_size=3),
               sizes=st.lists(st.integers(1, 3), min_size=2, max_size=4),
               policy=st.sampled_from(POLICIES))
    def prop(names, sizes, policy):
        cleanup()
        net = initialized(Chain(names))
        samples = _samples(rng_for("chain", *names), sizes)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            want = run(net, square_loss, samples, True, flag=False)
            got = run(net, square_loss, samples, True, flag=True, policy=policy)
        assert_same(want, got)
        mixing = any(OPS[n][1] == "mix" for n in names)
        assert bool(contract_warnings(record)) == mixing, (names, contract_warnings(record))
    prop()
