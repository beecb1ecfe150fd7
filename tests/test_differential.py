"""Batched vs plain per-sample Gluon: outputs and all parameter gradients, for every
model family, policy, and autograd mode."""
import zlib

import numpy as np
import pytest
from mxnet import autograd, nd
from mxnet.gluon import nn

import jitbatch
from jitbatch.schedule import bucket
from harness import check_model
from models import MODELS

POLICIES = ["auto", "depth", "agenda", "sequential"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_batched_equals_plain(model, train, policy):
    make, gen, apply = MODELS[model]
    rng = np.random.default_rng(zlib.crc32(("%s/%s/%s" % (model, train, policy)).encode()))
    st = check_model(make, gen, apply, rng, 6, train, policy)
    assert st["nodes"] > 0
    if policy != "sequential":
        # merging really happened: fewer launches than recorded nodes
        assert st["launches"] < st["nodes"], st
    else:
        assert st["launches"] == st["nodes"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_filler_samples_change_nothing(monkeypatch, model, train, policy):
    """Block launches rounded up to a power of two (config.row_buckets = 1: more
    than 2 samples): the filler samples' outputs are never read and add
    nothing to any gradient."""
    from jitbatch.gluon import gather
    monkeypatch.setattr(jitbatch.config, "row_buckets", 1)
    launched = []       # per launch: (nodes, samples run, rounded?)
    gather_batch = gather.gather_batch

    def spy(batch):
        first = batch[0]
        uniform = all(n.rows == first.rows for n in batch)   # (ragged: rows per sample)
        launched.append((len(batch), first.group.size, first.info.op.rounds and uniform))
        return gather_batch(batch)
    monkeypatch.setattr(gather, "gather_batch", spy)
    make, gen, apply = MODELS[model]
    rng = np.random.default_rng(zlib.crc32(("fill/%s/%s/%s" % (model, train, policy)).encode()))
    st = check_model(make, gen, apply, rng, 7, train, policy)
    assert [size for _, size, _ in launched] == \
        [bucket(n, 1) if rounded else n for n, _, rounded in launched], launched
    assert st["filler_samples"] == sum(size - n for n, size, _ in launched), (st, launched)
    # 7 samples: every model has launches of 3 or more (sequential: of 1)
    assert (st["filler_samples"] > 0) == (policy != "sequential"), st


@pytest.mark.parametrize("buckets, launched", [(16, 36), (0, 35), (2, 48), (1, 64)])
def test_launch_sizes_are_rounded_up(monkeypatch, buckets, launched):
    """35 calls merge into one launch of ``launched`` samples (config.row_buckets
    sizes per doubling above 2 x row_buckets): exact filler count, the same
    outputs and gradients as 35 separate calls."""
    monkeypatch.setattr(jitbatch.config, "row_buckets", buckets)
    net = nn.Dense(3, in_units=4)
    net.initialize()
    xs = [nd.array(np.random.default_rng(i).normal(size=(1, 4))) for i in range(35)]
    launched_rows = []
    call = net._call_cached_op      # pylint: disable=protected-access

    def counting(*args):
        launched_rows.append(args[0].shape[0])
        return call(*args)
    outs = {}
    for flag in (False, True):
        if flag:
            net.hybridize(dynamic_batch=True)
            monkeypatch.setattr(net, "_call_cached_op", counting)
        else:
            net.hybridize(active=False)
        jitbatch.reset_stats()
        with autograd.record():
            ys = [net(x) for x in xs]
            total = nd.add_n(*[(y * y).sum() for y in ys])
        total.backward()
        outs[flag] = ([y.asnumpy() for y in ys], net.weight.grad().asnumpy().copy(),
                      net.bias.grad().asnumpy().copy())
    st = jitbatch.stats()
    assert st["filler_samples"] == launched - 35, st
    assert launched_rows == [launched], launched_rows
    for a, b in zip(outs[False][0], outs[True][0]):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs[True][1], outs[False][1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outs[True][2], outs[False][2], rtol=1e-5, atol=1e-5)
