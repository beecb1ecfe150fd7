"""Which arrays are parameters of flagged blocks.

Merged launches read parameters when they run, so a write to one while calls
are pending runs them first (``writes.before_write``), and an operator given
a parameter's ``data()`` as its weight passes it once to a merged launch
(``record._shared``). The Parameters of flagged blocks are watched from the
first ``hybridize(dynamic_batch=True)`` or block signature on, initialized or
not; their arrays are noted whenever MXNet makes new ones (``initialize``,
deferred initialization, ``force_reinit``, ``reset_ctx``, ``cast``: ``renote``)."""
import functools
import weakref

#: id of a noted parameter array -> a weak reference to its Parameter
PARAM_ARRAYS = {}
#: the Parameters of flagged blocks (their arrays are noted when made)
WATCHED = weakref.WeakSet()


def watch_params(block):
    """Watch ``block``'s Parameters and note their arrays made so far."""
    for p in block.collect_params().values():
        WATCHED.add(p)
        renote(p)


def renote(p):
    """Note the arrays Parameter ``p`` holds now, if it is watched."""
    data = p._data  # pylint: disable=protected-access
    if data and p in WATCHED:
        ref = weakref.ref(p)
        for arr in data:
            PARAM_ARRAYS[id(arr)] = ref


def is_param(arr):
    """Whether ``arr`` is a noted array a watched Parameter holds now."""
    ref = PARAM_ARRAYS.get(id(arr))
    if ref is None:
        return False
    p = ref()
    return p is not None and any(a is arr for a in (p._data or ()))  # pylint: disable=protected-access


def forget():
    """Drop every note (``uninstall``)."""
    PARAM_ARRAYS.clear()
    WATCHED.clear()


def noting(orig):
    """``Parameter._init_impl`` (initialization, deferred or forced, and
    ``reset_ctx``) and ``Parameter.cast``, which give a Parameter new arrays:
    noted once made, if it is watched."""
    @functools.wraps(orig)
    def made(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        renote(self)
        return out
    return made
