"""LazyArray: an NDArray look-alike whose value is computed just in time.

``shape``, ``dtype`` and ``context`` are known at record time. Operators and
basic indexing stay lazy; anything that needs the data (``asnumpy``, printing,
``backward``, in-place writes, unknown C-API uses) goes through ``handle``,
which flushes the pending graph and materialises this array's rows."""
import numbers
from threading import get_ident as _get_ident

from mxnet import ndarray as _nd
from mxnet.ndarray import NDArray

from ..errors import StaleValueError
from ..graph import Composite, Ref


class LazyArray(NDArray, Ref):
    """Result of a recorded per-sample call. ``_view`` is None or ``(r0, rc, squeeze)``:
    rows ``r0:r0+rc`` of the producer's per-sample output, axis 0 dropped when
    ``squeeze`` (integer indexing) - views are free, they need no node."""
    __slots__ = ("_node", "_k", "_shape", "_dtype", "_ctx", "_view", "_value")

    def __init__(self, node, k, shape, dtype, ctx, view=None):  # pylint: disable=super-init-not-called
        self._node = node
        self._k = k
        self._shape = shape
        self._dtype = dtype
        self._ctx = ctx
        self._view = view
        self._value = None
        self.writable = True

    def __del__(self):
        pass  # nothing of our own to free; the base class would force the value

    # -- known without computing -------------------------------------------------
    @property
    def shape(self):
        return self._shape

    @property
    def dtype(self):
        return self._dtype

    @property
    def context(self):
        return self._ctx

    @property
    def ctx(self):
        return self._ctx

    @property
    def stype(self):
        return "default"

    @property
    def is_lazy(self):
        """True while the value has not been computed."""
        return self._value is None

    # -- forcing ---------------------------------------------------------------------
    @property
    def handle(self):
        v = self._value
        if v is None:
            v = self._materialize()
        return v.handle

    def _materialize(self):
        node = self._node
        if type(node) is Composite:
            err = node.failed
            if err is not None:
                raise StaleValueError("this lazy array is made of rows of a graph whose "
                                      "execution failed: %s: %s" % (type(err).__name__, err)) from err
            for part in node.parts:
                if type(part) is LazyArray:
                    part.value()
            from .hook import build_composite
            with backend.mode_scope(node.mode):
                v = build_composite(node)
            self._value = v
            return v
        if node.batch is None:
            if node.error is not None:
                raise StaleValueError(
                    "this lazy array (%s, recorded at %s) belongs to a graph that "
                    "failed (while recording or executing): %s: %s. Record the sample "
                    "again."
                    % (node.info.name, node.site or "?", type(node.error).__name__,
                       node.error)) from node.error
            backend.force(node)
        v = backend.row_value(self)
        self._value = v
        g = node.graph
        if (g.retired or g.kept) and not g.executing and g.thread == _get_ident():
            g.release()   # a read: what flushes kept is freed while the kernels run
        return v

    def value(self):
        """The computed NDArray (flushes the pending graph if needed)."""
        if self._value is None:
            self._materialize()
        return self._value

    # -- lazy structure operations ---------------------------------------------------
    def __getitem__(self, key):
        view = backend.row_view(self, key) if type(key) is slice or type(key) is int \
            else backend.row_view(self, key) if isinstance(key, numbers.Integral) else None
        if view is not None:
            return view
        if isinstance(key, (numbers.Integral, slice)):
            key = (key,)
        if isinstance(key, tuple) and all(isinstance(k, (numbers.Integral, slice)) for k in key):
            return _tuple_index(self, key)
        return NDArray.__getitem__(self, key)

    def __setitem__(self, key, value):
        # an in-place write: the array becomes a concrete one of its own (under
        # autograd its computed value is a copy, so later reads must use it)
        self.value()
        self._node = backend.DETACHED
        NDArray.__setitem__(self, key, value)

    def reshape(self, *shape, **kwargs):
        if len(shape) == 1 and isinstance(shape[0], (list, tuple)):
            shape = tuple(shape[0])
        elif not shape:
            shape = tuple(kwargs.pop("shape"))
        return _nd.reshape(self, shape=shape, **kwargs)

    def __repr__(self):
        if self._value is None and (self._node.batch is None or type(self._node) is Composite) \
                and self._node.error is None:
            return "<LazyArray %s %s @%s pending>" % ("x".join(str(s) for s in self._shape),
                                                     self._dtype.__name__ if hasattr(self._dtype, "__name__") else self._dtype,
                                                     self._ctx)
        return NDArray.__repr__(self)

    def __reduce__(self):
        return NDArray.__reduce__(self.value())


def _tuple_index(arr, key):
    """Basic indexing with ints and unit-step slices over several axes, as lazy ops."""
    shape = arr._shape
    if len(key) > len(shape):
        raise IndexError("too many indices (%d) for an array of shape %s" % (len(key), shape))
    begin, end, step, drop = [], [], [], []
    for ax, k in enumerate(key):
        if isinstance(k, slice):
            b, e, s = k.indices(shape[ax])
            begin.append(b)
            end.append(e)
            step.append(s)
        else:
            i = int(k) + (shape[ax] if k < 0 else 0)
            if not 0 <= i < shape[ax]:
                raise IndexError("index %d is out of bounds for axis %d with size %d"
                                 % (k, ax, shape[ax]))
            begin.append(i)
            end.append(i + 1)
            step.append(1)
            drop.append(ax)
    out = _nd.slice(arr, begin=tuple(begin), end=tuple(end), step=tuple(step))
    if drop:
        new_shape = tuple(d for ax, d in enumerate(out.shape) if ax not in drop) or (1,)
        out = _nd.reshape(out, shape=new_shape)
    return out


# backend reads LazyArray's fields by their C layout when compiled (its .pxd
# imports this class when it loads), so the class is defined before it
from . import backend  # noqa: E402
backend.LazyArray = LazyArray
