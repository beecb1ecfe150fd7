"""Every raw touch of MXNet: its originals captured once, its C API, its op table.

Everything above this module speaks to MXNet through these names, so what
jitbatch relies on in MXNet's internals can be read in one place. The
originals are taken when jitbatch is first imported, before ``patch`` replaces
them. When compiled, the flush's gathers and the record's metadata reads call
MXNet's C API directly (see ``_mxapi.pxd``): MXNet's Python wrappers around
those calls (ctypes buffers, argument checks, a Context built per call) cost
more than the calls themselves."""
import atexit
import ctypes
import threading

try:
    import cython   # compiled: the .pxd's C functions are used where cython.compiled
except ImportError:  # running from source without Cython installed
    from .. import _nocython as cython

import numpy as np
from mxnet import autograd
from mxnet.context import Context, cpu, current_context
from mxnet import ndarray as nd
from mxnet.base import (MXNetError, NDArrayHandle, OpHandle, SymbolHandle, _LIB, c_array, c_str,
                        c_str_array, check_call, mx_uint, py_str)
from mxnet.contrib import autograd as contrib_autograd
from mxnet.gluon.block import Block, HybridBlock
from mxnet.gluon.rnn.rnn_cell import RecurrentCell, ZoneoutCell
from mxnet.gluon.contrib.rnn import VariationalDropoutCell
from mxnet.ndarray import CachedOp, NDArray
from mxnet.ndarray import ndarray as _nd_impl
from mxnet.ndarray import register
from mxnet.symbol import Symbol, var
from mxnet.util import _NumpyArrayScope, is_np_shape, set_np_shape

#: Held while jitbatch pushes operations that touch arrays other threads use too
#: (a launch reads the parameters; a backward writes their gradients; a step writes
#: them): MXNet's engine queues a pushed operation on its arrays one at a time, so
#: two threads pushing at once can each get ahead on one of two shared arrays and
#: wait for the other forever, every engine worker idle. Re-entrant: a backward of
#: a pending head flushes inside it.
PUSHING = threading.RLock()

# -- originals, captured before jitbatch patches them ----------------------------------
#: the entry point of every generated imperative operator (``mx.nd.*``)
invoke = register._imperative_invoke  # pylint: disable=protected-access
#: the check every generated legacy operator runs on its arguments first
verify_legacy = register._verify_all_legacy_ndarrays  # pylint: disable=protected-access
block_call = Block.__call__
hybrid_forward = HybridBlock.forward
block_hybridize = Block.hybridize
hybrid_hybridize = HybridBlock.hybridize
clear_cached_op = HybridBlock._clear_cached_op  # pylint: disable=protected-access
get_graph = HybridBlock._get_graph  # pylint: disable=protected-access
recurrent_forward = RecurrentCell.forward
#: cells that keep Python state between step calls (the previous output, a mask
#: drawn once per sequence): a traced graph freezes it (plain hybridize() too)
STATEFUL_CELLS = (ZoneoutCell, VariationalDropoutCell)
nd_stack = nd.stack
nd_array = nd.array
copyto = NDArray.copyto
waitall = nd.waitall
to_dlpack_for_write = nd.to_dlpack_for_write
nd_setitem = NDArray.__setitem__
#: MXNet's index arrays of advanced indexing (it casts them with ``astype``)
advanced_index_to_array = NDArray._advanced_index_to_array  # pylint: disable=protected-access
#: MXNet's autograd-state setters, as (module, names): every Python scope that
#: changes the state (record, pause, train_mode, predict_mode) goes through them
AUTOGRAD_SETTERS = ((autograd, ("set_recording", "set_training")),
                    (contrib_autograd, ("set_is_training",)))


def hooked():
    """Whether jitbatch's operator hook is in place (``patch.install``)."""
    return register._imperative_invoke is not invoke  # pylint: disable=protected-access


# -- operators ---------------------------------------------------------------------------
_OP_NAMES = {}     # op handle -> its registered (not alias) name
_HANDLES = {}      # name or alias -> op handle


def _op_table():
    plist = ctypes.POINTER(ctypes.c_char_p)()
    size = ctypes.c_uint()
    check_call(_LIB.MXListAllOpNames(ctypes.byref(size), ctypes.byref(plist)))
    for i in range(size.value):
        name = py_str(plist[i])
        hdl = OpHandle()
        check_call(_LIB.NNGetOpHandle(c_str(name), ctypes.byref(hdl)))
        _HANDLES[name] = hdl.value
    for hdl in set(_HANDLES.values()):
        _OP_NAMES[hdl] = _registered_name(hdl)


def _registered_name(handle):
    """The name operator ``handle`` is registered under. Its aliases share the
    handle and MXNet lists them in no fixed order: taking the last listed
    named ``Activation`` ``_npx_activation``, so tables keyed by the
    registered name (batching rules, gradients) missed it."""
    name, desc, kv, ret = (ctypes.c_char_p() for _ in range(4))
    num = ctypes.c_uint()
    names, types, descs = (ctypes.POINTER(ctypes.c_char_p)() for _ in range(3))
    check_call(_LIB.MXSymbolGetAtomicSymbolInfo(
        ctypes.c_void_p(handle), ctypes.byref(name), ctypes.byref(desc), ctypes.byref(num),
        ctypes.byref(names), ctypes.byref(types), ctypes.byref(descs), ctypes.byref(kv),
        ctypes.byref(ret)))
    return py_str(name.value)


def _atomic(handle, keys, vals, count):
    """Operator ``handle`` with attributes ``keys`` / ``vals`` as a symbol on
    ``count`` variables ``in0``, ``in1``, ..."""
    sym_handle = SymbolHandle()
    check_call(_LIB.MXSymbolCreateAtomicSymbol(
        ctypes.c_void_p(handle), mx_uint(len(keys)), c_str_array(list(keys)),
        c_str_array([str(v) for v in vals]), ctypes.byref(sym_handle)))
    sym = Symbol(sym_handle)
    sym._compose(*[var("in%d" % i) for i in range(count)], name="trial")  # pylint: disable=protected-access
    return sym


def infer_by_symbol(handle, metas, keys, vals):
    """Per-sample output (shape, dtype) list of operator ``handle`` on inputs
    of ``metas`` ((shape, dtype) pairs) by MXNet's symbolic inference, without
    running it; None where that infers nothing."""
    names = ["in%d" % i for i in range(len(metas))]
    try:
        # (the methods under infer_shape / infer_type: those warn the user where
        # inference is partial, a value-shaped operator's, and print on errors)
        sym = _atomic(handle, keys, vals, len(metas))
        _, shapes, _ = sym._infer_shape_impl(  # pylint: disable=protected-access
            False, **{n: tuple(m[0]) for n, m in zip(names, metas)})
        _, dtypes, _ = sym._infer_type_impl(  # pylint: disable=protected-access
            False, **{n: np.dtype(m[1]) for n, m in zip(names, metas)})
    except MXNetError:
        return None
    if not shapes or not dtypes or any(s is None or d is None for s, d in zip(shapes, dtypes)):
        return None
    return tuple((tuple(s), d) for s, d in zip(shapes, dtypes))


_AUX = {}   # (handle, keys, vals, input count) -> how many inputs are auxiliary states


def aux_states(handle, keys, vals, count):
    """How many of the ``count`` inputs of a call of operator ``handle`` are
    auxiliary states (the last ones): arrays it may write as it runs, as a
    custom operator's running mean; 0 where MXNet names none."""
    key = (handle, tuple(keys), tuple(str(v) for v in vals), count)
    n = _AUX.get(key)
    if n is None:
        try:
            n = len(_atomic(handle, keys, vals, count).list_auxiliary_states())
        except MXNetError:
            n = 0
        _AUX[key] = n
    return n


def op_name(handle):
    """The registered name of the operator ``handle`` (the same whichever alias
    the program called it by)."""
    if not _OP_NAMES:
        _op_table()
    return _OP_NAMES.get(handle, "op#%d" % handle)


def op_handles():
    """Every operator name and alias -> its handle."""
    if not _HANDLES:
        _op_table()
    return dict(_HANDLES)


def op_handle(name):
    """The handle of operator ``name``."""
    if not _HANDLES:
        _op_table()
    return _HANDLES[name]


def generated(f):
    """Whether ``f`` is one of MXNet's generated operator functions (compiled
    from strings), not a wrapper another library put in its place
    (``amp.init`` inserts casts there)."""
    code = getattr(f, "__code__", None)
    return code is not None and code.co_filename == "<string>"


def memory_span(arr):
    """``(first byte, past the last)`` of a dense NDArray's memory (a view's:
    within the array it views), or None (sparse, or none allocated)."""
    if arr.stype != "default":
        return None
    # an operator's output gets its memory when the engine's worker runs the
    # operator; MXNDArrayGetData allocates it too if it has none yet, racing
    # that worker: the array could keep a buffer no kernel writes (garbage
    # values later). The producer is waited for first.
    arr.wait_to_read()
    ptr = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(arr.handle, ctypes.byref(ptr)))
    if not ptr.value:
        return None
    return ptr.value, ptr.value + arr.size * np.dtype(arr.dtype).itemsize


def wait_to_write(arr):
    """Wait until every pending operation that reads or writes ``arr`` is done."""
    check_call(_LIB.MXNDArrayWaitToWrite(arr.handle))


def dtype_name(dtype):
    """MXNet's name of ``dtype``: NumPy's, but 'bfloat16' for MXNet's bfloat16
    (a structured NumPy dtype, whose NumPy name is 'void16')."""
    d = np.dtype(dtype)
    return "bfloat16" if d.names == ("bfloat16",) else d.name


def dtype_key(dtype):
    """What jitbatch keeps as an array's dtype: the NumPy scalar type, or the
    dtype itself for MXNet's bfloat16 (its scalar type, numpy.void, would lose it)."""
    d = np.dtype(dtype)
    return d if d.names else d.type


def trial(shape, ctx, dtype, second=False, divides=True):
    """An array to run a kernel on once to learn its output shapes: zeros
    (``second``: ones); where ``dtype`` is an integer type and the kernel may
    divide by it (``divides``), 1 (2): an integer division by zero kills the
    process (SIGFPE) where plain Gluon, on the sample's values, divides by none."""
    if divides and np.issubdtype(np.dtype(dtype), np.integer):
        return invoke(op_handle("_full"), [], ["shape", "ctx", "dtype", "value"],
                      [tuple(shape), ctx, dtype_name(dtype), "2" if second else "1"],
                      None, False, False)
    return zeros(shape, ctx, dtype, "_ones" if second else "_zeros")


#: operators whose integer kernels trap on a zero divisor (their others do not)
INT_DIVISIONS = ("broadcast_div", "elemwise_div", "_div")


def zeros(shape, ctx, dtype, fill="_zeros"):
    """A concrete zero array (``fill="_ones"``: ones), made through MXNet's own
    operator entry point: the patched one records ``nd.zeros`` while a graph
    is pending, and jitbatch's own zeros (shape inference, padding) must exist
    at once."""
    return invoke(op_handle(fill), [], ["shape", "ctx", "dtype"],
                  [tuple(shape), ctx, dtype_name(dtype)], None, False, False)


_CPU = cpu()
_RESOLVED = {}   # (shape, target with MXNet's special codes, reverse) -> plain target


def resolved_shape(have, shape, reverse):
    """``shape`` with MXNet's special codes (0, -2, -3, -4; ``reverse``)
    resolved for an array of shape ``have``, by ``NDArray.reshape`` itself on
    a stand-in array: where the sizes differ it raises plain Gluon's error
    (MXNet's ``Reshape`` operator, which records the call, checks nothing)."""
    key = (tuple(have), tuple(shape), reverse)
    out = _RESOLVED.get(key)
    if out is None:
        stand_in = zeros(tuple(have), _CPU, "float32")
        out = _RESOLVED[key] = NDArray.reshape(stand_in, tuple(shape), reverse=reverse).shape
    return out


#: dtypes a host array is wrapped in without a copy (DLPack; MXNet's own table)
_DL_TYPES = {np.dtype(t): _nd_impl.DLDataType.TYPE_MAP[t]
             for t in ("float16", "float32", "float64", "uint8", "int32", "int64")}
#: (host data, its copy) pairs whose copies may still be pending (see host_array)
_HOSTS = []
_HOSTS_LOCK = threading.Lock()
#: pairs kept at most: past it the older half is freed, their copies long done
#: (a loop that never reads a value must not keep one per flush for ever)
HOSTS_KEPT = 64


def host_array(data, ctx, dtype):
    """NumPy ``data`` as a new NDArray of ``dtype`` on ``ctx``, without waiting.

    ``nd.array`` copies synchronously: its copy waits behind every kernel MXNet
    has queued, so Python stops where it should run ahead of the kernels.
    Instead the host memory is wrapped without a copy (DLPack) and copied into
    MXNet's own memory by an ordinary asynchronous engine op. The wrapper has
    no deleter: ``nd.from_numpy``'s frees the NumPy array by a Python callback
    from whichever thread drops the wrapper last, often an engine thread, which
    then waits for the GIL (and every kernel queued behind it waits too).
    This module keeps ``data`` instead, until ``release_hosts`` has seen the
    copy done. ``data`` must be jitbatch's own (NumPy marks it read-only)."""
    data = np.ascontiguousarray(data, dtype=dtype)
    code = _DL_TYPES.get(data.dtype)
    if code is None or not data.ndim:
        return nd_array(data, ctx=ctx, dtype=dtype)
    data.flags.writeable = False
    managed = _nd_impl.DLManagedTensor()
    tensor = managed.dl_tensor
    tensor.data = data.ctypes.data
    tensor.ctx = _nd_impl.DLContext(1, 0)
    tensor.ndim = data.ndim
    tensor.dtype = _nd_impl.DLDataType(*code)
    shape = data.ctypes.shape_as(ctypes.c_int64)
    tensor.shape = shape
    handle = NDArrayHandle()
    # transient: MXNet copies the struct and reads the shape now; deleter NULL
    check_call(_LIB.MXNDArrayFromDLPackEx(ctypes.byref(managed), True, ctypes.byref(handle)))
    host = NDArray(handle=handle)
    out = nd.empty(data.shape, ctx=ctx, dtype=data.dtype)
    # (MXNet's own entry point: a fresh array is no write the hook must check)
    invoke(op_handle("_copyto"), [host], [], [], out, False, False)
    with _HOSTS_LOCK:
        _HOSTS.append((data, out))
        full = len(_HOSTS) > HOSTS_KEPT
    if full:
        release_hosts(HOSTS_KEPT // 2)
    return out


def release_hosts(count=None):
    """Let go of the host data of ``host_array`` (waiting for copies not done
    yet), the oldest ``count`` or all: called where the thread waits for
    kernels anyway (a read), when more than ``HOSTS_KEPT`` are kept, and at
    exit."""
    with _HOSTS_LOCK:
        n = len(_HOSTS) if count is None else min(count, len(_HOSTS))
        hosts = _HOSTS[:n]
        del _HOSTS[:n]
    for _, out in hosts:
        out.wait_to_read()
    del hosts


@atexit.register
def _release_at_exit():
    # before MXNet's own exit hook (registered earlier, so run later): no copy
    # may still read host data the interpreter's shutdown frees
    waitall()
    release_hosts()


def run_op(handle, args, keys, vals):
    """Operator ``handle`` on NDArrays ``args``: a list of its outputs."""
    out = invoke(handle, args, keys, vals, None, False, True)
    return out if isinstance(out, list) else [out]


# -- autograd and array-semantics state ------------------------------------------------
_IS_REC = _LIB.MXAutogradIsRecording
_IS_TRAIN = _LIB.MXAutogradIsTraining


def autograd_state():
    """``(autograd.is_recording(), autograd.is_training())`` from two C calls."""
    r, t = ctypes.c_bool(), ctypes.c_bool()
    if _IS_REC(ctypes.byref(r)) or _IS_TRAIN(ctypes.byref(t)):
        return (autograd.is_recording(), autograd.is_training())  # MXNet's error
    return (r.value, t.value)


def mode_scope(mode):
    """A scope running under the autograd ``(recording, training)`` state ``mode``."""
    return autograd._RecordingStateScope(mode[0], mode[1])  # pylint: disable=protected-access


_DEVICE = Context._default_ctx   # pylint: disable=protected-access
default_device = current_context   # this thread's default device (``mx.cpu()`` unless set)


def adopt_state(mode, device):
    """Make this thread's autograd state ``mode`` and default device ``device``
    (a ``jitbatch.map`` worker takes its caller's; nothing restores them: a
    worker runs nothing else)."""
    if autograd_state() != mode:
        autograd.set_recording(mode[0])
        autograd.set_training(mode[1])
    if _DEVICE.__dict__.get("value") is not device:
        _DEVICE.value = device


_NP_STATE = _NumpyArrayScope._current   # pylint: disable=protected-access


def np_array_mode():
    """``mxnet.util.is_np_array()`` (asked per block call) without its Python frame."""
    # (the thread's dict: getattr with a default raises and catches an
    # AttributeError inside, ~0.3 us, in every thread MXNet was not imported in)
    cur = _NP_STATE.__dict__.get("value")
    return cur is not None and cur._is_np_array  # pylint: disable=protected-access


def np_state():
    """This thread's NumPy-interface state (``npx.set_np``): its array scope
    and whether shapes are NumPy's."""
    return _NP_STATE.__dict__.get("value"), is_np_shape()


def adopt_np(state):
    """Make this thread's NumPy-interface state ``state`` (a ``jitbatch.map``
    worker takes its caller's: MXNet keeps it per thread)."""
    scope, shape = state
    d = _NP_STATE.__dict__
    if d.get("value") is not scope:
        if scope is None:
            d.pop("value", None)       # never set in this thread: MXNet's default
        else:
            d["value"] = scope
    if is_np_shape() != shape:
        set_np_shape(shape)


_LEGACY_SCOPE = _NumpyArrayScope(False)


class legacy_np(object):
    """A scope with MXNet's NumPy interface off in this thread (a graph recorded
    in legacy mode flushed where ``npx.set_np()`` is on), then back as it was."""
    __slots__ = ("saved",)

    def __enter__(self):
        self.saved = np_state()
        adopt_np((_LEGACY_SCOPE, False))

    def __exit__(self, *exc):
        adopt_np(self.saved)


# -- metadata of concrete arrays -------------------------------------------------------
# Asked per record (a new token array per sample) and again per flush. These read
# the C-API functions through a handle to the library that keeps the GIL
# (metadata reads never wait for kernels), so one set of buffers serves every
# thread. Anything but a plain NDArray goes through MXNet's properties.
_PYLIB = ctypes.PyDLL(_LIB._name)  # pylint: disable=protected-access
_ndim = ctypes.c_int()
_dev_type = ctypes.c_int()
_dev_id = ctypes.c_int()
_dtype_code = ctypes.c_int()
_WIDE = _nd_impl._int64_enabled()  # pylint: disable=protected-access
if _WIDE:
    _pshape = ctypes.POINTER(ctypes.c_int64)()
    _GET_SHAPE = _PYLIB.MXNDArrayGetShapeEx64
else:
    _pshape = ctypes.POINTER(ctypes.c_int)()
    _GET_SHAPE = _PYLIB.MXNDArrayGetShapeEx
_GET_DTYPE = _PYLIB.MXNDArrayGetDType
_GET_CONTEXT = _PYLIB.MXNDArrayGetContext
_NDIM, _PSHAPE = ctypes.byref(_ndim), ctypes.byref(_pshape)
_DEV_TYPE, _DEV_ID = ctypes.byref(_dev_type), ctypes.byref(_dev_id)
_DTYPE = ctypes.byref(_dtype_code)
DTYPES = _nd_impl._DTYPE_MX_TO_NP  # pylint: disable=protected-access


def _address(fn):
    return ctypes.cast(fn, ctypes.c_void_p).value


def _direct_calls():
    """Compiled: hand the C-API functions' addresses to the C helpers of
    ``_mxapi.pxd``; False where NDArray's layout is not the one they make
    (then the ctypes paths run)."""
    if not cython.compiled:
        return False
    ptr = ctypes.sizeof(ctypes.c_void_p)
    if NDArray.__basicsize__ != object.__basicsize__ + 2 * ptr or \
            NDArray.__mro__[1].__slots__ != ["handle", "writable"]:
        return False
    fns = (_address(_LIB.MXImperativeInvokeEx), _address(_LIB.MXNDArraySlice),
           _address(_LIB.MXNDArrayReshape64),
           _address(_LIB.MXNDArrayGetShapeEx64) if _WIDE else None,
           None if _WIDE else _address(_LIB.MXNDArrayGetShapeEx),
           _address(_LIB.MXNDArrayGetDType), _address(_LIB.MXNDArrayGetContext))
    jb_mx_init(fns, NDArray, NDArrayHandle, check_call)  # noqa: F821 (compiled only)
    return True


DIRECT = _direct_calls()


def _shape(handle):
    check_call(_GET_SHAPE(handle, _NDIM, _PSHAPE))
    n = _ndim.value
    return None if n == -1 else tuple(_pshape[:n])


def concrete_shape(arr):
    """``arr.shape`` of a concrete array."""
    if type(arr) is not NDArray:
        return arr.shape
    if cython.compiled:
        if DIRECT:
            return jb_shape(arr)  # noqa: F821 (compiled only)
    return _shape(arr.handle)


def concrete_meta(arr):
    """``(shape, dtype, (device type id, device id))`` of a concrete NDArray,
    or None for any other array type."""
    if type(arr) is not NDArray:
        return None
    if cython.compiled:
        if DIRECT:
            shape, code, dev_type, dev_id = jb_meta(arr)  # noqa: F821 (compiled only)
            return shape, DTYPES[code], (dev_type, dev_id)
    h = arr.handle
    shape = _shape(h)
    check_call(_GET_DTYPE(h, _DTYPE))
    check_call(_GET_CONTEXT(h, _DEV_TYPE, _DEV_ID))
    return shape, DTYPES[_dtype_code.value], (_dev_type.value, _dev_id.value)


# -- gathers and views -----------------------------------------------------------------
# A flush issues a few of these per launch; MXNet's generated wrappers (argument
# checks, np.prod of shapes in reshape, the indexing machinery for a slice)
# cost more than the calls.
def take(src, idx):
    """Rows ``idx`` (an int64 array) of ``src``, along axis 0."""
    if cython.compiled:
        if DIRECT:
            return jb_take(op_handle("take"), src, idx)  # noqa: F821 (compiled only)
    return invoke(op_handle("take"), [src, idx], ["axis"], ["0"], None, False, False)


def concat(srcs):
    """The arrays ``srcs`` concatenated along axis 0."""
    if cython.compiled:
        if DIRECT:
            return jb_concat(op_handle("Concat"), srcs)  # noqa: F821 (compiled only)
    return invoke(op_handle("Concat"), srcs, ["num_args", "dim"], [str(len(srcs)), "0"],
                  None, False, False)


def rows(arr, start, stop):
    """Rows ``start:stop`` of ``arr``: a view (recorded for autograd when recording)."""
    if cython.compiled:
        if DIRECT:
            return jb_rows(arr, start, stop)  # noqa: F821 (compiled only)
    h = NDArrayHandle()
    check_call(_LIB.MXNDArraySlice(arr.handle, mx_uint(start), mx_uint(stop), ctypes.byref(h)))
    return NDArray(handle=h, writable=arr.writable)


def slice_rows(arr, start, stop):
    """Rows ``start:stop`` of ``arr`` by the ``slice_axis`` operator (a copy,
    which autograd records), called directly: through MXNet's wrapper it is
    recorded as a lazy node inside an unflagged block run on lazy arrays."""
    return invoke(op_handle("slice_axis"), [arr], ["axis", "begin", "end"],
                  ["0", str(start), str(stop)], None, False, False)


def reshape(arr, shape):
    """``arr`` re-viewed as ``shape`` (of the same size, known here)."""
    if cython.compiled:
        if DIRECT:
            return jb_reshape(arr, tuple(shape))  # noqa: F821 (compiled only)
    h = NDArrayHandle()
    check_call(_LIB.MXNDArrayReshape64(arr.handle, len(shape), c_array(ctypes.c_int64, shape),
                                       False, ctypes.byref(h)))
    return NDArray(handle=h, writable=arr.writable)
