"""Shape, dtype and device of any argument, asked cheaply on every record.

Every device has ONE ``Device`` object (a ``Context``), shared by every meta and
lazy array: signature keys compare it by identity and hash it from a stored
value (``Context.__eq__`` is Python code and ``Context.__hash__`` builds a tuple
per call)."""
import threading

from mxnet.context import Context

from ..errors import BatchingError
from . import _mxapi
from .lazy import LazyArray, meta_of


class Device(Context):
    """The one Context object of a device. Equal to, and hashed like, any
    Context of the same device."""

    def __init__(self, ctx):
        super(Device, self).__init__(ctx)
        self._hash = hash(ctx)
        self._jb_id = len(_CONTEXTS)   # its number: exact call keys hold this (an int
                                       # hashes in C; this class's __hash__ is Python)

    def __hash__(self):
        return self._hash

    # MXNet's Context keeps the default it replaces on the object, so two
    # nested ``with`` blocks on one object (a block's forward and a launch
    # both enter the device of its input) left the inner one's default
    # behind: this object, shared, keeps one stack per thread
    def __enter__(self):
        local = Context._default_ctx
        if not hasattr(local, "value"):
            local.value = Context("cpu", 0)
        _ENTERED.__dict__.setdefault(self._jb_id, []).append(local.value)
        local.value = self
        return self

    def __exit__(self, ptype, value, trace):
        Context._default_ctx.value = _ENTERED.__dict__[self._jb_id].pop()


_ENTERED = threading.local()   # per thread: Device number -> the defaults it replaced
_CONTEXTS = {}   # Context of a device -> its Device
_DEVICES = {}    # (device type id, device id) -> its Device


def device(ctx):
    """The one Device of ``ctx``'s device."""
    c = _CONTEXTS.get(ctx)
    if c is None:
        c = _CONTEXTS[ctx] = Device(ctx)
    return c


_concrete = {}          # id -> (array, meta): the same concrete array (a zero state,
                        # a constant) is passed to many calls; its meta is asked once
_LAST = [None, None]    # the concrete array meta() saw last, and its meta
#: arrays of at most this many values have their metas cached (see meta)
SMALL = 4096


def meta(a):
    """``(shape, dtype, Device)`` of a lazy or concrete array."""
    if type(a) is LazyArray:
        return meta_of(a)
    last = _LAST
    if a is last[0]:    # the same constant (a zero state) in call after call
        return last[1]
    hit = _concrete.get(id(a))
    if hit is not None and hit[0] is a:
        last[0], last[1] = a, hit[1]
        return hit[1]
    fast = _mxapi.concrete_meta(a)
    if fast is not None:
        shape, dtype, dev = fast
        c = _DEVICES.get(dev)
        if c is None:
            c = _DEVICES[dev] = device(compute_context(a.context))
        m = (shape, dtype, c)
    else:
        m = (a.shape, a.dtype, device(compute_context(a.context)))
    # small arrays only: the cache keeps them alive, and a sample's input of
    # megabytes, dropped by the user, must be freed (at most 512 x SMALL values)
    n = 1
    for d in m[0]:
        n *= d
    if n <= SMALL:
        if len(_concrete) >= 512:
            _concrete.clear()
        _concrete[id(a)] = (a, m)
    return m


#: host memory of another kind (pinned, or shared: ``DataLoader`` workers'
#: batches), which MXNet's operators compute on as the CPU
HOST_MEMORY = ("cpu_pinned", "cpu_shared")


def compute_context(ctx):
    """The device an operator on an array in ``ctx`` computes on: the CPU for
    pinned or shared memory (MXNet: "pinned context doesn't propagate"; an
    operator's output is never pinned nor shared), so such a sample's outputs
    are on the CPU and its calls merge with those of CPU samples."""
    return Context("cpu", ctx.device_id) if ctx.device_type in HOST_MEMORY else ctx


def forget():
    """Drop the cached metas (``uninstall``: no array is kept alive by them)."""
    _concrete.clear()
    _LAST[0] = _LAST[1] = None


def check_ctx(metas, what):
    """The one context of a call's arguments ``metas``; BatchingError naming
    ``what`` if they mix devices."""
    ctx = metas[0][2]
    for i, m in enumerate(metas):
        if m[2] != ctx:
            raise BatchingError(
                "%s: argument %d is on %s but argument 0 is on %s; one call must have all "
                "its arrays on one context. Fix: move it with .as_in_context(%s)."
                % (what, i, m[2], ctx, ctx))
    return ctx
