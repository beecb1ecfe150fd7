"""Held-out programs, round 24: per-sample programs written against MXNet 1.9's
NumPy interface (``from mxnet import np, npx; npx.set_np()``), the way a user of
that interface writes Gluon models for one sample.

* HybridBlocks whose ``hybrid_forward`` uses ``F.np.*`` / ``F.npx.*``
  (``np.tanh``, ``np.concatenate``, ``np.split``, ``np.expand_dims``,
  ``npx.relu``, ``npx.sigmoid``, ``npx.softmax``, ``npx.batch_dot``,
  ``npx.embedding``), ``mx.np.array`` inputs, ``np.stack`` / ``np.dot`` in the
  per-sample code around them, a per-sample ``gluon.Block`` looping an np cell,
  the fused ``rnn.GRU`` in NTC, ``nn.PReLU``, an empty ``HybridSequential`` as
  "no projection", a ``hybrid_forward`` branching on ``autograd.is_training()``,
  ``Dropout``, ``BatchNorm`` in training and ``np.random.normal`` (seeded),
  Gluon losses on np arrays (plain and flagged), input gradients
  (``attach_grad``), Trainer steps (sgd, adam);
  ``rnn.GRUCell``, which MXNet 1.9.1 refuses under ``set_np`` (jitbatch must
  refuse it the same way); a block class decorated with ``mx.util.use_np``
  called from legacy-mode code; ``jitbatch.map`` under ``set_np``.
* Mixing: a flagged legacy-NDArray model and an np model in one process,
  ``npx.set_np()`` / ``npx.reset_np()`` between minibatches, ``set_np`` turned
  on while legacy calls are still pending (their flush then runs in np mode),
  ``.as_np_ndarray()`` of pending legacy outputs (each, a row, ``nd.concat``)
  into an np loss, ``.as_nd_ndarray()`` of an np encoder's per-sample outputs
  into a flagged legacy head, an np model's Adam step while a legacy recurrent
  model's calls pend, one parameter-free flagged block used in both modes, np
  arrays given to a legacy model (and legacy arrays to an np model);
  after each error the next legacy minibatch, and the np mode the user set
  (``is_np_array`` / ``is_np_shape``) left as it was.
* Found along the way (legacy mode): the user's ``static_alloc=True`` given to
  ``hybridize`` beside ``dynamic_batch=True``, in training.

The oracle is the same program in plain per-sample Gluon (no hybridize) on a
fresh network with the same initial values and inputs: outputs, losses,
gradients and parameters after the steps (``same_arrays``). Where jitbatch does
not batch (every flagged call under ``set_np`` runs as one call of the block's
graph, docs/errors.rst) it must give those numbers or a clear
``JitBatchError`` naming the block, np mode and the fix; where plain Gluon
raises, jitbatch must raise the same error (or a clear one of its own). Launch
counts are asserted under 'depth' and 'agenda' only. Every test leaves np mode
off (autouse fixture).
The round's findings were fixed on 2026-11-26 (each test's docstring says
what it was; docs/errors.rst lists them): crashes plain Gluon does not have,
with MXNet's bare TypeError as the only message (graph rewrites that turned
an np graph into a legacy one: PReLU, a block returning its input; a legacy
graph flushed in np mode; ``jitbatch.map`` workers without np mode; one
block's traced graph reused across modes), an unclear error (np arrays into
a legacy model), and one silent wrong number (the user's ``static_alloc`` in
training, legacy mode). Kept as a strict expected failure (docs/errors.rst,
Known differences): a ``use_np`` class called from legacy code, compiled
build only.
"""
import re
import warnings

import numpy as onp
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd, np, npx
from mxnet.gluon import HybridBlock, nn, rnn

import jitbatch
from oracle import FIX, cleanup
from heldout import initialized as init  # noqa: F401
from heldout import merged, nothing_pending, rng_for, same_arrays  # noqa: F401

POLICIES = ["auto", "depth", "agenda", "sequential"]
POLICY = pytest.mark.parametrize("policy", POLICIES)
#: a clear error about np mode says so
NP_WORDS = r"(?i)set_np|numpy|np mode|np semantics|use_np"


@pytest.fixture(autouse=True)
def np_mode_off(nothing_pending):  # noqa: F811  (tears down before nothing_pending)
    npx.reset_np()
    yield
    npx.reset_np()


def np_state():
    return (bool(mx.util.is_np_array()), bool(mx.util.is_np_shape()))


def flag(nets, policy, granularity="auto"):
    for net in (nets if isinstance(nets, (list, tuple)) else [nets]):
        if policy is None:
            net.hybridize(active=False)
        else:
            net.hybridize(dynamic_batch=True, policy=policy, granularity=granularity)



def made_in_np_mode(cls, *args, **kw):
    """A maker of ``cls(*args, **kw)`` built and initialized under ``set_np``
    (its parameters np arrays), same initial values every call; np mode is off
    again afterwards."""
    def make():
        npx.set_np()
        try:
            return init(cls(*args, **kw))
        finally:
            npx.reset_np()
    return make


def legacy(cls, *args, **kw):
    return lambda: init(cls(*args, **kw))


def params_of(*nets):
    return [p.data().asnumpy().copy() for n in nets for p in n.collect_params().values()]


def grads_of(*nets):
    return [p.grad().asnumpy().copy() for n in nets for p in n.collect_params().values()
            if p.grad_req != "null"]


class Outcome(object):
    def __init__(self, arrays=None, error=None, state=None, stats=None):
        self.arrays, self.error, self.state, self.stats = arrays, error, state, stats

    def __repr__(self):
        if self.error is not None:
            return "raised %s: %s" % (type(self.error).__name__, str(self.error)[:300])
        return "%d arrays" % len(self.arrays)


def run(make, program, policy, granularity="auto"):
    """``program(nets) -> [array]`` on fresh networks, plain (policy None) or
    flagged; np mode off before; what it gave (or raised), the np state it
    left, the stats."""
    npx.reset_np()
    nets = make()
    jitbatch.reset_stats()
    try:
        flag(nets, policy, granularity)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", jitbatch.ContractWarning)
            got = [onp.asarray(a) for a in program(nets)]
        return Outcome(got, state=np_state(), stats=jitbatch.stats())
    except Exception as e:  # pylint: disable=broad-except
        return Outcome(error=e, state=np_state(), stats=jitbatch.stats())
    finally:
        npx.reset_np()
        cleanup()
        flag(nets, None)


def both(make, program, policy, granularity="auto"):
    return run(make, program, None), run(make, program, policy, granularity)


def same_or_clear(want, got, what, culprit):
    """jitbatch gave plain Gluon's numbers, or plain Gluon's own error, or a clear
    jitbatch error (names the culprit, np mode, and the fix); and left np mode
    as plain Gluon left it."""
    if want.error is not None:
        assert got.error is not None, "%s: plain Gluon raised %r, jitbatch did not" % (
            what, want)
        if isinstance(got.error, jitbatch.JitBatchError):
            assert re.search(culprit, str(got.error)) and re.search(FIX, str(got.error)), (
                "%s: unclear error %r (plain Gluon %r)" % (what, got, want))
        else:
            assert type(got.error) is type(want.error) and \
                str(got.error).strip() == str(want.error).strip(), (
                    "%s: plain Gluon %r, jitbatch %r" % (what, want, got))
    elif got.error is not None:
        msg = str(got.error)
        assert isinstance(got.error, jitbatch.JitBatchError) and re.search(culprit, msg) \
            and re.search(NP_WORDS, msg) and re.search(FIX, msg), (
                "%s: plain Gluon runs it, jitbatch raised an error that does not name the "
                "block, np mode and the fix: %r" % (what, got))
        return          # (the program stopped where it raised: its np mode is its own)
    else:
        same_arrays(want.arrays, got.arrays, what)
    assert got.state == want.state, (
        "%s: np mode (is_np_array, is_np_shape) left %s, plain Gluon left %s"
        % (what, got.state, want.state))


# -- 1. an np MLP classifier, trained ------------------------------------------------------
H = 6


class NpMLP(HybridBlock):
    """Two Dense views of the sample combined with np operators, logits out."""

    def __init__(self, n_in=5, n_out=4, **kw):
        super(NpMLP, self).__init__(**kw)
        with self.name_scope():
            self.a = nn.Dense(H, in_units=n_in)
            self.b = nn.Dense(H, in_units=n_in)
            self.out = nn.Dense(n_out, in_units=2 * H)

    def hybrid_forward(self, F, x):
        h = F.np.tanh(self.a(x))
        g = F.npx.relu(self.b(x))
        return self.out(F.np.concatenate([h * g, h - g], axis=1))


def np_rows(key, n, width):
    rng = rng_for(*key)
    return [rng.normal(size=(1, width)).astype("float32") for _ in range(n)]


MLP_X = [np_rows(("mlp", it), 5, 5) for it in range(3)]
MLP_Y = [rng_for("mlp-y", it).integers(0, 4, size=5) for it in range(3)]


def np_classifier(net, loss_flagged=False, policy=None):
    npx.set_np()
    ce = gluon.loss.SoftmaxCrossEntropyLoss()
    if loss_flagged and policy is not None:
        ce.hybridize(dynamic_batch=True, policy=policy)
    tr = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.05})
    out = []
    for xs, ys in zip(MLP_X, MLP_Y):
        with autograd.record():
            losses = [ce(net(np.array(x)), np.array([float(y)])) for x, y in zip(xs, ys)]
            total = np.stack(losses).sum()
        total.backward()
        out += [total.asnumpy()] + [l.asnumpy() for l in losses] + grads_of(net)
        tr.step(len(xs))
        out += [npx.softmax(net(np.array(x))).asnumpy() for x in xs[:2]]
    return out + params_of(net)


@POLICY
@pytest.mark.parametrize("loss", ["plain_loss", "flagged_loss"])
def test_np_mlp_classifier_trained_with_adam(policy, loss):
    want, got = both(made_in_np_mode(NpMLP),
                     lambda n: np_classifier(n, loss == "flagged_loss", policy), policy)
    assert want.error is None, want
    assert want.state == (True, True)
    same_or_clear(want, got, "np MLP classifier (%s) under %s" % (loss, policy), r"npmlp\d+")


# -- 2. attention with np.stack / npx.batch_dot / np.dot, input gradients ------------------
class NpAttention(HybridBlock):
    """A query (1, H) over its sample's keys (1, S, H)."""

    def __init__(self, **kw):
        super(NpAttention, self).__init__(**kw)
        with self.name_scope():
            self.q = nn.Dense(H, in_units=H)
            self.k = nn.Dense(H, in_units=H, flatten=False)

    def hybrid_forward(self, F, q, keys):
        qp = self.q(q)
        scores = F.npx.batch_dot(self.k(keys), F.np.expand_dims(qp, -1))    # (1, S, 1)
        att = F.npx.softmax(scores, axis=1)
        ctx = F.np.sum(att * keys, axis=1)                                  # (1, H)
        return F.np.concatenate([ctx, qp], axis=1)


_arng = rng_for("attention")
ATT = [(_arng.normal(size=(1, H)).astype("float32"),
        [_arng.normal(size=(1, H)).astype("float32") for _ in range(int(_arng.integers(2, 5)))])
       for _ in range(5)]
PROJ = _arng.normal(size=(2 * H, 1)).astype("float32")


def np_attention(net):
    npx.set_np()
    proj = np.array(PROJ)
    qs = [np.array(q) for q, _ in ATT]
    words = [[np.array(w) for w in ws] for _, ws in ATT]
    for q in qs:
        q.attach_grad()
    for ws in words:
        for w in ws:
            w.attach_grad()
    with autograd.record():
        outs = [net(q, np.stack(ws, axis=1)) for q, ws in zip(qs, words)]
        scores = [np.dot(o, proj) for o in outs]
        loss = (np.concatenate(scores, axis=0) ** 2).sum()
    loss.backward()
    return [loss.asnumpy()] + [o.asnumpy() for o in outs] + [q.grad.asnumpy() for q in qs] + \
        [w.grad.asnumpy() for ws in words for w in ws] + grads_of(net)


@POLICY
def test_np_attention_with_stacked_keys_and_input_gradients(policy):
    want, got = both(made_in_np_mode(NpAttention), np_attention, policy)
    assert want.error is None, want
    same_or_clear(want, got, "np attention under %s" % policy, r"npattention\d+")


# -- 3. a bag of embeddings with npx.embedding, L2 loss, sgd --------------------------------
VOCAB = 9


class NpBag(HybridBlock):
    def __init__(self, **kw):
        super(NpBag, self).__init__(**kw)
        with self.name_scope():
            self.weight = self.params.get("weight", shape=(VOCAB, H))
            self.out = nn.Dense(2, in_units=H)

    def hybrid_forward(self, F, ids, weight):
        e = F.npx.embedding(ids, weight, input_dim=VOCAB, output_dim=H)    # (1, T, H)
        return self.out(F.np.mean(F.np.tanh(e), axis=1))


_brng = rng_for("bag")
BAG = [[(_brng.integers(0, VOCAB, size=(1, int(_brng.integers(1, 6)))).astype("float32"),
         _brng.normal(size=(1, 2)).astype("float32")) for _ in range(4)] for _ in range(3)]


def np_bag(net):
    npx.set_np()
    l2 = gluon.loss.L2Loss()
    tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.5})
    out = []
    for mb in BAG:
        with autograd.record():
            losses = [l2(net(np.array(ids)), np.array(y)) for ids, y in mb]
        autograd.backward(losses)
        out += [l.asnumpy() for l in losses] + grads_of(net)
        tr.step(len(mb))
    return out + params_of(net)


@POLICY
def test_np_embedding_bag_with_npx_embedding(policy):
    want, got = both(made_in_np_mode(NpBag), np_bag, policy)
    assert want.error is None, want
    same_or_clear(want, got, "np embedding bag under %s" % policy, r"npbag\d+")


# -- 4. a per-sample gluon.Block looping an np cell; the fused GRU in NTC -------------------
class NpCell(HybridBlock):
    """A GRU-like cell in np operators (np.split of the gates)."""

    def __init__(self, n_in, **kw):
        super(NpCell, self).__init__(**kw)
        with self.name_scope():
            self.i2h = nn.Dense(3 * H, in_units=n_in)
            self.h2h = nn.Dense(3 * H, in_units=H)

    def hybrid_forward(self, F, x, h):
        r, z, n = F.np.split(self.i2h(x) + self.h2h(h), 3, axis=1)
        r, z = F.npx.sigmoid(r), F.npx.sigmoid(z)
        return (1 - z) * F.np.tanh(n * r) + z * h


class NpSeq(gluon.Block):
    def __init__(self, **kw):
        super(NpSeq, self).__init__(**kw)
        with self.name_scope():
            self.cell = NpCell(3)
            self.out = nn.Dense(2, in_units=H)

    def forward(self, seq):                     # (T, 3), one sample
        h = np.zeros((1, H))
        for t in range(seq.shape[0]):
            h = self.cell(seq[t:t + 1], h)
        return self.out(h)


class NpFusedGRU(gluon.Block):
    def __init__(self, **kw):
        super(NpFusedGRU, self).__init__(**kw)
        with self.name_scope():
            self.rnn = rnn.GRU(H, input_size=3, layout="NTC")
            self.out = nn.Dense(2, in_units=H)

    def forward(self, seq):                     # (T, 3) -> (1, T, 3)
        return self.out(self.rnn(np.expand_dims(seq, 0))[:, -1])


_srng = rng_for("np-seq")
SEQS = [[_srng.normal(size=(int(_srng.integers(1, 5)), 3)).astype("float32") for _ in range(4)]
        for _ in range(2)]


def np_sequences(net):
    npx.set_np()
    tr = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.05})
    out = []
    for mb in SEQS:
        with autograd.record():
            ys = [net(np.array(s)) for s in mb]
            loss = np.stack([(y * y).sum() for y in ys]).sum()
        loss.backward()
        out += [loss.asnumpy()] + [y.asnumpy() for y in ys] + grads_of(net)
        tr.step(len(mb))
    return out + params_of(net)


@POLICY
@pytest.mark.parametrize("model", ["np_cell_loop", "fused_gru_ntc"])
def test_np_sequence_models_per_sample(policy, model):
    cls = NpSeq if model == "np_cell_loop" else NpFusedGRU
    want, got = both(made_in_np_mode(cls), np_sequences, policy)
    assert want.error is None, want
    same_or_clear(want, got, "%s under %s" % (model, policy), r"npseq\d+|npcell\d+|gru\d+")


# -- 5. what plain Gluon refuses under set_np: rnn.GRUCell -----------------------------------
def gru_cell_steps(cell):
    npx.set_np()
    h = [np.zeros((1, 4))]
    with autograd.record():
        for t in range(2):
            y, h = cell(np.ones((1, 3)) * (t + 1), h)
    return [y.asnumpy()]


@POLICY
def test_gru_cell_under_set_np_is_refused_as_plain_gluon_refuses_it(policy):
    """MXNet 1.9.1's GRUCell calls legacy operators (``F.FullyConnected``),
    which refuse np arrays; flagged, the same TypeError, not a result."""
    want, got = both(made_in_np_mode(rnn.GRUCell, 4, input_size=3), gru_cell_steps, policy)
    assert isinstance(want.error, TypeError), want
    same_or_clear(want, got, "GRUCell under set_np (%s)" % policy, r"grucell\d+")


# -- 6. a forward branching on the training mode ---------------------------------------------
class NpAsksMode(HybridBlock):
    def __init__(self, **kw):
        super(NpAsksMode, self).__init__(**kw)
        with self.name_scope():
            self.d = nn.Dense(H, in_units=5)

    def hybrid_forward(self, F, x):
        h = self.d(x)
        if autograd.is_training():
            h = h * 0.5
        return F.np.tanh(h)


def train_then_eval(net):
    npx.set_np()
    xs = [np.array(x) for x in MLP_X[0]]
    with autograd.record():
        ys = [net(x) for x in xs]
        loss = np.stack([(y * y).sum() for y in ys]).sum()
    loss.backward()
    ev = [net(x) for x in xs]
    with autograd.record(train_mode=False):
        pm = [net(x) for x in xs]
    return [loss.asnumpy()] + [y.asnumpy() for y in ys + ev + pm] + grads_of(net)


@POLICY
def test_np_forward_branching_on_the_training_mode(policy):
    want, got = both(made_in_np_mode(NpAsksMode), train_then_eval, policy)
    assert want.error is None, want
    same_or_clear(want, got, "is_training branch under set_np (%s)" % policy, r"npasksmode\d+")


# -- 6b. random draws and BatchNorm in training under set_np ---------------------------------
class NpNoisyBN(HybridBlock):
    """Per sample (1, C, T): Dense over C at each step, BatchNorm (training: over
    the sample's T steps), Dropout, and np.random noise of the sample's shape."""

    def __init__(self, **kw):
        super(NpNoisyBN, self).__init__(**kw)
        with self.name_scope():
            self.d = nn.Dense(4, in_units=3, flatten=False)
            self.bn = nn.BatchNorm(in_channels=4, axis=1)
            self.drop = nn.Dropout(0.3)

    def hybrid_forward(self, F, x):                        # x: (1, T, 3)
        h = F.np.transpose(self.d(x), (0, 2, 1))           # (1, 4, T)
        h = self.drop(self.bn(h))
        return h + 0.1 * F.np.random.normal(0, 1, size=(1, 4, 5))


BN_X = [np_rows(("np-bn", i), 1, 15) for i in range(4)]


def np_noisy_bn(net):
    npx.set_np()
    tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    out = []
    for it in range(2):
        mx.random.seed(7 + it)
        with autograd.record():
            ys = [net(np.array(x[0]).reshape(1, 5, 3)) for x in BN_X]
            loss = np.stack([(y * y).sum() for y in ys]).sum()
        loss.backward()
        tr.step(len(ys))
        out += [loss.asnumpy()] + [y.asnumpy() for y in ys] + grads_of(net)
    out += [net(np.array(x[0]).reshape(1, 5, 3)).asnumpy() for x in BN_X[:2]]   # inference
    return out + params_of(net)       # running statistics included


@POLICY
def test_np_dropout_noise_and_batchnorm_in_training_seeded(policy):
    want, got = both(made_in_np_mode(NpNoisyBN), np_noisy_bn, policy)
    assert want.error is None, want
    same_or_clear(want, got, "np Dropout/noise/BatchNorm under %s" % policy, r"npnoisybn\d+")


# -- 7. graph rewrites under set_np: PReLU, a block that returns its input -------------------
class NpPReLUNet(HybridBlock):
    def __init__(self, **kw):
        super(NpPReLUNet, self).__init__(**kw)
        with self.name_scope():
            self.d = nn.Dense(H, in_units=5)
            self.act = nn.PReLU(alpha_initializer=mx.init.Constant(0.25))
            self.out = nn.Dense(2, in_units=H)

    def hybrid_forward(self, F, x):
        return self.out(self.act(self.d(x)))


class NoProjection(gluon.Block):
    """Per-sample model whose projection is an empty HybridSequential where the
    sizes already match (a common way to write "no projection")."""

    def __init__(self, **kw):
        super(NoProjection, self).__init__(**kw)
        with self.name_scope():
            self.d = nn.Dense(H, in_units=5)
            self.proj = nn.HybridSequential()
            self.out = nn.Dense(2, in_units=H)

    def forward(self, x):
        return self.out(np.tanh(self.proj(self.d(x))))


def np_regression(net):
    npx.set_np()
    tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.3})
    out = []
    for xs in MLP_X[:2]:
        with autograd.record():
            ys = [net(np.array(x)) for x in xs]
            loss = np.stack([(y * y).sum() for y in ys]).sum()
        loss.backward()
        out += [loss.asnumpy()] + [y.asnumpy() for y in ys] + grads_of(net)
        tr.step(len(xs))
    return out + params_of(net)


@pytest.mark.parametrize("policy", ["auto", "agenda"])
def test_np_prelu_in_a_flagged_block(policy):
    """Until 2026-11-26 MXNet's bare TypeError: jitbatch's rewrite reloaded the
    traced np graph as a legacy Symbol (kept an np symbol now)."""
    want, got = both(made_in_np_mode(NpPReLUNet), np_regression, policy)
    assert want.error is None, want
    same_or_clear(want, got, "PReLU under set_np (%s)" % policy, r"npprelunet\d+|prelu\d+")


@pytest.mark.parametrize("policy", ["auto", "agenda"])
def test_np_block_with_an_empty_sequential_as_its_projection(policy):
    """Until 2026-11-26 the same TypeError (the copied_inputs rewrite)."""
    want, got = both(made_in_np_mode(NoProjection), np_regression, policy)
    assert want.error is None, want
    same_or_clear(want, got, "identity child under set_np (%s)" % policy, r"hybridsequential\d+")


# -- 8. jitbatch.map under set_np -----------------------------------------------------------
def mapped(use_map):
    def program(net):
        npx.set_np()
        xs = [np.array(x) for x in MLP_X[1]]
        seen = []

        def fn(x):
            seen.append(np_state())
            y = npx.softmax(net(x))
            return y, (y * y).sum()
        with autograd.record():
            res = jitbatch.map(fn, xs) if use_map else list(map(fn, xs))
            loss = np.stack([r[1] for r in res]).sum()
        loss.backward()
        assert all(s == (True, True) for s in seen), "np mode inside the calls: %s" % seen
        return [loss.asnumpy()] + [r[0].asnumpy() for r in res] + grads_of(net)
    return program


@pytest.mark.parametrize("policy", ["auto", "agenda"])
def test_jitbatch_map_under_set_np(policy):
    """Until 2026-11-26 map's worker threads ran in legacy mode (MXNet keeps
    np mode per thread): they take the caller's NumPy-interface state now."""
    want = run(made_in_np_mode(NpMLP), mapped(False), None)
    assert want.error is None, want
    got = run(made_in_np_mode(NpMLP), mapped(True), policy)
    same_or_clear(want, got, "jitbatch.map under set_np (%s)" % policy, r"npmlp\d+|map")


def test_legacy_map_after_a_map_under_set_np_runs_in_legacy_mode():
    """Whatever a map under set_np did, its worker threads are not left in np mode:
    a later legacy ``jitbatch.map`` gives the plain loop's numbers."""
    try:
        run(made_in_np_mode(NpMLP), mapped(True), "agenda")
    finally:
        npx.reset_np()
    xs = [nd.array(x) for x in MLP_X[2]]

    def program(use_map):
        def prog(net):
            seen = []

            def fn(x):
                seen.append(np_state())
                return net(x), nd.sum(net(x) ** 2)
            with autograd.record():
                res = jitbatch.map(fn, xs) if use_map else [fn(x) for x in xs]
                loss = nd.add_n(*[r[1] for r in res])
            loss.backward()
            assert all(s == (False, False) for s in seen), "np mode inside the calls: %s" % seen
            return [loss.asnumpy()] + [r[0].asnumpy() for r in res] + grads_of(net)
        return prog
    want = run(legacy(LegacyMLP), program(False), None)
    got = run(legacy(LegacyMLP), program(True), "agenda")
    assert want.error is None, want
    assert got.error is None, got
    same_arrays(want.arrays, got.arrays, "legacy jitbatch.map after one under set_np")


# -- 9. a use_np block class called from legacy-mode code ------------------------------------
@mx.util.use_np
class UseNpNet(HybridBlock):
    def __init__(self, **kw):
        super(UseNpNet, self).__init__(**kw)
        with self.name_scope():
            self.a = nn.Dense(H, in_units=5)
            self.b = nn.Dense(3, in_units=H)

    def hybrid_forward(self, F, x):
        return F.npx.softmax(self.b(F.np.tanh(self.a(x))))


def use_np_from_legacy_code(net):
    """np arrays, np operators that keep the axes (legacy shape semantics stay on)."""
    xs = [np.array(x) for x in MLP_X[0]]
    with autograd.record():
        ys = [net(x) for x in xs]
        loss = np.concatenate([(y * y).sum(axis=1) for y in ys], axis=0)
    loss.backward()
    return [loss.asnumpy()] + [y.asnumpy() for y in ys] + grads_of(net)


def _make_use_np():
    mx.random.seed(0)
    net = UseNpNet()        # use_np: its __init__ runs in np mode: np parameters
    net.initialize(mx.init.Uniform(0.5))
    return net


@pytest.mark.xfail(condition=bool(jitbatch.compiled_modules()), strict=True,
                   raises=AssertionError, reason=(
    "differs by build, crash plain Gluon does not have: mx.util.use_np wraps a class's "
    "Python functions only (inspect.isfunction); compiled, jitbatch's Block.__call__ / "
    "HybridBlock.forward (patch._call, patch._forward) are Cython functions it leaves "
    "unwrapped, so np mode is on only inside hybrid_forward: the call is recorded like a "
    "legacy one and returns a legacy LazyArray, and the np loss refuses it "
    "(_npi_concatenate: 'can only accept MXNet numpy ndarrays'). From source "
    "(JITBATCH_PURE=1) the wrapped call sees np mode and runs as plain Gluon"))
@pytest.mark.parametrize("policy", ["auto", "agenda"])
def test_a_use_np_block_class_called_from_legacy_mode_code(policy):
    want, got = both(_make_use_np, use_np_from_legacy_code, policy)
    assert want.error is None, want
    same_or_clear(want, got, "use_np class from legacy code (%s)" % policy, r"usenpnet\d+")


# -- 10. a legacy model and an np model in one process ---------------------------------------
class LegacyMLP(HybridBlock):
    def __init__(self, **kw):
        super(LegacyMLP, self).__init__(**kw)
        with self.name_scope():
            self.a = nn.Dense(H, in_units=5, activation="tanh")
            self.b = nn.Dense(3, in_units=H)

    def hybrid_forward(self, F, x):
        return self.b(self.a(x))


def make_pair():
    return [legacy(LegacyMLP)(), made_in_np_mode(NpMLP)()]


def alternating(nets):
    """Minibatches alternate: the legacy model, then set_np and the np model, then
    reset_np; a Trainer each; the np state checked after each switch."""
    leg, npm = nets
    tl = gluon.Trainer(leg.collect_params(), "sgd", {"learning_rate": 0.3})
    npx.set_np()            # an np model's Trainer is made in np mode (its updater's type)
    tn = gluon.Trainer(npm.collect_params(), "adam", {"learning_rate": 0.05})
    npx.reset_np()
    ce = gluon.loss.SoftmaxCrossEntropyLoss()
    out, launches = [], []
    for it in range(3):
        xs = MLP_X[it]
        jitbatch.reset_stats()
        with autograd.record():
            loss = nd.add_n(*[nd.sum(leg(nd.array(x)) ** 2) for x in xs])
        loss.backward()
        tl.step(len(xs))
        out += [loss.asnumpy()] + grads_of(leg)
        launches.append((jitbatch.stats()["nodes"], jitbatch.stats()["launches"]))
        npx.set_np()
        assert np_state() == (True, True)
        with autograd.record():
            losses = [ce(npm(np.array(x)), np.array([float(y)])) for x, y in zip(xs, MLP_Y[it])]
        autograd.backward(losses)
        tn.step(len(xs))
        out += [l.asnumpy() for l in losses] + grads_of(npm)
        npx.reset_np()
        assert np_state() == (False, False)
    out += params_of(leg, npm)
    return out + [onp.array(launches, dtype="float64")]


@POLICY
def test_legacy_and_np_models_alternate_minibatches(policy):
    want, got = both(make_pair, alternating, policy)
    assert want.error is None, want
    assert got.error is None, got
    same_arrays(want.arrays[:-1], got.arrays[:-1], "alternating models under %s" % policy)
    if policy in ("depth", "agenda"):
        nodes, launches = got.arrays[-1].T
        assert (launches < nodes).all(), "legacy minibatches did not merge: %s" % got.arrays[-1]


# -- 11. conversions: as_np_ndarray of pending legacy outputs, as_nd_ndarray of np outputs ---
def legacy_into_np_loss(how, when):
    def program(net):
        xs = [nd.array(x) for x in MLP_X[1]]
        with autograd.record():
            ys = [net(x) for x in xs]
            if when == "set_np_first":
                npx.set_np()
            if how == "each":
                zs = [y.as_np_ndarray() for y in ys]
            elif how == "row":
                zs = [y[0].as_np_ndarray() for y in ys]
            else:
                zs = [nd.concat(*ys, dim=0).as_np_ndarray()]
            npx.set_np()
            loss = np.stack([(npx.softmax(z) * z).sum() for z in zs]).sum()
        loss.backward()
        return [loss.asnumpy()] + [y.asnumpy() for y in ys] + grads_of(net)
    return program


@pytest.mark.parametrize("how,when,policy", [
    ("each", "set_np_first", "agenda"), ("each", "set_np_after", "depth"),
    ("each", "set_np_first", "auto"), ("each", "set_np_after", "sequential"),
    ("row", "set_np_first", "agenda"), ("concat", "set_np_after", "agenda")])
def test_as_np_ndarray_of_pending_legacy_outputs_into_an_np_loss(how, when, policy):
    want, got = both(legacy(LegacyMLP), legacy_into_np_loss(how, when), policy)
    assert want.error is None, want
    same_or_clear(want, got, "as_np_ndarray (%s, %s) under %s" % (how, when, policy),
                  r"legacymlp\d+")
    if policy in ("depth", "agenda"):
        assert merged(got.stats), got.stats


class LegacyHead(HybridBlock):
    def __init__(self, **kw):
        super(LegacyHead, self).__init__(**kw)
        with self.name_scope():
            self.d = nn.Dense(3, in_units=4)

    def hybrid_forward(self, F, x):
        return F.softmax(self.d(x))


class NpEncoder(HybridBlock):
    def __init__(self, **kw):
        super(NpEncoder, self).__init__(**kw)
        with self.name_scope():
            self.d = nn.Dense(4, in_units=5)

    def hybrid_forward(self, F, x):
        return F.np.tanh(self.d(x))


def np_encoder_legacy_head(nets):
    enc, head = nets
    weights = nd.array([[1.0, 2.0, 3.0]])
    with autograd.record():
        npx.set_np()
        zs = [enc(np.array(x)).as_nd_ndarray() for x in MLP_X[2]]
        npx.reset_np()
        ys = [head(z) for z in zs]
        loss = nd.add_n(*[nd.sum(y * weights) for y in ys])
    loss.backward()
    return [loss.asnumpy()] + [y.asnumpy() for y in ys] + grads_of(enc, head)


@POLICY
def test_as_nd_ndarray_of_np_encoder_outputs_into_a_flagged_legacy_head(policy):
    make = lambda: [made_in_np_mode(NpEncoder)(), legacy(LegacyHead)()]  # noqa: E731
    want, got = both(make, np_encoder_legacy_head, policy)
    assert want.error is None, want
    same_or_clear(want, got, "np encoder -> legacy head under %s" % policy,
                  r"npencoder\d+|legacyhead\d+")
    if policy in ("depth", "agenda"):
        assert merged(got.stats), got.stats


# -- 12. set_np turned on while legacy calls pend ---------------------------------------------
def gru_chain(cell, steps=2):
    xs = [nd.array(rng_for("chain", i).normal(size=(steps, 3))) for i in range(3)]
    with autograd.record():
        ys = []
        for x in xs:
            h = [nd.zeros((1, 4))]
            for t in range(steps):
                y, h = cell(x[t:t + 1], h)
            ys.append(y)
        loss = nd.add_n(*[nd.sum(y * y) for y in ys])
    return xs, ys, loss


def pending_then_set_np(cell, reset=True):
    """A legacy minibatch recorded, then np mode turned on (an np evaluation, a
    library that calls set_np) before its backward: the flush runs in np mode."""
    _, ys, loss = gru_chain(cell)
    npx.set_np()
    loss.backward()
    state = np_state()
    if not reset:
        return [loss.asnumpy()]
    npx.reset_np()
    assert state == (True, True), "np mode changed by the flush: %s" % (state,)
    return [loss.asnumpy()] + [y.asnumpy() for y in ys] + grads_of(cell)


@pytest.mark.parametrize("policy,granularity", [
    ("auto", "auto"), ("depth", "split"),
    ("agenda", "auto"), ("depth", "block"), ("sequential", "auto")])
def test_legacy_calls_pending_when_set_np_is_turned_on(policy, granularity):
    """Until 2026-11-26 the flush ran in the caller's np mode and the stage
    planning raised MXNet's bare TypeError: a flush of a legacy graph runs
    with the NumPy interface off now."""
    make = legacy(rnn.GRUCell, 4, input_size=3)
    want = run(make, pending_then_set_np, None)
    got = run(make, pending_then_set_np, policy, granularity)
    assert want.error is None, want
    same_or_clear(want, got, "legacy GRUCell chain flushed under set_np (%s, %s)"
                  % (policy, granularity), r"grucell\d+")


def np_minibatch_while_legacy_calls_pend(nets):
    """A legacy recurrent minibatch recorded (its backward and its predictions
    pending) while an np model trains a minibatch with Adam: the np Trainer's
    first step makes its states with ``nd.zeros``, which jitbatch records while
    the legacy graph pends, so the step itself runs that graph, in np mode. The
    user turns np mode off again before the legacy backward."""
    cell, npm = nets
    npx.set_np()
    tn = gluon.Trainer(npm.collect_params(), "adam", {"learning_rate": 0.05})
    npx.reset_np()
    ce = gluon.loss.SoftmaxCrossEntropyLoss()
    out = []
    for it in range(2):
        xs, ys, loss = gru_chain(cell)
        npx.set_np()
        with autograd.record():
            losses = [ce(npm(np.array(x)), np.array([float(y)]))
                      for x, y in zip(MLP_X[it], MLP_Y[it])]
        autograd.backward(losses)
        tn.step(len(losses))
        out += [l.asnumpy() for l in losses] + grads_of(npm)
        npx.reset_np()
        loss.backward()
        out += [loss.asnumpy()] + [y.asnumpy() for y in ys] + grads_of(cell)
    return out + params_of(npm)


@pytest.mark.parametrize("policy", POLICIES)
def test_an_np_models_adam_step_while_legacy_recurrent_calls_pend(policy):
    """Until 2026-11-26 the same TypeError out of the np Trainer's step."""
    make = lambda: [legacy(rnn.GRUCell, 4, input_size=3)(), made_in_np_mode(NpMLP)()]  # noqa: E731
    want, got = both(make, np_minibatch_while_legacy_calls_pend, policy)
    assert want.error is None, want
    same_or_clear(want, got, "np Adam step while a legacy GRUCell chain pends (%s)" % policy,
                  r"grucell\d+|npmlp\d+")
    if policy in ("depth", "agenda"):
        assert merged(got.stats), got.stats


# -- 12b. arrays of the other interface fed to a model ---------------------------------------
def np_arrays_into(net):
    """np arrays given to a legacy model, np mode off (the user forgot set_np)."""
    xs = [np.array(x) for x in MLP_X[0]]
    with autograd.record():
        ys = [net(x) for x in xs]
    return [y.asnumpy() for y in ys]


def nd_arrays_into(net):
    """legacy arrays given to an np model under set_np."""
    npx.set_np()
    xs = [nd.array(x) for x in MLP_X[0]]
    with autograd.record():
        ys = [net(x) for x in xs]
    return [y.asnumpy() for y in ys]


@pytest.mark.parametrize("policy", ["auto", "agenda"])
def test_np_arrays_into_a_flagged_legacy_model_without_set_np(policy):
    """Until 2026-11-26 a BatchingError 'could not be traced' wrapping MXNet's
    TypeError: a TypeError in tracing is raised as is now, as plain Gluon does."""
    want, got = both(legacy(LegacyMLP), np_arrays_into, policy)
    assert isinstance(want.error, TypeError), want
    same_or_clear(want, got, "np arrays into a legacy model (%s)" % policy, r"legacymlp\d+")


@POLICY
def test_legacy_arrays_into_a_flagged_np_model_under_set_np(policy):
    want, got = both(made_in_np_mode(NpMLP), nd_arrays_into, policy)
    assert isinstance(want.error, TypeError), want
    same_or_clear(want, got, "legacy arrays into an np model (%s)" % policy, r"npmlp\d+")


class NpDeferred(HybridBlock):
    """Layers without in_units: shapes inferred at the first call, under set_np."""

    def __init__(self, **kw):
        super(NpDeferred, self).__init__(**kw)
        with self.name_scope():
            self.a = nn.Dense(H)
            self.b = nn.Dense(2)

    def hybrid_forward(self, F, x):
        return self.b(F.npx.relu(self.a(x)))


@POLICY
def test_np_model_with_deferred_shapes(policy):
    want, got = both(made_in_np_mode(NpDeferred), np_regression, policy)
    assert want.error is None, want
    same_or_clear(want, got, "np model with deferred shapes (%s)" % policy, r"npdeferred\d+")


# -- 13. after an error: the next legacy minibatch, and np mode as the user set it -----------
def failing_step(kind):
    """Something that raises today (or would, were it not fixed), under set_np."""
    if kind == "gru_cell_under_np":
        cell = made_in_np_mode(rnn.GRUCell, 4, input_size=3)()
        flag(cell, "agenda")
        return lambda: gru_cell_steps(cell)
    if kind == "prelu_under_np":
        net = made_in_np_mode(NpPReLUNet)()
        flag(net, "agenda")
        return lambda: np_regression(net)
    cell = legacy(rnn.GRUCell, 4, input_size=3)()
    flag(cell, "auto")
    return lambda: pending_then_set_np(cell, reset=False)


@pytest.mark.parametrize("kind", ["gru_cell_under_np", "prelu_under_np", "flush_under_np"])
def test_the_next_legacy_minibatch_after_an_np_mode_error(kind):
    step = failing_step(kind)
    try:
        step()
    except Exception:  # pylint: disable=broad-except
        pass
    state = np_state()
    npx.reset_np()
    # the user's own set_np() stays on, error or not (nothing jitbatch undid or added)
    assert state == (True, True), state
    cleanup()

    def legacy_mb(net):
        _, ys, loss = gru_chain(net, steps=3)
        loss.backward()
        return [loss.asnumpy()] + [y.asnumpy() for y in ys] + grads_of(net)
    make = legacy(rnn.GRUCell, 4, input_size=3)
    want = run(make, legacy_mb, None)
    got = run(make, legacy_mb, "agenda")
    assert want.error is None and got.error is None, (want, got)
    same_arrays(want.arrays, got.arrays, "legacy minibatch after %s" % kind)
    assert merged(got.stats), got.stats
    assert np_state() == (False, False)


# -- 14. one parameter-free flagged block used in both modes ---------------------------------
def act_both_modes(order):
    def program(act):
        out = []
        for mode in order:
            rows = np_rows(("act", mode), 3, 4)
            if mode == "np":
                npx.set_np()
                xs = [np.array(r) for r in rows]
            else:
                npx.reset_np()
                xs = [nd.array(r) for r in rows]
            for x in xs:
                x.attach_grad()
            with autograd.record():
                ys = [act(x) for x in xs]
                loss = sum((y * y).sum() for y in ys[1:]) + (ys[0] * ys[0]).sum()
            loss.backward()
            out += [loss.asnumpy()] + [y.asnumpy() for y in ys] + [x.grad.asnumpy() for x in xs]
            npx.reset_np()
        return out
    return program


@pytest.mark.parametrize("order", [("nd", "np"), ("np", "nd")])
@pytest.mark.parametrize("policy", ["agenda", "auto"])
def test_a_parameter_free_flagged_block_in_both_modes(order, policy):
    """Until 2026-11-26 MXNet's bare TypeError at the call or the read: the
    graph traced in one mode of the NumPy interface ran in the other; a
    flagged block traced in the other mode traces again now."""
    want, got = both(lambda: nn.Activation("tanh"), act_both_modes(order), policy)
    assert want.error is None, want
    same_or_clear(want, got, "nn.Activation in modes %s under %s" % (order, policy),
                  r"activation\d+")


# -- 15. found along the way: the user's static_alloc flag beside dynamic_batch --------------
class ResidualTanh(HybridBlock):
    """``tanh(x + Dense(c))``; ``x`` needs no gradient."""

    def __init__(self, **kw):
        super(ResidualTanh, self).__init__(**kw)
        with self.name_scope():
            self.d = nn.Dense(4, in_units=4)

    def hybrid_forward(self, F, x, c):
        if mx.util.is_np_array():
            return F.np.tanh(x + self.d(c))
        return F.tanh(x + self.d(c))


def residual_static(mode, flags):
    def make():
        if mode == "np":
            return made_in_np_mode(ResidualTanh)()
        return legacy(ResidualTanh)()

    def program(net):
        if mode == "np":
            npx.set_np()
        arr = np.array if mode == "np" else nd.array
        rng = rng_for("static-alloc", mode)
        xs = [arr(rng.normal(size=(1, 4)).astype("float32")) for _ in range(6)]
        cs = [arr(rng.normal(size=(1, 4)).astype("float32")) for _ in range(6)]
        with autograd.record():
            ys = [net(x, c) for x, c in zip(xs, cs)]
            losses = [(y * y).sum() for y in ys]
        autograd.backward(losses)
        return [l.asnumpy() for l in losses] + [y.asnumpy() for y in ys] + grads_of(net)

    def flagged(policy):
        return lambda n: program(n) if policy is None else (
            n.hybridize(dynamic_batch=True, policy=policy, **flags), program(n))[1]
    return make, flagged


@pytest.mark.parametrize("mode", ["legacy", "np"])
@pytest.mark.parametrize("flags", [{"static_alloc": True},
                                   {"static_alloc": True, "static_shape": True}])
@pytest.mark.parametrize("policy", ["auto", "agenda", "sequential"])
def test_the_users_static_alloc_flag_beside_dynamic_batch_in_training(mode, flags, policy):
    """Until 2026-11-26 silently wrong gradients in legacy mode: the user's
    static_alloc beside dynamic_batch made the block's own CachedOp static,
    which MXNet 1.9.1 differentiates wrongly (plain hybridize(static_alloc=True)
    too); a flagged block's CachedOp stays dynamic now (jitbatch gives its
    inference launches static memory itself)."""
    make, flagged = residual_static(mode, flags)
    want = run(make, flagged(None), None)
    got = run(make, flagged(policy), None)     # flagged by the program, with the user's flags
    assert want.error is None, want
    same_or_clear(want, got, "static_alloc %s beside dynamic_batch (%s, %s)"
                  % (flags, mode, policy), r"residualtanh\d+")
