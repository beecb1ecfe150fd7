"""Held-out programs, round 11: state that crosses minibatches, and data
pipelines. Stateful RNNs whose per-stream hidden state is carried from one
minibatch to the next as the (lazy) output of the previous one, detached
(truncated BPTT) or not, read between minibatches or never, over streams that
end and restart; scheduled sampling decided per sample by a seeded Python
``random`` with greedy feedback of the argmax (a read) in a loop and under
``jitbatch.map``; ``gluon.data.DataLoader`` (no workers, and a thread pool of
two) with a custom ``batchify_fn`` returning lists of per-sample arrays made
by ``ArrayDataset.transform`` / ``SimpleDataset``; a lazy running loss and an
exponential moving average of the parameters kept across steps; gradient
accumulation with ``grad_req='add'`` and ``allreduce_grads`` + ``update``;
early stopping on a validation loss read every K steps; checkpoints
(``save_parameters`` / ``load_parameters``, ``Trainer.save_states`` /
``load_states``) taken and restored while predictions pend; in-place writes
to a state or input buffer (or a parameter) whose rows pending calls read.

The oracle is plain per-sample Gluon running the same program on a fresh
network with the same initial values and inputs: outputs, carried states,
gradients and the parameters after the steps must agree (``same_arrays``,
the tolerances of ``tests/harness.py``). Where docs/errors.rst promises an
error, its class and message (culprit, fix) are asserted, and that the NEXT
minibatch gives plain Gluon's numbers. Known failures are strict xfails whose
reason gives the class (silent wrong number, crash, lost state, unclear
error, missed merge).
"""
import os
import random

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import HybridBlock, nn, rnn

import jitbatch
from heldout import (grads_of, merged, nothing_pending, plain_and_flagged,  # noqa: F401
                     rng_for, same_arrays, seeded, values_of)

POLICIES = ["auto", "depth", "agenda"]


def flag(net, policy):
    """``policy`` None: plain per-sample Gluon; 'hybrid': plain ``hybridize()``;
    else ``hybridize(dynamic_batch=True, policy=policy)``."""
    if policy is None:
        net.hybridize(active=False)
    elif policy == "hybrid":
        net.hybridize()
    else:
        net.hybridize(dynamic_batch=True, policy=policy)










# ---------------------------------------------------------------------------
# Stateful RNN over streams: truncated BPTT, state carried across minibatches
class StreamStep(gluon.Block):
    """A GRU cell over one chunk of a stream (1-3 steps), from a carried
    state; a Dense head on the last output. Returns (prediction, state)."""

    def __init__(self, **kw):
        super(StreamStep, self).__init__(**kw)
        with self.name_scope():
            self.cell = rnn.GRUCell(6, input_size=3)
            self.out = nn.Dense(2, in_units=6)

    def forward(self, x, h):
        for t in range(x.shape[0]):
            y, hs = self.cell(x[t:t + 1], [h])
            h = hs[0]
        return self.out(y), h


def bptt_streams(net, policy, detach, read_state, stepping, steps=3, streams=4):
    """``streams`` streams of random lengths; each minibatch takes a chunk of
    1-3 steps of each, from the state the previous minibatch left (detached or
    not); a stream that ends restarts from zeros (``nd.zeros`` while the graph
    pends). ``stepping``: 'step' (one trainer.step per minibatch),
    'accumulate-2' (grad_req 'add', one step(2*streams) every two
    minibatches, zero_grad after it), 'allreduce+update'."""
    flag(net, policy)
    params = net.collect_params()
    if stepping == "accumulate-2":
        params.setattr("grad_req", "add")
        params.zero_grad()
    trainer = gluon.Trainer(params, "sgd", {"learning_rate": 0.1, "momentum": 0.5})
    rng = rng_for("bptt", detach, read_state, stepping)
    states = [nd.zeros((1, 6)) for _ in range(streams)]
    left = [int(rng.integers(3, 8)) for _ in range(streams)]
    seen = []
    for step in range(steps):
        with autograd.record():
            losses = []
            for s in range(streams):
                n = int(rng.integers(1, 4))
                x = nd.array(rng.normal(size=(n, 3)))
                y = nd.array(rng.normal(size=(1, 2)))
                p, h = net(x, states[s].detach() if detach else states[s])
                losses.append(nd.sum(nd.square(p - y)))
                left[s] -= n
                if left[s] <= 0:                      # the stream ends: a new one starts
                    left[s] = int(rng.integers(3, 8))
                    h = nd.zeros((1, 6))
                states[s] = h
            loss = nd.add_n(*losses)
        loss.backward()
        if stepping == "step":
            trainer.step(streams)
        elif stepping == "allreduce+update":
            trainer.allreduce_grads()
            trainer.update(streams)
        elif step % 2 == 1:
            seen += grads_of(net)
            trainer.step(2 * streams)
            params.zero_grad()
        seen.append(loss.asnumpy())
        if read_state:
            seen += [h.asnumpy() for h in states]
    if stepping == "accumulate-2":
        seen += grads_of(net)                          # the half-accumulated rest
    return seen + [h.asnumpy() for h in states] + values_of(net)


@pytest.mark.parametrize("read_state", [False, True], ids=["state-unread", "state-read"])
@pytest.mark.parametrize("detach", [True, False], ids=["detached", "not-detached"])
@pytest.mark.parametrize("policy", POLICIES)
def test_stream_states_carried_across_minibatches(policy, detach, read_state):
    want, got, st = plain_and_flagged(seeded(StreamStep), bptt_streams, policy, detach=detach,
                                      read_state=read_state, stepping="step")
    same_arrays(want, got, "loss, carried state or parameter after the steps")
    if policy != "auto":
        assert merged(st), st


@pytest.mark.parametrize("stepping", ["accumulate-2", "allreduce+update"])
@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_stream_states_with_accumulated_gradients(policy, stepping):
    want, got, st = plain_and_flagged(seeded(StreamStep), bptt_streams, policy, detach=True,
                                      read_state=False, stepping=stepping, steps=4)
    same_arrays(want, got, "accumulated gradient, loss, state or parameter")
    assert merged(st), st


# ---------------------------------------------------------------------------
# Scheduled sampling: teacher forcing or greedy feedback per sample and step
class Decoder(gluon.Block):
    def __init__(self, **kw):
        super(Decoder, self).__init__(**kw)
        with self.name_scope():
            self.emb = nn.Embedding(7, 4)
            self.cell = rnn.LSTMCell(5, input_size=4)
            self.out = nn.Dense(7, in_units=5)

    def forward(self, tok, state):
        y, state = self.cell(self.emb(tok), state)
        return self.out(y), state


def decode_one(net, seed, ratio, targets):
    """Per decoding step a seeded coin: the target next (teacher forcing) or
    the argmax of the logits, read (greedy feedback). Returns the negative log
    likelihood and the tokens fed."""
    coin = random.Random(seed)
    state = [nd.zeros((1, 5)), nd.zeros((1, 5))]
    tok = nd.array([0])
    terms, fed = [], []
    for target in targets:
        logits, state = net(tok, state)
        terms.append(nd.pick(nd.log_softmax(logits), nd.array([target]), axis=1))
        if coin.random() < ratio:
            nxt = target
        else:
            nxt = int(nd.argmax(logits, axis=1).asscalar())
        fed.append(nxt)
        tok = nd.array([nxt])
    return -nd.add_n(*terms), fed


def scheduled_sampling(net, policy, mapped, steps=3, batch=6):
    flag(net, policy)
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.05})
    rng = rng_for("scheduled-sampling")
    seen = []
    for step in range(steps):
        samples = [(int(rng.integers(1 << 30)),
                    [int(v) for v in rng.integers(1, 7, size=int(rng.integers(2, 6)))])
                   for _ in range(batch)]
        ratio = 1.0 - 0.4 * step                      # teacher forcing decays

        def fn(s):
            return decode_one(net, s[0], ratio, s[1])
        with autograd.record():
            res = jitbatch.map(fn, samples) if mapped else [fn(s) for s in samples]
            loss = nd.add_n(*[r[0] for r in res])
        loss.backward()
        trainer.step(batch)
        seen.append(loss.asnumpy())
        seen += [np.array(r[1], dtype=np.float64) for r in res]
    return seen + values_of(net)


@pytest.mark.parametrize("mapped", [False, True], ids=["loop", "map"])
@pytest.mark.parametrize("policy", POLICIES)
def test_scheduled_sampling_with_greedy_feedback(policy, mapped):
    want, got, st = plain_and_flagged(seeded(Decoder), scheduled_sampling, policy,
                                      mapped=mapped)
    same_arrays(want, got, "loss, fed tokens or parameter after the steps")
    if mapped and policy != "auto":
        assert merged(st), st


# ---------------------------------------------------------------------------
# DataLoader pipelines, a lazy running loss, an EMA of the parameters
class Mlp(HybridBlock):
    def __init__(self, **kw):
        super(Mlp, self).__init__(**kw)
        with self.name_scope():
            self.a = nn.Dense(5, in_units=3, activation="tanh")
            self.b = nn.Dense(2, in_units=5)

    def hybrid_forward(self, F, x):
        return self.b(self.a(x))


def _to_sample(x, y):
    """A dataset transform making NDArrays per sample (arithmetic included)."""
    return nd.array(x).reshape((1, 3)) * 2 - 1, nd.array(y).reshape((1, 2))


def _as_lists(items):
    return [i[0] for i in items], [i[1] for i in items]


def loader_ema(net, policy, how, workers):
    """Two epochs over a DataLoader of per-sample arrays (``how``: the
    ArrayDataset transformed lazily, or a SimpleDataset of arrays made up
    front); after every step the loss enters a running mean and the
    parameters an EMA (``ema[:] = 0.99 * ema + 0.01 * p.data()``), neither
    read until the end; predictions of every sample after each epoch."""
    flag(net, policy)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9})
    rng = rng_for("loader")
    xs = rng.normal(size=(22, 3)).astype("float32")
    ys = rng.normal(size=(22, 2)).astype("float32")
    if how == "transform":
        data = gluon.data.ArrayDataset(xs, ys).transform(_to_sample)
    else:
        data = gluon.data.SimpleDataset([_to_sample(xs[i], ys[i]) for i in range(len(xs))])
    loader = gluon.data.DataLoader(data, batch_size=5, last_batch="keep", batchify_fn=_as_lists,
                                   num_workers=workers, thread_pool=workers > 0)
    ema = [p.data().copy() for p in net.collect_params().values()]
    running, preds = None, []
    for _ in range(2):
        for bx, by in loader:
            with autograd.record():
                loss = nd.add_n(*[nd.sum(nd.square(net(x) - y)) for x, y in zip(bx, by)])
            loss.backward()
            trainer.step(len(bx))
            running = loss if running is None else running * 0.9 + 0.1 * loss
            for e, p in zip(ema, net.collect_params().values()):
                e[:] = 0.99 * e + 0.01 * p.data()
        preds += [net(x) for bx, _ in loader for x in bx]
    return [running.asnumpy()] + [e.asnumpy() for e in ema] + \
        [p.asnumpy() for p in preds] + values_of(net)


@pytest.mark.parametrize("workers", [0, 2], ids=["no-workers", "thread-pool-2"])
@pytest.mark.parametrize("how", ["transform", "arrays"])
@pytest.mark.parametrize("policy", ["auto", "agenda"])
def test_data_loader_with_running_loss_and_ema(policy, how, workers):
    want, got, st = plain_and_flagged(seeded(Mlp), loader_ema, policy, how=how, workers=workers)
    same_arrays(want, got, "running loss, EMA, prediction or parameter")
    if policy != "auto":
        assert merged(st), st


FEATURES = {}


def _features_in_worker(x):
    """A transform that runs a flagged feature network in the loader's worker
    thread; with ``fix`` it flushes there, as the error's fix says."""
    y = FEATURES["net"](nd.array(x).reshape((1, 3)))
    if FEATURES["fix"]:
        jitbatch.flush()
    return y


def feature_loader(net, policy, fix):
    flag(net, policy)
    # traced once in the main thread first: MXNet's own _get_graph is not
    # thread-safe (two threads tracing one block race on its name scope; plain
    # hybridize() too), see the report of this round
    net(nd.ones((1, 3))).asnumpy()
    FEATURES.update(net=net, fix=fix)
    xs = list(rng_for("features").normal(size=(6, 3)).astype("float32"))
    loader = gluon.data.DataLoader(gluon.data.SimpleDataset(xs).transform(_features_in_worker),
                                   batch_size=3, batchify_fn=list, num_workers=2,
                                   thread_pool=True)
    return [y.asnumpy() for batch in loader for y in batch]


def test_flagged_net_inside_loader_worker_threads():
    """A lazy array made in a worker thread and read in the main thread is the
    promised StaleValueError naming both threads and the fix; the fix (a flush
    in the worker) gives plain Gluon's features, and so does the main thread's
    next minibatch."""
    make = seeded(Mlp)
    want = feature_loader(make(), None, fix=False)
    net = make()
    with pytest.raises(jitbatch.StaleValueError) as err:
        feature_loader(net, "depth", fix=False)
    msg = str(err.value)
    assert "thread" in msg and "Fix" in msg and "flush" in msg, msg
    same_arrays(want, feature_loader(net, "depth", fix=True), "feature after the fix")
    xs = [nd.array(x.reshape(1, 3)) for x in rng_for("features").normal(size=(6, 3))]
    net.hybridize(active=False)
    plain = [net(x).asnumpy() for x in xs]
    net.hybridize(dynamic_batch=True, policy="depth")
    same_arrays(plain, [y.asnumpy() for y in [net(x) for x in xs]], "next minibatch")


# ---------------------------------------------------------------------------
# Early stopping and checkpoints while predictions pend
class CellStep(HybridBlock):
    """One GRU step and a head: (x, h) -> (prediction, new h)."""

    def __init__(self, **kw):
        super(CellStep, self).__init__(**kw)
        with self.name_scope():
            self.cell = rnn.GRUCell(4, input_size=3)
            self.out = nn.Dense(2, in_units=4)

    def hybrid_forward(self, F, x, h):
        y, hs = self.cell(x, [h])
        return self.out(y), hs[0]


def checkpoints(net, policy, variant, path):
    """Each minibatch first predicts from the carried states (left pending),
    then trains. After minibatch 1 the parameters and the trainer's states are
    saved while that minibatch's predictions pend; at minibatch 2 (``variant``)
    the parameters, or both, are loaded back while its predictions pend."""
    flag(net, policy)
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.05})
    tag = os.path.join(path, ("plain" if policy is None else "jit") + variant)
    rng = rng_for("checkpoint", variant)
    states = [nd.zeros((1, 4)) for _ in range(3)]
    seen, kept = [], []
    for step in range(4):
        xs = [nd.array(rng.normal(size=(1, 3))) for _ in range(3)]
        preds = []
        for i, x in enumerate(xs):
            p, states[i] = net(x, states[i])
            preds.append(p)
        if step == 1:
            net.save_parameters(tag + ".params")
            trainer.save_states(tag + ".states")
        if step == 2 and variant != "none":
            net.load_parameters(tag + ".params")
            if variant == "params+trainer":
                trainer.load_states(tag + ".states")
        with autograd.record():
            loss = nd.add_n(*[nd.sum(nd.square(net(x, h)[0])) for x, h in zip(xs, states)])
        loss.backward()
        trainer.step(3)
        if step % 2:
            seen += [p.asnumpy() for p in preds]
        else:
            kept += preds                             # read only at the end
    return seen + [p.asnumpy() for p in kept] + [h.asnumpy() for h in states] + values_of(net)


@pytest.mark.parametrize("variant", ["none", "params", "params+trainer"])
@pytest.mark.parametrize("policy", POLICIES)
def test_checkpoints_saved_and_restored_while_predictions_pend(policy, variant, tmp_path):
    want, got, _ = plain_and_flagged(seeded(CellStep), checkpoints, policy, variant=variant,
                                      path=str(tmp_path))
    same_arrays(want, got, "prediction, state or parameter around the checkpoint")


def early_stopping(net, policy, path, every=2, patience=1):
    """Training over sequences with a validation loss read every ``every``
    steps; the best parameters saved (while the next minibatch's validation
    predictions pend), training stops after ``patience`` worse checks, the
    best parameters are loaded back and predict."""
    flag(net, policy)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.8})
    rng = rng_for("early-stopping")

    def seq():
        return nd.array(rng.normal(size=(int(rng.integers(1, 4)), 3)))

    def loss_of(x):
        p, _ = net(x, nd.zeros((1, 6)))
        return nd.sum(nd.square(p - 0.5))
    valid = [seq() for _ in range(4)]
    best, worse, seen = None, 0, []
    best_file = os.path.join(path, ("plain" if policy is None else "jit") + ".best")
    for step in range(12):
        with autograd.record():
            loss = nd.add_n(*[loss_of(seq()) for _ in range(4)])
        loss.backward()
        trainer.step(4)
        if step % every:
            continue
        vloss = nd.add_n(*[loss_of(x) for x in valid])
        pending = [loss_of(x) for x in valid[:2]]     # left pending over the save
        v = vloss.asscalar()
        seen.append(np.array([step, v]))
        if best is None or v < best:
            best, worse = v, 0
            net.save_parameters(best_file)
        else:
            worse += 1
            if worse > patience:
                break
        seen += [p.asnumpy() for p in pending]
    net.load_parameters(best_file)
    return seen + [loss_of(x).asnumpy() for x in valid] + values_of(net)


@pytest.mark.parametrize("policy", POLICIES)
def test_early_stopping_on_a_validation_loss_read_every_k_steps(policy, tmp_path):
    want, got, st = plain_and_flagged(seeded(StreamStep), early_stopping, policy,
                                      path=str(tmp_path))
    same_arrays(want, got, "step and validation loss, pending loss or best parameters")
    if policy != "auto":
        assert merged(st), st


# ---------------------------------------------------------------------------
# In-place writes to buffers whose rows pending calls read
def stream_buffer(net, policy, write):
    """Per-stream states kept as the rows of ONE (3, 4) buffer; each stream's
    call reads its row ``states[i:i+1]`` (a view); the predictions are left
    pending, then the buffer or a parameter is written in place (``write``),
    then the predictions are read: they must be those of the values at call
    time, as in plain Gluon."""
    flag(net, policy)
    states = nd.array(np.arange(12).reshape(3, 4) / 10.0)
    x = nd.array(rng_for("buffer", write).normal(size=(1, 3)))
    preds = [net(x, states[i:i + 1])[0] for i in range(3)]
    w = net.cell.h2h_weight.data()
    WRITES[write](states, w)
    after = [net(x, states[i:i + 1])[0] for i in range(3)]
    return [p.asnumpy() for p in preds + after]


def _reused_input_buffer(states, w):
    """The next minibatch copied (from NumPy, as a loader hands it) into the
    buffer the samples were rows of."""
    states[:] = np.full((3, 4), 0.3, dtype=np.float32)


WRITES = {
    # writes jitbatch sees (the written array is the one the calls read)
    "parameter setitem": lambda s, w: w.__setitem__(slice(None), w * 0.5),
    "parameter out=": lambda s, w: nd.elemwise_mul(w, w, out=w),
    # writes to the buffer whose row views the pending calls read, or to a
    # view of a parameter the calls read whole
    "ended stream's row reset": lambda s, w: s.__setitem__(slice(1, 2), 0),
    "ended stream's row reset by index": lambda s, w: s.__setitem__(1, 0),
    "buffer zeroed with *=": lambda s, w: s.__imul__(0),
    "reused input buffer": _reused_input_buffer,
    "parameter row view": lambda s, w: w[0].__setitem__(slice(None), 1.0),
    "parameter reshaped view": lambda s, w: w.reshape((-1,)).__setitem__(slice(None), 0.1),
}


@pytest.mark.parametrize("write", [
    "parameter setitem", "parameter out=",
    "ended stream's row reset",
    "ended stream's row reset by index",
    "buffer zeroed with *=",
    "reused input buffer",
    "parameter row view",
    "parameter reshaped view",
])
@pytest.mark.parametrize("policy", POLICIES)
def test_writes_to_a_state_buffer_whose_rows_pending_calls_read(write, policy):
    """An in-place write to an array whose VIEW a pending call reads (a row of
    a state buffer, a reused input buffer), or through a view of an array a
    pending call reads (w[0][:] =), runs the pending calls first
    (record._overlaps_a_read: memory spans); until 2026-11-26 they read the
    new values, silently."""
    make = seeded(CellStep)
    want = stream_buffer(make(), None, write)
    same_arrays(want, stream_buffer(make(), "hybrid", write), "plain hybridize() (MXNet itself)")
    want2, got, _ = plain_and_flagged(make, stream_buffer, policy, write=write)
    same_arrays(want2, got, "prediction before or after the write")


def test_dataloader_workers_tracing_one_block_at_once():
    """Two DataLoader worker threads make the first calls of one flagged block
    at the same moment: MXNet's tracing uses the block's own name scope, and
    two traces at once failed ('NoneType' object has no attribute '__exit__';
    29 of 40 passes flagged, 5 of 40 with plain hybridize()). jitbatch traces
    one block at a time (patch._get_graph), and every pass gives plain
    Gluon's values (four workers: without the lock 32 of 40 passes failed)."""
    for trial in range(10):
        mx.random.seed(trial)
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Dense(5, in_units=3, activation="tanh"), gluon.nn.Dense(2, in_units=5))
        net.initialize()
        xs = np.random.default_rng(trial).normal(size=(8, 3)).astype("float32")
        want = net(nd.array(xs)).asnumpy()
        net.hybridize(dynamic_batch=True, policy="depth")

        def transform(x):
            y = net(nd.array(x).reshape((1, 3)))
            jitbatch.flush()           # a worker's graph is its own: run it there
            return y
        ds = gluon.data.SimpleDataset(list(xs)).transform(transform)
        loader = gluon.data.DataLoader(ds, batch_size=2, batchify_fn=list, num_workers=4,
                                       thread_pool=True)
        got = np.concatenate([y.asnumpy() for batch in loader for y in batch])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
