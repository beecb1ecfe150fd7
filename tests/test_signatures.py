"""Signatures on MXNet (jitbatch/gluon/signatures.py): one key layout for every
block kind, and launch measurements that survive hybridizing again."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import nd
from mxnet.gluon import HybridBlock, nn

import jitbatch
from jitbatch import cost
from jitbatch.gluon import signatures


class TwoLeads(HybridBlock):
    """Inputs of different leading lengths: neither ragged nor padded, a plain
    block signature (each output row still depends on its own sample only)."""

    def hybrid_forward(self, F, x, y):  # pylint: disable=arguments-differ
        return x * 2, y * 3


class Padded(HybridBlock):
    def hybrid_forward(self, F, x, kids):  # pylint: disable=arguments-differ
        return x + F.sum(kids, axis=1)


def _plain_calls(net):
    return [net(nd.ones((1, 3)) * i, nd.ones((2, 3)) * i) for i in range(4)]


def _ragged_calls(net):
    return [net(nd.ones((1 + i % 3, 3)) * i) for i in range(4)]


def _padded_calls(net):
    return [net(nd.ones((1, 3)), nd.ones((1, 1 + i % 3, 3))) for i in range(4)]


CASES = {
    "plain": (TwoLeads, _plain_calls, signatures.PLAIN),
    "ragged": (lambda: nn.Dense(3, in_units=3), _ragged_calls, signatures.RAGGED),
    "padded": (Padded, _padded_calls, signatures.PADDED),
}


def _infos(block):
    return [i for i in signatures.TABLE._table.values()
            if getattr(getattr(i, "op", None), "block", None) is block]


@pytest.mark.parametrize("kind", sorted(CASES))
def test_launch_measurements_carry_over_when_hybridized_again(monkeypatch, kind):
    # the 2nd and 3rd 'auto' flush time every launch (calibrating); a block
    # hybridized again gets a new signature, which keeps those measurements
    monkeypatch.setattr(cost, "MODEL", cost.Model())
    make, calls, want = CASES[kind]
    net = make()
    net.initialize()
    if kind == "padded":
        jitbatch.zero_pad(net, kids=1)
    net.hybridize(dynamic_batch=True)
    for _ in range(3):
        calls(net)
        jitbatch.flush()
    first = _infos(net)
    assert [i.key[0] for i in first] == [want]
    timed = first[0]
    assert timed.launches >= 2 and timed.launch_cost > 0
    net.hybridize(dynamic_batch=True)          # a new token: new signatures
    calls(net)
    jitbatch.flush()
    renewed = [i for i in _infos(net) if i is not timed]
    assert len(renewed) == 1 and renewed[0].key[2] is not timed.key[2]
    assert renewed[0].launches >= timed.launches
    assert renewed[0].launch_cost >= timed.launch_cost


def test_every_block_signature_key_has_one_layout():
    # (kind, block id, renewal token, ...): what new_info's carry-over relies on
    nets = []
    for kind in sorted(CASES):
        make, calls, _ = CASES[kind]
        net = make()
        net.initialize()
        if kind == "padded":
            jitbatch.zero_pad(net, kids=1)
        net.hybridize(dynamic_batch=True, granularity="block")
        calls(net)
        nets.append(net)
    jitbatch.flush()
    for net in nets:
        for info in _infos(net):
            kind, owner, token = info.key[:3]
            assert kind in signatures.BLOCK_KINDS
            assert owner == id(net) and token is net._jb_token
            assert signatures.stable(info.key) == (kind, token.block) + info.key[3:]


def test_an_exact_call_seen_before_skips_the_signature_search(monkeypatch):
    net = TwoLeads()
    net.hybridize(dynamic_batch=True)
    searched = []
    orig = signatures.block_signature

    def spy(*args):
        searched.append(1)
        return orig(*args)
    import jitbatch.gluon.record as record
    monkeypatch.setattr(record, "block_signature", spy)
    outs = _plain_calls(net)
    jitbatch.flush()
    assert len(searched) == 1
    np.testing.assert_allclose(outs[3][1].asnumpy(), np.full((2, 3), 9.0))


class OpChain(HybridBlock):
    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return x * 1.5


def _op_spy(monkeypatch):
    """The operator signature searches from here on (the exact calls earlier
    tests of the process made are forgotten first: only a lookup is lost)."""
    signatures.OP_EXACT.clear()
    searched = []
    orig = signatures._op_signature  # pylint: disable=protected-access

    def spy(handle, *args):
        searched.append(handle)
        return orig(handle, *args)
    monkeypatch.setattr(signatures, "_op_signature", spy)
    return searched


def test_an_exact_operator_call_seen_before_skips_the_signature_search(monkeypatch):
    # OP_EXACT: the second and later calls of an operator with the same
    # attributes on arguments of the same shapes are one lookup, and still merge
    net = OpChain()
    net.hybridize(dynamic_batch=True)
    searched = _op_spy(monkeypatch)
    xs = [nd.array(np.arange(6).reshape(2, 3) + 10 * i) for i in range(4)]
    jitbatch.reset_stats()
    outs = [(nd.tanh(y), nd.sum(y, axis=1)) for y in (net(x) for x in xs)]
    jitbatch.flush()
    assert len(searched) == 2, searched          # tanh once, sum once
    assert jitbatch.stats()["launches"] == 3     # the block, tanh, sum: one launch each
    for x, (t, s) in zip(xs, outs):
        y = x.asnumpy() * 1.5
        np.testing.assert_allclose(t.asnumpy(), np.tanh(y), rtol=1e-6)
        np.testing.assert_allclose(s.asnumpy(), y.sum(axis=1), rtol=1e-6)


def test_exact_operator_calls_differ_by_attribute_shape_and_mode(monkeypatch):
    # an attribute (axis), an argument's shape and autograd's mode each make a
    # call of its own: the lookup never hands one call's signature to another
    net = OpChain()
    net.hybridize(dynamic_batch=True)
    searched = _op_spy(monkeypatch)
    a = net(nd.ones((2, 3)))
    b = net(nd.ones((2, 4)))
    got = [nd.sum(a, axis=0), nd.sum(a, axis=1), nd.sum(b, axis=1), nd.sum(a, axis=0)]
    x = nd.ones((2, 3))
    x.attach_grad()
    with mx.autograd.record():
        c = net(x)
        recorded = nd.sum(c, axis=0)
    recorded.backward()
    jitbatch.flush()
    names = [jitbatch.gluon._mxapi.op_name(h) for h in searched]
    assert names.count("sum") == 4, names      # (attach_grad may record a zeros_like)
    want = [np.full(3, 3.0), np.full(2, 4.5), np.full(2, 6.0), np.full(3, 3.0)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.asnumpy(), w)
    np.testing.assert_allclose(recorded.asnumpy(), np.full(3, 3.0))
    np.testing.assert_allclose(x.grad.asnumpy(), np.full((2, 3), 1.5))


def test_an_unhashable_operator_attribute_is_keyed_by_its_text(monkeypatch):
    # MXNet passes a list attribute (reshape's shape) as given: keyed by its
    # text, [3, 2] and [2, 3] stay two calls and a repeat is one lookup
    net = OpChain()
    net.hybridize(dynamic_batch=True)
    searched = _op_spy(monkeypatch)
    ys = [net(nd.array(np.arange(6).reshape(1, 6) + i)) for i in range(3)]
    outs = [nd.reshape(y, shape=[3, 2]) for y in ys] + [nd.reshape(y, shape=[2, 3]) for y in ys]
    jitbatch.flush()
    assert len(searched) == 2, searched
    for i, y in enumerate(ys):
        v = (np.arange(6) + i) * 1.5
        np.testing.assert_allclose(outs[i].asnumpy(), v.reshape(3, 2))
        np.testing.assert_allclose(outs[3 + i].asnumpy(), v.reshape(2, 3))


def _evict_all(monkeypatch):
    """A long run's new signatures push every earlier one out of the table
    (EXACT and OP_EXACT, bounded by the same limit, hold far fewer entries)."""
    monkeypatch.setattr(signatures.TABLE, "limit", len(signatures.TABLE))
    for _ in range(len(signatures.TABLE)):
        signatures.TABLE.add(("filler", object()), lambda sid: None)
    monkeypatch.setattr(signatures.TABLE, "limit", 4096)


@pytest.mark.parametrize("blocks_after", [True, False], ids=["blocks", "operators only"])
def test_calls_of_any_length_merge_after_the_table_evicted_their_signature(
        monkeypatch, blocks_after):
    # EXACT / OP_EXACT handed out ragged signatures TABLE had evicted: a call
    # of a new length got a new ragged signature, and the lengths' calls ran
    # as two launches (a suite order that ran a small-table test first).
    # After the eviction: block calls and operators, or operators only
    net = nn.Dense(3, in_units=4)
    net.initialize()
    net.hybridize(dynamic_batch=True, policy="agenda")
    t3 = nd.tanh(net(nd.ones((3, 4))))
    jitbatch.flush()
    # (lengths the other variant did not use: each exact call is new but 3's)
    lengths = (3, 5, 3, 7) if blocks_after else (3, 6, 3, 8)
    xs = [nd.ones((k, 4)) * k for k in lengths]    # nothing pending: concrete
    if blocks_after:
        _evict_all(monkeypatch)
    jitbatch.reset_stats()
    ys = [net(x) for x in xs]
    if not blocks_after:
        _evict_all(monkeypatch)
    outs = [nd.tanh(y) for y in ys]
    jitbatch.flush()
    assert jitbatch.stats()["launches"] == 2, jitbatch.stats()    # the block, tanh
    w = net.weight.data().asnumpy()
    b = net.bias.data().asnumpy()
    for k, o in zip(lengths, outs):
        np.testing.assert_allclose(o.asnumpy(), np.tanh(np.full((k, 4), float(k)) @ w.T + b),
                                   rtol=1e-5)
    np.testing.assert_allclose(t3.asnumpy(), np.tanh(np.ones((3, 4)) @ w.T + b), rtol=1e-5)


class _Centred(HybridBlock):
    """Centred over the sample's rows (a mean over axis 0): unmergeable."""

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return F.broadcast_sub(x, F.mean(x, axis=0, keepdims=True))


@pytest.mark.parametrize("forgotten", [False, True], ids=["exact call kept", "exact call gone"])
def test_strict_set_later_raises_whether_or_not_the_exact_call_is_kept(monkeypatch, forgotten):
    # a call whose exact entry was dropped (or whose signature the table
    # evicted) finds its signature again in TABLE: config.strict, set after
    # the signature was made, raises there too (it raised only on an exact hit)
    import warnings
    from jitbatch import config
    net = _Centred()
    net.hybridize(dynamic_batch=True, policy="depth")
    xs = [nd.array(np.arange(6).reshape(2, 3) * (i + 1)) for i in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jitbatch.ContractWarning)
        [y.asnumpy() for y in [net(x) for x in xs]]
    if forgotten:
        signatures.EXACT.clear()
    monkeypatch.setattr(config, "strict", True)
    with pytest.raises(jitbatch.BatchingError, match=r"(?s)_centred\d+.*mean.*Fix"):
        net(xs[0])
    monkeypatch.setattr(config, "strict", False)
    y = net(xs[1])                      # and the next call runs, per sample
    np.testing.assert_allclose(y.asnumpy(), xs[1].asnumpy() - xs[1].asnumpy().mean(0))


@pytest.mark.parametrize("clear", [True, False])
def test_a_block_never_meets_the_signatures_of_a_freed_block_with_its_id(clear):
    # CPython gives a freed block's id() to a new one; hybridize(clear=False)
    # left a never-cleared block without a token, so its calls' keys named it by
    # id() alone and met the dead block's signatures (a TypeError in
    # _regroup); a block number never reused keeps the dead one's measurements
    # from the new one too
    import gc
    seen = {}
    rng = np.random.default_rng(3)
    # the objects of the tests before are not this test's: each full collection
    # below scans only what it made, not the suite's heap
    gc.freeze()
    try:
        _made_and_freed(clear, seen, rng)
    finally:
        gc.unfreeze()


def _made_and_freed(clear, seen, rng):
    import gc
    reused = 0
    for _ in range(200):
        net = nn.Dense(3, in_units=3)
        net.initialize(mx.init.Normal(1.0))
        net.hybridize(dynamic_batch=True, clear=clear)
        xs = [nd.array(rng.normal(size=(1, 3))) for _ in range(3)]
        out = nd.concat(*[net(x) for x in xs], dim=0).asnumpy()
        net.hybridize(active=False)
        ref = nd.concat(*[net(x) for x in xs], dim=0).asnumpy()
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
        infos = [i for i in _infos(net) if i.key[0] in signatures.BLOCK_KINDS]
        assert infos
        for info in infos:
            assert signatures.stable(info.key)[1] not in seen.values()
        reused += id(net) in seen
        seen[id(net)] = signatures.stable(infos[0].key)[1]
        del net, infos
        gc.collect()
    assert reused, "no id() was reused: the test did not test"
