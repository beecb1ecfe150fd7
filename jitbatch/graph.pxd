# Compiled types of graph.py (Cython's "augmenting .pxd": the .py stays the one
# implementation, this file only gives its records C layouts, so compiled code
# reads and writes their fields directly instead of through Python attribute
# lookups). Every field stays readable and writable from Python (public).

from jitbatch.signature cimport SigInfo


cdef class Node:
    cdef public SigInfo info
    cdef public object inputs, depth, site, mode, batch, error, graph, group
    cdef public object plan, rows, users, lifted
    cdef public Py_ssize_t row, seq, off, wait, height, pad
    cdef public bint severed


cdef class Composite:
    cdef public object parts, mode, depth
    cdef public list nodes


cdef class Group:
    cdef public Py_ssize_t size, rows
    cdef public object outs


cdef class Graph:
    cdef public list nodes
    cdef public object thread, backend, policy, budget, granularity
    cdef public Py_ssize_t seq, passthrough, quiet, singles, limit, scope
    cdef public bint executing, chunk_merged, unpiped
    cdef public Py_ssize_t stops
    cdef public list retired, kept, kept_before
    cdef public dict reads
    cdef public object spans
    cdef public list aliased
    cdef public Py_ssize_t aliased_cap
    cdef public object autograd, sharing, net
    cdef public Py_ssize_t autograd_gen
    cpdef Node add(self, info, tuple inputs, site, mode, rows=*)
    cdef bint _link(self, Node n, Node p) except -1
    cpdef Node insert_producer(self, Node n, info, tuple inputs, site)


cpdef Graph current_graph()
cpdef object recorder()
cpdef _sources(x)
cpdef _producers(x, list out)
