"""Counters and timings: the test oracle and the user's view of what jitbatch did."""
import threading

_FIELDS = ("nodes", "launches", "batched_nodes", "flushes", "forced_flushes",
           "auto_flushes", "pipelined_flushes", "gather_ops", "filler_samples", "failures",
           "analysis_seconds", "execute_seconds", "release_seconds", "signatures",
           "fast_activations", "fast_splits", "exact_prelu", "copied_inputs")


class Stats(object):
    """Process-wide counters (the graph is per thread; counters are shared and
    updated under a lock only at flush granularity, never per node)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self):
        with self._lock:
            self._c = dict.fromkeys(_FIELDS, 0)
            self._c["analysis_seconds"] = 0.0
            self._c["execute_seconds"] = 0.0
            self._c["release_seconds"] = 0.0
            self._c["last_flush"] = {}
            self._c["policies"] = {}

    def add(self, **kw):
        with self._lock:
            c = self._c
            for k, v in kw.items():
                c[k] = c.get(k, 0) + v

    def set_last_flush(self, info):
        with self._lock:
            self._c["last_flush"] = info
            pol = self._c["policies"]
            key = info.get("policy")
            pol[key] = pol.get(key, 0) + 1

    def snapshot(self):
        with self._lock:
            out = dict(self._c)
            out["last_flush"] = dict(self._c["last_flush"])
            out["policies"] = dict(self._c["policies"])
            return out


STATS = Stats()
