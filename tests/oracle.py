"""The contract oracle of issue 19: a per-sample program run batched gives plain
per-sample Gluon's numbers (outputs, gradients and parameters after the run,
same parameters and inputs), or a clear jitbatch error, or - where plain MXNet
itself refuses (in-place writes inside ``autograd.record``) - MXNet's own
wording; never silently different numbers.

A *clear* jitbatch error is a ``jitbatch.JitBatchError`` subclass whose message
names the culprit (a regex for the block or operator, given per test) and the
fix (the word "Fix", as every error in docs/errors.rst does).

Used by tests/test_contract.py and tests/test_properties.py. Public API only.
"""
import gc
import re

import numpy as np
import mxnet as mx
from mxnet import autograd, nd

import jitbatch

#: every catalogued jitbatch error says how to fix it ("... Fix: ...")
FIX = r"(?i)\bfix\b"
#: MXNet's refusal of a write to an array already in the autograd graph
#: ("Assigning to NDArrays that are already in a computational graph ... Also note
#: that you cannot use inplace operations like +=, ... inside a record section.")
#: MXNet's refusals of an in-place write inside autograd.record: the Python
#: check ("... inside a record section") and, when the target is itself the
#: output of a recorded operator, the engine's ("... not supported when
#: recording with autograd"); which one fires depends on how the target was
#: made, not on whether the program is refused
MX_INPLACE = (r"(?i)inplace operations.*(inside a record section|"
              r"not supported when recording with autograd)")
RTOL, ATOL = 1e-4, 1e-5


class Outcome(object):
    """What one run of a program gave: named numpy arrays, or an exception."""

    def __init__(self, arrays=None, error=None):
        self.arrays = arrays
        self.error = error

    def __repr__(self):
        if self.error is not None:
            return "raised %s: %s" % (type(self.error).__name__, _first_line(self.error))
        return "%d arrays" % len(self.arrays)


def _first_line(e, n=300):
    s = str(e).strip()
    # MXNet errors start with a C++ traceback; the last "Error" line is the message
    lines = [ln for ln in s.splitlines() if "Error" in ln or "error" in ln] \
        or s.splitlines() or [""]
    return (lines[-1] if isinstance(e, mx.base.MXNetError) else s.replace("\n", " "))[:n]


def snapshot(net):
    """Parameter values, to give every run the same starting point."""
    jitbatch.flush()
    return {k: p.data().copy() for k, p in net.collect_params().items()}


def restore(net, snap):
    for k, p in net.collect_params().items():
        p.set_data(snap[k])
        if p.grad_req != "null":
            p.zero_grad()


def loss_of(outs):
    """A loss that depends on every output (not only on their sums, which axis-0
    centring and softmax make constant)."""
    return nd.add_n(*[(o * o).sum() * (1.0 + 0.1 * i) for i, o in enumerate(outs)])


def run_program(net, program, flag, policy="auto", granularity="auto", train=True,
                snap=None, seed=None):
    """Run ``program(net) -> [NDArray]`` (the whole minibatch, per-sample code)
    plain (``flag=False``: Gluon without hybridize) or batched, optionally under
    ``autograd.record`` with a backward through ``loss_of``. Returns an Outcome
    with the outputs, the gradients and every parameter's value after the run
    (BatchNorm's running statistics, parameters written by the program)."""
    if snap is not None:
        restore(net, snap)
    if seed is not None:
        mx.random.seed(seed)
    if flag:
        net.hybridize(dynamic_batch=True, policy=policy, granularity=granularity)
    else:
        net.hybridize(active=False)
    try:
        if train:
            with autograd.record():
                outs = list(program(net))
                loss = loss_of(outs)
            loss.backward()
        else:
            outs = list(program(net))
        arrays = [("output %d" % i, o.asnumpy()) for i, o in enumerate(outs)]
        for k, p in sorted(net.collect_params().items()):
            if train and p.grad_req != "null":
                arrays.append(("grad %s" % k, p.grad().asnumpy().copy()))
            arrays.append(("param %s after the run" % k, p.data().asnumpy().copy()))
        return Outcome(arrays=arrays)
    except Exception as e:  # pylint: disable=broad-except
        return Outcome(error=e)
    finally:
        cleanup()
        net.hybridize(active=False)


def cleanup():
    """Leave nothing pending (a failed program may have left calls recorded)."""
    for _ in range(2):
        try:
            jitbatch.flush()
            break
        except Exception:  # pylint: disable=broad-except
            pass


def rel_error(ref, got):
    """Largest |got - ref| over the largest |ref| (inf where shapes or NaNs differ)."""
    ref, got = np.asarray(ref, dtype=np.float64), np.asarray(got, dtype=np.float64)
    if ref.shape != got.shape:
        return float("inf")
    if not np.array_equal(np.isnan(ref), np.isnan(got)):
        return float("inf")
    ok = ~np.isnan(ref)
    if not ok.any():
        return 0.0
    diff = np.abs(got[ok] - ref[ok]).max()
    scale = np.abs(ref[ok]).max()
    return float(diff / scale) if scale > 1e-6 else (float("inf") if diff > 0 else 0.0)


#: BatchNorm running statistics after a run (see differences)
RUNNING = re.compile(r"^param .*running_(mean|var) after the run$")


def differences(ref, got, rtol=RTOL, atol=ATOL, running=True):
    """``(name, description, relative error)`` of each array of ``got`` that
    differs from ``ref``."""
    out = []
    names_ref = [n for n, _ in ref.arrays]
    names_got = [n for n, _ in got.arrays]
    if names_ref != names_got:
        return [("arrays", "plain gave %s, batched %s" % (names_ref, names_got), float("inf"))]
    for (name, a), (_, b) in zip(ref.arrays, got.arrays):
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        # ``running=False``: BatchNorm's running statistics after a training run
        # are not compared. MXNet updates them during backward, for the calls
        # its graph reaches, in the order it gives; a merged graph changes
        # both (a call whose output never reaches the loss updates them too),
        # which jitbatch's warning says (docs/errors.rst). Outputs and
        # gradients stay exact, and tests/test_contract.py compares the
        # statistics exactly where every call's output is used
        if not running and RUNNING.search(name):
            continue
        if a64.shape != b64.shape:
            out.append((name, "shape %s, plain Gluon %s" % (b64.shape, a64.shape), float("inf")))
        elif not np.allclose(b64, a64, rtol=rtol, atol=atol, equal_nan=True):
            if not np.array_equal(np.isnan(a64), np.isnan(b64)):
                out.append((name, "NaN at %d places, plain Gluon at %d"
                            % (np.isnan(b64).sum(), np.isnan(a64).sum()), float("inf")))
            else:
                err = rel_error(a64, b64)
                out.append((name, "relative error %.3g (max |batched - plain| %.3g, max "
                            "|plain| %.3g)" % (err, np.nanmax(np.abs(b64 - a64)),
                                               np.nanmax(np.abs(a64))), err))
    return out


def summary(ref, diffs):
    """Outputs summarised (count, worst), gradients and parameters one by one."""
    outs = [d for d in diffs if d[0].startswith("output ")]
    rest = [d for d in diffs if not d[0].startswith("output ")]
    n_out = sum(1 for n, _ in ref.arrays if n.startswith("output "))
    parts = []
    if outs:
        worst = max(outs, key=lambda d: d[2])
        parts.append("%d of %d outputs differ (worst: %s, %s)" % (len(outs), n_out, worst[0],
                                                                 worst[1]))
    parts.extend("%s: %s" % (n, d) for n, d, _ in rest[:8])
    if len(rest) > 8:
        parts.append("+%d more" % (len(rest) - 8))
    return "; ".join(parts)


def judge(ref, got, culprit, what, mx_error=MX_INPLACE, running=True):
    """The oracle. ``ref``/``got``: Outcomes of the plain and the batched run.
    ``culprit``: regex the message of a jitbatch error must match (the block's or
    operator's name); ``running``: compare BatchNorm's running statistics (see
    ``differences``). Returns None when the
    contract holds, else the failure text."""
    if ref.error is not None:
        # only MXNet's own refusal is an expected plain failure; anything else is a
        # bug of the test
        if not (isinstance(ref.error, mx.base.MXNetError)
                and re.search(mx_error, str(ref.error), re.S)):
            raise AssertionError("plain Gluon itself failed (test bug): %r" % ref)
        if got.error is None:
            return ("%s: jitbatch accepted it and returned values, where plain MXNet refuses "
                    "it (MXNetError /%s/): silently different" % (what, mx_error))
        if not re.search(mx_error, str(got.error), re.S):
            return ("%s: jitbatch raised %s: %s, where plain MXNet refuses it with "
                    "MXNetError /%s/ (expected that wording)"
                    % (what, type(got.error).__name__, _first_line(got.error), mx_error))
        return None
    if got.error is not None:
        e = got.error
        if not isinstance(e, jitbatch.JitBatchError):
            return ("%s: crashed with %s: %s (expected plain Gluon's numbers or a "
                    "jitbatch.JitBatchError naming the culprit and the fix)"
                    % (what, type(e).__name__, _first_line(e)))
        msg = str(e)
        missing = [w for w, rx in (("the culprit /%s/" % culprit, culprit), ("the fix", FIX))
                   if not re.search(rx, msg, re.S)]
        if missing:
            return ("%s: %s does not name %s: %s" % (what, type(e).__name__,
                                                     " or ".join(missing), _first_line(e)))
        return None
    diffs = differences(ref, got, running=running)
    if diffs:
        return "%s: silently different from plain Gluon: %s" % (what, summary(ref, diffs))
    return None


def check(net, program, policy, granularity="auto", train=True, culprit=".", seed=None,
          what=None):
    """Plain vs batched on one net (the same parameters for both runs); fails with
    the oracle's text. Returns the batched Outcome."""
    snap = snapshot(net)
    ref = run_program(net, program, False, train=train, snap=snap, seed=seed)
    got = run_program(net, program, True, policy, granularity, train=train, snap=snap,
                      seed=seed)
    restore(net, snap)
    what = what or "policy=%s granularity=%s %s" % (policy, granularity,
                                                     "training" if train else "inference")
    failure = judge(ref, got, culprit, what)
    assert failure is None, failure
    return got


def gc_left_enabled_after_abandoning(record):
    """Record with ``record()`` (which drops every lazy result), collect, and say
    whether Python's cyclic GC is enabled and whether new cyclic garbage is then
    collected automatically. Returns ``(enabled, collected_automatically)``."""
    import weakref

    class Cycle(object):
        pass

    record()
    gc.collect()
    enabled = gc.isenabled()
    dead = []
    refs = []
    for _ in range(3000):          # > gen-0 threshold (700): automatic collections run
        c = Cycle()
        c.me = c
        refs.append(weakref.ref(c, dead.append))
        del c
    return enabled, len(dead) > 0
