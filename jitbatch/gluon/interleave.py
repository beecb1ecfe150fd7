"""``jitbatch.map``: a minibatch's samples side by side, so a read waits for the others.

A per-sample program that reads a value (``int(x.argmax().asscalar())`` to
route a sample) runs its graph at every read, so in a plain loop only what
is pending at that moment merges. ``map(fn, items)`` runs ``fn(item)`` for
every item, each in a greenlet of its own (a coroutine on the caller's
thread), one at a time: a sample whose read needs a pending value parks
there and the next sample runs; when no sample can go on, one flush computes
what all of them wait for, and they go on in the order they parked. So each
read point costs one merged flush per minibatch, not one per sample. The
samples record into the caller's graph under the caller's autograd state,
default device and NumPy-interface state, each keeping its own changes of
them across its parks; their Python side effects interleave at reads. Being
the caller's thread, they draw random numbers from the caller's generator
(in another order than the loop)."""
import contextvars
from collections import deque

import greenlet
from mxnet import autograd
from mxnet.ndarray import NDArray

from .. import config, execute
from ..errors import BatchingError
from ..graph import current_graph
from . import _mxapi
from .modes import forget_mode

__all__ = ["map_samples", "in_sample", "keeping_others", "note_attached", "check_step"]


class _Aborted(BaseException):
    """Unwinds a parked sample after another sample failed (or the caller was
    interrupted): raised at its read, caught by its greenlet."""


class _Sample(greenlet.greenlet):
    """A greenlet running samples (``task``: the one it runs now): a sample
    that ends without others ready hands it to the next new sample, as a
    loop goes on to its next item (no switch, no new greenlet)."""

    def __init__(self, run, hub):
        super(_Sample, self).__init__(run.work, hub)
        self.task = None


class _Task(object):
    __slots__ = ("run", "index", "item", "result", "error", "glet", "state")

    def __init__(self, run, index, item):
        self.run, self.index, self.item = run, index, item
        self.result = self.error = self.glet = None
        self.state = None   # its autograd, device and NumPy states while it is parked


def _wait_for(nodes):
    """Wait for the launches that computed ``nodes``: only this flush's, not
    ``waitall``'s every pending operator of the process (other threads'
    launches, whose failures would be raised here too)."""
    seen = set()
    for n in nodes:
        outs = n.batch
        if outs is not None and id(outs) not in seen:
            seen.add(id(outs))
            for a in outs:
                if a is not None:
                    a.wait_to_read()


def _current():
    """The sample running now (None: not in a sample)."""
    return getattr(greenlet.getcurrent(), "task", None)


class _Run(object):
    """One ``map`` call: its samples, which can run (``ready``), which wait at a
    read (``parked``), and the caller's state each sample starts under."""

    def __init__(self, fn, items, graph):
        self.fn = fn
        self.graph = graph
        self.mode = _mxapi.autograd_state()
        self.device = _mxapi.default_device()
        self.np = _mxapi.np_state()
        self.context = contextvars.copy_context()     # the caller's context variables
        self.tasks = [_Task(self, i, x) for i, x in enumerate(items)]
        self.fresh = deque(self.tasks)   # not started yet
        self.ready = deque()             # started, can go on (parked before a flush)
        self.parked = []
        self.running = 0                 # started and not ended
        self.failed = []        # samples whose fn raised, in the order they raised
        self.aborted = False
        self.hub = None         # the caller's greenlet, which switches between samples
        self.current = None     # the sample running (the hub sets it at each switch)
        self.flush_error = None  # what the flush at a sample's read raised, if it did
        self.used = {}          # id -> (array with a gradient buffer, the samples using it)
        self.seen = []          # (concrete argument, sample) of recorded calls, not yet in used
        self.blocks = {}        # id -> (flagged block, the samples calling it)

    def go(self):
        """Run every sample; their results in order."""
        g = self.graph
        g.sharing = self
        # a window of eager calls ('auto' found nothing to merge in flushes of one
        # sample each) ends while the samples run side by side (see resume), and
        # the caller's own window and streak come back after: the map's flushes
        # say nothing of what the caller's loop merges
        window = g.passthrough, g.quiet
        g.passthrough = 0
        # and no pipelined chunk cuts the graph while they record (record._begin),
        # nor does the pipeline learn from its flushes
        g.limit = config.max_pending
        g.unpiped = True
        self.hub = greenlet.getcurrent()
        try:
            try:
                self.serve()
            except BaseException:
                # interrupted: the parked samples unwind, the unstarted ones never start
                self.aborted = True
                self.serve()
                raise
        finally:
            g.sharing = None
            g.passthrough, g.quiet = window
            self.adopt((self.mode, self.device, self.np))
        if self.failed:
            task = self.failed[0]
            err = task.error
            if err is self.flush_error:
                err.add_note("(in jitbatch.map: raised while running the calls of every sample "
                             "waiting at a read, at the read of item %d, %d items in all: the "
                             "failing call may be another item's (its call site is above); the "
                             "samples not finished then were stopped at their next read)"
                             % (task.index, len(self.tasks)))
            else:
                err.add_note("(in jitbatch.map: raised by the call of item %d, %d items in "
                             "all; the samples not finished then were stopped at their next "
                             "read)" % (task.index, len(self.tasks)))
            raise err
        return [t.result for t in self.tasks]

    def serve(self):
        """Switch to the next sample that can run until every sample ended."""
        while True:
            task = self.next()
            if task is None:
                return
            self.resume(task)

    @staticmethod
    def adopt(state):
        """Make ``state`` (autograd, device, NumPy) this thread's."""
        _mxapi.adopt_state(state[0], state[1])
        _mxapi.adopt_np(state[2])
        forget_mode()   # the graph's kept autograd state may be another sample's

    def resume(self, task):
        """Run ``task`` (its start or a resume) until it parks or its greenlet
        has no more samples to run."""
        self.graph.passthrough = 0
        try:
            if task.glet is None:
                glet = _Sample(self, self.hub)
                self.start(task, glet)
            else:
                self.adopt(task.state)
                self.current = task
                glet = task.glet
            glet.switch()
        finally:
            self.current = None

    def start(self, task, glet):
        """``task`` begins in greenlet ``glet`` under the caller's state."""
        self.running += 1
        task.glet = glet
        glet.task = task
        self.adopt((self.mode, self.device, self.np))
        self.current = task

    def can_start(self):
        """A sample not started yet may start now (fewer than the cap run)."""
        return bool(self.fresh) and not self.aborted and self.running < config.map_threads

    def next(self):
        """The next ready sample, else a new one; with neither, the last parked
        one (it runs the graph for all); with none parked either, None."""
        if self.ready:
            return self.ready.popleft()
        if self.can_start():
            return self.fresh.popleft()
        if self.parked:
            return self.parked.pop()
        return None

    def work(self):
        """A greenlet's life: run its sample, then the next new ones while no
        started sample is ready; it ends by switching to the hub."""
        glet = greenlet.getcurrent()
        while True:
            self.body(glet.task)
            glet.task = None
            if self.ready or not self.can_start():
                return
            self.start(self.fresh.popleft(), glet)

    def body(self, task):
        """Run one sample, in the caller's context variables (decimal's
        context, a request id), as the loop sees them; what it sets stays its own."""
        try:
            if self.aborted:
                raise _Aborted()
            task.result = self.context.copy().run(self.fn, *task.item)
        except _Aborted:
            pass
        except BaseException as e:   # pylint: disable=broad-except
            task.error = e
            self.failed.append(task)
            self.aborted = True
        self.running -= 1

    def wait(self, node):
        """A read of ``node`` (pending) in a sample: park while other samples
        can record; when none can, run the graph here for all the parked ones,
        which can go on after this one. Returns with ``node`` computed, or
        pending for the caller (``lazy.force``) to run its graph."""
        task = _current()
        if task is None or task.run is not self:
            return      # the caller itself, or a sample of another map
        while node.batch is None and (self.ready or self.can_start()):
            self.park(task, self.parked)
        if node.batch is None:
            self.run_here("read", forced=True)
            if self.ready:
                # the samples that parked before this one go on first, in the
                # order they parked, as the loop runs them: what they do at this
                # read point (a backward's gradient writes, reads of a buffer
                # they add to) happens in their order, this sample's last
                self.park(task, self.ready)

    def run_here(self, reason, forced=False):
        """Run the graph in this sample for every parked one, without parking
        (at a read; before a change that must end before another sample goes
        on, a deferred initialization). The parked samples go on next, in
        their order."""
        nodes = self.graph.nodes[:] if self.parked else ()
        try:
            execute.run_graph(self.graph, forced=forced, reason=reason)
            # every parked sample reads what this flush computes: an operator
            # failing as it runs (a take out of range) is raised here, the
            # flush's, not at one of their reads
            _wait_for(nodes)
        except BaseException as e:
            self.flush_error = e
            raise
        finally:
            self.ready.extend(self.parked)
            self.parked = []

    def park(self, task, queue):
        """Sample ``task`` waits in ``queue`` (parked or ready), its autograd,
        device and NumPy states kept, until the hub resumes it."""
        queue.append(task)
        task.state = (_mxapi.autograd_state(), _mxapi.default_device(), _mxapi.np_state())
        self.hub.switch()
        if self.aborted:
            raise _Aborted()

    def note(self, arr, task):
        """Sample ``task`` uses ``arr``, an array with a gradient buffer
        (attached in it, or read by a call it recorded: ``record.note_sample``)."""
        entry = self.used.get(id(arr))
        if entry is None or entry[0] is not arr:
            entry = self.used[id(arr)] = (arr, set())
        entry[1].add(task.index)

    def check_step(self, task, params):
        """A trainer's step in sample ``task`` over ``params``: refused where
        another sample called a block reading them. The samples run side by
        side, each recording before the others' steps, where the loop runs
        each sample after the steps of the ones before it."""
        ids = {id(a) for p in params for a in (p._data or ())}  # pylint: disable=protected-access
        for block, users in self.blocks.values():
            if users - {task.index} and any(id(a) in ids for p in block.collect_params().values()
                                            for a in (p._data or ())):  # pylint: disable=protected-access
                raise BatchingError(
                    "Trainer.step in a sample of jitbatch.map (item %d) updates parameters "
                    "of block %s, which other samples of the map call too: the samples run "
                    "side by side (each records its calls before the others' steps), where "
                    "the plain loop runs each sample after the steps of the ones before it, "
                    "so a step per sample would train other parameters. Fix: return the "
                    "losses from the samples and step once after map (e.g. "
                    "nd.add_n(*losses).backward(); trainer.step(n)), or run these samples "
                    "in a plain loop." % (task.index, block.name))

    def others(self, task):
        """Copies of the gradient buffers of the arrays that only other samples
        use: ``[(buffer, copy)]``."""
        for a, t in self.seen:
            if a.grad is not None:
                self.note(a, t)
        self.seen = []
        kept = []
        with autograd.pause():
            for arr, users in self.used.values():
                if task.index not in users:
                    g = arr.grad
                    if g is not None:
                        kept.append((g, g.copy()))
        return kept


def note_attached(arr):
    """``arr.attach_grad()`` ran (``guards.make_attach_grad``): inside a
    sample, the array is the sample's."""
    task = _current()
    if task is not None:
        task.run.note(arr, task)


def check_step(params):
    """``Trainer.step`` over ``params``: in a sample of ``jitbatch.map``,
    refused where other samples call a block reading them (``_Run.check_step``)."""
    task = _current()
    if task is not None:
        task.run.check_step(task, params)


def keeping_others(heads, backward):
    """``backward()`` from ``heads`` run in a sample, the other samples' input
    gradients kept. Their calls merged with this sample's into launches the
    backward passes through, so it writes a gradient (0: this sample's loss
    does not read them) into every input of those launches with a buffer:
    per sample, only this sample's are written. Inputs are told apart by the
    samples that attached them or passed them to a recorded call (``note``).
    The heads are computed first (the sample may park there, while the
    others run their own backwards), then the buffers copied."""
    task = _current()
    if task is None or not (task.run.used or task.run.seen):
        return backward()
    for h in heads:
        if isinstance(h, NDArray):
            h.wait_to_read()
    kept = task.run.others(task)
    try:
        return backward()
    finally:
        if kept:
            with autograd.pause():
                for g, copy in kept:
                    copy.copyto(g)


def in_sample():
    """Whether a sample of ``jitbatch.map`` runs now."""
    return _current() is not None


def map_samples(fn, *iterables):
    """``list(map(fn, *iterables))``, the samples side by side: ``fn(item)``
    runs for each item (``fn(a, b)`` for each pair of two iterables, up to the
    shortest, as the builtin ``map``), one sample at a time; a sample that reads a pending
    value (``.asscalar()``, ``.asnumpy()``, ``int(...)``) waits there until the
    other samples have recorded what they can, so one flush serves all of
    their reads. Results in the items' order; the first exception raised (in
    time) is raised, naming its item, and the other samples stop at their next
    read. Python side effects of ``fn`` interleave at reads. Inside a sample
    (a nested call) or with fewer than two items it is the plain loop."""
    if not iterables:
        raise TypeError("jitbatch.map(fn, items, ...) needs at least one iterable of items")
    items = list(zip(*iterables))     # each item: the arguments of one call
    g = current_graph()
    if len(items) < 2 or g.sharing is not None or in_sample():
        return [fn(*args) for args in items]
    return _Run(fn, items, g).go()
