# Compiled declarations of gather.py (see jitbatch/graph.pxd): the planning visits
# every row of every launch's inputs and reads lazy arrays, nodes and their
# launch groups directly.
from jitbatch.graph cimport Node, Composite, Group
from jitbatch.signature cimport SigInfo
from jitbatch.gluon.lazy cimport k_of, node_of, shape_of, value_of, view_of


cdef class Plan:
    cdef public object kind, srcs, start, stop, want, values, have, pad


cdef class _Pad:
    cdef public object zeros, count, shape


cdef class _View:
    cdef public object arr, shape


cpdef plan_gather(values, shape, list index, dict sizes)
cpdef _plan_segments(list leaves, values, want, list index, dict sizes)
cpdef _plan_take_concat(dict srcs, list keys, list starts, list counts, ones, want, rs,
                        list index)
cpdef plan_padded(values, shape, axis, list index, dict sizes)
cpdef _unit_segments(v, unit, list out, dict views)
cpdef _ragged_want(values, shape, dict sizes)
cpdef _twins(a_values, b_values, dict kmap)
