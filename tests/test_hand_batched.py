"""The baselines of the benchmark compute what the per-sample plain model computes
(outputs and parameter gradients): the hand-written level-by-level batched Tree-LSTM
(examples/tree_lstm/hand_batched.py) and the Fold-style one (fold_batched.py)."""
import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

import jitbatch
from examples.tree_lstm import data as D
from examples.tree_lstm.fold_batched import Fold, FoldBatched
from examples.tree_lstm.hand_batched import HandBatched, plan
from examples.tree_lstm.model import SimilarityTreeLSTM

VOCAB, EMBED, HIDDEN, SIM = 30, 8, 6, 5
RTOL, ATOL = 1e-4, 1e-5


def random_parents(rng, n):
    """1-based parent list of a random tree on n tokens (0 = root); bushy and deep mixed."""
    order = rng.permutation(n)
    parents = [0] * n
    for pos in range(1, n):
        # attach to one of the recent nodes (deep) or any earlier node (bushy)
        lo = max(0, pos - 2) if rng.random() < 0.5 else 0
        parents[order[pos]] = int(order[rng.integers(lo, pos)]) + 1
    return parents


def random_pairs(rng, n_pairs):
    pairs = []
    for i in range(n_pairs):
        sides = []
        for _ in range(2):
            n = 1 if i == 0 else int(rng.integers(2, 11))   # pair 0: one-token sentences
            toks = nd.array(rng.integers(0, VOCAB, size=n))
            sides += [toks, D.build_tree(random_parents(rng, n))]
        pairs.append(tuple(sides))
    # the same sentence objects on both sides of a pair, and a repeated pair
    pairs.append((pairs[2][0], pairs[2][1], pairs[2][0], pairs[2][1]))
    pairs.append(pairs[3])
    return pairs


def make_net(seed=0):
    mx.random.seed(seed)
    net = SimilarityTreeLSTM(VOCAB, embed_size=EMBED, hidden_size=HIDDEN, sim_hidden=SIM)
    net.initialize(mx.init.Uniform(0.5))
    return net


def targets(rng, n):
    return nd.array(np.stack([D.target_distribution(s) for s in rng.uniform(1, 5, size=n)]))


def loss_and_grads(net, forward, tgt):
    """Summed KL loss of the minibatch, one backward; (loss, {param: grad})."""
    loss_fn = gluon.loss.KLDivLoss(from_logits=True)
    with autograd.record():
        total = nd.sum(loss_fn(forward(), tgt))
    total.backward()
    grads = {name: p.grad().asnumpy().copy() for name, p in net.collect_params().items()}
    return total.asscalar(), grads


def per_sample(net, pairs):
    return nd.concat(*[net(*p) for p in pairs], dim=0)


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(7)
    pairs = random_pairs(rng, 6)
    return pairs, targets(rng, len(pairs))


def test_plan_levels_cover_every_node_once(case):
    pairs, _ = case
    trees = [p[1] for p in pairs] + [p[3] for p in pairs]
    p = plan(trees, [p[0].shape[0] for p in pairs] + [p[2].shape[0] for p in pairs])
    assert p.nodes == sum(t.size() for t in trees)
    assert sum(n for _, n, _, _ in p.levels) == p.nodes
    assert p.levels[0][2] == 0 and all(k >= 1 for _, _, k, _ in p.levels[1:])
    assert len(p.levels) == 1 + max(t.height for t in trees)
    assert sorted(p.index[:p.nodes]) == list(range(p.nodes))  # every token embedded once


@pytest.mark.parametrize("hybridize", [True, False])
def test_outputs_and_gradients_equal_per_sample(case, hybridize):
    pairs, tgt = case
    net = make_net()
    net.hybridize(active=False)
    ref_out = per_sample(net, pairs).asnumpy()
    ref_loss, ref_grads = loss_and_grads(net, lambda: per_sample(net, pairs), tgt)

    hand = HandBatched(net, hybridize=hybridize)
    out = hand(pairs)
    assert out.shape == (len(pairs), 5)
    np.testing.assert_allclose(out.asnumpy(), ref_out, rtol=RTOL, atol=ATOL)
    loss, grads = loss_and_grads(net, lambda: hand(pairs), tgt)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        assert np.abs(g).max() > 0, name               # every parameter is reached
        np.testing.assert_allclose(grads[name], g, rtol=RTOL, atol=ATOL, err_msg=name)


def test_row_order_and_single_pair(case):
    pairs, _ = case
    net = make_net(1)
    hand = HandBatched(net)
    full = hand(pairs).asnumpy()
    for i in (0, 4):
        np.testing.assert_allclose(hand([pairs[i]]).asnumpy(), full[i:i + 1], rtol=RTOL, atol=ATOL)
    rev = hand(pairs[::-1]).asnumpy()
    np.testing.assert_allclose(rev[::-1], full, rtol=RTOL, atol=ATOL)


def test_clears_dynamic_batch_flag(case):
    pairs, _ = case
    net = make_net(2)
    net.hybridize(active=False)
    ref = per_sample(net, pairs).asnumpy()
    net.hybridize(dynamic_batch=True)
    hand = HandBatched(net)          # hybridizes its blocks the ordinary way
    jitbatch.reset_stats()
    out = hand(pairs)
    assert not jitbatch.is_lazy(out) and jitbatch.stats()["nodes"] == 0
    np.testing.assert_allclose(out.asnumpy(), ref, rtol=RTOL, atol=ATOL)


def test_empty_minibatch_is_an_error():
    with pytest.raises(ValueError):
        HandBatched(make_net())([])


@pytest.mark.parametrize("hybridize", [True, False])
def test_fold_outputs_and_gradients_equal_per_sample(case, hybridize):
    pairs, tgt = case
    net = make_net(3)
    net.hybridize(active=False)
    ref_out = per_sample(net, pairs).asnumpy()
    ref_loss, ref_grads = loss_and_grads(net, lambda: per_sample(net, pairs), tgt)
    net.hybridize(active=hybridize)
    fold = FoldBatched(net)
    np.testing.assert_allclose(fold(pairs).asnumpy(), ref_out, rtol=RTOL, atol=ATOL)
    loss, grads = loss_and_grads(net, lambda: fold(pairs), tgt)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
    for name, g in ref_grads.items():
        np.testing.assert_allclose(grads[name], g, rtol=RTOL, atol=ATOL, err_msg=name)


def test_fold_runs_one_call_per_depth_and_signature():
    # three chains and a pair: per depth, one call per distinct signature
    # (the function and its arguments' shapes / producers)
    calls = []

    def f(x):
        calls.append(x.shape)
        return x * 2

    def g(a, b):
        calls.append(("g", a.shape))
        return a + b
    fold = Fold(mx.cpu())
    ones = nd.ones((1, 3))
    chains = []
    for length in (3, 1, 2):
        r = fold.add(f, ones)
        for _ in range(length - 1):
            r = fold.add(f, r)
        chains.append(r)
    pair = fold.add(g, chains[0], chains[2])
    outs = fold.run(chains + [pair])
    assert calls == [(3, 3), (2, 3), (1, 3), ("g", (1, 3))]
    np.testing.assert_allclose(outs[0].asnumpy(), 8 * np.ones((1, 3)))
    np.testing.assert_allclose(outs[1].asnumpy(), 2 * np.ones((1, 3)))
    np.testing.assert_allclose(outs[3].asnumpy(), 12 * np.ones((1, 3)))


def test_fold_empty_minibatch_is_an_error():
    with pytest.raises(ValueError):
        FoldBatched(make_net())([])


def test_leaf_block_is_the_cell_without_children():
    # the per-sample model runs leaves through the leaf block (the cell's own
    # parameters, no child terms): the same outputs and parameter gradients as
    # the cell with one zero child, which is what leaves computed before
    net = make_net(3)
    enc = net.encoder
    x = nd.array(np.random.default_rng(0).normal(size=(4, EMBED)))
    zero = nd.zeros((4, 1, HIDDEN))
    params = [enc.cell.W_iou, enc.cell.b_iou]
    assert enc.leaf.W_iou is enc.cell.W_iou and enc.leaf.b_iou is enc.cell.b_iou
    got = []
    for run in (lambda: enc.leaf(x), lambda: enc.cell(x, zero, zero)):
        with autograd.record():
            h, c = run()
            total = nd.sum(h * h) + nd.sum(c)
        total.backward()
        got.append((h.asnumpy(), c.asnumpy(), [p.grad().asnumpy().copy() for p in params]))
    (h1, c1, g1), (h2, c2, g2) = got
    np.testing.assert_allclose(h1, h2, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(c1, c2, rtol=1e-6, atol=1e-7)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # one set of parameters: the leaf adds none of its own
    names = list(net.collect_params().keys())
    assert len(names) == len(set(names)) and not any("leaf" in n for n in names)
