"""Held-out programs, round 34: jitbatch's own public API on a first run, as a
new user writes it, wrong usage included.

* Every ``hybridize`` flag (``dynamic_batch``, ``policy``,
  ``analysis_budget``, ``granularity``) with valid values (plain Gluon's
  numbers) and invalid ones (a ``FlagError`` naming the flag, the value and
  what is expected; the block works afterwards); misspelt flag names; every
  ``jitbatch.config`` setting, valid and invalid; ``zero_pad`` misuse.
* ``jitbatch.map``: no items, a generator, a dict's items, several iterables,
  one item, 1000 items, one item raising (an ``Exception`` and a
  ``BaseException`` subclass), a map inside a map and inside a flagged
  block's forward, results that are not arrays, wrong arguments.
* ``stats`` / ``reset_stats`` / ``flush``: counts of a known program under
  ``'depth'``, nothing pending, calls from another thread.
* ``uninstall`` / ``install`` with calls pending, twice, and flagged nets
  afterwards.
* Mixing: two nets under different policies in one minibatch, a flagged
  block inside an unflagged one and the reverse, a block flagged twice,
  plain ``hybridize()`` on a flagged block.

The oracle is plain per-sample Gluon (no hybridize) on the same parameters and
inputs.

Findings (fixed on 2026-11-26; each test's docstring says what happened
before):

* A misspelt flag name (``hybridize(dynamic_batching=True)``,
  ``hybridize(dynamic_batch=True, polcy='depth')``) was passed on to MXNet,
  which ignored it: no batching, or the default policy, and no error. It is
  a ``FlagError`` naming the flag meant now (``flags.misspelt_flag``).
* ``policy=`` / ``granularity=`` / ``analysis_budget=`` without
  ``dynamic_batch=True`` were dropped silently (plain hybridize); a
  ``FlagError`` with the fix now.
* ``analysis_budget=np.float32(0.1)`` or ``np.int64(1)`` (a NumPy number) was
  refused with "expected a number >= 0", which it is.
"""
import threading
import warnings

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import nn

import jitbatch
from heldout import initialized as init
from heldout import (both, error_of, grads_of, nothing_pending,  # noqa: F401
                     rng_for, same_values as same)


def rows(key, count=5, width=3):
    rng = rng_for(key)
    return [nd.array(rng.normal(size=(1, width))) for _ in range(count)]


def dense(seed=0, units=3, in_units=3):
    return init(nn.Dense(units, in_units=in_units, activation="tanh"), seed=seed)


def two_layer_program(xs, flags_a, flags_b=None):
    """program(nets, policy) for ``both``: two Dense blocks in a chain, trained
    one step; ``policy`` None runs plain, else ``hybridize(**flags)``."""
    def program(nets, policy):
        a, b = nets
        if policy is not None:
            if flags_a is not None:
                a.hybridize(**flags_a)
            if flags_b is not None:
                b.hybridize(**flags_b)
        with autograd.record():
            ys = [b(a(x)) for x in xs]
            loss = nd.add_n(*[nd.sum(y * y) for y in ys])
        loss.backward()
        return [y.asnumpy() for y in ys] + grads_of(a, b)
    return program


def make_two():
    return [dense(0), dense(1)]


# -- 1. hybridize flags -----------------------------------------------------------------
VALID_FLAGS = [
    dict(dynamic_batch=True),
    dict(dynamic_batch=True, policy="depth"),
    dict(dynamic_batch=True, policy="agenda"),
    dict(dynamic_batch=True, policy="sequential"),
    dict(dynamic_batch=True, policy="auto", granularity="split"),
    dict(dynamic_batch=True, policy="depth", granularity="split"),
    dict(dynamic_batch=True, policy="agenda", granularity="block"),
    dict(dynamic_batch=True, analysis_budget=0),
    dict(dynamic_batch=True, analysis_budget=0.5),
    dict(dynamic_batch=True, analysis_budget=2),
    dict(dynamic_batch=True, analysis_budget=float("inf")),
    dict(dynamic_batch=True, analysis_budget=None),
    dict(dynamic_batch=True, policy="depth", static_alloc=True, static_shape=True),
]


@pytest.mark.parametrize("flags", VALID_FLAGS, ids=lambda f: ",".join("%s=%s" % kv for kv in f.items()))
def test_every_valid_flag_gives_plain_gluons_numbers(flags):
    xs = rows("valid")
    want, got, st = both(make_two, two_layer_program(xs, flags, flags), "flags")
    same(want, got, str(flags))
    assert st["nodes"] >= 10  # the two blocks' calls, and the loss's operators


BAD_FLAGS = [
    ("dynamic_batch", dict(dynamic_batch=1)),
    ("dynamic_batch", dict(dynamic_batch="yes")),
    ("policy", dict(dynamic_batch=True, policy="Depth")),
    ("policy", dict(dynamic_batch=True, policy=None)),
    ("policy", dict(dynamic_batch=True, policy=["depth"])),
    ("analysis_budget", dict(dynamic_batch=True, analysis_budget=-1)),
    ("analysis_budget", dict(dynamic_batch=True, analysis_budget=float("nan"))),
    ("analysis_budget", dict(dynamic_batch=True, analysis_budget="0.1")),
    ("analysis_budget", dict(dynamic_batch=True, analysis_budget=True)),
    ("granularity", dict(dynamic_batch=True, granularity="blocks")),
    ("granularity", dict(dynamic_batch=True, granularity=None)),
]


@pytest.mark.parametrize("name,flags", BAD_FLAGS, ids=lambda v: str(v))
def test_a_bad_flag_value_is_named_and_the_block_works_afterwards(name, flags):
    net = dense()
    with pytest.raises(jitbatch.FlagError) as err:
        net.hybridize(**flags)
    msg = str(err.value)
    assert name in msg and repr(flags[name]) in msg and "expected" in msg, msg
    assert net.name in msg, msg
    xs = rows("badflag")
    want = [dense()(x).asnumpy() for x in xs]
    net.hybridize(dynamic_batch=True, policy="depth")
    jitbatch.reset_stats()
    got = [net(x) for x in xs]
    same(want, [y.asnumpy() for y in got], "after the FlagError")
    assert jitbatch.stats()["launches"] == 1


def test_active_false_with_dynamic_batch_is_refused_with_the_fix():
    net = dense()
    with pytest.raises(jitbatch.FlagError, match="active=True"):
        net.hybridize(False, dynamic_batch=True)


@pytest.mark.parametrize("flags,wrong,right", [
    (dict(dynamic_batching=True), "dynamic_batching", "dynamic_batch"),
    (dict(dynamic_batch=True, polcy="depth"), "polcy", "policy"),
    (dict(dynamic_batch=True, granularty="block"), "granularty", "granularity"),
    (dict(dynamic_batch=True, analysis_budjet=0.1), "analysis_budjet", "analysis_budget"),
])
def test_a_misspelt_flag_name_is_a_flag_error_naming_the_right_one(flags, wrong, right):
    """Until 2026-11-26 a misspelt flag went on to MXNet's hybridize, which
    ignored it: no batching, or the default policy, silently."""
    net = dense()
    with pytest.raises(jitbatch.FlagError) as err:
        net.hybridize(**flags)
    assert wrong in str(err.value) and right in str(err.value)


def test_a_policy_without_dynamic_batch_says_dynamic_batch_is_missing():
    """Until 2026-11-26 jitbatch's flags without ``dynamic_batch=True`` were
    dropped silently (the block hybridized plainly)."""
    net = dense()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        err = error_of(lambda: net.hybridize(policy="depth"))
    said = ([str(err)] if err is not None else []) + [str(w.message) for w in record]
    assert any("dynamic_batch=True" in s for s in said), said


@pytest.mark.parametrize("budget", [np.float32(0.1), np.int64(1)], ids=["float32", "int64"])
def test_a_numpy_number_is_a_valid_analysis_budget(budget):
    """Until 2026-11-26 a NumPy number was refused with 'expected a number >=
    0', which it is."""
    xs = rows("npbudget")
    flags = dict(dynamic_batch=True, analysis_budget=budget)
    want, got, _ = both(make_two, two_layer_program(xs, flags, flags), "flags")
    same(want, got, "numpy budget")


# -- config -----------------------------------------------------------------------------
CONFIG_VALUES = [("max_pending", 1), ("max_pending", 3), ("max_pending", np.int64(4)),
                 ("row_buckets", 0), ("row_buckets", 1), ("row_buckets", 3),
                 ("fast_activations", False), ("fast_splits", False), ("defer_gc", False),
                 ("debug", True), ("strict", True), ("pipeline", True),
                 ("map_threads", 1), ("map_threads", 2)]


@pytest.mark.parametrize("name,value", CONFIG_VALUES, ids=lambda v: str(v))
def test_every_config_setting_gives_plain_gluons_numbers(name, value):
    xs = rows("config", count=6)
    old = getattr(jitbatch.config, name)
    setattr(jitbatch.config, name, value)
    try:
        def program(nets, policy):
            a, b = nets
            if policy is not None:
                a.hybridize(dynamic_batch=True, policy=policy)
                b.hybridize(dynamic_batch=True, policy=policy)
            with autograd.record():
                ys = jitbatch.map(lambda x: b(a(x)), xs)
                loss = nd.add_n(*[nd.sum(y * y) for y in ys])
            loss.backward()
            return [y.asnumpy() for y in ys] + grads_of(a, b)
        want, got, _ = both(make_two, program, "depth")
        same(want, got, "%s=%r" % (name, value))
    finally:
        setattr(jitbatch.config, name, old)


@pytest.mark.parametrize("name,value,expect", [
    ("max_pending", 0, "int >= 1"), ("max_pending", 2.0, "int >= 1"),
    ("row_buckets", -1, "int >= 0"), ("strict", 1, "True or False"),
    ("pipeline", "no", "True or False"), ("map_threads", 0, "int >= 1"),
    ("maxpending", 5, "max_pending"), ("policy", "depth", "no such setting")])
def test_a_bad_config_value_is_named_and_leaves_the_setting(name, value, expect):
    before = {k: getattr(jitbatch.config, k) for k in ("max_pending", "row_buckets", "strict",
                                                        "pipeline", "map_threads")}
    with pytest.raises(jitbatch.FlagError) as err:
        setattr(jitbatch.config, name, value)
    msg = str(err.value)
    assert name in msg and expect in msg and "Fix" in msg, msg
    assert {k: getattr(jitbatch.config, k) for k in before} == before
    assert not hasattr(jitbatch.config, "maxpending")


class ChildSum(gluon.HybridBlock):
    def hybrid_forward(self, F, x, ch):
        return x + F.sum(ch, axis=1)


@pytest.mark.parametrize("args,kw,expect", [
    ((), dict(ch=0), "axis >= 1"), ((), dict(chh=1), "its inputs are x, ch"),
    ((), dict(ch="1"), "axis >= 1"), ((), dict(ch=True), "axis >= 1"),
    (("cell",), dict(ch=1), "HybridBlock")], ids=str)
def test_zero_pad_misuse_is_named(args, kw, expect):
    cell = ChildSum()
    with pytest.raises(jitbatch.FlagError, match=expect):
        jitbatch.zero_pad(*(args or (cell,)), **kw)


# -- 2. jitbatch.map --------------------------------------------------------------------
@pytest.fixture
def net_and_want():
    net = dense()
    xs = rows("map", count=6)
    want = [net(x).asnumpy() for x in xs]
    net.hybridize(dynamic_batch=True, policy="depth")
    yield net, xs, want
    net.hybridize(active=False)


def test_map_over_no_items_a_generator_and_one_item(net_and_want):
    net, xs, want = net_and_want
    assert jitbatch.map(lambda x: net(x).asnumpy(), []) == []
    same(want, jitbatch.map(lambda x: net(x).asnumpy(), (x for x in xs)), "generator")
    same(want[:1], jitbatch.map(lambda x: net(x).asnumpy(), [xs[0]]), "one item")


def test_map_over_dict_items_and_several_iterables(net_and_want):
    net, xs, want = net_and_want
    got = jitbatch.map(lambda kv: (kv[0], net(kv[1]).asnumpy()), dict(enumerate(xs)).items())
    assert [k for k, _ in got] == list(range(6))
    same(want, [v for _, v in got], "dict items")
    got = jitbatch.map(lambda a, b: (net(a) + net(b)).asnumpy(), xs, xs[1:])
    assert len(got) == 5
    same([w + v for w, v in zip(want, want[1:])], got, "two iterables (shortest)")


def test_map_over_1000_items_in_order(net_and_want):
    net, xs, want = net_and_want
    jitbatch.reset_stats()
    got = jitbatch.map(lambda i: (i, net(xs[i % 6]).sum().asscalar()), range(1000))
    assert [i for i, _ in got] == list(range(1000))
    np.testing.assert_allclose([v for _, v in got], [want[i % 6].sum() for i in range(1000)],
                               rtol=1e-5, atol=1e-6)
    st = jitbatch.stats()
    assert st["nodes"] == 2000 and st["launches"] < 100


class Boom(Exception):
    pass


class Stop(BaseException):
    pass


@pytest.mark.parametrize("exc", [Boom, Stop])
def test_map_with_one_item_raising_names_it_and_the_next_map_is_right(net_and_want, exc):
    net, xs, want = net_and_want

    def fn(i):
        y = net(xs[i]).asnumpy()
        if i == 3:
            raise exc("item three failed")
        return y

    with pytest.raises(exc) as err:
        jitbatch.map(fn, range(6))
    notes = " ".join(getattr(err.value, "__notes__", []))
    assert "item 3" in notes and "6 items" in notes, notes
    assert jitbatch.stats()["pending"] == 0
    same(want, jitbatch.map(lambda x: net(x).asnumpy(), xs), "the next map")


def test_map_inside_map_and_non_array_results(net_and_want):
    net, xs, want = net_and_want
    got = jitbatch.map(lambda x: jitbatch.map(lambda y: net(y).asnumpy(), [x, x]), xs)
    same(want, [g[0] for g in got], "nested")
    same(want, [g[1] for g in got], "nested")
    got = jitbatch.map(lambda x: {"s": "text", "n": None, "k": 3}, xs)
    assert got == [{"s": "text", "n": None, "k": 3}] * 6
    got = jitbatch.map(net, xs)
    same(want, [y.asnumpy() for y in got], "lazy results")


def test_map_with_wrong_arguments_is_the_builtins_type_error(net_and_want):
    net, xs, _ = net_and_want
    with pytest.raises(TypeError, match="not callable"):
        jitbatch.map(None, xs)
    with pytest.raises(TypeError, match="not iterable"):
        jitbatch.map(net, 5)
    with pytest.raises(TypeError, match="at least one iterable"):
        jitbatch.map(net)


class MapInForward(gluon.Block):
    def __init__(self, inner, **kw):
        super().__init__(**kw)
        self.inner = inner

    def forward(self, x):
        parts = jitbatch.map(lambda i: self.inner(x[i:i + 1]), range(x.shape[0]))
        return nd.concat(*parts, dim=0)


@pytest.mark.parametrize("policy", ["auto", "depth", "sequential"])
def test_map_inside_a_flagged_blocks_forward(policy):
    xs = rows("mapfwd", count=4)
    x = nd.concat(*xs, dim=0)

    def make():
        return MapInForward(dense())

    def program(outer, p):
        if p is not None:
            outer.hybridize(dynamic_batch=True, policy=p)
        with autograd.record():
            y = outer(x)
            loss = nd.sum(y * y)
        loss.backward()
        return [y.asnumpy()] + grads_of(outer)

    want, got, _ = both(make, program, policy)
    same(want, got, "map in forward")


# -- 3. stats / reset_stats / flush -----------------------------------------------------
def test_stats_of_a_known_program_under_depth():
    a, b = dense(0), dense(1)
    xs = rows("stats")
    want = [b(a(x)).asnumpy() for x in xs]
    a.hybridize(dynamic_batch=True, policy="depth")
    b.hybridize(dynamic_batch=True, policy="depth")
    jitbatch.reset_stats()
    ys = [b(a(x)) for x in xs]
    st = jitbatch.stats()
    assert (st["nodes"], st["pending"], st["launches"], st["flushes"]) == (10, 10, 0, 0)
    same(want, [y.asnumpy() for y in ys], "outputs")
    st = jitbatch.stats()
    assert (st["nodes"], st["pending"], st["launches"], st["flushes"]) == (10, 0, 2, 1)
    assert st["forced_flushes"] == 1 and st["policies"].get("depth") == 1, st["policies"]
    assert st["last_flush"]["policy"] == "depth"


def test_flush_stats_and_reset_with_nothing_pending():
    jitbatch.flush()
    jitbatch.flush()
    jitbatch.reset_stats()
    st = jitbatch.stats()
    assert (st["nodes"], st["launches"], st["flushes"], st["pending"]) == (0, 0, 0, 0)
    assert st["last_flush"] == {}


def test_stats_flush_and_reset_from_another_thread_leave_this_threads_graph():
    net = dense()
    xs = rows("thread")
    want = [net(x).asnumpy() for x in xs]
    net.hybridize(dynamic_batch=True, policy="depth")
    jitbatch.reset_stats()
    ys = [net(x) for x in xs]
    seen = {}

    def other():
        seen["stats"] = jitbatch.stats()
        jitbatch.flush()
        jitbatch.reset_stats()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["stats"]["pending"] == 0
    assert jitbatch.stats()["pending"] == 5
    same(want, [y.asnumpy() for y in ys], "after another thread's flush")
    assert jitbatch.stats()["launches"] == 1


# -- 4. uninstall / install -------------------------------------------------------------
def test_uninstall_with_calls_pending_then_install_again():
    net = dense()
    xs = rows("uninstall")
    want = [net(x).asnumpy() for x in xs]
    net.hybridize(dynamic_batch=True, policy="depth")
    ys = [net(x) for x in xs]
    try:
        jitbatch.uninstall()
        jitbatch.uninstall()
        same(want, [y.asnumpy() for y in ys], "pending at uninstall")
        plain = [net(x) for x in xs]
        assert not any(isinstance(y, jitbatch.LazyArray) for y in plain)
        same(want, [y.asnumpy() for y in plain], "while uninstalled")
    finally:
        jitbatch.install()
        jitbatch.install()
    net.hybridize(dynamic_batch=True, policy="depth")
    jitbatch.reset_stats()
    ys = [net(x) for x in xs]
    assert jitbatch.is_lazy(ys[0])
    same(want, [y.asnumpy() for y in ys], "after install")
    assert jitbatch.stats()["launches"] == 1


# -- 5. mixing --------------------------------------------------------------------------
@pytest.mark.parametrize("fa,fb", [
    (dict(dynamic_batch=True, policy="depth"), dict(dynamic_batch=True, policy="agenda")),
    (dict(dynamic_batch=True, policy="sequential"),
     dict(dynamic_batch=True, policy="auto", granularity="split")),
    (dict(dynamic_batch=True, policy="depth"), None),
    (None, dict(dynamic_batch=True, analysis_budget=0)),
], ids=["depth+agenda", "sequential+auto-split", "depth+plain", "plain+budget0"])
def test_two_nets_under_different_flags_in_one_minibatch(fa, fb):
    xs = rows("mix")
    want, got, _ = both(make_two, two_layer_program(xs, fa, fb), "mixed")
    same(want, got, "mixed flags")


class Outer(gluon.Block):
    def __init__(self, child, **kw):
        super().__init__(**kw)
        with self.name_scope():
            self.child = child
            self.head = dense(5)

    def forward(self, x):
        return self.head(self.child(x)) * 2


@pytest.mark.parametrize("which", ["outer", "child"])
def test_flagged_inside_unflagged_and_the_reverse(which):
    xs = rows("nest")

    def make():
        return Outer(dense(0))

    def program(net, p):
        if p is not None:
            if which == "outer":
                net.hybridize(dynamic_batch=True, policy=p)
                net.child.hybridize()
            else:
                net.child.hybridize(dynamic_batch=True, policy=p)
        with autograd.record():
            ys = [net(x) for x in xs]
            loss = nd.add_n(*[nd.sum(y * y) for y in ys])
        loss.backward()
        return [y.asnumpy() for y in ys] + grads_of(net)

    want, got, _ = both(make, program, "depth")
    same(want, got, which)


def test_flagged_twice_the_last_flags_win_and_plain_hybridize_turns_it_off():
    net = dense()
    xs = rows("twice")
    want = [net(x).asnumpy() for x in xs]
    net.hybridize(dynamic_batch=True, policy="depth")
    net.hybridize(dynamic_batch=True, policy="sequential")
    jitbatch.reset_stats()
    ys = [net(x) for x in xs]
    jitbatch.flush()
    st = jitbatch.stats()
    assert st["launches"] == 5 and st["last_flush"]["policy"] == "sequential"
    same(want, [y.asnumpy() for y in ys], "flagged twice")
    net.hybridize()
    jitbatch.reset_stats()
    ys = [net(x) for x in xs]
    assert jitbatch.stats()["nodes"] == 0 and not jitbatch.is_lazy(ys[0])
    same(want, [y.asnumpy() for y in ys], "plain hybridize")
