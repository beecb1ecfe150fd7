"""Held-out per-sample models, round 2: areas round 1 (tests/test_heldout.py)
did not cover, written naively, as a user writes plain Gluon for ONE sample:
every ``gluon.loss`` loss, float64/float16 and integer inputs, gradient
plumbing (``grad_req='add'``, input gradients, several backward passes, sparse
embedding gradients through a Trainer), NDArray operators and Python-side use
of lazy arrays between blocks, and more Gluon blocks and RNN cells.

The oracle is plain per-sample Gluon on the same parameters and inputs
(``tests/harness.py``): outputs, gradients and, where a Trainer steps, the
updated parameters. Where jitbatch is known to fail, the test is a strict
xfail whose reason says the class of the failure (silent wrong number or
gradient, crash, unclear error, missed merge); a crash runs in a subprocess.
"""
import warnings

import numpy as np
import pytest
from mxnet import autograd, gluon, nd
from mxnet.gluon import HybridBlock, nn, rnn
from mxnet.gluon.contrib.nn import Identity

import jitbatch
from harness import assert_same, check_model, run
from heldout import (contract_warnings, grads_of, initialized, merged,  # noqa: F401
                     nothing_pending, rng_for, run_in_subprocess, same_arrays, square_loss,
                     values_of)
from oracle import cleanup

POLICIES = ["auto", "depth", "agenda"]
#: one granularity per policy where running every pair would be slow
GRANULARITY_OF = {"auto": "auto", "depth": "block", "agenda": "split"}
TRAIN = pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])


def sum_loss(y):
    """A loss that weighs every entry differently (so that a permutation of
    rows or entries shows)."""
    y = y if y.dtype == np.float32 else nd.cast(y, dtype="float32")
    return nd.sum(y * nd.sin(nd.arange(y.size).reshape(y.shape) + 1))


# -- 1. every gluon.loss on per-sample lazy outputs ------------------------------------------
L = gluon.loss

#: name -> (loss, its arguments from the scores y (T, 4) and the sample)
LOSSES = {
    "L2": (L.L2Loss, lambda y, s: (y, s["target"])),
    "L2-weighted": (L.L2Loss, lambda y, s: (y, s["target"], s["weight"])),
    "L1": (L.L1Loss, lambda y, s: (y, s["target"])),
    "SCE-sparse": (L.SoftmaxCrossEntropyLoss, lambda y, s: (y, s["label"])),
    "SCE-sparse-weighted": (L.SoftmaxCrossEntropyLoss,
                            lambda y, s: (y, s["label"], s["weight"])),
    "SCE-dense": (lambda: L.SoftmaxCrossEntropyLoss(sparse_label=False),
                  lambda y, s: (y, nd.softmax(s["target"]))),
    "SCE-from-logits": (lambda: L.SoftmaxCrossEntropyLoss(from_logits=True),
                        lambda y, s: (nd.log_softmax(y), s["label"])),
    "SigmoidBCE": (L.SigmoidBinaryCrossEntropyLoss, lambda y, s: (y, s["target"] > 0)),
    "SigmoidBCE-from-sigmoid": (lambda: L.SigmoidBinaryCrossEntropyLoss(from_sigmoid=True),
                                lambda y, s: (nd.sigmoid(y), s["target"] > 0, s["weight"])),
    "KLDiv": (L.KLDivLoss, lambda y, s: (nd.log_softmax(y), nd.softmax(s["target"]))),
    "Huber": (lambda: L.HuberLoss(rho=0.5), lambda y, s: (y, s["target"])),
    "Hinge": (L.HingeLoss, lambda y, s: (y, nd.sign(s["target"]))),
    "SquaredHinge": (L.SquaredHingeLoss, lambda y, s: (y, nd.sign(s["target"]))),
    "Logistic": (L.LogisticLoss, lambda y, s: (y, nd.sign(s["target"]))),
    "Triplet": (L.TripletLoss, lambda y, s: (y, s["target"], s["target"] * 0.5)),
    "CosineEmbedding": (L.CosineEmbeddingLoss,
                        lambda y, s: (y, s["target"], s["sign"], s["weight"])),
}


class Scorer(gluon.Block):
    """Dense scores (T, 4) of a per-sample sequence of T rows; ``loss``, when
    given, is a child block (so ``hybridize(dynamic_batch=True)`` flags it)."""

    def __init__(self, loss=None, **kw):
        super(Scorer, self).__init__(**kw)
        with self.name_scope():
            self.inp = nn.Dense(5, in_units=3, activation="tanh")
            self.out = nn.Dense(4, in_units=5)
        self.loss = loss

    def forward(self, x):
        return self.out(self.inp(x))


def loss_samples(rng, n):
    out = []
    for _ in range(n):
        t = int(rng.integers(1, 4))
        out.append({"x": nd.array(rng.normal(size=(t, 3))),
                    "label": nd.array(rng.integers(0, 4, t)),
                    "target": nd.array(rng.normal(size=(t, 4))),
                    "weight": nd.array(rng.uniform(0.2, 1.0, size=(t, 1))),
                    "sign": nd.array(rng.choice([-1.0, 1.0], size=t))})
    return out


def loss_apply(name, mean, outside=None):
    """The loss of one sample: the net's child loss block, else ``outside``
    (a loss block that no ``hybridize`` reaches)."""
    def apply(net, sample):
        y = net(sample["x"])
        loss = net.loss if net.loss is not None else outside
        per_row = loss(*LOSSES[name][1](y, sample))
        return per_row, (nd.mean(per_row) if mean else nd.sum(per_row))
    return apply


@pytest.mark.parametrize("flag_loss", [False, True], ids=["loss-outside", "loss-flagged"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_loss_on_per_sample_outputs(name, policy, flag_loss):
    """Each loss on (T, 4) scores of ragged samples, averaged (even losses) or
    summed over the sample's rows, with sample weights where the loss takes
    them; the loss block runs between blocks or is itself flagged."""
    mean = sorted(LOSSES).index(name) % 2 == 0
    loss = LOSSES[name][0]()
    st = check_model(lambda: initialized(Scorer(loss if flag_loss else None)), loss_samples,
                     loss_apply(name, mean, outside=loss), rng_for("loss", name, policy, flag_loss),
                     6, True, policy)
    if policy != "auto":
        assert merged(st), st


@pytest.mark.parametrize("name", ["SCE-sparse-weighted", "KLDiv", "CosineEmbedding"])
def test_losses_in_inference(name):
    check_model(lambda: initialized(Scorer(LOSSES[name][0]())), loss_samples,
                loss_apply(name, False), rng_for("loss-infer", name), 6, False, "depth")


@pytest.mark.parametrize("policy", POLICIES)
def test_losses_under_map(policy):
    """Three losses of one sample summed, the samples side by side."""
    def apply(net, s):
        y = net(s["x"])
        parts = [L.SoftmaxCrossEntropyLoss()(y, s["label"], s["weight"]),
                 L.HuberLoss()(y, s["target"]),
                 L.CosineEmbeddingLoss()(y, s["target"], s["sign"])]
        return y, nd.add_n(*[nd.sum(p) for p in parts])
    net = initialized(Scorer())
    samples = loss_samples(rng_for("loss-map", policy), 6)
    ref = run(net, apply, samples, True, flag=False)
    got = run(net, apply, samples, True, flag=True, policy=policy, mapped=True)
    assert_same(ref, got)


def test_a_loss_reducing_to_a_scalar_is_a_clear_error():
    """PoissonNLLLoss returns the mean over ALL entries (not per row): flagged,
    it is the documented BatchingError naming the block and the fix; run
    between blocks (not flagged) it gives plain Gluon's numbers."""
    outside = L.PoissonNLLLoss()

    def apply(net, s):
        y = net(s["x"])
        loss = (net.loss if net.loss is not None else outside)(y, nd.abs(s["target"]))
        return y, loss.reshape((1,))
    check_model(lambda: initialized(Scorer()), loss_samples, apply, rng_for("poisson"), 5,
                True, "depth")
    net = initialized(Scorer(L.PoissonNLLLoss()))
    net.hybridize(dynamic_batch=True, policy="depth")
    try:
        with pytest.raises(jitbatch.BatchingError, match=r"poissonnllloss\d+.*axis 0.*Fix"):
            apply(net, loss_samples(rng_for("poisson-flag"), 1)[0])[1].asnumpy()
    finally:
        net.hybridize(active=False)


# -- 2. dtypes ----------------------------------------------------------------------------
class TwoLayer(HybridBlock):
    """Dense, tanh, Dense: cast as a whole with ``net.cast``."""

    def __init__(self, **kw):
        super(TwoLayer, self).__init__(**kw)
        with self.name_scope():
            self.a = nn.Dense(5, in_units=3, activation="tanh")
            self.b = nn.Dense(2, in_units=5)

    def hybrid_forward(self, F, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("policy", POLICIES)
@TRAIN
def test_float64_network(train, policy):
    def make():
        net = initialized(TwoLayer())
        net.cast("float64")
        return net

    def samples(rng, n):
        return [nd.array(rng.normal(size=(int(rng.integers(1, 3)), 3)), dtype="float64")
                for _ in range(n)]
    st = check_model(make, samples, square_loss, rng_for("f64", train, policy), 6, train,
                     policy)
    if policy != "auto":
        assert merged(st), st


class HalfStep(HybridBlock):
    """A recurrent step of elementwise operators (MXNet has no float16
    FullyConnected on CPU): ``tanh(h * w + x)``."""

    def __init__(self, **kw):
        super(HalfStep, self).__init__(**kw)
        with self.name_scope():
            self.w = self.params.get("w", shape=(1, 4))

    def hybrid_forward(self, F, x, h, w):
        return F.tanh(F.broadcast_mul(h, w) + x)


class HalfRNN(gluon.Block):
    """Embedding of the sample's float16 ids, the step over its rows, the
    final state cast back to float32 with ``nd.cast``."""

    def __init__(self, **kw):
        super(HalfRNN, self).__init__(**kw)
        with self.name_scope():
            self.embed = nn.Embedding(10, 4)
            self.step = HalfStep()

    def forward(self, ids):
        e = self.embed(ids)
        h = nd.zeros((1, 4), dtype="float16")
        for t in range(e.shape[0]):
            h = self.step(e[t:t + 1], h)
        return nd.cast(h, dtype="float32")


@pytest.mark.parametrize("policy", POLICIES)
@TRAIN
def test_float16_recurrent_network(train, policy):
    def make():
        net = initialized(HalfRNN())
        net.cast("float16")
        return net

    def samples(rng, n):
        return [nd.array(rng.integers(0, 10, int(rng.integers(1, 4))), dtype="float16")
                for _ in range(n)]
    net = make()
    data = samples(rng_for("f16", train, policy), 6)
    ref = run(net, square_loss, data, train, flag=False)
    jitbatch.reset_stats()
    got = run(net, square_loss, data, train, flag=True, policy=policy)
    assert_same(ref, got, rtol=2e-3, atol=2e-3)
    if policy != "auto":
        assert merged(jitbatch.stats()), jitbatch.stats()


class IdsToFloat64(gluon.Block):
    """Integer ids into a float32 Embedding and Dense, ``.astype('float64')``
    into a float64 Dense, ``.astype('float32')`` back."""

    def __init__(self, **kw):
        super(IdsToFloat64, self).__init__(**kw)
        with self.name_scope():
            self.embed = nn.Embedding(10, 4)
            self.lo = nn.Dense(3, in_units=4)
            self.hi = nn.Dense(2, in_units=3)
        self.hi.cast("float64")

    def forward(self, ids):
        h = self.lo(self.embed(ids))
        return self.hi(h.astype("float64")).astype("float32")


def ids_samples(dtype):
    def samples(rng, n):
        return [nd.array(rng.integers(0, 10, int(rng.integers(1, 4))), dtype=dtype)
                for _ in range(n)]
    return samples


@pytest.mark.parametrize("dtype", ["int32", "int64"])
@pytest.mark.parametrize("policy", POLICIES)
@TRAIN
def test_integer_ids_and_astype_between_blocks(train, policy, dtype):
    check_model(lambda: initialized(IdsToFloat64()), ids_samples(dtype), square_loss,
                rng_for("ids", train, policy, dtype), 6, train, policy)


@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_astype_between_blocks_merges(policy):
    st = check_model(lambda: initialized(IdsToFloat64()), ids_samples("int32"), square_loss,
                     rng_for("astype-merge", policy), 6, False, policy)
    assert merged(st) and st["flushes"] == 1, st


class PerDtype(HybridBlock):
    """A parameter-free block called with float32 and float64 samples."""

    def hybrid_forward(self, F, x):
        return F.tanh(x) * 2 + F.sigmoid(x)


class TwoDtypes(gluon.Block):
    """A float32 and a float64 Dense, chosen by the sample's dtype, then the
    shared parameter-free block, then ``nd.cast`` to float32."""

    def __init__(self, **kw):
        super(TwoDtypes, self).__init__(**kw)
        with self.name_scope():
            self.f32 = nn.Dense(3, in_units=3)
            self.f64 = nn.Dense(3, in_units=3)
            self.shared = PerDtype()
        self.f64.cast("float64")

    def forward(self, x):
        h = self.f64(x) if x.dtype == np.float64 else self.f32(x)
        return nd.cast(self.shared(h), dtype="float32")


@pytest.mark.parametrize("policy", POLICIES)
@TRAIN
def test_a_minibatch_of_two_dtypes(train, policy):
    def samples(rng, n):
        return [nd.array(rng.normal(size=(1, 3)), dtype="float64" if i % 2 else "float32")
                for i in range(n)]
    st = check_model(lambda: initialized(TwoDtypes()), samples, square_loss,
                     rng_for("two-dtypes", train, policy), 6, train, policy)
    if policy != "auto":
        assert merged(st), st


@pytest.mark.parametrize("policy", POLICIES)
def test_cast_after_a_dynamic_batch_run(policy):
    net = initialized(TwoLayer())
    xs = [nd.array(rng_for("recast", policy).normal(size=(1, 3))) for _ in range(4)]
    assert_same(run(net, square_loss, xs, True, flag=False),
                run(net, square_loss, xs, True, flag=True, policy=policy))
    net.cast("float64")
    xs64 = [x.astype("float64") for x in xs]
    ref = run(net, square_loss, xs64, True, flag=False)
    got = run(net, square_loss, xs64, True, flag=True, policy=policy)
    assert_same(ref, got)


class IdsAndFeatures(HybridBlock):
    """One call with int32 token ids and float32 features: ``tanh(x + embed(ids))``
    (plain ``hybridize()`` accepts the two dtypes in one call)."""

    def __init__(self, **kw):
        super(IdsAndFeatures, self).__init__(**kw)
        with self.name_scope():
            self.embed = nn.Embedding(10, 4)

    def hybrid_forward(self, F, ids, x):
        return F.tanh(x + self.embed(ids))


def test_int_ids_and_float_features_in_one_call():
    """Either the call gives plain Gluon's numbers, or the error's fix must not
    cast float data to an integer dtype."""
    net = initialized(IdsAndFeatures())
    rng = rng_for("ids-features")
    samples = [(nd.array(rng.integers(0, 10, 2), dtype="int32"),
                nd.array(rng.normal(size=(2, 4)))) for _ in range(3)]
    want = [net(*s).asnumpy() for s in samples]
    net.hybridize(dynamic_batch=True, policy="depth")
    try:
        got = [net(*s).asnumpy() for s in samples]
    except jitbatch.BatchingError as e:
        assert not any(t in str(e) for t in ("astype('int32')", "astype('int64')")), str(e)
    else:
        for a, b in zip(want, got):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    finally:
        net.hybridize(active=False)


# -- 3. gradient plumbing ------------------------------------------------------------------
class Encoder(HybridBlock):
    """Dense, tanh, Dropout (rate 0 unless set), Dense."""

    def __init__(self, rate=0.0, **kw):
        super(Encoder, self).__init__(**kw)
        with self.name_scope():
            self.a = nn.Dense(4, in_units=3, activation="tanh")
            self.drop = nn.Dropout(rate)
            self.b = nn.Dense(2, in_units=4)

    def hybrid_forward(self, F, x):
        return self.b(self.drop(self.a(x)))






def plain_and_batched(program, policy, make=lambda: initialized(Encoder()), **kw):
    """``program(net) -> list of numpy arrays`` run on a fresh net plain, then on
    another fresh net (same initial values) flagged; returns both and the
    batched run's stats."""
    net = make()
    want = program(net, **kw)
    net = make()
    net.hybridize(dynamic_batch=True, policy=policy)
    jitbatch.reset_stats()
    try:
        got = program(net, **kw)
    finally:
        cleanup()
        net.hybridize(active=False)
    return want, got, jitbatch.stats()


def minibatches(key, count=2, n=5):
    rng = rng_for(*key)
    return [[nd.array(rng.normal(size=(1, 3))) for _ in range(n)] for _ in range(count)]


def accumulate_then_step(net, batches, zero_each):
    """grad_req='add' over the minibatches and one Adam step after two
    (``zero_each``: a step and ``zero_grad`` after every minibatch instead)."""
    for p in net.collect_params().values():
        p.grad_req = "add"
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.1})
    net.collect_params().zero_grad()
    seen = []
    for i, batch in enumerate(batches):
        with autograd.record():
            ys = [net(x) for x in batch]
            loss = nd.add_n(*[nd.sum(y * y) for y in ys])
        loss.backward()
        if zero_each or i % 2 == 1:
            seen += grads_of(net)
            trainer.step(len(batch))
            net.collect_params().zero_grad()
    return seen + values_of(net)


@pytest.mark.parametrize("zero_each", [False, True], ids=["accumulate-2", "zero_grad-each"])
@pytest.mark.parametrize("policy", POLICIES)
def test_grad_req_add_accumulates_over_minibatches_then_steps(policy, zero_each):
    batches = minibatches(("add", policy, zero_each), count=4)
    want, got, st = plain_and_batched(accumulate_then_step, policy, batches=batches,
                                      zero_each=zero_each)
    same_arrays(want, got, "gradient or parameter after the steps")
    if policy != "auto":
        assert merged(st), st


def input_gradients(net, batch, how):
    """Gradients w.r.t. inputs that were ``attach_grad()``-ed: by
    ``autograd.grad`` (``create_graph=False``) or by ``backward``."""
    xs = [x.copy() for x in batch]
    for x in xs:
        x.attach_grad()
    with autograd.record():
        loss = nd.add_n(*[nd.sum(nd.square(net(x))) for x in xs])
    if how == "autograd.grad":
        gs = autograd.grad(loss, xs, create_graph=False)
        return [g.asnumpy() for g in gs]
    loss.backward()
    return [x.grad.asnumpy() for x in xs] + grads_of(net)


@pytest.mark.parametrize("how", ["autograd.grad", "backward"])
@pytest.mark.parametrize("policy", POLICIES)
def test_gradients_with_respect_to_attached_inputs(policy, how):
    want, got, _ = plain_and_batched(input_gradients, policy, batch=minibatches(("x", how))[0],
                                     how=how)
    same_arrays(want, got, "input gradient")


def slices_of_one_input(net, data):
    """Every sample is a row slice ``data[i:i+1]`` of ONE attached array."""
    data = data.copy()
    data.attach_grad()
    with autograd.record():
        loss = nd.add_n(*[nd.sum(nd.square(net(data[i:i + 1]))) for i in range(data.shape[0])])
    loss.backward()
    return [data.grad.asnumpy()] + grads_of(net)


@pytest.mark.parametrize("policy", POLICIES)
def test_samples_sliced_from_one_attached_input(policy):
    data = nd.array(rng_for("slices", policy).normal(size=(5, 3)))
    want, got, st = plain_and_batched(slices_of_one_input, policy, data=data)
    same_arrays(want, got, "gradient")
    if policy != "auto":
        assert merged(st), st


def two_losses_two_backwards(net, batch):
    """Two losses of one recording, ``backward(retain_graph=True)`` then
    ``backward()``, grad_req='add'."""
    for p in net.collect_params().values():
        p.grad_req = "add"
    net.collect_params().zero_grad()
    with autograd.record():
        ys = [net(x) for x in batch]
        first = nd.add_n(*[nd.sum(y * y) for y in ys])
        second = nd.add_n(*[nd.sum(nd.sin(y)) for y in ys])
    first.backward(retain_graph=True)
    after_first = grads_of(net)
    second.backward()
    return after_first + grads_of(net)


def backward_with_out_grad(net, batch):
    """The samples' outputs concatenated, ``backward(out_grad=...)``."""
    with autograd.record():
        y = nd.concat(*[net(x) for x in batch], dim=0)
    y.backward(out_grad=nd.array(np.arange(y.size).reshape(y.shape) - 3.0))
    return grads_of(net)


def backward_with_head_grads(net, batch):
    """``autograd.backward`` of every sample's output with its own head gradient."""
    with autograd.record():
        ys = [net(x) for x in batch]
    autograd.backward(ys, head_grads=[nd.full((1, 2), i - 2.0) for i in range(len(ys))])
    return grads_of(net)


def grad_of_parameters_with_head_grads(net, batch):
    """``autograd.grad`` of the outputs w.r.t. the parameters' arrays."""
    with autograd.record():
        ys = [net(x) for x in batch]
    params = [p.data() for p in net.collect_params().values()]
    gs = autograd.grad(ys, params, head_grads=[nd.full((1, 2), i + 1.0) for i in range(len(ys))])
    return [g.asnumpy() for g in gs]


def two_record_scopes(net, batch):
    """Half the samples recorded in one ``autograd.record()``, half in another,
    one backward."""
    with autograd.record():
        first = [net(x) for x in batch[:2]]
    with autograd.record():
        second = [net(x) for x in batch[2:]]
        loss = nd.add_n(*[nd.sum(y * y) for y in first + second])
    loss.backward()
    return grads_of(net)


def frozen_encoder(net, batch):
    """The first layer frozen (grad_req='null'), then everything frozen and
    the gradients w.r.t. the inputs (an adversarial example)."""
    net.a.collect_params().setattr("grad_req", "null")
    with autograd.record():
        loss = nd.add_n(*[nd.sum(nd.square(net(x))) for x in batch])
    loss.backward()
    out = grads_of(net)
    net.collect_params().setattr("grad_req", "null")
    xs = [x.copy() for x in batch]
    for x in xs:
        x.attach_grad()
    with autograd.record():
        loss = nd.add_n(*[nd.sum(nd.square(net(x))) for x in xs])
    loss.backward()
    return out + [x.grad.asnumpy() for x in xs]


def predict_mode_and_pause(net, batch):
    """Dropout(0.5) switched off with ``autograd.predict_mode()`` inside the
    recording, and a target computed under ``autograd.pause()`` mid-sample."""
    with autograd.record():
        outs = []
        for x in batch:
            with autograd.predict_mode():
                y = net(x)
            with autograd.pause():
                target = net(x * 0.5)
            outs.append(y - target)
        loss = nd.add_n(*[nd.sum(o * o) for o in outs])
    loss.backward()
    return [o.asnumpy() for o in outs] + grads_of(net)


@pytest.mark.parametrize("program", [two_losses_two_backwards, backward_with_out_grad,
                                     backward_with_head_grads,
                                     grad_of_parameters_with_head_grads, two_record_scopes,
                                     frozen_encoder, predict_mode_and_pause],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("policy", POLICIES)
def test_gradient_plumbing(policy, program):
    rate = 0.5 if program is predict_mode_and_pause else 0.0
    want, got, st = plain_and_batched(program, policy, make=lambda: initialized(Encoder(rate)),
                                      batch=minibatches(("plumbing", program.__name__))[0])
    same_arrays(want, got, "value or gradient")
    if policy != "auto":
        assert merged(st), st


class SparseBag(gluon.Block):
    """Mean of a ``sparse_grad=True`` embedding over the sample's (1, T) ids, Dense."""

    def __init__(self, **kw):
        super(SparseBag, self).__init__(**kw)
        with self.name_scope():
            self.embed = nn.Embedding(12, 4, sparse_grad=True)
            self.out = nn.Dense(2, in_units=4)

    def forward(self, ids):
        return self.out(nd.mean(self.embed(ids), axis=1))


def sparse_training(net, batches, optimizer):
    trainer = gluon.Trainer(net.collect_params(), optimizer, {"learning_rate": 0.1})
    out = []
    for batch in batches:
        with autograd.record():
            loss = nd.add_n(*[nd.sum(nd.square(net(ids))) for ids in batch])
        loss.backward()
        grad = net.embed.weight.grad()
        assert grad.stype == "row_sparse", grad.stype
        out += [grad.tostype("default").asnumpy(), net.out.weight.grad().asnumpy().copy()]
        trainer.step(len(batch))
    return out + values_of(net)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("policy", POLICIES)
def test_sparse_embedding_gradient_through_a_trainer(policy, optimizer):
    """A row_sparse gradient, and the parameters after two Trainer steps."""
    rng = rng_for("sparse", policy, optimizer)
    batches = [[nd.array(rng.integers(0, 12, (1, int(rng.integers(1, 4))))) for _ in range(5)]
               for _ in range(2)]
    want, got, st = plain_and_batched(sparse_training, policy,
                                      make=lambda: initialized(SparseBag()), batches=batches,
                                      optimizer=optimizer)
    same_arrays(want, got, "gradient or parameter after the step")
    if policy != "auto":
        assert merged(st), st


def backward_per_sample(net, batch, mapped=False):
    """Record the minibatch, then one ``backward()`` per sample's loss
    (grad_req='add'): the loop a user writes to accumulate per-sample losses.
    ``mapped``: record and backward inside ``jitbatch.map``, one sample each."""
    for p in net.collect_params().values():
        p.grad_req = "add"
    net.collect_params().zero_grad()
    if mapped:
        def one(x):
            with autograd.record():
                loss = nd.sum(nd.square(net(x)))
            loss.backward()
            return loss
        losses = jitbatch.map(one, batch)
    else:
        with autograd.record():
            losses = [nd.sum(nd.square(net(x))) for x in batch]
        for loss in losses:
            loss.backward()
    return [loss.asnumpy() for loss in losses] + grads_of(net)


@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_one_backward_per_sample_is_a_clear_error(policy):
    """Plain Gluon runs one backward() per sample's loss. Merged, the samples
    share their launches and the first backward() frees them: a BatchingError
    that says so and gives the fix (one backward() of the sum), not MXNet's
    bare 'Cannot differentiate node'."""
    with pytest.raises(jitbatch.BatchingError, match=r"(?s)freed them.*Fix.*add_n"):
        plain_and_batched(backward_per_sample, policy,
                          batch=minibatches(("per-sample-backward",))[0])


@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_one_backward_per_sample_under_map(policy):
    """Inside jitbatch.map each sample's backward() keeps the graph its
    launches share with the other samples (retain_graph), so per-sample
    backward() with grad_req='add' gives plain Gluon's gradients."""
    want, got, st = plain_and_batched(backward_per_sample, policy,
                                      batch=minibatches(("per-sample-backward",))[0],
                                      mapped=True)
    same_arrays(want, got, "loss or gradient")
    assert merged(st), st


@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_saliency_per_sample_under_map(policy):
    def saliency(net, batch):
        def one(x):
            x = x.copy()
            x.attach_grad()
            with autograd.record():
                y = nd.sum(net(x))
            return autograd.grad(y, [x])[0]
        return [g.asnumpy() for g in jitbatch.map(one, batch)]
    want, got, st = plain_and_batched(saliency, policy, batch=minibatches(("saliency",))[0])
    same_arrays(want, got, "input gradient")
    assert merged(st), st


@pytest.mark.parametrize("op", ["argmax", "greater"])
def test_loss_only_through_operators_without_gradient_gives_zero_gradients(op):
    """Plain Gluon gives zero gradients; jitbatch runs launches that pass no
    gradient outside autograd (MXNet 1.9.1 crashes otherwise, gradients.py), so
    the loss is in no autograd graph. Until 2026-11-27 that was a BatchingError;
    now the backward writes the zeros plain Gluon writes (``guards.make_backward``)."""
    def program(net, batch):
        with autograd.record():
            ys = [net(x) for x in batch]
            if op == "argmax":
                parts = [nd.argmax(y, axis=1) for y in ys]
            else:
                parts = [y > 0 for y in ys]
            loss = nd.add_n(*[nd.sum(p) for p in parts])
        for p in net.collect_params().values():
            p.grad()[:] = 7.0       # stale values the backward must overwrite
        loss.backward()
        return [loss.asnumpy()] + grads_of(net)
    want, got, st = plain_and_batched(program, "depth", batch=minibatches(("no-grad", op))[0])
    same_arrays(want, got, "loss and gradients")
    assert not any(np.any(g) for g in want[1:])
    assert merged(st), st


TOPK_INDICES = r"""
import numpy as np
import mxnet as mx
from mxnet import autograd, nd
from mxnet.gluon import nn
import jitbatch


def grads(flag):
    mx.random.seed(0)
    net = nn.Dense(4, in_units=3)
    net.initialize()
    if flag:
        net.hybridize(dynamic_batch=True, policy="depth")
    xs = [nd.array([[1.0, -2.0, 0.5]]) * (i + 1) for i in range(2)]
    with autograd.record():
        loss = nd.add_n(*[nd.sum(nd.topk(net(x), k=2, ret_typ=%(ret)r)) for x in xs])
    loss.backward()
    return loss.asnumpy(), net.weight.grad().asnumpy()


want = grads(False)
got = grads(True)
for w, g in zip(want, got):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
print("same as plain Gluon")
"""


@pytest.mark.parametrize("ret", ["indices", "mask"])
def test_topk_indices_as_the_only_gradient_path(ret):
    """The indices (or mask) of topk as the only path from the loss to merged
    calls crashed MXNet 1.9.1 in backward(); such launches run unrecorded now
    (gradients.NO_GRADIENT_WHERE); the loss, which has a zero gradient, was a
    clear error to differentiate until 2026-11-27, and gives plain Gluon's zero
    gradients since. In a subprocess: the failure was a crash."""
    status, out, err = run_in_subprocess(TOPK_INDICES % {"ret": ret})
    assert status == 0, ("exit status %d (a negative status is a signal): %s"
                         % (status, err[-1500:]))
    assert "same as plain Gluon" in out, (out, err[-1500:])


CUSTOM_FUNCTION = r"""
import numpy as np
from mxnet import autograd, nd
from mxnet.gluon import nn
import jitbatch


class ClipGrad(autograd.Function):
    # a straight-through clip whose backward uses the saved (lazy) input
    def forward(self, x):
        self.save_for_backward(x)
        return nd.clip(x, -0.1, 0.1)

    def backward(self, dy):
        x, = self.saved_tensors
        return dy * (nd.abs(x) < 0.1)


def grads(flag):
    net = nn.Dense(2, in_units=3)
    net.initialize()
    if flag:
        net.hybridize(dynamic_batch=True, policy="depth")
    xs = [nd.array([[0.1, -0.2, 0.3]]) * (i + 1) for i in range(3)]
    with autograd.record():
        loss = nd.add_n(*[nd.sum(ClipGrad()(net(x))) for x in xs])
    loss.backward()
    return net.weight.grad().asnumpy()


want = grads(False)
got = grads(True)
np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
print("same as plain Gluon")
"""


def test_autograd_function_saving_a_lazy_array():
    """MXNet's callback writes the Function's backward results into its own
    arrays (``[:] =``); a lazy result failed there until 2026-11-26 (a
    recursion of StaleValueError, then kCustomFunctionBackward)."""
    status, out, err = run_in_subprocess(CUSTOM_FUNCTION)
    assert status == 0 and "same as plain Gluon" in out, err[-1500:]


# -- 4. NDArray operators on lazy arrays between blocks -------------------------------------
class Project(HybridBlock):
    """tanh(Dense) over rows, flatten=False."""

    def __init__(self, units, in_units, **kw):
        super(Project, self).__init__(**kw)
        with self.name_scope():
            self.dense = nn.Dense(units, in_units=in_units, flatten=False)

    def hybrid_forward(self, F, x):
        return F.tanh(self.dense(x))


class Sandwich(gluon.Block):
    """A (T, 3) sample encoded to h (T, 4), then ``op(net, h, x)``: NDArray
    operators in the per-sample code, possibly feeding ``net.again`` (a block
    on (k, 3) rows) or using the learned vector ``net.gamma`` (4,)."""

    def __init__(self, op, **kw):
        super(Sandwich, self).__init__(**kw)
        self.op = op
        with self.name_scope():
            self.enc = Project(4, 3)
            self.again = Project(4, 3)
            self.gamma = self.params.get("gamma", shape=(4,))

    def forward(self, x):
        return self.op(self, self.enc(x), x)


def rows_of(h):
    return [h[i] for i in range(h.shape[0])]


def lengths_of(h):
    return nd.array([max(1, h.shape[0] - 1)])


#: id -> op(net, h (T, 4) lazy, x (T, 3))
OPERATORS = {
    "slice_like": lambda n, h, x: nd.slice_like(h, x, axes=(1,)),
    "broadcast_like": lambda n, h, x: nd.broadcast_like(nd.sum(h, axis=1, keepdims=True), h),
    "broadcast_like-input": lambda n, h, x: nd.broadcast_like(h[:, :1], x),
    "reshape_like": lambda n, h, x: nd.reshape_like(h[:, :3], x),
    "split-squeeze": lambda n, h, x: nd.split(h, num_outputs=4, axis=1, squeeze_axis=True)[2],
    "split-swap": lambda n, h, x: nd.concat(*nd.split(h, num_outputs=2, axis=1)[::-1], dim=1),
    "SliceChannel": lambda n, h, x: nd.SliceChannel(h.reshape((-1, 4, 1)), num_outputs=4,
                                                    axis=1, squeeze_axis=True)[1],
    "stack-rows-then-block": lambda n, h, x: n.again(nd.stack(*rows_of(h), axis=0)[:, :3]),
    "stack-axis1": lambda n, h, x: nd.stack(h, h * 2, axis=1),
    "T-then-block": lambda n, h, x: n.again(h.T[:3].T),
    "reshape(-1)-then-block": lambda n, h, x: n.again(h.reshape(-1)[:3].reshape((1, 3))),
    "stride-2": lambda n, h, x: h[:, ::2],
    "pad-constant": lambda n, h, x: nd.pad(h.reshape((1, 1, -1, 4)), mode="constant",
                                           pad_width=(0, 0, 0, 0, 1, 1, 2, 0),
                                           constant_value=0.5),
    "pad-edge": lambda n, h, x: nd.pad(h.reshape((1, 1, -1, 4)), mode="edge",
                                       pad_width=(0, 0, 0, 0, 1, 1, 2, 0)),
    "tile": lambda n, h, x: nd.tile(h, reps=(2, 3)),
    "repeat-axis0": lambda n, h, x: nd.repeat(h, repeats=2, axis=0),
    "repeat-flat": lambda n, h, x: nd.repeat(h, repeats=2),
    "norm-axis1": lambda n, h, x: nd.norm(h, axis=1),
    "norm-all": lambda n, h, x: nd.norm(h),
    "L2Normalization": lambda n, h, x: nd.L2Normalization(h),
    "L2Normalization-spatial": lambda n, h, x: nd.L2Normalization(h.reshape((1, -1, 4)),
                                                                  mode="spatial"),
    "topk-values": lambda n, h, x: nd.topk(h, k=2, axis=1, ret_typ="value"),
    "topk-mask-times-h": lambda n, h, x: nd.topk(h, k=2, axis=1, ret_typ="mask") * h,
    "topk-axis0": lambda n, h, x: nd.topk(h, k=1, axis=0, ret_typ="value"),
    "sort-axis1": lambda n, h, x: nd.sort(h, axis=1),
    "sort-axis0": lambda n, h, x: nd.sort(h, axis=0),
    "cumsum-axis1": lambda n, h, x: nd.cumsum(h, axis=1),
    "cumsum-axis0": lambda n, h, x: nd.cumsum(h, axis=0),
    "one_hot-of-argmax": lambda n, h, x: nd.one_hot(nd.argmax(h, axis=1), 4) * h,
    "pick-lazy-index": lambda n, h, x: nd.pick(h, nd.argmax(x, axis=1), axis=1, keepdims=True),
    "pick-wrap": lambda n, h, x: nd.pick(h, nd.ones((h.shape[0],)) * 5, axis=1, mode="wrap"),
    "gather_nd": lambda n, h, x: nd.gather_nd(h, nd.array([[h.shape[0] - 1, 0], [1, 3]])),
    "SequenceMask-TNC": lambda n, h, x: nd.SequenceMask(h.reshape((-1, 1, 4)),
                                                        sequence_length=lengths_of(h),
                                                        use_sequence_length=True, value=-1),
    "SequenceMask-NTC": lambda n, h, x: nd.SequenceMask(h.reshape((1, -1, 4)),
                                                        sequence_length=lengths_of(h),
                                                        use_sequence_length=True, axis=1),
    "SequenceLast-NTC": lambda n, h, x: nd.SequenceLast(h.reshape((1, -1, 4)),
                                                        sequence_length=lengths_of(h),
                                                        use_sequence_length=True, axis=1),
    "smooth_l1": lambda n, h, x: nd.smooth_l1(h * 3, scalar=1.0),
    "prelu-param": lambda n, h, x: nd.LeakyReLU(h, gamma=n.gamma.data(), act_type="prelu"),
    "elu": lambda n, h, x: nd.LeakyReLU(h, act_type="elu", slope=0.3),
    "gelu": lambda n, h, x: nd.LeakyReLU(h, act_type="gelu"),
    "softrelu": lambda n, h, x: nd.Activation(h, act_type="softrelu"),
    "softsign": lambda n, h, x: nd.Activation(h, act_type="softsign"),
    "softmin": lambda n, h, x: nd.softmin(h),
    "log_softmax-temperature": lambda n, h, x: nd.log_softmax(h, temperature=2.0),
    "flip-axis0": lambda n, h, x: nd.flip(h, axis=0),
    "swapaxes": lambda n, h, x: nd.swapaxes(h, 0, 1),
    "dot-self-transpose_b": lambda n, h, x: nd.dot(h, h, transpose_b=True),
    "batch_dot-self": lambda n, h, x: nd.batch_dot(h.reshape((1, -1, 4)),
                                                   h.reshape((1, -1, 4)), transpose_b=True),
    "broadcast_axis": lambda n, h, x: nd.broadcast_axis(h.reshape((-1, 1, 4)), axis=1, size=3),
    "moments-variance": lambda n, h, x: nd.moments(h, axes=(1,))[1],
    "reshape-special-codes": lambda n, h, x: nd.reshape(h, shape=(0, -4, 2, 2)),
    "concat-with-concrete": lambda n, h, x: nd.concat(h, nd.ones((1, 4)), h * 0.5, dim=0),
    "shape_array": lambda n, h, x: h * nd.cast(nd.shape_array(h)[0:1], "float32").reshape((1, 1)),
    "arange_like-axis0": lambda n, h, x: h * nd.contrib.arange_like(h, axis=0).reshape((-1, 1)),
    "softmax-axis0": lambda n, h, x: nd.softmax(h, axis=0),
    "centre-over-rows": lambda n, h, x: h - nd.mean(h, axis=0, keepdims=True),
}


@pytest.mark.parametrize("train, policy", [(True, "depth"), (False, "agenda")],
                         ids=["train-depth", "infer-agenda"])
@pytest.mark.parametrize("name", list(OPERATORS))
def test_operator_between_blocks(name, train, policy):
    """Each operator on the lazy (T, 4) encoding of ragged samples (T of 1..3)."""
    def samples(rng, n):
        return [nd.array(rng.normal(size=(int(rng.integers(1, 4)), 3))) for _ in range(n)]

    def apply(net, x):
        y = net(x)
        return y, sum_loss(y)
    st = check_model(lambda: initialized(Sandwich(OPERATORS[name])), samples, apply,
                     rng_for("op", name, train), 6, train, policy)
    assert merged(st), st


def boolean_mask_rows(flag):
    enc = initialized(Project(4, 3))
    if flag:
        enc.hybridize(dynamic_batch=True, policy="depth")
    rng = rng_for("boolean-mask")
    xs = [nd.array(rng.normal(size=(t, 3))) for t in (3, 2, 3)]
    masks = [nd.array([1, 0, 1]), nd.array([0, 1]), nd.array([0, 0, 1])]
    try:
        picked = [nd.contrib.boolean_mask(enc(x), m) for x, m in zip(xs, masks)]
        shapes = [p.shape for p in picked]
        return shapes, [p.asnumpy() for p in picked]
    finally:
        enc.hybridize(active=False)


def test_boolean_mask_of_a_lazy_array_keeps_its_rows():
    want_shapes, want = boolean_mask_rows(False)
    got_shapes, got = boolean_mask_rows(True)
    assert got_shapes == want_shapes
    for a, b in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=1e-6)


class MaskInside(HybridBlock):
    """``F.contrib.boolean_mask`` inside a flagged block (plain ``hybridize()``
    runs it)."""

    def __init__(self, **kw):
        super(MaskInside, self).__init__(**kw)
        with self.name_scope():
            self.enc = Project(4, 3)

    def hybrid_forward(self, F, x, mask):
        return F.contrib.boolean_mask(self.enc(x), mask)


def test_boolean_mask_inside_a_block_is_a_clear_error():
    net = initialized(MaskInside())
    net.hybridize(dynamic_batch=True, policy="depth")
    try:
        with pytest.raises(jitbatch.BatchingError, match=r"(?s)boolean_mask.*Fix"):
            net(nd.ones((3, 3)), nd.array([1, 0, 1])).asnumpy()
    finally:
        net.hybridize(active=False)


# -- 5. Python-side use of lazy arrays ------------------------------------------------------
class PyUse(gluon.Block):
    """h = enc(x) of a (T, 3) sample, then ``use(net, h)``: Python code on the
    lazy array with ``net.cell`` (a tanh Dense (4 -> 4)) and ``net.head``."""

    def __init__(self, use, **kw):
        super(PyUse, self).__init__(**kw)
        self.use = use
        with self.name_scope():
            self.enc = Project(4, 3)
            self.cell = nn.Dense(4, in_units=4, activation="tanh")
            self.head = nn.Dense(2, in_units=4)

    def forward(self, x):
        return self.use(self, self.enc(x))


def iterate_rows(n, h):
    """``for row in h`` over the (T, 4) lazy array, a recurrent sum."""
    acc = nd.zeros((1, 4))
    for row in h:
        acc = n.cell(acc + row.reshape((1, 4)))
    return n.head(acc)


def shape_in_control_flow(n, h):
    """``h.shape[0]`` and ``len(h)`` steer the loop and a branch."""
    c = h
    for _ in range(h.shape[0]):
        c = n.cell(c)
    if len(h) > 1:
        c = c[1:] * 2
    return n.head(c)


def asnumpy_then_array(n, h):
    """A value read to numpy and wrapped again (a constant), plus the lazy path."""
    return n.head(nd.array(h.asnumpy() * 2)) + n.head(h)


def copy_and_detach(n, h):
    return n.head(h.copy()) + n.head(h.detach())


def inplace_outside_record(n, h):
    """``h += 1; h *= 0.5`` where not recording (refused inside a record scope)."""
    if not autograd.is_recording():
        h += 1
        h *= 0.5
    return n.head(h)


def bool_of_comparison(n, h):
    if bool(nd.sum(h) > 0):
        return n.head(n.cell(h))
    return n.head(h)


def setitem_outside_record(n, h):
    z = nd.zeros((h.shape[0], 4))
    if not autograd.is_recording():
        z[:, :2] = h[:, :2]
        return n.head(z)
    return n.head(h)


def last_row_by_int_index(n, h):
    return n.head(h[-1].reshape((1, 4)))


def ndarray_index(n, h):
    """Advanced indexing with an NDArray of row indices."""
    return n.head(h[nd.zeros((h.shape[0],))])


def numpy_scalar_and_size(n, h):
    return n.head(h * np.float32(2.0)) * (h.size / h.ndim) + 1


def rows_through_a_cell(n, h):
    return n.head(nd.add_n(*[n.cell(r.expand_dims(0)) for r in h]))


def zeros_like_state(n, h):
    c = nd.zeros_like(h)
    for _ in range(2):
        c = n.cell(c + h)
    return n.head(c)


PY_USES = [iterate_rows, shape_in_control_flow, asnumpy_then_array, copy_and_detach,
           inplace_outside_record, bool_of_comparison, setitem_outside_record,
           last_row_by_int_index, ndarray_index, numpy_scalar_and_size, rows_through_a_cell,
           zeros_like_state]


def ragged_rows(rng, n):
    return [nd.array(rng.normal(size=(int(rng.integers(1, 4)), 3))) for _ in range(n)]


@pytest.mark.parametrize("mapped", [False, True], ids=["loop", "map"])
@pytest.mark.parametrize("policy", ["depth", "agenda"])
@TRAIN
@pytest.mark.parametrize("use", PY_USES, ids=lambda f: f.__name__)
def test_python_side_use_of_lazy_arrays(use, train, policy, mapped):
    net = initialized(PyUse(use))
    samples = ragged_rows(rng_for("py", use.__name__, train, policy), 6)
    ref = run(net, square_loss, samples, train, flag=False)
    got = run(net, square_loss, samples, train, flag=True, policy=policy, mapped=mapped)
    assert_same(ref, got)


@pytest.mark.parametrize("use", [copy_and_detach, ndarray_index], ids=lambda f: f.__name__)
def test_forcing_views_merge_in_a_loop(use):
    net = initialized(PyUse(use))
    samples = ragged_rows(rng_for("py-merge", use.__name__), 6)
    net.hybridize(dynamic_batch=True, policy="depth")
    jitbatch.reset_stats()
    try:
        [y.asnumpy() for y in [net(x) for x in samples]]
    finally:
        net.hybridize(active=False)
    assert jitbatch.stats()["flushes"] == 1, jitbatch.stats()


def test_inplace_write_under_map_merges():
    """Under jitbatch.map an in-place write to a lazy array (``h += 1; h *=
    0.5`` outside autograd.record) parks like a read: one flush per write
    point for all the samples, then the read after map (until 2026-11-26 each
    sample's write ran its graph alone: 7 flushes for 6 samples, 24 launches
    for 24 nodes)."""
    net = initialized(PyUse(inplace_outside_record))
    samples = ragged_rows(rng_for("inplace-map"), 6)
    net.hybridize(dynamic_batch=True, policy="depth")
    jitbatch.reset_stats()
    try:
        [y.asnumpy() for y in jitbatch.map(net, samples)]
    finally:
        net.hybridize(active=False)
    st = jitbatch.stats()
    assert st["flushes"] == 3 and merged(st), st


# -- 6. blocks ---------------------------------------------------------------------------
class NestedSequential(HybridBlock):
    """HybridSequential in HybridSequential, HybridLambda (function and
    operator name) and contrib Identity."""

    def __init__(self, **kw):
        super(NestedSequential, self).__init__(**kw)
        with self.name_scope():
            inner = nn.HybridSequential()
            inner.add(nn.Dense(4, in_units=3, activation="relu"),
                      nn.HybridLambda(lambda F, x: F.tanh(x) * 2), Identity())
            self.seq = nn.HybridSequential()
            self.seq.add(inner, nn.HybridLambda("sigmoid"), nn.Dense(2, in_units=4))

    def hybrid_forward(self, F, x):
        return self.seq(x)


class ListOut(HybridBlock):
    """Returns ``[y, (tanh(y), [sigmoid(y)])]``: a list holding a nested tuple."""

    def __init__(self, **kw):
        super(ListOut, self).__init__(**kw)
        with self.name_scope():
            self.a = nn.Dense(3, in_units=3)

    def hybrid_forward(self, F, x, h, scale):
        y = (self.a(x) + h) * scale
        return [y, (F.tanh(y), [F.sigmoid(y)])]


class NestedOutputs(gluon.Block):
    """ListOut called three times, its nested outputs fed back."""

    def __init__(self, **kw):
        super(NestedOutputs, self).__init__(**kw)
        with self.name_scope():
            self.block = ListOut()

    def forward(self, x):
        y, (t, [s]) = self.block(x, nd.zeros_like(x), nd.ones_like(x))
        _, (t2, [s2]) = self.block(t, s, nd.ones_like(x))
        y3, (t3, [s3]) = self.block(t2, s2, y)
        return nd.concat(y3, t3, s3, dim=1)


class TreeReuse(gluon.Block):
    """A binary tree bottom-up; the leaf block is reused at every inner node
    too (so it runs at several depths)."""

    def __init__(self, **kw):
        super(TreeReuse, self).__init__(**kw)
        with self.name_scope():
            self.leaf = nn.Dense(4, in_units=3, activation="tanh")
            self.join = nn.Dense(4, in_units=8, activation="tanh")

    def node(self, tree, xs):
        if isinstance(tree, int):
            return self.leaf(xs[tree:tree + 1])
        h = self.join(nd.concat(self.node(tree[0], xs), self.node(tree[1], xs), dim=1))
        return self.leaf(h[:, :3]) + h

    def forward(self, sample):
        xs, tree = sample
        return self.node(tree, xs)


def random_tree(rng, leaves):
    nodes = list(range(leaves))
    while len(nodes) > 1:
        i = int(rng.integers(0, len(nodes) - 1))
        nodes[i:i + 2] = [(nodes[i], nodes[i + 1])]
    return nodes[0]


class TimeDense(gluon.Block):
    """``Dense(flatten=False)`` on (1, T, 3), transposed to (1, 4, T),
    ``GlobalAvgPool1D``."""

    def __init__(self, **kw):
        super(TimeDense, self).__init__(**kw)
        with self.name_scope():
            self.dense = nn.Dense(4, in_units=3, flatten=False, activation="tanh")
            self.pool = nn.GlobalAvgPool1D()
            self.out = nn.Dense(2, in_units=4)

    def forward(self, x):
        return self.out(self.pool(self.dense(x).transpose((0, 2, 1))))


class ConvImage(gluon.Block):
    """Conv2D, MaxPool2D, InstanceNorm, GlobalMaxPool2D on (1, 2, H, W) images
    of different sizes."""

    def __init__(self, **kw):
        super(ConvImage, self).__init__(**kw)
        with self.name_scope():
            self.features = nn.HybridSequential()
            self.features.add(nn.Conv2D(3, 3, in_channels=2, padding=1, activation="relu"),
                              nn.MaxPool2D(2), nn.InstanceNorm(in_channels=3),
                              nn.GlobalMaxPool2D())
            self.out = nn.Dense(2, in_units=3)

    def forward(self, x):
        return self.out(self.features(x))


class ChannelLayerNorm(gluon.Block):
    """Conv1D then ``LayerNorm(axis=1)`` over channels of (1, C, T), max over time."""

    def __init__(self, **kw):
        super(ChannelLayerNorm, self).__init__(**kw)
        with self.name_scope():
            self.conv = nn.Conv1D(4, 1, in_channels=3)
            self.norm = nn.LayerNorm(axis=1, in_channels=4)
            self.out = nn.Dense(2, in_units=4)

    def forward(self, x):
        return self.out(nd.max(self.norm(self.conv(x)), axis=2))


class LSTMFromBeginState(gluon.Block):
    """``LSTMCell`` stepped over the sample's rows from ``begin_state(batch_size=1)``."""

    def __init__(self, **kw):
        super(LSTMFromBeginState, self).__init__(**kw)
        with self.name_scope():
            self.cell = rnn.LSTMCell(4, input_size=3)
            self.out = nn.Dense(2, in_units=4)

    def forward(self, x):
        state = self.cell.begin_state(batch_size=1)
        for t in range(x.shape[0]):
            y, state = self.cell(x[t:t + 1], state)
        return self.out(y + state[1])


def unrolled(kind):
    """A SequentialRNNCell (GRUCell and one ``kind`` of cell) unrolled over a
    (1, T, 3) sample, layout NTC, merge_outputs=True."""
    class Unrolled(gluon.Block):
        def __init__(self, **kw):
            super(Unrolled, self).__init__(**kw)
            with self.name_scope():
                self.cell = rnn.SequentialRNNCell()
                with self.cell.name_scope():
                    self.cell.add(rnn.GRUCell(3, input_size=3))
                    if kind == "residual":
                        self.cell.add(rnn.ResidualCell(rnn.GRUCell(3, input_size=3)))
                    elif kind == "zoneout":
                        self.cell.add(rnn.ZoneoutCell(rnn.GRUCell(3, input_size=3),
                                                      zoneout_outputs=0.0, zoneout_states=0.0))
                    elif kind == "dropout":
                        self.cell.add(rnn.DropoutCell(0.0))
                    elif kind == "bidirectional":
                        self.cell.add(rnn.BidirectionalCell(rnn.GRUCell(2, input_size=3),
                                                            rnn.GRUCell(2, input_size=3)))
                self.out = nn.Dense(2, in_units=4 if kind == "bidirectional" else 3)

        def forward(self, x):
            self.cell.reset()
            outs, _ = self.cell.unroll(x.shape[1], x, layout="NTC", merge_outputs=True)
            return self.out(outs[:, -1, :])
    Unrolled.__name__ = "Unrolled_" + kind
    return Unrolled


def length(rng, low, high):
    return int(rng.integers(low, high))


#: id -> (model class, one sample from an rng)
BLOCKS = {
    "nested-sequential-lambda-identity": (NestedSequential,
                                          lambda r: nd.array(r.normal(size=(1, 3)))),
    "list-and-nested-tuple-outputs": (NestedOutputs, lambda r: nd.array(r.normal(size=(1, 3)))),
    "leaf-reused-at-every-depth": (TreeReuse, lambda r: (
        lambda k: (nd.array(r.normal(size=(k, 3))), random_tree(r, k)))(length(r, 1, 5))),
    "dense-flatten-false-globalavgpool1d": (
        TimeDense, lambda r: nd.array(r.normal(size=(1, length(r, 1, 4), 3)))),
    "conv2d-maxpool-instancenorm": (
        ConvImage, lambda r: nd.array(r.normal(size=(1, 2, length(r, 4, 7), length(r, 4, 7))))),
    "layernorm-axis1": (ChannelLayerNorm,
                        lambda r: nd.array(r.normal(size=(1, 3, length(r, 1, 4))))),
    "lstmcell-begin_state": (LSTMFromBeginState,
                             lambda r: nd.array(r.normal(size=(length(r, 1, 4), 3)))),
}
for _kind in ("sequential", "residual", "zoneout", "dropout", "bidirectional"):
    BLOCKS["unroll-" + _kind] = (unrolled(_kind),
                                 lambda r: nd.array(r.normal(size=(1, length(r, 1, 4), 3))))


@pytest.mark.parametrize("policy", POLICIES)
@TRAIN
@pytest.mark.parametrize("name", list(BLOCKS))
def test_blocks(name, train, policy, recwarn):
    """Granularity: 'auto' under 'auto', 'block' under 'depth', 'split' under
    'agenda'. None of these needs to run per sample."""
    cls, one = BLOCKS[name]

    def samples(rng, n):
        return [one(rng) for _ in range(n)]
    st = check_model(lambda: initialized(cls()), samples, square_loss,
                     rng_for("block", name, train, policy), 6, train, policy,
                     GRANULARITY_OF[policy])
    assert not contract_warnings(recwarn.list)
    if policy != "auto":
        assert merged(st), st


@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_blocks_under_map(policy):
    cls, one = BLOCKS["unroll-residual"]
    net = initialized(cls())
    samples = [one(rng_for("block-map", policy)) for _ in range(6)]
    ref = run(net, square_loss, samples, True, flag=False)
    got = run(net, square_loss, samples, True, flag=True, policy=policy, mapped=True)
    assert_same(ref, got)


class PReLUMLP(HybridBlock):
    """Dense, ``nn.PReLU``, tanh, Dense: a learned leaky slope between layers
    (``channels``: one slope per unit)."""

    def __init__(self, channels=1, **kw):
        super(PReLUMLP, self).__init__(**kw)
        with self.name_scope():
            self.a = nn.Dense(4, in_units=3)
            self.act = nn.PReLU(in_channels=channels)
            self.b = nn.Dense(2, in_units=4)

    def hybrid_forward(self, F, x):
        return self.b(F.tanh(self.act(self.a(x))))


class PReLUConv(HybridBlock):
    """Conv1D, a PReLU slope per channel, Conv1D, over a (1, 2, T) sample."""

    def __init__(self, **kw):
        super(PReLUConv, self).__init__(**kw)
        with self.name_scope():
            self.a = nn.Conv1D(3, 2, in_channels=2)
            self.act = nn.PReLU(in_channels=3)
            self.b = nn.Conv1D(2, 2, in_channels=3)

    def hybrid_forward(self, F, x):
        return self.b(self.act(self.a(x)))


# MXNet 1.9.1 gives prelu's slope a wrong gradient in a hybridized graph where
# its output meets another operator (a quarter of the right one over four
# calls; plain hybridize() too): jitbatch rewrites it (rewrite.exact_prelu)
@pytest.mark.parametrize("policy", ["sequential", "depth", "agenda"])
@pytest.mark.parametrize("make", [lambda: PReLUMLP(), lambda: PReLUMLP(channels=4), PReLUConv],
                         ids=["shared-slope", "slope-per-unit", "conv"])
def test_prelu_between_layers(make, policy):
    def samples(rng, n):
        if make is PReLUConv:
            return [nd.array(rng.normal(size=(1, 2, 5))) for _ in range(n)]
        return ragged_rows(rng, n)
    jitbatch.reset_stats()
    check_model(lambda: initialized(make()), samples, square_loss, rng_for("prelu", policy),
                6, True, policy)
    assert jitbatch.stats()["exact_prelu"] == 1


class FusedRNN(gluon.Block):
    """A fused layer (``rnn.GRU`` / ``LSTM`` / ``RNN``, layout NTC) called
    directly on the (1, T, 3) sample, no explicit states, then a Dense on its
    last step."""

    def __init__(self, kind="GRU", layers=1, bidirectional=False, **kw):
        super(FusedRNN, self).__init__(**kw)
        with self.name_scope():
            self.rnn = getattr(rnn, kind)(3, num_layers=layers, input_size=3, layout="NTC",
                                          bidirectional=bidirectional)
            self.out = nn.Dense(2, in_units=6 if bidirectional else 3)

    def forward(self, x):
        return self.out(self.rnn(x)[:, -1])


FUSED = [dict(kind="GRU"), dict(kind="LSTM", layers=2), dict(kind="RNN", bidirectional=True)]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("layer", FUSED, ids=lambda d: "-".join(map(str, d.values())))
@TRAIN
def test_fused_layer_in_ntc_layout_called_directly_merges(train, layer, policy):
    # Gluon hands the layer begin states of shape (layers, 1, H), batch axis 1:
    # jitbatch records the call with the states made inside the merged graph
    rng = rng_for("fused-ntc", train, policy, *layer.values())
    samples = [nd.array(rng.normal(size=(1, T, 3))) for T in (2, 3, 2, 3, 2)]
    st = check_model(lambda: initialized(FusedRNN(**layer)), lambda rng, n: samples,
                     square_loss, rng, len(samples), train, policy)
    if policy != "auto":
        assert merged(st), st


def test_fused_layer_with_explicit_states_keeps_the_tnc_message():
    """States the user passes are not zeros jitbatch could make: the call
    keeps the error that gives the fix."""
    net = initialized(FusedRNN())
    net.hybridize(dynamic_batch=True)
    x = nd.ones((1, 2, 3))
    with pytest.raises(jitbatch.BatchingError, match=r"fused RNN layer.*Fix:"):
        net.rnn(x, net.rnn.begin_state(1))
    assert_same(run(net, square_loss, [x], False, flag=False),
                run(net, square_loss, [x], False, flag=True))


class EmbedStep(HybridBlock):
    """A recurrent step that embeds its own token: ``tanh(h + embed(id))``."""

    def __init__(self, **kw):
        super(EmbedStep, self).__init__(**kw)
        with self.name_scope():
            self.embed = nn.Embedding(10, 4)

    def hybrid_forward(self, F, ids, h):
        return F.tanh(h + self.embed(ids))


class EmbedRNN(gluon.Block):
    """EmbedStep over the sample's (T,) token ids."""

    def __init__(self, **kw):
        super(EmbedRNN, self).__init__(**kw)
        with self.name_scope():
            self.step = EmbedStep()

    def forward(self, ids):
        h = nd.zeros((1, 4))
        for t in range(ids.shape[0]):
            h = self.step(ids[t:t + 1], h)
        return h


@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_embedding_inside_a_recurrent_step_under_split(policy):
    def samples(rng, n):
        return [nd.array(rng.integers(0, 10, length(rng, 2, 4))) for _ in range(n)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jitbatch.ContractWarning)
        check_model(lambda: initialized(EmbedRNN()), samples, square_loss,
                    rng_for("embed-split", policy), 5, True, policy, "split")


@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_embedding_inside_a_recurrent_step_by_block(policy):
    def samples(rng, n):
        return [nd.array(rng.integers(0, 10, length(rng, 2, 4))) for _ in range(n)]
    st = check_model(lambda: initialized(EmbedRNN()), samples, square_loss,
                     rng_for("embed-block", policy), 5, True, policy, "block")
    assert merged(st), st
