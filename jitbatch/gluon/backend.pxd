# Compiled types of backend.py (see jitbatch/graph.pxd): the gather planning
# visits every row of every launch's inputs and reads lazy arrays, nodes and
# their launch groups directly.
from jitbatch.graph cimport Node, Composite, Group
from jitbatch.signature cimport SigInfo
from jitbatch.gluon._lazy cimport LazyArray, jb_new_lazy, jb_drop_finalizer


cdef class Plan:
    cdef public object kind, srcs, start, stop, want, values, have, pad


cdef class _Pad:
    cdef public object zeros, count, shape


cdef class _View:
    cdef public object arr, shape
