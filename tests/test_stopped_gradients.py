"""A parameter reached only through a stop gets what plain Gluon gives it.

Per sample, MXNet's backward writes the gradient of every parameter its
heads reach through recorded operators, zeros where only a stop leads there
(``BlockGrad``, ``argmax``, a comparison, ``broadcast_like``'s shape source),
and marks it fresh (``Trainer.step`` reads the mark). Merged, such a stop runs
unrecorded or detached, so the backward never reached the block's launch: its
gradient kept the previous step's values and its mark stayed stale, silently
(found 2026-11-27: with ``ignore_stale_grad=True``, Adagrad with weight decay
then skipped the update plain Gluon makes). ``history.stopped_params`` /
``zero_stopped`` now write those gradients as plain Gluon does. ``detach()``
and ``autograd.pause()`` stay walls: per sample MXNet's backward reaches
nothing behind them, and leaves their gradients as they are.

Each program: step 1 trains every block differentiably; step 2 reaches block
``b`` only through the stop; compared with plain Gluon: every gradient, every
freshness mark, and the parameters after a third step of Adagrad with weight
decay and ``ignore_stale_grad=True``."""
import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

POLICIES = ["depth", "agenda", "sequential", "auto"]

STOPS = {
    "BlockGrad": lambda h, k: h * nd.BlockGrad(k),
    "argmax": lambda h, k: h * nd.argmax(k, axis=1, keepdims=True),
    "comparison": lambda h, k: h * (k > 0),
    "shape_source": lambda h, k: nd.broadcast_like(nd.sum(h, axis=1, keepdims=True), k),
    "detach": lambda h, k: h * k.detach(),
    "pause": None,
}


class Net(gluon.Block):
    def __init__(self, stop, **kwargs):
        super().__init__(prefix="sg_", **kwargs)
        self.stop = stop
        with self.name_scope():
            self.a = gluon.nn.Dense(4, in_units=3, flatten=False)
            self.b = gluon.nn.Dense(4, in_units=4, flatten=False)

    def forward(self, x, stopped):  # pylint: disable=arguments-differ
        h = self.a(x)
        if not stopped:
            return h * self.b(h)
        if self.stop == "pause":
            with autograd.pause():
                k = self.b(h)
            return h * k
        return STOPS[self.stop](h, self.b(h))


def _train(stop, policy):
    mx.random.seed(0)
    net = Net(stop)
    net.initialize(mx.init.Uniform(0.5))
    if policy:
        net.hybridize(dynamic_batch=True, policy=policy)
    trainer = gluon.Trainer(net.collect_params(), "adagrad",
                            {"learning_rate": 0.1, "wd": 0.01})
    rng = np.random.default_rng(0)
    seen = []
    for step in range(3):
        xs = [nd.array(rng.normal(size=(int(t), 3))) for t in rng.integers(1, 4, size=5)]
        with autograd.record():
            loss = nd.add_n(*[nd.sum(net(x, step > 0)) for x in xs])
        loss.backward()
        params = list(net.collect_params().values())
        seen += [p.grad().asnumpy().copy() for p in params]
        seen += [np.array([p.data()._fresh_grad]) for p in params]
        trainer.step(len(xs), ignore_stale_grad=True)
    net.hybridize(active=False)
    return seen + [p.data().asnumpy().copy() for p in net.collect_params().values()]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("stop", sorted(STOPS))
def test_gradients_behind_a_stop_equal_plain_gluon(stop, policy):
    want = _train(stop, None)
    got = _train(stop, policy)
    for i, (w, g) in enumerate(zip(want, got)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg="array %d" % i)


ONLY_STOPS = {
    "argmax": lambda h: nd.argmax(h, axis=1),
    "comparison": lambda h: h > 0,
    "BlockGrad": nd.BlockGrad,
}


def _train_through_stops(stop, policy, form):
    """Steps 0 and 2 train the network differentiably; in step 1 the loss
    depends on it only through ``stop``: per sample MXNet's backward writes
    zeros over the stale gradients and marks them fresh."""
    mx.random.seed(0)
    net = gluon.nn.Dense(4, in_units=3, prefix="only_")
    net.initialize(mx.init.Uniform(0.5))
    if policy:
        net.hybridize(dynamic_batch=True, policy=policy)
    trainer = gluon.Trainer(net.collect_params(), "adagrad", {"learning_rate": 0.1, "wd": 0.01})
    rng = np.random.default_rng(1)
    seen = []
    for step in range(3):
        xs = [nd.array(rng.normal(size=(int(t), 3))) for t in rng.integers(1, 4, size=5)]
        with autograd.record():
            outs = [net(x) for x in xs]
            losses = [nd.sum(ONLY_STOPS[stop](h) if step == 1 else h * h) for h in outs]
            total = nd.add_n(*losses)
        if form == "autograd":
            autograd.backward([total])
        else:
            total.backward()
        params = list(net.collect_params().values())
        seen += [total.asnumpy()] + [p.grad().asnumpy().copy() for p in params]
        seen += [np.array([p.data()._fresh_grad]) for p in params]
        trainer.step(len(xs), ignore_stale_grad=True)
    net.hybridize(active=False)
    return seen + [p.data().asnumpy().copy() for p in net.collect_params().values()]


@pytest.mark.parametrize("form", ["backward", "autograd"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("stop", sorted(ONLY_STOPS))
def test_a_loss_only_through_stops_trains_as_plain_gluon(stop, policy, form):
    """Until 2026-11-27 jitbatch raised NotDifferentiableError here (the merged
    stop runs outside autograd, so the head is in no graph) where plain Gluon
    writes zero gradients; now it writes them too (``guards.make_backward``)."""
    want = _train_through_stops(stop, None, form)
    got = _train_through_stops(stop, policy, form)
    for i, (w, g) in enumerate(zip(want, got)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg="array %d" % i)
