# Compiled declarations of meta.py (see jitbatch/graph.pxd): asked per argument of
# every record.

cpdef meta(a)
cdef dict _concrete, _CONTEXTS, _DEVICES
cdef list _LAST
