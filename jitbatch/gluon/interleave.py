"""``jitbatch.map``: a minibatch's samples side by side, so a read waits for the others.

A per-sample program that reads a value (``int(x.argmax().asscalar())`` to
route a sample) runs its graph at every read, so in a plain loop only what
is pending at that moment merges. ``map(fn, items)`` runs ``fn(item)`` for
every item, each in a thread of its own but one at a time (a baton passed
between them): a sample whose read needs a pending value parks there and the
next sample runs; when no sample can go on, one flush computes what all of
them wait for, and they go on in the order they parked. So each read point
costs one merged flush per minibatch, not one per sample. The samples record
into the caller's graph (``graph.share``) under the caller's autograd state,
default device and NumPy-interface state; their Python side effects interleave at reads, as
threads' do. MXNet keeps one random generator per thread, each new one starting from
the same state: what draws from it in a sample (an operator in ``DRAWS``, a deferred
initializer) runs in the caller's thread (``in_caller``), so the draws come from the
caller's generator, as in the loop (in another order). A flush at a sample's read runs
in that sample's thread: its merged launches draw from that thread's generator."""
import os
import threading
from collections import deque

from .. import baton, config, execute
from ..graph import current_graph, recorder, share
from . import _mxapi
from .modes import forget_mode

__all__ = ["map_samples", "in_sample", "as_caller", "DRAWS"]


class _Here(threading.local):
    task = None     # the sample this worker thread runs (None: not a worker)


_here = _Here()
_IDLE = []                   # workers waiting for a sample (list.pop/append: atomic)
# a forked child has none of the parent's worker threads (a map there handed
# its first sample to one and hung)
os.register_at_fork(after_in_child=_IDLE.clear)


class _Aborted(BaseException):
    """Unwinds a parked sample after another sample failed (or the caller was
    interrupted): raised at its read, caught by its worker."""


class _Worker(threading.Thread):
    """A pool thread: runs one sample at a time, as long as the process lives."""

    def __init__(self):
        super(_Worker, self).__init__(name="jitbatch-map", daemon=True)
        self.baton = baton.new()   # handed to this thread to let it run
        self.task = None

    def run(self):
        give = None
        while True:
            baton.hand(give, self.baton)
            task = self.task
            give = task.run.body(task)


class _Task(object):
    __slots__ = ("run", "index", "item", "result", "error", "worker")

    def __init__(self, run, index, item):
        self.run, self.index, self.item = run, index, item
        self.result = self.error = self.worker = None


#: handles of the operators that draw random numbers (``patch.install`` fills it)
DRAWS = set()


class _Run(object):
    """One ``map`` call: its samples, which can run (``ready``), which wait at a
    read (``parked``), and the caller's state each sample runs under."""

    def __init__(self, fn, items, graph):
        self.fn = fn
        self.graph = graph
        self.owner = recorder()
        self.mode = _mxapi.autograd_state()
        self.device = _mxapi.default_device()
        self.np = _mxapi.np_state()
        self.tasks = [_Task(self, i, x) for i, x in enumerate(items)]
        self.fresh = deque(self.tasks)   # not started yet
        self.ready = deque()             # started, can go on (parked before a flush)
        self.parked = []
        self.running = 0                 # started and not ended (each holds a thread)
        self.failed = []        # samples whose fn raised, in the order they raised
        self.aborted = False
        self.caller = threading.Lock()
        self.caller.acquire()
        self.request = None     # (fn, task, [result, error]): for the caller's thread to run

    def go(self):
        """Run every sample (the caller's thread waits); their results in order."""
        g = self.graph
        g.sharing = self
        # a window of eager calls ('auto' found nothing to merge in flushes of one
        # sample each) ends while the samples run side by side (see wake), and
        # the caller's own window and streak come back after: the map's flushes
        # say nothing of what the caller's loop merges
        window = g.passthrough, g.quiet
        g.passthrough = 0
        # and no pipelined chunk cuts the graph while they record (record._begin),
        # nor does the pipeline learn from its flushes
        g.limit = config.max_pending
        g.unpiped = True
        try:
            baton.hand(self.wake(self.fresh.popleft()), None)
            try:
                self.serve()
            except BaseException:
                # interrupted: the running sample goes on to its next read or its
                # end, the parked ones unwind, the unstarted ones never start
                self.aborted = True
                self.serve()
                raise
        finally:
            g.sharing = None
            g.passthrough, g.quiet = window
        if self.failed:
            task = self.failed[0]
            err = task.error
            err.add_note("(in jitbatch.map: raised by the call of item %d, %d items in all; the "
                         "samples not finished then were stopped at their next read)"
                         % (task.index, len(self.tasks)))
            raise err
        return [t.result for t in self.tasks]

    def serve(self):
        """The caller's wait for the samples to end, running what a sample asks
        to run in this thread meanwhile (``in_caller``)."""
        while True:
            self.caller.acquire()
            req = self.request
            if req is None:
                return
            self.request = None
            fn, task, out = req
            try:
                out[0] = fn()
            except BaseException as e:  # pylint: disable=broad-except
                out[1] = e
            baton.hand(task.worker.baton, None)

    def in_caller(self, fn):
        """``fn()`` run in the caller's thread while this sample waits, what a
        plain loop runs there (a deferred initializer draws from the caller's
        random generator); its result, or its exception raised here."""
        task = _here.task
        out = [None, None]
        self.request = (fn, task, out)
        self.caller.release()
        baton.hand(None, task.worker.baton)
        if out[1] is not None:
            raise out[1]
        return out[0]

    def wake(self, task):
        """The baton to hand to let ``task`` run (its first start or a resume)."""
        forget_mode()   # the graph's kept autograd state was read in another thread
        self.graph.passthrough = 0
        w = task.worker
        if w is None:
            self.running += 1
            try:
                w = _IDLE.pop()
            except IndexError:
                w = _Worker()
                w.start()
            task.worker = w
            w.task = task
        return w.baton

    def can_start(self):
        """A sample not started yet may start now (a thread is free for it)."""
        return bool(self.fresh) and not self.aborted and self.running < config.map_threads

    def next(self):
        """The baton holder parks or ends: the baton of the next ready sample,
        else of a new one; with neither, of the last parked one (it runs the
        graph for all); with none parked either, None, and the caller returns."""
        if self.ready:
            return self.wake(self.ready.popleft())
        if self.can_start():
            return self.wake(self.fresh.popleft())
        if self.parked:
            return self.wake(self.parked.pop())
        self.caller.release()
        return None

    def body(self, task):
        """Run one sample (in its worker's thread); the baton to hand on."""
        share(self.graph, self.owner)
        _here.task = task
        try:
            if self.aborted:
                raise _Aborted()
            _mxapi.adopt_state(self.mode, self.device)
            _mxapi.adopt_np(self.np)
            task.result = self.fn(*task.item)
        except _Aborted:
            pass
        except BaseException as e:   # pylint: disable=broad-except
            task.error = e
            self.failed.append(task)
            self.aborted = True
        finally:
            _here.task = None
            share(None, None)
        w = task.worker
        w.task = None
        self.running -= 1
        _IDLE.append(w)
        return self.next()

    def wait(self, node):
        """A read of ``node`` (pending) in a sample: park while other samples
        can record; when none can, run the graph here for all the parked ones,
        which can go on after this one. Returns with ``node`` computed, or
        pending for the caller (``lazy.force``) to run its graph."""
        task = _here.task
        if task is None or task.run is not self:
            return      # the caller's own thread, or a thread of another map
        while node.batch is None and (self.ready or self.can_start()):
            self.parked.append(task)
            baton.hand(self.next(), task.worker.baton)
            if self.aborted:
                raise _Aborted()
        if node.batch is None:
            try:
                execute.run_graph(self.graph, forced=True, reason="read")
            finally:
                self.ready.extend(self.parked)
                self.parked = []


def in_sample():
    """Whether this thread runs a sample of ``jitbatch.map``."""
    return _here.task is not None


def as_caller(fn):
    """``fn()``, in a sample of ``jitbatch.map`` run in the caller's thread."""
    task = _here.task
    if task is None:
        return fn()
    return task.run.in_caller(fn)


def map_samples(fn, *iterables):
    """``list(map(fn, *iterables))``, the samples side by side: ``fn(item)``
    runs for each item (``fn(a, b)`` for each pair of two iterables, up to the
    shortest, as the builtin ``map``), one sample at a time; a sample that reads a pending
    value (``.asscalar()``, ``.asnumpy()``, ``int(...)``) waits there until the
    other samples have recorded what they can, so one flush serves all of
    their reads. Results in the items' order; the first exception raised (in
    time) is raised, naming its item, and the other samples stop at their next
    read. Python side effects of ``fn`` interleave at reads, as threads' do.
    Inside a sample (a nested call) or with fewer than two items it is the
    plain loop."""
    if not iterables:
        raise TypeError("jitbatch.map(fn, items, ...) needs at least one iterable of items")
    items = list(zip(*iterables))     # each item: the arguments of one call
    g = current_graph()
    if len(items) < 2 or g.sharing is not None or _here.task is not None:
        return [fn(*args) for args in items]
    return _Run(fn, items, g).go()
