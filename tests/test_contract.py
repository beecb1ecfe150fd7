"""The batch-axis contract (issue 19): ordinary per-sample programs, written as a
user would write them, give plain per-sample Gluon's numbers batched (outputs,
gradients and parameters after the run) under every policy (and granularity
where a block is recursive), or a clear jitbatch error naming the block or
operator and the fix, or - for writes inside ``autograd.record`` - MXNet's own
error; never silently different numbers. The oracle is ``tests/oracle.py``.

Classes: operators across samples inside a flagged block (BatchNorm in training
mode, centring / softmax / sort / max / sum over axis 0, ``norm`` without an
axis; per-sample rows and ragged ``(T, H)`` inputs; a recursive cell;
``contrib.foreach`` over a ``(T, H)`` input), random operators (one draw per
sample), in-place writes after recording, negative-step slices, ``relu`` of
NaN under ``config.fast_activations``, the GC pause of an abandoned graph,
memory held by small kept results, mixed contexts after a first run, lazy
arrays of another thread as block inputs, ``npx.set_np``, printing and
``nd.waitall`` as forcing points."""
import gc
import io
import re
import threading
import types
from contextlib import redirect_stdout

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import HybridBlock, nn

import jitbatch
from models import ScanRNN
from oracle import FIX, check, cleanup, gc_left_enabled_after_abandoning

pytestmark = pytest.mark.filterwarnings("ignore::jitbatch.ContractWarning")

POLICIES = ["sequential", "depth", "agenda", "auto"]
GRANULARITIES = ["block", "split", "auto"]
H = 4


@pytest.fixture(autouse=True)
def _clean():
    cleanup()
    gc_was = gc.isenabled()
    yield
    try:
        mx.npx.reset_np()
    finally:
        cleanup()
        if gc_was:
            gc.enable()


def _init(net, seed=0):
    mx.random.seed(seed)
    net.initialize(mx.init.Uniform(0.7))
    return net


def _rows(seed, n, t=1, h=H, lengths=None):
    """Per-sample inputs: ``n`` arrays of shape (t, h), or (lengths[i], h)."""
    rng = np.random.default_rng(seed)
    return [nd.array(rng.normal(size=((lengths[i] if lengths else t), h))) for i in range(n)]


# -- operators across samples inside a flagged block ---------------------------------------
class BNBlock(HybridBlock):
    def __init__(self, **kw):
        super(BNBlock, self).__init__(**kw)
        with self.name_scope():
            self.d = nn.Dense(H, in_units=H, flatten=False)
            self.bn = nn.BatchNorm(in_channels=H)

    def hybrid_forward(self, F, x):
        return self.bn(self.d(x))


@pytest.mark.parametrize("policy", POLICIES)
def test_batchnorm_training_mode_matches_per_sample(policy):
    """BatchNorm in training mode normalises over the rows of ONE sample (3 rows
    here); merged it would normalise over every sample's rows and update the
    running mean once instead of once per sample. Compared: outputs, gradients,
    and the running mean and variance after the minibatch."""
    net = _init(BNBlock())
    xs = _rows(1, 5, t=3)
    check(net, lambda net: [net(x) for x in xs], policy, culprit=r"bnblock\d+|BatchNorm",
          what="BatchNorm in training mode, policy=%s" % policy)


AXIS0 = {
    "centre": lambda F, y: F.broadcast_sub(y, F.mean(y, axis=0, keepdims=True)),
    "softmax": lambda F, y: F.softmax(y, axis=0),
    "sort": lambda F, y: F.sort(y, axis=0),
    "max": lambda F, y: F.broadcast_sub(y, F.max(y, axis=0, keepdims=True)),
    "sum": lambda F, y: F.broadcast_mul(y, F.sum(y, axis=0, keepdims=True)),
    "norm": lambda F, y: F.broadcast_div(y, F.norm(y)),
}
AXIS0_OP = {"centre": "mean", "softmax": "softmax", "sort": "sort", "max": "max", "sum": "sum",
            "norm": "norm"}


class Axis0(HybridBlock):
    """A projection, then an operator over axis 0 (the user's per-sample axis)."""

    def __init__(self, op, **kw):
        super(Axis0, self).__init__(**kw)
        self.op = op
        with self.name_scope():
            self.d = nn.Dense(H, in_units=H, flatten=False)

    def hybrid_forward(self, F, x):
        return AXIS0[self.op](F, self.d(x))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("layout", ["rows", "ragged"])
@pytest.mark.parametrize("op", sorted(AXIS0))
def test_operators_over_axis0_act_within_one_sample(op, layout, policy):
    """``rows``: per-sample (1, H) inputs (the documented layout); ``ragged``:
    per-sample (T, H) inputs of lengths 2..4, which ragged merging accepts. Per
    sample the operator acts over that sample's rows only."""
    net = _init(Axis0(op))
    xs = _rows(2, 5, lengths=[2, 3, 4, 3, 2] if layout == "ragged" else None)
    check(net, lambda net: [net(x) for x in xs], policy,
          culprit=r"axis0\d+|%s" % AXIS0_OP[op],
          what="%s over axis 0 on %s inputs, policy=%s" % (op, layout, policy))


class TimeMajor(HybridBlock):
    """A projection run time-major: the sample ``(1, T, H)`` transposed to
    ``(T, 1, H)`` (merged samples along axis 1), reshaped to ``(T, H)`` and
    back (``interleave``: to ``(T/2, 2, H)`` for a softmax over pairs of
    steps; merged, that axis would hold the samples)."""

    def __init__(self, interleave, **kw):
        super(TimeMajor, self).__init__(**kw)
        self.interleave = interleave
        with self.name_scope():
            self.d = nn.Dense(H, in_units=H, flatten=False)

    def hybrid_forward(self, F, x):
        y = F.transpose(self.d(x), axes=(1, 0, 2))
        if self.interleave:
            y = F.reshape_like(F.softmax(F.reshape(y, shape=(-1, 2, H)), axis=1), y)
        else:
            y = F.reshape(F.tanh(F.reshape(y, shape=(0, -3))), shape=(0, -4, -1, H))
        return F.transpose(y, axes=(1, 0, 2))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("interleave", [False, True], ids=["apart", "interleaved"])
def test_reshapes_of_samples_off_axis_0(interleave, policy):
    """Merged, the samples lie along axis 1 after the transpose: the reshapes
    to ``(T, H)`` and back keep each sample's elements together (the calls
    merge), the one to ``(T/2, 2, H)`` interleaves them (one call per
    sample, a ContractWarning naming the Reshape)."""
    net = _init(TimeMajor(interleave))
    xs = [nd.array(np.random.default_rng(k).normal(size=(1, 4, H))) for k in range(5)]
    jitbatch.reset_stats()
    with pytest.warns(jitbatch.ContractWarning, match="Reshape") if interleave else \
            _no_contract_warning():
        check(net, lambda net: [net(x) for x in xs], policy)
    st = jitbatch.stats()
    if policy in ("depth", "agenda"):
        # 5 block calls and the oracle's 16 loss operators (4 launches): the
        # block's calls in one launch, or one each
        assert (st["nodes"], st["launches"]) == (21, 9 if interleave else 5), st


class _no_contract_warning(object):
    def __enter__(self):
        import warnings
        self.catch = warnings.catch_warnings(record=True)
        self.record = self.catch.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self.catch.__exit__(*exc)
        got = [w for w in self.record if issubclass(w.category, jitbatch.ContractWarning)]
        assert not got, [str(w.message) for w in got]


class CentringCell(HybridBlock):
    """A recurrent cell over a two-row state that centres over its rows: it reads
    its own earlier outputs (recursive: ``granularity='split'`` cuts off the input
    projection)."""

    def __init__(self, **kw):
        super(CentringCell, self).__init__(**kw)
        with self.name_scope():
            self.i2h = nn.Dense(H, in_units=H, flatten=False)
            self.h2h = nn.Dense(H, in_units=H, flatten=False, use_bias=False)

    def hybrid_forward(self, F, x, h):
        g = F.tanh(self.i2h(x) + self.h2h(h))
        return F.broadcast_sub(g, 0.5 * F.mean(g, axis=0, keepdims=True))


class Chain(gluon.Block):
    def __init__(self, cell, state_rows, width=H, **kw):
        super(Chain, self).__init__(**kw)
        self.rows = state_rows
        self.width = width
        with self.name_scope():
            self.cell = cell

    def forward(self, seq):          # seq: (steps * rows, H), one sample
        h = nd.zeros((self.rows, self.width))
        for t in range(seq.shape[0] // self.rows):
            h = self.cell(seq[t * self.rows:(t + 1) * self.rows], h)
        return h


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("policy", POLICIES)
def test_recursive_cell_centring_over_axis0(policy, granularity):
    net = _init(Chain(CentringCell(), 2))
    xs = _rows(3, 4, lengths=[2 * k for k in (3, 1, 2, 3)])
    check(net, lambda net: [net(x) for x in xs], policy, granularity,
          culprit=r"centringcell\d+|mean",
          what="recursive cell centring over axis 0, policy=%s granularity=%s"
          % (policy, granularity))


@pytest.mark.parametrize("policy", POLICIES)
def test_foreach_rnn_over_a_per_sample_sequence(policy):
    """Merged, one ``foreach`` would run over all samples' rows and each sample
    would start from the previous sample's last state."""
    net = _init(ScanRNN(H))
    xs = _rows(4, 4, lengths=[3, 5, 2, 4])
    check(net, lambda net: [net(x) for x in xs], policy, culprit=r"scanrnn\d+|foreach",
          what="contrib.foreach RNN, policy=%s" % policy)


# -- random operators: one draw per sample -------------------------------------------------
WIDE = 64


class AxisDropout(HybridBlock):
    def __init__(self, **kw):
        super(AxisDropout, self).__init__(**kw)
        with self.name_scope():
            self.drop = nn.Dropout(0.5, axes=(0,))

    def hybrid_forward(self, F, x):
        return self.drop(x)


class Noise(HybridBlock):
    def hybrid_forward(self, F, x):
        return F.broadcast_add(x, F.random.normal(shape=(1, WIDE)))


class DropoutCell(HybridBlock):
    """Recursive: dropout (shared over axis 0) on the input projection."""

    def __init__(self, **kw):
        super(DropoutCell, self).__init__(**kw)
        with self.name_scope():
            self.i2h = nn.Dense(WIDE, in_units=WIDE, weight_initializer=mx.init.One(),
                                bias_initializer="ones")
            self.drop = nn.Dropout(0.5, axes=(0,))

    def hybrid_forward(self, F, x, h):
        return self.drop(self.i2h(x) * 0 + 1) + 0 * h


def _agreement(draws):
    """Mean fraction of equal entries over all pairs of samples' draws."""
    flat = [d.reshape(-1) for d in draws]
    pairs = [(a == b).mean() for i, a in enumerate(flat) for b in flat[i + 1:]]
    return float(np.mean(pairs))


def _random_draws(net, xs, extract, policy, granularity, seed):
    """Run per sample under ``autograd.record`` (training mode), return each
    sample's draw as numpy, or the exception the batched run raised."""
    mx.random.seed(seed)
    if policy is None:
        net.hybridize(active=False)
    else:
        net.hybridize(dynamic_batch=True, policy=policy, granularity=granularity)
    try:
        with autograd.record():
            ys = [net(x) for x in xs]
        return [extract(x.asnumpy(), y.asnumpy()) for x, y in zip(xs, ys)]
    except jitbatch.JitBatchError as e:
        return e
    finally:
        cleanup()
        net.hybridize(active=False)


def _check_per_sample_draws(net, xs, extract, valid, policy, granularity, culprit, what,
                            independent):
    """Plain Gluon draws per sample: pairwise agreement ``independent`` (0.5 for
    Bernoulli masks, 0 for normal noise). Batched, each merged sample must get
    its own draw (or a clear error)."""
    plain = _random_draws(net, xs, extract, None, granularity, seed=11)
    assert not isinstance(plain, Exception), plain
    base = _agreement(plain)
    assert abs(base - independent) < 0.2, ("test bug: plain Gluon's draws agree %.3f" % base)
    got = _random_draws(net, xs, extract, policy, granularity, seed=11)
    if isinstance(got, Exception):
        assert re.search(culprit, str(got)) and re.search(FIX, str(got)), (
            "%s: unclear error %s: %s" % (what, type(got).__name__, got))
        return
    for d in got:
        assert valid(d), "%s: not a draw of the operator: %s" % (what, d)
    agree = _agreement(got)
    assert abs(agree - independent) < 0.2, (
        "%s: merged samples share their random draw: pairwise agreement %.3f (plain Gluon, "
        "one draw per sample: %.3f): silently different" % (what, agree, base))


@pytest.mark.parametrize("policy", POLICIES)
def test_dropout_shared_over_axis0_draws_a_mask_per_sample(policy):
    net = AxisDropout()
    net.initialize()
    xs = [nd.ones((1, WIDE)) for _ in range(8)]
    _check_per_sample_draws(net, xs, lambda x, y: y != 0,
                            lambda m: m.dtype == bool, policy, "auto",
                            r"axisdropout\d+|[Dd]ropout", "Dropout(axes=(0,)), policy=%s" % policy,
                            independent=0.5)


@pytest.mark.parametrize("policy", POLICIES)
def test_random_normal_in_a_block_draws_per_sample(policy):
    net = Noise()
    net.initialize()
    xs = [nd.array(np.full((1, WIDE), float(i))) for i in range(8)]
    _check_per_sample_draws(net, xs, lambda x, y: y - x,
                            lambda d: np.isfinite(d).all() and 0.3 < d.std() < 3,
                            policy, "auto", r"noise\d+|normal",
                            "random.normal(shape=(1, H)), policy=%s" % policy, independent=0.0)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("policy", POLICIES)
def test_dropout_in_a_recursive_cell_draws_per_call(policy, granularity):
    """Each call's mask is its own (chains of 2 steps; under 'split' the dropout
    is in the input stage that runs for every call at once)."""
    cell = DropoutCell()
    net = Chain(cell, 1, WIDE)
    net.initialize()
    xs = [nd.ones((2, WIDE)) for _ in range(6)]

    def extract(x, y):
        return y != 0
    _check_per_sample_draws(net, xs, extract, lambda m: m.dtype == bool, policy, granularity,
                            r"dropoutcell\d+|[Dd]ropout",
                            "Dropout in a recursive cell, policy=%s granularity=%s"
                            % (policy, granularity), independent=0.5)


# -- writes after recording ------------------------------------------------------------------
class Cell1(HybridBlock):
    def __init__(self, **kw):
        super(Cell1, self).__init__(**kw)
        with self.name_scope():
            self.d = nn.Dense(H, in_units=H)

    def hybrid_forward(self, F, x):
        return F.tanh(self.d(x))


def _reused_buffer(xs):
    def program(net):
        buf = nd.zeros((1, H))
        outs = []
        for x in xs:
            buf[:] = x                  # the next sample into the same buffer
            outs.append(net(buf))
        return outs
    return program


def _state_plus_equals(xs):
    def program(net):
        state = nd.zeros((1, H))
        outs = []
        for x in xs:
            outs.append(net(state))
            state += x
        return outs + [state * 1]
    return program


def _copyto(xs):
    def program(net):
        buf = nd.zeros((1, H))
        outs = []
        for x in xs:
            outs.append(net(buf))
            x.copyto(buf)
        return outs
    return program


def _set_data_before_reading(xs):
    def program(net):
        preds = [net(x) for x in xs]
        w = net.d.weight
        w.set_data(w.data() * 0.5)     # an update before the predictions are read
        return preds
    return program


def _write_into_lazy(xs):
    def program(net):
        ys = [net(x) for x in xs]
        zs = [net(y) for y in ys]       # pending calls that read ys (not computed yet)
        for y in ys:
            y += 1.0
        return zs + ys
    return program


def _write_into_read_lazy(xs):
    def program(net):
        ys = [net(x) for x in xs]
        for y in ys:
            y.asnumpy()                 # computed: rows of a merged launch's output
        zs = [net(y) for y in ys]       # pending calls that read ys
        for y in ys:
            y += 1.0
        return zs + ys
    return program


def _write_into_made_array(xs):
    def program(net):
        first = net(xs[0])              # pending: the arrays made next are recorded
        c = nd.ones((1, H)) * 0.5
        outs = [first, net(c)]          # a pending call reads c
        c += xs[1]
        return outs + [c * 1.0]
    return program


WRITES = {"reused_buffer": _reused_buffer, "state_plus_equals": _state_plus_equals,
          "write_into_made_array": _write_into_made_array,
          "copyto": _copyto, "set_data_before_reading": _set_data_before_reading,
          "write_into_lazy_array": _write_into_lazy,
          "write_into_read_lazy_array": _write_into_read_lazy}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("inside_record", [False, True], ids=["outside_record", "inside_record"])
@pytest.mark.parametrize("kind", sorted(WRITES))
def test_writes_after_recording_never_change_what_a_pending_call_sees(kind, inside_record,
                                                                      policy):
    """Outside ``autograd.record``: plain Gluon's numbers (the pending call sees
    the value at its call). Inside: plain MXNet refuses the write
    (``inplace operations ... inside a record section``); so must jitbatch."""
    net = _init(Cell1())
    xs = _rows(5, 4)
    check(net, WRITES[kind](xs), policy, train=inside_record, culprit=r"cell1\d+|write",
          what="%s %s autograd.record, policy=%s"
          % (kind, "inside" if inside_record else "outside", policy))


# -- negative-step slices ---------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("key", ["rows_reversed", "columns_step_minus_2"])
def test_negative_step_slices_of_lazy_arrays(key, n, train, policy):
    net = _init(nn.Dense(H, in_units=H, flatten=False))
    xs = _rows(6, n, t=3)
    index = {"rows_reversed": (slice(None, None, -1),),
             "columns_step_minus_2": (slice(None), slice(None, None, -2))}[key]

    def program(net):
        return [net(x)[index if len(index) > 1 else index[0]] for x in xs]
    check(net, program, policy, train=train, culprit=r"slice|step",
          what="y[%s] for %d sample(s), %s, policy=%s"
          % (key, n, "training" if train else "inference", policy))


# -- relu of NaN ------------------------------------------------------------------------------
class Relu(HybridBlock):
    def __init__(self, **kw):
        super(Relu, self).__init__(**kw)
        with self.name_scope():
            self.d = nn.Dense(H, in_units=H, weight_initializer=mx.init.One(),
                              bias_initializer="zeros")

    def hybrid_forward(self, F, x):
        return F.relu(self.d(x))


@pytest.mark.parametrize("policy", POLICIES)
def test_relu_keeps_nan_under_fast_activations(monkeypatch, policy):
    monkeypatch.setattr(jitbatch.config, "fast_activations", True)
    net = Relu()                     # traced after the setting (it is read when traced)
    net.initialize()
    xs = [nd.array([[np.nan, 1, 2, 3]]), nd.array([[-1, -2, 1, 0.5]]),
          nd.array([[np.nan, np.nan, 0, 0]])]
    check(net, lambda net: [net(x) for x in xs], policy, train=False, culprit=r"relu",
          what="relu of NaN, policy=%s" % policy)


# -- an abandoned graph and Python's cyclic GC --------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_an_abandoned_pending_call_leaves_the_gc_enabled(policy):
    """One call recorded and never read (its result dropped): afterwards Python's
    cyclic GC is enabled and collects new cyclic garbage by itself, as in plain
    Gluon (docs/design.rst: the pause is for a graph being recorded)."""
    net = _init(Cell1())
    net.hybridize(dynamic_batch=True, policy=policy)
    assert gc.isenabled()

    def record():
        net(nd.ones((1, H)))          # the result is dropped at once
        assert jitbatch.stats()["pending"] == 1, "the call was not recorded"

    enabled, collected = gc_left_enabled_after_abandoning(record)
    assert enabled and collected, (
        "after a pending call was abandoned and collected: gc.isenabled() is %s and new "
        "cyclic garbage was %s" % (enabled, "collected" if collected else
                                   "never collected automatically"))


# -- memory held by small kept results ------------------------------------------------------
class WideAndSmall(HybridBlock):
    """A large per-sample output (64 KiB) and a small one (one float)."""

    def hybrid_forward(self, F, x):
        big = F.tile(x, reps=(1, 4096))
        return big, F.sum(x, axis=1, keepdims=True)


_STOP = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType,
         types.MethodType, types.FrameType, types.CodeType, gluon.Block, gluon.Parameter,
         threading.Thread, mx.context.Context)


def _ndarray_bytes_reachable(roots, exclude=()):
    """Bytes of the distinct NDArrays reachable by Python references from
    ``roots`` (what keeping ``roots`` keeps alive), not looking into modules,
    functions, classes, blocks and parameters. Uncomputed lazy arrays count 0."""
    seen = set(id(o) for o in exclude)
    stack = list(roots)
    total = 0
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, _STOP):
            continue
        seen.add(id(o))
        if isinstance(o, nd.NDArray) and not jitbatch.is_lazy(o):
            total += int(np.prod(o.shape)) * np.dtype(o.dtype).itemsize
        stack.extend(gc.get_referents(o))
    return total


@pytest.mark.parametrize("policy", POLICIES)
def test_small_kept_results_do_not_keep_their_launch_outputs(policy):
    """Keep only the one-float result of each of 3 x 24 samples (their 64 KiB
    outputs dropped): the arrays they keep reachable must be about their own
    size, as in plain Gluon, not their launches' 1.5 MiB outputs."""
    net = WideAndSmall()
    later = _init(nn.Dense(1, in_units=H))       # another block: a later, small minibatch

    def keep_small(flag):
        for b in (net, later):
            if flag:
                b.hybridize(dynamic_batch=True, policy=policy)
            else:
                b.hybridize(active=False)
        kept = []
        for b in range(3):
            xs = _rows(10 + b, 24)
            outs = [net(x) for x in xs]
            kept.extend(small for _, small in outs)
            del outs
            for k in kept:
                k.asnumpy()
        later(nd.ones((1, H))).asnumpy()       # a later minibatch ends (its graph is tiny)
        gc.collect()
        held = _ndarray_bytes_reachable(kept)
        net.hybridize(active=False)
        later.hybridize(active=False)
        return held, kept
    plain, kept = keep_small(False)
    own = len(kept) * 4
    assert plain <= own, plain       # the measure itself: plain keeps only the floats
    batched, kept = keep_small(True)
    assert batched <= own + 16 * 1024, (
        "keeping %d one-float results keeps %.1f KiB of arrays reachable (plain Gluon: %d "
        "bytes; one sample's large output is 64 KiB): launch outputs are kept alive"
        % (len(kept), batched / 1024.0, plain))


# -- mixed contexts after a first run --------------------------------------------------------
class Two(HybridBlock):
    def hybrid_forward(self, F, a, b):
        return a * 2 + b


MIXED = r"two\d+: argument 1 is on cpu\(1\) but argument 0 is on cpu\(0\).*Fix: move it " \
        r"with \.as_in_context\(cpu\(0\)\)"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("pending", [False, True], ids=["alone", "after_good_calls"])
def test_mixed_contexts_are_refused_after_the_block_ran(policy, pending):
    net = Two()
    net.hybridize(dynamic_batch=True, policy=policy)
    net(nd.ones((1, 2)), nd.ones((1, 2))).asnumpy()      # the signature runs once
    good = [net(nd.ones((1, 2)), nd.ones((1, 2))) for _ in range(3)] if pending else []
    try:
        net(nd.ones((1, 2)), nd.ones((1, 2), ctx=mx.cpu(1)))
    except Exception as e:  # pylint: disable=broad-except
        got = e
    else:
        got = None
    assert isinstance(got, jitbatch.BatchingError) and re.search(MIXED, str(got), re.S), (
        "after the block ran once, a call mixing cpu(0) and cpu(1)%s %s, not the documented "
        "BatchingError" % (" (after 3 pending good calls)" if pending else "",
                           "was accepted" if got is None else "gave %s: %s"
                           % (type(got).__name__, str(got)[:300])))
    for g in good:
        assert np.allclose(g.asnumpy(), 3.0)


# -- a lazy array of another thread as a block input -----------------------------------------
@pytest.mark.parametrize("alive", [False, True], ids=["thread_ended", "thread_alive"])
def test_lazy_array_of_another_thread_as_block_input(alive):
    net = _init(Cell1())
    net.hybridize(dynamic_batch=True)
    box, done, go = {}, threading.Event(), threading.Event()

    def worker():
        box["y"] = net(nd.ones((1, H)))
        done.set()
        go.wait(10)
    t = threading.Thread(target=worker)
    t.start()
    done.wait(10)
    if not alive:
        go.set()
        t.join()
    try:
        net(box["y"]).asnumpy()
    except Exception as e:  # pylint: disable=broad-except
        got = e
    else:
        got = None
    finally:
        go.set()
        t.join()
    assert isinstance(got, jitbatch.StaleValueError) and re.search(
        r"recorded in thread \d+ was used in thread \d+.*Fix", str(got), re.S), (
        "a lazy array of another thread (%s) used as a block input gave %s: %s, not the "
        "documented StaleValueError" % ("ended" if not alive else "still running",
                                        type(got).__name__, got))
    y = net(nd.ones((1, H)))                     # this thread goes on normally
    net.hybridize(active=False)
    assert np.allclose(y.asnumpy(), net(nd.ones((1, H))).asnumpy(), rtol=1e-5)


# -- numpy semantics ----------------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_flagged_call_under_numpy_semantics(policy):
    """Under ``mx.npx.set_np()`` a flagged Dense works as in plain Gluon or raises
    a clear jitbatch error (not a crash inside MXNet's type check)."""
    mx.npx.set_np()
    try:
        net = nn.Dense(H, in_units=H)
        _init(net)
        rng = np.random.default_rng(7)
        xs = [mx.np.array(rng.normal(size=(1, H)), dtype=np.float32) for _ in range(3)]

        def run(flag):
            net.collect_params().zero_grad()
            try:
                if flag:
                    net.hybridize(dynamic_batch=True, policy=policy)
                else:
                    net.hybridize(active=False)
                with autograd.record():
                    ys = [net(x) for x in xs]
                    loss = sum((y * y).sum() for y in ys)
                loss.backward()
                return [y.asnumpy() for y in ys] + [net.weight.grad().asnumpy().copy()]
            except Exception as e:  # pylint: disable=broad-except
                return e
            finally:
                cleanup()
                net.hybridize(active=False)
        ref, got = run(False), run(True)
        assert not isinstance(ref, Exception), ref
        if isinstance(got, Exception):
            assert isinstance(got, jitbatch.JitBatchError) and re.search(FIX, str(got)) \
                and re.search(r"dense\d+|set_np|numpy", str(got)), (
                "under npx.set_np() a flagged call crashed with %s: %s"
                % (type(got).__name__, str(got)[-300:]))
        else:
            for a, b in zip(ref, got):
                np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5,
                                           err_msg="under npx.set_np(): silently different")
    finally:
        mx.npx.reset_np()


# -- forcing points ------------------------------------------------------------------------------
def _exact_net():
    net = nn.Dense(2, in_units=2, weight_initializer=mx.init.One(), bias_initializer="zeros")
    net.initialize()
    return net


def test_printing_a_pending_array_shows_its_values():
    net = _exact_net()
    x = nd.array([[1.0, 2.0]])
    net.hybridize(active=False)
    want = str(net(x))                           # '\n[[3. 3.]]\n<NDArray 1x2 @cpu(0)>'
    net.hybridize(dynamic_batch=True)
    y = net(x)
    assert jitbatch.is_lazy(y)
    buf = io.StringIO()
    with redirect_stdout(buf):
        print(y)
    assert buf.getvalue() == want + "\n", (
        "print(pending array) printed %r; plain Gluon prints %r" % (buf.getvalue(), want + "\n"))
    assert str(net(x)) == want


@pytest.mark.parametrize("policy", POLICIES)
def test_waitall_runs_pending_work(policy):
    net = _exact_net()
    net.hybridize(dynamic_batch=True, policy=policy)
    ys = [net(nd.array([[i, 1.0]])) for i in range(3)]
    assert jitbatch.stats()["pending"] >= 3      # the calls (and arrays made meanwhile)
    nd.waitall()
    pending = jitbatch.stats()["pending"]
    assert pending == 0 or not any(jitbatch.is_lazy(y) for y in ys), (
        "mx.nd.waitall() returned with %d calls still pending: they were not run" % pending)
    assert [y.asnumpy().tolist() for y in ys] == [[[i + 1.0] * 2] for i in range(3)]


# -- how an unmergeable block is reported ----------------------------------------------------
def test_an_unmergeable_block_warns_once_and_runs_one_launch_per_call(recwarn):
    net = _init(Axis0("centre"))
    net.hybridize(dynamic_batch=True, policy="agenda")
    jitbatch.reset_stats()
    xs = _rows(20, 6) + _rows(21, 6)
    ys = [net(x) for x in xs]
    for y in ys:
        y.asnumpy()
    found = [w for w in recwarn.list if issubclass(w.category, jitbatch.ContractWarning)]
    assert len(found) == 1, [str(w.message) for w in found]
    msg = str(found[0].message)
    assert re.search(r"block axis0\d+ cannot merge its calls: its operator mean .*reduces over "
                     r"axis 0.*run one per sample.*Fix: ", msg, re.S), msg
    st = jitbatch.stats()
    assert st["launches"] == 12 and st["nodes"] == 12, st


def test_strict_mode_raises_instead(monkeypatch):
    monkeypatch.setattr(jitbatch.config, "strict", True)
    net = _init(Axis0("softmax"))
    net.hybridize(dynamic_batch=True)
    with pytest.raises(jitbatch.BatchingError, match=r"axis0\d+.*softmax.*Fix"):
        net(nd.ones((1, H)))
    monkeypatch.setattr(jitbatch.config, "strict", False)
    y = net(nd.ones((1, H)))                    # the next call runs normally
    net.hybridize(active=False)
    np.testing.assert_allclose(y.asnumpy(), net(nd.ones((1, H))).asnumpy(), rtol=1e-6)


class _Positions(HybridBlock):
    """Weights positions along ``axis`` by their index (``contrib.arange_like``)."""

    def __init__(self, axis, **kw):
        super(_Positions, self).__init__(**kw)
        self.axis = axis
        with self.name_scope():
            self.d = nn.Dense(H, in_units=H, flatten=False)

    def hybrid_forward(self, F, x):
        y = self.d(x)
        pos = F.contrib.arange_like(y, axis=self.axis)
        return F.broadcast_mul(y, F.expand_dims(pos, axis=1 - self.axis))


@pytest.mark.parametrize("policy", POLICIES)
def test_positions_along_a_sample_axis_merge_and_along_axis0_do_not(policy, recwarn):
    # arange_like over a per-sample axis is the same range for every sample: the
    # calls merge (one launch); over axis 0 it numbers the merged samples' rows,
    # so those calls run one per sample
    along = _init(_Positions(1))
    check(along, lambda net: [net(x) for x in _rows(30, 5)], policy,
          what="arange_like along axis 1, policy=%s" % policy)
    if policy in ("depth", "agenda"):
        along.hybridize(dynamic_batch=True, policy=policy)
        jitbatch.reset_stats()
        ys = [along(x) for x in _rows(30, 5)]
        ys[-1].asnumpy()
        assert jitbatch.stats()["launches"] == 1
        along.hybridize(active=False)
    across = _init(_Positions(0))
    got = check(across, lambda net: [net(x) for x in _rows(31, 5, t=3)], policy,
                culprit=r"_positions\d+|arange_like", what="arange_like along axis 0")
    assert got.error is None
    assert any("arange_like" in str(w.message) for w in recwarn.list
               if issubclass(w.category, jitbatch.ContractWarning))
