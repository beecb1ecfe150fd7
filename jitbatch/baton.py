"""Batons: locks that threads hand to each other so that one of them runs at a time.

``jitbatch.map`` runs a minibatch's samples in threads, one at a time: a
sample that parks at a read wakes the next and waits on its own baton. With
``threading.Lock`` a hand-over wakes the other thread while this one still
holds the GIL, so the other wakes twice (for its lock, then for the GIL).
Compiled, :func:`hand` lets go of the GIL first (``baton.pxd``), and the
woken thread finds it free. From source, a baton is a ``threading.Lock``."""
import threading

try:
    import cython   # compiled: the hand-over is C (baton.pxd)
except ImportError:  # pragma: no cover - running from source without Cython
    from . import _nocython as cython

__all__ = ["new", "hand"]


def new():
    """A baton, held: a thread that waits on it blocks until another hands it over."""
    if cython.compiled:
        return jb_baton_new()  # noqa: F821  (baton.pxd)
    lock = threading.Lock()
    lock.acquire()
    return lock


def hand(give, wait):
    """Wake the thread waiting on baton ``give`` (None: none), then wait on
    baton ``wait`` (None: return at once). Each wait takes one hand-over:
    a baton handed to no waiter is taken by its next wait."""
    if cython.compiled:
        jb_baton_hand(give, wait)  # noqa: F821  (baton.pxd)
        return
    if give is not None:
        give.release()
    if wait is not None:
        wait.acquire()
