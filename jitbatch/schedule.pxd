# Compiled types of schedule.py (see jitbatch/graph.pxd).
from jitbatch.graph cimport Node

cpdef _make_ready(list fresh, dict ready, dict level_sum, Py_ssize_t top)
