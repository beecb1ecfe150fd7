# Compiled declarations of meta.py (see jitbatch/graph.pxd): asked per argument of
# every record.
from jitbatch.gluon._lazy cimport LazyArray as LazyArrayT

cpdef meta(a)
cdef dict _concrete, _CONTEXTS, _DEVICES
cdef list _LAST
