"""Held-out programs, round 32: the Gluon Block API around flagged blocks,
each checked against plain per-sample Gluon.

* Forward hooks and pre-hooks on a flagged block (values read in the hook,
  how often it runs) and on a child of a flagged block; outputs, gradients.
* Deferred initialization (``nn.Dense(8)`` without ``in_units``) with the
  first calls pending; ``Parameter.shape`` after; trained.
* ``HybridLambda`` / ``Lambda``, ``contrib.nn.HybridConcurrent`` /
  ``Concurrent``, an unflagged ``HybridSequential`` of flagged children, a
  flagged parent with unflagged children.
* Parameter sharing: a Dense tied to another (``params=``), an embedding tied
  to the output layer, one block called twice per sample at different depths;
  ``lr_mult``; ``grad_req`` switched to 'null' and to 'add' between
  minibatches; trainers over ``collect_params(select=...)``.
* Outputs of odd structure: a tuple of (array, list of arrays), nested lists,
  outputs the user never reads; a ``None`` input.
* Flags changed mid-run: the policy switched while calls pend,
  ``hybridize(active=False)`` while calls pend, ``cast('float64')`` between
  minibatches, ``net.apply`` re-initialising a child while calls pend.

The oracle is plain per-sample Gluon (no hybridize) on the same parameters and
inputs, under the policies auto, depth, agenda and sequential. Not run:
``forward(x, scale=...)`` keywords (Gluon 1.9.1's ``Block.__call__`` takes
none); ``block.summary`` of a hybridized block (Gluon asserts it is not);
a hook's call count on a child of a flagged block (Gluon warns at
``hybridize`` that such hooks do not take effect); ``grad_req='null'`` on a
Dense's weight only (plain Gluon's bias gradient is then uninitialised
memory in some runs: FullyConnected's backward skips it).

Findings (fixed on 2026-11-26):

* A flagged block called with ``None`` in one call and a mask array in the
  same slot in the next (plain per-sample Gluon runs it; plain
  ``hybridize()`` raises a ValueError) was refused with the "varying number
  of arrays" ``BatchingError``, whose fix (``nd.stack(*children)``) did not
  apply and which did not name the ``None``. It names the argument and a
  fix that applies now (``contract.structure_changed``).
"""
import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import HybridBlock, nn
from mxnet.gluon.contrib import nn as cnn

import jitbatch
from heldout import initialized as init
from heldout import flag_all, params_dict, ragged
from heldout import (both, flag, grads_of, nothing_pending,  # noqa: F401
                     params_of, rng_for, same_values as same)

POLICIES = ["auto", "depth", "agenda", "sequential"]
POLICY = pytest.mark.parametrize("policy", POLICIES)
MERGING = ["depth", "agenda"]




def train(nets, policy, sample, xs, steps=2, trainer_params=None, between=None):
    """``steps`` SGD steps of ``nets`` flagged with ``policy``; ``sample(x)``
    returns (loss, [arrays]). Returns losses, arrays, gradients, parameters."""
    flag_all(nets, policy)
    tr = gluon.Trainer(trainer_params if trainer_params is not None else params_dict(*nets),
                       "sgd", {"learning_rate": 0.1})
    out = []
    for s in range(steps):
        if between is not None:
            between(s)
        with autograd.record():
            res = [sample(x) for x in xs]
            loss = nd.add_n(*[r[0] for r in res])
        loss.backward()
        out += [a.asnumpy() for r in res for a in [r[0]] + list(r[1])] + grads_of(*nets)
        tr.step(len(xs))
    return out + params_of(*nets)


# -- 1. hooks ---------------------------------------------------------------------------
@POLICY
def test_forward_hook_on_a_flagged_block_sees_each_samples_values(policy):
    xs = ragged("hook")
    seen = []

    def make():
        net = init(nn.Dense(4, in_units=3, activation="tanh"))
        net.register_forward_hook(lambda b, i, o: seen.append(o.asnumpy().sum()))
        return net

    def program(net, p):
        del seen[:]
        out = train([net], p, lambda x: (nd.sum(net(x) ** 2), []), xs)
        return out + [np.array(seen)]

    want, got, _ = both(make, program, policy)
    same(want, got, "hooked")


@POLICY
def test_forward_pre_hook_on_a_flagged_block_runs_once_per_call(policy):
    xs = ragged("prehook")
    count = []

    def make():
        net = init(nn.Dense(4, in_units=3))
        net.register_forward_pre_hook(lambda b, i: count.append(1))
        return net

    def program(net, p):
        del count[:]
        out = train([net], p, lambda x: (nd.sum(net(x) ** 2), []), xs)
        return out + [np.array(len(count))]

    want, got, _ = both(make, program, policy)
    same(want, got, "pre-hooked")


@POLICY
def test_a_hook_on_a_child_of_a_flagged_block_leaves_the_numbers_alone(policy):
    xs = ragged("childhook")

    def make():
        net = nn.HybridSequential()
        with net.name_scope():
            net.add(nn.Dense(4, in_units=3, activation="relu"), nn.Dense(2, in_units=4))
        net[0].register_forward_hook(lambda b, i, o: None)
        return init(net)

    def program(net, p):
        return train([net], p, lambda x: (nd.sum(net(x) ** 2), [net(x)]), xs)

    want, got, _ = both(make, program, policy)
    same(want, got, "child hooked")


# -- 2. deferred initialization ---------------------------------------------------------
@POLICY
def test_deferred_initialization_with_the_first_calls_pending(policy):
    xs = ragged("deferred", width=5)

    def make():
        mx.random.seed(0)
        net = nn.HybridSequential()
        with net.name_scope():
            net.add(nn.Dense(8, activation="tanh"), nn.Dense(2))
        net.initialize(mx.init.Uniform(0.5))
        return net

    def program(net, p):
        out = train([net], p, lambda x: (nd.sum(net(x) ** 2), [net(x)]), xs)
        return out + [np.array(net[0].weight.shape), np.array(net[1].weight.shape)]

    want, got, _ = both(make, program, policy)
    same(want, got, "deferred")


@POLICY
def test_summary_after_unflagging_while_calls_pend(policy):
    """Gluon's summary refuses hybridized blocks: unflagged first, the pending
    calls keep their values."""
    xs = ragged("summary", width=5)

    def make():
        mx.random.seed(0)
        net = nn.HybridSequential()
        with net.name_scope():
            net.add(nn.Dense(4), nn.Dense(2))
        net.initialize(mx.init.Uniform(0.5))
        return net

    def program(net, p):
        flag(net, p)
        ys = [net(x) for x in xs]
        net.hybridize(active=False)
        net.summary(nd.ones((1, 5)))
        return [y.asnumpy() for y in ys] + [np.array(net[0].weight.shape)]

    want, got, _ = both(make, program, policy)
    same(want, got, "summary")


# -- 3. Lambda, Concurrent, Sequential --------------------------------------------------
@POLICY
def test_hybrid_concurrent_of_flagged_children_in_an_unflagged_parent(policy):
    xs = ragged("concurrent")

    def make():
        mx.random.seed(0)
        net = cnn.HybridConcurrent(axis=1)
        with net.name_scope():
            net.add(nn.Dense(3, in_units=3, activation="tanh"), nn.Dense(2, in_units=3),
                    nn.HybridLambda(lambda F, x: F.sigmoid(x)))
        net.initialize(mx.init.Uniform(0.5))
        return net

    def program(net, p):
        for c in net._children.values():
            flag(c, p)
        return train([], p, lambda x: (nd.sum(net(x) ** 2), [net(x)]), xs,
                     trainer_params=net.collect_params()) + grads_of(net) + params_of(net)

    want, got, _ = both(make, program, policy)
    same(want, got, "concurrent")


@POLICY
def test_flagged_hybrid_concurrent_and_lambda(policy):
    xs = ragged("fconcurrent")

    def make():
        mx.random.seed(0)
        net = nn.HybridSequential()
        with net.name_scope():
            c = cnn.HybridConcurrent(axis=1)
            c.add(nn.Dense(3, in_units=3), nn.HybridLambda("tanh"))
            net.add(c, nn.HybridLambda(lambda F, x: F.relu(x) * 2), nn.Dense(2, in_units=6))
        net.initialize(mx.init.Uniform(0.5))
        return net

    def program(net, p):
        return train([net], p, lambda x: (nd.sum(net(x) ** 2), [net(x)]), xs)

    want, got, _ = both(make, program, policy)
    same(want, got, "flagged concurrent")


@POLICY
def test_concurrent_of_flagged_children(policy):
    xs = ragged("plainconcurrent")

    def make():
        mx.random.seed(0)
        net = cnn.Concurrent(axis=1)
        with net.name_scope():
            net.add(nn.Dense(3, in_units=3), nn.Lambda(lambda x: nd.exp(-x * x)),
                    nn.Dense(1, in_units=3))
        net.initialize(mx.init.Uniform(0.5))
        return net

    def program(net, p):
        for c in net._children.values():
            if isinstance(c, HybridBlock):
                flag(c, p)
        return train([], p, lambda x: (nd.sum(net(x) ** 2), [net(x)]), xs,
                     trainer_params=net.collect_params()) + grads_of(net) + params_of(net)

    want, got, _ = both(make, program, policy)
    same(want, got, "concurrent")


# -- 4. parameter sharing ---------------------------------------------------------------
@POLICY
def test_dense_tied_to_another_and_called_at_two_depths(policy):
    xs = ragged("tied", width=4)

    def make():
        mx.random.seed(0)
        a = nn.Dense(4, in_units=4, activation="tanh", prefix="tie_")
        b = nn.Dense(4, in_units=4, activation="tanh", prefix="tie_", params=a.params)
        a.initialize(mx.init.Uniform(0.5))
        return [a, b]

    def program(nets, p):
        a, b = nets
        assert a.weight is b.weight
        return train([a, b], p, lambda x: (nd.sum(a(b(a(x))) ** 2) + nd.sum(b(x)), []), xs,
                     trainer_params=a.collect_params())

    want, got, _ = both(make, program, policy)
    same(want, got, "tied")


class TiedLM(HybridBlock):
    def __init__(self, vocab=7, dim=4, **kw):
        super(TiedLM, self).__init__(**kw)
        with self.name_scope():
            self.emb = nn.Embedding(vocab, dim)
            self.rnn = nn.Dense(dim, in_units=dim, activation="tanh")
            self.out = nn.Dense(vocab, in_units=dim, params=self.emb.params,
                                prefix=self.emb.prefix)

    def hybrid_forward(self, F, ids):
        return self.out(self.rnn(self.emb(ids)))


@POLICY
def test_embedding_tied_to_the_output_layer(policy):
    rng = rng_for("tiedlm")
    ids = [nd.array(rng.integers(0, 7, size=int(rng.integers(1, 5)))) for _ in range(5)]

    def make():
        return init(TiedLM(prefix="lm_"))

    def program(net, p):
        assert net.out.weight is net.emb.weight
        return train([net], p, lambda i: (nd.sum(nd.log_softmax(net(i)) ** 2), [net(i)]), ids)

    want, got, _ = both(make, program, policy)
    same(want, got, "tied lm")


@POLICY
def test_freezing_and_accumulating_between_minibatches(policy):
    xs = ragged("freeze")

    def make():
        mx.random.seed(0)
        net = nn.HybridSequential(prefix="fz_")
        with net.name_scope():
            net.add(nn.Dense(4, in_units=3, activation="tanh"), nn.Dense(2, in_units=4))
        net.initialize(mx.init.Uniform(0.5))
        net[1].weight.lr_mult = 0.5
        return net

    def program(net, p):
        flag(net, p)
        tr = gluon.Trainer(net.collect_params(".*dense1.*|.*dense0.*"), "sgd",
                           {"learning_rate": 0.1})
        out = []
        for step, req in enumerate(["write", "null", "add", "add", "write"]):
            net[0].collect_params().setattr("grad_req", req)
            with autograd.record():
                loss = nd.add_n(*[nd.sum(net(x) ** 2) for x in xs])
            loss.backward()
            out += [loss.asnumpy()] + grads_of(net)
            tr.step(len(xs), ignore_stale_grad=True)
        return out + params_of(net)

    want, got, _ = both(make, program, policy)
    same(want, got, "freeze")


# -- 5. odd outputs ---------------------------------------------------------------------
class Odd(HybridBlock):
    def __init__(self, **kw):
        super(Odd, self).__init__(**kw)
        with self.name_scope():
            self.d = nn.Dense(4, in_units=3)

    def hybrid_forward(self, F, x, mask=None):
        h = self.d(x)
        if mask is not None:
            h = F.broadcast_mul(h, mask)
        return h, [F.tanh(h), [F.relu(h), F.sum(h, axis=1)]]


@POLICY
def test_nested_outputs_some_unused(policy):
    xs = ragged("odd")

    def make():
        return init(Odd())

    def program(net, p):
        def sample(x):
            h, (t, (r, s)) = net(x)
            return nd.sum(t * s.expand_dims(1)), [h]
        return train([net], p, sample, xs)

    want, got, _ = both(make, program, policy)
    same(want, got, "nested")


@POLICY
def test_none_input(policy):
    xs = ragged("none")

    def make():
        return init(Odd())

    def program(net, p):
        def sample(x):
            a, (t, _) = net(x, None)
            return nd.sum(a * t), [a, t]
        return train([net], p, sample, xs)

    want, got, _ = both(make, program, policy)
    same(want, got, "none")


@POLICY
def test_none_then_a_mask_in_the_same_slot_gets_an_error_naming_the_none(policy):
    """Plain per-sample Gluon runs it; plain hybridize() refuses it (a ValueError),
    so an error is fair, but it should name the None argument and a fix that
    applies (pass an all-ones mask instead of None, or unflag the block).
    Until 2026-11-26 it gave the argument structures as Gluon encodes them
    ([0, -1], [0, 0]) and the fix for a varying number of arrays (stack
    them), which did not apply."""
    xs = ragged("nonemask")
    net = init(Odd())
    for x in xs[:2]:
        net(x, None)
        net(x, nd.ones((1, 4)))
    flag(net, policy)
    try:
        with pytest.raises(jitbatch.BatchingError) as e:
            for x in xs:
                net(x, None)[0]
                net(x, nd.ones((1, 4)))[0]
            jitbatch.flush()
    finally:
        jitbatch.flush()
        net.hybridize(active=False)
    msg = str(e.value)
    assert "None" in msg and "stack" not in msg, msg


# -- 6. flags changed mid-run -----------------------------------------------------------
@POLICY
def test_policy_switched_while_calls_pend(policy):
    xs = ragged("switch")

    def make():
        return init(nn.Dense(3, in_units=3, activation="tanh"))

    def program(net, p):
        flag(net, p)
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
        out = []
        for step in range(2):
            with autograd.record():
                ys = []
                for k, x in enumerate(xs):
                    if p is not None and k == 2:
                        flag(net, POLICIES[(POLICIES.index(p) + 1 + step) % 4])
                    if p is not None and k == 4:
                        net.hybridize(active=False)
                    ys.append(net(net(x)))
                loss = nd.add_n(*[nd.sum(y ** 2) for y in ys])
            loss.backward()
            out += [y.asnumpy() for y in ys] + grads_of(net)
            tr.step(len(xs))
            if p is not None:
                flag(net, p)
        return out + params_of(net)

    want, got, _ = both(make, program, policy)
    same(want, got, "switched")


@POLICY
def test_cast_to_float64_between_minibatches(policy):
    xs = ragged("cast")

    def make():
        return init(nn.Dense(3, in_units=3, activation="tanh"))

    def program(net, p):
        def between(s):
            if s == 1:
                net.cast("float64")
        out = []
        flag(net, p)
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
        for s in range(2):
            between(s)
            dt = "float32" if s == 0 else "float64"
            with autograd.record():
                ys = [net(x.astype(dt)) for x in xs]
                loss = nd.add_n(*[nd.sum(y ** 2) for y in ys])
            loss.backward()
            out += [y.asnumpy() for y in ys] + grads_of(net) + [str(ys[0].dtype)]
            tr.step(len(xs))
        return out + params_of(net)

    want, got, _ = both(make, program, policy)
    same(want, got, "cast")


@POLICY
def test_apply_reinitialising_a_child_while_calls_pend(policy):
    xs = ragged("apply")

    def make():
        mx.random.seed(0)
        net = nn.HybridSequential(prefix="ap_")
        with net.name_scope():
            net.add(nn.Dense(4, in_units=3, activation="tanh"), nn.Dense(2, in_units=4))
        net.initialize(mx.init.Uniform(0.5))
        return net

    def reset(b):
        if isinstance(b, nn.Dense) and b.weight.shape == (2, 4):
            b.weight.set_data(nd.ones((2, 4)) * 0.25)

    def program(net, p):
        flag(net, p)
        first = [net(x) for x in xs[:3]]
        net.apply(reset)
        second = [net(x) for x in xs[3:]]
        return [y.asnumpy() for y in first + second]

    want, got, _ = both(make, program, policy)
    same(want, got, "apply")


@pytest.mark.parametrize("policy", MERGING)
def test_tied_calls_merge(policy):
    xs = ragged("merge")

    def make():
        return init(nn.Dense(3, in_units=3))

    def program(net, p):
        flag(net, p)
        return [y.asnumpy() for y in [net(x) for x in xs]]

    want, got, st = both(make, program, policy)
    same(want, got, "merge")
    assert st["launches"] == 1, st


@POLICY
def test_tied_lm_with_accumulated_gradients_under_map(policy):
    rng = rng_for("tiedmap")
    ids = [nd.array(rng.integers(0, 7, size=int(rng.integers(1, 5)))) for _ in range(6)]

    def make():
        net = init(TiedLM(prefix="lmm_"))
        net.collect_params().setattr("grad_req", "add")
        return net

    def program(net, p):
        flag(net, p)
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
        out = []
        for _ in range(2):
            for half in (ids[:3], ids[3:]):
                with autograd.record():
                    run = jitbatch.map if p is not None else lambda f, it: [f(i) for i in it]
                    ys = run(lambda i: nd.sum(nd.log_softmax(net(i)) ** 2), half)
                    loss = nd.add_n(*ys)
                loss.backward()
                out += [loss.asnumpy()] + grads_of(net)
            tr.step(len(ids))
            net.collect_params().zero_grad()
        return out + params_of(net)

    want, got, _ = both(make, program, policy)
    same(want, got, "tied map")
