"""Granularity: a recursive block's input stage (what its early inputs alone
determine, e.g. the Tree-LSTM cell's input projections) run as ONE launch across
all depths ('split') instead of inside every level's launch ('block').

Oracles: outputs and gradients equal plain per-sample Gluon for every model and
policy; exact launch counts (one input-stage launch more, the levels unchanged);
the symbol partition itself; the cost model's choice from given measurements."""
import zlib

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon, nd

import jitbatch
from jitbatch import cost
from jitbatch.gluon.stages import partition
from jitbatch.signature import SigInfo

from harness import check_model, run
from models import MODELS, BinaryTreeNet, full_binary

RECURSIVE = ["binary", "childsum", "childsum_padded", "gru"]


@pytest.mark.parametrize("buckets", [16, 1], ids=["exact", "rounded"])
@pytest.mark.parametrize("policy", ["auto", "depth", "agenda"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_split_equals_plain(monkeypatch, model, train, policy, buckets):
    """``rounded``: launches of input and main stages rounded up to powers of
    two (config.row_buckets = 1), filler samples in most of them."""
    monkeypatch.setattr(jitbatch.config, "row_buckets", buckets)
    make, gen, apply = MODELS[model]
    rng = np.random.default_rng(zlib.crc32(("split/%s/%s/%s" % (model, train, policy)).encode()))
    st = check_model(make, gen, apply, rng, 6, train, policy, granularity="split")
    if buckets == 1 and model in RECURSIVE:
        assert st["filler_samples"] > 0, st
    gran = st["last_flush"]["granularity"]
    if model in RECURSIVE:
        assert gran and all(g["granularity"] == "split" for g in gran.values()), gran
        assert all(g["why"] == "set by the user" for g in gran.values())
    else:
        assert gran is None     # no block reads its own earlier outputs: nothing to split


def _launches(model, granularity, policy, train=False, seed=3):
    make, gen, apply = MODELS[model]
    net = make()
    samples = gen(np.random.default_rng(seed), 6)
    jitbatch.reset_stats()
    run(net, apply, samples, train, flag=True, policy=policy, granularity=granularity)
    return jitbatch.stats()


@pytest.mark.parametrize("policy", ["depth", "agenda"])
@pytest.mark.parametrize("model", RECURSIVE)
def test_split_adds_exactly_one_launch(model, policy):
    # all input stages read the samples' inputs (one depth): ONE launch for all
    # of them, even across signatures that differ in late inputs (child counts);
    # every other launch stays as it was
    block = _launches(model, "block", policy)
    split = _launches(model, "split", policy)
    assert split["nodes"] == block["nodes"] + sum(
        g["nodes"] for g in split["last_flush"]["granularity"].values())
    assert split["launches"] == block["launches"] + 1


def test_full_binary_tree_launches():
    # 8 leaves: levels of 8, 4, 2, 1 cells and one output layer per tree; 'block'
    # runs 4 cell launches + 1, 'split' one input-stage launch more
    net = BinaryTreeNet()
    net.initialize(mx.init.Uniform(0.5))
    xs = nd.array(np.random.default_rng(0).normal(size=(15, 3)))
    tree, _ = full_binary(4)
    counts = {}
    for gran in ("block", "split"):
        net.hybridize(dynamic_batch=True, policy="depth", granularity=gran)
        jitbatch.reset_stats()
        y = net(xs, tree)
        y.asnumpy()
        counts[gran] = (jitbatch.stats()["nodes"], jitbatch.stats()["launches"])
    assert counts == {"block": (16, 5), "split": (31, 6)}


def test_sequential_never_splits():
    st = _launches("childsum", "split", "sequential")
    assert st["launches"] == st["nodes"] and st["last_flush"]["granularity"] is None


def test_partition():
    x, y = mx.sym.var("x"), mx.sym.var("y")
    w = mx.sym.var("w")
    px = mx.sym.FullyConnected(x, w, num_hidden=3, no_bias=True, name="px")
    out = mx.sym.tanh(px + y, name="t")
    a, a_in, b, b_in = partition(out, ["x", "y"], {"x"})
    assert a_in == ["x"] and a.list_outputs() == ["px_output"]
    assert b_in == ["y", "_jb_stage0"] and "x" not in b.list_arguments()
    ex_a = a.bind(mx.cpu(), {"x": nd.ones((2, 4)), "w": nd.ones((3, 4))})
    p = ex_a.forward()[0]
    ex_b = b.bind(mx.cpu(), {"y": nd.ones((2, 3)), "_jb_stage0": p})
    np.testing.assert_allclose(ex_b.forward()[0].asnumpy(), np.tanh(5.0) * np.ones((2, 3)),
                               rtol=1e-6)
    # an early input the rest also reads directly stays an input of the main stage
    out2 = mx.sym.concat(mx.sym.tanh(px + y), x, dim=1)
    _, _, b2, b2_in = partition(out2, ["x", "y"], {"x"})
    assert b2_in == ["x", "y", "_jb_stage0"]
    # nothing depends on early inputs alone, or an output does: no split
    assert partition(mx.sym.tanh(x + y), ["x", "y"], {"x"}) is None
    assert partition(mx.sym.Group([px, out]), ["x", "y"], {"x"}) is None


class _Plan(object):
    def __init__(self, a_info, b_info):
        self.a_info, self.b_info = a_info, b_info


def _timed(name, fixed, per_row):
    info = SigInfo(0, (name,), None, (((1, 2), np.float32),), True, name)
    for rows in (1, 2, 4, 8):
        t = fixed + per_row * rows
        info.launches += 1
        info.launch_rows += rows
        info.launch_rr += rows * rows
        info.launch_cost += t
        info.launch_cr += t * rows
    return info


def test_cost_model_chooses_granularity():
    m = cost.Model()
    m.analysis["depth"] = 1e-6
    group = {2: 3, 3: 2, 4: 1}      # calls per depth
    block = _timed("blk", 1e-3, 3e-4)           # 3 launches: 3e-3 + 6 * 3e-4 = 4.8e-3
    # input stage carries most of the per-row work: 1 launch 1e-3 + 6 * 2e-4;
    # main stage 3 launches of 1e-3 + rows * 1e-4: total 5.8e-3 -> block wins
    use, why, pred = m.split_gain(block, _Plan(_timed("a", 1e-3, 2e-4), _timed("b", 1e-3, 1e-4)),
                                  group, 100, "depth", None, False)
    assert not use and why == "block cheaper predicted"
    assert pred["block"]["execute"] == pytest.approx(4.8e-3)
    assert pred["split"]["execute"] == pytest.approx(5.8e-3)
    # cheap launches, rows cheaper in one big input launch: split wins
    use, why, pred = m.split_gain(_timed("blk", 1e-4, 5e-4),
                                  _Plan(_timed("a", 1e-4, 1e-4), _timed("b", 1e-4, 2e-4)),
                                  group, 100, "depth", None, False)
    assert use and why.startswith("cheaper predicted"), pred
    # the extra analysis of splitting flushes counts against it
    # (block 3.3e-3, split 2.2e-3 + 2e-3 more analysis over 100 nodes)
    m.analysis["depth+split"] = 1e-6 + 2e-5
    use, _, pred = m.split_gain(_timed("blk", 1e-4, 5e-4),
                                _Plan(_timed("a", 1e-4, 1e-4), _timed("b", 1e-4, 2e-4)),
                                group, 100, "depth", None, False)
    assert not use and pred["split"]["extra_analysis"] == pytest.approx(2e-3)
    # over the analysis budget: not split
    m.analysis["depth+split"] = 1e-6
    m.unbatched = 1e-2
    use, why, _ = m.split_gain(_timed("blk", 1e-4, 5e-4),
                               _Plan(_timed("a", 1e-4, 1e-4), _timed("b", 1e-4, 2e-4)),
                               group, 100, "depth", 1e-5, False)
    assert not use and "budget" in why
    # stages not timed: a calibrating flush splits to time them, others do not
    fresh = _Plan(SigInfo(0, ("a",), None, (), True, "a"), SigInfo(0, ("b",), None, (), True, "b"))
    assert m.split_gain(block, fresh, group, 100, "depth", None, True)[0]
    assert not m.split_gain(block, fresh, group, 100, "depth", None, False)[0]
    untimed = SigInfo(0, ("c",), None, (), True, "c")
    assert not m.split_gain(untimed, fresh, group, 100, "depth", None, True)[0]


def test_auto_times_the_split_then_decides(monkeypatch):
    # under 'auto': the 2nd flush (calibrating) times the block, the 3rd
    # (calibrating) the two stages; later flushes choose from those times
    from jitbatch.gluon import signatures
    model = cost.Model()
    monkeypatch.setattr(cost, "MODEL", model)
    monkeypatch.setattr(signatures, "_MEASURED", {})   # no times inherited from other tests
    make, gen, apply = MODELS["childsum_padded"]
    net = make()
    net.hybridize(dynamic_batch=True)
    seen = []
    for k in range(5):
        samples = gen(np.random.default_rng(k), 6)
        with autograd.record():
            res = [apply(net, s)[1] for s in samples]
            nd.add_n(*res).backward()
        lf = jitbatch.stats()["last_flush"]
        (g,) = lf["granularity"].values()
        seen.append((lf["calibrated"], g["granularity"], g["why"], g["predicted"]))
    assert seen[0][:3] == (False, "block", "block launches not timed yet")
    assert seen[1][:3] == (True, "block", "block launches not timed yet")
    assert seen[2][:3] == (True, "split", "timing the split (calibrating flush)")
    for _, gran, why, pred in seen[3:]:
        assert why == "block cheaper predicted" if gran == "block" else \
            why.startswith("cheaper predicted (input stage merged across")
        assert pred["block"]["execute"] > 0 and pred["split"]["execute"] > 0
        assert (gran == "split") == (pred["split"]["execute"] + pred["split"]["extra_analysis"]
                                     < pred["block"]["execute"])


def test_bad_granularity_is_explained():
    net = gluon.nn.Dense(2, in_units=2)
    with pytest.raises(jitbatch.FlagError, match=r"granularity='fine'.*'auto', 'block', 'split'"):
        net.hybridize(dynamic_batch=True, granularity="fine")


class _ReluResidual(gluon.HybridBlock):
    """``relu(Dense(concat(x, y, z))) + 0.1 z``: split with ``x`` late, its input
    stage is ``0.1 z``, and MXNet 1.9 cannot run the backward of the main stage
    reading it (``relu(FullyConnected(...)) + s``, s another recorded operator's
    output: apache/mxnet#14228)."""

    def __init__(self, width, **kw):
        super(_ReluResidual, self).__init__(**kw)
        with self.name_scope():
            self.d = gluon.nn.Dense(width, in_units=3 * width)

    def hybrid_forward(self, F, x, y, z):
        return F.relu(self.d(F.concat(x, y, z, dim=1))) + 0.1 * z


@pytest.mark.parametrize("policy", ["agenda", "depth", "auto", "sequential"])
def test_a_split_mxnet_cannot_differentiate_keeps_one_stage(policy):
    # found by a 10,000-program property run: such a block's calls under
    # granularity 'split' in training ran into MXNet's backward error; the
    # split is tried on zeros first (input gradients only) and, failing, not used
    net = _ReluResidual(4)
    net.initialize(mx.init.Uniform(0.5))
    rng = np.random.default_rng(0)
    a, b, c = [nd.array(rng.normal(size=(1, 4))) for _ in range(3)]

    def go(flag):
        if flag:
            net.hybridize(dynamic_batch=True, policy=policy, granularity="split")
        else:
            net.hybridize(active=False)
        net.collect_params().zero_grad()
        with autograd.record():
            t1 = net(a, b, c)
            t2 = net(t1, b, c)       # x reads the block's own earlier call: late
            t3 = net(a, c, b)
            t4 = net(t3, a, b)
            loss = (t2 * t2).sum() + (t4 * t4).sum()
        loss.backward()
        return loss.asscalar(), {k: p.grad().asnumpy().copy()
                                 for k, p in net.collect_params().items()}
    want, want_g = go(False)
    got, got_g = go(True)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for k in want_g:
        np.testing.assert_allclose(got_g[k], want_g[k], rtol=1e-4, atol=1e-6)
    assert not jitbatch.stats()["last_flush"]["granularity"]   # one stage: not split
    net.hybridize(active=False)
