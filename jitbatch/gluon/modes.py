"""The autograd mode of a record: MXNet's (recording, training) state, kept per graph.

Asked of MXNet once and then kept on the thread's graph until one of MXNet's
autograd setters runs: ``patch`` wraps them (``drops_mode``) so that each bumps
one global generation count, and a graph's kept state is valid while its
generation is current, so a setter in any thread makes every thread ask
again (read on every record: a per-thread ``threading.local`` lookup cost more
than the C calls it saved)."""
from functools import wraps

from ..graph import Graph
from . import _mxapi

_MODE_GEN = 0   # bumped by every autograd-state setter: kept states older are stale


def mode(g):
    """``(autograd.is_recording(), autograd.is_training())`` of this thread,
    whose graph is ``g``."""
    gr: Graph = g
    if gr.autograd_gen == _MODE_GEN:
        return gr.autograd
    m = gr.autograd = _mxapi.autograd_state()
    gr.autograd_gen = _MODE_GEN
    return m


def forget_mode():
    """Drop the kept autograd states (read again at the next record)."""
    global _MODE_GEN
    _MODE_GEN += 1


def drops_mode(setter):
    """Wrap an MXNet autograd-state setter so the states are asked again after it."""
    @wraps(setter)
    def wrapper(*args, **kwargs):
        try:
            return setter(*args, **kwargs)
        finally:
            forget_mode()
    return wrapper
