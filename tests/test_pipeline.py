"""Pipelined flushes: under 'auto' a large pending graph runs in chunks while
recording goes on (config.pipeline; the chunk size from cost.Model.pipeline_limit).

Oracles: outputs and gradients equal plain Gluon with chunks forced small; exact
flush counts; the chunk-size rule from given measurements."""
import zlib

import numpy as np
import pytest
from mxnet import nd
from mxnet.gluon import nn

import jitbatch
from jitbatch import cost

from harness import check_model
from models import MODELS


@pytest.fixture
def chunks(monkeypatch):
    """Pipelining on, with a fixed chunk size (set by the test)."""
    from jitbatch.gluon import hook
    monkeypatch.setattr(jitbatch.config, "pipeline", True)
    monkeypatch.setattr(hook, "_FREE_CORE", True)
    size = {"n": None}
    monkeypatch.setattr(cost.Model, "pipeline_limit", lambda self, mode: size["n"])
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
        from jitbatch.gluon import hook
        monkeypatch.setattr(hook, "_FREE_CORE", False)
    else:
        chunks["n"] = None
    net = nn.Dense(3, in_units=3)
    net.initialize()
    net.hybridize(dynamic_batch=True, policy=policy)
    jitbatch.reset_stats()
    ys = [net(nd.ones((1, 3)) * i) for i in range(35)]
    st = jitbatch.stats()
    assert st["pipelined_flushes"] == 0 and st["pending"] == 35
    assert ys[-1].shape == (1, 3)
    jitbatch.flush()
    assert jitbatch.stats()["last_flush"]["chunk_size"] is None


def test_chunk_size_rule():
    m = cost.Model()
    infer, train = (False, False), (True, True)
    m.flushes = 1                  # the process's first flush: not used
    m.observe_pipeline(infer, 10000, 10, 0.2, 8e-3, True)
    assert m.pipeline_limit(infer) is None
    m.flushes = 5
    # a graph of 10,000 nodes between reads, kernels 20 us per node (0.2 s),
    # 8 ms to issue a flush's launches: c chunks cost c * 8 ms and leave 0.2 s / c
    # of kernels to wait for; least at c = 5, chunks of 2,000 nodes
    m.observe_pipeline(infer, 10000, 10, 0.2, 8e-3, True)
    assert m.pipeline_limit(infer) == 2000
    # chunks (flushes that did not end the graph) add up to one graph; a
    # calibrating flush's issue time (None) is not used
    m2 = cost.Model()
    m2.flushes = 5
    for _ in range(4):
        m2.observe_pipeline(infer, 2500, 10, 0.05, 8e-3, False)
    assert m2.pipeline_limit(infer) is None          # no graph has ended yet
    m2.observe_pipeline(infer, 100, 10, 0.002, None, True)
    assert m2.pipe[infer].graph == 10100 and m2.pipe[infer].issue == pytest.approx(8e-3)
    assert m2.pipeline_limit(infer) == round((10100 * 8e-3 / 20e-6) ** 0.5)
    # under autograd recording every launch has a backward: issue counts twice
    m.observe_pipeline(train, 10000, 10, 0.2, 4e-3, True)
    assert m.pipeline_limit(train) == 2000
    # later graphs move the measurements by exponential averaging
    m.observe_pipeline(infer, 10000, 10, 0.2, 18e-3, True)
    assert m.pipe[infer].issue == pytest.approx(0.8 * 8e-3 + 0.2 * 18e-3)
    # fewer than two chunks would pay: the graph runs whole
    m.observe_pipeline((False, True), 600, 10, 0.012, 10e-3, True)   # would be 548 > 300
    assert m.pipeline_limit((False, True)) is None
    # a chunk must hold CHUNK_MERGE nodes per launch: a graph whose flushes
    # merge little, or a chain of 200 nodes in 200 launches, runs whole
    m3 = cost.Model()
    m3.flushes = 5
    m3.observe_pipeline(infer, 10000, 600, 0.2, 8e-3, True)    # 2000 < 4 x 600
    assert m3.pipeline_limit(infer) is None
    m3.observe_pipeline(train, 200, 200, 0.2, 8e-3, True)
    assert m3.pipeline_limit(train) is None
    assert m.pipeline_limit((True, False)) is None


@pytest.mark.parametrize("env, cores, free", [("1", 2, True), ("2", 2, False), ("", 2, False),
                                              ("x", 4, False), ("3", 4, True)])
def test_a_free_core_is_read_from_omp_num_threads(monkeypatch, env, cores, free):
    from jitbatch.gluon import hook
    monkeypatch.setenv("OMP_NUM_THREADS", env)
    monkeypatch.setattr(hook.os, "cpu_count", lambda: cores)
    assert hook.kernels_leave_a_core() is free
