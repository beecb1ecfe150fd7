# The C layout of jitbatch.gluon.lazy.LazyArray, for the compiled modules that
# read lazy arrays on their hot paths (cimported by meta, gather, signatures, record).
#
# LazyArray is an ordinary Python class (it must subclass MXNet's NDArray), so
# compiled code would reach its fields through Python attribute lookups. Its
# instances are laid out by CPython: MXNet's NDArrayBase slots (handle,
# writable), then LazyArray's own __slots__ in sorted order. Declared here as
# that struct, compiled code reads the fields directly. Cython checks at import
# that the class's instance size is this struct's ("check_size error"), and
# tests/test_compiled.py that every field reads what Python reads.
#
# Every LazyArray is made by LazyArray.__init__ or lazy.new_lazy (lazy.pxd), both of
# which set every field (a NULL field would crash a direct read).

cdef extern from *:
    """
    typedef struct {
        PyObject_HEAD
        PyObject *handle;      /* NDArrayBase's slot; LazyArray's handle is a property */
        PyObject *writable;
        PyObject *_ctx;
        PyObject *_dtype;
        PyObject *_k;
        PyObject *_node;
        PyObject *_shape;
        PyObject *_value;
        PyObject *_view;
    } JbLazyArrayObject;

    """
    ctypedef class jitbatch.gluon.lazy.LazyArray [object JbLazyArrayObject, check_size error]:
        cdef object _ctx
        cdef object _dtype
        cdef object _k
        cdef object _node
        cdef object _shape
        cdef object _value
        cdef object _view

