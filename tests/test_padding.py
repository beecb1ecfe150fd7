"""jitbatch.zero_pad: calls that differ only in a zero-paddable axis share launches.

Oracles: outputs and gradients equal plain per-sample Gluon; exact launch counts
with and without the declaration and for each split the cost model picks; the
split itself (dynamic programming) checked against brute force."""
import itertools

import numpy as np
import pytest
from mxnet import autograd, gluon, nd
from mxnet.gluon import HybridBlock

import jitbatch
from jitbatch import cost, schedule
from jitbatch.signature import SigInfo

from harness import assert_same, prepare


class SumCell(HybridBlock):
    """x: (1, D); ch: (1, K, H) -> (1, H). Absent children (zeros) add nothing."""

    def __init__(self, hidden=4, **kw):
        super(SumCell, self).__init__(**kw)
        with self.name_scope():
            self.wx = gluon.nn.Dense(hidden, in_units=3)
            self.wh = gluon.nn.Dense(hidden, in_units=hidden, use_bias=False, flatten=False)

    def hybrid_forward(self, F, x, ch):  # pylint: disable=arguments-differ
        return F.tanh(self.wx(x) + F.sum(self.wh(ch), axis=1))


class Net(gluon.Block):
    def __init__(self, **kw):
        super(Net, self).__init__(**kw)
        with self.name_scope():
            self.cell = SumCell()
            self.make = gluon.nn.Dense(4, in_units=4, flatten=False)

    def forward(self, x, kids, produced=False):  # pylint: disable=arguments-differ
        if produced:   # the children as one array made by another block: (1, K, 4)
            ch = self.make(kids)
        else:          # a stack of per-child rows: the Tree-LSTM's way
            ch = nd.stack(*[kids[j:j + 1] for j in range(kids.shape[0])], axis=1)
        return self.cell(x, ch)


def samples(rng, ks):
    return [(nd.array(rng.normal(size=(1, 3))), nd.array(rng.normal(size=(k, 4))))
            for k in ks]


def run(net, data, flag, policy="depth", produced=False, train=True):
    params = prepare(net, flag, policy)
    with autograd.record(train_mode=train):
        kids = [k.reshape((1,) + k.shape) if produced else k for _, k in data]
        outs = [net(x, kid, produced) for (x, _), kid in zip(data, kids)]
        total = nd.add_n(*[nd.sum(o * o) for o in outs])
    total.backward()
    res = [o.asnumpy() for o in outs], {k: p.grad().asnumpy().copy() for k, p in params.items()}
    net.hybridize(active=False)
    return res


def make_net():
    net = Net()
    net.initialize()
    net(*samples(np.random.default_rng(9), [2])[0])   # finish deferred shapes
    return net


KS = [1, 3, 2, 3, 1, 4, 2, 2, 1, 3]


@pytest.mark.parametrize("policy", ["auto", "depth", "agenda", "sequential"])
@pytest.mark.parametrize("produced", [False, True], ids=["stacked", "block-output"])
def test_padded_launches_equal_plain_gluon(policy, produced):
    net = make_net()
    data = samples(np.random.default_rng(1), KS)
    ref = run(net, data, False, produced=produced)
    jitbatch.zero_pad(net.cell, ch=1)
    jitbatch.reset_stats()
    got = run(net, data, True, policy, produced=produced)
    assert_same(ref, got)
    last = jitbatch.stats()["last_flush"]
    pad = last["padding"][net.cell.name]
    if policy == "sequential":
        assert last["launches"] == last["nodes"] and pad["launches"] == len(KS)
    elif policy != "auto":   # 'auto' may run its first flush sequentially
        # no prices measured yet, nothing split: every cell call in ONE launch,
        # each sample padded to 4 children
        assert pad == {"batches": 1, "launches": 1, "rows": len(KS), "units": 4 * len(KS),
                       "fixed_s": None, "per_unit_s": None}


def test_without_the_declaration_each_size_is_a_launch():
    net = make_net()
    data = samples(np.random.default_rng(2), KS)
    ref = run(net, data, False)
    jitbatch.zero_pad(net.cell, ch=1)
    assert_same(ref, run(net, data, True, "depth"))
    padded = jitbatch.stats()["last_flush"]["launches"]
    jitbatch.zero_pad(net.cell)               # removed again
    assert_same(ref, run(net, data, True, "depth"))
    last = jitbatch.stats()["last_flush"]
    assert last["padding"] is None
    assert last["launches"] == padded + len(set(KS)) - 1


@pytest.mark.parametrize("prices,launches", [
    ((1.0, 1e-9), 1),          # launches dear, padding cheap: one launch
    ((1e-9, 1.0), 4),          # padding dear: one launch per size (1, 2, 3, 4)
    ((1.0, 0.11), 2),          # sizes {1, 2} and {3, 4} cost 5.08, all in one 5.4
])
def test_cost_model_splits_by_size(monkeypatch, prices, launches):
    net = make_net()
    data = samples(np.random.default_rng(3), KS)
    ref = run(net, data, False)
    jitbatch.zero_pad(net.cell, ch=1)
    monkeypatch.setattr(cost.Model, "pad_costs", lambda self, info: prices)
    jitbatch.reset_stats()
    got = run(net, data, True, "depth")
    assert_same(ref, got)
    pad = jitbatch.stats()["last_flush"]["padding"][net.cell.name]
    assert pad["launches"] == launches


class _N(object):
    __slots__ = ("info", "k", "pad")

    def __init__(self, info, k):
        self.info = info
        self.k = self.pad = k


@pytest.mark.parametrize("seed", range(6))
def test_split_is_optimal(seed):
    rng = np.random.default_rng(seed)
    info = SigInfo(0, "c", None, (), True, "c")
    info.pad_axes = ((0, 1),)
    batch = [_N(info, int(k)) for k in rng.integers(1, 7, size=int(rng.integers(2, 30)))]
    fixed, per = float(rng.uniform(0.1, 3)), float(rng.uniform(0.01, 0.5))
    parts, kmax = schedule.split_padded(batch, fixed, per)
    assert kmax == [max(n.k for n in p) for p in parts]
    assert sorted(map(id, itertools.chain(*parts))) == sorted(map(id, batch))

    def price(ps):
        return sum(fixed + per * len(p) * max(n.k for n in p) for p in ps)
    ks = sorted(set(n.k for n in batch))
    best = None
    for mask in range(1 << (len(ks) - 1)):      # every way to cut the sorted sizes
        runs, cur = [], [ks[0]]
        for i, k in enumerate(ks[1:]):
            if mask >> i & 1:
                runs.append(cur)
                cur = []
            cur.append(k)
        runs.append(cur)
        ps = [[n for n in batch if n.k in r] for r in runs]
        best = price(ps) if best is None else min(best, price(ps))
    assert abs(price(parts) - best) < 1e-9
    assert schedule.split_padded(batch, fixed, 0.0)[0] == [batch]
    assert schedule.split_padded(batch, None, None) == ([batch], [max(n.k for n in batch)])


def test_padding_price_is_a_fitted_plane():
    info = SigInfo(0, "c", None, (), True, "c")
    m = cost.Model()
    assert m.pad_costs(info) is None
    for rows, k in [(10, 1), (10, 3), (40, 2), (5, 5), (25, 1), (30, 4)]:
        m.observe_padded(info, rows, rows * k, 2e-3 + 1e-5 * rows + 3e-6 * rows * k)
    a, c = m.pad_costs(info)
    assert abs(a - 2e-3) < 1e-9 and abs(c - 3e-6) < 1e-12
    flat = SigInfo(1, "d", None, (), True, "d")   # every launch padded alike: no price
    for rows in (1, 5, 9, 20, 31):
        m.observe_padded(flat, rows, 2 * rows, 1e-3 + 1e-5 * rows)
    assert m.pad_costs(flat) is None


def test_measurements_survive_hybridizing_again():
    net = make_net()
    jitbatch.zero_pad(net.cell, ch=1)
    data = samples(np.random.default_rng(4), KS)
    run(net, data, True, "auto")
    from jitbatch.gluon.signatures import TABLE
    info = next(i for i in TABLE._table.values()
                if getattr(getattr(i, "op", None), "block", None) is net.cell)
    info.launches, info.launch_cost, info.pad_fit = 3, 0.5, [1.0] * 9
    run(net, data, True, "auto")               # hybridize again: a new signature
    new = [i for i in TABLE._table.values()
           if getattr(getattr(i, "op", None), "block", None) is net.cell]
    assert new[-1] is not info and new[-1].launches >= 3 and new[-1].pad_fit[0] >= 1.0


def test_bad_declarations_are_explained():
    net = make_net()
    with pytest.raises(jitbatch.FlagError, match=r"no input named 'kids'.*x, ch"):
        jitbatch.zero_pad(net.cell, kids=1)
    with pytest.raises(jitbatch.FlagError, match="axis 0 is the batch axis"):
        jitbatch.zero_pad(net.cell, ch=0)
    with pytest.raises(jitbatch.FlagError, match="expected an axis >= 1"):
        jitbatch.zero_pad(net.cell, ch=True)
    with pytest.raises(jitbatch.FlagError, match="HybridBlock instance"):
        jitbatch.zero_pad(net, ch=1)


class Keeps(HybridBlock):
    def hybrid_forward(self, F, x, ch):  # pylint: disable=arguments-differ
        return x + F.sum(ch, axis=1), ch * 2     # second output keeps the padded axis


@pytest.mark.parametrize("block,axis,ch,error", [
    # an output that keeps the padded axis would change shape with the padding
    (Keeps, 1, (1, 2, 3), r"output 1 has shape \(1, 2, 3\).*must not change the outputs' shapes"),
    # the declared axis is not there
    (SumCell, 3, (1, 2, 4), r"along axis 3, but it has shape \(1, 2, 4\) \(3 axes\)"),
], ids=["output-keeps-axis", "missing-axis"])
def test_bad_padded_calls_are_explained(block, axis, ch, error):
    b = block()
    b.initialize()
    jitbatch.zero_pad(b, ch=axis)
    b.hybridize(dynamic_batch=True)
    with pytest.raises(jitbatch.BatchingError, match=error):
        b(nd.ones((1, 3)), nd.ones(ch))
    jitbatch.flush()


def test_an_unpriced_padded_signature_calibrates_until_priced(monkeypatch):
    # past the scheduled calibrating flushes (2nd, 3rd, 64th): only the padded
    # signature's lack of a price makes a flush calibrate. A calibrating flush
    # times every launch of the signature: one when its calls merge, several
    # when 'auto' runs a small flush sequentially (it may, on a loaded machine)
    from jitbatch.execute import _PAD_TIMED
    monkeypatch.setattr(cost.MODEL, "flushes", 10)
    net = make_net()
    jitbatch.zero_pad(net.cell, ch=1)
    net.hybridize(dynamic_batch=True)
    rng = np.random.default_rng(5)

    def timed():
        infos = [i for i in jitbatch.gluon.signatures.TABLE._table.values()
                 if getattr(getattr(i, "op", None), "block", None) is net.cell]
        return infos[0].pad_fit[0] if infos and infos[0].pad_fit else 0

    seen = []
    for _ in range(14):
        before = timed()
        ks = [int(k) for k in rng.integers(1, 6, size=int(rng.integers(2, 12)))]
        outs = [net(x, kids) for x, kids in samples(rng, ks)]
        jitbatch.flush()
        calibrated = jitbatch.stats()["last_flush"]["calibrated"]
        seen.append(calibrated)
        assert outs[0].shape == (1, 4)
        if calibrated:      # only while unpriced and timed fewer than _PAD_TIMED times
            assert before < _PAD_TIMED and timed() > before
        else:
            assert timed() == before
    assert seen[0] is False                # its first flush pays first-call costs
    assert seen[1] is True                 # then it is timed ...
    assert timed() >= 4                    # ... until priced (4 launches at least) or
    assert not any(seen[1 + _PAD_TIMED:])  # _PAD_TIMED launches timed, a flush at least each


def test_a_concrete_array_read_by_many_samples_is_one_gather_source(monkeypatch):
    # the child-sum model's leaves pass one shared (1, 1, H) zero state; in a
    # padded launch beside nodes with children it is read as rows of (H,)
    from jitbatch.gluon.backend import GluonBackend
    plans = []
    orig = GluonBackend.prepare

    def prepare(self, batches):
        orig(self, batches)
        plans.extend(b[0].plan[0] for b in batches if b[0].plan)
    monkeypatch.setattr(GluonBackend, "prepare", prepare)
    cell = SumCell()
    cell.initialize()
    jitbatch.zero_pad(cell, ch=1)
    cell.hybridize(dynamic_batch=True, policy="depth")
    zero = nd.zeros((1, 1, 4))
    rng = np.random.default_rng(6)
    xs = [nd.array(rng.normal(size=(1, 3))) for _ in range(6)]
    kids = [nd.array(rng.normal(size=(1, 3, 4))) for _ in range(2)]
    chs = [zero, zero, kids[0], zero, kids[1], zero]
    outs = [cell(x, ch) for x, ch in zip(xs, chs)]
    jitbatch.flush()
    cell.hybridize(active=False)
    for x, ch, o in zip(xs, chs, outs):
        np.testing.assert_allclose(o.asnumpy(), cell(x, ch).asnumpy(), rtol=1e-5, atol=1e-6)
    (_, ch_plan), = [p for p in plans]
    assert ch_plan.kind in ("concat_take", "take_concat")
    assert len(ch_plan.srcs) == 4      # the zero state once, both kids, the padding
