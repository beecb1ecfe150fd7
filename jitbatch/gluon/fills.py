"""``nd.zeros`` / ``nd.ones`` while a graph is pending: straight to the recorded creation.

``nd.zeros`` (and Gluon's ``begin_state``, which calls it) reaches MXNet's
generated ``_internal._zeros``, which turns the dtype into its name with
NumPy at every call and then calls the operator entry point, where jitbatch
records the creation (``record.record_filled``): per sample, an RNN's first
state pays this once per sequence. The shims below make the same attribute
names and values (the dtype's name kept per dtype) and hand them to
``record_filled`` directly; with nothing pending, an output array, or a
dtype NumPy does not know, they call MXNet's function."""
import numpy as np
from mxnet.base import _Null

from ..graph import Graph, current_graph
from .record import record_filled

_NAMES = {}     # dtype as passed -> the attribute value MXNet's generated code makes of it


def _dtype_value(dtype):
    """MXNet's attribute value for ``dtype`` (its name; a structured dtype's
    first field), or None where NumPy refuses it or it cannot be a key."""
    try:
        v = _NAMES.get(dtype)
    except TypeError:
        return None
    if v is None:
        try:
            d = np.dtype(dtype)
        except (TypeError, ValueError):
            return None
        v = d.names[0] if d.names else d.name
        if len(_NAMES) < 256:
            _NAMES[dtype] = v
    return v


def fill_shim(orig, handle):
    """``orig`` (MXNet's generated ``_internal._zeros`` or ``_ones``, operator
    ``handle``) with pending creations recorded without its frame."""
    def fill(shape=_Null, ctx=_Null, dtype=_Null, out=None, name=None, **kwargs):
        if out is None:
            g: Graph = current_graph()
            if g.nodes and not g.executing:
                keys, vals = list(kwargs), list(kwargs.values())
                if shape is not _Null:
                    keys.append("shape")
                    vals.append(shape)
                if ctx is not _Null:
                    keys.append("ctx")
                    vals.append(ctx)
                ok = True
                if dtype is not _Null:
                    dv = _dtype_value(dtype)
                    ok = dv is not None
                    keys.append("dtype")
                    vals.append(dv)
                if ok:
                    res = record_filled(g, handle, keys, vals)
                    if res is not None:
                        return res
        return orig(shape=shape, ctx=ctx, dtype=dtype, out=out, name=name, **kwargs)
    fill.__name__ = orig.__name__
    fill.__doc__ = orig.__doc__
    fill.__wrapped__ = orig
    return fill
