"""Python's cyclic GC while a graph is pending: old generations wait, young ones
run; during a flush none does.

Every object a pending graph allocates stays alive until its flush, so each
collection of the older generations during recording rescans the growing
graph and frees nothing (measured: a 256-pair Tree-LSTM inference batch spends
a third of its recording in them). While any thread's graph is pending, the
thresholds of generations 1 and 2 are raised; generation 0 keeps its own, so
the cyclic garbage a program makes meanwhile (even around a graph that is
never read) is still collected as it would be. The first flush that leaves no
graph pending restores the thresholds; so does the end of a thread that left
one pending. A collection inside a flush would run finalizers (a tree node's
``__del__`` that reads its state) in the middle of it, where the graph's
arrays cannot be computed, so the GC is off while a flush runs (``pause``).
``config.defer_gc = False`` leaves the GC alone."""
import gc
import threading

#: thresholds of generations 1 and 2 while a graph is pending (Python's: 10, 10)
OLD_GENERATIONS = 1000

_lock = threading.RLock()   # re-entrant: a thread's end (``_Owner.__del__``) may come in it
_holders = {}       # id of a pending graph -> (the graph, the Thread that records it)
_saved = [None]     # the thresholds to restore
_owned = threading.local()


class _Owner(object):
    """Kept in the recording thread's local storage: freed when the thread
    ends, it drops the thread's graph, so the thresholds come back even where
    nothing of jitbatch runs after (a pool thread's last call left pending,
    the process going on eagerly)."""
    __slots__ = ("key",)

    def __init__(self, key):
        self.key = key

    def __del__(self):
        try:
            with _lock:
                # the thread is ending: not yet counted as ended (is_alive)
                _holders.pop(self.key, None)
                _drop_dead_threads()
        except Exception:  # pylint: disable=broad-except
            pass       # the interpreter is shutting down


def _drop_dead_threads():
    """Drop the graphs of threads that ended (by the Thread object: a new
    thread may get an ended one's ident) and restore the thresholds when none
    is left."""
    if _holders:
        for k in [k for k, (_, t) in _holders.items() if not t.is_alive()]:
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
        _holders[id(graph)] = (graph, threading.current_thread())
    if getattr(_owned, "owner", None) is None:
        _owned.owner = _Owner(id(graph))


def restore(graph):
    """``graph`` is no longer pending (flushed, failed or emptied)."""
    with _lock:
        _holders.pop(id(graph), None)
        _drop_dead_threads()


def pending():
    """The graphs pending now, of every thread alive."""
    with _lock:
        _drop_dead_threads()
        return [g for g, _ in _holders.values()]


def deferred():
    """Whether the older generations are deferred now."""
    return _saved[0] is not None


_paused = [0, False]    # flushes running now, and whether the GC was on before the first


def pause():
    """A flush starts: no collection until every running flush has ended."""
    with _lock:
        if not _paused[0]:
            _paused[1] = gc.isenabled()
            gc.disable()
        _paused[0] += 1


def resume():
    """A flush has ended (``pause``)."""
    with _lock:
        _paused[0] -= 1
        if not _paused[0] and _paused[1]:
            gc.enable()
