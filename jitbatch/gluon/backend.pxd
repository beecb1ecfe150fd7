# Compiled types of backend.py (see jitbatch/graph.pxd): the gather planning
# visits every row of every launch's inputs and reads lazy arrays, nodes and
# their launch groups directly.
from jitbatch.graph cimport Node, Composite, Group
from jitbatch.signature cimport SigInfo
from jitbatch.gluon._lazy cimport LazyArray, jb_new_lazy, jb_drop_finalizer
from jitbatch.gluon._mxapi cimport (jb_mx_init, jb_take, jb_concat, jb_rows, jb_reshape,
                                    jb_shape, jb_meta)


cdef class Plan:
    cdef public object kind, srcs, start, stop, want, values, have, pad


cdef class _Pad:
    cdef public object zeros, count, shape


cdef class _View:
    cdef public object arr, shape


cpdef new_lazy(node, k, shape, dtype, ctx, view=*)
cpdef _view(arr, r0, rc, squeeze, new_shape)
cdef bint _DIRECT
cpdef extent(node, k)
cpdef _leaves(v, list out)
cpdef plan_gather(values, shape, list index, dict sizes)
cpdef _plan_leaves(list leaves, values, want, list index, dict sizes)
cpdef _plan_take_concat(dict srcs, list keys, list starts, list counts, ones, want, rs,
                        list index)
cpdef plan_padded(values, shape, axis, list index, dict sizes)
cpdef _unit_leaves(v, unit, list out, dict views)
cpdef _ragged_want(values, shape, dict sizes)
cpdef _twins(a_values, b_values, dict kmap)
cpdef finish(batch, outs)
