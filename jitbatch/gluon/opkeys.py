"""What an operator call's signature leaves out, so that calls differing in it merge.

A signature keys an operator call by its attributes and its arguments'
shapes; calls that differ in any of them never share a launch. Two kinds of
per-sample difference are left out, each where merging computes exactly what
every call does:

* the arity of a sum (``nd.add_n`` of each node's neighbours): a launch pads
  the shorter calls with rows of -0.0 (``gather.prepare``);
* the Python number of a scalar operator (``x / len(children)``): each node
  holds its own (``Node.lifted``) and a launch applies the broadcasting twin
  to a column of them (``executors.OpExec``)."""
import numpy as np

from . import _mxapi

#: operators summing any number of equally shaped inputs. x + -0.0 is x in IEEE
#: arithmetic, -0.0 and NaN included. MXNet 1.9.1 sums 3 or 4 inputs right to
#: left (a + (b + c)) and 5 or more left to right, so sums of up to
#: ``_SHORT_SUM`` inputs and sums of more are two signatures: within each, the
#: padded sums are the per-sample sums bit for bit (tests/test_variadic_sums.py)
_SUMS = ("add_n", "ElementWiseSum")
_SUM_HANDLES = []
_SHORT_SUM = 4
SUM = "sum of any arity"

#: scalar operators -> (their broadcasting twin, scalar first). MXNet casts the
#: scalar to the array's dtype before computing, so the twin on a column of the
#: calls' scalars computes what each call does (tests/test_lifted_scalars.py),
#: bit for bit but where MXNet's text parser reads a double one ulp off
#: (docs/errors.rst, Known differences)
_LIFTS = {"_plus_scalar": ("broadcast_add", False), "_minus_scalar": ("broadcast_sub", False),
          "_rminus_scalar": ("broadcast_sub", True), "_mul_scalar": ("broadcast_mul", False),
          "_div_scalar": ("broadcast_div", False), "_rdiv_scalar": ("broadcast_div", True),
          "_maximum_scalar": ("broadcast_maximum", False),
          "_minimum_scalar": ("broadcast_minimum", False),
          "_power_scalar": ("broadcast_power", False), "_rpower_scalar": ("broadcast_power", True)}
_LIFT_HANDLES = {}
LIFTED = "lifted scalar"


def left_out(handle, keys, vals, vkey, metas):
    """``(what is left out, the attribute values' key, the metas' key,
    lift)`` of an operator call: what is left out is False, ``SUM`` (the
    arity class, with ``"short"``/``"long"``) or ``LIFTED``; ``lift`` is the
    broadcasting twin ``(handle, scalar first)`` of a lifted scalar, else None."""
    cls = _sum_class(handle, metas)
    if cls and "num_args" in keys:     # (MXNet counts the inputs where it is not given)
        at = list(keys).index("num_args")
        if str(vals[at]) != str(len(metas)):
            # a count that is not the inputs': its own signature, whose trial run raises
            return False, vkey, metas, None
        vkey = vkey[:at] + (None,) + vkey[at + 1:]
    if cls:
        return (SUM, cls), vkey, metas[:1], None
    lift = _lifted_scalar(handle, keys, vals, metas)
    if lift is not None:
        return LIFTED, (None,), metas, lift
    return False, vkey, metas, None


def is_sum(loose):
    """Whether ``left_out``'s first value says a sum of any arity."""
    return type(loose) is tuple and loose[0] == SUM


def empty(metas):
    """Whether a meta's shape has a 0 (an empty array, NumPy shape semantics)."""
    for m in metas:
        if m[0] and 0 in m[0]:
            return True
    return False


def _sum_class(handle, metas):
    """For a sum of equally shaped inputs, its arity class ('short' up to
    ``_SHORT_SUM`` inputs, else 'long'); None for any other call. (Empty
    arguments never get here: ``record.record_op`` runs them at once.)"""
    if not _SUM_HANDLES:
        _SUM_HANDLES.extend(_mxapi.op_handle(n) for n in _SUMS)
    if handle not in _SUM_HANDLES:
        return None
    first = metas[0]
    if first[0] is None or not first[0] or first[0][0] is None:
        return None
    for m in metas:
        if m != first:
            return None
    return "short" if len(metas) <= _SHORT_SUM else "long"


def _lifted_scalar(handle, keys, vals, metas):
    """``(broadcasting twin's handle, scalar first)`` for a scalar operator
    call on one floating-point array of a fixed per-sample shape,
    else None (integer arrays keep their scalar in the key; so does a number
    MXNet refuses, a subnormal double: its trial run raises MXNet's error)."""
    if not _LIFT_HANDLES:
        _LIFT_HANDLES.update({_mxapi.op_handle(n): (_mxapi.op_handle(b), first)
                              for n, (b, first) in _LIFTS.items()})
    how = _LIFT_HANDLES.get(handle)
    if how is None or len(keys) != 1 or keys[0] != "scalar" or len(metas) != 1:
        return None
    shape = metas[0][0]
    if not shape or shape[0] is None or np.dtype(metas[0][1]).kind != "f":
        return None
    try:
        v = abs(float(vals[0]))
    except (TypeError, ValueError):
        return None
    if 0.0 < v < _SMALLEST:
        return None
    return how


_SMALLEST = np.finfo(np.float64).tiny   # below it (subnormal), MXNet's parser refuses a scalar
