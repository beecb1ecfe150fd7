# Compiled types of hook.py (see jitbatch/graph.pxd): recording a block call
# reads its lazy arguments, the pending graph and the signature directly, and
# makes its nodes and lazy results without a Python call per field.
from jitbatch.graph cimport Node, Composite, Graph
from jitbatch.signature cimport SigInfo
from jitbatch.gluon._lazy cimport LazyArray
from jitbatch.gluon.backend cimport new_lazy


cdef class Site:
    cdef public object code, lasti


cpdef _maybe_autoflush(g)
cdef bint _any_lazy(x, tuple args)
cpdef _meta(a)
cpdef _mode(g)
cpdef _skip(f)
cpdef _site_of(f)
cpdef _record_block(self, Graph g, x, tuple args, frame)
cpdef _padsize(tuple key, pads)

# module dicts read on every record (typed: C dict calls, no method lookups)
cdef dict _EXACT, _FLAT, _FLAT_IN, _skip_file, _concrete_meta, _STACK_BUILD
cdef list _LAST_CONCRETE
cdef Py_ssize_t _MODE_GEN, _SCOPES
