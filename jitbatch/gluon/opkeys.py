"""What an operator call's signature leaves out, so that calls differing in it merge.

A signature keys an operator call by its attributes and its arguments'
shapes; calls that differ in any of them never share a launch. Two kinds of
per-sample difference are left out, each where merging computes exactly what
every call does:

* the arity of a sum (``nd.add_n`` of each node's neighbours): a launch pads
  the shorter calls with rows of -0.0 (``gather.prepare``);
* the Python number of a scalar operator (``x / len(children)``): each node
  holds its own (``Node.lifted``) and a launch applies the broadcasting twin
  to a column of them (``executors.OpExec``);
* the leading length that every argument of a row-wise operator shares (a
  sample's own sequence length: ``nd.tanh(emb)`` of a ``(T, E)`` embedding):
  its signature is *ragged* (``ragged_lead``; ``signatures.op_signature``
  keeps it where the operator's rule maps rows to rows whatever their
  number), and a launch runs the operator on the samples' rows one after the
  other, each node owning its own rows of the outputs."""
import numpy as np

from . import _mxapi
from .rules import ONE_AXIS, REDUCING, broadcasts, parse_attr, true_attr

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


def ragged_lead(metas, loose):
    """The leading length of two or more that the arguments of an operator
    call share (some may have one row instead: a sample's single row against
    its rows, ``h * q``), where no arity is left out of the key; else None.
    (Calls of one row keep their exact signature: the common per-row case
    stays as it was.)"""
    if is_sum(loose) or not metas:
        return None
    lead = 0
    for m in metas:
        s = m[0]
        if not s or s[0] is None:
            return None
        if s[0] != 1:
            if lead and s[0] != lead:
                return None
            lead = s[0]
    return lead if lead >= 2 else None


def unled(metas, lead):
    """``metas`` with leading length ``lead`` left out (None) where they have it."""
    return tuple([((None,) + tuple(m[0][1:]),) + tuple(m[1:]) if m[0] and m[0][0] == lead
                  else tuple(m) for m in metas])


def single_rows(metas, lead):
    """The positions of the arguments with one row among others of ``lead``."""
    return tuple([i for i, m in enumerate(metas) if m[0][0] != lead])


#: reshapes that keep axis 0 whatever its length when their output keeps it
#: (``Reshape`` and ``reshape`` only where their target copies it: ``_copies_rows``)
ROW_RESHAPES = ("expand_dims", "squeeze", "Flatten", "flatten")

#: the value a padded row takes in a reduction over each sample's rows
#: (``executors.SegmentExec``), which leaves the reduction's running state as
#: it starts; the others of ``rules.REDUCING`` reduce row by row only
SEGMENT_FILLS = {"sum": 0.0, "sum_axis": 0.0, "nansum": 0.0, "mean": 0.0, "prod": 1.0,
                 "nanprod": 1.0, "max": -np.inf, "max_axis": -np.inf, "min": np.inf,
                 "min_axis": np.inf}


def rowwise(ex, lead, out_meta):
    """Whether operator executor ``ex`` (a signature whose arguments share
    leading length ``lead``) maps rows to rows whatever their number, judged
    by its rule and attributes, never by ``lead``: an elementwise rule (same
    shapes, ``batch_dot``, ``one_hot``), a lifted scalar operator, a
    broadcasting one between arrays of one rank (so along other axes), a
    re-view that keeps axis 0, or an operator acting along axes other than
    0; every output keeping ``lead`` (checked)."""
    kind, name = ex.kind, ex.name
    if ex.lift is None and kind != "elemwise" and \
            not (kind == "reshape" and (name in ROW_RESHAPES or _copies_rows(ex))) and \
            not (kind == "stacked" and _off_axis_0(name, ex.keys, ex.vals, ex.in_meta)):
        return False
    for m in out_meta:
        if not m[0] or m[0][0] != lead:
            return False
    return True


def rows_copied(have, shape, reverse):
    """A reshape target of an array of ``have`` rows (two or more) that keeps
    them, with axis 0 copied (code 0) instead of counted, so that sequences
    of any length share the call's signature (``rowwise``, ``_copies_rows``);
    else ``shape`` as given."""
    if len(shape) < 2 or have[0] < 2 or reverse:
        return shape
    if -1 in shape:
        shape = _mxapi.resolved_shape(have, shape, False)
    if shape[0] != have[0]:
        return shape
    return (0,) + tuple(shape[1:])


#: the handles of Reshape (the operator reshape_rows rewrites)
RESHAPE_HANDLES = frozenset(_mxapi.op_handle(n) for n in ("Reshape", "reshape"))


def reshape_rows(handle, keys, vals, have):
    """The attribute values of a ``Reshape`` call (``RESHAPE_HANDLES``) on an
    array of shape ``have``: a target that counts the rows (``nd.reshape(h,
    shape=(T, 2, -1))`` on ``T`` rows) gets axis 0 copied (code 0,
    ``rows_copied``), so that sequences of any length share its signature;
    other targets stay as given."""
    if "shape" not in keys or "target_shape" in keys or not have or have[0] < 2:
        return vals
    attrs = dict(zip(keys, vals))
    if true_attr(attrs.get("reverse")):
        return vals
    shape = parse_attr(str(attrs["shape"]))
    # (no special code but -1: a count of rows, or a -1 that resolves to it)
    if not isinstance(shape, (tuple, list)) or len(shape) < 2 or \
            shape[0] not in (have[0], -1) or \
            not all(isinstance(d, int) and (d > 0 or d == -1) for d in shape) or \
            (-1 not in shape and int(np.prod(shape)) != int(np.prod(have))):
        return vals     # (a wrong size is refused below, naming the target as written)
    out = list(vals)
    out[list(keys).index("shape")] = str(rows_copied(tuple(have), tuple(shape), False))
    return out


def check_reshape(name, keys, vals, shapes):
    """Refuse a ``Reshape`` call into another number of values as
    ``NDArray.reshape`` does: MXNet's operator checks no sizes, and a target of
    fewer values corrupts the heap (the signature's trial run too)."""
    if name in ("Reshape", "reshape") and "shape" in keys:
        attrs = dict(zip(keys, vals))
        target = parse_attr(str(attrs["shape"]))
        _mxapi.resolved_shape(shapes[0][0],
                              (target,) if isinstance(target, int) else tuple(target),
                              parse_attr(str(attrs.get("reverse", "False"))) is True)


def _copies_rows(ex):
    """Whether a ``Reshape`` copies axis 0 (its target starts with the code 0,
    read left to right): every other code then acts on the other axes only,
    whatever the number of rows."""
    attrs = dict(zip(ex.keys, ex.vals))
    target = parse_attr(str(attrs.get("shape", "()")))
    return isinstance(target, (tuple, list)) and len(target) > 0 and target[0] == 0 and \
        not true_attr(attrs.get("reverse")) and \
        parse_attr(str(attrs.get("target_shape", "()"))) in ((), [], None)


def _off_axis_0(name, keys, vals, in_meta):
    """Whether a 'stacked' operator call acts along other axes than 0 only."""
    rank = len(in_meta[0][0])
    if broadcasts(name):
        return all(len(m[0]) == rank for m in in_meta)
    attrs = dict(zip(keys, vals))
    if name in ONE_AXIS or name in REDUCING:
        attr, default, rank_of = ONE_AXIS.get(name, ("axis", None, "in"))
        # (stack's axis counts in the output's rank: one more)
        axes = _axes(attrs.get(attr), default, rank if rank_of == "in" else rank + 1)
        return axes is not None and 0 not in axes and not true_attr(attrs.get("exclude"))
    if name == "transpose":
        axes = _axes(attrs.get("axes"), None, rank)
        return axes is not None and len(axes) == rank and axes[0] == 0
    if name == "tile":      # (rules._tile: no more reps than axes)
        reps = parse_attr(str(attrs.get("reps")))
        reps = tuple(reps) if isinstance(reps, (tuple, list)) else (reps,)
        return len(reps) < rank or reps[0] == 1
    if name == "slice":
        firsts = [_first(attrs.get(k)) for k in ("begin", "end", "step")]
        return firsts[0] is None and firsts[1] is None and firsts[2] in (None, 1)
    return False


def _axes(value, default, rank):
    """The normalized axes of an attribute's string ``value`` (``default``
    where absent); None where absent without a default, empty (all) or bad."""
    axis = default if value is None else parse_attr(str(value))
    if axis is None or axis == ():
        return None
    out = []
    for a in (axis if isinstance(axis, (tuple, list)) else (axis,)):
        if not isinstance(a, int) or not -rank <= a < rank:
            return None
        out.append(a % rank)
    return tuple(out)


def _first(value):
    """The first entry of a slice attribute (``begin``/``end``/``step``)."""
    v = parse_attr(str(value)) if value is not None else None
    if isinstance(v, (tuple, list)):
        return v[0] if v else None
    return v


#: operators normalising over axis 0 of each sample's rows (attention
#: weights over a sample's tokens): padded like a reduction, with -inf (its
#: exp adds 0), their outputs the samples' rows again
SEGMENT_NORMS = ("softmax", "log_softmax")


def reduced_per_row(ex):
    """For a reduction over axis 0 (``segment_fill``), the entries one row of
    a sample adds to each output entry: the product of the sizes of its other
    reduced axes (1 where axis 0 is the only one)."""
    attrs = dict(zip(ex.keys, ex.vals))
    shape = ex.in_meta[0][0]
    count = 1
    for a in _axes(attrs.get("axis"), None, len(shape)):
        if a:
            count *= shape[a]
    return count


def segment_fill(ex):
    """For a reduction over axis 0 (and perhaps others), or a normalisation
    over axis 0 (``SEGMENT_NORMS``), of one floating-point argument, ``ex``'s
    executor, the value that pads its samples' rows (``SEGMENT_FILLS``); else None."""
    fill = -np.inf if ex.name in SEGMENT_NORMS else SEGMENT_FILLS.get(ex.name)
    if fill is None or ex.kind != "stacked" or len(ex.in_meta) != 1 or \
            np.dtype(ex.in_meta[0][1]).kind != "f":
        return None
    attrs = dict(zip(ex.keys, ex.vals))
    if ex.name in SEGMENT_NORMS:
        axes = _axes(attrs.get("axis"), -1, len(ex.in_meta[0][0]))
        return fill if axes == (0,) and not true_attr(attrs.get("use_length")) else None
    if true_attr(attrs.get("exclude")):
        return None
    axes = _axes(attrs.get("axis"), None, len(ex.in_meta[0][0]))
    return fill if axes is not None and 0 in axes else None


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
