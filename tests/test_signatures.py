"""Signatures on MXNet (jitbatch/gluon/signatures.py): one key layout for every
block kind, and launch measurements that survive hybridizing again."""
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
            assert signatures.stable(info.key) == (kind, owner) + info.key[3:]


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
