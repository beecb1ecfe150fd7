"""Property-based differential testing: generated per-sample programs give the
same outputs and gradients batched, under every policy, as plain per-sample
Gluon.

``test_generated_programs_match_plain_gluon``: random forests of chains, trees
and DAGs over several block types, with NDArray operators between blocks.

``test_generated_contract_programs_are_plain_gluon_or_a_clear_error`` (issue 19)
draws the same operations and also: operators over axis 0 inside flagged
blocks (centring, softmax, sort, max, sum, ``norm`` without an axis; BatchNorm
in training mode), ragged per-sample ``(T, W)`` inputs (those operators, a
row-wise Dense, a ``contrib.foreach`` RNN over the rows), random operators
(``random.normal``, ``Dropout(axes=(0,))``: each sample's draw must be its
own), in-place writes after recording (to a concrete array a pending call
reads, possibly with a lazy value, and to a computed lazy array a pending call
reads), negative-step slices, calls whose results are dropped, and a whole
recorded sample abandoned (Python's cyclic GC must be left enabled). Its oracle
is ``tests/oracle.py``: plain Gluon's numbers (outputs, gradients, parameters
after the run), or a clear ``jitbatch.JitBatchError`` (naming the culprit and
the fix), or - for writes inside ``autograd.record`` - MXNet's own refusal;
never silently different.

CI runs a few examples of each. For a long run (the count applies to each test)::

    JITBATCH_PROPERTY_EXAMPLES=10000 OMP_NUM_THREADS=1 python -m pytest -x tests/test_properties.py

(``JITBATCH_EXAMPLES`` is read when ``JITBATCH_PROPERTY_EXAMPLES`` is not set;
``-k contract`` runs the issue-19 generator alone.) A long run shrinks a failing
issue-19 example to a minimal program; CI's short run reports the first failing
example as found (``JITBATCH_PROPERTY_SHRINK=1`` / ``0`` overrides).
"""
import os

import numpy as np
import mxnet as mx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from mxnet import gluon, nd
from mxnet.gluon import HybridBlock, nn

import jitbatch
from harness import assert_same, run
from models import ScanRNN
from oracle import cleanup, gc_left_enabled_after_abandoning, judge, run_program, snapshot

EXAMPLES = int(os.environ.get("JITBATCH_PROPERTY_EXAMPLES",
                              os.environ.get("JITBATCH_EXAMPLES", "30")))
#: the issue-19 generator's CI count (each example runs plain + 4 policies)
CONTRACT_EXAMPLES = int(os.environ.get("JITBATCH_PROPERTY_EXAMPLES",
                                       os.environ.get("JITBATCH_EXAMPLES", "15")))
#: shrink a failing example to a minimal one (minutes while many programs fail):
#: on for a long run, off for CI's few examples unless JITBATCH_PROPERTY_SHRINK=1
SHRINK = os.environ.get("JITBATCH_PROPERTY_SHRINK",
                        "1" if "JITBATCH_PROPERTY_EXAMPLES" in os.environ else "0") == "1"
PHASES = tuple(p for p in Phase if SHRINK or p is not Phase.shrink)
W = 4


@pytest.fixture(autouse=True, scope="module")
def _exact_kernels():
    """The generated programs' blocks are traced with MXNet's own ``tanh`` and
    ``sigmoid`` (``config.fast_activations`` off), so batched and plain runs use
    the same kernels and differ only where batching does. With oneDNN's
    Activation kernel, a gradient through a saturated tanh (1 - y*y cancels)
    moved by up to 3.5e-4 relative from one ulp of y in two examples of a
    10,000-example run, bit-identical with it off; the rewrite has its own
    tests (tests/test_rewrite.py). Read at tracing: these nets trace here."""
    saved = jitbatch.config.fast_activations
    jitbatch.config.fast_activations = False
    yield
    jitbatch.config.fast_activations = saved


class One(HybridBlock):
    def __init__(self, **kw):
        super(One, self).__init__(**kw)
        with self.name_scope():
            self.d = nn.Dense(W, in_units=W)

    def hybrid_forward(self, F, x):
        return F.tanh(self.d(x))


class Two(HybridBlock):
    """Two inputs, two outputs."""

    def __init__(self, **kw):
        super(Two, self).__init__(**kw)
        with self.name_scope():
            self.a = nn.Dense(W, in_units=W)
            self.b = nn.Dense(W, in_units=W, use_bias=False)

    def hybrid_forward(self, F, x, y):
        h = F.sigmoid(self.a(x) + self.b(y))
        return h * y, h - x


class Three(HybridBlock):
    def __init__(self, **kw):
        super(Three, self).__init__(**kw)
        with self.name_scope():
            self.d = nn.Dense(W, in_units=3 * W)

    def hybrid_forward(self, F, x, y, z):
        return F.relu(self.d(F.concat(x, y, z, dim=1))) + 0.1 * z


class Program(gluon.Block):
    def __init__(self, **kw):
        super(Program, self).__init__(**kw)
        with self.name_scope():
            self.one = One()
            self.shared = nn.Dense(W, in_units=W, activation="tanh",
                                   params=self.one.d.params)   # shared parameters
            self.two = Two()
            self.three = Three()
            self.unflagged = nn.Dense(W, in_units=W)      # never gets the flag

    def forward(self, x, prog):
        vals = [x[i:i + 1] for i in range(x.shape[0])]   # free row views when lazy
        for op, args in prog:
            self.step(op, [vals[i % len(vals)] for i in args], vals, x)
        return nd.concat(self.one(vals[-1]), *vals[-2:], dim=1)

    def step(self, op, a, vals, x):  # pylint: disable=unused-argument
        """One generated operation on the values so far: appends (1, W) values."""
        if op == "one":
            vals.append(self.one(a[0]))
        elif op == "shared":
            vals.append(self.shared(a[0]))
        elif op == "two":
            vals.extend(self.two(a[0], a[1]))
        elif op == "three":
            vals.append(self.three(a[0], a[1], a[2]))
        elif op == "unflagged":
            vals.append(self.unflagged(a[0]))
        elif op == "arith":
            vals.append(a[0] * 0.5 - a[1] + 1.0)
        elif op == "add_n":
            vals.append(nd.add_n(*a))
        elif op == "concat_slice":
            vals.append(nd.concat(a[0], a[1], dim=1)[:, 1:1 + W])
        elif op == "expand_sum":
            vals.append(nd.sum(nd.stack(a[0], a[1], axis=1), axis=1) / 2)
        elif op == "reshape":
            vals.append(nd.relu(a[0].reshape((W, 1))).reshape((1, W)))
        elif op == "reduce":
            vals.append(a[0] * nd.mean(a[1], axis=1, keepdims=True))
        elif op == "index":
            vals.append(nd.expand_dims(a[0][0], axis=0))
        elif op == "broadcast":
            vals.append(nd.broadcast_mul(a[0], nd.sum(a[1], axis=0, keepdims=True)))
        elif op == "read":     # a value read in Python steers the program
            k = int(a[0].argmax(axis=1).asscalar())
            vals.append(self.one(a[1]) if k % 2 else a[1] * 0.5)
        else:
            raise ValueError(op)


ARITY = {"one": 1, "shared": 1, "two": 2, "three": 3, "unflagged": 1, "arith": 2,
         "add_n": 3, "concat_slice": 2, "expand_sum": 2, "reshape": 1, "reduce": 2,
         "index": 1, "broadcast": 2}
ARITY_READS = dict(ARITY, read=2)    # ... and reads that steer a sample's program


@st.composite
def programs(draw, arity=None, max_in=3):
    arity = arity or ARITY
    n_in = draw(st.integers(1, max_in))
    length = draw(st.integers(1, 8))
    prog = []
    for _ in range(length):
        op = draw(st.sampled_from(sorted(arity)))
        prog.append((op, [draw(st.integers(0, 20)) for _ in range(arity[op])]))
    seed = draw(st.integers(0, 2 ** 16))
    return n_in, prog, seed


def apply(net, s):
    y = net(s[0], s[1])
    return y, nd.sum(y * y)


def _samples(progs):
    """Each generated program with its input rows, drawn from its seed."""
    return [(nd.array(np.random.default_rng(seed).normal(size=(n_in, W))), prog)
            for n_in, prog, seed in progs]


_NET = {}


def _net():
    # one network for all examples (hypothesis re-runs the test body many times)
    if "net" not in _NET:
        net = Program()
        net.initialize(mx.init.Uniform(0.5))
        _NET["net"] = net
    return _NET["net"]


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(programs(), min_size=1, max_size=5), st.booleans(), st.sampled_from([16, 1, 2]))
# found by a 10,000-example run (2026-11-26) while the kernels differed (see
# _exact_kernels): a saturated tanh's gradient 3.5e-4 off
@example([(1, [("broadcast", [0, 0]), ("add_n", [0, 0, 0]), ("add_n", [1, 2, 14]),
               ("broadcast", [3, 3])], 789)], True, 16)
# found by a 10,000-example run: two row stacks reusing the same two parts made a
# gather take each whole source once where it needed each twice
@example([(1, [("three", [0, 0, 0]), ("expand_sum", [0, 1]), ("expand_sum", [0, 1])], 0)],
         False, 16)
# found by a 10,000-example run (2026-11-25): split, MXNet could not run the
# backward of Three's main stage reading its input stage's output
@example([(1, [("add_n", [0, 0, 0])], 0),
          (1, [("add_n", [0, 0, 0]), ("three", [0, 0, 0]), ("arith", [0, 0])], 6478),
          (3, [("three", [0, 0, 5]), ("two", [0, 0]), ("three", [15, 0, 0])], 0)], True, 16)
def test_generated_programs_match_plain_gluon(progs, train, buckets):
    """``buckets``: config.row_buckets; 1 and 2 round block launches of more
    than 2 or 4 samples up (to a power of two, or two sizes per doubling), so
    filler samples run in most examples."""
    net = _net()
    samples = _samples(progs)
    ref = run(net, apply, samples, train, flag=False)
    saved = jitbatch.config.row_buckets
    jitbatch.config.row_buckets = buckets
    try:
        # every policy, and the input stages of granularity 'split' (under
        # 'auto' a flush splits only where measured times say so)
        for policy, gran in (("auto", "auto"), ("depth", "auto"), ("agenda", "auto"),
                             ("sequential", "auto"), ("agenda", "split")):
            got = run(net, apply, samples, train, flag=True, policy=policy, granularity=gran)
            net.unflagged.hybridize(active=False)
            assert_same(ref, got, rtol=1e-4, atol=1e-5)
    finally:
        jitbatch.config.row_buckets = saved


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(programs(ARITY_READS), min_size=2, max_size=5), st.booleans())
# found by a 10,000-example run (2026-11-26) while the kernels differed (see
# _exact_kernels): a saturated tanh's gradient entry off by 2%
@example([(1, [("index", [0])], 0),
          (1, [("index", [0]), ("add_n", [0, 0, 0]), ("broadcast", [2, 8]), ("two", [0, 3]),
               ("add_n", [0, 0, 0]), ("add_n", [0, 0, 0]), ("add_n", [0, 0, 4])], 309)], True)
def test_generated_programs_with_reads_match_plain_gluon_under_map(progs, train):
    """The samples through ``jitbatch.map``, whose programs read values (a read
    parks the sample until the others have recorded what they can), under every
    policy: plain per-sample Gluon's outputs and gradients."""
    net = _net()
    samples = _samples(progs)
    ref = run(net, apply, samples, train, flag=False)
    for policy, gran in (("auto", "auto"), ("depth", "auto"), ("agenda", "auto"),
                         ("sequential", "auto"), ("agenda", "split")):
        got = run(net, apply, samples, train, flag=True, policy=policy, granularity=gran,
                  mapped=True)
        net.unflagged.hybridize(active=False)
        assert_same(ref, got, rtol=1e-4, atol=1e-5)


# -- issue 19: the batch-axis contract -----------------------------------------------------
AXIS0 = {
    "centre": lambda F, y: F.broadcast_sub(y, F.mean(y, axis=0, keepdims=True)),
    "softmax": lambda F, y: F.softmax(y, axis=0),
    "sort": lambda F, y: F.sort(y, axis=0),
    "max": lambda F, y: F.broadcast_sub(y, F.max(y, axis=0, keepdims=True)),
    "sum": lambda F, y: F.broadcast_mul(y, F.sum(y, axis=0, keepdims=True)),
    "norm": lambda F, y: F.broadcast_div(y, F.norm(y)),
}
DRAW = 32      # entries per random draw: two independent draws are never equal


class Axis0(HybridBlock):
    def __init__(self, op, **kw):
        super(Axis0, self).__init__(**kw)
        self.op = op
        with self.name_scope():
            self.d = nn.Dense(W, in_units=W, flatten=False)

    def hybrid_forward(self, F, x):
        return AXIS0[self.op](F, self.d(x))


class Norm(HybridBlock):
    def __init__(self, **kw):
        super(Norm, self).__init__(**kw)
        with self.name_scope():
            self.bn = nn.BatchNorm(in_channels=W)

    def hybrid_forward(self, F, x):
        return self.bn(x)


class Normal(HybridBlock):
    def hybrid_forward(self, F, x):
        zero = F.zeros_like(F.sum(x, axis=1, keepdims=True))          # (1, 1) per sample
        return F.broadcast_add(zero, F.random.normal(shape=(1, DRAW)))


class Drop(HybridBlock):
    def hybrid_forward(self, F, x):
        ones = F.broadcast_add(F.zeros_like(F.sum(x, axis=1, keepdims=True)),
                               F.ones(shape=(1, DRAW)))
        return F.Dropout(ones, p=0.5, axes=(0,))


class ContractProgram(Program):
    """Program's operations and those of issue 19's program classes."""

    def __init__(self, **kw):
        super(ContractProgram, self).__init__(**kw)
        with self.name_scope():
            for op in sorted(AXIS0):
                setattr(self, "axis0_" + op, Axis0(op))
            self.rows = nn.Dense(W, in_units=W, flatten=False)
            self.norm = Norm()
            self.scan = ScanRNN(W)
            self.normal = Normal()
            self.drop = Drop()
        self.draws = []           # (kind, lazy array): random draws, checked apart

    def step(self, op, a, vals, x):
        if op.startswith("axis0_"):                      # over axis 0 of a (1, W) value
            vals.append(getattr(self, op)(a[0]))
        elif op.startswith("ragged_"):                   # over axis 0 of the (T, W) input
            y = getattr(self, "axis0_" + op[len("ragged_"):])(x)
            vals.append(y[0:1])
            vals.append(nd.mean(y, axis=0, keepdims=True))
        elif op == "rows":                                # row-wise over the (T, W) input
            y = self.rows(x)
            vals.append(y[-1:])
            vals.append(nd.max(y, axis=0, keepdims=True))
        elif op == "batchnorm":
            vals.append(self.norm(x)[0:1])
        elif op == "foreach":
            vals.append(self.scan(x)[-1:])
        elif op == "normal":
            self.draws.append(("normal", self.normal(a[0])))
        elif op == "dropout":
            self.draws.append(("dropout", self.drop(a[0])))
        elif op == "write_concrete":                      # a pending call reads c, then c changes
            c = nd.ones((1, W)) * 0.5
            vals.append(self.one(c))
            c += a[0]
            vals.append(c * 1.0)
        elif op == "write_read_lazy":         # y computed, read by a pending call, then written
            y = self.one(a[0])
            y.asnumpy()
            vals.append(self.shared(y))
            y += 1.0
            vals.append(y)
        elif op == "neg_cols":
            vals.append(a[0][:, ::-1])
        elif op == "neg_rows":
            vals.append(nd.concat(a[0], a[1], dim=0)[::-1][0:1])
        elif op == "drop_result":                         # recorded, never read
            self.one(a[0])
        else:
            super(ContractProgram, self).step(op, a, vals, x)


CONTRACT_ARITY = dict(ARITY, **{"axis0_" + op: 1 for op in AXIS0})
CONTRACT_ARITY.update({"ragged_" + op: 0 for op in AXIS0})
CONTRACT_ARITY.update(rows=0, batchnorm=0, foreach=0, normal=1, dropout=1, write_concrete=1,
                      write_read_lazy=1, neg_cols=1, neg_rows=2, drop_result=1)
#: a jitbatch error must name one of these (a block of the program or an operator)
CULPRIT = (r"contractprogram\d+_\w+|" + "|".join(sorted(
    ["mean", "softmax", "sort", "max", "sum", "norm", "BatchNorm", "foreach", "Dropout",
     "normal", "slice", "write", "in-place", "inplace"])))


def _contract_net():
    if "contract" not in _NET:
        net = ContractProgram()
        net.initialize(mx.init.Uniform(0.5))
        _NET["contract"] = net
    return _NET["contract"]


def _draws_are_per_sample(draws, train):
    """None if no two draws of one kind are equal (independent draws never are),
    else the failure's description. Dropout draws only under training."""
    for kind in ("normal", "dropout"):
        got = [d for k, d in draws if k == kind]
        if kind == "dropout" and not train:
            continue
        for i, a in enumerate(got):
            for j in range(i):
                if np.array_equal(a, got[j]):
                    return ("%s draws %d and %d of %d are identical (each call must get its "
                            "own draw)" % (kind, j, i, len(got)))
    return None


# the programs mix rows on purpose: their blocks' ContractWarnings are expected
# (the oracle checks the numbers; tests/test_contract.py checks the warnings)
@pytest.mark.filterwarnings("ignore::jitbatch.ContractWarning")
@settings(max_examples=CONTRACT_EXAMPLES, deadline=None, derandomize=True, phases=PHASES,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(st.tuples(programs(CONTRACT_ARITY, max_in=4), st.integers(1, 3)),
                min_size=1, max_size=3), st.booleans(), st.booleans())
# found by 10,000-example runs (2026-11-25): BatchNorm's running statistics after
# training differ (update order; a call whose output never reaches the loss)
@example([((2, [("axis0_centre", [0]), ("batchnorm", []), ("arith", [0, 0])], 0), 1),
          ((1, [("batchnorm", [])], 0), 1)], True, False)
@example([((2, [("dropout", [10]), ("batchnorm", []), ("broadcast", [10, 3]),
                ("batchnorm", [])], 1456), 2)] * 2, True, True)
@example([((1, [("axis0_centre", [0]), ("add_n", [0, 0, 0]), ("arith", [0, 1]),
                ("axis0_centre", [0])], 0), 1),
          ((1, [("batchnorm", []), ("add_n", [0, 0, 0]), ("arith", [0, 1]), ("arith", [0, 0]),
                ("axis0_centre", [0])], 0), 1)], True, False)
# ... an in-place write inside autograd.record into an array made while calls were
# pending (nd.ones), which a recorded call reads: refused, as per sample
@example([((1, [("one", [0]), ("write_concrete", [0])], 0), 1)], True, False)
# ... and an in-place write inside autograd.record refused with MXNet's other wording
@example([((1, [("arith", [0, 0])], 0), 1),
          ((1, [("axis0_centre", [0]), ("axis0_centre", [0]), ("axis0_centre", [0]),
                ("write_concrete", [0]), ("add_n", [0, 0, 0])], 0), 1)], True, False)
def test_generated_contract_programs_are_plain_gluon_or_a_clear_error(progs, train, abandon):
    """Issue 19's program classes, generated: per policy, plain Gluon's outputs,
    gradients and parameters after the run (BatchNorm's running statistics), or a
    clear jitbatch error, or MXNet's own refusal of a write inside
    ``autograd.record``; random draws one per call; after abandoning a recorded
    sample (``abandon``), Python's cyclic GC enabled. Each program runs on 1-3
    samples (inputs of other lengths), as a minibatch would, so that its
    operations merge across samples."""
    net = _contract_net()
    samples = []
    for (n_in, prog, seed), copies in progs:
        for j in range(copies):
            rng = np.random.default_rng(seed + j)
            samples.append((nd.array(rng.normal(size=((n_in + j - 1) % 4 + 1, W))), prog))

    def program(net):
        return [net(x, prog) for x, prog in samples]

    def one_run(flag, policy="auto"):
        net.draws = []
        out = run_program(net, program, flag, policy, train=train, snap=snap, seed=7)
        draws = []
        if out.error is None:
            draws = [(k, d.asnumpy()) for k, d in net.draws]
        net.draws = []
        return out, draws

    # BatchNorm's running statistics after training are not compared here (see
    # oracle.differences: MXNet updates them in backward, for the calls its graph
    # reaches); outputs and gradients are
    running = not (train and any(op == "batchnorm" for _, prog in samples for op, _ in prog))
    snap = snapshot(net)
    ref, ref_draws = one_run(False)
    assert _draws_are_per_sample(ref_draws, train) is None, "test bug: plain Gluon's draws"
    for policy in ("auto", "depth", "agenda", "sequential"):
        got, draws = one_run(True, policy)
        what = "policy=%s %s, programs %r" % (policy, "training" if train else "inference",
                                              [(p, k) for (_, p, _), k in progs])
        failure = judge(ref, got, CULPRIT, what, running=running)
        assert failure is None, failure
        shared = _draws_are_per_sample(draws, train)
        assert shared is None, "%s: %s: silently different" % (what, shared)
    if abandon:
        net.hybridize(dynamic_batch=True)

        def record():
            try:
                net(*samples[0])               # every result dropped
            except jitbatch.JitBatchError:
                pass
            net.draws = []
        try:
            enabled, collected = gc_left_enabled_after_abandoning(record)
        finally:
            cleanup()
            net.hybridize(active=False)
            net.draws = []
        assert enabled and collected, (
            "after abandoning a recorded sample (program %r): gc.isenabled() is %s, new cyclic "
            "garbage %s" % (samples[0][1], enabled,
                            "collected" if collected else "never collected automatically"))
    for k, p in net.collect_params().items():      # the next example starts from here
        p.set_data(snap[k])
