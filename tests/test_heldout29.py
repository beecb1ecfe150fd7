"""Held-out programs, round 29: writes (and state changes) that pending calls
must not see, made through the APIs real programs use, each checked against
plain per-sample Gluon.

* Fills and copies into a buffer pending sums read: ``nd.random.uniform /
  normal(out=buf)``, ``nd.zeros_like(buf, out=buf)``, ``src.copyto(buf)``,
  ``buf[:] = numpy_array``, advanced indices (``buf[[0, 2]] = 1``), a buffer
  shared through DLPack (``from_dlpack(to_dlpack_for_write(buf))``) written.
* Views written through: ``A[1:3] += 1``, ``A.reshape((-1,))[:] = 0``,
  ``A[0][:] = v``, ``A[2] *= 2`` while calls read rows of ``A``.
* Python data behind ``nd.array`` (a NumPy buffer, a list) changed after the
  call while a graph pends (the copy is deferred to the flush).
* Parameters written while predictions pend: ``p.data()[:] = ...``,
  ``nd.elemwise_add(w, 1, out=w)``, ``set_data``, ``ParameterDict.load``.
* Autograd state: ``autograd.mark_variables`` after recorded calls read the
  array; ``grad_req`` switched to ``'add'`` between the forward and the
  backward; ``attach_grad(grad_req='add')`` and two backwards while sums of
  the gradient pend; ``gluon.utils.clip_global_norm`` scaling the gradients
  pending sums read, then ``Trainer.update``.
* Data: ``mx.io.CSVIter`` batches (a C++ iterator) one sample each.

The oracle is plain per-sample Gluon (no hybridize) on the same parameters and
inputs: outputs, gradients and parameters after the run, under the policies
auto, depth, agenda and sequential. Launch counts are asserted under 'depth'
and 'agenda' only.

Findings, kept as strict expected failures: writes made through MXNet's C
API (no ``out=`` of an operator, no ``__setitem__``), which no hook sees, so
pending calls compute with the new value, silently:

* ``KVStore.pull(key, out=buf)`` / ``pushpull(key, value, out=buf)`` into an
  array that pending calls read (a buffer, a parameter's array);
* ``Trainer.allreduce_grads()`` (``update_on_kvstore=False``, two devices:
  the gradient-clipping recipe) while pending sums read a gradient: the
  kvstore sums the devices' gradients into the gradient arrays;
* ``autograd.grad`` of an unflagged model's concrete loss (training mode,
  ``BatchNorm``), which updates the running statistics in place during its
  backward, while predictions of a flagged model sharing the parameters pend
  (``loss.backward()`` runs the pending calls first; ``autograd.grad`` does
  not).
"""
import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import HybridBlock, nn

from heldout import initialized as init
from heldout import (both, flag, grads_of, merged, nothing_pending, params_of,  # noqa: F401
                     rng_for, same_values as same)

POLICIES = ["auto", "depth", "agenda", "sequential"]
POLICY = pytest.mark.parametrize("policy", POLICIES)
#: the policies whose launches are planned from the graph alone
MERGING = ["depth", "agenda"]
H = 4



def encoder(prefix, ctx=None):
    return init(nn.Dense(H, in_units=3, activation="tanh", prefix=prefix), ctx=ctx)


def samples(key, count=5, ctx=None):
    rng = rng_for(key)
    return [nd.array(rng.normal(size=(1, 3)), ctx=ctx) for _ in range(count)]


# -- 1. fills and copies into a buffer pending calls read ------------------------------------
FILLS = ["random.uniform", "random.normal", "zeros_like", "copyto", "numpy", "advanced-index",
         "dlpack"]


def fill(buf, how, k):
    """Write ``buf`` (3 x H) in place, the ``how`` way, for sample ``k``."""
    if how == "random.uniform":
        nd.random.uniform(-1, 1, shape=buf.shape, out=buf)
    elif how == "random.normal":
        nd.random.normal(0, 1, shape=buf.shape, out=buf)
    elif how == "zeros_like":
        nd.zeros_like(buf, out=buf) if k % 2 else nd.ones_like(buf, out=buf)
    elif how == "copyto":
        (nd.ones(buf.shape) * (k + 2)).copyto(buf)
    elif how == "numpy":
        buf[:] = np.full(buf.shape, k - 1.5, dtype=np.float32)
    elif how == "advanced-index":
        buf[[0, 2]] = k + 0.25
        buf[nd.array([1])] = -k
    elif how == "dlpack":
        alias = nd.from_dlpack(nd.to_dlpack_for_write(buf))
        alias[:] = k * 0.5 - 1
        # an alias has an engine variable of its own: MXNet orders nothing
        # between its writes and later reads of buf (plain Gluon read the old
        # buffer at the end in about 1 run in 3 under load)
        alias.wait_to_read()
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", FILLS)
@POLICY
def test_a_buffer_filled_in_place_after_pending_sums_read_it(policy, how):
    """Per sample: sums of the output and the whole buffer (a row of it, a
    view) scaled by ``k + 1``, then the buffer refilled for the next sample;
    seeded draws. Every sum sees the buffer of its call."""
    xs = samples("fill")

    def program(net, policy):
        flag(net, policy)
        mx.random.seed(7)
        buf = nd.ones((3, H)) * 0.5
        ys = []
        for k, x in enumerate(xs):
            h = net(x)
            ys += [nd.add_n(h, buf[k % 3:k % 3 + 1], buf[0:1]) * (k + 1),
                   nd.broadcast_add(buf, h) - k]
            fill(buf, how, k)
        return [y.asnumpy() for y in ys] + [buf.asnumpy()]
    want, got, st = both(lambda: encoder("fill_"), program, policy)
    same(want, got, "%s under %s" % (how, policy))


# -- 2. views written through --------------------------------------------------------------
VIEWS = ["slice-iadd", "reshape-setitem", "row-setitem", "row-imul"]


@pytest.mark.parametrize("how", VIEWS)
@POLICY
def test_views_of_a_state_array_written_while_calls_read_its_rows(policy, how):
    """A (4, 3) state array whose rows are the samples' inputs (``A[k:k+1]``,
    a view) and read whole by a pending sum; after each call a view of it is
    written: ``A[1:3] += 1``, ``A.reshape((-1,))[:] = k``, ``A[0][:] = v``,
    ``A[2] *= 2``."""
    start = rng_for("views").normal(size=(4, 3))

    def program(net, policy):
        flag(net, policy)
        A = nd.array(start)
        ys = []
        for k in range(6):
            h = net(A[k % 4:k % 4 + 1])
            ys += [h * (k + 1), nd.sum(A) + nd.sum(h)]
            if how == "slice-iadd":
                A[1:3] += 1
            elif how == "reshape-setitem":
                A.reshape((-1,))[:] = k * 0.1
            elif how == "row-setitem":
                A[0][:] = nd.array([k, -k, 0.5])
            else:
                row = A[2]
                row *= 2
        return [y.asnumpy() for y in ys] + [A.asnumpy()]
    want, got, st = both(lambda: encoder("view_"), program, policy)
    same(want, got, "%s under %s" % (how, policy))


# -- 3. Python data behind nd.array changed after the call -----------------------------------
@pytest.mark.parametrize("source", ["numpy", "list", "numpy-float64"])
@POLICY
def test_python_data_changed_after_nd_array_while_calls_pend(policy, source):
    """A reused NumPy buffer (float32 or float64) or list: each sample's input
    made with ``nd.array(buf)`` after the first call is pending (the copy is
    recorded), then the buffer is overwritten for the next sample before any
    read. Per sample ``nd.array`` copies at the call."""
    rows = rng_for("nd-array").normal(size=(6, 3))

    def program(net, policy):
        flag(net, policy)
        if source == "list":
            buf = [0.0, 0.0, 0.0]
        else:
            buf = np.zeros((1, 3), dtype=np.float64 if source == "numpy-float64" else np.float32)
        ys = [net(nd.array(rows[:1]))]
        for k in range(6):
            if source == "list":
                buf[:] = [float(v) for v in rows[k]]
                x = nd.array([buf])
            else:
                buf[0, :] = rows[k]
                x = nd.array(buf)
            ys += [net(x) * (k + 1), x + 1]
            if source == "list":
                buf[0] = 99.0
            else:
                buf[:] = 99.0
        return [y.asnumpy() for y in ys]
    want, got, st = both(lambda: encoder("arr_"), program, policy)
    same(want, got, "%s under %s" % (source, policy))
    if policy in MERGING:
        assert merged(st), st


# -- 4. parameters written while predictions pend -------------------------------------------
PARAM_WRITES = ["setitem", "elemwise_add-out", "set_data", "ParameterDict.load", "grad-setitem"]


@pytest.mark.parametrize("how", PARAM_WRITES)
@POLICY
def test_parameters_written_while_predictions_and_sums_of_them_pend(policy, how, tmp_path):
    """Per round: predictions of every sample and sums of them with the bias
    (``add_n(net(x), b)``, ``b`` a view of the parameter) pend while the
    parameters are written the ``how`` way; then a training step. The
    gradient case writes ``p.grad()[:]`` while sums of the gradient pend."""
    xs = samples("params")
    path = str(tmp_path / "p.params")

    def program(net, policy):
        flag(net, policy)
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.2})
        net.collect_params().save(path)
        out = []
        for r in range(2):
            with autograd.record():
                loss = nd.add_n(*[nd.sum(net(x) ** 2) for x in xs])
            loss.backward()
            b = net.bias.data().reshape((1, H))
            gb = net.bias.grad().reshape((1, H))
            ys = [nd.add_n(net(x), b, gb) * (k + 1) for k, x in enumerate(xs)]
            w = net.weight.data()
            if how == "setitem":
                w[:] = w * 0.5 + 0.1
                net.bias.data()[:] = r + 0.5
            elif how == "elemwise_add-out":
                nd.elemwise_add(w, nd.ones_like(w), out=w)
                nd.elemwise_mul(net.bias.data(), net.bias.data(), out=net.bias.data())
            elif how == "set_data":
                net.weight.set_data(w * -1)
                net.bias.set_data(nd.ones((H,)) * r)
            elif how == "ParameterDict.load":
                net.collect_params().load(path)
            else:
                net.bias.grad()[:] = 3.0
                net.weight.grad()[:] *= 0.5
            ys += [net(x) - k for k, x in enumerate(xs)]
            tr.step(len(xs))
            out += [y.asnumpy() for y in ys]
        return out + params_of(net)
    want, got, st = both(lambda: encoder("pw_"), program, policy)
    same(want, got, "%s under %s" % (how, policy))
    if policy in MERGING:
        assert merged(st), st


# -- 5. autograd state ------------------------------------------------------------------------
@POLICY
def test_mark_variables_after_recorded_calls_read_the_array(policy):
    """A shared offset read by recorded sums, only afterwards made a variable
    with ``autograd.mark_variables`` (a gradient buffer of the user's); then
    a loss over the sums and the offset: per sample the offset's gradient
    comes from the loss's ``sum(offset)`` term only (the calls ran before it
    was a variable)."""
    xs = samples("mark")

    def program(net, policy):
        flag(net, policy)
        offset = nd.ones((1, H)) * 0.5
        with autograd.record():
            ys = [nd.add_n(net(x), offset) * (k + 1) for k, x in enumerate(xs)]
        gbuf = nd.zeros((1, H))
        autograd.mark_variables([offset], [gbuf])
        with autograd.record():
            loss = nd.add_n(*[nd.sum(y * y) for y in ys]) + nd.sum(offset * 3)
        loss.backward()
        return [y.asnumpy() for y in ys] + [gbuf.asnumpy()] + grads_of(net)
    want, got, st = both(lambda: encoder("mv_"), program, policy)
    same(want, got, "mark_variables under %s" % policy)
    if policy in MERGING:
        assert merged(st), st


@POLICY
def test_grad_req_switched_to_add_between_forward_and_backward(policy):
    """Gradient accumulation turned on after the forward was recorded
    (``collect_params().setattr('grad_req', 'add')``: MXNet makes new
    gradient buffers), then two backwards of two recordings; gradients and
    the parameters after a step."""
    xs = samples("req")

    def program(net, policy):
        flag(net, policy)
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
        with autograd.record():
            loss = nd.add_n(*[nd.sum(net(x) ** 2) * (k + 1) for k, x in enumerate(xs)])
        net.collect_params().setattr("grad_req", "add")
        loss.backward()
        out = grads_of(net)
        with autograd.record():
            loss = nd.add_n(*[nd.sum(net(x)) for x in xs])
        loss.backward()
        out += grads_of(net)
        tr.step(len(xs))
        return out + params_of(net)
    want, got, st = both(lambda: encoder("rq_"), program, policy)
    same(want, got, "grad_req switched under %s" % policy)
    if policy in MERGING:
        assert merged(st), st


@POLICY
def test_accumulated_input_gradient_read_by_sums_between_two_backwards(policy):
    """An input with ``attach_grad(grad_req='add')``: after each of two
    backwards, sums of predictions and the input's gradient pend
    (``add_n(net(v), x.grad) * (k + 1)``); the second backward adds to the
    gradient they read."""
    xs = samples("acc-grad")
    val = samples("acc-grad-val", 3)

    def program(net, policy):
        flag(net, policy)
        x = nd.concat(*xs, dim=0)[0:1].copy()
        x.attach_grad(grad_req="add")
        out = []
        for r in range(2):
            with autograd.record():
                loss = nd.add_n(*[nd.sum(net(x) * (k + r + 1)) + nd.sum(net(v) ** 2)
                                  for k, v in enumerate(xs)])
            loss.backward()
            g = x.grad.reshape((1, 3))
            out += [nd.add_n(net(v), net(g)) * (k + 1) for k, v in enumerate(val)]
            out.append(x.grad * 1)
        return [o.asnumpy() for o in out] + [x.grad.asnumpy()] + grads_of(net)
    want, got, st = both(lambda: encoder("ag_"), program, policy)
    same(want, got, "accumulated input gradient under %s" % policy)
    if policy in MERGING:
        assert merged(st), st


@POLICY
def test_clip_global_norm_of_gradients_pending_sums_read(policy):
    """The gradient-clipping recipe: backward, attributions of validation
    samples from the bias gradient pend, ``clip_global_norm`` scales the
    gradients in place (``arr *= scale``), ``Trainer.update``; two rounds."""
    xs = samples("clip")
    val = samples("clip-val", 3)

    def program(net, policy):
        flag(net, policy)
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.3})
        out = []
        for _ in range(2):
            with autograd.record():
                loss = nd.add_n(*[nd.sum((net(x) * 4) ** 2) for x in xs])
            loss.backward()
            gb = net.bias.grad().reshape((1, H))
            scores = [nd.add_n(net(v), gb) * (k + 1) for k, v in enumerate(val)]
            grads = [p.grad() for p in net.collect_params().values()]
            norm = gluon.utils.clip_global_norm(grads, 0.5)
            tr.update(len(xs))
            out += [s.asnumpy() for s in scores] + [np.array(norm)]
        return out + params_of(net)
    want, got, st = both(lambda: encoder("clip_"), program, policy)
    same(want, got, "clip_global_norm under %s" % policy)
    if policy in MERGING:
        assert merged(st), st


# -- 6. data from a C++ iterator ----------------------------------------------------------------
@POLICY
def test_csv_iterator_batches_one_sample_each(policy, tmp_path):
    """``mx.io.CSVIter`` with ``batch_size=1`` (MXNet's C++ prefetching
    iterator): each batch's data into the flagged net, then a sum of all
    outputs; no read until the end."""
    rows = rng_for("csv").normal(size=(7, 3)).astype(np.float32)
    path = str(tmp_path / "rows.csv")
    np.savetxt(path, rows, delimiter=",")

    def program(net, policy):
        flag(net, policy)
        ys = []
        for k, batch in enumerate(mx.io.CSVIter(data_csv=path, data_shape=(3,), batch_size=1)):
            ys.append(net(batch.data[0]) * (k + 1))
        return [y.asnumpy() for y in ys] + [nd.add_n(*ys).asnumpy()]
    want, got, st = both(lambda: encoder("csv_"), program, policy)
    same(want, got, "CSVIter under %s" % policy)
    if policy in MERGING:
        assert merged(st), st


# -- 7. findings: writes through MXNet's C API (strict expected failures) ----------------------
@pytest.mark.parametrize("case", ["pull-into-a-buffer", "pushpull-accumulator",
                                  "pull-into-a-parameter"])
@POLICY
def test_kvstore_pulls_into_arrays_pending_calls_read(policy, case):
    """A local kvstore used by hand (a parameter-server style loop): after
    each sample's call, ``kv.pull(key, out=buf)`` refreshes a buffer the
    pending sum read, ``kv.pushpull(key, acc * 2, out=acc)`` doubles an
    accumulator, or ``kv.pull(key, out=net.weight.data())`` loads shared
    weights into the net. Per sample each call used the value at its call.
    Until 2026-11-26 the pending calls computed with the pulled value: the
    kvstore writes through its C API, which no hook saw. ``KVStore.pull``,
    ``pushpull`` and ``row_sparse_pull`` now run the readers of what they
    write first."""
    xs = samples("kv")

    def program(net, policy):
        flag(net, policy)
        kv = mx.kv.create("local")
        buf = nd.ones((1, H))
        kv.init("b", nd.ones((1, H)) * 5)
        kv.init("w", net.weight.data() * -2)
        pushes = [nd.ones((1, H)) * k for k in range(len(xs))]   # made before any call
        ys = []
        for k, x in enumerate(xs):
            ys.append(nd.add_n(net(x), buf) * (k + 1))
            if case == "pull-into-a-buffer":
                kv.push("b", pushes[k])
                kv.pull("b", out=buf)
            elif case == "pushpull-accumulator":
                kv.pushpull("b", buf * 2, out=buf)
            else:
                kv.pull("w", out=net.weight.data())
        return [y.asnumpy() for y in ys] + [buf.asnumpy()] + params_of(net)
    want, got, st = both(lambda: encoder("kv_"), program, policy)
    same(want, got, "%s under %s" % (case, policy))


@POLICY
def test_allreduce_grads_on_two_devices_while_sums_of_a_gradient_pend(policy):
    """Data parallel on ``cpu(0)`` and ``cpu(1)`` with the gradient-clipping
    recipe (``update_on_kvstore=False``; ``allreduce_grads`` then
    ``update``): attributions ``add_n(net(v), bias_grad) * (k + 1)`` per
    device pend over ``allreduce_grads``, which sums the devices' gradients
    into each device's gradient array. Per sample they read the device's own
    gradient. Until 2026-11-26 they read the reduced gradients (the
    kvstore's writes were unhooked)."""
    ctxs = [mx.cpu(0), mx.cpu(1)]
    xs = samples("allreduce", 4)

    def program(net, policy):
        flag(net, policy)
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                           update_on_kvstore=False)
        out = []
        for _ in range(2):
            with autograd.record():
                losses = [nd.sum(net(x.as_in_context(c)) ** 2) * (i + 1)
                          for i, c in enumerate(ctxs) for x in xs[:2]]
            autograd.backward(losses)
            scores = [nd.add_n(net(x.as_in_context(c)), net.bias.grad(c).reshape((1, H))) * (k + 1)
                      for c in ctxs for k, x in enumerate(xs)]
            tr.allreduce_grads()
            tr.update(len(losses))
            out += [s.asnumpy() for s in scores]
        return out + [d.asnumpy() for p in net.collect_params().values() for d in p.list_data()]
    want, got, st = both(lambda: encoder("ar_", ctx=ctxs), program, policy)
    same(want, got, "allreduce_grads under %s" % policy)


class BNNet(HybridBlock):
    def __init__(self, **kw):
        super(BNNet, self).__init__(**kw)
        with self.name_scope():
            self.dense = nn.Dense(H, in_units=3)
            self.bn = nn.BatchNorm(in_channels=H)

    def hybrid_forward(self, F, x):
        return F.tanh(self.bn(self.dense(x)))


@POLICY
def test_autograd_grad_of_a_training_bn_model_while_predictions_pend(policy):
    """Adversarial training (FGSM): an evaluation twin of the model (flagged,
    sharing the parameters: ``params=``) predicts validation samples, which
    pend; the training model's input gradient comes from ``autograd.grad``
    in training mode, whose BatchNorm backward updates the running mean and
    variance in place. Per sample the predictions used the statistics of
    their call. (With ``loss.backward()`` instead the pending calls run
    first, and this passed.) Until 2026-11-26 ``autograd.grad`` of concrete
    heads did not run them first: the predictions read the new statistics."""
    val = samples("fgsm-val", 4)
    batch = nd.array(rng_for("fgsm").normal(size=(6, 3)))

    def make():
        train = init(BNNet(prefix="fgsm_"))
        return [train, BNNet(prefix="fgsm_", params=train.collect_params())]

    def program(nets, policy):
        train, twin = nets
        flag(twin, policy)
        out = []
        for r in range(2):
            preds = [twin(v) * (k + 1) for k, v in enumerate(val)]
            x = batch.copy()
            x.attach_grad()
            with autograd.record():
                loss = nd.sum(train(x) ** 2)
            gx, = autograd.grad(loss, [x])
            adv = x + 0.1 * nd.sign(gx)
            out += [p.asnumpy() for p in preds] + [adv.asnumpy()]
        return out + [train.bn.running_mean.data().asnumpy(),
                      train.bn.running_var.data().asnumpy()]
    want, got, st = both(make, program, policy)
    same(want, got, "autograd.grad with BatchNorm under %s" % policy)
