# Compiled declarations of patch.py (see jitbatch/graph.pxd): the shims run on
# every block call and every MXNet operator of the process.
from jitbatch.graph cimport Composite, Graph, Node, current_graph
from jitbatch.gluon._mxapi cimport np_array_mode
from jitbatch.gluon.record cimport record_block, record_op

cdef bint _any_lazy(x, tuple args)
cdef bint _any_pending(args)
cdef Py_ssize_t _SCOPES
cdef dict _RECURRENT
cpdef bint _recurrent_is_hybrid(cls) except -1
