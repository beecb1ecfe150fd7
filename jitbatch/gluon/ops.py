"""Batching rules for MXNet NDArray operators applied to lazy arrays.

Each operator family maps a per-sample call onto one call over N samples:
``elemwise`` runs on the flat layout as is; ``reshape`` re-views the flat data;
``stacked`` views each input as ``(N, *per-sample shape)``, shifts the axis
attributes past the new batch axis, and flattens the result. An operator with
no rule still stays lazy: it runs one launch per node at flush time."""
import ast
import ctypes

from mxnet import autograd
from mxnet import ndarray as nd
from mxnet.base import _LIB, OpHandle, c_str, check_call, py_str

from .backend import finish, flat_shape, gather_batch, mode_scope, row_value

_ELEMWISE = set("""
Activation sigmoid tanh relu softsign exp expm1 log log1p log2 log10 sqrt rsqrt cbrt square abs
negative reciprocal sign floor ceil round rint fix trunc sin cos tan arcsin arccos arctan sinh
cosh tanh arcsinh arccosh arctanh erf erfinv gamma gammaln degrees radians clip Cast cast
zeros_like ones_like _copy identity BlockGrad stop_gradient make_loss MakeLoss
elemwise_add elemwise_sub elemwise_mul elemwise_div _plus _minus _mul _div _Plus _Minus _Mul _Div
_grad_add _maximum _minimum _power _hypot _mod
_plus_scalar _minus_scalar _rminus_scalar _mul_scalar _div_scalar _rdiv_scalar _power_scalar
_rpower_scalar _maximum_scalar _minimum_scalar _hypot_scalar _mod_scalar _rmod_scalar
_equal_scalar _not_equal_scalar _greater_scalar _greater_equal_scalar _lesser_scalar
_lesser_equal_scalar _logical_and_scalar _logical_or_scalar _logical_xor_scalar logical_not
add_n ElementWiseSum _equal _not_equal _greater _greater_equal _lesser _lesser_equal
smooth_l1 hard_sigmoid softrelu log_sigmoid mish
""".split())

_BROADCAST = set("""
broadcast_add broadcast_sub broadcast_mul broadcast_div broadcast_plus broadcast_minus
broadcast_maximum broadcast_minimum broadcast_power broadcast_hypot broadcast_mod
broadcast_equal broadcast_not_equal broadcast_greater broadcast_greater_equal
broadcast_lesser broadcast_lesser_equal broadcast_logical_and broadcast_logical_or
broadcast_logical_xor
""".split())

_RESHAPE = {"Reshape", "reshape", "expand_dims", "squeeze", "Flatten", "flatten"}

_REDUCE = {"sum", "mean", "max", "min", "prod", "nansum", "nanprod", "norm", "sum_axis",
           "max_axis", "min_axis", "argmax", "argmin"}

# operator -> (attribute, default, ndim taken from: 'in' input rank, 'out' output rank)
_ONE_AXIS = {
    "softmax": ("axis", -1, "in"), "log_softmax": ("axis", -1, "in"),
    "slice_axis": ("axis", None, "in"), "SliceChannel": ("axis", 1, "in"),
    "split": ("axis", 1, "in"), "flip": ("axis", None, "in"), "reverse": ("axis", None, "in"),
    "sort": ("axis", -1, "in"), "argsort": ("axis", -1, "in"),
    "concat": ("dim", 1, "in"), "Concat": ("dim", 1, "in"),
    "stack": ("axis", 0, "out"),
}

_OP_NAMES = {}


def op_name(handle):
    if not _OP_NAMES:
        plist = ctypes.POINTER(ctypes.c_char_p)()
        size = ctypes.c_uint()
        check_call(_LIB.MXListAllOpNames(ctypes.byref(size), ctypes.byref(plist)))
        for i in range(size.value):
            name = py_str(plist[i])
            hdl = OpHandle()
            check_call(_LIB.NNGetOpHandle(c_str(name), ctypes.byref(hdl)))
            _OP_NAMES[hdl.value] = name
    return _OP_NAMES.get(handle, "op#%d" % handle)


def _parse(v):
    if not isinstance(v, str):
        return v
    try:
        return ast.literal_eval(v)
    except (ValueError, SyntaxError):
        return v


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
    keys = list(keys)
    vals = list(vals)
    for k, v in changes.items():
        if k in keys:
            vals[keys.index(k)] = v
        else:
            keys.append(k)
            vals.append(v)
    return keys, vals


def make_rule(name, keys, vals, in_shapes, out_shapes):
    """``(kind, keys, vals, input ranks)`` for one signature, or None (no rule)."""
    attrs = {k: _parse(v) for k, v in zip(keys, vals)}
    if not in_shapes:
        return None
    nd_in = len(in_shapes[0])
    same = all(s == in_shapes[0] for s in in_shapes)
    if name in _ELEMWISE or (name in _BROADCAST and same):
        if same and all(s == in_shapes[0] for s in out_shapes) and "axes" not in attrs:
            return ("elemwise", keys, vals, None)
        return None
    if name == "Dropout" and not attrs.get("axes"):
        return ("elemwise", keys, vals, None)
    if name in _BROADCAST:
        rank = max(len(s) for s in in_shapes)
        pads = [(1,) * (rank - len(s)) + tuple(s) for s in in_shapes]
        return ("stacked", keys, vals, pads)
    if name in _RESHAPE:
        return ("reshape", keys, vals, None)
    if name in _REDUCE:
        axis = attrs.get("axis", None)
        if axis is None or axis == ():
            if attrs.get("exclude"):
                return None
            axes = tuple(range(nd_in))
            if name in ("argmax", "argmin"):
                return None
        else:
            axes = _norm_axes(axis, nd_in)
            if axes is None:
                return None
        new = tuple(a + 1 for a in axes)
        if attrs.get("exclude"):
            new = (0,) + new
        if name == "norm" and len(new) > 2:
            return None
        if name in ("argmax", "argmin"):
            if len(new) != 1:
                return None
            new = new[0]
        k2, v2 = _shifted(keys, vals, axis=str(new))
        return ("stacked", k2, v2, [tuple(s) for s in in_shapes])
    if name in _ONE_AXIS:
        attr, default, rank_of = _ONE_AXIS[name]
        if name in ("softmax", "log_softmax") and attrs.get("use_length"):
            return None
        axis = attrs.get(attr, default)
        if axis is None:
            return None
        rank = nd_in if rank_of == "in" else len(out_shapes[0])
        axes = _norm_axes(axis, rank)
        if axes is None:
            return None
        new = tuple(a + 1 for a in axes)
        new = new[0] if not isinstance(axis, (tuple, list)) else new
        k2, v2 = _shifted(keys, vals, **{attr: str(new)})
        return ("stacked", k2, v2, [tuple(s) for s in in_shapes])
    if name == "transpose":
        axes = attrs.get("axes") or tuple(reversed(range(nd_in)))
        axes = _norm_axes(axes, nd_in)
        if axes is None:
            return None
        k2, v2 = _shifted(keys, vals, axes=str((0,) + tuple(a + 1 for a in axes)))
        return ("stacked", k2, v2, [tuple(s) for s in in_shapes])
    if name == "slice":
        def pre(t):
            t = attrs.get(t, ())
            t = tuple(t) if isinstance(t, (tuple, list)) else (t,)
            return str((None,) + t).replace("None", "None")
        changes = {"begin": pre("begin"), "end": pre("end")}
        if "step" in attrs:
            changes["step"] = pre("step")
        k2, v2 = _shifted(keys, vals, **changes)
        return ("stacked", k2, v2, [tuple(s) for s in in_shapes])
    return None


class OpExec(object):
    """Runs the nodes of one operator signature."""
    __slots__ = ("handle", "name", "kind", "keys", "vals", "bkeys", "bvals", "pads",
                 "in_meta", "out_meta", "ctx", "mode", "invoke", "checked")
    pad = None      # no zero-padded arguments (see jitbatch.zero_pad)
    stages = False  # no input stage (see gluon/stages.py)
    rounds = False  # launch sizes exact (config.row_buckets: block launches only)

    def __init__(self, handle, name, rule, keys, vals, in_meta, out_meta, ctx,
                 mode, invoke):
        self.handle = handle
        self.name = name
        self.kind = rule[0] if rule else None
        self.keys, self.vals = list(keys), list(vals)
        self.bkeys, self.bvals = (list(rule[1]), list(rule[2])) if rule else (None, None)
        self.pads = rule[3] if rule else None
        self.in_meta = in_meta
        self.out_meta = out_meta
        self.ctx = ctx
        self.mode = mode
        self.invoke = invoke
        self.checked = False

    def _call(self, args, keys, vals):
        out = self.invoke(self.handle, args, keys, vals, None, False, True)
        return out if isinstance(out, list) else [out]

    def launch(self, batch):
        n = len(batch)
        with self.ctx, mode_scope(self.mode):
            if self.kind is None:
                for node in batch:
                    args = [row_value(x) if hasattr(x, "_node") else x for x in node.inputs]
                    outs = self._call(args, self.keys, self.vals)
                    node.row = 0
                    node.group.size = 1
                    finish([node], outs)
                return
            ins = gather_batch(batch)
            if n == 1 or self.kind == "elemwise":
                # one sample's flat layout is its own shape: the call as recorded
                outs = self._call(ins, self.keys, self.vals)
            elif self.kind == "reshape":
                outs = [nd.reshape(ins[0], shape=flat_shape(self.out_meta[0][0], n))]
            else:
                ins = [x.reshape((n,) + pad) for x, pad in zip(ins, self.pads)]
                outs = self._call(ins, self.bkeys, self.bvals)
                outs = [o.reshape(flat_shape(m[0], n)) for o, m in zip(outs, self.out_meta)]
            if not self.checked and n > 1:
                for o, m in zip(outs, self.out_meta):
                    if o.shape != flat_shape(m[0], n):
                        raise AssertionError(
                            "jitbatch bug: batching rule %s of %s gave shape %s for %d samples "
                            "of per-sample shape %s" % (self.kind, self.name, o.shape, n, m[0]))
                self.checked = True
        finish(batch, outs)


def infer_outputs(invoke, handle, metas, keys, vals, ctx):
    """Per-sample output (shape, dtype) list, found by running the op once on zeros."""
    with ctx, autograd.pause(train_mode=False):
        args = [nd.zeros(s, ctx=ctx, dtype=d) for s, d in metas]
        out = invoke(handle, args, keys, vals, None, False, True)
    out = out if isinstance(out, list) else [out]
    return tuple((o.shape, o.dtype) for o in out)
