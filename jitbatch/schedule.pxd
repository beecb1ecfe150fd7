# Compiled types of schedule.py (see jitbatch/graph.pxd).
from jitbatch.graph cimport Node
