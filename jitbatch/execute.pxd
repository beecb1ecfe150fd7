# Compiled types of execute.py (see jitbatch/graph.pxd).
from jitbatch.graph cimport Node, Group
