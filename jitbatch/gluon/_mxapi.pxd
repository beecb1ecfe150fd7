# Compiled declarations of _mxapi.py (Cython's "augmenting .pxd": the .py stays the
# one implementation). The C helpers below call the few MXNet C-API functions the
# flush and the record issue per gather and per concrete input directly: MXNet's
# Python layer reaches them through ctypes (argument arrays, c_void_p wrappers and
# an NDArray.__init__ in Python around a C call that itself costs less). Their
# addresses are taken from the library MXNet already loaded (through ctypes, once,
# by jb_mx_init) and called from C, with the GIL held (they only push work to
# MXNet's engine or read metadata; they never wait for kernels). The results are
# the same NDArray objects MXNet's own wrappers make. Errors go through
# mxnet.base.check_call, so they raise MXNet's own exceptions.

cdef extern from *:
    """
    #include <stdint.h>
    typedef int (*jb_invoke_t)(void *, int, void **, int *, void ***, int,
                               const char **, const char **, const int **);
    typedef int (*jb_slice_t)(void *, uint32_t, uint32_t, void **);
    typedef int (*jb_reshape_t)(void *, int, int64_t *, int /* bool */, void **);
    typedef int (*jb_shape64_t)(void *, int *, const int64_t **);
    typedef int (*jb_shape32_t)(void *, int *, const int **);
    typedef int (*jb_dtype_t)(void *, int *);
    typedef int (*jb_context_t)(void *, int *, int *);

    static jb_invoke_t jb_mx_invoke = NULL;
    static jb_slice_t jb_mx_slice = NULL;
    static jb_reshape_t jb_mx_reshape = NULL;
    static jb_shape64_t jb_mx_shape64 = NULL;
    static jb_shape32_t jb_mx_shape32 = NULL;
    static jb_dtype_t jb_mx_dtype = NULL;
    static jb_context_t jb_mx_context = NULL;
    static PyObject *jb_nd_type = NULL;      /* mxnet.ndarray.NDArray */
    static PyObject *jb_handle_type = NULL;  /* mxnet.base.NDArrayHandle (c_void_p) */
    static PyObject *jb_check = NULL;        /* mxnet.base.check_call */
    static PyObject *jb_s_handle = NULL, *jb_s_value = NULL;

    static void *jb_addr(PyObject *fn) { return PyLong_AsVoidPtr(fn); }

    /* fns: (invoke, slice, reshape, shape64 or None, shape32 or None, dtype,
       context) as addresses (ints) */
    static int jb_mx_init(PyObject *fns, PyObject *nd_type, PyObject *handle_type,
                          PyObject *check) {
        if (!PyTuple_Check(fns) || PyTuple_GET_SIZE(fns) != 7) {
            PyErr_SetString(PyExc_TypeError, "jb_mx_init: 7 function addresses expected");
            return -1;
        }
        jb_mx_invoke = (jb_invoke_t)jb_addr(PyTuple_GET_ITEM(fns, 0));
        jb_mx_slice = (jb_slice_t)jb_addr(PyTuple_GET_ITEM(fns, 1));
        jb_mx_reshape = (jb_reshape_t)jb_addr(PyTuple_GET_ITEM(fns, 2));
        if (PyTuple_GET_ITEM(fns, 3) != Py_None)
            jb_mx_shape64 = (jb_shape64_t)jb_addr(PyTuple_GET_ITEM(fns, 3));
        if (PyTuple_GET_ITEM(fns, 4) != Py_None)
            jb_mx_shape32 = (jb_shape32_t)jb_addr(PyTuple_GET_ITEM(fns, 4));
        jb_mx_dtype = (jb_dtype_t)jb_addr(PyTuple_GET_ITEM(fns, 5));
        jb_mx_context = (jb_context_t)jb_addr(PyTuple_GET_ITEM(fns, 6));
        if (PyErr_Occurred()) return -1;
        Py_INCREF(nd_type); jb_nd_type = nd_type;
        Py_INCREF(handle_type); jb_handle_type = handle_type;
        Py_INCREF(check); jb_check = check;
        jb_s_handle = PyUnicode_InternFromString("handle");
        jb_s_value = PyUnicode_InternFromString("value");
        return (jb_s_handle && jb_s_value) ? 0 : -1;
    }

    /* MXNet's error for a failed call (check_call raises it); always NULL */
    static PyObject *jb_fail(int ret) {
        PyObject *r = PyObject_CallFunction(jb_check, "i", ret);
        Py_XDECREF(r);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "jitbatch: an MXNet call failed");
        return NULL;
    }

    /* arr.handle.value: the C handle of an NDArray (NULL with an exception) */
    static void *jb_handle_of(PyObject *arr) {
        PyObject *h = PyObject_GetAttr(arr, jb_s_handle);
        if (h == NULL) return NULL;
        PyObject *v = PyObject_GetAttr(h, jb_s_value);
        Py_DECREF(h);
        if (v == NULL) return NULL;
        void *p = (v == Py_None) ? NULL : PyLong_AsVoidPtr(v);
        Py_DECREF(v);
        if (p == NULL && !PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "jitbatch: an NDArray without a handle");
        return p;
    }

    /* NDArray(handle=NDArrayHandle(h), writable=writable), as NDArrayBase's
       __init__ makes it (its two slots set) */
    static PyObject *jb_wrap(void *h, PyObject *writable) {
        PyObject *addr = PyLong_FromVoidPtr(h);
        if (addr == NULL) return NULL;
        PyObject *hobj = PyObject_CallOneArg(jb_handle_type, addr);
        Py_DECREF(addr);
        if (hobj == NULL) return NULL;
        PyTypeObject *tp = (PyTypeObject *)jb_nd_type;
        PyObject *o = tp->tp_alloc(tp, 0);
        if (o == NULL) { Py_DECREF(hobj); return NULL; }
        PyObject **slots = (PyObject **)((char *)o + sizeof(PyObject));
        slots[0] = hobj;                                 /* handle */
        Py_INCREF(writable); slots[1] = writable;        /* writable */
        return o;
    }

    /* one dense output of operator op on inputs (a list or tuple of NDArrays) */
    static PyObject *jb_invoke(PyObject *op, PyObject *inputs, int nkeys,
                               const char **keys, const char **vals) {
        void *opp = PyLong_AsVoidPtr(op);
        if (opp == NULL && PyErr_Occurred()) return NULL;
        PyObject *seq = PySequence_Fast(inputs, "jitbatch: inputs must be a sequence");
        if (seq == NULL) return NULL;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        void *stack[16];
        void **hs = n <= 16 ? stack : (void **)PyMem_Malloc(n * sizeof(void *));
        if (hs == NULL) { Py_DECREF(seq); return PyErr_NoMemory(); }
        PyObject **items = PySequence_Fast_ITEMS(seq);
        for (Py_ssize_t i = 0; i < n; i++) {
            hs[i] = jb_handle_of(items[i]);
            if (hs[i] == NULL) {
                if (hs != stack) PyMem_Free(hs);
                Py_DECREF(seq);
                return NULL;
            }
        }
        int nout = 0;
        void **outs = NULL;
        const int *stypes = NULL;
        int ret = jb_mx_invoke(opp, (int)n, hs, &nout, &outs, nkeys, keys, vals, &stypes);
        if (hs != stack) PyMem_Free(hs);
        Py_DECREF(seq);
        if (ret != 0) return jb_fail(ret);
        if (nout != 1 || stypes == NULL || stypes[0] != 0) {
            PyErr_SetString(PyExc_RuntimeError,
                            "jitbatch: a gather op gave other than one dense output");
            return NULL;
        }
        return jb_wrap(outs[0], Py_True);
    }

    static PyObject *jb_take(PyObject *op, PyObject *src, PyObject *idx) {
        static const char *keys[] = {"axis"};
        static const char *vals[] = {"0"};
        PyObject *args = PyTuple_Pack(2, src, idx);
        if (args == NULL) return NULL;
        PyObject *r = jb_invoke(op, args, 1, keys, vals);
        Py_DECREF(args);
        return r;
    }

    static PyObject *jb_concat(PyObject *op, PyObject *srcs) {
        static const char *keys[] = {"num_args", "dim"};
        char num[32];
        Py_ssize_t n = PyObject_Length(srcs);
        if (n < 0) return NULL;
        snprintf(num, sizeof(num), "%zd", n);
        const char *vals[] = {num, "0"};
        return jb_invoke(op, srcs, 2, keys, vals);
    }

    /* the view a C-API call made of arr (its result ret, the new handle out):
       an NDArray as writable as arr */
    static PyObject *jb_view_of(PyObject *arr, int ret, void *out) {
        if (ret != 0) return jb_fail(ret);
        PyObject *w = PyObject_GetAttrString(arr, "writable");
        if (w == NULL) return NULL;
        PyObject *r = jb_wrap(out, w);
        Py_DECREF(w);
        return r;
    }

    /* rows [a, b) of arr, a view (MXNDArraySlice) */
    static PyObject *jb_rows(PyObject *arr, Py_ssize_t a, Py_ssize_t b) {
        void *h = jb_handle_of(arr);
        if (h == NULL) return NULL;
        void *out = NULL;
        int ret = jb_mx_slice(h, (uint32_t)a, (uint32_t)b, &out);
        return jb_view_of(arr, ret, out);
    }

    /* arr re-viewed as shape (a tuple of ints, same size) */
    static PyObject *jb_reshape(PyObject *arr, PyObject *shape) {
        int64_t dims[32];
        Py_ssize_t n = PyTuple_Size(shape);
        if (n < 0) return NULL;
        if (n > 32) { PyErr_SetString(PyExc_ValueError, "jitbatch: over 32 axes"); return NULL; }
        for (Py_ssize_t i = 0; i < n; i++) {
            dims[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
            if (dims[i] == -1 && PyErr_Occurred()) return NULL;
        }
        void *h = jb_handle_of(arr);
        if (h == NULL) return NULL;
        void *out = NULL;
        int ret = jb_mx_reshape(h, (int)n, dims, 0, &out);
        return jb_view_of(arr, ret, out);
    }

    /* shape of the array with C handle h (None for an unknown shape) */
    static PyObject *jb_shape_of(void *h) {
        int ndim = 0, ret;
        const int64_t *d64 = NULL;
        const int *d32 = NULL;
        PyObject *t, *v;
        ret = jb_mx_shape64 != NULL ? jb_mx_shape64(h, &ndim, &d64)
                                    : jb_mx_shape32(h, &ndim, &d32);
        if (ret != 0) return jb_fail(ret);
        if (ndim == -1) Py_RETURN_NONE;
        t = PyTuple_New(ndim);
        if (t == NULL) return NULL;
        for (int i = 0; i < ndim; i++) {
            v = PyLong_FromLongLong(d64 != NULL ? d64[i] : (long long)d32[i]);
            if (v == NULL) { Py_DECREF(t); return NULL; }
            PyTuple_SET_ITEM(t, i, v);
        }
        return t;
    }

    static PyObject *jb_shape(PyObject *arr) {
        void *h = jb_handle_of(arr);
        return h == NULL ? NULL : jb_shape_of(h);
    }

    /* (shape, dtype code, device type id, device id) */
    static PyObject *jb_meta(PyObject *arr) {
        void *h = jb_handle_of(arr);
        if (h == NULL) return NULL;
        int code = 0, dev_type = 0, dev_id = 0, ret;
        ret = jb_mx_dtype(h, &code);
        if (ret != 0) return jb_fail(ret);
        ret = jb_mx_context(h, &dev_type, &dev_id);
        if (ret != 0) return jb_fail(ret);
        PyObject *shape = jb_shape_of(h);
        if (shape == NULL) return NULL;
        PyObject *r = Py_BuildValue("(Niii)", shape, code, dev_type, dev_id);
        return r;
    }
    """
    int jb_mx_init(object fns, object nd_type, object handle_type, object check) except -1
    object jb_take(object op, object src, object idx)
    object jb_concat(object op, object srcs)
    object jb_rows(object arr, Py_ssize_t a, Py_ssize_t b)
    object jb_reshape(object arr, object shape)
    object jb_shape(object arr)
    object jb_meta(object arr)


cpdef concrete_shape(arr)
cpdef concrete_meta(arr)
cpdef take(src, idx)
cpdef concat(srcs)
cpdef rows(arr, Py_ssize_t start, Py_ssize_t stop)
cpdef reshape(arr, shape)
cpdef op_handle(name)
cpdef bint np_array_mode() except -1
