"""Batching rules for MXNet NDArray operators applied to lazy arrays: a registry.

A rule maps one per-sample call onto one call over N samples. It is found once
per signature, ``rule_for(name, keys, vals, in_shapes, out_shapes)``, and is
``(kind, keys, vals, pads)`` or None:

* ``elemwise``: the operator runs on the flat layout as recorded;
* ``reshape``: the flat data is re-viewed (``Reshape`` and its kin);
* ``stacked``: each input is viewed as ``(N, *pads[i])``, axis attributes
  shifted past the new batch axis (``keys``/``vals`` are the batched call's),
  and the result flattened back;
* ``batch_dot``: ``dot`` of two matrices per sample, run as ONE ``batch_dot``
  of the inputs viewed as ``(N, *pads[i])`` (its transposes as given).

Rules are registered per operator name by family helpers, so adding an
operator is one line below. An operator with no rule still stays lazy: it runs
one launch per node at flush time."""
import ast
import threading

#: operator name -> rule function(attrs, keys, vals, in_shapes, out_shapes)
RULES = {}

_PARSED = {}        # attribute string -> its immutable value (the strings repeat)
# CPython 3.11's parser keeps a recursion count per interpreter: two threads
# parsing at once can raise "SystemError: AST constructor recursion depth mismatch"
_PARSING = threading.Lock()
_MISSING = object()


def parse_attr(v):
    """An operator attribute's value from MXNet's string form (as is if not a literal)."""
    if not isinstance(v, str):
        return v
    got = _PARSED.get(v, _MISSING)
    if got is _MISSING:
        with _PARSING:
            try:
                got = ast.literal_eval(v)
            except (ValueError, SyntaxError):
                got = v
        if isinstance(got, (str, int, float, bool, tuple, type(None))) and len(_PARSED) < 65536:
            _PARSED[v] = got
    return got


def true_attr(value):
    """Whether a boolean operator attribute is set: MXNet reads 1, true and
    True alike (a parsed value or its string)."""
    return value is not None and str(value).strip().lower() in ("1", "true")


def _norm_axes(axis, ndim):
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    out = []
    for a in axes:
        a = int(a)
        if a < 0:
            a += ndim
        if not 0 <= a < ndim:
            return None
        out.append(a)
    return tuple(out)


def _shifted(keys, vals, **changes):
    """``keys``/``vals`` with the attributes in ``changes`` replaced or added."""
    keys = list(keys)
    vals = list(vals)
    for k, v in changes.items():
        if k in keys:
            vals[keys.index(k)] = v
        else:
            keys.append(k)
            vals.append(v)
    return keys, vals


def rule_for(name, keys, vals, in_shapes, out_shapes):
    """``(kind, keys, vals, pads)`` for one operator signature, or None (no rule)."""
    fn = RULES.get(name)
    if fn is None or not in_shapes:
        return None
    attrs = {k: parse_attr(v) for k, v in zip(keys, vals)}
    return fn(attrs, list(keys), list(vals), [tuple(s) for s in in_shapes],
              [tuple(s) for s in out_shapes])


def _register(names, fn):
    for name in names.split():
        RULES[name] = fn


# -- families ---------------------------------------------------------------------------
def _same_elemwise(attrs, keys, vals, ins, outs):
    """Every input and output of one shape: the flat layout is the same operator."""
    if all(s == ins[0] for s in ins) and all(s == ins[0] for s in outs) and "axes" not in attrs:
        return ("elemwise", keys, vals, None)
    return None


def elemwise(names):
    """Operators that act element by element on equally shaped arrays."""
    _register(names, _same_elemwise)


def _broadcasting(attrs, keys, vals, ins, outs):
    if all(s == ins[0] for s in ins):
        return _same_elemwise(attrs, keys, vals, ins, outs)
    rank = max(len(s) for s in ins)
    return ("stacked", keys, vals, [(1,) * (rank - len(s)) + s for s in ins])


def broadcasts(name):
    """Whether operator ``name`` is a broadcasting binary one (``broadcast``)."""
    return RULES.get(name) is _broadcasting


def broadcast(names):
    """Broadcasting binary operators: elementwise when the shapes agree, else
    each input rank-padded to the largest and stacked along a new batch axis."""
    _register(names, _broadcasting)


def _reshaping(attrs, keys, vals, ins, outs):
    # MXNet's Reshape operator does not check sizes (a target with special
    # codes can hold fewer values): re-viewing merged data then reads other
    # samples' rows, so only a true re-view merges
    if _size(ins[0]) != _size(outs[0]):
        return None
    return ("reshape", keys, vals, None)


def _size(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def reshape(names):
    """Operators that only re-view the data (the flat layout is re-viewed)."""
    _register(names, _reshaping)


def _reducing(name):
    def rule(attrs, keys, vals, ins, outs):
        nd_in = len(ins[0])
        axis = attrs.get("axis", None)
        if axis is None or axis == ():
            if true_attr(attrs.get("exclude")) or name in ("argmax", "argmin"):
                return None
            axes = tuple(range(nd_in))
        else:
            axes = _norm_axes(axis, nd_in)
            if axes is None:
                return None
        new = tuple(a + 1 for a in axes)
        if true_attr(attrs.get("exclude")):
            new = (0,) + new
        if name == "norm" and len(new) > 2:
            return None
        if name in ("argmax", "argmin"):
            if len(new) != 1:
                return None
            new = new[0]
        k2, v2 = _shifted(keys, vals, axis=str(new))
        return ("stacked", k2, v2, ins)
    return rule


def reduce(names):
    """Reductions over an ``axis`` attribute (all axes when absent)."""
    for name in names.split():
        RULES[name] = _reducing(name)


def one_axis(name, attr, default, rank_of="in"):
    """An operator with one axis attribute ``attr`` (``default`` when absent; None:
    no rule without it) counted in the input's rank (``rank_of='in'``) or the
    output's (``'out'``)."""
    def rule(attrs, keys, vals, ins, outs):
        if name in ("softmax", "log_softmax") and attrs.get("use_length"):
            return None
        axis = attrs.get(attr, default)
        if axis is None:
            return None
        rank = len(ins[0]) if rank_of == "in" else len(outs[0])
        axes = _norm_axes(axis, rank)
        if axes is None:
            return None
        new = tuple(a + 1 for a in axes)
        new = new[0] if not isinstance(axis, (tuple, list)) else new
        k2, v2 = _shifted(keys, vals, **{attr: str(new)})
        return ("stacked", k2, v2, ins)
    RULES[name] = rule


def _tile(attrs, keys, vals, ins, outs):
    # reps of the input's rank or fewer (padded with 1s in front, as MXNet
    # does), and 1 for the new leading axis; more reps than the input has axes
    # put new axes in front of the samples' rows: no rule
    reps = attrs.get("reps", ())
    reps = tuple(reps) if isinstance(reps, (tuple, list)) else (reps,)
    rank = len(ins[0])
    if len(reps) > rank or not all(isinstance(r, int) for r in reps):
        return None
    k2, v2 = _shifted(keys, vals, reps=str((1,) * (1 + rank - len(reps)) + reps))
    return ("stacked", k2, v2, ins)


def _leaky(attrs, keys, vals, ins, outs):
    # the element-wise kinds only: 'prelu' reads a slope per channel, 'rrelu'
    # draws slopes, in another order when merged
    if len(ins) != 1 or str(attrs.get("act_type", "leaky")) not in ("leaky", "elu", "selu",
                                                                    "gelu"):
        return None
    return _same_elemwise(attrs, keys, vals, ins, outs)


def _broadcast_to(attrs, keys, vals, ins, outs):
    # a 0 keeps an input's length: the samples' axis is kept
    shape = attrs.get("shape", ())
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    k2, v2 = _shifted(keys, vals, shape=str((0,) + shape))
    return ("stacked", k2, v2, ins)


def _broadcast_like(attrs, keys, vals, ins, outs):
    # both inputs are the samples' own: the axes they name move past theirs
    if len(ins) != 2 or len(ins[0]) != len(ins[1]):
        return None
    changes = {}
    for attr, shape in (("lhs_axes", ins[0]), ("rhs_axes", ins[1])):
        axes = attrs.get(attr)
        if axes not in (None, "None"):
            axes = _norm_axes(axes, len(shape))
            if axes is None:
                return None
            changes[attr] = str(tuple(a + 1 for a in axes))
    k2, v2 = _shifted(keys, vals, **changes)
    return ("stacked", k2, v2, ins)


def _axes_moved(attrs, keys, vals, ins, **defaults):
    """'stacked', the axis attributes named in ``defaults`` (their defaults
    where absent) read in the sample's rank and moved past the samples' axis;
    None for an axis out of range."""
    axes = _norm_axes(tuple(attrs.get(n, d) for n, d in defaults.items()), len(ins[0]))
    if axes is None:
        return None
    k2, v2 = _shifted(keys, vals, **{n: str(a + 1) for n, a in zip(defaults, axes)})
    return ("stacked", k2, v2, ins)


def _swap_axes(attrs, keys, vals, ins, outs):
    return _axes_moved(attrs, keys, vals, ins, dim1=0, dim2=0)


def _gemm2(attrs, keys, vals, ins, outs):
    # products over the last two axes (or around ``axis``), any leading axes
    # being a batch: the samples' axis is one more
    if len(ins) != 2 or len(ins[0]) != len(ins[1]) or len(ins[0]) < 2:
        return None
    return _axes_moved(attrs, keys, vals, ins, axis=-2)


def _transpose(attrs, keys, vals, ins, outs):
    nd_in = len(ins[0])
    axes = _norm_axes(attrs.get("axes") or tuple(reversed(range(nd_in))), nd_in)
    if axes is None:
        return None
    k2, v2 = _shifted(keys, vals, axes=str((0,) + tuple(a + 1 for a in axes)))
    return ("stacked", k2, v2, ins)


def _slice(attrs, keys, vals, ins, outs):
    def pre(t):
        t = attrs.get(t, ())
        t = tuple(t) if isinstance(t, (tuple, list)) else (t,)
        return str((None,) + t)
    changes = {"begin": pre("begin"), "end": pre("end")}
    if "step" in attrs:
        changes["step"] = pre("step")
    k2, v2 = _shifted(keys, vals, **changes)
    return ("stacked", k2, v2, ins)


def _leading(attrs, keys, vals, ins, outs):
    # every input and output keeps the same leading size, along which the
    # operator acts independently (batch_dot: one product per leading index):
    # the flat layout of N samples is the operator on N times as many
    lead = ins[0][0] if ins[0] else None
    if lead is None or any(not s or s[0] != lead for s in ins + outs):
        return None
    return ("elemwise", keys, vals, None)


def leading(names):
    """Operators independent along axis 0 whose inputs and outputs all keep
    its size (``batch_dot``)."""
    _register(names, _leading)


def _dot(attrs, keys, vals, ins, outs):
    # a product of two matrices per sample: N of them are one batch_dot of
    # (N, m, k) by (N, k, n), which takes the same transpose attributes
    if len(ins) != 2 or len(ins[0]) != 2 or len(ins[1]) != 2 or \
            attrs.get("forward_stype") not in (None, "None"):
        return None
    return ("batch_dot", keys, vals, ins)


def _expanding(attrs, keys, vals, ins, outs):
    # one input, each element mapped to a block of the same trailing shape
    # (one_hot): the output is the input's shape plus trailing axes
    if len(ins) != 1 or len(outs) != 1 or tuple(outs[0][:len(ins[0])]) != tuple(ins[0]) \
            or not ins[0]:
        return None
    return ("elemwise", keys, vals, None)


def expanding(names):
    """Operators mapping each input element to a fixed block of trailing axes
    (``one_hot``): the flat layout is the same operator."""
    _register(names, _expanding)


def _dropout(attrs, keys, vals, ins, outs):
    # a mask drawn per element is drawn per sample; one shared along ``axes`` is not
    if attrs.get("axes"):
        return None
    return ("elemwise", keys, vals, None)


def _reshape_like(attrs, keys, vals, ins, outs):
    # both inputs the samples' own: each range of axes moves past the samples'
    # axis (an absent begin is axis 0, the first of a sample's axes)
    if len(ins) != 2:
        return None
    changes = {}
    for side in ("lhs", "rhs"):
        for end, absent in (("begin", "1"), ("end", "None")):
            attr = "%s_%s" % (side, end)
            value = attrs.get(attr)
            if value in (None, "None"):
                changes[attr] = absent
            elif not isinstance(value, int):
                return None
            else:
                changes[attr] = str(value + 1 if value >= 0 else value)
    k2, v2 = _shifted(keys, vals, **changes)
    return ("stacked", k2, v2, ins)


def _slice_like(attrs, keys, vals, ins, outs):
    # the samples' axis is as long in both inputs: slicing it keeps it
    if len(ins) != 2 or len(ins[0]) != len(ins[1]):
        return None
    axes = attrs.get("axes", ())
    if axes in ((), [], None, "None"):
        return ("stacked", keys, vals, ins)
    axes = _norm_axes(axes, len(ins[0]))
    if axes is None:
        return None
    k2, v2 = _shifted(keys, vals, axes=str(tuple(a + 1 for a in axes)))
    return ("stacked", k2, v2, ins)


def _diag(attrs, keys, vals, ins, outs):
    # the diagonal of a matrix (or of two axes): those axes move past the
    # samples'; a vector's diagonal matrix has no batched form
    if len(ins) != 1 or len(ins[0]) < 2:
        return None
    return _axes_moved(attrs, keys, vals, ins, axis1=0, axis2=1)


def _sequence(attrs, keys, vals, ins, outs):
    # SequenceMask / SequenceLast along axis 1: the sequences lie along axis 0
    # with their lengths, so the samples' rows are more sequences. Along axis
    # 0 (the default) axis 0 is time: a sample's one sequence, (T, 1, ...),
    # is viewed as (T, ...) and the samples' as (N, T, ...), run along axis 1
    if str(attrs.get("axis", 0)) == "1":
        return _leading(attrs, keys, vals, ins, outs)
    data = ins[0]
    if len(data) < 3 or data[1] != 1 or any(s != (1,) for s in ins[1:]):
        return None
    k2, v2 = _shifted(keys, vals, axis="1")
    return ("stacked", k2, v2, [(data[0],) + tuple(data[2:])] + [()] * (len(ins) - 1))


#: operators whose weight arguments (positions) may be one array every call
#: passes (a parameter's ``data()``): merged, each such argument is passed
#: once, as is, and the others' rows are the samples' (axis 0 kept apart)
SHARED_WEIGHTS = {"FullyConnected": (1, 2), "Embedding": (1,), "take": (0,),
                  "LayerNorm": (1, 2), "dot": (1,)}


def shared_rule(name, keys, vals, ins, outs, shared):
    """The rule of a call whose arguments at positions ``shared`` are arrays
    every call of its signature passes (``SHARED_WEIGHTS``): ``elemwise``
    (the operator on the other arguments' flat rows and the shared ones as
    they are) where each index of axis 0 of the others is computed apart,
    else None (one launch per call)."""
    allowed = SHARED_WEIGHTS.get(name, ())
    rest = [s for k, s in enumerate(ins) if k not in shared]
    # every weight the call passes is one shared array (a bias made per call
    # beside a parameter is no sample's rows); the data has rows (axis 0 of a
    # vector is its features)
    if not rest or set(shared) != set(k for k in allowed if k < len(ins)) or \
            any(not s for s in rest) or (name == "FullyConnected" and len(rest[0]) < 2):
        return None
    lead = rest[0][0]
    if any(s[0] != lead for s in rest) or any(not o or o[0] != lead for o in outs):
        return None
    attrs = {k: parse_attr(v) for k, v in zip(keys, vals)}
    if name == "take" and _norm_axes(attrs.get("axis", 0), len(ins[0])) != (0,):
        return None             # (the indices' axes replace axis 0 of the weight)
    if name == "LayerNorm" and _norm_axes(attrs.get("axis", -1), len(ins[0])) in (None, (0,)):
        return None
    if name == "Embedding" and true_attr(attrs.get("sparse_grad")):
        return None
    if name == "dot" and (true_attr(attrs.get("transpose_a")) or len(rest[0]) < 2 or
                          attrs.get("forward_stype") not in (None, "None")):
        return None             # (the rows of a transposed lhs are its columns)
    return ("elemwise", keys, vals, None)

# -- the registry ------------------------------------------------------------------------
# (no rule for MakeLoss / make_loss: its backward passes ones whatever the head
# gradient, so a merged sample the backward never reaches would add its gradient;
# one launch per call)
elemwise("""
Activation sigmoid tanh relu softsign exp expm1 log log1p log2 log10 sqrt rsqrt cbrt square abs
negative reciprocal sign floor ceil round rint fix trunc sin cos tan arcsin arccos arctan sinh
cosh arcsinh arccosh arctanh erf erfinv gamma gammaln degrees radians clip Cast cast
zeros_like ones_like _copy identity BlockGrad stop_gradient
elemwise_add elemwise_sub elemwise_mul elemwise_div _plus _minus _mul _div _Plus _Minus _Mul _Div
_grad_add _maximum _minimum _power _hypot _mod
_plus_scalar _minus_scalar _rminus_scalar _mul_scalar _div_scalar _rdiv_scalar _power_scalar
_rpower_scalar _maximum_scalar _minimum_scalar _hypot_scalar _mod_scalar _rmod_scalar
_equal_scalar _not_equal_scalar _greater_scalar _greater_equal_scalar _lesser_scalar
_lesser_equal_scalar _logical_and_scalar _logical_or_scalar _logical_xor_scalar logical_not
add_n ElementWiseSum _equal _not_equal _greater _greater_equal _lesser _lesser_equal
smooth_l1 hard_sigmoid where L2Normalization
""")
broadcast("""
broadcast_add broadcast_sub broadcast_mul broadcast_div broadcast_plus broadcast_minus
broadcast_maximum broadcast_minimum broadcast_power broadcast_hypot broadcast_mod
broadcast_equal broadcast_not_equal broadcast_greater broadcast_greater_equal
broadcast_lesser broadcast_lesser_equal broadcast_logical_and broadcast_logical_or
broadcast_logical_xor
""")
reshape("Reshape reshape expand_dims squeeze Flatten flatten")
leading("batch_dot Pad pad")
expanding("one_hot")
#: reductions over an ``axis`` attribute (all axes where absent)
REDUCING = tuple("sum mean max min prod nansum nanprod norm sum_axis max_axis min_axis "
                 "argmax argmin".split())
reduce(" ".join(REDUCING))
#: operators acting along one axis attribute: name -> (the attribute, its
#: default, the rank it counts in: 'in'put's or 'out'put's)
ONE_AXIS = {"softmax": ("axis", -1, "in"), "log_softmax": ("axis", -1, "in"),
            "slice_axis": ("axis", None, "in"), "SliceChannel": ("axis", 1, "in"),
            "split": ("axis", 1, "in"), "flip": ("axis", None, "in"),
            "reverse": ("axis", None, "in"), "sort": ("axis", -1, "in"),
            "argsort": ("axis", -1, "in"), "concat": ("dim", 1, "in"),
            "Concat": ("dim", 1, "in"), "stack": ("axis", 0, "out"),
            "pick": ("axis", -1, "in"), "topk": ("axis", -1, "in"),
            "repeat": ("axis", None, "in"), "broadcast_axis": ("axis", None, "in"),
            "broadcast_axes": ("axis", None, "in"), "moments": ("axes", None, "in")}
for _name, (_attr, _default, _rank) in ONE_AXIS.items():
    one_axis(_name, _attr, _default, _rank)
RULES["transpose"] = _transpose
RULES["tile"] = _tile
RULES["LeakyReLU"] = _leaky
RULES["broadcast_to"] = _broadcast_to
RULES["broadcast_like"] = _broadcast_like
RULES["SwapAxis"] = RULES["swapaxes"] = _swap_axes
RULES["_linalg_gemm2"] = RULES["linalg_gemm2"] = _gemm2
RULES["dot"] = _dot
RULES["slice"] = _slice
RULES["Dropout"] = _dropout
RULES["reshape_like"] = _reshape_like
RULES["slice_like"] = _slice_like
RULES["diag"] = _diag
RULES["SequenceMask"] = RULES["SequenceLast"] = _sequence
