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
    monkeypatch.setattr(jitbatch.config, "pipeline", True)
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
    net.hybridize(active=False)
    for x, y in zip(xs, ys):
        np.testing.assert_allclose(y.asnumpy(), net(x).asnumpy(), rtol=1e-5)


@pytest.mark.parametrize("how", ["fixed policy", "switched off", "no measurement"])
def test_no_chunks(chunks, monkeypatch, how):
    chunks["n"] = 10
    policy = "auto"
    if how == "fixed policy":
        policy = "agenda"
    elif how == "switched off":
        monkeypatch.setattr(jitbatch.config, "pipeline", False)
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


def test_chunk_size_rule():
    m = cost.Model()
    infer, train = (False, False), (True, True)
    m.flushes = 1                  # the process's first flush: not used
    m.observe_pipeline(infer, 1000, 1e-2, 1e-2, 1e-2, 5e-3)
    assert m.pipeline_limit(infer) is None
    m.flushes = 5
    # recording 10 us per node, analysis + kernels 20 us, fixed costs 10 ms:
    # a boundary after n nodes saves 10 us * n and costs 10 ms: chunks where
    # that saves twice the cost, n = 2001
    m.observe_pipeline(infer, 1000, 1e-2, 5e-3, 15e-3, 1e-2)
    assert m.pipeline_limit(infer) == pytest.approx(2001, abs=1)
    # under autograd recording each launch has a backward: fixed costs count twice
    m.observe_pipeline(train, 1000, 1e-2, 5e-3, 15e-3, 1e-2)
    assert m.pipeline_limit(train) == pytest.approx(4001, abs=1)
    # later flushes move the measurements by exponential averaging
    m.observe_pipeline(infer, 1000, 1e-2, 1e-3, 4e-3, 1e-2)   # 5 us per node
    assert m.pipe[infer] == pytest.approx([10e-6, 0.8 * 20e-6 + 0.2 * 5e-6, 1e-2])
    assert m.pipeline_limit((True, False)) is None
    # kernels faster than recording: they bound the overlap (5 us per node)
    m2 = cost.Model()
    m2.flushes = 5
    m2.observe_pipeline(infer, 1000, 1e-2, 1e-3, 4e-3, 1e-2)
    assert m2.pipeline_limit(infer) == pytest.approx(4001, abs=1)
