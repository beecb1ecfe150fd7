"""Inputs that give only their shape: ``broadcast_like(x, y)``, ``reshape_like``,
``slice_like``, ``zeros_like(y) + x``, between blocks and inside a block.

MXNet 1.9.1 gives such an input a ``zeros_like`` gradient, and its backward
crashed the process (segmentation fault) when that input was rows gathered or
sliced from another launch; per sample plain Gluon runs. Found by the held-out
file ``tests/test_heldout53.py`` (2026-11-27) for operators between blocks; a
block whose output depends on an input through its shape only crashed the
same way. A recorded launch now detaches the inputs its operator passes no
gradient to (``executors.OpExec._detached``) and, for a block, the inputs no
output of its traced graph depends on differentiably
(``gradients.reached_variables``): their gradient is zero either way. Each program
runs in a subprocess (a crash would end the suite) and is compared with plain
Gluon, outputs and every parameter's gradient, over two minibatches with
``grad_req='add'`` (so a stale or missing gradient shows)."""
import pytest

from heldout import run_in_subprocess

_PROGRAM = """
import numpy as np, mxnet as mx
from mxnet import autograd, gluon, nd
import jitbatch

def go(body, forward, policy):
    class Like(gluon.HybridBlock):
        def hybrid_forward(self, F, x, y):
            return eval(body)

    class Net(gluon.Block):
        def __init__(self, **kw):
            super().__init__(prefix="ss_", **kw)
            with self.name_scope():
                self.a = gluon.nn.Dense(4, in_units=3, flatten=False)
                self.b = gluon.nn.Dense(4, in_units=4, flatten=False)
                self.like = Like()
        def forward(self, x):
            h = self.a(x)                              # (T, 4)
            k = self.b(h)                              # (T, 4): a shape source
            q = nd.mean(h, axis=0, keepdims=True)      # (1, 4)
            return eval(forward)

    mx.random.seed(0)
    net = Net(); net.initialize(mx.init.Uniform(0.5))
    for p in net.collect_params().values():
        p.grad_req = "add"
    if policy:
        net.hybridize(dynamic_batch=True, policy=policy)
    rng = np.random.default_rng(0)
    outs = []
    for step in range(2):
        xs = [nd.array(rng.normal(size=(t, 3))) for t in (2, 3, 2, 1, 3)]
        with autograd.record():
            ys = [net(x) for x in xs]
            loss = nd.add_n(*[nd.sum(y * y) for y in ys])
        loss.backward()
        outs += [y.asnumpy() for y in ys]
    net.hybridize(active=False)
    return outs + [p.grad().asnumpy().copy() for p in net.collect_params().values()]

for body, forward in %r:
    print("case", forward, flush=True)
    want = go(body, forward, None)
    got = go(body, forward, %r)
    for i, (w, g) in enumerate(zip(want, got)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg="%%s %%d" %% (forward, i))
print("same")
"""

#: (the block's body, the per-sample forward's result)
CASES = [
    ("F.broadcast_like(x, y)", "self.like(q, k)"),
    ("F.reshape_like(x, y)", "self.like(h, k)"),
    ("F.slice_like(x, y) * 2", "self.like(k, q) + q"),
    ("F.zeros_like(y) + x", "self.like(h, k)"),
    ("F.broadcast_like(x, y) + y", "self.like(q, k)"),            # y also used
    ("x", "nd.broadcast_like(q, k)"),                               # between blocks
    ("x", "nd.reshape_like(h, k) + nd.slice_like(k, q) * q"),
]


@pytest.mark.parametrize("policy", ["depth", "agenda", "auto", "sequential"])
def test_shape_source_gradients_equal_plain_gluon(policy):
    """Every case in one interpreter per policy (a crash names the last case)."""
    rc, out, err = run_in_subprocess(_PROGRAM % (CASES, policy))
    assert rc == 0 and "same" in out, (rc, out[-500:], err[-1500:])
