"""Python's cyclic GC while a graph is pending: old generations wait, young ones run.

Every object a pending graph allocates stays alive until its flush, so each
collection of the older generations during recording rescans the growing
graph and frees nothing (measured: a 256-pair Tree-LSTM inference batch spends
a third of its recording in them). While any thread's graph is pending, the
thresholds of generations 1 and 2 are raised; generation 0 keeps its own, so
the cyclic garbage a program makes meanwhile (even around a graph that is
never read) is still collected as it would be. The first flush that leaves no
graph pending restores the thresholds; so does a thread that ended with one
(checked at the next pause or restore). ``config.defer_gc = False`` leaves the
GC alone."""
import gc
import threading

#: thresholds of generations 1 and 2 while a graph is pending (Python's: 10, 10)
OLD_GENERATIONS = 1000

_lock = threading.Lock()
_holders = {}       # id of a pending graph -> the graph
_saved = [None]     # the thresholds to restore


def _drop_dead_threads():
    if _holders:
        alive = {t.ident for t in threading.enumerate()}
        for k in [k for k, g in _holders.items() if g.thread not in alive]:
            del _holders[k]
    if not _holders and _saved[0] is not None:
        gc.set_threshold(*_saved[0])
        _saved[0] = None


def defer(graph):
    """``graph`` (of this thread) starts pending."""
    with _lock:
        _drop_dead_threads()
        if not _holders:
            t = gc.get_threshold()
            _saved[0] = t
            gc.set_threshold(t[0], max(t[1], OLD_GENERATIONS), max(t[2], OLD_GENERATIONS))
        _holders[id(graph)] = graph


def restore(graph):
    """``graph`` is no longer pending (flushed, failed or emptied)."""
    with _lock:
        _holders.pop(id(graph), None)
        _drop_dead_threads()


def pending():
    """The graphs pending now, of every thread."""
    with _lock:
        return list(_holders.values())


def deferred():
    """Whether the older generations are deferred now."""
    return _saved[0] is not None
