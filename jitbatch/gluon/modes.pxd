# Compiled declarations of modes.py (see jitbatch/graph.pxd): read on every record.
from jitbatch.graph cimport Graph

cpdef mode(g)
cdef Py_ssize_t _MODE_GEN
