"""LazyArray: an NDArray look-alike whose value is computed just in time.

``shape``, ``dtype`` and ``context`` are known at record time. Operators and
basic indexing stay lazy; anything that needs the data (``asnumpy``, printing,
``backward``, in-place writes, unknown C-API uses) goes through ``handle``,
which runs the pending graph (``force``) and reads this array's rows of its
launch's output (``row_value``). Views (``x[i]``, ``x[a:b]`` on axis 0) are
free: rows of the producer's output, no node."""
import numbers
import weakref

try:
    import cython   # compiled: lazy arrays are made and freed in C (lazy.pxd)
except ImportError:  # running from source without Cython installed
    from .. import _nocython as cython

import numpy as np
from mxnet import autograd
from mxnet import ndarray as _nd
from mxnet.base import MXNetError
from mxnet.ndarray import NDArray

from .. import execute
from ..errors import BatchingError, StaleValueError
from ..graph import Composite, Graph, Node, Ref, current_graph, recorder
from . import _mxapi
from .interleave import in_sample
from .kept import keeps_recorded, note_read
from .layout import extent
from .modes import mode


class _Detached(object):
    """Stands in as the producer of a lazy array that became concrete (in-place
    write): it is never pending and never part of a batch."""
    batch = ()
    error = None
    depth = 0
    row = -1


DETACHED = _Detached()


class NotDifferentiableError(BatchingError, MXNetError):
    """``backward()`` of a lazy array MXNet cannot differentiate, said in
    jitbatch's terms; an ``MXNetError`` too, as per sample MXNet raises one."""


class LazyArray(NDArray, Ref):
    """Result of a recorded per-sample call. ``_view`` is None or ``(r0, rc, squeeze)``:
    rows ``r0:r0+rc`` of the producer's per-sample output, axis 0 dropped when
    ``squeeze`` (integer indexing) - views are free, they need no node.
    Compiled, lazy arrays are made in C (``lazy.pxd``), which learns the slots
    from this class: a slot added here needs ``__init__`` only."""
    __slots__ = ("_node", "_k", "_shape", "_dtype", "_ctx", "_view", "_value", "_base",
                 "__weakref__")

    def __init__(self, node, k, shape, dtype, ctx, view=None):  # pylint: disable=super-init-not-called
        self._node = node
        self._k = k
        self._shape = shape
        self._dtype = dtype
        self._ctx = ctx
        self._view = view
        self._value = None
        self._base = None    # (array, how): computed, this is MXNet's detach, reshape or
                             # index of that array's value (see track_view)
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
        if self._base is not None:
            return _as_view(self)
        if type(node) is Composite:
            err = node.failed
            if err is not None:
                raise StaleValueError("this lazy array is made of rows of a graph whose "
                                      "execution failed: %s: %s" % (type(err).__name__, err)) from err
            for part in node.parts:
                if type(part) is LazyArray:
                    part.value()
            with _mxapi.mode_scope(node.mode):
                v = composite_value(node, self._shape)
            self._value = v
            self._node = DETACHED   # its parts (and their launches) need not stay alive
            return v
        if node.batch is None:
            if node.error is not None:
                raise StaleValueError(
                    "this lazy array (%s, recorded at %s) belongs to a graph that "
                    "failed (while recording or executing): %s: %s. Record the sample "
                    "again."
                    % (node.info.name, node.site or "?", type(node.error).__name__,
                       node.error)) from node.error
            force(node)
        v = row_value(self)
        self._value = v
        # computed: the value stands alone, so a kept small result does not keep
        # its launch's other outputs (or its node) alive
        self._node = DETACHED
        self._view = None
        g = node.graph
        if node.inputs and g.sharing is None and node.mode[0]:
            note_read(self, node)
        if not g.executing and g.thread == recorder():
            # a read: what flushes kept is freed while the kernels run (also
            # after a flush that a backward forced and released already),
            # unless it keeps recorded nodes for a backward
            if (g.retired or g.kept) and not keeps_recorded(g):
                g.release()
            if _mxapi._HOSTS:  # pylint: disable=protected-access
                _mxapi.release_hosts()
        return v

    def value(self):
        """The computed NDArray (flushes the pending graph if needed)."""
        if self._value is None:
            self._materialize()
        return self._value

    # -- lazy structure operations ---------------------------------------------------
    def __getitem__(self, key):
        if self._value is not None:      # computed: MXNet's own indexing (views where it gives them)
            return NDArray.__getitem__(self._value, key)
        view = row_view(self, key) if type(key) is slice or type(key) is int \
            else row_view(self, key) if isinstance(key, numbers.Integral) else None
        if view is not None:
            return view
        if isinstance(key, (numbers.Integral, slice)):
            key = (key,)
        if isinstance(key, tuple) and all(isinstance(k, (numbers.Integral, slice)) for k in key):
            if _empty_slice(self, key):
                return _empty_index(self, key)
            return _tuple_index(self, key)
        if isinstance(key, NDArray) and key.dtype != np.bool_:
            # MXNet's advanced indexing of axis 0 by one array, as the operators it
            # runs (its own code casts the index with astype and then refuses the
            # lazy result)
            idx = _mxapi.advanced_index_to_array(key, self._shape[0], self._ctx)
            return _nd.gather_nd(self, _nd.expand_dims(idx, axis=0))
        return NDArray.__getitem__(self, key)

    def __setitem__(self, key, value):
        # an in-place write: the array becomes a concrete one of its own (under
        # autograd its computed value is a copy, so later reads must use it)
        detach(self)
        NDArray.__setitem__(self, key, value)

    def backward(self, out_grad=None, retain_graph=False, train_mode=True):
        """``NDArray.backward``; MXNet's 'not in a computational graph' (or 'no
        inputs ... that require gradients') said in jitbatch's terms. A sample
        of ``jitbatch.map`` keeps the graph: its launches are shared with the
        other samples, whose backward() comes next."""
        if not retain_graph and in_sample():
            retain_graph = True
        try:
            return NDArray.backward(self, out_grad, retain_graph, train_mode)
        except MXNetError as e:
            if "not in a computational graph" not in str(e) and \
                    "no inputs in computation graph that require gradients" not in str(e):
                raise
            raise NotDifferentiableError(
                "backward() of this array: MXNet cannot differentiate it, as the launches "
                "that computed it are not in autograd's graph. Either (1) an earlier "
                "backward() freed them: samples merged into one launch share it; or (2) it "
                "depends on the recorded values only through operators without a gradient "
                "(argmax, comparisons, BlockGrad, topk indices), which jitbatch runs "
                "outside autograd (MXNet 1.9.1 crashes otherwise): its gradient is zero; "
                "or (3) it was computed outside autograd.record(). Fix: (1) one backward() "
                "of the summed losses (nd.add_n(*losses).backward()), or retain_graph=True "
                "on every backward() but the last; (2) leave it out of backward(); (3) "
                "compute it inside autograd.record()") from e

    # MXNet writes these three as copies into arrays it allocates (``copyto``),
    # which would run the pending graph; as operators they are recorded and merge
    def astype(self, dtype, copy=True):
        if not copy and np.dtype(dtype) == self._dtype:
            return self
        return _nd.cast(self, dtype=dtype)

    def copy(self):
        return _nd.identity(self)

    def detach(self):
        node = self._node
        if self._value is not None or node is DETACHED or type(node) is Composite or \
                self._base is not None:
            return NDArray.detach(self.value())
        if autograd.is_recording() or node.mode[0]:
            # values unchanged, no gradient: what MXNet's detach gives a later
            # operator (a BlockGrad recorded outside autograd.record, as MXNet's
            # detach is outside its graph: a backward reaches nothing behind
            # it, history.stopped_params); a write to it or to this array makes
            # it MXNet's detach of the value
            with autograd.pause(train_mode=autograd.is_training()):
                out = _nd.BlockGrad(self)
            if type(out) is LazyArray:
                track_view(out, self, None)
            return out
        # computed outside autograd, there is no gradient to cut: the same rows,
        # and like MXNet's detach a view of them (a write shows through both)
        return new_lazy(node, self._k, self._shape, self._dtype, self._ctx, self._view)

    def reshape(self, *shape, **kwargs):
        """MXNet's reshape is a view: computed, this is MXNet's reshape of the
        value; pending, a recorded ``Reshape`` (it merges), which a write to
        it or to this array first makes MXNet's view of this array's value
        (``track_view``)."""
        if len(shape) == 1 and isinstance(shape[0], (list, tuple)):
            shape = tuple(shape[0])
        elif not shape:
            shape = tuple(kwargs.pop("shape"))
        if not all(type(d) is int and (d > 0 or d == -1) for d in shape) or \
                kwargs.get("reverse"):
            shape = _mxapi.resolved_shape(self._shape, shape, bool(kwargs.pop("reverse", False)))
        _check_size(self._shape, shape)
        node = self._node
        if self._value is not None or node is DETACHED or \
                (type(node) is Node and node.batch is not None):
            return NDArray.reshape(self.value(), shape, **kwargs)
        # (a target counting the rows is recorded with axis 0 copied:
        # opkeys.reshape_rows, as for every Reshape call)
        out = _nd.reshape(self, shape=shape, **kwargs)
        if type(out) is LazyArray:
            track_view(out, self, out._shape)
        return out

    def __repr__(self):
        if self._value is None and (self._node.batch is None or type(self._node) is Composite) \
                and self._node.error is None:
            return "<LazyArray %s %s @%s pending>" % ("x".join(str(s) for s in self._shape),
                                                     self._dtype.__name__ if hasattr(self._dtype, "__name__") else self._dtype,
                                                     self._ctx)
        return NDArray.__repr__(self)

    def __str__(self):
        # printing is a forcing point: it shows the values, as plain Gluon prints
        return NDArray.__repr__(self.value())

    def __reduce__(self):
        return NDArray.__reduce__(self.value())


if cython.compiled:
    jb_lazy_type(LazyArray)  # noqa: F821 (compiled only: lazy.pxd's maker learns the slots)


def _check_size(have, shape):
    """Refuse ``reshape`` of an array of shape ``have`` into ``shape`` (plain
    sizes and one -1; MXNet's special codes are resolved first) where the
    sizes differ, as ``NDArray.reshape`` does: MXNet's ``Reshape`` operator,
    which records it, reads past the rows instead."""
    if not all(type(d) is int and (d > 0 or d == -1) for d in shape) or shape.count(-1) > 1:
        return
    size = known = 1
    for d in have:
        size *= d
    for d in shape:
        if d > 0:
            known *= d
    if (known != size) if -1 not in shape else (size % known != 0):
        raise MXNetError(
            "cannot reshape a lazy array of shape %s (%d values) into shape %s: the sizes "
            "differ (NDArray.reshape refuses it too). Fix: give a shape with %d values, or "
            "-1 for one axis." % (tuple(have), size, tuple(shape), size))


def new_lazy(node, k, shape, dtype, ctx, view=None):
    """``LazyArray(node, k, shape, dtype, ctx, view)``; compiled, made in C with
    every field set at once (no Python call per field)."""
    if cython.compiled:
        return jb_new_lazy(LazyArray, node, k, shape, dtype, ctx, view)  # noqa: F821
    return LazyArray(node, k, shape, dtype, ctx, view)


# A lazy array's fields, read per argument of every record and per row of every
# gathered input: compiled, at the slot's offset (lazy.pxd), where an attribute
# read walks the type's lookup and its descriptor.
def node_of(la):
    """``la._node`` of LazyArray ``la``."""
    if cython.compiled:
        return jb_lz_slot(la, 0)  # noqa: F821
    return la._node


def k_of(la):
    """``la._k``: which output of its node."""
    if cython.compiled:
        return jb_lz_slot(la, 1)  # noqa: F821
    return la._k


def shape_of(la):
    """``la._shape``."""
    if cython.compiled:
        return jb_lz_slot(la, 2)  # noqa: F821
    return la._shape


def view_of(la):
    """``la._view``: None or its row range of the producer's output."""
    if cython.compiled:
        return jb_lz_slot(la, 5)  # noqa: F821
    return la._view


def value_of(la):
    """``la._value``: its concrete array, None while lazy."""
    if cython.compiled:
        return jb_lz_slot(la, 6)  # noqa: F821
    return la._value


def meta_of(la):
    """``(shape, dtype, device)`` of LazyArray ``la``."""
    if cython.compiled:
        return jb_lz_slot(la, 2), jb_lz_slot(la, 3), jb_lz_slot(la, 4)  # noqa: F821
    return la._shape, la._dtype, la._ctx


def detach(arr):
    """Make lazy ``arr`` a concrete array of its own (before an in-place write)."""
    arr.value()
    arr._node = DETACHED


# -- arrays that read others' memory when computed ----------------------------------
# A composite reads its parts when it is computed, and a reshape or detach of a
# pending lazy array is a recorded operator (a copy, so that it merges) where
# MXNet's is a view. Either is exact only while nothing it reads is written in
# place: the thread's graph keeps weak references to them (``Graph.aliased``),
# and a write (``writes.before_aliased_write``) first computes those that read the
# written memory: a composite becomes the copy MXNet's concat/stack made, a
# reshape or detach becomes MXNet's view of its source's value.
def track(g, la):
    """Keep lazy array ``la`` (a composite or a view) in graph ``g``'s list."""
    gr: Graph = g
    refs = gr.aliased
    if cython.compiled:
        refs.append(PyWeakref_NewRef(la, None))  # noqa: F821 (compiled only: lazy.pxd)
    else:
        refs.append(weakref.ref(la))
    if len(refs) >= gr.aliased_cap:
        live = []
        for r in refs:
            x = r()
            if x is not None and value_of(x) is None:
                live.append(r)
        gr.aliased = live
        gr.aliased_cap = max(1024, 2 * len(live))


def track_view(out, src, shape):
    """``out`` (a recorded copy of lazy ``src``) is MXNet's view of it: its
    detach (``shape`` None), its reshape into ``shape``, or its basic
    indexing by ``shape.key`` (an ``_Index``)."""
    out._base = (src, shape)
    track(current_graph(), out)


def _as_view(la):
    """Compute view ``la`` as MXNet's detach, reshape or index of its source's
    value (the value its recorded operator computed is a copy: after a write
    to either, they would differ)."""
    src, shape = la._base
    v = src.value()
    if shape is None:
        v = NDArray.detach(v)
    else:
        with _mxapi.mode_scope(la._node.mode):
            v = NDArray.__getitem__(v, shape.key) if type(shape) is _Index else \
                _mxapi.reshape(v, shape)
    la._value = v
    la._node = DETACHED
    la._view = None
    la._base = None
    return v


# -- views -----------------------------------------------------------------------------
def row_view(arr, key):
    """``x[i]`` / ``x[a:b]`` of lazy array ``arr`` along axis 0 as a free view
    (rows of its producer's output: no node), or None if not that case
    (``LazyArray.__getitem__`` then records an operator)."""
    shape = shape_of(arr)
    n = shape[0]
    if type(key) is not slice:
        i = int(key)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("index %d is out of bounds for axis 0 with size %d" % (key, n))
        squeeze = len(shape) > 1          # MXNet 1.x: a 1-D array indexed gives shape (1,)
        return _view(arr, i, 1, squeeze, shape[1:] if squeeze else (1,))
    if key.step is None or key.step == 1:
        start, stop, _ = key.indices(n)
        if stop <= start:
            return None
        return _view(arr, start, stop - start, False, (stop - start,) + shape[1:])
    return None


def _view(arr, r0, rc, squeeze, new_shape):
    view = view_of(arr)
    if view is not None:
        pr0, _, psq = view
        if psq:
            return None  # a view of a squeezed view is not a row range of the producer
        r0 = pr0 + r0
    node = node_of(arr)
    if node is DETACHED or type(node) is Composite:
        return None
    if type(node) is Node:
        n: Node = node
        if n.mode[0] and not mode(current_graph())[0]:
            # taken outside autograd.record (under pause) of rows recorded under
            # it: per sample MXNet's view is then outside autograd's graph and
            # passes no gradient; a free view would be gathered with the
            # gradient. The caller records the slice, which runs outside autograd
            return None
    _, dtype, ctx = meta_of(arr)
    return new_lazy(node, k_of(arr), new_shape, dtype, ctx, (r0, rc, squeeze))


def _empty_slice(arr, key):
    """Whether basic index ``key`` (ints and slices) selects nothing along an axis."""
    shape = arr._shape
    for ax, k in enumerate(key):
        if type(k) is slice and ax < len(shape) and not len(range(*k.indices(shape[ax]))):
            return True
    return False


def _empty_index(arr, key):
    """``arr[key]`` where ``key`` selects nothing along an axis, as MXNet gives
    it: an empty array along axis 0, an MXNetError along any other (MXNet 1.x
    reads a 0 there as an unknown size). Either way the answer does not depend
    on ``arr``'s values, so the index runs at once on zeros of its shape: no
    operator is recorded that would hand a merged launch an empty array."""
    _, dtype, ctx = meta_of(arr)
    return NDArray.__getitem__(_nd.zeros(arr._shape, ctx=ctx, dtype=dtype), key)


def _tuple_index(arr, key):
    """Basic indexing with ints and unit-step slices over several axes, as lazy ops."""
    shape = arr._shape
    if len(key) > len(shape):
        raise IndexError("too many indices (%d) for an array of shape %s" % (len(key), shape))
    begin, end, step, drop = [], [], [], []
    for ax, k in enumerate(key):
        if isinstance(k, slice):
            b, e, s = k.indices(shape[ax])
            if s == 1 and b == 0 and e == shape[ax]:
                # a whole axis is named without its length, so that calls over
                # sequences of any length share a signature (opkeys.rowwise)
                b = e = None
            begin.append(b)
            # a negative step running past index 0 stops at -1, which MXNet's
            # slice reads as the last element: its "before the first" is None
            end.append(None if s < 0 and e < 0 else e)
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
    if drop and len(drop) < len(shape):
        # squeeze, not a reshape to the kept lengths: no length in the attributes
        out = _nd.squeeze(out, axis=tuple(drop))
    elif drop:
        out = _nd.reshape(out, shape=(1,))    # MXNet 1.x: every axis indexed gives (1,)
    if type(out) is LazyArray and value_of(arr) is None:
        # recorded copies; MXNet's indexing may give a view: a write to either
        # first makes it MXNet's indexing of the source's value
        track_view(out, arr, _Index(key))
    return out


class _Index(object):
    """A basic-indexing key (ints and slices) a tracked view was taken with."""
    __slots__ = ("key",)

    def __init__(self, key):
        self.key = key


# -- composites (values made of other values' rows) ----------------------------------
def parts_of(v, out):
    """Append the values a composite lazy array ``v`` is made of (through
    nested composites)."""
    for part in node_of(v).parts:
        if type(part) is LazyArray and type(node_of(part)) is Composite:
            parts_of(part, out)
            continue
        out.append(part)


def composite_value(comp, shape):
    """The value of a composite read on its own (of ``shape``): its parts'
    rows side by side, one concat along axis 0 (MXNet's generated operator
    wrapper costs more than the call: a sample's output is often one)."""
    args = [row_value(a) if type(a) is LazyArray else a for a in comp.parts]
    out = _mxapi.concat(args)
    return out if out.shape == shape else _mxapi.reshape(out, shape)


# -- reading ----------------------------------------------------------------------------
def row_value(v):
    """Concrete NDArray of one lazy value (its rows of the producer's launch)."""
    node = v._node
    if node is DETACHED:
        return v._value
    if v._value is not None:
        return v._value
    if type(node) is Composite:
        return v.value()
    src = node.batch[v._k]
    start, count, _ = extent(node, v._k)
    if v._view is not None:
        start += v._view[0]
        count = v._view[1]
    if node.mode[0]:
        with _mxapi.mode_scope(node.mode):
            if start == 0 and count == src.shape[0]:
                out = src
            else:
                out = _mxapi.slice_rows(src, start, start + count)
            if out.shape != v._shape:
                out = _mxapi.reshape(out, v._shape)
        return out
    out = src if (start == 0 and count == src.shape[0]) else _mxapi.rows(src, start, start + count)
    if out.shape != v._shape:
        out = _mxapi.reshape(out, v._shape)
    return out


def force(node):
    """Make ``node`` computed: run its graph (in its own thread)."""
    if not _mxapi.hooked():
        raise StaleValueError(
            "this lazy array (%s, recorded at %s) was still pending when "
            "jitbatch.uninstall() ran; nothing can compute it now. Fix: call "
            "jitbatch.flush() (or read the values) before uninstalling." % (node.info.name, node.site))
    g = node.graph
    g.check_thread()
    if g.sharing is not None:   # jitbatch.map: the other samples record first
        g.sharing.wait(node)
        if node.batch is not None:
            return
    execute.run_graph(g, forced=True, reason="read")
    if node.batch is None:
        if node.error is not None:
            raise StaleValueError("the graph of this lazy array failed: %s" % node.error) from node.error
        raise StaleValueError("this lazy array was not computed by its graph's flush "
                              "(it was recorded while that graph was executing)")
