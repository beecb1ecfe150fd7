# Compiled declarations of signatures.py (see jitbatch/graph.pxd): the exact call
# key is built on every block record.
from jitbatch.gluon.meta cimport meta

cpdef tuple exact_key(block, fkey, mode, flat)
cpdef pad_size(tuple exact, pads)
