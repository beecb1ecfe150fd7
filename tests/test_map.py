"""``jitbatch.map``: the samples of a minibatch side by side, so that a read in
per-sample code (``asscalar`` to route a sample) waits for the other samples
and one flush serves them all. Differential (plain per-sample Gluon, same
parameters and inputs: outputs and gradients) and counters (flushes)."""
import threading

import numpy as np
import mxnet as mx
import pytest
from mxnet import autograd, gluon, nd

import jitbatch
from jitbatch.gluon import interleave
from examples.zoo import MODELS
from test_zoo import (GRANULARITIES, POLICIES, RUNNABLE, assert_close, assert_grads_close,
                      case, grads_of, run_per_sample)


def run_mapped(entry, net, samples, train=True):
    """run_per_sample (tests/test_zoo.py) with the loop over samples replaced by
    jitbatch.map."""
    return run_per_sample(entry, net, samples, train, each=jitbatch.map)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model", RUNNABLE)
def test_map_equals_per_sample(model, policy, granularity):
    c = case(model)
    c.net.hybridize(dynamic_batch=True, policy=policy, granularity=granularity)
    try:
        outs, loss, grads = run_mapped(c.entry, c.net, c.samples)
        inf_outs, _, _ = run_mapped(c.entry, c.net, c.samples, train=False)
    finally:
        c.net.hybridize(active=False)
    assert_close(loss, c.loss, "summed loss")
    for i, (got, inf, want) in enumerate(zip(outs, inf_outs, c.outs)):
        assert_close(got, want, "output of sample %d" % i)
        assert_close(inf, want, "inference output of sample %d" % i)
    assert_grads_close(grads, c.grads)


class Router(gluon.Block):
    """Per sample: a score, read in Python (``asscalar``) to pick one of two
    heads; written as a user writes it."""

    def __init__(self, **kwargs):
        super(Router, self).__init__(**kwargs)
        with self.name_scope():
            self.score = gluon.nn.Dense(2, in_units=5)
            self.heads = gluon.nn.HybridSequential()
            for _ in range(2):
                self.heads.add(gluon.nn.Dense(3, in_units=5))

    def forward(self, x):   # pylint: disable=arguments-differ
        k = int(self.score(x).argmax(axis=1).asscalar())
        return self.heads[k](x).tanh() * (k + 1)


def _router(flag, policy="agenda"):
    net = Router()
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    if flag:
        net.hybridize(dynamic_batch=True, policy=policy)
    return net


def _inputs(n=12, seed=3):
    rng = np.random.default_rng(seed)
    return [nd.array(rng.standard_normal((1, 5))) for _ in range(n)]


def _copy_params(src, dst):
    for (_, p), (_, q) in zip(sorted(src.collect_params().items()),
                              sorted(dst.collect_params().items())):
        q.set_data(p.data())


@pytest.mark.parametrize("policy", POLICIES)
def test_reads_inside_samples_cost_one_flush_per_read_point(policy):
    xs = _inputs()
    plain = _router(False)
    batched = _router(True, policy)
    _copy_params(plain, batched)
    want_loss = None
    for net, mapped in ((plain, False), (batched, True)):
        jitbatch.flush()
        jitbatch.reset_stats()
        with autograd.record():
            outs = jitbatch.map(net, xs) if mapped else [net(x) for x in xs]
            total = nd.add_n(*[(o * o).sum() for o in outs])
        total.backward()
        if not mapped:
            want = [o.asnumpy() for o in outs]
            want_loss, want_grads = total.asscalar(), grads_of(net)
            continue
        got = [o.asnumpy() for o in outs]
        st = jitbatch.stats()
        assert_close(total.asscalar(), want_loss, "loss")
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, "output of sample %d" % i)
        got_grads = grads_of(net)
        for (_, g), (_, w) in zip(sorted(got_grads.items()), sorted(want_grads.items())):
            assert_close(g, w, "gradient")
        # one flush for every sample's read of its score, one for the loss
        assert st["flushes"] == 2, st
        if policy != "sequential":
            # the twelve scores ran as one launch; the heads as at most two
            assert st["launches"] < st["nodes"], st


def test_a_plain_loop_flushes_at_every_read_and_map_does_not():
    xs = _inputs()
    net = _router(True)
    counts = {}
    for mapped in (False, True):
        jitbatch.flush()
        jitbatch.reset_stats()
        outs = jitbatch.map(net, xs) if mapped else [net(x) for x in xs]
        nd.concat(*outs, dim=0).asnumpy()
        counts[mapped] = jitbatch.stats()["flushes"]
    assert counts == {False: len(xs) + 1, True: 2}


def test_results_keep_the_order_of_the_items_and_side_effects_interleave_at_reads():
    net = _router(True)
    xs = _inputs(6)
    log = []

    def fn(i):
        log.append(("start", i))
        y = net(xs[i])
        y.asnumpy()
        log.append(("end", i))
        return i

    assert jitbatch.map(fn, range(6)) == list(range(6))
    # every sample started before any read finished: the reads waited for each other
    assert [e for e, _ in log[:6]] == ["start"] * 6
    assert sorted(i for e, i in log[6:]) == list(range(6))


def test_the_samples_run_under_the_callers_autograd_state_and_device():
    seen = []

    def fn(_):
        seen.append((autograd.is_recording(), autograd.is_training(),
                     mx.context.current_context()))
        return 0

    with mx.Context("cpu", 1):
        with autograd.record(train_mode=False):
            jitbatch.map(fn, range(3))
        jitbatch.map(fn, range(3))
    assert seen[:3] == [(True, False, mx.cpu(1))] * 3
    assert seen[3:] == [(False, False, mx.cpu(1))] * 3
    assert not autograd.is_recording()
    assert mx.context.current_context() == mx.cpu(0)


def test_an_error_in_one_sample_stops_the_others_names_its_item_and_the_next_call_is_right():
    xs = _inputs(8)
    plain = _router(False)
    net = _router(True)
    _copy_params(plain, net)
    finished = []

    def fn(i):
        y = net(xs[i])
        y.asnumpy()
        if i == 5:
            raise ValueError("bad sample")
        finished.append(i)
        return y

    with pytest.raises(ValueError, match="bad sample") as info:
        jitbatch.map(fn, range(8))
    assert any("item 5," in n for n in getattr(info.value, "__notes__", []))
    # the samples before it in the samples' order finished; none after it did
    assert 5 not in finished and len(finished) < 8
    assert not interleave.in_sample()
    got = jitbatch.map(net, xs)
    for g, x in zip(got, xs):
        assert_close(g.asnumpy(), plain(x).asnumpy(), "output after the error")


def test_a_nested_map_and_short_inputs_are_the_plain_loop():
    net = _router(True)
    xs = _inputs(4)
    plain = [net(x).asnumpy() for x in xs]
    nested = jitbatch.map(lambda i: [y.asnumpy() for y in jitbatch.map(net, xs[i:i + 2])],
                          range(3))
    for i, ys in enumerate(nested):
        for y, w in zip(ys, plain[i:i + 2]):
            assert_close(y, w, "nested output")
    assert jitbatch.map(lambda x: x * 2, [3]) == [6]
    assert jitbatch.map(lambda x: x, []) == []
    with pytest.raises(TypeError, match="at least one iterable"):
        jitbatch.map(len)


def test_several_iterables_give_each_call_one_item_of_each_up_to_the_shortest():
    net = _router(True)
    xs = _inputs(5)
    got = jitbatch.map(lambda x, w: net(x) * w, xs, [1.0, 2.0, 3.0, 4.0])
    assert len(got) == 4
    for g, x, w in zip(got, xs, [1.0, 2.0, 3.0, 4.0]):
        assert_close(g.asnumpy(), net(x).asnumpy() * w, "output")


def test_map_from_two_threads_at_once_keeps_each_callers_samples_apart():
    plain = _router(False)
    results, errors = {}, []

    def caller(seed):
        try:
            net = _router(True)
            _copy_params(plain, net)
            xs = _inputs(10, seed)
            got = [y.asnumpy() for y in jitbatch.map(net, xs)]
            results[seed] = (got, [plain(x).asnumpy() for x in xs])
        except Exception as e:  # pylint: disable=broad-except
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for got, want in results.values():
        for g, w in zip(got, want):
            assert_close(g, w, "output")


def test_moe_with_gate_routing_merges_under_map():
    entry = MODELS["moe"]
    c = case("moe")
    c.net.hybridize(dynamic_batch=True, policy="agenda")
    try:
        jitbatch.flush()
        jitbatch.reset_stats()
        run_mapped(entry, c.net, c.samples, train=False)
        st = jitbatch.stats()
    finally:
        c.net.hybridize(active=False)
    # the gates of all samples are read in one flush, their outputs and losses in a
    # second, the losses' sum (recorded on their lazy arrays) in a third; a loop
    # runs one flush per sample for the gates alone
    assert st["flushes"] == 3, st
    assert st["launches"] < st["nodes"] / 2, st


def test_a_minibatch_larger_than_the_thread_cap_runs_in_groups_of_that_many():
    xs = _inputs(10)
    plain = _router(False)
    net = _router(True)
    _copy_params(plain, net)
    saved = jitbatch.config.map_threads
    jitbatch.config.map_threads = 3
    try:
        jitbatch.flush()
        jitbatch.reset_stats()
        got = jitbatch.map(net, xs)
        out = nd.concat(*got, dim=0).asnumpy()
        st = jitbatch.stats()
    finally:
        jitbatch.config.map_threads = saved
    assert_close(out, nd.concat(*[plain(x) for x in xs], dim=0).asnumpy(), "outputs")
    # a read flush per group of three (3, 3, 3, 1 samples), then the caller's read
    assert st["flushes"] == 5, st


def test_the_callers_window_of_eager_calls_is_the_same_after_a_map():
    # a plain loop whose every flush holds one sample: 'auto' runs the calls
    # after it eagerly for a while; a map in between merges, and must leave
    # that window (and its streak) as the loop left it
    net = _router(True, policy="auto")
    xs = _inputs(8)
    jitbatch.flush()
    for x in xs:
        net(x).asnumpy()
    g = jitbatch.current_graph()
    before = (g.passthrough, g.quiet)
    assert before[0] > 0
    jitbatch.reset_stats()
    outs = jitbatch.map(net, xs)
    assert jitbatch.stats()["flushes"] == 1       # the samples' reads: one flush
    assert (g.passthrough, g.quiet) == before
    nd.concat(*outs, dim=0).asnumpy()


def _pipes():
    return {k: (p.graph, p.open, p.last, p.launches, p.ended)
            for k, p in jitbatch.PIPELINES.pipe.items()}


def test_the_flushes_of_a_map_teach_the_pipeline_nothing():
    # the pipelined-chunk search measures the caller's own loop; a map's graphs
    # run unchunked at their samples' reads, and their times must not count
    net = _router(True, policy="auto")
    xs = _inputs(8)
    jitbatch.flush()
    before = _pipes()
    outs = jitbatch.map(net, xs)
    nd.concat(*outs, dim=0).asnumpy()       # the caller's read, after the map
    assert _pipes() == before
