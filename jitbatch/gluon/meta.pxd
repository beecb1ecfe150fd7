# Compiled declarations of meta.py (see jitbatch/graph.pxd): asked per argument of
# every record.

from jitbatch.gluon.lazy cimport meta_of

cpdef meta(a)
cdef dict _concrete, _CONTEXTS, _DEVICES
cdef list _LAST
