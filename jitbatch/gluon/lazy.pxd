# Compiled declarations of lazy.py (see jitbatch/graph.pxd): lazy arrays are made
# in C with every field set at once, and freed without a finalizer call.
#
# The maker finds LazyArray's fields by name, from the member descriptors of its
# __slots__, when lazy.py loads (jb_lazy_type): it sets every slot of the class
# to None, then the six it is given, so a slot added to the class needs no edit
# here. LazyArray.__del__ only keeps NDArray's (which frees the handle, and would
# force a lazy one) from running; called per freed lazy array (tens of thousands
# per graph) it is a Python call each, so the compiled type has no finalizer.

cdef extern from *:
    """
    #include <structmember.h>
    static Py_ssize_t jb_lz_given[6];   /* _node, _k, _shape, _dtype, _ctx, _view */
    static Py_ssize_t jb_lz_value = -1, jb_lz_writable = -1;
    static Py_ssize_t jb_lz_slots[64];  /* every object slot of the class itself */
    static int jb_lz_nslots = 0;

    static Py_ssize_t jb_lz_offset(PyObject *type, const char *name) {
        PyObject *d = PyObject_GetAttrString(type, name);
        if (d == NULL) return -1;
        if (!Py_IS_TYPE(d, &PyMemberDescr_Type)) {
            Py_DECREF(d);
            PyErr_Format(PyExc_TypeError, "jitbatch: LazyArray.%s is not a slot", name);
            return -1;
        }
        Py_ssize_t off = ((PyMemberDescrObject *)d)->d_member->offset;
        Py_DECREF(d);
        return off;
    }

    static int jb_lazy_type(PyObject *type) {
        static const char *given[] = {"_node", "_k", "_shape", "_dtype", "_ctx", "_view"};
        PyTypeObject *tp = (PyTypeObject *)type;
        for (int i = 0; i < 6; i++)
            if ((jb_lz_given[i] = jb_lz_offset(type, given[i])) < 0) return -1;
        if ((jb_lz_value = jb_lz_offset(type, "_value")) < 0) return -1;
        if ((jb_lz_writable = jb_lz_offset(type, "writable")) < 0) return -1;
        jb_lz_nslots = 0;
        for (PyMemberDef *m = tp->tp_members; m != NULL && m->name != NULL; m++) {
            if (m->type != T_OBJECT_EX) continue;
            if (jb_lz_nslots == 64) {
                PyErr_SetString(PyExc_TypeError, "jitbatch: LazyArray has over 64 slots");
                return -1;
            }
            jb_lz_slots[jb_lz_nslots++] = m->offset;
        }
        tp->tp_finalize = NULL;
        return 0;
    }

    /* slot i of LazyArray o (0-5: the given fields in that order, 6: _value)
       as a new reference, read at its offset (a generic attribute read walks
       the type's lookup and descriptor: ~70 instructions). The offsets are
       per module: jb_lazy_type must have run in the module that reads. */
    static PyObject *jb_lz_slot(PyObject *o, int i) {
        PyObject *v = *(PyObject **)((char *)o + (i < 6 ? jb_lz_given[i] : jb_lz_value));
        if (v == NULL) v = Py_None;
        Py_INCREF(v);
        return v;
    }

    #define JB_SET(o, off, v) do { PyObject **p_ = (PyObject **)((char *)(o) + (off)); \
        PyObject *old_ = *p_; Py_INCREF(v); *p_ = (v); Py_XDECREF(old_); } while (0)

    /* LazyArray(node, k, shape, dtype, ctx, view), as its __init__ makes it */
    static PyObject *jb_new_lazy(PyObject *type, PyObject *node, PyObject *k,
                                 PyObject *shape, PyObject *dtype, PyObject *ctx,
                                 PyObject *view) {
        PyTypeObject *tp = (PyTypeObject *)type;
        PyObject *o = tp->tp_alloc(tp, 0);
        if (o == NULL) return NULL;
        for (int i = 0; i < jb_lz_nslots; i++) JB_SET(o, jb_lz_slots[i], Py_None);
        PyObject *vals[6] = {node, k, shape, dtype, ctx, view};
        for (int i = 0; i < 6; i++) JB_SET(o, jb_lz_given[i], vals[i]);
        JB_SET(o, jb_lz_value, Py_None);
        JB_SET(o, jb_lz_writable, Py_True);
        return o;
    }
    """
    int jb_lazy_type(object type) except -1
    object jb_lz_slot(object o, int i)
    object jb_new_lazy(object type, object node, object k, object shape, object dtype,
                       object ctx, object view)

from cpython.weakref cimport PyWeakref_NewRef
from jitbatch.graph cimport Node, Composite, Graph, current_graph
from jitbatch.gluon.modes cimport mode

cpdef new_lazy(node, k, shape, dtype, ctx, view=*)
cpdef track(g, la)
cpdef row_view(arr, key)
cpdef _view(arr, r0, rc, squeeze, new_shape)
cpdef parts_of(v, list out)
cpdef node_of(la)
cpdef k_of(la)
cpdef shape_of(la)
cpdef view_of(la)
cpdef value_of(la)
cpdef tuple meta_of(la)
