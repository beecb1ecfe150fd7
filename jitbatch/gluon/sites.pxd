# Compiled declarations of sites.py (see jitbatch/graph.pxd): a site per record.

cdef class Site:
    cdef public object code, lasti

cpdef _skip(f)
cpdef site_of(f)
cdef dict _skip_file, _skip_code
cpdef _skip_exec(f)
