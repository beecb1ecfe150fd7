"""Arithmetic on lazy arrays: ``x + y`` straight to MXNet's operator entry point.

On an NDArray, ``x + y`` goes through ``NDArray.__add__``, ``nd.add``,
``_ufunc_helper`` and the generated operator function (argument checks,
attribute lists) before it reaches ``_imperative_invoke``, where jitbatch
records it; per-sample code does such arithmetic at every step. A lazy
array's ``+ - * /`` and unary ``-`` make the very call MXNet would make
(operator, arrays in its order, attribute names and values) and hand it to
the entry point at once: the same node, signature and values, fewer Python
frames. Any operand other than a plain or lazy NDArray or a number, and any
operator function another library has wrapped, takes MXNet's own path (its
errors, the wrapper's casts included)."""
from mxnet.base import numeric_types
from mxnet.ndarray import NDArray
from mxnet.ndarray import _internal, op as _op

from . import _mxapi
from .lazy import LazyArray

#: method -> (operator on two arrays, on (array, scalar), whether the array
#: is the right-hand operand): as ``nd.add``/``subtract``/``multiply``/``divide``
#: choose them (``_ufunc_helper``)
_METHODS = {
    "__add__": ("broadcast_add", "_plus_scalar", False),
    "__radd__": ("broadcast_add", "_plus_scalar", True),
    "__sub__": ("broadcast_sub", "_minus_scalar", False),
    "__rsub__": ("broadcast_sub", "_rminus_scalar", True),
    "__mul__": ("broadcast_mul", "_mul_scalar", False),
    "__rmul__": ("broadcast_mul", "_mul_scalar", True),
    "__truediv__": ("broadcast_div", "_div_scalar", False),
    "__rtruediv__": ("broadcast_div", "_rdiv_scalar", True),
}

_OPS, _INTERNAL = _op.__dict__, _internal.__dict__
_WRAPPED = object()


def _generated(functions, name):
    """MXNet's generated operator function ``name`` (MXNet compiles them from
    strings), or a marker no function is where another library has wrapped it
    (``amp.init`` inserts casts there): calls then take MXNet's path, through
    the wrapper. Checked again at every call, as a wrapper may come later."""
    f = functions[name]
    return f if _mxapi.generated(f) else _WRAPPED


def _method(name, arrays, scalar, right, invoke):
    """``LazyArray.<name>``, calling ``invoke`` (MXNet's operator entry point,
    as jitbatch patches it)."""
    h_arrays, h_scalar = _mxapi.op_handle(arrays), _mxapi.op_handle(scalar)
    f_arrays, f_scalar = _generated(_OPS, arrays), _generated(_INTERNAL, scalar)
    mxnet_own = getattr(NDArray, name)

    def method(self, other):
        t = type(other)
        if t is LazyArray or t is NDArray:
            if _OPS[arrays] is f_arrays:
                return invoke(h_arrays, [other, self] if right else [self, other], [], [],
                              None, False, False)
        elif isinstance(other, numeric_types) and _INTERNAL[scalar] is f_scalar:
            return invoke(h_scalar, [self], ["scalar"], [float(other)], None, False, False)
        return mxnet_own(self, other)
    method.__name__ = name
    method.__doc__ = mxnet_own.__doc__
    return method


def methods(invoke):
    """``{name: method}`` of the arithmetic to set on :class:`LazyArray`."""
    out = {name: _method(name, *spec, invoke=invoke) for name, spec in _METHODS.items()}
    h_mul, f_mul = _mxapi.op_handle("_mul_scalar"), _generated(_INTERNAL, "_mul_scalar")

    def __neg__(self):
        if _INTERNAL["_mul_scalar"] is f_mul:
            return invoke(h_mul, [self], ["scalar"], [-1.0], None, False, False)
        return NDArray.__neg__(self)
    __neg__.__doc__ = NDArray.__neg__.__doc__
    out["__neg__"] = __neg__
    return out
