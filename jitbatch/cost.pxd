# Compiled types of cost.py (see jitbatch/graph.pxd).
from jitbatch.graph cimport Node
