"""Call sites: where in the user's code a node was recorded (for error messages).

Found by walking up from the current frame past frames of MXNet and jitbatch
(MXNet's generated operator wrappers are exec'd code, named ``<string>``: they
are recognised by their module globals), not at fixed depths, so they are right
whether or not jitbatch's modules are compiled. Kept as (code, offset) and
turned into ``file:line`` only when an error needs it."""
import dis
import sys
import traceback

from .. import config as _config

_SKIP = ("/mxnet/", "/jitbatch/gluon/", "/jitbatch/graph", "/contextlib")
_skip_file = {}
_skip_code = {}   # id(code) -> (code, skip?) for exec'd code (kept: the id stays its own)


def _skip(f):
    """True for a frame of MXNet or jitbatch (no user call site)."""
    fn = f.f_code.co_filename
    r = _skip_file.get(fn)
    if r is None:
        if fn == "<string>":   # MXNet's generated operator wrappers are exec'd code
            return _skip_exec(f)
        r = False
        for part in _SKIP:
            if part in fn:
                r = True
        _skip_file[fn] = r
    return r


def _skip_exec(f):
    """``_skip`` for exec'd code, judged by its module globals once per code
    object (every operator record passes MXNet's generated wrapper)."""
    code = f.f_code
    hit = _skip_code.get(id(code))
    if hit is not None and hit[0] is code:
        return hit[1]
    r = f.f_globals.get("__name__", "").startswith("mxnet")
    if len(_skip_code) > 4096:
        _skip_code.clear()
    _skip_code[id(code)] = (code, r)
    return r


def site():
    """The user call site of the running record (see ``site_of``)."""
    return site_of(sys._getframe(0))  # pylint: disable=protected-access


def site_of(f):
    """``file:line in function`` at frame ``f`` or the first frame above it outside
    MXNet and jitbatch, as a ``Site``; with ``config.debug``, the whole user
    stack as text."""
    if _config.debug:
        frames = []
        while f is not None:
            if not _skip(f):
                frames.append((f, f.f_lineno))
            f = f.f_back
        return "".join(traceback.format_list(traceback.StackSummary.extract(reversed(frames))))
    while f is not None and _skip(f):
        f = f.f_back
    if f is None:
        return "?"
    return Site(f.f_code, f.f_lasti)


class Site(object):
    """A call site: the code object and the offset of the call instruction in
    it, turned into a line number only when asked (``frame.f_lineno`` scans the
    code's line table on every record: ~0.2 us of a ~5 us record)."""
    __slots__ = ("code", "lasti")

    def __init__(self, code, lasti):
        self.code = code
        self.lasti = lasti

    @property
    def line(self):
        last = None
        for start, line in dis.findlinestarts(self.code):
            if start > self.lasti:
                break
            last = line
        return last if last is not None else self.code.co_firstlineno

    def __str__(self):
        return "%s:%d in %s" % (self.code.co_filename, self.line, self.code.co_name)

    __repr__ = __str__
