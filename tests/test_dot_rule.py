"""``nd.dot`` of two per-sample matrices merges: N calls are one ``batch_dot``.

Users score keys against a query with ``nd.dot(keys, q, transpose_b=True)``
between blocks, or form a bilinear product. Until 2026-11-27 ``dot`` had no
batching rule: every call was a launch of its own (issue 23 asked for one).
Its rule (``rules._dot``) views the samples' matrices as ``(N, m, k)`` and
``(N, k, n)`` and runs one ``batch_dot``, which takes the same transpose
attributes. Vectors and higher ranks keep one launch per call."""
import numpy as np
import pytest
from mxnet import gluon, nd

import jitbatch

from harness import assert_same, run
from heldout import initialized, launches_of

POLICIES = ["depth", "agenda", "sequential", "auto"]
TRANSPOSES = [(False, False), (False, True), (True, False), (True, True)]


class Scores(gluon.Block):
    """Per sample: keys ``(S, 4)`` and a query ``(1, 4)`` from Dense blocks,
    their products in every transpose form, summed into ``(1, 4)``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.keys = gluon.nn.Dense(4, in_units=3, flatten=False)
            self.query = gluon.nn.Dense(4, in_units=3)
            self.out = gluon.nn.Dense(2, in_units=4)

    def forward(self, x, q):  # pylint: disable=arguments-differ
        k = self.keys(x)                                         # (S, 4)
        u = self.query(q)                                        # (1, 4)
        s = nd.dot(k, u, transpose_b=True)                       # (S, 1)
        w = nd.softmax(s, axis=0)
        ctx = nd.dot(w, k, transpose_a=True)                     # (1, 4)
        g = nd.dot(u, u, transpose_a=True)                       # (4, 4)
        h = nd.dot(ctx, g) + nd.dot(g, ctx, transpose_a=True, transpose_b=True).T
        return self.out(h + nd.dot(nd.dot(k, g).T, w, transpose_b=False).T)


def _samples(seed, sizes=(3, 5, 3, 4, 5, 3, 2, 4)):
    rng = np.random.default_rng(seed)
    return [(nd.array(rng.normal(size=(s, 3))), nd.array(rng.normal(size=(1, 3))))
            for s in sizes]


def _apply(net, sample):
    out = net(*sample)
    return out, nd.sum(out * out)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_products_of_per_sample_matrices_equal_plain_gluon(policy, train):
    samples = _samples(0)
    ref = run(initialized(Scores(prefix="scores_")), _apply, samples, train, flag=False)
    got = run(initialized(Scores(prefix="scores_")), _apply, samples, train, flag=True,
              policy=policy)
    assert_same(ref, got)


@pytest.mark.parametrize("transpose", TRANSPOSES)
def test_one_launch_per_shape_and_transposes(transpose):
    """Counters: twelve products of per-sample (lazy) matrices of one shape
    and one transpose form run in one launch (twelve before)."""
    ta, tb = transpose
    rng = np.random.default_rng(1)
    ident = gluon.nn.HybridLambda(lambda F, x: F.identity(x))
    ident.hybridize(dynamic_batch=True, policy="depth")
    a_shape = (4, 3) if ta else (3, 4)
    b_shape = (5, 4) if tb else (4, 5)
    pairs = [(rng.normal(size=a_shape).astype(np.float32),
              rng.normal(size=b_shape).astype(np.float32)) for _ in range(12)]
    want = [nd.dot(nd.array(a), nd.array(b), transpose_a=ta, transpose_b=tb).asnumpy()
            for a, b in pairs]
    got = []

    def run():
        lazy = [nd.dot(ident(nd.array(a)), ident(nd.array(b)), transpose_a=ta, transpose_b=tb)
                for a, b in pairs]
        got.extend(g.asnumpy() for g in lazy)
    seen = launches_of(run)
    assert [n for n in seen if n[0] == "dot"] == [("dot", 12)], seen
    for a, b in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_vectors_keep_one_launch_per_call():
    """A dot of vectors (rank 1) has no rule: one launch per call, right values."""
    ident = gluon.nn.HybridLambda(lambda F, x: F.identity(x))
    ident.hybridize(dynamic_batch=True, policy="depth")
    vs = [np.arange(4, dtype=np.float32) + i for i in range(5)]
    jitbatch.reset_stats()
    got = [nd.dot(ident(nd.array(v)), ident(nd.array(v))).asnumpy() for v in vs]
    for v, g in zip(vs, got):
        np.testing.assert_allclose(g, np.dot(v, v), rtol=1e-6)
