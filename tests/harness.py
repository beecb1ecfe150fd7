"""Differential oracle: the same parameters and inputs, plain per-sample Gluon vs
dynamic batching, outputs AND gradients."""
import numpy as np
from mxnet import autograd, nd

import jitbatch


def prepare(net, flag, policy="auto", granularity="auto", hybridize_plain=False):
    """``net`` flagged (``flag``), hybridized plainly (``hybridize_plain``) or
    per-sample Gluon, its gradients zeroed; its parameters."""
    if flag:
        net.hybridize(dynamic_batch=True, policy=policy, granularity=granularity)
    elif hybridize_plain:
        net.hybridize()
    else:
        net.hybridize(active=False)
    params = net.collect_params()
    for p in params.values():
        if p.grad_req != "null" and p._data is not None:
            p.zero_grad()
    return params


def run(net, apply, samples, train, flag, policy="auto", hybridize_plain=False,
        granularity="auto", mapped=False):
    """``mapped``: the samples through ``jitbatch.map`` instead of a loop."""
    prepare(net, flag, policy, granularity, hybridize_plain)
    return run_configured(net, apply, samples, train, mapped)


def run_configured(net, apply, samples, train, mapped=False):
    """``run`` on a network its caller configured (flagged some blocks, zeroed
    the gradients); ends with ``net.hybridize(active=False)``."""
    params = net.collect_params()

    def each():
        if mapped:
            return jitbatch.map(lambda s: apply(net, s), samples)
        return [apply(net, s) for s in samples]
    if train:
        with autograd.record():
            res = each()
            total = nd.add_n(*[r[1] for r in res])
        total.backward()
    else:
        res = each()
    outs = [r[0].asnumpy() for r in res] + [r[1].asnumpy() for r in res]
    grads = {k: p.grad().asnumpy().copy() for k, p in params.items()
             if train and p.grad_req != "null"}
    net.hybridize(active=False)
    return outs, grads


#: entries are also compared on their array's scale: ``SCALE_TOL`` times its
#: largest magnitude (16 float32 ulps of it). A saturated ``tanh`` (|y| near 1)
#: has the gradient factor 1 - y*y, which cancels: one ulp of y, where oneDNN's
#: Activation kernel (config.fast_activations) and MXNet's tanh round apart,
#: moved such an entry by 2% (-1.291e-3 vs -1.267e-3 in an array whose largest
#: entry is 1.56e2; bit-identical with fast_activations off)
SCALE_TOL = 1e-6


def assert_same(ref, got, rtol=1e-4, atol=1e-5):
    (o1, g1), (o2, g2) = ref, got
    assert len(o1) == len(o2)

    def close(b, a, what):
        scale = float(np.abs(a).max()) if np.size(a) else 0.0
        np.testing.assert_allclose(b, a, rtol=rtol, atol=max(atol, SCALE_TOL * scale),
                                   err_msg=what)
    for i, (a, b) in enumerate(zip(o1, o2)):
        close(b, a, "output %d" % i)
    assert set(g1) == set(g2)
    for k in g1:
        close(g2[k], g1[k], "grad " + k)


def check_model(make, gen, apply, rng, n, train, policy, granularity="auto"):
    net = make()
    samples = gen(rng, n)
    ref = run(net, apply, samples, train, flag=False)
    jitbatch.reset_stats()
    got = run(net, apply, samples, train, flag=True, policy=policy, granularity=granularity)
    assert_same(ref, got)
    return jitbatch.stats()
