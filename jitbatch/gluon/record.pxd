# Compiled declarations of record.py (see jitbatch/graph.pxd): recording a block
# call reads its lazy arguments, the pending graph and the signature directly, and
# makes its nodes and lazy results without a Python call per field.
from jitbatch.graph cimport Node, Composite, Graph
from jitbatch.signature cimport SigInfo
from jitbatch.gluon.lazy cimport new_lazy
from jitbatch.gluon.meta cimport meta
from jitbatch.gluon.modes cimport mode
from jitbatch.gluon.signatures cimport exact_key, pad_size
from jitbatch.gluon.sites cimport site_of

cpdef maybe_autoflush(g)
cpdef tuple _arguments(block, tuple allargs)
cpdef _one_level(tuple allargs)
cpdef _outputs(list outs, ofmt)
cpdef record_block(block, Graph g, x, tuple args, frame)
cpdef record_op(g, handle, ndargs, keys, vals, output_is_list)
cdef dict _FLAT, _FLAT_IN, EXACT
