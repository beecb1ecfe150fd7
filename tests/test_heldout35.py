"""Held-out programs, round 35: models from Gluon's own libraries, run per
sample and checked against plain per-sample Gluon.

* ``gluon.model_zoo.vision`` networks (``resnet18_v1``, ``mobilenet0.25``,
  ``mobilenetv2_0.25``; ``classes=5``) over images ``(1, 3, H, W)`` of two or
  three sizes: inference (BatchNorm's running statistics, set to random
  values), training in the default mode (each sample's own batch
  statistics, running statistics updated), training recorded with
  ``autograd.record(train_mode=False)``, and training with every BatchNorm's
  statistics frozen (``use_global_stats=True``); two Trainer steps.
* ``gluon.contrib.nn`` blocks (``Identity``, ``PixelShuffle1D/2D``) and the
  activations ``PReLU``, ``ELU``, ``SELU``, ``Swish``, ``GELU``,
  ``LeakyReLU`` inside flagged blocks, trained; ``contrib.nn.SparseEmbedding``
  (a plain ``Block``, run per sample) feeding a flagged block, trained with a
  row_sparse gradient.
* The NumPy interface (``npx.set_np()``, in a fresh interpreter):
  ``mx.util.use_np`` blocks with ``mx.np`` operators between them, trained.

The oracle is plain per-sample Gluon (no hybridize) on the same parameters and
inputs, under the policies auto, depth, agenda and sequential. Not run (plain
Gluon / MXNet 1.9.1 itself fails or is nondeterministic): ``squeezenet1.1``,
``densenet121`` and ``alexnet`` on 32-64 pixel images (their pooling kernels
exceed the feature map: MXNet's "kernel size exceeds input", plain Gluon
too); ``resnet18_v1`` recorded with ``train_mode=False`` (its ``MaxPool2D``
backward after a forward_scoring pass is nondeterministic in oneDNN, plain
Gluon too: that test uses the MobileNets, which have no max pooling).

Findings: none. Every program gives plain per-sample Gluon's outputs,
gradients and learned parameters under every policy. Known difference seen
again (docs/errors.rst, BatchNorm in training mode): under 'agenda' (and
'auto' where it picks it) the zoo networks' running statistics get the same
updates in another order (same-size images first), so they are compared
under 'depth' and 'sequential' only.
"""
import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import nn
from mxnet.gluon.contrib import nn as cnn
from mxnet.gluon.model_zoo import vision

from heldout import (both, flag, grads_of, merged, nothing_pending,  # noqa: F401
                     params_of, rng_for, run_in_subprocess, same_values as same)

POLICIES = ["auto", "depth", "agenda", "sequential"]
POLICY = pytest.mark.parametrize("policy", POLICIES)
MERGING = ["depth", "agenda"]
ZOO = ["resnet18_v1", "mobilenet0.25", "mobilenetv2_0.25"]
NO_MAXPOOL = ["mobilenet0.25", "mobilenetv2_0.25"]
#: (network, policy) trained: the ResNet, the slowest, under one merging policy
#: only (the suite's time; it runs under every policy in inference)
TRAINED = pytest.mark.parametrize("name,policy", [(n, p) for n in NO_MAXPOOL for p in POLICIES]
                                  + [("resnet18_v1", "agenda")])


def zoo(name, frozen=False):
    """A maker of ``name`` (5 classes), Xavier-initialized from one seed, its
    deferred shapes settled on a dummy image, its running statistics random."""
    def make():
        mx.random.seed(0)
        net = vision.get_model(name, classes=5)
        if frozen:
            for blk in blocks_of(net):
                if isinstance(blk, nn.BatchNorm):
                    blk._kwargs["use_global_stats"] = True
        net.initialize(mx.init.Xavier(magnitude=2.0))
        net(nd.zeros((1, 3, 32, 32)))
        rng = rng_for(name)
        for pname, p in net.collect_params().items():
            if pname.endswith("running_mean"):
                p.set_data(nd.array(rng.normal(scale=0.1, size=p.shape)))
            elif pname.endswith("running_var"):
                p.set_data(nd.array(rng.uniform(0.5, 2.0, size=p.shape)))
        return net
    return make


def blocks_of(block):
    yield block
    for child in block._children.values():
        yield from blocks_of(child)


def images(key, sizes):
    rng = rng_for(key)
    return [nd.array(rng.normal(size=(1, 3, h, w))) for h, w in sizes]


def train(net, policy, xs, steps=2, lr=0.05, train_mode=True):
    """``steps`` SGD steps of ``net`` flagged with ``policy`` on the summed
    squares of its per-sample outputs; returns outputs, gradients and every
    parameter (running statistics included)."""
    flag(net, policy)
    tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": lr})
    out = []
    for _ in range(steps):
        with autograd.record(train_mode=train_mode):
            ys = [net(x) for x in xs]
            loss = nd.add_n(*[nd.sum(y * y) for y in ys])
        loss.backward()
        out += [y.asnumpy() for y in ys] + grads_of(net)
        tr.step(len(xs))
    return out + params_of(net)


# -- 1. model zoo ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ZOO)
@POLICY
def test_zoo_network_inference_over_images_of_two_sizes(name, policy):
    xs = images("infer/" + name, [(32, 32), (40, 36), (32, 32), (40, 36), (32, 32)])

    def program(net, p):
        flag(net, p)
        return [y.asnumpy() for y in [net(x) for x in xs]] + params_of(net)

    want, got, st = both(zoo(name), program, policy)
    same(want, got, name)
    if policy in MERGING:
        assert merged(st), st


@TRAINED
def test_zoo_network_trained_in_training_mode(name, policy):
    """BatchNorm normalises each sample over its own rows (plain Gluon: a
    batch of one); every output reaches the loss, so the running statistics
    get the same updates."""
    xs = images("train/" + name, [(32, 32), (36, 40), (32, 32)])
    want, got, _ = both(zoo(name), lambda n, p: train(n, p, xs), policy)
    names = list(zoo(name)().collect_params().keys())
    k = len(names)
    same(want[:-k], got[:-k], name + " outputs and gradients")
    stats = [i for i, n in enumerate(names) if n.endswith(("running_mean", "running_var"))]
    learned = [i for i in range(k) if i not in stats]
    same([want[-k + i] for i in learned], [got[-k + i] for i in learned], name + " parameters")
    if policy in ("depth", "sequential"):
        same([want[-k + i] for i in stats], [got[-k + i] for i in stats], name + " statistics")
    # 'agenda' (and 'auto' where it picks it) runs the same-size images first:
    # the running statistics get the same updates in another order, a known
    # difference (docs/errors.rst, BatchNorm in training mode); checked by hand
    # for mobilenet0.25: they equal plain Gluon's with the calls in order 0, 2, 1


@pytest.mark.parametrize("name", NO_MAXPOOL)
@POLICY
def test_zoo_network_trained_recorded_in_predict_mode(name, policy):
    xs = images("predict/" + name, [(32, 32), (40, 40), (32, 32), (40, 40)])
    want, got, _ = both(zoo(name), lambda n, p: train(n, p, xs, train_mode=False), policy)
    same(want, got, name)


@TRAINED
def test_zoo_network_with_frozen_batchnorm_trained(name, policy):
    xs = images("frozen/" + name, [(32, 32), (40, 36), (32, 32), (40, 36)])
    want, got, st = both(zoo(name, frozen=True), lambda n, p: train(n, p, xs), policy)
    same(want, got, name)
    if policy in MERGING:
        assert merged(st), st


# -- 2. contrib blocks and activations, trained -----------------------------------------
class Activations(nn.HybridBlock):
    """Every parametric and fixed activation of ``gluon.nn`` and the contrib
    shuffles around convolutions."""

    def __init__(self, **kw):
        super().__init__(**kw)
        with self.name_scope():
            self.conv = nn.Conv2D(8, 3, padding=1, in_channels=2)
            self.prelu = nn.PReLU(alpha_initializer=mx.init.Constant(0.2))
            self.elu = nn.ELU(alpha=0.7)
            self.selu = nn.SELU()
            self.swish = nn.Swish(beta=1.5)
            self.gelu = nn.GELU()
            self.leaky = nn.LeakyReLU(0.15)
            self.ident = cnn.Identity()
            self.shuffle = cnn.PixelShuffle2D((2, 2))
            self.conv2 = nn.Conv2D(4, 1, in_channels=2)
            self.shuffle1 = cnn.PixelShuffle1D(2)
            self.dense = nn.Dense(3, flatten=False, in_units=2)

    def hybrid_forward(self, F, x):
        h = self.conv(x)
        h = F.concat(self.prelu(F.slice_axis(h, axis=1, begin=0, end=2)),
                     self.elu(F.slice_axis(h, axis=1, begin=2, end=4)),
                     self.selu(F.slice_axis(h, axis=1, begin=4, end=6)),
                     self.swish(F.slice_axis(h, axis=1, begin=6, end=8)), dim=1)
        h = self.ident(self.gelu(self.shuffle(h)))           # (1, 2, 2H, 2W)
        h = self.leaky(self.conv2(h))                         # (1, 4, 2H, 2W)
        s = self.shuffle1(F.mean(h, axis=3))                  # (1, 2, 4H)
        return self.dense(F.transpose(s, axes=(0, 2, 1)))     # (1, 4H, 3)


def made(cls, init=None):
    def make():
        mx.random.seed(0)
        net = cls()
        net.initialize(init or mx.init.Xavier(magnitude=2.0))
        return net
    return make


@POLICY
def test_activations_and_contrib_blocks_trained(policy):
    xs = images("act", [(3, 4), (2, 5), (3, 4), (4, 4)])
    xs = [x[:, :2] for x in xs]

    def program(net, p):
        flag(net, p)
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05})
        out = []
        for _ in range(2):
            with autograd.record():
                ys = [net(x) for x in xs]
                loss = nd.add_n(*[nd.sum(nd.sin(y) * y) for y in ys])
            loss.backward()
            out += [y.asnumpy() for y in ys] + grads_of(net)
            tr.step(len(xs))
        return out + params_of(net)

    want, got, st = both(made(Activations), program, policy)
    same(want, got, "activations")
    if policy in MERGING:
        assert merged(st), st


@POLICY
def test_sparse_embedding_feeding_a_flagged_block(policy):
    rng = rng_for("sparse")
    ids = [nd.array(rng.integers(0, 20, size=(1, n))) for n in (3, 5, 3, 4, 5)]

    def make():
        mx.random.seed(0)
        emb = cnn.SparseEmbedding(20, 6)
        head = nn.HybridSequential()
        with head.name_scope():
            head.add(nn.Dense(5, flatten=False, in_units=6, activation="tanh"),
                     nn.Dense(2, flatten=False, in_units=5))
        emb.initialize(mx.init.Uniform(0.5))
        head.initialize(mx.init.Uniform(0.5))
        return [emb, head]

    def program(nets, p):
        emb, head = nets
        flag(head, p)
        params = emb.collect_params()
        params.update(head.collect_params())
        tr = gluon.Trainer(params, "sgd", {"learning_rate": 0.1, "wd": 0.01})
        out = []
        for _ in range(2):
            with autograd.record():
                ys = [head(emb(i)) for i in ids]
                loss = nd.add_n(*[nd.sum(y * y) for y in ys])
            loss.backward()
            out += [y.asnumpy() for y in ys] + grads_of(head)
            out.append(emb.weight.grad().tostype("default").asnumpy())
            tr.step(len(ids))
        return out + params_of(head) + [emb.weight.row_sparse_data(nd.arange(20)).asnumpy()]

    want, got, _ = both(make, program, policy)
    same(want, got, "sparse embedding")


# -- 3. the NumPy interface --------------------------------------------------------------
_NP_MODEL = """
import warnings
import numpy as onp, mxnet as mx
from mxnet import np, npx, autograd, gluon
from mxnet.gluon import nn
import jitbatch
npx.set_np()
warnings.simplefilter("ignore")

@mx.util.use_np
class Enc(nn.HybridBlock):
    def __init__(self, **kw):
        super().__init__(**kw)
        with self.name_scope():
            self.a = nn.Dense(6, flatten=False, in_units=4)
            self.b = nn.Dense(6, flatten=False, in_units=6)
    def hybrid_forward(self, F, x):
        return self.b(F.np.tanh(self.a(x))) + x.sum(axis=-1, keepdims=True)

@mx.util.use_np
class Head(nn.HybridBlock):
    def __init__(self, **kw):
        super().__init__(**kw)
        with self.name_scope():
            self.d = nn.Dense(3, in_units=6)
    def hybrid_forward(self, F, h):
        return self.d(h)

rng = onp.random.default_rng(35)
xs = [np.array(rng.normal(size=(n, 4)), dtype="float32") for n in (2, 3, 2, 4, 3)]

def run(policy):
    mx.random.seed(0)
    enc, head = Enc(prefix="enc_"), Head(prefix="head_")
    for b in (enc, head):
        b.initialize(mx.init.Xavier())
        if policy is None:
            b.hybridize(active=False)
        else:
            b.hybridize(dynamic_batch=True, policy=policy)
    params = enc.collect_params()
    params.update(head.collect_params())
    tr = gluon.Trainer(params, "adam", {"learning_rate": 0.01})
    out = []
    for _ in range(2):
        with autograd.record():
            ys = []
            for x in xs:
                h = enc(x)
                pooled = np.max(npx.relu(h), axis=0, keepdims=True) + np.mean(h, axis=0, keepdims=True)
                ys.append(head(pooled * np.exp(-np.abs(pooled))))
            loss = sum(np.sum(y ** 2) for y in ys)
        loss.backward()
        out += [y.asnumpy() for y in ys] + [p.grad().asnumpy().copy() for p in params.values()]
        tr.step(len(xs))
    jitbatch.flush()
    for b in (enc, head):
        b.hybridize(active=False)
    return out + [p.data().asnumpy().copy() for p in params.values()], [type(y).__name__ for y in ys]

want, wtypes = run(None)
for policy in ("auto", "depth", "agenda", "sequential"):
    got, gtypes = run(policy)
    assert gtypes == wtypes, (policy, gtypes, wtypes)
    for i, (w, g) in enumerate(zip(want, got)):
        onp.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg="%s %d" % (policy, i))
print("OK")
"""


def test_use_np_blocks_with_np_operators_between_them_trained():
    rc, out, err = run_in_subprocess(_NP_MODEL)
    assert rc == 0 and "OK" in out, err[-3000:]
