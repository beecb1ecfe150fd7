# Compiled hand-over of baton.py: a baton is a capsule holding a PyThread lock,
# and hand() releases one and acquires the other with the GIL let go in
# between (a threading.Lock release wakes the waiter while the GIL is still
# held: it then wakes a second time, for the GIL).

cdef extern from *:
    """
    #include "pythread.h"
    static const char *jb_baton_name = "jitbatch.baton";

    static void jb_baton_free(PyObject *cap) {
        PyThread_type_lock lock = (PyThread_type_lock)PyCapsule_GetPointer(cap, jb_baton_name);
        if (lock != NULL) PyThread_free_lock(lock);
    }

    static PyObject *jb_baton_new(void) {
        PyThread_type_lock lock = PyThread_allocate_lock();
        if (lock == NULL) return PyErr_NoMemory();
        PyThread_acquire_lock(lock, WAIT_LOCK);
        PyObject *cap = PyCapsule_New(lock, jb_baton_name, jb_baton_free);
        if (cap == NULL) PyThread_free_lock(lock);
        return cap;
    }

    static PyThread_type_lock jb_baton_lock(PyObject *b) {
        if (b == Py_None) return NULL;
        return (PyThread_type_lock)PyCapsule_GetPointer(b, jb_baton_name);
    }

    static int jb_baton_hand(PyObject *give, PyObject *wait) {
        PyThread_type_lock g = jb_baton_lock(give), w = jb_baton_lock(wait);
        if ((g == NULL && give != Py_None) || (w == NULL && wait != Py_None)) return -1;
        Py_BEGIN_ALLOW_THREADS
        if (g != NULL) PyThread_release_lock(g);
        if (w != NULL) PyThread_acquire_lock(w, WAIT_LOCK);
        Py_END_ALLOW_THREADS
        return 0;
    }
    """
    object jb_baton_new()
    int jb_baton_hand(object give, object wait) except -1
