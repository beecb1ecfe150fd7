# Compiled layout of signature.py's SigInfo (see graph.pxd): compiled code reads
# a node's signature fields directly.

cdef class SigInfo:
    cdef public object id, key, op, out_meta, out_rows, batchable, name
    cdef public object launch_cost, launch_rows, launches, launch_rr, launch_cr
    cdef public object pad_axes, pad_fit, pad_seen, stops
    cdef public bint live
