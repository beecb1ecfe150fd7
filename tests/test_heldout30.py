"""Held-out programs, round 30: Python custom operators, operators whose
output shapes depend on values, control flow, sparse storage, host data under
stress, DataLoader workers and forked processes, each checked against plain
per-sample Gluon.

* Custom operators (``mx.operator.CustomOp``, ``nd.Custom``): a NumPy-style
  operator with a per-call attribute (``scale=str(...)``) between flagged
  blocks; a two-output operator inside a flagged block and a custom loss
  (``need_top_grad=False``, with a label) after it, also under
  ``jitbatch.map``; an operator centring over axis 0 (mixes rows) inside and
  between blocks on ragged samples, trained, with reads mid-sample.
* Shapes from values: ``nd.contrib.boolean_mask`` (a detached mask) and
  ``nd.contrib.index_array`` between blocks in training; ``mx.np.unique`` and
  ``npx.nonzero`` of ``as_np_ndarray`` of lazy outputs.
* Control flow: MXNet's imperative ``nd.contrib.foreach`` / ``while_loop`` /
  ``cond`` around a flagged GRU cell; ``F.contrib.foreach`` (trained) and
  ``while_loop`` + ``cond`` (inference) inside a flagged block.
* Sparse: CSR samples (alone and mixed with dense ones) into a flagged block
  computing ``F.sparse.dot``; ``Embedding(sparse_grad=True)`` trained with
  SGD (momentum, weight decay) and Adam, with ``grad_req`` 'write' and 'add'
  (the row_sparse gradient's rows compared too); ``tostype('csr' /
  'row_sparse')`` of lazy outputs and ``sparse.dot(lazy, csr)`` trained.
* Host data: ``nd.array`` of NumPy views (negative strides, transposed,
  Fortran order, broadcast), bools, integers, float16, lists, ``array.array``
  and explicit dtypes; 200 minibatches under ``jitbatch.map`` with NumPy
  inputs, Python numbers, ``asnumpy`` / ``wait_to_read`` / ``nd.waitall()``
  mid-sample, ``gc.collect()`` and a custom operator, and three threads each
  training its own flagged model, in a watched subprocess; tree nodes with
  parent pointers (freed by the cyclic GC) that log their states from
  ``__del__``.
* Processes: a ``multiprocessing`` fork while predictions pend (the child
  reads them and trains a step), a ``DataLoader(num_workers=2)`` made while
  predictions pend, in a watched subprocess.
* ``hybridize(static_alloc=True[, static_shape=True], dynamic_batch=True)``
  trained (plain ``hybridize(static_alloc=True)`` gets MXNet 1.9.1's wrong
  gradients here; jitbatch must not).

The oracle is plain per-sample Gluon (no hybridize) on the same parameters and
inputs: outputs, gradients and parameters after the steps, under the policies
auto, depth, agenda and sequential. Launch counts are asserted under 'depth'
and 'agenda' only. Not run (MXNet's own limits, plain Gluon fails alike):
``boolean_mask`` with a mask recorded by autograd (segfault in backward),
``mx.np.nonzero`` (its transpose's shape inference), AMP float16 on CPU.

Findings, all fixed on 2026-11-26 (each test's docstring says what
happened before):

* A custom operator applied to a lazy array had its Python ``forward`` run
  on arrays of zeros and of ones at the call (the output shapes of a new
  operator signature): an operator that checks its input raised at every
  call, and one with a side effect saw two calls that never happened. Its
  shapes come from its own ``infer_shape`` now.
* A custom operator with an auxiliary state (a running mean it updates in
  ``forward``), between blocks or inside a flagged block, had its state
  write taken for a read: the flush reordered the calls and every output
  was silently off, and reading the state before the outputs gave zeros.
  Such a call runs at once now, after the pending calls that read the
  state; a flagged block holding one runs unhybridized (ContractWarning).
* Batches of ``DataLoader(num_workers > 0)`` live on ``cpu_shared(0)``,
  which jitbatch took for another device than the CPU (a BatchingError
  with the wrong fix, an ExecutionError, outputs on ``cpu_shared(0)``).
* The cyclic GC ran inside flushes: a ``__del__`` that read a state of the
  graph being executed got a misleading StaleValueError, which Python
  ignores, so a log silently missed entries. The GC is off during flushes.

Added with the fixes: another library writing a buffer through
``nd.to_dlpack_for_write``, and a long-lived ``nd.from_dlpack`` alias
written while calls read its source.
"""
import array
import gc

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import Block, HybridBlock, nn, rnn
from mxnet.gluon.data import ArrayDataset, DataLoader

import jitbatch
from heldout import Centre
from heldout import initialized as init
from heldout import flag_all, params_dict, ragged
from heldout import (both, flag, grads_of, merged, nothing_pending, params_of,  # noqa: F401
                     rng_for, run_in_subprocess, same_values as same)

POLICIES = ["auto", "depth", "agenda", "sequential"]
POLICY = pytest.mark.parametrize("policy", POLICIES)
#: the policies whose launches are planned from the graph alone
MERGING = ["depth", "agenda"]
H = 4




# -- custom operators ----------------------------------------------------------------------
def _prop(make, args=("data",), outs=("output",), aux=(), need_top_grad=True, shapes=None,
          **defaults):
    """A CustomOpProp class: ``make(**attrs)`` makes the operator; its outputs
    (and auxiliary states) shaped as its first input unless ``shapes``."""
    class Prop(mx.operator.CustomOpProp):
        def __init__(self, **attrs):
            super(Prop, self).__init__(need_top_grad=need_top_grad)
            self.attrs = dict(defaults, **attrs)

        def list_arguments(self):
            return list(args)

        def list_outputs(self):
            return list(outs)

        def list_auxiliary_states(self):
            return list(aux)

        def infer_shape(self, in_shape):
            if shapes is not None:
                return shapes(in_shape)
            return in_shape, [in_shape[0]] * len(outs), [in_shape[0]] * len(aux)

        def create_operator(self, ctx, in_shapes, in_dtypes):
            return make(**self.attrs)
    return Prop


class ScaledTanh(mx.operator.CustomOp):
    """``scale * tanh(x)`` computed in NumPy (MXNet's tutorial style)."""

    def __init__(self, scale):
        super(ScaledTanh, self).__init__()
        self.scale = float(scale)

    def forward(self, is_train, req, in_data, out_data, aux):
        self.assign(out_data[0], req[0], nd.array(np.tanh(in_data[0].asnumpy()) * self.scale))

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        t = out_data[0].asnumpy() / self.scale
        self.assign(in_grad[0], req[0],
                    nd.array(out_grad[0].asnumpy() * (1 - t * t) * self.scale))


class TanhAndSquare(mx.operator.CustomOp):
    """Two outputs, row-wise: ``tanh(x)`` and ``x * x``."""

    def forward(self, is_train, req, in_data, out_data, aux):
        x = in_data[0]
        self.assign(out_data[0], req[0], nd.tanh(x))
        self.assign(out_data[1], req[1], x * x)

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        x = in_data[0]
        self.assign(in_grad[0], req[0],
                    out_grad[0] * (1 - nd.tanh(x) ** 2) + out_grad[1] * 2 * x)


class SoftmaxCE(mx.operator.CustomOp):
    """Softmax over each row with a label per row (a loss layer: its backward
    is ``p - onehot(label)``, whatever the head gradient)."""

    def forward(self, is_train, req, in_data, out_data, aux):
        x = in_data[0].asnumpy()
        e = np.exp(x - x.max(axis=1, keepdims=True))
        self.assign(out_data[0], req[0], nd.array(e / e.sum(axis=1, keepdims=True)))

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        lab = in_data[1].asnumpy().astype(int)
        p = out_data[0].asnumpy()
        p[np.arange(len(lab)), lab] -= 1.0
        self.assign(in_grad[0], req[0], nd.array(p))
        self.assign(in_grad[1], req[1], nd.zeros_like(in_data[1]))


class CheckedNLL(mx.operator.CustomOp):
    """``-log p[label]`` of rows of probabilities; it checks that they are."""

    def forward(self, is_train, req, in_data, out_data, aux):
        p = in_data[0].asnumpy()
        if not np.allclose(p.sum(axis=1), 1.0, atol=1e-4):
            raise ValueError("rows must be probabilities, their sums are %s" % p.sum(axis=1))
        lab = in_data[1].asnumpy().astype(int)
        self.assign(out_data[0], req[0], nd.array(-np.log(p[np.arange(len(lab)), lab])))

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        p = in_data[0].asnumpy()
        lab = in_data[1].asnumpy().astype(int)
        g = np.zeros_like(p)
        g[np.arange(len(lab)), lab] = -1.0 / p[np.arange(len(lab)), lab]
        self.assign(in_grad[0], req[0], nd.array(g * out_grad[0].asnumpy()[:, None]))
        self.assign(in_grad[1], req[1], nd.zeros_like(in_data[1]))


#: per op_type: the (min, max, shape) of every input a calibration op saw
SEEN = {}


class Calibrate(mx.operator.CustomOp):
    """The identity, noting the range of each input it gets (a quantization
    calibration pass)."""

    def __init__(self, key):
        super(Calibrate, self).__init__()
        self.key = key

    def forward(self, is_train, req, in_data, out_data, aux):
        x = in_data[0].asnumpy()
        SEEN.setdefault(self.key, []).append((float(x.min()), float(x.max()), x.shape))
        self.assign(out_data[0], req[0], in_data[0])

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        self.assign(in_grad[0], req[0], out_grad[0])


class RunningCentre(mx.operator.CustomOp):
    """``x`` less a running mean (an auxiliary state), which then moves
    halfway to the mean of ``x``'s rows."""

    def forward(self, is_train, req, in_data, out_data, aux):
        x, rm = in_data[0], aux[0]
        self.assign(out_data[0], req[0], nd.broadcast_sub(x, rm))
        rm[:] = rm * 0.5 + nd.mean(x, axis=0, keepdims=True) * 0.5

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        self.assign(in_grad[0], req[0], out_grad[0])


mx.operator.register("heldout30_scaled_tanh")(_prop(ScaledTanh, scale="1.0"))
mx.operator.register("heldout30_tanh_square")(_prop(TanhAndSquare, outs=("a", "b")))
mx.operator.register("heldout30_softmax_ce")(_prop(
    SoftmaxCE, args=("data", "label"), need_top_grad=False,
    shapes=lambda s: ([s[0], (s[0][0],)], [s[0]], [])))
mx.operator.register("heldout30_centre")(_prop(Centre))
mx.operator.register("heldout30_checked_nll")(_prop(
    CheckedNLL, args=("prob", "label"),
    shapes=lambda s: ([s[0], (s[0][0],)], [(s[0][0],)], [])))
for _p in [None] + POLICIES:
    # one op_type per run: an operator signature (and what making it runs) is
    # made once per process
    mx.operator.register("heldout30_calibrate_%s" % _p)(_prop(Calibrate, key=str(_p)))
mx.operator.register("heldout30_running_centre")(_prop(
    RunningCentre, aux=("running_mean",),
    shapes=lambda s: ([s[0]], [s[0]], [(1, s[0][1])])))


class ScaledBetween(Block):
    """Two flagged Dense layers with a NumPy custom operator between them,
    its scale a per-sample attribute."""

    def __init__(self, **kw):
        super(ScaledBetween, self).__init__(**kw)
        with self.name_scope():
            self.a = nn.Dense(H, in_units=3)
            self.b = nn.Dense(2, in_units=H)

    def forward(self, x, k):
        return self.b(nd.Custom(self.a(x), op_type="heldout30_scaled_tanh",
                                scale=str(0.5 + k % 3)))


@POLICY
def test_a_numpy_custom_op_with_a_per_sample_scale_between_flagged_blocks(policy):
    """Ragged samples of 1-3 rows; ``nd.Custom(a(x), scale=...)`` (NumPy in
    its forward and backward) between two flagged Dense layers; two SGD
    steps. The Dense calls merge around the custom calls."""
    xs = ragged("scaled", 6)

    def program(net, policy):
        flag_all([net.a, net.b], policy)
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
        out = []
        for _ in range(2):
            with autograd.record():
                ys = [net(x, k) for k, x in enumerate(xs)]
                loss = nd.add_n(*[nd.sum(y * y) for y in ys])
            loss.backward()
            out += [y.asnumpy() for y in ys] + grads_of(net)
            tr.step(len(xs))
        return out + params_of(net)
    want, got, st = both(lambda: init(ScaledBetween(prefix="sb_")), program, policy)
    same(want, got, "custom op between blocks under %s" % policy)
    if policy in MERGING:
        assert merged(st), st


class SplitInside(HybridBlock):
    def __init__(self, **kw):
        super(SplitInside, self).__init__(**kw)
        with self.name_scope():
            self.a = nn.Dense(H, in_units=3)
            self.b = nn.Dense(3, in_units=2 * H)

    def hybrid_forward(self, F, x):
        p, q = F.Custom(self.a(x), op_type="heldout30_tanh_square")
        return self.b(F.concat(p, q, dim=1))


@pytest.mark.parametrize("mapped", [False, True], ids=["loop", "map"])
@POLICY
def test_a_two_output_custom_op_inside_a_block_and_a_custom_loss_after_it(policy, mapped):
    """A flagged block with a two-output custom operator inside; per sample a
    custom softmax loss with a label (``need_top_grad=False``) on its output;
    ``autograd.backward`` of the loss outputs; two SGD steps; the samples
    under ``jitbatch.map`` or a loop."""
    rng = rng_for("split-loss")
    xs = [nd.array(rng.normal(size=(1, 3))) for _ in range(6)]
    labels = [nd.array([k % 3]) for k in range(6)]

    def program(net, policy):
        flag(net, policy)
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})

        def sample(k):
            return nd.Custom(net(xs[k]), labels[k], op_type="heldout30_softmax_ce")
        out = []
        for _ in range(2):
            with autograd.record():
                ps = jitbatch.map(sample, range(6)) if mapped else [sample(k) for k in range(6)]
            autograd.backward(ps)
            out += [p.asnumpy() for p in ps] + grads_of(net)
            tr.step(6)
        return out + params_of(net)
    want, got, _ = both(lambda: init(SplitInside(prefix="si_")), program, policy)
    same(want, got, "custom ops (%s) under %s" % ("map" if mapped else "loop", policy))


class CentreInside(HybridBlock):
    def __init__(self, **kw):
        super(CentreInside, self).__init__(**kw)
        with self.name_scope():
            self.a = nn.Dense(H, in_units=3, activation="tanh")

    def hybrid_forward(self, F, x):
        return F.Custom(self.a(x), op_type="heldout30_centre")


@pytest.mark.parametrize("where", ["inside", "between"])
@POLICY
def test_a_row_mixing_custom_op_on_ragged_samples_with_reads_mid_sample(policy, where):
    """A custom operator centring over axis 0 (every row reads the sample's
    other rows) on ragged samples: inside a flagged block, or between a
    flagged encoder and a flagged head. Each sample reads its squared sum
    (``asscalar``) and divides its loss by one more than it; under
    ``jitbatch.map``; two SGD steps (Adam would scale the head bias's
    gradient, zero but for rounding after centring, to the learning rate).
    It must act within one sample."""
    xs = ragged("centre-" + where, 6, hi=4)

    def make():
        return [init(CentreInside(prefix="ci_")), init(nn.Dense(1, in_units=H, prefix="ch_"))]

    def program(nets, policy):
        enc, head = nets
        flag_all(nets, policy)
        tr = gluon.Trainer(params_dict(*nets), "sgd", {"learning_rate": 0.1})

        def sample(x):
            h = enc(x) if where == "inside" else nd.Custom(enc.a(x), op_type="heldout30_centre")
            y = head(h)
            s = nd.sum(y * y).asscalar()
            return nd.sum(y * y) / (1.0 + s)
        out = []
        for _ in range(2):
            with autograd.record():
                ls = jitbatch.map(sample, xs)
                loss = nd.add_n(*ls)
            loss.backward()
            out += [loss.asnumpy()] + [l.asnumpy() for l in ls] + grads_of(*nets)
            tr.step(len(xs))
        return out + params_of(*nets)
    want, got, _ = both(make, program, policy)
    same(want, got, "centring %s under %s" % (where, policy))


# findings: what making an operator signature runs, and auxiliary states
@POLICY
def test_a_custom_op_that_checks_its_input_between_blocks(policy):
    """A custom negative log-likelihood that checks its input rows are
    probabilities, on ``nd.softmax`` of a flagged layer's output, trained.
    Until 2026-11-26 a new operator signature ran the custom forward on arrays
    of zeros (the output shapes' trial run): its check failed, and MXNet's
    error was raised at every call where plain Gluon ran. Custom operators'
    shapes come from their own ``infer_shape`` now."""
    xs = ragged("checked", 4, hi=2)
    rng = rng_for("checked-labels")
    labels = [nd.array(rng.integers(0, 3, size=x.shape[0])) for x in xs]

    def program(net, policy):
        flag(net, policy)
        with autograd.record():
            ls = [nd.Custom(nd.softmax(net(x)), lab, op_type="heldout30_checked_nll")
                  for x, lab in zip(xs, labels)]
            loss = nd.add_n(*[nd.sum(l) for l in ls])
        loss.backward()
        return [l.asnumpy() for l in ls] + grads_of(net)
    want, got, _ = both(lambda: init(nn.Dense(3, in_units=3, prefix="ck_")), program, policy)
    same(want, got, "checked custom loss under %s" % policy)


@POLICY
def test_a_calibration_custom_op_sees_only_the_samples_values(policy):
    """A quantization calibration pass: the identity custom operator that notes
    each input's range, between a sigmoid layer and a head (both flagged);
    the ranges it saw (as a multiset) and the outputs. Until 2026-11-26 it
    also noted (0, 0) and (1, 1), the trial runs on zeros and ones, silently."""
    xs = ragged("calibrate", 5, hi=2)
    op_type = "heldout30_calibrate_%s" % policy

    def program(nets, policy):
        enc, head = nets
        flag_all(nets, policy)
        SEEN.pop(str(policy), None)
        ys = [head(nd.Custom(enc(x), op_type=op_type if policy else "heldout30_calibrate_None"))
              for x in xs]
        out = [y.asnumpy() for y in ys]
        jitbatch.flush()
        seen = sorted(SEEN.get(str(policy), []))
        return out + [np.array([(lo, hi) for lo, hi, _ in seen]).reshape((-1, 2))]
    want, got, _ = both(lambda: [init(nn.Dense(H, in_units=3, activation="sigmoid",
                                               prefix="cal_")),
                                 init(nn.Dense(2, in_units=H, prefix="calh_"))], program, policy)
    same(want, got, "calibration ranges under %s" % policy)


class CentredByState(HybridBlock):
    """A Dense layer and the running-centre custom operator, its running mean
    a parameter of the block (``grad_req='null'``)."""

    def __init__(self, **kw):
        super(CentredByState, self).__init__(**kw)
        with self.name_scope():
            self.d = nn.Dense(3, in_units=3)
            self.rm = self.params.get("rm", shape=(1, 3), init="zeros", grad_req="null")

    def hybrid_forward(self, F, x, rm):
        return F.Custom(self.d(x), rm, op_type="heldout30_running_centre")


def running_centre(where, logged_first):
    """Samples of alternating depth (every other one through an extra flagged
    layer) into the running-centre custom operator: between blocks with a
    user's ``nd.zeros`` running mean, or inside a flagged block whose
    parameter it is; the running mean read (logged) before the outputs or
    after them. Returns (make, program)."""
    rng = rng_for("running-centre")
    xs = [nd.array(rng.normal(size=(1, 3))) for _ in range(5)]

    def make():
        return [init(nn.Dense(3, in_units=3, activation="tanh", prefix="rc_")),
                init(CentredByState(prefix="rcs_"))]

    def program(nets, policy):
        pre, block = nets
        flag_all(nets, policy)
        rm = nd.zeros((1, 3)) if where == "between" else block.rm.data()
        ys = []
        for k, x in enumerate(xs):
            h = pre(x) if k % 2 == 0 else x
            if where == "between":
                ys.append(nd.Custom(block.d(h), rm, op_type="heldout30_running_centre"))
            else:
                ys.append(block(h))
        logged = [rm.asnumpy().copy()] if logged_first else []
        return logged + [y.asnumpy() for y in ys] + [rm.asnumpy()]
    return make, program




@pytest.mark.parametrize("where", ["between", "inside"])
@pytest.mark.parametrize("policy", ["depth", "agenda", "sequential"])
def test_a_custom_op_updating_an_auxiliary_running_mean(policy, where):
    """Per sample each call of the running-centre operator sees the running
    mean its predecessors (in program order) left; outputs, then the mean.
    Until 2026-11-26 the state, written through the operator's mutable input,
    was taken for a read: 'depth' and 'agenda' ran the shallower samples'
    calls first, and every output and the final mean were off, silently.
    Such an operator runs at its call now (between blocks), and a flagged
    block holding one runs unhybridized (a ContractWarning says why).
    ('auto' picks one of the others by timing: not asserted here.)"""
    make, program = running_centre(where, logged_first=False)
    want, got, _ = both(make, program, policy)
    same(want, got, "running mean (%s) under %s" % (where, policy))


@pytest.mark.parametrize("where", ["between", "inside"])
@POLICY
def test_the_running_mean_of_a_custom_op_logged_before_the_outputs(policy, where):
    """The running mean read (logged) after recording the samples and before
    reading their outputs: per sample it has every call's update. Until
    2026-11-26 the read ran nothing (a concrete array) and gave zeros."""
    make, program = running_centre(where, logged_first=True)
    want, got, _ = both(make, program, policy)
    same(want, got, "running mean logged first (%s) under %s" % (where, policy))


# -- shapes from values -------------------------------------------------------------------
@POLICY
def test_boolean_mask_and_index_array_between_blocks_in_training(policy):
    """Per sample: an encoder over its rows, a score per row, the rows scoring
    at least their mean kept (``boolean_mask``, its mask detached: MXNet
    1.9.1 crashes differentiating a recorded mask), mean-pooled by the kept
    count (a Python number), plus the rows weighted by their positions
    (``index_array``); two SGD steps."""
    xs = ragged("mask", 6, hi=5)

    def make():
        return [init(nn.Dense(H, in_units=3, activation="tanh", prefix="mk_")),
                init(nn.Dense(1, in_units=H, prefix="mkh_"))]

    def program(nets, policy):
        enc, head = nets
        flag_all(nets, policy)
        tr = gluon.Trainer(params_dict(*nets), "sgd", {"learning_rate": 0.1})
        out = []
        for _ in range(2):
            with autograd.record():
                ls = []
                for x in xs:
                    h = enc(x)
                    score = head(h)
                    keep = nd.contrib.boolean_mask(
                        h, (score.reshape((-1,)) >= nd.mean(score)).detach())
                    pos = nd.contrib.index_array(h, axes=(0,)).astype("float32")
                    pooled = nd.sum(keep, axis=0, keepdims=True) / max(1, keep.shape[0])
                    ls.append(nd.sum(pooled * pooled) + nd.sum(score) * 0.1 +
                              nd.sum(h * pos.reshape((-1, H))) * 0.1)
                    out.append(np.array([keep.shape[0]]))
                loss = nd.add_n(*ls)
            loss.backward()
            out += [l.asnumpy() for l in ls] + grads_of(*nets)
            tr.step(len(xs))
        return out + params_of(*nets)
    want, got, _ = both(make, program, policy)
    same(want, got, "boolean_mask and index_array under %s" % policy)


@POLICY
def test_numpy_unique_and_nonzero_of_lazy_outputs(policy):
    """``mx.np.unique`` (with counts) and ``npx.nonzero`` of rounded lazy
    outputs made NumPy arrays with ``as_np_ndarray``; their sizes vary by
    sample."""
    xs = ragged("unique", 5, hi=1)

    def program(net, policy):
        flag(net, policy)
        out = []
        for x in xs:
            r = nd.round(net(x) * 2).as_np_ndarray()
            u, c = mx.np.unique(r, return_counts=True)
            out += [u.asnumpy(), c.asnumpy(), mx.npx.nonzero(r).asnumpy()]
        return out
    want, got, _ = both(lambda: init(nn.Dense(6, in_units=3, prefix="un_")), program, policy)
    same(want, got, "unique and nonzero under %s" % policy)


# -- control flow ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["foreach", "while_loop", "cond"])
@POLICY
def test_imperative_control_flow_around_a_flagged_cell(policy, kind):
    """MXNet's imperative ``nd.contrib.foreach`` (the flagged GRU cell as its
    body over a ``(T, 1, C)`` sample), ``while_loop`` (the cell stepped until
    the sample's length, the index read per step) and ``cond`` (on the sign
    of the cell's output) per sample, with a flagged head; two SGD steps."""
    rng = rng_for("control", kind)
    seqs = [nd.array(rng.normal(size=(int(rng.integers(1, 5)), 1, 3))) for _ in range(5)]

    def make():
        return [init(rnn.GRUCell(H, input_size=3, prefix="cf_")),
                init(nn.Dense(1, in_units=H, prefix="cfh_"))]

    def program(nets, policy):
        cell, head = nets
        flag_all(nets, policy)
        tr = gluon.Trainer(params_dict(*nets), "sgd", {"learning_rate": 0.1})
        out = []
        for _ in range(2):
            with autograd.record():
                ys = []
                for s in seqs:
                    h0 = [nd.zeros((1, H))]
                    if kind == "foreach":
                        outs, st = nd.contrib.foreach(lambda x, hs: cell(x, hs), s, h0)
                        y = head(st[0]) + nd.sum(outs, axis=0)[:, 0:1]
                    elif kind == "while_loop":
                        def body(i, h, s=s):
                            o, hs = cell(s[int(i.asscalar())], [h])
                            return o, (i + 1, hs[0])
                        outs, (_, h) = nd.contrib.while_loop(
                            lambda i, h, s=s: i < s.shape[0], body, (nd.zeros((1,)), h0[0]),
                            max_iterations=5)
                        y = head(h) + nd.sum(outs[:s.shape[0]]) * 0.1
                    else:
                        o, hs = cell(s[0], h0)
                        y = nd.contrib.cond(nd.sum(o) > 0, lambda o=o: head(o) * 2,
                                            lambda hs=hs: head(hs[0]) - 1)
                    ys.append(y)
                loss = nd.add_n(*[nd.sum(y * y) for y in ys])
            loss.backward()
            out += [y.asnumpy() for y in ys] + grads_of(*nets)
            tr.step(len(seqs))
        return out + params_of(*nets)
    want, got, st = both(make, program, policy)
    same(want, got, "%s under %s" % (kind, policy))
    if policy in MERGING and kind == "foreach":
        assert merged(st), st


class Scan(HybridBlock):
    """A tanh RNN by ``F.contrib.foreach`` over the time axis of a ``(T, 1, C)``
    sample."""

    def __init__(self, **kw):
        super(Scan, self).__init__(**kw)
        with self.name_scope():
            self.i2h = nn.Dense(H, in_units=3, flatten=False)
            self.h2h = nn.Dense(H, in_units=H, flatten=False, use_bias=False)

    def hybrid_forward(self, F, seq, h0):
        def step(x, states):
            h = F.tanh(self.i2h(x) + self.h2h(states[0]))
            return h, [h]
        outs, states = F.contrib.foreach(step, seq, [h0])
        return outs, states[0]


class HalveThenPick(HybridBlock):
    """``while_loop`` halving a Dense output until its norm is under the
    sample's threshold, then ``cond`` on the sign of the result."""

    def __init__(self, **kw):
        super(HalveThenPick, self).__init__(**kw)
        with self.name_scope():
            self.d = nn.Dense(3, in_units=3)

    def hybrid_forward(self, F, x, thr):
        y = self.d(x)
        _, (v, i) = F.contrib.while_loop(
            lambda v, i: F.sum(F.abs(v)) > F.sum(thr),
            lambda v, i: (v, (v * 0.5, i + 1)),
            (y, F.zeros_like(F.sum(y, axis=1, keepdims=True))), max_iterations=20)
        return F.contrib.cond(F.sum(v) > 0, lambda: v * 2, lambda: -v), i


@pytest.mark.parametrize("case", ["foreach-train", "foreach-infer", "while-cond-infer"])
@POLICY
def test_control_flow_operators_inside_a_flagged_block(policy, case):
    """``F.contrib.foreach`` over ragged time-major samples (trained and in
    inference), ``while_loop`` + ``cond`` with per-sample thresholds (in
    inference: recorded they are refused, docs/errors.rst): one launch per
    call, plain Gluon's numbers."""
    rng = rng_for("cf-inside", case)
    seqs = [nd.array(rng.normal(size=(int(rng.integers(1, 5)), 1, 3))) for _ in range(5)]
    xs = [nd.array(rng.normal(size=(1, 3))) for _ in range(5)]
    thr = [nd.array([[t]]) for t in rng.uniform(0.05, 0.5, size=5)]
    train = case == "foreach-train"

    def program(net, policy):
        flag(net, policy)
        if case == "while-cond-infer":
            return [a.asnumpy() for x, t in zip(xs, thr) for a in net(x, t)]
        with autograd.record(train):
            res = [net(s, nd.zeros((1, H))) for s in seqs]
            loss = nd.add_n(*[nd.sum(o * o) + nd.sum(h) for o, h in res])
        if train:
            loss.backward()
        return [a.asnumpy() for r in res for a in r] + (grads_of(net) if train else [])
    make = (lambda: init(HalveThenPick(prefix="hp_"))) if case == "while-cond-infer" \
        else (lambda: init(Scan(prefix="scan_")))
    want, got, _ = both(make, program, policy)
    same(want, got, "%s under %s" % (case, policy))


# -- sparse storage ---------------------------------------------------------------------------
V = 7


class SparseIn(HybridBlock):
    """``tanh(sparse.dot(x, W))`` then a Dense head."""

    def __init__(self, **kw):
        super(SparseIn, self).__init__(**kw)
        with self.name_scope():
            self.w = self.params.get("w", shape=(V, H))
            self.out = nn.Dense(2, in_units=H)

    def hybrid_forward(self, F, x, w):
        return self.out(F.tanh(F.sparse.dot(x, w)))


def sparse_rows(key, count=6):
    rng = rng_for(key)
    rows = []
    for _ in range(count):
        d = np.zeros((1, V), np.float32)
        at = rng.choice(V, size=int(rng.integers(1, 4)), replace=False)
        d[0, at] = rng.normal(size=len(at))
        rows.append(d)
    return rows


@pytest.mark.parametrize("mixed", [False, True], ids=["csr", "csr-and-dense"])
@POLICY
def test_csr_samples_into_a_flagged_block(policy, mixed):
    """Bag-of-features samples as CSR rows (every other one dense where
    mixed) into a flagged block computing ``F.sparse.dot``; two momentum SGD
    steps. CSR samples run per sample; dense ones merge."""
    rows = sparse_rows("csr")

    def program(net, policy):
        flag(net, policy)
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.5})
        out = []
        for _ in range(2):
            with autograd.record():
                ys = [net(nd.array(d) if mixed and k % 2 == 0 else nd.sparse.csr_matrix(d))
                      for k, d in enumerate(rows)]
                loss = nd.add_n(*[nd.sum(y * y) * (k + 1) for k, y in enumerate(ys)])
            loss.backward()
            out += [y.asnumpy() for y in ys] + grads_of(net)
            tr.step(len(rows))
        return out + params_of(net)
    want, got, st = both(lambda: init(SparseIn(prefix="csr_")), program, policy)
    same(want, got, "CSR samples under %s" % policy)
    if policy in MERGING and mixed:
        assert merged(st), st


class SparseEnc(HybridBlock):
    def __init__(self, **kw):
        super(SparseEnc, self).__init__(**kw)
        with self.name_scope():
            self.emb = nn.Embedding(9, H, sparse_grad=True)
            self.out = nn.Dense(2, in_units=H, flatten=False)

    def hybrid_forward(self, F, ids):
        return self.out(F.tanh(self.emb(ids)))


@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "add"])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
@POLICY
def test_sparse_embedding_gradients_and_lazy_updates(policy, opt, accumulate):
    """Id sequences of 1-4 words into ``Embedding(sparse_grad=True)``; three
    steps of SGD (momentum, weight decay) or Adam (weight decay, lazy
    updates), ``grad_req`` 'write' or 'add' (zeroed after each step); the
    row_sparse gradient's values, storage type and listed rows."""
    rng = rng_for("sparse-emb")
    seqs = [rng.integers(0, 9, size=int(rng.integers(1, 5))).astype(np.float32)
            for _ in range(6)]
    kw = {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01} if opt == "sgd" else \
        {"learning_rate": 0.05, "wd": 0.01}

    def program(net, policy):
        flag(net, policy)
        if accumulate:
            net.collect_params().setattr("grad_req", "add")
        tr = gluon.Trainer(net.collect_params(), opt, kw)
        out = []
        for _ in range(3):
            with autograd.record():
                ys = [net(nd.array(s)) for s in seqs]
                loss = nd.add_n(*[nd.sum(y * y) for y in ys])
            loss.backward()
            g = net.emb.weight.grad()
            out += [y.asnumpy() for y in ys] + [g.asnumpy(), g.stype, g.indices.asnumpy()]
            tr.step(len(seqs))
            if accumulate:
                net.collect_params().zero_grad()
        return out + params_of(net)
    want, got, st = both(lambda: init(SparseEnc(prefix="se_")), program, policy)
    same(want, got, "%s (%s) under %s" % (opt, "add" if accumulate else "write", policy))
    if policy in MERGING:
        assert merged(st), st


@POLICY
def test_sparse_storage_of_lazy_outputs(policy):
    """``tostype('csr')`` / ``tostype('row_sparse')`` of relu outputs (their
    values, indices and storage types), ``sparse.dot`` of a CSR and a lazy
    output; then ``sparse.dot(lazy, csr)`` trained."""
    rng = rng_for("tostype")
    xs = [nd.array(rng.normal(size=(1, 3))) for _ in range(5)]
    proj = nd.sparse.csr_matrix(np.eye(V, 2, dtype=np.float32) * 2)

    def program(net, policy):
        flag(net, policy)
        out = []
        for x in xs:
            y = net(x)
            c, r = y.tostype("csr"), y.tostype("row_sparse")
            z = nd.sparse.dot(c, nd.ones((V, 2)))
            out += [c.asnumpy(), r.asnumpy(), z.asnumpy(), c.indices.asnumpy(), c.stype, r.stype]
        with autograd.record():
            ys = [nd.sparse.dot(net(x), proj) for x in xs]
            loss = nd.add_n(*[nd.sum(y * y) for y in ys])
        loss.backward()
        return out + [y.asnumpy() for y in ys] + grads_of(net)
    want, got, _ = both(lambda: init(nn.Dense(V, in_units=3, activation="relu", prefix="ts_")),
                        program, policy)
    same(want, got, "sparse storage under %s" % policy)


# -- host data -----------------------------------------------------------------------------
@POLICY
def test_python_data_of_every_form_into_nd_array_per_sample(policy):
    """Per sample ``nd.array`` of NumPy views (negative strides, a transposed
    column, Fortran order, a broadcast), bools, int64, uint8, float16, nested
    lists, NumPy float64 scalars, ``array.array``, values past float32's range,
    and explicit dtypes; each into the flagged layer and beside its output."""
    rng = rng_for("host-forms")
    X = rng.normal(size=(6, 3)) * 3
    XF = np.asfortranarray(rng.normal(size=(3, 6)))

    def sources(k):
        return [X[k:k + 1, ::-1], X.T[:, k].reshape(1, 3), XF[:, k:k + 1].T, X[k:k + 1] > 0,
                X[k:k + 1].astype(np.int64), X[k:k + 1].astype(np.uint8),
                X[k:k + 1].astype(np.float16), [list(X[k])], [[np.float64(v) for v in X[k]]],
                X[k:k + 1] * 1e39, np.broadcast_to(X[k:k + 1, :1], (1, 3)),
                array.array("f", X[k])]

    def program(net, policy):
        flag(net, policy)
        out = []
        for k in range(6):
            y = net(nd.array(X[k:k + 1]))
            for j, s in enumerate(sources(k)):
                a = nd.array(s)
                a = a.reshape((1, -1)) if a.ndim == 1 else a
                out += [net(a) + y * (j + 1), a, str(a.dtype)]
            for dt in ("int32", "float64", "float16", np.int64):
                a = nd.array(X[k:k + 1], dtype=dt)
                out += [a, str(a.dtype), a * 2, net(a.astype("float32")) * 1.5 + y]
        return [o if isinstance(o, str) else o.asnumpy().astype(np.float64) for o in out]
    want, got, st = both(lambda: init(nn.Dense(2, in_units=3, prefix="hf_")), program, policy)
    assert len(want) == len(got)
    for i, (a, b) in enumerate(zip(want, got)):
        if isinstance(a, str):
            assert a == b, (i, a, b)
        else:
            np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-5, err_msg=str(i))
    if policy in MERGING:
        assert merged(st), st


#: per (tree, node): the state a freed tree node logged
TRACE = {}


class LoggedNode(object):
    """A tree node with a parent pointer (a reference cycle: the cyclic GC
    frees it) that logs its state when freed (a debugging trace)."""

    def __init__(self, parent, key):
        self.parent, self.children, self.key, self.state = parent, [], key, None
        if parent is not None:
            parent.children.append(self)

    def __del__(self):
        if self.state is not None:
            TRACE[self.key] = self.state.asnumpy().copy()


def encode_logged(net, node, x, kept):
    kids = [encode_logged(net, c, x, kept) for c in node.children]
    h = net(x[node.key[1]:node.key[1] + 1])
    if kids:
        h = h + nd.add_n(*kids)
    node.state = h
    kept.append(h)      # (MXNet frees an array in the same garbage before the node reads it)
    return h


@POLICY
def test_tree_nodes_freed_by_the_gc_log_their_states(policy):
    """Ten minibatches of four trees of 2-6 nodes; each node (a
    ``LoggedNode``, freed by the cyclic GC some time after its tree is
    encoded) logs its state from ``__del__``; the roots' sum read per
    minibatch. Python's default GC thresholds; run four times, the GC's
    count shifted by 0, 175, 350 and 525 live objects (where collections
    fall depends on it); ``gc.collect()`` after each run. Until 2026-11-26 the
    GC also ran inside flushes: a node's ``__del__`` read a state of the graph
    being executed and got a StaleValueError that said it was recorded while
    that graph was executing (it was not); Python ignores errors in
    ``__del__``, so the trace silently missed nodes. No collection runs while
    a flush does now (``gcdefer.pause``)."""
    rng = rng_for("gc-trees")
    trees = []
    for b in range(10):
        for t in range(4):
            n = int(rng.integers(2, 7))
            trees.append((b * 4 + t, nd.array(rng.normal(size=(n, 3))),
                          [None] + [int(rng.integers(0, i)) for i in range(1, n)]))

    def program(net, policy):
        flag(net, policy)
        old = gc.get_threshold()
        gc.set_threshold(700, 10, 10)
        out = []
        try:
            for phase in (0, 175, 350, 525):
                TRACE.clear()
                kept = []
                gc.collect()
                shift = [[] for _ in range(phase)]
                for b in range(10):
                    roots = []
                    for key, x, par in trees[4 * b:4 * b + 4]:
                        nodes = []
                        for i, p in enumerate(par):
                            nodes.append(LoggedNode(None if p is None else nodes[p], (key, i)))
                        roots.append(encode_logged(net, nodes[0], x, kept))
                        del nodes
                    out.append(nd.add_n(*roots).asnumpy())
                del shift
                gc.collect()
                out += [np.array(sorted(TRACE))] + [TRACE[k] for k in sorted(TRACE)]
        finally:
            gc.set_threshold(*old)
        return out
    want, got, _ = both(lambda: init(nn.Dense(3, in_units=3, activation="tanh", prefix="gc_")),
                        program, policy)
    same(want, got, "states logged by freed nodes under %s" % policy)


STRESS = r"""
import gc, threading, warnings
import numpy as np, mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import nn
import jitbatch
warnings.simplefilter("ignore")
jitbatch.config.pipeline = False
H = 4

class RowTanh(mx.operator.CustomOp):
    def forward(self, is_train, req, in_data, out_data, aux):
        self.assign(out_data[0], req[0], nd.tanh(in_data[0]) + 0.1 * in_data[0])
    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        t = nd.tanh(in_data[0])
        self.assign(in_grad[0], req[0], out_grad[0] * (1.1 - t * t))

@mx.operator.register("stress_rowtanh")
class RowTanhProp(mx.operator.CustomOpProp):
    def __init__(self):
        super().__init__(need_top_grad=True)
    def list_arguments(self): return ["data"]
    def list_outputs(self): return ["output"]
    def infer_shape(self, s): return s, [s[0]], []
    def create_operator(self, ctx, shapes, dtypes): return RowTanh()

def train(seed, policy, batches, mapped, res):
    mx.random.seed(seed)
    a = nn.Dense(H, in_units=3, prefix="a%d_" % seed)
    b = nn.Dense(1, in_units=H, prefix="b%d_" % seed)
    params = gluon.ParameterDict()
    for n in (a, b):
        n.initialize(mx.init.Uniform(0.5))
        if policy:
            n.hybridize(dynamic_batch=True, policy=policy)
        params.update(n.collect_params())
    tr = gluon.Trainer(params, "sgd", {"learning_rate": 0.05})
    rng = np.random.default_rng(seed)
    out = []
    for i in range(batches):
        data = [rng.normal(size=(int(rng.integers(1, 3)), 3)) for _ in range(3)]
        weights = [float(w) for w in rng.uniform(0.5, 1.5, size=3)]
        def sample(k):
            x = nd.array(data[k])
            h = nd.Custom(a(x), op_type="stress_rowtanh")
            s = b(h) * weights[k] / len(data)
            if k == 0 and i % 7 == 0:
                gc.collect()
            if k == 1:
                nd.waitall()
            if k == 2:
                s.wait_to_read()
            v = float(s.asnumpy().sum())
            return nd.sum(s * s) + (v if v > 0 else -v)
        with autograd.record():
            ls = jitbatch.map(sample, range(3)) if mapped else [sample(k) for k in range(3)]
            loss = nd.add_n(*ls)
        loss.backward()
        tr.step(3)
        out.append(loss.asscalar())
    res[seed] = out + [p.data().asnumpy() for p in params.values()]

def run(policy, threads, batches, mapped):
    res = {}
    ts = [threading.Thread(target=train, args=(s, policy, batches, mapped, res))
          for s in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return [v for s in sorted(res) for v in res[s]]

def same(want, got):
    return len(want) == len(got) and all(
        np.allclose(g, w, rtol=1e-4, atol=1e-5) for w, g in zip(want, got))

print("map", same(run(None, 1, 200, True), run("auto", 1, 200, True)), flush=True)
print("threads", same(run(None, 3, 30, False), run("depth", 3, 30, False)), flush=True)
print("pending", jitbatch.stats()["pending"])
"""


def test_two_hundred_minibatches_with_reads_gc_and_threads_finish_and_match():
    """A watched subprocess (120 s): 200 minibatches under ``jitbatch.map``
    ('auto'), each sample an ``nd.array`` of NumPy data, a custom operator
    between two flagged layers, a per-sample Python weight, ``gc.collect()``,
    ``nd.waitall()``, ``wait_to_read`` and an ``asnumpy`` read it branches
    on; then three threads each training its own flagged model ('depth').
    Both finish, with plain Gluon's losses and parameters."""
    status, out, err = run_in_subprocess(STRESS)
    assert status == 0, err[-3000:]
    assert "map True" in out and "threads True" in out and "pending 0" in out, out + err[-2000:]


FORKS = r"""
import json, multiprocessing as mp, warnings
import numpy as np, mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import nn
from mxnet.gluon.data import DataLoader, SimpleDataset
import jitbatch
warnings.simplefilter("ignore")
jitbatch.config.pipeline = False
X = np.random.default_rng(30).normal(size=(8, 3)).astype(np.float32)

def item(i):
    return nd.array(X[i]) * 2.0 + 1.0, nd.array([float(i % 3)])

def step(net, tr):
    with autograd.record():
        loss = nd.add_n(*[nd.sum(net(nd.array(X[k:k + 1])) ** 2) * (k + 1) for k in range(4)])
    loss.backward()
    tr.step(4)
    return [loss.asnumpy().tolist()] + [p.data().asnumpy().tolist()
                                        for p in net.collect_params().values()]

def program(policy):
    mx.random.seed(0)
    net = nn.Dense(2, in_units=3, prefix="fk_")
    net.initialize(mx.init.Uniform(0.5))
    if policy:
        net.hybridize(dynamic_batch=True, policy=policy)
    tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    pend = [net(nd.array(X[k:k + 1])) * (k + 1) for k in range(3)]
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    def child():
        try:
            q.put([p.asnumpy().tolist() for p in pend] + step(net, tr))
        except Exception as e:
            q.put(repr(e))
    proc = ctx.Process(target=child)
    proc.start()
    theirs = q.get(timeout=60)
    proc.join(30)
    more = [net(nd.array(X[k:k + 1])) - k for k in range(3)]
    loader = DataLoader(SimpleDataset(list(range(8))).transform(item), batch_size=4,
                        num_workers=2)
    batches = [[xb.asnumpy().tolist(), yb.asnumpy().tolist()] for xb, yb in loader]
    del loader
    mine = [p.asnumpy().tolist() for p in pend] + step(net, tr)
    return {"child": theirs, "parent": mine, "exit": proc.exitcode,
            "more": [m.asnumpy().tolist() for m in more], "batches": batches}

def flat(v):
    if isinstance(v, str):
        return v
    if isinstance(v, (list, tuple)):
        return np.concatenate([flat(x) for x in v] or [np.zeros(0)])
    return np.array([float(v)])

def agree(a, b):
    fa, fb = flat(a), flat(b)
    if isinstance(fa, str) or isinstance(fb, str):
        return False
    return fa.shape == fb.shape and np.allclose(fa, fb, rtol=1e-5, atol=1e-6)

want = program(None)
for policy in ["auto", "depth", "agenda", "sequential"]:
    got = program(policy)
    ok = got["exit"] == 0 and all(agree(got[k], want[k]) for k in ("child", "parent", "more"))
    ok = ok and got["batches"] == want["batches"] and agree(got["child"], got["parent"])
    print(policy, "same" if ok else "DIFFERENT %r" % (got,), flush=True)
"""


def test_a_fork_and_dataloader_workers_while_predictions_pend():
    """A watched subprocess: per policy, predictions pend while a
    ``multiprocessing`` fork child reads them and trains a step (sending its
    numbers back), then the parent does the same; a ``DataLoader`` with two
    forked workers, whose dataset makes ``nd.array``s with Python arithmetic,
    is made while predictions pend. Child and parent agree, and every policy
    gives plain Gluon's numbers and batches."""
    status, out, err = run_in_subprocess(FORKS)
    assert status == 0, err[-3000:]
    for policy in POLICIES:
        assert "%s same" % policy in out, out + err[-2000:]


# -- DataLoader batches on cpu_shared ---------------------------------------------------------
@pytest.fixture(scope="module")
def worker_batches():
    """Batches of a ``DataLoader`` with two worker processes (on
    ``cpu_shared(0)``, as MXNet's workers hand them over): sequences of 4
    steps of 3 features and a target each."""
    rng = rng_for("dataloader")
    X = rng.normal(size=(8, 4, 3)).astype(np.float32)
    Y = rng.normal(size=(8, 1)).astype(np.float32)
    loader = DataLoader(ArrayDataset(X, Y), batch_size=4, num_workers=2)
    batches = list(loader)
    del loader
    assert all(xb.context.device_type == "cpu_shared" for xb, _ in batches)
    return batches


@pytest.mark.parametrize("model", ["gru-cell", "dense"])
@POLICY
def test_dataloader_worker_batches_fed_one_sample_at_a_time(policy, model, worker_batches):
    """Per sample of each worker batch: a flagged GRU cell over its steps from
    an ``nd.zeros`` begin state, or a flagged Dense over its first step; a
    flagged head; squared error against the batch's target; an SGD step per
    batch, two epochs. Outputs (and their contexts: plain Gluon's are
    cpu(0)), losses and parameters. Until 2026-11-26 ``cpu_shared(0)`` was
    taken for another device than the CPU: a BatchingError for the cell's
    ``nd.zeros`` state (its fix named the wrong device), an ExecutionError
    from MXNet's CachedOp for a launch of one call, and merged outputs on
    ``cpu_shared(0)``. Shared memory is the CPU's now, as pinned memory was."""
    def make():
        body = rnn.GRUCell(H, input_size=3, prefix="dlc_") if model == "gru-cell" else \
            nn.Dense(H, in_units=3, activation="tanh", prefix="dld_")
        return [init(body), init(nn.Dense(1, in_units=H, prefix="dlh_"))]

    def program(nets, policy):
        body, head = nets
        flag_all(nets, policy)
        tr = gluon.Trainer(params_dict(*nets), "sgd", {"learning_rate": 0.05})
        out = []
        for _ in range(2):
            for xb, yb in worker_batches:
                with autograd.record():
                    ys = []
                    for i in range(xb.shape[0]):
                        if model == "gru-cell":
                            h = [nd.zeros((1, H))]
                            for t in range(1 + i % 4):
                                o, h = body(xb[i, t:t + 1], h)
                        else:
                            o = body(xb[i, 0:1])
                        ys.append(head(o))
                    loss = nd.add_n(*[nd.sum((y - yb[i:i + 1]) ** 2) for i, y in enumerate(ys)])
                loss.backward()
                tr.step(xb.shape[0])
                out += [y.asnumpy() for y in ys] + [str(y.context) for y in ys] + \
                    [loss.asnumpy()]
        return out + params_of(*nets)
    want, got, _ = both(make, program, policy)
    same(want, got, "%s over DataLoader worker batches under %s" % (model, policy))


# -- static memory -------------------------------------------------------------------------
class Residual(HybridBlock):
    def __init__(self, **kw):
        super(Residual, self).__init__(**kw)
        with self.name_scope():
            self.d = nn.Dense(H, in_units=H)

    def hybrid_forward(self, F, h, x):
        return F.tanh(h + self.d(x))


@pytest.mark.parametrize("static_shape", [False, True])
@POLICY
def test_static_alloc_with_dynamic_batch_trains_as_per_sample(policy, static_shape):
    """``hybridize(static_alloc=True, static_shape=..., dynamic_batch=True)``
    of a residual recurrence over ragged sequences (state from ``nd.zeros``),
    three Adam steps, predictions after each. Plain
    ``hybridize(static_alloc=True)`` gets wrong gradients here (MXNet 1.9.1);
    the flagged block must get plain Gluon's."""
    seqs = ragged("static", 5, width=H, hi=5)

    def program(net, policy):
        if policy is None:
            net.hybridize(active=False)
        else:
            net.hybridize(static_alloc=True, static_shape=static_shape, dynamic_batch=True,
                          policy=policy)
        tr = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.05})
        out = []
        for _ in range(3):
            with autograd.record():
                ys = []
                for s in seqs:
                    h = nd.zeros((1, H))
                    for t in range(s.shape[0]):
                        h = net(h, s[t:t + 1])
                    ys.append(h)
                loss = nd.add_n(*[nd.sum(y * y) for y in ys])
            loss.backward()
            out += [y.asnumpy() for y in ys] + grads_of(net)
            tr.step(len(seqs))
            out += [net(nd.zeros((1, H)), s[0:1]).asnumpy() for s in seqs]
        return out + params_of(net)
    want, got, st = both(lambda: init(Residual(prefix="res_")), program, policy)
    same(want, got, "static_alloc (static_shape=%s) under %s" % (static_shape, policy))
    if policy in MERGING:
        assert merged(st), st


# -- memory written outside MXNet's operators (added with the fixes) ------------------------
def _numpy_view_of(capsule, shape):
    """A NumPy array over the memory of a DLPack ``capsule`` of float32: what
    another library writing through ``nd.to_dlpack_for_write`` writes."""
    import ctypes
    from mxnet.ndarray import ndarray as impl
    ctypes.pythonapi.PyCapsule_GetPointer.restype = ctypes.c_void_p
    ctypes.pythonapi.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    managed = impl.DLManagedTensor.from_address(
        ctypes.pythonapi.PyCapsule_GetPointer(capsule, b"dltensor"))
    ptr = ctypes.cast(managed.dl_tensor.data, ctypes.POINTER(ctypes.c_float))
    return np.ctypeslib.as_array(ptr, shape=shape)


@POLICY
def test_a_buffer_written_by_another_library_through_to_dlpack_for_write(policy):
    """Until 2026-11-26 pending calls that read a buffer ran after another
    library wrote it through ``nd.to_dlpack_for_write`` (MXNet waits there for
    the reads issued before; no hook saw the write): they read the new values.
    ``to_dlpack_for_write`` is a write now: the readers run first."""
    xs = ragged("dlpack-foreign", count=4, hi=1)

    def program(net, policy):
        flag(net, policy)
        buf = nd.ones((2, H)) * 0.25
        ys = []
        for k, x in enumerate(xs):
            h = net(x)
            ys.append(nd.broadcast_add(h, buf[0:1]) * (k + 1) + buf[1:2])
            capsule = nd.to_dlpack_for_write(buf)
            _numpy_view_of(capsule, (2, H))[:] = k - 1.5
            del capsule
        return [y.asnumpy() for y in ys] + [buf.asnumpy()]
    want, got, _ = both(lambda: init(nn.Dense(H, in_units=3, activation="tanh")), program,
                        policy)
    same(want, got, "to_dlpack_for_write under %s" % policy)


@POLICY
def test_a_long_lived_dlpack_alias_written_while_calls_read_its_source(policy):
    """An alias of ``buf`` made once (``nd.from_dlpack``) has an engine variable
    of its own, so MXNet orders nothing between its writes and reads of
    ``buf``. Per sample the reads were issued well before; until 2026-11-26 a
    write through the alias ran the pending readers of the overlapping memory
    but did not wait for them, and the engine ran the write first (the readers
    waited behind their own producers): they read the new values. The
    reference waits after each sample (a well-defined plain program); the
    flagged one does not, and must compute what each call was called with."""
    xs = ragged("dlpack-alias", count=5, hi=1)

    def program(net, policy):
        flag(net, policy)
        buf = nd.ones((3, H)) * 0.5
        alias = nd.from_dlpack(nd.to_dlpack_for_write(buf))
        ys = []
        for k, x in enumerate(xs):
            h = net(x)
            ys += [nd.add_n(h, buf[k % 3:k % 3 + 1], buf[0:1]) * (k + 1)]
            if policy is None:
                nd.waitall()
            alias[:] = k * 0.5 - 1
            alias.wait_to_read()
        return [y.asnumpy() for y in ys] + [buf.asnumpy()]
    want, got, _ = both(lambda: init(nn.Dense(H, in_units=3, activation="tanh")), program,
                        policy)
    same(want, got, "a long-lived alias under %s" % policy)


def test_a_dlpack_alias_written_while_an_operator_run_at_its_call_still_reads_the_source():
    """Operators whose arguments are all computed run at their call, and so do
    a flagged block's calls once 'auto' found nothing to merge (the test above
    reaches that window). Until 2026-11-27 a write through the alias did not
    wait for such an operator still queued behind a slow producer: the engine
    ran the write first, and the operator read the new values (about 1 run in
    100 of the test above under 'auto'). A write to memory handed out by
    ``to_dlpack_for_write`` now waits for every operator in flight."""
    rng = np.random.default_rng(30)
    a = nd.array(rng.normal(size=(1500, 1500)).astype("float32") / 40)
    buf = nd.ones((2, H)) * 0.5
    alias = nd.from_dlpack(nd.to_dlpack_for_write(buf))
    want = (nd.dot(a, a)[0:1, :H].asnumpy() + 0.5) * 3
    y = (nd.dot(a, a)[0:1, :H] + buf[0:1]) * 3   # queued behind the product
    alias[:] = 7.0
    np.testing.assert_allclose(y.asnumpy(), want, rtol=1e-4, atol=1e-4)
    # MXNet orders the alias's write only on the alias's engine variable, so a
    # read of buf waits for it only after the write is waited for (plain MXNet too)
    alias.wait_to_read()
    np.testing.assert_array_equal(buf.asnumpy(), np.full((2, H), 7.0, "float32"))
