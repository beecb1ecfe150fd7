# The C layout of jitbatch.gluon.array.LazyArray, for the compiled modules that
# read lazy arrays on their hot paths (cimported by backend.pxd and hook.pxd).
#
# LazyArray is an ordinary Python class (it must subclass MXNet's NDArray), so
# compiled code would reach its fields through Python attribute lookups. Its
# instances are laid out by CPython: MXNet's NDArrayBase slots (handle,
# writable), then LazyArray's own __slots__ in sorted order. Declared here as
# that struct, compiled code reads the fields directly. Cython checks at import
# that the class's instance size is this struct's ("check_size error"), and
# tests/test_compiled.py that every field reads what Python reads.
#
# Every LazyArray is made by LazyArray.__init__ or jb_new_lazy below, both of
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

    /* A new LazyArray with every field set (what LazyArray.__init__ does,
       without a Python call per field). */
    static PyObject *jb_new_lazy(PyObject *type, PyObject *node, PyObject *k,
                                 PyObject *shape, PyObject *dtype, PyObject *ctx,
                                 PyObject *view) {
        PyTypeObject *tp = (PyTypeObject *)type;
        JbLazyArrayObject *o = (JbLazyArrayObject *)tp->tp_alloc(tp, 0);
        if (o == NULL) return NULL;
        Py_INCREF(node); o->_node = node;
        Py_INCREF(k); o->_k = k;
        Py_INCREF(shape); o->_shape = shape;
        Py_INCREF(dtype); o->_dtype = dtype;
        Py_INCREF(ctx); o->_ctx = ctx;
        Py_INCREF(view); o->_view = view;
        Py_INCREF(Py_None); o->_value = Py_None;
        Py_INCREF(Py_True); o->writable = Py_True;
        return (PyObject *)o;
    }

    /* LazyArray.__del__ only keeps NDArray's (which frees the handle) from
       running: it has nothing to do. Called per freed lazy array (tens of
       thousands per graph) it is a Python call each; without a finalizer
       slot the type's deallocation skips it. */
    static void jb_drop_finalizer(PyObject *type) {
        ((PyTypeObject *)type)->tp_finalize = NULL;
    }
    """
    ctypedef class jitbatch.gluon.array.LazyArray [object JbLazyArrayObject, check_size error]:
        cdef object _ctx
        cdef object _dtype
        cdef object _k
        cdef object _node
        cdef object _shape
        cdef object _value
        cdef object _view

    object jb_new_lazy(object type, object node, object k, object shape, object dtype,
                       object ctx, object view)
    void jb_drop_finalizer(object type)
