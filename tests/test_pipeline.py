"""Pipelined flushes: under 'auto' a large pending graph runs in chunks while
recording goes on (config.pipeline; the chunk size from pipeline.Pipelines.limit).

Oracles: outputs and gradients equal plain Gluon with chunks forced small; exact
flush counts; the chunk-size rule from given measurements."""
import zlib

import numpy as np
import pytest
from mxnet import nd
from mxnet.gluon import nn

import jitbatch
from jitbatch import pipeline

from harness import check_model
from models import MODELS


@pytest.fixture
def chunks(monkeypatch):
    """Pipelining on, with a fixed chunk size (set by the test)."""
    monkeypatch.setattr(jitbatch.config, "pipeline", True)
    monkeypatch.setattr(pipeline, "FREE_CORE", True)
    size = {"n": None}
    monkeypatch.setattr(pipeline.Pipelines, "limit", lambda self, mode, price=None, net=None: size["n"])
    return size


@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_chunked_graphs_equal_plain(chunks, model, train):
    chunks["n"] = 7
    make, gen, apply = MODELS[model]
    rng = np.random.default_rng(zlib.crc32(("pipe/%s/%s" % (model, train)).encode()))
    st = check_model(make, gen, apply, rng, 6, train, "auto")
    assert st["pipelined_flushes"] >= 2, st


def test_chunks_of_exactly_the_limit(chunks):
    chunks["n"] = 10
    net = nn.Dense(3, in_units=3)
    net.initialize()
    net.hybridize(dynamic_batch=True)
    xs = [nd.array(np.random.default_rng(i).normal(size=(1, 3))) for i in range(35)]
    jitbatch.reset_stats()
    ys = [net(x) for x in xs]
    st = jitbatch.stats()
    assert (st["pipelined_flushes"], st["auto_flushes"], st["pending"]) == (3, 0, 5)
    assert st["last_flush"]["reason"] == "pipeline" and st["last_flush"]["nodes"] == 10
    assert st["last_flush"]["chunk_size"] == 10
    net.hybridize(active=False)
    for x, y in zip(xs, ys):
        np.testing.assert_allclose(y.asnumpy(), net(x).asnumpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["fixed policy", "switched off", "no measurement",
                                 "no free core"])
def test_no_chunks(chunks, monkeypatch, how):
    chunks["n"] = 10
    policy = "auto"
    if how == "fixed policy":
        policy = "agenda"
    elif how == "switched off":
        monkeypatch.setattr(jitbatch.config, "pipeline", False)
    elif how == "no free core":
        monkeypatch.setattr(pipeline, "FREE_CORE", False)
    else:
        chunks["n"] = None
    net = nn.Dense(3, in_units=3)
    net.initialize()
    net.hybridize(dynamic_batch=True, policy=policy)
    xs = [nd.ones((1, 3)) * i for i in range(35)]    # concrete: nothing pending yet
    jitbatch.reset_stats()
    ys = [net(x) for x in xs]
    st = jitbatch.stats()
    assert st["pipelined_flushes"] == 0 and st["pending"] == 35
    assert ys[-1].shape == (1, 3)
    jitbatch.flush()
    assert jitbatch.stats()["last_flush"]["chunk_size"] is None


class _Clock(object):
    """perf_counter for the cost model, and CPU clocks whose other threads
    (process minus this thread) run ``busy`` of the wall time, this one ``main``."""

    def __init__(self, busy=0.0, main=0.0):
        self.now = 100.0
        self.busy = busy
        self.main = main

    def perf_counter(self):
        return self.now

    def process_time(self):
        return (self.busy + self.main) * self.now

    def thread_time(self):
        return self.main * self.now


def _cycle(m, mode, clock, nodes, us_per_node, launches=10, calibrated=False, cold=0.0,
           price=None):
    """One graph between reads: its first record asks the chunk size, it takes
    ``us_per_node`` per node (``cold`` more when its chunk count differs from
    the last cycle's: new launch sizes), a read ends it (``price``: what one
    more launch costs). Returns the chunk size used."""
    p = m.of(mode)
    before = p.chunks if p is not None else 1
    size = m.limit(mode, price)
    if m.of(mode).chunks != before:
        us_per_node += cold
    clock.now += nodes * us_per_node * 1e-6
    m.observe(mode, nodes, launches, True, calibrated)
    return size


def test_chunk_count_is_chosen_by_measured_cycles(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(pipeline, "time", clock)
    m = pipeline.Pipelines()
    infer = (False, False)
    m.observe(infer, 10000, 10, True, warm=False)   # the process's first flush: not used
    assert m.limit(infer) is None and m.of(infer) is None
    m.observe(infer, 10000, 10, True)
    speed = {1: 30.0, 2: 20.0, 3: 25.0, 4: 40.0}    # us per node by chunk count
    used = []
    for _ in range(16):
        # the first cycle after a change is slow (new launch sizes): not measured
        size = _cycle(m, infer, clock, 10000, speed[m.of(infer).chunks], cold=100.0)
        used.append(m.of(infer).chunks)
        assert size == (None if used[-1] == 1 else -(-10000 // used[-1]))
    # 1 chunk is measured over 3 cycles, then 2 (better; a cycle to warm, 3
    # measured), then 3 (worse than 2): back to 2, whose neighbours are both known
    assert used == [1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 2, 2, 2, 2, 2], used
    assert m.report() == [{
        "recording": False, "training": False, "chunks": 2, "chunk_size": 5000,
        "graph_nodes": 10000, "us_per_node": {1: 30.0, 2: 20.0, 3: 25.0},
        "kernels_busy": {1: 0.0, 2: 0.0, 3: 0.0},
        "recording_busy": {1: 0.0, 2: 0.0, 3: 0.0}}]
    # a cycle with a calibrating flush, or one that did not start at a chunk-size
    # question (pipelining was off), is not measured
    n = len(m.of(infer).times[2])
    _cycle(m, infer, clock, 10000, 999.0, calibrated=True)
    m.observe(infer, 10000, 10, True)
    clock.now += 50.0
    _cycle(m, infer, clock, 10000, 20.0)
    assert m.of(infer).times[2][-1] == pytest.approx(20e-6) and \
        len(m.of(infer).times[2]) == min(n + 1, pipeline.PIPE_KEEP)
    # every PIPE_REPROBE cycles the other counts are measured again: 3 (its
    # warm cycle was the last above; 3 measured), then (still worse) back to 2
    # for a cycle, then 1 (a warm cycle, 3 measured), and 2 again
    while m.of(infer).cycles % pipeline.PIPE_REPROBE:
        _cycle(m, infer, clock, 10000, speed[m.of(infer).chunks])
    assert set(m.of(infer).times) == {2} and m.of(infer).chunks == 3
    assert [(_cycle(m, infer, clock, 10000, speed[m.of(infer).chunks], cold=100.0),
             m.of(infer).chunks)[1] for _ in range(9)] == [3, 3, 3, 2, 1, 1, 1, 1, 2]
    assert m.of(infer).times[3] == [pytest.approx(25e-6)] * 3


@pytest.mark.parametrize("busy, main, used", [
    # 1 chunk: 0.3 s cycles; one more chunk adds 10 launches of 2 ms each (20 ms)
    (0.95, 0.9, [1] * 8),                   # kernels wait 15 ms: 2 chunks never tried
    (0.3, 0.97, [1] * 8),                   # Python waits 9 ms: never tried
    (0.05, 0.5, [1] * 8),                   # 15 ms of kernels to hide: never tried
    (0.5, 0.5, [1, 1, 1, 2, 2, 2, 2, 3])])  # both wait 150 ms: 2, then 3 tried
def test_more_chunks_only_where_overlap_can_save_what_they_cost(monkeypatch, busy, main, used):
    clock = _Clock(busy, main)
    monkeypatch.setattr(pipeline, "time", clock)
    m = pipeline.Pipelines()
    train = (True, True)
    m.observe(train, 10000, 10, True)
    speed = {1: 30.0, 2: 20.0, 3: 25.0}
    price = 1.5e-3 + 0.5e-3                # a launch: fixed kernel + issue time
    got = [(_cycle(m, train, clock, 10000, speed[m.of(train).chunks], price=price),
            m.of(train).chunks)[1] for _ in range(8)]
    assert got == used, got
    assert m.of(train).busy_of(1) == pytest.approx(busy)
    assert m.report()[0]["kernels_busy"][1] == pytest.approx(busy, abs=1e-3)
    assert m.report()[0]["recording_busy"][1] == pytest.approx(main, abs=1e-3)


def test_chunks_only_where_each_merges(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(pipeline, "time", clock)
    m = pipeline.Pipelines()
    infer, train = (False, False), (True, True)
    # a chunk must hold CHUNK_MERGE nodes per launch: 10,000 nodes in 600
    # launches can be cut in 4 (2,500 >= 2,400) but not 5
    m.observe(infer, 10000, 600, True)
    p = m.of(infer)
    assert [p.feasible(c) for c in (1, 2, 4, 5)] == [True, True, True, False]
    # a chain of 200 nodes in 200 launches never runs in chunks, however slow
    m.observe(train, 200, 200, True)
    for _ in range(12):
        assert _cycle(m, train, clock, 200, 50.0, launches=200) is None
    assert m.of(train).chunks == 1
    # graphs that shrink: the count in use falls back to one that fits
    q = m.of(infer)
    q.chunks = 4
    m.observe(infer, 5000, 600, True)
    assert q.choose() < 4 and q.feasible(q.choose())


@pytest.mark.parametrize("env, cores, free", [("1", 2, True), ("2", 2, False), ("", 2, False),
                                              ("x", 4, False), ("3", 4, True)])
def test_a_free_core_is_read_from_omp_num_threads(monkeypatch, env, cores, free):
    monkeypatch.setenv("OMP_NUM_THREADS", env)
    monkeypatch.setattr(pipeline.os, "cpu_count", lambda: cores)
    assert pipeline.kernels_leave_a_core() is free


@pytest.fixture
def timed(monkeypatch):
    """The chunk search past the process's first flush, on a fake clock, having
    seen one inference graph of 10,000 nodes in 10 launches."""
    clock = _Clock()
    monkeypatch.setattr(pipeline, "time", clock)
    m = pipeline.Pipelines()
    m.observe((False, False), 10000, 10, True)
    return m, clock, (False, False)


def test_each_thread_measures_its_own_cycles(timed):
    """Graphs are per thread: a thread's cycles and chunk count are its own."""
    import threading
    m, clock, infer = timed
    for _ in range(4):
        _cycle(m, infer, clock, 10000, 30.0)
    other = []

    def run():
        m.observe(infer, 600, 200, True)     # a small graph: never chunked
        other.append([_cycle(m, infer, clock, 600, 99.0, launches=200) for _ in range(5)])
        other.append(m.of(infer).chunks)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert other == [[None] * 5, 1]
    p = m.of(infer)
    assert p.graph == 10000 and p.chunks == 2 and p.median(1) == pytest.approx(30e-6)
    assert len(m.report()) == 2


def test_a_flat_curve_keeps_one_chunk(timed):
    """Counts within PIPE_MARGIN of each other: the fewest is kept, and the
    search does not walk on past 2."""
    m, clock, infer = timed
    speed = {1: 30.0, 2: 29.0, 3: 20.0}   # 2 is 3% faster than 1: not enough
    used = [(_cycle(m, infer, clock, 10000, speed[m.of(infer).chunks]),
             m.of(infer).chunks)[1] for _ in range(11)]
    assert used == [1, 1, 1, 2, 2, 2, 2, 1, 1, 1, 1], used


def test_a_short_last_chunk_that_merges_nothing_keeps_the_next_graph_recorded(chunks,
                                                                              monkeypatch):
    # chunks of 10 nodes: 22 calls run as 10, 10 and a last chunk of 2 that
    # merges nothing; the graph merged well, so the next minibatch is recorded
    # (judged per chunk, its first calls ran unbatched)
    from jitbatch import cost
    monkeypatch.setattr(cost, "MODEL", cost.Model())     # priors, not other tests' times
    chunks["n"] = 10
    enc, head = nn.Dense(3, in_units=3), nn.Dense(2, in_units=3)
    for b in (enc, head):
        b.initialize()
        b.hybridize(dynamic_batch=True)
    xs = [nd.array(np.random.default_rng(i).normal(size=(1, 3))) for i in range(11)]
    for step in range(3):
        jitbatch.reset_stats()
        outs = [head(enc(x)) for x in xs]
        got = nd.concat(*outs, dim=0).asnumpy()
        st = jitbatch.stats()
        assert st["nodes"] == 22 and st["pipelined_flushes"] == 2, (step, st)
        assert st["launches"] < 22, (step, st)
    for b in (enc, head):
        b.hybridize(active=False)
    want = np.concatenate([head(enc(x)).asnumpy() for x in xs])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_cycle_ends_where_another_modes_graph_starts(timed):
    """Training and evaluation interleaved: a training cycle is timed from its
    first record to the evaluation graph's, not to the next training graph's
    (which would count the evaluation as training time)."""
    m, clock, infer = timed
    train = (True, True)
    m.observe(train, 10000, 10, True)
    for _ in range(4):
        m.limit(train)
        clock.now += 10000 * 30e-6           # the training graph: 30 us per node
        m.observe(train, 10000, 10, True)
        m.limit(infer)                       # an evaluation graph starts
        clock.now += 5.0                     # ... and takes long
        m.observe(infer, 10000, 10, True)
    m.limit(train)
    assert m.of(train).times[1] == [pytest.approx(30e-6)] * 3, m.of(train).times  # (5.3 s before)


def test_a_cycle_with_other_work_before_the_next_graph_is_not_measured(timed):
    """Other models or modes timed between two steps (a benchmark's
    interleaved rounds, an evaluation without jitbatch): the time between a
    graph's last flush and the next graph is not the graph's own, and a cycle
    where it is several times the graph's time is not measured."""
    m, clock, infer = timed
    for k in range(6):
        m.limit(infer)
        clock.now += 10000 * 20e-6           # the graph: 20 us per node (0.2 s)
        m.observe(infer, 10000, 10, True)
        clock.now += 0.05 if k % 2 else 5.0  # a read's wait, or other work
    m.limit(infer)
    # the three cycles followed by 0.05 s are measured (0.25 s each), the three
    # followed by 5 s (other work) are not
    assert m.of(infer).times[1] == [pytest.approx(25e-6)] * 3, m.of(infer).times


def test_each_network_has_a_pipe_of_its_own_and_old_ones_are_dropped():
    m = pipeline.Pipelines()
    infer = (False, False)
    a, b = object(), object()
    m.observe(infer, 100, 10, True, net=a)
    assert m.of(infer, net=a) is not None
    assert m.of(infer, net=b) is None and m.of(infer) is None
    nets = [object() for _ in range(pipeline.PIPES_KEPT + 5)]
    for n in nets:
        m.observe(infer, 100, 10, True, net=n)
    assert len(m.pipe) == pipeline.PIPES_KEPT
    assert m.of(infer, net=nets[-1]) is not None and m.of(infer, net=a) is None


def test_a_flush_teaches_the_pipe_of_the_network_that_began_its_graph():
    # two networks in one process (training one, evaluating another): the times
    # of one network's graphs must not choose the other's chunk count
    nets = []
    for _ in range(2):
        net = nn.Dense(3, in_units=3)
        net.initialize()
        net.hybridize(dynamic_batch=True, policy="auto")
        nets.append(net)
    a, b = nets
    infer = (False, False)
    for _ in range(3):
        nd.concat(*[a(nd.ones((1, 3)) * i) for i in range(6)], dim=0).asnumpy()
    pa = pipeline.PIPELINES.of(infer, net=a._jb_cfg.serial)   # pylint: disable=protected-access
    assert pa is not None and pa.graph is not None
    assert pipeline.PIPELINES.of(infer, net=b._jb_cfg.serial) is None   # pylint: disable=protected-access


def _dense_net():
    net = nn.Dense(3, in_units=3)
    net.initialize()
    net.hybridize(dynamic_batch=True, policy="auto")
    return net


def _run_inference(net, graphs=3):
    for _ in range(graphs):
        nd.concat(*[net(nd.ones((1, 3)) * i) for i in range(6)], dim=0).asnumpy()


def test_a_new_network_never_takes_the_pipe_of_a_freed_one():
    # a process that builds one model after another frees the old flags
    # objects; CPython hands their memory (and id()) to the next one, which
    # then chose its chunk count from the old network's times
    import gc
    infer = (False, False)
    pipes = []
    for _ in range(20):
        net = _dense_net()
        _run_inference(net)
        pipe = pipeline.PIPELINES.of(infer, net=net._jb_cfg.serial)   # pylint: disable=protected-access
        assert pipe is not None and all(pipe is not p for p in pipes)
        pipes.append(pipe)
        del net
        gc.collect()
