"""In-place writes against what MXNet copies or views (docs/errors.rst): a
concat along axis 0 or a stack along axis 1 is a copy of its parts (jitbatch's
composites read the parts when computed: a write to a part, or to memory a
part shares, first computes the composites that hold it); ``reshape`` and
``detach`` are views (a pending lazy array's are recorded operators: a write
to either side first makes them MXNet's view of the source's value); views,
composites, reshapes and detaches taken outside ``autograd.record`` (under
``pause``, or after it) of arrays recorded under it pass no gradient. Variants
of tests/test_heldout14.py's three findings, each failing before 2026-11-27.

The oracle is plain per-sample Gluon on the same parameters and inputs."""
import numpy as np
import pytest
from mxnet import autograd, nd
from mxnet.gluon import HybridBlock, nn

import jitbatch
from heldout import nothing_pending, rng_for, seeded  # noqa: F401


class Dense3(HybridBlock):
    def __init__(self, **kw):
        super(Dense3, self).__init__(**kw)
        with self.name_scope():
            self.d = nn.Dense(3, in_units=3, flatten=False)

    def hybrid_forward(self, F, x):
        return F.tanh(self.d(x))


def xs(key, lens=(2, 1, 3)):
    rng = rng_for("aliased", key)
    return [nd.array(rng.normal(size=(t, 3))) for t in lens]


def grads(net):
    return [p.grad().asnumpy().copy() for p in net.collect_params().values()]


P = {}


def prog(f):
    P[f.__name__] = f
    return f


@prog
def f6_view_of_concrete_part(net):
    buf = nd.zeros((2, 3)); outs = []
    for r in range(3):
        buf[:] = r
        outs.append(nd.concat(buf, net(buf), dim=0))
        buf[0:1][:] = 9
    return [o.asnumpy() for o in outs]

@prog
def f6_lazy_view_part_then_write_whole(net):
    ys = [net(x) for x in xs("a")]
    c = nd.concat(ys[2][0:1], ys[0], dim=0)
    ys[0].asnumpy()
    ys[2][:] = 5
    return [c.asnumpy(), ys[2].asnumpy()]

@prog
def f6_nested(net):
    buf = nd.ones((1, 3)); outs = []
    for r in range(3):
        buf[:] = r
        inner = nd.stack(net(buf), buf, axis=1)      # (1, 2, 3)
        outs.append(nd.concat(inner, inner, dim=0))
    return [o.asnumpy() for o in outs]

@prog
def f6_write_through_detach_of_computed(net):
    ys = [net(x) for x in xs("b", (1, 1, 1))]
    s = nd.stack(*ys, axis=1)
    ys[1].asnumpy()
    d = ys[1].detach()
    d[:] = 3
    return [s.asnumpy(), ys[1].asnumpy()]

@prog
def f6_out_write(net):
    buf = nd.ones((1, 3)); outs = []
    for r in range(3):
        outs.append(nd.concat(net(buf), buf, dim=0))
        nd.elemwise_add(buf, buf, out=buf)
    return [o.asnumpy() for o in outs]

@prog
def f6_reshape_view_part(net):
    ys = [net(x) for x in xs("c", (2, 2))]
    r = ys[0].reshape((2, 3))
    c = nd.concat(r, ys[1], dim=0)
    ys[0][:] = 1
    return [c.asnumpy(), r.asnumpy(), ys[0].asnumpy()]

@prog
def f6_train_then_write(net):
    with autograd.record():
        ys = [net(x) for x in xs("d", (1, 1, 1))]
        s = nd.stack(*ys, axis=1)
        loss = (s * s).sum()
    loss.backward()
    ys[1][:] = 0
    return [s.asnumpy()] + grads(net)

@prog
def f7_read_reshape_then_write_source(net):
    ys = [net(x) for x in xs("e")]
    r = ys[2].reshape((9,))
    r.asnumpy()
    ys[2][:] = 7
    return [r.asnumpy(), ys[2].asnumpy()]

@prog
def f7_consumer_after_write(net):
    ys = [net(x) for x in xs("f")]
    r = ys[2].reshape((9,))
    ys[2][:] = 7
    z = net(r.reshape((3, 3)))
    return [z.asnumpy(), r.asnumpy()]

@prog
def f7_two_reshapes(net):
    ys = [net(x) for x in xs("g")]
    r1 = ys[2].reshape((9,)); r2 = ys[2].reshape((3, 3))
    z = net(r2)
    r1[:] = 1
    return [r2.asnumpy(), ys[2].asnumpy(), z.asnumpy()]

@prog
def f7_training_reshape(net):
    with autograd.record():
        ys = [net(x) for x in xs("h", (2, 2, 2))]
        rs = [y.reshape((1, 6)) for y in ys]
        loss = nd.add_n(*[(r * r).sum() for r in rs])
    loss.backward()
    return [r.asnumpy() for r in rs] + grads(net)

@prog
def f7_detach_write_after_training(net):
    with autograd.record():
        ys = [net(x) for x in xs("i", (2, 2))]
        loss = nd.add_n(*[(y * y).sum() for y in ys])
    d = ys[0].detach()
    loss.backward()
    d[:] = 0
    return [ys[0].asnumpy(), d.asnumpy()] + grads(net)

@prog
def f8_detach_under_pause(net):
    with autograd.record():
        ys = [net(x) for x in xs("j", (1, 1, 1))]
        with autograd.pause():
            t = ys[0].detach()
        loss = (net(t) ** 2).sum() + (ys[1] ** 2).sum()
    loss.backward()
    return grads(net)

@prog
def f8_detach_outside_record(net):
    with autograd.record():
        ys = [net(x) for x in xs("k", (1, 1, 1))]
    t = ys[0].detach()
    with autograd.record():
        loss = (net(t) ** 2).sum() + (ys[1] ** 2).sum()
    loss.backward()
    return grads(net)

@prog
def f8_concat_of_read_parts_under_pause(net):
    with autograd.record():
        ys = [net(x) for x in xs("l", (1, 1, 1))]
        [y.asnumpy() for y in ys]
        with autograd.pause():
            t = nd.concat(*ys, dim=0)
        loss = (net(t) ** 2).sum() + (ys[1] ** 2).sum()
    loss.backward()
    return grads(net)

@prog
def f8_reshape_under_pause(net):
    with autograd.record():
        ys = [net(x) for x in xs("m", (2, 2))]
        with autograd.pause():
            t = ys[0].reshape((3, 2)).reshape((2, 3))
        loss = (net(t) ** 2).sum() + (ys[1] ** 2).sum()
    loss.backward()
    return grads(net)

@prog
def f8_view_of_view_under_pause(net):
    with autograd.record():
        ys = [net(x) for x in xs("n", (3, 3))]
        with autograd.pause():
            t = ys[0][1:3][0:1]
        loss = (net(t) ** 2).sum() + (ys[1] ** 2).sum()
    loss.backward()
    return grads(net)

@prog
def f8_view_outside_record(net):
    with autograd.record():
        ys = [net(x) for x in xs("o", (3, 3))]
    t = ys[0][1]
    with autograd.record():
        loss = (net(t.reshape((1, 3))) ** 2).sum() + (ys[1] ** 2).sum()
    loss.backward()
    return grads(net)


@pytest.mark.parametrize("policy", ["auto", "depth", "agenda", "sequential"])
@pytest.mark.parametrize("name", sorted(P))
def test_writes_views_and_pause_equal_plain_gluon(name, policy):
    net = seeded(Dense3)()
    want = [np.asarray(a) for a in P[name](net)]
    net = seeded(Dense3)()
    net.hybridize(dynamic_batch=True, policy=policy)
    try:
        got = [np.asarray(a) for a in P[name](net)]
        jitbatch.flush()
    finally:
        net.hybridize(active=False)
    assert len(want) == len(got)
    for i, (w, g) in enumerate(zip(want, got)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg="%s: item %d" % (name, i))


def test_a_bad_sample_skipped_between_composites_of_a_reused_buffer():
    """A sample whose call raised is skipped inside the loop: the composites
    of the other samples (a reused buffer and its call's rows) keep their
    rows through the later writes to the buffer."""
    net = seeded(Dense3)()
    net.hybridize(dynamic_batch=True, policy="depth")
    buf = nd.zeros((1, 3))
    try:
        outs = []
        for r in range(3):
            buf[:] = r
            y = net(buf)
            c = nd.concat(buf, y, dim=0)
            if r == 1:
                try:
                    net(nd.zeros((1, 4)))        # a bad sample: its call raises
                except Exception:  # pylint: disable=broad-except
                    pass
            outs.append(c)
        buf[:] = 7
        for r, c in enumerate(outs):
            np.testing.assert_allclose(c.asnumpy()[0], np.full(3, r, np.float32))
    finally:
        jitbatch.flush()
        net.hybridize(active=False)


def _indexed(case, flag, policy):
    """A (3, 3) output indexed over two axes (``y[0, 1:]``, ``y[1, :2]``,
    ``y[:, 1]``), then a write through the result or to ``y``."""
    net = seeded(nn.Dense, 3, in_units=3, flatten=False)()
    if flag:
        net.hybridize(dynamic_batch=True, policy=policy)
    try:
        y = net(nd.array(np.arange(9).reshape(3, 3)))
        if case == "write-through":
            v = y[0, 1:]
            v[:] = 5
        elif case == "write-source":
            v = y[1, :2]
            y[:] = 7
        elif case == "computed-first":
            y.asnumpy()
            v = y[0, 1:]
            v[:] = 5
        else:                      # a column: MXNet's copy, the write stays in it
            v = y[:, 1]
            v[:] = 9
        return [y.asnumpy(), v.asnumpy()]
    finally:
        net.hybridize(active=False)


@pytest.mark.parametrize("policy", ["auto", "depth", "agenda", "sequential"])
@pytest.mark.parametrize("case", ["write-through", "write-source", "computed-first", "column"])
def test_indexing_over_two_axes_views_as_mxnet_does(case, policy):
    """``y[0, 1:]`` of a lazy array was a recorded copy, pending or computed
    (until 2026-11-27 a write through it was lost on ``y`` and a write to ``y``
    did not show in it, where MXNet's indexing gives a view); now a computed
    array is indexed by MXNet itself and a pending one's result becomes MXNet's
    indexing of the value before a write to either."""
    want = _indexed(case, False, None)
    got = _indexed(case, True, policy)
    for a, b in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=1e-6)
